//! A region registered on several device contexts at once, on Soft-RoCE (ignored on hosts
//! without RDMA; `cargo xtask softroce --test -p tern-memreg --features verbs` runs it).
#![cfg(feature = "verbs")]

use std::time::Instant;

use tern_memreg::nic::NicRegistration;
use tern_memreg::{AlignedBuffer, MemoryError, MemoryRegistry, Region};
use tern_verbs::{Access, Context, ProtectionDomain};

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-memreg --features verbs"]
fn one_region_on_many_contexts_in_parallel_with_per_context_keys() {
    let device = std::env::var("TERN_RXE").unwrap_or_else(|_| "rxe0".into());
    let pds: Vec<_> = (0..3)
        .map(|_| ProtectionDomain::new(&Context::open(&device).unwrap()).unwrap())
        .collect();
    let registry = MemoryRegistry::new();
    let region = registry
        .register(Region::owned(
            AlignedBuffer::new(64 << 20).unwrap(),
            "*",
            true,
        ))
        .unwrap();
    let addr = region.addr();
    let pin = registry.pin(addr, 64 << 20).unwrap();
    let started = Instant::now();
    let nics = NicRegistration::register(pin, &pds, Access::REMOTE).unwrap();
    eprintln!("64 MiB on 3 contexts: {:?}", started.elapsed());
    assert_eq!(nics.rkeys().len(), 3);
    assert_eq!(nics.lkeys().len(), 3);
    assert!(
        nics.regions()
            .iter()
            .all(|mr| mr.addr() == addr && mr.len() == 64 << 20)
    );
    // While the NICs hold it, the region cannot be unregistered.
    assert!(matches!(
        registry.unregister(addr),
        Err(MemoryError::InUse { .. })
    ));
    drop(nics);
    drop(region);
    registry.unregister(addr).unwrap();
}
