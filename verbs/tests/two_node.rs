//! RC traffic between two machines over each of two NICs, in the two-node Soft-RoCE setup
//! (`cargo xtask softroce --two-nodes`, run by `cargo xtask test`). Both nodes run this
//! same test; `TERN_NODE` says which side each is. Elsewhere it does nothing.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tern_verbs::{
    Access, CompletionError, Context, Gid, MemoryRegion, PathConfig, Peer, ProtectionDomain,
    QpCaps, QueuePair, SendOp, SendWork, Sge,
};

#[path = "../../testkit/include/completions.rs"]
mod completions;
use completions::post_and_retire;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
        .collect()
}

fn publish(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(tmp, dir.join(name)).unwrap();
}

fn await_file(dir: &Path, name: &str) -> String {
    let started = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(dir.join(name)) {
            return text;
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "peer never wrote {name}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Posts one request and waits for its completion, which retires it; returns its status.
fn run(
    qp: &QueuePair,
    op: SendOp,
    local: Sge,
    mr: &Arc<MemoryRegion>,
) -> Result<(), CompletionError> {
    let work = SendWork {
        op,
        local,
        guard: mr.clone(),
        user: 0,
    };
    post_and_retire(qp, work)
}

#[test]
#[ignore = "needs two Soft-RoCE nodes: cargo xtask softroce --two-nodes"]
fn rc_traffic_crosses_both_links_between_two_nodes() {
    let Ok(node) = std::env::var("TERN_NODE") else {
        eprintln!("not in the two-node setup; nothing to do");
        return;
    };
    let sync = PathBuf::from(std::env::var("TERN_SYNC").unwrap());
    for link in 0..2u8 {
        let device = format!("rxe{link}");
        let context = Context::open(&device).unwrap();
        let port = context.port(1).unwrap();
        let gid = context.select_gid(1, None).unwrap();
        let pd = ProtectionDomain::new(&context).unwrap();
        let cq = tern_verbs::CompletionQueue::new(&context, 64).unwrap();
        let qp: QueuePair = QueuePair::new_rc(&pd, &cq, QpCaps::default()).unwrap();
        let mut memory = vec![0u8; 1 << 20];
        // SAFETY: `memory` outlives the MR: every request holding it is retired before the
        // last Arc is dropped at the end of this iteration, before `memory`.
        let mr = Arc::new(
            unsafe {
                MemoryRegion::register(&pd, memory.as_mut_ptr(), memory.len(), Access::REMOTE)
            }
            .unwrap(),
        );
        let me = format!("QP {} {} {} {}", qp.qp_num(), gid.gid, mr.addr(), mr.rkey());
        publish(&sync, &format!("{node}{link}"), &me);
        let peer_name = if node == "a" { "b" } else { "a" };
        let theirs = await_file(&sync, &format!("{peer_name}{link}"));
        let f: Vec<&str> = theirs.split_whitespace().collect();
        let (qpn, peer_gid, remote_addr, rkey): (u32, Gid, u64, u32) = (
            f[1].parse().unwrap(),
            Gid::parse(f[2]).unwrap(),
            f[3].parse().unwrap(),
            f[4].parse().unwrap(),
        );
        let path = PathConfig {
            sgid_index: gid.index as u8,
            mtu: port.active_mtu,
            retry_count: 3,
            ..PathConfig::default()
        };
        qp.connect(
            &Peer {
                qp_num: qpn,
                psn: 0,
                gid: peer_gid,
                lid: 0,
            },
            &path,
        )
        .unwrap();
        let sge = |offset: usize, len: usize| Sge {
            addr: (mr.addr() + offset) as u64,
            len: len as u32,
            lkey: mr.lkey(),
        };
        if node == "a" {
            memory.copy_from_slice(&pattern(link, 1 << 20));
            publish(&sync, &format!("a{link}.ready"), "");
            await_file(&sync, &format!("b{link}.done"));
            // SAFETY: in bounds; volatile because the peer's NIC wrote it.
            let landed: Vec<u8> = (4096..8192)
                .map(|i| unsafe { std::ptr::read_volatile(memory.as_ptr().add(i)) })
                .collect();
            assert!(
                landed == pattern(100 + link, 4096),
                "link {link}: b's write did not land"
            );
            publish(&sync, &format!("a{link}.verified"), "");
        } else {
            await_file(&sync, &format!("a{link}.ready"));
            let read = run(
                &qp,
                SendOp::Read { remote_addr, rkey },
                sge(0, 1 << 20),
                &mr,
            );
            assert_eq!(read, Ok(()), "link {link}: read");
            // SAFETY: in bounds; volatile because the NIC wrote it.
            let got: Vec<u8> = (0..1 << 20)
                .map(|i| unsafe { std::ptr::read_volatile(memory.as_ptr().add(i)) })
                .collect();
            assert!(
                got == pattern(link, 1 << 20),
                "link {link}: read the wrong bytes"
            );
            memory[..4096].copy_from_slice(&pattern(100 + link, 4096));
            let write = run(
                &qp,
                SendOp::Write {
                    remote_addr: remote_addr + 4096,
                    rkey,
                },
                sge(0, 4096),
                &mr,
            );
            assert_eq!(write, Ok(()), "link {link}: write");
            publish(&sync, &format!("b{link}.done"), "");
            await_file(&sync, &format!("a{link}.verified"));
        }
        drop(qp);
        drop(mr);
        drop(memory);
    }
}
