"""Bad config and bad calls: each error has the right type and says what to do."""

import os
import subprocess
import warnings

import pytest
import torch

import tierstore as ts


@pytest.mark.parametrize("field", ["device_budget_bytes", "host_budget_bytes", "nvme_budget_bytes"])
@pytest.mark.parametrize("value", [0, -1, "-5MiB"])
def test_non_positive_budgets(field, value):
    with pytest.raises(ValueError, match=f"{field}=.*must be a positive number of bytes"):
        ts.StoreConfig(**{field: value})


def test_budget_not_a_size():
    with pytest.raises(ValueError, match=r"host_budget_bytes='lots' is not a byte count.*'512MiB'"):
        ts.StoreConfig(host_budget_bytes="lots")


def test_block_size_must_be_aligned():
    with pytest.raises(ValueError, match="multiple of 4096"):
        ts.StoreConfig(block_size_bytes=1000)


def test_unknown_tier_names_the_setting_as_written():
    from tierstore.integrations import ParamOffloadPolicy, split_settings

    with pytest.raises(ValueError, match="param_tier='ssd': unknown tier 'ssd'; choose one of: device, host, nvme"):
        split_settings({"param_tier": "ssd"})
    with pytest.raises(ValueError, match="home='ssd': unknown tier 'ssd'"):
        ParamOffloadPolicy(home="ssd")


def test_missing_nvme_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist or is not a directory"):
        ts.TierStore(nvme_path=str(tmp_path / "nope"))


def test_nvme_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        ts.TierStore(nvme_path=str(f))


def test_read_only_nvme_path(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() == 0:  # root writes through mode bits; an immutable directory stops it too
        if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
            pytest.skip("cannot make a read-only directory as root here (chattr +i refused)")
    else:
        os.chmod(d, 0o555)
    try:
        with pytest.raises(ValueError, match="is not writable by this process; choose a writable directory"):
            ts.TierStore(nvme_path=str(d))
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(d)], check=True)


def test_nvme_home_without_nvme_path():
    with ts.TierStore(host_budget_bytes="1MiB") as store:
        with pytest.raises(ValueError, match="needs nvme_path"):
            store.put("x", torch.zeros(3), home="nvme")


def test_tensor_larger_than_every_tier(make_store):
    store = make_store(host_budget_bytes="1MiB", device_budget_bytes="1MiB")
    with pytest.raises(ts.TierBudgetError, match=r"exceed host_budget_bytes=1048576.*raise host_budget_bytes"):
        store.put("big", torch.zeros(300_000))
    with pytest.raises(ts.TierBudgetError, match="exceed device_budget_bytes"):
        store.put("big", torch.zeros(300_000), home="device")
    assert "big" not in store


def test_nvme_budget(make_store):
    store = make_store(nvme_budget_bytes=8192)
    store.put("a", torch.zeros(2048)).wait()
    with pytest.raises(ts.TierBudgetError, match="nvme_budget_bytes=8192"):
        store.put("b", torch.zeros(2048))
    assert "b" not in store


def test_quantized_dtype_rejected(make_store):
    store = make_store()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch
        q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match="not supported.*dequantize"):
        store.put("q", q)


def test_a_tensor_with_gaps_or_overlaps_is_rejected(make_store):
    store = make_store()
    for t in (torch.randn(4, 8)[:, ::2], torch.randn(4, 1).expand(4, 4)):
        with pytest.raises(ValueError, match=r"gaps or overlaps.*pass tensor.contiguous\(\)"):
            store.put("t", t)
    assert "t" not in store


def test_not_a_tensor(make_store):
    store = make_store()
    with pytest.raises(TypeError, match="needs a torch.Tensor"):
        store.put("t", [1, 2, 3])


def test_get_unknown_key(make_store):
    store = make_store()
    with pytest.raises(KeyError, match="unknown key 'nope': put\\(\\) it into the store first"):
        store.get("nope", "host")


def test_duplicate_key(make_store):
    store = make_store()
    store.put("a", torch.zeros(1))
    with pytest.raises(ValueError, match="already in the store; drop"):
        store.put("a", torch.zeros(1))


def test_get_nvme_is_not_a_tensor(make_store):
    store = make_store()
    store.put("a", torch.zeros(1))
    with pytest.raises(ValueError, match="get or prefetch into 'host' or 'device'"):
        store.get("a", "nvme")


def test_release_without_get(make_store):
    store = make_store()
    store.put("a", torch.zeros(10)).wait()
    with pytest.raises(ValueError, match="without a matching get"):
        store.release("a", "device")


def test_mark_dirty_without_get(make_store):
    store = make_store()
    store.put("a", torch.zeros(10)).wait()
    with pytest.raises(ValueError, match="get\\(\\) the tensor in that tier first"):
        store.mark_dirty("a", "device")


def test_evict_held_copy_and_home(make_store):
    store = make_store()
    store.put("a", torch.zeros(10)).wait()
    store.get("a", "device")
    with pytest.raises(ValueError, match="held; release\\(\\) it first"):
        store.evict("a", "device")
    with pytest.raises(ValueError, match="home tier; use drop"):
        store.evict("a", "nvme")


def test_device_full_of_held_tensors(make_store):
    store = make_store(device_budget_bytes=8192)
    store.put("a", torch.zeros(1024)).wait()
    store.put("b", torch.zeros(1024)).wait()
    store.put("c", torch.zeros(1024)).wait()
    store.get("a", "device")
    store.get("b", "device")
    with pytest.raises(ts.TierBudgetError, match=r"by get\(\) without release\(\): MainThread holds 2 \(a, b\)"):
        store.get("c", "device")
    h = store.prefetch("c", "device")
    h.wait()
    assert h.skipped
    store.release("a", "device")
    store.get("c", "device")


def test_use_after_close(make_store):
    store = make_store()
    store.put("a", torch.zeros(10)).wait()
    store.close()
    for call in (lambda: store.get("a", "host"), lambda: store.put("b", torch.zeros(1)),
                 lambda: store.prefetch("a", "host"), lambda: store.flush()):
        with pytest.raises(ts.StoreClosedError, match="closed; create a new TierStore"):
            call()
    store.close()  # idempotent


def test_wrong_config_type():
    with pytest.raises(TypeError, match="must be a StoreConfig"):
        ts.TierStore({"host_budget_bytes": 1})


def test_a_closed_store_says_so_for_every_call(make_store):
    store = make_store()
    store.put("a", torch.zeros(8)).wait()
    store.close()
    for call in (lambda: store.get("a", "host"), lambda: store.release("a", "host"), lambda: store.info("a"),
                 lambda: store.mark_dirty("a", "host"), lambda: store.drop("a"), lambda: store.evict("a", "host"),
                 lambda: store.prefetch("a", "host"), lambda: store.put("b", torch.zeros(8))):
        with pytest.raises(ts.StoreClosedError, match="closed"):
            call()


def test_a_budget_beyond_the_machines_memory_is_refused(nvme_dir):
    import psutil

    too_much = psutil.virtual_memory().total + 2**30
    with pytest.raises(ValueError, match=r"host_budget_bytes=.* GiB exceeds this machine's memory"):
        ts.TierStore(nvme_path=nvme_dir, host_budget_bytes=too_much)


def test_a_failed_optimizer_construction_leaves_nothing_behind(make_store):
    from tierstore.integrations.offload import offload_model
    from tierstore.integrations.optim import OffloadedAdamW

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    store = make_store(nvme_budget_bytes="1MiB", file_size_bytes="1MiB")  # the weights fit, their moments not
    off = offload_model(model, store)
    keys = store.keys()
    with pytest.raises(ts.StoreFullError, match=r"AdamW state of 1.0 MiB needs that much room .* 0.5 MiB is free"):
        OffloadedAdamW(off)  # refused before any of it is written
    assert store.keys() == keys  # a retry would not find another optimizer's state


def test_a_misspelt_setting_is_named_with_the_valid_ones(nvme_dir):
    with pytest.raises(TypeError, match=r"'queue_dept' \(did you mean 'queue_depth'\?\).*host_budget_bytes"):
        ts.TierStore(nvme_path=nvme_dir, queue_dept=4)


def test_every_error_raised_is_a_tierstore_error_and_the_builtin_of_its_kind(make_store, nvme_dir):
    """Each of tierstore's own errors is a TierStoreError and the builtin a caller catches for its kind; no
    module of the package or its integrations raises a bare builtin error (tierstore.testing's simulated I/O
    faults raise OSError as the operating system would)."""
    import ast
    import builtins
    import pathlib

    for cls, builtin in ((ts.TierValueError, ValueError), (ts.TierTypeError, TypeError), (ts.TierKeyError, KeyError),
                         (ts.UnsupportedError, NotImplementedError), (ts.TierOSError, OSError)):
        assert issubclass(cls, ts.TierStoreError) and issubclass(cls, builtin)
    with pytest.raises(ts.TierValueError) as bad:
        ts.StoreConfig(host_budget_bytes="lots")
    assert isinstance(bad.value, ValueError)
    store = make_store()
    with pytest.raises(ts.TierKeyError):
        store.get("nothing")
    root = pathlib.Path(ts.__file__).parent
    bare = []
    for path in [*root.rglob("*.py"), *(root.parent / "integrations").rglob("*.py")]:
        tree = ast.parse(path.read_text())
        # __getattr__ says "no such attribute" with AttributeError, as the attribute protocol asks
        protocol = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
                    for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                name = exc.id if isinstance(exc, ast.Name) else None
                if isinstance(getattr(builtins, name or "", None), type) and name != "StopIteration" and not (
                        path.name == "testing.py" and name == "OSError") and not (
                        name == "AttributeError" and id(node) in protocol):
                    bare.append(f"{path.relative_to(root.parent)}:{node.lineno}: {name}")
    assert not bare, bare
