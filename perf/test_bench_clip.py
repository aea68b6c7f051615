"""The clip-tax benchmark at a tiny size: each loop's step time, the reference and their ratio are printed, and the
clipped and streamed loops end bit-identical (and the reference too where the norm is never reached)."""

import bench_clip
import pytest


@pytest.mark.parametrize("max_norm,code", [(1.0, "no"), (1e-4, "no"), (1.0, "yes")],
                         ids=["never-clips", "always-clips", "never-clips-coded"])
def test_bench_clip_tiny(tmp_path, capsys, max_norm, code):
    # A host budget under the state (0.34 MB), so that the clipped loop's step() reads: with room for all of it,
    # its step() only starts writes, whose bytes a busy machine may count after it returned.
    res = bench_clip.main(["--layers", "3", "--width", "96", "--batch", "4", "--host-budget", "256KiB",
                           "--rounds", "1", "--steps", "2", "--max-norm", str(max_norm), "--code-grads", code,
                           "--nvme-path", str(tmp_path)])
    assert [r["loop"] for r in res["results"]] == list(bench_clip.LOOPS)
    assert all(r["step_seconds"] > 0 and r["ratio"] > 0 for r in res["results"])
    by = {r["loop"]: r for r in res["results"]}
    # step() only queues: the drive bytes move after it returns (the worker may start one before the count)
    assert by["streamed"]["inside_step_share"] < 0.5 < by["clipped"]["inside_step_share"]
    assert all(res["identical"].values()) and len(res["identical"]) == (3 if max_norm == 1.0 else 2)
    spec = res["speculation"]
    assert spec["updates_speculated"] > 0
    assert spec["speculated_kept"] + spec["speculated_undone"] == spec["updates_speculated"]
    if max_norm == 1.0:  # no clip: every update made in backward stands
        assert spec["speculated_undone"] == 0
    if code == "no":  # coded only when asked (and where the kernel is built: tests/test_speculated.py)
        assert spec["gradients_coded"] == 0
    assert res["steps_clipped"] == (0 if max_norm == 1.0 else 4)
    out = capsys.readouterr().out
    assert "the reference" in out and "bit-identical" in out
    assert list(tmp_path.iterdir()) == []
