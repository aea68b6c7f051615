import json

import pytest

import tierstore as ts
from tierstore import Tier
from tierstore.integrations import ParamOffloadPolicy, load_settings, settings_from_deepspeed


def test_keywords_and_sizes():
    c = ts.StoreConfig(host_budget_bytes="2GiB", device_budget_bytes="1.5GB")
    assert c.host_budget_bytes == 2 * 1024**3
    assert c.device_budget_bytes == 1_500_000_000


def test_frozen():
    c = ts.StoreConfig()
    with pytest.raises(AttributeError):
        c.queue_depth = 3


def test_json_and_toml(tmp_path):
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"host_budget_bytes": "64MiB", "queue_depth": 4}))
    c = ts.load_config(j, queue_depth=8)
    assert (c.host_budget_bytes, c.queue_depth) == (64 * 1024**2, 8)
    t = tmp_path / "c.toml"
    t.write_text('[tierstore]\nnvme_path = "/tmp"\nblock_size_bytes = "2MiB"\nverify_checksums = true\n')
    c = ts.load_config(t)
    assert c.nvme_path == "/tmp" and c.block_size_bytes == 2 * 1024**2 and c.verify_checksums


def test_unknown_key_lists_valid_keys(tmp_path):
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"host_budget": 5}))
    with pytest.raises(ValueError, match=r"unknown setting\(s\) 'host_budget' \(did you mean 'host_budget_bytes'\?\); "
                                         r"the store's settings are: .*host_budget_bytes"):
        ts.load_config(j)
    with pytest.raises(ts.UnknownSettingError):  # the same error as TierStore(host_budget=...) raises
        ts.TierStore(host_budget=5)


def test_bad_values_name_the_key():
    with pytest.raises(ValueError, match="queue_depth=0 must be an integer >= 1"):
        ts.StoreConfig(queue_depth=0)
    with pytest.raises(TypeError, match="verify_checksums must be true or false"):
        ts.StoreConfig(verify_checksums="yes")
    with pytest.raises(ValueError, match="prefetch_depth=-1"):
        ParamOffloadPolicy(prefetch_depth=-1)


def test_bad_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read config file"):
        ts.load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        ts.load_config(bad)
    yml = tmp_path / "c.yaml"
    yml.write_text("a: 1")
    with pytest.raises(ValueError, match="must end in .json or .toml"):
        ts.load_config(yml)


DS = {
    "train_batch_size": 8,
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                          "buffer_count": 5, "buffer_size": 100000000},
        "offload_optimizer": {"device": "cpu", "pin_memory": True, "fast_init": False},
        "stage3_param_persistence_threshold": 10000,
        "overlap_comm": True,
    },
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 2, "single_submit": False,
            "overlap_events": True},
}


def test_deepspeed_mapping_reports_unhonoured_keys(tmp_path):
    with pytest.warns(UserWarning, match="does not honour these DeepSpeed config keys") as rec:
        settings, ignored = settings_from_deepspeed(DS)
    cfg, params, state = settings.store, settings.params, settings.optimizer
    assert params.home is Tier.NVME and state.home is Tier.HOST
    assert cfg.nvme_path == "/local_nvme" and cfg.pin_host_memory
    assert params.prefetch_depth == 4
    assert (cfg.block_size_bytes, cfg.queue_depth, cfg.io_threads) == (1048576, 8, 2)
    assert params.resident_threshold_bytes == 20000
    assert set(ignored) == {
        "zero_optimization.offload_param.buffer_size", "zero_optimization.offload_optimizer.fast_init",
        "zero_optimization.overlap_comm", "aio.single_submit", "aio.overlap_events", "train_batch_size"}
    for key in ignored:
        assert key in str(rec[0].message)
    f = tmp_path / "ds.json"
    f.write_text(json.dumps(DS))
    with pytest.warns(UserWarning):
        assert load_settings(f).optimizer.home is Tier.HOST


def test_the_stores_deepspeed_reader_reports_the_integrations_keys_as_not_its_own(tmp_path):
    """ts.from_deepspeed maps the store's keys alone (the core knows no setting above it): the devices, the
    buffer count and the persistence threshold are listed as not honoured there."""
    with pytest.warns(UserWarning, match="does not honour"):
        cfg, ignored = ts.from_deepspeed(DS)
    assert cfg.nvme_path == "/local_nvme" and (cfg.block_size_bytes, cfg.queue_depth) == (1048576, 8)
    assert {"zero_optimization.offload_param.device", "zero_optimization.offload_optimizer.device",
            "zero_optimization.offload_param.buffer_count",
            "zero_optimization.stage3_param_persistence_threshold"} <= set(ignored)
    f = tmp_path / "ds.json"
    f.write_text(json.dumps(DS))
    with pytest.warns(UserWarning):
        assert ts.load_config(f).queue_depth == 8


def test_deepspeed_bad_device():
    with pytest.raises(ValueError, match="must be 'nvme', 'cpu' or 'none'"):
        settings_from_deepspeed({"zero_optimization": {"offload_param": {"device": "tape"}}})


def test_deepspeed_config_as_transformers_writes_it_loads_with_auto_values():
    """transformers' DeepSpeed integration writes "auto" for values it fills in: tierstore keeps its own default
    for those, and lists them with the keys not honoured; a value that cannot be read names its key."""
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
                                "offload_param": {"device": "cpu", "pin_memory": True, "buffer_count": "auto"},
                                "stage3_param_persistence_threshold": "auto", "stage3_prefetch_bucket_size": "auto"}}
    with pytest.warns(UserWarning, match=r"stage3_param_persistence_threshold=auto \(tierstore's default\)"):
        settings, ignored = settings_from_deepspeed(ds)
    assert settings.params == ParamOffloadPolicy(home="host")  # the rest are the defaults
    assert settings.optimizer.home is Tier.NVME
    assert "zero_optimization.offload_param.buffer_count=auto (tierstore's default)" in ignored
    bad = {"zero_optimization": {"stage3_param_persistence_threshold": "1e4x"}}
    with pytest.raises(ValueError, match=r"stage3_param_persistence_threshold='1e4x' cannot be read"):
        settings_from_deepspeed(bad)
    with pytest.raises(ValueError, match=r"aio.queue_depth=2.5 cannot be read"):
        ts.from_deepspeed({"aio": {"queue_depth": 2.5}})
