"""The Python rows of ``cargo xtask bench``: the drop-in (``tern.mooncake``) against a
``tern-bench --mode=target`` process on loopback, with tern-bench's parameters, one thread.

``--case latency``: ``transfer_sync_read`` of 4 KiB, batch 1, timed per call;
``--case throughput``: ``batch_transfer_sync_write`` of 128 x 64 KiB (``--protocol shm``: to a
target on this host through shared memory, both sides on the engine's own memory);
``--case descriptors``: ``batch_transfer_sync_write`` of 100 000 contiguous 16 KiB descriptors
(``--block`` bytes each: at 64 bytes the bytes take little of the call),
as lists of int and as numpy ``uint64`` arrays, p50 per call (the engine merges them into a few
runs, so what grows with the count is the per-descriptor work: the binding's, and the engine's,
which tern-bench's row of the same shape measures; ``--protocol shm`` keeps the bytes' share
steady enough for the difference to show);
``--module mooncake`` runs the same case through Mooncake's own module (``mooncake.engine``) in
place of the drop-in, against the same ``tern-bench`` target, to compare the two on the same
lists and transport (lists only: Mooncake's batch calls take no arrays);
``--case idle``: the process's CPU while its engine idles, then while a thread is blocked in
``batch_transfer_sync_write`` to a stopped target until the deadline.
Prints one JSON line; with ``--paced`` (not ``idle``), ``ready`` once set up, then a JSON line
per line read from stdin, each a round measured as the first is (a warm-up call, then
``--duration`` s), until stdin closes: one process and one target serve every round, which the
caller alternates with tern-bench's runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

BUFFER = 256 << 20


def warm_up(call) -> None:
    """One call before the clock starts, as tern-bench makes one batch: the first transfer to
    a peer opens its connection or maps its memory, a cost no later call pays."""
    code = call()
    assert code == 0, f"the warm-up call returned {code}"

DESCRIPTORS, DESCRIPTOR_BYTES = 100_000, 16 << 10


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (proc(5): the state follows the name)."""
    stats = [open(f"/proc/{pid}/task/{tid}/stat").read() for tid in os.listdir(f"/proc/{pid}/task")]
    return all(stat.rsplit(") ", 1)[1][:1] in "Tt" for stat in stats)


def engine_class(module: str):
    if module == "tern":
        from tern.mooncake import TransferEngine

        return TransferEngine
    # Mooncake's engine.so links libcuda.so.1 even for host memory; lazy binding lets it load
    # where only a stub of that library is present, since the host paths never call into it.
    sys.setdlopenflags(os.RTLD_LAZY | os.RTLD_GLOBAL)
    from mooncake.engine import TransferEngine

    return TransferEngine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["latency", "throughput", "descriptors", "idle"], required=True)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--tern-bench", required=True)
    parser.add_argument("--protocol", choices=["tcp", "shm"], default="tcp")
    parser.add_argument("--module", choices=["tern", "mooncake"], default="tern")
    parser.add_argument("--chunk", type=int, default=DESCRIPTORS, help="descriptors per call in --case descriptors")
    parser.add_argument("--block", type=int, default=DESCRIPTOR_BYTES, help="bytes per descriptor in --case descriptors")
    parser.add_argument("--paced", action="store_true", help="a round per line read from stdin, until it closes")
    args = parser.parse_args()
    TransferEngine = engine_class(args.module)
    if args.case == "idle":
        # The drop-in takes at least 5 s, as Mooncake's Python layer does.
        os.environ["MC_TRANSFER_TIMEOUT"] = "5"
    buffer = DESCRIPTORS * args.block if args.case == "descriptors" else BUFFER
    target = subprocess.Popen(
        [
            args.tern_bench,
            "--mode=target",
            "--local_server_name=127.0.0.1",
            f"--buffer_size={buffer}",
            f"--protocol={args.protocol}",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        segment = target.stdout.readline().split(": ", 1)[1].strip()
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", args.protocol, "") == 0
        # The engine's own memory, as tern-bench's initiator uses (huge pages where the kernel
        # gives them, touched up front): what differs between the two is then the binding.
        base = engine.allocate_managed_buffer(buffer)
        assert base != 0
        remote = engine.get_first_buffer_address(segment)
        measure = None
        if args.case == "latency":
            def measure(result: dict) -> None:
                block, blocks = 4096, BUFFER // 4096
                latencies = []
                i = 0
                warm_up(lambda: engine.transfer_sync_read(segment, base, remote, block))
                stop = time.perf_counter() + args.duration
                while time.perf_counter() < stop:
                    offset = (i % blocks) * block
                    began = time.perf_counter_ns()
                    code = engine.transfer_sync_read(segment, base + offset, remote + offset, block)
                    latencies.append((time.perf_counter_ns() - began) / 1000)
                    assert code == 0
                    i += 1
                latencies.sort()
                result.update(calls=len(latencies), p50_latency_us=latencies[len(latencies) // 2], p99_latency_us=latencies[int(len(latencies) * 0.99)])

        elif args.case == "throughput":

            block, batch = 65536, 128
            blocks = BUFFER // block
            # Each batch's lists made before the clock, as the descriptors case does (and as
            # tern-bench builds its requests in Rust): what is timed is the call, not the
            # interpreter making 384 ints. The batches walk the buffer as tern-bench's do.
            batches = []
            for round_ in range(blocks // batch):
                offsets = [((round_ * batch + j) % blocks) * block for j in range(batch)]
                batches.append(([base + o for o in offsets], [remote + o for o in offsets], [block] * batch))

            def measure(result: dict) -> None:
                moved, round_ = 0, 0
                warm_up(lambda: engine.batch_transfer_sync_write(segment, *batches[0]))
                started = time.perf_counter()
                stop = started + args.duration
                while time.perf_counter() < stop:
                    code = engine.batch_transfer_sync_write(segment, *batches[round_ % len(batches)])
                    assert code == 0
                    moved += block * batch
                    round_ += 1
                seconds = time.perf_counter() - started
                result.update(bytes=moved, seconds=seconds, gbps=moved / seconds / 1e9)

        elif args.case == "descriptors":
            # OpenBLAS's idle threads would spin beside the engine on a small machine.
            os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
            offsets = [i * args.block for i in range(DESCRIPTORS)]
            lists = ([base + o for o in offsets], [remote + o for o in offsets], [args.block] * DESCRIPTORS)
            forms = [("lists", lists)]
            if args.module == "tern":
                import numpy as np

                forms.append(("numpy", tuple(np.array(values, dtype=np.uint64) for values in lists)))
            # Each call's arguments made before the clock: cutting a list copies it, which is
            # the caller's cost, not the binding's (one call takes the lists themselves).
            calls = {
                form: [given] if args.chunk >= DESCRIPTORS else [tuple(values[first : first + args.chunk] for values in given) for first in range(0, DESCRIPTORS, args.chunk)]
                for form, given in forms
            }

            def measure(result: dict) -> None:
                for form, _ in forms:
                    warm_up(lambda: engine.batch_transfer_sync_write(segment, *calls[form][0]))
                # Alternating, so that both forms see the same moments of the machine.
                times: dict[str, list[float]] = {form: [] for form, _ in forms}
                stop = time.perf_counter() + args.duration
                while time.perf_counter() < stop or not times[forms[-1][0]]:
                    for form, _ in forms:
                        began = time.perf_counter_ns()
                        for call in calls[form]:
                            code = engine.batch_transfer_sync_write(segment, *call)
                            assert code == 0, f"batch_transfer_sync_write of {args.chunk} descriptors returned {code}"
                        times[form].append((time.perf_counter_ns() - began) / 1000)
                for form, values in times.items():
                    values.sort()
                    result[f"p50_{form}_us"] = values[len(values) // 2]
                result.update(calls=len(times["lists"]), descriptors=DESCRIPTORS, block=args.block, per_call=args.chunk)

        else:
            result: dict = {"case": args.case, "protocol": args.protocol, "module": args.module}
            idle = min(args.duration, 5.0)
            cpu, wall = cpu_seconds(), time.monotonic()
            time.sleep(idle)
            result.update(idle_seconds=time.monotonic() - wall, idle_cpu_pct=(cpu_seconds() - cpu) / (time.monotonic() - wall) * 100)
            target.send_signal(signal.SIGSTOP)
            while not stopped(target.pid):  # delivered after kill returns, not by then
                time.sleep(0.0002)
            offsets = [j * 65536 for j in range(128)]
            cpu, wall = cpu_seconds(), time.monotonic()
            code = engine.batch_transfer_sync_write(segment, [base + o for o in offsets], [remote + o for o in offsets], [65536] * 128)
            blocked = time.monotonic() - wall
            target.send_signal(signal.SIGCONT)
            result.update(blocked_code=code, blocked_seconds=blocked, blocked_cpu_pct=(cpu_seconds() - cpu) / blocked * 100)
            print(json.dumps(result))
        if measure is not None and args.paced:
            print("ready", flush=True)
        while measure is not None and (not args.paced or sys.stdin.readline()):
            result = {"case": args.case, "protocol": args.protocol, "module": args.module}
            measure(result)
            print(json.dumps(result), flush=True)
            if not args.paced:
                break
    finally:
        target.send_signal(signal.SIGCONT)
        target.terminate()
        target.wait()


if __name__ == "__main__":
    main()
