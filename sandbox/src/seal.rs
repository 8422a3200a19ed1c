//! How a sandbox's commands are sealed: Linux namespaces, through hakoniwa.
//!
//! Each command runs as the init of its own pid, mount, ipc and uts
//! namespaces (and a user namespace, on a node that is not root), and of
//! its own network namespace unless its agent says
//! `network: open` (I-28). It sees the system read-only (`/usr`, `/bin`,
//! `/lib*`, `/sbin` and a short list from `/etc`), its workdir read-write, a
//! private `/tmp`, `/proc` of its own pid namespace and a minimal `/dev`;
//! never `/`, `/run`, the host's `/tmp` or the node's data dir, so no host
//! Unix socket is reachable.
//!
//! Invariants:
//! 1. Killing the process hakoniwa forks (the pid namespace's parent) kills
//!    every process in the namespace: its init dies by its parent-death
//!    signal, and the kernel kills the rest, setsid or double fork or not
//!    (I-17).
//! 2. Every command a sandbox runs, sealed or not, is forked from one
//!    thread that lives as long as the node (`spawner`): a parent-death
//!    signal follows the thread that forked, so a process forked from a
//!    pool thread that later exits would be killed early, and one forked
//!    from a thread of ours dies with the node, and only then.
//! 3. A sealed command never runs as the host's root. A node that is root
//!    needs no user namespace to make the others: the namespace's init drops
//!    to a uid of the sandbox's own (`SandboxUser`), owner of its workdir,
//!    before it execs the command. (The kernel never applies RLIMIT_NPROC to
//!    a process whose real uid is the host's root, user namespace or not, so
//!    a root-mapped sandbox could fork without bound.) A node that is not
//!    root maps its own uid to 1000 in a user namespace.
//! 4. Nothing runs unsealed unless `[sandbox] mode = "none"` says so: a node
//!    whose kernel cannot seal refuses the jobs that would run commands (I-28).

use arbor_protocol::{Network, Resources};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::mpsc;

/// The uid a sealed command has inside its user namespace (a node that is not root).
const INSIDE_UID: u32 = 1000;
/// A root node's sandboxes get uids from here up, one per sandbox: far above
/// any a distribution hands out, and distinct so that RLIMIT_NPROC counts
/// each sandbox's processes alone.
const SANDBOX_UID_BASE: u32 = 1_500_000_000;
const SANDBOX_UID_SPAN: u32 = 1_000_000;
/// The size of a sealed command's private `/tmp` when its file-size limit does not say less.
const TMP_SIZE: u64 = 256 * 1024 * 1024;

/// `[sandbox] mode` in arbor.toml.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxIsolation {
    /// Namespaces for every command; refused where the kernel cannot give them.
    #[default]
    Sealed,
    /// Commands run on the host in a process group (development only).
    None,
}

/// What the node can do for its sandboxes, found at start (the probe runs
/// once per process). Shown at start, in `/v1/status` and in every run's document.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Posture {
    /// What arbor.toml asked for.
    pub mode: SandboxIsolation,
    /// Whether commands run sealed; false for `mode = "none"` and for a
    /// sealed node whose kernel refused (its exec jobs are refused).
    pub sealed: bool,
    /// One line for an operator.
    pub detail: String,
}

impl Posture {
    /// Probes the kernel with one sealed `true` (for `Sealed`), so that a
    /// node says at start, not at its first job, whether it can seal.
    pub async fn probe(mode: SandboxIsolation) -> Self {
        match mode {
            SandboxIsolation::None => Self {
                mode,
                sealed: false,
                detail: "UNSEALED: [sandbox] mode = \"none\": commands run on the host, \
                         with the node's user, network and files (development only)"
                    .into(),
            },
            SandboxIsolation::Sealed => {
                let outcome = probe_sealed().await;
                match outcome {
                    Ok(()) => Self {
                        mode,
                        sealed: true,
                        detail: match SandboxUser::for_new_sandbox() {
                            Some(_) => {
                                "sealed: pid, mount, ipc, uts and network namespaces, \
                                        a uid per sandbox; read-only system; workdir writable"
                            }
                            None => {
                                "sealed: user (uid 1000), pid, mount, ipc, uts and network \
                                     namespaces; read-only system; workdir writable"
                            }
                        }
                        .into(),
                    },
                    Err(why) => Self {
                        mode,
                        sealed: false,
                        detail: format!(
                            "cannot seal ({why}): jobs that run commands are refused; \
                             [sandbox] mode = \"none\" runs them unsealed (development only)"
                        ),
                    },
                }
            }
        }
    }
}

/// Runs one sealed `true`, once per process: what the kernel allows does
/// not change while the node runs, and nodes in one process (tests, an
/// embedder's) share the answer. Each probe has a folder of its own.
async fn probe_sealed() -> Result<(), String> {
    static PROBED: tokio::sync::OnceCell<Result<(), String>> = tokio::sync::OnceCell::const_new();
    PROBED
        .get_or_init(|| async {
            let temp = std::env::temp_dir();
            sweep_stale_probes(&temp);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let dir = temp.join(format!("{PROBE_PREFIX}{}-{nanos}", std::process::id()));
            // Its root folder is made in its own folder too, not left to
            // hakoniwa's temporary one: a node killed mid-probe leaves only
            // this folder, which the next probe's sweep removes.
            let (work, roots) = (dir.join("work"), dir.join("roots"));
            let outcome = async {
                std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
                let user = SandboxUser::for_new_sandbox();
                if let Some(user) = user {
                    user.own(&work)
                        .map_err(|e| format!("{}: {e}", work.display()))?;
                }
                let spec = SealSpec {
                    workdir: work.clone(),
                    user,
                    network: Network::None,
                    resources: Resources::default(),
                    env: vec![],
                    roots: Some(roots.clone()),
                    read_only: vec![],
                    stdin: false,
                };
                let mut child = spawn(&spec, "true").await?;
                child.wait().await.and_then(|s| match s.exit_code {
                    Some(0) => Ok(()),
                    _ => Err(s.reason),
                })
            };
            // Bounded: a node must start, and say why it cannot seal, even
            // if the probe's fork never reports back.
            let outcome = tokio::time::timeout(PROBE_LIMIT, outcome)
                .await
                .unwrap_or_else(|_| {
                    Err(format!(
                        "the probe did not finish in {} s",
                        PROBE_LIMIT.as_secs()
                    ))
                });
            let _ = std::fs::remove_dir_all(&dir);
            outcome
        })
        .await
        .clone()
}

/// How long the probe may take: a sealed `true` takes milliseconds.
const PROBE_LIMIT: std::time::Duration = std::time::Duration::from_secs(20);

/// A probe's folder: `arbor-probe-<pid>-<nanos>` in the temporary folder.
const PROBE_PREFIX: &str = "arbor-probe-";

/// Removes the probe folders of processes that are gone: a node killed
/// during its probe (SIGKILL, a crash) leaves its folder behind. A folder
/// whose pid is alive, even if reused by another program, is left alone.
fn sweep_stale_probes(temp: &Path) {
    let Ok(entries) = std::fs::read_dir(temp) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(PROBE_PREFIX))
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

impl Posture {
    /// The posture of a sealed node none of whose agents can run a command
    /// or start an MCP server: nothing to seal, so nothing is probed. A
    /// command would run sealed, or fail to start if the kernel refused.
    pub fn not_probed() -> Self {
        Self {
            mode: SandboxIsolation::Sealed,
            sealed: true,
            detail: "sealed, not probed: no agent of this workspace runs commands or MCP servers"
                .into(),
        }
    }

    /// A posture for tests and tools that run without probing.
    pub fn assumed(mode: SandboxIsolation) -> Self {
        Self {
            sealed: mode == SandboxIsolation::Sealed,
            mode,
            detail: String::new(),
        }
    }
}

/// The host uid a root node's sandbox runs its commands as (its gid is the same number).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SandboxUser(pub u32);

impl SandboxUser {
    /// A fresh uid for a new sandbox, if this node is root; None otherwise
    /// (its commands run as the node's own user, mapped in a user namespace).
    pub fn for_new_sandbox() -> Option<Self> {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return None;
        }
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % SANDBOX_UID_SPAN;
        // Two nodes on one host start far apart in the span.
        let start = std::process::id().wrapping_mul(1000);
        Some(Self(
            SANDBOX_UID_BASE + start.wrapping_add(n) % SANDBOX_UID_SPAN,
        ))
    }

    /// Makes `path` (a workdir, or a file or folder the runtime wrote in
    /// one) the sandbox's, so its commands can write there.
    pub fn own(&self, path: &Path) -> std::io::Result<()> {
        std::os::unix::fs::lchown(path, Some(self.0), Some(self.0))
    }

    /// Makes `path` and everything below it the sandbox's, symlinks
    /// themselves and not what they point at: a workdir an earlier
    /// sandbox left (a loop's next iteration, its check, a rescuer's copy
    /// of a failed workdir), whose processes have all been killed.
    pub fn own_tree(&self, path: &Path) -> std::io::Result<()> {
        self.own(path)?;
        if !std::fs::symlink_metadata(path)?.is_dir() {
            return Ok(());
        }
        for entry in std::fs::read_dir(path)? {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                self.own_tree(&entry.path())?;
            } else {
                self.own(&entry.path())?;
            }
        }
        Ok(())
    }
}

/// One sealed command's setting.
pub struct SealSpec {
    pub workdir: PathBuf,
    /// For a root node: who the command runs as (`SandboxUser`).
    pub user: Option<SandboxUser>,
    pub network: Network,
    pub resources: Resources,
    /// The whole environment, beyond PATH, HOME, LANG and TMPDIR.
    pub env: Vec<(String, String)>,
    /// Where the command's root folder is made (one folder each, removed
    /// when it ends); None: the temporary folder. A node puts them in its
    /// data dir, so that what a crash leaves is swept at the next start.
    pub roots: Option<PathBuf>,
    /// Host folders (absolute, existing) it sees read-only at the same
    /// path, beyond the system's: a tool server's own files.
    pub read_only: Vec<PathBuf>,
    /// Whether its stdin is a pipe the caller writes (`Spawned::stdin`);
    /// else `/dev/null`.
    pub stdin: bool,
}

/// A command while it runs, sealed or (under `mode = "none"`) on the host.
pub struct Spawned {
    child: Option<Forked>,
    /// The root folder made for it, removed once it has been reaped.
    root: Option<PathBuf>,
    pid: i32,
    /// Names the forked process whatever happens to its pid (kill and wait are race-free).
    pidfd: tokio::io::unix::AsyncFd<OwnedFd>,
    pub stdin: Option<tokio::net::unix::pipe::Sender>,
    pub stdout: Option<tokio::net::unix::pipe::Receiver>,
    pub stderr: Option<tokio::net::unix::pipe::Receiver>,
}

/// The pipes of a forked child: stdin, stdout, stderr.
type Pipes = (Option<OwnedFd>, Option<OwnedFd>, Option<OwnedFd>);

enum Forked {
    /// hakoniwa's process, the parent of the command's namespaces.
    Sealed(Box<hakoniwa::Child>),
    /// `/bin/sh` itself, leading a process group on the host.
    Host(std::process::Child),
}

impl Forked {
    fn pid(&self) -> i32 {
        match self {
            Forked::Sealed(c) => c.id() as i32,
            Forked::Host(c) => c.id() as i32,
        }
    }

    /// Kills and reaps a child nobody waits for any more: its start took
    /// too long, or its job stopped meanwhile. It must not run on unwatched.
    fn abandon(mut self, root: Option<PathBuf>) {
        let pid = self.pid();
        if matches!(self, Forked::Sealed(_)) {
            kill_namespace_init(pid);
        }
        // SAFETY: plain syscalls. The child is ours and not yet reaped, so
        // its pid (and a host command's group id, the same number) names it.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            if matches!(self, Forked::Host(_)) {
                libc::kill(-pid, libc::SIGKILL);
            }
        }
        let _ = self.wait();
        remove_root(root);
    }

    /// Blocks until it has exited, reaping it.
    fn wait(&mut self) -> Result<SpawnedStatus, String> {
        match self {
            Forked::Sealed(child) => child
                .wait()
                .map(|s| SpawnedStatus {
                    exit_code: s.exit_code,
                    reason: s.reason,
                })
                .map_err(|e| e.to_string()),
            Forked::Host(child) => child
                .wait()
                .map(|s| SpawnedStatus {
                    exit_code: s.code(),
                    reason: format!("the command ended by {s}"),
                })
                .map_err(|e| e.to_string()),
        }
    }
}

/// Kills the init of a sealed command's pid namespace (the child of
/// hakoniwa's process `parent`), and with it every process of the namespace.
///
/// The init dies with its parent by its parent-death signal, but a root
/// node's init changes its uid before the command, which clears that
/// signal until it sets it again: a parent killed in between (a stop or a
/// deadline just as the command starts) would leave the namespace running,
/// orphaned. Killed directly, it dies whenever that happens.
fn kill_namespace_init(parent: i32) {
    let children = || {
        std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|pid| pid.parse::<i32>().ok())
            .collect::<Vec<_>>()
    };
    for pid in children() {
        // SAFETY: plain syscalls; the descriptor is closed below.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            continue;
        }
        // SAFETY: just opened, owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // Still its child once the descriptor is held: then the descriptor
        // names that child, not a process that reused its pid.
        if children().contains(&pid) {
            // SAFETY: a plain syscall on a descriptor owned here.
            unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    fd.as_raw_fd(),
                    libc::SIGKILL,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                );
            }
        }
    }
}

/// How a command ended.
pub struct SpawnedStatus {
    /// The command's own exit code; None if it was killed or never started.
    pub exit_code: Option<i32>,
    pub reason: String,
}

impl Spawned {
    /// The pid of the forked process, which leads the command's process
    /// group: for a sealed command, the parent of its namespaces.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Kills the forked process: a sealed command's whole namespace with it
    /// (invariant 1); a host command's group is the caller's to kill.
    pub fn kill(&self) {
        if matches!(self.child, Some(Forked::Sealed(_))) {
            kill_namespace_init(self.pid);
        }
        // SAFETY: a plain syscall on a descriptor this struct owns.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.get_ref().as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            );
        }
    }

    /// Waits for the forked process to exit, without holding a thread meanwhile.
    pub async fn wait(&mut self) -> Result<SpawnedStatus, String> {
        // A pidfd becomes readable when its process exits.
        let _ready = self.pidfd.readable().await.map_err(|e| e.to_string())?;
        let mut child = self.child.take().ok_or("already waited")?;
        let root = self.root.take();
        // It has exited: this reaps it (and reads hakoniwa's status pipe, now closed).
        tokio::task::spawn_blocking(move || {
            let status = child.wait();
            remove_root(root);
            status
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// Forks `make()`'s child on the spawner thread and tracks it.
    async fn fork(
        root: Option<PathBuf>,
        make: impl FnOnce() -> Result<(Forked, Pipes), String> + Send + 'static,
    ) -> Result<Spawned, String> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let abandoned = root.clone();
        spawner()
            .send(Box::new(move || {
                // Nobody waits for the reply when the start was given up
                // on (its deadline, its job's stop): what it made goes,
                // whether the reply finds no receiver or lies unread in a
                // channel dropped later (`Unclaimed`).
                match make() {
                    Ok(made) => {
                        let _ = tx.send(Ok(Unclaimed(Some((made, abandoned)))));
                    }
                    Err(e) => {
                        if tx.send(Err(e)).is_err() {
                            remove_root(abandoned);
                        }
                    }
                }
            }))
            .map_err(|_| "the spawner thread is gone")?;
        // A dropped reply: the fork panicked (and the spawner went on).
        let (mut child, (stdin, stdout, stderr)) = rx
            .await
            .map_err(|_| "the command's fork failed inside arbor; see the node's log")??
            .claim();
        let pid = child.pid();
        // SAFETY: a plain syscall. The child is ours and not yet reaped, so
        // its pid names it.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: as above: not yet reaped, so the pid is still its.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            let _ = child.wait();
            remove_root(root);
            return Err(format!("pidfd_open: {e}"));
        }
        // SAFETY: the fd was just opened and is owned by nothing else.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Ok(Spawned {
            child: Some(child),
            root,
            pid,
            // SAFETY: the descriptor is owned by the AsyncFd from here on,
            // and closed only when it is dropped (and deregistered).
            pidfd: unsafe {
                tokio::io::unix::AsyncFd::register_with_interest(
                    pidfd,
                    tokio::io::Interest::READABLE,
                )
            }
            .map_err(|e| e.to_string())?,
            stdin: stdin.map(sender).transpose()?,
            stdout: stdout.map(receiver).transpose()?,
            stderr: stderr.map(receiver).transpose()?,
        })
    }
}

/// A fork's child on its way to the task that asked for it: killed and
/// reaped if it is dropped unclaimed (its start given up on after it was
/// made), so no command outlives a stop that raced its start (I-17).
struct Unclaimed(Option<((Forked, Pipes), Option<PathBuf>)>);

impl Unclaimed {
    fn claim(mut self) -> (Forked, Pipes) {
        let (made, _root) = self.0.take().expect("claimed once");
        made
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        if let Some(((child, _pipes), root)) = self.0.take() {
            // Off the async threads: abandon waits for the child to die.
            std::thread::spawn(move || child.abandon(root));
        }
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            self.kill();
            let root = self.root.take();
            // Reap it off the async threads: it is dying, the wait is short.
            std::thread::spawn(move || {
                let _ = child.wait();
                remove_root(root);
            });
        }
    }
}

type SpawnJob = Box<dyn FnOnce() + Send>;

/// The one thread every sealed command is forked from (invariant 2). It
/// never exits, so parent-death signals fire only when the node dies.
fn spawner() -> &'static mpsc::Sender<SpawnJob> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnJob>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("arbor-spawner".into())
            .spawn(move || {
                for job in rx {
                    // A panic in a fork must not end this thread: every
                    // command forked from it would die with it (I-38).
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                        tracing::error!("a command's fork panicked; the spawner goes on");
                    }
                }
            })
            .expect("the node can start a thread");
        tx
    })
}

/// Starts `command` under `/bin/sh -c`, sealed as `spec` says.
pub async fn spawn(spec: &SealSpec, command: &str) -> Result<Spawned, String> {
    let argv = [
        c"/bin/sh".to_owned(),
        c"-c".to_owned(),
        std::ffi::CString::new(command).map_err(|_| "the command holds a NUL byte")?,
    ];
    let user = spec.user;
    // The job's own variables (its secrets) are set by `init`, not handed
    // to hakoniwa, which logs every variable it is given at debug level.
    let env = spec
        .env
        .iter()
        .map(|(k, v)| {
            Ok((
                std::ffi::CString::new(k.as_str())?,
                std::ffi::CString::new(v.as_str())?,
            ))
        })
        .collect::<Result<Vec<_>, std::ffi::NulError>>()
        .map_err(|_| "an environment variable holds a NUL byte")?;
    let workdir = spec.workdir.to_str().ok_or("the workdir is not UTF-8")?;
    let stdin = if spec.stdin {
        hakoniwa::Stdio::piped()
    } else {
        let null = std::fs::File::open("/dev/null").map_err(|e| format!("/dev/null: {e}"))?;
        hakoniwa::Stdio::from(null)
    };
    let mut container = container(spec)?;
    // Made last: nothing after it fails before the fork, which removes it.
    let root = match &spec.roots {
        Some(roots) => {
            let root = roots.join(unique_name());
            std::fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
            container.rootdir(&root);
            Some(root)
        }
        None => None,
    };
    // SAFETY: the closure runs in the namespace's init, a process forked
    // from a single-threaded one, so it may allocate; it only makes
    // syscalls and execs.
    let mut cmd = unsafe { container.command_from_closure(move || init(user, &env, &argv)) };
    cmd.current_dir(workdir);
    for (key, value) in base_env(Path::new(workdir), true) {
        cmd.env(&key, &value);
    }
    cmd.stdin(stdin)
        .stdout(hakoniwa::Stdio::piped())
        .stderr(hakoniwa::Stdio::piped());
    let made = root.clone();
    let spawned = Spawned::fork(root, move || {
        let mut child = cmd.spawn().map_err(|e| e.to_string())?;
        let pid = child.id() as i32;
        // Its own process group, so that a restart can kill it by group
        // (I-30); it never execs, so the parent may still set it.
        // SAFETY: a plain syscall on our own unreaped child.
        unsafe { libc::setpgid(pid, pid) };
        let pipes = (
            child.stdin.take().map(OwnedFd::from),
            child.stdout.take().map(OwnedFd::from),
            child.stderr.take().map(OwnedFd::from),
        );
        Ok((Forked::Sealed(Box::new(child)), pipes))
    })
    .await;
    if spawned.is_err() {
        remove_root(made);
    }
    spawned
}

/// A name no other folder made by this process has.
fn unique_name() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{}-{nanos}-{n}", std::process::id())
}

/// Removes a command's root folder: only the empty mount points and the
/// two files (`/etc/passwd`, `/etc/group`) hakoniwa made in it on the host.
fn remove_root(root: Option<PathBuf>) {
    if let Some(root) = root
        && let Err(e) = std::fs::remove_dir_all(&root)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(root = %root.display(), error = %e, "could not remove a command's root folder");
    }
}

/// The environment every command and MCP server starts from, sealed or
/// not, before its agent's variables and secrets: PATH, HOME (its workdir,
/// as the sandbox sees it) and LANG; a sealed one's TMPDIR is its own /tmp.
pub fn base_env(home: &Path, sealed: bool) -> Vec<(String, String)> {
    let mut env = vec![
        (
            "PATH".to_string(),
            "/usr/local/bin:/usr/bin:/bin".to_string(),
        ),
        ("HOME".to_string(), home.display().to_string()),
        ("LANG".to_string(), "C.UTF-8".to_string()),
    ];
    if sealed {
        env.push(("TMPDIR".to_string(), "/tmp".to_string()));
    }
    env
}

/// Starts `command` under `/bin/sh -c` on the host, unsealed (`mode =
/// "none"`): in `workdir`, in a process group of its own, with `base_env`
/// and then `env` as its whole environment and `resources` as its rlimits;
/// its stdin a pipe if `stdin`, else `/dev/null`.
pub async fn spawn_host(
    workdir: &Path,
    env: Vec<(String, String)>,
    resources: &Resources,
    command: &str,
    stdin: bool,
) -> Result<Spawned, String> {
    let limits = rlimits(resources);
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(command)
        .current_dir(workdir)
        .env_clear()
        .envs(base_env(workdir, false))
        .envs(env)
        .stdin(if stdin {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0);
    // SAFETY: set_pdeathsig and setrlimit are async-signal-safe (one
    // syscall each); `limits` was built before the fork, so the child
    // allocates nothing and touches no memory of the parent but its copy.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
            for (resource, limit) in &limits {
                nix::sys::resource::setrlimit(*resource, *limit, *limit)?;
            }
            Ok(())
        });
    }
    Spawned::fork(None, move || {
        let mut child = cmd.spawn().map_err(|e| e.to_string())?;
        let pipes = (
            child.stdin.take().map(OwnedFd::from),
            child.stdout.take().map(OwnedFd::from),
            child.stderr.take().map(OwnedFd::from),
        );
        Ok((Forked::Host(child), pipes))
    })
    .await
}

/// `resources` as setrlimit's arguments, for a command on the host.
fn rlimits(r: &Resources) -> Vec<(nix::sys::resource::Resource, u64)> {
    use nix::sys::resource::Resource;
    [
        (Resource::RLIMIT_AS, r.memory_bytes),
        (Resource::RLIMIT_CPU, r.cpu_secs),
        (Resource::RLIMIT_FSIZE, r.file_size_bytes),
        (Resource::RLIMIT_NOFILE, r.open_files),
        (Resource::RLIMIT_NPROC, r.processes),
    ]
    .into_iter()
    .filter_map(|(resource, limit)| limit.map(|l| (resource, l)))
    .collect()
}

/// The namespace's init, between hakoniwa's set-up (mounts, rlimits,
/// no_new_privs) and the command: on a root node, drops to the sandbox's
/// uid, then execs the shell. Returns only on failure, as the exit code.
fn init(
    user: Option<SandboxUser>,
    env: &[(std::ffi::CString, std::ffi::CString)],
    argv: &[std::ffi::CString; 3],
) -> i32 {
    fn fail(what: &str) -> i32 {
        let e = std::io::Error::last_os_error();
        eprintln!("arbor sandbox: {what}: {e}");
        125
    }
    // SAFETY: plain syscalls with constant or owned arguments.
    unsafe {
        if let Some(SandboxUser(id)) = user {
            if libc::setgroups(0, std::ptr::null()) != 0 {
                return fail("setgroups");
            }
            if libc::setresgid(id, id, id) != 0 {
                return fail("setresgid");
            }
            if libc::setresuid(id, id, id) != 0 {
                return fail("setresuid");
            }
            // The uid change cleared the parent-death signal; set it again,
            // so the namespace still dies with its parent (invariant 1).
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return fail("prctl");
            }
        }
        for (name, value) in env {
            if libc::setenv(name.as_ptr(), value.as_ptr(), 1) != 0 {
                return fail("setenv");
            }
        }
        let ptrs = [
            argv[0].as_ptr(),
            argv[1].as_ptr(),
            argv[2].as_ptr(),
            std::ptr::null(),
        ];
        libc::execv(ptrs[0], ptrs.as_ptr());
    }
    fail("exec /bin/sh")
}

fn receiver(pipe: OwnedFd) -> Result<tokio::net::unix::pipe::Receiver, String> {
    tokio::net::unix::pipe::Receiver::from_owned_fd(pipe).map_err(|e| e.to_string())
}

fn sender(pipe: OwnedFd) -> Result<tokio::net::unix::pipe::Sender, String> {
    tokio::net::unix::pipe::Sender::from_owned_fd(pipe).map_err(|e| e.to_string())
}

fn container(spec: &SealSpec) -> Result<hakoniwa::Container, String> {
    use hakoniwa::{Container, MountOptions, Namespace, Rlimit};
    let mut c = Container::empty();
    for ns in [
        Namespace::Pid,
        Namespace::Mount,
        Namespace::Ipc,
        Namespace::Uts,
    ] {
        c.unshare(ns);
    }
    if spec.user.is_none() {
        // Not root: a user namespace gives the rights to make the others.
        c.unshare(Namespace::User)
            .uidmap(INSIDE_UID)
            .gidmap(INSIDE_UID);
    }
    if spec.network == Network::None {
        // A new network namespace has only a loopback that is down: no
        // connection, no DNS, no abstract Unix socket of the host (I-28).
        c.unshare(Namespace::Network);
    }
    c.hostname("sandbox");
    for dir in ["/bin", "/sbin", "/lib", "/lib64", "/lib32", "/usr"] {
        let path = Path::new(dir);
        match path.symlink_metadata() {
            Ok(m) if m.file_type().is_symlink() => {
                let target = std::fs::read_link(path).map_err(|e| format!("{dir}: {e}"))?;
                c.symlink(&target.to_string_lossy(), dir);
            }
            Ok(m) if m.is_dir() => {
                c.bindmount_ro(dir, dir);
            }
            _ => {}
        }
    }
    let id = spec.user.map_or(INSIDE_UID, |u| u.0);
    for file in etc_files(spec.network) {
        if Path::new(file).exists() {
            c.bindmount_ro(file, file);
        }
    }
    c.file(
        "/etc/passwd",
        &format!("root:x:0:0::/:/bin/sh\nsandbox:x:{id}:{id}::/tmp:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n"),
    )
    .file(
        "/etc/group",
        &format!("root:x:0:\nsandbox:x:{id}:\nnogroup:x:65534:\n"),
    );
    c.procfsmount("/proc").devfsmount("/dev");
    // The root is a fresh folder only its maker may enter; the sandbox's
    // user must pass through it.
    c.dir("/", 0o755);
    let tmp_size = spec
        .resources
        .file_size_bytes
        .map_or(TMP_SIZE, |f| f.min(TMP_SIZE));
    c.mount(
        "tmpfs",
        "/tmp",
        "tmpfs",
        MountOptions::NOSUID | MountOptions::NODEV,
        Some(format!("size={tmp_size},mode=1777")),
    );
    for dir in &spec.read_only {
        let path = dir
            .to_str()
            .ok_or("a read-only folder's path is not UTF-8")?;
        c.bindmount_ro(path, path);
    }
    let workdir = spec.workdir.to_str().ok_or("the workdir is not UTF-8")?;
    c.mount(
        workdir,
        workdir,
        "",
        MountOptions::BIND | MountOptions::REC | MountOptions::NOSUID | MountOptions::NODEV,
        None,
    );
    let r = &spec.resources;
    for (rlimit, value) in [
        (Rlimit::As, r.memory_bytes),
        (Rlimit::Cpu, r.cpu_secs),
        (Rlimit::Fsize, r.file_size_bytes),
        (Rlimit::Nofile, r.open_files),
        (Rlimit::Nproc, r.processes),
    ] {
        if let Some(v) = value {
            // Soft and hard alike, so a command cannot raise them again.
            c.setrlimit(rlimit, v, v);
        }
    }
    Ok(c)
}

/// What of the host's `/etc` a sealed command sees: what the dynamic loader,
/// locales, time zones and TLS need, and name resolution with the network.
fn etc_files(network: Network) -> Vec<&'static str> {
    let mut files = vec![
        "/etc/alternatives",
        "/etc/ld.so.cache",
        "/etc/ld.so.conf",
        "/etc/ld.so.conf.d",
        "/etc/localtime",
        "/etc/ssl",
        "/etc/ca-certificates",
    ];
    if network == Network::Open {
        files.extend([
            "/etc/resolv.conf",
            "/etc/hosts",
            "/etc/nsswitch.conf",
            "/etc/services",
            "/etc/protocols",
        ]);
    }
    files
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    async fn run(spec: &SealSpec, command: &str) -> (Option<i32>, String, String) {
        let mut child = spawn(spec, command).await.expect("spawns");
        let (mut out, mut err) = (String::new(), String::new());
        let mut o = child.stdout.take().unwrap();
        let mut e = child.stderr.take().unwrap();
        let status = child.wait().await.unwrap();
        o.read_to_string(&mut out).await.unwrap();
        e.read_to_string(&mut err).await.unwrap();
        (status.exit_code, out, err)
    }

    /// A plain sealed spec on `dir`, no network, no secrets.
    fn plain_spec(dir: &Path, user: Option<SandboxUser>, roots: Option<PathBuf>) -> SealSpec {
        SealSpec {
            workdir: dir.to_path_buf(),
            user,
            network: Network::None,
            resources: Resources::default(),
            env: vec![],
            roots,
            read_only: vec![],
            stdin: false,
        }
    }

    /// A probe folder left by a process that is gone is swept; one of a
    /// live process (this one) and anything not named as a probe stay.
    #[test]
    fn a_probe_folder_of_a_dead_process_is_swept_and_nothing_else() {
        let temp = tempfile::tempdir().unwrap();
        // Above any pid Linux hands out (pid_max is at most 2^22).
        let dead = temp.path().join(format!("{PROBE_PREFIX}99999999-1"));
        let live = temp
            .path()
            .join(format!("{PROBE_PREFIX}{}-2", std::process::id()));
        let other = temp.path().join("arbor-probe-notapid-3");
        for dir in [&dead, &live, &other] {
            std::fs::create_dir(dir).unwrap();
        }
        std::fs::write(dead.join("left.txt"), "x").unwrap();
        sweep_stale_probes(temp.path());
        assert!(!dead.exists(), "the dead process's folder is gone");
        assert!(live.exists() && other.exists());
    }

    /// Nodes started at once in one process (tests, an embedder's) each get
    /// the sealed posture: no probe removes another's folder.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn probes_at_once_all_find_the_node_sealed() {
        let probes = (0..8).map(|_| tokio::spawn(Posture::probe(SandboxIsolation::Sealed)));
        for probe in futures::future::join_all(probes).await {
            let posture = probe.unwrap();
            assert!(posture.sealed, "{}", posture.detail);
        }
    }

    /// A start given up on before its fork reported (its deadline, its
    /// job's stop) leaves nothing running and no root folder, and the
    /// spawner serves the next command.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_start_given_up_on_is_killed_when_it_reports() {
        let dir = tempfile::tempdir().unwrap();
        let user = SandboxUser::for_new_sandbox();
        if let Some(u) = user {
            u.own(dir.path()).unwrap();
        }
        let roots = dir.path().join("roots");
        let spec = plain_spec(dir.path(), user, Some(roots.clone()));
        // A marker no other process's command line holds.
        let marker = format!("{}.{}", 600, std::process::id());
        let command = format!("sleep {marker}");
        let mut start = Box::pin(spawn(&spec, &command));
        // Polled once (the job is handed to the spawner), then dropped.
        assert!(
            futures::poll!(&mut start).is_pending(),
            "the fork cannot have reported yet"
        );
        drop(start);
        // The spawner forks one command at a time: by the time this one
        // ran, the one given up on was killed, reaped and its root removed.
        let (code, _, err) = run(&spec, "true").await;
        assert_eq!(code, Some(0), "{err}");
        let left: Vec<_> = std::fs::read_dir(&roots).unwrap().flatten().collect();
        assert!(left.is_empty(), "root folders left: {left:?}");
        // Its namespace dies with it; each process of it still there must exit.
        for pid in processes_with(&marker) {
            // SAFETY: a plain syscall; a pid that is gone gives an error.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
            if fd < 0 {
                continue;
            }
            // SAFETY: just opened, owned by nothing else.
            let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
            // SAFETY: the descriptor is owned by the AsyncFd from here on.
            let exited = unsafe {
                tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
            }
            .unwrap();
            let _ready =
                tokio::time::timeout(std::time::Duration::from_secs(10), exited.readable())
                    .await
                    .unwrap_or_else(|_| panic!("the command given up on (pid {pid}) still runs"))
                    .unwrap();
        }
    }

    /// A start given up on after its fork reported, its reply unread in
    /// the channel (a stop that raced the start's end): the command is
    /// killed when the reply is dropped, not left running (I-17).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_start_given_up_on_with_its_reply_unread_is_killed() {
        let dir = tempfile::tempdir().unwrap();
        let user = SandboxUser::for_new_sandbox();
        if let Some(u) = user {
            u.own(dir.path()).unwrap();
        }
        let spec = plain_spec(dir.path(), user, Some(dir.path().join("roots")));
        let marker = format!("{}.{}", 601, std::process::id());
        let command = format!("sleep {marker}");
        let mut start = Box::pin(spawn(&spec, &command));
        assert!(futures::poll!(&mut start).is_pending());
        // The spawner forks one command at a time: once the next has run,
        // this one's reply lies in its channel, never read.
        let (code, _, err) = run(&spec, "true").await;
        assert_eq!(code, Some(0), "{err}");
        let running = processes_with(&marker);
        assert!(
            !running.is_empty(),
            "the command runs before its start is dropped"
        );
        drop(start);
        for pid in running {
            assert!(
                crate::pidfd::process_exits_within(pid, std::time::Duration::from_secs(10)).await,
                "the command given up on (pid {pid}) still runs"
            );
        }
    }

    /// Killing a sealed command's namespace init, and nothing else, ends
    /// the command: hakoniwa's process then reaps it and exits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_namespace_ends_with_its_init_killed_directly() {
        // Only a root node's init changes its uid (and so loses its
        // parent-death signal for a moment); unprivileged, the init is in a
        // user namespace of its own whose /proc entries this node may not read.
        let Some(user) = SandboxUser::for_new_sandbox() else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        user.own(dir.path()).unwrap();
        let spec = plain_spec(dir.path(), Some(user), Some(dir.path().join("roots")));
        let marker = format!("{}.{}", 601, std::process::id());
        let mut child = spawn(&spec, &format!("sleep {marker}")).await.unwrap();
        kill_namespace_init(child.pid());
        let status = tokio::time::timeout(std::time::Duration::from_secs(10), child.wait())
            .await
            .expect("the command ended with its namespace's init")
            .unwrap();
        assert_eq!(status.exit_code, None, "{}", status.reason);
        assert!(processes_with(&marker).is_empty());
    }

    /// Pids of the live processes whose command line holds `marker`.
    fn processes_with(marker: &str) -> Vec<i32> {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(marker))
            })
            .collect()
    }

    #[tokio::test]
    async fn a_sealed_command_sees_its_workdir_and_little_else() {
        let dir = tempfile::tempdir().unwrap();
        let user = SandboxUser::for_new_sandbox();
        if let Some(u) = user {
            u.own(dir.path()).unwrap();
        }
        let spec = SealSpec {
            workdir: dir.path().to_path_buf(),
            user,
            network: Network::None,
            resources: Resources::default(),
            env: vec![("GREETING".into(), "hi".into())],
            roots: Some(dir.path().join("roots")),
            read_only: vec![],
            stdin: false,
        };
        let (code, out, err) = run(
            &spec,
            "echo $GREETING > f.txt; cat f.txt; id -u; echo $$; ls /; touch /usr/x 2>&1 || echo ro",
        )
        .await;
        assert_eq!(code, Some(0), "{err}");
        println!("{out}");
        let uid = user.map_or(INSIDE_UID, |u| u.0);
        assert!(out.starts_with(&format!("hi\n{uid}\n1\n")), "{out}");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("f.txt")).unwrap(),
            "hi\n"
        );
        assert!(out.contains("ro"), "{out}");
    }
}
