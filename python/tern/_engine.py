"""The Pythonic engine: keyword arguments, exceptions, registration of anything with memory,
owned buffers as ``memoryview``, batches, and asyncio."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import weakref
from typing import Any, Iterable, NamedTuple, Sequence, Union

from . import _tern
from ._errors import InvalidArgument, MemoryMoved, TransferError
from ._memory import Hold, device_location, locate, view_of

__all__ = [
    "TransferEngine",
    "Buffer",
    "Region",
    "Segment",
    "Batch",
    "BatchStatus",
    "TaskStatus",
    "Request",
    "read",
    "write",
]


class Request(NamedTuple):
    """One transfer: ``write`` (local → remote) or read, ``local`` memory (an address, a
    :class:`Buffer`, a :class:`Region` or a registered object), the ``segment`` (a
    :class:`Segment` or its name), the remote address, the byte count (``None``: all of
    ``local`` from ``local_offset`` on) and an offset into ``local``."""

    write: bool
    local: Any
    segment: Any
    remote_addr: int
    nbytes: int | None = None
    local_offset: int = 0


def read(local: Any, segment: Any, remote_addr: int, nbytes: int | None = None, *, local_offset: int = 0) -> Request:
    """A request that reads ``nbytes`` at ``remote_addr`` of ``segment`` into ``local``."""
    return Request(False, local, segment, remote_addr, nbytes, local_offset)


def write(local: Any, segment: Any, remote_addr: int, nbytes: int | None = None, *, local_offset: int = 0) -> Request:
    """A request that writes ``nbytes`` of ``local`` to ``remote_addr`` of ``segment``."""
    return Request(True, local, segment, remote_addr, nbytes, local_offset)


class Segment:
    """An open segment of another node (or of this one)."""

    __slots__ = ("_engine", "name")

    def __init__(self, engine: "TransferEngine", name: str) -> None:
        self._engine = engine
        self.name = name

    @property
    def id(self) -> int:
        """The engine's id for it (opened again after a failure made the engine forget it)."""
        return self._engine._core.open_segment(self.name)

    @property
    def buffers(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of every buffer the segment publishes, as last fetched."""
        return self._engine._core.segment_info(self.id)[1]

    def refresh(self) -> None:
        """Fetches the segment's descriptor again."""
        self._engine._core.refresh_segment(self.id)

    def __repr__(self) -> str:
        return f"Segment({self.name!r})"


class Region:
    """Memory registered from a Python object; the object (a tensor's storage) is kept alive
    until unregistered."""

    __slots__ = ("addr", "nbytes", "location", "obj", "_hold", "__weakref__")

    def __init__(self, addr: int, nbytes: int, location: str, obj: Any, hold: Hold | None = None) -> None:
        self.addr = addr
        self.nbytes = nbytes
        self.location = location
        self.obj = obj
        self._hold = hold

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"Region(addr={self.addr:#x}, nbytes={self.nbytes}, location={self.location!r})"


class Buffer:
    """Memory the engine owns and has registered. ``view()`` (and ``memoryview(buffer)`` on
    Python 3.12+) gives a zero-copy writable ``memoryview``; the memory lives while the
    buffer or any view of it does."""

    __slots__ = ("_memory", "addr", "nbytes", "__weakref__")

    def __init__(self, memory: Any) -> None:
        self._memory = memory
        self.addr = memory.addr
        self.nbytes = memory.nbytes

    def view(self) -> memoryview:
        """A writable byte ``memoryview`` of the whole buffer (no copy)."""
        return view_of(self, self.addr, self.nbytes)

    def __buffer__(self, flags: int) -> memoryview:
        return self.view()

    def read(self, offset: int = 0, nbytes: int | None = None) -> bytes:
        """A copy of ``nbytes`` at ``offset``."""
        if nbytes is None:
            nbytes = self.nbytes - offset
        return self._memory.read(offset, nbytes)

    def write(self, data: bytes, offset: int = 0) -> None:
        """Copies ``data`` in at ``offset``."""
        self._memory.write(offset, bytes(data))

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"Buffer(addr={self.addr:#x}, nbytes={self.nbytes})"


class TaskStatus(NamedTuple):
    """One task: ``state`` (``pending``, ``completed``, ``failed``, ``timeout``, ``canceled``),
    bytes moved, and the exception of a task that did not complete."""

    state: str
    transferred_bytes: int
    error: TransferError | None


class BatchStatus(NamedTuple):
    """A batch's tasks counted by how they stand."""

    state: str
    submitted: int
    completed: int
    failed: int
    pending: int
    transferred_bytes: int


class Batch:
    """Submitted transfers: ``wait(timeout)``, ``status``, ``task(i)``, ``cancel()``, and
    ``await batch`` (or ``await batch.wait_async()``) in asyncio."""

    __slots__ = ("_inner", "_engine")

    def __init__(self, engine: "TransferEngine", inner: Any) -> None:
        self._engine = engine
        self._inner = inner

    def wait(self, timeout: float | None = None) -> bool:
        """Sleeps until every task has ended or ``timeout`` seconds pass (``None``: until the
        batch's deadline). True when all completed, False while some still run; raises the
        first failed task's exception."""
        return self._inner.wait(timeout)

    @property
    def done(self) -> bool:
        """Whether every task has ended."""
        return self._inner.done

    @property
    def status(self) -> BatchStatus:
        return BatchStatus(*self._inner.status())

    def task(self, index: int) -> TaskStatus:
        return TaskStatus(*self._inner.task(index))

    @property
    def tasks(self) -> list[TaskStatus]:
        return [self.task(i) for i in range(len(self))]

    def cancel(self) -> int:
        """Cancels every unfinished task; returns how many."""
        return self._inner.cancel()

    async def wait_async(self) -> bool:
        """Waits in asyncio without blocking the loop or polling: the last task's completion
        rings a socket the loop watches. True on completion; raises on failure; canceling
        the awaiting task cancels the batch."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        _loop_waker(loop).watch(self._inner, future, self._engine._core.transfer_timeout)
        try:
            return await future
        except asyncio.CancelledError:
            self.cancel()
            raise

    def __await__(self):
        return self.wait_async().__await__()

    def __len__(self) -> int:
        return len(self._inner)

    def __repr__(self) -> str:
        return f"Batch({self.status})"


class _LoopWaker:
    """One per event loop: the socket batches ring, and the futures waiting on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waker = _tern.Waker()
        self._pending: list[tuple[Any, asyncio.Future]] = []
        loop.add_reader(self._waker.fileno(), self._ready)

    def watch(self, inner: Any, future: asyncio.Future, deadline: float | None) -> None:
        self._pending.append((inner, future))
        inner.notify_on_complete(self._waker)
        if deadline is not None:
            # A deadline fires when someone looks: look once it has passed.
            self._loop.call_later(deadline + 0.05, self._ready)

    def _ready(self) -> None:
        self._waker.drain()
        still = []
        for inner, future in self._pending:
            if future.done():
                continue
            if not inner.done:
                still.append((inner, future))
                continue
            try:
                future.set_result(inner.result())
            except TransferError as error:
                future.set_exception(error)
        self._pending = still


_LOOP_WAKERS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker]" = weakref.WeakKeyDictionary()


def _loop_waker(loop: asyncio.AbstractEventLoop) -> _LoopWaker:
    waker = _LOOP_WAKERS.get(loop)
    if waker is None:
        waker = _LOOP_WAKERS[loop] = _LoopWaker(loop)
    return waker


def _finish(batch: Batch, timeout: float | None) -> None:
    """Waits for ``batch``; past ``timeout`` it is canceled and ``TransferTimeout`` raised."""
    if not batch.wait(timeout):
        batch.cancel()
        from ._errors import TransferTimeout

        raise TransferTimeout(f"the transfer did not finish within {timeout} s")


Local = Union[int, Buffer, Region, Any]
SegmentLike = Union[Segment, str]


class TransferEngine:
    """A Tern engine.

    ``local_server_name``: the name peers open this node by (P2P mode: its address; the
    segment becomes ``ip:rpc_port``). ``metadata``: ``"P2PHANDSHAKE"`` (default),
    ``"etcd://host:port"``, ``"http://host:port/metadata"``. ``protocols``: ``["tcp"]``,
    ``["rdma"]``, both, or ``None`` for RDMA where a device opens and TCP elsewhere; put
    ``"shm"`` first (``["shm", "tcp"]``) and peers on this host are reached through shared
    memory, the rest by the transports after it.
    ``devices``: RDMA devices (empty: every device with an active port). ``cluster_secret``:
    peers must prove they know it. ``transfer_timeout``: seconds a batch may take (default
    ``MC_TRANSFER_TIMEOUT``, else 30). Use it as a context manager, or call ``close()``.
    """

    def __init__(
        self,
        local_server_name: str | None = None,
        metadata: str = "P2PHANDSHAKE",
        protocols: Sequence[str] | str | None = None,
        devices: Sequence[str] | str = (),
        cluster_secret: str | None = None,
        transfer_timeout: float | None = None,
    ) -> None:
        if isinstance(protocols, str):
            protocols = [protocols]
        if isinstance(devices, str):
            devices = [d for d in devices.replace(",", " ").split() if d]
        self._core = _tern.Engine(
            local_server_name,
            metadata,
            list(protocols) if protocols is not None else ["auto"],
            list(devices),
            cluster_secret,
            transfer_timeout,
        )
        self._lock = threading.Lock()
        self._regions: dict[int, Region] = {}

    # -- identity -----------------------------------------------------------------------

    @property
    def segment_name(self) -> str:
        """The name peers open this engine by (``ip:port`` in P2P mode)."""
        return self._core.segment_name

    @property
    def rpc_port(self) -> int:
        return self._core.rpc_port

    @property
    def protocols(self) -> list[str]:
        """The transports that run (``tcp``, ``rdma``)."""
        return self._core.protocols

    # -- memory -------------------------------------------------------------------------

    def register(self, obj: Any, *, location: str = "*", remote_accessible: bool = True) -> Region:
        """Registers the memory of ``obj`` (buffer protocol, ``__array_interface__``, or a
        CPU or CUDA tensor's ``data_ptr()``/``nbytes``); its memory is kept allocated until
        unregistered (a buffer export, the tensor's storage, the object). A CUDA tensor is
        registered as ``cuda:<index>`` device memory, which moves only by driver copies.

        Do not move registered memory (a tensor's growing ``resize_``): nothing outside
        torch can forbid it, and peers would write freed memory. :meth:`unregister` detects
        it and raises :class:`MemoryMoved`."""
        addr, nbytes, hold = locate(obj)
        if location == "*":
            location = device_location(obj) or location
        self._core.register_held(addr, nbytes, location, remote_accessible, hold)
        region = Region(addr, nbytes, location, obj, hold)
        with self._lock:
            self._regions[addr] = region
        return region

    def unregister(self, target: Any) -> None:
        """Unregisters a :class:`Region`, a registered object, or the region at an address.

        A region whose memory moved while registered (a tensor's storage reallocated by
        ``resize_``, an ``__array_interface__`` pointing elsewhere) is unregistered all the
        same, by the address it was registered at, and then :class:`MemoryMoved` is raised:
        peers may have written the memory after it was freed."""
        if isinstance(target, Region):
            addr = target.addr
        elif isinstance(target, int):
            addr = target
        else:
            with self._lock:
                # The object registered, found by identity: its memory may be elsewhere now.
                addr = next((a for a, r in self._regions.items() if r.obj is target), None)
            if addr is None:
                addr = locate(target)[0]
        with self._lock:
            region = self._regions.get(addr)
        moved = region._hold.moved() if region is not None and region._hold is not None else None
        self._core.unregister(addr)
        with self._lock:
            self._regions.pop(addr, None)
        if region is not None:
            region._hold = None  # the buffer export goes with the registration
        if moved is not None:
            raise MemoryMoved(
                f"the region at {addr:#x} ({region.nbytes} bytes) is unregistered, but {moved} "
                "while it was registered: peers may have written freed memory"
            )

    def allocate(self, nbytes: int, *, location: str = "*") -> Buffer:
        """Allocates ``nbytes`` owned by the engine, registered for peers."""
        if nbytes <= 0:
            raise InvalidArgument(f"cannot allocate {nbytes} bytes")
        return Buffer(self._core.allocate(nbytes, location))

    @property
    def regions(self) -> list[tuple[int, int, str, bool]]:
        """``(address, nbytes, location, remote_accessible)`` of every registered region."""
        return self._core.regions()

    # -- segments -----------------------------------------------------------------------

    def segment(self, name: str) -> Segment:
        """Opens (once) the segment peers know as ``name``."""
        if not isinstance(name, str):
            raise TypeError(f"segment name must be a str, not {type(name).__name__}")
        self._core.open_segment(name)
        return Segment(self, name)

    def _segment_id(self, segment: SegmentLike) -> int:
        if isinstance(segment, Segment):
            return self._core.open_segment(segment.name)
        if not isinstance(segment, str):
            raise TypeError(f"segment must be a Segment or a str, not {type(segment).__name__}")
        return self._core.open_segment(segment)

    # -- transfers ----------------------------------------------------------------------

    def _local(self, local: Local, offset: int, nbytes: int | None) -> tuple[int, int]:
        if isinstance(local, bool):
            raise TypeError("local memory must be an address, a Buffer, a Region or an object with memory")
        if isinstance(local, int):
            if nbytes is None:
                raise InvalidArgument("nbytes is required with a raw address")
            return local + offset, nbytes
        if isinstance(local, (Buffer, Region)):
            addr, size = local.addr, local.nbytes
        else:
            addr, size, _ = locate(local)
        if offset < 0 or offset > size:
            raise InvalidArgument(f"local_offset {offset} is outside {size} bytes")
        if nbytes is None:
            nbytes = size - offset
        return addr + offset, nbytes

    def _requests(self, requests: Iterable[Request]) -> list[tuple[bool, int, int, int, int]]:
        out = []
        for request in requests:
            if not isinstance(request, Request):
                request = Request(*request)
            addr, nbytes = self._local(request.local, request.local_offset, request.nbytes)
            out.append(
                (bool(request.write), addr, self._segment_id(request.segment), int(request.remote_addr), int(nbytes))
            )
        return out

    def submit(self, requests: Iterable[Request]) -> Batch:
        """Submits requests (``tern.read(...)``, ``tern.write(...)``) as one batch."""
        return Batch(self, self._core.submit(self._requests(requests)))

    def transfer(self, requests: Iterable[Request], timeout: float | None = None) -> None:
        """Submits and waits; raises the first failure. ``timeout``: seconds (default: the
        batch's deadline)."""
        _finish(self.submit(requests), timeout)

    def submit_arrays(self, segment: SegmentLike, local_addrs: Any, remote_addrs: Any, lengths: Any, *, write: bool) -> Batch:
        """Submits one batch to ``segment`` from three equally long one-dimensional arrays:
        local addresses, remote addresses and byte counts, task ``i`` being
        ``(local_addrs[i], remote_addrs[i], lengths[i])``. Each is a numpy ``uint64`` array
        (strided views too), an ``array.array('Q')``, any other buffer of ``uint64``, or a list
        of ints; buffers are read in place, without a Python object per descriptor. The local
        addresses must lie in registered memory.

        Raises ``TypeError`` for another dtype (``int64`` included) or a non-sequence,
        :class:`InvalidArgument` for more than one dimension, arrays of different lengths or
        none at all; engine errors as :meth:`submit` does."""
        return Batch(self, self._core.submit_arrays(bool(write), self._segment_id(segment), local_addrs, remote_addrs, lengths))

    def write_arrays(self, segment: SegmentLike, local_addrs: Any, remote_addrs: Any, lengths: Any, *, timeout: float | None = None) -> None:
        """:meth:`submit_arrays` of writes, waited for; raises the first failure."""
        _finish(self.submit_arrays(segment, local_addrs, remote_addrs, lengths, write=True), timeout)

    def read_arrays(self, segment: SegmentLike, local_addrs: Any, remote_addrs: Any, lengths: Any, *, timeout: float | None = None) -> None:
        """:meth:`submit_arrays` of reads, waited for; raises the first failure."""
        _finish(self.submit_arrays(segment, local_addrs, remote_addrs, lengths, write=False), timeout)

    def read(self, local: Local, segment: SegmentLike, remote_addr: int, nbytes: int | None = None, *, local_offset: int = 0, timeout: float | None = None) -> None:
        """Reads ``nbytes`` at ``remote_addr`` of ``segment`` into ``local`` and waits."""
        self.transfer([read(local, segment, remote_addr, nbytes, local_offset=local_offset)], timeout)

    def write(self, local: Local, segment: SegmentLike, remote_addr: int, nbytes: int | None = None, *, local_offset: int = 0, timeout: float | None = None) -> None:
        """Writes ``nbytes`` of ``local`` to ``remote_addr`` of ``segment`` and waits until
        they have landed."""
        self.transfer([write(local, segment, remote_addr, nbytes, local_offset=local_offset)], timeout)

    async def transfer_async(self, requests: Iterable[Request]) -> None:
        """``transfer`` for asyncio: the loop keeps running while the bytes move."""
        await self.submit(requests).wait_async()

    async def read_async(self, local: Local, segment: SegmentLike, remote_addr: int, nbytes: int | None = None, *, local_offset: int = 0) -> None:
        await self.transfer_async([read(local, segment, remote_addr, nbytes, local_offset=local_offset)])

    async def write_async(self, local: Local, segment: SegmentLike, remote_addr: int, nbytes: int | None = None, *, local_offset: int = 0) -> None:
        await self.transfer_async([write(local, segment, remote_addr, nbytes, local_offset=local_offset)])

    # -- messages -----------------------------------------------------------------------

    def notify(self, segment: SegmentLike, name: str, message: str) -> None:
        """Sends a small message to a segment's node (``notifications()`` there)."""
        self._core.notify(self._segment_id(segment), name, message)

    def notifications(self) -> list[tuple[str, str]]:
        """Takes every ``(name, message)`` received so far, oldest first."""
        return self._core.notifications()

    def probe(self, segment: SegmentLike) -> None:
        """Raises unless the segment's node answers."""
        self._core.probe(self._segment_id(segment))

    def stats(self) -> dict:
        """What each transport moved, retried and failed, and how each peer stands."""
        return json.loads(self._core.stats_json())

    def metrics(self) -> str:
        """The same statistics in the Prometheus text format (latency histograms included),
        for a ``/metrics`` endpoint the serving process already has."""
        return self._core.metrics_text()

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Unregisters everything, stops listeners and workers, withdraws the metadata. A
        region whose memory moved while registered is logged (logger ``tern``)."""
        with self._lock:
            regions = list(self._regions.values())
        self._core.close()
        with self._lock:
            self._regions.clear()
        for region in regions:
            moved = region._hold.moved() if region._hold is not None else None
            region._hold = None
            if moved is not None:
                logging.getLogger("tern").warning(
                    "close: the region at %#x (%d bytes): %s while it was registered: "
                    "peers may have written freed memory",
                    region.addr,
                    region.nbytes,
                    moved,
                )

    @property
    def closed(self) -> bool:
        return self._core.closed

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "TransferEngine(closed)"
        return f"TransferEngine({self.segment_name!r}, protocols={self.protocols})"
