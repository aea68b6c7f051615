"""pytest-benchmark micro-benchmarks of the store's hot paths.

Run for figures:  pytest perf/test_micro.py --benchmark-enable
Each prints the store's time and, as its reference, a plain torch copy of the
same bytes between the same memories (the floor the store's bookkeeping adds to).
In the default test run they execute once each (benchmarks disabled), so they
cannot rot.
"""

import pytest
import torch

import tierstore as ts

SIZES = {"small_4KiB": 1024, "large_16MiB": 4 * 1024**2}


@pytest.fixture
def store(tmp_path):
    with ts.TierStore(nvme_path=str(tmp_path), host_budget_bytes="256MiB", device_budget_bytes="128MiB") as s:
        yield s


@pytest.mark.parametrize("size", SIZES, ids=list(SIZES))
def test_put_host(benchmark, store, size):
    x = torch.randn(SIZES[size])
    keys = iter(range(10**9))

    def put():
        k = str(next(keys))
        store.put(k, x, home="host").wait()
        store.drop(k)

    benchmark(put)
    assert store.keys() == []  # every put was dropped again
    store.put("last", x, home="host").wait()
    assert torch.equal(store.read("last"), x)


@pytest.mark.parametrize("size", SIZES, ids=list(SIZES))
def test_get_hit_device(benchmark, store, size):
    store.put("x", torch.randn(SIZES[size]), home="host").wait()
    store.get("x", "device")
    store.release("x", "device")

    def get():
        store.get("x", "device")
        store.release("x", "device")

    benchmark(get)
    assert store.stats_dict()["hits"] >= 1


@pytest.mark.parametrize("size", SIZES, ids=list(SIZES))
def test_get_miss_host_to_device(benchmark, store, size):
    x = torch.randn(SIZES[size])
    store.put("x", x, home="host").wait()

    def get_then_evict():
        t = store.get("x", "device")
        store.release("x", "device")
        store.evict("x", "device")
        return t

    benchmark(get_then_evict)
    assert store.stats_dict()["misses"] >= 1


@pytest.mark.parametrize("size", SIZES, ids=list(SIZES))
def test_reference_torch_copy(benchmark, size):
    src = torch.randn(SIZES[size])
    dst = torch.empty_like(src)
    benchmark(dst.copy_, src)
    assert torch.equal(dst, src)


@pytest.mark.parametrize("size", SIZES, ids=list(SIZES))
def test_get_miss_nvme_to_host(benchmark, store, size):
    x = torch.randn(SIZES[size])
    store.put("x", x).wait()

    def read():
        store.evict("x", "host")
        store.get("x", "host")
        store.release("x", "host")

    benchmark(read)
    assert store.stats_dict()["bytes_read_nvme"] >= x.numel() * 4
    assert torch.equal(store.read("x"), x)
