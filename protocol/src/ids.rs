//! Ids are uuid v7: unique without coordination, and sortable by creation time,
//! so journal keys built from them come back in the order things happened.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use uuid::Uuid;

/// The 8 bytes a span of `id` is known by: the end of a v7 uuid (its
/// random part), never all zero (an invalid span id in OpenTelemetry).
fn span_bytes(id: &Uuid) -> [u8; 8] {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&id.as_bytes()[8..]);
    if bytes == [0; 8] {
        bytes[7] = 1;
    }
    bytes
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema)]
        #[serde(transparent)]
        pub struct $name(pub Uuid);

        impl $name {
            pub fn new() -> Self {
                Self(Uuid::now_v7())
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl FromStr for $name {
            type Err = uuid::Error;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Uuid::parse_str(s).map(Self)
            }
        }
    };
}

id_type!(
    /// One run of a flow.
    RunId
);
id_type!(
    /// One step or job: a node of the run's tree that runs an agent. Each retry
    /// attempt gets a new one.
    JobId
);
id_type!(
    /// One approval card: a gated tool call waiting for a person (I-46).
    CardId
);

impl RunId {
    /// The run's trace id (docs/operations.md, "Traces"): its own 16 bytes,
    /// so a tracing backend finds a run by its id.
    pub fn trace_id(&self) -> [u8; 16] {
        *self.0.as_bytes()
    }

    /// `trace_id` as a trace is written: 32 lowercase hex digits.
    pub fn trace_hex(&self) -> String {
        self.0.simple().to_string()
    }

    /// The span id of the run's first root span.
    pub fn span_id(&self) -> [u8; 8] {
        span_bytes(&self.0)
    }
}

impl JobId {
    /// The span id of the step's or job's span: the end of its id, so a
    /// span, a log line and a child can name it without asking anyone.
    pub fn span_id(&self) -> [u8; 8] {
        span_bytes(&self.0)
    }

    /// `span_id` as a trace is written: 16 lowercase hex digits.
    pub fn span_hex(&self) -> String {
        hex(&self.span_id())
    }

    /// The span id of its tool call `call` (the model's id for it): the
    /// parent of the jobs a delegate call makes, and the span an MCP server
    /// is told it serves.
    pub fn call_span_id(&self, call: &str) -> [u8; 8] {
        use sha2::{Digest, Sha256};
        let mut hash = Sha256::new();
        hash.update(self.0.as_bytes());
        hash.update(b"tool");
        hash.update(call.as_bytes());
        let mut bytes = [0u8; 8];
        bytes.copy_from_slice(&hash.finalize()[..8]);
        if bytes == [0; 8] {
            bytes[7] = 1;
        }
        bytes
    }

    /// The W3C `traceparent` of its tool call `call` in `run`'s trace.
    pub fn call_traceparent(&self, run: RunId, call: &str) -> String {
        format!(
            "00-{}-{}-01",
            run.trace_hex(),
            hex(&self.call_span_id(call))
        )
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
