//! What the two wire formats share: the class of a failed request, the
//! errors a reply can make, and the pieces of a request both build the same.

use arbor_actors::model::{ModelError, ModelRequest};
use arbor_protocol::ErrorClass;
use serde_json::Value;

/// How much of an error body is kept in the message.
const ERROR_BODY_CHARS: usize = 300;

/// The class of a failed request, from its status and body (either
/// format's error shape: `{"error": {"type", "code", "message"}}`).
pub fn classify(status: u16, body: &str) -> ModelError {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let error = parsed.as_ref().and_then(|v| v.get("error"));
    let field = |k: &str| {
        error
            .and_then(|e| e.get(k))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    let (kind, code, message) = (field("type"), field("code"), field("message"));
    let lower = format!("{kind} {code} {message}").to_lowercase();
    let context = code == "context_length_exceeded"
        || lower.contains("context length")
        || lower.contains("context window")
        || lower.contains("prompt is too long")
        || lower.contains("maximum context");
    let quota = code == "insufficient_quota"
        || kind == "insufficient_quota"
        || lower.contains("credit balance")
        || lower.contains("exceeded your current quota");
    let class = match status {
        401 | 403 => ErrorClass::ModelAuth,
        402 => ErrorClass::ModelUsageCap,
        429 if quota => ErrorClass::ModelUsageCap,
        429 => ErrorClass::ModelRateLimit,
        400 | 413 if context => ErrorClass::ContextTooLong,
        413 => ErrorClass::ContextTooLong,
        400 if quota => ErrorClass::ModelUsageCap,
        408 => ErrorClass::ModelTimeout,
        503 | 529 => ErrorClass::ModelOverloaded,
        500..=599 if kind == "overloaded_error" => ErrorClass::ModelOverloaded,
        500..=599 => ErrorClass::ModelServer,
        _ => ErrorClass::ModelBadRequest,
    };
    let detail = if message.is_empty() {
        clip(body.trim())
    } else {
        clip(&message)
    };
    ModelError::new(
        class,
        if detail.is_empty() {
            format!("HTTP {status}")
        } else {
            format!("HTTP {status}: {detail}")
        },
    )
}

/// An `error` object that arrived inside a 200 stream.
pub(crate) fn error_in_stream(error: &Value) -> ModelError {
    let kind = error.get("type").and_then(Value::as_str).unwrap_or("");
    let status = match kind {
        "overloaded_error" => 529,
        "rate_limit_error" => 429,
        "authentication_error" => 401,
        "permission_error" => 403,
        "invalid_request_error" => 400,
        "request_too_large" => 413,
        _ => 500,
    };
    let body = serde_json::json!({ "error": error }).to_string();
    let mut e = classify(status, &body);
    e.message = format!("in the stream: {}", e.message);
    e
}

pub(crate) fn dropped_mid_stream() -> ModelError {
    ModelError::new(
        ErrorClass::ModelServer,
        "the stream ended before the answer was complete (connection dropped?)",
    )
}

pub(crate) fn protocol_error(what: &str) -> ModelError {
    ModelError::new(ErrorClass::ModelProtocol, what.to_string())
}

pub(crate) fn parse_json(bytes: &[u8]) -> Result<Value, ModelError> {
    serde_json::from_slice(bytes).map_err(|e| {
        protocol_error(&format!(
            "the answer is not JSON ({e}): {}",
            clip(&String::from_utf8_lossy(bytes))
        ))
    })
}

/// The system prompt as sent: the agent's, plus the request-local wind-down
/// notice (I-12: it is never in the history).
pub(crate) fn system_prompt(request: &ModelRequest) -> String {
    match &request.wind_down {
        Some(notice) => format!("{}\n\n{notice}", request.system),
        None => request.system.clone(),
    }
}

/// A tool call's arguments as the model wrote them: JSON when they parse,
/// else the raw text, which the loop refuses as bad arguments the model sees.
pub(crate) fn tool_arguments(text: &str) -> Value {
    if text.trim().is_empty() {
        return Value::Null;
    }
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_string()))
}

fn clip(text: &str) -> String {
    let one_line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match one_line.char_indices().nth(ERROR_BODY_CHARS) {
        Some((end, _)) => format!("{}…", &one_line[..end]),
        None => one_line,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(status: u16, body: &str, class: ErrorClass) {
        assert_eq!(classify(status, body).class, class, "{status} {body}");
    }

    #[test]
    fn failures_are_classified_from_status_and_body() {
        use ErrorClass::*;
        check(
            401,
            r#"{"error":{"type":"authentication_error","message":"invalid x-api-key"}}"#,
            ModelAuth,
        );
        check(403, "", ModelAuth);
        check(
            429,
            r#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#,
            ModelRateLimit,
        );
        check(
            429,
            r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#,
            ModelUsageCap,
        );
        check(
            400,
            r#"{"error":{"message":"This model's maximum context length is 8192 tokens","type":"invalid_request_error","code":"context_length_exceeded"}}"#,
            ContextTooLong,
        );
        check(
            400,
            r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 210000 tokens > 200000 maximum"}}"#,
            ContextTooLong,
        );
        check(
            400,
            r#"{"type":"error","error":{"type":"invalid_request_error","message":"Your credit balance is too low"}}"#,
            ModelUsageCap,
        );
        check(
            400,
            r#"{"error":{"message":"Unrecognized request argument"}}"#,
            ModelBadRequest,
        );
        check(404, "not found", ModelBadRequest);
        check(
            529,
            r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
            ModelOverloaded,
        );
        check(503, "", ModelOverloaded);
        check(500, "<html>oops</html>", ModelServer);
        check(502, "", ModelServer);
        check(408, "", ModelTimeout);
    }
}
