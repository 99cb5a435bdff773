//! The sources trie (`RL_SOURCES`): allow list, deny list and the rules' source and `except`
//! lists in one; the destinations trie (`RL_DESTS`): the rules' `dst` lists.

/// Value of the sources trie (`RL_SOURCES`), which holds the allow list, the deny list and the
/// rules' `src` lists in one LPM trie, so one lookup answers all three. At every prefix the
/// daemon stores the union over all listed prefixes covering it (itself included), so the
/// longest match alone says whether any allow / deny entry covers the address and which rules'
/// source lists contain it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ListValue {
    pub rule_src_mask: u32,
    /// Rules whose `except` list contains the prefix: they never match it.
    pub rule_except_mask: u32,
    /// `LIST_ALLOW` | `LIST_DENY`.
    pub flags: u32,
}

/// `ListValue::flags`: an allow-list entry covers the prefix.
pub const LIST_ALLOW: u32 = 1 << 0;
/// `ListValue::flags`: a deny-list entry covers the prefix.
pub const LIST_DENY: u32 = 1 << 1;
