"""CUDA tensors of PyTorch through both Python APIs, on a real GPU: the GPU bundle's
``run.sh`` runs this file under PyTorch's default allocator and again with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (VMM memory, which has no CUDA IPC
handle). Skipped where PyTorch or a GPU is missing (every CI run: the stand-in driver's tests
are ``test_cuda.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import tern  # noqa: E402
from tern.mooncake import TransferEngine  # noqa: E402

LOCAL = "127.0.0.1"
NBYTES = (64 << 20) + 4096


def engines(protocol: str) -> tuple[TransferEngine, TransferEngine]:
    pair = TransferEngine(), TransferEngine()
    for engine in pair:
        assert engine.initialize(LOCAL, "P2PHANDSHAKE", protocol, "") == 0
    return pair


def tensor(seed: int) -> "torch.Tensor":
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, device="cuda", generator=generator)


def stats(engine: TransferEngine) -> dict:
    return json.loads(engine.get_stats_json())


def transport(engine: TransferEngine, protocol: str) -> dict:
    return next(t for t in stats(engine)["transports"] if t["protocol"] == protocol)


def test_the_drop_in_moves_cuda_tensors_over_tcp_both_ways():
    initiator, target = engines("tcp")
    source, landing, remote = tensor(1), torch.zeros(NBYTES, dtype=torch.uint8, device="cuda"), torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
    assert initiator.batch_register_memory([source.data_ptr(), landing.data_ptr()], [NBYTES, NBYTES]) == 0
    assert target.register_memory(remote.data_ptr(), NBYTES) == 0
    session = f"{LOCAL}:{target.get_rpc_port()}"
    assert initiator.transfer_sync_write(session, source.data_ptr(), remote.data_ptr(), NBYTES) == 0
    torch.cuda.synchronize()
    assert torch.equal(remote, source)
    assert initiator.transfer_sync_read(session, landing.data_ptr(), remote.data_ptr(), NBYTES) == 0
    assert torch.equal(landing, source)
    assert initiator.read_bytes_from_buffer(source.data_ptr(), 4096) == bytes(source[:4096].cpu().numpy())


def test_the_pythonic_api_registers_a_cuda_tensor_by_its_storage():
    memory = tensor(2)
    with tern.TransferEngine(local_server_name=LOCAL, protocols=["tcp"]) as engine:
        region = engine.register(memory)
        listed = {addr: location for addr, _, location, _ in engine.regions}
        assert listed[region.addr] == f"cuda:{memory.device.index}"
        engine.unregister(region)


OWNER = textwrap.dedent(
    """
    import sys, torch
    from tern.mooncake import TransferEngine
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "shm", "") == 0
    memory = torch.zeros(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
    assert engine.register_memory(memory.data_ptr(), memory.numel()) == 0
    print(f"owner 127.0.0.1:{engine.get_rpc_port()} {memory.data_ptr()}", flush=True)
    for line in sys.stdin:
        if line.strip() == "sum":
            torch.cuda.synchronize()
            print(f"sum {int(memory.to(torch.int64).sum())}", flush=True)
    """
)


def test_same_host_processes_move_cuda_tensors_with_the_gpu():
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(NBYTES)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    try:
        line = owner.stdout.readline().split()
        assert line and line[0] == "owner", line
        session, remote = line[1], int(line[2])
        initiator = TransferEngine()
        assert initiator.initialize(LOCAL, "P2PHANDSHAKE", "shm", "") == 0
        source = tensor(3)
        back = torch.zeros_like(source)
        assert initiator.batch_register_memory([source.data_ptr(), back.data_ptr()], [NBYTES, NBYTES]) == 0
        assert initiator.transfer_sync_write(session, source.data_ptr(), remote, NBYTES) == 0
        owner.stdin.write("sum\n")
        owner.stdin.flush()
        assert owner.stdout.readline().split() == ["sum", str(int(source.to(torch.int64).sum()))]
        assert initiator.transfer_sync_read(session, back.data_ptr(), remote, NBYTES) == 0
        assert torch.equal(back, source)
        shm = transport(initiator, "shm")
        # The GPU carried it all: nothing declined to TCP (under expandable_segments too).
        assert shm["bytes"] == 2 * NBYTES, shm
        assert not shm.get("declined"), shm
    finally:
        owner.kill()
        owner.wait()


def test_transfers_on_the_current_stream_keep_its_order():
    initiator, target = engines("tcp")
    source, remote = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda"), torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
    assert initiator.register_memory(source.data_ptr(), NBYTES) == 0
    assert target.register_memory(remote.data_ptr(), NBYTES) == 0
    session = f"{LOCAL}:{target.get_rpc_port()}"
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        # The kernel before the write fills the source; the write must see its bytes.
        torch.cuda._sleep(50_000_000)
        source.fill_(7)
        handle = initiator.transfer_write_on_cuda(session, source.data_ptr(), remote.data_ptr(), NBYTES, stream.cuda_stream)
        # Work after the write runs only once it is over.
        after = torch.cuda.Event()
        after.record(stream)
    after.synchronize()
    assert handle.done()
    assert handle.wait(0) == NBYTES
    assert torch.equal(remote, source)
    failing = initiator.transfer_write_on_cuda(session, source.data_ptr(), remote.data_ptr() + NBYTES - 8, 64, stream.cuda_stream)
    with pytest.raises(tern.TransferError):
        failing.wait(60)
    stream.synchronize()


def test_a_transfer_that_names_no_stream_comes_after_the_default_streams_kernels():
    # PyTorch's default stream is the legacy stream: kernels queued there (a long sleep, then
    # a fill) come before a write that names no stream, though the caller never synchronized.
    initiator, target = engines("tcp")
    source, remote = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda"), torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    assert initiator.register_memory(source.data_ptr(), NBYTES) == 0
    assert target.register_memory(remote.data_ptr(), NBYTES) == 0
    session = f"{LOCAL}:{target.get_rpc_port()}"
    torch.cuda._sleep(100_000_000)
    source.fill_(9)
    assert initiator.transfer_sync_write(session, source.data_ptr(), remote.data_ptr(), NBYTES) == 0
    torch.cuda.synchronize()
    assert int(remote.min()) == 9 and int(remote.max()) == 9
    # And a read lands after a kernel queued before it that writes its destination.
    landing = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
    assert initiator.register_memory(landing.data_ptr(), NBYTES) == 0
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    landing.fill_(3)
    assert initiator.transfer_sync_read(session, landing.data_ptr(), remote.data_ptr(), NBYTES) == 0
    torch.cuda.synchronize()
    assert int(landing.min()) == 9 and int(landing.max()) == 9


ON_STREAM_0 = textwrap.dedent(
    """
    import sys, torch
    from tern.mooncake import TransferEngine
    nbytes = int(sys.argv[1])
    initiator, target = TransferEngine(), TransferEngine()
    for engine in (initiator, target):
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "shm", "") == 0
    source = torch.full((nbytes,), 5, dtype=torch.uint8, device="cuda")
    remote = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    assert initiator.register_memory(source.data_ptr(), nbytes) == 0
    assert target.register_memory(remote.data_ptr(), nbytes) == 0
    session = f"127.0.0.1:{target.get_rpc_port()}"
    handle = initiator.transfer_write_on_cuda(session, source.data_ptr(), remote.data_ptr(), nbytes, 0)
    assert handle.wait(20) == nbytes
    torch.cuda.synchronize()
    assert int(remote.min()) == 5
    print("done", flush=True)
    """
)


def test_a_transfer_on_stream_0_over_the_same_host_transport_ends():
    # In a process of its own: a hang would otherwise outlive the test.
    done = subprocess.run(
        [sys.executable, "-c", ON_STREAM_0, str(NBYTES)],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ.copy(),
    )
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-2000:]
