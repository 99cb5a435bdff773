//! What each part of the suite hands back: its JSON for bench/results.json, its part of
//! BENCHMARKS.md, and its rows of the targets table.

/// One part of the suite's results.
pub struct Section {
    /// Key in bench/results.json.
    pub key: &'static str,
    pub json: serde_json::Value,
    /// Markdown for BENCHMARKS.md, starting with a `## ` heading.
    pub markdown: String,
    pub targets: Vec<TargetRow>,
}

/// A row of the targets table: the target, what this run measured, whether it is met
/// (`None`: not measured).
pub struct TargetRow {
    pub target: String,
    pub measured: String,
    pub met: Option<bool>,
}

impl TargetRow {
    pub fn new(target: impl Into<String>, measured: impl Into<String>, met: Option<bool>) -> Self {
        Self {
            target: target.into(),
            measured: measured.into(),
            met,
        }
    }
}

/// What every part gets: whether this is the quick run, and where plots go. (The parts that
/// load the benchmark's XDP object do so through `object.rs`.)
pub struct Ctx {
    pub quick: bool,
    /// Where plots go (bench/ in the workspace).
    pub out_dir: std::path::PathBuf,
}
