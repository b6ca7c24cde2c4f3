"""A Python initiator against a ``tern-bench --mode=target`` process."""

from __future__ import annotations

import numpy as np

import tern
from conftest import expected_byte
from tern.mooncake import TransferEngine

SIZE = 4 << 20


def test_drop_in_reads_and_writes_a_tern_bench_target(bench_target, mooncake_engine):
    target = bench_target(f"--buffer_size={SIZE}")
    engine = mooncake_engine
    remote = engine.get_first_buffer_address(target.segment)
    assert remote != 0
    local = np.zeros(SIZE, dtype=np.uint8)
    assert engine.register_memory(local.ctypes.data, SIZE) == 0
    blocks = 64
    block = SIZE // blocks
    addrs = [local.ctypes.data + i * block for i in range(blocks)]
    peers = [remote + i * block for i in range(blocks)]
    assert engine.batch_transfer_sync_read(target.segment, addrs, peers, [block] * blocks) == 0
    assert np.array_equal(local, expected_byte(np.arange(SIZE)))
    # Write something else over the first MiB and read it back.
    mine = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    local[: 1 << 20] = mine
    assert engine.transfer_sync_write(target.segment, local.ctypes.data, remote, 1 << 20) == 0
    local[:] = 0
    assert engine.transfer_sync_read(target.segment, local.ctypes.data, remote, 2 << 20) == 0
    assert np.array_equal(local[: 1 << 20], mine)
    assert np.array_equal(local[1 << 20 : 2 << 20], expected_byte(np.arange(1 << 20, 2 << 20)))


def test_pythonic_batch_against_a_tern_bench_target(bench_target):
    target = bench_target(f"--buffer_size={SIZE}")
    with tern.TransferEngine(local_server_name="127.0.0.1", protocols="tcp") as engine:
        segment = engine.segment(target.segment)
        remote = max(segment.buffers, key=lambda b: b[1])[0]
        buffer = engine.allocate(SIZE)
        batch = engine.submit([tern.read(buffer, segment, remote + i * 65536, 65536, local_offset=i * 65536) for i in range(64)])
        assert len(batch) == 64
        assert batch.wait(30.0) is True
        status = batch.status
        assert (status.state, status.completed, status.transferred_bytes) == ("completed", 64, 64 * 65536)
        assert all(t.state == "completed" and t.transferred_bytes == 65536 and t.error is None for t in batch.tasks)
        view = np.frombuffer(buffer.view(), dtype=np.uint8)
        assert np.array_equal(view[: 64 * 65536], expected_byte(np.arange(64 * 65536)))
