//! The tools a job calls: built-in ones (delegation through the job
//! actor, files and commands through the sandbox), MCP ones, each admitted
//! against its limits (I-45) and, where the policy asks, staged for a
//! person (I-46). `Tools` answers every call the loop makes, whatever
//! answers it: run live, served from the recording a replay follows, or
//! run and kept for the recording a recorded run makes (I-49).

use super::types::{LoopArgs, LoopMsg, clip, panic_message};
use crate::mcp::{McpToolbox, result_text};
use crate::model::ToolCall;
use crate::policy::Gating;
use crate::sandbox::{OUTPUT_LIMIT, SandboxMsg};
use crate::tape::Served;
use arbor_protocol::tools::parse_duration_arg;
use arbor_protocol::{
    CollectArgs, DelegateArgs, EventKind, ExecArgs, ReadFileArgs, ReadSkillArgs, Refusal,
    SendMessageArgs, StopChildArgs, SubmitOutputArgs, ToolName, WriteFileArgs,
};
use futures::FutureExt;
use ractor::{ActorRef, RpcReplyPort};
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

/// Answers a job's tool calls: the one interface the loop calls (`answer`),
/// over three ways a call is answered. `live` runs it (a panic in it is one
/// error result, I-38); `replayed` serves what a replay's recording says a
/// tool that reads the world answered, and writes again the files it left;
/// `record` keeps what such a tool answered, and the files it changed, for
/// the recording a recorded run makes.
pub(super) struct Tools<'a> {
    args: &'a LoopArgs,
    toolbox: &'a McpToolbox,
    /// Calls counted against its limits, its predecessor's included (I-45).
    counts: CallCounts,
}

impl<'a> Tools<'a> {
    pub(super) fn new(args: &'a LoopArgs, toolbox: &'a McpToolbox) -> Self {
        Tools {
            args,
            toolbox,
            counts: CallCounts {
                made: args.tool_counts.calls.clone(),
            },
        }
    }

    /// Answers one call; returns the tool's canonical name (what events and
    /// limits say) and what came of it.
    pub(super) async fn answer(&mut self, call: &ToolCall, turn: u32) -> (String, Step) {
        let is_mcp = self.toolbox.get(&call.tool).is_some()
            || call.tool.starts_with(arbor_protocol::mcp::MCP_PREFIX);
        let recorded = crate::tape::is_recorded_tool(&call.tool, is_mcp);
        let replayed = match recorded {
            true => self.replayed(call).await,
            false => None,
        };
        let (tool, step) = match replayed {
            Some(answered) => answered,
            None => self.live(call, turn).await,
        };
        if recorded {
            self.record(call, &tool, &step).await;
        }
        (tool, step)
    }

    /// What the recording a replay follows answered, if it serves tools.
    async fn replayed(&self, call: &ToolCall) -> Option<(String, Step)> {
        let replay = self.args.tapes.replay.as_ref()?;
        if !replay.serves_tools() {
            return None;
        }
        match replay.tool(&call.tool, &call.args)? {
            Served::Result(canonical, result, files) => {
                write_files(self.args, files).await;
                Some((canonical, Step::Result(result)))
            }
            Served::Diverged(why) => Some((call.tool.clone(), Step::Result(Err(why)))),
        }
    }

    /// The call, run.
    async fn live(&mut self, call: &ToolCall, turn: u32) -> (String, Step) {
        let run = call_tool(self.args, call, self.toolbox, &mut self.counts, turn);
        AssertUnwindSafe(run)
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| {
                let why = format!("the tool panicked: {}", panic_message(&panic));
                (call.tool.clone(), Step::Result(Err(why)))
            })
    }

    /// Kept for the recording, if the run is recorded.
    async fn record(&self, call: &ToolCall, tool: &str, step: &Step) {
        let (Some(writer), Step::Result(result)) = (&self.args.tapes.writer, step) else {
            return;
        };
        let content = result.as_ref().map(|v| v.to_string()).map_err(Clone::clone);
        let files = match result {
            Ok(value) if tool == ToolName::Exec.as_str() => changed_files(self.args, value).await,
            _ => BTreeMap::new(),
        };
        writer.tool(&call.tool, tool, &call.args, &content, files);
    }
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

pub(super) enum Step {
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
            Step::Result(Err(refused(args, canonical, refusal))),
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
            let text = refused(args, &call.tool, refusal);
            return (call.tool.clone(), Step::Result(Err(text)));
        }
        return (
            call.tool.clone(),
            Step::Result(Err(format!(
                "unknown tool {:?}; call only the tools this request lists",
                call.tool
            ))),
        );
    };
    let named = tool.to_string();
    if let Some(Err(why)) = args.offered.get(&tool) {
        let refusal = Refusal::ToolNotOffered {
            tool: named.clone(),
            why: format!(": {why}"),
        };
        return (
            named.clone(),
            Step::Result(Err(refused(args, &named, refusal))),
        );
    }
    if let Err(e) = admit(args, counts, &named, &call.id, turn, false).await {
        return (named, Step::Result(Err(e)));
    }
    let hooked = match before_call(args, &named, call).await {
        Ok(asks) => asks,
        Err(e) => return (named, Step::Result(Err(e))),
    };
    match gating(args, &named, hooked) {
        Some(Gating::Ask { timeout }) => {
            let check: crate::approvals::ArgsCheck = Arc::new(move |a| builtin_check(tool, a));
            match ask_person(args, &named, call, check, timeout).await {
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
        Some(Gating::Notify { undo }) => {
            let step = call_builtin(args, tool, call).await;
            if let Step::Result(result) = &step
                && let Err(e) = record_ran(args, &named, call, result, undo).await
            {
                return (named, Step::Result(Err(e)));
            }
            return (named, step);
        }
        None => {}
    }
    (named, call_builtin(args, tool, call).await)
}

/// How a call is gated: a hook that answered `ask` asks; else its
/// agent's `approve:` entries say (`Policy::gating`).
fn gating(args: &LoopArgs, tool: &str, hooked: bool) -> Option<Gating> {
    // A question is a card already: an entry for it sets only its wait.
    if tool == "ask_person" {
        return None;
    }
    if hooked {
        // The entry's own wait still holds for a hook's ask.
        let timeout = match args.policy.gating(tool) {
            Some(Gating::Ask { timeout }) => timeout,
            _ => None,
        };
        return Some(Gating::Ask { timeout });
    }
    args.policy.gating(tool)
}

/// I-60: a notify-mode call ran; its card, decided `ran` as it is made,
/// records the tool, its arguments and result (secrets redacted, clipped)
/// and the entry's undo hint, durable before the model reads the result.
/// `Err`: the record could not be made; the model is told the call ran.
async fn record_ran(
    args: &LoopArgs,
    tool: &str,
    call: &ToolCall,
    result: &Result<serde_json::Value, String>,
    undo: Option<String>,
) -> Result<(), String> {
    use crate::approvals::GateMsg;
    use arbor_protocol::{Card, CardId, CardKind, CardState, Decision};
    let Some(gate) = args.ctx.gate.get() else {
        return Ok(());
    };
    let secrets = &args.ctx.secrets;
    let shown = match result {
        Ok(serde_json::Value::String(text)) => text.clone(),
        Ok(value) => value.to_string(),
        Err(e) => format!("error: {e}"),
    };
    let at_ms = crate::events::now_ms();
    let card = Card {
        id: CardId::new(),
        kind: CardKind::Call,
        run: args.run,
        job: args.id,
        lineage: args.path.to_vec(),
        agent: args.agent.name.clone(),
        tool: tool.to_string(),
        call: call.id.clone(),
        args: card_args(&call.args, secrets),
        state: CardState::Ran,
        asked_at_ms: at_ms,
        deadline_ms: at_ms,
        decision: Some(Decision {
            by: "notify".into(),
            reason: None,
            at_ms,
            edited: false,
            answer: None,
        }),
        result: Some(clip(&secrets.redact(&shown), CARD_STRING_LIMIT)),
        undo,
    };
    let recorded = gate
        .call(
            |reply| GateMsg::Record {
                card: Box::new(card),
                reply,
            },
            None,
        )
        .await;
    match recorded {
        Ok(ractor::rpc::CallResult::Success(Ok(()))) => Ok(()),
        Ok(ractor::rpc::CallResult::Success(Err(e))) => Err(format!(
            "the call ran, but its record card could not be journaled: {e}"
        )),
        _ => Err("the call ran, but the approval gate that records it is gone".into()),
    }
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
        ToolName::ReadSkill => parse::<ReadSkillArgs>(tool, args).map(|_| ()),
        ToolName::AskPerson => {
            parse::<arbor_protocol::AskPersonArgs>(tool, args).and_then(|a| a.check())
        }
        ToolName::SendPeer => parse::<arbor_protocol::SendPeerArgs>(tool, args).map(|_| ()),
    }
}

/// I-46: stages a call for a person and waits for the card's one outcome.
/// `Ok(None)` runs the call as the model asked, `Ok(Some(args))` with a
/// person's edited arguments; `Err` is what the model reads instead, and
/// the call does not run. While it waits the job holds no reservation (no
/// model call is in flight between turns) and its wall timeout is paused.
/// A question (`ask_person`, I-60) goes the same way: `Ok(Some(answer))`.
async fn ask_person(
    args: &LoopArgs,
    tool: &str,
    call: &ToolCall,
    check: crate::approvals::ArgsCheck,
    timeout: Option<std::time::Duration>,
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
    let kind = arbor_protocol::CardKind::of_tool(tool);
    let decided = ask_gate(args, tool, call, check, timeout)
        .await
        .and_then(|answer| outcome(kind, answer));
    // What a stop cut short is no one's decision.
    if let (Some(writer), false) = (&args.tapes.writer, args.cancel.is_cancelled()) {
        writer.approval(&call.id, tool, &decided);
    }
    decided
}

/// The gate's side of `ask_person`: the card, and its one outcome; `Err`
/// when no card could be waited on, in words the model reads.
async fn ask_gate(
    args: &LoopArgs,
    tool: &str,
    call: &ToolCall,
    check: crate::approvals::ArgsCheck,
    timeout: Option<std::time::Duration>,
) -> Result<crate::approvals::Answer, String> {
    use crate::approvals::{Answer, Ask, GateMsg};
    // Fail safe: with no gate, a call meant to wait for a person does not run.
    let Some(gate) = args.ctx.gate.get() else {
        return Err(format!(
            "{tool} needs a person and this node has no approval gate, so it did not run"
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
        timeout,
    };
    let _ = args.job.cast(LoopMsg::Waiting(true));
    let answer = tokio::select! {
        answer = gate.call(|reply| GateMsg::Ask { ask: Box::new(ask), reply }, None) => answer,
        _ = args.cancel.cancelled() => {
            return Err("the job was stopped while it waited for a person".into());
        }
    };
    let _ = args.job.cast(LoopMsg::Waiting(false));
    let answer = match answer {
        Ok(ractor::rpc::CallResult::Success(answer)) => answer,
        _ => Answer::Failed("the approval gate is gone".into()),
    };
    // A stop after the decision still wins: nothing runs once it came.
    if args.cancel.is_cancelled() {
        return Err("the job was stopped, so nothing it waited for goes on".into());
    }
    Ok(answer)
}

/// What a card's outcome means to the model: for a call, run it (perhaps
/// with edited arguments) or the reason it did not run; for a question,
/// the answer or why there is none.
fn outcome(
    kind: arbor_protocol::CardKind,
    answer: crate::approvals::Answer,
) -> Result<Option<serde_json::Value>, String> {
    use crate::approvals::Answer;
    use arbor_protocol::CardKind;
    match (kind, answer) {
        (CardKind::Question, Answer::Answered { answer, .. }) => {
            Ok(Some(serde_json::Value::String(answer)))
        }
        (CardKind::Question, Answer::Rejected { by, reason }) => Err(format!(
            "a person ({by}) declined to answer: {reason}. Go on without it"
        )),
        (CardKind::Question, Answer::Expired) => Err(
            "no answer: nobody answered before the question's deadline. This is not a \
             refusal: go on without it, or ask again later"
                .into(),
        ),
        (CardKind::Question, Answer::Failed(why)) => {
            Err(format!("the question could not be asked: {why}"))
        }
        (CardKind::Question, _) => Err("the question was closed without an answer".into()),
        (_, Answer::Approved { edited }) => Ok(edited),
        (_, Answer::Rejected { by, reason }) => Err(format!(
            "a person ({by}) rejected this call, so it did not run: {reason}"
        )),
        (_, Answer::Expired) => Err(
            "no one decided on this call before its approval deadline, so it did not run. \
             This is not a rejection: go on without it, or ask again later"
                .into(),
        ),
        (_, Answer::Failed(why)) => Err(format!(
            "the call could not be staged for approval, so it did not run: {why}"
        )),
        (_, Answer::Cancelled | Answer::Answered { .. }) => {
            Err("the call's approval was cancelled, so it did not run".into())
        }
    }
}

/// `ask_person` (I-60): the question becomes a card of kind `question`; its
/// answer is the result. Refused before any card when the question is bad.
async fn question(args: &LoopArgs, call: &ToolCall) -> Result<serde_json::Value, String> {
    let tool = ToolName::AskPerson;
    let asked = parse::<arbor_protocol::AskPersonArgs>(tool, &call.args)?;
    asked.check()?;
    let call = ToolCall {
        args: serde_json::to_value(&asked).unwrap_or_default(),
        ..call.clone()
    };
    let check: crate::approvals::ArgsCheck = Arc::new(|_| Ok(()));
    // `approve: [{tool: ask_person, timeout}]` sets a question's wait.
    let timeout = match args.policy.gating("ask_person") {
        Some(Gating::Ask { timeout }) => timeout,
        _ => None,
    };
    match ask_person(args, "ask_person", &call, check, timeout).await? {
        Some(serde_json::Value::String(answer)) => Ok(serde_json::Value::String(format!(
            "The person answered: {answer}"
        ))),
        _ => Err("the question was closed without an answer".into()),
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
        Err(refusal) => Err(refused(args, tool, refusal)),
        Ok(Counted::No) => Ok(()),
        Ok(Counted::Yes { limited }) => journal_start(args, tool, call_id, turn, limited).await,
    }
}

/// Whether `CallCounts::admit` counted a call, and whether a limit did.
enum Counted {
    No,
    Yes { limited: bool },
}

/// Tells a refusal of a call of `tool` (an event) and returns the text the
/// model reads.
fn refused(args: &LoopArgs, tool: &str, refusal: Refusal) -> String {
    let text = refusal.to_string();
    let tool = tool.to_string();
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
    let hooked = before_call(args, &entry.canonical, call).await?;
    let mut notify = None;
    match gating(args, &entry.canonical, hooked) {
        Some(Gating::Ask { timeout }) => {
            let schema = entry.clone();
            let check: crate::approvals::ArgsCheck = Arc::new(move |a| schema.check(a).map(|_| ()));
            if let Some(edited) = ask_person(args, &entry.canonical, call, check, timeout).await? {
                arguments = entry.check(&edited)?;
            }
        }
        Some(Gating::Notify { undo }) => notify = Some(undo),
        None => {}
    }
    let result = mcp_send(args, call, entry, arguments).await;
    if let Some(undo) = notify {
        record_ran(args, &entry.canonical, call, &result, undo).await?;
    }
    result
}

/// Sends an MCP call through the job's sandbox, which owns the server.
async fn mcp_send(
    args: &LoopArgs,
    call: &ToolCall,
    entry: &crate::mcp::McpToolEntry,
    arguments: serde_json::Map<String, serde_json::Value>,
) -> Result<serde_json::Value, String> {
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
        ToolName::AskPerson => question(args, call).await,
        ToolName::SendPeer => match parse::<arbor_protocol::SendPeerArgs>(tool, &call.args) {
            Ok(a) => actor_call(&args.job, |reply| LoopMsg::SendPeer {
                to: a.to,
                text: a.text,
                reply,
            })
            .await
            .map(|id| serde_json::json!({ "queued": true, "message_id": id })),
            Err(e) => Err(e),
        },
        ToolName::ReadSkill => match parse::<ReadSkillArgs>(tool, &call.args) {
            Ok(a) => crate::skills::read(&args.ctx.skills, &args.agent, &args.policy, a)
                .await
                .map(serde_json::Value::String),
            Err(e) => Err(e),
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
/// How long a hook may take before it is killed and the call denied.
pub const HOOK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A hook's answer on its stdout.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct HookAnswer {
    decision: HookDecision,
    #[serde(default)]
    reason: Option<String>,
}

#[derive(serde::Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
enum HookDecision {
    Allow,
    Deny,
    Ask,
}

/// I-62: the policy's `before_call` hooks, the topmost ancestor's first,
/// each run sealed in the job's sandbox with the call as JSON on its stdin.
/// `Ok(true)`: one asks, so the call waits for a person; `Err`: one denied
/// it (or failed, timed out or answered nonsense: a hook fails closed),
/// and the model reads why. `submit_output` is never asked about: an agent
/// must always be able to answer.
async fn before_call(args: &LoopArgs, tool: &str, call: &ToolCall) -> Result<bool, String> {
    if args.policy.hooks.is_empty() || tool == ToolName::SubmitOutput.as_str() {
        return Ok(false);
    }
    let input = serde_json::json!({
        "tool": tool,
        "args": call.args,
        "agent": args.agent.name,
        "run": args.run,
        "job": args.id,
        "lineage": args.path,
    });
    let input = serde_json::to_vec(&input).unwrap_or_default();
    let mut asks = false;
    for (i, command) in args.policy.hooks.iter().enumerate() {
        let answer = run_hook(args, command, input.clone()).await;
        let deny = |why: String| {
            let refusal = Refusal::Denied {
                tool: tool.to_string(),
                why: format!("hook {} ({command}) {why}", i + 1),
            };
            refused(args, tool, refusal)
        };
        match answer {
            Ok(HookAnswer {
                decision: HookDecision::Allow,
                ..
            }) => {}
            Ok(HookAnswer {
                decision: HookDecision::Ask,
                ..
            }) => asks = true,
            Ok(HookAnswer {
                decision: HookDecision::Deny,
                reason,
            }) => {
                let reason = reason.unwrap_or_else(|| "gave no reason".into());
                return Err(deny(format!("denied it: {reason}")));
            }
            Err(why) => return Err(deny(format!("failed, so it is denied: {why}"))),
        }
    }
    Ok(asks)
}

/// One hook's answer, or why it gave none a call may go on with.
async fn run_hook(args: &LoopArgs, command: &str, input: Vec<u8>) -> Result<HookAnswer, String> {
    let sandbox = sandbox_of(args)?;
    let outcome = ractor::call!(sandbox, |reply| SandboxMsg::Hook {
        command: command.to_string(),
        input,
        timeout: HOOK_TIMEOUT,
        reply
    })
    .map_err(|e| format!("the sandbox is gone: {e}"))?;
    if outcome.timed_out {
        return Err(format!(
            "did not answer within {}",
            humantime::format_duration(HOOK_TIMEOUT)
        ));
    }
    if let Some(error) = outcome.error {
        return Err(error);
    }
    match outcome.exit_code {
        Some(0) => {}
        code => {
            let stderr: String = outcome.stderr.trim().chars().take(200).collect();
            return Err(format!("exited with {code:?}: {stderr}"));
        }
    }
    serde_json::from_str(outcome.stdout.trim()).map_err(|e| {
        format!(
            "answered {:?}, not {{\"decision\": \"allow\" | \"deny\" | \"ask\", \"reason\": ...}}: {e}",
            outcome.stdout.trim().chars().take(200).collect::<String>()
        )
    })
}

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
