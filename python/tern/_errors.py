"""Tern's exceptions: one class per way an engine call or a transfer can fail.

Every exception is a :class:`TransferError`; those that are also a built-in kind of error
derive from it too (``InvalidArgument`` is a ``ValueError``, ``TransferTimeout`` a
``TimeoutError``, ``ConnectionFailed`` a ``ConnectionError``). ``code`` is Mooncake's
numeric error code for the failure; ``task`` is the index of the failed task in its batch,
when a task failed.
"""

from __future__ import annotations

__all__ = [
    "TransferError",
    "InvalidArgument",
    "TooManyRequests",
    "AddressNotRegistered",
    "BatchBusy",
    "AddressOverlapped",
    "RegionInUse",
    "BatchFreed",
    "UnknownSegment",
    "MetadataError",
    "TransportFailed",
    "ConnectionFailed",
    "TransferTimeout",
    "RemoteRejected",
    "SegmentVanished",
    "TargetOutOfRange",
    "NoCommonTransport",
    "ProtocolError",
    "Canceled",
    "Dropped",
    "MemoryMoved",
]


class TransferError(Exception):
    """A Tern engine call or transfer failed; the message says why."""

    code: int = -1

    def __init__(self, message: str, *, task: int | None = None) -> None:
        super().__init__(message)
        self.task = task


class InvalidArgument(TransferError, ValueError):
    """An argument was invalid (zero length, closed engine, unknown protocol, ...)."""

    code = -1


class TooManyRequests(TransferError):
    """More requests than the batch has room for."""

    code = -2


class AddressNotRegistered(TransferError, ValueError):
    """The local memory is not inside one registered region."""

    code = -3


class BatchBusy(TransferError):
    """The batch still has tasks in flight."""

    code = -4


class AddressOverlapped(TransferError, ValueError):
    """The memory overlaps a region that is already registered."""

    code = -7


class RegionInUse(TransferError):
    """The region is used by transfers in flight; wait for them first."""

    code = -1


class BatchFreed(TransferError):
    """The batch was freed."""

    code = -1


class UnknownSegment(TransferError):
    """The segment is not open, or no node publishes it."""

    code = -200


class MetadataError(TransferError):
    """The metadata store (etcd, HTTP) failed or holds something malformed."""

    code = -200


class TransportFailed(TransferError):
    """A transport could not start, or could not register memory."""

    code = -201


class ConnectionFailed(TransferError, ConnectionError):
    """The peer could not be reached, or the connection broke mid-transfer."""

    code = -102


class TransferTimeout(TransferError, TimeoutError):
    """The batch's deadline passed before the transfer finished."""

    code = -1


class RemoteRejected(TransferError):
    """The peer refused the range (not registered, or not remote-accessible there)."""

    code = -1


class SegmentVanished(TransferError):
    """The peer withdrew its segment (shut down, or its lease expired)."""

    code = -200


class TargetOutOfRange(TransferError, ValueError):
    """The remote range is not inside one buffer the peer published."""

    code = -1


class NoCommonTransport(TransferError):
    """No installed transport speaks the peer's protocols."""

    code = -1


class ProtocolError(TransferError):
    """The peer spoke the data protocol wrongly."""

    code = -1


class Canceled(TransferError):
    """The transfer was canceled."""

    code = -1


class Dropped(TransferError):
    """A transport dropped the work without finishing it (it was shutting down)."""

    code = -1


class MemoryMoved(TransferError):
    """Registered memory moved while it was registered (a tensor's storage reallocated by
    ``resize_``); the region is unregistered all the same."""

    code = -1
