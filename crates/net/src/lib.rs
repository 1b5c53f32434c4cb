//! flexstack-net: sans-IO network modules for flexstack's data path.
//!
//! Shared pieces: [`packet`] parses an IP packet's headers once into a [`packet::PacketInfo`] (the drop reasons
//! are its [`packet::ParseError`]s); [`checksum`] computes and incrementally updates Internet checksums.
//! Module kinds are added to a catalog with [`register`].
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod binding;
pub mod checksum;
pub mod cidr;
pub mod classify;
pub mod firewall;
pub mod icmp;
pub mod ip;
pub mod link;
pub mod nat;
pub mod packet;
pub mod reassemble;

use flexstack_core::Catalog;

/// Adds this crate's module kinds to `catalog`.
pub fn register(catalog: &mut Catalog) {
    catalog.register(Box::new(reassemble::ReassembleKind));
    catalog.register(Box::new(ip::IpKind));
    catalog.register(Box::new(icmp::IcmpKind));
    catalog.register(Box::new(classify::ClassifyKind));
    catalog.register(Box::new(firewall::FirewallKind));
    catalog.register(Box::new(nat::NatKind));
    catalog.register(Box::new(link::LinkKind));
    catalog.register(Box::new(binding::LateBindingKind));
    catalog.register(Box::new(binding::EarlyBindingKind));
    let _ = catalog;
}
