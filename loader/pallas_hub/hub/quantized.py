"""Loading quantized checkpoints on TorchTPU or CPU with the experts kept quantized: block-wise FP8 (Qwen3-*-FP8,
DeepSeek-V3; ``from_pretrained_fp8``) and GPT-OSS's MXFP4 (``from_pretrained_mxfp4``, see its docstring).

transformers 5.24's FP8 quantizer (``FineGrainedFP8HfQuantizer.validate_environment``) needs accelerate and, on a
host without CUDA or XPU (TorchTPU's device is ``tpu``), turns a pre-quantized checkpoint into a bf16 model: the
experts, which are most of an MoE's bytes, would then stream bf16 from HBM. ``from_pretrained_fp8`` loads through
a subclass of that quantizer whose only change is to skip those environment checks, so transformers' own
conversion runs: ``*.experts`` become ``FP8Experts`` holding the checkpoint's e4m3 bytes and fp32 ``*_scale_inv``
as stored (gate and up concatenated), which our ``tokamax_ragged_dot`` registration in
``ALL_FP8_EXPERTS_FUNCTIONS`` runs. Nothing else is patched: the quantizer is swapped into
``AUTO_QUANTIZER_MAPPING`` for the duration of the call only (``register_quantizer`` refuses an existing name).

The other FP8 layers (attention, dense and shared-expert MLPs: ``FP8Linear``) have no registry; their forward
calls the CUDA/XPU Triton kernel. ``from_pretrained_fp8`` dequantizes them after loading (``w * scale_inv`` in
f32, rounded once to the model dtype, as transformers' dequantizing load does), and ``FP8Linear.forward`` then
takes its plain ``F.linear`` path. They are a few percent of an MoE's weights (Qwen3-30B-A3B: ~5%).
"""

from __future__ import annotations

import contextlib


def _keep_fp8_quantizer():
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    class KeepFp8Quantizer(FineGrainedFP8HfQuantizer):
        """transformers' FP8 quantizer without its environment checks (accelerate, CUDA/XPU), which only
        decide to dequantize: pre-quantized weights stay e4m3."""

        def validate_environment(self, *args, **kwargs):
            if not self.pre_quantized:
                raise ValueError("from_pretrained_fp8 loads pre-quantized FP8 checkpoints; quantizing a bf16 "
                                 "model on the fly is not supported on this host")

    return KeepFp8Quantizer


@contextlib.contextmanager
def keep_fp8_quantized():
    """Within the block, ``from_pretrained`` of an FP8 checkpoint (``quant_method: "fp8"``) keeps it quantized."""
    from unittest import mock

    with mock.patch.dict("transformers.quantizers.auto.AUTO_QUANTIZER_MAPPING", {"fp8": _keep_fp8_quantizer()}):
        yield


def dequantize_fp8(weight, scale_inv, block_size, dtype):
    """e4m3 ``weight [..., N, K]`` times its ``scale_inv [..., ceil(N/b0), ceil(K/b1)]`` (edge blocks partial)
    in f32, rounded once to ``dtype``."""
    n, k = weight.shape[-2:]
    b0, b1 = block_size
    s = scale_inv.float().repeat_interleave(b0, dim=-2)[..., :n, :].repeat_interleave(b1, dim=-1)[..., :k]
    return (weight.float() * s).to(dtype)


def dequantize_fp8_linears(model, dtype=None) -> int:
    """Replace every ``FP8Linear``'s e4m3 weight by its dequantized value (``dtype``: the model's); returns how
    many. Experts (``FP8Experts``) are left quantized."""
    import torch
    from transformers.integrations.finegrained_fp8 import FP8Linear

    dtype = dtype or model.dtype
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear) and module.weight.element_size() == 1:
            if module.block_size is None or module.weight.dtype != torch.float8_e4m3fn:
                raise NotImplementedError(f"{name}: FP8Linear with block_size={module.block_size} and weight dtype "
                                          f"{module.weight.dtype}; block-wise float8_e4m3fn is supported")
            w = dequantize_fp8(module.weight.data, module.weight_scale_inv.data, module.block_size, dtype)
            module.weight = torch.nn.Parameter(w, requires_grad=False)
            count += 1
    return count


def refuse_fp8_nan_codes(model) -> None:
    """Raise, naming the tensor, if an expert weight kept in e4m3 holds a NaN code (0x7f / 0xff): the kernel
    reads them as +-480 on v5e and v6e (its e4m3b11fnuz unpack; see ``_e4m3_times``). Quantizers saturate at
    +-448, so a checkpoint with NaN weights is corrupt. One pass at load, an expert at a time."""
    import torch

    for name, p in model.named_parameters():
        if p.dtype == torch.float8_e4m3fn and ".experts." in f".{name}":
            bad = sum(int(((w.view(torch.uint8) & 0x7F) == 0x7F).sum()) for w in p.data.reshape(-1, *p.shape[-2:]))
            if bad:
                raise ValueError(f"{name} holds {bad} float8_e4m3fn NaN codes (0x7f / 0xff): the checkpoint is "
                                 "corrupt (quantizers saturate at +-448), and ragged-dot-tpu does not take NaN weights")


def from_pretrained_fp8(model_class, path, **kwargs):
    """``model_class.from_pretrained(path, **kwargs)`` for a block-wise FP8 checkpoint, experts kept in e4m3
    (``FP8Experts``; select ``experts_implementation="tokamax_ragged_dot"`` after ``pallas_hub.load``), other
    FP8 linears dequantized to the model dtype. Needs no accelerate and no GPU. Refuses expert weights that
    hold NaN codes (``refuse_fp8_nan_codes``)."""
    with keep_fp8_quantized():
        model = model_class.from_pretrained(path, **kwargs)
    refuse_fp8_nan_codes(model)
    dequantize_fp8_linears(model)
    return model


# --------------------------------------------------------------------------- MXFP4 (GPT-OSS)

MXFP4_SCALE_ROW_MULTIPLE = 32  # scale rows padded to a multiple of the uint8 sublane tile


def mxfp4_scale_rows(inp: int) -> int:
    """Rows of the stored [E, rows, out] e8m0 scales of an MXFP4 weight with ``inp`` inputs (in/32, padded)."""
    return -(-inp // 32 // MXFP4_SCALE_ROW_MULTIPLE) * MXFP4_SCALE_ROW_MULTIPLE


def mxfp4_kernel_layout(blocks, scales):
    """The checkpoint's MXFP4 weight, blocks [E, out, in/32, 16] (or [E, out, in/2]) and scales [E, out, in/32]
    (torch tensors), in the layout the ragged-dot kernel reads: blocks [E, in/2, out] and scales
    [E, mxfp4_scale_rows(in), out] (padding rows 127, unused), contiguous. XLA:TPU lays out the checkpoint's
    [E, out, in/2] with ``in/2`` major when ``in/2`` is off the 128-lane grid (GPT-OSS: 1440) and its
    [E, out, in/32] scales with ``in/32`` outermost; the kernel needs row-major operands, so each call would copy
    both. These shapes are row-major as stored (checked for GPT-OSS-20B on v5e, v6e, TPU7x), so no call copies."""
    import torch

    e, out = scales.shape[:2]
    pad = mxfp4_scale_rows(scales.shape[2] * 32) - scales.shape[2]
    return (blocks.reshape(e, out, -1).transpose(1, 2).contiguous(),
            torch.nn.functional.pad(scales.transpose(1, 2), (0, 0, 0, pad), value=127).contiguous())


def _packed_mxfp4_experts_class():
    """GPT-OSS experts holding the checkpoint's MXFP4 tensors as stored (parameter names = checkpoint keys,
    so they load 1:1): ``*_blocks`` uint8 [E, out, in/32, 16] (two e2m1 values per byte, low nibble first),
    ``*_scales`` uint8 e8m0 [E, out, in/32], and the biases. After loading, ``to_kernel_layout`` replaces the
    blocks and scales by ``gate_up_proj`` / ``down_proj`` uint8 [E, in/2, out] and ``*_scales`` [E, in/32 padded,
    out] (``mxfp4_kernel_layout``; ``is_transposed``). transformers' ``Mxfp4GptOssExperts`` holds the checkpoint's
    tensors but is not dispatched through ``ALL_EXPERTS_FUNCTIONS`` (its forward is the CUDA Triton kernel); this
    class is, so ``experts_implementation="tokamax_ragged_dot"`` runs it."""
    import torch
    from transformers.integrations.moe import use_experts_implementation
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    @use_experts_implementation(is_concatenated=False, is_transposed=False, has_bias=True)
    class PackedMxfp4GptOssExperts(torch.nn.Module):
        _apply_gate = GptOssExperts._apply_gate  # GPT-OSS's clamped swiglu on interleaved gate/up

        def __init__(self, config):
            super().__init__()
            e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
            if h % 32 or i % 32:
                raise ValueError(f"MXFP4 experts need hidden_size and intermediate_size divisible by 32, got {h}, {i}")
            self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
            u8 = lambda *shape: torch.nn.Parameter(torch.zeros(*shape, dtype=torch.uint8), requires_grad=False)  # noqa: E731
            self.gate_up_proj_blocks, self.gate_up_proj_scales = u8(e, 2 * i, h // 32, 16), u8(e, 2 * i, h // 32)
            self.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(e, 2 * i))
            self.down_proj_blocks, self.down_proj_scales = u8(e, h, i // 32, 16), u8(e, h, i // 32)
            self.down_proj_bias = torch.nn.Parameter(torch.zeros(e, h))
            self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit

        def to_kernel_layout(self):
            """Once, after loading: the checkpoint's blocks and scales -> the kernel's layout (see the class)."""
            for name in ("gate_up_proj", "down_proj"):
                blocks, scales = mxfp4_kernel_layout(getattr(self, name + "_blocks"), getattr(self, name + "_scales"))
                delattr(self, name + "_blocks")
                setattr(self, name, torch.nn.Parameter(blocks, requires_grad=False))
                setattr(self, name + "_scales", torch.nn.Parameter(scales, requires_grad=False))
            self.is_transposed = True

        def forward(self, hidden_states, top_k_index, top_k_weights):  # "eager": there is none for packed weights
            raise NotImplementedError("PackedMxfp4GptOssExperts runs through an experts_implementation that reads "
                                      "MXFP4 blocks (e.g. 'tokamax_ragged_dot')")

    return PackedMxfp4GptOssExperts


def _keep_mxfp4_quantizer():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    packed = _packed_mxfp4_experts_class()

    class KeepMxfp4Quantizer(Mxfp4HfQuantizer):
        """transformers' MXFP4 quantizer keeping the checkpoint's blocks and scales: no environment checks (they only
        decide to dequantize, or to fetch CUDA's Triton kernels), GPT-OSS's experts swapped for
        PackedMxfp4GptOssExperts before loading, and no conversion (the keys are the parameters' names)."""

        def validate_environment(self, *args, **kwargs):
            if not self.pre_quantized:
                raise ValueError("from_pretrained_mxfp4 loads pre-quantized MXFP4 checkpoints; quantizing on the "
                                 "fly is not supported on this host")
            self.quantization_config.dequantize = False

        def _process_model_before_weight_loading(self, model, **kwargs):
            import torch

            self.modules_to_not_convert = self.get_modules_to_not_convert(
                model, self.quantization_config.modules_to_not_convert, model._keep_in_fp32_modules)
            for name, module in list(model.named_modules()):
                if isinstance(module, GptOssExperts) and should_convert_module(name, self.modules_to_not_convert):
                    with torch.device("meta"):
                        model.set_submodule(name, packed(model.config))

        def param_needs_quantization(self, *args, **kwargs):
            return False

        def get_load_operations(self):
            return {}

        def _process_model_after_weight_loading(self, model, **kwargs):
            for module in model.modules():
                if isinstance(module, packed):
                    module.to_kernel_layout()
            return model

    return KeepMxfp4Quantizer


def from_pretrained_mxfp4(model_class, path, **kwargs):
    """``model_class.from_pretrained(path, **kwargs)`` for an MXFP4 GPT-OSS checkpoint with the experts' blocks and
    scales kept quantized (``PackedMxfp4GptOssExperts``, in the kernel's layout: ``mxfp4_kernel_layout``; select
    ``experts_implementation="tokamax_ragged_dot"``).
    transformers 5.24 otherwise dequantizes them on any host without CUDA/XPU Triton kernels (and needs
    accelerate). Needs no accelerate and no GPU."""
    from unittest import mock

    with mock.patch.dict("transformers.quantizers.auto.AUTO_QUANTIZER_MAPPING", {"mxfp4": _keep_mxfp4_quantizer()}):
        return model_class.from_pretrained(path, **kwargs)
