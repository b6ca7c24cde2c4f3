//! A stand-in for a Mooncake node on Soft-RoCE: its own verbs objects and registered buffer,
//! a handshake RPC server that answers Metadata with a descriptor shaped like the golden
//! Mooncake one and Connection with frames shaped exactly like the golden recording (its own
//! GID, path and QP numbers in place of the recorded ones), and a way to send the golden
//! active-side frames to a Tern node.

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use serde_json::{Value, json};
use tern_memreg::nic::{NicKeys, register_on_devices};
use tern_memreg::{AlignedBuffer, MemoryRegistry, Region, RegionPin};
use tern_metadata::rpc::{RpcServer, RpcServerConfig, RpcType};
use tern_verbs::{
    Access, CompletionError, CompletionQueue, Context, Gid, PathConfig, Peer, ProtectionDomain,
    QpCaps, QueuePair, SendOp, SendWork, Sge,
};

#[path = "../../../testkit/include/completions.rs"]
mod completions;
use completions::post_and_retire;

/// The stand-in's QPs: each request holds a pin on the stand-in's memory.
pub type StandinQp = QueuePair<RegionPin, u64>;

const RECORDING: &str = include_str!("../golden/mooncake-rdma-connection-rpc.txt");
const SEGMENT: &str = include_str!("../golden/mooncake-rdma-segment.json");

/// The recorded frames, in order: request, reply, ready ACK, its reply, a rejection.
pub struct Golden {
    pub req: String,
    pub rep: String,
    pub req_ack: String,
    pub rep_ack: String,
    pub rejection: String,
}

pub fn golden() -> Golden {
    let frames: Vec<String> = RECORDING
        .lines()
        .filter_map(|l| {
            l.strip_prefix("REQ 0 ")
                .or_else(|| l.strip_prefix("REP 0 "))
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(frames.len(), 5, "the recording has five frames");
    Golden {
        req: frames[0].clone(),
        rep: frames[1].clone(),
        req_ack: frames[2].clone(),
        rep_ack: frames[3].clone(),
        rejection: frames[4].clone(),
    }
}

/// Mooncake's wire form of a JSON value: compact, keys sorted, one trailing newline.
pub fn wire(value: &Value) -> String {
    format!("{value}\n")
}

/// The keys of a JSON object.
pub fn keys(json: &str) -> Vec<String> {
    let value: Value = serde_json::from_str(json.trim()).unwrap();
    value.as_object().unwrap().keys().cloned().collect()
}

/// Verbs objects of the stand-in, and its registered buffer.
pub struct Verbs {
    pub pd: Arc<ProtectionDomain>,
    pub cq: Arc<CompletionQueue>,
    pub gid: Gid,
    pub path: PathConfig,
    registry: MemoryRegistry,
    pub pin: RegionPin,
    pub keys: NicKeys,
}

impl Verbs {
    pub fn open(device: &str, len: usize) -> Self {
        let context = Context::open(device).unwrap();
        let port = context.port(1).unwrap();
        let gid = context.select_gid(1, None).unwrap();
        let pd = ProtectionDomain::new(&context).unwrap();
        let cq = CompletionQueue::new(&context, 1024).unwrap();
        let registry = MemoryRegistry::new();
        let region = registry
            .register(Region::owned(
                AlignedBuffer::new(len).unwrap(),
                "cpu:0",
                true,
            ))
            .unwrap();
        let pin = registry.pin(region.addr(), len).unwrap();
        let keys = register_on_devices(&pin, std::slice::from_ref(&pd), Access::REMOTE).unwrap();
        Self {
            path: PathConfig {
                sgid_index: gid.index as u8,
                mtu: port.active_mtu,
                retry_count: 3,
                ..PathConfig::default()
            },
            gid: gid.gid,
            pd,
            cq,
            registry,
            pin,
            keys,
        }
    }

    pub fn addr(&self) -> usize {
        self.pin.info().addr
    }

    pub fn len(&self) -> usize {
        self.pin.info().len
    }

    /// `n` RC QPs in INIT.
    pub fn qps(&self, n: usize) -> Vec<StandinQp> {
        (0..n)
            .map(|_| {
                let qp = StandinQp::new_rc(&self.pd, &self.cq, QpCaps::default()).unwrap();
                qp.to_init(1).unwrap();
                qp
            })
            .collect()
    }

    /// Connects QP i to the peer's QP i.
    pub fn connect(&self, qps: &[StandinQp], gid: Gid, peer_qps: &[u32]) {
        assert_eq!(qps.len(), peer_qps.len());
        for (qp, &qp_num) in qps.iter().zip(peer_qps) {
            let peer = Peer {
                qp_num,
                psn: 0,
                gid,
                lid: 0,
            };
            qp.to_rtr(&peer, &self.path).unwrap();
            qp.to_rts(&self.path).unwrap();
        }
    }

    /// Posts one request on `qp` (holding a pin on the memory) and waits for its completion,
    /// which retires it; returns its status.
    pub fn run(
        &self,
        qp: &StandinQp,
        op: SendOp,
        offset: usize,
        len: usize,
    ) -> Result<(), CompletionError> {
        let work = SendWork {
            op,
            local: Sge {
                addr: (self.addr() + offset) as u64,
                len: len as u32,
                lkey: self.keys.lkeys[0],
            },
            guard: self.pin.clone(),
            user: 1,
        };
        post_and_retire(qp, work)
    }

    pub fn write_at(&self, offset: usize, bytes: &[u8]) {
        self.pin
            .copy_from_slice(self.addr() + offset, bytes)
            .unwrap();
    }

    pub fn read_at(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; len];
        self.pin
            .copy_to_slice(self.addr() + offset, &mut bytes)
            .unwrap();
        bytes
    }

    /// The stand-in's descriptor: the golden one with this node's name, GID, buffer and keys.
    pub fn descriptor(&self, name: &str, device: &str) -> String {
        let mut desc: Value = serde_json::from_str(SEGMENT).unwrap();
        desc["name"] = json!(name);
        desc["devices"][0]["gid"] = json!(self.gid.to_string());
        desc["devices"][0]["name"] = json!(device);
        let buffer = &mut desc["buffers"][0];
        buffer["addr"] = json!(self.addr());
        buffer["length"] = json!(self.len());
        buffer["lkey"] = json!(self.keys.lkeys);
        buffer["rkey"] = json!(self.keys.rkeys);
        wire(&desc)
    }
}

/// A passive stand-in: serves Metadata and Connection like the recorded Mooncake target.
pub struct StandIn {
    pub name: String,
    pub verbs: Arc<Verbs>,
    /// Every Connection exchange: (request, reply) as on the wire.
    pub exchanges: Arc<Mutex<Vec<(String, String)>>>,
    _server: RpcServer,
}

impl StandIn {
    pub fn start(device: &str, len: usize) -> Self {
        let verbs = Arc::new(Verbs::open(device, len));
        let exchanges = Arc::new(Mutex::new(Vec::new()));
        let name: Arc<OnceLock<String>> = Arc::new(OnceLock::new());
        let connected: Arc<Mutex<Vec<StandinQp>>> = Arc::new(Mutex::new(Vec::new()));
        let golden = golden();
        let handler = {
            let (verbs, exchanges, name, device) = (
                verbs.clone(),
                exchanges.clone(),
                name.clone(),
                device.to_owned(),
            );
            move |ty: RpcType, body: &[u8]| -> Result<Vec<u8>, String> {
                let me = name.get().cloned().unwrap_or_default();
                let text = String::from_utf8_lossy(body).into_owned();
                let reply = match ty {
                    RpcType::Metadata => verbs.descriptor(&me, &device),
                    RpcType::Connection => {
                        let request: Value =
                            serde_json::from_str(&text).map_err(|e| e.to_string())?;
                        let reply = if request["ready_ack"] == json!(true) {
                            format!("{}\n", golden.rep_ack)
                        } else {
                            let peer_gid = Gid::parse(request["local_gid"].as_str().unwrap_or(""))
                                .ok_or("bad GID")?;
                            let peer_qps: Vec<u32> =
                                serde_json::from_value(request["qp_num"].clone())
                                    .map_err(|e| e.to_string())?;
                            let qps = verbs.qps(peer_qps.len());
                            verbs.connect(&qps, peer_gid, &peer_qps);
                            let mut reply: Value = serde_json::from_str(&golden.rep).unwrap();
                            reply["local_gid"] = json!(verbs.gid.to_string());
                            reply["local_nic_path"] = json!(format!("{me}@{device}"));
                            reply["peer_nic_path"] = request["local_nic_path"].clone();
                            reply["qp_num"] =
                                json!(qps.iter().map(StandinQp::qp_num).collect::<Vec<_>>());
                            connected.lock().extend(qps);
                            wire(&reply)
                        };
                        exchanges.lock().push((text, reply.clone()));
                        reply
                    }
                    _ => return Err(format!("the stand-in does not answer {ty:?}")),
                };
                Ok(reply.into_bytes())
            }
        };
        let server = RpcServer::start(
            "127.0.0.1".parse().unwrap(),
            RpcServerConfig::default(),
            Arc::new(handler),
        )
        .unwrap();
        let full = format!("127.0.0.1:{}", server.local_addr().port());
        let _ = name.set(full.clone());
        Self {
            name: full,
            verbs,
            exchanges,
            _server: server,
        }
    }
}
