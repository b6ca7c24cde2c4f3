"""The drop-in's copies by address pin their region: an unregister from another thread waits
for (or is refused during) a copy, and no copy touches memory once it is unregistered."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RACE = Path(__file__).resolve().parent / "copy_race.py"
ROUNDS = 8


@pytest.mark.parametrize("mode", ["write", "read"])
def test_no_copy_runs_into_memory_unregistered_and_unmapped_from_another_thread(mode):
    # In a process of its own: a copy into unmapped memory is a SIGSEGV, which must fail this
    # test rather than end the test run.
    result = subprocess.run(
        [sys.executable, str(RACE), mode, str(ROUNDS)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, (
        f"copy_race.py {mode} ended with {result.returncode} "
        f"(-11: a copy went on into memory unregistered and unmapped under it)\n{result.stderr[-4000:]}"
    )
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["copies"] >= ROUNDS, outcome
