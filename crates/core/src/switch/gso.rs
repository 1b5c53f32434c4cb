//! Cutting GSO super-packets ([`MetaKey::GSO`]) into their on-wire segments, as the kernel's segmentation does
//! (tcp_gso_segment, __udp_gso_segment): the switch does it before a module that does not take super-packets
//! whole ([`crate::ModuleInterface::accepts_gso`]), a face before a device that cannot take them.
//!
//! Each segment is the super-packet's first `hdr_len` bytes followed by its share of the payload, with the IP
//! length fields (IPv4 total length, IPv6 payload length) and the IPv4 identification (+1 per segment) and header
//! checksum adjusted; TCP segments get their sequence numbers, FIN and PSH on the last segment only and CWR on the
//! first only; UDP segments their length; and every segment a complete transport checksum (the super-packet's own
//! checksum field is not read: it may hold the pseudo-header sum only).

use crate::frame::{Batch, Frame, Gso, GsoKind, MetaKey, Packet, PacketPool};

/// One's-complement sum of `data` as 16-bit big-endian words (an odd last byte padded with zero), added to
/// `initial`; not folded to 16 bits. The bytes are summed as native-endian 32-bit words into a 64-bit accumulator
/// (which the compiler vectorizes), then folded and byte-swapped (RFC 1071 section 2: the sum does not depend on
/// the byte order, up to a swap). `flexstack_wire::checksum` builds on it.
pub fn ones_complement_sum(initial: u32, data: &[u8]) -> u32 {
    let mut acc: u64 = 0;
    let mut words = data.chunks_exact(4);
    for w in &mut words {
        acc += u64::from(u32::from_ne_bytes([w[0], w[1], w[2], w[3]]));
    }
    let mut tail = [0u8; 4];
    let rest = words.remainder();
    tail[..rest.len()].copy_from_slice(rest);
    acc += u64::from(u32::from_ne_bytes(tail));
    let mut folded = fold64(acc);
    while folded > 0xffff {
        folded = (folded & 0xffff) + (folded >> 16);
    }
    let be = u16::from_be_bytes((folded as u16).to_ne_bytes());
    fold64(u64::from(initial) + u64::from(be))
}

/// Folds a 64-bit one's-complement accumulator to 32 bits.
pub fn fold64(mut acc: u64) -> u32 {
    while acc > 0xffff_ffff {
        acc = (acc & 0xffff_ffff) + (acc >> 32);
    }
    acc as u32
}

/// The checksum to store for a sum: folded to 16 bits and complemented.
fn finish(sum: u32) -> u16 {
    let mut s = sum;
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

impl Gso {
    /// True if `data` is laid out as the description says: an IP header of the kind's version at `l3_offset`, the
    /// transport header at `csum_start` within the first `hdr_len` bytes, and a segment size.
    pub fn matches(&self, data: &[u8]) -> bool {
        let (l3, start, hdr) = (usize::from(self.l3_offset), usize::from(self.csum_start), usize::from(self.hdr_len));
        let Some(&first) = data.get(l3) else { return false };
        let ip_len = match first >> 4 {
            4 => usize::from(first & 0x0f) * 4,
            6 => 40,
            _ => return false,
        };
        let version_ok = match self.kind {
            GsoKind::TcpV4 => first >> 4 == 4,
            GsoKind::TcpV6 => first >> 4 == 6,
            GsoKind::UdpL4 => true,
        };
        let transport = match self.kind {
            GsoKind::TcpV4 | GsoKind::TcpV6 => 20,
            GsoKind::UdpL4 => 8,
        };
        version_ok
            && self.gso_size > 0
            && ip_len >= 20
            && start >= l3 + ip_len
            && start + transport <= hdr
            && hdr <= data.len()
    }

    /// Writes segment `index` (of [`Gso::segments`]) of super-packet `data` into `into` (cleared first). `data`
    /// must match the description ([`Gso::matches`]).
    pub fn segment_into(&self, data: &[u8], index: usize, into: &mut Vec<u8>) {
        let (l3, start, hdr) = (usize::from(self.l3_offset), usize::from(self.csum_start), usize::from(self.hdr_len));
        let size = usize::from(self.gso_size);
        let from = (hdr + index * size).min(data.len());
        let to = (from + size).min(data.len());
        let last = index + 1 >= self.segments(data.len());
        into.clear();
        into.extend_from_slice(&data[..hdr]);
        into.extend_from_slice(&data[from..to]);
        let put16 = |b: &mut [u8], at: usize, v: u16| b[at..at + 2].copy_from_slice(&v.to_be_bytes());
        let get16 = |b: &[u8], at: usize| u16::from_be_bytes([b[at], b[at + 1]]);
        let len = into.len();
        // The IP header, and the addresses for the pseudo-header.
        let v4 = into[l3] >> 4 == 4;
        let addresses = if v4 {
            let ihl = usize::from(into[l3] & 0x0f) * 4;
            put16(into, l3 + 2, (len - l3) as u16);
            let id = get16(into, l3 + 4).wrapping_add(index as u16);
            put16(into, l3 + 4, id);
            put16(into, l3 + 10, 0);
            let c = finish(ones_complement_sum(0, &into[l3..l3 + ihl]));
            put16(into, l3 + 10, c);
            l3 + 12..l3 + 20
        } else {
            put16(into, l3 + 4, (len - l3 - 40) as u16);
            l3 + 8..l3 + 40
        };
        let transport_len = len - start;
        match self.kind {
            GsoKind::TcpV4 | GsoKind::TcpV6 => {
                let seq = u32::from_be_bytes([into[start + 4], into[start + 5], into[start + 6], into[start + 7]]);
                let seq = seq.wrapping_add((index * size) as u32);
                into[start + 4..start + 8].copy_from_slice(&seq.to_be_bytes());
                // FIN and PSH on the last segment only, CWR on the first only.
                if !last {
                    into[start + 13] &= !0x09;
                }
                if index > 0 {
                    into[start + 13] &= !0x80;
                }
            }
            GsoKind::UdpL4 => put16(into, start + 4, transport_len as u16),
        }
        let field = start + usize::from(self.kind.csum_offset());
        put16(into, field, 0);
        let mut sum = ones_complement_sum(0, &into[addresses]);
        sum = ones_complement_sum(sum, &[0, self.kind.protocol()]);
        sum = ones_complement_sum(sum, &(transport_len as u32).to_be_bytes());
        let mut c = finish(ones_complement_sum(sum, &into[start..]));
        if self.kind == GsoKind::UdpL4 && c == 0 {
            c = 0xffff;
        }
        put16(into, field, c);
    }
}

/// Cuts GSO super-packet `p` (described by `gso`) into its segments and appends them to `out`: packets from
/// `pool` with the direction and metadata of `p`, but neither [`MetaKey::GSO`] nor [`MetaKey::CSUM_PARTIAL`] (their
/// checksums are complete). Returns the number of segments, or `None` (nothing appended) if `p` does not match
/// `gso` ([`Gso::matches`]).
pub fn segment_packet(pool: &PacketPool, p: &Packet, gso: &Gso, out: &mut Batch) -> Option<usize> {
    let data = p.data();
    if !gso.matches(data) {
        return None;
    }
    let mut meta = *p.meta();
    meta.remove(MetaKey::GSO);
    meta.remove(MetaKey::CSUM_PARTIAL);
    let n = gso.segments(data.len());
    for i in 0..n {
        let mut s = pool.alloc_for_overwrite();
        gso.segment_into(data, i, s.make_mut());
        s.set_direction(p.direction());
        *s.meta_mut() = meta;
        out.push(Frame::Data(s));
    }
    Some(n)
}

/// What [`segment_batch`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Segmented {
    /// Super-packets cut into segments.
    pub cut: u64,
    /// Super-packets that did not match their description: left whole, without [`MetaKey::GSO`].
    pub mismatched: u64,
}

/// Replaces every GSO super-packet in `batch` by its segments, in place and in order ([`segment_packet`]); a
/// super-packet that does not match its description stays whole and loses its [`MetaKey::GSO`] (it then travels
/// as one long packet). A batch without super-packets is left as it is, without copying.
pub fn segment_batch(pool: &PacketPool, batch: &mut Batch) -> Segmented {
    let mut done = Segmented::default();
    let gso_of = |f: &Frame| match f {
        Frame::Data(p) => p.meta().get(MetaKey::GSO).and_then(Gso::unpack),
        Frame::Control(_) => None,
    };
    if !batch.iter().any(|f| gso_of(f).is_some()) {
        return done;
    }
    let frames = std::mem::take(batch);
    for f in frames {
        match (gso_of(&f), f) {
            (Some(gso), Frame::Data(mut p)) => {
                if segment_packet(pool, &p, &gso, batch).is_some() {
                    done.cut += 1;
                } else {
                    done.mismatched += 1;
                    p.meta_mut().remove(MetaKey::GSO);
                    batch.push(Frame::Data(p));
                }
            }
            (_, f) => batch.push(f),
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An IPv4 TCP super-packet (ECN, FIN|PSH|CWR) of `payload` bytes, segments of `mss`.
    fn tcp4(payload: usize, mss: u16) -> (Vec<u8>, Gso) {
        let mut d = vec![0u8; 40 + payload];
        d[0] = 0x45;
        d[2..4].copy_from_slice(&((40 + payload) as u16).to_be_bytes());
        d[4..6].copy_from_slice(&0xfffeu16.to_be_bytes());
        d[8] = 64;
        d[9] = 6;
        d[12..16].copy_from_slice(&[10, 0, 0, 1]);
        d[16..20].copy_from_slice(&[10, 0, 0, 2]);
        d[24..28].copy_from_slice(&0xffff_fff0u32.to_be_bytes());
        d[32] = 5 << 4;
        d[33] = 0x80 | 0x08 | 0x10 | 0x01;
        for (i, b) in d[40..].iter_mut().enumerate() {
            *b = (i * 13 + 1) as u8;
        }
        let gso = Gso { kind: GsoKind::TcpV4, gso_size: mss, hdr_len: 40, csum_start: 20, l3_offset: 0, ecn: true };
        (d, gso)
    }

    fn verify(sum: u32, data: &[u8]) -> bool {
        finish(ones_complement_sum(sum, data)) == 0
    }

    #[test]
    fn segments_carry_their_share_with_headers_and_checksums_adjusted() {
        let (d, gso) = tcp4(3000, 1400);
        assert!(gso.matches(&d));
        assert_eq!(gso.segments(d.len()), 3);
        let mut s = Vec::new();
        let mut payload = Vec::new();
        for i in 0..3 {
            gso.segment_into(&d, i, &mut s);
            let len = [1440, 1440, 240][i];
            assert_eq!(s.len(), len, "segment {i}");
            assert_eq!(u16::from_be_bytes([s[2], s[3]]) as usize, len);
            assert_eq!(u16::from_be_bytes([s[4], s[5]]), 0xfffeu16.wrapping_add(i as u16), "IPv4 id");
            assert!(verify(0, &s[..20]), "IPv4 header checksum of segment {i}");
            let seq = u32::from_be_bytes([s[24], s[25], s[26], s[27]]);
            assert_eq!(seq, 0xffff_fff0u32.wrapping_add(1400 * i as u32));
            let flags = s[33];
            assert_eq!(flags & 0x80 != 0, i == 0, "CWR on the first only");
            assert_eq!(flags & 0x09 != 0, i == 2, "FIN and PSH on the last only");
            assert!(flags & 0x10 != 0, "ACK on all");
            let pseudo = ones_complement_sum(0, &s[12..20]);
            let pseudo = ones_complement_sum(pseudo, &[0, 6]);
            let pseudo = ones_complement_sum(pseudo, &((len - 20) as u32).to_be_bytes());
            assert!(verify(pseudo, &s[20..]), "TCP checksum of segment {i}");
            payload.extend_from_slice(&s[40..]);
        }
        assert_eq!(payload, d[40..], "the payload, in order");
    }

    #[test]
    fn a_batch_has_its_super_packets_cut_in_place_and_mismatches_left_whole() {
        let pool = PacketPool::default();
        let (d, gso) = tcp4(2000, 1000);
        let mut p = pool.alloc_from(&d);
        p.meta_mut().set(MetaKey::GSO, gso.pack());
        p.meta_mut().set(MetaKey::FLOW_ID, 7);
        let mut bad = pool.alloc_from(&d[..30]);
        bad.meta_mut().set(MetaKey::GSO, gso.pack());
        let plain = pool.alloc_from(&[0x45, 0, 0, 20]);
        let mut batch = vec![Frame::Data(plain), Frame::Data(p), Frame::Data(bad)];
        assert_eq!(segment_batch(&pool, &mut batch), Segmented { cut: 1, mismatched: 1 });
        let lens: Vec<usize> = batch.iter().map(Frame::len).collect();
        assert_eq!(lens, [4, 1040, 1040, 30]);
        for f in &batch {
            let Frame::Data(p) = f else { panic!("data") };
            assert_eq!(p.meta().get(MetaKey::GSO), None);
        }
        let Frame::Data(first) = &batch[1] else { panic!("data") };
        assert_eq!(first.meta().get(MetaKey::FLOW_ID), Some(7), "the other metadata is kept");
        // No super-packet: nothing changes.
        assert_eq!(segment_batch(&pool, &mut batch), Segmented::default());
        assert_eq!(batch.len(), 4);
    }

    #[test]
    fn udp_segments_get_their_length_and_ipv6_its_payload_length() {
        let mut d = vec![0u8; 48 + 2500];
        d[0] = 0x60;
        d[6] = 17;
        d[8..24].copy_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        d[24..40].copy_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
        let gso = Gso { kind: GsoKind::UdpL4, gso_size: 1200, hdr_len: 48, csum_start: 40, l3_offset: 0, ecn: false };
        let mut s = Vec::new();
        gso.segment_into(&d, 2, &mut s);
        assert_eq!(s.len(), 48 + 100);
        assert_eq!(u16::from_be_bytes([s[4], s[5]]), 108, "IPv6 payload length");
        assert_eq!(u16::from_be_bytes([s[44], s[45]]), 108, "UDP length");
        let pseudo = ones_complement_sum(ones_complement_sum(0, &s[8..40]), &[0, 17]);
        assert!(verify(ones_complement_sum(pseudo, &108u32.to_be_bytes()), &s[40..]));
        // TCPv4 claimed for IPv6, and headers past the end, do not match.
        assert!(!Gso { kind: GsoKind::TcpV4, ..gso }.matches(&d));
        assert!(!gso.matches(&d[..47]));
    }
}
