//! `skills/NAME/SKILL.md`: YAML front matter (`name`, `description`)
//! between `---` lines, then the skill's instructions. Other keys of the
//! format (`license`, `allowed-tools`, `metadata`, ...) are read past, so a
//! skill written for another agent loads as it is.

use super::agent::split_front_matter;
use super::parse::{LoadError, check_name, invalid};
use arbor_protocol::Skill;
use arbor_protocol::skill::DESCRIPTION_LIMIT;
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Deserialize)]
struct SkillFront {
    name: Option<String>,
    description: Option<String>,
}

/// Parses one SKILL.md of the folder `dir` named `folder_name`; `path`
/// names the file in errors.
pub fn parse_skill(
    folder_name: &str,
    text: &str,
    dir: PathBuf,
    path: &Path,
) -> Result<Skill, LoadError> {
    check_name("skill", folder_name).map_err(|m| invalid(path, m))?;
    let (yaml, body) = split_front_matter(text).map_err(|m| invalid(path, m))?;
    let front: SkillFront =
        serde_saphyr::from_str(yaml).map_err(|e| invalid(path, format!("front matter: {e}")))?;
    match front.name.as_deref().map(str::trim) {
        Some(name) if name == folder_name => {}
        Some(name) => {
            return Err(invalid(
                path,
                format!("name: {name:?} is not its folder's name, {folder_name:?}"),
            ));
        }
        None => {
            return Err(invalid(
                path,
                format!("name: missing; write `name: {folder_name}`"),
            ));
        }
    }
    let description = front.description.unwrap_or_default().trim().to_string();
    if description.is_empty() {
        return Err(invalid(
            path,
            "description: missing; say what the skill is for and when to read it (agents' \
             prompts list it)",
        ));
    }
    if description.chars().count() > DESCRIPTION_LIMIT {
        return Err(invalid(
            path,
            format!("description: longer than {DESCRIPTION_LIMIT} characters"),
        ));
    }
    Ok(Skill {
        name: folder_name.to_string(),
        description,
        body: body.to_string(),
        dir,
    })
}
