"""Finding the memory behind a Python object, without importing numpy or torch.

An object qualifies by the buffer protocol (``bytearray``, ``memoryview``, ``array.array``,
``mmap``, numpy arrays), by ``__array_interface__``, or as a CPU tensor with ``data_ptr()``
and ``nbytes``. It must be writable and C-contiguous: peers write registered memory.
"""

from __future__ import annotations

import ctypes
from typing import Any

from ._errors import InvalidArgument


def _from_buffer(obj: Any) -> tuple[int, int, Any]:
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
    return ctypes.addressof(holder), flat.nbytes, holder


def _from_array_interface(obj: Any, interface: dict) -> tuple[int, int, Any]:
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
    return int(pointer), nbytes, obj


def _from_tensor(obj: Any) -> tuple[int, int, Any]:
    device = getattr(obj, "device", None)
    kind = getattr(device, "type", device)
    if kind is not None and str(kind) != "cpu":
        raise InvalidArgument(f"tensor on {kind}: only CPU memory can be registered")
    is_contiguous = getattr(obj, "is_contiguous", None)
    if callable(is_contiguous) and not is_contiguous():
        raise InvalidArgument("tensor is not contiguous")
    nbytes = obj.nbytes() if callable(obj.nbytes) else obj.nbytes
    pointer = obj.data_ptr()
    if not pointer or not nbytes:
        raise InvalidArgument("tensor has no bytes")
    return int(pointer), int(nbytes), obj


def locate(obj: Any) -> tuple[int, int, Any]:
    """``(address, nbytes, keepalive)`` of an object's memory; ``keepalive`` keeps it valid."""
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
