//! Parallel pre-touch of a 4 GiB buffer against a single-thread memset of another fresh
//! 4 GiB buffer, in the same run: what pre-touching saves before registration.

use std::time::Instant;

use tern_memreg::{AlignedBuffer, PretouchPolicy};

fn main() {
    const LEN: usize = 4 << 30;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = PretouchPolicy::always(16).threads_for(LEN, cores, 1);
    let mut rows = Vec::new();
    for round in 0..2 {
        let single = AlignedBuffer::new(LEN).expect("4 GiB");
        let started = Instant::now();
        single.fill(0x5a);
        let memset = started.elapsed();
        drop(single);

        let mut parallel = AlignedBuffer::new(LEN).expect("4 GiB");
        let started = Instant::now();
        parallel.pretouch(threads);
        let pretouch = started.elapsed();
        drop(parallel);
        rows.push((round, memset, pretouch));
    }
    println!(
        "| round | single-thread memset of 4 GiB | parallel pre-touch ({threads} threads) | speed-up |"
    );
    println!("|---|---|---|---|");
    for (round, memset, pretouch) in rows {
        println!(
            "| {round} | {:.0} ms | {:.0} ms | {:.1}x |",
            memset.as_secs_f64() * 1e3,
            pretouch.as_secs_f64() * 1e3,
            memset.as_secs_f64() / pretouch.as_secs_f64()
        );
    }
}
