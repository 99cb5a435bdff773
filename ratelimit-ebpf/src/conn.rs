//! `tcp_state = "no_connection"`: whether a TCP segment without SYN belongs to a connection
//! the kernel holds, asked of the kernel's own socket tables.
//!
//! The segment's 4-tuple is looked up (`bpf_skc_lookup_tcp`, as `cookies.rs` does): an
//! established, half-open or TIME_WAIT socket accepts it (the kernel checks its sequence
//! numbers); a listener accepts an ACK only if it carries a valid SYN cookie of the listener
//! (`bpf_tcp_check_syncookie`, the kernel's own test). Anything else (no socket, a listener
//! and no valid cookie) is a segment the kernel would answer with a reset or drop: out of
//! state. Only segments addressed to this host are judged (`cookies::for_this_host`):
//! a forwarded segment has no local socket and is none of this rule's business. A segment
//! from a source the stack discards as a martian is out of state too. So are only
//! segments whose TCP header follows a fixed IP header directly (no IPv4 options, no IPv6
//! extension header), which the lookup's tuple is read from; the others count as in state.

use aya_ebpf::{
    bindings::{bpf_sock, tcphdr, xdp_md},
    helpers::{bpf_sk_release, bpf_tcp_check_syncookie},
    programs::XdpContext,
};

use crate::{
    cookies::{self, BUF, Dest, TCP_ACK, TCP_LISTEN},
    parse::{self, Parsed},
};

/// `RuleLoop::conn`: the segment belongs to a connection the kernel holds (or carries a
/// valid SYN cookie), or is not addressed to this host, or cannot be judged here.
pub const CONN_JUDGED_OK: u32 = 1;
/// No local socket accepts the segment: `tcp_state = "no_connection"` holds.
pub const CONN_NONE: u32 = 2;

/// Whether the TCP segment `pkt` (read, not a fragment, without SYN) of the Ethernet frame
/// of `ctx` is out of state: [`CONN_NONE`], else [`CONN_JUDGED_OK`]. A static function, not
/// inlined: its stack is not added to the rules' call chain.
#[inline(never)]
pub fn connection(ctx: *mut xdp_md, pkt: *const Parsed) -> u32 {
    let ctx = XdpContext::new(ctx);
    // SAFETY: the scratch record's packet, written by the entry for this packet.
    let v4 = unsafe { (*pkt).v4 };
    // SAFETY: as above.
    let ack = unsafe { (*pkt).tcp_flags } & TCP_ACK != 0;
    // One copy per family, as in `cookies.rs`.
    if v4 {
        connection_af::<true>(&ctx, ack)
    } else {
        connection_af::<false>(&ctx, ack)
    }
}

#[inline(always)]
fn connection_af<const V4: bool>(ctx: &XdpContext, ack: bool) -> u32 {
    let Some(b) = BUF.get_ptr_mut(0) else {
        return CONN_JUDGED_OK;
    };
    let Some((l3, ip_len)) = cookies::headers::<V4>(ctx) else {
        return CONN_JUDGED_OK;
    };
    let sk = cookies::lookup::<V4>(ctx, b, l3);
    if !sk.is_null() {
        // SAFETY: a socket the lookup returned; `state` is a field its type allows reading.
        let state =
            unsafe { core::ptr::read_volatile(&raw const (*(sk as *const bpf_sock)).state) };
        let mut accepted = state != TCP_LISTEN;
        if state == TCP_LISTEN
            && ack
            && let (Some(ip), Some(th)) = (
                parse::header(ctx, l3, if V4 { 20 } else { 40 }),
                parse::header(ctx, l3 + ip_len, 20),
            )
        {
            // SAFETY: `sk` is the lookup's reference; the helper reads the checked headers.
            accepted = unsafe {
                bpf_tcp_check_syncookie(
                    sk,
                    ip.ptr() as *mut core::ffi::c_void,
                    ip_len as u32,
                    th.ptr() as *mut tcphdr,
                    20,
                )
            } == 0;
        }
        // SAFETY: the reference the lookup returned, released once.
        unsafe { bpf_sk_release(sk) };
        if accepted {
            return CONN_JUDGED_OK;
        }
    }
    match cookies::for_this_host::<V4>(ctx, b, l3) {
        // A martian source's segment the stack discards: nothing can accept it either.
        Dest::Here | Dest::Martian => CONN_NONE,
        Dest::Elsewhere => CONN_JUDGED_OK,
    }
}
