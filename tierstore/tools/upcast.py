"""Compute in fp32 what is stored in bf16 or fp16: for CPUs whose half-precision matrix products are slow.

On a CPU without bf16 matrix instructions (AVX2 only, say) torch's bf16 matrix product is hundreds of times slower
than its fp32 one (measured on one such machine: 0.29 against 94 GFLOPS at 2048 x 2048). A model kept in bf16 to
halve its bytes on the drive and in memory can still compute in fp32: :func:`compute_in_fp32` makes each
``nn.Linear``, ``nn.LayerNorm`` and ``nn.Embedding`` whose weight is bf16/fp16 compute in fp32 from the values of
that weight (a Linear converts it a block of rows at a time, an Embedding only the rows it looks up) and return fp32
outputs; the weight's gradient is summed in fp32 and reaches the weight in its own dtype, as under autocast.
Call it before ``offload_model``: the offloaded forward then runs the patched one.
"""

from __future__ import annotations

import threading
import time
import types

import torch
import torch.nn.functional as F
from torch import nn
from tierstore import TierValueError

_HALF = (torch.bfloat16, torch.float16)


# [Note: Products of half weights in fp32] Casting a whole bf16 weight to fp32 (``weight.float()``) allocates a new
# tensor of 4 bytes a parameter each time; one that large comes fresh from the operating system, which faults in and
# zeroes every page: on one CPU (AVX2, 2 cores) a 10240 x 2560 weight's cast took 53 ms, against 8 ms copying the same
# values into a tensor already in memory, and the weight's gradient, made whole in fp32 before its cast to bf16, was
# another such tensor. At a small batch those allocations cost more than the products. So on the CPU the products run
# in row blocks of the weight: each block is converted into a scratch tensor of _BLOCK_ELEMENTS fp32 values kept by
# the thread (in cache, never faulted in again) and multiplied, and the weight gradient's block is computed into the
# same scratch and rounded into the bf16 gradient (the one new tensor, which autograd hands on). Each output of the
# forward and of the weight gradient sums the same products as the whole product does (the matrix kernel may order
# them differently for another block shape); the input's gradient adds the blocks' partial products in turn. Measured
# on that CPU, forward and backward of that layer at 17 rows: 252 ms -> ~100 ms. Other devices' caching allocators
# reuse memory: there the whole weight is one block.
_BLOCK_ELEMENTS = 1 << 21  # 8 MiB of fp32 a thread
_scratch = threading.local()


def _fp32_like(block: torch.Tensor) -> torch.Tensor:
    """An fp32 tensor of ``block``'s shape to compute in: a view of this thread's scratch tensor on the CPU (grown
    when a block needs more), a new tensor on another device (whose caching allocator reuses memory)."""
    rows, cols = block.shape
    if block.device.type != "cpu":
        return torch.empty(rows, cols, dtype=torch.float32, device=block.device)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < rows * cols:
        buf = _scratch.buf = torch.empty(max(rows * cols, _BLOCK_ELEMENTS), dtype=torch.float32)
    return buf[: rows * cols].view(rows, cols)


def _row_blocks(weight: torch.Tensor) -> tuple[range, int]:
    """Where the weight's row blocks start, and their rows: the whole weight at once off the CPU."""
    rows = max(1, _BLOCK_ELEMENTS // max(1, weight.shape[1]) if weight.device.type == "cpu" else weight.shape[0])
    return range(0, weight.shape[0], rows), rows


class _LinearInFp32(torch.autograd.Function):
    """``F.linear`` in fp32 of an input and a bf16/fp16 weight, the weight converted a block of rows at a time
    ([Note: Products of half weights in fp32]), keeping for backward the weight itself, not an fp32 copy:
    autograd would otherwise hold every layer's fp32 copy from forward to backward (4 bytes a parameter of the
    whole model at once; an offloaded weight is kept as a view the offload rebuilds from the store). The backward
    runs the products torch's own linear backward runs, in fp32, each gradient returned in its input's dtype."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)  # type: ignore[attr-defined]
        ctx.has_bias = bias is not None  # type: ignore[attr-defined]
        flat = x.float().reshape(-1, weight.shape[1])
        out = torch.empty(flat.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
        starts, rows = _row_blocks(weight)
        for r in starts:
            block = weight[r : r + rows]
            torch.mm(flat, _fp32_like(block).copy_(block).t(), out=out[:, r : r + rows])
        if bias is not None:
            out += bias.float()
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        need = ctx.needs_input_grad  # type: ignore[attr-defined]
        flat = grad.float().reshape(-1, weight.shape[0])
        inputs = x.float().reshape(-1, weight.shape[1]) if need[1] else None
        grad_x = torch.zeros(flat.shape[0], weight.shape[1], dtype=torch.float32, device=grad.device) \
            if need[0] else None
        grad_w = torch.empty_like(weight, memory_format=torch.contiguous_format) if need[1] else None
        starts, rows = _row_blocks(weight)
        for r in starts:
            block = weight[r : r + rows]
            if grad_x is not None:
                grad_x.addmm_(flat[:, r : r + rows], _fp32_like(block).copy_(block))
            if grad_w is not None:
                grad_w[r : r + rows].copy_(torch.mm(flat[:, r : r + rows].t(), inputs, out=_fp32_like(block)))
        grad_b = flat.sum(0) if ctx.has_bias and need[2] else None  # type: ignore[attr-defined]
        return (None if grad_x is None else grad_x.view(x.shape).to(x.dtype)), grad_w, grad_b


def _linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _LinearInFp32.apply(x, self.weight, self.bias)


class _EmbeddingInFp32(torch.autograd.Function):
    """``F.embedding`` of a bf16/fp16 table giving fp32 rows: the rows are looked up in the table's dtype and then
    cast (the values an fp32 copy of the table gives, the cast being exact), and the table's gradient is summed in
    fp32 over the rows the ids name, each row's gradients added in the order of the ids as torch's embedding
    backward adds them, then rounded once into the table's dtype. So neither an fp32 copy of the table in
    forward nor a dense fp32 gradient of it in backward is made (a 32000 x 4096 table: 512 MiB each)."""

    @staticmethod
    def forward(ctx: object, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)  # type: ignore[attr-defined]
        ctx.table = (weight.shape, weight.dtype, padding_idx)  # type: ignore[attr-defined]
        return F.embedding(ids, weight, padding_idx).float()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if not ctx.needs_input_grad[1]:  # type: ignore[attr-defined]
            return None, None, None
        (ids,) = ctx.saved_tensors  # type: ignore[attr-defined]
        shape, dtype, padding_idx = ctx.table  # type: ignore[attr-defined]
        rows, where = torch.unique(ids.reshape(-1), return_inverse=True)
        sums = torch.zeros(rows.numel(), shape[1], dtype=torch.float32, device=grad.device).index_add_(
            0, where, grad.reshape(-1, shape[1]).float())
        if padding_idx is not None:
            sums[rows == padding_idx] = 0
        grad_w = torch.zeros(shape, dtype=dtype, device=grad.device)
        grad_w[rows] = sums.to(dtype)
        return None, grad_w, None


def _embedding(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    if self.scale_grad_by_freq or self.sparse:  # torch's own backward, on an fp32 copy of the table
        return F.embedding(ids, self.weight.float(), self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)
    return _EmbeddingInFp32.apply(ids, self.weight, self.padding_idx)


def _layer_norm(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    weight = None if self.weight is None else self.weight.float()
    bias = None if self.bias is None else self.bias.float()
    return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps)


# [Note: Which dtype computes faster] Whether a CPU multiplies bf16 faster than fp32 depends on its instructions,
# not on the model: on a 2-core Xeon with AMX a bf16 Linear's forward and backward ran 2-2.5x faster computed in
# bf16 than through compute_in_fp32, at every shape tried from 16 x 1024 by 1024 x 1024 to 136 x 2560 by 2560 x
# 10240 (29 against 72 ms there); with AVX2 alone torch's bf16 product is hundreds of times slower. So "auto" times
# one small layer's forward and backward both ways (16 x 1024 by 1024 x 2048: 1.0 against 2.0 ms on that Xeon) once
# per process and dtype, and keeps the faster; a bf16 run 4x slower than the fp32 one ends the timing (at the 0.29
# GFLOPS measured for bf16 on an AVX2-only EPYC, its two runs come to about 1.4 s). Either way the weights, their
# gradients and the optimizer's state keep the weights' dtype: only the products' precision differs.
COMPUTE_CHOICES = ("auto", "param", "fp32")
_measured: dict[torch.dtype, dict[str, float]] = {}


def product_seconds(dtype: torch.dtype, *, rows: int = 16, width: int = 1024, repeats: int = 3) -> dict[str, float]:
    """Seconds of one bias-free Linear's forward and backward (``rows`` x ``width`` by ``width`` x 2 ``width``), its
    weight in ``dtype``: ``{"fp32": computed by compute_in_fp32, "param": computed in dtype}``, each the best of
    ``repeats`` after one warm-up, on the CPU; the dtype's timing stops at a run 4x slower than fp32's best."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(2 * width, width, generator=gen).to(dtype)
    x = torch.randn(rows, width, generator=gen)
    seconds: dict[str, float] = {}
    for how in ("fp32", "param"):
        lin = nn.Linear(width, 2 * width, bias=False, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(weight)
        if how == "fp32":
            compute_in_fp32(lin)
        inp = x if how == "fp32" else x.to(dtype)
        best = float("inf")
        for i in range(repeats + 1):
            lin.weight.grad = None  # each run makes its gradient, as a training step does
            t0 = time.perf_counter()
            lin(inp).float().sum().backward()
            took = time.perf_counter() - t0
            if i:  # the first run is a warm-up
                best = min(best, took)
                if how == "param" and took > 4 * seconds["fp32"]:
                    break
        seconds[how] = best
    return seconds


def resolve_compute(compute: str, dtype: torch.dtype, *, on_cpu: bool = True) -> tuple[str, dict[str, float] | None]:
    """``compute`` ("auto", "param" or "fp32") for weights of ``dtype`` as "param" or "fp32", and the timings
    "auto" chose by (None when nothing was measured). fp32 weights compute in fp32 whatever is asked; a model
    computing on a GPU (``on_cpu=False``) computes "auto" in its weights' dtype ([Note: Which dtype computes
    faster])."""
    if compute not in COMPUTE_CHOICES:
        raise TierValueError(f"compute {compute!r}: choose auto (the faster here, measured), param (the weights' "
                             "dtype) or fp32")
    if dtype not in _HALF:
        return "param", None
    if compute != "auto":
        return compute, None
    if not on_cpu:
        return "param", None
    if dtype not in _measured:
        _measured[dtype] = product_seconds(dtype)
    seconds = _measured[dtype]
    return ("param" if seconds["param"] <= seconds["fp32"] else "fp32"), seconds


def choice_text(seconds: dict[str, float] | None, dtype_name: str) -> str:
    """What "auto" measured, for a log line: "" when nothing was (``seconds`` as :func:`resolve_compute` returns)."""
    if seconds is None:
        return ""
    return (f" (the faster here: a {dtype_name} layer's products took {seconds['param'] * 1e3:.1f} ms in "
            f"{dtype_name}, {seconds['fp32'] * 1e3:.1f} ms in fp32)")


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
                raise TierValueError("compute_in_fp32 cannot patch an Embedding with max_norm (it writes its weight)")
            m.forward = types.MethodType(_embedding, m)
            n += 1
    return n


__all__ = ["COMPUTE_CHOICES", "choice_text", "compute_in_fp32", "product_seconds", "resolve_compute"]
