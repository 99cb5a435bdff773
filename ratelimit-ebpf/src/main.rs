//! The ratelimit XDP program.
//!
//! Per packet: parse (`parse`; from the IP header on devices without one, `ratelimit_l3`),
//! then this tick's fast-drop entry (`fast`) → allow list → deny list → active ban (`bans`)
//! → rules in file order (`policy`, `rules`), write the lines of any rare condition the rules
//! met (`rare`), record the verdict in the per-CPU counters and return. Every exit goes
//! through [`finish`], so every frame is counted in exactly one verdict counter.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics, asm_experimental_arch))]
#![cfg_attr(
    target_arch = "bpf",
    expect(internal_features, reason = "BPF atomics, see atomic.rs")
)]
// Every `unsafe` in the program says why it is sound; clippy on the BPF target (`cargo xtask
// test`, step 2) fails on one that does not.
#![cfg_attr(
    target_arch = "bpf",
    warn(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)
)]

#[cfg(target_arch = "bpf")]
mod admission;
#[cfg(target_arch = "bpf")]
mod atomic;
#[cfg(target_arch = "bpf")]
mod bans;
#[cfg(all(target_arch = "bpf", feature = "bench"))]
mod bench;
#[cfg(target_arch = "bpf")]
mod clock;
#[cfg(target_arch = "bpf")]
mod events;
#[cfg(target_arch = "bpf")]
mod fast;
#[cfg(all(target_arch = "bpf", feature = "bench"))]
mod generator;
#[cfg(target_arch = "bpf")]
mod known;
#[cfg(target_arch = "bpf")]
mod meters;
#[cfg(target_arch = "bpf")]
mod parse;
#[cfg(target_arch = "bpf")]
mod policy;
#[cfg(target_arch = "bpf")]
mod rare;
#[cfg(target_arch = "bpf")]
mod rules;
#[cfg(target_arch = "bpf")]
mod scratch;
#[cfg(target_arch = "bpf")]
mod state;
#[cfg(target_arch = "bpf")]
mod stats;
#[cfg(target_arch = "bpf")]
mod store;

#[cfg(target_arch = "bpf")]
mod program {
    use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
    use ratelimit_common::{
        maps::{
            BAN_EXCEED_PASS, BAN_PREVIEW, GLOBAL_HAS_ALLOW, GLOBAL_HAS_DENY, LIST_ALLOW, LIST_DENY,
        },
        stats::global,
    };

    use crate::{
        bans, clock, fast,
        parse::{self, Frame, Parsed},
        policy, rare,
        rules::{self, RuleVerdict},
        scratch::SCRATCH,
        stats::{self, Slot},
    };

    #[xdp]
    pub fn ratelimit(ctx: XdpContext) -> u32 {
        #[cfg(feature = "bench")]
        crate::bench::vary_source(&ctx);
        let (slot, len) = (stats::slot(ctx.ingress_ifindex() as u32), frame_len(&ctx));
        match parse::parse(&ctx) {
            Frame::Ip(pkt) => judge(slot, pkt, len),
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
            Frame::Ip(pkt) => judge(slot, pkt, len),
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

    /// Count what the parser noted, then [`decide`].
    #[inline(always)]
    fn judge(slot: Slot, pkt: Parsed, len: u64) -> u32 {
        if pkt.note != 0 {
            stats::add(slot, pkt.note, len);
        }
        if pkt.fragment {
            stats::add(slot, global::FRAGMENTS, len);
        }
        decide(slot, pkt, len)
    }

    #[inline(always)]
    fn decide(slot: Slot, pkt: Parsed, len: u64) -> u32 {
        let src = &pkt.src;
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
        let mut src_mask = (0u32, 0u32);
        // The source's key in the list and ban tries, built once for both, in this CPU's
        // scratch record (the entry's stack has no room to spare on 6.1), which the rules
        // use after them.
        let Some(rl) = SCRATCH.get_ptr_mut(0) else {
            return finish(slot, global::PASS, len);
        };
        // SAFETY: this CPU's scratch record, used only during this packet; a reference to a
        // field of a live map value.
        let key = unsafe {
            (*rl).src_key = policy::full(src);
            &(*rl).src_key
        };
        if global_cfg.flags & (GLOBAL_HAS_ALLOW | GLOBAL_HAS_DENY) != 0 {
            let (flags, mask) = policy::sources_at(key);
            if flags & LIST_ALLOW != 0 {
                return finish(slot, global::PASS_ALLOW, len);
            }
            if flags & LIST_DENY != 0 {
                return finish(slot, global::DROP_DENY, len);
            }
            src_mask = (1, mask);
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
            pkt,
            (slot, len),
            (now, tick, ban_epoch),
            global_cfg,
            src_mask,
            ban_matched,
        );
        // The rare conditions the rules met (full tables, lost events) reach the log here,
        // after the verdict, at most once a second each (`rare.rs`).
        rare::flush(now);
        match verdict {
            RuleVerdict::Pass => finish(slot, global::PASS, len),
            _ => finish(slot, global::DROP_RULE, len),
        }
    }

    // Reference programs for `cargo xtask bench`: the floor any XDP program pays, and the cost
    // of parsing alone, so the limiter's cost can be reported as ns over each. They are in the
    // object but only loaded by the benchmark.

    /// Reference: return XDP_PASS.
    #[xdp]
    pub fn ref_pass(_ctx: XdpContext) -> u32 {
        xdp_action::XDP_PASS
    }

    /// Reference: return XDP_DROP.
    #[xdp]
    pub fn ref_drop(_ctx: XdpContext) -> u32 {
        xdp_action::XDP_DROP
    }

    /// Reference: our parser, then XDP_PASS.
    #[xdp]
    pub fn ref_parse(ctx: XdpContext) -> u32 {
        match parse::parse(&ctx) {
            Frame::Ip(p) => {
                // Keep the parse from being optimised away.
                core::hint::black_box(p.dport);
                xdp_action::XDP_PASS
            }
            Frame::NonIp => xdp_action::XDP_PASS,
            Frame::Bogon | Frame::Unreadable(_) => xdp_action::XDP_ABORTED,
        }
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
}

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

#[cfg(not(target_arch = "bpf"))]
fn main() {}
