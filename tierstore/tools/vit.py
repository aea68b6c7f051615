"""A small Vision Transformer and a learnable synthetic image task, made in-process (no download)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from tierstore import TierValueError


@dataclass(frozen=True, kw_only=True)
class ViTConfig:
    image_size: int = 32
    patch_size: int = 8
    channels: int = 3
    dim: int = 64
    depth: int = 2
    heads: int = 2
    mlp_ratio: int = 4
    num_classes: int = 10

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise TierValueError(f"image_size={self.image_size} must be a multiple of patch_size={self.patch_size}")
        if self.dim % self.heads:
            raise TierValueError(f"dim={self.dim} must be a multiple of heads={self.heads}")


PRESETS = {
    "tiny": ViTConfig(dim=64, depth=2, heads=2),
    "small": ViTConfig(dim=256, depth=6, heads=4),
    "base": ViTConfig(dim=768, depth=12, heads=12),  # ~85M parameters
    "large": ViTConfig(dim=1024, depth=24, heads=16),  # ~300M
    "1b": ViTConfig(dim=1536, depth=36, heads=16),  # ~1.0B
    "3b": ViTConfig(dim=2560, depth=38, heads=20),  # ~3.0B: the largest the demo trains on a 24 GiB machine
}


class Block(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.fc1 = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig, *, checkpoint_blocks: bool = False, tie_head: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.checkpoint_blocks = checkpoint_blocks
        patches = (cfg.image_size // cfg.patch_size) ** 2
        self.patch = nn.Linear(cfg.channels * cfg.patch_size**2, cfg.dim)
        self.cls_token = nn.Parameter(torch.empty(1, 1, cfg.dim))
        self.pos = nn.Parameter(torch.empty(1, patches + 1, cfg.dim))
        self.reset_parameters()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)
        if tie_head:
            # A tied weight: the class embedding doubles as the output projection.
            self.class_embed = nn.Embedding(cfg.num_classes, cfg.dim)
            self.head.weight = self.class_embed.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialize the parameters this module owns itself (its children have their own), so that a ViT built
        on the meta device can be materialized module by module."""
        self.cls_token.zero_()
        nn.init.normal_(self.pos, std=0.02)  # in place: also for a DTensor shard (FSDP2 on the meta device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        c, p = self.cfg.channels, self.cfg.patch_size
        b = images.shape[0]
        x = images.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(b, -1, c * p * p)
        x = torch.cat([self.cls_token.expand(b, -1, -1), self.patch(x)], dim=1) + self.pos
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if self.checkpoint_blocks else blk(x)
        return self.head(self.norm(x[:, 0]))


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class SyntheticImages:
    """Images of ``num_classes`` fixed random templates plus noise; the label is the template."""

    def __init__(self, cfg: ViTConfig, *, seed: int = 0, noise: float = 1.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(cfg.num_classes, cfg.channels, cfg.image_size, cfg.image_size, generator=g)
        self.noise = noise
        self.seed = seed

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        labels = torch.randint(0, self.templates.shape[0], (batch_size,), generator=g)
        x = self.templates[labels] + self.noise * torch.randn(self.templates[labels].shape, generator=g)
        return x, labels
