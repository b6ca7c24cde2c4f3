//! A transport that moves no bytes and completes every slice either on a worker thread of
//! its own, as real transports do, or at once inside `submit` (which leaves the engine's own
//! bookkeeping alone): what the slices and engine benches and the slice_cost example measure
//! the engine with.

use crossbeam_channel::{Receiver, Sender};
use tern_engine::{
    RegionInfo, ReportTogether, SegmentDesc, Slice, Transport, TransportContext, TransportError,
};

/// Completes every slice it is given, on its worker thread (which ends when it is dropped)
/// or, without one, on the submitting thread.
pub struct ThreadedTransport {
    slice_size: usize,
    to_worker: Option<Sender<Vec<Slice>>>,
}

/// All of them end now, as a real transport learns of many ends in one poll.
fn complete_all(slices: impl IntoIterator<Item = Slice>) {
    let _together = ReportTogether::begin();
    for slice in slices {
        slice.complete();
    }
}

impl ThreadedTransport {
    /// Cuts requests into slices of `slice_size`, completed on a worker thread.
    #[allow(
        dead_code,
        reason = "each bench that includes this file uses one constructor"
    )]
    pub fn new(slice_size: usize) -> Self {
        let (to_worker, from_submitters): (Sender<Vec<Slice>>, Receiver<Vec<Slice>>) =
            crossbeam_channel::unbounded();
        std::thread::spawn(move || {
            while let Ok(slices) = from_submitters.recv() {
                complete_all(slices);
            }
        });
        Self {
            slice_size,
            to_worker: Some(to_worker),
        }
    }

    /// Cuts requests into slices of `slice_size`, completed inside `submit`.
    #[allow(
        dead_code,
        reason = "each bench that includes this file uses one constructor"
    )]
    pub fn instant(slice_size: usize) -> Self {
        Self {
            slice_size,
            to_worker: None,
        }
    }
}

impl Transport for ThreadedTransport {
    fn protocol(&self) -> &'static str {
        "threaded"
    }
    fn start(&self, _context: TransportContext) -> Result<(), TransportError> {
        Ok(())
    }
    fn describe(&self, _desc: &mut SegmentDesc, _regions: &[RegionInfo]) {}
    fn max_slice_size(&self) -> usize {
        self.slice_size
    }
    fn submit(&self, slices: &mut Vec<Slice>) {
        match &self.to_worker {
            // The worker thread takes the list: a real transport hands its slices to another
            // thread too.
            Some(to_worker) => {
                let _ = to_worker.send(std::mem::take(slices));
            }
            None => complete_all(slices.drain(..)),
        }
    }
    fn shutdown(&self) {}
}
