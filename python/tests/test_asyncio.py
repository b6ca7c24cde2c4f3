"""asyncio: transfers awaited on the event loop; completions arrive through a socket the loop
watches (no polling thread), deadlines and cancellation included."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import tern
from conftest import pattern, sha


def test_write_and_read_async(peer_factory):
    peer = peer_factory("--api", "tern")

    async def main() -> int:
        with tern.TransferEngine(local_server_name="127.0.0.1", protocols="tcp") as engine:
            local = np.random.default_rng(2).integers(0, 256, peer.nbytes, dtype=np.uint8)
            engine.register(local)
            threads = threading.active_count()
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            tick = asyncio.create_task(ticker())
            await engine.write_async(local, peer.session, peer.addr)
            assert peer.ask("sha")["sha"] == sha(local)
            peer.ask("fill 8")
            # Eight reads at once, each a slice of the buffer.
            part = peer.nbytes // 8
            await asyncio.gather(
                *(engine.read_async(local, peer.session, peer.addr + i * part, part, local_offset=i * part) for i in range(8))
            )
            assert np.array_equal(local, pattern(8, peer.nbytes))
            batch = engine.submit([tern.write(local, peer.session, peer.addr, 4096)])
            assert await batch is True and batch.done
            tick.cancel()
            assert threading.active_count() == threads  # no helper thread was started
            return ticks

    assert asyncio.run(main()) > 0  # the loop kept running while the bytes moved


def test_async_deadline_and_cancel(bench_target):
    target = bench_target("--buffer_size=1048576")

    async def main() -> None:
        with tern.TransferEngine(local_server_name="127.0.0.1", protocols="tcp", transfer_timeout=2.0) as engine:
            buffer = engine.allocate(1 << 20)
            segment = engine.segment(target.segment)
            remote = max(segment.buffers, key=lambda b: b[1])[0]
            await engine.read_async(buffer, segment, remote, 4096)
            target.pause()
            try:
                # Canceling the awaiting task cancels the batch.
                task = asyncio.ensure_future(engine.write_async(buffer, segment, remote, 1 << 20))
                await asyncio.sleep(0.2)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                # Nobody polls, yet the deadline ends the transfer.
                started = time.monotonic()
                with pytest.raises(tern.TransferTimeout):
                    await engine.write_async(buffer, segment, remote, 1 << 20)
                assert 1.5 < time.monotonic() - started < 10
            finally:
                target.resume()

    asyncio.run(main())
