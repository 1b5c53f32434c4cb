//! The network layer: IP validation and forwarding hygiene, fragment reassembly, ICMP errors, and the Ethernet
//! adaptation (ARP, NDP) behind a link face.

pub mod icmp;
#[allow(clippy::module_inception)] // the family and its `ip` kind share the protocol's name
pub mod ip;
pub mod link;
pub mod reassemble;

#[cfg(test)]
mod gso_tests;
