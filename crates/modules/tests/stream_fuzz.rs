//! Deterministic, bounded mutational fuzzing of the stream endpoints (the approach of `packets_fuzz.rs`): random
//! and mutated segments into `terminate`, as if from the app, and one in four into `originate`, as if from the
//! network (its match table takes every flow for the server role), while a real connection runs beside them.
//!
//! Seeds are the files in `fuzz/corpus/endpoint/` (IPv4 and IPv6 packets from the app to the server: SYNs with and
//! without options, data, FIN, RST, a SYN with data, bad option lengths, a bad checksum, out-of-window data, a DNS
//! query). Inputs are seeds mutated by the fuzzkit engine (bit flips, TCP header bytes and words, truncation,
//! splices) and, half of the time, "repaired" (IPv4 length and header checksum, IPv6 payload length, TCP and UDP
//! checksums) so that they reach the TCP state machine rather than stop at the first check; one in eight is random
//! bytes. They run through the lab of `streamkit` (app host, `terminate`, `originate`, a server host with
//! listeners on port 80), with small limits, while the clock moves and jumps.
//!
//! - `seeds_alone`: each seed through a fresh lab: no panic.
//! - `fuzz_endpoint`: one lab for the whole campaign. After every input: no panic; connections and UDP flows within
//!   their limits; bytes in flight and queued within the budgets; the pool bounded; every packet sent to the app is
//!   an IP packet with right checksums (TCP segments, ICMP errors). At the end, with the network silent and the app
//!   gone, every flow ends: nothing is left.
//!
//! `FLEXSTACK_FUZZ_SEED` (decimal or 0x-hex) sets the base seed, `FLEXSTACK_FUZZ_ITERS` the inputs (default
//! [`DEFAULT_ITERS`]).

mod streamkit;
use streamkit::*;
// The IP part of `repair`, shared with the packet checks (fuzz/src/packet.rs).
#[allow(dead_code)]
#[path = "../../../fuzz/src/packet.rs"]
mod packet_checks;

use flexstack_core::Direction;
use flexstack_fuzzkit::{
    iters_from_env, load_corpus, mutate_input, run_guarded, seed_from_env, target_seed, Dict, Rng,
};
use flexstack_wire::checksum;
use flexstack_wire::packet::PacketInfo;
use std::time::Duration;

const DEFAULT_ITERS: usize = 4000;
const DEFAULT_SEED: u64 = 0x5eed_e4d9_0147_0001;

const MAX_CONN: u64 = 24;
const BUDGET: u64 = 16 * 1024;
const QUEUE: u64 = 64 * 1024;

fn settings() -> Vec<String> {
    vec![
        format!("max_connections={MAX_CONN}"),
        format!("max_udp_flows={MAX_CONN}"),
        format!("budget={BUDGET}"),
        format!("queue_limit={QUEUE}"),
        "rx_buffer=4096".into(),
        "tx_buffer=4096".into(),
        "connect_timeout_ms=300".into(),
        "udp_timeout_ms=300".into(),
        "keepalive_ms=1000".into(),
        "timeout_ms=3000".into(),
    ]
}

fn lab() -> Lab {
    let mut t = settings();
    t.push("match=[\"tcp *\", \"udp *\"]".into());
    let t: Vec<&str> = t.iter().map(|s| s.as_str()).collect();
    let mut o = settings();
    o.push("match=[\"tcp role server\", \"udp role server\"]".into());
    let o: Vec<&str> = o.iter().map(|s| s.as_str()).collect();
    let mut lab = Lab::new(false, &t, &o, &[("p", "stream-pass", vec![])]);
    for _ in 0..8 {
        lab.listen(80, 4096);
    }
    lab.keep_seen = true;
    lab
}

/// TCP header fields and values worth planting.
const BYTES: &[u8] = &[0, 1, 2, 3, 4, 5, 8, 0x10, 0x11, 0x12, 0x14, 0x18, 0x50, 0x60, 0xf0, 0x7f, 0x80, 0xff];
const WORDS: &[u16] = &[0, 1, 80, 53, 536, 1460, 0x7fff, 0x8000, 0xfffe, 0xffff];
const DICT: Dict<'static> =
    Dict { bytes: BYTES, words: WORDS, runs: &[4, 40, 1400], head: 80, max_len: 3000, ..Dict::EMPTY };

/// Sets lengths and checksums from the bytes (the IP header's as `packets_fuzz` does, then TCP's or UDP's), so a
/// mutated packet gets past the first checks.
fn repair(p: &mut [u8]) {
    let Some((l4, protocol)) = packet_checks::repair(p, true) else { return };
    let Ok(info) = PacketInfo::parse(p) else { return };
    let field = match protocol {
        6 => l4 + 16,
        17 => l4 + 6,
        _ => return,
    };
    if field + 2 > p.len() {
        return;
    }
    p[field] = 0;
    p[field + 1] = 0;
    let c = checksum::finish(checksum::sum(
        checksum::pseudo_header(info.src, info.dst, protocol, (p.len() - l4) as u32),
        &p[l4..],
    ));
    p[field..field + 2].copy_from_slice(&c.to_be_bytes());
}

/// Why a packet sent to the app is not well formed, if it is not.
fn malformed(p: &[u8]) -> Option<String> {
    let info = match PacketInfo::parse(p) {
        Ok(i) => i,
        Err(e) => return Some(format!("does not parse: {e}")),
    };
    let l4 = &p[info.l4_offset..info.total_len];
    let ok = match (info.version, info.protocol) {
        (4, 1) => checksum::verify(0, l4),
        (6, 58) | (_, 6) | (_, 17) => {
            checksum::verify(checksum::pseudo_header(info.src, info.dst, info.protocol, l4.len() as u32), l4)
        }
        _ => return Some(format!("protocol {}", info.protocol)),
    };
    (!ok).then(|| "wrong checksum".to_string())
}

fn check(lab: &mut Lab) -> Result<(), String> {
    let m = |name: &str| lab.meter(name);
    for side in ["t", "o"] {
        let tcp = m(&format!("module.{side}.connections_active"));
        let udp = m(&format!("module.{side}.udp_flows_active"));
        if tcp > MAX_CONN || udp > MAX_CONN {
            return Err(format!("{side}: {tcp} connections, {udp} UDP flows"));
        }
        let flight = m(&format!("module.{side}.in_flight_bytes"));
        if flight > (tcp + udp) * BUDGET {
            return Err(format!("{side}: {flight} bytes in flight"));
        }
        let queued = m(&format!("module.{side}.buffered_bytes"));
        if queued > tcp * QUEUE {
            return Err(format!("{side}: {queued} bytes queued"));
        }
    }
    let slots = lab.sw.pool().stats().peak;
    if slots > 20_000 {
        return Err(format!("{slots} pool slots"));
    }
    for p in lab.seen_to_app.drain(..) {
        if let Some(why) = malformed(&p) {
            return Err(format!("to the app: {why}: {}", flexstack_fuzzkit::hex(&p)));
        }
    }
    lab.seen_to_net.clear();
    Ok(())
}

#[test]
fn seeds_alone() {
    for (i, (name, seed)) in load_corpus("endpoint", 10).into_iter().enumerate() {
        run_guarded(&format!("endpoint seed {name}"), 0, i, &seed, || {
            let mut lab = lab();
            lab.inject("t", "in", vec![seed.clone()], Direction::Down);
            lab.run(50);
            check(&mut lab)
        });
    }
}

#[test]
fn fuzz_endpoint() {
    let corpus = load_corpus("endpoint", 10);
    let base = seed_from_env(DEFAULT_SEED);
    let mut rng = Rng::new(target_seed(base, "endpoint"));
    let mut lab = lab();
    let mut client = None;
    let mut pump = Pump::default();
    for i in 0..iters_from_env(DEFAULT_ITERS) {
        let input = if rng.one_in(8) {
            let n = rng.below(120);
            rng.bytes(n)
        } else {
            let seed = &corpus[rng.below(corpus.len())].1;
            let mut m = mutate_input(&mut rng, seed, &corpus, &DICT);
            if rng.one_in(2) {
                repair(&mut m);
            }
            m
        };
        // A real connection beside the hostile packets, started again when it ends.
        let closed = client.is_none_or(|h| !lab.app.tcp(h).is_open());
        if closed && rng.one_in(20) {
            client = Some(lab.connect(80, 4096));
            pump = Pump::new(pattern(i as u64, 1 + rng.below(60_000)), true);
        }
        let jump = rng.one_in(60);
        let from_net = rng.one_in(4);
        run_guarded("endpoint", base, i + 1, &input, || {
            if from_net {
                lab.inject("o", "in", vec![input.clone()], Direction::Up);
            } else {
                lab.inject("t", "in", vec![input.clone()], Direction::Down);
            }
            lab.step();
            if let Some(h) = client {
                pump.drive(lab.app.tcp(h));
            }
            for s in lab.server.sockets.iter_mut() {
                if let smoltcp::socket::Socket::Tcp(s) = s.1 {
                    while s.can_recv() {
                        let _ = s.recv(|b| (b.len(), ()));
                    }
                    if !s.is_open() {
                        let _ = s.listen(80);
                    }
                }
            }
            if jump {
                lab.now = lab.now + Duration::from_millis(700);
            }
            check(&mut lab)
        });
    }
    println!(
        "server role: {} connections and {} UDP flows from the network chosen by its rules",
        lab.meter("module.o.rule1_matches_total"),
        lab.meter("module.o.rule2_matches_total")
    );
    let m = |n: &str| lab.meter(&format!("module.t.{n}"));
    println!(
        "endpoint fuzz: {} connections, {} UDP flows, {} invalid SYNs, {} refused, {} passed, {} segments in, {} bytes \
         out, {} aborts sent",
        m("connections_total"),
        m("udp_flows_total"),
        m("invalid_syns_total"),
        m("refused_total"),
        m("passed_total"),
        m("segments_in_total"),
        m("data_bytes_out_total"),
        m("aborts_sent_total")
    );
    // The end: the network goes silent and the app's sockets go away; every flow times out or is reset.
    lab.blackhole = true;
    let handles: Vec<_> = lab.app.sockets.iter().map(|(h, _)| h).collect();
    for h in handles {
        lab.app.sockets.remove(h);
    }
    lab.run(12_000);
    for side in ["t", "o"] {
        let left = lab.meter(&format!("module.{side}.connections_active"))
            + lab.meter(&format!("module.{side}.udp_flows_active"));
        assert_eq!(left, 0, "{side}: flows left after every timeout");
    }
}
