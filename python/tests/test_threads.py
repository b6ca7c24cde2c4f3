"""One engine, 16 Python threads at once, every byte checked."""

from __future__ import annotations

import threading

import numpy as np

import tern

THREADS = 16
CHUNK = 256 << 10
ROUNDS = 8


def test_sixteen_threads_share_one_drop_in_engine(peer_factory, mooncake_engine):
    peer = peer_factory("--nbytes", str(THREADS * CHUNK))
    engine = mooncake_engine
    send = np.random.default_rng(0).integers(0, 256, THREADS * CHUNK, dtype=np.uint8)
    back = np.zeros_like(send)
    assert engine.batch_register_memory([send.ctypes.data, back.ctypes.data], [send.nbytes, back.nbytes]) == 0
    failures: list[str] = []
    start = threading.Barrier(THREADS)

    def worker(t: int) -> None:
        start.wait()
        base = t * CHUNK
        for round_ in range(ROUNDS):
            # Each round writes a different slice of the sender's bytes into this thread's area.
            piece = (base + round_ * 4096) % (THREADS * CHUNK - CHUNK)
            quarter = CHUNK // 4
            if engine.batch_transfer_sync_write(
                peer.session,
                [send.ctypes.data + piece + q * quarter for q in range(4)],
                [peer.addr + base + q * quarter for q in range(4)],
                [quarter] * 4,
            ):
                failures.append(f"thread {t} write {round_}")
                return
            if engine.transfer_sync_read(peer.session, back.ctypes.data + base, peer.addr + base, CHUNK):
                failures.append(f"thread {t} read {round_}")
                return
            if not np.array_equal(back[base : base + CHUNK], send[piece : piece + CHUNK]):
                failures.append(f"thread {t} round {round_}: wrong bytes")
                return

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_sixteen_threads_share_one_pythonic_engine(peer_factory):
    peer = peer_factory("--api", "tern", "--nbytes", str(THREADS * CHUNK))
    with tern.TransferEngine(local_server_name="127.0.0.1", protocols="tcp") as engine:
        buffers = [engine.allocate(CHUNK) for _ in range(THREADS)]
        errors: list[BaseException] = []

        def worker(t: int) -> None:
            try:
                data = bytes([t]) * CHUNK
                for _ in range(ROUNDS):
                    buffers[t].write(data)
                    engine.write(buffers[t], peer.session, peer.addr + t * CHUNK)
                    buffers[t].write(bytes(CHUNK))
                    engine.read(buffers[t], peer.session, peer.addr + t * CHUNK)
                    assert buffers[t].read() == data
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
