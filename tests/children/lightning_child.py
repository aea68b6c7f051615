"""PyTorch Lightning as its users write it, with tierstore: the store, ``offload_model`` and ``OffloadedAdamW`` made
in ``configure_optimizers``, ``gradient_clip_val``, ``accumulate_grad_batches``, ``ModelCheckpoint`` (each epoch's
end), resume with ``ckpt_path=``. Prints, as JSON, the losses and a SHA-256 of the final weights' bytes, and where
a checkpoint was saved, how far the anonymous RSS rose while Lightning saved it.

    python lightning_child.py ROOT MODE [--plain] [--default-io]

MODE: ``whole`` (two epochs), ``first`` (one epoch, checkpointed), ``resume`` (from ``first``'s checkpoint to the
end of the second epoch; the rise of the anonymous RSS from reading the checkpoint to the end of restoring
it). ``--plain``: torch.optim.AdamW and no offload; ``--default-io``: Lightning's own
checkpoint writer instead of ``MappedCheckpointIO``.
"""

import hashlib
import json
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import tierstore as ts
from tierstore.integrations import OffloadedAdamW, offload_model
from tierstore.integrations.lightning import MappedCheckpointIO
from tierstore.tools.rss import AnonRssPeak, anon_rss_bytes

warnings.simplefilter("ignore")  # Lightning's advice on workers and loggers
import pytorch_lightning as pl  # noqa: E402

HOST_BUDGET = 4 * 2**20


class Net(pl.LightningModule):
    def __init__(self, root: str, plain: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Linear(512, 512) for _ in range(12)], nn.Linear(512, 10))  # 12 MiB of weights
        self.root, self.plain, self.losses = root, plain, []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.plain:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=False)
        self.store = ts.TierStore(nvme_path=os.path.join(self.root, "nvme"), host_budget_bytes=HOST_BUDGET)
        self.offload = offload_model(self.net, self.store)
        return OffloadedAdamW(self.offload, lr=1e-3)


def main() -> None:
    root, mode = sys.argv[1:3]
    plain, default_io = "--plain" in sys.argv, "--default-io" in sys.argv
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 512, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(8)]
    model = Net(root, plain)
    trainer = pl.Trainer(max_epochs=1 if mode == "first" else 2, accelerator="cpu", devices=1, gradient_clip_val=1.0,
                         accumulate_grad_batches=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True, default_root_dir=os.path.join(root, mode),
                         plugins=[] if default_io else [MappedCheckpointIO()])
    saves = []
    original = trainer.strategy.checkpoint_io.save_checkpoint

    def measured(*args, **kwargs):
        before = anon_rss_bytes()
        with AnonRssPeak() as peak:
            original(*args, **kwargs)
        saves.append(peak.peak_bytes - before)

    trainer.strategy.checkpoint_io.save_checkpoint = measured
    # a resume, from reading the checkpoint to letting it go (the model's and the optimizer's states restored)
    connector, loads = trainer._checkpoint_connector, []
    resume_start, resume_end = connector.resume_start, connector.resume_end

    def start(*args, **kwargs):
        loads.append((anon_rss_bytes(), AnonRssPeak().__enter__()))
        return resume_start(*args, **kwargs)

    def end(*args, **kwargs):
        out = resume_end(*args, **kwargs)
        if loads and isinstance(loads[-1], tuple):
            before, peak = loads.pop()
            peak.__exit__(None, None, None)
            loads.append(peak.peak_bytes - before)
        return out

    connector.resume_start, connector.resume_end = start, end
    ckpt = None
    if mode == "resume":
        ckpt = next(os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "first")) for f in fs
                    if f.endswith(".ckpt"))
    trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=ckpt)
    weights = hashlib.sha256()
    for name, _ in model.net.named_parameters():
        value = model.offload.read_param(name) if not plain else dict(model.net.named_parameters())[name].detach()
        weights.update(value.contiguous().view(torch.uint8).numpy().tobytes())
    state_bytes = 0 if plain else sum(model.store.info(k)["nbytes"] for k in model.store.keys())
    print(json.dumps({"losses": model.losses, "weights": weights.hexdigest(), "save_rise_bytes": saves, "load_rise_bytes": loads,
                      "state_bytes": state_bytes, "host_budget_bytes": HOST_BUDGET}))


if __name__ == "__main__":
    main()
