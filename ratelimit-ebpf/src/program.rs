//! The entry points, and the path every frame takes from the parser's result to its
//! verdict (see the crate documentation).

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use ratelimit_common::{
    maps::{
        BAN_EXCEED_PASS, BAN_PREVIEW, GLOBAL_HAS_ALLOW, GLOBAL_HAS_DENY, LIST_ALLOW, LIST_DENY,
    },
    stats::global,
};

use crate::{
    bans, clock, cookies, fast, matching,
    parse::{self, Frame, Parsed},
    policy, rare,
    rules::{self, RuleVerdict},
    scratch::SCRATCH,
    stats::{self, Slot},
};

/// The entry for Ethernet devices.
#[xdp]
pub fn ratelimit(ctx: XdpContext) -> u32 {
    ethernet(&ctx)
}

/// What [`ratelimit`] does with a frame. Public so that another build of the program can
/// enter it after work of its own on the frame, and run exactly this code.
#[inline(always)]
pub fn ethernet(ctx: &XdpContext) -> u32 {
    let (slot, len) = (stats::slot(ctx.ingress_ifindex() as u32), frame_len(ctx));
    match parse::parse(ctx) {
        Frame::Ip(pkt) => judge::<true>(ctx, slot, pkt, len),
        Frame::NonIp => finish(slot, global::PASS_NON_IP, len),
        Frame::Bogon => finish(slot, global::DROP_BOGON, len),
        Frame::Unreadable(reason) => malformed(slot, reason, len),
    }
}

/// The entry for devices without a link-layer header (tun, wireguard, ipip/sit/gre): the
/// frame starts at the IP header. The daemon picks the entry from the device's link type;
/// everything after parsing is shared. (Each entry matches on its parser's result itself:
/// passing the result on to a shared function makes the verifier see its unset payload
/// as an uninitialised register.)
#[xdp]
pub fn ratelimit_l3(ctx: XdpContext) -> u32 {
    let (slot, len) = (stats::slot(ctx.ingress_ifindex() as u32), frame_len(&ctx));
    match parse::parse_l3(&ctx) {
        Frame::Ip(pkt) => judge::<false>(&ctx, slot, pkt, len),
        Frame::NonIp => finish(slot, global::PASS_NON_IP, len),
        Frame::Bogon => finish(slot, global::DROP_BOGON, len),
        Frame::Unreadable(reason) => malformed(slot, reason, len),
    }
}

#[inline(always)]
fn frame_len(ctx: &XdpContext) -> u64 {
    (ctx.data_end() - ctx.data()) as u64
}

#[inline(always)]
fn malformed(slot: Slot, reason: u32, len: u64) -> u32 {
    stats::add(slot, reason, len);
    finish(slot, global::PASS_MALFORMED, len)
}

/// Count what the parser noted, then [`decide`]. `ETH`: the frame has an Ethernet header
/// (only then may it be answered with a SYN cookie (`cookies.rs`), or its TCP segment be
/// looked up for `tcp_state` (`conn.rs`)); a constant of each entry, so no register holds it.
#[inline(always)]
fn judge<const ETH: bool>(ctx: &XdpContext, slot: Slot, pkt: Parsed, len: u64) -> u32 {
    if pkt.reason() != 0 {
        stats::add(slot, pkt.reason(), len);
    }
    if pkt.fragment {
        stats::add(slot, global::FRAGMENTS, len);
    }
    decide::<ETH>(ctx, slot, pkt, len)
}

#[inline(always)]
fn decide<const ETH: bool>(ctx: &XdpContext, slot: Slot, pkt: Parsed, len: u64) -> u32 {
    let global_cfg = policy::global();
    // The coarse clock (the last timer tick): a fraction of the cost of reading the clock
    // source. Rules that need precision read the precise one (`RULE_FINE_CLOCK`).
    let (now, tick) = clock::coarse_tick();
    // Refused earlier in this tick, like packet for like packet (see `fast.rs`): before the
    // lists and bans, whose verdicts the entry already holds. It was made for a packet no
    // list and no ban matched; lists change only with the policy generation, and a ban
    // added since moves the ban epoch (read here, before this packet's ban lookup): either
    // voids it.
    let ban_epoch = if global_cfg.rule_count != 0 {
        bans::ban_epoch()
    } else {
        0
    };
    if global_cfg.rule_count != 0
        && fast::check(slot, &pkt, len, global_cfg.generation, tick, ban_epoch)
    {
        return finish(slot, global::DROP_RULE, len);
    }
    // One lookup answers the allow list, the deny list and the rules' source lists; with
    // no list at all it is skipped (rules with a source list then look up on their own).
    // (known, mask): plain integers, not an Option, whose unset payload the verifier would
    // see as an uninitialised register.
    // The source's key in the list and ban tries, built once for both, in this CPU's
    // scratch record (the entry's stack has no room to spare on 6.1), which the rules
    // use after them.
    let Some(rl) = SCRATCH.get_ptr_mut(0) else {
        return finish(slot, global::PASS, len);
    };
    // SAFETY: this CPU's scratch record, used only during this packet; a reference to a
    // field of a live map value.
    // The packet's facts go to the record here, where the rules read them, so the entry
    // holds none of them across the lookups below (its stack is what the 512 bytes of the
    // call chain have least of).
    let key = unsafe {
        (*rl).pkt = pkt;
        (*rl).src_mask_known = 0;
        (*rl).src_key.set(&(*rl).pkt.src, (*rl).pkt.v4);
        (*rl).src_key.key()
    };
    // What the rules ask of the frame beyond the parser's facts (`matching.rs`), made here,
    // once a packet, before the lists; without a rule that asks for any, no call at all (a
    // call costs about 20 ns on this path).
    if global_cfg.rule_count != 0 && matching::any_needs(global_cfg) {
        matching::rl_prepare(ctx.ctx, rl, ETH as u64);
    } else {
        // SAFETY: this CPU's scratch record, used only during this packet.
        unsafe { (*rl).have = 0 };
    }
    if global_cfg.flags & (GLOBAL_HAS_ALLOW | GLOBAL_HAS_DENY) != 0 {
        let v = policy::sources_at(key);
        if v.flags & LIST_ALLOW != 0 {
            return finish(slot, global::PASS_ALLOW, len);
        }
        if v.flags & LIST_DENY != 0 {
            return finish(slot, global::DROP_DENY, len);
        }
        // SAFETY: this CPU's scratch record; the rules' share of the answer, for them.
        unsafe {
            (*rl).src_mask = v.rule_src_mask;
            (*rl).src_except = v.rule_except_mask;
            (*rl).src_mask_known = 1;
        }
    }
    let mut ban_matched = false;
    if let Some(ban_flags) = bans::active_ban(slot, key, now) {
        let passes =
            global_cfg.preview_all != 0 || ban_flags & (BAN_PREVIEW | BAN_EXCEED_PASS) != 0;
        if !passes {
            return finish(slot, global::DROP_BAN, len);
        }
        stats::add(slot, global::BAN_PASS, len);
        if ban_flags & BAN_PREVIEW != 0 || global_cfg.preview_all != 0 {
            stats::add(slot, global::PREVIEW_WOULD_DROP, len);
        }
        ban_matched = true;
    }
    let verdict = rules::evaluate_rules(
        rl,
        (slot, len),
        (now, tick, ban_epoch),
        global_cfg,
        ban_matched,
    );
    // The rare conditions the rules met (full tables, lost events) reach the log here,
    // after the verdict, at most once a second each (`rare.rs`).
    rare::flush(now);
    match verdict {
        RuleVerdict::Pass => return finish(slot, global::PASS, len),
        // Dropped only because its source was refused state: a second look against the
        // kernel's sockets (`cookies.rs`).
        RuleVerdict::Refused if ETH => {
            let a = cookies::answer(ctx.ctx, rl, global_cfg.syn_answer_tick_cap as u64);
            if a == cookies::ANSWER_TX {
                stats::add(slot, global::SYN_COOKIES_SENT, len);
                stats::add(slot, global::DROP_RULE, len);
                return xdp_action::XDP_TX;
            }
            if a & 0xff == cookies::ANSWER_PASS {
                if a & cookies::ANSWER_PROVEN != 0 {
                    stats::add(slot, global::SOURCES_PROVEN, len);
                }
                let reason = ((a >> 8) & 0xffff) as u32;
                if reason != 0 {
                    stats::add(slot, reason, len);
                }
                return finish(slot, global::PASS, len);
            }
        }
        _ => {}
    }
    finish(slot, global::DROP_RULE, len)
}

/// Record the verdict and return the XDP action it implies.
#[inline(always)]
fn finish(slot: Slot, verdict: u32, len: u64) -> u32 {
    stats::add(slot, verdict, len);
    match verdict {
        global::DROP_DENY | global::DROP_BAN | global::DROP_RULE | global::DROP_BOGON => {
            xdp_action::XDP_DROP
        }
        _ => xdp_action::XDP_PASS,
    }
}
