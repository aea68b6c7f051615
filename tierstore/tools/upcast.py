"""Compute in fp32 what is stored in bf16 or fp16: for CPUs whose half-precision matrix products are slow.

On a CPU without bf16 matrix instructions (AVX2 only, say) torch's bf16 matrix product is hundreds of times slower
than its fp32 one (measured on one such machine: 0.29 against 94 GFLOPS at 2048 x 2048). A model kept in bf16 to
halve its bytes on the drive and in memory can still compute in fp32: :func:`compute_in_fp32` makes each
``nn.Linear``, ``nn.LayerNorm`` and ``nn.Embedding`` whose weight is bf16/fp16 cast that weight (and its input) to fp32 in its
forward (LayerNorm too). The gradient flows back through the cast and reaches the weight in its own dtype, as under autocast.
Call it before ``offload_model``: the offloaded forward then runs the patched one.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

_HALF = (torch.bfloat16, torch.float16)


class _LinearInFp32(torch.autograd.Function):
    """``F.linear`` of fp32 copies of its input, weight and bias, keeping for backward the weight itself, not its
    fp32 copy: autograd would otherwise hold every layer's fp32 copy from forward to backward (4 bytes a parameter
    of the whole model at once; an offloaded weight is kept as a view the offload rebuilds from the store). The
    backward runs the products torch's own linear backward runs, in fp32, each gradient returned in its input's
    dtype."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)  # type: ignore[attr-defined]
        ctx.has_bias = bias is not None  # type: ignore[attr-defined]
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        need = ctx.needs_input_grad  # type: ignore[attr-defined]
        grad = grad.float()
        grad_x = grad.matmul(weight.float()).to(x.dtype) if need[0] else None
        flat = grad.reshape(-1, grad.shape[-1])
        grad_w = flat.t().mm(x.reshape(-1, x.shape[-1]).float()).to(weight.dtype) if need[1] else None
        grad_b = flat.sum(0) if ctx.has_bias and need[2] else None  # type: ignore[attr-defined]
        return grad_x, grad_w, grad_b


def _linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = _LinearInFp32.apply(x, self.weight, self.bias)
    return out


def _embedding(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, self.weight.float(), self.padding_idx, self.max_norm, self.norm_type,
                       self.scale_grad_by_freq, self.sparse)


def _layer_norm(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    weight = None if self.weight is None else self.weight.float()
    bias = None if self.bias is None else self.bias.float()
    return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps)


def compute_in_fp32(model: nn.Module) -> int:
    """Make every Linear, LayerNorm and Embedding of ``model`` with a bf16/fp16 weight compute in fp32; returns
    how many. Other modules compute as they are; where their parameters meet fp32 activations, torch's type
    promotion computes in fp32 (a bf16 parameter added to an fp32 tensor gives fp32)."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.dtype in _HALF:
            m.forward = types.MethodType(_linear, m)
            n += 1
        elif type(m) is nn.LayerNorm and m.weight is not None and m.weight.dtype in _HALF:
            m.forward = types.MethodType(_layer_norm, m)
            n += 1
        elif type(m) is nn.Embedding and m.weight.dtype in _HALF:
            if m.max_norm is not None:  # renormalizes the weight in place: the cast copy would be renormalized
                raise ValueError("compute_in_fp32 cannot patch an Embedding with max_norm (it writes its weight)")
            m.forward = types.MethodType(_embedding, m)
            n += 1
    return n


__all__ = ["compute_in_fp32"]
