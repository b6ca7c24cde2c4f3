//! The contract between the engine and a transport.
//!
//! The engine checks and slices every request; a transport only moves slices and reports
//! each one's outcome, from whatever thread it likes. Transports never publish metadata:
//! they describe their part of the local descriptor when asked, and ask the engine to
//! publish again when that part changes.
//!
//! The parts: the [`Transport`] trait ([`contract`]), what a transport is given at start
//! ([`context`]) and how it fails outside a transfer ([`error`]); segments as transports see
//! them ([`segment`]); the transports that reach a peer ([`routes`]); what the slices of one
//! submit call share ([`submission`]); and the [`Slice`] itself ([`slice`](mod@slice)): the
//! tasks a slice of a merged run carries ([`run`]), runs kept for use again ([`run_pool`]), how it reports ([`outcome`]), cut into
//! pieces ([`cut`]) or handed to the next transport ([`decline`]).

mod context;
mod contract;
mod cut;
mod decline;
mod error;
mod outcome;
mod routes;
mod run;
mod run_pool;
mod segment;
mod slice;
mod submission;

pub use context::TransportContext;
pub use contract::Transport;
pub use error::TransportError;
pub(crate) use routes::Routes;
pub(crate) use run::{RunHead, TaskPart};
pub(crate) use run_pool::RunPool;
pub use segment::{PeerSegment, keyless_buffer};
pub use slice::Slice;
pub use submission::Submission;
