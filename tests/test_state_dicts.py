"""State dicts the ecosystem walks: torch's format, ``opt.state`` as torch's, copies mapped from files beyond the host
budget (see [Note: A whole state dict beyond the host budget]), torch.distributed.checkpoint as its users write it."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from _training import is_mapped, named_state
from conftest import child_script
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from tierstore.integrations import OffloadedAdamW, offload_model

import tierstore as ts

# a single process with no process group: torch.distributed.checkpoint says it assumes so, once a call
NO_GROUP = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _mlp(dtype=torch.float32, width=64, depth=12):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(depth)] + [torch.nn.Linear(width, 10)]
    return torch.nn.Sequential(*layers).to(dtype)


def _batch(step, width=64):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, width, generator=g), torch.randint(0, 10, (8,), generator=g)


def _train(model, opt, steps, *, start=0, clip=None):
    losses = []
    for step in range(start, start + steps):
        x, y = _batch(step)
        loss = F.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y)
        loss.backward()
        if clip is not None and isinstance(opt, OffloadedAdamW):
            opt.offloaded.clip_grad_norm_(clip)
        elif clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _offloaded(store, dtype=torch.float32, **opt_kw):
    model = _mlp(dtype)
    off = offload_model(model, store)
    return model, off, OffloadedAdamW(off, lr=1e-2, **opt_kw)


def _state_bytes(opt):
    return sum(opt.store.info(k)["nbytes"] for _, _, k in opt.state_tensors(all_params=True))


def test_state_dicts_beyond_the_host_budget_are_mapped_copies_of_the_same_values(make_store):
    store = make_store(host_budget_bytes="64KiB")
    model, off, opt = _offloaded(store)
    _train(model, opt, 2)
    assert _state_bytes(opt) > 4 * store.config.host_budget_bytes
    sd, whole = opt.state_dict(), opt.state_dict(beyond_host_budget=True)
    assert [list(e) for e in sd["state"].values()] == [list(e) for e in whole["state"].values()]
    for i, entry in sd["state"].items():
        for what, t in entry.items():
            assert torch.equal(t, whole["state"][i][what]), (i, what)
            assert is_mapped(t) == (what != "step") and not is_mapped(whole["state"][i][what]), (i, what)
    msd = model.state_dict()
    for name, t in msd.items():
        assert is_mapped(t) and torch.equal(t, off.read_param(name)), name
    # a write into a mapped copy stays in it, and the store is not changed by it
    before = off.read_param("0.weight")
    msd["0.weight"].add_(1)
    assert torch.equal(msd["0.weight"], before + 1) and torch.equal(off.read_param("0.weight"), before)
    assert store.memory()["host"]["peak_bytes"] <= store.config.host_budget_bytes
    assert not [n for n in os.listdir(store.swap_directory) if not n.startswith(("swap-", ".owner"))]  # no names


def test_state_dicts_within_the_host_budget_are_ordinary_copies(make_store):
    model, off, opt = _offloaded(make_store(host_budget_bytes="4MiB"))
    _train(model, opt, 1)
    assert not any(is_mapped(t) for e in opt.state_dict()["state"].values() for t in e.values())
    assert not any(is_mapped(t) for t in model.state_dict().values())


@pytest.mark.parametrize("saver", ["torch_save", "dcp", "accelerate", "torch_save --in-memory"])
def test_a_saver_walks_a_state_beyond_the_host_budget_in_no_more_anonymous_memory(tmp_path, saver):
    """In a fresh process, a state 9x the host budget: torch.save of both state dicts, torch.distributed.checkpoint's
    save and Accelerate's save_state, each then loaded into a fresh model, raise the memory the kernel cannot drop
    (RssAnon, sampled) by less than the budget; the same save of ordinary copies (``--in-memory``) raises it by the whole state, which this
    measure must show."""
    (tmp_path / "nvme").mkdir()
    (tmp_path / "out").mkdir()
    r = subprocess.run([sys.executable, child_script("state_dict_rss_child.py"), str(tmp_path / "nvme"),
                        str(tmp_path / "out"), *saver.split()], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["state_bytes"] > 8 * got["host_budget_bytes"]
    if saver.endswith("--in-memory"):
        assert got["anon_rise_bytes"] > 0.9 * got["state_bytes"], got
    else:
        assert got["anon_rise_bytes"] < got["host_budget_bytes"], got


def test_the_state_dict_is_torch_s_and_each_loads_into_the_other(make_store):
    """The format is torch.optim's (parameters by index, their names in ``param_names``): a state saved by
    OffloadedAdamW goes on in torch.optim.AdamW, and one saved by torch.optim.AdamW in OffloadedAdamW, bit for
    bit (fp32), each matched by index as torch matches it."""
    model, off, opt = _offloaded(make_store(host_budget_bytes="64KiB"))
    ref = _mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    assert _train(model, opt, 2, clip=0.5) == _train(ref, ref_opt, 2, clip=0.5)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert list(sd["state"]) == list(ref_sd["state"]) == list(range(len(list(model.parameters()))))
    assert [g["params"] for g in sd["param_groups"]] == [g["params"] for g in ref_sd["param_groups"]]
    assert sd["param_groups"][0]["param_names"] == [n for n, _ in model.named_parameters()]
    for i, entry in ref_sd["state"].items():
        assert entry.keys() == sd["state"][i].keys() and all(torch.equal(v, sd["state"][i][k]) for k, v in entry.items())

    # ours into torch's, torch's into ours: both go on as one run
    torch_side = _mlp()
    torch_side.load_state_dict(model.state_dict())
    torch_opt = torch.optim.AdamW(torch_side.parameters(), lr=1e-2, foreach=False)
    torch_opt.load_state_dict(sd)
    model2, off2, opt2 = _offloaded(make_store(host_budget_bytes="64KiB"))
    model2.load_state_dict(ref.state_dict())
    opt2.load_state_dict(ref_sd)
    expected = _train(ref, ref_opt, 2, start=2)
    assert _train(torch_side, torch_opt, 2, start=2) == expected == _train(model2, opt2, 2, start=2)
    for name, p in ref.named_parameters():
        assert torch.equal(off2.read_param(name), p) and torch.equal(dict(torch_side.named_parameters())[name], p)

    # groups that do not match are refused, saying so; state dicts keyed by name (earlier versions) still load
    wrong = {"state": {}, "param_groups": [{**sd["param_groups"][0], "params": [0, 1]}]}
    with pytest.raises(ValueError, match="do not hold the same parameters"):
        opt2.load_state_dict({k: v for k, v in wrong.items()})
    renamed = copy.deepcopy(sd)
    renamed["param_groups"][0]["param_names"][0] = "other.weight"
    with pytest.raises(ValueError, match=r"holds \['other.weight'\]"):
        opt2.load_state_dict(renamed)
    by_name = {"state": named_state(sd), "state_layout": sd["state_layout"],
               "param_groups": [{**g, "params": g["param_names"]} for g in sd["param_groups"]]}
    opt2.load_state_dict(by_name)
    assert named_state(opt2.state_dict()).keys() == named_state(sd).keys()


def test_opt_state_is_keyed_by_parameter_and_read_from_the_store(make_store):
    model, off, opt = _offloaded(make_store(host_budget_bytes="64KiB"))
    params = list(model.parameters())
    assert len(opt.state) == len(params) and list(opt.state) == params and opt.state  # from creation on
    assert float(opt.state[params[0]]["step"]) == 0 and not opt.state[params[0]]["exp_avg"].any()
    _train(model, opt, 2)
    sd = opt.state_dict()
    for i, p in enumerate(params):
        assert set(opt.state[p]) == set(sd["state"][i])
        assert all(torch.equal(opt.state[p][k], v) for k, v in sd["state"][i].items())
    with pytest.raises(TypeError, match="load a whole state with opt.load_state_dict"):
        opt.state[params[0]]["exp_avg"] = torch.zeros(1)
    with pytest.raises(KeyError):
        opt.state[torch.nn.Parameter(torch.zeros(1))]
    off.remove(keep_values=False)
    assert len(opt.state) == 0


@NO_GROUP
@pytest.mark.parametrize("layout", ["fp32", "bf16-8bit-split"])
def test_dcp_save_and_load_resume_bit_identically_and_take_no_step(make_store, tmp_path, layout):
    """torch.distributed.checkpoint as its docs write it (``get_state_dict``, ``dcp.save``; in a fresh run
    ``get_state_dict``, ``dcp.load``, ``set_state_dict``), with the state beyond the host budget: the resumed run
    goes on as the uninterrupted one, and taking a state dict of a fresh optimizer steps nothing (DCP steps with
    lr=0 an optimizer whose ``state`` is empty)."""
    dtype, kw = (torch.float32, {}) if layout == "fp32" else (torch.bfloat16, {"moments": "8bit", "master": "split"})
    budget = "64KiB"
    model, off, opt = _offloaded(make_store(host_budget_bytes=budget), dtype, **kw)
    _train(model, opt, 2, clip=0.1)
    msd, osd = get_state_dict(model, opt)
    assert all(is_mapped(t) for t in msd.values())
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ckpt"))
    del msd, osd
    expected = _train(model, opt, 2, start=2, clip=0.1)
    final = {name: off.read_param(name) for name, _ in model.named_parameters()}

    model2, off2, opt2 = _offloaded(make_store(host_budget_bytes=budget), dtype, **kw)
    fresh = {name: off2.read_param(name) for name, _ in model2.named_parameters()}
    msd, osd = get_state_dict(model2, opt2)
    assert opt2.steps == {} and all(p.grad is None for p in model2.parameters())
    assert all(torch.equal(off2.read_param(n), v) for n, v in fresh.items())  # no lr=0 step, no zero gradients
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ckpt"))
    set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd)
    del msd, osd
    assert opt2.steps == {n: 2.0 for n, _ in model2.named_parameters()}
    assert _train(model2, opt2, 2, start=2, clip=0.1) == expected
    for name, value in final.items():
        assert torch.equal(off2.read_param(name), value), name
    assert named_state(opt2.state_dict()).keys() == named_state(opt.state_dict()).keys()
    for name, entry in named_state(opt.state_dict()).items():
        assert all(torch.equal(v, named_state(opt2.state_dict())[name][k]) for k, v in entry.items()), name


def test_a_mapped_state_dict_needs_room_on_the_drive(make_store, monkeypatch):
    model, off, opt = _offloaded(make_store(host_budget_bytes="64KiB"))
    engine = opt.store._state.engine
    monkeypatch.setattr(engine, "_drive_free_bytes", lambda: 1 << 20)
    with pytest.raises(ts.StoreFullError, match="a mapped copy of tensor .* does not fit under nvme_path.*"
                                                "nvme_reserve_bytes"):
        opt.state_dict()
    monkeypatch.undo()
    assert len(opt.state_dict()["state"]) == len(list(model.parameters()))


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_accelerate_saves_and_resumes_bit_identically(make_store, tmp_path):
    """Accelerate as its docs write it (``prepare``, ``accumulate``, ``clip_grad_norm_``, ``save_state``,
    ``load_state`` with the optimizer's file mapped, ``save_model``), the state beyond the host budget: the resumed
    run's losses and weights are the uninterrupted run's, and the saved weights are the model's."""
    accelerate = pytest.importorskip("accelerate")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from accelerate.state import AcceleratorState, GradientState

    batches = [_batch(i) for i in range(8)]

    def run(steps, *, save=None, load=None):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        model, off, ours = _offloaded(make_store(host_budget_bytes="64KiB"))
        accelerator = accelerate.Accelerator(gradient_accumulation_steps=2, cpu=True)
        model, opt, loader = accelerator.prepare(model, ours, torch.utils.data.DataLoader(batches, batch_size=None))
        if load is not None:
            accelerator.load_state(load, load_kwargs={"mmap": True})
        losses = []
        for i, (x, y) in enumerate(loader):
            if i < steps[0]:
                continue
            if i == steps[1]:
                break
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.1)
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
        if save is not None:
            assert _state_bytes(ours) > 4 * ours.store.config.host_budget_bytes
            accelerator.save_state(save)
            accelerator.save_model(model, save + "-model")  # the weights alone, as safetensors
            saved = safetensors_torch.load_file(os.path.join(save + "-model", "model.safetensors"))
            assert saved.keys() == {n for n, _ in model.named_parameters()}
            assert all(torch.equal(v, off.read_param(n)) for n, v in saved.items())
        return losses, {name: off.read_param(name) for name, _ in model.named_parameters()}

    whole, final = run((0, 8))
    first, _ = run((0, 4), save=str(tmp_path / "acc"))
    second, resumed = run((4, 8), load=str(tmp_path / "acc"))
    assert first + second == whole
    assert all(torch.equal(resumed[n], v) for n, v in final.items())


def _lightning(root, *args):
    r = subprocess.run([sys.executable, child_script("lightning_child.py"), str(root), *args], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_lightning_checkpoints_and_resumes_as_plain_lightning_does_within_the_budget(tmp_path):
    """PyTorch Lightning as its users write it (the optimizer from configure_optimizers, gradient_clip_val,
    accumulate_grad_batches, ModelCheckpoint, ckpt_path=), the state 12x the host budget, with MappedCheckpointIO:
    the resumed run ends where the uninterrupted one does, which is where plain Lightning with torch.optim.AdamW
    ends; saving raises the anonymous RSS by less than the host budget, restoring by less than a quarter of the
    state. Lightning's own writer, for comparison, holds the whole checkpoint (the measure must show it)."""
    pytest.importorskip("pytorch_lightning")
    (tmp_path / "a" / "nvme").mkdir(parents=True)
    (tmp_path / "b" / "nvme").mkdir(parents=True)
    whole, plain = _lightning(tmp_path / "a", "whole"), _lightning(tmp_path / "a", "whole", "--plain")
    first, resumed = _lightning(tmp_path / "a", "first"), _lightning(tmp_path / "a", "resume")
    assert whole["losses"] == plain["losses"] == first["losses"] + resumed["losses"]
    assert whole["weights"] == plain["weights"] == resumed["weights"]
    budget, state = first["host_budget_bytes"], first["state_bytes"]
    assert state > 8 * budget
    assert first["save_rise_bytes"] and max(first["save_rise_bytes"]) < budget, first
    assert resumed["load_rise_bytes"] and max(resumed["load_rise_bytes"]) < state / 4, resumed
    theirs = _lightning(tmp_path / "b", "first", "--default-io")
    assert theirs["losses"] == first["losses"] and max(theirs["save_rise_bytes"]) > state / 2, theirs


def test_a_load_gives_back_the_pages_of_a_checkpoint_mapped_from_its_file(make_store, tmp_path):
    """torch.load(mmap=True), then model.load_state_dict and opt.load_state_dict: once each tensor is in the store,
    the pages the load read of the checkpoint's file leave the RSS (see [Note: Loaded pages given back])."""
    from test_mapped import _resident_bytes

    model, off, opt = _offloaded(make_store(host_budget_bytes="64KiB"))
    _train(model, opt, 2)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    size = (tmp_path / "ckpt.pt").stat().st_size
    model2, off2, opt2 = _offloaded(make_store(host_budget_bytes="64KiB"))
    ckpt = torch.load(tmp_path / "ckpt.pt", mmap=True, weights_only=True)
    some = ckpt["optimizer"]["state"][0]["exp_avg"]
    for t in [*ckpt["model"].values(), *(v for e in ckpt["optimizer"]["state"].values() for v in e.values())]:
        t.sum()  # every page read, as the load reads them
    assert _resident_bytes(some) > 0.9 * size
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    # what stays: the pages a tensor shares with another or with the file's headers (tiny tensors here)
    assert _resident_bytes(some) < size // 2, (_resident_bytes(some), size)
    assert _train(model2, opt2, 1, start=2) == _train(model, opt, 1, start=2)  # the values stayed


def test_a_model_given_its_own_values_keeps_its_masters(make_store):
    """``model.load_state_dict(model.state_dict())`` changes nothing, a bf16 model's split masters included (made
    again from the weights, their low halves would be lost): the run goes on as if it had not been called."""
    kw = {"moments": "8bit", "master": "split"}
    model, off, opt = _offloaded(make_store(host_budget_bytes="64KiB"), torch.bfloat16, **kw)
    twin, twin_off, twin_opt = _offloaded(make_store(host_budget_bytes="64KiB"), torch.bfloat16, **kw)
    assert _train(model, opt, 2) == _train(twin, twin_opt, 2)
    model.load_state_dict(model.state_dict())
    assert _train(model, opt, 2, start=2) == _train(twin, twin_opt, 2, start=2)
    assert all(torch.equal(off.read_param(n), twin_off.read_param(n)) for n, _ in model.named_parameters())


def test_under_offload_fsdp_state_dicts_hold_dtensors_and_a_load_writes_the_shards(nvme_dir):
    """One gloo rank: model.state_dict() gives each shard as a DTensor whose local tensor is read from the store
    (the parameter's own has no memory between all-gathers: reading it crashed the process before), torch.save
    writes it; opt.state_dict() gives each piece of state as a DTensor too, as torch's AdamW under FSDP2 does; and
    model.load_state_dict() writes each shard into the store (see [Note: Loading into the shards]); training goes
    on."""
    import io
    import socket

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from tierstore.integrations.fsdp import offload_fsdp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = _mlp()
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        store = ts.TierStore(nvme_path=nvme_dir, host_budget_bytes="64KiB")  # gloo's sockets outlive the test
        off = offload_fsdp(model, store)
        opt = OffloadedAdamW(off, lr=1e-2)
        _train(model, opt, 1)
        sd = model.state_dict()
        assert list(sd) == [n for n, _ in model.named_parameters()]
        for name, value in sd.items():
            assert isinstance(value, DTensor) and torch.equal(value.to_local(), off.read_param(name)), name
            assert is_mapped(value.to_local()), name  # beyond the host budget
        torch.save(sd, io.BytesIO())
        osd = opt.state_dict()
        assert all(isinstance(v, DTensor) and v.placements == model[0].weight.placements
                   for entry in osd["state"].values() for what, v in entry.items() if what != "step")
        doubled = {name: value * 2 for name, value in sd.items()}
        model.load_state_dict(doubled)
        for name, value in doubled.items():
            assert torch.equal(off.read_param(name), value.to_local()), name
        assert all(p.to_local().untyped_storage().nbytes() == 0 for p in model.parameters())  # freed again
        assert len(_train(model, opt, 1, start=1)) == 1
        off.remove()
        store.close()
    finally:
        dist.destroy_process_group()
