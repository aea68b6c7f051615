"""A saver walks a whole state dict of a model whose state is several times the host budget; prints, as JSON, the
state's bytes and how far the anonymous RSS rose above where it stood before the state dict was taken.

    python state_dict_rss_child.py NVME_DIR OUT_DIR SAVER [--in-memory]

SAVER: ``torch_save`` (``torch.save`` of the model's and the optimizer's state dicts), ``dcp``
(torch.distributed.checkpoint's ``get_state_dict`` and ``save``, then a fresh model's ``load``), ``accelerate``
(Accelerate's ``save_state``, then a fresh model's ``load_state`` with the optimizer's file mapped). ``--in-memory``
(``torch_save`` only) reads both into ordinary memory first, as a saver that copies every tensor would: the
test expects the measure to show it.
"""

import json
import os
import sys

import torch
from torch import nn

import tierstore as ts
from tierstore.integrations import OffloadedAdamW, offload_model
from tierstore.tools.rss import AnonRssPeak, anon_rss_bytes

HOST_BUDGET = 8 * 2**20


def build(nvme_dir: str) -> tuple[nn.Module, ts.TierStore, object, OffloadedAdamW]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(24)])  # 24 MiB of fp32 weights
    store = ts.TierStore(nvme_path=nvme_dir, host_budget_bytes=HOST_BUDGET)
    off = offload_model(model, store)
    return model, store, off, OffloadedAdamW(off, lr=1e-3)


def main() -> None:
    nvme_dir, out_dir, saver = sys.argv[1:4]
    in_memory = "--in-memory" in sys.argv
    model, store, off, opt = build(nvme_dir)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    opt.zero_grad()
    state_bytes = sum(store.info(k)["nbytes"] for k in store.keys())
    if saver == "accelerate":
        import accelerate

        accelerator = accelerate.Accelerator(cpu=True)
        model, opt = accelerator.prepare(model, opt)
        os.makedirs(os.path.join(nvme_dir, "second"))
        model2, store2, off2, opt2 = build(os.path.join(nvme_dir, "second"))  # the run to resume, built beforehand
        accelerator2 = accelerate.Accelerator(cpu=True)
        model2, opt2 = accelerator2.prepare(model2, opt2)
        accelerator2.save_state(os.path.join(out_dir, "warm"))  # what the first call costs once, outside the measure
    if saver == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        # what the first call costs once, whatever the model (torch's lazy imports: ~30 MiB here), outside the measure
        tiny = nn.Linear(2, 2)
        dcp.save(get_state_dict(tiny, torch.optim.AdamW(tiny.parameters()))[0], checkpoint_id=os.path.join(out_dir, "warm"))
        os.makedirs(os.path.join(nvme_dir, "second"))
        model2, store2, off2, opt2 = build(os.path.join(nvme_dir, "second"))  # the run to resume, built beforehand
    before = anon_rss_bytes()
    with AnonRssPeak() as peak:
        if saver == "torch_save":
            osd = opt.state_dict(beyond_host_budget=in_memory)
            msd = model.state_dict()
            if in_memory:
                msd = {k: v.clone() for k, v in msd.items()}
            torch.save({"model": msd, "optimizer": osd}, os.path.join(out_dir, "ckpt.pt"))
            del msd, osd
        elif saver == "accelerate":
            accelerator.save_state(os.path.join(out_dir, "accelerate"))
            accelerator2.load_state(os.path.join(out_dir, "accelerate"), load_kwargs={"mmap": True})
        else:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out_dir, "dcp"))
            del msd, osd
            msd, osd = get_state_dict(model2, opt2)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out_dir, "dcp"))
            set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd)
            del msd, osd
    if saver != "torch_save":
        off2.remove(keep_values=False)
        store2.close()
    print(json.dumps({"state_bytes": state_bytes, "anon_rise_bytes": peak.peak_bytes - before,
                      "host_budget_bytes": HOST_BUDGET}))
    off.remove(keep_values=False)
    store.close()


if __name__ == "__main__":
    main()
