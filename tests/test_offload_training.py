"""Offloaded training gives the same numbers as resident training, bit for bit (fp32); what it reads, keeps
and frees."""

import copy
import gc
import os
import time

import pytest
import torch
import torch.nn.functional as F
from _training import _assert_same_parameters, _tiny_pair, _train, named_state, train_offloaded, train_resident
from conftest import open_fds, tierstore_threads
from tierstore.integrations.offload import OffloadedParameterError, offload_model
from tierstore.integrations.optim import OffloadedAdamW
from tierstore.tools.vit import PRESETS, SyntheticImages, ViT

import tierstore as ts


@pytest.mark.parametrize("checkpointing,tied,in_backward", [(False, False, False), (True, True, False),
                                                            (False, False, True), (True, True, True)],
                         ids=["plain", "ckpt+tied", "plain-in-backward", "ckpt+tied-in-backward"])
@pytest.mark.parametrize("depth", [0, 2])
@pytest.mark.parametrize("compute", ["host", "device"])
def test_offloaded_training_is_bit_identical(make_store, checkpointing, tied, in_backward, depth, compute):
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    ref = ViT(cfg, checkpoint_blocks=checkpointing, tie_head=tied)
    model = copy.deepcopy(ref)
    data = SyntheticImages(cfg)
    # Budgets far below the model's parameters + Adam state (~0.5 MiB + 1 MiB) force traffic to the drive.
    # Computing in the host tier, the host holds what the device tier would (so its budget grows by as much).
    store = make_store(host_budget_bytes="384KiB" if compute == "device" else "704KiB", device_budget_bytes="320KiB")
    ref_losses, ref_opt = train_resident(ref, data, 5)
    losses, off, opt = train_offloaded(model, data, 5, store, step_in_backward=in_backward, prefetch_depth=depth,
                                       compute_tier=compute)
    assert losses == ref_losses
    assert losses[-1] < losses[0]
    sd = model.state_dict()
    assert list(sd) == list(ref.state_dict())
    for name, value in ref.state_dict().items():
        assert torch.equal(sd[name], value), name
    for mname, module in ref.named_modules():  # a module's own state_dict() too: values, never placeholders
        for name, value in module.state_dict().items():
            assert torch.equal(model.get_submodule(mname).state_dict()[name], value), f"{mname}: {name}"
    ours = named_state(opt.state_dict(beyond_host_budget=True))
    for name, p in ref.named_parameters():
        st = ref_opt.state[p]
        assert torch.equal(ours[name]["exp_avg"], st["exp_avg"]), name
        assert torch.equal(ours[name]["exp_avg_sq"], st["exp_avg_sq"]), name
    stats = store.stats_dict()
    assert stats["bytes_read_nvme"] > 0 and stats["bytes_written_nvme"] > 0
    assert store.memory()["device"]["peak_bytes"] <= 320 * 1024
    assert (store.memory()["device"]["peak_bytes"] > 0) == (compute == "device")
    if depth:
        assert off.prefetch_policy.trace is not None and off.stats.prefetches_issued > 0


def test_prefetch_turns_misses_into_hits(make_store):
    cfg = PRESETS["tiny"]
    counts = {}
    for depth in (0, 2):
        torch.manual_seed(0)
        model = ViT(cfg)
        store = make_store(host_budget_bytes="2MiB", device_budget_bytes="256KiB")
        off = offload_model(model, store, prefetch_depth=depth, compute_tier="device")
        data = SyntheticImages(cfg)
        for step in range(3):
            x, y = data.batch(step, 4)
            F.cross_entropy(model(x), y).backward()
            off.zero_grad()
        counts[depth] = store.stats_dict()["misses"]
    assert counts[2] < counts[0]


def test_no_grad_inference_and_module_called_twice(make_store):
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    model = torch.nn.Sequential(lin, torch.nn.ReLU(), lin)  # the same module twice
    ref = copy.deepcopy(model)
    store = make_store()
    offload_model(model, store)
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    assert torch.equal(model(x), ref(x))  # with grad, twice in a row
    out = model(x).sum()
    out.backward()


def test_inference_mode_then_training(make_store):
    """Under torch.inference_mode() too (it reaches the placeholders' dispatch when a parameter lets go of its
    copy): the same outputs, and training afterwards is unaffected."""
    torch.manual_seed(0)
    ref, model, data = _tiny_pair()
    off = offload_model(model, make_store(host_budget_bytes="2MiB"), resident_threshold_bytes=0)
    x, _ = data.batch(0, 4)
    with torch.inference_mode():
        assert torch.equal(model(x), ref(x))
        assert torch.equal(model(x), ref(x))
    opt = OffloadedAdamW(off, lr=1e-3)
    train_resident(ref, data, 2)
    _train(model, data, 2, opt)
    opt.close()
    _assert_same_parameters(model, ref)


def test_remove_restores_module(make_store):
    torch.manual_seed(0)
    model = ViT(PRESETS["tiny"])
    ref = copy.deepcopy(model)
    store = make_store()
    off = offload_model(model, store)
    with pytest.raises(ValueError, match="already offloaded"):
        offload_model(model, store)
    twin = copy.deepcopy(ref)  # another model with the same names, into the same store: refused before any write
    keys = store.keys()
    with pytest.raises(ValueError, match=r"already holds an offloaded parameter named .* its own TierStore"):
        offload_model(twin, store)
    assert store.keys() == keys and all(not p.is_meta and p.data_ptr() for p in twin.parameters())
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):  # the memory is gone, the shape stays
        assert p.data_ptr() == 0 and p.shape == r.shape and p.dtype == r.dtype and p.device == r.device
        assert isinstance(p, torch.nn.Parameter) and p.is_leaf and p.requires_grad
        assert p.data.is_meta and p.detach().is_meta
        with pytest.raises(OffloadedParameterError, match=f"{name}.*read_param"):  # never a stand-in value
            p.sum()
        with pytest.raises(RuntimeError, match="meta"):  # .data bypasses the parameter: no value to read there
            p.data.sum().item()
        with pytest.raises(OffloadedParameterError, match=f"copy.deepcopy read .*{name}.*read_param"):
            copy.deepcopy(p)  # torch's would copy the meta .data: a copy with no values
        with pytest.raises(OffloadedParameterError, match=f"untyped_storage read .*{name}"):
            p.untyped_storage()  # a storage with no memory: a write into it, or a tensor set_() on it, crashed
        assert "offloaded" in repr(p)
    assert not any(m._backward_pre_hooks or m._backward_hooks for m in model.modules())
    model.to("cpu")  # a conversion that changes nothing reads nothing
    with pytest.raises(OffloadedParameterError, match="convert dtype or device before offload_model"):
        model.double()
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    x, _ = SyntheticImages(PRESETS["tiny"]).batch(0, 2)
    y = model(x)
    off.remove()
    assert not model._forward_pre_hooks and not model.blocks[0].qkv._forward_hooks
    assert not model.blocks[0].qkv._backward_pre_hooks and "forward" not in vars(model)  # its forward unwrapped
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert torch.equal(model(x), ref(x)) and torch.equal(y, ref(x))
    assert store.keys() == []


def test_resident_threshold_keeps_small_params(make_store):
    torch.manual_seed(0)
    model = ViT(PRESETS["tiny"])
    store = make_store()
    off = offload_model(model, store, resident_threshold_bytes=1024)
    assert "blocks.0.norm1.weight" in off.resident  # 64 floats = 256 bytes
    assert model.blocks[0].norm1.weight.untyped_storage().nbytes() == 64 * 4  # resident: its own memory
    assert model.blocks[0].fc1.weight.data_ptr() == 0  # offloaded: a placeholder


def test_eviction_keeps_what_the_optimizer_still_needs(make_store):
    """A parameter whose gradient is complete, its state and its kept gradient rank as needed by their place in
    the optimizer's queue; once stepped they rank as never needed (first to go)."""
    torch.manual_seed(0)
    model = ViT(PRESETS["tiny"])
    store = make_store()
    off = offload_model(model, store, prefetch_depth=2)
    opt = OffloadedAdamW(off, lr=1e-3)
    try:
        data = SyntheticImages(PRESETS["tiny"])
        _train(model, data, 1, opt)
        (first, k1, p1), (_, k2, _) = [(n, k, p) for n, k, p in off.named_offloaded()][:2]
        state = [f"adam/{first}/exp_avg", f"adam/{first}/exp_avg_sq"]
        grad = "grad/" + k1.partition("/")[2]
        assert all(off.later_uses.after[k] == k1 for k in state) and off.later_uses.grads[grad] == k1

        def order():
            return off.victim_order(None, [k1, *state, grad, k2])

        assert order() == [k1, *state, grad, k2]  # after the step none is used again: ties keep their order
        opt._progress = ([(first, k1, p1, None)], 0)  # as the backward hook queues it
        assert off.pass_consumers.next_uses() == {k: 0 for k in (k1, grad, *state)}
        assert order() == [k2, k1, *state, grad]
    finally:
        opt.close()
    assert off.pass_consumers.next_uses() == {}


def test_prefetched_layers_are_not_read_twice(make_store):
    """A layer being fetched for use was ranked as unused (its place in the trace just passed), so a
    prefetch running at that moment could evict it and the layer was read again. The placement leaves the
    fixed depth room for its layers in flight, the one computing and the one before it (it kept four of six
    layers' budget, leaving room for one ahead, and a prefetch then evicted another layer before its use)."""
    torch.manual_seed(0)
    width, layers, depth = 1024, 24, 4
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    layer = width * (width + 1) * 4
    store = make_store(host_budget_bytes=(depth + 2) * layer, device_budget_bytes=2 * layer)
    off = offload_model(model, store, prefetch_depth=depth)
    x = torch.randn(4, width)
    for _ in range(4):
        for key in store.keys():
            store.evict(key, "host")
        before = store.stats_dict()["bytes_read_nvme"]
        with torch.no_grad():
            model(x)
        assert store.stats_dict()["bytes_read_nvme"] - before == layers * layer
    assert off.placer.tried.room_bytes >= (depth + 2) * layer  # the whole budget: nothing is kept
    assert off.placement is None and "no placement" in off.placement_verdict


def test_copying_an_offloaded_model_is_a_clear_error(make_store):
    import io
    import pickle

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    off = offload_model(model, make_store())
    with pytest.raises(TypeError, match="cannot be copied or pickled.*before offload_model"):
        copy.deepcopy(model)
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        pickle.dumps(model)
    with pytest.raises(TypeError, match="cannot be copied or pickled"):
        torch.save(model, io.BytesIO())
    off.remove()
    assert torch.equal(copy.deepcopy(model)[0].weight, model[0].weight)  # an ordinary module again


def test_two_models_on_one_store_keep_their_own_eviction_order(make_store):
    """Each offloaded model ranks its own copies: a second model no longer replaces the first's order, and
    removing one leaves the other's in place. Both train bit-identically to resident training."""
    ref_a, model_a, data = _tiny_pair()
    torch.manual_seed(1)
    ref_b = torch.nn.Sequential(torch.nn.Linear(3072, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
    model_b = copy.deepcopy(ref_b)
    store = make_store(host_budget_bytes="3MiB", device_budget_bytes="256KiB")  # the state is ~3 MiB
    off_a, off_b = offload_model(model_a, store), offload_model(model_b, store)
    opts = [OffloadedAdamW(off, lr=1e-3, weight_decay=0.01) for off in (off_a, off_b)]
    ref_opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01, foreach=False) for m in (ref_a, ref_b)]

    def step(m, o, i, flat):
        x, y = data.batch(i, 8)
        loss = F.cross_entropy(m(x.flatten(1) if flat else x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        return loss.item()

    for i in range(3):  # both models train in turns on the one store
        assert step(model_a, opts[0], i, False) == step(ref_a, ref_opts[0], i, False)
        assert step(model_b, opts[1], i, True) == step(ref_b, ref_opts[1], i, True)
    # Each counts its own parameters and optimizer state, nothing of the other's.
    mine = [sum(off.local_state_bytes().values()) for off in (off_a, off_b)]
    everything = sum(store.info(k)["nbytes"] for k in store.keys() if not k.startswith("grad/"))
    assert all(mine) and sum(mine) == everything, (mine, everything)
    off_a.remove()
    for i in range(3, 5):  # the other's order is still in place
        assert step(model_b, opts[1], i, True) == step(ref_b, ref_opts[1], i, True)
    _assert_same_parameters(model_a, ref_a)
    _assert_same_parameters(model_b, ref_b)
    assert store.stats_dict()["evictions"] > 0


@pytest.mark.parametrize("step", [False, True])
def test_a_dropped_model_frees_its_store(nvme_dir, step):
    """A model, its optimizer and its store dropped without close() (a notebook cell run again, a sweep in one
    process) are collected like any Python object: the swap directory is removed and the threads end, instead
    of holding the drive's space until the process exits."""
    fds = open_fds()
    for _ in range(3):
        store = ts.TierStore(nvme_path=nvme_dir, host_budget_bytes="1MiB", device_budget_bytes="1MiB",
                             file_size_bytes="4MiB", block_size_bytes="64KiB")
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
        opt = OffloadedAdamW(offload_model(model, store), lr=1e-3)
        if step:
            model(torch.randn(2, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert os.listdir(nvme_dir)
        del store, model, opt
        # A write behind still in flight keeps the drive's engine until it ends; idle pool threads end once they
        # see their pool is gone.
        deadline = time.monotonic() + 10
        while (os.listdir(nvme_dir) or tierstore_threads()) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        assert os.listdir(nvme_dir) == []
        assert not tierstore_threads()
    assert open_fds() <= fds
