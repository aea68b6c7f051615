"""The integrations' choices as policies (tierstore/integrations/policies.py): given as objects, or flat among the
store's settings, which the core carries unread (see [Note: Settings of the layers above])."""

import ast
import dataclasses
import json
import pathlib

import pytest
import torch
import torch.nn as nn

import tierstore as ts
from tierstore import Tier
from tierstore.integrations import OffloadedAdamW, OptimizerStatePolicy, ParamOffloadPolicy, offload_model

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(torch.bfloat16)


def test_flat_settings_reach_offload_model_and_the_optimizer(make_store, tmp_path):
    """The choices written flat in a config file (as before the policies) are those offload_model and
    OffloadedAdamW make."""
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"prefetch_depth": 2, "resident_threshold_bytes": 1024, "grad_tier": "host",
                             "optimizer_moments": "bf16", "optimizer_master": "split", "optimizer_tier": "host"}))
    cfg = ts.load_config(f, nvme_path=str(tmp_path))
    assert cfg.to_dict()["grad_tier"] == "host" and ts.StoreConfig(**cfg.to_dict()) == cfg
    store = make_store(**cfg.to_dict())
    model = _model()
    off = offload_model(model, store)
    assert off.policy.depth == 2 and off.grads.home is Tier.HOST
    assert len(off.resident_ids) == 2  # the biases (128 and 16 bytes) stay resident
    opt = OffloadedAdamW(off)
    assert (opt.layout.moments, opt.layout.master) == ("bf16", "split")
    model(torch.randn(4, 64, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    opt.step()
    assert {store.info(k)["home"] for k in store.keys() if k.startswith("adam/")} == {"host"}


def test_a_policy_replaces_the_stores_settings_and_a_keyword_overrides_it(make_store):
    store = make_store(prefetch_depth=2, optimizer_moments="bf16")
    model = _model()
    off = offload_model(model, store, policy=ParamOffloadPolicy(prefetch_depth=0, home="host"), prefetch_depth=3)
    assert off.policy.depth == 3 and off.home is Tier.HOST
    assert {store.info(k)["home"] for k in store.keys() if k.startswith("param/")} == {"host"}
    opt = OffloadedAdamW(off, policy=OptimizerStatePolicy(moments="8bit", master="split"), master="fp32")
    assert (opt.layout.moments, opt.layout.master) == ("8bit", "fp32")


def test_bad_choices_name_the_setting_as_it_was_written():
    with pytest.raises(ValueError, match="optimizer_moments='4bit': choose one of 'fp32', 'bf16', '8bit'"):
        ts.StoreConfig(optimizer_moments="4bit")
    with pytest.raises(ValueError, match="moments='4bit': choose one of"):
        OptimizerStatePolicy(moments="4bit")
    with pytest.raises(ValueError, match="resident_threshold_bytes=-1 must be >= 0"):
        ts.TierStore(resident_threshold_bytes=-1)
    with pytest.raises(ValueError, match="prefetch_bytes=0 must be a positive"):
        ParamOffloadPolicy(prefetch_bytes=0)
    with pytest.raises(ts.UnknownSettingError, match=r"'optimizer_moment' \(did you mean 'optimizer_moments'\?\)"):
        ts.StoreConfig(optimizer_moment="8bit")
    with pytest.raises(ts.TierValueError, match="the store reads a setting of that name"):
        ts.register_layer_settings("a layer", {"queue_depth": (1, int)})


def test_a_layers_setting_read_as_a_config_attribute_still_answers_and_says_where_it_lives():
    cfg = ts.StoreConfig(param_tier="host")
    with pytest.warns(DeprecationWarning, match="config.param_tier is a setting of ParamOffloadPolicy.home"):
        assert cfg.param_tier is Tier.HOST
    with pytest.warns(DeprecationWarning):
        assert cfg.prefetch_depth == "auto"  # its layer's default
    with pytest.raises(AttributeError):
        cfg.no_such_setting


def _core_sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in (ROOT / "tierstore").glob("*.py")}


def test_the_store_config_holds_only_what_the_core_reads():
    """Each StoreConfig field is read by the core outside the config's own module, and the layers' settings are not
    (the core carries layer_settings but never reads a value from it)."""
    sources = _core_sources()
    del sources["_config.py"]
    read = set()
    for text in sources.values():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute):
                read.add(node.attr)
    fields = {f.name for f in dataclasses.fields(ts.StoreConfig)} - {"layer_settings"}
    assert fields - read == set(), "settings the core never reads belong to the layer that reads them"
    assert "layer_settings" not in read
    assert "8bit" not in (ROOT / "tierstore" / "_config.py").read_text()  # the choices are written once


def test_each_flat_setting_is_a_policy_field_with_its_default():
    declared = ts.declared_layer_settings()
    for flat, (policy, field) in __import__("tierstore.integrations.policies", fromlist=["FLAT"]).FLAT.items():
        assert declared[flat].default == getattr(policy(), field)
        assert declared[flat].owner == f"{policy.__name__}.{field}"


def test_a_layers_setting_is_known_before_its_layer_is_imported():
    """In a fresh process: a config of the store's own settings imports nothing above the core; one with a layer's
    setting finds the layer through its entry point (see [Note: Settings of the layers above])."""
    import subprocess
    import sys

    code = ("import sys, tierstore as ts\n"
            "ts.StoreConfig(queue_depth=4)\n"
            "assert 'tierstore.integrations' not in sys.modules\n"
            "c = ts.StoreConfig(optimizer_moments='8bit')\n"
            "print(c.layer_settings['optimizer_moments'], 'tierstore.integrations.policies' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["8bit", "True"]
