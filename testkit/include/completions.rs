//! Waiting on a completion queue, for the tests that drive verbs by hand. Included by path
//! (`#[path]`) into tests that depend on `tern-verbs`.
// Each test binary takes only what it needs of this file.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use tern_verbs::{Completion, CompletionError, CompletionQueue, MemoryGuard, QueuePair, SendWork};

/// Polls `cq` until a completion arrives (120 s at most: a lost request fails the test, it
/// does not hang it).
pub fn next_completion(cq: &CompletionQueue) -> Completion {
    let started = Instant::now();
    let mut out = Vec::new();
    while cq.poll(&mut out, 1).unwrap() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no completion"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    out.pop().unwrap()
}

/// Posts `work` on `qp` and waits for its completion, which retires it; returns its status.
pub fn post_and_retire<G: MemoryGuard, U: Send>(
    qp: &QueuePair<G, U>,
    work: SendWork<G, U>,
) -> Result<(), CompletionError> {
    qp.post_send(&mut vec![work]).unwrap();
    let completion = next_completion(qp.cq());
    let status = completion.status();
    qp.retire(completion, &mut Vec::new()).unwrap();
    status
}
