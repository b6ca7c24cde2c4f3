"""GPU figures, each beside its baseline measured in the same run, for the GPU bundle.

- TCP, two processes on loopback, 1 MiB blocks in batches of 128: device → device against
  host → host (staging hidden behind the wire when the ratio is near 1).
- Same host, two processes, one GPU: device → device at 1 MiB and 64 MiB blocks against a
  device-to-device copy in one process (torch ``copy_``, which is ``cuMemcpyDtoD``).
- Registration of 1 GiB of device memory, and the cost per call of the drop-in's
  ``register_memory`` on device memory.

Prints one line per figure; exits non-zero when a transfer fails. Needs PyTorch and a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import torch

from tern.mooncake import TransferEngine

LOCAL = "127.0.0.1"
TOTAL = 1 << 30

TARGET = textwrap.dedent(
    """
    import sys, torch
    from tern.mooncake import TransferEngine
    protocol, nbytes, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0
    memory = torch.empty(nbytes, dtype=torch.uint8, device=where, pin_memory=False)
    assert engine.register_memory(memory.data_ptr(), nbytes) == 0
    print(f"target 127.0.0.1:{engine.get_rpc_port()} {memory.data_ptr()}", flush=True)
    sys.stdin.read()
    """
)


def target(protocol: str, nbytes: int, where: str) -> tuple[subprocess.Popen, str, int]:
    child = subprocess.Popen(
        [sys.executable, "-c", TARGET, protocol, str(nbytes), where],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    words = child.stdout.readline().split()
    if not words or words[0] != "target":
        child.kill()
        raise SystemExit(f"the target did not start: {words}")
    return child, words[1], int(words[2])


def write_rate(protocol: str, where: str, block: int, batch: int, rounds: int) -> float:
    nbytes = block * batch
    child, session, remote = target(protocol, nbytes, where)
    try:
        engine = TransferEngine()
        assert engine.initialize(LOCAL, "P2PHANDSHAKE", protocol, "") == 0
        local = torch.ones(nbytes, dtype=torch.uint8, device=where)
        assert engine.register_memory(local.data_ptr(), nbytes) == 0
        sources = [local.data_ptr() + i * block for i in range(batch)]
        targets = [remote + i * block for i in range(batch)]
        lengths = [block] * batch
        assert engine.batch_transfer_sync_write(session, sources, targets, lengths) == 0
        start = time.perf_counter()
        for _ in range(rounds):
            if engine.batch_transfer_sync_write(session, sources, targets, lengths) != 0:
                raise SystemExit(f"a {protocol} write from {where} failed")
        return nbytes * rounds / (time.perf_counter() - start) / 1e9
    finally:
        child.kill()
        child.wait()


def copy_rate(block: int, rounds: int) -> float:
    source = torch.ones(block, dtype=torch.uint8, device="cuda")
    landing = torch.empty_like(source)
    landing.copy_(source)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(rounds):
        landing.copy_(source)
    torch.cuda.synchronize()
    return block * rounds / (time.perf_counter() - start) / 1e9


def registration() -> tuple[float, float]:
    engine = TransferEngine()
    assert engine.initialize(LOCAL, "P2PHANDSHAKE", "tcp", "") == 0
    big = torch.empty(TOTAL, dtype=torch.uint8, device="cuda")
    start = time.perf_counter()
    assert engine.register_memory(big.data_ptr(), TOTAL) == 0
    whole = time.perf_counter() - start
    assert engine.unregister_memory(big.data_ptr()) == 0
    small = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(64)]
    start = time.perf_counter()
    for t in small:
        assert engine.register_memory(t.data_ptr(), 1 << 20) == 0
    per_call = (time.perf_counter() - start) / len(small)
    return whole, per_call


def main() -> None:
    allocator = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default")
    tcp_host = write_rate("tcp", "cpu", 1 << 20, 128, 4)
    device = write_rate("tcp", "cuda", 1 << 20, 128, 4)
    print(f"tcp 1 MiB x128 device->device {device:.2f} GB/s, host->host {tcp_host:.2f} GB/s: ratio {device / tcp_host:.2f} (goal >= 0.9)")
    for block, batch in ((1 << 20, 128), (64 << 20, 4)):
        shm = write_rate("shm", "cuda", block, batch, 8)
        base = copy_rate(block, 64)
        print(f"same-host {block >> 20} MiB device->device {shm:.2f} GB/s, in-process copy {base:.2f} GB/s: ratio {shm / base:.2f} (goal >= 0.8; allocator {allocator})")
    whole, per_call = registration()
    print(f"registration of 1 GiB of device memory {whole * 1e3:.1f} ms; register_memory on device memory {per_call * 1e6:.0f} us per call")


if __name__ == "__main__":
    main()
