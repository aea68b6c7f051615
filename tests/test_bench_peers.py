"""`tierstore bench peers` at a tiny size: all three forwards run and agree (Accelerate where installed)."""

import json

from tierstore.tools import cli as _cli


def test_bench_peers_tiny(tmp_path, capsys):
    out = tmp_path / "peers.json"
    assert _cli.main(["bench", "peers", "--nvme-path", str(tmp_path), "--layers", "3", "--width", "64",
                      "--rounds", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["samples_s"]["memory"]) == len(res["samples_s"]["tierstore"]) == 2
    assert res["read_bytes"] >= 3 * 64 * 65 * 4  # every weight came from the drive
    assert len(res["drive_read_gbps_samples"]) == 2
    assert res["read_floor_s"] <= min(res["samples_s"]["tierstore"]) * (1 + 1e-9)  # a floor no forward beat
    printed = capsys.readouterr().out
    assert "vs memory" in printed
    try:
        import accelerate  # noqa: F401
    except ImportError:
        assert res["speedup_vs_accelerate"] is None and "not installed" in printed
    else:
        assert len(res["samples_s"]["accelerate"]) == 2 and res["speedup_vs_accelerate"] > 0
        assert "outputs equal" in printed
    assert [p.name for p in tmp_path.iterdir()] == ["peers.json"]  # swap and offload files removed
