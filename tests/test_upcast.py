"""Half-precision weights computed in fp32 (tierstore/tools/upcast.py): the block-wise products give the fp32
products of the same weights, for any block split, dtype and layout, on several threads at once."""

import copy
import threading

import pytest
import torch
from tierstore.tools import upcast
from tierstore.tools.upcast import compute_in_fp32


def _run(model: torch.nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    out = model(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)))
    return (out.detach(), x.grad, *(p.grad.clone() for p in model.parameters()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [1 << 21, 1000, 37])  # one block; several with a ragged last; one row a block
def test_block_wise_products_are_the_fp32_products_of_the_same_weights(monkeypatch, dtype, block):
    monkeypatch.setattr(upcast, "_BLOCK_ELEMENTS", block)
    torch.manual_seed(0)
    half = torch.nn.Linear(48, 70).to(dtype)
    ref = copy.deepcopy(half).float()  # the same values, exactly, in fp32
    assert compute_in_fp32(half) == 1
    x = torch.randn(3, 5, 48)
    got, want = _run(half, x, 1), _run(ref, x, 1)
    assert got[0].dtype == torch.float32 and got[2].dtype == dtype and got[3].dtype == dtype
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)  # the output
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)  # the input's gradient
    for g, w in zip(got[2:], want[2:]):  # the weight's and the bias's gradients, rounded to the weight's dtype
        # each element is the same fp32 sum; the product's kernel may order it differently for another block
        # shape, which can move the rounded value by one unit
        torch.testing.assert_close(g.float(), w.to(dtype).float(), rtol=1e-2, atol=1e-6)


def test_a_half_input_gets_a_half_gradient_and_a_weight_needing_none_gets_none(monkeypatch):
    monkeypatch.setattr(upcast, "_BLOCK_ELEMENTS", 100)
    lin = torch.nn.Linear(16, 24, bias=False).bfloat16()
    compute_in_fp32(lin)
    lin.weight.requires_grad_(False)
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    out = lin(x)
    out.sum().backward()
    assert out.dtype == torch.float32 and x.grad.dtype == torch.bfloat16 and lin.weight.grad is None
    expect = torch.ones(4, 24) @ lin.weight.float()
    torch.testing.assert_close(x.grad, expect.bfloat16())


def test_a_transposed_weight_view_multiplies_as_its_values(monkeypatch):
    monkeypatch.setattr(upcast, "_BLOCK_ELEMENTS", 64)
    lin = torch.nn.Linear(12, 20, bias=False).bfloat16()
    compute_in_fp32(lin)
    base = torch.randn(12, 20).bfloat16()
    lin.weight = torch.nn.Parameter(base.t())  # not contiguous
    x = torch.randn(3, 12)
    torch.testing.assert_close(lin(x), x @ base.float(), rtol=1e-6, atol=1e-6)


def test_two_threads_computing_at_once_each_get_what_they_get_alone(monkeypatch):
    monkeypatch.setattr(upcast, "_BLOCK_ELEMENTS", 4096)  # many blocks: the threads' scratch use interleaves
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 32)).bfloat16()
        compute_in_fp32(m)
        models.append(m)
    xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(s)) for s in (2, 3)]
    alone = [[_run(m, x, 4) for _ in range(3)] for m, x in zip(models, xs)]
    together: list[list[tuple[torch.Tensor, ...]]] = [[], []]

    def work(i: int) -> None:
        for _ in range(3):
            together[i].append(_run(models[i], xs[i], 4))

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1):
        assert len(together[i]) == 3
        for a, b in zip(alone[i], together[i]):
            assert all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_an_embedding_gives_the_values_and_gradients_of_an_fp32_copy_of_its_table(padding_idx):
    torch.manual_seed(0)
    half = torch.nn.Embedding(50, 16, padding_idx=padding_idx).bfloat16()
    ids = torch.tensor([[3, 7, 7, 0, 49], [7, 3, 3, 12, 7]])  # repeated ids: their gradients add up
    weight = half.weight.detach().clone().requires_grad_()
    want = torch.nn.functional.embedding(ids, weight.float(), padding_idx)  # what the cast copy gives
    compute_in_fp32(half)
    got = half(ids)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    g = torch.randn(got.shape) * 1e3
    got.backward(g)
    want.backward(g)
    assert half.weight.grad.dtype == torch.bfloat16 and torch.equal(half.weight.grad, weight.grad)
    if padding_idx is not None:
        assert not half.weight.grad[padding_idx].any()


@pytest.mark.parametrize("tied", [True, False])
def test_a_transformers_llama_in_bf16_computed_in_fp32_trains_offloaded_as_resident(make_store, tied):
    """A model we did not write (its embedding tied to its head or not): compressed state, the weights moving
    through a small host budget, the same losses as with everything resident."""
    transformers = pytest.importorskip("transformers")
    from tierstore.integrations import OffloadedAdamW, offload_model

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tied)
    base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    runs = []
    for budget in ("64MiB", "256KiB"):
        model = copy.deepcopy(base)
        assert compute_in_fp32(model) == 2 * 7 + 2  # each layer's 7 Linears, the embedding, the head
        opt = OffloadedAdamW(offload_model(model, make_store(host_budget_bytes=budget)), lr=1e-3,
                             moments="8bit", master="split")
        losses = []
        ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))  # one repeated batch
        for _ in range(4):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append(losses)
        opt.close()
    assert runs[0] == runs[1] and runs[0][-1] < runs[0][0]


def test_products_stay_fp32_whatever_the_default_dtype(monkeypatch):
    monkeypatch.setattr(upcast, "_BLOCK_ELEMENTS", 256)
    lin = torch.nn.Linear(32, 40).bfloat16()
    emb = torch.nn.Embedding(10, 32).bfloat16()
    compute_in_fp32(lin)
    compute_in_fp32(emb)
    x = torch.randn(3, 32)
    ids = torch.tensor([1, 2, 2])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = lin(x)
        rows = emb(ids)
        (out.sum() + rows.sum()).backward()
    finally:
        torch.set_default_dtype(previous)
    assert out.dtype == rows.dtype == torch.float32
    torch.testing.assert_close(out, x @ lin.weight.float().t() + lin.bias.float(), rtol=1e-6, atol=1e-6)
    assert lin.weight.grad.dtype == emb.weight.grad.dtype == torch.bfloat16
    assert emb.weight.grad[2].eq(2).all() and emb.weight.grad[0].eq(0).all()


def test_auto_compute_keeps_the_faster_of_the_two_products_as_measured(monkeypatch):
    measured = upcast.product_seconds(torch.bfloat16, rows=4, width=64, repeats=1)
    assert set(measured) == {"param", "fp32"} and all(v > 0 for v in measured.values())
    for times, want in (({"param": 1.0, "fp32": 2.0}, "param"), ({"param": 3.0, "fp32": 2.0}, "fp32")):
        monkeypatch.setattr(upcast, "_measured", {})
        calls = []
        monkeypatch.setattr(upcast, "product_seconds", lambda dtype, t=times: calls.append(dtype) or t)
        assert upcast.resolve_compute("auto", torch.bfloat16) == (want, times)
        assert upcast.resolve_compute("auto", torch.bfloat16) == (want, times) and calls == [torch.bfloat16]
    # fp32 weights compute in fp32, a GPU in the weights' dtype, an explicit choice as given: nothing measured
    assert upcast.resolve_compute("auto", torch.float32) == ("param", None)
    assert upcast.resolve_compute("auto", torch.float16, on_cpu=False) == ("param", None)
    assert upcast.resolve_compute("fp32", torch.bfloat16) == ("fp32", None) and calls == [torch.bfloat16]
    with pytest.raises(ValueError, match="choose auto"):
        upcast.resolve_compute("fp16", torch.bfloat16)
