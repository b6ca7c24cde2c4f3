"""Where Mooncake crashes, Tern answers: every bad call returns its failure code (or raises
TypeError for a wrong type), logs one line with the reason, and the engine goes on with its
memory and registrations intact."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import tern
from tern.mooncake import TransferEngine, TransferNotify

UNREACHABLE = "127.0.0.1:1"


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.WARNING, logger="tern")

    def one_line(*words: str) -> None:
        lines = [r.getMessage() for r in caplog.records if r.name == "tern"]
        caplog.clear()
        assert len(lines) == 1, lines
        for word in words:
            assert word in lines[0], (word, lines[0])

    caplog.clear()
    return one_line


def test_every_call_before_initialize_fails_cleanly(log):
    engine = TransferEngine()
    calls = [
        (lambda: engine.get_rpc_port(), -1),
        (lambda: engine.register_memory(4096, 4096), -1),
        (lambda: engine.unregister_memory(4096), -1),
        (lambda: engine.batch_register_memory([4096], [4096]), -1),
        (lambda: engine.batch_unregister_memory([4096]), -1),
        (lambda: engine.allocate_managed_buffer(4096), 0),
        (lambda: engine.free_managed_buffer(4096, 4096), -1),
        (lambda: engine.write_bytes_to_buffer(4096, b"x", 1), -1),
        (lambda: engine.transfer_sync_write("127.0.0.1:2", 1, 2, 3), -1),
        (lambda: engine.transfer_sync_read("127.0.0.1:2", 1, 2, 3), -1),
        (lambda: engine.transfer_sync("127.0.0.1:2", 1, 2, 3, 0), -1),
        (lambda: engine.batch_transfer_sync_write("127.0.0.1:2", [1], [2], [3]), -1),
        (lambda: engine.batch_transfer_sync_read("127.0.0.1:2", [1], [2], [3]), -1),
        (lambda: engine.batch_transfer_sync("127.0.0.1:2", [1], [2], [3], 1), -1),
        (lambda: engine.batch_transfer_async_write("127.0.0.1:2", [1], [2], [3]), 0),
        (lambda: engine.batch_transfer_async_read("127.0.0.1:2", [1], [2], [3]), 0),
        (lambda: engine.batch_transfer_async("127.0.0.1:2", [1], [2], [3], 0), 0),
        (lambda: engine.transfer_submit_write("127.0.0.1:2", 1, 2, 3), 0),
        (lambda: engine.get_batch_transfer_status([1]), -1),
        (lambda: engine.transfer_check_status(1), -1),
        (lambda: engine.get_first_buffer_address("127.0.0.1:2"), 0),
        (lambda: engine.get_notifies(), []),
        (lambda: engine.send_probe("127.0.0.1:2"), -1),
    ]
    for call, expected in calls:
        assert call() == expected
        log("before initialize")
    with pytest.raises(ValueError):
        engine.read_bytes_from_buffer(4096, 1)
    log("before initialize")
    with pytest.raises(NotImplementedError, match="Mooncake"):
        engine.get_engine()


def test_bad_initialize_arguments(log):
    assert TransferEngine().initialize(None, "P2PHANDSHAKE", "tcp", "") == -1
    log("None")
    assert TransferEngine().initialize("127.0.0.1", None, "tcp", "") == -1
    log("None")
    assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", None, None) == -1
    log("None")
    assert TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink", "") == -1
    log("nvlink")
    assert TransferEngine().initialize("127.0.0.1", "redis://127.0.0.1:1", "tcp", "") == -1
    log("redis")
    with pytest.raises(TypeError):
        TransferEngine().initialize(1, "P2PHANDSHAKE", "tcp", "")
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", None) == 0
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1
    log("already initialized")


def test_bad_calls_on_a_running_engine(log, peer, mooncake_engine):
    engine = mooncake_engine
    local = np.arange(1 << 16, dtype=np.uint8)
    addr = local.ctypes.data
    assert engine.register_memory(addr, local.nbytes) == 0

    # Registration: null, zero length, overlap, unknown address, mismatched lists.
    assert engine.register_memory(0, 4096) == -1
    log("null")
    assert engine.register_memory(addr + local.nbytes + 8192, 0) == -1
    log("zero-length")
    assert engine.register_memory(addr + 4096, 4096) == -7
    log("overlaps")
    assert engine.unregister_memory(addr + 1) == -3
    log("not registered")
    assert engine.batch_register_memory([addr], [1, 2]) == -1
    log("1 addresses but 2 capacities")
    with pytest.raises(TypeError):
        engine.register_memory("0x1000", 4096)

    # Lists of different lengths.
    assert engine.batch_transfer_sync_write(peer.session, [addr, addr], [peer.addr], [8]) == -1
    log("different lengths")
    assert engine.batch_transfer_async_read(peer.session, [addr], [peer.addr, peer.addr], [8]) == 0
    log("different lengths")
    assert engine.batch_transfer_sync(peer.session, [addr], [peer.addr], [8], 7) == -1
    log("opcode 7")

    # None where a string belongs; wrong types.
    assert engine.transfer_sync_write(None, addr, peer.addr, 8) == -1
    log("None")
    assert engine.send_probe(None) == -1
    log("None")
    assert engine.get_first_buffer_address(None) == 0
    log("None")
    with pytest.raises(TypeError):
        engine.transfer_sync_write(peer.session, "addr", peer.addr, 8)
    with pytest.raises(TypeError):
        engine.batch_transfer_sync_write(peer.session, "abc", [1], [1])
    assert engine.transfer_sync(peer.session, addr, peer.addr, 8, 1, TransferNotify()) == 0
    assert engine.transfer_sync(peer.session, addr, peer.addr, 8, 1, object()) == -1
    log("notify.name")

    # Unknown and freed batch ids.
    assert engine.get_batch_transfer_status([123456789]) == -1
    log("unknown or already freed batch id 123456789")
    assert engine.transfer_check_status(987654321) == -1
    log("987654321")
    batch = engine.batch_transfer_async_write(peer.session, [addr], [peer.addr], [64])
    assert engine.get_batch_transfer_status([batch]) == 0
    assert engine.get_batch_transfer_status([batch]) == -1
    log(f"batch id {batch}")

    # Addresses outside registered memory: local, remote, and the byte copies.
    assert engine.transfer_sync_write(peer.session, addr + local.nbytes, peer.addr, 8) == -1
    log("not inside one registered region")
    assert engine.transfer_sync_read(peer.session, addr, peer.addr + peer.nbytes, 8) == -1
    log("not inside one buffer")
    assert engine.write_bytes_to_buffer(4096, b"abc", 3) == -1
    log("not registered")
    assert engine.write_bytes_to_buffer(addr + local.nbytes - 1, b"abc", 3) == -1
    log("not registered")
    assert engine.write_bytes_to_buffer(addr, b"abc", 10) == -1
    log("more than the 3 bytes")
    with pytest.raises(ValueError):
        engine.read_bytes_from_buffer(4096, 16)
    log("not registered")
    assert engine.free_managed_buffer(addr, local.nbytes) == -1
    log("not a managed buffer")
    managed = engine.allocate_managed_buffer(8192)
    assert engine.free_managed_buffer(managed, 4096) == -1
    log("8192 bytes, not 4096")
    assert engine.allocate_managed_buffer(0) == 0
    log("zero")

    # An unreachable peer.
    assert engine.transfer_sync_write(UNREACHABLE, addr, 4096, 8) == -1
    log(UNREACHABLE)
    assert engine.send_probe(UNREACHABLE) == -200
    log(UNREACHABLE)
    assert engine.get_first_buffer_address(UNREACHABLE) == 0
    log(UNREACHABLE)
    assert engine.batch_transfer_async_write(UNREACHABLE, [addr], [4096], [8]) == 0
    log(UNREACHABLE)

    # Nothing was lost: the registration, the managed buffer and the engine still work.
    assert engine.write_bytes_to_buffer(addr, b"tern", 4) == 0
    assert engine.read_bytes_from_buffer(addr, 4) == b"tern"
    assert engine.write_bytes_to_buffer(managed + 100, b"ok", 2) == 0
    assert engine.read_bytes_from_buffer(managed + 100, 2) == b"ok"
    assert engine.transfer_sync_write(peer.session, addr, peer.addr, local.nbytes) == 0
    assert engine.send_probe(peer.session) == 0
    assert engine.free_managed_buffer(managed, 8192) == 0
    assert engine.unregister_memory(addr) == 0


def test_the_pythonic_api_raises_typed_exceptions(peer):
    with tern.TransferEngine(local_server_name="127.0.0.1", protocols="tcp") as engine:
        local = bytearray(4096)
        with pytest.raises(tern.AddressNotRegistered):
            engine.write(local, peer.session, peer.addr)
        region = engine.register(local)
        with pytest.raises(tern.AddressOverlapped):
            engine.register(local)
        with pytest.raises(tern.TargetOutOfRange) as error:
            engine.write(region, peer.session, peer.addr + peer.nbytes)
        assert error.value.task == 0 and isinstance(error.value, ValueError)
        with pytest.raises(tern.ConnectionFailed):
            engine.write(region, UNREACHABLE, 4096)
        with pytest.raises(tern.InvalidArgument, match="read-only"):
            engine.register(b"immutable bytes")
        with pytest.raises(TypeError):
            engine.register(12345)
        with pytest.raises(TypeError):
            engine.segment(None)
        with pytest.raises(tern.InvalidArgument):
            engine.allocate(0)
        with pytest.raises(tern.InvalidArgument):
            tern.TransferEngine(protocols=["carrier-pigeon"])
        engine.write(region, peer.session, peer.addr)
        engine.unregister(region)
    with pytest.raises(tern.InvalidArgument, match="closed"):
        engine.segment(peer.session)
