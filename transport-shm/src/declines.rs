//! Device memory this transport hands to the next one instead, and why: the reasons, and the
//! tally the report shows, so that a slow path taken is seen and not hidden.

use parking_lot::Mutex;
use tern_engine::Slice;

/// Why a slice between local device memory and a peer's plain host memory (not a memfd)
/// goes to the next transport: that memory is reached only by cross-memory attach, a CPU
/// copy, which never touches device memory.
pub(crate) const DEVICE_TO_HOST_DECLINED: &str =
    "device memory to a peer's host memory outside memfds: reached only by cross-memory attach";
/// Why the owner could not hand out its device memory (the driver's reason follows).
pub(crate) const DEVICE_UNSHARED: &str = "the owner cannot share its device memory";
/// Why this process could not map a peer's device memory (the driver's reason follows).
pub(crate) const DEVICE_UNMAPPED: &str = "the peer's device memory cannot be mapped here";
/// Why a peer declined its device memory (its reason follows).
pub(crate) const DEVICE_PEER_DECLINED: &str = "the peer declined its device memory";

/// Slices of device memory declined to the next transport (TCP, which stages it), counted
/// by why, so the stats show a slow path taken instead of hiding it.
#[derive(Debug, Default)]
pub(crate) struct DeviceDeclines {
    /// `(reason, slices, bytes)`, one entry per reason (a handful of constants).
    tally: Mutex<Vec<(&'static str, u64, u64)>>,
}

impl DeviceDeclines {
    /// Declines `slice` for the next transport and counts it under `reason`; `detail` goes
    /// into the slice's message only.
    pub(crate) fn decline(&self, slice: Slice, reason: &'static str, detail: Option<&str>) {
        {
            let mut tally = self.tally.lock();
            match tally.iter_mut().find(|(r, _, _)| *r == reason) {
                Some(entry) => {
                    entry.1 += 1;
                    entry.2 += slice.len as u64;
                }
                None => tally.push((reason, 1, slice.len as u64)),
            }
        }
        match detail {
            Some(detail) => slice.decline(&format!("{reason}: {detail}")),
            None => slice.decline(reason),
        }
    }

    /// `(reason, slices, bytes)` declined so far.
    pub(crate) fn get(&self) -> Vec<(&'static str, u64, u64)> {
        self.tally.lock().clone()
    }
}
