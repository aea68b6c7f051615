"""Gradients as tensors of the store: what an offloaded model keeps from backward to the optimizer's step.

[Note: Gradients in the tiers] A gradient that must outlive the backward that
made it (accumulation over micro-batches, clipping by the global norm, an
optimizer that steps after backward) is a key of the store, ``grad/<name>``,
under the same budgets as everything else: its home is ``grad_tier`` (the
optimizer's tier by default), and with an NVMe home it is put with
``write_home=False``, so it stays in the host tier while there is room and
reaches the drive only when that room is needed (a model whose gradients fit
costs the drive nothing for them). The model's victim order ranks them as it
ranks optimizer state (``LaterUses.grads``; see [Note: Who uses a copy
next]): a gradient is next used by the next backward through its parameter,
which adds to it, or once backward is past, by the update (its place in the
optimizer's queue). So while backward reads the weights of the units ahead,
the gradients just made go to the drive first, and one read ahead for its
update stays until it is used. Left unranked they went first even then: in
Trainer's loop at 170.6M (bf16 gradients, 160 MiB host budget) the step read
3.4-3.75 bytes of gradient a parameter against 2, most read ahead, evicted
and read again. Accumulation adds into the stored copy
(read, add, mark dirty). The optimizer reads each gradient ahead with its
state (see [Note: Pipelined step]) and the gradients go at ``zero_grad()``.
Gradients handed to an optimizer that steps in backward do not pass through
the store: each is consumed at once, and their backlog is bounded apart (see
[Note: Stepping in backward]).

The stored dtype is the parameter's, except that a bf16 or fp16 parameter's
gradient is kept, and accumulated, in fp32 (``grad_dtype="param"`` keeps the
parameter's dtype, as torch does): the drive then holds 4 bytes per such
parameter instead of 2, and accumulating over micro-batches loses no bits.

[Note: A stored gradient read from outside] ``param.grad`` of an offloaded
parameter is a :class:`StoredGrad`: a tensor with the gradient's shape, dtype
and device and no memory of its own. Every torch operation on it reads the
gradient from the store (through the host tier) and writes it back when the
operation writes it, so ``torch.nn.utils.clip_grad_norm_(model.parameters(),
...)``, ``model.zero_grad()``, ``p.grad.clamp_(...)`` and any read work as
on a resident model, one gradient in memory at a time. Two operations that
clipping does to every gradient cost no read at all, with the same bits: the
2-norm of each gradient is computed as it is stored (after each
accumulation), and a multiplication by a scalar (the clip coefficient; also
as ``_foreach_mul_`` of one gradient, which a DTensor's clip comes down to) is
recorded and applied when the gradient is next read; the optimizer's update
applies it to a copy (``values_of(..., keep_stored=True)``), so a gradient
kept after its update is unchanged by it, and one read back from the drive
for the update is freed with no write (applied in place, each clipped gradient was written back to the drive only
for ``zero_grad()`` to drop it: 4.1 bytes a parameter a step in Trainer's
loop at 170.6M with fp32 gradients, 38.7 against 34.7 in all). A view of a stored
gradient (``p.grad[0]``, ``p.grad.view(-1)``) is a copy that refuses writes,
since a write into it could not reach the gradient: write the gradient
itself (``p.grad[0] = 0`` raises, ``p.grad.mul_(...)`` works). An operation
over a list of stored gradients (torch's ``_foreach_`` kernels, which
``clip_grad_norm_(..., foreach=True)`` and ``clip_grad_value_`` use, and
the unscaling of ``torch.amp.GradScaler``) runs one
list position at a time, so each gradient is read and written in turn; one
that writes a stored gradient while reading another is refused.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from tierstore import Tier, TierStore, TierStoreError, TierValueError
from tierstore.memory import dense_strides

from ._contract import MASTERED_DTYPES
from .policies import OptimizerStatePolicy

GRAD_PREFIX = "grad/"
CODE_PREFIX = "coded/"  # before a gradient's key: its code (see [Note: A kept gradient coded against its moments])
_aten = torch.ops.aten
_NORM = _aten.linalg_vector_norm.default
# In-place products by one number: recorded and applied at the next read (see [Note: A stored gradient read from
# outside]).
_SCALINGS = frozenset({_aten.mul_.Tensor, _aten.mul_.Scalar})
_FOREACH_SCALINGS = frozenset({_aten._foreach_mul_.Tensor, _aten._foreach_mul_.Scalar})  # of one gradient (a DTensor's)
GRAD_DTYPES = ("float32", "param")
# Operations over lists of tensors, elementwise at each list position: torch's foreach kernels, and the one
# GradScaler unscales with (its found_inf is only ever set, so one position at a time sets it alike).
_LISTWISE = ("_foreach_", "_amp_foreach_non_finite_check_and_unscale_")


def check_grad_dtype(grad_dtype: object) -> None:
    """``grad_dtype`` is one of GRAD_DTYPES, else a ValueError that says which to choose."""
    if grad_dtype not in GRAD_DTYPES:
        raise TierValueError(f"grad_dtype={grad_dtype!r}: choose 'float32' (bf16/fp16 gradients kept and accumulated "
                             f"in fp32) or 'param' (in the parameter's dtype, as torch keeps them)")


def grad_home(store: TierStore, grad_tier: Tier | None, optimizer_home: Tier | None = None) -> Tier:
    """Where kept gradients live: ``grad_tier``, else the home of the state of the optimizer that steps them
    (``OptimizerStatePolicy``'s default before one is built); the host tier without a drive (see [Note:
    Gradients in the tiers])."""
    home = grad_tier if grad_tier is not None else optimizer_home or OptimizerStatePolicy().home
    return Tier.HOST if home is Tier.NVME and store.swap_directory is None else home


def grad_key(param_key: str) -> str:
    """The store key of an offloaded parameter's gradient (``param/<name>`` -> ``grad/<name>``)."""
    return GRAD_PREFIX + param_key.partition("/")[2]


def stored_dtype(param_dtype: torch.dtype, grad_dtype: str) -> torch.dtype:
    """The dtype a gradient of a ``param_dtype`` parameter is kept in (see [Note: Gradients in the tiers])."""
    return torch.float32 if grad_dtype == "float32" and param_dtype in MASTERED_DTYPES else param_dtype


@dataclass(eq=False)
class _Record:
    """One stored gradient."""

    key: str  # its store key
    param_key: str
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    scales: list[torch.Tensor | float] = field(default_factory=list)  # products not yet applied
    norm: torch.Tensor | None = None  # its 2-norm, while its values are those it was computed from
    generation: int = 0  # changes whenever its values do
    handle: StoredGrad | None = None
    claims: int = 0  # updates queued to read it (see ``GradientStore.claim``)
    # What changed it since an update read it before its step (see ``GradientStore.watched_values``): each product
    # by one number, or None for any other write.
    watched: list[Any] | None = None
    written: bool = False  # by something else than a product by one number, since backward last added to it
    stored: int = 0  # changes whenever its stored bytes do (a write, or its pending products applied)
    watched_stored: int | None = None  # ``stored`` when an update read it unscaled (see ``watched_values``)
    readers: int = 0  # threads about to read or write its values: it is not coded meanwhile
    coded: Coded | None = None  # stored coded against its update's moments (see ``keep_coded``)


@dataclass(eq=False)
class Coded:
    """Where a coded gradient is stored, and what decodes it (see [Note: A kept gradient coded against its moments]
    in _grad_code.py): ``settle()`` undoes the speculated updates, which decodes it."""

    key: str
    settle: Callable[[], None]


class _MustDecode(Exception):
    """Raised by ``GradientStore._held`` for a coded gradient: the caller decodes it (``_reading``) and tries again."""


class GradientStore:
    """The gradients of one offloaded model, by parameter key (see [Note: Gradients in the tiers]).

    ``get``/``pop``/``[key] = tensor``/``clear``/``zero``: the ``GradientSource`` the optimizer reads; ``accumulate``
    adds a backward's gradient; :func:`values_of` gives a gradient's values for the length of a ``with``.
    """

    def __init__(self, store: TierStore, grad_tier: Tier | None, grad_dtype: str = "float32") -> None:
        check_grad_dtype(grad_dtype)
        self.store = store
        self.grad_tier = grad_tier  # chosen by the offload's policy, or None: the optimizer's state's home
        self.home = grad_home(store, grad_tier)
        self.grad_dtype = grad_dtype
        self._records: dict[str, _Record] = {}
        self._direct: dict[str, torch.Tensor] = {}  # handed to an optimizer stepping in backward
        self._lock = threading.RLock()
        self._claims_released = threading.Condition(self._lock)  # see claim()

    # ---- what backward and the optimizer call --------------------------------------------

    def follow(self, optimizer_home: Tier) -> None:
        """An optimizer whose state lives in ``optimizer_home`` steps these gradients: unless the offload's policy
        chose their tier, the gradients put from now on live there too."""
        if self.grad_tier is None:
            self.home = grad_home(self.store, None, optimizer_home)
    def accumulate(self, param_key: str, grad: torch.Tensor, param_dtype: torch.dtype) -> None:
        """Add a backward's gradient into the stored one (or store it: the first of a step)."""
        stored = self._records.get(param_key)
        with self._reading(stored) if stored is not None else contextlib.nullcontext(), self._lock:
            rec = self._records.get(param_key)
            if rec is None:
                self._put(param_key, grad, stored_dtype(param_dtype, self.grad_dtype))
                return
            self._unclaimed(rec)
            if rec.watched is not None:
                rec.watched.append(None)
            rec.written = False
            with self._held(rec, write=True) as t:
                t.add_(grad.to(t.device))
                rec.norm = torch.linalg.vector_norm(t, 2.0)

    def hand_over(self, param_key: str, grad: torch.Tensor) -> None:
        """Keep a gradient for an optimizer that steps in backward, outside the store (it is consumed at once)."""
        host = grad.detach().to("cpu", copy=grad.device.type != "cpu")
        prev = self._direct.get(param_key)
        self._direct[param_key] = host if prev is None else prev.add_(host)

    def get(self, param_key: str, default: Any = None) -> Any:
        with self._lock:
            direct = self._direct.get(param_key)
            if direct is not None:
                return direct
            rec = self._records.get(param_key)
            if rec is None:
                return default
            if rec.handle is None:
                rec.handle = StoredGrad.of(self, rec)
            return rec.handle

    __getitem__ = get

    def pop(self, param_key: str, default: Any = None) -> Any:
        with self._lock:
            out = self.get(param_key, default)
            self._direct.pop(param_key, None)
            rec = self._records.pop(param_key, None)
            if rec is not None and not rec.claims:  # else the last claim's release drops it
                self._drop_stored(rec)
            return out

    def claim(self, grad: torch.Tensor) -> None:
        """An update queued to run later reads ``grad`` (one ``get`` gave): ``zero_grad()`` lets it go from the model
        but keeps its bytes, and a write into it (``p.grad.mul_(...)``, ``zero_()``, a backward adding to it) waits,
        until :meth:`release_claim` (see [Note: Updates streamed into the next forward])."""
        if isinstance(grad, StoredGrad):
            with self._lock:
                grad._record.claims += 1

    def release_claim(self, grad: torch.Tensor, *, drop: bool) -> None:
        """The queued update has read ``grad``; ``drop``: it goes from the model too (``keep_grads=False``)."""
        if not isinstance(grad, StoredGrad):
            return
        with self._lock:
            rec = grad._record
            rec.claims -= 1
            current = self._records.get(rec.param_key) is rec
            if current and drop:
                del self._records[rec.param_key]
                current = False
            if not current and not rec.claims:
                self._drop_stored(rec)
            self._claims_released.notify_all()

    @contextlib.contextmanager
    def watched_values(self, grad: torch.Tensor) -> Iterator[torch.Tensor | None]:
        """The values of ``grad`` (one ``get`` gave) for an update made before it is known whether they are those
        the step applies (see [Note: Speculated updates]), or None where it is no longer the model's gradient.
        From here on what changes it is recorded for :meth:`unchanged`; a product by one number (a clip) waits for
        no update, nor does this block hold the lock: a backward storing other gradients goes on meanwhile."""
        if not isinstance(grad, StoredGrad):
            yield None
            return
        rec = grad._record
        with self._lock:
            current = self._records.get(rec.param_key) is rec and rec.coded is None
            if current:
                rec.watched = []
                rec.claims += 1  # a drop meanwhile keeps its bytes, and other writes wait
                scales = list(rec.scales)
                rec.watched_stored = None if scales else rec.stored  # the values given are the stored bytes
        if not current:
            yield None
            return
        try:
            t = self.store.get(rec.key, Tier.HOST)
            try:
                yield _scaled_copy(t, scales) if scales else t
            finally:
                self.store.release(rec.key, Tier.HOST)
        finally:
            self.release_claim(grad, drop=False)

    def unchanged(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is still the model's gradient with the values :meth:`watched_values` gave: nothing
        changed it since but products by exactly 1 (a clip whose coefficient came out 1)."""
        if not isinstance(grad, StoredGrad):
            return False
        rec = grad._record
        with self._lock:
            return (self._records.get(rec.param_key) is rec and rec.watched is not None
                    and all(_is_one(c) for c in rec.watched))

    def scaled_by_one(self, grad: torch.Tensor) -> bool:
        """Whether nothing changed ``grad`` since backward last added to it but products by exactly 1 (a clip that
        did not clip, or none; not an unscaling)."""
        if not isinstance(grad, StoredGrad):
            return True
        with self._lock:
            rec = grad._record
            return not rec.written and all(_is_one(c) for c in rec.scales)

    def _unclaimed(self, rec: _Record) -> None:
        """Wait (the lock held, let go meanwhile) until no queued update is still to read ``rec``."""
        while rec.claims:
            self._claims_released.wait(0.05)

    def __setitem__(self, param_key: str, grad: torch.Tensor) -> None:
        with self._lock:
            self.pop(param_key)
            self._put(param_key, grad, grad.dtype)

    def __contains__(self, param_key: object) -> bool:
        return param_key in self._records or param_key in self._direct

    def __len__(self) -> int:
        return len(self._records) + len(self._direct)

    def clear(self) -> None:
        """Drop every gradient (``zero_grad()``)."""
        with self._lock:
            for k in list(self._records):
                self.pop(k)
            self._direct.clear()

    def zero(self) -> None:
        """Zero every gradient in place (``zero_grad(set_to_none=False)``)."""
        with self._lock:
            records = list(self._records.values())
        for rec in records:  # each zeroed outside the lock: a coded one is decoded first (see ``_reading``)
            if self._records.get(rec.param_key) is rec:  # not let go by an update meanwhile
                self.get(rec.param_key).zero_()
        with self._lock:
            for t in self._direct.values():
                t.zero_()

    def dtype_of(self, param: torch.Tensor) -> torch.dtype:
        """The dtype ``param``'s gradient is kept in."""
        return stored_dtype(param.dtype, self.grad_dtype)

    # ---- operations on a StoredGrad ----------------------------------------------------------
    def apply(self, rec: _Record, func: Any, args: Any, kwargs: Any) -> Any:
        """``func`` on a stored gradient: see [Note: A stored gradient read from outside]. A coded one is decoded
        first where ``func`` needs its values (not for a product by a number or its cached norm)."""
        try:
            return self._apply(rec, func, args, kwargs)
        except _MustDecode:
            pass
        with self._reading(rec):
            return self._apply(rec, func, args, kwargs)

    def _apply(self, rec: _Record, func: Any, args: Any, kwargs: Any) -> Any:
        listed = func in _FOREACH_SCALINGS and len(args) == 2 and isinstance(args[0], (list, tuple)) and \
            len(args[0]) == 1
        scaling = (func in _SCALINGS or listed) and not kwargs and len(args) == 2 and _is_scalar(args[1])
        writes = scaling or _writes_grad(func, args, kwargs)
        with self._lock:
            if writes and not (scaling and rec.watched is not None):  # a watched product waits for no update
                self._unclaimed(rec)
            if self._records.get(rec.param_key) is not rec:
                raise TierStoreError("this gradient was dropped (zero_grad() or a new assignment to .grad since it was "
                                     "read): read param.grad again")
            factor = (args[1].detach().clone() if isinstance(args[1], torch.Tensor) else args[1]) if scaling else None
            rec.written = rec.written or (writes and not scaling)
            if rec.watched is not None and writes:
                rec.watched.append(factor)
            if scaling:
                rec.scales.append(factor)
                rec.norm = None
                rec.generation += 1
                return None if listed else args[0]
            if func is _NORM and not rec.scales and rec.norm is not None and _is_plain_2_norm(args, kwargs):
                return rec.norm.clone()
            with self._held(rec, write=writes) as t:
                out = func(*_swap(args, rec, t), **_swap(kwargs, rec, t))
                if writes:
                    rec.norm = torch.linalg.vector_norm(t, 2.0)
                if out is t:  # an in-place op returns the tensor it was called on
                    return next(g for g in tree_leaves((args, kwargs)) if isinstance(g, StoredGrad))
                return tree_map_only(torch.Tensor, lambda o: _copy_if_shares(o, t), out)

    def read(self, rec: _Record) -> torch.Tensor:
        """A copy of a stored gradient's values."""
        with self._reading(rec), self._lock, self._held(rec, write=False) as t:
            return t.clone()

    # ---- coded gradients (see [Note: A kept gradient coded against its moments] in _grad_code.py) --------------
    def keep_coded(self, grad: torch.Tensor, coded: torch.Tensor, settle: Callable[[], None]) -> bool:
        """Store ``coded`` in place of the values of ``grad`` that :meth:`watched_values` gave, where they are still
        its stored bytes and nothing is about to read them; ``settle()`` decodes it (by :meth:`uncode`). Whether it
        now stands for them. The code is put without the lock held (a put may wait for room)."""
        if not isinstance(grad, StoredGrad):
            return False
        rec = grad._record

        def still() -> bool:
            return (self._records.get(rec.param_key) is rec and rec.coded is None and not rec.readers
                    and rec.watched_stored == rec.stored and not rec.written and all(_is_one(c) for c in rec.scales))

        with self._lock:
            if not still():
                return False
        key = CODE_PREFIX + rec.key
        try:
            self.store.put(key, coded, home=self.home, write_home=False).wait()
        except TierStoreError:  # no room for it now (or backward waits for room): kept as it is
            if key in self.store:
                self.store.drop(key)
            return False
        with self._lock:
            if still():
                self.store.drop(rec.key)
                rec.coded = Coded(key, settle)
                return True
        self.store.drop(key)
        return False

    def is_coded(self, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is still the model's gradient, stored coded."""
        return isinstance(grad, StoredGrad) and grad._record.coded is not None and \
            self._records.get(grad._record.param_key) is grad._record

    def uncode(self, grad: torch.Tensor, decode: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Store the values of a coded gradient again: ``decode(code, out)`` writes them into ``out``. Called by
        whatever ``settle()`` runs, while no update reads or codes it; takes no lock of this store, so that a
        reader waiting for ``settle()`` may hold it."""
        rec = grad._record
        coded = rec.coded
        if coded is None:
            return
        if self._records.get(rec.param_key) is not rec:  # dropped meanwhile, its code with it
            rec.coded = None
            return
        values = torch.empty(rec.shape, dtype=rec.dtype)
        code = self.store.get(coded.key, Tier.HOST)
        try:
            decode(code, values)
        finally:
            self.store.release(coded.key, Tier.HOST)
        self.store.put(rec.key, values, home=self.home, write_home=False).wait()
        rec.coded = None
        self.store.drop(coded.key)

    @contextlib.contextmanager
    def _reading(self, rec: _Record) -> Iterator[None]:
        """Values of ``rec`` are read or written in the block: a coded one is decoded first, and none is coded until
        it ends. Not entered with the lock held: decoding waits for the worker that codes, which takes it."""
        with self._lock:
            rec.readers += 1
        try:
            if rec.coded is not None:
                if self._lock._is_owned():  # type: ignore[attr-defined]
                    raise TierStoreError("internal: a coded gradient read with the gradients' lock held")
                rec.coded.settle()
                if rec.coded is not None and self._records.get(rec.param_key) is rec:
                    raise TierStoreError(f"internal: the gradient of {rec.param_key!r} stayed coded after the "
                                         f"updates speculated with it were settled")
            yield
        finally:
            with self._lock:
                rec.readers -= 1

    def _drop_stored(self, rec: _Record) -> None:
        """Drop what stores ``rec`` (its values, or its code)."""
        coded = rec.coded
        self.store.drop(coded.key if coded is not None else rec.key)

    # ---- inside ---------------------------------------------------------------------------
    def _put(self, param_key: str, grad: torch.Tensor, dtype: torch.dtype) -> None:
        key = grad_key(param_key)
        if key in self.store:  # a queued update still reads the last one, which its parameter's uses wait for
            raise TierStoreError(f"the gradient of {param_key!r} was made while the update queued to read the last "
                                 f"one has not run: its parameter was used without waiting for its update")
        value = grad.detach().to(device="cpu", dtype=dtype)  # in its own layout: channels_last stays so
        if not value.is_contiguous() and dense_strides(value) is None:
            value = value.contiguous()
        self.store.put(key, value, home=self.home, write_home=False).wait()
        self._records[param_key] = _Record(key, param_key, value.shape, value.stride(), dtype,
                                           norm=torch.linalg.vector_norm(value, 2.0))

    @contextlib.contextmanager
    def _held(self, rec: _Record, *, write: bool) -> Iterator[torch.Tensor]:
        """The stored gradient in the host tier with its pending products applied; marked changed after a write."""
        if rec.coded is not None:
            raise _MustDecode
        st = self.store
        t = st.get(rec.key, Tier.HOST)
        try:
            if rec.scales or write:
                st.writing(rec.key).wait()  # a write of its bytes in flight must not see them change
            if rec.scales:
                for s in rec.scales:
                    t.mul_(s)
                rec.scales.clear()
                rec.norm = torch.linalg.vector_norm(t, 2.0)
                st.mark_dirty(rec.key, Tier.HOST)
                rec.stored += 1
            yield t
            if write:
                st.mark_dirty(rec.key, Tier.HOST)
                rec.generation += 1
                rec.stored += 1
        finally:
            st.release(rec.key, Tier.HOST)


def store_key_of(grad: torch.Tensor | None) -> str | None:
    """The store key of a gradient ``GradientSource.get`` gave, or None when it is an ordinary tensor (or stored
    coded: its values are not read ahead)."""
    return grad._record.key if isinstance(grad, StoredGrad) and grad._record.coded is None else None


def generation(grad: torch.Tensor) -> int:
    """What changes whenever the values of a gradient ``GradientSource.get`` gave change."""
    return grad._record.generation if isinstance(grad, StoredGrad) else grad._version


@contextlib.contextmanager
def values_of(grad: torch.Tensor, *, keep_stored: bool = False) -> Iterator[torch.Tensor]:
    """The values of a gradient ``GradientSource.get`` gave, as an ordinary tensor for the length of the block
    (a stored one held in the host tier, read-only). With ``keep_stored`` the stored bytes stay as they are:
    products recorded but not yet applied (the clip coefficient) are applied to a copy, so that a gradient kept
    after its update is not changed by it: one read back from the drive for the update leaves the host tier with no
    write (see [Note: Gradients in the tiers])."""
    if not isinstance(grad, StoredGrad):
        yield grad
        return
    grads, rec = grad._grads, grad._record
    with grads._reading(rec), _plain_values(grads, rec, keep_stored) as t:
        yield t


@contextlib.contextmanager
def _plain_values(grads: GradientStore, rec: _Record, keep_stored: bool) -> Iterator[torch.Tensor]:
    if keep_stored and rec.scales:
        with grads._lock:
            t = grads.store.get(rec.key, Tier.HOST)
            try:
                scaled = _scaled_copy(t, rec.scales)
            finally:
                grads.store.release(rec.key, Tier.HOST)
            yield scaled
        return
    with grads._lock, grads._held(rec, write=False) as t:
        yield t


def _scaled_copy(t: torch.Tensor, scales: list[Any]) -> torch.Tensor:
    """A copy of a stored gradient's values with its pending products applied, as ``_held`` applies them in place:
    the same bits."""
    out = t.clone()
    for s in scales:
        out.mul_(s)
    return out


def _list_length(args: Any) -> int:
    """The length of the first list among a list-wise operation's arguments."""
    return len(next((a for a in args if isinstance(a, (list, tuple))), ()))


def _one_by_one(func: Any, args: Any, kwargs: Any) -> Any:
    """A list-wise operation (``_LISTWISE``) over several stored gradients, run on one list position at a time (each is
    elementwise over its lists): each gradient is read, and written, in turn, and no more than one is in memory. A
    position that holds two stored gradients is then an operation on two, as any other (see ``__torch_dispatch__``)."""
    n = _list_length(args)

    def at(i: int, v: Any) -> Any:
        return [v[i]] if isinstance(v, (list, tuple)) and len(v) == n else v

    outs = [func(*(at(i, a) for a in args), **{k: at(i, v) for k, v in kwargs.items()}) for i in range(n)]
    return None if all(o is None for o in outs) else [o[0] for o in outs]


def _is_one(c: Any) -> bool:
    """Whether a recorded product is by exactly 1 (NaN and a write, None, are not)."""
    if c is None:
        return False
    if isinstance(c, torch.Tensor):
        return c.numel() == 1 and not c.is_complex() and bool(c.item() == 1)
    return not isinstance(c, complex) and c == 1


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) or (
        isinstance(x, torch.Tensor) and not isinstance(x, StoredGrad) and x.dim() == 0 and x.device.type == "cpu")


def _is_plain_2_norm(args: Any, kwargs: Any) -> bool:
    """``linalg_vector_norm(g)`` or ``(g, 2)``: the 2-norm of the whole gradient, in its own dtype."""
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    rest = list(args[2:]) + [v for k, v in kwargs.items() if k != "ord"]
    return ord_ == 2 and all(v in (None, False, []) for v in rest)


def _writes(func: Any, args: Any, kwargs: Any, cls: type) -> bool:
    """Whether ``func`` writes an argument of class ``cls`` (in place: ``mul_``, ``zero_``, ``copy_``; ``out=``), as
    passed or in a list of tensors."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if any(isinstance(v, cls) for v in tree_leaves(value)):
                return True
    return False


def _writes_grad(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``func`` writes a stored gradient among its arguments."""
    return _writes(func, args, kwargs, StoredGrad)


def _swap(tree: Any, rec: _Record, t: torch.Tensor) -> Any:
    def real(g: StoredGrad) -> torch.Tensor:
        if g._record is not rec:
            raise TierStoreError("an operation on two stored gradients at once; read one of them first "
                                 "(.clone() makes an ordinary tensor of it)")
        return t
    return tree_map_only(StoredGrad, real, tree)


def _copy_if_shares(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """An output that shares the stored gradient's memory (a view) outlives the hold: a copy that refuses writes."""
    if out.layout is torch.strided and out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
        return _ReadOnlyView.of(out.clone())
    return out


# What torch refuses on a tensor subclass outright: answered from a copy of the values.
_ON_A_COPY = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__})


class StoredGrad(torch.Tensor):
    """``param.grad`` of an offloaded parameter (see [Note: A stored gradient read from outside])."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _ON_A_COPY and isinstance(args[0], StoredGrad):
            return func(args[0].clone(), *args[1:], **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    _grads: GradientStore
    _record: _Record

    @staticmethod
    def of(grads: GradientStore, rec: _Record) -> StoredGrad:
        g = torch.Tensor._make_wrapper_subclass(StoredGrad, rec.shape, strides=rec.stride, dtype=rec.dtype,
                                                device="cpu")
        g._grads, g._record = grads, rec
        return g

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (_aten.detach.default, _aten.alias.default):  # ``.data``, ``.detach()``: the gradient itself
            g = args[0]
            return StoredGrad.of(g._grads, g._record)
        mine = [g for g in tree_leaves((args, kwargs)) if isinstance(g, StoredGrad)]
        g = mine[0]
        if len({id(x._record) for x in mine}) > 1:  # several: the others are read first, one at a time
            if func.overloadpacket.__name__.startswith(_LISTWISE) and _list_length(args) > 1:
                return _one_by_one(func, args, kwargs)
            first = args[0] if isinstance(args[0], StoredGrad) and _writes_grad(func, args[:1], {}) else None
            if first is None and _writes_grad(func, args, kwargs):  # its write would land in a copy
                raise TierStoreError(f"{func.overloadpacket.__name__} would write a stored gradient while reading "
                                     "another: read the others first (.clone() makes an ordinary tensor of one)")
            values = {id(x._record): x._grads.read(x._record) for x in mine if first is None or x._record is not
                      first._record}
            args, kwargs = tree_map_only(StoredGrad, lambda x: values.get(id(x._record), x), (args, kwargs))
            if first is None:
                return func(*args, **kwargs)
            g = first
        return g._grads.apply(g._record, func, args, kwargs)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        return self.clone()  # its values, as an ordinary tensor

    def __reduce_ex__(self, protocol: Any) -> Any:  # torch.save / pickle: its values, as an ordinary tensor
        return self.clone().__reduce_ex__(protocol)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        with values_of(self) as t:
            return f"StoredGrad({t!r})"


class _ReadOnlyView(torch.Tensor):
    """A copy of a view of a stored gradient: reads work, a write raises (it could not reach the gradient)."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    _value: torch.Tensor

    @staticmethod
    def of(value: torch.Tensor) -> _ReadOnlyView:
        v = torch.Tensor._make_wrapper_subclass(_ReadOnlyView, value.shape, strides=value.stride(),
                                                dtype=value.dtype, device=value.device)
        v._value = value
        return v

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _writes(func, args, kwargs, _ReadOnlyView):
            raise TierStoreError(
                f"{func.overloadpacket.__name__} would write into a view of an offloaded parameter's gradient "
                f"(p.grad[...] or p.grad.view(...)), which is a copy: the gradient lives in the store and would "
                f"not change. Write the gradient itself (p.grad.mul_(...), p.grad.copy_(new), p.grad = new)")
        unwrap = tree_map_only(_ReadOnlyView, lambda v: v._value, (args, kwargs))
        out = func(*unwrap[0], **unwrap[1])
        if any(r.alias_info is not None for r in func._schema.returns):
            return tree_map_only(torch.Tensor, _ReadOnlyView.of, out)
        return out


__all__ = ["GRAD_DTYPES", "GradientStore", "StoredGrad", "check_grad_dtype", "generation", "grad_home", "grad_key",
           "store_key_of", "stored_dtype", "values_of"]
