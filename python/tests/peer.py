"""A second Tern node for the tests: starts an engine, registers a numpy array (or, with
``--managed``, takes one from ``allocate_managed_buffer``), prints one
JSON line ``{"session", "addr", "nbytes"}``, then serves commands read from stdin, one per
line, answering each with one JSON line, until stdin closes:

- ``fill SEED``: fills the array with ``numpy.random.default_rng(SEED)`` bytes;
- ``sha``: the SHA-256 of the array;
- ``notifies``: the notifications received so far;
- ``stats``: the engine's statistics.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import sys

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=["mooncake", "tern"], default="mooncake")
    parser.add_argument("--name", default="127.0.0.1")
    parser.add_argument("--metadata", default="P2PHANDSHAKE")
    parser.add_argument("--protocol", default="tcp")
    parser.add_argument("--device", default="")
    parser.add_argument("--nbytes", type=int, default=1 << 20)
    parser.add_argument(
        "--managed", action="store_true", help="the array is allocate_managed_buffer memory (mooncake API)"
    )
    args = parser.parse_args()
    array = np.zeros(args.nbytes, dtype=np.uint8)
    if args.api == "mooncake":
        from tern.mooncake import TransferEngine

        engine = TransferEngine()
        if engine.initialize(args.name, args.metadata, args.protocol, args.device) != 0:
            sys.exit("initialize failed")
        if args.managed:
            addr = engine.allocate_managed_buffer(args.nbytes)
            if addr == 0:
                sys.exit("allocate_managed_buffer failed")
            array = np.ctypeslib.as_array((ctypes.c_uint8 * args.nbytes).from_address(addr))
        elif engine.register_memory(array.ctypes.data, array.nbytes) != 0:
            sys.exit("register_memory failed")
        # As SGLang and vLLM build it: the IP they passed, and the RPC port.
        session = f"{args.name}:{engine.get_rpc_port()}" if args.metadata == "P2PHANDSHAKE" else args.name
        assert session == engine.get_local_segment_name(), (session, engine.get_local_segment_name())
        notifies = lambda: [[n.name, n.msg] for n in engine.get_notifies()]  # noqa: E731
        stats = lambda: json.loads(engine.get_stats_json())  # noqa: E731
        protocols = engine.get_protocols()
    else:
        import tern

        engine = tern.TransferEngine(
            local_server_name=args.name,
            metadata=args.metadata,
            protocols=[args.protocol],
            devices=args.device,
        )
        engine.register(array)
        session = engine.segment_name
        notifies = lambda: [list(n) for n in engine.notifications()]  # noqa: E731
        stats = engine.stats
        protocols = engine.protocols
    print(
        json.dumps({"session": session, "addr": int(array.ctypes.data), "nbytes": array.nbytes, "protocols": protocols}),
        flush=True,
    )
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "fill":
            array[:] = np.random.default_rng(int(words[1])).integers(0, 256, array.nbytes, dtype=np.uint8)
            answer = {"ok": True}
        elif words[0] == "sha":
            answer = {"sha": hashlib.sha256(array.tobytes()).hexdigest()}
        elif words[0] == "notifies":
            answer = {"notifies": notifies()}
        elif words[0] == "stats":
            answer = {"stats": stats()}
        else:
            answer = {"error": f"unknown command {words[0]!r}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
