//! The virtio-net header (`virtio_net_hdr`) a packet socket with PACKET_VNET_HDR puts before each frame: read
//! into a frame's metadata (a checksum left to offload, [`MetaKey::CSUM_PARTIAL`]; a GSO super-frame,
//! [`MetaKey::GSO`]) and written back for a frame that carries them. Byte handling only: the socket is the faces
//! crate's.
//!
//! [`MetaKey::CSUM_PARTIAL`]: flexstack_core::frame::MetaKey::CSUM_PARTIAL
//! [`MetaKey::GSO`]: flexstack_core::frame::MetaKey::GSO

use flexstack_core::frame::{CsumPartial, Gso, GsoKind};

/// Length of the `virtio_net_hdr` before each frame on a packet socket with PACKET_VNET_HDR.
pub const VNET_HDR_LEN: usize = 10;
/// `virtio_net_hdr` flag: the checksum at csum_start + csum_offset holds only the pseudo-header sum.
pub const VNET_F_NEEDS_CSUM: u8 = 1;
/// `virtio_net_hdr` gso_type bit: TCP with ECN (CWR kept on the first segment only).
pub const VNET_GSO_ECN: u8 = 0x80;

/// A `virtio_net_hdr` as read from a packet socket (little-endian fields, as PACKET_VNET_HDR uses them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VnetHeader {
    /// Flags: [`VNET_F_NEEDS_CSUM`].
    pub flags: u8,
    /// The GSO type (`VIRTIO_NET_HDR_GSO_*`, with [`VNET_GSO_ECN`]); 0 for a frame that is not a super-frame.
    pub gso_type: u8,
    /// The segment size of a super-frame (payload bytes per segment).
    pub gso_size: u16,
    /// Where the checksummed part starts, from the frame's start.
    pub csum_start: u16,
    /// Where the checksum field is, from `csum_start`.
    pub csum_offset: u16,
}

impl VnetHeader {
    /// The header in its 10 bytes on the wire.
    pub fn decode(b: &[u8; VNET_HDR_LEN]) -> VnetHeader {
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        // b[2..4] is hdr_len: on receive the kernel puts the length of the linear part there, not the headers'
        // length, so it is worked out from the frame instead (see `gso`).
        VnetHeader { flags: b[0], gso_type: b[1], gso_size: u16_at(4), csum_start: u16_at(6), csum_offset: u16_at(8) }
    }

    /// Where the transport checksum the frame's sender left to offload is (csum_start and csum_offset count from
    /// the frame's start); `None` when the checksum is complete, or the field lies beyond a frame of `len` bytes.
    pub fn partial_checksum(&self, len: usize) -> Option<CsumPartial> {
        let partial = CsumPartial { start: self.csum_start, offset: self.csum_offset };
        (self.flags & VNET_F_NEEDS_CSUM != 0 && partial.field() + 2 <= len).then_some(partial)
    }

    /// The GSO description of `frame` if the header says it is a super-frame of a kind flexstack carries
    /// (TCPv4, TCPv6, UDP_L4) and its headers are where the header says; `None` otherwise (the frame then travels
    /// as one long packet, as any other).
    pub fn gso(&self, frame: &[u8]) -> Option<Gso> {
        self.gso_at(frame, l3_offset(frame)?)
    }

    /// As [`VnetHeader::gso`], for a packet whose IP header starts at `l3` (0 for an IP packet from a TUN device).
    pub fn gso_at(&self, frame: &[u8], l3: usize) -> Option<Gso> {
        let kind = GsoKind::from_virtio_type(self.gso_type)?;
        if self.gso_size == 0 || self.flags & VNET_F_NEEDS_CSUM == 0 || self.csum_offset != kind.csum_offset() {
            return None;
        }
        let start = usize::from(self.csum_start);
        let transport = match kind {
            GsoKind::UdpL4 => 8,
            GsoKind::TcpV4 | GsoKind::TcpV6 => usize::from(*frame.get(start + 12)? >> 4) * 4,
        };
        let version = frame.get(l3)? >> 4;
        let ip_ok = match kind {
            GsoKind::TcpV4 => version == 4,
            GsoKind::TcpV6 => version == 6,
            GsoKind::UdpL4 => version == 4 || version == 6,
        };
        let hdr_len = start + transport;
        if !ip_ok || start < l3 + 20 || transport < 8 || hdr_len > frame.len() {
            return None;
        }
        Some(Gso {
            kind,
            gso_size: self.gso_size,
            hdr_len: hdr_len as u16,
            csum_start: self.csum_start,
            l3_offset: u8::try_from(l3).ok()?,
            ecn: self.gso_type & VNET_GSO_ECN != 0,
        })
    }
}

/// Where the IP header of an Ethernet frame starts (behind up to two VLAN tags); `None` if it is not IP.
pub fn l3_offset(frame: &[u8]) -> Option<usize> {
    let mut at = 12;
    loop {
        let ethertype = u16::from_be_bytes([*frame.get(at)?, *frame.get(at + 1)?]);
        match ethertype {
            0x8100 | 0x88a8 if at < 20 => at += 4,
            0x0800 | 0x86dd => return Some(at + 2),
            _ => return None,
        }
    }
}

/// How a GSO super-frame is written: the virtio_net_hdr to put before it, and the checksum field to replace.
#[derive(Debug, PartialEq, Eq)]
pub struct GsoWrite {
    /// The virtio_net_hdr to write before the frame.
    pub header: [u8; VNET_HDR_LEN],
    /// Offset of the transport checksum field in the frame.
    pub field: usize,
    /// What the kernel expects in that field: the pseudo-header sum (addresses, protocol, the super-frame's whole
    /// transport length), folded and not complemented, as Linux's CHECKSUM_PARTIAL; the kernel's segmentation
    /// adjusts it per segment (tcp_gso_segment, __udp_gso_segment) and completes it.
    pub field_value: [u8; 2],
}

/// The parts of a GSO write of `frame` described by `gso`; `None` when the frame fits in one segment or does not
/// match the description (it is then written as an ordinary frame, its checksums complete).
pub fn gso_write_parts(frame: &[u8], gso: &Gso) -> Option<GsoWrite> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let (start, hdr_len, l3) = (usize::from(gso.csum_start), usize::from(gso.hdr_len), usize::from(gso.l3_offset));
    let field = start + usize::from(gso.kind.csum_offset());
    if frame.len() <= hdr_len + usize::from(gso.gso_size) || field + 2 > hdr_len || hdr_len > frame.len() {
        return None;
    }
    let ip = frame.get(l3..start)?;
    let (src, dst) = match ip.first()? >> 4 {
        4 if ip.len() >= 20 => (
            IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(&ip[12..16]).ok()?)),
            IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(&ip[16..20]).ok()?)),
        ),
        6 if ip.len() >= 40 => (
            IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).ok()?)),
            IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&ip[24..40]).ok()?)),
        ),
        _ => return None,
    };
    let sum = crate::checksum::pseudo_header(src, dst, gso.kind.protocol(), (frame.len() - start) as u32);
    let field_value = (!crate::checksum::finish(sum)).to_be_bytes();
    let mut header = [0u8; VNET_HDR_LEN];
    header[0] = VNET_F_NEEDS_CSUM;
    header[1] = gso.kind.virtio_type() | if gso.ecn { VNET_GSO_ECN } else { 0 };
    header[2..4].copy_from_slice(&gso.hdr_len.to_le_bytes());
    header[4..6].copy_from_slice(&gso.gso_size.to_le_bytes());
    header[6..8].copy_from_slice(&gso.csum_start.to_le_bytes());
    header[8..10].copy_from_slice(&gso.kind.csum_offset().to_le_bytes());
    Some(GsoWrite { header, field, field_value })
}

/// The virtio_net_hdr of a frame of `len` bytes written whole with its partial checksum `partial` (NEEDS_CSUM:
/// the kernel, or the receiver's offloads, complete it); `None` if the field lies beyond the frame (it is then
/// written as it is, with a zero header).
pub fn partial_write_header(len: usize, partial: CsumPartial) -> Option<[u8; VNET_HDR_LEN]> {
    if partial.field() + 2 > len {
        return None;
    }
    let mut header = [0u8; VNET_HDR_LEN];
    header[0] = VNET_F_NEEDS_CSUM;
    header[6..8].copy_from_slice(&partial.start.to_le_bytes());
    header[8..10].copy_from_slice(&partial.offset.to_le_bytes());
    Some(header)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum;

    /// An Ethernet frame with one VLAN tag, IPv6 and TCP (32-byte header: 12 bytes of options) carrying
    /// `payload` bytes, its TCP checksum complete.
    fn tcp6_vlan_frame(payload: usize) -> Vec<u8> {
        let mut f = vec![0u8; 18 + 40 + 32 + payload];
        f[12..14].copy_from_slice(&0x8100u16.to_be_bytes());
        f[16..18].copy_from_slice(&0x86ddu16.to_be_bytes());
        f[18] = 0x60;
        f[22..24].copy_from_slice(&((32 + payload) as u16).to_be_bytes());
        f[24] = 6;
        f[25] = 64;
        f[26..42].copy_from_slice(&"fd00::1".parse::<std::net::Ipv6Addr>().unwrap().octets());
        f[42..58].copy_from_slice(&"fd00::2".parse::<std::net::Ipv6Addr>().unwrap().octets());
        f[58 + 12] = 8 << 4;
        for (i, b) in f[90..].iter_mut().enumerate() {
            *b = (i * 7) as u8;
        }
        let (src, dst) = (ip6(&f[26..42]), ip6(&f[42..58]));
        let sum = checksum::pseudo_header(src, dst, 6, (f.len() - 58) as u32);
        let c = checksum::finish(checksum::sum(sum, &f[58..]));
        f[58 + 16..58 + 18].copy_from_slice(&c.to_be_bytes());
        f
    }

    fn ip6(b: &[u8]) -> std::net::IpAddr {
        std::net::IpAddr::from(<[u8; 16]>::try_from(b).unwrap())
    }

    fn vnet(flags: u8, gso_type: u8, gso_size: u16, csum_start: u16, csum_offset: u16) -> VnetHeader {
        VnetHeader { flags, gso_type, gso_size, csum_start, csum_offset }
    }

    #[test]
    fn a_gso_header_becomes_the_gso_key_with_the_header_length_taken_from_the_frame() {
        let f = tcp6_vlan_frame(5000);
        let h = vnet(VNET_F_NEEDS_CSUM, 4 | VNET_GSO_ECN, 1428, 58, 16);
        let g = h.gso(&f).expect("a TCPv6 super-frame");
        assert_eq!(
            g,
            Gso { kind: GsoKind::TcpV6, gso_size: 1428, hdr_len: 90, csum_start: 58, l3_offset: 18, ecn: true }
        );
        // Not carried: no GSO, UFO (3), a zero segment size, a checksum offset that is not TCP's, IPv4 claimed for
        // an IPv6 packet, no NEEDS_CSUM.
        assert_eq!(vnet(VNET_F_NEEDS_CSUM, 0, 1428, 58, 16).gso(&f), None);
        assert_eq!(vnet(VNET_F_NEEDS_CSUM, 3, 1428, 58, 6).gso(&f), None);
        assert_eq!(vnet(VNET_F_NEEDS_CSUM, 4, 0, 58, 16).gso(&f), None);
        assert_eq!(vnet(VNET_F_NEEDS_CSUM, 4, 1428, 58, 6).gso(&f), None);
        assert_eq!(vnet(VNET_F_NEEDS_CSUM, 1, 1428, 58, 16).gso(&f), None);
        assert_eq!(vnet(0, 4, 1428, 58, 16).gso(&f), None);
        // A transport header that runs past the frame.
        assert_eq!(vnet(VNET_F_NEEDS_CSUM, 4, 1428, 58, 16).gso(&f[..80]), None);
    }

    #[test]
    fn a_gso_write_puts_the_pseudo_header_sum_in_the_checksum_field() {
        // An odd length: the last byte counts as the high byte of a word.
        let f = tcp6_vlan_frame(5001);
        let complete = u16::from_be_bytes([f[74], f[75]]);
        let g = Gso { kind: GsoKind::TcpV6, gso_size: 1428, hdr_len: 90, csum_start: 58, l3_offset: 18, ecn: false };
        let w = gso_write_parts(&f, &g).expect("a GSO write");
        assert_eq!(w.field, 74);
        assert_eq!(w.header, [VNET_F_NEEDS_CSUM, 4, 90, 0, 0x94, 0x05, 58, 0, 16, 0]);
        // What the kernel does with it, and what the read path does with a NEEDS_CSUM frame: sum from csum_start
        // with the field in place gives back the complete checksum.
        let mut partial = f.clone();
        partial[74..76].copy_from_slice(&w.field_value);
        let pseudo = checksum::pseudo_header(ip6(&f[26..42]), ip6(&f[42..58]), 6, (f.len() - 58) as u32);
        assert_eq!(u16::from_be_bytes(w.field_value), !checksum::finish(pseudo));
        let read = vnet(VNET_F_NEEDS_CSUM, 4, 1428, 58, 16).partial_checksum(partial.len()).expect("partial");
        assert!(checksum::complete_partial_bytes(&mut partial, read));
        assert_eq!(u16::from_be_bytes([partial[74], partial[75]]), complete);
        assert_eq!(partial, f);

        // One segment's worth is written as an ordinary frame; so is a frame that does not match the key.
        assert_eq!(gso_write_parts(&tcp6_vlan_frame(1428), &g), None);
        assert_eq!(gso_write_parts(&f[..85], &g), None);
        let mut v4 = f.clone();
        v4[18] = 0x45;
        assert!(gso_write_parts(&v4, &g).is_some_and(|w| w.field_value != gso_write_parts(&f, &g).unwrap().field_value));
        v4[18] = 0x75;
        assert_eq!(gso_write_parts(&v4, &g), None);
    }

    #[test]
    fn a_partial_checksum_is_read_into_the_key_and_written_back_with_needs_csum() {
        let f = tcp6_vlan_frame(100);
        // Read: NEEDS_CSUM gives where the field is; no flag, or a field beyond the frame, gives none.
        let partial = vnet(VNET_F_NEEDS_CSUM, 0, 0, 58, 16).partial_checksum(f.len());
        assert_eq!(partial, Some(CsumPartial { start: 58, offset: 16 }));
        assert_eq!(vnet(0, 0, 0, 58, 16).partial_checksum(f.len()), None);
        assert_eq!(vnet(VNET_F_NEEDS_CSUM, 0, 0, 58, 16).partial_checksum(75), None);
        // Write: the same place in a NEEDS_CSUM header, no GSO.
        let header = partial_write_header(f.len(), partial.unwrap()).expect("a header");
        assert_eq!(header, [VNET_F_NEEDS_CSUM, 0, 0, 0, 0, 0, 58, 0, 16, 0]);
        assert_eq!(VnetHeader::decode(&header).partial_checksum(f.len()), partial, "read back the same");
        assert_eq!(partial_write_header(75, partial.unwrap()), None);
    }

    #[test]
    fn the_ip_header_is_found_behind_up_to_two_vlan_tags() {
        let mut f = vec![0u8; 40];
        f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        assert_eq!(l3_offset(&f), Some(14));
        f[12..14].copy_from_slice(&0x88a8u16.to_be_bytes());
        f[16..18].copy_from_slice(&0x8100u16.to_be_bytes());
        f[20..22].copy_from_slice(&0x86ddu16.to_be_bytes());
        assert_eq!(l3_offset(&f), Some(22));
        f[20..22].copy_from_slice(&0x0806u16.to_be_bytes());
        assert_eq!(l3_offset(&f), None, "ARP is not IP");
        assert_eq!(l3_offset(&f[..13]), None);
    }
}
