use super::Entry;

#[test]
fn detach_refuses_a_directory_off_bpffs_and_removes_nothing() {
    let dir = std::env::temp_dir().join(format!("ratelimit-detach-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("RL_STATS"), "not a pin").unwrap();
    let e = super::detach(&dir, &[]).unwrap_err().to_string();
    assert!(
        e.contains("not a bpffs") && e.contains("nothing was removed"),
        "{e}"
    );
    assert!(dir.join("RL_STATS").exists());
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        super::detach(&dir, &[]).unwrap(),
        Vec::<String>::new(),
        "absent: nothing to do"
    );
}

/// The object the daemon embeds is the program and nothing else: its only programs are
/// the two entry points, and no symbol of the benchmark's object (per-run source
/// variation, reference and floor programs, the flood generator, their maps) is in it.
#[test]
fn the_embedded_object_holds_the_two_entry_points_and_nothing_of_the_benchmark() {
    use object::{Object as _, ObjectSection as _, ObjectSymbol as _, SymbolKind};
    let file = object::File::parse(super::PROGRAM).expect("the embedded object is ELF");
    let mut programs = std::collections::BTreeSet::new();
    let mut foreign = Vec::new();
    for sym in file.symbols() {
        let name = sym.name().expect("a symbol name in UTF-8");
        let lower = name.to_ascii_lowercase();
        if lower.contains("bench")
            || lower.contains("vary")
            || name.starts_with("ref_")
            || name.starts_with("gen_")
        {
            foreign.push(name.to_string());
        }
        // A program is a function in a section of its own (`xdp`); global functions are
        // in `.text`.
        let section = sym
            .section_index()
            .and_then(|i| file.section_by_index(i).ok())
            .and_then(|s| s.name().ok().map(str::to_string));
        if sym.kind() == SymbolKind::Text
            && sym.is_global()
            && section.as_deref().is_some_and(|s| s != ".text")
        {
            programs.insert(name.to_string());
        }
    }
    let want: std::collections::BTreeSet<String> = [super::PROGRAM_NAME, super::PROGRAM_NAME_L3]
        .map(String::from)
        .into();
    assert!(
        programs == want && foreign.is_empty(),
        "programs {programs:?} (want exactly {want:?}); benchmark symbols {foreign:?} (want none)"
    );
}

#[test]
fn each_link_type_gets_the_entry_that_parses_it_or_a_refusal_naming_it() {
    assert_eq!(Entry::for_link_type(1), Some(Entry::Ethernet));
    assert_eq!(Entry::for_link_type(772), Some(Entry::Ethernet));
    for l3 in [512, 519, 768, 769, 776, 778, 823, 65534] {
        assert_eq!(Entry::for_link_type(l3), Some(Entry::L3), "type {l3}");
    }
    // InfiniBand (32), CAN (280), 802.15.4 (804): neither Ethernet nor bare IP.
    for other in [32, 280, 804] {
        let e = Entry::for_link("ib0", other).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("ib0 has link type {other} ")) && e.contains("remove ib0"),
            "{e}"
        );
    }
}

/// The program's maps are exactly [`super::MAP_NAMES`]: a map added to (or renamed in) the
/// program without the daemon's list, or the other way round, fails here.
#[test]
fn the_program_s_maps_are_the_daemon_s_list_of_them() {
    use object::{Object as _, ObjectSection as _, ObjectSymbol as _};
    let file = object::File::parse(super::PROGRAM).expect("the embedded object is ELF");
    // aya-ebpf's `#[map]` puts the maps in a section named `maps` (BTF maps are in `.maps`).
    let maps_section = file
        .section_by_name("maps")
        .or_else(|| file.section_by_name(".maps"))
        .expect("the object has a maps section")
        .index();
    let in_object: std::collections::BTreeSet<&str> = file
        .symbols()
        .filter(|s| s.section_index() == Some(maps_section))
        .filter_map(|s| s.name().ok())
        .filter(|n| n.starts_with("RL_"))
        .collect();
    let listed: std::collections::BTreeSet<&str> = super::MAP_NAMES.iter().copied().collect();
    assert_eq!(listed.len(), super::MAP_NAMES.len(), "a name listed twice");
    assert_eq!(
        in_object, listed,
        "the object's maps (left) and the daemon's MAP_NAMES (right) differ"
    );
}

/// Every map name the daemon's code spells (`"RL_..."`) is one of [`super::MAP_NAMES`].
#[test]
fn every_map_name_the_daemon_spells_is_listed() {
    fn walk(dir: &std::path::Path, out: &mut Vec<(String, String)>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).unwrap();
                for (i, _) in text.match_indices("\"RL_") {
                    let name: String = text[i + 1..]
                        .chars()
                        .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                        .collect();
                    if name.len() > 3 && text[i + 1 + name.len()..].starts_with('"') {
                        out.push((p.display().to_string(), name));
                    }
                }
            }
        }
    }
    let mut spelled = Vec::new();
    walk(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut spelled,
    );
    assert!(spelled.len() > 20, "too few names found: {spelled:?}");
    let unknown: Vec<_> = spelled
        .iter()
        .filter(|(_, n)| !super::MAP_NAMES.contains(&n.as_str()))
        .collect();
    assert!(
        unknown.is_empty(),
        "map names not in MAP_NAMES: {unknown:?}"
    );
}
