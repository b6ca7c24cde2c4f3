//! What a queue pair is made with (its queues' sizes) and connected with (the peer, the path).

use rdma_sys as sys;

use crate::gid::Gid;

/// Sizes of a queue pair's queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send work requests.
    pub max_send_wr: u32,
    /// Outstanding receive work requests.
    pub max_recv_wr: u32,
    /// SGEs per work request.
    pub max_sge: u32,
    /// Inline data bytes.
    pub max_inline: u32,
    /// Of the send requests of one [`QueuePair::post_send`](super::QueuePair::post_send),
    /// every this many and the last are signalled (1: all). The rest are retired by the next
    /// signalled completion.
    pub signal_every: u32,
}

impl Default for QpCaps {
    /// Mooncake's: 256 WRs, 4 SGEs, 64 bytes inline; one request in 32 signalled.
    fn default() -> Self {
        Self {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_sge: 4,
            max_inline: 64,
            signal_every: 32,
        }
    }
}

/// What the passive side of a connection needs to know about the other end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Its QP number.
    pub qp_num: u32,
    /// Its first packet sequence number.
    pub psn: u32,
    /// Its GID.
    pub gid: Gid,
    /// Its LID (0 on RoCE).
    pub lid: u16,
}

/// Path settings for RTR and RTS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathConfig {
    /// Local port.
    pub port: u8,
    /// Local GID index.
    pub sgid_index: u8,
    /// Path MTU (verbs enum, 1..=5); the smaller of both ends' active MTUs.
    pub mtu: u32,
    /// ACK timeout exponent (Mooncake: 14 ≈ 67 ms).
    pub timeout: u8,
    /// Retries on timeout (7 means "forever" on some devices).
    pub retry_count: u8,
    /// Retries on receiver-not-ready.
    pub rnr_retry: u8,
    /// Our first packet sequence number.
    pub psn: u32,
}

impl Default for PathConfig {
    fn default() -> Self {
        Self {
            port: 1,
            sgid_index: 0,
            mtu: sys::ibv_mtu::IBV_MTU_4096,
            timeout: 14,
            retry_count: 6,
            rnr_retry: 7,
            psn: 0,
        }
    }
}
