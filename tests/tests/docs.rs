//! Docs that stay true: docs/ARCHITECTURE.md is a map, under 300 lines,
//! that names only files that exist and covers every crate of the
//! workspace; the README's Layout table names only folders that exist.
//!
//! The one rule for paths in ARCHITECTURE.md: a path in backticks is written
//! from the repository's root (`actors/src/job/settlement.rs`, never
//! `job/settlement.rs`); a markdown link is relative to docs/, where the map
//! lives.

use std::path::{Path, PathBuf};

/// The repository's root: this crate lives in `<root>/tests`.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the repository")
        .to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Where a path named in a document is resolved from.
#[derive(Clone, Copy, Debug)]
enum Base {
    /// Inside backticks: from the repository's root.
    Root,
    /// A link target: from docs/.
    Docs,
}

/// Endings that make a token a file's name even without a '/'.
const FILE_ENDINGS: [&str; 7] = [".rs", ".md", ".toml", ".json", ".sh", ".yaml", ".yml"];

/// The path a token names, if it names one. `run.rs:589` names `run.rs`
/// and `journal.md#closing` names `journal.md`. A token with a space is
/// prose or a command, and one with a `*` is a pattern: neither is a path.
fn as_path(token: &str) -> Option<&str> {
    let token = token.trim();
    let token = token.split('#').next().unwrap_or_default();
    let token = token.split(':').next().unwrap_or_default();
    let looks_like_one = token.contains('/') || FILE_ENDINGS.iter().any(|e| token.ends_with(e));
    (looks_like_one && !token.contains(' ') && !token.contains('*')).then_some(token)
}

/// Every path a markdown text names: its line, where it resolves from, and
/// the path. Fenced code blocks are skipped: they hold drawings, commands
/// and output, not references.
fn named_paths(text: &str) -> Vec<(usize, Base, String)> {
    let mut found = vec![];
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Code spans are the odd pieces of the line split on backticks.
        for code in line.split('`').skip(1).step_by(2) {
            if let Some(path) = as_path(code) {
                found.push((i + 1, Base::Root, path.to_string()));
            }
        }
        // Link targets: what follows "](" up to the next ")".
        let mut rest = line;
        while let Some(start) = rest.find("](") {
            rest = &rest[start + 2..];
            let Some(end) = rest.find(')') else {
                break;
            };
            let target = &rest[..end];
            rest = &rest[end + 1..];
            let elsewhere = ["http://", "https://", "mailto:", "#"]
                .iter()
                .any(|prefix| target.starts_with(prefix));
            if elsewhere {
                continue;
            }
            if let Some(path) = as_path(target) {
                found.push((i + 1, Base::Docs, path.to_string()));
            }
        }
    }
    found
}

/// The text of a `## ` section, up to the next one.
fn section<'a>(text: &'a str, heading: &str) -> &'a str {
    let start = text
        .find(heading)
        .unwrap_or_else(|| panic!("no section {heading:?}"));
    let body = &text[start + heading.len()..];
    match body.find("\n## ") {
        Some(end) => &body[..end],
        None => body,
    }
}

/// The folders of the root Cargo.toml's `members = [...]`, on one line or many.
fn workspace_members(cargo_toml: &str) -> Vec<String> {
    let (_, after) = cargo_toml
        .split_once("\nmembers")
        .expect("the root Cargo.toml has a members list");
    let open = after.find('[').expect("members = [");
    let close = after.find(']').expect("members = [...]");
    after[open + 1..close]
        .split(',')
        .map(|member| member.trim().trim_matches('"').to_string())
        .filter(|member| !member.is_empty())
        .collect()
}

#[test]
fn architecture_names_only_paths_that_exist() {
    let root = root();
    let text = read(&root.join("docs/ARCHITECTURE.md"));
    let named = named_paths(&text);
    assert!(
        named.len() > 50,
        "the map names files; the extraction found only {named:?}"
    );
    let missing: Vec<String> = named
        .iter()
        .filter(|(_, base, path)| {
            let full = match base {
                Base::Root => root.join(path),
                Base::Docs => root.join("docs").join(path),
            };
            !full.exists()
        })
        .map(|(line, base, path)| format!("docs/ARCHITECTURE.md:{line}: {path} (from {base:?})"))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/ARCHITECTURE.md names paths that do not exist (in backticks, write a path \
         from the repository's root; a link, from docs/):\n{}",
        missing.join("\n")
    );
    let lines = text.lines().count();
    assert!(
        lines < 300,
        "docs/ARCHITECTURE.md has {lines} lines; it is the map: keep it under 300 and move \
         detail to the topic docs"
    );
}

#[test]
fn architecture_names_every_crate_folder_and_the_readme_only_folders_that_exist() {
    let root = root();
    let map = read(&root.join("docs/ARCHITECTURE.md"));
    let code_map = section(&map, "## Code map");
    let members = workspace_members(&read(&root.join("Cargo.toml")));
    assert!(!members.is_empty(), "the workspace has members");
    let unmapped: Vec<&String> = members
        .iter()
        .filter(|member| !code_map.contains(&format!("{member}/")))
        .collect();
    assert!(
        unmapped.is_empty(),
        "workspace members missing from ARCHITECTURE.md's code map: {unmapped:?}"
    );

    let readme = read(&root.join("README.md"));
    let layout = section(&readme, "## Layout");
    // Rows like "| `protocol/` | plain data ... |".
    let folders: Vec<&str> = layout
        .lines()
        .filter_map(|row| row.strip_prefix("| `"))
        .filter_map(|row| row.split('`').next())
        .filter(|folder| folder.ends_with('/'))
        .collect();
    assert!(
        !folders.is_empty(),
        "the README's Layout table lists folders"
    );
    let absent: Vec<&&str> = folders
        .iter()
        .filter(|folder| !root.join(folder).is_dir())
        .collect();
    assert!(
        absent.is_empty(),
        "README.md's Layout names folders that do not exist: {absent:?}"
    );
}
