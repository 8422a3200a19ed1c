//! Waiting on a process without polling: a pidfd becomes readable when the
//! process it names ends.

/// Waits until process `pid` has exited (or `limit` passes), without
/// polling: a pidfd becomes readable when the process ends. True if it ended.
pub async fn process_exits_within(pid: i32, limit: std::time::Duration) -> bool {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        // ESRCH: it is already gone.
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    }
    // SAFETY: the fd was just opened and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // SAFETY: the OwnedFd moves into the AsyncFd, which deregisters it
    // before it is closed; nothing else holds it.
    let Ok(async_fd) = (unsafe { tokio::io::unix::AsyncFd::register(fd) }) else {
        return false;
    };
    tokio::time::timeout(limit, async_fd.readable())
        .await
        .is_ok()
}
