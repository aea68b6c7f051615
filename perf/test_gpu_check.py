"""perf/gpu_check.py without a GPU: the ordering and training checks on the simulated device, so the script
cannot rot; the checks that need CUDA say so."""

import gpu_check
import torch


def test_gpu_check_simulated(tmp_path, capsys):
    res = gpu_check.main(["--simulate", "--nvme-path", str(tmp_path), "--ordering-ops", "300"])
    assert res["ordering"]["status"] == "PASS" and res["training"]["status"] == "PASS", res
    assert res["ordering"]["copies"]["host->device"] > 50 and res["ordering"]["copies"]["device->host"] > 0
    assert len(res["training"]["losses"]) == 3 and all(a == b for a, b in res["training"]["losses"])
    if not torch.cuda.is_available():
        assert res["host to device"]["status"] == "SKIP" and res["demo and bench step"]["status"] == "SKIP"
    out = capsys.readouterr().out
    assert "PASS  ordering" in out and "PASS  training" in out
    assert list(tmp_path.iterdir()) == []
