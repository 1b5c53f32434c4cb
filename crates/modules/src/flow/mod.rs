//! Kinds that keep per-flow state: the flow table (`classify`), address translation and the firewall.

pub mod classify;
pub mod firewall;
pub mod nat;
