//! `ip`: validation and forwarding hygiene for raw IPv4 and IPv6 packets (no link header): parse once, drop what
//! is malformed, decrement the TTL / hop limit, enforce an MTU (fragmenting IPv4 or answering with ICMP), and
//! optionally verify transport checksums.
//!
//! Its ports, knobs (each also accepted as a setting of the same name) and meters are declared once, in `DECL`
//! below; docs/modules.md lists them with their types, units, defaults and ranges. What the knobs do:
//!
//! - `decrement_ttl`: decrement the TTL / hop limit (IPv4: header checksum updated incrementally, RFC 1624). A
//!   packet arriving with TTL / hop limit <= 1 is dropped (`drop_ttl_exceeded_total`) and answered with Time
//!   Exceeded (ICMP type 11 / ICMPv6 type 3, code 0).
//! - `mtu` (0 = unlimited, else at least 68): a longer packet is, for IPv4 without DF, fragmented (RFC 791: options
//!   without the copy flag only in the first fragment) and each fragment emitted on `out`; for IPv4 with DF and for
//!   IPv6 it is dropped (`drop_too_big_total`) and answered with Fragmentation Needed (ICMP type 3 code 4, next-hop
//!   MTU) / Packet Too Big (ICMPv6 type 2, the MTU). An IPv4 fragment whose pieces would lie beyond offset 65535 is
//!   dropped as too big, without an error.
//! - `verify_l4_checksums`: verify the TCP, UDP, ICMP and ICMPv6 checksums of whole (non-fragment) packets; a wrong
//!   one is dropped (`drop_bad_l4_checksum_total`). UDP over IPv4 with checksum 0 has none and passes; over IPv6 a
//!   zero UDP checksum is wrong.
//! - `source_v4`, `source_v6`: source address of the ICMP errors; when unset (""), an error is sent from the
//!   offending packet's destination address.
//! - `icmp_rate`: token bucket limiting the ICMP errors sent (RFC 4443 2.4 (f)), with bursts of up to a tenth of a
//!   second's worth (at least 1); errors held back are counted in `icmp_errors_limited_total` (the packet itself is
//!   still dropped and counted).
//!
//! Control frames pass to `out` unchanged. ICMP errors leave on `icmp`, addressed to the offending packet's source
//! and travelling the opposite way, with the offending packet's `IN_FACE` metadata. They are never sent about ICMP
//! errors, non-first fragments, packets from unspecified, multicast or broadcast sources, or IPv4 packets to
//! multicast/broadcast addresses ([`crate::ip::icmp::may_send_error`]), and quote the packet as it arrived.
//! `packets_total` and `bytes_total` count every data frame received, before any drop; packets that do not parse
//! count in `drop_<reason>_total` ([`ParseError`](flexstack_wire::packet::ParseError) reasons).
//!
//! Bytes beyond the length the IP header states (link padding) are cut from forwarded packets. Accounting: every
//! data frame received is either emitted on `out` (whole, or replaced by `fragments_made_total -
//! packets_fragmented_total` more frames) or dropped with exactly one reason; ICMP errors are new frames.
//!
//! GSO super-packets (`MetaKey::GSO`) pass whole, their TTL / hop limit decremented once for all their segments,
//! while their segments fit the MTU and their TTL / hop limit is not exhausted; otherwise (and for one whose IP
//! length does not match its bytes) the module cuts it and handles each segment as any packet. Its transport
//! checksum is not verified (it is computed when the super-packet is cut, or by the kernel). The meters count
//! segments and their bytes on the wire (`Packet::wire_packets`, `wire_bytes`), as if the packet had been cut
//! before; parse errors count frames.

use crate::ip::icmp::{self, types};
use flexstack_core::frame::Gso;
use flexstack_core::module::port_type;
use flexstack_core::{
    field, kind_from_decl, Batch, ConfigError, Direction, Frame, KindDecl, MetaKey, Meter, MeterDecl, Module,
    ModuleBuilder, ModuleKind, Output, Packet, Param, PortDecl, Settings, Time, Value,
};
use flexstack_wire::checksum;
use flexstack_wire::packet::{proto, PacketInfo};
use smoltcp::wire::Ipv4Packet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The kind's name in stack files.
pub const KIND: &str = "ip";

/// Smallest MTU accepted (RFC 791: every IPv4 host handles 68-byte datagrams).
pub const MIN_MTU: u64 = 68;

const PORT_OUT: usize = 0;
const PORT_ICMP: usize = 1;

pub(crate) use flexstack_wire::packet::ParseDrops;

/// The opposite direction.
pub(crate) fn reverse(d: Direction) -> Direction {
    match d {
        Direction::Up => Direction::Down,
        Direction::Down => Direction::Up,
    }
}

/// True if the transport checksum of a parsed whole packet is right (or not checked: other protocols,
/// fragments, UDP over IPv4 without a checksum).
pub fn l4_checksum_ok(info: &PacketInfo, data: &[u8]) -> bool {
    if info.fragment.is_some() {
        return true;
    }
    let l4 = &data[info.l4_offset..info.total_len];
    let pseudo = || checksum::pseudo_header(info.src, info.dst, info.protocol, l4.len() as u32);
    match (info.version, info.protocol) {
        (4, proto::UDP) if l4[6] == 0 && l4[7] == 0 => true,
        (6, proto::UDP) if l4[6] == 0 && l4[7] == 0 => false,
        (_, proto::TCP | proto::UDP) | (6, proto::ICMPV6) => checksum::verify(pseudo(), l4),
        (4, proto::ICMP) => checksum::verify(0, l4),
        _ => true,
    }
}

/// Settings and knob values of an `ip` module (`Default` is a blank to read them into).
#[derive(Clone, Debug, Default, PartialEq)]
struct IpConfig {
    decrement_ttl: bool,
    mtu: u64,
    verify_l4_checksums: bool,
    source_v4: Option<Ipv4Addr>,
    source_v6: Option<Ipv6Addr>,
    icmp_rate: u64,
}

fn check_mtu(v: u64) -> Result<(), String> {
    if v != 0 && !(MIN_MTU..=65535).contains(&v) {
        return Err(format!("must be 0 (unlimited) or within {MIN_MTU}..=65535, got {v}"));
    }
    Ok(())
}

fn parse_source<T: std::str::FromStr>(text: &str, family: &str) -> Result<Option<T>, String> {
    let t = text.trim();
    if t.is_empty() {
        return Ok(None);
    }
    t.parse().map(Some).map_err(|_| format!("expected an {family} address or \"\", got {text:?}"))
}

/// The `ip` module kind.
pub struct IpKind;

type P = Param<IpConfig>;

/// The kind: ports, knobs and meters.
const DECL: KindDecl<IpConfig, Meters> = KindDecl {
    inputs: &[PortDecl::new("in", port_type::IP, "IP packets to check and forward")],
    outputs: &[
        PortDecl::new("out", port_type::IP, "packets forwarded, or their fragments; control frames"),
        PortDecl::new("icmp", port_type::IP, "ICMP and ICMPv6 errors generated here, travelling back"),
    ],
    params: &[
        P::bool("decrement_ttl", "decrement TTL / hop limit; drop at <= 1", true, field!(decrement_ttl)),
        P::u64("mtu", "bytes", "largest packet forwarded whole; 0 = unlimited", 0, field!(mtu))
            .range(0.0, 65535.0)
            .check(|_, v| check_mtu(v as u64)),
        P::bool("verify_l4_checksums", "verify TCP/UDP/ICMP checksums", false, field!(verify_l4_checksums)),
        P::text(
            "source_v4",
            "source of ICMP errors; \"\" = the packet's destination",
            "",
            |c| c.source_v4.map(|a| a.to_string()).unwrap_or_default(),
            |c, t| parse_source(t, "IPv4").map(|a| c.source_v4 = a),
        ),
        P::text(
            "source_v6",
            "source of ICMPv6 errors; \"\" = the packet's destination",
            "",
            |c| c.source_v6.map(|a| a.to_string()).unwrap_or_default(),
            |c, t| parse_source(t, "IPv6").map(|a| c.source_v6 = a),
        ),
        P::u64("icmp_rate", "1/s", "ICMP errors per second at most; 0 = no limit", 1000, field!(icmp_rate))
            .range(0.0, 1e6),
    ],
    meters: &[
        MeterDecl::u64("packets_total", "frames", "data frames received", |m| &mut m.packets),
        MeterDecl::u64("bytes_total", "bytes", "bytes of the data frames received", |m| &mut m.bytes),
        MeterDecl::u64("drop_ttl_exceeded_total", "frames", "packets dropped: TTL / hop limit exhausted", |m| {
            &mut m.ttl_exceeded
        }),
        MeterDecl::u64(
            "drop_too_big_total",
            "frames",
            "packets dropped: longer than the MTU and not fragmentable",
            |m| &mut m.too_big,
        ),
        MeterDecl::u64("drop_bad_l4_checksum_total", "frames", "packets dropped: wrong TCP/UDP/ICMP checksum", |m| {
            &mut m.bad_l4
        }),
        MeterDecl::u64("icmp_errors_total", "frames", "ICMP errors emitted on `icmp`", |m| &mut m.icmp_errors),
        MeterDecl::u64("icmp_errors_limited_total", "frames", "ICMP errors not sent because of `icmp_rate`", |m| {
            &mut m.icmp_limited
        }),
        MeterDecl::u64("fragments_made_total", "frames", "IPv4 fragments emitted", |m| &mut m.fragments_made),
        MeterDecl::u64("packets_fragmented_total", "frames", "packets cut into fragments", |m| &mut m.fragmented),
    ],
    more_meters: || ParseDrops::specs(false),
    accepts_gso: true,
    ..KindDecl::new(KIND, "validates IPv4/IPv6 packets, decrements TTL, enforces an MTU (fragments or ICMP errors)")
};

impl ModuleKind for IpKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        DECL.configure(settings, IpConfig::default(), |config, m, vars| {
            Box::new(Ip { bucket: Bucket::new(config.icmp_rate), config, m, parse_drops: ParseDrops::new(vars) })
        })
    }
}

/// The `ip` module's meters.
#[derive(Default)]
struct Meters {
    packets: Meter,
    bytes: Meter,
    ttl_exceeded: Meter,
    too_big: Meter,
    bad_l4: Meter,
    icmp_errors: Meter,
    icmp_limited: Meter,
    fragments_made: Meter,
    fragmented: Meter,
}

/// A token bucket for ICMP errors: credit in nanoseconds, one error costs `1e9 / rate` of it.
#[derive(Debug)]
struct Bucket {
    cost: u64,
    burst: u64,
    credit: u64,
    last: Option<Time>,
}

impl Bucket {
    fn new(rate: u64) -> Bucket {
        let cost = 1_000_000_000u64.checked_div(rate).unwrap_or(0);
        let burst = cost * (rate / 10).max(1);
        Bucket { cost, burst, credit: burst, last: None }
    }

    fn take(&mut self, now: Time) -> bool {
        if self.cost == 0 {
            return true;
        }
        let elapsed = self.last.map_or(0, |l| now.as_nanos().saturating_sub(l.as_nanos()));
        self.last = Some(now);
        self.credit = self.credit.saturating_add(elapsed).min(self.burst);
        if self.credit >= self.cost {
            self.credit -= self.cost;
            true
        } else {
            false
        }
    }
}

/// Which ICMP error to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Error {
    TimeExceeded,
    TooBig,
}

/// A running `ip` module.
pub struct Ip {
    config: IpConfig,
    bucket: Bucket,
    m: Meters,
    parse_drops: ParseDrops,
}

impl Ip {
    /// Emits the ICMP error `kind` about `p` on port `icmp`, if the rules and the rate limit allow it.
    fn send_error(&mut self, info: &PacketInfo, p: &Packet, kind: Error, out: &mut Output<'_>) {
        if !icmp::may_send_error(info, kind == Error::TooBig) {
            return;
        }
        let source: IpAddr = match info.dst {
            IpAddr::V4(d) => self.config.source_v4.unwrap_or(d).into(),
            IpAddr::V6(d) => self.config.source_v6.unwrap_or(d).into(),
        };
        if source.is_multicast() || source.is_unspecified() {
            return; // e.g. Packet Too Big about a multicast packet, with no source_v6 configured
        }
        if !self.bucket.take(out.now()) {
            self.m.icmp_limited.add(1);
            return;
        }
        let mtu = self.config.mtu;
        let mut e = out.pool().alloc();
        e.set_direction(reverse(p.direction()));
        if let Some(face) = p.meta().get(MetaKey::IN_FACE) {
            e.meta_mut().set(MetaKey::IN_FACE, face);
        }
        let original = &p.data()[..info.total_len];
        match source {
            IpAddr::V4(src) => {
                let (t, c, rest) = match kind {
                    Error::TimeExceeded => (types::TIME_EXCEEDED, 0, [0; 4]),
                    Error::TooBig => {
                        let m = (mtu as u16).to_be_bytes();
                        (types::DEST_UNREACHABLE, types::CODE_FRAG_NEEDED, [0, 0, m[0], m[1]])
                    }
                };
                icmp::write_error_v4(e.make_mut(), src, original, t, c, rest);
            }
            IpAddr::V6(src) => {
                let (t, rest) = match kind {
                    Error::TimeExceeded => (types::V6_TIME_EXCEEDED, [0; 4]),
                    Error::TooBig => (types::V6_PACKET_TOO_BIG, (mtu as u32).to_be_bytes()),
                };
                icmp::write_error_v6(e.make_mut(), src, original, t, 0, rest);
            }
        }
        self.m.icmp_errors.add(1);
        out.emit(PORT_ICMP, e);
    }

    /// Cuts the IPv4 packet `p` (TTL already handled) into fragments of at most `mtu` bytes, emitted on `out`.
    /// Returns false (nothing emitted) if the pieces would not fit the 13-bit offset field.
    fn fragment(&mut self, info: &PacketInfo, p: &Packet, out: &mut Output<'_>) -> bool {
        let data = p.data();
        let hlen = info.l4_offset;
        let payload = &data[hlen..info.total_len];
        let (base_offset, base_more) = info.fragment.map_or((0, false), |f| (f.offset as usize, f.more));
        if base_offset + payload.len() > 65535 {
            return false;
        }
        // The header of later fragments: the fixed header and the options with the copy flag (RFC 791).
        let mut later = [0u8; 60];
        later[..20].copy_from_slice(&data[..20]);
        let mut later_len = 20;
        let mut i = 20;
        while i < hlen {
            match data[i] {
                0 => break,
                1 => i += 1,
                t => {
                    let Some(&l) = data.get(i + 1).filter(|_| i + 1 < hlen) else { break };
                    let l = usize::from(l);
                    if l < 2 || i + l > hlen {
                        break;
                    }
                    if t & 0x80 != 0 {
                        later[later_len..later_len + l].copy_from_slice(&data[i..i + l]);
                        later_len += l;
                    }
                    i += l;
                }
            }
        }
        later_len = later_len.div_ceil(4) * 4; // padded with end-of-options (zero) bytes
        let mtu = self.config.mtu as usize;
        let mut pos = 0;
        let mut made = 0;
        while pos < payload.len() {
            let header = if pos == 0 { &data[..hlen] } else { &later[..later_len] };
            let room = (mtu - header.len()) / 8 * 8;
            let n = (payload.len() - pos).min(room);
            let last = pos + n == payload.len();
            let mut f = out.pool().alloc();
            f.set_direction(p.direction());
            *f.meta_mut() = *p.meta();
            let b = f.make_mut();
            b.extend_from_slice(header);
            b.extend_from_slice(&payload[pos..pos + n]);
            let total = (header.len() + n) as u16;
            b[0] = 0x40 | (header.len() / 4) as u8;
            b[2..4].copy_from_slice(&total.to_be_bytes());
            let flags_offset = if !last || base_more { 0x2000 } else { 0 } | ((base_offset + pos) / 8) as u16;
            b[6..8].copy_from_slice(&flags_offset.to_be_bytes());
            b[10] = 0;
            b[11] = 0;
            let c = checksum::ipv4_header(&b[..header.len()]);
            b[10..12].copy_from_slice(&c.to_be_bytes());
            out.emit(PORT_OUT, f);
            made += 1;
            pos += n;
        }
        self.m.fragments_made.add(made);
        self.m.fragmented.add(1);
        true
    }

    /// True if super-packet `p` (described by `gso`) can be forwarded whole: it parses, its IP length is its
    /// length, its TTL / hop limit is not exhausted and its segments fit the MTU.
    fn takes_whole(&self, p: &Packet, gso: &Gso) -> bool {
        let Ok(info) = PacketInfo::parse(p.data()) else { return false };
        let c = &self.config;
        let segment = u64::from(gso.hdr_len) + u64::from(gso.gso_size);
        info.total_len == p.len() && !(c.decrement_ttl && info.hop_limit <= 1) && (c.mtu == 0 || segment <= c.mtu)
    }

    fn handle(&mut self, mut p: Packet, out: &mut Output<'_>) {
        let whole = Gso::of(p.meta()).filter(|g| g.segments(p.len()) > 1);
        if let Some(gso) = whole.filter(|g| !self.takes_whole(&p, g)) {
            let mut segments = Batch::new();
            if flexstack_core::switch::segment_packet(out.pool(), &p, &gso, &mut segments).is_some() {
                for s in segments {
                    if let Frame::Data(s) = s {
                        self.handle(s, out);
                    }
                }
                return;
            }
            // Its bytes do not match its description: one long packet.
            p.meta_mut().remove(MetaKey::GSO);
            return self.handle(p, out);
        }
        self.m.packets.add(p.wire_packets());
        self.m.bytes.add(p.wire_bytes());
        let info = match PacketInfo::parse(p.data()) {
            Ok(info) => info,
            Err(e) => {
                self.parse_drops.count(e);
                out.drop_frame(p.into());
                return;
            }
        };
        let c = &self.config;
        // A super-packet's checksum field holds no checksum yet (see MetaKey::GSO).
        if c.verify_l4_checksums && whole.is_none() && !l4_checksum_ok(&info, p.data()) {
            self.m.bad_l4.add(1);
            out.drop_frame(p.into());
            return;
        }
        if c.decrement_ttl && info.hop_limit <= 1 {
            self.m.ttl_exceeded.add(1);
            self.send_error(&info, &p, Error::TimeExceeded, out);
            out.drop_frame(p.into());
            return;
        }
        let too_big = whole.is_none() && c.mtu != 0 && info.total_len as u64 > c.mtu;
        if too_big && (info.version == 6 || Ipv4Packet::new_unchecked(p.data()).dont_frag()) {
            self.m.too_big.add(1);
            self.send_error(&info, &p, Error::TooBig, out);
            out.drop_frame(p.into());
            return;
        }
        if p.len() > info.total_len {
            p.truncate(info.total_len);
        }
        if c.decrement_ttl {
            let d = p.data_mut();
            if info.version == 4 {
                let old = [d[8], d[9]];
                d[8] -= 1;
                let ck = checksum::update(u16::from_be_bytes([d[10], d[11]]), &old, &[d[8], d[9]]);
                d[10..12].copy_from_slice(&ck.to_be_bytes());
            } else {
                d[7] -= 1;
            }
        }
        if !too_big {
            out.emit(PORT_OUT, p);
        } else if !self.fragment(&info, &p, out) {
            self.m.too_big.add(1);
            out.drop_frame(p.into());
        }
    }
}

impl Module for Ip {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        for frame in input.drain(..) {
            match frame {
                Frame::Data(p) => self.handle(p, out),
                control => out.emit(PORT_OUT, control),
            }
        }
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        DECL.write(&mut self.config, knob, value)?;
        if knob == "icmp_rate" {
            self.bucket = Bucket::new(self.config.icmp_rate);
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod testkit {
    //! Helpers shared by this crate's module tests (ip, reassemble, icmp): loading modules, a recorder,
    //! injecting byte vectors, reading meters, and checking every checksum of a packet by recomputation.

    pub use crate::catalog;
    pub use crate::testutil::{assert_config_error, configure_toml, knob, link, load, u64_var, var};
    use flexstack_core::{Direction, Switch};
    use flexstack_wire::checksum;
    use flexstack_wire::packet::{proto, PacketInfo};
    pub use flexstack_wire::testkit::{a6, b6, A4, B4};

    /// Injects packets with the given bytes into input `in` of `module`.
    pub fn inject(sw: &mut Switch, module: &str, packets: &[&[u8]], direction: Direction) {
        crate::testutil::inject_into(sw, module, "in", packets, direction);
    }

    pub use flexstack_core::testing::{Log, Recorder, Seen};

    /// Asserts that `packet` parses and that its IPv4 header checksum and (for a whole packet) its TCP, UDP,
    /// ICMP or ICMPv6 checksum are right, recomputing each from scratch.
    pub fn assert_checksums(packet: &[u8]) {
        let info = PacketInfo::parse(packet).unwrap_or_else(|e| panic!("emitted packet does not parse: {e}"));
        if info.version == 4 {
            let mut h = packet[..info.l4_offset].to_vec();
            let stored = u16::from_be_bytes([h[10], h[11]]);
            h[10] = 0;
            h[11] = 0;
            let want = checksum::ipv4_header(&h);
            assert!(stored == want || (stored ^ want) == 0xffff, "IPv4 header checksum {stored:04x} != {want:04x}");
        }
        if info.fragment.is_some() {
            return;
        }
        let at = match (info.version, info.protocol) {
            (_, proto::TCP) => 16,
            (_, proto::UDP) => 6,
            (4, proto::ICMP) | (6, proto::ICMPV6) => 2,
            _ => return,
        };
        let mut l4 = packet[info.l4_offset..info.total_len].to_vec();
        let stored = u16::from_be_bytes([l4[at], l4[at + 1]]);
        if info.version == 4 && info.protocol == proto::UDP && stored == 0 {
            return;
        }
        l4[at] = 0;
        l4[at + 1] = 0;
        let initial = if info.version == 4 && info.protocol == proto::ICMP {
            0
        } else {
            checksum::pseudo_header(info.src, info.dst, info.protocol, l4.len() as u32)
        };
        let want = checksum::finish(checksum::sum(initial, &l4));
        assert!(stored == want || (stored ^ want) == 0xffff, "transport checksum {stored:04x} != {want:04x}");
    }
}

#[cfg(test)]
mod tests {
    use super::testkit::*;
    use super::*;
    use flexstack_core::Switch;
    use flexstack_wire::packet::build;

    fn udp4(ttl: u8, data: &[u8]) -> Vec<u8> {
        build::ipv4(A4, B4, proto::UDP, ttl, &build::udp(A4.into(), B4.into(), 1000, 2000, data))
    }

    fn udp6(hops: u8, data: &[u8]) -> Vec<u8> {
        build::ipv6(a6(), b6(), proto::UDP, hops, &build::udp(a6().into(), b6().into(), 1000, 2000, data))
    }

    /// An IPv4 packet without DF.
    fn no_df(mut p: Vec<u8>) -> Vec<u8> {
        p[6] &= !0x40;
        p[10] = 0;
        p[11] = 0;
        let c = checksum::ipv4_header(&p[..20]);
        p[10..12].copy_from_slice(&c.to_be_bytes());
        p
    }

    struct Stack {
        sw: Switch,
        out: Log,
        icmp: Log,
        t: u64,
    }

    impl Stack {
        fn new(args: &[&str]) -> Stack {
            let mut sw = Switch::default();
            let (o, out) = Recorder::load("o");
            let (i, icmp) = Recorder::load("e");
            sw.apply(vec![load("ip", "ip", args), o, i, link("ip[out] -> o"), link("ip[icmp] -> e")]).unwrap();
            Stack { sw, out, icmp, t: 0 }
        }

        fn send(&mut self, packets: &[&[u8]]) {
            inject(&mut self.sw, "ip", packets, Direction::Up);
            self.t += 1;
            self.sw.run(Time::from_millis(self.t));
        }

        fn out(&self) -> Vec<Seen> {
            std::mem::take(&mut *self.out.lock().unwrap())
        }

        fn icmp(&self) -> Vec<Seen> {
            std::mem::take(&mut *self.icmp.lock().unwrap())
        }

        fn meter(&self, name: &str) -> u64 {
            u64_var(&self.sw, &format!("module.ip.{name}"))
        }
    }

    #[test]
    fn forwards_and_decrements_ttl_with_valid_checksums() {
        let mut s = Stack::new(&[]);
        let p4 = udp4(64, b"hello");
        let p6 = udp6(9, b"hello6");
        let t4 = build::ipv4(A4, B4, proto::TCP, 2, &build::tcp(A4.into(), B4.into(), 5, 80, b"x"));
        s.send(&[&p4, &p6, &t4]);
        let out = s.out();
        assert_eq!(out.len(), 3);
        for o in &out {
            assert_checksums(&o.data);
            assert_eq!(o.direction, Direction::Up);
        }
        assert_eq!(out[0].data[8], 63);
        assert_eq!(&out[0].data[12..], &p4[12..]);
        assert_eq!(out[1].data[7], 8);
        assert_eq!(&out[1].data[8..], &p6[8..]);
        assert_eq!(out[2].data[8], 1);
        assert_eq!(s.meter("packets_total"), 3);
        assert_eq!(s.meter("bytes_total"), (p4.len() + p6.len() + t4.len()) as u64);
        // Every TTL value: the incremental update always gives a header that verifies.
        let all: Vec<Vec<u8>> = (2..=255).map(|ttl| udp4(ttl, b"z")).collect();
        let refs: Vec<&[u8]> = all.iter().map(|v| v.as_slice()).collect();
        s.send(&refs);
        let out = s.out();
        assert_eq!(out.len(), 254);
        for (o, ttl) in out.iter().zip(2u8..=255) {
            assert_eq!(o.data[8], ttl - 1);
            assert_checksums(&o.data);
        }
    }

    #[test]
    fn decrement_off_leaves_packets_alone_and_pads_are_cut() {
        let mut s = Stack::new(&["decrement_ttl=false"]);
        let p4 = udp4(1, b"hello");
        let mut padded = p4.clone();
        padded.extend_from_slice(&[0; 12]);
        s.send(&[&p4, &padded]);
        let out = s.out();
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].data, p4);
        assert_eq!(out[1].data, p4);
        assert_eq!(var(&s.sw, "module.ip.decrement_ttl"), Value::Bool(false));
    }

    #[test]
    fn ttl_exceeded_sends_time_exceeded() {
        let mut s = Stack::new(&["source_v4=\"192.0.2.1\""]);
        let p4 = udp4(1, b"hello");
        let p6 = udp6(0, b"hello");
        s.send(&[&p4, &p6]);
        assert!(s.out().is_empty());
        let icmp = s.icmp();
        assert_eq!(icmp.len(), 2);
        for e in &icmp {
            assert_checksums(&e.data);
            assert_eq!(e.direction, Direction::Down);
        }
        let i4 = PacketInfo::parse(&icmp[0].data).unwrap();
        assert_eq!((i4.src, i4.dst, i4.icmp), (Ipv4Addr::new(192, 0, 2, 1).into(), A4.into(), Some((11, 0))));
        assert_eq!(&icmp[0].data[28..], &p4[..], "the packet as it arrived is quoted");
        let i6 = PacketInfo::parse(&icmp[1].data).unwrap();
        assert_eq!((i6.src, i6.dst, i6.icmp), (b6().into(), a6().into(), Some((3, 0))));
        assert_eq!(&icmp[1].data[48..], &p6[..]);
        assert_eq!(s.meter("drop_ttl_exceeded_total"), 2);
        assert_eq!(s.meter("icmp_errors_total"), 2);
        assert_eq!(s.meter("frames_dropped_total"), 2);
    }

    #[test]
    fn no_errors_about_errors_fragments_or_bad_sources() {
        let mut s = Stack::new(&[]);
        let err = icmp::error_v4(B4, &udp4(1, b"x"), 11, 0, [0; 4]);
        let mut err_ttl1 = err.clone();
        err_ttl1[8] = 1;
        err_ttl1[10] = 0;
        err_ttl1[11] = 0;
        let c = checksum::ipv4_header(&err_ttl1[..20]);
        err_ttl1[10..12].copy_from_slice(&c.to_be_bytes());
        let bcast = build::ipv4(A4, Ipv4Addr::BROADCAST, proto::UDP, 1, &[0; 8]);
        let mut frag = vec![proto::UDP, 0, 0, 16 | 1, 0, 0, 0, 9];
        frag.extend_from_slice(&[0; 16]);
        let frag6 = build::ipv6(a6(), b6(), proto::FRAGMENT, 1, &frag);
        s.send(&[&err_ttl1, &bcast, &frag6]);
        assert!(s.icmp().is_empty());
        assert_eq!(s.meter("drop_ttl_exceeded_total"), 3);
        assert_eq!(s.meter("icmp_errors_total"), 0);
    }

    #[test]
    fn too_big_with_df_and_v6_sends_errors() {
        let mut s = Stack::new(&["mtu=1280"]);
        let p4 = udp4(64, &[1; 1400]);
        let p6 = udp6(64, &[2; 1400]);
        let ok = udp4(64, &[3; 1252]);
        s.send(&[&p4, &p6, &ok]);
        let out = s.out();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].data.len(), 1280);
        let icmp = s.icmp();
        assert_eq!(icmp.len(), 2);
        for e in &icmp {
            assert_checksums(&e.data);
        }
        assert_eq!((&icmp[0].data[20..22], &icmp[0].data[24..28]), (&[3, 4][..], &[0, 0, 5, 0][..]));
        assert_eq!(icmp[0].data.len(), icmp::MAX_ERROR_V4);
        assert_eq!((&icmp[1].data[40..42], &icmp[1].data[44..48]), (&[2, 0][..], &[0, 0, 5, 0][..]));
        assert_eq!(icmp[1].data.len(), icmp::MAX_ERROR_V6);
        assert_eq!(s.meter("drop_too_big_total"), 2);
        // The quoted packet is the original, TTL not decremented.
        assert_eq!(icmp[0].data[28 + 8], 64);
    }

    #[test]
    fn fragments_ipv4_without_df() {
        let mut s = Stack::new(&["mtu=576"]);
        let data: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
        let p = no_df(udp4(64, &data));
        s.send(&[&p]);
        let out = s.out();
        assert_eq!(out.len(), 6, "3028 bytes of payload in pieces of 552");
        let mut payload = Vec::new();
        for (k, f) in out.iter().enumerate() {
            assert!(f.data.len() <= 576);
            assert_checksums(&f.data);
            let info = PacketInfo::parse(&f.data).unwrap();
            let fr = info.fragment.unwrap();
            assert_eq!(fr.offset as usize, payload.len());
            assert_eq!(fr.more, k < 5);
            assert_eq!(info.hop_limit, 63);
            assert_eq!(fr.id, 0x1234);
            payload.extend_from_slice(&f.data[20..]);
        }
        assert_eq!(payload, &p[20..]);
        assert_eq!(s.meter("fragments_made_total"), 6);
        assert_eq!(s.meter("packets_fragmented_total"), 1);
    }

    #[test]
    fn fragmenting_copies_only_copied_options() {
        let mut s = Stack::new(&["mtu=100"]);
        // Options: a security-like option with the copy flag (type 0x82, length 4), a record route without it
        // (type 7, length 7, pointer 4), a NOP: 12 bytes, header 32.
        let body = vec![9u8; 200];
        let mut p = no_df(build::ipv4(A4, B4, 200, 64, &body));
        p.splice(20..20, [0x82, 4, 0xaa, 0xbb, 7, 7, 4, 0, 0, 0, 0, 1]);
        p[0] = 0x48;
        let total = p.len() as u16;
        p[2..4].copy_from_slice(&total.to_be_bytes());
        p[10] = 0;
        p[11] = 0;
        let c = checksum::ipv4_header(&p[..32]);
        p[10..12].copy_from_slice(&c.to_be_bytes());
        s.send(&[&p]);
        let out = s.out();
        assert!(out.len() >= 3);
        assert_eq!(&out[0].data[20..32], &p[20..32]);
        assert_eq!(out[0].data.len(), 32 + 64);
        for f in &out[1..] {
            assert_eq!(f.data[0] & 0x0f, 6, "20 + 4 bytes of copied options");
            assert_eq!(&f.data[20..24], &[0x82, 4, 0xaa, 0xbb]);
            assert_checksums(&f.data);
        }
        let payload: Vec<u8> = out.iter().flat_map(|f| f.data[(f.data[0] & 0x0f) as usize * 4..].to_vec()).collect();
        assert_eq!(payload, body);
    }

    #[test]
    fn verifies_transport_checksums_when_asked() {
        let mut s = Stack::new(&["verify_l4_checksums=true"]);
        let good4 = udp4(64, b"abc");
        let mut bad4 = good4.clone();
        bad4[30] ^= 0xff;
        let mut none4 = good4.clone();
        none4[26] = 0;
        none4[27] = 0;
        none4[30] ^= 0xff;
        let good6 = udp6(64, b"abc");
        let mut zero6 = good6.clone();
        zero6[46] = 0;
        zero6[47] = 0;
        let mut badtcp = build::ipv4(A4, B4, proto::TCP, 64, &build::tcp(A4.into(), B4.into(), 5, 80, b"x"));
        badtcp[40] ^= 1;
        let mut badicmp = build::ipv4(A4, B4, proto::ICMP, 64, &build::icmpv4_echo(1, 1, b"x"));
        badicmp[28] ^= 1;
        s.send(&[&good4, &bad4, &none4, &good6, &zero6, &badtcp, &badicmp]);
        assert_eq!(s.out().len(), 3);
        assert_eq!(s.meter("drop_bad_l4_checksum_total"), 4);
        s.sw.apply(vec![knob("ip", "verify_l4_checksums", Value::Bool(false))]).unwrap();
        s.send(&[&bad4]);
        assert_eq!(s.out().len(), 1);
    }

    #[test]
    fn malformed_packets_are_dropped_with_reasons() {
        let mut s = Stack::new(&[]);
        let good = udp4(64, b"x");
        let mut bad_sum = good.clone();
        bad_sum[10] ^= 1;
        let mut bad_len = good.clone();
        bad_len[3] = 200;
        s.send(&[b"", &good[..10], b"\x55xxxxxxxxxxxxxxxxxxxxxx", &bad_sum, &bad_len, &good]);
        assert_eq!(s.out().len(), 1);
        for (reason, n) in [("truncated", 2), ("bad_version", 1), ("bad_checksum", 1), ("bad_total_length", 1)] {
            assert_eq!(s.meter(&format!("drop_{reason}_total")), n, "{reason}");
        }
        assert_eq!(s.meter("frames_dropped_total"), 5);
        assert_eq!(s.meter("packets_total"), 6);
    }

    #[test]
    fn icmp_errors_are_rate_limited() {
        let mut s = Stack::new(&["icmp_rate=100"]);
        let p = udp4(1, b"x");
        let many: Vec<&[u8]> = (0..50).map(|_| p.as_slice()).collect();
        s.send(&many);
        assert_eq!(s.icmp().len(), 10, "a burst of a tenth of a second");
        assert_eq!(s.meter("icmp_errors_limited_total"), 40);
        assert_eq!(s.meter("drop_ttl_exceeded_total"), 50);
        // 100 ms later, ten more.
        s.t += 100;
        s.send(&many);
        assert_eq!(s.icmp().len(), 10);
    }

    #[test]
    fn knobs_and_settings_are_checked() {
        let mut s = Stack::new(&["mtu=1500", "source_v6=\"fd00::9\""]);
        assert_eq!(u64_var(&s.sw, "module.ip.mtu"), 1500);
        assert_eq!(var(&s.sw, "module.ip.source_v6"), Value::Str("fd00::9".into()));
        assert!(s.sw.apply(vec![knob("ip", "mtu", Value::U64(67))]).is_err() || s.meter("mtu") == 1500);
        assert_eq!(s.meter("mtu"), 1500);
        s.sw.apply(vec![knob("ip", "mtu", Value::U64(0))]).unwrap();
        assert_eq!(s.meter("mtu"), 0);
        let r = s.sw.apply(vec![knob("ip", "source_v4", Value::Str("fd00::1".into()))]);
        assert!(r.is_err() || r.unwrap().iter().any(|n| n.contains("IPv4")));
        s.sw.apply(vec![knob("ip", "source_v6", Value::Str("".into()))]).unwrap();
        assert_config_error("[modules.ip]\nkind = \"ip\"\nmtu = 20\n", Some(3), &["68..=65535"]);
        assert_config_error("[modules.ip]\nkind = \"ip\"\nsource_v4 = \"x\"\n", None, &["IPv4"]);
        assert_config_error("[modules.ip]\nkind = \"ip\"\nttl = 3\n", None, &["unknown setting `ttl`"]);
    }
}
