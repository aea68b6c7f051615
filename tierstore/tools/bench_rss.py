"""Peak RSS of offloaded training against the tier budgets, measured in a fresh process.

[Note: Measuring RSS] One process that has held other models cannot say what
one configuration costs, so the probe runs in a child process, whose RSS
before the model exists is the runtime's (torch, threads, the data). glibc
keeps freed memory of large tensors for reuse unless they are mapped on their
own, so the child runs with a fixed mmap threshold: what a tensor frees goes
back to the kernel, and RSS counts only what is live. The probe measures, in
the same process, the activations of one resident forward at the batch size (the memory a step needs that no tier holds), then offloads the
model and takes the peak RSS over a few training steps. The claim checked is

    peak RSS - runtime RSS <= host budget + device budget + activations
                              + gradient backlog bound + OVERHEAD_BYTES

where the backlog bound is the optimizer's ``max_grad_backlog_bytes``
(gradients waiting for their update) and OVERHEAD_BYTES covers the
bookkeeping, the threads' stacks and the allocator's slack.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any
from tierstore import TierStoreError

MIB = 1024**2
OVERHEAD_BYTES = 64 * MIB
"""The fixed allowance above budgets and activations that the check states."""


def measure_rss(*, preset: str, batch_size: int, nvme_path: str, host_budget_bytes: int, device_budget_bytes: int,
                prefetch_depth: int, step_in_backward: bool, steps: int = 3) -> dict[str, Any]:
    """Run the probe in a child process and return its figures (see [Note: Measuring RSS])."""
    args = {"preset": preset, "batch_size": batch_size, "nvme_path": nvme_path, "host_budget_bytes": host_budget_bytes,
            "device_budget_bytes": device_budget_bytes, "prefetch_depth": prefetch_depth,
            "step_in_backward": step_in_backward, "steps": steps}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    proc = subprocess.run([sys.executable, "-m", "tierstore.tools.bench_rss", json.dumps(args)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise TierStoreError(f"the RSS probe failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _probe(*, preset: str, batch_size: int, nvme_path: str, host_budget_bytes: int, device_budget_bytes: int,
           prefetch_depth: int, step_in_backward: bool, steps: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from tierstore import StoreConfig, TierStore
    from tierstore.integrations import OffloadedAdamW, offload_model

    from .demo import measure_step
    from .rss import peak_rss_bytes, reset_peak_rss, rss_bytes
    from .vit import PRESETS, SyntheticImages, ViT

    cfg = PRESETS[preset]
    data = SyntheticImages(cfg)
    x, y = data.batch(0, batch_size)
    runtime = rss_bytes()
    torch.manual_seed(0)
    model = ViT(cfg)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    before = rss_bytes()
    if not reset_peak_rss():
        raise TierStoreError("this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)")
    loss = F.cross_entropy(model(x), y)
    activations = peak_rss_bytes() - before  # what forward saved for backward, and its temporaries
    loss.backward()
    del loss
    model.zero_grad(set_to_none=True)
    config = StoreConfig(nvme_path=nvme_path, host_budget_bytes=host_budget_bytes,
                         device_budget_bytes=device_budget_bytes)
    with TierStore(config) as store:
        off = offload_model(model, store, prefetch_depth=prefetch_depth)
        opt = OffloadedAdamW(off, lr=1e-3, step_in_backward=step_in_backward, speculate=False)
        try:
            store.flush()
            rest = rss_bytes()
            reset_peak_rss()
            for step in range(steps):
                measure_step(model, store, opt, data, batch_size, step)
            peak = peak_rss_bytes()
        finally:
            opt.close()
            off.remove(keep_values=False)  # its values are not kept: nothing to read back at close
    budgets = host_budget_bytes + device_budget_bytes
    backlog = opt.max_grad_backlog_bytes if step_in_backward else 0
    allowed = budgets + activations + backlog + OVERHEAD_BYTES
    return {"runtime_rss_bytes": runtime, "rss_at_rest_bytes": rest, "peak_rss_bytes": peak,
            "above_runtime_bytes": peak - runtime, "budgets_bytes": budgets, "activations_bytes": activations,
            "grad_backlog_bytes": backlog, "overhead_bytes": OVERHEAD_BYTES, "allowed_bytes": allowed, "weights_bytes": weights,
            "within": peak - runtime <= allowed}


if __name__ == "__main__":
    print(json.dumps(_probe(**json.loads(sys.argv[1]))))
