"""How OffloadedAdamW lays out a parameter's state in the store: moments in fp32, bf16 or 8 bits a value, and the
master of a bf16 weight in fp32, split into 16+16 bits, or none.

[Note: Compressed optimizer state] The store keeps what it is given; the
layout decides what that is, so the drive and the host tier see only the
compressed bytes (4-16 a parameter instead of 12-16):

- moments ``"fp32"``: the parameter's dtype (fp32 for a bf16/fp16 weight), as
  torch.optim.AdamW keeps them, updated by torch's own AdamW (bit-identical);
- ``"bf16"``: each moment rounded to bf16 (nearest, ties to even) after the
  update;
- ``"8bit"``: block-wise dynamic quantization, the semantics of
  bitsandbytes' and torchao's AdamW8bit: blocks of 256 values in the
  parameter's memory order, each stored as its absolute maximum (fp32) and
  one byte a value, the index of the nearest value of the dynamic tree map
  (signed for ``exp_avg``, unsigned for ``exp_avg_sq``; the map of
  "8-bit Optimizers via Block-wise Quantization"), a tie to the larger
  code; a block whose maximum is 0 stores zeros. Blocks of 256 (not 2048,
  that paper's) keep an outlier from flattening more than 255 neighbours, as
  both libraries chose for their CPU/GPU 8-bit Adam. Both moments cost
  2 + 8/256 bytes a value instead of 8. A value is normalised by
  multiplying it by the reciprocal of its block's maximum (one division a
  block; dividing each value made the native update 12% slower). The
  nearest code is that of the normalised value rounded to bf16 first (8
  significant bits), read from a 65,536-entry table indexed by those bits: one gather a value, 2.5x faster
  here than the exact search (a binary search over the 255 midpoints, or
  a table plus a comparison with the midpoint inside its bucket: two
  gathers), and it differs from the exact nearest code only for values
  within half a bf16 step of a midpoint (3% of normal values, each then one
  code off: at most 0.2% of the block's maximum more error than the
  nearest, against the map's own steps of up to 1.4%).

Tensors of fewer than ``MIN_COMPRESSED`` elements (biases, norms: well
under 1% of a transformer's state) keep fp32 moments in every layout, as
both libraries do: compressing them saves nothing and costs accuracy.

Masters of bf16 weights (fp16 weights need ``"fp32"``: an fp16 value is not
the top half of an fp32 one):

- ``"fp32"``: an fp32 master beside the bf16 weight (mixed precision; 6
  bytes a parameter);
- ``"split"``: the master's low 16 bits are stored apart (key ``master``,
  int16) and the weight the forward reads is the master rounded to bf16
  (nearest, a tie away from zero), 4 bytes in all; the master is exact
  (see [Note: A rounded split]);
- ``"none"``: the bf16 weight alone (2 bytes): the update runs in fp32 and is
  stochastically rounded back (away from zero with probability equal to the
  dropped fraction, the noise a hash of the element, the parameter's name
  and the step: [Note: Rounding noise]; a run repeats exactly), which keeps
  small updates from vanishing on average as bf16's rounding to nearest
  would.

[Note: A rounded split] The update joins the halves (the weight's bits, less
one where the low half is 0x8000 or more, since that rounded the weight up;
then the low half), steps the fp32 value and splits it again. The first
version (``split="truncated"``) kept the master's top 16 bits as the
weight, truncated toward zero: Adam's first steps move every value by about
the learning rate, far less than a bf16 unit, and each value moved toward
zero then dropped by a whole unit in the weight the forward reads: a 1B
ViT's loss rose from 2.45 to 5.53 after one step at lr 1e-5 where the fp32
master's rounded weight gave 2.33. State saved so (its layout names no
``split``) loads as it is, each master exactly, and its weights are rounded
again (``AdamWState.resplit_truncated``).

A compressed update decodes, steps and encodes one block at a time in a
native kernel ([Note: One update, two implementations] in _native.py), or,
without one, runs torch operations over slices of ``CHUNK`` elements (fp32
temporaries that stay in the CPU's cache); both run the arithmetic of
[Note: The compressed update's arithmetic] and give the same bits.
"""

from __future__ import annotations

import ctypes
import math
import struct
import threading
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from tierstore import TierStoreError, TierValueError

from . import _native
from ._contract import MASTERED_DTYPES

MOMENTS = ("fp32", "bf16", "8bit")
MASTERS = ("fp32", "split", "none")
BLOCK = 256  # values per 8-bit block
MIN_COMPRESSED = 4096  # elements: smaller tensors keep fp32 moments
CHUNK = 1 << 18  # elements per slice of a compressed update; a multiple of BLOCK (fastest here of 2^14-2^20)


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 values of the dynamic tree quantization map, ascending: 0, 1 and, for each of seven decades
    (10^-6 ... 1), the midpoints of an even split of [0.1, 1] scaled to it, finer in larger decades
    (2^k intervals in decade k, 2^(k+1) unsigned), negated as well where ``signed``."""
    values = [0.0, 1.0]
    for decade in range(7):
        edges = torch.linspace(0.1, 1.0, (2 ** decade if signed else 2 ** (decade + 1)) + 1)
        mids = ((edges[:-1] + edges[1:]) / 2.0 * 10.0 ** (decade - 6)).tolist()
        values += mids + ([-v for v in mids] if signed else [])
    assert len(values) == 256
    return torch.tensor(sorted(values), dtype=torch.float32)


class _Quantizer:
    """Block-wise 8-bit encoding with one map: see [Note: Compressed optimizer state]."""

    def __init__(self, signed: bool) -> None:
        self.map = dynamic_map(signed)
        self.midpoints = (self.map[:-1] + self.map[1:]) / 2
        # The code of every bf16 value in [-1, 1] (indexed by its bit pattern as an int16, plus 2^15): the number
        # of midpoints at or below it, so the nearest map value, a tie to the larger.
        values = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        self.table = torch.bucketize(values.float().clamp(-1, 1), self.midpoints, right=True).to(torch.uint8)

    def encode(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Write ``x`` (fp32, contiguous, len(codes) values) as ``codes`` (uint8) and per-block ``scales``."""
        n = x.numel()
        full = n - n % BLOCK
        if full:
            self._encode_blocks(x[:full].view(-1, BLOCK), codes[:full], scales[:full // BLOCK])
        if full < n:
            self._encode_blocks(x[full:].view(1, -1), codes[full:], scales[full // BLOCK:])

    def _encode_blocks(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
        absmax = x.abs().amax(1, keepdim=True)  # NaN stays NaN: the whole block decodes to NaN
        scales.copy_(absmax.view(-1))
        inverse = torch.ones_like(absmax).div_(absmax.clamp(min=torch.finfo(torch.float32).tiny))
        normal = (x * inverse).to(torch.bfloat16)
        index = normal.view(torch.int16).view(-1).to(torch.int32).add_(1 << 15)
        torch.index_select(self.table, 0, index, out=codes)

    def decode(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The fp32 values of ``codes`` (a multiple of BLOCK, or ending in the tensor's last partial block)."""
        n = codes.numel()
        out = self.map.index_select(0, codes.to(torch.int32))
        full = n - n % BLOCK
        if full:
            out[:full].view(-1, BLOCK).mul_(scales[:full // BLOCK].view(-1, 1))
        if full < n:
            out[full:].mul_(scales[full // BLOCK:])
        return out


SIGNED = _Quantizer(signed=True)
UNSIGNED = _Quantizer(signed=False)


def packed_size(n: int) -> int:
    """Bytes of an 8-bit moment of ``n`` values: fp32 scales of its blocks, then one code a value."""
    return 4 * -(-n // BLOCK) + n


def unpack(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) views of a packed 8-bit moment of ``n`` values."""
    head = 4 * -(-n // BLOCK)
    return packed[head:], packed[:head].view(torch.float32)


def flat(t: torch.Tensor) -> torch.Tensor:
    """A view of a dense tensor's elements in memory order (a contiguous one's are in index order)."""
    if t.is_contiguous():
        return t.view(-1)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _bits16(t: torch.Tensor) -> np.ndarray:
    """A 16-bit tensor's elements in memory order, as numpy's uint16 (no copy for a dense tensor)."""
    return flat(t).view(torch.int16).numpy().view(np.uint16)


def join_master(weight: torch.Tensor, low: torch.Tensor, *, split: str = "nearest") -> torch.Tensor:
    """The fp32 master of a bf16 ``weight`` and the int16 ``low`` half stored beside it (see [Note: A rounded
    split]; ``split="truncated"``: the weight is the master's top half, as the first version stored it), in the
    weight's shape and memory layout."""
    hi, lo = _bits16(weight), _bits16(low)
    if split == "nearest":
        hi = hi - (lo >> np.uint16(15))  # where the low half rounded the weight up (uint16 arithmetic wraps)
    elif split != "truncated":
        raise TierValueError(f"split={split!r}: choose 'nearest' or 'truncated'")
    out = torch.empty_strided(weight.shape, weight.stride(), dtype=torch.float32)
    flat(out).view(torch.int32).numpy().view(np.uint32)[:] = (hi.astype(np.uint32) << np.uint32(16)) | lo
    return out


def split_master(master: torch.Tensor, weight: torch.Tensor, low: torch.Tensor) -> None:
    """Store an fp32 ``master`` (of the weight's memory layout) as its low 16 bits (``low``, int16) and the bf16
    ``weight``, the master rounded to nearest, a tie away from zero (a NaN stays NaN)."""
    if master.stride() != weight.stride():
        master = torch.empty_strided(weight.shape, weight.stride(), dtype=torch.float32).copy_(master)
    bits = flat(master).view(torch.int32).numpy().view(np.uint32)
    top = (bits >> np.uint32(16)).astype(np.uint16)
    lo = (bits & np.uint32(0xFFFF)).astype(np.uint16)
    hi = top + (lo >> np.uint16(15))
    nan = np.isnan(bits.view(np.float32))
    if nan.any():
        hi[nan] = (top[nan] & np.uint16(0x8000)) | np.uint16(0x7FC0)
    _bits16(weight)[:] = hi
    _bits16(low)[:] = lo


def _mix32(h: np.ndarray) -> np.ndarray:
    """compressed_adamw.c's mix32 (murmur3's finalizer) on uint32 values (numpy's uint32 arithmetic wraps)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def rounding_noise(seed: int, start: int, stop: int) -> torch.Tensor:
    """[Note: Rounding noise] The stochastic rounding's noise for elements
    start:stop of one update: element i's is a hash of i and the update's seed
    (``seed_of``), ``mix32((i * 0x9E3779B1) ^ key) & 0xFFFF`` with ``key`` mixed
    from the seed and i's high 32 bits, so any slice of the tensor, on any
    thread, draws the same values, and the native kernel computes them inline
    (drawing them from a torch generator cost the update three quarters of its
    time). int32 values in [0, 2^16), one a value; ``stop - start`` values,
    within one block of 2^32 elements."""
    with np.errstate(over="ignore"):
        seed_lo, seed_hi = np.uint32(seed & 0xFFFFFFFF), np.uint32((seed >> 32) & 0xFFFFFFFF)
        key = _mix32(seed_lo ^ _mix32(np.asarray(seed_hi ^ np.uint32(start >> 32), dtype=np.uint32)))
        index = np.arange(start & 0xFFFFFFFF, (start & 0xFFFFFFFF) + (stop - start), dtype=np.uint64).astype(np.uint32)
        noise = _mix32((index * np.uint32(0x9E3779B1)) ^ key) & np.uint32(0xFFFF)
    return torch.from_numpy(noise.astype(np.int32))


def stochastic_round(value: torch.Tensor, out: torch.Tensor, noise: torch.Tensor) -> None:
    """Round fp32 ``value`` into bf16 ``out``: away from zero with probability (dropped low 16 bits) / 2^16, given
    ``noise``, int32 values uniform in [0, 2^16) (one a value)."""
    bits = value.view(torch.int32)
    rounded = ((bits + noise) >> 16).to(torch.int16).view(torch.bfloat16)
    out.copy_(torch.where(torch.isnan(value), value.to(torch.bfloat16), rounded))  # a NaN stays NaN


def seed_of(name: str, step: float) -> int:
    """The stochastic rounding seed of one parameter's update at one step: a rerun rounds the same way."""
    return (zlib.crc32(name.encode()) << 20) ^ int(step)


@dataclass(frozen=True)
class StateLayout:
    """What an OffloadedAdamW stores per parameter (see [Note: Compressed optimizer state])."""

    moments: str = "fp32"
    master: str = "fp32"
    split: str = "nearest"  # how a split master's weight is made: see [Note: A rounded split]

    def __post_init__(self) -> None:
        if self.moments not in MOMENTS:
            raise TierValueError(f"moments={self.moments!r}: choose one of {', '.join(map(repr, MOMENTS))}")
        if self.master not in MASTERS:
            raise TierValueError(f"master={self.master!r}: choose one of {', '.join(map(repr, MASTERS))}")
        if self.split not in ("nearest", "truncated"):
            raise TierValueError(f"split={self.split!r}: choose 'nearest' (or 'truncated', to read old state)")

    def as_dict(self) -> dict[str, str]:
        out = {"moments": self.moments, "master": self.master}
        return {**out, "split": self.split} if self.master == "split" else out

    @staticmethod
    def from_dict(d: dict[str, str]) -> "StateLayout":
        """The layout ``as_dict()`` named (state saved before split masters were rounded names no ``split``)."""
        d = dict(d)
        if d.get("master") == "split":
            d.setdefault("split", "truncated")
        return StateLayout(**d)

    def describe(self) -> str:
        return (f"moments={self.moments!r}, master={self.master!r}"
                + (f" (split={self.split!r})" if self.master == "split" and self.split != "nearest" else ""))

    def moments_of(self, key: str | None, p: torch.Tensor, numel: int) -> str:
        """How this parameter's moments are stored: "plain" (the moment dtype, today's), "bf16" or "8bit"."""
        if key is None or p.dtype == torch.float64 or numel < MIN_COMPRESSED:
            return "plain"
        return {"fp32": "plain", "bf16": "bf16", "8bit": "8bit"}[self.moments]

    def master_of(self, key: str | None, p: torch.Tensor) -> str | None:
        """How this parameter's master is stored: None (it has none: fp32, fp64 or resident, or ``"none"``),
        "fp32" or "split"."""
        if key is None or p.dtype not in MASTERED_DTYPES or self.master == "none":
            return None
        return self.master

    def is_plain(self, key: str | None, p: torch.Tensor, numel: int) -> bool:
        """Whether this parameter's state is stored as torch keeps it (updated by torch's AdamW on it directly)."""
        return (self.moments_of(key, p, numel) == "plain"
                and (key is None or p.dtype not in MASTERED_DTYPES or self.master == "fp32"))

    def check(self, items: list[tuple[str, str | None, torch.Tensor]]) -> None:
        """Refuse a master layout these parameters cannot have."""
        if self.master == "fp32":
            return
        half = [name for name, key, p in items if key is not None and p.dtype == torch.float16]
        if half:
            raise TierValueError(f"master={self.master!r} needs bf16 weights (an fp16 value is not the top half of an "
                                 f"fp32 one), but {', '.join(half[:4])} {'are' if len(half) > 1 else 'is'} fp16: use "
                                 f"master='fp32', or make the model bf16")

    def moment_tensor(self, how: str, moment_dtype: torch.dtype, shape: torch.Size,
                      stride: tuple[int, ...] | None) -> torch.Tensor:
        """A zero moment stored ``how`` (see :meth:`moments_of`), in the parameter's layout where it has one."""
        if how == "8bit":
            return torch.zeros(packed_size(shape.numel()), dtype=torch.uint8)
        dtype = torch.bfloat16 if how == "bf16" else moment_dtype
        return torch.zeros(shape, dtype=dtype) if stride is None else torch.empty_strided(
            shape, stride, dtype=dtype).zero_()

    def piece_bytes(self, key: str | None, p: torch.Tensor, numel: int, moment_dtype: torch.dtype) -> list[int]:
        """Bytes of each stored piece of this parameter's state: both moments, and its master (the low half
        under ``"split"``) where it has one; not the weight itself."""
        how = self.moments_of(key, p, numel)
        one = (packed_size(numel) if how == "8bit" else numel * (2 if how == "bf16" else moment_dtype.itemsize))
        master = self.master_of(key, p)
        return [one, one] + ([numel * 4] if master == "fp32" else [numel * 2] if master == "split" else [])


def _decode(how: str, stored: torch.Tensor, quantizer: _Quantizer, n: int, start: int, stop: int) -> torch.Tensor:
    """Values start:stop of a stored moment in fp32: a view of a plain one (updated in place)."""
    if how == "plain":
        return stored[start:stop]
    if how == "bf16":
        return stored[start:stop].float()
    codes, scales = unpack(stored, n)
    return quantizer.decode(codes[start:stop], scales[start // BLOCK:-(-stop // BLOCK)])


def _encode(how: str, value: torch.Tensor, stored: torch.Tensor, quantizer: _Quantizer, n: int, start: int,
            stop: int) -> None:
    if how == "bf16":
        stored[start:stop].copy_(value)
    elif how == "8bit":
        codes, scales = unpack(stored, n)
        quantizer.encode(value, codes[start:stop], scales[start // BLOCK:-(-stop // BLOCK)])


@dataclass(frozen=True)
class Constants:
    """The scalars of one compressed update, each an fp32 value (see [Note: The compressed update's arithmetic])."""

    decay: float
    b1: float
    omb1: float
    b2: float
    omb2: float
    bc2_sqrt: float
    eps: float
    step_size: float
    maximize: bool

    @staticmethod
    def of(step: float, hyper: tuple) -> "Constants":
        lr, (beta1, beta2), eps, weight_decay, maximize = hyper
        lr, beta1, beta2 = float(lr), float(beta1), float(beta2)

        def f32(x: float) -> float:
            return struct.unpack("f", struct.pack("f", x))[0]

        return Constants(decay=f32(1.0 - lr * float(weight_decay)), b1=f32(beta1), omb1=f32(1.0 - beta1),
                         b2=f32(beta2), omb2=f32(1.0 - beta2), bc2_sqrt=f32(math.sqrt(1.0 - beta2 ** step)),
                         eps=f32(float(eps)), step_size=f32(lr / (1.0 - beta1 ** step)), maximize=bool(maximize))


def adamw_values(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, c: Constants) -> None:
    """[Note: The compressed update's arithmetic] AdamW on fp32 values, each
    operation one correctly rounded fp32 operation, in this order::

        g = -g                                  (maximize only)
        p = p * decay                           decay = 1 - lr * weight_decay
        m = m * beta1 + g * (1 - beta1)
        v = v * beta2 + (g * g) * (1 - beta2)
        d = sqrt(v) / sqrt(1 - beta2^step) + eps
        p = p - (m / d) * (lr / (1 - beta1^step))

    with the scalars rounded to fp32 once (``Constants``). It is torch's
    AdamW written out (the same result up to the last bits, which depend on
    how torch's kernels order and fuse operations and differ between its own
    implementations): fixed here so that the native kernel (compressed_adamw.c,
    compiled without fused multiply-adds) and these torch operations give the
    same bits, [Note: One update, two implementations]. The fp32 layout keeps
    torch's own AdamW, bit-identical to torch.optim.AdamW."""
    if c.maximize:
        g = torch.neg(g)
    p.mul_(c.decay)
    m.mul_(c.b1).add_(torch.mul(g, c.omb1))
    v.mul_(c.b2).add_(torch.mul(g, g).mul_(c.omb2))
    d = torch.from_numpy(np.sqrt(v.numpy())).div_(c.bc2_sqrt).add_(c.eps)  # IEEE's sqrt: torch's is not, here
    p.sub_(torch.div(m, d).mul_(c.step_size))


_MOMENT_KIND = {"plain": 0, "bf16": 1, "8bit": 2}


def _native_args(moments: str, master: str | None, w: torch.Tensor, lo: torch.Tensor | None, m: torch.Tensor,
                 v: torch.Tensor, g: torch.Tensor, c: Constants) -> _native.UpdateArgs:
    n = w.numel()
    a = _native.UpdateArgs(n=n, moments=_MOMENT_KIND[moments], weight=0 if w.dtype == torch.float32 else
                           1 if master == "split" else 2, grad=0 if g.dtype == torch.float32 else 1,
                           maximize=int(c.maximize), w=w.data_ptr(), low=lo.data_ptr() if lo is not None else None,
                           g=g.data_ptr(), map_m=SIGNED.map.data_ptr(), map_v=UNSIGNED.map.data_ptr(),
                           table_m=SIGNED.table.data_ptr(), table_v=UNSIGNED.table.data_ptr(), decay=c.decay,
                           b1=c.b1, omb1=c.omb1, b2=c.b2, omb2=c.omb2, bc2_sqrt=c.bc2_sqrt, eps=c.eps,
                           step_size=c.step_size)
    if moments == "8bit":
        (mc, ms), (vc, vs) = unpack(m, n), unpack(v, n)
        a.m, a.v, a.m_scales, a.v_scales = mc.data_ptr(), vc.data_ptr(), ms.data_ptr(), vs.data_ptr()
    else:
        a.m, a.v = m.data_ptr(), v.data_ptr()
    return a


def _native_fits(moments: str, w: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors as they are (it reads fp32 and bf16, dense in memory order)."""
    plain_ok = moments != "plain" or (m.dtype == torch.float32 and v.dtype == torch.float32)
    return (plain_ok and g.dtype in (torch.float32, torch.bfloat16) and w.dtype in (torch.float32, torch.bfloat16)
            and all(t.is_contiguous() for t in (w, m, v, g)))


def _in_parallel(fn, args: _native.UpdateArgs, n: int, threads: int) -> None:
    """The kernel over [0, n) in ``threads`` ranges of whole chunks, the last on the calling thread. The helpers
    are threads of this call (tens of microseconds to start, against a millisecond or more of work each): none
    outlives it."""
    parts = min(threads, n // CHUNK)
    bounds = [n * i // parts // CHUNK * CHUNK for i in range(parts)] + [n]
    ref = ctypes.byref(args)
    helpers = [threading.Thread(target=fn, args=(ref, bounds[i], bounds[i + 1]), name="tierstore-update",
                                daemon=True) for i in range(parts - 1)]
    for t in helpers:
        t.start()
    try:
        fn(ref, bounds[-2], n)
    finally:
        for t in helpers:
            t.join()


def compressed_update(*, moments: str, master: str | None, weight: torch.Tensor, low: torch.Tensor | None,
                      exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, step: float,
                      hyper: tuple, seed: int, native: bool | None = None, threads: int = 1) -> None:
    """One AdamW update of a parameter whose state is stored compressed, slice by slice, in the arithmetic of
    [Note: The compressed update's arithmetic].

    ``weight`` is what the update steps: the fp32 master (``master="fp32"``), the bf16 weight (``"split"``,
    with ``low`` its master's low bits; or None: the weight alone, rounded stochastically), or an fp32
    parameter's own values. ``exp_avg``/``exp_avg_sq`` are stored ``moments`` (see StateLayout.moments_of).
    ``native``: the compiled kernel (True), torch operations (False), or the kernel where it was built (None).
    ``threads``: how many threads the kernel may run it on (the caller's and helpers): the element ranges are
    disjoint, and the rounding noise is a function of the element ([Note: Rounding noise]), so the bits do not
    change."""
    n = weight.numel()
    if grad.stride() != weight.stride() or grad.dtype not in (torch.float32, torch.bfloat16):
        # elements paired in memory order
        grad = torch.empty_strided(weight.shape, weight.stride(), dtype=torch.float32).copy_(grad)
    w, g = flat(weight), flat(grad)
    lo = flat(low) if low is not None else None
    m_flat = flat(exp_avg) if moments != "8bit" else exp_avg
    v_flat = flat(exp_avg_sq) if moments != "8bit" else exp_avg_sq
    stepped_in_place = weight.dtype == torch.float32
    c = Constants.of(step, hyper)
    fn = _native.kernel() if native is not False else None
    if native and fn is None:
        raise TierStoreError("the native kernel of the compressed update is not built (see the warning above)")
    if fn is not None and not _native_fits(moments, w, m_flat, v_flat, g):
        fn = None
    args = _native_args(moments, master, w, lo, m_flat, v_flat, g, c) if fn is not None else None
    if args is not None:
        args.seed_lo, args.seed_hi = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
        if threads > 1 and n >= 2 * CHUNK:
            _in_parallel(fn, args, n, threads)
        else:
            fn(ctypes.byref(args), 0, n)
        return
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        m = _decode(moments, m_flat, SIGNED, n, start, stop)
        v = _decode(moments, v_flat, UNSIGNED, n, start, stop)
        if stepped_in_place:
            value = w[start:stop]
        elif master == "split":
            assert lo is not None
            value = join_master(w[start:stop], lo[start:stop])
        else:
            value = w[start:stop].float()
        adamw_values(value, m, v, g[start:stop].float(), c)
        _encode(moments, m, m_flat, SIGNED, n, start, stop)
        _encode(moments, v, v_flat, UNSIGNED, n, start, stop)
        if master == "split":
            assert lo is not None
            split_master(value, w[start:stop], lo[start:stop])
        elif not stepped_in_place:
            stochastic_round(value, w[start:stop], rounding_noise(seed, start, stop))


def decode_state(how: str, stored: torch.Tensor, signed: bool, shape: torch.Size,
                 stride: tuple[int, ...] | None) -> torch.Tensor:
    """A stored moment as fp32 values of the parameter's shape (what state_dict() gives)."""
    if how == "plain":
        return stored.clone()
    out = torch.empty(shape, dtype=torch.float32) if stride is None else torch.empty_strided(
        shape, stride, dtype=torch.float32)
    flat(out).copy_(_decode(how, stored if how == "8bit" else flat(stored), SIGNED if signed else UNSIGNED,
                            out.numel(), 0, out.numel()))
    return out


def encode_state(how: str, value: torch.Tensor, stored: torch.Tensor, signed: bool,
                 stride: tuple[int, ...] | None) -> None:
    """Store moment values ``value`` (of the parameter's shape) into ``stored``: the inverse of
    :func:`decode_state`, up to the rounding of the encoding."""
    if how != "8bit":
        stored.copy_(value)
        return
    n = value.numel()
    source = torch.empty(value.shape, dtype=torch.float32) if stride is None else torch.empty_strided(
        value.shape, stride, dtype=torch.float32)
    source.copy_(value)
    _encode(how, flat(source), stored, SIGNED if signed else UNSIGNED, n, 0, n)
