"""OffloadedAdamW(stream_update=True): the updates step() queues run while the next forward computes, with the
numbers of the step that runs after backward (see [Note: Updates streamed into the next forward])."""

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from tierstore import FencedWriteError, TierStoreError, TierValueError
from tierstore.integrations import OffloadedAdamW, load_checkpoint, offload_model, save_checkpoint

from _training import _assert_same_parameters, _tiny_pair, clipped_loop as _loop, resident_clipped as _resident


def _streamed(model, store, **kw):
    off = offload_model(model, store, resident_threshold_bytes=1024)
    assert off.resident and off.params  # clipping spans both kinds of parameter
    # every update streamed after step() (tests/test_speculated.py runs it with speculated ones)
    opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, stream_update=True, keep_grads=kw.pop("keep_grads", True),
                         speculate=False)
    return off, opt


@pytest.mark.parametrize("clip", [1e-3, 1e9], ids=["always-clipped", "never-clipped"])
def test_a_clipped_accumulated_loop_matches_torch(make_store, clip):
    ref, model, data = _tiny_pair(tie_head=True)
    ref_losses, ref_norms = _resident(ref, data, steps=4, clip=clip, schedule=True)
    off, opt = _streamed(model, make_store(host_budget_bytes="704KiB", device_budget_bytes="320KiB"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # lr changes after each step()
    losses, norms = _loop(model, data, opt, steps=4, clip=clip, sched=sched)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(norms, ref_norms))
    assert (min(n.item() for n in norms) > clip) == (clip < 1)
    _assert_same_parameters(model, ref)  # model.state_dict() waits for the last step's updates
    opt.close()


def test_step_returns_before_the_updates_and_the_forward_waits_for_each(make_store, monkeypatch):
    """step() returns with the updates queued; the next forward's fetch of a unit waits for that unit's updates,
    which run in the order the forward uses them."""
    ref, model, data = _tiny_pair()
    off, opt = _streamed(model, make_store())
    _loop(model, data, opt, steps=1, clip=1.0)  # records the trace
    opt.wait()
    gate = threading.Event()
    ran: list[str] = []
    timed_step = opt._timed_step

    def gated(name, *args, **kw):
        if threading.current_thread() is not threading.main_thread():  # the queue's, not a resident one's
            gate.wait(30)
            ran.append(name)
        return timed_step(name, *args, **kw)

    monkeypatch.setattr(opt, "_timed_step", gated)
    x, y = data.batch(9, 4)
    F.cross_entropy(model(x), y).backward()
    opt.step()  # returns although no update can run yet
    assert opt._streamed.busy and not ran
    fences = off.store._fences
    wait = fences.wait
    # the updates run once a read waits for one: the forward's first fetch of a unit still to be updated
    monkeypatch.setattr(fences, "wait", lambda *args: (gate.set(), wait(*args))[1])
    opt.zero_grad()
    model(x)  # waits for each unit's updates as it reaches it
    order = off.forward_order()
    keys = {name: key for name, key, _ in off.named_offloaded()}
    assert [order[keys[n]] for n in ran] == sorted(order[keys[n]] for n in ran)
    assert len(ran) == len(off.params)
    stats = off.store.stats_dict()
    assert stats["updates_streamed"] == 2 * len(off.params)
    assert stats["fenced_waits"] >= 1  # the forward waited for the gate
    opt.close()


def test_an_update_waits_until_a_slow_forward_nears_its_parameter(make_store, monkeypatch):
    """While the next forward runs on its trace, a queued update starts only once the forward is at most the
    prefetch depth and AHEAD units from its parameter (so the weight it writes is still in the host tier when the
    forward reads it); the run is torch's all the same."""
    import time

    from tierstore.integrations._streamed import AHEAD

    ref, model, data = _tiny_pair()
    ref_losses, _ = _resident(ref, data, steps=3, clip=1.0, micro=1)
    off, opt = _streamed(model, make_store(host_budget_bytes="704KiB", device_budget_bytes="320KiB"))
    forward = threading.Event()

    def slow(*_):  # a forward much slower than the updates: the worker would run far ahead
        time.sleep(0.05)

    for module in [*model.blocks, model.head]:
        module.register_forward_pre_hook(slow)
    begin_step = off._begin_step
    monkeypatch.setattr(off, "_begin_step", lambda: (begin_step(), forward.set()))  # before the forward fetches
    started: list[tuple[float, int]] = []
    timed_step, pace = opt._timed_step, opt._streamed._pace

    def record(name, key, *args, **kw):
        if threading.current_thread() is not threading.main_thread():
            started.append((off.forward_distance(key), off.prefetch_policy.depth + AHEAD))
        return timed_step(name, key, *args, **kw)

    monkeypatch.setattr(opt, "_timed_step", record)
    # the queue waits for the forward to start (before it the updates run at once)
    monkeypatch.setattr(opt._streamed, "_pace", lambda i, it: (forward.wait(30), pace(i, it)))
    rounds: list[list[tuple[float, int]]] = []

    def before_step(step):  # the updates step() queues wait for the next forward
        forward.clear()
        rounds.append(list(started))  # those of the step before, run while this step's forward ran
        started.clear()

    losses, _ = _loop(model, data, opt, steps=3, clip=1.0, micro=1, before_clip=before_step)
    forward.set()  # no forward comes: the last step's updates run as the model's values are read
    assert losses == ref_losses
    _assert_same_parameters(model, ref)
    opt.close()
    # each streamed update started near its parameter, not all at the forward's first block
    assert [len(r) for r in rounds] == [0, len(off.params), len(off.params)]
    assert all(d <= most for r in rounds for d, most in r), rounds


def test_a_bf16_weight_rounded_from_its_fp32_master_is_fenced_too(make_store):
    """Under ``master="fp32"`` an update also writes the bf16 weight (rounded from its master): the next forward
    waits for it as for the state, and the run is the step after backward's, bit for bit (unfenced, the forward
    read the weight of before the update)."""
    ref, _, data = _tiny_pair()
    runs = []
    for stream in (False, True):
        model = copy.deepcopy(ref).to(torch.bfloat16)
        off = offload_model(model, make_store(host_budget_bytes="704KiB", device_budget_bytes="320KiB"),
                            resident_threshold_bytes=1024)
        opt = OffloadedAdamW(off, lr=1e-2, master="fp32", stream_update=stream, speculate=False)
        losses, _ = _loop(model, data, opt, steps=4, clip=1.0, micro=1,
                          batch=lambda i: (data.batch(i, 4)[0].to(torch.bfloat16), data.batch(i, 4)[1]))
        runs.append((losses, {k: v.clone() for k, v in model.state_dict().items()}))
        opt.close()
    (losses, values), (streamed_losses, streamed_values) = runs
    assert streamed_losses == losses
    assert all(torch.equal(streamed_values[k], v) for k, v in values.items())


@pytest.mark.parametrize("seen", ["ended", "running"])
def test_a_script_whose_forward_raises_while_updates_wait_for_it_exits(tmp_path, seen):
    """The forward the queued updates keep pace with raises and the script ends on the error: the updates run, the
    interpreter exits, and no swap file is left; so too where the offload still sees that forward running (as an
    FSDP2 rank's, whose end Ctrl-C hides)."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import torch.nn.functional as F
        import tierstore as ts
        from tierstore.integrations import OffloadedAdamW, offload_model
        from _training import _tiny_pair
        _, model, data = _tiny_pair()
        store = ts.TierStore(nvme_path={str(tmp_path)!r}, host_budget_bytes="704KiB", device_budget_bytes="320KiB")
        off = offload_model(model, store, resident_threshold_bytes=1024, prefetch_depth=0)
        opt = OffloadedAdamW(off, lr=1e-3, stream_update=True, speculate=False)
        for step in range(3):
            if step == 2:  # the head's update waits for a forward that raises at the first block
                model.blocks[0].register_forward_pre_hook(lambda *_: 1 / 0)
            x, y = data.batch(step, 4)
            try:
                F.cross_entropy(model(x), y).backward()
            except ZeroDivisionError:
                if {seen!r} == "running":
                    off._forward_runs = lambda: True
                raise
            opt.step()
            opt.zero_grad()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "ZeroDivisionError" in done.stderr, done.stderr
    assert os.listdir(tmp_path) == []


def test_reads_between_step_and_the_next_forward_see_the_step(make_store, tmp_path, monkeypatch):
    """A parameter read, p.grad, opt.state, state dicts and a checkpoint, while the updates of a streamed step() are
    still queued: each waits for exactly what it reads, and gives what the resident model has after its step."""
    ref, model, data = _tiny_pair()
    ref_grads = {}

    def keep_ref_grads(step):
        if step == 1:
            ref_grads.update({n: p.grad.clone() for n, p in ref.named_parameters()})
            ref_grads["exp_avg"] = {n: ropt.state[p]["exp_avg"].clone() for n, p in ref.named_parameters()}

    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    _loop(ref, data, ropt, steps=2, clip=1e-3, after_step=keep_ref_grads)
    off, opt = _streamed(model, make_store())
    gate = threading.Event()
    gate.set()
    timed_step = opt._timed_step
    monkeypatch.setattr(opt, "_timed_step", lambda *a, **k: (
        threading.current_thread() is threading.main_thread() or gate.wait(30), timed_step(*a, **k))[1])
    name = next(n for n, _, _ in off.named_offloaded())
    p = dict(model.named_parameters())[name]
    seen = {}

    def read(step):
        if step == 0:
            opt.wait()
            gate.clear()  # the next step's updates wait
            return
        assert opt._streamed.busy
        threading.Timer(0.2, gate.set).start()  # each read below waits for the updates it reads
        seen["param"] = off.read_param(name)
        seen["grad"] = p.grad.clone()  # kept until zero_grad, as torch keeps it
        seen["exp_avg"] = opt.state[p]["exp_avg"]
        seen["model"] = {k: v.clone() for k, v in model.state_dict().items()}
        save_checkpoint(str(tmp_path / "ck"), model, opt)

    _loop(model, data, opt, steps=2, clip=1e-3, after_step=read)
    assert torch.equal(seen["param"], ref.state_dict()[name])
    assert torch.equal(seen["grad"], ref_grads[name])
    assert torch.equal(seen["exp_avg"], ref_grads["exp_avg"][name])
    assert all(torch.equal(seen["model"][k], v) for k, v in ref.state_dict().items())
    _assert_same_parameters(model, ref)
    opt.close()
    # the checkpoint resumes into a fresh model with the resident model's values
    _, model2, _ = _tiny_pair()
    _, opt2 = _streamed(model2, make_store())
    load_checkpoint(str(tmp_path / "ck"), model2, opt2)
    _assert_same_parameters(model2, ref)
    opt2.close()


@pytest.mark.parametrize("keep_grads", [True, False])
def test_zero_grad_lets_a_queued_gradient_go_once_read(make_store, monkeypatch, keep_grads):
    """zero_grad() before the queued updates ran: the gradients they read stay in the store until read, then go;
    nothing is left behind."""
    ref, model, data = _tiny_pair()
    _resident(ref, data, steps=2, clip=0.5)
    off, opt = _streamed(model, make_store(), keep_grads=keep_grads)
    gate = threading.Event()
    timed_step = opt._timed_step
    monkeypatch.setattr(opt, "_timed_step", lambda *a, **k: (
        threading.current_thread() is threading.main_thread() or gate.wait(30), timed_step(*a, **k))[1])
    gate.set()
    _loop(model, data, opt, steps=1, clip=0.5)
    opt.wait()
    gate.clear()
    x, y = data.batch(2, 4)
    F.cross_entropy(model(x), y).backward()
    x, y = data.batch(3, 4)
    F.cross_entropy(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    if keep_grads:
        assert all(p.grad is not None for p in model.parameters())
    opt.zero_grad()  # while every update waits
    assert all(p.grad is None for p in model.parameters())
    assert any(k.startswith("grad/") for k in off.store.keys())  # still read by the queue
    gate.set()
    opt.wait()
    assert not any(k.startswith("grad/") for k in off.store.keys())
    _assert_same_parameters(model, ref)
    opt.close()


def test_a_write_into_a_gradient_a_queued_update_reads_waits_for_that_update(make_store, monkeypatch):
    """p.grad.mul_() and zero_grad(set_to_none=False) right after step(), while its updates wait: each write waits
    for the update that reads that gradient, which applies the gradient step() saw, as torch's step did."""
    ref, model, data = _tiny_pair()

    def after(step):
        for p in ref.parameters():
            p.grad.mul_(0.5)

    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    ref_losses, _ = _loop(ref, data, ropt, steps=3, clip=0.5, after_step=after)
    off, opt = _streamed(model, make_store())
    gate = threading.Event()
    timed_step = opt._timed_step
    monkeypatch.setattr(opt, "_timed_step", lambda *a, **k: (
        threading.current_thread() is threading.main_thread() or gate.wait(30), timed_step(*a, **k))[1])
    zero_grad = opt.zero_grad
    monkeypatch.setattr(opt, "zero_grad", lambda: zero_grad(set_to_none=False))

    def writes(step):
        gate.clear()
        threading.Timer(0.2, gate.set).start()
        for p in model.parameters():
            p.grad.mul_(0.5)

    losses, _ = _loop(model, data, opt, steps=3, clip=0.5, after_step=writes)
    assert losses == ref_losses
    _assert_same_parameters(model, ref)
    opt.close()


def test_a_failed_update_stops_the_queue_and_step_again_finishes_it(make_store, monkeypatch):
    ref, model, data = _tiny_pair()
    ref_losses, _ = _resident(ref, data, steps=3, clip=0.5)
    off, opt = _streamed(model, make_store())
    losses, _ = _loop(model, data, opt, steps=1, clip=0.5)
    opt.wait()
    update = opt._pipeline.update
    calls = []

    def failing(*args, **kw):
        if threading.current_thread() is not threading.main_thread():
            calls.append(args[0])
            if len(calls) == 3:
                raise OSError(5, "Input/output error")
        return update(*args, **kw)

    monkeypatch.setattr(opt._pipeline, "update", failing)
    losses += _loop(model, data, opt, steps=1, clip=0.5, first=1)[0]  # its updates stop at the third
    x, y = data.batch(4, 4)
    with pytest.raises((FencedWriteError, TierStoreError)):
        model(x)  # reaches a unit whose update did not run, or refuses at once
    with pytest.raises(TierStoreError, match="step\\(\\) again"):
        model(x)  # the model is part of a step ahead
    opt.step()  # runs the updates left, with the gradients and lr they were queued with
    monkeypatch.setattr(opt._pipeline, "update", update)
    losses += _loop(model, data, opt, steps=1, clip=0.5, first=2)[0]
    assert losses == ref_losses
    _assert_same_parameters(model, ref)
    opt.close()


def test_refused_where_it_cannot_run(make_store):
    _, model, _ = _tiny_pair()
    off = offload_model(model, make_store())
    with pytest.raises(TierValueError, match="choose one"):
        OffloadedAdamW(off, stream_update=True, step_in_backward=True)
    with pytest.raises(TypeError, match="True or False"):
        OffloadedAdamW(off, stream_update="yes")


def test_stress_streamed_updates_beside_a_forward_under_a_tight_budget(make_store):
    """Many thread switches, a host tier that makes the worker and the forward evict each other's copies: the run
    stays that of torch, step after step."""
    import sys

    ref, model, data = _tiny_pair(tie_head=True)
    ref_losses, _ = _resident(ref, data, steps=6, clip=0.05, micro=1)
    off, opt = _streamed(model, make_store(host_budget_bytes="704KiB", device_budget_bytes="320KiB"))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        losses, _ = _loop(model, data, opt, steps=6, clip=0.05, micro=1)
    finally:
        sys.setswitchinterval(interval)
    assert losses == ref_losses
    _assert_same_parameters(model, ref)
    opt.close()


def test_a_forward_that_raises_between_steps_leaves_the_queue_running(make_store):
    """The next forward raises part-way (a bad batch) while the updates it waits for run: the queue goes on, and
    the run, retried with a good batch, is torch's."""
    ref, model, data = _tiny_pair()
    ref_losses, _ = _resident(ref, data, steps=3, clip=0.5, micro=1)
    off, opt = _streamed(model, make_store())
    bad = torch.zeros(4, 3, 5, 5)  # not the image size the patch embedding expects

    def raise_in_forward(step):
        with pytest.raises(RuntimeError):
            model(bad)

    losses, _ = _loop(model, data, opt, steps=3, clip=0.5, micro=1, after_step=raise_in_forward)
    assert losses == ref_losses
    _assert_same_parameters(model, ref)
    opt.close()
