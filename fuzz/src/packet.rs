//! The checks of the packet parsers (`flexstack_wire::packet::PacketInfo::parse`) and of the ICMP errors built
//! around any packet (`flexstack_modules::ip::icmp`), shared by the stable-Rust fuzz test
//! `crates/modules/tests/packets_fuzz.rs` (which includes this file) and the libFuzzer target `packet`.

use flexstack_modules::ip::icmp;
use flexstack_wire::checksum;
use flexstack_wire::packet::PacketInfo;
use std::net::{Ipv4Addr, Ipv6Addr};

/// Sets the IPv4 header checksum (and the total length when `total_len`), or the IPv6 payload length, from the
/// buffer, so that a mutated packet gets past the first checks; returns where the header after the IP header starts
/// and its protocol (the IPv6 next header), or `None` when the input is too short for an IP header.
pub fn repair(p: &mut [u8], total_len: bool) -> Option<(usize, u8)> {
    match p.first().map(|b| b >> 4) {
        Some(4) if p.len() >= 20 => {
            if total_len {
                let n = p.len().min(65535) as u16;
                p[2..4].copy_from_slice(&n.to_be_bytes());
            }
            let ihl = (usize::from(p[0] & 0x0f) * 4).clamp(20, p.len());
            p[10] = 0;
            p[11] = 0;
            let c = checksum::ipv4_header(&p[..ihl]);
            p[10..12].copy_from_slice(&c.to_be_bytes());
            Some((ihl, p[9]))
        }
        Some(6) if p.len() >= 40 => {
            let n = (p.len() - 40).min(65535) as u16;
            p[4..6].copy_from_slice(&n.to_be_bytes());
            Some((40, p[6]))
        }
        _ => None,
    }
}

/// Recomputes a packet's IPv4 header and transport checksum; `None` when right (or not checkable).
pub fn checksum_error(packet: &[u8]) -> Option<String> {
    let info = match PacketInfo::parse(packet) {
        Ok(i) => i,
        Err(e) => return Some(format!("does not parse: {e}")),
    };
    if info.fragment.is_some() {
        return None;
    }
    let l4 = &packet[info.l4_offset..info.total_len];
    let ok = match (info.version, info.protocol) {
        (4, 1) => checksum::verify(0, l4),
        (6, 58) | (_, 6) | (_, 17) => {
            checksum::verify(checksum::pseudo_header(info.src, info.dst, info.protocol, l4.len() as u32), l4)
        }
        _ => true,
    };
    (!ok).then(|| "wrong transport checksum".to_string())
}

/// `PacketInfo::parse`: a parsed packet's offsets lie within it, its version agrees with its addresses.
pub fn check_parse(input: &[u8]) -> Result<(), String> {
    if let Ok(info) = PacketInfo::parse(input) {
        if !(info.l4_offset <= info.total_len && info.total_len <= input.len()) {
            return Err(format!("offsets out of the packet: {info:?}"));
        }
        if info.fragment.is_some_and(|f| f.data_offset > info.total_len) {
            return Err(format!("fragment data beyond the packet: {info:?}"));
        }
        if (info.version == 4) != info.src.is_ipv4() {
            return Err(format!("version and addresses disagree: {info:?}"));
        }
    }
    Ok(())
}

/// ICMP errors quoting `input`: within 576 / 1280 bytes, parse back, right checksums, quote a prefix of it.
pub fn check_icmp(input: &[u8]) -> Result<(), String> {
    let src4 = Ipv4Addr::new(192, 0, 2, 1);
    let src6: Ipv6Addr = "2001:db8::1".parse().unwrap();
    let e4 = icmp::error_v4(src4, input, 11, 0, [0; 4]);
    let e6 = icmp::error_v6(src6, input, 2, 0, 1280u32.to_be_bytes());
    if e4.len() > icmp::MAX_ERROR_V4 || e6.len() > icmp::MAX_ERROR_V6 {
        return Err(format!("error too long: {} / {}", e4.len(), e6.len()));
    }
    for (e, at) in [(&e4, 28), (&e6, 48)] {
        if let Some(m) = checksum_error(e) {
            return Err(format!("ICMP error: {m}"));
        }
        if !input.starts_with(&e[at..]) {
            return Err("the quote is not a prefix of the original".into());
        }
    }
    if let Ok(info) = PacketInfo::parse(input) {
        let _ = icmp::may_send_error(&info, true);
        let _ = icmp::may_send_error(&info, false);
    }
    Ok(())
}

/// The libFuzzer target's check: [`check_parse`] and [`check_icmp`] on the input as it is and repaired (lengths and
/// IPv4 header checksum set from the buffer: [`repair`]), so that mutations get past the first checks.
pub fn check_packet(input: &[u8]) -> Result<(), String> {
    check_parse(input)?;
    check_icmp(input)?;
    let mut repaired = input.to_vec();
    repair(&mut repaired, true);
    check_parse(&repaired)?;
    check_icmp(&repaired)
}
