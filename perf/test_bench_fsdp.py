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
