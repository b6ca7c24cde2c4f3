"""Tern: move bytes between registered memory on different machines, over TCP and RDMA.

``tern.TransferEngine`` is the Pythonic API (keyword arguments, exceptions, registration of
anything with memory, batches, asyncio); ``tern.mooncake.TransferEngine`` is a drop-in for
Mooncake's ``mooncake.engine.TransferEngine``. Both speak Mooncake's metadata and wire
formats, so Tern and Mooncake nodes share a cluster.
"""

from __future__ import annotations

try:
    from . import _tern
except ImportError as error:  # the extension or a library it links is missing
    _text = str(error)
    if "libibverbs" in _text or "librdmacm" in _text:
        raise ImportError(
            f"tern cannot load the RDMA verbs library ({_text}). Install rdma-core's "
            "libibverbs (Debian/Ubuntu: apt-get install libibverbs1 ibverbs-providers; "
            "Fedora/RHEL: dnf install libibverbs), or use the TCP-only wheel "
            "(cargo xtask wheel --tcp-only), which does not need it."
        ) from error
    raise

from ._engine import (
    Batch,
    BatchStatus,
    Buffer,
    Region,
    Request,
    Segment,
    TaskStatus,
    TransferEngine,
    read,
    write,
)
from ._errors import *  # noqa: F403
from ._errors import __all__ as _errors_all

__version__: str = _tern.__version__
#: Whether this wheel carries the RDMA transport (False for ``--tcp-only`` wheels).
RDMA_BUILT: bool = _tern.RDMA_BUILT

__all__ = [
    "TransferEngine",
    "Batch",
    "BatchStatus",
    "Buffer",
    "Region",
    "Request",
    "Segment",
    "TaskStatus",
    "read",
    "write",
    "RDMA_BUILT",
    *_errors_all,
]
