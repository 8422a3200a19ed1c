//! The parent's side of the child protocol, written once for both kinds of
//! parent: the Run, whose children are its steps, and a Job, whose children
//! are the jobs it delegated. What a parent does when a child ends is one
//! routine (`record_child_end`), so the rules it keeps are kept in one place:
//! 1. A child its parent stopped has no output, whatever it sent (I-16:
//!    `final_envelope`).
//! 2. The child's account is settled at what it spent before anything else
//!    (I-10), and the parent alone writes the child's terminal record
//!    (`Terminal`).
//! 3. The end is appended, not committed: nothing outside hears of it until
//!    a flush covers it (I-29, `Ends`), so many ends share one sync.

use crate::account::AccountMsg;
use crate::context::NodeContext;
use crate::ends::Ends;
use arbor_protocol::{
    Amount, ErrorClass, EventKind, JobId, NodeKind, ParentRef, ResultEnvelope, RunId, Status,
    TaskStatus,
};
use arbor_storage::{JobRecord, Record};
use ractor::{ActorProcessingErr, ActorRef};

/// What a child reports its end to. A Run and a Job are parents the same
/// way: each hands its children a `Parent` made from its own ref, and a
/// child never names its parent's type.
pub type Parent = ractor::DerivedActorRef<ChildReport>;

/// A child's final word to its parent.
#[derive(Clone, Debug)]
pub struct ChildReport {
    pub id: JobId,
    pub envelope: ResultEnvelope,
}

/// Why a parent stopped a child, and whether the stop came down from above
/// it (propagated) or was this parent's own decision.
#[derive(Clone, Debug, PartialEq)]
pub struct StopReason {
    pub reason: String,
    pub propagated: bool,
    /// The audit entry of the operator's call that stopped it (I-64),
    /// committed with its end.
    pub audit: Option<Record>,
}

impl StopReason {
    pub fn new(reason: impl Into<String>, propagated: bool) -> Self {
        Self {
            reason: reason.into(),
            propagated,
            audit: None,
        }
    }

    /// With the audit entry of the call that asked for it.
    pub fn with_audit(mut self, audit: Option<Record>) -> Self {
        self.audit = audit;
        self
    }
}

/// Who a child was, for its terminal record.
pub(crate) struct ChildEnd<'a> {
    pub id: JobId,
    pub run: RunId,
    pub parent: ParentRef,
    pub agent: &'a str,
    pub kind: NodeKind,
    pub depth: u32,
    pub grant_tokens: u64,
    /// Set if the parent stopped it (rule 1).
    pub stop: Option<&'a StopReason>,
}

/// A child has ended with `envelope`: rules 1 to 3, in order. Returns the
/// envelope as it stands, the one the parent goes on with.
pub(crate) async fn record_child_end(
    ctx: &NodeContext,
    account: &ActorRef<AccountMsg>,
    ended: &mut Ends,
    child: ChildEnd<'_>,
    envelope: ResultEnvelope,
) -> Result<ResultEnvelope, ActorProcessingErr> {
    let envelope = final_envelope(child.stop, envelope);
    let _ = ractor::call!(account, |reply| AccountMsg::Settle {
        child: child.id,
        spent: envelope.spent(),
        reply
    });
    let (record, finished) = Terminal {
        run: child.run,
        parent: child.parent,
        agent: child.agent,
        kind: child.kind,
        depth: child.depth,
        envelope: &envelope,
        grant: child.grant_tokens,
        propagated: child.stop.is_some_and(|stop| stop.propagated),
    }
    .record(ctx);
    let mut records = vec![record];
    records.extend(child.stop.and_then(|stop| stop.audit.clone()));
    let seq = ctx.journal.append(records)?;
    ended.push(seq, finished);
    Ok(envelope)
}

/// I-16: a child its parent stopped has no output, whatever it sent.
pub(crate) fn final_envelope(
    stop: Option<&StopReason>,
    mut envelope: ResultEnvelope,
) -> ResultEnvelope {
    if let Some(StopReason {
        reason, propagated, ..
    }) = stop
    {
        envelope.status = Status::Stopped;
        envelope.task_status = None;
        envelope.output = serde_json::Value::Null;
        envelope.error_class = None;
        envelope.error = Some(if *propagated {
            format!("{reason} (propagated)")
        } else {
            reason.clone()
        });
    }
    envelope
}

/// The envelope of a child whose actor died without reporting (I-38): failed,
/// class `panicked`, charged what its account had spent.
pub(crate) fn dead_envelope(
    id: JobId,
    label: &str,
    attempt: u32,
    agent: &str,
    error: &str,
    spent: Amount,
) -> ResultEnvelope {
    ResultEnvelope {
        label: Some(label.to_string()),
        attempt,
        task_status: Some(TaskStatus::Failed),
        error: Some(error.to_string()),
        error_class: Some(ErrorClass::Panicked),
        tokens_spent: spent.tokens,
        usd_micros_spent: spent.usd_micros,
        ..ResultEnvelope::bare(id, agent, Status::Failed)
    }
}

/// A child's end, as its parent writes it: the parent is the only writer of
/// a child's final status (shared by the Run, for steps, and Jobs, for their
/// children).
#[derive(Clone, Copy)]
pub(crate) struct Terminal<'a> {
    pub run: RunId,
    pub parent: ParentRef,
    pub agent: &'a str,
    pub kind: NodeKind,
    pub depth: u32,
    pub envelope: &'a ResultEnvelope,
    pub grant: u64,
    /// Stopped because a stop above it came down.
    pub propagated: bool,
}

impl Terminal<'_> {
    /// The terminal record and the `JobFinished` that tells of it.
    pub(crate) fn record(&self, ctx: &NodeContext) -> (Record, EventKind) {
        let Terminal {
            run,
            parent,
            agent,
            kind,
            depth,
            envelope,
            grant,
            propagated,
        } = *self;
        let reason = match envelope.status {
            Status::Done => None,
            _ => envelope.error.clone(),
        };
        let record = JobRecord {
            id: envelope.job,
            run,
            parent,
            kind,
            agent: agent.to_string(),
            label: envelope.label.clone(),
            depth,
            attempt: envelope.attempt,
            grant_tokens: grant,
            workdir: envelope.workdir.clone(),
            status: envelope.status,
            task_status: envelope.task_status,
            error_class: envelope.error_class,
            reason: reason.clone(),
            output_json: envelope.output.to_string(),
            tokens_spent: envelope.tokens_spent,
            epoch: ctx.journal.epoch(),
        };
        let finished = EventKind::job_finished(envelope.clone(), reason, propagated);
        (Record::Job(record), finished)
    }
}

/// A step's ask of its run when the run's ceiling refused its next call
/// and the run pauses at it (`on_ceiling = "pause"`, I-58): wait for a
/// top-up of at least `needs`, then its `account` is extended. The answer:
/// true once it was, false when the pause ended without (its deadline, a
/// stop, a ceiling of the step's own), and the step ends as it would have.
#[derive(Debug)]
pub struct BudgetWait {
    pub job: JobId,
    pub account: ActorRef<AccountMsg>,
    pub needs: Amount,
    pub reply: ractor::RpcReplyPort<bool>,
}

/// What a step asks to wait for budget: its run, as a `Parent` is.
pub type Payer = ractor::DerivedActorRef<BudgetWait>;
