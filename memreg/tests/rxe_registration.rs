//! A region registered on several device contexts at once, on Soft-RoCE (ignored on hosts
//! without RDMA; `cargo xtask softroce --test -p tern-memreg --features verbs` runs it).
#![cfg(feature = "verbs")]

use std::time::Instant;

use tern_memreg::nic::register_on_devices;
use tern_memreg::{AlignedBuffer, MemoryError, MemoryRegistry, Region};
use tern_verbs::{Access, Context, ProtectionDomain, live_memory_regions};

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
    let before = live_memory_regions();
    let started = Instant::now();
    let keys = register_on_devices(&pin, &pds, Access::REMOTE).unwrap();
    eprintln!("64 MiB on 3 contexts: {:?}", started.elapsed());
    assert_eq!(keys.rkeys.len(), 3);
    assert_eq!(keys.lkeys.len(), 3);
    assert_eq!(live_memory_regions(), before + 3);
    // While a transfer holds the region, it cannot be unregistered, and the devices keep it.
    assert!(matches!(
        registry.unregister(addr),
        Err(MemoryError::InUse { .. })
    ));
    assert_eq!(live_memory_regions(), before + 3);
    // Unregistering deregisters it from every device at once, before returning.
    drop(pin);
    drop(region);
    registry.unregister(addr).unwrap();
    assert_eq!(live_memory_regions(), before);
}

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-memreg --features verbs"]
fn an_owned_region_removed_while_in_use_keeps_its_registration_until_the_last_pin() {
    let device = std::env::var("TERN_RXE").unwrap_or_else(|_| "rxe0".into());
    let pd = ProtectionDomain::new(&Context::open(&device).unwrap()).unwrap();
    let registry = MemoryRegistry::new();
    let region = registry
        .register(Region::owned(
            AlignedBuffer::new(1 << 20).unwrap(),
            "*",
            true,
        ))
        .unwrap();
    let addr = region.addr();
    drop(region);
    let pin = registry.pin(addr, 4096).unwrap();
    let before = live_memory_regions();
    register_on_devices(&pin, &[pd], Access::REMOTE).unwrap();
    assert!(registry.remove_owned(addr).is_some());
    assert_eq!(
        live_memory_regions(),
        before + 1,
        "deregistered under a transfer"
    );
    drop(pin);
    assert_eq!(live_memory_regions(), before);
}
