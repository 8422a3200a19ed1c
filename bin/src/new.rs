//! `arbor new agent NAME` and `arbor new skill NAME`: a file a person fills
//! in, that loads as it is. Nothing is overwritten.

use std::path::{Path, PathBuf};

/// agent.md with every key arbor reads, commented, and what each takes.
const AGENT: &str = r#"---
# name: {name}                   # the folder's name, if given at all
description: What {name} does, in one line. A parent's model picks sub-agents by it.
# model: scripted                 # or provider/model from arbor.toml (scripted is the default)
# models: [hosted/small, hosted/large]   # the models a parent may put a job of it on; model among them
# temperature: 0.2                # 0 to 2, over the model entry's default
# top_p: 0.9                      # above 0, at most 1 (not with temperature on Anthropic)
# effort: medium                  # low | medium | high: OpenAI's reasoning_effort (not with temperature or top_p)
# tools: [exec, read_file, write_file, mcp__SERVER__TOOL]
# mcp: [SERVER]                   # every tool of arbor.toml's [mcp.servers.SERVER]
# deny: [exec, "mcp__fs__*"]      # never these, here and below
# approve: [write_file]           # these wait for a person, here and below
# limits: { exec: 20, calls: 100 }   # the most calls one job makes, per tool and in all
# subagents: [helper]             # each needs a description; delegate takes only these names
# skills: [SKILL]                 # skills/SKILL/SKILL.md, listed in the prompt, read with read_skill
# sandbox: shared                 # or own: a sandbox of its own, which may not delegate
# network: none                   # or open
# secrets: [API_TOKEN]            # values from [sandbox] secrets_file or the node's environment
# budget: { tokens: 50000, usd: 0.50 }   # the most one job may be granted
# max_turns: 20
# max_repeats: 3                  # the same call this many times in a row gets a notice
# timeout: 10m
# resources: { memory: 1GiB, cpu: 120s, file_size: 100MiB, open_files: 256, processes: 64 }
script:                           # the scripted model's turns, one reply each; a provider's model ignores it
  - say: "Working on it."
    call: { tool: submit_output, args: { output: "{name} answers here once it is written" } }
---
You are {name}. Say what it does, what it is given, and what a good answer is.
"#;

/// SKILL.md: the format Claude Code and other agents share.
const SKILL: &str = r#"---
name: {name}
description: What {name} is for and when to read it, in a line or two. Agents' prompts list this.
---
# {name}

The instructions an agent reads with `read_skill` before work this skill
covers. A file beside this one is read with `read_skill {name: {name}, file: PATH}`.
"#;

/// Writes `agents/NAME/agent.md` or `skills/NAME/SKILL.md` below
/// `workspace`; returns the file written.
pub fn write(kind: Kind, name: &str, workspace: &Path) -> Result<PathBuf, String> {
    // The loader's own rule: a name written here is one it reads.
    arbor_runtime::workspace::check_name(kind.word(), name)?;
    let (folder, file, template) = match kind {
        Kind::Agent => ("agents", "agent.md", AGENT),
        Kind::Skill => ("skills", "SKILL.md", SKILL),
    };
    let dir = workspace.join(folder).join(name);
    let path = dir.join(file);
    if dir.exists() {
        return Err(format!(
            "{} already exists; nothing was written",
            dir.display()
        ));
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let text = template.replace("{name}", name);
    std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Kind {
    Agent,
    Skill,
}

impl Kind {
    fn word(self) -> &'static str {
        match self {
            Kind::Agent => "agent",
            Kind::Skill => "skill",
        }
    }
}
