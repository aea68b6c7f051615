"""Configuration: one frozen dataclass, loaded from keywords, JSON, TOML or a DeepSpeed file."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._types import TierTypeError, TierValueError, UnknownSettingError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any, *, name: str) -> int:
    """An int, float or a string such as '512MiB' or '4GB' as a byte count."""
    if isinstance(value, bool):
        raise TierTypeError(f"{name} must be a byte count such as 1073741824 or '1GiB', not {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if n.is_integer():
                return int(n)
            raise TierValueError(f"{name}={value!r} is {n} bytes, not a whole number: write it in a smaller unit "
                                 f"(e.g. '{int(n) // 1024}KiB') or as an integer")
    raise TierValueError(
        f"{name}={value!r} is not a byte count; write an integer or a size such as '512MiB' or '4GB'"
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """What the store and its I/O engine are tuned by: the store's settings alone (see [Note: Settings of the
    layers above])."""

    nvme_path: str | None = None
    """Directory under which the private swap directory is made; required for the NVMe tier."""
    device_budget_bytes: int = 2 * 1024**3
    """Most bytes of tensors the device tier (GPU, or CPU memory without CUDA) may hold."""
    host_budget_bytes: int = 4 * 1024**3
    """Most bytes the host tier (pinned CPU buffers with CUDA) may hold, pooled buffers included."""
    nvme_budget_bytes: int | None = None
    """Most bytes of swap space; None means as much as the filesystem has free."""
    block_size_bytes: int = 4 * 1024**2
    """Size of each read or write the I/O engine issues; a multiple of 4096. 4 MiB stepped ViT-large 8% faster
    than 1 MiB here (same-process A/B, medians of 8: 4.49 against 4.88 s, with less CPU in the I/O threads) and
    reads and writes the drive as fast."""
    queue_depth: int = 16
    """Most block reads/writes the I/O engine keeps in flight at once."""
    io_threads: int = 8
    """Threads issuing O_DIRECT preadv/pwritev; the drive sees min(io_threads, queue_depth) requests."""
    file_size_bytes: int = 256 * 1024**2
    """Most bytes of each preallocated swap file that tensors are packed into (a larger tensor gets a file of its
    size); a new file is made smaller where nvme_budget_bytes or the drive's free room (less nvme_reserve_bytes)
    leave less."""
    nvme_reserve_bytes: int = 64 * 1024**2
    """Bytes the store leaves free on the filesystem under nvme_path, for the system and other programs; 0 lets
    it take every free byte."""
    direct_io: bool = True
    """Use O_DIRECT; where the filesystem refuses it (tmpfs), fall back to buffered I/O with a warning."""
    verify_checksums: bool = False
    """Checksum every block written to the NVMe tier and verify it on read."""
    pin_host_memory: bool = True
    """Pin host-tier buffers when CUDA is available (ignored without CUDA)."""
    malloc_mmap_threshold_bytes: int | None = 128 * 1024
    """Fix the C allocator's mmap threshold at this size when a store is created, so that memory freed by tensors
    goes back to the system and RSS does not grow with the model (glibc only; a setting of the whole process; see
    [Note: Giving freed memory back]). None leaves the allocator alone."""

    def __post_init__(self) -> None:
        for name in ("device_budget_bytes", "host_budget_bytes", "nvme_budget_bytes",
                     "block_size_bytes", "file_size_bytes", "nvme_reserve_bytes", "malloc_mmap_threshold_bytes"):
            value = getattr(self, name)
            if value is None and name in ("nvme_budget_bytes", "malloc_mmap_threshold_bytes"):
                continue
            object.__setattr__(self, name, parse_bytes(value, name=name))
        for name in ("device_budget_bytes", "host_budget_bytes", "nvme_budget_bytes",
                     "block_size_bytes", "file_size_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise TierValueError(f"{name}={value} must be a positive number of bytes")
        if self.malloc_mmap_threshold_bytes is not None and not 0 < self.malloc_mmap_threshold_bytes <= 2**25:
            raise TierValueError(f"malloc_mmap_threshold_bytes={self.malloc_mmap_threshold_bytes} must be between 1 "
                                 f"byte and 32 MiB (glibc's limit), or None to leave the allocator alone")
        if self.block_size_bytes % 4096:
            raise TierValueError(
                f"block_size_bytes={self.block_size_bytes} must be a multiple of 4096 "
                "(O_DIRECT needs aligned transfers); try 4194304 (4 MiB)"
            )
        if self.file_size_bytes % 4096:
            raise TierValueError(f"file_size_bytes={self.file_size_bytes} must be a multiple of 4096")
        if self.nvme_reserve_bytes < 0:
            raise TierValueError(f"nvme_reserve_bytes={self.nvme_reserve_bytes} must be >= 0 (0 leaves nothing free "
                                 f"on the drive for others)")
        for name in ("queue_depth", "io_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TierValueError(f"{name}={value!r} must be an integer >= 1")
        for name in ("direct_io", "verify_checksums", "pin_host_memory"):
            if not isinstance(getattr(self, name), bool):
                raise TierTypeError(f"{name} must be true or false, not {getattr(self, name)!r}")
        if self.nvme_path is not None:
            object.__setattr__(self, "nvme_path", os.fspath(self.nvme_path))

    def replace(self, **changes: Any) -> StoreConfig:
        """A copy with some fields changed (validated like any other)."""
        return from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        """Every setting by name, as a config file writes them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


_CORE_FIELDS = frozenset(f.name for f in dataclasses.fields(StoreConfig))
SETTINGS_ABOVE = ("settings of offload_model and OffloadedAdamW (prefetch depth, tiers, optimizer state) are their "
                  "policies: pass them as policy=, or read a file that holds both with "
                  "tierstore.integrations.load_settings")
"""Said of a setting the store does not have (see [Note: Settings of the layers above])."""


def check_settings(names: Iterable[str], what: str, *, above: Iterable[str] = ()) -> None:
    """Raise :class:`UnknownSettingError` for any of ``names`` that StoreConfig does not have (nor ``above``: the
    names a layer above reads beside the store's, where it splits a settings file of its own), naming the closest
    one of each and listing them all.

    [Note: Settings of the layers above] The store's config holds the
    store's settings and nothing else: the core reads every one of them and
    knows no setting of a layer above it. The integrations' choices
    (``offload_model``'s prefetch depth, ``OffloadedAdamW``'s moments, ...) are
    their own policies, passed to them as ``policy=``; a file or a DeepSpeed
    config that holds both is split by ``tierstore.integrations.load_settings``,
    which reads the file here (:func:`read_config_file`,
    :func:`read_deepspeed`) and builds this config from the store's part."""
    valid = _CORE_FIELDS | set(above)
    unknown = sorted(set(names) - valid)
    if unknown:
        hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, valid, 1)) else repr(k)
                 for k in unknown]
        listed = (f"the settings are: {', '.join(sorted(valid))}" if above else
                  f"the store's settings are: {', '.join(sorted(_CORE_FIELDS))}; {SETTINGS_ABOVE}")
        raise UnknownSettingError(f"{what} has unknown setting(s) {', '.join(hints)}; {listed}")


def from_dict(values: Mapping[str, Any]) -> StoreConfig:
    """Build a config from a mapping; an unknown key is an error that lists the valid ones."""
    check_settings(values, "the config")
    return StoreConfig(**values)


def _toml_reader(path: str) -> Any:
    """The standard library's TOML reader (Python 3.11+), or tomli where it is installed."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise TierValueError(f"reading {path!r} needs a TOML reader: Python 3.11+, or `pip install tomli` on "
                                 "Python 3.10 (or use a .json config)") from None
    return tomllib


def read_config_file(path: str | os.PathLike[str]) -> tuple[dict[str, Any], bool]:
    """The settings a .json or .toml file holds (a TOML file's ``[tierstore]`` table, or its top level), and whether
    it is a DeepSpeed config (a JSON file with a ``zero_optimization`` or ``aio`` section: read it with
    :func:`read_deepspeed`)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TierValueError(f"cannot read config file {path!r}: {e.strerror}") from e
    deepspeed = False
    if path.endswith(".toml"):
        tomllib = _toml_reader(path)
        try:
            values = tomllib.loads(raw.decode())
        except tomllib.TOMLDecodeError as e:
            raise TierValueError(f"config file {path!r} is not valid TOML: {e}") from e
        values = values.get("tierstore", values)
    elif path.endswith(".json"):
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as e:
            raise TierValueError(f"config file {path!r} is not valid JSON: {e}") from e
        deepspeed = isinstance(values, dict) and ("zero_optimization" in values or "aio" in values)
    else:
        raise TierValueError(f"config file {path!r} must end in .json or .toml")
    if not isinstance(values, dict):
        raise TierValueError(f"config file {path!r} must hold a table/object of keys")
    return values, deepspeed


def load_config(path: str | os.PathLike[str], **overrides: Any) -> StoreConfig:
    """Load the store's config from a .json or .toml file; keywords override the file.

    A JSON file with a ``zero_optimization`` or ``aio`` section is read as a
    DeepSpeed config (see :func:`from_deepspeed`). A file that also holds the
    integrations' settings is read by ``tierstore.integrations.load_settings``.
    """
    values, deepspeed = read_config_file(path)
    if deepspeed:
        config, _ = from_deepspeed(values)
        return config.replace(**overrides) if overrides else config
    return from_dict({**values, **overrides})


def deepspeed_int(value: Any) -> int:
    """A DeepSpeed config's integer (a float only when whole)."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise TierValueError("not an integer")
    return int(value)


DeepSpeedKeys = Mapping[str, tuple[str, Callable[[Any], Any]]]
"""Dotted DeepSpeed key -> (the setting it gives, the converter of its value)."""

STORE_DEEPSPEED_KEYS: DeepSpeedKeys = {
    "zero_optimization.offload_param.pin_memory": ("pin_host_memory", bool),
    "zero_optimization.offload_optimizer.pin_memory": ("pin_host_memory", bool),
    # elements of fp16/bf16
    "zero_optimization.offload_param.max_in_cpu": ("host_budget_bytes", lambda v: deepspeed_int(v) * 2),
    "aio.block_size": ("block_size_bytes", deepspeed_int),
    "aio.queue_depth": ("queue_depth", deepspeed_int),
    "aio.thread_count": ("io_threads", deepspeed_int),
    "aio.intra_op_parallelism": ("io_threads", deepspeed_int),
}
"""The DeepSpeed keys the store honours (``nvme_path`` and ``stage`` apart)."""

_AUTO = object()


def _ds_read(dotted: str, value: Any, convert: Callable[[Any], Any], ignored: list[str]) -> Any:
    """``convert(value)`` of DeepSpeed key ``dotted``; ``_AUTO`` for ``"auto"`` (as transformers' integration
    writes values it fills in itself: tierstore's default is kept, and said); an unreadable value names the key."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        ignored.append(f"{dotted}=auto (tierstore's default)")
        return _AUTO
    try:
        return convert(value)
    except (TypeError, ValueError) as e:
        raise TierValueError(f"DeepSpeed config key {dotted}={value!r} cannot be read ({e}); give a number, or "
                             f"\"auto\" for tierstore's default") from None


def read_deepspeed(ds: Mapping[str, Any], keys: DeepSpeedKeys = STORE_DEEPSPEED_KEYS) -> tuple[dict[str, Any],
                                                                                              list[str]]:
    """The settings a DeepSpeed config (dict) gives under ``keys`` (the store's by default; a layer above adds
    its own), plus ``nvme_path``; and the dotted names of the keys not honoured. ``"auto"`` values
    (transformers' DeepSpeed integration writes them) keep tierstore's default and are listed with the keys not
    honoured; a value that cannot be read is a ValueError naming its key. Warns of nothing."""
    ours: dict[str, Any] = {}
    ignored: list[str] = []
    zero = ds.get("zero_optimization", {}) or {}
    given = [(f"zero_optimization.{section}.{key}", value)
             for section in ("offload_param", "offload_optimizer") for key, value in (zero.get(section) or {}).items()]
    given += [(f"zero_optimization.{key}", value) for key, value in zero.items()
              if key not in ("offload_param", "offload_optimizer")]
    given += [(f"aio.{key}", value) for key, value in (ds.get("aio") or {}).items()]
    ignored += [key for key in ds if key not in ("zero_optimization", "aio")]
    convert: Callable[[Any], Any]
    for dotted, value in given:
        if dotted.endswith(".nvme_path") and dotted.count(".") == 2:
            if "nvme_path" in ours and ours["nvme_path"] != value:
                ignored.append(f"{dotted} (one nvme_path is used: {ours['nvme_path']!r})")
                continue
            setting, convert = "nvme_path", str
        elif dotted == "zero_optimization.stage":
            stage = _ds_read(dotted, value, deepspeed_int, ignored)
            if stage is not _AUTO and stage != 3:
                ignored.append(f"{dotted}={value} (tierstore offloads ZeRO-3-style sharded state)")
            continue
        elif dotted in keys:
            setting, convert = keys[dotted]
        else:
            ignored.append(dotted)
            continue
        got = _ds_read(dotted, value, convert, ignored)
        if got is not _AUTO:
            ours[setting] = got
    return ours, ignored


def from_deepspeed(ds: Mapping[str, Any]) -> tuple[StoreConfig, list[str]]:
    """Map a DeepSpeed config (dict) onto the store's config.

    Returns the config and the dotted names of the keys that the store does
    not honour; those are also reported in one warning, never dropped silently
    (``tierstore.integrations.load_settings`` reads the keys of offload_model
    and OffloadedAdamW too). See :func:`read_deepspeed`.
    """
    values, ignored = read_deepspeed(ds)
    if ignored:
        warnings.warn("tierstore does not honour these DeepSpeed config keys: " + ", ".join(ignored), stacklevel=2)
    return from_dict(values), ignored


def user_cache_path(name: str) -> str:
    """``name`` in the user's cache directory: $XDG_CACHE_HOME, else ~/.cache (not created)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), name)


def default_nvme_path() -> str:
    """Where the command-line tools put swap files unless told: $TIERSTORE_NVME_PATH, else a cache directory of
    the user's ($XDG_CACHE_HOME/tierstore or ~/.cache/tierstore, created), never the current directory, which may
    be a source checkout."""
    path = os.environ.get("TIERSTORE_NVME_PATH") or user_cache_path("tierstore")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path
