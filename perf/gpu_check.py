"""The CUDA paths in one prepared run (about 5 minutes on one H200): pinned host memory against its budget, the
host<->device link, the drive against fio, a 1.4B Llama step offloaded against the same model resident. Prints
each check's figures and PASS, FAIL or SKIP, and writes them all as JSON.

    python perf/gpu_check.py --nvme-path /mnt/nvme --json gpu.json

Checks:
1. environment: torch, the GPU, its memory, the CPU cores;
2. pinned host memory: a host tier of ``--pinned-mib`` filled and cycled through the device, the bytes it holds
   page-locked against its budget (equal to the arenas held, none through torch's caching host allocator), a
   host buffer ``is_pinned()``, and nothing locked once the store closes (see [Note: Pinned host memory]);
3. the link: host to device (``get(key, "device")``) and device to host (a changed device copy written back)
   through the store, against ``tensor.to(..., non_blocking=True)`` from and into pinned memory, GB/s and their
   ratio; the bytes must match;
4. the drive: the store's reads and writes against fio on ``--nvme-path`` (``tierstore bench drive``);
5. ordering: a random workload of gets, changes and releases through both memory tiers under budgets of a
   few copies, every value checked (what tests/test_device.py checks against a simulated device on CPU);
6. offloaded training of the tiny ViT with compute on the GPU against resident training on the GPU:
   losses and parameters bit-identical after 3 steps;
7. a Llama of 1.4B parameters (hidden 2048, 24 layers) in bf16 built on meta, offloaded with 8-bit moments and
   split masters under a host budget of a third of its state, trained after backward (2 micro-batches, clipping
   to 1.0) on the GPU, against a model of its shape resident on the GPU with torch's fused AdamW: step time, stall,
   drive bytes a step and the ratio.

``--tiny`` runs every check at a tiny size, on the GPU where there is one, else on the CPU (checks 5 and 6 on
``tierstore.testing.SimulatedDevice``, the CUDA-only ones skipped): the test suite runs it so the script cannot
rot.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from tierstore.integrations import OffloadedAdamW, offload_model

import tierstore as ts
from tierstore.testing import SimulatedDevice, checked_workload
from tierstore.tools.bench_step import run_step_bench
from tierstore.tools.demo import run_demo
from tierstore.tools.vit import PRESETS, SyntheticImages, ViT

MIB = 1024**2


def _store(path: str, simulate: bool, **kw: Any) -> ts.TierStore:
    kw.setdefault("file_size_bytes", "64MiB")
    return ts.TierStore(nvme_path=path, device=SimulatedDevice() if simulate else None, **kw)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def check_environment(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    return out


def check_pinned(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "needs a GPU"}
    budget = args.pinned_mib * MIB
    n = budget // 7 + 12345  # odd sizes: no buffer a power of two
    stats = getattr(torch.cuda, "host_memory_stats", None)  # torch's caching host allocator, where it says

    def cached() -> int | None:
        return stats().get("allocated_bytes.all.current", 0) if stats is not None else None

    before = cached()
    with _store(args.nvme_path, False, host_budget_bytes=budget, device_budget_bytes=2 * n) as store:
        for i in range(10):  # more than the host tier holds: arenas given back and made again
            store.put(f"p{i}", torch.full((n,), i, dtype=torch.uint8), home="nvme").wait()
            store.get(f"p{i}", "device")
            store.release(f"p{i}", "device")
        pinned = store.get("p9", "host").is_pinned()
        store.release("p9", "host")
        mem = store.memory()["host"]
        through_torch = None if before is None else cached() - before
    after = store.memory()["host"]["pinned_bytes"]
    ok = pinned and mem["pinned_bytes"] == mem["held_bytes"] <= budget and after == 0 and not through_torch
    res = {"budget_bytes": budget, "pinned_bytes": mem["pinned_bytes"], "held_bytes": mem["held_bytes"],
           "peak_bytes": mem["peak_bytes"], "is_pinned": pinned, "through_torch_allocator_bytes": through_torch,
           "pinned_after_close": after}
    if not ok:
        raise AssertionError(f"pinned memory off its budget: {res}")
    return res


def check_link(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "needs a GPU"}
    n = args.link_mib * MIB
    src = torch.randint(0, 255, (n,), dtype=torch.uint8).pin_memory()
    back = torch.empty_like(src).pin_memory()
    best = {k: float("inf") for k in ("h2d", "h2d_ref", "d2h", "d2h_ref")}

    def timed(key: str, fn: Callable[[], Any]) -> Any:
        _sync()
        t0 = time.perf_counter()
        out = fn()
        _sync()
        best[key] = min(best[key], time.perf_counter() - t0)
        return out

    with _store(args.nvme_path, False, host_budget_bytes=2 * n, device_budget_bytes=2 * n) as store:
        store.put("x", src, home="host").wait()
        for i in range(3):
            ref = timed("h2d_ref", lambda: src.to("cuda", non_blocking=True))
            timed("d2h_ref", lambda: back.copy_(ref, non_blocking=True))
            del ref
            store.evict("x", "device")
            got = timed("h2d", lambda: store.get("x", "device"))
            if not torch.equal(got.cpu(), src):
                raise AssertionError("the device copy differs from the host bytes")
            got.fill_(i)  # changed on the device: evicting it writes it back to the host copy
            store.mark_dirty("x", "device")
            store.release("x", "device")
            timed("d2h", lambda: store.evict("x", "device"))
            if not bool((store.read("x") == i).all()):
                raise AssertionError("the host copy lacks what the device wrote")
            store.put("x", src, home="host").wait()
    rate = {k: n / v / 1e9 for k, v in best.items()}
    return {"mib": args.link_mib, "h2d_store_gbps": round(rate["h2d"], 2), "h2d_to_gbps": round(rate["h2d_ref"], 2),
            "h2d_ratio": round(rate["h2d"] / rate["h2d_ref"], 3), "d2h_store_gbps": round(rate["d2h"], 2),
            "d2h_to_gbps": round(rate["d2h_ref"], 2), "d2h_ratio": round(rate["d2h"] / rate["d2h_ref"], 3)}


def check_drive(args: argparse.Namespace) -> dict[str, Any]:
    from tierstore.tools.bench_drive import DriveBenchConfig, run_drive_bench

    res = run_drive_bench(DriveBenchConfig(path=args.nvme_path, size_mib=args.drive_mib, rounds=1),
                          log=lambda *a: None)
    keys = ("store_read_gbps", "fio_read_gbps", "read_ratio", "store_write_gbps", "fio_write_gbps", "write_ratio")
    return {k: res.get(k) for k in keys}


def check_ordering(args: argparse.Namespace) -> dict[str, Any]:
    n = 256 * 1024  # floats: 1 MiB a tensor
    with _store(args.nvme_path, args.simulate, host_budget_bytes=5 * 4 * n, device_budget_bytes=3 * 4 * n) as store:
        checked_workload(store, numel=n, ops=args.ordering_ops)
        stats = store.stats_dict()
    paths = stats["paths"]
    moved = {path: paths[path]["count"] for path in ("host->device", "device->host") if path in paths}
    if "host->device" not in moved:
        raise AssertionError("the device tier was not used")
    return {"ops": args.ordering_ops, "copies": moved}


def check_training(args: argparse.Namespace) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() and not args.simulate else "cpu"
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    ref = ViT(cfg).to(device)
    model = copy.deepcopy(ref).cpu()
    data = SyntheticImages(cfg)
    with _store(args.nvme_path, args.simulate, host_budget_bytes="2MiB", device_budget_bytes="512KiB") as store:
        off = offload_model(model, store, compute_tier="device", prefetch_depth=2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
        opt = OffloadedAdamW(off, lr=1e-3)
        losses = []
        for step in range(3):
            x, y = data.batch(step, 4)
            x, y = x.to(device), y.to(device)
            pair = []
            for m, o in ((ref, ref_opt), (model, opt)):
                loss = F.cross_entropy(m(x), y)
                loss.backward()
                o.step()
                o.zero_grad()
                pair.append(loss.item())
            losses.append(pair)
        opt.close()
        differ = [n for n, v in ref.state_dict().items() if not torch.equal(model.state_dict()[n].cpu(), v.cpu())]
    if differ or any(a != b for a, b in losses):
        raise AssertionError(f"not bit-identical: losses {losses}, parameters differing {differ[:5]}")
    return {"device": device, "losses": losses}


def check_demo_and_bench(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available() or args.tiny:
        return {"skipped": "needs a GPU, at full size"}
    # Six demo steps: the placement's trial ends at the fifth (see integrations/_placing.py).
    demo = run_demo(preset="small", steps=6, batch_size=16, nvme_path=args.nvme_path, prefetch_depth="auto",
                    host_budget_bytes=None, device_budget_bytes=None)
    bench = run_step_bench(preset="base", batch_size=8, depths=[0, 2, "auto"], nvme_path=args.nvme_path, rounds=1,
                           host_budget_bytes=None, device_budget_bytes=None, rss=False)
    return {"demo": demo, "bench_step": bench}


def _llama(tiny: bool) -> tuple[Any, Any, int]:
    """transformers' Llama config of the check (tiny, or 1.4B), its decoder layer class, tokens a sequence."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    hidden, layers, heads, inter, vocab, tokens = ((128, 4, 4, 352, 1024, 32) if tiny
                                                   else (2048, 24, 16, 5632, 32000, 512))
    config = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=heads, intermediate_size=inter, vocab_size=vocab,
                                      max_position_embeddings=tokens, tie_word_embeddings=False, use_cache=False)
    return config, LlamaDecoderLayer, tokens


def _llama_steps(model: Any, opt: Any, config: Any, tokens: int, batch: int, steps: int, device: str,
                 store: ts.TierStore | None = None) -> list[dict[str, float]]:
    """Training steps as Trainer takes them (2 micro-batches, clipping to 1.0, the optimizer after backward):
    each one's seconds, loss, and with a store its stall seconds and drive bytes."""
    out = []
    for step in range(steps):
        before = store.stats_dict() if store is not None else None
        _sync()
        t0 = time.perf_counter()
        total = 0.0
        for micro in range(2):
            ids = torch.randint(0, config.vocab_size, (batch, tokens),
                                generator=torch.Generator().manual_seed(10 * step + micro)).to(device)
            loss = model(input_ids=ids, labels=ids).loss / 2
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if store is not None:
            opt.wait()  # the step's write-behind belongs to it
        _sync()
        row = {"seconds": time.perf_counter() - t0, "loss": total}
        if store is not None:
            after = store.stats_dict()
            row["stall_seconds"] = after["stall_seconds"] - before["stall_seconds"]
            row["drive_bytes"] = sum(after[k] - before[k] for k in ("bytes_read_nvme", "bytes_written_nvme"))
        out.append(row)
    return out


def check_llama(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import transformers
    except ImportError:
        return {"skipped": "needs transformers (pip install tierstore[hf])"}
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    config, layer, tokens = _llama(args.tiny)
    batch, steps = (1, 3) if args.tiny else (4, args.llama_steps)
    torch.manual_seed(0)
    with torch.device("meta"):  # in bf16 as from_config makes it (the rotary tables stay fp32)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    state = params * (2 + 2 + 2 + 8 / 256)  # bf16 weights, 8-bit moments, the split masters' low halves
    host = int(state // 3)
    device_budget = max(4 * MIB, params * 2 // 4) if cuda else MIB
    with _store(args.nvme_path, False, host_budget_bytes=host, device_budget_bytes=device_budget) as store:
        off = offload_model(model, store, units=[layer], init_fn=model._init_weights)
        opt = OffloadedAdamW(off, lr=1e-5, moments="8bit", master="split")
        try:
            ours = _llama_steps(model, opt, config, tokens, batch, steps, device, store)
        finally:
            opt.close()
            off.remove(keep_values=False)  # its values are not kept: nothing to read back at close
        peak_host = store.memory()["host"]["peak_bytes"]
    del model, off, opt
    resident = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device)
    ref_opt = torch.optim.AdamW(resident.parameters(), lr=1e-5, fused=cuda)
    ref = _llama_steps(resident, ref_opt, config, tokens, batch, steps, device)
    del resident, ref_opt
    timed = slice(1, None)  # the first step records the trace
    ours_s = statistics.median(r["seconds"] for r in ours[timed])
    ref_s = statistics.median(r["seconds"] for r in ref[timed])
    if not all(math.isfinite(r["loss"]) for r in ours):
        raise AssertionError(f"offloaded losses not finite: {[r['loss'] for r in ours]}")
    return {"device": device, "params": params, "dtypes": dtypes, "tokens_a_step": 2 * batch * tokens,
            "host_budget_bytes": host,
            "state_bytes": int(state), "host_peak_bytes": peak_host, "offloaded_step_s": round(ours_s, 3),
            "resident_step_s": round(ref_s, 3), "ratio": round(ours_s / ref_s, 3),
            "stall_s": [round(r["stall_seconds"], 3) for r in ours],
            "drive_bytes_per_param": [round(r["drive_bytes"] / params, 2) for r in ours],
            "losses": [round(r["loss"], 4) for r in ours], "resident_losses": [round(r["loss"], 4) for r in ref]}


CHECKS: list[tuple[str, Callable[[argparse.Namespace], dict[str, Any]]]] = [
    ("environment", check_environment), ("pinned host memory", check_pinned), ("link", check_link),
    ("drive", check_drive), ("ordering", check_ordering), ("training", check_training),
    ("llama step", check_llama), ("demo and bench step", check_demo_and_bench)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvme-path", default=None, help="directory on the drive (default: a temporary one)")
    p.add_argument("--tiny", action="store_true", help="every check at a tiny size; without a GPU, the ordering "
                   "and training checks on a simulated device")
    p.add_argument("--pinned-mib", type=int, default=1024, help="the pinned host tier's budget (default 1024)")
    p.add_argument("--link-mib", type=int, default=1024, help="MiB a link copy (default 1024)")
    p.add_argument("--drive-mib", type=int, default=4096, help="MiB the drive check writes and reads (default 4096)")
    p.add_argument("--ordering-ops", type=int, default=2000)
    p.add_argument("--llama-steps", type=int, default=4, help="steps of each Llama run, the first untimed")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.simulate = args.tiny and not torch.cuda.is_available()
    if args.tiny:
        args.pinned_mib, args.link_mib, args.drive_mib = 16, 16, 64
        args.ordering_ops = min(args.ordering_ops, 300)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as tmp:
        args.nvme_path = tmp
        for name, check in CHECKS:
            t0 = time.perf_counter()
            try:
                res = check(args)
                status = "SKIP" if "skipped" in res else "PASS"
            except Exception as e:  # noqa: BLE001 - every check runs; each failure is reported
                res, status = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}, "FAIL"
            res.update(status=status, seconds=round(time.perf_counter() - t0, 1))
            results[name] = res
            shown = {k: v for k, v in res.items() if k not in ("trace", "demo", "bench_step")}
            print(f"{status}  {name}: {json.dumps(shown, default=str)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return results


if __name__ == "__main__":
    res = main()
    raise SystemExit(1 if any(r["status"] == "FAIL" for r in res.values()) else 0)
