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
