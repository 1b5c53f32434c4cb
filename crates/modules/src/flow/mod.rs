//! Kinds that keep per-flow state: the flow table (`classify`), address translation and the firewall, and the
//! flow table's building blocks they share (`table`).

pub mod classify;
pub mod firewall;
pub mod nat;
pub(crate) mod table;
#[cfg(test)]
pub(crate) mod testutil;
