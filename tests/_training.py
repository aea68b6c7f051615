"""Training loops and models shared by the offload and optimizer tests."""

import copy

import torch
import torch.nn.functional as F
from tierstore.integrations import OffloadedAdamW, offload_model

from tierstore.tools.vit import PRESETS, SyntheticImages, ViT


def named_state(sd):
    """The ``"state"`` of an optimizer state dict keyed by parameter name, with the entries of parameters never
    stepped left out: OffloadedAdamW's state dicts number the parameters as torch's do (their names under each
    group's ``"param_names"``) and hold every parameter it steps from its creation (``step`` 0)."""
    names = [n for g in sd["param_groups"] for n in g["param_names"]]
    return {names[i]: entry for i, entry in sd["state"].items() if float(entry["step"]) != 0}


def is_mapped(t):
    """Whether a tensor's memory is mapped from a file that no name reaches: a mapped copy (see [Note: Tensors mapped
    from a file])."""
    if t.numel() == 0:
        return False
    ptr = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return len(fields) == 6 and fields[5].rstrip().endswith("(deleted)")
    return False


def _train(model, data, steps, opt, after_step=None, *, batch=8, rank=0, world=1):
    """``steps`` steps; their losses. ``after_step(step)`` is called after each. Over ``world`` ranks, each rank
    trains on its slice of one batch of ``batch * world``."""
    losses = []
    for step in range(steps):
        x, y = data.batch(step, batch * world)
        loss = F.cross_entropy(model(x[rank::world]), y[rank::world])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if after_step is not None:
            after_step(step)
    return losses


def train_resident(model, data, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    return _train(model, data, steps, opt), opt


def train_offloaded(model, data, steps, store, step_in_backward=False, **kw):
    off = offload_model(model, store, **kw)
    opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, step_in_backward=step_in_backward)
    try:
        return _train(model, data, steps, opt), off, opt
    finally:
        opt.close()


def clipped_loop(model, data, opt, *, steps, clip, micro=2, sched=None, after_step=None, first=0,
                 before_clip=None, batch=None):
    """Trainer's loop: ``micro`` micro-batches, clipping by the global norm at ``clip`` (None: no clipping), step, a
    scheduler step, zero_grad; the losses and clip norms. ``before_clip(step)`` runs after the last backward,
    ``batch(i)`` gives micro-batch ``i`` (else the data's)."""
    losses, norms = [], []
    for step in range(first, first + steps):
        for m in range(micro):
            x, y = data.batch(micro * step + m, 4) if batch is None else batch(micro * step + m)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            losses.append(loss.item())
        if before_clip is not None:
            before_clip(step)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip is not None else None)
        opt.step()
        if sched is not None:
            sched.step()
        if after_step is not None:
            after_step(step)
        opt.zero_grad()
    return losses, norms


def resident_clipped(ref, data, **kw):
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(ropt, lambda s: 1.0 / (1 + s)) if kw.pop("schedule", False) else None
    return clipped_loop(ref, data, ropt, sched=sched, **kw)


def _tiny_pair(**vit_kw):
    """A tiny ViT, a copy of it to offload, and its data."""
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    ref = ViT(cfg, **vit_kw)
    return ref, copy.deepcopy(ref), SyntheticImages(cfg)


def _assert_same_parameters(model, ref):
    for name, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def _train_on_ids(ref, model, off, *, vocab: int, steps: int, step_in_backward: bool = False) -> None:
    """Train a model whose forward returns its loss on token ids, resident and offloaded; same losses each step."""
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt = OffloadedAdamW(off, lr=1e-2, step_in_backward=step_in_backward)
    for step in range(steps):
        ids = torch.randint(0, vocab, (4, 6), generator=torch.Generator().manual_seed(step))
        ref_loss = ref(ids)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = model(ids)
        assert torch.isfinite(loss) and loss.item() == ref_loss.item(), step
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.close()
