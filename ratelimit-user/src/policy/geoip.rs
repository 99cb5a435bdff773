//! The GeoIP database behind `key = "region"`: a MaxMind DB (GeoLite2-Country / GeoIP2-Country
//! layout, or any database whose records carry the same country fields, such as City) flattened
//! into `network → ISO 3166-1 alpha-2 code` and written into the `RL_REGIONS` LPM trie.
//!
//! A record's region is `country.iso_code`, else `registered_country.iso_code`, else
//! `represented_country.iso_code`. Networks without any of them (and addresses the database
//! does not cover) get no trie entry, which the data plane reads as `ZZ`, unknown.
//!
//! MaxMind IPv6 databases keep IPv4 under `::/96` and reach the same subtree through alias
//! networks (`::ffff:0:0/96`, `2001::/32`, `2002::/16`). The walk covers `0.0.0.0/0` (IPv4,
//! becoming IPv4 prefixes, which the trie maps into `::ffff:0:0/96`) and `::/0` (IPv6) apart,
//! and skips the aliases and anything in `::ffff:0:0/96` on the IPv6 side, so IPv4 space is
//! listed once and the IPv4-mapped range belongs to the IPv4 entries alone.

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
};

use anyhow::{Context as _, bail, ensure};
use aya::maps::{LpmTrie, MapData};
use ipnet::IpNet;
use maxminddb::{Reader, WithinOptions, geoip2};
use ratelimit_common::{addr::LpmAddr, caps::MAX_REGION_PREFIXES};

use crate::policy::apply::{Prefix, lpm_key, prefix, prefix_of_lpm};

/// A GeoIP database flattened into disjoint networks and their country codes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionTable {
    /// Sorted by network, no duplicates; codes are two uppercase ASCII letters.
    pub entries: Vec<(IpNet, [u8; 2])>,
    /// From the database's metadata, e.g. `GeoLite2-Country`.
    pub database_type: String,
    /// Seconds since the Unix epoch at which the database was built (metadata).
    pub build_epoch: u64,
}

/// Reads and flattens a MaxMind DB.
///
/// Fails when the file cannot be read, is not a MaxMind DB, holds records that are not maps or
/// country codes that are not two letters, has more networks than the regions map holds
/// ([`MAX_REGION_PREFIXES`]), or has networks with data of which none carries a country code
/// (a database of another kind, such as ASN).
pub fn load(path: &Path) -> anyhow::Result<RegionTable> {
    let bytes = std::fs::read(path)
        .with_context(|| format!("cannot read the GeoIP database {}", path.display()))?;
    let reader = Reader::from_source(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not a MaxMind DB (GeoLite2/GeoIP2 .mmdb): {e}",
            path.display()
        )
    })?;
    let meta = reader.metadata();
    let database_type = meta.database_type.clone();
    let build_epoch = meta.build_epoch;

    let mut walk = Walk {
        reader: &reader,
        codes: HashMap::new(),
        entries: BTreeMap::new(),
        with_data: 0,
    };
    walk.run("0.0.0.0/0", false)
        .with_context(|| format!("reading the GeoIP database {}", path.display()))?;
    if meta.ip_version == 6 {
        walk.run("::/0", true)
            .with_context(|| format!("reading the GeoIP database {}", path.display()))?;
    }
    if walk.with_data > 0 && walk.entries.is_empty() {
        bail!(
            "{}: wrong record layout: none of its {} networks has country.iso_code, \
             registered_country.iso_code or represented_country.iso_code (database type \
             {database_type:?}; a GeoLite2-Country or GeoIP2-Country database is needed)",
            path.display(),
            walk.with_data,
        );
    }
    let table = RegionTable {
        entries: walk.entries.into_iter().collect(),
        database_type,
        build_epoch,
    };
    check_capacity(table.entries.len())
        .with_context(|| format!("GeoIP database {}", path.display()))?;
    Ok(table)
}

/// Makes the regions trie equal to the table: inserts (or overwrites) every entry, then removes
/// the keys that are not in the table, so lookups never see a gap during a reload. Returns the
/// number of prefixes the trie holds afterwards. A table larger than the map is rejected before
/// anything is written.
pub fn apply(
    trie: &mut LpmTrie<MapData, LpmAddr, [u8; 4]>,
    table: &RegionTable,
) -> anyhow::Result<usize> {
    let want: BTreeMap<Prefix, [u8; 4]> = table
        .entries
        .iter()
        .map(|(net, code)| (prefix(&net.trunc()), [code[0], code[1], 0, 0]))
        .collect();
    check_capacity(want.len())?;
    let have: Vec<Prefix> = trie
        .keys()
        .map(|k| k.map(|k| prefix_of_lpm(&k)))
        .collect::<Result<_, _>>()
        .context("reading the regions map")?;
    for ((len, key), value) in &want {
        crate::kernel::datapath::retry_enomem(|| trie.insert(&lpm_key(&(*len, *key)), value, 0))
            .context("writing the regions map")?;
    }
    for p in have {
        if !want.contains_key(&p) {
            trie.remove(&lpm_key(&p))
                .context("pruning the regions map")?;
        }
    }
    Ok(want.len())
}

/// Errors when `n` prefixes would not fit the regions map.
pub fn check_capacity(n: usize) -> anyhow::Result<()> {
    ensure!(
        n <= MAX_REGION_PREFIXES as usize,
        "{n} region prefixes do not fit the regions map, which holds {MAX_REGION_PREFIXES}"
    );
    Ok(())
}

/// The region of one record: two letters, uppercased; `None` when the record has no code.
fn region_of(record: &geoip2::Country<'_>) -> anyhow::Result<Option<[u8; 2]>> {
    let Some(code) = record
        .country
        .iso_code
        .or(record.registered_country.iso_code)
        .or(record.represented_country.iso_code)
    else {
        return Ok(None);
    };
    match code.as_bytes() {
        [a, b] if a.is_ascii_alphabetic() && b.is_ascii_alphabetic() => {
            Ok(Some([a.to_ascii_uppercase(), b.to_ascii_uppercase()]))
        }
        _ => bail!("country code {code:?} is not an ISO 3166-1 alpha-2 code"),
    }
}

struct Walk<'r> {
    reader: &'r Reader<Vec<u8>>,
    /// Region per data-section offset: records are shared by many networks.
    codes: HashMap<usize, Option<[u8; 2]>>,
    entries: BTreeMap<IpNet, [u8; 2]>,
    /// Networks with a record, with or without a code.
    with_data: usize,
}

impl Walk<'_> {
    /// Every network with data under `cidr`. On the IPv6 side (`v6_side`) IPv4 networks (the
    /// `::/96` subtree, listed by the IPv4 walk) and IPv4-mapped ones are skipped; aliases of
    /// the IPv4 subtree are skipped by the iterator (`WithinOptions::default()`).
    fn run(&mut self, cidr: &str, v6_side: bool) -> anyhow::Result<()> {
        let networks = self
            .reader
            .within(
                cidr.parse().expect("a valid CIDR"),
                WithinOptions::default(),
            )
            .with_context(|| format!("walking {cidr}"))?;
        for item in networks {
            let item = item.with_context(|| format!("walking {cidr}"))?;
            let network = item.network().with_context(|| format!("walking {cidr}"))?;
            let net = IpNet::new(network.ip(), network.prefix())
                .with_context(|| format!("network {network}"))?
                .trunc();
            if v6_side && is_ipv4_space(&net) {
                continue;
            }
            let Some(offset) = item.offset() else {
                continue;
            };
            self.with_data += 1;
            let code = match self.codes.get(&offset) {
                Some(code) => *code,
                None => {
                    let code = item
                        .decode::<geoip2::Country<'_>>()
                        .map_err(anyhow::Error::from)
                        .and_then(|record| match record {
                            Some(record) => region_of(&record),
                            None => Ok(None),
                        })
                        .with_context(|| format!("wrong record layout for {net}"))?;
                    self.codes.insert(offset, code);
                    code
                }
            };
            if let Some(code) = code {
                self.entries.insert(net, code);
            }
        }
        Ok(())
    }
}

/// IPv4 networks, and IPv6 networks inside `::ffff:0:0/96`, where the trie keeps IPv4.
fn is_ipv4_space(net: &IpNet) -> bool {
    match net {
        IpNet::V4(_) => true,
        IpNet::V6(n) => {
            let mapped: ipnet::Ipv6Net = "::ffff:0:0/96".parse().expect("valid");
            mapped.contains(n)
        }
    }
}

#[cfg(test)]
#[path = "../../../tests/src/mmdb.rs"]
mod mmdb_writer;

#[cfg(test)]
mod tests {
    use std::{collections::BTreeSet, net::IpAddr};

    use super::{mmdb_writer as w, *};

    fn tmp(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("ratelimit-geoip-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn set(entries: &[(&str, &str)]) -> BTreeSet<(IpNet, [u8; 2])> {
        entries
            .iter()
            .map(|(n, c)| (net(n), c.as_bytes().try_into().unwrap()))
            .collect()
    }

    fn table_set(t: &RegionTable) -> BTreeSet<(IpNet, [u8; 2])> {
        t.entries.iter().copied().collect()
    }

    /// The country code `maxminddb` finds for an address, and the network it reports.
    fn lookup(reader: &Reader<Vec<u8>>, addr: &str) -> Option<(String, String)> {
        let ip: IpAddr = addr.parse().unwrap();
        let r = reader.lookup(ip).unwrap();
        let rec: geoip2::Country<'_> = r.decode().unwrap()?;
        Some((
            rec.country.iso_code.unwrap().to_owned(),
            r.network().unwrap().to_string(),
        ))
    }

    /// The code the trie would return: longest prefix of the table containing the address.
    fn trie_lookup(t: &RegionTable, addr: &str) -> Option<[u8; 2]> {
        let ip: IpAddr = addr.parse().unwrap();
        t.entries
            .iter()
            .filter(|(n, _)| n.contains(&ip))
            .max_by_key(|(n, _)| n.prefix_len())
            .map(|(_, c)| *c)
    }

    const DISJOINT: &[(&str, &str)] = &[
        ("1.0.0.0/24", "AU"),
        ("2.16.0.0/13", "FR"),
        ("5.1.2.3/32", "DE"),
        ("128.0.0.0/1", "US"),
        ("2001:db8::/32", "NL"),
        ("2a00:1450::/29", "IE"),
        ("2c0f:f000::/20", "ZA"),
        ("::1:0:0:1/128", "JP"),
    ];

    #[test]
    fn geoip_writer_reads_back_with_maxminddb() {
        for record_size in [24, 28, 32] {
            let opts = w::Options {
                record_size,
                ..Default::default()
            };
            let entries: Vec<(&str, w::Value)> = DISJOINT
                .iter()
                .map(|(n, c)| (*n, w::country_record(c)))
                .collect();
            let reader = Reader::from_source(w::build_db(&opts, &entries).unwrap()).unwrap();
            reader.verify().unwrap();
            let m = reader.metadata();
            assert_eq!(
                (m.record_size, m.ip_version, m.binary_format_major_version),
                (record_size, 6, 2)
            );
            assert_eq!(m.database_type, "GeoLite2-Country");
            assert_eq!(m.build_epoch, 1_700_000_000);
            assert_eq!(m.languages, ["en"]);

            let some = |c: &str, n: &str| Some((c.to_owned(), n.to_owned()));
            assert_eq!(lookup(&reader, "1.0.0.77"), some("AU", "1.0.0.0/24"));
            assert_eq!(lookup(&reader, "1.0.1.0"), None);
            assert_eq!(lookup(&reader, "0.255.255.255"), None);
            assert_eq!(lookup(&reader, "2.23.255.255"), some("FR", "2.16.0.0/13"));
            assert_eq!(lookup(&reader, "2.24.0.0"), None);
            assert_eq!(lookup(&reader, "5.1.2.3"), some("DE", "5.1.2.3/32"));
            assert_eq!(lookup(&reader, "5.1.2.4"), None);
            assert_eq!(lookup(&reader, "200.1.2.3"), some("US", "128.0.0.0/1"));
            assert_eq!(lookup(&reader, "127.255.255.255"), None);
            assert_eq!(
                lookup(&reader, "2001:db8:ffff::1"),
                some("NL", "2001:db8::/32")
            );
            assert_eq!(lookup(&reader, "2001:db9::1"), None);
            assert_eq!(
                lookup(&reader, "2a00:1457:1::"),
                some("IE", "2a00:1450::/29")
            );
            assert_eq!(lookup(&reader, "2a00:1458::"), None);
            assert_eq!(
                lookup(&reader, "2c0f:f0ff::1"),
                some("ZA", "2c0f:f000::/20")
            );
            assert_eq!(lookup(&reader, "::1:0:0:1"), some("JP", "::1:0:0:1/128"));
            assert_eq!(lookup(&reader, "::1:0:0:2"), None);
            // IPv4 through the aliases: IPv4-mapped and 6to4 reach the IPv4 subtree.
            assert_eq!(lookup(&reader, "::ffff:1.0.0.9").unwrap().0, "AU");
            assert_eq!(lookup(&reader, "2002:0501:0203::1").unwrap().0, "DE");
            assert_eq!(lookup(&reader, "2001:0:0501:0203::").unwrap().0, "DE");
            assert_eq!(lookup(&reader, "::ffff:1.0.1.0"), None);
        }
    }

    #[test]
    fn geoip_load_returns_exactly_the_written_entries() {
        let path = tmp("disjoint.mmdb");
        w::write_country_db(&path, DISJOINT).unwrap();
        let t = load(&path).unwrap();
        assert_eq!(table_set(&t), set(DISJOINT));
        assert_eq!(
            t.entries.len(),
            DISJOINT.len(),
            "no duplicates from aliases"
        );
        assert!(t.entries.is_sorted());
        assert_eq!(t.database_type, "GeoLite2-Country");
        assert_eq!(t.build_epoch, 1_700_000_000);

        // Without aliases, and as an IPv4-only database.
        for (ip_version, aliases) in [(6, vec![]), (4, vec![])] {
            let opts = w::Options {
                ip_version,
                ipv4_aliases: aliases,
                ..Default::default()
            };
            let entries: Vec<(&str, w::Value)> = DISJOINT
                .iter()
                .filter(|(n, _)| ip_version == 6 || !n.contains(':'))
                .map(|(n, c)| (*n, w::country_record(c)))
                .collect();
            w::write_db(&path, &opts, &entries).unwrap();
            let want: BTreeSet<_> = set(DISJOINT)
                .into_iter()
                .filter(|(n, _)| ip_version == 6 || matches!(n, IpNet::V4(_)))
                .collect();
            assert_eq!(table_set(&load(&path).unwrap()), want);
        }
    }

    #[test]
    fn geoip_nested_networks_most_specific_wins() {
        // Given out of order: the /8 after the /24 inside it.
        let entries = [
            ("10.1.2.0/24", "DE"),
            ("10.0.0.0/8", "US"),
            ("2001:db8:1::/48", "FR"),
            ("2001:db8::/32", "NL"),
            ("2001:db8:1:2::/64", "BE"),
        ];
        let path = tmp("nested.mmdb");
        w::write_country_db(&path, &entries).unwrap();
        let reader = Reader::open_readfile(&path).unwrap();
        reader.verify().unwrap();
        for (addr, want) in [
            ("10.1.2.3", "DE"),
            ("10.1.3.0", "US"),
            ("10.255.255.255", "US"),
            ("10.0.0.0", "US"),
            ("2001:db8:1::1", "FR"),
            ("2001:db8:1:2::1", "BE"),
            ("2001:db8:1:3::1", "FR"),
            ("2001:db8:2::1", "NL"),
        ] {
            assert_eq!(lookup(&reader, addr).unwrap().0, want, "{addr}");
        }
        assert_eq!(lookup(&reader, "11.0.0.0"), None);

        let t = load(&path).unwrap();
        // The tree stores disjoint networks: the /8 comes back split around the /24.
        let pieces = |outer: &str, inner: &str, code: &str| -> BTreeSet<(IpNet, [u8; 2])> {
            let (outer, inner) = (net(outer), net(inner));
            let mut out = BTreeSet::new();
            for len in outer.prefix_len() + 1..=inner.prefix_len() {
                // The sibling of the inner network's ancestor at `len`.
                let anc = IpNet::new(inner.addr(), len).unwrap().trunc();
                let parent = anc.supernet().unwrap();
                let sib = parent.subnets(len).unwrap().find(|s| *s != anc).unwrap();
                out.insert((sib, code.as_bytes().try_into().unwrap()));
            }
            out
        };
        let mut want = pieces("10.0.0.0/8", "10.1.2.0/24", "US");
        want.extend(set(&[("10.1.2.0/24", "DE"), ("2001:db8:1:2::/64", "BE")]));
        want.extend(pieces("2001:db8::/32", "2001:db8:1::/48", "NL"));
        want.extend(pieces("2001:db8:1::/48", "2001:db8:1:2::/64", "FR"));
        assert_eq!(table_set(&t), want);
        assert_eq!(want.len(), 16 + 1 + 16 + 16 + 1);
        // And the flattened table answers every address as the database does.
        for addr in [
            "10.1.2.3",
            "10.1.3.0",
            "10.128.0.1",
            "11.0.0.0",
            "2001:db8:1:2::9",
            "2001:db8:1:ffff::",
            "2001:db8:ffff::",
            "2001:db9::",
        ] {
            assert_eq!(
                trie_lookup(&t, addr).map(|c| String::from_utf8(c.to_vec()).unwrap()),
                lookup(&reader, addr).map(|(c, _)| c),
                "{addr}"
            );
        }
    }

    #[test]
    fn geoip_country_fallbacks_and_unknown() {
        let iso = |c: &str| w::Value::map([("iso_code", w::Value::str(c))]);
        let entries = [
            ("1.0.0.0/24", w::country_record("de")),
            (
                "1.0.1.0/24",
                w::Value::map([
                    ("continent", w::Value::map([("code", w::Value::str("EU"))])),
                    ("registered_country", iso("FR")),
                ]),
            ),
            (
                "1.0.2.0/24",
                w::Value::map([
                    ("represented_country", iso("US")),
                    (
                        "traits",
                        w::Value::map([("is_anycast", w::Value::Bool(true))]),
                    ),
                ]),
            ),
            (
                "1.0.3.0/24",
                w::Value::map([("country", iso("IT")), ("registered_country", iso("FR"))]),
            ),
            // No code at all: unknown, left out of the table.
            (
                "1.0.4.0/24",
                w::Value::map([("continent", w::Value::map([("code", w::Value::str("AS"))]))]),
            ),
            (
                "2001:db8::/32",
                w::Value::map([
                    (
                        "country",
                        w::Value::map([
                            ("geoname_id", w::Value::U32(2_921_044)),
                            ("is_in_european_union", w::Value::Bool(true)),
                            ("iso_code", w::Value::str("DE")),
                            ("names", w::Value::map([("en", w::Value::str("Germany"))])),
                        ]),
                    ),
                    ("registered_country", iso("AT")),
                ]),
            ),
        ];
        let path = tmp("fallbacks.mmdb");
        w::write_db(&path, &w::Options::default(), &entries).unwrap();
        let t = load(&path).unwrap();
        assert_eq!(
            table_set(&t),
            set(&[
                ("1.0.0.0/24", "DE"),
                ("1.0.1.0/24", "FR"),
                ("1.0.2.0/24", "US"),
                ("1.0.3.0/24", "IT"),
                ("2001:db8::/32", "DE"),
            ])
        );
    }

    #[test]
    fn geoip_load_errors_are_clear() {
        let err = |path: &Path| format!("{:#}", load(path).unwrap_err());

        let missing = tmp("does-not-exist.mmdb");
        let e = err(&missing);
        assert!(e.contains("cannot read the GeoIP database"), "{e}");
        assert!(e.contains("does-not-exist.mmdb"), "{e}");

        let junk = tmp("junk.mmdb");
        std::fs::write(&junk, b"not a database at all").unwrap();
        let e = err(&junk);
        assert!(e.contains("is not a MaxMind DB"), "{e}");

        // An ASN-style database: valid, but no country anywhere.
        let asn = tmp("asn.mmdb");
        let opts = w::Options {
            database_type: "GeoLite2-ASN".into(),
            ..Default::default()
        };
        let rec = |n: u32| w::Value::map([("autonomous_system_number", w::Value::U32(n))]);
        w::write_db(
            &asn,
            &opts,
            &[("1.0.0.0/24", rec(13335)), ("2001:db8::/32", rec(1))],
        )
        .unwrap();
        let e = err(&asn);
        assert!(e.contains("wrong record layout"), "{e}");
        assert!(e.contains("GeoLite2-ASN"), "{e}");

        // Records that are not maps.
        let strings = tmp("strings.mmdb");
        w::write_db(
            &strings,
            &w::Options::default(),
            &[("1.0.0.0/24", w::Value::str("DE"))],
        )
        .unwrap();
        let e = err(&strings);
        assert!(e.contains("wrong record layout for 1.0.0.0/24"), "{e}");

        // A code that is not two letters.
        let bad = tmp("bad-code.mmdb");
        w::write_country_db(&bad, &[("1.0.0.0/24", "DEU")]).unwrap();
        let e = err(&bad);
        assert!(e.contains("\"DEU\" is not an ISO 3166-1 alpha-2"), "{e}");

        // An empty database is valid and empty.
        let empty = tmp("empty.mmdb");
        w::write_country_db(&empty, &[]).unwrap();
        assert!(load(&empty).unwrap().entries.is_empty());
    }

    #[test]
    fn geoip_capacity_is_an_error() {
        check_capacity(MAX_REGION_PREFIXES as usize).unwrap();
        let e = check_capacity(MAX_REGION_PREFIXES as usize + 1).unwrap_err();
        assert!(e.to_string().contains("do not fit the regions map"), "{e}");
    }

    #[test]
    fn geoip_writer_node_layout() {
        assert_eq!(
            w::encode_node(24, 0x12_3456, 0xab_cdef),
            [0x12, 0x34, 0x56, 0xab, 0xcd, 0xef]
        );
        assert_eq!(
            w::encode_node(28, 0x0a12_3456, 0x0bab_cdef),
            [0x12, 0x34, 0x56, 0xab, 0xab, 0xcd, 0xef]
        );
        assert_eq!(
            w::encode_node(32, 0x0102_0304, 0xa0b0_c0d0),
            [1, 2, 3, 4, 0xa0, 0xb0, 0xc0, 0xd0]
        );
    }

    #[test]
    fn geoip_writer_rejects_bad_input() {
        assert!(w::parse_cidr("10.0.0.1/8").is_err(), "host bits");
        assert!(w::parse_cidr("10.0.0.0/33").is_err());
        assert!(w::parse_cidr("2001:db8::/129").is_err());
        assert_eq!(
            w::parse_cidr("10.0.0.1").unwrap(),
            ("10.0.0.1".parse().unwrap(), 32)
        );
        let v4 = w::Options {
            ip_version: 4,
            ..Default::default()
        };
        assert!(w::build_db(&v4, &[("2001:db8::/32", w::country_record("DE"))]).is_err());
        // Inside ::/96, which is IPv4 space in an IPv6 database.
        assert!(
            w::build_db(
                &w::Options::default(),
                &[("::1/128", w::country_record("DE"))]
            )
            .is_err()
        );
        // Inside an IPv4 alias.
        assert!(
            w::build_db(
                &w::Options::default(),
                &[("2002:102::/32", w::country_record("DE"))]
            )
            .is_err()
        );
    }

    #[test]
    fn geoip_ipv6_around_aliases_is_split_not_lost() {
        // A network that contains an alias range (2002::/16) keeps the rest of its space.
        let path = tmp("around-alias.mmdb");
        w::write_country_db(&path, &[("2000::/14", "US"), ("9.9.9.0/24", "CH")]).unwrap();
        let reader = Reader::open_readfile(&path).unwrap();
        reader.verify().unwrap();
        assert_eq!(lookup(&reader, "2003::1").unwrap().0, "US");
        assert_eq!(lookup(&reader, "2002:0909:0909::").unwrap().0, "CH");
        let t = load(&path).unwrap();
        assert_eq!(trie_lookup(&t, "2003::1"), Some(*b"US"));
        assert_eq!(trie_lookup(&t, "9.9.9.9"), Some(*b"CH"));
        // 2002::/16 is an alias: not listed, and neither is any IPv4-mapped network.
        assert_eq!(trie_lookup(&t, "2002:0909:0909::"), None);
        assert!(
            t.entries
                .iter()
                .all(|(n, _)| !is_ipv4_space(n) || n.addr().is_ipv4())
        );
        assert!(!t.entries.iter().any(|(n, _)| n.contains(&net("2002::/16"))));
        assert_eq!(
            t.entries.iter().filter(|(n, _)| n.addr().is_ipv4()).count(),
            1
        );
    }
}
