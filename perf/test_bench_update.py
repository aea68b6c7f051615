"""The update benchmark at a tiny size: every layout's figures, the reference and their ratio are printed."""

import bench_update


def test_bench_update_tiny(tmp_path, capsys):
    res = bench_update.main(["--elements", str(3 * 4096 + 100), "--rounds", "1", "--drive-mib", "16",
                             "--nvme-path", str(tmp_path)])
    assert res["drive_mixed_gbps"] > 0
    assert [r["layout"] for r in res["results"]] == [f"{m}/{s}" for m, s in bench_update.LAYOUTS]
    for r in res["results"]:
        assert r["gb_per_cpu_s"] > 0 and r["gb_per_wall_s"] > 0
    by = {r["layout"]: r for r in res["results"]}
    assert by["8bit/split"]["state_bytes"] < by["fp32/fp32"]["state_bytes"] / 2
    out = capsys.readouterr().out
    assert "the reference" in out and "ratio" in out
    assert list(tmp_path.iterdir()) == []
