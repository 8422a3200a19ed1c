//! Anthropic's Messages wire format: the request body (tool results as
//! `tool_result` blocks, consecutive turns of one role merged, as the API
//! requires; `effort` as extended thinking, each turn's thinking blocks
//! sent back before its tool calls, unchanged, as the API requires), a
//! whole answer, and a streamed one (usage from `message_start` and
//! `message_delta`). Pure, like `openai`.

use crate::wire::{error_in_stream, parse_json, protocol_error, system_prompt, tool_arguments};
use arbor_actors::model::{CallMeter, Message, ModelError, ModelReply, ModelRequest, ToolCall};
use arbor_protocol::{Settings, ThinkingTokens, Usage};
use serde_json::{Value, json};

/// The API version this client speaks (the `anthropic-version` header).
pub const API_VERSION: &str = "2023-06-01";

/// Anthropic's least thinking budget: below it a call goes without.
const MIN_THINKING: u64 = 1024;

/// `max_tokens`: what the body asks for (the call's reserved output, its
/// thinking budget included); `thinking`: the model entry's budgets.
pub fn body(
    model_id: &str,
    defaults: Settings,
    thinking: Option<ThinkingTokens>,
    request: &ModelRequest,
    max_tokens: u64,
    stream: bool,
) -> Value {
    let mut messages: Vec<Value> = vec![];
    let mut push = |role: &str, block: Value| {
        if let Some(last) = messages.last_mut()
            && last["role"] == role
            && let Some(blocks) = last["content"].as_array_mut()
        {
            blocks.push(block);
            return;
        }
        messages.push(json!({"role": role, "content": [block]}));
    };
    for message in &request.messages {
        match message {
            Message::User(text) => push("user", json!({"type": "text", "text": text})),
            Message::Assistant {
                text,
                calls,
                thinking,
            } => {
                for block in thinking.iter() {
                    push("assistant", block.clone());
                }
                if let Some(text) = text.as_ref().filter(|t| !t.is_empty()) {
                    push("assistant", json!({"type": "text", "text": text}));
                }
                for call in calls {
                    let input = if call.args.is_object() {
                        call.args.clone()
                    } else {
                        json!({})
                    };
                    push(
                        "assistant",
                        json!({"type": "tool_use", "id": call.id, "name": call.tool, "input": input}),
                    );
                }
            }
            Message::ToolResult {
                call_id,
                content,
                is_error,
            } => push(
                "user",
                json!({"type": "tool_result", "tool_use_id": call_id, "content": content, "is_error": is_error}),
            ),
        }
    }
    let mut body = json!({
        "model": model_id,
        "system": system_prompt(request),
        "messages": messages,
        "max_tokens": max_tokens,
    });
    if !request.tools.is_empty() {
        body["tools"] = request
            .tools
            .iter()
            .map(|t| {
                json!({
                    "name": t.name,
                    "description": t.description,
                    "input_schema": t.parameters.as_ref(),
                })
            })
            .collect();
    }
    let settings = request.settings.over(defaults);
    // Within `max_tokens`, leaving at least one token of answer; a call
    // whose account covers too little for the least budget goes without.
    let budget = match (thinking, settings.effort) {
        (Some(tokens), Some(effort)) => tokens.at(effort).min(max_tokens.saturating_sub(1)),
        _ => 0,
    };
    if budget >= MIN_THINKING {
        body["thinking"] = json!({"type": "enabled", "budget_tokens": budget});
    }
    // With thinking, sampling settings are refused at load (docs/models.md).
    crate::openai::sampling(&mut body, settings);
    if stream {
        body["stream"] = json!(true);
    }
    body
}

pub fn parse_reply(bytes: &[u8]) -> Result<ModelReply, ModelError> {
    let value = parse_json(bytes)?;
    let blocks = value
        .get("content")
        .and_then(Value::as_array)
        .ok_or_else(|| protocol_error("the answer has no content"))?;
    let mut text = String::new();
    let mut calls = vec![];
    let mut thinking = vec![];
    for block in blocks {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => text.push_str(block.get("text").and_then(Value::as_str).unwrap_or("")),
            Some("thinking" | "redacted_thinking") => thinking.push(block.clone()),
            Some("tool_use") => calls.push(ToolCall {
                id: block
                    .get("id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| protocol_error("a tool_use block has no id"))?
                    .to_string(),
                tool: block
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| protocol_error("a tool_use block has no name"))?
                    .to_string(),
                args: block.get("input").cloned().unwrap_or(Value::Null),
            }),
            _ => {}
        }
    }
    let usage = value.get("usage").and_then(|u| {
        Some(Usage {
            input_tokens: input_tokens(u)?,
            output_tokens: u.get("output_tokens")?.as_u64()?,
        })
    });
    Ok(ModelReply {
        text: (!text.is_empty()).then_some(text),
        calls,
        thinking,
        usage,
        truncated: value.get("stop_reason").and_then(Value::as_str) == Some("max_tokens"),
    })
}

/// Input tokens as billed: fresh ones plus those written to and read from the cache.
fn input_tokens(usage: &Value) -> Option<u64> {
    let fresh = usage.get("input_tokens")?.as_u64()?;
    let cached = ["cache_creation_input_tokens", "cache_read_input_tokens"]
        .iter()
        .filter_map(|k| usage.get(*k).and_then(Value::as_u64))
        .sum::<u64>();
    Some(fresh + cached)
}

/// A streamed answer, event by event.
#[derive(Default)]
pub struct Stream {
    text: String,
    /// By block index: (id, name, partial json), for tool_use blocks.
    calls: Vec<(usize, String, String, String)>,
    /// By block index: thinking blocks as they grow (text and signature
    /// appended), or a redacted one whole.
    thinking: Vec<(usize, Value)>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    stop_reason: Option<String>,
    done: bool,
}

impl Stream {
    /// Takes one SSE event's data (its `type` names the event). True at `message_stop`.
    pub fn on_data(&mut self, data: &str, meter: &CallMeter) -> Result<bool, ModelError> {
        let event = parse_json(data.as_bytes())?;
        match event.get("type").and_then(Value::as_str).unwrap_or("") {
            "message_start" => {
                if let Some(u) = event.get("message").and_then(|m| m.get("usage")) {
                    self.input_tokens = input_tokens(u);
                    self.output_tokens = u.get("output_tokens").and_then(Value::as_u64);
                    meter.report_usage(self.input_tokens, self.output_tokens);
                }
            }
            "content_block_start" => {
                let index = event.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
                let block = event.get("content_block").cloned().unwrap_or(Value::Null);
                match block.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        let t = block.get("text").and_then(Value::as_str).unwrap_or("");
                        self.text.push_str(t);
                    }
                    Some("thinking" | "redacted_thinking") => self.thinking.push((index, block)),
                    Some("tool_use") => self.calls.push((
                        index,
                        block
                            .get("id")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_string(),
                        block
                            .get("name")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_string(),
                        String::new(),
                    )),
                    _ => {}
                }
            }
            "content_block_delta" => {
                let index = event.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
                let delta = event.get("delta").cloned().unwrap_or(Value::Null);
                match delta.get("type").and_then(Value::as_str) {
                    Some("text_delta") => {
                        let t = delta.get("text").and_then(Value::as_str).unwrap_or("");
                        meter.add_streamed(t.len() as u64);
                        self.text.push_str(t);
                    }
                    Some(kind @ ("thinking_delta" | "signature_delta")) => {
                        let key = if kind == "thinking_delta" {
                            "thinking"
                        } else {
                            "signature"
                        };
                        let piece = delta.get(key).and_then(Value::as_str).unwrap_or("");
                        meter.add_streamed(piece.len() as u64);
                        let Some((_, block)) = self.thinking.iter_mut().find(|b| b.0 == index)
                        else {
                            return Err(protocol_error(
                                "a thinking delta for a block that is not thinking",
                            ));
                        };
                        let grown = format!("{}{piece}", block[key].as_str().unwrap_or(""));
                        block[key] = Value::String(grown);
                    }
                    Some("input_json_delta") => {
                        let piece = delta
                            .get("partial_json")
                            .and_then(Value::as_str)
                            .unwrap_or("");
                        meter.add_streamed(piece.len() as u64);
                        match self.calls.iter_mut().find(|c| c.0 == index) {
                            Some(call) => call.3.push_str(piece),
                            None => {
                                return Err(protocol_error(
                                    "input for a block that is not a tool_use",
                                ));
                            }
                        }
                    }
                    _ => {}
                }
            }
            "message_delta" => {
                if let Some(reason) = event
                    .get("delta")
                    .and_then(|d| d.get("stop_reason"))
                    .and_then(Value::as_str)
                {
                    self.stop_reason = Some(reason.to_string());
                }
                if let Some(u) = event.get("usage") {
                    if let Some(output) = u.get("output_tokens").and_then(Value::as_u64) {
                        self.output_tokens = Some(output);
                    }
                    if let Some(input) = input_tokens(u) {
                        self.input_tokens = Some(self.input_tokens.unwrap_or(0).max(input));
                    }
                    meter.report_usage(self.input_tokens, self.output_tokens);
                }
            }
            "message_stop" => {
                self.done = true;
                return Ok(true);
            }
            "error" => {
                return Err(error_in_stream(event.get("error").unwrap_or(&Value::Null)));
            }
            _ => {} // ping, content_block_stop, and types added later
        }
        Ok(false)
    }

    pub fn finish(self) -> Result<ModelReply, ModelError> {
        if !self.done {
            return Err(crate::wire::dropped_mid_stream());
        }
        let usage = match (self.input_tokens, self.output_tokens) {
            (Some(input_tokens), Some(output_tokens)) => Some(Usage {
                input_tokens,
                output_tokens,
            }),
            _ => None,
        };
        Ok(ModelReply {
            text: (!self.text.is_empty()).then_some(self.text),
            calls: self
                .calls
                .into_iter()
                .map(|(_, id, tool, args)| ToolCall {
                    id,
                    tool,
                    args: tool_arguments(&args),
                })
                .collect(),
            thinking: self.thinking.into_iter().map(|(_, block)| block).collect(),
            usage,
            truncated: self.stop_reason.as_deref() == Some("max_tokens"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_protocol::ToolName;

    #[test]
    fn tool_results_and_a_steer_after_them_share_one_user_turn() {
        let request = ModelRequest {
            input_estimate: 0,
            agent: "a".into(),
            system: "You are the planner.".into(),
            messages: vec![
                Message::User("go".into()),
                Message::Assistant {
                    thinking: vec![],
                    text: Some("Two things.".into()),
                    calls: vec![
                        ToolCall {
                            id: "toolu_1".into(),
                            tool: "exec".into(),
                            args: json!({"command": "ls"}),
                        },
                        ToolCall {
                            id: "toolu_2".into(),
                            tool: "read_file".into(),
                            args: json!({"path": "a"}),
                        },
                    ],
                },
                Message::ToolResult {
                    call_id: "toolu_1".into(),
                    content: "a".into(),
                    is_error: false,
                },
                Message::ToolResult {
                    call_id: "toolu_2".into(),
                    content: "no such file".into(),
                    is_error: true,
                },
                Message::User("Message from your parent: hurry".into()),
            ],
            tools: [ToolName::Exec].map(Into::into).into(),
            max_output_tokens: 50,
            wind_down: None,
            settings: Default::default(),
            turn: 1,
            meter: Default::default(),
        };
        let body = body("claude-x", Settings::default(), None, &request, 50, false);
        assert_eq!(body["system"], "You are the planner.");
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 3, "{body}");
        assert_eq!(messages[1]["content"][1]["type"], "tool_use");
        let user = &messages[2]["content"];
        assert_eq!(user[0]["type"], "tool_result");
        assert_eq!(user[1]["is_error"], true);
        assert_eq!(user[2]["type"], "text");
        assert_eq!(body["tools"][0]["input_schema"]["type"], "object");
        assert!(body.get("stream").is_none());
    }

    #[test]
    fn a_whole_answer_counts_cached_input_as_input() {
        let reply = parse_reply(
            br#"{"id":"msg_1","type":"message","role":"assistant","content":[
                {"type":"text","text":"Delegating."},
                {"type":"tool_use","id":"toolu_a","name":"exec","input":{"command":"ls"}},
                {"type":"tool_use","id":"toolu_b","name":"exec","input":{"command":"pwd"}}],
                "stop_reason":"tool_use","usage":{"input_tokens":13,"cache_read_input_tokens":100,"output_tokens":6}}"#,
        )
        .unwrap();
        assert_eq!(reply.calls.len(), 2);
        assert_eq!(reply.text.as_deref(), Some("Delegating."));
        assert_eq!(reply.usage.unwrap().input_tokens, 113);
    }

    #[test]
    fn a_stream_reports_usage_from_start_and_delta() {
        let meter = CallMeter::default();
        let mut s = Stream::default();
        let events = [
            r#"{"type":"message_start","message":{"id":"m","usage":{"input_tokens":25,"output_tokens":1}}}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#,
            r#"{"type":"content_block_stop","index":0}"#,
            r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_1","name":"exec","input":{}}}"#,
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"command\": "}}"#,
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"\"ls\"}"}}"#,
            r#"{"type":"ping"}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":15}}"#,
        ];
        for e in events {
            assert!(!s.on_data(e, &meter).unwrap());
        }
        assert!(s.on_data(r#"{"type":"message_stop"}"#, &meter).unwrap());
        let reply = s.finish().unwrap();
        assert_eq!(reply.text.as_deref(), Some("Hi"));
        assert_eq!(reply.calls[0].args, json!({"command": "ls"}));
        assert_eq!(
            reply.usage,
            Some(Usage {
                input_tokens: 25,
                output_tokens: 15
            })
        );
    }

    #[test]
    fn an_error_event_is_classified() {
        let meter = CallMeter::default();
        let e = Stream::default()
            .on_data(
                r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
                &meter,
            )
            .unwrap_err();
        assert_eq!(e.class, arbor_protocol::ErrorClass::ModelOverloaded);
    }

    #[test]
    fn a_streamed_thinking_block_is_kept_whole_and_effort_sets_its_budget() {
        let meter = CallMeter::default();
        let mut s = Stream::default();
        let events = [
            r#"{"type":"message_start","message":{"id":"m","usage":{"input_tokens":25,"output_tokens":1}}}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"","signature":""}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"Check "}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"first."}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"EqQB"}}"#,
            r#"{"type":"content_block_start","index":1,"content_block":{"type":"redacted_thinking","data":"xyz"}}"#,
            r#"{"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"toolu_1","name":"exec","input":{}}}"#,
            r#"{"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{}"}}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":15}}"#,
        ];
        for e in events {
            assert!(!s.on_data(e, &meter).unwrap());
        }
        assert!(s.on_data(r#"{"type":"message_stop"}"#, &meter).unwrap());
        let reply = s.finish().unwrap();
        assert_eq!(
            reply.thinking,
            vec![
                json!({"type": "thinking", "thinking": "Check first.", "signature": "EqQB"}),
                json!({"type": "redacted_thinking", "data": "xyz"}),
            ]
        );

        let thinking = ThinkingTokens {
            low: 1024,
            medium: 2048,
            high: 4096,
        };
        let request = |effort| ModelRequest {
            input_estimate: 0,
            agent: "a".into(),
            system: "s".into(),
            messages: vec![
                Message::User("go".into()),
                Message::Assistant {
                    text: None,
                    calls: reply.calls.clone(),
                    thinking: reply.thinking.clone(),
                },
            ],
            tools: [].into(),
            max_output_tokens: 5000,
            wind_down: None,
            settings: Settings {
                effort,
                ..Settings::default()
            },
            turn: 1,
            meter: Default::default(),
        };
        let high = body(
            "claude-x",
            Settings::default(),
            Some(thinking),
            &request(Some(arbor_protocol::Effort::High)),
            5000,
            false,
        );
        assert_eq!(
            high["thinking"],
            json!({"type": "enabled", "budget_tokens": 4096})
        );
        let content = &high["messages"][1]["content"];
        assert_eq!(content[0]["signature"], "EqQB");
        assert_eq!(content[1]["type"], "redacted_thinking");
        assert_eq!(content[2]["type"], "tool_use");
        // Cut to what max_tokens leaves; below Anthropic's least, none.
        let cut = body(
            "claude-x",
            Settings::default(),
            Some(thinking),
            &request(Some(arbor_protocol::Effort::High)),
            3000,
            false,
        );
        assert_eq!(cut["thinking"]["budget_tokens"], 2999);
        let none = body(
            "claude-x",
            Settings::default(),
            Some(thinking),
            &request(Some(arbor_protocol::Effort::Low)),
            1000,
            false,
        );
        assert!(none.get("thinking").is_none());
        let plain = body(
            "claude-x",
            Settings::default(),
            Some(thinking),
            &request(None),
            5000,
            false,
        );
        assert!(plain.get("thinking").is_none());
    }
}
