//! Which NUMA node memory lives on, to name memory registered with location `"*"`.

/// The NUMA node of the page holding `addr`, or `None` when the page is not populated yet
/// or the kernel does not say (no NUMA support).
pub fn numa_node_of(addr: usize) -> Option<u32> {
    let page = (addr & !(crate::PAGE_SIZE - 1)) as *mut libc::c_void;
    let mut pages = [page];
    let mut status: [libc::c_int; 1] = [-1];
    // SAFETY: move_pages with a NULL node list only reports where the listed pages are; both
    // arrays hold exactly `count` (1) entries and outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_pages,
            0,
            1usize,
            pages.as_mut_ptr(),
            std::ptr::null::<libc::c_int>(),
            status.as_mut_ptr(),
            0,
        )
    };
    (rc == 0 && status[0] >= 0).then_some(status[0] as u32)
}

/// Mooncake's location for memory registered with `"*"`: `cpu:<node>` of its first page.
/// Any other location is returned as given, and `"*"` stays when the node is unknown.
pub fn resolve_location(location: &str, addr: usize) -> String {
    match (location, numa_node_of(addr)) {
        ("*", Some(node)) => format!("cpu:{node}"),
        _ => location.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touched_memory_reports_a_node_that_exists() {
        let buffer = vec![1u8; 1 << 16];
        let addr = buffer.as_ptr() as usize;
        let numa_kernel = std::path::Path::new("/sys/devices/system/node/node0").exists();
        match numa_node_of(addr) {
            Some(node) => {
                let dir = format!("/sys/devices/system/node/node{node}");
                assert!(std::path::Path::new(&dir).exists(), "node {node}");
                assert_eq!(resolve_location("*", addr), format!("cpu:{node}"));
            }
            None => assert!(!numa_kernel, "a NUMA kernel did not report the node"),
        }
        assert_eq!(resolve_location("cuda:1", addr), "cuda:1");
    }
}
