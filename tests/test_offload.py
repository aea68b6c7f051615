"""Offloaded training gives the same numbers as resident training, bit for bit (fp32)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from tierstore.integrations.offload import OffloadedParameterError, offload_model
from tierstore.integrations.optim import OffloadedAdamW

import tierstore as ts
from tierstore.tools.vit import PRESETS, Block, SyntheticImages, ViT


def _train(model, data, steps, opt):
    losses = []
    for step in range(steps):
        x, y = data.batch(step, 8)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_resident(model, data, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    return _train(model, data, steps, opt), opt


def train_offloaded(model, data, steps, store, step_in_backward=False, **kw):
    off = offload_model(model, store, **kw)
    opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, step_in_backward=step_in_backward)
    try:
        return _train(model, data, steps, opt), off, opt
    finally:
        opt.close()


def _tiny_pair(**vit_kw):
    """A tiny ViT, a copy of it to offload, and its data."""
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    ref = ViT(cfg, **vit_kw)
    return ref, copy.deepcopy(ref), SyntheticImages(cfg)


def _assert_same_parameters(model, ref):
    for name, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


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


def test_remove_restores_module(make_store):
    torch.manual_seed(0)
    model = ViT(PRESETS["tiny"])
    ref = copy.deepcopy(model)
    store = make_store()
    off = offload_model(model, store)
    with pytest.raises(ValueError, match="already offloaded"):
        offload_model(model, store)
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):  # the memory is gone, the shape stays
        assert p.data_ptr() == 0 and p.shape == r.shape and p.dtype == r.dtype and p.device == r.device
        assert isinstance(p, torch.nn.Parameter) and p.is_leaf and p.requires_grad
        assert p.data.is_meta and p.detach().is_meta
        with pytest.raises(OffloadedParameterError, match=f"{name}.*read_param"):  # never a stand-in value
            p.sum()
        with pytest.raises(RuntimeError, match="meta"):  # .data bypasses the parameter: no value to read there
            p.data.sum().item()
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
    assert not model.blocks[0].qkv._backward_pre_hooks
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


def test_failed_update_leaves_state_as_before_the_step(make_store, monkeypatch):
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    model = ViT(cfg)
    store = make_store(host_budget_bytes="384KiB", device_budget_bytes="320KiB")
    off = offload_model(model, store)
    opt = OffloadedAdamW(off)
    data = SyntheticImages(cfg)
    _train(model, data, 1, opt)
    before = {n: off.read_param(n) for n, _, _ in off.named_offloaded()}
    moments = opt.state_dict()["state"]
    x, y = data.batch(1, 8)
    F.cross_entropy(model(x), y).backward()
    real = OffloadedAdamW._adamw

    def failing(self, param, exp_avg, exp_avg_sq, grad, step, hyper):
        if param.shape == (256, 64):  # blocks.0.fc1.weight: fail half-way through its update
            param.add_(1.0)
            exp_avg.add_(1.0)
            raise RuntimeError("update failed")
        real(param, exp_avg, exp_avg_sq, grad, step, hyper)

    monkeypatch.setattr(OffloadedAdamW, "_adamw", failing)
    with pytest.raises(RuntimeError, match="update failed"):
        opt.step()
    opt.wait()
    assert torch.equal(off.read_param("blocks.0.fc1.weight"), before["blocks.0.fc1.weight"])
    assert torch.equal(opt.state_dict()["state"]["blocks.0.fc1.weight"]["exp_avg"],
                       moments["blocks.0.fc1.weight"]["exp_avg"])
    assert opt.steps["blocks.0.fc1.weight"] == 1.0
    assert not torch.equal(off.read_param("blocks.0.qkv.weight"), before["blocks.0.qkv.weight"])  # stepped


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


def test_groups_know_their_bytes(make_store):
    torch.manual_seed(0)
    model = ViT(PRESETS["tiny"])
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    off = offload_model(model, make_store(), prefetch_depth=2)
    assert sum(off.policy.group_bytes.values()) == total  # what prefetch_bytes is counted against


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
    assert opt._backlog_bytes == 0
    assert store.stats_dict()["stall_seconds"] > stall
    _assert_same_parameters(model, ref)
    with pytest.raises(ValueError, match="max_grad_backlog_bytes=0 must be at least 1 byte"):
        OffloadedAdamW(off, max_grad_backlog_bytes=0)
    with pytest.raises(ValueError, match="readahead_bytes='lots' is not a byte count"):
        OffloadedAdamW(off, readahead_bytes="lots")
    fresh = offload_model(ViT(PRESETS["tiny"]), make_store(), prefetch_depth=2)
    assert OffloadedAdamW(fresh, max_grad_backlog_bytes="64KiB").max_grad_backlog_bytes == 64 * 1024


def test_prefetched_layers_are_not_read_twice(make_store):
    """A layer being fetched for use was ranked as unused (its place in the trace just passed), so a
    prefetch running at that moment could evict it and the layer was read again."""
    torch.manual_seed(0)
    width, layers, depth = 1024, 24, 4
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    layer = width * (width + 1) * 4
    store = make_store(host_budget_bytes=(depth + 2) * layer, device_budget_bytes=2 * layer)
    offload_model(model, store, prefetch_depth=depth)
    x = torch.randn(4, width)
    for _ in range(4):
        for key in store.keys():
            store.evict(key, "host")
        before = store.stats_dict()["bytes_read_nvme"]
        with torch.no_grad():
            model(x)
        assert store.stats_dict()["bytes_read_nvme"] - before == layers * layer


@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in-backward"])
def test_tensors_larger_than_an_update_slice_are_bit_identical(make_store, monkeypatch, in_backward):
    import tierstore.integrations.optim as optim

    _SLICE = 1 << 18  # slices small enough for a quick test: [Note: Sliced updates]
    monkeypatch.setattr(optim, "_SLICE", _SLICE)
    monkeypatch.setattr(optim, "_WHOLE_MAX", _SLICE)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(640, 1300), torch.nn.Tanh(), torch.nn.Linear(1300, 3))
    assert 3 * _SLICE < ref[0].weight.numel() < 4 * _SLICE  # three whole slices and a partial one
    model = copy.deepcopy(ref)
    x, y = torch.randn(16, 640), torch.randn(16, 3)
    with torch.no_grad():  # the process's first product of these shapes came out different in its last bits in
        copy.deepcopy(ref)(x)  # about 1 run in 30 here (torch's CPU BLAS, before any store existed), so not counted
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    off = offload_model(model, make_store(host_budget_bytes="12MiB", device_budget_bytes="8MiB"))
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
    ours = opt.state_dict()["state"]
    for name, p in ref.named_parameters():
        assert torch.equal(ours[name]["exp_avg_sq"], ropt.state[p]["exp_avg_sq"]), name


def test_sliced_update_matches_whole_tensor_operations():
    """The update over slices gives the bits of each operation run over the whole tensor, bf16 gradients too."""
    from tierstore.integrations.optim import _SLICE, _WHOLE_MAX

    hyper = (3e-4, (0.9, 0.95), 1e-8, 0.1)  # lr, betas, eps, weight_decay
    g = torch.Generator().manual_seed(3)
    for n, grad_dtype in ((_WHOLE_MAX + 2 * _SLICE + 12345, torch.float32), (_WHOLE_MAX + 1, torch.bfloat16),
                          (1001, torch.float32)):
        base = [torch.randn(n, generator=g) for _ in range(3)]
        base[2].abs_()
        grad = torch.randn(n, generator=g).to(grad_dtype)
        sliced, whole = [t.clone() for t in base], [t.clone() for t in base]
        for step in (1.0, 2.0, 7.0):
            OffloadedAdamW._adamw(*sliced, grad, step, hyper)
            OffloadedAdamW._adamw_slice(*whole, grad.float(), step, hyper)
        for a, b in zip(sliced, whole):
            assert torch.equal(a, b)


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
    saved = opt.state_dict()["param_groups"]
    assert saved[0]["params"] == no_decay and saved[0]["initial_lr"] == 1e-3


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
        other.load_state_dict(opt.state_dict())


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


def test_loss_scaling_matches_torch_grad_scaler(make_store):
    from tierstore.integrations.optim import OffloadedGradScaler

    ref, model, data = _tiny_pair(tie_head=True)
    off = offload_model(model, make_store(host_budget_bytes="704KiB", device_budget_bytes="320KiB"),
                        resident_threshold_bytes=1024)
    runs = {}
    # 2**30 overflows fp16 in the first backward: that step is skipped and the scale backed off to 2**10.
    scaler_kw = {"init_scale": 2.0**30, "backoff_factor": 2.0**-20, "growth_interval": 2}
    for who, m, opt, scaler, clip in (
            ("ref", ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False),
             torch.amp.GradScaler("cpu", **scaler_kw), lambda: torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)),
            ("ours", model, OffloadedAdamW(off, lr=1e-3, weight_decay=0.01),
             OffloadedGradScaler("cpu", **scaler_kw), lambda: off.clip_grad_norm_(1.0))):
        losses, scales, norms = [], [], []
        for step in range(5):
            x, y = data.batch(step, 8)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(m(x), y)
            scaler.scale(loss).backward()
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
    assert runs["ref"][1][0] == 2.0**10 and not torch.isfinite(runs["ref"][2][0])  # the first step overflowed
    assert runs["ref"][1][-1] > 2.0**10 and torch.isfinite(runs["ref"][2][-1])  # the scale grew after clean steps
    _assert_same_parameters(model, ref)


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
    opt.close()


def _train_on_ids(ref, model, off, *, vocab: int, steps: int, step_in_backward: bool = False) -> None:
    """Train a model whose forward returns its loss on token ids, resident and offloaded; same losses each step."""
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt = OffloadedAdamW(off, lr=1e-2, step_in_backward=step_in_backward)
    for step in range(steps):
        ids = torch.randint(0, vocab, (4, 6), generator=torch.Generator().manual_seed(step))
        ref_loss = ref(ids)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = model(ids)
        assert torch.isfinite(loss) and loss.item() == ref_loss.item(), step
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.close()


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
    model.zero_grad()  # torch's own zero_grad clears the gradients kept for offloaded parameters too
    assert off.grads == {}


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")  # raised by torch importing dynamo
def test_torch_compile_is_refused(make_store):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    offload_model(model, make_store())
    with pytest.raises(OffloadedParameterError, match="torch.compile of an offloaded model"):
        torch.compile(model)(torch.randn(2, 8))


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


def test_a_host_budget_below_one_update_is_refused_before_any_state_exists(make_store):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))  # 16 KiB weight: 3 x 16 KiB
    store = make_store(host_budget_bytes="40KiB")
    off = offload_model(model, store)
    keys = store.keys()
    with pytest.raises(ValueError, match=r"host_budget_bytes=40960 .* AdamW update of .0.weight. needs .* 49152 bytes"):
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


def test_the_optimizer_takes_what_implements_the_offloaded_parameters_contract(make_store):
    from tierstore.integrations import FSDPOffload, OffloadedModel, OffloadedParameters

    assert OffloadedParameters in OffloadedModel.__mro__ and OffloadedParameters in FSDPOffload.__mro__
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="pass what offload_model or offload_fsdp returned, not Linear"):
        OffloadedAdamW(model)
    off = offload_model(model, make_store(), resident_threshold_bytes=0)
    assert isinstance(off, OffloadedParameters) and not off.in_forward_or_backward()
    OffloadedAdamW(off).close()
