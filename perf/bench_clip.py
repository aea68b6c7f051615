"""The clip tax: a loop that clips by the global norm against the step that updates inside backward.

    python perf/bench_clip.py --nvme-path DIR [--max-norm 1.0] [--keep-grads yes] [--code-grads yes] [--rounds 2]
        [--steps 3]

The model is DeepSpeed's ZeRO-3 anchor: ``--layers`` x (``Linear(--width)`` + ReLU), fp32 (48 x 2048: 201M
parameters), a batch of ``--batch`` rows, MSE loss, parameters and Adam state on the drive under a
``--host-budget`` host tier. Four loops train it on the same batches, each in its own store (the three that step
after backward with ``keep_grads=False``, as their ``zero_grad()`` drops each gradient anyway, unless
``--keep-grads yes``; with ``--code-grads yes`` the speculated loop's ``OffloadedAdamW(code_grads=True)`` codes a
speculated update's kept gradient, see [Note: A kept gradient coded against its moments]):

- **in-backward** (the reference): ``OffloadedAdamW(step_in_backward=True)``, no clipping: each update runs as its
  gradient completes, beside the rest of backward;
- **clipped**: ``loss.backward()``, ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``,
  ``opt.step()``: every update waits for the whole backward and runs while nothing computes;
- **streamed**: the same loop with ``OffloadedAdamW(stream_update=True)``: ``step()`` queues the updates and each
  runs while the next forward computes (see [Note: Updates streamed into the next forward]);
- **speculated**: the same loop with ``OffloadedAdamW(speculate="auto", stream_update=True)``: each update is made
  in backward; ``step()`` keeps those the clip left unchanged and undoes the others, which it then streams, and
  speculates no more until a step does not clip (see [Note: Speculated updates], [Note: When to speculate]).

Rounds alternate the loops, ``--steps`` steps each (the first round warms them up and is not counted; a block's time
includes waiting for its last step's updates and writes). Printed: each loop's median step time and its ratio to the
reference, the share of each loop's drive bytes that moved inside ``opt.step()`` (while the training loop waited)
and during the forward (where a streamed step's updates run, beside the forward's own reads), how many updates were
speculated, kept and undone (and how many kept gradients were coded), and whether the clipped, streamed and
speculated models end bit-identical (and, where ``--max-norm`` is never reached, the reference too). The anchor's
gradient norm is about 0.009, so 1.0 never clips; ``--max-norm 1e-4`` clips every step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

LOOPS = ("in-backward", "clipped", "streamed", "speculated")
MIB = 1024**2


class _Run:
    """One loop's model, store and optimizer, and its figures."""

    def __init__(self, loop: str, args: argparse.Namespace, nvme_path: str) -> None:
        import torch

        import tierstore as ts
        from tierstore.integrations import OffloadedAdamW, offload_model

        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers)
        self.loop = loop
        host = ts.parse_bytes(args.host_budget, name="--host-budget")
        self.store = ts.TierStore(nvme_path=nvme_path, host_budget_bytes=host, device_budget_bytes=host // 4)
        self.off = offload_model(self.model, self.store)
        self.opt = OffloadedAdamW(self.off, lr=1e-3, step_in_backward=loop == "in-backward",
                                  stream_update=loop in ("streamed", "speculated"),
                                  speculate="auto" if loop == "speculated" else False,
                                  keep_grads=args.keep_grads == "yes",
                                  code_grads=loop == "speculated" and args.code_grads == "yes")
        self.clip = None if loop == "in-backward" else args.max_norm
        self.step_seconds: list[float] = []
        self.moved = self.inside_step = self.in_forward = 0
        self.norms: list[float] = []

    def _drive_bytes(self) -> int:
        stats = self.store.stats
        return int(stats.path("nvme->host")[0] + stats.path("host->nvme")[0])

    def block(self, batches: list, counted: bool) -> None:
        import torch
        import torch.nn.functional as F

        start, before = time.perf_counter(), self._drive_bytes()
        inside = forward = 0
        for x, y in batches:
            at = self._drive_bytes()
            out = self.model(x)
            forward += self._drive_bytes() - at
            F.mse_loss(out, y).backward()
            if self.clip is not None:
                self.norms.append(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip).item())
            at = self._drive_bytes()
            self.opt.step()
            inside += self._drive_bytes() - at
            self.opt.zero_grad()
        self.opt.wait()  # the last step's updates and writes belong to this block
        if counted:
            self.step_seconds.append((time.perf_counter() - start) / len(batches))
            self.moved += self._drive_bytes() - before
            self.inside_step += inside
            self.in_forward += forward

    def close(self) -> dict:
        state = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.opt.close()
        self.store.close()
        return state


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nvme-path", default=None, help="where the swap files go (a temporary folder by default)")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--host-budget", default="800MiB")
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--keep-grads", choices=("yes", "no"), default="no",
                   help="OffloadedAdamW(keep_grads=...) of the loops that step after backward (no: each gradient "
                        "goes at step(), as the loop's zero_grad() drops it)")
    p.add_argument("--code-grads", choices=("yes", "no"), default="no",
                   help="OffloadedAdamW(code_grads=...) of the speculated loop (yes: a speculated update's kept "
                        "gradient is coded against its moments; needs --keep-grads no)")
    p.add_argument("--rounds", type=int, default=2, help="counted rounds (after one that warms up)")
    p.add_argument("--steps", type=int, default=3, help="steps of each loop a round")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.code_grads == "yes" and args.keep_grads == "yes":
        p.error("--code-grads yes codes the gradients that go at step(): it needs --keep-grads no")

    import torch

    with tempfile.TemporaryDirectory(dir=args.nvme_path) as nvme:
        runs = {loop: _Run(loop, args, nvme) for loop in LOOPS}
        params = sum(t.numel() for t in runs["clipped"].model.parameters())
        print(f"anchor model: {args.layers} x Linear({args.width}) + ReLU, {params / 1e6:.1f}M parameters, fp32, "
              f"batch {args.batch}, host budget {args.host_budget}, max_norm {args.max_norm:g}")
        g = torch.Generator().manual_seed(1)
        step = 0
        for r in range(args.rounds + 1):
            batches = []
            for _ in range(args.steps):
                batches.append((torch.randn(args.batch, args.width, generator=g),
                                torch.randn(args.batch, args.width, generator=g)))
                step += 1
            for loop in (LOOPS if r % 2 == 0 else LOOPS[::-1]):  # alternate which goes first
                runs[loop].block(batches, counted=r > 0)
        clipped_norms = runs["clipped"].norms
        speculation = {k: runs["speculated"].store.stats_dict()[k]
                       for k in ("updates_speculated", "speculated_kept", "speculated_undone", "gradients_coded")}
        states = {loop: run.close() for loop, run in runs.items()}

    def same(a: str, b: str) -> bool:
        return all(torch.equal(states[a][k], states[b][k]) for k in states[a])

    ref = statistics.median(runs["in-backward"].step_seconds)
    results = []
    print(f"{'loop':<13}{'step s':>8}{'vs ref':>8}{'GB/step':>9}{'inside step()':>15}{'in forward':>12}")
    for loop in LOOPS:
        run = runs[loop]
        med = statistics.median(run.step_seconds)
        counted_steps = args.rounds * args.steps
        share = run.inside_step / run.moved if run.moved else 0.0
        forward = run.in_forward / run.moved if run.moved else 0.0
        results.append({"loop": loop, "step_seconds": med, "ratio": med / ref,
                        "bytes_per_step": run.moved / counted_steps, "inside_step_share": share,
                        "in_forward_share": forward})
        print(f"{loop:<13}{med:>8.2f}{med / ref:>7.2f}x{run.moved / counted_steps / 1e9:>9.2f}{share:>14.0%}"
              f"{forward:>11.0%}")
    clips = sum(n > args.max_norm for n in clipped_norms)
    never = clips == 0
    by = {r["loop"]: r for r in results}
    print(f"the reference: in-backward, {ref:.2f} s a step; " + ", ".join(
        f"{loop} {by[loop]['ratio']:.2f}x it" for loop in LOOPS[1:]) +
        f" (speculated/clipped {by['speculated']['step_seconds'] / by['clipped']['step_seconds']:.2f})")
    print(f"speculated: {speculation['updates_speculated']} updates made in backward, "
          f"{speculation['speculated_kept']} kept at step(), {speculation['speculated_undone']} undone and streamed; "
          f"{speculation['gradients_coded']} kept gradients coded against their moments")
    print(f"steps that clipped: {clips} of {len(clipped_norms)} (median norm {statistics.median(clipped_norms):.4g})")
    identical = {"clipped=streamed": same("clipped", "streamed"), "clipped=speculated": same("clipped", "speculated")}
    if never:
        identical["clipped=in-backward"] = same("clipped", "in-backward")
    print("bit-identical: " + ", ".join(f"{k} {v}" for k, v in identical.items()))
    out = {"params": params, "max_norm": args.max_norm, "results": results, "steps_clipped": clips,
           "identical": identical, "speculation": speculation}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
