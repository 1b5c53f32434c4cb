//! Deterministic, bounded mutational fuzzing of the `nat` and `firewall` rule parsers and of random packets through
//! `classify`, `firewall` and `nat`, on stable Rust, as part of `cargo test` (the approach of `tests/fuzz_parsers.rs`
//! at the repository root; see `fuzz/README.md`).
//!
//! - Rules: the seeds are `fuzz/corpus/fwrule/*` and `fuzz/corpus/natrule/*`, one rule per line. Each input is
//!   mutated (bit flips, inserts, deletes, duplicates, splices, rule words and odd tokens), then every line is parsed
//!   alone (a rule that parses must print back to text that parses to the same rule) and all lines are configured
//!   as the `rules` array of a module through the catalog, from a TOML stack description: an error must be located
//!   and name the first rule that does not parse.
//! - Packets: valid IPv4/IPv6 TCP, UDP, ICMP echo, ICMP errors quoting packets, other protocols and extension
//!   headers, built with `packet::build`, one in three mutated, go through `classify -> firewall -> nat[inside]` and
//!   `firewall -> nat[outside] -> classify` with simulated time (so flows and bindings expire). Afterwards every
//!   module has `frames_in_total = frames_out_total + frames_dropped_total` and nothing is held, and NAT's own
//!   counts add up. Every unmutated packet also goes through a NAT alone: a packet with correct checksums must come
//!   out with correct checksums.
//!
//! Everything runs under `catch_unwind`; a failure prints the seed, the iteration and the input.
//! `FLEXSTACK_FUZZ_SEED` (decimal or 0x-hex) sets the seed, `FLEXSTACK_FUZZ_ITERS` the rule inputs per target
//! (packets: the same number); the defaults keep a debug run within a few seconds.

mod common;
use common::{catalog, link, load};

use flexstack_core::{
    Batch, Catalog, Direction, Edit, Frame, Module, ModuleBuilder, ModuleInterface, ModuleVars, Output, PortSpec,
    StackSpec, Switch, Time, Value,
};
use flexstack_fuzzkit::{iters_from_env, load_corpus_bytes, mutate, seed_from_env, target_seed, Dict, Rng};
use flexstack_modules::flow::firewall::Rule;
use flexstack_modules::flow::nat::NatRule;
use flexstack_wire::checksum;
use flexstack_wire::packet::{build, proto, PacketInfo};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

const DEFAULT_SEED: u64 = 0x5eed_f1e5_57ac_0003;
const DEFAULT_ITERS: usize = 10_000;

const TOKENS: &[&str] = &[
    " ",
    "  ",
    "\t",
    "\n",
    "/",
    ":",
    "[",
    "]",
    "-",
    ".",
    "any",
    "in",
    "out",
    "from",
    "to",
    "port",
    "proto",
    "tcp",
    "udp",
    "icmp",
    "accept",
    "drop",
    "snat",
    "dnat",
    "0",
    "65535",
    "65536",
    "255",
    "256",
    "4294967296",
    "-1",
    "/0",
    "/32",
    "/128",
    "/129",
    "0.0.0.0/0",
    "::/0",
    "::",
    "::ffff:1.2.3.4",
    "10.77.0.2",
    "fd00::1",
    "[fd00::1]:80",
    "1.2.3.4:5",
    "1-65535",
    "9-1",
    "é",
    "\u{0}",
    "\u{feff}",
    "\"",
    "\\",
    "#",
];

/// The mutations: rule words and odd tokens, runs of digits, colons and spaces; up to 4 KiB.
const DICT: Dict<'static> =
    Dict { tokens: TOKENS, runs: &[1, 2, 3, 8, 17, 40], run_bytes: b"09: a", max_len: 4096, ..Dict::EMPTY };

/// One rules input: each line alone, then all of them through the catalog.
fn check_rules(cat: &Catalog, kind: &str, input: &[u8]) -> Result<(), String> {
    let text = String::from_utf8_lossy(input);
    let rules: Vec<&str> = text.lines().take(64).collect();
    let mut first_bad = None;
    for (i, r) in rules.iter().enumerate() {
        let parsed = if kind == "firewall" {
            Rule::parse(r).map(|rule| {
                let back = rule.to_string();
                (Rule::parse(&back).ok() == Some(rule), back)
            })
        } else {
            NatRule::parse(r).map(|rule| {
                let back = rule.to_string();
                (NatRule::parse(&back).ok() == Some(rule), back)
            })
        };
        match parsed {
            Ok((true, _)) => {}
            Ok((false, back)) => return Err(format!("rule {r:?} prints as {back:?}, which parses differently")),
            Err(e) => {
                if e.is_empty() || e.contains('\n') {
                    return Err(format!("rule {r:?}: empty or multi-line error {e:?}"));
                }
                first_bad.get_or_insert(i + 1);
            }
        }
    }
    let list = toml::Value::Array(rules.iter().map(|r| toml::Value::String(r.to_string())).collect());
    let stack = format!("[modules.m]\nkind = \"{kind}\"\nrules = {list}\n");
    let spec = StackSpec::parse("fuzz.toml", &stack).map_err(|e| format!("generated stack does not parse: {e}"))?;
    let m = &spec.modules[0];
    match (cat.configure(kind, &m.settings, m.location.clone()), first_bad) {
        (Ok(b), None) => {
            let meters = b.interface().vars.iter().filter(|v| v.name.starts_with("rule")).count();
            if kind == "firewall" && meters != rules.len() {
                return Err(format!("{meters} rule meters for {} rules", rules.len()));
            }
            Ok(())
        }
        (Ok(_), Some(n)) => Err(format!("configured although rule {n} does not parse")),
        (Err(e), None) => Err(format!("every rule parses, yet configure failed: {e}")),
        (Err(e), Some(n)) => {
            let want = format!("setting `rules` of a {kind} module: rule {n} ");
            if e.location.as_ref().is_none_or(|l| l.line != 3)
                || !e.message.starts_with(&want)
                || e.message.contains('\n')
            {
                return Err(format!("error should be located at line 3 and start with {want:?}: {e}"));
            }
            Ok(())
        }
    }
}

fn fuzz_rules(target: &str, kind: &str) {
    let seeds = load_corpus_bytes(target, 10);
    let cat = catalog();
    let s = target_seed(seed_from_env(DEFAULT_SEED), target);
    let mut rng = Rng::new(s);
    let mut failures = Vec::new();
    for i in 0..seeds.len() + iters_from_env(DEFAULT_ITERS) {
        let input = if i < seeds.len() { seeds[i].clone() } else { mutate(&mut rng, &seeds, &DICT) };
        let result = catch_unwind(AssertUnwindSafe(|| check_rules(&cat, kind, &input)));
        let problem = match result {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => e,
            Err(_) => "panic".to_string(),
        };
        failures.push(format!(
            "{target} seed {s:#x} iteration {i}: {problem}\n  input: {:?}",
            String::from_utf8_lossy(&input)
        ));
        if failures.len() >= 5 {
            break;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn fuzz_firewall_rules() {
    fuzz_rules("fwrule", "firewall");
}

#[test]
fn fuzz_nat_rules() {
    fuzz_rules("natrule", "nat");
}

// ---------------------------------------------------------------------------------------------------------------
// Packets
// ---------------------------------------------------------------------------------------------------------------

type Log = Arc<Mutex<Vec<Vec<u8>>>>;

/// Consumes frames, keeping the bytes of data frames.
struct Keep(Log);
struct KeepBuilder(Log);

impl ModuleBuilder for KeepBuilder {
    fn interface(&self) -> ModuleInterface {
        ModuleInterface { inputs: vec![PortSpec::new("in", "any")], ..Default::default() }
    }
    fn build(self: Box<Self>, _: &ModuleVars) -> Box<dyn Module> {
        Box::new(Keep(self.0))
    }
}

impl Module for Keep {
    fn process(&mut self, _: usize, input: &mut Batch, _: &mut Output<'_>) {
        let mut log = self.0.lock().expect("log");
        for f in input.drain(..) {
            if let Frame::Data(p) = f {
                log.push(p.data().to_vec());
            }
        }
    }
}

fn keep(name: &str) -> (Edit, Log) {
    let log = Log::default();
    (Edit::load_built(name, "keep", Box::new(KeepBuilder(log.clone()))), log)
}

const NAT_RULES: &str = r#"rules=["dnat tcp 192.0.2.10:8080 to 10.77.0.2:80", "dnat udp [fd00::10]:53 to [fd77::2]:5353", "dnat 192.0.2.11 to 10.77.0.3", "snat 10.77.0.0/24 to 192.0.2.10", "snat fd77::/64 to fd00::10"]"#;
const FW_RULES: &str = r#"rules=["drop in tcp from any to 10.77.0.2 port 22", "accept out udp to any port 53", "drop in from 203.0.113.0/24", "accept icmp", "drop proto 47", "accept tcp from fd77::/64 port 1000-2000"]"#;
const TIMEOUTS: [&str; 4] =
    ["udp_timeout_ms=3000", "tcp_timeout_ms=5000", "tcp_closing_timeout_ms=500", "icmp_timeout_ms=1000"];

const INSIDE4: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 77, 0, 2), Ipv4Addr::new(10, 77, 0, 3)];
const OUTSIDE4: [Ipv4Addr; 4] = [
    Ipv4Addr::new(192, 0, 2, 10),
    Ipv4Addr::new(192, 0, 2, 11),
    Ipv4Addr::new(198, 51, 100, 7),
    Ipv4Addr::new(203, 0, 113, 5),
];
const PORTS: [u16; 8] = [22, 53, 80, 5353, 8080, 20000, 40000, 1500];

fn inside6() -> Ipv6Addr {
    "fd77::2".parse().expect("v6")
}
fn outside6(rng: &mut Rng) -> Ipv6Addr {
    rng.pick(&["fd00::10", "2001:db8::7", "fd77::3"]).parse().expect("v6")
}

fn icmpv6_echo(s: Ipv6Addr, d: Ipv6Addr, ty: u8, id: u16) -> Vec<u8> {
    let mut m = vec![ty, 0, 0, 0];
    m.extend_from_slice(&id.to_be_bytes());
    m.extend_from_slice(&[0, 1, 2, 3]);
    let c = checksum::finish(checksum::sum(checksum::pseudo_header(s.into(), d.into(), 58, m.len() as u32), &m));
    m[2..4].copy_from_slice(&c.to_be_bytes());
    m
}

fn icmpv4(ty: u8, code: u8, rest: &[u8]) -> Vec<u8> {
    let mut m = vec![ty, code, 0, 0];
    m.extend_from_slice(rest);
    let c = checksum::finish(checksum::sum(0, &m));
    m[2..4].copy_from_slice(&c.to_be_bytes());
    m
}

/// An ICMP error about `quoted` (a packet seen leaving through NAT, or arriving through it), sent back towards its
/// source: to the NAT's outside from a router (`from_inside` false) or by the inside host that received it.
fn error_about(rng: &mut Rng, quoted: &[u8], from_inside: bool) -> Option<Vec<u8>> {
    let info = PacketInfo::parse(quoted).ok()?;
    let cut = if rng.one_in(2) { quoted.len() } else { (info.l4_offset + 8).min(quoted.len()) };
    let q = &quoted[..cut];
    let router = if info.version == 4 { IpAddr::from(OUTSIDE4[3]) } else { "2001:db8::1".parse().expect("v6") };
    let (src, dst) = if from_inside { (info.dst, info.src) } else { (router, info.src) };
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let mut rest = vec![0, 0, 0, 0];
            rest.extend_from_slice(q);
            Some(build::ipv4(s, d, proto::ICMP, 64, &icmpv4(*rng.pick(&[3, 11]), 3, &rest)))
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut m = vec![*rng.pick(&[1, 2, 3]), 0, 0, 0, 0, 0, 5, 0];
            m.extend_from_slice(q);
            let c =
                checksum::finish(checksum::sum(checksum::pseudo_header(s.into(), d.into(), 58, m.len() as u32), &m));
            m[2..4].copy_from_slice(&c.to_be_bytes());
            Some(build::ipv6(s, d, proto::ICMPV6, 64, &m))
        }
        _ => None,
    }
}

/// A valid packet, from the inside (true) or the outside; now and then an ICMP error about a recent packet.
fn packet(rng: &mut Rng, depth: u8, sent: &[Vec<u8>], received: &[Vec<u8>]) -> (Vec<u8>, bool) {
    let from_inside = rng.one_in(2);
    let recent = if from_inside { received } else { sent };
    if depth == 0 && !recent.is_empty() && rng.one_in(6) {
        let q = rng.pick(recent).clone();
        if let Some(e) = error_about(rng, &q, from_inside) {
            return (e, from_inside);
        }
    }
    let len = rng.below(48);
    let data = rng.bytes(len);
    let (sp, dp) = (*rng.pick(&PORTS), *rng.pick(&PORTS));
    if rng.one_in(3) {
        let (s, d) = if from_inside {
            (inside6(), outside6(rng))
        } else {
            (outside6(rng), *rng.pick(&["fd00::10".parse().expect("v6"), inside6()]))
        };
        let (next, payload) = match rng.below(4) {
            0 => (proto::UDP, build::udp(s.into(), d.into(), sp, dp, &data)),
            1 => (proto::TCP, build::tcp(s.into(), d.into(), sp, dp, &data)),
            2 => (proto::ICMPV6, icmpv6_echo(s, d, *rng.pick(&[128, 129]), sp)),
            _ => {
                // A hop-by-hop header before UDP.
                let mut p = vec![proto::UDP, 0, 1, 4, 0, 0, 0, 0];
                p.extend_from_slice(&build::udp(s.into(), d.into(), sp, dp, &data));
                (proto::HOP_BY_HOP, p)
            }
        };
        return (build::ipv6(s, d, next, 64, &payload), from_inside);
    }
    let (s, d) = if from_inside {
        (*rng.pick(&INSIDE4), *rng.pick(&OUTSIDE4))
    } else {
        (*rng.pick(&OUTSIDE4), *rng.pick(&OUTSIDE4[..2]))
    };
    let (p, payload) = match rng.below(6) {
        0 => (proto::UDP, build::udp(s.into(), d.into(), sp, dp, &data)),
        1 => {
            let mut t = build::tcp(s.into(), d.into(), sp, dp, &data);
            let old = [t[12], t[13]];
            t[13] = *rng.pick(&[0x02, 0x12, 0x10, 0x11, 0x04, 0x18]);
            let c = checksum::update(u16::from_be_bytes([t[16], t[17]]), &old, &t[12..14]);
            t[16..18].copy_from_slice(&c.to_be_bytes());
            (proto::TCP, t)
        }
        2 => {
            let mut rest = sp.to_be_bytes().to_vec();
            rest.extend_from_slice(&[0, 1]);
            rest.extend_from_slice(&data);
            (proto::ICMP, icmpv4(*rng.pick(&[0, 8]), 0, &rest))
        }
        3 if depth == 0 => {
            // An ICMP error quoting another packet, whole or cut.
            let (quoted, _) = packet(rng, 1, &[], &[]);
            let cut = if rng.one_in(2) { quoted.len() } else { rng.below(quoted.len() + 1) };
            let mut rest = vec![0, 0, 0, 0];
            rest.extend_from_slice(&quoted[..cut]);
            (proto::ICMP, icmpv4(*rng.pick(&[3, 11, 12]), rng.below(4) as u8, &rest))
        }
        _ => (*rng.pick(&[47, 50, 132]), data),
    };
    (build::ipv4(s, d, p, 64, &payload), from_inside)
}

fn damage(rng: &mut Rng, d: &mut Vec<u8>) {
    for _ in 0..=rng.below(3) {
        match rng.below(5) {
            0 if !d.is_empty() => {
                let i = rng.below(d.len());
                d[i] ^= 1 << rng.below(8);
            }
            1 => d.truncate(rng.below(d.len() + 1)),
            2 => {
                let len = rng.below(16);
                let extra = rng.bytes(len);
                d.extend_from_slice(&extra);
            }
            3 if !d.is_empty() => {
                let i = rng.below(d.len().min(48));
                d[i] = *rng.pick(&[0, 0xff, 0x45, 0x4f, 0x60, 44, 6, 17, 58]);
            }
            _ => {}
        }
    }
}

/// True if `p` parses and its transport checksum (when it has one) is right.
fn checksums_ok(p: &[u8]) -> bool {
    let Ok(info) = PacketInfo::parse(p) else { return false };
    if info.fragment.is_some() {
        return true;
    }
    let seg = &p[info.l4_offset..info.total_len];
    match info.protocol {
        proto::UDP if seg.len() >= 8 && seg[6..8] == [0, 0] => true,
        proto::TCP | proto::UDP | proto::ICMPV6 => {
            checksum::verify(checksum::pseudo_header(info.src, info.dst, info.protocol, seg.len() as u32), seg)
        }
        proto::ICMP => checksum::verify(0, seg),
        _ => true,
    }
}

fn u64_var(sw: &Switch, name: &str) -> u64 {
    match sw.registry().snapshot().get(name).map(|c| c.get()) {
        Some(Value::U64(v)) => v,
        other => panic!("{name}: {other:?}"),
    }
}

#[test]
fn fuzz_packets_through_classify_firewall_nat() {
    let cat = catalog();
    let mut args = vec![NAT_RULES];
    args.extend(TIMEOUTS);
    let mut sw = Switch::default();
    let (k_out, sent_log) = keep("k_out");
    let (k_in, received_log) = keep("k_in");
    sw.apply(vec![
        load(&cat, "c", "classify", &TIMEOUTS),
        load(&cat, "fw", "firewall", &[FW_RULES]),
        load(&cat, "n", "nat", &args),
        load(&cat, "fw2", "firewall", &[FW_RULES, "default=\"drop\""]),
        load(&cat, "c2", "classify", &[&TIMEOUTS[..], &["vars_prefix=\"flow.in\"", "max_flows=50"]].concat()),
        k_out,
        k_in,
        link("c[tcp] -> fw"),
        link("c[udp] -> fw"),
        link("c[icmp] -> fw"),
        link("c[other] -> fw"),
        link("fw -> n[inside]"),
        link("n[to_outside] -> k_out"),
        link("fw2 -> n[outside]"),
        link("n[to_inside] -> c2"),
        link("c2[tcp] -> k_in"),
        link("c2[udp] -> k_in"),
        link("c2[icmp] -> k_in"),
        link("c2[other] -> k_in"),
    ])
    .expect("stack");
    // A NAT alone, to check that valid packets stay valid.
    let mut solo = Switch::default();
    let (so, solo_out) = keep("so");
    let (si, solo_in) = keep("si");
    solo.apply(vec![load(&cat, "n", "nat", &args), so, si, link("n[to_outside] -> so"), link("n[to_inside] -> si")])
        .expect("solo");

    let s = target_seed(seed_from_env(DEFAULT_SEED), "packets");
    let mut rng = Rng::new(s);
    let mut now = 0u64;
    let mut injected = 0u64;
    let (mut sent, mut received): (Vec<Vec<u8>>, Vec<Vec<u8>>) = (Vec::new(), Vec::new());
    for i in 0..iters_from_env(DEFAULT_ITERS) {
        let n = 1 + rng.below(8);
        let mut up: Batch = Vec::new();
        let mut down: Batch = Vec::new();
        let mut shown = Vec::new();
        for _ in 0..n {
            let (mut p, from_inside) = packet(&mut rng, 0, &sent, &received);
            let valid = !rng.one_in(3);
            if !valid {
                damage(&mut rng, &mut p);
            }
            shown.push(p.clone());
            let result = catch_unwind(AssertUnwindSafe(|| {
                if !valid {
                    return Ok(());
                }
                let (port, log) = if from_inside { ("inside", &solo_out) } else { ("outside", &solo_in) };
                let mut b: Batch = vec![Frame::Data(solo.pool().alloc_from(&p))];
                solo.inject("n", port, &mut b).expect("inject");
                solo.run(Time(now));
                let out = std::mem::take(&mut *log.lock().expect("log"));
                match out.as_slice() {
                    [] => Ok(()), // dropped (ports exhausted): counted, checked below
                    [o] if checksums_ok(o) => Ok(()),
                    _ => Err(format!("valid packet came out of NAT {out:02x?}")),
                }
            }));
            match result {
                Ok(Ok(())) => {}
                Ok(Err(e)) => panic!("packets seed {s:#x} iteration {i}: {e}\n  input {p:02x?}"),
                Err(_) => panic!("packets seed {s:#x} iteration {i}: panic in the solo NAT\n  input {p:02x?}"),
            }
            let mut pk = sw.pool().alloc_from(&p);
            pk.set_direction(if from_inside { Direction::Down } else { Direction::Up });
            let batch = if from_inside { &mut down } else { &mut up };
            batch.push(Frame::Data(pk));
        }
        injected += n as u64;
        now += rng.below(700) as u64 * 1_000_000;
        let result = catch_unwind(AssertUnwindSafe(|| {
            sw.inject("c", "in", &mut down).expect("inject");
            sw.inject("fw2", "in", &mut up).expect("inject");
            sw.run(Time(now));
        }));
        if result.is_err() {
            panic!("packets seed {s:#x} iteration {i}: panic\n  inputs {shown:02x?}");
        }
        for (log, recent) in [(&sent_log, &mut sent), (&received_log, &mut received)] {
            recent.extend(std::mem::take(&mut *log.lock().expect("log")));
            let extra = recent.len().saturating_sub(32);
            recent.drain(..extra);
        }
    }
    // Longer than every timeout (other protocols: 30 s).
    sw.run(Time(now + 60_000_000_000));
    for m in ["c", "fw", "n", "fw2", "c2"] {
        let get = |v: &str| u64_var(&sw, &format!("module.{m}.{v}"));
        let (fin, fout, dropped) = (get("frames_in_total"), get("frames_out_total"), get("frames_dropped_total"));
        assert_eq!(fin, fout + dropped, "{m}: {fin} in, {fout} out, {dropped} dropped");
        assert_eq!(get("held_frames"), 0, "{m}");
    }
    let g = |v: &str| u64_var(&sw, &format!("module.n.{v}"));
    let nat_drops: u64 = sw
        .registry()
        .snapshot()
        .matching("module.n.drop_*_total")
        .map(|(_, c)| match c.get() {
            Value::U64(v) => v,
            _ => 0,
        })
        .sum();
    assert_eq!(g("translated_total") + g("untranslated_total") + nat_drops, g("frames_in_total"));
    assert_eq!(u64_var(&sw, "module.c.frames_in_total") + u64_var(&sw, "module.fw2.frames_in_total"), injected);
    // After a long quiet time every flow and binding has expired.
    assert_eq!(g("bindings_active"), 0);
    assert_eq!(u64_var(&sw, "module.c.flows_active"), 0);
    assert_eq!(u64_var(&sw, "module.c2.flows_active"), 0);
    assert!(sw.registry().snapshot().matching("flow.**").next().is_none());
    assert!(g("translated_total") > 0 && g("icmp_errors_translated_total") > 0, "the fuzzer reaches translation");
    eprintln!(
        "packets: {injected} injected, {} translated, {} ICMP errors translated, {} untranslated",
        g("translated_total"),
        g("icmp_errors_translated_total"),
        g("untranslated_total")
    );
    let fw = |v: &str| u64_var(&sw, &format!("module.fw.{v}"));
    assert!(fw("drop_rule_total") > 0 && fw("accepted_total") > 0);
}
