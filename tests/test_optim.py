"""OffloadedAdamW on its own terms: bit-identical to torch.optim.AdamW (parameter groups, schedulers,
clipping, accumulation, loss scaling, stepping in backward), its budgets, and what it leaves in the store."""

import collections
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from _training import (
    _assert_same_parameters,
    _tiny_pair,
    _train,
    named_state,
    train_offloaded,
    train_resident,
)
from tierstore.integrations import _adamw
from tierstore.integrations._contract import OPTIMIZER_PREFIX
from tierstore.integrations._pipeline import UnrestorableUpdateError
from tierstore.integrations.offload import offload_model
from tierstore.integrations.optim import OffloadedAdamW

from tierstore.tools.vit import PRESETS, SyntheticImages, ViT


def _fail_fc1_update_half_way(monkeypatch):
    """From now on the update of blocks.0.fc1.weight (the tiny ViT's only (256, 64) tensor) changes the weight and
    its first moment, then fails; returns the real update."""
    real = _adamw.adamw_update

    def failing(param, exp_avg, exp_avg_sq, grad, step, hyper, impl):
        if param.shape == (256, 64):
            param.add_(1.0)
            exp_avg.add_(1.0)
            raise RuntimeError("update failed")
        real(param, exp_avg, exp_avg_sq, grad, step, hyper, impl)

    monkeypatch.setattr(_adamw, "adamw_update", failing)
    return real


def test_failed_update_leaves_state_as_before_the_step(make_store, monkeypatch):
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    model = ViT(cfg)
    store = make_store(host_budget_bytes="384KiB", device_budget_bytes="320KiB")
    off = offload_model(model, store)
    opt = OffloadedAdamW(off, speculate=False)
    data = SyntheticImages(cfg)
    _train(model, data, 1, opt)
    before = {n: off.read_param(n) for n, _, _ in off.named_offloaded()}
    moments = named_state(opt.state_dict(beyond_host_budget=True))
    x, y = data.batch(1, 8)
    F.cross_entropy(model(x), y).backward()
    _fail_fc1_update_half_way(monkeypatch)
    with pytest.raises(RuntimeError, match="update failed"):
        opt.step()
    opt.wait()
    assert torch.equal(off.read_param("blocks.0.fc1.weight"), before["blocks.0.fc1.weight"])
    assert torch.equal(named_state(opt.state_dict(beyond_host_budget=True))["blocks.0.fc1.weight"]["exp_avg"],
                       moments["blocks.0.fc1.weight"]["exp_avg"])
    assert opt.steps["blocks.0.fc1.weight"] == 1.0
    assert not torch.equal(off.read_param("blocks.0.qkv.weight"), before["blocks.0.qkv.weight"])  # stepped


def test_a_failed_update_of_kept_state_is_an_error_every_later_step_and_forward_repeats(make_store, monkeypatch):
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    model = ViT(cfg)
    n = sum(p.numel() for p in model.parameters())
    store = make_store(host_budget_bytes=n * 8)  # the weights stay in the host tier under the placement
    off = offload_model(model, store)
    opt = OffloadedAdamW(off, speculate=False)
    data = SyntheticImages(cfg)
    _train(model, data, 3, opt)
    assert "param/blocks.0.fc1.weight" in off.placement.resident
    x, y = data.batch(3, 8)
    F.cross_entropy(model(x), y).backward()
    real = _fail_fc1_update_half_way(monkeypatch)
    with pytest.raises(RuntimeError, match=r"update of 'blocks.0.fc1.weight' failed half-way .*load a checkpoint"):
        opt.step()
    monkeypatch.setattr(_adamw, "adamw_update", real)
    with pytest.raises(RuntimeError, match="failed half-way"):
        opt.step()
    with pytest.raises(RuntimeError, match="failed half-way"):
        model(x)


def test_step_in_backward_refuses_gradient_accumulation(make_store):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    off = offload_model(model, make_store())
    opt = OffloadedAdamW(off, step_in_backward=True)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="gradient accumulation needs step_in_backward=False"):
        model(x).sum().backward()
    opt.close()


def test_gradient_backlog_bound_keeps_numbers(make_store):
    """With room for one queued gradient, backward waits for the optimizer instead of piling up
    gradients; the numbers do not change."""
    ref, model, data = _tiny_pair()
    ref_losses, _ = train_resident(ref, data, 3)
    store = make_store(host_budget_bytes="704KiB", device_budget_bytes="320KiB")
    off = offload_model(model, store, prefetch_depth=2)
    opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, step_in_backward=True, max_grad_backlog_bytes=1)
    stall = store.stats_dict()["stall_seconds"]
    try:
        assert _train(model, data, 3, opt) == ref_losses
    finally:
        opt.close()
    assert opt._in_backward.backlog.bytes == 0
    assert store.stats_dict()["stall_seconds"] > stall
    _assert_same_parameters(model, ref)
    with pytest.raises(ValueError, match="max_grad_backlog_bytes=0 must be at least 1 byte"):
        OffloadedAdamW(off, max_grad_backlog_bytes=0)
    with pytest.raises(ValueError, match="readahead_bytes='lots' is not a byte count"):
        OffloadedAdamW(off, readahead_bytes="lots")
    fresh = offload_model(ViT(PRESETS["tiny"]), make_store(), prefetch_depth=2)
    assert OffloadedAdamW(fresh, max_grad_backlog_bytes="64KiB").max_grad_backlog_bytes == 64 * 1024


@pytest.mark.parametrize("window", ["all", "64KiB"])
def test_read_ahead_issues_each_state_key_at_most_twice_a_step(make_store, monkeypatch, window):
    """The optimizer's read-ahead issues what enters its window, and the next update's keys once more: prefetch
    calls grow with the parameter count, not with its square (see [Note: A read-ahead window]), and every update's
    state is asked for before the update reads it; the numbers do not change."""
    ref, model, data = _tiny_pair()
    ref_losses, _ = train_resident(ref, data, 3)
    store = make_store(host_budget_bytes="64MiB" if window == "all" else "1MiB")
    off = offload_model(model, store, prefetch_depth=2)
    opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, **({} if window == "all" else {"readahead_bytes": window}))
    calls: list[str] = []
    late: list[str] = []
    real_prefetch, real_get = type(store).prefetch, type(store).get

    def prefetch(self, key, *args, **kw):
        calls.append(key)
        return real_prefetch(self, key, *args, **kw)

    def get(self, key, *args, **kw):
        if key.startswith(OPTIMIZER_PREFIX) and key not in calls:
            late.append(key)
        return real_get(self, key, *args, **kw)

    monkeypatch.setattr(type(store), "prefetch", prefetch)
    monkeypatch.setattr(type(store), "get", get)
    per_step = []

    def after_step(step):
        per_step.append(collections.Counter(k for k in calls if k.startswith(OPTIMIZER_PREFIX)))
        calls.clear()

    losses = _train(model, data, 3, opt, after_step)
    opt.wait()
    assert losses == ref_losses
    _assert_same_parameters(model, ref)
    n_state_keys = 2 * len(list(model.parameters()))
    for counts in per_step:
        assert len(counts) >= n_state_keys and max(counts.values()) <= 2, counts
    assert late == []


@pytest.mark.parametrize("master", ["fp32", "split"])
def test_letting_gradients_go_once_applied_trains_the_same_and_writes_none_home(make_store, master):
    """keep_grads=False (Trainer's loop: 2 micro-batches, clipping, the optimizer after backward): the same losses,
    clip norms and parameters as keep_grads=True, under a budget where the step's read-ahead needs the room the
    gradients hold; p.grad is None after step() and no gradient is left in the store. Fewer gradient bytes go to
    the drive during the steps (here 4-20x fewer: only those not yet applied when the room ran out), since none is
    written home only for zero_grad() to drop it."""
    _, base, data = _tiny_pair()
    base = base.to(torch.bfloat16) if master == "split" else base
    runs = {}
    for keep in (True, False):
        model = copy.deepcopy(base)
        store = make_store(host_budget_bytes="640KiB")
        opt = OffloadedAdamW(offload_model(model, store, prefetch_depth=2), lr=1e-3, keep_grads=keep,
                             **({"moments": "8bit", "master": "split"} if master == "split" else {}))
        seen, grad_writes = [], 0
        for step in range(3):
            for micro in range(2):
                x, y = data.batch(2 * step + micro, 4)
                (F.cross_entropy(model(x.to(next(base.parameters()).dtype)).float(), y) / 2).backward()
            seen.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
            tl = store.record_timeline()
            opt.step()
            opt.wait()
            store.record_timeline(False)
            grad_writes += sum(e["args"]["bytes"] for e in tl.events() if e.get("cat") == "transfer"
                               and e["name"] == "host->nvme" and e["args"]["key"].startswith("grad"))
            if not keep:
                assert all(p.grad is None for p in model.parameters())
                assert not [k for k in store.keys() if k.startswith("grad")]
            opt.zero_grad()
        seen.append(grad_writes)
        runs[keep] = (seen, {n: p.detach().float().clone() for n, p in model.state_dict().items()})
        opt.close()
    (kept_seen, kept_params), (let_seen, let_params) = runs[True], runs[False]
    assert kept_seen[:-1] == let_seen[:-1] and kept_params.keys() == let_params.keys()
    assert all(torch.equal(kept_params[n], let_params[n]) for n in kept_params)
    assert let_seen[-1] < kept_seen[-1]


def test_the_read_ahead_window_counts_the_gradients_it_reads(make_store):
    """Read ahead of an update brings its state and its gradient kept in the store: the window counts both, so
    what it issues fits the bytes it is given (counting the state alone, it held up to 1.7x of them with fp32
    gradients beside 8-bit state, and its reads evicted each other before their updates)."""
    from tierstore.integrations._grads import store_key_of
    from tierstore.integrations._pipeline import state_keys

    _, model, data = _tiny_pair()
    store = make_store(host_budget_bytes="1MiB")
    opt = OffloadedAdamW(offload_model(model, store, prefetch_depth=2), lr=1e-3)
    x, y = data.batch(0, 4)
    F.cross_entropy(model(x), y).backward()
    items = [(name, key, p, p.grad) for name, key, p in opt._items]
    kept = [item for item in items if store_key_of(item[3]) is not None]
    assert kept  # the gradients are in the store until the step
    for name, key, p, grad in kept:
        state = sum(store.info(k)["nbytes"] for k in state_keys(name, key, p, opt.layout))
        assert opt._pipeline._read_bytes((name, key, p, grad)) == state + store.info(store_key_of(grad))["nbytes"]
    opt.step()
    opt.close()


def test_an_update_leaves_the_read_ahead_window_with_the_bytes_it_entered_with(make_store):
    """A queue lets go of each gradient once its update has read it (the item becomes one without it): the window
    still takes away what it counted for the item, so it holds the updates ahead and nothing more (counted again
    on the way out, each stored gradient stayed in the window's bytes and it read fewer updates ahead each time)."""
    from tierstore.integrations._grads import store_key_of

    _, model, data = _tiny_pair()
    store = make_store(host_budget_bytes="1MiB")
    opt = OffloadedAdamW(offload_model(model, store, prefetch_depth=2), lr=1e-3, speculate=False)
    x, y = data.batch(0, 4)
    F.cross_entropy(model(x), y).backward()
    items = [(name, key, p, p.grad) for name, key, p in opt._items if store_key_of(p.grad) is not None]
    assert len(items) > 2
    pipe = opt._pipeline
    for i in range(len(items)):
        pipe.read_ahead(items, i)
        items[i] = (*items[i][:3], None)  # read: the queue lets its gradient go
    last = (*items[-1][:3], opt.offloaded.grads.get(items[-1][1]))
    assert pipe._window_bytes == pipe._read_bytes(last)  # the last update's state and gradient, as it entered
    pipe.drop_window()
    opt.step()
    opt.close()


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in-backward"])
def test_tensors_larger_than_an_update_slice_are_bit_identical(make_store, monkeypatch, in_backward):
    _SLICE = 1 << 18  # slices small enough for a quick test: [Note: Sliced updates]
    monkeypatch.setattr(_adamw, "SLICE", _SLICE)
    monkeypatch.setattr(_adamw, "WHOLE_MAX", _SLICE)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(640, 1300), torch.nn.Tanh(), torch.nn.Linear(1300, 3))
    assert 3 * _SLICE < ref[0].weight.numel() < 4 * _SLICE  # three whole slices and a partial one
    model = copy.deepcopy(ref)
    x, y = torch.randn(16, 640), torch.randn(16, 3)
    with torch.no_grad():  # the process's first product of these shapes came out different in its last bits in
        copy.deepcopy(ref)(x)  # about 1 run in 30 here (torch's CPU BLAS, before any store existed), so not counted
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    off = offload_model(model, make_store(  # an update holds its gradient too
        host_budget_bytes="16MiB", device_budget_bytes="8MiB"))
    opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, step_in_backward=in_backward)
    try:
        for m, o in ((ref, ropt), (model, opt)):
            for _ in range(3):
                F.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad()
    finally:
        opt.close()
    _assert_same_parameters(model, ref)
    ours = named_state(opt.state_dict(beyond_host_budget=True))
    for name, p in ref.named_parameters():
        assert torch.equal(ours[name]["exp_avg_sq"], ropt.state[p]["exp_avg_sq"]), name


@pytest.mark.parametrize("impl", _adamw.IMPLS)
def test_sliced_update_matches_whole_tensor_operations(impl):
    """The update over slices gives the bits of the whole tensor's update, bf16 gradients too, for each of torch's
    implementations (the fused kernel's scalar tail included: sizes that are no multiple of its vector width)."""
    _SLICE, _WHOLE_MAX = _adamw.SLICE, _adamw.WHOLE_MAX
    hyper = (3e-4, (0.9, 0.95), 1e-8, 0.1, False)  # lr, betas, eps, weight_decay, maximize
    g = torch.Generator().manual_seed(3)
    for n, grad_dtype in ((_WHOLE_MAX + 2 * _SLICE + 12345, torch.float32), (_WHOLE_MAX + 1, torch.bfloat16),
                          (1001, torch.float32)):
        base = [torch.randn(n, generator=g) for _ in range(3)]
        base[2].abs_()
        grad = torch.randn(n, generator=g).to(grad_dtype)
        sliced, whole = [t.clone() for t in base], [t.clone() for t in base]
        for step in (1.0, 2.0, 7.0):
            _adamw.adamw_update(*sliced, grad, step, hyper, impl)
            _adamw.adamw_slice(*whole, grad.float(), step, hyper, impl)
        for a, b in zip(sliced, whole):
            assert torch.equal(a, b)



@pytest.mark.parametrize("dtypes", [(torch.float32,) * 4, (torch.float32,) * 3 + (torch.bfloat16,),
                                    (torch.bfloat16,) * 4], ids=["fp32", "bf16-grad", "bf16"])
def test_the_single_tensor_update_in_thread_buffers_gives_torchs_bits(dtypes):
    """[Note: The update's temporaries]: the own sequence serves these dtypes on this torch (its check against
    torch's function passed), and gives torch's bits: sliced, whole, non-contiguous; maximize runs torch's code."""
    param_dtype, avg_dtype, sq_dtype, grad_dtype = dtypes
    hyper = (3e-4, (0.9, 0.95), 1e-8, 0.1, False)
    g = torch.Generator().manual_seed(5)
    p0, m0, v0 = (torch.randn(3 * _adamw.SLICE + 77, generator=g).to(dt) for dt in (param_dtype, avg_dtype, sq_dtype))
    assert _adamw._own_single_exact(p0, m0, v0.abs(), p0.to(grad_dtype), hyper)
    base = {"sliced": (p0, m0, v0.abs()),
            "transposed": tuple(t[:4097 * 3].view(4097, 3).t() for t in (p0, m0, v0.abs()))}
    for shape, tensors in base.items():
        for maximize in (False, True):
            h = hyper[:4] + (maximize,)
            ours, theirs = [t.clone() for t in tensors], [t.clone() for t in tensors]
            for step in (1.0, 2.0, 7.0):
                grad = torch.randn(tensors[0].shape, generator=g).to(grad_dtype)
                _adamw.adamw_update(*ours, grad, step, h, "single")
                _adamw.adamw_slice(*theirs, grad, step, h, "single")
            for a, b in zip(ours, theirs):
                assert torch.equal(a, b), (shape, maximize)
    buf = _adamw._buffer(param_dtype, 10)
    assert buf.data_ptr() == _adamw._buffer(param_dtype, 10).data_ptr()  # kept for the next update
    assert _adamw._buffers.by_dtype[param_dtype].numel() <= _adamw.SLICE  # and no larger than a slice


def test_an_own_update_sequence_that_differs_from_torchs_is_not_run(monkeypatch):
    """A torch whose single-tensor AdamW is not the own sequence (say a later release's) gets its own code run."""
    monkeypatch.setattr(_adamw, "_exact", {})
    monkeypatch.setattr(_adamw, "_matches_torch", lambda *dtypes: False)

    def refused(*args):
        raise AssertionError("the own sequence ran where its check failed")

    monkeypatch.setattr(_adamw, "_single_in_buffers", refused)
    g = torch.Generator().manual_seed(6)
    p, m, v, grad = (torch.randn(2 * _adamw.SLICE + 5, generator=g) for _ in range(4))
    ours, theirs = [t.clone() for t in (p, m, v.abs())], [t.clone() for t in (p, m, v.abs())]
    _adamw.adamw_update(*ours, grad, 1.0, (1e-3, (0.9, 0.999), 1e-8, 0.01, False), "single")
    _adamw.adamw_slice(*theirs, grad, 1.0, (1e-3, (0.9, 0.999), 1e-8, 0.01, False), "single")
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def _train_clipped(model, data, steps, opt, clip):
    """Two micro-batches of gradient accumulation per step, then clipping by the global norm."""
    losses, norms = [], []
    for step in range(steps):
        for micro in range(2):
            x, y = data.batch(2 * step + micro, 4)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            losses.append(loss.item())
        norms.append(clip(0.5))
        opt.step()
        opt.zero_grad()
    return losses, norms


@pytest.mark.parametrize("clip", ["off", "torch"])
def test_clipping_and_accumulation_match_resident_training(make_store, clip):
    ref, model, data = _tiny_pair(tie_head=True)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    ref_losses, ref_norms = _train_clipped(ref, data, 4, ropt,
                                           lambda m: torch.nn.utils.clip_grad_norm_(ref.parameters(), m))
    # Norms and LayerNorm weights stay resident (below 1 KiB): clipping spans both kinds of parameter.
    off = offload_model(model, make_store(host_budget_bytes="704KiB", device_budget_bytes="320KiB"),
                        resident_threshold_bytes=1024)
    assert off.resident and off.params
    opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01)
    # torch's own clip over model.parameters() sees the gradients the offloaded model keeps (param.grad)
    clipper = off.clip_grad_norm_ if clip == "off" else lambda m: torch.nn.utils.clip_grad_norm_(model.parameters(), m)
    losses, norms = _train_clipped(model, data, 4, opt, clipper)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(norms, ref_norms))
    assert max(n.item() for n in norms) > 0.5  # the clipping did scale gradients
    _assert_same_parameters(model, ref)


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in-backward"])
def test_parameter_groups_and_a_scheduler_match_torch(make_store, in_backward):
    ref, model, data = _tiny_pair()
    no_decay = [n for n, p in ref.named_parameters() if p.ndim < 2]  # biases and norms, as ViT recipes do
    ropt = torch.optim.AdamW([{"params": [p for n, p in ref.named_parameters() if n not in no_decay]},
                              {"params": [p for n, p in ref.named_parameters() if n in no_decay],
                               "weight_decay": 0.0, "betas": (0.9, 0.95)}],
                             lr=1e-3, weight_decay=0.05, foreach=False)
    off = offload_model(model, make_store(host_budget_bytes="704KiB", device_budget_bytes="320KiB"))
    opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.05, step_in_backward=in_backward,
                         param_groups=[{"params": no_decay, "weight_decay": 0.0, "betas": [0.9, 0.95]}])
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["weight_decay"] == 0.05  # the rest, defaults

    def warmup_then_decay(step):
        return min(1.0, (step + 1) / 2) * 0.7**step

    scheds = [torch.optim.lr_scheduler.LambdaLR(o, warmup_then_decay) for o in (ropt, opt)]
    losses: dict[str, list[float]] = {"ref": [], "ours": []}
    try:
        for step in range(4):
            for who, m, o, sched in (("ref", ref, ropt, scheds[0]), ("ours", model, opt, scheds[1])):
                x, y = data.batch(step, 8)
                loss = F.cross_entropy(m(x), y)
                loss.backward()
                o.step()
                o.zero_grad()
                sched.step()
                losses[who].append(loss.item())
    finally:
        opt.close()
    assert losses["ref"] == losses["ours"]
    assert [g["lr"] for g in opt.param_groups] == [ropt.param_groups[1]["lr"], ropt.param_groups[0]["lr"]] != [1e-3] * 2
    _assert_same_parameters(model, ref)
    saved = opt.state_dict(beyond_host_budget=True)["param_groups"]
    assert saved[0]["param_names"] == no_decay and saved[0]["initial_lr"] == 1e-3


@pytest.mark.parametrize("flags", [{}, {"foreach": True}, {"fused": True}], ids=["single", "foreach", "fused"])
@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in-backward"])
def test_maximize_and_torch_adamw_keywords_match_torch(make_store, in_backward, flags):
    """Code written for torch.optim.AdamW ports unchanged: ``maximize`` (for all, or one group) climbs the
    gradient as torch's does, and ``foreach``/``fused`` choose torch's implementation, bit for bit with torch
    given the same flag (the fused kernel's bits differ from the others'); what it cannot do is refused."""
    ref, model, data = _tiny_pair()
    heads = [n for n, _ in ref.named_parameters() if n.startswith("head")]
    ropt = torch.optim.AdamW([{"params": [p for n, p in ref.named_parameters() if n not in heads]},
                              {"params": [p for n, p in ref.named_parameters() if n in heads], "maximize": False}],
                             lr=1e-3, maximize=True, **({"foreach": False} | flags))
    off = offload_model(model, make_store(host_budget_bytes="704KiB", device_budget_bytes="320KiB"))
    for bad in ("amsgrad", "capturable", "differentiable"):
        with pytest.raises(ValueError, match=f"does not support {bad}=True"):
            OffloadedAdamW(off, **{bad: True})
    with pytest.raises(ValueError, match="maximize=1 must be True or False"):
        OffloadedAdamW(off, maximize=1)
    with pytest.raises(ValueError, match="fused=True and foreach=True cannot be given together"):
        OffloadedAdamW(off, foreach=True, fused=True)
    opt = OffloadedAdamW(off, lr=1e-3, maximize=True, amsgrad=False, step_in_backward=in_backward,
                         param_groups=[{"params": heads, "maximize": False}], **flags)
    assert repr(opt).endswith("maximize=True)" + "".join(f", {k}=True" for k in flags) + ")")  # the last group
    try:
        for step in range(3):
            for m, o in ((ref, ropt), (model, opt)):
                x, y = data.batch(step, 8)
                F.cross_entropy(m(x), y).backward()
                o.step()
                o.zero_grad()
            _assert_same_parameters(model, ref)
        assert [g["maximize"] for g in opt.state_dict(beyond_host_budget=True)["param_groups"]] == [False, True]
    finally:
        opt.close()


def test_torchs_fused_adamw_differs_from_its_default_so_each_is_matched_to_its_own():
    """Why the flags are honoured: torch's fused kernel gives other bits than its default implementation on the
    same input, so an update that ran one where the user's resident code ran the other would drift from it."""
    results = {}
    for impl in ("single", "fused"):
        g = torch.Generator().manual_seed(0)
        p = torch.randn(4099, generator=g)
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        for step in (1.0, 2.0, 3.0):
            _adamw.adamw_update(p, m, v, torch.randn(4099, generator=g), step, (1e-2, (0.9, 0.999), 1e-8, 0.1, False),
                                impl)
        results[impl] = p
    assert not torch.equal(results["single"], results["fused"])


def test_the_fused_update_pairs_elements_by_position_not_by_memory_order():
    """A channels_last weight, its gradient too, beside moments in the default layout (as the store keeps them):
    the fused update gives torch's fused AdamW's weight and moments (the kernel alone would permute the moments);
    a parameter whose memory has gaps is refused."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, 5, 5, generator=g).to(memory_format=torch.channels_last)
    grads = [torch.randn(4, 3, 5, 5, generator=g).to(memory_format=torch.channels_last) for _ in range(3)]
    ref = torch.nn.Parameter(w.clone(memory_format=torch.preserve_format))
    ropt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, fused=True)
    m, v = torch.zeros(w.shape), torch.zeros(w.shape)
    assert m.stride() != w.stride()
    for step, grad in enumerate(grads, 1):
        ref.grad = grad.clone(memory_format=torch.preserve_format)
        ropt.step()
        _adamw.adamw_update(w, m, v, grad, float(step), (1e-2, (0.9, 0.999), 1e-8, 0.1, False), "fused")
    assert torch.equal(w, ref.detach())
    assert torch.equal(m, ropt.state[ref]["exp_avg"]) and torch.equal(v, ropt.state[ref]["exp_avg_sq"])
    gapped = torch.randn(4, 12)[:, ::2]
    with pytest.raises(ValueError, match="memory has gaps or overlaps; use fused=False"):
        _adamw.adamw_update(gapped, torch.zeros(4, 6), torch.zeros(4, 6), torch.ones(4, 6), 1.0,
                            (1e-2, (0.9, 0.999), 1e-8, 0.0, False), "fused")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-with-master"])
def test_moments_take_their_parameters_layout_so_the_fused_update_copies_nothing(make_store, monkeypatch, dtype):
    """As torch's AdamW makes them (zeros_like): a channels_last weight's moments (and fp32 master) are
    channels_last in the store, offloaded or resident, and fused steps never need copies in another layout."""
    from tierstore.integrations._contract import optimizer_key

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 2)).to(dtype)
    model = model.to(memory_format=torch.channels_last)
    store = make_store(host_budget_bytes="256KiB")
    off = offload_model(model, store, resident_threshold_bytes=1000)  # the first conv's weight stays resident
    assert "0.weight" in off.resident and "2.weight" not in off.resident
    opt = OffloadedAdamW(off, lr=1e-2, fused=True)
    for name in ("0.weight", "2.weight"):
        layout = torch.empty((8, 8 if name == "2.weight" else 3, 3, 3)).to(memory_format=torch.channels_last).stride()
        for what in ("exp_avg", "exp_avg_sq") + (("master",) if dtype != torch.float32 and name != "0.weight" else ()):
            assert store.info(optimizer_key(name, what))["stride"] == layout, (name, what)

    def copies(*args):
        raise AssertionError("a fused update needed copies in the parameter's layout")

    monkeypatch.setattr(_adamw, "_fused_in_layout_of_param", copies)
    x = torch.randn(4, 3, 8, 8).to(dtype).to(memory_format=torch.channels_last)
    for _ in range(2):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert set(named_state(opt.state_dict(beyond_host_budget=True))) == {n for n, _ in model.named_parameters()}


def test_parameter_groups_refuse_bad_input(make_store):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    off = offload_model(model, make_store())
    with pytest.raises(ValueError, match="'2.weight' is not a parameter"):
        OffloadedAdamW(off, param_groups=[{"params": ["2.weight"]}])
    with pytest.raises(ValueError, match="'0.bias' is already in param_groups\\[0\\]"):
        OffloadedAdamW(off, param_groups=[{"params": ["0.bias"]}, {"params": [model[0].bias]}])
    with pytest.raises(ValueError, match="unknown keys \\['momentum'\\]"):
        OffloadedAdamW(off, param_groups=[{"params": ["0.bias"], "momentum": 0.9}])
    with pytest.raises(ValueError, match="param_groups\\[0\\]: weight_decay=-1"):
        OffloadedAdamW(off, param_groups=[{"params": ["0.bias"], "weight_decay": -1}])
    with pytest.raises(ValueError, match="not a parameter of the offloaded model"):
        OffloadedAdamW(off, param_groups=[{"params": [torch.nn.Parameter(torch.zeros(3))]}])
    opt = OffloadedAdamW(off, param_groups=[{"params": "1.weight", "lr": 0.5}])
    assert [len(g["params"]) for g in opt.param_groups] == [1, 3]
    with pytest.raises(RuntimeError, match="pass param_groups= when constructing it"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    with pytest.raises(ValueError, match="already has an OffloadedAdamW"):
        OffloadedAdamW(off)
    twin = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    other = OffloadedAdamW(offload_model(twin, make_store()))
    with pytest.raises(ValueError, match="do not hold the same parameters"):
        other.load_state_dict(opt.state_dict(beyond_host_budget=True))


@pytest.mark.parametrize("unscale", [True, False], ids=["unscale-and-clip", "no-clip"])
@pytest.mark.parametrize("fused", [False, True], ids=["single", "fused"])
@pytest.mark.parametrize("stream,speculate", [(False, False), (True, False), (False, "auto"), (True, True)],
                         ids=["after-backward", "streamed", "speculated-auto", "speculated-streamed"])
def test_loss_scaling_matches_torch_grad_scaler(make_store, fused, unscale, stream, speculate):
    """torch's fused AdamW takes the scale into its kernel when nothing unscaled the gradients before the step
    (the scaler hands it the scale instead): bit for bit the same, the scaler's scales being powers of two. With the
    updates streamed into the next forward, a step the scaler skips queues nothing. Speculated in backward, the
    updates are undone (the scaler unscales each gradient; a step it skips undoes them at zero_grad()), and with
    speculate="auto" none is made after the first step that undid some."""
    from tierstore.integrations.optim import OffloadedGradScaler

    ref, model, data = _tiny_pair(tie_head=True)
    off = offload_model(model, make_store(host_budget_bytes="704KiB", device_budget_bytes="320KiB"),
                        resident_threshold_bytes=1024)
    runs = {}
    # 2**30 overflows fp16 in the first backward: that step is skipped and the scale backed off to 2**10.
    scaler_kw = {"init_scale": 2.0**30, "backoff_factor": 2.0**-20, "growth_interval": 2}
    for who, m, opt, scaler, clip in (
            ("ref", ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False, fused=fused),
             torch.amp.GradScaler("cpu", **scaler_kw), lambda: torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)),
            ("ours", model, OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, fused=fused, stream_update=stream,
                                           speculate=speculate),
             OffloadedGradScaler("cpu", **scaler_kw), lambda: off.clip_grad_norm_(1.0))):
        losses, scales, norms = [], [], []
        for step in range(5):
            x, y = data.batch(step, 8)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(m(x), y)
            scaler.scale(loss).backward()
            if unscale:
                scaler.unscale_(opt)
                norms.append(clip())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
        runs[who] = (losses, scales, norms)
    assert runs["ours"][0] == runs["ref"][0] and runs["ours"][1] == runs["ref"][1]
    assert all(torch.equal(a, b) or (a.isnan() and b.isnan()) for a, b in zip(runs["ours"][2], runs["ref"][2]))
    assert runs["ref"][1][0] == 2.0**10 and runs["ref"][1][-1] > 2.0**10  # the first step overflowed; then grew
    if unscale:
        assert not torch.isfinite(runs["ref"][2][0]) and torch.isfinite(runs["ref"][2][-1])
    _assert_same_parameters(model, ref)
    stats = off.store.stats_dict()
    # (an update the worker made after the scaler unscaled its gradient is the step's, and stands)
    assert stats["speculated_kept"] + stats["speculated_undone"] == stats["updates_speculated"]
    assert stats["updates_speculated"] == 0 or speculate
    if speculate == "auto":  # one step's, then paused: the scaler writes every gradient
        assert stats["speculated_undone"] <= len(off.params)
    if stream or speculate:
        opt.close()


def test_clipping_and_loss_scaling_refuse_stepping_in_backward(make_store):
    from tierstore.integrations.optim import OffloadedGradScaler

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    off = offload_model(model, make_store())
    opt = OffloadedAdamW(off, step_in_backward=True)
    scaler = OffloadedGradScaler("cpu")
    scaler.scale(model(torch.randn(4, 8)).sum()).backward()
    with pytest.raises(RuntimeError, match="step_in_backward=False"):
        off.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="step_in_backward=False"):
        scaler.unscale_(opt)
    # torch's own clipping reads param.grad, which the updates are consuming: refused too, not a clip of nothing
    with pytest.raises(RuntimeError, match=r"0.weight.grad: .*being applied now.*step_in_backward=False"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="being applied now"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    opt.step()
    model.zero_grad()  # after step() the gradients are gone, as they are after any step and zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.close()


def test_a_host_budget_below_one_update_is_refused_before_any_state_exists(make_store):
    # 16 KiB weight: 4 x 16 KiB (weight, moments, gradient)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    store = make_store(host_budget_bytes="40KiB")
    off = offload_model(model, store)
    keys = store.keys()
    with pytest.raises(ValueError, match=r"host_budget_bytes=40960 .* AdamW update of .0.weight. needs .* 65536 bytes"
                                         r".*and its gradient"):
        OffloadedAdamW(off)
    assert store.keys() == keys  # nothing of the optimizer was left in the store


def test_stepping_in_backward_at_the_tightest_budget_never_fails_spuriously(make_store):
    """The optimizer's worker and backward share a host budget that just holds one update beside a unit: each
    waits for what the other will release, 20 runs in a row, always bit-identical to resident training."""
    ref, _, data = _tiny_pair()
    ref_losses, _ = train_resident(copy.deepcopy(ref), data, 3)
    for run in range(20):
        model = copy.deepcopy(ref)
        store = make_store(host_budget_bytes="272KiB", device_budget_bytes="256KiB")
        losses, off, opt = train_offloaded(model, data, 3, store, step_in_backward=True)
        assert losses == ref_losses, run
        store.close()
    with pytest.raises(ValueError, match="beside the largest unit backward may hold"):  # any less: refused at once
        OffloadedAdamW(offload_model(copy.deepcopy(ref), make_store(host_budget_bytes="256KiB")),
                       step_in_backward=True)


def test_remove_takes_the_optimizers_state_out_of_the_store(make_store):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    store = make_store()
    off = offload_model(model, store)
    opt = OffloadedAdamW(off, step_in_backward=True)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    off.remove()
    assert store.keys() == []  # a new offload of a model with the same names starts clean
    off = offload_model(model, store)
    OffloadedAdamW(off).close()


def test_the_optimizer_takes_what_implements_the_offloaded_parameters_contract(make_store):
    from tierstore.integrations import FSDPOffload, OffloadedModel, OffloadedParameters

    assert OffloadedParameters in OffloadedModel.__mro__ and OffloadedParameters in FSDPOffload.__mro__
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="pass what offload_model or offload_fsdp returned, not Linear"):
        OffloadedAdamW(model)
    off = offload_model(model, make_store(), resident_threshold_bytes=0)
    assert isinstance(off, OffloadedParameters) and not off.in_forward_or_backward()
    OffloadedAdamW(off).close()


class _LoRALinear(torch.nn.Module):
    """A frozen base layer and a trainable low-rank update beside it."""

    def __init__(self, base: torch.nn.Linear, r: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(r, base.in_features) * 0.01)
        self.b = torch.nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in-backward"])
def test_frozen_parameters_get_no_state_and_unfreezing_later_is_an_error(make_store, in_backward):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(_LoRALinear(torch.nn.Linear(32, 64)), torch.nn.GELU(),
                              _LoRALinear(torch.nn.Linear(64, 8)))
    model = copy.deepcopy(ref)
    store = make_store(host_budget_bytes="1MiB")
    off = offload_model(model, store, resident_threshold_bytes=0)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    opt = OffloadedAdamW(off, lr=1e-2, step_in_backward=in_backward)
    for step in range(3):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step))
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    _assert_same_parameters(model, ref)
    assert sorted({k.split("/")[1] for k in store.keys() if k.startswith("adam/")}) == ["0.a", "0.b", "2.a", "2.b"]
    model[0].base.weight.requires_grad_(True)  # unfrozen after the optimizer was made: it has no state for it
    with pytest.raises(RuntimeError, match=r"frozen \(requires_grad=False\) when this OffloadedAdamW was created.*"
                                           r"0.base.weight"):
        model(torch.randn(4, 32)).pow(2).mean().backward()
        opt.step()
    opt.close()


def _step_that_fails(model, opt, data, step, fail):
    """One training step whose opt.step() fails once (``fail()`` arms the fault); returns whether it stopped part-way
    (some parameters updated, some not), after checking what refuses until opt.step() is called again."""
    x, y = data.batch(step, 8)
    F.cross_entropy(model(x), y).backward()
    fail()
    with pytest.raises(Exception) as failed:  # noqa: PT011 - the fault's own error, whatever layer raised it
        opt.step()
    part_way = opt._unfinished is not None
    if part_way:
        assert "Call opt.step() again" in opt._unfinished and str(failed.value) in opt._unfinished
        with pytest.raises(RuntimeError, match=r"step\(\) stopped after updating \d+ parameters"):
            model(x)
        with pytest.raises(RuntimeError, match="stopped after updating"):
            opt.zero_grad()
    opt.step()  # finishes the step: only the parameters not yet updated are
    opt.zero_grad()
    return part_way


def test_a_step_stopped_by_an_io_error_finishes_when_called_again(make_store, nvme_dir, tmp_path):
    """An I/O error part-way through step() leaves some parameters updated: forward, zero_grad() and checkpoints
    refuse until step() is called again, which updates only the rest; training then matches resident training."""
    from tierstore.integrations.checkpoint import save_checkpoint
    from tierstore import TierIOError
    from tierstore.testing import FaultySyscalls

    ref, _, data = _tiny_pair()
    train_resident(ref, data, 4)
    part_ways = 0
    for k in range(1, 27, 2):  # where a fault lands varies with timing: enough of them land part-way
        _, model, _ = _tiny_pair()
        sysc = FaultySyscalls(None)
        store = make_store(host_budget_bytes="384KiB", device_budget_bytes="320KiB", syscalls=sysc)
        off = offload_model(model, store)
        opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, speculate=False)
        _train(model, data, 2, opt)
        x, y = data.batch(2, 8)
        F.cross_entropy(model(x), y).backward()
        opt.wait()  # the last step's writes behind are done: the fault lands in this step's reads and writes
        sysc.fail_at = sysc.calls + k  # a read of the step, or (the count is not exact) a write behind it
        try:
            opt.step()
        except TierIOError:
            if opt._unfinished is not None:
                part_ways += 1
                with pytest.raises(RuntimeError, match="mix two steps"):
                    save_checkpoint(str(tmp_path / "ckpt"), model, opt)
                assert not (tmp_path / "ckpt").exists()
                with pytest.raises(RuntimeError, match=r"step\(\) stopped after updating \d+ parameters"):
                    model(x)
            opt.step()
        with contextlib.suppress(TierIOError):  # a write behind the step failed: its data stayed in memory
            opt.wait()
        assert sysc.failed == 1
        opt.zero_grad()
        x, y = data.batch(3, 8)
        F.cross_entropy(model(x), y).backward()  # a failure is reported once: nothing raises from here on
        opt.step()
        opt.wait()
        _assert_same_parameters(model, ref)
        off.remove()
        store.close()
        if part_ways >= 3 and k >= 11:  # faults before the first update tried too
            break
    assert part_ways >= 3  # faults landed part-way through the step, not only before the first update


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_step_stopped_by_a_failed_update_finishes_when_called_again(make_store, monkeypatch, in_backward):
    ref, model, data = _tiny_pair()
    train_resident(ref, data, 3)
    store = make_store(host_budget_bytes="384KiB", device_budget_bytes="320KiB")
    off = offload_model(model, store)
    opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, step_in_backward=in_backward, speculate=False)
    _train(model, data, 1, opt)
    real = _adamw.adamw_update

    def fail_once():
        def failing(param, exp_avg, exp_avg_sq, grad, step, hyper, impl):
            if param.shape == (256, 64):  # blocks.0.fc1.weight, neither first nor last to be updated
                monkeypatch.setattr(_adamw, "adamw_update", real)
                raise RuntimeError("update failed")
            real(param, exp_avg, exp_avg_sq, grad, step, hyper, impl)
        monkeypatch.setattr(_adamw, "adamw_update", failing)

    if in_backward:  # the updates run as backward produces gradients: arm the fault before it
        x, y = data.batch(1, 8)
        fail_once()
        F.cross_entropy(model(x), y).backward()
        with pytest.raises(RuntimeError, match="update failed"):
            opt.step()
        assert opt._unfinished is not None
        with pytest.raises(RuntimeError, match="stopped after updating"):
            model(x)
        opt.step()
        opt.zero_grad()
    else:
        assert _step_that_fails(model, opt, data, 1, fail_once)
    x, y = data.batch(2, 8)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.wait()
    opt.close()
    _assert_same_parameters(model, ref)


def test_a_step_stopped_by_ctrl_c_names_it_and_finishes_when_called_again(make_store, monkeypatch):
    """A KeyboardInterrupt has no message: the part-way error names its type (it read "()" before)."""
    ref, model, data = _tiny_pair()
    train_resident(ref, data, 2)
    opt = OffloadedAdamW(offload_model(model, make_store(host_budget_bytes="384KiB")), lr=1e-3, weight_decay=0.01,
                         speculate=False)
    _train(model, data, 1, opt)
    real = _adamw.adamw_update

    def interrupted(param, exp_avg, exp_avg_sq, grad, step, hyper, impl):
        if param.shape == (256, 64):
            monkeypatch.setattr(_adamw, "adamw_update", real)
            raise KeyboardInterrupt
        real(param, exp_avg, exp_avg_sq, grad, step, hyper, impl)

    x, y = data.batch(1, 8)
    F.cross_entropy(model(x), y).backward()
    monkeypatch.setattr(_adamw, "adamw_update", interrupted)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    with pytest.raises(RuntimeError, match=r"not yet \(KeyboardInterrupt\)\. Call opt.step\(\) again"):
        model(x)
    opt.step()
    opt.wait()
    opt.close()
    _assert_same_parameters(model, ref)


def test_step_twice_with_the_same_gradients_is_refused(make_store):
    _, model, data = _tiny_pair()
    off = offload_model(model, make_store())
    opt = OffloadedAdamW(off)
    x, y = data.batch(0, 8)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    with pytest.raises(RuntimeError, match=r"step\(\) again with the gradients the last step\(\) applied"):
        opt.step()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()  # a new backward's gradients: fine


def test_a_backward_that_raises_after_stepping_in_backward_began_is_refused_for_good(make_store):
    """Stepping in backward updates parameters while backward runs: when it raises, some are a step ahead and
    the rest never get their gradient, which no second step can repair; the retry's backward says so."""
    _, model, data = _tiny_pair()
    store = make_store()
    off = offload_model(model, store)
    opt = OffloadedAdamW(off, step_in_backward=True)
    _train(model, data, 1, opt)
    x, y = data.batch(1, 8)
    calls = []

    def raise_in_backward(module, grad_in, grad_out):
        calls.append(module)
        if len(calls) == 1:
            raise RuntimeError("backward failed")
    handle = model.blocks[0].register_full_backward_hook(raise_in_backward)
    with pytest.raises(RuntimeError, match="backward failed"):
        F.cross_entropy(model(x), y).backward()
    handle.remove()
    with pytest.raises(UnrestorableUpdateError, match="load a checkpoint"):
        F.cross_entropy(model(x), y).backward()
    with pytest.raises(UnrestorableUpdateError, match="load a checkpoint"):
        opt.step()
    opt.close()


def _mlp(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 10)).to(dtype)


def _train_both(ref, model, opt, steps=3):
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    dtype = next(ref.parameters()).dtype
    for step in range(steps):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step)).to(dtype)
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x).float().square().mean().backward()
            o.step()
            o.zero_grad()
        _assert_same_parameters(model, ref)
    opt.close()


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in-backward"])
def test_fp64_parameters_are_stepped_in_fp64(make_store, in_backward):
    """An fp64 parameter's moments are fp64, as torch.optim.AdamW keeps them (an fp32 master would round it)."""
    ref = _mlp(torch.float64)
    model = copy.deepcopy(ref)
    store = make_store(host_budget_bytes="640KiB", device_budget_bytes="64KiB")
    off = offload_model(model, store)
    opt = OffloadedAdamW(off, lr=1e-2, step_in_backward=in_backward)
    assert named_state(opt.state_dict(beyond_host_budget=True)) == {} and "adam/0.weight/master" not in store
    _train_both(ref, model, opt)
    assert named_state(opt.state_dict(beyond_host_budget=True))["0.weight"]["exp_avg"].dtype == torch.float64
    assert store.stats_dict()["bytes_read_nvme"] > 0


def test_resident_bf16_parameters_are_stepped_as_torch_steps_them(make_store):
    ref = _mlp(torch.bfloat16)
    model = copy.deepcopy(ref)
    off = offload_model(model, make_store(), resident_threshold_bytes=2**20)  # all resident: torch's AdamW
    assert len(off.resident) == 6 and not off.params
    _train_both(ref, model, OffloadedAdamW(off, lr=1e-2))


def test_parameters_of_a_dtype_adamw_cannot_step_are_refused(make_store):
    model = torch.nn.Linear(8, 8)
    model.phase = torch.nn.Parameter(torch.randn(8, dtype=torch.complex64))
    off = offload_model(model, make_store())
    with pytest.raises(TypeError, match=r"not phase \(torch.complex64\): freeze them"):
        OffloadedAdamW(off)


class _Branches(torch.nn.Module):
    """A trunk, two branches taken on alternate steps (as experts are chosen), a head: each branch gets no
    gradient every other step."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.even, self.odd, self.head = (torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.trunk(x)
        return self.head((self.even if step % 2 == 0 else self.odd)(h))


@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_gradients_zeroed_in_place_step_a_parameter_that_got_none(make_store, zero):
    """zero_grad(set_to_none=False) keeps zero gradients: torch then steps the branch not taken with zeros (its
    moments decay and move it); the offloaded model must too, whether the optimizer or the model zeroes them."""
    torch.manual_seed(0)
    ref = _Branches()
    model = copy.deepcopy(ref)
    off = offload_model(model, make_store(host_budget_bytes="64KiB", device_budget_bytes="32KiB"))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt = OffloadedAdamW(off, lr=1e-2)
    for step in range(4):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        for m, o in ((ref, ropt), (model, opt)):
            m(x, step).pow(2).mean().backward()
            o.step()
            (o if zero == "optimizer" else m).zero_grad(set_to_none=False)
        if step:  # the odd branch has had a gradient: it is kept, zeroed, as torch keeps it
            assert model.odd.weight.grad is not None and not model.odd.weight.grad.any()
        _assert_same_parameters(model, ref)
    assert off.store.stats_dict()["bytes_read_nvme"] > 0
    opt.close()


def test_zeroing_gradients_in_place_is_refused_when_stepping_in_backward(make_store):
    off = offload_model(_Branches(), make_store(host_budget_bytes="64KiB", device_budget_bytes="32KiB"))
    opt = OffloadedAdamW(off, step_in_backward=True)
    with pytest.raises(ValueError, match=r"set_to_none=False.*step_in_backward=True.*call zero_grad\(\)"):
        opt.zero_grad(set_to_none=False)
    opt.zero_grad()
    opt.close()


def test_parameters_added_after_offload_are_refused_by_the_optimizer(make_store):
    model = _Branches()
    off = offload_model(model, make_store())
    model.adapter = torch.nn.Linear(16, 2)  # never taken by offload_model: it would never be stepped
    model.head = torch.nn.Linear(16, 16)  # replaced
    with pytest.raises(ValueError, match=r"head.weight, head.bias, adapter.weight, adapter.bias: trainable "
                                         r"parameters of the model that offload_model did not take"):
        OffloadedAdamW(off)
    model.adapter.requires_grad_(False)
    model.head.requires_grad_(False)
    OffloadedAdamW(off).close()


def test_a_sparse_embedding_is_refused_when_the_optimizer_is_made(make_store):
    off = offload_model(torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 2)),
                        make_store())
    with pytest.raises(ValueError, match=r"^0: sparse=True gives sparse gradients.*sparse=False"):
        OffloadedAdamW(off)


def test_step_takes_a_closure_as_torch_optimizers_do(make_store):
    """step(closure) runs the closure with gradients on and returns its loss (transformers' Trainer, through
    accelerate, and torch's LBFGS-style loops call it so)."""
    ref = _mlp(torch.float32)
    model = copy.deepcopy(ref)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt = OffloadedAdamW(offload_model(model, make_store()), lr=1e-2)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    losses = []
    for m, o in ((ref, ropt), (model, opt)):
        def closure(m=m):
            loss = m(x).pow(2).mean()
            loss.backward()
            return loss
        with torch.no_grad():  # the closure computes with gradients all the same
            losses.append(o.step(closure))
        o.zero_grad()
    assert losses[1].item() == losses[0].item()
    assert opt.step() is None
    _assert_same_parameters(model, ref)
    opt.close()


def test_a_gradient_of_another_dtype_or_shape_is_refused_as_torch_refuses_it(make_store):
    model = _mlp(torch.float32)
    offload_model(model, make_store())
    for bad in (torch.zeros(128, 64, dtype=torch.float16), torch.zeros(64, 128)):
        with pytest.raises(ValueError, match=r"a gradient of shape .* for '0.weight' of shape \(128, 64\) and dtype "
                                             r"torch.float32"):
            model[0].weight.grad = bad
    model[0].weight.grad = torch.ones(128, 64)
    assert model[0].weight.grad.sum().item() == 128 * 64
