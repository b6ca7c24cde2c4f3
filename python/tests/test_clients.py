"""The drop-in driven the way SGLang and vLLM drive ``mooncake.engine.TransferEngine``: one
engine per process, ``initialize(ip, "P2PHANDSHAKE", "rdma", "")`` (TCP where there is no
RDMA device), session ids ``f"{ip}:{get_rpc_port()}"``, KV caches registered in one
``batch_register_memory``, per-layer ``batch_transfer_sync_write`` from a thread pool, the
weight loader's ``batch_transfer_sync_read``, and a failed session recovered through
``send_probe`` once the peer is back."""

from __future__ import annotations

import concurrent.futures

import numpy as np

from conftest import LOCAL, pattern, sha
from tern.mooncake import TransferEngine

LAYERS = 8
LAYER_BYTES = 64 << 10


def prefill_engine() -> tuple[TransferEngine, str]:
    engine = TransferEngine()
    # vLLM: kv_connector_extra_config's mooncake_protocol defaults to "rdma"; device "".
    assert engine.initialize(LOCAL, "P2PHANDSHAKE", "rdma", "") == 0
    session = f"{LOCAL}:{engine.get_rpc_port()}"
    int(session.rsplit(":", 1)[1])  # SGLang shards work by the session's port
    return engine, session


def test_pd_disaggregation_push_from_a_thread_pool(peer_factory):
    decode = peer_factory("--protocol", "rdma", "--nbytes", str(LAYERS * LAYER_BYTES))
    engine, _ = prefill_engine()
    kv = [np.random.default_rng(layer).integers(0, 256, LAYER_BYTES, dtype=np.uint8) for layer in range(LAYERS)]
    ptrs = [layer.ctypes.data for layer in kv]
    assert engine.batch_register_memory(ptrs, [LAYER_BYTES] * LAYERS) == 0

    def send_layer(layer: int) -> int:
        # Chunks of 4 KiB pages, as the connectors coalesce blocks.
        pages = LAYER_BYTES // 4096
        src = [ptrs[layer] + 4096 * p for p in range(pages)]
        dst = [decode.addr + layer * LAYER_BYTES + 4096 * p for p in range(pages)]
        return engine.batch_transfer_sync_write(decode.session, src, dst, [4096] * pages)

    with concurrent.futures.ThreadPoolExecutor(max_workers=10) as pool:
        results = list(pool.map(send_layer, range(LAYERS)))
    assert results == [0] * LAYERS
    assert decode.ask("sha")["sha"] == sha(np.concatenate(kv))
    # The weight loader reads from the seed instance.
    decode.ask("fill 42")
    assert engine.batch_transfer_sync_read(decode.session, ptrs, [decode.addr + i * LAYER_BYTES for i in range(LAYERS)], [LAYER_BYTES] * LAYERS) == 0
    assert np.array_equal(np.concatenate(kv), pattern(42, LAYERS * LAYER_BYTES))
    assert engine.batch_unregister_memory(ptrs) == 0


def test_a_failed_session_recovers_through_send_probe(peer_factory, monkeypatch):
    first = peer_factory("--protocol", "rdma")
    port = int(first.session.rsplit(":", 1)[1])
    engine, _ = prefill_engine()
    local = np.random.default_rng(1).integers(0, 256, first.nbytes, dtype=np.uint8)
    assert engine.register_memory(local.ctypes.data, local.nbytes) == 0
    assert engine.transfer_sync_write(first.session, local.ctypes.data, first.addr, local.nbytes) == 0
    assert engine.send_probe(first.session) == 0
    first.kill()
    # The decode instance died: the transfer fails, and so does the probe.
    assert engine.transfer_sync_write(first.session, local.ctypes.data, first.addr, local.nbytes) != 0
    assert engine.send_probe(first.session) != 0
    # It restarts on the same port (new buffers, new data port): the next probe and transfer
    # handshake again and succeed.
    second = peer_factory("--protocol", "rdma", env={"MC_MIN_RPC_PORT": str(port), "MC_MAX_RPC_PORT": str(port)})
    assert second.session == first.session
    assert engine.send_probe(second.session) == 0
    assert engine.transfer_sync_write(second.session, local.ctypes.data, second.addr, local.nbytes) == 0
    assert second.ask("sha")["sha"] == sha(local)
    assert engine.get_first_buffer_address(second.session) == second.addr


def test_encoder_cache_connector_registers_and_unregisters(peer):
    engine, _ = prefill_engine()
    tensors = [np.full(8192, i, dtype=np.uint8) for i in range(3)]
    for tensor in tensors:
        assert engine.batch_register_memory([tensor.ctypes.data], [tensor.nbytes]) == 0
    srcs = [t.ctypes.data for t in tensors]
    dsts = [peer.addr + i * 8192 for i in range(3)]
    assert engine.batch_transfer_sync_write(peer.session, srcs, dsts, [8192] * 3) == 0
    assert engine.unregister_memory(srcs[0]) == 0
    assert engine.batch_unregister_memory(srcs[1:]) == 0
    # Unregistered memory no longer moves.
    assert engine.batch_transfer_sync_write(peer.session, srcs, dsts, [8192] * 3) != 0
