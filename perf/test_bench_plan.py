"""The plan benchmark at a tiny size: the predicted step, the measured one and their ratio are printed."""

import bench_plan
import pytest


@pytest.mark.parametrize("step", ["in-backward", "after-backward"])
def test_bench_plan_tiny(tmp_path, capsys, step):
    res = bench_plan.main(["--preset", "tiny", "--batch-size", "4", "--rounds", "1", "--optimizer-step", step,
                           "--nvme-path", str(tmp_path)])
    (pair,) = res["pairs"]
    assert pair["predicted_s"] > 0 and pair["measured_s"] > 0 and pair["offload_s"] >= 0 and pair["tensors"] > 0
    out = capsys.readouterr().out
    assert "predicted s (ours)" in out and "measured s (the reference)" in out and "ratio" in out
    assert list(tmp_path.iterdir()) == []
