"""The drive benchmark at a tiny size, so that it cannot rot."""

import json

import pytest

from tierstore.tools import cli as _cli
from tierstore.tools.bench_drive import fio_available


@pytest.mark.parametrize("integrity", [False, True])
def test_bench_drive_tiny(tmp_path, capsys, integrity):
    out = tmp_path / "drive.json"
    args = ["bench", "drive", "--nvme-path", str(tmp_path), "--size-mib", "8", "--tensor-mib", "2",
            "--rounds", "2", "--json", str(out)] + (["--integrity"] if integrity else [])
    assert _cli.main(args) == 0
    res = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "store-write" in printed and "median" in printed
    assert res["store_read_gbps"] > 0 and res["store_write_gbps"] > 0
    assert len(res["samples_gbps"]["store_read"]) == 2
    if fio_available():
        assert res["fio_read_gbps"] > 0 and res["fio_write_gbps"] > 0
        assert res["read_ratio"] == pytest.approx(res["store_read_gbps"] / res["fio_read_gbps"])
        assert "ratio store/fio" in printed
    else:
        assert res["read_ratio"] is None
    if integrity:
        assert "checksum_read_cost" in res and "checksum cost" in printed
    for kind in ("read", "write"):  # CPU per GB moved, the store against the bare pool, in the same run
        store_cpu, bare_cpu = res[f"store_{kind}_cpu_s_per_gb"], res[f"bare_{kind}_cpu_s_per_gb"]
        assert store_cpu >= 0 and bare_cpu >= 0  # 8 MiB may pass within one tick of the CPU clock
        assert res[f"cpu_{kind}_ratio"] == (store_cpu / bare_cpu if bare_cpu > 0 else None)
        assert res[f"bare_{kind}_gbps"] > 0
    assert "CPU s per GB" in printed and "bare preadv/pwritev pool" in printed
    assert [p.name for p in tmp_path.iterdir()] == ["drive.json"]


def test_bench_drive_bad_path(tmp_path, capsys):
    assert _cli.main(["bench", "drive", "--nvme-path", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
