"""Child process for the concurrent-load test: saves checkpoints to one path as fast as it can, checkpoint i
holding the value i in every parameter and every optimizer moment, and step count i, until ``stop_file`` exists.

argv: nvme_dir checkpoint_path stop_file
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the tests' shared modules
from _models import constant_state, race_model  # noqa: E402
from tierstore.integrations.checkpoint import save_checkpoint
from tierstore.integrations.offload import offload_model
from tierstore.integrations.optim import OffloadedAdamW

import tierstore as ts


def main() -> None:
    nvme_dir, path, stop_file = sys.argv[1:4]
    with ts.TierStore(nvme_path=nvme_dir, host_budget_bytes="2MiB", device_budget_bytes="1MiB") as store:
        model = race_model()
        off = offload_model(model, store)
        opt = OffloadedAdamW(off, lr=1e-3)
        i = 0
        while not os.path.exists(stop_file):
            i += 1
            model_sd, opt_sd = constant_state(model, float(i))
            model.load_state_dict(model_sd)
            opt.load_state_dict(opt_sd)
            save_checkpoint(path, off, opt, extra={"i": i})
            print(i, flush=True)
        opt.close()


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
