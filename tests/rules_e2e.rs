//! End-to-end: cross-layer rules in a real daemon, driven by the real CLI.
//!
//! A rule reads a real meter (the counter's frame rate) and sets a real knob (the switch's `select`) when a
//! threshold is crossed: the traffic moves to the other sink and back. Also: unload, replace keeping a History's
//! samples, the repository (log, diff, rollback), a bad rule file refused with file:line:column and exit code 2,
//! and `monitor --csv`.

mod common;

use common::Daemon;
use flexstack_api::ops::*;
use flexstack_api::Value;
use serde_json::Value as Json;

fn stack() -> String {
    common::chain("rate = 300\nsize = 100", "", "")
}

const ROUTE: &str = r#"# Busy traffic goes to branch 1, calm traffic back to branch 0 (hysteresis between 1000 and 3000 frames/s).
fps: get("module.count.rate_fps")
busy: Threshold(fps, 3000, 1000)
route: set("module.sel.select", If(busy, 1, 0))
"#;

fn write(d: &Daemon, name: &str, text: &str) -> String {
    let p = d.path(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

/// The output of the first instance of `rule`, if it runs.
fn rule_value(d: &Daemon, rule: &str) -> Option<Value> {
    d.answer::<RulesShow>(&["rules", "show", rule]).instances.first().and_then(|i| i.value.clone())
}

fn select(d: &Daemon) -> i64 {
    d.get("module.sel.select").as_i64().unwrap()
}

#[test]
fn a_rule_moves_traffic_when_a_meter_crosses_a_threshold_and_stops_when_unloaded() {
    let d = Daemon::start(&stack(), &[]);
    let file = write(&d, "route.rules", ROUTE);
    let out = d.ok(&["rules", "load", &file]);
    assert!(out.contains("ok: rules revision 1"), "{out}");
    let list = d.answer::<RulesList>(&["rules", "list"]);
    let route = list.iter().find(|r| r.name == "route").expect("route listed").clone();
    assert!(route.explicit);
    assert_eq!(route.instances, 1);
    assert_eq!(route.source, file.as_str());

    // Calm: traffic stays on branch 0.
    d.wait_for("sink0 to receive", 10, |d| d.get_u64("module.sink0.frames_total") > 100);
    assert_eq!(select(&d), 0);
    assert_eq!(d.get_u64("module.sink1.frames_total"), 0);

    // Busy: the rule switches the knob and the traffic moves to branch 1.
    d.ok(&["set", "module.src.rate", "8000"]);
    d.wait_for("the rule to select branch 1", 10, |d| select(d) == 1);
    let sink1 = d.get_u64("module.sink1.frames_total");
    d.wait_for("sink1 to receive", 10, |d| d.get_u64("module.sink1.frames_total") > sink1 + 1000);
    let sink0 = d.get_u64("module.sink0.frames_total");
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(d.get_u64("module.sink0.frames_total"), sink0, "branch 0 still gets frames after the switch");

    // The write went through `set`: a stack revision by the user `rules`; the unit graph shows the state.
    let log = d.answer::<ConfigLog>(&["config", "log"]);
    assert!(log.iter().any(|r| r.user == "rules" && r.change.contains("select")), "{log:?}");
    let show = d.answer::<RulesShow>(&["rules", "show", "route"]);
    let units = &show.instances[0].units;
    let set_unit = units.iter().find(|u| u.kind == "set").expect("a set unit");
    assert!(matches!(set_unit.state["writes"].value(), Some(Value::U64(n)) if *n >= 2), "{show:?}");
    assert_eq!(show.instances[0].value, Some(Value::U64(1)));
    let text = d.ok(&["rules", "show", "route"]);
    assert!(text.contains("  route/0    If") && text.contains("last_written=1"), "{text}");

    // Calm again: back to branch 0.
    d.ok(&["set", "module.src.rate", "200"]);
    d.wait_for("the rule to select branch 0", 10, |d| select(d) == 0);

    // Unloaded, the rule no longer acts.
    let out = d.ok(&["rules", "unload", "route"]);
    assert!(out.contains("ok: rules revision 2"), "{out}");
    // Only `route` goes: `fps` and `busy` were loaded by themselves too.
    let running: Vec<String> =
        d.answer::<RulesList>(&["rules", "list"]).into_iter().filter(|r| r.instances != 0).map(|r| r.name).collect();
    assert_eq!(running, ["busy", "fps"]);
    d.ok(&["set", "module.src.rate", "8000"]);
    std::thread::sleep(std::time::Duration::from_millis(2500));
    assert!(d.get("module.count.rate_fps").as_f64().unwrap() > 3000.0);
    assert_eq!(select(&d), 0, "an unloaded rule changed the knob");
}

#[test]
fn replace_keeps_history_state_and_rollback_restores_the_wiring() {
    let d = Daemon::start(&stack(), &[]);
    let base = r#"frames: get("module.count.frames_total")
tick: Timer(20ms)
h: History(frames, 10000)
fast: Greater(Avg(h), 0)
tick -> fast
"#;
    let alt = "[manual]\nslow: Less(Max(h), 0)\n";
    d.ok(&["rules", "load", &write(&d, "base.rules", base)]);
    d.ok(&["rules", "load", &write(&d, "alt.rules", alt)]);
    let samples = |d: &Daemon| {
        let show = d.answer::<RulesShow>(&["rules", "show", "h"]);
        let unit = show.instances.first().and_then(|i| i.units.first());
        unit.and_then(|u| u.state.get("samples")).and_then(UnitState::samples).map_or(0, <[f64]>::len)
    };
    d.wait_for("History to record samples", 10, |d| samples(d) >= 10);
    d.wait_for("fast to be true", 10, |d| rule_value(d, "fast") == Some(Value::Bool(true)));

    // replace: the trigger moves to `slow`; `h` is the same unit and keeps its samples.
    let before = samples(&d);
    let out = d.ok(&["rules", "replace", "fast", "slow"]);
    assert!(out.contains("ok: rules revision 3"), "{out}");
    assert!(samples(&d) >= before, "History lost its samples on replace");
    d.wait_for("slow to run (false)", 10, |d| rule_value(d, "slow") == Some(Value::Bool(false)));
    let n = samples(&d);
    d.wait_for("History to keep recording after replace", 10, |d| samples(d) > n);

    // The repository: every change is a revision; diff shows the moved trigger; rollback restores it.
    let log = d.answer::<RulesLog>(&["rules", "log"]);
    let revs: Vec<&str> = log.revisions.iter().map(|r| r.what.as_str()).collect();
    assert_eq!(revs.len(), 3, "{log:?}");
    assert!(revs[2].starts_with("replace fast slow"), "{revs:?}");
    let diff = d.answer::<RulesDiff>(&["rules", "diff", "2", "3"]);
    let lines: Vec<&str> = diff.iter().map(String::as_str).collect();
    assert!(lines.iter().any(|l| l.starts_with('+') && l.contains("slow")), "{lines:?}");
    assert!(d.cli(&["rules", "diff", "2", "99"]).status.code() == Some(1));

    let before = samples(&d);
    let out = d.ok(&["rules", "rollback", "2"]);
    assert!(out.contains("ok: rules revision 4"), "{out}");
    assert_eq!(d.answer::<RulesShow>(&["rules", "show", "slow"]).instances.len(), 0, "slow still runs");
    assert_eq!(d.answer::<RulesShow>(&["rules", "show", "fast"]).instances.len(), 1);
    assert!(samples(&d) >= before, "History lost its samples on rollback");
    let e = d.fails(&["rules", "rollback", "42"]);
    assert!(e.contains("unknown revision 42"), "{e}");
}

#[test]
fn a_bad_rule_file_is_refused_with_file_line_column_and_changes_nothing() {
    let d = Daemon::start(&stack(), &[]);
    d.ok(&["rules", "load", &write(&d, "good.rules", ROUTE)]);
    let bad = "ok: get(\"module.count.rate_fps\")\nx: Less(ok, 3)\ny: Hist(ok, 4)\nz: Avg(ok)\n";
    let file = write(&d, "bad.rules", bad);
    let out = d.cli(&["rules", "load", &file]);
    assert_eq!(out.status.code(), Some(2), "{}", common::text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("{file}:3:4: error: unknown unit `Hist`")), "{err}");
    assert!(err.contains(&format!("{file}:4:4: error: unbounded window")), "{err}");
    // Nothing changed: one revision, the good rules only.
    let log = d.answer::<RulesLog>(&["rules", "log"]);
    assert_eq!(log.revisions.len(), 1, "{log:?}");
    let names: Vec<String> = d.answer::<RulesList>(&["rules", "list"]).into_iter().map(|r| r.name).collect();
    assert_eq!(names, ["busy", "fps", "route"]);
    // A file that does not exist is an input error too; unknown names are not found (exit 1).
    assert_eq!(d.cli(&["rules", "load", "/nonexistent/x.rules"]).status.code(), Some(2));
    assert_eq!(d.cli(&["rules", "unload", "nothere"]).status.code(), Some(1));
    assert_eq!(d.cli(&["rules", "show", "nothere"]).status.code(), Some(1));
}

#[test]
fn monitor_streams_parseable_csv_and_json() {
    let d = Daemon::start(&stack(), &[]);
    let out = d.ok(&["monitor", "-i", "50", "-n", "6", "--csv", "module.count.frames_total", "module.sel.*_total"]);
    let mut lines = out.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let sel =
        ["busy_ns_total", "calls_total", "frames_dropped_total", "frames_in_total", "frames_out_total", "frames_total"];
    let mut want = vec!["time_s".to_string(), "module.count.frames_total".to_string()];
    want.extend(sel.iter().map(|v| format!("module.sel.{v}")));
    assert_eq!(header, want);
    let rows: Vec<Vec<f64>> = lines
        .map(|l| l.split(',').map(|c| c.parse::<f64>().unwrap_or_else(|e| panic!("{l}: {e}"))).collect())
        .collect();
    assert_eq!(rows.len(), 6, "{out}");
    for pair in rows.windows(2) {
        assert_eq!(pair[1].len(), 8);
        assert!(pair[1][0] >= pair[0][0] && pair[1][1] >= pair[0][1], "time and frames go forward: {pair:?}");
    }
    assert!(rows[5][1] > rows[0][1], "frames did not grow: {out}");
    assert!(rows[5][7] > rows[0][7], "the switch's frames did not grow: {out}");

    let out = d.ok(&["-j", "monitor", "-i", "20", "-n", "3", "module.sel.select"]);
    let samples: Vec<Json> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(samples.len(), 3);
    assert_eq!(samples[2]["values"]["module.sel.select"], 0);

    let out = d.ok(&["monitor", "-i", "20", "-n", "2", "module.sel.select"]);
    assert!(out.lines().next().unwrap().contains("module.sel.select"), "{out}");
    assert_eq!(out.lines().count(), 3, "{out}");
}
