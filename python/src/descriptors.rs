//! The integers a batch comes with (addresses, lengths, batch ids), read straight from what
//! Python passed: a batch of many descriptors must cost the binding no Python object per
//! descriptor, nor a vector per argument on the way to the engine's requests.

use std::cell::Cell;

use pyo3::exceptions::{PyIndexError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};
use tern_engine::TransferRequest;

use crate::errors::invalid;
use crate::raw::{NotU64s, U64Buffer, exact_int_at, exact_int_rows};

/// One argument's integers, where they already are.
pub(crate) enum U64s<'a, 'py> {
    /// A list: its items are read one by one, in place.
    List(&'a Bound<'py, PyList>),
    /// A buffer of `uint64` (numpy, `array('Q')`, memoryview), read in place.
    Buffer(U64Buffer<'py>),
    /// Any other iterable of integers (a tuple, a range), gathered first.
    Gathered(Vec<u64>),
}

impl<'a, 'py> U64s<'a, 'py> {
    /// Reads `obj`. `what` names the argument in errors; a wrong type raises `TypeError`,
    /// a buffer of another number of dimensions than one `tern.InvalidArgument` (a
    /// `ValueError`).
    pub(crate) fn of(obj: &'a Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        if let Ok(list) = obj.cast::<PyList>() {
            return Ok(Self::List(list));
        }
        // A string would iterate as characters; a bytes object exports bytes, refused below.
        if obj.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err(format!(
                "{what} must be a list of int or a buffer of uint64, not str"
            )));
        }
        match U64Buffer::of(obj) {
            Ok(Some(buffer)) => return Ok(Self::Buffer(buffer)),
            Ok(None) => {}
            Err(NotU64s::Format(format)) => {
                return Err(PyTypeError::new_err(format!(
                    "{what} must hold uint64 (buffer format 'Q'), not items of format {format:?}"
                )));
            }
            Err(NotU64s::Shape(ndim)) => {
                return Err(invalid(
                    obj.py(),
                    format!("{what} must be one-dimensional, not of {ndim} dimensions"),
                ));
            }
        }
        let gathered = obj
            .try_iter()
            .map_err(|_| {
                PyTypeError::new_err(format!(
                    "{what} must be a list of int or a buffer of uint64, not {}",
                    type_name(obj)
                ))
            })?
            .map(|item| item.and_then(|item| int_u64(&item)))
            .collect::<PyResult<Vec<u64>>>()?;
        Ok(Self::Gathered(gathered))
    }

    /// How many integers there are.
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::List(list) => list.len(),
            Self::Buffer(buffer) => buffer.len(),
            Self::Gathered(values) => values.len(),
        }
    }

    /// The `i`th integer: read in place from a list's exact `int`s and from buffers; any
    /// other item converted as a `u64` argument would be. Past the end (a list that shrank
    /// while an `__index__` ran Python code) raises `IndexError`.
    #[inline]
    pub(crate) fn get(&self, i: usize) -> PyResult<u64> {
        let value = match self {
            Self::List(list) => match exact_int_at(list, i) {
                Some(value) => Some(value),
                None => return int_u64(&list.get_item(i)?),
            },
            Self::Buffer(buffer) => buffer.get(i),
            Self::Gathered(values) => values.get(i).copied(),
        };
        value.ok_or_else(|| PyIndexError::new_err(format!("no integer at index {i}")))
    }

    /// Stores the `i`th integer into `out[i]` with `set`, for every slot of `out`.
    pub(crate) fn fill<T>(&self, out: &mut [T], set: impl Fn(&mut T, u64)) -> PyResult<()> {
        for (i, slot) in out.iter_mut().enumerate() {
            set(slot, self.get(i)?);
        }
        Ok(())
    }
}

/// An integer as `u64`, by CPython's signed conversion where the value fits it: that one
/// reads the digits in a loop, while the unsigned one goes through a byte array for any
/// value above 2**30, as every address is. Anything else takes the `u64` conversion, which
/// raises what a `u64` argument would (negative, too large, not an integer).
fn int_u64(item: &Bound<'_, PyAny>) -> PyResult<u64> {
    match item.extract::<i64>() {
        Ok(value) if value >= 0 => Ok(value as u64),
        _ => item.extract::<u64>(),
    }
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string())
}

/// A batch's three arguments (local addresses, remote addresses, lengths; named by `names`
/// in messages) as requests like `template`, read in place into the one vector the engine is
/// given. A wrong type raises; arguments of different lengths are `Ok(Err(reason))`, which
/// each face reports its own way.
pub(crate) fn requests(
    template: TransferRequest,
    names: [&str; 3],
    [local, remote, lengths]: [&Bound<'_, PyAny>; 3],
) -> PyResult<Result<Vec<TransferRequest>, String>> {
    let local = U64s::of(local, names[0])?;
    let remote = U64s::of(remote, names[1])?;
    let lengths = U64s::of(lengths, names[2])?;
    let (n, m, k) = (local.len(), remote.len(), lengths.len());
    if n != m || n != k {
        return Ok(Err(format!(
            "lists of different lengths: {n} {}, {m} {}, {k} {}",
            names[0], names[1], names[2]
        )));
    }
    // One pass, each request written once: a batch of many descriptors is larger than the
    // caches, and three passes over it cost more than reading three arguments side by side.
    let mut requests = room_for(n);
    let mut read = 0;
    if let (U64s::List(local), U64s::List(remote), U64s::List(lengths)) =
        (&local, &remote, &lengths)
    {
        // Lists of exact ints, as callers mostly pass, read side by side without a look at
        // the kind of each argument per item.
        read = exact_int_rows(
            [*local, *remote, *lengths],
            n,
            |[source, offset, length]| {
                requests.push(TransferRequest {
                    source: source as usize,
                    target_offset: offset,
                    length: length as usize,
                    ..template
                });
            },
        );
    } else if let (U64s::Buffer(local), U64s::Buffer(remote), U64s::Buffer(lengths)) =
        (&local, &remote, &lengths)
    {
        // Buffers (numpy arrays), read side by side the same way.
        requests.extend((0..n).map_while(|i| {
            Some(TransferRequest {
                source: local.get(i)? as usize,
                target_offset: remote.get(i)?,
                length: lengths.get(i)? as usize,
                ..template
            })
        }));
        read = requests.len();
    }
    for i in read..n {
        requests.push(TransferRequest {
            source: local.get(i)? as usize,
            target_offset: remote.get(i)?,
            length: lengths.get(i)? as usize,
            ..template
        });
    }
    Ok(Ok(requests))
}

/// Requests' room of fewer entries is not kept: the allocator reuses room this small
/// without the kernel.
const KEEP_FROM_REQUESTS: usize = 4096;

thread_local! {
    /// The room of this thread's last large batch of requests, for its next: made afresh, a
    /// batch of 100 000 descriptors takes 4 MB that the kernel hands out a page fault per
    /// 4 KiB (a Python main thread's heap gives such room back as soon as it is freed).
    static KEPT_ROOM: Cell<Vec<TransferRequest>> = const { Cell::new(Vec::new()) };
}

/// An empty vector with room for `n` requests: the thread's kept room when it fits and is
/// not much larger (a much larger one is let go), else new room.
fn room_for(n: usize) -> Vec<TransferRequest> {
    let kept = KEPT_ROOM.with(Cell::take);
    if kept.capacity() >= n && kept.capacity() <= n.max(KEEP_FROM_REQUESTS).saturating_mul(4) {
        kept
    } else {
        Vec::with_capacity(n)
    }
}

/// Gives the room of a call's requests, done with, back to the thread for its next call.
pub(crate) fn give_back(mut requests: Vec<TransferRequest>) {
    if requests.capacity() >= KEEP_FROM_REQUESTS {
        requests.clear();
        KEPT_ROOM.with(|kept| kept.set(requests));
    }
}
