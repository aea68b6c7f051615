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


def test_bench_trainer_tiny_plain_alone_with_the_drive_measured(tmp_path, capsys):
    """``--runs plain`` runs one process; ``--measure-drive`` sets each step's rate against the drive's."""
    pytest.importorskip("transformers")
    res = bench_trainer.main(["--preset", "llama-tiny", "--steps", "2", "--runs", "plain", "--grad-dtype", "param",
                              "--keep-grads", "no", "--measure-drive", "8", "--nvme-path", str(tmp_path)])
    (r,) = res["results"]
    assert r["mode"] == "plain" and len(r["losses"]) == 2 and len(r["drive_ratio"]) == 2
    assert r["drive"]["mixed_gbps"] > 0 and all(x > 0 for x in r["drive_ratio"])
    assert "x of it" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_trainer.main(["--runs", "resume", "--nvme-path", str(tmp_path)])
