//! Ethernet framing: MAC addresses, the MACs multicast addresses map to, and writing a frame's header.

use smoltcp::wire::{EthernetAddress, EthernetFrame, EthernetProtocol, EthernetRepr};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// A MAC address.
pub type Mac = [u8; 6];

pub(crate) const BROADCAST: Mac = [0xff; 6];

/// Parses `02:00:00:00:00:01` (or with `-`).
pub fn parse_mac(text: &str) -> Option<Mac> {
    let mut mac = [0u8; 6];
    let mut parts = text.trim().split([':', '-']);
    for b in &mut mac {
        let part = parts.next()?;
        if part.is_empty() || part.len() > 2 || !part.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        *b = u8::from_str_radix(part, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// `02:00:00:00:00:01`.
pub fn format_mac(mac: Mac) -> String {
    let [a, b, c, d, e, f] = mac;
    format!("{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{f:02x}")
}

/// The MAC an IPv6 multicast address maps to (RFC 2464 7).
pub fn multicast_mac_v6(addr: Ipv6Addr) -> Mac {
    let o = addr.octets();
    [0x33, 0x33, o[12], o[13], o[14], o[15]]
}

/// The MAC an IPv4 multicast address maps to (RFC 1112 6.4).
pub fn multicast_mac_v4(addr: Ipv4Addr) -> Mac {
    let o = addr.octets();
    [0x01, 0x00, 0x5e, o[1] & 0x7f, o[2], o[3]]
}

fn v4_at(data: &[u8], at: usize) -> Ipv4Addr {
    Ipv4Addr::new(data[at], data[at + 1], data[at + 2], data[at + 3])
}

pub(crate) fn v6_at(data: &[u8], at: usize) -> Ipv6Addr {
    let mut a = [0u8; 16];
    a.copy_from_slice(&data[at..at + 16]);
    Ipv6Addr::from(a)
}

/// Source and destination of a packet to send, if it is IPv4/IPv6 with its whole fixed header.
pub(crate) fn ip_addresses(data: &[u8]) -> Option<(IpAddr, IpAddr)> {
    match data.first()? >> 4 {
        4 if data.len() >= 20 => Some((v4_at(data, 12).into(), v4_at(data, 16).into())),
        6 if data.len() >= 40 => Some((v6_at(data, 8).into(), v6_at(data, 24).into())),
        _ => None,
    }
}

pub(crate) fn write_ethernet(buf: &mut [u8], dst: Mac, src: Mac, ethertype: EthernetProtocol) {
    let mut frame = EthernetFrame::new_unchecked(buf);
    EthernetRepr { src_addr: EthernetAddress(src), dst_addr: EthernetAddress(dst), ethertype }.emit(&mut frame);
}
