//! Sandbox: one per step and job. Owns the workdir and every process started in it.
//!
//! Parent: the step or job it serves (spawned linked to it).
//! Each command runs sealed in namespaces of its own (`seal`), or, where
//! arbor.toml says `[sandbox] mode = "none"`, as a process group on the host;
//! either way in the job's workdir, with an environment cleared to an
//! allowlist and the job's rlimits.
//!
//! Invariants:
//! 1. Every process group it started is killed when it ends, however it ends:
//!    `KillAll`, `post_stop`, and the `Drop` of its state (which runs even when
//!    ractor kills the actor and skips `post_stop`) all kill them (I-17). A
//!    sealed command's group leader is its pid namespace's parent: killing it
//!    kills everything in the namespace.
//! 2. Files are read and written only below the workdir: absolute paths, `..`
//!    and symlinks are refused (I-28), by words first (`confine`) and then by
//!    the kernel (`openat2` with RESOLVE_BENEATH and RESOLVE_NO_SYMLINKS), so
//!    a symlink swapped in between the two is refused too.
//! 3. Artifacts are what the runtime saw change in the workdir, never a claim (I-24).
//! 4. The workdir is made at its first use (a command, a write, or a read of
//!    a folder that already exists), never at the start: most jobs of a wide
//!    fan-out never touch theirs, and a mkdir each cost such a run a sixth of
//!    its CPU and left a thousand empty folders behind. So a job that fails
//!    to start, or never uses its sandbox, leaves no folder (I-06).

use crate::events::EventBus;
use crate::mcp_server::{LiveServer, ServerLaunch};
use crate::secrets::Secrets;
use arbor_mcp::{McpClient, McpError, McpOutcome};
use arbor_protocol::{EventKind, McpServerSpec, McpServerState, McpTransport};
use arbor_sandbox::files::{confine, is_file_beneath, read_confined, write_confined};
use arbor_sandbox::seal::{
    self, Posture, SandboxIsolation, SandboxUser, SealSpec, Spawned, SpawnedStatus,
};
use arbor_storage::{SandboxRecord, SandboxState as GroupState};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};
use tokio::io::AsyncReadExt;
use tokio_util::sync::CancellationToken;

/// The most of stdout and of stderr a command returns to the model.
pub const OUTPUT_LIMIT: usize = 64 * 1024;
/// How many workdir entries an artifact scan looks at before it stops.
const SCAN_LIMIT: usize = 10_000;
/// How long an MCP server has to answer anything after one of its calls
/// timed out and was cancelled, before it is killed.
pub const MCP_GRACE: Duration = Duration::from_secs(2);
/// At a stop mid-call: how long the cancel gets to reach the server before
/// the server is killed (well inside I-17's 2 s).
const MCP_CANCEL_FLUSH: Duration = Duration::from_millis(250);

pub struct Sandbox;

pub struct SandboxArgs {
    /// Where each process group is recorded, so a restart can kill what a
    /// crash left running (I-30).
    pub record: Option<GroupRecorder>,
    pub workdir: PathBuf,
    /// Cancelled when the job (or anything above it) stops: running commands are killed at once.
    pub cancel: CancellationToken,
    pub exec_timeout: Duration,
    /// The rlimits of every command it runs.
    pub resources: arbor_protocol::Resources,
    /// The job's effective network (I-28).
    pub network: arbor_protocol::Network,
    /// The node's sandbox posture: sealed, or not and why.
    pub posture: Arc<Posture>,
    /// Whether the job may run commands (holds `exec`): a node that cannot
    /// seal refuses such a job at its start rather than run it unsealed.
    pub runs_commands: bool,
    /// Environment beyond the allowlist (the job's secrets, I-27).
    pub env: Vec<(String, String)>,
    /// Cut from every byte it hands back (I-27).
    pub secrets: Arc<Secrets>,
    /// Where its sealed commands' root folders are made (`SealSpec::roots`).
    pub roots: Option<PathBuf>,
}

pub enum SandboxMsg {
    Exec {
        command: String,
        timeout: Option<Duration>,
        reply: RpcReplyPort<ExecOutcome>,
    },
    /// A hook (I-62): `command` run as a command is, `input` on its stdin.
    Hook {
        command: String,
        input: Vec<u8>,
        timeout: Duration,
        reply: RpcReplyPort<ExecOutcome>,
    },
    /// A command or an MCP call ended; these paths of the workdir changed
    /// while it ran (I-24: what the runtime saw written). Cast before the
    /// reply, so the job's next `Artifacts` comes after it.
    Wrote {
        changed: Vec<String>,
    },
    ReadFile {
        path: String,
        reply: RpcReplyPort<Result<String, String>>,
    },
    WriteFile {
        path: String,
        content: String,
        reply: RpcReplyPort<Result<(), String>>,
    },
    Artifacts {
        reply: RpcReplyPort<Vec<String>>,
    },
    /// Kill every process this sandbox started; replies with how many groups were signalled.
    KillAll {
        reply: RpcReplyPort<usize>,
    },
    /// Call a tool of one of its MCP servers: started at its first call,
    /// and again at the next call after it ended. The call runs in a task
    /// of its own, so `KillAll` is served meanwhile.
    McpCall {
        server: Arc<McpServerSpec>,
        /// The server's own name for the tool.
        tool: String,
        arguments: serde_json::Map<String, serde_json::Value>,
        /// The call's span in its run's trace, for the server.
        traceparent: String,
        reply: RpcReplyPort<Result<McpOutcome, McpCallError>>,
    },
}

/// Why an MCP call gave no result. Each is a tool error the model reads;
/// none fails the job.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum McpCallError {
    #[error("the MCP server {server} could not start: {why}")]
    Start { server: String, why: String },
    #[error("timed_out: the call did not end within {after}; it was cancelled")]
    TimedOut { after: String },
    #[error(
        "the MCP server {server} ended during the call ({why}); it starts again at the next call"
    )]
    Died { server: String, why: String },
    #[error("stopped: the job was stopped during the call")]
    Stopped,
    #[error("the MCP server {server} refused the call: {why}")]
    Refused { server: String, why: String },
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ExecOutcome {
    pub exit_code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub timed_out: bool,
    /// The job was stopped while the command ran.
    pub stopped: bool,
    pub changed: Vec<String>,
    pub error: Option<String>,
}

impl Actor for Sandbox {
    type Msg = SandboxMsg;
    type State = SandboxState;
    type Arguments = SandboxArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        args: SandboxArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let sealed = match args.posture.mode {
            SandboxIsolation::None => false,
            SandboxIsolation::Sealed if args.posture.sealed => true,
            SandboxIsolation::Sealed if args.runs_commands => {
                return Err(format!(
                    "refused: this job may run commands and this node {}",
                    args.posture.detail
                )
                .into());
            }
            // Files only: a command, were one asked for, would be tried
            // sealed and fail; never run unsealed.
            SandboxIsolation::Sealed => true,
        };
        let user = if sealed {
            SandboxUser::for_new_sandbox()
        } else {
            None
        };
        Ok(SandboxState {
            how: Arc::new(HowCommandsRun {
                workdir: Workdir {
                    asked: args.workdir,
                    user,
                    made: OnceLock::new(),
                },
                resources: args.resources,
                sealed,
                user,
                network: args.network,
                env: args.env,
                secrets: args.secrets,
                roots: args.roots,
            }),
            cancel: args.cancel,
            exec_timeout: args.exec_timeout,
            groups: ProcessGroups::new(args.record),
            artifacts: BTreeSet::new(),
            servers: HashMap::new(),
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        state.groups.kill_all();
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            SandboxMsg::Exec {
                command,
                timeout,
                reply,
            } => {
                let timeout = timeout.unwrap_or(state.exec_timeout);
                state.command(&myself, command, timeout, None, reply);
            }
            SandboxMsg::Hook {
                command,
                input,
                timeout,
                reply,
            } => state.command(&myself, command, timeout, Some(input), reply),
            SandboxMsg::Wrote { changed } => {
                state.artifacts.extend(changed);
            }
            SandboxMsg::ReadFile { path, reply } => {
                let read = match state.how.workdir.existing() {
                    Ok(Some(workdir)) => {
                        read_confined(workdir, &path).map(|t| state.how.secrets.redact(&t))
                    }
                    // Refused by words as it would be in any workdir.
                    Ok(None) => confine(&state.how.workdir.asked, &path)
                        .and_then(|_| Err(format!("{path:?}: no such file in the workdir"))),
                    Err(e) => Err(e),
                };
                let _ = reply.send(read);
            }
            SandboxMsg::WriteFile {
                path,
                content,
                reply,
            } => {
                let result =
                    state.how.workdir.make().and_then(|workdir| {
                        write_confined(workdir, &path, &content, state.how.user)
                    });
                if result.is_ok() {
                    state.artifacts.insert(normalize(&path));
                }
                let _ = reply.send(result);
            }
            SandboxMsg::Artifacts { reply } => {
                // Nothing seen written means no workdir needed to look in.
                let present = match state.how.workdir.made.get() {
                    Some(workdir) => state
                        .artifacts
                        .iter()
                        .filter(|p| is_file_beneath(workdir, p))
                        .cloned()
                        .collect(),
                    None => vec![],
                };
                let _ = reply.send(present);
            }
            SandboxMsg::KillAll { reply } => {
                // A stop's cancels reach their servers before the servers
                // die: each call in flight has seen the job's token and is
                // flushing its cancel; bounded, well inside I-17's 2 s.
                let deadline = tokio::time::Instant::now() + MCP_CANCEL_FLUSH * 2;
                for slot in state.servers.values() {
                    slot.calls_settled(deadline).await;
                }
                // Told before the kill, which closes the recorder: a server
                // that still runs ends with its job.
                for (name, slot) in &state.servers {
                    let (running, server) = match slot.live.try_lock() {
                        Ok(mut live) => (live.is_some(), live.take()),
                        Err(_) => (true, None),
                    };
                    if running {
                        let starts = slot.starts.load(std::sync::atomic::Ordering::Acquire);
                        let restarts = starts.saturating_sub(1);
                        state
                            .groups
                            .tell(name, McpServerState::Stopped, restarts, None);
                    }
                    // An HTTP session ends here; a process ends with its
                    // group just below.
                    if let Some(server) = server {
                        server.kill();
                    }
                }
                let _ = reply.send(state.groups.kill_all());
            }
            SandboxMsg::McpCall {
                server,
                tool,
                arguments,
                traceparent,
                reply,
            } => {
                let slot = state
                    .servers
                    .entry(server.name.clone())
                    .or_default()
                    .clone();
                let job = McpCallJob {
                    how: state.how.clone(),
                    groups: state.groups.clone(),
                    cancel: state.cancel.clone(),
                    slot,
                    spec: server,
                };
                tokio::spawn(job.run_and_report(myself, tool, arguments, traceparent, reply));
            }
        }
        Ok(())
    }
}

pub struct SandboxState {
    /// How its commands run; every command's task shares it.
    how: Arc<HowCommandsRun>,
    cancel: CancellationToken,
    exec_timeout: Duration,
    groups: ProcessGroups,
    artifacts: BTreeSet<String>,
    /// Its MCP servers, by name, as far as they have been started.
    servers: HashMap<String, Arc<ServerSlot>>,
}

/// A sandbox's workdir, made at its first use (invariant 4).
struct Workdir {
    /// As the job was given it: it may be relative, or lead through a symlink.
    asked: PathBuf,
    /// Who owns it once made, on a root node.
    user: Option<SandboxUser>,
    /// Canonical, once made: a sealed command's workdir is bound at its host
    /// path, which must be absolute and free of symlinks.
    made: OnceLock<PathBuf>,
}

impl Workdir {
    /// The workdir, made now if this is its first use. Two commands that
    /// race here both make it (each step is idempotent); one path is kept.
    fn make(&self) -> Result<&Path, String> {
        if let Some(made) = self.made.get() {
            return Ok(made);
        }
        let at = |e: std::io::Error| format!("the workdir {}: {e}", self.asked.display());
        std::fs::create_dir_all(&self.asked).map_err(at)?;
        let canonical = std::fs::canonicalize(&self.asked).map_err(at)?;
        if let Some(user) = self.user {
            // What an earlier sandbox left here becomes this one's too.
            user.own_tree(&canonical).map_err(at)?;
        }
        Ok(self.made.get_or_init(|| canonical))
    }

    /// The workdir if it exists (made by this sandbox, or left by an
    /// earlier one at the same path), without making a new folder.
    fn existing(&self) -> Result<Option<&Path>, String> {
        if self.made.get().is_none() && !self.asked.is_dir() {
            return Ok(None);
        }
        self.make().map(Some)
    }
}

/// What every command of a sandbox runs with, fixed when the sandbox starts.
struct HowCommandsRun {
    workdir: Workdir,
    resources: arbor_protocol::Resources,
    sealed: bool,
    /// Who its commands run as, on a root node.
    user: Option<SandboxUser>,
    network: arbor_protocol::Network,
    /// Beyond the allowlist: the job's secrets (I-27).
    env: Vec<(String, String)>,
    /// Cut from every byte that leaves (I-27).
    secrets: Arc<Secrets>,
    roots: Option<PathBuf>,
}

impl Drop for SandboxState {
    fn drop(&mut self) {
        // Runs even when the actor is killed and post_stop is skipped.
        self.groups.kill_all();
    }
}

/// Journals a sandbox's process groups (live when started, ended when
/// killed), and tells its MCP servers' changes.
#[derive(Clone)]
pub struct GroupRecorder {
    pub journal: arbor_storage::Journal,
    pub events: EventBus,
    pub run: arbor_protocol::RunId,
    pub job: arbor_protocol::JobId,
}

impl GroupRecorder {
    fn record(&self, pgid: i32, start: &(u64, String), state: GroupState) -> arbor_storage::Record {
        arbor_storage::Record::Sandbox(SandboxRecord {
            run: self.run,
            job: self.job,
            pgid,
            start_ticks: start.0,
            boot_id: start.1.clone(),
            state,
            epoch: self.journal.epoch(),
        })
    }
}

/// The process groups a sandbox started. Once closed, a group registered late
/// (a command that was starting while the sandbox ended) is killed at once.
#[derive(Clone, Default)]
pub struct ProcessGroups(Arc<Mutex<GroupsInner>>);

#[derive(Default)]
struct GroupsInner {
    live: Vec<(i32, Option<(u64, String)>)>,
    closed: bool,
    recorder: Option<GroupRecorder>,
}

impl ProcessGroups {
    fn new(recorder: Option<GroupRecorder>) -> Self {
        Self(Arc::new(Mutex::new(GroupsInner {
            recorder,
            ..Default::default()
        })))
    }

    /// Registers a started group and makes its record durable. Returns false
    /// (and kills the group) if the sandbox has already ended.
    async fn register(&self, pgid: i32) -> bool {
        let start = arbor_sandbox::process_start(pgid);
        let (recorder, closed) = {
            let mut inner = self.0.lock().unwrap_or_else(|p| p.into_inner());
            if !inner.closed {
                inner.live.push((pgid, start.clone()));
            }
            (inner.recorder.clone(), inner.closed)
        };
        if closed {
            kill_group(pgid);
            return false;
        }
        if let (Some(recorder), Some(start)) = (recorder, start) {
            let record = recorder.record(pgid, &start, GroupState::Live);
            if let Err(error) = recorder.journal.commit(vec![record]).await {
                tracing::error!(%error, pgid, "could not journal a process group");
            }
        }
        true
    }

    fn kill_all(&self) -> usize {
        let mut inner = self.0.lock().unwrap_or_else(|p| p.into_inner());
        inner.closed = true;
        let groups = std::mem::take(&mut inner.live);
        let mut ended = vec![];
        for (pgid, start) in &groups {
            kill_group(*pgid);
            if let (Some(recorder), Some(start)) = (&inner.recorder, start) {
                ended.push(recorder.record(*pgid, start, GroupState::Ended));
            }
        }
        if let Some(recorder) = &inner.recorder
            && !ended.is_empty()
            && let Err(error) = recorder.journal.append(ended)
        {
            tracing::error!(%error, "could not journal ended process groups");
        }
        // Closed: nothing is recorded again, and a command's task that is
        // still ending must not keep the journal open (a node started again
        // in this process would find it locked).
        inner.recorder = None;
        groups.len()
    }
}

impl ProcessGroups {
    /// Kills one group and forgets it: its leader has been killed and will
    /// be reaped, so its id may name another group later.
    fn release(&self, pgid: i32) {
        kill_group(pgid);
        let mut inner = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let Some(at) = inner.live.iter().position(|(g, _)| *g == pgid) else {
            return;
        };
        let (_, start) = inner.live.remove(at);
        if let (Some(recorder), Some(start)) = (&inner.recorder, start) {
            let ended = recorder.record(pgid, &start, GroupState::Ended);
            if let Err(error) = recorder.journal.append(vec![ended]) {
                tracing::error!(%error, "could not journal an ended process group");
            }
        }
    }

    /// Tells an MCP server's change as an event of its job, while the
    /// sandbox still records (a closed one tells nothing more).
    fn tell(&self, server: &str, state: McpServerState, restarts: u32, detail: Option<String>) {
        let recorder = self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .recorder
            .clone();
        if let Some(r) = recorder {
            r.events.emit(
                r.run,
                EventKind::McpServer {
                    id: r.job,
                    server: server.to_string(),
                    state,
                    restarts,
                    detail,
                },
            );
        }
    }
}

fn kill_group(pgid: i32) {
    use nix::sys::signal::{Signal, killpg};
    use nix::unistd::Pid;
    // ESRCH (already gone) is the common, fine case.
    let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
}

/// One MCP server of a sandbox: its process and connection while it runs,
/// and how many times it was started.
#[derive(Default)]
struct ServerSlot {
    /// Held while a call starts it, so two calls never start two.
    live: tokio::sync::Mutex<Option<LiveServer>>,
    starts: std::sync::atomic::AtomicU32,
    /// Calls not yet settled, and a wake-up each time one settles.
    in_flight: std::sync::atomic::AtomicUsize,
    settled: tokio::sync::Notify,
}

impl ServerSlot {
    /// Waits until no call is in flight, or until `deadline`.
    async fn calls_settled(&self, deadline: tokio::time::Instant) {
        use std::sync::atomic::Ordering;
        loop {
            let settled = self.settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            if self.in_flight.load(Ordering::Acquire) == 0 {
                return;
            }
            if tokio::time::timeout_at(deadline, settled).await.is_err() {
                return;
            }
        }
    }
}

/// Counts a call in flight on its slot while it lives.
struct InFlight(Arc<ServerSlot>);

impl InFlight {
    fn new(slot: &Arc<ServerSlot>) -> Self {
        slot.in_flight
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Self(slot.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0
            .in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        self.0.settled.notify_waiters();
    }
}

struct McpCallJob {
    how: Arc<HowCommandsRun>,
    groups: ProcessGroups,
    cancel: CancellationToken,
    slot: Arc<ServerSlot>,
    spec: Arc<McpServerSpec>,
}

impl McpCallJob {
    async fn run(
        self,
        tool: &str,
        arguments: serde_json::Map<String, serde_json::Value>,
        traceparent: &str,
    ) -> Result<McpOutcome, McpCallError> {
        if self.cancel.is_cancelled() {
            return Err(McpCallError::Stopped);
        }
        let _in_flight = InFlight::new(&self.slot);
        let client = tokio::select! {
            client = self.connection() => client?,
            _ = self.cancel.cancelled() => return Err(McpCallError::Stopped),
        };
        let timeout = self.spec.call_timeout;
        // The call is dropped when the select ends without it, which
        // cancels it at the server (`arbor_mcp` invariant 2).
        let result = tokio::select! {
            result = client.call(tool, arguments, timeout, Some(traceparent)) => Some(result),
            _ = self.cancel.cancelled() => None,
        };
        let server = self.spec.name.clone();
        match result {
            None => {
                // I-16: whatever the server answers now reaches no one. The
                // short wait lets the cancel out before the kill (I-17).
                let _ = client.answers_within(MCP_CANCEL_FLUSH).await;
                self.end(
                    &client,
                    McpServerState::Killed,
                    "the job was stopped during a call",
                )
                .await;
                Err(McpCallError::Stopped)
            }
            Some(Ok(outcome)) => Ok(outcome),
            Some(Err(McpError::TimedOut(_))) => {
                if !client.answers_within(MCP_GRACE).await {
                    let why = format!(
                        "it answered nothing within {} after a call timed out",
                        humantime::format_duration(MCP_GRACE)
                    );
                    self.end(&client, McpServerState::Killed, &why).await;
                }
                Err(McpCallError::TimedOut {
                    after: humantime::format_duration(timeout).to_string(),
                })
            }
            Some(Err(McpError::Refused(why))) => Err(McpCallError::Refused { server, why }),
            Some(Err(e)) => {
                let why = self
                    .end(&client, McpServerState::Died, &e.to_string())
                    .await;
                Err(McpCallError::Died { server, why })
            }
        }
    }

    /// Runs the call in its own task; tells the sandbox what a stdio server,
    /// which runs in the workdir, wrote there meanwhile (I-24: the job's, as
    /// a command's is); then replies, so the job's next `Artifacts` sees it.
    async fn run_and_report(
        self,
        sandbox: ActorRef<SandboxMsg>,
        tool: String,
        arguments: serde_json::Map<String, serde_json::Value>,
        traceparent: String,
        reply: RpcReplyPort<Result<McpOutcome, McpCallError>>,
    ) {
        let watched =
            matches!(self.spec.transport, McpTransport::Stdio(_)).then(|| self.how.clone());
        let workdir_snapshot = |how: &HowCommandsRun| how.workdir.made.get().map(|d| snapshot(d));
        let before = watched.as_deref().and_then(workdir_snapshot);
        let result = self.run(&tool, arguments, &traceparent).await;
        if let Some(after) = watched.as_deref().and_then(workdir_snapshot) {
            let changed = changed_since(&before.unwrap_or_default(), after);
            if !changed.is_empty() {
                let _ = sandbox.cast(SandboxMsg::Wrote { changed });
            }
        }
        let _ = reply.send(result);
    }

    /// The server's connection: the one that runs, or a new one.
    async fn connection(&self) -> Result<Arc<McpClient>, McpCallError> {
        let mut live = self.slot.live.lock().await;
        if let Some(server) = live.as_ref()
            && server.client.is_closed()
        {
            let why = self.ended(server, "its connection closed");
            self.tell(McpServerState::Died, Some(why));
            *live = None;
        }
        if let Some(server) = live.as_ref() {
            return Ok(server.client.clone());
        }
        let start_error = |why: String| McpCallError::Start {
            server: self.spec.name.clone(),
            why,
        };
        self.slot
            .starts
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        // A process arbor started is killed when it fails to connect; an
        // HTTP server someone else runs is only unreachable.
        let (connected, pid) = match &self.spec.transport {
            McpTransport::Http(http) => (
                LiveServer::connect_http(http, &self.spec, &self.how.secrets).await,
                None,
            ),
            McpTransport::Stdio(stdio) => {
                let workdir = self.how.workdir.make().map_err(start_error)?.to_path_buf();
                let launch = ServerLaunch {
                    workdir,
                    sealed: self.how.sealed,
                    user: self.how.user,
                    resources: self.how.resources,
                    roots: self.how.roots.clone(),
                };
                let child = launch
                    .spawn(&self.spec, stdio, &self.how.secrets)
                    .await
                    .map_err(start_error)?;
                let pid = child.pid();
                if !self.groups.register(pid).await {
                    return Err(McpCallError::Stopped);
                }
                (
                    LiveServer::connect(child, &self.spec, &self.how.secrets).await,
                    Some(pid),
                )
            }
        };
        match connected {
            Ok(server) => {
                let client = server.client.clone();
                *live = Some(server);
                self.tell(McpServerState::Running, None);
                Ok(client)
            }
            Err(why) => {
                let state = match pid {
                    Some(pid) => {
                        self.groups.release(pid);
                        McpServerState::Killed
                    }
                    None => McpServerState::Died,
                };
                self.tell(state, Some(why.clone()));
                Err(start_error(why))
            }
        }
    }

    /// Kills the server whose connection is `client` (if it is still the
    /// one that runs) and tells it; returns why, with its stderr's end.
    async fn end(&self, client: &Arc<McpClient>, state: McpServerState, why: &str) -> String {
        let mut live = self.slot.live.lock().await;
        let Some(server) = live.as_ref().filter(|s| Arc::ptr_eq(&s.client, client)) else {
            return why.to_string();
        };
        let why = self.ended(server, why);
        self.tell(state, Some(why.clone()));
        *live = None;
        why
    }

    /// Kills a server's group and forgets it; `why`, with its stderr's end.
    fn ended(&self, server: &LiveServer, why: &str) -> String {
        server.kill();
        if let Some(pid) = server.pid() {
            self.groups.release(pid);
        }
        let said = server.stderr_tail(&self.how.secrets);
        if said.is_empty() {
            why.to_string()
        } else {
            format!("{why}; its stderr ends: {said}")
        }
    }

    fn tell(&self, state: McpServerState, detail: Option<String>) {
        let starts = self.slot.starts.load(std::sync::atomic::Ordering::Acquire);
        let restarts = starts.saturating_sub(1);
        self.groups.tell(&self.spec.name, state, restarts, detail);
    }
}

impl SandboxState {
    /// Runs a command in its own task, so the mailbox stays free for
    /// `KillAll` while it runs. A command's writes become artifacts; a
    /// hook's (`input` on its stdin) are not the job's work.
    fn command(
        &self,
        myself: &ActorRef<SandboxMsg>,
        command: String,
        timeout: Duration,
        input: Option<Vec<u8>>,
        reply: RpcReplyPort<ExecOutcome>,
    ) {
        let hook = input.is_some();
        let job = ExecJob {
            how: self.how.clone(),
            groups: self.groups.clone(),
            cancel: self.cancel.clone(),
            timeout,
            stdin: input,
        };
        let myself = myself.clone();
        tokio::spawn(async move {
            let outcome = job.run(&command).await;
            if !hook {
                let _ = myself.cast(SandboxMsg::Wrote {
                    changed: outcome.changed.clone(),
                });
            }
            let _ = reply.send(outcome);
        });
    }
}

struct ExecJob {
    how: Arc<HowCommandsRun>,
    groups: ProcessGroups,
    cancel: CancellationToken,
    timeout: Duration,
    /// Written to its stdin, then closed; None: stdin is `/dev/null`.
    stdin: Option<Vec<u8>>,
}

type Pipe = tokio::net::unix::pipe::Receiver;

impl ExecJob {
    async fn run(self, command: &str) -> ExecOutcome {
        let mut outcome = ExecOutcome {
            exit_code: None,
            stdout: String::new(),
            stderr: String::new(),
            timed_out: false,
            stopped: false,
            changed: vec![],
            error: None,
        };
        if self.cancel.is_cancelled() {
            outcome.stopped = true;
            outcome.error = Some("the job is stopping; the command was not started".into());
            return outcome;
        }
        let workdir = match self.how.workdir.make() {
            Ok(workdir) => workdir.to_path_buf(),
            Err(e) => {
                outcome.error = Some(e);
                return outcome;
            }
        };
        let before = snapshot(&workdir);
        // One deadline for the start and the command: a fork that never
        // reports back must not hold the job (and its parent's collect)
        // forever. A start given up on is killed when it reports (`seal`).
        let deadline = tokio::time::Instant::now() + self.timeout;
        let started = tokio::select! {
            started = self.start(&workdir, command) => started,
            _ = tokio::time::sleep_until(deadline) => {
                outcome.timed_out = true;
                Err(format!(
                    "timed out after {} while the command was starting",
                    humantime::format_duration(self.timeout)
                ))
            }
            _ = self.cancel.cancelled() => {
                outcome.stopped = true;
                Err("stopped: the job was stopped while the command was starting".into())
            }
        };
        let mut child = match started {
            Ok(child) => child,
            Err(e) => {
                outcome.error = Some(e);
                return outcome;
            }
        };
        let pgid = child.pid();
        if !self.groups.register(pgid).await {
            kill_group(pgid);
            child.kill();
            outcome.stopped = true;
            outcome.error = Some("the sandbox ended while the command started".into());
            return outcome;
        }
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        if let (Some(mut pipe), Some(input)) = (child.stdin.take(), self.stdin.clone()) {
            // Written beside the reads: a command that answers before it
            // has read all of it cannot block on a full pipe.
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                let _ = pipe.write_all(&input).await;
            });
        }
        let stdout = tokio::spawn(read_bounded(stdout));
        let stderr = tokio::spawn(read_bounded(stderr));
        tokio::select! {
            status = child.wait() => match status {
                Ok(SpawnedStatus { exit_code: Some(code), .. }) => outcome.exit_code = Some(code),
                Ok(SpawnedStatus { reason, .. }) => outcome.error = Some(reason),
                Err(why) => outcome.error = Some(why),
            },
            _ = tokio::time::sleep_until(deadline) => {
                kill_group(pgid);
                child.kill();
                outcome.timed_out = true;
                outcome.error = Some(format!("timed out after {}", humantime::format_duration(self.timeout)));
            }
            _ = self.cancel.cancelled() => {
                kill_group(pgid);
                child.kill();
                outcome.stopped = true;
                outcome.error = Some("stopped: the job was stopped".into());
            }
        }
        // The command has ended, and what it left behind ends with it, as it
        // does in its own pid namespace when sealed. Forgotten now, its group
        // id cannot name another process's group at the job's end.
        self.groups.release(pgid);
        // What it has written by now is what the model gets.
        outcome.stdout = take_output(stdout, &self.how.secrets).await;
        outcome.stderr = take_output(stderr, &self.how.secrets).await;
        outcome.changed = changed_since(&before, snapshot(&workdir));
        outcome
    }

    async fn start(&self, workdir: &Path, command: &str) -> Result<Spawned, String> {
        if self.how.sealed {
            let spec = SealSpec {
                workdir: workdir.to_path_buf(),
                user: self.how.user,
                network: self.how.network,
                resources: self.how.resources,
                env: self.how.env.clone(),
                roots: self.how.roots.clone(),
                read_only: vec![],
                stdin: self.stdin.is_some(),
            };
            return seal::spawn(&spec, command)
                .await
                .map_err(|e| format!("could not start the command in its sandbox: {e}"));
        }
        let env = self.how.env.clone();
        seal::spawn_host(
            workdir,
            env,
            &self.how.resources,
            command,
            self.stdin.is_some(),
        )
        .await
        .map_err(|e| format!("could not start the command: {e}"))
    }
}

/// What a command wrote to one pipe, redacted of every secret value (I-27).
async fn take_output(task: tokio::task::JoinHandle<(Vec<u8>, bool)>, secrets: &Secrets) -> String {
    // A reader still waiting when the time is up is dropped, and so aborted.
    let task = tokio_util::task::AbortOnDropHandle::new(task);
    match tokio::time::timeout(Duration::from_millis(200), task).await {
        Ok(Ok((bytes, cut))) => {
            let text = String::from_utf8_lossy(&bytes);
            // Cut at the limit, it may end in the start of a value.
            if cut {
                secrets.redact_cut(&text)
            } else {
                secrets.redact(&text)
            }
        }
        _ => String::new(),
    }
}

/// At most `OUTPUT_LIMIT` bytes of a pipe, read to its end; and whether more was cut.
async fn read_bounded(pipe: Option<Pipe>) -> (Vec<u8>, bool) {
    let Some(mut pipe) = pipe else {
        return (vec![], false);
    };
    let mut kept = Vec::new();
    let mut cut = false;
    let mut buf = [0u8; 8192];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let room = OUTPUT_LIMIT.saturating_sub(kept.len());
                cut |= n > room;
                kept.extend_from_slice(&buf[..n.min(room)]);
            }
        }
    }
    (kept, cut)
}

type Snapshot = BTreeMap<String, (u64, Option<SystemTime>)>;

/// Size and mtime of every regular file below `root` (symlinks are not followed).
fn snapshot(root: &Path) -> Snapshot {
    let mut files = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    let mut seen = 0usize;
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            seen += 1;
            if seen > SCAN_LIMIT {
                return files;
            }
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            if meta.is_dir() {
                stack.push(entry.path());
            } else if meta.is_file()
                && let Ok(rel) = entry.path().strip_prefix(root)
            {
                files.insert(
                    rel.to_string_lossy().into_owned(),
                    (meta.len(), meta.modified().ok()),
                );
            }
        }
    }
    files
}

/// The files of `after` that are new or changed since `before`.
fn changed_since(before: &Snapshot, after: Snapshot) -> Vec<String> {
    after
        .into_iter()
        .filter(|(path, meta)| before.get(path) != Some(meta))
        .map(|(path, _)| path)
        .collect()
}

fn normalize(path: &str) -> String {
    Path::new(path)
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

/// The rlimits to set in a command's process before it execs (soft and hard
/// alike, so it cannot raise them again).
#[cfg(test)]
mod tests {
    use super::*;

    fn args(workdir: &Path, posture: Posture, runs_commands: bool) -> SandboxArgs {
        SandboxArgs {
            record: None,
            workdir: workdir.to_path_buf(),
            cancel: CancellationToken::new(),
            exec_timeout: Duration::from_secs(5),
            resources: Default::default(),
            network: arbor_protocol::Network::None,
            posture: Arc::new(posture),
            runs_commands,
            env: vec![],
            secrets: Default::default(),
            roots: Some(workdir.with_extension("roots")),
        }
    }

    /// Fail closed: where the kernel cannot seal, a job that may run
    /// commands gets no sandbox (and so does not start), with the reason;
    /// one that only reads and writes files starts.
    #[tokio::test]
    async fn a_node_that_cannot_seal_refuses_a_sandbox_for_commands() {
        let dir = tempfile::tempdir().unwrap();
        let refused = Posture {
            mode: SandboxIsolation::Sealed,
            sealed: false,
            detail: "cannot seal (no user namespaces)".into(),
        };
        let work = dir.path().join("a");
        let err = Actor::spawn(None, Sandbox, args(&work, refused.clone(), true))
            .await
            .expect_err("refused");
        assert!(err.to_string().contains("no user namespaces"), "{err}");
        assert!(!work.exists(), "nothing was made");
        let (files_only, _) = Actor::spawn(None, Sandbox, args(&work, refused, false))
            .await
            .expect("a sandbox for file tools only starts");
        files_only.stop(None);
        // Unsealed by choice: commands run, on the host.
        let (host, _) = Actor::spawn(
            None,
            Sandbox,
            args(&work, Posture::assumed(SandboxIsolation::None), true),
        )
        .await
        .unwrap();
        let outcome = ractor::call!(host, |reply| SandboxMsg::Exec {
            command: "echo $$".into(),
            timeout: None,
            reply
        })
        .unwrap();
        assert_ne!(outcome.stdout.trim(), "1", "not a namespace's init");
        host.stop(None);
    }

    /// A workdir is made when the job first uses it: a job that never
    /// touches its sandbox leaves no folder behind, and one that does finds
    /// its workdir there before its first command or file.
    #[tokio::test]
    async fn a_workdir_is_made_at_its_first_use_and_not_before() {
        let dir = tempfile::tempdir().unwrap();
        let posture = || Posture::assumed(SandboxIsolation::None);
        let unused = dir.path().join("unused");
        let (sandbox, _) = Actor::spawn(None, Sandbox, args(&unused, posture(), true))
            .await
            .unwrap();
        let listed = ractor::call!(sandbox, |reply| SandboxMsg::Artifacts { reply }).unwrap();
        assert!(listed.is_empty());
        let read = ractor::call!(sandbox, |reply| SandboxMsg::ReadFile {
            path: "notes.txt".into(),
            reply
        })
        .unwrap();
        assert!(
            read.is_err_and(|e| e.contains("notes.txt")),
            "a missing file, named"
        );
        sandbox.stop(None);
        assert!(
            !unused.exists(),
            "started, listed and read from, never made"
        );

        let by_command = dir.path().join("by-command");
        let (sandbox, _) = Actor::spawn(None, Sandbox, args(&by_command, posture(), true))
            .await
            .unwrap();
        let outcome = ractor::call!(sandbox, |reply| SandboxMsg::Exec {
            command: "pwd && echo hi > out.txt".into(),
            timeout: None,
            reply
        })
        .unwrap();
        assert_eq!(outcome.exit_code, Some(0), "{outcome:?}");
        let made = std::fs::canonicalize(&by_command).expect("made by its first command");
        assert_eq!(outcome.stdout.trim(), made.display().to_string());
        assert_eq!(outcome.changed, vec!["out.txt".to_string()]);
        sandbox.stop(None);

        let by_write = dir.path().join("by-write");
        let (sandbox, _) = Actor::spawn(None, Sandbox, args(&by_write, posture(), false))
            .await
            .unwrap();
        ractor::call!(sandbox, |reply| SandboxMsg::WriteFile {
            path: "a.txt".into(),
            content: "x".into(),
            reply
        })
        .unwrap()
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(by_write.join("a.txt")).unwrap(),
            "x"
        );
        sandbox.stop(None);
    }

    /// A command's process group is forgotten when the command ends, with
    /// what it left running in it: its id, free again, must not name
    /// another process's group when the job ends and its groups are killed.
    #[tokio::test]
    async fn an_ended_commands_group_is_killed_and_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let (sandbox, _) = Actor::spawn(
            None,
            Sandbox,
            args(
                &dir.path().join("w"),
                Posture::assumed(SandboxIsolation::None),
                true,
            ),
        )
        .await
        .unwrap();
        let outcome = ractor::call!(sandbox, |reply| SandboxMsg::Exec {
            command: "sleep 300 >/dev/null 2>&1 & echo $!".into(),
            timeout: None,
            reply
        })
        .unwrap();
        assert_eq!(outcome.exit_code, Some(0), "{outcome:?}");
        let left: i32 = outcome.stdout.trim().parse().unwrap();
        let killed = ractor::call!(sandbox, |reply| SandboxMsg::KillAll { reply }).unwrap();
        assert_eq!(killed, 0, "an ended command's group was still held");
        // Its background process went with it (as in its own pid namespace).
        let gone = || {
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(left), None).is_err()
                || std::fs::read_to_string(format!("/proc/{left}/stat")).is_ok_and(|s| {
                    s.rsplit(')')
                        .next()
                        .is_some_and(|r| r.trim_start().starts_with('Z'))
                })
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !gone() {
            assert!(
                std::time::Instant::now() < deadline,
                "process {left} outlived its command"
            );
            tokio::task::yield_now().await;
        }
        sandbox.stop(None);
    }

    /// I-27 at the output limit: a value the limit cuts in two leaves no
    /// start of itself at the end of what the model gets.
    #[tokio::test]
    async fn a_secret_cut_by_the_output_limit_is_cut_out_whole() {
        let dir = tempfile::tempdir().unwrap();
        let value = "s3cr3t-0123456789";
        let secrets = Secrets::new(BTreeMap::from([("TOKEN".to_string(), value.to_string())]));
        let mut args = args(
            &dir.path().join("w"),
            Posture::probe(SandboxIsolation::Sealed).await,
            true,
        );
        args.env = vec![("TOKEN".into(), value.into())];
        args.secrets = Arc::new(secrets);
        let (sandbox, _) = Actor::spawn(None, Sandbox, args).await.unwrap();
        // The limit falls 6 bytes into the value.
        let fill = OUTPUT_LIMIT - 6;
        let outcome = ractor::call!(sandbox, |reply| SandboxMsg::Exec {
            command: format!("head -c {fill} /dev/zero | tr '\\0' a; echo $TOKEN"),
            timeout: None,
            reply
        })
        .unwrap();
        assert_eq!(outcome.exit_code, Some(0), "{outcome:?}");
        assert_eq!(
            outcome.stdout.len(),
            fill,
            "cut to the limit, less the value's start"
        );
        assert!(outcome.stdout.bytes().all(|b| b == b'a'));
        sandbox.stop(None);
    }
}
