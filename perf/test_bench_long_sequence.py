"""The long-sequence benchmark at a tiny size: the offloaded layer-major step against resident training with
gradient checkpointing, in fresh processes, the same bits."""

import bench_long_sequence
import pytest


@pytest.mark.slow  # fresh processes
def test_bench_long_sequence_tiny(tmp_path, capsys):
    pytest.importorskip("transformers")
    res = bench_long_sequence.main(["--preset", "llama-tiny", "--tokens", "1024", "--host-budget", "4MiB",
                                    "--steps", "2", "--nvme-path", str(tmp_path), "--json", str(tmp_path / "o.json")])
    assert res["same_losses"] and res["same_weights"]
    ours = res["results"]["offloaded"]
    assert ours["host_peak_bytes"] <= ours["host_budget_bytes"] and ours["peak_rss_bytes"] > 0
    assert "the same bits as the reference's: True" in capsys.readouterr().out
