"""The conformance harness: offloaded training of a model we did not write against resident training, bit for bit.

Each case builds a model from a config with random weights (no downloads), and a
batch function and a loss; :func:`check_bit_identical` trains a copy resident
with ``torch.optim.AdamW(foreach=False)`` and a copy offloaded (parameters and
AdamW state homed on the NVMe tier, host budget a third of the fp32 state) and
compares losses, parameters, buffers and moments after every step, and an eval
forward under ``no_grad``.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from _training import named_state
from tierstore.integrations.offload import offload_model
from tierstore.integrations.optim import OffloadedAdamW

import tierstore as ts


@dataclass
class Case:
    build: Callable[[], torch.nn.Module]
    batch: Callable[[int], Any]  # step -> the forward's keyword arguments
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    host_budget_fraction: float = 1 / 3  # of the fp32 state


def state_bytes(model: torch.nn.Module) -> int:
    """fp32 parameters and two AdamW moments."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters())


def _seeded(fn: Callable[[], Any], seed: int) -> Any:
    torch.manual_seed(seed)
    return fn()


def check_bit_identical(case: Case, nvme_path: str, *, steps: int = 3, step_in_backward: bool = False,
                        prepare: Callable[[torch.nn.Module], None] | None = None,
                        units: Any = None, host_budget_fraction: float | None = None,
                        adamw_flags: dict[str, bool] | None = None, micro_batches: int = 1,
                        clip: float | None = None) -> dict[str, Any]:
    """Train resident and offloaded; assert every figure equal; return what the offloaded run saw.
    ``adamw_flags`` (``foreach``/``fused``) go to both optimizers; ``micro_batches`` backward passes a step
    accumulate gradients, and ``clip`` clips them by their global norm (torch's ``clip_grad_norm_`` over each
    model's parameters) before each step. The result's ``spilled``: how many times a kept gradient was found on
    the drive alone before a step."""
    if host_budget_fraction is None:
        host_budget_fraction = case.host_budget_fraction
    ref = _seeded(case.build, 0)
    model = copy.deepcopy(ref)
    if prepare is not None:
        prepare(ref)
        prepare(model)
    ref.train()
    model.train()
    # A third of the state, and at least what the largest parameter's AdamW update holds at once (its fp32
    # master and two moments) with room to read the next one ahead.
    largest = max(p.numel() * 4 for p in ref.parameters())
    budget = max(int(state_bytes(ref) * host_budget_fraction), 5 * largest, 64 * 1024)
    store = ts.TierStore(nvme_path=nvme_path, host_budget_bytes=budget, device_budget_bytes="1MiB",
                         file_size_bytes="4MiB", block_size_bytes="64KiB")
    try:
        kw = {} if units is None else {"units": units}
        off = offload_model(model, store, **kw)
        flags = adamw_flags or {}
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, **({"foreach": False} | flags))
        opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, step_in_backward=step_in_backward, **flags)
        try:
            spilled = 0
            for step in range(steps):
                for micro in range(micro_batches):
                    batch = case.batch(step * micro_batches + micro)
                    torch.manual_seed(100 + step * micro_batches + micro)  # dropout draws the same masks in both
                    ref_loss = case.loss(ref, batch)
                    ref_loss.backward()
                    torch.manual_seed(100 + step * micro_batches + micro)
                    loss = case.loss(model, batch)
                    loss.backward()
                    assert torch.isfinite(loss), f"step {step}: loss {loss.item()}"
                    assert loss.item() == ref_loss.item(), f"step {step}: loss {loss.item()} != {ref_loss.item()}"
                spilled += sum(1 for k in store.keys() if k.startswith("grad/")
                               and set(store.info(k)["copies"]) == {"nvme"})
                if clip is not None:
                    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                    assert torch.equal(norm, ref_norm), f"step {step}: norm {norm} != {ref_norm}"
                ref_opt.step()
                ref_opt.zero_grad()
                opt.step()
                opt.zero_grad()
                _assert_same_state(model, ref, opt, ref_opt, f"after step {step}")
            ref.eval()
            model.eval()
            with torch.no_grad():
                batch = case.batch(steps)
                ours = _seeded(partial(case.loss, model, batch), 100 + steps)  # a model may draw in eval too
                assert torch.equal(ours, _seeded(partial(case.loss, ref, batch), 100 + steps)), \
                    "eval forward under no_grad"
        finally:
            opt.close()
        stats = store.stats_dict()
        assert stats["bytes_read_nvme"] > 0, "nothing was read from the drive: the test would prove nothing"
        return {"off": off, "stats": stats, "units": off.units(), "spilled": spilled}
    finally:
        store.close()


def _assert_same_state(model: torch.nn.Module, ref: torch.nn.Module, opt: OffloadedAdamW,
                       ref_opt: torch.optim.Optimizer, when: str) -> None:
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd), when
    for name, value in ref_sd.items():
        assert torch.equal(sd[name], value), f"{name} differs {when} (max {(sd[name] - value).abs().max()})"
    ours = named_state(opt.state_dict(beyond_host_budget=True))
    for name, p in ref.named_parameters():
        st = ref_opt.state.get(p)
        if not st:  # never had a gradient (an expert no token chose): torch keeps no state, ours is zeros
            assert all(not ours.get(name, {}).get(m, torch.zeros(1)).any() for m in ("exp_avg", "exp_avg_sq")), \
                f"{name}: moments without a gradient {when}"
            continue
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours[name][moment], st[moment]), f"{name} {moment} differs {when}"


def check_compressed_streamed_as_in_memory(case: Case, nvme_path: str, *, moments: str, master: str,
                                           dtype: torch.dtype = torch.float32, steps: int = 3,
                                           step_in_backward: bool = False, micro_batches: int = 1,
                                           clip: float | None = None) -> dict[str, Any]:
    """Compressed optimizer state (``moments``, ``master``) has no torch reference to train against: train the
    model twice with the same layout, once streamed from the drive (a third of its state as host budget) and
    once with every tensor at home in the host tier (no drive), and assert every figure equal after every step:
    losses, parameters, buffers and the stored state. Returns what the streamed run saw."""
    runs, stores = [], []
    try:
        for streamed in (False, True):
            model = _seeded(case.build, 0).to(dtype)
            model.train()
            if streamed:
                largest = max(p.numel() * 4 for p in model.parameters())
                budget = max(int(state_bytes(model) * case.host_budget_fraction), 5 * largest, 64 * 1024)
                store = ts.TierStore(nvme_path=nvme_path, host_budget_bytes=budget, device_budget_bytes="1MiB",
                                     file_size_bytes="4MiB", block_size_bytes="64KiB")
            else:
                store = ts.TierStore(host_budget_bytes=8 * state_bytes(model) + (64 << 20))
            stores.append(store)
            home = "nvme" if streamed else "host"
            off = offload_model(model, store, home=home, grad_tier=home)
            opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, step_in_backward=step_in_backward,
                                 moments=moments, master=master, home=home)
            runs.append((model, off, opt, store))
        for step in range(steps):
            seen = []
            for model, off, opt, _ in runs:
                losses = []
                for micro in range(micro_batches):
                    torch.manual_seed(100 + step * micro_batches + micro)
                    loss = case.loss(model, case.batch(step * micro_batches + micro))
                    loss.backward()
                    losses.append(loss.item())
                norm = off.clip_grad_norm_(clip) if clip is not None else None
                opt.step()
                opt.zero_grad()
                seen.append((losses, norm))
            assert seen[0] == seen[1], f"step {step}: losses and norms {seen[1]} streamed, {seen[0]} in memory"
            assert all(math.isfinite(x) for x in seen[0][0]), f"step {step}: losses {seen[0][0]}"
            (ref, _, ref_opt, _), (model, _, opt, _) = runs
            when = f"after step {step}"
            ref_sd, sd = ref.state_dict(), model.state_dict()
            for name, value in ref_sd.items():
                assert torch.equal(sd[name], value), f"{name} differs {when}"
            ref_state, state = named_state(ref_opt.state_dict(beyond_host_budget=True)), named_state(opt.state_dict(beyond_host_budget=True))
            assert list(state) == list(ref_state), when
            for name, entry in ref_state.items():
                for key, value in entry.items():
                    other = state[name][key]
                    same = torch.equal(other, value) if isinstance(value, torch.Tensor) else other == value
                    assert same, f"{name} {key} differs {when}"
        stats = runs[1][3].stats_dict()
        assert stats["bytes_read_nvme"] > 0, "nothing was read from the drive: the test would prove nothing"
        assert runs[0][3].stats_dict()["bytes_read_nvme"] == 0
        return {"stats": stats}
    finally:
        for _, _, opt, _ in runs:
            opt.close()
        for store in stores:
            store.close()


# ---- the models -----------------------------------------------------------------------------
VOCAB = 96


def _tokens(step: int, batch: int = 2, length: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


def _causal_lm(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _llama(tied: bool) -> nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


def _mixtral() -> nn.Module:
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                     num_experts_per_tok=1, max_position_embeddings=64)
    return transformers.MixtralForCausalLM(cfg)


def _bert() -> nn.Module:
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=112, max_position_embeddings=64)
    return transformers.BertForMaskedLM(cfg)


def _masked_lm(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[:, ::2] = -100
    return model(input_ids=ids, labels=labels).loss


def _t5() -> nn.Module:
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=112, num_layers=2, num_heads=4,
                                relative_attention_num_buckets=8, decoder_start_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg)


def _seq2seq(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids.flip(1)).loss


class MLPBlock(nn.Sequential):
    """torchvision.models.vision_transformer.MLPBlock."""

    def __init__(self, in_dim: int, mlp_dim: int, dropout: float) -> None:
        super().__init__(nn.Linear(in_dim, mlp_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(mlp_dim, in_dim),
                         nn.Dropout(dropout))


class EncoderBlock(nn.Module):
    """torchvision.models.vision_transformer.EncoderBlock, line for line."""

    def __init__(self, num_heads: int, hidden_dim: int, mlp_dim: int, dropout: float, attention_dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.ln_1 = partial(nn.LayerNorm, eps=1e-6)(hidden_dim)
        self.self_attention = nn.MultiheadAttention(hidden_dim, num_heads, dropout=attention_dropout,
                                                    batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = partial(nn.LayerNorm, eps=1e-6)(hidden_dim)
        self.mlp = MLPBlock(hidden_dim, mlp_dim, dropout)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        torch._assert(input.dim() == 3, f"Expected (batch_size, seq_length, hidden_dim) got {input.shape}")
        x = self.ln_1(input)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = self.dropout(x)
        x = x + input
        y = self.ln_2(x)
        y = self.mlp(y)
        return x + y


class ConvNet(nn.Module):
    """Residual conv blocks with BatchNorm, trained channels_last as convnets often are: each weight's layout
    picks the kernel (a contiguous copy of a channels_last weight would round otherwise)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False),
                                                  nn.BatchNorm2d(width), nn.ReLU(),
                                                  nn.Conv2d(width, width, 1)) for _ in range(2))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean((2, 3)))


class Encoder(nn.Module):
    """torchvision's ViT encoder (pos embedding, blocks, norm) with a token embedding and a head."""

    def __init__(self, depth: int = 2, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos_embedding = nn.Parameter(torch.empty(1, 12, dim).normal_(std=0.02))
        self.layers = nn.Sequential(OrderedDict(
            (f"encoder_layer_{i}", EncoderBlock(4, dim, 2 * dim, 0.1, 0.1)) for i in range(depth)))
        self.ln = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.layers(self.embed(ids) + self.pos_embedding)))


class Recurrent(nn.Module):
    """A bidirectional two-layer LSTM (its kernel takes every layer's weights in one call) and a GRU after it."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=0)
        self.lstm = nn.LSTM(dim, dim, num_layers=2, batch_first=True, bidirectional=True, dropout=0.1)
        self.gru = nn.GRU(2 * dim, dim, batch_first=True)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.lstm(self.embed(ids))[0])[0])


def _encoder_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).flatten(0, 1), ids.flip(1).flatten())


class TorchEncoder(nn.Module):
    """``nn.TransformerEncoder`` over padded sequences, as text classifiers use it: in eval under no_grad torch
    runs its inference fast path (the layers' fused kernel, and nested tensors for the padding)."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids), src_key_padding_mask=_padding(ids)))


class TorchTransformer(nn.Module):
    """``nn.Transformer`` (encoder and decoder layers) with padding and a causal mask."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.body = nn.Transformer(dim, 4, 2, 2, 2 * dim, dropout=0.1, batch_first=True)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x, pad = self.embed(ids), _padding(ids)
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.body(x, x, tgt_mask=causal, src_key_padding_mask=pad, memory_key_padding_mask=pad))


def _hf_vit() -> nn.Module:
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=128, num_labels=10)
    return transformers.ViTForImageClassification(cfg)


def _clip() -> nn.Module:
    """Two towers (text and vision) and a contrastive loss over the batch."""
    text = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 32}
    vision = {"image_size": 32, "patch_size": 8, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4}
    return transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=32))


def _whisper() -> nn.Module:
    """An audio encoder (convolutions over mel features) and a text decoder."""
    cfg = transformers.WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, d_model=64, encoder_layers=2,
                                     decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                     encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=16,
                                     max_target_positions=32, decoder_start_token_id=1, pad_token_id=0,
                                     eos_token_id=2, bos_token_id=1)
    return transformers.WhisperForConditionalGeneration(cfg)


def _albert() -> nn.Module:
    """One layer's weights shared by every layer: each is used at every depth, in forward and backward."""
    cfg = transformers.AlbertConfig(vocab_size=VOCAB, embedding_size=32, hidden_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, intermediate_size=112, max_position_embeddings=64)
    return transformers.AlbertForMaskedLM(cfg)


def _deberta() -> nn.Module:
    """Relative position embeddings that every layer's attention reads (a parameter of another module)."""
    cfg = transformers.DebertaV2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=112, max_position_embeddings=64, relative_attention=True,
                                       pos_att_type=["p2c", "c2p"], position_buckets=16)
    return transformers.DebertaV2ForMaskedLM(cfg)


def _reformer() -> nn.Module:
    """Reversible residual layers: backward recomputes each layer's forward in a custom autograd function."""
    cfg = transformers.ReformerConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, attention_head_size=16,
                                      feed_forward_size=64, attn_layers=["local", "lsh", "local", "lsh"],
                                      axial_pos_shape=[4, 3], axial_pos_embds_dim=[16, 16],
                                      max_position_embeddings=12, local_attn_chunk_length=4,
                                      lsh_attn_chunk_length=4, num_buckets=2, is_decoder=True, hash_seed=7,
                                      hidden_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0,
                                      local_attention_probs_dropout_prob=0.0)  # its dropout seeds are unseeded
    return transformers.ReformerModelWithLMHead(cfg)


def _vit_mae() -> nn.Module:
    """A random mask of patches drawn in every forward (eval too)."""
    cfg = transformers.ViTMAEConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=128, decoder_hidden_size=32,
                                    decoder_num_hidden_layers=1, decoder_num_attention_heads=4,
                                    decoder_intermediate_size=64)
    return transformers.ViTMAEForPreTraining(cfg)


def _wav2vec2() -> nn.Module:
    """Convolutions over raw audio and a weight-normed (parametrized) positional convolution."""
    cfg = transformers.Wav2Vec2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=112, conv_dim=[16, 16], conv_stride=[5, 2],
                                      conv_kernel=[10, 3], num_conv_pos_embeddings=8,
                                      num_conv_pos_embedding_groups=4, mask_time_prob=0.0)
    return transformers.Wav2Vec2ForCTC(cfg)


def _bart(cls: type[nn.Module], config: type, **kw: Any) -> nn.Module:
    """An encoder-decoder with tied embeddings (Marian: and a final-logits bias buffer)."""
    return cls(config(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64,
                      **kw))


def _qwen2_moe() -> nn.Module:
    """Routed experts beside a gated shared expert."""
    cfg = transformers.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)
    return transformers.Qwen2MoeForCausalLM(cfg)


def _xlnet() -> nn.Module:
    """Two-stream relative attention whose bias parameters each layer reads outside its linear modules."""
    return transformers.XLNetLMHeadModel(transformers.XLNetConfig(vocab_size=VOCAB, d_model=64, n_layer=2, n_head=4,
                                                                  d_inner=96))


def _mamba() -> nn.Module:
    """A selective state-space scan (torch's reference path): ``A_log`` and ``D`` read outside any submodule."""
    return transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32,
                                                                  num_hidden_layers=2, state_size=8))


def _rwkv() -> nn.Module:
    """Rescales its output weights in place whenever it switches between training and eval (rescale_every)."""
    cfg = transformers.RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                                  intermediate_size=64, context_length=32, rescale_every=1)
    return transformers.RwkvForCausalLM(cfg)


def _hf_swin() -> nn.Module:
    """Shifted windows with a relative position bias table indexed by a buffer."""
    cfg = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                                  window_size=4, num_labels=10)
    return transformers.SwinForImageClassification(cfg)


def _beit() -> nn.Module:
    """Relative position bias per layer and layer-scale parameters (read by the layer, not by a submodule)."""
    cfg = transformers.BeitConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=96, use_relative_position_bias=True,
                                  layer_scale_init_value=0.1, num_labels=10)
    return transformers.BeitForImageClassification(cfg)


def _audio_and_text(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(6000 + step)
    return {"input_values": torch.randn(2, 400, generator=g), "labels": _tokens(step, length=6)}


def _pixels(step: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": _pixels_and_labels(step)["pixel_values"]}


def _pixels_and_labels(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 + step)
    return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "labels": torch.randint(0, 10, (2,), generator=g)}


def _pixels_and_text(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4000 + step)
    return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "input_ids": _tokens(step), "return_loss": True}


def _mel_and_text(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5000 + step)
    return {"input_features": torch.randn(2, 16, 32, generator=g), "labels": _tokens(step, length=8)}


def _model_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    return model(**batch).loss


def _padding(ids: torch.Tensor) -> torch.Tensor:
    """True past each row's length: row i of the batch is i + 1 tokens shorter than the longest."""
    lengths = ids.shape[1] - torch.arange(ids.shape[0])
    return torch.arange(ids.shape[1])[None] >= lengths[:, None]


CASES = {
    "llama-tied": Case(partial(_llama, True), _tokens, _causal_lm),
    "llama-untied": Case(partial(_llama, False), _tokens, _causal_lm),
    "gpt2": Case(_gpt2, _tokens, _causal_lm),
    "bert": Case(_bert, _tokens, _masked_lm),
    "t5": Case(_t5, _tokens, _seq2seq),
    "mixtral": Case(_mixtral, _tokens, _causal_lm),
    "mha-encoder": Case(Encoder, _tokens, _encoder_loss),
    "torch-encoder": Case(TorchEncoder, _tokens, _encoder_loss),
    "torch-transformer": Case(TorchTransformer, _tokens, _encoder_loss),
    "torch-recurrent": Case(Recurrent, _tokens, _encoder_loss, host_budget_fraction=2 / 3),
    "hf-vit": Case(_hf_vit, _pixels_and_labels, _model_loss),
    "clip": Case(_clip, _pixels_and_text, _model_loss),
    "whisper": Case(_whisper, _mel_and_text, _model_loss),
    # backward holds the shared layer from its last use to its first: more than a third of this tiny state
    "albert": Case(_albert, _tokens, _masked_lm, host_budget_fraction=3 / 4),
    "deberta-v2": Case(_deberta, _tokens, _masked_lm),
    "reformer": Case(_reformer, _tokens, _causal_lm),
    "vit-mae": Case(_vit_mae, _pixels, _model_loss),
    "wav2vec2": Case(_wav2vec2, _audio_and_text, _model_loss),
    "bart": Case(lambda: _bart(transformers.BartForConditionalGeneration, transformers.BartConfig), _tokens, _seq2seq),
    "marian": Case(lambda: _bart(transformers.MarianMTModel, transformers.MarianConfig, pad_token_id=0,
                                 decoder_start_token_id=0), _tokens, _seq2seq),
    "qwen2-moe": Case(_qwen2_moe, _tokens, _causal_lm),
    "xlnet": Case(_xlnet, _tokens, _causal_lm),
    "mamba": Case(_mamba, _tokens, _causal_lm),
    "rwkv": Case(_rwkv, _tokens, _causal_lm),
    "hf-swin": Case(_hf_swin, _pixels_and_labels, _model_loss),
    "beit": Case(_beit, _pixels_and_labels, _model_loss),
}


def _hf(model: str, config: str, **kw: Any) -> Callable[[], nn.Module]:
    """A builder of transformers' ``model`` from its ``config`` with ``kw``."""
    return lambda: getattr(transformers, model)(getattr(transformers, config)(**kw))


_LM = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
       "intermediate_size": 112, "max_position_embeddings": 64}
_CLASSES = {"num_labels": 10, "image_size": 32}
# Attention variants (ALiBi, parallel blocks, soft-capping, sliding windows, sparse and pooled attention) and
# vision backbones of convolutions and attention.
CASES.update({
    "falcon": Case(_hf("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4), _tokens, _causal_lm),
    "bloom": Case(_hf("BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
                  _tokens, _causal_lm),
    "gpt-neox": Case(_hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **_LM), _tokens, _causal_lm),
    "gemma2": Case(_hf("Gemma2ForCausalLM", "Gemma2Config", **_LM, num_key_value_heads=2, head_dim=16),
                   _tokens, _causal_lm),
    "mistral-sliding": Case(_hf("MistralForCausalLM", "MistralConfig", **_LM, num_key_value_heads=2,
                                sliding_window=4), _tokens, _causal_lm),
    "longformer": Case(_hf("LongformerForMaskedLM", "LongformerConfig", **_LM, attention_window=4), _tokens,
                       _masked_lm),
    "funnel": Case(_hf("FunnelForMaskedLM", "FunnelConfig", vocab_size=VOCAB, d_model=64, n_head=4, d_head=16,
                       d_inner=112, block_sizes=[1, 1], num_decoder_layers=1), _tokens, _masked_lm),
    "dinov2": Case(_hf("Dinov2ForImageClassification", "Dinov2Config", **_CLASSES, patch_size=8, hidden_size=64,
                       num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2), _pixels_and_labels, _model_loss),
    "swinv2": Case(_hf("Swinv2ForImageClassification", "Swinv2Config", **_CLASSES, patch_size=4, embed_dim=16,
                       depths=[1, 1], num_heads=[2, 2], window_size=4), _pixels_and_labels, _model_loss),
    "segformer": Case(_hf("SegformerForImageClassification", "SegformerConfig", num_labels=10, num_encoder_blocks=2,
                          depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
                          patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2]), _pixels_and_labels, _model_loss),
    "mobilevit": Case(_hf("MobileViTForImageClassification", "MobileViTConfig", **_CLASSES,
                          hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64]),
                      _pixels_and_labels, _model_loss),
})


# ---- vision models: torchvision and timm, where installed (`bash .ci/run conformance`) ----------------------
def _images(step: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _classify(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


# The images stay contiguous: the weights' layout picks each convolution's (and its output's).
CASES["channels-last-convnet"] = Case(lambda: ConvNet().to(memory_format=torch.channels_last), _images, _classify)

try:
    import torchvision
except ImportError:  # PyPI's torchvision wheels need the CUDA build of torch: absent from the default suite
    torchvision = None
if torchvision is not None:
    def _vit_b_16() -> nn.Module:
        """torchvision's vit_b_16 (patch 16) at a tiny width and depth."""
        return torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=4,
                                                    hidden_dim=64, mlp_dim=128, num_classes=10)

    CASES["torchvision-vit_b_16"] = Case(_vit_b_16, _images, _classify)
    M = torchvision.models
    # Stochastic depth (a random draw per block in training), layer scale; shifted windows; dense blocks whose
    # concatenation is checkpointed (memory_efficient).
    CASES["torchvision-convnext"] = Case(lambda: M.ConvNeXt([M.convnext.CNBlockConfig(16, 32, 1),
                                                             M.convnext.CNBlockConfig(32, None, 1)],
                                                            stochastic_depth_prob=0.1, num_classes=10),
                                         _images, _classify)
    CASES["torchvision-swin"] = Case(lambda: M.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2],
                                                               num_heads=[2, 4], window_size=[4, 4],
                                                               stochastic_depth_prob=0.1, num_classes=10),
                                     _images, _classify)
    CASES["torchvision-densenet"] = Case(lambda: M.DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16,
                                                            num_classes=10, memory_efficient=True),
                                         _images, _classify)

try:
    import timm
except ImportError:
    timm = None
if timm is not None:
    def _timm_vit() -> nn.Module:
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                                 embed_dim=64, num_heads=4, num_classes=10)

    def _timm_resnet() -> nn.Module:
        from timm.models.resnet import BasicBlock, ResNet
        return ResNet(block=BasicBlock, layers=[1, 1, 1, 1], num_classes=10)  # BatchNorm: buffers move in forward

    CASES["timm-vit"] = Case(_timm_vit, _images, _classify)
    CASES["timm-resnet"] = Case(_timm_resnet, _images, _classify)
    # An attention-bias table cached per device in eval (LeViT); rotary embeddings (EVA-02).
    CASES["timm-levit"] = Case(lambda: timm.create_model("levit_128s", pretrained=False, img_size=32, num_classes=10),
                               _images, _classify)
    CASES["timm-eva02"] = Case(lambda: timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=32,
                                                         patch_size=8, depth=2, embed_dim=64, num_heads=4,
                                                         num_classes=10), _images, _classify)
