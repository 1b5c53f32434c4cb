//! Addresses shared by the tests of every crate that builds packets (module tests, fuzz tests, benches).

use std::net::{Ipv4Addr, Ipv6Addr};

/// The IPv4 address the tests send from.
pub const A4: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 2);
/// The IPv4 address the tests send to.
pub const B4: Ipv4Addr = Ipv4Addr::new(10, 2, 0, 1);

/// The IPv6 address the tests send from.
pub fn a6() -> Ipv6Addr {
    "fd00::2".parse().unwrap()
}

/// The IPv6 address the tests send to.
pub fn b6() -> Ipv6Addr {
    "fd00:1::1".parse().unwrap()
}
