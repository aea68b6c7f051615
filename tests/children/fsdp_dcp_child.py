"""Run under torchrun: torch.distributed.checkpoint under offload_fsdp, as FSDP2's users write it.

    python -m torch.distributed.run --nproc_per_node 2 fsdp_dcp_child.py NVME_DIR CHECKPOINT_DIR LAYOUT [full]

The project's ViT (3 blocks, patches of 4 pixels; fp32 with torch's AdamW layout, or bf16 with 8-bit moments and
split masters: LAYOUT ``fp32`` or ``8bit-split``) is sharded with FSDP2 and offloaded; after 2 steps
``get_state_dict(model, opt)`` goes to ``dcp.save``, then 2 steps more. A fresh model (other initial values),
offloaded with its own optimizer, takes ``get_state_dict``, ``dcp.load`` and ``set_state_dict`` and trains the same
2 steps. With ``fp32`` FSDP2 alone with torch's AdamW loads the same checkpoint (its parameter groups' keys this
optimizer does not save left at torch's defaults) and trains them too. Prints one JSON line per rank: the losses,
those of each resumed run, and whether every stored tensor of the resumed optimizer and shards equals what was
saved, bit for bit. With ``full``, the state dicts are DCP's full ones (``StateDictOptions(full_state_dict=True)``:
every tensor gathered whole on every rank, and each rank's shard cut from it at the load).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import tierstore as ts
from tierstore.integrations import OffloadedAdamW, offload_fsdp
from tierstore.tools.demo import DTYPES
from tierstore.tools.fsdp_train import _shard, _train_step
from tierstore.tools.vit import SyntheticImages, ViT, ViTConfig

SAVE_AT, STEPS = 2, 4
# 3 blocks; patches of 4 pixels: the position embedding (1 x 65 x 64) is all on rank 0, whose 8-bit moments of it
# are packed where rank 1's (of no values) are not.
CONFIG = ViTConfig(patch_size=4, depth=3)


def _state_keys(store: ts.TierStore) -> list[str]:
    return sorted(k for k in store.keys() if k.startswith(("adam/", "fsdp/")))


def main(nvme: str, ckpt: str, layout: str, full: str = "") -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    options = StateDictOptions(full_state_dict=True) if full == "full" else None
    dtype, kw = ("bf16", {"moments": "8bit", "master": "split"}) if layout == "8bit-split" else ("fp32", {})
    host_budget = (88 if layout == "8bit-split" else 128) << 10  # a rank's state 4-5x that
    data = SyntheticImages(CONFIG)

    def offloaded(seed: int, run: str):
        torch.manual_seed(seed)
        model = _shard(ViT(CONFIG).to(DTYPES[dtype]))
        path = os.path.join(nvme, f"{run}{rank}")
        os.makedirs(path)
        store = ts.TierStore(nvme_path=path, host_budget_bytes=host_budget, device_budget_bytes="64KiB")
        off = offload_fsdp(model, store)
        return model, store, OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, **kw)

    def torch_resume(model, opt) -> list[float]:
        """torch's AdamW has parameter group keys this optimizer does not save (amsgrad, foreach, ...): loaded
        partially, they keep torch's defaults, which the run used."""
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
        sd = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, checkpoint_id=ckpt, planner=DefaultLoadPlanner(allow_partial_load=True))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=options)
        return [_train_step(model, opt, data, s, 4, rank, world) for s in range(SAVE_AT, STEPS)]

    model, store, opt = offloaded(0, "first")
    losses = [_train_step(model, opt, data, s, 4, rank, world) for s in range(SAVE_AT)]
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    del model_sd, optim_sd
    saved = {k: store.read(k) for k in _state_keys(store)}
    state_bytes = sum(store.info(k)["nbytes"] for k in saved)
    pos_moment = str(saved["adam/pos/exp_avg"].dtype)
    losses += [_train_step(model, opt, data, s, 4, rank, world) for s in range(SAVE_AT, STEPS)]
    opt.close()
    store.close()

    model, store, opt = offloaded(1, "resumed")
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=options)
    del model_sd, optim_sd, sd
    loaded = {k: store.read(k) for k in _state_keys(store)}
    same_state = loaded.keys() == saved.keys() and all(
        loaded[k].shape == saved[k].shape and torch.equal(loaded[k].reshape(-1).view(torch.uint8),
                                                          saved[k].reshape(-1).view(torch.uint8)) for k in saved)
    again = [_train_step(model, opt, data, s, 4, rank, world) for s in range(SAVE_AT, STEPS)]
    opt.close()
    store.close()

    row = {"rank": rank, "losses": losses, "resumed": again, "same_state": same_state, "state_keys": len(saved),
           "state_bytes": state_bytes, "host_budget_bytes": host_budget, "pos_moment": pos_moment}
    if layout == "fp32":  # FSDP2 alone with torch's AdamW loads the same checkpoint
        torch.manual_seed(1)
        model = _shard(ViT(CONFIG).to(DTYPES[dtype]))
        row["torch_resumed"] = torch_resume(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01,
                                                                foreach=False))
    print(json.dumps(row))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
