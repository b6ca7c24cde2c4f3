"""Run by ``test_copy_pins.py`` in a process of its own: ``copy_race.py write|read ROUNDS``.

Each round maps fresh anonymous memory, registers it with the drop-in, and starts a thread
that copies into it (``write_bytes_to_buffer``) or out of it (``read_bytes_from_buffer``) in a
loop, the whole buffer each time, until a copy is refused. Meanwhile this thread unregisters
the memory (retrying while it is refused) and unmaps it the moment the unregister succeeds. A
copy still running after a successful unregister touches unmapped memory and kills this process
with SIGSEGV. Prints one JSON line: the copies made and the unregisters refused.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import sys
import threading

from tern.mooncake import TransferEngine

NBYTES = 64 << 20

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.restype = ctypes.c_int
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FAILED = ctypes.c_void_p(-1).value


def main() -> None:
    mode, rounds = sys.argv[1], int(sys.argv[2])
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    data = bytes(range(256)) * (NBYTES // 256)
    copies = refused = 0
    for _ in range(rounds):
        addr = libc.mmap(
            None, NBYTES, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
        )
        assert addr not in (None, MAP_FAILED), ctypes.get_errno()
        assert engine.register_memory(addr, NBYTES) == 0
        copying = threading.Event()
        made: list[int] = []

        def copier() -> None:
            n = 0
            while True:
                if mode == "write":
                    if engine.write_bytes_to_buffer(addr, data, NBYTES) != 0:
                        break
                else:
                    try:
                        engine.read_bytes_from_buffer(addr, NBYTES)
                    except ValueError:
                        break
                n += 1
                copying.set()
            made.append(n)

        thread = threading.Thread(target=copier)
        thread.start()
        # Once one copy has been made, the copier is in its loop: from here on it is inside
        # a copy (the GIL released) nearly all the time.
        assert copying.wait(timeout=300), "no copy succeeded"
        while engine.unregister_memory(addr) != 0:
            refused += 1
        assert libc.munmap(addr, NBYTES) == 0, ctypes.get_errno()
        thread.join()
        copies += made[0]
    print(json.dumps({"copies": copies, "refused": refused}), flush=True)


if __name__ == "__main__":
    main()
