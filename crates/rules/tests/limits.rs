//! The engine's bounds (issue 18, item 6): caps on instances and memory, refused instantiations counted, definitions
//! deleted, the repository trimmed.

use flexstack_core::{Time, Value};
use flexstack_rules::{drive, Cap, Environment, Limits, MemoryEnv, RuleEngine, RuleError};

fn ms(t: u64) -> Time {
    Time::from_millis(t)
}

/// `n` flows with a loss meter and a cc knob.
fn flows(env: &mut MemoryEnv, names: impl IntoIterator<Item = String>) {
    for f in names {
        env.meter(&format!("flow.{f}.loss"), Value::F64(0.0)).knob(&format!("flow.{f}.cc"), Value::Str("cubic".into()));
    }
}

/// `rules` per-name rules over every flow's loss.
fn wildcard_rules(rules: usize) -> String {
    (0..rules).map(|i| format!("r{i}: Greater(get(\"flow.*.loss\"), {i})\n")).collect()
}

fn limits(max_instances: usize) -> Limits {
    Limits { max_instances, ..Limits::DEFAULT }
}

#[test]
fn a_load_over_the_instance_cap_is_refused_whole() {
    let mut env = MemoryEnv::new();
    flows(&mut env, (0..10).map(|i| format!("f{i}")));
    let mut e = RuleEngine::with_limits(limits(50));
    let err = e.handle_load_text("many.rules", &wildcard_rules(6), ms(0), &env).unwrap_err();
    assert_eq!(err, RuleError::Limit { what: "load many.rules".into(), cap: Cap::Instances, wanted: 60, limit: 50 });
    assert_eq!(
        err.to_string(),
        "load many.rules refused: it would run 60 rule instances, more than the cap of 50 (max_instances)"
    );
    // Nothing changed: no definition, no revision, nothing running.
    assert!(e.list().is_empty());
    assert!(e.log().is_empty());
    assert_eq!(e.usage().instances, 0);
    // Within the cap it loads.
    e.handle_load_text("some.rules", &wildcard_rules(5), ms(1), &env).unwrap();
    assert_eq!(e.usage().instances, 50);
    // Loading one more rule, by name or by text, is refused the same way.
    e.handle_load_text("more.rules", "[manual]\nx: Less(get(\"flow.*.loss\"), 1)", ms(2), &env).unwrap();
    let err = e.handle_load(&["x"], ms(3), &env).unwrap_err();
    assert!(matches!(err, RuleError::Limit { cap: Cap::Instances, wanted: 60, limit: 50, .. }), "{err}");
    assert_eq!(e.usage().instances, 50);
}

#[test]
fn the_memory_cap_refuses_rules_whose_windows_would_not_fit() {
    let mut env = MemoryEnv::new();
    flows(&mut env, (0..4).map(|i| format!("f{i}")));
    let mut e = RuleEngine::with_limits(Limits { max_memory_bytes: 4 << 20, ..Limits::DEFAULT });
    // 4 flows x 8 rules x a window of 65,536 samples of 16 bytes: 32 MiB at most.
    let text: String = (0..8).map(|i| format!("h{i}: History(get(\"flow.*.loss\"), 65536)\n")).collect();
    let err = e.handle_load_text("big.rules", &text, ms(0), &env).unwrap_err();
    let RuleError::Limit { cap: Cap::Memory, wanted, limit, .. } = &err else { panic!("{err}") };
    assert!(*wanted > 32 << 20 && *limit == 4 << 20, "{err}");
    assert!(err.to_string().contains("more than the cap of 4.0 MiB (max_memory_bytes)"), "{err}");
    assert!(e.list().is_empty());
    // Small windows fit, and the estimate says what they take.
    e.handle_load_text("small.rules", "h: History(get(\"flow.*.loss\"), 10)", ms(1), &env).unwrap();
    let used = e.usage().memory_bytes;
    assert!(used > 0 && used < 64 << 10, "{used}");
}

#[test]
fn names_that_appear_beyond_the_cap_are_refused_counted_and_created_when_room_comes() {
    let mut env = MemoryEnv::new();
    flows(&mut env, ["b".to_string(), "c".to_string()]);
    let mut e = RuleEngine::with_limits(limits(3));
    let text =
        "lossy: Threshold(get(\"flow.*.loss\"), 0.04, 0.02)\ncc: set(\"flow.*.cc\", If(lossy, \"bbr\", \"cubic\"))";
    // cc and lossy for b and c: 4 instances, over a cap of 3 when loaded ...
    let err = e.handle_load_text("cc.rules", text, ms(0), &env).unwrap_err();
    assert!(matches!(err, RuleError::Limit { wanted: 4, limit: 3, .. }), "{err}");
    let mut e = RuleEngine::with_limits(limits(4));
    e.handle_load_text("cc.rules", text, ms(0), &env).unwrap();
    env.meter("flow.b.loss", Value::F64(0.5));
    drive(&mut e, &mut env, ms(1));
    assert_eq!(env.get("flow.b.cc"), Some(Value::Str("bbr".into())));
    while e.poll_notice().is_some() {}
    // ... and a flow that appears later, sorting first, is not instantiated: b and c keep running, with their state.
    flows(&mut env, ["a".to_string()]);
    for t in 2..10 {
        drive(&mut e, &mut env, ms(t));
    }
    assert_eq!(e.usage().instances, 4);
    assert_eq!(e.usage().refused_instances_total, 2, "cc[a] and lossy[a], once each, not at every advance");
    assert_eq!(e.value("lossy", &["b"]), Some(Value::Bool(true)));
    assert_eq!(e.value("cc", &["a"]), None);
    let notice = e.poll_notice().expect("a notice").message;
    assert!(notice.starts_with("2 rule instance(s) not created (cc[a], lossy[a])"), "{notice}");
    assert!(notice.contains("more than the cap of 4 (max_instances)"), "{notice}");
    // A flow goes: there is room, a's instances are created.
    env.remove("flow.c.loss");
    env.meter("flow.a.loss", Value::F64(0.5));
    drive(&mut e, &mut env, ms(20));
    assert_eq!(e.value("lossy", &["a"]), Some(Value::Bool(true)));
    assert_eq!(e.value("lossy", &["c"]), None);
    assert_eq!(e.usage().refused_instances_total, 2);
}

#[test]
fn delete_removes_definitions_and_refuses_what_others_still_use() {
    let env = MemoryEnv::new();
    let mut e = RuleEngine::new();
    let text = "a: get(\"app.x.v\")\nb: Forwarder(a)\nt: Timer(1s)\nt -> b\n[manual]\nc: Not(a)\n[contextEnter]\nw: Greater(a, 3)\nw -> load(c)";
    e.handle_load_text("x.rules", text, ms(0), &env).unwrap();
    assert_eq!(e.handle_delete(&["nope"], ms(1), &env).unwrap_err(), RuleError::UnknownRule("nope".into()));
    let err = e.handle_delete(&["a"], ms(1), &env).unwrap_err();
    assert!(matches!(&err, RuleError::InUse(r, _) if r == "a"), "{err}");
    assert!(err.to_string().contains("expected those deleted too"), "{err}");
    let err = e.handle_delete(&["c"], ms(1), &env).unwrap_err();
    assert_eq!(err, RuleError::InUse("c".into(), "w".into()));
    assert_eq!(e.list().len(), 5, "nothing changed");
    // Deleting the trigger's source drops the trigger: b stays, pushed.
    e.handle_delete(&["t"], ms(2), &env).unwrap();
    assert!(e.show("t").is_none());
    assert_eq!(e.show("b").unwrap().text, ["b: Forwarder(a)"]);
    // A loaded rule is unloaded and deleted with what uses it.
    e.handle_delete(&["w", "c"], ms(3), &env).unwrap();
    assert_eq!(e.list().iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    // unload ALL keeps definitions; delete ALL removes them.
    e.handle_unload(&["ALL"], ms(4), &env).unwrap();
    assert_eq!(e.list().len(), 2);
    assert_eq!(e.usage().instances, 0);
    let rev = e.handle_delete(&["ALL"], ms(5), &env).unwrap();
    assert!(e.list().is_empty());
    assert_eq!(e.usage().definitions, 0);
    assert_eq!(e.usage().memory_bytes, 0);
    assert_eq!(e.log().last().unwrap().what, "delete ALL");
    // A rollback brings them back.
    e.handle_rollback(rev - 2, ms(6), &env).unwrap();
    assert_eq!(e.list().len(), 2);
}

#[test]
fn the_repository_keeps_the_last_revisions_and_goes_on_numbering() {
    let env = MemoryEnv::new();
    let mut e = RuleEngine::with_limits(Limits { max_revisions: 3, ..Limits::DEFAULT });
    for i in 1..=5u64 {
        let text = format!("a: Greater(get(\"app.x.v\"), {i})");
        assert_eq!(e.handle_load_text("a.rules", &text, ms(i), &env).unwrap().revision, i);
    }
    // A load names ten rules at most in the log (a file may define thousands; the log keeps the text).
    let many: String = (0..12).map(|i| format!("[manual]\nm{i}: Not(true)\n")).collect();
    e.handle_load_text("m.rules", &many, ms(5), &env).unwrap();
    assert_eq!(e.log().last().unwrap().what, "load m.rules: m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, ... (12 rules)");
    let numbers: Vec<u64> = e.log().iter().map(|r| r.number).collect();
    assert_eq!(numbers, [4, 5, 6]);
    assert_eq!(e.handle_rollback(3, ms(6), &env).unwrap_err(), RuleError::UnknownRevision(3));
    assert_eq!(e.handle_rollback(4, ms(7), &env).unwrap(), 7);
    assert_eq!(e.usage().revisions, 3);
    e.set_limits(Limits { max_revisions: 1, ..Limits::DEFAULT });
    assert_eq!(e.log().len(), 1);
}
