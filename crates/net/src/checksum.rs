//! Internet checksums (RFC 1071) and their incremental update (RFC 1624), for IPv4 headers and the TCP, UDP and
//! ICMP checksums over IPv4 and IPv6 pseudo-headers.
//!
//! Full computation: [`sum`] the bytes (and a [`pseudo_header`]), then [`finish`]. After rewriting a field (NAT),
//! [`update`] adjusts an existing checksum from the old and new bytes of that field alone.

use std::net::IpAddr;

/// One's-complement sum of `data` as 16-bit big-endian words (an odd last byte is padded with zero), added to
/// `initial`. Not folded: pass the result to [`finish`].
pub fn sum(initial: u32, data: &[u8]) -> u32 {
    let mut acc = u64::from(initial);
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        acc += u64::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        acc += u64::from(*last) << 8;
    }
    fold32(acc)
}

fn fold32(mut acc: u64) -> u32 {
    while acc > 0xffff_ffff {
        acc = (acc & 0xffff_ffff) + (acc >> 32);
    }
    acc as u32
}

/// Folds a sum to 16 bits and complements it: the checksum to store.
pub fn finish(sum: u32) -> u16 {
    let mut s = sum;
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
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

    #[test]
    fn pseudo_headers_differ_by_family() {
        let a = pseudo_header(Ipv4Addr::new(10, 0, 0, 1).into(), Ipv4Addr::new(10, 0, 0, 2).into(), 17, 8);
        let b = pseudo_header(Ipv6Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into(), 17, 8);
        assert_ne!(a, b);
        assert_eq!(finish(a), finish(sum(0, &[10, 0, 0, 1, 10, 0, 0, 2, 0, 17, 0, 0, 0, 8])));
    }
}
