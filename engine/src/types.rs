//! The plain values of the API: requests, segment IDs, statuses.

use std::fmt;

use crate::error::TransferError;

/// Direction of a transfer, seen from the initiator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Opcode {
    /// Remote → local.
    Read,
    /// Local → remote.
    Write,
}

/// A process-local handle to an open segment. The local segment is [`SegmentId::LOCAL`] (0),
/// remote ones count up from 1, as in Mooncake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentId(pub u64);

impl SegmentId {
    /// This engine's own segment.
    pub const LOCAL: Self = Self(0);
}

impl fmt::Display for SegmentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// One transfer between local registered memory and a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferRequest {
    /// Read or write.
    pub opcode: Opcode,
    /// Local address; `[source, source + length)` must lie in one registered region.
    pub source: usize,
    /// The segment on the other side.
    pub target: SegmentId,
    /// Remote virtual address (Mooncake's `target_offset`); the range must lie in one buffer
    /// of the target's descriptor.
    pub target_offset: u64,
    /// Bytes to move.
    pub length: usize,
}

impl TransferRequest {
    /// Reads `length` bytes at `target_offset` of `target` into `source`.
    pub fn read(source: usize, target: SegmentId, target_offset: u64, length: usize) -> Self {
        Self {
            opcode: Opcode::Read,
            source,
            target,
            target_offset,
            length,
        }
    }

    /// Writes `length` bytes from `source` to `target_offset` of `target`.
    pub fn write(source: usize, target: SegmentId, target_offset: u64, length: usize) -> Self {
        Self {
            opcode: Opcode::Write,
            source,
            target,
            target_offset,
            length,
        }
    }
}

/// Where a task stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferStatus {
    /// Not submitted yet.
    Waiting,
    /// Submitted, in flight.
    Pending,
    /// All bytes moved (for writes: landed in the target's memory).
    Completed,
    /// Failed, with the reason.
    Failed(TransferError),
    /// The batch's deadline passed before it finished.
    Timeout,
    /// Canceled by the caller.
    Canceled,
}

impl TransferStatus {
    /// Whether the task will not change any more.
    pub fn is_finished(&self) -> bool {
        !matches!(self, Self::Waiting | Self::Pending)
    }

    /// Mooncake's numeric status (`WAITING=0 … FAILED=6`).
    pub fn mooncake_code(&self) -> i32 {
        match self {
            Self::Waiting => 0,
            Self::Pending => 1,
            Self::Canceled => 3,
            Self::Completed => 4,
            Self::Timeout => 5,
            Self::Failed(_) => 6,
        }
    }
}

impl fmt::Display for TransferStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Waiting => f.write_str("waiting"),
            Self::Pending => f.write_str("pending"),
            Self::Completed => f.write_str("completed"),
            Self::Failed(e) => write!(f, "failed: {e}"),
            Self::Timeout => f.write_str("timed out"),
            Self::Canceled => f.write_str("canceled"),
        }
    }
}

/// One task's status and how many bytes it moved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskStatus {
    /// Where it stands.
    pub status: TransferStatus,
    /// Bytes moved so far.
    pub transferred_bytes: u64,
    /// For an ended write: whether bytes of it may still land at the peer after this status
    /// was read (a slice was cut off, or failed, after some of its bytes had left, without
    /// their landing confirmed). False for reads and for writes whose unfinished slices never
    /// left. A write shown Completed has it false: no byte of any earlier send of it (one
    /// that a transport sent again on another connection, say) lands after it completed, so
    /// its range may be written again at once. The local memory is never touched again once
    /// a task shows Timeout, Canceled or Failed.
    pub remote_may_change: bool,
}

/// A batch's aggregate state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchState {
    /// Some task is still in flight and none has ended badly.
    Pending,
    /// Every submitted task completed.
    Completed,
    /// Some task failed, timed out or was canceled.
    Failed,
}

/// A batch's tasks, counted by how they stand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchStatus {
    /// The aggregate.
    pub state: BatchState,
    /// Tasks submitted.
    pub submitted: usize,
    /// Tasks completed.
    pub completed: usize,
    /// Tasks failed, timed out or canceled.
    pub failed: usize,
    /// Tasks in flight.
    pub pending: usize,
    /// Bytes moved by all tasks.
    pub transferred_bytes: u64,
}

/// A notification received from a peer (`send_notify`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Notify {
    /// Sender-chosen name.
    pub name: String,
    /// The message.
    pub notify_msg: String,
}
