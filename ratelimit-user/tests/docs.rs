//! The config examples of the documentation are configs the daemon accepts: every ` ```toml `
//! block of `README.md` and `docs/*.md` parses and validates as a whole config file (the
//! examples are written whole: a rule with `scope = "global"` comes with its `[fleet]`).
//! Host-only: no root, no kernel.

use std::path::{Path, PathBuf};

use ratelimit_user::config;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `README.md` and every `docs/*.md`, as (path shown, text).
fn documents() -> Vec<(String, String)> {
    let root = root();
    let mut paths = vec![PathBuf::from("README.md")];
    let mut pages: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ exists")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .map(|p| Path::new("docs").join(p.file_name().expect("a file name")))
        .collect();
    pages.sort();
    paths.extend(pages);
    paths
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(root.join(&p))
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p.display().to_string(), text)
        })
        .collect()
}

/// The ` ```toml ` blocks of a Markdown text: the line of each opening fence, and the block.
fn toml_blocks(markdown: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut open: Option<(usize, String)> = None;
    for (i, line) in markdown.lines().enumerate() {
        let fence = line.trim_start().strip_prefix("```");
        match (&mut open, fence) {
            (None, Some(info)) if info.trim() == "toml" => open = Some((i + 1, String::new())),
            (Some(_), Some(_)) => blocks.extend(open.take()),
            (Some((_, text)), None) => {
                text.push_str(line);
                text.push('\n');
            }
            _ => {}
        }
    }
    blocks
}

#[test]
fn docs_config_examples_validate() {
    let mut checked = 0;
    let mut failures = Vec::new();
    for (path, text) in documents() {
        for (line, block) in toml_blocks(&text) {
            let label = format!("{path} (the toml block at line {line})");
            match config::parse(&label, &block) {
                Ok(_) => checked += 1,
                Err(e) => failures.push(e.to_string()),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "config examples the daemon refuses:\n{}",
        failures.join("\n")
    );
    assert!(checked >= 4, "only {checked} config examples found");
}

#[test]
fn toml_blocks_are_found() {
    let md = "a\n```toml\n[daemon]\n```\n```sh\nx\n```\n```toml\n[[rule]]\nname = \"r\"\n```\n";
    let blocks = toml_blocks(md);
    assert_eq!(
        blocks,
        [
            (2, "[daemon]\n".to_string()),
            (8, "[[rule]]\nname = \"r\"\n".to_string())
        ]
    );
}
