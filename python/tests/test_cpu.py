"""Waiting costs no CPU: a thread blocked in batch_transfer_sync_write to a stopped peer
sleeps until the transfer deadline, then gets -1; an idle engine sleeps too. Measured by
the process's own CPU time (every thread of it), with a generous bound for a noisy
machine; the benchmark reports the figure."""

from __future__ import annotations

import os
import time

import numpy as np

from tern.mooncake import TransferEngine


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def test_a_blocked_waiter_and_an_idle_engine_sleep(bench_target, monkeypatch):
    target = bench_target("--buffer_size=16777216")
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "11")
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    local = np.zeros(128 * 65536, dtype=np.uint8)
    assert engine.register_memory(local.ctypes.data, local.nbytes) == 0
    remote = engine.get_first_buffer_address(target.segment)
    srcs = [local.ctypes.data + i * 65536 for i in range(128)]
    dsts = [remote + i * 65536 for i in range(128)]
    assert engine.batch_transfer_sync_write(target.segment, srcs, dsts, [65536] * 128) == 0

    idle_cpu, idle_wall = cpu_seconds(), time.monotonic()
    time.sleep(3)
    idle = (cpu_seconds() - idle_cpu) / (time.monotonic() - idle_wall)
    assert idle < 0.05, f"an idle engine used {idle:.1%} of a core"

    target.pause()
    try:
        cpu, wall = cpu_seconds(), time.monotonic()
        assert engine.batch_transfer_sync_write(target.segment, srcs, dsts, [65536] * 128) == -1
        elapsed = time.monotonic() - wall
        used = (cpu_seconds() - cpu) / elapsed
    finally:
        target.resume()
    assert 10 <= elapsed < 20, f"returned after {elapsed:.1f} s with an 11 s deadline"
    assert used < 0.05, f"a blocked waiter used {used:.1%} of a core over {elapsed:.1f} s"
