"""Child process for the SIGKILL test: train, save checkpoint A, train, save checkpoint B (maybe killed).

argv: nvme_dir checkpoint_path kill_at [ref_dir]. kill_at < 0: no kill; prints the number of save stages
of checkpoint B and, with ref_dir, also saves A and B there as references.
"""

import os
import signal
import sys

import torch
import torch.nn.functional as F
from tierstore.integrations.checkpoint import save_checkpoint
from tierstore.integrations.offload import offload_model
from tierstore.integrations.optim import OffloadedAdamW

import tierstore as ts
from tierstore import _checkpoint
from tierstore.tools.vit import PRESETS, SyntheticImages, ViT


def step(model, opt, data, i):
    x, y = data.batch(i, 4)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def main() -> None:
    nvme_dir, path, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ref = sys.argv[4] if len(sys.argv) > 4 else None
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    model = ViT(cfg)
    data = SyntheticImages(cfg)
    with ts.TierStore(nvme_path=nvme_dir, host_budget_bytes="512KiB", device_budget_bytes="256KiB",
                      file_size_bytes="4MiB", block_size_bytes="64KiB") as store:
        off = offload_model(model, store)
        opt = OffloadedAdamW(off)
        step(model, opt, data, 0)
        save_checkpoint(path, off, opt, extra={"step": 1})
        if ref:
            save_checkpoint(os.path.join(ref, "A"), off, opt, extra={"step": 1})
        step(model, opt, data, 1)
        stages = []

        def hook(name: str) -> None:
            if len(stages) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            stages.append(name)

        _checkpoint.crash_point = hook
        save_checkpoint(path, off, opt, extra={"step": 2})
        _checkpoint.crash_point = None
        if ref:
            save_checkpoint(os.path.join(ref, "B"), off, opt, extra={"step": 2})
        print("\n".join(stages))


if __name__ == "__main__":
    main()
