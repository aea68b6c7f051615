"""A tied parameter in a layer-major step: its gradient's parts summed in the loop's order, holding only the rows
of the step's tokens.

[Note: Tied parameters layer by layer] A parameter used in two places (a
language model's embedding and its head, ``tie_word_embeddings``) gets, in
the loop, a part of its gradient from each place in each micro-batch's
backward: autograd adds the two (``s_i = h_i + e_i``) and the micro-batches'
sums are added in their order (``G = s_0 + s_1 + ...``). In a layer-major
step the head's parts ``h_i`` come in the forward phase (each micro-batch's
own backward stops at the last segment) and the embedding's parts ``e_i`` at
the very end (the glue before the first segment), so added as they come the
sum would be ``h_0 + h_1 + ... + e_0 + e_1 + ...``: other bits.

But an embedding's part touches only the rows of its micro-batch's tokens:
every other row of ``e_i`` is +0, and adding +0 changes a sum only where it
is -0 (into +0), the same wherever in the chain it is added. So, with ``R``
the rows of all the step's micro-batches' tokens (known before any head
runs: every micro-batch passes the first segment before any passes the
second, and its embedding before that):

- each ``h_i`` is added to the kept gradient as it comes (its rows outside
  ``R`` then end as the loop's, but for the sign of a zero), and its rows
  ``R`` (``h_i[R]``) are kept in the store, as the activations are, needed
  after all of them;
- each ``e_i`` is checked to be +0 outside ``R``, bit for bit (else the step
  runs as the loop), and after each micro-batch's glue ``F = F + (h_i[R] +
  e_i[R])``, ``F`` starting from the gradient's rows ``R`` from before the
  step (the embeddings' parts in the order they came, where there are more);
- at the end the kept gradient gets one +0 where the loop added one (an
  ``e_i`` came), and its rows ``R`` are set to ``F``.

An encoder-decoder's shared embedding (T5, BART) is used by the encoder's
embedding, the decoder's (between the encoder's layers and the decoder's)
and the head: the loop adds the head's part, then the decoder embedding's,
then the encoder embedding's, as its backward reaches them, and so does
the step, each embedding's part kept (its rows ``R``) until the last comes.

So the step sums what the loop sums, in its order, and holds k x |R| x width
(in the gradient's dtype, in the tiers) where keeping each ``h_i`` whole
would hold k x vocab x width. A tied parameter used otherwise (by a module
that is no ``nn.Embedding`` outside the head, inside the segments, in two
parts of the head's side of a micro-batch) makes the step run as the loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class TiedStep(Protocol):
    """What :class:`TiedParts` uses of the layer-major step it serves (``_layer_major.LayerMajorStep``): its offload
    (``off.grads``: the kept gradients), its micro-batches' threads and the segment each is at, the turn, where its
    backward stands (inside the segments, or in which micro-batch's glue), and its store of activations
    (``keep``, ``take_kept``, ``glue_place``)."""

    off: Any
    segments: list[nn.Module]
    workers: dict[int, int]
    next_segment: list[int]
    rotation: Any
    in_segments_backward: bool
    glue_micro_batch: int | None

    def keep(self, value: torch.Tensor, place: int) -> str: ...

    def take_kept(self, key: str) -> torch.Tensor: ...

    def glue_place(self, i: int) -> int: ...


@dataclass(eq=False)
class _Tied:
    """One tied trainable offloaded parameter during one step."""

    name: str
    key: str  # its store key
    param: nn.Parameter
    tokens: list[torch.Tensor] = field(default_factory=list)  # the indices its embeddings took, before any head
    rows: torch.Tensor | None = None  # R: their sorted distinct rows, once a part came
    sums: torch.Tensor | None = None  # F, on the CPU in the kept gradient's dtype
    started: bool = False  # F's start read (the gradient's rows R from before the step, or none)
    head: dict[int, str] = field(default_factory=dict)  # micro-batch -> store key of h_i[R]
    embedding: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # micro-batch -> its e[R], in order
    embedding_came: bool = False


def tied_parameters(model: nn.Module) -> dict[int, tuple[str, list[nn.Module]]]:
    """id -> (first name, the modules that own it) of each parameter ``model`` holds in more than one place."""
    names: dict[int, list[str]] = {}
    owners: dict[int, list[nn.Module]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for pname, p in m._parameters.items():
            if p is not None:
                names.setdefault(id(p), []).append(f"{mname}.{pname}" if mname else pname)
                if all(o is not m for o in owners.setdefault(id(p), [])):
                    owners[id(p)].append(m)
    return {i: (n[0], owners[i]) for i, n in names.items() if len(n) > 1}


class TiedParts:
    """The tied parameters of one layer-major step (see [Note: Tied parameters layer by layer]): the embeddings'
    tokens seen, the parts kept, their sums; ``bad`` says why the step must run as the loop."""

    def __init__(self, step: TiedStep, tied: Sequence[tuple[str, str, nn.Parameter, list[nn.Module]]],
                 grads: Any = None) -> None:
        self.step = step
        # Where the parts are summed: the offload's kept gradients, or (FSDP2) the unsharded gradients, which autograd
        # accumulates the parts into (see [Note: Tied parameters on FSDP2 ranks] in fsdp.py).
        self.grads = step.off.grads if grads is None else grads
        self.by_key = {key: _Tied(name, key, p) for name, key, p, _ in tied}
        self.owners = [(m, self.by_key[key]) for _, key, _, owners in tied for m in owners]
        self.bad: str | None = None

    def hook(self, refuse: Callable[[str], None]) -> list[Any]:
        """Forward pre-hooks on the modules that own a tied parameter: where each is used, and with which tokens;
        ``refuse(why)`` raises where the step must run as the loop."""
        def used(m: nn.Module, args: Any, kwargs: Any, t: _Tied) -> None:
            why = self._used(t, m, args, kwargs)
            if why is not None:
                self.bad = self.bad or why
                refuse(why)

        return [m.register_forward_pre_hook(lambda m, args, kwargs, t=t: used(m, args, kwargs, t), with_kwargs=True)
                for m, t in self.owners]

    def _used(self, t: _Tied, module: nn.Module, args: Any, kwargs: Any) -> str | None:
        """Why this use of ``t`` makes the step run as the loop, or None; the tokens of an embedding's."""
        step = self.step
        i = step.workers.get(threading.get_ident())
        k, last = (None, None) if i is None else (step.next_segment[i], len(step.segments))
        if i is None or k == last:  # a segment's rerun in backward; or after the last segment (the head)
            return None
        where = f"tied parameter {t.name!r} is used by {type(module).__name__}"
        if not isinstance(module, nn.Embedding) or module.max_norm is not None or module.sparse:
            return (f"{where} {f'between segments {k - 1} and {k}' if k else 'before the first segment'}, which "
                    f"is no dense nn.Embedding without max_norm: the rows its gradient touches are not known "
                    f"before the head's part comes")
        if t.rows is not None:
            return f"{where} after the head's part of its gradient came"
        ids = args[0] if args else kwargs["input"]
        t.tokens.append(ids.detach().reshape(-1).to("cpu"))
        return None

    # ---- the parts ----------------------------------------------------------------------------
    def take(self, key: str, grad: torch.Tensor) -> bool:
        """Keep ``grad``, a part of a tied parameter's gradient (a pass consumer's ``takes_part``)."""
        t = self.by_key.get(key)
        if t is None:
            return False
        step = self.step
        if step.glue_micro_batch is not None:
            self._from_embedding(t, step.glue_micro_batch, grad)
        elif step.in_segments_backward:
            self.bad = self.bad or f"{t.name} got a part of its gradient inside the segments"
        else:  # the forward phase: the backward of the micro-batch whose turn it is
            self._from_head(t, step.rotation.turn, grad)
        return True

    def _start(self, t: _Tied) -> torch.Tensor:
        """R, and F's start: the gradient's rows R from before the step, if it had one."""
        if t.rows is None:
            t.rows = torch.unique(torch.cat(t.tokens)) if t.tokens else torch.zeros(0, dtype=torch.long)
            t.tokens = []
        if not t.started:
            before = self.grads.get(t.key)
            t.sums = None if before is None else before.index_select(0, t.rows)
            t.started = True
        return t.rows

    def _from_head(self, t: _Tied, i: int, grad: torch.Tensor) -> None:
        if i in t.head:
            self.bad = self.bad or f"{t.name} got two parts of its gradient from after the segments in micro-batch {i}"
            return
        rows = self._start(t)
        t.head[i] = self.step.keep(grad.index_select(0, rows.to(grad.device)), self.step.glue_place(i))
        self.grads.accumulate(t.key, grad, t.param.dtype)

    def _from_embedding(self, t: _Tied, i: int, grad: torch.Tensor) -> None:
        rows = self._start(t).to(grad.device)
        t.embedding.setdefault(i, []).append(grad.index_select(0, rows))
        t.embedding_came = True
        rest = grad.index_fill_(0, rows, 0)  # ours: taken from .grad
        if rest.view(_INT_OF_SIZE[rest.element_size()]).any():
            self.bad = self.bad or (f"{t.name}'s part of the gradient from before the first segment is not zero "
                                    f"outside the rows of the micro-batches' tokens")

    def glue_done(self, i: int) -> None:
        """Micro-batch ``i``'s glue before the first segment ran backward: its sum joins F."""
        step = self.step
        for t in self.by_key.values():
            parts = [step.take_kept(t.head.pop(i))] if i in t.head else []
            parts += t.embedding.pop(i, [])
            if not parts:
                continue
            s = parts[0]  # the head's, then each embedding's as the loop's backward reached it
            for part in parts[1:]:
                s = s.to(part.device) + part
            s = s.to("cpu")
            t.sums = s.to(self.grads.dtype_of(t.param)) if t.sums is None else t.sums.add_(s)

    def end(self) -> None:
        """Every micro-batch's glue ran backward: each kept gradient's rows R set to F (see [Note: Tied parameters
        layer by layer])."""
        grads = self.grads
        for t in self.by_key.values():
            if t.sums is None:  # no part came
                continue
            if grads.get(t.key) is None:  # only embeddings' parts: the loop's first one was +0 outside R
                zeros = torch.zeros(t.param.shape, dtype=grads.dtype_of(t.param))
                grads.accumulate(t.key, zeros, t.param.dtype)
            g = grads.get(t.key)
            with torch.no_grad():
                if t.embedding_came:
                    g.add_(0.0)
                g.index_copy_(0, t.rows, t.sums)
            t.sums = None


__all__ = ["TiedParts", "TiedStep", "tied_parameters"]
