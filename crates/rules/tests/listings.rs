//! The paper's Listing 1 and Listing 2, adapted to flexstack's names, parse and run on a simulated clock.

use flexstack_core::{Time, Value};
use flexstack_rules::{drive, Environment, MemoryEnv, RuleEngine};

fn ms(t: u64) -> Time {
    Time::from_millis(t)
}

/// Listing 1: every 200 ms the average of the last four RSSI samples is compared with 55; when it falls below,
/// the application's variable is set to "bad" and the flow's congestion window to 0.
const LISTING_1: &str = r#"
my_rssi: get("iface.wlan0.rssi")
my_history_of_rssi: History(my_rssi, 4)
my_rssi_is_bad: Less(Avg(my_history_of_rssi), 55)
my_rssi_is_bad -> my_appl_var1
my_rssi_is_bad -> my_tcp_freezer
my_appl_var1: set("app.voip.var1", "bad")
my_tcp_freezer: set("flow.f1.cwnd", 0)
my_timer: Timer(200)
my_timer -> my_rssi_is_bad
"#;

/// Listing 2: an application-provided optimisation, loaded when the application sets `loadOpt` and unloaded
/// (with everything else of this text outside the context sections) when it sets `removeOpt`.
const LISTING_2: &str = r#"
[manual]
rssiavg: avg(history(get("iface.wlan0.rssi"), 10))
less1: less(rssiavg, 60)
packetLossRate: get("app.switchCwnd.packetLossRate")
less2: less(4, packetLossRate)
changeCwnd: and(less1, less2)
cwndAlg: if(changeCwnd, "bbr", "cubic")
initPort: set("app.switchCwnd.port", 5001)
setCwndAlg: set("flow.f1.cc", cwndAlg)

[contextEnter]
loadOpt: get("app.switchCwnd.loadOpt")
loadOpt -> load(setCwndAlg)

[contextExit]
removeOpt: get("app.switchCwnd.removeOpt")
removeOpt -> unload(ALL)
"#;

#[test]
fn listing_1_runs_on_a_timer() {
    let mut env = MemoryEnv::new();
    env.meter("iface.wlan0.rssi", Value::U64(70))
        .knob("app.voip.var1", Value::Str("good".into()))
        .knob("flow.f1.cwnd", Value::U64(10));
    let mut engine = RuleEngine::new();
    let report = engine.handle_load_text("listing1.rules", LISTING_1, ms(0), &env).expect("Listing 1 loads");
    assert_eq!(report.defined.len(), 6);
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
    assert_eq!(drive(&mut engine, &mut env, ms(0)).next_wakeup, Some(ms(200)));
    for t in [200, 400] {
        assert!(drive(&mut engine, &mut env, ms(t)).writes.is_empty());
    }
    env.meter("iface.wlan0.rssi", Value::U64(40));
    // 600: [70, 70, 70... ] window of 4: [70, 70, 40] avg 60; 800: [70, 70, 40, 40] avg 55, not below.
    for t in [600, 800] {
        assert!(drive(&mut engine, &mut env, ms(t)).writes.is_empty(), "at {t}");
    }
    assert_eq!(engine.value("my_rssi_is_bad", &[]), Some(Value::Bool(false)));
    let step = drive(&mut engine, &mut env, ms(1000)); // [70, 40, 40, 40]: 47.5
    assert_eq!(engine.value("my_rssi_is_bad", &[]), Some(Value::Bool(true)));
    let written: Vec<(&str, &Value)> = step.writes.iter().map(|w| (w.name.as_str(), &w.value)).collect();
    assert_eq!(written.len(), 2, "{written:?}");
    assert!(written.contains(&("app.voip.var1", &Value::Str("bad".into()))));
    assert!(written.contains(&("flow.f1.cwnd", &Value::U64(0))));
    assert_eq!(env.get("flow.f1.cwnd"), Some(Value::U64(0)));
    // Still bad at the next tick: no new event, so no new writes.
    assert!(drive(&mut engine, &mut env, ms(1200)).writes.is_empty());
    let history = engine.show("my_history_of_rssi").expect("defined");
    let json = serde_json::to_value(&history).expect("serializes");
    assert_eq!(json["instances"][0]["units"][0]["state"]["samples"], serde_json::json!([40.0, 40.0, 40.0, 40.0]));
}

#[test]
fn listing_2_contexts_load_and_unload() {
    let mut env = MemoryEnv::new();
    env.meter("iface.wlan0.rssi", Value::U64(50))
        .meter("app.switchCwnd.packetLossRate", Value::F64(2.0))
        .meter("app.switchCwnd.loadOpt", Value::Bool(false))
        .meter("app.switchCwnd.removeOpt", Value::Bool(false))
        .knob("app.switchCwnd.port", Value::U64(0))
        .knob("flow.f1.cc", Value::Str("cubic".into()));
    let mut engine = RuleEngine::new();
    let report = engine.handle_load_text("listing2.rules", LISTING_2, ms(0), &env).expect("Listing 2 loads");
    assert_eq!(report.loaded, vec!["loadOpt", "removeOpt"]);
    assert_eq!(engine.loaded(), vec!["loadOpt", "removeOpt"]);
    assert!(drive(&mut engine, &mut env, ms(10)).writes.is_empty());

    // The application asks for the optimisation: setCwndAlg and what it uses are loaded, and it writes at once.
    env.meter("app.switchCwnd.loadOpt", Value::Bool(true));
    let step = drive(&mut engine, &mut env, ms(20));
    assert_eq!(step.writes.len(), 1, "{:?}", step.writes);
    assert_eq!(env.get("flow.f1.cc"), Some(Value::Str("cubic".into())));
    assert!(engine.loaded().contains(&"setCwndAlg".to_string()) && engine.loaded().contains(&"rssiavg".to_string()));
    assert!(engine.poll_notice().expect("a notice").message.contains("loadOpt ran load(setCwndAlg)"));
    assert!(!engine.loaded().contains(&"initPort".to_string()), "manual rules load only when asked");

    // Loss above 4 % with a weak signal: switch to bbr; back when the loss falls.
    env.meter("app.switchCwnd.packetLossRate", Value::F64(6.0));
    drive(&mut engine, &mut env, ms(30));
    assert_eq!(env.get("flow.f1.cc"), Some(Value::Str("bbr".into())));
    env.meter("app.switchCwnd.packetLossRate", Value::F64(1.0));
    drive(&mut engine, &mut env, ms(40));
    assert_eq!(env.get("flow.f1.cc"), Some(Value::Str("cubic".into())));

    // The application removes it: unload(ALL) takes every rule of the text but its context watchers.
    env.meter("app.switchCwnd.removeOpt", Value::Bool(true));
    drive(&mut engine, &mut env, ms(50));
    assert_eq!(engine.loaded(), vec!["loadOpt", "removeOpt"]);
    env.meter("app.switchCwnd.packetLossRate", Value::F64(9.0));
    assert!(drive(&mut engine, &mut env, ms(60)).writes.is_empty());
    assert_eq!(env.get("flow.f1.cc"), Some(Value::Str("cubic".into())));
}
