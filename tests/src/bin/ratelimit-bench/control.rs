//! Control plane and daemon (issue 5, parts 5 and 6). Filled in separately.

use crate::part::{Ctx, Section};

pub fn run(_ctx: &Ctx) -> Option<Section> {
    None
}
