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
    # 8 MiB measures caches and a queue filling, not the drive: said last, and in the JSON
    warning = printed.strip().splitlines()[-1]
    assert warning == f"warning: {res['size_warning']}"
    assert warning.startswith("warning: 8 MiB does not measure the drive: a file under 4096 MiB can be read back "
                              "from the drive's own cache; the fastest pass took ") and "Give --size-mib " in warning
    assert [p.name for p in tmp_path.iterdir()] == ["drive.json"]


def test_bench_drive_bad_path(tmp_path, capsys):
    assert _cli.main(["bench", "drive", "--nvme-path", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_the_drive_table_says_when_the_spread_is_wider_than_the_difference():
    from tierstore.tools.bench_drive import format_drive_table

    res = {"size_mib": 8, "tensor_mib": 2, "block_size_bytes": 65536, "queue_depth": 4, "io_threads": 2,
           "fio_iodepth": 4, "direct_io": True, "rounds": 3, "fio": True,
           "samples_gbps": {"store_write": [3.4, 3.5, 3.4], "fio_write": [2.4, 2.5, 2.6],
                            "store_read": [2.4, 2.3, 2.4], "fio_read": [0.71, 2.07, 1.5], "crc_read": [],
                            "crc_write": []},
           "store_write_gbps": 3.4, "fio_write_gbps": 2.5, "store_read_gbps": 2.4, "fio_read_gbps": 1.5,
           "write_ratio": 3.4 / 2.5, "read_ratio": 2.4 / 1.5, "bare_write_gbps": 3.0, "bare_read_gbps": 2.0,
           "store_write_cpu_s_per_gb": 0.01, "bare_write_cpu_s_per_gb": 0.01, "cpu_write_ratio": 1.0,
           "store_read_cpu_s_per_gb": 0.01, "bare_read_cpu_s_per_gb": 0.01, "cpu_read_ratio": 1.0}
    table = format_drive_table(res)
    assert "fio_read 0.71-2.07" in table
    assert "read: the rounds of one side spread wider than the medians differ (0.90 GB/s)" in table
    assert "write: the rounds" not in table  # 0.2 GB/s of spread against 0.9 of difference


def test_a_size_measures_the_drive_when_it_passes_its_caches_and_takes_seconds():
    from tierstore.tools.bench_drive import size_warning

    assert size_warning(8192, 3.0, direct_io=True) is None  # 2.9 s a pass at 3 GB/s
    # past the caches, but 0.6 s a pass at 7 GB/s: 2 s of it, up to a whole GiB
    assert size_warning(4096, 7.0, direct_io=True) == (
        "4096 MiB does not measure the drive: the fastest pass took 0.61 s, and one under 2 s is mostly the queue "
        "filling and draining. Give --size-mib 14336 or more")
    assert size_warning(1024, None, direct_io=True).endswith("Give --size-mib 4096 or more")
    # without O_DIRECT the page cache holds anything smaller than the RAM
    assert size_warning(16384, 3.0, direct_io=False, ram_bytes=32 * 2**30) == (
        "16384 MiB does not measure the drive: without O_DIRECT the page cache holds a file smaller than the RAM "
        "(32.0 GiB). Give --size-mib 33792 or more")
    assert size_warning(40960, 3.0, direct_io=False, ram_bytes=32 * 2**30) is None

