"""A hypothesis state machine holds the store against a plain dict."""

import os

import hypothesis.strategies as st
import torch
from conftest import open_fds, tierstore_threads
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import tierstore as ts

KEYS = [f"k{i}" for i in range(6)]
MEMORY_TIERS = ["device", "host"]


class StoreVsDict(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.store = None
        self.model: dict[str, torch.Tensor] = {}
        self.held: dict[tuple[str, str], torch.Tensor] = {}
        self.fds = open_fds()
        self.threads = set(tierstore_threads())

    @initialize(
        host_pages=st.integers(4, 24),
        device_pages=st.integers(2, 12),
        verify=st.booleans(),
        block_pages=st.sampled_from([1, 2, 16]),
    )
    def open(self, host_pages, device_pages, verify, block_pages):
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="sm-")
        self.store = ts.TierStore(nvme_path=self.dir, host_budget_bytes=host_pages * 4096,
                                  device_budget_bytes=device_pages * 4096, block_size_bytes=block_pages * 4096,
                                  file_size_bytes=8 * 4096, verify_checksums=verify, io_threads=3)

    def _fits_host(self, n):
        return (n + 4095) // 4096 * 4096 <= self.store.config.host_budget_bytes

    @rule(key=st.sampled_from(KEYS), numel=st.integers(0, 3000), seed=st.integers(0, 2**16),
          home=st.sampled_from(["nvme", "host", "device"]))
    def put(self, key, numel, seed, home):
        if self.store.closed:
            return
        x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
        if key in self.model:
            try:
                self.store.put(key, x, home=home)
                raise AssertionError("duplicate put accepted")
            except ValueError:
                return
        try:
            self.store.put(key, x, home=home).wait()
        except ts.TierBudgetError:
            assert key not in self.store
            return
        self.model[key] = x.clone()

    @rule(key=st.sampled_from(KEYS), tier=st.sampled_from(MEMORY_TIERS))
    def prefetch(self, key, tier):
        if self.store.closed or key not in self.model:
            return
        self.store.prefetch(key, tier).wait()

    @rule(key=st.sampled_from(KEYS), tier=st.sampled_from(MEMORY_TIERS))
    def get(self, key, tier):
        if self.store.closed or key not in self.model or (key, tier) in self.held:
            return
        if any(k == key for k, _ in self.held):
            return  # one holder per key keeps the dict model simple
        try:
            t = self.store.get(key, tier)
        except ts.TierBudgetError as e:
            assert "held by get() without release()" in str(e) or "cannot fit" in str(e)
            return
        assert torch.equal(t, self.model[key]), key
        self.held[(key, tier)] = t

    @rule(data=st.data(), delta=st.floats(-4, 4, allow_nan=False))
    def modify(self, data, delta):
        if self.store.closed or not self.held:
            return
        key, tier = data.draw(st.sampled_from(sorted(self.held)))
        t = self.held[(key, tier)]
        t.add_(delta)
        self.store.mark_dirty(key, tier)
        self.model[key] = t.clone()

    @rule(data=st.data())
    def release(self, data):
        if self.store.closed or not self.held:
            return
        key, tier = data.draw(st.sampled_from(sorted(self.held)))
        del self.held[(key, tier)]
        self.store.release(key, tier)

    @rule(key=st.sampled_from(KEYS), tier=st.sampled_from(MEMORY_TIERS))
    def evict(self, key, tier):
        if self.store.closed or key not in self.model:
            return
        if (key, tier) in self.held or self.store.info(key)["home"] == tier:
            return
        try:
            self.store.evict(key, tier)
        except ts.TierBudgetError:
            pass  # write-back staging needed host space held by get()

    @rule(key=st.sampled_from(KEYS))
    def write_back(self, key):
        if self.store.closed or key not in self.model:
            return
        try:
            self.store.write_back(key).wait()
        except ts.TierBudgetError:
            pass

    @rule(key=st.sampled_from(KEYS))
    def drop(self, key):
        if self.store.closed or key not in self.model or any(k == key for k, _ in self.held):
            return
        self.store.drop(key)
        del self.model[key]

    @invariant()
    def budgets_hold(self):
        if self.store is None or self.store.closed:
            return
        mem = self.store.memory()
        for tier in MEMORY_TIERS:
            assert mem[tier]["peak_bytes"] <= mem[tier]["budget_bytes"], mem

    @invariant()
    def held_tensors_match(self):
        for (key, _), t in self.held.items():
            assert torch.equal(t, self.model[key])

    def close_store(self):
        try:
            self._check_and_close()
        finally:
            self.store.close()
        assert os.listdir(self.dir) == [], "swap files left"
        os.rmdir(self.dir)
        assert set(tierstore_threads()) <= self.threads, "threads left"
        assert open_fds() <= self.fds, "fds leaked"

    def _check_and_close(self):
        for key, tier in list(self.held):
            self.store.release(key, tier)
        self.held.clear()
        # Every key still reads back as the model says, from the slowest path.
        for key, x in self.model.items():
            for tier in MEMORY_TIERS:
                if self.store.info(key)["home"] != tier:
                    try:
                        self.store.evict(key, tier)
                    except ts.TierBudgetError:
                        pass
            home = self.store.info(key)["home"]
            tier = home if home in MEMORY_TIERS else "host"
            try:
                t = self.store.get(key, tier)
            except ts.TierBudgetError as e:
                # Only tensors whose home is the host tier can crowd out the staging of another.
                assert home == "nvme" and "by tensors whose home is this tier" in str(e)
                continue
            assert torch.equal(t, x), key
            self.store.release(key, tier)

    def teardown(self):  # close, then check that nothing was lost or leaked
        if self.store is not None and not self.store.closed:
            self.close_store()


StoreVsDict.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], derandomize=True)
test_store_against_dict = StoreVsDict.TestCase
