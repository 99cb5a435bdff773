//! The TOML document as a tree that keeps the position of every key and value, and typed
//! accessors over it that record errors instead of stopping at the first one.
//!
//! Deserializing into this tree (rather than into `#[serde(deny_unknown_fields)]` structs) only
//! fails on TOML syntax; unknown keys, wrong types and bad values are all found and reported
//! in one pass by the validator.

use std::fmt;
use std::ops::Range;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

use super::ConfigError;

/// A TOML value with its position, when the parser knows it (the implicit tables of dotted
/// keys have none).
#[derive(Debug, Clone)]
pub(super) struct Item {
    pub(super) node: Node,
    span: Option<Range<usize>>,
}

impl Item {
    fn bare(node: Node) -> Self {
        Item { node, span: None }
    }

    /// Where the value starts, or `fallback` when unknown.
    fn at_or(&self, fallback: usize) -> usize {
        self.span.as_ref().map_or(fallback, |s| s.start)
    }
}

/// A TOML value; nested values carry positions.
#[derive(Debug, Clone)]
pub(super) enum Node {
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    Datetime,
    Array(Vec<Item>),
    Table(Vec<(Key, Item)>),
}

impl Node {
    /// "a string", "an integer", ... for type errors.
    fn kind(&self) -> &'static str {
        match self {
            Node::Str(_) => "a string",
            Node::Int(_) => "an integer",
            Node::Float(_) => "a float",
            Node::Bool(_) => "a boolean",
            Node::Datetime => "a date-time",
            Node::Array(_) => "an array",
            Node::Table(_) => "a table",
        }
    }
}

/// A table key and, when the parser knows it, its position.
#[derive(Debug, Clone)]
pub(super) struct Key {
    name: String,
    span: Option<Range<usize>>,
}

// The private protocol through which `toml` 0.8 hands positions to `serde_spanned::Spanned`:
// asked for a struct with these names, it visits a map of start, end and value when it knows
// the position, and the bare value when it does not. `Spanned<T>` itself fails in the second
// case (dotted keys), so keys and values here speak the protocol directly. The tests catch a
// change of protocol.
const SPANNED_NAME: &str = "$__serde_spanned_private_Spanned";
const SPANNED_FIELDS: &[&str] = &[
    "$__serde_spanned_private_start",
    "$__serde_spanned_private_end",
    "$__serde_spanned_private_value",
];
/// The key under which `toml` presents a date-time as a one-entry map.
const DATETIME_FIELD: &str = "$__toml_private_datetime";

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a table key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(Key {
                    name: v.to_owned(),
                    span: None,
                })
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Key, A::Error> {
                let (mut start, mut end, mut name) = (None, None, None);
                while let Some(field) = map.next_key::<String>()? {
                    match field.as_str() {
                        f if f == SPANNED_FIELDS[0] => start = Some(map.next_value::<usize>()?),
                        f if f == SPANNED_FIELDS[1] => end = Some(map.next_value::<usize>()?),
                        _ => name = Some(map.next_value::<String>()?),
                    }
                }
                let name = name.ok_or_else(|| de::Error::missing_field("key"))?;
                let span = start.zip(end).map(|(s, e)| s..e);
                Ok(Key { name, span })
            }
        }
        d.deserialize_struct(SPANNED_NAME, SPANNED_FIELDS, KeyVisitor)
    }
}

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_struct(SPANNED_NAME, SPANNED_FIELDS, ItemVisitor)
    }
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ItemVisitor).map(|item| item.node)
    }
}

/// Visits a value with its position (a map of the spanned fields), or a bare value.
struct ItemVisitor;

impl<'de> Visitor<'de> for ItemVisitor {
    type Value = Item;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any TOML value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Item, E> {
        Ok(Item::bare(Node::Bool(v)))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Item, E> {
        Ok(Item::bare(Node::Int(v)))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Item, E> {
        i64::try_from(v)
            .map(|v| Item::bare(Node::Int(v)))
            .map_err(|_| E::custom("integer out of range"))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Item, E> {
        Ok(Item::bare(Node::Float(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Item, E> {
        Ok(Item::bare(Node::Str(v.to_owned())))
    }
    fn visit_string<E>(self, v: String) -> Result<Item, E> {
        Ok(Item::bare(Node::Str(v)))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Item::bare(Node::Array(items)))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Item, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<Key>()? {
            if entries.is_empty() && key.name == SPANNED_FIELDS[0] {
                return spanned(map);
            }
            if entries.is_empty() && key.name == DATETIME_FIELD {
                map.next_value::<String>()?;
                return Ok(Item::bare(Node::Datetime));
            }
            entries.push((key, map.next_value()?));
        }
        Ok(Item::bare(Node::Table(entries)))
    }
}

/// The rest of a spanned map, after its start field's key.
fn spanned<'de, A: MapAccess<'de>>(mut map: A) -> Result<Item, A::Error> {
    let start: usize = map.next_value()?;
    let (mut end, mut node) = (start, None);
    while let Some(field) = map.next_key::<String>()? {
        if field == SPANNED_FIELDS[1] {
            end = map.next_value()?;
        } else {
            node = Some(map.next_value::<Node>()?);
        }
    }
    let node = node.ok_or_else(|| de::Error::missing_field(SPANNED_FIELDS[2]))?;
    Ok(Item {
        node,
        span: Some(start..end),
    })
}

/// Parses TOML text into the tree, or returns the parser's error message and position.
pub(super) fn parse_toml(text: &str) -> Result<Item, (usize, String)> {
    toml::from_str::<Item>(text).map_err(|e| {
        let at = e.span().map_or(0, |s| s.start);
        let msg = e.message().trim().lines().collect::<Vec<_>>().join(", ");
        (at, msg)
    })
}

/// Collects errors by byte offset and turns them into [`ConfigError`]s.
pub(super) struct Checker<'t> {
    text: &'t str,
    errors: Vec<(usize, String)>,
}

impl<'t> Checker<'t> {
    pub(super) fn new(text: &'t str) -> Self {
        Checker {
            text,
            errors: Vec::new(),
        }
    }

    pub(super) fn error(&mut self, at: usize, message: impl Into<String>) {
        self.errors.push((at, message.into()));
    }

    /// 1-based line and character column of a byte offset.
    pub(super) fn line_col(&self, at: usize) -> (usize, usize) {
        let mut at = at.min(self.text.len());
        while !self.text.is_char_boundary(at) {
            at -= 1;
        }
        let before = &self.text[..at];
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        let line = before.bytes().filter(|&b| b == b'\n').count() + 1;
        (line, before[line_start..].chars().count() + 1)
    }

    pub(super) fn line(&self, at: usize) -> usize {
        self.line_col(at).0
    }

    /// Errors sorted by position (stable: same position keeps discovery order).
    pub(super) fn into_errors(mut self, file: &str) -> Vec<ConfigError> {
        self.errors.sort_by_key(|(at, _)| *at);
        self.errors
            .iter()
            .map(|(at, message)| {
                let (line, col) = self.line_col(*at);
                ConfigError {
                    file: file.to_owned(),
                    line,
                    col,
                    message: message.clone(),
                }
            })
            .collect()
    }
}

/// A table being read. Keys are looked up by name; [`Table::finish`] reports every key that
/// was never asked for.
pub(super) struct Table<'a> {
    /// Message prefix, e.g. `rule "x": `.
    pub(super) pre: String,
    /// Dotted path of this table relative to `pre`, e.g. `threshold`; empty for a rule itself.
    path: String,
    at: usize,
    entries: &'a [(Key, Item)],
    asked: Vec<&'static str>,
}

impl<'a> Table<'a> {
    pub(super) fn root(item: &'a Item) -> Option<Self> {
        match &item.node {
            Node::Table(entries) => Some(Table {
                pre: String::new(),
                path: String::new(),
                at: item.at_or(0),
                entries,
                asked: Vec::new(),
            }),
            _ => None,
        }
    }

    /// Where the table starts (its header, or the `{` of an inline table).
    pub(super) fn at(&self) -> usize {
        self.at
    }

    fn full(&self, key: &str) -> String {
        if self.path.is_empty() {
            key.to_owned()
        } else {
            format!("{}.{key}", self.path)
        }
    }

    pub(super) fn get(&mut self, key: &'static str) -> Option<Field<'a>> {
        self.asked.push(key);
        let (k, v) = self.entries.iter().find(|(k, _)| k.name == key)?;
        let key_at = k.span.as_ref().map_or(v.at_or(self.at), |s| s.start);
        Some(Field {
            pre: self.pre.clone(),
            name: self.full(key),
            element: false,
            key_at,
            at: v.at_or(key_at),
            node: &v.node,
        })
    }

    /// Reports `key` as missing, at the start of the table.
    pub(super) fn missing(&self, ck: &mut Checker, key: &str, why: &str) {
        ck.error(
            self.at,
            format!("{}{} is required{why}", self.pre, self.full(key)),
        );
    }

    /// An error about the table as a whole, at its start: `{pre}{path} {msg}`.
    pub(super) fn error(&self, ck: &mut Checker, msg: impl fmt::Display) {
        let sep = if self.path.is_empty() { "" } else { " " };
        ck.error(self.at, format!("{}{}{sep}{msg}", self.pre, self.path));
    }

    /// Reports the keys nobody asked for.
    pub(super) fn finish(self, ck: &mut Checker) {
        for (k, v) in self.entries {
            if self.asked.contains(&k.name.as_str()) {
                continue;
            }
            let at = k.span.as_ref().map_or(v.at_or(self.at), |s| s.start);
            let place = if self.path.is_empty() {
                String::new()
            } else {
                format!("{}: ", self.path)
            };
            let hint = match closest(&k.name, &self.asked) {
                Some(known) => format!("; did you mean {known:?}?"),
                None => format!("; expected one of {}", self.asked.join(", ")),
            };
            ck.error(
                at,
                format!("{}{place}unknown key {:?}{hint}", self.pre, k.name),
            );
        }
    }
}

/// The known key closest to a misspelt one, if any is close.
fn closest<'k>(unknown: &str, known: &[&'k str]) -> Option<&'k str> {
    let unknown = unknown.to_ascii_lowercase();
    known
        .iter()
        .map(|k| (edit_distance(&unknown, k), *k))
        .filter(|(d, k)| *d <= 2.min(k.len() / 3).max(1))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// A value found under a key (or an element of an array value).
pub(super) struct Field<'a> {
    pre: String,
    /// Full field name for messages, e.g. `threshold.interval`.
    pub(super) name: String,
    /// An array element: type errors say "entries of X".
    element: bool,
    key_at: usize,
    at: usize,
    node: &'a Node,
}

impl<'a> Field<'a> {
    /// Where the value starts.
    pub(super) fn at(&self) -> usize {
        self.at
    }

    /// Where the key starts (the value's position for array elements and dotted keys).
    pub(super) fn key_at(&self) -> usize {
        self.key_at
    }

    /// `{pre}{name} {msg}` at the value.
    pub(super) fn error(&self, ck: &mut Checker, msg: impl fmt::Display) {
        ck.error(self.at(), format!("{}{} {msg}", self.pre, self.name));
    }

    /// `{pre}{name}: {msg}` at the value.
    pub(super) fn invalid(&self, ck: &mut Checker, msg: impl fmt::Display) {
        ck.error(self.at(), format!("{}{}: {msg}", self.pre, self.name));
    }

    /// A value parser's error at the value, worded as on the command line
    /// ([`super::labelled`]).
    pub(super) fn rejected(&self, ck: &mut Checker, msg: &str) {
        let text = format!("{}{}", self.pre, super::labelled(&self.name, msg));
        ck.error(self.at(), text);
    }

    /// `{pre}{name} {msg}` at the key.
    pub(super) fn error_at_key(&self, ck: &mut Checker, msg: impl fmt::Display) {
        ck.error(self.key_at, format!("{}{} {msg}", self.pre, self.name));
    }

    fn wrong_type(&self, ck: &mut Checker, expected: &str) {
        let what = if self.element {
            format!("{}{}: each entry", self.pre, self.name)
        } else {
            format!("{}{}", self.pre, self.name)
        };
        let found = self.node.kind();
        ck.error(self.at(), format!("{what} must be {expected}, not {found}"));
    }

    /// The node itself, for values of more than one type.
    pub(super) fn node(&self) -> &'a Node {
        self.node
    }

    pub(super) fn str(&self, ck: &mut Checker) -> Option<&'a str> {
        match self.node {
            Node::Str(s) => Some(s),
            _ => {
                self.wrong_type(ck, "a string");
                None
            }
        }
    }

    pub(super) fn int(&self, ck: &mut Checker) -> Option<i64> {
        match self.node {
            Node::Int(n) => Some(*n),
            _ => {
                self.wrong_type(ck, "an integer");
                None
            }
        }
    }

    pub(super) fn bool(&self, ck: &mut Checker) -> Option<bool> {
        match self.node {
            Node::Bool(b) => Some(*b),
            _ => {
                self.wrong_type(ck, "true or false");
                None
            }
        }
    }

    /// A float, or an integer taken as one.
    pub(super) fn number(&self, ck: &mut Checker) -> Option<f64> {
        match self.node {
            Node::Float(f) => Some(*f),
            Node::Int(n) => Some(*n as f64),
            _ => {
                self.wrong_type(ck, "a number");
                None
            }
        }
    }

    /// A string, for errors that say which types are accepted.
    pub(super) fn expected(&self, ck: &mut Checker, what: &str) {
        self.wrong_type(ck, what);
    }

    /// The elements of an array; their fields carry this field's name.
    pub(super) fn array(&self, ck: &mut Checker) -> Option<Vec<Field<'a>>> {
        match self.node {
            Node::Array(items) => Some(
                items
                    .iter()
                    .map(|item| Field {
                        pre: self.pre.clone(),
                        name: self.name.clone(),
                        element: true,
                        key_at: item.at_or(self.at),
                        at: item.at_or(self.at),
                        node: &item.node,
                    })
                    .collect(),
            ),
            _ => {
                self.wrong_type(ck, "an array");
                None
            }
        }
    }

    pub(super) fn table(&self, ck: &mut Checker) -> Option<Table<'a>> {
        match self.node {
            Node::Table(entries) => Some(Table {
                pre: self.pre.clone(),
                path: self.name.clone(),
                at: self.at(),
                entries,
                asked: Vec::new(),
            }),
            _ => {
                self.wrong_type(ck, "a table");
                None
            }
        }
    }

    /// An array of tables (`[[header]]`). Each table gets an empty path: the caller sets its
    /// message prefix.
    pub(super) fn tables(&self, ck: &mut Checker, header: &str) -> Option<Vec<Table<'a>>> {
        let items = match self.node {
            Node::Array(items) => items,
            other => {
                ck.error(
                    self.at(),
                    format!(
                        "{}{} must be an array of tables (write [[{header}]]), not {}",
                        self.pre,
                        self.name,
                        other.kind()
                    ),
                );
                return None;
            }
        };
        let mut tables = Vec::new();
        for item in items {
            let at = item.at_or(self.at);
            match &item.node {
                Node::Table(entries) => tables.push(Table {
                    pre: self.pre.clone(),
                    path: String::new(),
                    at,
                    entries,
                    asked: Vec::new(),
                }),
                other => ck.error(
                    at,
                    format!(
                        "{}{} entries must be tables (write [[{header}]]), not {}",
                        self.pre,
                        self.name,
                        other.kind()
                    ),
                ),
            }
        }
        Some(tables)
    }
}
