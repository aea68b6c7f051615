"""The layer-major benchmark at a tiny size: both loops in fresh processes at two micro-batch counts and one
sequence length, each size's ratio printed against the loop."""

import bench_layer_major
import pytest


@pytest.mark.slow  # fresh processes
def test_bench_layer_major_tiny(tmp_path, capsys):
    pytest.importorskip("transformers")
    plot = ["--plot", str(tmp_path / "lm.png")] if pytest.importorskip("matplotlib") else []
    res = bench_layer_major.main(["--preset", "llama-tiny", "--micro-batches", "1,2", "--tokens-sweep", "128",
                                  "--steps", "2", "--nvme-path", str(tmp_path), *plot,
                                  "--json", str(tmp_path / "out.json")])
    assert {(r["loop"], r["micro_batches"], r["tokens"]) for r in res["results"]} == {
        (loop, n, t) for loop in bench_layer_major.LOOPS for n, t in ((1, 64), (2, 64), (1, 128))}
    for r in res["results"]:
        assert r["peak_rss_bytes"] > 0 and r["bytes_per_param"] > 0 and len(r["steps"]) == 2
    assert set(res["growth"]) == set(bench_layer_major.LOOPS) and all(g > 0 for g in res["growth"].values())
    assert (tmp_path / "lm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "against the loop (the reference)" in out and "x those with 1" in out


@pytest.mark.slow  # fresh processes
def test_bench_layer_major_vit_tiny(tmp_path, capsys):
    """The demo's ViT (its class token and position embedding parameters of the model itself) runs layer by layer."""
    res = bench_layer_major.main(["--vit", "tiny", "--host-budget", "1MiB", "--micro-batches", "1,2", "--steps", "2",
                                  "--nvme-path", str(tmp_path)])
    assert {(r["loop"], r["micro_batches"]) for r in res["results"]} == {
        (loop, n) for loop in bench_layer_major.LOOPS for n in (1, 2)}
    assert all(r["layer_major_refused"] is None and r["bytes_per_param"] > 0 for r in res["results"])
    assert res["preset"] == "vit-tiny" and all(g > 0 for g in res["growth"].values())
    out = capsys.readouterr().out
    assert "ViT-tiny" in out and "fell back" not in out and "x those with 1" in out


@pytest.mark.slow  # fresh processes
def test_bench_layer_major_tied_tiny(tmp_path, capsys):
    """A Llama whose head is its embedding runs layer by layer (see [Note: Tied parameters layer by layer])."""
    pytest.importorskip("transformers")
    res = bench_layer_major.main(["--preset", "llama-tiny", "--tied", "--micro-batches", "1,2", "--steps", "2",
                                  "--nvme-path", str(tmp_path)])
    assert all(r["layer_major_refused"] is None and r["bytes_per_param"] > 0 for r in res["results"])
    assert all(g > 0 for g in res["growth"].values())
    out = capsys.readouterr().out
    assert "llama-tiny tied" in out and "fell back" not in out and "x those with 1" in out


@pytest.mark.slow  # fresh processes
def test_bench_layer_major_t5_tiny(tmp_path, capsys):
    """A T5 encoder-decoder (its decoder's blocks take the encoder's output, its embedding shared by both stacks)
    runs layer by layer."""
    pytest.importorskip("transformers")
    res = bench_layer_major.main(["--t5", "tiny", "--host-budget", "1MiB", "--micro-batches", "1,2", "--tokens",
                                  "16", "--steps", "2", "--nvme-path", str(tmp_path)])
    assert {(r["loop"], r["micro_batches"]) for r in res["results"]} == {
        (loop, n) for loop in bench_layer_major.LOOPS for n in (1, 2)}
    assert all(r["layer_major_refused"] is None and r["bytes_per_param"] > 0 for r in res["results"])
    assert res["preset"] == "t5-tiny" and all(g > 0 for g in res["growth"].values())
    out = capsys.readouterr().out
    assert "T5-tiny" in out and "fell back" not in out and "x those with 1" in out
