"""OffloadedAdamW(speculate=True): each update made in backward, kept at step() where it is the step's and undone
and made again where it is not, with torch's numbers either way (see [Note: Speculated updates])."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from tierstore import TierValueError
from tierstore.integrations import OffloadedAdamW, _grad_code, load_checkpoint, offload_model, save_checkpoint

from _training import _assert_same_parameters, _tiny_pair, clipped_loop, resident_clipped


def _speculating(model, store, **kw):
    off = offload_model(model, store, resident_threshold_bytes=1024)
    assert off.resident and off.params  # clipping spans both kinds of parameter
    kw.setdefault("speculate", True)
    kw.setdefault("code_grads", kw.get("keep_grads") is False)  # the tests with keep_grads=False code them
    opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, **kw)
    return off, opt


def _speculated(opt):
    """Wait until the worker has made every update of this backward (so the clip comes after each, the order
    where a clip that clips undoes them): the path a test means to force."""
    round_ = opt._speculated._round
    for spec in round_.items if round_ is not None else ():
        spec.future.exception()
        if spec.coding is not None:  # and the coder has kept its gradient coded
            spec.coding.exception()


def _counts(store):
    s = store.stats_dict()
    return s["updates_speculated"], s["speculated_kept"], s["speculated_undone"]


def _same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _coded_where_it_can(store, keep_grads):
    """With keep_grads=False and code_grads=True (and the kernel built) the kept gradients were coded against their
    moments."""
    coded = store.stats_dict()["gradients_coded"]
    assert coded > 0 if not keep_grads and _grad_code.available() else coded == 0


@pytest.mark.parametrize("keep_grads", [True, False])
@pytest.mark.parametrize("clip", [None, 1e9, 1e-3], ids=["no-clip", "never-clipped", "always-clipped"])
def test_a_clipped_loop_matches_torch_and_keeps_only_the_updates_that_are_the_steps(make_store, clip, keep_grads):
    ref, model, data = _tiny_pair(tie_head=True)
    ref_losses, ref_norms = resident_clipped(ref, data, steps=3, clip=clip, micro=1, schedule=True)
    store = make_store(host_budget_bytes="704KiB", device_budget_bytes="320KiB")
    off, opt = _speculating(model, store, keep_grads=keep_grads)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    losses, norms = clipped_loop(model, data, opt, steps=3, clip=clip, micro=1, sched=sched,
                                 before_clip=lambda step: _speculated(opt))
    assert losses == ref_losses
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(norms, ref_norms))
    _assert_same_parameters(model, ref)
    speculated, kept, undone = _counts(store)
    assert 0 < speculated <= 3 * len(off.params)  # the placement may keep some state in the host tier: not these
    assert (kept, undone) == ((0, speculated) if clip == 1e-3 else (speculated, 0))
    _coded_where_it_can(store, keep_grads)
    opt.close()


@pytest.mark.parametrize("keep_grads", [True, False])
def test_a_non_finite_gradient_undoes_the_updates(make_store, keep_grads):
    """A batch that makes every gradient NaN: the clip's coefficient is NaN, so no speculated update stands, and
    the step is torch's (NaN parameters, bit for bit)."""
    ref, model, data = _tiny_pair()

    def batch(i):
        x, y = data.batch(i, 4)
        return (x * float("inf") if i == 1 else x), y

    resident_clipped(ref, data, steps=2, clip=1e9, micro=1, batch=batch)
    store = make_store()
    off, opt = _speculating(model, store, keep_grads=keep_grads)
    clipped_loop(model, data, opt, steps=2, clip=1e9, micro=1, batch=batch, before_clip=lambda step: _speculated(opt))
    got = model.state_dict()
    assert all(_same_bits(got[k], v) for k, v in ref.state_dict().items())
    assert any(v.isnan().any() for v in got.values())
    speculated, kept, undone = _counts(store)
    assert undone == len(off.params) and kept == speculated - undone
    _coded_where_it_can(store, keep_grads)
    opt.close()


@pytest.mark.parametrize("keep_grads", [True, False])
def test_a_learning_rate_changed_before_step_undoes_the_updates(make_store, keep_grads):
    """A scheduler stepped between backward and step() (a warmup that sets the lr first): each update speculated
    with the old lr is undone and made with the new one."""
    ref, model, data = _tiny_pair()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    store = make_store()
    off, opt = _speculating(model, store, keep_grads=keep_grads)

    def halve(o):
        return lambda step: [g.__setitem__("lr", g["lr"] / 2) for g in o.param_groups]

    ref_losses, _ = clipped_loop(ref, data, ropt, steps=2, clip=1e9, micro=1, before_clip=halve(ropt))
    losses, _ = clipped_loop(model, data, opt, steps=2, clip=1e9, micro=1,
                             before_clip=lambda step: (_speculated(opt), halve(opt)(step)))
    assert losses == ref_losses
    _assert_same_parameters(model, ref)
    assert _counts(store)[2] == 2 * len(off.params)
    _coded_where_it_can(store, keep_grads)
    opt.close()


@pytest.mark.parametrize("keep_grads", [True, False])
def test_a_loop_that_accumulates_undoes_at_the_next_forward(make_store, keep_grads):
    """Two micro-batches a step: the second forward reads parameters the first backward's updates changed, so they
    are undone before it reads them; the step is torch's. With keep_grads=False the first backward's gradients
    may be stored coded: the second adds to them decoded."""
    ref, model, data = _tiny_pair()
    ref_losses, _ = resident_clipped(ref, data, steps=2, clip=1e9, micro=2)
    store = make_store()
    off, opt = _speculating(model, store, keep_grads=keep_grads)
    losses, _ = clipped_loop(model, data, opt, steps=2, clip=1e9, micro=2)
    assert losses == ref_losses
    _assert_same_parameters(model, ref)
    speculated, kept, undone = _counts(store)
    assert kept == 0 and undone == speculated  # (those the worker had not begun when undone are not run)
    opt.close()


def test_reads_between_backward_and_step_see_the_values_of_before_it(make_store, tmp_path):
    """A parameter read, state dicts and a checkpoint after backward, before step(): each gives the values of
    before the step (the speculated updates are undone), and the run goes on as torch's; a checkpoint saved right
    after a speculated step resumes with torch's values."""
    ref, model, data = _tiny_pair()
    before = {}
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)

    def keep_ref(step):
        before[step] = {k: v.clone() for k, v in ref.state_dict().items()}

    clipped_loop(ref, data, ropt, steps=3, clip=1e9, micro=1, before_clip=keep_ref)
    store = make_store()
    off, opt = _speculating(model, store)
    name = next(n for n, _, _ in off.named_offloaded())
    p = dict(model.named_parameters())[name]
    seen = {}

    def read(step):
        _speculated(opt)
        if step == 1:
            seen["param"] = off.read_param(name)
            seen["model"] = {k: v.clone() for k, v in model.state_dict().items()}
            seen["exp_avg"] = opt.state[p]["exp_avg"].clone()
            save_checkpoint(str(tmp_path / "between"), model, opt)

    def save_after(step):
        if step == 2:
            save_checkpoint(str(tmp_path / "after"), model, opt)

    clipped_loop(model, data, opt, steps=3, clip=1e9, micro=1, before_clip=read, after_step=save_after)
    assert torch.equal(seen["param"], before[1][name])
    assert all(torch.equal(seen["model"][k], v) for k, v in before[1].items())
    _assert_same_parameters(model, ref)
    opt.close()
    for ck, expected in (("between", before[1]), ("after", ref.state_dict())):
        _, model2, _ = _tiny_pair()
        _, opt2 = _speculating(model2, make_store())
        load_checkpoint(str(tmp_path / ck), model2, opt2)
        assert all(torch.equal(model2.state_dict()[k], v) for k, v in expected.items()), ck
        opt2.close()


@pytest.mark.parametrize("keep_grads", [True, False])
def test_a_skipped_step_leaves_the_values_as_they_were(make_store, keep_grads):
    """backward, then zero_grad() with no step() (a step skipped, as GradScaler skips one on an overflow): nothing
    of the speculated updates stands."""
    ref, model, data = _tiny_pair()
    store = make_store()
    off, opt = _speculating(model, store, keep_grads=keep_grads)
    x, y = data.batch(0, 4)
    F.cross_entropy(model(x), y).backward()
    _speculated(opt)
    assert _counts(store)[0] == len(off.params)
    _coded_where_it_can(store, keep_grads)
    opt.zero_grad()
    _assert_same_parameters(model, ref)
    assert opt.steps == {}
    clipped_loop(model, data, opt, steps=1, clip=1e9, micro=1)  # and the next step is a first step
    resident_clipped(ref, data, steps=1, clip=1e9, micro=1)
    _assert_same_parameters(model, ref)
    opt.close()


@pytest.mark.parametrize("clip", [1e9, 1e-3], ids=["never-clipped", "always-clipped"])
def test_compressed_state_gives_the_results_of_no_speculation(make_store, clip):
    """bf16 weights, 8-bit moments and split masters: the same kernels on the same inputs, so the same bits as
    the step without speculation, whether the updates stand or are made again (streamed, here)."""
    results = {}
    for speculate in (False, True):
        _, model, data = _tiny_pair()
        model.to(torch.bfloat16)
        store = make_store()
        off = offload_model(model, store, resident_threshold_bytes=1024)
        opt = OffloadedAdamW(off, lr=1e-3, moments="8bit", master="split", speculate=speculate,
                             stream_update=speculate)
        losses, _ = clipped_loop(model, data, opt, steps=3, clip=clip, micro=1,
                                 before_clip=(lambda step: _speculated(opt)) if speculate else None,
                                 batch=lambda i: (data.batch(i, 4)[0].bfloat16(), data.batch(i, 4)[1]))
        results[speculate] = losses, {k: v.clone() for k, v in model.state_dict().items()}
        if speculate:
            assert _counts(store)[0] > 0
        opt.close()
    assert results[True][0] == results[False][0]
    assert all(_same_bits(results[True][1][k], v) for k, v in results[False][1].items())


@pytest.mark.parametrize("share", [0.5, 0.0])
def test_a_drive_without_room_for_every_kept_version_speculates_those_that_fit(make_store, share):
    """Room on the drive for ``share`` of what the updates replace: the updates backward completes first are
    speculated while it lasts, the others are made at step(), with one warning, and the run is torch's."""
    ref, model, data = _tiny_pair()
    ref_losses, _ = resident_clipped(ref, data, steps=2, clip=1e9, micro=1)
    peaks = {}
    for speculate in (False, True):
        probe_store = make_store()
        _, probe_model, _ = _tiny_pair()
        _, probe = _speculating(probe_model, probe_store, speculate=speculate)
        clipped_loop(probe_model, data, probe, steps=1, clip=1e9, micro=1)
        probe.close()
        peaks[speculate] = probe_store.memory()["nvme"]["peak_bytes"]
    assert peaks[True] > peaks[False]
    # room for the state and the gradients, and for ``share`` of a second copy of every changed key
    store = make_store(nvme_budget_bytes=peaks[False] + int(share * (peaks[True] - peaks[False])))
    off, opt = _speculating(model, store)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, _ = clipped_loop(model, data, opt, steps=2, clip=1e9, micro=1)
    assert losses == ref_losses
    _assert_same_parameters(model, ref)
    assert sum("no room" in str(w.message) for w in caught) == 1
    speculated, kept, undone = _counts(store)
    assert speculated == kept and undone == 0
    assert (0 < speculated < 2 * len(off.params)) if share else speculated == 0
    opt.close()


def test_refused_where_it_cannot_run(make_store):
    from tierstore.integrations._optim_params import check_speculating

    _, model, _ = _tiny_pair()
    off = offload_model(model, make_store())
    with pytest.raises(TierValueError, match="choose one"):
        OffloadedAdamW(off, speculate=True, step_in_backward=True)
    with pytest.raises(TypeError, match="True, False or 'auto'"):
        OffloadedAdamW(off, speculate="yes")
    with pytest.raises(TierValueError, match="needs a model of offload_model or offload_fsdp"):
        check_speculating(object(), speculate=True, step_in_backward=False)
    with pytest.raises(TierValueError, match="pass keep_grads=False too"):
        OffloadedAdamW(off, code_grads=True)
    with pytest.raises(TierValueError, match="speculate=False makes none"):
        OffloadedAdamW(off, code_grads=True, keep_grads=False, speculate=False)
    with pytest.raises(TypeError, match="code_grads=1 must be True or False"):
        OffloadedAdamW(off, code_grads=1, keep_grads=False)


def test_a_parameter_whose_whole_state_is_kept_in_the_host_tier_is_not_speculated(make_store):
    """Keeping its version would write its state home each step, which the placement keeps in the host tier so as to
    write it only when it goes: it steps at step(); one with part of its state kept is speculated. torch's numbers."""
    ref, model, data = _tiny_pair()
    ref_losses, _ = resident_clipped(ref, data, steps=2, clip=1e9, micro=1)
    store = make_store()
    off, opt = _speculating(model, store, speculate="auto")
    whole, part = "blocks.0.fc1.weight", "blocks.0.fc2.weight"
    kept = [f"param/{whole}", f"adam/{whole}/exp_avg", f"adam/{whole}/exp_avg_sq", f"param/{part}"]
    assert set(kept) <= set(store.keys())
    owner = object()
    store.keep(owner, kept)  # as a placement keeps them
    losses, _ = clipped_loop(model, data, opt, steps=2, clip=1e9, micro=1, before_clip=lambda step: _speculated(opt))
    assert losses == ref_losses
    _assert_same_parameters(model, ref)
    n = len(off.params)
    assert _counts(store) == (2 * (n - 1), 2 * (n - 1), 0)
    store.keep(owner, [])
    opt.close()


@pytest.mark.parametrize("where", ["drive", "in-backward", "no-drive", "host-budget"])
def test_auto_is_the_default_and_runs_as_false_where_it_cannot_speculate(make_store, where):
    """OffloadedAdamW's default is speculate="auto": with a drive it speculates, and where speculating cannot run
    (stepping in backward, a store with no drive, a host budget that holds an update after backward but not beside
    it) it runs as False, with no error and no warning, where speculate=True is refused. torch's numbers."""
    ref, model, data = _tiny_pair()
    in_backward = where == "in-backward"
    ref_losses, _ = resident_clipped(ref, data, steps=2, clip=None if in_backward else 1e9, micro=1)
    kw = {"no-drive": {"nvme_path": None}, "host-budget": {"host_budget_bytes": "256KiB",
                                                           "device_budget_bytes": "64KiB"}}.get(where, {})
    store = make_store(**kw)
    off = offload_model(model, store, resident_threshold_bytes=1024, home="nvme" if store.swap_directory else "host")
    if where != "drive":
        with pytest.raises(TierValueError, match={"in-backward": "choose one", "no-drive": "no nvme_path",
                                                  "host-budget": "beside the largest unit"}[where]):
            OffloadedAdamW(off, speculate=True, step_in_backward=in_backward)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, step_in_backward=in_backward,
                             home="nvme" if store.swap_directory else "host")
        losses, _ = clipped_loop(model, data, opt, steps=2, clip=None if in_backward else 1e9, micro=1,
                                 before_clip=lambda step: _speculated(opt) if opt._speculated else None)
    assert opt.speculate == "auto" and losses == ref_losses
    _assert_same_parameters(model, ref)
    n = len(off.params)
    assert _counts(store) == ((2 * n, 2 * n, 0) if where == "drive" else (0, 0, 0))
    opt.close()


@pytest.mark.parametrize("clip", [1e9, 1e-3], ids=["never-clipped", "always-clipped"])
def test_auto_pauses_after_a_step_that_did_not_stand(make_store, clip):
    """speculate="auto": a loop that clips every step pays one undone step, then runs as without speculation; one
    that never clips speculates every step; one that accumulates stops after its first step. torch's numbers."""
    ref, model, data = _tiny_pair()
    ref_losses, _ = resident_clipped(ref, data, steps=4, clip=clip, micro=1)
    store = make_store()
    off, opt = _speculating(model, store, speculate="auto")
    losses, _ = clipped_loop(model, data, opt, steps=4, clip=clip, micro=1, before_clip=lambda step: _speculated(opt))
    assert losses == ref_losses
    _assert_same_parameters(model, ref)
    n = len(off.params)
    assert _counts(store) == ((4 * n, 4 * n, 0) if clip > 1 else (n, 0, n))
    # The same optimizer in a loop that stops clipping: it speculates again from the step after the first.
    if clip < 1:
        clipped_loop(model, data, opt, steps=2, clip=1e9, micro=1, first=4, before_clip=lambda step: _speculated(opt))
        assert _counts(store) == (2 * n, n, n)
    # A loop that accumulates: the second forward undoes the first backward's updates, then none more.
    before = _counts(store)
    clipped_loop(model, data, opt, steps=3, clip=1e9, micro=2, first=6)
    speculated, kept, undone = (a - b for a, b in zip(_counts(store), before))
    assert kept == 0 and speculated == undone <= n  # in the first step's first backward only
    opt.close()


@pytest.mark.parametrize("speculate", [True, "auto"])
def test_a_loop_that_says_which_micro_batch_is_last_speculates_in_its_backward(make_store, speculate):
    """opt.set_is_last_micro_batch(False) before the micro-batches but the last, (True) before it: each update is
    made in the last backward only, and stands; torch's numbers."""
    ref, model, data = _tiny_pair()
    ref_losses, _ = resident_clipped(ref, data, steps=3, clip=1e9, micro=3)
    store = make_store()
    off, opt = _speculating(model, store, speculate=speculate)
    losses = []
    for step in range(3):
        for m in range(3):
            opt.set_is_last_micro_batch(m == 2)
            x, y = data.batch(3 * step + m, 4)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        opt.zero_grad()
    assert losses == ref_losses
    _assert_same_parameters(model, ref)
    n = len(off.params)
    assert _counts(store) == (3 * n, 3 * n, 0)
    with pytest.raises(TypeError, match="True or False"):
        opt.set_is_last_micro_batch(1)
    opt.close()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt], ids=["raises", "ctrl-c"])
def test_a_backward_that_stops_part_way_leaves_the_values_of_before_it(make_store, error):
    """A backward that raises (or is interrupted) after the updates of the layers above were speculated: zero_grad()
    undoes them, and training goes on as torch's run that dropped that batch."""
    ref, model, data = _tiny_pair()
    store = make_store()
    off, opt = _speculating(model, store)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    clipped_loop(ref, data, ropt, steps=1, clip=1e9, micro=1)
    clipped_loop(model, data, opt, steps=1, clip=1e9, micro=1)

    def stop(*_):
        _speculated(opt)  # the blocks above have been updated
        raise error("stopped in backward")

    handle = model.blocks[0].register_full_backward_hook(stop)
    x, y = data.batch(7, 4)
    with pytest.raises(error):
        F.cross_entropy(model(x), y).backward()
    handle.remove()
    assert _counts(store)[0] > len(off.params)  # some of this backward's were made
    opt.zero_grad()
    _assert_same_parameters(model, ref)
    ref_losses, _ = clipped_loop(ref, data, ropt, steps=2, clip=1e9, micro=1, first=1)
    losses, _ = clipped_loop(model, data, opt, steps=2, clip=1e9, micro=1, first=1)
    assert losses == ref_losses
    _assert_same_parameters(model, ref)
    opt.close()


@pytest.mark.parametrize("keep_grads", [True, False], ids=["kept", "coded"])
@pytest.mark.parametrize("clip", [1e9, 0.05], ids=["never-clipped", "clipped"])
def test_stress_speculated_updates_beside_backward_under_a_tight_budget(make_store, clip, keep_grads):
    """Many thread switches, a host tier that makes the worker, the coder and backward evict each other's copies,
    updates kept and undone: the run stays torch's, step after step."""
    import sys

    ref, model, data = _tiny_pair(tie_head=True)
    ref_losses, _ = resident_clipped(ref, data, steps=6, clip=clip, micro=1)
    store = make_store(host_budget_bytes="704KiB", device_budget_bytes="320KiB")
    off, opt = _speculating(model, store, stream_update=True, keep_grads=keep_grads)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        losses, _ = clipped_loop(model, data, opt, steps=6, clip=clip, micro=1)
    finally:
        sys.setswitchinterval(interval)
    assert losses == ref_losses
    _assert_same_parameters(model, ref)
    speculated, kept, undone = _counts(store)
    assert speculated > 0 and kept + undone == speculated
    opt.close()


def _codec():
    if not _grad_code.available():
        pytest.skip("no C compiler: kept gradients are not coded")


def test_a_gradient_coded_against_its_moments_decodes_to_its_bits():
    """Any fp32 values (NaN with payloads, infinities, both zeros, subnormals) against moments near them, far from
    them or not finite: decoded, the same bits; where most elements would be kept whole, not coded at all."""
    _codec()
    g = torch.Generator().manual_seed(0)
    n = 3 * 4096 + 17
    grad = torch.randn(n, generator=g) * 1e-3
    grad[torch.rand(n, generator=g) < 0.4] = 0.0
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, -1e-40, 3e38, -3e38])
    grad[:8] = special
    grad.view(torch.int32)[8] = 0x7FC00123  # a NaN with a payload
    before = torch.randn(n, generator=g) * 1e-3
    before[20:30] = torch.tensor([float("nan"), float("inf"), 0.0, -0.0, 1e30, -1e30, 1e-45, 5.0, -5.0, 0.0])
    for beta1 in (0.9, 0.0, 0.5):
        after = before.lerp(grad, 1 - beta1)
        coded = _grad_code.Coder().code(grad, before, after, beta1)
        assert coded is not None and coded.dtype == torch.uint8 and n <= coded.numel() < 1.2 * n  # ~1 byte each
        out = torch.empty(n)
        _grad_code.decode(coded, before, after, beta1, out)
        assert _same_bits(out, grad), beta1
    # a moment a billion times the gradient predicts none of its bits: kept as it is
    big = torch.full((n,), 1e6)
    assert _grad_code.Coder().code(grad, big, big.lerp(grad, 0.1), 0.9) is None


def test_a_coded_gradient_read_before_step_gives_its_values(make_store):
    """keep_grads=False: each kept gradient is stored coded once its update is made in backward; reading p.grad
    then (its values, not its norm or a product by the clip coefficient) undoes the updates and decodes it, the
    gradient torch made, bit for bit, and the run is torch's."""
    _codec()
    ref, model, data = _tiny_pair()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    ref_grads = {}
    clipped_loop(ref, data, ropt, steps=2, clip=1e9, micro=1, before_clip=lambda step: ref_grads.setdefault(
        step, {n: p.grad.clone() for n, p in ref.named_parameters()}))
    store = make_store()
    off, opt = _speculating(model, store, keep_grads=False)
    names = [n for n, _, _ in off.named_offloaded()]
    params = dict(model.named_parameters())
    norms_kept = {}

    def read(step):
        _speculated(opt)
        if step == 1:
            coded = store.stats_dict()["gradients_coded"]
            norms_kept[step] = (coded, _counts(store)[2])
            for n in names:  # a norm is read at no cost, and keeps the updates
                assert torch.equal(params[n].grad.norm(), ref_grads[step][n].norm())
            assert _counts(store)[2] == norms_kept[step][1]
            for n in names:
                assert _same_bits(params[n].grad.clone(), ref_grads[step][n]), n

    losses, _ = clipped_loop(model, data, opt, steps=2, clip=1e9, micro=1, before_clip=read)
    _assert_same_parameters(model, ref)
    coded_then, undone_before = norms_kept[1]
    assert coded_then > 0 and _counts(store)[2] > undone_before  # the read undid the step's updates
    opt.close()


def test_kept_gradients_are_coded_only_when_asked(make_store):
    """code_grads is off by default (see OffloadedAdamW's docstring): with keep_grads=False alone the speculated
    updates keep their gradients as they are, and the step is torch's."""
    ref, model, data = _tiny_pair()
    ref_losses, _ = resident_clipped(ref, data, steps=2, clip=1e-3, micro=1)
    store = make_store()
    _, opt = _speculating(model, store, keep_grads=False, code_grads=False)
    assert OffloadedAdamW.__init__.__kwdefaults__["code_grads"] is False
    losses, _ = clipped_loop(model, data, opt, steps=2, clip=1e-3, micro=1, before_clip=lambda step: _speculated(opt))
    assert losses == ref_losses
    _assert_same_parameters(model, ref)
    assert store.stats_dict()["gradients_coded"] == 0 and _counts(store)[2] > 0
    opt.close()


def test_without_the_kernel_gradients_are_kept_as_they_are(make_store, monkeypatch):
    from tierstore.integrations import _native

    monkeypatch.setattr(_native, "_loaded", [None])
    ref, model, data = _tiny_pair()
    ref_losses, _ = resident_clipped(ref, data, steps=2, clip=1e-3, micro=1)
    store = make_store()
    _, opt = _speculating(model, store, keep_grads=False)
    losses, _ = clipped_loop(model, data, opt, steps=2, clip=1e-3, micro=1, before_clip=lambda step: _speculated(opt))
    assert losses == ref_losses
    _assert_same_parameters(model, ref)
    assert store.stats_dict()["gradients_coded"] == 0 and _counts(store)[2] > 0
    opt.close()
