//! Rewriting a packet's addresses and ports in place, with its checksums updated incrementally (RFC 1624,
//! [`checksum::update`]) rather than summed again: the IPv4 header checksum, and the transport checksum over the
//! changed bytes (TCP, UDP and ICMPv6 cover the addresses through their pseudo-header; ICMPv4 has none and covers
//! only an echo identifier). A UDP checksum of 0 (none) stays 0, and an updated one that comes to 0 is written
//! 0xffff. A field that keeps its value is left as it is, and so are its checksums.
//!
//! `nat` rewrites endpoints (and the packet an ICMP error quotes); the late-binding scheduler rewrites the source
//! address of each packet it binds to an interface, and the destination of packets coming up.

use crate::checksum;
use crate::packet::{is_echo, proto, PacketInfo};
use std::net::IpAddr;

/// Where the fields of an IP packet (or of the packet an ICMP error quotes) are: what a rewrite needs of its
/// parse. 12 bytes, so that a scheduler can keep one with each packet it queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// IPv6 (else IPv4).
    pub v6: bool,
    /// The transport protocol.
    pub protocol: u8,
    /// Offset of the transport header.
    pub l4: u32,
    /// End of the packet's bytes (its length as its IP header states it): nothing at or past it is touched.
    pub end: u32,
    /// The transport header is there: a whole packet or a first fragment.
    pub transport: bool,
    /// An ICMP echo message, whose identifier is its port.
    pub echo: bool,
}

impl Layout {
    /// The layout of a parsed packet.
    pub fn of(info: &PacketInfo) -> Layout {
        Layout {
            v6: info.version == 6,
            protocol: info.protocol,
            // An IP packet is at most 65,575 bytes (16-bit length fields; jumbograms do not parse).
            l4: info.l4_offset as u32,
            end: info.total_len as u32,
            transport: info.fragment.is_none_or(|f| f.offset == 0),
            echo: info.icmp.is_some_and(|(t, _)| is_echo(info.protocol, t)),
        }
    }
}

/// Rewrites the source (`src`) or destination address of the packet in `buf` to `addr` and, when `port` is given,
/// its source or destination port (TCP, UDP) or its identifier (ICMP echo). An address of the other family than
/// the packet's, or a field past the packet's end, changes nothing.
pub fn endpoint(buf: &mut [u8], layout: &Layout, src: bool, addr: IpAddr, port: Option<u16>) {
    // With the address's length known, comparing and copying it are plain loads and stores (a slice of variable
    // length cost a memcmp and a memcpy call per packet in the late-binding scheduler).
    match addr {
        IpAddr::V4(a) => rewrite(buf, layout, src, a.octets(), port),
        IpAddr::V6(a) => rewrite(buf, layout, src, a.octets(), port),
    }
}

/// Rewrites the source (`src`) or destination address of the packet in `buf` to `addr`: [`endpoint`] without a
/// port.
pub fn address(buf: &mut [u8], layout: &Layout, src: bool, addr: IpAddr) {
    endpoint(buf, layout, src, addr, None);
}

/// [`endpoint`] for an address of `N` bytes.
fn rewrite<const N: usize>(buf: &mut [u8], l: &Layout, src: bool, new: [u8; N], port: Option<u16>) {
    let end = (l.end as usize).min(buf.len());
    let at = match (l.v6, src) {
        (false, true) => 12,
        (false, false) => 16,
        (true, true) => 8,
        (true, false) => 24,
    };
    if N != if l.v6 { 16 } else { 4 } || at + N > end {
        return;
    }
    let Ok(old) = <[u8; N]>::try_from(&buf[at..at + N]) else { return };
    let l4 = l.l4 as usize;
    let within = |at: &usize| l.transport && at + 2 <= end;
    let ck_at = match l.protocol {
        proto::TCP => Some(l4 + 16),
        proto::UDP => Some(l4 + 6),
        proto::ICMP | proto::ICMPV6 => Some(l4 + 2),
        _ => None,
    }
    .filter(within);
    // The transport checksum, if there is one to update (a zero UDP checksum says there is none).
    let mut ck = ck_at.map(|at| read16(buf, at)).filter(|&c| !(l.protocol == proto::UDP && c == 0));
    if old != new {
        buf[at..at + N].copy_from_slice(&new);
        if !l.v6 {
            let c = checksum::update(read16(buf, 10), &old, &new);
            buf[10..12].copy_from_slice(&c.to_be_bytes());
        }
        if l.protocol != proto::ICMP {
            ck = ck.map(|c| checksum::update(c, &old, &new));
        }
    }
    let port_at = match l.protocol {
        proto::TCP | proto::UDP => Some(l4 + if src { 0 } else { 2 }),
        proto::ICMP | proto::ICMPV6 if l.echo => Some(l4 + 4),
        _ => None,
    }
    .filter(within);
    if let (Some(p), Some(port_at)) = (port, port_at) {
        let (old_port, new_port) = ([buf[port_at], buf[port_at + 1]], p.to_be_bytes());
        if old_port != new_port {
            buf[port_at..port_at + 2].copy_from_slice(&new_port);
            ck = ck.map(|c| checksum::update(c, &old_port, &new_port));
        }
    }
    if let (Some(mut c), Some(at)) = (ck, ck_at) {
        if l.protocol == proto::UDP && c == 0 {
            c = 0xffff;
        }
        buf[at..at + 2].copy_from_slice(&c.to_be_bytes());
    }
}

fn read16(buf: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([buf[at], buf[at + 1]])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packet::build;
    use std::net::{Ipv4Addr, Ipv6Addr};

    /// UDP/IPv4 10.77.0.2:5000 -> 198.51.100.7:53 carrying "query" (checksums computed independently).
    const V4_UDP: [u8; 33] = [
        0x45, 0x00, 0x00, 0x21, 0x12, 0x34, 0x40, 0x00, 0x40, 0x11, 0xf4, 0x0e, 0x0a, 0x4d, 0x00, 0x02, 0xc6, 0x33,
        0x64, 0x07, 0x13, 0x88, 0x00, 0x35, 0x00, 0x0d, 0x67, 0xa5, 0x71, 0x75, 0x65, 0x72, 0x79,
    ];
    /// [`V4_UDP`] from 192.0.2.10:40000.
    const V4_UDP_SNAT: [u8; 33] = [
        0x45, 0x00, 0x00, 0x21, 0x12, 0x34, 0x40, 0x00, 0x40, 0x11, 0x3c, 0x53, 0xc0, 0x00, 0x02, 0x0a, 0xc6, 0x33,
        0x64, 0x07, 0x9c, 0x40, 0x00, 0x35, 0x00, 0x0d, 0x27, 0x31, 0x71, 0x75, 0x65, 0x72, 0x79,
    ];
    /// TCP/IPv6 [fd00::2]:40000 -> [fd00::1]:80 carrying "hi".
    const V6_TCP: [u8; 62] = [
        0x60, 0x00, 0x00, 0x00, 0x00, 0x16, 0x06, 0x40, 0xfd, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0xfd, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x01, 0x9c, 0x40, 0x00, 0x50, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x50, 0x02,
        0xff, 0xff, 0xb0, 0xe1, 0x00, 0x00, 0x68, 0x69,
    ];
    /// [`V6_TCP`] to [fd77::5]:8080.
    const V6_TCP_DNAT: [u8; 62] = [
        0x60, 0x00, 0x00, 0x00, 0x00, 0x16, 0x06, 0x40, 0xfd, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0xfd, 0x77, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x05, 0x9c, 0x40, 0x1f, 0x90, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x50, 0x02,
        0xff, 0xff, 0x91, 0x26, 0x00, 0x00, 0x68, 0x69,
    ];

    fn layout(packet: &[u8]) -> Layout {
        Layout::of(&PacketInfo::parse(packet).expect("a packet that parses"))
    }

    fn rewritten(packet: &[u8], src: bool, addr: IpAddr, port: Option<u16>) -> Vec<u8> {
        let mut p = packet.to_vec();
        endpoint(&mut p, &layout(packet), src, addr, port);
        p
    }

    #[test]
    fn endpoints_are_rewritten_with_their_checksums() {
        let public: IpAddr = Ipv4Addr::new(192, 0, 2, 10).into();
        assert_eq!(rewritten(&V4_UDP, true, public, Some(40_000)), V4_UDP_SNAT);
        let inside: IpAddr = "fd77::5".parse().unwrap();
        assert_eq!(rewritten(&V6_TCP, false, inside, Some(8080)), V6_TCP_DNAT);
        // Back again: the original bytes.
        assert_eq!(rewritten(&V4_UDP_SNAT, true, Ipv4Addr::new(10, 77, 0, 2).into(), Some(5000)), V4_UDP);
        assert_eq!(rewritten(&V6_TCP_DNAT, false, "fd00::1".parse().unwrap(), Some(80)), V6_TCP);
        // An address alone, as late binding rewrites it: the same as the packet built with it.
        let mut p = V4_UDP.to_vec();
        address(&mut p, &layout(&V4_UDP), false, Ipv4Addr::new(203, 0, 113, 9).into());
        let (a, b) = (Ipv4Addr::new(10, 77, 0, 2), Ipv4Addr::new(203, 0, 113, 9));
        assert_eq!(p, build::ipv4(a, b, proto::UDP, 64, &build::udp(a.into(), b.into(), 5000, 53, b"query")));
    }

    #[test]
    fn unchanged_fields_other_families_and_missing_fields_change_nothing() {
        assert_eq!(rewritten(&V4_UDP, true, Ipv4Addr::new(10, 77, 0, 2).into(), Some(5000)), V4_UDP);
        assert_eq!(rewritten(&V4_UDP, true, "fd00::9".parse().unwrap(), Some(1)), V4_UDP);
        assert_eq!(rewritten(&V6_TCP, true, Ipv4Addr::new(192, 0, 2, 1).into(), None), V6_TCP);
        // A layout whose end cuts the address off.
        let mut p = V4_UDP.to_vec();
        endpoint(&mut p, &Layout { end: 14, ..layout(&V4_UDP) }, true, Ipv4Addr::new(1, 2, 3, 4).into(), None);
        assert_eq!(p, V4_UDP);
    }

    #[test]
    fn a_zero_udp_checksum_stays_zero_and_icmpv4_covers_only_the_identifier() {
        let mut none = V4_UDP.to_vec();
        none[26..28].copy_from_slice(&[0, 0]);
        let p = rewritten(&none, true, Ipv4Addr::new(192, 0, 2, 10).into(), Some(40_000));
        assert_eq!(p[26..28], [0, 0], "no UDP checksum");
        assert_eq!(p[10..12], V4_UDP_SNAT[10..12], "the header checksum is updated");

        let (a, b, c) = (Ipv4Addr::new(10, 0, 0, 2), Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(192, 0, 2, 1));
        let ping = build::ipv4(a, b, proto::ICMP, 64, &build::icmpv4_echo(7, 1, b"x"));
        assert_eq!(rewritten(&ping, true, c.into(), None)[20..], ping[20..], "no pseudo-header in ICMPv4");
        let expected = build::ipv4(c, b, proto::ICMP, 64, &build::icmpv4_echo(99, 1, b"x"));
        assert_eq!(rewritten(&ping, true, c.into(), Some(99)), expected);

        // ICMPv6 covers the addresses, and its echo identifier.
        let (a6, b6): (Ipv6Addr, Ipv6Addr) = ("fd00::2".parse().unwrap(), "fd00::1".parse().unwrap());
        let echo6 = |src: Ipv6Addr, id: u16| {
            let mut m = build::icmpv4_echo(id, 1, b"x");
            m[0] = 128;
            m[2..4].copy_from_slice(&[0, 0]);
            let sum = checksum::pseudo_header(src.into(), b6.into(), proto::ICMPV6, m.len() as u32);
            let ck = checksum::finish(checksum::sum(sum, &m));
            m[2..4].copy_from_slice(&ck.to_be_bytes());
            build::ipv6(src, b6, proto::ICMPV6, 64, &m)
        };
        let c6: Ipv6Addr = "fd77::3".parse().unwrap();
        assert_eq!(rewritten(&echo6(a6, 7), true, c6.into(), Some(8)), echo6(c6, 8));
    }

    #[test]
    fn fragments_and_quoted_packets_keep_what_they_lack() {
        // A non-first fragment: the IPv4 header changes, the bytes where a transport header would be do not.
        let mut frag = V4_UDP.to_vec();
        frag[6..8].copy_from_slice(&0x0001u16.to_be_bytes());
        frag[10..12].copy_from_slice(&[0, 0]);
        let c = checksum::ipv4_header(&frag[..20]);
        frag[10..12].copy_from_slice(&c.to_be_bytes());
        let p = rewritten(&frag, true, Ipv4Addr::new(192, 0, 2, 10).into(), Some(40_000));
        assert_eq!(p[20..], frag[20..]);
        assert!(checksum::verify(0, &p[..20]) && p[12..16] == [192, 0, 2, 10]);

        // The first 8 bytes of a TCP segment, as an ICMP error quotes it: the port changes, the checksum is not
        // there to update.
        let quoted = &V6_TCP[..48];
        let mut q = quoted.to_vec();
        let l = Layout { v6: true, protocol: proto::TCP, l4: 40, end: 48, transport: true, echo: false };
        endpoint(&mut q, &l, true, "fd00::9".parse().unwrap(), Some(1234));
        assert_eq!(
            (&q[8..24], &q[40..42]),
            ("fd00::9".parse::<Ipv6Addr>().unwrap().octets().as_slice(), &[0x04, 0xd2][..])
        );
        assert_eq!(q[42..], quoted[42..]);
    }
}
