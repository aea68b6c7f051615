"""LoRA through peft on a frozen base several times the host budget: bit-identical to resident training.

The base's parameters require no gradient, so their backward holds end when their unit's backward is done with
them (see [Note: Frozen parameters in backward]), not when the whole backward ends.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tierstore as ts
from tierstore.integrations import OffloadedAdamW, offload_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
# peft asks transformers the deprecated way whether checkpointing is on
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

VOCAB = 256


def _llama() -> tuple[torch.nn.Module, list[type], list[str]]:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return transformers.LlamaForCausalLM(cfg), [LlamaDecoderLayer], ["q_proj", "v_proj"]


def _gpt2() -> tuple[torch.nn.Module, list[type], list[str]]:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=6, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return transformers.GPT2LMHeadModel(cfg), [GPT2Block], ["c_attn"]


BASES = {"llama": _llama, "gpt2": _gpt2}


def lora_pair(base: str) -> tuple[torch.nn.Module, torch.nn.Module, list[type]]:
    """A peft LoRA model over a random base (dropout off: the same draws in both), and an identical copy."""
    torch.manual_seed(0)
    model, units, targets = BASES[base]()
    model.config.use_cache = False
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0,
                           fan_in_fan_out=base == "gpt2")
    model = peft.get_peft_model(model, lora)
    torch.manual_seed(1)
    for name, p in model.named_parameters():  # LoRA's B starts at zero: make the adapter change the loss at once
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model, copy.deepcopy(model), units


def base_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


def _ids(i: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("step_in_backward", [False, True], ids=["after-backward", "in-backward"])
def test_lora_on_a_base_four_times_the_budget_trains_as_resident(base, step_in_backward, nvme_dir, tmp_path):
    """Three steps; stepping after backward with two micro-batches a step and clipping to norm 1, as Trainer
    does. Losses, norms, every weight and the adapter's saved files are the resident run's."""
    ref, model, units = lora_pair(base)
    budget = base_bytes(model) // 4
    store = ts.TierStore(nvme_path=nvme_dir, host_budget_bytes=budget, device_budget_bytes="1MiB",
                         file_size_bytes="4MiB", block_size_bytes="64KiB")
    micro_batches, clip = (1, None) if step_in_backward else (2, 1.0)
    try:
        off = offload_model(model, store, units=units)
        opt = OffloadedAdamW(off, lr=1e-2, step_in_backward=step_in_backward)
        ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, foreach=False)
        for step in range(3):
            for micro in range(micro_batches):
                ids = _ids(step * micro_batches + micro)
                torch.manual_seed(step)  # the base's dropout draws the same masks in both
                ref_loss = ref(input_ids=ids, labels=ids).loss / micro_batches
                ref_loss.backward()
                torch.manual_seed(step)
                loss = model(input_ids=ids, labels=ids).loss / micro_batches
                loss.backward()
                assert loss.item() == ref_loss.item(), f"step {step}.{micro}: {loss.item()} != {ref_loss.item()}"
            if clip is not None:
                ref_norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], clip)
                norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
                assert torch.equal(norm, ref_norm), f"step {step}: norm {norm} != {ref_norm}"
            ref_opt.step()
            ref_opt.zero_grad()
            opt.step()
            opt.zero_grad()
        opt.close()
        got, want = model.state_dict(), ref.state_dict()
        assert got.keys() == want.keys()
        changed = [k for k in want if "lora_" in k]
        assert changed and all(torch.equal(got[k], want[k]) for k in want), "weights differ from the resident run's"
        model.save_pretrained(tmp_path / "ours")
        ref.save_pretrained(tmp_path / "ref")
        ours = (tmp_path / "ours" / "adapter_model.safetensors").read_bytes()
        assert ours == (tmp_path / "ref" / "adapter_model.safetensors").read_bytes()
        stats = store.stats_dict()
        assert stats["bytes_read_nvme"] > base_bytes(model), "the base was not streamed from the drive"
        assert store.memory()["host"]["peak_bytes"] <= budget
    finally:
        store.close()


def test_a_frozen_backbone_under_a_quarter_of_its_size_trains_as_resident(nvme_dir):
    """All but the first decoder layer frozen by hand, no peft: backward runs through five frozen layers."""
    torch.manual_seed(0)
    ref, units, _ = _llama()
    for name, p in ref.named_parameters():
        p.requires_grad_(name.startswith(("model.layers.0.",)))
    model = copy.deepcopy(ref)
    _train_both(ref, model, units, nvme_dir)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_lora_with_activation_checkpointing_under_a_quarter_of_the_base(reentrant, nvme_dir):
    """transformers' gradient checkpointing (each decoder layer a segment, rerun inside backward) with LoRA: the
    rerun's frozen parameters go once the segment's backward is done with them."""
    ref, model, units = lora_pair("llama")
    for m in (ref, model):
        kw = {"use_reentrant": reentrant}
        if hasattr(m, "activation_checkpointing_enable"):  # the name since transformers 5.x
            m.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        m.enable_input_require_grads()  # peft's recipe: reentrant checkpointing needs an input that needs grad
    _train_both(ref, model, units, nvme_dir)


def _train_both(ref: torch.nn.Module, model: torch.nn.Module, units: list[type], nvme_dir: str) -> None:
    """Three plain steps of ``ref`` resident and ``model`` offloaded under a quarter of its frozen base: the same
    losses and weights."""
    budget = base_bytes(model) // 4
    store = ts.TierStore(nvme_path=nvme_dir, host_budget_bytes=budget, device_budget_bytes="1MiB",
                         file_size_bytes="4MiB", block_size_bytes="64KiB")
    try:
        off = offload_model(model, store, units=units)
        opt = OffloadedAdamW(off, lr=1e-2)
        ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, foreach=False)
        for step in range(3):
            ids = _ids(step)
            ref_loss = ref(input_ids=ids, labels=ids).loss
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            assert loss.item() == ref_loss.item(), step
        opt.close()
        got = model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in ref.state_dict().items())
        assert store.memory()["host"]["peak_bytes"] <= budget
    finally:
        store.close()
