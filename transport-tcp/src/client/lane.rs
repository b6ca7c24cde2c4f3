//! A lane: one thread and one connection, taking slices from its pool's queue.

use std::io;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use tern_engine::{Slice, TransferError};

use super::cut_off::CutOff;
use super::pool::PoolShared;
use super::window::{RunEnd, Window};

/// A connection unused for longer than this is checked before reuse: the server may have
/// closed it for idleness, and a request sent into a closed connection would fail.
const IDLE_CHECK: Duration = Duration::from_millis(50);

pub(super) fn lane_loop(shared: &PoolShared, lane: usize, receiver: &Receiver<Slice>) {
    let mut connection: Option<TcpStream> = None;
    let mut last_used = Instant::now();
    // Empty between runs; kept for its buffers.
    let mut window = Window::default();
    loop {
        // Blocks for the first slice only when nothing is in flight (a window can hold
        // slices here: those a cut-off sends again on a new connection).
        if window.is_empty() {
            match receiver.recv() {
                Ok(first) => window.take(shared, first),
                Err(_) => break,
            }
        }
        window.fill(shared, receiver);
        if window.is_empty() {
            continue;
        }
        if connection.is_some()
            && last_used.elapsed() > IDLE_CHECK
            && !still_open(connection.as_ref())
        {
            connection = None;
        }
        let stream = match connection.as_mut() {
            Some(stream) => stream,
            None => match shared.connect() {
                Ok(stream) => {
                    shared.open.lock()[lane] = stream.try_clone().ok();
                    if shared.stop.load(Ordering::Acquire) {
                        let _ = stream.shutdown(Shutdown::Both);
                    }
                    connection.insert(stream)
                }
                Err(message) => {
                    window.fail_all(|| TransferError::Connection {
                        peer: shared.endpoint.clone(),
                        message: message.clone(),
                    });
                    continue;
                }
            },
        };
        let ended = window.run(shared, lane, stream, receiver);
        last_used = Instant::now();
        match ended {
            RunEnd::Emptied => {}
            RunEnd::CutOff(CutOff::Closing) => {
                if let Some(mut dropped) = connection.take() {
                    window.await_close(shared, lane, &mut dropped);
                }
            }
            RunEnd::Broken | RunEnd::CutOff(_) => connection = None,
        }
    }
}

/// Whether the peer has not closed `stream` (nothing may be pending on it between requests;
/// the socket is non-blocking).
fn still_open(stream: Option<&TcpStream>) -> bool {
    stream.is_some_and(|stream| {
        matches!(stream.peek(&mut [0u8; 1]), Err(ref e) if e.kind() == io::ErrorKind::WouldBlock)
    })
}
