"""What ``tern.TransferEngine.register`` holds: a tensor's storage, not the tensor, so ``set_``
cannot free registered memory; and a storage or an ``__array_interface__`` object that moves
its memory while registered is caught at unregister (``tern.MemoryMoved``), the region being
unregistered all the same. So is a numpy array resized with ``refcheck=False``."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import tern


class FakeStorage:
    """What the binding reads of ``torch.UntypedStorage``: ``data_ptr()`` and ``nbytes()``.
    ``resize_`` reallocates the memory in place and frees the old one, as torch's does."""

    def __init__(self, nbytes: int) -> None:
        self.memory = np.zeros(nbytes, dtype=np.uint8)

    def data_ptr(self) -> int:
        return self.memory.ctypes.data

    def nbytes(self) -> int:
        return self.memory.nbytes

    def resize_(self, nbytes: int) -> None:
        grown = np.zeros(nbytes, dtype=np.uint8)
        kept = min(nbytes, self.memory.nbytes)
        grown[:kept] = self.memory[:kept]
        self.memory = grown


class FakeTensor:
    """A contiguous CPU tensor over a :class:`FakeStorage`, with torch's ``resize_`` (grows
    its storage when it needs more bytes) and ``set_`` (takes another storage)."""

    class device:
        type = "cpu"

    def __init__(self, nbytes: int) -> None:
        self.storage = FakeStorage(nbytes)
        self.nbytes = nbytes

    def untyped_storage(self) -> FakeStorage:
        return self.storage

    def data_ptr(self) -> int:
        return self.storage.data_ptr()

    def is_contiguous(self) -> bool:
        return True

    def resize_(self, nbytes: int) -> None:
        if nbytes > self.storage.nbytes():
            self.storage.resize_(nbytes)
        self.nbytes = nbytes

    def set_(self, storage: FakeStorage) -> None:
        self.storage = storage
        self.nbytes = storage.nbytes()


class MovableArray:
    """Only ``__array_interface__``, over memory it can replace."""

    def __init__(self, nbytes: int) -> None:
        self.memory = np.zeros(nbytes, dtype=np.uint8)

    @property
    def __array_interface__(self) -> dict:
        return {"data": (self.memory.ctypes.data, False), "shape": self.memory.shape, "typestr": "|u1", "version": 3}


@pytest.fixture
def engine():
    with tern.TransferEngine(local_server_name="127.0.0.1", protocols=["tcp"]) as engine:
        yield engine


def registered(engine, addr: int) -> bool:
    return any(start == addr for start, _, _, _ in engine.regions)


def test_a_registered_tensor_keeps_its_storage_through_set(engine):
    tensor = FakeTensor(1 << 20)
    old = weakref.ref(tensor.storage)
    region = engine.register(tensor)
    tensor.set_(FakeStorage(1 << 20))
    gc.collect()
    assert old() is not None, "the registered storage was freed while registered"
    assert old().data_ptr() == region.addr
    # By the object: found by what it was registered as, not by where it points now.
    engine.unregister(tensor)
    assert not registered(engine, region.addr)
    del region
    gc.collect()
    assert old() is None, "the storage outlived its unregister"


def test_a_tensor_resized_while_registered_is_caught_at_unregister(engine):
    tensor = FakeTensor(1 << 20)
    region = engine.register(tensor)
    tensor.resize_(4 << 20)  # the storage reallocates: the registered memory is freed
    assert tensor.data_ptr() != region.addr
    with pytest.raises(tern.MemoryMoved, match=f"from {region.addr:#x} to {tensor.data_ptr():#x}"):
        engine.unregister(tensor)
    assert not registered(engine, region.addr)
    with pytest.raises(tern.AddressNotRegistered):
        engine.unregister(region)


def test_an_array_interface_that_moves_is_caught_at_unregister(engine):
    steady, moving = MovableArray(4096), MovableArray(4096)
    kept = engine.register(steady)
    region = engine.register(moving)
    moving.memory = np.zeros(8192, dtype=np.uint8)
    with pytest.raises(tern.MemoryMoved, match="__array_interface__"):
        engine.unregister(region.addr)
    assert not registered(engine, region.addr)
    engine.unregister(steady)  # one that stayed put goes quietly
    assert not registered(engine, kept.addr)


def test_a_registered_numpy_array_is_resized_only_on_request_and_then_caught(engine):
    array = np.zeros(4096, dtype=np.uint8)
    region = engine.register(array)
    with pytest.raises(ValueError, match="cannot resize"):
        array.resize(8192)  # the engine's buffer export refuses it
    # numpy's way of saying "nobody else holds it": it reallocates, here far past any heap
    # chunk's room, so the memory moves unless realloc finds room behind it.
    array.resize(64 << 20, refcheck=False)
    if array.ctypes.data == region.addr:
        engine.unregister(array)  # grown in place: nothing moved, so nothing to report
        pytest.skip("realloc grew the array in place")
    with pytest.raises(tern.MemoryMoved, match="ndarray moved its memory"):
        engine.unregister(array)
    assert not registered(engine, region.addr)
