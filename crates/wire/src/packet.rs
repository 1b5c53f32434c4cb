//! A parsed view of an IP packet's headers, shared by the network modules.
//!
//! [`PacketInfo::parse`] reads a raw IPv4 or IPv6 packet (no link header) once, without allocating: version,
//! addresses, hop limit, the transport protocol after any IPv6 extension headers, where the transport header
//! starts, ports (TCP/UDP) or type/code (ICMP), and fragment information. A packet that cannot be parsed gives a
//! [`ParseError`], whose [`ParseError::reason`] is the name of the drop meter a module counts it in.
//! IPv4 and IPv6 fixed headers are read through `smoltcp::wire`; the IPv6 extension-header chain is walked here
//! with a bound on its length.

use flexstack_core::{Frame, Meter, ModuleVars, Output, Packet, ValueType, VarSpec};
use smoltcp::wire::{Ipv4Packet, Ipv6FragmentHeader, Ipv6Packet};
use std::fmt;
use std::net::IpAddr;

/// IP protocol numbers used by the modules.
pub mod proto {
    /// ICMP for IPv4.
    pub const ICMP: u8 = 1;
    /// TCP.
    pub const TCP: u8 = 6;
    /// UDP.
    pub const UDP: u8 = 17;
    /// ICMPv6.
    pub const ICMPV6: u8 = 58;
    /// IPv6 hop-by-hop options.
    pub const HOP_BY_HOP: u8 = 0;
    /// IPv6 routing header.
    pub const ROUTING: u8 = 43;
    /// IPv6 fragment header.
    pub const FRAGMENT: u8 = 44;
    /// IPv6 destination options.
    pub const DEST_OPTS: u8 = 60;
    /// Authentication header.
    pub const AH: u8 = 51;
    /// No next header.
    pub const NO_NEXT: u8 = 59;
}

/// True for an ICMP or ICMPv6 echo request or reply (types 8 and 0, 128 and 129), whose identifier works as a port.
pub fn is_echo(protocol: u8, icmp_type: u8) -> bool {
    matches!((protocol, icmp_type), (proto::ICMP, 0 | 8) | (proto::ICMPV6, 128 | 129))
}

/// Most IPv6 extension headers walked before the packet is refused.
pub const MAX_EXTENSION_HEADERS: usize = 8;

/// Fragment information of a packet that is one fragment of a larger datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fragment {
    /// Offset of this fragment's data in the datagram, in bytes.
    pub offset: u32,
    /// More fragments follow.
    pub more: bool,
    /// Identification (16 bits for IPv4, 32 for IPv6).
    pub id: u32,
    /// Where the fragmentable part starts (IPv4: the header length; IPv6: after the fragment header).
    pub data_offset: usize,
}

/// The parsed headers of one IP packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PacketInfo {
    /// 4 or 6.
    pub version: u8,
    /// Source address.
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// TTL or hop limit.
    pub hop_limit: u8,
    /// Transport protocol (after IPv6 extension headers).
    pub protocol: u8,
    /// Length of the IP header including IPv6 extension headers, i.e. where the transport header starts.
    pub l4_offset: usize,
    /// Length of the packet according to its IP header (≤ the buffer's length).
    pub total_len: usize,
    /// Source port (TCP/UDP), ICMP identifier for echo, else 0; 0 in non-first fragments.
    pub src_port: u16,
    /// Destination port (TCP/UDP), else 0; 0 in non-first fragments.
    pub dst_port: u16,
    /// ICMP/ICMPv6 type and code, if this is a first fragment of an ICMP message.
    pub icmp: Option<(u8, u8)>,
    /// Set when the packet is a fragment.
    pub fragment: Option<Fragment>,
}

/// Why a packet could not be parsed; each is a drop reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParseError {
    /// Empty, or shorter than the fixed IP header.
    Truncated,
    /// The version nibble is neither 4 nor 6.
    BadVersion,
    /// IPv4 IHL < 5 or beyond the buffer.
    BadHeaderLength,
    /// The total / payload length disagrees with the buffer.
    BadTotalLength,
    /// The IPv4 header checksum is wrong.
    BadChecksum,
    /// An IPv6 extension header is truncated, or the chain is too long.
    BadExtensionHeader,
    /// The transport header is shorter than its minimum in a first fragment.
    TruncatedTransport,
}

impl ParseError {
    /// The drop reason, as used in meter names (`drop_<reason>_total`).
    pub fn reason(self) -> &'static str {
        match self {
            ParseError::Truncated => "truncated",
            ParseError::BadVersion => "bad_version",
            ParseError::BadHeaderLength => "bad_header_length",
            ParseError::BadTotalLength => "bad_total_length",
            ParseError::BadChecksum => "bad_checksum",
            ParseError::BadExtensionHeader => "bad_extension_header",
            ParseError::TruncatedTransport => "truncated_transport",
        }
    }

    /// Every reason, for declaring meters.
    pub const ALL: [ParseError; 7] = [
        ParseError::Truncated,
        ParseError::BadVersion,
        ParseError::BadHeaderLength,
        ParseError::BadTotalLength,
        ParseError::BadChecksum,
        ParseError::BadExtensionHeader,
        ParseError::TruncatedTransport,
    ];
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reason())
    }
}

/// The drop meters of packets that do not parse (`drop_<reason>_total`, one per [`ParseError`]) and, for modules
/// that drop control frames arriving where packets are expected, `drop_not_packet_total`.
pub struct ParseDrops {
    reasons: Vec<Meter>,
    not_packet: Option<Meter>,
}

impl ParseDrops {
    /// The meter declarations; `not_packet` adds `drop_not_packet_total`.
    pub fn specs(not_packet: bool) -> Vec<VarSpec> {
        let mut v: Vec<VarSpec> = ParseError::ALL
            .iter()
            .map(|e| {
                let desc = format!("packets dropped because they do not parse: {}", e.reason().replace('_', " "));
                VarSpec::meter(&format!("drop_{}_total", e.reason()), ValueType::U64, "frames", &desc)
            })
            .collect();
        if not_packet {
            v.push(VarSpec::meter("drop_not_packet_total", ValueType::U64, "frames", "control frames dropped"));
        }
        v
    }

    /// The meters declared by [`ParseDrops::specs`].
    pub fn new(vars: &ModuleVars) -> ParseDrops {
        ParseDrops {
            reasons: ParseError::ALL.iter().map(|e| vars.meter(&format!("drop_{}_total", e.reason()))).collect(),
            not_packet: vars.cell("drop_not_packet_total").map(|_| vars.meter("drop_not_packet_total")),
        }
    }

    /// Counts a packet that did not parse.
    pub fn count(&self, e: ParseError) {
        if let Some(i) = ParseError::ALL.iter().position(|x| *x == e) {
            self.reasons[i].add(1);
        }
    }

    /// Counts a control frame where a packet was expected.
    pub fn not_packet(&self) {
        if let Some(m) = &self.not_packet {
            m.add(1);
        }
    }

    /// The packet `frame` holds and its headers; a control frame, or a packet that does not parse, is counted and
    /// dropped (`None`).
    pub fn parse(&self, frame: Frame, out: &mut Output<'_>) -> Option<(Packet, PacketInfo)> {
        match frame {
            Frame::Data(p) => self.parse_packet(p, out),
            f @ Frame::Control(_) => {
                self.not_packet();
                out.drop_frame(f);
                None
            }
        }
    }

    /// `packet` and its headers; a packet that does not parse is counted by reason and dropped (`None`).
    pub fn parse_packet(&self, packet: Packet, out: &mut Output<'_>) -> Option<(Packet, PacketInfo)> {
        match PacketInfo::parse(packet.data()) {
            Ok(info) => Some((packet, info)),
            Err(e) => {
                self.count(e);
                out.drop_frame(packet.into());
                None
            }
        }
    }
}

impl PacketInfo {
    /// Parses the IP and transport headers of `data`. The IPv4 header checksum is verified; transport checksums
    /// are not (see [`crate::checksum`]).
    pub fn parse(data: &[u8]) -> Result<PacketInfo, ParseError> {
        match data.first().map(|b| b >> 4) {
            None => Err(ParseError::Truncated),
            Some(4) => Self::parse_v4(data),
            Some(6) => Self::parse_v6(data),
            Some(_) => Err(ParseError::BadVersion),
        }
    }

    fn parse_v4(data: &[u8]) -> Result<PacketInfo, ParseError> {
        if data.len() < 20 {
            return Err(ParseError::Truncated);
        }
        let ihl = usize::from(data[0] & 0x0f) * 4;
        if ihl < 20 || ihl > data.len() {
            return Err(ParseError::BadHeaderLength);
        }
        let total = usize::from(u16::from_be_bytes([data[2], data[3]]));
        if total < ihl || total > data.len() {
            return Err(ParseError::BadTotalLength);
        }
        let p = Ipv4Packet::new_checked(&data[..total]).map_err(|_| ParseError::BadTotalLength)?;
        if !p.verify_checksum() {
            return Err(ParseError::BadChecksum);
        }
        let fragment = (p.more_frags() || p.frag_offset() != 0).then(|| Fragment {
            offset: u32::from(p.frag_offset()),
            more: p.more_frags(),
            id: u32::from(p.ident()),
            data_offset: ihl,
        });
        let mut info = PacketInfo {
            version: 4,
            src: IpAddr::V4(p.src_addr()),
            dst: IpAddr::V4(p.dst_addr()),
            hop_limit: p.hop_limit(),
            protocol: u8::from(p.next_header()),
            l4_offset: ihl,
            total_len: total,
            src_port: 0,
            dst_port: 0,
            icmp: None,
            fragment,
        };
        info.parse_transport(&data[..total])?;
        Ok(info)
    }

    fn parse_v6(data: &[u8]) -> Result<PacketInfo, ParseError> {
        if data.len() < 40 {
            return Err(ParseError::Truncated);
        }
        let p = Ipv6Packet::new_checked(data).map_err(|_| ParseError::BadTotalLength)?;
        let total = 40 + usize::from(p.payload_len());
        let data = &data[..total];
        let mut next = u8::from(p.next_header());
        let mut offset = 40;
        let mut fragment = None;
        let mut headers = 0;
        loop {
            match next {
                proto::HOP_BY_HOP | proto::ROUTING | proto::DEST_OPTS | proto::AH => {
                    let h = data.get(offset..offset + 2).ok_or(ParseError::BadExtensionHeader)?;
                    let len = if next == proto::AH { (usize::from(h[1]) + 2) * 4 } else { (usize::from(h[1]) + 1) * 8 };
                    if offset + len > data.len() {
                        return Err(ParseError::BadExtensionHeader);
                    }
                    next = h[0];
                    offset += len;
                }
                proto::FRAGMENT => {
                    let h = data.get(offset..offset + 8).ok_or(ParseError::BadExtensionHeader)?;
                    // smoltcp's view starts after the generic next-header and reserved bytes.
                    let f = Ipv6FragmentHeader::new_checked(&h[2..]).map_err(|_| ParseError::BadExtensionHeader)?;
                    next = h[0];
                    offset += 8;
                    fragment = Some(Fragment {
                        offset: u32::from(f.frag_offset()) * 8,
                        more: f.more_frags(),
                        id: f.ident(),
                        data_offset: offset,
                    });
                    // After the fragment header of a non-first fragment comes data, not more headers: stop here,
                    // with the fragment header's next header as the protocol.
                    if f.frag_offset() != 0 {
                        break;
                    }
                }
                _ => break,
            }
            headers += 1;
            if headers > MAX_EXTENSION_HEADERS {
                return Err(ParseError::BadExtensionHeader);
            }
        }
        let mut info = PacketInfo {
            version: 6,
            src: IpAddr::V6(p.src_addr()),
            dst: IpAddr::V6(p.dst_addr()),
            hop_limit: p.hop_limit(),
            protocol: next,
            l4_offset: offset,
            total_len: total,
            src_port: 0,
            dst_port: 0,
            icmp: None,
            fragment,
        };
        // An atomic fragment (offset 0, no more) is a whole packet.
        if info.fragment.is_some_and(|f| f.offset == 0 && !f.more) {
            info.fragment = None;
        }
        info.parse_transport(data)?;
        Ok(info)
    }

    /// Reads ports or ICMP type/code from a first fragment (or a whole packet).
    fn parse_transport(&mut self, data: &[u8]) -> Result<(), ParseError> {
        if self.fragment.is_some_and(|f| f.offset != 0) {
            return Ok(());
        }
        let l4 = &data[self.l4_offset.min(data.len())..];
        let whole = self.fragment.is_none();
        match self.protocol {
            proto::TCP | proto::UDP => {
                let min = if self.protocol == proto::TCP { 20 } else { 8 };
                if l4.len() < 4 || (whole && l4.len() < min) {
                    return Err(ParseError::TruncatedTransport);
                }
                if whole && self.protocol == proto::TCP && usize::from(l4[12] >> 4) * 4 < 20 {
                    return Err(ParseError::TruncatedTransport);
                }
                self.src_port = u16::from_be_bytes([l4[0], l4[1]]);
                self.dst_port = u16::from_be_bytes([l4[2], l4[3]]);
            }
            proto::ICMP | proto::ICMPV6 => {
                if l4.len() < 4 || (whole && l4.len() < 8) {
                    return Err(ParseError::TruncatedTransport);
                }
                self.icmp = Some((l4[0], l4[1]));
                // Echo request/reply: the identifier plays the part of a port for flows and NAT.
                let echo = matches!((self.protocol, l4[0]), (proto::ICMP, 0 | 8) | (proto::ICMPV6, 128 | 129));
                if echo && l4.len() >= 6 {
                    self.src_port = u16::from_be_bytes([l4[4], l4[5]]);
                    self.dst_port = self.src_port;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// True for TCP or UDP.
    pub fn has_ports(&self) -> bool {
        matches!(self.protocol, proto::TCP | proto::UDP)
    }

    /// Length of the transport segment (from `l4_offset` to `total_len`).
    pub fn l4_len(&self) -> usize {
        self.total_len.saturating_sub(self.l4_offset)
    }
}

/// Builders of test packets, shared by the modules' unit tests (and usable by tests elsewhere).
pub mod build {
    use crate::checksum;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    /// An IPv4 packet with a correct header checksum and `payload` after it (transport checksum left as given).
    pub fn ipv4(src: Ipv4Addr, dst: Ipv4Addr, protocol: u8, ttl: u8, payload: &[u8]) -> Vec<u8> {
        let total = 20 + payload.len();
        let mut p = vec![0x45, 0, (total >> 8) as u8, total as u8, 0x12, 0x34, 0x40, 0, ttl, protocol, 0, 0];
        p.extend_from_slice(&src.octets());
        p.extend_from_slice(&dst.octets());
        let c = checksum::ipv4_header(&p);
        p[10..12].copy_from_slice(&c.to_be_bytes());
        p.extend_from_slice(payload);
        p
    }

    /// An IPv6 packet with `payload` directly after the fixed header (`next` = its protocol).
    pub fn ipv6(src: Ipv6Addr, dst: Ipv6Addr, next: u8, hop_limit: u8, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut p = vec![0x60, 0, 0, 0, (len >> 8) as u8, len as u8, next, hop_limit];
        p.extend_from_slice(&src.octets());
        p.extend_from_slice(&dst.octets());
        p.extend_from_slice(payload);
        p
    }

    /// A UDP datagram with a correct checksum for the given addresses.
    pub fn udp(src: IpAddr, dst: IpAddr, sport: u16, dport: u16, data: &[u8]) -> Vec<u8> {
        let len = 8 + data.len();
        let mut u = Vec::with_capacity(len);
        u.extend_from_slice(&sport.to_be_bytes());
        u.extend_from_slice(&dport.to_be_bytes());
        u.extend_from_slice(&(len as u16).to_be_bytes());
        u.extend_from_slice(&[0, 0]);
        u.extend_from_slice(data);
        let c = checksum::finish_transport(checksum::sum(checksum::pseudo_header(src, dst, 17, len as u32), &u));
        u[6..8].copy_from_slice(&c.to_be_bytes());
        u
    }

    /// A minimal TCP segment (20-byte header, flags SYN) with a correct checksum.
    pub fn tcp(src: IpAddr, dst: IpAddr, sport: u16, dport: u16, data: &[u8]) -> Vec<u8> {
        let mut t = Vec::with_capacity(20 + data.len());
        t.extend_from_slice(&sport.to_be_bytes());
        t.extend_from_slice(&dport.to_be_bytes());
        t.extend_from_slice(&1u32.to_be_bytes());
        t.extend_from_slice(&0u32.to_be_bytes());
        t.extend_from_slice(&[0x50, 0x02, 0xff, 0xff, 0, 0, 0, 0]);
        t.extend_from_slice(data);
        let c = checksum::finish(checksum::sum(checksum::pseudo_header(src, dst, 6, t.len() as u32), &t));
        t[16..18].copy_from_slice(&c.to_be_bytes());
        t
    }

    /// An ICMP (v4) echo request with identifier `id`, sequence `seq`, and a correct checksum.
    pub fn icmpv4_echo(id: u16, seq: u16, data: &[u8]) -> Vec<u8> {
        let mut m = vec![8, 0, 0, 0];
        m.extend_from_slice(&id.to_be_bytes());
        m.extend_from_slice(&seq.to_be_bytes());
        m.extend_from_slice(data);
        let c = checksum::finish(checksum::sum(0, &m));
        m[2..4].copy_from_slice(&c.to_be_bytes());
        m
    }
}

#[cfg(test)]
mod tests {
    use super::build::*;
    use super::*;
    use crate::testkit::{a6, b6, A4, B4};

    #[test]
    fn ipv4_udp_tcp_icmp() {
        let u = udp(A4.into(), B4.into(), 4000, 53, b"q");
        let info = PacketInfo::parse(&ipv4(A4, B4, proto::UDP, 64, &u)).unwrap();
        assert_eq!((info.version, info.protocol, info.src_port, info.dst_port), (4, 17, 4000, 53));
        assert_eq!((info.l4_offset, info.total_len, info.hop_limit), (20, 29, 64));
        let t = tcp(A4.into(), B4.into(), 5000, 80, b"");
        let info = PacketInfo::parse(&ipv4(A4, B4, proto::TCP, 64, &t)).unwrap();
        assert_eq!((info.src_port, info.dst_port), (5000, 80));
        let e = icmpv4_echo(77, 1, b"ping");
        let info = PacketInfo::parse(&ipv4(A4, B4, proto::ICMP, 64, &e)).unwrap();
        assert_eq!((info.icmp, info.src_port), (Some((8, 0)), 77));
    }

    #[test]
    fn ipv6_with_extension_headers_and_fragments() {
        let u = udp(a6().into(), b6().into(), 1, 2, b"xy");
        // Hop-by-hop (8 bytes) then destination options (16 bytes) then UDP.
        let mut payload = vec![proto::DEST_OPTS, 0, 1, 4, 0, 0, 0, 0];
        payload.extend_from_slice(&[proto::UDP, 1, 1, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        payload.extend_from_slice(&u);
        let info = PacketInfo::parse(&ipv6(a6(), b6(), proto::HOP_BY_HOP, 9, &payload)).unwrap();
        assert_eq!((info.version, info.protocol, info.l4_offset, info.src_port), (6, 17, 64, 1));
        // A non-first fragment: no ports.
        let mut frag = vec![proto::UDP, 0, 0, 16 | 1, 0, 0, 0, 9];
        frag.extend_from_slice(&[0; 16]);
        let info = PacketInfo::parse(&ipv6(a6(), b6(), proto::FRAGMENT, 9, &frag)).unwrap();
        let f = info.fragment.unwrap();
        assert_eq!((f.offset, f.more, f.id, f.data_offset), (16, true, 9, 48));
        assert_eq!(info.src_port, 0);
        // A later fragment whose next header names an extension header: its data is not walked as headers.
        let mut frag = vec![proto::DEST_OPTS, 0, 0, 16 | 1, 0, 0, 0, 9];
        frag.extend_from_slice(&[0xff; 16]);
        let info = PacketInfo::parse(&ipv6(a6(), b6(), proto::FRAGMENT, 9, &frag)).unwrap();
        assert_eq!((info.protocol, info.l4_offset), (proto::DEST_OPTS, 48));
    }

    #[test]
    fn malformed_packets_give_reasons() {
        let good = ipv4(A4, B4, proto::UDP, 64, &udp(A4.into(), B4.into(), 1, 2, b""));
        assert_eq!(PacketInfo::parse(&[]), Err(ParseError::Truncated));
        assert_eq!(PacketInfo::parse(&good[..19]), Err(ParseError::Truncated));
        // One byte of the good packet changed: (where, to what, the reason).
        for (at, byte, reason) in [
            (0, 0x44, ParseError::BadHeaderLength),
            (0, 0x4f, ParseError::BadHeaderLength),
            (3, 200, ParseError::BadTotalLength),
            (8, 1, ParseError::BadChecksum),
            (0, 0x55, ParseError::BadVersion),
        ] {
            let mut bad = good.clone();
            bad[at] = byte;
            assert_eq!(PacketInfo::parse(&bad), Err(reason), "byte {at} = {byte:#x}");
        }
        let short = ipv4(A4, B4, proto::TCP, 64, &[0; 10]);
        assert_eq!(PacketInfo::parse(&short), Err(ParseError::TruncatedTransport));
        // An extension header running past the end, and an endless chain.
        assert_eq!(
            PacketInfo::parse(&ipv6(a6(), b6(), proto::HOP_BY_HOP, 1, &[proto::UDP, 5, 0, 0, 0, 0, 0, 0])),
            Err(ParseError::BadExtensionHeader)
        );
        let chain: Vec<u8> = (0..10).flat_map(|_| [proto::DEST_OPTS, 0, 1, 4, 0, 0, 0, 0]).collect();
        assert_eq!(
            PacketInfo::parse(&ipv6(a6(), b6(), proto::DEST_OPTS, 1, &chain)),
            Err(ParseError::BadExtensionHeader)
        );
    }
}
