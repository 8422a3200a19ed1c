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

use crate::account::{AccountMsg, CallHold};
use crate::context::NodeContext;
use crate::mcp::{McpToolbox, result_text};
use crate::model::{
    CallMeter, Message, Model, ModelError, ModelInfo, ModelReply, ModelRequest, ToolCall, ToolSpec,
};
use crate::policy::Policy;
use crate::sandbox::{OUTPUT_LIMIT, SandboxMsg};
use crate::tape::Served;
use arbor_protocol::tools::parse_duration_arg;
use arbor_protocol::{
    AgentDef, Amount, CallFacts, CollectArgs, DelegateArgs, ErrorClass, EventKind, ExecArgs, JobId,
    ReadFileArgs, Refusal, ResultEnvelope, RunId, SendMessageArgs, StopChildArgs, SubmitOutputArgs,
    TaskStatus, ToolName, Usage, WriteFileArgs,
};
use futures::FutureExt;
use ractor::{ActorRef, RpcReplyPort};
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// The notice a model request carries once spend has crossed the wind-down share.
pub const WIND_DOWN_NOTICE: &str = "Budget notice: most of your budget is spent. Finish now: submit your best answer with submit_output, and list what is missing in limitations.";

/// What the loop asks of its job. The loop's own words: the Job wraps them
/// (`JobMsg::Loop`), so the loop names no type of the job's.
pub enum LoopMsg {
    Delegate {
        args: DelegateArgs,
        call_id: String,
        reply: RpcReplyPort<Result<Vec<ChildHandle>, Refusal>>,
    },
    Collect {
        children: Vec<String>,
        timeout: Option<Duration>,
        /// A waiting delegate call: children still running at the timeout are stopped.
        stop_on_timeout: bool,
        reply: RpcReplyPort<Result<Vec<ResultEnvelope>, Refusal>>,
    },
    StopChild {
        child: String,
        reply: RpcReplyPort<Result<String, Refusal>>,
    },
    SendMessage {
        child: String,
        text: String,
        reply: RpcReplyPort<Result<u64, Refusal>>,
    },
    /// The queued messages, each with whether its parent sent it.
    TakeSteering {
        turn: u32,
        reply: RpcReplyPort<Vec<(String, bool)>>,
    },
    /// It waits on a person's approval (true) or no longer does: the job's
    /// wall timeout is paused meanwhile (the card's deadline is its own).
    Waiting(bool),
}

/// What `delegate` returns for each child it started.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ChildHandle {
    pub label: String,
    pub id: JobId,
    pub agent: String,
    pub grant_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grant_usd_micros: Option<u64>,
}

pub struct LoopArgs {
    pub ctx: Arc<NodeContext>,
    pub run: RunId,
    pub id: JobId,
    /// The labels from the root to it (an approval card's lineage).
    pub path: Arc<[String]>,
    /// Its job, spoken to in the loop's own words (`LoopMsg`).
    pub job: ractor::DerivedActorRef<LoopMsg>,
    pub account: ActorRef<AccountMsg>,
    /// None when no tool that uses a sandbox is offered (`ToolInfo::sandbox`).
    pub sandbox: Option<ActorRef<SandboxMsg>>,
    /// How many steering messages the job holds for the next turn.
    pub steering_queued: Arc<AtomicUsize>,
    /// Woken when a message is queued.
    pub steering_arrived: Arc<tokio::sync::Notify>,
    pub model: Arc<dyn Model>,
    pub agent: Arc<AgentDef>,
    pub offered: Arc<BTreeMap<ToolName, Result<(), String>>>,
    /// Its MCP tools and its limits come from here (I-44, I-45).
    pub policy: Arc<Policy>,
    /// Calls counted against its limits before it started (a predecessor's).
    pub tool_counts: BTreeMap<String, u64>,
    pub request: String,
    pub max_turns: u32,
    pub cancel: CancellationToken,
    /// Shared with the job, which settles a call its abort cut short.
    pub in_flight: InFlightSlot,
    /// Where its recording goes, and the recording it replays.
    pub tapes: crate::tape::JobTapes,
    /// Its children's ends it was answered on before they were durable, and
    /// its events after them: told (`Held::release`) before it acts outside.
    pub held: crate::ends::Held,
}

/// How the loop ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoopEnd {
    /// The agent called submit_output.
    Submitted,
    /// A model answer with no tool call (it declares completed).
    FinalAnswer,
    TurnCap,
    /// The account could not cover the next call (I-13).
    BudgetExhausted,
    /// The model failed or the job's actor went away.
    Failed,
    /// A stop cut it short (its cancel token): the stop is the job's end.
    Stopped,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LoopOutcome {
    pub end: LoopEnd,
    pub declared: Option<TaskStatus>,
    pub output: serde_json::Value,
    pub limitations: Vec<String>,
    pub error: Option<(ErrorClass, String)>,
    pub turns: u32,
    /// The agent said something that can stand as a partial answer.
    pub produced: bool,
}

impl LoopOutcome {
    pub fn failed(class: ErrorClass, message: String, turns: u32) -> Self {
        Self {
            end: LoopEnd::Failed,
            declared: None,
            output: serde_json::Value::Null,
            limitations: vec![],
            error: Some((class, message)),
            turns,
            produced: false,
        }
    }
}

/// The journal failed while the loop waited for what it holds to be durable.
fn journal_failed(e: arbor_storage::Error, turn: u32) -> LoopOutcome {
    LoopOutcome::failed(
        ErrorClass::Internal,
        format!("the journal failed: {e}"),
        turn,
    )
}

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
    let mut history = vec![Message::User(args.request.clone())];
    // Its MCP tools are listed before its first turn: a job whose tools
    // could not be listed would work blind, so it fails to start instead.
    let toolbox = if args.policy.may_use_mcp() {
        // Boxed: inline, its future (about 8 KB, rmcp's start) sized this
        // loop's, which every job holds while it waits on its model.
        match Box::pin(McpToolbox::for_job(&args.ctx.mcp, &args.policy)).await {
            Ok(toolbox) => toolbox,
            Err(why) => return LoopOutcome::failed(ErrorClass::ToolsUnavailable, why, 0),
        }
    } else {
        McpToolbox::default()
    };
    let tools = tool_specs(&args.offered, toolbox.specs());
    let mut counts = CallCounts {
        made: args.tool_counts.clone(),
    };
    let mut turn: u32 = 0;
    let mut last_text: Option<String> = None;
    loop {
        // A stop above cancels the token before its Stop message arrives: a
        // turn that would start, or a tool that would run, after it does not.
        if args.cancel.is_cancelled() {
            return stopped(turn);
        }
        if turn >= args.max_turns {
            return ended_without_answer(
                LoopEnd::TurnCap,
                last_text,
                turn,
                format!("turn cap {} reached", args.max_turns),
            );
        }
        // Turn boundary: steering queued since the last turn comes in now,
        // in order. Asked for only when the job has some: a message queued
        // after this look waits for the next boundary, as it would had it
        // come a moment later. A replay takes in what its recording's job
        // took in at this turn instead: when a message comes is the
        // schedule's, and a replay's is another (what comes live is left
        // queued, and discarded at the end).
        let replayed = args.tapes.replay.as_ref().filter(|r| r.serves_steering());
        let taken = if let Some(replay) = replayed {
            // It may wait long for its parent: nothing is held meanwhile.
            if let Err(e) = args.held.release(&args.ctx, args.run).await {
                return journal_failed(e, turn);
            }
            match Box::pin(replayed_steering(&args, replay, turn)).await {
                Some(taken) => taken,
                None => return stopped(turn),
            }
        } else if args.steering_queued.load(Ordering::Acquire) > 0 {
            ractor::call!(args.job, |reply| LoopMsg::TakeSteering { turn, reply })
        } else {
            Ok(vec![])
        };
        match taken {
            Ok(messages) => {
                if let Some(writer) = &args.tapes.writer {
                    writer.steering(turn, &messages);
                }
                for (text, _) in messages {
                    history.push(Message::User(format!("Message from your parent: {text}")));
                }
            }
            Err(_) => {
                return LoopOutcome::failed(
                    ErrorClass::Internal,
                    "the job actor is gone".into(),
                    turn,
                );
            }
        }
        // The prompt is measured before each call, and compacted if it would
        // not fit; a provider that still says it is too long gets one more
        // try, compacted harder.
        let mut harder = false;
        let reply = loop {
            // Boxed, as the settlements in `call_model` are: a job waiting on
            // its model holds this loop's future, sized by its largest await.
            let fitted = Box::pin(fit_context(&args, &mut history, &tools, turn, harder)).await;
            let called = match fitted {
                Ok(()) => call_model(&args, &args.agent.prompt, &history, &tools, turn).await,
                Err(end) => Err(end),
            };
            match called {
                Ok(reply) => break reply,
                Err(CallEnd::Failed(outcome))
                    if !harder
                        && outcome.error.as_ref().map(|e| e.0)
                            == Some(ErrorClass::ContextTooLong)
                        && args.model.info().context_window.is_some() =>
                {
                    harder = true;
                }
                Err(CallEnd::Budget(refusal)) => {
                    return ended_without_answer(
                        LoopEnd::BudgetExhausted,
                        last_text,
                        turn,
                        refusal.to_string(),
                    );
                }
                Err(CallEnd::Failed(outcome)) => return outcome,
            }
        };
        turn += 1;
        if let Some(text) = reply.text.as_ref().filter(|t| !t.trim().is_empty()) {
            last_text = Some(text.clone());
        }
        history.push(Message::Assistant {
            text: reply.text.clone(),
            calls: reply.calls.clone(),
        });
        if reply.calls.is_empty() {
            // A final answer declares completed (I-22); an empty one is graded later.
            let output = reply
                .text
                .map(serde_json::Value::String)
                .unwrap_or(serde_json::Value::Null);
            return LoopOutcome {
                end: LoopEnd::FinalAnswer,
                declared: Some(TaskStatus::Completed),
                output,
                limitations: vec![],
                error: None,
                turns: turn,
                produced: last_text.is_some(),
            };
        }
        for call in reply.calls {
            if args.cancel.is_cancelled() {
                return stopped(turn);
            }
            // A tool acts outside: what the last one was answered on (a
            // child's end) is durable and told first.
            if let Err(e) = args.held.release(&args.ctx, args.run).await {
                return journal_failed(e, turn);
            }
            let mut tool = call.tool.clone();
            let began = std::time::Instant::now();
            let recorded = crate::tape::is_recorded_tool(
                &call.tool,
                toolbox.get(&call.tool).is_some()
                    || call.tool.starts_with(arbor_protocol::mcp::MCP_PREFIX),
            );
            let served = match &args.tapes.replay {
                Some(replay) if recorded && replay.serves_tools() => {
                    replay.tool(&call.tool, &call.args)
                }
                _ => None,
            };
            let result = match served {
                Some(Served::Result(canonical, result, files)) => {
                    tool = canonical;
                    write_files(&args, files).await;
                    Step::Result(result)
                }
                Some(Served::Diverged(why)) => Step::Result(Err(why)),
                None => AssertUnwindSafe(call_tool(&args, &call, &toolbox, &mut counts, turn))
                    .catch_unwind()
                    .await
                    .map(|(canonical, step)| {
                        tool = canonical;
                        step
                    })
                    .unwrap_or_else(|panic| {
                        Step::Result(Err(format!("the tool panicked: {}", panic_message(&panic))))
                    }),
            };
            if let (true, Some(writer), Step::Result(result)) =
                (recorded, &args.tapes.writer, &result)
            {
                let content = result.as_ref().map(|v| v.to_string()).map_err(Clone::clone);
                let files = match result {
                    Ok(value) if tool == ToolName::Exec.as_str() => {
                        changed_files(&args, value).await
                    }
                    _ => BTreeMap::new(),
                };
                writer.tool(&call.tool, &tool, &call.args, &content, files);
            }
            match result {
                Step::Submit(submitted) => {
                    args.held.emit(
                        &args.ctx,
                        args.run,
                        EventKind::ToolCalled {
                            id: args.id,
                            turn,
                            tool,
                            call: call.id.clone(),
                            ok: true,
                            detail: "submitted".into(),
                            latency_ms: began.elapsed().as_millis() as u64,
                        },
                    );
                    return LoopOutcome {
                        end: LoopEnd::Submitted,
                        declared: Some(submitted.task_status.unwrap_or(TaskStatus::Completed)),
                        output: submitted.output,
                        limitations: submitted.limitations,
                        error: None,
                        turns: turn,
                        produced: true,
                    };
                }
                Step::Result(result) => {
                    let (ok, content) = match result {
                        Ok(v) => (true, v.to_string()),
                        Err(e) => (false, e),
                    };
                    args.held.emit(
                        &args.ctx,
                        args.run,
                        EventKind::ToolCalled {
                            id: args.id,
                            turn,
                            tool,
                            call: call.id.clone(),
                            ok,
                            detail: clip(&content, 300),
                            latency_ms: began.elapsed().as_millis() as u64,
                        },
                    );
                    history.push(Message::ToolResult {
                        call_id: call.id.clone(),
                        content,
                        is_error: !ok,
                    });
                }
            }
        }
    }
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

/// The files a command changed, as text, for its recording: a replay
/// writes them again (`tape::ToolExchange::files`).
async fn changed_files(args: &LoopArgs, result: &serde_json::Value) -> BTreeMap<String, String> {
    let mut files = BTreeMap::new();
    let Some(sandbox) = &args.sandbox else {
        return files;
    };
    let changed = result["changed"].as_array().into_iter().flatten();
    for path in changed.filter_map(|p| p.as_str()) {
        let read = ractor::call!(sandbox, |reply| SandboxMsg::ReadFile {
            path: path.to_string(),
            reply
        });
        if let Ok(Ok(text)) = read {
            files.insert(path.to_string(), text);
        }
    }
    files
}

/// A recorded command's files, written again where it left them.
async fn write_files(args: &LoopArgs, files: BTreeMap<String, String>) {
    let Some(sandbox) = &args.sandbox else {
        return;
    };
    for (path, content) in files {
        let _ = ractor::call!(sandbox, |reply| SandboxMsg::WriteFile {
            path,
            content,
            reply
        });
    }
}

/// A model call in flight: what was reserved for it and what its adapter
/// has learned so far. Whoever takes it from the job's slot settles it,
/// exactly once: the loop when the call returns or is cancelled, the job
/// when it aborted the loop mid-call.
pub struct InFlight {
    /// What the call's reservation holds, in both units.
    pub reserved: Amount,
    pub input_reserved: u64,
    pub max_output: u64,
    pub wind_down: bool,
    pub turn: u32,
    pub retries: u32,
    pub started: std::time::Instant,
    pub meter: CallMeter,
    pub info: ModelInfo,
}

/// The job's handle on its loop's call in flight.
pub type InFlightSlot = Arc<Mutex<Option<InFlight>>>;

/// Takes the call in flight, if the other side has not already.
pub fn take_in_flight(slot: &InFlightSlot) -> Option<InFlight> {
    slot.lock().unwrap_or_else(|e| e.into_inner()).take()
}

/// Settles a call that was cut short (stopped, failed, or its adapter
/// panicked): nothing of its answer is kept, and it is charged what it may
/// have cost (`CallMeter::charge_when_cut`), with one `ModelCalled` event.
pub async fn settle_cut(account: &ActorRef<AccountMsg>, id: JobId, call: InFlight, outcome: &str) {
    let usage = call
        .meter
        .charge_when_cut(call.input_reserved, call.max_output);
    let estimated = usage.total() > 0;
    let event = model_called(id, &call, usage, false, estimated, outcome);
    let _ = ractor::call!(account, |reply| AccountMsg::SettleCall {
        reserved: call.reserved,
        spent: call.cost(usage),
        event: Some(event),
        reply
    });
}

impl InFlight {
    /// What `usage` costs, in both units.
    fn cost(&self, usage: Usage) -> Amount {
        Amount {
            tokens: usage.total(),
            usd_micros: self
                .info
                .price
                .map_or(0, |p| p.micros(usage.input_tokens, usage.output_tokens)),
        }
    }
}

fn model_called(
    id: JobId,
    call: &InFlight,
    usage: Usage,
    truncated: bool,
    usage_estimated: bool,
    outcome: &str,
) -> EventKind {
    let usd_micros = call.cost(usage).usd_micros;
    EventKind::ModelCalled {
        id,
        turn: call.turn,
        reserved: call.reserved.tokens,
        input_tokens: usage.input_tokens,
        output_tokens: usage.output_tokens,
        truncated,
        wind_down: call.wind_down,
        call: CallFacts {
            provider: call.info.provider.clone(),
            model: call.info.model.clone(),
            usd_micros,
            latency_ms: call.started.elapsed().as_millis() as u64,
            retries: call.retries,
            outcome: outcome.to_string(),
            usage_estimated,
        },
    }
}

enum CallEnd {
    /// The account cannot cover the next call (I-13).
    Budget(Refusal),
    /// The call failed for good, or the job is stopping.
    Failed(LoopOutcome),
}

/// One model call of turn `turn`: reserved at its worst case (I-11), sent,
/// settled on the reported usage; a transient failure is retried after a
/// backoff, each attempt reserved and settled on its own.
/// The system prompt of the call that summarizes old turns (compaction step 2).
pub const SUMMARY_PROMPT: &str = "Summarize this conversation of an agent at work for the agent itself, so it can go on without it: what it was asked, what it did and found (names, numbers, paths, results), what failed, and what is left to do. Be brief and exact.";

/// The output room a prompt must leave in the context window.
const MIN_OUTPUT_ROOM: u64 = 1024;

/// Compaction (see `compaction`): the history made to fit the model's
/// context window before a call, or the job ends with `context_too_long`.
/// `harder`: the provider refused a prompt this judged to fit, so aim for
/// half the window.
async fn fit_context(
    args: &LoopArgs,
    history: &mut Vec<Message>,
    tools: &Arc<[ToolSpec]>,
    turn: u32,
    harder: bool,
) -> Result<(), CallEnd> {
    let info = args.model.info();
    let Some(window) = info.context_window else {
        return Ok(());
    };
    let room = info
        .max_output_tokens
        .unwrap_or(MIN_OUTPUT_ROOM)
        .min(MIN_OUTPUT_ROOM);
    let target = if harder { window / 2 } else { window };
    let estimate = |messages: &[Message]| {
        args.model.estimate_prompt(&ModelRequest {
            agent: args.agent.name.clone(),
            system: args.agent.prompt.clone(),
            messages: messages.to_vec(),
            tools: tools.clone(),
            max_output_tokens: room,
            wind_down: Some(WIND_DOWN_NOTICE.to_string()),
            turn,
            meter: CallMeter::default(),
        })
    };
    let fits = |messages: &[Message]| estimate(messages) + room <= target;
    if fits(history) {
        return Ok(());
    }
    let before = estimate(history);
    let elided = crate::compaction::elide_tool_results(history, fits);
    let mut summarized = 0;
    if !fits(history)
        && let Some(span) = crate::compaction::summary_span(history, crate::compaction::KEEP_TURNS)
    {
        let mut text = crate::compaction::transcript(&history[span.clone()]);
        // The summary's own prompt must fit too: keep the transcript's end.
        let limit = (target.saturating_sub(room) as usize).saturating_mul(2);
        if text.len() > limit {
            let mut start = text.len() - limit;
            while !text.is_char_boundary(start) {
                start += 1;
            }
            text = text[start..].to_string();
        }
        let reply = call_model(
            args,
            SUMMARY_PROMPT,
            &[Message::User(text)],
            &Arc::from([]),
            turn,
        )
        .await?;
        let summary = reply.text.unwrap_or_default();
        summarized = span.len() as u32;
        crate::compaction::apply_summary(history, span, &summary);
    }
    let after = estimate(history);
    args.held.emit(
        &args.ctx,
        args.run,
        EventKind::ContextCompacted {
            id: args.id,
            turn,
            tool_results_elided: elided,
            messages_summarized: summarized,
            estimate_before: before,
            estimate_after: after,
        },
    );
    if fits(history) {
        Ok(())
    } else {
        Err(CallEnd::Failed(LoopOutcome::failed(
            ErrorClass::ContextTooLong,
            format!(
                "the prompt needs about {after} tokens, compacted, and {} leaves room for {}",
                info.model,
                target.saturating_sub(room)
            ),
            turn,
        )))
    }
}

/// The most output tokens a call to `info`'s model may ask for.
fn max_output_limit(info: &ModelInfo, limits: &arbor_protocol::Limits) -> u64 {
    info.max_output_tokens
        .map_or(limits.max_output_tokens, |m| {
            m.min(limits.max_output_tokens)
        })
}

/// What a job is shown it may call: its built-in tools, then its MCP tools.
fn tool_specs(
    offered: &BTreeMap<ToolName, Result<(), String>>,
    mcp: &[ToolSpec],
) -> Arc<[ToolSpec]> {
    offered
        .iter()
        .filter(|(_, v)| v.is_ok())
        .map(|(t, _)| ToolSpec::builtin(*t))
        .chain(mcp.iter().cloned())
        .collect()
}

/// A call's request as its reservation is planned from, made in one place
/// so that a parent planning its child's first call (`first_call`) plans
/// what the child's loop will ask.
fn call_request(
    agent: &AgentDef,
    system: &str,
    history: &[Message],
    tools: &Arc<[ToolSpec]>,
    max_output_limit: u64,
    turn: u32,
    meter: CallMeter,
) -> ModelRequest {
    ModelRequest {
        agent: agent.name.clone(),
        system: system.to_string(),
        messages: history.to_vec(),
        tools: tools.clone(),
        max_output_tokens: max_output_limit,
        // Counted with the notice, so the bound holds whether it is sent or not.
        wind_down: Some(WIND_DOWN_NOTICE.to_string()),
        turn,
        meter,
    }
}

/// What the first model call of a job of `agent` asked `request` will ask
/// its account to reserve, if the job starts as planned: no MCP tools (they
/// are listed only once it runs), no message before its first turn, a
/// prompt that fits. Its parent reserves it in the commit that admits the
/// job (`account::FirstCall`); if the job's first call differs, that hold
/// is released and the call reserved as usual.
pub(crate) fn first_call(
    model: &dyn Model,
    agent: &AgentDef,
    offered: &BTreeMap<ToolName, Result<(), String>>,
    request: &str,
    limits: &arbor_protocol::Limits,
) -> crate::account::PlannedCall {
    let info = model.info();
    let max_output_limit = max_output_limit(&info, limits);
    let tools = tool_specs(offered, &[]);
    let history = [Message::User(request.to_string())];
    let request = call_request(
        agent,
        &agent.prompt,
        &history,
        &tools,
        max_output_limit,
        0,
        CallMeter::default(),
    );
    crate::account::PlannedCall {
        input_estimate: model.count_input(&request),
        max_output_limit,
        price: info.price,
        billed: info.billed,
    }
}

async fn call_model(
    args: &LoopArgs,
    system: &str,
    history: &[Message],
    tools: &Arc<[ToolSpec]>,
    turn: u32,
) -> Result<ModelReply, CallEnd> {
    let info = args.model.info();
    let max_output_limit = max_output_limit(&info, &args.ctx.limits);
    let mut retries = 0;
    loop {
        let meter = CallMeter::default();
        let mut request = call_request(
            &args.agent,
            system,
            history,
            tools,
            max_output_limit,
            turn,
            meter.clone(),
        );
        let input_estimate = args.model.count_input(&request);
        let hold: CallHold = match ractor::call!(args.account, |reply| AccountMsg::ReserveCall {
            input_estimate,
            max_output_limit,
            price: info.price,
            billed: info.billed,
            reply,
        }) {
            Ok(Ok(hold)) => hold,
            Ok(Err(refusal)) => return Err(CallEnd::Budget(refusal)),
            Err(_) => {
                return Err(CallEnd::Failed(LoopOutcome::failed(
                    ErrorClass::Internal,
                    "the account is gone".into(),
                    turn,
                )));
            }
        };
        // The reservation was a commit, so what is held is durable now:
        // told before the request goes out.
        if let Err(e) = args.held.release(&args.ctx, args.run).await {
            Box::pin(settle_with(args, hold.reserved, Amount::ZERO, None)).await;
            return Err(CallEnd::Failed(journal_failed(e, turn)));
        }
        request.max_output_tokens = hold.max_output;
        if !hold.wind_down {
            request.wind_down = None;
        }
        put_in_flight(
            &args.in_flight,
            InFlight {
                reserved: hold.reserved,
                input_reserved: input_estimate,
                max_output: hold.max_output,
                wind_down: hold.wind_down,
                turn,
                retries,
                started: std::time::Instant::now(),
                meter,
                info: info.clone(),
            },
        );
        let span = tracing::info_span!(
            "chat",
            otel.name = %format!("chat {}", info.model),
            gen_ai.operation.name = "chat",
            gen_ai.system = %info.provider,
            gen_ai.request.model = %info.model,
            gen_ai.request.max_tokens = hold.max_output,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            error.type = tracing::field::Empty,
            run = %args.run,
            job = %args.id,
        );
        let answer = tokio::select! {
            // A stop wins over an answer that is ready at the same time (I-16).
            biased;
            _ = args.cancel.cancelled() => {
                if let Some(call) = take_in_flight(&args.in_flight) {
                    Box::pin(settle_cut(&args.account, args.id, call, "stopped")).await;
                }
                return Err(CallEnd::Failed(stopped(turn)));
            }
            answer = AssertUnwindSafe(args.model.complete(request)).catch_unwind().instrument(span.clone()) => answer,
        };
        let Some(call) = take_in_flight(&args.in_flight) else {
            // The job took the call: it is stopping and settled it.
            return Err(CallEnd::Failed(stopped(turn)));
        };
        let error = match answer {
            Ok(Ok(reply)) => {
                let (usage, estimated) = match reply.usage {
                    Some(usage) => (usage, false),
                    // No usage reported: charged the reservation, marked so.
                    None => (
                        Usage {
                            input_tokens: call.input_reserved,
                            output_tokens: call.max_output,
                        },
                        true,
                    ),
                };
                span.record("gen_ai.usage.input_tokens", usage.input_tokens);
                span.record("gen_ai.usage.output_tokens", usage.output_tokens);
                if usage.total() > call.reserved.tokens {
                    args.held.emit(
                        &args.ctx,
                        args.run,
                        EventKind::BudgetOverrun {
                            id: args.id,
                            turn,
                            reserved: call.reserved.tokens,
                            reported: usage.total(),
                        },
                    );
                }
                let event = model_called(args.id, &call, usage, reply.truncated, estimated, "ok");
                Box::pin(settle_with(
                    args,
                    call.reserved,
                    call.cost(usage),
                    Some(event),
                ))
                .await;
                return Ok(reply);
            }
            Ok(Err(error)) => error,
            Err(panic) => ModelError::new(
                ErrorClass::Panicked,
                format!("the model adapter panicked: {}", panic_message(&panic)),
            ),
        };
        span.record("error.type", error.class.as_str());
        Box::pin(settle_cut(
            &args.account,
            args.id,
            call,
            error.class.as_str(),
        ))
        .await;
        let policy = info.retry;
        if !error.class.is_transient() || retries >= policy.max_retries {
            let message = if retries > 0 {
                format!(
                    "model call failed after {} attempts: {}",
                    retries + 1,
                    error.message
                )
            } else {
                format!("model call failed: {}", error.message)
            };
            return Err(CallEnd::Failed(LoopOutcome::failed(
                error.class,
                message,
                turn,
            )));
        }
        let pause = policy.backoff(retries, error.retry_after, fastrand::f64());
        tracing::warn!(
            run = %args.run,
            job = %args.id,
            class = %error.class,
            retry = retries + 1,
            pause_ms = pause.as_millis() as u64,
            "model call failed transiently; retrying"
        );
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = args.cancel.cancelled() => {
                return Err(CallEnd::Failed(stopped(turn)));
            }
        }
        retries += 1;
    }
}

/// How a loop ends that a stop cut short; the job's own finish says why.
fn stopped(turn: u32) -> LoopOutcome {
    LoopOutcome {
        end: LoopEnd::Stopped,
        ..LoopOutcome::failed(ErrorClass::Internal, "stopped".into(), turn)
    }
}

fn put_in_flight(slot: &InFlightSlot, call: InFlight) {
    *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(call);
}

/// I-22: the task status a loop's end earns, lowered by the machine checks.
/// Pure: every rule is a row in the unit table below.
pub fn grade(
    outcome: &LoopOutcome,
    schema_error: Option<&str>,
    missing_artifacts: &[String],
) -> (TaskStatus, Vec<String>) {
    let mut notes = vec![];
    let mut status = match outcome.end {
        LoopEnd::Submitted | LoopEnd::FinalAnswer => {
            outcome.declared.unwrap_or(TaskStatus::Completed)
        }
        LoopEnd::TurnCap | LoopEnd::BudgetExhausted => {
            if outcome.produced {
                TaskStatus::Partial
            } else {
                TaskStatus::Failed
            }
        }
        LoopEnd::Failed | LoopEnd::Stopped => TaskStatus::Failed,
    };
    if matches!(outcome.end, LoopEnd::Submitted | LoopEnd::FinalAnswer) && is_empty(&outcome.output)
    {
        status = TaskStatus::Failed;
        notes.push("the answer is empty".to_string());
    }
    if let Some(error) = schema_error {
        status = TaskStatus::Failed;
        notes.push(format!("the output does not match its schema: {error}"));
    }
    if !missing_artifacts.is_empty() {
        status = status.min(TaskStatus::Partial);
        notes.push(format!(
            "required artifacts missing: {}",
            missing_artifacts.join(", ")
        ));
    }
    // I-22: the machine's checks only ever lower what the agent declared.
    debug_assert!(
        outcome.declared.is_none_or(|declared| status <= declared),
        "{status:?} is above the declared {:?}",
        outcome.declared
    );
    (status, notes)
}

fn is_empty(output: &serde_json::Value) -> bool {
    match output {
        serde_json::Value::Null => true,
        serde_json::Value::String(s) => s.trim().is_empty(),
        _ => false,
    }
}

fn ended_without_answer(
    end: LoopEnd,
    last_text: Option<String>,
    turns: u32,
    why: String,
) -> LoopOutcome {
    let produced = last_text.is_some();
    let class = match end {
        LoopEnd::BudgetExhausted => ErrorClass::BudgetExhausted,
        _ => ErrorClass::Task,
    };
    LoopOutcome {
        end,
        declared: None,
        output: last_text
            .map(serde_json::Value::String)
            .unwrap_or(serde_json::Value::Null),
        limitations: vec![why.clone()],
        error: Some((class, why)),
        turns,
        produced,
    }
}

async fn settle_with(args: &LoopArgs, reserved: Amount, spent: Amount, event: Option<EventKind>) {
    let _ = ractor::call!(args.account, |reply| AccountMsg::SettleCall {
        reserved,
        spent,
        event,
        reply
    });
}

enum Step {
    Submit(SubmitOutputArgs),
    Result(Result<serde_json::Value, String>),
}

fn parse<T: DeserializeOwned>(tool: ToolName, args: &serde_json::Value) -> Result<T, String> {
    let args = if args.is_null() {
        serde_json::Value::Object(Default::default())
    } else {
        args.clone()
    };
    serde_json::from_value(args).map_err(|e| {
        Refusal::BadArguments {
            tool: tool.to_string(),
            message: e.to_string(),
        }
        .to_string()
    })
}

/// Runs one tool call; returns the tool's canonical name (what events and
/// limits say) and what came of it.
async fn call_tool(
    args: &LoopArgs,
    call: &ToolCall,
    toolbox: &McpToolbox,
    counts: &mut CallCounts,
    turn: u32,
) -> (String, Step) {
    if let Some(entry) = toolbox.get(&call.tool) {
        let canonical = entry.canonical.clone();
        let step = Step::Result(mcp_call(args, call, entry, counts, turn).await);
        return (canonical, step);
    }
    if let Some((canonical, why)) = toolbox.refusal(&call.tool) {
        let refusal = Refusal::ToolNotOffered {
            tool: canonical.to_string(),
            why: format!(": {why}"),
        };
        return (
            canonical.to_string(),
            Step::Result(Err(refused(args, refusal))),
        );
    }
    let Ok(tool) = call.tool.parse::<ToolName>() else {
        if call.tool.starts_with(arbor_protocol::mcp::MCP_PREFIX) {
            // Named like an MCP tool this job was not given: say why it may not be.
            let refusal = Refusal::ToolNotOffered {
                tool: call.tool.clone(),
                why: ": it is not among this job's MCP tools (a shared sandbox gets only \
                      what its parent may use)"
                    .into(),
            };
            return (call.tool.clone(), Step::Result(Err(refused(args, refusal))));
        }
        return (
            call.tool.clone(),
            Step::Result(Err(format!("unknown tool {:?}", call.tool))),
        );
    };
    let named = tool.to_string();
    if let Some(Err(why)) = args.offered.get(&tool) {
        let refusal = Refusal::ToolNotOffered {
            tool: named.clone(),
            why: format!(": {why}"),
        };
        return (named, Step::Result(Err(refused(args, refusal))));
    }
    if let Err(e) = admit(args, counts, &named, &call.id, turn, false).await {
        return (named, Step::Result(Err(e)));
    }
    if args.policy.asks(&named) {
        let check: crate::approvals::ArgsCheck = Arc::new(move |a| builtin_check(tool, a));
        match ask_person(args, &named, call, check).await {
            Err(e) => return (named, Step::Result(Err(e))),
            Ok(Some(edited)) => {
                let call = ToolCall {
                    args: edited,
                    ..call.clone()
                };
                return (named, call_builtin(args, tool, &call).await);
            }
            Ok(None) => {}
        }
    }
    (named, call_builtin(args, tool, call).await)
}

/// Whether `args` are arguments the built-in `tool` accepts.
fn builtin_check(tool: ToolName, args: &serde_json::Value) -> Result<(), String> {
    match tool {
        ToolName::Delegate => parse::<DelegateArgs>(tool, args).map(|_| ()),
        ToolName::Collect => parse::<CollectArgs>(tool, args).map(|_| ()),
        ToolName::StopChild => parse::<StopChildArgs>(tool, args).map(|_| ()),
        ToolName::SendMessage => parse::<SendMessageArgs>(tool, args).map(|_| ()),
        ToolName::SubmitOutput => parse::<SubmitOutputArgs>(tool, args).map(|_| ()),
        ToolName::Exec => parse::<ExecArgs>(tool, args)
            .and_then(|a| parse_duration_arg("timeout", a.timeout.as_deref()).map(|_| ())),
        ToolName::ReadFile => parse::<ReadFileArgs>(tool, args).map(|_| ()),
        ToolName::WriteFile => parse::<WriteFileArgs>(tool, args).map(|_| ()),
    }
}

/// I-46: stages a call for a person and waits for the card's one outcome.
/// `Ok(None)` runs the call as the model asked, `Ok(Some(args))` with a
/// person's edited arguments; `Err` is what the model reads instead, and
/// the call does not run. While it waits the job holds no reservation (no
/// model call is in flight between turns) and its wall timeout is paused.
async fn ask_person(
    args: &LoopArgs,
    tool: &str,
    call: &ToolCall,
    check: crate::approvals::ArgsCheck,
) -> Result<Option<serde_json::Value>, String> {
    // A replay applies the recorded decision: the person is not asked again.
    if let Some(decided) = args
        .tapes
        .replay
        .as_ref()
        .and_then(|r| r.approval(&call.id))
    {
        return decided;
    }
    let decided = ask_gate(args, tool, call, check).await;
    // What a stop cut short is no one's decision.
    if let (Some(writer), false) = (&args.tapes.writer, args.cancel.is_cancelled()) {
        writer.approval(&call.id, tool, &decided);
    }
    decided
}

/// The gate's side of `ask_person`: the card, and its one outcome.
async fn ask_gate(
    args: &LoopArgs,
    tool: &str,
    call: &ToolCall,
    check: crate::approvals::ArgsCheck,
) -> Result<Option<serde_json::Value>, String> {
    use crate::approvals::{Answer, Ask, GateMsg};
    // Fail safe: with no gate, a call meant to wait for a person does not run.
    let Some(gate) = args.ctx.gate.get() else {
        return Err(format!(
            "{tool} needs a person's approval and this node has no approval gate, so it did not run"
        ));
    };
    let ask = Ask {
        run: args.run,
        job: args.id,
        lineage: args.path.to_vec(),
        agent: args.agent.name.clone(),
        tool: tool.to_string(),
        call: call.id.clone(),
        args: card_args(&call.args, &args.ctx.secrets),
        cancel: args.cancel.clone(),
        check,
    };
    let _ = args.job.cast(LoopMsg::Waiting(true));
    let answer = tokio::select! {
        answer = gate.call(|reply| GateMsg::Ask { ask: Box::new(ask), reply }, None) => answer,
        _ = args.cancel.cancelled() => {
            return Err("the job was stopped while the call waited for approval".into());
        }
    };
    let _ = args.job.cast(LoopMsg::Waiting(false));
    let answer = match answer {
        Ok(ractor::rpc::CallResult::Success(answer)) => answer,
        _ => Answer::Failed("the approval gate is gone, so the call did not run".into()),
    };
    // A stop after the approval still wins: nothing runs once it came.
    if args.cancel.is_cancelled() {
        return Err("the job was stopped, so the approved call did not run".into());
    }
    match answer {
        Answer::Approved { edited } => Ok(edited),
        Answer::Rejected { by, reason } => Err(format!(
            "a person ({by}) rejected this call, so it did not run: {reason}"
        )),
        Answer::Expired => Err(
            "no one decided on this call before its approval deadline, so it did not run. \
             This is not a rejection: go on without it, or ask again later"
                .into(),
        ),
        Answer::Cancelled => Err("the call's approval was cancelled, so it did not run".into()),
        Answer::Failed(why) => Err(format!("the call could not be staged for approval: {why}")),
    }
}

/// The arguments as a card shows them: every secret's value cut out, long
/// strings clipped, so a card is safe to show anyone who may decide.
fn card_args(args: &serde_json::Value, secrets: &crate::secrets::Secrets) -> serde_json::Value {
    clip_strings(secrets.redact_json(args))
}

fn clip_strings(value: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::String(s) => Value::String(clip(&s, CARD_STRING_LIMIT)),
        Value::Array(items) => Value::Array(items.into_iter().map(clip_strings).collect()),
        Value::Object(map) => {
            Value::Object(map.into_iter().map(|(k, v)| (k, clip_strings(v))).collect())
        }
        other => other,
    }
}

/// The longest string of a card's arguments, in bytes.
pub const CARD_STRING_LIMIT: usize = 2000;

/// I-45: counts the call against every limit that covers it, or refuses
/// it. A call a limit counts is durable in the journal before it runs, so
/// a restart reads the count back; with `always` (an MCP call) any call is
/// in the journal before it is sent, durable or not.
async fn admit(
    args: &LoopArgs,
    counts: &mut CallCounts,
    tool: &str,
    call_id: &str,
    turn: u32,
    always: bool,
) -> Result<(), String> {
    match counts.admit(&args.policy.limits, tool, always) {
        Err(refusal) => Err(refused(args, refusal)),
        Ok(Counted::No) => Ok(()),
        Ok(Counted::Yes { limited }) => journal_start(args, tool, call_id, turn, limited).await,
    }
}

/// Whether `CallCounts::admit` counted a call, and whether a limit did.
enum Counted {
    No,
    Yes { limited: bool },
}

/// Tells a refusal (an event) and returns the text the model reads.
fn refused(args: &LoopArgs, refusal: Refusal) -> String {
    let text = refusal.to_string();
    let tool = match &refusal {
        Refusal::ToolNotOffered { tool, .. } | Refusal::ToolLimit { tool, .. } => tool.clone(),
        _ => String::new(),
    };
    args.held.emit(
        &args.ctx,
        args.run,
        EventKind::Refused {
            id: args.id,
            tool,
            refusal,
        },
    );
    text
}

/// `ToolStarted`, in the journal before the call goes out; made durable
/// first when a limit counts the call.
async fn journal_start(
    args: &LoopArgs,
    tool: &str,
    call_id: &str,
    turn: u32,
    durable: bool,
) -> Result<(), String> {
    args.held.emit(
        &args.ctx,
        args.run,
        EventKind::ToolStarted {
            id: args.id,
            turn,
            tool: tool.to_string(),
            call: call_id.to_string(),
        },
    );
    if !durable {
        return Ok(());
    }
    args.ctx
        .journal
        .flush()
        .await
        .map_err(|e| format!("the call could not be journaled, so it was not run: {e}"))
}

/// An MCP call: arguments checked against the tool's schema, counted,
/// journaled, then sent through the job's sandbox, which owns the server.
async fn mcp_call(
    args: &LoopArgs,
    call: &ToolCall,
    entry: &crate::mcp::McpToolEntry,
    counts: &mut CallCounts,
    turn: u32,
) -> Result<serde_json::Value, String> {
    let mut arguments = entry.check(&call.args)?;
    admit(args, counts, &entry.canonical, &call.id, turn, true).await?;
    if args.policy.asks(&entry.canonical) {
        let schema = entry.clone();
        let check: crate::approvals::ArgsCheck = Arc::new(move |a| schema.check(a).map(|_| ()));
        if let Some(edited) = ask_person(args, &entry.canonical, call, check).await? {
            arguments = entry.check(&edited)?;
        }
    }
    let sandbox = sandbox_of(args)?;
    let secrets = &args.ctx.secrets;
    let outcome = ractor::call!(sandbox, |reply| SandboxMsg::McpCall {
        server: entry.server.clone(),
        tool: entry.own.clone(),
        arguments,
        traceparent: args.id.call_traceparent(args.run, &call.id),
        reply
    })
    .map_err(|e| format!("the sandbox is gone: {e}"))?
    .map_err(|e| secrets.redact(&e.to_string()))?;
    let text = result_text(&outcome, secrets, OUTPUT_LIMIT);
    if outcome.is_error {
        Err(text)
    } else {
        Ok(serde_json::Value::String(text))
    }
}

/// The calls one job attempt has made that its limits count (I-45), by
/// canonical tool name.
struct CallCounts {
    made: BTreeMap<String, u64>,
}

impl CallCounts {
    /// Counts a call of `tool` if every limit that covers it has room (and,
    /// with `always`, even if none covers it), else the refusal. What is
    /// counted is what the journal's `ToolStarted` events say, so a restart
    /// counts the same.
    fn admit(
        &mut self,
        limits: &arbor_protocol::ToolLimits,
        tool: &str,
        always: bool,
    ) -> Result<Counted, Refusal> {
        let mut limited = false;
        for (key, most) in limits.covering(tool) {
            let made = self.made_under(key);
            if made >= most {
                return Err(Refusal::ToolLimit {
                    tool: tool.to_string(),
                    limit: key.to_string(),
                    most,
                    made,
                });
            }
            limited = true;
        }
        if !(limited || always) {
            return Ok(Counted::No);
        }
        *self.made.entry(tool.to_string()).or_default() += 1;
        Ok(Counted::Yes { limited })
    }

    /// The calls made that `key` covers.
    fn made_under(&self, key: &str) -> u64 {
        self.made
            .iter()
            .filter(|(tool, _)| {
                key == arbor_protocol::mcp::ALL_CALLS
                    || arbor_protocol::mcp::name_matches(key, tool)
            })
            .map(|(_, n)| n)
            .sum()
    }
}

/// A built-in tool's call, offered and admitted.
async fn call_builtin(args: &LoopArgs, tool: ToolName, call: &ToolCall) -> Step {
    let result = match tool {
        ToolName::SubmitOutput => match parse::<SubmitOutputArgs>(tool, &call.args) {
            Ok(submitted) => return Step::Submit(submitted),
            Err(e) => Err(e),
        },
        ToolName::Delegate => delegate(args, &call.id, &call.args).await,
        ToolName::Collect => collect(args, &call.args).await,
        ToolName::StopChild => match parse::<StopChildArgs>(tool, &call.args) {
            Ok(a) => actor_call(&args.job, |reply| LoopMsg::StopChild {
                child: a.child,
                reply,
            })
            .await
            .map(serde_json::Value::String),
            Err(e) => Err(e),
        },
        ToolName::SendMessage => match parse::<SendMessageArgs>(tool, &call.args) {
            Ok(a) => actor_call(&args.job, |reply| LoopMsg::SendMessage {
                child: a.child,
                text: a.message,
                reply,
            })
            .await
            .map(|id| serde_json::json!({ "queued": true, "message_id": id })),
            Err(e) => Err(e),
        },
        ToolName::Exec => match (parse::<ExecArgs>(tool, &call.args), sandbox_of(args)) {
            (Ok(a), Ok(sandbox)) => match parse_duration_arg("timeout", a.timeout.as_deref()) {
                Ok(timeout) => ractor::call!(sandbox, |reply| SandboxMsg::Exec {
                    command: a.command,
                    timeout,
                    reply
                })
                .map_err(|e| format!("the sandbox is gone: {e}"))
                .and_then(|outcome| {
                    let value = serde_json::to_value(&outcome).unwrap_or_default();
                    match outcome.error {
                        Some(e) if outcome.exit_code.is_none() => Err(format!("{e}; {value}")),
                        _ => Ok(value),
                    }
                }),
                Err(e) => Err(e),
            },
            (Err(e), _) | (_, Err(e)) => Err(e),
        },
        ToolName::ReadFile => match (parse::<ReadFileArgs>(tool, &call.args), sandbox_of(args)) {
            (Ok(a), Ok(sandbox)) => ractor::call!(sandbox, |reply| SandboxMsg::ReadFile {
                path: a.path,
                reply
            })
            .map_err(|e| format!("the sandbox is gone: {e}"))
            .and_then(|r| r.map(serde_json::Value::String)),
            (Err(e), _) | (_, Err(e)) => Err(e),
        },
        ToolName::WriteFile => match (parse::<WriteFileArgs>(tool, &call.args), sandbox_of(args)) {
            (Ok(a), Ok(sandbox)) => {
                let path = a.path.clone();
                ractor::call!(sandbox, |reply| SandboxMsg::WriteFile {
                    path: a.path,
                    content: a.content,
                    reply
                })
                .map_err(|e| format!("the sandbox is gone: {e}"))
                .and_then(|r| r.map(|_| serde_json::json!({ "written": path })))
            }
            (Err(e), _) | (_, Err(e)) => Err(e),
        },
    };
    Step::Result(result)
}

/// The job's Sandbox. A job has one whenever a tool that uses it is
/// offered, and only such a tool gets here; were it missing, the call fails
/// as a tool error, never the loop.
fn sandbox_of(args: &LoopArgs) -> Result<&ActorRef<SandboxMsg>, String> {
    args.sandbox
        .as_ref()
        .ok_or_else(|| "this job has no sandbox".to_string())
}

async fn delegate(
    args: &LoopArgs,
    call_id: &str,
    raw: &serde_json::Value,
) -> Result<serde_json::Value, String> {
    let delegate: DelegateArgs = parse(ToolName::Delegate, raw)?;
    let timeout = parse_duration_arg("timeout", delegate.timeout.as_deref())?;
    let wait = delegate.wait;
    let handles = actor_call(&args.job, |reply| LoopMsg::Delegate {
        args: delegate,
        call_id: call_id.to_string(),
        reply,
    })
    .await?;
    if !wait {
        return Ok(serde_json::to_value(&handles).unwrap_or_default());
    }
    let labels = handles.iter().map(|h| h.label.clone()).collect();
    let results = actor_call(&args.job, |reply| LoopMsg::Collect {
        children: labels,
        timeout,
        stop_on_timeout: true,
        reply,
    })
    .await?;
    Ok(serde_json::to_value(&results).unwrap_or_default())
}

async fn collect(args: &LoopArgs, raw: &serde_json::Value) -> Result<serde_json::Value, String> {
    let collect: CollectArgs = parse(ToolName::Collect, raw)?;
    let timeout = parse_duration_arg("timeout", collect.timeout.as_deref())?;
    let results = actor_call(&args.job, |reply| LoopMsg::Collect {
        children: collect.children,
        timeout,
        stop_on_timeout: false,
        reply,
    })
    .await?;
    Ok(serde_json::to_value(&results).unwrap_or_default())
}

/// Calls the job actor; a refusal or a gone actor becomes the tool's error text.
async fn actor_call<T: Send + 'static>(
    job: &ractor::DerivedActorRef<LoopMsg>,
    msg: impl FnOnce(RpcReplyPort<Result<T, Refusal>>) -> LoopMsg,
) -> Result<T, String> {
    match job.call(msg, None).await {
        Ok(ractor::rpc::CallResult::Success(Ok(v))) => Ok(v),
        Ok(ractor::rpc::CallResult::Success(Err(refusal))) => Err(refusal.to_string()),
        Ok(_) => Err("the job did not answer".into()),
        Err(e) => Err(format!("the job actor is gone: {e}")),
    }
}

pub fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".into()
    }
}

fn clip(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
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
