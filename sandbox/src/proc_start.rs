//! Telling a process apart from a later one that reuses its pid.
//!
//! Recovery kills the process groups a previous boot of the node left running
//! (I-30), but a pid alone names nothing: once a process is gone the kernel
//! hands its number to the next one. So the sandbox journals each group's
//! leader with its start time and the kernel's boot id, and recovery kills a
//! group only if its leader still matches both (`same_process`).
//!
//! Invariants:
//! 1. A process matches only if its pid, its start time in clock ticks since
//!    boot and the boot id all match. A reboot changes the boot id, so nothing
//!    recorded before it ever matches after it.
//! 2. Anything unreadable or unparsable is "no match", never a guess: the cost
//!    of a false "no" is a leaked process, of a false "yes" a killed stranger.
//!
//! Limits: only the group's leader is checked. If the leader has exited while
//! other members of its group live on, `same_process` says no, and those
//! members cannot be proven to be ours by their own start times (a group
//! started later under a reused pgid looks the same).
//!
//! Linux only: elsewhere there is no `/proc`, and every answer is `None`/`false`.

use procfs::process::{Process, Stat};

/// `/proc/<pid>/stat`, parsed by procfs (field 2, the command's name, may
/// hold spaces and `)`; procfs counts the fields from the last `)`).
fn stat(pid: i32) -> Option<Stat> {
    Process::new(pid).ok()?.stat().ok()
}

/// The start time of process `pid` (`starttime`, field 22 of
/// `/proc/<pid>/stat`, clock ticks since boot) and the current boot id, or
/// `None` if the process does not exist or `/proc` cannot be read.
pub fn process_start(pid: i32) -> Option<(u64, String)> {
    if pid <= 0 {
        // 0 and negative numbers name groups or "self" to the kernel, never
        // one process.
        return None;
    }
    Some((stat(pid)?.starttime, boot_id()?))
}

/// Whether the process now running as `record_pgid` (a group's leader, whose
/// pid is the pgid) is the one that was recorded with `start_ticks` in the
/// boot `boot_id`.
pub fn same_process(record_pgid: i32, start_ticks: u64, boot_id: &str) -> bool {
    match process_start(record_pgid) {
        Some((now_ticks, now_boot)) => now_ticks == start_ticks && now_boot == boot_id,
        None => false,
    }
}

/// The live (not zombie) processes of the group a sandbox recorded, whether
/// or not its leader is still there:
/// - a different boot: none;
/// - the leader (pid = pgid) is running with another start time: the pgid
///   belongs to someone else now: none;
/// - otherwise every non-zombie process whose group is `pgid` and that
///   started no earlier than the leader. The kernel does not hand out a pid
///   still used as a process group id, so while any member of our group
///   lives, the pgid cannot name a stranger's group.
pub fn group_members(pgid: i32, start_ticks: u64, boot: &str) -> Vec<i32> {
    if pgid <= 1 || boot_id().as_deref() != Some(boot) {
        return vec![];
    }
    if let Some((leader_ticks, _)) = process_start(pgid)
        && leader_ticks != start_ticks
    {
        return vec![];
    }
    let Ok(all) = procfs::process::all_processes() else {
        return vec![];
    };
    all.flatten()
        .filter_map(|process| process.stat().ok())
        .filter(|s| s.state != 'Z' && s.pgrp == pgid && s.starttime >= start_ticks)
        .map(|s| s.pid)
        .collect()
}

/// The kernel's id for this boot, trimmed.
fn boot_id() -> Option<String> {
    let id = procfs::sys::kernel::random::boot_id().ok()?;
    let id = id.trim();
    (!id.is_empty()).then(|| id.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};

    #[test]
    fn this_process_matches_itself_and_nothing_else() {
        let pid = std::process::id() as i32;
        let (ticks, boot) = process_start(pid).expect("/proc has this process");
        assert!(!boot.is_empty());
        assert!(same_process(pid, ticks, &boot));
        assert!(!same_process(pid, ticks + 1, &boot));
        assert!(!same_process(pid, ticks, "another-boot"));
        assert_eq!(process_start(0), None);
        assert_eq!(process_start(-1), None);
    }

    /// The command's name is field 2 of the stat line and may hold spaces
    /// and `)`: a process named so is still found, with its group.
    #[test]
    fn a_process_whose_name_holds_parentheses_and_spaces_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let odd = dir.path().join("a) 1 2 (b");
        std::fs::copy("/bin/sleep", &odd).expect("a copy of sleep");
        // Another test's fork may still hold the copy open for writing for a
        // moment (ETXTBSY): try again, a bounded number of times.
        let mut child = (0..100)
            .find_map(|_| {
                match Command::new(&odd)
                    .arg("1000")
                    .stdin(Stdio::null())
                    .process_group(0)
                    .spawn()
                {
                    Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                        std::thread::yield_now();
                        None
                    }
                    other => Some(other),
                }
            })
            .expect("the copy is not busy for long")
            .expect("the copy starts");
        let pid = child.id() as i32;
        let (ticks, boot) = process_start(pid).expect("found by its pid");
        assert_eq!(stat(pid).map(|s| s.comm), Some("a) 1 2 (b".to_string()));
        assert_eq!(group_members(pid, ticks, &boot), vec![pid]);
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(group_members(pid, ticks, &boot).is_empty());
    }

    #[test]
    fn a_killed_child_stops_matching() {
        let mut child = Command::new("sleep")
            .arg("1000")
            .stdin(Stdio::null())
            .spawn()
            .expect("sleep starts");
        let pid = child.id() as i32;
        let (ticks, boot) = process_start(pid).expect("the child is in /proc");
        assert!(same_process(pid, ticks, &boot));
        // Started after us, so no earlier than our own start.
        let (own_ticks, own_boot) = process_start(std::process::id() as i32).unwrap();
        assert!(ticks >= own_ticks);
        assert_eq!(boot, own_boot);

        child.kill().unwrap();
        child.wait().unwrap(); // reaped: the pid is free, and may be reused
        assert!(!same_process(pid, ticks, &boot));
    }
}
