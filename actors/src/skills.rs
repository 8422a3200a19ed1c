//! `read_skill`: a skill's instructions, or a file beside them, for a job
//! that may read it.
//!
//! Invariants:
//! 1. A job reads only the skills its policy holds: its agent's, cut to
//!    every ancestor's (I-25). Another is refused, naming those it may read.
//! 2. A file is returned only if it is a regular file below the skill's
//!    folder, opened as `read_file` opens one (`arbor_sandbox::files`):
//!    an absolute path, a `..`, a symlink, a folder or a device is refused
//!    and nothing is read.

use crate::policy::Policy;
use arbor_protocol::{AgentDef, ReadSkillArgs, Skill};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// The most of a skill's file a model is given, in bytes.
pub const FILE_LIMIT: u64 = 256 * 1024;

/// The skills a job of `agent` under `policy` is shown, in its agent's
/// order (a name the catalogue lacks is left out: a loaded workspace has
/// them all).
pub fn listed(
    catalog: &BTreeMap<String, Arc<Skill>>,
    agent: &AgentDef,
    policy: &Policy,
) -> Vec<Arc<Skill>> {
    policy
        .readable_skills(agent)
        .into_iter()
        .filter_map(|name| catalog.get(name).cloned())
        .collect()
}

/// What `read_skill` answers a job of `agent` under `policy`.
pub async fn read(
    catalog: &BTreeMap<String, Arc<Skill>>,
    agent: &AgentDef,
    policy: &Policy,
    args: ReadSkillArgs,
) -> Result<String, String> {
    let readable = policy.readable_skills(agent);
    let name = args.name.trim();
    if !readable.contains(&name) {
        let why = if agent.skills.iter().any(|s| s == name) {
            "its parent may not read it, so neither may this job"
        } else {
            "it is not among this agent's skills"
        };
        return Err(format!(
            "skill {name:?} cannot be read: {why}; read one of: {}",
            readable.join(", ")
        ));
    }
    let Some(skill) = catalog.get(name) else {
        return Err(format!("skill {name:?} is not in this node's workspace"));
    };
    match args.file.as_deref().map(str::trim) {
        None | Some("" | "SKILL.md") => Ok(skill.body.clone()),
        Some(file) => {
            let (dir, file) = (skill.dir.clone(), file.to_string());
            tokio::task::spawn_blocking(move || read_file(&dir, &file))
                .await
                .map_err(|e| format!("the read failed: {e}"))?
                .map_err(|why| format!("skill {name:?}: {why}"))
        }
    }
}

/// `file` of the skill in `dir`, if it is a regular file below it.
fn read_file(dir: &Path, file: &str) -> Result<String, String> {
    arbor_sandbox::files::read_below(dir, file, "the skill's folder", FILE_LIMIT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_outside_the_skill_folder_is_never_read() {
        let dir = tempfile::tempdir().unwrap();
        let skill = dir.path().join("deploy");
        std::fs::create_dir_all(skill.join("refs")).unwrap();
        std::fs::write(skill.join("refs/steps.md"), "step one").unwrap();
        std::fs::write(dir.path().join("secret.txt"), "outside").unwrap();
        std::os::unix::fs::symlink(dir.path().join("secret.txt"), skill.join("link.md")).unwrap();

        assert_eq!(read_file(&skill, "refs/steps.md").unwrap(), "step one");
        assert_eq!(read_file(&skill, "./refs/steps.md").unwrap(), "step one");
        for bad in ["../secret.txt", "/etc/passwd", "link.md", "refs", "nope.md"] {
            let err = read_file(&skill, bad).unwrap_err();
            assert!(!err.contains("outside"), "{bad}: {err}");
        }
        assert!(
            read_file(&skill, "link.md")
                .unwrap_err()
                .contains("symlink")
        );
        assert!(
            read_file(&skill, "../x")
                .unwrap_err()
                .contains("leaves the skill's folder")
        );
        assert!(
            read_file(&skill, "refs")
                .unwrap_err()
                .contains("not a file")
        );
    }
}
