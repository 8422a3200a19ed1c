//! One model call, whole: its request made in one place (`call_request`),
//! its history fitted to the context window (compaction), its worst case
//! reserved before it is sent (I-11), its usage settled, a transient
//! failure retried after a backoff, and a call cut short charged what it
//! may have cost.

use super::prompt::Prompt;
use super::types::{
    InFlight, InFlightSlot, LoopArgs, LoopOutcome, WIND_DOWN_NOTICE, journal_failed, panic_message,
    stopped,
};
use crate::account::{AccountMsg, CallHold};
use crate::model::{CallMeter, Message, Model, ModelError, ModelInfo, ModelReply, ModelRequest};
use arbor_protocol::{
    AgentDef, Amount, CallFacts, ErrorClass, EventKind, JobId, Refusal, ToolName, Usage,
};
use futures::FutureExt;
use ractor::ActorRef;
use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use tracing::Instrument;

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
        event: Some(Box::new(event)),
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

pub(super) enum CallEnd {
    /// The account cannot cover the next call (I-13); what more it needs
    /// to (zero unless the job may pause for it: `LoopArgs::payer`).
    Budget(Refusal, Amount),
    /// The call failed for good, or the job is stopping.
    Failed(LoopOutcome),
}

/// The system prompt of the call that summarizes old turns (compaction step 2).
pub const SUMMARY_PROMPT: &str = "Summarize this conversation of an agent at work for the agent itself, so it can go on without it. Write exactly these sections, each under its heading: `## Goal` (what it was asked), `## Constraints` (limits and rules it works under), `## Progress` (what it did and found: names, numbers, paths, results; what failed), `## Open questions` (what is left to do or decide), `## Critical context` (anything it cannot go on without). If the transcript begins with a PREVIOUS SUMMARY, update that summary section by section: keep what still holds, add what is new, drop what is settled; do not summarize the summary. Be brief and exact.";

/// The output room a prompt must leave in the context window.
const MIN_OUTPUT_ROOM: u64 = 1024;

/// What a model is told, once a job, when its context fills.
pub const PRESSURE_NOTICE: &str = "[arbor] Your context window is {share}% full. Finish what matters most, keep what you still read short, and submit_output before it runs out; older turns will be summarized to make room.";

/// Context pressure: once a job's prompt (`estimate`, as `fit_context`
/// measured it) reaches `[limits] context_warn` of its model's window, the
/// model is told (a message in its history, so it keeps knowing) and
/// `context_pressure` is journaled. `told` keeps it to once a job.
pub(super) fn tell_pressure(
    args: &LoopArgs,
    history: &mut Vec<Message>,
    estimate: u64,
    turn: u32,
    told: &mut bool,
) {
    let Some(window) = args
        .model
        .current()
        .info()
        .context_window
        .filter(|w| *w > 0)
    else {
        return;
    };
    if *told || (estimate as f64) < args.ctx.limits.context_warn * window as f64 {
        return;
    }
    *told = true;
    let share = (estimate.saturating_mul(100) / window).min(100);
    history.push(Message::User(
        PRESSURE_NOTICE.replace("{share}", &share.to_string()),
    ));
    args.held.emit(
        &args.ctx,
        args.run,
        EventKind::ContextPressure {
            id: args.id,
            turn,
            estimate,
            window,
        },
    );
}

/// Compaction (see `compaction`): the history made to fit the model's
/// context window before a call, or the job ends with `context_too_long`.
/// `harder`: the provider refused a prompt this judged to fit, so aim for
/// half the window. Returns the prompt's estimate before any compaction,
/// how full the window grew (0 for a model of no known window).
pub(super) async fn fit_context(
    args: &LoopArgs,
    history: &mut Vec<Message>,
    prompt: &Prompt,
    turn: u32,
    harder: bool,
) -> Result<u64, CallEnd> {
    let info = args.model.current().info();
    let Some(window) = info.context_window else {
        return Ok(0);
    };
    let room = info
        .max_output_tokens
        .unwrap_or(MIN_OUTPUT_ROOM)
        .min(MIN_OUTPUT_ROOM);
    let target = if harder { window / 2 } else { window };
    let estimate = |messages: &[Message]| {
        let request = call_request(
            &args.agent,
            prompt,
            messages,
            room,
            turn,
            CallMeter::default(),
        );
        args.model.current().estimate_prompt(&request)
    };
    let before = estimate(history);
    if before + room <= target {
        return Ok(before);
    }
    let fits = |messages: &[Message]| estimate(messages) + room <= target;
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
        let summarizer = Prompt {
            system: SUMMARY_PROMPT.into(),
            tools: Arc::from([]),
        };
        let reply = call_model(args, &summarizer, &[Message::User(text)], turn).await?;
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
    if after + room <= target {
        Ok(before)
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
/// The most output a call of an agent with `settings` may be reserved
/// and ask for: its answer's cap (the model's and `[limits]`'s) and its
/// thinking budget, within the model's whole output.
pub fn max_output_limit(
    info: &ModelInfo,
    limits: &arbor_protocol::Limits,
    settings: arbor_protocol::Settings,
) -> u64 {
    let answer = info
        .max_output_tokens
        .map_or(limits.max_output_tokens, |m| {
            m.min(limits.max_output_tokens)
        });
    let whole = answer.saturating_add(info.thinking_budget(settings));
    info.max_output_tokens.map_or(whole, |m| whole.min(m))
}

/// A call's request as its reservation is planned from, made in one place
/// so that a parent planning its child's first call (`first_call`) plans
/// what the child's loop will ask.
pub(super) fn call_request(
    agent: &AgentDef,
    prompt: &Prompt,
    history: &[Message],
    max_output_limit: u64,
    turn: u32,
    meter: CallMeter,
) -> ModelRequest {
    ModelRequest {
        input_estimate: 0,
        agent: agent.name.clone(),
        system: prompt.system.to_string(),
        messages: history.to_vec(),
        tools: prompt.tools.clone(),
        max_output_tokens: max_output_limit,
        // Counted with the notice, so the bound holds whether it is sent or not.
        wind_down: Some(WIND_DOWN_NOTICE.to_string()),
        settings: agent.settings,
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
    ctx: &crate::context::NodeContext,
    skills: &[Arc<arbor_protocol::Skill>],
    request: &str,
    instructions: Option<&str>,
) -> crate::account::PlannedCall {
    let info = model.info();
    let max_output_limit = max_output_limit(&info, &ctx.limits, agent.settings);
    let prompt = Prompt::for_job(agent, offered, &ctx.agents, skills, &[], instructions);
    let history = [Message::User(request.to_string())];
    let request = call_request(
        agent,
        &prompt,
        &history,
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

/// The first request a job of `agent` sends when asked `request`, as its
/// loop makes it (`arbor prompt` shows it): no wind-down notice, and no MCP
/// tools unless `prompt` has them.
pub fn first_request(
    agent: &AgentDef,
    prompt: &Prompt,
    request: &str,
    max_output_limit: u64,
) -> ModelRequest {
    let history = [Message::User(request.to_string())];
    let mut request = call_request(
        agent,
        prompt,
        &history,
        max_output_limit,
        0,
        CallMeter::default(),
    );
    request.wind_down = None;
    request
}

/// One model call of turn `turn`, on its job's model; when that fails in a
/// way that walls its supply (after its own retries), the same call goes
/// to the next of its agent's fallbacks on another supply, reserved anew
/// at that model's window and prices (I-55), and the move is told.
pub(super) async fn call_model(
    args: &LoopArgs,
    prompt: &Prompt,
    history: &[Message],
    turn: u32,
) -> Result<ModelReply, CallEnd> {
    let mut walled: Vec<String> = vec![];
    loop {
        let (from, model) = args.model.current_named();
        // Read before the call: a replay's model is the recorded call's.
        let supply = model.info().supply;
        let result = call_on(args, &model, prompt, history, turn).await;
        let class = match &result {
            Err(CallEnd::Failed(outcome)) => outcome.error.as_ref().map(|(class, _)| *class),
            _ => None,
        };
        let Some(class) = class.filter(|c| c.walls_supply()) else {
            return result;
        };
        walled.push(supply);
        let Some((to, _)) = args.model.fall_back(&walled) else {
            return result;
        };
        tracing::warn!(run = %args.run, job = %args.id, turn, %class, from, to, "model supply walled; falling back");
        args.held.emit(
            &args.ctx,
            args.run,
            EventKind::ModelFallback {
                id: args.id,
                turn,
                from,
                to,
                class,
            },
        );
    }
}

/// One model call of turn `turn` on `model`: reserved at its worst case
/// (I-11), sent, settled on the reported usage; a transient failure is
/// retried after a backoff, each attempt reserved and settled on its own.
async fn call_on(
    args: &LoopArgs,
    model: &Arc<dyn crate::model::Model>,
    prompt: &Prompt,
    history: &[Message],
    turn: u32,
) -> Result<ModelReply, CallEnd> {
    let info = model.info();
    let max_output_limit = max_output_limit(&info, &args.ctx.limits, args.agent.settings);
    let mut retries = 0;
    loop {
        let meter = CallMeter::default();
        let mut request = call_request(
            &args.agent,
            prompt,
            history,
            max_output_limit,
            turn,
            meter.clone(),
        );
        let input_estimate = model.count_input(&request);
        request.input_estimate = input_estimate;
        let hold = reserve(args, &info, input_estimate, max_output_limit, turn).await?;
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
        let span = chat_span(args, &info, hold.max_output);
        let answer = tokio::select! {
            // A stop wins over an answer that is ready at the same time (I-16).
            biased;
            _ = args.cancel.cancelled() => {
                if let Some(call) = take_in_flight(&args.in_flight) {
                    Box::pin(settle_cut(&args.account, args.id, call, "stopped")).await;
                }
                return Err(CallEnd::Failed(stopped(turn)));
            }
            answer = AssertUnwindSafe(model.complete(request)).catch_unwind().instrument(span.clone()) => answer,
        };
        let Some(call) = take_in_flight(&args.in_flight) else {
            // The job took the call: it is stopping and settled it.
            return Err(CallEnd::Failed(stopped(turn)));
        };
        let error = match answer {
            Ok(Ok(reply)) => {
                settle_reply(args, call, &reply, &span).await;
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
        pause_before_retry(args, &info, error, retries, turn).await?;
        retries += 1;
    }
}

/// The call's worst case, held by its account (a commit); then what the
/// loop holds is durable, and told before the request goes out.
async fn reserve(
    args: &LoopArgs,
    info: &ModelInfo,
    input_estimate: u64,
    max_output_limit: u64,
    turn: u32,
) -> Result<CallHold, CallEnd> {
    let hold = match ractor::call!(args.account, |reply| AccountMsg::ReserveCall {
        input_estimate,
        max_output_limit,
        price: info.price,
        billed: info.billed,
        reply,
    }) {
        Ok(Ok(hold)) => hold,
        Ok(Err(refusal)) => {
            let needs = match &args.payer {
                Some(_) => shortfall(args, info, input_estimate, max_output_limit).await,
                None => Amount::ZERO,
            };
            return Err(CallEnd::Budget(refusal, needs));
        }
        Err(_) => {
            let why = "the account is gone".to_string();
            return Err(CallEnd::Failed(LoopOutcome::failed(
                ErrorClass::Internal,
                why,
                turn,
            )));
        }
    };
    if let Err(e) = args.held.release(&args.ctx, args.run).await {
        Box::pin(settle_with(args, hold.reserved, Amount::ZERO, None)).await;
        return Err(CallEnd::Failed(journal_failed(e, turn)));
    }
    Ok(hold)
}

/// What the call's full worst case needs beyond what its account has
/// available: the least top-up after which it goes out as asked. Zero in
/// a unit that is not short, and in all when no top-up can help (a usd
/// ceiling on a model without a price).
async fn shortfall(
    args: &LoopArgs,
    info: &ModelInfo,
    input_estimate: u64,
    max_output_limit: u64,
) -> Amount {
    let Ok((tokens, usd)) = ractor::call!(args.account, |reply| AccountMsg::Available { reply })
    else {
        return Amount::ZERO;
    };
    let usd_micros = match (usd, info.price) {
        (Some(_), None) => return Amount::ZERO,
        (Some(available), Some(price)) => price
            .micros(input_estimate, max_output_limit)
            .saturating_sub(available),
        (None, _) => 0,
    };
    Amount {
        tokens: (input_estimate + max_output_limit).saturating_sub(tokens),
        usd_micros,
    }
}

/// The call's span in its run's trace (OpenTelemetry's GenAI names).
fn chat_span(args: &LoopArgs, info: &ModelInfo, max_output: u64) -> tracing::Span {
    tracing::info_span!(
        "chat",
        otel.name = %format!("chat {}", info.model),
        gen_ai.operation.name = "chat",
        gen_ai.system = %info.provider,
        gen_ai.request.model = %info.model,
        gen_ai.request.max_tokens = max_output,
        gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        error.type = tracing::field::Empty,
        run = %args.run,
        job = %args.id,
    )
}

/// An answer's usage charged: what the provider reported (or, if it
/// reported none, the reservation, marked so), an overrun told as such.
async fn settle_reply(args: &LoopArgs, call: InFlight, reply: &ModelReply, span: &tracing::Span) {
    let (usage, estimated) = match reply.usage {
        Some(usage) => (usage, false),
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
                turn: call.turn,
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
}

/// After a failed attempt: the pause before the next one, if its class is
/// transient and retries are left; otherwise how the loop ends.
async fn pause_before_retry(
    args: &LoopArgs,
    info: &ModelInfo,
    error: ModelError,
    retries: u32,
    turn: u32,
) -> Result<(), CallEnd> {
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
        _ = tokio::time::sleep(pause) => Ok(()),
        _ = args.cancel.cancelled() => Err(CallEnd::Failed(stopped(turn))),
    }
}

pub(super) fn put_in_flight(slot: &InFlightSlot, call: InFlight) {
    *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(call);
}

pub(super) async fn settle_with(
    args: &LoopArgs,
    reserved: Amount,
    spent: Amount,
    event: Option<EventKind>,
) {
    let _ = ractor::call!(args.account, |reply| AccountMsg::SettleCall {
        reserved,
        spent,
        event: event.map(Box::new),
        reply
    });
}
