//! arbor's node assembly: reading a user's workspace, the scripted model, and
//! the embedded node that `arbor run` and the test harness start.
//!
//! Invariant: nothing here parses argv or prints; `arbor-bin` does that.

pub mod check;
pub mod node;
pub mod providers;
pub mod recovery;
pub mod scripted;
pub mod secrets;
pub mod workspace;

pub use node::{EmbeddedNode, Error};
pub use providers::{Models, Provider, ProviderKind};
pub use recovery::{RecoveryReport, RunOutcome};
pub use scripted::{DefaultModels, ScriptedModel};
pub use workspace::{Config, LoadError, Workspace};
