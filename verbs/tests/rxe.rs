//! Real verbs on Soft-RoCE. These need an RDMA device, so on a plain host they are ignored;
//! `cargo xtask softroce --test -p tern-verbs` (and `cargo xtask test`) runs them inside the
//! guest, where `rxe0` exists.

use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tern_verbs::{
    Access, CompletionError, CompletionQueue, Context, MemoryGuard, MemoryRegion, Outcome,
    PathConfig, Peer, ProtectionDomain, QpCaps, QueuePair, RecvWork, SendOp, SendWork, Sge,
};

#[path = "../../testkit/include/completions.rs"]
mod completions;
use completions::next_completion;

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

/// The QPs of these tests: work requests keep their memory through [`Keep`], and carry no
/// value of their own but an index.
type Qp = QueuePair<Keep, u64>;

/// Two RC QPs on one device, connected to each other.
struct Loop {
    pd: Arc<ProtectionDomain>,
    a: Qp,
    b: Qp,
    path: PathConfig,
    gid: tern_verbs::Gid,
}

impl Loop {
    fn new() -> Self {
        let (context, pd, path, gid) = open_device();
        let cq = CompletionQueue::new(&context, 1024).unwrap();
        let a = Qp::new_rc(&pd, &cq, QpCaps::default()).unwrap();
        let b = Qp::new_rc(&pd, &cq, QpCaps::default()).unwrap();
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
        connect_to_each_other(&self.a, &self.b, &self.path, self.gid);
    }

    /// Posts one request on `a` moving `len` bytes at `offset` of `local`, and waits for it.
    fn run(&self, op: SendOp, local: &Arc<Registered>, offset: usize, len: usize) -> Done {
        post_and_wait(&self.a, op, local, offset, len)
    }
}

/// Connects `a` and `b`, two QPs of one device whose GID is `gid`, to each other.
fn connect_to_each_other(a: &Qp, b: &Qp, path: &PathConfig, gid: tern_verbs::Gid) {
    let peer_of = |qp: &Qp| Peer {
        qp_num: qp.qp_num(),
        psn: 0,
        gid,
        lid: 0,
    };
    a.connect(&peer_of(b), path).unwrap();
    b.connect(&peer_of(a), path).unwrap();
}

/// What a completion said, read before the completion was handed back to its QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Done {
    status: Result<(), CompletionError>,
    byte_len: u32,
}

/// Posts one request on `qp` and waits for its completion, which retires it.
fn post_and_wait(qp: &Qp, op: SendOp, local: &Arc<Registered>, offset: usize, len: usize) -> Done {
    let mut work = vec![SendWork {
        op,
        local: local.sge(offset, len),
        guard: Keep(local.clone()),
        user: 7,
    }];
    qp.post_send(&mut work).unwrap();
    assert!(work.is_empty());
    let completion = next_completion(qp.cq());
    let done = Done {
        status: completion.status(),
        byte_len: completion.byte_len(),
    };
    let mut retired = Vec::new();
    assert_eq!(qp.retire(completion, &mut retired), Ok(1));
    assert_eq!(retired[0].0, 7);
    assert_eq!(qp.in_flight(), 0);
    done
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Heap memory registered as an MR. Work requests hold it through [`Keep`], so its bytes
/// are freed only once the MR is gone and no request holds it any more.
struct Registered {
    mr: ManuallyDrop<MemoryRegion>,
    bytes: *mut u8,
    len: usize,
}

// SAFETY: the bytes are reached only through raw pointers (the NIC writes them anyway); the
// MR is Send + Sync.
unsafe impl Send for Registered {}
// SAFETY: see Send.
unsafe impl Sync for Registered {}

impl Drop for Registered {
    fn drop(&mut self) {
        // SAFETY: dropped exactly once, here, before the memory it registers is freed.
        unsafe { ManuallyDrop::drop(&mut self.mr) };
        // SAFETY: `bytes` came from `Box::into_raw` of a slice of `len` bytes in `register`.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.bytes, self.len)) });
    }
}

/// Keeps a [`Registered`] alive while a work request uses it.
struct Keep(Arc<Registered>);

// SAFETY: the bytes of a `Registered` are freed only in its Drop, which runs when the last
// Arc — this one included — goes; the range never changes.
unsafe impl MemoryGuard for Keep {
    fn span(&self) -> (usize, usize) {
        (self.0.bytes as usize, self.0.len)
    }
}

fn register(pd: &Arc<ProtectionDomain>, len: usize, access: Access) -> Arc<Registered> {
    let bytes = Box::into_raw(vec![0u8; len].into_boxed_slice()).cast::<u8>();
    // SAFETY: the memory is freed only after this MR is dropped (`Registered`'s Drop).
    let mr = unsafe { MemoryRegion::register(pd, bytes, len, access) }.unwrap();
    Arc::new(Registered {
        mr: ManuallyDrop::new(mr),
        bytes,
        len,
    })
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

    fn rkey(&self) -> u32 {
        self.mr.rkey()
    }

    /// Reads the bytes the NIC wrote, without letting the compiler assume it knows them.
    fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        assert!(offset + len <= self.len);
        (offset..offset + len)
            // SAFETY: in bounds (checked); volatile because the device writes behind our back.
            .map(|i| unsafe { std::ptr::read_volatile(self.bytes.add(i)) })
            .collect()
    }

    fn write(&self, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= self.len);
        // SAFETY: in bounds (checked); raw copy, as the device may touch these bytes too.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.bytes.add(offset), data.len()) };
    }
}

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-verbs"]
fn write_and_read_move_exact_bytes_at_every_size_and_offset() {
    let _ = NEEDS_RXE;
    let qps = Loop::new();
    let local = register(&qps.pd, 64 << 20, Access::REMOTE);
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
                rkey: remote.rkey(),
            },
            &local,
            local_off,
            len,
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
                rkey: remote.rkey(),
            },
            &local,
            local_off,
            len,
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
            rkey: remote.rkey() ^ 0x5a5a_0000,
        },
        &local,
        0,
        4096,
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
            rkey: remote.rkey(),
        },
        &local,
        0,
        4096,
    );
    assert_eq!(ok.status, Ok(()));

    // A valid key with an address past the end of its region: the key grants access, the
    // address and length choose the bytes.
    let done = qps.run(
        SendOp::Write {
            remote_addr: remote.remote((1 << 20) - 100),
            rkey: remote.rkey(),
        },
        &local,
        0,
        4096,
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
            rkey: write_only.rkey(),
        },
        &local,
        0,
        4096,
    );
    assert_eq!(done.status, Ok(()), "a write into a write-only region");
    let done = qps.run(
        SendOp::Read {
            remote_addr: write_only.remote(0),
            rkey: write_only.rkey(),
        },
        &local,
        0,
        4096,
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
    let source = register(&qps.pd, 65536, Access::REMOTE);
    source.write(0, &pattern(99, 65536));
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
            &source,
            0,
            len,
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
fn endpoint_line(qp: &Qp, gid: tern_verbs::Gid, addr: u64, rkey: u32) -> String {
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
    qp: Qp,
    cq: Arc<CompletionQueue>,
    memory: Arc<Registered>,
    gid: tern_verbs::Gid,
    path: PathConfig,
}

fn side() -> Side {
    let (context, pd, path, gid) = open_device();
    let cq = CompletionQueue::new(&context, 64).unwrap();
    let qp = Qp::new_rc(&pd, &cq, QpCaps::default()).unwrap();
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
    let me = side();
    me.memory.write(0, &pattern(42, 1 << 20));
    println!(
        "{}",
        endpoint_line(&me.qp, me.gid, me.memory.remote(0), me.memory.rkey())
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
    let me = side();
    writeln!(to_child, "{}", endpoint_line(&me.qp, me.gid, 0, 0)).unwrap();
    me.connect_to(qpn, gid);
    next_line("CONNECTED");
    let run =
        |me: &Side, op: SendOp, len: usize| post_and_wait(&me.qp, op, &me.memory, 0, len).status;
    let read = run(&me, SendOp::Read { remote_addr, rkey }, 1 << 20);
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
        4096,
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
    let a = Qp::new_rc(&pd, &cq, QpCaps::default()).unwrap();
    let b = Qp::new_rc(&pd, &cq, QpCaps::default()).unwrap();
    connect_to_each_other(&a, &b, &path, gid);
    let sender = register(&pd, 4096, Access::REMOTE);
    let receiver = register(&pd, 4096, Access::REMOTE);
    let receive = |offset: usize, user: u64| RecvWork {
        local: receiver.sge(offset, 256),
        guard: Keep(receiver.clone()),
        user,
    };
    b.post_recv(&mut vec![receive(0, 100), receive(256, 101)])
        .unwrap();

    // Nothing happened yet: the waiter sleeps for its timeout and takes nothing.
    let mut out = Vec::new();
    let started = Instant::now();
    assert_eq!(cq.wait(&mut out, 4, Duration::from_millis(300)).unwrap(), 0);
    assert!(started.elapsed() >= Duration::from_millis(250));

    sender.write(0, b"small control message");
    let mut sends = vec![
        SendWork {
            op: SendOp::Send,
            local: sender.sge(0, 21),
            guard: Keep(sender.clone()),
            user: 1,
        },
        SendWork {
            op: SendOp::WriteWithImm {
                remote_addr: receiver.remote(1024),
                rkey: receiver.rkey(),
                imm: 0xC0FFEE,
            },
            local: sender.sge(0, 5),
            guard: Keep(sender.clone()),
            user: 2,
        },
    ];
    a.post_send(&mut sends).unwrap();

    // Each completion, read and then retired on its QP: (value, status, bytes, immediate).
    let mut seen = Vec::new();
    let started = Instant::now();
    while seen.len() < 4 {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "completions: {seen:?}"
        );
        cq.wait(&mut out, 4, Duration::from_secs(10)).unwrap();
        for completion in out.drain(..) {
            let facts = (completion.status(), completion.byte_len(), completion.imm());
            let qp = if completion.qp_num() == b.qp_num() {
                &b
            } else {
                &a
            };
            let mut retired = Vec::new();
            qp.retire(completion, &mut retired).unwrap();
            for (user, outcome) in retired {
                seen.push((user, outcome, facts));
            }
        }
    }
    assert!(
        seen.iter()
            .all(|(_, outcome, (status, _, _))| *outcome == Outcome::Done && status.is_ok()),
        "{seen:?}"
    );
    let facts_of = |user: u64| seen.iter().find(|s| s.0 == user).unwrap().2;
    assert_eq!(facts_of(100), (Ok(()), 21, None));
    assert_eq!(receiver.read(0, 21), b"small control message");
    assert_eq!(facts_of(101).2, Some(0xC0FFEE));
    assert_eq!(receiver.read(1024, 5), b"small");
    assert_eq!(a.in_flight() + b.in_flight(), 0);
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

/// Polls `cq` and retires every completion on `qp` until nothing is in flight there;
/// returns the outcomes in posting order.
fn drain(qp: &Qp, cq: &CompletionQueue) -> Vec<(u64, Outcome<CompletionError>)> {
    let mut retired = Vec::new();
    let mut out = Vec::new();
    let started = Instant::now();
    while qp.in_flight() > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "{} request(s) never completed",
            qp.in_flight()
        );
        if cq.poll(&mut out, 64).unwrap() == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
        for completion in out.drain(..) {
            qp.retire(completion, &mut retired).unwrap();
        }
    }
    retired
}

/// `count` requests of `block` bytes each from `local` (request `i` at `i * block` on both
/// sides), one chain.
fn post_blocks(
    qp: &Qp,
    local: &Arc<Registered>,
    count: usize,
    block: usize,
    op: impl Fn(usize) -> SendOp,
) {
    let mut work: Vec<SendWork<Keep, u64>> = (0..count)
        .map(|i| SendWork {
            op: op(i * block),
            local: local.sge(i * block, block),
            guard: Keep(local.clone()),
            user: i as u64,
        })
        .collect();
    qp.post_send(&mut work).unwrap();
}

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-verbs"]
fn deregistering_under_outstanding_requests_fails_them_and_never_touches_freed_memory() {
    const BLOCK: usize = 64 << 10;
    const COUNT: usize = 1024;
    let (context, pd, path, gid) = open_device();
    let cq = CompletionQueue::new(&context, 4096).unwrap();
    let caps = QpCaps {
        max_send_wr: COUNT as u32,
        ..QpCaps::default()
    };
    let a = Qp::new_rc(&pd, &cq, caps).unwrap();
    let b = Qp::new_rc(&pd, &cq, caps).unwrap();
    connect_to_each_other(&a, &b, &path, gid);
    let source = register(&pd, COUNT * BLOCK, Access::REMOTE);
    source.write(0, &pattern(3, COUNT * BLOCK));

    // The peer deregisters its memory while 64 MiB of writes into it are outstanding: the
    // writes still queued end in error, and once deregistration has returned the NIC never
    // writes those bytes again, whatever the initiator had posted.
    let mut target = vec![0u8; COUNT * BLOCK];
    let target_bytes = target.as_mut_ptr();
    // SAFETY: `target` outlives the MR, which is dropped below, long before the Vec.
    let target_mr =
        unsafe { MemoryRegion::register(&pd, target_bytes, COUNT * BLOCK, Access::REMOTE) }
            .unwrap();
    let (target_addr, target_rkey) = (target_mr.addr() as u64, target_mr.rkey());
    post_blocks(&a, &source, COUNT, BLOCK, |offset| SendOp::Write {
        remote_addr: target_addr + offset as u64,
        rkey: target_rkey,
    });
    drop(target_mr);
    // The memory is the peer's to reuse now: it writes a pattern of its own.
    // SAFETY: `target` owns these bytes; raw writes, as a NIC could still race them.
    unsafe { std::ptr::write_bytes(target_bytes, 0xEE, COUNT * BLOCK) };
    let outcomes = drain(&a, &cq);
    assert_eq!(outcomes.len(), COUNT);
    let failed: Vec<u32> = outcomes
        .iter()
        .filter_map(|(_, o)| match o {
            Outcome::Failed(e) => Some(e.code),
            Outcome::Done => None,
        })
        .collect();
    assert!(
        !failed.is_empty(),
        "all {COUNT} writes finished before the deregistration: nothing was outstanding"
    );
    assert!(
        failed[1..].iter().all(|&c| c == CompletionError::FLUSHED)
            && [CompletionError::REMOTE_ACCESS, CompletionError::FLUSHED].contains(&failed[0]),
        "{failed:?}"
    );
    std::thread::sleep(Duration::from_millis(200));
    // SAFETY: in bounds of `target`; volatile, as only a NIC could have changed them.
    let changed = (0..COUNT * BLOCK)
        .filter(|&i| unsafe { std::ptr::read_volatile(target_bytes.add(i)) } != 0xEE)
        .count();
    assert_eq!(
        changed, 0,
        "bytes changed after the memory was deregistered"
    );
    drop(target);

    // The initiator lets go of its memory while reads into it are outstanding: the requests
    // keep it (their guards), so it is freed only once they have been retired — here by the
    // flushes that moving the QP to the error state causes.
    let far = register(&pd, COUNT * BLOCK, Access::REMOTE);
    let (far_addr, far_rkey) = (far.remote(0), far.rkey());
    let local = register(&pd, COUNT * BLOCK, Access::REMOTE);
    let local_alive = Arc::downgrade(&local);
    post_blocks(&a, &local, COUNT, BLOCK, |offset| SendOp::Read {
        remote_addr: far_addr + offset as u64,
        rkey: far_rkey,
    });
    drop(local);
    assert!(
        a.in_flight() > 0,
        "every read finished before the memory was let go"
    );
    assert!(
        local_alive.upgrade().is_some(),
        "the memory went while reads into it were outstanding"
    );
    a.to_error().unwrap();
    let outcomes = drain(&a, &cq);
    assert!(
        outcomes
            .iter()
            .any(|(_, o)| matches!(o, Outcome::Failed(e) if e.code == CompletionError::FLUSHED)),
        "no read was flushed"
    );
    assert!(
        local_alive.upgrade().is_none(),
        "the memory outlived the retirement of every request that used it"
    );
    assert_eq!(a.in_flight(), 0);
}
