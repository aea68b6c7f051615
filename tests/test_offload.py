"""Offloaded training gives the same numbers as resident training, bit for bit (fp32)."""

import copy
import gc
import os
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import open_fds, tierstore_threads
from _training import (
    _assert_same_parameters,
    _tiny_pair,
    _train,
    _train_on_ids,
    train_offloaded,
    train_resident,
)
from tierstore.integrations.offload import OffloadedParameterError, offload_model
from tierstore.integrations.optim import OffloadedAdamW

import tierstore as ts
from tierstore.tools.vit import PRESETS, Block, SyntheticImages, ViT, num_params


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
    ours = opt.state_dict()["state"]
    for name, p in ref.named_parameters():
        st = ref_opt.state[p]
        assert torch.equal(ours[name]["exp_avg"], st["exp_avg"]), name
        assert torch.equal(ours[name]["exp_avg_sq"], st["exp_avg_sq"]), name
    stats = store.stats_dict()
    assert stats["bytes_read_nvme"] > 0 and stats["bytes_written_nvme"] > 0
    assert store.memory()["device"]["peak_bytes"] <= 320 * 1024
    assert (store.memory()["device"]["peak_bytes"] > 0) == (compute == "device")
    if depth:
        assert off.policy.trace is not None and off.stats.prefetches_issued > 0


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


def test_a_loss_over_two_forwards_that_cannot_fit_says_what_to_do(make_store):
    """Backward of a loss summing two forwards holds every parameter until the earlier forward's backward reaches
    it: beyond the budget that is an error saying so, and the model trains on afterwards with a backward per
    forward, as the resident one does."""
    ref, model, data = _tiny_pair()
    # half the parameters, and room for one update with its gradient
    off = offload_model(model, make_store(host_budget_bytes=num_params(ref) * 2 + 64 * 1024))
    (x1, y1), (x2, y2) = data.batch(0, 4), data.batch(1, 4)
    loss = F.cross_entropy(model(x1), y1) + F.cross_entropy(model(x2), y2)
    with pytest.raises(ts.TierBudgetError, match=r"sums several forwards .* Call backward\(\) on each forward"):
        loss.backward()
    off.zero_grad()
    opt = OffloadedAdamW(off, lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    for m, o in ((ref, ref_opt), (model, opt)):
        for x, y in ((x1, y1), (x2, y2)):
            F.cross_entropy(m(x), y).backward()
        o.step()
        o.zero_grad()
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


@pytest.mark.parametrize("depth", [0, 2])
def test_saved_views_of_weights_survive_buffer_reuse(make_store, depth):
    # F.linear saves weight.t(), a view of the forward-time buffer; with a device budget of two layers the
    # store reuses that buffer for later layers before backward runs.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    ref = copy.deepcopy(model)
    x = torch.randn(2, 5, 64)
    ref(x).sum().backward()
    store = make_store(device_budget_bytes="40KiB", host_budget_bytes="40KiB")
    off = offload_model(model, store, prefetch_depth=depth, compute_tier="device")
    for _ in range(3):
        model(x).sum().backward()
        for (name, key, _), p in zip(off.named_offloaded(), ref.parameters()):
            assert torch.equal(off.grads[key], p.grad), name
        off.zero_grad()
    assert store.stats_dict()["evictions"] > 0


def test_groups_know_their_bytes(make_store):
    torch.manual_seed(0)
    model = ViT(PRESETS["tiny"])
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    off = offload_model(model, make_store(), prefetch_depth=2)
    assert sum(off.policy.unit_bytes.values()) == total  # what prefetch_bytes is counted against


def test_eviction_keeps_what_the_optimizer_still_needs(make_store):
    """A parameter whose gradient is complete, and its state, rank as needed by their place in the
    optimizer's queue; once stepped they rank as never needed (first to go)."""
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
        assert all(off.later_uses.after[k] == k1 for k in state)

        def order():
            return off.victim_order(None, [k1, *state, k2])

        assert order() == [k1, *state, k2]  # after the step none is used again: ties keep their order
        opt._queue = [(first, k1, p1, None)]  # as the backward hook queues it
        assert off.later_uses.queued() == {k: 0 for k in (k1, *state)}
        assert order() == [k2, k1, *state]
    finally:
        opt.close()
    assert off.later_uses.queues == []


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


class _TiedProjection(torch.nn.Module):
    """A parent with no parameters of its own that reads its children's weights directly."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
        self.head = torch.nn.Linear(16, 16)

    def forward(self, ids):
        h = self.body(self.embed(ids))
        logits = F.linear(h, self.embed.weight)  # a tied projection: never calls self.embed
        penalty = self.head.weight.pow(2).mean()  # a term that reads a child's weight, not its forward
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten()) + penalty + self.head(h).mean()


@pytest.mark.parametrize("in_backward", [False, True])
def test_parent_reading_a_childs_weight_trains_bit_identically(make_store, in_backward):
    torch.manual_seed(0)
    ref = _TiedProjection()
    model = copy.deepcopy(ref)
    store = make_store(host_budget_bytes="96KiB")
    off = offload_model(model, store)
    _train_on_ids(ref, model, off, vocab=32, steps=4, step_in_backward=in_backward)
    _assert_same_parameters(model, ref)
    # Learned: the root unit now fetches the weights its forward reads, ahead of use.
    assert set(off.units()[""]) == {"embed.weight", "head.weight"}
    with pytest.raises(OffloadedParameterError, match=r"'head.weight' \(of head\).*read_param"):
        model.head.weight.pow(2).mean()  # outside the forward: no value to compute with


class _GradientPenalty(torch.nn.Module):
    """A forward that runs a backward of its own (``torch.autograd.grad`` of a gradient penalty), then goes on
    to read parameters, its own and a child's."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 16)
        self.critic = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.head = torch.nn.Linear(16, 16)
        self.scale = torch.nn.Parameter(torch.ones(16, 16))

    def forward(self, ids):
        h = self.embed(ids)
        (g,) = torch.autograd.grad(self.critic(h).sum(), h, create_graph=True)
        penalty = (g.norm(dim=-1) - 1).pow(2).mean()
        logits = self.head(h) @ self.scale + self.head.weight.sum()
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten()) + penalty


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_backward_inside_the_forward_trains_bit_identically(make_store, in_backward):
    torch.manual_seed(0)
    ref = _GradientPenalty()
    model = copy.deepcopy(ref)
    store = make_store(host_budget_bytes="96KiB", device_budget_bytes="64KiB")
    off = offload_model(model, store, resident_threshold_bytes=0)
    _train_on_ids(ref, model, off, vocab=16, steps=4, step_in_backward=in_backward)
    _assert_same_parameters(model, ref)
    assert not any(sp.holds for sp in off.params.values())


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
        self.a = torch.nn.Linear(32, 8)
        self.b = torch.nn.Linear(32, 8)

    def forward(self, x):
        h = self.body(x)
        return self.a(h), self.b(h)


@pytest.mark.parametrize("how", ["backward-inputs", "autograd-grad"])
@pytest.mark.parametrize("in_backward", [False, True])
def test_parameters_as_the_inputs_of_a_backward(make_store, how, in_backward):
    """``loss.backward(inputs=[...])`` (only the heads trained) and ``torch.autograd.grad(loss, params)`` (the
    gradients assigned to ``.grad`` by hand) take offloaded parameters as the leaves to differentiate for: that
    reads no value of them, and trains as the resident model does."""
    torch.manual_seed(0)
    ref = _TwoHeads()
    model = copy.deepcopy(ref)
    body = copy.deepcopy(ref.body.state_dict())
    off = offload_model(model, make_store(host_budget_bytes="48KiB", device_budget_bytes="32KiB"))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt = OffloadedAdamW(off, lr=1e-2, step_in_backward=in_backward)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 32, generator=g), torch.randint(0, 8, (4,), generator=g)
        for m, o in ((ref, ref_opt), (model, opt)):
            a, b = m(x)
            loss = F.cross_entropy(a, y) + F.cross_entropy(b, y)
            if how == "backward-inputs":
                loss.backward(inputs=[*m.a.parameters(), *m.b.parameters()])
            else:
                params = list(m.parameters())
                for p, grad in zip(params, torch.autograd.grad(loss, params)):
                    p.grad = grad * 0.5
            o.step()
            o.zero_grad()
    opt.close()
    _assert_same_parameters(model, ref)
    if how == "backward-inputs":  # the body had no gradient, so it kept its values
        assert all(torch.equal(off.read_param(f"body.{name}"), value) for name, value in body.items())
    else:
        assert not torch.equal(off.read_param("body.0.weight"), body["0.weight"])
    assert not any(sp.holds for sp in off.params.values())


class _Latents(torch.nn.Module):
    """Returns a view of its own parameter, as Perceiver's latent embeddings do."""

    def __init__(self):
        super().__init__()
        self.latents = torch.nn.Parameter(torch.randn(6, 16))

    def forward(self, batch):
        return self.latents.expand(batch, -1, -1)


class _LatentsNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 16)
        self.latents = _Latents()
        self.norm = torch.nn.LayerNorm(16)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
        self.head = torch.nn.Linear(16, 16)

    def forward(self, ids):
        q = self.norm(self.latents(ids.shape[0]))  # computed with after the latents' module returned
        q = q + self.mlp(q) + self.embed(ids).mean(1, keepdim=True)
        return F.cross_entropy(self.head(q).flatten(0, 1), ids[:, :1].expand(-1, 6).flatten())


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_module_returning_a_view_of_its_parameter(make_store, in_backward):
    """The view stays valid while the model's forward uses it (its memory was reused by the next fetch, and the
    model trained on other values, silently); one returned from a module called on its own raises."""
    torch.manual_seed(0)
    ref = _LatentsNet()
    model = copy.deepcopy(ref)
    off = offload_model(model, make_store(host_budget_bytes="64KiB", device_budget_bytes="32KiB"),
                        resident_threshold_bytes=0)
    _train_on_ids(ref, model, off, vocab=16, steps=4, step_in_backward=in_backward)
    _assert_same_parameters(model, ref)
    assert not any(sp.holds for sp in off.params.values())
    with pytest.raises(OffloadedParameterError, match=r"forward of latents returned a view of the offloaded "
                                                      r"parameter 'latents.latents'.*\.clone\(\)"):
        model.latents(2)
    with torch.no_grad():
        assert torch.equal(model(torch.ones(2, 6, dtype=torch.long)), ref(torch.ones(2, 6, dtype=torch.long)))


class _KeepsTransposeFn(torch.autograd.Function):
    """A linear map that keeps ``ctx.wt = weight.t()`` for backward instead of ``ctx.save_for_backward(weight)``:
    a view of the weight's memory that no saved-tensor hook sees."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x)
        ctx.wt = weight.t()
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad @ ctx.wt.t(), grad.t() @ x


class _KeepsTranspose(torch.nn.Linear):
    def forward(self, x):
        return _KeepsTransposeFn.apply(x, self.weight) + self.bias


class _KeepsTransposeLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 64)
        self.layers = torch.nn.Sequential(*[_KeepsTranspose(64, 64) for _ in range(6)])  # 16 KiB weights
        self.head = torch.nn.Linear(64, 16)

    def forward(self, ids):
        return F.cross_entropy(self.head(self.layers(self.embed(ids.flatten()))), ids.flatten())


def _train_with_views(ref, model, store, *, steps, in_backward):
    """Train a _KeepsTransposeLM-like pair resident and offloaded (no prefetch: evictions in a fixed order);
    each loss, its graph and the views it keeps go before the next forward. Same losses and parameters."""
    off = offload_model(model, store, resident_threshold_bytes=0, placement=False, prefetch_depth=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt = OffloadedAdamW(off, lr=1e-2, step_in_backward=in_backward)
    for step in range(steps):
        ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(step))
        losses = []
        for m, o in ((ref, ref_opt), (model, opt)):
            loss = m(ids)
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
            del loss
        assert losses[0] == losses[1], step
        _assert_same_parameters(model, ref)
    opt.close()
    return off


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_view_of_a_weight_kept_past_its_forward_keeps_its_values(make_store, in_backward):
    """``ctx.wt = weight.t()`` outlives the layer's hold: its memory was reused by the next fetch and backward
    computed with other values, silently (embed.weight differed after step 0 at this budget, both modes). The
    memory is now kept while the view lives, and training is bit-identical; where the budget cannot hold what
    is so kept, the budget error says why."""
    torch.manual_seed(0)
    ref = _KeepsTransposeLM()
    model = copy.deepcopy(ref)
    off = _train_with_views(ref, model, make_store(host_budget_bytes="160KiB", device_budget_bytes="32KiB"),
                            steps=3, in_backward=in_backward)
    off.remove()
    model = copy.deepcopy(ref)
    tight = make_store(host_budget_bytes="96KiB", device_budget_bytes="32KiB")
    off = offload_model(model, tight, resident_threshold_bytes=0, placement=False)
    with pytest.raises(ts.TierBudgetError, match=r"freed copies \(param/layers.0.weight, .*kept because tensors "
                                                 r"viewing them are still alive.*save_for_backward"):
        model(torch.zeros(4, 6, dtype=torch.long)).backward()


class _CachesTranspose(torch.nn.Linear):
    """Caches ``weight.t()`` at its first forward and computes with the cached view from then on: a view of
    the resident parameter, it reads every optimizer update."""

    def forward(self, x):
        if not hasattr(self, "_wt"):
            self._wt = self.weight.t()
        return x @ self._wt + self.bias


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_view_cached_across_steps_reads_the_updates(make_store, in_backward):
    """The cached view's memory is kept for it (see the test above) and is given the parameter's current value
    each time the parameter is fetched again, so the view reads what the resident one does."""
    torch.manual_seed(0)
    ref = _KeepsTransposeLM()
    ref.layers = torch.nn.Sequential(*[_CachesTranspose(64, 64) for _ in range(6)])
    model = copy.deepcopy(ref)
    _train_with_views(ref, model, make_store(host_budget_bytes="224KiB", device_budget_bytes="32KiB"), steps=4,
                      in_backward=in_backward)


def test_mha_keeps_its_packed_path_and_gradients(make_store, monkeypatch):
    """Backward fetches leave autograd's graph alone: query, key and value stay one tensor, so
    MultiheadAttention takes the packed in-projection, as it does without tierstore."""
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    model = copy.deepcopy(ref)
    off = offload_model(model, make_store(), units=())  # no unit: out_proj's weight is fetched on demand
    packed = []
    real = F._in_projection_packed

    def recording(q, k, v, w, b=None):
        packed.append(q is k and k is v)
        return real(q, k, v, w, b)

    monkeypatch.setattr(F, "_in_projection_packed", recording)
    for mha in (ref, model):
        x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out, _ = mha(x, x, x, need_weights=False)
        out.pow(2).sum().backward()
        mha.input_grad = x.grad
    assert packed == [True, True]
    assert torch.equal(model.input_grad, ref.input_grad)
    for name, p in ref.named_parameters():
        assert torch.equal(off.grads[f"param/{name}"], p.grad), name


def test_a_torch_optimizer_over_offloaded_parameters_is_refused(make_store):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    offload_model(model, make_store())
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    with pytest.raises(OffloadedParameterError, match="0.weight.*OffloadedAdamW"):
        opt.step()


def test_submodule_called_alone_then_model_under_no_grad(make_store):
    """A submodule's forward outside the model's keeps its saved views of weights: the buffers the
    no_grad forward reuses in between do not leak into its gradients."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    model = copy.deepcopy(ref)
    off = offload_model(model, make_store(host_budget_bytes="24KiB"))  # ~ five weights: buffers are reused
    x = torch.randn(3, 32)
    for m in (ref, model):
        y = m[1](m[0](x))
        with torch.no_grad():
            m(x)
        y.pow(2).sum().backward()
    for name, p in ref.named_parameters():
        if p.grad is not None:
            assert torch.equal(off.grads[f"param/{name}"], p.grad), name
    assert any(k.startswith("grad/") for k in off.store.keys())  # kept in the store
    model.zero_grad()  # torch's own zero_grad clears the gradients kept for offloaded parameters too
    assert len(off.grads) == 0 and not any(k.startswith("grad/") for k in off.store.keys())


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")  # raised by torch importing dynamo
def test_torch_compile_is_refused(make_store):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    offload_model(model, make_store())
    with pytest.raises(OffloadedParameterError, match="torch.compile of an offloaded model"):
        torch.compile(model)(torch.randn(2, 8))


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")  # torch.jit.script is deprecated
def test_a_torchscript_module_is_refused_before_anything_moves(make_store):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.jit.script(torch.nn.Linear(8, 2)))
    before = [p.detach().clone() for p in model.parameters()]
    store = make_store()
    with pytest.raises(TypeError, match="'1' is a TorchScript module"):
        offload_model(model, store)
    assert store.keys() == [] and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    offload_model(model[0], store)  # its eager part offloads as any module


_DDP = """
import sys, torch, torch.distributed as dist
import tierstore as ts
from tierstore.integrations import offload_model
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
with ts.TierStore(nvme_path=sys.argv[1], host_budget_bytes="1MiB") as store:
    offload_model(model, store)
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/group", rank=0, world_size=1)
    try:
        torch.nn.parallel.DistributedDataParallel(model)
    except Exception as e:
        print(type(e).__name__, e)
    dist.destroy_process_group()
"""


def test_data_parallel_wrapping_is_refused_with_what_to_use(tmp_path):
    """DistributedDataParallel broadcasts every parameter at construction: refused, saying to use FSDP2 (in a
    process of its own: a gloo group leaves a descriptor open)."""
    out = subprocess.run([sys.executable, "-c", _DDP, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("OffloadedParameterError DistributedDataParallel cannot wrap a model offloaded "
                                 "with offload_model: "), out.stdout + out.stderr
    assert "offload_fsdp instead" in out.stdout


def test_only_a_wrapper_gets_the_wrapper_hint(make_store):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    offload_model(model, make_store())
    with pytest.raises(OffloadedParameterError, match=r"^TensorBase.sum read"):
        model[0].weight.sum()


class _Interrupted(torch.nn.Linear):
    """Stops the forward with a KeyboardInterrupt (Ctrl-C) when armed, after computing with its weight."""

    armed = False

    def forward(self, x):
        y = super().forward(x)
        if self.armed:
            raise KeyboardInterrupt
        return y


def test_a_forward_stopped_by_ctrl_c_leaves_nothing_held(make_store):
    """torch runs its modules' always-call forward hooks for an Exception, not for a KeyboardInterrupt: the
    stopped forward's units, saved-tensor hooks and pass count are cleared by the next forward, which trains on
    as the resident model does after the same interrupted step (and another thread may run the model again)."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), _Interrupted(64, 64))
                                for _ in range(6)])
    model = copy.deepcopy(ref)
    store = make_store(host_budget_bytes="96KiB", param_tier="nvme", optimizer_tier="nvme")  # ~ four weights
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


class _Gate(torch.nn.Module):
    """Waits, inside the model's forward (or, in backward, at the gradient through it), until let go."""

    def __init__(self):
        super().__init__()
        self.inside, self.go, self.in_backward = threading.Event(), threading.Event(), False

    def _wait(self, grad=None):
        self.inside.set()
        assert self.go.wait(30)
        return grad

    def forward(self, x):
        if self.in_backward:
            if x.requires_grad:
                x.register_hook(self._wait)
        else:
            self._wait()
        return x


@pytest.mark.parametrize("during", ["forward", "backward"])
def test_a_second_thread_is_refused_while_the_model_runs(make_store, during):
    """Two threads running an offloaded model at once released each other's parameters: a segfault with four
    inference threads. A forward while another thread is in the forward or backward raises; the running pass
    is unharmed, and calls serialized by a lock give the resident values."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), _Gate(),
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


def test_units_hold_whole_subtrees_and_must_fit_the_compute_budget(make_store):
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    model = ViT(cfg)
    off = offload_model(model, make_store(), units=[Block])
    units = off.units()
    assert set(units["blocks.0"]) == {f"blocks.0.{n}" for n, _ in model.blocks[0].named_parameters()}
    assert not any(name.startswith("blocks.0.") for name in units)  # nothing inside a unit is a unit
    off.remove()
    store = make_store(host_budget_bytes="64KiB")  # a block's parameters are ~200 KiB
    with pytest.raises(ValueError, match=r"unit .blocks.0. holds \d+ bytes .* MiB.* host budget \(65536 bytes\)"):
        offload_model(model, store, units=[Block])
    assert store.keys() == [] and type(model.blocks[0].qkv.weight) is torch.nn.Parameter  # nothing left behind
    with pytest.raises(ValueError, match="no module named 'blocks.99'"):
        offload_model(model, store, units=["blocks.99"])
    # Each parameter takes whole pages of the budget: 20 biases of 1 KiB are 80 KiB there, not 20.
    with pytest.raises(ValueError, match=r"unit '<root>' holds 81920 bytes .* whole 4 KiB pages"):
        offload_model(torch.nn.ParameterList(torch.zeros(256) for _ in range(20)), store)
    assert store.keys() == []


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
    off_a.remove()
    for i in range(3, 5):  # the other's order is still in place
        assert step(model_b, opts[1], i, True) == step(ref_b, ref_opts[1], i, True)
    _assert_same_parameters(model_a, ref_a)
    _assert_same_parameters(model_b, ref_b)
    assert store.stats_dict()["evictions"] > 0


class _TiedLM(torch.nn.Module):
    """Standard modules only, constructed in the order they are registered, with a tied output projection."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.LayerNorm(96),
                                        torch.nn.Linear(96, 32))
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return F.cross_entropy(self.head(self.body(self.embed(ids))).flatten(0, 1), ids.flatten())


def test_a_model_built_on_meta_equals_eager_construction_and_trains_bit_identically(make_store):
    torch.manual_seed(0)
    ref = _TiedLM()
    with torch.device("meta"):
        model = _TiedLM()
    store = make_store(host_budget_bytes="96KiB")
    torch.manual_seed(0)  # the same draws, module by module, as eager construction made
    off = offload_model(model, store)
    assert model.head.weight is model.embed.weight and not any(t.is_meta for t in model.state_dict().values())
    _assert_same_parameters(model, ref)
    _train_on_ids(ref, model, off, vocab=64, steps=3)
    _assert_same_parameters(model, ref)


def test_meta_modules_without_an_init_need_init_fn_and_nothing_is_left_behind(make_store):
    class Scaled(torch.nn.Module):  # a parameter of its own and no reset_parameters()
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(32))
            self.proj = torch.nn.Linear(32, 32)

        def forward(self, x):
            return self.proj(x) * self.scale

    with torch.device("meta"):
        model = Scaled()
    store = make_store()
    with pytest.raises(ValueError, match=r"no reset_parameters\(\) to initialize them: <root>.*init_fn"):
        offload_model(model, store)
    assert store.keys() == [] and model.scale.is_meta

    def init(module):
        if isinstance(module, Scaled):
            torch.nn.init.ones_(module.scale)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()

    off = offload_model(model, store, init_fn=init)
    assert torch.equal(off.read_param("scale"), torch.ones(32))
    off.remove()
    with torch.device("meta"):
        big = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])  # 1 MiB of weights
    small = make_store(nvme_budget_bytes="512KiB")
    with pytest.raises(ts.StoreFullError, match=r"1.0 MiB of parameters needs that much room .* 0.5 MiB is free"):
        offload_model(big, small)
    assert small.keys() == [] and all(p.is_meta for p in big.parameters())  # checked before any write


class _Parametrized(torch.nn.Module):
    """A weight-normed convolution (as wav2vec2's positional one) and a symmetric-weight layer without a
    right_inverse: torch.nn.utils.parametrize keeps their original tensors in a ParametrizationList."""

    def __init__(self):
        super().__init__()
        from torch.nn.utils import parametrize

        class Symmetric(torch.nn.Module):
            def forward(self, w):
                return w.triu() + w.triu(1).transpose(-1, -2)

        self.conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 8, 3, padding=1), dim=2)
        self.sym = torch.nn.Linear(8, 8)
        parametrize.register_parametrization(self.sym, "weight", Symmetric())

    def forward(self, x):
        return self.sym(self.conv(x).transpose(1, 2))


def test_a_model_with_parametrized_weights_built_on_meta_equals_eager_construction(make_store):
    """A parametrized module's reset_parameters() writes a value computed from its original tensors, which is
    lost: on meta its originals would stay uninitialized memory. They are computed from the module's own
    initialization as registering the parametrization computes them, so they equal eager construction's."""
    torch.manual_seed(0)
    ref = _Parametrized()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = _Parametrized()
    off = offload_model(model, make_store())
    state, ref_state = model.state_dict(), ref.state_dict()
    assert list(state) == list(ref_state) and "conv.parametrizations.weight.original1" in state
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    off.remove()


class _LegacyTable(torch.nn.Module):
    """Makes a weight with ``torch.Tensor(size)``, which ignores ``torch.device("meta")`` (XLNet's attention does
    so): in a model built on meta it is real, uninitialized memory."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.Tensor(4, 8))
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x) + self.table.sum(0)


def _init_table(module):
    if isinstance(module, _LegacyTable):
        torch.nn.init.constant_(module.table, 0.5)
    elif isinstance(module, torch.nn.Linear):
        module.reset_parameters()


def test_a_real_parameter_in_a_model_built_on_meta_is_initialized_kept_or_an_error(make_store):
    """Whether a real parameter of a model built on meta holds values or uninitialized memory cannot be told:
    it is an error naming it until ``real_parameters`` says which; "initialize" has its module's init write it
    (and one that does not is refused with the parameter's values put back), "keep" keeps it."""
    with torch.device("meta"):
        model = _LegacyTable()
    assert not model.table.is_meta and model.proj.weight.is_meta
    with torch.no_grad():
        model.table.fill_(3.0)  # stands for whatever the memory held
    store = make_store()
    with pytest.raises(ValueError, match=r"not: table\. A constructor that ignores torch.device\('meta'\)"):
        offload_model(model, store, init_fn=_init_table)
    with pytest.raises(ValueError, match=r"init_fn\(<root>\) \(_LegacyTable\) left table .*unwritten"):
        offload_model(model, store, init_fn=lambda m: None, real_parameters="initialize")
    assert store.keys() == [] and model.proj.weight.is_meta and torch.equal(model.table, torch.full((4, 8), 3.0))
    off = offload_model(model, store, init_fn=_init_table, real_parameters="initialize")
    assert torch.equal(off.read_param("table"), torch.full((4, 8), 0.5))
    assert torch.isfinite(model(torch.ones(1, 8))).all()
    off.remove()
    with torch.device("meta"):
        kept = _LegacyTable()
    with torch.no_grad():
        kept.table.fill_(2.0)
    off = offload_model(kept, make_store(), init_fn=_init_table, real_parameters="keep")
    assert torch.equal(off.read_param("table"), torch.full((4, 8), 2.0))
    with pytest.raises(ValueError, match="real_parameters='all': choose one of 'initialize', 'keep'"):
        offload_model(torch.nn.Linear(2, 2), make_store(), real_parameters="all")


class _HalfInit(torch.nn.Linear):
    def reset_parameters(self):  # writes half the weight and not the bias
        torch.nn.init.ones_(self.weight[:2])


class _UnwrittenBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.long))  # set in __init__ only

    def reset_parameters(self):
        pass


def _old_weight_norm(module):
    """torch.nn.utils.weight_norm: a forward pre-hook computes the weight from weight_g and weight_v."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.nn.utils.weight_norm(module)


@pytest.mark.parametrize("build, left", [
    (lambda: _HalfInit(8, 4), r"<root>.reset_parameters\(\) \(_HalfInit\) left weight, bias"),
    (lambda: torch.nn.Sequential(_UnwrittenBuffer()), r"0.reset_parameters\(\) .* left 0.steps"),
    (lambda: _old_weight_norm(torch.nn.Linear(8, 4)), r"left weight_g, weight_v"),
], ids=["part-of-a-weight", "a-buffer", "hook-weight-norm"])
def test_a_meta_tensor_its_init_leaves_unwritten_is_refused(make_store, build, left):
    """Memory given to a meta tensor holds whatever was there: a tensor its module's initialization leaves
    unwritten, in whole or part, would train on it silently; it raises, naming it, and nothing is kept."""
    with torch.device("meta"):
        model = build()
    store = make_store()
    with pytest.raises(ValueError, match=left + r" \(in whole or part\) unwritten: .*init_fn"):
        offload_model(model, store)
    assert store.keys() == [] and all(t.is_meta for t in (*model.parameters(), *model.buffers()))


def test_the_encoder_is_bit_identical_in_eval_with_the_fast_path_on_and_off(make_store):
    """nn.TransformerEncoderLayer's fused eval path needs ordinary parameters and no forward hook inside the layer:
    held parameters are ordinary ones and the layer's forward is wrapped, so the offloaded encoder takes it as the
    resident one does; with the fast path off both take the standard path."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    ref = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    model = copy.deepcopy(ref)
    off = offload_model(model, make_store(), resident_threshold_bytes=0)
    assert sorted(off.units()) == ["layers.0", "layers.1"]
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)
    off.remove()  # the wrapped forwards are undone with the hooks
    assert not any("forward" in vars(layer) for layer in model.layers)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


@pytest.mark.parametrize("write", [
    lambda p: p.data.normal_(mean=0.0, std=0.02),  # initialization code of many models
    lambda p: p.data.zero_(),
    lambda p: p.data.__setitem__((slice(None), 0), 1.0),
    lambda p: p.data.view(-1)[:3].fill_(1.0),
    lambda p: p.detach().copy_(torch.ones(p.shape)),
    lambda p: setattr(p, "data", torch.ones(p.shape)),
], ids=["data-normal_", "data-zero_", "data-setitem", "data-view-fill_", "detach-copy_", "assign-data"])
def test_a_write_that_would_be_lost_is_refused(make_store, write):
    """Outside forward an offloaded parameter's values live in the store: a write through ``.data``, a view of
    it, or an assignment would change nothing the model computes with, so it raises and names the parameter."""
    ref, model, data = _tiny_pair()
    off = offload_model(model, make_store())
    p = model.blocks[0].fc1.weight
    with pytest.raises(OffloadedParameterError, match=r"'blocks.0.fc1.weight' .* and be lost.*load_state_dict"):
        write(p)
    assert p.data.shape == p.shape and p.data.dtype == p.dtype and p.data.is_meta  # metadata still reads
    x, _ = data.batch(0, 2)
    assert torch.equal(model(x), ref(x))  # nothing changed
    model.to("cpu")  # ``param.data = param`` (a conversion that changes nothing) is no write
    off.remove()


@pytest.mark.parametrize("read", [
    lambda ema, p: ema.mul_(0.9).add_(p.data, alpha=0.1),  # an EMA of the weights: torch alone adds nothing here
    lambda ema, p: ema.sub_(p.detach()),
    lambda ema, p: torch._foreach_add_([ema], [p.detach()]),
    lambda ema, p: torch._foreach_lerp_([ema], [p.detach()], 0.5),
    lambda ema, p: torch.add(ema, p.data, out=ema),
    lambda ema, p: torch.equal(ema, p.data),
    lambda ema, p: p.detach().to("cpu"),
], ids=["data-add_", "detach-sub_", "foreach-add_", "foreach-lerp_", "add-out", "equal", "to-cpu"])
def test_a_value_computed_from_data_outside_the_forward_is_refused(make_store, read):
    """``.data`` and ``detach()`` of an offloaded parameter outside the forward are meta tensors with no values.
    torch computes some ops of a real tensor and a meta one as a silent no-op (``cpu.add_(meta)`` returns the
    CPU tensor unchanged): each would give a value the parameter's values never went into, so each raises."""
    ref, model, _ = _tiny_pair()
    off = offload_model(model, make_store())
    p = model.blocks[0].fc1.weight
    ema = ref.blocks[0].fc1.weight.detach().clone()
    with pytest.raises(OffloadedParameterError, match=r"'blocks.0.fc1.weight' .* through its .data .*read_param"):
        read(ema, p)
    assert (p.data * torch.tensor(2.0)).is_meta and p.detach().double().is_meta  # still meta: no value made
    off.remove()


def _train_beside_resident(ref, model, store, *, width: int, steps: int = 3, compute_tier: str | None = None,
                           **opt_kw) -> OffloadedAdamW:
    """Train ``ref`` resident and ``model`` offloaded into ``store`` on the same batches, asserting the same
    parameters after every step; returns the offloaded model's optimizer, open."""
    off = offload_model(model, store, compute_tier=compute_tier)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt = OffloadedAdamW(off, lr=1e-2, **opt_kw)
    for step in range(steps):
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(step))
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
        _assert_same_parameters(model, ref)
    return opt


class _ClippedLinear(torch.nn.Linear):
    """Clips its own weight on every forward (as weight clipping and renormalization do): in place, or by
    assigning ``.data``."""

    assign = False

    def forward(self, x):
        if self.assign:
            self.weight.data = self.weight.data.clamp(-0.05, 0.05)
        else:
            with torch.no_grad():
                self.weight.clamp_(-0.05, 0.05)
        return super().forward(x)


@pytest.mark.parametrize("assign", [False, True], ids=["in-place", "assign-data"])
@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in-backward"])
def test_a_write_in_forward_is_kept_as_the_resident_model_keeps_it(make_store, in_backward, assign, monkeypatch):
    monkeypatch.setattr(_ClippedLinear, "assign", assign)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[_ClippedLinear(96, 96) for _ in range(6)], torch.nn.Linear(96, 4))
    with torch.no_grad():
        for m in ref[:6]:
            m.weight.mul_(2)  # some weights beyond the clip
    model = copy.deepcopy(ref)
    store = make_store(host_budget_bytes="192KiB", device_budget_bytes="64KiB")  # the weights cycle through
    opt = _train_beside_resident(ref, model, store, width=96, step_in_backward=in_backward)
    with torch.no_grad():
        x = torch.randn(4, 96)
        assert torch.equal(model(x), ref(x))
    _assert_same_parameters(model, ref)
    assert store.stats_dict()["bytes_read_nvme"] > 0
    opt.close()


def test_autograd_grad_over_the_parameters_gives_the_resident_gradients(make_store):
    """``torch.autograd.grad(loss, parameters)`` accumulates no ``.grad``, so no parameter's gradient is seen
    complete before that backward ends: each stays held to its end. With room for that it gives the resident
    gradients (and the model trains on after it); without, the budget error says why."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(3, 64)
    expected = torch.autograd.grad(ref(x).pow(2).sum(), list(ref.parameters()))
    model = copy.deepcopy(ref)
    offload_model(model, make_store(host_budget_bytes="512KiB", param_tier="nvme"))
    got = torch.autograd.grad(model(x).pow(2).sum(), list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    model(x).sum().backward()
    ref(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    tight = copy.deepcopy(ref)
    offload_model(tight, make_store(host_budget_bytes="64KiB", param_tier="nvme"))  # under the 66 KiB of weights
    with pytest.raises(ts.TierBudgetError, match=r"torch.autograd.grad\(loss, parameters\) accumulates no .grad"):
        torch.autograd.grad(tight(x).pow(2).sum(), list(tight.parameters()))


class _Momentum(torch.nn.Module):
    """A query encoder trained by the optimizer and a key encoder that its forward moves towards it (MoCo, BYOL,
    DINO): the update reads and writes parameters of modules that are not running, four ways."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.q = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
        self.k = copy.deepcopy(self.q).requires_grad_(False)
        self.head = torch.nn.Linear(128, 4)

    def forward(self, x):
        with torch.no_grad():
            for pk, pq in zip(self.k.parameters(), self.q.parameters()):
                if self.how == "assign-data":
                    pk.data = pk.data * 0.9 + pq.data * 0.1
                elif self.how == "through-data":
                    pk.data.mul_(0.9).add_(pq.data, alpha=0.1)
                elif self.how == "detach":
                    pk.mul_(0.9).add_(pq.detach(), alpha=0.1)
                else:
                    pk.copy_(pk * 0.9 + pq * 0.1)
        return self.head(torch.cat([self.q(x), self.k(x)], -1))


@pytest.mark.parametrize("how, compute, in_backward", [
    ("assign-data", "host", False), ("through-data", "host", False), ("detach", "host", False), ("copy", "host", False),
    ("through-data", "host", True), ("through-data", "device", False), ("through-data", "device", True),
], ids=["assign-data", "through-data", "detach", "copy", "through-data-in-backward", "through-data-device",
        "through-data-device-in-backward"])
def test_a_momentum_encoder_updated_in_the_forward_trains_as_the_resident_one(make_store, how, compute, in_backward):
    """Inside the forward, ``.data`` and ``detach()`` of a parameter no running module holds fetch it (outside
    they are meta tensors), and a write through ``.data``, which no version counter sees, is kept: the key
    encoder's weights cycle through the drive between steps, so a lost write would show. The query encoder's
    parameters, read through ``.data`` and so marked changed after each hold, still get their updates (stepped
    in backward too, and computing in the device tier, where the copy held is not the one updated)."""
    torch.manual_seed(0)
    ref = _Momentum(how)
    model = copy.deepcopy(ref)
    start = ref.k[0].weight.detach().clone()
    store = make_store(host_budget_bytes="256KiB", device_budget_bytes="192KiB")
    opt = _train_beside_resident(ref, model, store, width=64, step_in_backward=in_backward, compute_tier=compute)
    assert not torch.equal(model.state_dict()["k.0.weight"], start), "the key encoder never moved"
    assert store.stats_dict()["bytes_read_nvme"] > 0
    opt.close()


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
