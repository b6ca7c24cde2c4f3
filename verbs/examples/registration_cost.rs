//! Registration cost per MiB for region sizes from 4 KiB to 1 GiB, on a real device (run in
//! the Soft-RoCE guest by `cargo xtask bench`): why registration stays off the data path.

use std::time::Instant;

use tern_verbs::{Access, Context, MemoryRegion, ProtectionDomain};

fn main() {
    let device = std::env::var("TERN_RXE").unwrap_or_else(|_| "rxe0".into());
    let context = match Context::open(&device) {
        Ok(context) => context,
        Err(e) => {
            eprintln!("registration_cost: {e}");
            std::process::exit(1);
        }
    };
    let pd = ProtectionDomain::new(&context).expect("protection domain");
    println!("| region | register | deregister | register per MiB |");
    println!("|---|---|---|---|");
    let mut size = 4096usize;
    while size <= 1 << 30 {
        let mut memory = vec![1u8; size];
        let rounds = (64 << 20) / size.max(1 << 20) + if size < (1 << 20) { 32 } else { 0 };
        let rounds = rounds.clamp(1, 64);
        let (mut reg, mut dereg) = (0f64, 0f64);
        let mut failed = None;
        for _ in 0..rounds {
            let started = Instant::now();
            // SAFETY: `memory` outlives the MR, which is dropped within this iteration.
            let mr =
                unsafe { MemoryRegion::register(&pd, memory.as_mut_ptr(), size, Access::REMOTE) };
            reg += started.elapsed().as_secs_f64();
            match mr {
                Ok(mr) => {
                    let started = Instant::now();
                    drop(mr);
                    dereg += started.elapsed().as_secs_f64();
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let label = if size >= 1 << 20 {
            format!("{} MiB", size >> 20)
        } else {
            format!("{} KiB", size >> 10)
        };
        match failed {
            Some(e) => println!("| {label} | failed: {e} | | |"),
            None => {
                let (reg_us, dereg_us) = (reg / rounds as f64 * 1e6, dereg / rounds as f64 * 1e6);
                let per_mib = reg_us / (size as f64 / (1 << 20) as f64);
                println!("| {label} | {reg_us:.0} µs | {dereg_us:.0} µs | {per_mib:.0} µs |");
            }
        }
        drop(memory);
        size *= 4;
    }
}
