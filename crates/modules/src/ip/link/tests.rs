//! Unit tests of the `link` module: frames in on `wire` and packets in on `ip`, what leaves, and the meters.

use super::ndp::ALL_NODES;
use super::*;
use crate::flow::testutil::*;
use flexstack_core::{ControlFrame, ControlOp, Edit, Switch};
use flexstack_wire::packet::build;
use smoltcp::wire::Icmpv6Packet;
use std::net::{Ipv4Addr, Ipv6Addr};

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
    s.wire_in(1, &[eth([0x33, 0x33, 0, 0, 0, 2], PEER, 0x86dd, &rs), eth([0x33, 0x33, 0, 0, 0, 1], GW, 0x86dd, &ra)]);
    assert_eq!((s.meter("rs_received_total"), s.meter("ra_received_total")), (1, 1));
    assert!(s.wire_out().is_empty() && s.ip_out().is_empty());
    assert_eq!(s.meter("neighbours"), 0);
    s.check_accounting();
}

#[test]
fn neighbours_expire_or_are_probed_when_in_use() {
    let mut s = Stack::new(&["neighbour_timeout_ms=10000"]);
    s.wire_in(0, &[arp_frame(ME, 2, PEER, P4, ME, A4), arp_frame(ME, 2, PEER2, Ipv4Addr::new(10, 0, 0, 3), ME, A4)]);
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
    let notes =
        s.sw.apply(vec![Edit::Replace { name: "l".into(), kind: "link".into(), settings, builder, keep_state: true }])
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
        (vec!["mac=\"02:00:00:00:00:01\"", "addresses=[\"10.0.0.2/24\"]", "gateway_v4=\"10.0.0.2\""], "own addresses"),
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

/// The Ethernet header goes into the headroom the faces leave and comes off by moving the packet's start: the
/// packet itself never moves (a 64 KiB super-packet used to, twice).
#[test]
fn the_link_header_is_added_and_stripped_without_moving_the_packet() {
    use flexstack_core::{ModuleVars, Output, PacketPool};
    let builder = LinkKind
        .configure(&crate::testutil::settings(&["mac=\"02:00:00:00:00:01\"", "addresses=[\"10.0.0.2/24\"]"]))
        .unwrap();
    let vars = ModuleVars::new(&builder.interface().vars);
    let mut link = builder.build(&vars);
    let pool = PacketPool::default();
    let (mut ports, mut control, mut serial) = (vec![Vec::new(), Vec::new()], Vec::new(), 0);
    let bcast = udp4(Ipv4Addr::BROADCAST, 1);
    // As a face reads it: the packet behind PacketPool::HEADROOM bytes of room.
    let mut p = pool.alloc();
    let buf = p.buffer_for_overwrite();
    buf.resize(PacketPool::HEADROOM, 0);
    buf.extend_from_slice(&bcast);
    p.strip_front(PacketPool::HEADROOM);
    let at = p.data().as_ptr();
    let mut out = Output::detached(Time::from_millis(1), "l", &pool, &mut ports, &mut control, &mut serial);
    link.process(IN_IP, &mut vec![Frame::Data(p)], &mut out);
    let Some(Frame::Data(sent)) = ports[OUT_WIRE].pop() else { panic!("a frame on wire: {ports:?}") };
    assert_eq!(sent.data(), eth(BROADCAST, ME, 0x0800, &bcast));
    assert_eq!(sent.data()[ETHERNET_HEADER_LEN..].as_ptr(), at, "the header went in front, in place");
    // Back in from the wire (as from a peer): the header comes off, the IP packet stays where it is.
    let mut back = sent;
    back.data_mut()[..12].copy_from_slice(&[ME, PEER].concat());
    let mut out = Output::detached(Time::from_millis(2), "l", &pool, &mut ports, &mut control, &mut serial);
    link.process(IN_WIRE, &mut vec![Frame::Data(back)], &mut out);
    let Some(Frame::Data(up)) = ports[OUT_IP].pop() else { panic!("a packet on ip: {ports:?}") };
    assert_eq!((up.data(), up.data().as_ptr()), (&bcast[..], at));
}
