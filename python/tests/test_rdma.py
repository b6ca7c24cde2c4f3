"""Two Python processes over RDMA on Soft-RoCE (rxe0), inside the guest that
``cargo xtask test`` boots: a drop-in target and a Pythonic initiator that installs RDMA
only, so the bytes cannot have gone over TCP."""

from __future__ import annotations

import os

import pytest

import tern
from conftest import pythonic_both_ways

DEVICE = os.environ.get("TERN_RXE")
ADDRESS = os.environ.get("TERN_RXE_ADDR", "10.77.0.1")

pytestmark = pytest.mark.skipif(not DEVICE, reason="needs the Soft-RoCE guest (cargo xtask test runs it there)")


def test_numpy_array_both_ways_over_rdma(peer_factory):
    peer = peer_factory("--protocol", "rdma", "--device", DEVICE, "--name", ADDRESS, "--nbytes", str(4 << 20))
    assert peer.protocols == ["rdma"]
    with tern.TransferEngine(local_server_name=ADDRESS, protocols=["rdma"], devices=[DEVICE]) as engine:
        assert engine.protocols == ["rdma"]
        pythonic_both_ways(engine, peer, 13)
        rdma = engine.stats()["transports"][0]
        assert rdma["protocol"] == "rdma" and rdma["bytes"] >= 2 * peer.nbytes
    assert peer.ask("stats")["stats"]["transports"][0]["protocol"] == "rdma"
