//! Packets an endpoint writes itself (UDP datagrams, ICMP errors to the app) and reads itself (the packet an ICMP
//! error quotes).

use crate::ip::icmp;
use flexstack_core::{Packet, PacketPool};
use flexstack_wire::checksum;
use flexstack_wire::packet::{proto, PacketInfo};
use std::net::{IpAddr, SocketAddr};

/// Hop limit of the packets an endpoint writes.
pub const HOP_LIMIT: u8 = 64;

/// Writes an IP header for `len` bytes of `protocol` payload from `src` to `dst` into `buf` (cleared first).
fn ip_header(buf: &mut Vec<u8>, src: IpAddr, dst: IpAddr, protocol: u8, len: usize) {
    buf.clear();
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let total = 20 + len;
            buf.extend_from_slice(&[
                0x45,
                0,
                (total >> 8) as u8,
                total as u8,
                0,
                0,
                0x40,
                0,
                HOP_LIMIT,
                protocol,
                0,
                0,
            ]);
            buf.extend_from_slice(&s.octets());
            buf.extend_from_slice(&d.octets());
            let c = checksum::ipv4_header(&buf[..20]);
            buf[10..12].copy_from_slice(&c.to_be_bytes());
        }
        _ => {
            let v6 = |a: IpAddr| match a {
                IpAddr::V6(a) => a,
                IpAddr::V4(a) => a.to_ipv6_mapped(),
            };
            buf.extend_from_slice(&[0x60, 0, 0, 0, (len >> 8) as u8, len as u8, protocol, HOP_LIMIT]);
            buf.extend_from_slice(&v6(src).octets());
            buf.extend_from_slice(&v6(dst).octets());
        }
    }
}

/// A UDP datagram from `src` to `dst` carrying `payload`, with its checksum, in a pooled packet.
pub fn udp(pool: &PacketPool, src: SocketAddr, dst: SocketAddr, payload: &[u8]) -> Packet {
    let mut p = pool.alloc();
    let buf = p.make_mut();
    let len = 8 + payload.len();
    ip_header(buf, src.ip(), dst.ip(), proto::UDP, len);
    let l4 = buf.len();
    buf.extend_from_slice(&src.port().to_be_bytes());
    buf.extend_from_slice(&dst.port().to_be_bytes());
    buf.extend_from_slice(&(len as u16).to_be_bytes());
    buf.extend_from_slice(&[0, 0]);
    buf.extend_from_slice(payload);
    let c = checksum::finish_transport(checksum::sum(
        checksum::pseudo_header(src.ip(), dst.ip(), proto::UDP, len as u32),
        &buf[l4..],
    ));
    buf[l4 + 6..l4 + 8].copy_from_slice(&c.to_be_bytes());
    p
}

/// The payload of a UDP datagram whose headers `info` describes, if it is one: its length field within the packet
/// and at least 8, its checksum right (or absent, over IPv4).
pub fn udp_payload<'a>(data: &'a [u8], info: &PacketInfo) -> Option<&'a [u8]> {
    let l4 = data.get(info.l4_offset..info.total_len)?;
    let len = usize::from(u16::from_be_bytes([*l4.get(4)?, *l4.get(5)?]));
    if len < 8 || len > l4.len() {
        return None;
    }
    let udp = &l4[..len];
    let stated = u16::from_be_bytes([udp[6], udp[7]]);
    let ok = match (stated, info.version) {
        (0, 4) => true,
        (0, _) => false,
        _ => checksum::verify(checksum::pseudo_header(info.src, info.dst, proto::UDP, len as u32), udp),
    };
    ok.then(|| &udp[8..])
}

/// Why an ICMP error is sent to the app.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unreachable {
    /// The destination host (a connection that could not be made).
    Host,
    /// The destination port (a UDP flow).
    Port,
}

/// An ICMP (or ICMPv6) destination unreachable from `from` (the original destination) about `original` (a packet
/// the app sent), in a pooled packet; `None` if the families differ.
pub fn unreachable(pool: &PacketPool, from: IpAddr, original: &[u8], why: Unreachable) -> Option<Packet> {
    let mut p = pool.alloc();
    match (from, original.first().map(|b| b >> 4)) {
        (IpAddr::V4(a), Some(4)) => {
            let code = if why == Unreachable::Host { 1 } else { 3 };
            icmp::write_error_v4(p.make_mut(), a, original, icmp::types::DEST_UNREACHABLE, code, [0; 4]);
        }
        (IpAddr::V6(a), Some(6)) => {
            let code = if why == Unreachable::Host { 3 } else { 4 };
            icmp::write_error_v6(p.make_mut(), a, original, icmp::types::V6_DEST_UNREACHABLE, code, [0; 4]);
        }
        _ => return None,
    }
    Some(p)
}

/// What an ICMP error quotes: the protocol and the two endpoints of the packet it is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quoted {
    /// Transport protocol.
    pub protocol: u8,
    /// Source of the quoted packet (us, for an error about a packet we sent).
    pub src: SocketAddr,
    /// Its destination.
    pub dst: SocketAddr,
}

/// The packet quoted by an ICMP error (`message`: the ICMP message from its type on), if it is a TCP or UDP packet
/// with at least its ports (no extension headers are walked in a quoted IPv6 packet).
pub fn quoted(message: &[u8]) -> Option<Quoted> {
    let q = message.get(8..)?;
    let (protocol, src, dst, l4) = match q.first()? >> 4 {
        4 => {
            let ihl = usize::from(q[0] & 0x0f) * 4;
            let h = q.get(..20)?;
            let src: [u8; 4] = h[12..16].try_into().ok()?;
            let dst: [u8; 4] = h[16..20].try_into().ok()?;
            if ihl < 20 || u16::from_be_bytes([h[6], h[7]]) & 0x1fff != 0 {
                return None; // a non-first fragment has no ports
            }
            (h[9], IpAddr::from(src), IpAddr::from(dst), ihl)
        }
        6 => {
            let h = q.get(..40)?;
            let src: [u8; 16] = h[8..24].try_into().ok()?;
            let dst: [u8; 16] = h[24..40].try_into().ok()?;
            (h[6], IpAddr::from(src), IpAddr::from(dst), 40)
        }
        _ => return None,
    };
    if protocol != proto::TCP && protocol != proto::UDP {
        return None;
    }
    let ports = q.get(l4..l4 + 4)?;
    Some(Quoted {
        protocol,
        src: SocketAddr::new(src, u16::from_be_bytes([ports[0], ports[1]])),
        dst: SocketAddr::new(dst, u16::from_be_bytes([ports[2], ports[3]])),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn udp_datagrams_parse_back_with_right_checksums() {
        let pool = PacketPool::default();
        for (s, d) in [("10.0.0.2:5000", "192.0.2.1:53"), ("[fd77::2]:5000", "[2001:db8::1]:53")] {
            let (s, d): (SocketAddr, SocketAddr) = (s.parse().unwrap(), d.parse().unwrap());
            let p = udp(&pool, s, d, b"query");
            let info = PacketInfo::parse(p.data()).unwrap();
            assert_eq!((info.src, info.dst, info.src_port, info.dst_port), (s.ip(), d.ip(), 5000, 53));
            assert_eq!(&p.data()[info.l4_offset + 8..], b"query");
            let l4 = &p.data()[info.l4_offset..];
            assert!(checksum::verify(checksum::pseudo_header(s.ip(), d.ip(), 17, l4.len() as u32), l4));
            assert_eq!(udp_payload(p.data(), &info), Some(&b"query"[..]));
            let mut bad = p.data().to_vec();
            let at = bad.len() - 1;
            bad[at] ^= 1;
            assert_eq!(udp_payload(&bad, &info), None, "a wrong checksum");
            let mut long = p.data().to_vec();
            long[info.l4_offset + 5] += 1;
            assert_eq!(udp_payload(&long, &info), None, "a length beyond the packet");
            // An ICMP error about it quotes it, and the quote reads back.
            let e = unreachable(&pool, d.ip(), p.data(), Unreachable::Port).unwrap();
            let ei = PacketInfo::parse(e.data()).unwrap();
            assert_eq!((ei.src, ei.dst), (d.ip(), s.ip()));
            let q = quoted(&e.data()[ei.l4_offset..]).unwrap();
            assert_eq!(q, Quoted { protocol: 17, src: s, dst: d });
        }
        assert!(unreachable(&pool, "10.0.0.1".parse().unwrap(), &[0x60; 40], Unreachable::Host).is_none());
        assert!(quoted(&[3, 3, 0, 0, 0, 0, 0, 0, 0x45]).is_none(), "truncated quote");
    }
}
