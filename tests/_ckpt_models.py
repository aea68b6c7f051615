"""What the concurrent checkpoint test and its saver process share: the model, and a checkpoint's values."""

import torch


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
