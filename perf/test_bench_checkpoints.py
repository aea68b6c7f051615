"""The checkpoints benchmark at a tiny size: every flow's train, save and resume runs, fresh processes."""

import os

import bench_checkpoints
import pytest


@pytest.mark.slow
def test_bench_checkpoints_tiny(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("pytorch_lightning")
    res = bench_checkpoints.main(["--preset", "tiny", "--steps", "2", "--nvme-path", str(tmp_path),
                                  "--json", str(tmp_path / "out.json")])
    runs = [(r["flow"], r["what"]) for r in res["results"]]
    assert runs == [(f, w) for f in bench_checkpoints.SAVERS for w in ("train", "save", "resume")]
    for r in res["results"]:
        assert r["peak_rss_bytes"] > 0 and r["peak_anon_bytes"] > 0 and all(x == x for x in r["losses"])
        assert r["state_bytes"] > r["host_budget_bytes"]  # the state dicts are mapped copies
        if r["what"] != "train":
            assert r["rss_ratio"] > 0 and r["anon_ratio"] > 0
    out = capsys.readouterr().out
    assert "vs train" in out and "x the host budget" in out
    assert os.listdir(tmp_path) == ["out.json"]


def test_bench_checkpoints_refuses_a_flow_it_does_not_know(tmp_path):
    with pytest.raises(SystemExit):
        bench_checkpoints.main(["--flows", "deepspeed", "--nvme-path", str(tmp_path)])
