//! Children's ends appended to the journal and not yet known durable (I-29).
//!
//! A parent (a Job for its children, the Run for its steps) appends each
//! child's terminal record instead of committing it: many children that end
//! together (a stop of 10,000, 64 steps finishing at once) then share one
//! sync instead of waiting for one each, in a row. Nothing outside hears of
//! an end before it is durable: its `JobFinished` waits here, and so does
//! anything the parent would do on it (report, end the run, answer a
//! `collect` other than as below) until `is_empty`.
//!
//! A Job whose own loop waits on those ends (a `delegate` with `wait`, a
//! `collect`) does not wait for that flush: it hands the held events to the
//! loop (`hand_over`, into the job's `Held`) and answers it at once. The
//! loop's next act outside is nearly always a commit (its next model call's
//! reservation), which makes the ends durable with it, seq order being
//! durability order: one sync a delegation instead of two, in a row. Until
//! then every event of that job waits in `Held` behind them, so no watcher
//! sees the child's end, or what the loop made of it, before it is durable.

use crate::context::NodeContext;
use arbor_protocol::{EventKind, RunId};
use arbor_storage::Error;
use std::sync::{Arc, Mutex, PoisonError};

#[derive(Default)]
pub(crate) struct Ends {
    /// The held `JobFinished` events, in the order the ends were appended.
    events: Vec<EventKind>,
    /// The journal seq that covers every one of them.
    upto: u64,
    /// A task waits for a flush and will say so to the parent.
    waiting: bool,
    /// What was handed to the parent's loop: told before anything later.
    held: Held,
}

/// Events of one job held until the journal is durable up to a seq: ends
/// its Job handed over (`Ends::hand_over`), and every event of the job's
/// loop emitted after them, in order. Shared by the Job and its loop; each
/// tells them once they are durable (`release`), whichever comes first:
/// the loop before its next act outside, the Job before its own end.
#[derive(Clone, Default)]
pub struct Held(Arc<Mutex<HeldEvents>>);

#[derive(Default)]
struct HeldEvents {
    events: Vec<EventKind>,
    upto: u64,
}

impl Held {
    fn lock(&self) -> std::sync::MutexGuard<'_, HeldEvents> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn take(&self, upto: u64, events: Vec<EventKind>) {
        let mut held = self.lock();
        held.events.extend(events);
        held.upto = held.upto.max(upto);
    }

    /// Emits `kind` now, or after what is held if anything is.
    pub fn emit(&self, ctx: &NodeContext, run: RunId, kind: EventKind) {
        let mut held = self.lock();
        if held.events.is_empty() {
            drop(held);
            ctx.events.emit(run, kind);
        } else {
            held.events.push(kind);
        }
    }

    /// Tells what is held if it is durable; returns whether nothing is left.
    fn release_durable(&self, ctx: &NodeContext, run: RunId) -> bool {
        let mut held = self.lock();
        if held.events.is_empty() {
            return true;
        }
        if ctx.journal.durable_seq() < held.upto {
            return false;
        }
        // Under the lock: an event emitted meanwhile comes after these.
        for kind in std::mem::take(&mut held.events) {
            ctx.events.emit(run, kind);
        }
        true
    }

    /// Waits until what is held is durable (at once after a commit, which
    /// covers it), then tells it. A failed wait leaves it held: the journal
    /// has failed, and nothing after it will be told either.
    pub async fn release(&self, ctx: &NodeContext, run: RunId) -> Result<(), Error> {
        while !self.release_durable(ctx, run) {
            let upto = self.lock().upto;
            ctx.journal.wait_durable(upto).await?;
        }
        Ok(())
    }
}

impl Ends {
    /// An end appended at `seq`; `finished` is told once it is durable.
    pub(crate) fn push(&mut self, seq: u64, finished: EventKind) {
        self.events.push(finished);
        self.upto = self.upto.max(seq);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Tells the ends if they are durable already; otherwise, unless a wait
    /// is under way, starts one task that waits for a flush to cover them
    /// and hands its result to `tell` (which sends it to the parent, whose
    /// handler calls `waited` and then this again: more may have come).
    pub(crate) fn release(
        &mut self,
        ctx: &NodeContext,
        run: RunId,
        tell: impl FnOnce(Result<(), String>) + Send + 'static,
    ) {
        if self.events.is_empty() {
            return;
        }
        if ctx.journal.durable_seq() >= self.upto {
            self.emit(ctx, run);
        } else if !self.waiting {
            self.waiting = true;
            let journal = ctx.journal.clone();
            let upto = self.upto;
            tokio::spawn(async move {
                tell(journal.wait_durable(upto).await.map_err(|e| e.to_string()));
            });
        }
    }

    /// The parent's loop is answered on these ends before they are durable:
    /// it takes them, and tells them (`Held::release`) before it acts on
    /// them outside; its next commit makes them durable. Nothing is left to
    /// wait for here.
    pub(crate) fn hand_over(&mut self) {
        if !self.events.is_empty() {
            self.held.take(self.upto, std::mem::take(&mut self.events));
        }
    }

    /// What this parent's ends are handed to.
    pub(crate) fn held(&self) -> Held {
        self.held.clone()
    }

    /// The wait `release` started has come back.
    pub(crate) fn waited(&mut self) {
        self.waiting = false;
    }

    /// Waits here until every end is durable, and tells them.
    pub(crate) async fn settle(&mut self, ctx: &NodeContext, run: RunId) -> Result<(), Error> {
        if !self.events.is_empty() {
            ctx.journal.wait_durable(self.upto).await?;
            self.emit(ctx, run);
        }
        Ok(())
    }

    fn emit(&mut self, ctx: &NodeContext, run: RunId) {
        // Ends handed over earlier have lower seqs: durable too, told first.
        self.held.release_durable(ctx, run);
        for finished in std::mem::take(&mut self.events) {
            self.held.emit(ctx, run, finished);
        }
    }
}
