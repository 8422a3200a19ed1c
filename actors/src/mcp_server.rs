//! One MCP server's connection, and its process when arbor runs it: a
//! stdio server is started as a sandbox's commands are (sealed in
//! namespaces of its own, in the job's workdir, with the job's rlimits) and
//! spoken to over its stdin and stdout; an HTTP server is reached at its
//! URL from the node, with its declared headers (`arbor_mcp`).
//!
//! Invariants:
//! 1. A server is never started through a bare process spawn: only through
//!    `seal::spawn` (or, under `[sandbox] mode = "none"`, `seal::spawn_host`),
//!    the spawner every command goes through, so it dies with its node.
//! 2. Its environment (or its headers) holds its declared secrets only
//!    (I-27): never the job's own secrets, never the node's.
//! 3. Its stderr is read as it comes (a server that logs must not block on
//!    a full pipe) and only the last `STDERR_TAIL` bytes are kept, redacted,
//!    to say why a server that failed did.

use crate::secrets::Secrets;
use arbor_mcp::McpClient;
use arbor_protocol::{HttpServer, McpServerSpec, Resources, StdioServer};
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
    pub async fn spawn(
        &self,
        spec: &McpServerSpec,
        stdio: &StdioServer,
        secrets: &Secrets,
    ) -> Result<Spawned, String> {
        let names = spec.secrets.iter().cloned().collect();
        let mut env: Vec<(String, String)> = stdio
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        env.extend(secrets.env_for(&names)?);
        // `exec`, so that the server is the process the shell was: its
        // pipes, its exit, its group.
        let words = std::iter::once(&stdio.command).chain(&stdio.args);
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
                network: stdio.network,
                resources: self.resources,
                env,
                roots: self.roots.clone(),
                read_only: stdio.read_only.clone(),
                stdin: true,
            };
            return seal::spawn(&spec, &command).await;
        }
        seal::spawn_host(&self.workdir, env, &self.resources, &command, true).await
    }
}

/// A started server, initialized: its connection, and its process when
/// arbor runs it.
pub struct LiveServer {
    pub client: Arc<McpClient>,
    /// None for an HTTP server, which runs elsewhere.
    process: Option<ServerProcess>,
}

struct ServerProcess {
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
                process: Some(ServerProcess { child, stderr }),
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

    /// Speaks `initialize` to `http`'s URL within the server's start
    /// timeout, with its headers' secrets filled in.
    pub async fn connect_http(
        http: &HttpServer,
        spec: &McpServerSpec,
        secrets: &Secrets,
    ) -> Result<Self, String> {
        let names = spec.secrets.iter().cloned().collect();
        let values: std::collections::BTreeMap<String, String> =
            secrets.env_for(&names)?.into_iter().collect();
        let headers = http.headers_with(|name| values.get(name).cloned())?;
        #[cfg(feature = "http")]
        {
            let client = McpClient::connect_http(&http.url, &headers, spec.start_timeout)
                .await
                .map_err(|e| secrets.redact(&e.to_string()))?;
            Ok(Self {
                client: Arc::new(client),
                process: None,
            })
        }
        #[cfg(not(feature = "http"))]
        {
            let _ = headers;
            Err(format!(
                "{} is an HTTP server, and this node was built without HTTP (arbor-runtime's `http` feature)",
                http.url
            ))
        }
    }

    /// The pid of its process, which leads its process group.
    pub fn pid(&self) -> Option<i32> {
        self.process.as_ref().map(|p| p.child.pid())
    }

    /// The end of what it wrote to stderr, redacted (I-27).
    pub fn stderr_tail(&self, secrets: &Secrets) -> String {
        self.process
            .as_ref()
            .map(|p| tail_text(&p.stderr, secrets))
            .unwrap_or_default()
    }

    /// Ends it: kills its process (and, sealed, everything in its
    /// namespaces), or ends its HTTP session.
    pub fn kill(&self) {
        match &self.process {
            Some(process) => process.child.kill(),
            None => self.client.close(),
        }
    }
}

fn tail_text(tail: &Mutex<Vec<u8>>, secrets: &Secrets) -> String {
    let bytes = tail.lock().unwrap_or_else(|p| p.into_inner()).clone();
    secrets.redact_cut(String::from_utf8_lossy(&bytes).trim())
}
