"""Closing a store that an offloaded model still uses loses no trained weight: close() and the end of a ``with``
block (an exception inside it too) give the model its values back, or refuse and say what to call first; the
interpreter's exit removes the swap files and says nothing; a Ctrl-C says where the run stood."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tierstore as ts
from tierstore.integrations import OffloadedAdamW, _base, offload_model

from _training import _assert_same_parameters, _tiny_pair, _train, train_resident


def _trained(store, steps=2, **opt_kw):
    """A tiny ViT offloaded to ``store`` and trained ``steps`` steps, its resident twin trained alike, the data."""
    ref, model, data = _tiny_pair()
    train_resident(ref, data, steps)
    off = offload_model(model, store)
    opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, **opt_kw)
    _train(model, data, steps, opt)
    return ref, model, off, opt, data


def _gives_back(ref, model, opt, data, swap_dir):
    """The model holds its trained values as ordinary tensors, computes as its resident twin, and the store's
    swap files are gone; its optimizer says it has no state left."""
    assert _base.offloaded_of(model) is None
    _assert_same_parameters(model, ref)
    x, _ = data.batch(9, 4)
    assert torch.equal(model(x), ref(x))
    assert not os.path.exists(swap_dir)
    with pytest.raises(ts.TierStoreError, match="no longer offloaded.*make a new optimizer"):
        opt.step()
    off = opt.offloaded
    with pytest.raises(ts.TierStoreError, match="was removed .*read them from the model"):
        off.read_param(next(iter(ref.state_dict())))
    off.remove()  # once more: nothing to do
    with ts.TierStore(nvme_path=os.path.dirname(swap_dir), host_budget_bytes="64MiB") as again:
        offload_model(model, again)  # the model offloads afresh, trained values and all
        assert torch.equal(model(x), ref(x))


def test_close_gives_an_attached_model_its_trained_values(tmp_path):
    store = ts.TierStore(nvme_path=str(tmp_path), host_budget_bytes="64MiB")
    ref, model, off, opt, data = _trained(store)
    swap_dir = store.swap_directory
    store.close()
    assert store.closed
    _gives_back(ref, model, opt, data, swap_dir)
    assert store.close() is None  # a second close is nothing


def test_the_end_of_a_with_block_gives_the_values_back(tmp_path):
    with ts.TierStore(nvme_path=str(tmp_path), host_budget_bytes="64MiB") as store:
        ref, model, off, opt, data = _trained(store)
        swap_dir = store.swap_directory
    _gives_back(ref, model, opt, data, swap_dir)


def test_an_exception_inside_the_block_goes_on_and_the_values_come_back(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with ts.TierStore(nvme_path=str(tmp_path), host_budget_bytes="64MiB") as store:
            ref, model, off, opt, data = _trained(store)
            swap_dir = store.swap_directory
            1 / 0
    _gives_back(ref, model, opt, data, swap_dir)


@pytest.fixture
def little_memory(monkeypatch):
    """As if the machine had 1 KiB of memory free: too little to give a model its values back."""
    monkeypatch.setattr(_base, "free_memory_bytes", lambda device: 1024)


def test_a_model_too_big_to_give_back_refuses_the_close_and_names_what_to_call(tmp_path, little_memory):
    store = ts.TierStore(nvme_path=str(tmp_path), host_budget_bytes="64MiB")
    ref, model, off, opt, data = _trained(store)
    with pytest.raises(ts.StoreInUseError) as refused:
        store.close()
    message = str(refused.value)
    for words in ("ViT is offloaded to this store (offload_model)", "GiB of values live only here",
                  "save_checkpoint(path, model, optimizer)", "off.remove(keep_values=False)", "Nothing was closed"):
        assert words in message
    assert not store.closed  # and everything still works: train on, save
    _train(model, data, 1, opt)
    train_resident(ref, data, 1)  # the twin one step further too (its own optimizer: same steps as ours)
    # dropped on purpose after a save: the parameters keep their shapes on the meta device
    off.remove(keep_values=False)
    assert all(p.is_meta for p in model.parameters())
    store.close()
    assert store.closed


def test_a_with_block_that_cannot_give_back_raises_the_refusal_or_notes_it_on_the_block_s_exception(
        tmp_path, little_memory):
    with pytest.raises(ts.StoreInUseError, match="Nothing was closed"):
        with ts.TierStore(nvme_path=str(tmp_path), host_budget_bytes="64MiB") as store:
            _, model, off, opt, data = _trained(store, steps=1)
    assert not store.closed
    off.remove(keep_values=False)
    store.close()

    with pytest.raises(ZeroDivisionError) as raised:
        with ts.TierStore(nvme_path=str(tmp_path), host_budget_bytes="64MiB") as store:
            _, model, off, opt, data = _trained(store, steps=1)
            1 / 0
    assert any("the store was left open" in note for note in raised.value.__notes__)
    assert not store.closed
    x, _ = data.batch(0, 4)
    model(x)  # still offloaded and usable: nothing was lost
    off.remove()
    store.close()


def test_closing_inside_a_forward_is_refused(tmp_path):
    store = ts.TierStore(nvme_path=str(tmp_path), host_budget_bytes="64MiB")
    _, model, off, opt, data = _trained(store, steps=1)
    seen = []

    def close_now(module, args, output):
        with pytest.raises(ts.StoreInUseError, match="inside a forward or backward"):
            store.close()
        seen.append(True)

    handle = model.blocks[0].register_forward_hook(close_now)
    model(data.batch(0, 4)[0])
    handle.remove()
    assert seen and not store.closed
    store.close()


def test_the_interpreter_s_exit_with_an_offloaded_model_leaves_no_swap_files(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import tierstore as ts
        from _training import _tiny_pair, train_offloaded
        store = ts.TierStore(nvme_path={str(nvme)!r}, host_budget_bytes="64MiB")
        _, model, data = _tiny_pair()
        train_offloaded(model, data, 1, store)
        print(store.swap_directory)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert not os.path.exists(done.stdout.strip())
    assert os.listdir(nvme) == []


@pytest.mark.parametrize("mode", ["forward", "accumulate"])
def test_a_real_ctrl_c_says_where_the_run_stood_and_the_run_goes_on(mode, tmp_path):
    """SIGINT to the main thread inside the model's forward, or while off.accumulate's threads run (the main
    thread waiting on them in threading's join): the KeyboardInterrupt carries a note of where the run stood,
    what to call next and what becomes of the swap directory; the step then runs again; uncaught, the process ends
    and its swap directory with it."""
    pytest.importorskip("transformers")
    from conftest import child_script

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    said = {"forward": "the offloaded model's forward was stopped; what it held was let go",
            "accumulate": "off.accumulate was stopped in its forward, its micro-batches past 2, 1 of their 3 segments"}
    resumed = subprocess.run([sys.executable, child_script("interrupt_child.py"), mode, str(tmp_path), "resume"],
                             capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    swap, note, last = resumed.stdout.splitlines()
    assert note.startswith(f"tierstore: {said[mode]}") and "call opt.zero_grad()" in note, note
    assert note.endswith(f"the swap directory {swap} is removed when the store closes or the process exits")
    assert last == "resumed"

    ended = subprocess.run([sys.executable, child_script("interrupt_child.py"), mode, str(tmp_path)],
                           capture_output=True, text=True, env=env, timeout=300)
    assert ended.returncode != 0 and "KeyboardInterrupt" in ended.stderr
    assert f"tierstore: {said[mode]}" in ended.stderr
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_of_an_optimizer_whose_model_was_given_back_is_refused(tmp_path):
    from tierstore.integrations import save_checkpoint

    with ts.TierStore(nvme_path=str(tmp_path), host_budget_bytes="64MiB") as store:
        ref, model, off, opt, data = _trained(store, steps=1)
    with pytest.raises(ts.TierStoreError, match="no longer offloaded.*make a new optimizer"):
        save_checkpoint(str(tmp_path / "ckpt"), model, opt)  # would hold no optimizer state at all
    assert not (tmp_path / "ckpt").exists()


def test_two_models_that_fit_one_at_a_time_but_not_together_are_refused_together(tmp_path, monkeypatch):
    store = ts.TierStore(nvme_path=str(tmp_path), host_budget_bytes="64MiB")
    refs, models, offs = [], [], []
    for wrap in (lambda m: m, lambda m: torch.nn.Sequential(m)):  # two models, no name in common
        ref, model, _ = _tiny_pair()
        refs.append(wrap(ref))
        models.append(wrap(model))
        offs.append(offload_model(models[-1], store))
    one = sum(p.numel() * p.element_size() for _, _, p in offs[0].named_offloaded())
    monkeypatch.setattr(_base, "free_memory_bytes", lambda device: one + one // 2)  # room for one, not two
    with pytest.raises(ts.StoreInUseError, match="more than the .* free to give them back into"):
        store.close()
    assert all(_base.offloaded_of(m) is not None for m in models)  # neither given back: nothing was closed
    monkeypatch.undo()
    store.close()
    for ref, model in zip(refs, models):
        _assert_same_parameters(model, ref)


def test_a_step_stopped_part_way_is_finished_before_the_close(tmp_path, monkeypatch):
    from tierstore.integrations import _pipeline

    store = ts.TierStore(nvme_path=str(tmp_path), host_budget_bytes="64MiB")
    ref, model, off, opt, data = _trained(store, steps=1, speculate=False)  # step()'s updates, none in backward
    x, y = data.batch(1, 8)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    update, calls = _pipeline.StatePipeline.update, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("update failed")
        return update(self, *args, **kwargs)

    monkeypatch.setattr(_pipeline.StatePipeline, "update", failing)
    with pytest.raises(RuntimeError, match="update failed"):
        opt.step()
    with pytest.raises(ts.StoreInUseError, match="its last step stopped part-way.*call opt.step\\(\\) to finish"):
        store.close()
    monkeypatch.undo()
    opt.step()  # finishes the step (as if it had not failed: tests/test_optim.py)
    opt.zero_grad()
    store.close()
    assert _base.offloaded_of(model) is None and not any(p.is_meta for p in model.parameters())
    model(x)  # whole values, given back
