"""Loading block-wise FP8 checkpoints (Qwen3-*-FP8, DeepSeek-V3) on TorchTPU or CPU with the experts kept quantized.

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


def from_pretrained_fp8(model_class, path, **kwargs):
    """``model_class.from_pretrained(path, **kwargs)`` for a block-wise FP8 checkpoint, experts kept in e4m3
    (``FP8Experts``; select ``experts_implementation="tokamax_ragged_dot"`` after ``pallas_hub.load``), other
    FP8 linears dequantized to the model dtype. Needs no accelerate and no GPU."""
    with keep_fp8_quantized():
        model = model_class.from_pretrained(path, **kwargs)
    dequantize_fp8_linears(model)
    return model
