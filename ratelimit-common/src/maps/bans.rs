//! Bans: their entries, flags and tables.

/// `BanEntry::flags`.
/// Issued by an operator (`ratelimit ban add`), not by a rule.
pub const BAN_MANUAL: u32 = 1 << 0;
/// The issuing rule is in preview: count would-drops, do not drop.
pub const BAN_PREVIEW: u32 = 1 << 1;
/// The issuing rule's `exceed_action` is pass.
pub const BAN_EXCEED_PASS: u32 = 1 << 2;
/// Received from the fleet (issued on another host, by its operator or one of its rules; with
/// `BAN_MANUAL`, so it always drops): in the remote bans' table, never the operator's.
pub const BAN_REMOTE: u32 = 1 << 8;
/// A remote ban that found the remote bans' table full, kept in the rules' table of bans that
/// drop instead (with `BAN_REMOTE`): enforced, and expired in the kernel, like a rule ban.
pub const BAN_SPILLED: u32 = 1 << 9;

/// Value of the `BANS` LPM trie. It repeats its own key, because an LPM lookup does not say
/// which prefix matched and the program must delete exactly that entry when the ban expires.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BanEntry {
    /// CLOCK_MONOTONIC ns when the ban ends; 0 = until removed.
    pub expires_ns: u64,
    /// When it was issued.
    pub since_ns: u64,
    pub rule: u32,
    pub flags: u32,
    /// The entry's own key: prefix length (of the 16-byte address) and address.
    pub prefix_len: u32,
    pub _pad: u32,
    pub addr: [u8; 16],
}

/// `BanEntry::rule` of a manual ban.
pub const BAN_RULE_NONE: u32 = u32::MAX;

/// The ban tables, by what their bans do. A ban that drops is never in the same trie as one
/// that lets packets through, so a longest match that passes can never hide a wider one that
/// drops (the strictest ban in force wins); the operator's bans have a table of their own,
/// which no number of rule-issued bans can fill; and bans received from the fleet have one
/// too, so no number of them can fill the operator's.
/// `BAN_TABLE_OPERATOR`: `ratelimit ban add` and restored manual bans (they always drop).
pub const BAN_TABLE_OPERATOR: u32 = 0;
/// `BAN_TABLE_RULE`: rule-issued bans that drop (and remote bans spilled, `BAN_SPILLED`).
pub const BAN_TABLE_RULE: u32 = 1;
/// `BAN_TABLE_PASSING`: rule-issued bans that let packets on (preview, `exceed_action = pass`).
pub const BAN_TABLE_PASSING: u32 = 2;
/// `BAN_TABLE_REMOTE`: bans received from the fleet (`BAN_REMOTE`; they always drop).
pub const BAN_TABLE_REMOTE: u32 = 3;
/// Number of ban tables (`RL_BANS_PRESENT` has one flag for each).
pub const BAN_TABLES: u32 = 4;

/// The table a ban belongs in, from its flags.
#[inline(always)]
pub const fn ban_table(flags: u32) -> u32 {
    if flags & BAN_REMOTE != 0 {
        if flags & BAN_SPILLED != 0 {
            BAN_TABLE_RULE
        } else {
            BAN_TABLE_REMOTE
        }
    } else if flags & BAN_MANUAL != 0 {
        BAN_TABLE_OPERATOR
    } else if flags & (BAN_PREVIEW | BAN_EXCEED_PASS) != 0 {
        BAN_TABLE_PASSING
    } else {
        BAN_TABLE_RULE
    }
}

/// `ClientState::ban_stamp` of a client whose rule ban is held in its own state, because the
/// rule bans' table was full: `seen_prev` is then the ban's end (`u64::MAX`: until removed)
/// and `seen_cur` its `BAN_*` flags. The ban meter is not running while a client is banned,
/// so its words are free; no window index ever reaches this value.
pub const BAN_HELD_MARK: u64 = u64::MAX;

impl BanEntry {
    /// An operator's ban of `addr/prefix_len` issued at `now_ns`, ending at `expires_ns`
    /// (0 = until removed).
    pub const fn manual(prefix_len: u32, addr: [u8; 16], now_ns: u64, expires_ns: u64) -> Self {
        Self {
            expires_ns,
            since_ns: now_ns,
            rule: BAN_RULE_NONE,
            flags: BAN_MANUAL,
            prefix_len,
            _pad: 0,
            addr,
        }
    }
}
