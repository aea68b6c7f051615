"""The clipping study at a tiny size: the share of steps that clipped, each policy's step time against the
reference and their ratio are printed, and the three policies end bit-identical."""

import bench_clip_study
import pytest


def test_bench_clip_study_tiny(tmp_path, capsys):
    pytest.importorskip("transformers")
    res = bench_clip_study.main(["--vocab", "32", "--width", "32", "--layers", "2", "--tokens", "16", "--batch", "2",
                                 "--pretrain-steps", "5", "--steps", "4", "--host-budget", "192KiB",
                                 "--nvme-path", str(tmp_path)])
    assert res["steps"] == 4 and 0 <= res["steps_clipped"] <= 4
    assert [r["policy"] for r in res["results"]] == [False, "auto", True]
    assert all(r["step_seconds"] > 0 and r["ratio"] > 0 for r in res["results"])
    assert res["results"][2]["updates_speculated"] > 0  # True speculates every step
    assert all(r["speculated_kept"] + r["speculated_undone"] == r["updates_speculated"] for r in res["results"])
    assert res["identical"]
    out = capsys.readouterr().out
    assert "steps that clipped" in out and "the reference" in out
    assert list(tmp_path.iterdir()) == []
