"""The byte accounting of Trainer's step at a tiny size: the table, our total, the reference and their ratio."""

import bench_bytes
import pytest


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("grad_dtype", ["float32", "param"])
def test_bench_bytes_tiny(tmp_path, capsys, grad_dtype):
    pytest.importorskip("transformers")
    res = bench_bytes.main(["--preset", "llama-tiny", "--grad-dtype", grad_dtype, "--nvme-path", str(tmp_path)])
    assert res["grad_dtype"] == grad_dtype
    assert res["moved_bytes"] == sum(r["bytes"] for r in res["table"]) > 0
    assert res["once_bytes"] > 0 and res["ratio"] == res["moved_bytes"] / res["once_bytes"]
    phases = {r["phase"] for r in res["table"]}
    assert {"micro-batch 1", "micro-batch 2", "step"} <= phases and "clip" not in phases  # clipping reads nothing
    out = capsys.readouterr().out
    assert "(ours)" in out and "(the reference)" in out and "ratio" in out
    assert list(tmp_path.iterdir()) == []
