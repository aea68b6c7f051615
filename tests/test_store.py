import contextlib
import random
import threading
import time

import pytest
import torch
from conftest import all_dtypes, random_tensor

import tierstore as ts


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.numel() else a,
                                                                      b.view(torch.uint8) if b.numel() else b)


@pytest.mark.parametrize("dtype", all_dtypes(), ids=str)
@pytest.mark.parametrize("home", ["nvme", "host", "device"])
def test_round_trip_every_dtype(make_store, dtype, home):
    store = make_store()
    x = random_tensor((37, 5), dtype)
    store.put("x", x, home=home).wait()
    for tier in ("device", "host"):
        got = store.get("x", tier)
        assert same(got, x)
        store.release("x", tier)


@pytest.mark.parametrize("shape", [(0,), (0, 7), (1,), (4095,), (4097,), (1, 3, 5, 7), (65536 * 3 + 1,)])
@pytest.mark.parametrize("verify", [False, True])
def test_round_trip_odd_sizes(make_store, shape, verify):
    store = make_store(verify_checksums=verify, block_size_bytes=4096 * 4)
    x = random_tensor(shape, torch.float32, seed=len(shape))
    store.put("x", x).wait()
    store.evict("x", "host")
    assert same(store.get("x", "device"), x)
    store.release("x", "device")


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "size_one_dim"])
def test_a_dense_tensor_keeps_its_layout_through_the_drive(make_store, layout):
    x = torch.randn((4, 3, 5, 2), generator=torch.Generator().manual_seed(0))
    x = {"channels_last": x.contiguous(memory_format=torch.channels_last),
         "transposed": x.flatten(1).t(),
         "size_one_dim": torch.empty_strided((4, 1, 5, 2), (10, 1, 2, 1)).copy_(x[:, :1])}[layout]  # conv, 1 in
    store = make_store()
    store.put("x", x).wait()
    store.evict("x", "host")
    got = store.get("x", "device")
    assert got.stride() == x.stride() and torch.equal(got, x)
    got.mul_(2)  # a write through the strided view is the tensor's
    store.mark_dirty("x", "device")
    store.release("x", "device")
    store.evict("x", "device")
    assert torch.equal(store.read("x"), x * 2) and store.read("x").stride() == x.stride()


def test_modify_write_back_and_reread(make_store):
    store = make_store()
    x = torch.arange(10000, dtype=torch.float32)
    store.put("x", x).wait()
    t = store.get("x", "device")
    t.mul_(2)
    store.mark_dirty("x", "device")
    assert store.info("x")["copies"]["device"]["state"] == "dirty"
    store.release("x", "device")
    store.flush()
    assert store.info("x")["copies"]["device"]["state"] == "clean"
    store.evict("x", "device")
    store.evict("x", "host")
    assert torch.equal(store.get("x", "host"), x * 2)
    store.release("x", "host")


def test_evicting_dirty_copy_writes_it_back_first(make_store):
    store = make_store()
    store.put("x", torch.zeros(1000)).wait()
    t = store.get("x", "device")
    t.fill_(7)
    store.mark_dirty("x", "device")
    store.release("x", "device")
    store.evict("x", "device")
    store.evict("x", "host")
    assert torch.equal(store.get("x", "device"), torch.full((1000,), 7.0))
    store.release("x", "device")


def test_budget_pressure_evicts_and_writes_back(make_store):
    # Host holds two tensors, device one: everything must still round-trip.
    n = 256 * 1024  # 1 MiB of float32
    store = make_store(host_budget_bytes=2 * 4 * n, device_budget_bytes=4 * n)
    xs = {f"k{i}": torch.full((n,), float(i)) for i in range(6)}
    for k, x in xs.items():
        store.put(k, x).wait()
    for k in xs:
        t = store.get(k, "device")
        t.add_(100)
        store.mark_dirty(k, "device")
        store.release(k, "device")
        mem = store.memory()
        assert mem["host"]["held_bytes"] <= mem["host"]["budget_bytes"]
        assert mem["device"]["held_bytes"] <= mem["device"]["budget_bytes"]
    for k, x in xs.items():
        got = store.get(k, "host")
        assert torch.equal(got, x + 100), k
        store.release(k, "host")
    mem = store.memory()
    assert mem["host"]["peak_bytes"] <= mem["host"]["budget_bytes"]
    assert mem["device"]["peak_bytes"] <= mem["device"]["budget_bytes"]


def test_prefetch_is_idempotent_and_get_waits(make_store):
    store = make_store()
    x = torch.randn(500_000)
    store.put("x", x).wait()
    store.evict("x", "host")
    h1 = store.prefetch("x", "device")
    h2 = store.prefetch("x", "device")
    h1.wait()
    h2.wait()
    assert h1.done() and not h1.skipped
    assert same(store.get("x", "device"), x)
    store.release("x", "device")
    stats = store.stats_dict()
    assert stats["paths"]["nvme->host"]["count"] == 1
    assert stats["hits"] == 1


def _run_threads(target, count: int) -> None:
    """``target(i)`` on ``count`` threads at once; returns when all are done."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)


def test_many_threads_prefetch_and_get_the_same_keys(make_store):
    store = make_store(host_budget_bytes=8 * 1024**2, device_budget_bytes=4 * 1024**2)
    xs = {f"k{i}": torch.randn(100_000, generator=torch.Generator().manual_seed(i)) for i in range(8)}
    for k, x in xs.items():
        store.put(k, x).wait()
    errors = []

    def worker(seed):
        try:
            for j in range(40):
                k = f"k{(seed * 7 + j) % 8}"
                store.prefetch(k, "device")
                t = store.get(k, "device")
                assert same(t, xs[k])
                store.release(k, "device")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    _run_threads(worker, 6)
    assert not errors, errors
    assert store.memory()["device"]["peak_bytes"] <= 4 * 1024**2


def test_the_index_of_copies_by_tier_follows_every_change(make_store):
    """Eviction looks only at the copies of the tier it makes room in (``StoreState.in_tier``): after threads
    prefetching, getting, changing and dropping keys under a tight budget, the index holds exactly the copies the
    entries hold; an entry's copies refuse changes that would bypass it."""
    store = make_store(host_budget_bytes=2 * 1024**2, device_budget_bytes=1024**2)
    for i in range(24):
        store.put(f"k{i}", torch.full((50_000,), float(i))).wait()
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(60):
                tier = rng.choice(["host", "device"])
                store.prefetch(f"k{rng.randrange(12)}", tier)
                if rng.random() < 0.3:  # k12-k23: three keys of each thread's own, written
                    k = f"k{12 + 3 * seed + rng.randrange(3)}"
                    store.get(k, tier).add_(1)
                    store.mark_dirty(k, tier)
                else:  # k0-k11: read by all
                    k = f"k{rng.randrange(12)}"
                    store.get(k, tier)
                store.release(k, tier)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    _run_threads(worker, 4)
    assert not errors, errors
    store.drop("k3")
    state = store._state
    with state.lock:
        want = {t: {c: e for e in state.entries.values() for c in e.copies.values() if c.tier is t} for t in ts.Tier}
        assert {t: dict(v) for t, v in state.in_tier.items()} == want
        assert sum(len(v) for v in want.values()) > 24  # copies in the memory tiers besides the drive's
        with pytest.raises(TypeError, match="keep the index"):
            state.entries["k0"].copies.pop(ts.Tier.NVME)


def test_stats_report_paths_hits_and_stalls(make_store):
    store = make_store()
    store.put("x", torch.randn(100_000)).wait()
    store.evict("x", "host")
    store.get("x", "device")
    store.release("x", "device")
    store.get("x", "device")
    store.release("x", "device")
    s = store.stats_dict()
    assert s["misses"] == 1 and s["hits"] == 1 and s["get_calls"] == 2
    assert s["stall_seconds"] > 0
    assert s["paths"]["nvme->host"]["bytes"] >= 400_000
    assert s["paths"]["host->device"]["bytes"] == 400_000
    assert s["paths"]["host->nvme"]["bytes"] >= 400_000
    assert s["bytes_read_nvme"] >= 400_000
    assert s["background_wait_seconds"] == 0


def test_waits_of_a_helper_thread_are_not_stall(make_store):
    store = make_store()
    store.put("x", torch.randn(100_000)).wait()
    store.evict("x", "host")
    timeline = store.record_timeline()
    with store.stats.background():
        store.get("x", "host")
    store.release("x", "host")
    s = store.stats_dict()
    assert s["misses"] == 1 and s["stall_seconds"] == 0 and s["background_wait_seconds"] > 0
    assert [e["name"] for e in timeline.events() if e["cat"] == "background wait"] == ["wait"]
    store.evict("x", "host")
    store.get("x", "host")  # outside the block: the training thread's stall again
    store.release("x", "host")
    assert store.stats_dict()["stall_seconds"] > 0


def test_swap_files_are_private_and_removed(make_store, nvme_dir):
    import os
    import stat

    store = make_store()
    store.put("x", torch.randn(1000)).wait()
    d = store.swap_directory
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    for name in os.listdir(d):
        assert stat.S_IMODE(os.stat(os.path.join(d, name)).st_mode) == 0o600
    store.close()
    assert not os.path.exists(d)


def test_buffered_fallback_warns_once(nvme_dir):
    from tierstore.testing import NoDirectSyscalls

    with pytest.warns(RuntimeWarning, match="refuses O_DIRECT") as record:
        store = ts.TierStore(nvme_path=nvme_dir, host_budget_bytes="16MiB", syscalls=NoDirectSyscalls())
    try:
        assert len(record) == 1
        x = torch.randn(3333)
        store.put("x", x).wait()
        store.evict("x", "host")
        assert same(store.get("x", "host"), x)
        store.release("x", "host")
    finally:
        store.close()


def test_victim_order_policy_is_used(make_store):
    n = 1024
    store = make_store(device_budget_bytes=2 * 4 * n)
    for k in "abc":
        store.put(k, torch.zeros(n)).wait()
    order = []

    def farthest_first(tier, keys):
        order.append(list(keys))
        return sorted(keys, reverse=True)  # evict "b" before "a"

    store.set_victim_order(farthest_first)
    for k in "ab":
        store.get(k, "device")
        store.release(k, "device")
    store.get("c", "device")
    store.release("c", "device")
    assert order and set(order[0]) == {"a", "b"}
    assert "device" in store.info("a")["copies"]
    assert "device" not in store.info("b")["copies"]


def test_a_clean_copy_ranked_after_a_changed_one_waits_for_its_write_back(make_store):
    """Eviction keeps the victim order past changed copies (see [Note: Changed copies keep their rank]): the
    changed copy ranked first is written home and goes; the clean one ranked last (read ahead for a near use)
    stays, although dropping it would have cost no write."""
    n = 64 * 1024
    store = make_store(host_budget_bytes=2 * n)
    for k in "abc":
        store.put(k, torch.full((n // 4,), float(ord(k))), home="nvme").wait()
        store.evict(k, "host")  # the put staged it there
    store.set_victim_order(lambda tier, keys: sorted(keys))  # "a" goes first, then "b"
    store.get("a", "host").add_(1)
    store.mark_dirty("a", "host")
    store.release("a", "host")  # changed, in the host tier only
    store.prefetch("b", "host").wait()  # clean, read ahead
    assert store.info("a")["copies"]["host"]["state"] == "dirty" and "host" in store.info("b")["copies"]
    store.get("c", "host")
    store.release("c", "host")
    assert "host" in store.info("b")["copies"] and "host" not in store.info("a")["copies"]
    read = store.stats_dict()["bytes_read_nvme"]
    store.get("b", "host")  # no read: it stayed
    store.release("b", "host")
    assert store.stats_dict()["bytes_read_nvme"] == read
    assert torch.equal(store.read("a"), torch.full((n // 4,), float(ord("a")) + 1))  # written home first

def test_a_get_waits_for_room_another_thread_will_release(make_store):
    n = 64 * 1024
    store = make_store(host_budget_bytes=2 * n)
    for k in "abc":
        store.put(k, torch.full((n // 4,), float(ord(k))), home="nvme").wait()
    store.get("a", "host")
    store.get("b", "host")  # the host tier is full of held copies
    held = threading.Event()
    got = []

    def other():
        held.wait()
        got.append(store.get("c", "host").clone())  # waits: the main thread will release one
        store.release("c", "host")

    t = threading.Thread(target=other)
    t.start()
    held.set()
    time.sleep(0.3)
    assert not got  # still waiting, not failed
    store.release("a", "host")
    t.join(timeout=10)
    assert got and bool((got[0] == ord("c")).all())
    assert store.stats_dict()["budget_waits"] == 1
    store.release("b", "host")


def test_threads_waiting_on_each_other_fail_at_once_naming_who_holds_what(make_store, monkeypatch):
    """Without the check that neither thread can go on, this test waits out a bound longer than its timeout."""
    monkeypatch.setattr("tierstore._room.BUDGET_WAIT_SECONDS", 3600.0)
    n = 64 * 1024
    store = make_store(host_budget_bytes=2 * n)
    for k in "abcd":
        store.put(k, torch.zeros(n // 4), home="nvme").wait()
    store.get("a", "host")
    errors = []
    barrier = threading.Barrier(2)

    def other():
        store.get("b", "host")
        barrier.wait()
        try:
            store.get("d", "host")  # each needs room the other holds
        except ts.TierBudgetError as e:
            errors.append(e)
        finally:
            store.release("b", "host")

    t = threading.Thread(target=other, name="worker")
    t.start()
    barrier.wait()
    try:
        store.get("c", "host")
        store.release("c", "host")
    except ts.TierBudgetError as e:
        errors.append(e)
    finally:
        store.release("a", "host")  # whichever thread fails lets go, and the other goes on
    t.join()
    assert len(errors) == 1 and "MainThread holds 1 (a); worker holds 1 (b)" in str(errors[0])


@pytest.mark.parametrize("gives_way", [True, False], ids=["giving-way", "not"])
def test_a_thread_giving_way_lets_go_where_another_waits_for_room(make_store, monkeypatch, gives_way):
    """A worker holds most of the host tier and waits for more, which the training thread holds; then the training
    thread needs room too. Inside store.giving_way() the worker's wait ends in RoomYieldedError, it lets go, and the
    training thread's get() completes; without it the training thread's get() fails at once (neither could go
    on), and the worker's completes once the training thread has let go."""
    monkeypatch.setattr("tierstore._room.BUDGET_WAIT_SECONDS", 3600.0)
    n = 64 * 1024
    store = make_store(host_budget_bytes=3 * n)
    for k in "abcde":
        store.put(k, torch.full((n // 4,), float(ord(k))), home="nvme").wait()
    store.get("c", "host")
    errors: list[Exception] = []

    def worker():
        with store.giving_way() if gives_way else contextlib.nullcontext():
            store.get("a", "host")
            store.get("b", "host")
            try:
                store.get("e", "host")  # waits: the training thread holds c
                store.release("e", "host")
            except ts.TierBudgetError as e:
                errors.append(e)
            finally:
                store.release("a", "host")
                store.release("b", "host")

    t = threading.Thread(target=worker, name="worker")
    t.start()
    while not store.is_waiting_for_room(t.ident):
        time.sleep(0.001)
    try:
        if gives_way:
            assert bool((store.get("d", "host") == ord("d")).all())  # waits for the worker to give way
            store.release("d", "host")
        else:
            with pytest.raises(ts.TierBudgetError, match="worker holds 2"):
                store.get("d", "host")
    finally:
        store.release("c", "host")
    t.join(timeout=10)
    assert [type(e) for e in errors] == ([ts.RoomYieldedError] if gives_way else [])


def test_get_while_the_stores_own_write_back_of_an_older_copy_is_in_flight(make_store):
    store = make_store(host_budget_bytes="1MiB", device_budget_bytes="1MiB")
    store.put("k", torch.zeros(64 * 1024), home="nvme").wait()
    for i in range(20):  # the write-back below is usually still in flight when the host copy goes stale
        h = store.get("k", "host")
        h.fill_(float(i))
        store.mark_dirty("k", "host")
        store.release("k", "host")
        store.write_back("k")
        d = store.get("k", "device")
        d.add_(0.5)
        store.mark_dirty("k", "device")
        store.release("k", "device")
        assert float(store.get("k", "host")[0]) == i + 0.5  # not "held at an older version"
        store.release("k", "host")


def test_a_changed_host_copy_is_written_home_before_it_is_dropped_even_with_a_device_copy_beside_it(make_store):
    """A changed key copied to the device has two current copies and a stale NVMe home. Dropping the host copy
    unsaved would leave the device copy to be staged home through the host tier later, when the host tier may be
    full of held copies (the device tier then had nothing it could free: a budget error with no holder)."""
    n = 16 * 1024
    store = make_store(host_budget_bytes=3 * n, device_budget_bytes=n)
    for k in ("x", "a", "b"):
        store.put(k, torch.zeros(n // 4), home="nvme").wait()
    store.put("y", torch.zeros(n // 4), home="host").wait()  # to the device without staging
    store.get("x", "host").fill_(7.0)
    store.mark_dirty("x", "host")
    store.release("x", "host")
    store.get("x", "device")
    store.release("x", "device")  # x: host and device current, NVMe stale
    store.get("a", "host")
    store.get("b", "host")  # the host tier is full of held copies: x's host copy had to go
    assert float(store.get("y", "device")[0]) == 0.0  # x's device copy makes room without the host tier
    store.release("y", "device")
    assert float(store.read("y")[0]) == 0.0
    store.release("b", "host")
    store.get("x", "device").fill_(8.0)  # changed on the device itself: only a staged write can save it
    store.mark_dirty("x", "device")
    store.release("x", "device")
    store.get("b", "host")
    with pytest.raises(ts.TierBudgetError, match="16384 by changed copies that could not be written home"):
        store.get("y", "device")
    for k in ("a", "b"):
        store.release(k, "host")
    assert float(store.read("x")[0]) == 8.0


def test_threads_at_a_tight_budget_wait_for_each_other_and_lose_nothing(make_store):
    """Four threads each hold one copy while getting a second, under a host budget of five copies: there is
    always a way forward, so no get() may fail, and every increment must survive the evictions."""
    n = 16 * 1024
    store = make_store(host_budget_bytes=5 * n, device_budget_bytes=2 * n)
    keys = [f"k{i}" for i in range(12)]
    for k in keys:
        store.put(k, torch.zeros(n // 4), home="nvme").wait()
    counts = {k: 0 for k in keys}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(seed: int) -> None:
        rng = random.Random(seed)
        mine = keys[seed * 3:(seed + 1) * 3]  # each thread changes its own keys: their values are known
        try:
            for _ in range(60):
                first, second = rng.sample(mine, 2)
                if rng.random() < 0.3:
                    store.prefetch(rng.choice(keys), "host")
                tier_b = "device" if rng.random() < 0.2 else "host"
                a = store.get(first, "host")
                store.get(second, tier_b)
                a.add_(1.0)
                store.mark_dirty(first, "host")
                with lock:
                    counts[first] += 1
                store.release(first, "host")
                store.release(second, tier_b)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    _run_threads(work, 4)
    assert not errors, errors
    store.flush()
    for k in keys:
        assert float(store.read(k)[0]) == counts[k], k


def test_each_owners_victim_order_ranks_its_own_keys(make_store):
    n = 1024
    store = make_store(device_budget_bytes=5 * 4 * n)
    keys = ["a1", "a2", "b1", "b2", "x", "new"]
    for k in keys:
        store.put(k, torch.zeros(n)).wait()
    seen = {}

    def ranking(owner, first):
        def order(tier, mine):
            seen[owner] = sorted(mine)
            return sorted(mine, key=lambda k: k != first)  # its own farthest-next-use copy first
        return order

    ta = store.add_victim_order(ranking("a", "a2"), owns=lambda k: k.startswith("a"))
    tb = store.add_victim_order(ranking("b", "b1"), owns=lambda k: k.startswith("b"))
    for k in keys[:5]:
        store.get(k, "device")
        store.release(k, "device")
    store.get("new", "device")  # one copy must go: "x", which no owner claims
    store.release("new", "device")
    assert seen == {"a": ["a1", "a2"], "b": ["b1", "b2"]}  # each ranked only its own
    assert "device" not in store.info("x")["copies"]
    store.remove_victim_order(ta)  # one owner leaving keeps the other's order
    store.get("x", "device")  # now a's keys are unclaimed: the least recently used of them goes first
    store.release("x", "device")
    assert "device" not in store.info("a1")["copies"] and "device" in store.info("b1")["copies"]
    store.remove_victim_order(tb)


def test_kept_copies_survive_prefetches_and_go_last_of_all_for_a_get(make_store):
    mib = 1024**2
    store = make_store(host_budget_bytes=3 * mib)
    values = {k: torch.full((mib // 4,), float(i)) for i, k in enumerate("abcd")}
    for k, v in values.items():
        store.put(k, v).wait()
    owner = object()
    with pytest.raises(ValueError, match="memory tiers"):
        store.keep(owner, ["a"], "nvme")
    with pytest.raises(TypeError, match="pass \\['a'\\]"):
        store.keep(owner, "a")
    a = store.get("a", "host")
    a.add_(1)  # a kept copy is changed: it is written home when it goes, not before
    store.mark_dirty("a", "host")
    store.release("a", "host")
    store.keep(owner, ["a"], "host")
    assert store.kept("host") == {"a"}
    written = store.stats_dict()["bytes_written_nvme"]
    held = [store.get(k, "host") for k in "bc"]  # the tier is full: a kept, b and c held
    assert store.prefetch("d", "host").skipped  # a prefetch never takes a kept copy
    assert "host" in store.info("a")["copies"] and store.stats_dict()["bytes_written_nvme"] == written
    assert torch.equal(store.get("d", "host"), values["d"])  # a get() does, last of all, writing it home first
    store.release("d", "host")
    stats = store.stats_dict()
    assert stats["kept_evictions"] == 1 and stats["bytes_written_nvme"] > written
    assert "host" not in store.info("a")["copies"]
    for k in "bc":
        store.release(k, "host")
    assert torch.equal(store.read("a"), values["a"] + 1)
    store.keep(owner, [])
    assert store.kept("host") == frozenset()


def test_a_changed_copy_no_longer_kept_is_written_home_at_once_and_stays_until_evicted(make_store):
    """Eviction frees clean copies first: a changed copy left behind by a placement would outlast copies read ahead
    for a near use. So the copies an owner stops keeping are written home when it does (those still kept, or held,
    are not), and stay in the tier, clean, for eviction to rank with the rest."""
    mib = 1024**2
    store = make_store(host_budget_bytes=4 * mib)
    for i, k in enumerate("abc"):
        store.put(k, torch.full((mib // 4,), float(i))).wait()
    for k in "abc":
        store.get(k, "host").add_(1)
        store.mark_dirty(k, "host")
    store.release("a", "host")
    store.release("b", "host")  # c stays held
    owner = object()
    store.keep(owner, ["a", "b", "c"], "host")
    written = store.stats_dict()["bytes_written_nvme"]
    store.keep(owner, ["b"], "host")  # a and c are no longer kept; c is held
    store.writing("a").wait()
    assert store.info("a")["copies"]["host"]["state"] == "clean"
    assert store.stats_dict()["bytes_written_nvme"] == written + mib
    assert store.info("b")["copies"]["host"]["state"] != "clean" and store.info("c")["copies"]["host"]["state"] != "clean"
    store.release("c", "host")
    store.keep(owner, [])
    store.writing("b").wait()
    assert store.info("b")["copies"]["host"]["state"] == "clean"
    for i, k in enumerate("abc"):
        assert torch.equal(store.read(k), torch.full((mib // 4,), float(i + 1)))


def test_writing_waits_for_a_write_back_in_flight_without_starting_one(make_store):
    store = make_store()
    store.put("x", torch.zeros(1000)).wait()
    written = store.stats_dict()["bytes_written_nvme"]
    t = store.get("x", "host")
    t.fill_(2)
    store.mark_dirty("x", "host")
    store.release("x", "host")
    store.writing("x").wait()  # none in flight: done at once, nothing written
    assert store.stats_dict()["bytes_written_nvme"] == written
    store.write_back("x")
    store.writing("x").wait()
    assert store.info("x")["copies"]["host"]["state"] == "clean"


def test_flush_racing_drops_skips_the_dropped_keys_and_flushes_the_rest(make_store):
    """One thread flushes while others change, drop and put keys again: a key dropped during a flush is skipped
    (never a KeyError), and every key left is on the drive with its last value."""
    n = 16 * 1024
    store = make_store(host_budget_bytes=4 * n, device_budget_bytes=16 * n)  # device copies wait for host room
    stop = threading.Event()
    errors: list[BaseException] = []
    last: dict[str, float] = {}
    lock = threading.Lock()

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        mine = [f"t{seed}k{i}" for i in range(6)]
        try:
            for i in range(150):
                k = rng.choice(mine)
                with lock:
                    if k in last:
                        store.drop(k)
                        del last[k]
                        continue
                store.put(k, torch.zeros(n // 4), home="nvme").wait()
                tier = "device" if rng.random() < 0.8 else "host"  # a device copy is written home through the host
                t = store.get(k, tier)
                t.fill_(float(i))
                store.mark_dirty(k, tier)
                store.release(k, tier)
                with lock:
                    last[k] = float(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def flusher(_: int) -> None:
        try:
            while not stop.is_set():
                store.flush()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    watcher = threading.Thread(target=flusher, args=(0,))
    watcher.start()
    try:
        _run_threads(churn, 3)
    finally:
        stop.set()
        watcher.join()
    assert not errors, errors
    store.flush()
    for k, value in last.items():
        assert store.info(k)["copies"]["nvme"]["state"] == "clean" and float(store.read(k)[0]) == value, k


def test_close_gives_the_memory_back_at_once_and_a_held_view_keeps_its_values(tmp_path):
    """close() frees every copy's buffer, so the host tier's memory goes back to the system then, not when the
    store is collected (a reference cycle left it for the cyclic collector: RSS grew by the budget each time a
    store was made and closed); a tensor still viewing a buffer keeps its own memory and values."""
    import gc

    from tierstore.tools.rss import rss_bytes

    mib = 1024**2
    gc.collect()
    gc.disable()
    try:
        before = rss_bytes()
        store = ts.TierStore(nvme_path=str(tmp_path), host_budget_bytes=160 * mib)
        for i in range(16):
            store.put(f"t{i}", torch.full((8 * mib,), i, dtype=torch.uint8))
        held = store.get("t3", "host")
        assert rss_bytes() - before > 100 * mib
        store.close()
        assert rss_bytes() - before < 80 * mib  # at most the arena the held view keeps
        assert torch.equal(held, torch.full((8 * mib,), 3, dtype=torch.uint8))
    finally:
        gc.enable()


def test_changing_what_is_kept_while_other_threads_write_and_evict_loses_no_value(make_store):
    """One thread changes an owner's kept set over and over (each change writes home the changed copies it lets go)
    while two threads change, read ahead and evict copies in a full tier: every key ends with its last value."""
    import random

    mib = 1024**2
    store = make_store(host_budget_bytes=3 * mib)
    keys = [f"k{i}" for i in range(24)]
    last = {}
    for i, k in enumerate(keys):
        store.put(k, torch.full((mib // 16,), float(i))).wait()
        last[k] = float(i)
    stop, errors, owner, changes = threading.Event(), [], object(), [0]
    locks = {k: threading.Lock() for k in keys}

    def keeper() -> None:
        r = random.Random(1)
        while not stop.wait(0.001):
            store.keep(owner, r.sample(keys, r.randint(0, 12)), "host")
            changes[0] += 1

    def writer(seed: int) -> None:
        r = random.Random(seed)
        try:
            for n in range(800):
                k = r.choice(keys)
                with locks[k]:
                    t = store.get(k, "host")
                    t.fill_(float(seed * 100000 + n))
                    store.mark_dirty(k, "host")
                    store.release(k, "host")
                    last[k] = float(seed * 100000 + n)
                if n % 7 == 0:
                    store.prefetch(r.choice(keys), "host")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=keeper)] + [threading.Thread(target=writer, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert not errors, errors
    assert store.stats_dict()["evictions"] > 0 and changes[0] >= 10  # copies went while the kept set changed
    store.keep(owner, [])
    for k in keys:
        assert torch.equal(store.read(k), torch.full((mib // 16,), last[k])), k


def _prefetch_after_a_get(make_store, *, getting: int):
    """A key of ``n`` bytes on the drive whose prefetch into the host tier gets room only after a get() of it
    (``getting``: that get is still fetching it): the store, ``n``, what the prefetch's fill returned and the
    bytes read from the drive before it."""
    n = 64 * 1024
    store = make_store(host_budget_bytes=4 * n)
    store.put("b", torch.ones(n // 4), home="nvme").wait()
    store.evict("b", "host")
    state = store._state
    entry = state.lookup("b")
    read = store.stats_dict()["bytes_read_nvme"]
    with state.lock:
        entry.prefetch_asked[ts.Tier.HOST] = next(state.tick)  # asked for ...
        entry.last_get = next(state.tick)  # ... then a get() came first
        entry.getting += getting
        try:
            copy = store._transfers.materialize(entry, ts.Tier.HOST, may_skip=True, prefetch_into=ts.Tier.HOST)
        finally:
            entry.getting -= getting
    return store, n, copy, read


def test_a_prefetch_overtaken_by_a_get_of_its_key_reads_nothing(make_store):
    """A prefetch that got room only after the caller had get() the key itself skips (see [Note: A prefetch
    overtaken by its get]): reading it then would serve a use that is over, and a failure of that read would be
    reported by a get in a later step. One asked for again after that get reads, for the later use."""
    store, n, copy, read = _prefetch_after_a_get(make_store, getting=0)
    assert copy is None
    assert store.stats_dict()["bytes_read_nvme"] == read and "host" not in store.info("b")["copies"]
    store.prefetch("b", "host").wait()  # asked again: for the next use
    assert store.stats_dict()["bytes_read_nvme"] == read + n and "host" in store.info("b")["copies"]


def test_a_failed_prefetch_read_for_a_get_fetching_the_key_is_not_kept_for_a_later_get(nvme_dir):
    """A prefetch whose read fails while a get() of the key is fetching it: that get reads the key itself, and
    the failure is not kept for the next get (which would raise it in a later step, after this use had its
    bytes). With no get fetching, the next get reports it, as before (see [Note: A prefetch overtaken by its
    get])."""
    from tierstore.testing import FaultySyscalls

    n = 64 * 1024
    sysc = FaultySyscalls(None)
    with ts.TierStore(nvme_path=nvme_dir, host_budget_bytes=4 * n, device_budget_bytes=n, block_size_bytes=n,
                      file_size_bytes=4 * n, syscalls=sysc) as store:
        for getting, kept in ((1, False), (0, True)):
            store.put("b", torch.ones(n // 4), home="nvme").wait()
            store.evict("b", "host")
            state = store._state
            entry = state.lookup("b")
            sysc.fail_at = sysc.calls  # the prefetch's read fails
            with state.lock:
                entry.getting += getting
                try:
                    with pytest.raises(ts.TierIOError):
                        store._transfers.materialize(entry, ts.Tier.HOST, may_skip=True, prefetch_into=ts.Tier.HOST)
                finally:
                    entry.getting -= getting
            assert (entry.error is not None) == kept
            if kept:
                with pytest.raises(ts.TierStoreError):
                    store.get("b", "host")
            assert torch.equal(store.get("b", "host"), torch.ones(n // 4))  # read again: the fault was once
            store.release("b", "host")
            store.drop("b")


def test_a_prefetch_overtaken_by_a_get_still_fetching_reads_for_it(make_store):
    """A get() of the key that is still fetching it (waiting for room, as the prefetch was) is the use the
    prefetch was for: the prefetch fills the copy and reads it once, and the get finds it (see [Note: A prefetch
    overtaken by its get])."""
    store, n, copy, read = _prefetch_after_a_get(make_store, getting=1)  # the get waits for room too
    assert copy is not None and store.stats_dict()["bytes_read_nvme"] == read + n
    assert torch.equal(store.get("b", "host"), torch.ones(n // 4))
    store.release("b", "host")
    assert store.stats_dict()["bytes_read_nvme"] == read + n


def test_a_stale_home_copy_in_memory_is_brought_up_to_date_not_freed(make_store):
    """A key homed in the host tier, changed in the device tier: a prefetch into the host tier that its get
    overtook skips its fill. Before, the stale home copy was freed to make way for that fill, so the key was left
    with no home copy at all, and eviction of its device copy then waited for ever (seen as a hang under load in
    test_device's late copies)."""
    store = make_store(host_budget_bytes="1MiB", device_budget_bytes="1MiB")
    store.put("a", torch.full((1024,), 1.0), home="host").wait()
    t = store.get("a", "device")
    t.fill_(2.0)
    store.mark_dirty("a", "device")
    store.release("a", "device")
    state = store._state
    entry = state.entries["a"]
    with state.lock:
        entry.prefetch_asked[ts.Tier.HOST] = 0
        entry.last_get = 10**9  # a get of the key came after the prefetch was asked
        store._transfers.materialize(entry, ts.Tier.HOST, may_skip=True, prefetch_into=ts.Tier.HOST)
    assert "host" in store.info("a")["copies"]
    store.evict("a", "device")
    assert torch.equal(store.read("a"), torch.full((1024,), 2.0))
