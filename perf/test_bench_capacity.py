"""The capacity benchmark at a tiny size: a model built on meta, 10x its host budget, within the RSS claim in every
optimizer mode."""

import os

import bench_capacity
import pytest


@pytest.mark.parametrize("width", [512, 1024])  # 4x the parameters: the bound holds whatever the model's size
def test_bench_capacity_tiny(tmp_path, capsys, width):
    res = bench_capacity.main(["--layers", "10", "--width", str(width), "--state-per-budget", "10", "--steps", "2",
                               "--pretrained", "--nvme-path", str(tmp_path)])
    assert [r["mode"] for r in res["results"]] == ["accumulate", "after", "in-backward"]
    for r in res["results"]:
        assert r["state_bytes"] >= 6 * r["host_budget_bytes"]
        assert r["ratio"] <= 1.0 and r["peak_rss_above_baseline"] > 0, r
        assert r["bytes_read_nvme"] > 0 and all(x == x for x in r["losses"])
    out = capsys.readouterr().out
    assert "ratio" in out and "built on meta and pretrained weights loaded" in out
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("compute", ["auto", "fp32"])
def test_bench_capacity_llama_preset_tiny(tmp_path, capsys, compute):
    pytest.importorskip("transformers")
    out = tmp_path / "res.json"
    res = bench_capacity.main(["--preset", "llama-tiny", "--steps", "3", "--lr", "1e-3", "--compute", compute,
                               "--drive-mib", "16", "--nvme-path", str(tmp_path), "--json", str(out)])
    assert out.exists() and res["mode"] == "in-backward" and res["moments"] == "8bit" and res["master"] == "split"
    assert res["params"] > 0 and res["drive_bytes"] > 0 and res["peak_rss_bytes"] > 0 and res["drive_mixed_gbps"] > 0
    assert len(res["step_seconds"]) == len(res["bytes_moved"]) == 3
    losses = res["losses"]
    assert all(x == x for x in losses) and losses[-1] < losses[0], losses  # one repeated batch: the loss falls
    if compute == "fp32":
        assert res["compute"] == "fp32" and res["product_seconds"] is None
    else:  # the faster of the two, as measured in the run
        times = res["product_seconds"]
        assert res["compute"] == ("bf16" if times["param"] <= times["fp32"] else "fp32")
    printed = capsys.readouterr().out
    assert f"computed in {res['compute']}" in printed and "the step ran at" in printed
