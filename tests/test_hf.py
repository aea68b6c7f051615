"""save_pretrained, Trainer's checkpoints and resume, and LoRA merges of an offloaded model, one tensor at a time:
the files are transformers' and peft's own, and load there to the same values."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import tierstore as ts
from tierstore.integrations import (
    OffloadedAdamW,
    accumulate_layer_major,
    log_update_counts,
    offload_model,
    save_merged,
    stream_checkpoints,
)
from tierstore.integrations.offload import OffloadedParameterError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")  # Trainer's
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

from _training import is_mapped, named_state  # noqa: E402
from conftest import child_script  # noqa: E402
from test_peft import VOCAB, lora_pair  # noqa: E402


def _llama(tied: bool = False) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _store(nvme_dir: str, model: torch.nn.Module, fraction: int = 4) -> ts.TierStore:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return ts.TierStore(nvme_path=nvme_dir, host_budget_bytes=total // fraction, device_budget_bytes="1MiB",
                        file_size_bytes="4MiB", block_size_bytes="64KiB")


def _layer_units() -> list[type]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return [LlamaDecoderLayer]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("tied,shard", [(False, None), (True, "300KB")], ids=["one-file", "tied-sharded"])
def test_save_pretrained_of_a_model_four_times_the_budget_loads_in_transformers(tied, shard, nvme_dir, tmp_path):
    ref = _llama(tied)
    model = copy.deepcopy(ref)
    store = _store(nvme_dir, model)
    try:
        offload_model(model, store, units=_layer_units())
        kw = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(tmp_path / "out", **kw)
        assert store.memory()["host"]["peak_bytes"] <= store.config.host_budget_bytes
    finally:
        store.close()
    files = sorted(os.listdir(tmp_path / "out"))
    assert ("model.safetensors.index.json" in files) == bool(shard), files
    assert "config.json" in files
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert _same(back.state_dict(), ref.state_dict())


@pytest.mark.parametrize("embeddings", [False, True], ids=["adapter", "with-embedding-layers"])
def test_saving_an_adapter_reads_none_of_the_frozen_base(embeddings, nvme_dir, tmp_path):
    """peft's save_pretrained copies the state dict it is given into a new dict before picking the adapter out of
    it: only what it keeps of the frozen base is read from the store (the embedding layers it is asked to save),
    and the files are peft's own for the resident model."""
    st = pytest.importorskip("safetensors.torch")
    ref, model, units = lora_pair("llama")
    store = _store(nvme_dir, model)
    read: list[str] = []
    try:
        offload_model(model, store, units=units)
        frozen = {f"param/{n}" for n, p in model.named_parameters() if not p.requires_grad}
        store_read = store.read
        store.read = lambda key, *a, **k: (read.append(key), store_read(key, *a, **k))[1]
        model.save_pretrained(tmp_path / "ours", save_embedding_layers=embeddings)
        saving = set(read)  # not what close() reads to give the model its values back
    finally:
        store.close()
    embed = {k for k in frozen if "embed_tokens" in k or "lm_head" in k}
    assert saving & frozen == (embed if embeddings else set())
    ref.save_pretrained(tmp_path / "ref", save_embedding_layers=embeddings)
    ours = st.load_file(tmp_path / "ours" / "adapter_model.safetensors")
    assert _same(ours, st.load_file(tmp_path / "ref" / "adapter_model.safetensors"))
    assert any("embed_tokens" in k for k in ours) == embeddings


def test_loading_an_adapter_reads_none_of_the_frozen_base(nvme_dir, tmp_path):
    """peft's load_adapter (Trainer's resume of a peft model) takes model.state_dict() for its keys and shapes:
    on an offloaded peft model it reads none of the frozen base, and the adapter's values land in the store."""
    ref, model, units = lora_pair("llama")
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_" in name:
                p.add_(0.5)  # an adapter the offloaded model does not have yet
    ref.save_pretrained(tmp_path / "adapter")
    store = _store(nvme_dir, model)
    read: list[str] = []
    try:
        off = offload_model(model, store, units=units)
        frozen = {f"param/{n}" for n, p in model.named_parameters() if not p.requires_grad}
        store_read = store.read
        store.read = lambda key, *a, **k: (read.append(key), store_read(key, *a, **k))[1]
        model.load_adapter(tmp_path / "adapter", adapter_name="default", is_trainable=True)
        assert not set(read) & frozen
        store.read = store_read
        for name, p in ref.named_parameters():
            assert torch.equal(off.read_param(name), p.detach()), name
        assert torch.is_tensor(model.state_dict()["base_model.model.lm_head.weight"])  # read again outside it
        assert not model.state_dict()["base_model.model.lm_head.weight"].is_meta
        off.remove()
        assert "load_adapter" not in model.__dict__ and "save_pretrained" not in model.__dict__
    finally:
        store.close()


def test_save_merged_writes_what_peft_merges(nvme_dir, tmp_path):
    ref, model, units = lora_pair("llama")
    store = _store(nvme_dir, model)
    try:
        offload_model(model, store, units=units)
        save_merged(model, tmp_path / "merged")
        with pytest.raises(OffloadedParameterError, match="save_merged"):
            model.merge_and_unload()  # peft's own merge would bring every base weight into memory
        assert store.memory()["host"]["peak_bytes"] <= store.config.host_budget_bytes
    finally:
        store.close()
    want = ref.merge_and_unload()
    got = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged")
    assert _same(got.state_dict(), want.state_dict())
    assert not any("lora" in k for k in got.state_dict())


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def _trainer_run(output, nvme_dir, lora: bool, *, steps: int, resume: bool = False,
                 layer_major: bool = False, stream_update: bool = False) -> tuple[dict, list]:
    """Trainer's loop (2 micro-batches, clipping to norm 1, a checkpoint every step) over a Llama (or LoRA on it)
    four times the host budget."""
    if lora:
        _, model, units = lora_pair("llama")
    else:
        model, units = _llama(), _layer_units()
    store = _store(nvme_dir, model)
    try:
        off = offload_model(model, store, units=units)
        opt = OffloadedAdamW(off, lr=1e-2, stream_update=stream_update)
        args = transformers.TrainingArguments(
            output_dir=str(output), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=1.0,
            max_steps=steps, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="steps", save_steps=1,
            use_cpu=True, seed=0)
        trainer = stream_checkpoints(transformers.Trainer(model=model, args=args, train_dataset=_Tokens(),
                                                          optimizers=(opt, None)))
        if layer_major:
            accumulate_layer_major(trainer)
        trainer.train(resume_from_checkpoint=str(output / "checkpoint-2") if resume else None)
        assert store.memory()["host"]["peak_bytes"] <= store.config.host_budget_bytes
        opt.close()
        return ({k: v.clone() for k, v in model.state_dict().items()},
                [h["loss"] for h in trainer.state.log_history if "loss" in h])
    finally:
        store.close()


@pytest.mark.parametrize("lora,layer_major", [(False, False), (True, False), (False, True)],
                         ids=["full", "lora", "full-layer-major"])
def test_trainer_checkpoints_and_resumes_through_the_store(lora, layer_major, nvme_dir, tmp_path):
    """A checkpoint every step holds save_pretrained's files and the optimizer's state as the store's checksummed
    safetensors (no optimizer.pt read whole into memory); a run resumed from step 2 in a new Trainer ends where the
    uninterrupted run ends, bit for bit (also with the micro-batches run layer by layer)."""
    whole, losses = _trainer_run(tmp_path, nvme_dir, lora, steps=4, layer_major=layer_major)
    files = set(os.listdir(tmp_path / "checkpoint-2"))
    assert {"tierstore_optimizer", "scheduler.pt", "trainer_state.json"} <= files and "optimizer.pt" not in files
    assert ("adapter_model.safetensors" if lora else "model.safetensors") in files
    assert "manifest.json" in os.listdir(tmp_path / "checkpoint-2" / "tierstore_optimizer")
    resumed, resumed_losses = _trainer_run(tmp_path, nvme_dir, lora, steps=4, resume=True, layer_major=layer_major)
    assert resumed_losses == losses and len(losses) == 4
    assert _same(resumed, whole)
    if lora:
        frozen = [k for k in whole if "lora_" not in k]
        assert frozen and _same({k: whole[k] for k in frozen}, {k: resumed[k] for k in frozen})


@pytest.mark.parametrize("layer_major", [False, True], ids=["loop", "layer-major"])
def test_trainer_with_updates_streamed_into_the_next_forward_is_the_same_run(layer_major, nvme_dir, tmp_path):
    """OffloadedAdamW(stream_update=True) in Trainer's loop (clipping, accumulation, a checkpoint every step right
    after its step() returned): the losses and weights of the optimizer that steps after backward, bit for bit."""
    plain, losses = _trainer_run(tmp_path / "plain", nvme_dir, False, steps=3, layer_major=layer_major)
    streamed, streamed_losses = _trainer_run(tmp_path / "streamed", nvme_dir, False, steps=3, layer_major=layer_major,
                                             stream_update=True)
    assert streamed_losses == losses and len(losses) == 3
    assert _same(streamed, plain)


def test_stream_checkpoints_needs_an_offloaded_model(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = transformers.Trainer(model=_llama(), args=args, train_dataset=_Tokens())
    with pytest.raises(ValueError, match="offload_model"):
        stream_checkpoints(trainer)



def _kill_child(*args: str) -> "subprocess.CompletedProcess[str]":
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, child_script("trainer_kill_child.py"), *args], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.slow
def test_a_trainer_save_killed_part_way_resumes_from_the_last_whole_checkpoint(tmp_path):
    """kill -9 at points of the save of checkpoint-2 (the weights written, the optimizer's state half written, the
    optimizer and the RNG states written, the directory renamed into place), then resume_from_checkpoint=True in a
    fresh process: every checkpoint-N there is whole, and the run ends where the uninterrupted run ends, bit for
    bit (see [Note: A Trainer checkpoint appears whole])."""
    (tmp_path / "nvme").mkdir()
    dry = _kill_child(str(tmp_path / "nvme"), str(tmp_path / "whole"), "-1", "0", str(tmp_path / "whole.pt"))
    assert dry.returncode == 0, dry.stderr[-3000:]
    stages = [line.removeprefix("stage ") for line in dry.stdout.splitlines() if line.startswith("stage ")]
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    tensors = [i for i, s in enumerate(stages) if s.startswith("tensor ")]
    named = [stages.index(s) for s in ("model saved", "optimizer saved", "rng saved")]
    points = sorted({*named, tensors[len(tensors) // 2], len(stages) - 2})  # the last: the whole directory renamed
    assert stages[-2:] == ["renamed new", "done"]
    for k in points:
        out, nvme = tmp_path / f"out{k}", tmp_path / f"nvme{k}"
        nvme.mkdir()
        killed = _kill_child(str(nvme), str(out), str(k), "0", str(tmp_path / "unused.pt"))
        assert killed.returncode == -9, (k, stages[k], killed.stderr[-3000:])
        names = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
        assert names == (["checkpoint-1", "checkpoint-2"] if k == len(stages) - 2 else ["checkpoint-1"]), \
            (stages[k], names)
        assert all("trainer_state.json" in os.listdir(out / n) for n in names)
        resumed = _kill_child(str(nvme), str(out), "-1", "1", str(tmp_path / f"resumed{k}.pt"))
        assert resumed.returncode == 0, (stages[k], resumed.stderr[-3000:])
        assert _same(torch.load(tmp_path / f"resumed{k}.pt", weights_only=True), whole), stages[k]
        assert not [n for n in os.listdir(out) if n.startswith(".tierstore-checkpoint")]  # the killed save's


def test_trainer_without_the_line_saves_a_state_beyond_the_host_budget_through_mapped_copies(nvme_dir, tmp_path):
    """Without stream_checkpoints, Trainer's save is ``torch.save(optimizer.state_dict())``: with an optimizer state
    beyond the host budget, each tensor of it is a copy mapped from a file (see [Note: A whole state dict beyond the
    host budget]), the host tier stays within its budget, and the file is torch's, holding the state as it was."""
    model = _llama()
    store = _store(nvme_dir, model)
    try:
        off = offload_model(model, store, units=_layer_units())
        opt = OffloadedAdamW(off, lr=1e-2)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to=[], save_strategy="steps",
            save_steps=1, use_cpu=True, seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), optimizers=(opt, None))
        trainer.train()
        assert store.memory()["host"]["peak_bytes"] <= store.config.host_budget_bytes
        whole = named_state(opt.state_dict(beyond_host_budget=True))
        assert sum(t.nbytes for s in whole.values() for k, t in s.items() if k != "step") \
            > store.config.host_budget_bytes
        saved = named_state(torch.load(tmp_path / "checkpoint-1" / "optimizer.pt", weights_only=True))
        assert saved.keys() == whole.keys()
        assert all(torch.equal(saved[n][k], v) for n, e in whole.items() for k, v in e.items())
    finally:
        store.close()


def test_a_state_within_the_host_budget_is_returned_whole(nvme_dir):
    model = _llama()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    store = ts.TierStore(nvme_path=nvme_dir, host_budget_bytes=4 * total, file_size_bytes="4MiB",
                         block_size_bytes="64KiB")
    try:
        off = offload_model(model, store, units=_layer_units())
        opt = OffloadedAdamW(off, lr=1e-2)
        model(torch.randint(0, VOCAB, (2, 8)), labels=torch.randint(0, VOCAB, (2, 8))).loss.backward()
        opt.step()
        sd = opt.state_dict()
        assert set(named_state(sd)) == {n for n, p in model.named_parameters()}
        assert not any(is_mapped(t) for e in sd["state"].values() for t in e.values())
        assert sum(t.nbytes for s in sd["state"].values() for k, t in s.items() if k != "step") \
            <= store.config.host_budget_bytes
        opt.close()
    finally:
        store.close()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_trainer_accumulating_layer_major_is_trainers_own_loop_bit_for_bit(tied, nvme_dir, tmp_path):
    """accumulate_layer_major(trainer): 4 micro-batches a step, clipping, a model three times the host budget: the
    losses logged and the weights are those of Trainer's own loop, and the step reads fewer bytes from the drive;
    with the head tied to the embedding too, with no fallback (see [Note: Tied parameters layer by layer])."""
    runs = []
    for layer_major in (False, True):
        model = _llama(tied)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        out = tmp_path / str(layer_major)
        with ts.TierStore(nvme_path=nvme_dir, host_budget_bytes=total // 3, file_size_bytes="4MiB",
                          block_size_bytes="64KiB") as store:
            off = offload_model(model, store, units=_layer_units())
            opt = OffloadedAdamW(off, lr=1e-2)
            args = transformers.TrainingArguments(
                output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=4, max_grad_norm=1.0,
                max_steps=3, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                seed=0, disable_tqdm=True)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), optimizers=(opt, None))
            if layer_major:
                assert accumulate_layer_major(trainer) is trainer
            trainer.train()
            if layer_major:
                assert (off.stats.layer_major_steps, off.layer_major_refused) == (3, None)
            opt.close()
            read = store.stats_dict()["bytes_read_nvme"]
            runs.append(([h["loss"] for h in trainer.state.log_history if "loss" in h],
                         {k: v.clone() for k, v in model.state_dict().items()}, read))
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 3
    assert _same(runs[0][1], runs[1][1])
    assert runs[1][2] < runs[0][2]


@pytest.mark.parametrize("max_grad_norm", [1e9, 1e-3], ids=["never-clipped", "always-clipped"])
def test_trainer_with_updates_speculated_layer_by_layer_is_trainers_own_loop(max_grad_norm, nvme_dir, tmp_path):
    """speculate="auto" with accumulate_layer_major(trainer): the losses and weights of Trainer's own loop, and each
    log says what became of the updates (log_update_counts): never clipped, each update of the last micro-batch's
    backward stands; clipped every step, the first step's are undone and none are made after."""
    runs = []
    for speculate in (False, "auto"):
        model = _llama()
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        with ts.TierStore(nvme_path=nvme_dir, host_budget_bytes=total, file_size_bytes="4MiB",
                          block_size_bytes="64KiB") as store:
            off = offload_model(model, store, units=_layer_units())
            opt = OffloadedAdamW(off, lr=1e-2, speculate=speculate)
            args = transformers.TrainingArguments(
                output_dir=str(tmp_path / str(speculate)), per_device_train_batch_size=2,
                gradient_accumulation_steps=4, max_grad_norm=max_grad_norm, max_steps=3, learning_rate=1e-2,
                logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), optimizers=(opt, None))
            if speculate:
                assert log_update_counts(accumulate_layer_major(trainer)) is trainer
            trainer.train()
            opt.close()
            logs = [h for h in trainer.state.log_history if "loss" in h]
            runs.append(([h["loss"] for h in logs], {k: v.clone() for k, v in model.state_dict().items()}, logs))
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 3
    assert _same(runs[0][1], runs[1][1])
    made = [h["updates_speculated"] for h in runs[1][2]]
    kept = [h["speculated_kept"] for h in runs[1][2]]
    undone = [h["speculated_undone"] for h in runs[1][2]]
    # (a parameter whose state the placement keeps in the host tier, once planned, is not speculated)
    assert made[0] > 0 and all(0 < m <= made[0] for m in made) if max_grad_norm > 1 else made[1:] == [0, 0]
    assert kept == made and undone == [0, 0, 0] if max_grad_norm > 1 else undone[0] > 0 and undone[1:] == [0, 0]
    with pytest.raises(ts.TierTypeError, match="needs a Trainer given an OffloadedAdamW"):
        log_update_counts(transformers.Trainer(model=_llama(), args=args, train_dataset=_Tokens()))
