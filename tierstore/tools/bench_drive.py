"""`tierstore bench drive`: the store's NVMe path against fio on the same file size and block size, and its CPU
seconds per GB against a bare preadv/pwritev thread pool (GB/s alone cannot show the engine's cost here: the
drive's rate swings more from run to run than the engines differ).

Runs alternate (store, fio, store, fio ...), several rounds, and reports
medians and ratios, because this class of disk swings by 2x from run to run.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from tierstore import StoreConfig, Tier, TierStore, TierValueError
from tierstore.memory import aligned_empty

MIB = 1024**2


@dataclass(frozen=True, kw_only=True)
class DriveBenchConfig:
    path: str
    """Directory on the drive to measure."""
    size_mib: int = 8192
    """Bytes written then read per round, in MiB."""
    tensor_mib: int = 64
    """Size of each tensor the store moves (a layer's shard)."""
    block_size_bytes: int = StoreConfig.block_size_bytes
    queue_depth: int = StoreConfig.queue_depth
    io_threads: int = StoreConfig.io_threads
    fio_iodepth: int = 32
    rounds: int = 3
    integrity: bool = False
    """Also measure the store with checksums on, to state their cost."""

    def __post_init__(self) -> None:
        if not os.path.isdir(self.path):
            raise TierValueError(f"--path {self.path!r} is not a directory; create it or choose another")
        if self.size_mib < 1:
            raise TierValueError(f"--size-mib {self.size_mib} must be >= 1")
        if self.tensor_mib < 1:
            raise TierValueError(f"--tensor-mib {self.tensor_mib} must be >= 1")
        if self.rounds < 1:
            raise TierValueError(f"--rounds {self.rounds} must be >= 1")


# [Note: What size measures the drive] A file the drive has just written can be served from the drive's own
# caches (its DRAM, and on many drives an SLC write cache of several GiB), and a pass that ends within a couple of
# seconds is mostly the queue filling and draining, where one stall or one cached stretch moves the figure: a
# 256 MiB run has put the store at 2.6x fio. A run counts as measuring the drive when each pass moves at least
# MEASURING_MIB (a few GiB, past the smaller caches) and takes at least MEASURING_SECONDS at the fastest rate the
# run measured; without O_DIRECT (a filesystem that refuses it) the page cache holds the file too, so it must
# also be larger than the RAM. Below that the run still reports its figures, with a warning.
MEASURING_MIB = 4096
MEASURING_SECONDS = 2.0


def size_warning(size_mib: int, fastest_gbps: float | None, *, direct_io: bool,
                 ram_bytes: int | None = None) -> str | None:
    """Why ``size_mib`` does not measure the drive, and the size that does (see [Note: What size measures the
    drive]); None where it does. ``ram_bytes``: this machine's RAM (None: read from the system)."""
    def whole_gib(mib: float) -> int:
        return 1024 * -(-int(mib) // 1024)

    why, need_mib = [], MEASURING_MIB
    if size_mib < MEASURING_MIB:
        why.append(f"a file under {MEASURING_MIB} MiB can be read back from the drive's own cache")
    if fastest_gbps:
        need_mib = max(need_mib, whole_gib(MEASURING_SECONDS * fastest_gbps * 1e9 / MIB))
        took = size_mib * MIB / (fastest_gbps * 1e9)
        if took < MEASURING_SECONDS:
            spent = f"{took * 1e3:.1f} ms" if took < 0.1 else f"{took:.2f} s"
            why.append(f"the fastest pass took {spent}, and one under {MEASURING_SECONDS:.0f} s is mostly the "
                       "queue filling and draining")
    if not direct_io:
        ram = ram_bytes if ram_bytes is not None else psutil.virtual_memory().total
        need_mib = max(need_mib, whole_gib(ram / MIB + 1))
        if size_mib * MIB <= ram:
            why.append(f"without O_DIRECT the page cache holds a file smaller than the RAM ({ram / 2**30:.1f} GiB)")
    if not why:
        return None
    return f"{size_mib} MiB does not measure the drive: {'; '.join(why)}. Give --size-mib {need_mib} or more"


def fio_available() -> bool:
    return shutil.which("fio") is not None


def _run_fio(directory: str, cfg: DriveBenchConfig, rw: str) -> float:
    path = os.path.join(directory, "fio.bin")
    cmd = ["fio", "--name=tierstore", f"--filename={path}", f"--rw={rw}", f"--bs={cfg.block_size_bytes}",
           f"--size={cfg.size_mib * MIB}", f"--iodepth={cfg.fio_iodepth}", "--ioengine=libaio",
           "--direct=1", "--numjobs=1", "--output-format=json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job["read" if rw == "read" else "write"]["bw_bytes"] / 1e9


def _cpu_seconds() -> float:
    """User + system CPU of this process, all threads, to the microsecond (getrusage; psutil's /proc figures
    count 10 ms ticks, which at ~0.05 s of CPU per GB moved left each figure a handful of ticks)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


class _BarePool:
    """The reference for the store's CPU cost: ``preadv``/``pwritev`` of one file in ``block_size`` blocks from a
    pool of ``io_threads`` threads, into and out of one pre-faulted buffer, O_DIRECT where the store used it:
    nothing else (no tiers, no copies, no bookkeeping)."""

    def __init__(self, directory: str, nbytes: int, cfg: DriveBenchConfig, *, direct: bool) -> None:
        self.nbytes, self.block = nbytes, cfg.block_size_bytes
        self.buffer = aligned_empty(nbytes)
        self.buffer.random_(0, 255)
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
        self.fd = os.open(os.path.join(directory, "bare.bin"), flags, 0o600)
        os.posix_fallocate(self.fd, 0, nbytes)
        self.pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="bench-bare")

    def _all(self, call: Any) -> float:
        mv = memoryview(self.buffer.numpy())
        t0 = time.perf_counter()
        jobs = [self.pool.submit(call, self.fd, [mv[off:off + self.block]], off)
                for off in range(0, self.nbytes, self.block)]
        for j in jobs:
            j.result()
        return self.nbytes / (time.perf_counter() - t0) / 1e9

    def write(self) -> float:
        return self._all(os.pwritev)

    def read(self) -> float:
        return self._all(os.preadv)

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)


class _StoreDrive:
    """One store holding size_mib of tensors with NVMe home; times flush() and prefetch of all."""

    def __init__(self, directory: str, cfg: DriveBenchConfig, *, checksums: bool) -> None:
        n = max(1, cfg.size_mib // cfg.tensor_mib)
        per = cfg.size_mib * MIB // n
        self.nbytes = per * n
        self.store = TierStore(StoreConfig(
            nvme_path=directory, host_budget_bytes=self.nbytes + 64 * MIB,
            block_size_bytes=cfg.block_size_bytes, queue_depth=cfg.queue_depth, io_threads=cfg.io_threads,
            file_size_bytes=max(per, 4096), verify_checksums=checksums))
        self.keys = [f"t{i}" for i in range(n)]
        gen = torch.Generator().manual_seed(0)
        for k in self.keys:
            self.store.put(k, torch.randint(0, 255, (per,), dtype=torch.uint8, generator=gen))
        self.store.flush()
        self.direct = self.store.direct_io

    def write(self) -> float:
        for k in self.keys:  # make every host copy dirty without copying bytes
            self.store.get(k, Tier.HOST)
            self.store.mark_dirty(k, Tier.HOST)
            self.store.release(k, Tier.HOST)
        t0 = time.perf_counter()
        self.store.flush()
        return self.nbytes / (time.perf_counter() - t0) / 1e9

    def read(self) -> float:
        for k in self.keys:
            self.store.evict(k, Tier.HOST)
        t0 = time.perf_counter()
        handles = [self.store.prefetch(k, Tier.HOST) for k in self.keys]
        for h in handles:
            h.wait()
        return self.nbytes / (time.perf_counter() - t0) / 1e9

    def mixed(self, read_fraction: float) -> float:
        """Read ``read_fraction`` of the tensors while writing the rest, all at once, as a training
        step does; GB/s of both together."""
        n_read = min(len(self.keys) - 1, max(1, round(len(self.keys) * read_fraction)))
        reads, writes = self.keys[:n_read], self.keys[n_read:]
        for k in reads:
            self.store.evict(k, Tier.HOST)
        for k in writes:
            self.store.get(k, Tier.HOST)
            self.store.mark_dirty(k, Tier.HOST)
            self.store.release(k, Tier.HOST)
        t0 = time.perf_counter()
        handles = [self.store.prefetch(k, Tier.HOST) for k in reads] + [self.store.write_back(k) for k in writes]
        for h in handles:
            h.wait()
        return self.nbytes / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        self.store.close()


def measure_drive(path: str, *, size_mib: int, read_fraction: float, tensor_mib: int = 8) -> dict[str, float]:
    """The store's read, write and mixed (``read_fraction`` reads) GB/s on the drive at ``path``, once each."""
    with tempfile.TemporaryDirectory(prefix="tierstore-drive-", dir=path) as d:
        cfg = DriveBenchConfig(path=path, size_mib=size_mib, tensor_mib=min(tensor_mib, size_mib), rounds=1)
        drive = _StoreDrive(d, cfg, checksums=False)
        try:
            return {"write_gbps": drive.write(), "read_gbps": drive.read(),
                    "mixed_gbps": drive.mixed(read_fraction), "read_fraction": read_fraction}
        finally:
            drive.close()


def run_drive_bench(cfg: DriveBenchConfig, *, log=print) -> dict[str, Any]:
    need = cfg.size_mib * MIB * (3 if cfg.integrity else 2) + 256 * MIB
    free = psutil.disk_usage(cfg.path).free
    if free < need:
        raise TierValueError(f"{cfg.path!r} has {free / 1e9:.1f} GB free; this run needs {need / 1e9:.1f} GB. "
                             "Lower --size-mib or pick another --path")
    has_fio = fio_available()
    if not has_fio:
        log("fio is not installed (Debian: apt-get install fio); reporting the store's figures alone")
    work = tempfile.mkdtemp(prefix="tierstore-bench-", dir=cfg.path)
    samples: dict[str, list[float]] = {k: [] for k in
                                       ("store_write", "store_read", "fio_write", "fio_read",
                                        "crc_write", "crc_read", "bare_write", "bare_read")}
    cpu: dict[str, list[float]] = {k: [] for k in ("store_write", "store_read", "bare_write", "bare_read")}
    stores: list[Any] = []
    try:
        plain = _StoreDrive(work, cfg, checksums=False)
        stores.append(plain)
        crc = _StoreDrive(work, cfg, checksums=True) if cfg.integrity else None
        if crc:
            stores.append(crc)
        bare = _BarePool(work, plain.nbytes, cfg, direct=plain.direct)
        stores.append(bare)
        for r in range(cfg.rounds):
            steps = ([("store", plain)] + ([("crc", crc)] if crc else []) + [("bare", bare)]
                     + ([("fio", None)] if has_fio else []))
            if r % 2:
                steps.reverse()  # alternate who goes first
            for kind in ("write", "read"):
                for name, drive in steps:
                    if drive is None:
                        samples[f"fio_{kind}"].append(_run_fio(work, cfg, kind))
                        continue
                    c0 = _cpu_seconds()
                    samples[f"{name}_{kind}"].append(getattr(drive, kind)())
                    if f"{name}_{kind}" in cpu:  # CPU seconds per GB moved, all threads of this process
                        cpu[f"{name}_{kind}"].append((_cpu_seconds() - c0) / (plain.nbytes / 1e9))
        direct = plain.direct
    finally:
        for s in stores:
            s.close()
        shutil.rmtree(work, ignore_errors=True)

    def med(name: str) -> float | None:
        return statistics.median(samples[name]) if samples[name] else None

    result: dict[str, Any] = {
        "size_mib": cfg.size_mib, "tensor_mib": cfg.tensor_mib, "block_size_bytes": cfg.block_size_bytes,
        "queue_depth": cfg.queue_depth, "io_threads": cfg.io_threads, "fio_iodepth": cfg.fio_iodepth,
        "rounds": cfg.rounds, "direct_io": direct, "fio": has_fio,
        "store_read_gbps": med("store_read"), "store_write_gbps": med("store_write"),
        "fio_read_gbps": med("fio_read"), "fio_write_gbps": med("fio_write"),
        "samples_gbps": samples, "cpu_seconds_per_gb_samples": cpu,
        "bare_read_gbps": med("bare_read"), "bare_write_gbps": med("bare_write"),
    }
    for name in cpu:
        result[f"{name}_cpu_s_per_gb"] = statistics.median(cpu[name])
    for kind in ("read", "write"):  # None where the bare pool used no measurable CPU
        bare_cpu = result[f"bare_{kind}_cpu_s_per_gb"]
        result[f"cpu_{kind}_ratio"] = result[f"store_{kind}_cpu_s_per_gb"] / bare_cpu if bare_cpu > 0 else None
    rates = [result[k] for k in ("store_read_gbps", "store_write_gbps", "fio_read_gbps", "fio_write_gbps",
                                 "bare_read_gbps", "bare_write_gbps") if result[k]]
    result["size_warning"] = size_warning(cfg.size_mib, max(rates, default=None), direct_io=direct)
    result["read_ratio"] = result["store_read_gbps"] / result["fio_read_gbps"] if has_fio else None
    result["write_ratio"] = result["store_write_gbps"] / result["fio_write_gbps"] if has_fio else None
    if cfg.integrity:
        result["checksum_read_gbps"] = med("crc_read")
        result["checksum_write_gbps"] = med("crc_write")
        result["checksum_read_cost"] = 1 - med("crc_read") / result["store_read_gbps"]
        result["checksum_write_cost"] = 1 - med("crc_write") / result["store_write_gbps"]
    log(format_drive_table(result))
    return result


def spread_text(samples: list[float]) -> str:
    """The range of one side's rounds: '1.21-2.07'."""
    return f"{min(samples):.2f}-{max(samples):.2f}"


def format_drive_table(res: dict[str, Any]) -> str:
    def f(x: float | None) -> str:
        return f"{x:8.2f}" if x is not None else "       -"

    s = res["samples_gbps"]
    lines = [
        f"drive: {res['size_mib']} MiB in {res['tensor_mib']} MiB tensors, block {res['block_size_bytes'] // 1024} KiB, "
        f"store queue depth {res['queue_depth']} x {res['io_threads']} threads, fio libaio iodepth "
        f"{res['fio_iodepth']}, {'O_DIRECT' if res['direct_io'] else 'buffered (no O_DIRECT)'}",
        "GB/s     store-write fio-write store-read fio-read" + ("  crc-write crc-read" if s["crc_read"] else ""),
    ]
    for i in range(res["rounds"]):
        def g(name: str) -> str:
            return f(s[name][i] if i < len(s[name]) else None)
        lines.append(f"round {i + 1:<3}   {g('store_write')}  {g('fio_write')}   {g('store_read')} {g('fio_read')}"
                     + (f"   {g('crc_write')} {g('crc_read')}" if s["crc_read"] else ""))
    lines.append(f"median      {f(res['store_write_gbps'])}  {f(res['fio_write_gbps'])}   "
                 f"{f(res['store_read_gbps'])} {f(res['fio_read_gbps'])}"
                 + (f"   {f(res['checksum_write_gbps'])} {f(res['checksum_read_gbps'])}" if s["crc_read"] else ""))
    lines.append("spread (max-min)" + "".join(
        f"  {name} {spread_text(s[name])}" for name in ("store_write", "fio_write", "store_read", "fio_read")
        if s[name]))
    if res["fio"]:
        lines.append(f"ratio store/fio: write {res['write_ratio']:.2f}  read {res['read_ratio']:.2f}")
        for kind in ("write", "read"):
            ours, theirs = s[f"store_{kind}"], s[f"fio_{kind}"]
            gap = abs(res[f"store_{kind}_gbps"] - res[f"fio_{kind}_gbps"])
            if max(max(ours) - min(ours), max(theirs) - min(theirs)) > gap:
                lines.append(f"  {kind}: the rounds of one side spread wider than the medians differ "
                             f"({gap:.2f} GB/s): the drive moved between rounds, so that ratio is within the noise; "
                             f"run more --rounds")
    lines.append(f"bare preadv/pwritev pool (same run): write {f(res['bare_write_gbps']).strip()} GB/s, read "
                 f"{f(res['bare_read_gbps']).strip()} GB/s")
    def cpu(kind: str) -> str:
        ratio = res[f"cpu_{kind}_ratio"]
        return (f"store {kind} {res[f'store_{kind}_cpu_s_per_gb']:.3f}, bare {res[f'bare_{kind}_cpu_s_per_gb']:.3f} "
                + (f"({ratio:.2f}x)" if ratio is not None else "(too short to time: raise --size-mib)"))

    lines.append(f"CPU s per GB (all threads; lower is better): {cpu('write')}; {cpu('read')}")
    if "checksum_read_cost" in res:
        lines.append(f"checksum cost: write {res['checksum_write_cost'] * 100:+.1f}%  "
                     f"read {res['checksum_read_cost'] * 100:+.1f}% of throughput")
    if res.get("size_warning"):  # last, where it is read: every figure above is in question
        lines.append(f"warning: {res['size_warning']}")
    return "\n".join(lines)
