//! ICMP and ICMPv6: building error messages (used by [`crate::ip::ip`]), deciding whether one may be sent, and the
//! `icmp` module kind, which answers echo requests.
//!
//! # Error messages
//!
//! [`error_v4`] and [`error_v6`] build a whole IP packet carrying an ICMP (RFC 792) or ICMPv6 (RFC 4443) error
//! about `original`, addressed to `original`'s source, with TTL / hop limit [`HOP_LIMIT`], quoting as much of the
//! original as fits in 576 (IPv4) or 1280 (IPv6) bytes, with correct checksums (ICMPv6 with its pseudo-header).
//! [`write_error_v4`] / [`write_error_v6`] do the same into a caller's buffer (a pooled packet), so the error path
//! allocates nothing once the pool is warm. `original` may be anything, even garbage: the functions never panic.
//!
//! [`may_send_error`] says whether an error may be sent about a parsed packet at all: never about an ICMP error,
//! a fragment other than the first, or a packet from an unspecified, multicast or broadcast source; never about an
//! IPv4 packet sent to a multicast or broadcast address; about an IPv6 packet sent to a multicast address only for
//! Packet Too Big (RFC 1122 3.2.2, RFC 1812 4.3.2.7, RFC 4443 2.4 (e)).
//!
//! # The `icmp` module kind
//!
//! Answers ICMP echo requests and ICMPv6 echo requests addressed to one of its addresses; everything else passes.
//! The `addresses` setting (an array of IPv4 and IPv6 address strings, or one string of addresses separated by
//! commas or spaces) is not a knob: change it with `module replace`. `passed_total` includes packets that do not
//! parse (validating is the `ip` module's job). Its ports, setting and meters are declared once, in `DECL` below;
//! docs/modules.md lists them.
//!
//! A reply swaps the addresses, sets TTL / hop limit to [`HOP_LIMIT`], changes the type (8 → 0, 128 → 129) and
//! updates the ICMP checksum incrementally; it is made in place (no copy unless the packet is shared), except
//! for a request carrying IPv4 options or IPv6 extension headers, whose reply is rebuilt without them. Trailing
//! bytes beyond the IP length are cut. The reply keeps the request's metadata and goes the opposite direction.

use flexstack_core::module::port_type;
use flexstack_core::{
    kind_from_decl, Batch, ConfigError, Direction, Frame, KindDecl, Meter, MeterDecl, Module, ModuleBuilder,
    ModuleKind, Output, Packet, Param, PortDecl, Settings,
};
use flexstack_wire::checksum;
use flexstack_wire::packet::{proto, PacketInfo};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The kind's name in stack files.
pub const KIND: &str = "icmp";

/// Largest IPv4 ICMP error message (RFC 1812 4.3.2.3).
pub const MAX_ERROR_V4: usize = 576;
/// Largest ICMPv6 error message: the IPv6 minimum MTU (RFC 4443 2.4 (c)).
pub const MAX_ERROR_V6: usize = 1280;
/// TTL / hop limit of the messages built here.
pub const HOP_LIMIT: u8 = 64;

/// ICMP and ICMPv6 message types used by the modules.
pub mod types {
    /// ICMP echo reply.
    pub const ECHO_REPLY: u8 = 0;
    /// ICMP destination unreachable (code 4: fragmentation needed and DF set).
    pub const DEST_UNREACHABLE: u8 = 3;
    /// ICMP echo request.
    pub const ECHO_REQUEST: u8 = 8;
    /// ICMP time exceeded (code 0: TTL exceeded in transit).
    pub const TIME_EXCEEDED: u8 = 11;
    /// Code of "fragmentation needed and DF set".
    pub const CODE_FRAG_NEEDED: u8 = 4;
    /// ICMPv6 destination unreachable.
    pub const V6_DEST_UNREACHABLE: u8 = 1;
    /// ICMPv6 packet too big.
    pub const V6_PACKET_TOO_BIG: u8 = 2;
    /// ICMPv6 time exceeded (code 0: hop limit exceeded in transit).
    pub const V6_TIME_EXCEEDED: u8 = 3;
    /// ICMPv6 echo request.
    pub const V6_ECHO_REQUEST: u8 = 128;
    /// ICMPv6 echo reply.
    pub const V6_ECHO_REPLY: u8 = 129;
}

/// True if ICMP (`version` 4) or ICMPv6 (6) type `icmp_type` is an error message. ICMPv6 errors are types 0..=127
/// (RFC 4443 2.1); for ICMPv4 every type that is not a known query or reply counts as an error, so that an
/// unknown type never draws an error in return.
pub fn is_error_type(version: u8, icmp_type: u8) -> bool {
    if version == 6 {
        icmp_type < 128
    } else {
        !matches!(icmp_type, 0 | 8 | 9 | 10 | 13 | 14 | 15 | 16 | 17 | 18 | 42 | 43)
    }
}

fn bad_source(addr: IpAddr) -> bool {
    match addr {
        IpAddr::V4(a) => a.is_unspecified() || a.is_multicast() || a.is_broadcast(),
        IpAddr::V6(a) => a.is_unspecified() || a.is_multicast(),
    }
}

/// True if an ICMP error may be sent about the packet described by `info` (see the module docs for the rules).
/// `packet_too_big` allows an IPv6 multicast destination, as RFC 4443 does for Packet Too Big.
pub fn may_send_error(info: &PacketInfo, packet_too_big: bool) -> bool {
    if info.fragment.is_some_and(|f| f.offset != 0) {
        return false;
    }
    if matches!(info.protocol, proto::ICMP | proto::ICMPV6) && (info.protocol == proto::ICMP) == (info.version == 4) {
        match info.icmp {
            Some((t, _)) if !is_error_type(info.version, t) => {}
            _ => return false,
        }
    }
    if bad_source(info.src) {
        return false;
    }
    match info.dst {
        IpAddr::V4(d) => !(d.is_multicast() || d.is_broadcast()),
        IpAddr::V6(d) => packet_too_big || !d.is_multicast(),
    }
}

/// The part of `original` worth quoting: cut to the IP length its header states, when that is plausible.
fn quotable(original: &[u8], v4: bool) -> &[u8] {
    let stated = if v4 && original.len() >= 20 {
        usize::from(u16::from_be_bytes([original[2], original[3]]))
    } else if !v4 && original.len() >= 40 {
        40 + usize::from(u16::from_be_bytes([original[4], original[5]]))
    } else {
        original.len()
    };
    if stated >= 20 && stated <= original.len() {
        &original[..stated]
    } else {
        original
    }
}

/// Writes into `out` (cleared first) an IPv4 packet from `src` carrying an ICMP error of `icmp_type`/`code` with
/// `rest_of_header` (bytes 4..8 of the ICMP header), about `original`, sent to `original`'s source address (or
/// 0.0.0.0 if `original` is too short to have one).
pub fn write_error_v4(
    out: &mut Vec<u8>,
    src: Ipv4Addr,
    original: &[u8],
    icmp_type: u8,
    code: u8,
    rest_of_header: [u8; 4],
) {
    let dst = match original {
        [b0, ..] if original.len() >= 20 && b0 >> 4 == 4 => {
            Ipv4Addr::new(original[12], original[13], original[14], original[15])
        }
        _ => Ipv4Addr::UNSPECIFIED,
    };
    let quote = quotable(original, true);
    let quote = &quote[..quote.len().min(MAX_ERROR_V4 - 28)];
    let total = 28 + quote.len();
    out.clear();
    out.extend_from_slice(&[0x45, 0, (total >> 8) as u8, total as u8, 0, 0, 0, 0, HOP_LIMIT, proto::ICMP, 0, 0]);
    out.extend_from_slice(&src.octets());
    out.extend_from_slice(&dst.octets());
    let c = checksum::ipv4_header(&out[..20]);
    out[10..12].copy_from_slice(&c.to_be_bytes());
    out.extend_from_slice(&[icmp_type, code, 0, 0]);
    out.extend_from_slice(&rest_of_header);
    out.extend_from_slice(quote);
    let c = checksum::finish(checksum::sum(0, &out[20..]));
    out[22..24].copy_from_slice(&c.to_be_bytes());
}

/// Writes into `out` (cleared first) an IPv6 packet from `src` carrying an ICMPv6 error of `icmp_type`/`code`
/// with `rest_of_header`, about `original`, sent to `original`'s source address (or `::` if it has none).
pub fn write_error_v6(
    out: &mut Vec<u8>,
    src: Ipv6Addr,
    original: &[u8],
    icmp_type: u8,
    code: u8,
    rest_of_header: [u8; 4],
) {
    let dst = match original {
        [b0, ..] if original.len() >= 40 && b0 >> 4 == 6 => {
            let mut a = [0u8; 16];
            a.copy_from_slice(&original[8..24]);
            Ipv6Addr::from(a)
        }
        _ => Ipv6Addr::UNSPECIFIED,
    };
    let quote = quotable(original, false);
    let quote = &quote[..quote.len().min(MAX_ERROR_V6 - 48)];
    let len = 8 + quote.len();
    out.clear();
    out.extend_from_slice(&[0x60, 0, 0, 0, (len >> 8) as u8, len as u8, proto::ICMPV6, HOP_LIMIT]);
    out.extend_from_slice(&src.octets());
    out.extend_from_slice(&dst.octets());
    out.extend_from_slice(&[icmp_type, code, 0, 0]);
    out.extend_from_slice(&rest_of_header);
    out.extend_from_slice(quote);
    let pseudo = checksum::pseudo_header(src.into(), dst.into(), proto::ICMPV6, len as u32);
    let c = checksum::finish(checksum::sum(pseudo, &out[40..]));
    out[42..44].copy_from_slice(&c.to_be_bytes());
}

/// An IPv4 ICMP error packet about `original` (see [`write_error_v4`]).
pub fn error_v4(src: Ipv4Addr, original: &[u8], icmp_type: u8, code: u8, rest_of_header: [u8; 4]) -> Vec<u8> {
    let mut out = Vec::with_capacity(MAX_ERROR_V4);
    write_error_v4(&mut out, src, original, icmp_type, code, rest_of_header);
    out
}

/// An IPv6 ICMPv6 error packet about `original` (see [`write_error_v6`]).
pub fn error_v6(src: Ipv6Addr, original: &[u8], icmp_type: u8, code: u8, rest_of_header: [u8; 4]) -> Vec<u8> {
    let mut out = Vec::with_capacity(MAX_ERROR_V6);
    write_error_v6(&mut out, src, original, icmp_type, code, rest_of_header);
    out
}

/// True if the ICMP / ICMPv6 checksum of the message in `data` (a parsed packet) is right.
pub(crate) fn icmp_checksum_ok(info: &PacketInfo, data: &[u8]) -> bool {
    let msg = &data[info.l4_offset..info.total_len];
    let initial = if info.version == 6 {
        checksum::pseudo_header(info.src, info.dst, proto::ICMPV6, msg.len() as u32)
    } else {
        0
    };
    checksum::verify(initial, msg)
}

// ---------------------------------------------------------------------------------------------------------------
// The `icmp` module kind
// ---------------------------------------------------------------------------------------------------------------

/// The `icmp` module kind.
pub struct IcmpKind;

/// The kind: ports, setting and meters (the state is the addresses answered for).
const DECL: KindDecl<Vec<IpAddr>, Meters> = KindDecl {
    inputs: &[PortDecl::new("in", port_type::IP, "IP packets")],
    outputs: &[
        PortDecl::new("reply", port_type::IP, "echo replies, travelling the opposite way"),
        PortDecl::new("out", port_type::IP, "everything else, unchanged"),
    ],
    params: &[Param::manual(
        "addresses",
        "array of strings",
        "IPv4 and IPv6 addresses this module answers for (or one string of them, separated by commas or spaces)",
        "none",
    )],
    meters: &[
        MeterDecl::u64("echo_requests_total", "frames", "echo requests to our addresses", |m| &mut m.requests),
        MeterDecl::u64("echo_replies_total", "frames", "echo replies emitted on `reply`", |m| &mut m.replies),
        MeterDecl::u64("passed_total", "frames", "frames emitted unchanged on `out`", |m| &mut m.passed),
        MeterDecl::u64("drop_bad_l4_checksum_total", "frames", "echo requests to us with a wrong ICMP checksum", |m| {
            &mut m.bad_checksum
        }),
        MeterDecl::u64(
            "drop_bad_source_total",
            "frames",
            "echo requests from an unspecified, multicast or broadcast source",
            |m| &mut m.bad_source,
        ),
    ],
    ..KindDecl::new(KIND, "answers ICMP/ICMPv6 echo requests to its addresses; passes everything else")
};

impl ModuleKind for IcmpKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(KIND);
        // An array of address strings, or (handy on a command line) one string of them.
        let words = match settings.get("addresses").map(|s| &s.value) {
            Some(toml::Value::String(_)) => {
                let text = r.string("addresses")?.unwrap_or_default();
                text.split([',', ' ']).filter(|w| !w.is_empty()).map(str::to_string).collect()
            }
            _ => r.strings("addresses")?.unwrap_or_default(),
        };
        let mut addresses = Vec::new();
        for w in words {
            let a: IpAddr = w
                .trim()
                .parse()
                .map_err(|_| r.error("addresses", format_args!("{w:?} is not an IPv4 or IPv6 address")))?;
            addresses.push(a);
        }
        r.finish()?;
        Ok(DECL.builder(addresses, |addresses, m, _| Box::new(Icmp { addresses, m })))
    }
}

/// The `icmp` module's meters.
#[derive(Default)]
struct Meters {
    requests: Meter,
    replies: Meter,
    passed: Meter,
    bad_checksum: Meter,
    bad_source: Meter,
}

/// A running `icmp` module.
pub struct Icmp {
    addresses: Vec<IpAddr>,
    m: Meters,
}

const PORT_REPLY: usize = 0;
const PORT_OUT: usize = 1;

/// What to do with one frame.
enum Verdict {
    Pass,
    Reply(PacketInfo),
    BadChecksum,
    BadSource,
}

impl Icmp {
    fn classify(&self, data: &[u8]) -> Verdict {
        let Ok(info) = PacketInfo::parse(data) else { return Verdict::Pass };
        let request = matches!(
            (info.version, info.protocol, info.icmp),
            (4, proto::ICMP, Some((types::ECHO_REQUEST, 0))) | (6, proto::ICMPV6, Some((types::V6_ECHO_REQUEST, 0)))
        );
        if !request || info.fragment.is_some() || !self.addresses.contains(&info.dst) {
            return Verdict::Pass;
        }
        if bad_source(info.src) {
            return Verdict::BadSource;
        }
        if !icmp_checksum_ok(&info, data) {
            return Verdict::BadChecksum;
        }
        Verdict::Reply(info)
    }

    /// Turns the echo request in `p` into its reply.
    fn make_reply(info: &PacketInfo, p: &mut Packet, out: &Output<'_>) {
        let direction = match p.direction() {
            Direction::Up => Direction::Down,
            Direction::Down => Direction::Up,
        };
        let plain_header = if info.version == 4 { 20 } else { 40 };
        if info.l4_offset != plain_header {
            // IPv4 options or IPv6 extension headers: rebuild the reply without them.
            let mut fresh = out.pool().alloc();
            *fresh.meta_mut() = *p.meta();
            let data = p.data();
            let msg = &data[info.l4_offset..info.total_len];
            let buf = fresh.make_mut();
            if info.version == 4 {
                let total = 20 + msg.len();
                buf.extend_from_slice(&[0x45, 0, (total >> 8) as u8, total as u8, 0, 0, 0x40, 0]);
                buf.extend_from_slice(&[HOP_LIMIT, proto::ICMP, 0, 0]);
                buf.extend_from_slice(&data[12..20]);
            } else {
                let len = msg.len();
                buf.extend_from_slice(&data[..4]);
                buf.extend_from_slice(&[(len >> 8) as u8, len as u8, proto::ICMPV6, HOP_LIMIT]);
                buf.extend_from_slice(&data[8..40]);
            }
            buf.extend_from_slice(msg);
            *p = fresh;
        } else {
            p.truncate(info.total_len);
        }
        p.set_direction(direction);
        let d = p.data_mut();
        let l4 = plain_header;
        if info.version == 4 {
            for i in 0..4 {
                d.swap(12 + i, 16 + i);
            }
            d[8] = HOP_LIMIT;
            d[10] = 0;
            d[11] = 0;
            let c = checksum::ipv4_header(&d[..20]);
            d[10..12].copy_from_slice(&c.to_be_bytes());
        } else {
            for i in 0..16 {
                d.swap(8 + i, 24 + i);
            }
            d[7] = HOP_LIMIT;
        }
        // Swapping the addresses leaves the ICMPv6 pseudo-header sum unchanged; only the type word changes.
        let reply_type = if info.version == 4 { types::ECHO_REPLY } else { types::V6_ECHO_REPLY };
        let old = [d[l4], d[l4 + 1]];
        d[l4] = reply_type;
        let c = checksum::update(u16::from_be_bytes([d[l4 + 2], d[l4 + 3]]), &old, &[reply_type, d[l4 + 1]]);
        d[l4 + 2..l4 + 4].copy_from_slice(&c.to_be_bytes());
    }
}

impl Module for Icmp {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        for mut frame in input.drain(..) {
            let verdict = match &frame {
                Frame::Data(p) => self.classify(p.data()),
                Frame::Control(_) => Verdict::Pass,
            };
            match verdict {
                Verdict::Pass => {
                    self.m.passed.add(1);
                    out.emit(PORT_OUT, frame);
                }
                Verdict::BadSource => {
                    self.m.requests.add(1);
                    self.m.bad_source.add(1);
                    out.drop_frame(frame);
                }
                Verdict::BadChecksum => {
                    self.m.requests.add(1);
                    self.m.bad_checksum.add(1);
                    out.drop_frame(frame);
                }
                Verdict::Reply(info) => {
                    self.m.requests.add(1);
                    if let Some(p) = frame.packet_mut() {
                        Self::make_reply(&info, p, out);
                    }
                    self.m.replies.add(1);
                    out.emit(PORT_REPLY, frame);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ip::ip::testkit::*;
    use flexstack_core::{Switch, Time};
    use flexstack_wire::packet::build;

    fn echo6(id: u16, seq: u16, data: &[u8], src: Ipv6Addr, dst: Ipv6Addr) -> Vec<u8> {
        let mut m = vec![128, 0, 0, 0];
        m.extend_from_slice(&id.to_be_bytes());
        m.extend_from_slice(&seq.to_be_bytes());
        m.extend_from_slice(data);
        let c = checksum::finish(checksum::sum(
            checksum::pseudo_header(src.into(), dst.into(), proto::ICMPV6, m.len() as u32),
            &m,
        ));
        m[2..4].copy_from_slice(&c.to_be_bytes());
        m
    }

    #[test]
    fn error_v4_quotes_and_checksums() {
        let u = build::udp(A4.into(), B4.into(), 1000, 53, &[7; 1000]);
        let orig = build::ipv4(A4, B4, proto::UDP, 1, &u);
        let e = error_v4(B4, &orig, types::TIME_EXCEEDED, 0, [0; 4]);
        assert_eq!(e.len(), MAX_ERROR_V4);
        let info = PacketInfo::parse(&e).unwrap();
        assert_eq!((info.src, info.dst, info.hop_limit), (IpAddr::V4(B4), IpAddr::V4(A4), HOP_LIMIT));
        assert_eq!(info.icmp, Some((11, 0)));
        assert_checksums(&e);
        assert_eq!(&e[28..], &orig[..MAX_ERROR_V4 - 28]);
        // A short original is quoted whole, trailing garbage beyond its total length cut.
        let small = build::ipv4(A4, B4, proto::UDP, 1, &build::udp(A4.into(), B4.into(), 1, 2, b"x"));
        let mut padded = small.clone();
        padded.extend_from_slice(&[0xee; 10]);
        let e = error_v4(B4, &padded, 3, 4, [0, 0, 5, 220]);
        assert_eq!(&e[28..], &small[..]);
        assert_eq!(&e[24..28], &[0, 0, 5, 220]);
        assert_checksums(&e);
    }

    #[test]
    fn error_v6_quotes_and_checksums() {
        let u = build::udp(a6().into(), b6().into(), 1000, 53, &[7; 2000]);
        let orig = build::ipv6(a6(), b6(), proto::UDP, 1, &u);
        let e = error_v6(b6(), &orig, types::V6_PACKET_TOO_BIG, 0, 1280u32.to_be_bytes());
        assert_eq!(e.len(), MAX_ERROR_V6);
        let info = PacketInfo::parse(&e).unwrap();
        assert_eq!((info.src, info.dst), (IpAddr::V6(b6()), IpAddr::V6(a6())));
        assert_eq!(info.icmp, Some((2, 0)));
        assert_eq!(&e[48..], &orig[..MAX_ERROR_V6 - 48]);
        assert_checksums(&e);
    }

    #[test]
    fn errors_about_garbage_do_not_panic() {
        for len in 0..80 {
            let junk: Vec<u8> = (0..len).map(|i| (i * 37) as u8 | 0x40).collect();
            let e = error_v4(B4, &junk, 11, 0, [0; 4]);
            assert_checksums(&e);
            let e = error_v6(b6(), &junk, 3, 0, [0; 4]);
            assert_checksums(&e);
        }
    }

    #[test]
    fn when_errors_may_be_sent() {
        let parse = |p: &[u8]| PacketInfo::parse(p).unwrap();
        let u = build::udp(A4.into(), B4.into(), 1, 2, b"x");
        assert!(may_send_error(&parse(&build::ipv4(A4, B4, proto::UDP, 1, &u)), false));
        // About an ICMP error: no; about an echo request: yes.
        let err = error_v4(B4, &build::ipv4(A4, B4, proto::UDP, 1, &u), 11, 0, [0; 4]);
        assert!(!may_send_error(&parse(&err), false));
        let echo = build::ipv4(A4, B4, proto::ICMP, 1, &build::icmpv4_echo(1, 1, b""));
        assert!(may_send_error(&parse(&echo), false));
        let err6 = error_v6(b6(), &build::ipv6(a6(), b6(), proto::UDP, 1, &[0; 8]), 3, 0, [0; 4]);
        assert!(!may_send_error(&parse(&err6), false));
        // Bad sources, and IPv4 broadcast/multicast destinations.
        for (s, d) in [
            (Ipv4Addr::UNSPECIFIED, B4),
            (Ipv4Addr::BROADCAST, B4),
            (Ipv4Addr::new(224, 0, 0, 1), B4),
            (A4, Ipv4Addr::BROADCAST),
            (A4, Ipv4Addr::new(239, 1, 1, 1)),
        ] {
            let u = build::udp(s.into(), d.into(), 1, 2, b"x");
            assert!(!may_send_error(&parse(&build::ipv4(s, d, proto::UDP, 1, &u)), true), "{s} -> {d}");
        }
        // IPv6 multicast destination: only Packet Too Big.
        let m: Ipv6Addr = "ff02::1".parse().unwrap();
        let p = parse(&build::ipv6(a6(), m, proto::UDP, 1, &build::udp(a6().into(), m.into(), 1, 2, b"")));
        assert!(!may_send_error(&p, false));
        assert!(may_send_error(&p, true));
        let p = parse(&build::ipv6(m, b6(), proto::UDP, 1, &build::udp(m.into(), b6().into(), 1, 2, b"")));
        assert!(!may_send_error(&p, true));
        // A non-first fragment: no.
        let mut frag = vec![proto::UDP, 0, 0, 16 | 1, 0, 0, 0, 9];
        frag.extend_from_slice(&[0; 16]);
        assert!(!may_send_error(&parse(&build::ipv6(a6(), b6(), proto::FRAGMENT, 9, &frag)), true));
    }

    fn stack() -> (Switch, Log, Log) {
        let mut sw = Switch::default();
        let (r, replies) = Recorder::load("replies");
        let (o, others) = Recorder::load("others");
        sw.apply(vec![
            load("i", "icmp", &["addresses=[\"10.2.0.1\", \"fd00:1::1\"]"]),
            r,
            o,
            link("i[reply] -> replies"),
            link("i[out] -> others"),
        ])
        .unwrap();
        (sw, replies, others)
    }

    #[test]
    fn answers_echo_requests_v4_and_v6() {
        let (mut sw, replies, others) = stack();
        let req4 = build::ipv4(A4, B4, proto::ICMP, 7, &build::icmpv4_echo(42, 3, b"hello"));
        let req6 = build::ipv6(a6(), b6(), proto::ICMPV6, 7, &echo6(43, 4, b"hi6", a6(), b6()));
        let to_other = build::ipv4(A4, A4, proto::ICMP, 7, &build::icmpv4_echo(42, 3, b"hello"));
        let udp = build::ipv4(A4, B4, proto::UDP, 7, &build::udp(A4.into(), B4.into(), 1, 2, b"q"));
        let mut padded = req4.clone();
        padded.extend_from_slice(&[0; 6]);
        inject(&mut sw, "i", &[&req4, &req6, &to_other, &udp, b"junk", &padded], Direction::Up);
        sw.run(Time::from_millis(1));
        let replies = replies.lock().unwrap();
        assert_eq!(replies.len(), 3);
        let r4 = &replies[0];
        let info = PacketInfo::parse(&r4.data).unwrap();
        assert_eq!((info.src, info.dst, info.icmp, info.hop_limit), (B4.into(), A4.into(), Some((0, 0)), 64));
        assert_eq!(&r4.data[24..], &req4[24..], "identifier, sequence and data echoed");
        assert_eq!(r4.direction, Direction::Down);
        assert_checksums(&r4.data);
        let info = PacketInfo::parse(&replies[1].data).unwrap();
        assert_eq!((info.src, info.dst, info.icmp), (b6().into(), a6().into(), Some((129, 0))));
        assert_checksums(&replies[1].data);
        assert_eq!(replies[2].data, r4.data, "trailing bytes cut");
        assert_eq!(others.lock().unwrap().len(), 3);
        assert_eq!(u64_var(&sw, "module.i.echo_requests_total"), 3);
        assert_eq!(u64_var(&sw, "module.i.echo_replies_total"), 3);
        assert_eq!(u64_var(&sw, "module.i.passed_total"), 3);
    }

    #[test]
    fn replies_to_requests_with_options_and_extension_headers() {
        let (mut sw, replies, _others) = stack();
        // IPv4 with 4 bytes of options (NOPs).
        let mut req4 = build::ipv4(A4, B4, proto::ICMP, 7, &build::icmpv4_echo(1, 2, b"opt"));
        req4.splice(20..20, [1, 1, 1, 0]);
        req4[0] = 0x46;
        let total = req4.len() as u16;
        req4[2..4].copy_from_slice(&total.to_be_bytes());
        req4[10] = 0;
        req4[11] = 0;
        let c = checksum::ipv4_header(&req4[..24]);
        req4[10..12].copy_from_slice(&c.to_be_bytes());
        // IPv6 with a hop-by-hop header.
        let mut payload = vec![proto::ICMPV6, 0, 1, 4, 0, 0, 0, 0];
        payload.extend_from_slice(&echo6(5, 6, b"ext", a6(), b6()));
        let req6 = build::ipv6(a6(), b6(), proto::HOP_BY_HOP, 3, &payload);
        inject(&mut sw, "i", &[&req4, &req6], Direction::Down);
        sw.run(Time::from_millis(1));
        let replies = replies.lock().unwrap();
        assert_eq!(replies.len(), 2);
        for r in replies.iter() {
            assert_checksums(&r.data);
            assert_eq!(r.direction, Direction::Up);
        }
        assert_eq!(replies[0].data.len(), req4.len() - 4);
        assert_eq!(&replies[0].data[28..], b"opt");
        assert_eq!(replies[1].data.len(), req6.len() - 8);
        let info = PacketInfo::parse(&replies[1].data).unwrap();
        assert_eq!((info.l4_offset, info.icmp), (40, Some((129, 0))));
    }

    #[test]
    fn drops_bad_checksums_and_sources() {
        let (mut sw, replies, _others) = stack();
        let mut bad = build::ipv4(A4, B4, proto::ICMP, 7, &build::icmpv4_echo(42, 3, b"hello"));
        bad[30] ^= 1;
        let any = Ipv4Addr::UNSPECIFIED;
        let from_any = build::ipv4(any, B4, proto::ICMP, 7, &build::icmpv4_echo(42, 3, b"hello"));
        inject(&mut sw, "i", &[&bad, &from_any], Direction::Up);
        sw.run(Time::from_millis(1));
        assert!(replies.lock().unwrap().is_empty());
        assert_eq!(u64_var(&sw, "module.i.drop_bad_l4_checksum_total"), 1);
        assert_eq!(u64_var(&sw, "module.i.drop_bad_source_total"), 1);
        assert_eq!(u64_var(&sw, "module.i.frames_dropped_total"), 2);
    }

    #[test]
    fn rejects_bad_addresses_with_their_location() {
        assert_config_error("[modules.i]\nkind = \"icmp\"\naddresses = [\"10.0.0.1\", \"nope\"]\n", Some(3), &["nope"]);
        assert_config_error("[modules.i]\nkind = \"icmp\"\naddresses = 5\n", None, &["array"]);
        assert_config_error("[modules.i]\nkind = \"icmp\"\n\nmtu = 5\n", Some(4), &[]);
        assert!(configure_toml("[modules.i]\nkind = \"icmp\"\naddresses = \"10.0.0.1, ::1\"\n").is_ok());
    }
}
