"""Passes and threads: one pass at a time, and a forward stopped by Ctrl-C."""

import copy
import threading

import pytest
import torch
from _models import Gate, Interrupted
from _training import _assert_same_parameters
from tierstore.integrations.offload import OffloadedParameterError, offload_model
from tierstore.integrations.optim import OffloadedAdamW


def test_a_forward_stopped_by_ctrl_c_leaves_nothing_held(make_store):
    """torch runs its modules' always-call forward hooks for an Exception, not for a KeyboardInterrupt: the
    stopped forward's units, saved-tensor hooks and pass count are cleared by the next forward, which trains on
    as the resident model does after the same interrupted step (and another thread may run the model again)."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), Interrupted(64, 64))
                                for _ in range(6)])
    model = copy.deepcopy(ref)
    store = make_store(host_budget_bytes="96KiB")  # ~ four weights; parameters and state on the drive
    opt = OffloadedAdamW(offload_model(model, store), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for step in range(5):
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(step))
        for m, o in ((ref, ref_opt), (model, opt)):
            m[3][1].armed = step in (1, 2)
            try:
                m(x).square().mean().backward()
            except KeyboardInterrupt:
                continue
            o.step()
            o.zero_grad()
        _assert_same_parameters(model, ref)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    model[3][1].armed = True  # a module called on its own, stopped: the model's next forward clears what it left
    with pytest.raises(KeyboardInterrupt):
        model[3](torch.ones(1, 64))
    model[3][1].armed = False
    result = []
    thread = threading.Thread(target=lambda: result.append(model(torch.ones(1, 64))))
    thread.start()
    thread.join(30)
    assert result and torch.equal(result[0], ref(torch.ones(1, 64)))
    # The stopped pass's saved-tensor hooks are this thread's to pop: its next forward of the model does.
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    assert torch.equal(model(torch.ones(1, 64)), ref(torch.ones(1, 64)))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    opt.close()


@pytest.mark.parametrize("during", ["forward", "backward"])
def test_a_second_thread_is_refused_while_the_model_runs(make_store, during):
    """Two threads running an offloaded model at once released each other's parameters: a segfault with four
    inference threads. A forward while another thread is in the forward or backward raises; the running pass
    is unharmed, and calls serialized by a lock give the resident values."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), Gate(),
                                   torch.nn.Linear(32, 4))

    ref, model = build(), build()
    gate = model[3]
    off = offload_model(model, make_store(host_budget_bytes="64KiB"), resident_threshold_bytes=0)
    x = torch.randn(8, 16)
    gate.in_backward = during == "backward"
    got = {}

    def run():
        with torch.set_grad_enabled(during == "backward"):
            y = model(x)
            if during == "backward":
                y.square().sum().backward()
        got["y"] = y.detach()

    t = threading.Thread(target=run, name="runner")
    t.start()
    assert gate.inside.wait(30)
    with pytest.raises(OffloadedParameterError, match=f"called from thread 'MainThread' while thread 'runner' is "
                                                      f"in its {during}: .*threading.Lock"):
        model(x)
    gate.go.set()
    t.join(30)
    ref[3].go.set()
    with torch.no_grad():
        want = ref(x)
    assert torch.equal(got["y"], want)
    lock, outs = threading.Lock(), []

    def serialized():
        for _ in range(3):
            with lock, torch.no_grad():
                outs.append(torch.equal(model(x), want))

    gate.in_backward = True  # no waiting in a forward under no_grad
    threads = [threading.Thread(target=serialized) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert outs == [True] * 9
