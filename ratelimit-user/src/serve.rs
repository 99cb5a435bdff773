//! Serving the operator and other systems: the control socket ([`control`]), the reports off
//! the owner task ([`reader`]), and the HTTP listener ([`http`], its connection slots
//! [`http_slots`]).

pub mod control;
pub mod http;
pub mod http_slots;
pub mod reader;
