//! The layering check: no import cycle between the modules of any crate of the workspace.
//!
//! A module's imports are the `crate::a::b` (and `crate::{a, b::c}`) paths and the
//! `super::sibling` paths of its file, comments left out; tests count (a test module that
//! imports a higher layer ties its module to that layer as much as its code would). Each
//! such path is an edge between the two modules where the importer's path and the imported
//! path part: `ratelimit-user/src/fleet/peers.rs` importing `crate::config::check_host_id` is
//! the edge `fleet → config` between the crate's top-level modules; importing
//! `crate::fleet::dup::IdGuard` is the edge `peers → dup` among the modules of `fleet/`. A
//! module's own items used by its children (`super::Conn`, `crate::fleet::Settings` from
//! `fleet/peers.rs`) are no edge: a folder's `mod.rs` (or `fleet.rs`) is the layer its children
//! build on. Every folder's modules, and every crate's top level, must form no cycle: a module
//! only imports from modules below it. `cargo xtask test` runs this as a host test.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

/// A module: its path inside its crate (`["fleet", "peers"]`).
type ModPath = Vec<String>;

/// The `src` directories whose modules are checked.
pub const CRATES: &[&str] = &[
    "ratelimit-common/src",
    "ratelimit-ebpf/src",
    "ratelimit-ebpf-build/src",
    "ratelimit-user/src",
    "xtask/src",
    "tests/src",
    "bench/src",
    "bench-ebpf/src",
];

/// An edge between sibling modules, with where the import that makes it is.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Edge {
    pub parent: ModPath,
    pub from: String,
    pub to: String,
    pub at: String,
}

/// The module path of a source file relative to `src` (`fleet/mod.rs` and `fleet.rs` are
/// `fleet`; `lib.rs` and `main.rs` are the root, `[]`).
fn module_of(rel: &Path) -> ModPath {
    let mut parts: Vec<String> = rel
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|l| l == "mod") {
        parts.pop();
    }
    if parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main") {
        parts.clear();
    }
    parts
}

/// The text of a file as the check reads it: `//` comments cut off.
fn code_of(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths a `{...}` group names, from just after its `{`: each as its segments (nested
/// groups expanded), and the index after the closing `}`.
fn group(s: &[char], mut i: usize) -> (Vec<Vec<String>>, usize) {
    let mut out = Vec::new();
    let mut current: Vec<String> = Vec::new();
    let mut word = String::new();
    while i < s.len() {
        let c = s[i];
        if is_ident(c) {
            word.push(c);
        } else {
            if !word.is_empty() {
                current.push(std::mem::take(&mut word));
            }
            match c {
                '{' => {
                    let (inner, next) = group(s, i + 1);
                    for p in inner {
                        let mut full = current.clone();
                        full.extend(p);
                        out.push(full);
                    }
                    current.clear();
                    i = next;
                    continue;
                }
                '}' => {
                    if !current.is_empty() {
                        out.push(current);
                    }
                    return (out, i + 1);
                }
                ',' if !current.is_empty() => {
                    out.push(std::mem::take(&mut current));
                }
                // `a::b` separators, `as`, whitespace: the words collect the segments.
                _ => {}
            }
        }
        i += 1;
    }
    (out, i)
}

/// Every path after `prefix::` in `code` (`crate` or `super`), as segments.
fn paths_after(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let chars: Vec<char> = code.chars().collect();
    let pat: Vec<char> = format!("{prefix}::").chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i + pat.len() <= chars.len() {
        let starts = chars[i..i + pat.len()] == pat[..] && (i == 0 || !is_ident(chars[i - 1]));
        if !starts {
            i += 1;
            continue;
        }
        let mut j = i + pat.len();
        if chars.get(j) == Some(&'{') {
            let (paths, next) = group(&chars, j + 1);
            out.extend(paths);
            i = next;
            continue;
        }
        let mut segs = Vec::new();
        loop {
            let start = j;
            while j < chars.len() && is_ident(chars[j]) {
                j += 1;
            }
            if j == start {
                break;
            }
            segs.push(chars[start..j].iter().collect());
            if chars.get(j) == Some(&':') && chars.get(j + 1) == Some(&':') {
                j += 2;
                if chars.get(j) == Some(&'{') {
                    let (paths, next) = group(&chars, j + 1);
                    for p in paths {
                        let mut full = segs.clone();
                        full.extend(p);
                        out.push(full);
                    }
                    segs.clear();
                    j = next;
                    break;
                }
            } else {
                break;
            }
        }
        if !segs.is_empty() {
            out.push(segs);
        }
        i = j.max(i + 1);
    }
    out
}

/// The source files below `dir` (sorted).
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// The edges between sibling modules of the crate whose sources are in `src`.
pub fn edges(src: &Path) -> Vec<Edge> {
    let files = rust_files(src);
    let modules: BTreeSet<ModPath> = files
        .iter()
        .map(|f| module_of(f.strip_prefix(src).expect("below src")))
        .collect();
    let mut out = BTreeSet::new();
    for f in &files {
        let rel = f.strip_prefix(src).expect("below src");
        let me = module_of(rel);
        if me.is_empty() {
            continue;
        }
        let code = code_of(&std::fs::read_to_string(f).unwrap_or_default());
        let mut targets = paths_after(&code, "crate");
        let parent = &me[..me.len() - 1];
        for p in paths_after(&code, "super") {
            let mut full = parent.to_vec();
            full.extend(p);
            targets.push(full);
        }
        for target in targets {
            // Where the two paths part, if both go on as modules there.
            let common = me.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if common >= me.len() || common >= target.len() {
                continue; // a module's own items or its children's
            }
            let to_module = target[..=common].to_vec();
            if !modules.contains(&to_module) {
                continue; // an item of the common parent
            }
            out.insert(Edge {
                parent: me[..common].to_vec(),
                from: me[common].clone(),
                to: target[common].clone(),
                at: rel.display().to_string(),
            });
        }
    }
    out.into_iter().collect()
}

/// The cycles among sibling modules (each as its modules, sorted), by folder.
pub fn cycles(edges: &[Edge]) -> Vec<(ModPath, Vec<String>)> {
    let mut graphs: BTreeMap<&ModPath, BTreeMap<&str, BTreeSet<&str>>> = BTreeMap::new();
    for e in edges {
        let g = graphs.entry(&e.parent).or_default();
        g.entry(&e.from).or_default().insert(&e.to);
        g.entry(&e.to).or_default();
    }
    let mut out = Vec::new();
    for (parent, g) in graphs {
        for comp in strongly_connected(&g) {
            if comp.len() > 1 {
                out.push((parent.clone(), comp));
            }
        }
    }
    out
}

/// Tarjan's strongly connected components of `g`.
fn strongly_connected(g: &BTreeMap<&str, BTreeSet<&str>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        g: &'a BTreeMap<&'a str, BTreeSet<&'a str>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(w: &mut Walk<'a>, v: &'a str) {
        let n = w.index.len();
        w.index.insert(v, n);
        w.low.insert(v, n);
        w.stack.push(v);
        w.on.insert(v);
        for &u in &w.g[v] {
            if !w.index.contains_key(u) {
                visit(w, u);
                let l = w.low[v].min(w.low[u]);
                w.low.insert(v, l);
            } else if w.on.contains(u) {
                let l = w.low[v].min(w.index[u]);
                w.low.insert(v, l);
            }
        }
        if w.low[v] == w.index[v] {
            let mut comp = Vec::new();
            while let Some(u) = w.stack.pop() {
                w.on.remove(u);
                comp.push(u.to_string());
                if u == v {
                    break;
                }
            }
            comp.sort();
            w.out.push(comp);
        }
    }
    let mut w = Walk {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for &v in g.keys() {
        if !w.index.contains_key(v) {
            visit(&mut w, v);
        }
    }
    w.out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("workspace")
            .to_path_buf()
    }

    #[test]
    fn no_crate_has_an_import_cycle_between_its_modules() {
        let mut found = Vec::new();
        for krate in CRATES {
            let src = root().join(krate);
            assert!(src.is_dir(), "{} is not a directory", src.display());
            let edges = edges(&src);
            for (parent, comp) in cycles(&edges) {
                let folder = if parent.is_empty() {
                    String::new()
                } else {
                    format!("{}/", parent.join("/"))
                };
                let mut why = Vec::new();
                for e in edges.iter().filter(|e| {
                    e.parent == parent && comp.contains(&e.from) && comp.contains(&e.to)
                }) {
                    why.push(format!("    {} -> {} ({})", e.from, e.to, e.at));
                }
                found.push(format!(
                    "{krate}/{folder}: {} import each other:\n{}",
                    comp.join(", "),
                    why.join("\n")
                ));
            }
        }
        assert!(
            found.is_empty(),
            "import cycles (a module only imports from modules below it):\n{}",
            found.join("\n")
        );
    }

    #[test]
    fn paths_are_read_from_groups_nested_groups_and_super() {
        let code = "use crate::{a::{b, c::D}, e as f};\nlet x = crate::g::h(1);\nuse super::k::L;";
        assert_eq!(
            paths_after(code, "crate"),
            [
                vec!["a", "b"],
                vec!["a", "c", "D"],
                vec!["e", "as", "f"],
                vec!["g", "h"],
            ]
        );
        assert_eq!(paths_after(code, "super"), [vec!["k", "L"]]);
        assert_eq!(code_of("let a = 1; // crate::x\n"), "let a = 1; ");
    }

    #[test]
    fn a_cycle_is_found_with_the_imports_that_make_it() {
        let dir = std::env::temp_dir().join(format!("xtask-layers-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("fleet")).unwrap();
        std::fs::write(dir.join("lib.rs"), "pub mod config; pub mod fleet;").unwrap();
        std::fs::write(dir.join("config.rs"), "use crate::fleet::Keys;").unwrap();
        std::fs::write(
            dir.join("fleet.rs"),
            "pub mod peers; pub mod dup; use crate::config;",
        )
        .unwrap();
        // A child using its parent's items, and a sibling: no cycle.
        std::fs::write(dir.join("fleet/peers.rs"), "use super::{Conn, dup::Guard};").unwrap();
        std::fs::write(
            dir.join("fleet/dup.rs"),
            "use crate::fleet::Conn; // crate::fleet::peers",
        )
        .unwrap();
        let e = edges(&dir);
        let c = cycles(&e);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            c,
            [(vec![], vec!["config".to_string(), "fleet".to_string()])]
        );
        assert!(e.contains(&Edge {
            parent: vec!["fleet".into()],
            from: "peers".into(),
            to: "dup".into(),
            at: "fleet/peers.rs".into(),
        }));
        assert_eq!(e.len(), 3, "{e:?}");
    }
}
