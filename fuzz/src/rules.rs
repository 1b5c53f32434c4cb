//! The check of the rule language (`flexstack_rules`: parser, checker, rendering, engine), shared by the stable-Rust
//! fuzz test `crates/rules/tests/fuzz_rules.rs` (which includes this file) and the libFuzzer target `rules`.

use flexstack_core::{Time, Value};
use flexstack_rules::{compile, render_rules, syntax, MemoryEnv, Program, RuleEngine};

/// The variables the rules are checked against.
pub fn env() -> MemoryEnv {
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

/// One rule text: diagnostics located inside it and one line each; a text that checks renders back to a text that
/// checks to the same trees, loads into an engine, and its knob writes name variables without `*` as the clock
/// advances.
pub fn check(text: &str) -> Result<(), String> {
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
