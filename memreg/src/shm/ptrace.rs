//! The process settings that decide whether the kernel lets a peer reach this process by
//! cross-memory attach: dumpability (`prctl(PR_SET_DUMPABLE)`) and Yama's ptrace exception
//! (`prctl(PR_SET_PTRACER)`).

use std::io;

/// Makes this process dumpable or not (`prctl(PR_SET_DUMPABLE)`). A process that is not
/// dumpable cannot be reached by cross-memory attach from processes without
/// `CAP_SYS_PTRACE`, even of its own user (nor dumps core); `execve` resets it.
pub fn set_dumpable(dumpable: bool) -> io::Result<()> {
    // SAFETY: prctl(2) PR_SET_DUMPABLE takes 0 or 1 and changes only this process's flag.
    let got = unsafe {
        libc::prctl(
            libc::PR_SET_DUMPABLE,
            libc::c_ulong::from(dumpable),
            0,
            0,
            0,
        )
    };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether this process is dumpable (`prctl(PR_GET_DUMPABLE)`).
pub fn is_dumpable() -> bool {
    // SAFETY: prctl(2) PR_GET_DUMPABLE takes no argument and returns the flag.
    unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) > 0 }
}

/// Lets any process of this user trace this one, and so reach it by cross-memory attach,
/// where Yama restricts ptrace to ancestors (`ptrace_scope` 1):
/// `prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`. `Ok(false)` when the kernel has no Yama
/// (nothing to lift). A wide grant: callers make it only when asked to.
pub fn allow_ptrace_by_same_user() -> io::Result<bool> {
    if yama_ptrace_scope().is_none() {
        return Ok(false);
    }
    // SAFETY: prctl(2) PR_SET_PTRACER takes a pid or PR_SET_PTRACER_ANY and changes only
    // this process's Yama exception.
    let got = unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(true)
}

/// Yama's `kernel.yama.ptrace_scope` (0 classic, 1 restricted to ancestors, 2 admin only,
/// 3 none); `None` when the kernel has no Yama.
pub fn yama_ptrace_scope() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dumpable_reads_back() {
        assert!(is_dumpable());
        let _ = yama_ptrace_scope();
    }
}
