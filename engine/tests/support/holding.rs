//! A transport that holds the slices it is given until the test takes them, and has no
//! thread of its own; if it offers help, a waiting thread completes them one per call. Asked
//! to cut off, it gives back the held slices of ended tasks, unless told to ignore it.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use tern_engine::{
    RegionInfo, SegmentDesc, SegmentId, Slice, TransferEngine, TransferRequest, Transport,
    TransportContext, TransportError,
};

/// An engine on loopback whose only transport holds its slices.
#[allow(dead_code)]
pub fn holding_engine() -> (TransferEngine, HoldingTransport) {
    let transport = HoldingTransport::default();
    let engine = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(transport.clone())
        .build()
        .unwrap();
    (engine, transport)
}

/// `tasks` writes of `len` bytes, neighbours on both sides (from `source` to the local
/// segment at `target`), last first: merged, they make one run whatever their order.
#[allow(dead_code)]
pub fn neighbours_last_first(
    source: usize,
    target: u64,
    tasks: usize,
    len: usize,
) -> Vec<TransferRequest> {
    (0..tasks)
        .rev()
        .map(|i| {
            TransferRequest::write(
                source + i * len,
                SegmentId::LOCAL,
                target + (i * len) as u64,
                len,
            )
        })
        .collect()
}

#[derive(Clone, Default)]
pub struct HoldingTransport {
    pub held: Arc<Mutex<Vec<Slice>>>,
    /// Whether a waiter may complete held slices ([`Transport::help`]).
    pub offers_help: bool,
    /// The threads that helped, one entry per slice completed.
    pub helped_by: Arc<Mutex<Vec<ThreadId>>>,
    /// Whether [`Transport::cut_off`] is ignored: slices stay held until the test takes them.
    pub deaf: Arc<AtomicBool>,
    /// How many times the engine asked it to cut off.
    pub cut_offs: Arc<AtomicUsize>,
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
    fn submit(&self, slices: &mut Vec<Slice>) {
        self.held.lock().unwrap().append(slices);
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
    fn cut_off(&self) {
        self.cut_offs.fetch_add(1, Ordering::SeqCst);
        if self.deaf.load(Ordering::SeqCst) {
            return;
        }
        let ended: Vec<Slice> = {
            let mut held = self.held.lock().unwrap();
            let (ended, live) = std::mem::take(&mut *held)
                .into_iter()
                .partition(|s| !s.is_live());
            *held = live;
            ended
        };
        for slice in ended {
            slice.cut_off(false);
        }
    }
    fn shutdown(&self) {
        self.held.lock().unwrap().clear();
    }
}
