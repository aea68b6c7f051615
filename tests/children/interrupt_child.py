"""A run stopped by a real Ctrl-C (SIGINT to the main thread): argv MODE NVME_DIR, MODE "forward" (inside the
model's forward, on the main thread) or "accumulate" (while off.accumulate's micro-batch threads run and the main
thread waits for them). Prints the swap directory, then the KeyboardInterrupt's notes; with "resume" after the mode
it then runs the step again and prints "resumed"; else it lets the interrupt end the process."""

import signal
import sys
import threading

import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import tierstore as ts
from tierstore.integrations import OffloadedAdamW, offload_model


def main(mode: str, nvme: str, resume: bool) -> None:
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                                   num_attention_heads=4)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    store = ts.TierStore(nvme_path=nvme, host_budget_bytes="8MiB", file_size_bytes="4MiB")
    print(store.swap_directory, flush=True)
    off = offload_model(model, store, units=[LlamaDecoderLayer])
    opt = OffloadedAdamW(off, lr=1e-3)
    main_thread = threading.main_thread().ident
    sent = []

    def ctrl_c(module, args):
        if not sent:
            sent.append(True)
            signal.pthread_kill(main_thread, signal.SIGINT)  # what the terminal sends the foreground process

    layer = model.model.layers[1]
    handle = layer.register_forward_pre_hook(ctrl_c)

    def step_fn(ids):
        (model(ids, labels=ids).loss / 2).backward()

    def step():
        ids = [torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(2)]
        if mode == "accumulate":
            off.accumulate(step_fn, ids)
        else:
            for mb in ids:
                step_fn(mb)
                threading.Event().wait(0.05)  # the signal's handler runs here at the latest
        opt.step()
        opt.zero_grad()

    try:
        step()
    except KeyboardInterrupt as e:
        print("\n".join(getattr(e, "__notes__", [])), flush=True)
        if not resume:
            raise
    handle.remove()
    opt.zero_grad()
    step()
    assert off.stats.loop_steps == 0, off.layer_major_refused  # the step ran again layer by layer where asked
    print("resumed", flush=True)
    store.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], len(sys.argv) > 3 and sys.argv[3] == "resume")
