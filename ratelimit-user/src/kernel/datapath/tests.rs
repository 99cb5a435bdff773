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
