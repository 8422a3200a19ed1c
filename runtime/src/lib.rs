//! arbor's node assembly: reading a user's workspace, the scripted model, and
//! the embedded node that `arbor run` and the test harness start.
//!
//! Invariant: nothing here parses argv or prints; `arbor-bin` does that.

pub mod check;
pub mod models;
pub mod node;
pub mod notify;
pub mod prompt;
pub mod recovery;
pub mod replay;
pub mod schedules;
pub mod scripted;
pub mod secrets;
pub mod telemetry;
pub mod triggers;
pub mod versions;
pub mod workspace;

pub use arbor_actors::approvals::{Decide, DecideError};
pub use arbor_providers::{Provider, ProviderKind, rate::RATES};
pub use models::Models;
pub use node::{EmbeddedNode, Error};
pub use recovery::{RecoveryReport, RunOutcome};
pub use scripted::{DefaultModels, ScriptedModel};
pub use workspace::{Config, LoadError, Workspace};
