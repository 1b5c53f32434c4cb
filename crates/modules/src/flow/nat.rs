//! `nat`: source and destination address (and port) translation for IPv4 and IPv6, TCP, UDP and ICMP echo, with
//! the checksums updated incrementally (RFC 1624), and ICMP errors that quote a translated packet translated too.
//!
//! Its ports, settings, knobs and meters are declared once, in `DECL` below; docs/modules.md lists them.
//!
//! - Ports: every packet from `inside` leaves on `to_outside` and every packet from `outside` on `to_inside`,
//!   translated or not; packets no rule or binding covers pass unchanged.
//! - Rules (the `rules` setting, one string each) are each one of:
//!   - `snat [tcp|udp|icmp] PREFIX to ADDR` (e.g. `snat 10.77.0.0/24 to 192.0.2.10`, `snat fd77::/64 to fd00::10`):
//!     packets from the inside whose source lies in PREFIX leave with source ADDR and a source port from
//!     `port_range` (the inside port is kept when it lies in the range and is free). A binding is made per (protocol,
//!     inside address, inside port) on the first packet out and is shared by every destination
//!     (endpoint-independent mapping); packets from the outside to ADDR at the bound port go back to the inside
//!     endpoint, whoever sends them (endpoint-independent filtering: filtering is the firewall's job). For ICMP echo
//!     the identifier plays the part of the port; only an echo request makes a binding.
//!   - `dnat [tcp|udp|icmp] ADDR[:PORT] to ADDR[:PORT]` (e.g. `dnat tcp 192.0.2.10:8080 to 10.77.0.2:80`,
//!     `dnat udp [fd00::10]:53 to [fd77::2]:5353`, `dnat 192.0.2.11 to 10.77.0.3`): packets from the outside to the
//!     first address (and port) go to the second (the port is kept when none is given; ports need `tcp` or `udp`).
//!     A binding is made per connection (protocol, remote endpoint, public endpoint) on its first packet in; the
//!     inside host's replies leave with the public address and port as source. SNAT never hands out a port that a
//!     DNAT rule forwards on the same address.
//!
//!   On the way out, a packet that belongs to a DNAT connection is translated as its reply before any SNAT rule is
//!   tried; on the way in, DNAT connections come first, then SNAT bindings, then DNAT rules. Rules are tried in
//!   order; the first that matches makes the binding. A rule that does not parse fails the configuration with the
//!   rule's number and text, the word at fault and what was expected.
//! - ICMP errors (destination unreachable, time exceeded, parameter problem, packet too big, ...) arriving from the
//!   outside that quote a packet sent through a binding get their outer destination and the quoted packet's source
//!   address and port translated back; errors sent by an inside host about a packet it received through a binding
//!   get their outer source and the quoted destination translated. The quoted IPv4 header checksum and the quoted
//!   transport checksum (when quoted) are updated, and the outer ICMP checksum is adjusted by the change of the
//!   quoted bytes' sum.
//! - Checksums: the IPv4 header checksum, and the TCP, UDP and ICMPv6 checksums over the changed address (their
//!   pseudo-header) and port; the ICMPv4 checksum over a changed echo identifier only (no pseudo-header). A UDP
//!   checksum of 0 (none) stays 0.
//! - Bindings expire after the idle timeouts of the timeout knobs (a TCP binding that saw a RST or a FIN from both
//!   sides after `tcp_closing_timeout_ms`; `other_timeout_ms` is unused: other protocols are not translated);
//!   expiry runs from the module's poll.
//! - Non-first fragments carry no ports and pass untranslated: put reassembly before NAT.
//! - `icmp_errors_translated_total` also counts in `translated_total`. Packets that do not parse are dropped and
//!   counted by reason (`drop_<reason>_total`), control frames in `drop_not_packet_total`.
//!
//! On `module replace` with state kept, the new module continues the old one's bindings.

use crate::flow::table::{tcp_flags, timeouts_in_field, Expiring, Idle, Slab, Timeouts, Timers};
use flexstack_core::module::port_type;
use flexstack_core::{
    field, kind_from_decl, Batch, ConfigError, KindDecl, Meter, MeterDecl, Module, ModuleBuilder, ModuleInterface,
    ModuleKind, ModuleVars, Output, Packet, Param, PortDecl, Settings, Time, Value,
};
use flexstack_wire::checksum;
use flexstack_wire::cidr::{parse_endpoint, Endpoint, PortRange, Prefix, Words};
use flexstack_wire::packet::{is_echo, proto, PacketInfo, ParseDrops};
use flexstack_wire::rewrite::{self, Layout};
use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::IpAddr;

/// The kind's name in stack files.
pub const KIND: &str = "nat";

/// Input port of packets from the inside.
pub const IN_INSIDE: usize = 0;
/// Input port of packets from the outside.
pub const IN_OUTSIDE: usize = 1;
/// Output port towards the outside.
pub const TO_OUTSIDE: usize = 0;
/// Output port towards the inside.
pub const TO_INSIDE: usize = 1;

/// Most rules of one NAT module.
pub const MAX_RULES: usize = 10_000;

/// Largest `max_bindings`.
const MAX_BINDINGS_LIMIT: u64 = 1 << 22;

// -------------------------------------------------------------------------------------------------------------
// Rules
// -------------------------------------------------------------------------------------------------------------

/// The protocols a rule can be limited to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NatProtocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
    /// ICMP echo (ICMPv4 and ICMPv6).
    Icmp,
}

impl NatProtocol {
    fn matches(self, p: u8) -> bool {
        match self {
            NatProtocol::Tcp => p == proto::TCP,
            NatProtocol::Udp => p == proto::UDP,
            NatProtocol::Icmp => p == proto::ICMP || p == proto::ICMPV6,
        }
    }

    fn name(self) -> &'static str {
        match self {
            NatProtocol::Tcp => "tcp",
            NatProtocol::Udp => "udp",
            NatProtocol::Icmp => "icmp",
        }
    }
}

/// A parsed NAT rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NatRule {
    /// Rewrite sources in `from` (going out) to `to`.
    Snat {
        /// Limited to this protocol, if given.
        protocol: Option<NatProtocol>,
        /// Inside sources translated.
        from: Prefix,
        /// The public address.
        to: IpAddr,
    },
    /// Rewrite destinations `dst[:port]` (coming in) to `to[:to_port]`.
    Dnat {
        /// Limited to this protocol, if given.
        protocol: Option<NatProtocol>,
        /// Public address matched.
        dst: IpAddr,
        /// Public port matched (any when `None`).
        port: Option<u16>,
        /// Inside address.
        to: IpAddr,
        /// Inside port (the packet's when `None`).
        to_port: Option<u16>,
    },
}

impl NatRule {
    /// Parses one rule; the error names the word at fault and what was expected there.
    pub fn parse(text: &str) -> Result<NatRule, String> {
        let mut w = Words::new(text);
        let kind = w.next("`snat` or `dnat`")?;
        if kind != "snat" && kind != "dnat" {
            return Err(w.error_last("expected `snat` or `dnat`"));
        }
        let protocol = match w.peek() {
            Some("tcp") => Some(NatProtocol::Tcp),
            Some("udp") => Some(NatProtocol::Udp),
            Some("icmp") => Some(NatProtocol::Icmp),
            _ => None,
        };
        if protocol.is_some() {
            w.next("a protocol")?;
        }
        let rule = if kind == "snat" {
            let what = if protocol.is_some() {
                "the inside prefix (10.77.0.0/24, fd77::/64)"
            } else {
                "tcp, udp, icmp or the inside prefix (10.77.0.0/24, fd77::/64)"
            };
            let p = w.next(what)?;
            let from = Prefix::parse(p).map_err(|e| w.error_last(&e))?;
            if !w.eat("to") {
                return Err(w.error("`to`"));
            }
            let a = w.next("the public address after `to`")?;
            let to: IpAddr =
                a.parse().map_err(|_| w.error_last("expected the public address (192.0.2.10, fd00::10)"))?;
            if to.is_ipv4() != from.is_ipv4() {
                return Err(w.error_last(&format!("{to} is not of the same address family as {from}")));
            }
            NatRule::Snat { protocol, from, to }
        } else {
            let what = if protocol.is_some() {
                "the public address with an optional port (192.0.2.10:8080, [fd00::10]:80)"
            } else {
                "tcp, udp, icmp or the public address (192.0.2.10, fd00::10)"
            };
            let d = w.next(what)?;
            let (dst, port) = parse_endpoint(d).map_err(|e| w.error_last(&e))?;
            let ports_ok = matches!(protocol, Some(NatProtocol::Tcp | NatProtocol::Udp));
            if port.is_some() && !ports_ok {
                return Err(w.error_last("a port needs the protocol tcp or udp before it (dnat tcp ADDR:PORT ...)"));
            }
            if !w.eat("to") {
                return Err(w.error("`to`"));
            }
            let t = w.next("the inside address with an optional port after `to`")?;
            let (to, to_port) = parse_endpoint(t).map_err(|e| w.error_last(&e))?;
            if to_port.is_some() && port.is_none() {
                return Err(w.error_last("an inside port needs a public port to match (dnat tcp ADDR:PORT to ...)"));
            }
            if to.is_ipv4() != dst.is_ipv4() {
                return Err(w.error_last(&format!("{to} is not of the same address family as {dst}")));
            }
            NatRule::Dnat { protocol, dst, port, to, to_port }
        };
        w.end("the end of the rule")?;
        Ok(rule)
    }
}

impl fmt::Display for NatRule {
    /// The rule in the form [`NatRule::parse`] reads back equal.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ep = |a: IpAddr, p: Option<u16>| match p {
            Some(p) => Endpoint(a, p).to_string(),
            None => a.to_string(),
        };
        let (kind, protocol) = match self {
            NatRule::Snat { protocol, .. } => ("snat", protocol),
            NatRule::Dnat { protocol, .. } => ("dnat", protocol),
        };
        f.write_str(kind)?;
        if let Some(p) = protocol {
            write!(f, " {}", p.name())?;
        }
        match self {
            NatRule::Snat { from, to, .. } => write!(f, " {from} to {to}"),
            NatRule::Dnat { dst, port, to, to_port, .. } => {
                write!(f, " {} to {}", ep(*dst, *port), ep(*to, *to_port))
            }
        }
    }
}

/// Parses a list of rules; the error says which rule (1-based), its text and what is wrong.
pub fn parse_rules(rules: &[String]) -> Result<Vec<NatRule>, String> {
    if rules.len() > MAX_RULES {
        return Err(format!("{} rules: at most {MAX_RULES} are allowed", rules.len()));
    }
    rules
        .iter()
        .enumerate()
        .map(|(i, text)| NatRule::parse(text).map_err(|e| format!("rule {} {text:?}: {e}", i + 1)))
        .collect()
}

// -------------------------------------------------------------------------------------------------------------
// ICMP messages, and the packets ICMP errors quote
// -------------------------------------------------------------------------------------------------------------

fn read16(buf: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([buf[at], buf[at + 1]])
}

fn is_echo_request(protocol: u8, ty: u8) -> bool {
    matches!((protocol, ty), (proto::ICMP, 8) | (proto::ICMPV6, 128))
}

fn is_icmp_error(protocol: u8, ty: u8) -> bool {
    matches!((protocol, ty), (proto::ICMP, 3 | 4 | 5 | 11 | 12) | (proto::ICMPV6, 1..=4))
}

/// The packet quoted in an ICMP error: its layout (relative to its start), addresses and ports (or echo id).
struct Quoted {
    layout: Layout,
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    dport: u16,
}

fn quoted(b: &[u8]) -> Option<Quoted> {
    let (v6, protocol, l4, src, dst) = match b.first()? >> 4 {
        4 if b.len() >= 20 => {
            let ihl = usize::from(b[0] & 0x0f) * 4;
            let frag_offset = u16::from_be_bytes([b[6] & 0x1f, b[7]]);
            if ihl < 20 || ihl > b.len() || frag_offset != 0 {
                return None;
            }
            let src: [u8; 4] = b[12..16].try_into().ok()?;
            let dst: [u8; 4] = b[16..20].try_into().ok()?;
            (false, b[9], ihl, IpAddr::from(src), IpAddr::from(dst))
        }
        6 if b.len() >= 40 => {
            let src: [u8; 16] = b[8..24].try_into().ok()?;
            let dst: [u8; 16] = b[24..40].try_into().ok()?;
            (true, b[6], 40, IpAddr::from(src), IpAddr::from(dst))
        }
        _ => return None,
    };
    let l4b = &b[l4..];
    let (sport, dport, echo) = match protocol {
        proto::TCP | proto::UDP if l4b.len() >= 4 => (read16(l4b, 0), read16(l4b, 2), false),
        proto::ICMP | proto::ICMPV6 if l4b.len() >= 6 && is_echo(protocol, l4b[0]) => {
            let id = read16(l4b, 4);
            (id, id, true)
        }
        _ => return None,
    };
    if (protocol == proto::ICMP && v6) || (protocol == proto::ICMPV6 && !v6) {
        return None;
    }
    // Quoted bytes are at most an ICMP error's payload.
    let layout = Layout { v6, protocol, l4: l4 as u32, end: b.len() as u32, transport: true, echo };
    Some(Quoted { layout, src, dst, sport, dport })
}

// -------------------------------------------------------------------------------------------------------------
// Bindings
// -------------------------------------------------------------------------------------------------------------

/// Lookup keys of bindings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Key {
    /// SNAT, going out: (protocol, inside endpoint).
    SnatOut(u8, IpAddr, u16),
    /// SNAT, coming in: (protocol, public endpoint).
    SnatIn(u8, IpAddr, u16),
    /// DNAT, coming in: (protocol, remote endpoint, public endpoint).
    DnatIn(u8, IpAddr, u16, IpAddr, u16),
    /// DNAT, going out: (protocol, inside endpoint, remote endpoint).
    DnatOut(u8, IpAddr, u16, IpAddr, u16),
}

#[derive(Clone, Debug)]
struct Binding {
    /// Its id, protocol, idle timer and TCP end.
    idle: Idle,
    inside: (IpAddr, u16),
    outside: (IpAddr, u16),
    /// The remote endpoint of a DNAT connection; `None` for SNAT.
    remote: Option<(IpAddr, u16)>,
}

impl Expiring for Binding {
    fn idle(&mut self) -> &mut Idle {
        &mut self.idle
    }
}

impl Binding {
    fn keys(&self) -> [Key; 2] {
        let p = self.idle.protocol;
        let (i, o) = (self.inside, self.outside);
        match self.remote {
            None => [Key::SnatOut(p, i.0, i.1), Key::SnatIn(p, o.0, o.1)],
            Some(r) => [Key::DnatIn(p, r.0, r.1, o.0, o.1), Key::DnatOut(p, i.0, i.1, r.0, r.1)],
        }
    }
}

/// The binding table: what a NAT module hands to its replacement.
#[derive(Default)]
struct Table {
    bindings: Slab<Binding>,
    index: HashMap<Key, u32>,
    timers: Timers,
    /// SNAT bindings per (protocol, public address).
    used: HashMap<(u8, IpAddr), u32>,
    cursor: u32,
    next_id: u64,
    created: u64,
    expired: u64,
}

impl Table {
    /// The binding a packet from `src` to `dst` belongs to, going out (`out`: from the inside) or coming in: a
    /// DNAT connection's, else an SNAT binding's.
    fn find(&self, protocol: u8, out: bool, src: (IpAddr, u16), dst: (IpAddr, u16)) -> Option<u32> {
        let (dnat, snat) = if out {
            (Key::DnatOut(protocol, src.0, src.1, dst.0, dst.1), Key::SnatOut(protocol, src.0, src.1))
        } else {
            (Key::DnatIn(protocol, src.0, src.1, dst.0, dst.1), Key::SnatIn(protocol, dst.0, dst.1))
        };
        self.index.get(&dnat).or_else(|| self.index.get(&snat)).copied()
    }
}

/// Why a packet was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refused {
    PortsExhausted,
    BindingsFull,
    Conflict,
}

// -------------------------------------------------------------------------------------------------------------
// The kind
// -------------------------------------------------------------------------------------------------------------

/// The `nat` module kind.
pub struct NatKind;

/// The settings and knobs of a NAT module besides its rules (`Default` is a blank to read them into: the defaults
/// are declared in `DECL`).
#[derive(Clone, Copy, Debug)]
struct Config {
    port_range: PortRange,
    max_bindings: u64,
    timeouts: Timeouts,
}

impl Default for Config {
    fn default() -> Config {
        Config { port_range: PortRange { first: 0, last: 0 }, max_bindings: 0, timeouts: Timeouts::default() }
    }
}

timeouts_in_field!(Config);

/// Checks and sets `port_range`: `FIRST-LAST`, not starting at 0.
fn set_port_range(c: &mut Config, text: &str) -> Result<(), String> {
    let range = PortRange::parse(text).map_err(|e| format!("{e}; expected FIRST-LAST, e.g. 20000-59999"))?;
    if range.first == 0 {
        return Err("port 0 cannot be handed out; start at 1 or above".into());
    }
    c.port_range = range;
    Ok(())
}

type P = Param<Config>;

/// The settings and knobs: `rules` (read by hand), `port_range`, `max_bindings`, the timeouts.
const PARAMS: [P; 8] = {
    let t = Timeouts::params::<Config>();
    [
        P::manual("rules", "array of strings", "snat and dnat rules, in order: the first that matches binds", "none"),
        P::text(
            "port_range",
            "`FIRST-LAST`: the ports SNAT hands out",
            "20000-59999",
            |c| format!("{}-{}", c.port_range.first, c.port_range.last),
            set_port_range,
        )
        .setting(),
        P::u64("max_bindings", "bindings", "most bindings in the table", 65_536, field!(max_bindings))
            .range(0.0, MAX_BINDINGS_LIMIT as f64)
            .setting(),
        t[0],
        t[1],
        t[2],
        t[3],
        t[4],
    ]
};

/// The kind: ports, settings, knobs and meters.
const DECL: KindDecl<Config, Meters> = KindDecl {
    inputs: &[
        PortDecl::new("inside", port_type::IP, "packets from the inside hosts, going out"),
        PortDecl::new("outside", port_type::IP, "packets from the network, coming in"),
    ],
    outputs: &[
        PortDecl::new("to_outside", port_type::IP, "every packet from `inside`, translated or not"),
        PortDecl::new("to_inside", port_type::IP, "every packet from `outside`, translated or not"),
    ],
    params: &PARAMS,
    meters: &[
        MeterDecl::u64("bindings_active", "bindings", "bindings in the table", |m| &mut m.active),
        MeterDecl::u64("bindings_created_total", "bindings", "bindings made", |m| &mut m.created),
        MeterDecl::u64("bindings_expired_total", "bindings", "bindings expired", |m| &mut m.expired),
        MeterDecl::u64("translated_total", "frames", "packets translated", |m| &mut m.translated),
        MeterDecl::u64("untranslated_total", "frames", "packets passed unchanged (no rule or binding)", |m| {
            &mut m.untranslated
        }),
        MeterDecl::u64(
            "icmp_errors_translated_total",
            "frames",
            "ICMP errors whose quoted packet was translated",
            |m| &mut m.icmp_errors,
        ),
        MeterDecl::u64(
            "drop_ports_exhausted_total",
            "frames",
            "packets dropped: no free port for a new SNAT binding",
            |m| &mut m.exhausted,
        ),
        MeterDecl::u64("drop_bindings_full_total", "frames", "packets dropped: max_bindings reached", |m| &mut m.full),
        MeterDecl::u64(
            "drop_binding_conflict_total",
            "frames",
            "packets dropped: a new DNAT connection clashing with an existing one",
            |m| &mut m.conflict,
        ),
    ],
    more_meters: || ParseDrops::specs(true),
    // A translated flow hashes to another worker than its original: the stack runs on one worker.
    global_view: true,
    accepts_gso: true,
    ..KindDecl::new(KIND, "source and destination NAT for IPv4/IPv6 TCP, UDP and ICMP echo, with incremental checksums")
};

impl ModuleKind for NatKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(KIND);
        let texts = r.strings("rules")?.unwrap_or_default();
        let rules = parse_rules(&texts).map_err(|e| r.error("rules", e))?;
        let mut cfg = Config::default();
        DECL.read(&mut r, &mut cfg)?;
        r.finish()?;
        Ok(Box::new(NatBuilder { rules, cfg }))
    }
}

struct NatBuilder {
    rules: Vec<NatRule>,
    cfg: Config,
}

impl ModuleBuilder for NatBuilder {
    fn interface(&self) -> ModuleInterface {
        DECL.interface(&self.cfg)
    }

    /// Packets from the inside only ever leave towards the outside, and the other way round: a NAT may sit in a
    /// loop of links between an app and a link layer.
    fn paths(&self) -> Option<Vec<(String, String)>> {
        Some(vec![("inside".into(), "to_outside".into()), ("outside".into(), "to_inside".into())])
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        DECL.publish(&self.cfg, vars);
        let mut reserved = HashSet::new();
        for r in &self.rules {
            if let NatRule::Dnat { protocol: Some(p), dst, port: Some(port), .. } = r {
                let n = if *p == NatProtocol::Tcp { proto::TCP } else { proto::UDP };
                reserved.insert((n, *dst, *port));
            }
        }
        Box::new(Nat {
            rules: self.rules,
            reserved,
            cfg: self.cfg,
            table: Table::default(),
            m: DECL.meters(vars),
            drops: ParseDrops::new(vars),
        })
    }
}

/// A NAT module's meters.
#[derive(Default)]
struct Meters {
    active: Meter,
    created: Meter,
    expired: Meter,
    translated: Meter,
    untranslated: Meter,
    icmp_errors: Meter,
    exhausted: Meter,
    full: Meter,
    conflict: Meter,
}

/// A running NAT module.
pub struct Nat {
    rules: Vec<NatRule>,
    /// (protocol, public address, port) forwarded by a DNAT rule: never handed out by SNAT.
    reserved: HashSet<(u8, IpAddr, u16)>,
    cfg: Config,
    table: Table,
    m: Meters,
    drops: ParseDrops,
}

/// What to do with a packet.
enum Plan {
    /// Leave it as it is.
    Pass,
    /// Rewrite the source (`src`) or destination to this endpoint.
    Rewrite { src: bool, to: (IpAddr, u16) },
}

/// A packet's protocol, endpoints and what it is, as NAT sees it.
#[derive(Clone, Copy)]
struct Seen {
    protocol: u8,
    src: (IpAddr, u16),
    dst: (IpAddr, u16),
    /// An ICMP echo message.
    echo: bool,
    /// An ICMP echo request.
    request: bool,
    /// TCP flags.
    flags: Option<u8>,
}

impl Nat {
    /// Translates a packet from the inside (`from_inside`) or the outside in place; Ok(true) if it was translated.
    fn translate(
        &mut self,
        p: &mut Packet,
        info: &PacketInfo,
        from_inside: bool,
        out: &mut Output<'_>,
    ) -> Result<bool, Refused> {
        if info.fragment.is_some_and(|f| f.offset != 0) {
            return Ok(false);
        }
        let icmp_type = info.icmp.map(|(t, _)| t);
        let echo = icmp_type.is_some_and(|t| is_echo(info.protocol, t));
        match info.protocol {
            proto::TCP | proto::UDP => {}
            proto::ICMP | proto::ICMPV6 if echo && info.l4_len() >= 8 => {}
            proto::ICMP | proto::ICMPV6 if icmp_type.is_some_and(|t| is_icmp_error(info.protocol, t)) => {
                let done = self.translate_error(p, info, from_inside);
                if done {
                    self.m.icmp_errors.add(1);
                }
                return Ok(done);
            }
            _ => return Ok(false),
        }
        let seen = Seen {
            protocol: info.protocol,
            src: (info.src, info.src_port),
            dst: (info.dst, info.dst_port),
            echo,
            request: icmp_type.is_some_and(|t| is_echo_request(info.protocol, t)),
            flags: tcp_flags(p.data(), info),
        };
        let plan = if from_inside { self.plan_out(&seen, out)? } else { self.plan_in(&seen, out)? };
        let Plan::Rewrite { src, to } = plan else { return Ok(false) };
        rewrite::endpoint(p.data_mut(), &Layout::of(info), src, to.0, Some(to.1));
        Ok(true)
    }

    /// Notes a packet of the binding in `slot`; returns the binding.
    fn touch(&mut self, slot: u32, from_inside: bool, flags: Option<u8>, out: &mut Output<'_>) -> Option<&Binding> {
        let now = out.now().as_nanos();
        let closing_ns = self.cfg.timeouts.of(proto::TCP, true);
        let b = self.table.bindings.get_mut(slot)?;
        // SNAT connections are opened from the inside, DNAT ones from the outside.
        let tcp = flags.map(|flags| (from_inside == b.remote.is_none(), flags));
        if let Some(d) = self.table.timers.seen(slot, &mut b.idle, now, tcp, closing_ns) {
            out.wake_at(Time(d));
        }
        self.table.bindings.get(slot)
    }

    /// The plan for a packet of an existing binding (`slot`), going out (`from_inside`) or coming in: the other
    /// side's endpoint as its source going out, as its destination coming in.
    fn follow(&mut self, slot: u32, from_inside: bool, flags: Option<u8>, out: &mut Output<'_>) -> Plan {
        match self.touch(slot, from_inside, flags, out) {
            Some(b) if from_inside => Plan::Rewrite { src: true, to: b.outside },
            Some(b) => Plan::Rewrite { src: false, to: b.inside },
            None => Plan::Pass,
        }
    }

    fn plan_out(&mut self, s: &Seen, out: &mut Output<'_>) -> Result<Plan, Refused> {
        let pr = s.protocol;
        if let Some(slot) = self.table.find(pr, true, s.src, s.dst) {
            return Ok(self.follow(slot, true, s.flags, out));
        }
        if s.echo && !s.request {
            return Ok(Plan::Pass);
        }
        let rule = self.rules.iter().find_map(|r| match r {
            NatRule::Snat { protocol, from, to }
                if protocol.is_none_or(|x| x.matches(pr)) && from.contains(s.src.0) =>
            {
                Some(*to)
            }
            _ => None,
        });
        let Some(public) = rule else { return Ok(Plan::Pass) };
        self.check_room()?;
        let port = self.allocate(pr, public, s.src.1).ok_or(Refused::PortsExhausted)?;
        *self.table.used.entry((pr, public)).or_default() += 1;
        let slot = self.insert(pr, s.src, (public, port), None, out);
        self.touch(slot, true, s.flags, out);
        Ok(Plan::Rewrite { src: true, to: (public, port) })
    }

    fn plan_in(&mut self, s: &Seen, out: &mut Output<'_>) -> Result<Plan, Refused> {
        let pr = s.protocol;
        if let Some(slot) = self.table.find(pr, false, s.src, s.dst) {
            return Ok(self.follow(slot, false, s.flags, out));
        }
        if s.echo && !s.request {
            return Ok(Plan::Pass);
        }
        let rule = self.rules.iter().find_map(|r| match r {
            NatRule::Dnat { protocol, dst, port, to, to_port }
                if protocol.is_none_or(|x| x.matches(pr)) && *dst == s.dst.0 && port.is_none_or(|x| x == s.dst.1) =>
            {
                Some((*to, to_port.unwrap_or(s.dst.1)))
            }
            _ => None,
        });
        let Some(inside) = rule else { return Ok(Plan::Pass) };
        self.check_room()?;
        if self.table.index.contains_key(&Key::DnatOut(pr, inside.0, inside.1, s.src.0, s.src.1)) {
            return Err(Refused::Conflict);
        }
        let slot = self.insert(pr, inside, s.dst, Some(s.src), out);
        self.touch(slot, false, s.flags, out);
        Ok(Plan::Rewrite { src: false, to: inside })
    }

    fn check_room(&self) -> Result<(), Refused> {
        if self.table.bindings.len() as u64 >= self.cfg.max_bindings {
            Err(Refused::BindingsFull)
        } else {
            Ok(())
        }
    }

    /// A free public port for a new SNAT binding: the inside port if it is in the range and free, else the next
    /// free one in the range after the last one handed out.
    fn allocate(&mut self, protocol: u8, public: IpAddr, want: u16) -> Option<u16> {
        let range = self.cfg.port_range;
        let free = |t: &Table, p: u16| {
            !t.index.contains_key(&Key::SnatIn(protocol, public, p)) && !self.reserved.contains(&(protocol, public, p))
        };
        if range.contains(want) && free(&self.table, want) {
            return Some(want);
        }
        let n = range.count();
        if self.table.used.get(&(protocol, public)).copied().unwrap_or(0) >= n {
            return None;
        }
        for i in 0..n {
            let k = (self.table.cursor.wrapping_add(i)) % n;
            let p = (u32::from(range.first) + k) as u16;
            if free(&self.table, p) {
                self.table.cursor = (k + 1) % n;
                return Some(p);
            }
        }
        None
    }

    fn insert(
        &mut self,
        protocol: u8,
        inside: (IpAddr, u16),
        outside: (IpAddr, u16),
        remote: Option<(IpAddr, u16)>,
        out: &mut Output<'_>,
    ) -> u32 {
        let now = out.now().as_nanos();
        let t = &mut self.table;
        t.next_id += 1;
        let idle = Idle::new(t.next_id, protocol, now, &self.cfg.timeouts);
        let b = Binding { idle, inside, outside, remote };
        let keys = b.keys();
        let slot = t.bindings.insert(b);
        for k in keys {
            t.index.insert(k, slot);
        }
        t.timers.start(slot, &idle);
        out.wake_at(Time(idle.queued));
        t.created += 1;
        self.m.created.add(1);
        self.m.active.set(t.bindings.len() as u64);
        slot
    }

    /// Translates an ICMP error that quotes a packet of a binding; true if it did.
    fn translate_error(&mut self, p: &mut Packet, info: &PacketInfo, from_inside: bool) -> bool {
        let (l4, end) = (info.l4_offset, info.total_len);
        let inner = l4 + 8;
        if info.fragment.is_some() || inner >= end || end > p.len() {
            return false;
        }
        let Some(q) = quoted(&p.data()[inner..end]) else { return false };
        if q.layout.v6 != (info.version == 6) {
            return false;
        }
        // From the outside: the quoted packet is one that left through a binding (its source is public).
        // From the inside: one that arrived through a binding (its destination is the inside endpoint). Either
        // way its reply, the way the error goes, belongs to the binding.
        let slot = self.table.find(q.layout.protocol, from_inside, (q.dst, q.dport), (q.src, q.sport));
        let outer_addr = if from_inside { info.src } else { info.dst };
        let Some(b) = slot.and_then(|s| self.table.bindings.get(s)) else { return false };
        let (old, to) = if from_inside { (q.dst, b.outside) } else { (q.src, b.inside) };
        if outer_addr != old {
            return false;
        }
        let buf = p.data_mut();
        let before = checksum::sum(0, &buf[inner..end]);
        // The quoted packet: from the outside its source is rewritten, from the inside its destination.
        rewrite::endpoint(&mut buf[inner..end], &q.layout, !from_inside, to.0, Some(to.1));
        let after = checksum::sum(0, &buf[inner..end]);
        if l4 + 4 <= end {
            let c = checksum::update(
                read16(buf, l4 + 2),
                &checksum::fold(before).to_be_bytes(),
                &checksum::fold(after).to_be_bytes(),
            );
            buf[l4 + 2..l4 + 4].copy_from_slice(&c.to_be_bytes());
        }
        // The outer header: from the outside its destination, from the inside its source (no port).
        rewrite::address(buf, &Layout::of(info), from_inside, to.0);
        true
    }

    /// Puts every binding's timer at its current deadline.
    fn rearm(&mut self) {
        self.table.timers.rearm(&mut self.table.bindings, &self.cfg.timeouts);
    }
}

impl Module for Nat {
    fn process(&mut self, port: usize, input: &mut Batch, out: &mut Output<'_>) {
        let from_inside = port == IN_INSIDE;
        let to = if from_inside { TO_OUTSIDE } else { TO_INSIDE };
        for frame in input.drain(..) {
            let Some((mut p, info)) = self.drops.parse(frame, out) else { continue };
            // A GSO super-packet is translated whole (its segments share its headers; its checksum field, updated
            // here as any, is computed afresh when it is cut or written) and counts its segments.
            let n = p.wire_packets();
            match self.translate(&mut p, &info, from_inside, out) {
                Ok(true) => self.m.translated.add(n),
                Ok(false) => self.m.untranslated.add(n),
                Err(refused) => {
                    match refused {
                        Refused::PortsExhausted => &self.m.exhausted,
                        Refused::BindingsFull => &self.m.full,
                        Refused::Conflict => &self.m.conflict,
                    }
                    .add(n);
                    out.drop_frame(p.into());
                    continue;
                }
            }
            out.emit(to, p);
        }
    }

    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        let Table { bindings, index, timers, used, expired, .. } = &mut self.table;
        let next = timers.expire(bindings, &self.cfg.timeouts, out.now().as_nanos(), |slot, b| {
            for k in b.keys() {
                if index.get(&k) == Some(&slot) {
                    index.remove(&k);
                }
            }
            if b.remote.is_none() {
                let public = (b.idle.protocol, b.outside.0);
                if let Some(n) = used.get_mut(&public) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        used.remove(&public);
                    }
                }
            }
            *expired += 1;
            self.m.expired.add(1);
        });
        self.m.active.set(bindings.len() as u64);
        next.map(Time)
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        DECL.write(&mut self.cfg, knob, value)?;
        self.rearm();
        Ok(())
    }

    fn take_state(&mut self) -> Option<Box<dyn Any>> {
        Some(Box::new(std::mem::take(&mut self.table)))
    }

    fn adopt_state(&mut self, state: Box<dyn Any>) -> Result<(), String> {
        let table = state.downcast::<Table>().map_err(|_| "not a nat module's binding table".to_string())?;
        self.table = *table;
        self.rearm();
        self.m.active.set(self.table.bindings.len() as u64);
        self.m.created.set(self.table.created);
        self.m.expired.set(self.table.expired);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::testutil::*;
    use flexstack_core::{Direction, Switch};
    use flexstack_wire::packet::build;
    use std::net::{Ipv4Addr, Ipv6Addr};

    const H1: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
    const H2: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 3);
    const PUB: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
    const REM: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
    const ROUTER: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);

    fn v6(s: &str) -> Ipv6Addr {
        s.parse().unwrap()
    }

    fn udp4(s: Ipv4Addr, d: Ipv4Addr, sp: u16, dp: u16, data: &[u8]) -> Vec<u8> {
        build::ipv4(s, d, proto::UDP, 64, &build::udp(s.into(), d.into(), sp, dp, data))
    }

    fn tcp4(s: Ipv4Addr, d: Ipv4Addr, sp: u16, dp: u16, flags: u8) -> Vec<u8> {
        let mut t = build::tcp(s.into(), d.into(), sp, dp, b"data");
        t[13] = flags;
        t[16] = 0;
        t[17] = 0;
        let c = checksum::finish(checksum::sum(checksum::pseudo_header(s.into(), d.into(), 6, t.len() as u32), &t));
        t[16..18].copy_from_slice(&c.to_be_bytes());
        build::ipv4(s, d, proto::TCP, 64, &t)
    }

    fn echo4(s: Ipv4Addr, d: Ipv4Addr, ty: u8, id: u16) -> Vec<u8> {
        let mut m = build::icmpv4_echo(id, 1, b"ping");
        m[0] = ty;
        m[2] = 0;
        m[3] = 0;
        let c = checksum::finish(checksum::sum(0, &m));
        m[2..4].copy_from_slice(&c.to_be_bytes());
        build::ipv4(s, d, proto::ICMP, 64, &m)
    }

    fn udp6(s: Ipv6Addr, d: Ipv6Addr, sp: u16, dp: u16) -> Vec<u8> {
        build::ipv6(s, d, proto::UDP, 64, &build::udp(s.into(), d.into(), sp, dp, b"v6 data"))
    }

    fn tcp6(s: Ipv6Addr, d: Ipv6Addr, sp: u16, dp: u16) -> Vec<u8> {
        build::ipv6(s, d, proto::TCP, 64, &build::tcp(s.into(), d.into(), sp, dp, b"v6"))
    }

    /// An ICMPv6 message with a correct checksum.
    fn icmp6(s: Ipv6Addr, d: Ipv6Addr, body: &[u8]) -> Vec<u8> {
        let mut m = body.to_vec();
        m[2] = 0;
        m[3] = 0;
        let c = checksum::finish(checksum::sum(
            checksum::pseudo_header(s.into(), d.into(), proto::ICMPV6, m.len() as u32),
            &m,
        ));
        m[2..4].copy_from_slice(&c.to_be_bytes());
        build::ipv6(s, d, proto::ICMPV6, 64, &m)
    }

    fn echo6(s: Ipv6Addr, d: Ipv6Addr, ty: u8, id: u16) -> Vec<u8> {
        let mut body = vec![ty, 0, 0, 0];
        body.extend_from_slice(&id.to_be_bytes());
        body.extend_from_slice(&[0, 1, b'x', b'y']);
        icmp6(s, d, &body)
    }

    /// An ICMPv4 error of `ty`/`code` from `s` to `d` quoting `quoted`.
    fn error4(s: Ipv4Addr, d: Ipv4Addr, ty: u8, code: u8, quoted: &[u8]) -> Vec<u8> {
        let mut m = vec![ty, code, 0, 0, 0, 0, 0, 0];
        m.extend_from_slice(quoted);
        let c = checksum::finish(checksum::sum(0, &m));
        m[2..4].copy_from_slice(&c.to_be_bytes());
        build::ipv4(s, d, proto::ICMP, 64, &m)
    }

    /// Checks every checksum of `pkt` by recomputing it in full; returns the parsed headers.
    fn verify(pkt: &[u8]) -> PacketInfo {
        let info = PacketInfo::parse(pkt).expect("translated packet parses (IPv4 header checksum included)");
        let seg = &pkt[info.l4_offset..info.total_len];
        let ok = match info.protocol {
            proto::UDP if seg[6..8] == [0, 0] => true,
            proto::TCP | proto::UDP | proto::ICMPV6 => {
                checksum::verify(checksum::pseudo_header(info.src, info.dst, info.protocol, seg.len() as u32), seg)
            }
            proto::ICMP => checksum::verify(0, seg),
            _ => true,
        };
        assert!(ok, "bad transport checksum in {pkt:02x?}");
        info
    }

    /// Checks the quoted packet of an ICMP error (header checksum and, when wholly quoted, transport checksum).
    fn verify_quoted(pkt: &[u8]) -> PacketInfo {
        let outer = verify(pkt);
        let inner = &pkt[outer.l4_offset + 8..outer.total_len];
        let info = PacketInfo::parse(inner).expect("the quoted packet is whole in these tests");
        verify(inner);
        info
    }

    fn stack(args: &[&str]) -> (Switch, Log, Log) {
        let mut sw = Switch::default();
        let (o, lo) = recorder("o");
        let (i, li) = recorder("i");
        sw.apply(vec![load("nat", "nat", args), o, i, link("nat[to_outside] -> o"), link("nat[to_inside] -> i")])
            .unwrap();
        (sw, lo, li)
    }

    fn rules(rules: &[&str]) -> String {
        let list: Vec<String> = rules.iter().map(|r| format!("{r:?}")).collect();
        format!("rules=[{}]", list.join(", "))
    }

    /// Sends one packet out (from the inside) and returns what left on to_outside.
    fn out1(sw: &mut Switch, log: &Log, pkt: Vec<u8>, at: u64) -> Vec<u8> {
        send(sw, "nat", "inside", &[pkt], Direction::Down, at);
        let mut seen = take(log);
        assert_eq!(seen.len(), 1, "one packet out");
        seen.remove(0).data
    }

    /// Sends one packet in (from the outside) and returns what left on to_inside.
    fn in1(sw: &mut Switch, log: &Log, pkt: Vec<u8>, at: u64) -> Vec<u8> {
        send(sw, "nat", "outside", &[pkt], Direction::Up, at);
        let mut seen = take(log);
        assert_eq!(seen.len(), 1, "one packet in");
        seen.remove(0).data
    }

    fn ends(info: &PacketInfo) -> (IpAddr, u16, IpAddr, u16) {
        (info.src, info.src_port, info.dst, info.dst_port)
    }

    #[test]
    fn rules_parse_print_back_and_explain_errors() {
        for (text, canonical) in [
            ("snat 10.77.0.0/24 to 192.0.2.10", "snat 10.77.0.0/24 to 192.0.2.10"),
            ("snat  udp 10.77.0.9/24   to 192.0.2.10", "snat udp 10.77.0.0/24 to 192.0.2.10"),
            ("snat fd77::/64 to fd00::10", "snat fd77::/64 to fd00::10"),
            ("dnat tcp 192.0.2.10:8080 to 10.77.0.2:80", "dnat tcp 192.0.2.10:8080 to 10.77.0.2:80"),
            ("dnat udp [fd00::10]:53 to fd77::2", "dnat udp [fd00::10]:53 to fd77::2"),
            ("dnat 192.0.2.11 to 10.77.0.3", "dnat 192.0.2.11 to 10.77.0.3"),
            ("dnat icmp 192.0.2.11 to 10.77.0.3", "dnat icmp 192.0.2.11 to 10.77.0.3"),
        ] {
            let rule = NatRule::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(rule.to_string(), canonical);
            assert_eq!(NatRule::parse(canonical).unwrap(), rule);
        }
        for (text, want) in [
            ("", "expected `snat` or `dnat` after word 0"),
            ("masq 10.0.0.0/8", "word 1 `masq`: expected `snat` or `dnat`"),
            ("snat 10.77.0.0/24 too 1.2.3.4", "word 3 `too`: expected `to`"),
            ("snat 10.77.0.0/24", "expected `to` after word 2 but the rule ends"),
            ("snat sctp 10.0.0.0/8 to 1.2.3.4", "word 2 `sctp`: expected an address or prefix"),
            ("snat 10.77.0.0/24 to fd00::1", "word 4 `fd00::1`: fd00::1 is not of the same address family"),
            ("snat 10.77.0.0/24 to 1.2.3.4:5", "word 4 `1.2.3.4:5`: expected the public address"),
            ("dnat 192.0.2.10:80 to 10.0.0.1", "word 2 `192.0.2.10:80`: a port needs the protocol tcp or udp"),
            ("dnat tcp 192.0.2.10 to 10.0.0.1:80", "word 5 `10.0.0.1:80`: an inside port needs a public port"),
            ("dnat tcp 192.0.2.10:99999 to 10.0.0.1", "port `99999` is larger than 65535"),
            ("dnat tcp 192.0.2.10:80 to 10.0.0.1 now", "word 6 `now`: expected the end of the rule"),
            ("dnat tcp", "expected the public address with an optional port"),
        ] {
            let e = NatRule::parse(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
        let e = config_error("nat", &[&rules(&["snat 10.77.0.0/24 to 192.0.2.10", "dnat tcp x to y"])]);
        assert!(e.contains("setting `rules` of a nat module: rule 2 \"dnat tcp x to y\": word 3 `x`"), "{e}");
        assert!(config_error("nat", &["port_range=\"5-4\""]).contains("ends before it starts"));
        assert!(config_error("nat", &["port_range=\"0-10\""]).contains("port 0"));
        assert!(config_error("nat", &["rules=[1]"]).contains("expected an array of strings"));
    }

    #[test]
    fn snat_udp_tcp_icmp_ipv4_and_replies() {
        let (mut sw, lo, li) = stack(&[&rules(&["snat 10.77.0.0/24 to 192.0.2.10"])]);
        // UDP: the inside port is in the range and free, so it is kept.
        let o = out1(&mut sw, &lo, udp4(H1, REM, 40000, 53, b"query"), 1);
        assert_eq!(ends(&verify(&o)), (PUB.into(), 40000, REM.into(), 53));
        // The same port from another inside host gets another public port.
        let o2 = out1(&mut sw, &lo, udp4(H2, REM, 40000, 53, b"query"), 1);
        let p2 = verify(&o2).src_port;
        assert_ne!(p2, 40000);
        assert!((20000..=59999).contains(&p2));
        // A port outside the range is replaced by one from it.
        let o3 = out1(&mut sw, &lo, udp4(H1, REM, 53, 53, b""), 1);
        assert!((20000..=59999).contains(&verify(&o3).src_port));
        // Replies go back to the right inside endpoints.
        let r = in1(&mut sw, &li, udp4(REM, PUB, 53, 40000, b"answer"), 2);
        assert_eq!(ends(&verify(&r)), (REM.into(), 53, H1.into(), 40000));
        let r2 = in1(&mut sw, &li, udp4(REM, PUB, 53, p2, b"answer"), 2);
        assert_eq!(ends(&verify(&r2)), (REM.into(), 53, H2.into(), 40000));
        // TCP.
        let o = out1(&mut sw, &lo, tcp4(H1, REM, 45000, 443, 0x02), 3);
        assert_eq!(ends(&verify(&o)), (PUB.into(), 45000, REM.into(), 443));
        let r = in1(&mut sw, &li, tcp4(REM, PUB, 443, 45000, 0x12), 3);
        assert_eq!(ends(&verify(&r)), (REM.into(), 443, H1.into(), 45000));
        // ICMP echo: the identifier is the port (7 is outside the range: a new one is chosen).
        let o = out1(&mut sw, &lo, echo4(H1, REM, 8, 7), 4);
        let info = verify(&o);
        assert_eq!(info.src, IpAddr::from(PUB));
        let id = info.src_port;
        assert!((20000..=59999).contains(&id));
        let r = in1(&mut sw, &li, echo4(REM, PUB, 0, id), 4);
        let info = verify(&r);
        assert_eq!((info.dst, info.src_port, info.icmp), (H1.into(), 7, Some((0, 0))));
        assert_eq!(u64_var(&sw, "module.nat.bindings_active"), 5);
        assert_eq!(u64_var(&sw, "module.nat.translated_total"), 9);
        // Unrelated packets pass unchanged, both ways.
        let other = udp4(Ipv4Addr::new(10, 78, 0, 1), REM, 1, 2, b"");
        assert_eq!(out1(&mut sw, &lo, other.clone(), 5), other);
        let stray = udp4(REM, PUB, 53, 1234, b"");
        assert_eq!(in1(&mut sw, &li, stray.clone(), 5), stray);
        let gre = build::ipv4(H1, REM, 47, 64, b"gre!");
        assert_eq!(out1(&mut sw, &lo, gre.clone(), 5), gre);
        assert_eq!(u64_var(&sw, "module.nat.untranslated_total"), 3);
    }

    #[test]
    fn udp_without_checksum_keeps_none() {
        let (mut sw, lo, li) = stack(&[&rules(&["snat 10.77.0.0/24 to 192.0.2.10"])]);
        let mut p = udp4(H1, REM, 40000, 53, b"q");
        p[26] = 0;
        p[27] = 0;
        let o = out1(&mut sw, &lo, p, 1);
        assert_eq!(&o[26..28], &[0, 0]);
        assert_eq!(ends(&verify(&o)), (PUB.into(), 40000, REM.into(), 53));
        let _ = li;
    }

    #[test]
    fn snat_ipv6_udp_tcp_icmpv6() {
        let (h, p, r) = (v6("fd77::2"), v6("fd00::10"), v6("2001:db8::7"));
        let (mut sw, lo, li) = stack(&[&rules(&["snat 10.77.0.0/24 to 192.0.2.10", "snat fd77::/64 to fd00::10"])]);
        let o = out1(&mut sw, &lo, udp6(h, r, 30000, 53), 1);
        assert_eq!(ends(&verify(&o)), (p.into(), 30000, r.into(), 53));
        let back = in1(&mut sw, &li, udp6(r, p, 53, 30000), 1);
        assert_eq!(ends(&verify(&back)), (r.into(), 53, h.into(), 30000));
        let o = out1(&mut sw, &lo, tcp6(h, r, 30001, 80), 1);
        assert_eq!(ends(&verify(&o)), (p.into(), 30001, r.into(), 80));
        let back = in1(&mut sw, &li, tcp6(r, p, 80, 30001), 1);
        assert_eq!(ends(&verify(&back)), (r.into(), 80, h.into(), 30001));
        let o = out1(&mut sw, &lo, echo6(h, r, 128, 21000), 1);
        assert_eq!(ends(&verify(&o)), (p.into(), 21000, r.into(), 21000));
        let back = in1(&mut sw, &li, echo6(r, p, 129, 21000), 1);
        assert_eq!(ends(&verify(&back)), (r.into(), 21000, h.into(), 21000));
        // IPv4 rules do not touch IPv6 and the other way round.
        assert_eq!(u64_var(&sw, "module.nat.bindings_active"), 3);
    }

    #[test]
    fn dnat_ipv4_and_ipv6_with_replies() {
        let (mut sw, lo, li) = stack(&[
            &rules(&[
                "dnat tcp 192.0.2.10:8080 to 10.77.0.2:80",
                "dnat udp [fd00::10]:53 to [fd77::2]:5353",
                "dnat 192.0.2.11 to 10.77.0.3",
                "snat 10.77.0.0/24 to 192.0.2.10",
            ]),
            "port_range=\"8080-8081\"",
        ]);
        let i = in1(&mut sw, &li, tcp4(REM, PUB, 50000, 8080, 0x02), 1);
        assert_eq!(ends(&verify(&i)), (REM.into(), 50000, H1.into(), 80));
        // The server's reply leaves with the public endpoint, not through the SNAT rule.
        let o = out1(&mut sw, &lo, tcp4(H1, REM, 80, 50000, 0x12), 1);
        assert_eq!(ends(&verify(&o)), (PUB.into(), 8080, REM.into(), 50000));
        // A second client is a second binding.
        let i = in1(&mut sw, &li, tcp4(ROUTER, PUB, 50000, 8080, 0x02), 1);
        assert_eq!(ends(&verify(&i)), (ROUTER.into(), 50000, H1.into(), 80));
        // SNAT never hands out the forwarded TCP port 8080: H2's connection gets 8081.
        let o = out1(&mut sw, &lo, tcp4(H2, REM, 8080, 9, 0x02), 2);
        assert_eq!(verify(&o).src_port, 8081);
        // IPv6 DNAT with a port change.
        let (p6, h6, r6) = (v6("fd00::10"), v6("fd77::2"), v6("2001:db8::7"));
        let i = in1(&mut sw, &li, udp6(r6, p6, 7000, 53), 3);
        assert_eq!(ends(&verify(&i)), (r6.into(), 7000, h6.into(), 5353));
        let o = out1(&mut sw, &lo, udp6(h6, r6, 5353, 7000), 3);
        assert_eq!(ends(&verify(&o)), (p6.into(), 53, r6.into(), 7000));
        // Address-only DNAT: ports kept; ICMP echo to it too.
        let i = in1(&mut sw, &li, udp4(REM, Ipv4Addr::new(192, 0, 2, 11), 1, 2, b"x"), 4);
        assert_eq!(ends(&verify(&i)), (REM.into(), 1, H2.into(), 2));
        let i = in1(&mut sw, &li, echo4(REM, Ipv4Addr::new(192, 0, 2, 11), 8, 99), 4);
        assert_eq!(ends(&verify(&i)), (REM.into(), 99, H2.into(), 99));
        let o = out1(&mut sw, &lo, echo4(H2, REM, 0, 99), 4);
        assert_eq!(ends(&verify(&o)), (Ipv4Addr::new(192, 0, 2, 11).into(), 99, REM.into(), 99));
        // An echo reply from outside with no binding makes none.
        let stray = echo4(REM, Ipv4Addr::new(192, 0, 2, 11), 0, 5);
        assert_eq!(in1(&mut sw, &li, stray.clone(), 4), stray);
        assert_eq!(u64_var(&sw, "module.nat.bindings_active"), 6);
    }

    #[test]
    fn ports_run_out() {
        let (mut sw, lo, _li) = stack(&[&rules(&["snat 10.77.0.0/24 to 192.0.2.10"]), "port_range=\"20000-20001\""]);
        let a = out1(&mut sw, &lo, udp4(H1, REM, 5000, 53, b""), 1);
        let b = out1(&mut sw, &lo, udp4(H2, REM, 5000, 53, b""), 1);
        assert_eq!((verify(&a).src_port, verify(&b).src_port), (20000, 20001));
        send(&mut sw, "nat", "inside", &[udp4(Ipv4Addr::new(10, 77, 0, 4), REM, 5000, 53, b"")], Direction::Down, 1);
        assert!(take(&lo).is_empty());
        assert_eq!(u64_var(&sw, "module.nat.drop_ports_exhausted_total"), 1);
        assert_eq!(u64_var(&sw, "module.nat.frames_dropped_total"), 1);
        // Other protocols have their own ports.
        let t = out1(&mut sw, &lo, tcp4(Ipv4Addr::new(10, 77, 0, 4), REM, 5000, 53, 0x02), 1);
        assert_eq!(verify(&t).src_port, 20000);
        // Existing bindings still work.
        let again = out1(&mut sw, &lo, udp4(H2, REM, 5000, 53, b""), 2);
        assert_eq!(verify(&again).src_port, 20001);
    }

    #[test]
    fn max_bindings_and_binding_expiry_free_ports() {
        let (mut sw, lo, li) = stack(&[
            &rules(&["snat 10.77.0.0/24 to 192.0.2.10"]),
            "port_range=\"20000-20000\"",
            "udp_timeout_ms=1000",
            "max_bindings=1",
        ]);
        let a = out1(&mut sw, &lo, udp4(H1, REM, 5000, 53, b""), 0);
        assert_eq!(verify(&a).src_port, 20000);
        send(&mut sw, "nat", "inside", &[tcp4(H2, REM, 1, 2, 0x02)], Direction::Down, 0);
        assert_eq!(u64_var(&sw, "module.nat.drop_bindings_full_total"), 1);
        // A reply at 500 ms keeps the binding alive until 1500 ms.
        in1(&mut sw, &li, udp4(REM, PUB, 53, 20000, b""), 500);
        sw.run(Time::from_millis(1000));
        assert_eq!(u64_var(&sw, "module.nat.bindings_active"), 1);
        assert_eq!(sw.next_wakeup(), Some(Time::from_millis(1500)));
        sw.run(Time::from_millis(1500));
        assert_eq!(u64_var(&sw, "module.nat.bindings_active"), 0);
        assert_eq!(u64_var(&sw, "module.nat.bindings_expired_total"), 1);
        // Replies to the expired binding pass untranslated; the port is free for another host.
        let stray = udp4(REM, PUB, 53, 20000, b"");
        assert_eq!(in1(&mut sw, &li, stray.clone(), 1600), stray);
        let b = out1(&mut sw, &lo, udp4(H2, REM, 6000, 53, b""), 1600);
        assert_eq!(ends(&verify(&b)), (PUB.into(), 20000, REM.into(), 53));
    }

    #[test]
    fn tcp_bindings_close_after_fins_or_rst() {
        let (mut sw, lo, li) = stack(&[&rules(&["snat 10.77.0.0/24 to 192.0.2.10"]), "tcp_closing_timeout_ms=50"]);
        out1(&mut sw, &lo, tcp4(H1, REM, 40000, 80, 0x02), 0);
        in1(&mut sw, &li, tcp4(REM, PUB, 80, 40000, 0x11), 10);
        sw.run(Time::from_millis(100));
        assert_eq!(u64_var(&sw, "module.nat.bindings_active"), 1);
        out1(&mut sw, &lo, tcp4(H1, REM, 40000, 80, 0x11), 100);
        sw.run(Time::from_millis(150));
        assert_eq!(u64_var(&sw, "module.nat.bindings_active"), 0);
        out1(&mut sw, &lo, tcp4(H1, REM, 40001, 80, 0x02), 200);
        out1(&mut sw, &lo, tcp4(H1, REM, 40001, 80, 0x04), 210);
        sw.run(Time::from_millis(260));
        assert_eq!(u64_var(&sw, "module.nat.bindings_active"), 0);
    }

    #[test]
    fn icmp_errors_from_outside_are_translated_back() {
        let (mut sw, lo, li) = stack(&[&rules(&["snat 10.77.0.0/24 to 192.0.2.10"])]);
        let sent = out1(&mut sw, &lo, udp4(H1, REM, 5000, 33434, b"traceroute probe"), 1);
        let public_port = verify(&sent).src_port;
        // Time exceeded from a router on the way, quoting the whole translated datagram.
        let e = in1(&mut sw, &li, error4(ROUTER, PUB, 11, 0, &sent), 2);
        let outer = verify(&e);
        assert_eq!((outer.src, outer.dst, outer.icmp), (ROUTER.into(), H1.into(), Some((11, 0))));
        let inner = verify_quoted(&e);
        assert_eq!(ends(&inner), (H1.into(), 5000, REM.into(), 33434));
        // A truncated quote (header and 8 bytes) is translated too; the outer checksum stays right.
        let short = in1(&mut sw, &li, error4(REM, PUB, 3, 3, &sent[..28]), 3);
        verify(&short);
        let q = &short[28..];
        assert!(checksum::verify(0, &q[..20]), "quoted IPv4 header checksum");
        assert_eq!(&q[12..16], &H1.octets());
        assert_eq!(u16::from_be_bytes([q[20], q[21]]), 5000);
        // An echo request that timed out.
        let ping = out1(&mut sw, &lo, echo4(H1, REM, 8, 7), 4);
        let e = in1(&mut sw, &li, error4(ROUTER, PUB, 11, 0, &ping), 4);
        verify(&e);
        let inner = verify_quoted(&e);
        assert_eq!((inner.src, inner.src_port), (H1.into(), 7));
        assert_eq!(u64_var(&sw, "module.nat.icmp_errors_translated_total"), 3);
        // An error about a packet that went through no binding passes unchanged.
        let other = error4(ROUTER, PUB, 3, 1, &udp4(PUB, REM, 1111, 53, b""));
        assert_eq!(in1(&mut sw, &li, other.clone(), 5), other);
        let _ = public_port;
    }

    #[test]
    fn icmpv6_errors_and_errors_from_inside_hosts() {
        let (p6, h6, r6, rt6) = (v6("fd00::10"), v6("fd77::2"), v6("2001:db8::7"), v6("2001:db8::1"));
        let (mut sw, lo, li) =
            stack(&[&rules(&["snat fd77::/64 to fd00::10", "dnat tcp 192.0.2.10:8080 to 10.77.0.2:80"])]);
        let sent = out1(&mut sw, &lo, udp6(h6, r6, 5000, 53), 1);
        // Packet too big (type 2) with the MTU in the second word.
        let mut body = vec![2, 0, 0, 0, 0, 0, 0x05, 0x00];
        body.extend_from_slice(&sent);
        let e = in1(&mut sw, &li, icmp6(rt6, p6, &body), 2);
        let outer = verify(&e);
        assert_eq!((outer.src, outer.dst), (rt6.into(), h6.into()));
        let inner = verify_quoted(&e);
        assert_eq!((inner.src, inner.src_port, inner.dst), (h6.into(), 5000, r6.into()));
        // The inside server of a DNAT connection answers with port unreachable: the error leaves with the public
        // address, quoting the packet as the client sent it.
        let arrived = in1(&mut sw, &li, tcp4(REM, PUB, 50000, 8080, 0x02), 3);
        let e = out1(&mut sw, &lo, error4(H1, REM, 3, 3, &arrived), 3);
        let outer = verify(&e);
        assert_eq!((outer.src, outer.dst), (PUB.into(), REM.into()));
        let inner = verify_quoted(&e);
        assert_eq!(ends(&inner), (REM.into(), 50000, PUB.into(), 8080));
        assert_eq!(u64_var(&sw, "module.nat.icmp_errors_translated_total"), 2);
    }

    #[test]
    fn incremental_checksums_match_recomputation_on_random_packets() {
        // Random payloads, ports and addresses through SNAT out and back: every checksum recomputed.
        let (mut sw, lo, li) = stack(&[&rules(&["snat 10.0.0.0/8 to 192.0.2.10", "snat fd77::/64 to fd00::10"])]);
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for i in 0..300u64 {
            let n = next();
            let len = (n % 40) as usize;
            let data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            let src = Ipv4Addr::from(0x0a00_0000 | (next() as u32 & 0x00ff_ffff));
            let (sp, dp) = (next() as u16, next() as u16 | 1);
            let pkt = match i % 4 {
                0 => udp4(src, REM, sp, dp, &data),
                1 => {
                    let t = build::tcp(src.into(), REM.into(), sp, dp, &data);
                    build::ipv4(src, REM, proto::TCP, 64, &t)
                }
                2 => {
                    let s6 = Ipv6Addr::from(0xfd77_0000_0000_0000_0000_0000_0000_0000_u128 | u128::from(next()));
                    build::ipv6(
                        s6,
                        v6("2001:db8::7"),
                        proto::UDP,
                        64,
                        &build::udp(s6.into(), v6("2001:db8::7").into(), sp, dp, &data),
                    )
                }
                _ => echo4(src, REM, 8, sp),
            };
            let o = out1(&mut sw, &lo, pkt, i);
            let info = verify(&o);
            // And the reply back.
            let reply = match info.protocol {
                proto::UDP if info.version == 4 => udp4(REM, PUB, info.dst_port, info.src_port, &data),
                proto::UDP => {
                    let (a, b) = (v6("2001:db8::7"), v6("fd00::10"));
                    build::ipv6(
                        a,
                        b,
                        proto::UDP,
                        64,
                        &build::udp(a.into(), b.into(), info.dst_port, info.src_port, &data),
                    )
                }
                proto::TCP => build::ipv4(
                    REM,
                    PUB,
                    proto::TCP,
                    64,
                    &build::tcp(REM.into(), PUB.into(), info.dst_port, info.src_port, &data),
                ),
                _ => echo4(REM, PUB, 0, info.src_port),
            };
            let back = in1(&mut sw, &li, reply, i);
            let b = verify(&back);
            assert_eq!(b.dst, if info.version == 4 { IpAddr::from(src) } else { b.dst });
        }
    }

    #[test]
    fn replace_keeps_bindings() {
        let args = rules(&["snat 10.77.0.0/24 to 192.0.2.10"]);
        let (mut sw, lo, li) = stack(&[&args]);
        out1(&mut sw, &lo, udp4(H1, REM, 40000, 53, b""), 1);
        let settings = settings(&[&args]);
        let builder = catalog().configure("nat", &settings, None).unwrap();
        sw.apply(vec![flexstack_core::Edit::Replace {
            name: "nat".into(),
            kind: "nat".into(),
            settings,
            builder,
            keep_state: true,
        }])
        .unwrap();
        assert_eq!(u64_var(&sw, "module.nat.bindings_active"), 1);
        let r = in1(&mut sw, &li, udp4(REM, PUB, 53, 40000, b""), 2);
        assert_eq!(verify(&r).dst, IpAddr::from(H1));
    }

    #[test]
    fn malformed_packets_are_dropped_with_reasons() {
        let (mut sw, lo, li) = stack(&[&rules(&["snat 10.77.0.0/24 to 192.0.2.10"])]);
        send(&mut sw, "nat", "inside", &[vec![0x45, 0, 0], vec![0x60; 10]], Direction::Down, 1);
        send(&mut sw, "nat", "outside", &[vec![0x20; 30]], Direction::Up, 1);
        assert!(take(&lo).is_empty() && take(&li).is_empty());
        assert_eq!(u64_var(&sw, "module.nat.drop_truncated_total"), 2);
        assert_eq!(u64_var(&sw, "module.nat.drop_bad_version_total"), 1);
        assert_eq!(u64_var(&sw, "module.nat.frames_dropped_total"), 3);
    }
}
