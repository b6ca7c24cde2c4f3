//! The same-host transport between real processes (`tern-bench --mode target` and this test,
//! and `tern-bench --mode initiator` against this test's engine): both ways over both paths
//! (memfd mappings and cross-memory attach); a target killed while mapped (its tasks fail
//! with `Connection`, its memfd is unmapped, the engine serves on); ptrace denied, so
//! cross-memory attach is refused and TCP carries the slices; and a target in another network
//! namespace (which the test creates), not same-host even when its descriptor claims to be.

#[path = "support/target.rs"]
mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use support::{Target, target_byte, tern_bench};
use tern_engine::{
    Batch, OwnedBuffer, SegmentId, TransferEngine, TransferError, TransferRequest, TransferStatus,
};
use tern_metadata::MetadataStore;
use tern_metadata::http::{HttpMetadataServer, HttpStore};
use tern_transport_shm::{PtracePolicy, ShmConfig, ShmTransport};
use tern_transport_tcp::TcpTransport;
#[path = "../../testkit/include/transfers.rs"]
mod transfers;
use transfers::transport_stats;

const MIB: usize = 1 << 20;

fn engine(memfd: bool) -> TransferEngine {
    TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(ShmTransport::new(ShmConfig {
            memfd_buffers: memfd,
            // Where Yama's ptrace_scope is 1, a tern-bench child may attach to this process
            // (its parent) only by this opt-in; without Yama it changes nothing.
            ptrace: if memfd {
                PtracePolicy::Keep
            } else {
                PtracePolicy::AllowSameUser
            },
            ..ShmConfig::default()
        }))
        .transport(TcpTransport::default())
        .build()
        .unwrap()
}

fn run(engine: &TransferEngine, requests: &[TransferRequest]) -> Batch {
    let batch = engine.allocate_batch(requests.len()).unwrap();
    engine.submit(&batch, requests).unwrap();
    batch.wait(Duration::from_secs(60));
    batch
}

fn all_completed(batch: &Batch) {
    let status = batch.status();
    for task in 0..status.submitted {
        assert_eq!(
            batch.task_status(task).unwrap().status,
            TransferStatus::Completed,
            "task {task}"
        );
    }
}

/// The largest buffer of an open segment.
fn remote_buffer(engine: &TransferEngine, peer: SegmentId) -> (u64, u64) {
    let desc = engine.segment(peer).unwrap().desc.clone();
    let buffer = desc.buffers.iter().max_by_key(|b| b.length).unwrap();
    (buffer.addr, buffer.length)
}

/// Whether this process maps a memfd that process `pid` made (`/memfd:tern-shm-<pid>`).
fn maps_memfd_of(pid: u32) -> bool {
    let name = format!("/memfd:tern-shm-{pid} ");
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .any(|l| l.contains(&name))
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().nth(1).map(|e| e == "0"))
        .unwrap_or(false)
}

/// `tern-bench --mode initiator` against `segment`, with `prefix` before it; its JSON.
fn bench_initiator(prefix: &[&str], segment: &str, args: &[&str]) -> serde_json::Value {
    let output = tern_bench(prefix)
        .args([
            "--mode=initiator",
            "--protocol=shm",
            "--local_server_name=127.0.0.1",
            &format!("--segment_id={segment}"),
            "--threads=1",
            "--batch_size=16",
            "--block_size=65536",
            "--duration=0.5",
            "--verify",
            "--json",
        ])
        .args(args)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "tern-bench initiator {args:?}: {}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

fn bench_bytes(json: &serde_json::Value, protocol: &str) -> u64 {
    json["stats"]["transports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["protocol"] == protocol)
        .and_then(|t| t["bytes"].as_u64())
        .unwrap()
}

fn fill(buffer: &OwnedBuffer, len: usize) {
    let bytes: Vec<u8> = (0..len).map(target_byte).collect();
    buffer.write_at(0, &bytes).unwrap();
}

#[test]
fn two_processes_move_bytes_both_ways_over_memfd_and_cross_memory_attach() {
    for memory in ["memfd", "plain"] {
        let memfd = memory == "memfd";
        let target = Target::start(
            &[
                "--protocol=shm",
                &format!("--shm_memory={memory}"),
                "--local_server_name=127.0.0.1",
                "--buffer_size=16777216",
            ],
            &[],
        );
        let engine = engine(memfd);
        let peer = engine.open_segment(&target.segment).unwrap();
        let (remote, remote_len) = remote_buffer(&engine, peer);
        assert_eq!(remote_len, 16 * MIB as u64);
        let local = engine.allocate(16 * MIB, "cpu:0").unwrap();
        let mut moved = 0u64;
        // Reads at unaligned offsets, 1 B to 3 MiB + 7.
        let cases = [(0, 1), (13, 4099), (3 * 4096 + 1, MIB), (5, 3 * MIB + 7)];
        for (offset, len) in cases {
            let batch = run(
                &engine,
                &[TransferRequest::read(
                    local.addr() + offset + 3,
                    peer,
                    remote + offset as u64,
                    len,
                )],
            );
            all_completed(&batch);
            let mut got = vec![0u8; len];
            local.read_at(offset + 3, &mut got).unwrap();
            assert!(
                got.iter()
                    .enumerate()
                    .all(|(i, b)| *b == target_byte(offset + i)),
                "{memory}: read of {len} B at {offset}"
            );
            moved += len as u64;
        }
        // Writes of a pattern of ours, read back into another part of the local buffer.
        let ours: Vec<u8> = (0..2 * MIB + 11).map(|i| (i % 253) as u8 ^ 0x5a).collect();
        local.write_at(0, &ours).unwrap();
        let at = remote + 8 * MIB as u64 + 1;
        all_completed(&run(
            &engine,
            &[TransferRequest::write(local.addr(), peer, at, ours.len())],
        ));
        all_completed(&run(
            &engine,
            &[TransferRequest::read(
                local.addr() + 4 * MIB + 9,
                peer,
                at,
                ours.len(),
            )],
        ));
        let mut back = vec![0u8; ours.len()];
        local.read_at(4 * MIB + 9, &mut back).unwrap();
        assert!(back == ours, "{memory}: written bytes came back changed");
        moved += 2 * ours.len() as u64;
        // One block written and read again and again in one batch (a benchmark's reuse):
        // each slice is cut among the hands on both paths, and the block still lands whole.
        let block = 256 << 10;
        let again = remote + 12 * MIB as u64;
        let writes: Vec<_> = (0..8)
            .map(|_| TransferRequest::write(local.addr() + 64, peer, again, block))
            .collect();
        all_completed(&run(&engine, &writes));
        let reads: Vec<_> = (0..8)
            .map(|_| TransferRequest::read(local.addr() + 6 * MIB, peer, again, block))
            .collect();
        all_completed(&run(&engine, &reads));
        let mut block_back = vec![0u8; block];
        local.read_at(6 * MIB, &mut block_back).unwrap();
        assert!(
            block_back == ours[64..64 + block],
            "{memory}: a block moved again and again came back changed"
        );
        moved += 16 * block as u64;
        let shm = transport_stats(&engine, "shm");
        assert_eq!(shm.bytes, moved, "{memory}: {shm:?}");
        assert_eq!(transport_stats(&engine, "tcp").bytes, 0, "{memory}");
        assert_eq!(
            maps_memfd_of(target.child.id()),
            memfd,
            "{memory}: the target's memfd mapped here"
        );

        // The other way: a tern-bench initiator process reads and writes this engine's buffer.
        fill(&local, 16 * MIB);
        for op in ["read", "write"] {
            let json = bench_initiator(
                &[],
                engine.segment_name(),
                &[
                    &format!("--operation={op}"),
                    &format!("--shm_memory={memory}"),
                    "--buffer_size=8388608",
                ],
            );
            assert!(bench_bytes(&json, "shm") > 0, "{memory} {op}: {json}");
            assert_eq!(bench_bytes(&json, "tcp"), 0, "{memory} {op}: {json}");
        }
    }
}

#[test]
fn a_target_killed_while_mapped_fails_its_tasks_typed_is_unmapped_and_the_engine_serves_on() {
    let mut target = Target::start(
        &[
            "--protocol=shm",
            "--local_server_name=127.0.0.1",
            "--buffer_size=67108864",
        ],
        &[],
    );
    let pid = target.child.id();
    let engine = engine(true);
    let peer = engine.open_segment(&target.segment).unwrap();
    let (remote, _) = remote_buffer(&engine, peer);
    let local = engine.allocate(64 * MIB, "cpu:0").unwrap();
    all_completed(&run(
        &engine,
        &[TransferRequest::read(local.addr(), peer, remote, MIB)],
    ));
    assert!(maps_memfd_of(pid), "the target's memfd is mapped");

    // Batches of reads keep going while the target is killed under them.
    let reads: Vec<TransferRequest> = (0..64)
        .map(|i| {
            TransferRequest::read(local.addr() + i * MIB, peer, remote + (i * MIB) as u64, MIB)
        })
        .collect();
    let mut killed = false;
    let mut failed = None;
    let started = Instant::now();
    for round in 0.. {
        if round == 3 {
            target.child.kill().unwrap();
            killed = true;
        }
        let batch = run(&engine, &reads);
        let status = batch.status();
        assert_eq!(status.pending, 0, "a task hangs: {status:?}");
        for task in 0..status.submitted {
            match batch.task_status(task).unwrap().status {
                TransferStatus::Completed => {
                    let mut got = vec![0u8; MIB];
                    local.read_at(task * MIB, &mut got).unwrap();
                    assert!(
                        got.iter()
                            .enumerate()
                            .all(|(j, b)| *b == target_byte(task * MIB + j)),
                        "a completed read carries wrong bytes"
                    );
                }
                TransferStatus::Failed(TransferError::Connection { message, .. }) => {
                    failed = Some(message)
                }
                other => panic!("task {task} ended {other}"),
            }
        }
        if killed && failed.is_some() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no task failed after the kill"
        );
    }
    target.child.wait().unwrap();
    // Later transfers fail at once with Connection, and nothing of the target stays mapped.
    let batch = run(&engine, &reads[..1]);
    assert!(
        matches!(
            batch.task_status(0).unwrap().status,
            TransferStatus::Failed(TransferError::Connection { .. })
        ),
        "{:?}",
        batch.task_status(0)
    );
    let unmapped_by = Instant::now() + Duration::from_secs(10);
    while maps_memfd_of(pid) {
        assert!(
            Instant::now() < unmapped_by,
            "the dead target is still mapped"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The engine serves the next peer.
    let next = Target::start(
        &[
            "--protocol=shm",
            "--local_server_name=127.0.0.1",
            "--buffer_size=4194304",
        ],
        &[],
    );
    let peer = engine.open_segment(&next.segment).unwrap();
    let (remote, _) = remote_buffer(&engine, peer);
    all_completed(&run(
        &engine,
        &[TransferRequest::read(local.addr(), peer, remote, MIB)],
    ));
}

#[test]
fn with_ptrace_denied_cross_memory_attach_is_refused_and_tcp_carries_the_slices() {
    // The target makes itself not dumpable; the initiator has no CAP_SYS_PTRACE (as root it
    // gives it up), so the kernel refuses process_vm_readv/writev between them.
    let target = Target::start(
        &[
            "--protocol=shm",
            "--shm_memory=plain",
            "--shm_ptrace=refuse",
            "--local_server_name=127.0.0.1",
            "--buffer_size=4194304",
        ],
        &[],
    );
    let prefix: &[&str] = if is_root() {
        &["setpriv", "--bounding-set", "-sys_ptrace", "--"]
    } else {
        &[]
    };
    for op in ["read", "write"] {
        let json = bench_initiator(
            prefix,
            &target.segment,
            &[&format!("--operation={op}"), "--buffer_size=4194304"],
        );
        assert_eq!(bench_bytes(&json, "shm"), 0, "{op}: {json}");
        assert!(bench_bytes(&json, "tcp") > 0, "{op}: {json}");
        let shm = json["stats"]["transports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["protocol"] == "shm")
            .unwrap();
        let why = shm["peers"][0]["last_error"].as_str().unwrap_or_default();
        assert!(why.contains("refused"), "{op}: {why}");
    }
}

/// A network namespace with a veth pair to it, removed on drop.
struct Netns {
    name: String,
    host_if: String,
    host_ip: String,
    inner_ip: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let output = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| e.to_string())?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

impl Netns {
    fn create() -> Result<Self, String> {
        let pid = std::process::id();
        let (b, c) = (200 + pid % 50, (pid / 50) % 250);
        let ns = Self {
            name: format!("tern-shm-{pid}"),
            host_if: format!("tsh{pid}h"),
            host_ip: format!("10.{b}.{c}.1"),
            inner_ip: format!("10.{b}.{c}.2"),
        };
        let inner_if = format!("tsh{pid}n");
        ip(&["netns", "add", &ns.name])?;
        ip(&[
            "link",
            "add",
            &ns.host_if,
            "type",
            "veth",
            "peer",
            "name",
            &inner_if,
        ])?;
        ip(&["link", "set", &inner_if, "netns", &ns.name])?;
        ip(&[
            "addr",
            "add",
            &format!("{}/24", ns.host_ip),
            "dev",
            &ns.host_if,
        ])?;
        ip(&["link", "set", &ns.host_if, "up"])?;
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &ns.name, "ip"];
            all.extend_from_slice(args);
            ip(&all)
        };
        inside(&[
            "addr",
            "add",
            &format!("{}/24", ns.inner_ip),
            "dev",
            &inner_if,
        ])?;
        inside(&["link", "set", &inner_if, "up"])?;
        inside(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.host_if]);
        let _ = ip(&["netns", "del", &self.name]);
    }
}

#[test]
fn a_target_in_another_network_namespace_is_not_same_host_even_when_its_descriptor_says_so() {
    if !is_root() {
        eprintln!("skipped: creating a network namespace needs root");
        return;
    }
    let ns = Netns::create().expect("root can create a network namespace and a veth pair");
    let server = HttpMetadataServer::start(format!("{}:0", ns.host_ip).parse().unwrap()).unwrap();
    let url = format!("http://{}/metadata", server.local_addr());
    let name = format!("netns-target-{}", std::process::id());
    let target = Target::start_under(
        &["ip", "netns", "exec", &ns.name],
        &[
            "--protocol=shm",
            &format!("--metadata_server={url}"),
            &format!("--local_server_name={name}"),
            "--buffer_size=4194304",
        ],
        &[("MC_TCP_BIND_ADDRESS", &ns.inner_ip)],
    );
    assert_eq!(target.segment, name);
    let initiator = TransferEngine::builder()
        .local_server_name(format!("netns-initiator-{}", std::process::id()))
        .advertise_address(ns.host_ip.as_str())
        .metadata(&url)
        .transport(ShmTransport::default())
        .transport(TcpTransport::default())
        .build()
        .unwrap();
    let local = initiator.allocate(4 * MIB, "cpu:0").unwrap();

    // As published: another network namespace, so shm does not even try; TCP carries.
    let peer = initiator.open_segment(&name).unwrap();
    let desc = initiator.segment(peer).unwrap().desc.clone();
    let mine = initiator.local_descriptor();
    assert_eq!(desc.tern["shm"]["boot_id"], mine.tern["shm"]["boot_id"]);
    assert_ne!(desc.tern["shm"]["netns"], mine.tern["shm"]["netns"]);
    let (remote, _) = remote_buffer(&initiator, peer);
    all_completed(&run(
        &initiator,
        &[TransferRequest::read(local.addr(), peer, remote, MIB)],
    ));
    let mut got = vec![0u8; MIB];
    local.read_at(0, &mut got).unwrap();
    assert!(got.iter().enumerate().all(|(i, b)| *b == target_byte(i)));
    assert_eq!(transport_stats(&initiator, "shm").slices, 0);
    assert!(transport_stats(&initiator, "shm").peers.is_empty());
    let tcp_before = transport_stats(&initiator, "tcp").bytes;
    assert_eq!(tcp_before, MIB as u64);

    // The same target under a descriptor that claims this network namespace: shm tries,
    // its socket cannot be reached from here, so it is not same-host, and TCP carries.
    let store = HttpStore::new(&url).unwrap();
    let mut forged = store.fetch_segment(&name).unwrap();
    forged.tern.get_mut("shm").unwrap()["netns"] = mine.tern["shm"]["netns"].clone();
    let forged_name = format!("{name}-forged");
    forged.name = forged_name.clone();
    store.publish_segment(&forged_name, &forged).unwrap();
    store
        .publish_rpc_meta(&forged_name, &store.rpc_meta(&name).unwrap())
        .unwrap();
    let peer = initiator.open_segment(&forged_name).unwrap();
    let requests: Vec<TransferRequest> = (0..4)
        .map(|i| {
            TransferRequest::write(local.addr() + i * MIB, peer, remote + (i * MIB) as u64, MIB)
        })
        .collect();
    all_completed(&run(&initiator, &requests));
    let shm = transport_stats(&initiator, "shm");
    assert_eq!(shm.bytes, 0, "{shm:?}");
    let why = shm.peers[0].last_error.clone().unwrap_or_default();
    assert!(why.contains("cannot connect to its socket"), "{why}");
    assert_eq!(
        transport_stats(&initiator, "tcp").bytes,
        tcp_before + 4 * MIB as u64
    );
}
