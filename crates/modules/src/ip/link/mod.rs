//! `link`: the Ethernet adaptation between a link face (the raw frames of an interface flexstack owns, e.g. the
//! daemon's AF_PACKET face) and the IP modules. It owns the link's addresses: it answers ARP (RFC 826) and IPv6
//! neighbour solicitations (RFC 4861) for them, resolves next hops into a bounded neighbour cache, and adds and
//! removes Ethernet headers. Sans-IO: frames in, frames out, timers through `out.wake_at` / `poll`.
//!
//! Its ports, settings, knobs and meters are declared once, in `DECL` below; docs/modules.md lists them with their
//! types, defaults and ranges. Control frames cross over unchanged (`wire` → `ip`, `ip` → `wire`).
//!
//! - Settings that are not knobs change with `module replace`, which keeps the neighbour cache. `addresses` are
//!   the addresses flexstack owns on this link with their on-link prefixes, an array of strings
//!   (`["10.0.0.2/24", "fd00::2/64"]`) or one string separated by commas or spaces; a bare address is a host
//!   prefix. ARP requests and neighbour solicitations for them are answered, and they are the sources of the
//!   module's own requests. `link_local` also owns the IPv6 link-local address derived from `mac` (EUI-64,
//!   `fe80::/64`), used for neighbour discovery of link-local next hops. `gateway_v4` and `gateway_v6` are the
//!   next hops for destinations outside the on-link prefixes; each must be on-link (an IPv6 link-local gateway is
//!   on-link whenever the module owns an IPv6 address). Without one, packets to off-link destinations of that
//!   family are dropped (`no_route`).
//! - Knobs: a resolved neighbour stays reachable `neighbour_timeout_ms` after it was last confirmed (a reply, or a
//!   request for one of our addresses). Then, if packets were sent to it since, it is probed (unicast ARP request /
//!   NS to its known MAC, still used meanwhile) and kept if it answers; if not used, it is removed
//!   (`expired_total`). An unresolved next hop gets one request at once and up to `resolve_retries` more,
//!   `resolve_interval_ms` apart; one interval after the last, it is given up (`resolution_failed_total`) and its
//!   queued packets are dropped (`unresolved`). A probed neighbour that does not answer is removed the same way.
//!   `queue_per_neighbour` packets are held per unresolved next hop, sent in order once it resolves, and
//!   `max_queued` for all next hops together; beyond, dropped (`resolution_queue_full`). A new entry beyond
//!   `max_neighbours` evicts the least recently created or confirmed (`evicted_total`, its queued packets dropped
//!   as `evicted`).
//!
//! # Receiving (`wire` in)
//! A frame whose transport checksum a link face left partial (`MetaKey::CSUM_PARTIAL`) has it completed first
//! ([`flexstack_wire::checksum::complete_partial`]): the modules behind the link see complete checksums. A GSO
//! super-packet (`MetaKey::GSO`) only loses the key (its checksum is computed when it is cut or written); its
//! description moves with the IP header as the Ethernet header is stripped, and back when one is put in front.
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
//! # Accounting
//! Every drop counts in `drop_<reason>_total` for its reason above (and in the switch's drops). ARP and NDP
//! messages consumed here are not drops; so:
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

mod arp;
mod config;
mod ethernet;
mod ndp;
mod neighbours;

// The parts' items that this file and the other parts use: the parts import them from here, so that no
// two files import each other.
pub(crate) use config::{broadcast_of, configure, Config};
pub use config::{
    DEFAULT_MAX_NEIGHBOURS, DEFAULT_MAX_QUEUED, DEFAULT_NEIGHBOUR_TIMEOUT_MS, DEFAULT_QUEUE_PER_NEIGHBOUR,
    DEFAULT_RESOLVE_INTERVAL_MS, DEFAULT_RESOLVE_RETRIES,
};
pub use ethernet::{format_mac, multicast_mac_v4, multicast_mac_v6, parse_mac, Mac};
pub(crate) use ethernet::{ip_addresses, v6_at, write_ethernet, BROADCAST};
pub(crate) use ndp::is_link_local_v6;
pub use ndp::{link_local_of, solicited_node};
pub(crate) use neighbours::{Cache, Entry, State};

use flexstack_core::module::port_type;
use flexstack_core::{
    field, frames_meter, kind_from_decl, Batch, ConfigError, Direction, Frame, KindDecl, Meter, MeterDecl, Module,
    ModuleBuilder, ModuleInterface, ModuleKind, ModuleVars, Output, Packet, Param, PortDecl, Settings, Time, Value,
};
use flexstack_wire::checksum;
use flexstack_wire::packet::proto;
use smoltcp::wire::{EthernetAddress, EthernetFrame, EthernetProtocol, EthernetRepr, ETHERNET_HEADER_LEN};
use std::any::Any;
use std::net::IpAddr;

/// The kind's name in stack files.
pub const KIND: &str = "ethernet";

const IN_IP: usize = 0;
const IN_WIRE: usize = 1;
const OUT_WIRE: usize = 0;
const OUT_IP: usize = 1;

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

/// Number of receive reasons, the first ones of [`Reason`] (up to `BadIcmpv6Checksum`); then come send reasons.
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

/// The `link` module kind.
pub struct LinkKind;

type P = Param<Config>;

/// The kind: ports, settings, knobs and meters.
const DECL: KindDecl<Config, Meters> = KindDecl {
    inputs: &[
        PortDecl::new("ip", port_type::IP, "packets to send out of the interface"),
        PortDecl::new("wire", port_type::ETHERNET, "frames read from the interface"),
    ],
    outputs: &[
        PortDecl::new("wire", port_type::ETHERNET, "frames to write to the interface (direction down)"),
        PortDecl::new("ip", port_type::IP, "packets received, Ethernet header removed (direction up)"),
    ],
    params: &[
        P::manual("mac", "str", "the interface's unicast MAC address, `02:00:00:00:00:01` (`-` accepted)", "required"),
        P::manual(
            "addresses",
            "array of strings, or one string",
            "the addresses owned on the link with their prefixes (`10.0.0.2/24`); commas or spaces in one string",
            "none",
        ),
        P::bool("link_local", "also own the IPv6 link-local address derived from `mac`", true, field!(link_local))
            .setting(),
        P::manual("gateway_v4", "str", "next hop for IPv4 destinations off the link; on-link", "none"),
        P::manual("gateway_v6", "str", "next hop for IPv6 destinations off the link; on-link", "none"),
        P::u64(
            "neighbour_timeout_ms",
            "ms",
            "time a neighbour stays reachable after it was last confirmed",
            DEFAULT_NEIGHBOUR_TIMEOUT_MS,
            field!(limits.neighbour_timeout_ms),
        )
        .range(1.0, 86_400_000.0),
        P::u64(
            "resolve_retries",
            "",
            "requests resent to a next hop that does not answer",
            DEFAULT_RESOLVE_RETRIES,
            field!(limits.resolve_retries),
        )
        .range(0.0, 100.0),
        P::u64(
            "resolve_interval_ms",
            "ms",
            "time between two requests",
            DEFAULT_RESOLVE_INTERVAL_MS,
            field!(limits.resolve_interval_ms),
        )
        .range(1.0, 60_000.0),
        P::u64(
            "queue_per_neighbour",
            "frames",
            "packets held per unresolved next hop",
            DEFAULT_QUEUE_PER_NEIGHBOUR,
            field!(limits.queue_per_neighbour),
        )
        .range(1.0, 65_536.0),
        P::u64(
            "max_queued",
            "frames",
            "packets held for all unresolved next hops",
            DEFAULT_MAX_QUEUED,
            field!(limits.max_queued),
        )
        .range(1.0, (1u64 << 20) as f64),
        P::u64(
            "max_neighbours",
            "",
            "entries in the neighbour cache",
            DEFAULT_MAX_NEIGHBOURS,
            field!(limits.max_neighbours),
        )
        .range(1.0, (1u64 << 20) as f64),
    ],
    meters: &METERS,
    // One neighbour table (ARP/NDP answers reach one worker): the stack runs on one data-plane worker.
    global_view: true,
    accepts_gso: true,
    ..KindDecl::new(
        KIND,
        "Ethernet for a link face: owns the link's addresses, answers ARP and neighbour discovery, resolves next hops",
    )
};

/// The meters: the gauges, what the module counts ([`Count`]), then its drops ([`Reason`]: receive reasons, then
/// send reasons).
const METERS: [MeterDecl<Meters>; 34] = [
    MeterDecl::u64("neighbours", "", "entries in the neighbour cache, resolved or not", |m| &mut m.neighbours),
    MeterDecl::u64("queued", "frames", "packets waiting for their next hop to be resolved", |m| &mut m.queued),
    frames_meter!(
        "passed_up_total",
        "IP packets received and emitted on `ip` (a GSO super-packet counts its segments)",
        counts[Count::PassedUp]
    ),
    frames_meter!(
        "sent_total",
        "IP packets emitted on `wire` with an Ethernet header (a GSO super-packet counts its segments)",
        counts[Count::Sent]
    ),
    frames_meter!("arp_requests_received_total", "ARP requests received", counts[Count::ArpRequestsReceived]),
    frames_meter!("arp_replies_received_total", "ARP replies received", counts[Count::ArpRepliesReceived]),
    frames_meter!(
        "arp_requests_answered_total",
        "ARP replies sent for our addresses",
        counts[Count::ArpRequestsAnswered]
    ),
    frames_meter!(
        "arp_requests_sent_total",
        "ARP requests sent (resolution and probes)",
        counts[Count::ArpRequestsSent]
    ),
    frames_meter!("ns_received_total", "neighbour solicitations received", counts[Count::NsReceived]),
    frames_meter!("na_received_total", "neighbour advertisements received", counts[Count::NaReceived]),
    frames_meter!("rs_received_total", "router solicitations received (ignored)", counts[Count::RsReceived]),
    frames_meter!("ra_received_total", "router advertisements received (ignored)", counts[Count::RaReceived]),
    frames_meter!("redirects_received_total", "redirects received (ignored)", counts[Count::RedirectsReceived]),
    frames_meter!("ns_sent_total", "neighbour solicitations sent (resolution and probes)", counts[Count::NsSent]),
    frames_meter!("na_sent_total", "neighbour advertisements sent for our addresses", counts[Count::NaSent]),
    frames_meter!("resolved_total", "next hops resolved", counts[Count::Resolved]),
    frames_meter!(
        "resolution_failed_total",
        "next hops or probed neighbours that did not answer",
        counts[Count::ResolutionFailed]
    ),
    frames_meter!("expired_total", "neighbours removed unused after their timeout", counts[Count::Expired]),
    frames_meter!("evicted_total", "neighbours evicted to make room", counts[Count::Evicted]),
    frames_meter!(
        "address_conflicts_total",
        "ARP/NA from another MAC claiming one of our addresses",
        counts[Count::AddressConflicts]
    ),
    frames_meter!("drop_truncated_total", "frames shorter than their Ethernet or IP header", drops[Reason::Truncated]),
    frames_meter!(
        "drop_not_for_us_total",
        "frames to another MAC, or multicast not matching their EtherType",
        drops[Reason::NotForUs]
    ),
    frames_meter!(
        "drop_bad_source_mac_total",
        "frames from a multicast source MAC or our own",
        drops[Reason::BadSourceMac]
    ),
    frames_meter!(
        "drop_bad_ethertype_total",
        "frames of an EtherType other than ARP, IPv4, IPv6",
        drops[Reason::BadEthertype]
    ),
    frames_meter!(
        "drop_bad_version_total",
        "IP frames whose version disagrees with the EtherType",
        drops[Reason::BadVersion]
    ),
    frames_meter!(
        "drop_arp_malformed_total",
        "ARP messages that are not Ethernet/IPv4 requests or replies",
        drops[Reason::ArpMalformed]
    ),
    frames_meter!(
        "drop_ndp_malformed_total",
        "neighbour discovery messages that do not parse",
        drops[Reason::NdpMalformed]
    ),
    frames_meter!(
        "drop_ndp_invalid_total",
        "neighbour discovery messages failing RFC 4861 validity checks",
        drops[Reason::NdpInvalid]
    ),
    frames_meter!(
        "drop_bad_icmpv6_checksum_total",
        "neighbour discovery messages with a wrong checksum",
        drops[Reason::BadIcmpv6Checksum]
    ),
    frames_meter!(
        "drop_bad_packet_total",
        "packets to send that are not IPv4/IPv6 with a whole fixed header",
        drops[Reason::BadPacket]
    ),
    frames_meter!("drop_no_route_total", "packets to send with no next hop", drops[Reason::NoRoute]),
    frames_meter!(
        "drop_resolution_queue_full_total",
        "packets to send while their next hop's queue was full",
        drops[Reason::QueueFull]
    ),
    frames_meter!("drop_unresolved_total", "queued packets whose next hop never answered", drops[Reason::Unresolved]),
    frames_meter!(
        "drop_evicted_total",
        "queued packets whose next hop was evicted from the cache",
        drops[Reason::Evicted]
    ),
];

impl ModuleKind for LinkKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        Ok(Box::new(LinkBuilder(configure(settings)?)))
    }
}

struct LinkBuilder(Config);

impl ModuleBuilder for LinkBuilder {
    fn interface(&self) -> ModuleInterface {
        DECL.interface(&self.0)
    }

    /// IP packets only go out on the wire; frames from the wire go up as IP, or back out as ARP / NDP answers.
    /// So a link may sit between a NAT and a face in a loop of links that no frame can go round.
    fn paths(&self) -> Option<Vec<(String, String)>> {
        Some(vec![("ip".into(), "wire".into()), ("wire".into(), "ip".into()), ("wire".into(), "wire".into())])
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        DECL.publish(&self.0, vars);
        Box::new(Link {
            cfg: self.0,
            cache: Cache::default(),
            limits_changed: false,
            scratch: Vec::new(),
            m: DECL.meters(vars),
        })
    }
}

/// The module's meters.
#[derive(Default)]
struct Meters {
    neighbours: Meter,
    queued: Meter,
    counts: [Meter; 18],
    drops: [Meter; 14],
}

/// Where a packet goes next.
enum Hop {
    /// A broadcast or multicast MAC.
    Direct(Mac),
    /// A neighbour to resolve.
    Neighbour(IpAddr),
    NoRoute,
}

// ---------------------------------------------------------------------------------------------------------------
// The module
// ---------------------------------------------------------------------------------------------------------------

/// A running `link` module.
pub struct Link {
    cfg: Config,
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
            State::Reachable => e.confirmed + self.cfg.limits.timeout(),
        }
    }

    // --- receiving ---------------------------------------------------------------------------------------------

    fn receive(&mut self, mut p: Packet, out: &mut Output<'_>) {
        // The modules behind the link see complete transport checksums (the rule of MetaKey::CSUM_PARTIAL); a GSO
        // super-packet's checksum is computed afresh when it is cut or written (the rule of MetaKey::GSO), so its
        // up to 64 KiB are not summed here.
        if p.wire_packets() > 1 {
            p.meta_mut().remove(flexstack_core::MetaKey::CSUM_PARTIAL);
        } else {
            checksum::complete_partial(&mut p);
        }
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
        // Neither moves the packet: the Ethernet header becomes headroom.
        p.truncate(ETHERNET_HEADER_LEN + keep);
        p.strip_front(ETHERNET_HEADER_LEN);
        p.move_gso(-(ETHERNET_HEADER_LEN as isize));
        p.set_direction(Direction::Up);
        // A GSO super-packet counts its segments.
        self.m.counts[Count::PassedUp as usize].add(p.wire_packets());
        out.emit(OUT_IP, p);
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

    /// Adds an Ethernet header to an IP packet and emits it on `wire`.
    fn transmit(&self, mut p: Packet, dst: Mac, out: &mut Output<'_>) {
        let ethertype =
            if p.data().first().is_some_and(|b| b >> 4 == 6) { EthernetProtocol::Ipv6 } else { EthernetProtocol::Ipv4 };
        // Into the headroom the faces leave in front of what they read: the packet does not move.
        write_ethernet(p.prepend(ETHERNET_HEADER_LEN), dst, self.cfg.mac, ethertype);
        p.move_gso(ETHERNET_HEADER_LEN as isize);
        p.set_direction(Direction::Down);
        self.m.counts[Count::Sent as usize].add(p.wire_packets());
        out.emit(OUT_WIRE, p);
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
        DECL.write(&mut self.cfg, knob, value)?;
        self.limits_changed = true;
        Ok(())
    }

    fn execute(&mut self, procedure: &str, _argument: &Value, out: &mut Output<'_>) -> Result<Value, String> {
        match procedure {
            "neighbours" => Ok(Value::Str(self.neighbours_text(out.now()))),
            "addresses" => Ok(Value::Str(self.cfg.addresses_text())),
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

/// The drop reasons, as in meter names (`drop_<reason>_total`): receive reasons, then send reasons.
fn drop_reasons() -> impl Iterator<Item = &'static str> {
    METERS.iter().filter_map(|m| m.name.strip_prefix("drop_")?.strip_suffix("_total"))
}

/// The drop reasons counted on the receive path, as in meter names (`drop_<reason>_total`).
pub fn receive_drop_reasons() -> impl Iterator<Item = &'static str> {
    drop_reasons().take(RECEIVE_REASONS)
}

/// The drop reasons counted on the send path, as in meter names (`drop_<reason>_total`).
pub fn send_drop_reasons() -> impl Iterator<Item = &'static str> {
    drop_reasons().skip(RECEIVE_REASONS)
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
mod tests;
