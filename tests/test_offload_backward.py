"""Backward: holds until gradients complete, saved views of parameters, backwards inside forwards."""

import copy

import pytest
import torch
import torch.nn.functional as F
from _models import CachesTranspose, GradientPenalty, KeepsTransposeLM, LatentsNet, TwoHeads, train_with_views
from _training import _assert_same_parameters, _tiny_pair, _train_on_ids
from tierstore.integrations.offload import OffloadedParameterError, offload_model
from tierstore.integrations.optim import OffloadedAdamW
from tierstore.tools.vit import num_params

import tierstore as ts


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


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_backward_inside_the_forward_trains_bit_identically(make_store, in_backward):
    torch.manual_seed(0)
    ref = GradientPenalty()
    model = copy.deepcopy(ref)
    store = make_store(host_budget_bytes="96KiB", device_budget_bytes="64KiB")
    off = offload_model(model, store, resident_threshold_bytes=0)
    _train_on_ids(ref, model, off, vocab=16, steps=4, step_in_backward=in_backward)
    _assert_same_parameters(model, ref)
    assert not any(sp.holds for sp in off.params.values())


@pytest.mark.parametrize("how", ["backward-inputs", "autograd-grad"])
@pytest.mark.parametrize("in_backward", [False, True])
def test_parameters_as_the_inputs_of_a_backward(make_store, how, in_backward):
    """``loss.backward(inputs=[...])`` (only the heads trained) and ``torch.autograd.grad(loss, params)`` (the
    gradients assigned to ``.grad`` by hand) take offloaded parameters as the leaves to differentiate for: that
    reads no value of them, and trains as the resident model does."""
    torch.manual_seed(0)
    ref = TwoHeads()
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


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_module_returning_a_view_of_its_parameter(make_store, in_backward):
    """The view stays valid while the model's forward uses it (its memory was reused by the next fetch, and the
    model trained on other values, silently); one returned from a module called on its own raises."""
    torch.manual_seed(0)
    ref = LatentsNet()
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


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_view_of_a_weight_kept_past_its_forward_keeps_its_values(make_store, in_backward):
    """``ctx.wt = weight.t()`` outlives the layer's hold: its memory was reused by the next fetch and backward
    computed with other values, silently (embed.weight differed after step 0 at this budget, both modes). The
    memory is now kept while the view lives, and training is bit-identical; where the budget cannot hold what
    is so kept, the budget error says why."""
    torch.manual_seed(0)
    ref = KeepsTransposeLM()
    model = copy.deepcopy(ref)
    off = train_with_views(ref, model, make_store(host_budget_bytes="160KiB", device_budget_bytes="32KiB"),
                            steps=3, in_backward=in_backward)
    off.remove()
    model = copy.deepcopy(ref)
    tight = make_store(host_budget_bytes="96KiB", device_budget_bytes="32KiB")
    off = offload_model(model, tight, resident_threshold_bytes=0, placement=False)
    with pytest.raises(ts.TierBudgetError, match=r"freed copies \(param/layers.0.weight, .*kept because tensors "
                                                 r"viewing them are still alive.*save_for_backward"):
        model(torch.zeros(4, 6, dtype=torch.long)).backward()


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_view_cached_across_steps_reads_the_updates(make_store, in_backward):
    """The cached view's memory is kept for it (see the test above) and is given the parameter's current value
    each time the parameter is fetched again, so the view reads what the resident one does."""
    torch.manual_seed(0)
    ref = KeepsTransposeLM()
    ref.layers = torch.nn.Sequential(*[CachesTranspose(64, 64) for _ in range(6)])
    model = copy.deepcopy(ref)
    train_with_views(ref, model, make_store(host_budget_bytes="224KiB", device_budget_bytes="32KiB"), steps=4,
                      in_backward=in_backward)


def test_autograd_grad_over_the_parameters_gives_the_resident_gradients(make_store):
    """``torch.autograd.grad(loss, parameters)`` accumulates no ``.grad``, so no parameter's gradient is seen
    complete before that backward ends: each stays held to its end. With room for that it gives the resident
    gradients (and the model trains on after it); without, the budget error says why."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    x = torch.randn(3, 64)
    expected = torch.autograd.grad(ref(x).pow(2).sum(), list(ref.parameters()))
    model = copy.deepcopy(ref)
    offload_model(model, make_store(host_budget_bytes="512KiB"))
    got = torch.autograd.grad(model(x).pow(2).sum(), list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    model(x).sum().backward()
    ref(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    tight = copy.deepcopy(ref)
    offload_model(tight, make_store(host_budget_bytes="64KiB"))  # under the 66 KiB of weights
    with pytest.raises(ts.TierBudgetError, match=r"torch.autograd.grad\(loss, parameters\) accumulates no .grad"):
        torch.autograd.grad(tight(x).pow(2).sum(), list(tight.parameters()))
