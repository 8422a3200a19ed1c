//! The one rule of every rate window, the node's and the shared: what a
//! window may hold, and when a request fits it.

use std::time::{Duration, Instant};

/// The windows' span: limits are per minute.
pub const SPAN: Duration = Duration::from_secs(60);

/// A request stays in its windows this much past its minute: the time it
/// may take from its stamp here to its arrival there.
pub const SKEW: Duration = Duration::from_secs(1);

/// Requests and tokens a window may hold in any span; None: no limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub rpm: Option<u64>,
    pub tpm: Option<u64>,
}

impl Limits {
    pub fn is_set(&self) -> bool {
        self.rpm.is_some() || self.tpm.is_some()
    }
}

/// Why a request cannot be admitted now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// Not before this.
    Until(Instant),
    /// Never: it asks more tokens than `tpm` allows in any span.
    TooLarge { tokens: u64, tpm: u64 },
}

/// When a request of `tokens` fits `limits` beside the requests in the
/// window, each given as when it leaves and the tokens it holds (in any
/// order): `None` if it fits now, else when the last of those it must wait
/// for leaves. The one rule of every window, the node's and the shared.
pub fn room_at<T: Ord + Copy>(
    limits: Limits,
    mut leaving: Vec<(T, u64)>,
    tokens: u64,
) -> Option<T> {
    leaving.sort_unstable();
    let mut at = None;
    if let Some(rpm) = limits.rpm {
        let n = leaving.len() as u64;
        if n >= rpm {
            // The first n - rpm + 1 to leave must have left.
            let last = usize::try_from(n - rpm).unwrap_or(usize::MAX);
            at = leaving.get(last).map(|(when, _)| *when);
        }
    }
    if let Some(tpm) = limits.tpm {
        let mut held: u64 = leaving.iter().map(|(_, t)| t).sum();
        for (when, t) in &leaving {
            if held + tokens <= tpm {
                break;
            }
            held -= t;
            at = Some(at.map_or(*when, |a: T| a.max(*when)));
        }
    }
    at
}
