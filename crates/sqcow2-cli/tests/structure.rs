//! The workspace's shape, as `docs/vhost.md` and `docs/architecture.md`
//! describe it: no module of a crate imports one that imports it back
//! (through `crate::` and `super::` paths, unit tests aside), and the
//! vhost crate's layers import only downwards (transport <- device <-
//! daemon).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module path (`a::b`, "" for the crate root) -> source text.
fn modules(src: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(
                parts.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                parts.pop();
            }
            let text = std::fs::read_to_string(&path).unwrap();
            out.insert(parts.join("::"), code_of(&text));
        }
    }
    out
}

/// `text` without its unit tests and line comments.
fn code_of(text: &str) -> String {
    let mut code = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim();
        if trimmed == "#[cfg(test)]"
            && lines
                .peek()
                .is_some_and(|next| next.trim().starts_with("mod tests"))
        {
            break;
        }
        let line = match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        };
        code.push_str(line);
        code.push('\n');
    }
    code
}

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The paths named after each `crate::` and `super::` in `code`, as
/// segments relative to the crate root.
fn paths_named(module: &str, code: &str) -> Vec<Vec<String>> {
    let parent: Vec<String> = module
        .split("::")
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect::<Vec<_>>()
        .split_last()
        .map_or(Vec::new(), |(_, rest)| rest.to_vec());
    let mut out = Vec::new();
    for (keyword, base) in [("crate::", Vec::new()), ("super::", parent)] {
        let mut rest = code;
        while let Some(at) = rest.find(keyword) {
            let before = rest[..at].chars().next_back();
            rest = &rest[at + keyword.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let mut heads = Vec::new();
            if let Some(group) = rest.strip_prefix('{') {
                // `crate::{a, b::c}`: the first segment of each.
                let close = group.find('}').unwrap_or(group.len());
                for item in group[..close].split(',') {
                    heads.push(vec![ident_at(item.trim()).to_string()]);
                }
            } else {
                let mut segs = Vec::new();
                let mut s = rest;
                loop {
                    let id = ident_at(s);
                    if id.is_empty() {
                        break;
                    }
                    segs.push(id.to_string());
                    match s[id.len()..].strip_prefix("::") {
                        Some(next) => s = next,
                        None => break,
                    }
                }
                heads.push(segs);
            }
            for segs in heads {
                let mut path = base.clone();
                path.extend(segs);
                out.push(path);
            }
        }
    }
    out
}

/// The import graph of the crate whose sources are in `src`.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mods = modules(src);
    let mut g = BTreeMap::new();
    for (name, code) in &mods {
        let mut deps = BTreeSet::new();
        for path in paths_named(name, code) {
            // The longest prefix that is a module.
            for k in (1..=path.len()).rev() {
                let target = path[..k].join("::");
                if mods.contains_key(&target) {
                    if &target != name {
                        deps.insert(target);
                    }
                    break;
                }
            }
        }
        g.insert(name.clone(), deps);
    }
    g
}

/// The strongly connected components with more than one module.
fn cycles(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    // Two modules are in one cycle iff each reaches the other.
    let reach = |from: &String| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(m) = todo.pop() {
            for d in g.get(&m).into_iter().flatten() {
                if seen.insert(d.clone()) {
                    todo.push(d.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> = g.keys().map(|m| (m, reach(m))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for m in g.keys() {
        if done.contains(m) {
            continue;
        }
        let comp: Vec<String> = reaches[m]
            .iter()
            .filter(|o| *o != m && reaches[*o].contains(m))
            .cloned()
            .collect();
        if !comp.is_empty() {
            let mut comp = comp;
            comp.push(m.clone());
            comp.sort();
            done.extend(comp.iter().cloned());
            out.push(comp);
        }
    }
    out
}

#[test]
fn no_crate_has_an_import_cycle() {
    let crates = common::workspace_root().join("crates");
    let mut found = Vec::new();
    let mut counted = 0;
    for entry in std::fs::read_dir(&crates).unwrap().flatten() {
        let src = entry.path().join("src");
        if !src.is_dir() {
            continue;
        }
        let g = graph(&src);
        counted += g.len();
        for c in cycles(&g) {
            found.push(format!(
                "{}: {}",
                entry.file_name().to_string_lossy(),
                c.join(" <-> ")
            ));
        }
    }
    assert!(counted > 100, "only {counted} modules found: wrong root?");
    assert!(found.is_empty(), "import cycles:\n{}", found.join("\n"));
}

#[test]
fn vhost_layers_import_only_downwards() {
    let g = graph(&common::workspace_root().join("crates/sqcow2-vhost/src"));
    let rank = |m: &str| match m.split("::").next() {
        Some("transport") => Some(0),
        Some("device") => Some(1),
        Some("daemon") => Some(2),
        _ => None,
    };
    let mut upward = Vec::new();
    for (from, deps) in &g {
        for to in deps {
            if let (Some(a), Some(b)) = (rank(from), rank(to)) {
                if a < b {
                    upward.push(format!("{from} -> {to}"));
                }
            }
        }
    }
    assert!(
        g.keys().any(|m| m.starts_with("transport::"))
            && g.keys().any(|m| m.starts_with("daemon::")),
        "the layers moved: update this test and docs/vhost.md"
    );
    assert!(
        upward.is_empty(),
        "imports against the layering:\n{}",
        upward.join("\n")
    );
}

/// The checker itself finds a cycle where there is one.
#[test]
fn a_cycle_is_found() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    std::fs::write(src.join("lib.rs"), "mod a;\nmod b;\nmod c;\n").unwrap();
    std::fs::write(src.join("a.rs"), "use crate::b::B;\n").unwrap();
    std::fs::write(src.join("b.rs"), "use crate::{c::C, a};\n").unwrap();
    std::fs::write(src.join("c.rs"), "// crate::a::A in a comment\n").unwrap();
    let g = graph(src);
    assert_eq!(cycles(&g), vec![vec!["a".to_string(), "b".to_string()]]);
}
