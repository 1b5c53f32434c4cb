//! End-to-end tests of `flexstack lab` (issue 4, acceptance): the real binary builds real labs — namespaces, veth
//! pairs, the wire daemon's emulators, stacked hosts' daemons — runs their programs with real traffic, and leaves
//! results folders that the tests read.
//!
//! Every test writes its own lab file into a temporary folder, with a lab name unique to this process and test
//! ([`TestLab::new`]), and uses its own `--state-dir` and `--results` folders there; a [`TestLab`] runs
//! `lab down --all` on its state folder when dropped, pass or fail. The validation test needs no privileges; the
//! others need root (they skip with a printed reason outside CI) and take turns ([`common::privileged_serial`]) so
//! that their timings (pings, paced UDP senders) do not disturb each other on a two-core machine.
//!
//! The UDP traffic comes from `tests/data/udp_seq.py`: sequence-numbered datagrams at a steady pace, and a receiver
//! that prints the sequence numbers it got, so the tests see exactly which datagrams the emulator dropped.

mod common;

use common::{answer, as_u64, bin, path_str, ping_rtts, privileged_serial, repo, text, upper_median, LabScratch};
use flexstack_api::ops::Get;
use serde_json::Value as Json;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The command line of the UDP test program (`tests/data/udp_seq.py`) with `args`.
fn udp_seq(args: &str) -> String {
    format!("exec python3 {} {args}", repo().join("tests/data/udp_seq.py").display())
}

/// A lab of one test ([`LabScratch`]: its name, its folder, `lab down --all` when dropped) with the lab tests'
/// own helpers.
struct TestLab(LabScratch);

impl std::ops::Deref for TestLab {
    type Target = LabScratch;
    fn deref(&self) -> &LabScratch {
        &self.0
    }
}

impl TestLab {
    fn new(tag: &str) -> TestLab {
        TestLab(LabScratch::new(tag))
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

    /// The lab's entry in `lab list -j`, which must list it.
    fn listed(&self) -> Json {
        let list: Json = serde_json::from_str(&self.ok(&["-j", "lab", "list"])).expect("lab list -j is JSON");
        let entry = list.as_array().and_then(|a| a.iter().find(|l| l["name"] == self.name.as_str())).cloned();
        entry.unwrap_or_else(|| panic!("lab {} not listed: {list}", self.name))
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
    let last = csv
        .lines()
        .rev()
        .find_map(|l| {
            let mut fields = l.split(',');
            (fields.nth(1) == Some(name)).then(|| fields.next()).flatten()
        })
        .unwrap_or_else(|| panic!("no {name} in {}/meters.csv", results.display()));
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

// ---------------------------------------------------------------------------------------------------------------
// 2. A runner killed halfway: `lab down --all` removes everything, and the lab runs again.

#[test]
fn a_killed_runner_leaves_nothing_after_down_all_and_the_lab_runs_again() {
    let Some(_serial) = privileged_serial() else { return };
    let t = TestLab::new("kill");
    let file = t.write(
        "kill.toml",
        &format!(
            r#"[lab]
name = "{{name}}"
duration = "5s"
[hosts.pl]
[hosts.st]
stack = "{stack}"
[[links]]
a = "pl"
b = "st"
[[programs]]
host = "pl"
run = "exec sleep 30"
background = true
[[programs]]
host = "st"
run = "exec sleep 4"
"#,
            stack = repo().join("stacks/app-default.toml").display()
        ),
    );
    let mut runner = t
        .command(&["lab", "run", "-q", path_str(&file), "--results", path_str(&t.path("r1"))])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start lab run");
    let labs = t.state().join("labs").join(&t.name);
    let daemon_pid =
        |dir: &Path| -> Option<u32> { std::fs::read_to_string(dir.join("daemon.pid")).ok()?.trim().parse().ok() };
    let (wire_dir, st_dir) = (labs.join("wire"), labs.join("hosts").join("st"));
    let app_namespaces = |pid: u32| -> Vec<String> {
        entries("/run/netns").into_iter().filter(|n| n.starts_with(&format!("fs-{pid}-"))).collect()
    };
    wait_for("the lab's namespaces, daemons and the stacked host's app namespace", 20, || {
        t.namespaces().len() == 3
            && daemon_pid(&wire_dir).is_some()
            && daemon_pid(&st_dir).is_some_and(|p| !app_namespaces(p).is_empty())
            && lab_processes(&t.name).len() >= 2
    });
    let daemons = [daemon_pid(&wire_dir).expect("wire daemon"), daemon_pid(&st_dir).expect("st daemon")];
    let st_daemon = daemons[1];
    assert!(daemons.iter().all(|&p| running(p)), "daemons {daemons:?} run");
    let programs = lab_processes(&t.name);

    nix::sys::signal::kill(nix::unistd::Pid::from_raw(runner.id() as i32), nix::sys::signal::Signal::SIGKILL)
        .expect("SIGKILL the runner");
    runner.wait().expect("reap the runner");

    // `lab list` shows the lab with its runner gone.
    let entry = t.listed();
    assert_eq!(entry["runner_pid"], runner.id(), "{entry}");
    assert_eq!(entry["runner_alive"], false, "{entry}");
    let shown = t.ok(&["lab", "list"]);
    assert!(shown.contains(&format!("runner {} gone", runner.id())), "{shown}");
    // Killing the runner stopped nothing by itself.
    assert_eq!(t.namespaces().len(), 3, "namespaces survive the runner");
    assert!(daemons.iter().all(|&p| running(p)), "daemons survive the runner");

    let out = t.ok(&["lab", "down", "--all"]);
    assert!(out.contains(&t.name), "{out}");
    t.assert_gone();
    assert_eq!(app_namespaces(st_daemon), Vec::<String>::new(), "app namespaces of the stacked host's daemon");
    let alive: Vec<u32> = daemons.iter().chain(&programs).copied().filter(|&p| running(p)).collect();
    assert_eq!(alive, Vec::<u32>::new(), "daemons {daemons:?} and programs {programs:?} must be gone");
    assert!(t.ok(&["lab", "list"]).contains("no lab is up"));

    // The same lab runs again, to the end, and leaves nothing either.
    let r2 = t.run_ok(&file, "r2");
    assert_eq!(read(&r2.join("programs/st-1.status")).trim(), "exit=0", "the stacked host's program ran");
    t.assert_gone();
}

// ---------------------------------------------------------------------------------------------------------------
// 3. The same lab twice: the same timeline and, with the same seed, the same drops.

/// A lab of two hosts, one link with `link` parameters, a receiver on h2 and a sender of `count` datagrams every
/// `interval_s` seconds on h1 (from 0.5 s).
fn udp_lab(link: &str, seed: u64, count: u32, interval_s: f64, duration_s: u32) -> String {
    format!(
        r#"[lab]
name = "{{name}}"
duration = "{duration_s}s"
seed = {seed}
sample = "250ms"
meters = ["link.**"]
[hosts.h1]
[hosts.h2]
[[links]]
a = "h1"
b = "h2"
{link}
[[programs]]
host = "h2"
run = "{recv}"
[[programs]]
host = "h1"
run = "{send}"
at = "0.5s"
"#,
        recv = udp_seq(&format!("recv 9000 1 {}", duration_s as f64 - 0.5)),
        send = udp_seq(&format!("send h2 9000 {count} {interval_s}")),
    )
}

/// The datagrams h2 received, and the drops the a → b emulator counted, of a lab from [`udp_lab`]; checks that
/// every missing datagram is one the emulator dropped.
fn udp_outcome(results: &Path, count: u32) -> (BTreeSet<u32>, u64) {
    let got = received(results, "h2-1");
    assert!(got.iter().all(|&s| s < count), "sequence numbers below {count}");
    let drops = last_meter(results, "link.h1-h2.ab.drop_loss_total") as u64;
    assert_eq!(drops, u64::from(count) - got.len() as u64, "every missing datagram was dropped by the loss model");
    (got, drops)
}

#[test]
fn the_same_lab_twice_gives_the_same_timeline_and_the_same_drops() {
    let Some(_serial) = privileged_serial() else { return };
    const N: u32 = 3000;
    let t = TestLab::new("twice");
    let file = t.write("twice.toml", &udp_lab("loss = 10", 11, N, 0.001, 6));
    let (a, b) = (t.run_ok(&file, "a"), t.run_ok(&file, "b"));
    let timeline = planned_and_events(&a);
    assert!(timeline.len() >= 5, "starts, ends and the end of the lab: {timeline:?}");
    assert_eq!(timeline, planned_and_events(&b), "planned and event columns of the two runs");
    let (got_a, drops_a) = udp_outcome(&a, N);
    let (got_b, drops_b) = udp_outcome(&b, N);
    assert_eq!(drops_a, drops_b, "drop counters of the two runs");
    assert_eq!(got_a, got_b, "the same datagrams were received");
    // The loss is within the 99 % binomial interval of 10 %.
    let (n, p) = (f64::from(N), 0.10);
    let half = 2.576 * (n * p * (1.0 - p)).sqrt();
    assert!(
        (drops_a as f64 - n * p).abs() <= half,
        "{drops_a} drops of {N}: outside {:.0}..{:.0}",
        n * p - half,
        n * p + half
    );
    // Another seed, another drop pattern; and `realtime = 0`: the lab's daemons run their data planes under the
    // normal policy instead of SCHED_FIFO 10 (the default, as in runs a and b).
    let other =
        t.write("other.toml", &udp_lab("loss = 10", 12, N, 0.001, 6).replacen("[lab]\n", "[lab]\nrealtime = 0\n", 1));
    let c = t.run_ok(&other, "c");
    let (got_c, _) = udp_outcome(&c, N);
    assert_ne!(got_a, got_c, "seed 12 drops other datagrams than seed 11");
    let scheduling = |results: &Path| {
        let log = read(&results.join("logs/wire-daemon.log"));
        log.lines().find(|l| l.contains("data plane started")).map(str::to_string).unwrap_or_else(|| panic!("{log}"))
    };
    assert!(scheduling(&a).contains("scheduling=\"fifo 10\""), "{}", scheduling(&a));
    assert!(scheduling(&c).contains("scheduling=\"normal\""), "{}", scheduling(&c));
    eprintln!("seed 11: {drops_a} drops of {N} (twice); seed 12: {} drops", N as usize - got_c.len());
    t.assert_gone();
}

// ---------------------------------------------------------------------------------------------------------------
// 4. Gilbert-Elliott loss on real traffic: bursts of the configured mean length.

#[test]
fn gilbert_elliott_loss_gives_bursts_of_the_configured_mean_length() {
    let Some(_serial) = privileged_serial() else { return };
    const N: u32 = 12_000;
    let (p, r) = (0.02, 0.25);
    let t = TestLab::new("ge");
    let link = format!("loss_model = \"gilbert-elliott\"\nge_p = {p}\nge_r = {r}\nge_loss_bad = 100");
    // 2,000 datagrams/s: slow enough that a loaded machine drops none outside the loss model.
    let file = t.write("ge.toml", &udp_lab(&link, 5, N, 0.0005, 8));
    let results = t.run_ok(&file, "r");
    let (got, drops) = udp_outcome(&results, N);
    // Runs of consecutive missing sequence numbers; a run reaching the last datagram is cut short and not counted.
    let mut bursts: Vec<u32> = Vec::new();
    let mut run = 0;
    for seq in 0..N {
        if got.contains(&seq) {
            if run > 0 {
                bursts.push(run);
            }
            run = 0;
        } else {
            run += 1;
        }
    }
    // With ge_loss_bad = 100 % and no loss in the good state, a run is one stay in the bad state: geometric with
    // mean 1/r and variance (1-r)/r². Over B bursts the mean's standard error is sqrt((1-r)/r²/B); allow 3.3 of
    // them (two-sided 99.9 %). About N·p·r/(p+r) ≈ 220 bursts are expected.
    let b = bursts.len() as f64;
    assert!(b >= 100.0, "{b} bursts: too few to measure");
    let mean = bursts.iter().map(|&l| f64::from(l)).sum::<f64>() / b;
    let tol = 3.3 * ((1.0 - r) / (r * r) / b).sqrt();
    assert!((mean - 1.0 / r).abs() <= tol, "mean burst length {mean:.3} over {b} bursts: expected 4 ± {tol:.3}");
    // Overall loss p/(p+r). Successive packets' states are correlated (the chain's second eigenvalue is
    // λ = 1-p-r), which multiplies the binomial variance π(1-π)/N by (1+λ)/(1-λ); allow 3.3 standard deviations.
    let pi = p / (p + r);
    let lambda = 1.0 - p - r;
    let sd = (pi * (1.0 - pi) / f64::from(N) * (1.0 + lambda) / (1.0 - lambda)).sqrt();
    let loss = drops as f64 / f64::from(N);
    assert!((loss - pi).abs() <= 3.3 * sd, "loss {loss:.4}: expected {pi:.4} ± {:.4}", 3.3 * sd);
    eprintln!("{drops} of {N} lost ({loss:.4}, expected {pi:.4}); {b} bursts, mean length {mean:.3} ± {tol:.3}");
    t.assert_gone();
}

// ---------------------------------------------------------------------------------------------------------------
// 5. Interactive use: lab up, exec, link down/up/set, list, down.

/// Median RTT in ms of `count` pings from `host` to `to`, 200 ms apart, through `lab exec`.
fn ping_median(t: &TestLab, host: &str, to: &str, count: u32) -> f64 {
    let out = t.cli(&["lab", "exec", host, "--", "ping", "-n", "-c", &count.to_string(), "-i", "0.2", "-W", "2", to]);
    assert!(out.status.success(), "ping from {host} to {to}: {}", text(&out));
    upper_median(ping_rtts(&String::from_utf8_lossy(&out.stdout), count))
}

#[test]
fn an_interactive_lab_routes_through_a_middle_host_and_obeys_link_commands() {
    let Some(_serial) = privileged_serial() else { return };
    let t = TestLab::new("up");
    let file = t.write(
        "chain.toml",
        &format!(
            r#"[lab]
name = "{{name}}"
duration = "10s"
[hosts.h1]
[hosts.r]
[hosts.h2]
[hosts.st]
stack = "{stack}"
[[links]]
a = "h1"
b = "r"
[[links]]
a = "r"
b = "h2"
[[links]]
a = "st"
b = "r"
[[programs]]
host = "h2"
run = "exec python3 -m http.server 8080 --directory $LAB_SCRATCH"
background = true
"#,
            stack = repo().join("stacks/app-default.toml").display()
        ),
    );
    let up = t.ok(&["lab", "up", path_str(&file), "--results", path_str(&t.path("r"))]);
    assert!(up.contains(&format!("lab {} is up", t.name)), "{up}");
    assert_eq!(t.namespaces().len(), 5, "4 hosts and the wire: {:?}", t.namespaces());
    let ping = |args: &[&str]| t.cli(&[&["lab", "exec"], args].concat());

    // h1 reaches h2 through r (two links): the TTL says one router.
    let out = ping(&["--lab", &t.name, "h1", "--", "ping", "-n", "-c", "2", "-W", "2", "h2"]);
    assert!(out.status.success(), "ping h1 -> h2: {}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("ttl=63"), "one hop through r: {}", text(&out));

    // A link down is a pulled cable: h2's interface on it loses its carrier, and gets it back.
    let h2_link = || {
        let out = ping(&["h2", "--", "ip", "link", "show", "eth0"]);
        assert!(out.status.success(), "ip link show on h2: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    assert!(!h2_link().contains("NO-CARRIER"), "h2's eth0 has its carrier: {}", h2_link());
    t.ok(&["lab", "link", "r", "h2", "down"]);
    assert!(h2_link().contains("NO-CARRIER"), "h2's eth0 must lose its carrier: {}", h2_link());
    let out = ping(&["h1", "--", "ping", "-n", "-c", "2", "-W", "1", "h2"]);
    assert!(!out.status.success(), "ping over a link that is down must fail: {}", text(&out));
    t.ok(&["lab", "link", "r", "h2", "up"]);
    assert!(!h2_link().contains("NO-CARRIER"), "h2's eth0 must get its carrier back: {}", h2_link());
    let out = ping(&["h1", "--", "ping", "-n", "-c", "2", "-W", "2", "h2"]);
    assert!(out.status.success(), "ping after the link came back: {}", text(&out));

    // 40 ms on h1-r, both directions: the RTT rises by 80 ms.
    let before = ping_median(&t, "h1", "h2", 5);
    t.ok(&["lab", "link", "h1", "r", "set", "delay=40ms"]);
    let after = ping_median(&t, "h1", "h2", 5);
    assert!((after - before - 80.0).abs() <= 3.0, "RTT {before:.3} ms -> {after:.3} ms: expected +80 ms ± 3");
    eprintln!("RTT h1 -> h2: {before:.3} ms, with delay=40ms on h1-r {after:.3} ms");

    let entry = t.listed();
    assert_eq!(entry["runner_pid"], 0, "lab up has no runner: {entry}");
    let hosts: Vec<&str> = entry["hosts"].as_array().expect("hosts").iter().filter_map(|h| h[0].as_str()).collect();
    assert_eq!(hosts, ["h1", "r", "h2", "st"], "{entry}");

    // The stacked host's commands run through its stack: its daemon counts their packets.
    let st_state = t.state().join("labs").join(&t.name).join("hosts").join("st");
    let pinger = t
        .command(&["lab", "exec", "st", "--", "ping", "-n", "-c", "10", "-i", "0.2", "-W", "2", "h2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ping from st");
    let frames = || -> u64 {
        let out = Command::new(bin())
            .arg("--state-dir")
            .arg(&st_state)
            .args(["-j", "get", "module.**.frames_in_total"])
            .output()
            .expect("get");
        answer::<Get>(&out).map_or(0, |m| m.values().filter_map(|x| as_u64(&x.value)).sum())
    };
    wait_for("the stacked host's modules to carry the ping", 10, || frames() > 0);
    let out = pinger.wait_with_output().expect("ping from st");
    assert!(out.status.success(), "ping st -> h2 through st's stack: {}", text(&out));
    let out = t.cli(&[
        "lab",
        "exec",
        "st",
        "--",
        "curl",
        "-sS",
        "-m",
        "5",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "http://h2:8080/",
    ]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200", "curl st -> h2: {}", text(&out));

    let out = t.ok(&["lab", "down"]);
    assert!(out.contains(&format!("removed: {}", t.name)), "{out}");
    t.assert_gone();
}

// ---------------------------------------------------------------------------------------------------------------
// 6. The results folder.

/// The frames of a pcapng file.
fn pcapng_packets(path: &Path) -> usize {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut reader = pcap_file::pcapng::PcapNgReader::new(file).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut n = 0;
    while let Some(block) = reader.next_block() {
        if let pcap_file::pcapng::Block::EnhancedPacket(_) = block.unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        {
            n += 1;
        }
    }
    n
}

#[test]
fn a_run_leaves_a_complete_results_folder_and_its_report_regenerates_identically() {
    let Some(_serial) = privileged_serial() else { return };
    let t = TestLab::new("res");
    let text_of_lab = r#"[lab]
name = "{name}"
duration = "5s"
sample = "250ms"
[hosts.cl]
[hosts.srv]
[[links]]
a = "cl"
b = "srv"
bw = 50
delay = "2ms"
capture = true
[[programs]]
host = "srv"
run = "exec iperf3 -s -p 5201"
background = true
[[programs]]
host = "cl"
run = "exec iperf3 -c srv -p 5201 -t 2 -J"
at = "0.5s"
[[events]]
at = "1.5s"
link = "cl-srv"
set = { bw = 30 }
"#;
    let file = t.write("res.toml", text_of_lab);
    let dir = t.run_ok(&file, "results");
    t.assert_gone();

    assert_eq!(read(&dir.join("lab.toml")), read(&file), "lab.toml is the lab file");
    let topology = read(&dir.join("topology.txt"));
    for want in ["host cl (plain)", "host srv (plain)", "link cl-srv", &format!("fl-lab.{}.cl", t.name)] {
        assert!(topology.contains(want), "topology.txt lacks {want:?}:\n{topology}");
    }
    let timeline = planned_and_events(&dir);
    for want in ["1.500,link cl-srv set rate_mbit=30", "0.500,start on cl (foreground): exec iperf3"] {
        assert!(timeline.iter().any(|l| l.starts_with(want)), "timeline.csv lacks {want:?}: {timeline:?}");
    }
    let meters = read(&dir.join("meters.csv"));
    assert!(meters.starts_with("time_s,name,value\n"), "{}", &meters[..80.min(meters.len())]);
    for dir_ in ["ab", "ba"] {
        let name = format!("link.cl-srv.{dir_}.bytes_delivered_total");
        assert!(last_meter(&dir, &name) > 1e5, "{name}: iperf3's traffic crossed the link");
    }
    assert_eq!(last_meter(&dir, "link.cl-srv.ab.rate_mbit"), 30.0, "the event changed the rate");

    let programs = dir.join("programs");
    for f in ["cl-1.out", "cl-1.err", "cl-1.status", "cl-1.json", "srv-1.out", "srv-1.err", "srv-1.status"] {
        assert!(programs.join(f).is_file(), "programs/{f} missing");
    }
    assert_eq!(read(&programs.join("cl-1.status")).trim(), "exit=0");
    let iperf: Json = serde_json::from_str(&read(&programs.join("cl-1.json"))).expect("cl-1.json is JSON");
    let sent = iperf["end"]["sum_sent"]["bits_per_second"].as_f64().expect("sum_sent") / 1e6;
    let got = iperf["end"]["sum_received"]["bits_per_second"].as_f64().expect("sum_received") / 1e6;
    assert!((5.0..=51.0).contains(&got), "{got:.2} Mbit/s over a link of 50 then 30 Mbit/s");

    for d in ["ab", "ba"] {
        let cap = dir.join("captures").join(format!("cl-srv.{d}.pcapng"));
        let n = pcapng_packets(&cap);
        assert!(n > 100, "{}: {n} packets", cap.display());
    }

    let report = read(&dir.join("report.md"));
    let row = report.lines().find(|l| l.starts_with("| cl-1 |")).unwrap_or_else(|| panic!("no cl-1 row:\n{report}"));
    assert!(row.contains(&format!("| {sent:.2} | {got:.2} |")), "iperf3 throughput {sent:.2}/{got:.2} in: {row}");
    let plots: Vec<String> =
        entries(path_str(&dir.join("plots"))).into_iter().filter(|p| p.ends_with(".svg")).collect();
    assert!(plots.contains(&"throughput.svg".to_string()), "plots: {plots:?}");
    for p in &plots {
        let svg = read(&dir.join("plots").join(p));
        assert!(svg.starts_with("<svg") && svg.len() > 1000, "plots/{p}");
        assert!(report.contains(&format!("plots/{p}")), "report.md links plots/{p}");
    }

    // `lab report DIR` writes the same report again.
    std::fs::remove_file(dir.join("report.md")).expect("remove report.md");
    let out = t.ok(&["lab", "report", path_str(&dir)]);
    assert!(out.contains("report.md"), "{out}");
    assert_eq!(read(&dir.join("report.md")), report, "report.md regenerated byte for byte");
}

/// A server that looks a name up when it starts (Python's `http.server` resolves the address it binds to) listens at
/// once on a host whose default route leads into the lab: the lab has no name server, and lookups fail at once. They
/// went to the machine's name server, out of the lab's reach, and the server listened only after about 8 s.
#[test]
fn a_server_that_looks_names_up_listens_at_once() {
    let Some(_serial) = privileged_serial() else { return };
    let t = TestLab::new("dns");
    let lab = format!(
        r#"[lab]
name = "{name}"
duration = "6s"
[hosts.h1]
[hosts.app]
stack = "{stack}"
[hosts.srv]
[[links]]
a = "h1"
b = "srv"
[[links]]
a = "app"
b = "srv"
[[programs]]
host = "srv"
run = "exec python3 -m http.server 8080 --directory /"
background = true
[[programs]]
host = "app"
run = "curl -sS --retry 3 --retry-connrefused --retry-delay 1 -o /dev/null -w '%{{http_code}}' http://srv:8080/"
at = "1s"
"#,
        name = t.name,
        stack = repo().join("stacks/app-default.toml").display()
    );
    let file = t.write("dns.toml", &lab);
    let dir = t.run_ok(&file, "results");
    t.assert_gone();
    let programs = dir.join("programs");
    assert_eq!(read(&programs.join("app-1.out")).trim(), "200", "curl: {}", read(&programs.join("app-1.err")));
}

/// `lab up --metrics`: every daemon of the lab (the wire's, a stacked host's), each in its namespace, serves its
/// meters on the host's loopback; the `prometheus.yml` written into the results is valid, and a real Prometheus
/// started with it scrapes every daemon (`up` 1), with the lab's emulated links among the series.
#[test]
fn lab_daemons_are_scraped_by_prometheus_with_the_written_configuration() {
    let Some(_serial) = privileged_serial() else { return };
    let t = TestLab::new("prom");
    let lab = format!(
        "[lab]\nname = \"{name}\"\nduration = \"5s\"\n[hosts.st]\nstack = \"{stack}\"\n[hosts.srv]\n\
         [[links]]\na = \"st\"\nb = \"srv\"\nbw = 50\n",
        name = t.name,
        stack = repo().join("stacks/app-default.toml").display()
    );
    let file = t.write("prom.toml", &lab);
    let results = t.path("r");
    t.ok(&["lab", "up", path_str(&file), "--results", path_str(&results), "--metrics"]);
    let config = results.join("prometheus.yml");
    let check = Command::new("promtool").arg("check").arg("config").arg(&config).output().expect("promtool");
    assert!(check.status.success(), "promtool: {}", text(&check));
    let targets = read(&config).matches("targets:").count();
    assert_eq!(targets, 2, "the wire daemon and the stacked host's:\n{}", read(&config));
    let prom = common::prometheus::Prometheus::with_config(&config, tempfile::tempdir().unwrap());
    let deadline = Instant::now() + Duration::from_secs(30);
    let up = loop {
        let up = prom.query(&format!("up{{lab=\"{}\"}}", t.name));
        if up.len() == 2 && up.iter().all(|s| s["value"][1] == "1") || Instant::now() > deadline {
            break up;
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    let hosts: BTreeSet<&str> =
        up.iter().filter(|s| s["value"][1] == "1").filter_map(|s| s["metric"]["host"].as_str()).collect();
    assert_eq!(hosts, BTreeSet::from(["st", "wire"]), "every daemon scraped: {up:?}");
    // The wire daemon's emulators of link st-srv, one per direction, with the rate the lab gave them.
    let rates = prom.query(&format!("flexstack_emulator_rate_mbit{{lab=\"{}\", host=\"wire\"}}", t.name));
    let modules: BTreeSet<&str> = rates.iter().filter_map(|s| s["metric"]["module"].as_str()).collect();
    assert_eq!(modules, BTreeSet::from(["st-srv_ab", "st-srv_ba"]), "{rates:?}");
    assert!(rates.iter().all(|s| s["value"][1] == "50"), "50 Mbit/s: {rates:?}");
    t.ok(&["lab", "down", &t.name]);
    t.assert_gone();
}
