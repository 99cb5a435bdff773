//! Frames for the differential fuzz test (`tests/tests/fuzz.rs`): seeded and reproducible (a
//! seed and a frame index give the same bytes on every machine), no external fuzzer.
//!
//! A mix of random bytes and structured mutations of valid frames: 0-3 VLAN tags (802.1Q and
//! 802.1ad), IPv4 with options, bad IHL, bad version, bad total length, first and later
//! fragments; IPv6 with extension chains (hop-by-hop, routing, destination options, AH,
//! fragment) up to chains longer than the parser walks or reaching past its offset bound;
//! TCP with any flag byte, UDP, ICMP, ICMPv6, other protocols; truncation at any offset;
//! sources of every address class of both families, and sources the fuzz config lists, denies,
//! bans, or matches by source list. Sources come from small pools so that thresholds are
//! reached and bans issued; a few are fully random. What the match fields read varies too:
//! source ports (53 and 123 among them), TTLs at the edges of the config's ranges, two
//! destinations, ICMP types and codes, payloads that begin with the bytes a rule looks for.

pub use crate::rng::Rng;

/// The frame with index `i` of the run seeded `seed`: independent of every other frame, so a
/// failing frame can be regenerated from (seed, index) alone.
///
/// One frame in six repeats the one before it (one in three of those with more payload): a
/// source's like packets within one timer tick are what the program's fast-drop table
/// (`ratelimit-ebpf/src/fast.rs`) answers, and it must answer them as the full evaluation does.
pub fn frame(seed: u64, i: u64) -> Vec<u8> {
    let rng_of = |i: u64| {
        let mut rng = Rng::new(seed ^ i.wrapping_mul(0xd6e8_feb8_6659_fd93));
        rng.next_u64();
        rng
    };
    // Walk back over the repeats to the frame they repeat.
    let mut first = i;
    while first > 0 && rng_of(first).below(6) == 0 {
        first -= 1;
    }
    let mut f = fresh(&mut rng_of(first));
    for k in first + 1..=i {
        let mut rng = rng_of(k);
        rng.below(6);
        if rng.chance(33) && f.len() + 64 <= MAX_FRAME {
            let n = 1 + rng.below(64) as usize;
            f.extend(rng.bytes(n));
        }
    }
    f
}

fn fresh(rng: &mut Rng) -> Vec<u8> {
    rng.below(6);
    let mut f = match rng.below(100) {
        0..=7 => random_bytes(rng),
        8..=11 => non_ip(rng),
        12..=55 => ipv4(rng),
        _ => ipv6(rng),
    };
    mutate(rng, &mut f);
    f
}

/// Longest frame generated (an Ethernet MTU).
pub const MAX_FRAME: usize = 1514;

const SERVER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 2];
const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 1];

/// Ethernet header with 0-3 VLAN tags, then `ethertype`.
fn l2(rng: &mut Rng, ethertype: u16) -> Vec<u8> {
    let mut f = Vec::with_capacity(128);
    f.extend_from_slice(&SERVER_MAC);
    f.extend_from_slice(&CLIENT_MAC);
    let tags = match rng.below(100) {
        0..=69 => 0,
        70..=84 => 1,
        85..=96 => 2,
        _ => 3,
    };
    for _ in 0..tags {
        f.extend_from_slice(&rng.pick(&[0x8100u16, 0x88a8]).to_be_bytes());
        f.extend_from_slice(&(rng.below(4096) as u16).to_be_bytes());
    }
    f.extend_from_slice(&ethertype.to_be_bytes());
    f
}

fn random_bytes(rng: &mut Rng) -> Vec<u8> {
    let any = rng.next_u64() as u16;
    let ethertype = rng.pick(&[0x0800u16, 0x86dd, 0x8100, 0x88a8, 0x0806, any]);
    let mut f = l2(rng, ethertype);
    let n = rng.below(120) as usize;
    f.extend(rng.bytes(n));
    f
}

fn non_ip(rng: &mut Rng) -> Vec<u8> {
    let ethertype = rng.pick(&[0x0806u16, 0x88cc, 0x88b5, 0x8847, 0x0842]);
    let mut f = l2(rng, ethertype);
    let n = 28 + rng.below(40) as usize;
    f.extend(rng.bytes(n));
    f
}

/// Sources the fuzz config names: (allow, deny, manual ban, rule source list).
pub const V4_LISTED: [[u8; 3]; 4] = [[198, 18, 50], [198, 18, 60], [198, 18, 70], [198, 18, 40]];
pub const V6_LISTED: [[u8; 6]; 4] = [
    [0x20, 0x01, 0x0d, 0xb8, 0x0a, 0x11],
    [0x20, 0x01, 0x0d, 0xb8, 0xde, 0xad],
    [0x20, 0x01, 0x0d, 0xb8, 0x00, 0xba],
    [0x20, 0x01, 0x0d, 0xb8, 0x00, 0x40],
];

/// An IPv4 source of some class, from a pool small enough that sources repeat.
pub fn v4_source(rng: &mut Rng) -> [u8; 4] {
    let h = rng.below(24) as u8;
    match rng.below(100) {
        0..=3 => [0, 0, 0, 0],
        4..=6 => [127, 0, 0, h],
        7..=10 => [224 + rng.below(16) as u8, 0, 0, h],
        11..=12 => [255, 255, 255, 255],
        13..=15 => [169, 254, rng.below(2) as u8, h],
        16..=21 => rng.pick(&[[192, 0, 2, h], [198, 51, 100, h], [203, 0, 113, h]]),
        22..=30 => {
            let net = rng.below(3) as u8;
            rng.pick(&[[10, 0, net, h], [172, 16, 0, h], [192, 168, 1, h]])
        }
        31..=60 => {
            let p = rng.pick(&V4_LISTED);
            // Both halves of 198.18.40.0/24 (the override covers the upper one), and the
            // edges of the /28 allow list.
            [p[0], p[1], p[2], rng.pick(&[h, 15, 16, 128 + h, 255])]
        }
        61..=97 => [
            rng.pick(&[1u8, 8, 23, 45, 91]),
            rng.below(3) as u8,
            rng.below(4) as u8,
            h,
        ],
        _ => rng.bytes(4).try_into().unwrap(),
    }
}

/// An IPv6 source of some class.
pub fn v6_source(rng: &mut Rng) -> [u8; 16] {
    let h = rng.below(24) as u8;
    let mut a = [0u8; 16];
    match rng.below(100) {
        0..=3 => {}
        4..=6 => a[15] = 1,
        7..=10 => {
            a[0] = 0xff;
            a[1] = rng.pick(&[0x02u8, 0x05, 0x0e]);
            a[15] = h;
        }
        11..=14 => {
            a[0] = 0xfe;
            a[1] = 0x80;
            a[15] = h;
        }
        15..=24 => {
            // IPv4-mapped, of an IPv4 source of the pool (which the lists and bans cover).
            a[10] = 0xff;
            a[11] = 0xff;
            a[12..].copy_from_slice(&v4_source(rng));
        }
        25..=29 => a[12..].copy_from_slice(&v4_source(rng)),
        30..=35 => {
            a[..4].copy_from_slice(&[0x20, 0x01, 0x0d, 0xb8]);
            a[7] = rng.below(3) as u8;
            a[15] = h;
        }
        36..=41 => {
            a[0] = 0xfd;
            a[7] = rng.below(2) as u8;
            a[15] = h;
        }
        42..=70 => {
            a[..6].copy_from_slice(&rng.pick(&V6_LISTED));
            // Several /56 and /64 networks of each listed /48.
            a[6] = rng.below(2) as u8;
            a[7] = rng.pick(&[0u8, 1, 0x80]);
            a[15] = h;
        }
        71..=97 => {
            a[..4]
                .copy_from_slice(&rng.pick(&[[0x2a, 0x00, 0x14, 0x50], [0x24, 0x04, 0x68, 0x00]]));
            a[6] = rng.below(3) as u8;
            a[7] = rng.below(2) as u8;
            a[15] = h;
        }
        _ => a.copy_from_slice(&rng.bytes(16)),
    }
    a
}

/// An upper-layer protocol and its header (plus some payload), as bytes.
fn l4(rng: &mut Rng, v6: bool) -> (u8, Vec<u8>) {
    let proto = match rng.below(100) {
        0..=34 => 6,
        35..=69 => 17,
        70..=79 => {
            if v6 {
                58
            } else {
                1
            }
        }
        80..=84 => {
            if v6 {
                1
            } else {
                58
            }
        }
        _ => rng.pick(&[0u8, 2, 41, 47, 50, 59, 132, 255]),
    };
    let high = 1024 + rng.below(60000) as u16;
    let sport = rng.pick(&[high, high, high, 53, 123]).to_be_bytes();
    let mut h = match proto {
        6 => {
            let any = rng.next_u64() as u16;
            let dport: u16 = rng.pick(&[80, 443, 22, 8080, 53, any]);
            let mut h = Vec::with_capacity(20);
            h.extend_from_slice(&sport);
            h.extend_from_slice(&dport.to_be_bytes());
            h.extend(rng.bytes(8));
            let flags = if rng.chance(50) {
                rng.pick(&[0x02u8, 0x12, 0x10, 0x11, 0x04, 0x18, 0x03, 0x06])
            } else {
                rng.byte()
            };
            h.extend_from_slice(&[0x50, flags]);
            h.extend(rng.bytes(6));
            h
        }
        17 => {
            let (bucket, preview, any) = (
                5000 + rng.below(101) as u16,
                7000 + rng.below(1000) as u16,
                rng.next_u64() as u16,
            );
            let dport: u16 = rng.pick(&[53, bucket, 4999, 5101, preview, 123, any]);
            let mut h = sport.to_vec();
            h.extend_from_slice(&dport.to_be_bytes());
            h.extend_from_slice(&[0, 8, 0, 0]);
            h
        }
        1 | 58 => {
            let t = rng.pick(&[8u8, 0, 128, 129, 135, 3, 13]);
            vec![t, rng.pick(&[0u8, 0, 1]), 0, 0, 0, 1, 0, 1]
        }
        _ => Vec::new(),
    };
    let pay = rng.pick(&[0usize, 0, 8, 32, 200]);
    let mut body = rng.bytes(pay);
    // Some payloads begin with what the fuzz config's payload rule looks for.
    if body.len() >= 2 && rng.chance(30) {
        body[..2].copy_from_slice(&[0xab, 0xcd]);
    }
    h.extend(body);
    (proto, h)
}

/// An IPv4 TTL or IPv6 hop limit: mostly 64, some at the edges of the fuzz config's ranges.
fn ttl(rng: &mut Rng) -> u8 {
    rng.pick(&[64, 64, 64, 128, 0, 1, 10, 11, 249, 250, 255])
}

fn ipv4(rng: &mut Rng) -> Vec<u8> {
    let mut f = l2(rng, 0x0800);
    let (proto, upper) = l4(rng, false);
    let opt_words = if rng.chance(20) {
        1 + rng.below(10) as usize
    } else {
        0
    };
    let mut ihl = 5 + opt_words as u8;
    let mut version = 4u8;
    match rng.below(100) {
        0..=3 => ihl = rng.below(5) as u8,
        4..=5 => ihl = 5 + rng.below(11) as u8,
        6..=7 => version = rng.pick(&[0u8, 6, 15]),
        _ => {}
    }
    let header_len = 20 + opt_words * 4;
    let mut total = (header_len + upper.len()) as u16;
    match rng.below(100) {
        0..=4 => total = rng.below(4 * ihl as u64 + 1) as u16,
        5..=7 => total = rng.next_u64() as u16,
        _ => {}
    }
    let frag: u16 = match rng.below(100) {
        0..=79 => 0x4000 * rng.below(2) as u16,
        80..=89 => 0x2000,
        _ => (rng.below(2) as u16) << 13 | (1 + rng.below(0x1fff) as u16),
    };
    let src = v4_source(rng);
    f.push(version << 4 | (ihl & 0x0f));
    f.push(0);
    f.extend_from_slice(&total.to_be_bytes());
    f.extend_from_slice(&(rng.next_u64() as u16).to_be_bytes());
    f.extend_from_slice(&frag.to_be_bytes());
    f.extend_from_slice(&[ttl(rng), proto, 0, 0]);
    f.extend_from_slice(&src);
    f.extend_from_slice(&[198, 18, 0, rng.pick(&[1, 1, 1, 2])]);
    for _ in 0..opt_words {
        f.extend_from_slice(&rng.pick(&[[1u8, 1, 1, 1], [0x94, 4, 0, 0], [7, 3, 4, 0]]));
    }
    f.extend(upper);
    f
}

/// An extension header's length byte and the rest of its body (`body_len(length)` random
/// bytes): the length below `rare` one time in ten, else below `usual`.
fn length_and_body(
    rng: &mut Rng,
    (rare, usual): (u64, u64),
    body_len: impl Fn(usize) -> usize,
) -> Vec<u8> {
    let length = if rng.chance(10) {
        rng.below(rare)
    } else {
        rng.below(usual)
    };
    let mut b = vec![length as u8];
    b.extend(rng.bytes(body_len(length as usize)));
    b
}

fn ipv6(rng: &mut Rng) -> Vec<u8> {
    let mut f = l2(rng, 0x86dd);
    let (proto, upper) = l4(rng, true);
    // The extension chain, innermost last: (type, body after the next-header byte).
    let n = match rng.below(100) {
        0..=49 => 0,
        50..=84 => 1 + rng.below(3),
        85..=94 => 4 + rng.below(3),
        _ => 7 + rng.below(3),
    };
    let mut chain: Vec<(u8, Vec<u8>)> = Vec::new();
    for _ in 0..n {
        let t = rng.pick(&[0u8, 43, 60, 51, 44]);
        let body = match t {
            44 => {
                // Fragment: offset 0 (first) or later, M flag either way.
                let off: u16 = if rng.chance(50) {
                    0
                } else {
                    1 + rng.below(0x1fff) as u16
                };
                let mut b = vec![0u8];
                b.extend_from_slice(&(off << 3 | rng.below(2) as u16).to_be_bytes());
                b.extend(rng.bytes(4));
                b
            }
            // AH: its length in 4-byte words minus 2.
            51 => length_and_body(rng, (128, 4), |words| (words + 2) * 4 - 2),
            // The others: in 8-byte units minus 1.
            _ => length_and_body(rng, (64, 3), |units| (units + 1) * 8 - 2),
        };
        chain.push((t, body));
    }
    let first = chain.first().map_or(proto, |c| c.0);
    let mut payload = Vec::new();
    for (k, (_, body)) in chain.iter().enumerate() {
        let next = chain.get(k + 1).map_or(proto, |c| c.0);
        payload.push(next);
        payload.extend_from_slice(body);
    }
    payload.extend(upper);
    let version = if rng.chance(3) {
        rng.pick(&[4u8, 0, 7])
    } else {
        6
    };
    f.push(version << 4);
    f.extend_from_slice(&[0, 0, 0]);
    f.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    f.push(first);
    f.push(ttl(rng));
    f.extend_from_slice(&v6_source(rng));
    let host = rng.pick(&[1, 1, 1, 2]);
    f.extend_from_slice(&[
        0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, host,
    ]);
    f.extend(payload);
    f
}

/// Byte-level mutations of a built frame: truncation at any offset, flipped or zeroed bytes.
fn mutate(rng: &mut Rng, f: &mut Vec<u8>) {
    if rng.chance(15) && f.len() > 14 {
        let at = 14 + rng.below((f.len() - 14) as u64) as usize;
        f.truncate(at);
    }
    if rng.chance(5) && f.len() > 14 {
        for _ in 0..1 + rng.below(3) {
            let at = 12 + rng.below((f.len() - 12) as u64) as usize;
            f[at] = if rng.chance(50) { 0 } else { rng.byte() };
        }
    }
    // Long extension chains can pass an MTU; a frame stays one page of the test run.
    f.truncate(MAX_FRAME);
    // BPF_PROG_TEST_RUN refuses frames shorter than an Ethernet header.
    if f.len() < 14 {
        f.resize(14, 0);
    }
}

/// Smaller candidates of `frame` for shrinking a difference, most promising first: shorter
/// (halfway, at header boundaries, one byte less), one VLAN tag fewer, then blocks of 16 and
/// 4 bytes zeroed, then single bytes of the first 96 (the headers).
pub fn shrink_candidates(frame: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let n = frame.len();
    let mut cuts: Vec<usize> = vec![14 + n.saturating_sub(14) / 2];
    cuts.extend([18, 22, 34, 38, 42, 54, 58, 62, 74, 94, 118]);
    cuts.push(n.saturating_sub(1));
    for c in cuts {
        if c >= 14 && c < n {
            out.push(frame[..c].to_vec());
        }
    }
    if n >= 18 && matches!(u16::from_be_bytes([frame[12], frame[13]]), 0x8100 | 0x88a8) {
        let mut f = frame[..12].to_vec();
        f.extend_from_slice(&frame[16..]);
        out.push(f);
    }
    for block in [16usize, 4, 1] {
        let end = if block == 1 { n.min(96) } else { n };
        for at in (14..end).step_by(block) {
            let to = (at + block).min(n);
            if frame[at..to].iter().any(|b| *b != 0) {
                let mut f = frame.to_vec();
                f[at..to].fill(0);
                out.push(f);
            }
        }
    }
    out
}

/// Parse a regression file: frames as hex, one a line (`#` comments and blank lines
/// ignored; whitespace inside a line ignored).
pub fn parse_hex_frames(text: &str) -> Result<Vec<Vec<u8>>, String> {
    let mut frames = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("");
        let hex: String = line.chars().filter(|c| !c.is_whitespace()).collect();
        if hex.is_empty() {
            continue;
        }
        if !hex.len().is_multiple_of(2) {
            return Err(format!("line {}: odd number of hex digits", n + 1));
        }
        let bytes = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|e| format!("line {}: {e}", n + 1))?;
        frames.push(bytes);
    }
    Ok(frames)
}

/// A frame as one line of hex.
pub fn hex_line(frame: &[u8]) -> String {
    frame.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_reproducible_and_never_shorter_than_ethernet() {
        for i in 0..2000 {
            let a = frame(7, i);
            assert_eq!(a, frame(7, i));
            assert!(a.len() >= 14 && a.len() <= MAX_FRAME);
        }
        assert_ne!(frame(7, 1), frame(8, 1));
    }

    #[test]
    fn hex_round_trip() {
        let f = frame(1, 2);
        let text = format!("# a comment\n{}\n\n", hex_line(&f));
        assert_eq!(parse_hex_frames(&text).unwrap(), vec![f]);
    }
}
