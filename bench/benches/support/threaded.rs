//! A transport that completes every slice on a worker thread of its own, as real transports
//! do, and moves no bytes: what the slices bench and the slice_cost example measure the
//! engine with.

use crossbeam_channel::{Receiver, Sender};
use tern_engine::{
    RegionInfo, ReportTogether, SegmentDesc, Slice, Transport, TransportContext, TransportError,
};

/// Completes every slice it is given on its worker thread (which ends when it is dropped).
pub struct ThreadedTransport {
    slice_size: usize,
    to_worker: Sender<Vec<Slice>>,
}

impl ThreadedTransport {
    /// Cuts requests into slices of `slice_size`.
    pub fn new(slice_size: usize) -> Self {
        let (to_worker, from_submitters): (Sender<Vec<Slice>>, Receiver<Vec<Slice>>) =
            crossbeam_channel::unbounded();
        std::thread::spawn(move || {
            while let Ok(slices) = from_submitters.recv() {
                // All of them end now, as a real transport learns of many ends in one poll.
                let _together = ReportTogether::begin();
                for slice in slices {
                    slice.complete();
                }
            }
        });
        Self {
            slice_size,
            to_worker,
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
    fn submit(&self, slices: Vec<Slice>) {
        let _ = self.to_worker.send(slices);
    }
    fn shutdown(&self) {}
}
