//! The known-sources filter (`RL_KNOWN`) and the keyed placement hash that the filter and the
//! per-source store share.

/// The known-sources filter (`RL_KNOWN`, an mmap-able array of u64): one bit per hash of a
/// per-source [`ClientKey`] (`KEY_IP`), set before the program inserts that key's state, so
/// a clear bit proves the source has no state and its per-client lookup can be skipped. In a
/// random-source flood nearly every packet is such a source, and the lookup that misses (a
/// walk of a hash chain through memory no cache holds) is what it costs most.
///
/// Word 0 is the control word (`KNOWN_*` flags, and the number of bits per half in
/// bits 8..15 as a power of two); then two halves of `1 << (log2 - 6)` words each. The program
/// reads the active half and sets a new key's bit in both. Bits of evicted states stay set
/// (a set bit only costs the lookup), so the daemon rebuilds the other half from the map
/// now and then: it clears it, waits for inserts in flight, sets the bit of every state it
/// walks (states inserted during the walk set their own), then makes it the active half.
/// The filter is off until the daemon's first rebuild after it loads the program.
///
/// [`ClientKey`]: super::ClientKey
pub const KNOWN_ENABLED: u64 = 1 << 0;
/// Control word: the active half is the second.
pub const KNOWN_HALF: u64 = 1 << 1;
/// Control word: position of log2(bits per half).
pub const KNOWN_LOG2_SHIFT: u32 = 8;
/// Bounds of log2(bits per half): at least one word, at most 128 MiB a half.
pub const KNOWN_MIN_LOG2: u64 = 6;
pub const KNOWN_MAX_LOG2: u64 = 30;

/// log2 of the bits per half for a per-client map of `max_sources`: 8 to 16 bits per
/// source (a power of two), so a full map leaves 6 to 12% of untracked sources to a lookup.
pub const fn known_log2_bits(max_sources: u32) -> u64 {
    let n = if max_sources < 8 {
        8
    } else {
        max_sources as u64
    };
    let log2 = (n.next_power_of_two() * 8).trailing_zeros() as u64;
    if log2 > KNOWN_MAX_LOG2 {
        KNOWN_MAX_LOG2
    } else {
        log2
    }
}

/// Entries of `RL_KNOWN` for a per-client map of `max_sources`: the control word and two halves.
pub const fn known_map_entries(max_sources: u32) -> u32 {
    1 + 2 * (1u32 << (known_log2_bits(max_sources) - KNOWN_MIN_LOG2))
}

/// 64-bit words of [`HashKey`]: a constant and one multiplier for each of the message's five
/// 32-bit words ([`known_hash`]).
pub const HASH_KEY_WORDS: usize = 6;

/// The per-load key of the placement hash ([`known_hash`]): six 64-bit words the daemon draws
/// from the OS's random source when it creates the maps, and keeps in `RL_HASH_KEY` for as
/// long as they are pinned (a daemon that adopts them reads it back: with another key, every
/// state would sit in sets no lookup visits). All zero until drawn.
pub type HashKey = [u64; HASH_KEY_WORDS];

/// The hash of a per-source key: the known-sources filter indexes by its top bits, the store
/// places the key by it ([`store_sets_of`]) and tags its slot with it ([`slot_tag`]). The
/// program and the daemon compute it alike (this function, in both).
///
/// Keyed per load, because a hash with public constants lets anyone who can choose source
/// addresses (an IPv6 attacker holds 2^64 of them in a /64) compute, offline, sources whose
/// two sets are a chosen client's, and evict its state. What it takes is a hash drawn at
/// random from a *strongly universal* family: for any two distinct messages, their hashes
/// are independent and uniform over the draw of the key, so no source can be chosen, before
/// the key is drawn, to share a client's sets more often than a source tried blind.
///
/// The family is multilinear hashing (Lemire and Kaser, "Strongly universal string hashing
/// is fast", 2014): the message as 32-bit words `m1..m5`, 64-bit keys `k0..k5`, and
/// `(k0 + k1 m1 + ... + k5 m5) mod 2^64`, whose top 32 bits are strongly universal. A fixed
/// bijection (MurmurHash3's 64-bit finalizer) then spreads those 32 bits over the 64 the
/// store and the filter take theirs from: a bijection of independent uniform values leaves
/// them independent and uniform, and it spreads sources that differ by a regular step
/// (consecutive addresses) as random ones would, where the bare sums, an arithmetic
/// progression, bunch up under some keys. (32 bits tell 4 billion sources apart, and two
/// sources that share them share their sets only as two random ones would: the address is
/// compared in full.) The message is the 16-byte address (an IPv4 source as
/// `::ffff:a.b.c.d`, so the two families never share one) as four little-endian words, then
/// the rule and the prefix length (one byte each; a prefix length is at most 128). Seven
/// multiplies and no branch, inline in the packet's path: SipHash-1-3, the pseudorandom
/// function it replaces, cost some 20 ns a lookup on the benchmark's CPU (a call, and four to
/// six rounds of 64-bit rotations, which BPF has no instruction for; BENCHMARKS.md,
/// "Data-plane hardening: before and after").
///
/// What it gives up against a pseudorandom function: the sum is linear in the key, so an
/// attacker who learnt which of its own sources share a set would learn relations between
/// the key's words. The store shows that only through evictions (a source's state lost to
/// a flood of others), which it makes slow to probe (two choices of eight ways, protected
/// states, the admission budget), and a key lasts only as long as its pinned maps.
///
/// [`store_sets_of`]: super::store_sets_of
/// [`slot_tag`]: super::slot_tag
#[inline(always)]
pub fn known_hash(key: &HashKey, rule: u8, prefix_len: u32, addr: &[u8; 16]) -> u64 {
    let w = |i: usize| {
        u32::from_le_bytes([
            addr[4 * i],
            addr[4 * i + 1],
            addr[4 * i + 2],
            addr[4 * i + 3],
        ]) as u64
    };
    let m5 = rule as u64 | ((prefix_len & 0xff) as u64) << 8;
    let sum = key[0]
        .wrapping_add(key[1].wrapping_mul(w(0)))
        .wrapping_add(key[2].wrapping_mul(w(1)))
        .wrapping_add(key[3].wrapping_mul(w(2)))
        .wrapping_add(key[4].wrapping_mul(w(3)))
        .wrapping_add(key[5].wrapping_mul(m5));
    fmix64(sum >> 32)
}

/// MurmurHash3's 64-bit finalizer: a bijection of `u64` in which every input bit moves about
/// half the output bits.
#[inline(always)]
pub const fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ h >> 33
}

/// The bit of `hash` in a half of `2^log2` bits: (word within the half, bit within the word).
#[inline(always)]
pub fn known_bit(hash: u64, log2: u64) -> (u64, u64) {
    let idx = hash >> (64 - log2);
    (idx >> 6, idx & 63)
}
