"""Notifications: sent with a transfer (once its bytes have landed) or alone."""

from __future__ import annotations

import numpy as np

import tern
from tern.mooncake import TransferNotify, TransferOpcode


def test_a_transfer_carries_a_notification(peer, mooncake_engine):
    engine = mooncake_engine
    local = np.full(4096, 7, dtype=np.uint8)
    assert engine.register_memory(local.ctypes.data, local.nbytes) == 0
    assert engine.transfer_sync(peer.session, local.ctypes.data, peer.addr, 4096, TransferOpcode.Write, TransferNotify("req-1", "layer 0 done")) == 0
    assert engine.batch_transfer_sync(peer.session, [local.ctypes.data], [peer.addr + 4096], [4096], TransferOpcode.Write, TransferNotify("req-1", "all done")) == 0
    assert peer.ask("notifies")["notifies"] == [["req-1", "layer 0 done"], ["req-1", "all done"]]
    assert peer.ask("notifies")["notifies"] == []


def test_notifications_between_pythonic_engines(peer_factory):
    peer = peer_factory("--api", "tern")
    with tern.TransferEngine(local_server_name="127.0.0.1", protocols="tcp") as engine:
        engine.notify(peer.session, "hello", "from the test")
        assert peer.ask("notifies")["notifies"] == [["hello", "from the test"]]
    from tern.mooncake import TransferEngine

    receiver = TransferEngine()
    assert receiver.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert receiver.get_notifies() == []
    with tern.TransferEngine(local_server_name="127.0.0.1", protocols="tcp") as sender:
        sender.notify(receiver.get_local_segment_name(), "n", "m")
    assert receiver.get_notifies() == [TransferNotify("n", "m")]
