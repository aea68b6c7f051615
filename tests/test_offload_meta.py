"""A model built on the meta device: materialized into the store module by module."""

import pytest
import torch
from _models import HalfInit, LegacyTable, Parametrized, TiedLM, UnwrittenBuffer, init_table, old_weight_norm
from _training import _assert_same_parameters, _train_on_ids
from tierstore.integrations.offload import offload_model

import tierstore as ts


def test_a_model_built_on_meta_equals_eager_construction_and_trains_bit_identically(make_store):
    torch.manual_seed(0)
    ref = TiedLM()
    with torch.device("meta"):
        model = TiedLM()
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


def test_a_model_with_parametrized_weights_built_on_meta_equals_eager_construction(make_store):
    """A parametrized module's reset_parameters() writes a value computed from its original tensors, which is
    lost: on meta its originals would stay uninitialized memory. They are computed from the module's own
    initialization as registering the parametrization computes them, so they equal eager construction's."""
    torch.manual_seed(0)
    ref = Parametrized()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Parametrized()
    off = offload_model(model, make_store())
    state, ref_state = model.state_dict(), ref.state_dict()
    assert list(state) == list(ref_state) and "conv.parametrizations.weight.original1" in state
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    off.remove()


def test_a_real_parameter_in_a_model_built_on_meta_is_initialized_kept_or_an_error(make_store):
    """Whether a real parameter of a model built on meta holds values or uninitialized memory cannot be told:
    it is an error naming it until ``real_parameters`` says which; "initialize" has its module's init write it
    (and one that does not is refused with the parameter's values put back), "keep" keeps it."""
    with torch.device("meta"):
        model = LegacyTable()
    assert not model.table.is_meta and model.proj.weight.is_meta
    with torch.no_grad():
        model.table.fill_(3.0)  # stands for whatever the memory held
    store = make_store()
    with pytest.raises(ValueError, match=r"not: table\. A constructor that ignores torch.device\('meta'\)"):
        offload_model(model, store, init_fn=init_table)
    with pytest.raises(ValueError, match=r"init_fn\(<root>\) \(LegacyTable\) left table .*unwritten"):
        offload_model(model, store, init_fn=lambda m: None, real_parameters="initialize")
    assert store.keys() == [] and model.proj.weight.is_meta and torch.equal(model.table, torch.full((4, 8), 3.0))
    off = offload_model(model, store, init_fn=init_table, real_parameters="initialize")
    assert torch.equal(off.read_param("table"), torch.full((4, 8), 0.5))
    assert torch.isfinite(model(torch.ones(1, 8))).all()
    off.remove()
    with torch.device("meta"):
        kept = LegacyTable()
    with torch.no_grad():
        kept.table.fill_(2.0)
    off = offload_model(kept, make_store(), init_fn=init_table, real_parameters="keep")
    assert torch.equal(off.read_param("table"), torch.full((4, 8), 2.0))
    with pytest.raises(ValueError, match="real_parameters='all': choose one of 'initialize', 'keep'"):
        offload_model(torch.nn.Linear(2, 2), make_store(), real_parameters="all")


@pytest.mark.parametrize("build, left", [
    (lambda: HalfInit(8, 4), r"<root>.reset_parameters\(\) \(HalfInit\) left weight, bias"),
    (lambda: torch.nn.Sequential(UnwrittenBuffer()), r"0.reset_parameters\(\) .* left 0.steps"),
    (lambda: old_weight_norm(torch.nn.Linear(8, 4)), r"left weight_g, weight_v"),
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
