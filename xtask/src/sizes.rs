//! The size bounds of the daemon's code, a host test that `cargo xtask test` runs: a file holds
//! one concern and a function fits on a screen or two. No product source file of
//! `ratelimit-user` or `ratelimit-common` is longer than [`FILE_LINES`] (its
//! `#[cfg(test)] mod tests { ... }` block at the end left out), and no function in them longer
//! than [`FN_LINES`]. Test files (`tests.rs`, `proptests.rs`, and the test-only modules in
//! [`TEST_DATA`]) are not product code.
//!
//! The XDP program (`ratelimit-ebpf`) is bounded by the verifier instead: its rule evaluation
//! is one inlined function by design (see `rules.rs`), so it is not checked here.

use std::path::Path;

/// The most lines a product source file may hold.
const FILE_LINES: usize = 800;
/// The most lines a function may take, its signature and closing brace included.
const FN_LINES: usize = 150;
/// The crates whose files are bounded.
const CRATES: &[&str] = &["ratelimit-user/", "ratelimit-common/"];
/// Test-only modules that are data (one sample of each answer), not logic.
const TEST_DATA: &[&str] = &["ratelimit-user/src/api/samples.rs"];

/// The lines of a file as the bounds count them: up to a trailing `#[cfg(test)] mod tests {`.
fn product_lines(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    let end = lines
        .windows(2)
        .position(|w| w[0] == "#[cfg(test)]" && w[1] == "mod tests {")
        .unwrap_or(lines.len());
    lines[..end].to_vec()
}

/// The functions of `lines` longer than `max`, as `(name, first line, length)`. A function
/// starts at a `fn` line (any visibility, `async`, `const`, `unsafe`) and ends at the first
/// line that is its indentation and `}` (the code is rustfmt's).
fn long_functions(lines: &[&str], max: usize) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let body = line.trim_start();
        let indent = &line[..line.len() - body.len()];
        let mut rest = body;
        for prefix in [
            "pub(crate) ",
            "pub(super) ",
            "pub ",
            "async ",
            "const ",
            "unsafe ",
        ] {
            rest = rest.strip_prefix(prefix).unwrap_or(rest);
        }
        let Some(sig) = rest.strip_prefix("fn ") else {
            continue;
        };
        let name: String = sig
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if body.ends_with('}') {
            continue; // a body on one line
        }
        // The signature ends at the body's `{`, or at `;` for a declaration without a body.
        let Some(open) = lines[i..]
            .iter()
            .position(|l| l.ends_with('{') || l.ends_with(';'))
        else {
            continue;
        };
        if lines[i + open].ends_with(';') {
            continue;
        }
        let close = format!("{indent}}}");
        let Some(len) = lines[i..].iter().position(|l| *l == close) else {
            continue;
        };
        if len + 1 > max {
            out.push((name, i + 1, len + 1));
        }
    }
    out
}

fn over_bounds(root: &Path) -> Vec<String> {
    let mut over = Vec::new();
    for file in crate::docs::product_sources(root) {
        if !CRATES.iter().any(|c| file.starts_with(c)) || TEST_DATA.contains(&file.as_str()) {
            continue;
        }
        let text = std::fs::read_to_string(root.join(&file)).unwrap_or_default();
        let lines = product_lines(&text);
        if lines.len() > FILE_LINES {
            over.push(format!(
                "{file}: {} lines (at most {FILE_LINES})",
                lines.len()
            ));
        }
        for (name, at, len) in long_functions(&lines, FN_LINES) {
            over.push(format!(
                "{file}:{at}: fn {name} is {len} lines (at most {FN_LINES})"
            ));
        }
    }
    over
}

#[test]
fn the_daemon_s_files_and_functions_are_within_their_bounds() {
    let over = over_bounds(&crate::util::workspace_root());
    assert!(
        over.is_empty(),
        "split these by concern (move code into a module of its own, a long function into \
         named steps):\n  {}",
        over.join("\n  ")
    );
}

#[test]
fn a_long_function_is_found_and_a_short_one_is_not() {
    let mut text = String::from("impl X {\n    pub async fn long(&self) {\n");
    text += &"        step();\n".repeat(200);
    text +=
        "    }\n\n    fn short() {}\n\n    fn decl();\n    fn two() {\n        b();\n    }\n}\n";
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        long_functions(&lines, FN_LINES),
        vec![("long".to_string(), 2, 202)]
    );
    let with_tests = "fn a() {}\n#[cfg(test)]\nmod tests {\n    fn t() {}\n}\n";
    assert_eq!(product_lines(with_tests), vec!["fn a() {}"]);
}
