"""Offloaded training is bit-identical to resident training on models tierstore did not write.

transformers' models are built from tiny configs with random weights (no downloads); the encoder
block is built on ``nn.MultiheadAttention`` exactly as torchvision's ViT builds it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from tierstore import TierBudgetError
from tierstore.integrations.offload import offload_model
from tierstore.integrations.optim import OffloadedAdamW

pytest.importorskip("transformers")
# torch says so whenever nn.TransformerEncoder takes its nested-tensor path (the resident model too)
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")

from conformance import CASES, _gpt2, _seeded, _tokens, check_bit_identical  # noqa: E402


@pytest.mark.parametrize("name", list(CASES))
def test_bit_identical(name, nvme_dir):
    check_bit_identical(CASES[name], nvme_dir)


@pytest.mark.parametrize("name", [n for n in ("llama-tied", "gpt2", "t5", "mixtral") if n in CASES])
def test_accumulation_and_clipping_with_gradients_on_the_drive(name, nvme_dir):
    """Trainer's loop (two micro-batches a step, torch's clip_grad_norm_ over model.parameters()) at a host budget
    a sixth of the state: kept gradients go to the drive and come back, and every figure is the resident one."""
    seen = check_bit_identical(CASES[name], nvme_dir, micro_batches=2, clip=0.5, host_budget_fraction=1 / 6)
    assert seen["spilled"] > 0, "no gradient reached the drive: the test would prove nothing"


def test_mha_without_default_units_learns_out_proj(nvme_dir):
    """With no unit given, MultiheadAttention's read of out_proj's weight (it never calls out_proj) is fetched
    on demand in the first step and learned: its unit then fetches it ahead."""
    seen = check_bit_identical(CASES["mha-encoder"], nvme_dir, units=())
    attn = "layers.encoder_layer_0.self_attention"
    assert f"{attn}.out_proj.weight" in seen["units"][attn] and f"{attn}.out_proj.bias" in seen["units"][attn]
    assert seen["off"].stats.reads_learned >= 4


@pytest.mark.parametrize("name", ["llama-untied", "falcon", "gemma2", "longformer", "swinv2", "mobilevit"])
def test_step_in_backward(name, nvme_dir):
    check_bit_identical(CASES[name], nvme_dir, step_in_backward=True)


FUSED_IN_BACKWARD = ("llama-untied", "bert", "hf-vit", "torch-recurrent", "channels-last-convnet",
                     "timm-vit", "torchvision-convnext")  # the last two where installed


@pytest.mark.parametrize("name", list(CASES))
def test_fused_adamw(name, nvme_dir):
    """OffloadedAdamW(fused=True) against torch.optim.AdamW(fused=True): torch's fused kernel, bit for bit, the moments
    of channels_last weights too (see [Note: The fused kernel and layouts])."""
    check_bit_identical(CASES[name], nvme_dir, adamw_flags={"fused": True})


@pytest.mark.parametrize("name", [n for n in FUSED_IN_BACKWARD if n in CASES])
def test_fused_adamw_in_backward(name, nvme_dir):
    check_bit_identical(CASES[name], nvme_dir, step_in_backward=True, adamw_flags={"fused": True})


def _checkpointed(reentrant: bool):
    def prepare(model):
        kwargs = {"use_reentrant": reentrant}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return prepare


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(nvme_dir, reentrant):
    check_bit_identical(CASES["llama-tied"], nvme_dir, prepare=_checkpointed(reentrant))


def test_a_checkpointed_segment_beyond_the_budget_says_so(nvme_dir):
    """HF Swin checkpoints a whole stage: rerun in backward, the stage's parameters are all held until their
    gradients are complete. Beyond a third of the state that fits and trains as the resident model does; at a
    third, the budget error says why backward holds them."""
    check_bit_identical(CASES["hf-swin"], nvme_dir, prepare=_checkpointed(False), host_budget_fraction=1 / 2)
    with pytest.raises(TierBudgetError, match="a forward rerun there .activation checkpointing. holds its whole "
                                              "segment's parameters"):
        check_bit_identical(CASES["hf-swin"], nvme_dir, prepare=_checkpointed(False))


def test_generate_gives_the_resident_tokens(make_store):
    torch.manual_seed(0)
    ref = _gpt2().eval()
    model = _gpt2().eval()
    model.load_state_dict(ref.state_dict())
    offload_model(model, make_store(host_budget_bytes="256KiB"))
    ids = _tokens(0, batch=1, length=5)
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


@pytest.mark.parametrize("name", ["llama-tied", "wav2vec2", "clip", "xlnet"])
def test_built_on_meta_every_tensor_is_written_or_it_is_an_error(name, make_store):
    """``offload_model(model, store, init_fn=model._init_weights)`` of a model built on meta: every parameter
    and buffer written (wav2vec2's weight-normed positional convolution trained on NaN before), its buffers
    equal to eager construction's and training finite; CLIP's ``logit_scale``, which ``_init_weights`` does not
    write, is an error naming it (it trained on whatever the memory held) until init_fn writes it too. XLNet
    makes its attention weights with ``torch.FloatTensor(size)``, real even on meta: they trained on
    uninitialized memory (NaN losses); they are an error until ``real_parameters="initialize"``."""
    case = CASES[name]
    with torch.device("meta"):
        model = case.build()
    store = make_store(host_budget_bytes="4MiB")
    if name == "xlnet":
        with pytest.raises(ValueError, match=r"on the meta device but 19 of its parameters are not: "
                                             r"transformer.mask_emb, transformer.layer.0.rel_attn.q"):
            offload_model(model, store, init_fn=model._init_weights)
        assert store.keys() == []
        off = offload_model(model, store, init_fn=model._init_weights, real_parameters="initialize")
    elif name == "clip":
        with pytest.raises(ValueError, match=r"init_fn\(<root>\) \(CLIPModel\) left logit_scale .* unwritten"):
            offload_model(model, store, init_fn=model._init_weights)
        assert store.keys() == [] and model.logit_scale.is_meta

        def init(module):
            model._init_weights(module)
            if module is model:
                torch.nn.init.constant_(module.logit_scale, model.config.logit_scale_init_value)

        off = offload_model(model, store, init_fn=init)
    else:
        off = offload_model(model, store, init_fn=model._init_weights)
    eager = _seeded(case.build, 0)
    buffers = dict(model.named_buffers())
    assert all(torch.equal(b, buffers[n]) for n, b in eager.named_buffers())
    opt = OffloadedAdamW(off, lr=1e-3)
    try:
        for step in range(2):
            loss = case.loss(model, case.batch(step))
            assert torch.isfinite(loss), (step, loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert all(torch.isfinite(t).all() for t in model.state_dict().values())
    finally:
        opt.close()


@pytest.mark.parametrize("name", ["llama-tied", "mha-encoder"])
def test_under_a_placement(name, nvme_dir):
    """Six steps, two thirds of the state as host budget: a placement is planned from the trace, tried, and kept
    or dropped; every figure equal to resident training throughout."""
    seen = check_bit_identical(CASES[name], nvme_dir, steps=6, step_in_backward=True, host_budget_fraction=2 / 3)
    assert seen["off"].placement_verdict is not None


@pytest.mark.parametrize("name", ["mha-encoder", "torch-encoder"])
def test_inference_takes_the_resident_fast_path(name, make_store, monkeypatch):
    """In eval under no_grad, ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` run fused kernels only
    when no parameter has a ``__torch_function__`` (and the layer has no forward hook), and the fused kernels round
    differently (and give zeros at padding): the offloaded model takes the path the resident one takes."""
    calls: list[str] = []
    for fused in ("_native_multi_head_attention", "_transformer_encoder_layer_fwd"):
        kernel = getattr(torch, fused)
        monkeypatch.setattr(torch, fused, lambda *a, _k=kernel, _n=fused, **kw: (calls.append(_n), _k(*a, **kw))[1])
    ref = _seeded(CASES[name].build, 0).eval()
    model = _seeded(CASES[name].build, 0).eval()
    off = offload_model(model, make_store(host_budget_bytes="256KiB"))
    for step in range(8):
        ids = _tokens(step, batch=3)
        with torch.no_grad():
            calls.clear()
            want = ref(ids)
            resident_calls = list(calls)
            calls.clear()
            got = model(ids)
        assert resident_calls, "the resident model took no fused kernel: the test would prove nothing"
        assert calls == resident_calls
        assert torch.equal(got, want), f"batch {step}: max difference {(got - want).abs().max()}"
    assert off.params and all(type(sp.param) is not nn.Parameter for sp in off.params.values()), \
        "outside a forward an offloaded parameter is an offloaded one again"


def test_inference_mode_gives_the_resident_values(make_store):
    """Under torch.inference_mode() a held copy made there would be an inference tensor, which torch computes with
    differently (attention with dropout rounds otherwise): held copies are ordinary tensors there too."""
    ref = _seeded(CASES["mha-encoder"].build, 0)
    model = _seeded(CASES["mha-encoder"].build, 0)
    offload_model(model, make_store(host_budget_bytes="256KiB"))
    attn = model.layers.encoder_layer_0.self_attention
    seen = []
    attn.register_forward_pre_hook(lambda module, args: seen.append(module.in_proj_weight.is_inference()))
    for training in (True, False):
        ref.train(training)
        model.train(training)
        for step in range(8):
            ids = _tokens(step, batch=3)
            with torch.inference_mode():
                torch.manual_seed(step)  # the same dropout masks
                want = ref(ids)
                torch.manual_seed(step)
                got = model(ids)
            assert torch.equal(got, want), f"training={training}, batch {step}: {(got - want).abs().max()}"
    assert seen and not any(seen)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = _tokens(i, batch=1, length=8)[0]
        return {"input_ids": ids, "labels": ids}


def _trainer_run(tmp_path, optimizer_for, *, steps: int = 4, resume: bool = False) -> tuple[dict, list]:
    """transformers' Trainer (its own loop: gradient accumulation, clipping to norm 1, a linear schedule, closure
    steps through accelerate; a checkpoint every 2 steps, resumed from with ``resume``) over GPT-2; the state
    dict and the logged losses and gradient norms."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model = _seeded(_gpt2, 0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=steps,
        learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="steps", save_steps=2, use_cpu=True,
        seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), optimizers=(optimizer_for(model),
                                                                                               None))
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2") if resume else None)
    logged = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    return {k: v.clone() for k, v in model.state_dict().items()}, logged


def test_transformers_trainer_trains_the_offloaded_model_as_the_resident_one(make_store, tmp_path):
    from tierstore.integrations import OffloadedAdamW

    ref = _trainer_run(tmp_path / "ref", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False))
    store = make_store(host_budget_bytes="1MiB", device_budget_bytes="512KiB")
    got = _trainer_run(tmp_path / "off", lambda m: OffloadedAdamW(offload_model(m, store), lr=1e-2))
    assert len(got[1]) == 4 and got[1] == ref[1]
    assert all(torch.equal(got[0][k], v) for k, v in ref[0].items())
    assert store.stats_dict()["bytes_read_nvme"] > 0
    # Resumed from the step-2 checkpoint: the Trainer loads the model's state dict, then the optimizer's state,
    # into an optimizer that exists; the rest of the run is the resident resumed run's
    ref = _trainer_run(tmp_path / "ref", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False),
                       steps=6, resume=True)
    got = _trainer_run(tmp_path / "off", lambda m: OffloadedAdamW(
        offload_model(m, make_store(host_budget_bytes="1MiB", device_budget_bytes="512KiB")), lr=1e-2),
        steps=6, resume=True)
    assert len(got[1]) == 6 and got[1] == ref[1]  # the 2 logged up to the checkpoint, then 4 more
    assert all(torch.equal(got[0][k], v) for k, v in ref[0].items())


@pytest.mark.parametrize("name,dtype,moments,master,in_backward", [
    ("llama-tied", torch.bfloat16, "8bit", "split", False),
    ("gpt2", torch.bfloat16, "8bit", "none", True),
    ("t5", torch.bfloat16, "bf16", "split", True),
    ("mixtral", torch.bfloat16, "8bit", "split", False),
    ("hf-vit", torch.float32, "8bit", "fp32", True),
    ("torch-recurrent", torch.float32, "bf16", "fp32", False),
])
def test_compressed_state_trains_the_same_streamed_from_the_drive_as_in_memory(name, dtype, moments, master,
                                                                               in_backward, nvme_dir):
    """Each compressed layout, on models tierstore did not write, stepping after backward and in it: streamed
    from the drive under a third of the state, the same bits as with every tensor in memory."""
    from conformance import check_compressed_streamed_as_in_memory

    check_compressed_streamed_as_in_memory(CASES[name], nvme_dir, moments=moments, master=master, dtype=dtype,
                                           step_in_backward=in_backward)


@pytest.mark.parametrize("name", ["llama-untied", "bert"])
def test_compressed_state_with_accumulation_and_clipping(name, nvme_dir):
    """Trainer's loop (two micro-batches, clipping by the global norm) with 8-bit moments and split masters."""
    from conformance import check_compressed_streamed_as_in_memory

    check_compressed_streamed_as_in_memory(CASES[name], nvme_dir, moments="8bit", master="split",
                                           dtype=torch.bfloat16, micro_batches=2, clip=0.5)
