extern crate std;

use super::*;

/// A key as the daemon draws one: random words (here from splitmix64 of `seed`).
fn key_from(seed: u64) -> HashKey {
    let mut x = seed;
    core::array::from_fn(|_| {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    })
}

const KEY: HashKey = [
    0x6d5a_56da_5c7a_6b1e,
    0x1f3c_2b8e_9d47_a601,
    0xc4e1_0f93_27b8_5d6a,
    0x83a7_4c1d_e905_f2b3,
    0x5e29_b6f0_1c8d_4a77,
    0xa91f_d3c2_6e40_8b15,
];

/// `known_hash` is the hash it documents: the key's constant plus its multipliers times
/// the message's words (the address as four little-endian words, then the rule and the
/// prefix length), modulo 2^64, top 32 bits, through MurmurHash3's finalizer (checked on
/// known values).
#[test]
fn known_hash_is_the_multilinear_sum_it_documents() {
    fn reference(key: &HashKey, m: [u64; 5]) -> u64 {
        let sum = (0..5).fold(key[0] as u128, |h, i| h + key[i + 1] as u128 * m[i] as u128);
        fmix64(((sum % (1u128 << 64)) >> 32) as u64)
    }
    let mut v4 = [0u8; 16];
    v4[10] = 0xff;
    v4[11] = 0xff;
    v4[12..].copy_from_slice(&[198, 18, 0, 1]);
    let v6: [u8; 16] = core::array::from_fn(|i| 0x20 + i as u8);
    let word =
        |a: &[u8; 16], i: usize| u32::from_le_bytes(a[4 * i..4 * i + 4].try_into().unwrap()) as u64;
    for key in [KEY, key_from(1), [u64::MAX; HASH_KEY_WORDS]] {
        for (rule, plen, a) in [(3u8, 128u32, v4), (3, 64, v6), (15, 0, [0xff; 16])] {
            let m = [word(&a, 0), word(&a, 1), word(&a, 2), word(&a, 3)];
            assert_eq!(
                known_hash(&key, rule, plen, &a),
                reference(
                    &key,
                    [m[0], m[1], m[2], m[3], rule as u64 | (plen as u64) << 8]
                ),
                "{a:x?}"
            );
        }
    }
    // The same address bytes under two families never give one message.
    assert_ne!(
        known_hash(&KEY, 3, 128, &v4),
        known_hash(&KEY, 3, 128, &[0; 16])
    );
    assert_eq!(fmix64(0), 0);
    assert_eq!(fmix64(1), 0xb456_bcfc_34c2_cb2c);
}

/// Strong universality, as far as a test can see it: two fixed sources that differ in
/// one bit, or only in their rule, share their first set (of 1024) under about 1 in 1024
/// of 16384 random keys, as two independent draws would (expected 16).
#[test]
fn two_given_sources_share_a_set_only_by_chance_of_the_key() {
    let sets = 1024u32;
    let mut a = [0u8; 16];
    a[10] = 0xff;
    a[11] = 0xff;
    a[12..].copy_from_slice(&[203, 0, 113, 9]);
    let mut b = a;
    b[15] ^= 1;
    let v6: [u8; 16] = core::array::from_fn(|i| 0x20 + i as u8);
    let mut v6b = v6;
    v6b[0] ^= 0x80;
    for (x, y) in [
        ((0u8, 128u32, a), (0u8, 128u32, b)),
        ((0, 128, a), (1, 128, a)),
        ((0, 64, v6), (0, 64, v6b)),
    ] {
        let same = (0..16_384u64)
            .filter(|&seed| {
                let k = key_from(seed);
                store_sets_of(known_hash(&k, x.0, x.1, &x.2), sets).0
                    == store_sets_of(known_hash(&k, y.0, y.1, &y.2), sets).0
            })
            .count();
        assert!((2..=40).contains(&same), "{same} of 16384 keys");
    }
}

/// Another key, another placement: of 4096 sources, about 1 in `sets` keep their first
/// set (as two independent draws would), and a key's own placement is repeatable.
#[test]
fn the_placement_depends_on_the_key() {
    let sets = 1024u32;
    let other = key_from(2);
    let mut same = 0;
    for i in 0..4096u32 {
        let mut a = [0u8; 16];
        a[0] = 0x20;
        a[1] = 0x01;
        a[12..].copy_from_slice(&i.to_be_bytes());
        let p = store_sets_of(known_hash(&KEY, 0, 64, &a), sets);
        assert_eq!(p, store_sets_of(known_hash(&KEY, 0, 64, &a), sets));
        same += usize::from(p.0 == store_sets_of(known_hash(&other, 0, 64, &a), sets).0);
    }
    assert!(same < 16, "{same} of 4096 kept their set under another key");
}

#[test]
fn state_memory_is_the_longest_span_a_limiter_remembers() {
    let l = Limit {
        interval_ns: 1_000_000_000,
        ..Limit::default()
    };
    assert_eq!(state_memory_ns(&l), 2_000_000_000);
    let tb = Limit {
        interval_ns: 1_000_000_000,
        gcra_burst_ns: 5_000_000_000,
        gcra_inc_ns: 1_000_000,
        ..Limit::default()
    };
    assert_eq!(state_memory_ns(&tb), 5_001_000_000);
    let ban = Limit {
        ban_interval_ns: 3_000_000_000,
        ..l
    };
    assert_eq!(state_memory_ns(&ban), 6_000_000_000);
    assert_eq!(protect_ms(1), 1);
    assert_eq!(protect_ms(2_000_000_000), 2000);
    assert_eq!(protect_ms(u64::MAX), u32::MAX);
}

#[test]
fn admission_tick_cap_is_twice_a_ticks_share_and_at_least_64() {
    assert_eq!(admission_tick_cap(0, 4_000_000), 0);
    assert_eq!(admission_tick_cap(1000, 4_000_000), 64);
    assert_eq!(admission_tick_cap(10_000, 4_000_000), 80);
    assert_eq!(admission_tick_cap(10_000, 1_000_000), 64);
    assert_eq!(admission_tick_cap(1_000_000, 4_000_000), 8000);
    assert_eq!(admission_tick_cap(u64::MAX, u64::MAX), u32::MAX);
}

#[test]
fn store_layout_is_108_bytes_a_source_with_the_tags_in_one_line() {
    assert_eq!(size_of::<ClientState>(), 88);
    assert_eq!(size_of::<Slot>(), 104);
    assert_eq!(size_of::<StoreSet>(), 864);
    assert_eq!(size_of::<StoreSet>() / STORE_WAYS, 108);
    // Set i starts at 864 i, a multiple of 32, and its tags are its first 32 bytes: one
    // cache line holds them whatever i is.
    assert_eq!(size_of::<StoreSet>() % 32, 0);
    assert_eq!(core::mem::offset_of!(StoreSet, slots), 32);
    assert_eq!(store_sets(0), 1);
    assert_eq!(store_sets(1), 1);
    assert_eq!(store_sets(8), 1);
    assert_eq!(store_sets(9), 2);
    assert_eq!(store_sets(1_000_000), 125_000);
}

#[test]
fn slot_tags_round_trip_and_never_look_empty_or_busy() {
    for (rule, plen, hash) in [
        (0u8, 0u32, 0u64),
        (15, 128, u64::MAX),
        (3, 127, 0x1234_5678_9abc_def0),
        (1, 1, u64::MAX),
        (0, 0, 1 << 46),
    ] {
        let t = slot_tag(rule, plen, hash);
        assert!(slot_ready(t), "{t:#x}");
        let addr = [7u8; 16];
        let k = slot_key(t, addr);
        assert_eq!(
            (k.rule, k.kind, k.prefix_len, k.addr),
            (rule, KEY_IP, plen, addr)
        );
        assert!(!slot_ready(t | SLOT_BUSY));
    }
    assert!(!slot_ready(0));
}

/// Two choices fill the store evenly: of distinct random sources (a random-source flood)
/// making 90% of its capacity, fewer than 1 in 100 find both their sets full (with one
/// choice, about 1 in 10 would), and the two sets of a key are independent of each other.
#[test]
fn two_choices_place_90_percent_of_capacity_nearly_without_an_eviction() {
    let sets = 4096u32;
    let n = (sets as usize * STORE_WAYS) * 90 / 100;
    let place = |two: bool| {
        let mut used = std::vec![0usize; sets as usize];
        let mut homeless = 0;
        let mut same = 0;
        for i in 0..n as u32 {
            let mut a = [0u8; 16];
            a[10] = 0xff;
            a[11] = 0xff;
            let r = key_from(i as u64)[0] as u32;
            a[12..].copy_from_slice(&r.to_be_bytes());
            let (x, y) = store_sets_of(known_hash(&KEY, 0, 128, &a), sets);
            same += usize::from(x == y);
            let s = if two && used[y as usize] < used[x as usize] {
                y
            } else {
                x
            } as usize;
            if used[s] < STORE_WAYS {
                used[s] += 1;
            } else {
                homeless += 1;
            }
        }
        (homeless, same)
    };
    let (two, same) = place(true);
    let (one, _) = place(false);
    assert!(
        two < n / 100,
        "two choices: {two} of {n} found both sets full"
    );
    assert!(one > n / 20, "one choice: {one} of {n}");
    std::println!("two choices: {two} of {n} homeless; one choice: {one}");
    // Coinciding sets: about n / sets of them.
    assert!(same < 3 * n / sets as usize + 3, "{same}");
}

#[test]
fn known_filter_sizes() {
    assert_eq!(known_log2_bits(1), 6);
    assert_eq!(known_log2_bits(4000), 15);
    assert_eq!(known_log2_bits(65536), 19);
    assert_eq!(known_log2_bits(65537), 20);
    assert_eq!(known_log2_bits(1_000_000), 23);
    assert_eq!(known_log2_bits(u32::MAX), KNOWN_MAX_LOG2);
    assert_eq!(known_map_entries(1), 3);
    assert_eq!(known_map_entries(65536), 1 + 2 * (1 << 13));
}

/// Consecutive IPv4 sources (IPv4-mapped keys: their first 10 bytes are zero) and IPv6
/// /64s spread over the bits as uniformly random ones would, under every one of 16 keys:
/// n keys in m bits set about m (1 - e^(-n/m)) of them. (Without the finalizer, under
/// some keys consecutive sources set 30% fewer.)
#[test]
fn known_hash_spreads_mapped_and_v6_keys() {
    let log2 = 16;
    let m = 1u64 << log2;
    let n = 16_384u32;
    let expect = m as f64 * (1.0 - (-(n as f64) / m as f64).exp());
    for seed in 0..16 {
        let key = key_from(seed);
        let count = |keys: &mut dyn Iterator<Item = (u8, u32, [u8; 16])>| {
            let mut bits = std::collections::HashSet::new();
            for (rule, plen, addr) in keys {
                bits.insert(known_bit(known_hash(&key, rule, plen, &addr), log2));
            }
            bits.len() as f64
        };
        let v4 = count(&mut (0..n).map(|i| {
            let mut a = [0u8; 16];
            a[10] = 0xff;
            a[11] = 0xff;
            a[12..].copy_from_slice(&(0xc612_0000u32 + i).to_be_bytes());
            (0, 128, a)
        }));
        let v6 = count(&mut (0..n).map(|i| {
            let mut a = [0u8; 16];
            a[0] = 0x20;
            a[1] = 0x01;
            a[4..8].copy_from_slice(&i.to_be_bytes());
            (1, 64, a)
        }));
        // One source under several rules: distinct bits too.
        let rules = count(&mut (0..n).map(|i| {
            let mut a = [0u8; 16];
            a[12..].copy_from_slice(&(i / 8).to_be_bytes());
            ((i % 8) as u8, 128, a)
        }));
        for (what, got) in [("v4", v4), ("v6", v6), ("rules", rules)] {
            assert!(
                (got - expect).abs() < expect * 0.02,
                "key {seed}, {what}: {got} bits set, {expect:.0} expected"
            );
        }
    }
}
