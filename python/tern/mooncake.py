"""``tern.mooncake``: a drop-in for ``mooncake.engine``.

``from tern.mooncake import TransferEngine`` in place of ``from mooncake.engine import
TransferEngine``: the same methods, positional arguments, defaults and return codes, and the
same metadata, naming and port rules (``P2PHANDSHAKE`` names the segment ``host:<rpc port>``
with the port from ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT``; protocol ``"rdma"`` runs over TCP
where no RDMA device opens; ``MC_FORCE_TCP``, ``MC_FORCE_HCA`` and ``MC_TRANSFER_TIMEOUT`` are
honoured). One protocol more than Mooncake: ``"shm"`` moves bytes to peers on this host
through shared memory (mappings of ``allocate_managed_buffer`` memory, cross-memory attach
for the rest) and to every other peer over TCP. Where Mooncake crashes on bad input (a call before ``initialize``, an unknown
batch id, lists of different lengths, ``None`` for a string, an address outside registered
memory), this returns the method's failure code and logs one line with the reason on the
``tern`` logger. Calls that register, move bytes or wait release the GIL, and waits sleep.

Integer addresses given to ``register_memory`` and ``batch_register_memory`` are the
caller's promise, as with Mooncake: the memory must stay valid until it is unregistered
(or the engine is gone), since peers read and write it at any time.
"""

from __future__ import annotations

from enum import IntEnum

from . import _tern

__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify", "Read", "Write"]

# Compile-time features of Mooncake builds. CUDA is a run-time matter in Tern (``SUPPORT_CUDA``
# is true when a CUDA driver loads, asked on first access); none of the others is in Tern.
SUPPORT_HIP = False
SUPPORT_MUSA = False
SUPPORT_EFA = False
SUPPORT_MNNVL = False
SUPPORT_INTRA_NVLINK = False


def __getattr__(name: str) -> object:
    if name == "SUPPORT_CUDA":
        return _tern.cuda_driver() is not None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class TransferOpcode(IntEnum):
    """Direction of a transfer, as Mooncake numbers it."""

    Read = 0
    Write = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A notification sent with a transfer: ``name`` and ``msg``."""

    __slots__ = ("name", "msg")

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TransferNotify) and (self.name, self.msg) == (other.name, other.msg)

    def __hash__(self) -> int:
        return hash((self.name, self.msg))

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


class TransferEngine(_tern.MooncakeEngine):
    """Mooncake's ``TransferEngine`` on Tern (see the module documentation)."""

    TransferOpcode = TransferOpcode

    def get_notifies(self) -> list[TransferNotify]:
        """Takes the notifications received so far."""
        return [TransferNotify(name, msg) for name, msg in super().get_notifies()]

    def get_local_topology(self, device_name: str | None = None) -> str:
        """The local NIC priority matrix as Mooncake's JSON (``{}`` without RDMA devices)."""
        return _tern.local_topology(device_name)

    def get_engine(self):
        raise NotImplementedError(
            "get_engine() returns Mooncake's own C++ engine object (for Mooncake Store and "
            "Mooncake's process group); Tern has no such object"
        )

    def get_engine_ptr(self) -> int:
        raise NotImplementedError("get_engine_ptr(): Tern has no Mooncake C++ engine to point at")
