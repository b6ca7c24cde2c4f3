"""Batches given as arrays: the Pythonic ``submit_arrays``/``write_arrays``/``read_arrays`` and
the drop-in's batch calls with numpy arrays, ``array('Q')`` or lists, read in place; the
bytes land where each descriptor says, and a wrong dtype, shape or length is a typed error."""

from __future__ import annotations

import array
import logging

import numpy as np
import pytest

import tern
from conftest import pattern, sha

BLOCK = 4096


def shuffled_blocks(nbytes: int, seed: int) -> np.ndarray:
    """Every block offset of ``nbytes`` once, in a shuffled order: nothing merges by accident."""
    return np.random.default_rng(seed).permutation(nbytes // BLOCK).astype(np.uint64) * np.uint64(BLOCK)


@pytest.fixture
def engine():
    with tern.TransferEngine(local_server_name="127.0.0.1", protocols=["tcp"]) as engine:
        yield engine


def test_arrays_move_every_descriptor_to_its_place(engine, peer):
    local = pattern(11, peer.nbytes)
    engine.register(local)
    base = np.uint64(local.ctypes.data)
    offsets = shuffled_blocks(peer.nbytes, 1)
    # Remote addresses as a strided column of a 2-D array: read in place, not copied first.
    remote = np.zeros((offsets.size, 3), dtype=np.uint64)
    remote[:, 1] = np.uint64(peer.addr) + offsets
    engine.write_arrays(peer.session, base + offsets, remote[:, 1], np.full(offsets.size, BLOCK, dtype=np.uint64))
    assert peer.ask("sha")["sha"] == sha(local)

    peer.ask("fill 12")
    local[:] = 0
    # A local block i receives remote block perm[i]: the bytes must follow their descriptor.
    perm = shuffled_blocks(peer.nbytes, 2)
    lengths = array.array("Q", [BLOCK] * offsets.size)
    batch = engine.submit_arrays(engine.segment(peer.session), base + offsets, np.uint64(peer.addr) + perm, lengths, write=False)
    assert batch.wait(30.0) is True and len(batch) == offsets.size
    expected = pattern(12, peer.nbytes)
    for i in (0, 1, offsets.size // 2, offsets.size - 1):
        got = local[int(offsets[i]) : int(offsets[i]) + BLOCK]
        assert np.array_equal(got, expected[int(perm[i]) : int(perm[i]) + BLOCK])
    engine.read_arrays(peer.session, [int(base)], [peer.addr], [peer.nbytes])
    assert np.array_equal(local, expected)


def test_wrong_arrays_raise_typed_errors(engine, peer):
    local = np.zeros(1 << 16, dtype=np.uint8)
    engine.register(local)
    addrs = np.array([local.ctypes.data], dtype=np.uint64)
    remote = np.array([peer.addr], dtype=np.uint64)
    one = np.array([64], dtype=np.uint64)
    for wrong in (addrs.astype(np.int64), addrs.astype(np.float64), addrs.astype(">u8"), addrs.astype(np.uint32), b"12345678"):
        with pytest.raises(TypeError, match="uint64"):
            engine.write_arrays(peer.session, wrong, remote, one)
    with pytest.raises(TypeError):
        engine.write_arrays(peer.session, addrs, remote, "64")
    with pytest.raises(TypeError):
        engine.write_arrays(peer.session, addrs, remote, 64)
    with pytest.raises(tern.InvalidArgument, match="one-dimensional"):
        engine.write_arrays(peer.session, addrs.reshape(1, 1), remote, one)
    with pytest.raises(tern.InvalidArgument, match="different lengths"):
        engine.write_arrays(peer.session, addrs, np.concatenate([remote, remote]), one)
    with pytest.raises(tern.InvalidArgument, match="no requests"):
        engine.write_arrays(peer.session, addrs[:0], remote[:0], one[:0])
    with pytest.raises(OverflowError):
        engine.write_arrays(peer.session, [local.ctypes.data], [-1], [64])
    with pytest.raises(tern.AddressNotRegistered):
        engine.write_arrays(peer.session, addrs + np.uint64(local.nbytes), remote, one)
    with pytest.raises(tern.TargetOutOfRange) as error:
        engine.write_arrays(peer.session, np.repeat(addrs, 2), np.array([peer.addr, peer.addr + peer.nbytes], dtype=np.uint64), np.repeat(one, 2))
    assert error.value.task == 1
    engine.write_arrays(peer.session, addrs, remote, one)  # the engine goes on


def test_the_drop_in_takes_arrays_and_lists_alike(mooncake_engine, peer, caplog):
    engine = mooncake_engine
    local = pattern(21, peer.nbytes)
    assert engine.register_memory(local.ctypes.data, local.nbytes) == 0
    offsets = shuffled_blocks(peer.nbytes, 3)
    half = offsets.size // 2
    ours = np.uint64(local.ctypes.data) + offsets
    theirs = np.uint64(peer.addr) + offsets
    # Half as numpy arrays, half as array('Q') and a list.
    assert engine.batch_transfer_sync_write(peer.session, ours[:half], theirs[:half], np.full(half, BLOCK, dtype=np.uint64)) == 0
    rest = offsets.size - half
    assert engine.batch_transfer_sync_write(peer.session, array.array("Q", ours[half:].tolist()), theirs[half:].tolist(), [BLOCK] * rest) == 0
    assert peer.ask("sha")["sha"] == sha(local)
    peer.ask("fill 22")
    batch = engine.batch_transfer_async_read(peer.session, ours, tuple(theirs.tolist()), np.full(offsets.size, BLOCK, dtype=np.uint64))
    assert batch != 0 and engine.get_batch_transfer_status([batch]) == 0
    assert np.array_equal(local, pattern(22, peer.nbytes))

    with pytest.raises(TypeError, match="uint64"):
        engine.batch_transfer_sync_write(peer.session, ours.astype(np.int64), theirs, [BLOCK] * offsets.size)
    with pytest.raises(TypeError):
        engine.batch_transfer_sync_read(peer.session, ours, theirs, [BLOCK] * (offsets.size - 1) + ["x"])
    caplog.set_level(logging.WARNING, logger="tern")
    assert engine.batch_transfer_sync_write(peer.session, ours, theirs[:-1], [BLOCK] * offsets.size) == -1
    assert "different lengths" in caplog.text
    registered = np.array([local.ctypes.data], dtype=np.uint64)
    assert engine.batch_unregister_memory(registered) == 0
    assert engine.batch_register_memory(registered, array.array("Q", [local.nbytes])) == 0
    assert engine.unregister_memory(local.ctypes.data) == 0


class Length(int):
    """A length that is an int, but not exactly one."""


def registered_blocks(engine, peer, salt: int):
    """A patterned array of the peer's size, registered: it, its blocks and its address."""
    local = pattern(salt, peer.nbytes)
    engine.register(local)
    return local, peer.nbytes // BLOCK, local.ctypes.data


def test_list_items_that_are_not_plain_ints_convert_as_a_u64_argument_would(engine, peer):
    """Exact ints are read in place; anything else takes the general conversion: int
    subclasses, numpy scalars (``__index__``), values from 2**63 up; wrong ones raise, and a
    list an ``__index__`` empties raises instead of being read past its end."""
    local, blocks, base = registered_blocks(engine, peer, 31)
    # numpy scalars for the local side, an int subclass and a bool among the lengths.
    ours = list(np.uint64(base) + np.arange(blocks, dtype=np.uint64) * np.uint64(BLOCK))
    theirs = [peer.addr + i * BLOCK for i in range(blocks)]
    lengths = [Length(BLOCK)] * (blocks - 1) + [BLOCK]
    assert isinstance(ours[0], np.uint64) and not isinstance(ours[0], int)
    engine.write_arrays(peer.session, ours, theirs, lengths)
    assert peer.ask("sha")["sha"] == sha(local)
    with pytest.raises(tern.InvalidArgument):
        engine.write_arrays(peer.session, [base], [peer.addr], [False])

    # From 2**63 up a value is no C long, yet a u64: an address no peer has.
    with pytest.raises(tern.TargetOutOfRange):
        engine.write_arrays(peer.session, [base], [2**63 + peer.addr], [BLOCK])
    for wrong in (-1, 2**64):
        with pytest.raises(OverflowError):
            engine.write_arrays(peer.session, [base], [peer.addr], [wrong])
    with pytest.raises(TypeError):
        engine.write_arrays(peer.session, [base], [peer.addr], [float(BLOCK)])

    class Emptying:
        """An address whose conversion empties the list it is read from."""

        def __init__(self, owner: list):
            self.owner = owner

        def __index__(self) -> int:
            self.owner.clear()
            return base

    shrinking: list = [base, base]
    shrinking[0] = Emptying(shrinking)
    with pytest.raises(IndexError):
        engine.write_arrays(peer.session, shrinking, [peer.addr] * 2, [BLOCK] * 2)
    engine.write_arrays(peer.session, [base], [peer.addr], [BLOCK])  # the engine goes on


def test_lists_of_plain_ints_hand_over_to_the_general_conversion_where_one_item_is_not(engine, peer):
    """Rows of exact ints are read side by side, one repeated length object read once; the
    first item that is not one hands the rest to the general conversion, which reads it and
    every row after, and raises where an ``__index__`` there emptied another list."""
    local, blocks, base = registered_blocks(engine, peer, 33)
    middle = blocks // 2
    ours = [base + i * BLOCK for i in range(blocks)]
    theirs = [peer.addr + i * BLOCK for i in range(blocks)]
    lengths = [BLOCK] * middle + [Length(BLOCK)] + [BLOCK] * (blocks - middle - 1)
    engine.write_arrays(peer.session, ours, theirs, lengths)
    assert peer.ask("sha")["sha"] == sha(local)

    class EmptyingOther:
        """An address whose conversion empties another list of the same call."""

        def __init__(self, other: list):
            self.other = other

        def __index__(self) -> int:
            self.other.clear()
            return base + 2 * BLOCK

    theirs = [peer.addr + i * BLOCK for i in range(4)]
    ours = [base, base + BLOCK, EmptyingOther(theirs), base + 3 * BLOCK]
    with pytest.raises(IndexError):
        engine.write_arrays(peer.session, ours, theirs, [BLOCK] * 4)
    engine.write_arrays(peer.session, [base], [peer.addr], [BLOCK])  # the engine goes on
