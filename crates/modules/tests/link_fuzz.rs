//! Deterministic, bounded mutational fuzzing of the `link` module (Ethernet, ARP, neighbour discovery, the
//! neighbour cache), on stable Rust, as part of `cargo test` (the approach of `packets_fuzz.rs`).
//!
//! Seeds are the files in `fuzz/corpus/ethernet/` (whole Ethernet frames: ARP requests, replies, gratuitous and
//! probes; NS, NA, RS, RA and redirects with options; IPv4/IPv6 unicast, broadcast and multicast; truncated and
//! otherwise bad ones, named `*_bad_*`) for the `wire` input, and, for the `ip` input, packets built here to
//! on-link, gateway, broadcast and multicast destinations plus the IP corpus `fuzz/corpus/packet/`. Inputs are
//! seeds mutated by a xorshift PRNG (bit flips, interesting bytes, 16-bit words, MACs and addresses written into
//! the headers, inserts, deletes, truncation, splices) and, half of the time, "repaired" (IPv6 payload length,
//! ICMPv6 checksum, IPv4 header checksum) so that they get past the first checks.
//!
//! - `seeds_behave_as_named`: each seed alone through a fresh module: a `_bad_` seed is dropped with one reason,
//!   any other is not dropped; requests for our addresses are answered.
//! - `fuzz_link`: one switch with `link` (small limits, both gateways) and checking sinks on both outputs, fed
//!   batches of mutated frames on `wire` and mutated packets on `ip` while the clock jumps ahead and knobs change:
//!   no panic; after every run the accounting identities of the module docs hold against the switch's port meters
//!   (`wire` in = passed up + consumed + receive drops, `ip` in = sent + queued + send drops, `wire` out = sent +
//!   generated, `frames_dropped_total` = the drop meters); the cache and the queues stay within their limits;
//!   every frame emitted on `wire` is from our MAC with a known EtherType, every ARP frame one we may send, every
//!   NS/NA well formed with a right checksum; every packet on `ip` is IP of the version its frame said. At the end,
//!   time runs out: nothing stays queued or cached.
//!
//! `FLEXSTACK_FUZZ_SEED` (decimal or 0x-hex) sets the base seed, `FLEXSTACK_FUZZ_ITERS` the inputs (default
//! [`DEFAULT_ITERS`]). A failure prints the seed, the iteration and the batch in hex.

mod common;
use common::{catalog, link, load, meter, verdict};

use flexstack_core::{
    Batch, ControlFrame, ControlOp, Edit, Frame, Module, ModuleBuilder, ModuleInterface, ModuleVars, Output, PortSpec,
    Switch, Time, Value,
};
use flexstack_fuzzkit::{
    hex, iters_from_env, load_corpus, mutate_input, run_guarded, seed_from_env, target_seed, Dict, Rng,
};
use flexstack_modules::ip::link::{self, CONSUMED_METERS, GENERATED_METERS};
use flexstack_wire::checksum;
use flexstack_wire::packet::{build, proto};
use smoltcp::wire::{ArpOperation, ArpPacket, ArpRepr, Icmpv6Packet, NdiscRepr};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, Mutex};

/// Inputs by default: the file runs in a few seconds in a debug build.
const DEFAULT_ITERS: usize = 100_000;
const DEFAULT_SEED: u64 = 0x5eed_11c4_e7f0_0001;
const MAX_INPUT: usize = 2000;

const ME: [u8; 6] = [2, 0, 0, 0, 0, 1];
const MAX_NEIGHBOURS: u64 = 8;
const QUEUE_PER_NEIGHBOUR: u64 = 4;
const MAX_QUEUED: u64 = 12;
const TIMEOUT_MS: u64 = 3000;
const RETRIES: u64 = 2;
const INTERVAL_MS: u64 = 200;

fn v6(s: &str) -> Ipv6Addr {
    s.parse().unwrap()
}

/// Packets for the `ip` input: to on-link neighbours (some of which the Ethernet seeds answer for), gateways'
/// destinations, broadcast and multicast, from our addresses and others; then the IP corpus.
fn ip_seeds() -> Vec<Vec<u8>> {
    let a4 = Ipv4Addr::new(10, 0, 0, 2);
    let a6 = v6("fd00::2");
    let mut out = Vec::new();
    for (i, dst) in ["10.0.0.1", "10.0.0.5", "10.0.0.254", "10.0.0.77", "192.0.2.7", "255.255.255.255", "10.0.0.255"]
        .into_iter()
        .chain(["224.0.0.251", "127.0.0.1", "10.0.0.2"])
        .enumerate()
    {
        let d: Ipv4Addr = dst.parse().unwrap();
        let src = if i % 3 == 2 { Ipv4Addr::new(172, 16, 0, 1) } else { a4 };
        out.push(build::ipv4(src, d, proto::UDP, 64, &build::udp(src.into(), d.into(), 4000, 53, &[i as u8; 12])));
    }
    for (i, dst) in
        ["fd00::1", "fd00::5", "fe80::1", "fe80::2", "2001:db8::7", "ff02::fb", "fd00::2"].into_iter().enumerate()
    {
        let d = v6(dst);
        let src = if i % 2 == 1 { v6("fe80::ff:fe00:1") } else { a6 };
        out.push(build::ipv6(src, d, proto::UDP, 64, &build::udp(src.into(), d.into(), 4000, 53, &[i as u8; 12])));
    }
    out.extend(load_corpus("packet", 12).into_iter().map(|(_, s)| s));
    out
}

const BYTES: &[u8] = &[0, 1, 2, 4, 6, 8, 0x33, 0x45, 0x60, 0x86, 0xdd, 0x06, 58, 64, 133, 134, 135, 136, 137, 0xff];
const WORDS: &[u16] = &[0, 1, 2, 8, 24, 32, 0x0800, 0x0806, 0x86dd, 0x8100, 0x88cc, 0x05dc, 0xffff, 0x3333];
/// MACs and address bytes worth writing into headers.
const PATCHES: &[&[u8]] = &[
    &[2, 0, 0, 0, 0, 1],
    &[2, 0, 0, 0, 0, 2],
    &[2, 0, 0, 0, 0, 0xfe],
    &[0xff; 6],
    &[0x33, 0x33, 0xff, 0, 0, 2],
    &[0x33, 0x33, 0, 0, 0, 1],
    &[0x01, 0, 0x5e, 0, 0, 1],
    &[0; 6],
    // IPv4 addresses.
    &[10, 0, 0, 2],
    &[10, 0, 0, 1],
    &[10, 0, 0, 5],
    &[10, 0, 0, 254],
    &[0, 0, 0, 0],
    &[255; 4],
];
/// The mutations: header bytes, words, MACs and addresses, mostly in the headers (Ethernet + IPv6 + ND = 78
/// bytes), where the decisions are.
const DICT: Dict<'static> = Dict {
    bytes: BYTES,
    words: WORDS,
    patches: PATCHES,
    runs: &[8, 64, 300],
    head: 80,
    max_len: MAX_INPUT,
    ..Dict::EMPTY
};

/// Sets the IPv6 payload length and ICMPv6 checksum, or the IPv4 header checksum, of an Ethernet frame.
fn repair_frame(rng: &mut Rng, f: &mut [u8]) {
    if f.len() < 14 {
        return;
    }
    let ethertype = u16::from_be_bytes([f[12], f[13]]);
    let ip = &mut f[14..];
    match ethertype {
        0x86dd if ip.len() >= 40 => {
            let n = (ip.len() - 40).min(65535) as u16;
            ip[4..6].copy_from_slice(&n.to_be_bytes());
            if ip[6] == 58 && ip.len() >= 44 {
                if rng.one_in(3) {
                    ip[7] = 255;
                }
                ip[42] = 0;
                ip[43] = 0;
                let src: [u8; 16] = ip[8..24].try_into().unwrap();
                let dst: [u8; 16] = ip[24..40].try_into().unwrap();
                let msg = &ip[40..];
                let pseudo = checksum::pseudo_header(
                    Ipv6Addr::from(src).into(),
                    Ipv6Addr::from(dst).into(),
                    58,
                    msg.len() as u32,
                );
                let c = checksum::finish(checksum::sum(pseudo, msg));
                ip[42..44].copy_from_slice(&c.to_be_bytes());
            }
        }
        0x0800 if ip.len() >= 20 => {
            let ihl = (usize::from(ip[0] & 0x0f) * 4).clamp(20, ip.len());
            ip[10] = 0;
            ip[11] = 0;
            let c = checksum::ipv4_header(&ip[..ihl]);
            ip[10..12].copy_from_slice(&c.to_be_bytes());
        }
        _ => {}
    }
}

fn mutate(rng: &mut Rng, input: &[u8], others: &[Vec<u8>]) -> Vec<u8> {
    mutate_input(rng, input, others, &DICT)
}

/// Runs `check` under catch_unwind; panics with a reproducible report on failure.
fn run_case(target: &str, iteration: usize, input: &[u8], check: impl FnOnce() -> Result<(), String>) {
    run_guarded(target, seed_from_env(DEFAULT_SEED), iteration, input, check);
}

// ---------------------------------------------------------------------------------------------------------------
// Sinks that check what the module emits
// ---------------------------------------------------------------------------------------------------------------

type Problems = Arc<Mutex<Vec<String>>>;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Wire,
    Ip,
}

struct SinkBuilder(Side, Problems);

impl ModuleBuilder for SinkBuilder {
    fn interface(&self) -> ModuleInterface {
        ModuleInterface { inputs: vec![PortSpec::new("in", "any")], ..Default::default() }
    }
    fn build(self: Box<Self>, _vars: &ModuleVars) -> Box<dyn Module> {
        Box::new(Sink(self.0, self.1))
    }
}

struct Sink(Side, Problems);

fn owned(ip: IpAddr) -> bool {
    ["10.0.0.2", "fd00::2", "fe80::ff:fe00:1"].iter().any(|a| a.parse::<IpAddr>().unwrap() == ip)
}

/// What is wrong with a frame the module sent on `wire`, if anything.
fn wire_problem(f: &[u8]) -> Option<String> {
    if f.len() < 14 || f[6..12] != ME {
        return Some("not from our MAC".into());
    }
    let payload = &f[14..];
    match u16::from_be_bytes([f[12], f[13]]) {
        0x0806 => {
            let repr = ArpPacket::new_checked(payload).and_then(|p| ArpRepr::parse(&p));
            let Ok(ArpRepr::EthernetIpv4 { operation, source_hardware_addr, source_protocol_addr, .. }) = repr else {
                return Some("ARP that does not parse".into());
            };
            let ok = payload.len() == 28
                && source_hardware_addr.0 == ME
                && matches!(operation, ArpOperation::Request | ArpOperation::Reply)
                && owned(source_protocol_addr.into());
            (!ok).then(|| "ARP not from one of our addresses".into())
        }
        0x0800 => (payload.first().map(|b| b >> 4) != Some(4)).then(|| "IPv4 EtherType on a non-IPv4 packet".into()),
        0x86dd => {
            if payload.first().map(|b| b >> 4) != Some(6) || payload.len() < 40 {
                return Some("IPv6 EtherType on a non-IPv6 packet".into());
            }
            // Only our own NS/NA have hop limit 255 and ICMPv6 with ND types; IP packets pass unchanged.
            let nd = payload[6] == 58 && payload[7] == 255 && payload.len() > 40 && matches!(payload[40], 135 | 136);
            if !nd {
                return None;
            }
            let src = Ipv6Addr::from(<[u8; 16]>::try_from(&payload[8..24]).unwrap());
            let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&payload[24..40]).unwrap());
            let plen = usize::from(u16::from_be_bytes([payload[4], payload[5]]));
            if plen + 40 != payload.len() {
                return None; // a packet from the `ip` input that looks like ND: passed unchanged
            }
            let msg = &payload[40..];
            let Ok(pkt) = Icmpv6Packet::new_checked(msg) else { return None };
            if !owned(src.into()) {
                return None;
            }
            if !pkt.verify_checksum(&src, &dst) {
                return Some("ND message with a wrong checksum".into());
            }
            match NdiscRepr::parse(&pkt) {
                Ok(
                    NdiscRepr::NeighborSolicit { lladdr: Some(l), .. }
                    | NdiscRepr::NeighborAdvert { lladdr: Some(l), .. },
                ) if l.as_bytes() == ME => None,
                other => Some(format!("ND message without our link-layer address: {other:?}")),
            }
        }
        t => Some(format!("EtherType {t:#06x}")),
    }
}

impl Module for Sink {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        for f in input.drain(..) {
            if let Frame::Data(p) = &f {
                let problem = match self.0 {
                    Side::Wire => wire_problem(p.data()),
                    Side::Ip => (!matches!(p.data().first().map(|b| b >> 4), Some(4 | 6)))
                        .then(|| "not an IP packet on `ip`".to_string()),
                };
                if let Some(m) = problem {
                    self.1.lock().unwrap().push(format!("{m}: {}", hex(p.data())));
                }
            }
            out.drop_frame(f);
        }
    }
}

fn sink(name: &str, side: Side, problems: &Problems) -> Edit {
    Edit::load_built(name, "fuzz-sink", Box::new(SinkBuilder(side, problems.clone())))
}

fn link_args(extra: &[String]) -> Vec<String> {
    let mut args = vec![
        "mac=\"02:00:00:00:00:01\"".to_string(),
        "addresses=[\"10.0.0.2/24\", \"fd00::2/64\"]".to_string(),
        "gateway_v4=\"10.0.0.254\"".to_string(),
        "gateway_v6=\"fe80::1\"".to_string(),
    ];
    args.extend_from_slice(extra);
    args
}

fn stack(extra: &[String], problems: &Problems) -> Switch {
    let catalog = catalog();
    let mut sw = Switch::default();
    let mut edits = vec![
        load(&catalog, "l", "link", &link_args(extra)),
        sink("wire", Side::Wire, problems),
        sink("up", Side::Ip, problems),
    ];
    for l in ["l[wire] -> wire", "l[ip] -> up"] {
        edits.push(link(l));
    }
    sw.apply(edits).unwrap();
    sw
}

fn inject(sw: &mut Switch, port: &str, packets: &[Vec<u8>]) {
    let mut frames: Batch = packets.iter().map(|b| Frame::Data(sw.pool().alloc_from(b))).collect();
    sw.inject("l", port, &mut frames).unwrap();
}

fn neighbours_listing(sw: &mut Switch, at: Time) -> Result<String, String> {
    sw.send_control(ControlFrame {
        op: ControlOp::Exec,
        sender: "control".into(),
        dest: "l".into(),
        serial: 9,
        param: "neighbours".into(),
        value: Value::Bool(true),
    });
    sw.run(at);
    match sw.take_control_inbox().pop() {
        Some(ControlFrame { op: ControlOp::ExecReply, value: Value::Str(s), .. }) => Ok(s),
        other => Err(format!("neighbours: {other:?}")),
    }
}

/// The accounting identities and the bounds.
fn check(sw: &Switch, problems: &Problems, limits: (u64, u64)) -> Result<(), String> {
    if let Some(p) = problems.lock().unwrap().first() {
        return Err(p.clone());
    }
    let m = |n: &str| meter(sw, &format!("module.l.{n}"));
    let rx_drops: u64 = link::receive_drop_reasons().map(|r| m(&format!("drop_{r}_total"))).sum();
    let tx_drops: u64 = link::send_drop_reasons().map(|r| m(&format!("drop_{r}_total"))).sum();
    let consumed: u64 = CONSUMED_METERS.iter().map(|n| m(n)).sum();
    let generated: u64 = GENERATED_METERS.iter().map(|n| m(n)).sum();
    let mut failures = Vec::new();
    let mut expect = |what: &str, left: u64, right: u64| {
        if left != right {
            failures.push(format!("{what}: {left} != {right}"));
        }
    };
    expect("drop meters = switch drops", rx_drops + tx_drops, m("frames_dropped_total"));
    expect(
        "wire in = passed up + consumed + receive drops",
        m("port.wire.frames_in_total"),
        m("passed_up_total") + consumed + rx_drops,
    );
    expect(
        "ip in = sent + queued + send drops",
        m("port.ip.frames_in_total"),
        m("sent_total") + m("queued") + tx_drops,
    );
    expect("wire out = sent + generated", m("port.wire.frames_out_total"), m("sent_total") + generated);
    expect("ip out = passed up", m("port.ip.frames_out_total"), m("passed_up_total"));
    expect(
        "in = out + dropped + consumed + queued",
        m("frames_in_total") + generated,
        m("frames_out_total") + m("frames_dropped_total") + consumed + m("queued"),
    );
    expect(
        "sinks got everything",
        meter(sw, "module.wire.frames_in_total") + meter(sw, "module.up.frames_in_total"),
        m("frames_out_total"),
    );
    let (max_neighbours, max_queued) = limits;
    if m("neighbours") > max_neighbours {
        failures.push(format!("{} neighbours > {max_neighbours}", m("neighbours")));
    }
    if m("queued") > max_queued {
        failures.push(format!("{} queued > {max_queued}", m("queued")));
    }
    verdict(&failures)
}

#[test]
fn seeds_behave_as_named() {
    for (name, seed) in load_corpus("ethernet", 30) {
        let problems = Problems::default();
        let mut sw = stack(&[], &problems);
        inject(&mut sw, "wire", std::slice::from_ref(&seed));
        sw.run(Time::from_millis(1));
        let m = |n: &str| meter(&sw, &format!("module.l.{n}"));
        if name.contains("_bad_") {
            assert_eq!(m("frames_dropped_total"), 1, "{name} is dropped");
        } else {
            assert_eq!(m("frames_dropped_total"), 0, "{name} is not dropped");
        }
        let answers = m("arp_requests_answered_total") + m("na_sent_total");
        let want = usize::from(
            [
                "arp_request_for_us",
                "arp_probe",
                "ns_for_us",
                "ns_dad",
                "ns_link_local",
                "ns_unicast_no_option",
                "ns_with_nonce",
            ]
            .iter()
            .any(|p| name.starts_with(p)),
        );
        assert_eq!(answers, want as u64, "{name}: answers");
        if name.starts_with("ipv") && !name.contains("_bad_") {
            assert_eq!(m("passed_up_total"), 1, "{name} passes up");
        }
        check(&sw, &problems, (MAX_NEIGHBOURS, MAX_QUEUED)).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn fuzz_link() {
    let frames: Vec<Vec<u8>> = load_corpus("ethernet", 30).into_iter().map(|(_, s)| s).collect();
    let packets = ip_seeds();
    let problems = Problems::default();
    let limits = [
        format!("max_neighbours={MAX_NEIGHBOURS}"),
        format!("queue_per_neighbour={QUEUE_PER_NEIGHBOUR}"),
        format!("max_queued={MAX_QUEUED}"),
        format!("neighbour_timeout_ms={TIMEOUT_MS}"),
        format!("resolve_retries={RETRIES}"),
        format!("resolve_interval_ms={INTERVAL_MS}"),
    ];
    let mut sw = stack(&limits, &problems);
    let mut bounds = (MAX_NEIGHBOURS, MAX_QUEUED);
    let mut rng = Rng::new(target_seed(seed_from_env(DEFAULT_SEED), "link"));
    let mut now = 0u64;
    let mut i = 0;
    let iters = iters_from_env(DEFAULT_ITERS);
    while i < iters {
        let n = 1 + rng.below(12);
        let mut wire = Vec::new();
        let mut ip = Vec::new();
        for _ in 0..n {
            if rng.one_in(3) {
                let seed = &packets[rng.below(packets.len())];
                let mut p = if rng.one_in(3) { mutate(&mut rng, seed, &packets) } else { seed.clone() };
                // The wire sink checks the NS/NA the module makes (hop limit 255, from our addresses): a packet to
                // send must not pass for one.
                if p.len() > 40 && p[0] >> 4 == 6 && p[6] == 58 && p[7] == 255 {
                    p[7] = 64;
                }
                ip.push(p);
            } else {
                let seed = &frames[rng.below(frames.len())];
                let mut f = if rng.one_in(4) { seed.clone() } else { mutate(&mut rng, seed, &frames) };
                if rng.one_in(2) {
                    repair_frame(&mut rng, &mut f);
                }
                wire.push(f);
            }
        }
        i += n;
        now += [0, 1, 10, 100, 250, 700, 3500][rng.below(7)];
        // Now and then a knob changes: the limits apply at once.
        if rng.one_in(200) {
            let (knob, value) = match rng.below(3) {
                0 => ("max_neighbours", 1 + rng.below(MAX_NEIGHBOURS as usize) as u64),
                1 => ("max_queued", 1 + rng.below(MAX_QUEUED as usize) as u64),
                _ => ("queue_per_neighbour", 1 + rng.below(QUEUE_PER_NEIGHBOUR as usize) as u64),
            };
            sw.apply(vec![Edit::SetKnob { module: "l".into(), knob: knob.into(), value: Value::U64(value) }]).unwrap();
            match knob {
                "max_neighbours" => bounds.0 = value,
                "max_queued" => bounds.1 = value,
                _ => {}
            }
        }
        inject(&mut sw, "ip", &ip);
        inject(&mut sw, "wire", &wire);
        let at = Time::from_millis(now);
        let all: Vec<u8> = wire
            .iter()
            .chain(&ip)
            .flat_map(|b| (b.len() as u32).to_be_bytes().into_iter().chain(b.iter().copied()))
            .collect();
        run_case("link", i, &all, || {
            sw.run(at);
            check(&sw, &problems, bounds)?;
            if rng.one_in(50) {
                let listing = neighbours_listing(&mut sw, at)?;
                let lines = listing.lines().count() as u64;
                if lines != meter(&sw, "module.l.neighbours") {
                    return Err(format!("{lines} neighbours listed: {listing}"));
                }
                for l in listing.lines() {
                    let words: Vec<&str> = l.split(' ').collect();
                    let ok = words.len() == 3
                        && words[0].parse::<IpAddr>().is_ok()
                        && (words[1] == "incomplete" || link::parse_mac(words[1]).is_some())
                        && words[2].parse::<u64>().is_ok();
                    if !ok {
                        return Err(format!("bad neighbours line {l:?}"));
                    }
                }
            }
            Ok(())
        });
    }
    // Time runs out: every queue is given up, every neighbour expires or stops answering its probes.
    let mut runs = 0;
    while let Some(t) = sw.next_wakeup() {
        sw.run(t.max(Time::from_millis(now)));
        runs += 1;
        assert!(runs < 10_000, "timers keep firing: next at {:?}", sw.next_wakeup());
    }
    run_case("link", i, &[], || {
        check(&sw, &problems, bounds)?;
        let left = (meter(&sw, "module.l.queued"), meter(&sw, "module.l.neighbours"));
        if left != (0, 0) {
            return Err(format!("(queued, neighbours) = {left:?} after all timeouts"));
        }
        Ok(())
    });
    let snapshot = sw.registry().snapshot();
    let mut reached: Vec<String> = snapshot
        .iter()
        .filter(|(n, _)| n.starts_with("module.l.") && n.ends_with("_total") && !n.contains(".port."))
        .map(|(n, c)| format!("{}={}", &n["module.l.".len()..], c.get()))
        .collect();
    reached.sort();
    eprintln!("after {i} inputs: {}", reached.join(" "));
    let m = |n: &str| meter(&sw, &format!("module.l.{n}"));
    for n in [
        "arp_requests_answered_total",
        "na_sent_total",
        "ns_sent_total",
        "arp_requests_sent_total",
        "resolved_total",
        "resolution_failed_total",
        "sent_total",
        "passed_up_total",
        "evicted_total",
        "drop_arp_malformed_total",
        "drop_ndp_malformed_total",
        "drop_ndp_invalid_total",
        "drop_bad_icmpv6_checksum_total",
        "drop_resolution_queue_full_total",
        "drop_unresolved_total",
        "drop_not_for_us_total",
    ] {
        assert!(m(n) > 0, "{n} never reached");
    }
}
