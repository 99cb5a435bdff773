//! The per-interface counter slots: one given to each interface at attach, freed (its
//! counts kept in the retired slot) once no link is attached to its interface.

use std::{fs, path::Path};

use anyhow::Context as _;
use aya::maps::{Array, HashMap, MapData, PerCpuArray};
use ratelimit_common::{
    caps::{IFSLOT_ARRAY_LEN, RETIRED_SLOT, UNLISTED_SLOT},
    stats::Counter,
};
use tracing::{info, warn};

use super::{Datapath, maps::Maps, pin::pinned_link_ifindex};

impl Datapath {
    /// (slot, interface) of the attached interfaces with counters of their own: one beyond
    /// the slots counts in [`UNLISTED_SLOT`], which is no interface's series.
    pub fn counter_slots(&self) -> Vec<(u32, String)> {
        self.attached
            .iter()
            .filter(|a| a.slot != UNLISTED_SLOT)
            .map(|a| (a.slot, a.iface.clone()))
            .collect()
    }
}

/// Counter slot for `ifindex`: the one already assigned, else the lowest free one. With every
/// slot taken the interface is not listed, and counts in [`UNLISTED_SLOT`] with the other
/// unlisted interfaces (counted, and said in a warning, rather than refusing to protect it).
pub(super) fn assign_slot(
    ifaces: &mut HashMap<MapData, u32, u32>,
    ifslots: &mut Array<MapData, u32>,
    ifindex: u32,
) -> anyhow::Result<u32> {
    match ifaces.get(&ifindex, 0) {
        // Pinned by a daemon that gave interfaces the last slot too: its counts stay there
        // as retired ones, and the interface gets a slot of its own from here on.
        Ok(RETIRED_SLOT) => {
            ifaces.remove(&ifindex).ok();
        }
        Ok(s) => {
            if ifindex < IFSLOT_ARRAY_LEN {
                ifslots.set(ifindex, s, 0)?;
            }
            return Ok(s);
        }
        Err(_) => {}
    }
    let used: Vec<u32> = ifaces
        .iter()
        .filter_map(|r| r.ok().map(|(_, v)| v))
        .collect();
    let Some(slot) = (UNLISTED_SLOT + 1..RETIRED_SLOT).find(|s| !used.contains(s)) else {
        warn!(
            ifindex,
            "all {} per-interface counter slots are in use by attached interfaces: this one's \
             counts go to the series of unlisted interfaces (interface=\"\") and the totals, \
             not to a series of its own",
            RETIRED_SLOT - UNLISTED_SLOT - 1
        );
        return Ok(UNLISTED_SLOT);
    };
    ifaces
        .insert(ifindex, slot, 0)
        .context("recording the interface's counter slot (RL_IFACES)")?;
    if ifindex < IFSLOT_ARRAY_LEN {
        ifslots.set(ifindex, slot, 0)?;
    }
    Ok(slot)
}

/// Free the counter slots of interfaces no link in `pin_dir` is attached to any more (deleted,
/// or detached), except `keep` (the one being attached). Without this, every interface ever
/// attached kept its slot: the 16th distinct ifindex (an interface re-created 15 times) got
/// the shared slot 0 and the 17th could not be attached at all.
///
/// A freed slot's counters are added to [`RETIRED_SLOT`] and zeroed: the totals (`ratelimit
/// stats`, the reasons' and the rules' counters) stay monotonic, as counters must, and the
/// next interface given the slot starts from zero instead of inheriting another device's
/// counts. The interface's series of `/metrics` ends; no other series takes its counts (which
/// Prometheus would read as that many frames arriving at once). An interface re-created under
/// the same name is a new device: its series restarts from zero, which Prometheus reads as a
/// counter reset.
pub(super) fn prune_slots(maps: &mut Maps, pin_dir: &Path, keep: u32) -> anyhow::Result<Vec<u32>> {
    let mut live = vec![keep];
    if let Ok(entries) = fs::read_dir(pin_dir) {
        for e in entries.flatten() {
            if !e.file_name().to_string_lossy().starts_with("link-") {
                continue;
            }
            match pinned_link_ifindex(&e.path()) {
                Ok(Some(i)) => live.push(i),
                // Its interface was deleted: the kernel detached it, the pin is all that is left.
                Ok(None) => {
                    if fs::remove_file(e.path()).is_ok() {
                        info!(
                            "removed {}: its interface no longer exists",
                            e.path().display()
                        );
                    }
                }
                Err(_) => {}
            }
        }
    }
    let stale: Vec<(u32, u32)> = maps
        .ifaces
        .iter()
        .filter_map(|r| r.ok())
        .filter(|(i, _)| !live.contains(i))
        .collect();
    for &(ifindex, slot) in &stale {
        maps.ifaces.remove(&ifindex).ok();
        if ifindex < IFSLOT_ARRAY_LEN {
            maps.ifslots.set(ifindex, 0, 0)?;
        }
        if slot != UNLISTED_SLOT && slot < RETIRED_SLOT {
            retire_slot(&mut maps.stats, slot)?;
        }
        info!(
            ifindex,
            slot, "freed the counter slot of an interface that is no longer attached"
        );
    }
    Ok(stale.into_iter().map(|(i, _)| i).collect())
}

/// Add every counter of `slot` to [`RETIRED_SLOT`]'s and zero it, CPU by CPU. (Nothing counts
/// in either any more: the program is no longer attached to the slot's interface, and no
/// frame is ever counted in the retired slot.)
fn retire_slot(stats: &mut PerCpuArray<MapData, Counter>, slot: u32) -> anyhow::Result<()> {
    use ratelimit_common::stats::{PER_IFACE, global_index};
    for k in 0..PER_IFACE {
        let from = global_index(slot, k);
        let to = global_index(RETIRED_SLOT, k);
        let src = stats.get(&from, 0)?;
        if src.iter().all(|c| c.packets == 0 && c.bytes == 0) {
            continue;
        }
        let dst = stats.get(&to, 0)?;
        let sum: Vec<Counter> = dst
            .iter()
            .zip(src.iter())
            .map(|(d, s)| Counter {
                packets: d.packets + s.packets,
                bytes: d.bytes + s.bytes,
            })
            .collect();
        let zero = vec![Counter::default(); sum.len()];
        stats.set(to, aya::maps::PerCpuValues::try_from(sum)?, 0)?;
        stats.set(from, aya::maps::PerCpuValues::try_from(zero)?, 0)?;
    }
    Ok(())
}
