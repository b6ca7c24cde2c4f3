"""Device memory through both Python APIs, against the stand-in CUDA driver that
``cargo xtask test`` names in ``TERN_CUDA_DRIVER``: its device memory faults on any CPU
access, so these tests pass only if Tern moved every byte by driver copies. They test the
logic above the driver, not that GPUs work (the GPU bundle does that)."""

from __future__ import annotations

import ctypes
import os

import pytest

import tern
from tern.mooncake import TransferEngine

LOCAL = "127.0.0.1"
LEN = 3 * (512 << 10) + 999


def standin() -> ctypes.CDLL:
    path = os.environ.get("TERN_CUDA_DRIVER", "")
    if "standin" not in path:
        pytest.skip("TERN_CUDA_DRIVER does not name the stand-in driver (cargo xtask test sets it)")
    # The same file the engine loads, so the same library instance and the same devices.
    return ctypes.CDLL(path)


class Gpu:
    """Allocations and copies on the stand-in's device 0, through its driver API."""

    def __init__(self) -> None:
        self.lib = standin()
        assert self.lib.cuInit(0) == 0
        context = ctypes.c_void_p()
        assert self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), 0) == 0
        self.context = context

    def _enter(self) -> None:
        assert self.lib.cuCtxPushCurrent_v2(self.context) == 0

    def _leave(self) -> None:
        popped = ctypes.c_void_p()
        assert self.lib.cuCtxPopCurrent_v2(ctypes.byref(popped)) == 0

    def allocate(self, nbytes: int) -> int:
        self._enter()
        try:
            ptr = ctypes.c_uint64()
            assert self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)) == 0
            return ptr.value
        finally:
            self._leave()

    def write(self, addr: int, data: bytes) -> None:
        self._enter()
        try:
            assert self.lib.cuMemcpyHtoD_v2(ctypes.c_uint64(addr), data, ctypes.c_size_t(len(data))) == 0
        finally:
            self._leave()

    def read(self, addr: int, nbytes: int) -> bytes:
        out = ctypes.create_string_buffer(nbytes)
        self._enter()
        try:
            assert self.lib.cuMemcpyDtoH_v2(out, ctypes.c_uint64(addr), ctypes.c_size_t(nbytes)) == 0
        finally:
            self._leave()
        return out.raw


def pattern(nbytes: int, seed: int) -> bytes:
    return bytes((i * 31 + seed + (i >> 11)) & 0xFF for i in range(nbytes))


@pytest.fixture
def gpu() -> Gpu:
    return Gpu()


def test_the_drop_in_moves_device_memory_over_tcp(gpu):
    import tern.mooncake as mooncake

    assert mooncake.SUPPORT_CUDA is True
    initiator, target = TransferEngine(), TransferEngine()
    for engine in (initiator, target):
        assert engine.initialize(LOCAL, "P2PHANDSHAKE", "tcp", "") == 0
    source, landing, remote = gpu.allocate(LEN), gpu.allocate(LEN), gpu.allocate(LEN)
    data = pattern(LEN, 3)
    # Device memory registered the way SGLang and vLLM do it: an address and a length.
    assert initiator.batch_register_memory([source, landing], [LEN, LEN]) == 0
    assert target.register_memory(remote, LEN) == 0
    # write_bytes_to_buffer goes through a device copy.
    assert initiator.write_bytes_to_buffer(source, data, LEN) == 0
    assert gpu.read(source, LEN) == data
    session = f"{LOCAL}:{target.get_rpc_port()}"
    assert initiator.transfer_sync_write(session, source, remote, LEN) == 0
    assert gpu.read(remote, LEN) == data
    assert initiator.transfer_sync_read(session, landing, remote, LEN) == 0
    assert initiator.read_bytes_from_buffer(landing, LEN) == data
    # Out of the target's device buffer: refused as for host memory, nothing lost.
    assert initiator.transfer_sync_write(session, source, remote + LEN - 8, 64) < 0
    assert gpu.read(remote, LEN) == data


def test_a_cuda_tensor_registers_as_device_memory(gpu):
    class CudaTensor:
        """What the engine asks of a torch CUDA tensor."""

        def __init__(self, addr: int, nbytes: int) -> None:
            self.addr, self.nbytes = addr, nbytes
            self.device = type("device", (), {"type": "cuda", "index": 0})

        def data_ptr(self) -> int:
            return self.addr

        def is_contiguous(self) -> bool:
            return True

    memory = gpu.allocate(LEN)
    with tern.TransferEngine(local_server_name=LOCAL, protocols=["tcp"]) as engine:
        region = engine.register(CudaTensor(memory, LEN))
        listed = {addr: location for addr, _, location, _ in engine.regions}
        assert listed[region.addr] == "cuda:0"
        engine.unregister(region)
        # The wrong device is refused: the driver says where memory is.
        wrong = CudaTensor(memory, LEN)
        wrong.device = type("device", (), {"type": "cuda", "index": 1})
        with pytest.raises(tern.TransferError, match="cuda:0"):
            engine.register(wrong)


def test_transfers_on_a_stream_keep_its_order_and_report_failure_without_exiting(gpu):
    lib = gpu.lib
    gpu._enter()
    try:
        stream = ctypes.c_void_p()
        assert lib.cuStreamCreate(ctypes.byref(stream), 1) == 0
        # A word of mapped pinned memory the stream waits on: the "earlier work" the test
        # finishes when it chooses.
        word = ctypes.c_void_p()
        assert lib.cuMemHostAlloc(ctypes.byref(word), ctypes.c_size_t(4), 3) == 0
        ctypes.c_uint32.from_address(word.value).value = 0
        assert lib.cuStreamWaitValue32_v2(stream, ctypes.c_uint64(word.value), ctypes.c_uint32(1), 0) == 0
    finally:
        gpu._leave()
    initiator, target = TransferEngine(), TransferEngine()
    for engine in (initiator, target):
        assert engine.initialize(LOCAL, "P2PHANDSHAKE", "tcp", "") == 0
    source, remote = gpu.allocate(LEN), gpu.allocate(LEN)
    data = pattern(LEN, 17)
    gpu.write(source, data)
    assert initiator.register_memory(source, LEN) == 0
    assert target.register_memory(remote, LEN) == 0
    session = f"{LOCAL}:{target.get_rpc_port()}"

    handle = initiator.transfer_write_on_cuda(session, source, remote, LEN, stream.value)
    # The call returned with the stream still held by earlier work: nothing has moved.
    with pytest.raises(TimeoutError):
        handle.wait(0.3)
    assert not handle.done()
    assert gpu.read(remote, LEN) == bytes(LEN)
    ctypes.c_uint32.from_address(word.value).value = 1
    assert handle.wait(60) == LEN
    assert gpu.read(remote, LEN) == data

    # Lists of different lengths are Mooncake's RuntimeError.
    with pytest.raises(RuntimeError):
        initiator.batch_transfer_read_on_cuda(session, [source], [remote, remote], [8], stream.value)
    # Out of the target's buffer: the stream goes on, the handle says why, the process lives.
    failing = initiator.batch_transfer_write_on_cuda(
        session, [source], [remote + LEN - 8], [64], stream.value
    )
    with pytest.raises(tern.TransferError):
        failing.wait(60)
    gpu._enter()
    try:
        assert lib.cuStreamSynchronize(stream) == 0
    finally:
        gpu._leave()
    assert gpu.read(remote, LEN) == data
