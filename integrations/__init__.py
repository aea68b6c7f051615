"""Hooks that attach a TierStore to training loops and distributed engines."""

__all__: list[str] = []
