"""The Trainer benchmark at a tiny size: three fresh processes (no checkpoint, a checkpoint every step, a resume),
each one's peak RSS set against the run without checkpoints."""

import os

import bench_trainer
import pytest


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_bench_trainer_tiny(tmp_path, capsys, lora):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    # the full fine-tune with bf16 gradients let go once applied, its updates streamed into the next forward, and
    # the drive measured after each run
    extra = ["--grad-dtype", "param", "--keep-grads", "no", "--measure-drive", "8", "--stream-update"] if not lora else []
    res = bench_trainer.main(["--preset", "llama-tiny", "--steps", "2", "--lora", str(lora), *extra,
                              "--nvme-path", str(tmp_path), "--json", str(tmp_path / "out.json")])
    assert [r["mode"] for r in res["results"]] == ["plain", "save", "resume"]
    assert len({r["compute"] for r in res["results"]}) == 1  # "auto" chose once, for every run
    for r in res["results"]:
        assert r["peak_rss_bytes"] > 0 and r["rss_ratio"] > 0 and all(x == x for x in r["losses"])
        assert len(r["waits"]) == len(r["step_seconds"]) == len(r["inside_step_bytes"])  # each step's gets: every one
        # found, waited or fetched
        assert all(w["hits"] + w["late_prefetches"] + w["misses"] > 0 and w["stall_seconds"] >= 0 for w in r["waits"])
    assert len(res["results"][2]["losses"]) == 3  # the 2 logged up to the checkpoint, then one more
    if not lora:
        for r in res["results"]:
            assert r["drive"]["mixed_gbps"] > 0 and len(r["drive_ratio"]) == len(r["bytes_moved"]) > 0
            assert all(x > 0 for x in r["drive_ratio"])
    out = capsys.readouterr().out
    assert "inside opt.step()" in out and ("streamed into the next forward" in out) == (not lora)
    assert "vs plain" in out and "peak RSS" in out and ("x of it" in out) == (not lora) and "prefetches skipped" in out
    assert os.listdir(tmp_path) == ["out.json"]


def test_bench_trainer_refuses_runs_it_does_not_know_or_a_resume_without_a_save(tmp_path):
    for runs in ("resume", "plain,later", ""):
        with pytest.raises(SystemExit):
            bench_trainer.main(["--runs", runs, "--nvme-path", str(tmp_path)])


def test_bench_trainer_tiny_speculated_layer_by_layer(tmp_path, capsys):
    """Layer by layer with the updates speculated in the last micro-batch's backward, a max_grad_norm never
    reached: every update is made in backward and stands."""
    pytest.importorskip("transformers")
    res = bench_trainer.main(["--preset", "llama-tiny", "--steps", "2", "--runs", "plain", "--accumulation", "4",
                              "--layer-major", "--speculate", "yes", "--max-grad-norm", "1e9",
                              "--nvme-path", str(tmp_path)])
    spec = res["results"][0]["speculation"]
    assert spec["updates_speculated"] == spec["speculated_kept"] > 0 and spec["speculated_undone"] == 0
    assert "speculate=yes" in capsys.readouterr().out
