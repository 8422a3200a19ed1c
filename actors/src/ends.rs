//! Children's ends appended to the journal and not yet known durable (I-29).
//!
//! A parent (a Job for its children, the Run for its steps) appends each
//! child's terminal record instead of committing it: many children that end
//! together (a stop of 10,000, 64 steps finishing at once) then share one
//! sync instead of waiting for one each, in a row. Nothing outside hears of
//! an end before it is durable: its `JobFinished` waits here, and so does
//! anything the parent would do on it (answer a `collect`, report, end the
//! run) until `is_empty`.

use crate::context::NodeContext;
use arbor_protocol::{EventKind, RunId};
use arbor_storage::Error;

#[derive(Default)]
pub(crate) struct Ends {
    /// The held `JobFinished` events, in the order the ends were appended.
    events: Vec<EventKind>,
    /// The journal seq that covers every one of them.
    upto: u64,
    /// A task waits for a flush and will say so to the parent.
    waiting: bool,
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
        for finished in std::mem::take(&mut self.events) {
            ctx.events.emit(run, finished);
        }
    }
}
