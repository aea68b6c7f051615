"""tierstore: train models whose weights and optimizer state overflow the GPU and RAM.

Tensors live in a device -> host -> NVMe hierarchy under byte budgets; an I/O
engine moves them at the drive's speed and a trace-based scheduler reads them
ahead of use.
"""

from ._config import (
    STORE_DEEPSPEED_KEYS,
    DeepSpeedKeys,
    StoreConfig,
    check_settings,
    deepspeed_int,
    default_nvme_path,
    from_deepspeed,
    from_dict,
    load_config,
    parse_bytes,
    read_config_file,
    read_deepspeed,
)
from ._nvme import Syscalls
from ._store import Handle, TierStore, open_store
from ._timeline import Timeline
from ._versions import KeptVersions
from ._types import (
    CheckpointError,
    CheckpointIntegrityError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    FencedWriteError,
    IntegrityError,
    TierValueError,
    TierTypeError,
    StoreClosedError,
    StoreFullError,
    StoreInUseError,
    StoreUser,
    Tier,
    TierBudgetError,
    RoomYieldedError,
    TierIOError,
    TierOSError,
    TierStoreError,
    TierKeyError,
    UnknownSettingError,
    UnsupportedError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CheckpointIntegrityError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "FencedWriteError",
    "Handle",
    "IntegrityError",
    "KeptVersions",
    "DeepSpeedKeys",
    "STORE_DEEPSPEED_KEYS",
    "TierValueError",
    "TierTypeError",
    "StoreClosedError",
    "StoreConfig",
    "StoreFullError",
    "StoreInUseError",
    "StoreUser",
    "Syscalls",
    "Tier",
    "TierBudgetError",
    "RoomYieldedError",
    "TierIOError",
    "TierStore",
    "TierOSError",
    "TierStoreError",
    "TierKeyError",
    "UnknownSettingError",
    "UnsupportedError",
    "Timeline",
    "check_settings",
    "deepspeed_int",
    "default_nvme_path",
    "from_deepspeed",
    "from_dict",
    "load_config",
    "open_store",
    "parse_bytes",
    "read_config_file",
    "read_deepspeed",
]
