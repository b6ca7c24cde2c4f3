"""Types of ``tern.mooncake``, the drop-in for ``mooncake.engine``."""

from enum import IntEnum

from ._tern import MooncakeEngine

SUPPORT_CUDA: bool
SUPPORT_HIP: bool
SUPPORT_MUSA: bool
SUPPORT_EFA: bool
SUPPORT_MNNVL: bool
SUPPORT_INTRA_NVLINK: bool

class TransferOpcode(IntEnum):
    Read = 0
    Write = 1

Read: TransferOpcode
Write: TransferOpcode

class TransferNotify:
    name: str
    msg: str
    def __init__(self, name: str = "", msg: str = "") -> None: ...

class TransferEngine(MooncakeEngine):
    TransferOpcode: type[TransferOpcode]
    def get_notifies(self) -> list[TransferNotify]: ...  # type: ignore[override]
    def get_local_topology(self, device_name: str | None = None) -> str: ...
    def get_engine(self) -> object: ...
    def get_engine_ptr(self) -> int: ...
