"""The main job at a tiny size: it trains, the loss falls, budgets hold, the figures are real."""

import copy
import json
import os

import pytest
import torch
from tierstore.integrations import OffloadedAdamW, offload_model

from tierstore.tools import bench_step as _bench_step
from tierstore.tools import cli as _cli
from tierstore.tools.demo import PRESET_LR
from tierstore.tools.vit import PRESETS, SyntheticImages, ViT

try:
    import matplotlib  # noqa: F401

    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False


def test_demo_tiny(tmp_path, capsys):
    out = tmp_path / "demo.json"
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    rc = _cli.main(["demo", "--preset", "tiny", "--steps", "6", "--batch-size", "16",
                    "--nvme-path", str(nvme), "--host-budget", "640KiB", "--device-budget", "320KiB",
                    "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    for word in ("loss", "stall s", "drive GB/s", "peak memory per tier", "peak RSS", "synthetic", "warm-up"):
        assert word in printed
    if not torch.cuda.is_available():  # the device tier is not used without CUDA: not shown
        assert "device" not in printed.split("peak memory per tier")[1].splitlines()[0]
    res = json.loads(out.read_text())
    steps = res["steps"]
    assert len(steps) == 6
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert all(s["read_bytes"] > 0 and s["written_bytes"] > 0 for s in steps)
    for tier in ("device", "host"):
        assert res["memory"][tier]["peak_bytes"] <= res["memory"][tier]["budget_bytes"]
    assert list(nvme.iterdir()) == []
    # Training adds the tier budgets plus a fixed overhead (activations, runtime) to the RSS, never the model's
    # state (~1.2 MiB here, so this bound says little at this size; the demo prints the figure at real sizes).
    assert res["peak_rss_bytes"] - res["rss_before_steps_bytes"] < 128 * 1024**2


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_demo_loss_falls_at_its_default_learning_rate(tmp_path, preset):
    out = tmp_path / "demo.json"
    assert _cli.main(["demo", "--preset", preset, "--steps", "6", "--batch-size", "16",
                      "--nvme-path", str(tmp_path), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    losses = [s["loss"] for s in res["steps"]]
    assert res["lr"] == PRESET_LR[preset] and losses[-1] < 0.8 * losses[0], losses


def test_demo_bf16_with_compressed_state_names_the_compute_it_chose(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert _cli.main(["demo", "--preset", "tiny", "--steps", "4", "--batch-size", "16", "--dtype", "bf16",
                      "--moments", "8bit", "--master-weights", "split", "--nvme-path", str(tmp_path), "--host-budget",
                      "640KiB", "--measure-drive", "16", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    drive = res["drive_mixed_gbps"]  # the drive measured before the first step and after each
    assert len(drive) == 5 and all(g > 0 for g in drive)
    for i, s in enumerate(res["steps"]):
        assert s["drive_share"] == pytest.approx(s["nvme_gbps"] / ((drive[i] + drive[i + 1]) / 2))
    times = res["product_seconds"]  # --compute auto: both timed, the faster kept
    assert res["compute"] == ("bf16" if times["param"] <= times["fp32"] else "fp32")
    printed = capsys.readouterr().out
    assert f"bf16 computed in {res['compute']} (the faster here" in printed
    assert "the drive's mixed read+write rate (the store moving 16 MiB) before the first step and after each" in printed
    assert all(s["loss"] == s["loss"] and s["read_bytes"] > 0 for s in res["steps"])
    with pytest.raises(SystemExit):  # argparse: "invalid choice", with the choices
        _cli.main(["demo", "--preset", "tiny", "--compute", "fp16", "--nvme-path", str(tmp_path)])


def test_demo_defaults_to_a_swap_path_outside_the_current_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TIERSTORE_NVME_PATH", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert _cli.main(["demo", "--preset", "tiny", "--steps", "1", "--batch-size", "2", "--lr", "1e-4"]) == 0
    assert f"under '{tmp_path / 'cache' / 'tierstore'}'" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["cache"]


def test_plot_without_matplotlib_fails_before_measuring(tmp_path, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert _cli.main(["bench", "step", "--preset", "tiny", "--nvme-path", str(tmp_path), "--plot", "p.png"]) == 2
    out = capsys.readouterr()
    assert "--plot needs matplotlib" in out.err and "resident step" not in out.out  # nothing was measured


def test_demo_bad_preset(tmp_path, capsys):
    assert _cli.main(["demo", "--preset", "huge", "--nvme-path", str(tmp_path)]) == 2
    assert "unknown preset 'huge'; choose one of" in capsys.readouterr().err


def test_bench_step_tiny(tmp_path, capsys):
    out = tmp_path / "step.json"
    # A host budget in which each setup keeps something beside its room (a fixed depth of 2: four units in flight,
    # and the parameters waiting for updates behind backward, see [Note: Updates behind backward]).
    rc = _cli.main(["bench", "step", "--preset", "tiny", "--batch-size", "8", "--depths", "0,2,auto", "--rounds", "2",
                    "--placement-ab", "--layouts", "8bit", "--nvme-path", str(tmp_path), "--host-budget", "1536KiB",
                    "--device-budget", "320KiB",
                    "--json", str(out), "--trace", str(tmp_path / "trace.json"),
                    *(["--plot", str(tmp_path / "p.png")] if HAVE_MATPLOTLIB else [])])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["resident_step_s"] > 0 and res["drive_gbps"] > 0
    assert set(res["depths"]) == {"0", "2", "auto", "2 w/o plan", "auto 8bit/fp32"}
    # 8-bit moments move fewer bytes a step than fp32 ones, in the same rounds
    assert res["depths"]["auto 8bit/fp32"]["bytes_per_step"] < res["depths"]["auto"]["bytes_per_step"]
    assert 1 <= res["depths"]["auto"]["chosen_depth"] and res["depths"]["2"]["chosen_depth"] == 2
    # Each setup planned its placement from its first step (the one without prints none); the bound is a bound.
    assert res["depths"]["2 w/o plan"]["predicted_bytes_per_step"] is None
    plan = res["placement"]
    assert 0 < plan["lower_bound_bytes"] <= plan["bytes_per_step"] == res["depths"]["auto"]["predicted_bytes_per_step"]
    assert res["depths"]["2"]["predicted_bytes_per_step"] >= plan["lower_bound_bytes"]
    # The prediction: the forward (its compute or its reads), then the rest (see [Note: The predicted step]).
    assert 0 < res["resident_forward_s"] < res["resident_compute_s"] and 0 <= plan["forward_bytes"]
    rate, forward = res["drive_gbps"] * 1e9, res["resident_forward_s"]
    assert plan["predicted_step_s"] == pytest.approx(
        max(forward, plan["forward_bytes"] / rate)
        + max(res["resident_compute_s"] - forward, (plan["bytes_per_step"] - plan["forward_bytes"]) / rate))
    assert res["depths"]["auto"]["predicted_step_s"] == plan["predicted_step_s"] >= res["resident_compute_s"]
    assert res["depths"]["2 w/o plan"]["predicted_step_s"] is None
    for d in res["depths"]:
        row = res["depths"][d]
        assert row["bytes_per_step"] > 0
        assert row["bound_s"] >= res["resident_compute_s"] and res["resident_step_s"] > res["resident_compute_s"] > 0
        assert row["overlap_efficiency"] == row["bound_s"] / row["step_s"]
        # The drive's rate is one it reached in this run, so its share of the bound never passes the step.
        assert row["bytes_per_step"] / (res["drive_gbps"] * 1e9) <= row["step_s"]
    assert len(res["drive_mixed_gbps_samples"]) == 3  # before the rounds and after each
    assert res["drive_gbps"] >= max(res["drive_mixed_gbps_samples"])
    assert res["serial"]["step_s"] > 0 and res["serial"]["bytes_per_step"] > 0
    rss = res["rss"]
    assert rss["within"] and rss["peak_rss_bytes"] > rss["runtime_rss_bytes"] > 0
    assert rss["allowed_bytes"] == (rss["budgets_bytes"] + rss["activations_bytes"] + rss["grad_backlog_bytes"]
                                    + rss["overhead_bytes"])
    printed = capsys.readouterr().out
    assert "overlap" in printed and "peak RSS (fresh process, depth 2)" in printed
    # Sizes and counts never read 0, each verdict is printed once, and nothing points into the source.
    assert "host budget 1.5 MiB, device 320.0 KiB" in printed and " 0M params" not in printed
    assert "[Note:" not in printed
    verdicts = [line.partition(": ")[2] for line in printed.splitlines() if line.startswith("depth")]
    assert len(verdicts) == len(set(verdicts))
    assert "higher is better" in printed and "lower bound" in printed and "   auto=" in printed
    if HAVE_MATPLOTLIB:
        assert f"plot written to {tmp_path / 'p.png'}" in printed and (tmp_path / "p.png").stat().st_size > 0
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert len(spans) == res["trace"]["events"]
    cats = {e["cat"] for e in spans}
    assert {"transfer", "compute", "optimizer"} <= cats
    names = {e["name"] for e in spans}
    assert {"nvme->host", "host->nvme", "forward blocks.0.fc1", "backward blocks.0.fc1"} <= names
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert any(e["ph"] == "M" and e["name"] == "thread_name" for e in trace)
    if HAVE_MATPLOTLIB:
        assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("fused", [False, True], ids=["default", "fused"])
def test_bench_step_bf16_and_its_resident_reference_computes_what_the_offloaded_step_does(tmp_path, make_store,
                                                                                          fused):
    """--dtype bf16: bf16 weights with fp32 masters; the resident reference steps torch's AdamW over fp32
    masters and rounds the weights from them, which is OffloadedAdamW's arithmetic: the same numbers (--fused:
    torch's fused kernel on both sides)."""
    res = _bench_step.run_step_bench(preset="tiny", batch_size=4, depths=[2], nvme_path=str(tmp_path), rounds=1,
                                     host_budget_bytes=None, device_budget_bytes=None, rss=False, dtype="bf16",
                                     fused=fused, log=lambda *a: None)
    assert res["dtype"] == "bf16" and res["depths"]["2"]["bytes_per_step"] > 0 and res["fused"] is fused
    row = res["depths"]["2"]  # the bound counts the whole resident step, the update's compute too
    assert row["bound_s"] >= res["resident_step_s"] > res["resident_compute_s"] > 0
    assert row["vs_resident"] == res["resident_step_s"] / row["step_s"]
    assert res["state_bytes"] == 14 * res["params"]
    cfg = PRESETS["tiny"]
    torch.manual_seed(0)
    ref = ViT(cfg).to(torch.bfloat16)
    model = copy.deepcopy(ref)
    data = SyntheticImages(cfg)
    off = offload_model(model, make_store(host_budget_bytes="2MiB"))
    opts = (_bench_step._MasterAdamW(ref, fused), OffloadedAdamW(off, lr=1e-3, fused=fused))
    for step in range(3):
        for m, o in zip((ref, model), opts):
            _bench_step.resident_step(m, data, 4, step, o, torch.bfloat16)
    opts[1].close()
    for name, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


def test_bench_step_budget_sweep_tiny(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    rc = _cli.main(["bench", "step", "--preset", "tiny", "--batch-size", "4", "--depths", "2", "--rounds", "1",
                    "--nvme-path", str(tmp_path), "--budget-sweep", "2,10", "--json", str(out),
                    *(["--plot", str(tmp_path / "s.png")] if HAVE_MATPLOTLIB else [])])
    assert rc == 0
    res = json.loads(out.read_text())
    rows = res["sweep"]
    assert [r["divisor"] for r in rows] == [2, 10]
    assert rows[0]["host_budget_bytes"] > rows[1]["host_budget_bytes"]
    for r in rows:
        assert r["step_s"] > 0 and r["bytes_per_step"] > 0 and r["bound_s"] >= r["resident_step_s"] > 0
        assert 0 < r["lower_bound_bytes"]
        assert r["placement_verdict"].startswith(("placement kept", "placement dropped", "no placement"))
        kept = r["placement_verdict"].startswith("placement kept")
        assert (r["predicted_step_s"] >= r["resident_compute_s"]) if kept else r["predicted_step_s"] is None
    assert rows[0]["lower_bound_bytes"] < rows[1]["lower_bound_bytes"]  # less budget, more to move
    printed = capsys.readouterr().out
    assert "budget sweep" in printed and "1/10" in printed and "bound MiB" in printed
    if HAVE_MATPLOTLIB:
        assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_peak_rss_stays_within_budgets(tmp_path):
    """ViT-base's 1 GiB of fp32 state trains under a 64 MiB host budget without the state entering RAM:
    the peak RSS stays below budgets + activations + the stated overhead, far below the state itself."""
    from tierstore.tools.bench_rss import measure_rss

    rss = measure_rss(preset="base", batch_size=2, nvme_path=str(tmp_path), host_budget_bytes=64 * 1024**2,
                      device_budget_bytes=32 * 1024**2, prefetch_depth=2, step_in_backward=True, steps=2)
    assert rss["within"], rss
    state = rss["weights_bytes"] * 3
    assert rss["allowed_bytes"] < state / 2  # so the check can fail if the state stays resident


def test_rss_probe_failure_is_reported(tmp_path, capsys, monkeypatch):
    from tierstore.tools.bench_rss import measure_rss

    with pytest.raises(RuntimeError, match="the RSS probe failed"):
        measure_rss(preset="no-such-preset", batch_size=1, nvme_path=str(tmp_path), host_budget_bytes=1 << 20,
                    device_budget_bytes=1 << 20, prefetch_depth=0, step_in_backward=False)
    # bench step still prints and returns its table, and says why the check is missing
    from tierstore.tools import bench_step as _bench_step

    def fail(**kw):
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(_bench_step, "measure_rss", fail)
    res = _bench_step.run_step_bench(preset="tiny", batch_size=2, depths=[0], nvme_path=str(tmp_path), rounds=1,
                                     host_budget_bytes=640 * 1024, device_budget_bytes=320 * 1024)
    assert res["rss"] == {"error": "probe exploded"} and res["depths"]["0"]["step_s"] > 0
    assert "peak RSS check could not run: probe exploded" in capsys.readouterr().out


@pytest.mark.parametrize("budget,says", [("1KB", "unit '<root>' holds"), ("3MiB", "below what one AdamW update")])
def test_a_budget_below_the_models_minimum_is_one_line_before_training(tmp_path, capsys, budget, says):
    assert _cli.main(["demo", "--preset", "small", "--steps", "1", "--nvme-path", str(tmp_path),
                      "--host-budget", budget]) == 2
    out = capsys.readouterr()
    assert says in out.err and len(out.err.strip().splitlines()) == 1 and "stall s" not in out.out  # no step ran
    assert os.listdir(tmp_path) == []
