"""Every python block of the README and of each page of docs/ runs as written, in order, in one namespace per
file (so they cannot drift).

What the text leaves to the reader is given here: ``model`` (a fresh tiny ViT before each block that
wraps one), ``loader``, ``loss_fn``, ``x``/``y``, ``steps``/``step``, the config files block 1 reads, a
process group of one rank for the FSDP2 block; ``/mnt/nvme`` becomes a temporary directory and the working
directory is a temporary one, so ``runs/`` and ``step.json`` land there.
"""

from __future__ import annotations

import json
import os
import re
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tierstore.integrations.optim import OffloadedAdamW

import tierstore as ts
from tierstore.tools.vit import PRESETS, SyntheticImages, ViT

ROOT = os.path.join(os.path.dirname(__file__), "..")
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))


def _blocks(page: str) -> list[str]:
    with open(os.path.join(ROOT, page)) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def _fresh_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return ViT(PRESETS["tiny"])


def _recording(init, made: list):
    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)
    return recorded


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_docs_have_python_blocks_to_run():
    assert sum(len(_blocks(p)) for p in PAGES) >= 10 and _blocks("README.md")


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)])
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # asked by peft
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in one process says it is one
@pytest.mark.filterwarnings("ignore::pytorch_lightning.utilities.warnings.PossibleUserWarning")  # its advice on workers
@pytest.mark.filterwarnings("ignore:Starting from v1.9.0, `tensorboardX` has been removed:UserWarning")  # Lightning's
@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning")  # Lightning's
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning")  # a resume's, Lightning's
def test_python_blocks_run_as_written(tmp_path, monkeypatch, page):
    blocks = _blocks(page)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tierstore.toml").write_text(f'nvme_path = "{nvme}"\nhost_budget_bytes = "64MiB"\n')
    (tmp_path / "ds_config.json").write_text(json.dumps({"zero_optimization": {
        "offload_param": {"device": "nvme", "nvme_path": str(nvme)}}}))
    data = SyntheticImages(PRESETS["tiny"])
    x, y = data.batch(0, 4)
    # a DataLoader as users have one (Lightning takes a list for several loaders)
    ns: dict = {"loader": torch.utils.data.DataLoader([data.batch(i, 4) for i in range(2)], batch_size=None), "loss_fn": F.cross_entropy, "x": x, "y": y,
                "steps": 2, "step": 1, "make_model": _fresh_model}
    made: list = []  # every store and optimizer the blocks make, to close at the end
    for cls in (ts.TierStore, OffloadedAdamW):
        monkeypatch.setattr(cls, "__init__", _recording(cls.__init__, made))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    try:
        for i, block in enumerate(blocks):
            code = block.replace("/mnt/nvme", str(nvme))
            if "offload_model(model" in code or "fully_shard(" in code:
                ns["model"] = _fresh_model()
            if "fully_shard(" in code and not dist.is_initialized():
                dist.init_process_group("gloo", rank=0, world_size=1)
            try:
                exec(compile(code, f"{page} python block {i}", "exec"), ns)
            except Exception as e:
                raise AssertionError(f"{page} python block {i} fails as written:\n{block}") from e
        code = "".join(blocks)
        if "save_checkpoint(" in code:
            assert (tmp_path / "runs" / "ckpt" / "manifest.json").is_file()
        if "write_chrome_trace(" in code:
            assert (tmp_path / "step.json").is_file()
    finally:
        for thing in reversed(made):
            thing.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_design_notes_index_is_current_and_every_reference_names_a_note():
    from tierstore.tools import notes

    with open(os.path.join(ROOT, "docs", "design-notes.md")) as f:
        assert f.read() == notes.index(ROOT), "regenerate: python -m tierstore.tools.notes > docs/design-notes.md"
    defined = {title for title, _ in notes.definitions(ROOT)}
    assert notes.references(ROOT) - defined == set()


def test_every_link_between_pages_names_a_page_that_exists():
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", text):
            if not target.startswith("http"):
                assert os.path.isfile(os.path.join(ROOT, os.path.dirname(page), target)), (page, target)


def _install_lines(page: str) -> list[str]:
    """The ``pip install`` commands of a page's bash blocks, comments cut."""
    with open(os.path.join(ROOT, page)) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("pip install")]


@pytest.mark.parametrize("page", ["README.md", os.path.join("docs", "gpu.md")])
def test_the_install_line_installs_from_inside_a_clone(page):
    """Where a user stands after ``git clone``: the repository's root (a dry run: nothing is installed, but pip
    finds and builds the project's metadata there, or fails as it would for the user)."""
    import importlib.util
    import shlex
    import subprocess
    import sys

    lines = [line for line in _install_lines(page) if "dist/" not in line]
    assert lines, f"{page} gives no pip install line"
    for line in lines:
        args = shlex.split(line)[2:]
        isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "-q", *isolation,
                               *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (page, line, done.stderr[-2000:])
