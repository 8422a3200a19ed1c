//! What a sealed sandbox costs: one `exec` of `true` inside it, beside a
//! bare fork and exec of `/bin/true` and the same exec in an unsealed
//! (`mode = "none"`) sandbox, and a sandbox's start and teardown; all in the
//! same process and run.
//!
//! ```sh
//! cargo bench -p arbor-tests --bench sandbox             # default sizes
//! cargo bench -p arbor-tests --bench sandbox -- --quick  # a smoke run
//! ```
//!
//! - bare fork+exec: `std::process::Command::new("/bin/true").status()`.
//! - exec, unsealed: `SandboxMsg::Exec { command: "true" }` to a Sandbox
//!   actor on the host: `/bin/sh -c true` in a process group, with the
//!   rlimits, the output pipes and the workdir scans before and after.
//! - exec, sealed: the same message to a sealed Sandbox: the same, plus
//!   hakoniwa's fork on the spawner thread, the user (or, as root, the
//!   uid drop), pid, mount, ipc, uts and network namespaces, the read-only
//!   binds and the pivot.
//! - sandbox start + teardown: spawning a Sandbox actor (its workdir made,
//!   and, as root, given to the sandbox's uid), stopping it and waiting for
//!   its exit, then removing the workdir: what each job pays before and
//!   after its first command.

use arbor_actors::sandbox::SandboxArgs;
use arbor_actors::{Sandbox, SandboxMsg};
use arbor_sandbox::seal::{Posture, SandboxIsolation};
use arbor_tests::measure::{self, Latency};
use ractor::Actor;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

struct Sizes {
    execs: usize,
    sandboxes: usize,
}

impl Sizes {
    const DEFAULT: Sizes = Sizes {
        execs: 500,
        sandboxes: 500,
    };
    const QUICK: Sizes = Sizes {
        execs: 20,
        sandboxes: 20,
    };
}

fn main() {
    let quick = measure::quick();
    let sizes = if quick { Sizes::QUICK } else { Sizes::DEFAULT };
    let (runtime, workers) = measure::runtime();
    runtime.block_on(run(sizes, quick, workers));
}

fn args(workdir: &Path, posture: &Arc<Posture>) -> SandboxArgs {
    SandboxArgs {
        record: None,
        workdir: workdir.to_path_buf(),
        cancel: CancellationToken::new(),
        exec_timeout: Duration::from_secs(30),
        resources: Default::default(),
        network: arbor_protocol::Network::None,
        posture: posture.clone(),
        runs_commands: true,
        env: vec![],
        secrets: Default::default(),
        roots: Some(workdir.with_extension("roots")),
    }
}

async fn execs(dir: &Path, posture: Posture, n: usize) -> Latency {
    let posture = Arc::new(posture);
    let (sandbox, join) = Actor::spawn(None, Sandbox, args(&dir.join("exec"), &posture))
        .await
        .expect("a sandbox");
    let mut samples = Vec::with_capacity(n);
    for i in 0..n + n / 10 {
        let start = Instant::now();
        let outcome = ractor::call!(sandbox, |reply| SandboxMsg::Exec {
            command: "true".into(),
            timeout: None,
            reply
        })
        .expect("the sandbox answers");
        let took = start.elapsed();
        assert_eq!(outcome.exit_code, Some(0), "{outcome:?}");
        // The first tenth warms up, unmeasured.
        if i >= n / 10 {
            samples.push(took);
        }
    }
    sandbox.stop(None);
    join.await.unwrap();
    Latency::of(&samples)
}

async fn run(sizes: Sizes, quick: bool, workers: usize) {
    println!(
        "arbor sandbox benchmark ({}, tokio multi-thread, {workers} workers, {})",
        if quick { "--quick" } else { "default sizes" },
        // SAFETY: geteuid cannot fail.
        if nix::unistd::geteuid().is_root() {
            "as root"
        } else {
            "not root"
        }
    );
    let dir = tempfile::tempdir().unwrap();
    let sealed = Posture::probe(SandboxIsolation::Sealed).await;
    assert!(sealed.sealed, "this machine cannot seal: {}", sealed.detail);

    let mut bare = Vec::with_capacity(sizes.execs);
    for i in 0..sizes.execs + sizes.execs / 10 {
        let start = Instant::now();
        let status = std::process::Command::new("/bin/true").status().unwrap();
        let took = start.elapsed();
        assert!(status.success());
        if i >= sizes.execs / 10 {
            bare.push(took);
        }
    }
    let bare = Latency::of(&bare);
    let host = execs(
        &dir.path().join("host"),
        Posture::assumed(SandboxIsolation::None),
        sizes.execs,
    )
    .await;
    let sealed_exec = execs(&dir.path().join("sealed"), sealed.clone(), sizes.execs).await;

    let posture = Arc::new(sealed);
    let mut lifecycle = Vec::with_capacity(sizes.sandboxes);
    for i in 0..sizes.sandboxes {
        let workdir = dir.path().join("life").join(i.to_string());
        let start = Instant::now();
        let (sandbox, join) = Actor::spawn(None, Sandbox, args(&workdir, &posture))
            .await
            .expect("a sandbox");
        sandbox.stop(None);
        join.await.unwrap();
        std::fs::remove_dir_all(&workdir).unwrap();
        lifecycle.push(start.elapsed());
    }
    let lifecycle = Latency::of(&lifecycle);

    let width = 28;
    Latency::print_header(width);
    bare.print_row("bare fork+exec /bin/true", width);
    host.print_row("exec true, unsealed", width);
    sealed_exec.print_row("exec true, sealed", width);
    lifecycle.print_row("sandbox start + teardown", width);
    println!(
        "sealed / bare: {:.1}x   sealed / unsealed: {:.1}x   unsealed / bare: {:.1}x (p50)",
        sealed_exec.p50_us / bare.p50_us,
        sealed_exec.p50_us / host.p50_us,
        host.p50_us / bare.p50_us
    );
    println!(
        "summary {}",
        serde_json::json!({
            "bench": "sandbox",
            "quick": quick,
            "bare_fork_exec": bare.json(),
            "exec_unsealed": host.json(),
            "exec_sealed": sealed_exec.json(),
            "sandbox_start_teardown": lifecycle.json(),
            "sealed_over_bare_p50": measure::round(sealed_exec.p50_us / bare.p50_us),
            "sealed_over_unsealed_p50": measure::round(sealed_exec.p50_us / host.p50_us),
        })
    );
}
