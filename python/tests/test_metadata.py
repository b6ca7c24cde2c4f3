"""Through a metadata server: tern-metadata-server (Mooncake's HTTP protocol) and etcd, with
segments named by their nodes instead of ip:port."""

from __future__ import annotations

import os

import pytest

import tern
from conftest import drop_in_both_ways, pattern, sha
from tern.mooncake import TransferEngine

LOOPBACK = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}


@pytest.fixture(autouse=True)
def loopback(monkeypatch):
    # A named node advertises its first non-loopback address unless told otherwise.
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")


def move_both_ways(engine: TransferEngine, peer) -> None:
    drop_in_both_ways(engine, peer, 4)
    assert engine.get_first_buffer_address(peer.session) == peer.addr


def test_through_tern_metadata_server(peer_factory, metadata_server):
    name = f"decode-{os.getpid()}"
    peer = peer_factory("--name", name, "--metadata", metadata_server, env=LOOPBACK)
    assert peer.session == name
    engine = TransferEngine()
    assert engine.initialize(f"prefill-{os.getpid()}", metadata_server, "tcp", "") == 0
    move_both_ways(engine, peer)


@pytest.mark.parametrize("form", ["url", "bare", "ext"])
def test_through_etcd(peer_factory, etcd, form):
    name = f"decode-{form}-{os.getpid()}"
    peer = peer_factory("--name", name, "--metadata", f"etcd://{etcd}", env=LOOPBACK)
    engine = TransferEngine()
    me = f"prefill-{form}-{os.getpid()}"
    if form == "url":
        assert engine.initialize(me, f"etcd://{etcd}", "tcp", "") == 0
    elif form == "bare":
        assert engine.initialize(me, etcd, "rdma", "") == 0  # a bare host:port means etcd
    else:
        assert engine.initialize_ext(me, etcd, "tcp", "", "etcd") == 0
    move_both_ways(engine, peer)


def test_pythonic_engine_through_etcd(peer_factory, etcd):
    name = f"pythonic-peer-{os.getpid()}"
    peer = peer_factory("--api", "tern", "--name", name, "--metadata", f"etcd://{etcd}", env=LOOPBACK)
    with tern.TransferEngine(local_server_name=f"pythonic-{os.getpid()}", metadata=f"etcd://{etcd}", protocols="tcp") as engine:
        buffer = engine.allocate(peer.nbytes)
        buffer.view()[:] = pattern(12, peer.nbytes).tobytes()
        engine.write(buffer, name, peer.addr)
        assert peer.ask("sha")["sha"] == sha(pattern(12, peer.nbytes))
