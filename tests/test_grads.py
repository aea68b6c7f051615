"""Gradients kept in the store between backward and the optimizer's step: what ``param.grad`` reads and writes,
where the bytes go, their dtype, and the allocator setting that gives freed memory back."""

import copy

import pytest
import torch
import torch.nn.functional as F

import tierstore as ts
from tierstore import _allocator
from tierstore.integrations.offload import offload_model
from tierstore.integrations.optim import OffloadedAdamW


def _pair(dtype=torch.float32, width=64, depth=4):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]).to(dtype)
    return ref, copy.deepcopy(ref)


def _backward(model, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 64, generator=g).to(dtype)
    model(x).float().pow(2).mean().backward()


def test_param_grad_reads_and_writes_the_stored_gradient(make_store):
    ref, model = _pair()
    store = make_store(host_budget_bytes="256KiB")
    offload_model(model, store)
    for m in (ref, model):
        _backward(m, 0)
    p, r = model[0].weight, ref[0].weight
    assert type(p.grad).__name__ == "StoredGrad" and p.grad.shape == r.grad.shape and p.grad.dtype == r.grad.dtype
    assert torch.equal(p.grad, r.grad) and torch.equal(p.grad.view(-1)[:5], r.grad.view(-1)[:5])
    assert torch.equal(p.grad.clone(), r.grad) and p.grad.norm().item() == r.grad.norm().item()
    for a, b in ((p.grad, r.grad), (p.grad.data, r.grad.data)):  # in place, also through .data: kept
        a.mul_(0.5)
        b.mul_(0.5)
        assert torch.equal(p.grad, r.grad)
    p.grad.clamp_(-1e-3, 1e-3)
    r.grad.clamp_(-1e-3, 1e-3)
    assert torch.equal(p.grad, r.grad)
    with pytest.raises(RuntimeError, match=r"view of an offloaded parameter's gradient .* Write the gradient itself"):
        p.grad[0] = 0.0  # a write into a copy would change nothing: refused, never lost
    with pytest.raises(RuntimeError, match="Write the gradient itself"):
        p.grad.view(-1).zero_()
    new = torch.full_like(r.grad, 0.25)
    p.grad = new.clone()
    assert torch.equal(p.grad, new)
    with pytest.raises(ValueError, match="shape"):
        p.grad = torch.zeros(3)
    p.grad = None
    assert p.grad is None and "grad/0.weight" not in store
    old = model[1].weight.grad
    model.zero_grad()
    assert all(q.grad is None for q in model.parameters()) and not [k for k in store.keys() if k.startswith("grad/")]
    with pytest.raises(RuntimeError, match="this gradient was dropped"):
        old.sum()  # a gradient read before zero_grad() is not silently another one


def test_operations_over_several_stored_gradients_write_each_or_refuse(make_store):
    """torch's foreach operations (clip_grad_norm_(..., foreach=True), clip_grad_value_, _foreach_mul_) over a list
    of stored gradients run one gradient at a time and change each, as on resident gradients (they were silently
    applied to copies before); an operation writing one stored gradient while reading another is refused, in a
    foreach operation too (it recursed without end once)."""
    ref, model = _pair()
    offload_model(model, make_store(host_budget_bytes="256KiB"))
    for m in (ref, model):
        _backward(m, 0)

    def same():
        return all(torch.equal(p.grad.clone(), r.grad) for p, r in zip(model.parameters(), ref.parameters()))

    norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01, foreach=True) for m in (model, ref)]
    assert torch.equal(norms[0], norms[1]) and same()
    for m in (model, ref):
        torch.nn.utils.clip_grad_value_(m.parameters(), 1e-4, foreach=True)
        grads = [p.grad for p in m.parameters()]
        torch._foreach_mul_(grads, 0.5)
        torch._foreach_add_(grads, [torch.ones_like(g) for g in grads], alpha=0.25)
    assert same()
    ours = torch._foreach_norm([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(ours, torch._foreach_norm([p.grad for p in ref.parameters()])))
    a, b = model[0].weight.grad, model[1].weight.grad
    with pytest.raises(RuntimeError, match="write a stored gradient while reading another"):
        torch.add(b, b, out=a)
    c = model[2].weight.grad  # a list position holding two stored gradients: that position is refused, not looped
    with pytest.raises(RuntimeError, match="_foreach_add_ would write a stored gradient while reading another"):
        torch._foreach_add_([a, c], [torch.zeros(a.shape), a])
    sums = torch._foreach_add([a, c], [b, a])  # reading two at a position is fine
    assert torch.equal(sums[1], ref[2].weight.grad + ref[0].weight.grad)
    assert same()


def test_kept_gradients_spill_to_the_drive_and_clipping_reads_none_of_them(make_store):
    """A host budget below the gradients: they go to the drive during backward, come back for the step, and
    torch's clip_grad_norm_ over every parameter reads none of them (norms made as they were stored, the
    coefficient applied as the optimizer reads each); the training is the resident one."""
    ref, model = _pair(width=64, depth=8)
    store = make_store(host_budget_bytes="96KiB")  # 8 weights of 16 KiB, their gradients, and the state
    off = offload_model(model, store)
    opt = OffloadedAdamW(off, lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for step in range(3):
        for micro in range(2):
            _backward(ref, 10 * step + micro)
            _backward(model, 10 * step + micro)
        on_drive = [k for k in store.keys() if k.startswith("grad/") and set(store.info(k)["copies"]) == {"nvme"}]
        assert on_drive, "no gradient reached the drive"
        read = store.stats_dict()["bytes_read_nvme"]
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        assert store.stats_dict()["bytes_read_nvme"] == read  # the clip read nothing from the drive
        assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01))
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    opt.close()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name


def test_low_precision_gradients_accumulate_in_fp32_unless_asked(make_store):
    ref, model = _pair(torch.bfloat16)
    kept = copy.deepcopy(ref)
    off = offload_model(model, make_store())
    off_param = offload_model(kept, make_store(), grad_dtype="param")
    for seed in (0, 1):
        _backward(ref, seed, torch.bfloat16)
        _backward(model, seed, torch.bfloat16)
        _backward(kept, seed, torch.bfloat16)
    assert kept[0].weight.grad.dtype == torch.bfloat16 and torch.equal(kept[0].weight.grad, ref[0].weight.grad)
    assert model[0].weight.grad.dtype == torch.float32
    # each backward's bf16 gradient, added in fp32
    g = [None, None]
    for i, seed in enumerate((0, 1)):
        one = copy.deepcopy(ref)
        one.zero_grad()
        _backward(one, seed, torch.bfloat16)
        g[i] = one[0].weight.grad.float()
    assert torch.equal(model[0].weight.grad, g[0] + g[1])
    assert store_dtype(off, "grad/0.weight") == torch.float32 and store_dtype(off_param, "grad/0.weight") == \
        torch.bfloat16
    with pytest.raises(ValueError, match="grad_dtype='half'"):
        offload_model(copy.deepcopy(ref), make_store(), grad_dtype="half")


def store_dtype(off, key):
    return off.store.info(key)["dtype"]


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_grad_tier_is_the_gradients_home(make_store, tier):
    _, model = _pair()
    off = offload_model(model, make_store(), grad_tier=tier)
    _backward(model, 0)
    assert off.store.info("grad/0.weight")["home"] == tier
    # the tier of the state of the optimizer that steps them when not set
    _, other = _pair()
    off = offload_model(other, make_store())
    OffloadedAdamW(off, home="host")
    _backward(other, 0)
    assert off.store.info("grad/0.weight")["home"] == "host"


def test_a_gradient_that_fits_never_touches_the_drive(make_store):
    _, model = _pair()
    store = make_store(host_budget_bytes="8MiB")
    offload_model(model, store)
    written = store.stats_dict()["bytes_written_nvme"]
    _backward(model, 0)
    _backward(model, 1)
    model.zero_grad()
    assert store.stats_dict()["bytes_written_nvme"] == written


def test_the_store_fixes_the_allocators_mmap_threshold(make_store):
    make_store()
    if _allocator._libc() is None:
        pytest.skip("not glibc")
    assert _allocator.mmap_threshold() == 128 * 1024
    with pytest.raises(ValueError, match="malloc_mmap_threshold_bytes=.* between 1 byte and 32 MiB"):
        ts.StoreConfig(malloc_mmap_threshold_bytes="64MiB")
    assert ts.StoreConfig(malloc_mmap_threshold_bytes=None).malloc_mmap_threshold_bytes is None


def test_stepping_in_backward_keeps_no_gradient_in_the_store(make_store):
    ref, model = _pair()
    store = make_store()
    off = offload_model(model, store)
    opt = OffloadedAdamW(off, lr=1e-2, step_in_backward=True)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for step in range(2):
        for m, o in ((ref, ropt), (model, opt)):
            _backward(m, step)
            o.step()
            o.zero_grad()
        assert not [k for k in store.keys() if k.startswith("grad/")]
    opt.close()
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name
    x = torch.randn(2, 64)
    assert torch.equal(model(x), ref(x))
    assert F.mse_loss(model(x), ref(x)).item() == 0.0


def test_a_stored_gradient_behaves_as_a_tensor_of_its_values(make_store, tmp_path):
    ref, model = _pair()
    offload_model(model, make_store())
    for m in (ref, model):
        _backward(m, 0)
    g, r = model[0].weight.grad, ref[0].weight.grad
    assert torch.equal(copy.deepcopy(g), r) and type(copy.deepcopy(g)) is torch.Tensor
    torch.save(g, tmp_path / "g.pt")  # its values, never the store's bookkeeping
    assert torch.equal(torch.load(tmp_path / "g.pt"), r)
    assert g.tolist() == r.tolist() and (g.numpy() == r.numpy()).all()
    assert torch.equal(g.to(torch.float64), r.to(torch.float64)) and g.cpu() is g
    g.add_(model[1].weight.grad)  # one stored gradient into another
    r.add_(ref[1].weight.grad)
    assert torch.equal(g, r) and torch.equal(g + model[1].weight.grad, r + ref[1].weight.grad)


def _layers_under_a_small_budget(make_store, width: int, layers: int):
    """``layers`` Linear layers offloaded under a host budget of half of them, with an optimizer that steps
    after backward and lets each gradient go once applied."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    store = make_store(host_budget_bytes=layers // 2 * width * width * 4)
    off = offload_model(model, store, prefetch_depth=2)
    return model, store, OffloadedAdamW(off, lr=1e-3, keep_grads=False)


def test_a_backward_writing_gradients_reads_each_weight_once(make_store):
    """Trainer's loop under a host budget of 6 layers: the second micro-batch's backward adds into kept
    gradients, filling the host tier with changed copies. Eviction writes them to the drive rather than drop
    the next layer's weights read ahead for it (see [Note: Changed copies keep their rank]): no weight is read
    twice in that backward (with clean copies freed first, 7 of the 9 read were read two or three times). The
    update then reads each kept gradient once: ranked as its parameter's state, one read ahead stays for it."""
    import collections

    width, layers = 256, 12
    model, store, opt = _layers_under_a_small_budget(make_store, width, layers)
    x = torch.randn(4, width)
    reads: collections.Counter = collections.Counter()
    try:
        for step in range(3):
            for micro in range(2):
                loss = model(x + micro).square().mean() / 2
                timeline = store.record_timeline() if (step, micro) == (2, 1) else None
                loss.backward()
                if timeline is not None:
                    reads.update(e["args"]["key"] for e in timeline.events() if e.get("cat") == "transfer"
                                 and e["name"].startswith("nvme->") and e["args"]["key"].startswith("param/"))
                    store.record_timeline(False)
            assert any(k.startswith("grad/") and set(store.info(k)["copies"]) == {"nvme"} for k in store.keys())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            timeline = store.record_timeline() if step == 2 else None
            opt.step()
            opt.wait()
            if timeline is not None:
                grad_reads = collections.Counter(
                    e["args"]["key"] for e in timeline.events() if e.get("cat") == "transfer"
                    and e["name"].startswith("nvme->") and e["args"]["key"].startswith("grad/"))
                store.record_timeline(False)
            opt.zero_grad()
    finally:
        opt.close()
    assert reads and max(reads.values()) == 1, reads
    assert grad_reads and max(grad_reads.values()) == 1, grad_reads


def test_the_first_backward_reads_its_weights_ahead(make_store):
    """Before a step was recorded, the guessed trace runs forward through the units in definition order and
    backward in reverse: every weight the first backward reads from the drive was asked for ahead of its use
    (with a guess of forward alone, the first backward left it and fetched each on demand)."""
    width, layers = 256, 12
    model, store, opt = _layers_under_a_small_budget(make_store, width, layers)
    asked: list[str] = []
    prefetch = store.prefetch
    store.prefetch = lambda key, tier="device": (asked.append(key), prefetch(key, tier))[1]
    try:
        loss = model(torch.randn(4, width)).square().mean()
        asked.clear()
        timeline = store.record_timeline()
        loss.backward()
        store.record_timeline(False)
        read = {e["args"]["key"] for e in timeline.events() if e.get("cat") == "transfer"
                and e["name"].startswith("nvme->") and e["args"]["key"].startswith("param/")}
        assert len(read) >= layers // 2 and read <= set(asked), (sorted(read), asked)
        opt.step()
    finally:
        opt.close()


def test_a_gradient_kept_after_its_update_is_not_changed_by_it(make_store):
    """With ``keep_grads`` (the default) the update applies the recorded clip coefficient to a copy: the stored
    gradient keeps its bytes, so the room the next updates need drops it with no write to the drive, and
    ``p.grad`` still reads the clipped values torch's does."""
    ref, model = _pair()
    store = make_store()
    off = offload_model(model, store)
    opt = OffloadedAdamW(off, lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    try:
        for m in (ref, model):
            _backward(m, 0)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
        keys = [k for k in store.keys() if k.startswith("grad/")]
        before = {k: store.read(k) for k in keys}  # as stored: the coefficient is recorded, not applied
        opt.step()
        ropt.step()
        assert keys and all(torch.equal(store.read(k), before[k]) for k in keys)
        for p, r in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, r.grad)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    finally:
        opt.close()
