"""The AdamW arithmetic: torch's own functional AdamW (the code torch.optim.AdamW.step runs), with the same choice
of its single-tensor, multi-tensor (``foreach``) or fused implementation, so fp32 training is bit-identical to
torch.optim.AdamW given the same flags; tensors beyond a size are updated slice by slice."""

from __future__ import annotations

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
    scalar path, the same elements sliced or whole). A tensor of more than
    ``WHOLE_MAX`` elements is updated so: its temporaries (``sqrt`` and the
    division make two, and a bf16/fp16 gradient's fp32 copy a third) are then
    slices of 4 MiB in fp32 instead of copies of the whole tensor, memory
    outside every tier budget (1.6 GB at once for a 200M-element fp32
    embedding) that the allocator faults in afresh on
    every step once it is larger than what it keeps for reuse. Measured here:
    a 16M-element tensor alone steps in 37 ms instead of 72; a training step of
    three offloaded Linear(8192, 8192) layers (67M elements each) took 3.57 s
    instead of 3.82, with 2.56 s of CPU instead of 3.19. Smaller tensors are
    updated whole: slicing them made a ViT-large step 10% slower (4.97 against
    4.52 s, the optimizer stepping in backward beside the backward's compute).
    """
    grad = grad.to(param.device)
    if impl == "fused" and any(t.stride() != param.stride() for t in (exp_avg, exp_avg_sq, grad)):
        _fused_in_layout_of_param(param, exp_avg, exp_avg_sq, grad, step, hyper)
        return
    tensors = (param, exp_avg, exp_avg_sq, grad)
    n = param.numel()
    if n <= WHOLE_MAX or not all(t.is_contiguous() for t in tensors):
        adamw_slice(*tensors, step, hyper, impl)
        return
    flat = [t.view(-1) for t in tensors]
    for start in range(0, n, SLICE):
        adamw_slice(*(t[start:start + SLICE] for t in flat), step, hyper, impl)


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
