//! The agent loop that steps and jobs share: a model in a tool loop.
//!
//! It runs as a task owned by its job actor, never inside a handler, so the
//! actor serves stop, steer and status while a model call or a command runs.
//! Everything that touches the tree (delegate, collect, stop, steer) is a
//! message to the job actor; every model call is reserved with the account
//! first (I-11) and settled on the reported usage.
//!
//! Invariants:
//! 1. No model request is sent without a reservation covering its worst case.
//! 2. Steering messages enter the history only at a turn boundary (I-20).
//! 3. The wind-down notice rides on the request and never enters the history (I-12).
//! 4. A tool that panics is one error result; the loop goes on (I-38).

//!
//! Its parts (`agent_loop/`): `types` (what it is given and how it ends),
//! `prompt` (the system prompt and tools a job is shown), `model_call`
//! (one call: fitted, reserved, sent, settled, retried),
//! `tools` (every tool call, live, recorded or replayed), `grading` (what
//! an end earns, I-22). This file is the loop's control flow only.

mod grading;
mod model_call;
mod prompt;
mod repeats;
mod tools;
mod types;

pub use grading::grade;
pub(crate) use model_call::first_call;
pub use model_call::first_request;
pub use model_call::{PRESSURE_NOTICE, SUMMARY_PROMPT, settle_cut, take_in_flight};
pub use types::{
    ChildHandle, InFlight, InFlightSlot, LoopArgs, LoopEnd, LoopMsg, LoopOutcome, Made,
    WIND_DOWN_NOTICE, panic_message,
};

use crate::mcp::McpToolbox;
use crate::model::{Message, ModelReply, ToolCall};
use arbor_protocol::{ErrorClass, EventKind, TaskStatus};
pub use model_call::max_output_limit;
use model_call::{CallEnd, call_model, fit_context, tell_pressure};
pub use prompt::{
    PEERS_HEADING, Prompt, ROSTER_HEADING, RosterEntry, SKILLS_HEADING, TENANT_HEADING, roster,
};
pub use repeats::REPEAT_NOTICE;
use repeats::{Repeats, Verdict};
use std::sync::atomic::Ordering;
use tools::{Step, Tools};
use types::{clip, ended_without_answer, journal_failed, stopped};

/// Runs the loop to its end. Never panics: a panic in the model adapter is
/// caught by the caller (`Job`), a panic in a tool here.
pub async fn run(args: LoopArgs) -> LoopOutcome {
    // A model may echo what it should never have seen (a value in an
    // instruction, a guess): what the job hands on is redacted (I-27).
    let secrets = args.ctx.secrets.clone();
    let (ctx, run, held) = (args.ctx.clone(), args.run, args.held.clone());
    let mut outcome = run_turns(args).await;
    // Its end is an act outside: what it holds is told first. A journal
    // that failed here fails the job's own end too (`Job::complete`).
    let _ = held.release(&ctx, run).await;
    outcome.output = secrets.redact_json(&outcome.output);
    for note in &mut outcome.limitations {
        *note = secrets.redact(note);
    }
    if let Some((_, message)) = &mut outcome.error {
        *message = secrets.redact(message);
    }
    outcome
}

async fn run_turns(args: LoopArgs) -> LoopOutcome {
    // A bounded agent's job waits for a slot before its first turn, and
    // holds it to its end.
    let _slot = match args.ctx.slots.take(&args.agent.name, &args.cancel).await {
        Ok(slot) => slot,
        Err(()) => return stopped(0),
    };
    let toolbox = match start_mcp(&args).await {
        Ok(toolbox) => toolbox,
        Err(outcome) => return outcome,
    };
    let skills = crate::skills::listed(&args.ctx.skills, &args.agent, &args.policy);
    let prompt = Prompt::for_job(
        &args.agent,
        &args.offered,
        &args.ctx.agents,
        &skills,
        toolbox.specs(),
        args.instructions.as_deref(),
    )
    .with_peers(&args.peers);
    let mut tools = Tools::new(&args, &toolbox);
    let max_repeats = args
        .agent
        .max_repeats
        .unwrap_or(args.ctx.limits.max_repeats);
    let mut repeats = Repeats::new(max_repeats, args.tool_counts.streak.clone());
    let mut pressure_told = false;
    let mut history = vec![Message::User(args.request.clone())];
    let mut turn: u32 = 0;
    let mut last_text: Option<String> = None;
    loop {
        // A stop above cancels the token before its Stop message arrives: a
        // turn that would start, or a tool that would run, after it does not.
        if args.cancel.is_cancelled() {
            return stopped(turn);
        }
        if turn >= args.max_turns {
            let why = format!("turn cap {} reached", args.max_turns);
            return ended_without_answer(LoopEnd::TurnCap, last_text, turn, why);
        }
        if let Err(outcome) = take_steering(&args, &mut history, turn).await {
            return outcome;
        }
        let reply = match next_reply(&args, &mut history, &prompt, turn, &mut pressure_told).await {
            Ok(reply) => reply,
            Err(CallEnd::Budget(refusal, needs)) => {
                if wait_for_budget(&args, needs).await {
                    continue;
                }
                let why = refusal.to_string();
                return ended_without_answer(LoopEnd::BudgetExhausted, last_text, turn, why);
            }
            Err(CallEnd::Failed(outcome)) => return outcome,
        };
        turn += 1;
        if let Some(text) = reply.text.as_ref().filter(|t| !t.trim().is_empty()) {
            last_text = Some(text.clone());
        }
        history.push(Message::Assistant {
            text: reply.text.clone(),
            calls: reply.calls.clone(),
            thinking: reply.thinking.clone(),
        });
        if reply.calls.is_empty() {
            return final_answer(reply, turn, last_text.is_some());
        }
        for call in reply.calls {
            let answer = answer_call(&args, &mut tools, &mut repeats, &mut history, call, turn);
            if let Some(end) = answer.await {
                return end;
            }
        }
    }
}

/// The run's ceiling refused its next call and the run pauses at it
/// (I-58): the step waits for a top-up holding nothing, its wall timeout
/// paused. True once its account was extended (the turn is tried again);
/// false when it may not wait or the pause ended without (it ends as it
/// would have).
async fn wait_for_budget(args: &LoopArgs, needs: arbor_protocol::Amount) -> bool {
    let Some(payer) = &args.payer else {
        return false;
    };
    if needs == arbor_protocol::Amount::ZERO || args.cancel.is_cancelled() {
        return false;
    }
    // What it was answered on is told before it waits, maybe for hours.
    if args.held.release(&args.ctx, args.run).await.is_err() {
        return false;
    }
    let (tx, rx) = ractor::concurrency::oneshot();
    let wait = crate::parent::BudgetWait {
        job: args.id,
        account: args.account.clone(),
        needs,
        reply: tx.into(),
    };
    if payer.send_message(wait).is_err() {
        return false;
    }
    let _ = args.job.send_message(LoopMsg::Waiting(true));
    let extended = tokio::select! {
        biased;
        _ = args.cancel.cancelled() => false,
        answer = rx => answer.unwrap_or(false),
    };
    let _ = args.job.send_message(LoopMsg::Waiting(false));
    extended
}

/// Its MCP tools, listed before its first turn: a job whose tools could not
/// be listed would work blind, so it fails to start instead.
async fn start_mcp(args: &LoopArgs) -> Result<McpToolbox, LoopOutcome> {
    if !args.policy.may_use_mcp() {
        return Ok(McpToolbox::default());
    }
    // Boxed: inline, its future (about 8 KB, rmcp's start) sized this loop's,
    // which every job holds while it waits on its model.
    Box::pin(McpToolbox::for_job(&args.ctx.mcp, &args.policy))
        .await
        .map_err(|why| LoopOutcome::failed(ErrorClass::ToolsUnavailable, why, 0))
}

/// Turn boundary: steering queued since the last turn comes in now, in
/// order (I-20). Asked for only when the job has some: a message queued
/// after this look waits for the next boundary, as it would had it come a
/// moment later. A replay takes in what its recording's job took in at
/// this turn instead: when a message comes is the schedule's, and a
/// replay's is another (what comes live is left queued, and discarded at
/// the end).
async fn take_steering(
    args: &LoopArgs,
    history: &mut Vec<Message>,
    turn: u32,
) -> Result<(), LoopOutcome> {
    let replayed = args.tapes.replay.as_ref().filter(|r| r.serves_steering());
    let taken = if let Some(replay) = replayed {
        // It may wait long for its parent: nothing is held meanwhile.
        if let Err(e) = args.held.release(&args.ctx, args.run).await {
            return Err(journal_failed(e, turn));
        }
        match Box::pin(replayed_steering(args, replay, turn)).await {
            Some(taken) => taken,
            None => return Err(stopped(turn)),
        }
    } else if args.steering_queued.load(Ordering::Acquire) > 0 {
        ractor::call!(args.job, |reply| LoopMsg::TakeSteering { turn, reply })
    } else {
        Ok(vec![])
    };
    let Ok(messages) = taken else {
        let why = "the job actor is gone".to_string();
        return Err(LoopOutcome::failed(ErrorClass::Internal, why, turn));
    };
    if let Some(writer) = &args.tapes.writer {
        writer.steering(turn, &messages);
    }
    for (text, _) in messages {
        history.push(Message::User(format!("Message from your parent: {text}")));
    }
    Ok(())
}

/// The model's next reply. The prompt is measured before each call, and
/// compacted if it would not fit; a provider that still says it is too
/// long gets one more try, compacted harder.
async fn next_reply(
    args: &LoopArgs,
    history: &mut Vec<Message>,
    prompt: &Prompt,
    turn: u32,
    pressure_told: &mut bool,
) -> Result<ModelReply, CallEnd> {
    let mut harder = false;
    loop {
        // Boxed, as the settlements in `call_model` are: a job waiting on its
        // model holds this loop's future, sized by its largest await.
        let estimate = Box::pin(fit_context(args, history, prompt, turn, harder)).await?;
        // How full the window grew, measured before any compaction.
        tell_pressure(args, history, estimate, turn, pressure_told);
        match call_model(args, prompt, history, turn).await {
            Err(CallEnd::Failed(outcome))
                if !harder
                    && outcome.error.as_ref().map(|e| e.0) == Some(ErrorClass::ContextTooLong)
                    && args.model.current().info().context_window.is_some() =>
            {
                harder = true;
            }
            called => return called,
        }
    }
}

/// A reply with no tool call: a final answer, which declares completed
/// (I-22); an empty one is graded later.
fn final_answer(reply: ModelReply, turn: u32, produced: bool) -> LoopOutcome {
    LoopOutcome {
        end: LoopEnd::FinalAnswer,
        declared: Some(TaskStatus::Completed),
        output: reply
            .text
            .map(serde_json::Value::String)
            .unwrap_or(serde_json::Value::Null),
        limitations: vec![],
        error: None,
        turns: turn,
        produced,
    }
}

/// One tool call of the reply: answered, told as an event, and its result
/// put in the history; `Some` if the loop ends on it (a submission, a stop,
/// a journal that failed).
async fn answer_call(
    args: &LoopArgs,
    tools: &mut Tools<'_>,
    repeats: &mut Repeats,
    history: &mut Vec<Message>,
    call: ToolCall,
    turn: u32,
) -> Option<LoopOutcome> {
    if args.cancel.is_cancelled() {
        return Some(stopped(turn));
    }
    let notice = match repeats.see(&call) {
        Verdict::Run => None,
        Verdict::RunWithNotice(notice) => Some(notice),
        Verdict::Stuck(why) => return Some(LoopOutcome::failed(ErrorClass::NoProgress, why, turn)),
    };
    // A tool acts outside: what the last one was answered on (a child's
    // end) is durable and told first.
    if let Err(e) = args.held.release(&args.ctx, args.run).await {
        return Some(journal_failed(e, turn));
    }
    let began = std::time::Instant::now();
    let (tool, step) = tools.answer(&call, turn).await;
    let (ok, detail, mut content) = match &step {
        Step::Submit(_) => (true, "submitted".to_string(), String::new()),
        Step::Result(Ok(v)) => {
            // Text (a file, a skill, an MCP result) is given as it is, not
            // as a JSON string of escaped lines.
            let content = match v {
                serde_json::Value::String(text) => text.clone(),
                v => v.to_string(),
            };
            (true, clip(&content, 300), content)
        }
        Step::Result(Err(e)) => (false, clip(e, 300), e.clone()),
    };
    if let Some(notice) = notice {
        content.push_str("\n\n");
        content.push_str(&notice);
    }
    args.held.emit(
        &args.ctx,
        args.run,
        EventKind::ToolCalled {
            id: args.id,
            turn,
            tool,
            call: call.id.clone(),
            ok,
            detail,
            latency_ms: began.elapsed().as_millis() as u64,
            repeat: repeats.count(),
            digest: repeats.last_digest().to_string(),
        },
    );
    if let Step::Submit(submitted) = step {
        return Some(LoopOutcome {
            end: LoopEnd::Submitted,
            declared: Some(submitted.task_status.unwrap_or(TaskStatus::Completed)),
            output: submitted.output,
            limitations: submitted.limitations,
            error: None,
            turns: turn,
            produced: true,
        });
    }
    history.push(Message::ToolResult {
        call_id: call.id,
        content,
        is_error: !ok,
    });
    None
}

/// The steering a replaying job takes in at `turn`: what its recording's
/// took in then. An operator's message is the recorded text; its parent's
/// comes again from its replayed parent, so the job waits for it (a stop
/// ends the wait: None), and a parent that sees it run, as the recording's
/// did, is told the same.
async fn replayed_steering(
    args: &LoopArgs,
    replay: &crate::tape::JobReplay,
    turn: u32,
) -> Option<Result<Vec<(String, bool)>, ractor::RactorErr<LoopMsg>>> {
    let recorded = replay.steering(turn);
    let from_parent = recorded.iter().filter(|m| m.from_parent).count();
    if from_parent == 0 {
        return Some(Ok(recorded.into_iter().map(|m| (m.text, false)).collect()));
    }
    while args.steering_queued.load(Ordering::Acquire) < from_parent {
        tokio::select! {
            _ = args.steering_arrived.notified() => {}
            _ = args.cancel.cancelled() => return None,
        }
    }
    let live = match ractor::call!(args.job, |reply| LoopMsg::TakeSteering { turn, reply }) {
        Ok(live) => live,
        Err(e) => return Some(Err(e)),
    };
    let mut live = live.into_iter().filter(|(_, parent)| *parent);
    let mut messages = vec![];
    for message in recorded {
        if message.from_parent {
            messages.extend(live.next());
        } else {
            messages.push((message.text, false));
        }
    }
    Some(Ok(messages))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The size of the future `f` returns, without calling it.
    fn future_size<A, F: Future>(_: impl FnOnce(A) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// Every job holds its loop's future for its whole life, as large as
    /// the largest await in it: a rare path's await (an MCP server's start)
    /// inlined made an idle job 8 KB larger (docs/benchmarks.md, P4).
    #[test]
    fn the_loop_a_job_holds_stays_small() {
        let size = future_size(run);
        assert!(
            size <= 4096,
            "the agent loop's future is {size} bytes: box the large await"
        );
    }

    fn outcome(
        end: LoopEnd,
        declared: Option<TaskStatus>,
        output: serde_json::Value,
        produced: bool,
    ) -> LoopOutcome {
        LoopOutcome {
            end,
            declared,
            output,
            limitations: vec![],
            error: None,
            turns: 1,
            produced,
        }
    }

    fn check(case: (LoopOutcome, Option<&str>, &[&str]), expected: TaskStatus) {
        let missing: Vec<String> = case.2.iter().map(|s| s.to_string()).collect();
        let (got, _) = grade(&case.0, case.1, &missing);
        assert_eq!(got, expected, "{:?}", case.0);
    }

    #[test]
    fn inv_22_machine_checks_only_lower_what_the_agent_declared() {
        use LoopEnd::{FinalAnswer, Submitted, TurnCap};
        use TaskStatus::{Blocked, Completed, Partial};
        const FAILED: TaskStatus = TaskStatus::Failed;
        let ok = json!("answer");
        check(
            (
                outcome(Submitted, Some(Completed), ok.clone(), true),
                None,
                &[],
            ),
            Completed,
        );
        check(
            (
                outcome(Submitted, Some(Blocked), ok.clone(), true),
                None,
                &[],
            ),
            Blocked,
        );
        check(
            (
                outcome(FinalAnswer, Some(Completed), ok.clone(), true),
                None,
                &[],
            ),
            Completed,
        );
        // an empty answer fails
        check(
            (
                outcome(FinalAnswer, Some(Completed), json!(""), false),
                None,
                &[],
            ),
            FAILED,
        );
        check(
            (
                outcome(Submitted, Some(Completed), json!(null), true),
                None,
                &[],
            ),
            FAILED,
        );
        // turn cap: partial if anything was produced, else failed
        check(
            (outcome(TurnCap, None, ok.clone(), true), None, &[]),
            Partial,
        );
        check(
            (outcome(TurnCap, None, json!(null), false), None, &[]),
            FAILED,
        );
        // a schema violation fails
        check(
            (
                outcome(Submitted, Some(Completed), ok.clone(), true),
                Some("bad"),
                &[],
            ),
            FAILED,
        );
        // a missing artifact caps at partial, never raises
        check(
            (
                outcome(Submitted, Some(Completed), ok.clone(), true),
                None,
                &["r.md"],
            ),
            Partial,
        );
        check(
            (
                outcome(Submitted, Some(Blocked), ok.clone(), true),
                None,
                &["r.md"],
            ),
            Blocked,
        );
    }
}
