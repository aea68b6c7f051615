"""A step's micro-batches run layer by layer: each unit's weights read about once forward and once backward a step,
whatever the number of micro-batches, and the activations at the units' boundaries kept in the tiers.

[Note: A layer-major step] ``off.accumulate(step_fn, micro_batches)`` gives
what ``[step_fn(mb) for mb in micro_batches]`` gives, where ``step_fn`` runs
one micro-batch's forward and backward (``loss_fn(model, mb).backward()``,
or transformers' ``Trainer.training_step``), with the same sums in the same
order, so an fp32 run is bit-identical to the loop. How:

- The chain. The *segments* are the modules given to ``offload_model`` as
  ``units`` (a decoder layer each), in the order the forward calls them.
  Each micro-batch's ``step_fn`` runs on a thread of its own, and the threads
  take turns: each runs until its forward reaches the next segment, then
  hands over to the next micro-batch's (a rotation; only one runs at a time).
  So every micro-batch passes through segment k before any passes through
  segment k+1, and segment k's weights, held for the first, are still in
  memory for the others. What the forward does between segments (the
  embedding, the head, the loss: the *glue*) runs as the model wrote it.
- A segment runs without building a graph (``no_grad``): its input (the
  *boundary activation*) is put into the store (see [Note: Activations in the
  tiers]) and its output is returned as a new leaf that requires grad. The
  glue after the last segment, ``step_fn``'s own ``backward()`` included,
  runs on that micro-batch's thread as written, and stops at that leaf.
- Backward, once every ``step_fn`` has returned: for each segment from the
  last, for each micro-batch in order, the segment's forward runs again from
  its boundary activation (with the RNG state it had), and its backward from
  the gradient of its output; its input's gradient is the previous
  segment's output gradient. Then the glue before the first segment, for
  each micro-batch in order. Each backward is one call of its own, so each
  parameter's gradient sums its micro-batches' parts in their order, as the
  loop's backward calls do.
- Values the segments take. A segment may take, besides the previous
  segment's output, any earlier segment's output or a tensor the glue made
  before it (an encoder-decoder's decoder takes its embedding's output and
  the encoder's: see [Note: Values the segments take]).
- Not a chain. A model whose segments do not run so (a segment called
  twice, one tensor given twice, a parameter passed as an argument, a layer
  shared across depth) is found in its first micro-batch's forward, before
  any gradient is made; the step then runs as the loop does, with a warning
  once. A segment's output (but the last's) used by the glue after the
  segments, or taken both by segments and by the glue between them, is found
  when its gradient arrives: the gradients the step made are dropped (they
  were none before it) and it runs as the loop does.
- Random numbers. Each micro-batch draws from a generator of its own: the
  first from the global generator as it is, the i-th (i >= 1) from one seeded
  with ``s + i``, ``s`` drawn from a copy of the global generator; after the
  step the global generator is where the first micro-batch left it. A model
  that draws none (no dropout) is unaffected; with dropout, the step equals
  the loop that seeds each micro-batch so (tested).
- ``use_cache``: a transformers cache given to a segment (by name, or by
  position as GPT-2 gives it) is not passed: the segment runs twice, and its
  rerun would attend to the keys its forward put into the cache.

[Note: Values the segments take] Each tensor needing a gradient that a segment takes is a *value*: a segment's
output (the leaf the step returned for it), or a tensor the glue made (kept with its graph): before the first
segment, or between two (an encoder-decoder's decoder takes its embedding's output, made after the encoder's last
layer, and the encoder's output, through T5's and Whisper's final norm). T5's blocks all take the position bias
their stack's first block made; BART's decoder layers all take the encoder's last layer's output. A
segment's output goes into the store at its first taker (see [Note: Activations in the tiers]) and is read at each
taker's rerun, let go at the last. In the loop's one backward, a value's gradient is the sum of its parts in the
order autograd makes them: the later taker's first, and within one taker in that taker's own order (each use is a
part: T5's attention adds the bias once, cross-attention projects its input twice). The reruns take a value as a
fresh leaf each, so each rerun's parts would sum apart, and adding those sums gives other bits where a taker has
more than one part. So each rerun also backpropagates ``x * 1.0`` (made after the segment's graph, so that autograd
runs it first) with the sum so far as its gradient: the leaf's sum starts from it and adds this taker's parts in
their order, as the loop's does. A value the glue made before segment m gets its whole gradient once segment m has
run again for every micro-batch: that glue's backward then runs, for each micro-batch in order, in one call with
every value it made, as the loop's one backward runs that glue's graph between segment m's and segment m - 1's;
an earlier segment's output it took gets its gradient from it (one taken by both the glue and later segments runs
as the loop). Which glue made a tensor autograd tells: it numbers the nodes it makes on each thread in order, and
the step notes the number at each segment.

[Note: Parameters held around the segments] A module around the segments may own parameters it uses there (a
ViT written as timm writes it adds its class token and position embedding before the first block): its unit holds
them across the segments, for every micro-batch's forward at once (fetched once for the forward, once for the
backward, as a segment's weights are). Used only before the first segment, their gradients' parts come from the
glue's backward, micro-batch after micro-batch, as in the loop. Used after the first segment too (inside a segment,
or by the head), their parts would be summed in another order than the loop's: the gradient of each is looked at
when the segments' backward ends, and one that changed since the step first saw it makes the step run as the loop
(the gradients it made dropped, as for a skip); the warning names them and the ``resident_threshold_bytes`` that
keeps them in memory, with which nothing is held across the segments.

[Note: Activations in the tiers] A boundary activation is a key of the store
(``act/<n>``), put with ``write_home=False`` under the same budgets as the
weights: kept in the host tier while it has room, written to the drive when
the room is needed (no owner claims it, so it goes before any weight, the
least recently used first: the first segment's, needed last), read back one
ahead of its segment's backward, and dropped after it. So a step whose
activations are many times the host budget trains. What stays in memory: the
first segment's input with the glue that made it (its graph), the last
segment's output until the head's backward has run, the gradients between
two segments (one boundary per micro-batch), and small inputs given to every
segment (masks, rotary embeddings).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from tierstore import Tier, TierStoreError

from ._contract import KeptGradients, OffloadedParameters, PassConsumer, note_interrupt
from ._grads import generation
from ._tied import TiedParts, tied_parameters
from ._unit import compiled

if TYPE_CHECKING:
    from tierstore import TierStore

    from ._pass import PassState

ACT_PREFIX = "act/"


class LayerMajorOffload(OffloadedParameters, Protocol):
    """What a layer-major step uses of the offload whose ``accumulate`` runs it (``offload.OffloadedModel``): its
    pass (micro-batches' threads taking turns as one pass), the compute tier, the gradients it keeps, the keys of
    others it ranks (``claimed``: the step's activations), why it last ran as the loop (``layer_major_refused``)
    and the counts of what it ran (``stats``)."""

    store: TierStore
    params: dict[int, Any]  # id of an offloaded parameter -> its record (name, key)
    pass_state: PassState
    compute_tier: Tier
    grads: KeptGradients
    claimed: set[str]
    layer_major_refused: str | None
    stats: Any


class Gathers(Protocol):
    """What a step tells the engine that gathers each segment's parameters (FSDP2 on a rank: see [Note: Layer by
    layer on FSDP2 ranks]); nothing where the pass holds them (``offload_model``). ``orders_glue_between``: the
    parts the glue between segments adds are seen in the kept gradients (see [Note: Values the segments take])."""

    orders_glue_between: bool
    tied_grads: Any  # where a tied parameter's parts are summed (None: the offload's kept gradients)

    def begin(self) -> None: ...

    def forward_passed(self, k: int) -> None: ...

    def before_rerun(self, k: int, last: bool) -> None: ...

    def glue_starts(self) -> None: ...

    def mixed(self) -> str | None: ...

    def end(self, ok: bool) -> None: ...


class _HeldByThePass:
    """``offload_model``'s pass holds a segment's parameters for every micro-batch's forward at once and lets go
    after the last (see [Note: A layer-major step]): nothing to tell."""

    orders_glue_between = True
    tied_grads = None

    def begin(self) -> None:
        pass

    def forward_passed(self, k: int) -> None:
        pass

    def before_rerun(self, k: int, last: bool) -> None:
        pass

    def glue_starts(self) -> None:
        pass

    def mixed(self) -> str | None:
        """Parts summed out of the loop's order are found through the kept gradients (see _backward)."""
        return None

    def end(self, ok: bool) -> None:
        pass


class NotAChain(Exception):
    """The model's segments do not run as a chain (see [Note: A layer-major step]); raised inside a worker."""


class _Stopped(Exception):
    """A worker told to stop: another raised."""


@dataclass(eq=False)
class _Value:
    """A tensor needing a gradient that segments take (see [Note: Values the segments take]): a segment's output
    (a leaf the step made; its value in the store from its first taker on) or one the glue before the first segment
    made (kept, with its graph, for that glue's backward)."""

    ref: weakref.ref  # the tensor, while it lives (``kept`` holds one the glue made until its backward)
    segment: int | None  # the segment whose output it is; None: made by the glue
    region: int = 0  # made by the glue: the segment before which it was made
    kept: torch.Tensor | None = None  # a value made before the first segment, with its graph
    key: str | None = None  # its value in the store, for the segments' reruns
    takers: list[int] = field(default_factory=list)  # the segments that take it, in forward order
    grad: torch.Tensor | None = None  # the sum of its gradient's parts so far, in the loop's order


@dataclass
class _Call:
    """One segment's call for one micro-batch: what its backward runs again."""

    spec: Any  # the (args, kwargs) tree
    leaves: list[Any]  # its leaves; the slots of the values it takes hold None
    inputs: list[tuple[int, _Value]]  # (leaf index, value) of each input that needs a gradient
    rng: tuple[torch.Tensor, torch.Tensor | None]
    autocast: list[tuple[str, torch.dtype]]  # the devices whose autocast was on, and its dtype
    outputs: list[_Value] = field(default_factory=list)  # its outputs' values (floating point ones, in order)
    last_outputs: list[torch.Tensor] = field(default_factory=list)  # the last segment's: the head's part in .grad


def _autocast_state() -> list[tuple[str, torch.dtype]]:
    return [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]


def _is_cache(value: Any) -> bool:
    return any(c.__name__.endswith("Cache") and c.__module__.startswith("transformers.") for c in type(value).__mro__)


def _rng_state() -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def _forked_rng(n: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each micro-batch's generator state (see [Note: A layer-major step]); the global generator is not drawn."""
    first = _rng_state()
    return [first] + [(torch.Generator().manual_seed(seed).get_state(), None if first[1] is None else
                       _cuda_seeded(seed)) for seed in micro_batch_seeds(n)[1:] if seed is not None]


def _cuda_seeded(seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return g.get_state()


def micro_batch_seeds(n: int) -> list[int | None]:
    """What :func:`_forked_rng` seeds each micro-batch's generator with (None: the global generator as it is), for
    a loop that draws as a layer-major step does (tests, benchmarks)."""
    copy = torch.Generator()
    copy.set_state(torch.get_rng_state())
    seed = int(torch.randint(0, 2**62, (1,), generator=copy))
    return [None] + [seed + i for i in range(1, n)]


class _Rotation:
    """Threads that take turns, one running at a time, in a fixed order (see [Note: A layer-major step]).

    Stopped (a thread raised, or Ctrl-C on the caller's thread), each thread that has run unwinds its forward at
    its turn, one at a time as they ran, since they share the pass's state; one that never ran ends at once."""

    def __init__(self, n: int, rng: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        self.cond = threading.Condition()
        self.turn = -1  # nobody's until begin()
        self.live = [True] * n
        self.ran = [False] * n
        self.rng = rng
        self.error: BaseException | None = None
        self.entered = [threading.Event() for _ in range(n)]  # set by each thread first
        self.ended = [threading.Event() for _ in range(n)]  # and as it ends

    def wait_ended(self, started: int) -> None:
        """Until every thread started has ended: those whose ``start()`` returned, and the one whose start a
        Ctrl-C interrupted, if it runs. Not ``Thread.join``: a join that a Ctrl-C interrupts marks its thread
        ended while it still runs (Python 3.11), and the threads must be done with the pass before the caller
        goes on."""
        for i in range(min(started + 1, len(self.ended))):
            if i == started and not self.entered[i].wait(timeout=1.0):
                return
            self.ended[i].wait()

    def begin(self) -> None:
        """Every thread is started: the first one's turn."""
        with self.cond:
            if self.turn == -1:
                self._pass_on(-1)

    def wait(self, i: int) -> None:
        """Until ``i``'s turn; raises ``_Stopped`` once the step is stopped: at its turn, or at once if it never
        ran."""
        with self.cond:
            while self.turn != i and not (self.error is not None and not self.ran[i]):
                self.cond.wait()
            if self.error is not None:
                raise _Stopped()
            self.ran[i] = True
        _set_rng_state(self.rng[i])

    def has_turn(self, i: int) -> bool:
        with self.cond:
            return self.turn == i

    def hand_over(self, i: int, *, done: bool = False) -> None:
        self.rng[i] = _rng_state()
        with self.cond:
            if done:
                self.live[i] = False
            self._pass_on(i)

    def leave(self, i: int) -> None:
        """Thread ``i`` ends (stopped): the turn, if it was its, goes on."""
        with self.cond:
            self.live[i] = False
            if self.turn == i:
                self._pass_on(i)
            self.cond.notify_all()

    def _pass_on(self, i: int) -> None:
        n = len(self.live)
        nxt = next((j % n for j in range(i + 1, i + 1 + n) if self.live[j % n]), None)
        self.turn = -1 if nxt is None else nxt
        self.cond.notify_all()

    def stop(self, error: BaseException, *, first: bool = False) -> None:
        """Every thread stops at its next turn; ``error`` is what the step raises (the first one unless ``first``:
        a Ctrl-C on the caller's thread goes before what a thread raised)."""
        with self.cond:
            if self.error is None or first:
                self.error = error
            if self.turn == -1:  # stopped before it began: the threads that never ran end at once
                self._pass_on(-1)
            self.cond.notify_all()


class LayerMajorStep(PassConsumer):
    """One ``off.accumulate(...)`` call (see [Note: A layer-major step]); while it runs, a consumer of the model's
    passes whose next uses are its activations (see [Note: Activations in the tiers], [Note: Consumers of a
    pass])."""

    def __init__(self, off: LayerMajorOffload, segments: Sequence[nn.Module], gathers: Gathers | None = None) -> None:
        self.off = off
        self.gathers = gathers or _HeldByThePass()
        self.ending = False  # the gathers' end: FSDP2's last post-backward (see completes)
        self.segments = list(segments)
        self.index = {id(m): k for k, m in enumerate(self.segments)}
        self.store = off.store
        self.home = Tier.NVME if off.store.swap_directory is not None else Tier.HOST
        self.workers: dict[int, int] = {}  # thread ident -> micro-batch
        # Activation key -> its place in the backward's order. Read by evicting threads (``next_uses``): replaced whole
        # on each change, never changed in place, so a reader iterates one that no thread changes.
        self._uses: dict[str, int] = {}
        self._now = -1  # the place the backward has reached
        self.calls: list[list[_Call]] = []  # [segment][micro-batch]
        self.next_segment: list[int] = []
        self.reached: list[str] = []  # skips into a segment's output from the glue after it
        self.values: list[dict[int, _Value]] = []  # [micro-batch]: id of a tensor segments take -> its value
        self.backward_started = False
        self._keys = 0
        self._devices: dict[str, torch.device] = {}  # each kept value's device, where the compute tier is not it
        self._handles: list[Any] = []
        # Parameters a unit around the segments holds across them (see [Note: Parameters held around the
        # segments]): store key -> (the unit, the parameter, its gradient and that gradient's generation when seen).
        self.held_across: dict[str, tuple[Any, Any, Any]] = {}
        # Tied trainable parameters (see [Note: Tied parameters layer by layer]), and where the backward stands for
        # them: inside the segments, or in which micro-batch's glue before the first segment.
        self.tied = TiedParts(self, [(name, off.params[i].key, off.params[i].param, owners)
                                     for i, (name, owners) in tied_parameters(off.model).items()
                                     if i in off.params and off.params[i].param.requires_grad],
                              self.gathers.tied_grads)
        self.in_segments_backward = False
        self.glue_micro_batch: int | None = None
        self.rerun_micro_batch: int | None = None
        self.n = 0  # micro-batches

    # ---- forward, on the workers ----------------------------------------------------------
    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        i = self.workers.get(threading.get_ident())
        if i is None:  # the backward's reruns, on the caller's thread
            return None
        k = self.index[id(module)]
        if k != self.next_segment[i]:
            raise NotAChain(f"segment {k} ({type(module).__name__}) ran where segment {self.next_segment[i]} was next "
                            f"(a segment called twice, or out of order)")
        for u, _ in self.off.pass_state.running:  # see [Note: Parameters held around the segments]
            for sp in u.params:
                if sp.key not in self.held_across and sp.key not in self.tied.by_key:
                    self.held_across[sp.key] = (u, sp, self._grad_state(sp.key))
        self._switch(i)
        args = tuple(None if _is_cache(v) else v for v in args)  # GPT-2 passes its cache by position
        kwargs = {name: (None if _is_cache(v) else v) for name, v in kwargs.items()}
        with torch.enable_grad():  # what the glue made before now, autograd numbered below this (a thread's own)
            self.marks[i].append((torch.zeros((), requires_grad=True) * 1).grad_fn._sequence_nr())
        leaves, spec = tree_flatten((args, kwargs))
        leaves = list(leaves)
        inputs = []
        for j, t in enumerate(leaves):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                if any(leaves[at] is t for at, _ in inputs):
                    raise NotAChain(f"segment {k} takes one tensor needing a gradient twice")
                inputs.append((j, self._taken(t, k, i)))
        assert len(self.calls[k]) == i
        for j, _ in inputs:
            leaves[j] = None
        self.calls[k].append(_Call(spec, leaves, inputs, _rng_state(), _autocast_state()))
        self.next_segment[i] = k + 1
        self._grad_mode[i] = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        return args, kwargs

    def _post(self, module: nn.Module, args: Any, output: Any) -> Any:
        i = self.workers.get(threading.get_ident())
        if i is None:
            return None
        k = self.index[id(module)]
        torch.set_grad_enabled(self._grad_mode[i])
        if output is None or len(self.calls[k]) <= i:
            return None
        leaves, spec = tree_flatten(output)
        made = [t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                for t in leaves]
        call = self.calls[k][i]
        ys = [t for t in made if isinstance(t, torch.Tensor) and t.requires_grad]
        call.outputs = [_Value(weakref.ref(y), k) for y in ys]
        self.values[i].update((id(y), v) for y, v in zip(ys, call.outputs))
        if k == len(self.segments) - 1:
            call.last_outputs = ys  # the head's backward leaves their gradients' parts in .grad
        else:
            for y in ys:  # used by the glue after a later segment (see [Note: Values the segments take])
                y.register_hook(lambda g, k=k: None if self.backward_started else
                                self.reached.append(f"segment {k}'s output"))
        if i == self.n - 1:  # every micro-batch has passed it
            self.gathers.forward_passed(k)
        return tree_unflatten(made, spec)

    def _taken(self, t: torch.Tensor, k: int, i: int) -> _Value:
        """The value of ``t``, an input of segment ``k`` that needs a gradient, in micro-batch ``i``: a segment's
        output (its value into the store at its first taker), or one made before the first segment (see [Note:
        Values the segments take])."""
        v = self.values[i].get(id(t))
        if v is None or v.ref() is not t:
            if isinstance(t, nn.Parameter):  # its value is the store's, held only while its unit runs
                raise NotAChain(f"segment {k} takes a parameter as an argument")
            made = 0 if t.grad_fn is None else t.grad_fn._sequence_nr()
            v = _Value(weakref.ref(t), None, region=next(m for m in range(k + 1) if self.marks[i][m] > made), kept=t)
            self.values[i][id(t)] = v
            if t.grad_fn is not None:  # used by the glue after the segments: its graph would be run too early
                t.register_hook(lambda g: self.reached.append("a tensor made before the first segment") if
                                not self.backward_started else None)
        elif v.segment is not None and v.key is None:  # its value for the reruns
            v.key = self.keep(t, self._place(k, i))
        v.takers.append(k)
        if v.key is not None:  # ranked by its next use in backward: its last taker's rerun
            self._uses = {**self._uses, v.key: self._place(k, i)}
        return v

    def _place(self, k: int, i: int) -> int:
        """The backward's place of segment ``k``'s rerun for micro-batch ``i``."""
        return (len(self.segments) - 1 - k) * len(self.next_segment) + i

    def _grad_state(self, key: str) -> tuple[Any, int | None]:
        """The gradient kept for ``key`` and its generation (what changes when a part is added to it)."""
        g = self.off.grads.get(key)
        return g, None if g is None else generation(g)

    def _switch(self, i: int, *, done: bool = False) -> None:
        """Hand over to the next micro-batch's thread and wait for this one's turn; each thread's part of the pass
        (its running units, its saved-tensor hooks) is its own, swapped in with its turn."""
        self.contexts[i] = self.off.pass_state.thread_part()
        self.rotation.hand_over(i, done=done)
        if not done:
            self._wait(i)

    def _wait(self, i: int) -> None:
        try:
            self.rotation.wait(i)
        except _Stopped:
            if self.rotation.has_turn(i):  # it unwinds its forward now: with its own part of the pass
                self.off.pass_state.set_thread_part(self.contexts[i])
            raise
        self.off.pass_state.set_thread_part(self.contexts[i])

    def _worker(self, i: int, step_fn: Callable[[Any], Any], mb: Any, results: list) -> None:
        self.workers[threading.get_ident()] = i  # one pass with the others (see PassState.group)
        self.rotation.entered[i].set()
        try:
            self._wait(i)
            results[i] = step_fn(mb)
            if self.reached:
                raise NotAChain(f"{self.reached[0]} was used after the segment that follows it")
            if self.next_segment[i] != len(self.segments):
                raise NotAChain(f"micro-batch {i} ran {self.next_segment[i]} of the {len(self.segments)} segments")
            self._switch(i, done=True)
        except _Stopped:
            self.rotation.leave(i)
        except BaseException as e:  # noqa: BLE001 (handed to the caller)
            self.rotation.stop(e)
            self.rotation.leave(i)
        finally:
            self.rotation.ended[i].set()

    def run(self, step_fn: Callable[[Any], Any], micro_batches: Sequence[Any]) -> list[Any]:
        n = self.n = len(micro_batches)
        self.calls = [[] for _ in self.segments]
        self.values = [{} for _ in range(n)]
        self.marks: list[list[int]] = [[] for _ in range(n)]  # autograd's number at each segment (see _taken)
        self.states_at_start = self._grad_states()
        self.next_segment = [0] * n
        self._grad_mode = [True] * n
        self.rotation = _Rotation(n, _forked_rng(n))
        start = self.rotation.rng[0]  # a step that raises leaves the global generator here, for the loop after it
        self.contexts: list[tuple[Any, ...]] = [([], [], None, 0) for _ in range(n)]
        results: list[Any] = [None] * n
        for m in self.segments:
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True))
            self._handles.append(m.register_forward_hook(self._post, always_call=True))
        self._handles.extend(self.tied.hook(self._not_a_chain))
        self.off.attach(self)  # its activations ranked for eviction (see [Note: Activations in the tiers])
        self.gathers.begin()
        passes = self.off.pass_state
        threads = [threading.Thread(target=self._worker, args=(i, step_fn, mb, results),
                                    name=f"tierstore-micro-batch-{i}") for i, mb in enumerate(micro_batches)]
        passes.group = self.workers
        started = 0
        try:
            try:
                for t in threads:
                    t.start()
                    started += 1
                self.rotation.begin()
                self.rotation.wait_ended(started)
            except BaseException as e:  # Ctrl-C while the threads run: each stops at its next turn
                self.rotation.stop(e, first=True)
                self.rotation.wait_ended(started)
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            passes.end_group()
        first_rng = self.rotation.rng[0]
        if self.rotation.error is not None:
            _set_rng_state(start)
            self.gathers.end(ok=False)
            self._drop_activations()
            passes.clear()
            reached = ", ".join(map(str, self.next_segment))
            note_interrupt(self.rotation.error, f"off.accumulate was stopped in its forward, its micro-batches past "
                                                f"{reached} of their {len(self.segments)} segments; what it held was "
                                                f"let go: call opt.zero_grad() and run the step again", self.store)
            raise self.rotation.error
        try:
            self._backward(n)
            self.ending = True
            self.gathers.end(ok=True)
        except BaseException as e:
            _set_rng_state(start)
            self.gathers.end(ok=False)  # the gathers and unsharded gradients let go (again, if its end raised)
            note_interrupt(e, "off.accumulate was stopped in its backward; call opt.zero_grad() and run the step "
                              "again", self.store)
            raise
        finally:
            self._drop_activations()
        _set_rng_state(first_rng)
        return results

    @staticmethod
    def _not_a_chain(why: str) -> None:
        raise NotAChain(why)

    def takes_part(self, key: str, grad: torch.Tensor) -> bool:
        return self.tied.take(key, grad)  # see [Note: Tied parameters layer by layer]

    def glue_place(self, i: int) -> int:
        """The backward's place of micro-batch ``i``'s glue before the first segment (after every segment's)."""
        return len(self.segments) * len(self.next_segment) + i

    def keep(self, value: torch.Tensor, place: int) -> str:
        """Put ``value`` into the store as an activation is (see [Note: Activations in the tiers]), used at the
        backward's ``place``; its key."""
        key = f"{ACT_PREFIX}{id(self)}/{self._keys}"
        self._keys += 1
        self._uses = {**self._uses, key: place}
        self.off.claimed.add(key)
        self.store.put(key, value.detach(), self.home, write_home=False)
        self._devices[key] = value.device  # a GPU rank's store may compute on the host (FSDP2 gathers there)
        return key

    def take_kept(self, key: str) -> torch.Tensor:
        """A value :meth:`keep` put, let go by the store."""
        x = self.store.get(key, self.off.compute_tier).detach().clone().to(self._devices.pop(key))
        self.store.release(key, self.off.compute_tier)
        self.store.drop(key)
        self.off.claimed.discard(key)
        self._uses = {k: at for k, at in self._uses.items() if k != key}
        return x

    # ---- backward, on the caller's thread ------------------------------------------------------
    def _grad_states(self) -> dict[str, tuple[Any, int | None]]:
        """Each parameter's gradient (by store key or, resident, by name) and what changes as a part is added:
        which parameters a stretch of the backward added to (see [Note: Values the segments take])."""
        out = {sp.key: self._grad_state(sp.key) for sp in self.off.params.values() if sp.key not in self.tied.by_key}
        for name, p in self.off.resident.items():
            out[name] = (p.grad, None if p.grad is None else p.grad._version)
        return out

    def _check_glue_parts(self, stretches: list[tuple[int, dict, dict]]) -> None:
        """A parameter the glue between two segments adds to (``stretches``: region, or -1 for another stretch of
        the step, with the gradients before and after it) must get no part elsewhere: the loop's one backward
        would sum its parts first."""
        changed = [(r, {k for k, (g, gen) in after.items() if k not in before or before[k][0] is not g
                        or before[k][1] != gen}) for r, before, after in stretches]
        for r, keys in changed:
            if r > 0 and keys:
                twice = keys & set().union(*(other for r2, other in changed if r2 != r))
                if twice:
                    raise NotAChain(f"{', '.join(sorted(twice)[:3])} get gradient parts in the glue between segments "
                                    f"{r - 1} and {r} and elsewhere: they would be summed in another order than the "
                                    f"loop's")

    def _backward(self, n: int) -> None:
        self.backward_started = True
        # The segments the glue made values before (but the first): its backward runs after theirs, and what it adds
        # to is watched (see _check_glue_parts). None in a model whose segments follow one another.
        between = {v.region for values in self.values for v in values.values() if v.kept is not None and v.region}
        if between and not self.gathers.orders_glue_between:
            raise NotAChain("the glue between segments makes values later segments take (an encoder-decoder), "
                            "which runs as the loop on FSDP2 ranks")
        stretches = []  # (region, or -1 for any other stretch of the step; the gradients before it, after it)
        states = self._grad_states() if between else {}
        if between:
            stretches.append((-1, self.states_at_start, states))  # the forward's: the head's parts
        for call in self.calls[-1]:  # the head's parts of the last segment's outputs
            for v, y in zip(call.outputs, call.last_outputs):
                v.grad = y.grad
            call.last_outputs = []
        order = [(k, i) for k in reversed(range(len(self.segments))) for i in range(n)]
        self._check_tied()
        self.in_segments_backward = True
        for step, (k, i) in enumerate(order):
            self._now = step
            call = self.calls[k][i]
            if step + 1 < len(order):
                for _, v in self.calls[order[step + 1][0]][order[step + 1][1]].inputs:
                    if v.key is not None:
                        self.store.prefetch(v.key, Tier.HOST)
            self.gathers.before_rerun(k, last=i == n - 1)
            self._rerun(k, i, call)
            for v in call.outputs:  # every taker has run: its gradient went into this segment's
                v.grad = None
            call.outputs = []
            if k in between and i == n - 1:  # the glue between segments k - 1 and k
                self.in_segments_backward = False
                before = self._grad_states()
                stretches.append((-1, states, before))
                for j in range(n):
                    self._glue_backward(k, j)
                states = self._grad_states()
                stretches.append((k, before, states))
                self.in_segments_backward = True
        self.in_segments_backward = False
        self._check_tied()
        if between:
            after = self._grad_states()
            stretches.append((-1, states, after))
        for u, sp, before in self.held_across.values():
            now = self._grad_state(sp.key)
            if now[0] is not before[0] or now[1] != before[1]:
                raise NotAChain(f"{_held_across(u)}; {sp.name} has gradient parts from after the first segment, "
                                f"which would be summed in another order than the loop's")
        self.gathers.glue_starts()
        for i in range(n):  # the glue before the first segment, each micro-batch in order
            self._now = self.glue_place(i)
            self._glue_backward(0, i)
            self._check_tied()
            self.tied.glue_done(i)
        if between:
            stretches.append((-1, after, self._grad_states()))
            self._check_glue_parts(stretches)
        mixed = self.gathers.mixed()
        if mixed is not None:
            raise NotAChain(mixed)
        self.tied.end()

    def _glue_backward(self, region: int, i: int) -> None:
        """Micro-batch ``i``'s glue before segment ``region`` backward, from the gradients of the values it made,
        in one call as the loop's backward runs this glue's graph; an earlier segment's output it took gets its
        gradient so (see [Note: Values the segments take])."""
        made = [v for v in self.values[i].values() if v.kept is not None and v.region == region]
        roots = [(v.kept, v.grad) for v in made if v.grad is not None]
        self.glue_micro_batch = i
        try:
            if roots:
                torch.autograd.backward([t for t, _ in roots], [g for _, g in roots])
        finally:
            self.glue_micro_batch = None
        for v in made:
            v.kept = v.grad = None
        if region:
            for w in self.values[i].values():
                y = w.ref() if w.segment is not None else None
                if y is not None and y.grad is not None:
                    if w.grad is not None:
                        raise NotAChain(f"segment {w.segment}'s output is taken by later segments and by the "
                                        f"glue between segments {region - 1} and {region}")
                    w.grad, y.grad = y.grad, None

    def _rerun(self, k: int, i: int, call: _Call) -> None:
        """Segment ``k``'s forward again from its inputs' values, and its backward from its outputs' gradients;
        each input's gradient so far goes first into the sum its parts join (see [Note: Values the segments
        take])."""
        leaves = list(call.leaves)
        xs = []
        for j, v in call.inputs:
            x = self._value_of(v, k, i)
            leaves[j] = x
            xs.append((x, v))
        args, kwargs = tree_unflatten(leaves, call.spec)
        before = _rng_state()
        _set_rng_state(call.rng)
        self.rerun_micro_batch = i
        with torch.enable_grad(), contextlib.ExitStack() as autocasts:
            for device, dtype in call.autocast:  # as the forward ran it (Trainer's bf16=True)
                autocasts.enter_context(torch.autocast(device, dtype=dtype))
            out = self.segments[k](*args, **kwargs)
            # made after the segment's graph, so autograd runs them first: each sum so far, then this segment's parts
            first = [(x * 1.0, v.grad) for x, v in xs if v.grad is not None]
        _set_rng_state(before)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        pairs = [(o, v.grad) for o, v in zip(outs, call.outputs) if v.grad is not None and o.requires_grad] + first
        try:
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        finally:
            self.rerun_micro_batch = None
        for x, v in xs:
            if x.grad is not None:
                v.grad = x.grad

    def completes(self, key: str) -> bool:
        """Whether the gradient of ``key`` backward completed just now is the step's: micro-batch n - 1's backward
        (the head's in the forward, a segment's rerun, the glue's), of a parameter with no tied parts to come."""
        i = self.workers.get(threading.get_ident())
        if i is None:
            i = self.glue_micro_batch if self.glue_micro_batch is not None else self.rerun_micro_batch
        return (i == self.n - 1 or self.ending) and key not in self.tied.by_key

    def _value_of(self, v: _Value, k: int, i: int) -> torch.Tensor:
        """A fresh leaf of the value segment ``k`` takes: from the store (let go at its first taker, the last
        rerun that needs it), or the tensor made before the first segment."""
        if v.key is None:
            assert v.kept is not None
            return v.kept.detach().requires_grad_(v.kept.requires_grad)
        if k == v.takers[0]:
            return self.take_kept(v.key).requires_grad_(True)
        x = self.store.get(v.key, self.off.compute_tier).detach().clone().to(self._devices[v.key])
        self.store.release(v.key, self.off.compute_tier)
        earlier = max(t for t in v.takers if t < k)
        self._uses = {**self._uses, v.key: self._place(earlier, i)}
        return x.requires_grad_(True)

    def _check_tied(self) -> None:
        if self.tied.bad is not None:
            raise NotAChain(self.tied.bad)

    def next_uses(self) -> dict[str, int]:
        """Each activation still to be used: how many segment backwards away its use is (on an evicting thread)."""
        uses, now = self._uses, self._now
        return {key: at - now for key, at in uses.items()}

    def _drop_activations(self) -> None:
        """Let go of the step's activations (those not used yet: a step that raised) and of their ranking."""
        self.off.detach(self)
        self.off.claimed.difference_update(self._uses)
        left, self._uses = self._uses, {}
        for key in left:  # the boundaries' and the tied parameters' parts not taken
            if self.store.contains(key):
                self.store.drop(key)
        for calls in self.calls:
            for call in calls:
                call.outputs = []
                call.last_outputs = []
        self.values = []


def _held_across(unit: Any) -> str:
    """A unit around the segments holds these parameters across them, and what makes the step run layer by layer
    however they are used: those parameters kept resident."""
    params = sorted(unit.params, key=lambda sp: -sp.nbytes)
    names = ", ".join(f"{sp.name} ({sp.nbytes} bytes)" for sp in params[:4]) + (", ..." if len(params) > 4 else "")
    return (f"unit {unit.name!r} holds its parameters across the segments ({names}); kept resident "
            f"(offload_model(..., resident_threshold_bytes={params[0].nbytes + 1}) keeps them and every smaller "
            f"parameter in memory), they would run layer by layer")


def _refusal(off: LayerMajorOffload, segments: Sequence[nn.Module]) -> str | None:
    """Why ``off``'s model cannot run layer by layer, seen before it runs: no segments, a compiled segment, or a
    trainable tied parameter kept resident (its gradient's parts, added by torch as they come, would be summed in
    another order than the loop's; offloaded, they are summed as the loop sums them: see [Note: Tied parameters
    layer by layer])."""
    if not segments:
        return ("no units were given to offload_model (units=[DecoderLayer]): there is no chain of segments to run "
                "layer by layer")
    for m in segments:
        if compiled(m) is not None:
            return (f"{type(m).__name__} is compiled: a compiled unit runs hooks inside its compiled code, and the "
                    f"step's hooks switch threads")
    params = {id(p): p for p in off.model.parameters()}
    for i, (name, _) in tied_parameters(off.model).items():
        if i not in off.params and params[i].requires_grad:
            return (f"parameter {name!r} is tied (used in two places) and kept resident: its gradient's parts from "
                    f"the two places would be summed in another order than the loop's (offloaded, lower "
                    f"resident_threshold_bytes below its {params[i].nbytes} bytes, they are not)")
    return None


def run_layer_major(off: LayerMajorOffload, step_fn: Callable[[Any], Any], micro_batches: Sequence[Any],
                    segments: Sequence[nn.Module], *, gathers: Callable[[], Gathers] | None = None,
                    refused: str | None = None) -> list[Any]:
    """``[step_fn(mb) for mb in micro_batches]``, layer by layer where the model runs as a chain of ``segments``;
    else as the loop, with a warning once (see [Note: A layer-major step]). ``gathers`` makes what each step tells
    the engine that gathers the segments' parameters; ``refused`` says why the caller found the model cannot run
    layer by layer. Meanwhile ``off.final_gradients`` says which gradients backward completes are the step's (see
    [Note: Speculated updates])."""
    try:
        return _run_layer_major(off, step_fn, micro_batches, segments, gathers, refused)
    finally:
        off.final_gradients = None


def _run_layer_major(off: LayerMajorOffload, step_fn: Callable[[Any], Any], micro_batches: Sequence[Any],
                     segments: Sequence[nn.Module], gathers: Callable[[], Gathers] | None,
                     refused: str | None) -> list[Any]:
    micro_batches = list(micro_batches)
    if off.layer_major_refused is None:
        refused = refused or _refusal(off, segments)
        if refused is not None:
            _refuse(off, refused)
    if off.layer_major_refused is None and micro_batches:
        had_grads = len(off.grads) > 0 or any(p.grad is not None for p in off.resident.values())
        step = LayerMajorStep(off, segments, None if gathers is None else gathers())
        try:
            off.final_gradients = step.completes  # see [Note: Speculated updates]
            results = step.run(step_fn, micro_batches)
        except NotAChain as e:
            if had_grads:
                raise TierStoreError(f"this model does not run as a chain of its units ({e}), found after the step "
                                     f"had added to gradients kept from before it: run the micro-batches one after "
                                     f"another instead of off.accumulate") from e
            off.zero_grad()  # what the step made before it was found (none where it was found in the forward)
            _refuse(off, str(e))
        else:
            if not off.stats.layer_major_steps:  # said once, as a fallback is
                print(f"tierstore: off.accumulate runs the micro-batches layer by layer ({len(micro_batches)} "
                      f"through {len(segments)} units; off.stats.layer_major_steps counts the steps)",
                      file=sys.stderr)
            off.stats.layer_major_steps += 1
            return results
    off.stats.loop_steps += 1
    results = []
    for j, mb in enumerate(micro_batches):
        off.final_gradients = _final if j == len(micro_batches) - 1 else _not_final
        results.append(step_fn(mb))
    return results


def _final(key: str) -> bool:
    return True


def _not_final(key: str) -> bool:
    return False


def _refuse(off: LayerMajorOffload, reason: str) -> None:
    """From now on ``off``'s steps run as the loop; said once."""
    off.layer_major_refused = reason
    warnings.warn(f"tierstore: the micro-batches run one after another, not layer by layer: {reason} (docs/"
                  f"layer-major.md lists what runs as the loop, and what to do where something can be done)",
                  stacklevel=4)


__all__ = ["ACT_PREFIX", "Gathers", "LayerMajorStep", "NotAChain", "micro_batch_seeds", "run_layer_major"]
