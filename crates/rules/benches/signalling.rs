//! Benchmark of rule signalling (issue 6): the cost of one unit hop by query and by event, on chains of 1, 10,
//! 100 and 1000 `Forwarder` units, against a plain function call per hop, in the same run (the paper's Figure
//! 7(a): 2.1x for query, 2.8x for event; our target is <= 1.5x).
//!
//! Run: `cargo bench -p flexstack-rules --bench signalling` (or `scripts/bench-rules.sh`).
//!
//! What is measured, per chain length N, as nanoseconds per traversal of the whole chain (wall clock, one thread):
//! - **query(N)**: rules `f1: Forwarder(get("bench.x"))`, `fI: Forwarder(fI-1)` up to fN, and a trigger
//!   `t -> fN` (so the chain is pulled). One traversal is `RuleEngine::evaluate("fN")`: a query of fN that reaches
//!   f1's get (reading the environment) and evaluates N forwarders on the way back. The meter changes before every
//!   traversal, so every hop forwards a new value.
//! - **event(N)**: the same chain without the trigger (so it is pushed). One traversal is
//!   `RuleEngine::handle_meter_changed("bench.x", new value)`: the get emits, f1 is evaluated and emits, ... up
//!   to fN.
//! - **call(N)**: a reference: N stages in one `Vec<Forward>`, each `forward(&mut self, v: Value) -> Value`
//!   (never inlined) storing the value as its output and returning a copy (what a Forwarder does), called in a
//!   loop with a new value per traversal: one plain function call per hop, the value passed along by value.
//! - **callref(N)**: the other reference: N outputs in one `Vec<Option<Value>>`; hop k is one never-inlined
//!   `forward_from(out: &mut Option<Value>, input: &Option<Value>)` that stores a copy of output k-1 as output
//!   k, which is what a Forwarder unit does (read its input's output, keep a copy as its own).
//! - **callcopy(N)**: as callref, but the call copies with the engine's own copy of an output
//!   ([`flexstack_rules::units::assign`]: the scalars copied inline, a string's buffer reused) instead of
//!   `clone_from`, so that the reference does not lose to the engine by copying a value less cleverly.
//!   All three references are real calls per hop (one `call` instruction per stage in the loop, checked with
//!   objdump) and `black_box` keeps the outputs live, so the chain cannot fold into a constant. The ratios use
//!   the cheapest of the three per hop (the hardest reference).
//!
//! **Per hop** is `cost(N) / N`, as the paper plots it; **marginal per hop** is `(cost(1000) - cost(1)) / 999`,
//! which leaves out the fixed cost of a traversal (the environment read, starting a wave). The ratios are
//! engine per hop / per hop of the cheapest reference. Each configuration runs for 10 slices of 20 ms per round,
//! in 5 rounds; within a round the slices of all configurations are interleaved; every figure is the median
//! over rounds.

use flexstack_core::{Time, Value};
use flexstack_rules::units::assign;
use flexstack_rules::{MemoryEnv, RuleEngine};
use std::hint::black_box;
use std::time::{Duration, Instant};

const HOPS: [usize; 4] = [1, 10, 100, 1000];
const ROUNDS: usize = 5;
const SLICES: usize = 10;
const SLICE: Duration = Duration::from_millis(20);
const TARGET: f64 = 1.5;

fn chain(n: usize, pulled: bool) -> String {
    flexstack_rules::testing::forwarder_chain("f", "bench.x", n, pulled)
}

struct Forward {
    out: Option<Value>,
}

impl Forward {
    #[inline(never)]
    fn forward(&mut self, v: Value) -> Value {
        self.out = Some(v.clone());
        v
    }
}

/// Hop k of `callref`: output k becomes a copy of output k - 1.
#[inline(never)]
fn forward_from(out: &mut Option<Value>, input: &Option<Value>) {
    out.clone_from(input);
}

/// Hop k of `callcopy`: output k becomes a copy of output k - 1, copied as the engine copies an output.
#[inline(never)]
fn forward_copy(out: &mut Option<Value>, input: &Option<Value>) {
    assign(out, input);
}

/// One configuration: runs `traverse` repeatedly for a slice and returns ns per traversal.
trait Config {
    fn traverse(&mut self, k: u64);
}

struct Query {
    engine: RuleEngine,
    env: MemoryEnv,
    top: String,
}

impl Config for Query {
    fn traverse(&mut self, k: u64) {
        self.env.meter("bench.x", Value::U64(k));
        let v = self.engine.evaluate(&self.top, Time(k), &self.env).expect("loaded");
        black_box(v);
    }
}

struct Event {
    engine: RuleEngine,
    env: MemoryEnv,
}

impl Config for Event {
    fn traverse(&mut self, k: u64) {
        self.engine.handle_meter_changed("bench.x", Value::U64(k), Time(k), &self.env);
    }
}

struct Call {
    stages: Vec<Forward>,
}

/// `callref` (hop = `forward_from`) and `callcopy` (hop = `forward_copy`): the hop is a function item type, so
/// each call is a direct call of that never-inlined function.
struct CallRef<F: Fn(&mut Option<Value>, &Option<Value>)> {
    outs: Vec<Option<Value>>,
    hop: F,
}

impl<F: Fn(&mut Option<Value>, &Option<Value>)> Config for CallRef<F> {
    fn traverse(&mut self, k: u64) {
        self.outs[0] = Some(Value::U64(k));
        for i in 1..self.outs.len() {
            let (done, rest) = self.outs.split_at_mut(i);
            (self.hop)(&mut rest[0], &done[i - 1]);
        }
        black_box(&self.outs);
    }
}

impl Config for Call {
    fn traverse(&mut self, k: u64) {
        let mut v = Value::U64(k);
        for s in self.stages.iter_mut() {
            v = s.forward(v);
        }
        black_box(v);
        black_box(&self.stages);
    }
}

fn slice(c: &mut dyn Config, k: &mut u64) -> (u64, Duration) {
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < SLICE {
        for _ in 0..16 {
            *k += 1;
            c.traverse(*k);
        }
        n += 16;
    }
    (n, start.elapsed())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// `--profile KIND N TRAVERSALS`: runs one configuration a fixed number of times and nothing else, for
/// `valgrind --tool=callgrind` (instruction counts are repeatable on a loaded machine, wall-clock medians are not).
fn profile(args: &[String]) {
    let kind = args.first().map(String::as_str).unwrap_or("event");
    let n: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(1000);
    let traversals: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1000);
    let mut configs = build(&[n]);
    let (_, _, c) =
        configs.iter_mut().find(|(k, _, _)| k == kind).expect("kind is query, event, call, callref or callcopy");
    for k in 1..=traversals {
        c.traverse(k);
    }
    println!("{kind}({n}): {traversals} traversals done");
}

/// The five configurations for each chain length.
fn build(hops: &[usize]) -> Vec<(String, usize, Box<dyn Config>)> {
    let mut configs: Vec<(String, usize, Box<dyn Config>)> = Vec::new();
    for &n in hops {
        let mut env = MemoryEnv::new();
        env.meter("bench.x", Value::U64(0));
        let mut q = RuleEngine::new();
        q.handle_load_text("query", &chain(n, true), Time::ZERO, &env).expect("query chain loads");
        let mut e = RuleEngine::new();
        e.handle_load_text("event", &chain(n, false), Time::ZERO, &env).expect("event chain loads");
        assert_eq!(q.unit_count(), n + 2, "n forwarders, a get and a timer");
        configs.push(("query".into(), n, Box::new(Query { engine: q, env: env.clone(), top: format!("f{n}") })));
        configs.push(("event".into(), n, Box::new(Event { engine: e, env })));
        let stages: Vec<Forward> = (0..n).map(|_| Forward { out: None }).collect();
        configs.push(("call".into(), n, Box::new(Call { stages })));
        // Output 0 is the source (the meter), outputs 1..=n the n hops.
        configs.push(("callref".into(), n, Box::new(CallRef { outs: vec![None; n + 1], hop: forward_from })));
        configs.push(("callcopy".into(), n, Box::new(CallRef { outs: vec![None; n + 1], hop: forward_copy })));
    }
    configs
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(p) = args.iter().position(|a| a == "--profile") {
        return profile(&args[p + 1..]);
    }
    // `cargo bench` passes --bench; `cargo test --benches` runs this with no argument: one quick round then.
    let quick = !std::env::args().any(|a| a == "--bench");
    let (rounds, slices) = if quick { (1, 1) } else { (ROUNDS, SLICES) };
    let mut configs = build(&HOPS);
    // Check that the chains really forward: after a traversal the top holds the new value, by event and by
    // query, and every unit of the chain holds it.
    {
        let mut env = MemoryEnv::new();
        env.meter("bench.x", Value::U64(0));
        let mut e = RuleEngine::new();
        e.handle_load_text("check", &chain(100, false), Time::ZERO, &env).unwrap();
        env.meter("bench.x", Value::U64(42));
        e.handle_meter_changed("bench.x", Value::U64(42), Time(1), &env);
        assert!((1..=100).all(|i| e.value(&format!("f{i}"), &[]) == Some(Value::U64(42))));
        let mut q = RuleEngine::new();
        q.handle_load_text("check", &chain(100, true), Time::ZERO, &env).unwrap();
        env.meter("bench.x", Value::U64(43));
        assert_eq!(q.evaluate("f100", Time(1), &env), Ok(Some(Value::U64(43))));
        assert!((1..=100).all(|i| q.value(&format!("f{i}"), &[]) == Some(Value::U64(43))));
    }
    let mut per_round: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let mut k = 0u64;
    for _ in 0..rounds {
        let mut totals = vec![(0u64, Duration::ZERO); configs.len()];
        for _ in 0..slices {
            for (i, (_, _, c)) in configs.iter_mut().enumerate() {
                let (n, d) = slice(c.as_mut(), &mut k);
                totals[i].0 += n;
                totals[i].1 += d;
            }
        }
        for (i, (n, d)) in totals.iter().enumerate() {
            per_round[i].push(d.as_nanos() as f64 / *n as f64);
        }
    }
    let cost = |kind: &str, n: usize| {
        let i = configs.iter().position(|(k, h, _)| k == kind && *h == n).expect("configured");
        median(per_round[i].clone())
    };
    println!("rule signalling benchmark: ns per traversal of a chain of N Forwarder units (median of {rounds} rounds)");
    println!(
        "{:>6} {:>9} {:>9} {:>9} {:>9} {:>9} | {:>9} {:>9} {:>9} {:>9} {:>9} | {:>7} {:>7}",
        "N",
        "query",
        "event",
        "call",
        "callref",
        "callcopy",
        "query/hop",
        "event/hop",
        "call/hop",
        "cref/hop",
        "ccopy/hop",
        "q ratio",
        "e ratio"
    );
    for &n in &HOPS {
        let (q, e) = (cost("query", n), cost("event", n));
        let (c, r, y) = (cost("call", n), cost("callref", n), cost("callcopy", n));
        let h = n as f64;
        let reference = c.min(r).min(y);
        println!(
            "{n:>6} {q:>9.1} {e:>9.1} {c:>9.1} {r:>9.1} {y:>9.1} | {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} | {:>7.2} {:>7.2}",
            q / h,
            e / h,
            c / h,
            r / h,
            y / h,
            q / reference,
            e / reference
        );
    }
    let slope = |kind: &str| (cost(kind, 1000) - cost(kind, 1)) / 999.0;
    let (q, e, c, r, y) = (slope("query"), slope("event"), slope("call"), slope("callref"), slope("callcopy"));
    let reference = c.min(r).min(y);
    println!(
        "marginal per hop (N 1 -> 1000): query {q:.2} ns, event {e:.2} ns, call {c:.2} ns, callref {r:.2} ns, \
         callcopy {y:.2} ns; ratios to the cheapest reference: query {:.2}, event {:.2} (target <= {TARGET})",
        q / reference,
        e / reference
    );
}
