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

use std::fs;

const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// The start time of process `pid` (field 22 of `/proc/<pid>/stat`, clock
/// ticks since boot) and the current boot id, or `None` if the process does
/// not exist or `/proc` cannot be read.
pub fn process_start(pid: i32) -> Option<(u64, String)> {
    if pid <= 0 {
        // 0 and negative numbers name groups or "self" to the kernel, never
        // one process.
        return None;
    }
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let start_ticks = start_ticks_from_stat(&stat)?;
    Some((start_ticks, boot_id()?))
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
    let Ok(entries) = fs::read_dir("/proc") else {
        return vec![];
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| group_fields(&stat))
                .is_some_and(|(state, group, start)| {
                    state != 'Z' && group == pgid && start >= start_ticks
                })
        })
        .collect()
}

/// (state, pgrp, starttime) of a `/proc/<pid>/stat` line: fields 3, 5 and 22.
fn group_fields(stat: &str) -> Option<(char, i32, u64)> {
    let (_, after_comm) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = after_comm.split_ascii_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    let group = fields.get(5 - 3)?.parse().ok()?;
    let start = fields.get(22 - 3)?.parse().ok()?;
    Some((state, group, start))
}

/// The kernel's id for this boot, trimmed.
fn boot_id() -> Option<String> {
    let id = fs::read_to_string(BOOT_ID_PATH).ok()?;
    let id = id.trim();
    (!id.is_empty()).then(|| id.to_string())
}

/// Field 22 (`starttime`) of a `/proc/<pid>/stat` line.
///
/// Field 2 (`comm`) is the executable's name in parentheses and may itself
/// hold spaces and `)`, so the fields are counted from the *last* `)`: after
/// it come field 3 (`state`), field 4, and so on.
fn start_ticks_from_stat(stat: &str) -> Option<u64> {
    const STATE_FIELD: usize = 3;
    const STARTTIME_FIELD: usize = 22;
    let (_, after_comm) = stat.rsplit_once(')')?;
    after_comm
        .split_ascii_whitespace()
        .nth(STARTTIME_FIELD - STATE_FIELD)?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    /// A stat line as the kernel writes it, with `comm` and `starttime` filled in.
    fn stat_line(comm: &str, starttime: u64) -> String {
        let mut fields: Vec<String> = (3..=52).map(|n| n.to_string()).collect();
        fields[0] = "S".into();
        fields[22 - 3] = starttime.to_string();
        format!("1234 ({comm}) {}\n", fields.join(" "))
    }

    #[test]
    fn start_ticks_are_field_22_whatever_the_command_is_called() {
        for comm in ["sleep", "a b c", "x) 1 2 3 (y", ")", "((", "tab\there"] {
            assert_eq!(
                start_ticks_from_stat(&stat_line(comm, 424_242)),
                Some(424_242),
                "comm {comm:?}"
            );
        }
    }

    #[test]
    fn a_short_or_garbled_stat_line_is_no_answer() {
        assert_eq!(start_ticks_from_stat(""), None);
        assert_eq!(start_ticks_from_stat("1234 (sleep S 1 2 3"), None);
        assert_eq!(start_ticks_from_stat("1234 (sleep) S 1 2 3"), None);
        let garbled = stat_line("sleep", 7).replace(" 7 ", " seven ");
        assert_eq!(start_ticks_from_stat(&garbled), None);
    }

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
