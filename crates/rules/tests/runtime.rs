//! Runtime behaviour on a simulated clock: load, unload and replace while values flow, state kept across
//! rewiring, reference counting, per-name instances, query caches, write results, the repository.

use flexstack_core::{Time, Value};
use flexstack_rules::testing::forwarder_chain;
use flexstack_rules::{drive, Environment, MemoryEnv, RuleEngine, RuleError};

fn ms(t: u64) -> Time {
    Time::from_millis(t)
}

fn samples(engine: &RuleEngine, rule: &str, unit: usize) -> serde_json::Value {
    let view = engine.show(rule).expect("defined");
    serde_json::to_value(&view).unwrap()["instances"][0]["units"][unit]["state"]["samples"].clone()
}

fn f(x: f64) -> Option<Value> {
    Some(Value::F64(x))
}

/// A meter that changes every step, feeding a History shared by two rules.
fn setup() -> (MemoryEnv, RuleEngine) {
    let mut env = MemoryEnv::new();
    env.meter("module.src.rate", Value::U64(0)).knob("module.sel.select", Value::I64(0));
    let engine = RuleEngine::new();
    (env, engine)
}

const BASE: &str = r#"
h: History(get("module.src.rate"), 4)
a: Avg(h)
b: Max(h)
"#;

#[test]
fn load_unload_replace_while_values_flow() {
    let (mut env, mut engine) = setup();
    engine.handle_load_text("base", BASE, ms(0), &env).unwrap();
    engine
        .handle_load_text("sel", "hot: Greater(a, 15)\npick: set(\"module.sel.select\", If(hot, 1, 0))", ms(0), &env)
        .unwrap();
    let mut selected = Vec::new();
    for (i, rate) in [10u64, 20, 30, 40, 50, 60].iter().enumerate() {
        env.meter("module.src.rate", Value::U64(*rate));
        drive(&mut engine, &mut env, ms(10 * (i as u64 + 1)));
        selected.push(env.get("module.sel.select"));
        if i == 1 {
            // Rewire `hot` to the maximum while samples keep coming: h keeps its window.
            engine.handle_load_text("sel2", "hot: Greater(b, 45)", ms(25), &env).unwrap();
            assert_eq!(samples(&engine, "h", 0), serde_json::json!([0.0, 10.0, 20.0]));
        }
        if i == 3 {
            engine.handle_unload(&["pick"], ms(45), &env).unwrap();
        }
    }
    // 10: avg(0,10)=5 -> 0; 20: avg 10 -> 0; then hot = max > 45: 30 -> 0, 40 -> 0, (unloaded) 50, 60: unchanged.
    assert_eq!(
        selected,
        vec![
            Some(Value::U64(0)),
            Some(Value::U64(0)),
            Some(Value::U64(0)),
            Some(Value::U64(0)),
            Some(Value::U64(0)),
            Some(Value::U64(0))
        ]
    );
    assert_eq!(engine.value("hot", &[]), Some(Value::Bool(true)), "hot was loaded by itself and stays");
    assert!(!engine.loaded().contains(&"pick".to_string()));
    // Load it again: it evaluates at once with the current window [30, 40, 50, 60].
    engine.handle_load(&["pick"], ms(70), &env).unwrap();
    drive(&mut engine, &mut env, ms(70));
    assert_eq!(env.get("module.sel.select"), Some(Value::U64(1)));
    assert_eq!(engine.value("b", &[]), f(60.0));
}

#[test]
fn rewiring_keeps_state_inline_and_named() {
    let (mut env, mut engine) = setup();
    engine.handle_load_text("t", "w: Avg(History(get(\"module.src.rate\"), 3))", ms(0), &env).unwrap();
    for (i, r) in [3u64, 9, 6].iter().enumerate() {
        env.meter("module.src.rate", Value::U64(*r));
        drive(&mut engine, &mut env, ms(i as u64 + 1));
    }
    assert_eq!(engine.value("w", &[]), f(6.0));
    // Avg -> Min: the History at w/0 is the same unit and keeps [3, 9, 6].
    engine.handle_load_text("t", "w: Min(History(get(\"module.src.rate\"), 3))", ms(5), &env).unwrap();
    assert_eq!(samples(&engine, "w", 1), serde_json::json!([3.0, 9.0, 6.0]));
    assert_eq!(engine.value("w", &[]), f(3.0), "evaluated after the rewiring, over the kept samples");
    // A window change keeps the newest samples.
    engine.handle_load_text("t", "w: Min(History(get(\"module.src.rate\"), 2))", ms(6), &env).unwrap();
    assert_eq!(samples(&engine, "w", 1), serde_json::json!([9.0, 6.0]));
    // A different unit at the place starts fresh.
    engine.handle_load_text("t", "w: Min(EWMA(get(\"module.src.rate\"), 0.5), 2)", ms(7), &env).unwrap();
    assert_eq!(samples(&engine, "w", 0), serde_json::json!([6.0]));
}

#[test]
fn reference_counting_keeps_shared_units() {
    let (mut env, mut engine) = setup();
    engine.handle_load_text("base", BASE, ms(0), &env).unwrap();
    engine.handle_unload(&["h"], ms(0), &env).unwrap();
    let refcount = |e: &RuleEngine| e.show("h").unwrap().instances.first().map(|i| i.refcount);
    assert_eq!(refcount(&engine), Some(2), "a and b use h");
    for r in [5u64, 7] {
        env.meter("module.src.rate", Value::U64(r));
        drive(&mut engine, &mut env, ms(r));
    }
    engine.handle_unload(&["a"], ms(10), &env).unwrap();
    assert_eq!(refcount(&engine), Some(1));
    assert_eq!(samples(&engine, "h", 0), serde_json::json!([0.0, 5.0, 7.0]), "h stays, with its values");
    assert_eq!(engine.handle_unload(&["h"], ms(11), &env), Err(RuleError::NotLoaded("h".into())));
    engine.handle_unload(&["b"], ms(12), &env).unwrap();
    assert_eq!(refcount(&engine), None, "the last user is gone");
    assert_eq!(engine.unit_count(), 0);
    assert_eq!(engine.handle_unload(&["zzz"], ms(13), &env), Err(RuleError::UnknownRule("zzz".into())));
}

#[test]
fn replace_rewires_users_and_keeps_their_state() {
    let (mut env, mut engine) = setup();
    engine.handle_load_text("base", BASE, ms(0), &env).unwrap();
    engine.handle_load_text("alarm", "alarm: Threshold(a, 20, 10)", ms(0), &env).unwrap();
    env.meter("module.src.rate", Value::U64(100));
    drive(&mut engine, &mut env, ms(1)); // avg(0, 100) = 50 -> on
    assert_eq!(engine.value("alarm", &[]), Some(Value::Bool(true)));
    let rev = engine.handle_replace("a", "b", ms(2), &env).unwrap();
    assert_eq!(engine.show("alarm").unwrap().text, vec!["alarm: Threshold(b, 20.0, 10.0)".to_string()]);
    // The Threshold unit kept its "on" state; b = max = 100.
    assert_eq!(engine.value("alarm", &[]), Some(Value::Bool(true)));
    env.meter("module.src.rate", Value::U64(15));
    drive(&mut engine, &mut env, ms(3));
    assert_eq!(engine.value("alarm", &[]), Some(Value::Bool(true)), "inside the band: stays on");
    let diff = engine.diff(rev - 1, rev).unwrap();
    assert!(
        diff.contains(&"- useRule(alarm/0, a)".to_string()) && diff.contains(&"+ useRule(alarm/0, b)".to_string()),
        "{diff:?}"
    );
}

#[test]
fn rollback_restores_an_earlier_revision() {
    let (mut env, mut engine) = setup();
    let r1 = engine.handle_load_text("t", "big: Greater(get(\"module.src.rate\"), 5)", ms(0), &env).unwrap().revision;
    let r2 = engine.handle_load_text("t", "big: Less(get(\"module.src.rate\"), 5)", ms(1), &env).unwrap().revision;
    env.meter("module.src.rate", Value::U64(9));
    drive(&mut engine, &mut env, ms(2));
    assert_eq!(engine.value("big", &[]), Some(Value::Bool(false)));
    let r3 = engine.handle_rollback(r1, ms(3), &env).unwrap();
    assert_eq!(engine.value("big", &[]), Some(Value::Bool(true)), "re-evaluated after the rollback");
    let log = engine.log();
    assert_eq!(log.iter().map(|r| r.number).collect::<Vec<_>>(), vec![r1, r2, r3]);
    assert_eq!(log[2].what, "rollback to 1");
    assert_eq!(engine.diff(r1, r2).unwrap(), vec!["rule big", "- createFU(big, Greater)", "+ createFU(big, Less)"]);
    assert!(engine.diff(r1, r3).unwrap().is_empty());
    assert_eq!(engine.handle_rollback(99, ms(4), &env), Err(RuleError::UnknownRevision(99)));
    assert!(serde_json::to_string(&log).unwrap().contains("\"what\":\"rollback to 1\""));
}

#[test]
fn per_flow_instances_follow_the_flows() {
    let mut env = MemoryEnv::new();
    env.meter("flow.a.loss", Value::F64(0.0)).knob("flow.a.cc", Value::Str("cubic".into()));
    let mut engine = RuleEngine::new();
    let text =
        "lossy: Threshold(get(\"flow.*.loss\"), 0.04, 0.02)\ncc: set(\"flow.*.cc\", If(lossy, \"bbr\", \"cubic\"))";
    let report = engine.handle_load_text("cc", text, ms(0), &env).unwrap();
    assert!(report.warnings.is_empty(), "flow.*.loss matches flow.a.loss: {:?}", report.warnings);
    assert_eq!(engine.loaded(), vec!["cc[a]", "lossy[a]"]);
    // A flow appears: its own copy, bound to its own names.
    env.meter("flow.b.loss", Value::F64(0.1)).knob("flow.b.cc", Value::Str("cubic".into()));
    let step = drive(&mut engine, &mut env, ms(10));
    assert_eq!(engine.loaded(), vec!["cc[a]", "cc[b]", "lossy[a]", "lossy[b]"]);
    assert_eq!(env.get("flow.b.cc"), Some(Value::Str("bbr".into())));
    assert_eq!(env.get("flow.a.cc"), Some(Value::Str("cubic".into())));
    assert!(step.writes.iter().all(|w| w.name != "flow.a.cc" || w.value == Value::Str("cubic".into())));
    assert_eq!(engine.value("lossy", &["b"]), Some(Value::Bool(true)));
    // Flow a ends: its copy goes; b's keeps its state.
    env.remove("flow.a.loss");
    env.remove("flow.a.cc");
    drive(&mut engine, &mut env, ms(20));
    assert_eq!(engine.loaded(), vec!["cc[b]", "lossy[b]"]);
    env.meter("flow.b.loss", Value::F64(0.03)); // inside the band: stays bbr
    drive(&mut engine, &mut env, ms(30));
    assert_eq!(env.get("flow.b.cc"), Some(Value::Str("bbr".into())));
    env.meter("flow.b.loss", Value::F64(0.01));
    drive(&mut engine, &mut env, ms(40));
    assert_eq!(env.get("flow.b.cc"), Some(Value::Str("cubic".into())));
}

#[test]
fn per_flow_names_are_listed_again_only_when_names_changed() {
    // An environment that says when its names may have changed (the daemon's registry does): the per-name rule's
    // driver is listed once while only values move, and again when a flow comes or goes.
    let mut env = MemoryEnv::new();
    env.track_names().meter("flow.a.loss", Value::F64(0.0)).knob("flow.a.cc", Value::Str("cubic".into()));
    let mut engine = RuleEngine::new();
    let text =
        "lossy: Threshold(get(\"flow.*.loss\"), 0.04, 0.02)\ncc: set(\"flow.*.cc\", If(lossy, \"bbr\", \"cubic\"))";
    engine.handle_load_text("cc", text, ms(0), &env).unwrap();
    drive(&mut engine, &mut env, ms(10));
    let listed = env.listings();
    for t in 2..20 {
        env.meter("flow.a.loss", Value::F64(0.001 * t as f64));
        drive(&mut engine, &mut env, ms(10 * t));
    }
    assert_eq!(env.listings(), listed, "values moved, names did not: no listing");
    env.meter("flow.b.loss", Value::F64(0.1)).knob("flow.b.cc", Value::Str("cubic".into()));
    drive(&mut engine, &mut env, ms(300));
    assert!(env.listings() > listed, "a flow came: listed again");
    assert_eq!(engine.loaded(), vec!["cc[a]", "cc[b]", "lossy[a]", "lossy[b]"]);
    assert_eq!(env.get("flow.b.cc"), Some(Value::Str("bbr".into())));
    env.remove("flow.a.loss");
    env.remove("flow.a.cc");
    drive(&mut engine, &mut env, ms(310));
    assert_eq!(engine.loaded(), vec!["cc[b]", "lossy[b]"]);
    // Without a generation every advance lists them, as before.
    let mut plain = MemoryEnv::new();
    plain.meter("flow.a.loss", Value::F64(0.0)).knob("flow.a.cc", Value::Str("cubic".into()));
    let mut engine = RuleEngine::new();
    engine.handle_load_text("cc", text, ms(0), &plain).unwrap();
    let before = plain.listings();
    for t in 1..5 {
        drive(&mut engine, &mut plain, ms(10 * t));
    }
    assert!(plain.listings() >= before + 4, "{} listings after {before}", plain.listings());
}

#[test]
fn query_cache_validity_and_pull_evaluation() {
    let (mut env, mut engine) = setup();
    let text = "c: Cache(get(\"module.src.rate\"), 100ms)\nt: Timer(30ms)\nt -> c";
    engine.handle_load_text("t", text, ms(0), &env).unwrap();
    env.meter("module.src.rate", Value::U64(1));
    drive(&mut engine, &mut env, ms(30));
    assert_eq!(engine.value("c", &[]), Some(Value::U64(1)));
    env.meter("module.src.rate", Value::U64(2));
    drive(&mut engine, &mut env, ms(60));
    drive(&mut engine, &mut env, ms(90));
    assert_eq!(engine.value("c", &[]), Some(Value::U64(1)), "cached for 100 ms");
    drive(&mut engine, &mut env, ms(150));
    assert_eq!(engine.value("c", &[]), Some(Value::U64(2)), "refetched after 100 ms");
    // A pull from outside, as a trigger would.
    env.meter("module.src.rate", Value::U64(3));
    assert_eq!(engine.evaluate("c", ms(151), &env).unwrap(), Some(Value::U64(2)));
    assert_eq!(engine.evaluate("c", ms(260), &env).unwrap(), Some(Value::U64(3)));
    assert_eq!(engine.evaluate("nope", ms(260), &env), Err(RuleError::UnknownRule("nope".into())));
}

#[test]
fn refused_writes_are_reported() {
    let (mut env, mut engine) = setup();
    env.meter("app.x.level", Value::U64(1));
    engine.handle_load_text("t", "w: set(\"app.x.level\", 5)", ms(0), &env).unwrap();
    let step = drive(&mut engine, &mut env, ms(1));
    assert_eq!(step.writes.len(), 1);
    assert_eq!(step.writes[0].unit, "w");
    let notice = engine.poll_notice().expect("a notice");
    assert!(notice.message.contains("refused: app.x.level is a meter"), "{notice:?}");
    let view = serde_json::to_value(engine.show("w").unwrap()).unwrap();
    assert_eq!(view["instances"][0]["units"][0]["state"]["error"], "app.x.level is a meter, not a knob");
}

#[test]
fn refused_texts_change_nothing() {
    let (env, mut engine) = setup();
    engine.handle_load_text("base", BASE, ms(0), &env).unwrap();
    let before = engine.loaded();
    let err = engine.handle_load_text("bad", "x: Avg(h)\ny: Less(x, \"s\")\nz: Nope(1)", ms(1), &env).unwrap_err();
    let RuleError::Invalid(d) = &err else { panic!("{err:?}") };
    assert_eq!(d.len(), 2, "{d:?}");
    assert!(err.to_string().starts_with("2:12: error: type mismatch"), "{err}");
    assert_eq!(engine.loaded(), before);
    assert_eq!(engine.log().len(), 1);
}

#[test]
fn deep_chains_query_and_propagate() {
    // Deeper than the query's recursion limit: the rest of the walk uses an explicit stack.
    let (mut env, mut engine) = setup();
    let pulled = forwarder_chain("f", "module.src.rate", 1500, true);
    let pushed = forwarder_chain("g", "module.src.rate", 1500, false);
    engine.handle_load_text("pulled", &pulled, ms(0), &env).unwrap();
    engine.handle_load_text("pushed", &pushed, ms(0), &env).unwrap();
    env.meter("module.src.rate", Value::U64(77));
    assert_eq!(engine.evaluate("f1500", ms(1), &env).unwrap(), Some(Value::U64(77)));
    assert_eq!(engine.value("f750", &[]), Some(Value::U64(77)));
    engine.handle_meter_changed("module.src.rate", Value::U64(78), ms(2), &env);
    assert_eq!(engine.value("g1500", &[]), Some(Value::U64(78)));
    drive(&mut engine, &mut env, ms(3));
    assert_eq!(engine.value("g1500", &[]), Some(Value::U64(77)), "sampling reads the environment again");
}

#[test]
fn replace_rechecks_cycles_and_wildcards() {
    let mut env = MemoryEnv::new();
    env.meter("flow.a.loss", Value::F64(0.0))
        .meter("module.src.rate", Value::U64(1))
        .knob("module.sel.select", Value::I64(0));
    let mut engine = RuleEngine::new();
    let text = "one: get(\"module.src.rate\")\nper: get(\"flow.*.loss\")\nuse: set(\"module.sel.select\", one)\nb: Forwarder(use)";
    engine.handle_load_text("t", text, ms(0), &env).unwrap();
    let before = engine.loaded();
    let err = engine.handle_replace("one", "b", ms(1), &env);
    assert!(
        matches!(&err, Err(RuleError::Invalid(d)) if d[0].message.starts_with("replace(one, b) is refused: definition cycle")),
        "{err:?}"
    );
    assert_eq!(engine.loaded(), before);
    assert_eq!(engine.log().len(), 1);
    // Using a per-flow rule makes `use` per-flow too: one instance per flow, each writing the same knob.
    engine.handle_replace("one", "per", ms(2), &env).unwrap();
    assert_eq!(engine.loaded(), vec!["b[a]", "per[a]", "use[a]"]);
}
