"""The AdamW arithmetic: torch's own functional AdamW (the code torch.optim.AdamW.step runs), with the same choice
of its single-tensor, multi-tensor (``foreach``) or fused implementation, so fp32 training is bit-identical to
torch.optim.AdamW given the same flags; tensors beyond a size are updated slice by slice."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.optim.adamw import adamw as torch_adamw
from tierstore import TierValueError

SLICE = 1 << 20  # elements per slice of the update of a tensor larger than WHOLE_MAX: [Note: Sliced updates]
WHOLE_MAX = 1 << 22


HYPER = ("lr", "betas", "eps", "weight_decay", "maximize")

# torch.optim.AdamW's implementations: foreach=False (its default for CPU tensors), foreach=True, fused=True
IMPLS = ("single", "foreach", "fused")


def impl_of(foreach: bool | None, fused: bool | None) -> str:
    """The implementation torch.optim.AdamW runs on CPU tensors given these flags (see [Note: Which AdamW])."""
    if foreach and fused:  # torch's own refusal
        raise TierValueError("fused=True and foreach=True cannot be given together (as torch.optim.AdamW refuses): "
                             "pick one")
    return "fused" if fused else "foreach" if foreach else "single"


def check_hyper(group: dict[str, Any], where: str) -> None:
    lr, betas, eps, wd, maximize = (group[k] for k in HYPER)
    if not lr >= 0.0:
        raise TierValueError(f"{where}lr={lr} must be >= 0")
    if not (len(betas) == 2 and 0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise TierValueError(f"{where}betas={betas} must be two numbers, each in [0, 1)")
    if not eps >= 0.0:
        raise TierValueError(f"{where}eps={eps} must be >= 0")
    if not wd >= 0.0:
        raise TierValueError(f"{where}weight_decay={wd} must be >= 0")
    if not isinstance(maximize, bool):
        raise TierValueError(f"{where}maximize={maximize!r} must be True or False")


def adamw_update(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                 step: float, hyper: tuple, impl: str = "single") -> None:
    """torch.optim.AdamW's update of one tensor (``impl`` one of IMPLS), slice by slice.

    [Note: Sliced updates] Every operation of the update is elementwise, so an
    element's result depends only on that element's inputs, and running the whole
    sequence over one slice of ``SLICE`` elements at a time gives the same bits as
    running each operation over the whole tensor (tested, vectorised and scalar
    paths alike; the fused kernel too, since every slice starts at a multiple of
    its vector width: only the last ``numel % width`` elements of a call take its
    scalar path, the same elements sliced or whole). The single-tensor update
    runs so over every tensor of more than ``SLICE`` elements, its temporaries
    in buffers of its thread (see [Note: The update's temporaries]); the others
    over tensors of more than ``WHOLE_MAX`` elements: their temporaries (``sqrt``
    and the division make two, and a bf16/fp16 gradient's fp32 copy a third) are
    then slices of 4 MiB in fp32 instead of copies of the whole tensor, memory
    outside every tier budget (1.6 GB at once for a 200M-element fp32
    embedding) that the allocator faults in afresh on
    every step once it is larger than what it keeps for reuse. Measured here:
    a 16M-element tensor alone steps in 37 ms instead of 72; a training step of
    three offloaded Linear(8192, 8192) layers (67M elements each) took 3.57 s
    instead of 3.82, with 2.56 s of CPU instead of 3.19.
    """
    grad = grad.to(param.device)
    if impl == "fused" and any(t.stride() != param.stride() for t in (exp_avg, exp_avg_sq, grad)):
        _fused_in_layout_of_param(param, exp_avg, exp_avg_sq, grad, step, hyper)
        return
    tensors = (param, exp_avg, exp_avg_sq, grad)
    n = param.numel()
    contiguous = all(t.is_contiguous() for t in tensors)
    own = impl == "single" and (contiguous or n <= SLICE) and _own_single_exact(param, exp_avg, exp_avg_sq, grad,
                                                                                  hyper)

    def update(*part: torch.Tensor) -> None:
        if own:
            _single_in_buffers(*part, step, hyper)
        else:
            adamw_slice(*part, step, hyper, impl)

    if n <= (SLICE if own else WHOLE_MAX) or not contiguous:
        update(*tensors)
        return
    flat = [t.view(-1) for t in tensors]
    for start in range(0, n, SLICE):
        update(*(t[start:start + SLICE] for t in flat))


# [Note: The update's temporaries] torch's single-tensor AdamW (the default on
# the CPU) makes two temporaries the size of the tensor it updates (``sqrt``,
# then the division), and a bf16/fp16 gradient's copy in its master's dtype a
# third. Above glibc's mmap threshold, which the store fixes at 128 KiB (see
# [Note: Giving freed memory back] in tierstore/_allocator.py), each is a fresh
# mapping whose pages are faulted in, and zeroed, at each update: 4096 faults a
# 16 MiB temporary. Measured here, a 4M-element fp32 update on one thread took
# 38-42 ms so against 11 ms with the temporaries from the allocator's heaps;
# on the anchor model of docs/optimizer.md (48 such updates a step, on the
# optimizer's worker beside the backward) 196,608 faults a step, 34 ms of CPU
# an update, most of the worker's time and the step's bound. So the update here
# runs torch's sequence of operations itself, slice by slice, the temporaries
# in buffers of its thread kept for the next (at most ``SLICE`` elements each,
# 4 MiB in fp32): the same kernels on the same inputs in the same order, so the
# same bits. Where torch's sequence is not this one (another release may
# change it), nothing may differ: each combination of dtypes is checked once a
# process against torch's own function (``_own_single_exact``), and one that
# differs, a ``maximize`` update and a complex tensor run torch's code.
_buffers = threading.local()  # dtype -> this thread's buffer of at most SLICE elements
_exact: dict[tuple, bool] = {}  # (param, moments, gradient dtypes) -> the own sequence matched torch's
_exact_lock = threading.Lock()


def _buffer(dtype: torch.dtype, n: int) -> torch.Tensor:
    """``n`` elements of this thread's buffer of ``dtype``, grown to the largest asked (at most SLICE)."""
    held = getattr(_buffers, "by_dtype", None)
    if held is None:
        held = _buffers.by_dtype = {}
    buf = held.get(dtype)
    if buf is None or buf.numel() < n:
        buf = held[dtype] = torch.empty(n, dtype=dtype)
    return buf[:n]


def _single_in_buffers(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                       step: float, hyper: tuple) -> None:
    """torch's ``_single_tensor_adam`` on one tensor of at most SLICE elements (CPU, real, no amsgrad, decoupled
    weight decay, not maximize, neither capturable nor differentiable), its temporaries in this thread's buffers."""
    lr, (beta1, beta2), eps, weight_decay, _ = hyper
    if grad.dtype != param.dtype:  # adamw_slice's conversion, into a buffer (the denominator's, where the dtypes
        grad = _buffer(param.dtype, grad.numel()).view(grad.shape).copy_(grad)  # match: last read before it)
    step_t = torch.tensor(step - 1.0)  # the step count as torch keeps and advances it
    step_t += 1
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    count = step_t.item()
    bias_correction1 = 1 - beta1 ** count
    bias_correction2 = 1 - beta2 ** count
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    denom = _buffer(exp_avg_sq.dtype, exp_avg_sq.numel()).view(exp_avg_sq.shape)
    torch.sqrt(exp_avg_sq, out=denom)
    denom.div_(bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def _own_single_exact(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                      hyper: tuple) -> bool:
    """Whether ``_single_in_buffers`` may run this update: not maximize, real dtypes, and the same bits as torch's
    own single-tensor AdamW for these dtypes (checked once a process; see [Note: The update's temporaries])."""
    if hyper[4] or any(t.is_complex() or t.device.type != "cpu" for t in (param, exp_avg, exp_avg_sq, grad)):
        return False
    key = (param.dtype, exp_avg.dtype, exp_avg_sq.dtype, grad.dtype)
    with _exact_lock:
        if key not in _exact:
            _exact[key] = _matches_torch(*key)
        return _exact[key]


def _matches_torch(param_dtype: torch.dtype, avg_dtype: torch.dtype, sq_dtype: torch.dtype,
                   grad_dtype: torch.dtype) -> bool:
    """Both sequences over random tensors: weight decay and none, the first step and a later one, a size with a
    vectorised body and a scalar tail, the gradient converted or not; each step compared bit for bit."""
    g = torch.Generator().manual_seed(0)
    n = 4133
    base = [torch.randn(n, generator=g).to(dt) for dt in (param_dtype, avg_dtype, sq_dtype)]
    base[2] = base[2].abs()
    for hyper in ((1e-3, (0.9, 0.999), 1e-8, 0.01, False), (0.25, (0.5, 0.75), 1e-3, 0.0, False)):
        theirs, ours = [t.clone() for t in base], [t.clone() for t in base]
        for step in (1.0, 2.0, 9.0):
            grad = torch.randn(n, generator=g).to(grad_dtype)
            adamw_slice(*theirs, grad, step, hyper, "single")
            _single_in_buffers(*ours, grad, step, hyper)
            if not all(torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
                       for a, b in zip(theirs, ours)):
                return False
    return True


def _fused_in_layout_of_param(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                              grad: torch.Tensor, step: float, hyper: tuple) -> None:
    """[Note: The fused kernel and layouts] torch's fused kernel walks its
    tensors' memory in order, as if they had one layout: given a channels_last
    weight beside contiguous moments it pairs elements that are not the same
    element (it computed the weight right and left both moments permuted, where
    ``state_dict()`` reads them). torch's own AdamW keeps each moment in its
    parameter's layout (``zeros_like``) and autograd makes the gradient match it;
    OffloadedAdamW makes the moments so too. Where a tensor's layout still
    differs (a gradient of another layout, say), the kernel runs on copies in
    the parameter's layout, the moments copied back after, giving torch's bits;
    the single-tensor and multi-tensor updates index elements and need no
    copies."""
    copies = [t if t.stride() == param.stride() else torch.empty_like(param, dtype=t.dtype).copy_(t)
              for t in (exp_avg, exp_avg_sq, grad)]
    if any(t.stride() != param.stride() for t in copies):  # empty_like keeps the strides of dense memory only
        raise TierValueError(f"fused=True cannot step a parameter of shape {tuple(param.shape)} with strides "
                             f"{param.stride()}: its memory has gaps or overlaps; use fused=False")
    adamw_update(param, *copies, step, hyper, "fused")
    for mine, copy in zip((exp_avg, exp_avg_sq), copies):
        if copy is not mine:
            mine.copy_(copy)


def adamw_slice(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                step: float, hyper: tuple, impl: str = "single") -> None:
    """[Note: Which AdamW] torch.optim.AdamW runs one of three implementations:
    the single-tensor one (``foreach=False``, its default for CPU tensors), the
    multi-tensor one (``foreach=True``) and the fused kernel (``fused=True``).
    The fused kernel's results differ from the others' in the last bits (one
    pass, against a sequence of elementwise operations; on the CPU the
    multi-tensor one runs the same operations as the single-tensor one, and
    gave the same bits here), so each update here calls
    torch's own functional AdamW with the same choice: the very code
    ``torch.optim.AdamW.step`` runs, whatever the torch release. The step count
    goes in as the tensor torch keeps (it adds the one itself): fp32 for the
    fused kernel, the default dtype otherwise, as torch makes them. The fused
    kernel reads and writes each element once instead of about eight times:
    measured here, a 4M-element update took 2-4 ms fused against 11-14 ms."""
    lr, (beta1, beta2), eps, weight_decay, maximize = hyper
    grad = grad.to(param.dtype)  # a bf16/fp16 gradient against its fp32 master; no copy when the same
    step_t = torch.tensor(step - 1.0, dtype=torch.float32 if impl == "fused" else None)
    torch_adamw([param], [grad], [exp_avg], [exp_avg_sq], [], [step_t], foreach=impl == "foreach",
                fused=impl == "fused", amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay,
                eps=eps, maximize=maximize)
