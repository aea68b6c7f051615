"""The store's ordering of device work, on CPU: a simulated device whose copies finish late (see
[Note: Ordering device work]). A missed wait, or a buffer reused while a copy still reads or writes it, shows
up as wrong values; the last tests check that the simulation does catch each of those."""

import copy

import pytest
import torch
import torch.nn.functional as F
from tierstore.integrations import OffloadedAdamW, offload_model

from tierstore._memory import Buffer, TierPool
from tierstore.testing import SimulatedDevice, checked_workload
from tierstore.tools.vit import PRESETS, SyntheticImages, ViT

N = 4096  # floats per tensor: 16 KiB


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_late_copies_never_show_wrong_bytes(make_store, seed):
    device = SimulatedDevice(seed=seed)
    store = make_store(host_budget_bytes=5 * 4 * N, device_budget_bytes=3 * 4 * N, device=device)
    checked_workload(store, numel=N, seed=seed)
    assert device.copies > 100  # the device tier was really used


def test_pinned_host_tier_locks_exactly_the_arenas_it_holds(make_store):
    """A device that pins the host tier (as CUDA does) through the store: the bytes page-locked never exceed the
    host budget, equal the host pool's arenas, and are all unlocked when the store closes (see [Note: Pinned host
    memory]); the values read back are right throughout."""
    from test_memory import PageLocks

    locks = PageLocks()

    class PinningDevice(SimulatedDevice):
        pins_host = True

        def pin(self, data):
            return locks.pin(data)

    store = make_store(host_budget_bytes=5 * 4 * N, device_budget_bytes=3 * 4 * N, device=PinningDevice())
    checked_workload(store, numel=N)
    host = store.memory()["host"]
    assert 0 < locks.bytes == host["pinned_bytes"] == host["held_bytes"] and locks.peak <= 5 * 4 * N
    store.close()
    assert locks.locked == {}


def test_offloaded_training_on_a_late_device_is_bit_identical(make_store):
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    ref = ViT(cfg)
    model = copy.deepcopy(ref)
    data = SyntheticImages(cfg)
    store = make_store(host_budget_bytes="2MiB", device_budget_bytes="512KiB", device=SimulatedDevice())
    off = offload_model(model, store, compute_tier="device", prefetch_depth=2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    opt = OffloadedAdamW(off, lr=1e-3)
    for step in range(3):
        x, y = data.batch(step, 4)
        for m, o in ((ref, ref_opt), (model, opt)):
            F.cross_entropy(m(x), y).backward()
            o.step()
            o.zero_grad()
    opt.close()
    for name, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], v), name


def test_a_buffer_keeps_one_event_per_stream():
    buf = Buffer(torch.empty(8, dtype=torch.uint8), 8, None)
    for i in range(100):  # a device copy released 100 times: its latest event per stream covers the others
        buf.add_event("compute", i)
        buf.add_event("h2d", -i)
    assert buf.events == {"compute": 99, "h2d": -99}


class _NoComputeWait(SimulatedDevice):
    def ready_for_compute(self, buf):
        pass


class _NoCpuWait(SimulatedDevice):
    def ready_for_cpu(self, buf):
        pass


@pytest.mark.parametrize("device_class", [_NoComputeWait, _NoCpuWait])
def test_the_simulation_catches_a_missed_wait(make_store, device_class):
    store = make_store(host_budget_bytes=5 * 4 * N, device_budget_bytes=3 * 4 * N,
                       device=device_class(max_delay_s=0.005))
    with pytest.raises(AssertionError):
        checked_workload(store, numel=N, ops=200)


def test_the_simulation_catches_a_buffer_reused_under_a_copy(make_store, monkeypatch):
    def free_at_once(pool, buf, label=""):  # no fence: the buffer is carved again while a copy may still use it
        with pool._lock:
            pool.live_bytes -= buf.capacity
            pool._give_locked(buf)

    monkeypatch.setattr(TierPool, "free", free_at_once)
    store = make_store(host_budget_bytes=5 * 4 * N, device_budget_bytes=3 * 4 * N,
                       device=SimulatedDevice(max_delay_s=0.005))
    with pytest.raises(AssertionError):
        checked_workload(store, numel=N, ops=200)
