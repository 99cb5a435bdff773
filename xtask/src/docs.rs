//! Checks of the documentation against the tree, run by `cargo xtask test` with the host tests
//! (`cargo test -p xtask`):
//!
//! * the README's Layout table names every product source file, and every path it names
//!   exists;
//! * every relative link in `README.md` and `docs/*.md` points at a file or directory that
//!   exists, and a link's `#anchor` into a Markdown file names one of its headings.
//!
//! **The Layout table's format.** The table under the README's `## Layout` heading (up to the
//! next `## ` heading) has one row per path, the path alone in backticks in the first cell,
//! relative to the repository root:
//!
//! ```text
//! | `ratelimit-user/src/daemon.rs` | the daemon: ... |
//! | `tests/` | the lab ... |
//! ```
//!
//! A path ending in `/` is a directory. Rows whose first cell is anything else (the header,
//! the separator) are not paths.
//!
//! **Product source files** are the `*.rs` files under `src/` of every workspace member that
//! is not a tool of the workspace ([`TOOLING`]: the xtask, the kernel tests, the benchmark and
//! its XDP object), and their `build.rs`. Test-only modules (files named `tests.rs` or
//! `proptests.rs`, declared `#[cfg(test)]` by their parent) are left out: the parent's row
//! covers them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::util::workspace_root;

/// Workspace members that are tools, not the product: their files need no row of their own
/// (the table may name them by folder).
const TOOLING: &[&str] = &["xtask", "tests", "bench", "bench-ebpf"];

/// File names of test-only modules, covered by their parent module's row.
const TEST_ONLY: &[&str] = &["tests.rs", "proptests.rs"];

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The workspace members listed in the root `Cargo.toml` (`members = [ "a", "b", ... ]`).
fn workspace_members(root: &Path) -> Vec<String> {
    let manifest = read(&root.join("Cargo.toml"));
    let start = manifest
        .find("members = [")
        .expect("the root Cargo.toml lists its members");
    let list = &manifest[start + "members = [".len()..];
    let list = &list[..list.find(']').expect("the members list ends")];
    list.split(',')
        .map(|m| m.trim().trim_matches('"').to_string())
        .filter(|m| !m.is_empty())
        .collect()
}

/// Every `*.rs` file under `dir`, as paths relative to `root` with `/` separators.
fn rust_files(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.expect("reading a directory entry").path();
        if path.is_dir() {
            rust_files(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.insert(relative(root, &path));
        }
    }
}

fn relative(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .expect("under the root")
        .components()
        .map(|c| c.as_os_str().to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

/// The product source files the Layout table must name.
pub(crate) fn product_sources(root: &Path) -> BTreeSet<String> {
    let mut files = BTreeSet::new();
    for member in workspace_members(root) {
        if TOOLING.contains(&member.as_str()) {
            continue;
        }
        let dir = root.join(&member);
        rust_files(root, &dir.join("src"), &mut files);
        if dir.join("build.rs").is_file() {
            files.insert(format!("{member}/build.rs"));
        }
    }
    files.retain(|f| !TEST_ONLY.iter().any(|t| f.ends_with(&format!("/{t}"))));
    files
}

/// The paths in the first column of the table under `## Layout` (see the module's comment).
fn layout_paths(readme: &str) -> Vec<String> {
    let mut lines = readme.lines().skip_while(|l| l.trim() != "## Layout");
    assert!(
        lines.next().is_some(),
        "README.md has no `## Layout` section"
    );
    lines
        .take_while(|l| !l.starts_with("## "))
        .filter_map(|l| {
            let first = l.trim().strip_prefix('|')?.split('|').next()?.trim();
            let path = first.strip_prefix('`')?.strip_suffix('`')?;
            (!path.is_empty() && !path.contains('`')).then(|| path.to_string())
        })
        .collect()
}

/// The paths of `required` that the Layout table of `readme` does not name.
fn missing_rows(readme: &str, required: &BTreeSet<String>) -> Vec<String> {
    let named: BTreeSet<String> = layout_paths(readme).into_iter().collect();
    required.difference(&named).cloned().collect()
}

#[test]
fn layout_table_names_every_product_source_file() {
    let root = workspace_root();
    let required = product_sources(&root);
    assert!(
        required.contains("ratelimit-user/src/daemon.rs")
            && required.contains("ratelimit-ebpf/src/program.rs"),
        "the product crates were not found: {required:?}"
    );
    let missing = missing_rows(&read(&root.join("README.md")), &required);
    assert!(
        missing.is_empty(),
        "README.md's Layout table does not name these product source files; add a row \
         `| \\`PATH\\` | what it is |` for each:\n  {}",
        missing.join("\n  ")
    );
}

#[test]
fn layout_table_names_only_paths_that_exist() {
    let root = workspace_root();
    let paths = layout_paths(&read(&root.join("README.md")));
    assert!(
        paths.len() > 10,
        "the Layout table has too few rows: {paths:?}"
    );
    let gone: Vec<&String> = paths
        .iter()
        .filter(|p| {
            let full = root.join(p.trim_end_matches('/'));
            if p.ends_with('/') {
                !full.is_dir()
            } else {
                !full.is_file()
            }
        })
        .collect();
    assert!(
        gone.is_empty(),
        "README.md's Layout table names paths that do not exist (moved or removed?): {gone:?}"
    );
}

#[test]
fn layout_rows_are_read_as_documented() {
    let readme = "# x\n\n## Layout\n\n| path | what |\n|---|---|\n\
                  | `a/src/lib.rs` | the library |\n| `tests/` | tests |\n\
                  | not a path | x |\n| `a` and `b` | two |\n\n## Next\n| `c.rs` | after |\n";
    assert_eq!(layout_paths(readme), ["a/src/lib.rs", "tests/"]);
    let required: BTreeSet<String> = ["a/src/lib.rs", "a/src/gone.rs"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(missing_rows(readme, &required), ["a/src/gone.rs"]);
}

/// `README.md` and every `docs/*.md`.
fn documents(root: &Path) -> Vec<PathBuf> {
    let mut docs = vec![root.join("README.md")];
    let mut pages: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ exists")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.sort();
    docs.extend(pages);
    docs
}

/// Markdown text without fenced code blocks and inline code spans (blanked, so line numbers
/// stay), where a `[x](y)` is not a link.
fn prose(markdown: &str) -> String {
    let mut out = String::with_capacity(markdown.len());
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            out.push('\n');
            continue;
        }
        if !fenced {
            let mut in_code = false;
            for c in line.chars() {
                if c == '`' {
                    in_code = !in_code;
                }
                out.push(if in_code || c == '`' { ' ' } else { c });
            }
        }
        out.push('\n');
    }
    out
}

/// The targets of the inline links (`[text](target)`, `![alt](target)`) and reference
/// definitions (`[label]: target`) of `markdown`, with their line numbers.
fn link_targets(markdown: &str) -> Vec<(usize, String)> {
    let mut targets = Vec::new();
    for (i, line) in prose(markdown).lines().enumerate() {
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("");
            targets.push((i + 1, target.trim_matches(['<', '>']).to_string()));
            rest = &after[end..];
        }
        let trimmed = line.trim_start();
        if trimmed.starts_with('[')
            && let Some((_, target)) = trimmed.split_once("]: ")
        {
            let target = target.split_whitespace().next().unwrap_or("");
            targets.push((i + 1, target.trim_matches(['<', '>']).to_string()));
        }
    }
    targets
}

/// The anchor GitHub gives a heading: lowercase; letters, digits, `-` and `_` kept, spaces to
/// `-`, everything else (punctuation, backticks) dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's headings (repeated headings get `-1`, `-2`, ...).
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        let Some(heading) = line.strip_prefix('#').filter(|_| !fenced) else {
            continue;
        };
        let base = anchor(heading.trim_start_matches('#'));
        let mut name = base.clone();
        let mut n = 0;
        while seen.contains(&name) {
            n += 1;
            name = format!("{base}-{n}");
        }
        seen.insert(name);
    }
    seen
}

/// What is wrong with the relative links of `file` (text `markdown`): one line each.
fn broken_links(file: &Path, markdown: &str) -> Vec<String> {
    let dir = file.parent().expect("a file has a directory");
    let mut broken = Vec::new();
    for (line, target) in link_targets(markdown) {
        let external = ["http://", "https://", "mailto:"]
            .iter()
            .any(|scheme| target.starts_with(scheme));
        if external || target.is_empty() {
            continue;
        }
        let (path, fragment) = match target.split_once('#') {
            Some((path, fragment)) => (path, Some(fragment)),
            None => (target.as_str(), None),
        };
        let resolved = if path.is_empty() {
            file.to_path_buf()
        } else {
            dir.join(path)
        };
        let root = workspace_root();
        let shown = |p: &Path| p.strip_prefix(&root).unwrap_or(p).display().to_string();
        let at = format!("{}:{line}: ({target})", shown(file));
        if !resolved.exists() {
            broken.push(format!("{at}: {} does not exist", shown(&resolved)));
            continue;
        }
        if let Some(fragment) = fragment
            && resolved.extension().is_some_and(|e| e == "md")
            && !anchors(&read(&resolved)).contains(fragment)
        {
            broken.push(format!(
                "{at}: {} has no heading with the anchor #{fragment}",
                shown(&resolved)
            ));
        }
    }
    broken
}

#[test]
fn relative_links_point_at_files_and_headings_that_exist() {
    let root = workspace_root();
    let docs = documents(&root);
    assert!(docs.len() > 5, "docs/ has too few pages: {docs:?}");
    let broken: Vec<String> = docs
        .iter()
        .flat_map(|d| broken_links(d, &read(d)))
        .collect();
    assert!(
        broken.is_empty(),
        "broken links:\n  {}",
        broken.join("\n  ")
    );
}

#[test]
fn links_are_read_as_documented() {
    let md = "See [a](a.md#x), [web](https://example.com), ![img](p.png \"t\") and \
              `[not](code.md)`.\n```\n[not](fenced.md)\n```\n[ref]: <r.md>\n";
    let targets: Vec<String> = link_targets(md).into_iter().map(|(_, t)| t).collect();
    assert_eq!(targets, ["a.md#x", "https://example.com", "p.png", "r.md"]);
    assert_eq!(anchor("Files in `state_dir`"), "files-in-state_dir");
    assert_eq!(anchor("The daemon's log"), "the-daemons-log");
    assert_eq!(
        anchor("Live changes: `rule set` and overrides"),
        "live-changes-rule-set-and-overrides"
    );
    let headings = anchors("# T\n## A b\n```\n# not\n```\n## A b\n");
    let expected: BTreeSet<String> = ["t", "a-b", "a-b-1"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(headings, expected);

    let root = workspace_root();
    let page = root.join("docs/README.md");
    let broken = broken_links(
        &page,
        "[ok](cli.md) [gone](no-such-page.md) [bad anchor](cli.md#no-such-heading)\n",
    );
    assert_eq!(broken.len(), 2, "{broken:?}");
    assert!(
        broken[0].contains("no-such-page.md does not exist"),
        "{broken:?}"
    );
    assert!(
        broken[1].contains("no heading with the anchor #no-such-heading"),
        "{broken:?}"
    );
}
