//! The one module of `tern-python` with `unsafe`: registering memory Tern does not own.
//!
//! Two kinds of memory come from Python:
//!
//! - **Held** ([`HeldRegions`], the Pythonic API): an object's memory found through the buffer
//!   protocol, `__array_interface__` or `data_ptr()`/`nbytes`, with a keep-alive object (a
//!   `ctypes` array made with `from_buffer`, which holds a buffer export; the tensor's
//!   storage; or the object that exposes `__array_interface__`). The keep-alive stays here
//!   until the engine has unregistered the region, so Python cannot free the memory while
//!   Tern may touch it. A buffer export also forbids moving it (numpy moves an exported array
//!   only when told to, `resize(refcheck=False)`); a torch storage or an
//!   `__array_interface__` owner can still move its memory (`resize_`). The package checks
//!   for a move when the region is unregistered (`tern.MemoryMoved`).
//! - **Promised** ([`LocalMemory::register_promised`], the Mooncake drop-in): an integer
//!   address and length. As with Mooncake, the caller promises that the memory stays valid
//!   until it unregisters it; Rust cannot check that promise, and the documentation of
//!   `tern.mooncake` says so.
//!
//! Copies by address (`write_bytes_to_buffer`, `read_bytes_from_buffer`) need no `unsafe`:
//! they go through a [`RegionPin`] of the region that holds the range, taken before the
//! copy and dropped after it, so an unregister cannot succeed while a copy runs, and
//! engine-owned buffers (`allocate_managed_buffer`) are copied the same way.
//!
//! One more kind of memory is only read, never registered: a buffer of `uint64` addresses or
//! lengths given for a batch ([`U64Buffer`]), read in place through the buffer protocol
//! while its export is held, so that a batch of many descriptors needs no Python integer
//! per descriptor; and the items of a list of such integers, read without a reference
//! taken on each ([`exact_int_at`]).
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_void};

use parking_lot::Mutex;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;
use tern_engine::{EngineError, OwnedBuffer, RegionPin, RegisterRaw, TransferEngine};

use crate::core::unregister_settled;

/// Regions registered from Python objects, each with the object that keeps its memory.
#[derive(Debug, Default)]
pub(crate) struct HeldRegions {
    held: Mutex<HashMap<usize, Py<PyAny>>>,
}

impl HeldRegions {
    /// Registers `[addr, addr + len)`, whose memory `keepalive` keeps valid and in place for
    /// as long as it lives, and holds `keepalive` until the region is unregistered. On
    /// failure the keep-alive is handed back (to be dropped with the GIL).
    pub(crate) fn register(
        &self,
        engine: &TransferEngine,
        addr: usize,
        len: usize,
        location: &str,
        remote_accessible: bool,
        keepalive: Py<PyAny>,
    ) -> Result<(), (EngineError, Py<PyAny>)> {
        if addr == 0 {
            return Err((
                EngineError::InvalidArgument("null address".into()),
                keepalive,
            ));
        }
        // Held across the registration, so that no unregister of this address can slip in
        // between the engine's registration and the keep-alive's arrival here.
        let mut held = self.held.lock();
        // SAFETY: `Region::from_raw` needs the range valid for reads and writes until the
        // region is unregistered. The range is the memory of a writable, C-contiguous export
        // (`bf_getbuffer`, held by the ctypes array made with `from_buffer`): CPython's buffer
        // protocol forbids the exporter to free, move or resize the memory while an export is
        // held (numpy's `resize(refcheck=False)` overrides that only on the caller's word,
        // which numpy's documentation makes the caller's responsibility). Or it is the memory of a CPU tensor's storage or of an `__array_interface__`
        // object, which `keepalive` (the storage, the object) keeps allocated; neither can be
        // stopped from moving it (`resize_`), so there, as in `register_promised`, the caller
        // promises not to, and `tern.TransferEngine.unregister` checks the pointer and reports
        // a broken promise. `keepalive` leaves `held` only in `unregister` after the engine's
        // unregister returned `Ok` (no pin left, none can be taken), or never (`close`).
        // Peers writing the bytes concurrently is what registration means; nothing here forms
        // Rust references to them.
        let registered =
            unsafe { engine.register_memory(addr as *mut u8, len, location, remote_accessible) };
        match registered {
            Ok(()) => {
                held.insert(addr, keepalive);
                Ok(())
            }
            Err(e) => Err((e, keepalive)),
        }
    }

    /// Unregisters the region at `addr` and returns its keep-alive, now safe to drop.
    pub(crate) fn unregister(
        &self,
        engine: &TransferEngine,
        addr: usize,
    ) -> Result<Option<Py<PyAny>>, EngineError> {
        let mut held = self.held.lock();
        unregister_settled(engine, &[addr])?;
        Ok(held.remove(&addr))
    }

    /// Before the engine goes: unregisters every held region and returns the keep-alives
    /// that may go. A region still in use by a transfer that was cancelled keeps its
    /// keep-alive for the rest of the process: leaking it is the only sound choice.
    pub(crate) fn close(&self, engine: &TransferEngine) -> (Vec<Py<PyAny>>, usize) {
        let mut held = self.held.lock();
        let addrs: Vec<usize> = held.keys().copied().collect();
        let mut released = Vec::new();
        let mut leaked = 0;
        for addr in addrs {
            match unregister_settled(engine, &[addr]) {
                Ok(()) => released.extend(held.remove(&addr)),
                Err(EngineError::AddressNotRegistered { .. }) => {
                    released.extend(held.remove(&addr))
                }
                Err(_) => {
                    if let Some(keepalive) = held.remove(&addr) {
                        std::mem::forget(keepalive);
                        leaked += 1;
                    }
                }
            }
        }
        (released, leaked)
    }
}

/// The drop-in's local memory: engine-owned managed buffers, and registration and copies of
/// memory the caller promises.
#[derive(Debug, Default)]
pub(crate) struct LocalMemory {
    /// Managed buffers by start address; dropping one unregisters it (a copy that pinned it
    /// keeps its memory until the copy ends).
    managed: Mutex<HashMap<usize, OwnedBuffer>>,
}

impl LocalMemory {
    /// Registers ranges the caller promises stay valid for reads and writes until they are
    /// unregistered (Mooncake's `register_memory` contract).
    pub(crate) fn register_promised(
        &self,
        engine: &TransferEngine,
        ranges: &[(usize, usize)],
        location: &str,
    ) -> Result<(), EngineError> {
        if let Some(&(addr, _)) = ranges.iter().find(|(addr, _)| *addr == 0) {
            return Err(EngineError::InvalidArgument(format!(
                "null address {addr:#x}"
            )));
        }
        let ranges: Vec<(*mut u8, usize)> = ranges
            .iter()
            .map(|&(addr, len)| (addr as *mut u8, len))
            .collect();
        // SAFETY: `Region::from_raw`'s contract (valid for reads and writes by any thread
        // until unregistered) is exactly what the Python caller promises by passing an
        // address to `register_memory`, as with Mooncake, whose callers (SGLang, vLLM)
        // register tensors they keep for the engine's lifetime. This is the one place where
        // Tern trusts a caller it cannot check; the drop-in's documentation says so.
        unsafe { engine.register_memory_batch(&ranges, location, true) }
    }

    /// Allocates a managed buffer; returns its address.
    pub(crate) fn allocate(
        &self,
        engine: &TransferEngine,
        len: usize,
    ) -> Result<usize, EngineError> {
        let buffer = engine.allocate(len, "*")?;
        let addr = buffer.addr();
        self.managed.lock().insert(addr, buffer);
        Ok(addr)
    }

    /// Frees a managed buffer (transfers and copies still using it keep it until they end).
    pub(crate) fn free(&self, addr: usize, len: usize) -> Result<(), EngineError> {
        let mut managed = self.managed.lock();
        let Some(buffer) = managed.get(&addr) else {
            return Err(EngineError::InvalidArgument(format!(
                "{addr:#x} is not a managed buffer"
            )));
        };
        if buffer.len() != len {
            return Err(EngineError::InvalidArgument(format!(
                "the managed buffer at {addr:#x} has {} bytes, not {len}",
                buffer.len()
            )));
        }
        drop(managed.remove(&addr));
        Ok(())
    }

    /// Pins the region (promised memory or a managed buffer) that holds all of
    /// `[addr, addr + len)`. Until the pin drops, the region's unregister fails with
    /// `RegionInUse` (the drop-in's `unregister_memory` waits a little for it first), so
    /// the memory cannot be unregistered, and then freed by its owner, under a copy.
    fn pin(engine: &TransferEngine, addr: usize, len: usize) -> Result<RegionPin, EngineError> {
        if addr == 0 {
            return Err(EngineError::AddressNotRegistered { addr });
        }
        // An empty copy still needs its address inside a region, as a byte there would.
        engine.pin_local(addr, len.max(1))
    }

    /// Copies `data` to `addr`, which must lie (with `data.len()` bytes) inside a managed
    /// buffer or a registered region, pinned for the copy.
    pub(crate) fn write(
        &self,
        engine: &TransferEngine,
        addr: usize,
        data: &[u8],
    ) -> Result<(), EngineError> {
        let pin = Self::pin(engine, addr, data.len())?;
        Ok(pin.copy_from_slice(addr, data)?)
    }

    /// Copies `out.len()` bytes at `addr` into `out`; the range must lie inside a managed
    /// buffer or a registered region, pinned for the copy.
    pub(crate) fn read(
        &self,
        engine: &TransferEngine,
        addr: usize,
        out: &mut [u8],
    ) -> Result<(), EngineError> {
        let pin = Self::pin(engine, addr, out.len())?;
        Ok(pin.copy_to_slice(addr, out)?)
    }
}

/// The caller's CUDA stream `stream_ptr` (0: the legacy default stream of the calling
/// thread's context), as `transfer_*_on_cuda` take it.
pub(crate) fn caller_stream(
    stream_ptr: u64,
) -> Result<tern_engine::CallerStream<'static>, tern_engine::CudaError> {
    // SAFETY: `stream_ptr` is a stream handle the caller made (`torch.cuda.Stream.cuda_stream`)
    // or 0, and the caller keeps it alive across the call, as Mooncake's
    // `transfer_*_on_cuda` require and `tern.mooncake`'s documentation says; the value is
    // used only within the call (what is enqueued on the stream outlives it in the driver).
    unsafe { tern_engine::CallerStream::from_raw(stream_ptr as usize) }
}

/// `Py_buffer` as CPython lays it out (`Include/pybuffer.h`, in the stable ABI since 3.11 and
/// unchanged since 3.3). pyo3-ffi declares it, and the two functions below, only for builds
/// that need 3.11, while this wheel's stable ABI starts at 3.10, whose interpreter exports both
/// functions all the same.
#[repr(C)]
struct PyBufferView {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: ffi::Py_ssize_t,
    itemsize: ffi::Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut ffi::Py_ssize_t,
    strides: *mut ffi::Py_ssize_t,
    suboffsets: *mut ffi::Py_ssize_t,
    internal: *mut c_void,
}

unsafe extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut PyBufferView, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut PyBufferView);
}

/// `PyBUF_FORMAT | PyBUF_STRIDES`: the item format, the shape and the strides, no suboffsets.
const STRIDED_WITH_FORMAT: c_int = 0x0004 | 0x0010 | 0x0008;

/// Why a buffer cannot be read as 64-bit unsigned integers.
#[derive(Debug)]
pub(crate) enum NotU64s {
    /// Its items are not 64-bit unsigned integers (the format it declares).
    Format(String),
    /// It is not one-dimensional (its number of dimensions).
    Shape(usize),
}

/// A one-dimensional buffer of 64-bit unsigned integers (a numpy `uint64` array, even a
/// strided view; an `array('Q')`; a memoryview of format `Q`), read in place. The export is
/// held until this drops, with the GIL (`Python<'py>` keeps it on an attached thread).
pub(crate) struct U64Buffer<'py> {
    // Boxed: exporters may point `shape` or `strides` into the view itself.
    view: Box<PyBufferView>,
    len: usize,
    stride: isize,
    _attached: Python<'py>,
}

impl<'py> U64Buffer<'py> {
    /// The buffer of `obj`: `Ok(None)` when it exports none (the caller reads it another
    /// way), `Err` when its buffer holds something other than one dimension of `uint64`.
    pub(crate) fn of(obj: &Bound<'py, PyAny>) -> Result<Option<Self>, NotU64s> {
        let py = obj.py();
        let mut view = Box::new(PyBufferView {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        });
        // SAFETY: `obj` is a live object and the GIL is held (`Bound<'py>`); `view` is a
        // writable `Py_buffer` that stays at one address until `PyBuffer_Release` (boxed, and
        // released only by `Drop`, or below when refused).
        if unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, STRIDED_WITH_FORMAT) } != 0 {
            // No buffer (or none the exporter gives with these flags): not an error here.
            drop(PyErr::take(py));
            return Ok(None);
        }
        // Built before any check, so that a refusal below releases the export too.
        let mut buffer = Self {
            view,
            len: 0,
            stride: 0,
            _attached: py,
        };
        let view = &*buffer.view;
        let format = if view.format.is_null() {
            // The buffer protocol's default: unsigned bytes.
            "B".to_owned()
        } else {
            // SAFETY: with `PyBUF_FORMAT` a non-null `format` is a NUL-terminated struct-module
            // format string owned by the export, valid until it is released.
            unsafe { CStr::from_ptr(view.format) }
                .to_string_lossy()
                .into_owned()
        };
        if !is_u64_format(&format) || view.itemsize != 8 {
            return Err(NotU64s::Format(format));
        }
        if view.ndim != 1 || view.shape.is_null() || view.strides.is_null() {
            return Err(NotU64s::Shape(usize::try_from(view.ndim).unwrap_or(0)));
        }
        // SAFETY: with `PyBUF_STRIDES` (which includes `PyBUF_ND`) an exporter fills `shape`
        // and `strides` with `ndim` entries each, valid until the export is released.
        let (len, stride) = unsafe { (*view.shape, *view.strides) };
        buffer.len = usize::try_from(len).unwrap_or(0);
        buffer.stride = stride;
        Ok(Some(buffer))
    }

    /// How many integers it holds.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Its `i`th integer; `None` past the end.
    #[inline]
    pub(crate) fn get(&self, i: usize) -> Option<u64> {
        if i >= self.len {
            return None;
        }
        let base = self.view.buf.cast::<u8>().cast_const();
        // SAFETY: the export is held for as long as `self` lives, and the buffer protocol's
        // contract is that for a one-dimensional export item `i < shape[0]` (checked above)
        // lies at `buf + i * strides[0]`, `itemsize` (8) bytes of memory the exporter may not
        // free, move or resize while the export is held. The read is unaligned because
        // nothing obliges an exporter to align its items. A thread running without the GIL
        // could write the integers meanwhile, as it could write any Python buffer: the
        // values read are then checked by the engine like any others (an address outside
        // registered memory fails the request).
        Some(unsafe {
            base.offset(i as isize * self.stride)
                .cast::<u64>()
                .read_unaligned()
        })
    }
}

impl Drop for U64Buffer<'_> {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful `PyObject_GetBuffer` and is released
        // exactly once, here, on a thread attached to the interpreter (`Python<'py>`).
        unsafe { PyBuffer_Release(&mut *self.view) }
    }
}

/// Whether a struct-module format names a 64-bit unsigned integer in this machine's byte
/// order (`Q`, or `L` where native `unsigned long` has 64 bits; the item size is checked too).
fn is_u64_format(format: &str) -> bool {
    let code = match format.as_bytes() {
        [code] => *code,
        [b'@' | b'=', code] => *code,
        [b'<', code] if cfg!(target_endian = "little") => *code,
        [b'>' | b'!', code] if cfg!(target_endian = "big") => *code,
        _ => return false,
    };
    matches!(code, b'Q' | b'L')
}

/// The `i`th item of `list` if it is an `int` (exactly; not a subclass) from 0 to 2**63 - 1,
/// read without taking a reference to it: `None` for anything else (past the end, another
/// type, a value out of that range), which the caller reads the general way, raising what
/// it must. A batch of many descriptors so writes nothing to its integers' memory.
#[inline]
pub(crate) fn exact_int_at(list: &Bound<'_, PyList>, i: usize) -> Option<u64> {
    let at = ffi::Py_ssize_t::try_from(i).ok()?;
    let list = list.as_ptr();
    // SAFETY: `list` is a live list (the `Bound` holds a reference, on a thread attached to
    // the interpreter: it holds the GIL, so no other thread runs Python code and changes the
    // list meanwhile; the abi3 wheel loads in no free-threaded build). `PyList_Size` and
    // `PyList_GetItem` with an index checked against the size set no error; the item
    // `PyList_GetItem` returns is borrowed, owned by the list, and stays alive while
    // nothing changes the list, and `exact_int_value` runs no Python code, so nothing can.
    unsafe {
        if at >= ffi::PyList_Size(list) {
            return None;
        }
        let item = ffi::PyList_GetItem(list, at);
        if item.is_null() {
            return None;
        }
        exact_int_value(item)
    }
}

/// The value of `item` if it is an `int` (exactly; not a subclass) from 0 to 2**63 - 1, read
/// without taking a reference to it and without running Python code: `PyLong_CheckExact` is
/// a type comparison, and `PyLong_AsLongAndOverflow` calls `__index__` only for objects that
/// are not `int`s (https://docs.python.org/3/c-api/long.html#c.PyLong_AsLongAndOverflow).
/// With `overflow` set it reports a value out of range without setting an error; for an
/// exact `int` it sets none otherwise.
///
/// # Safety
///
/// `item` is a live object, and the calling thread is attached to the interpreter.
#[inline]
unsafe fn exact_int_value(item: *mut ffi::PyObject) -> Option<u64> {
    // SAFETY: the caller's contract: `item` is live, on an attached thread.
    unsafe {
        if ffi::PyLong_CheckExact(item) == 0 {
            return None;
        }
        let mut overflow: c_int = 0;
        let value = ffi::PyLong_AsLongAndOverflow(item, &mut overflow);
        (overflow == 0 && value >= 0).then_some(value as u64)
    }
}

/// Reads rows of exact `int`s side by side from `lists` (all of at least `rows` items),
/// handing each row to `row`, until the first item that is not an exact `int` from 0 to
/// 2**63 - 1 (or past a list's end); returns how many rows it read, for the caller to read
/// the rest the general way, raising what it must. No Python code runs meanwhile, so no
/// item goes away and an item that is the object of the one before in its list (a list of
/// one repeated length) is read once.
pub(crate) fn exact_int_rows<const N: usize>(
    lists: [&Bound<'_, PyList>; N],
    rows: usize,
    mut row: impl FnMut([u64; N]),
) -> usize {
    let lists = lists.map(|list| list.as_ptr());
    let mut last = [(std::ptr::null_mut::<ffi::PyObject>(), 0u64); N];
    for i in 0..rows {
        let Ok(at) = ffi::Py_ssize_t::try_from(i) else {
            return i;
        };
        let mut values = [0u64; N];
        for ((list, value), last) in lists.iter().zip(&mut values).zip(&mut last) {
            // SAFETY: each list is live (its `Bound` holds a reference, on a thread attached
            // to the interpreter: it holds the GIL, so no other thread runs Python code
            // and changes the list meanwhile; the abi3 wheel loads in no free-threaded
            // build). `PyList_GetItem` returns a borrowed item, or NULL with an
            // `IndexError` set for an index out of range
            // (https://docs.python.org/3/c-api/list.html#c.PyList_GetItem), which is
            // cleared here for the caller's general read to raise its own. A borrowed item
            // stays alive while nothing changes its list, and nothing can: from the first
            // row to the return only `exact_int_value` runs, which runs no Python code. So
            // an item at the address of the one read before is that object, whose value an
            // `int` never changes.
            unsafe {
                let item = ffi::PyList_GetItem(*list, at);
                if item.is_null() {
                    ffi::PyErr_Clear();
                    return i;
                }
                if item == last.0 {
                    *value = last.1;
                    continue;
                }
                let Some(read) = exact_int_value(item) else {
                    return i;
                };
                *value = read;
                *last = (item, read);
            }
        }
        row(values);
    }
    rows
}
