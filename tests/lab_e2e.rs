//! End-to-end tests of `flexstack lab` (issue 4, acceptance): the real binary builds real labs — namespaces, veth
//! pairs, the wire daemon's emulators, stacked hosts' daemons — runs their programs with real traffic, and leaves
//! results folders that the tests read.
//!
//! Every test writes its own lab file into a temporary folder, with a lab name unique to this process and test
//! ([`TestLab::new`]), and uses its own `--state-dir` and `--results` folders there; a [`TestLab`] runs
//! `lab down --all` on its state folder when dropped, pass or fail. The validation test needs no privileges; the
//! others need root (they skip with a printed reason outside CI, see [`common::privileged`]) and take a lock so that
//! their timings (pings, paced UDP senders) do not disturb each other on a two-core machine.
//!
//! The UDP traffic comes from `tests/data/udp_seq.py`: sequence-numbered datagrams at a steady pace, and a receiver
//! that prints the sequence numbers it got, so the tests see exactly which datagrams the emulator dropped.

mod common;

use common::{bin, privileged, text, unique};
use serde_json::Value as Json;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The repository's root (for stack templates and test scripts).
fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The command line of the UDP test program (`tests/data/udp_seq.py`) with `args`.
fn udp_seq(args: &str) -> String {
    format!("exec python3 {} {args}", repo().join("tests/data/udp_seq.py").display())
}

/// A lab of one test: its name, and a temporary folder with its lab files, its `--state-dir` and its results.
/// Dropping it runs `lab down --all` on the state folder.
struct TestLab {
    name: String,
    dir: tempfile::TempDir,
}

impl TestLab {
    fn new(tag: &str) -> TestLab {
        TestLab { name: unique(tag), dir: tempfile::tempdir().expect("temp dir") }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// A path inside the test's folder.
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes a lab file; `{name}` in `text` becomes the lab's name.
    fn write(&self, file: &str, text: &str) -> PathBuf {
        let path = self.path(file);
        std::fs::write(&path, text.replace("{name}", &self.name)).expect("write lab file");
        path
    }

    /// `flexstack --state-dir STATE ARGS...`.
    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(bin());
        c.arg("--state-dir").arg(self.state()).args(args).stdin(Stdio::null());
        c
    }

    fn cli(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run flexstack")
    }

    /// Runs a command that must succeed; returns its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert!(out.status.success(), "flexstack {args:?} failed: {}", text(&out));
        String::from_utf8(out.stdout).expect("utf-8")
    }

    /// `lab run -q FILE --results RESULTS`.
    fn run(&self, file: &Path, results: &Path) -> Output {
        self.cli(&["lab", "run", "-q", path_str(file), "--results", path_str(results)])
    }

    /// Runs the lab, which must succeed, into `<folder>/<results>`; returns the results folder.
    fn run_ok(&self, file: &Path, results: &str) -> PathBuf {
        let dir = self.path(results);
        let out = self.run(file, &dir);
        assert!(out.status.success(), "lab run {}: {}", file.display(), text(&out));
        dir
    }

    /// The lab's namespaces that exist: `fl-lab.<lab>` and `fl-lab.<lab>.<host>`.
    fn namespaces(&self) -> Vec<String> {
        let wire = format!("fl-lab.{}", self.name);
        entries("/run/netns").into_iter().filter(|n| *n == wire || n.starts_with(&format!("{wire}."))).collect()
    }

    /// Asserts that nothing of the lab is left: namespaces, their `/etc/netns` folders, its state.
    fn assert_gone(&self) {
        assert_eq!(self.namespaces(), Vec::<String>::new(), "namespaces of lab {} left", self.name);
        let wire = format!("fl-lab.{}", self.name);
        let etc: Vec<String> = entries("/etc/netns").into_iter().filter(|n| n.starts_with(&wire)).collect();
        assert_eq!(etc, Vec::<String>::new(), "/etc/netns folders of lab {} left", self.name);
        let state = self.state().join("labs").join(&self.name);
        assert!(!state.exists(), "state of lab {} left: {}", self.name, state.display());
        assert_eq!(lab_processes(&self.name), Vec::<u32>::new(), "programs of lab {} still run", self.name);
    }
}

impl Drop for TestLab {
    fn drop(&mut self) {
        let out = self.cli(&["lab", "down", "--all"]);
        if !out.status.success() {
            eprintln!("lab down --all for {}: {}", self.name, text(&out));
        }
    }
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// File names in a folder (none if it does not exist).
fn entries(dir: &str) -> Vec<String> {
    std::fs::read_dir(dir).into_iter().flatten().flatten().filter_map(|e| e.file_name().into_string().ok()).collect()
}

/// True if process `pid` exists and is not a zombie.
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
}

/// Processes started by lab `name` (the runner gives its programs `LAB_NAME` in their environment), not zombies.
fn lab_processes(name: &str) -> Vec<u32> {
    let marker = format!("LAB_NAME={name}");
    entries("/proc")
        .into_iter()
        .filter_map(|p| p.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == marker.as_bytes()))
        })
        .filter(|&pid| running(pid))
        .collect()
}

/// Waits until `cond` holds (every 50 ms), or panics with `what` after `secs`.
fn wait_for(what: &str, secs: u64, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out after {secs} s waiting for {what}");
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The last sampled value of meter `name` in `meters.csv`.
fn last_meter(results: &Path, name: &str) -> f64 {
    let csv = read(&results.join("meters.csv"));
    let value = csv.lines().filter_map(|l| l.splitn(3, ',').nth(1).filter(|n| *n == name).and(l.rsplit(',').next()));
    let last = value.last().unwrap_or_else(|| panic!("no {name} in {}/meters.csv", results.display()));
    last.parse().unwrap_or_else(|e| panic!("{name} = {last:?}: {e}"))
}

/// The planned and event columns of `timeline.csv` (everything after the first field of each row).
fn planned_and_events(results: &Path) -> Vec<String> {
    read(&results.join("timeline.csv"))
        .lines()
        .skip(1)
        .map(|l| l.split_once(',').map(|(_, rest)| rest.to_string()).unwrap_or_default())
        .collect()
}

/// The sequence numbers a receiver printed in `programs/<program>.out`.
fn received(results: &Path, program: &str) -> BTreeSet<u32> {
    read(&results.join("programs").join(format!("{program}.out")))
        .lines()
        .map(|l| l.parse().unwrap_or_else(|e| panic!("{program}.out: {l:?}: {e}")))
        .collect()
}

/// The line of `text` (from 1) that is exactly `line`, for expected error locations.
fn line_of(text: &str, line: &str) -> usize {
    let all: Vec<&str> = text.lines().collect();
    let i = all.iter().rposition(|l| l.trim() == line).unwrap_or_else(|| panic!("no line {line:?} in:\n{text}"));
    i + 1
}

// ---------------------------------------------------------------------------------------------------------------
// 1. Validation: rejected before anything is created.

#[test]
fn invalid_labs_are_rejected_with_their_location_before_anything_exists() {
    let t = TestLab::new("val");
    let head = "[lab]\nname = \"{name}\"\nduration = \"5s\"\n[hosts.h1]\n[hosts.h2]\n";
    // (what, the lab file, the line the error must point at, words the message must contain)
    let cases: [(&str, String, &str, &[&str]); 6] = [
        ("unknown host", format!("{head}[[links]]\na = \"h1\"\nb = \"h3\"\n"), "b = \"h3\"", &["unknown host", "h3"]),
        (
            "negative delay",
            format!("{head}[[links]]\na = \"h1\"\nb = \"h2\"\ndelay = \"-5ms\"\n"),
            "delay = \"-5ms\"",
            &["delay", "non-negative"],
        ),
        (
            "loss over 100 %",
            format!("{head}[[links]]\na = \"h1\"\nb = \"h2\"\nloss = 101\n"),
            "loss = 101",
            &["loss", "0..=100", "101"],
        ),
        ("duplicate host", format!("{head}[hosts.h3]\n[hosts.h1]\n"), "[hosts.h1]", &["duplicate"]),
        (
            "event after the end",
            format!(
                "{head}[[links]]\na = \"h1\"\nb = \"h2\"\n[[events]]\nat = \"6s\"\nlink = \"h1-h2\"\ndown = true\n"
            ),
            "at = \"6s\"",
            &["6s", "before the end"],
        ),
        (
            "missing stack template",
            format!("{head}[hosts.st]\nstack = \"no-such-stack.toml\"\n"),
            // The host's declaration: the runner locates a template it cannot read at its host.
            "[hosts.st]",
            &["stack", "st", "no-such-stack.toml", "cannot read"],
        ),
    ];
    for (i, (what, lab, line, words)) in cases.iter().enumerate() {
        let file = t.write(&format!("bad{i}.toml"), lab);
        let results = t.path(&format!("results{i}"));
        let out = t.run(&file, &results);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{what}: exit code 2 expected: {}", text(&out));
        let at = format!("{}:{}:", file.display(), line_of(&read(&file), line));
        assert!(err.contains(&at), "{what}: expected {at} in: {err}");
        for w in *words {
            assert!(err.contains(w), "{what}: expected {w:?} in: {err}");
        }
        assert!(!results.exists(), "{what}: a results folder was created");
        assert_eq!(t.namespaces(), Vec::<String>::new(), "{what}: namespaces were created");
        assert!(!t.state().join("labs").join(&t.name).exists(), "{what}: lab state was created");
        // `lab check` rejects it the same way.
        let out = t.cli(&["lab", "check", path_str(&file)]);
        assert_eq!(out.status.code(), Some(2), "{what}: lab check: {}", text(&out));
    }
    // The demonstration lab is valid, and `-j` says so in JSON.
    let demo = repo().join("labs/demo.toml");
    let out = t.ok(&["lab", "check", path_str(&demo)]);
    assert!(out.contains("lab demo is valid"), "{out}");
    let v: Json = serde_json::from_str(&t.ok(&["-j", "lab", "check", path_str(&demo)])).expect("lab check -j is JSON");
    assert_eq!(v["valid"], Json::Bool(true), "{v}");
    assert_eq!(v["name"], "demo", "{v}");
    assert_eq!(v["hosts"], 3, "{v}");
    assert_eq!(v["links"], 2, "{v}");
}
