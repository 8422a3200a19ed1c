//! A provider's rate limits (`rpm`, `tpm`, I-65), kept the way a budget is:
//! every request reserves one request and its worst-case tokens (its prompt
//! as counted, and the `max_tokens` it asks for) from a sliding window
//! before it is sent, and its settled usage gives back the difference. No
//! span of the window's length ever holds more than the limits, because a
//! request is admitted only if the window that ends at its admission,
//! itself included, holds no more: any span's requests are in the window
//! that ends at its last admission.
//!
//! Each `[providers.NAME]` and each of its models may say `rpm` and `tpm`;
//! a request takes from its provider's window and its model's together, or
//! from neither (it holds nothing while it waits). A 429's `Retry-After`
//! closes both windows until then. The windows are the node's: every run
//! on it shares them.

mod rule;
mod shared;

pub use rule::{Limits, SKEW, SPAN, Wait, room_at};
pub use shared::{RATES, RateEntry, SharedWindows};

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// One window: what was admitted in the last `SPAN`, in order.
#[derive(Debug)]
pub struct Window {
    limits: Limits,
    /// Admitted requests, stamped when admitted and again when sent:
    /// oldest admission first.
    admitted: VecDeque<Entry>,
    /// The tokens they hold, together.
    held: u64,
    /// Closed until then (a provider's `Retry-After`).
    closed_until: Option<Instant>,
    /// Requests of this node waiting for room in it.
    waiting: u64,
}

/// One admitted request.
#[derive(Clone, Copy, Debug)]
struct Entry {
    /// When it was admitted, then when it was sent: never earlier.
    at: Instant,
    id: u64,
    tokens: u64,
    /// Sent: it leaves the window a minute (and `SKEW`) after `at`. One
    /// waiting to be sent (for a connection) has not begun its minute.
    sent: bool,
}

impl Entry {
    /// When it leaves the window, seen at `now`.
    fn leaves(&self, now: Instant) -> Instant {
        match self.sent {
            true => self.at + SPAN + SKEW,
            false => now + SPAN + SKEW,
        }
    }
}

impl Window {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            admitted: VecDeque::new(),
            held: 0,
            closed_until: None,
            waiting: 0,
        }
    }

    /// Drops the oldest requests that have left. One stamped again when it
    /// was sent may keep a few behind it a little longer: never fewer.
    fn forget(&mut self, now: Instant) {
        while let Some(front) = self.admitted.front() {
            if front.leaves(now) > now {
                break;
            }
            self.held -= front.tokens;
            self.admitted.pop_front();
        }
    }

    /// The requests still in the window at `now`.
    fn inside(&self, now: Instant) -> impl Iterator<Item = &Entry> {
        self.admitted.iter().filter(move |e| e.leaves(now) > now)
    }

    /// What it may hold.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// How much longer the provider closed it for, from `now`.
    pub fn closed_for(&self, now: Instant) -> Duration {
        self.closed_until
            .map_or(Duration::ZERO, |until| until.saturating_duration_since(now))
    }

    /// What the window ending at `now` holds: requests and tokens.
    pub fn used(&mut self, now: Instant) -> (u64, u64) {
        self.forget(now);
        self.inside(now)
            .fold((0, 0), |(n, tokens), e| (n + 1, tokens + e.tokens))
    }

    /// When a request of `tokens` could be admitted: now (Ok), or later.
    pub fn check(&mut self, now: Instant, tokens: u64) -> Result<(), Wait> {
        if let Some(tpm) = self.limits.tpm
            && tokens > tpm
        {
            return Err(Wait::TooLarge { tokens, tpm });
        }
        self.forget(now);
        let mut at = self.closed_until.filter(|until| *until > now);
        // What it holds with nothing yet left: room enough, the common case.
        let n = self.admitted.len() as u64;
        let room = self.limits.rpm.is_none_or(|rpm| n < rpm)
            && self.limits.tpm.is_none_or(|tpm| self.held + tokens <= tpm);
        if room && at.is_none() {
            return Ok(());
        }
        let leaving: Vec<(Instant, u64)> = self
            .inside(now)
            .map(|e| (e.leaves(now), e.tokens))
            .collect();
        if let Some(when) = room_at(self.limits, leaving, tokens) {
            at = Some(at.map_or(when, |a| a.max(when)));
        }
        match at {
            Some(at) if at > now => Err(Wait::Until(at)),
            _ => Ok(()),
        }
    }

    fn admit(&mut self, now: Instant, id: u64, tokens: u64) {
        self.held += tokens;
        self.admitted.push_back(Entry {
            at: now,
            id,
            tokens,
            sent: false,
        });
    }

    /// The request `id` was sent at `now`: its minute begins.
    fn sent(&mut self, id: u64, now: Instant) {
        // Found from the newest: one sent was admitted a moment ago.
        if let Some(entry) = self.admitted.iter_mut().rev().find(|e| e.id == id) {
            entry.at = entry.at.max(now);
            entry.sent = true;
        }
    }

    /// The request `id` settled at `tokens` (never more than it held).
    fn settle(&mut self, id: u64, tokens: u64) {
        if let Some(entry) = self.admitted.iter_mut().rev().find(|e| e.id == id) {
            let kept = entry.tokens.min(tokens);
            self.held -= entry.tokens - kept;
            entry.tokens = kept;
        }
    }

    /// The request `id` was never sent: it leaves now, holding nothing.
    fn withdraw(&mut self, id: u64) {
        if let Some(at) = self.admitted.iter().rposition(|e| e.id == id)
            && let Some(entry) = self.admitted.remove(at)
        {
            self.held -= entry.tokens;
        }
    }

    /// The provider said to wait until `until`.
    fn close_until(&mut self, until: Instant) {
        self.closed_until = Some(self.closed_until.map_or(until, |u| u.max(until)));
    }
}

/// The shared windows of a provider's every model, set at each start of a
/// node on a shared journal.
pub type Shared = Arc<RwLock<Option<SharedWindows>>>;

/// The windows one request takes from: its provider's and its model's,
/// and on a shared journal the same windows as every node holds them.
#[derive(Clone, Debug)]
pub struct Windows {
    provider: Option<Arc<Mutex<Window>>>,
    model: Option<Arc<Mutex<Window>>>,
    next_id: Arc<std::sync::atomic::AtomicU64>,
    /// The shared windows' names and limits: the provider's, the model's.
    keys: Vec<(String, Limits)>,
    /// Set when the node's journal is a shared one (again at each start).
    shared: Shared,
}

impl Windows {
    /// `provider`'s and `model`'s windows, named as `GET /v1/limits` names
    /// them (`NAME/*`, `NAME/MODEL`).
    pub fn new(
        provider: Option<(String, Arc<Mutex<Window>>)>,
        model: (String, Limits),
        shared: Shared,
    ) -> Self {
        let mut keys = vec![];
        if let Some((name, window)) = &provider {
            let limits = window.lock().unwrap_or_else(|e| e.into_inner()).limits;
            keys.push((name.clone(), limits));
        }
        if model.1.is_set() {
            keys.push(model.clone());
        }
        Self {
            provider: provider.map(|(_, w)| w),
            model: model
                .1
                .is_set()
                .then(|| Arc::new(Mutex::new(Window::new(model.1)))),
            next_id: Default::default(),
            keys,
            shared,
        }
    }

    /// The windows every node shares, while the journal is a shared one.
    pub fn shared(&self) -> Option<SharedWindows> {
        self.shared
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Counts a request as waiting in each window until the guard drops.
    pub fn waiting(&self) -> WaitingGuard {
        for window in self.each() {
            window.lock().unwrap_or_else(|e| e.into_inner()).waiting += 1;
        }
        WaitingGuard(self.clone())
    }

    /// Its model's own window, if it has limits of its own.
    pub fn model_window(&self) -> Option<&Arc<Mutex<Window>>> {
        self.model.as_ref()
    }

    /// Whether any limit applies.
    pub fn is_set(&self) -> bool {
        self.provider.is_some() || self.model.is_some()
    }

    fn each(&self) -> impl Iterator<Item = &Arc<Mutex<Window>>> {
        self.provider.iter().chain(self.model.iter())
    }

    /// One request of `tokens`, admitted at `now` from every window or
    /// from none: a ticket, or when to try again.
    pub fn try_admit(&self, now: Instant, tokens: u64) -> Result<Ticket, Wait> {
        // In one order, provider then model: two requests never wait on
        // each other's locks.
        let mut guards: Vec<_> = self
            .each()
            .map(|w| w.lock().unwrap_or_else(|e| e.into_inner()))
            .collect();
        let mut wait: Option<Instant> = None;
        for window in guards.iter_mut() {
            match window.check(now, tokens) {
                Ok(()) => {}
                Err(Wait::Until(at)) => wait = Some(wait.map_or(at, |w| w.max(at))),
                Err(too_large) => return Err(too_large),
            }
        }
        if let Some(at) = wait {
            return Err(Wait::Until(at));
        }
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        for window in guards.iter_mut() {
            window.admit(now, id, tokens);
        }
        Ok(Ticket {
            windows: self.clone(),
            id,
            tokens,
            sent: false,
            shared: None,
        })
    }

    /// What the windows ending now hold (provider's, model's): requests and tokens.
    pub fn used(&self, now: Instant) -> Vec<(u64, u64)> {
        self.each()
            .map(|w| w.lock().unwrap_or_else(|e| e.into_inner()).used(now))
            .collect()
    }

    /// The provider said to wait `after` (a 429's `Retry-After`).
    pub fn close_for(&self, now: Instant, after: Duration) {
        for window in self.each() {
            let mut w = window.lock().unwrap_or_else(|e| e.into_inner());
            w.close_until(now + after);
        }
        if let Some(shared) = self.shared()
            && let Err(error) = shared.close_for(&self.keys, after)
        {
            tracing::warn!(%error, "could not close the shared rate windows");
        }
    }
}

/// A request waiting for room, counted in its windows (`GET /v1/limits`).
pub struct WaitingGuard(Windows);

impl Drop for WaitingGuard {
    fn drop(&mut self) {
        for window in self.0.each() {
            let mut w = window.lock().unwrap_or_else(|e| e.into_inner());
            w.waiting = w.waiting.saturating_sub(1);
        }
    }
}

/// An admitted request's hold. Dropped before it was sent, it leaves its
/// windows; sent and unsettled, it keeps its worst case: a request whose
/// usage is unknown may have used all it asked for.
#[derive(Debug)]
pub struct Ticket {
    windows: Windows,
    id: u64,
    tokens: u64,
    sent: bool,
    /// Its entry in the shared windows, once they admitted it.
    shared: Option<RateEntry>,
}

impl Ticket {
    /// On a shared journal, one try at the windows every node shares, just
    /// before the request goes out (there, its stamp is its sending):
    /// admitted, or when to try again. Nothing to do on a node's own.
    pub async fn admit_shared(&mut self) -> Result<Result<(), Wait>, arbor_storage::Error> {
        let Some(shared) = self.windows.shared() else {
            return Ok(Ok(()));
        };
        if self.shared.is_some() {
            return Ok(Ok(()));
        }
        match shared.admit(&self.windows.keys, self.tokens).await? {
            Ok(entry) => {
                self.shared = Some(entry);
                Ok(Ok(()))
            }
            Err(wait) => Ok(Err(wait)),
        }
    }

    /// The windows it was admitted from.
    pub fn windows(&self) -> &Windows {
        &self.windows
    }

    /// The request goes out now: its minute counts from here.
    pub fn sent(&mut self, now: Instant) {
        self.sent = true;
        for window in self.windows.each() {
            let mut w = window.lock().unwrap_or_else(|e| e.into_inner());
            w.sent(self.id, now);
        }
    }

    /// The provider said its windows have no room for `after` (its limit
    /// headers): this request's windows close until then.
    pub fn close_for(&self, now: Instant, after: Duration) {
        self.windows.close_for(now, after);
    }

    /// What the request used: the rest of its hold is given back.
    pub fn settle(self, tokens: u64) {
        for window in self.windows.each() {
            let mut w = window.lock().unwrap_or_else(|e| e.into_inner());
            w.settle(self.id, tokens);
        }
        if let (Some(shared), Some(entry)) = (self.windows.shared(), &self.shared)
            && let Err(error) = shared.settle(&self.windows.keys, entry, tokens)
        {
            // It keeps its worst case until it leaves: never less than it used.
            tracing::warn!(%error, "could not settle a shared rate window");
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.sent {
            for window in self.windows.each() {
                let mut w = window.lock().unwrap_or_else(|e| e.into_inner());
                w.withdraw(self.id);
            }
        }
    }
}

/// One window as the node shows it (`GET /v1/limits`), named `model`: on
/// a shared journal, what every node's requests hold in it.
pub fn view(
    model: String,
    window: &Mutex<Window>,
    shared: Option<&SharedWindows>,
    now: Instant,
) -> arbor_protocol::RateView {
    let mut w = window.lock().unwrap_or_else(|e| e.into_inner());
    let (mut requests, mut tokens) = w.used(now);
    if let Some(shared) = shared {
        match shared.used(&model) {
            Ok(used) => (requests, tokens) = used,
            Err(error) => tracing::warn!(%error, "could not read a shared rate window"),
        }
    }
    arbor_protocol::RateView {
        waiting: w.waiting,
        model,
        rpm: w.limits.rpm,
        tpm: w.limits.tpm,
        used: arbor_protocol::RateUsed { requests, tokens },
        closed_ms: u64::try_from(w.closed_for(now).as_millis()).unwrap_or(u64::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(rpm: Option<u64>, tpm: Option<u64>) -> Limits {
        Limits { rpm, tpm }
    }

    /// Admitted and sent at `at`.
    fn send(windows: &Windows, at: Instant, tokens: u64) -> Ticket {
        let mut ticket = windows.try_admit(at, tokens).unwrap();
        ticket.sent(at);
        ticket
    }

    #[test]
    fn inv_65_no_span_of_a_minute_holds_more_requests_than_rpm() {
        let t0 = Instant::now();
        let windows = Windows::new(
            None,
            ("p/m".into(), limits(Some(3), None)),
            Default::default(),
        );
        let at = |s: u64| t0 + Duration::from_secs(s);
        for s in [0, 10, 20] {
            send(&windows, at(s), 1);
        }
        // The fourth waits until the first has left the window.
        assert_eq!(
            windows.try_admit(at(30), 1).unwrap_err(),
            Wait::Until(at(60) + SKEW)
        );
        send(&windows, at(61), 1);
        assert_eq!(
            windows.try_admit(at(62), 1).unwrap_err(),
            Wait::Until(at(70) + SKEW)
        );
        assert_eq!(windows.used(at(62)), [(3, 3)]);
    }

    #[test]
    fn inv_65_a_request_waiting_to_be_sent_has_not_begun_its_minute() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let windows = Windows::new(
            None,
            ("p/m".into(), limits(Some(1), None)),
            Default::default(),
        );
        let mut waiting = windows.try_admit(at(0), 1).unwrap();
        // Sent 90 s later (it waited for a connection): it holds the
        // window until a minute after that, not after its admission.
        assert!(windows.try_admit(at(70), 1).is_err());
        waiting.sent(at(90));
        assert_eq!(
            windows.try_admit(at(100), 1).unwrap_err(),
            Wait::Until(at(150) + SKEW)
        );
        // One dropped before it was sent leaves at once.
        let windows = Windows::new(
            None,
            ("p/m".into(), limits(Some(1), None)),
            Default::default(),
        );
        drop(windows.try_admit(at(0), 1).unwrap());
        send(&windows, at(0), 1);
    }

    #[test]
    fn inv_65_tokens_are_held_at_their_worst_and_settled_usage_gives_back_the_rest() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let windows = Windows::new(
            None,
            ("p/m".into(), limits(None, Some(1_000))),
            Default::default(),
        );
        let first = send(&windows, at(0), 600);
        assert_eq!(
            windows.try_admit(at(1), 600).unwrap_err(),
            Wait::Until(at(60) + SKEW),
            "600 + 600 would pass 1,000 in one span"
        );
        first.settle(150);
        let second = send(&windows, at(2), 600);
        drop(second); // sent, unsettled: it keeps its worst case
        assert_eq!(windows.used(at(3)), [(2, 750)]);
        assert_eq!(
            windows.try_admit(at(3), 300).unwrap_err(),
            Wait::Until(at(60) + SKEW),
            "the 150 leaves at 60, and 600 + 300 fit"
        );
        assert_eq!(
            windows.try_admit(at(3), 500).unwrap_err(),
            Wait::Until(at(62) + SKEW),
            "600 + 500 do not: the 600 must leave too, at 62"
        );
        assert_eq!(
            windows.try_admit(at(3), 5_000).unwrap_err(),
            Wait::TooLarge {
                tokens: 5_000,
                tpm: 1_000
            }
        );
    }

    #[test]
    fn inv_65_a_request_takes_from_its_provider_and_its_model_together_or_from_neither() {
        let t0 = Instant::now();
        let provider = Arc::new(Mutex::new(Window::new(limits(Some(2), None))));
        let a = Windows::new(
            Some(("p/*".into(), provider.clone())),
            ("p/a".into(), limits(None, Some(100))),
            Default::default(),
        );
        let b = Windows::new(
            Some(("p/*".into(), provider)),
            ("p/b".into(), Limits::default()),
            Default::default(),
        );
        let _first = send(&a, t0, 80);
        // The model's tokens refuse it: the provider's request is not taken.
        assert!(a.try_admit(t0, 80).is_err());
        assert_eq!(a.used(t0), [(1, 80), (1, 80)]);
        let _other = send(&b, t0, 1);
        assert_eq!(
            a.try_admit(t0, 1).unwrap_err(),
            Wait::Until(t0 + SPAN + SKEW),
            "the provider's rpm is shared by its models"
        );
    }

    #[test]
    fn a_retry_after_closes_the_window_until_then() {
        let t0 = Instant::now();
        let windows = Windows::new(
            None,
            ("p/m".into(), limits(Some(100), None)),
            Default::default(),
        );
        windows.close_for(t0, Duration::from_secs(7));
        assert_eq!(
            windows.try_admit(t0, 1).unwrap_err(),
            Wait::Until(t0 + Duration::from_secs(7))
        );
        send(&windows, t0 + Duration::from_secs(7), 1);
    }
}
