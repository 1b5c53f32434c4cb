//! Internet checksums (RFC 1071) and their incremental update (RFC 1624), for IPv4 headers and the TCP, UDP and
//! ICMP checksums over IPv4 and IPv6 pseudo-headers.
//!
//! Full computation: [`sum`] the bytes (and a [`pseudo_header`]), then [`finish`]. After rewriting a field (NAT),
//! [`update`] adjusts an existing checksum from the old and new bytes of that field alone. A packet whose
//! transport checksum is still partial (`MetaKey::CSUM_PARTIAL`, from a link face) is completed with
//! [`complete_partial`] by the modules that need complete checksums (see the key's documentation for the rule).

use flexstack_core::frame::{CsumPartial, MetaKey};
use flexstack_core::Packet;
use std::net::IpAddr;

/// One's-complement sum of `data` as 16-bit big-endian words (an odd last byte is padded with zero), added to
/// `initial`. Not folded: pass the result to [`finish`].
///
/// The bytes are summed as native-endian 32-bit words into a 64-bit accumulator (which the compiler vectorizes)
/// and the result folded and byte-swapped (RFC 1071 section 2: the sum does not depend on the byte order, up to
/// a swap): a 64 KiB GSO frame is summed at memory speed rather than 16 bits at a time.
pub fn sum(initial: u32, data: &[u8]) -> u32 {
    // The switch cuts GSO super-packets with the same sum: it lives in the core crate, below this one.
    flexstack_core::switch::ones_complement_sum(initial, data)
}

/// Completes the partial transport checksum of `packet` (`MetaKey::CSUM_PARTIAL`: the field holds the
/// pseudo-header sum) and removes the key; true if there was one to complete. A packet without the key is left
/// alone (it is not copied); one whose field lies beyond its end only loses the key.
pub fn complete_partial(packet: &mut Packet) -> bool {
    let Some(partial) = CsumPartial::of(packet.meta()) else { return false };
    packet.meta_mut().remove(MetaKey::CSUM_PARTIAL);
    complete_partial_bytes(packet.data_mut(), partial)
}

/// Completes the partial transport checksum described by `partial` in `data`: the checksum field, which holds the
/// pseudo-header sum, becomes the complement of the sum of every byte from `partial.start` on. False (nothing
/// changed) if the field lies beyond the data.
///
/// A result of zero is stored as 0xffff ([`finish_transport`]): a datagram whose sum came out zero would otherwise
/// be dropped as invalid.
pub fn complete_partial_bytes(data: &mut [u8], partial: CsumPartial) -> bool {
    let (start, field) = (usize::from(partial.start), partial.field());
    if field + 2 > data.len() {
        return false;
    }
    let c = finish_transport(sum(0, &data[start..]));
    data[field..field + 2].copy_from_slice(&c.to_be_bytes());
    true
}

/// Folds a sum to 16 bits and complements it: the checksum to store.
pub fn finish(sum: u32) -> u16 {
    !fold(sum)
}

/// [`finish`] for a transport checksum: a result of zero is stored as 0xffff, its one's-complement equal, as the
/// kernel does (a UDP checksum of zero means "none", which IPv6 forbids).
pub fn finish_transport(sum: u32) -> u16 {
    match finish(sum) {
        0 => 0xffff,
        c => c,
    }
}

/// Folds a sum to 16 bits, not complemented (what an ICMP error's checksum changes by when the packet it quotes
/// changes).
pub fn fold(sum: u32) -> u16 {
    let mut s = sum;
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// Sum of the pseudo-header for a transport checksum: addresses, protocol and transport length (IPv4 and IPv6).
pub fn pseudo_header(src: IpAddr, dst: IpAddr, protocol: u8, length: u32) -> u32 {
    let mut s = 0;
    match (src, dst) {
        (IpAddr::V4(a), IpAddr::V4(b)) => {
            s = sum(s, &a.octets());
            s = sum(s, &b.octets());
        }
        (a, b) => {
            let v6 = |x: IpAddr| match x {
                IpAddr::V6(v) => v.octets(),
                IpAddr::V4(v) => v.to_ipv6_mapped().octets(),
            };
            s = sum(s, &v6(a));
            s = sum(s, &v6(b));
        }
    }
    s = sum(s, &[0, protocol]);
    sum(s, &length.to_be_bytes())
}

/// RFC 1624 eqn. 3: the checksum `old_checksum` updated for a field whose bytes change from `old` to `new`
/// (equal lengths, even offset within the summed data).
pub fn update(old_checksum: u16, old: &[u8], new: &[u8]) -> u16 {
    debug_assert_eq!(old.len(), new.len());
    // HC' = ~(~HC + ~m + m'), with ~m summed as the complement of each word.
    let mut s = u32::from(!old_checksum);
    let mut chunks = old.chunks_exact(2);
    for c in &mut chunks {
        s += u32::from(!u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        s += u32::from(!(u16::from(*last) << 8));
    }
    s = sum(s, new);
    finish(s)
}

/// Checksum of an IPv4 header (its checksum field must be zero, or use [`verify`]).
pub fn ipv4_header(header: &[u8]) -> u16 {
    finish(sum(0, header))
}

/// True if data that includes its own checksum field sums to all ones (the checksum is right).
pub fn verify(initial: u32, data: &[u8]) -> bool {
    finish(sum(initial, data)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    #[test]
    fn rfc1071_example() {
        // RFC 1071 section 3 example: 00 01 f2 03 f4 f5 f6 f7 sums to ddf2.
        let s = sum(0, &[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]);
        assert_eq!(finish(s), !0xddf2);
    }

    #[test]
    fn ipv4_header_checksum_verifies() {
        let mut h = [0x45, 0, 0, 0x54, 0x12, 0x34, 0x40, 0, 64, 1, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2];
        let c = ipv4_header(&h);
        h[10..12].copy_from_slice(&c.to_be_bytes());
        assert!(verify(0, &h));
        h[8] = 63;
        assert!(!verify(0, &h));
    }

    #[test]
    fn incremental_update_equals_recomputation() {
        let mut rng = 0x1234_5678_u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for _ in 0..2000 {
            let len = 8 + (next() % 60) as usize * 2;
            let mut data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            data[0] = 0;
            data[1] = 0;
            let c = finish(sum(0, &data));
            let at = 2 + (next() as usize % ((len - 6) / 2)) * 2;
            let old = data[at..at + 4].to_vec();
            let new: Vec<u8> = (0..4).map(|_| next() as u8).collect();
            data[at..at + 4].copy_from_slice(&new);
            let want = finish(sum(0, &data));
            let got = update(c, &old, &new);
            // 0x0000 and 0xffff are the same one's-complement value.
            assert!(got == want || (got ^ want) == 0xffff, "got {got:04x} want {want:04x}");
        }
    }

    /// The plain RFC 1071 definition, 16-bit big-endian words one by one: the reference for [`sum`].
    fn reference_sum(initial: u32, data: &[u8]) -> u32 {
        let mut acc = u64::from(initial);
        for c in data.chunks(2) {
            acc += u64::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
        }
        flexstack_core::switch::fold64(acc)
    }

    #[test]
    fn the_wide_sum_equals_the_word_by_word_sum() {
        let mut rng = flexstack_fuzzkit::Rng::new(0x9e37_79b9_7f4a_7c15);
        let data = rng.bytes(70_000);
        for _ in 0..500 {
            let start = rng.below(64);
            let len = rng.below(2000) + if rng.one_in(10) { 60_000 } else { 0 };
            let initial = rng.next() as u32 & 0x3_ffff;
            let d = &data[start..start + len];
            assert_eq!(finish(sum(initial, d)), finish(reference_sum(initial, d)), "len {len} from {start}");
        }
        // All ones: the end-around carries of a long run.
        let ones = vec![0xffu8; 65_535];
        assert_eq!(finish(sum(0xffff, &ones)), finish(reference_sum(0xffff, &ones)));
        assert_eq!(sum(7, &[]), 7);
    }

    /// A TCP/IPv4 packet behind an Ethernet header with `payload` bytes, and where its partial checksum is.
    fn partial_tcp4(payload: usize) -> (Vec<u8>, CsumPartial, u16) {
        let mut f = vec![0u8; 14 + 20 + 20 + payload];
        f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        f[14] = 0x45;
        f[14 + 9] = 6;
        f[26..30].copy_from_slice(&[10, 0, 0, 1]);
        f[30..34].copy_from_slice(&[10, 0, 0, 2]);
        f[34 + 12] = 5 << 4;
        for (i, b) in f[54..].iter_mut().enumerate() {
            *b = (i * 13 + 5) as u8;
        }
        let pseudo = pseudo_header(
            Ipv4Addr::new(10, 0, 0, 1).into(),
            Ipv4Addr::new(10, 0, 0, 2).into(),
            6,
            (20 + payload) as u32,
        );
        let complete = finish(sum(pseudo, &f[34..]));
        // What a sender offloading its checksum leaves in the field: the folded pseudo-header sum.
        f[50..52].copy_from_slice(&(!finish(pseudo)).to_be_bytes());
        (f, CsumPartial { start: 34, offset: 16 }, complete)
    }

    #[test]
    fn completing_a_partial_checksum_gives_the_full_checksum_and_removes_the_key() {
        let pool = flexstack_core::PacketPool::default();
        for payload in [0, 1, 1447, 64_000] {
            let (f, partial, complete) = partial_tcp4(payload);
            let mut p = pool.alloc_from(&f);
            p.meta_mut().set(MetaKey::CSUM_PARTIAL, partial.pack());
            p.meta_mut().set(MetaKey::FLOW_ID, 3);
            assert!(complete_partial(&mut p));
            assert_eq!(u16::from_be_bytes([p.data()[50], p.data()[51]]), complete, "payload {payload}");
            assert!(verify(
                pseudo_header(
                    Ipv4Addr::new(10, 0, 0, 1).into(),
                    Ipv4Addr::new(10, 0, 0, 2).into(),
                    6,
                    (20 + payload) as u32
                ),
                &p.data()[34..]
            ));
            assert_eq!(p.meta().get(MetaKey::CSUM_PARTIAL), None);
            assert_eq!(p.meta().get(MetaKey::FLOW_ID), Some(3), "other metadata kept");
            assert!(!complete_partial(&mut p), "a second call has nothing to do");
            assert_eq!(u16::from_be_bytes([p.data()[50], p.data()[51]]), complete);
        }
        // A field beyond the packet: nothing written, the key is gone.
        let mut short = pool.alloc_from(&[1, 2, 3]);
        short.meta_mut().set(MetaKey::CSUM_PARTIAL, CsumPartial { start: 2, offset: 16 }.pack());
        assert!(!complete_partial(&mut short));
        assert_eq!(short.data(), &[1, 2, 3]);
        assert!(short.meta().is_empty());
        // A shared packet is copied, the other holder keeps its bytes.
        let (f, partial, _) = partial_tcp4(10);
        let mut a = pool.alloc_from(&f);
        a.meta_mut().set(MetaKey::CSUM_PARTIAL, partial.pack());
        let b = a.clone();
        assert!(complete_partial(&mut a));
        assert_eq!(b.data(), &f[..]);
        assert_ne!(a.data(), b.data());
    }

    #[test]
    fn a_partial_udp_checksum_that_completes_to_zero_is_stored_as_all_ones() {
        // A UDP/IPv6 datagram whose last two payload bytes make its checksum come out zero: stored as zero it would
        // read as "no checksum", which IPv6 forbids, and the datagram would be dropped.
        let (src, dst): (IpAddr, IpAddr) = ("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap());
        let mut f = vec![0u8; 40 + 8 + 100];
        f[0] = 0x60;
        f[6] = 17;
        let udp_len = (8 + 100) as u16;
        f[44..46].copy_from_slice(&udp_len.to_be_bytes());
        for (i, b) in f[48..146].iter_mut().enumerate() {
            *b = (i * 7 + 3) as u8;
        }
        let pseudo = pseudo_header(src, dst, 17, u32::from(udp_len));
        let s = fold(sum(pseudo, &f[40..]));
        f[146..148].copy_from_slice(&(!s).to_be_bytes());
        assert_eq!(finish(sum(pseudo, &f[40..])), 0, "the datagram's checksum comes out zero");
        f[46..48].copy_from_slice(&(!finish(pseudo)).to_be_bytes());
        let pool = flexstack_core::PacketPool::default();
        let mut p = pool.alloc_from(&f);
        p.meta_mut().set(MetaKey::CSUM_PARTIAL, CsumPartial { start: 40, offset: 6 }.pack());
        assert!(complete_partial(&mut p));
        assert_eq!(&p.data()[46..48], &[0xff, 0xff]);
        assert!(verify(pseudo, &p.data()[40..]));
    }

    #[test]
    fn pseudo_headers_differ_by_family() {
        let a = pseudo_header(Ipv4Addr::new(10, 0, 0, 1).into(), Ipv4Addr::new(10, 0, 0, 2).into(), 17, 8);
        let b = pseudo_header(Ipv6Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into(), 17, 8);
        assert_ne!(a, b);
        assert_eq!(finish(a), finish(sum(0, &[10, 0, 0, 1, 10, 0, 0, 2, 0, 17, 0, 0, 0, 8])));
    }
}
