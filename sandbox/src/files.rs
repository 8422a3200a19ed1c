//! Files below a workdir, confined to it: every path a model gives is
//! refused by words first (`confine`: absolute paths, `..`, symlinks on the
//! way) and then by the kernel (`openat2` with RESOLVE_BENEATH and
//! RESOLVE_NO_SYMLINKS), so a symlink swapped in between the two is refused
//! too (I-28).

use crate::seal::SandboxUser;
use std::path::{Component, Path, PathBuf};

/// The largest file `read_confined` returns.
pub const READ_LIMIT: u64 = 1024 * 1024;

/// Joins a model-given relative path to the workdir, refusing what could leave it.
pub fn confine(workdir: &Path, path: &str) -> Result<PathBuf, String> {
    confine_in(workdir, path, "the workdir")
}

/// `confine` below `root`, which its errors call `place`.
fn confine_in(workdir: &Path, path: &str, place: &str) -> Result<PathBuf, String> {
    if path.trim().is_empty() {
        return Err("the path is empty".into());
    }
    let p = Path::new(path);
    if p.is_absolute() {
        return Err(format!(
            "{path:?} is absolute: give a path relative to {place}"
        ));
    }
    for c in p.components() {
        match c {
            Component::Normal(_) | Component::CurDir => {}
            _ => return Err(format!("{path:?} leaves {place}: `..` is refused")),
        }
    }
    // No symlink on the way may lead out, not even one the job made itself.
    let mut at = workdir.to_path_buf();
    for c in p.components() {
        at.push(c);
        if let Ok(meta) = at.symlink_metadata()
            && meta.file_type().is_symlink()
        {
            return Err(format!("{path:?} goes through a symlink: refused"));
        }
    }
    Ok(workdir.join(p))
}

/// How every file below a workdir is opened: resolved by the kernel beneath
/// the workdir's descriptor, through no symlink and no magic link (openat2,
/// Linux 5.6+). `confine` has already refused `..`, absolute paths and the
/// symlinks it saw, with words; this closes the race in which a command
/// swaps a directory for a symlink between that check and the open.
fn open_beneath(
    dir: &impl std::os::fd::AsFd,
    path: &Path,
    flags: nix::fcntl::OFlag,
) -> Result<std::os::fd::OwnedFd, nix::Error> {
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
    let mut how = OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
    // openat2 refuses a mode without O_CREAT.
    if flags.contains(OFlag::O_CREAT) {
        how = how.mode(nix::sys::stat::Mode::from_bits_truncate(0o644));
    }
    openat2(dir, path, how)
}

fn open_workdir(workdir: &Path) -> Result<std::fs::File, String> {
    std::fs::File::open(workdir).map_err(|e| format!("the workdir: {e}"))
}

/// Says why an open beneath `place` failed, in the tool's words.
fn beneath_error(path: &str, e: nix::Error, place: &str) -> String {
    match e {
        nix::Error::EXDEV | nix::Error::ELOOP => {
            format!("{path:?} leads out of {place} (through a symlink or `..`): refused")
        }
        nix::Error::ENOSYS => {
            "this kernel has no openat2 (Linux 5.6 or newer is needed): file tools are refused"
                .into()
        }
        other => format!("{path}: {}", std::io::Error::from(other)),
    }
}

/// Whether `path` is a regular file beneath the workdir, reached through no symlink.
pub fn is_file_beneath(workdir: &Path, path: &str) -> bool {
    let Ok(dir) = open_workdir(workdir) else {
        return false;
    };
    open_beneath(&dir, Path::new(path), nix::fcntl::OFlag::O_PATH)
        .map(std::fs::File::from)
        .ok()
        .and_then(|f| f.metadata().ok())
        .is_some_and(|m| m.is_file())
}

pub fn read_confined(workdir: &Path, path: &str) -> Result<String, String> {
    read_below(workdir, path, "the workdir", READ_LIMIT)
}

/// A regular file below `root` (which errors call `place`) of at most
/// `limit` bytes, opened as `read_confined` opens one: never through a
/// symlink or out of `root`.
pub fn read_below(root: &Path, path: &str, place: &str, limit: u64) -> Result<String, String> {
    confine_in(root, path, place)?;
    let dir = std::fs::File::open(root).map_err(|e| format!("{place}: {e}"))?;
    let file = open_beneath(&dir, Path::new(path), nix::fcntl::OFlag::O_RDONLY)
        .map(std::fs::File::from)
        .map_err(|e| beneath_error(path, e, place))?;
    let meta = file.metadata().map_err(|e| format!("{path}: {e}"))?;
    if !meta.is_file() {
        return Err(format!("{path} is not a file"));
    }
    if meta.len() > limit {
        return Err(format!(
            "{path} is {} bytes; at most {limit} are read",
            meta.len()
        ));
    }
    let mut bytes = vec![];
    std::io::Read::read_to_end(&mut std::io::Read::take(&file, limit), &mut bytes)
        .map_err(|e| format!("{path}: {e}"))?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Writes a file below the workdir; on a root node, what it makes belongs to
/// the sandbox's user, so the job's commands can change it.
pub fn write_confined(
    workdir: &Path,
    path: &str,
    content: &str,
    owner: Option<SandboxUser>,
) -> Result<(), String> {
    let chown = |fd: &dyn std::os::fd::AsFd| match owner {
        Some(SandboxUser(id)) => {
            std::os::unix::fs::fchown(fd, Some(id), Some(id)).map_err(|e| format!("{path}: {e}"))
        }
        None => Ok(()),
    };
    use nix::fcntl::OFlag;
    confine(workdir, path)?;
    let rel = Path::new(path);
    let name = rel
        .file_name()
        .ok_or_else(|| format!("{path:?} names no file"))?;
    // Each directory on the way is made and then opened beneath the last.
    let mut dir: std::os::fd::OwnedFd = open_workdir(workdir)?.into();
    for part in rel.parent().into_iter().flat_map(|p| p.components()) {
        let Component::Normal(part) = part else {
            continue;
        };
        let made = match nix::sys::stat::mkdirat(
            &dir,
            part,
            nix::sys::stat::Mode::from_bits_truncate(0o755),
        ) {
            Ok(()) => true,
            Err(nix::Error::EEXIST) => false,
            Err(e) => return Err(beneath_error(path, e, "the workdir")),
        };
        dir = open_beneath(&dir, Path::new(part), OFlag::O_DIRECTORY | OFlag::O_RDONLY)
            .map_err(|e| beneath_error(path, e, "the workdir"))?;
        if made {
            chown(&dir)?;
        }
    }
    let file = open_beneath(
        &dir,
        Path::new(name),
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_TRUNC,
    )
    .map(std::fs::File::from)
    .map_err(|e| beneath_error(path, e, "the workdir"))?;
    chown(&file)?;
    std::io::Write::write_all(&mut &file, content.as_bytes()).map_err(|e| format!("{path}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn confine_refuses_what_leaves_the_workdir() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::os::unix::fs::symlink("/etc", root.join("out")).unwrap();
        let check = |path: &str, ok: bool| {
            assert_eq!(confine(root, path).is_ok(), ok, "{path}");
        };
        check("notes/a.txt", true);
        check("./a.txt", true);
        check("/etc/passwd", false);
        check("../x", false);
        check("a/../../x", false);
        check("out/passwd", false);
        check("", false);
    }

    /// The kernel's half on its own: what `confine` would have refused by
    /// words is refused by openat2 too, for a symlink made after any check.
    #[test]
    fn openat2_refuses_symlinks_and_dot_dot_by_itself() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir(root.join("real")).unwrap();
        std::fs::write(root.join("real/f.txt"), "x").unwrap();
        std::os::unix::fs::symlink("/etc", root.join("out")).unwrap();
        std::os::unix::fs::symlink(root.join("real/f.txt"), root.join("inner-link")).unwrap();
        let fd = std::fs::File::open(root).unwrap();
        let open = |p: &str| open_beneath(&fd, Path::new(p), nix::fcntl::OFlag::O_RDONLY);
        assert!(open("real/f.txt").is_ok());
        for p in [
            "out/passwd",
            "inner-link",
            "../x",
            "real/../../x",
            "/etc/passwd",
        ] {
            let e = open(p).expect_err(p);
            assert!(
                matches!(e, nix::Error::EXDEV | nix::Error::ELOOP),
                "{p}: {e}"
            );
        }
        assert!(is_file_beneath(root, "real/f.txt"));
        assert!(
            !is_file_beneath(root, "inner-link"),
            "a symlink is no file here"
        );
        assert!(!is_file_beneath(root, "real"), "nor a directory");
    }

    #[test]
    fn write_then_read_round_trips_inside_the_workdir() {
        let dir = tempfile::tempdir().unwrap();
        write_confined(dir.path(), "sub/dir/f.txt", "hello", None).unwrap();
        assert_eq!(read_confined(dir.path(), "sub/dir/f.txt").unwrap(), "hello");
        assert!(read_confined(dir.path(), "missing.txt").is_err());
    }
}
