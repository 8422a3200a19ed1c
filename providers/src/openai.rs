//! OpenAI's Chat Completions wire format: the request body, a whole answer,
//! and a streamed one (`stream_options.include_usage` asks for usage last).
//! Pure: bytes in, values out, so every shape is tested from fixtures.

use crate::wire::{parse_json, protocol_error, system_prompt, tool_arguments};
use arbor_actors::model::{CallMeter, Message, ModelError, ModelReply, ModelRequest, ToolCall};
use arbor_protocol::{Settings, Usage};
use serde_json::{Value, json};

/// The request body. `max_tokens` is the call's reserved output.
/// `max_tokens`: what the body asks for (the call's reserved output).
pub fn body(
    model_id: &str,
    defaults: Settings,
    request: &ModelRequest,
    max_tokens: u64,
    stream: bool,
) -> Value {
    let mut messages = vec![json!({"role": "system", "content": system_prompt(request)})];
    for message in &request.messages {
        messages.push(match message {
            Message::User(text) => json!({"role": "user", "content": text}),
            // Chat Completions has no thinking blocks to send back.
            Message::Assistant { text, calls, .. } => {
                let mut m = json!({"role": "assistant", "content": text});
                if !calls.is_empty() {
                    m["tool_calls"] = calls
                        .iter()
                        .map(|c| {
                            json!({
                                "id": c.id,
                                "type": "function",
                                "function": {"name": c.tool, "arguments": c.args.to_string()},
                            })
                        })
                        .collect();
                }
                m
            }
            Message::ToolResult {
                call_id,
                content,
                is_error,
            } => json!({
                "role": "tool",
                "tool_call_id": call_id,
                "content": if *is_error { format!("Error: {content}") } else { content.clone() },
            }),
        });
    }
    let mut body = json!({
        "model": model_id,
        "messages": messages,
        "max_tokens": max_tokens,
    });
    if !request.tools.is_empty() {
        body["tools"] = request
            .tools
            .iter()
            .map(|t| {
                json!({
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.parameters.as_ref(),
                    },
                })
            })
            .collect();
    }
    let settings = request.settings.over(defaults);
    sampling(&mut body, settings);
    if let Some(effort) = settings.effort {
        body["reasoning_effort"] = json!(effort.as_str());
        // Reasoning models take their cap, thinking included, only by this name.
        if let Some(map) = body.as_object_mut()
            && let Some(cap) = map.remove("max_tokens")
        {
            map.insert("max_completion_tokens".into(), cap);
        }
    }
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// `temperature` and `top_p` as the provider takes them (a fraction).
pub(crate) fn sampling(body: &mut Value, settings: Settings) {
    if let Some(t) = settings.temperature_milli {
        body["temperature"] = json!(f64::from(t) / 1000.0);
    }
    if let Some(p) = settings.top_p_milli {
        body["top_p"] = json!(f64::from(p) / 1000.0);
    }
}

/// A whole (not streamed) answer.
pub fn parse_reply(bytes: &[u8], turn: u32) -> Result<ModelReply, ModelError> {
    let value = parse_json(bytes)?;
    let choice = value
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or_else(|| protocol_error("the answer has no choices"))?;
    let message = choice
        .get("message")
        .ok_or_else(|| protocol_error("the answer's choice has no message"))?;
    let text = message
        .get("content")
        .and_then(Value::as_str)
        .map(str::to_string);
    let mut calls = vec![];
    if let Some(list) = message.get("tool_calls").and_then(Value::as_array) {
        for (i, call) in list.iter().enumerate() {
            let function = call
                .get("function")
                .ok_or_else(|| protocol_error("a tool call has no function"))?;
            let name = function
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| protocol_error("a tool call has no name"))?;
            let arguments = function
                .get("arguments")
                .and_then(Value::as_str)
                .unwrap_or("");
            calls.push(ToolCall {
                id: call_id(call.get("id").and_then(Value::as_str), turn, i),
                tool: name.to_string(),
                args: tool_arguments(arguments),
            });
        }
    }
    Ok(ModelReply {
        thinking: vec![],
        text,
        calls,
        usage: usage(value.get("usage")),
        truncated: choice.get("finish_reason").and_then(Value::as_str) == Some("length"),
    })
}

fn usage(value: Option<&Value>) -> Option<Usage> {
    let u = value?;
    let input = u.get("prompt_tokens")?.as_u64()?;
    let output = u.get("completion_tokens").and_then(Value::as_u64)?;
    Some(Usage {
        input_tokens: input,
        output_tokens: output,
    })
}

/// Some OpenAI-compatible servers send tool calls without ids.
fn call_id(id: Option<&str>, turn: u32, index: usize) -> String {
    match id {
        Some(id) if !id.is_empty() => id.to_string(),
        _ => format!("call_{turn}_{index}"),
    }
}

/// A streamed answer, chunk by chunk.
#[derive(Default)]
pub struct Stream {
    text: String,
    /// By the chunk's `index`: id, name, arguments so far.
    calls: Vec<(Option<String>, String, String)>,
    finish_reason: Option<String>,
    usage: Option<Usage>,
    done: bool,
}

impl Stream {
    /// Takes one SSE `data:` payload. True once the stream says it is done.
    pub fn on_data(&mut self, data: &str, meter: &CallMeter) -> Result<bool, ModelError> {
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(true);
        }
        let chunk = parse_json(data.as_bytes())?;
        if let Some(error) = chunk.get("error") {
            return Err(crate::wire::error_in_stream(error));
        }
        if let Some(u) = usage(chunk.get("usage")) {
            meter.report_usage(Some(u.input_tokens), Some(u.output_tokens));
            self.usage = Some(u);
        }
        let Some(choice) = chunk.get("choices").and_then(|c| c.get(0)) else {
            return Ok(false);
        };
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(reason.to_string());
        }
        let Some(delta) = choice.get("delta") else {
            return Ok(false);
        };
        if let Some(text) = delta.get("content").and_then(Value::as_str) {
            meter.add_streamed(text.len() as u64);
            self.text.push_str(text);
        }
        if let Some(list) = delta.get("tool_calls").and_then(Value::as_array) {
            for piece in list {
                let index = piece
                    .get("index")
                    .and_then(Value::as_u64)
                    .ok_or_else(|| protocol_error("a streamed tool call has no index"))?
                    as usize;
                if index > 1024 {
                    return Err(protocol_error("a streamed tool call index is out of range"));
                }
                if self.calls.len() <= index {
                    self.calls
                        .resize(index + 1, (None, String::new(), String::new()));
                }
                let call = &mut self.calls[index];
                if let Some(id) = piece.get("id").and_then(Value::as_str) {
                    call.0 = Some(id.to_string());
                }
                if let Some(function) = piece.get("function") {
                    if let Some(name) = function.get("name").and_then(Value::as_str) {
                        call.1.push_str(name);
                    }
                    if let Some(args) = function.get("arguments").and_then(Value::as_str) {
                        meter.add_streamed(args.len() as u64);
                        call.2.push_str(args);
                    }
                }
            }
        }
        Ok(false)
    }

    /// The answer, once the stream has ended.
    pub fn finish(self, turn: u32) -> Result<ModelReply, ModelError> {
        if !self.done && self.finish_reason.is_none() {
            return Err(crate::wire::dropped_mid_stream());
        }
        let calls = self
            .calls
            .into_iter()
            .enumerate()
            .filter(|(_, (_, name, _))| !name.is_empty())
            .map(|(i, (id, name, args))| ToolCall {
                id: call_id(id.as_deref(), turn, i),
                tool: name,
                args: tool_arguments(&args),
            })
            .collect();
        Ok(ModelReply {
            thinking: vec![],
            text: (!self.text.is_empty()).then_some(self.text),
            calls,
            usage: self.usage,
            truncated: self.finish_reason.as_deref() == Some("length"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arbor_protocol::ToolName;

    fn request() -> ModelRequest {
        ModelRequest {
            input_estimate: 0,
            agent: "a".into(),
            system: "You are the planner.".into(),
            messages: vec![
                Message::User("go".into()),
                Message::Assistant {
                    thinking: vec![],
                    text: None,
                    calls: vec![ToolCall {
                        id: "call_1".into(),
                        tool: "exec".into(),
                        args: json!({"command": "ls"}),
                    }],
                },
                Message::ToolResult {
                    call_id: "call_1".into(),
                    content: "boom".into(),
                    is_error: true,
                },
            ],
            tools: [ToolName::Exec, ToolName::SubmitOutput]
                .map(Into::into)
                .into(),
            max_output_tokens: 77,
            wind_down: Some("Finish now.".into()),
            settings: Default::default(),
            turn: 1,
            meter: Default::default(),
        }
    }

    #[test]
    fn settings_are_the_agents_over_the_models_and_effort_renames_the_cap() {
        let defaults = Settings::from_figures(Some(0.7), Some(0.5), None).unwrap();
        let mut request = request();
        request.settings = Settings::from_figures(None, Some(0.9), None).unwrap();
        let plain = body("gpt-x", defaults, &request, 77, false);
        assert_eq!(plain["temperature"], 0.7);
        assert_eq!(plain["top_p"], 0.9);
        assert!(plain.get("reasoning_effort").is_none());
        request.settings.effort = Some(arbor_protocol::Effort::High);
        let reasoning = body("gpt-x", Settings::default(), &request, 77, false);
        assert_eq!(reasoning["reasoning_effort"], "high");
        assert_eq!(reasoning["max_completion_tokens"], 77);
        assert!(reasoning.get("max_tokens").is_none());
    }

    #[test]
    fn the_body_carries_the_system_prompt_tools_history_and_max_tokens() {
        let body = body("gpt-x", Settings::default(), &request(), 77, true);
        assert_eq!(body["model"], "gpt-x");
        assert_eq!(body["max_tokens"], 77);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(
            body["messages"][0]["content"],
            "You are the planner.\n\nFinish now."
        );
        assert_eq!(
            body["messages"][2]["tool_calls"][0]["function"]["arguments"],
            "{\"command\":\"ls\"}"
        );
        assert_eq!(body["messages"][3]["role"], "tool");
        assert_eq!(body["messages"][3]["tool_call_id"], "call_1");
        assert_eq!(body["messages"][3]["content"], "Error: boom");
        assert_eq!(body["tools"][0]["function"]["name"], "exec");
        assert_eq!(body["tools"][0]["function"]["parameters"]["type"], "object");
    }

    #[test]
    fn a_whole_answer_with_two_tool_calls_and_usage() {
        let reply = parse_reply(
            br#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":null,
            "tool_calls":[{"id":"call_a","type":"function","function":{"name":"exec","arguments":"{\"command\": \"ls\"}"}},
                          {"id":"call_b","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"a\"}"}}]},
            "finish_reason":"tool_calls"}],"usage":{"prompt_tokens":13,"completion_tokens":6,"total_tokens":19}}"#,
            0,
        )
        .unwrap();
        assert_eq!(reply.calls.len(), 2);
        assert_eq!(reply.calls[0].args, json!({"command": "ls"}));
        assert_eq!(reply.calls[1].id, "call_b");
        assert_eq!(
            reply.usage,
            Some(Usage {
                input_tokens: 13,
                output_tokens: 6
            })
        );
        assert!(!reply.truncated);
    }

    #[test]
    fn a_stream_with_usage_last_and_one_without() {
        let meter = CallMeter::default();
        let mut s = Stream::default();
        let chunks = [
            r#"{"choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_x","type":"function","function":{"name":"submit_output","arguments":""}}]},"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"output\": "}}]},"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"done\"}"}}]},"finish_reason":null}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":20,"completion_tokens":9}}"#,
        ];
        for c in chunks {
            assert!(!s.on_data(c, &meter).unwrap());
        }
        assert!(s.on_data("[DONE]", &meter).unwrap());
        let reply = s.finish(0).unwrap();
        assert_eq!(reply.calls[0].tool, "submit_output");
        assert_eq!(reply.calls[0].args, json!({"output": "done"}));
        assert_eq!(reply.usage.unwrap().total(), 29);

        let mut s = Stream::default();
        s.on_data(
            r#"{"choices":[{"index":0,"delta":{"content":"Tide"},"finish_reason":null}]}"#,
            &meter,
        )
        .unwrap();
        s.on_data(
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}"#,
            &meter,
        )
        .unwrap();
        let reply = s.finish(0).unwrap();
        assert_eq!(reply.text.as_deref(), Some("Tide"));
        assert_eq!(reply.usage, None, "no usage streamed");
        assert!(reply.truncated);
    }

    #[test]
    fn a_stream_that_stops_early_or_sends_garbage_is_an_error() {
        let meter = CallMeter::default();
        let mut s = Stream::default();
        s.on_data(
            r#"{"choices":[{"index":0,"delta":{"content":"Ti"},"finish_reason":null}]}"#,
            &meter,
        )
        .unwrap();
        let e = s.finish(0).unwrap_err();
        assert_eq!(e.class, arbor_protocol::ErrorClass::ModelServer);
        let e = Stream::default().on_data("{not json", &meter).unwrap_err();
        assert_eq!(e.class, arbor_protocol::ErrorClass::ModelProtocol);
    }
}
