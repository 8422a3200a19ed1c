//! What both benchmark binaries share: how a run picks its sizes, the
//! runtime it runs on, and the process CPU clock.

use std::time::Duration;

/// `cargo bench` passes `--bench` (and a filter, if given); `cargo test
/// --all-targets` runs a bench binary without it, and gets the smoke run, as
/// criterion does. `--quick` asks for the smoke run; anything else is ignored.
pub fn quick() -> bool {
    let args: Vec<String> = std::env::args().skip(1).collect();
    args.iter().any(|a| a == "--quick") || !args.iter().any(|a| a == "--bench")
}

/// A multi-thread tokio runtime, one worker per core, and its worker count.
pub fn runtime() -> (tokio::runtime::Runtime, usize) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let workers = runtime.metrics().num_workers();
    (runtime, workers)
}

/// CPU time this process has used, user and system, on every thread: the
/// tokio workers, the journal's flusher and sled's own I/O threads.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu {
    pub user: Duration,
    pub system: Duration,
}

impl Cpu {
    pub fn now() -> Cpu {
        let mut usage = std::mem::MaybeUninit::<libc::rusage>::uninit();
        // SAFETY: getrusage writes a whole rusage to the pointer it is given,
        // which points at one; it is read only if the call succeeded.
        let usage = unsafe {
            assert_eq!(libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()), 0);
            usage.assume_init()
        };
        let of = |t: libc::timeval| {
            Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
        };
        Cpu {
            user: of(usage.ru_utime),
            system: of(usage.ru_stime),
        }
    }

    pub fn since(self, before: Cpu) -> Cpu {
        Cpu {
            user: self.user - before.user,
            system: self.system - before.system,
        }
    }

    pub fn total(self) -> Duration {
        self.user + self.system
    }
}
