//! Rule bans made by the lab, for tests that need the rules' ban table full.

use ratelimit_common::{
    caps::{MAX_BANS, MAX_REMOTE_BANS},
    maps::{BAN_MANUAL, BAN_REMOTE, BanEntry},
};
use ratelimit_user::kernel::datapath::Maps;

/// The `i`-th of the bans that fill the rules' ban table as a spoofed IPv6 flood would: one
/// `/64` each (`2001:0:<i>::/64`), issued by rule `rule` at `now_ns`, until removed.
pub fn flood_rule_ban(i: u32, rule: u32, now_ns: u64) -> BanEntry {
    let mut addr = [0u8; 16];
    addr[0] = 0x20;
    addr[1] = 0x01;
    addr[4..8].copy_from_slice(&i.to_be_bytes());
    let mut e = BanEntry::manual(64, addr, now_ns, 0);
    e.flags = 0;
    e.rule = rule;
    e
}

/// Fill the rules' ban table (`caps::MAX_BANS` bans of rule `rule`) through `maps`.
pub fn fill_rule_ban_table(maps: &mut Maps, rule: u32, now_ns: u64) {
    for i in 0..MAX_BANS {
        maps.insert_ban_deferred(flood_rule_ban(i, rule, now_ns))
            .expect("fill the rules' ban table");
    }
    maps.flush_ban_epoch().expect("ban epoch");
}

/// Fill the fleet's ban table (`caps::MAX_REMOTE_BANS` remote bans, `2001:0:<i>::/64`, as
/// the daemon installs them) through `maps`.
pub fn fill_remote_ban_table(maps: &mut Maps, now_ns: u64) {
    for i in 0..MAX_REMOTE_BANS {
        let mut e = flood_rule_ban(i, 0, now_ns);
        e.flags = BAN_MANUAL | BAN_REMOTE;
        e.rule = ratelimit_common::maps::BAN_RULE_NONE;
        maps.insert_ban_deferred(e)
            .expect("fill the fleet's ban table");
    }
    maps.flush_ban_epoch().expect("ban epoch");
}
