//! The kinds of the app chains that take GSO super-packets whole (ip, reassemble, classify, direction, nat,
//! firewall, counter, link) do to a super-packet what they do to its segments: the same bytes and checksums once
//! it is cut, the same meters (`crate::testutil::assert_same_as_cut_first`).

use crate::testutil::{assert_same_as_cut_first, tcp_super_packet};
use flexstack_core::frame::Gso;
use flexstack_core::Direction;
use flexstack_wire::checksum;
use flexstack_wire::testkit::{a6, b6, A4, B4};
use std::net::IpAddr;

/// A super-packet of each IP version (5,000 bytes of payload in segments of 1,400), travelling `direction`.
fn both_versions(direction: Direction) -> Vec<(Vec<u8>, Gso, Direction)> {
    [(A4.into(), B4.into()), (a6().into(), b6().into())]
        .into_iter()
        .map(|(s, d): (IpAddr, IpAddr)| {
            let (p, g) = tcp_super_packet(s, d, 5000, 1400);
            (p, g, direction)
        })
        .collect()
}

/// Sets the TTL / hop limit of a packet from `both_versions` (IPv4 header checksum updated).
fn with_hop_limit(mut packets: Vec<(Vec<u8>, Gso, Direction)>, hops: u8) -> Vec<(Vec<u8>, Gso, Direction)> {
    for (p, _, _) in &mut packets {
        if p[0] >> 4 == 4 {
            p[8] = hops;
            p[10..12].fill(0);
            let c = checksum::ipv4_header(&p[..20]);
            p[10..12].copy_from_slice(&c.to_be_bytes());
        } else {
            p[7] = hops;
        }
    }
    packets
}

#[test]
fn ip_forwards_super_packets_whole_and_cuts_those_it_must_handle_per_segment() {
    let packets = both_versions(Direction::Down);
    let meters = ["packets_total", "bytes_total", "drop_ttl_exceeded_total", "drop_too_big_total", "icmp_errors_total"];
    let whole = assert_same_as_cut_first("ip", &[], "in", &["out", "icmp"], &packets, &meters);
    assert_eq!(whole, 2, "both left whole, their TTL decremented once");
    let whole = assert_same_as_cut_first("ip", &["mtu=1500"], "in", &["out", "icmp"], &packets, &meters);
    assert_eq!(whole, 2, "segments that fit the MTU");
    // Segments beyond the MTU (DF, IPv6): cut, each dropped and answered; TTL exhausted: the same.
    let whole = assert_same_as_cut_first("ip", &["mtu=1000"], "in", &["out", "icmp"], &packets, &meters);
    assert_eq!(whole, 0);
    let expiring = with_hop_limit(packets.clone(), 1);
    assert_eq!(assert_same_as_cut_first("ip", &[], "in", &["out", "icmp"], &expiring, &meters), 0);
    // Checksums verified: a super-packet's is not there yet, its segments' are right.
    let whole =
        assert_same_as_cut_first("ip", &["verify_l4_checksums=true"], "in", &["out"], &packets, &["packets_total"]);
    assert_eq!(whole, 2);
}

#[test]
fn reassemble_classify_direction_and_counter_pass_super_packets_whole_counting_segments() {
    let mut packets = both_versions(Direction::Down);
    packets.extend(both_versions(Direction::Up));
    assert_eq!(assert_same_as_cut_first("reassemble", &[], "in", &["out"], &packets, &["passed_total"]), 4);
    let flows = ["flow.1.packets_total", "flow.1.bytes_up_total", "flow.2.packets_down_total", "flow.2.bytes_total"];
    let ports = ["tcp", "udp", "icmp", "other"];
    assert_eq!(assert_same_as_cut_first("classify", &[], "in", &ports, &packets, &flows), 4);
    let meters = ["up_total", "down_total"];
    assert_eq!(assert_same_as_cut_first("direction", &[], "in", &["up", "down"], &packets, &meters), 4);
    let meters = ["frames_total", "bytes_total"];
    assert_eq!(assert_same_as_cut_first("counter", &[], "in", &["out"], &packets, &meters), 4);
}

#[test]
fn nat_translates_super_packets_whole() {
    let rules = r#"rules=["snat 10.1.0.0/16 to 203.0.113.9", "snat fd00::/64 to 2001:db8::9"]"#;
    let packets = both_versions(Direction::Down);
    let meters = ["translated_total", "untranslated_total"];
    let whole = assert_same_as_cut_first("nat", &[rules], "inside", &["to_outside"], &packets, &meters);
    assert_eq!(whole, 2);
}

#[test]
fn firewall_judges_super_packets_whole_counting_segments() {
    let packets = both_versions(Direction::Down);
    let rules = r#"rules=["drop tcp from 10.1.0.0/16 to any port 2000", "accept tcp"]"#;
    let meters = ["accepted_total", "drop_rule_total"];
    let whole = assert_same_as_cut_first("firewall", &[rules], "in", &["pass"], &packets, &meters);
    assert_eq!(whole, 1, "the IPv6 one accepted whole, the IPv4 one dropped with its segments counted");
}

#[test]
fn link_moves_the_description_with_the_ethernet_header() {
    let mac = [2, 0, 0, 0, 0, 1];
    let packets: Vec<(Vec<u8>, Gso, Direction)> = both_versions(Direction::Up)
        .into_iter()
        .map(|(p, g, d)| {
            let mut f = mac.to_vec();
            f.extend_from_slice(&[2, 0, 0, 0, 0, 9]);
            f.extend_from_slice(if p[0] >> 4 == 4 { &[0x08, 0x00] } else { &[0x86, 0xdd] });
            f.extend_from_slice(&p);
            (f, g.moved(14).unwrap(), d)
        })
        .collect();
    let args = [r#"mac="02:00:00:00:00:01""#, r#"addresses=["198.51.100.2/24", "2001:db8:2::2/64"]"#];
    let whole = assert_same_as_cut_first("link", &args, "wire", &["ip"], &packets, &["passed_up_total"]);
    assert_eq!(whole, 2);
}
