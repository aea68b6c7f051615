"""perf/bench_fsdp.py at a tiny size (2 gloo ranks), so it cannot rot."""

import bench_fsdp
import pytest


@pytest.mark.slow
def test_bench_fsdp_tiny(tmp_path, capsys):
    res = bench_fsdp.main(["--preset", "tiny", "--ranks", "2", "--depths", "0,2", "--steps", "2",
                           "--batch-size", "2", "--nvme-path", str(tmp_path), "--host-budget", "128KiB",
                           "--json", str(tmp_path / "r.json")])
    assert set(res["depths"]) == {"0", "2"} and res["ranks"] == 2
    for row in res["depths"].values():
        assert row["step_s"] > 0 and row["read_bytes"] > 0
    assert res["depths"]["0"]["speedup_vs_depth0"] == 1.0
    assert res["fsdp2_alone_step_s"] > 0
    assert res["depths"]["2"]["vs_fsdp2_alone"] == res["depths"]["2"]["step_s"] / res["fsdp2_alone_step_s"]
    out = capsys.readouterr().out
    assert "vs depth 0" in out and "FSDP2 alone (no offload" in out
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


@pytest.mark.slow
def test_bench_fsdp_micro_batches_tiny(tmp_path, capsys):
    """The micro-batch comparison: layer by layer, the all-gather bytes a step do not grow with the count."""
    res = bench_fsdp.main(["--preset", "tiny", "--ranks", "2", "--micro-batches", "2,4", "--steps", "2",
                           "--batch-size", "4", "--nvme-path", str(tmp_path), "--host-budget", "128KiB",
                           "--json", str(tmp_path / "r.json")])
    by = res["micro_batches"]
    assert set(by) == {"layer-major", "loop"} and all(set(v) == {"2", "4"} for v in by.values())
    for way in by.values():
        for row in way.values():
            assert row["read_bytes"] > 0 and row["all_gather_bytes_per_rank"] > 0 and row["peak_rss_bytes"] > 0
    lm = by["layer-major"]
    assert lm["4"]["all_gather_bytes_per_rank"] == lm["2"]["all_gather_bytes_per_rank"]
    assert res["ratio"]["layer-major"]["all_gather_bytes_per_rank"] == 1.0
    assert res["ratio"]["loop"]["all_gather_bytes_per_rank"] == (by["loop"]["4"]["all_gather_bytes_per_rank"]
                                                                  / by["loop"]["2"]["all_gather_bytes_per_rank"])
    out = capsys.readouterr().out
    assert "4 over 2 micro-batches" in out and "the loop over layer by layer" in out
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
