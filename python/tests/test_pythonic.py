"""The Pythonic API: registration by duck typing, owned buffers as memoryviews, batches,
statistics, and the context manager."""

from __future__ import annotations

import array

import numpy as np
import pytest

import tern


class FakeTensor:
    """What the binding reads of a CPU torch tensor: data_ptr(), nbytes, device, is_contiguous()."""

    class device:
        type = "cpu"

    def __init__(self, nbytes: int) -> None:
        self.storage = np.zeros(nbytes, dtype=np.uint8)
        self.nbytes = nbytes

    def data_ptr(self) -> int:
        return self.storage.ctypes.data

    def is_contiguous(self) -> bool:
        return True


class ArrayInterface:
    """Only ``__array_interface__``, as some array libraries offer."""

    def __init__(self, base: np.ndarray) -> None:
        self.base = base
        self.__array_interface__ = {
            "data": (base.ctypes.data, False),
            "shape": base.shape,
            "typestr": base.dtype.str,
            "strides": None,
            "version": 3,
        }


@pytest.fixture
def engine():
    with tern.TransferEngine(local_server_name="127.0.0.1", protocols=["tcp"]) as engine:
        yield engine


def test_everything_with_memory_registers(engine):
    matrix = np.zeros((64, 128), dtype=np.float32)
    tensor = FakeTensor(8192)
    backing = np.zeros(512, dtype=np.int64)
    objects = [bytearray(4096), array.array("d", [0.0] * 1024), memoryview(bytearray(100)), matrix, tensor, ArrayInterface(backing)]
    sizes = [4096, 8192, 100, matrix.nbytes, 8192, backing.nbytes]
    regions = [engine.register(obj) for obj in objects]
    assert [r.nbytes for r in regions] == sizes
    assert regions[3].addr == matrix.ctypes.data and regions[4].addr == tensor.data_ptr()
    listed = {(addr, size) for addr, size, _, _ in engine.regions}
    assert {(r.addr, r.nbytes) for r in regions} <= listed
    # A registered bytearray cannot be resized underneath the engine.
    with pytest.raises(BufferError):
        objects[0].extend(b"more")
    engine.unregister(regions[0])
    objects[0].extend(b"more")  # released once unregistered
    engine.unregister(matrix)
    engine.unregister(regions[4].addr)
    with pytest.raises(tern.InvalidArgument, match="C-contiguous"):
        engine.register(np.zeros((8, 8))[:, ::2])
    # A tensor that says it is on cuda:0 but whose memory is host memory is refused: the
    # driver (or its absence) decides what memory is, never the object's word alone.
    with pytest.raises(tern.TransferError, match="cuda"):
        cuda = FakeTensor(64)
        cuda.device = type("device", (), {"type": "cuda", "index": 0})
        engine.register(cuda)
    with pytest.raises(tern.InvalidArgument, match="xpu"):
        other = FakeTensor(64)
        other.device = type("device", (), {"type": "xpu", "index": 0})
        engine.register(other)


def test_owned_buffers_are_zero_copy_memoryviews(engine, peer_factory):
    peer = peer_factory("--api", "tern")
    buffer = engine.allocate(1 << 20)
    view = buffer.view()
    assert (len(view), view.readonly, view.format) == (1 << 20, False, "B")
    view[:5] = b"hello"
    assert buffer.read(0, 5) == b"hello"
    numbers = np.frombuffer(buffer.view(), dtype=np.uint32)
    numbers[:] = np.arange(numbers.size, dtype=np.uint32)
    engine.write(buffer, peer.session, peer.addr)
    buffer.write(bytes(1 << 20))
    assert numbers[5] == 0
    engine.read(buffer, peer.session, peer.addr)
    assert np.array_equal(numbers, np.arange(numbers.size, dtype=np.uint32))
    del buffer  # the views keep the memory alive
    assert numbers[7] == 7


def test_batches_wait_report_and_cancel(engine, peer):
    buffer = engine.allocate(peer.nbytes)
    segment = engine.segment(peer.session)
    batch = engine.submit([tern.write(buffer, segment, peer.addr + i * 4096, 4096, local_offset=i * 4096) for i in range(16)])
    assert batch.wait(10.0) is True
    assert batch.status.completed == 16 and batch.status.transferred_bytes == 16 * 4096
    assert batch.cancel() == 0
    bad = engine.submit([tern.read(buffer, segment, peer.addr, 4096), tern.read(buffer, segment, peer.addr + peer.nbytes, 4096)])
    with pytest.raises(tern.TargetOutOfRange) as error:
        bad.wait()
    assert error.value.task == 1
    assert bad.task(0).state == "completed" and bad.task(1).state == "failed"
    assert isinstance(bad.task(1).error, tern.TargetOutOfRange)
    stats = engine.stats()
    assert stats["transports"][0]["protocol"] == "tcp"
    assert stats["transports"][0]["bytes"] >= 16 * 4096
    assert {"peer", "state", "endpoints", "last_error"} <= set(stats["transports"][0]["peers"][0])
    text = engine.metrics()
    moved = next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith('tern_transport_bytes_total{transport="tcp"} ')
    )
    assert moved >= 16 * 4096
    assert "# TYPE tern_transfer_duration_seconds histogram" in text


def test_closing_unregisters_and_releases(peer):
    data = bytearray(8192)
    engine = tern.TransferEngine(local_server_name="127.0.0.1", protocols="tcp")
    engine.register(data)
    name = engine.segment_name
    assert name.startswith("127.0.0.1:") and repr(engine).startswith("TransferEngine(")
    engine.close()
    engine.close()
    assert engine.closed
    data.extend(b"x")  # the export was released
    with tern.TransferEngine(local_server_name="127.0.0.1", protocols="tcp") as other:
        with pytest.raises(tern.ConnectionFailed):
            other.segment(name)


def test_an_engine_left_to_the_garbage_collector_releases_what_it_held():
    import gc

    data = bytearray(8192)
    engine = tern.TransferEngine(local_server_name="127.0.0.1", protocols="tcp")
    engine.register(data)
    with pytest.raises(BufferError):
        data.extend(b"x")
    del engine
    gc.collect()
    data.extend(b"x")  # unregistered and released on the way out
