//! End-to-end tests of rules in labs (issue 6): a `[[events]]` entry with `rules = "FILE"` loads a rule file into
//! the lab's wire daemon (or, with `host`, a stacked host's daemon), `lab check` rejects a missing or wrong rule file
//! before anything is created, and every program finds its rules daemon's app socket through `FLEXSTACK_STATE_DIR`.
//!
//! The privileged test runs a real lab: a program on a plain host and one on a stacked host, each using the Python
//! application module (clients/python) with no socket path given, register a meter and a knob; a rule file loaded by
//! an event into the matching daemon reads the meter and sets the knob, and the programs print what the knob
//! callback received. Each test uses its own lab name, state and results folders in a temporary folder, and runs
//! `lab down --all` there when it ends, pass or fail.

mod common;

use common::{path_str, privileged, text, LabScratch};

const LAB_HEAD: &str =
    "[lab]\nname = \"{name}\"\nduration = \"4s\"\n[hosts.h1]\n[hosts.srv]\n[[links]]\na = \"h1\"\nb = \"srv\"\n";

#[test]
fn lab_check_rejects_missing_and_wrong_rule_files_with_their_places() {
    let s = LabScratch::new("rc");
    // Line 9 is the event.
    let lab = s.write("lab.toml", &format!("{LAB_HEAD}[[events]]\nat = \"1s\"\nrules = \"r.rules\"\n"));

    let out = s.cli(&["lab", "check", path_str(&lab)]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = text(&out);
    assert!(err.contains(&format!("{}:9:1:", lab.display())), "{err}");
    assert!(err.contains("cannot read") && err.contains("r.rules"), "{err}");

    s.write("r.rules", "a: get(\"module.x.y\")\nb: Frobnicate(a)\nc: History(a)\n");
    let out = s.cli(&["lab", "check", path_str(&lab)]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let err = text(&out);
    let rules = s.path("r.rules").display().to_string();
    assert!(err.contains(&format!("{rules}:2:4: error: unknown unit `Frobnicate`")), "{err}");
    assert!(err.contains(&format!("{rules}:3:4: error: wrong arity")), "{err}");
    assert!(err.contains(&format!("the rules of the event at {}:9:1", lab.display())), "{err}");
    assert!(!err.contains("warning"), "warnings are not errors: {err}");
    assert!(!s.path("state").join("labs").join(&s.name).exists(), "nothing is created for an invalid lab");

    // Names that do not exist yet are warnings: the lab's daemons and programs create them later.
    s.write("r.rules", "a: get(\"module.x.y\")\nb: set(\"app.p.k\", Threshold(a, 2, 1))\n");
    let out = s.cli(&["lab", "check", path_str(&lab)]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("1s  rules r.rules"), "{}", text(&out));
}

/// A program using the Python application module: registers `level` (a meter) and `answer` (a knob) as
/// app.<NAME>.*, publishes level = LEVEL, and prints `answer=<value>` for each knob write it accepts; it exits 1 s
/// after it got EXPECTED (so that the lab samples its variables), or fails after 20 s.
const PROBE: &str = r#"
import os, sys, time
sys.path.insert(0, os.path.join(sys.argv[4], "clients", "python"))
from flexstack_app import App
name, level, expected = sys.argv[1], float(sys.argv[2]), sys.argv[3]
got = []
def on_answer(_n, value):
    print("answer=%s" % value, flush=True)
    got.append(value)
app = App()
print("state_dir=%s" % os.environ.get("FLEXSTACK_STATE_DIR"), flush=True)
app.meter("level", "f64")
app.knob("answer", "str", "none", on_answer)
app.register(name)
app.update("level", level)
end = time.monotonic() + 20
while expected not in got:
    if time.monotonic() > end:
        sys.exit("no answer %s (got %s)" % (expected, got))
    app.poll(0.1)
linger = time.monotonic() + 1.0
while time.monotonic() < linger:
    app.poll(0.1)
"#;

#[test]
fn rules_events_drive_programs_knobs_on_the_wire_and_on_a_stacked_host() {
    if !privileged() {
        return;
    }
    let s = LabScratch::new("rl");
    s.write("probe.py", PROBE);
    let rule = |app: &str| {
        format!("level: get(\"app.{app}.level\")\nanswer: set(\"app.{app}.answer\", If(Greater(level, 5), \"high\", \"low\"))\n")
    };
    s.write("wire.rules", &rule("plain"));
    s.write("st.rules", &rule("stacked"));
    let probe = s.path("probe.py").display().to_string();
    let lab = s.write(
        "lab.toml",
        &format!(
            "[lab]\nname = \"{{name}}\"\nduration = \"12s\"\nmeters = [\"wire.app.**\", \"host.st.app.**\"]\n\
             sample = \"200ms\"\n[hosts.h1]\n[hosts.srv]\n[hosts.st]\nstack = \"{{repo}}/stacks/app-default.toml\"\n\
             [[links]]\na = \"h1\"\nb = \"srv\"\n[[links]]\na = \"st\"\nb = \"srv\"\n\
             [[programs]]\nhost = \"h1\"\nat = \"1s\"\nrun = \"python3 {probe} plain 7 high {{repo}}\"\n\
             [[programs]]\nhost = \"st\"\nat = \"1s\"\nrun = \"python3 {probe} stacked 2 low {{repo}}\"\n\
             [[events]]\nat = \"0s\"\nrules = \"wire.rules\"\n\
             [[events]]\nat = \"0.5s\"\nrules = \"st.rules\"\nhost = \"st\"\n"
        ),
    );
    let results = s.path("results");
    let out = s.cli(&["lab", "run", "-q", path_str(&lab), "--results", path_str(&results)]);
    assert!(out.status.success(), "lab run: {}", text(&out));

    let timeline = std::fs::read_to_string(results.join("timeline.csv")).expect("timeline.csv");
    assert!(timeline.contains(",0.000,rules wire.rules\n"), "{timeline}");
    assert!(timeline.contains(",0.500,rules st.rules on st\n"), "{timeline}");
    assert!(!timeline.contains("FAILED"), "{timeline}");

    let output = |stem: &str| std::fs::read_to_string(results.join("programs").join(stem)).expect("program output");
    let plain = output("h1-1.out");
    assert!(plain.contains("state_dir=") && plain.contains("/wire\n"), "{plain}");
    assert!(plain.contains("answer=high"), "the wire's rule set the plain host's knob: {plain}");
    let stacked = output("st-1.out");
    assert!(stacked.contains("/hosts/st\n"), "the stacked host's program gets its own daemon: {stacked}");
    assert!(stacked.contains("answer=low"), "the stacked host's rule set its knob: {stacked}");
    assert_eq!(output("h1-1.status").trim(), "exit=0");
    assert_eq!(output("st-1.status").trim(), "exit=0");

    // The programs' variables were sampled from the daemon each registered with.
    let meters = std::fs::read_to_string(results.join("meters.csv")).expect("meters.csv");
    assert!(meters.contains(",wire.app.plain.level,7"), "{meters}");
    assert!(meters.contains(",host.st.app.stacked.level,2"), "{meters}");
}
