"""Finding the memory behind a Python object, without importing numpy or torch.

An object qualifies by the buffer protocol (``bytearray``, ``memoryview``, ``array.array``,
``mmap``, numpy arrays), by ``__array_interface__``, or as a CPU tensor with ``data_ptr()``
and ``nbytes``. It must be writable and C-contiguous: peers write registered memory.

What the engine holds while the memory is registered is a :class:`Hold`: for the buffer
protocol, a buffer export, which forbids the exporter to free, move or resize the memory; for
a tensor, its storage (``untyped_storage()``), so that ``set_`` or deleting the tensor does not
free it; for an ``__array_interface__`` object, the object itself. A storage or such an object
can still move its memory (a growing ``resize_``), and numpy moves an exported array on request
(``resize(refcheck=False)``); nothing outside them can forbid that, so the hold remembers where
the memory was and :meth:`Hold.moved` tells whether it still is there.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

from ._errors import InvalidArgument


class Hold:
    """What keeps registered memory allocated: ``keepalive``, and, where the memory can move
    while it is held, how to read where it is now (``None`` where it cannot move)."""

    __slots__ = ("keepalive", "what", "_base", "_where")

    def __init__(self, keepalive: Any, what: str, base: int = 0, where: Callable[[], int] | None = None) -> None:
        self.keepalive = keepalive
        self.what = what
        self._base = base
        self._where = where

    def moved(self) -> str | None:
        """``None`` while the memory is where it was registered; else what happened to it."""
        if self._where is None:
            return None
        try:
            now = int(self._where())
        except Exception as error:  # noqa: BLE001 - the owner no longer says: treat as moved
            return f"the {self.what} no longer tells where its memory is ({error!r})"
        if now == self._base:
            return None
        return f"the {self.what} moved its memory from {self._base:#x} to {now:#x}"


def _from_buffer(obj: Any) -> tuple[int, int, Hold]:
    view = memoryview(obj)
    if view.readonly:
        raise InvalidArgument(
            f"{type(obj).__name__} is read-only; register writable memory (bytearray, numpy array)"
        )
    if not view.c_contiguous:
        raise InvalidArgument(f"{type(obj).__name__} is not C-contiguous")
    flat = view.cast("B") if view.ndim != 1 or view.format != "B" else view
    if flat.nbytes == 0:
        raise InvalidArgument(f"{type(obj).__name__} has no bytes")
    # The ctypes array holds a buffer export of `flat` (and so of `obj`) for as long as it
    # lives: the exporter may not free, move or resize the memory meanwhile.
    holder = (ctypes.c_char * flat.nbytes).from_buffer(flat)
    addr = ctypes.addressof(holder)
    # An exporter can still break that rule on request (numpy's `resize(refcheck=False)`):
    # where the memory is is asked again at unregister.
    return addr, flat.nbytes, Hold(holder, type(obj).__name__, addr, lambda: _buffer_address(obj))


def _buffer_address(obj: Any) -> int:
    with memoryview(obj) as view, view.cast("B") as flat:
        first = ctypes.c_char.from_buffer(flat)
        addr = ctypes.addressof(first)
        del first
    return addr


def _interface_pointer(obj: Any) -> int:
    return int(obj.__array_interface__["data"][0])


def _from_array_interface(obj: Any, interface: dict) -> tuple[int, int, Hold]:
    pointer, readonly = interface["data"]
    if readonly:
        raise InvalidArgument(f"{type(obj).__name__} is read-only")
    shape = tuple(interface.get("shape", ()))
    typestr = interface.get("typestr", "|u1")
    itemsize = int(typestr[2:]) if len(typestr) > 2 and typestr[2:].isdigit() else 1
    count = 1
    for extent in shape:
        count *= int(extent)
    strides = interface.get("strides")
    if strides is not None:
        expected, step = [], itemsize
        for extent in reversed(shape):
            expected.append(step)
            step *= int(extent)
        if tuple(reversed(expected)) != tuple(strides):
            raise InvalidArgument(f"{type(obj).__name__} is not C-contiguous")
    nbytes = count * itemsize
    if not pointer or nbytes == 0:
        raise InvalidArgument(f"{type(obj).__name__} has no bytes")
    # The object that exposes the interface owns (or holds the owner of) the memory; whether
    # it still points there is asked of it again at unregister.
    what = f"{type(obj).__name__} (__array_interface__)"
    return int(pointer), nbytes, Hold(obj, what, int(pointer), lambda: _interface_pointer(obj))


def _from_tensor(obj: Any) -> tuple[int, int, Hold]:
    device = getattr(obj, "device", None)
    kind = getattr(device, "type", device)
    if kind is not None and str(kind) not in ("cpu", "cuda"):
        raise InvalidArgument(f"tensor on {kind}: only CPU and CUDA memory can be registered")
    is_contiguous = getattr(obj, "is_contiguous", None)
    if callable(is_contiguous) and not is_contiguous():
        raise InvalidArgument("tensor is not contiguous")
    nbytes = int(obj.nbytes() if callable(obj.nbytes) else obj.nbytes)
    pointer = int(obj.data_ptr())
    if not pointer or not nbytes:
        raise InvalidArgument("tensor has no bytes")
    untyped_storage = getattr(obj, "untyped_storage", None)
    if not callable(untyped_storage):
        # No storage to hold (not torch, or a torch before 2.0): the tensor itself, whose data
        # pointer is asked again at unregister.
        return pointer, nbytes, Hold(obj, type(obj).__name__, pointer, obj.data_ptr)
    # The storage, not the tensor: `set_` gives the tensor other memory and `resize_` may
    # give it a new storage, while this one (and its memory) stays as long as it is held. A
    # storage can still reallocate itself in place (growing `resize_`): its pointer is asked
    # again at unregister.
    storage = untyped_storage()
    base = int(storage.data_ptr())
    storage_nbytes = storage.nbytes() if callable(storage.nbytes) else storage.nbytes
    if not (base <= pointer and pointer + nbytes <= base + int(storage_nbytes)):
        raise InvalidArgument(
            f"tensor's {nbytes} bytes at {pointer:#x} are not inside its storage "
            f"({int(storage_nbytes)} bytes at {base:#x})"
        )
    return pointer, nbytes, Hold(storage, f"storage of a {type(obj).__name__}", base, storage.data_ptr)


def device_location(obj: Any) -> str | None:
    """``cuda:<index>`` for a tensor on a numbered CUDA device, else ``None`` (the engine then
    asks the driver where the memory is)."""
    device = getattr(obj, "device", None)
    if str(getattr(device, "type", device)) != "cuda":
        return None
    index = getattr(device, "index", None)
    return f"cuda:{int(index)}" if index is not None else None


def locate(obj: Any) -> tuple[int, int, Hold]:
    """``(address, nbytes, hold)`` of an object's memory; ``hold`` keeps it allocated."""
    try:
        memoryview(obj)
    except TypeError:
        pass
    else:
        return _from_buffer(obj)
    interface = getattr(obj, "__array_interface__", None)
    if isinstance(interface, dict):
        return _from_array_interface(obj, interface)
    if callable(getattr(obj, "data_ptr", None)) and hasattr(obj, "nbytes"):
        return _from_tensor(obj)
    raise TypeError(
        f"cannot register {type(obj).__name__}: it has neither the buffer protocol, "
        "__array_interface__, nor data_ptr() and nbytes"
    )


def view_of(owner: Any, address: int, nbytes: int) -> memoryview:
    """A writable byte ``memoryview`` over ``nbytes`` at ``address`` that keeps ``owner`` alive."""
    array = (ctypes.c_ubyte * nbytes).from_address(address)
    array._owner = owner  # the memory lives as long as its owner; every view holds the array
    return memoryview(array).cast("B")
