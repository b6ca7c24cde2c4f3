//! Making a link and confirming the peer is same-host: its socket opens only inside its
//! network namespace, the kernel's credentials must show this node's user, with a cluster
//! secret the peer proves it, it must answer as the segment asked for, and reading back by
//! cross-memory attach the nonce it was given proves which process answered (and whether
//! the kernel permits attaching to it). A peer whose socket does not open is not same-host
//! if its handshake RPC answers, and gone if that does not either.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::Arc;

use tern_engine::PeerSegment;
use tern_memreg::shm::{AttachFailure, PeerProcess, peer_credentials};
use tern_metadata::auth::{self, Channel, Claims};
use tern_metadata::rpc::RpcType;

use super::attach::Attach;
use super::{Link, Links};
use crate::identity::VERSION;
use crate::wire::{self, Frame, FrameReader, MAGIC, NONCE_LEN};

/// Why a peer could not be reached.
pub(super) enum Unreached {
    NotSameHost(String),
    Gone(String),
}

impl Links {
    /// Connects to `peer`'s socket and confirms it is same-host, step by step; the link, its
    /// reader started.
    pub(super) fn connect(&self, peer: &PeerSegment, socket: &str) -> Result<Arc<Link>, Unreached> {
        let stream = self.dial(peer, socket)?;
        let cred = peer_credentials(&stream).map_err(not_same("SO_PEERCRED"))?;
        let uid = tern_memreg::shm::effective_uid();
        if cred.uid != uid {
            return Err(Unreached::NotSameHost(format!(
                "its socket {socket:?} belongs to uid {}, this node runs as {uid}",
                cred.uid
            )));
        }
        self.prove_secret(&stream, peer, socket)?;
        let mut reader = FrameReader::new();
        let (nonce, probe_addr) = self.greet(&stream, &mut reader, peer, socket)?;
        let attach = if cred.pid == std::process::id() as i32 {
            match crate::server::in_process(socket) {
                Some(registry) => Attach::SameProcess(registry),
                None => Attach::Refused("this process, but its engine is gone".into()),
            }
        } else {
            match probe(cred.pid, probe_addr, &nonce) {
                Ok(process) => Attach::Process(process),
                Err(why) => {
                    tracing::debug!("shm peer {}: no cross-memory attach: {why}", peer.name);
                    Attach::Refused(why)
                }
            }
        };
        self.start_link(peer, stream, reader, attach)
    }

    /// The peer's socket, open, its reads and writes bounded by the connect timeout.
    fn dial(&self, peer: &PeerSegment, socket: &str) -> Result<UnixStream, Unreached> {
        let addr = SocketAddr::from_abstract_name(socket.as_bytes())
            .map_err(|e| Unreached::NotSameHost(format!("socket name {socket:?}: {e}")))?;
        let stream = match UnixStream::connect_addr(&addr) {
            Ok(stream) => stream,
            Err(e) => return Err(self.unreachable(peer, socket, &e)),
        };
        stream
            .set_read_timeout(Some(self.connect_timeout))
            .map_err(not_same("setting up its socket"))?;
        stream
            .set_write_timeout(Some(self.connect_timeout))
            .map_err(not_same("setting up its socket"))?;
        Ok(stream)
    }

    /// With a cluster secret, the exchange that proves it both ways.
    fn prove_secret(
        &self,
        stream: &UnixStream,
        peer: &PeerSegment,
        socket: &str,
    ) -> Result<(), Unreached> {
        let Some(secret) = self.context.cluster_secret() else {
            return Ok(());
        };
        let claims = Claims {
            client_segment: self.context.segment_name.clone(),
            server_segment: peer.name.clone(),
            dialed: socket.to_owned(),
        };
        let mut io = stream;
        auth::client_handshake(&mut io, secret, Channel::Shm, claims).map_err(|e| {
            Unreached::NotSameHost(format!("cluster-secret exchange on its socket: {e}"))
        })
    }

    /// The hello and the peer's welcome, which must answer as the segment asked for: the
    /// nonce sent, and where the peer says it now is.
    fn greet(
        &self,
        stream: &UnixStream,
        reader: &mut FrameReader,
        peer: &PeerSegment,
        socket: &str,
    ) -> Result<([u8; NONCE_LEN], u64), Unreached> {
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce)
            .map_err(|e| Unreached::NotSameHost(format!("no random nonce: {e}")))?;
        let hello = Frame::Hello {
            magic: MAGIC,
            version: VERSION as u16,
            nonce,
            client_segment: self.context.segment_name.clone(),
            server_segment: peer.name.clone(),
        };
        wire::send(stream, &hello.encode()).map_err(not_same("sending hello"))?;
        let (probe_addr, segment) = match reader.next(stream) {
            Ok(Some(Frame::Welcome {
                version,
                probe_addr,
                segment,
            })) if u64::from(version) == VERSION => (probe_addr, segment),
            Ok(Some(Frame::Refused { reason })) => {
                return Err(Unreached::NotSameHost(format!(
                    "its socket refused us: {reason}"
                )));
            }
            Ok(other) => {
                return Err(Unreached::NotSameHost(format!(
                    "its socket answered {other:?}, not a welcome"
                )));
            }
            Err(e) => {
                return Err(Unreached::NotSameHost(format!("reading its welcome: {e}")));
            }
        };
        if segment != peer.name {
            return Err(Unreached::NotSameHost(format!(
                "its socket {socket:?} answers as segment {segment:?}, not {:?}",
                peer.name
            )));
        }
        Ok((nonce, probe_addr))
    }

    /// The link over the confirmed `stream`, its reader started on the read side.
    fn start_link(
        &self,
        peer: &PeerSegment,
        stream: UnixStream,
        reader: FrameReader,
        attach: Attach,
    ) -> Result<Arc<Link>, Unreached> {
        stream
            .set_read_timeout(None)
            .map_err(not_same("setting up its socket"))?;
        let write_half = stream.try_clone().map_err(not_same("cloning its socket"))?;
        let link = Arc::new(Link::new(
            peer.name.clone(),
            write_half,
            attach,
            self.io_timeout,
            self.device_declines.clone(),
        ));
        let reading = link.clone();
        let reader = std::thread::Builder::new()
            .name("tern-shm-link".into())
            .spawn(move || reading.read_loop(&stream, reader))
            .map_err(not_same("starting its reader"))?;
        let mut readers = self.readers.lock();
        readers.retain(|r| !r.is_finished());
        readers.push(reader);
        Ok(link)
    }

    /// The peer's socket does not open: not same-host if its handshake RPC answers (it lives
    /// elsewhere, or in another network namespace), gone if that does not answer either.
    fn unreachable(&self, peer: &PeerSegment, socket: &str, error: &io::Error) -> Unreached {
        match self
            .context
            .call_peer(peer, RpcType::Probe, b"{}", Some(self.connect_timeout))
        {
            Ok(_) => Unreached::NotSameHost(format!(
                "cannot connect to its socket {socket:?} ({error}) though it answers: not \
                 same-host (another network namespace or host)"
            )),
            Err(rpc) => Unreached::Gone(format!(
                "its socket {socket:?} refuses ({error}) and its handshake RPC too ({rpc})"
            )),
        }
    }
}

/// A failure of a step of the set-up, as not same-host.
fn not_same(what: &str) -> impl Fn(io::Error) -> Unreached + '_ {
    move |e: io::Error| Unreached::NotSameHost(format!("{what}: {e}"))
}

/// Reads `nonce` back from `probe_addr` in process `pid`: `Ok` when the kernel permits
/// cross-memory attach to it and it is the process that answered on the socket.
fn probe(pid: i32, probe_addr: u64, nonce: &[u8; NONCE_LEN]) -> Result<PeerProcess, String> {
    let process = PeerProcess::new(pid).map_err(|e| e.to_string())?;
    let mut seen = [0u8; NONCE_LEN];
    process
        .read_bytes(probe_addr, &mut seen)
        .map_err(|e| match AttachFailure::of(&e) {
            AttachFailure::Refused => format!(
                "process_vm_readv into process {pid} refused ({e}): the kernel does not let \
                 this process ptrace it (it is not dumpable, or Yama's ptrace_scope forbids it)"
            ),
            _ => format!("process_vm_readv into process {pid}: {e}"),
        })?;
    if &seen != nonce {
        return Err(format!(
            "process {pid} does not hold the nonce it was given (another PID namespace?)"
        ));
    }
    Ok(process)
}
