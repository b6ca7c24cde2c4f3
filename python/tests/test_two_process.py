"""Two Python processes on loopback, P2P handshake, TCP: a numpy array moves both ways,
through the drop-in and through the Pythonic API."""

from __future__ import annotations

import numpy as np

import tern
from conftest import LOCAL, pattern, sha


def test_numpy_array_both_ways_with_the_drop_in(peer, mooncake_engine):
    engine = mooncake_engine
    assert peer.session.startswith(f"{LOCAL}:")
    assert 15000 <= int(peer.session.rsplit(":", 1)[1]) <= 17000
    local = np.random.default_rng(7).integers(0, 256, peer.nbytes, dtype=np.uint8)
    assert engine.register_memory(local.ctypes.data, local.nbytes) == 0
    half = peer.nbytes // 2
    # Write in two requests, then check the peer's bytes.
    assert (
        engine.batch_transfer_sync_write(
            peer.session,
            [local.ctypes.data, local.ctypes.data + half],
            [peer.addr, peer.addr + half],
            [half, peer.nbytes - half],
        )
        == 0
    )
    assert peer.ask("sha")["sha"] == sha(local)
    # Read back what the peer fills in.
    peer.ask("fill 11")
    assert engine.transfer_sync_read(peer.session, local.ctypes.data, peer.addr, peer.nbytes) == 0
    assert np.array_equal(local, pattern(11, peer.nbytes))
    assert engine.unregister_memory(local.ctypes.data) == 0


def test_numpy_array_both_ways_with_the_pythonic_api(peer_factory):
    peer = peer_factory("--api", "tern")
    with tern.TransferEngine(local_server_name=LOCAL, protocols=["tcp"]) as engine:
        local = np.random.default_rng(3).integers(0, 256, peer.nbytes, dtype=np.uint8)
        region = engine.register(local)
        assert (region.addr, region.nbytes) == (local.ctypes.data, local.nbytes)
        segment = engine.segment(peer.session)
        assert (peer.addr, peer.nbytes) in segment.buffers
        engine.write(local, segment, peer.addr)
        assert peer.ask("sha")["sha"] == sha(local)
        peer.ask("fill 5")
        engine.read(local, peer.session, peer.addr)
        assert np.array_equal(local, pattern(5, peer.nbytes))
        stats = engine.stats()
        tcp = stats["transports"][0]
        assert tcp["protocol"] == "tcp" and tcp["bytes"] >= 2 * peer.nbytes


def test_managed_buffers_move_bytes(peer, mooncake_engine):
    engine = mooncake_engine
    addr = engine.allocate_managed_buffer(peer.nbytes)
    assert addr != 0
    data = bytes(pattern(21, 4096))
    assert engine.write_bytes_to_buffer(addr, data, len(data)) == 0
    assert engine.transfer_sync(peer.session, addr, peer.addr, 4096, engine.TransferOpcode.Write) == 0
    assert engine.transfer_sync(peer.session, addr + 8192, peer.addr, 4096, tern.mooncake.Read) == 0
    assert engine.read_bytes_from_buffer(addr + 8192, 4096) == data
    assert engine.free_managed_buffer(addr, peer.nbytes) == 0


def test_async_batches_and_status(peer, mooncake_engine):
    engine = mooncake_engine
    local = np.zeros(peer.nbytes, dtype=np.uint8)
    assert engine.register_memory(local.ctypes.data, local.nbytes, "cpu:0") == 0
    peer.ask("fill 9")
    ids = [
        engine.batch_transfer_async_read(peer.session, [local.ctypes.data], [peer.addr], [peer.nbytes // 2]),
        engine.batch_transfer_async(
            peer.session,
            [local.ctypes.data + peer.nbytes // 2],
            [peer.addr + peer.nbytes // 2],
            [peer.nbytes // 2],
            tern.mooncake.TransferOpcode.Read,
        ),
    ]
    assert all(i != 0 for i in ids)
    assert engine.get_batch_transfer_status(ids) == 0
    assert np.array_equal(local, pattern(9, peer.nbytes))
    # Freed once reported: the ids are gone.
    assert engine.get_batch_transfer_status(ids) == -1
    one = engine.transfer_submit_write(peer.session, local.ctypes.data, peer.addr, 4096)
    assert one != 0
    while (code := engine.transfer_check_status(one)) == 0:
        pass
    assert code == 1
    assert engine.transfer_check_status(one) == -1
    # An empty batch is complete at once.
    empty = engine.batch_transfer_async_write(peer.session, [], [], [])
    assert empty != 0 and engine.get_batch_transfer_status([empty]) == 0
