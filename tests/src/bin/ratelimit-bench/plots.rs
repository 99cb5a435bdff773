//! PNG plots from bench/results.json. Filled in separately.

use crate::part::Ctx;

/// Draw the plots from the results (the JSON that goes to bench/results.json); returns the
/// markdown that embeds them.
pub fn draw(_ctx: &Ctx, _results: &serde_json::Value) -> String {
    String::new()
}
