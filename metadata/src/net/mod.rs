//! Addresses and ports (what a node advertises, how it binds its listeners), the one accept
//! loop every listener runs ([`Acceptor`]), frame deadlines ([`DeadlineRead`]) and the one
//! way to dial a peer ([`dial`]).

mod acceptor;
mod addr;
mod deadline;
mod dial;
mod listen;
mod replayed;
mod served;
mod slots;

pub use acceptor::{Acceptor, Handler};
pub use addr::{
    BIND_ADDRESS_ENV, BIND_ATTEMPTS, DEFAULT_PORT_RANGE, PortChoice, advertised_ip, bind_listener,
    host_part, split_host_port,
};
pub use deadline::{DeadlineRead, READ_TICK, is_tick};
pub use dial::{Dial, DialAuth, DialError, dial};
pub use listen::{Listen, ServeStream, wake_acceptor};
pub use replayed::Replayed;
pub use served::{ServeLimits, Served};
