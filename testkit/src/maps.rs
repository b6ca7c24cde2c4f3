//! What this process has mapped, from proc(5)'s `/proc/self/maps`: for tests that check a
//! peer's memory is mapped once, and unmapped when it should be.

/// The inode of the file mapped at `addr` in this process, if a mapping starts there.
pub fn inode_at(addr: u64) -> Option<u64> {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
    maps.lines().find_map(|line| {
        let start = u64::from_str_radix(line.split('-').next()?, 16).ok()?;
        (start == addr).then(|| line.split_whitespace().nth(4)?.parse().ok())?
    })
}

/// The lines of `/proc/self/maps` that map the memfd with this inode.
pub fn memfd_mappings(inode: u64) -> Vec<String> {
    std::fs::read_to_string("/proc/self/maps")
        .expect("/proc/self/maps")
        .lines()
        .filter(|l| {
            l.contains("/memfd:")
                && l.split_whitespace().nth(4).and_then(|i| i.parse().ok()) == Some(inode)
        })
        .map(str::to_owned)
        .collect()
}

/// How many mappings of this process map the memfd with this inode.
pub fn mappings_of(inode: u64) -> usize {
    memfd_mappings(inode).len()
}
