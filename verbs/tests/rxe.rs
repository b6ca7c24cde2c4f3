//! Real verbs on Soft-RoCE. These need an RDMA device, so on a plain host they are ignored;
//! `cargo xtask softroce --test -p tern-verbs` (and `cargo xtask test`) runs them inside the
//! guest, where `rxe0` exists.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tern_verbs::{
    Access, Completion, CompletionError, CompletionQueue, Context, MemoryRegion, PathConfig, Peer,
    ProtectionDomain, QpCaps, QueuePair, SendOp, SendRequest, Sge,
};

const NEEDS_RXE: &str = "needs Soft-RoCE: cargo xtask softroce --test -p tern-verbs";

fn device() -> String {
    std::env::var("TERN_RXE").unwrap_or_else(|_| "rxe0".into())
}

/// The device under test, opened: its protection domain and the path settings for its
/// auto-selected GID (which must be RoCE v2, IPv4-mapped, on an active port).
fn open_device() -> (
    Arc<Context>,
    Arc<ProtectionDomain>,
    PathConfig,
    tern_verbs::Gid,
) {
    let context = Context::open(&device()).unwrap();
    let port = context.port(1).unwrap();
    assert!(port.active, "port 1 of {} is not active", device());
    let gid = context.select_gid(1, None).unwrap();
    assert!(gid.gid.is_ipv4_mapped(), "auto-selected {gid:?}");
    let pd = ProtectionDomain::new(&context).unwrap();
    let path = PathConfig {
        sgid_index: gid.index as u8,
        mtu: port.active_mtu,
        retry_count: 3,
        ..PathConfig::default()
    };
    (context, pd, path, gid.gid)
}

/// Two RC QPs on one device, connected to each other.
struct Loop {
    pd: Arc<ProtectionDomain>,
    a: QueuePair,
    b: QueuePair,
    path: PathConfig,
    gid: tern_verbs::Gid,
}

impl Loop {
    fn new() -> Self {
        let (context, pd, path, gid) = open_device();
        let cq = CompletionQueue::new(&context, 1024).unwrap();
        let a = QueuePair::new_rc(&pd, &cq, QpCaps::default()).unwrap();
        let b = QueuePair::new_rc(&pd, &cq, QpCaps::default()).unwrap();
        let this = Self {
            pd,
            a,
            b,
            path,
            gid,
        };
        this.connect();
        this
    }

    fn connect(&self) {
        let peer_of = |qp: &QueuePair| Peer {
            qp_num: qp.qp_num(),
            psn: 0,
            gid: self.gid,
            lid: 0,
        };
        self.a.connect(&peer_of(&self.b), &self.path).unwrap();
        self.b.connect(&peer_of(&self.a), &self.path).unwrap();
    }

    /// Posts one signaled request on `a` and waits for its completion.
    fn run(&self, op: SendOp, sge: Sge) -> Completion {
        post_and_wait(&self.a, op, sge)
    }
}

/// Posts one signaled request on `qp` and polls its CQ until the completion arrives.
fn post_and_wait(qp: &QueuePair, op: SendOp, sge: Sge) -> Completion {
    let request = SendRequest {
        wr_id: 7,
        op,
        sges: vec![sge],
        signaled: true,
    };
    qp.post_send(&[request]).unwrap();
    let started = Instant::now();
    let mut out = [Completion::EMPTY];
    while qp.cq().poll(&mut out).unwrap() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no completion"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    out[0]
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A Vec registered as an MR; the Vec lives as long as the MR (dropped after it).
struct Registered {
    mr: MemoryRegion,
    bytes: Vec<u8>,
}

fn register(pd: &Arc<ProtectionDomain>, len: usize, access: Access) -> Registered {
    let mut bytes = vec![0u8; len];
    // SAFETY: the Vec is never reallocated and is dropped after the MR (field order).
    let mr = unsafe { MemoryRegion::register(pd, bytes.as_mut_ptr(), len, access) }.unwrap();
    Registered { mr, bytes }
}

impl Registered {
    fn sge(&self, offset: usize, len: usize) -> Sge {
        Sge {
            addr: (self.mr.addr() + offset) as u64,
            len: len as u32,
            lkey: self.mr.lkey(),
        }
    }

    fn remote(&self, offset: usize) -> u64 {
        (self.mr.addr() + offset) as u64
    }

    /// Reads the bytes the NIC wrote, without letting the compiler assume it knows them.
    fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        (offset..offset + len)
            // SAFETY: in bounds of the Vec; volatile because the device wrote behind our back.
            .map(|i| unsafe { std::ptr::read_volatile(self.bytes.as_ptr().add(i)) })
            .collect()
    }

    fn write(&mut self, offset: usize, data: &[u8]) {
        self.bytes[offset..offset + data.len()].copy_from_slice(data);
    }
}

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-verbs"]
fn write_and_read_move_exact_bytes_at_every_size_and_offset() {
    let _ = NEEDS_RXE;
    let qps = Loop::new();
    let mut local = register(&qps.pd, 64 << 20, Access::REMOTE);
    let remote = register(&qps.pd, 64 << 20, Access::REMOTE);
    for (round, (len, local_off, remote_off)) in [
        (1usize, 0usize, 0usize),
        (4096, 3, 5),
        (65536, 4096, 1),
        (1 << 20, 7, 13),
        (8 << 20, 1, 3),
    ]
    .into_iter()
    .enumerate()
    {
        let data = pattern(round as u8, len);
        local.write(local_off, &data);
        let done = qps.run(
            SendOp::Write {
                remote_addr: remote.remote(remote_off),
                rkey: remote.mr.rkey(),
            },
            local.sge(local_off, len),
        );
        assert_eq!(done.status, Ok(()), "write of {len}");
        assert!(
            remote.read(remote_off, len) == data,
            "write of {len}: bytes differ"
        );

        local.write(local_off, &vec![0; len]);
        let done = qps.run(
            SendOp::Read {
                remote_addr: remote.remote(remote_off),
                rkey: remote.mr.rkey(),
            },
            local.sge(local_off, len),
        );
        assert_eq!(done.status, Ok(()), "read of {len}");
        assert_eq!(done.byte_len as usize, len);
        assert!(
            local.read(local_off, len) == data,
            "read of {len}: bytes differ"
        );
    }
}

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-verbs"]
fn bad_keys_and_addresses_are_typed_completion_errors_and_the_qp_recovers() {
    let qps = Loop::new();
    let local = register(&qps.pd, 1 << 20, Access::REMOTE);
    let remote = register(&qps.pd, 1 << 20, Access::REMOTE);
    // A key nobody issued.
    let done = qps.run(
        SendOp::Write {
            remote_addr: remote.remote(0),
            rkey: remote.mr.rkey() ^ 0x5a5a_0000,
        },
        local.sge(0, 4096),
    );
    assert_eq!(
        done.status.unwrap_err().code,
        CompletionError::REMOTE_ACCESS
    );

    // The QP is in the error state now: reset and reconnect, then it works again.
    qps.a.reset().unwrap();
    qps.b.reset().unwrap();
    qps.connect();
    let ok = qps.run(
        SendOp::Write {
            remote_addr: remote.remote(0),
            rkey: remote.mr.rkey(),
        },
        local.sge(0, 4096),
    );
    assert_eq!(ok.status, Ok(()));

    // A valid key with an address past the end of its region: the key grants access, the
    // address and length choose the bytes.
    let done = qps.run(
        SendOp::Write {
            remote_addr: remote.remote((1 << 20) - 100),
            rkey: remote.mr.rkey(),
        },
        local.sge(0, 4096),
    );
    assert_eq!(
        done.status.unwrap_err().code,
        CompletionError::REMOTE_ACCESS
    );
}

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-verbs"]
fn granted_access_is_the_access_asked_for() {
    let qps = Loop::new();
    let local = register(&qps.pd, 1 << 20, Access::REMOTE);
    let write_only = register(
        &qps.pd,
        1 << 20,
        Access {
            remote_write: true,
            remote_read: false,
            relaxed_ordering: true,
        },
    );
    let done = qps.run(
        SendOp::Write {
            remote_addr: write_only.remote(0),
            rkey: write_only.mr.rkey(),
        },
        local.sge(0, 4096),
    );
    assert_eq!(done.status, Ok(()), "a write into a write-only region");
    let done = qps.run(
        SendOp::Read {
            remote_addr: write_only.remote(0),
            rkey: write_only.mr.rkey(),
        },
        local.sge(0, 4096),
    );
    assert_eq!(
        done.status.unwrap_err().code,
        CompletionError::REMOTE_ACCESS,
        "a read from a region registered without REMOTE_READ"
    );
}

static mut STATIC_BUFFER: [u8; 65536] = [0; 65536];

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-verbs"]
fn every_kind_of_process_memory_registers_and_moves_data() {
    let qps = Loop::new();
    let source = {
        let mut s = register(&qps.pd, 65536, Access::REMOTE);
        s.write(0, &pattern(99, 65536));
        s
    };
    let len = 65536usize;
    // SAFETY: anonymous private mapping of `len` bytes, unmapped at the end of the test.
    let anon = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(anon, libc::MAP_FAILED);
    // SAFETY: a memfd of `len` bytes, mapped shared; closed and unmapped at the end.
    let (fd, shared) = unsafe {
        let fd = libc::memfd_create(c"tern-test".as_ptr(), 0);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, len as libc::off_t), 0);
        let map = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        );
        assert_ne!(map, libc::MAP_FAILED);
        (fd, map)
    };
    // SAFETY: 2 MiB huge page if the kernel has one to give; None otherwise.
    let huge = unsafe {
        let map = libc::mmap(
            std::ptr::null_mut(),
            2 << 20,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB,
            -1,
            0,
        );
        (map != libc::MAP_FAILED).then_some(map)
    };
    let mut heap = vec![0u8; len];
    // Only the NIC writes the static, and only this test touches it.
    let static_ptr = std::ptr::addr_of_mut!(STATIC_BUFFER).cast::<u8>();
    let mut kinds: Vec<(&str, *mut u8)> = vec![
        ("heap", heap.as_mut_ptr()),
        ("anonymous mmap", anon.cast()),
        ("memfd shared memory", shared.cast()),
        ("static", static_ptr),
    ];
    if let Some(huge) = huge {
        kinds.push(("huge page", huge.cast()));
    } else {
        assert!(
            std::env::var_os("TERN_IN_GUEST").is_none(),
            "the guest reserves huge pages, yet none could be mapped"
        );
        eprintln!("no huge pages configured in this kernel: huge-page memory not exercised");
    }
    for (kind, ptr) in kinds {
        // SAFETY: each mapping/buffer outlives its MR, which is dropped in this iteration.
        let mr = unsafe { MemoryRegion::register(&qps.pd, ptr, len, Access::REMOTE) }
            .unwrap_or_else(|e| panic!("{kind}: {e}"));
        let done = qps.run(
            SendOp::Write {
                remote_addr: ptr as u64,
                rkey: mr.rkey(),
            },
            source.sge(0, len),
        );
        assert_eq!(done.status, Ok(()), "{kind}");
        // SAFETY: `ptr` is valid for `len` bytes; volatile since the NIC wrote them.
        let landed: Vec<u8> = (0..len)
            .map(|i| unsafe { std::ptr::read_volatile(ptr.add(i)) })
            .collect();
        assert!(landed == pattern(99, len), "{kind}: bytes differ");
        drop(mr);
    }
    // SAFETY: unmapping exactly what was mapped above, after every MR on it is gone.
    unsafe {
        libc::munmap(anon, len);
        libc::munmap(shared, len);
        libc::close(fd);
        if let Some(huge) = huge {
            libc::munmap(huge, 2 << 20);
        }
    }
    drop(heap);
}

/// What one side of the two-process test tells the other, one line on a pipe.
fn endpoint_line(qp: &QueuePair, gid: tern_verbs::Gid, addr: u64, rkey: u32) -> String {
    format!("QP {} {gid} {addr} {rkey}", qp.qp_num())
}

fn parse_endpoint(line: &str) -> (u32, tern_verbs::Gid, u64, u32) {
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(fields.first(), Some(&"QP"), "{line}");
    (
        fields[1].parse().unwrap(),
        tern_verbs::Gid::parse(fields[2]).unwrap(),
        fields[3].parse().unwrap(),
        fields[4].parse().unwrap(),
    )
}

struct Side {
    qp: QueuePair,
    cq: Arc<CompletionQueue>,
    memory: Registered,
    gid: tern_verbs::Gid,
    path: PathConfig,
}

fn side() -> Side {
    let (context, pd, path, gid) = open_device();
    let cq = CompletionQueue::new(&context, 64).unwrap();
    let qp = QueuePair::new_rc(&pd, &cq, QpCaps::default()).unwrap();
    let memory = register(&pd, 1 << 20, Access::REMOTE);
    Side {
        qp,
        cq,
        memory,
        gid,
        path,
    }
}

impl Side {
    /// RESET → RTS towards the other process's QP.
    fn connect_to(&self, qp_num: u32, gid: tern_verbs::Gid) {
        let peer = Peer {
            qp_num,
            psn: 0,
            gid,
            lid: 0,
        };
        self.qp.connect(&peer, &self.path).unwrap();
    }
}

/// The child process: publishes its QP and memory, connects, waits until told to stop.
fn qp_child() {
    use std::io::BufRead;
    let mut me = side();
    me.memory.write(0, &pattern(42, 1 << 20));
    println!(
        "{}",
        endpoint_line(&me.qp, me.gid, me.memory.remote(0), me.memory.mr.rkey())
    );
    let mut lines = std::io::stdin().lock().lines();
    let (qpn, gid, _, _) = parse_endpoint(&lines.next().unwrap().unwrap());
    me.connect_to(qpn, gid);
    println!("CONNECTED");
    assert_eq!(lines.next().unwrap().unwrap(), "DONE");
    assert!(
        me.memory.read(4096, 4096) == pattern(7, 4096),
        "the parent's write did not land"
    );
    println!("VERIFIED");
    drop(me.cq);
}

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-verbs"]
fn a_queue_pair_between_two_processes_moves_data() {
    use std::io::{BufRead, BufReader, Write};
    if std::env::var_os("TERN_QP_CHILD").is_some() {
        qp_child();
        return;
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "a_queue_pair_between_two_processes_moves_data",
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("TERN_QP_CHILD", "1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut from_child = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut to_child = child.stdin.take().unwrap();
    // libtest prints "test <name> ... " without a newline first, so a marker may sit
    // mid-line: take the line from the marker on.
    let mut next_line = |marker: &str| loop {
        let line = from_child.next().expect("child exited").unwrap();
        if let Some(at) = line.find(marker) {
            return line[at..].to_owned();
        }
    };
    let (qpn, gid, remote_addr, rkey) = parse_endpoint(&next_line("QP "));
    let mut me = side();
    writeln!(to_child, "{}", endpoint_line(&me.qp, me.gid, 0, 0)).unwrap();
    me.connect_to(qpn, gid);
    next_line("CONNECTED");
    let run = |me: &Side, op: SendOp, sge: Sge| post_and_wait(&me.qp, op, sge).status;
    let read = run(
        &me,
        SendOp::Read { remote_addr, rkey },
        me.memory.sge(0, 1 << 20),
    );
    assert_eq!(read, Ok(()));
    assert!(
        me.memory.read(0, 1 << 20) == pattern(42, 1 << 20),
        "read the wrong bytes"
    );
    me.memory.write(0, &pattern(7, 4096));
    let write = run(
        &me,
        SendOp::Write {
            remote_addr: remote_addr + 4096,
            rkey,
        },
        me.memory.sge(0, 4096),
    );
    assert_eq!(write, Ok(()));
    writeln!(to_child, "DONE").unwrap();
    next_line("VERIFIED");
    assert!(child.wait().unwrap().success());
}

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-verbs"]
fn send_receive_and_write_with_immediate_wake_a_blocking_waiter() {
    let (context, pd, path, gid) = open_device();
    let cq = CompletionQueue::with_channel(&context, 64).unwrap();
    let a = QueuePair::new_rc(&pd, &cq, QpCaps::default()).unwrap();
    let b = QueuePair::new_rc(&pd, &cq, QpCaps::default()).unwrap();
    let peer = |qp: &QueuePair| Peer {
        qp_num: qp.qp_num(),
        psn: 0,
        gid,
        lid: 0,
    };
    a.connect(&peer(&b), &path).unwrap();
    b.connect(&peer(&a), &path).unwrap();
    let mut sender = register(&pd, 4096, Access::REMOTE);
    let receiver = register(&pd, 4096, Access::REMOTE);
    b.post_recv(&[
        (100, vec![receiver.sge(0, 256)]),
        (101, vec![receiver.sge(256, 256)]),
    ])
    .unwrap();

    // Nothing happened yet: the waiter sleeps for its timeout and takes nothing.
    let mut out = [Completion::EMPTY; 4];
    let started = Instant::now();
    assert_eq!(cq.wait(&mut out, Duration::from_millis(300)).unwrap(), 0);
    assert!(started.elapsed() >= Duration::from_millis(250));

    sender.write(0, b"small control message");
    let send = SendRequest {
        wr_id: 1,
        op: SendOp::Send,
        sges: vec![sender.sge(0, 21)],
        signaled: true,
    };
    let write_imm = SendRequest {
        wr_id: 2,
        op: SendOp::WriteWithImm {
            remote_addr: receiver.remote(1024),
            rkey: receiver.mr.rkey(),
            imm: 0xC0FFEE,
        },
        sges: vec![sender.sge(0, 5)],
        signaled: true,
    };
    a.post_send(&[send, write_imm]).unwrap();

    let mut seen = Vec::new();
    let started = Instant::now();
    while seen.len() < 4 {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "completions: {seen:?}"
        );
        let got = cq.wait(&mut out, Duration::from_secs(10)).unwrap();
        seen.extend_from_slice(&out[..got]);
    }
    assert!(seen.iter().all(|c| c.status.is_ok()), "{seen:?}");
    let recv_send = seen.iter().find(|c| c.wr_id == 100).unwrap();
    assert_eq!((recv_send.byte_len, recv_send.imm), (21, None));
    assert_eq!(receiver.read(0, 21), b"small control message");
    let recv_imm = seen.iter().find(|c| c.wr_id == 101).unwrap();
    assert_eq!(recv_imm.imm, Some(0xC0FFEE));
    assert_eq!(receiver.read(1024, 5), b"small");
}

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-verbs"]
fn a_low_locked_memory_limit_is_a_clear_error() {
    if std::env::var_os("TERN_MEMLOCK_CHILD").is_some() {
        let context = Context::open(&device()).unwrap();
        let pd = ProtectionDomain::new(&context).unwrap();
        let mut memory = vec![0u8; 64 << 20];
        // SAFETY: `memory` outlives the attempt; a successful MR would be dropped at once.
        let error = unsafe {
            MemoryRegion::register(&pd, memory.as_mut_ptr(), memory.len(), Access::REMOTE)
        }
        .expect_err("64 MiB registered under a 64 KiB locked-memory limit");
        assert!(
            matches!(error, tern_verbs::VerbsError::MemlockLimit { .. }),
            "{error:?}"
        );
        assert!(error.to_string().contains("ulimit -l"), "{error}");
        return;
    }
    // Root may lock any amount (CAP_IPC_LOCK): run the check as an unprivileged user with a
    // 64 KiB limit, as most service users are.
    let status = std::process::Command::new("prlimit")
        .args([
            "--memlock=65536:65536",
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
        ])
        .arg(std::env::current_exe().unwrap())
        .args([
            "a_low_locked_memory_limit_is_a_clear_error",
            "--exact",
            "--include-ignored",
            "--test-threads=1",
        ])
        .env("TERN_MEMLOCK_CHILD", "1")
        .status()
        .unwrap();
    assert!(status.success(), "the unprivileged check failed: {status}");
}
