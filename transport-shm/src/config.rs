//! The transport's settings.

use std::time::Duration;

use crate::WORKERS_ENV;
use crate::error::ShmError;

/// Whether other processes may reach this one by cross-memory attach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PtracePolicy {
    /// Leave the process as it is: peers of the same user attach where the kernel lets them
    /// (everywhere without Yama or with `ptrace_scope` 0; with 1 only ancestors).
    #[default]
    Keep,
    /// With Yama's `ptrace_scope` 1, let any process of this user attach
    /// (`prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`), so that same-host peers can reach
    /// registered memory that is not a memfd. A wide grant: opt in only where every process
    /// of the user is trusted.
    AllowSameUser,
    /// Make the process not dumpable (`prctl(PR_SET_DUMPABLE, 0)`): no process without
    /// `CAP_SYS_PTRACE` can attach, so peers reach only its memfd buffers this way and move
    /// everything else over the next transport. (It also stops core dumps.)
    Refuse,
}

impl PtracePolicy {
    /// Applies the policy to this process.
    pub(crate) fn apply(self) -> Result<(), ShmError> {
        let applied = match self {
            Self::Keep => Ok(()),
            Self::AllowSameUser => tern_memreg::shm::allow_ptrace_by_same_user().map(|_| ()),
            Self::Refuse => tern_memreg::shm::set_dumpable(false),
        };
        applied.map_err(|source| ShmError::Ptrace {
            policy: self,
            source,
        })
    }
}

/// Settings of the shared-memory transport.
#[derive(Debug, Clone)]
pub struct ShmConfig {
    /// Whether [`TransferEngine::allocate`](tern_engine::TransferEngine::allocate) hands out
    /// memfd-backed buffers (peers map them). Off: ordinary memory, which peers reach by
    /// cross-memory attach.
    pub memfd_buffers: bool,
    /// What this process allows peers' cross-memory attach.
    pub ptrace: PtracePolicy,
    /// Threads that copy (default: one fewer than the cores, 1 to 4; `TERN_SHM_WORKERS`). A
    /// submit's slices are spread over them and the thread that waits for the batch, which
    /// copies a part itself instead of spinning; they sleep when there is nothing to copy.
    pub workers: usize,
    /// Largest slice.
    pub slice_size: usize,
    /// Bound on making a link (connect, exchange, probe) and on the peer's handshake RPC
    /// when its socket does not open.
    pub connect_timeout: Duration,
    /// Bound on each answer on a link (open, lease).
    pub io_timeout: Duration,
    /// How long unregistering waits for peers to confirm they unmapped a buffer.
    pub revoke_timeout: Duration,
    /// Peers served at once; connections still in their opening (credentials, the
    /// cluster-secret proof, the hello) have as many places again, the oldest given up for a
    /// newcomer.
    pub max_inbound: usize,
    /// How long a peer's connection may take from being accepted to its hello (with a
    /// cluster secret, its proof first) before it is closed.
    pub exchange_timeout: Duration,
}

impl Default for ShmConfig {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let workers = std::env::var(WORKERS_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| (1..=64).contains(&n))
            // The waiting thread is one more pair of hands.
            .unwrap_or((cores - 1).clamp(1, 4));
        Self {
            memfd_buffers: true,
            ptrace: PtracePolicy::Keep,
            workers,
            slice_size: 1 << 20,
            connect_timeout: Duration::from_secs(2),
            io_timeout: Duration::from_secs(10),
            revoke_timeout: Duration::from_secs(5),
            max_inbound: 256,
            exchange_timeout: tern_metadata::auth::EXCHANGE_TIMEOUT,
        }
    }
}
