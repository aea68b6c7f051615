"""Fine-tune a transformers causal LM with its weights and AdamW state on the drive.

    python examples/finetune_causal_lm.py --model DIR --output OUT --nvme-path /mnt/nvme [--steps 20] [--lora 16]

``DIR`` is a model saved with ``save_pretrained`` (``--make-tiny DIR`` writes a small random Llama there to try
it). The whole flow of a model bigger than RAM:

1. the model is built on the meta device from its config (no memory), offloaded unit by unit (each decoder
   layer a unit) and its pretrained weights streamed into the store one tensor at a time;
2. ``--lora R`` wraps it in peft's LoRA of rank R on every attention and MLP projection (the base frozen: its
   weights stay on the drive, read for forward and backward only);
3. transformers' ``Trainer`` trains it with ``OffloadedAdamW`` (gradient accumulation over 2 micro-batches and
   clipping to norm 1, as its defaults do; gradients live in the store too), saving a checkpoint every
   ``--save-steps`` one tensor at a time (``stream_checkpoints``); ``--resume`` goes on from the last one (or
   from the one it names);
4. the result is saved with ``save_pretrained`` (read from the store tensor by tensor; the adapter alone under
   ``--lora``, and the base with the adapter merged in, ``save_merged``, in ``OUTPUT/merged``) and generates text.

It runs on the GPU where torch sees one (the store's device tier), else on the CPU.

The data is token ids from a fixed random Markov chain (no tokenizer, nothing downloaded); use your own
dataset of ``input_ids``/``labels`` the same way. ``--resident`` runs the same with the model in memory and
``torch.optim.AdamW``: the offloaded run gives the same weights, bit for bit (tested).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import zlib
from collections.abc import Callable

import torch
import transformers

import tierstore as ts
from tierstore.tools.rss import peak_rss_bytes
from tierstore.integrations import OffloadedAdamW, load_base_weights, offload_model, save_merged, stream_checkpoints

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class MarkovTokens(torch.utils.data.Dataset):
    """Sequences of token ids from a fixed random Markov chain: each token has 8 possible successors."""

    def __init__(self, vocab: int, length: int, size: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.next = torch.stack([torch.randperm(vocab, generator=g)[:8] for _ in range(vocab)])
        self.vocab, self.length, self.size = vocab, length, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + i)
        ids = [int(torch.randint(0, self.vocab, (1,), generator=g))]
        for _ in range(self.length - 1):
            ids.append(int(self.next[ids[-1], torch.randint(0, 8, (1,), generator=g)]))
        t = torch.tensor(ids)
        return {"input_ids": t, "labels": t}


def make_tiny(directory: str) -> None:
    """A small random Llama, saved as a pretrained model is."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def build(model_dir: str, store: ts.TierStore | None, dtype: torch.dtype = torch.float32,
          lora: int = 0) -> tuple[torch.nn.Module, object]:
    """The pretrained model (with LoRA of rank ``lora`` on it, if any): in memory, or (given a store) built on
    meta, offloaded and loaded into the store."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    if store is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=dtype)
        return _with_lora(model, lora), None
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    layers = {type(m) for m in model.modules() if type(m).__name__ in (model._no_split_modules or [])}
    base_init = model._init_weights
    model = _with_lora(model, lora)
    off = offload_model(model, store, units=list(layers), init_fn=_initializer(model, base_init))
    load_base_weights(model_dir, off)  # one tensor at a time, through the host budget
    return model, off


def _with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    if not rank:
        return model
    import peft

    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                       target_modules=LORA_TARGETS))
    if not any(p.is_meta for p in model.parameters()):
        with torch.no_grad():
            for module in model.modules():
                _init_adapter(model, module)
    return model


def _initializer(model: torch.nn.Module, base_init: Callable[[torch.nn.Module], None]) -> Callable:
    """What initializes each module of a model built on meta: the adapters as in memory, the rest as the base."""
    def init(module: torch.nn.Module) -> None:
        if not _init_adapter(model, module):
            base_init(module)
    return init


def _init_adapter(model: torch.nn.Module, module: torch.nn.Module) -> bool:
    """peft's initial values of a LoRA adapter's matrix (A kaiming-uniform, B zeros), drawn from a seed of its
    name, so that a model built on meta starts where one built in memory does; False for any other module."""
    name = next((n for n, m in model.named_modules() if m is module), "")
    matrix = name.split(".")[-2:-1]  # lora_A.<adapter>, lora_B.<adapter>
    if matrix == ["lora_B"]:
        torch.nn.init.zeros_(module.weight)
    elif matrix == ["lora_A"]:
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        torch.nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=g)
    else:
        return False
    return True


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a directory saved with save_pretrained")
    p.add_argument("--make-tiny", metavar="DIR", help="write a small random Llama to DIR and fine-tune it")
    p.add_argument("--output", required=True, help="Trainer's output directory; the result goes to OUTPUT/final")
    p.add_argument("--nvme-path", default=None, help="directory on the drive for the swap files")
    p.add_argument("--host-budget", default="1GiB")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--examples", type=int, default=256, help="sequences in the training set")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the weights' dtype")
    p.add_argument("--moments", default="fp32", help="OffloadedAdamW's moments: fp32, bf16 or 8bit")
    p.add_argument("--master-weights", dest="master", default=None,
                   help="OffloadedAdamW's master weights of bf16/fp16 weights: fp32, split or none (default: fp32)")
    p.add_argument("--lora", type=int, default=0, metavar="R", help="train LoRA adapters of rank R (peft) on a "
                   "frozen base")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                   help="go on from a checkpoint (default: the last one in --output)")
    p.add_argument("--resident", action="store_true", help="the same run with the model in memory and torch's AdamW")
    args = p.parse_args(argv)
    if args.make_tiny:
        make_tiny(args.make_tiny)
        args.model = args.make_tiny
    if not args.model:
        p.error("give --model DIR (saved with save_pretrained) or --make-tiny DIR")

    store = None if args.resident else ts.TierStore(nvme_path=args.nvme_path, host_budget_bytes=args.host_budget)
    done = False
    try:
        model, off = build(args.model, store, DTYPES[args.dtype], args.lora)
        trained = [p for p in model.parameters() if p.requires_grad]
        if off is None:
            opt = torch.optim.AdamW(trained, lr=args.lr, foreach=False)
        else:
            opt = OffloadedAdamW(off, lr=args.lr, moments=args.moments, master=args.master)
        training = transformers.TrainingArguments(
            output_dir=args.output, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=1.0,
            max_steps=args.steps, learning_rate=args.lr, logging_steps=1, save_strategy="steps",
            save_steps=args.save_steps, report_to=[], seed=0, dataloader_pin_memory=torch.cuda.is_available())
        data = MarkovTokens(model.config.vocab_size, length=32, size=args.examples)
        trainer = transformers.Trainer(model=model, args=training, train_dataset=data, optimizers=(opt, None))
        if off is not None:
            stream_checkpoints(trainer)  # checkpoints and resume one tensor at a time
        trainer.train(resume_from_checkpoint=args.resume)
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        final = os.path.join(args.output, "final")
        model.save_pretrained(final)  # the trained weights (the adapter, with --lora), tensor by tensor
        if args.lora and off is not None:
            save_merged(model, os.path.join(args.output, "merged"))  # the base with the adapter merged in
        device = next(p.device for p in model.parameters())  # where Trainer put the model
        prompt = data[0]["input_ids"][:8].unsqueeze(0).to(device)
        with torch.no_grad():
            generated = model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
        print(f"losses: {' '.join(f'{x:.3f}' for x in losses)}")
        print(f"saved to {final}; generated after {prompt[0].tolist()}: {generated[0, 8:].tolist()}")
        if store is not None:
            print(f"peak RSS {peak_rss_bytes() / 2**20:.0f} MiB; host budget "
                  f"{store.config.host_budget_bytes / 2**20:.0f} MiB")
        if store is not None:
            print(f"drive: {store.stats_dict()['bytes_read_nvme'] / 2**20:.1f} MiB read, "
                  f"{store.stats_dict()['bytes_written_nvme'] / 2**20:.1f} MiB written")
            if isinstance(opt, OffloadedAdamW):
                opt.close()
            if off is not None:
                off.remove(keep_values=False)  # saved above: nothing to read back when the store closes
        done = True
        return {"losses": losses, "generated": generated[0].tolist(), "final": final,
                "merged": os.path.join(args.output, "merged") if args.lora and off is not None else None}
    finally:
        if store is not None:
            # after an error, which goes on, a close that cannot give the model its values back must not hide it
            with contextlib.suppress(*(() if done else (ts.StoreInUseError,))):
                store.close()


if __name__ == "__main__":
    main()
