"""Compressed optimizer state (see [Note: Compressed optimizer state]): each layout's update against a plain
reference to the last bit, the bytes the store keeps, checkpoints and state dicts, training against fp32."""

import contextlib
import copy
import itertools
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _training import named_state
from tierstore.integrations import OffloadedAdamW, load_checkpoint, offload_model, save_checkpoint, split_settings
from tierstore.integrations import _layouts as L

from tierstore import CheckpointError

HYPER = (1e-2, (0.9, 0.999), 1e-8, 0.01, False)


def _ref_decode(codes, scales, qmap):
    per_value = scales.repeat_interleave(L.BLOCK)[:codes.numel()]
    return qmap[codes.long()] * per_value


def _ref_encode(x, qmap):
    """Plain block-wise quantization: each block's absolute maximum, then per value (normalised: times the
    maximum's reciprocal; rounded to bf16)
    the number of midpoints between neighbouring map values at or below it (the index of the nearest, a tie to
    the larger)."""
    n = x.numel()
    padded = torch.zeros(-(-n // L.BLOCK) * L.BLOCK)
    padded[:n] = x
    scales = padded.view(-1, L.BLOCK).abs().amax(1)
    safe = scales.clamp(min=torch.finfo(torch.float32).tiny)
    y = (padded.view(-1, L.BLOCK) * (1.0 / safe)[:, None]).view(-1)[:n].to(torch.bfloat16).float()
    midpoints = (qmap[:-1] + qmap[1:]) / 2
    codes = (y.unsqueeze(1) >= midpoints).sum(1).to(torch.uint8)
    return codes, scales


def _ref_bits(weight_bf16, low):
    """The master of a split pair: the weight was rounded up from the master's top half where its low half is
    0x8000 or more."""
    hi = weight_bf16.view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    lo = low.numpy().astype(np.int64) & 0xFFFF
    top = (hi - (lo >= 0x8000)) & 0xFFFF
    return torch.from_numpy(((top << 16) | lo).astype(np.uint32).view(np.float32).copy())


def _ref_rounded(master):
    """A finite fp32 master rounded to bf16, nearest, a tie away from zero (as int16 bits)."""
    bits = master.numpy().view(np.uint32).astype(np.int64)
    return torch.from_numpy((((bits >> 16) + ((bits & 0xFFFF) >= 0x8000)) & 0xFFFF).astype(np.uint16).view(np.int16))


def _random_moments(n, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=g) * 1e-3
    v = torch.rand(n, generator=g) * 1e-6
    m[:7] = 0.0  # a block's zeros, and exact ties come from the map's own values below
    return m, v


def _ref_adamw(p, m, v, g, step, hyper):
    """The arithmetic of [Note: The compressed update's arithmetic] in numpy, fp32 throughout."""
    lr, (beta1, beta2), eps, wd, maximize = hyper
    f = np.float32
    p, m, v, g = (t.numpy().astype(np.float32) for t in (p, m, v, g))
    if maximize:
        g = -g
    p = p * f(1 - lr * wd)
    m = m * f(beta1) + g * f(1 - beta1)
    v = v * f(beta2) + (g * g) * f(1 - beta2)
    d = np.sqrt(v) / f(np.sqrt(1 - beta2 ** step)) + f(eps)
    p = p - (m / d) * f(lr / (1 - beta1 ** step))
    return tuple(torch.from_numpy(t) for t in (p, m, v))


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("moments,master", list(itertools.product(("bf16", "8bit"), ("split", "none", "fp32"))))
def test_one_compressed_update_matches_a_plain_reference_to_the_last_bit(moments, master, native):
    n = L.CHUNK + 3 * L.BLOCK + 37  # two slices, the last block partial
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(n, generator=g) * 1e-2
    m0, v0 = _random_moments(n, 2)
    fp32_weight = torch.randn(n, generator=g)
    # the stored state before the update, and its values as the reference reads them
    if moments == "8bit":
        stored_m = torch.zeros(L.packed_size(n), dtype=torch.uint8)
        stored_v = torch.zeros(L.packed_size(n), dtype=torch.uint8)
        for stored, value, q in ((stored_m, m0, L.SIGNED), (stored_v, v0, L.UNSIGNED)):
            codes, scales = _ref_encode(value, q.map)
            c, s = L.unpack(stored, n)
            c.copy_(codes)
            s.copy_(scales)
        m_ref = _ref_decode(*_ref_encode(m0, L.SIGNED.map), L.SIGNED.map)
        v_ref = _ref_decode(*_ref_encode(v0, L.UNSIGNED.map), L.UNSIGNED.map)
    else:
        stored_m, stored_v = m0.to(torch.bfloat16), v0.to(torch.bfloat16)
        m_ref, v_ref = stored_m.float(), stored_v.float()
    low = None
    if master == "split":
        weight = torch.empty(n, dtype=torch.bfloat16)
        low = torch.empty(n, dtype=torch.int16)
        L.split_master(fp32_weight, weight, low)
        w_ref = _ref_bits(weight, low)
        assert torch.equal(w_ref, fp32_weight)  # the split is exact
    elif master == "none":
        weight = fp32_weight.to(torch.bfloat16)
        w_ref = weight.float()
    else:  # an fp32 master (or an fp32 weight): stepped in place
        weight = fp32_weight.clone()
        w_ref = fp32_weight.clone()

    L.compressed_update(moments=moments, master=None if master == "none" else master, weight=weight, low=low,
                        exp_avg=stored_m, exp_avg_sq=stored_v, grad=grad, step=3.0, hyper=HYPER,
                        seed=L.seed_of("w", 3.0), native=native)

    w_ref, m_ref, v_ref = _ref_adamw(w_ref, m_ref, v_ref, grad, 3.0, HYPER)
    if moments == "8bit":
        for stored, value, q in ((stored_m, m_ref, L.SIGNED), (stored_v, v_ref, L.UNSIGNED)):
            codes, scales = _ref_encode(value, q.map)
            c, s = L.unpack(stored, n)
            assert torch.equal(c, codes) and torch.equal(s, scales)
    else:
        assert torch.equal(stored_m, m_ref.to(torch.bfloat16)) and torch.equal(stored_v, v_ref.to(torch.bfloat16))
    if master == "split":
        assert torch.equal(_ref_bits(weight, low).view(torch.int32), w_ref.view(torch.int32))
        assert torch.equal(weight.view(torch.int16), _ref_rounded(w_ref))
        ties = (low.to(torch.int32) & 0xFFFF) == 0x8000  # else torch's rounding to nearest gives the same
        assert torch.equal(weight[~ties], w_ref.to(torch.bfloat16)[~ties])
    elif master == "none":  # rounded to one of the two bf16 neighbours, each often
        down = torch.from_numpy((w_ref.numpy().view(np.uint32) >> 16).astype(np.uint16).view(np.int16))
        up = (down.to(torch.int32) + 1).to(torch.int16)
        got = weight.view(torch.int16)
        assert bool(((got == down) | (got == up)).all())
        assert 0.2 < (got == up).float().mean().item() < 0.8
    else:
        assert torch.equal(weight, w_ref)


def _same_bits(a, b):
    """Equal bit for bit, any NaN equal to any NaN (its payload is not kept by every conversion)."""
    if a.is_floating_point():
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(-1).view(torch.uint8),
                                                           b[~nan].view(-1).view(torch.uint8))
    return torch.equal(a, b)


@pytest.mark.parametrize("moments", ["8bit", "bf16", "plain"])
@pytest.mark.parametrize("master", ["split", "none", "fp32"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_the_native_kernel_and_the_torch_operations_give_the_same_bits(moments, master, grad_dtype):
    """Two steps on values a run meets (zeros, ties of the map, a NaN and an infinity in a gradient, an odd
    length), maximize on: every stored byte equal."""
    if L._native.kernel() is None:
        pytest.skip("no C compiler: the torch operations are the only implementation here")
    n = 2 * L.CHUNK + 2 * L.BLOCK + 11
    g = torch.Generator().manual_seed(3)
    fp = torch.randn(n, generator=g)
    fp[100:140] = 0.0
    grad = (torch.randn(n, generator=g) * 1e-2).to(grad_dtype)
    grad[300], grad[L.CHUNK + 5], grad[900:1000] = float("nan"), float("inf"), 0.0
    m0, v0 = _random_moments(n, 4)
    m0[2000:2300] = L.SIGNED.map[torch.arange(300) % 256] * 1e-3  # values on the map's own points
    state = {"low": None}
    if master == "split":
        state["weight"], state["low"] = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
        L.split_master(fp, state["weight"], state["low"])
    else:
        state["weight"] = fp.to(torch.bfloat16) if master == "none" else fp
    for key, value, signed in (("exp_avg", m0, True), ("exp_avg_sq", v0, False)):
        if moments == "8bit":
            state[key] = torch.zeros(L.packed_size(n), dtype=torch.uint8)
            L.encode_state("8bit", value, state[key], signed, None)
        else:
            state[key] = value.to(torch.bfloat16 if moments == "bf16" else torch.float32)
    runs = []
    for native, threads in ((True, 1), (False, 1), (True, 3)):  # three threads: ranges of unequal chunk counts
        mine = {k: v.clone() if v is not None else None for k, v in state.items()}
        for step in (1.0, 2.0):
            L.compressed_update(moments=moments, master=None if master == "none" else master, **mine, grad=grad,
                                step=step, hyper=(1e-3, (0.9, 0.99), 1e-8, 0.1, True), seed=11, native=native,
                                threads=threads)
        runs.append(mine)
    for key in state:
        if state[key] is not None:
            assert _same_bits(runs[0][key], runs[1][key]) and _same_bits(runs[0][key], runs[2][key]), key


def test_the_8bit_codes_are_those_of_the_nearest_map_values_up_to_bf16_rounding():
    for q in (L.SIGNED, L.UNSIGNED):
        mids = q.midpoints
        values = torch.cat([mids, torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0)),
                            q.map, torch.linspace(-1, 1, 10001), torch.randn(5000) * 1e-6])
        values = values[(values >= 0) | bool(q is L.SIGNED)].clamp(-1, 1)
        n = values.numel()
        x = torch.cat([values, torch.ones(-n % L.BLOCK)])
        x[::L.BLOCK] = 1.0  # every block's scale is 1: the values are quantized as they are
        codes = torch.empty(x.numel(), dtype=torch.uint8)
        scales = torch.empty(x.numel() // L.BLOCK)
        q.encode(x, codes, scales)
        assert torch.equal(codes, _ref_encode(x, q.map)[0])
        rounded = x.to(torch.bfloat16).float()
        assert torch.equal(codes.long(), torch.bucketize(rounded, mids, right=True))
        # against the exact nearest: never worse by more than the bf16 rounding of the value
        exact = q.map[torch.bucketize(x, mids, right=True)]
        worse = (q.map[codes.long()] - x).abs() - (exact - x).abs()
        assert bool((worse <= (rounded - x).abs() * 2 + 1e-6).all())  # up to fp32 rounding of the differences


def test_the_dynamic_maps_hold_256_sorted_values_with_zero_and_one():
    for q, low in ((L.SIGNED, -0.99297), (L.UNSIGNED, 0.0)):
        assert q.map.numel() == 256 and bool((q.map[1:] > q.map[:-1]).all())
        assert q.map[-1].item() == 1.0 and 0.0 in q.map.tolist()
        assert q.map[0].item() == pytest.approx(low, abs=1e-5)
    assert L.SIGNED.map[L.SIGNED.map > 0].min().item() == pytest.approx(5.5e-7)


def test_rounding_noise_is_uniform_and_rounds_up_as_often_as_the_dropped_fraction():
    """[Note: Rounding noise]: any slice draws the same values as the whole; they are uniform over [0, 2^16);
    a value a quarter of a bf16 unit above its lower neighbour rounds up a quarter of the time."""
    n = 1 << 20
    noise = L.rounding_noise(L.seed_of("w", 3.0), 0, n)
    assert noise.dtype == torch.int32 and int(noise.min()) >= 0 and int(noise.max()) < 1 << 16
    assert torch.equal(L.rounding_noise(L.seed_of("w", 3.0), 1000, 5000), noise[1000:5000])
    assert not torch.equal(L.rounding_noise(L.seed_of("w", 4.0), 0, 4000), noise[:4000])
    counts = torch.bincount(noise >> 12, minlength=16).float()
    assert bool(((counts - n / 16).abs() < 0.01 * n / 16).all())  # each sixteenth of the range within 1%
    value = torch.full((n,), 1.0 + 2 ** -9)  # a quarter of bf16's unit at 1 (2^-7)
    out = torch.empty(n, dtype=torch.bfloat16)
    L.stochastic_round(value, out, noise)
    assert abs((out.float() > 1.0).float().mean().item() - 0.25) < 0.005


def test_a_nan_in_a_block_decodes_as_nan_and_stochastic_rounding_keeps_nan():
    x = torch.randn(2 * L.BLOCK)
    x[3] = float("nan")
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    scales = torch.empty(2)
    L.SIGNED.encode(x, codes, scales)
    out = L.SIGNED.decode(codes, scales)
    assert bool(out[:L.BLOCK].isnan().all()) and bool(out[L.BLOCK:].isfinite().all())
    value = torch.tensor([float("nan"), 1.0, float("inf"), -float("inf")])
    rounded = torch.empty(4, dtype=torch.bfloat16)
    L.stochastic_round(value, rounded, torch.randint(0, 1 << 16, (4,), dtype=torch.int32))
    assert rounded[0].isnan() and rounded[1] == 1.0 and rounded[2] == float("inf") and rounded[3] == -float("inf")


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64),
                               torch.nn.GELU(), torch.nn.Linear(64, 8)).to(dtype)


def _train(model, opt, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 64, generator=g).to(next(model.parameters()).dtype)
        loss = F.mse_loss(model(x).float(), torch.tanh(x[:, :8].float()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_store_keeps_compressed_bytes_and_the_drive_sees_only_them(make_store):
    store = make_store()
    model = _model()
    off = offload_model(model, store)
    opt = OffloadedAdamW(off, moments="8bit", master="split")
    for name, key, p in off.named_offloaded():
        n = p.numel()
        infos = {what: store.info(f"adam/{name}/{what}") for what in ("exp_avg", "exp_avg_sq", "master")}
        if n >= L.MIN_COMPRESSED:
            assert infos["exp_avg"]["nbytes"] == infos["exp_avg_sq"]["nbytes"] == L.packed_size(n)
        else:  # small tensors keep fp32 moments
            assert infos["exp_avg"]["nbytes"] == 4 * n
        assert infos["master"]["nbytes"] == 2 * n and infos["master"]["dtype"] == torch.int16
        assert store.info(key)["dtype"] == torch.bfloat16
    state = sum(opt._state.nbytes(key, p) for _, key, p in off.named_offloaded())
    params = sum(p.numel() for _, _, p in off.named_offloaded())
    assert state < 0.55 * params * 8  # against the fp32 layout's 8 bytes of moments and 4 of master a parameter
    store.flush()
    written = store.stats.snapshot()["bytes_written_nvme"]
    # the drive was written each tensor once as the store keeps it (in 4 KiB-aligned extents): compressed state
    kept = sum(-(-store.info(k)["nbytes"] // 4096) * 4096 for k in store.keys())
    assert written == kept


def test_fp32_layout_is_unchanged_and_the_config_chooses_the_layout(make_store):
    ref, model = _model(torch.float32), _model(torch.float32)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    off = offload_model(model, make_store())
    opt = OffloadedAdamW(off, lr=1e-2)
    assert opt.layout == L.StateLayout("fp32", "fp32")
    assert _train(model, opt, 3) == _train(ref, ref_opt, 3)
    settings = split_settings({"optimizer_moments": "bf16", "optimizer_master": "split"})
    off2 = offload_model(_model(), make_store())
    assert OffloadedAdamW(off2, policy=settings.optimizer).layout == L.StateLayout("bf16", "split")
    with pytest.raises(ValueError, match="optimizer_moments='4bit': choose one of"):
        split_settings({"optimizer_moments": "4bit"})


def test_fp16_weights_refuse_a_split_master(make_store):
    off = offload_model(_model(torch.float16), make_store())
    with pytest.raises(ValueError, match="master='split' needs bf16 weights"):
        OffloadedAdamW(off, master="split")


@pytest.mark.parametrize("moments,master", [("8bit", "split"), ("bf16", "none"), ("8bit", "fp32")])
def test_short_training_stays_within_two_percent_of_fp32_adamw(make_store, moments, master):
    """bf16 weights with each layout against resident fp32 AdamW on the same model in fp32 (40 steps)."""
    ref = _model(torch.float32)
    ref_losses = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False), 40)
    model = _model()
    opt = OffloadedAdamW(offload_model(model, make_store()), lr=1e-2, moments=moments, master=master)
    losses = _train(model, opt, 40)
    assert losses[-1] < 0.5 * losses[0]
    assert abs(np.mean(losses[-10:]) - np.mean(ref_losses[-10:])) <= 0.02 * np.mean(ref_losses[-10:])


def test_stochastic_rounding_repeats_exactly(make_store):
    runs = []
    for _ in range(2):
        model = _model()
        opt = OffloadedAdamW(offload_model(model, make_store()), lr=1e-2, moments="8bit", master="none")
        runs.append(_train(model, opt, 4))
        opt.close()
    assert runs[0] == runs[1]


def test_a_checkpoint_keeps_compressed_state_as_it_is_and_resumes_bit_identically(make_store, tmp_path):
    model = _model()
    off = offload_model(model, make_store())
    opt = OffloadedAdamW(off, lr=1e-2, moments="8bit", master="split")
    _train(model, opt, 3)
    save_checkpoint(str(tmp_path / "ck"), model, opt)
    stored = opt.state_dict(beyond_host_budget=True)
    expected = _train(model, opt, 3, start=3)
    load_checkpoint(str(tmp_path / "ck"), model, opt)
    for name, entry in named_state(opt.state_dict(beyond_host_budget=True)).items():
        for what, value in entry.items():
            assert torch.equal(value, named_state(stored)[name][what]), (name, what)
    assert _train(model, opt, 3, start=3) == expected
    # the optimizer file holds the packed bytes: about a quarter of the fp32 layout's moments
    params = sum(p.numel() for _, _, p in off.named_offloaded())
    assert (tmp_path / "ck" / "optimizer.safetensors").stat().st_size < params * 5

    other = _model()
    opt2 = OffloadedAdamW(offload_model(other, make_store()), lr=1e-2, moments="bf16", master="split")
    with pytest.raises(CheckpointError, match="stored with moments='8bit'.*load_state_dict\\(sd, convert=True\\)"):
        load_checkpoint(str(tmp_path / "ck"), other, opt2)


def test_a_state_dict_loads_into_its_own_layout_bit_identically_and_into_another_with_convert(make_store):
    model = _model()
    opt = OffloadedAdamW(offload_model(model, make_store()), lr=1e-2, moments="8bit", master="split")
    _train(model, opt, 3)
    sd = copy.deepcopy(opt.state_dict(beyond_host_budget=True))
    weights = copy.deepcopy(model.state_dict())
    assert sd["state_layout"] == {"moments": "8bit", "master": "split", "split": "nearest"}
    opt.load_state_dict(sd)
    for name, entry in named_state(opt.state_dict(beyond_host_budget=True)).items():
        for what, value in entry.items():
            assert torch.equal(value, named_state(sd)[name][what])

    other = _model()
    off2 = offload_model(other, make_store())
    other.load_state_dict(weights)
    opt2 = OffloadedAdamW(off2, lr=1e-2, moments="fp32", master="fp32")
    with pytest.raises(ValueError, match="saved with moments='8bit', master='split'.*convert=True"):
        opt2.load_state_dict(sd)
    opt2.load_state_dict(sd, convert=True)
    name = "0.weight"
    converted = named_state(opt2.state_dict(beyond_host_budget=True))[name]
    assert torch.equal(converted["exp_avg"], opt.decoded(name, "exp_avg", named_state(sd)[name]["exp_avg"]))
    assert torch.equal(converted["master"], opt.decoded(name, "master", named_state(sd)[name]["master"]))
    # both continue the same way up to the moments' quantization
    a, b = _train(model, opt, 5, start=3), _train(other, opt2, 5, start=3)
    assert np.allclose(a, b, rtol=0.02)


def test_bf16_weights_computed_in_fp32_train_offloaded_as_resident_and_keep_no_fp32_copies(make_store):
    from tierstore.tools.upcast import compute_in_fp32

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.GELU(),
                              torch.nn.Linear(128, 8)).to(torch.bfloat16)
    model = copy.deepcopy(ref)
    assert compute_in_fp32(ref) == compute_in_fp32(model) == 3
    ref_opt = OffloadedAdamW(offload_model(ref, make_store(host_budget_bytes="64MiB")), lr=1e-2)
    opt = OffloadedAdamW(offload_model(model, make_store(host_budget_bytes="8MiB")), lr=1e-2)
    for step in range(3):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
        losses = []
        for m, o in ((ref, ref_opt), (model, opt)):
            out = m(x)
            assert out.dtype == torch.float32
            loss = out.pow(2).mean()
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1]
    # what autograd keeps from forward to backward: the input and the weight itself, not an fp32 copy of it
    lin = torch.nn.Linear(256, 256).to(torch.bfloat16)
    compute_in_fp32(lin)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lin(torch.randn(2, 256))
    assert not any(t.dtype == torch.float32 and t.shape == (256, 256) for t in saved)


def test_without_a_compiler_the_update_warns_once_and_runs_as_torch_operations(monkeypatch, tmp_path):
    monkeypatch.setattr(L._native, "_loaded", [])
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="torch operations.*no C compiler"):
        assert L._native.kernel() is None
    assert L._native.kernel() is None  # decided once
    n = 3 * L.BLOCK
    weight, m, v = torch.zeros(n), torch.zeros(L.packed_size(n), dtype=torch.uint8), torch.zeros(
        L.packed_size(n), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="native kernel of the compressed update is not built"):
        L.compressed_update(moments="8bit", master=None, weight=weight, low=None, exp_avg=m, exp_avg_sq=v,
                            grad=torch.ones(n), step=1.0, hyper=HYPER, seed=0, native=True)
    L.compressed_update(moments="8bit", master=None, weight=weight, low=None, exp_avg=m, exp_avg_sq=v,
                        grad=torch.ones(n), step=1.0, hyper=HYPER, seed=0)
    assert bool((weight < 0).all())  # stepped against the gradient


def test_a_kernel_cache_others_can_write_is_refused(monkeypatch, tmp_path):
    if L._native.kernel() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(L._native, "_loaded", [])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (tmp_path / "tierstore-kernels").mkdir(mode=0o777)
    (tmp_path / "tierstore-kernels").chmod(0o777)
    with pytest.warns(RuntimeWarning, match="others can write to it"):
        assert L._native.kernel() is None
    monkeypatch.setattr(L._native, "_loaded", [])
    (tmp_path / "tierstore-kernels").chmod(0o700)
    assert L._native.kernel() is not None  # built there, private
    built = list((tmp_path / "tierstore-kernels").iterdir())
    assert len(built) == 1 and built[0].stat().st_mode & 0o077 == 0


def test_the_kernel_s_arguments_match_their_ctypes_mirror_field_by_field(monkeypatch):
    """The library reports each field's name and offset, not only the struct's size: two fields of one size
    swapped in the mirror keep the size and the offsets and are still refused."""
    import ctypes

    fn = L._native.kernel()
    if fn is None:
        pytest.skip("no C compiler")
    assert L._native.matches(fn.library)
    fields = list(L._native.UpdateArgs._fields_)
    at = [name for name, _ in fields].index("seed_lo")
    fields[at], fields[at + 1] = fields[at + 1], fields[at]  # seed_hi before seed_lo: the same size
    swapped = type("Swapped", (ctypes.Structure,), {"_fields_": fields})
    monkeypatch.setattr(L._native, "UpdateArgs", swapped)
    assert not L._native.matches(fn.library)

def _old_split(master, weight, low):
    """The first version's split: the weight is the master's top half, truncated toward zero."""
    bits = master.contiguous().view(torch.int32).numpy().view(np.uint32)
    weight.view(torch.int16).numpy().view(np.uint16).reshape(-1)[:] = (bits >> 16).astype(np.uint16).reshape(-1)
    low.numpy().view(np.uint16).reshape(-1)[:] = (bits & 0xFFFF).astype(np.uint16).reshape(-1)


def test_split_masters_of_the_first_version_load_exactly_with_rounded_weights(make_store, tmp_path, monkeypatch):
    """State saved when the split weight was the master's truncated top half: a checkpoint and a state dict load
    without convert=True, each master exactly as saved, each weight then its master rounded to nearest."""
    model = _model()
    off = offload_model(model, make_store())
    with monkeypatch.context() as m:  # train and save as the first version did
        m.setattr(L, "split_master", _old_split)
        m.setattr(L, "join_master", lambda w, lo, split="nearest": _ref_truncated(w, lo))
        m.setattr(L._native, "_loaded", [None])
        m.setattr(L.StateLayout, "as_dict", lambda self: {"moments": self.moments, "master": self.master})
        opt = OffloadedAdamW(off, lr=1e-2, moments="8bit", master="split")
        _train(model, opt, 3)
        save_checkpoint(str(tmp_path / "ck"), model, opt)
        sd = copy.deepcopy(opt.state_dict(beyond_host_budget=True))
        weights = copy.deepcopy(model.state_dict())
    masters = {name: _ref_truncated(weights[name], named_state(sd)[name]["master"]) for name in named_state(sd)
               if "master" in named_state(sd)[name]}
    assert masters and sd["state_layout"] == {"moments": "8bit", "master": "split"}
    for how in ("checkpoint", "state_dict"):
        other = _model()
        off2 = offload_model(other, make_store())
        opt2 = OffloadedAdamW(off2, lr=1e-2, moments="8bit", master="split")
        if how == "checkpoint":
            load_checkpoint(str(tmp_path / "ck"), other, opt2)
        else:
            other.load_state_dict(weights)
            opt2.load_state_dict(sd)
        now = opt2.state_dict(beyond_host_budget=True)
        loaded = dict(other.state_dict())
        for name, master in masters.items():
            assert torch.equal(opt2.decoded(name, "master", named_state(now)[name]["master"]), master), (how, name)
            assert torch.equal(loaded[name].view(torch.int16), _ref_rounded(master)), (how, name)
        assert all(x == x for x in _train(other, opt2, 2, start=3))


def _ref_truncated(weight, low):
    hi = weight.contiguous().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    lo = low.contiguous().numpy().astype(np.int64) & 0xFFFF
    return torch.from_numpy(((hi << 16) | lo).astype(np.uint32).view(np.float32).copy()).view(weight.shape)


def test_a_split_master_gives_the_forward_the_weights_an_fp32_master_gives(make_store):
    """Steps far smaller than a bf16 unit (Adam's first steps move each value by about the learning rate): the
    bf16 weights the forward reads are the fp32 master layout's, rounded from masters that agree, not weights
    a unit below them (a truncated top half moved every value stepped toward zero by a whole unit)."""
    models = {}
    for master in ("fp32", "split"):
        model = _model()
        opt = OffloadedAdamW(offload_model(model, make_store()), lr=1e-5, moments="fp32", master=master)
        _train(model, opt, 3)
        models[master] = model
    for (name, a), b in zip(models["fp32"].state_dict().items(), models["split"].state_dict().values()):
        same = (a == b).float().mean().item()
        assert same > 0.99, (name, same)


@pytest.mark.parametrize("step_in_backward", [False, True], ids=["after-backward", "in-backward"])
def test_two_threads_training_compressed_state_at_once_each_train_as_alone(make_store, step_in_backward):
    """Two models, each with its store, trained at the same time on two threads (their updates in the native
    kernel at once, after backward split over helper threads too): each ends bit-identical to its run alone."""
    def build(seed):  # on the main thread: torch's global generator is shared by threads
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(64, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 64),
                                   torch.nn.GELU(), torch.nn.Linear(64, 8)).to(torch.bfloat16)  # 2 chunks a weight

    def run(seed, results, store, model):
        opt = OffloadedAdamW(offload_model(model, store), lr=1e-3, moments="8bit", master="split",
                             step_in_backward=step_in_backward)
        losses = _train(model, opt, 4)
        opt.wait()
        results[seed] = (losses, {k: v.clone() for k, v in model.state_dict().items()},
                         {n: {w: t.clone() for w, t in e.items() if torch.is_tensor(t)}
                          for n, e in named_state(opt.state_dict(beyond_host_budget=True)).items()})
        opt.close()

    alone, together = {}, {}
    for seed in (1, 2):
        run(seed, alone, make_store(host_budget_bytes="8MiB"), build(seed))
    args = {seed: (seed, together, make_store(host_budget_bytes="8MiB"), build(seed)) for seed in (1, 2)}
    threads = [threading.Thread(target=run, args=args[seed]) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for seed in (1, 2):
        losses, weights, state = together[seed]
        assert losses == alone[seed][0]
        assert all(torch.equal(weights[k], alone[seed][1][k]) for k in weights)
        assert all(torch.equal(t, alone[seed][2][n][w]) for n, e in state.items() for w, t in e.items())


def test_two_processes_building_the_kernel_at_once_both_load_it(tmp_path):
    """A fresh kernel cache and two processes that build it at the same moment: each installs its build by an
    atomic rename, both run the update, with the same bits."""
    if L._native.kernel() is None:
        pytest.skip("no C compiler")
    script = (
        "import hashlib, sys, torch\n"
        "from tierstore.integrations import _layouts as L\n"
        "assert L._native.kernel() is not None\n"
        "n = 3 * L.CHUNK\n"
        "w = torch.linspace(-1, 1, n).bfloat16(); low = torch.zeros(n, dtype=torch.int16)\n"
        "m = torch.zeros(L.packed_size(n), dtype=torch.uint8); v = m.clone()\n"
        "L.compressed_update(moments='8bit', master='split', weight=w, low=low, exp_avg=m, exp_avg_sq=v,\n"
        "                    grad=torch.cos(torch.arange(n).float()), step=1.0,\n"
        "                    hyper=(1e-3, (0.9, 0.999), 1e-8, 0.0, False), seed=0, native=True)\n"
        "sys.stdout.write(hashlib.sha256(bytes(w.view(torch.int16).numpy()) + bytes(m.numpy())).hexdigest())\n")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0] == outs[1][0]
    built = list((tmp_path / "tierstore-kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"  # no temporary build left behind


@pytest.mark.parametrize("moments,master", [("8bit", "split"), ("bf16", "none")])
def test_a_compressed_step_stopped_by_an_io_error_finishes_as_an_unbroken_run(make_store, moments, master):
    """An I/O error in step() (a read of a compressed state tensor, or a write behind it), wherever it lands:
    step() called again finishes the step, updating only the parameters not yet updated, and the next step ends
    with the same bits (weights and stored state) as a run without the fault."""
    from _training import _tiny_pair

    from tierstore import TierIOError
    from tierstore.testing import FaultySyscalls

    def run(fail_after=None):
        _, model, data = _tiny_pair()
        model = model.to(torch.bfloat16)
        sysc = FaultySyscalls(None)
        store = make_store(host_budget_bytes="256KiB", device_budget_bytes="1MiB", syscalls=sysc)
        opt = OffloadedAdamW(offload_model(model, store), lr=1e-3, moments=moments, master=master,
                             speculate=False)  # step()'s updates, none in backward
        part_way = False
        for step in range(4):
            x, y = data.batch(step, 8)
            F.cross_entropy(model(x.to(torch.bfloat16)).float(), y).backward()
            if step == 2 and fail_after is not None:
                opt.wait()  # the last step's writes behind are done: the fault lands in this step's I/O
                sysc.fail_at = sysc.calls + fail_after
            try:
                opt.step()
            except TierIOError:
                part_way = part_way or opt._unfinished is not None
                opt.step()
            with contextlib.suppress(TierIOError):  # a write behind the step failed: its data stayed in memory
                opt.wait()
            opt.zero_grad()
        assert sysc.failed == (fail_after is not None)
        result = ({k: v.clone() for k, v in model.state_dict().items()},
                  {n: {w: t.clone() for w, t in e.items() if torch.is_tensor(t)}
                   for n, e in named_state(opt.state_dict(beyond_host_budget=True)).items()})
        opt.close()
        store.close()
        return result, part_way

    (weights, state), _ = run()
    part_ways = 0
    for tried, k in enumerate(range(1, 40, 3), 1):  # where a fault lands varies with timing
        (w, s), part_way = run(k)
        part_ways += part_way
        assert all(torch.equal(w[name], weights[name]) for name in weights), k
        assert all(torch.equal(t, state[n][key]) for n, e in s.items() for key, t in e.items()), k
        if part_ways >= 2 and tried >= 4:
            break
    assert part_ways >= 2  # faults landed part-way through the step, not only before its first update
