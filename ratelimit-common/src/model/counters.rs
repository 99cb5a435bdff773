//! The counter deltas of a frame (`crate::stats`), global and per rule.

extern crate std;

use std::{format, string::String, vec::Vec};

use crate::{
    caps::MAX_RULES,
    stats::{global, rule as rc},
};

/// Counter deltas of one frame: packets and bytes of every global and per-rule counter of
/// interface slot 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counters {
    pub global: [(u64, u64); global::COUNT as usize],
    pub rules: [[(u64, u64); rc::COUNT as usize]; MAX_RULES as usize],
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            global: [(0, 0); global::COUNT as usize],
            rules: [[(0, 0); rc::COUNT as usize]; MAX_RULES as usize],
        }
    }
}

impl Counters {
    pub fn add(&mut self, counter: u32, len: u64) {
        let c = &mut self.global[counter as usize];
        c.0 += 1;
        c.1 += len;
    }

    pub fn add_rule(&mut self, rule: u32, counter: u32, len: u64) {
        let c = &mut self.rules[rule as usize][counter as usize];
        c.0 += 1;
        c.1 += len;
    }

    /// Add `other` to these.
    pub fn merge(&mut self, other: &Counters) {
        for (a, b) in self.global.iter_mut().zip(other.global.iter()) {
            a.0 += b.0;
            a.1 += b.1;
        }
        for (ra, rb) in self.rules.iter_mut().zip(other.rules.iter()) {
            for (a, b) in ra.iter_mut().zip(rb.iter()) {
                a.0 += b.0;
                a.1 += b.1;
            }
        }
    }

    /// Every non-zero counter as `name = packets/bytes`, for failure reports.
    pub fn describe(&self, rule_count: usize) -> Vec<String> {
        let mut out = Vec::new();
        for (i, c) in self.global.iter().enumerate() {
            if *c != (0, 0) {
                out.push(format!("{} = {}/{}", global::NAMES[i], c.0, c.1));
            }
        }
        for (r, counters) in self.rules.iter().enumerate().take(rule_count) {
            for (i, c) in counters.iter().enumerate() {
                if *c != (0, 0) {
                    out.push(format!("rule{r}/{} = {}/{}", rc::NAMES[i], c.0, c.1));
                }
            }
        }
        out
    }
}
