//! A transport that holds the slices it is given until the test takes them, and has no
//! thread of its own; if it offers help, a waiting thread completes them one per call.

use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use tern_engine::{RegionInfo, SegmentDesc, Slice, Transport, TransportContext, TransportError};

#[derive(Clone, Default)]
pub struct HoldingTransport {
    pub held: Arc<Mutex<Vec<Slice>>>,
    /// Whether a waiter may complete held slices ([`Transport::help`]).
    pub offers_help: bool,
    /// The threads that helped, one entry per slice completed.
    pub helped_by: Arc<Mutex<Vec<ThreadId>>>,
}

impl HoldingTransport {
    /// The slices held so far (each test crate uses what it needs of this module).
    #[allow(dead_code)]
    pub fn take(&self) -> Vec<Slice> {
        std::mem::take(&mut *self.held.lock().unwrap())
    }
}

impl Transport for HoldingTransport {
    fn protocol(&self) -> &'static str {
        "hold"
    }
    fn start(&self, _context: TransportContext) -> Result<(), TransportError> {
        Ok(())
    }
    fn describe(&self, _desc: &mut SegmentDesc, _regions: &[RegionInfo]) {}
    fn max_slice_size(&self) -> usize {
        4096
    }
    fn submit(&self, slices: Vec<Slice>) {
        self.held.lock().unwrap().extend(slices);
    }
    fn offers_help(&self) -> bool {
        self.offers_help
    }
    fn help(&self) -> bool {
        let Some(slice) = self.held.lock().unwrap().pop() else {
            return false;
        };
        self.helped_by
            .lock()
            .unwrap()
            .push(std::thread::current().id());
        slice.complete();
        true
    }
    fn shutdown(&self) {
        self.held.lock().unwrap().clear();
    }
}
