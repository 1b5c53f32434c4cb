//! Traffic classes and the rules that give a flow its class.

use flexstack_wire::cidr::Words;
use flexstack_wire::packet::{proto, PacketInfo};

/// A traffic class; lower values are served first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Class {
    /// Served before everything else.
    Urgent = 0,
    /// Served before bulk.
    Interactive = 1,
    /// Served last (the default).
    Bulk = 2,
}

impl Class {
    pub(super) const ALL: [Class; 3] = [Class::Urgent, Class::Interactive, Class::Bulk];

    /// The class's name.
    pub fn name(self) -> &'static str {
        match self {
            Class::Urgent => "urgent",
            Class::Interactive => "interactive",
            Class::Bulk => "bulk",
        }
    }

    /// The class named `s`.
    pub fn parse(s: &str) -> Option<Class> {
        Class::ALL.into_iter().find(|c| c.name() == s)
    }

    /// The class of a DSCP: EF (46), VOICE-ADMIT (44), CS5-CS7 (40, 48, 56) are urgent; AF2x-AF4x and CS2-CS4
    /// (16-38) are interactive; everything else (best effort, CS1/lower effort, AF1x) is bulk.
    pub fn from_dscp(dscp: u8) -> Class {
        match dscp {
            40 | 44 | 46 | 48 | 56 => Class::Urgent,
            16..=38 => Class::Interactive,
            _ => Class::Bulk,
        }
    }
}

/// A rule of `class_rules`: packets matching every condition given start flows of `class`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassRule {
    /// The class given.
    pub class: Class,
    /// Transport protocol, if limited.
    pub protocol: Option<u8>,
    /// A port either end must have (TCP/UDP).
    pub port: Option<u16>,
    /// The DSCP the packet must carry.
    pub dscp: Option<u8>,
}

impl ClassRule {
    /// Parses `CLASS [tcp|udp|icmp] [port N] [dscp N]`.
    pub fn parse(text: &str) -> Result<ClassRule, String> {
        let mut w = Words::new(text);
        let c = w.next("a class (urgent, interactive, bulk)")?;
        let class = Class::parse(c).ok_or_else(|| w.error_last("expected a class (urgent, interactive, bulk)"))?;
        let mut rule = ClassRule { class, protocol: None, port: None, dscp: None };
        rule.protocol = match w.peek() {
            Some("tcp") => Some(proto::TCP),
            Some("udp") => Some(proto::UDP),
            Some("icmp") => Some(proto::ICMP),
            _ => None,
        };
        if rule.protocol.is_some() {
            w.next("a protocol")?;
        }
        if w.eat("port") {
            let p = w.next("a port number")?;
            rule.port = Some(p.parse().map_err(|_| w.error_last("expected a port number (0-65535)"))?);
        }
        if w.eat("dscp") {
            let d = w.next("a DSCP (0-63)")?;
            rule.dscp =
                Some(d.parse().ok().filter(|d: &u8| *d < 64).ok_or_else(|| w.error_last("expected a DSCP (0-63)"))?);
        }
        w.end("`port N`, `dscp N` or the end of the rule")?;
        Ok(rule)
    }

    pub(super) fn matches(&self, info: &PacketInfo, dscp: u8) -> bool {
        let proto_ok = match self.protocol {
            None => true,
            Some(proto::ICMP) => matches!(info.protocol, proto::ICMP | proto::ICMPV6),
            Some(p) => info.protocol == p,
        };
        proto_ok
            && self.port.is_none_or(|p| info.has_ports() && (info.src_port == p || info.dst_port == p))
            && self.dscp.is_none_or(|d| d == dscp)
    }
}

/// The DSCP of an IP packet (the upper six bits of the IPv4 TOS or IPv6 traffic class).
pub(crate) fn dscp_of(data: &[u8]) -> u8 {
    match data {
        [b0, b1, ..] if b0 >> 4 == 6 => (((b0 & 0x0f) << 4) | (b1 >> 4)) >> 2,
        [_, b1, ..] => b1 >> 2,
        _ => 0,
    }
}
