//! arbor's sandboxing on Linux: how a command is sealed in namespaces of its
//! own (`seal`), how a process is told apart from a later one that reuses its
//! pid (`proc_start`) and when it has ended (`pidfd`), and how files are read and written only below a
//! workdir (`files`). Every `unsafe` block of the product is in this crate,
//! each with a `// SAFETY:` comment that says why it holds.
//!
//! Knows nothing of actors, jobs or the journal: the Sandbox actor
//! (arbor-actors) decides what runs and records it; this crate runs it.

pub mod files;
pub mod pidfd;
pub mod proc_start;
pub mod seal;

pub use pidfd::process_exits_within;
pub use proc_start::{group_members, process_start, same_process};
pub use seal::{Posture, SandboxIsolation, SandboxUser};
