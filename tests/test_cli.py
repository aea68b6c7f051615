"""The command line's vocabulary (docs/cli.md): one flag and one default per concept in every command that has
it, and a flag that a mode ignores is an error."""

from __future__ import annotations

import argparse
import pathlib

import pytest

from tierstore.tools import cli, flags, fsdp_train

# concept (argparse dest) -> (its flag, its default); every command that has the concept has exactly this
VOCABULARY = {
    "nvme_path": ("--nvme-path", None),
    "host_budget": ("--host-budget", None),
    "device_budget": ("--device-budget", None),
    "dtype": ("--dtype", "fp32"),
    "moments": ("--moments", "fp32"),
    "master": ("--master-weights", "fp32"),
    "optimizer_step": ("--optimizer-step", "in-backward"),
    "prefetch_depth": ("--prefetch-depth", "auto"),
    "json": ("--json", None),
    "batch_size": ("--batch-size", None),  # each command's own batch: images, rows
    "steps": ("--steps", None),
}
# where a command's default differs, and why (each said in its --help too)
DIFFERENT_DEFAULTS = {
    ("plan", "dtype"): None,  # the --hf-config's dtype, else fp32
    ("bench peers", "prefetch_depth"): 4,  # one cold forward: no step to choose a depth from
}


def _commands() -> dict[str, argparse.ArgumentParser]:
    out = {"fsdp_train": fsdp_train.build_parser()}

    def walk(parser: argparse.ArgumentParser, prefix: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{prefix} {name}".strip())
                return
        out[prefix] = parser

    walk(cli.build_parser(), "")
    return out


def test_every_command_says_each_concept_with_one_flag_and_one_default():
    commands = _commands()
    assert {"plan", "demo", "bench step", "bench peers", "bench drive", "gc", "fsdp_train"} <= set(commands)
    seen = {concept: [] for concept in VOCABULARY}
    for name, parser in commands.items():
        for action in parser._actions:
            if action.dest not in VOCABULARY:
                continue
            flag, default = VOCABULARY[action.dest]
            assert action.option_strings[0] == flag, (name, action.option_strings)
            if (name, action.dest) in DIFFERENT_DEFAULTS:
                assert action.default == DIFFERENT_DEFAULTS[name, action.dest], (name, action.dest)
                assert "default" in (action.help or ""), (name, action.dest)
            elif default is not None:
                assert action.default == default, (name, action.dest, action.default)
            seen[action.dest].append(name)
    assert {"plan", "demo", "bench step", "fsdp_train"} <= set(seen["optimizer_step"])
    assert {"plan", "demo", "fsdp_train"} <= set(seen["master"]) & set(seen["moments"])
    assert {"plan", "demo", "bench step", "bench peers", "fsdp_train"} <= set(seen["host_budget"])
    assert {"demo", "bench peers", "fsdp_train"} <= set(seen["prefetch_depth"])


def test_the_docs_table_lists_each_concept_once_with_its_flag():
    table = (pathlib.Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    for flag, _ in VOCABULARY.values():
        assert sum(f"`{flag}" in row.split("|")[2] for row in rows) == 1, flag


def test_each_command_accepts_its_concepts_flags(tmp_path):
    parser = cli.build_parser()
    args = parser.parse_args(["demo", "--optimizer-step", "after-backward", "--master-weights", "split",
                              "--moments", "8bit", "--dtype", "bf16", "--prefetch-depth", "3", "--nvme-path",
                              str(tmp_path), "--host-budget", "64MiB", "--device-budget", "1MiB"])
    assert (args.optimizer_step, args.master, args.prefetch_depth) == ("after-backward", "split", 3)
    args = parser.parse_args(["plan", "--params", "7B", "--optimizer-step", "after-backward", "--master-weights",
                              "split", "--dtype", "bf16", "--host-budget", "16GiB"])
    assert (args.optimizer_step, args.master, args.dtype) == ("after-backward", "split", "bf16")
    args = parser.parse_args(["bench", "peers", "--prefetch-depth", "auto", "--nvme-path", str(tmp_path)])
    assert args.prefetch_depth == "auto"
    args = fsdp_train.build_parser().parse_args(["--optimizer-step", "after-backward", "--master-weights", "split",
                                                 "--prefetch-depth", "auto", "--host-budget", "1MiB"])
    assert (args.master, args.prefetch_depth, args.host_budget) == ("split", "auto", 2**20)
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--prefetch-depth", "deep"])


@pytest.mark.parametrize("argv", [
    ["bench", "step", "--compile", "--depths", "0,2"],
    ["bench", "step", "--compile", "--dtype", "bf16"],
    ["bench", "step", "--compile", "--layouts", "8bit/split"],
    ["bench", "step", "--budget-sweep", "2,3", "--trace", "t.json"],
    ["bench", "step", "--budget-sweep", "2,3", "--layouts", "8bit/split"],
    ["bench", "step", "--budget-sweep", "2,3", "--host-budget", "64MiB"],
], ids=["compile-depths", "compile-dtype", "compile-layouts", "sweep-trace", "sweep-layouts", "sweep-host-budget"])
def test_a_flag_the_mode_ignores_is_an_error(argv, capsys):
    with pytest.raises(SystemExit, match="2"):
        cli.main(argv)
    err = capsys.readouterr().err
    assert "no effect with --" in err and "drop it" in err
    flag = next(a for a in argv[3:] if a.startswith("--"))
    assert flag in err.split("error:")[1]


def test_the_vocabulary_module_names_what_the_commands_use():
    assert flags.OPTIMIZER_STEPS == ("in-backward", "after-backward")
    assert set(flags.MOMENTS) == {"fp32", "bf16", "8bit"} and set(flags.MASTERS) == {"fp32", "split", "none"}
