//! Every unit through the engine, on a simulated clock: a rule over one meter, the meter's values at given
//! times, and the rule's output after each step.

use flexstack_core::{Time, Value};
use flexstack_rules::{drive, units::CATALOG, MemoryEnv, RuleEngine};

const M: &str = "module.m.x";

fn n(x: f64) -> Option<Value> {
    Some(Value::F64(x))
}
fn u(x: u64) -> Option<Value> {
    Some(Value::U64(x))
}
fn b(x: bool) -> Option<Value> {
    Some(Value::Bool(x))
}

/// Loads `r: <expr>` (plus `extra` lines), then for each (ms, meter value) sets the meter, advances, and
/// returns the output of `r`.
fn run(expr: &str, extra: &str, steps: &[(u64, f64)]) -> Vec<Option<Value>> {
    let mut env = MemoryEnv::new();
    env.meter(M, Value::F64(steps.first().map_or(0.0, |s| s.1))).knob("module.m.k", Value::F64(0.0));
    let mut engine = RuleEngine::new();
    engine
        .handle_load_text("t", &format!("r: {expr}\n{extra}"), Time::ZERO, &env)
        .unwrap_or_else(|e| panic!("{expr}: {e}"));
    steps
        .iter()
        .map(|&(ms, v)| {
            env.meter(M, Value::F64(v));
            drive(&mut engine, &mut env, Time::from_millis(ms));
            engine.value("r", &[])
        })
        .collect()
}

const X: &str = "get(\"module.m.x\")";

#[test]
fn sources_and_sinks() {
    assert_eq!(run(X, "", &[(1, 1.0), (2, 3.0)]), vec![n(1.0), n(3.0)]);
    assert_eq!(run("Constant(7)", "", &[(1, 1.0)]), vec![u(7)]);
    assert_eq!(run(&format!("Forwarder({X})"), "", &[(1, 1.0), (2, 2.0)]), vec![n(1.0), n(2.0)]);
    // Timer(50): ticks at 50, 100, ...; one tick per advance however late (no burst of missed ticks).
    assert_eq!(run("Timer(50)", "", &[(10, 0.0), (50, 0.0), (120, 0.0), (400, 0.0)]), vec![u(0), u(1), u(2), u(3)]);
    // set writes when its value changes (pushed rule) and outputs what it wrote.
    let mut env = MemoryEnv::new();
    env.meter(M, Value::F64(1.0)).knob("module.m.k", Value::F64(0.0));
    let mut engine = RuleEngine::new();
    engine.handle_load_text("t", &format!("r: set(\"module.m.k\", {X})"), Time::ZERO, &env).unwrap();
    let writes: Vec<usize> = [1.0, 1.0, 2.0]
        .iter()
        .enumerate()
        .map(|(i, v)| {
            env.meter(M, Value::F64(*v));
            drive(&mut engine, &mut env, Time::from_millis(i as u64 + 1)).writes.len()
        })
        .collect();
    assert_eq!(writes, vec![1, 0, 1]);
    assert_eq!(env.written.last(), Some(&("module.m.k".to_string(), Value::F64(2.0))));
}

#[test]
fn windows() {
    let s = [(1, 4.0), (2, 2.0), (3, 9.0), (4, 1.0)];
    assert_eq!(run(&format!("History({X}, 2)"), "", &s), vec![n(4.0), n(2.0), n(9.0), n(1.0)]);
    assert_eq!(run(&format!("Avg(History({X}, 2))"), "", &s), vec![n(4.0), n(3.0), n(5.5), n(5.0)]);
    assert_eq!(run(&format!("Min({X}, 3)"), "", &s), vec![n(4.0), n(2.0), n(2.0), n(1.0)]);
    assert_eq!(run(&format!("Max({X}, 3)"), "", &s), vec![n(4.0), n(4.0), n(9.0), n(9.0)]);
    assert_eq!(run(&format!("Sum({X}, 2)"), "", &s), vec![n(4.0), n(6.0), n(11.0), n(10.0)]);
    // A 2 ms time window. Pushed rules sample on change: at load (t=0, 4.0), then t=2, 3, 4 (t=1 is no change);
    // at t=3 the sample of t=0 is older than 2 ms.
    assert_eq!(run(&format!("Count({X}, 2ms)"), "", &s), vec![u(1), u(2), u(2), u(3)]);
    // Aggregates over a named History rule read its window.
    assert_eq!(run("Max(h)", &format!("h: History({X}, 2)"), &s), vec![n(4.0), n(4.0), n(9.0), n(9.0)]);
}

#[test]
fn rates_and_averages() {
    // Rate is per second: +10 over 500 ms = 20/s.
    assert_eq!(run(&format!("Rate({X})"), "", &[(0, 0.0), (500, 10.0), (1500, 40.0)]), vec![None, n(20.0), n(30.0)]);
    assert_eq!(run(&format!("Derivative({X})"), "", &[(0, 0.0), (1000, 5.0)]), vec![None, n(5.0)]);
    // Pulled every millisecond by a timer, so repeated values count too.
    let tick = "t: Timer(1)\nt -> r";
    assert_eq!(run(&format!("EWMA({X}, 0.25)"), tick, &[(1, 8.0), (2, 0.0), (3, 0.0)]), vec![n(8.0), n(6.0), n(4.5)]);
    // Pushed: evaluated only when the meter changes, so a repeated 0 is not a new sample.
    assert_eq!(run(&format!("EWMA({X}, 0.25)"), "", &[(1, 8.0), (2, 0.0), (3, 0.0)]), vec![n(8.0), n(6.0), n(6.0)]);
}

#[test]
fn comparisons_and_logic() {
    let s = [(1, 1.0), (2, 5.0), (3, 3.0)];
    assert_eq!(run(&format!("Less({X}, 3)"), "", &s), vec![b(true), b(false), b(false)]);
    assert_eq!(run(&format!("Greater({X}, 3)"), "", &s), vec![b(false), b(true), b(false)]);
    assert_eq!(run(&format!("Equal({X}, 3)"), "", &s), vec![b(false), b(false), b(true)]);
    assert_eq!(run(&format!("Not(Less({X}, 3))"), "", &s), vec![b(false), b(true), b(true)]);
    assert_eq!(run(&format!("And(Greater({X}, 0), Less({X}, 4))"), "", &s), vec![b(true), b(false), b(true)]);
    assert_eq!(run(&format!("Or(Less({X}, 2), Greater({X}, 4), false)"), "", &s), vec![b(true), b(true), b(false)]);
    let strs: Vec<Option<Value>> = ["low", "high", "low"].iter().map(|s| Some(Value::Str(s.to_string()))).collect();
    assert_eq!(run(&format!("If(Greater({X}, 4), \"high\", \"low\")"), "", &s), strs);
    assert_eq!(
        run(&format!("Threshold({X}, 4, 2)"), "", &[(1, 3.0), (2, 5.0), (3, 3.0), (4, 1.0), (5, 3.0)]),
        vec![b(false), b(true), b(true), b(false), b(false)]
    );
    let tick = "t: Timer(1)\nt -> r";
    assert_eq!(run(&format!("Changed({X})"), tick, &[(1, 1.0), (2, 2.0), (3, 2.0)]), vec![b(false), b(true), b(false)]);
}

#[test]
fn cache_and_triggers() {
    // A pulled rule with a cache: re-read only once the validity has passed.
    let steps = [(10, 1.0), (20, 2.0), (30, 3.0), (40, 4.0)];
    assert_eq!(run(&format!("Cache({X}, 25)"), "t: Timer(10)\nt -> r", &steps), vec![n(1.0), n(1.0), n(1.0), n(4.0)]);
    // A trigger fires its target on each true event of the source only.
    let out = run(
        "Count(Constant(1), 100)",
        &format!("hi: Greater({X}, 2)\nhi -> r"),
        &[(1, 3.0), (2, 4.0), (3, 1.0), (4, 5.0)],
    );
    assert_eq!(out, vec![u(1), u(1), u(1), u(2)]);
}

#[test]
fn every_catalogued_unit_is_exercised_here() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/units.rs")).unwrap();
    for unit in CATALOG {
        assert!(text.contains(&format!("{}(", unit.name)), "no test of {}", unit.name);
    }
}
