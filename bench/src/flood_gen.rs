//! User-space side of the live-frames generator (`gen_flood` in
//! bench-ebpf/src/generator.rs): its configuration, the template frame and checksum base,
//! and the BPF_PROG_TEST_RUN loop that runs it from the sending namespace.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use aya::{
    maps::{Array, MapData, PerCpuArray, PerCpuValues},
    programs::{TestRun as _, TestRunAttrs, TestRunOptions, Xdp},
};
use ratelimit_tests::{VethPair, packet::Frame};

/// Set when the kernel refused a live-frames run with EPERM (BPF_PROG_RUN with
/// `BPF_F_TEST_XDP_LIVE_FRAMES` is not permitted where the suite runs): no flood can be sent.
pub static LIVE_FRAMES_REFUSED: AtomicBool = AtomicBool::new(false);

/// Whether `e` is the kernel's EPERM.
fn refused(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if err
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.raw_os_error() == Some(libc::EPERM))
        {
            return true;
        }
        cur = err.source();
    }
    false
}

/// Frames per live-frames batch (the kernel's maximum is 256).
const BATCH: u32 = 64;
/// Runs of the first BPF_PROG_TEST_RUN call of a flood; later calls are sized from the rate it
/// showed to last the rest of the flood (see `Generator::run`).
const FIRST_CHUNK: u64 = 1 << 16;

/// Legitimate clients' destination port (the receiving namespace's UDP sink).
pub const LEGIT_PORT: u16 = 9000;
/// Flood destination port: nothing listens there.
pub const FLOOD_PORT: u16 = 9;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::V4 => "ipv4",
            Family::V6 => "ipv6",
        }
    }
}

/// Sources: the generator writes the low 32 bits of the address; the rest is the template's.
/// IPv4: 10.0.0.0/8 for floods (10.1.1.1 the heavy source), 172.16.0.0/16 for legitimate
/// clients. IPv6, all in 2001:db8:f100::/96: random sources in the low 24 bits, the heavy
/// source ::101:101, legitimate clients from ::fe00:1.
pub fn addr4(low: u32) -> Ipv4Addr {
    Ipv4Addr::from(low)
}

pub fn addr6(prefix: u16, low: u32) -> Ipv6Addr {
    let [a, b, c, d] = low.to_be_bytes();
    Ipv6Addr::new(
        0x2001,
        0xdb8,
        prefix,
        0,
        0,
        0,
        u16::from_be_bytes([a, b]),
        u16::from_be_bytes([c, d]),
    )
}

pub const V6_FLOOD_PREFIX: u16 = 0xf100;
pub const V4_FLOOD_BASE: u32 = 0x0a00_0000; // 10.0.0.0
pub const V4_HEAVY: u32 = 0x0a01_0101; // 10.1.1.1
pub const V4_LEGIT_BASE: u32 = 0xac10_0001; // 172.16.0.1
pub const V6_FLOOD_BASE: u32 = 0;
pub const V6_HEAVY: u32 = 0x0101_0101;
pub const V6_LEGIT_BASE: u32 = 0xfe00_0001;

/// What one flood offers.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub family: Family,
    /// Low 32 bits of the first flood source.
    pub flood_base: u32,
    /// 1: one heavy source; a power of two: a new source each frame (scrambled walk).
    pub flood_n: u64,
    pub legit_n: u64,
    /// Low 32 bits of the first legitimate client.
    pub legit_base: u32,
    /// Each legitimate client's rate, frames per second.
    pub legit_pps: u64,
    /// The flood's rate, frames per second (0: as fast as the generator goes).
    pub flood_pps: u64,
}

impl Plan {
    /// Source address of legitimate client `i`.
    pub fn legit_addr(&self, i: u32) -> std::net::IpAddr {
        let low = self.legit_base.wrapping_add(i);
        match self.family {
            Family::V4 => addr4(low).into(),
            Family::V6 => addr6(V6_FLOOD_PREFIX, low).into(),
        }
    }
}

/// The template frame for `family` (first flood source, flood port): valid Ethernet, IP and
/// UDP with correct checksums, to the receiver's real MAC and address.
pub fn template(pair: &VethPair, family: Family) -> Vec<u8> {
    let f = Frame::new(pair.a().mac, pair.b().mac);
    let f = match family {
        Family::V4 => f.ipv4(addr4(V4_FLOOD_BASE), pair.b().ipv4),
        Family::V6 => f.ipv6(addr6(V6_FLOOD_PREFIX, 0), pair.b().ipv6),
    };
    f.udp(40000, FLOOD_PORT).pad_to(60).build()
}

fn sum_words(data: &[u8]) -> u64 {
    data.chunks(2)
        .map(|c| u64::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum()
}

/// One's-complement sum of the words the generator does not rewrite: the IPv4 header with
/// its checksum and source zeroed; for IPv6 the UDP checksum's pseudo-header and UDP
/// datagram with the source's low 32 bits, the destination port and the checksum zeroed.
pub fn csum_base(frame: &[u8], family: Family) -> u64 {
    let mut f = frame.to_vec();
    match family {
        Family::V4 => {
            f[24..30].fill(0);
            sum_words(&f[14..34])
        }
        Family::V6 => {
            f[34..38].fill(0);
            f[56..58].fill(0);
            f[60..62].fill(0);
            let udp_len = u16::from_be_bytes([f[58], f[59]]) as usize;
            sum_words(&f[22..54]) + udp_len as u64 + 17 + sum_words(&f[54..54 + udp_len])
        }
    }
}

/// IPv4: one's-complement sum of the UDP checksum's fixed words (pseudo-header without the
/// source, UDP datagram with the destination port and the checksum zeroed).
pub fn udp_csum_base_v4(frame: &[u8]) -> u64 {
    let mut f = frame.to_vec();
    f[36..38].fill(0);
    f[40..42].fill(0);
    let udp_len = u16::from_be_bytes([f[38], f[39]]) as usize;
    sum_words(&f[30..34]) + udp_len as u64 + 17 + sum_words(&f[34..34 + udp_len])
}

/// The generator's maps and program.
pub struct Generator<'a> {
    pub prog: &'a Xdp,
    pub cfg: Array<MapData, [u64; 16]>,
    pub state: PerCpuArray<MapData, [u64; 8]>,
    pub legit: PerCpuArray<MapData, u64>,
}

/// What the generator's counters said, summed over CPUs.
#[derive(Clone, Copy, Debug, Default)]
pub struct GenCounts {
    pub flood: u64,
    pub legit: u64,
}

impl GenCounts {
    pub fn total(&self) -> u64 {
        self.flood + self.legit
    }
}

/// What one run of the generator did.
pub struct GenRun {
    pub elapsed: Duration,
    pub counts: GenCounts,
    /// CPU time the generator thread used (user + system).
    pub cpu: Duration,
}

fn thread_cpu() -> Duration {
    // SAFETY: rusage is plain data; RUSAGE_THREAD fills it for the calling thread.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid out-pointer for the call's whole duration.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

impl Generator<'_> {
    /// Writes the configuration for `plan` (and resets nothing: counters are read as deltas).
    pub fn configure(&mut self, plan: &Plan, frame: &[u8], legit_only: bool, flood_only: bool) {
        let mut c = [0u64; 16];
        c[0] = match plan.family {
            Family::V4 => 4,
            Family::V6 => 6,
        };
        c[1] = u64::from(plan.flood_base);
        c[2] = plan.flood_n.max(1);
        c[3] = u64::from(FLOOD_PORT);
        c[4] = plan.legit_n;
        c[5] = u64::from(plan.legit_base);
        c[6] = u64::from(LEGIT_PORT);
        c[7] = 1_000_000_000u64
            .checked_div(plan.legit_n * plan.legit_pps)
            .unwrap_or(0);
        c[8] = csum_base(frame, plan.family);
        c[9] = u64::from(flood_only);
        c[10] = u64::from(legit_only);
        c[11] = 1_000_000_000u64.checked_div(plan.flood_pps).unwrap_or(0);
        if plan.family == Family::V4 {
            c[12] = udp_csum_base_v4(frame);
        }
        self.cfg.set(0, c, 0).expect("configure the generator");
        // Restart the legitimate pacing from now.
        let st = self.state.get(&0, 0).expect("generator state");
        let st: Vec<[u64; 8]> = st
            .iter()
            .map(|s| {
                let mut s = *s;
                s[1] = 0;
                s[6] = 0;
                s
            })
            .collect();
        let st = PerCpuValues::try_from(st).expect("one value per CPU");
        self.state.set(0, st, 0).expect("generator state");
    }

    pub fn counts(&self) -> GenCounts {
        let st = self.state.get(&0, 0).expect("generator state");
        st.iter().fold(GenCounts::default(), |acc, s| GenCounts {
            flood: acc.flood + s[3],
            legit: acc.legit + s[4],
        })
    }

    /// Frames sent so far to each of the first `n` legitimate clients.
    pub fn legit_sent(&self, n: u64) -> Vec<u64> {
        (0..n as u32)
            .map(|i| self.legit.get(&i, 0).map_or(0, |v| v.iter().sum()))
            .collect()
    }

    /// Runs the generator on the calling thread (which must be in the sending namespace and
    /// pinned) until `stop` is set, `max_time` passes or `max_frames` runs are done.
    pub fn run(
        &self,
        ifindex: u32,
        frame: &[u8],
        stop: &AtomicBool,
        max_time: Duration,
        max_frames: u64,
    ) -> GenRun {
        // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index,
        // egress_ifindex (u32 each).
        let md: [u32; 6] = [0, frame.len() as u32, 0, ifindex, 0, 0];
        let ctx: Vec<u8> = md.iter().flat_map(|v| v.to_ne_bytes()).collect();
        let before = self.counts();
        let cpu0 = thread_cpu();
        let start = Instant::now();
        let mut runs = 0u64;
        // Every live-frames call sets up and tears down a page pool, and the teardown waits
        // for an RCU grace period (milliseconds to tens of milliseconds here, the generator
        // idle all along): a few long calls, not many short ones. The first call measures the
        // rate; each next one is sized for 60% of the time left at the last call's rate (the
        // rate on this shared machine can change from one second to the next), the last one
        // for all of it, so a flood overruns its time by a fraction of the last call at most.
        let mut chunk = FIRST_CHUNK;
        while !stop.load(Ordering::Relaxed) && runs < max_frames {
            let repeat = chunk.min(max_frames - runs).min(u64::from(u32::MAX));
            let mut opts = TestRunOptions::new();
            opts.data_in = Some(frame);
            opts.ctx_in = Some(&ctx);
            opts.repeat = repeat as u32;
            opts.attrs = TestRunAttrs::new().xdp_live_frames(BATCH);
            let t = Instant::now();
            // Live-frames mode reports no return value: the generator's counters say what
            // it did.
            if let Err(e) = self.prog.test_run(opts) {
                if refused(&e) {
                    // This kernel (or the sandbox it runs in) does not let a program send
                    // live frames: the flood cases cannot run here (see `flood::run`).
                    LIVE_FRAMES_REFUSED.store(true, Ordering::Relaxed);
                    break;
                }
                panic!("live-frames test run: {e:#}");
            }
            runs += repeat;
            let rate = repeat as f64 / t.elapsed().as_secs_f64().max(1e-6);
            let left = max_time.saturating_sub(start.elapsed()).as_secs_f64();
            if left < 0.005 {
                break;
            }
            let plan = if left < 0.1 { left } else { left * 0.6 };
            chunk = ((rate * plan) as u64).max(u64::from(BATCH));
        }
        let elapsed = start.elapsed();
        let cpu = thread_cpu() - cpu0;
        let after = self.counts();
        GenRun {
            elapsed,
            counts: GenCounts {
                flood: after.flood - before.flood,
                legit: after.legit - before.legit,
            },
            cpu,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the XDP program writes, computed here the same way, must equal what the lab's
    /// frame builder makes for that source and port.
    fn rewrite(frame: &mut [u8], family: Family, base: u64, udp_base: u64, low: u32, port: u16) {
        let fold = |mut s: u64| {
            while s > 0xffff {
                s = (s & 0xffff) + (s >> 16);
            }
            s as u16
        };
        let sum = base + u64::from(low >> 16) + u64::from(low & 0xffff);
        match family {
            Family::V4 => {
                frame[26..30].copy_from_slice(&low.to_be_bytes());
                frame[24..26].copy_from_slice(&(!fold(sum)).to_be_bytes());
                frame[36..38].copy_from_slice(&port.to_be_bytes());
                let c = !fold(udp_base + sum - base + u64::from(port));
                let c = if c == 0 { 0xffff } else { c };
                frame[40..42].copy_from_slice(&c.to_be_bytes());
            }
            Family::V6 => {
                frame[34..38].copy_from_slice(&low.to_be_bytes());
                frame[56..58].copy_from_slice(&port.to_be_bytes());
                let c = !fold(sum + u64::from(port));
                let c = if c == 0 { 0xffff } else { c };
                frame[60..62].copy_from_slice(&c.to_be_bytes());
            }
        }
    }

    #[test]
    fn generator_checksums_match_the_frame_builder() {
        let (sm, dm) = ([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
        let dst4 = Ipv4Addr::new(198, 18, 7, 2);
        let dst6: Ipv6Addr = "2001:db8:7::2".parse().unwrap();
        for (family, lows) in [
            (
                Family::V4,
                [V4_FLOOD_BASE, V4_HEAVY, 0xac10_0063, 0x0aff_ffff],
            ),
            (
                Family::V6,
                [V6_FLOOD_BASE, V6_HEAVY, V6_LEGIT_BASE, 0xffff_ffff],
            ),
        ] {
            let build = |low: u32, port: u16| {
                let f = Frame::new(sm, dm);
                let f = match family {
                    Family::V4 => f.ipv4(addr4(low), dst4),
                    Family::V6 => f.ipv6(addr6(V6_FLOOD_PREFIX, low), dst6),
                };
                f.udp(40000, port).pad_to(60).build()
            };
            let template = build(lows[0], FLOOD_PORT);
            let base = csum_base(&template, family);
            let udp_base = match family {
                Family::V4 => udp_csum_base_v4(&template),
                Family::V6 => 0,
            };
            for low in lows {
                for port in [FLOOD_PORT, LEGIT_PORT] {
                    // From the template, and from a page an earlier run already rewrote.
                    for mut page in [template.clone(), build(0xdead_beef, 1234)] {
                        rewrite(&mut page, family, base, udp_base, low, port);
                        assert_eq!(page, build(low, port), "{family:?} {low:#x} {port}");
                    }
                }
            }
        }
    }
}
