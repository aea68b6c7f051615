"""`tierstore bench step --compile`: compiled and eager, resident and offloaded, in one run.

Four setups of one ViT, each after its own warm-up (which compiles): resident eager, resident with each block
compiled (``block.compile()``), offloaded eager and offloaded with each block compiled (a compiled block is one
unit: see [Note: Compiled units]). The offloaded ones step their optimizer in backward at the automatic depth
under a host budget of a third of the state; the resident ones run torch's AdamW after backward. Samples are
taken in alternating order over rounds and medians reported; each row prints its step time, the eager step of
the same kind (the reference) and their ratio.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tierstore import StoreConfig, TierStore, TierValueError
from tierstore.scheduling import count_text, size_text
from tierstore.integrations import OffloadedAdamW, offload_model

from .bench_step import STEPS_PER_SAMPLE, WARMUP_STEPS, offloaded_sample, resident_step
from .demo import default_budgets
from .vit import PRESETS, SyntheticImages, ViT, num_params

SETUPS = ("resident eager", "resident compiled", "offloaded eager", "offloaded compiled")


def _compile_blocks(model: ViT) -> None:
    for block in model.blocks:
        block.compile()


def run_compile_bench(*, preset: str, batch_size: int, nvme_path: str, rounds: int, host_budget_bytes: int | None,
                      device_budget_bytes: int | None, log: Callable[[str], None] = print) -> dict[str, Any]:
    if preset not in PRESETS:
        raise TierValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    cfg = PRESETS[preset]
    torch.manual_seed(0)
    base = ViT(cfg)
    n = num_params(base)
    state_bytes, host, device = default_budgets(n, host_budget_bytes, device_budget_bytes)
    data = SyntheticImages(cfg)
    stores: list[TierStore] = []
    opts: list[Any] = []
    run: dict[str, Callable[[int], float]] = {}
    warmup: dict[str, float] = {}
    try:
        for name in SETUPS:
            model = copy.deepcopy(base)
            if name.endswith("compiled"):
                _compile_blocks(model)
            if name.startswith("resident"):
                opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
                run[name] = lambda step, m=model, o=opt: resident_step(m, data, batch_size, step, o)[0]
            else:
                store = TierStore(StoreConfig(nvme_path=nvme_path, host_budget_bytes=host,
                                              device_budget_bytes=device))
                stores.append(store)
                opt = OffloadedAdamW(offload_model(model, store, prefetch_depth="auto"), lr=1e-3,
                                     step_in_backward=True)
                opts.append(opt)
                run[name] = lambda step, m=model, s=store, o=opt: offloaded_sample(
                    m, s, o, data, batch_size, step, steps=1)[0]
            t0 = time.perf_counter()
            for step in range(WARMUP_STEPS):
                run[name](step)
            warmup[name] = time.perf_counter() - t0
        samples: dict[str, list[float]] = {name: [] for name in SETUPS}
        for r in range(rounds):
            for name in SETUPS if r % 2 == 0 else reversed(SETUPS):
                first = WARMUP_STEPS + r * STEPS_PER_SAMPLE
                samples[name].append(sum(run[name](first + i) for i in range(STEPS_PER_SAMPLE)) / STEPS_PER_SAMPLE)
    finally:
        for opt in opts:
            opt.close()
            opt.offloaded.remove(keep_values=False)  # its values are not kept: nothing to read back at close
        for store in stores:
            store.close()
    steps = {name: statistics.median(s) for name, s in samples.items()}
    log(f"bench step --compile: ViT-{preset} ({count_text(n)} params, fp32, {size_text(state_bytes)} state), batch "
        f"{batch_size}, offloaded under a host budget of {size_text(host)} (optimizer in backward, depth auto); "
        f"each block compiled in place (block.compile()); medians of {rounds} alternating rounds")
    log(f"{'setup':>20} {'step s':>8} {'eager s':>8} {'ratio':>7} {'warm-up s':>10}")
    result: dict[str, Any] = {"preset": preset, "params": n, "batch_size": batch_size, "host_budget_bytes": host,
                              "rounds": rounds, "setups": {}}
    for name in SETUPS:
        reference = steps[name.replace("compiled", "eager")]
        result["setups"][name] = {"step_s": steps[name], "eager_step_s": reference,
                                  "speedup": reference / steps[name], "warmup_s": warmup[name]}
        log(f"{name:>20} {steps[name]:>8.3f} {reference:>8.3f} {reference / steps[name]:>6.2f}x "
            f"{warmup[name]:>10.1f}")
    log("ratio: the eager step of the same kind over this one (higher is faster); warm-up: its first "
        f"{WARMUP_STEPS} steps, compilation included")
    return result


__all__ = ["run_compile_bench"]
