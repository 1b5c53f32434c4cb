//! Deterministic, bounded mutational fuzzing of the packet path, on stable Rust, as part of `cargo test`.
//!
//! Seeds are the files in `fuzz/corpus/packet/` (raw IPv4/IPv6 packets: transports, options, extension-header
//! chains, AH, fragments, ICMP errors quoting truncated packets). Inputs are seeds mutated by a xorshift PRNG (bit
//! flips, interesting bytes and 16-bit fields, inserts, deletes, truncation, splices) and, half of the time,
//! "repaired" (IPv4 total length and header checksum, IPv6 payload length) so that they get past the first checks.
//! Three targets, each under `catch_unwind`:
//!
//! - `parse`: [`PacketInfo::parse`]; a parsed packet's offsets lie within it.
//! - `icmp`: [`icmp::error_v4`] / [`icmp::error_v6`] with the input as the original: within 576 / 1280 bytes, parse
//!   back, right checksums, quote a prefix of the input; [`icmp::may_send_error`] on parsed inputs.
//! - `stack`: a switch running `ip` (mtu 1500, L4 checksums verified) → `reassemble` (small limits) → `icmp`, with
//!   sinks on every output, fed batches of mutated packets while the clock jumps ahead: every frame is accounted
//!   for by each module's meters, reassembly memory stays within its bounds, and every packet emitted is well
//!   formed (ICMP errors and echo replies with right checksums; reassembled datagrams with a consistent length).
//!
//! `FLEXSTACK_FUZZ_SEED` (decimal or 0x-hex) sets the base seed, `FLEXSTACK_FUZZ_ITERS` the inputs per target
//! (default [`DEFAULT_ITERS`]). A failure prints the target, seed, iteration and input in hex.

mod common;
use common::{catalog, link, load, meter, verdict};
// The checks of the parsers, shared with the libFuzzer target `packet` (fuzz/fuzz_targets/packet.rs).
#[allow(dead_code)]
#[path = "../../../fuzz/src/packet.rs"]
mod checks;
use checks::{check_icmp, check_parse, checksum_error, repair};

use flexstack_core::{
    Batch, Edit, Frame, Module, ModuleBuilder, ModuleInterface, ModuleVars, Output, PortSpec, Switch, Time,
};
use flexstack_fuzzkit::{
    hex, iters_from_env, load_corpus, mutate_input, run_guarded, seed_from_env, target_seed, Dict, Rng,
};
use flexstack_wire::checksum;
use flexstack_wire::packet::{PacketInfo, ParseError};
use std::sync::{Arc, Mutex};

/// Inputs per target by default: the whole file runs in a few seconds in a debug build.
const DEFAULT_ITERS: usize = 30_000;
const DEFAULT_SEED: u64 = 0x5eed_9ac4_e7f0_0001;
const MAX_INPUT: usize = 9000;

const MAX_DATAGRAMS: u64 = 6;
const MAX_BYTES: u64 = 40_000;

/// The seeds, sorted by file name.
fn corpus() -> Vec<(String, Vec<u8>)> {
    load_corpus("packet", 12)
}

/// Bytes and 16-bit values that mean something in IP headers.
const BYTES: &[u8] =
    &[0, 1, 2, 4, 5, 6, 8, 17, 43, 44, 51, 58, 59, 60, 0x20, 0x40, 0x45, 0x46, 0x4f, 0x60, 0x7f, 0x80, 0xff];
const WORDS: &[u16] =
    &[0, 1, 7, 8, 20, 40, 0x2000, 0x2001, 0x1fff, 0x3fff, 0x4000, 576, 1280, 1500, 0x7fff, 0xfff8, 0xffff];

/// The mutations: IP header bytes and fields (mostly within the first 64 bytes), long runs.
const DICT: Dict<'static> =
    Dict { bytes: BYTES, words: WORDS, runs: &[8, 64, 600, 1500], head: 64, max_len: MAX_INPUT, ..Dict::EMPTY };

/// A mutation of `input`, half of the time repaired (lengths, IPv4 header checksum).
fn mutate(rng: &mut Rng, input: &[u8], corpus: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = mutate_input(rng, input, corpus, &DICT);
    if rng.one_in(2) {
        let total_len = rng.one_in(2);
        repair(&mut out, total_len);
    }
    out
}

/// Runs `check` on `input` under catch_unwind; panics with a reproducible report on failure.
fn run_case(target: &str, iteration: usize, input: &[u8], check: impl FnOnce() -> Result<(), String>) {
    run_guarded(target, seed_from_env(DEFAULT_SEED), iteration, input, check);
}

#[test]
fn seeds_parse_as_intended() {
    for (name, seed) in corpus() {
        let parsed = PacketInfo::parse(&seed);
        if name.contains("_bad_") {
            assert!(parsed.is_err(), "{name} should not parse");
        } else {
            let info = parsed.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(name.contains("_frag_") && !name.contains("atomic"), info.fragment.is_some(), "{name}");
            if info.fragment.is_none() {
                assert_eq!(checksum_error(&seed), None, "{name}");
            }
        }
    }
}

#[test]
fn fuzz_parse_and_icmp() {
    let corpus = corpus();
    for (name, check) in [("parse", check_parse as fn(&[u8]) -> Result<(), String>), ("icmp", check_icmp)] {
        for (_, seed) in &corpus {
            run_case(name, 0, seed, || check(seed));
        }
        let mut rng = Rng::new(target_seed(seed_from_env(DEFAULT_SEED), name));
        for i in 0..iters_from_env(DEFAULT_ITERS) {
            let seed = &corpus[rng.below(corpus.len())].1;
            let input = mutate(&mut rng, seed, &corpus);
            run_case(name, i + 1, &input, || check(&input));
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The stack target
// ---------------------------------------------------------------------------------------------------------------

/// What a sink checks about the packets it receives.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// ICMP errors or echo replies: parse, right checksums.
    Checksums,
    /// Leaving `reassemble`: a length consistent with the IP header, a right IPv4 header checksum.
    Consistent,
    /// Anything.
    Any,
}

type Problems = Arc<Mutex<Vec<String>>>;

struct Sink {
    expect: Expect,
    problems: Problems,
}

struct SinkBuilder(Expect, Problems);

impl ModuleBuilder for SinkBuilder {
    fn interface(&self) -> ModuleInterface {
        ModuleInterface { inputs: vec![PortSpec::new("in", "any")], ..Default::default() }
    }
    fn build(self: Box<Self>, _vars: &ModuleVars) -> Box<dyn Module> {
        Box::new(Sink { expect: self.0, problems: self.1 })
    }
}

fn consistency_error(p: &[u8]) -> Option<String> {
    match p.first().map(|b| b >> 4) {
        Some(4) if p.len() >= 20 => {
            let ihl = usize::from(p[0] & 0x0f) * 4;
            let total = usize::from(u16::from_be_bytes([p[2], p[3]]));
            if total != p.len() || ihl < 20 || ihl > p.len() || !checksum::verify(0, &p[..ihl]) {
                return Some(format!("inconsistent IPv4 packet (ihl {ihl}, total {total}, len {})", p.len()));
            }
            None
        }
        Some(6) if p.len() >= 40 => {
            let plen = usize::from(u16::from_be_bytes([p[4], p[5]]));
            (plen + 40 != p.len()).then(|| format!("IPv6 payload length {plen} for {} bytes", p.len()))
        }
        _ => Some(format!("not an IP packet ({} bytes)", p.len())),
    }
}

impl Module for Sink {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        for f in input.drain(..) {
            if let Frame::Data(p) = &f {
                let problem = match self.expect {
                    Expect::Checksums => checksum_error(p.data()),
                    Expect::Consistent => consistency_error(p.data()),
                    Expect::Any => None,
                };
                if let Some(m) = problem {
                    self.problems.lock().unwrap().push(format!("{m}: {}", hex(p.data())));
                }
            }
            out.drop_frame(f);
        }
    }
}

fn sink(name: &str, expect: Expect, problems: &Problems) -> Edit {
    Edit::load_built(name, "fuzz-sink", Box::new(SinkBuilder(expect, problems.clone())))
}

fn stack(problems: &Problems) -> Switch {
    let catalog = catalog();
    let mut sw = Switch::default();
    let max_d = format!("max_datagrams={MAX_DATAGRAMS}");
    let max_b = format!("max_bytes={MAX_BYTES}");
    let mut edits = vec![
        load(&catalog, "ip", "ip", &["mtu=1500", "verify_l4_checksums=true", "icmp_rate=0"]),
        load(&catalog, "r", "reassemble", &[&max_d, &max_b, "timeout_ms=1000"]),
        load(&catalog, "i", "icmp", &["addresses=[\"10.2.0.1\", \"fd00:1::1\"]"]),
        sink("errors", Expect::Checksums, problems),
        sink("replies", Expect::Checksums, problems),
        sink("rest", Expect::Any, problems),
        sink("whole", Expect::Consistent, problems),
    ];
    for l in ["ip[out] -> r", "ip[icmp] -> errors", "r -> i, whole", "i[reply] -> replies", "i[out] -> rest"] {
        edits.push(link(l));
    }
    sw.apply(edits).unwrap();
    sw
}

/// The per-module accounting and the reassembly bounds.
fn check_stack(sw: &Switch, injected: u64, problems: &Problems) -> Result<(), String> {
    if let Some(p) = problems.lock().unwrap().first() {
        return Err(p.clone());
    }
    let m = |n: &str| meter(sw, n);
    let drops = |module: &str, reasons: &[&str]| -> u64 {
        let parse = ParseError::ALL.map(|e| e.reason());
        reasons.iter().chain(parse.iter()).map(|r| m(&format!("module.{module}.drop_{r}_total"))).sum()
    };
    let mut failures = Vec::new();
    let mut expect = |what: &str, left: u64, right: u64| {
        if left != right {
            failures.push(format!("{what}: {left} != {right}"));
        }
    };
    // ip: every frame in leaves on `out` (whole or as fragments) or is dropped with one reason.
    expect("ip frames in", m("module.ip.frames_in_total"), injected);
    let ip_drops = drops("ip", &["ttl_exceeded", "too_big", "bad_l4_checksum"]);
    expect("ip drops by reason", ip_drops, m("module.ip.frames_dropped_total"));
    expect(
        "ip in = out - extra fragments + dropped",
        m("module.ip.frames_in_total") + m("module.ip.fragments_made_total"),
        m("module.ip.port.out.frames_out_total") + m("module.ip.packets_fragmented_total") + ip_drops,
    );
    expect("ip icmp port", m("module.ip.port.icmp.frames_out_total"), m("module.ip.icmp_errors_total"));
    // reassemble
    let r_drops = drops("r", &["overlap", "duplicate", "tiny", "too_big", "timeout", "memory"]);
    expect("reassemble drops by reason", r_drops, m("module.r.frames_dropped_total"));
    expect("reassemble in", m("module.r.frames_in_total"), m("module.ip.port.out.frames_out_total"));
    expect(
        "reassemble in = passed + reassembled + pending + dropped",
        m("module.r.frames_in_total"),
        m("module.r.passed_total")
            + m("module.r.fragments_reassembled_total")
            + m("module.r.fragments_pending")
            + r_drops,
    );
    expect(
        "reassemble out",
        m("module.r.frames_out_total"),
        m("module.r.passed_total") + m("module.r.datagrams_reassembled_total"),
    );
    // icmp
    expect("icmp in", m("module.i.frames_in_total"), m("module.r.frames_out_total"));
    expect(
        "icmp in = replies + passed + dropped",
        m("module.i.frames_in_total"),
        m("module.i.echo_replies_total") + m("module.i.passed_total") + m("module.i.frames_dropped_total"),
    );
    // Sinks got everything emitted.
    let sinks: u64 = ["errors", "replies", "rest"].iter().map(|s| m(&format!("module.{s}.frames_in_total"))).sum();
    expect("sinks", sinks, m("module.ip.port.icmp.frames_out_total") + m("module.i.frames_out_total"));
    if m("module.r.datagrams_pending") > MAX_DATAGRAMS {
        failures.push(format!("datagrams_pending {} > {MAX_DATAGRAMS}", m("module.r.datagrams_pending")));
    }
    if m("module.r.bytes_pending") > MAX_BYTES || m("module.r.bytes_spare") > MAX_BYTES / 4 {
        failures.push(format!("reassembly memory {} + {}", m("module.r.bytes_pending"), m("module.r.bytes_spare")));
    }
    verdict(&failures)
}

#[test]
fn fuzz_stack() {
    let corpus = corpus();
    let problems = Problems::default();
    let mut sw = stack(&problems);
    let mut rng = Rng::new(target_seed(seed_from_env(DEFAULT_SEED), "stack"));
    let mut injected = 0u64;
    let mut now = 0u64;
    // The seeds as they are first (the fragment seeds reassemble), then batches of mutated ones.
    let mut batches: Vec<Vec<Vec<u8>>> = vec![corpus.iter().map(|(_, s)| s.clone()).collect()];
    let mut i = 0;
    let iters = iters_from_env(DEFAULT_ITERS);
    while i < iters {
        let batch = batches.pop().unwrap_or_else(|| {
            let n = 1 + rng.below(16);
            (0..n)
                .map(|_| {
                    let seed = &corpus[rng.below(corpus.len())].1;
                    // A quarter of the packets are seeds unchanged: whole datagrams and their fragments.
                    if rng.one_in(4) {
                        seed.clone()
                    } else {
                        mutate(&mut rng, seed, &corpus)
                    }
                })
                .collect()
        });
        i += batch.len();
        injected += batch.len() as u64;
        now += [0, 1, 10, 300, 1200][rng.below(5)];
        let mut frames: Batch = batch.iter().map(|b| Frame::Data(sw.pool().alloc_from(b))).collect();
        sw.inject("ip", "in", &mut frames).unwrap();
        let at = Time::from_millis(now);
        let all: Vec<u8> =
            batch.iter().flat_map(|b| (b.len() as u32).to_be_bytes().into_iter().chain(b.clone())).collect();
        run_case("stack", i, &all, || {
            sw.run(at);
            check_stack(&sw, injected, &problems)
        });
    }
    // Time runs out for everything pending.
    sw.run(Time::from_millis(now + 10_000));
    run_case("stack", i, &[], || {
        check_stack(&sw, injected, &problems)?;
        match meter(&sw, "module.r.fragments_pending") {
            0 => Ok(()),
            n => Err(format!("{n} fragments still pending after the timeout")),
        }
    });
    let snapshot = sw.registry().snapshot();
    let mut reached: Vec<String> = snapshot
        .iter()
        .filter(|(n, _)| n.contains("drop_") || n.ends_with("_total") && !n.contains(".port."))
        .map(|(n, c)| format!("{n}={}", c.get()))
        .collect();
    reached.sort();
    eprintln!("after {injected} packets: {}", reached.join(" "));
    assert!(meter(&sw, "module.r.datagrams_reassembled_total") > 0, "the seeds' fragments reassemble");
    assert!(meter(&sw, "module.ip.fragments_made_total") > 0);
    assert!(meter(&sw, "module.ip.icmp_errors_total") > 0);
    assert!(meter(&sw, "module.i.echo_replies_total") > 0);
}
