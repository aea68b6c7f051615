"""The CUDA paths in one short run (a few minutes on one GPU): pinned host pools, copy streams and events,
offloaded training on the GPU, the demo and ``bench step``. Prints each check's figures and PASS or FAIL.

    python perf/gpu_check.py --nvme-path /mnt/nvme [--json out.json]

Checks:
1. environment: torch, the GPU, its memory;
2. host to device through the store (a pinned host copy read by ``get(key, "device")``) against a plain
   ``tensor.to("cuda", non_blocking=True)`` from pinned memory, GB/s and their ratio; the bytes must match;
3. ordering: a random workload of gets, changes and releases through both memory tiers under budgets of a
   few copies, every value checked (what tests/test_device.py checks against a simulated device on CPU);
4. offloaded training of the tiny ViT with compute on the GPU against resident training on the GPU:
   losses and parameters bit-identical after 3 steps;
5. ``tierstore demo --preset small`` and ``bench step --preset base --depths 0,2``: their figures.

Without CUDA, ``--simulate`` runs checks 3 and 4 on ``tierstore.testing.SimulatedDevice`` (CPU), so the script
is exercised by the test suite; the real checks say they need a GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
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


def check_environment(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    return out


def check_host_to_device(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "needs a GPU"}
    n = args.h2d_mib * MIB
    src = torch.randint(0, 255, (n,), dtype=torch.uint8).pin_memory()
    best_ref, best_ours = float("inf"), float("inf")
    with _store(args.nvme_path, False, host_budget_bytes=2 * n, device_budget_bytes=2 * n) as store:
        store.put("x", src, home="host").wait()
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ref = src.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            best_ref = min(best_ref, time.perf_counter() - t0)
            del ref
            store.evict("x", "device")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = store.get("x", "device")
            torch.cuda.synchronize()
            best_ours = min(best_ours, time.perf_counter() - t0)
            same = torch.equal(got.cpu(), src)
            store.release("x", "device")
            if not same:
                raise AssertionError("the device copy differs from the host bytes")
    ours, ref = n / best_ours / 1e9, n / best_ref / 1e9
    return {"store_gbps": round(ours, 2), "to_cuda_gbps": round(ref, 2), "ratio": round(ours / ref, 3)}


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
    if not torch.cuda.is_available():
        return {"skipped": "needs a GPU"}
    # Six demo steps: the placement's trial ends at the fifth (see integrations/_placing.py).
    demo = run_demo(preset="small", steps=6, batch_size=16, nvme_path=args.nvme_path, prefetch_depth="auto",
                    host_budget_bytes=None, device_budget_bytes=None)
    bench = run_step_bench(preset="base", batch_size=8, depths=[0, 2, "auto"], nvme_path=args.nvme_path, rounds=1,
                           host_budget_bytes=None, device_budget_bytes=None, rss=False)
    return {"demo": demo, "bench_step": bench}


CHECKS: list[tuple[str, Callable[[argparse.Namespace], dict[str, Any]]]] = [
    ("environment", check_environment), ("host to device", check_host_to_device), ("ordering", check_ordering),
    ("training", check_training), ("demo and bench step", check_demo_and_bench)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nvme-path", default=None, help="directory on the drive (default: a temporary one)")
    p.add_argument("--simulate", action="store_true", help="no GPU: checks 3 and 4 on a simulated device")
    p.add_argument("--h2d-mib", type=int, default=256)
    p.add_argument("--ordering-ops", type=int, default=2000)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
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
