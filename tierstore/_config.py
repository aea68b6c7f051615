"""Configuration: one frozen dataclass, loaded from keywords, JSON, TOML or a DeepSpeed file."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.metadata
import json
import os
import re
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._types import Tier, TierTypeError, TierValueError, UnknownSettingError

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
    """What the store and its I/O engine are tuned by; the settings of the layers above ride along, unread, in
    ``layer_settings``."""

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
    """Size of each preallocated swap file that tensors are packed into (a larger tensor gets a file of its size)."""
    direct_io: bool = True
    """Use O_DIRECT; where the filesystem refuses it (tmpfs), fall back to buffered I/O with a warning."""
    verify_checksums: bool = False
    """Checksum every block written to the NVMe tier and verify it on read."""
    pin_host_memory: bool = True
    """Pin host-tier buffers when CUDA is available (ignored without CUDA)."""
    layer_settings: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    """Settings of the layers above the core (offload_model's prefetch depth, OffloadedAdamW's moments, ...), by
    name. The core reads none of them: it carries them so that one config file, one DeepSpeed config or one
    ``TierStore(**settings)`` sets up the whole stack, and checks each when given by the rule of the layer that
    declared it (see :func:`register_layer_settings`). Given flat (``StoreConfig(prefetch_depth=4)``,
    ``prefetch_depth = 4`` in a file), they land here."""

    malloc_mmap_threshold_bytes: int | None = 128 * 1024
    """Fix the C allocator's mmap threshold at this size when a store is created, so that memory freed by tensors
    goes back to the system and RSS does not grow with the model (glibc only; a setting of the whole process; see
    [Note: Giving freed memory back]). None leaves the allocator alone."""

    def __post_init__(self) -> None:
        for name in ("device_budget_bytes", "host_budget_bytes", "nvme_budget_bytes",
                     "block_size_bytes", "file_size_bytes", "malloc_mmap_threshold_bytes"):
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
        for name in ("queue_depth", "io_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TierValueError(f"{name}={value!r} must be an integer >= 1")
        for name in ("direct_io", "verify_checksums", "pin_host_memory"):
            if not isinstance(getattr(self, name), bool):
                raise TierTypeError(f"{name} must be true or false, not {getattr(self, name)!r}")
        object.__setattr__(self, "layer_settings", _checked_layer_settings(self.layer_settings))
        if self.nvme_path is not None:
            object.__setattr__(self, "nvme_path", os.fspath(self.nvme_path))

    def replace(self, **changes: Any) -> StoreConfig:
        """A copy with some fields changed (validated like any other)."""
        return from_dict({**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        """Every setting by name, flat (the layers' settings beside the core's, as a config file writes them);
        tiers as their labels."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "layer_settings"}
        out.update(self.layer_settings)
        return {k: v.label if isinstance(v, Tier) else v for k, v in out.items()}

    def __getattr__(self, name: str) -> Any:
        # A layer's setting read as an attribute, as StoreConfig had them before layer_settings: its value, or
        # its layer's default.
        if name.startswith("_") or name not in (known := declared_layer_settings()):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(f"config.{name} is a setting of {known[name].owner}: read config.layer_settings or the "
                      f"layer's policy", DeprecationWarning, stacklevel=2)
        return self.__dict__["layer_settings"].get(name, known[name].default)


_CORE_FIELDS = frozenset(f.name for f in dataclasses.fields(StoreConfig)) - {"layer_settings"}
_store_config_init = StoreConfig.__init__


@functools.wraps(_store_config_init)
def _init_flat(self: StoreConfig, **settings: Any) -> None:
    # A layer's setting may be given flat, beside the core's: it is kept in layer_settings.
    above = {k: settings.pop(k) for k in list(settings) if k not in _CORE_FIELDS and k != "layer_settings"}
    if above:
        settings["layer_settings"] = {**settings.get("layer_settings", {}), **above}
    _store_config_init(self, **settings)


StoreConfig.__init__ = _init_flat  # type: ignore[method-assign]


@dataclasses.dataclass(frozen=True)
class LayerSetting:
    """A setting of a layer above the core, as that layer declared it."""

    owner: str
    """Who reads it, as a message names it (the integrations name the policy field: ``"ParamOffloadPolicy.home"``
    for ``param_tier``)."""
    default: Any
    """Its value when not given."""
    check: Callable[[Any], Any]
    """The value given, normalized (``"host"`` -> ``Tier.HOST``); raises a TierValueError/TierTypeError naming
    the setting for a bad one."""


_LAYER_SETTINGS: dict[str, LayerSetting] = {}
LAYER_SETTINGS_ENTRY_POINTS = "tierstore.layer_settings"
"""The entry-point group under which packages name the modules that declare their settings on import (see
[Note: Settings of the layers above])."""
_discovered = False


def register_layer_settings(owner: str, settings: Mapping[str, tuple[Any, Callable[[Any], Any]]]) -> None:
    """Declare settings that a layer above the core reads: name -> (default, check). From then on StoreConfig,
    config files and ``TierStore(**settings)`` accept them and keep them in ``StoreConfig.layer_settings``.

    [Note: Settings of the layers above] One config file sets up the whole stack
    (the store's budgets beside offload_model's prefetch depth and
    OffloadedAdamW's moments), yet the core reads only its own settings. A
    layer declares its own, with their defaults and checks; the core carries
    them unread. So that ``TierStore(prefetch_depth=4)`` works before the layer
    was imported, a name the core does not know first loads the modules named
    in the entry-point group ``tierstore.layer_settings`` (the integrations
    name ``tierstore.integrations.policies`` there), which declare theirs on
    import: the core never imports a layer above it by name.
    """
    for name, (default, check) in settings.items():
        if name in _CORE_FIELDS:
            raise TierValueError(f"{owner} cannot declare setting {name!r}: the store reads a setting of that name")
        _LAYER_SETTINGS[name] = LayerSetting(owner, default, check)


def declared_layer_settings() -> Mapping[str, LayerSetting]:
    """Every setting declared by a layer above, once the installed layers have declared theirs."""
    global _discovered
    if not _discovered:
        _discovered = True
        for ep in importlib.metadata.entry_points(group=LAYER_SETTINGS_ENTRY_POINTS):
            ep.load()  # importing it declares its settings
    return types.MappingProxyType(_LAYER_SETTINGS)


def _checked_layer_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(values, Mapping):
        raise TierTypeError(f"layer_settings must be a mapping of setting names to values, not {values!r}")
    if not values:  # nothing to check: the layers above are not looked for
        return {}
    check_settings(values, "the config")
    known = declared_layer_settings()
    return {name: known[name].check(value) for name, value in values.items()}


def check_settings(names: Iterable[str], what: str) -> None:
    """Raise :class:`UnknownSettingError` for any of ``names`` that neither StoreConfig nor a layer above (see
    :func:`register_layer_settings`) knows, naming the closest one of each and listing them all."""
    unknown = sorted(set(names) - _CORE_FIELDS - {"layer_settings"})
    if unknown:
        valid = _CORE_FIELDS | set(declared_layer_settings())
        unknown = sorted(set(unknown) - valid)
    if unknown:
        hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, valid, 1)) else repr(k)
                 for k in unknown]
        raise UnknownSettingError(f"{what} has unknown setting(s) {', '.join(hints)}; the settings are: "
                                  f"{', '.join(sorted(valid))}")


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
            import tomli as tomllib
        except ImportError:
            raise TierValueError(f"reading {path!r} needs a TOML reader: Python 3.11+, or `pip install tomli` on "
                                 "Python 3.10 (or use a .json config)") from None
    return tomllib


def load_config(path: str | os.PathLike[str], **overrides: Any) -> StoreConfig:
    """Load a config from a .json or .toml file; keywords override the file.

    A JSON file with a ``zero_optimization`` or ``aio`` section is read as a
    DeepSpeed config (see :func:`from_deepspeed`).
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise TierValueError(f"cannot read config file {path!r}: {e.strerror}") from e
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
        if isinstance(values, dict) and ("zero_optimization" in values or "aio" in values):
            config, _ = from_deepspeed(values)
            return config.replace(**overrides) if overrides else config
    else:
        raise TierValueError(f"config file {path!r} must end in .json or .toml")
    if not isinstance(values, dict):
        raise TierValueError(f"config file {path!r} must hold a table/object of keys")
    return from_dict({**values, **overrides})


# DeepSpeed key -> (our key, converter). Keys absent here are reported as not honoured.
def _ds_tier(value: Any) -> Tier:
    v = str(value).lower()
    if v == "nvme":
        return Tier.NVME
    if v == "cpu":
        return Tier.HOST
    if v == "none":
        return Tier.DEVICE
    raise TierValueError(f"DeepSpeed offload device {value!r} must be 'nvme', 'cpu' or 'none'")


def check_prefetch_depth(depth: object) -> None:
    """``depth`` is "auto" or an integer >= 0, else a ValueError that says so."""
    if depth != "auto" and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise TierValueError(f"prefetch_depth={depth!r} must be \"auto\" or an integer >= 0 (0 turns prefetch off)")


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


def _ds_int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise TierValueError("not an integer")
    return int(value)


def from_deepspeed(ds: Mapping[str, Any]) -> tuple[StoreConfig, list[str]]:
    """Map a DeepSpeed config (dict) onto a StoreConfig.

    Returns the config and the dotted names of the keys that tierstore does not
    honour; those are also reported in one warning, never dropped silently.
    ``"auto"`` values (transformers' DeepSpeed integration writes them) keep
    tierstore's default and are listed with the keys not honoured; a value that
    cannot be read is a ValueError naming its key.
    """
    ours: dict[str, Any] = {}
    ignored: list[str] = []

    def put(ours_key: str, dotted: str, value: Any, convert: Callable[[Any], Any]) -> None:
        got = _ds_read(dotted, value, convert, ignored)
        if got is not _AUTO:
            ours[ours_key] = got

    zero = ds.get("zero_optimization", {}) or {}
    for section, tier_key in (("offload_param", "param_tier"), ("offload_optimizer", "optimizer_tier")):
        sec = zero.get(section) or {}
        for key, value in sec.items():
            dotted = f"zero_optimization.{section}.{key}"
            if key == "device":
                put(tier_key, dotted, value, _ds_tier)
            elif key == "nvme_path":
                if "nvme_path" in ours and ours["nvme_path"] != value:
                    ignored.append(f"{dotted} (one nvme_path is used: {ours['nvme_path']!r})")
                else:
                    put("nvme_path", dotted, value, str)
            elif key == "pin_memory":
                put("pin_host_memory", dotted, value, bool)
            elif key == "buffer_count" and section == "offload_param":
                # DeepSpeed's swap buffers bound how far ahead parameters are read.
                put("prefetch_depth", dotted, value, lambda v: max(_ds_int(v) - 1, 0))
            elif key == "max_in_cpu" and section == "offload_param":
                put("host_budget_bytes", dotted, value, lambda v: _ds_int(v) * 2)  # elements of fp16/bf16
            else:
                ignored.append(dotted)
    for key, value in zero.items():
        if key in ("offload_param", "offload_optimizer"):
            continue
        dotted = f"zero_optimization.{key}"
        if key == "stage":
            stage = _ds_read(dotted, value, _ds_int, ignored)
            if stage is not _AUTO and stage != 3:
                ignored.append(f"{dotted}={value} (tierstore offloads ZeRO-3-style sharded state)")
        elif key == "stage3_param_persistence_threshold":
            put("resident_threshold_bytes", dotted, value, lambda v: _ds_int(v) * 2)  # elements of fp16/bf16
        else:
            ignored.append(dotted)
    aio_map = {"block_size": "block_size_bytes", "queue_depth": "queue_depth", "thread_count": "io_threads",
               "intra_op_parallelism": "io_threads"}
    for key, value in (ds.get("aio") or {}).items():
        if key in aio_map:
            put(aio_map[key], f"aio.{key}", value, _ds_int)
        else:
            ignored.append(f"aio.{key}")
    for key in ds:
        if key not in ("zero_optimization", "aio"):
            ignored.append(key)
    if ignored:
        warnings.warn(
            "tierstore does not honour these DeepSpeed config keys: " + ", ".join(ignored),
            stacklevel=2,
        )
    return from_dict(ours), ignored


def default_grad_backlog_bytes(host_budget_bytes: int) -> int:
    """OffloadedAdamW's default ``max_grad_backlog_bytes``: a quarter of the host budget (at least a byte)."""
    return max(1, host_budget_bytes // 4)


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
