"""What the tests share: a second node in its own process (``peer.py``), a ``tern-bench``
target, a ``tern-metadata-server``, and the tests' etcd.

``cargo xtask test`` sets ``TERN_BENCH_BIN``, ``TERN_METADATA_SERVER_BIN``, ``TERN_TEST_ETCD``
and ``TERN_WHEEL_VARIANT`` (``default`` or ``tcp-only``). Every socket is on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
PEER = HERE / "peer.py"
LOCAL = "127.0.0.1"


def pattern(seed: int, nbytes: int) -> np.ndarray:
    """The bytes ``peer.py fill SEED`` writes."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def sha(array: np.ndarray) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()


def drop_in_both_ways(engine, peer, seed: int) -> None:
    """With the drop-in ``engine``: writes ``seed``'s bytes over the whole of the peer's array
    and checks them there, then reads back what the peer fills in with ``seed + 1``."""
    local = pattern(seed, peer.nbytes)
    assert engine.register_memory(local.ctypes.data, local.nbytes) == 0
    assert engine.transfer_sync_write(peer.session, local.ctypes.data, peer.addr, local.nbytes) == 0
    assert peer.ask("sha")["sha"] == sha(local)
    peer.ask(f"fill {seed + 1}")
    assert engine.transfer_sync_read(peer.session, local.ctypes.data, peer.addr, local.nbytes) == 0
    assert np.array_equal(local, pattern(seed + 1, peer.nbytes))
    assert engine.unregister_memory(local.ctypes.data) == 0


def pythonic_both_ways(engine, peer, seed: int) -> None:
    """The same with a ``tern.TransferEngine``."""
    local = pattern(seed, peer.nbytes)
    engine.register(local)
    engine.write(local, peer.session, peer.addr)
    assert peer.ask("sha")["sha"] == sha(local)
    peer.ask(f"fill {seed + 1}")
    engine.read(local, peer.session, peer.addr)
    assert np.array_equal(local, pattern(seed + 1, peer.nbytes))


def stop_process(proc: subprocess.Popen, stop) -> None:
    """Asks a process to stop with ``stop(proc)``, and kills it if it has not in 20 s."""
    if proc.poll() is None:
        stop(proc)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pause_process(proc: subprocess.Popen) -> None:
    """Stops ``proc`` with SIGSTOP and returns once every thread of it is stopped: a signal
    is delivered after ``kill`` returns, and on a loaded machine a peer can serve a whole
    transfer in between."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while not all_threads_stopped(proc.pid):
        assert time.monotonic() < deadline, f"process {proc.pid} did not stop in 60 s"
        time.sleep(0.0002)


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (``T``, or ``t`` under a tracer), per
    proc(5): the state follows the parenthesised command name in ``/proc/PID/task/TID/stat``."""
    states = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            states.append((task / "stat").read_text().rsplit(") ", 1)[1][:1])
        except (OSError, IndexError):
            pass
    return bool(states) and all(state in "Tt" for state in states)


class Peer:
    """A ``peer.py`` process; its stdin closing ends it."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise RuntimeError(f"peer did not start: {self.proc.stderr.read()}")
        info = json.loads(line)
        self.session: str = info["session"]
        self.addr: int = info["addr"]
        self.nbytes: int = info["nbytes"]
        self.protocols: list = info["protocols"]

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer died: {self.proc.stderr.read()}")
        return json.loads(line)

    def stop(self) -> None:
        stop_process(self.proc, lambda proc: proc.stdin.close())

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def peer_factory():
    peers: list[Peer] = []

    def start(*args: str, env: dict | None = None) -> Peer:
        peer = Peer(*args, env=env)
        peers.append(peer)
        return peer

    yield start
    for peer in peers:
        peer.stop()


@pytest.fixture
def peer(peer_factory) -> Peer:
    return peer_factory()


def binary(variable: str, name: str) -> str:
    path = os.environ.get(variable) or shutil.which(name)
    if not path:
        pytest.skip(f"{variable} is not set (cargo xtask test sets it)")
    return path


class BenchTarget:
    """``tern-bench --mode=target`` on loopback: its buffer holds tern-bench's pattern."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.proc = subprocess.Popen(
            [binary("TERN_BENCH_BIN", "tern-bench"), "--mode=target", "--local_server_name=127.0.0.1", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        line = self.proc.stdout.readline()
        if not line.startswith("segment: "):
            self.proc.kill()
            raise RuntimeError(f"tern-bench target did not start: {line!r} {self.proc.stderr.read()}")
        self.segment = line.split(": ", 1)[1].strip()

    def pause(self) -> None:
        """Stops the target (SIGSTOP); returns once it serves nothing more."""
        pause_process(self.proc)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        def resume_and_terminate(proc: subprocess.Popen) -> None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()

        stop_process(self.proc, resume_and_terminate)


@pytest.fixture
def bench_target():
    targets: list[BenchTarget] = []

    def start(*args: str, env: dict | None = None) -> BenchTarget:
        target = BenchTarget(*args, env=env)
        targets.append(target)
        return target

    yield start
    for target in targets:
        target.stop()


def expected_byte(offsets: np.ndarray) -> np.ndarray:
    """tern-bench's pattern at byte offsets (``expected_byte`` in bench/src/workload.rs)."""
    offsets = offsets.astype(np.uint64)
    x = (offsets // np.uint64(8)) * np.uint64(0x9E3779B97F4A7C15) ^ (offsets % np.uint64(8))
    return ((x >> np.uint64(56)).astype(np.uint8)) ^ (offsets.astype(np.uint8))


@pytest.fixture
def metadata_server():
    """A tern-metadata-server on a free loopback port: its ``http://.../metadata`` URL."""
    proc = subprocess.Popen(
        [binary("TERN_METADATA_SERVER_BIN", "tern-metadata-server"), "--bind", LOCAL, "--port", "0"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().strip()
    assert line.startswith("serving http://"), line
    yield line.split(" ", 1)[1]
    proc.terminate()
    proc.wait(timeout=20)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCAL, 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def etcd():
    """``host:port`` of the tests' etcd, or of one started here."""
    endpoint = os.environ.get("TERN_TEST_ETCD")
    if endpoint:
        yield endpoint
        return
    exe = shutil.which("etcd")
    if not exe:
        pytest.skip("no etcd (cargo xtask test provides one)")
    client, peer_port = free_port(), free_port()
    data = tempfile.mkdtemp(prefix="tern-etcd-")
    proc = subprocess.Popen(
        [
            exe,
            f"--data-dir={data}",
            f"--listen-client-urls=http://{LOCAL}:{client}",
            f"--advertise-client-urls=http://{LOCAL}:{client}",
            f"--listen-peer-urls=http://{LOCAL}:{peer_port}",
            f"--initial-advertise-peer-urls=http://{LOCAL}:{peer_port}",
            f"--initial-cluster=default=http://{LOCAL}:{peer_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection((LOCAL, client), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    yield f"{LOCAL}:{client}"
    proc.terminate()
    proc.wait(timeout=20)
    shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def mooncake_engine():
    """An initialized drop-in engine (TCP, P2P) on loopback."""
    from tern.mooncake import TransferEngine

    engine = TransferEngine()
    assert engine.initialize(LOCAL, "P2PHANDSHAKE", "tcp", "") == 0
    yield engine


def variant() -> str:
    return os.environ.get("TERN_WHEEL_VARIANT", "default")
