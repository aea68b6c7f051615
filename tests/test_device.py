"""The store's ordering of device work, on CPU: a simulated device whose copies finish late (see
[Note: Ordering device work]). A missed wait, or a buffer reused while a copy still reads or writes it, shows
up as wrong values; the last tests check that the simulation does catch each of those."""

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from tierstore.integrations import OffloadedAdamW, offload_model

from tierstore._memory import Buffer, TierPool
from tierstore.testing import SimulatedDevice
from tierstore.tools.vit import PRESETS, SyntheticImages, ViT

N = 4096  # floats per tensor: 16 KiB


def _workload(store, *, keys: int = 10, ops: int = 400, seed: int = 0) -> None:
    """Random puts' values read back through both memory tiers and changed in either, under budgets that
    keep a few copies per tier, so buffers are reused all the time; every read is checked."""
    rng = random.Random(seed)
    value = {}
    for i in range(keys):  # two homed in the host tier: the rest of it, and the device tier, are a cache
        store.put(f"k{i}", torch.full((N,), float(i)), home="host" if i < 2 else "nvme").wait()
        value[f"k{i}"] = float(i)
    for step in range(ops):
        key = f"k{rng.randrange(keys)}"
        tier = rng.choice(["device", "device", "host"])
        if rng.random() < 0.3:
            store.prefetch(f"k{rng.randrange(keys)}", rng.choice(["device", "host"]))
        t = store.get(key, tier)
        got = t[rng.randrange(N)].item(), t[0].item(), t[-1].item()
        assert got == (value[key],) * 3, (step, key, tier, got, value[key])
        if rng.random() < 0.5:
            t.fill_(float(1000 + step))
            store.mark_dirty(key, tier)
            value[key] = float(1000 + step)
        store.release(key, tier)
        if rng.random() < 0.1:
            store.evict(key, rng.choice(["device", "host"]) if store.info(key)["home"] == "nvme" else "device")
    store.flush()
    for key, v in value.items():
        assert torch.equal(store.read(key), torch.full((N,), v)), key


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_late_copies_never_show_wrong_bytes(make_store, seed):
    device = SimulatedDevice(seed=seed)
    store = make_store(host_budget_bytes=5 * 4 * N, device_budget_bytes=3 * 4 * N, device=device)
    _workload(store, seed=seed)
    assert device.copies > 100  # the device tier was really used


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
        _workload(store, ops=200)


def test_the_simulation_catches_a_buffer_reused_under_a_copy(make_store, monkeypatch):
    def free_at_once(pool, buf):  # no fence: the buffer is carved again while a copy may still use it
        with pool._lock:
            pool.live_bytes -= buf.capacity
            pool._give_locked(buf)

    monkeypatch.setattr(TierPool, "free", free_at_once)
    store = make_store(host_budget_bytes=5 * 4 * N, device_budget_bytes=3 * 4 * N,
                       device=SimulatedDevice(max_delay_s=0.005))
    with pytest.raises(AssertionError):
        _workload(store, ops=200)
