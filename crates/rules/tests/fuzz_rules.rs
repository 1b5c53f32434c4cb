//! Fuzz target `rules`: the rule language's parser, checker and engine on mutated rule texts, with the shared
//! deterministic engine of `flexstack-fuzzkit` (see fuzz/README.md for the variables it reads:
//! `FLEXSTACK_FUZZ_SEED`, `FLEXSTACK_FUZZ_ITERS`).
//!
//! Seeds: `fuzz/corpus/rules/`. For every input, besides "no panic":
//! - every diagnostic lies inside the text (line 1..=lines+1, column >= 1) and is one line;
//! - a text that checks renders back (each defined rule's definition, triggers and actions) to a text that checks
//!   again and gives the same unit trees;
//! - loading it into an engine and advancing the clock a few times neither panics nor hangs, and
//!   every knob write names a variable without `*`.

use flexstack_core::{Time, Value};
use flexstack_fuzzkit::{
    iters_from_env, load_corpus_bytes, mutate, run_guarded, seed_from_env, target_seed, Dict, Rng,
};
use flexstack_rules::{compile, render_rules, syntax, MemoryEnv, Program, RuleEngine};
use std::time::{Duration, Instant};

const DEFAULT_ITERS: usize = 8_000;
const DEFAULT_SEED: u64 = 0x5eed_f1e5_57ac_0001;
const SLOW: Duration = Duration::from_secs(2);

const DICT: Dict<'static> = Dict {
    tokens: &[
        "->",
        ":",
        "(",
        ")",
        ",",
        "\n",
        "[manual]\n",
        "[contextEnter]\n",
        "[contextExit]\n",
        "get(\"",
        "set(\"",
        "\"flow.*.rtt\"",
        "\"module.src.rate\"",
        "History(",
        "Avg(",
        "Timer(",
        "Threshold(",
        "If(",
        "Cache(",
        "EWMA(",
        "load(",
        "unload(ALL)",
        "replace(",
        "*",
        "5s",
        "200ms",
        "0",
        "-1",
        "1e99",
        "\"",
        "#",
        "//",
        "\\",
        "😀",
        "\t",
        "ALL",
        "true",
    ],
    bytes: b"\n\"()-:,*#[]",
    words: &[],
    patches: &[],
    numbers: &["0", "-1", "18446744073709551616", "99999999999", "0.0001", "65537"],
    runs: &[8, 300],
    run_bytes: b"(",
    head: 0,
    max_len: 16 * 1024,
};

fn env() -> MemoryEnv {
    let mut env = MemoryEnv::new();
    env.meter("iface.wlan0.rssi", Value::U64(50))
        .meter("module.src.rate", Value::F64(3.0))
        .meter("flow.a.loss", Value::F64(0.05))
        .meter("flow.a.rtt", Value::U64(20))
        .meter("app.switchCwnd.loadOpt", Value::Bool(true))
        .meter("app.switchCwnd.packetLossRate", Value::F64(5.0))
        .knob("flow.a.cc", Value::Str("cubic".into()))
        .knob("module.sel.select", Value::I64(0));
    env
}

fn check(text: &str) -> Result<(), String> {
    let lines = text.split('\n').count() as u32;
    let (_, diags) = syntax::parse(text);
    let env = env();
    let all = match compile("fuzz", text, &Program::default(), &env) {
        Ok(c) => {
            // Round trip through the rendered rules.
            let rendered = render_rules(c.defined.iter().map(|n| &c.program.rules[n]));
            let again = compile("fuzz", &rendered, &Program::default(), &env)
                .map_err(|d| format!("rendered text does not check: {d:?}\n{rendered}"))?;
            for n in &c.defined {
                if again.program.rules[n].node != c.program.rules[n].node {
                    return Err(format!("rule {n} renders to a different tree: {rendered}"));
                }
            }
            let mut engine = RuleEngine::new();
            let mut env = env.clone();
            engine
                .handle_load_text("fuzz", text, Time::ZERO, &env)
                .map_err(|e| format!("checked text refused: {e}"))?;
            for t in [1u64, 50, 1000] {
                env.meter("module.src.rate", Value::F64(t as f64));
                let step = flexstack_rules::drive(&mut engine, &mut env, Time::from_millis(t));
                if let Some(w) = step.writes.iter().find(|w| w.name.contains('*')) {
                    return Err(format!("write to an unbound name {}", w.name));
                }
            }
            c.warnings
        }
        Err(d) => d,
    };
    for d in diags.iter().chain(&all) {
        if d.span.line < 1 || d.span.line > lines + 1 || d.span.column < 1 || d.message.contains('\n') {
            return Err(format!("diagnostic out of place or multi-line: {d}"));
        }
    }
    Ok(())
}

#[test]
fn fuzz_rules() {
    let corpus = load_corpus_bytes("rules", 8);
    let seed = target_seed(seed_from_env(DEFAULT_SEED), "rules");
    for (i, s) in corpus.iter().enumerate() {
        run_guarded("rules", seed, i, s, || check(&String::from_utf8_lossy(s)));
    }
    let mut rng = Rng::new(seed);
    for i in 0..iters_from_env(DEFAULT_ITERS) {
        let input = mutate(&mut rng, &corpus, &DICT);
        let started = Instant::now();
        run_guarded("rules", seed, i, &input, || check(&String::from_utf8_lossy(&input)));
        assert!(started.elapsed() < SLOW, "slow input at iteration {i}: {:?}", String::from_utf8_lossy(&input));
    }
}
