//! Tern's Python face: the extension module `tern._tern` of the `tern` wheel.
//!
//! Two faces over one engine: `tern.mooncake.TransferEngine` (module `mooncake`), Mooncake's
//! `mooncake.engine.TransferEngine` method for method (positional arguments, integer codes,
//! Mooncake's naming and port rules), and the Pythonic `tern.TransferEngine` (module `pythonic`:
//! keyword arguments, typed exceptions, buffer registration, batches, asyncio), whose
//! duck typing and asyncio glue live in the Python package beside this module.
//!
//! It must not own transfer logic: it converts arguments, releases the GIL around every
//! engine call that registers, moves or waits, and maps engine errors to codes or exceptions.
//! `unsafe` lives in module `raw` only (raw-pointer registration and copies); everything else is
//! safe code. It must not take the GIL on a transport thread: completions reach asyncio
//! through a socket the event loop watches.
#![deny(unsafe_code)]

mod config;
mod core;
mod descriptors;
mod errors;
mod mooncake;
mod on_stream;
mod pythonic;
mod raw;

use pyo3::prelude::*;

/// Log lines of the engine itself (a dropped connection, a refused peer) go to stderr at
/// `TERN_LOG` (`error`, `warn` (default), `info`, `debug`, `trace`); the binding's own lines
/// about failed calls go to Python's `logging` (logger `tern`).
fn install_engine_logging() {
    let level = match std::env::var("TERN_LOG").as_deref().map(str::trim) {
        Ok("trace") => tracing::Level::TRACE,
        Ok("debug") => tracing::Level::DEBUG,
        Ok("info") => tracing::Level::INFO,
        Ok("error") => tracing::Level::ERROR,
        _ => tracing::Level::WARN,
    };
    // Another library of the process may have installed a subscriber first; it wins.
    let _ = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}

/// The extension module.
#[pymodule]
fn _tern(m: &Bound<'_, PyModule>) -> PyResult<()> {
    install_engine_logging();
    m.add("RDMA_BUILT", cfg!(feature = "rdma"))?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<mooncake::MooncakeEngine>()?;
    m.add_class::<pythonic::Engine>()?;
    m.add_class::<pythonic::PyBatch>()?;
    m.add_class::<pythonic::OwnedMemory>()?;
    m.add_class::<pythonic::Waker>()?;
    m.add_class::<on_stream::StreamTransfer>()?;
    m.add_function(wrap_pyfunction!(mooncake::local_topology, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_driver, m)?)?;
    Ok(())
}

/// The CUDA driver this process uses (loading it on the first call): `None` without one, else
/// its library path and version. Device memory can be registered only when there is one.
#[pyfunction]
fn cuda_driver(py: Python<'_>) -> Option<(String, i32)> {
    py.detach(|| {
        tern_engine::cuda_driver()
            .ok()
            .map(|d| (d.path().to_owned(), d.version()))
    })
}
