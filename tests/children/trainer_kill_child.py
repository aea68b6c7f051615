"""Child process for the killed-Trainer-save test: transformers' Trainer over an offloaded Llama four times the host
budget (2 micro-batches, clipping, a checkpoint every step, ``stream_checkpoints``), killed part-way through the
save of ``checkpoint-2`` or resumed with ``resume_from_checkpoint=True``.

argv: nvme_dir output_dir kill_at resume(0/1) weights_out. kill_at < 0: no kill; prints the stages of the save of
checkpoint-2, one a line ("stage NAME"). With weights_out, the trained weights are saved there at the end (torch.save of plain
tensors).
"""

import os
import signal
import sys

import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import tierstore as ts
from tierstore import _checkpoint
from tierstore.integrations import OffloadedAdamW, offload_model, stream_checkpoints

VOCAB, STEPS, KILLED_SAVE = 256, 4, 2


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    nvme_dir, output, kill_at, resume, weights_out = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
        sys.argv[4] == "1", sys.argv[5]
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    with ts.TierStore(nvme_path=nvme_dir, host_budget_bytes=total // 4, device_budget_bytes="1MiB",
                      file_size_bytes="4MiB", block_size_bytes="64KiB") as store:
        off = offload_model(model, store, units=[LlamaDecoderLayer])
        opt = OffloadedAdamW(off, lr=1e-2)
        args = transformers.TrainingArguments(
            output_dir=output, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=1.0,
            max_steps=STEPS, learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="steps",
            save_steps=1, use_cpu=True, seed=0)
        trainer = stream_checkpoints(transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                                          optimizers=(opt, None)))
        stages: list[str] = []

        def stage(name: str) -> None:
            if trainer.state.global_step != KILLED_SAVE:
                return
            if len(stages) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            stages.append(name)

        def after(name: str, method):
            def run(*a, **k):
                out = method(*a, **k)
                stage(name)
                return out
            return run

        # Trainer's own steps of a save, and the store's (the optimizer's state, the commit of the directory)
        trainer.save_model = after("model saved", trainer.save_model)
        trainer._save_optimizer_and_scheduler = after("optimizer saved", trainer._save_optimizer_and_scheduler)
        trainer._save_rng_state = after("rng saved", trainer._save_rng_state)
        _checkpoint.crash_point = stage
        trainer.train(resume_from_checkpoint=True if resume else None)
        _checkpoint.crash_point = None
        opt.close()
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, weights_out)
    if kill_at < 0:
        print("\n".join("stage " + s for s in stages))


if __name__ == "__main__":
    main()
