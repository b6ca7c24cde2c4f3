"""The wheel: what it links, what it says without libibverbs, and its type information."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tern
from conftest import variant


def needed_libraries() -> list[str]:
    readelf = shutil.which("readelf")
    if not readelf:
        pytest.skip("no readelf")
    out = subprocess.run([readelf, "-d", tern._tern.__file__], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def test_the_extension_links_libibverbs_only_in_the_default_wheel():
    needed = needed_libraries()
    assert any(lib.startswith("libc.so") for lib in needed)
    has_verbs = any(lib.startswith("libibverbs") for lib in needed)
    if variant() == "tcp-only":
        assert not has_verbs, needed
        assert tern.RDMA_BUILT is False
    else:
        assert has_verbs, needed
        assert tern.RDMA_BUILT is True


def libibverbs_path() -> str:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.strip().startswith("libibverbs.so.1 ") and "=>" in line:
            return line.split("=>", 1)[1].strip()
    pytest.skip("libibverbs is not installed here")


def without_libibverbs(code: str) -> subprocess.CompletedProcess:
    """Runs ``python -c code`` in a mount namespace where libibverbs cannot be loaded."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("hiding libibverbs needs root and unshare(1)")
    lib = os.path.realpath(libibverbs_path())
    script = f"mount --bind /dev/null '{lib}' && exec '{sys.executable}' -c \"$0\""
    return subprocess.run(["unshare", "-m", "sh", "-c", script, code], capture_output=True, text=True, cwd="/")


def test_without_libibverbs():
    code = (
        "from tern.mooncake import TransferEngine\n"
        "e = TransferEngine()\n"
        "assert e.initialize('127.0.0.1', 'P2PHANDSHAKE', 'rdma', '') == 0\n"
        "print('imported', e.get_protocols())\n"
    )
    result = without_libibverbs(code)
    if variant() == "tcp-only":
        assert result.returncode == 0, result.stderr
        assert "imported ['tcp']" in result.stdout
    else:
        assert result.returncode != 0
        assert "ImportError" in result.stderr
        assert "apt-get install libibverbs1" in result.stderr, result.stderr


def test_type_information_ships():
    package = Path(tern.__file__).parent
    for name in ["py.typed", "mooncake.pyi", "_tern.pyi"]:
        assert (package / name).is_file(), name
