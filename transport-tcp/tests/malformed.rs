//! Bad bytes on the TCP data port and on the handshake RPC port, sent over raw loopback
//! sockets: the server drops (or answers) that connection, keeps serving everyone else, and
//! no well-behaved transfer loses anything. Also: the RPC replies have the exact shape a
//! Mooncake node's have (golden samples).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use tern_engine::{
    OwnedBuffer, RegisterRaw, SegmentDesc, SegmentId, TransferEngine, TransferRequest,
};
use tern_transport_tcp::{
    FRAME_ALIGN, Header, OP_ALIGNED, OP_READ, OP_V2, OP_WRITE, STATUS_MAGIC, TcpConfig,
    TcpTransport,
};

const GOLDEN_RPC: &str = include_str!("../../metadata/tests/golden/mooncake-p2p-metadata-rpc.txt");

fn engine(idle_timeout: Duration) -> TransferEngine {
    TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(TcpTransport::new(TcpConfig {
            idle_timeout,
            ..TcpConfig::default()
        }))
        .build()
        .unwrap()
}

struct Setup {
    target: TransferEngine,
    initiator: TransferEngine,
    peer: SegmentId,
    remote: OwnedBuffer,
    local: OwnedBuffer,
    data_port: u16,
}

fn setup() -> Setup {
    let target = engine(Duration::from_millis(500));
    let initiator = engine(Duration::from_secs(300));
    let remote = target.allocate(1 << 20, "cpu:0").unwrap();
    let local = initiator.allocate(1 << 20, "cpu:0").unwrap();
    let peer = initiator.open_segment(target.segment_name()).unwrap();
    let data_port = target.local_descriptor().tcp_data_port;
    Setup {
        target,
        initiator,
        peer,
        remote,
        local,
        data_port,
    }
}

impl Setup {
    /// A write and a read through the engine still work and move the right bytes.
    fn still_serves(&self, seed: u8) {
        let data: Vec<u8> = (0..65536u32)
            .map(|i| (i as u8).wrapping_mul(seed) ^ seed)
            .collect();
        self.local.write_at(0, &data).unwrap();
        let remote = self.remote.addr() as u64 + 4096;
        self.initiator
            .transfer_sync(TransferRequest::write(
                self.local.addr(),
                self.peer,
                remote,
                65536,
            ))
            .unwrap();
        self.initiator
            .transfer_sync(TransferRequest::read(
                self.local.addr() + 65536,
                self.peer,
                remote,
                65536,
            ))
            .unwrap();
        let mut back = vec![0u8; 65536];
        self.local.read_at(65536, &mut back).unwrap();
        assert!(back == data, "bytes changed on the way");
    }

    fn raw(&self) -> TcpStream {
        let stream = TcpStream::connect(("127.0.0.1", self.data_port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream
    }
}

fn header(size: u64, addr: u64, opcode: u8) -> [u8; 24] {
    Header { size, addr, opcode }.encode()
}

fn status(stream: &mut TcpStream) -> u64 {
    let mut frame = [0u8; 8];
    stream.read_exact(&mut frame).unwrap();
    u64::from_le_bytes(frame)
}

/// Reads until the server closes; panics if it does not within the read timeout.
fn expect_closed(stream: &mut TcpStream) {
    let mut sink = [0u8; 64];
    loop {
        match stream.read(&mut sink) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("server kept the connection open: {e}"),
        }
    }
}

#[test]
fn data_port_rejects_bad_ranges_and_keeps_the_connection() {
    let s = setup();
    let base = s.remote.addr() as u64;
    let mut conn = s.raw();
    // Absurd size: rejected, connection stays usable.
    conn.write_all(&header(u64::MAX, base, OP_READ | OP_V2))
        .unwrap();
    assert_eq!(status(&mut conn), STATUS_MAGIC | 1);
    // Address wrapping the address space.
    conn.write_all(&header(16, u64::MAX - 4, OP_READ | OP_V2))
        .unwrap();
    assert_eq!(status(&mut conn), STATUS_MAGIC | 1);
    // Zero-length request.
    conn.write_all(&header(0, base, OP_READ | OP_V2)).unwrap();
    assert_eq!(status(&mut conn), STATUS_MAGIC | 1);
    // A write just past the end of the buffer: body drained, rejected, nothing written.
    conn.write_all(&header(100, base + (1 << 20) - 50, OP_WRITE | OP_V2))
        .unwrap();
    conn.write_all(&[0xEE; 100]).unwrap();
    assert_eq!(status(&mut conn), STATUS_MAGIC | 1);
    let mut tail = [0u8; 50];
    s.remote.read_at((1 << 20) - 50, &mut tail).unwrap();
    assert!(
        tail.iter().all(|&b| b == 0),
        "a rejected write changed memory"
    );
    // The same connection then serves valid requests.
    conn.write_all(&header(4, base + 8, OP_WRITE | OP_V2))
        .unwrap();
    conn.write_all(b"tern").unwrap();
    assert_eq!(status(&mut conn), STATUS_MAGIC);
    conn.write_all(&header(4, base + 8, OP_READ | OP_V2))
        .unwrap();
    assert_eq!(status(&mut conn), STATUS_MAGIC);
    let mut word = [0u8; 4];
    conn.read_exact(&mut word).unwrap();
    assert_eq!(&word, b"tern");
    s.still_serves(3);
}

/// A v3 (aligned) header: the v2 header padded with zeros to a cache line.
fn aligned_header(size: u64, addr: u64, opcode: u8) -> Vec<u8> {
    let mut bytes = header(size, addr, opcode | OP_V2 | OP_ALIGNED).to_vec();
    bytes.resize(FRAME_ALIGN, 0);
    bytes
}

/// A v3 status frame: the status word, then zeros to a cache line.
fn aligned_status(stream: &mut TcpStream) -> u64 {
    let mut frame = [0u8; FRAME_ALIGN];
    stream.read_exact(&mut frame).unwrap();
    assert!(frame[8..].iter().all(|&b| b == 0), "padding is not zero");
    u64::from_le_bytes(frame[..8].try_into().unwrap())
}

#[test]
fn data_port_speaks_the_aligned_framing_beside_v2_on_one_connection() {
    let s = setup();
    let base = s.remote.addr() as u64;
    let mut conn = s.raw();
    // A v3 write, its header sent in two parts (the padding late): applied, a padded status.
    let write = aligned_header(4, base + 64, OP_WRITE);
    conn.write_all(&write[..30]).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    conn.write_all(&write[30..]).unwrap();
    conn.write_all(b"tern").unwrap();
    assert_eq!(aligned_status(&mut conn), STATUS_MAGIC);
    // A v2 read on the same connection: the short frame.
    conn.write_all(&header(4, base + 64, OP_READ | OP_V2))
        .unwrap();
    assert_eq!(status(&mut conn), STATUS_MAGIC);
    let mut word = [0u8; 4];
    conn.read_exact(&mut word).unwrap();
    assert_eq!(&word, b"tern");
    // v3 reads sent back to back: a padded status before each block; a rejected one between
    // them is a padded rejection with no block, and the stream stays in step.
    let mut reads = aligned_header(4, base + 64, OP_READ);
    reads.extend(aligned_header(16, u64::MAX - 4, OP_READ));
    reads.extend(aligned_header(2, base + 66, OP_READ));
    conn.write_all(&reads).unwrap();
    assert_eq!(aligned_status(&mut conn), STATUS_MAGIC);
    conn.read_exact(&mut word).unwrap();
    assert_eq!(&word, b"tern");
    assert_eq!(aligned_status(&mut conn), STATUS_MAGIC | 1);
    assert_eq!(aligned_status(&mut conn), STATUS_MAGIC);
    let mut half = [0u8; 2];
    conn.read_exact(&mut half).unwrap();
    assert_eq!(&half, b"rn");
    // A rejected v3 write: its body drained, a padded rejection, memory untouched.
    conn.write_all(&aligned_header(100, base + (1 << 20) - 50, OP_WRITE))
        .unwrap();
    conn.write_all(&[0xEE; 100]).unwrap();
    assert_eq!(aligned_status(&mut conn), STATUS_MAGIC | 1);
    let mut tail = [0u8; 50];
    s.remote.read_at((1 << 20) - 50, &mut tail).unwrap();
    assert!(
        tail.iter().all(|&b| b == 0),
        "a rejected write changed memory"
    );
    // The aligned bit without v2 is no operation a server knows: the connection goes.
    conn.write_all(&header(4, base, OP_READ | OP_ALIGNED))
        .unwrap();
    expect_closed(&mut conn);
    s.still_serves(5);
}

#[test]
fn a_write_status_waits_only_behind_a_short_write_already_arriving() {
    let s = setup();
    let base = s.remote.addr() as u64;
    let write = |at: u64, len: u64| aligned_header(len, base + at, OP_WRITE);
    let mut conn = s.raw();
    // A write with nothing behind it: its status comes.
    conn.write_all(&[write(0, 4), b"aaaa".to_vec()].concat())
        .unwrap();
    assert_eq!(aligned_status(&mut conn), STATUS_MAGIC);
    // Behind it the next write's header alone: the server would wait for the client, so the
    // status comes first.
    conn.write_all(&[write(0, 4), b"bbbb".to_vec(), write(4, 4)].concat())
        .unwrap();
    assert_eq!(aligned_status(&mut conn), STATUS_MAGIC);
    conn.write_all(b"cccc").unwrap();
    assert_eq!(aligned_status(&mut conn), STATUS_MAGIC);
    // Behind it a long write already arriving: the status comes before that body is whole.
    let long = 1 << 19;
    conn.write_all(
        &[
            write(0, 4),
            b"dddd".to_vec(),
            write(4096, long),
            vec![1; 64],
        ]
        .concat(),
    )
    .unwrap();
    assert_eq!(aligned_status(&mut conn), STATUS_MAGIC);
    conn.write_all(&vec![1; long as usize - 64]).unwrap();
    assert_eq!(aligned_status(&mut conn), STATUS_MAGIC);
    // Behind it a short write already arriving: held until that write is applied too, then
    // both come, in order, and both writes landed.
    conn.write_all(&[write(0, 4), b"eeee".to_vec(), write(8, 4), b"f".to_vec()].concat())
        .unwrap();
    conn.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut early = [0u8; 1];
    let held = conn.read(&mut early);
    assert!(
        matches!(&held, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)),
        "a status came while the write behind it was arriving: {held:?}"
    );
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    conn.write_all(b"fff").unwrap();
    assert_eq!(aligned_status(&mut conn), STATUS_MAGIC);
    assert_eq!(aligned_status(&mut conn), STATUS_MAGIC);
    let mut landed = [0u8; 12];
    s.remote.read_at(0, &mut landed).unwrap();
    assert_eq!(&landed, b"eeeeccccffff");
    s.still_serves(9);
}

#[test]
fn a_server_capped_at_v2_drops_an_aligned_request() {
    let target = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(TcpTransport::new(TcpConfig {
            proto_version: 2,
            ..TcpConfig::default()
        }))
        .build()
        .unwrap();
    let remote = target.allocate(1 << 20, "cpu:0").unwrap();
    let desc = target.local_descriptor();
    assert_eq!(desc.tcp_proto_version, 2);
    let mut conn = TcpStream::connect(("127.0.0.1", desc.tcp_data_port)).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    conn.write_all(&header(4, remote.addr() as u64, OP_READ | OP_V2))
        .unwrap();
    assert_eq!(status(&mut conn), STATUS_MAGIC);
    let mut word = [0u8; 4];
    conn.read_exact(&mut word).unwrap();
    conn.write_all(&aligned_header(4, remote.addr() as u64, OP_READ))
        .unwrap();
    expect_closed(&mut conn);
}

#[test]
fn data_port_refuses_memory_that_is_not_remote_accessible() {
    let s = setup();
    let mut private = vec![7u8; 4096];
    // SAFETY: `private` outlives the registration, which is undone before it drops.
    unsafe {
        s.target
            .register_memory(private.as_mut_ptr(), private.len(), "cpu:0", false)
            .unwrap();
    }
    let mut conn = s.raw();
    conn.write_all(&header(16, private.as_ptr() as u64, OP_READ | OP_V2))
        .unwrap();
    assert_eq!(status(&mut conn), STATUS_MAGIC | 1);
    assert!(
        s.target
            .local_descriptor()
            .buffers
            .iter()
            .all(|b| b.addr != private.as_ptr() as u64),
        "a private region was published"
    );
    s.target
        .unregister_memory(private.as_ptr() as usize)
        .unwrap();
    drop(private);
    s.still_serves(5);
}

#[test]
fn data_port_drops_malformed_connections_and_serves_the_rest() {
    let s = setup();
    let base = s.remote.addr() as u64;
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("unknown opcode", header(16, base, 0x85).to_vec()),
        ("garbage", b"GET / HTTP/1.1\r\nHost: tern\r\n\r\n".to_vec()),
        ("v1 request outside memory", header(16, 8, OP_READ).to_vec()),
        (
            "huge rejected write",
            header(1 << 40, 8, OP_WRITE | OP_V2).to_vec(),
        ),
    ];
    for (what, bytes) in cases {
        let mut conn = s.raw();
        conn.write_all(&bytes).unwrap();
        let started = Instant::now();
        expect_closed(&mut conn);
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{what}: slow to drop"
        );
        s.still_serves(what.len() as u8);
    }
    // Truncated header: the peer sends part of a header and goes away.
    let mut conn = s.raw();
    conn.write_all(&header(16, base, OP_READ | OP_V2)[..10])
        .unwrap();
    drop(conn);
    s.still_serves(11);
    // A truncated write body: the peer dies mid-transfer.
    let mut conn = s.raw();
    conn.write_all(&header(4096, base, OP_WRITE | OP_V2))
        .unwrap();
    conn.write_all(&[1u8; 100]).unwrap();
    drop(conn);
    s.still_serves(13);
}

#[test]
fn data_port_closes_silent_connections_after_the_idle_timeout() {
    let s = setup();
    let mut silent = s.raw();
    // Others are served while the silent peer holds its connection.
    s.still_serves(17);
    let started = Instant::now();
    expect_closed(&mut silent);
    assert!(started.elapsed() < Duration::from_secs(8));
    // The initiator's own pooled connections went idle too and were closed by the server;
    // the initiator notices and reconnects instead of failing the next transfer.
    std::thread::sleep(Duration::from_millis(700));
    s.still_serves(19);
}

/// A peer that sends a header one byte every 300 ms is cut off at the frame deadline (here
/// the 1 s I/O timeout), long before its header is whole; not kept alive by the trickle.
#[test]
fn data_port_drops_a_trickled_header_at_the_frame_deadline() {
    let target = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(TcpTransport::new(TcpConfig {
            io_timeout: Duration::from_secs(1),
            ..TcpConfig::default()
        }))
        .build()
        .unwrap();
    let remote = target.allocate(1 << 20, "cpu:0").unwrap();
    let port = target.local_descriptor().tcp_data_port;
    let mut conn = TcpStream::connect(("127.0.0.1", port)).unwrap();
    conn.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let bytes = header(16, remote.addr() as u64, OP_READ | OP_V2);
    let mut sent = 0;
    for byte in bytes {
        let closed = match conn.read(&mut [0u8; 64]) {
            Ok(0) => true,
            Ok(_) => panic!("the server answered half a header"),
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        };
        if closed || conn.write_all(&[byte]).is_err() {
            break;
        }
        sent += 1;
    }
    assert!(sent < bytes.len(), "a trickled header was taken whole");
}

fn rpc_raw(port: u16, bytes: &[u8]) -> Vec<u8> {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    conn.write_all(bytes).unwrap();
    let mut reply = Vec::new();
    match conn.read_to_end(&mut reply) {
        Ok(_) => reply,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => reply,
        Err(e) => panic!("rpc server kept a bad connection open: {e}"),
    }
}

fn frame(ty: u8, body: &[u8]) -> Vec<u8> {
    let mut bytes = (body.len() as u64 + 1).to_le_bytes().to_vec();
    bytes.push(ty);
    bytes.extend_from_slice(body);
    bytes
}

/// The body Mooncake's node sent for a request type, as recorded in the golden file.
fn golden_body(request_type: u8) -> String {
    let marker = format!("request type {request_type} ");
    let section = GOLDEN_RPC.split(&marker).nth(1).unwrap();
    let body = section.split("body=b'").nth(1).unwrap();
    body.split("'\n").next().unwrap().replace("\\n", "\n")
}

#[test]
fn rpc_replies_have_mooncakes_shape() {
    let s = setup();
    let port = s.target.rpc_port();
    for (ty, request) in [
        (1u8, &b"{}"[..]),
        (3, b"{}"),
        (2, br#"{"name":"tern-probe","notify_msg":"hello"}"#),
    ] {
        let reply = rpc_raw(port, &frame(ty, request));
        let len = u64::from_le_bytes(reply[..8].try_into().unwrap()) as usize;
        assert_eq!(len, reply.len() - 8, "length counts type byte and body");
        assert_eq!(reply[8], ty, "reply echoes the type");
        let body = std::str::from_utf8(&reply[9..]).unwrap();
        assert!(body.ends_with('\n'), "trailing newline");
        let golden = golden_body(ty);
        if ty == 1 {
            let ours = SegmentDesc::from_json(body.as_bytes()).unwrap();
            let theirs = SegmentDesc::from_json(golden.as_bytes()).unwrap();
            assert_eq!(ours.name, s.target.segment_name());
            assert_eq!(ours.protocol, theirs.protocol);
            // Mooncake's initiators speak v2 to any target that publishes 2 or more; Tern
            // publishes 3, its aligned framing, which only Tern initiators use.
            assert_eq!(theirs.tcp_proto_version, 2);
            assert_eq!(ours.tcp_proto_version, 3);
            assert_eq!(ours.tcp_data_port, s.data_port);
            assert_eq!(
                ours.buffers[0].name, ours.name,
                "TCP buffers carry the server name"
            );
            assert_eq!(ours.buffers[0].addr, s.remote.addr() as u64);
            let keys = |j: &str| {
                let v: serde_json::Value = serde_json::from_str(j).unwrap();
                v.as_object().unwrap().keys().cloned().collect::<Vec<_>>()
            };
            assert_eq!(keys(body), keys(&golden), "same fields as Mooncake's");
        } else {
            assert_eq!(body, golden);
        }
    }
    let notes = s.target.get_notifies();
    assert_eq!(notes.len(), 1);
    assert_eq!(notes[0].notify_msg, "hello");
}

#[test]
fn rpc_port_drops_malformed_requests_and_serves_the_rest() {
    let s = setup();
    let port = s.target.rpc_port();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated length", vec![1, 2, 3]),
        (
            "truncated body",
            [&100u64.to_le_bytes()[..], &[2, b'{']].concat(),
        ),
        ("zero length", 0u64.to_le_bytes().to_vec()),
        ("absurd length", u64::MAX.to_le_bytes().to_vec()),
        ("unknown type", frame(9, b"{}")),
        ("garbage notify", frame(2, b"\xff\xfenot json")),
        ("notify of the wrong shape", frame(2, br#"{"nom":1}"#)),
        ("garbage metadata", frame(1, b"}{")),
    ];
    for (what, bytes) in cases {
        let reply = rpc_raw(port, &bytes);
        assert!(reply.is_empty(), "{what}: got a reply {reply:?}");
        s.initiator
            .probe(s.peer)
            .unwrap_or_else(|e| panic!("after {what}: {e}"));
    }
    assert!(
        s.target.get_notifies().is_empty(),
        "a malformed notify was queued"
    );
    // A silent peer holds one connection; others are served meanwhile, and it is dropped.
    let mut silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    s.initiator.send_notify(s.peer, "n", "m").unwrap();
    let started = Instant::now();
    let mut sink = Vec::new();
    let _ = silent.read_to_end(&mut sink);
    assert!(sink.is_empty());
    assert!(
        started.elapsed() < Duration::from_secs(14),
        "silent peer never dropped"
    );
    assert_eq!(s.target.get_notifies().len(), 1);
    s.still_serves(23);
}

#[test]
fn dropping_an_engine_cuts_its_inbound_connections() {
    let s = setup();
    let base = s.remote.addr() as u64;
    let mut conn = s.raw();
    conn.write_all(&header(4, base, OP_READ | OP_V2)).unwrap();
    assert_eq!(status(&mut conn), STATUS_MAGIC);
    let mut word = [0u8; 4];
    conn.read_exact(&mut word).unwrap();
    let Setup {
        target, initiator, ..
    } = s;
    drop(initiator);
    let started = Instant::now();
    drop(target);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "shutdown took {:?}",
        started.elapsed()
    );
    // Once the engine is gone nobody may reach its memory through an old connection.
    expect_closed(&mut conn);
}
