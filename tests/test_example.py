"""examples/finetune_causal_lm.py at a tiny size: the offloaded run against the resident one, and resumed."""

import importlib.util
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _example():
    spec = importlib.util.spec_from_file_location("finetune_causal_lm",
                                                  os.path.join(ROOT, "examples", "finetune_causal_lm.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _weights(final):
    from safetensors.torch import load_file

    return load_file(os.path.join(final, "model.safetensors"))


def test_the_example_fine_tunes_as_the_resident_run_does_and_resumes(tmp_path, nvme_dir):
    ex = _example()
    ex.make_tiny(str(tmp_path / "pretrained"))
    common = ["--model", str(tmp_path / "pretrained"), "--steps", "4", "--save-steps", "2", "--lr", "1e-2"]
    resident = ex.main([*common, "--output", str(tmp_path / "resident"), "--resident"])
    offloaded = ex.main([*common, "--output", str(tmp_path / "offloaded"), "--nvme-path", nvme_dir,
                         "--host-budget", "2MiB"])
    assert offloaded["losses"] == resident["losses"] and len(resident["losses"]) == 4
    assert offloaded["generated"] == resident["generated"]
    want = _weights(resident["final"])
    got = _weights(offloaded["final"])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # resumed in a fresh process state from the checkpoint of step 2: the uninterrupted run's weights
    resumed = ex.main([*common, "--output", str(tmp_path / "resumed"), "--nvme-path", nvme_dir, "--host-budget",
                       "2MiB", "--resume", str(tmp_path / "offloaded" / "checkpoint-2")])
    assert resumed["losses"][-2:] == resident["losses"][-2:]
    got = _weights(resumed["final"])
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert os.listdir(nvme_dir) == []


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # asked by peft
def test_the_example_with_lora_in_bf16_matches_the_resident_run_and_merges(tmp_path, nvme_dir):
    """--lora on a bf16 base with split masters: the adapter trains as the resident run's (same losses, same
    adapter file), resumes from a checkpoint, and the merged model loads in transformers to peft's own merge."""
    pytest.importorskip("peft")
    import transformers

    ex = _example()
    ex.make_tiny(str(tmp_path / "pretrained"))
    common = ["--model", str(tmp_path / "pretrained"), "--steps", "4", "--save-steps", "2", "--lr", "1e-2",
              "--lora", "4", "--dtype", "bf16"]
    resident = ex.main([*common, "--output", str(tmp_path / "resident"), "--resident"])
    offloaded = ex.main([*common, "--output", str(tmp_path / "offloaded"), "--nvme-path", nvme_dir,
                         "--host-budget", "2MiB", "--master-weights", "fp32"])
    assert offloaded["losses"] == resident["losses"] and len(resident["losses"]) == 4
    adapter = "adapter_model.safetensors"
    with open(os.path.join(offloaded["final"], adapter), "rb") as a, open(os.path.join(resident["final"], adapter),
                                                                          "rb") as b:
        assert a.read() == b.read()
    resumed = ex.main([*common, "--output", str(tmp_path / "resumed"), "--nvme-path", nvme_dir, "--host-budget",
                       "2MiB", "--master-weights", "fp32", "--resume", str(tmp_path / "offloaded" / "checkpoint-2")])
    assert resumed["losses"][-2:] == resident["losses"][-2:]
    import peft

    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "pretrained"), dtype=torch.bfloat16)
    want = peft.PeftModel.from_pretrained(base, resident["final"]).merge_and_unload().state_dict()
    got = transformers.AutoModelForCausalLM.from_pretrained(offloaded["merged"], dtype=torch.bfloat16).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert os.listdir(nvme_dir) == []
