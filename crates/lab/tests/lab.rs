//! Parsing, validation and the timeline of lab descriptions.

use flexstack_core::Value;
use flexstack_lab::{format_duration, parse_duration, Action, Lab};
use std::time::Duration;

const DEMO: &str = include_str!("../../../labs/demo.toml");

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn demo_parses_into_the_expected_lab() {
    let lab = Lab::parse("labs/demo.toml", DEMO).unwrap();
    assert_eq!((lab.name.as_str(), lab.duration, lab.seed), ("demo", ms(20_000), 7));
    assert_eq!((lab.sample, lab.meters.clone()), (ms(250), vec!["link.**".to_string()]));
    let hosts: Vec<_> = lab.hosts.iter().map(|h| (h.name.as_str(), h.stack.as_deref())).collect();
    assert_eq!(hosts, [("h1", None), ("app", Some("../stacks/app-default.toml")), ("srv", None)]);
    assert_eq!(lab.hosts[1].location.line, 11);
    let names: Vec<_> = lab.links.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["h1-srv", "app-srv"]);
    let l = &lab.links[0];
    assert_eq!((l.params.bw_mbit, l.params.delay, l.params.jitter), (Some(40.0), Some(ms(10)), Some(ms(1))));
    assert_eq!((l.params.loss.clone(), l.params.max_queue_size, l.mtu, l.capture), (None, Some(100), None, false));
    assert_eq!(l.location.to_string(), "labs/demo.toml:15:1");
    let settings: Vec<(String, Value)> = l.emulator_settings();
    let expected = [
        ("delay_ms", Value::F64(10.0)),
        ("jitter_ms", Value::F64(1.0)),
        ("rate_mbit", Value::F64(40.0)),
        ("queue_packets", Value::U64(100)),
    ];
    assert_eq!(settings, expected.map(|(k, v)| (k.to_string(), v)));
    assert!(lab.links[1].capture);
    let ge: Vec<_> = lab.links[1].emulator_settings().into_iter().map(|(k, _)| k).collect();
    assert_eq!(ge, ["delay_ms", "rate_mbit", "ge_p", "ge_r", "ge_loss_bad_pct", "ge_loss_good_pct"]);
    assert_eq!(lab.programs.len(), 6);
    assert!(lab.programs[..3].iter().all(|p| p.background) && lab.programs[3..].iter().all(|p| !p.background));
    assert_eq!(lab.programs[5].at, ms(9000));

    let timeline: Vec<(String, String)> =
        lab.timeline().into_iter().map(|(at, what)| (format_duration(at), what)).collect();
    let expected = [
        ("0s", "start on srv (background): iperf3 -s -p 5201"),
        ("0s", "start on srv (background): iperf3 -s -p 5202"),
        ("0s", "start on srv (background): head -c 8000000 /dev/zero > $LAB_SCRATCH/blob && exec python3 -m http.server 8080 --directory $LAB_SCRATCH"),
        ("2s", "start on h1 (foreground): iperf3 -c srv -p 5201 -t 16 -J"),
        ("2s", "start on app (foreground): curl -sS --retry 5 --retry-connrefused --retry-delay 1 -o /dev/null -w '%{json}' http://srv:8080/blob"),
        ("8s", "link h1-srv set delay_ms=20 rate_mbit=15"),
        ("9s", "start on app (foreground): iperf3 -c srv -p 5202 -t 9 -J"),
        ("13s", "link app-srv down"),
        ("14500ms", "link app-srv up"),
        ("20s", "end of lab demo"),
    ];
    assert_eq!(timeline, expected.map(|(a, b)| (a.to_string(), b.to_string())));
}

#[test]
fn knob_and_capture_events() {
    let text = format!(
        "{BASE}[[events]]\nat = \"2s\"\nknob = \"module.h1-h2_ab.duplicate_pct\"\nvalue = 1\n\
         [[events]]\nat = \"1s\"\nlink = \"h2-h1\"\ncapture = true\n"
    );
    let lab = Lab::parse("t.toml", &text).unwrap();
    assert!(matches!(&lab.events[0].action, Action::Capture { link } if link == "h1-h2"));
    assert!(
        matches!(&lab.events[1].action, Action::Knob { host: None, knob, value: Value::U64(1) } if knob == "module.h1-h2_ab.duplicate_pct")
    );
    let t: Vec<String> = lab.timeline().into_iter().map(|(_, w)| w).collect();
    assert_eq!(t[0], "capture link h1-h2");
}

#[test]
fn same_file_same_timeline() {
    let a = Lab::parse("labs/demo.toml", DEMO).unwrap();
    let b = Lab::parse("labs/demo.toml", DEMO).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.timeline(), b.timeline());
}

#[test]
fn events_are_sorted_stably() {
    let text = format!(
        "{BASE}[[events]]\nat = \"5s\"\nlink = \"h1-h2\"\ndown = true\n[[events]]\nat = \"1s\"\nknob = \"a.b\"\nvalue = 2\n\
         [[events]]\nat = \"5s\"\nlink = \"h2-h1\"\nup = true\n[[events]]\nat = \"1s\"\nknob = \"a.c\"\nvalue = true\n"
    );
    let lab = Lab::parse("t.toml", &text).unwrap();
    let t: Vec<String> = lab.timeline().into_iter().map(|(_, w)| w).collect();
    assert_eq!(t, ["knob a.b = 2", "knob a.c = true", "link h1-h2 down", "link h1-h2 up", "end of lab t"]);
}

#[test]
fn durations() {
    for (text, d) in [
        ("250ms", ms(250)),
        ("6s", ms(6000)),
        ("1.5s", ms(1500)),
        ("2m", ms(120_000)),
        ("0s", ms(0)),
        ("1h", ms(3_600_000)),
        ("10us", Duration::from_micros(10)),
        ("0.001s", ms(1)),
        (" 3ms ", ms(3)),
        ("0.5ms", Duration::from_micros(500)),
    ] {
        assert_eq!(parse_duration(text), Ok(d), "{text}");
        assert_eq!(parse_duration(&format_duration(d)), Ok(d), "{text}");
    }
    for bad in [
        "",
        "5",
        "ms",
        "-5ms",
        "-0s",
        "1.s",
        ".5s",
        "1..5s",
        "1.2.3s",
        "5 s",
        "5sec",
        "1e3ms",
        "+5s",
        "五s",
        "1.0000000001s",
        "9999999999999999h",
    ] {
        assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
    }
    assert!(parse_duration("-5ms").unwrap_err().contains("non-negative"));
}

const BASE: &str =
    "[lab]\nname = \"t\"\nduration = \"10s\"\n[hosts.h1]\n[hosts.h2]\n[[links]]\na = \"h1\"\nb = \"h2\"\n";

#[track_caller]
fn rejected(extra: &str, line: usize, needle: &str) {
    let text = format!("{BASE}{extra}");
    let e = Lab::parse("t.toml", &text).expect_err(extra);
    let loc = e.location.as_ref().unwrap_or_else(|| panic!("{extra:?}: no location: {e}"));
    assert_eq!(&*loc.file, "t.toml");
    assert_eq!(loc.line, line, "{extra:?}: {e}");
    assert!(e.message.contains(needle), "{extra:?}: {e} (wanted {needle:?})");
    assert!(e.to_string().starts_with(&format!("t.toml:{line}:")), "{e}");
}

#[test]
fn validation_errors_are_located() {
    assert!(Lab::parse("t.toml", BASE).is_ok());
    // Hosts.
    rejected("[[links]]\na = \"h1\"\nb = \"nope\"\n", 11, "unknown host \"nope\"");
    rejected("[hosts.h1]\n", 9, "invalid TOML");
    rejected("[hosts.H1]\n", 9, "invalid host name");
    rejected("[hosts.abcdefghijk]\n", 9, "at most 10");
    rejected("[hosts.h3]\nstack = 3\n", 10, "expected a string");
    rejected("[hosts.h3]\nstak = \"x\"\n", 10, "unknown key `stak`");
    // Links.
    rejected("[[links]]\na = \"h2\"\nb = \"h1\"\n", 9, "duplicate link");
    rejected("[[links]]\na = \"h1\"\nb = \"h1\"\n", 11, "two different hosts");
    rejected("delay = \"-5ms\"\n", 9, "non-negative");
    rejected("delay = \"5 parsecs\"\n", 9, "expected a duration");
    rejected("jitter = \"2h\"\n", 9, "at most 1h");
    rejected("loss = 100.5\n", 9, "0..=100");
    rejected("loss = -1\n", 9, "0..=100");
    rejected("loss_model = \"gilbert-elliott\"\nge_p = 1.5\nge_r = 0.5\n", 10, "probability in 0..=1");
    rejected("loss_model = \"gilbert-elliott\"\nge_p = 0.5\nge_r = -0.1\n", 11, "probability in 0..=1");
    rejected("loss_model = \"gilbert-elliott\"\nge_p = 0.5\n", 9, "needs `ge_r`");
    rejected("ge_p = 0.5\n", 9, "needs loss_model");
    rejected("loss_model = \"gilbert-elliott\"\nge_p = 0.5\nge_r = 0.5\nge_loss_bad = 101\n", 12, "0..=100");
    rejected("loss_model = \"markov\"\n", 9, "gilbert-elliott");
    rejected("bw = 0\n", 9, "> 0");
    rejected("bw = -10\n", 9, "> 0");
    rejected("max_queue_size = 0\n", 9, "1..=");
    rejected("mtu = 67\n", 9, "68..=65535");
    rejected("mtu = 65536\n", 9, "68..=65535");
    rejected("colour = \"red\"\n", 9, "unknown key `colour`");
    rejected("links = 3\n", 9, "unknown key `links`");
    // Programs.
    rejected("[[programs]]\nhost = \"h9\"\nrun = \"x\"\n", 10, "unknown host");
    rejected("[[programs]]\nhost = \"h1\"\n", 9, "needs `run`");
    rejected("[[programs]]\nhost = \"h1\"\nrun = \"x\"\nat = \"10s\"\n", 12, "not before the end");
    rejected("[[programs]]\nhost = \"h1\"\nrun = \"x\"\nbackground = 1\n", 12, "true or false");
    // Events.
    rejected("[[events]]\nat = \"10s\"\nlink = \"h1-h2\"\ndown = true\n", 10, "not before the end");
    rejected("[[events]]\nat = \"25s\"\nlink = \"h1-h2\"\ndown = true\n", 10, "not before the end");
    rejected("[[events]]\nlink = \"h1-h2\"\ndown = true\n", 9, "needs `at`");
    rejected("[[events]]\nat = \"1s\"\nlink = \"h1-h3\"\ndown = true\n", 11, "unknown link \"h1-h3\"");
    rejected("[[events]]\nat = \"1s\"\n", 9, "exactly one of `link`");
    rejected("[[events]]\nat = \"1s\"\nlink = \"h1-h2\"\nknob = \"a.b\"\nvalue = 1\n", 12, "exactly one of `link`");
    rejected("[[events]]\nat = \"1s\"\nlink = \"h1-h2\"\n", 11, "exactly one of `set");
    rejected("[[events]]\nat = \"1s\"\nlink = \"h1-h2\"\ndown = true\nup = true\n", 13, "exactly one of `set");
    rejected("[[events]]\nat = \"1s\"\nlink = \"h1-h2\"\ndown = false\n", 12, "expected true");
    rejected("[[events]]\nat = \"1s\"\nlink = \"h1-h2\"\nset = { delay = \"-1ms\" }\n", 12, "non-negative");
    rejected("[[events]]\nat = \"1s\"\nlink = \"h1-h2\"\nset = { mtu = 1400 }\n", 12, "unknown key `mtu`");
    rejected("[[events]]\nat = \"1s\"\nlink = \"h1-h2\"\nset = {}\n", 12, "changes nothing");
    rejected("[[events]]\nat = \"1s\"\nknob = \"nodots\"\nvalue = 1\n", 11, "dotted knob name");
    rejected("[[events]]\nat = \"1s\"\nknob = \"a.b\"\n", 11, "needs `value`");
    rejected("[[events]]\nat = \"1s\"\nknob = \"a.b\"\nvalue = 1\nhost = \"h1\"\n", 13, "plain host");
    rejected("[[events]]\nat = \"-1s\"\nknob = \"a.b\"\nvalue = 1\n", 10, "non-negative");
    rejected("[[events]]\nat = \"1s\"\nknob = \"a.b\"\nvalue = 1\nwhen = 3\n", 13, "unknown key `when`");
    // The lab table and the top level.
    rejected("[extra]\n", 9, "unknown key `extra`");
    let e = Lab::parse("t.toml", "[hosts.h1]\n").unwrap_err();
    assert_eq!(e.location.unwrap().line, 1);
    let e = Lab::parse("t.toml", "[lab]\nname = \"t\"\n").unwrap_err();
    assert!(e.message.contains("needs `duration`"), "{e}");
    let e = Lab::parse("t.toml", "[lab]\nname = \"t\"\nduration = \"0s\"\n").unwrap_err();
    assert_eq!(e.location.unwrap().line, 3);
    let e = Lab::parse("t.toml", "[lab]\nname = \"t\"\nduration = \"1s\"\nseed = -1\n").unwrap_err();
    assert_eq!(e.location.unwrap().line, 4);
    let e = Lab::parse("t.toml", "[lab]\nname = \"T T\"\nduration = \"1s\"\n").unwrap_err();
    assert!(e.message.contains("invalid lab name"), "{e}");
}

#[test]
fn stacked_host_knob_events_and_reverse_link_names() {
    let text = format!(
        "{BASE}[hosts.app]\nstack = \"s.toml\"\n[[events]]\nat = \"1s\"\nknob = \"link.h1-ap1.loss_pct\"\nvalue = 2.5\nhost = \"app\"\n\
         [[events]]\nat = \"2s\"\nlink = \"h2-h1\"\nset = {{ loss_model = \"gilbert-elliott\", ge_p = 0.1, ge_r = 0.5 }}\n"
    );
    let lab = Lab::parse("t.toml", &text).unwrap();
    let t: Vec<String> = lab.timeline().into_iter().map(|(_, w)| w).collect();
    assert_eq!(t[0], "knob link.h1-ap1.loss_pct = 2.5 on app");
    assert_eq!(t[1], "link h1-h2 set ge_p=0.1 ge_r=0.5 ge_loss_bad_pct=100 ge_loss_good_pct=0");
}

#[test]
fn routes_are_validated() {
    let stacked = "[lab]\nname = \"t\"\nduration = \"10s\"\n[hosts.h1]\nstack = \"s.toml\"\n[hosts.h2]\n[hosts.h3]\n\
                   [[links]]\na = \"h1\"\nb = \"h2\"\n[[links]]\na = \"h2\"\nb = \"h3\"\n";
    let check = |extra: &str, line: usize, needle: &str| {
        let e = Lab::parse("t.toml", &format!("{stacked}{extra}")).expect_err(extra);
        assert_eq!(e.location.as_ref().map(|l| l.line), Some(line), "{e}");
        assert!(e.message.contains(needle), "{e} (wanted {needle:?})");
    };
    check("[[routes]]\nhost = \"h3\"\nto = \"h1\"\nvia = \"h1\"\n", 17, "not linked");
    check("[[routes]]\nhost = \"h3\"\nto = \"h2\"\nvia = \"h2\"\n", 16, "plain host");
    check("[[routes]]\nhost = \"h3\"\nto = \"hx\"\nvia = \"h2\"\n", 16, "unknown host");
    check("[[routes]]\nhost = \"h3\"\nto = \"h1\"\nvia = \"h2\"\nover = 1\n", 18, "unknown key");
    let ok = Lab::parse("t.toml", &format!("{stacked}[[routes]]\nhost = \"h3\"\nto = \"h1\"\nvia = \"h2\"\n")).unwrap();
    assert_eq!((ok.routes[0].host.as_str(), ok.routes[0].via.as_str()), ("h3", "h2"));
}
