//! Which worker owns a frame: a symmetric hash of its flow, so that both directions of a flow meet on one worker.
//!
//! The hash covers the 5-tuple of TCP, UDP, UDP-Lite, SCTP and DCCP packets that are not fragments, and the address
//! pair of everything else (other protocols, fragments: a datagram's fragments carry no ports after the first, so all
//! of them go by addresses and meet on one worker for reassembly). Each side of the flow is combined in an order
//! that does not depend on the direction (the smaller endpoint first). Frames that do not parse as IPv4 or IPv6
//! (ARP, an Ethernet frame of another type, a runt) belong to worker 0.
//!
//! Sans-IO, no allocation: [`owner`] reads at most the first headers of the frame.

/// The flow hash of a frame: `ethernet` when it starts with an Ethernet header (a link face's frames), else it is
/// a raw IP packet (a TUN device's). `None` when it is no IP packet.
pub fn flow_hash(frame: &[u8], ethernet: bool) -> Option<u64> {
    let ip = if ethernet { behind_ethernet(frame)? } else { frame };
    match ip.first()? >> 4 {
        4 => ipv4(ip),
        6 => ipv6(ip),
        _ => None,
    }
}

/// The worker (0..workers) that owns `frame`'s flow.
pub fn owner(frame: &[u8], ethernet: bool, workers: usize) -> usize {
    if workers <= 1 {
        return 0;
    }
    flow_hash(frame, ethernet).map_or(0, |h| (h % workers as u64) as usize)
}

/// The IP packet behind an Ethernet header with up to two VLAN tags.
fn behind_ethernet(frame: &[u8]) -> Option<&[u8]> {
    let mut at = 12;
    loop {
        let ty = u16::from_be_bytes([*frame.get(at)?, *frame.get(at + 1)?]);
        match ty {
            0x8100 | 0x88a8 => at += 4,
            0x0800 | 0x86dd => return frame.get(at + 2..),
            _ => return None,
        }
    }
}

/// Protocols whose first four bytes are the source and destination ports.
fn has_ports(proto: u8) -> bool {
    matches!(proto, 6 | 17 | 33 | 132 | 136)
}

fn ipv4(ip: &[u8]) -> Option<u64> {
    let ihl = usize::from(ip.first()? & 0x0f) * 4;
    let header = ip.get(..20)?;
    let proto = header[9];
    let fragment = u16::from_be_bytes([header[6], header[7]]) & 0x3fff != 0;
    let (src, dst) = (&header[12..16], &header[16..20]);
    let ports = if has_ports(proto) && !fragment { ip.get(ihl..ihl + 4) } else { None };
    Some(mix(src, dst, ports, proto))
}

fn ipv6(ip: &[u8]) -> Option<u64> {
    let header = ip.get(..40)?;
    let (src, dst) = (&header[8..24], &header[24..40]);
    // Walk the extension headers that may precede the transport header; a fragment header means no ports.
    let (mut next, mut at) = (header[6], 40);
    for _ in 0..8 {
        match next {
            0 | 43 | 60 => {
                let ext = ip.get(at..at + 2)?;
                next = ext[0];
                at += (usize::from(ext[1]) + 1) * 8;
            }
            44 => return Some(mix(src, dst, None, 44)),
            _ => break,
        }
    }
    let ports = if has_ports(next) { ip.get(at..at + 4) } else { None };
    Some(mix(src, dst, ports, next))
}

/// Combines the two endpoints in a way that does not depend on the direction: the XOR of the addresses' 32-bit
/// words, with source port ^ destination port and the protocol << 16 when there are ports, then lowbias32's mix
/// so that the low bits (taken modulo the number of workers) spread. A multi-queue TUN device's steering program
/// computes the same (`flexstack_faces::tun::steering_program`), so the kernel puts a flow's packets on its
/// owner's queue.
fn mix(src: &[u8], dst: &[u8], ports: Option<&[u8]>, proto: u8) -> u64 {
    let words = |a: &[u8]| a.chunks_exact(4).fold(0u32, |h, w| h ^ u32::from_be_bytes([w[0], w[1], w[2], w[3]]));
    let mut h = words(src) ^ words(dst);
    if let Some(p) = ports {
        h ^= u32::from(u16::from_be_bytes([p[0], p[1]]) ^ u16::from_be_bytes([p[2], p[3]])) ^ (u32::from(proto) << 16);
    }
    h ^= h >> 16;
    h = h.wrapping_mul(0x7feb_352d);
    h ^= h >> 15;
    h = h.wrapping_mul(0x846c_a68b);
    u64::from(h ^ (h >> 16))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;
    use std::os::fd::AsFd;

    /// An IP packet of `proto` from `src:sp` to `dst:dp` (ports written where a transport header would be),
    /// with `fragment_offset` (8-byte units) for IPv4.
    fn packet(src: &str, dst: &str, proto: u8, sp: u16, dp: u16, fragment_offset: u16) -> Vec<u8> {
        let (src, dst): (IpAddr, IpAddr) = (src.parse().unwrap(), dst.parse().unwrap());
        let mut p = match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let mut h = vec![0x45, 0, 0, 48, 0, 0, 0, 0, 64, proto, 0, 0];
                h[6..8].copy_from_slice(&fragment_offset.to_be_bytes());
                h.extend_from_slice(&s.octets());
                h.extend_from_slice(&d.octets());
                h
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let mut h = vec![0x60, 0, 0, 0, 0, 8, proto, 64];
                h.extend_from_slice(&s.octets());
                h.extend_from_slice(&d.octets());
                h
            }
            _ => unreachable!(),
        };
        p.extend_from_slice(&sp.to_be_bytes());
        p.extend_from_slice(&dp.to_be_bytes());
        p.extend_from_slice(&[0; 24]);
        p
    }

    #[test]
    fn both_directions_of_a_flow_hash_alike() {
        for (a, b) in [("10.0.0.1", "10.0.0.2"), ("fd00::1", "fd00::2"), ("192.168.1.9", "10.1.1.1")] {
            for proto in [6, 17, 1, 58] {
                for (sp, dp) in [(40000, 443), (53, 53), (1, 65535)] {
                    let there = flow_hash(&packet(a, b, proto, sp, dp, 0), false);
                    let back = flow_hash(&packet(b, a, proto, dp, sp, 0), false);
                    assert!(there.is_some());
                    assert_eq!(there, back, "{a} {b} {proto} {sp} {dp}");
                }
            }
        }
    }

    #[test]
    fn ports_tell_flows_apart_and_spread_over_workers() {
        let mut per_worker = [0usize; 4];
        for port in 0..4000u16 {
            per_worker[owner(&packet("10.0.0.1", "10.0.0.2", 6, 10000 + port, 80, 0), false, 4)] += 1;
        }
        // 1,000 each on average: a hash that ignored the ports, or spread badly, puts far more on one.
        assert!(per_worker.iter().all(|&n| (800..1200).contains(&n)), "{per_worker:?}");
        // Protocols without ports and fragments go by the addresses alone.
        let icmp = flow_hash(&packet("10.0.0.1", "10.0.0.2", 1, 1, 2, 0), false);
        assert_eq!(icmp, flow_hash(&packet("10.0.0.1", "10.0.0.2", 1, 3, 4, 0), false));
        let first = flow_hash(&packet("10.0.0.1", "10.0.0.2", 17, 5, 6, 0x2000), false);
        let later = flow_hash(&packet("10.0.0.1", "10.0.0.2", 17, 7, 8, 0x0010), false);
        assert_eq!(first, later, "fragments of one datagram meet");
        assert_eq!(first, icmp, "fragments go by the address pair, as other protocols");
    }

    #[test]
    fn ethernet_frames_hash_as_their_ip_packet_and_others_go_to_worker_0() {
        let ip = packet("fd00::1", "fd00::2", 17, 1000, 2000, 0);
        let mut frame = vec![0u8; 12];
        frame.extend_from_slice(&[0x81, 0x00, 0, 5, 0x86, 0xdd]);
        frame.extend_from_slice(&ip);
        assert_eq!(flow_hash(&frame, true), flow_hash(&ip, false));
        let mut arp = vec![0u8; 12];
        arp.extend_from_slice(&[0x08, 0x06, 0, 1]);
        assert_eq!(flow_hash(&arp, true), None);
        assert_eq!(owner(&arp, true, 8), 0);
        assert_eq!(owner(&[0x45, 0], false, 8), 0, "a runt");
        assert_eq!(owner(&ip, false, 1), 0);
    }

    /// The kernel's steering program of multi-queue TUN devices computes this hash: run in the kernel
    /// (BPF_PROG_TEST_RUN) on IPv4 and IPv6 packets of many flows, each of its answers equals `flow_hash`.
    #[test]
    fn the_tun_steering_program_computes_the_same_hash() {
        if !nix::unistd::geteuid().is_root() {
            assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "CI runs this as root");
            eprintln!("skipped: loading an eBPF program needs root");
            return;
        }
        let prog = flexstack_sys::bpf_load_socket_filter(&flexstack_faces::tun::steering_program()).unwrap();
        let mut checked = 0;
        for (a, b) in [("10.0.0.1", "10.0.7.2"), ("fd00::1", "fd00:5::2"), ("192.168.1.9", "10.1.1.1")] {
            for proto in [6, 17, 1, 58, 132, 33, 136, 47] {
                for (sp, dp) in [(40000, 443), (53, 53), (1, 65535), (12345, 8080)] {
                    for fragment in [0, 0x2000, 0x0010] {
                        let ip = packet(a, b, proto, sp, dp, fragment);
                        let mut frame = vec![0u8; 12];
                        frame.extend_from_slice(if ip[0] >> 4 == 4 { &[0x08, 0x00] } else { &[0x86, 0xdd] });
                        frame.extend_from_slice(&ip);
                        let kernel = flexstack_sys::bpf_test_run(prog.as_fd(), &frame).unwrap();
                        assert_eq!(Some(u64::from(kernel)), flow_hash(&ip, false), "{a} {b} {proto} {sp} {dp}");
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, 3 * 8 * 4 * 3);
        // Not IP: worker 0, as `owner` says.
        let mut arp = vec![0u8; 12];
        arp.extend_from_slice(&[0x08, 0x06, 0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(flexstack_sys::bpf_test_run(prog.as_fd(), &arp).unwrap(), 0);
    }
}
