"""Two Python processes on one host with protocol "shm": the bytes move through shared memory
(the peer's ``allocate_managed_buffer`` memory through a mapping, its registered numpy array
by cross-memory attach), both ways, through the drop-in and through the Pythonic API, and
TCP carries none of them — unless the kernel refuses cross-memory attach, when TCP carries
the slices shm hands back."""

from __future__ import annotations

import json

import pytest

import tern
from conftest import LOCAL, drop_in_both_ways, pythonic_both_ways


def bytes_by_protocol(stats: dict) -> dict[str, int]:
    return {t["protocol"]: t["bytes"] for t in stats["transports"]}


def attach_allowed() -> bool:
    """Whether this process may attach to its child's memory: Yama's ``ptrace_scope`` 2 or
    3 refuses it (0, 1 and no Yama allow a parent)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as scope:
            return int(scope.read()) < 2
    except OSError:
        return True


@pytest.mark.parametrize("managed", [False, True], ids=["cross-memory-attach", "memfd"])
def test_the_drop_in_moves_same_host_bytes_over_shared_memory(peer_factory, managed):
    from tern.mooncake import TransferEngine

    peer = peer_factory("--protocol", "shm", *(["--managed"] if managed else []))
    assert "shm" in peer.protocols
    engine = TransferEngine()
    assert engine.initialize(LOCAL, "P2PHANDSHAKE", "shm", "") == 0
    assert engine.get_protocols()[0] == "shm"
    drop_in_both_ways(engine, peer, 17)
    moved = bytes_by_protocol(json.loads(engine.get_stats_json()))
    if managed or attach_allowed():
        assert moved.get("shm", 0) >= 2 * peer.nbytes and moved.get("tcp", 0) == 0, moved
    else:
        # The kernel refuses cross-memory attach: shm hands the slices to TCP.
        assert moved.get("tcp", 0) >= 2 * peer.nbytes, moved


def test_the_pythonic_api_puts_shared_memory_first(peer_factory):
    peer = peer_factory("--protocol", "shm", "--managed")
    with tern.TransferEngine(local_server_name=LOCAL, protocols=["shm", "tcp"]) as engine:
        assert engine.protocols == ["shm", "tcp"]
        pythonic_both_ways(engine, peer, 29)
        moved = bytes_by_protocol(engine.stats())
        assert moved.get("shm", 0) >= 2 * peer.nbytes and moved.get("tcp", 0) == 0, moved
