//! The one error type of the crate, and errno.

/// `errno` of "function not implemented": what `ibv_get_device_list` reports on kernels
/// built without InfiniBand.
pub const ENOSYS: i32 = 38;

/// Whether a failed `ibv_get_device_list` call (NULL result) with this `errno` means "no
/// devices" rather than a failure worth reporting.
pub fn null_device_list_means_no_devices(errno: i32) -> bool {
    errno == ENOSYS || errno == 0
}

/// A verb that failed. Each variant is one verb and carries `errno`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// `ibv_get_device_list` failed for a reason other than "no RDMA in this kernel".
    #[error("ibv_get_device_list failed (errno {0})")]
    GetDeviceList(i32),
    /// No device has this name; `device_names()` lists what there is.
    #[error("no RDMA device named {0:?}")]
    NoSuchDevice(String),
    /// `ibv_open_device` failed.
    #[error("ibv_open_device({device}) failed (errno {errno})")]
    OpenDevice {
        /// Device name.
        device: String,
        /// errno.
        errno: i32,
    },
    /// `ibv_query_device` failed.
    #[error("ibv_query_device failed (errno {0})")]
    QueryDevice(i32),
    /// `ibv_query_port` failed.
    #[error("ibv_query_port(port {port}) failed (errno {errno})")]
    QueryPort {
        /// Port number.
        port: u8,
        /// errno.
        errno: i32,
    },
    /// `ibv_query_gid` failed.
    #[error("ibv_query_gid(port {port}, index {index}) failed (errno {errno})")]
    QueryGid {
        /// Port number.
        port: u8,
        /// GID index.
        index: u32,
        /// errno.
        errno: i32,
    },
    /// No usable GID on the port (none is RoCE with an address, or the table is empty).
    #[error("no usable GID on {device} port {port}; set the GID index by hand (MC_GID_INDEX)")]
    NoUsableGid {
        /// Device.
        device: String,
        /// Port.
        port: u8,
    },
    /// `ibv_alloc_pd` failed.
    #[error("ibv_alloc_pd failed (errno {0})")]
    AllocPd(i32),
    /// `ibv_reg_mr` failed.
    #[error("ibv_reg_mr of {len} bytes failed (errno {errno})")]
    RegMr {
        /// Bytes asked for.
        len: usize,
        /// errno.
        errno: i32,
    },
    /// `ibv_reg_mr` failed because the locked-memory limit is too low.
    #[error(
        "ibv_reg_mr of {len} bytes failed: the locked-memory limit is {limit}; raise it (`ulimit -l unlimited`, or LimitMEMLOCK= for a service)"
    )]
    MemlockLimit {
        /// Bytes asked for.
        len: usize,
        /// The limit as /proc/self/limits states it.
        limit: String,
    },
    /// `ibv_create_cq` failed.
    #[error("ibv_create_cq({entries} entries) failed (errno {errno})")]
    CreateCq {
        /// Entries asked for.
        entries: i32,
        /// errno.
        errno: i32,
    },
    /// `ibv_poll_cq` failed.
    #[error("ibv_poll_cq failed (returned {0})")]
    PollCq(i32),
    /// `ibv_create_qp` failed.
    #[error("ibv_create_qp failed (errno {0})")]
    CreateQp(i32),
    /// `ibv_modify_qp` to a state failed.
    #[error("ibv_modify_qp to {state} failed (errno {errno})")]
    ModifyQp {
        /// Target state.
        state: &'static str,
        /// errno.
        errno: i32,
    },
    /// `ibv_post_send` refused a request; the first `posted` requests of the chain were
    /// posted and will complete, the rest were not.
    #[error("ibv_post_send failed after {posted} request(s) (errno {errno})")]
    PostSend {
        /// errno.
        errno: i32,
        /// Requests at the head of the chain that were posted.
        posted: usize,
    },
    /// `ibv_post_recv` refused a request; the first `posted` were posted.
    #[error("ibv_post_recv failed after {posted} request(s) (errno {errno})")]
    PostRecv {
        /// errno.
        errno: i32,
        /// Requests at the head of the chain that were posted.
        posted: usize,
    },
    /// `ibv_post_send` or `ibv_post_recv` (`verb`) failed without naming the request it
    /// refused (`bad_wr` unset or outside the chain), so any of the `chain` requests may be
    /// on the device. They are all treated as posted: a tracked request keeps its memory
    /// guard until its completion or flush retires it, and the QP was moved to the error
    /// state (`flushed`; false if that failed too) so that the posted ones flush.
    #[error(
        "{verb} failed (errno {errno}) without naming which of {chain} request(s) it refused; all count as posted and the QP was moved to the error state (done: {flushed})"
    )]
    PostUncertain {
        /// The verb.
        verb: &'static str,
        /// errno.
        errno: i32,
        /// Requests in the chain, all treated as posted.
        chain: usize,
        /// Whether the QP is now in the error state.
        flushed: bool,
    },
    /// A work request list or SGE list was invalid before reaching the device.
    #[error("invalid work request: {0}")]
    InvalidRequest(&'static str),
}

pub(crate) fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}
