"""Layers for the kernels library's ``kernelize`` (what transformers' ``use_kernels=True`` runs).

A class here replaces the forward of the transformers layer decorated with
``use_kernel_forward_from_hub("<class name>")``: kernels loads it as ``kernel.layers.<name>`` and checks
that it keeps that forward's signature and adds no state (no ``__init__``, no members but
``can_torch_compile`` and ``has_backward``); its forward runs with the original layer's parameters.

* ``MegaBlocksMoeMLP``: GPT-OSS's MoE block (``GptOssMLP``): its router, then its experts in one ragged-dot op.

(MoE experts of every other family are reached through ``experts_implementation``: transformers accepts
only registered names there, which ``pallas_hub.load`` or ``ALL_EXPERTS_FUNCTIONS.register`` provide.)
"""

import torch

from .experts import experts_forward


class MegaBlocksMoeMLP(torch.nn.Module):
    """GPT-OSS's ``GptOssMLP.forward``: route, then ``experts_forward`` on ``self.experts``; returns
    (hidden_states, router_scores) as the original does."""

    can_torch_compile = False  # experts_forward checks expert ids on the host (CPU): a graph break
    has_backward = False  # the experts op has no backward

    def forward(self, hidden_states):
        batch, seq, hidden = hidden_states.shape
        flat = hidden_states.reshape(-1, hidden)
        _, router_scores, router_indices = self.router(flat)
        out = experts_forward(self.experts, flat, router_indices, router_scores)
        return out.reshape(batch, seq, hidden), router_scores
