"""The Trainer benchmark at a tiny size: three fresh processes (no checkpoint, a checkpoint every step, a resume),
each one's peak RSS set against the run without checkpoints."""

import os

import bench_trainer
import pytest


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_bench_trainer_tiny(tmp_path, capsys, lora):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    res = bench_trainer.main(["--preset", "llama-tiny", "--steps", "2", "--lora", str(lora),
                              "--nvme-path", str(tmp_path), "--json", str(tmp_path / "out.json")])
    assert [r["mode"] for r in res["results"]] == ["plain", "save", "resume"]
    for r in res["results"]:
        assert r["peak_rss_bytes"] > 0 and r["rss_ratio"] > 0 and all(x == x for x in r["losses"])
    assert len(res["results"][2]["losses"]) == 3  # the 2 logged up to the checkpoint, then one more
    out = capsys.readouterr().out
    assert "vs plain" in out and "peak RSS" in out
    assert os.listdir(tmp_path) == ["out.json"]
