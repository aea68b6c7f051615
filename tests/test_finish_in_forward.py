"""OffloadedAdamW(step_in_backward=True, finish_in_forward=True): updates that step() leaves running finish during
the next forward, and nothing reads a value before its update (see [Note: Finishing in the next forward])."""

import threading
import time

import pytest
import torch
import torch.nn.functional as F
from _training import _tiny_pair

from tierstore.integrations import OffloadedAdamW, load_checkpoint, offload_model, save_checkpoint
from tierstore.tools.vit import PRESETS, ViT, num_params


class _Gate:
    """Holds the optimizer's worker at each update until opened, and then slows each by 10 ms: step() returns with
    every update still to run, and what follows it (the next forward, reads) meets them still running."""

    def __init__(self, opt: OffloadedAdamW, fail_once: str | None = None) -> None:
        self.open = threading.Event()
        self.fail_once = fail_once
        self.failed = False
        original = opt._pipeline.update

        def update(name, *args, **kwargs):
            if threading.current_thread().name.startswith("tierstore-adamw"):
                assert self.open.wait(60), "the worker was never let go"
                time.sleep(0.01)
                if name == self.fail_once and not self.failed:
                    self.failed = True
                    raise OSError(5, "injected I/O error")
            return original(name, *args, **kwargs)

        opt._pipeline.update = update


def _lr(step: int) -> float:
    return 1.0 / (1 + step)


def _assert_same(model, ref, opt, ref_opt, when):
    for name, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), f"{name} {when}"
    ours = opt.state_dict()["state"]
    for name, p in ref.named_parameters():
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours[name][moment], ref_opt.state[p][moment]), f"{name} {moment} {when}"
        assert ours[name]["step"].item() == ref_opt.state[p]["step"].item(), f"{name} step {when}"


@pytest.mark.parametrize("gated", [True, False], ids=["every-update-left", "as-timing-goes"])
def test_updates_left_to_the_next_forward_train_bit_identically(make_store, gated, tmp_path):
    ref, model, data = _tiny_pair()
    store = make_store(host_budget_bytes=num_params(ref) * 4)  # a third of the fp32 state
    off = offload_model(model, store)
    opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, step_in_backward=True, finish_in_forward=True,
                         max_grad_backlog_bytes="1GiB")  # a held worker must not hold backward too
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, _lr)
    gate = _Gate(opt)
    if not gated:
        gate.open.set()
    offloaded = {name for name, _, p in off.named_offloaded() if p.requires_grad}
    try:
        for step in range(4):
            x, y = data.batch(step, 8)
            ref_loss = F.cross_entropy(ref(x), y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_sched.step()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            left = [u.name for u in opt._deferred]
            # The learning rate changes before the updates left run: they keep the one of their step().
            sched.step()
            opt.zero_grad()
            if gated:
                assert set(left) == offloaded, step
                # In the next forward's order (the first, already running when step() returned, aside).
                assert left.index("blocks.0.fc1.weight") < left.index("blocks.1.fc1.weight"), left
                gate.open.set()
            assert loss.item() == ref_loss.item(), step
            if step == 1:  # a checkpoint right after step(): it waits for the updates left
                save_checkpoint(str(tmp_path / "ckpt"), model, opt)
                saved = {k: v.clone() for k, v in ref.state_dict().items()}
            _assert_same(model, ref, opt, ref_opt, f"after step {step}")
            if gated:
                gate.open.clear()
        assert store.stats_dict()["bytes_read_nvme"] > 0
    finally:
        gate.open.set()
        opt.close()
    fresh = ViT(PRESETS["tiny"])
    with pytest.warns(UserWarning, match="another tier"):  # saved from an offloaded model, loaded into a plain one
        load_checkpoint(str(tmp_path / "ckpt"), fresh)
    for name, value in saved.items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_an_update_that_fails_after_step_raises_where_it_is_read_and_step_finishes_it(make_store):
    ref, model, data = _tiny_pair()
    store = make_store(host_budget_bytes=num_params(ref) * 4)
    off = offload_model(model, store)
    opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, step_in_backward=True, finish_in_forward=True,
                         max_grad_backlog_bytes="1GiB")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    gate = _Gate(opt, fail_once="blocks.0.fc1.weight")
    try:
        for step in range(3):
            x, y = data.batch(step, 8)
            F.cross_entropy(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            gate.open.set()
            if step == 0:
                # The failed update's values are never read: the forward (or a read) raises, saying what to do.
                with pytest.raises(RuntimeError, match=r"blocks\.0\.fc1\.weight.*failed \(OSError.*opt\.step\(\) "
                                                       r"again"):
                    model(data.batch(1, 8)[0])
                with pytest.raises(RuntimeError, match="opt.step"):
                    off.read_param("blocks.0.fc1.weight")
                with pytest.raises(RuntimeError, match="opt.step"):
                    opt.zero_grad()
                opt.step()  # steps it again with the gradient it kept
                assert off.broken is None
            _assert_same(model, ref, opt, ref_opt, f"after step {step}")
            gate.open.clear()
        assert gate.failed
    finally:
        gate.open.set()
        opt.close()


def test_finish_in_forward_needs_step_in_backward(make_store):
    _, model, _ = _tiny_pair()
    off = offload_model(model, make_store())
    with pytest.raises(ValueError, match="step_in_backward=True"):
        OffloadedAdamW(off, finish_in_forward=True)
