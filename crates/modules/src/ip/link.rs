//! `link`: the Ethernet adaptation between a link face (the raw frames of an interface flexstack owns, e.g. the
//! daemon's AF_PACKET face) and the IP modules. It owns the link's addresses: it answers ARP (RFC 826) and IPv6
//! neighbour solicitations (RFC 4861) for them, resolves next hops into a bounded neighbour cache, and adds and
//! removes Ethernet headers. Sans-IO: frames in, frames out, timers through `out.wake_at` / `poll`.
//!
//! - Ports: inputs `ip` (ip: packets to send out of the interface) and `wire` (ethernet: frames read from the
//!   interface); outputs `wire` (ethernet: frames to write to the interface, direction down) and `ip` (ip: packets
//!   received, Ethernet header removed, direction up). Control frames cross over unchanged (`wire` → `ip`,
//!   `ip` → `wire`).
//! - Settings (not knobs; change them with `module replace`, which keeps the neighbour cache):
//!   - `mac` (required): the interface's unicast MAC address, `"02:00:00:00:00:01"` (`-` separators accepted).
//!   - `addresses`: the addresses flexstack owns on this link with their on-link prefixes, an array of strings
//!     (`["10.0.0.2/24", "fd00::2/64"]`) or one string separated by commas or spaces; a bare address is a host
//!     prefix. ARP requests and neighbour solicitations for them are answered, and they are the sources of the
//!     module's own requests.
//!   - `link_local` (bool, default true): also own the IPv6 link-local address derived from `mac` (EUI-64,
//!     `fe80::/64`), used for neighbour discovery of link-local next hops.
//!   - `gateway_v4`, `gateway_v6` (optional): next hops for destinations outside the on-link prefixes; each must
//!     be on-link (an IPv6 link-local gateway is on-link whenever the module owns an IPv6 address). Without one,
//!     packets to off-link destinations of that family are dropped (`no_route`).
//! - Knobs (each also accepted as a setting of the same name):
//!   - `neighbour_timeout_ms` (default 60000, 1..=86400000): a resolved neighbour stays reachable this long after
//!     it was last confirmed (a reply, or a request for one of our addresses). Then, if packets were sent to it
//!     since, it is probed (unicast ARP request / NS to its known MAC, still used meanwhile) and kept if it answers;
//!     if not used, it is removed (`expired_total`).
//!   - `resolve_retries` (default 3, 0..=100) and `resolve_interval_ms` (default 1000, 1..=60000): an unresolved
//!     next hop gets one request at once and up to `resolve_retries` more, `resolve_interval_ms` apart; one interval
//!     after the last, it is given up (`resolution_failed_total`) and its queued packets are dropped
//!     (`unresolved`). A probed neighbour that does not answer is removed the same way.
//!   - `queue_per_neighbour` (default 64, 1..=65536): packets held per unresolved next hop, sent in order once it
//!     resolves; beyond, dropped (`resolution_queue_full`).
//!   - `max_queued` (default 1024, 1..=1048576): packets held for all next hops together (the same drop beyond).
//!   - `max_neighbours` (default 1024, 1..=1048576): cache entries, resolved or not; a new one evicts the least
//!     recently created or confirmed (`evicted_total`, its queued packets dropped as `evicted`).
//!
//! # Receiving (`wire` in)
//! A frame whose transport checksum a link face left partial (`MetaKey::CSUM_PARTIAL`) has it completed first
//! ([`flexstack_wire::checksum::complete_partial`]): the modules behind the link see complete checksums.
//! Frames shorter than an Ethernet header are `truncated`; unicast frames to another MAC, and multicast frames
//! that do not match their EtherType (IPv4: `01:00:5e:…`, IPv6: `33:33:…`; ARP: broadcast only) are
//! `not_for_us`; frames from a multicast or broadcast source MAC, or from our own MAC (our frames looped back), are
//! `bad_source_mac`; EtherTypes other than ARP, IPv4 and IPv6 (VLAN tags and 802.3 length fields included) are
//! `bad_ethertype`.
//! - ARP (Ethernet/IPv4 only, else `arp_malformed`; also malformed: an operation other than request/reply, a
//!   multicast or zero sender MAC, a multicast, broadcast or loopback sender address). RFC 826 merge: a known
//!   sender's entry is updated (a gratuitous ARP updates, never creates); a request or reply addressed to one of
//!   our addresses also creates the sender's entry. Requests for our addresses are answered (to the sender's MAC),
//!   ARP probes (sender 0.0.0.0, RFC 5227) included, without learning. A sender claiming one of our addresses
//!   from another MAC counts in `address_conflicts_total` and is not learned.
//! - IPv4 and IPv6: the version must match the EtherType (`bad_version`) and the fixed header be there
//!   (`truncated`); bytes beyond the length the IP header states (Ethernet padding) are cut; the packet leaves on
//!   `ip` without its Ethernet header, direction up (`passed_up_total`). Nothing else is checked: that is the `ip`
//!   module's job.
//! - ICMPv6 neighbour discovery (types 133-137 directly after the IPv6 header) is consumed here: a wrong
//!   checksum is `bad_icmpv6_checksum`; a message smoltcp cannot parse (truncated, bad option lengths) or whose IPv6
//!   payload length exceeds the frame is `ndp_malformed`; one failing RFC 4861 7.1 validity (hop limit 255, code 0,
//!   unicast target, a DAD probe sent to the target's solicited-node address without a source link-layer option,
//!   no solicited NA to a multicast address, unicast link-layer options) is `ndp_invalid`. A neighbour
//!   solicitation for one of our addresses is answered with a solicited, override NA carrying our MAC (to the
//!   source link-layer option's MAC, else the frame's source), and the source link-layer option is learnt; a DAD
//!   probe (source `::`) for one of our addresses is answered to all-nodes (`ff02::1`), not solicited. A neighbour
//!   advertisement updates an existing entry (RFC 4861 7.2.5: not overriding a known MAC without the override
//!   flag) and resolves an incomplete one; it never creates one. Router solicitations, advertisements and
//!   redirects are counted and ignored.
//!
//! # Sending (`ip` in)
//! A packet that is not IPv4/IPv6 with its whole fixed header is `bad_packet`. IPv4 broadcast (255.255.255.255 or
//! the directed broadcast of an on-link prefix up to /30) goes to `ff:ff:ff:ff:ff:ff`, IPv4 multicast to
//! `01:00:5e` + its low 23 bits, IPv6 multicast to `33:33` + its low 32 bits. A unicast destination in an on-link
//! prefix (IPv6 link-local ones included) is its own next hop; any other goes to the family's gateway; none, or a
//! destination that is unspecified, loopback or one of our own addresses, is `no_route`. A resolved next hop gets
//! the packet at once with an Ethernet header (our MAC → its MAC); an unresolved one queues it and is resolved by
//! a broadcast ARP request or an NS to its solicited-node address (`33:33:ff:…`, with our source link-layer
//! option), from the packet's source if that is one of our addresses, else from our address in the prefix of the
//! next hop (the link-local one for link-local next hops). When the answer comes, the queue is sent in order.
//! Frames are not padded to 60 bytes (the device does it).
//!
//! # Meters and accounting
//! `neighbours` and `queued` (gauges), `passed_up_total`, `sent_total` (IP packets emitted on `wire`),
//! `arp_requests_received_total`, `arp_replies_received_total`, `arp_requests_answered_total`,
//! `arp_requests_sent_total`, `ns_received_total`, `na_received_total`, `rs_received_total`, `ra_received_total`,
//! `redirects_received_total`, `ns_sent_total`, `na_sent_total`, `resolved_total`, `resolution_failed_total`,
//! `expired_total`, `evicted_total`, `address_conflicts_total`, and `drop_<reason>_total` for each reason above
//! (every drop also counted by the switch). ARP and NDP messages consumed here are not drops; so:
//! - `wire` in = `passed_up_total` + ARP requests and replies received + NS + NA + RS + RA + redirects received +
//!   drops of the receive reasons (`truncated` … `bad_icmpv6_checksum`);
//! - `ip` in = `sent_total` + `queued` + drops of the send reasons (`bad_packet`, `no_route`,
//!   `resolution_queue_full`, `unresolved`, `evicted`);
//! - `wire` out = `sent_total` + `arp_requests_sent_total` + `arp_requests_answered_total` + `ns_sent_total` +
//!   `na_sent_total`; `ip` out = `passed_up_total`.
//!
//! Procedures (`flexstack module exec`): `neighbours` lists the cache, one `ip mac age_ms` line per entry sorted
//! by address (`incomplete` for the MAC of an unresolved one; the age since it was last confirmed, or created);
//! `addresses` lists the owned addresses with their prefix lengths, then the gateways; `flush` empties the cache
//! (queued packets dropped as `unresolved`) and returns how many entries it removed.
//!
//! Not done here: duplicate address detection of our own addresses, gratuitous announcements at start, router
//! discovery (RAs are not used for prefixes or default routes), proxy ARP, VLANs.

use flexstack_core::module::port_type;
use flexstack_core::{
    Batch, ConfigError, Direction, Frame, Meter, Module, ModuleBuilder, ModuleInterface, ModuleKind, ModuleVars,
    Output, Packet, PortSpec, Settings, Time, Value, ValueType, VarSpec,
};
use flexstack_wire::checksum;
use flexstack_wire::cidr::Prefix;
use flexstack_wire::packet::proto;
use smoltcp::wire::{
    ArpOperation, ArpPacket, ArpRepr, EthernetAddress, EthernetFrame, EthernetProtocol, EthernetRepr, Icmpv6Packet,
    IpProtocol, Ipv6Packet, Ipv6Repr, NdiscNeighborFlags, NdiscRepr, RawHardwareAddress, ETHERNET_HEADER_LEN,
};
use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

/// The kind's name in stack files.
pub const KIND: &str = "ethernet";

const IN_IP: usize = 0;
const IN_WIRE: usize = 1;
const OUT_WIRE: usize = 0;
const OUT_IP: usize = 1;

/// A MAC address.
pub type Mac = [u8; 6];

const BROADCAST: Mac = [0xff; 6];
const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);

/// Default `neighbour_timeout_ms`.
pub const DEFAULT_NEIGHBOUR_TIMEOUT_MS: u64 = 60_000;
/// Default `resolve_retries`.
pub const DEFAULT_RESOLVE_RETRIES: u64 = 3;
/// Default `resolve_interval_ms`.
pub const DEFAULT_RESOLVE_INTERVAL_MS: u64 = 1000;
/// Default `queue_per_neighbour`.
pub const DEFAULT_QUEUE_PER_NEIGHBOUR: u64 = 64;
/// Default `max_queued`.
pub const DEFAULT_MAX_QUEUED: u64 = 1024;
/// Default `max_neighbours`.
pub const DEFAULT_MAX_NEIGHBOURS: u64 = 1024;

/// The knobs: name, default, range, unit, description.
const KNOBS: [(&str, u64, u64, u64, &str, &str); 6] = [
    (
        "neighbour_timeout_ms",
        DEFAULT_NEIGHBOUR_TIMEOUT_MS,
        1,
        86_400_000,
        "ms",
        "time a neighbour stays reachable after it was last confirmed",
    ),
    ("resolve_retries", DEFAULT_RESOLVE_RETRIES, 0, 100, "", "requests resent to a next hop that does not answer"),
    ("resolve_interval_ms", DEFAULT_RESOLVE_INTERVAL_MS, 1, 60_000, "ms", "time between two requests"),
    ("queue_per_neighbour", DEFAULT_QUEUE_PER_NEIGHBOUR, 1, 65_536, "frames", "packets held per unresolved next hop"),
    ("max_queued", DEFAULT_MAX_QUEUED, 1, 1 << 20, "frames", "packets held for all unresolved next hops"),
    ("max_neighbours", DEFAULT_MAX_NEIGHBOURS, 1, 1 << 20, "", "entries in the neighbour cache"),
];

/// Why a frame or packet was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reason {
    Truncated,
    NotForUs,
    BadSourceMac,
    BadEthertype,
    BadVersion,
    ArpMalformed,
    NdpMalformed,
    NdpInvalid,
    BadIcmpv6Checksum,
    BadPacket,
    NoRoute,
    QueueFull,
    Unresolved,
    Evicted,
}

/// Receive reasons first (up to `BadIcmpv6Checksum`), then send reasons.
const REASONS: [(Reason, &str, &str); 14] = [
    (Reason::Truncated, "truncated", "frames shorter than their Ethernet or IP header"),
    (Reason::NotForUs, "not_for_us", "frames to another MAC, or multicast not matching their EtherType"),
    (Reason::BadSourceMac, "bad_source_mac", "frames from a multicast source MAC or our own"),
    (Reason::BadEthertype, "bad_ethertype", "frames of an EtherType other than ARP, IPv4, IPv6"),
    (Reason::BadVersion, "bad_version", "IP frames whose version disagrees with the EtherType"),
    (Reason::ArpMalformed, "arp_malformed", "ARP messages that are not Ethernet/IPv4 requests or replies"),
    (Reason::NdpMalformed, "ndp_malformed", "neighbour discovery messages that do not parse"),
    (Reason::NdpInvalid, "ndp_invalid", "neighbour discovery messages failing RFC 4861 validity checks"),
    (Reason::BadIcmpv6Checksum, "bad_icmpv6_checksum", "neighbour discovery messages with a wrong checksum"),
    (Reason::BadPacket, "bad_packet", "packets to send that are not IPv4/IPv6 with a whole fixed header"),
    (Reason::NoRoute, "no_route", "packets to send with no next hop"),
    (Reason::QueueFull, "resolution_queue_full", "packets to send while their next hop's queue was full"),
    (Reason::Unresolved, "unresolved", "queued packets whose next hop never answered"),
    (Reason::Evicted, "evicted", "queued packets whose next hop was evicted from the cache"),
];

/// Number of receive reasons at the start of [`REASONS`].
const RECEIVE_REASONS: usize = 9;

/// What the module counts besides drops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Count {
    PassedUp,
    Sent,
    ArpRequestsReceived,
    ArpRepliesReceived,
    ArpRequestsAnswered,
    ArpRequestsSent,
    NsReceived,
    NaReceived,
    RsReceived,
    RaReceived,
    RedirectsReceived,
    NsSent,
    NaSent,
    Resolved,
    ResolutionFailed,
    Expired,
    Evicted,
    AddressConflicts,
}

const COUNTS: [(Count, &str, &str); 18] = [
    (Count::PassedUp, "passed_up_total", "IP packets received and emitted on `ip`"),
    (Count::Sent, "sent_total", "IP packets emitted on `wire` with an Ethernet header"),
    (Count::ArpRequestsReceived, "arp_requests_received_total", "ARP requests received"),
    (Count::ArpRepliesReceived, "arp_replies_received_total", "ARP replies received"),
    (Count::ArpRequestsAnswered, "arp_requests_answered_total", "ARP replies sent for our addresses"),
    (Count::ArpRequestsSent, "arp_requests_sent_total", "ARP requests sent (resolution and probes)"),
    (Count::NsReceived, "ns_received_total", "neighbour solicitations received"),
    (Count::NaReceived, "na_received_total", "neighbour advertisements received"),
    (Count::RsReceived, "rs_received_total", "router solicitations received (ignored)"),
    (Count::RaReceived, "ra_received_total", "router advertisements received (ignored)"),
    (Count::RedirectsReceived, "redirects_received_total", "redirects received (ignored)"),
    (Count::NsSent, "ns_sent_total", "neighbour solicitations sent (resolution and probes)"),
    (Count::NaSent, "na_sent_total", "neighbour advertisements sent for our addresses"),
    (Count::Resolved, "resolved_total", "next hops resolved"),
    (Count::ResolutionFailed, "resolution_failed_total", "next hops or probed neighbours that did not answer"),
    (Count::Expired, "expired_total", "neighbours removed unused after their timeout"),
    (Count::Evicted, "evicted_total", "neighbours evicted to make room"),
    (Count::AddressConflicts, "address_conflicts_total", "ARP/NA from another MAC claiming one of our addresses"),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Limits {
    neighbour_timeout_ms: u64,
    resolve_retries: u64,
    resolve_interval_ms: u64,
    queue_per_neighbour: u64,
    max_queued: u64,
    max_neighbours: u64,
}

impl Limits {
    fn get(&self, name: &str) -> Option<u64> {
        Some(match name {
            "neighbour_timeout_ms" => self.neighbour_timeout_ms,
            "resolve_retries" => self.resolve_retries,
            "resolve_interval_ms" => self.resolve_interval_ms,
            "queue_per_neighbour" => self.queue_per_neighbour,
            "max_queued" => self.max_queued,
            "max_neighbours" => self.max_neighbours,
            _ => return None,
        })
    }

    fn set(&mut self, name: &str, v: u64) -> bool {
        let field = match name {
            "neighbour_timeout_ms" => &mut self.neighbour_timeout_ms,
            "resolve_retries" => &mut self.resolve_retries,
            "resolve_interval_ms" => &mut self.resolve_interval_ms,
            "queue_per_neighbour" => &mut self.queue_per_neighbour,
            "max_queued" => &mut self.max_queued,
            "max_neighbours" => &mut self.max_neighbours,
            _ => return false,
        };
        *field = v;
        true
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.neighbour_timeout_ms)
    }

    fn interval(&self) -> Duration {
        Duration::from_millis(self.resolve_interval_ms)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------------------------

/// Parses `02:00:00:00:00:01` (or with `-`).
pub fn parse_mac(text: &str) -> Option<Mac> {
    let mut mac = [0u8; 6];
    let mut parts = text.trim().split([':', '-']);
    for b in &mut mac {
        let part = parts.next()?;
        if part.is_empty() || part.len() > 2 || !part.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        *b = u8::from_str_radix(part, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// `02:00:00:00:00:01`.
pub fn format_mac(mac: Mac) -> String {
    let [a, b, c, d, e, f] = mac;
    format!("{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{f:02x}")
}

/// The IPv6 link-local address derived from `mac` (modified EUI-64, RFC 4291 appendix A).
pub fn link_local_of(mac: Mac) -> Ipv6Addr {
    let eui = EthernetAddress(mac).as_eui_64().unwrap_or([0; 8]);
    let mut a = [0u8; 16];
    a[0] = 0xfe;
    a[1] = 0x80;
    a[8..].copy_from_slice(&eui);
    Ipv6Addr::from(a)
}

/// The solicited-node multicast address of `addr` (RFC 4291 2.7.1).
pub fn solicited_node(addr: Ipv6Addr) -> Ipv6Addr {
    let o = addr.octets();
    Ipv6Addr::from([0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, o[13], o[14], o[15]])
}

/// The MAC an IPv6 multicast address maps to (RFC 2464 7).
pub fn multicast_mac_v6(addr: Ipv6Addr) -> Mac {
    let o = addr.octets();
    [0x33, 0x33, o[12], o[13], o[14], o[15]]
}

/// The MAC an IPv4 multicast address maps to (RFC 1112 6.4).
pub fn multicast_mac_v4(addr: Ipv4Addr) -> Mac {
    let o = addr.octets();
    [0x01, 0x00, 0x5e, o[1] & 0x7f, o[2], o[3]]
}

fn is_link_local_v6(a: Ipv6Addr) -> bool {
    a.segments()[0] & 0xffc0 == 0xfe80
}

/// Parses an owned address `10.0.0.2/24`, `fd00::2/64` or a bare address (a host prefix).
fn parse_owned(text: &str) -> Result<(IpAddr, Prefix), String> {
    let text = text.trim();
    let (a, len) = match text.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (text, None),
    };
    let addr: IpAddr = a
        .parse()
        .map_err(|_| format!("expected an address with its prefix like 10.0.0.2/24 or fd00::2/64, got {text:?}"))?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let len = match len {
        None => max,
        Some(l) => l
            .parse::<u8>()
            .ok()
            .filter(|n| *n <= max && !l.starts_with('+'))
            .ok_or_else(|| format!("expected a prefix length 0..={max} after `/` in {text:?}"))?,
    };
    let bad = match addr {
        IpAddr::V4(v) => v.is_unspecified() || v.is_multicast() || v.is_broadcast() || v.is_loopback(),
        IpAddr::V6(v) => v.is_unspecified() || v.is_multicast() || v.is_loopback(),
    };
    if bad {
        return Err(format!("{text:?}: not a unicast address"));
    }
    let prefix = Prefix::new(addr, len)?;
    if let IpAddr::V4(v) = addr {
        if len <= 30 && (v == broadcast_of(&prefix) || IpAddr::V4(v) == prefix.addr()) {
            return Err(format!("{text:?}: the network or broadcast address of its prefix"));
        }
    }
    Ok((addr, prefix))
}

/// The directed broadcast address of an IPv4 prefix.
fn broadcast_of(prefix: &Prefix) -> Ipv4Addr {
    match prefix.addr() {
        IpAddr::V4(n) => {
            let host = u32::MAX.checked_shr(u32::from(prefix.len())).unwrap_or(0);
            Ipv4Addr::from(u32::from(n) | host)
        }
        IpAddr::V6(_) => Ipv4Addr::UNSPECIFIED,
    }
}

#[derive(Clone, Debug)]
struct Config {
    mac: Mac,
    v4: Vec<(Ipv4Addr, Prefix)>,
    v6: Vec<(Ipv6Addr, Prefix)>,
    gateway_v4: Option<Ipv4Addr>,
    gateway_v6: Option<Ipv6Addr>,
    limits: Limits,
}

impl Config {
    fn owns(&self, ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(a) => self.v4.iter().any(|(o, _)| *o == a),
            IpAddr::V6(a) => self.v6.iter().any(|(o, _)| *o == a),
        }
    }

    /// True if `ip` is on the link: in one of our prefixes, or IPv6 link-local while we own an IPv6 address.
    fn on_link(&self, ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(_) => self.v4.iter().any(|(_, p)| p.contains(ip)),
            IpAddr::V6(a) => {
                (is_link_local_v6(a) && !self.v6.is_empty()) || self.v6.iter().any(|(_, p)| p.contains(ip))
            }
        }
    }
}

/// The `link` module kind.
pub struct LinkKind;

impl ModuleKind for LinkKind {
    fn name(&self) -> &'static str {
        KIND
    }

    fn summary(&self) -> &'static str {
        "Ethernet for a link face: owns the link's addresses, answers ARP and neighbour discovery, resolves next hops"
    }

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(KIND);
        let Some(mac_text) = r.string("mac")? else {
            return Err(ConfigError::new(
                None,
                "a link module needs `mac`, the interface's MAC address (e.g. mac = \"02:00:00:00:00:01\")",
            ));
        };
        let mac = parse_mac(&mac_text).ok_or_else(|| {
            r.error("mac", format_args!("expected a MAC address like 02:00:00:00:00:01, got {mac_text:?}"))
        })?;
        if mac[0] & 1 != 0 || mac == [0; 6] {
            return Err(r.error("mac", format_args!("{mac_text:?} is not a unicast MAC address")));
        }
        let words: Vec<String> = match settings.get("addresses").map(|s| &s.value) {
            Some(toml::Value::String(_)) => {
                let text = r.string("addresses")?.unwrap_or_default();
                text.split([',', ' ']).filter(|w| !w.is_empty()).map(str::to_string).collect()
            }
            _ => r.strings("addresses")?.unwrap_or_default(),
        };
        let mut cfg = Config {
            mac,
            v4: Vec::new(),
            v6: Vec::new(),
            gateway_v4: None,
            gateway_v6: None,
            limits: Limits {
                neighbour_timeout_ms: 0,
                resolve_retries: 0,
                resolve_interval_ms: 0,
                queue_per_neighbour: 0,
                max_queued: 0,
                max_neighbours: 0,
            },
        };
        for w in &words {
            let (addr, prefix) = parse_owned(w).map_err(|e| r.error("addresses", e))?;
            if cfg.owns(addr) {
                return Err(r.error("addresses", format_args!("{addr} is listed twice")));
            }
            match addr {
                IpAddr::V4(a) => cfg.v4.push((a, prefix)),
                IpAddr::V6(a) => cfg.v6.push((a, prefix)),
            }
        }
        if r.bool("link_local")?.unwrap_or(true) {
            let ll = link_local_of(mac);
            if !cfg.owns(ll.into()) {
                let prefix = Prefix::new(ll.into(), 64).map_err(|e| r.error("link_local", e))?;
                cfg.v6.push((ll, prefix));
            }
        }
        for key in ["gateway_v4", "gateway_v6"] {
            let Some(text) = r.string(key)? else { continue };
            let gw: IpAddr =
                text.trim().parse().map_err(|_| r.error(key, format_args!("{text:?} is not an address")))?;
            let family_ok = gw.is_ipv4() == (key == "gateway_v4");
            let unicast = match gw {
                IpAddr::V4(a) => !(a.is_unspecified() || a.is_multicast() || a.is_broadcast() || a.is_loopback()),
                IpAddr::V6(a) => !(a.is_unspecified() || a.is_multicast() || a.is_loopback()),
            };
            if !family_ok || !unicast {
                let family = if key == "gateway_v4" { "IPv4" } else { "IPv6" };
                return Err(r.error(key, format_args!("{gw} is not a unicast {family} address")));
            }
            if cfg.owns(gw) {
                return Err(r.error(key, format_args!("{gw} is one of the module's own addresses")));
            }
            if !cfg.on_link(gw) {
                return Err(r.error(key, format_args!("{gw} is not in an on-link prefix of `addresses`")));
            }
            match gw {
                IpAddr::V4(a) => cfg.gateway_v4 = Some(a),
                IpAddr::V6(a) => cfg.gateway_v6 = Some(a),
            }
        }
        for (name, default, min, max, _, _) in KNOBS {
            let v = r.u64_in(name, default, min, max)?;
            cfg.limits.set(name, v);
        }
        r.finish()?;
        Ok(Box::new(LinkBuilder(cfg)))
    }
}

struct LinkBuilder(Config);

impl ModuleBuilder for LinkBuilder {
    fn interface(&self) -> ModuleInterface {
        let m = |name: &str, unit: &str, d: &str| VarSpec::meter(name, ValueType::U64, unit, d);
        let mut vars: Vec<VarSpec> = KNOBS
            .iter()
            .map(|(name, _, min, max, unit, d)| {
                VarSpec::knob(name, ValueType::U64, unit, d).with_range(*min as f64, *max as f64)
            })
            .collect();
        vars.push(m("neighbours", "", "entries in the neighbour cache, resolved or not"));
        vars.push(m("queued", "frames", "packets waiting for their next hop to be resolved"));
        for (_, name, d) in COUNTS {
            vars.push(m(name, "frames", d));
        }
        for (_, name, d) in REASONS {
            vars.push(m(&format!("drop_{name}_total"), "frames", d));
        }
        ModuleInterface {
            inputs: vec![PortSpec::new("ip", port_type::IP), PortSpec::new("wire", port_type::ETHERNET)],
            outputs: vec![PortSpec::new("wire", port_type::ETHERNET), PortSpec::new("ip", port_type::IP)],
            vars,
            breaks_cycles: false,
        }
    }

    /// IP packets only go out on the wire; frames from the wire go up as IP, or back out as ARP / NDP answers.
    /// So a link may sit between a NAT and a face in a loop of links that no frame can go round.
    fn paths(&self) -> Option<Vec<(String, String)>> {
        Some(vec![("ip".into(), "wire".into()), ("wire".into(), "ip".into()), ("wire".into(), "wire".into())])
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        let cfg = self.0;
        for (name, ..) in KNOBS {
            vars.meter(name).set(cfg.limits.get(name).unwrap_or(0));
        }
        Box::new(Link {
            limits: cfg.limits,
            cfg,
            cache: Cache::default(),
            limits_changed: false,
            scratch: Vec::new(),
            m: Meters {
                neighbours: vars.meter("neighbours"),
                queued: vars.meter("queued"),
                counts: COUNTS.map(|(_, name, _)| vars.meter(name)),
                drops: REASONS.map(|(_, name, _)| vars.meter(&format!("drop_{name}_total"))),
            },
        })
    }
}

struct Meters {
    neighbours: Meter,
    queued: Meter,
    counts: [Meter; 18],
    drops: [Meter; 14],
}

// ---------------------------------------------------------------------------------------------------------------
// The neighbour cache
// ---------------------------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Being resolved: requests sent, packets queued.
    Incomplete,
    /// Resolved and confirmed within the timeout.
    Reachable,
    /// Resolved, timed out while in use: still used, unicast requests sent until it answers or is given up.
    Probe,
}

#[derive(Debug)]
struct Entry {
    state: State,
    mac: Mac,
    created: Time,
    confirmed: Time,
    /// Packets were sent through it since it was last confirmed.
    used: bool,
    /// Requests sent in the current resolution or probe.
    probes: u64,
    next_probe: Time,
    /// Our address the requests come from (re-checked when sending).
    source: IpAddr,
    queue: VecDeque<Packet>,
    /// Position in the cache's age order.
    seq: u64,
}

/// The neighbour cache; handed to a replacement module as its state.
#[derive(Debug, Default)]
struct Cache {
    map: HashMap<IpAddr, Entry>,
    /// (seq, address) by the time entries were created or last confirmed; stale pairs are skipped lazily.
    order: VecDeque<(u64, IpAddr)>,
    next_seq: u64,
    /// Packets in all queues.
    queued: usize,
}

impl Cache {
    /// Moves `ip`'s entry to the young end of the age order.
    fn touch(&mut self, ip: IpAddr) {
        let Some(e) = self.map.get_mut(&ip) else { return };
        self.next_seq += 1;
        e.seq = self.next_seq;
        self.order.push_back((self.next_seq, ip));
        if self.order.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.order.retain(|(s, ip)| map.get(ip).is_some_and(|e| e.seq == *s));
        }
    }

    /// The least recently created or confirmed entry.
    fn oldest(&mut self) -> Option<IpAddr> {
        while let Some(&(s, ip)) = self.order.front() {
            if self.map.get(&ip).is_some_and(|e| e.seq == s) {
                return Some(ip);
            }
            self.order.pop_front();
        }
        None
    }

    fn remove(&mut self, ip: IpAddr) -> Option<Entry> {
        let e = self.map.remove(&ip)?;
        self.queued -= e.queue.len();
        if self.map.is_empty() {
            self.order.clear();
        }
        Some(e)
    }
}

/// Where a packet goes next.
enum Hop {
    /// A broadcast or multicast MAC.
    Direct(Mac),
    /// A neighbour to resolve.
    Neighbour(IpAddr),
    NoRoute,
}

/// A neighbour discovery message, copied out of the frame.
enum Ndp {
    RouterSolicit,
    RouterAdvert,
    Redirect,
    Solicit { target: Ipv6Addr, lladdr: Option<Mac> },
    Advert { flags: NdiscNeighborFlags, target: Ipv6Addr, lladdr: Option<Mac> },
}

/// A link-layer address option's MAC; `Err` when it is not a unicast Ethernet address.
fn option_mac(raw: Option<RawHardwareAddress>) -> Result<Option<Mac>, ()> {
    match raw {
        None => Ok(None),
        Some(raw) => {
            let b = raw.as_bytes();
            if b.len() < 6 {
                return Err(());
            }
            let mac: Mac = [b[0], b[1], b[2], b[3], b[4], b[5]];
            if mac[0] & 1 != 0 || mac == [0; 6] {
                return Err(());
            }
            Ok(Some(mac))
        }
    }
}

fn v4_at(data: &[u8], at: usize) -> Ipv4Addr {
    Ipv4Addr::new(data[at], data[at + 1], data[at + 2], data[at + 3])
}

fn v6_at(data: &[u8], at: usize) -> Ipv6Addr {
    let mut a = [0u8; 16];
    a.copy_from_slice(&data[at..at + 16]);
    Ipv6Addr::from(a)
}

/// Source and destination of a packet to send, if it is IPv4/IPv6 with its whole fixed header.
fn ip_addresses(data: &[u8]) -> Option<(IpAddr, IpAddr)> {
    match data.first()? >> 4 {
        4 if data.len() >= 20 => Some((v4_at(data, 12).into(), v4_at(data, 16).into())),
        6 if data.len() >= 40 => Some((v6_at(data, 8).into(), v6_at(data, 24).into())),
        _ => None,
    }
}

fn write_ethernet(buf: &mut [u8], dst: Mac, src: Mac, ethertype: EthernetProtocol) {
    let mut frame = EthernetFrame::new_unchecked(buf);
    EthernetRepr { src_addr: EthernetAddress(src), dst_addr: EthernetAddress(dst), ethertype }.emit(&mut frame);
}

// ---------------------------------------------------------------------------------------------------------------
// The module
// ---------------------------------------------------------------------------------------------------------------

/// A running `link` module.
pub struct Link {
    cfg: Config,
    limits: Limits,
    cache: Cache,
    limits_changed: bool,
    scratch: Vec<IpAddr>,
    m: Meters,
}

impl Link {
    fn count(&self, c: Count) {
        self.m.counts[c as usize].add(1);
    }

    fn discard(&self, reason: Reason, p: Packet, out: &mut Output<'_>) {
        self.m.drops[reason as usize].add(1);
        out.drop_frame(Frame::Data(p));
    }

    fn publish(&self) {
        self.m.neighbours.set(self.cache.map.len() as u64);
        self.m.queued.set(self.cache.queued as u64);
    }

    fn deadline(&self, e: &Entry) -> Time {
        match e.state {
            State::Incomplete | State::Probe => e.next_probe,
            State::Reachable => e.confirmed + self.limits.timeout(),
        }
    }

    // --- receiving ---------------------------------------------------------------------------------------------

    fn receive(&mut self, mut p: Packet, out: &mut Output<'_>) {
        // The modules behind the link see complete transport checksums (the rule of MetaKey::CSUM_PARTIAL).
        checksum::complete_partial(&mut p);
        let repr = match EthernetFrame::new_checked(p.data()).and_then(|f| EthernetRepr::parse(&f)) {
            Ok(r) => r,
            Err(_) => return self.discard(Reason::Truncated, p, out),
        };
        let (dst, src, me) = (repr.dst_addr, repr.src_addr, EthernetAddress(self.cfg.mac));
        if dst.is_unicast() && dst != me {
            return self.discard(Reason::NotForUs, p, out);
        }
        if src.is_multicast() || src == me {
            return self.discard(Reason::BadSourceMac, p, out);
        }
        match repr.ethertype {
            EthernetProtocol::Arp if dst == me || dst.is_broadcast() => self.receive_arp(p, out),
            EthernetProtocol::Ipv4 if dst == me || dst.is_broadcast() || dst.0[..3] == [0x01, 0x00, 0x5e] => {
                self.receive_ip(p, 4, src.0, out)
            }
            EthernetProtocol::Ipv6 if dst == me || dst.0[..2] == [0x33, 0x33] => self.receive_ip(p, 6, src.0, out),
            EthernetProtocol::Arp | EthernetProtocol::Ipv4 | EthernetProtocol::Ipv6 => {
                self.discard(Reason::NotForUs, p, out)
            }
            EthernetProtocol::Unknown(_) => self.discard(Reason::BadEthertype, p, out),
        }
    }

    fn receive_ip(&mut self, mut p: Packet, version: u8, eth_src: Mac, out: &mut Output<'_>) {
        let ip = &p.data()[ETHERNET_HEADER_LEN..];
        let min = if version == 4 { 20 } else { 40 };
        if ip.is_empty() || ip[0] >> 4 != version {
            let reason = if ip.is_empty() { Reason::Truncated } else { Reason::BadVersion };
            return self.discard(reason, p, out);
        }
        if ip.len() < min {
            return self.discard(Reason::Truncated, p, out);
        }
        if version == 6 && ip[6] == proto::ICMPV6 && ip.len() > 40 && (133..=137).contains(&ip[40]) {
            return self.receive_ndp(p, eth_src, out);
        }
        // A zero length (IPv4 and IPv6 "big" GRO packets, IPv6 jumbograms) says nothing: nothing is cut then.
        let at = if version == 4 { 2 } else { 4 };
        let stated = match usize::from(u16::from_be_bytes([ip[at], ip[at + 1]])) {
            0 => ip.len(),
            total if version == 4 => total,
            payload => 40 + payload,
        };
        let keep = if stated >= min && stated < ip.len() { stated } else { ip.len() };
        let v = p.make_mut();
        v.truncate(ETHERNET_HEADER_LEN + keep);
        v.drain(..ETHERNET_HEADER_LEN);
        p.set_direction(Direction::Up);
        self.count(Count::PassedUp);
        out.emit(OUT_IP, p);
    }

    fn receive_arp(&mut self, p: Packet, out: &mut Output<'_>) {
        let parsed = ArpPacket::new_checked(&p.data()[ETHERNET_HEADER_LEN..]).and_then(|a| ArpRepr::parse(&a));
        let Ok(ArpRepr::EthernetIpv4 {
            operation,
            source_hardware_addr: sha,
            source_protocol_addr: spa,
            target_protocol_addr: tpa,
            ..
        }) = parsed
        else {
            return self.discard(Reason::ArpMalformed, p, out);
        };
        let request = match operation {
            ArpOperation::Request => true,
            ArpOperation::Reply => false,
            ArpOperation::Unknown(_) => return self.discard(Reason::ArpMalformed, p, out),
        };
        if !sha.is_unicast() || sha.0 == [0; 6] || spa.is_multicast() || spa.is_broadcast() || spa.is_loopback() {
            return self.discard(Reason::ArpMalformed, p, out);
        }
        drop(p);
        self.count(if request { Count::ArpRequestsReceived } else { Count::ArpRepliesReceived });
        let spa_ours = self.cfg.owns(spa.into());
        if spa_ours && sha.0 != self.cfg.mac {
            self.count(Count::AddressConflicts);
        }
        let tpa_ours = self.cfg.owns(tpa.into());
        if !spa.is_unspecified() && !spa_ours {
            // RFC 826: update a known sender; add it when we are the target.
            self.learn(spa.into(), sha.0, tpa_ours, out);
        }
        if tpa_ours && request {
            let reply = self.arp_frame(out, sha.0, ArpOperation::Reply, tpa, sha.0, spa);
            self.count(Count::ArpRequestsAnswered);
            out.emit(OUT_WIRE, reply);
        }
    }

    fn receive_ndp(&mut self, p: Packet, eth_src: Mac, out: &mut Output<'_>) {
        let ip = &p.data()[ETHERNET_HEADER_LEN..];
        let plen = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
        if 40 + plen > ip.len() {
            return self.discard(Reason::NdpMalformed, p, out);
        }
        let ip = &ip[..40 + plen];
        let (src, dst, hop_limit) = (v6_at(ip, 8), v6_at(ip, 24), ip[7]);
        let icmp = &ip[40..];
        let pseudo = checksum::pseudo_header(src.into(), dst.into(), proto::ICMPV6, icmp.len() as u32);
        if !checksum::verify(pseudo, icmp) {
            return self.discard(Reason::BadIcmpv6Checksum, p, out);
        }
        let parsed = Icmpv6Packet::new_checked(icmp).and_then(|pkt| Ok((pkt.msg_code(), NdiscRepr::parse(&pkt)?)));
        let (code, msg) = match parsed {
            Ok((code, repr)) => {
                let msg = match repr {
                    NdiscRepr::RouterSolicit { .. } => Ok(Ndp::RouterSolicit),
                    NdiscRepr::RouterAdvert { .. } => Ok(Ndp::RouterAdvert),
                    NdiscRepr::Redirect { .. } => Ok(Ndp::Redirect),
                    NdiscRepr::NeighborSolicit { target_addr, lladdr } => {
                        option_mac(lladdr).map(|lladdr| Ndp::Solicit { target: target_addr, lladdr })
                    }
                    NdiscRepr::NeighborAdvert { flags, target_addr, lladdr } => {
                        option_mac(lladdr).map(|lladdr| Ndp::Advert { flags, target: target_addr, lladdr })
                    }
                };
                (code, msg)
            }
            Err(_) => return self.discard(Reason::NdpMalformed, p, out),
        };
        let Ok(msg) = msg else { return self.discard(Reason::NdpInvalid, p, out) };
        if hop_limit != 255 || code != 0 {
            return self.discard(Reason::NdpInvalid, p, out);
        }
        let valid = match &msg {
            Ndp::Solicit { target, lladdr } => {
                !target.is_multicast()
                    && !src.is_multicast()
                    && (!src.is_unspecified() || (lladdr.is_none() && dst == solicited_node(*target)))
            }
            Ndp::Advert { flags, target, .. } => {
                let solicited_to_multicast = dst.is_multicast() && flags.contains(NdiscNeighborFlags::SOLICITED);
                !(target.is_multicast() || src.is_multicast() || solicited_to_multicast)
            }
            _ => true,
        };
        if !valid {
            return self.discard(Reason::NdpInvalid, p, out);
        }
        drop(p);
        match msg {
            Ndp::RouterSolicit => self.count(Count::RsReceived),
            Ndp::RouterAdvert => self.count(Count::RaReceived),
            Ndp::Redirect => self.count(Count::RedirectsReceived),
            Ndp::Solicit { target, lladdr } => {
                self.count(Count::NsReceived);
                if !self.cfg.owns(target.into()) {
                    return;
                }
                if src.is_unspecified() {
                    // Duplicate address detection for one of our addresses: defend it, to all nodes.
                    let na = self.na_frame(out, multicast_mac_v6(ALL_NODES), target, ALL_NODES, false);
                    self.count(Count::NaSent);
                    out.emit(OUT_WIRE, na);
                    return;
                }
                if let Some(mac) = lladdr {
                    if !self.cfg.owns(src.into()) {
                        self.learn(src.into(), mac, true, out);
                    }
                }
                let na = self.na_frame(out, lladdr.unwrap_or(eth_src), target, src, true);
                self.count(Count::NaSent);
                out.emit(OUT_WIRE, na);
            }
            Ndp::Advert { flags, target, lladdr } => {
                self.count(Count::NaReceived);
                if self.cfg.owns(target.into()) {
                    if lladdr != Some(self.cfg.mac) {
                        self.count(Count::AddressConflicts);
                    }
                    return;
                }
                let Some(e) = self.cache.map.get(&IpAddr::V6(target)) else { return };
                let incomplete = e.state == State::Incomplete;
                // RFC 4861 7.2.5: a known MAC is only replaced with the override flag; a solicited NA without the
                // option confirms the one known.
                let update = match lladdr {
                    Some(mac) if incomplete || mac == e.mac || flags.contains(NdiscNeighborFlags::OVERRIDE) => {
                        Some(mac)
                    }
                    None if !incomplete && flags.contains(NdiscNeighborFlags::SOLICITED) => Some(e.mac),
                    _ => None,
                };
                if let Some(mac) = update {
                    self.learn(target.into(), mac, false, out);
                }
            }
        }
    }

    /// Records that `ip` is at `mac`, confirmed now: updates its entry (resolving an incomplete one and sending
    /// its queue), or creates one if `create`.
    fn learn(&mut self, ip: IpAddr, mac: Mac, create: bool, out: &mut Output<'_>) {
        let now = out.now();
        let deadline = now + self.limits.timeout();
        if let Some(e) = self.cache.map.get_mut(&ip) {
            let queue = if e.state == State::Incomplete { std::mem::take(&mut e.queue) } else { VecDeque::new() };
            let resolved = e.state == State::Incomplete;
            e.state = State::Reachable;
            e.mac = mac;
            e.confirmed = now;
            e.used = !queue.is_empty();
            e.probes = 0;
            self.cache.queued -= queue.len();
            self.cache.touch(ip);
            if resolved {
                self.count(Count::Resolved);
            }
            for p in queue {
                self.transmit(p, mac, out);
            }
            out.wake_at(deadline);
            return;
        }
        if !create {
            return;
        }
        self.make_room(1, out);
        let entry = Entry {
            state: State::Reachable,
            mac,
            created: now,
            confirmed: now,
            used: false,
            probes: 0,
            next_probe: now,
            source: ip,
            queue: VecDeque::new(),
            seq: 0,
        };
        self.cache.map.insert(ip, entry);
        self.cache.touch(ip);
        out.wake_at(deadline);
    }

    /// Evicts the oldest entries until `room` more fit.
    fn make_room(&mut self, room: usize, out: &mut Output<'_>) {
        let max = self.limits.max_neighbours as usize;
        while self.cache.map.len() + room > max {
            let Some(ip) = self.cache.oldest() else { break };
            let Some(e) = self.cache.remove(ip) else { break };
            self.count(Count::Evicted);
            for p in e.queue {
                self.discard(Reason::Evicted, p, out);
            }
        }
    }

    // --- sending -----------------------------------------------------------------------------------------------

    fn next_hop(&self, dst: IpAddr) -> Hop {
        match dst {
            IpAddr::V4(d) => {
                if d.is_broadcast() {
                    return Hop::Direct(BROADCAST);
                }
                if d.is_multicast() {
                    return Hop::Direct(multicast_mac_v4(d));
                }
                if d.is_unspecified() || d.is_loopback() || self.cfg.owns(dst) {
                    return Hop::NoRoute;
                }
                if self.cfg.v4.iter().any(|(_, p)| p.len() <= 30 && broadcast_of(p) == d) {
                    return Hop::Direct(BROADCAST);
                }
                if self.cfg.on_link(dst) {
                    return Hop::Neighbour(dst);
                }
                self.cfg.gateway_v4.map_or(Hop::NoRoute, |g| Hop::Neighbour(g.into()))
            }
            IpAddr::V6(d) => {
                if d.is_multicast() {
                    return Hop::Direct(multicast_mac_v6(d));
                }
                if d.is_unspecified() || d.is_loopback() || self.cfg.owns(dst) {
                    return Hop::NoRoute;
                }
                if self.cfg.on_link(dst) {
                    return Hop::Neighbour(dst);
                }
                self.cfg.gateway_v6.map_or(Hop::NoRoute, |g| Hop::Neighbour(g.into()))
            }
        }
    }

    /// Our address to send requests for `target` from: `hint` if it is ours, else one in `target`'s prefix (the
    /// link-local one for a link-local target), else the first of the family.
    fn request_source(&self, target: IpAddr, hint: IpAddr) -> Option<IpAddr> {
        if hint.is_ipv4() == target.is_ipv4() && self.cfg.owns(hint) {
            return Some(hint);
        }
        match target {
            IpAddr::V4(_) => {
                let found = self.cfg.v4.iter().find(|(_, p)| p.contains(target)).or(self.cfg.v4.first());
                found.map(|(a, _)| IpAddr::V4(*a))
            }
            IpAddr::V6(t) => {
                let in_prefix = if is_link_local_v6(t) {
                    self.cfg.v6.iter().find(|(a, _)| is_link_local_v6(*a))
                } else {
                    self.cfg.v6.iter().find(|(_, p)| p.contains(target))
                };
                in_prefix.or(self.cfg.v6.first()).map(|(a, _)| IpAddr::V6(*a))
            }
        }
    }

    fn send(&mut self, p: Packet, out: &mut Output<'_>) {
        let Some((src, dst)) = ip_addresses(p.data()) else {
            return self.discard(Reason::BadPacket, p, out);
        };
        match self.next_hop(dst) {
            Hop::Direct(mac) => self.transmit(p, mac, out),
            Hop::NoRoute => self.discard(Reason::NoRoute, p, out),
            Hop::Neighbour(hop) => self.send_to_neighbour(p, hop, src, out),
        }
    }

    fn send_to_neighbour(&mut self, p: Packet, hop: IpAddr, src: IpAddr, out: &mut Output<'_>) {
        let per_queue = self.limits.queue_per_neighbour as usize;
        let room = self.cache.queued < self.limits.max_queued as usize;
        if let Some(e) = self.cache.map.get_mut(&hop) {
            if e.state != State::Incomplete {
                e.used = true;
                let mac = e.mac;
                return self.transmit(p, mac, out);
            }
            if e.queue.len() >= per_queue || !room {
                return self.discard(Reason::QueueFull, p, out);
            }
            e.queue.push_back(p);
            self.cache.queued += 1;
            return;
        }
        let Some(source) = self.request_source(hop, src) else {
            return self.discard(Reason::NoRoute, p, out);
        };
        self.make_room(1, out);
        let now = out.now();
        let mut entry = Entry {
            state: State::Incomplete,
            mac: [0; 6],
            created: now,
            confirmed: now,
            used: false,
            probes: 0,
            next_probe: now,
            source,
            queue: VecDeque::new(),
            seq: 0,
        };
        let dropped = if room {
            entry.queue.push_back(p);
            self.cache.queued += 1;
            None
        } else {
            Some(p)
        };
        self.cache.map.insert(hop, entry);
        self.cache.touch(hop);
        self.probe(hop, out);
        if let Some(p) = dropped {
            self.discard(Reason::QueueFull, p, out);
        }
    }

    /// Adds an Ethernet header to an IP packet and emits it on `wire`.
    fn transmit(&self, mut p: Packet, dst: Mac, out: &mut Output<'_>) {
        let ethertype =
            if p.data().first().is_some_and(|b| b >> 4 == 6) { EthernetProtocol::Ipv6 } else { EthernetProtocol::Ipv4 };
        let v = p.make_mut();
        let len = v.len();
        v.resize(len + ETHERNET_HEADER_LEN, 0);
        v.copy_within(..len, ETHERNET_HEADER_LEN);
        write_ethernet(v, dst, self.cfg.mac, ethertype);
        p.set_direction(Direction::Down);
        self.count(Count::Sent);
        out.emit(OUT_WIRE, p);
    }

    /// Sends the next request for `ip` (broadcast / solicited-node while incomplete, unicast when probing).
    fn probe(&mut self, ip: IpAddr, out: &mut Output<'_>) {
        let next = out.now() + self.limits.interval();
        let Some(e) = self.cache.map.get_mut(&ip) else { return };
        e.probes += 1;
        e.next_probe = next;
        let unicast = (e.state != State::Incomplete).then_some(e.mac);
        let hint = e.source;
        out.wake_at(next);
        let Some(source) = self.request_source(ip, hint) else { return };
        match (ip, source) {
            (IpAddr::V4(target), IpAddr::V4(src)) => {
                let f = self.arp_frame(out, unicast.unwrap_or(BROADCAST), ArpOperation::Request, src, [0; 6], target);
                self.count(Count::ArpRequestsSent);
                out.emit(OUT_WIRE, f);
            }
            (IpAddr::V6(target), IpAddr::V6(src)) => {
                let (ip_dst, eth_dst) = match unicast {
                    Some(mac) => (target, mac),
                    None => (solicited_node(target), multicast_mac_v6(solicited_node(target))),
                };
                let repr = NdiscRepr::NeighborSolicit {
                    target_addr: target,
                    lladdr: Some(EthernetAddress(self.cfg.mac).into()),
                };
                let f = self.ndp_frame(out, eth_dst, src, ip_dst, repr);
                self.count(Count::NsSent);
                out.emit(OUT_WIRE, f);
            }
            _ => {}
        }
    }

    fn arp_frame(
        &self,
        out: &Output<'_>,
        eth_dst: Mac,
        operation: ArpOperation,
        spa: Ipv4Addr,
        tha: Mac,
        tpa: Ipv4Addr,
    ) -> Packet {
        let repr = ArpRepr::EthernetIpv4 {
            operation,
            source_hardware_addr: EthernetAddress(self.cfg.mac),
            source_protocol_addr: spa,
            target_hardware_addr: EthernetAddress(tha),
            target_protocol_addr: tpa,
        };
        let mut p = out.pool().alloc();
        let v = p.make_mut();
        v.resize(ETHERNET_HEADER_LEN + repr.buffer_len(), 0);
        write_ethernet(v, eth_dst, self.cfg.mac, EthernetProtocol::Arp);
        repr.emit(&mut ArpPacket::new_unchecked(&mut v[ETHERNET_HEADER_LEN..]));
        p.set_direction(Direction::Down);
        p
    }

    /// A neighbour advertisement for our `target` to `ip_dst`, with our MAC as target link-layer option.
    fn na_frame(&self, out: &Output<'_>, eth_dst: Mac, target: Ipv6Addr, ip_dst: Ipv6Addr, solicited: bool) -> Packet {
        let mut flags = NdiscNeighborFlags::OVERRIDE;
        if solicited {
            flags |= NdiscNeighborFlags::SOLICITED;
        }
        let repr = NdiscRepr::NeighborAdvert {
            flags,
            target_addr: target,
            lladdr: Some(EthernetAddress(self.cfg.mac).into()),
        };
        self.ndp_frame(out, eth_dst, target, ip_dst, repr)
    }

    /// An Ethernet frame with an IPv6 packet (hop limit 255) carrying `repr`, with its ICMPv6 checksum.
    fn ndp_frame(&self, out: &Output<'_>, eth_dst: Mac, src: Ipv6Addr, dst: Ipv6Addr, repr: NdiscRepr<'_>) -> Packet {
        let len = repr.buffer_len();
        let icmp_at = ETHERNET_HEADER_LEN + 40;
        let mut p = out.pool().alloc();
        let v = p.make_mut();
        v.resize(icmp_at + len, 0);
        write_ethernet(v, eth_dst, self.cfg.mac, EthernetProtocol::Ipv6);
        let ip = Ipv6Repr {
            src_addr: src,
            dst_addr: dst,
            next_header: IpProtocol::Icmpv6,
            payload_len: len,
            hop_limit: 255,
        };
        ip.emit(&mut Ipv6Packet::new_unchecked(&mut v[ETHERNET_HEADER_LEN..icmp_at]));
        repr.emit(&mut Icmpv6Packet::new_unchecked(&mut v[icmp_at..]));
        let pseudo = checksum::pseudo_header(src.into(), dst.into(), proto::ICMPV6, len as u32);
        let c = checksum::finish(checksum::sum(pseudo, &v[icmp_at..]));
        v[icmp_at + 2..icmp_at + 4].copy_from_slice(&c.to_be_bytes());
        p.set_direction(Direction::Down);
        p
    }

    // --- timers and limits -------------------------------------------------------------------------------------

    /// Handles an entry whose deadline has come: retry, probe, give up or expire.
    fn expire(&mut self, ip: IpAddr, out: &mut Output<'_>) {
        let max_probes = 1 + self.limits.resolve_retries;
        let Some(e) = self.cache.map.get_mut(&ip) else { return };
        match e.state {
            State::Reachable if e.used => {
                e.state = State::Probe;
                e.probes = 0;
                self.probe(ip, out);
            }
            State::Reachable => {
                self.cache.remove(ip);
                self.count(Count::Expired);
            }
            State::Incomplete | State::Probe if e.probes < max_probes => self.probe(ip, out),
            State::Incomplete | State::Probe => {
                if let Some(e) = self.cache.remove(ip) {
                    self.count(Count::ResolutionFailed);
                    for p in e.queue {
                        self.discard(Reason::Unresolved, p, out);
                    }
                }
            }
        }
    }

    /// Applies lowered limits: evicts entries beyond `max_neighbours`, trims queues (newest packets first).
    fn enforce_limits(&mut self, out: &mut Output<'_>) {
        self.make_room(0, out);
        let per_queue = self.limits.queue_per_neighbour as usize;
        let mut over = self.cache.queued.saturating_sub(self.limits.max_queued as usize);
        let mut ips: Vec<IpAddr> = self.cache.map.keys().copied().collect();
        ips.sort_unstable();
        let mut trimmed = Vec::new();
        for ip in ips {
            let Some(e) = self.cache.map.get_mut(&ip) else { continue };
            while e.queue.len() > per_queue || (over > 0 && !e.queue.is_empty()) {
                let Some(p) = e.queue.pop_back() else { break };
                over = over.saturating_sub(1);
                trimmed.push(p);
            }
        }
        self.cache.queued -= trimmed.len();
        for p in trimmed {
            self.discard(Reason::QueueFull, p, out);
        }
    }

    fn neighbours_text(&self, now: Time) -> String {
        let mut entries: Vec<(&IpAddr, &Entry)> = self.cache.map.iter().collect();
        entries.sort_unstable_by_key(|(ip, _)| **ip);
        let mut text = String::new();
        for (ip, e) in entries {
            let (mac, since) = match e.state {
                State::Incomplete => ("incomplete".to_string(), e.created),
                _ => (format_mac(e.mac), e.confirmed),
            };
            let _ = writeln!(text, "{ip} {mac} {}", (now - since).as_millis());
        }
        text
    }

    fn addresses_text(&self) -> String {
        let mut text = String::new();
        for (a, p) in &self.cfg.v4 {
            let _ = writeln!(text, "{a}/{}", p.len());
        }
        for (a, p) in &self.cfg.v6 {
            let _ = writeln!(text, "{a}/{}", p.len());
        }
        if let Some(g) = self.cfg.gateway_v4 {
            let _ = writeln!(text, "gateway {g}");
        }
        if let Some(g) = self.cfg.gateway_v6 {
            let _ = writeln!(text, "gateway {g}");
        }
        text
    }
}

impl Module for Link {
    fn process(&mut self, port: usize, input: &mut Batch, out: &mut Output<'_>) {
        for frame in input.drain(..) {
            match frame {
                Frame::Data(p) if port == IN_WIRE => self.receive(p, out),
                Frame::Data(p) => self.send(p, out),
                Frame::Control(c) if port == IN_IP => out.emit(OUT_WIRE, Frame::Control(c)),
                Frame::Control(c) => out.emit(OUT_IP, Frame::Control(c)),
            }
        }
        self.publish();
    }

    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        if std::mem::take(&mut self.limits_changed) {
            self.enforce_limits(out);
        }
        let now = out.now();
        let mut due = std::mem::take(&mut self.scratch);
        due.clear();
        due.extend(self.cache.map.iter().filter(|(_, e)| self.deadline(e) <= now).map(|(ip, _)| *ip));
        // HashMap order is random: sorted, what a poll emits is deterministic.
        due.sort_unstable();
        for &ip in &due {
            self.expire(ip, out);
        }
        self.scratch = due;
        self.publish();
        self.cache.map.values().map(|e| self.deadline(e)).min()
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        match value {
            Value::U64(v) if self.limits.set(knob, *v) => {
                self.limits_changed = true;
                Ok(())
            }
            _ => Err(format!("no knob {knob}")),
        }
    }

    fn execute(&mut self, procedure: &str, _argument: &Value, out: &mut Output<'_>) -> Result<Value, String> {
        match procedure {
            "neighbours" => Ok(Value::Str(self.neighbours_text(out.now()))),
            "addresses" => Ok(Value::Str(self.addresses_text())),
            "flush" => {
                let n = self.cache.map.len() as u64;
                let mut ips: Vec<IpAddr> = self.cache.map.keys().copied().collect();
                ips.sort_unstable();
                for ip in ips {
                    if let Some(e) = self.cache.remove(ip) {
                        for p in e.queue {
                            self.discard(Reason::Unresolved, p, out);
                        }
                    }
                }
                self.publish();
                Ok(Value::U64(n))
            }
            _ => Err(format!("no procedure named {procedure}; expected neighbours, addresses or flush")),
        }
    }

    fn take_state(&mut self) -> Option<Box<dyn Any>> {
        Some(Box::new(std::mem::take(&mut self.cache)))
    }

    fn adopt_state(&mut self, state: Box<dyn Any>) -> Result<(), String> {
        let cache = state.downcast::<Cache>().map_err(|_| "not the state of a link module".to_string())?;
        self.cache = *cache;
        self.limits_changed = true;
        self.publish();
        Ok(())
    }
}

/// The drop reasons counted on the receive path, as in meter names (`drop_<reason>_total`).
pub fn receive_drop_reasons() -> impl Iterator<Item = &'static str> {
    REASONS[..RECEIVE_REASONS].iter().map(|(_, name, _)| *name)
}

/// The drop reasons counted on the send path, as in meter names (`drop_<reason>_total`).
pub fn send_drop_reasons() -> impl Iterator<Item = &'static str> {
    REASONS[RECEIVE_REASONS..].iter().map(|(_, name, _)| *name)
}

/// The meters of messages consumed on the receive path (not drops): ARP, NS, NA, RS, RA, redirects.
pub const CONSUMED_METERS: [&str; 7] = [
    "arp_requests_received_total",
    "arp_replies_received_total",
    "ns_received_total",
    "na_received_total",
    "rs_received_total",
    "ra_received_total",
    "redirects_received_total",
];

/// The meters of frames the module makes itself on `wire` (besides `sent_total`).
pub const GENERATED_METERS: [&str; 4] =
    ["arp_requests_sent_total", "arp_requests_answered_total", "ns_sent_total", "na_sent_total"];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::classify::testutil::*;
    use flexstack_core::{ControlFrame, ControlOp, Edit, Switch};
    use flexstack_wire::packet::build;
    use smoltcp::wire::Icmpv6Packet;

    const ME: Mac = [0x02, 0, 0, 0, 0, 0x01];
    const PEER: Mac = [0x02, 0, 0, 0, 0, 0x02];
    const PEER2: Mac = [0x02, 0, 0, 0, 0, 0x03];
    const GW: Mac = [0x02, 0, 0, 0, 0, 0xfe];
    const A4: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
    const P4: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
    const G4: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 254);
    const FAR4: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 7);
    const A6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2);
    const P6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1);
    const G6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
    const FAR6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 7);

    struct Stack {
        sw: Switch,
        wire: Log,
        ip: Log,
    }

    impl Stack {
        fn new(extra: &[&str]) -> Stack {
            let mut args = vec!["mac=\"02:00:00:00:00:01\"", "addresses=[\"10.0.0.2/24\", \"fd00::2/64\"]"];
            args.extend_from_slice(extra);
            let mut sw = Switch::default();
            let (w, wire) = recorder("w");
            let (i, ip) = recorder("i");
            sw.apply(vec![load("l", "link", &args), w, i, link("l[wire] -> w"), link("l[ip] -> i")]).unwrap();
            Stack { sw, wire, ip }
        }

        fn wire_in(&mut self, at_ms: u64, frames: &[Vec<u8>]) {
            send(&mut self.sw, "l", "wire", frames, Direction::Up, at_ms);
        }

        fn ip_in(&mut self, at_ms: u64, packets: &[Vec<u8>]) {
            send(&mut self.sw, "l", "ip", packets, Direction::Down, at_ms);
        }

        fn run(&mut self, at_ms: u64) {
            self.sw.run(Time::from_millis(at_ms));
        }

        /// Frames emitted on `wire`; all go down.
        fn wire_out(&self) -> Vec<Vec<u8>> {
            take(&self.wire)
                .into_iter()
                .map(|s| {
                    assert_eq!(s.direction, Direction::Down);
                    s.data
                })
                .collect()
        }

        /// Packets emitted on `ip`; all go up.
        fn ip_out(&self) -> Vec<Vec<u8>> {
            take(&self.ip)
                .into_iter()
                .map(|s| {
                    assert_eq!(s.direction, Direction::Up);
                    s.data
                })
                .collect()
        }

        fn meter(&self, name: &str) -> u64 {
            u64_var(&self.sw, &format!("module.l.{name}"))
        }

        fn exec(&mut self, procedure: &str, at_ms: u64) -> Value {
            self.sw.send_control(ControlFrame {
                op: ControlOp::Exec,
                sender: "control".into(),
                dest: "l".into(),
                serial: 1,
                param: procedure.into(),
                value: Value::Bool(true),
            });
            self.run(at_ms);
            let inbox = self.sw.take_control_inbox();
            assert_eq!(inbox.len(), 1, "{inbox:?}");
            assert_eq!(inbox[0].op, ControlOp::ExecReply, "{inbox:?}");
            inbox[0].value.clone()
        }

        fn neighbours(&mut self, at_ms: u64) -> String {
            match self.exec("neighbours", at_ms) {
                Value::Str(s) => s,
                other => panic!("neighbours gave {other:?}"),
            }
        }

        /// The accounting identities of the module docs, against the switch's port meters.
        fn check_accounting(&self) {
            let m = |n: &str| self.meter(n);
            let rx_drops: u64 = receive_drop_reasons().map(|r| m(&format!("drop_{r}_total"))).sum();
            let tx_drops: u64 = send_drop_reasons().map(|r| m(&format!("drop_{r}_total"))).sum();
            let consumed: u64 = CONSUMED_METERS.iter().map(|n| m(n)).sum();
            let generated: u64 = GENERATED_METERS.iter().map(|n| m(n)).sum();
            assert_eq!(rx_drops + tx_drops, m("frames_dropped_total"), "drop meters vs switch");
            assert_eq!(m("port.wire.frames_in_total"), m("passed_up_total") + consumed + rx_drops, "wire in");
            assert_eq!(m("port.ip.frames_in_total"), m("sent_total") + m("queued") + tx_drops, "ip in");
            assert_eq!(m("port.wire.frames_out_total"), m("sent_total") + generated, "wire out");
            assert_eq!(m("port.ip.frames_out_total"), m("passed_up_total"), "ip out");
        }
    }

    fn eth(dst: Mac, src: Mac, ethertype: u16, payload: &[u8]) -> Vec<u8> {
        let mut f = Vec::with_capacity(14 + payload.len());
        f.extend_from_slice(&dst);
        f.extend_from_slice(&src);
        f.extend_from_slice(&ethertype.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn arp(op: u16, sha: Mac, spa: Ipv4Addr, tha: Mac, tpa: Ipv4Addr) -> Vec<u8> {
        let mut a = vec![0, 1, 0x08, 0x00, 6, 4];
        a.extend_from_slice(&op.to_be_bytes());
        a.extend_from_slice(&sha);
        a.extend_from_slice(&spa.octets());
        a.extend_from_slice(&tha);
        a.extend_from_slice(&tpa.octets());
        a
    }

    fn arp_frame(dst: Mac, op: u16, sha: Mac, spa: Ipv4Addr, tha: Mac, tpa: Ipv4Addr) -> Vec<u8> {
        eth(dst, sha, 0x0806, &arp(op, sha, spa, tha, tpa))
    }

    /// An IPv6 packet (hop limit 255) carrying an ICMPv6 message with a correct checksum.
    fn icmp6(src: Ipv6Addr, dst: Ipv6Addr, mut msg: Vec<u8>) -> Vec<u8> {
        let pseudo = checksum::pseudo_header(src.into(), dst.into(), 58, msg.len() as u32);
        let c = checksum::finish(checksum::sum(pseudo, &msg));
        msg[2..4].copy_from_slice(&c.to_be_bytes());
        build::ipv6(src, dst, 58, 255, &msg)
    }

    fn ns(src: Ipv6Addr, dst: Ipv6Addr, target: Ipv6Addr, slla: Option<Mac>) -> Vec<u8> {
        let mut m = vec![135, 0, 0, 0, 0, 0, 0, 0];
        m.extend_from_slice(&target.octets());
        if let Some(mac) = slla {
            m.extend_from_slice(&[1, 1]);
            m.extend_from_slice(&mac);
        }
        icmp6(src, dst, m)
    }

    fn na(src: Ipv6Addr, dst: Ipv6Addr, target: Ipv6Addr, flags: u8, tlla: Option<Mac>) -> Vec<u8> {
        let mut m = vec![136, 0, 0, 0, flags, 0, 0, 0];
        m.extend_from_slice(&target.octets());
        if let Some(mac) = tlla {
            m.extend_from_slice(&[2, 1]);
            m.extend_from_slice(&mac);
        }
        icmp6(src, dst, m)
    }

    const S_O: u8 = 0x60;

    fn udp4(dst: Ipv4Addr, n: u8) -> Vec<u8> {
        build::ipv4(A4, dst, proto::UDP, 64, &build::udp(A4.into(), dst.into(), 5000, 53, &[n; 5]))
    }

    fn udp6(dst: Ipv6Addr, n: u8) -> Vec<u8> {
        build::ipv6(A6, dst, proto::UDP, 64, &build::udp(A6.into(), dst.into(), 5000, 53, &[n; 5]))
    }

    /// Checks an emitted NDP frame: Ethernet from us, IPv6 hop limit 255, ICMPv6 checksum right by two
    /// computations (ours and smoltcp's); returns (eth dst, ip src, ip dst, icmp message).
    fn ndp_parts(frame: &[u8]) -> (Mac, Ipv6Addr, Ipv6Addr, Vec<u8>) {
        assert_eq!(&frame[6..12], &ME);
        assert_eq!(&frame[12..14], &[0x86, 0xdd]);
        let ip = &frame[14..];
        assert_eq!(ip[0] >> 4, 6);
        assert_eq!((ip[6], ip[7]), (58, 255));
        let plen = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
        assert_eq!(plen + 40, ip.len());
        let (src, dst) = (v6_at(ip, 8), v6_at(ip, 24));
        let msg = &ip[40..];
        let pseudo = checksum::pseudo_header(src.into(), dst.into(), 58, msg.len() as u32);
        assert!(checksum::verify(pseudo, msg), "ICMPv6 checksum");
        assert!(Icmpv6Packet::new_checked(msg).unwrap().verify_checksum(&src, &dst), "smoltcp agrees");
        (frame[..6].try_into().unwrap(), src, dst, msg.to_vec())
    }

    #[test]
    fn arp_request_for_us_is_answered_and_the_sender_learnt() {
        let mut s = Stack::new(&[]);
        // Padded to 60 bytes, as on the wire.
        let mut req = arp_frame(BROADCAST, 1, PEER, P4, [0; 6], A4);
        req.resize(60, 0);
        s.wire_in(1, &[req]);
        let out = s.wire_out();
        let want = eth(PEER, ME, 0x0806, &arp(2, ME, A4, PEER, P4));
        assert_eq!(out, vec![want]);
        assert_eq!((s.meter("arp_requests_received_total"), s.meter("arp_requests_answered_total")), (1, 1));
        assert_eq!(s.meter("neighbours"), 1);
        // The sender is known: a packet to it goes at once, no request.
        let pkt = udp4(P4, 1);
        s.ip_in(2, std::slice::from_ref(&pkt));
        assert_eq!(s.wire_out(), vec![eth(PEER, ME, 0x0800, &pkt)]);
        assert_eq!(s.meter("arp_requests_sent_total"), 0);
        // A request for another host is consumed: not answered, sender not learnt.
        s.wire_in(3, &[arp_frame(BROADCAST, 1, PEER2, Ipv4Addr::new(10, 0, 0, 3), [0; 6], Ipv4Addr::new(10, 0, 0, 9))]);
        assert!(s.wire_out().is_empty());
        assert_eq!(s.meter("neighbours"), 1);
        // An ARP probe (sender 0.0.0.0) for our address is answered, not learnt.
        s.wire_in(4, &[arp_frame(BROADCAST, 1, PEER2, Ipv4Addr::UNSPECIFIED, [0; 6], A4)]);
        assert_eq!(s.wire_out(), vec![eth(PEER2, ME, 0x0806, &arp(2, ME, A4, PEER2, Ipv4Addr::UNSPECIFIED))]);
        assert_eq!(s.meter("neighbours"), 1);
        assert_eq!(s.meter("frames_dropped_total"), 0);
        s.check_accounting();
    }

    #[test]
    fn gratuitous_arp_updates_and_unsolicited_replies_to_us_create() {
        let mut s = Stack::new(&[]);
        // A gratuitous ARP for an unknown address does not create an entry (RFC 826 merge only).
        s.wire_in(1, &[arp_frame(BROADCAST, 1, PEER, P4, [0; 6], P4)]);
        assert_eq!(s.meter("neighbours"), 0);
        // An unsolicited reply addressed to us does.
        s.wire_in(2, &[arp_frame(ME, 2, PEER, P4, ME, A4)]);
        assert_eq!(s.meter("neighbours"), 1);
        assert_eq!(s.meter("arp_replies_received_total"), 1);
        // A gratuitous ARP (a reply, broadcast) moves the known address to another MAC.
        s.wire_in(3, &[arp_frame(BROADCAST, 2, PEER2, P4, BROADCAST, P4)]);
        let pkt = udp4(P4, 2);
        s.ip_in(4, std::slice::from_ref(&pkt));
        assert_eq!(s.wire_out(), vec![eth(PEER2, ME, 0x0800, &pkt)]);
        assert!(s.neighbours(5).starts_with("10.0.0.1 02:00:00:00:00:03 2\n"), "{}", s.neighbours(5));
        // Someone else claiming our address: counted, not learnt, nothing sent.
        s.wire_in(6, &[arp_frame(BROADCAST, 1, PEER2, A4, [0; 6], A4)]);
        assert_eq!(s.meter("address_conflicts_total"), 1);
        assert_eq!(s.meter("neighbours"), 1);
        s.check_accounting();
    }

    #[test]
    fn unresolved_next_hop_queues_and_the_reply_flushes_in_order() {
        let mut s = Stack::new(&[]);
        let pkts: Vec<Vec<u8>> = (1..=3).map(|n| udp4(P4, n)).collect();
        s.ip_in(10, &pkts);
        assert_eq!(s.wire_out(), vec![arp_frame(BROADCAST, 1, ME, A4, [0; 6], P4)]);
        assert_eq!((s.meter("queued"), s.meter("neighbours"), s.meter("arp_requests_sent_total")), (3, 1, 1));
        assert_eq!(s.neighbours(11), "10.0.0.1 incomplete 1\n");
        // More while waiting: queued behind, no second request.
        s.ip_in(12, &[udp4(P4, 4)]);
        assert!(s.wire_out().is_empty());
        s.wire_in(20, &[arp_frame(ME, 2, PEER, P4, ME, A4)]);
        let want: Vec<Vec<u8>> = (1..=4).map(|n| eth(PEER, ME, 0x0800, &udp4(P4, n))).collect();
        assert_eq!(s.wire_out(), want);
        assert_eq!((s.meter("queued"), s.meter("resolved_total"), s.meter("sent_total")), (0, 1, 4));
        assert_eq!(s.neighbours(25), "10.0.0.1 02:00:00:00:00:02 5\n");
        s.check_accounting();
    }

    #[test]
    fn off_link_destinations_go_to_the_gateway_or_are_dropped() {
        let mut s = Stack::new(&["gateway_v4=\"10.0.0.254\"", "gateway_v6=\"fe80::1\""]);
        let pkt = udp4(FAR4, 1);
        s.ip_in(1, std::slice::from_ref(&pkt));
        assert_eq!(s.wire_out(), vec![arp_frame(BROADCAST, 1, ME, A4, [0; 6], G4)]);
        s.wire_in(2, &[arp_frame(ME, 2, GW, G4, ME, A4)]);
        assert_eq!(s.wire_out(), vec![eth(GW, ME, 0x0800, &pkt)], "to the gateway's MAC, the packet unchanged");
        // IPv6 through a link-local gateway: the NS comes from our link-local address.
        let pkt6 = udp6(FAR6, 1);
        s.ip_in(3, std::slice::from_ref(&pkt6));
        let out = s.wire_out();
        assert_eq!(out.len(), 1);
        let (dst, src, ip_dst, _) = ndp_parts(&out[0]);
        assert_eq!((dst, ip_dst), (multicast_mac_v6(solicited_node(G6)), solicited_node(G6)));
        // A packet whose source is one of our addresses names the source (RFC 4861 7.2.2): fd00::2.
        assert_eq!(src, A6);
        s.wire_in(4, &[eth(ME, GW, 0x86dd, &na(G6, A6, G6, S_O, Some(GW)))]);
        assert_eq!(s.wire_out(), vec![eth(GW, ME, 0x86dd, &pkt6)]);
        // Without gateways, off-link packets have no route; so do loopback and our own addresses.
        let mut s = Stack::new(&[]);
        let lo = udp4(Ipv4Addr::LOCALHOST, 1);
        s.ip_in(1, &[udp4(FAR4, 1), udp6(FAR6, 1), lo, udp4(A4, 1), udp6(A6, 1)]);
        assert!(s.wire_out().is_empty());
        assert_eq!(s.meter("drop_no_route_total"), 5);
        // Not IP at all.
        s.ip_in(2, &[vec![0x45; 10], vec![], vec![0x70; 60]]);
        assert_eq!(s.meter("drop_bad_packet_total"), 3);
        s.check_accounting();
    }

    #[test]
    fn broadcast_and_multicast_destinations_map_to_their_macs() {
        let mut s = Stack::new(&[]);
        let b = udp4(Ipv4Addr::BROADCAST, 1);
        let directed = udp4(Ipv4Addr::new(10, 0, 0, 255), 2);
        let m4 = udp4(Ipv4Addr::new(239, 129, 2, 3), 3);
        let m6 = udp6("ff02::fb".parse().unwrap(), 4);
        s.ip_in(1, &[b.clone(), directed.clone(), m4.clone(), m6.clone()]);
        assert_eq!(
            s.wire_out(),
            vec![
                eth(BROADCAST, ME, 0x0800, &b),
                eth(BROADCAST, ME, 0x0800, &directed),
                eth([0x01, 0, 0x5e, 0x01, 2, 3], ME, 0x0800, &m4),
                eth([0x33, 0x33, 0, 0, 0, 0xfb], ME, 0x86dd, &m6),
            ]
        );
        assert_eq!(s.meter("neighbours"), 0);
        s.check_accounting();
    }

    #[test]
    fn queues_are_bounded() {
        let mut s = Stack::new(&["queue_per_neighbour=2", "max_queued=3"]);
        s.ip_in(1, &(1..=5).map(|n| udp4(P4, n)).collect::<Vec<_>>());
        assert_eq!(s.meter("queued"), 2);
        assert_eq!(s.meter("drop_resolution_queue_full_total"), 3);
        // Another neighbour: only one more fits in all.
        s.ip_in(2, &(1..=3).map(|n| udp4(Ipv4Addr::new(10, 0, 0, 5), n)).collect::<Vec<_>>());
        assert_eq!(s.meter("queued"), 3);
        assert_eq!(s.meter("drop_resolution_queue_full_total"), 5);
        assert_eq!(s.meter("frames_dropped_total"), 5);
        assert_eq!(s.meter("arp_requests_sent_total"), 2);
        s.wire_out();
        s.wire_in(3, &[arp_frame(ME, 2, PEER, P4, ME, A4)]);
        let want: Vec<Vec<u8>> = (1..=2).map(|n| eth(PEER, ME, 0x0800, &udp4(P4, n))).collect();
        assert_eq!(s.wire_out(), want, "the first two, in order");
        // Lowering a knob trims queues at once (newest first).
        s.sw.apply(vec![knob("l", "max_queued", Value::U64(1))]).unwrap();
        s.ip_in(4, &[]);
        assert_eq!(s.meter("queued"), 1);
        s.check_accounting();
    }

    #[test]
    fn retries_then_give_up_and_count_the_queued_packets() {
        let mut s = Stack::new(&[]);
        s.ip_in(0, &[udp4(P4, 1), udp4(P4, 2)]);
        let request = arp_frame(BROADCAST, 1, ME, A4, [0; 6], P4);
        assert_eq!(s.wire_out(), vec![request.clone()]);
        assert_eq!(s.sw.next_wakeup(), Some(Time::from_millis(1000)));
        s.run(999);
        assert!(s.wire_out().is_empty());
        for t in [1000, 2000, 3000] {
            s.run(t);
            assert_eq!(s.wire_out(), vec![request.clone()], "retry at {t}");
            assert_eq!(s.meter("queued"), 2);
        }
        assert_eq!(s.meter("arp_requests_sent_total"), 4);
        s.run(3999);
        assert_eq!(s.meter("neighbours"), 1);
        s.run(4000);
        assert!(s.wire_out().is_empty());
        assert_eq!((s.meter("neighbours"), s.meter("queued")), (0, 0));
        assert_eq!(s.meter("drop_unresolved_total"), 2);
        assert_eq!(s.meter("resolution_failed_total"), 1);
        assert_eq!(s.meter("frames_dropped_total"), 2);
        assert_eq!(s.sw.next_wakeup(), None);
        s.check_accounting();
        // Fewer retries at runtime, and a shorter interval.
        s.sw.apply(vec![knob("l", "resolve_retries", Value::U64(0)), knob("l", "resolve_interval_ms", Value::U64(50))])
            .unwrap();
        s.ip_in(5000, &[udp6(P6, 1)]);
        assert_eq!(s.meter("ns_sent_total"), 1);
        s.run(5050);
        assert_eq!(s.meter("drop_unresolved_total"), 3);
        assert_eq!(s.meter("ns_sent_total"), 1);
        s.check_accounting();
    }

    #[test]
    fn ipv6_resolution_with_ns_and_na() {
        let mut s = Stack::new(&[]);
        let pkts = [udp6(P6, 1), udp6(P6, 2)];
        s.ip_in(1, &pkts);
        let out = s.wire_out();
        assert_eq!(out.len(), 1);
        let (dst, src, ip_dst, msg) = ndp_parts(&out[0]);
        assert_eq!(dst, [0x33, 0x33, 0xff, 0, 0, 1]);
        assert_eq!((src, ip_dst), (A6, "ff02::1:ff00:1".parse().unwrap()));
        // NS: type 135, code 0, reserved, target, source link-layer option with our MAC.
        let mut want = vec![135, 0, msg[2], msg[3], 0, 0, 0, 0];
        want.extend_from_slice(&P6.octets());
        want.extend_from_slice(&[1, 1]);
        want.extend_from_slice(&ME);
        assert_eq!(msg, want);
        // A solicited NA resolves it and flushes the queue in order.
        s.wire_in(2, &[eth(ME, PEER, 0x86dd, &na(P6, A6, P6, S_O, Some(PEER)))]);
        let want: Vec<Vec<u8>> = pkts.iter().map(|p| eth(PEER, ME, 0x86dd, p)).collect();
        assert_eq!(s.wire_out(), want);
        assert_eq!((s.meter("na_received_total"), s.meter("resolved_total")), (1, 1));
        // An NA without override does not move a known neighbour; with it, it does.
        s.wire_in(3, &[eth(ME, PEER2, 0x86dd, &na(P6, A6, P6, 0x40, Some(PEER2)))]);
        s.ip_in(4, &[udp6(P6, 3)]);
        assert_eq!(&s.wire_out()[0][..6], &PEER);
        s.wire_in(5, &[eth(ME, PEER2, 0x86dd, &na(P6, ALL_NODES, P6, 0x20, Some(PEER2)))]);
        s.ip_in(6, &[udp6(P6, 4)]);
        assert_eq!(&s.wire_out()[0][..6], &PEER2);
        // An unsolicited NA for an unknown address creates nothing.
        s.wire_in(
            7,
            &[eth(
                ME,
                PEER,
                0x86dd,
                &na("fd00::9".parse().unwrap(), ALL_NODES, "fd00::9".parse().unwrap(), 0x20, Some(PEER)),
            )],
        );
        assert_eq!(s.meter("neighbours"), 1);
        s.check_accounting();
    }

    #[test]
    fn neighbour_solicitations_for_our_addresses_are_answered() {
        let mut s = Stack::new(&[]);
        let sn = solicited_node(A6);
        s.wire_in(1, &[eth(multicast_mac_v6(sn), PEER, 0x86dd, &ns(P6, sn, A6, Some(PEER)))]);
        let out = s.wire_out();
        assert_eq!(out.len(), 1);
        let (dst, src, ip_dst, msg) = ndp_parts(&out[0]);
        assert_eq!((dst, src, ip_dst), (PEER, A6, P6));
        let mut want = vec![136, 0, msg[2], msg[3], S_O, 0, 0, 0];
        want.extend_from_slice(&A6.octets());
        want.extend_from_slice(&[2, 1]);
        want.extend_from_slice(&ME);
        assert_eq!(msg, want, "solicited, override, target link-layer option");
        assert_eq!((s.meter("ns_received_total"), s.meter("na_sent_total")), (1, 1));
        // The source link-layer option was learnt.
        let pkt = udp6(P6, 1);
        s.ip_in(2, std::slice::from_ref(&pkt));
        assert_eq!(s.wire_out(), vec![eth(PEER, ME, 0x86dd, &pkt)]);
        // A unicast NS without the option (NUD) is answered to the frame's source.
        s.wire_in(3, &[eth(ME, PEER2, 0x86dd, &ns("fd00::3".parse().unwrap(), A6, A6, None))]);
        let (dst, _, ip_dst, _) = ndp_parts(&s.wire_out()[0]);
        assert_eq!((dst, ip_dst), (PEER2, "fd00::3".parse().unwrap()));
        // Our link-local address (EUI-64 of the MAC) is answered too.
        let ll = link_local_of(ME);
        assert_eq!(ll, "fe80::ff:fe00:1".parse::<Ipv6Addr>().unwrap());
        let sn = solicited_node(ll);
        s.wire_in(4, &[eth(multicast_mac_v6(sn), PEER, 0x86dd, &ns(G6, sn, ll, Some(PEER)))]);
        let (_, src, ip_dst, _) = ndp_parts(&s.wire_out()[0]);
        assert_eq!((src, ip_dst), (ll, G6));
        // A solicitation for another address is consumed silently.
        let other: Ipv6Addr = "fd00::77".parse().unwrap();
        s.wire_in(
            5,
            &[eth(
                multicast_mac_v6(solicited_node(other)),
                PEER,
                0x86dd,
                &ns(P6, solicited_node(other), other, Some(PEER)),
            )],
        );
        assert!(s.wire_out().is_empty());
        assert_eq!(s.meter("ns_received_total"), 4);
        s.check_accounting();
    }

    #[test]
    fn dad_probe_for_our_address_is_answered_to_all_nodes() {
        let mut s = Stack::new(&[]);
        let sn = solicited_node(A6);
        s.wire_in(1, &[eth(multicast_mac_v6(sn), PEER, 0x86dd, &ns(Ipv6Addr::UNSPECIFIED, sn, A6, None))]);
        let out = s.wire_out();
        assert_eq!(out.len(), 1);
        let (dst, src, ip_dst, msg) = ndp_parts(&out[0]);
        assert_eq!((dst, src, ip_dst), ([0x33, 0x33, 0, 0, 0, 1], A6, ALL_NODES));
        assert_eq!(msg[4], 0x20, "override, not solicited");
        assert_eq!(s.meter("neighbours"), 0, "nothing learnt from a DAD probe");
        // A DAD probe must go to the solicited-node address and carry no source link-layer option.
        s.wire_in(2, &[eth(multicast_mac_v6(sn), PEER, 0x86dd, &ns(Ipv6Addr::UNSPECIFIED, ALL_NODES, A6, None))]);
        s.wire_in(3, &[eth(multicast_mac_v6(sn), PEER, 0x86dd, &ns(Ipv6Addr::UNSPECIFIED, sn, A6, Some(PEER)))]);
        assert!(s.wire_out().is_empty());
        assert_eq!(s.meter("drop_ndp_invalid_total"), 2);
        s.check_accounting();
    }

    #[test]
    fn received_ip_loses_its_ethernet_header_and_padding() {
        let mut s = Stack::new(&[]);
        let small = build::ipv4(P4, A4, proto::UDP, 64, &build::udp(P4.into(), A4.into(), 1, 2, b""));
        let mut padded = eth(ME, PEER, 0x0800, &small);
        padded.resize(60, 0);
        let v6 = build::ipv6(P6, A6, proto::UDP, 64, &build::udp(P6.into(), A6.into(), 1, 2, b"x"));
        let bcast = build::ipv4(P4, Ipv4Addr::BROADCAST, proto::UDP, 64, &[0; 8]);
        let mcast6 = build::ipv6(P6, "ff02::1".parse().unwrap(), proto::UDP, 1, &[0; 8]);
        // An echo request is ICMPv6 but not neighbour discovery: it passes.
        let echo = icmp6(P6, A6, vec![128, 0, 0, 0, 0, 1, 0, 1]);
        s.wire_in(
            1,
            &[
                padded,
                eth(ME, PEER, 0x86dd, &v6),
                eth(BROADCAST, PEER, 0x0800, &bcast),
                eth([0x33, 0x33, 0, 0, 0, 1], PEER, 0x86dd, &mcast6),
                eth(ME, PEER, 0x86dd, &echo),
                eth(
                    [0x01, 0, 0x5e, 0, 0, 0xfb],
                    PEER,
                    0x0800,
                    &build::ipv4(P4, Ipv4Addr::new(224, 0, 0, 251), 17, 1, &[0; 8]),
                ),
            ],
        );
        let got = s.ip_out();
        assert_eq!(got.len(), 6);
        assert_eq!(got[..5], [small, v6, bcast, mcast6, echo]);
        assert_eq!(s.meter("passed_up_total"), 6);
        assert_eq!(s.meter("neighbours"), 0, "IP traffic teaches nothing");
        // A zero length field (big GRO packets, jumbograms) cuts nothing.
        let mut big6 = build::ipv6(P6, A6, proto::HOP_BY_HOP, 64, &[0; 100]);
        big6[4..6].copy_from_slice(&[0, 0]);
        let mut big4 = build::ipv4(P4, A4, proto::TCP, 64, &[0; 100]);
        big4[2..4].copy_from_slice(&[0, 0]);
        s.wire_in(2, &[eth(ME, PEER, 0x86dd, &big6), eth(ME, PEER, 0x0800, &big4)]);
        assert_eq!(s.ip_out(), [big6, big4]);
        s.check_accounting();
    }

    #[test]
    fn frames_for_others_and_malformed_frames_are_counted() {
        let mut s = Stack::new(&[]);
        let pkt = build::ipv4(P4, A4, proto::UDP, 64, &build::udp(P4.into(), A4.into(), 1, 2, b""));
        let sn = solicited_node(A6);
        let mut bad_sum = ns(P6, sn, A6, Some(PEER));
        bad_sum[42] ^= 1;
        let mut hop64 = ns(P6, sn, A6, Some(PEER));
        hop64[7] = 64;
        let mut bad_len = ns(P6, sn, A6, Some(PEER));
        bad_len[5] += 8;
        let mut zero_opt = vec![135, 0, 0, 0, 0, 0, 0, 0];
        zero_opt.extend_from_slice(&A6.octets());
        zero_opt.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]);
        let zero_opt = icmp6(P6, sn, zero_opt);
        let short_ns = icmp6(P6, sn, vec![135, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3]);
        let mcast_target = ns(P6, sn, "ff02::1".parse().unwrap(), Some(PEER));
        let mut arp_hw = arp(1, PEER, P4, [0; 6], A4);
        arp_hw[1] = 6;
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (eth(PEER2, PEER, 0x0800, &pkt), "not_for_us"),
            (eth([0x01, 0x80, 0xc2, 0, 0, 0x0e], PEER, 0x88cc, &[0; 46]), "bad_ethertype"),
            (eth([0x01, 0x80, 0xc2, 0, 0, 0x0e], PEER, 0x0800, &pkt), "not_for_us"),
            (eth(BROADCAST, PEER, 0x86dd, &udp6(A6, 1)), "not_for_us"),
            (eth([0x33, 0x33, 0, 0, 0, 1], PEER, 0x0806, &arp(1, PEER, P4, [0; 6], A4)), "not_for_us"),
            (eth(ME, PEER, 0x8100, &[0; 46]), "bad_ethertype"),
            (eth(ME, PEER, 0x0042, &[0; 46]), "bad_ethertype"),
            (vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0], "truncated"),
            (eth(ME, PEER, 0x0800, &[]), "truncated"),
            (eth(ME, PEER, 0x0800, &pkt[..19]), "truncated"),
            (eth(ME, PEER, 0x86dd, &pkt), "bad_version"),
            (eth(ME, BROADCAST, 0x0800, &pkt), "bad_source_mac"),
            (eth(ME, ME, 0x0800, &pkt), "bad_source_mac"),
            (eth(BROADCAST, PEER, 0x0806, &arp(1, PEER, P4, [0; 6], A4)[..20]), "arp_malformed"),
            (eth(BROADCAST, PEER, 0x0806, &arp_hw), "arp_malformed"),
            (eth(BROADCAST, PEER, 0x0806, &arp(3, PEER, P4, [0; 6], A4)), "arp_malformed"),
            (eth(BROADCAST, PEER, 0x0806, &arp(1, BROADCAST, P4, [0; 6], A4)), "arp_malformed"),
            (eth(BROADCAST, PEER, 0x0806, &arp(1, PEER, Ipv4Addr::new(224, 0, 0, 1), [0; 6], A4)), "arp_malformed"),
            (eth(ME, PEER, 0x86dd, &bad_sum), "bad_icmpv6_checksum"),
            (eth(ME, PEER, 0x86dd, &hop64), "ndp_invalid"),
            (eth(ME, PEER, 0x86dd, &mcast_target), "ndp_invalid"),
            (eth(ME, PEER, 0x86dd, &ns(P6, sn, A6, Some([0x01, 0, 0, 0, 0, 9]))), "ndp_invalid"),
            (eth(ME, PEER, 0x86dd, &na(P6, ALL_NODES, P6, S_O, Some(PEER))), "ndp_invalid"),
            (eth(ME, PEER, 0x86dd, &bad_len), "ndp_malformed"),
            (eth(ME, PEER, 0x86dd, &zero_opt), "ndp_malformed"),
            (eth(ME, PEER, 0x86dd, &short_ns), "ndp_malformed"),
        ];
        for (i, (frame, reason)) in cases.iter().enumerate() {
            let meter = format!("drop_{reason}_total");
            let before = s.meter(&meter);
            s.wire_in(1 + i as u64, std::slice::from_ref(frame));
            assert_eq!(s.meter(&meter), before + 1, "case {i}: {reason}");
            assert_eq!(s.meter("frames_dropped_total"), i as u64 + 1, "case {i}: one drop");
        }
        assert!(s.wire_out().is_empty());
        assert!(s.ip_out().is_empty());
        assert_eq!(s.meter("neighbours"), 0);
        s.check_accounting();
    }

    #[test]
    fn router_messages_are_counted_and_ignored() {
        let mut s = Stack::new(&[]);
        let rs = icmp6(G6, "ff02::2".parse().unwrap(), vec![133, 0, 0, 0, 0, 0, 0, 0]);
        let mut ra_msg = vec![134, 0, 0, 0, 64, 0, 0x07, 0x08, 0, 0, 0, 0, 0, 0, 0, 0];
        ra_msg.extend_from_slice(&[1, 1]);
        ra_msg.extend_from_slice(&GW);
        let ra = icmp6(G6, ALL_NODES, ra_msg);
        s.wire_in(
            1,
            &[eth([0x33, 0x33, 0, 0, 0, 2], PEER, 0x86dd, &rs), eth([0x33, 0x33, 0, 0, 0, 1], GW, 0x86dd, &ra)],
        );
        assert_eq!((s.meter("rs_received_total"), s.meter("ra_received_total")), (1, 1));
        assert!(s.wire_out().is_empty() && s.ip_out().is_empty());
        assert_eq!(s.meter("neighbours"), 0);
        s.check_accounting();
    }

    #[test]
    fn neighbours_expire_or_are_probed_when_in_use() {
        let mut s = Stack::new(&["neighbour_timeout_ms=10000"]);
        s.wire_in(
            0,
            &[arp_frame(ME, 2, PEER, P4, ME, A4), arp_frame(ME, 2, PEER2, Ipv4Addr::new(10, 0, 0, 3), ME, A4)],
        );
        assert_eq!(s.meter("neighbours"), 2);
        assert_eq!(s.sw.next_wakeup(), Some(Time::from_millis(10_000)));
        s.ip_in(5000, &[udp4(P4, 1)]);
        s.wire_out();
        s.run(10_000);
        // The unused one is gone; the used one is probed by unicast, and still used meanwhile.
        assert_eq!(s.meter("expired_total"), 1);
        assert_eq!(s.wire_out(), vec![arp_frame(PEER, 1, ME, A4, [0; 6], P4)]);
        s.ip_in(10_001, &[udp4(P4, 2)]);
        assert_eq!(s.wire_out(), vec![eth(PEER, ME, 0x0800, &udp4(P4, 2))]);
        // It answers: reachable again for another timeout.
        s.wire_in(10_002, &[arp_frame(ME, 2, PEER, P4, ME, A4)]);
        assert_eq!(s.neighbours(10_003), "10.0.0.1 02:00:00:00:00:02 1\n");
        // Used again, times out, probed four times without an answer: removed.
        s.ip_in(10_004, &[udp4(P4, 3)]);
        s.wire_out();
        for t in [20_002, 21_002, 22_002, 23_002] {
            s.run(t);
            assert_eq!(s.wire_out().len(), 1, "probe at {t}");
        }
        s.run(24_002);
        assert_eq!(s.meter("neighbours"), 0);
        assert_eq!(s.meter("resolution_failed_total"), 1);
        assert_eq!(s.meter("frames_dropped_total"), 0, "nothing was queued");
        s.check_accounting();
    }

    #[test]
    fn the_cache_is_bounded_and_evicts_the_oldest() {
        let mut s = Stack::new(&["max_neighbours=2"]);
        let ip = |n: u8| Ipv4Addr::new(10, 0, 0, 10 + n);
        let mac = |n: u8| [0x02, 0, 0, 0, 1, n];
        s.wire_in(1, &[arp_frame(ME, 2, mac(1), ip(1), ME, A4), arp_frame(ME, 2, mac(2), ip(2), ME, A4)]);
        // An unresolved next hop with a queued packet takes the oldest's place.
        s.ip_in(2, &[udp4(ip(3), 1)]);
        assert_eq!(s.meter("neighbours"), 2);
        assert_eq!(s.meter("evicted_total"), 1);
        // ip(2) was confirmed later than ip(1): ip(1) went.
        assert!(s.neighbours(3).starts_with("10.0.0.12 "), "{}", s.neighbours(3));
        // Confirming ip(2) makes the incomplete ip(3) the oldest: its queued packet is dropped as evicted.
        s.wire_in(4, &[arp_frame(ME, 2, mac(2), ip(2), ME, A4), arp_frame(ME, 2, mac(4), ip(4), ME, A4)]);
        assert_eq!(s.meter("drop_evicted_total"), 1);
        assert_eq!(
            s.neighbours(5).lines().map(|l| l.split(' ').next().unwrap()).collect::<Vec<_>>(),
            ["10.0.0.12", "10.0.0.14"]
        );
        // Lowering the knob evicts at once.
        s.sw.apply(vec![knob("l", "max_neighbours", Value::U64(1))]).unwrap();
        s.run(6);
        assert_eq!(s.meter("neighbours"), 1);
        s.check_accounting();
    }

    #[test]
    fn procedures_list_the_cache_and_addresses_and_flush() {
        let mut s = Stack::new(&["gateway_v4=\"10.0.0.254\""]);
        s.wire_in(1000, &[eth(ME, PEER, 0x86dd, &ns(P6, A6, A6, Some(PEER))), arp_frame(ME, 2, PEER2, P4, ME, A4)]);
        s.ip_in(1500, &[udp4(G4, 1)]);
        assert_eq!(
            s.neighbours(2000),
            "10.0.0.1 02:00:00:00:00:03 1000\n10.0.0.254 incomplete 500\nfd00::1 02:00:00:00:00:02 1000\n"
        );
        assert_eq!(
            s.exec("addresses", 2000),
            Value::Str("10.0.0.2/24\nfd00::2/64\nfe80::ff:fe00:1/64\ngateway 10.0.0.254\n".into())
        );
        assert_eq!(s.exec("flush", 2001), Value::U64(3));
        assert_eq!((s.meter("neighbours"), s.meter("queued"), s.meter("drop_unresolved_total")), (0, 0, 1));
        assert_eq!(s.neighbours(2002), "");
        s.check_accounting();
    }

    #[test]
    fn replace_keeps_the_neighbour_cache_and_queues() {
        let mut s = Stack::new(&[]);
        s.wire_in(1, &[arp_frame(ME, 2, PEER, P4, ME, A4)]);
        s.ip_in(2, &[udp4(Ipv4Addr::new(10, 0, 0, 5), 1)]);
        s.wire_out();
        let args = vec![
            "mac=\"02:00:00:00:00:01\"".to_string(),
            "addresses=\"10.0.0.2/24, fd00::2/64\"".to_string(),
            "max_neighbours=8".to_string(),
        ];
        let settings = Settings::from_args(&args).unwrap();
        let builder = catalog().configure("link", &settings, None).unwrap();
        let notes = s
            .sw
            .apply(vec![Edit::Replace { name: "l".into(), kind: "link".into(), settings, builder, keep_state: true }])
            .unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        s.run(3);
        assert_eq!((s.meter("neighbours"), s.meter("queued")), (2, 1));
        s.ip_in(4, &[udp4(P4, 2)]);
        assert_eq!(s.wire_out(), vec![eth(PEER, ME, 0x0800, &udp4(P4, 2))]);
        s.wire_in(5, &[arp_frame(ME, 2, PEER2, Ipv4Addr::new(10, 0, 0, 5), ME, A4)]);
        assert_eq!(s.wire_out(), vec![eth(PEER2, ME, 0x0800, &udp4(Ipv4Addr::new(10, 0, 0, 5), 1))]);
    }

    #[test]
    fn settings_are_checked() {
        let e = config_error("link", &[]);
        assert!(e.contains("needs `mac`"), "{e}");
        for (args, want) in [
            (vec!["mac=\"02:00:00:00:00\""], "expected a MAC address"),
            (vec!["mac=\"01:00:5e:00:00:01\""], "not a unicast MAC"),
            (vec!["mac=\"02:00:00:00:00:01\"", "addresses=[\"10.0.0.2/33\"]"], "prefix length"),
            (vec!["mac=\"02:00:00:00:00:01\"", "addresses=[\"10.0.0.0/24\"]"], "network or broadcast"),
            (vec!["mac=\"02:00:00:00:00:01\"", "addresses=[\"224.0.0.1/4\"]"], "not a unicast address"),
            (vec!["mac=\"02:00:00:00:00:01\"", "addresses=[\"fd00::2/64\", \"fd00::2/64\"]"], "listed twice"),
            (
                vec!["mac=\"02:00:00:00:00:01\"", "addresses=[\"10.0.0.2/24\"]", "gateway_v4=\"10.0.1.1\""],
                "not in an on-link",
            ),
            (
                vec!["mac=\"02:00:00:00:00:01\"", "addresses=[\"10.0.0.2/24\"]", "gateway_v4=\"fd00::1\""],
                "not a unicast IPv4",
            ),
            (
                vec!["mac=\"02:00:00:00:00:01\"", "addresses=[\"10.0.0.2/24\"]", "gateway_v4=\"10.0.0.2\""],
                "own addresses",
            ),
            (vec!["mac=\"02:00:00:00:00:01\"", "link_local=false", "gateway_v6=\"fe80::1\""], "not in an on-link"),
            (vec!["mac=\"02:00:00:00:00:01\"", "queue_per_neighbour=0"], "within 1..=65536"),
            (vec!["mac=\"02:00:00:00:00:01\"", "bogus=1"], "unknown setting `bogus`"),
        ] {
            let e = config_error("link", &args);
            assert!(e.contains(want), "{args:?}: {e}");
        }
        // A link-local gateway is on-link through the derived link-local address.
        let s = Stack::new(&["gateway_v6=\"fe80::1\"", "neighbour_timeout_ms=500"]);
        assert_eq!(s.meter("neighbour_timeout_ms"), 500);
        assert_eq!(s.meter("max_neighbours"), DEFAULT_MAX_NEIGHBOURS);
        assert_eq!(parse_mac("2-0-0-0-0-A"), Some([2, 0, 0, 0, 0, 10]));
        assert_eq!(format_mac([2, 0, 0, 0xab, 0, 10]), "02:00:00:ab:00:0a");
    }
}
