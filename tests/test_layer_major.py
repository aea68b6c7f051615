"""A layer-major step (off.accumulate; see [Note: A layer-major step]): the loop's numbers, bit for bit, with each
weight read about once forward and once backward a step, activations in the tiers, and the models that are not a
chain run as the loop."""

from __future__ import annotations

import collections
import copy
import re
import warnings
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

import tierstore as ts
from tierstore.integrations import OffloadedAdamW, offload_model
from tierstore.integrations._layer_major import ACT_PREFIX, micro_batch_seeds

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

VOCAB = 256


def _llama(layers: int = 4, width: int = 64, **kw) -> nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=width * 11 // 4,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, **kw)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _batches(step: int, n: int, tokens: int = 16) -> list[torch.Tensor]:
    return [torch.randint(0, VOCAB, (2, tokens), generator=torch.Generator().manual_seed(100 * step + i))
            for i in range(n)]


def _store(nvme_dir: str, model: nn.Module, budget: int | None = None) -> ts.TierStore:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return ts.TierStore(nvme_path=nvme_dir, host_budget_bytes=budget or total // 3, file_size_bytes="4MiB",
                        block_size_bytes="64KiB")


def _train(model: nn.Module, store: ts.TierStore | None, n: int, steps: int, *, layer_major: bool,
           seeded: bool = False, tokens: int = 16, on_step=None) -> tuple[list, dict]:
    """``steps`` steps of ``n`` micro-batches with clipping to norm 1: offloaded (layer-major or the loop) or, with
    no store, resident (torch's AdamW). ``seeded``: the loop seeds each micro-batch as a layer-major step does."""
    if store is not None:
        off = offload_model(model, store, units=[LlamaDecoderLayer])
        opt = OffloadedAdamW(off, lr=1e-2)
    else:
        off, opt = None, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = []
    for step in range(steps):
        def step_fn(ids: torch.Tensor) -> float:
            loss = model(ids, labels=ids).loss / n
            loss.backward()
            return loss.item()

        mbs = _batches(step, n, tokens)
        if on_step is not None:
            on_step(step, store)
        if layer_major:
            losses.append(off.accumulate(step_fn, mbs))
        elif seeded:
            losses.append(_seeded_loop(step_fn, mbs))
        else:
            losses.append([step_fn(mb) for mb in mbs])
        (off.clip_grad_norm_ if off is not None else
         lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c))(1.0)
        opt.step()
        opt.zero_grad()
    if store is not None:
        opt.close()
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _seeded_loop(step_fn, mbs: list) -> list:
    """The loop that draws its random numbers as a layer-major step does (see [Note: A layer-major step])."""
    seeds = micro_batch_seeds(len(mbs))
    start = torch.get_rng_state()
    out = []
    for i, (mb, seed) in enumerate(zip(mbs, seeds)):
        if seed is None:
            torch.set_rng_state(start)
        else:
            torch.manual_seed(seed)
        out.append(step_fn(mb))
        if i == 0:
            after_first = torch.get_rng_state()
    torch.set_rng_state(after_first)
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("n", [1, 4])
def test_a_layer_major_step_is_the_loop_bit_for_bit(n, tmp_path):
    """fp32, clipping, a host budget of a third of the weights: the losses and weights of 3 steps are the loop's
    (one micro-batch: its activations kept in the store, its layers run again in backward)."""
    ref = _llama()
    runs = []
    for layer_major in (False, True):
        (tmp_path / str(layer_major)).mkdir()
        with _store(str(tmp_path / str(layer_major)), ref) as store:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no fallback
                runs.append(_train(copy.deepcopy(ref), store, n, 3, layer_major=layer_major))
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 3
    assert _same(runs[0][1], runs[1][1])


def test_with_dropout_each_micro_batch_draws_from_its_own_generator(tmp_path):
    """attention_dropout=0.1: the step is the loop that seeds each micro-batch as the step does (the layers run
    again in backward with the random state they had), and the global generator ends where the first
    micro-batch left it."""
    ref = _llama(attention_dropout=0.1)
    ref.train()
    runs = []
    for layer_major in (False, True):
        (tmp_path / str(layer_major)).mkdir()
        torch.manual_seed(7)
        with _store(str(tmp_path / str(layer_major)), ref) as store:
            runs.append(_train(copy.deepcopy(ref), store, 3, 2, layer_major=layer_major, seeded=True))
        runs[-1] = (*runs[-1], torch.get_rng_state())
    assert runs[0][0] == runs[1][0]
    assert _same(runs[0][1], runs[1][1])
    assert torch.equal(runs[0][2], runs[1][2])


def test_each_weight_is_read_about_once_forward_and_once_backward(tmp_path):
    """8 micro-batches under a host budget of half the weights: in the third step (its update included, which reads
    each weight once more), the decoder layers' weights are read from the drive about three times each (forward,
    backward, update: 3.9 on average, measured); the loop reads each once a micro-batch's forward and about once its
    backward (14.8)."""
    ref = _llama(layers=6)
    budget = sum(p.numel() * p.element_size() for p in ref.parameters()) // 2
    most = {}
    for layer_major in (False, True):
        reads: collections.Counter = collections.Counter()

        def record(step: int, store: ts.TierStore) -> None:
            if step == 2:
                store.record_timeline()

        (tmp_path / str(layer_major)).mkdir()
        with _store(str(tmp_path / str(layer_major)), ref, budget) as store:
            _train(copy.deepcopy(ref), store, 8, 3, layer_major=layer_major, on_step=record)
            timeline = store.timeline
            assert timeline is not None
            reads.update(e["args"]["key"] for e in timeline.events() if e.get("cat") == "transfer"
                         and e["name"].startswith("nvme->") and e["args"]["key"].startswith("param/model.layers."))
        most[layer_major] = (max(reads.values()), sum(reads.values()) / len(reads))
    assert most[True][1] <= 4.5 and most[True][0] <= 6 and most[False][1] >= 12, most  # (max, mean)


def test_activations_many_times_the_host_budget_go_to_the_drive(tmp_path):
    """One sequence of 1024 tokens whose activations at the layers' boundaries are several times the host budget:
    they are written to the drive and read back for backward, and the result is resident training's (with
    gradient checkpointing, which runs the layers again as the step does), bit for bit."""
    ref = _llama(layers=6, width=128)
    activations = 6 * 1024 * 128 * 4 * 2  # boundary activations of the batch of 2 sequences
    budget = activations // 5
    written: collections.Counter = collections.Counter()

    def record(step: int, store: ts.TierStore) -> None:
        if step == 1:
            store.record_timeline()

    with _store(str(tmp_path), ref, budget) as store:
        got = _train(copy.deepcopy(ref), store, 1, 2, layer_major=True, tokens=1024, on_step=record)
        assert store.memory()["host"]["peak_bytes"] <= budget
        timeline = store.timeline
        assert timeline is not None
        written.update(e["name"].split()[0] for e in timeline.events() if e.get("cat") == "transfer"
                       and e["args"]["key"].startswith(ACT_PREFIX))
        assert not [k for k in store.keys() if k.startswith(ACT_PREFIX)]  # each dropped after its backward
    assert written["host->nvme"] > 0 and written["nvme->host"] > 0, written
    resident = copy.deepcopy(ref)
    resident.activation_checkpointing_enable()
    want = _train(resident, None, 1, 2, layer_major=False, tokens=1024)
    assert got[0] == want[0] and _same(got[1], want[1])


class _Twice(nn.Module):
    """A block called twice in one forward (a layer shared across depth): not a chain."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.block(self.inp(x))))


def test_the_step_says_it_ran_layer_by_layer(tmp_path, capfd):
    """One line on stderr at the first step run layer by layer, none after; the stats count the steps."""
    ref = _llama(layers=2)
    with _store(str(tmp_path), ref, budget=8 << 20) as store:
        model = copy.deepcopy(ref)
        off = offload_model(model, store, units=[LlamaDecoderLayer])

        def step_fn(ids: torch.Tensor) -> None:
            model(ids, labels=ids).loss.backward()

        for step in range(2):
            off.accumulate(step_fn, _batches(step, 2))
            off.zero_grad()
        said = capfd.readouterr().err
    assert said.count("tierstore: off.accumulate runs the micro-batches layer by layer (2 through 2 units") == 1
    assert (off.stats.layer_major_steps, off.stats.loop_steps, off.layer_major_refused) == (2, 0, None)


@pytest.mark.parametrize("kind", ["twice", "tied-resident"])
def test_a_model_that_is_not_a_chain_runs_as_the_loop(kind, tmp_path):
    """A block called twice, or tied embeddings kept resident: a warning once, and the loop's numbers."""
    kept = {}
    if kind == "twice":
        torch.manual_seed(0)
        ref, units = _Twice(), [nn.Sequential]
        mbs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        loss_of = lambda m, x: m(x).square().mean()  # noqa: E731
    else:
        ref, units = _llama(tie_word_embeddings=True), [LlamaDecoderLayer]
        kept = {"resident_threshold_bytes": VOCAB * 64 * 4 + 1}
        mbs = _batches(0, 3)
        loss_of = lambda m, ids: m(ids, labels=ids).loss  # noqa: E731
    grads = []
    for layer_major in (False, True):
        model = copy.deepcopy(ref)
        (tmp_path / str(layer_major)).mkdir()
        budget = sum(p.numel() * p.element_size() for p in ref.parameters()) // 2 + (64 << 10)
        with _store(str(tmp_path / str(layer_major)), ref, budget) as store:
            off = offload_model(model, store, units=units, **kept)

            def step_fn(mb):
                loss = loss_of(model, mb) / len(mbs)
                loss.backward()
                return loss.item()

            if layer_major:
                with pytest.warns(UserWarning, match="not layer by layer"):
                    losses = off.accumulate(step_fn, mbs)
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # said once
                    off.accumulate(lambda mb: None, mbs)
                # the stats say so too, and why
                assert (off.stats.loop_steps, off.stats.layer_major_steps) == (2, 0)
                assert ("called twice" if kind == "twice" else "tied (used in two places) and kept resident"
                        ) in off.layer_major_refused
            else:
                losses = [step_fn(mb) for mb in mbs]
            grads.append((losses, [g.clone() for g in off.grads_in_order()]))
    assert grads[0][0] == grads[1][0]
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1]))


def test_under_autocast_the_layers_run_again_as_they_ran(tmp_path):
    """A step_fn that computes under autocast (Trainer's bf16=True): each layer runs again in backward under the
    autocast it ran under, so the gradients are the loop's, bit for bit."""
    ref = _llama()
    grads = []
    for layer_major in (False, True):
        model = copy.deepcopy(ref)
        (tmp_path / str(layer_major)).mkdir()
        with _store(str(tmp_path / str(layer_major)), ref) as store:
            off = offload_model(model, store, units=[LlamaDecoderLayer])

            def step_fn(ids: torch.Tensor) -> float:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(ids, labels=ids).loss / 3
                loss.backward()
                return loss.item()

            mbs = _batches(0, 3)
            losses = off.accumulate(step_fn, mbs) if layer_major else [step_fn(mb) for mb in mbs]
            grads.append((losses, [g.clone() for g in off.grads_in_order()]))
    assert grads[0][0] == grads[1][0]
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1]))


def _layer_classes(model: nn.Module) -> list[type[nn.Module]]:
    """The classes of the blocks of the model's outermost ModuleLists (its layers; an encoder-decoder's encoder
    and decoder layers), not of lists inside a block (T5's sublayers, Mixtral's experts)."""
    lists = {name: m for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)}
    outer = [m for name, m in lists.items() if not any(name.startswith(other + ".") for other in lists)]
    return list(dict.fromkeys(type(m[0]) for m in outer))


@pytest.mark.parametrize("name", ["llama-untied", "mixtral", "gpt-neox", "gemma2", "mistral-sliding", "falcon",
                                  "llama-tied", "gpt2", "t5", "bart", "marian", "whisper", "albert"])
def test_conformance_models_run_layer_major_as_the_loop(name, tmp_path):
    """Models it did not write, 3 micro-batches a step with clipping: the step's numbers are the loop's, bit for bit
    (the loop seeded as the step seeds, for those with dropout), tied embeddings (llama-tied, gemma2, falcon, gpt2)
    included; cross-attention (t5) and a layer shared across depth (albert) run as the loop, with the warning."""
    from conformance import CASES, state_bytes

    case = CASES[name]
    torch.manual_seed(0)
    ref = case.build()
    ref.train()
    units = _layer_classes(ref)
    budget = max(int(state_bytes(ref) * case.host_budget_fraction), 5 * max(p.numel() * 4 for p in ref.parameters()))
    runs, fell_back = [], None
    for layer_major in (True, False):
        model = copy.deepcopy(ref)
        (tmp_path / str(layer_major)).mkdir()
        with _store(str(tmp_path / str(layer_major)), ref, budget) as store:
            off = offload_model(model, store, units=units)
            opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01)
            losses = []
            torch.manual_seed(100)
            for step in range(2):
                def step_fn(batch):
                    loss = case.loss(model, batch) / 3
                    loss.backward()
                    return loss.item()

                mbs = [case.batch(3 * step + i) for i in range(3)]
                if layer_major:
                    with warnings.catch_warnings(record=True) as said:
                        warnings.simplefilter("always")
                        losses.append(off.accumulate(step_fn, mbs))
                    fell_back = fell_back or any("not layer by layer" in str(w.message) for w in said)
                else:
                    losses.append([step_fn(mb) for mb in mbs] if fell_back else _seeded_loop(step_fn, mbs))
                off.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
            opt.close()
            runs.append((losses, {k: v.clone() for k, v in model.state_dict().items()}))
    assert fell_back == (name == "albert")
    assert runs[0][0] == runs[1][0]
    assert _same(runs[0][1], runs[1][1])


def test_eviction_reads_the_step_s_queues_while_its_threads_change_them(tmp_path):
    """The activations' ranking (the step's ``_queued``) and the optimizer's queue are read by whichever thread
    evicts (a mover's prefetch) while the micro-batch threads and the caller change them. Here a thread evicts
    for ever beside a layer-major step under a tight budget (a third of the weights: prefetches and
    evictions all step long), with the interpreter switching threads every microsecond; before each reader got
    a snapshot no thread changes, it failed with "dictionary changed size during iteration" in every round."""
    import sys
    import threading

    ref = _llama(layers=4, width=64)
    errors: list[BaseException] = []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for round_ in range(2):
            (tmp_path / str(round_)).mkdir()
            with _store(str(tmp_path / str(round_)), ref) as store:
                model = copy.deepcopy(ref)
                off = offload_model(model, store, units=[LlamaDecoderLayer])
                opt = OffloadedAdamW(off, lr=1e-2)
                stop = threading.Event()

                def evicting() -> None:
                    while not stop.is_set():
                        try:
                            off.victim_order(ts.Tier.HOST, store.keys())  # what a mover's eviction asks
                        except BaseException as e:  # noqa: BLE001 (the test's failure)
                            errors.append(e)
                            return

                reader = threading.Thread(target=evicting)
                reader.start()
                try:
                    for step in range(2):
                        def step_fn(ids: torch.Tensor) -> None:
                            (model(ids, labels=ids).loss / 8).backward()

                        off.accumulate(step_fn, _batches(step, 8, tokens=4))
                        off.clip_grad_norm_(1.0)
                        opt.step()
                        opt.zero_grad()
                finally:
                    stop.set()
                    reader.join()
                opt.close()
                assert store.stats.snapshot()["evictions"] > 0 and store.stats.snapshot()["prefetches"] > 0
    finally:
        sys.setswitchinterval(switch)
    assert not errors, errors[0]


class _Around(nn.Module):
    """A chain of blocks with parameters of the model itself around it: ``pos`` added before the first block and,
    with ``after``, ``gain`` multiplied after the last (the head's side)."""

    def __init__(self, after: bool) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.pos = nn.Parameter(torch.randn(16))
        self.gain = nn.Parameter(torch.rand(16) + 0.5) if after else None
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(x * self.gain if self.gain is not None else x)


def _runs_around(model_of, units, loss_of, mbs, tmp_path, **kw) -> list:
    """The loop's and the layer-major step's (losses, gradients) over a copy of one model each."""
    ref = model_of()
    runs = []
    for layer_major in (False, True):
        model = copy.deepcopy(ref)
        path = tmp_path / str(layer_major)
        path.mkdir()
        with _store(str(path), ref, 8 << 20) as store:
            off = offload_model(model, store, units=units, **kw)

            def step_fn(mb):
                loss = loss_of(model, mb) / len(mbs)
                loss.backward()
                return loss.item()

            losses = off.accumulate(step_fn, mbs) if layer_major else [step_fn(mb) for mb in mbs]
            runs.append((losses, [g.clone() for g in off.grads_in_order()], off.layer_major_refused,
                         off.stats.layer_major_steps))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    return runs


def test_a_vit_whose_class_token_the_model_owns_runs_layer_by_layer(tmp_path):
    """A ViT written as timm writes it: its class token and position embedding are parameters of the model itself,
    held across the blocks (see [Note: Parameters held around the segments]); the step runs layer by layer,
    bit-identical to the loop."""
    import torch.nn.functional as F

    from tierstore.tools.vit import PRESETS, Block, SyntheticImages, ViT

    data = SyntheticImages(PRESETS["tiny"])

    def model_of():
        torch.manual_seed(0)
        return ViT(PRESETS["tiny"])

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        runs = _runs_around(model_of, [Block], lambda m, mb: F.cross_entropy(m(mb[0]), mb[1]),
                            [data.batch(i, 4) for i in range(3)], tmp_path)
    assert runs[1][2] is None and runs[1][3] == 1


@pytest.mark.parametrize("after", [False, True], ids=["before-only", "before-and-after"])
def test_parameters_of_the_model_used_after_the_first_segment_run_as_the_loop(after, tmp_path):
    """A parameter the model itself uses after the last segment too would have its gradient's parts summed in
    another order: the step runs as the loop, bit-identical, and the warning names it and the resident threshold
    that keeps it in memory. Used before the first segment only, the step runs layer by layer."""
    def model_of():
        torch.manual_seed(0)
        return _Around(after)

    mbs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    loss_of = lambda m, x: m(x).square().mean()  # noqa: E731
    if not after:
        runs = _runs_around(model_of, [nn.Sequential], loss_of, mbs, tmp_path)
        assert runs[1][2] is None and runs[1][3] == 1
        return
    with pytest.warns(UserWarning, match=r"gain.*resident_threshold_bytes=65\)"):
        runs = _runs_around(model_of, [nn.Sequential], loss_of, mbs, tmp_path)
    assert "another order" in runs[1][2] and runs[1][3] == 0
    # kept resident as it says, they hold nothing across the segments: layer by layer
    (tmp_path / "resident").mkdir()
    runs = _runs_around(model_of, [nn.Sequential], loss_of, mbs, tmp_path / "resident", resident_threshold_bytes=65)
    assert runs[1][2] is None and runs[1][3] == 1


def _step_both(ref: nn.Module, ropt, off, opt, step_fn, mbs: list, *, seeded: bool = False, clip: float = 1.0,
               allowed: str | None = None) -> None:
    """One step of ``mbs`` with clipping at ``clip``, resident on ``ref`` with torch's AdamW (the loop drawing as the
    layer-major step draws, with ``seeded``) and layer by layer through ``off`` with no fallback (no warning but
    those matching ``allowed``, warned again for the caller): the same losses and gradient norm, bit for bit."""
    rng = torch.get_rng_state()
    ref_losses = (_seeded_loop(lambda mb: step_fn(mb, ref), mbs) if seeded else [step_fn(mb, ref) for mb in mbs])
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    ropt.step()
    ropt.zero_grad()
    torch.set_rng_state(rng)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = off.accumulate(step_fn, mbs)
    for w in caught:
        assert allowed is not None and re.search(allowed, str(w.message)), f"a warning (a fallback?): {w.message}"
        warnings.warn(w.message, stacklevel=2)
    norm = torch.nn.utils.clip_grad_norm_(off.model.parameters(), clip)
    opt.step()
    opt.zero_grad()
    assert losses == ref_losses and torch.equal(norm, ref_norm)


def _trains_as_resident(ref: nn.Module, store, units: list, batches, loss_of, *, clip: float = 1.0,
                        allowed: str | None = None, **opt_kw) -> Any:
    """2 steps of 4 micro-batches (``batches(step)``, each micro-batch's loss ``loss_of(model, mb) / 4``), resident
    on ``ref`` with torch's AdamW and layer by layer on a copy of it offloaded in ``store`` (``OffloadedAdamW``
    given ``opt_kw``): every step's losses and gradient norm and the weights at the end the same bits, with no
    fallback (see :func:`_step_both`); the offload."""
    model = copy.deepcopy(ref)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    off = offload_model(model, store, units=units)
    opt = OffloadedAdamW(off, lr=1e-3, weight_decay=0.01, **opt_kw)
    for step in range(2):
        def step_fn(mb, m=model):
            loss = loss_of(m, mb) / 4
            loss.backward()
            return loss.item()

        _step_both(ref, ropt, off, opt, step_fn, batches(step), seeded=True, clip=clip, allowed=allowed)
    opt.close()
    assert off.stats.layer_major_steps == 2 and off.layer_major_refused is None
    assert all(torch.equal(off.read_param(n), p.detach()) for n, p in ref.named_parameters())
    return off


def test_a_timm_style_vit_trains_layer_by_layer_as_torch_trains_it_resident(tmp_path):
    """fp32, 4 micro-batches, clipping at 1.0, 2 steps: the ViT whose class token and position embedding the model
    owns runs layer by layer with no fallback, and ends bit-identical to resident training with torch's AdamW."""
    import torch.nn.functional as F

    from tierstore.tools.vit import PRESETS, Block, SyntheticImages, ViT

    torch.manual_seed(0)
    ref = ViT(PRESETS["tiny"])
    data = SyntheticImages(PRESETS["tiny"])
    with _store(str(tmp_path), ref, 8 << 20) as store:
        off = _trains_as_resident(ref, store, [Block], lambda step: [data.batch(10 * step + i, 2) for i in range(4)],
                                  lambda m, mb: F.cross_entropy(m(mb[0]), mb[1]))
        assert "cls_token" in {r.name for r in off.params.values()}  # offloaded, not kept resident


def test_a_drive_with_room_for_some_kept_versions_speculates_those_layer_by_layer(tmp_path):
    """speculate=True under off.accumulate on a drive with room for about half of what the updates replace: when
    micro-batch k-1's backward begins, the gradients of the micro-batches before are stored already, and the room
    left for their next writes is not set aside again, so the updates are speculated while the rest of the room
    lasts (some, not all), the others are made at step(), one warning says so, and the run is torch's resident
    one, bit for bit."""
    def loss_of(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return m(ids, labels=ids).loss

    batches = partial(_batches, n=4)
    peaks = {}
    for speculate in (False, True):
        ref = _llama(layers=3)
        ref.train()
        (tmp_path / f"probe{speculate}").mkdir()
        total = sum(p.numel() * p.element_size() for p in ref.parameters())
        with _store(str(tmp_path / f"probe{speculate}"), ref, total) as store:
            _trains_as_resident(ref, store, [LlamaDecoderLayer], batches, loss_of, clip=1e9, speculate=speculate)
            peaks[speculate] = store.memory()["nvme"]["peak_bytes"]
    assert peaks[True] > peaks[False]
    ref = _llama(layers=3)
    ref.train()
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    (tmp_path / "run").mkdir()
    with ts.TierStore(nvme_path=str(tmp_path / "run"), host_budget_bytes=total, file_size_bytes="4MiB",
                      block_size_bytes="64KiB", nvme_budget_bytes=(peaks[True] + peaks[False]) // 2) as store:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            off = _trains_as_resident(ref, store, [LlamaDecoderLayer], batches, loss_of, clip=1e9, speculate=True,
                                      allowed="no room to keep")
        stats, params = store.stats_dict(), len(off.params)
    assert sum("no room" in str(w.message) for w in caught) == 1
    assert 0 < stats["updates_speculated"] == stats["speculated_kept"] < 2 * params


def _qwen2_tied() -> nn.Module:
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg)


def _tied_case(name: str):
    """(model, its segments' class, step -> its 4 micro-batches, the loss) of a language model with tied
    embeddings."""
    from conformance import CASES

    if name in ("llama-tied", "qwen2-tied"):
        model = _llama(layers=3, tie_word_embeddings=True) if name == "llama-tied" else _qwen2_tied()
        batches, loss = partial(_batches, n=4), lambda m, ids: m(ids, labels=ids).loss
    else:
        torch.manual_seed(0)
        case = CASES[name]
        model, loss = case.build(), case.loss
        batches = lambda step: [case.batch(4 * step + i) for i in range(4)]  # noqa: E731
    assert len(list(model.parameters())) < len(list(model.named_parameters(remove_duplicate=False)))  # tied
    return model, _layer_classes(model), batches, loss


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-tied", "gemma2", "gpt2", "t5", "bart", "whisper"])
def test_tied_language_models_train_layer_by_layer_as_torch_trains_them_resident(name, tmp_path):
    """fp32, 4 micro-batches, clipping at 1.0, 2 steps: a model whose head is its embedding (see [Note: Tied
    parameters layer by layer]; T5's and BART's shared by encoder, decoder and head), encoder-decoders among them
    (their decoders' inputs made between the encoder's layers and the decoder's, the encoder's output taken by
    every decoder layer: see [Note: Values the segments take]), runs layer by layer with no fallback, and ends
    bit-identical to resident training with torch's AdamW (dropout drawn as the step draws it)."""
    ref, units, batches, loss_of = _tied_case(name)
    ref.train()
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    layer = max(sum(p.nbytes for p in m.parameters()) for m in ref.modules() if isinstance(m, tuple(units)))
    with _store(str(tmp_path), ref, max(total // 3, 3 * layer)) as store:
        _trains_as_resident(ref, store, units, batches, loss_of)


def test_a_tied_embedding_keeps_only_the_rows_of_the_step_s_tokens(tmp_path, monkeypatch):
    """The head's part of each micro-batch is kept for the rows of the step's tokens only (k x |R| x width), not
    whole (k x vocab x width); the step stays the loop's, bit for bit, and two calls before one step add as the
    loop's micro-batches do."""
    from tierstore.integrations._layer_major import LayerMajorStep

    kept = []
    keep = LayerMajorStep.keep
    monkeypatch.setattr(LayerMajorStep, "keep", lambda self, value, place: kept.append(value.shape) or
                        keep(self, value, place))
    ref = _llama(layers=2, tie_word_embeddings=True)
    mbs = [torch.randint(0, VOCAB // 8, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    rows = len(torch.unique(torch.cat(mbs)))
    grads = []
    for how in ("loop", "one step", "two calls"):
        model = copy.deepcopy(ref)
        (tmp_path / how).mkdir()
        with _store(str(tmp_path / how), ref, 8 << 20) as store:
            off = offload_model(model, store, units=[LlamaDecoderLayer])

            def step_fn(ids):
                loss = model(ids, labels=ids).loss / 4
                loss.backward()
                return loss.item()

            if how == "loop":
                losses = [step_fn(mb) for mb in mbs]
            elif how == "one step":
                losses = off.accumulate(step_fn, mbs)
            else:
                losses = off.accumulate(step_fn, mbs[:2]) + off.accumulate(step_fn, mbs[2:])
            grads.append((losses, [g.clone() for g in off.grads_in_order()]))
    heads = [s for s in kept if s[-1] == 64 and s[0] != 2]  # not a boundary activation (2 sequences)
    assert len(heads) == 4 + 2 + 2 and all(s[0] <= rows for s in heads) and rows < VOCAB // 4
    assert grads[0][0] == grads[1][0] == grads[2][0]
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(grads[0][1], grads[1][1], grads[2][1]))


class _TiedOther(nn.Module):
    """A head tied to an input weight that is used otherwise than by an embedding of the step's tokens alone:
    ``dense``, by a Linear before the blocks; ``shifted``, by the embedding and by a lookup of shifted tokens."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(16, 16) if kind == "dense" else nn.Embedding(16, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(16, 16, bias=False)
        self.head.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "dense":
            x = self.inp(x)
        else:
            x = self.inp(x) + nn.functional.embedding((x + 1) % 16, self.inp.weight)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize("kind", ["dense", "shifted"])
def test_a_tied_parameter_used_otherwise_runs_as_the_loop(kind, tmp_path):
    """Used before the blocks by a module that is no embedding (found in the forward), or in rows beyond those of
    the embedding's tokens (found when its part comes): the step runs as the loop, bit-identical, and says why."""
    def model_of():
        torch.manual_seed(0)
        return _TiedOther(kind)

    g = torch.Generator().manual_seed(0)
    mbs = [torch.randn(4, 16, generator=g) if kind == "dense" else torch.randint(0, 8, (4, 3), generator=g)
           for _ in range(3)]
    with pytest.warns(UserWarning, match="not layer by layer"):
        runs = _runs_around(model_of, [nn.Sequential], lambda m, x: m(x).square().mean(), mbs, tmp_path)
    assert ("no dense nn.Embedding" if kind == "dense" else "not zero outside the rows") in runs[1][2]
    assert runs[1][3] == 0


def test_a_tied_model_layer_by_layer_with_updates_streamed_is_the_same_run(tmp_path):
    """Tied embeddings layer by layer with the update streamed into the next forward (the embedding's fetch waits
    for its update while the step's kept rows are gone): the losses and weights of the optimizer that steps after
    backward, bit for bit."""
    ref = _llama(layers=3, tie_word_embeddings=True)
    runs = []
    for stream in (False, True):
        model = copy.deepcopy(ref)
        (tmp_path / str(stream)).mkdir()
        with _store(str(tmp_path / str(stream)), ref, 1 << 20) as store:  # weights and moments 1.9x that
            off = offload_model(model, store, units=[LlamaDecoderLayer])
            opt = OffloadedAdamW(off, lr=1e-2, stream_update=stream)
            losses = []
            for step in range(3):
                def step_fn(ids):
                    loss = model(ids, labels=ids).loss / 4
                    loss.backward()
                    return loss.item()

                losses.append(off.accumulate(step_fn, _batches(step, 4)))
                off.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
            opt.close()
            assert off.stats.layer_major_steps == 3 and (not stream or store.stats_dict()["updates_streamed"] > 0)
            runs.append((losses, {k: v.clone() for k, v in model.state_dict().items()}))
    assert runs[0][0] == runs[1][0]
    assert _same(runs[0][1], runs[1][1])


class _Memory(nn.Module):
    """Blocks that each take, besides the chain, a value made earlier and use it twice (as an encoder's output or
    T5's position bias is used): ``made="segment"``, the first block's second output; ``made="glue"``, a tensor the
    model makes before the first block. ``between``: the chain is scaled (``"scaled"``) or goes through one module
    (``"module"``) between blocks (made between segments)."""

    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.mem = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.tanh(self.fc(x)), torch.tanh(self.mem(x))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
            att = torch.softmax(self.q(x) @ self.k(mem).transpose(-1, -2), -1)
            return x + att @ self.v(mem)

    def __init__(self, made: str, between: str | None = None) -> None:
        super().__init__()
        self.made, self.between = made, between
        self.first = _Memory.First()
        self.side = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(_Memory.Block() for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        side = torch.tanh(self.side(x))
        x, mem = self.first(x)
        mem = mem if self.made == "segment" else side
        for b in self.blocks:
            x = b(x, mem)
            x = x * 2 if self.between == "scaled" else self.mid(x) if self.between == "module" else x
        return self.head(x).square().mean()


@pytest.mark.parametrize("made", ["segment", "glue"])
def test_a_value_several_segments_take_sums_its_gradient_in_the_loop_s_order(made, tmp_path):
    """A tensor taken by every block and used twice in each (the first block's second output, or a tensor made
    before the first block; see [Note: Values the segments take]): the step runs layer by layer, its gradient's
    parts summed as the loop's one backward sums them (each block's rerun adds its parts after the sum so far),
    bit for bit."""
    def model_of():
        torch.manual_seed(0)
        return _Memory(made)

    mbs = [torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        runs = _runs_around(model_of, [_Memory.First, _Memory.Block], lambda m, x: m(x), mbs, tmp_path)
    assert runs[1][2] is None and runs[1][3] == 1


@pytest.mark.parametrize("between", ["scaled", "module"])
def test_a_tensor_made_between_segments_is_glue_run_in_the_loop_s_order(between, tmp_path):
    """The chain changed between blocks (made between segments, as an encoder-decoder makes its decoder's input):
    that glue's backward runs between the blocks' reruns, bit-identical to the loop. A module the glue between
    blocks calls every time would have its gradient's parts from each place summed in another order: the step
    runs as the loop, bit-identical, and says why."""
    def model_of():
        torch.manual_seed(0)
        return _Memory("segment", between=between)

    mbs = [torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    if between == "scaled":
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback
            runs = _runs_around(model_of, [_Memory.First, _Memory.Block], lambda m, x: m(x), mbs, tmp_path)
        assert runs[1][3] == 1
        return
    with pytest.warns(UserWarning, match="glue between segments .* and elsewhere"):
        runs = _runs_around(model_of, [_Memory.First, _Memory.Block], lambda m, x: m(x), mbs, tmp_path)
    assert runs[1][3] == 0


def test_a_t5_encoder_trains_layer_by_layer_as_torch_trains_it_resident(tmp_path):
    """T5's encoder (each block takes the position bias the first block made, a value taken by every segment),
    with a classifier head and dropout: fp32, 4 micro-batches, clipping at 1.0, 2 steps, layer by layer with no
    fallback and bit-identical to resident training with torch's AdamW."""
    from transformers.models.t5.modeling_t5 import T5Block

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            cfg = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_heads=4)
            self.encoder = transformers.T5EncoderModel(cfg)
            self.head = nn.Linear(64, 5)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(ids).last_hidden_state.mean(1))

    torch.manual_seed(0)
    ref = Classifier()
    ref.train()
    with _store(str(tmp_path), ref, 8 << 20) as store:
        _trains_as_resident(ref, store, [T5Block], lambda step: [(ids, ids[:, 0] % 5) for ids in _batches(step, 4)],
                            lambda m, mb: torch.nn.functional.cross_entropy(m(mb[0]), mb[1]))


@pytest.mark.parametrize("clip", [1e9, 1e-3], ids=["never-clipped", "always-clipped"])
@pytest.mark.parametrize("name", ["llama", "llama-tied", "t5", "vit"])
def test_updates_speculated_in_the_last_micro_batch_layer_by_layer(name, clip, tmp_path):
    """speculate=True under off.accumulate: each parameter is updated as micro-batch k-1's backward completes its
    gradient (a tied weight's, summed at the end, is not), kept where the clip did not clip, undone and made again
    where it did; the run is torch's resident one, bit for bit (see [Note: The last micro-batch]). A decoder, a
    tied one, an encoder-decoder and the timm-style ViT (class token and position embedding the model's own)."""
    import torch.nn.functional as F

    from tierstore.integrations._tied import tied_parameters
    from tierstore.tools.vit import PRESETS, Block, SyntheticImages, ViT

    if name == "llama":
        ref, units, batches, loss_of = _llama(layers=3), [LlamaDecoderLayer], partial(_batches, n=4), \
            lambda m, ids: m(ids, labels=ids).loss
    elif name == "vit":
        torch.manual_seed(0)
        ref, data = ViT(PRESETS["tiny"]), SyntheticImages(PRESETS["tiny"])
        units, loss_of = [Block], lambda m, mb: F.cross_entropy(m(mb[0]), mb[1])
        batches = lambda step: [data.batch(10 * step + i, 2) for i in range(4)]  # noqa: E731
    else:
        ref, units, batches, loss_of = _tied_case(name)
    ref.train()
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    # the weights, their moments and gradients 4x that (2.7x for the ViT, whose few layers are wide)
    with _store(str(tmp_path), ref, total * 3 // 2 if name == "vit" else total) as store:
        off = _trains_as_resident(ref, store, units, batches, loss_of, clip=clip, speculate=True)
        stats = store.stats_dict()
        tied = len([i for i in tied_parameters(off.model) if i in off.params])
        untied = len(off.params) - tied
    speculated, kept, undone = stats["updates_speculated"], stats["speculated_kept"], stats["speculated_undone"]
    assert 0 < speculated <= 2 * untied
    assert kept + undone == speculated
    # never clipped, every one stands; clipped, each one the worker made before the clip is undone (one made after
    # it read the clipped gradient, which is the step's)
    assert undone == 0 if clip > 1 else undone > 0
