"""The accuracy benchmark at a tiny size: every layout runs, the fp32 layout repeats torch's losses exactly."""

import bench_accuracy


def test_bench_accuracy_tiny(tmp_path, capsys):
    res = bench_accuracy.main(["--steps", "4", "--hidden", "64", "--layers", "1", "--vocab", "128", "--length", "16",
                               "--batch", "2", "--layouts", ",".join(l for l in bench_accuracy.LAYOUTS
                                                                     if l != "torchao"),
                               "--nvme-path", str(tmp_path)])
    by = {r["layout"]: r for r in res["results"]}
    assert set(by) == set(bench_accuracy.LAYOUTS) - {"torchao"}
    assert by["fp32/fp32/-"]["losses"] == by["torch"]["losses"]  # the fp32 layout is torch's AdamW
    assert by["bf16/8bit/split"]["bytes_per_param"] < by["fp32/fp32/-"]["bytes_per_param"] / 1.9
    for r in res["results"]:
        assert all(x == x for x in r["losses"]) and r["held_out_loss"] > res["entropy_rate"] * 0.5
    assert list(tmp_path.iterdir()) == []  # nothing left on the drive
    out = capsys.readouterr().out
    assert "entropy rate" in out and "vs torch" in out


def test_bench_accuracy_tiny_with_accumulation_and_clipping(tmp_path):
    """Trainer's loop: 2 micro-batches a step, the global norm clipped; the fp32 layout still repeats torch."""
    layouts = ["torch", "fp32/fp32/-", "bf16/8bit/split", "bf16/8bit/split/bf16"]
    res = bench_accuracy.main(["--steps", "3", "--hidden", "64", "--layers", "1", "--vocab", "128", "--length", "16",
                               "--batch", "2", "--accumulation", "2", "--clip", "0.5", "--layouts", ",".join(layouts),
                               "--nvme-path", str(tmp_path)])
    by = {r["layout"]: r for r in res["results"]}
    assert res["accumulation"] == 2 and res["clip"] == 0.5 and set(by) == set(layouts)
    assert by["fp32/fp32/-"]["losses"] == by["torch"]["losses"]
    # the gradients' dtype changes the training, not the first step's loss
    assert by["bf16/8bit/split/bf16"]["losses"][0] == by["bf16/8bit/split"]["losses"][0]
    assert all(x == x for r in res["results"] for x in r["losses"])
