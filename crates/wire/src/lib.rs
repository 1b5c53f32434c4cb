//! flexstack-wire: the packet formats every module shares.
//!
//! - [`packet`] parses an IP packet's headers once into a [`packet::PacketInfo`] (the drop reasons are its
//!   [`packet::ParseError`]s); [`packet::build`] makes well-formed test packets.
//! - [`checksum`] computes, incrementally updates and completes Internet checksums.
//! - [`rewrite`] rewrites a packet's addresses and ports in place, its checksums updated incrementally.
//! - [`cidr`] holds address prefixes, port ranges and endpoints as written in settings.
//! - [`vnet`] reads and writes the virtio-net header (partial checksums, GSO super-frames) of a link face's frames.
//! - [`testkit`] holds the addresses that tests send from and to.
//!
//! Nothing here does I/O; it depends only on `flexstack-core` (packets and their metadata) and smoltcp's `wire`.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod checksum;
pub mod cidr;
pub mod packet;
pub mod rewrite;
pub mod testkit;
pub mod vnet;
