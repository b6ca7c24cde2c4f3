//! The client side: a pool of persistent connections per peer, each with one lane thread
//! taking slices from the pool's queue, so slices stripe across connections.
//!
//! A lane pipelines: it keeps up to `PIPELINE_SLICES` requests (and `PIPELINE_BYTES`; of
//! writes `WRITE_PIPELINE_BYTES`, all in [`window`]) on its connection, and sends requests and
//! takes replies at the same time over a non-blocking socket, waiting in `poll(2)` for
//! whichever can move. Reads and writes mixed in one group therefore never deadlock: read
//! replies filling the socket buffers are taken while write bodies are still going out.
//!
//! A slice whose task has ended is never started; one already on the wire is cut off when
//! the engine asks ([`Pool::cut_off`]): the lane drops its connection, so that no reply lands
//! in that slice's memory and no more of a write's body is read from it, gives the slice
//! back, and sends the live slices that were on that connection again on a new one — writes
//! only once the server has closed the dropped one, so that no older copy of a write lands
//! after it was reported Completed ([`cut_off`]).
//!
//! A pool ([`pool`]) starts one lane per connection ([`lane`]); a lane's [`window`] holds
//! what it has taken on, sends requests ([`send`]), takes replies ([`receive`]) and cuts off
//! slices of ended tasks ([`cut_off`]). The short-call marks ([`marks`]) are a speed trick
//! apart from them: calls that could only say `WouldBlock` are not made.

mod cut_off;
mod lane;
mod marks;
mod pool;
mod receive;
mod send;
mod window;

pub(crate) use pool::{Pool, PoolAuth};
