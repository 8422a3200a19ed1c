//! One MCP server's process and its connection: started as a sandbox's
//! commands are (sealed in namespaces of its own, in the job's workdir, with
//! the job's rlimits), and spoken to over its stdin and stdout (`arbor_mcp`).
//!
//! Invariants:
//! 1. A server is never started through a bare process spawn: only through
//!    `seal::spawn` (or, under `[sandbox] mode = "none"`, `seal::spawn_host`),
//!    the spawner every command goes through, so it dies with its node.
//! 2. Its environment is the allowlist, its declared `env` and its declared
//!    secrets (I-27): never the job's own secrets, never the node's.
//! 3. Its stderr is read as it comes (a server that logs must not block on
//!    a full pipe) and only the last `STDERR_TAIL` bytes are kept, redacted,
//!    to say why a server that failed did.

use crate::secrets::Secrets;
use arbor_mcp::McpClient;
use arbor_protocol::{McpServerSpec, Resources};
use arbor_sandbox::seal::{self, SandboxUser, SealSpec, Spawned};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::io::AsyncReadExt;

/// The most of a server's stderr kept to explain its failure.
const STDERR_TAIL: usize = 2048;

/// Where and how a server's process runs.
pub struct ServerLaunch {
    pub workdir: PathBuf,
    /// Sealed in namespaces; else a process group on the host (`mode = "none"`).
    pub sealed: bool,
    /// Who it runs as, on a root node.
    pub user: Option<SandboxUser>,
    pub resources: Resources,
    pub roots: Option<PathBuf>,
}

impl ServerLaunch {
    /// Starts `spec`'s process with `secrets`' values of its declared
    /// secrets; its pipes are left for `LiveServer::connect`.
    pub async fn spawn(&self, spec: &McpServerSpec, secrets: &Secrets) -> Result<Spawned, String> {
        let names = spec.secrets.iter().cloned().collect();
        let mut env: Vec<(String, String)> = spec
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        env.extend(secrets.env_for(&names)?);
        // `exec`, so that the server is the process the shell was: its
        // pipes, its exit, its group.
        let words = std::iter::once(&spec.command).chain(&spec.args);
        let quoted: Result<Vec<String>, _> = words
            .map(|w| shlex::try_quote(w).map(|q| q.into_owned()))
            .collect();
        let command = format!(
            "exec {}",
            quoted
                .map_err(|_| "the server's command holds a NUL byte")?
                .join(" ")
        );
        if self.sealed {
            let spec = SealSpec {
                workdir: self.workdir.clone(),
                user: self.user,
                network: spec.network,
                resources: self.resources,
                env,
                roots: self.roots.clone(),
                read_only: spec.read_only.clone(),
                stdin: true,
            };
            return seal::spawn(&spec, &command).await;
        }
        let mut host_env = vec![
            (
                "PATH".to_string(),
                "/usr/local/bin:/usr/bin:/bin".to_string(),
            ),
            ("HOME".into(), self.workdir.display().to_string()),
            ("LANG".into(), "C.UTF-8".into()),
        ];
        host_env.extend(env);
        seal::spawn_host(&self.workdir, host_env, &self.resources, &command, true).await
    }
}

/// A started server, initialized: its connection and its process.
pub struct LiveServer {
    pub client: Arc<McpClient>,
    /// Killed when this is dropped (`Spawned`'s own drop).
    child: Spawned,
    stderr: Arc<Mutex<Vec<u8>>>,
}

impl LiveServer {
    /// Speaks `initialize` over `child`'s pipes within the server's start
    /// timeout. On failure the process is killed and the error says why,
    /// with what it wrote to stderr.
    pub async fn connect(
        mut child: Spawned,
        spec: &McpServerSpec,
        secrets: &Secrets,
    ) -> Result<Self, String> {
        let stderr = Arc::new(Mutex::new(Vec::new()));
        if let Some(mut pipe) = child.stderr.take() {
            let tail = stderr.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = pipe.read(&mut buf).await {
                    let mut tail = tail.lock().unwrap_or_else(|p| p.into_inner());
                    tail.extend_from_slice(&buf[..n]);
                    let excess = tail.len().saturating_sub(STDERR_TAIL);
                    tail.drain(..excess);
                }
            });
        }
        let (Some(stdout), Some(stdin)) = (child.stdout.take(), child.stdin.take()) else {
            child.kill();
            return Err("the server's pipes were not made".into());
        };
        match McpClient::connect(stdout, stdin, spec.start_timeout).await {
            Ok(client) => Ok(Self {
                client: Arc::new(client),
                child,
                stderr,
            }),
            Err(e) => {
                child.kill();
                // What it said before it failed is the best clue; it has
                // had the start timeout to say it.
                let said = tail_text(&stderr, secrets);
                Err(if said.is_empty() {
                    e.to_string()
                } else {
                    format!("{e}; its stderr ends: {said}")
                })
            }
        }
    }

    /// The pid of its process, which leads its process group.
    pub fn pid(&self) -> i32 {
        self.child.pid()
    }

    /// The end of what it wrote to stderr, redacted (I-27).
    pub fn stderr_tail(&self, secrets: &Secrets) -> String {
        tail_text(&self.stderr, secrets)
    }

    /// Kills its process (and, sealed, everything in its namespaces).
    pub fn kill(&self) {
        self.child.kill();
    }
}

fn tail_text(tail: &Mutex<Vec<u8>>, secrets: &Secrets) -> String {
    let bytes = tail.lock().unwrap_or_else(|p| p.into_inner()).clone();
    secrets.redact_cut(String::from_utf8_lossy(&bytes).trim())
}
