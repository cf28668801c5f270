"""ragged-dot-tpu: a Pallas TPU grouped matmul (jax.lax.ragged_dot semantics) for Mixture-of-Experts.

* ``ragged_dot(lhs, rhs, group_sizes, rhs_transposed=False, out_dtype="", tile_m=0, tile_n=0)``:
  a torch op (autograd: d lhs and d rhs), the JAX function is ``pallas.ragged_dot``.
* ``experts_forward``: transformers' experts contract in one op; register it with
  ``ALL_EXPERTS_FUNCTIONS.register("tokamax_ragged_dot", experts_forward)``.
* ``layers.MegaBlocksMoeMLP``: GPT-OSS's MoE block for kernels' ``kernelize`` / transformers' ``use_kernels``.
"""

import torch

from . import experts, layers, pallas  # layers: kernelize's kernel.layers.<Name> (see layers.py)
from ._bridge import jax_op
from ._ops import add_op_namespace_prefix
from .experts import experts_forward, experts_op  # noqa: F401


def _fake(lhs, rhs, group_sizes, rhs_transposed=False, out_dtype="", tile_m=0, tile_n=0):
    n = rhs.shape[1] if rhs_transposed else rhs.shape[2]
    return lhs.new_empty((lhs.shape[0], n), dtype=getattr(torch, out_dtype) if out_dtype else lhs.dtype)


ragged_dot = jax_op(add_op_namespace_prefix("ragged_dot"), pallas.ragged_dot, fake=_fake, validate=pallas.validate)

_backward_op = jax_op(
    add_op_namespace_prefix("ragged_dot_backward"), pallas.ragged_dot_backward,
    fake=lambda lhs, rhs, group_sizes, dout, rhs_transposed=False: (torch.empty_like(lhs), torch.empty_like(rhs)),
    returns=tuple[torch.Tensor, torch.Tensor],
)


def _setup_context(ctx, inputs, output):
    lhs, rhs, group_sizes, rhs_transposed = inputs[:4]
    ctx.save_for_backward(lhs, rhs, group_sizes)
    ctx.rhs_transposed = rhs_transposed


def _backward(ctx, dout):
    lhs, rhs, group_sizes = ctx.saved_tensors
    dlhs, drhs = _backward_op(lhs, rhs, group_sizes, dout.contiguous(), ctx.rhs_transposed)
    return dlhs, drhs, None, None, None, None, None


ragged_dot.register_autograd(_backward, setup_context=_setup_context)

REGISTRATIONS = [{"registry": "experts", "name": "tokamax_ragged_dot", "function": "experts_forward"}]
__all__ = ["ragged_dot", "experts_forward", "experts", "layers", "pallas", "REGISTRATIONS"]
