//! A skill: `skills/NAME/SKILL.md` in a workspace, the format Claude Code
//! and other agents share. Its front matter's `name` and `description` are
//! what an agent's prompt lists; its body, and any file beside it, are
//! read on demand with `read_skill`.

use std::path::PathBuf;

/// One skill, as the workspace loaded it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skill {
    pub name: String,
    pub description: String,
    /// SKILL.md after its front matter.
    pub body: String,
    /// Its folder: the files `read_skill` may return are below it.
    pub dir: PathBuf,
}

/// The longest description a prompt lists (Claude Code's limit).
pub const DESCRIPTION_LIMIT: usize = 1024;
