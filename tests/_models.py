"""Models and helpers shared by the offload tests: each a pattern real models have (tied weights, a
gradient penalty, views of parameters, writes in forward, initializers of meta modules)."""

import copy
import threading
import warnings

import torch
import torch.nn.functional as F
from _training import _assert_same_parameters
from tierstore.integrations.offload import offload_model
from tierstore.integrations.optim import OffloadedAdamW


class TiedProjection(torch.nn.Module):
    """A parent with no parameters of its own that reads its children's weights directly."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
        self.head = torch.nn.Linear(16, 16)

    def forward(self, ids):
        h = self.body(self.embed(ids))
        logits = F.linear(h, self.embed.weight)  # a tied projection: never calls self.embed
        penalty = self.head.weight.pow(2).mean()  # a term that reads a child's weight, not its forward
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten()) + penalty + self.head(h).mean()


class GradientPenalty(torch.nn.Module):
    """A forward that runs a backward of its own (``torch.autograd.grad`` of a gradient penalty), then goes on
    to read parameters, its own and a child's."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 16)
        self.critic = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.head = torch.nn.Linear(16, 16)
        self.scale = torch.nn.Parameter(torch.ones(16, 16))

    def forward(self, ids):
        h = self.embed(ids)
        (g,) = torch.autograd.grad(self.critic(h).sum(), h, create_graph=True)
        penalty = (g.norm(dim=-1) - 1).pow(2).mean()
        logits = self.head(h) @ self.scale + self.head.weight.sum()
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten()) + penalty


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
        self.a = torch.nn.Linear(32, 8)
        self.b = torch.nn.Linear(32, 8)

    def forward(self, x):
        h = self.body(x)
        return self.a(h), self.b(h)


class Latents(torch.nn.Module):
    """Returns a view of its own parameter, as Perceiver's latent embeddings do."""

    def __init__(self):
        super().__init__()
        self.latents = torch.nn.Parameter(torch.randn(6, 16))

    def forward(self, batch):
        return self.latents.expand(batch, -1, -1)


class LatentsNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 16)
        self.latents = Latents()
        self.norm = torch.nn.LayerNorm(16)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
        self.head = torch.nn.Linear(16, 16)

    def forward(self, ids):
        q = self.norm(self.latents(ids.shape[0]))  # computed with after the latents' module returned
        q = q + self.mlp(q) + self.embed(ids).mean(1, keepdim=True)
        return F.cross_entropy(self.head(q).flatten(0, 1), ids[:, :1].expand(-1, 6).flatten())


class KeepsTransposeFn(torch.autograd.Function):
    """A linear map that keeps ``ctx.wt = weight.t()`` for backward instead of ``ctx.save_for_backward(weight)``:
    a view of the weight's memory that no saved-tensor hook sees."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x)
        ctx.wt = weight.t()
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad @ ctx.wt.t(), grad.t() @ x


class KeepsTranspose(torch.nn.Linear):
    def forward(self, x):
        return KeepsTransposeFn.apply(x, self.weight) + self.bias


class KeepsTransposeLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 64)
        self.layers = torch.nn.Sequential(*[KeepsTranspose(64, 64) for _ in range(6)])  # 16 KiB weights
        self.head = torch.nn.Linear(64, 16)

    def forward(self, ids):
        return F.cross_entropy(self.head(self.layers(self.embed(ids.flatten()))), ids.flatten())


def train_with_views(ref, model, store, *, steps, in_backward):
    """Train a KeepsTransposeLM-like pair resident and offloaded (no prefetch: evictions in a fixed order);
    each loss, its graph and the views it keeps go before the next forward. Same losses and parameters."""
    off = offload_model(model, store, resident_threshold_bytes=0, placement=False, prefetch_depth=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt = OffloadedAdamW(off, lr=1e-2, step_in_backward=in_backward)
    for step in range(steps):
        ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(step))
        losses = []
        for m, o in ((ref, ref_opt), (model, opt)):
            loss = m(ids)
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
            del loss
        assert losses[0] == losses[1], step
        _assert_same_parameters(model, ref)
    opt.close()
    return off


class CachesTranspose(torch.nn.Linear):
    """Caches ``weight.t()`` at its first forward and computes with the cached view from then on: a view of
    the resident parameter, it reads every optimizer update."""

    def forward(self, x):
        if not hasattr(self, "_wt"):
            self._wt = self.weight.t()
        return x @ self._wt + self.bias


class Interrupted(torch.nn.Linear):
    """Stops the forward with a KeyboardInterrupt (Ctrl-C) when armed, after computing with its weight."""

    armed = False

    def forward(self, x):
        y = super().forward(x)
        if self.armed:
            raise KeyboardInterrupt
        return y


class Gate(torch.nn.Module):
    """Waits, inside the model's forward (or, in backward, at the gradient through it), until let go."""

    def __init__(self):
        super().__init__()
        self.inside, self.go, self.in_backward = threading.Event(), threading.Event(), False

    def _wait(self, grad=None):
        self.inside.set()
        assert self.go.wait(30)
        return grad

    def forward(self, x):
        if self.in_backward:
            if x.requires_grad:
                x.register_hook(self._wait)
        else:
            self._wait()
        return x


class TiedLM(torch.nn.Module):
    """Standard modules only, constructed in the order they are registered, with a tied output projection."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.LayerNorm(96),
                                        torch.nn.Linear(96, 32))
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return F.cross_entropy(self.head(self.body(self.embed(ids))).flatten(0, 1), ids.flatten())


class Parametrized(torch.nn.Module):
    """A weight-normed convolution (as wav2vec2's positional one) and a symmetric-weight layer without a
    right_inverse: torch.nn.utils.parametrize keeps their original tensors in a ParametrizationList."""

    def __init__(self):
        super().__init__()
        from torch.nn.utils import parametrize

        class Symmetric(torch.nn.Module):
            def forward(self, w):
                return w.triu() + w.triu(1).transpose(-1, -2)

        self.conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(4, 8, 3, padding=1), dim=2)
        self.sym = torch.nn.Linear(8, 8)
        parametrize.register_parametrization(self.sym, "weight", Symmetric())

    def forward(self, x):
        return self.sym(self.conv(x).transpose(1, 2))


class LegacyTable(torch.nn.Module):
    """Makes a weight with ``torch.Tensor(size)``, which ignores ``torch.device("meta")`` (XLNet's attention does
    so): in a model built on meta it is real, uninitialized memory."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.Tensor(4, 8))
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x) + self.table.sum(0)


def init_table(module):
    if isinstance(module, LegacyTable):
        torch.nn.init.constant_(module.table, 0.5)
    elif isinstance(module, torch.nn.Linear):
        module.reset_parameters()


class HalfInit(torch.nn.Linear):
    def reset_parameters(self):  # writes half the weight and not the bias
        torch.nn.init.ones_(self.weight[:2])


class UnwrittenBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.long))  # set in __init__ only

    def reset_parameters(self):
        pass


def old_weight_norm(module):
    """torch.nn.utils.weight_norm: a forward pre-hook computes the weight from weight_g and weight_v."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.nn.utils.weight_norm(module)


def train_beside_resident(ref, model, store, *, width: int, steps: int = 3, compute_tier: str | None = None,
                           **opt_kw) -> OffloadedAdamW:
    """Train ``ref`` resident and ``model`` offloaded into ``store`` on the same batches, asserting the same
    parameters after every step; returns the offloaded model's optimizer, open."""
    off = offload_model(model, store, compute_tier=compute_tier)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt = OffloadedAdamW(off, lr=1e-2, **opt_kw)
    for step in range(steps):
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(step))
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
        _assert_same_parameters(model, ref)
    return opt


class ClippedLinear(torch.nn.Linear):
    """Clips its own weight on every forward (as weight clipping and renormalization do): in place, or by
    assigning ``.data``."""

    assign = False

    def forward(self, x):
        if self.assign:
            self.weight.data = self.weight.data.clamp(-0.05, 0.05)
        else:
            with torch.no_grad():
                self.weight.clamp_(-0.05, 0.05)
        return super().forward(x)


class Momentum(torch.nn.Module):
    """A query encoder trained by the optimizer and a key encoder that its forward moves towards it (MoCo, BYOL,
    DINO): the update reads and writes parameters of modules that are not running, four ways."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.q = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
        self.k = copy.deepcopy(self.q).requires_grad_(False)
        self.head = torch.nn.Linear(128, 4)

    def forward(self, x):
        with torch.no_grad():
            for pk, pq in zip(self.k.parameters(), self.q.parameters()):
                if self.how == "assign-data":
                    pk.data = pk.data * 0.9 + pq.data * 0.1
                elif self.how == "through-data":
                    pk.data.mul_(0.9).add_(pq.data, alpha=0.1)
                elif self.how == "detach":
                    pk.mul_(0.9).add_(pq.detach(), alpha=0.1)
                else:
                    pk.copy_(pk * 0.9 + pq * 0.1)
        return self.head(torch.cat([self.q(x), self.k(x)], -1))


# ---- the concurrent checkpoint test and its saver process -------------------------------------------
def race_model() -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])


def constant_state(model: torch.nn.Module, value: float) -> tuple[dict, dict]:
    """A state dict with ``value`` in every parameter, and an OffloadedAdamW state dict with it in every moment
    and as every step count."""
    model_sd = {name: torch.full_like(t, value) for name, t in model.state_dict().items()}
    state = {name: {"step": torch.tensor(value), "exp_avg": torch.full(p.shape, value),
                    "exp_avg_sq": torch.full(p.shape, value)} for name, p in model.named_parameters()}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "maximize": False,
               "params": [name for name, _ in model.named_parameters()]}]
    return model_sd, {"state": state, "param_groups": groups}
