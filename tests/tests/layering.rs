//! The files of a crate import one way: no two modules of one product
//! crate name each other, directly or through others. A module names
//! another by a `crate::` path, a `super::` path (a sibling, or its parent),
//! or a path that starts with one of its own children. Test code (after
//! `#[cfg(test)]`) is left out: a test may reach anywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Every module of the crate whose sources are in `src`, by its path
/// (`job::settlement`; the crate root is ""), with its text before its tests.
fn modules(src: &Path) -> BTreeMap<String, String> {
    let mut found = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("a source folder") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let Some(rel) = path.strip_prefix(src).ok().and_then(|p| p.to_str()) else {
                continue;
            };
            let Some(rel) = rel.strip_suffix(".rs") else {
                continue;
            };
            let name = if rel == "lib" {
                String::new()
            } else {
                rel.replace('/', "::")
            };
            let text = std::fs::read_to_string(&path).expect("a source file");
            let code = text
                .split("#[cfg(test)]")
                .next()
                .unwrap_or_default()
                .to_string();
            found.insert(name, code);
        }
    }
    found
}

/// The `a::b::c` path that starts right after `at` in `text`.
fn path_after(text: &str, at: usize) -> Vec<&str> {
    let rest = &text[at..];
    let end = rest
        .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(rest.len());
    rest[..end].split("::").filter(|p| !p.is_empty()).collect()
}

/// The longest prefix of `base ++ parts` that is a module.
fn resolve(mods: &BTreeMap<String, String>, base: &[&str], parts: &[&str]) -> Option<String> {
    let full: Vec<&str> = base.iter().chain(parts).copied().collect();
    (base.len() + 1..=full.len())
        .rev()
        .map(|n| full[..n].join("::"))
        .find(|m| mods.contains_key(m))
}

/// What each module names.
fn imports(mods: &BTreeMap<String, String>) -> BTreeMap<&str, BTreeSet<String>> {
    let mut graph = BTreeMap::new();
    for (name, code) in mods {
        let own: Vec<&str> = name.split("::").filter(|p| !p.is_empty()).collect();
        let parent = &own[..own.len().saturating_sub(1)];
        let mut named = BTreeSet::new();
        for (at, _) in code.match_indices("crate::") {
            named.extend(resolve(mods, &[], &path_after(code, at + 7)));
        }
        for (at, _) in code.match_indices("super::") {
            let after = &code[at + 7..];
            if let Some(list) = after.strip_prefix('{') {
                let list = &list[..list.find('}').unwrap_or(list.len())];
                for item in list.split(',') {
                    let first = item.trim().split("::").next().unwrap_or_default();
                    let first = first.split_whitespace().next().unwrap_or_default();
                    named.extend(resolve(mods, parent, &[first]).or(Some(parent.join("::"))));
                }
            } else {
                let path = path_after(code, at + 7);
                named.extend(resolve(mods, parent, &path).or(Some(parent.join("::"))));
            }
        }
        // A child named by a path relative to this module (`overlay::Work`).
        for child in mods.keys() {
            let is_child = match child.rsplit_once("::") {
                Some((up, _)) => up == name,
                None => name.is_empty() && !child.is_empty(),
            };
            let leaf = child.rsplit("::").next().unwrap_or_default();
            let pattern = format!("{leaf}::");
            let used = code.match_indices(&pattern).any(|(at, _)| {
                let before = code[..at].chars().next_back();
                !before.is_some_and(|c| c == ':' || c.is_alphanumeric() || c == '_')
            });
            if is_child && used {
                named.insert(child.clone());
            }
        }
        named.remove(name);
        named.remove("");
        graph.insert(name.as_str(), named);
    }
    graph
}

/// The first loop found, as the modules on it, if there is one.
fn a_loop(graph: &BTreeMap<&str, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        graph: &BTreeMap<&str, BTreeSet<String>>,
        at: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|m| m == at) {
            return Some(path[start..].to_vec());
        }
        if !done.insert(at.to_string()) {
            return None;
        }
        path.push(at.to_string());
        for next in graph.get(at).into_iter().flatten() {
            if let Some(found) = visit(graph, next, path, done) {
                return Some(found);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|start| visit(graph, start, &mut vec![], &mut done))
}

#[test]
fn no_two_files_of_a_crate_import_each_other() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the repository");
    for krate in [
        "protocol",
        "storage",
        "sandbox",
        "actors",
        "providers",
        "runtime",
        "service",
    ] {
        let mods = modules(&root.join(krate).join("src"));
        assert!(mods.len() > 3, "{krate}: too few modules found: {mods:?}");
        let graph = imports(&mods);
        if let Some(cycle) = a_loop(&graph) {
            panic!("{krate}/src: these modules import each other in a loop: {cycle:?}");
        }
    }
}

/// The check itself sees a loop where there is one.
#[test]
fn a_loop_between_two_modules_is_found() {
    let mods: BTreeMap<String, String> = [
        ("".to_string(), "mod a; mod b;".to_string()),
        ("a".to_string(), "use crate::b::Thing;".to_string()),
        ("b".to_string(), "use super::{a::Other};".to_string()),
        ("c".to_string(), "use crate::a::X;".to_string()),
    ]
    .into();
    let found = a_loop(&imports(&mods)).expect("a and b name each other");
    assert_eq!(found.len(), 2, "{found:?}");
    let one_way: BTreeMap<String, String> = [
        ("a".to_string(), "use crate::b::Thing;".to_string()),
        ("b".to_string(), "fn f() {}".to_string()),
    ]
    .into();
    assert_eq!(a_loop(&imports(&one_way)), None);
}

/// The crates `cargo tree` finds under `package` (normal dependencies only).
fn dependencies(package: &str, features: &[&str]) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args([
            "tree",
            "--locked",
            "--offline",
            "-e",
            "normal",
            "-p",
            package,
        ])
        .args(features)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// An embedder of runtime that leaves out the HTTP providers builds no HTTP
/// client; the default build has one (so the check can see it).
#[test]
fn runtime_without_its_http_feature_builds_no_reqwest() {
    let lean = dependencies("arbor-runtime", &["--no-default-features"]);
    assert!(lean.contains("arbor-providers"), "{lean}");
    assert!(!lean.contains("reqwest"), "{lean}");
    assert!(dependencies("arbor-runtime", &[]).contains("reqwest v"));
}
