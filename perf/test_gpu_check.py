"""perf/gpu_check.py --tiny: every check at a tiny size (without a GPU, the ordering and training checks on the
simulated device, the CUDA-only ones skipped), so the script for the first device run cannot rot."""

import json

import gpu_check
import pytest
import torch


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_gpu_check_tiny(tmp_path, capsys):
    pytest.importorskip("transformers")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    res = gpu_check.main(["--tiny", "--nvme-path", str(nvme), "--json", str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text()).keys() == res.keys()
    for name in ("environment", "drive", "ordering", "training", "llama step"):
        assert res[name]["status"] == "PASS", (name, res[name])
    assert res["ordering"]["copies"]["host->device"] > 50 and res["ordering"]["copies"]["device->host"] > 0
    assert len(res["training"]["losses"]) == 3 and all(a == b for a, b in res["training"]["losses"])
    llama = res["llama step"]
    assert llama["dtypes"] == ["torch.bfloat16"]
    assert llama["offloaded_step_s"] > 0 and llama["resident_step_s"] > 0 and llama["ratio"] > 0
    assert llama["host_peak_bytes"] <= llama["host_budget_bytes"] < llama["state_bytes"]
    assert all(b > 0 for b in llama["drive_bytes_per_param"]) and len(llama["losses"]) == 3
    assert res["drive"]["store_read_gbps"] > 0
    cuda = torch.cuda.is_available()
    for name in ("pinned host memory", "link"):
        assert res[name]["status"] == ("PASS" if cuda else "SKIP"), res[name]
    out = capsys.readouterr().out
    assert "PASS  ordering" in out and "PASS  llama step" in out
    assert list(nvme.iterdir()) == []
