"""Reads and writes of an offloaded parameter: kept where the resident model keeps them, refused where they
would be lost or read no value."""

import copy
import subprocess
import sys

import pytest
import torch
from conftest import child_script
from _models import ClippedLinear, Momentum, train_beside_resident
from _training import _assert_same_parameters, _tiny_pair
from tierstore.integrations.offload import OffloadedParameterError, offload_model


def test_a_torch_optimizer_over_offloaded_parameters_is_refused(make_store):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    offload_model(model, make_store())
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    with pytest.raises(OffloadedParameterError, match="0.weight.*OffloadedAdamW"):
        opt.step()


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")  # raised by torch importing dynamo
def test_torch_compile_is_refused(make_store):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    offload_model(model, make_store())
    with pytest.raises(OffloadedParameterError, match="Compile its units instead"):
        torch.compile(model)(torch.randn(2, 8))  # the whole model: see tests/test_offload_compile.py


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")  # torch.jit.script is deprecated
def test_a_torchscript_module_is_refused_before_anything_moves(make_store):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.jit.script(torch.nn.Linear(8, 2)))
    before = [p.detach().clone() for p in model.parameters()]
    store = make_store()
    with pytest.raises(TypeError, match="'1' is a TorchScript module"):
        offload_model(model, store)
    assert store.keys() == [] and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    offload_model(model[0], store)  # its eager part offloads as any module


def test_data_parallel_wrapping_is_refused_with_what_to_use(tmp_path):
    """DistributedDataParallel broadcasts every parameter at construction: refused, saying to use FSDP2 (in a
    process of its own: a gloo group leaves a descriptor open)."""
    out = subprocess.run([sys.executable, child_script("ddp_child.py"), str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.startswith("OffloadedParameterError DistributedDataParallel cannot wrap a model offloaded "
                                 "with offload_model: "), out.stdout + out.stderr
    assert "offload_fsdp instead" in out.stdout


def test_only_a_wrapper_gets_the_wrapper_hint(make_store):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    offload_model(model, make_store())
    with pytest.raises(OffloadedParameterError, match=r"^TensorBase.sum read"):
        model[0].weight.sum()


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
    lambda ema, p: p.detach().clone(),
    lambda ema, p: p.data.clone(),
], ids=["data-add_", "detach-sub_", "foreach-add_", "foreach-lerp_", "add-out", "equal", "to-cpu", "detach-clone",
        "data-clone"])
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


@pytest.mark.parametrize("assign", [False, True], ids=["in-place", "assign-data"])
@pytest.mark.parametrize("in_backward", [False, True], ids=["step", "in-backward"])
def test_a_write_in_forward_is_kept_as_the_resident_model_keeps_it(make_store, in_backward, assign, monkeypatch):
    monkeypatch.setattr(ClippedLinear, "assign", assign)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[ClippedLinear(96, 96) for _ in range(6)], torch.nn.Linear(96, 4))
    with torch.no_grad():
        for m in ref[:6]:
            m.weight.mul_(2)  # some weights beyond the clip
    model = copy.deepcopy(ref)
    store = make_store(host_budget_bytes="192KiB", device_budget_bytes="64KiB")  # the weights cycle through
    opt = train_beside_resident(ref, model, store, width=96, step_in_backward=in_backward)
    with torch.no_grad():
        x = torch.randn(4, 96)
        assert torch.equal(model(x), ref(x))
    _assert_same_parameters(model, ref)
    assert store.stats_dict()["bytes_read_nvme"] > 0
    opt.close()


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
    ref = Momentum(how)
    model = copy.deepcopy(ref)
    start = ref.k[0].weight.detach().clone()
    store = make_store(host_budget_bytes="256KiB", device_budget_bytes="192KiB")
    opt = train_beside_resident(ref, model, store, width=64, step_in_backward=in_backward, compute_tier=compute)
    assert not torch.equal(model.state_dict()["k.0.weight"], start), "the key encoder never moved"
    assert store.stats_dict()["bytes_read_nvme"] > 0
    opt.close()
