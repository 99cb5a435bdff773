//! The policy over the maps: a config turned into map contents ([`apply`], with a rule's match
//! in [`matching`] and the tries' prefixes in [`prefixes`]), live changes
//! ([`live`], [`ruleset`]), bans on disk and their notes ([`bans`], [`ban_notes`]), the GeoIP
//! regions ([`geoip`]), the pressure level ([`pressure`]), and the data plane read back
//! ([`report`]).

pub mod apply;
pub mod ban_notes;
pub mod bans;
pub mod geoip;
pub mod live;
pub mod matching;
pub mod prefixes;
pub mod pressure;
pub mod report;
pub mod ruleset;

#[cfg(test)]
mod proptests;
