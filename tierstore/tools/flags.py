"""The command line's vocabulary: one flag, one default and one unit per concept, in every command that has it
(docs/cli.md lists them). Each command adds its flags through these functions, and a flag that the chosen mode
of a command would ignore is an error (:func:`refuse_ignored`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

from tierstore import default_nvme_path
from tierstore.integrations.layouts import MASTERS, MOMENTS

DTYPES = ("fp32", "bf16", "fp16")
OPTIMIZER_STEPS = ("in-backward", "after-backward")

NVME_PATH_HELP = ("directory on the drive for the swap files (default: $TIERSTORE_NVME_PATH, else "
                  "$XDG_CACHE_HOME/tierstore or ~/.cache/tierstore)")
HOST_BUDGET_HELP = "host tier budget, e.g. 512MiB (default: a third of the state: weights and optimizer state)"
DEVICE_BUDGET_HELP = "device tier budget, e.g. 20GiB (default: a quarter of the weights with CUDA, 1 MiB without)"


def add_nvme_path(p: argparse.ArgumentParser, help: str = NVME_PATH_HELP) -> None:
    p.add_argument("--nvme-path", "--path", dest="nvme_path", default=None, help=help)


def add_budgets(p: argparse.ArgumentParser, *, per_rank: bool = False, host_default: str = "",
                device_default: str = "", parse: Callable[[str], int] | None = None) -> None:
    """--host-budget and --device-budget: parsed by ``parse``, or as written (the command parses them, erring in
    one line); ``*_default`` replaces the default's words where a command's differs, saying why."""
    rank = " per rank" if per_rank else ""
    host, device = (h.replace(" budget,", f" budget{rank},") for h in (HOST_BUDGET_HELP, DEVICE_BUDGET_HELP))
    if host_default:
        host = host.split("(default")[0] + f"(default: {host_default})"
    if device_default:
        device = device.split("(default")[0] + f"(default: {device_default})"
    p.add_argument("--host-budget", type=parse, help=host)
    p.add_argument("--device-budget", type=parse, help=device)


def add_dtype(p: argparse.ArgumentParser, choices: Iterable[str] = DTYPES, default: str | None = "fp32",
              help: str = "the weights' dtype (default fp32)") -> None:
    p.add_argument("--dtype", choices=list(choices), default=default, help=help)


def add_layout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--moments", choices=MOMENTS, default="fp32",
                   help="how OffloadedAdamW stores its moments (default fp32)")
    p.add_argument("--master-weights", dest="master", choices=MASTERS, default="fp32",
                   help="masters of bf16/fp16 weights: fp32, split (exact, 2 bytes) or none (stochastic rounding) "
                        "(default fp32)")


def add_optimizer_step(p: argparse.ArgumentParser) -> None:
    p.add_argument("--optimizer-step", choices=OPTIMIZER_STEPS, default="in-backward",
                   help="when the optimizer steps a parameter: in-backward, as soon as its gradient is ready "
                        "(overlapping backward, no gradient kept), or after-backward, in opt.step() (accumulation, "
                        "clipping; speculate=False) (default in-backward)")


def add_prefetch_depth(p: argparse.ArgumentParser, default: int | str = "auto", why: str = "") -> None:
    p.add_argument("--prefetch-depth", type=depth, default=default,
                   help=f"units read ahead of use, or 'auto' to choose each step (default {default}{why})")


def depth(text: str) -> int | str:
    """An argparse type: a prefetch depth >= 0, or 'auto'."""
    text = text.strip()
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give a depth >= 0 or 'auto'")
    return int(text)


def nvme_path(args: argparse.Namespace) -> str:
    return args.nvme_path or default_nvme_path()


def refuse_ignored(p: argparse.ArgumentParser, args: argparse.Namespace, mode: str, used: Iterable[str]) -> None:
    """Exit with an error naming each flag given that ``mode`` ignores: every flag of ``p`` set away from its
    default whose dest is not in ``used`` (nor the mode's own)."""
    keep = set(used)

    def default(a: argparse.Action) -> object:  # as argparse gives it: a string default goes through the type
        return a.type(a.default) if isinstance(a.default, str) and callable(a.type) else a.default

    ignored = [a.option_strings[0] for a in p._actions
               if a.option_strings and a.dest not in keep and a.dest != "help"
               and getattr(args, a.dest, a.default) != default(a)]
    if ignored:
        p.error(f"{', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect with {mode}: drop "
                f"{'it' if len(ignored) == 1 else 'them'}")


__all__ = ["DTYPES", "MASTERS", "MOMENTS", "OPTIMIZER_STEPS", "add_budgets", "add_dtype", "add_layout",
           "add_nvme_path", "add_optimizer_step", "add_prefetch_depth", "depth", "nvme_path",
           "refuse_ignored"]
