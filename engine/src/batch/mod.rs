//! Batches and tasks: the bookkeeping between submit and completion.
//!
//! A task's state lives in atomics so that status reads take no lock; a finished task never
//! changes again (the first final state wins a compare-and-swap). Waiters sleep on a condvar
//! that the last task to finish signals; each slice costs one atomic add on its task (or on
//! its merged run, which ends its tasks together).
//!
//! A task that ends other than Completed (deadline, cancel, a failed slice) is *reported*
//! so only once every slice of it has let go (reported, abandoned or dropped): until then a
//! status read shows it Pending, and waiters ask the transports to cut its slices off
//! ([`Transport::cut_off`](crate::Transport::cut_off)) and wait up to [`DRAIN`] for them.
//! So whoever sees a task Timeout, Canceled or Failed knows that no slice of it touches
//! local memory any more. The count is the one the slices keep anyway: every slice,
//! whatever its outcome, adds one to its task's progress word, and the one that brings it
//! to the total settles the task. A task of a merged run has one such slice, the run: its
//! slices count down on the run, and the last to let go reports the run to each of its
//! tasks.
//!
//! The parts: one task's state word ([`task`]) and a batch's table of them, which the
//! engine's tally reads ([`table`]); the batch's lifecycle from reserve to settled tasks
//! ([`lifecycle`]); status reads ([`status`]); waiting ([`wait`]); deadlines and cancel,
//! and cutting off the slices of ended tasks ([`deadline`]); completion hooks ([`hooks`]);
//! the handle users hold ([`handle`]); and the large task tables and merged runs' parts kept
//! from batches gone for the next ones ([`kept`]).

mod counts;
mod deadline;
mod handle;
mod hooks;
mod kept;
mod lifecycle;
#[cfg(all(test, feature = "loom"))]
mod model;
mod status;
mod sync;
mod table;
mod task;
#[cfg(test)]
mod tests;
mod wait;

pub(crate) use counts::MAX_CAPACITY;
pub use deadline::DRAIN;
pub use handle::Batch;
pub(crate) use kept::{KEEP_FROM, KeptRoom};
pub(crate) use lifecycle::BatchInner;
pub(crate) use table::tally_tasks;
pub(crate) use task::MAX_TASK_BYTES;
pub(crate) use wait::Helpers;
