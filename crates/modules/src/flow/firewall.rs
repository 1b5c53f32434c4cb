//! `firewall`: lets IP packets pass or drops them by an ordered list of rules; the first rule that matches decides.
//!
//! Its ports, settings, knobs and meters are declared once, in `DECL` below; docs/modules.md lists them. A rule
//! (one string of the `rules` setting) reads `ACTION [DIRECTION] [PROTOCOL] [from ADDR [port PORTS]] [to ADDR
//! [port PORTS]]`:
//!
//!   - ACTION: `accept` or `drop`;
//!   - DIRECTION: `in` (frames travelling up, from the network), `out` (travelling down, to the network) or
//!     `any` (the default);
//!   - PROTOCOL: `tcp`, `udp`, `icmp` (ICMP and ICMPv6) or `proto N` (0-255; `proto 1` is ICMP for IPv4 only);
//!     any protocol when left out;
//!   - ADDR: `any`, an address (`10.77.0.2`, `fd00::1`) or a prefix (`203.0.113.0/24`, `fd77::/64`); an address
//!     matches only packets of its family;
//!   - PORTS: `22` or `1000-2000`, only with `tcp` or `udp`; non-first fragments (which carry no ports) never
//!     match a rule with ports, so put reassembly before the firewall.
//!
//!   Examples: `drop in tcp from any to 10.77.0.2 port 22`, `accept out udp to any port 53`,
//!   `drop in from 203.0.113.0/24`, `accept icmp`. A rule that does not parse fails the configuration with the
//!   rule's number and text, the word at fault and what was expected there.
//!
//! Packets that do not parse are dropped and counted by [`ParseError`](flexstack_wire::packet::ParseError) reason.

use flexstack_core::module::port_type;
use flexstack_core::{
    field, kind_from_decl, Batch, ConfigError, Direction, Frame, KindDecl, Meter, MeterDecl, Module, ModuleBuilder,
    ModuleInterface, ModuleKind, ModuleVars, Output, Param, PortDecl, Settings, Value, ValueType, VarSpec,
};
use flexstack_wire::cidr::{PortRange, Prefix, Words};
use flexstack_wire::packet::{proto, PacketInfo, ParseDrops};
use std::fmt;

/// The kind's name in stack files.
pub const KIND: &str = "firewall";

/// Most rules of one firewall.
pub const MAX_RULES: usize = 10_000;

/// What a rule does with the packets it matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Let the packet pass.
    Accept,
    /// Drop the packet.
    Drop,
}

impl Action {
    fn parse(word: &str) -> Option<Action> {
        match word {
            "accept" => Some(Action::Accept),
            "drop" => Some(Action::Drop),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Action::Accept => "accept",
            Action::Drop => "drop",
        }
    }
}

/// The protocol a rule matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
    /// ICMP (IPv4) and ICMPv6.
    Icmp,
    /// Any other protocol number.
    Number(u8),
}

impl Protocol {
    fn matches(self, p: u8) -> bool {
        match self {
            Protocol::Tcp => p == proto::TCP,
            Protocol::Udp => p == proto::UDP,
            Protocol::Icmp => p == proto::ICMP || p == proto::ICMPV6,
            Protocol::Number(n) => p == n,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Protocol::Tcp => f.write_str("tcp"),
            Protocol::Udp => f.write_str("udp"),
            Protocol::Icmp => f.write_str("icmp"),
            Protocol::Number(n) => write!(f, "proto {n}"),
        }
    }
}

/// One side of a rule: an address prefix (any when `None`) and ports (any when `None`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Side {
    /// Addresses matched.
    pub addr: Option<Prefix>,
    /// Ports matched.
    pub ports: Option<PortRange>,
}

impl Side {
    fn is_any(&self) -> bool {
        self.addr.is_none() && self.ports.is_none()
    }
}

/// A parsed firewall rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rule {
    /// Accept or drop.
    pub action: Action,
    /// Direction matched (any when `None`): up is `in`, down is `out`.
    pub direction: Option<Direction>,
    /// Protocol matched (any when `None`).
    pub protocol: Option<Protocol>,
    /// Source matched.
    pub from: Side,
    /// Destination matched.
    pub to: Side,
}

impl Rule {
    /// Parses one rule; the error names the word at fault and what was expected there.
    pub fn parse(text: &str) -> Result<Rule, String> {
        let mut w = Words::new(text);
        let first = w.next("`accept` or `drop`")?;
        let action = Action::parse(first).ok_or_else(|| w.error_last("expected `accept` or `drop`"))?;
        let mut rule = Rule { action, direction: None, protocol: None, from: Side::default(), to: Side::default() };
        let mut expected = "`in`, `out`, `any`, a protocol (tcp, udp, icmp, proto N), `from`, `to` or the end";
        let had_direction = if w.eat("in") {
            rule.direction = Some(Direction::Up);
            true
        } else if w.eat("out") {
            rule.direction = Some(Direction::Down);
            true
        } else {
            w.eat("any")
        };
        if had_direction {
            expected = "a protocol (tcp, udp, icmp, proto N), `from`, `to` or the end of the rule";
        }
        rule.protocol = match w.peek() {
            Some("tcp") => Some(Protocol::Tcp),
            Some("udp") => Some(Protocol::Udp),
            Some("icmp") => Some(Protocol::Icmp),
            Some("proto") => {
                w.next("`proto`")?;
                let n = w.next("a protocol number 0-255 after `proto`")?;
                let n: u8 = n
                    .parse()
                    .ok()
                    .filter(|_| n.bytes().all(|b| b.is_ascii_digit()))
                    .ok_or_else(|| w.error_last("expected a protocol number 0-255"))?;
                // `proto 6` is `tcp`: one rule, one way of writing it.
                Some(match n {
                    proto::TCP => Protocol::Tcp,
                    proto::UDP => Protocol::Udp,
                    n => Protocol::Number(n),
                })
            }
            _ => None,
        };
        if matches!(w.peek(), Some("tcp" | "udp" | "icmp")) {
            w.next("a protocol")?;
        }
        if rule.protocol.is_some() {
            expected = "`from`, `to` or the end of the rule";
        }
        let ports_ok = matches!(rule.protocol, Some(Protocol::Tcp | Protocol::Udp));
        if w.eat("from") {
            rule.from = side(&mut w, ports_ok)?;
            expected = "`to` or the end of the rule";
        }
        if w.eat("to") {
            rule.to = side(&mut w, ports_ok)?;
            expected = "the end of the rule";
        }
        w.end(expected)?;
        if let (Some(a), Some(b)) = (rule.from.addr, rule.to.addr) {
            if a.is_ipv4() != b.is_ipv4() {
                return Err(format!("`from {a}` and `to {b}` are of different address families: it cannot match"));
            }
        }
        Ok(rule)
    }

    /// True if the rule matches a packet with headers `info` travelling in `direction`.
    #[inline]
    pub fn matches(&self, info: &PacketInfo, direction: Direction) -> bool {
        if self.direction.is_some_and(|d| d != direction) {
            return false;
        }
        if self.protocol.is_some_and(|p| !p.matches(info.protocol)) {
            return false;
        }
        if self.from.addr.is_some_and(|a| !a.contains(info.src)) || self.to.addr.is_some_and(|a| !a.contains(info.dst))
        {
            return false;
        }
        if self.from.ports.is_some() || self.to.ports.is_some() {
            let ports_known = info.has_ports() && info.fragment.is_none_or(|f| f.offset == 0);
            if !ports_known
                || self.from.ports.is_some_and(|r| !r.contains(info.src_port))
                || self.to.ports.is_some_and(|r| !r.contains(info.dst_port))
            {
                return false;
            }
        }
        true
    }
}

/// Reads `ADDR [port PORTS]` after `from` or `to`.
fn side(w: &mut Words<'_>, ports_ok: bool) -> Result<Side, String> {
    let a = w.next("an address, a prefix or `any`")?;
    let addr = match a {
        "any" => None,
        a => Some(Prefix::parse(a).map_err(|e| w.error_last(&e))?),
    };
    let mut ports = None;
    if w.eat("port") {
        if !ports_ok {
            return Err(
                w.error_last("ports need the protocol tcp or udp before them (e.g. `drop in tcp to any port 22`)")
            );
        }
        let p = w.next("a port or a port range (22, 1000-2000) after `port`")?;
        ports = Some(PortRange::parse(p).map_err(|e| w.error_last(&e))?);
    }
    Ok(Side { addr, ports })
}

impl fmt::Display for Rule {
    /// The rule in the form [`Rule::parse`] reads back equal.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.action.name())?;
        match self.direction {
            Some(Direction::Up) => f.write_str(" in")?,
            Some(Direction::Down) => f.write_str(" out")?,
            None => {}
        }
        if let Some(p) = self.protocol {
            write!(f, " {p}")?;
        }
        for (word, side) in [("from", &self.from), ("to", &self.to)] {
            if side.is_any() {
                continue;
            }
            match side.addr {
                Some(a) => write!(f, " {word} {a}")?,
                None => write!(f, " {word} any")?,
            }
            if let Some(p) = side.ports {
                write!(f, " port {p}")?;
            }
        }
        Ok(())
    }
}

/// Parses a list of rules; the error says which rule (1-based), its text and what is wrong.
pub fn parse_rules(rules: &[String]) -> Result<Vec<Rule>, String> {
    if rules.len() > MAX_RULES {
        return Err(format!("{} rules: at most {MAX_RULES} are allowed", rules.len()));
    }
    rules
        .iter()
        .enumerate()
        .map(|(i, text)| Rule::parse(text).map_err(|e| format!("rule {} {text:?}: {e}", i + 1)))
        .collect()
}

fn parse_default(text: &str) -> Result<Action, String> {
    Action::parse(text).ok_or_else(|| format!("expected `accept` or `drop`, got {text:?}"))
}

/// The `firewall` module kind.
pub struct FirewallKind;

/// The knobs' values.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Config {
    enabled: bool,
    default: Action,
}

type P = Param<Config>;

/// The kind: ports, settings, knobs and meters.
const DECL: KindDecl<Config, Meters> = KindDecl {
    inputs: &[PortDecl::new("in", port_type::IP, "IP packets to judge")],
    outputs: &[PortDecl::new("pass", port_type::IP, "packets let through")],
    params: &[
        P::manual("rules", "array of strings", "the rules, in order: the first that matches decides", "none"),
        P::bool("enabled", "false lets every frame through unexamined", true, field!(enabled)),
        P::text(
            "default",
            "accept or drop: what happens when no rule matches",
            "accept",
            |c| c.default.name().into(),
            |c, t| parse_default(t).map(|a| c.default = a),
        ),
    ],
    meters: &[
        MeterDecl::pattern("rule<N>_matches_total", "frames", "packets decided by rule N (1, 2, ...)"),
        MeterDecl::u64("accepted_total", "frames", "packets let through", |m| &mut m.accepted),
        MeterDecl::u64("drop_rule_total", "frames", "packets dropped by a drop rule", |m| &mut m.drop_rule),
        MeterDecl::u64("drop_default_total", "frames", "packets dropped by the default policy", |m| {
            &mut m.drop_default
        }),
    ],
    more_meters: || ParseDrops::specs(true),
    accepts_gso: true,
    ..KindDecl::new(KIND, "accepts or drops IP packets by ordered rules on direction, protocol, addresses and ports")
};

impl ModuleKind for FirewallKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(KIND);
        let mut cfg = Config { enabled: true, default: Action::Accept };
        DECL.read(&mut r, &mut cfg)?;
        let texts = r.strings("rules")?.unwrap_or_default();
        let rules = parse_rules(&texts).map_err(|e| r.error("rules", e))?;
        r.finish()?;
        Ok(Box::new(FirewallBuilder { rules, cfg }))
    }
}

struct FirewallBuilder {
    rules: Vec<Rule>,
    cfg: Config,
}

impl ModuleBuilder for FirewallBuilder {
    fn interface(&self) -> ModuleInterface {
        let mut iface = DECL.interface(&self.cfg);
        for (i, rule) in self.rules.iter().enumerate() {
            let desc = format!("packets decided by rule {}: {rule}", i + 1);
            iface.vars.push(VarSpec::meter(&format!("rule{}_matches_total", i + 1), ValueType::U64, "frames", &desc));
        }
        iface
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        DECL.publish(&self.cfg, vars);
        let matches = (1..=self.rules.len()).map(|n| vars.meter(&format!("rule{n}_matches_total"))).collect();
        Box::new(Firewall {
            rules: self.rules,
            matches,
            cfg: self.cfg,
            m: DECL.meters(vars),
            drops: ParseDrops::new(vars),
        })
    }
}

/// The firewall's meters.
#[derive(Default)]
struct Meters {
    accepted: Meter,
    drop_rule: Meter,
    drop_default: Meter,
}

/// A running firewall.
pub struct Firewall {
    rules: Vec<Rule>,
    matches: Vec<Meter>,
    cfg: Config,
    m: Meters,
    drops: ParseDrops,
}

impl Module for Firewall {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        if !self.cfg.enabled {
            out.emit_all(0, input);
            return;
        }
        for frame in input.drain(..) {
            let Frame::Data(p) = &frame else {
                self.drops.not_packet();
                out.drop_frame(frame);
                continue;
            };
            let info = match PacketInfo::parse(p.data()) {
                Ok(info) => info,
                Err(e) => {
                    self.drops.count(e);
                    out.drop_frame(frame);
                    continue;
                }
            };
            let direction = p.direction();
            // The rules read the headers, which a GSO super-packet's segments share: it is judged whole, and its
            // segments counted.
            let n = p.wire_packets();
            let action = match self.rules.iter().position(|r| r.matches(&info, direction)) {
                Some(i) => {
                    self.matches[i].add(n);
                    let a = self.rules[i].action;
                    if a == Action::Drop {
                        self.m.drop_rule.add(n);
                    }
                    a
                }
                None => {
                    if self.cfg.default == Action::Drop {
                        self.m.drop_default.add(n);
                    }
                    self.cfg.default
                }
            };
            match action {
                Action::Accept => {
                    self.m.accepted.add(n);
                    out.emit(0, frame);
                }
                Action::Drop => out.drop_frame(frame),
            }
        }
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        DECL.write(&mut self.cfg, knob, value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::testutil::*;
    use flexstack_core::{Switch, Value};
    use flexstack_wire::packet::build;
    use std::net::{Ipv4Addr, Ipv6Addr};

    const IN: Direction = Direction::Up;
    const OUT: Direction = Direction::Down;
    const HOST: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
    const NET: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 9);
    const DNS: Ipv4Addr = Ipv4Addr::new(9, 9, 9, 9);

    fn tcp(src: Ipv4Addr, dst: Ipv4Addr, sp: u16, dp: u16) -> Vec<u8> {
        build::ipv4(src, dst, proto::TCP, 64, &build::tcp(src.into(), dst.into(), sp, dp, b""))
    }

    fn udp(src: Ipv4Addr, dst: Ipv4Addr, sp: u16, dp: u16) -> Vec<u8> {
        build::ipv4(src, dst, proto::UDP, 64, &build::udp(src.into(), dst.into(), sp, dp, b""))
    }

    fn ping(src: Ipv4Addr, dst: Ipv4Addr) -> Vec<u8> {
        build::ipv4(src, dst, proto::ICMP, 64, &build::icmpv4_echo(1, 1, b""))
    }

    fn stack(args: &[&str]) -> (Switch, Log) {
        crate::testutil::recorded("fw", "firewall", args)
    }

    /// Sends one packet; true if it passed.
    fn passes(sw: &mut Switch, log: &Log, packet: Vec<u8>, dir: Direction) -> bool {
        send(sw, "fw", "in", &[packet], dir, 1);
        !take(log).is_empty()
    }

    fn rules_arg(rules: &[&str]) -> String {
        let list: Vec<String> = rules.iter().map(|r| format!("{r:?}")).collect();
        format!("rules=[{}]", list.join(", "))
    }

    #[test]
    fn rule_forms_parse_and_print_back() {
        for (text, canonical) in [
            ("drop in tcp from any to 10.77.0.2 port 22", "drop in tcp to 10.77.0.2 port 22"),
            ("accept out udp to any port 53", "accept out udp to any port 53"),
            ("drop in from 203.0.113.0/24", "drop in from 203.0.113.0/24"),
            ("accept icmp", "accept icmp"),
            ("accept any proto 6 from 10.0.0.0/8 port 1000-2000", "accept tcp from 10.0.0.0/8 port 1000-2000"),
            ("drop  out   proto 47", "drop out proto 47"),
            ("drop to fd77::/64", "drop to fd77::/64"),
            ("accept", "accept"),
        ] {
            let rule = Rule::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(rule.to_string(), canonical);
            assert_eq!(Rule::parse(canonical).unwrap(), rule);
        }
    }

    #[test]
    fn bad_rules_say_which_word_and_what_was_expected() {
        for (text, want) in [
            ("", "expected `accept` or `drop` after word 0"),
            ("allow tcp", "word 1 `allow`: expected `accept` or `drop`"),
            ("drop inn", "word 2 `inn`: expected `in`, `out`, `any`, a protocol"),
            ("drop in tcpp", "word 3 `tcpp`: expected a protocol (tcp, udp, icmp, proto N), `from`, `to`"),
            ("drop tcp port 22", "word 3 `port`: expected `from`, `to` or the end"),
            ("drop in from", "expected an address, a prefix or `any` after word 3 but the rule ends"),
            ("drop in from 10.0.0.300", "word 4 `10.0.0.300`: expected an address or prefix"),
            ("drop in from 10.0.0.0/40", "prefix length 40 is longer than 32"),
            ("drop icmp to any port 1", "word 5 `port`: ports need the protocol tcp or udp"),
            ("drop tcp to any port 99999", "word 6 `99999`: port `99999` is larger than 65535"),
            ("drop tcp to any port", "after `port`"),
            ("drop proto 256", "word 3 `256`: expected a protocol number 0-255"),
            ("drop from 10.0.0.1 to fd00::1", "different address families"),
            ("drop from any to any to any", "word 6 `to`: expected the end of the rule"),
        ] {
            let e = Rule::parse(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
        let e = config_error("firewall", &[&rules_arg(&["accept icmp", "drop inn"])]);
        assert!(e.contains("setting `rules` of a firewall module: rule 2 \"drop inn\": word 2 `inn`"), "{e}");
        assert!(config_error("firewall", &["rules=\"accept\""]).contains("expected an array of strings"));
        assert!(config_error("firewall", &["default=\"reject\""]).contains("expected `accept` or `drop`"));
    }

    #[test]
    fn each_rule_form_matches() {
        let (mut sw, log) = stack(&[
            &rules_arg(&[
                "drop in tcp from any to 10.77.0.2 port 22",
                "accept out udp to any port 53",
                "drop in from 203.0.113.0/24",
                "accept icmp",
                "drop out udp",
            ]),
            "default=\"accept\"",
        ]);
        // Rule 1: inbound ssh to the host.
        assert!(!passes(&mut sw, &log, tcp(DNS, HOST, 5555, 22), IN));
        assert!(passes(&mut sw, &log, tcp(HOST, DNS, 5555, 22), OUT), "direction matters");
        assert!(passes(&mut sw, &log, tcp(DNS, HOST, 5555, 23), IN), "port matters");
        assert!(passes(&mut sw, &log, udp(DNS, HOST, 5555, 22), IN), "protocol matters");
        // Rule 2 before rule 5: DNS out passes, other UDP out is dropped.
        assert!(passes(&mut sw, &log, udp(HOST, DNS, 4000, 53), OUT));
        assert!(!passes(&mut sw, &log, udp(HOST, DNS, 4000, 54), OUT));
        // Rule 3: anything in from the bad net, but rule 4 is later so ICMP from there is dropped too.
        assert!(!passes(&mut sw, &log, ping(NET, HOST), IN));
        assert!(!passes(&mut sw, &log, tcp(NET, HOST, 1, 80), IN));
        assert!(passes(&mut sw, &log, ping(DNS, HOST), IN));
        // Default accept.
        assert!(passes(&mut sw, &log, tcp(HOST, NET, 1, 80), OUT));
        let m = |n: usize| u64_var(&sw, &format!("module.fw.rule{n}_matches_total"));
        assert_eq!([m(1), m(2), m(3), m(4), m(5)], [1, 1, 2, 1, 1]);
        assert_eq!(u64_var(&sw, "module.fw.drop_rule_total"), 4);
        assert_eq!(u64_var(&sw, "module.fw.accepted_total"), 6);
        assert_eq!(u64_var(&sw, "module.fw.frames_dropped_total"), 4);
        assert_eq!(u64_var(&sw, "module.fw.drop_default_total"), 0);
    }

    #[test]
    fn default_policy_enabled_knob_and_ipv6() {
        let (mut sw, log) =
            stack(&[&rules_arg(&["accept out", "accept in tcp from fd77::/64 port 443"]), "default=\"drop\""]);
        let a: Ipv6Addr = "fd77::5".parse().unwrap();
        let b: Ipv6Addr = "fd00::1".parse().unwrap();
        let t6 = |s: Ipv6Addr, d: Ipv6Addr, sp| {
            build::ipv6(s, d, proto::TCP, 64, &build::tcp(s.into(), d.into(), sp, 5000, b""))
        };
        assert!(passes(&mut sw, &log, t6(a, b, 443), IN));
        assert!(!passes(&mut sw, &log, t6(b, a, 443), IN));
        assert!(!passes(&mut sw, &log, tcp(HOST, DNS, 443, 1), IN), "an IPv6 prefix never matches IPv4");
        assert!(passes(&mut sw, &log, tcp(HOST, DNS, 443, 1), OUT));
        assert_eq!(u64_var(&sw, "module.fw.drop_default_total"), 2);
        assert_eq!(var(&sw, "module.fw.default"), Some(Value::Str("drop".into())));
        sw.apply(vec![knob("fw", "default", Value::Str("accept".into()))]).unwrap();
        assert!(passes(&mut sw, &log, t6(b, a, 443), IN));
        // The switch checks a text knob's type only: the module refuses the value, the edit carries a note.
        let notes = sw.apply(vec![knob("fw", "default", Value::Str("maybe".into()))]).unwrap();
        assert!(notes.iter().any(|n| n.contains("expected `accept` or `drop`")), "{notes:?}");
        assert_eq!(var(&sw, "module.fw.default"), Some(Value::Str("accept".into())));
        sw.apply(vec![knob("fw", "default", Value::Str("drop".into())), knob("fw", "enabled", Value::Bool(false))])
            .unwrap();
        assert!(passes(&mut sw, &log, t6(b, a, 443), IN));
        assert!(passes(&mut sw, &log, vec![1, 2, 3], IN), "disabled: not even parsed");
        sw.apply(vec![knob("fw", "enabled", Value::Bool(true))]).unwrap();
        assert!(!passes(&mut sw, &log, vec![0x45, 2, 3], IN));
        assert_eq!(u64_var(&sw, "module.fw.drop_truncated_total"), 1);
    }

    #[test]
    fn non_first_fragments_never_match_port_rules() {
        let (mut sw, log) = stack(&[&rules_arg(&["drop tcp to any port 0-65535", "accept tcp", "drop"])]);
        let mut frag = tcp(DNS, HOST, 1, 22);
        frag[6] = 0x00;
        frag[7] = 0x10; // offset 128 bytes
        let c = flexstack_wire::checksum::ipv4_header(&{
            let mut h = frag[..20].to_vec();
            h[10] = 0;
            h[11] = 0;
            h
        });
        frag[10..12].copy_from_slice(&c.to_be_bytes());
        assert!(passes(&mut sw, &log, frag, IN));
        assert!(!passes(&mut sw, &log, tcp(DNS, HOST, 1, 22), IN));
    }
}
