"""`tierstore plan`: the ZeRO-3 worked example, placement under budgets, and bad input."""

import json

import pytest

from tierstore.tools import cli as _cli
from tierstore.tools.plan import PlanConfig, format_plan, make_plan


def test_seed_example_7b_on_8_ranks(capsys, tmp_path):
    assert _cli.main(["plan", "--params", "7e9", "--ranks", "8", "--dtype", "bf16", "--json",
                      str(tmp_path / "p.json")]) == 0
    plan = json.loads((tmp_path / "p.json").read_text())
    t, r = plan["totals"], plan["per_rank"]
    assert t["weights"] == 14e9  # bf16
    assert t["moments"] == 56e9 and t["optimizer_state"] == 84e9  # with the fp32 master copy
    assert r["moments"] == 7e9
    # Each all-gather brings the other 7/8 of 14 GB of weights into every rank, twice a step (forward, backward);
    # the reduce-scatter sends 7/8 of the 14 GB of gradients. With the weights on the drive, their shards
    # come to the device before each all-gather and the gradient shards go down to the CPU optimizer.
    tr = plan["traffic_per_step"]
    assert tr["all_gather"] == 24.5e9 and tr["reduce_scatter"] == 12.25e9
    assert tr["host_to_device"] == 2 * 1.75e9 and tr["device_to_host"] == 1.75e9
    out = capsys.readouterr().out
    assert "all gather 24.50  reduce scatter 12.25" in out
    assert "Adam moments (fp32 m, v)           56.00          7.00" in out
    assert "optimizer state, all               84.00         10.50" in out


def test_placement_follows_budgets():
    gb = 10**9
    plan = make_plan(PlanConfig(params=7 * gb, ranks=8, device_budget_bytes=4 * gb, host_budget_bytes=16 * gb))
    assert plan["homes"] == {"weights": "device", "optimizer_state": "host"}  # 1.75 GB, then 10.5 of 12 GB
    assert plan["traffic_per_step"]["nvme_read"] == 0
    # The optimizer steps on the CPU: gradient shards go down, updated weight shards come back up.
    assert plan["traffic_per_step"]["device_to_host"] == plan["traffic_per_step"]["host_to_device"] == 1.75e9
    plan = make_plan(PlanConfig(params=7 * gb, ranks=8, host_budget_bytes=8 * gb))
    assert plan["homes"] == {"weights": "host", "optimizer_state": "nvme"}
    # the state, and the fp32 gradients kept from backward to the step, which spill beside it
    assert plan["traffic_per_step"]["nvme_read"] == plan["per_rank"]["optimizer_state"] + 4 * 7 * gb / 8
    inb = make_plan(PlanConfig(params=7 * gb, ranks=8, host_budget_bytes=8 * gb, step_in_backward=True))
    assert inb["traffic_per_step"]["nvme_read"] == inb["traffic_per_step"]["nvme_write"] == 10.5e9
    plan = make_plan(PlanConfig(params=7 * gb, ranks=1, nvme_budget_bytes=10 * gb))
    assert not plan["fits"]


def test_the_plan_prints_the_placement_a_rank_would_make(capsys):
    # ViT-large in fp32 with a third of its state as host budget, as `bench step --preset large` runs it.
    assert _cli.main(["plan", "--preset", "large", "--dtype", "fp32", "--host-budget", "1154MiB"]) == 0
    out = capsys.readouterr().out
    assert "over 24 equal layers" in out and "predicted" in out and "lower bound" in out
    plan = make_plan(PlanConfig(params=302_500_000, dtype="fp32", host_budget_bytes=1154 * 2**20))
    pl = plan["placement"]
    state = 302_500_000 * 12
    # The bound: what is not in the host tier is read and written once a step.
    assert pl["lower_bound_bytes"] == pytest.approx(2 * (state - 1154 * 2**20), rel=1e-3)
    assert pl["lower_bound_bytes"] < pl["bytes_per_step"] < 1.5 * pl["lower_bound_bytes"]
    assert set(pl["resident_by_kind"]) == {"weights"}  # weights first: read twice and written once a step
    # The forward reads only the weights that stream; the state moves from backward on.
    assert 0 < pl["forward_bytes"] < pl["moved_by_kind"]["weights"] and "read by the forward" in out
    assert make_plan(PlanConfig(params=10**6, host_budget_bytes=10**9))["placement"] is None  # all in memory
    with pytest.raises(ValueError, match="layers=0"):
        PlanConfig(params=1, layers=0)


@pytest.mark.parametrize("text,count", [("7e9", 7 * 10**9), ("7B", 7 * 10**9), ("350M", 350 * 10**6),
                                        ("1.5b", 1_500_000_000), ("125k", 125_000)])
def test_parameter_counts_as_people_write_them(tmp_path, text, count):
    assert _cli.main(["plan", "--params", text, "--json", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["config"]["params"] == count


def test_preset_and_bad_input(capsys):
    assert _cli.main(["plan", "--preset", "base", "--ranks", "2", "--dtype", "fp32"]) == 0
    assert "M parameters, fp32 weights" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="2"):
        _cli.main(["plan", "--params", "7e9", "--dtype", "int8"])
    assert "invalid choice: 'int8' (choose from 'fp32', 'bf16', 'fp16')" in capsys.readouterr().err
    assert _cli.main(["plan", "--preset", "huge"]) == 2
    assert _cli.main(["plan", "--params", "seven"]) == 2
    assert "give a count such as 7e9, 7B or 350M" in capsys.readouterr().err
    with pytest.raises(ValueError, match="ranks=0 must be >= 1"):
        PlanConfig(params=1, ranks=0)


def test_a_transformers_config_is_counted_exactly_and_the_plan_says_first_whether_it_fits(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    for tied in (True, False):
        config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=176,
                                          num_hidden_layers=3, num_attention_heads=4, tie_word_embeddings=tied,
                                          architectures=["LlamaForCausalLM"])
        config.save_pretrained(str(tmp_path / str(tied)))
        with torch.device("meta"):
            want = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
        assert _cli.main(["plan", "--hf-config", str(tmp_path / str(tied) / "config.json"), "--host-budget", "16GiB",
                          "--nvme-path", str(tmp_path), "--json", str(tmp_path / "p.json")]) == 0
        plan = json.loads((tmp_path / "p.json").read_text())
        assert plan["config"]["params"] == want and plan["config"]["layers"] == 3
        out = capsys.readouterr().out
        first = out.splitlines()[0]
        assert first.startswith("fits: ") and "free" in first
        assert "LlamaForCausalLM from" in out and "host 16.00 GiB of" in out  # GiB in, GiB out
    # the same model against a drive too small and a host budget larger than RAM: why, in the first line
    plan = make_plan(PlanConfig(params=7 * 10**9, host_budget_bytes=64 * 2**30, nvme_path=str(tmp_path),
                                free_bytes=78 * 10**9, ram_bytes=24 * 2**30, unit="GiB"))
    assert not plan["fits"]
    problems = " ".join(plan["checks"]["problems"])
    assert "has 72.64 GiB free and this plan puts" in problems
    assert "more than the RAM planned for (24.00 GiB, --ram)" in problems


def test_compressed_layouts_and_stepping_in_backward_shrink_the_drive_need():
    gb = 10**9
    base = make_plan(PlanConfig(params=7 * gb, host_budget_bytes=16 * gb, free_bytes=10**15, ram_bytes=10**12))
    small = make_plan(PlanConfig(params=7 * gb, host_budget_bytes=16 * gb, free_bytes=10**15, ram_bytes=10**12,
                                 moments="8bit", master="split", step_in_backward=True))
    # bf16 weights + fp32 master + fp32 moments + fp32 kept gradients: 2 + 4 + 8 + 4 bytes a parameter
    assert base["checks"]["drive_need"] == pytest.approx(18 * 7 * gb)
    assert small["checks"]["drive_need"] == pytest.approx((2 + 2 + 2 + 8 / 256) * 7 * gb)


def test_the_predicted_step_follows_the_placement_model(tmp_path, capsys):
    """Compute and drive rate given: the forward (a third of the compute, or its reads), then the rest."""
    plan = make_plan(PlanConfig(params=302_500_000, dtype="fp32", host_budget_bytes=1154 * 2**20, ram_bytes=10**12,
                                compute_seconds=3.0, drive_gbps=1.5, step_in_backward=True))
    pl, step = plan["placement"], plan["predicted_step"]
    rate = 1.5e9
    want = max(1.0, pl["forward_bytes"] / rate) + max(2.0, (pl["bytes_per_step"] - pl["forward_bytes"]) / rate)
    assert step["seconds"] == pytest.approx(want) and step["bytes_moved"] == pl["bytes_per_step"]
    assert make_plan(PlanConfig(params=10**6, ram_bytes=10**12))["predicted_step"] is None  # no rates given
    # the offload's own work per tensor adds to the compute (see [Note: The offload's own work])
    own = make_plan(PlanConfig(params=302_500_000, dtype="fp32", host_budget_bytes=1154 * 2**20, ram_bytes=10**12,
                               compute_seconds=3.0, drive_gbps=1.5, step_in_backward=True, tensors=300,
                               tensor_seconds=0.002))["predicted_step"]
    assert own["offload_seconds"] == pytest.approx(0.6)
    assert own["seconds"] == pytest.approx(max(1.2, pl["forward_bytes"] / rate)
                                           + max(2.4, (pl["bytes_per_step"] - pl["forward_bytes"]) / rate))
    with pytest.raises(ValueError, match="tensor_seconds=-1 must be >= 0"):
        PlanConfig(params=1, tensor_seconds=-1)
    assert _cli.main(["plan", "--params", "7B", "--host-budget", "16GiB", "--drive-gbps", "2", "--tflops", "1"]) == 0
    assert "not counted: the offload's own work per tensor (give --tensor-ms or --measure)" in capsys.readouterr().out
    assert _cli.main(["plan", "--params", "7B", "--host-budget", "16GiB", "--drive-gbps", "2", "--tflops", "1",
                      "--tensor-ms", "3", "--layers", "32"]) == 0
    assert "(291 tensors x 3.00 ms)" in capsys.readouterr().out  # estimated as a Llama's: 9 a layer, and 3
    assert _cli.main(["plan", "--params", "7B", "--host-budget", "18.3MiB"]) == 2
    assert "not a whole number: write it in a smaller unit (e.g. '18739KiB')" in capsys.readouterr().err




def _llama_7b_config(path, dtype="float16"):
    """Llama-2-7B's config.json, as published (float16)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                      architectures=["LlamaForCausalLM"], dtype=dtype)
    config.save_pretrained(str(path))
    return str(path / "config.json")


def test_a_measured_plan_for_a_device_counts_the_cpu_update_and_names_what_it_measured(tmp_path, capsys):
    """The issue's command on this machine: the config's dtype (float16) and layers, the device's working set,
    the drive checked at --nvme-path, and a predicted step with the optimizer's CPU update in it, measured on the
    device that will compute (this CPU here)."""
    import torch

    config = _llama_7b_config(tmp_path / "llama")
    assert _cli.main(["plan", "--hf-config", config, "--device-budget", "20GiB", "--host-budget", "48GiB",
                      "--nvme-path", str(tmp_path), "--measure", "--moments", "8bit", "--json",
                      str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    plan = json.loads((tmp_path / "p.json").read_text())
    cfg, step = plan["config"], plan["predicted_step"]
    assert cfg["dtype"] == "fp16" and cfg["layers"] == 32 and cfg["hidden"] == 4096 and cfg["tokens"] == 2048
    assert "fp16 weights" in out and "LlamaForCausalLM from" in out
    assert step["update_seconds"] > 0 and "the optimizer's CPU update" in out
    assert cfg["compute_device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert f"on {cfg['device_name']}" in out and (torch.cuda.is_available() or "the CPU (" in cfg["device_name"])
    ws = plan["device_working_set"]  # activations of 2048 tokens in 16 bits: 34 bytes a token and unit of width
    assert ws["activations"] == 34 * 4096 * 2048 * 32 and ws["layers_in_flight"] > 0
    assert plan["checks"]["drive_path"] == str(tmp_path) and plan["checks"]["drive_free"] > 0
    # the same step without the update's seconds is shorter by them at most (they add on the CPU)
    cfg_fields = {k: v for k, v in cfg.items() if k in PlanConfig.__dataclass_fields__}
    without = make_plan(PlanConfig(**{**cfg_fields, "update_seconds": None}))["predicted_step"]["seconds"]
    assert without < step["seconds"] <= without + step["update_seconds"] + 1e-9


def test_plan_errors_in_one_line_and_reads_the_model_from_its_config(tmp_path, capsys):
    assert _cli.main(["plan", "--hf-config", str(tmp_path / "missing" / "config.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file or directory" in err
    (tmp_path / "bad.json").write_text("{not json")
    assert _cli.main(["plan", "--hf-config", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a transformers config" in err
    config = _llama_7b_config(tmp_path / "bf16", dtype="bfloat16")
    assert _cli.main(["plan", "--hf-config", config, "--master-weights", "split", "--json",
                      str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["config"]["dtype"] == "bf16"
    assert _cli.main(["plan", "--hf-config", config, "--dtype", "fp16", "--master-weights", "split"]) == 2
    assert "needs bf16 weights" in capsys.readouterr().err
    assert _cli.main(["plan", "--hf-config", config, "--dtype", "fp32", "--json", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["config"]["dtype"] == "fp32"  # given beats the config's
    capsys.readouterr()
    # --params: the layers of a Llama of that size unless given (7B: 32), said in the plan's first lines
    assert _cli.main(["plan", "--params", "7B", "--json", str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["config"]["layers"] == 32
    assert "32 layers estimated from the count" in capsys.readouterr().out


def test_the_device_budget_holds_the_activations_and_layers_in_flight(tmp_path):
    gb = 10**9
    args = dict(params=7 * gb, dtype="bf16", layers=32, hidden=4096, host_budget_bytes=48 * gb,
                free_bytes=10**15, ram_bytes=10**12)
    small = make_plan(PlanConfig(**args, tokens=16384, device_budget_bytes=20 * gb))
    assert not small["fits"] and "on the device" in small["checks"]["problems"][0]
    assert "fewer --tokens" in small["checks"]["problems"][0]
    ok = make_plan(PlanConfig(**args, tokens=2048, device_budget_bytes=20 * gb))
    # 9.1 GB of activations and 1.3 of layers in flight leave 9.6 GB of 20: the 14 GB of weights stay off it
    assert ok["fits"] and ok["homes"]["weights"] == "host"
    roomy = make_plan(PlanConfig(**args, tokens=2048, device_budget_bytes=40 * gb))
    assert roomy["homes"]["weights"] == "device"


# The 7B for a 24 GB GPU, planned from another machine with its figures given: the case of the first-contact review.
_OTHER_GPU = ["--device", "cuda", "--device-budget", "20GiB", "--tflops", "150", "--drive-gbps", "3",
              "--link-gbps", "20"]


def test_planning_for_another_machine_checks_nothing_against_this_ones_ram(tmp_path, capsys):
    config = _llama_7b_config(tmp_path / "llama")
    # a host budget no test machine has: given the other machine's figures, this machine's RAM is not checked
    assert _cli.main(["plan", "--hf-config", config, *_OTHER_GPU, "--host-budget", "64TiB", "--json",
                      str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("fits: ") and "RAM not checked (planning for another machine: give --ram" in first
    assert "this machine's RAM" not in out and "host 64.00 TiB (RAM not checked" in out
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["checks"]["ram"] is None and plan["checks"]["this_machine"] is False
    # nor the drive where this machine's store would put its swap files (the default host budget, a third of the
    # state, sends the rest there)
    assert _cli.main(["plan", "--hf-config", config, *_OTHER_GPU, "--json", str(tmp_path / "p.json")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["checks"]["drive_need"] > 0 and plan["checks"]["drive_path"] is None
    assert "the drive's free space not checked (planning for another machine: give --nvme-path to check a drive)" \
        in first
    # --ram checks it, and says whose RAM it was
    assert _cli.main(["plan", "--hf-config", config, *_OTHER_GPU, "--host-budget", "64TiB", "--ram", "64GiB"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("does not fit: the host budget (64.00 TiB) is more than the RAM planned for (0.06 TiB, "
                            "--ram)")
    # with no figure of another machine, the plan is for this one: its RAM is checked as before
    gb = 10**9
    here = make_plan(PlanConfig(params=7 * gb, host_budget_bytes=2**50, free_bytes=10**15))
    assert here["checks"]["this_machine"] and "more than this machine's RAM" in here["checks"]["problems"][0]
    given = make_plan(PlanConfig(params=7 * gb, host_budget_bytes=2**50, free_bytes=10**15, compute_seconds=1.0,
                                 drive_gbps=3.0))
    assert given["fits"] and given["checks"]["ram"] is None
    measured = make_plan(PlanConfig(params=7 * gb, host_budget_bytes=2**50, free_bytes=10**15, compute_seconds=1.0,
                                    drive_gbps=3.0, device_name="the CPU (2 cores)"))  # --measure timed it here
    assert not measured["fits"] and measured["checks"]["this_machine"]


def test_every_term_the_predicted_step_leaves_out_is_named_beside_it(tmp_path, capsys):
    config = _llama_7b_config(tmp_path / "llama")
    base = ["plan", "--hf-config", config, "--device", "cuda", "--device-budget", "20GiB", "--tflops", "150",
            "--drive-gbps", "3", "--ram", "64GiB", "--optimizer-step", "after-backward", "--json",
            str(tmp_path / "p.json")]
    assert _cli.main(base) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("predicted step:"))
    left_out = line.split("; not counted: ")[1]
    assert line.startswith("predicted step: at least ")  # each missing term only adds: the figure is a floor
    for term in ("the offload's own work per tensor (give --tensor-ms or --measure)",
                 "the optimizer's CPU update (give --update-ns or --measure)",
                 "host<->device copies (give --link-gbps or --measure)"):
        assert term in left_out
    floor = json.loads((tmp_path / "p.json").read_text())["predicted_step"]
    assert len(floor["not_counted"]) == 3
    # given, each is counted and the prediction is no longer called a floor
    assert _cli.main([*base, "--update-ns", "2", "--tensor-ms", "1", "--link-gbps", "20"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("predicted step:"))
    assert "not counted" not in line and "at least" not in line and "the optimizer's CPU update" in line
    whole = json.loads((tmp_path / "p.json").read_text())["predicted_step"]
    assert whole["not_counted"] == [] and whole["seconds"] > floor["seconds"]
    # over ranks, the collectives: no network rate is asked for, so they are named
    assert _cli.main([*base, "--update-ns", "2", "--tensor-ms", "1", "--link-gbps", "20", "--ranks", "2"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("predicted step:"))
    assert "not counted: the all-gather and reduce-scatter between the 2 ranks (18.83 GiB a step)" in line


def test_the_drive_has_one_figure_a_step_the_one_the_prediction_takes(tmp_path, capsys):
    config = _llama_7b_config(tmp_path / "llama")
    assert _cli.main(["plan", "--hf-config", config, *_OTHER_GPU, "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    plan = json.loads((tmp_path / "p.json").read_text())
    assert "nvme read" not in out and "nvme write" not in out and " predicted (" not in out
    (line,) = [x for x in out.splitlines() if x.startswith("drive per step per rank:")]
    d, step = plan["drive_per_step"], plan["predicted_step"]
    assert d["by"] == "placement" and d["bytes"] == step["bytes_moved"] == plan["placement"]["bytes_per_step"]
    assert d["seconds"] == pytest.approx(d["bytes"] / 3e9)
    assert line.startswith(f"drive per step per rank: {d['bytes'] / 2**30:.2f} GiB read and written, "
                           f"{d['seconds']:.2f} s at the drive's 3.00 GB/s mixed read+write rate (the placement's: ")
    assert f"the drive's {d['bytes'] / 2**30:.2f} GiB at 3.00 GB/s" in out  # the predicted step names the same
    # no host tier, no placement: what is homed on the drive, its reads and writes as parts of the one figure
    gb = 10**9
    plan = make_plan(PlanConfig(params=7 * gb, free_bytes=10**15, ram_bytes=10**12, drive_gbps=2.0,
                                compute_seconds=1.0))
    d, tr = plan["drive_per_step"], plan["traffic_per_step"]
    assert d["by"] == "homes" and d["bytes"] == tr["nvme_read"] + tr["nvme_write"] == plan["predicted_step"][
        "bytes_moved"]
    assert (f"drive per step per rank: {d['bytes'] / gb:.2f} GB read and written, {d['seconds']:.2f} s at the drive's "
            f"2.00 GB/s mixed read+write rate ({tr['nvme_read'] / gb:.2f} read + {tr['nvme_write'] / gb:.2f} "
            "written: what is homed on the drive)") in format_plan(plan)


def test_the_plan_says_what_stays_on_the_device_and_what_streams_through_it(tmp_path, capsys):
    config = _llama_7b_config(tmp_path / "llama")
    assert _cli.main(["plan", "--hf-config", config, *_OTHER_GPU, "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    dev = json.loads((tmp_path / "p.json").read_text())["device"]
    # 20 GiB less 9.68 of working set leaves 10.32: the 12.55 GiB of fp16 weights do not fit, so they stream
    assert dev["resident"] == {} and dev["resident_bytes"] == 0
    assert "on the device per rank (budget 20.00 GiB): kept there nothing (the weights, 12.55 GiB, are more than " \
           "the 10.32 GiB the budget leaves beside the step's working set); streamed a step: each layer's weights " \
           "up through the host tier for forward and backward 25.10 GiB, the gradients down to the CPU's update " \
           "12.55 GiB" in out
    gb = 10**9
    roomy = make_plan(PlanConfig(params=7 * gb, layers=32, hidden=4096, tokens=2048, device_budget_bytes=40 * gb,
                                 host_budget_bytes=48 * gb, free_bytes=10**15, ram_bytes=10**12))
    dev = roomy["device"]
    assert dev["resident"] == {"weights": 14 * gb} and dev["streamed_in_bytes_per_step"] == 14 * gb
    assert ("on the device per rank (budget 40.00 GB): kept there the weights, 14.00 GB; streamed a step: the "
            "updated weights up from the CPU's update 14.00 GB, the gradients down to the CPU's update 14.00 GB"
            in format_plan(roomy))
    assert make_plan(PlanConfig(params=10**6, ram_bytes=10**12))["device"] is None  # the host computes


@pytest.mark.parametrize("page,args", [
    ("planning.md", [*_OTHER_GPU]),
    ("gpu.md", ["--dtype", "bf16", "--moments", "8bit", "--master-weights", "split", "--optimizer-step",
                "after-backward", "--device", "cuda", "--device-budget", "20GiB", "--host-budget", "24GiB", "--ram",
                "64GiB", "--tflops", "400", "--drive-gbps", "6", "--link-gbps", "25", "--update-ns", "0.5",
                "--tensor-ms", "1", "--nvme-path", "NVME"])])
def test_the_plan_output_in_the_docs_is_what_plan_prints(tmp_path, capsys, page, args):
    import os
    import re

    with open(os.path.join(os.path.dirname(__file__), "..", "docs", page)) as f:
        (sample,) = re.findall(r"```\n((?:fits: |on the device per rank).*?)```", f.read(), re.S)
    config = _llama_7b_config(tmp_path / "llama-2-7b")
    assert _cli.main(["plan", "--hf-config", config, *[str(tmp_path) if a == "NVME" else a for a in args]]) == 0
    printed = capsys.readouterr().out.splitlines()
    for line in sample.splitlines():
        assert line in printed

