"""torch.compile of an offloaded model's units, as FSDP2 users compile each block: compiled offloaded training
equals compiled resident training, bit for bit, with no recompilation after the first step."""

import copy

import pytest
import torch
import torch.nn.functional as F
from _training import _assert_same_parameters
from tierstore.integrations import OffloadedAdamW, OffloadedParameterError, offload_model
from tierstore.tools.vit import PRESETS, Block, SyntheticImages, ViT

@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile_blocks(model, how):
    """Compile each ViT block: in place (``block.compile()``) or wrapped (``torch.compile(block)``)."""
    for i, block in enumerate(model.blocks):
        if how == "in place":
            block.compile()
        else:
            model.blocks[i] = torch.compile(block)


def _train_both(ref, model, off, loss_of, *, steps=4, step_in_backward=False, lr=1e-3):
    """Train ``ref`` with torch's AdamW and the offloaded ``model`` side by side on ``loss_of(module, step)``:
    equal losses each step, dynamo compiled something and nothing after the second step, equal parameters."""
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01, foreach=False)
    opt = OffloadedAdamW(off, lr=lr, weight_decay=0.01, step_in_backward=step_in_backward)
    graphs = []
    try:
        for step in range(steps):
            losses = []
            for m, o in ((ref, ref_opt), (model, opt)):
                torch.manual_seed(step)  # dropout (GPT-2's): the same masks on both sides
                loss = loss_of(m, step)
                loss.backward()
                o.step()
                o.zero_grad()
                losses.append(loss.item())
            assert losses[0] == losses[1], step
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    finally:
        opt.close()
    assert graphs[0] > 0 and graphs[-1] == graphs[1], graphs  # compiled, and nothing after the first steps
    _assert_same_parameters(model, ref)


@pytest.mark.parametrize("how, when, in_backward", [
    ("in place", "before", False), ("wrapped", "before", True), ("in place", "after", True)])
def test_compiled_blocks_train_as_the_compiled_resident_model(make_store, how, when, in_backward):
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    ref = ViT(cfg)
    model = copy.deepcopy(ref)
    _compile_blocks(ref, how)
    if when == "before":
        _compile_blocks(model, how)
        off = offload_model(model, make_store(host_budget_bytes="2MiB"))
    else:
        off = offload_model(model, make_store(host_budget_bytes="2MiB"), units=[Block])
        _compile_blocks(model, how)
    blocks = [name for name in off.units() if name.startswith("blocks.")]
    assert len(blocks) == cfg.depth  # each compiled block is one unit, fetched whole
    data = SyntheticImages(cfg)

    def loss_of(m, step):
        x, y = data.batch(step, 8)
        return F.cross_entropy(m(x), y)

    _train_both(ref, model, off, loss_of, step_in_backward=in_backward)


@pytest.mark.parametrize("arch, in_backward", [("llama", False), ("gpt2", True)])
def test_compiled_decoder_layers_of_transformers_models_train_as_the_compiled_resident_model(make_store, arch,
                                                                                             in_backward):
    """Each decoder layer compiled in place, as per-block compile under FSDP2 does it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        ref = transformers.LlamaForCausalLM(cfg)
    else:
        ref = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4,
                                                                   n_positions=64))
    model = copy.deepcopy(ref)
    for m in (ref, model):
        for layer in (m.model.layers if arch == "llama" else m.transformer.h):
            layer.compile()
    off = offload_model(model, make_store(host_budget_bytes="2MiB"))

    def loss_of(m, step):
        ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(step))
        return m(input_ids=ids, labels=ids).loss

    _train_both(ref, model, off, loss_of, step_in_backward=in_backward)


@pytest.mark.parametrize("in_backward", [False, True])
def test_compiled_encoder_layers_train_and_evaluate_as_the_compiled_resident_model(make_store, in_backward):
    """nn.TransformerEncoderLayer, whose fused inference path refuses hooks (eager, offload_model wraps its
    forward instead): compiled in place before offload_model, its compiled call is wrapped instead."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    ref = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    model = copy.deepcopy(ref)
    for m in (ref, model):
        for block in m.layers:
            block.compile()
    off = offload_model(model, make_store(host_budget_bytes="2MiB"))

    def loss_of(m, step):
        return m(torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(step))).pow(2).mean()

    _train_both(ref, model, off, loss_of, step_in_backward=in_backward, lr=1e-2)
    ref.eval()
    model.eval()
    with torch.no_grad():
        x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(9))
        assert torch.equal(model(x), ref(x))


def test_an_encoder_layer_compiled_after_offload_is_refused(make_store):
    """Its forward was wrapped when offload_model found it eager; compiled so, it rounds otherwise than the
    compiled resident layer on some torch versions: refused, saying to compile it first."""
    model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2,
                                        enable_nested_tensor=False)
    off = offload_model(model, make_store(host_budget_bytes="2MiB"))
    model.layers[0].compile()
    with pytest.raises(OffloadedParameterError, match="Compile it before offload_model"):
        model(torch.randn(2, 5, 16))
    assert not any(sp.holds for sp in off.params.values())
    assert off.pass_state.forward_thread is None  # no pass left counted: another thread may run the model


def test_a_unit_compiled_again_after_offload_is_fetched_around_its_new_compiled_call(make_store):
    torch.manual_seed(0)
    ref = ViT(PRESETS["tiny"])
    model = copy.deepcopy(ref)
    for m in (ref, model):
        _compile_blocks(m, "in place")
    off = offload_model(model, make_store(host_budget_bytes="2MiB"))
    _compile_blocks(model, "in place")  # a new compiled call, which offload_model never saw
    x, _ = SyntheticImages(PRESETS["tiny"]).batch(0, 2)
    assert torch.equal(model(x), ref(x))
    assert all(off._units[f"blocks.{i}"].around_compiled_call() for i in range(PRESETS["tiny"].depth))


def test_a_whole_compiled_model_is_refused_saying_to_compile_its_units(make_store):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with pytest.raises(OffloadedParameterError, match="Compile its units instead"):
        offload_model(torch.compile(model), make_store())
    model.compile()
    with pytest.raises(OffloadedParameterError, match="Compile its units instead"):
        offload_model(model, make_store())


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace:UserWarning",
                            "ignore:module forward hook with ``always_call=True``:UserWarning")
def test_a_model_compiled_after_offload_is_refused(make_store):
    """Dynamo traces the model's own hooks then, and warns of what it cannot trace in them; the refusal is ours."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    offload_model(model, make_store())
    model.compile()
    with pytest.raises(OffloadedParameterError, match="Compile its units instead"):
        model(torch.randn(2, 8))


def test_a_block_of_units_compiled_after_offload_says_to_make_it_one_unit(make_store):
    torch.manual_seed(0)
    model = ViT(PRESETS["tiny"])
    off = offload_model(model, make_store(host_budget_bytes="2MiB"))  # each Linear its own unit
    model.blocks[0].compile()
    x, _ = SyntheticImages(PRESETS["tiny"]).batch(0, 2)
    with pytest.raises(OffloadedParameterError, match=r"units=\[Block\]"):
        model(x)
    assert not any(sp.holds for sp in off.params.values())


def test_bench_step_compile_tiny(tmp_path, capsys):
    import json

    from tierstore.tools import cli

    out = tmp_path / "compile.json"
    assert cli.main(["bench", "step", "--compile", "--preset", "tiny", "--batch-size", "4", "--rounds", "1",
                     "--nvme-path", str(tmp_path), "--host-budget", "1MiB", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert list(res["setups"]) == ["resident eager", "resident compiled", "offloaded eager", "offloaded compiled"]
    for name, row in res["setups"].items():
        assert row["step_s"] > 0 and row["warmup_s"] > 0
        assert row["speedup"] == row["eager_step_s"] / row["step_s"]
        assert row["eager_step_s"] == res["setups"][name.replace("compiled", "eager")]["step_s"]
    printed = capsys.readouterr().out
    assert "bench step --compile: ViT-tiny" in printed and "offloaded compiled" in printed
