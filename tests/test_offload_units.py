"""Units: what a module's forward fetches, the reads it learns, and modules with fused paths."""

import copy

import pytest
import torch
import torch.nn.functional as F
from _models import TiedProjection
from _training import _assert_same_parameters, _train_on_ids
from tierstore.integrations.offload import OffloadedParameterError, offload_model
from tierstore.tools.vit import PRESETS, Block, SyntheticImages, ViT


def test_units_know_their_bytes_and_count_their_stalls(make_store):
    torch.manual_seed(0)
    model = ViT(PRESETS["tiny"])
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    store = make_store()
    off = offload_model(model, store, prefetch_depth=2)
    assert sum(off.prefetch_policy.unit_bytes.values()) == total  # what prefetch_bytes is counted against
    assert off.local_state_bytes() == {store.info(k)["home"]: total for k in store.keys()[:1]}
    x, _ = SyntheticImages(PRESETS["tiny"]).batch(0, 2)
    model(x)
    stalls = off.stats.stall_seconds_by_unit
    assert set(stalls) == set(off.units()) and all(t >= 0 for t in stalls.values())
    with pytest.warns(DeprecationWarning, match="stall_seconds_by_unit"):
        assert off.stats.stall_seconds_by_group is stalls  # the old name, for one release


@pytest.mark.parametrize("in_backward", [False, True])
def test_parent_reading_a_childs_weight_trains_bit_identically(make_store, in_backward):
    torch.manual_seed(0)
    ref = TiedProjection()
    model = copy.deepcopy(ref)
    store = make_store(host_budget_bytes="96KiB")
    off = offload_model(model, store)
    _train_on_ids(ref, model, off, vocab=32, steps=4, step_in_backward=in_backward)
    _assert_same_parameters(model, ref)
    # Learned: the root unit now fetches the weights its forward reads, ahead of use.
    assert set(off.units()[""]) == {"embed.weight", "head.weight"}
    with pytest.raises(OffloadedParameterError, match=r"'head.weight' \(of head\).*read_param"):
        model.head.weight.pow(2).mean()  # outside the forward: no value to compute with


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
