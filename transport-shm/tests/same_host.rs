//! The shared-memory transport between engines of this process, with real sockets, memfds
//! and mappings: a buffer unregistered while a peer has it mapped is unmapped there before
//! unregistering returns; a Mooncake-format descriptor (no `tern.shm`) gets no shm; bad input
//! on the socket, from either side, is refused with a reason, maps nothing, and leaves the
//! engine serving; the cluster secret is proved on the socket too.

use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::Duration;

use tern_engine::{
    AlignedBuffer, OwnedBuffer, SegmentDesc, SegmentId, TransferEngine, TransferError,
    TransferRequest, TransferStatus, Transport,
};
use tern_memreg::shm::{MemFd, send_with_fds};
use tern_metadata::MetadataStore;
use tern_metadata::auth::{self, Channel, Claims, ClusterSecret};
use tern_metadata::http::{HttpMetadataServer, HttpStore};
use tern_testkit::maps::mappings_of;
use tern_transport_shm::wire::{self, Frame, FrameReader, MAGIC, NONCE_LEN, Opened};
use tern_transport_shm::{ShmConfig, ShmTransport};
use tern_transport_tcp::TcpTransport;

fn engine(name: &str) -> TransferEngine {
    TransferEngine::builder()
        .local_server_name(name)
        .transport(ShmTransport::default())
        .transport(TcpTransport::default())
        .build()
        .unwrap()
}

fn inode_at(addr: usize) -> Option<u64> {
    tern_testkit::maps::inode_at(addr as u64)
}

fn mapping_lines(inode: u64) -> String {
    tern_testkit::maps::memfd_mappings(inode).join("\n")
}

fn inode_of(fd: std::os::fd::BorrowedFd<'_>) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::File::from(fd.try_clone_to_owned().unwrap())
        .metadata()
        .unwrap()
        .ino()
}

fn status(engine: &TransferEngine, request: TransferRequest) -> TransferStatus {
    let batch = engine.allocate_batch(1).unwrap();
    engine.submit(&batch, &[request]).unwrap();
    batch.wait(Duration::from_secs(30));
    batch.task_status(0).unwrap().status
}

/// Writes `bytes` from a fresh buffer of `initiator` to the start of `remote` (of segment
/// `peer`) and checks they landed.
fn write_lands(initiator: &TransferEngine, peer: SegmentId, remote: &OwnedBuffer, bytes: &[u8]) {
    let local = initiator.allocate(bytes.len(), "cpu:0").unwrap();
    local.write_at(0, bytes).unwrap();
    let request = TransferRequest::write(local.addr(), peer, remote.addr() as u64, bytes.len());
    assert_eq!(status(initiator, request), TransferStatus::Completed);
    let mut seen = vec![0u8; bytes.len()];
    remote.read_at(0, &mut seen).unwrap();
    assert_eq!(seen, bytes);
}

fn shm_stats(engine: &TransferEngine) -> tern_engine::TransportStats {
    engine
        .stats()
        .transports
        .into_iter()
        .find(|t| t.protocol == "shm")
        .unwrap()
}

fn tcp_bytes(engine: &TransferEngine) -> u64 {
    engine
        .stats()
        .transports
        .iter()
        .find(|t| t.protocol == "tcp")
        .map_or(0, |t| t.bytes)
}

#[test]
fn a_buffer_unregistered_while_mapped_is_unmapped_in_the_peer_before_unregistering_returns() {
    let target = engine("127.0.0.1");
    let initiator = engine("127.0.0.1");
    let peer = initiator.open_segment(target.segment_name()).unwrap();
    let local = initiator.allocate(1 << 20, "cpu:0").unwrap();
    let remote = target.allocate(1 << 20, "cpu:0").unwrap();
    let remote_addr = remote.addr();
    initiator.refresh_segment(peer).unwrap();
    let inode = inode_at(remote_addr).unwrap();
    assert_eq!(mappings_of(inode), 1, "only the owner's own");
    local.write_at(0, b"through the mapping").unwrap();
    assert_eq!(
        status(
            &initiator,
            TransferRequest::write(local.addr(), peer, remote_addr as u64, 19)
        ),
        TransferStatus::Completed
    );
    let mut seen = [0u8; 19];
    remote.read_at(0, &mut seen).unwrap();
    assert_eq!(&seen, b"through the mapping");
    assert_eq!(
        mappings_of(inode),
        2,
        "the initiator maps the target's memfd"
    );
    assert_eq!(shm_stats(&initiator).bytes, 19);
    assert_eq!(tcp_bytes(&initiator), 0);
    drop(remote);
    // Both the owner's mapping and the peer's are gone the moment unregistering returned.
    assert_eq!(mappings_of(inode), 0);
    // The initiator's descriptor is stale now: the owner refuses the range.
    for request in [
        TransferRequest::write(local.addr(), peer, remote_addr as u64, 19),
        TransferRequest::read(local.addr(), peer, remote_addr as u64, 19),
    ] {
        assert!(matches!(
            status(&initiator, request),
            TransferStatus::Failed(TransferError::RemoteRejected { .. })
        ));
    }
    assert_eq!(mappings_of(inode), 0, "nothing was mapped again");
}

#[test]
fn a_buffer_is_unmapped_in_the_peer_once_unregistered_however_soon_after_a_copy() {
    let target = engine("127.0.0.1");
    let initiator = engine("127.0.0.1");
    let peer = initiator.open_segment(target.segment_name()).unwrap();
    let local = initiator.allocate(1 << 20, "cpu:0").unwrap();
    // The copy threads complete their slices and then let the mapping go: unregistering
    // right after the completion must not find the mapping still held there. And the hands
    // of one submit (copy threads, the waiter) each open a buffer they find unmapped: the
    // peer maps it once however their opens interleave (under CPU load they overlap).
    for round in 0..200 {
        let remote = target.allocate(1 << 20, "cpu:0").unwrap();
        initiator.refresh_segment(peer).unwrap();
        let inode = inode_at(remote.addr()).unwrap();
        let writes: Vec<TransferRequest> = (0..16)
            .map(|i| {
                let at = i * (64 << 10);
                TransferRequest::write(
                    local.addr() + at,
                    peer,
                    (remote.addr() + at) as u64,
                    64 << 10,
                )
            })
            .collect();
        all_complete(&initiator, &writes);
        assert_eq!(
            mappings_of(inode),
            2,
            "round {round}: the owner's and the peer's:\n{}",
            mapping_lines(inode)
        );
        drop(remote);
        assert_eq!(
            mappings_of(inode),
            0,
            "round {round}:\n{}",
            mapping_lines(inode)
        );
    }
}

/// Runs `requests` in one batch and checks every task completed.
fn all_complete(engine: &TransferEngine, requests: &[TransferRequest]) {
    let batch = engine.allocate_batch(requests.len()).unwrap();
    engine.submit(&batch, requests).unwrap();
    batch.wait(Duration::from_secs(30));
    for task in 0..requests.len() {
        assert_eq!(
            batch.task_status(task).unwrap().status,
            TransferStatus::Completed
        );
    }
}

#[test]
fn slices_shared_out_by_bytes_among_the_hands_land_whole_both_ways() {
    // One copy thread and the waiter: two hands, so a slice through a mapping that is worth
    // sharing is cut in two, each hand copying its own half.
    let two_hands = || {
        TransferEngine::builder()
            .local_server_name("127.0.0.1")
            .transport(ShmTransport::new(ShmConfig {
                workers: 1,
                ..ShmConfig::default()
            }))
            .transport(TcpTransport::default())
            .build()
            .unwrap()
    };
    let (target, initiator) = (two_hands(), two_hands());
    let peer = initiator.open_segment(target.segment_name()).unwrap();
    let remote = target.allocate(4 << 20, "cpu:0").unwrap();
    let local = initiator.allocate(4 << 20, "cpu:0").unwrap();
    initiator.refresh_segment(peer).unwrap();
    // The first transfer maps the buffer; only then is a submit through it shared out.
    write_lands(&initiator, peer, &remote, b"map it");
    let before = shm_stats(&initiator);

    // One slice of an odd length, too few to share out whole: cut in two, both halves land.
    let odd = (1 << 20) - 100;
    let pattern: Vec<u8> = (0..odd).map(|i| (i % 251) as u8).collect();
    local.write_at(0, &pattern).unwrap();
    let remote_at = remote.addr() as u64 + 4096;
    all_complete(
        &initiator,
        &[TransferRequest::write(local.addr(), peer, remote_at, odd)],
    );
    let mut seen = vec![0u8; odd];
    remote.read_at(4096, &mut seen).unwrap();
    assert!(seen == pattern, "the written halves differ from the source");
    let after_write = shm_stats(&initiator);
    assert_eq!(after_write.bytes - before.bytes, odd as u64);
    assert_eq!(
        after_write.slices - before.slices,
        2,
        "one slice, two pieces"
    );

    // The same block read into the same local block eight times (a benchmark's reuse): cut
    // too, so that the hands never write the same bytes; and it still reads right.
    let block = 64 << 10;
    let into = local.addr() + (2 << 20);
    let reads: Vec<_> = (0..8)
        .map(|_| TransferRequest::read(into, peer, remote_at, block))
        .collect();
    all_complete(&initiator, &reads);
    let mut back = vec![0u8; block];
    local.read_at(2 << 20, &mut back).unwrap();
    assert!(
        back == pattern[..block],
        "the read halves differ from the source"
    );
    let after_reads = shm_stats(&initiator);
    assert_eq!(after_reads.bytes - after_write.bytes, 8 * block as u64);
    assert_eq!(
        after_reads.slices - after_write.slices,
        16,
        "eight slices, two pieces each"
    );
    assert_eq!(tcp_bytes(&initiator), 0);
}

#[test]
fn a_mooncake_descriptor_without_the_field_gets_no_shm_and_tcp_carries() {
    let golden = include_str!("../../metadata/tests/golden/mooncake-tcp-segment.json");
    let desc = SegmentDesc::from_json(golden.as_bytes()).unwrap();
    assert!(desc.tern.is_empty());
    assert!(!ShmTransport::default().can_reach(&desc));
    // A peer without the transport (as a Mooncake node) publishes no `tern.shm`.
    let tcp_only = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(TcpTransport::default())
        .build()
        .unwrap();
    assert!(!tcp_only.local_descriptor().tern.contains_key("shm"));
    let initiator = engine("127.0.0.1");
    let mine = initiator.local_descriptor();
    assert!(mine.tern.contains_key("shm"));
    assert_eq!(mine.protocol, ["tcp"], "Mooncake peers see only TCP");
    let peer = initiator.open_segment(tcp_only.segment_name()).unwrap();
    let remote = tcp_only.allocate(4096, "cpu:0").unwrap();
    initiator.refresh_segment(peer).unwrap();
    write_lands(&initiator, peer, &remote, b"over tcp");
    let shm = shm_stats(&initiator);
    assert_eq!((shm.bytes, shm.slices, shm.peers.len()), (0, 0, 0));
    assert_eq!(tcp_bytes(&initiator), 8);
}

/// A client of `target`'s socket that speaks the protocol by hand.
fn raw_client(target: &TransferEngine) -> UnixStream {
    let socket = target.local_descriptor().tern["shm"]["socket"]
        .as_str()
        .unwrap()
        .to_owned();
    let stream =
        UnixStream::connect_addr(&SocketAddr::from_abstract_name(socket.as_bytes()).unwrap())
            .unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
}

fn hello(client: &str, server: &str) -> Vec<u8> {
    Frame::Hello {
        magic: MAGIC,
        version: tern_transport_shm::identity::VERSION as u16,
        nonce: [3; NONCE_LEN],
        client_segment: client.into(),
        server_segment: server.into(),
    }
    .encode()
}

/// The frames the server sends until it closes.
fn answers(stream: &UnixStream) -> Vec<Frame> {
    let mut reader = FrameReader::new();
    let mut frames = Vec::new();
    while let Ok(Some(frame)) = reader.next(stream) {
        frames.push(frame);
    }
    frames
}

fn refusal(frames: &[Frame]) -> String {
    match frames.last() {
        Some(Frame::Refused { reason }) => reason.clone(),
        other => panic!("no refusal, but {other:?}"),
    }
}

#[test]
fn garbage_unpublished_ranges_and_unasked_descriptors_are_refused_and_the_engine_keeps_serving() {
    let target = engine("127.0.0.1");
    let buffer = target.allocate(1 << 16, "cpu:0").unwrap();
    let name = target.segment_name().to_owned();

    // Bytes that are no frame.
    let mut garbage = raw_client(&target);
    garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let reason = refusal(&answers(&garbage));
    assert!(
        reason.contains("longer than") || reason.contains("unknown frame"),
        "{reason}"
    );

    // A hello with the wrong magic, and one for another segment.
    let mut bad_magic = raw_client(&target);
    let mut frame = hello("me", &name);
    frame[wire::HEADER_LEN] ^= 0xff;
    bad_magic.write_all(&frame).unwrap();
    assert!(refusal(&answers(&bad_magic)).contains("magic"));
    let mut wrong = raw_client(&target);
    wrong.write_all(&hello("me", "someone-else")).unwrap();
    assert!(refusal(&answers(&wrong)).contains("someone-else"));

    // A well-formed peer asking for ranges the target never published.
    let mut asking = raw_client(&target);
    asking.write_all(&hello("me", &name)).unwrap();
    let mut reader = FrameReader::new();
    assert!(matches!(
        reader.next(&asking).unwrap(),
        Some(Frame::Welcome { .. })
    ));
    let outside = (buffer.addr() + (1 << 16)) as u64;
    for (id, addr, len) in [
        (1, outside, 8),
        (2, buffer.addr() as u64, 1 << 17),
        (3, 8, 8),
        (4, buffer.addr() as u64, 0),
    ] {
        asking
            .write_all(&Frame::Open { id, addr, len }.encode())
            .unwrap();
        match reader.next(&asking).unwrap() {
            Some(Frame::Opened {
                id: got,
                outcome: Opened::Rejected(reason),
            }) => {
                assert_eq!(got, id);
                assert!(!reason.is_empty());
            }
            other => panic!("open {id}: {other:?}"),
        }
    }
    asking
        .write_all(
            &Frame::Lease {
                id: 5,
                ranges: vec![(outside, 8), (buffer.addr() as u64, 8)],
            }
            .encode(),
        )
        .unwrap();
    assert_eq!(
        reader.next(&asking).unwrap(),
        Some(Frame::Leased {
            id: 5,
            granted: vec![false, true]
        })
    );
    // Held by the lease: the buffer is in use, and stays registered.
    let in_use = target.unregister_memory(buffer.addr()).unwrap_err();
    assert!(in_use.to_string().contains("in use"), "{in_use}");
    asking
        .write_all(&Frame::Release { id: 5 }.encode())
        .unwrap();
    // A frame only a server sends.
    asking
        .write_all(
            &Frame::Welcome {
                version: tern_transport_shm::identity::VERSION as u16,
                probe_addr: 0,
                segment: "x".into(),
            }
            .encode(),
        )
        .unwrap();
    assert!(refusal(&answers(&asking)).contains("unexpected"));

    // Descriptors nobody asked for, more than a reader keeps.
    let flood = raw_client(&target);
    let memfd = MemFd::create("flood", 4096).unwrap();
    let mut fds_sent = 0;
    for _ in 0..8 {
        if send_with_fds(
            &flood,
            b"\0",
            &[memfd.as_fd(), memfd.as_fd(), memfd.as_fd()],
        )
        .is_ok()
        {
            fds_sent += 3;
        }
    }
    assert!(fds_sent > 16);
    let mut rest = Vec::new();
    let _ = (&flood).read_to_end(&mut rest);

    // Through all of it the engine serves a real peer.
    let initiator = engine("127.0.0.1");
    let peer = initiator.open_segment(&name).unwrap();
    write_lands(&initiator, peer, &buffer, b"still serving");
    assert_eq!(shm_stats(&initiator).bytes, 13);
}

/// A fake same-host peer: its descriptor (in an HTTP store) names a socket the test serves,
/// whose answers to opens are `answers`, in order.
struct FakePeer {
    _server: HttpMetadataServer,
    url: String,
    buffer: (u64, u64),
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakePeer {
    fn start(
        template: &TransferEngine,
        answers: Vec<(Opened, Option<std::os::fd::OwnedFd>)>,
    ) -> Self {
        let server = HttpMetadataServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
        let url = format!("http://{}/metadata", server.local_addr());
        let store = HttpStore::new(&url).unwrap();
        // A name of the form Tern binds (it dials no other).
        let socket = tern_transport_shm::identity::socket_name(std::process::id(), &[0xfa; 8]);
        let listener =
            UnixListener::bind_addr(&SocketAddr::from_abstract_name(socket.as_bytes()).unwrap())
                .unwrap();
        // This host's identity, a socket the test serves, one buffer at a made-up address.
        let mut desc = template.local_descriptor();
        desc.name = "fake".into();
        desc.tern.get_mut("shm").unwrap()["socket"] = socket.clone().into();
        let buffer = (0x7000_0000_0000u64, 1u64 << 20);
        desc.buffers = vec![tern_engine::BufferDesc {
            addr: buffer.0,
            length: buffer.1,
            lkey: None,
            name: "fake".into(),
            rkey: None,
        }];
        store.publish_segment("fake", &desc).unwrap();
        // Its handshake RPC is the template's (it answers probes).
        let rpc = tern_engine::RpcMeta {
            ip_or_host_name: "127.0.0.1".into(),
            rpc_port: template.rpc_port(),
        };
        store.publish_rpc_meta("fake", &rpc).unwrap();
        let thread = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = FrameReader::new();
            let Ok(Some(Frame::Hello { .. })) = reader.next(&stream) else {
                return;
            };
            let probe = Box::new([0u8; NONCE_LEN]);
            let welcome = Frame::Welcome {
                version: tern_transport_shm::identity::VERSION as u16,
                probe_addr: probe.as_ptr() as u64,
                segment: "fake".into(),
            };
            wire::send(&stream, &welcome.encode()).unwrap();
            let mut answers = answers.into_iter();
            while let Ok(Some(frame)) = reader.next(&stream) {
                let Frame::Open { id, .. } = frame else {
                    continue;
                };
                let Some((outcome, fd)) = answers.next() else {
                    return;
                };
                let bytes = Frame::Opened { id, outcome }.encode();
                match &fd {
                    Some(fd) => {
                        send_with_fds(&stream, &bytes, &[fd.as_fd()]).unwrap();
                    }
                    None => wire::send(&stream, &bytes).unwrap(),
                }
            }
        });
        Self {
            _server: server,
            url,
            buffer,
            thread: Some(thread),
        }
    }
}

impl Drop for FakePeer {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[test]
fn a_peer_passing_wrong_descriptors_or_unpublished_buffers_is_refused_and_nothing_is_mapped() {
    let template = engine("127.0.0.1");
    let (reader, _writer) = std::io::pipe().unwrap();
    let small = MemFd::create("small", 4096).unwrap();
    let path = std::env::temp_dir().join(format!("tern-fake-{}", std::process::id()));
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(1 << 20).unwrap();
    std::fs::remove_file(&path).unwrap();
    let (addr, len) = (0x7000_0000_0000u64, 1u64 << 20);
    let fine = MemFd::create("fine", 1 << 20).unwrap();
    let answers = vec![
        (
            Opened::Memfd {
                addr,
                len,
                map_len: len,
            },
            Some(reader.into()),
        ),
        (
            Opened::Memfd {
                addr,
                len,
                map_len: len,
            },
            Some(file.into()),
        ),
        (
            Opened::Memfd {
                addr,
                len,
                map_len: len,
            },
            Some(small.as_fd().try_clone_to_owned().unwrap()),
        ),
        (
            Opened::Memfd {
                addr,
                len,
                map_len: len,
            },
            None,
        ),
        // A buffer it never published.
        (
            Opened::Memfd {
                addr: addr + 4096,
                len,
                map_len: len,
            },
            Some(fine.as_fd().try_clone_to_owned().unwrap()),
        ),
        (
            Opened::Plain {
                addr: addr - 4096,
                len: 2 * len,
            },
            None,
        ),
    ];
    let expected = [
        "not a memfd",
        "not a memfd",
        "fewer than",
        "without a descriptor",
        "not a buffer it published",
        "not a buffer it published",
    ];
    let fake = FakePeer::start(&template, answers);
    let initiator = TransferEngine::builder()
        .local_server_name("fake-initiator")
        .advertise_address("127.0.0.1")
        .metadata(&fake.url)
        .transport(ShmTransport::new(ShmConfig::default()))
        .build()
        .unwrap();
    let peer = initiator.open_segment("fake").unwrap();
    let local = initiator.allocate(1 << 20, "cpu:0").unwrap();
    let offered = [inode_of(small.as_fd()), inode_of(fine.as_fd())];
    for want in expected {
        match status(
            &initiator,
            TransferRequest::read(local.addr(), peer, fake.buffer.0 + 64, 4096),
        ) {
            TransferStatus::Failed(TransferError::Declined { reason, .. }) => {
                assert!(reason.contains(want), "{reason} (wanted {want:?})")
            }
            other => panic!("{other}"),
        }
        for inode in offered {
            assert_eq!(mappings_of(inode), 0, "an offered memfd was mapped");
        }
    }
    // The engine serves a real peer after all that.
    let real = engine("127.0.0.1");
    let real_buffer = real.allocate(4096, "cpu:0").unwrap();
    let sane = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(ShmTransport::default())
        .build()
        .unwrap();
    let peer = sane.open_segment(real.segment_name()).unwrap();
    let mine = sane.allocate(4096, "cpu:0").unwrap();
    assert_eq!(
        status(
            &sane,
            TransferRequest::read(mine.addr(), peer, real_buffer.addr() as u64, 4096)
        ),
        TransferStatus::Completed
    );
    drop(initiator);
}

fn secured(secret: &str) -> TransferEngine {
    TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .cluster_secret(secret)
        .transport(ShmTransport::default())
        .build()
        .unwrap()
}

#[test]
fn with_a_cluster_secret_the_socket_serves_only_peers_that_prove_it() {
    let target = secured("s3cret");
    let remote = target.allocate(4096, "cpu:0").unwrap();
    // A client that speaks plainly is refused before anything is served.
    let mut plain = raw_client(&target);
    plain
        .write_all(&hello("me", target.segment_name()))
        .unwrap();
    let frames = answers(&plain);
    assert!(
        !frames.iter().any(|f| matches!(f, Frame::Welcome { .. })),
        "{frames:?}"
    );
    // One that proves another secret is refused too; the right one gets its welcome.
    for (secret, welcomed) in [("other", false), ("s3cret", true)] {
        let mut client = raw_client(&target);
        let claims = Claims {
            client_segment: "me".into(),
            server_segment: target.segment_name().into(),
            dialed: target.local_descriptor().tern["shm"]["socket"]
                .as_str()
                .unwrap()
                .into(),
        };
        let secret = ClusterSecret::new(secret.as_bytes()).unwrap();
        let proved = auth::client_handshake(&mut client, &secret, Channel::Shm, claims);
        assert_eq!(proved.is_ok(), welcomed, "{proved:?}");
        if welcomed {
            client
                .write_all(&hello("me", target.segment_name()))
                .unwrap();
            assert!(matches!(
                FrameReader::new().next(&client).unwrap(),
                Some(Frame::Welcome { .. })
            ));
        }
    }
    // A peer engine with the secret moves bytes over shm.
    let friend = secured("s3cret");
    let peer = friend.open_segment(target.segment_name()).unwrap();
    write_lands(&friend, peer, &remote, &[7u8; 4096]);
    assert_eq!(shm_stats(&friend).bytes, 4096);
}

/// Set in the environment of the child process that [`late_owner`] starts.
const LATE_OWNER_ENV: &str = "TERN_SHM_TEST_LATE_OWNER";

/// What [`late_owner`] runs in its child: an owner whose buffers are plain memory (so a
/// peer reaches them by cross-memory attach under leases), serving until its stdin closes.
/// It prints `owner <segment> <buffer address>`; on a line `unregister` it unregisters the
/// buffer, retrying while it is in use for up to 30 s, and prints `unregistered` or why not.
/// Without the variable it does nothing (a run of the whole suite passes it by).
#[test]
fn serves_as_the_owner_of_the_late_lease_test_when_run_as_its_child() {
    use std::io::BufRead;
    if std::env::var_os(LATE_OWNER_ENV).is_none() {
        return;
    }
    use tern_engine::RegisterRaw;
    let owner = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(ShmTransport::default())
        .build()
        .unwrap();
    // A heap buffer registered as a region (not `allocate`, whose buffer handle holds a pin
    // of its own): only a lease holds it, and unregistering says whether one does.
    let region = tern_engine::Region::owned(AlignedBuffer::new(4096).unwrap(), "cpu:0", true);
    let addr = region.addr();
    owner.register_region(region).unwrap();
    // On a line of its own (the harness has printed the test's name without a newline).
    println!("\nowner {} {addr}", owner.segment_name());
    for line in std::io::stdin().lock().lines() {
        if line.unwrap().trim() != "unregister" {
            continue;
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let outcome = loop {
            match owner.unregister_memory(addr) {
                Ok(()) => break "unregistered".to_owned(),
                Err(_) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => break format!("still refused after 30 s: {e}"),
            }
        };
        println!("{outcome}");
    }
}

#[test]
fn a_lease_the_owner_grants_after_the_initiator_stopped_waiting_is_released() {
    // The owner is another process (cross-memory attach into oneself is refused), this
    // test binary run again as its child; stopping it with SIGSTOP makes it answer late.
    let mut child = tern_testkit::process::SelfChild::start(
        "serves_as_the_owner_of_the_late_lease_test_when_run_as_its_child",
        LATE_OWNER_ENV,
    );
    let owner = child.next("owner ");
    let (segment, addr) = owner.split_once(' ').unwrap();
    let (segment, remote) = (segment.to_owned(), addr.parse::<u64>().unwrap());
    let initiator = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(ShmTransport::new(ShmConfig {
            io_timeout: Duration::from_secs(1),
            ..ShmConfig::default()
        }))
        .build()
        .unwrap();
    let peer = initiator.open_segment(&segment).unwrap();
    let local = initiator.allocate(4096, "cpu:0").unwrap();
    let write = TransferRequest::write(local.addr(), peer, remote, 4096);
    match status(&initiator, write) {
        TransferStatus::Completed => {}
        // Yama's ptrace_scope 1 lets a parent attach to its child; a stricter one refuses.
        TransferStatus::Failed(TransferError::Declined { reason, .. })
            if reason.contains("cross-memory attach") =>
        {
            eprintln!("skipped: the kernel refuses cross-memory attach here: {reason}");
            return;
        }
        other => panic!("the first write, under a lease: {other}"),
    }
    assert_eq!(shm_stats(&initiator).bytes, 4096);

    // The owner is stopped: the lease goes unanswered, the task fails.
    tern_testkit::process::stop(child.id());
    let failed = status(&initiator, write);
    tern_testkit::process::resume(child.id());
    assert!(
        matches!(&failed, TransferStatus::Failed(TransferError::Connection { message, .. }) if message.contains("no answer")),
        "{failed}"
    );
    // Now it reads the lease, pins the buffer and answers nobody; the release that follows
    // lets the buffer go, and the owner can unregister it.
    child.send("unregister");
    let outcome = loop {
        let line = child.next("");
        if line == "unregistered" || line.starts_with("still refused") {
            break line;
        }
    };
    child.close_stdin();
    drop(child);
    assert_eq!(outcome, "unregistered");
}

#[test]
fn a_revocation_the_peer_does_not_confirm_is_reported_as_cut_off_not_confirmed() {
    let target = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(ShmTransport::new(ShmConfig {
            revoke_timeout: Duration::from_millis(500),
            ..ShmConfig::default()
        }))
        .build()
        .unwrap();
    let buffer = target.allocate(1 << 16, "cpu:0").unwrap();
    let addr = buffer.addr();
    // A peer that opens the memfd buffer, and then answers nothing.
    let mut silent = raw_client(&target);
    silent
        .write_all(&hello("silent", target.segment_name()))
        .unwrap();
    let mut reader = FrameReader::new();
    assert!(matches!(
        reader.next(&silent).unwrap(),
        Some(Frame::Welcome { .. })
    ));
    silent
        .write_all(
            &Frame::Open {
                id: 1,
                addr: addr as u64,
                len: 8,
            }
            .encode(),
        )
        .unwrap();
    assert!(matches!(
        reader.next(&silent).unwrap(),
        Some(Frame::Opened {
            id: 1,
            outcome: Opened::Memfd { .. }
        })
    ));
    assert!(shm_stats(&target).peers.is_empty());
    // Unregistering returns after the revoke timeout; the report says the peer did not
    // confirm, and that it was cut off.
    drop(buffer);
    let peers = shm_stats(&target).peers;
    let cut = peers
        .iter()
        .find(|p| p.peer == "silent")
        .unwrap_or_else(|| panic!("no word of the silent peer: {peers:?}"));
    assert_eq!(cut.state, tern_engine::PeerState::Failed);
    let said = cut.last_error.as_deref().unwrap();
    assert!(
        said.contains("did not confirm") && said.contains(&format!("{addr:#x}")),
        "{said}"
    );
    // The peer was told to unmap it, and then its socket was closed.
    assert!(matches!(
        reader.next(&silent).unwrap(),
        Some(Frame::Revoke { .. })
    ));
    assert!(matches!(reader.next(&silent), Ok(None) | Err(_)));
}

#[test]
fn a_descriptor_naming_a_socket_tern_does_not_bind_is_not_dialed_and_tcp_carries() {
    // A listener at a name of another form (any abstract socket of this namespace could
    // be named), that counts who dials it.
    let foreign = format!("tern-shm-fake-{}", std::process::id() + 1);
    let listener =
        UnixListener::bind_addr(&SocketAddr::from_abstract_name(foreign.as_bytes()).unwrap())
            .unwrap();
    listener.set_nonblocking(true).unwrap();
    // A real target (shm and TCP) whose descriptor, in the store, names that socket.
    let server = HttpMetadataServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
    let url = format!("http://{}/metadata", server.local_addr());
    let target = engine("127.0.0.1");
    let remote = target.allocate(4096, "cpu:0").unwrap();
    let store = HttpStore::new(&url).unwrap();
    let mut desc = target.local_descriptor();
    desc.name = "forged".into();
    desc.tern.get_mut("shm").unwrap()["socket"] = foreign.clone().into();
    store.publish_segment("forged", &desc).unwrap();
    let rpc = tern_engine::RpcMeta {
        ip_or_host_name: "127.0.0.1".into(),
        rpc_port: target.rpc_port(),
    };
    store.publish_rpc_meta("forged", &rpc).unwrap();
    let with_tcp = TransferEngine::builder()
        .local_server_name("forged-reader")
        .advertise_address("127.0.0.1")
        .metadata(&url)
        .transport(ShmTransport::default())
        .transport(TcpTransport::default())
        .build()
        .unwrap();
    let peer = with_tcp.open_segment("forged").unwrap();
    write_lands(&with_tcp, peer, &remote, b"over tcp, not that socket");
    assert_eq!(shm_stats(&with_tcp).bytes, 0);
    assert_eq!(tcp_bytes(&with_tcp), 25);
    // With nothing after shm, the slice is declined with the reason.
    let shm_only = TransferEngine::builder()
        .local_server_name("forged-reader-2")
        .advertise_address("127.0.0.1")
        .metadata(&url)
        .transport(ShmTransport::default())
        .build()
        .unwrap();
    let peer = shm_only.open_segment("forged").unwrap();
    let local = shm_only.allocate(4096, "cpu:0").unwrap();
    match status(
        &shm_only,
        TransferRequest::read(local.addr(), peer, remote.addr() as u64, 8),
    ) {
        TransferStatus::Failed(TransferError::Declined { reason, .. }) => {
            assert!(
                reason.contains(&foreign) && reason.contains("not dialed"),
                "{reason}"
            )
        }
        other => panic!("{other}"),
    }
    assert!(
        matches!(listener.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "the foreign socket was dialed"
    );
}
