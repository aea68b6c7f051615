"""The integrations' choices as policies (tierstore/integrations/policies.py): given as objects, or read with the
store's settings from one file by load_settings; the store's config holds the store's settings alone (see [Note:
Settings of the layers above])."""

import ast
import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import tierstore as ts
from tierstore import Tier
from tierstore.integrations import (
    OffloadedAdamW,
    OptimizerStatePolicy,
    ParamOffloadPolicy,
    Settings,
    load_settings,
    offload_model,
    split_settings,
)
from tierstore.integrations.policies import FLAT

ROOT = pathlib.Path(__file__).resolve().parents[1]
OLD_FILE = {"prefetch_depth": 2, "resident_threshold_bytes": 1024, "grad_tier": "host", "optimizer_moments": "bf16",
            "optimizer_master": "split", "optimizer_tier": "host", "host_budget_bytes": "8MiB"}
"""A settings file as written before the policies: the store's settings and the integrations' side by side."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(torch.bfloat16)


def _homes(store: ts.TierStore, prefix: str) -> set[str]:
    return {store.info(k)["home"] for k in store.keys() if k.startswith(prefix)}


@pytest.mark.parametrize("kind", ["json", "toml"])
def test_an_old_flat_settings_file_loads_to_the_same_choices(kind, tmp_path):
    """The choices written flat in a settings file (as before the policies) are those offload_model and
    OffloadedAdamW make, through load_settings."""
    f = tmp_path / f"c.{kind}"
    if kind == "json":
        f.write_text(json.dumps(OLD_FILE))
    else:
        f.write_text("[tierstore]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in OLD_FILE.items()))
    settings = load_settings(f, nvme_path=str(tmp_path))
    assert settings.params == ParamOffloadPolicy(prefetch_depth=2, resident_threshold_bytes=1024, grad_tier="host")
    assert settings.optimizer == OptimizerStatePolicy(moments="bf16", master="split", home="host")
    assert settings.store == ts.StoreConfig(host_budget_bytes="8MiB", nvme_path=str(tmp_path))
    assert split_settings(settings.to_dict()) == settings
    with ts.TierStore(settings.store) as store:
        model = _model()
        off = offload_model(model, store, policy=settings.params)
        assert off.prefetch_policy.depth == 2 and off.grads.home is Tier.HOST
        assert len(off.resident_ids) == 2  # the biases (128 and 16 bytes) stay resident
        opt = OffloadedAdamW(off, policy=settings.optimizer)
        assert (opt.layout.moments, opt.layout.master) == ("bf16", "split")
        model(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        assert _homes(store, "adam/") == {"host"}
        opt.close()


def test_a_keyword_overrides_the_policy(make_store):
    store = make_store()
    model = _model()
    off = offload_model(model, store, policy=ParamOffloadPolicy(prefetch_depth=0, home="host"), prefetch_depth=3)
    assert off.prefetch_policy.depth == 3 and off.home is Tier.HOST
    assert _homes(store, "param/") == {"host"}
    opt = OffloadedAdamW(off, policy=OptimizerStatePolicy(moments="8bit", master="split"), master="fp32")
    assert (opt.layout.moments, opt.layout.master) == ("8bit", "fp32")


@pytest.mark.parametrize("grad_tier", [None, "nvme"])
def test_the_optimizers_policy_decides_where_its_gradients_live(grad_tier, make_store):
    """Kept gradients live where the state of the optimizer that steps them lives, unless the offload's own policy
    chose their tier."""
    store = make_store()
    model = _model()
    off = offload_model(model, store, policy=ParamOffloadPolicy(grad_tier=grad_tier))
    opt = OffloadedAdamW(off, policy=OptimizerStatePolicy(home="host"))
    model(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    assert _homes(store, "grad/") == {grad_tier or "host"}
    opt.step()
    assert _homes(store, "adam/") == {"host"}


def test_bad_choices_name_the_setting_as_it_was_written():
    with pytest.raises(ValueError, match="optimizer_moments='4bit': choose one of 'fp32', 'bf16', '8bit'"):
        split_settings({"optimizer_moments": "4bit"})
    with pytest.raises(ValueError, match="moments='4bit': choose one of"):
        OptimizerStatePolicy(moments="4bit")
    with pytest.raises(ValueError, match="resident_threshold_bytes=-1 must be >= 0"):
        split_settings({"resident_threshold_bytes": -1})
    with pytest.raises(ValueError, match="optimizer_tier='ssd': unknown tier 'ssd'"):
        split_settings({"optimizer_tier": "ssd"})
    with pytest.raises(ValueError, match="prefetch_bytes=0 must be a positive"):
        ParamOffloadPolicy(prefetch_bytes=0)
    with pytest.raises(ts.UnknownSettingError, match=r"'optimizer_moment' \(did you mean 'optimizer_moments'\?\)"):
        split_settings({"optimizer_moment": "8bit"})


def test_the_store_refuses_a_setting_above_it_and_says_where_it_goes(tmp_path):
    with pytest.raises(ts.UnknownSettingError, match=r"'prefetch_depth'.*policy=.*load_settings"):
        ts.TierStore(prefetch_depth=2)
    f = tmp_path / "c.json"
    f.write_text(json.dumps(OLD_FILE))
    with pytest.raises(ts.UnknownSettingError, match="load_settings"):
        ts.load_config(f)


def _core_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in (ROOT / "tierstore").glob("*.py")}


def test_the_store_config_holds_only_what_the_core_reads():
    """Each StoreConfig field is read by the core outside the config's own module."""
    sources = _core_sources()
    del sources["_config.py"]
    read = set()
    for text in sources.values():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute):
                read.add(node.attr)
    fields = {f.name for f in dataclasses.fields(ts.StoreConfig)}
    assert fields - read == set(), "settings the core never reads belong to the layer that reads them"
    assert "8bit" not in (ROOT / "tierstore" / "_config.py").read_text()  # the choices are written once


def test_the_core_knows_no_setting_above_it():
    """No registry, entry point, replaced __init__ or attribute hook for the layers' settings in the core, and none
    of their names."""
    for name, text in _core_sources().items():
        for word in ("entry_points", "__getattr__", "register_layer_settings", "layer_settings"):
            assert word not in text, (name, word)
        for flat in FLAT:
            assert f'"{flat}"' not in text, (name, flat)
    assert "entry-points" not in (ROOT / "pyproject.toml").read_text()
    assert [f.name for f in dataclasses.fields(Settings)] == ["store", "params", "optimizer"]


def test_a_misspelt_store_setting_fails_type_checking(tmp_path):
    """StoreConfig is a plain keyword-only dataclass: a type checker sees its fields, so StoreConfig(...) with a
    misspelt name fails checking (and a correct one passes)."""
    probe = ROOT / "_probe_store_config.py"
    probe.write_text("from tierstore._config import StoreConfig\n\n"
                     "StoreConfig(host_budget_bytes=1, queue_depth=4)\n"
                     "StoreConfig(host_budget_bytes=1, queue_dept=4)\n")
    try:
        out = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=skip", "--no-incremental",
                              "--ignore-missing-imports", probe.name, "tierstore/_config.py", "tierstore/_types.py"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        probe.unlink()
    assert out.returncode == 1, out.stdout + out.stderr
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert errors and all(line.startswith(f"{probe.name}:4:") for line in errors), out.stdout
    assert 'Unexpected keyword argument "queue_dept"' in errors[0]


def test_a_store_config_imports_nothing_above_the_core():
    code = ("import sys, tierstore as ts\n"
            "ts.TierStore(queue_depth=4, nvme_path=None).close()\n"
            "assert not [m for m in sys.modules if m.startswith('tierstore.integrations')], 'imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
