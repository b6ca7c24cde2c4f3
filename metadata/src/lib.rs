//! Who is where, and what memory they expose.
//!
//! `tern-metadata` defines the segment descriptors ([`SegmentDesc`], [`BufferDesc`],
//! [`DeviceDesc`]) byte-compatible with Mooncake's JSON, the key layout of metadata stores,
//! the [`MetadataStore`] trait with its stores, the handshake RPC ([`rpc`]: framing, server,
//! client), the cluster-secret challenge–response that opens RPC and data connections
//! ([`auth`]), how a node picks the address it advertises ([`net`]), and text cut to a
//! length field without splitting a character ([`text`]).
//!
//! It must not move data or know about batches, transports' internals or registered memory:
//! transports hand their part of a descriptor to the engine, which publishes it here.
#![forbid(unsafe_code)]

pub mod auth;
mod desc;
mod error;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod http;
pub mod keyed;
pub mod keys;
pub mod net;
pub mod rpc;
pub mod seal;
mod store;
pub mod text;

pub use desc::{BufferDesc, DescriptorError, DeviceDesc, PriorityMatrix, SegmentDesc};
pub use error::MetadataError;
pub use store::{
    EtcdCredentials, EtcdTls, MetadataConn, MetadataEvent, MetadataListener, MetadataStore,
    P2pStore, RpcMeta, StoreOptions, open_store,
};
