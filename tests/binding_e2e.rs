//! End-to-end tests of late binding in real labs (issue 5): the committed lab files `labs/handoff-b2.toml` and
//! `labs/urgent-b2.toml`, run by the real binary with real kernel TCP/UDP in the apps' sandboxes, `late` and
//! `early` binding side by side in the same run. Short versions of what scripts/experiment-binding.sh measures:
//! one handoff run (late binding loses at most 2 packets below the binding point, early binding what its FIFO held,
//! and both flows continue over the second uplink), and one urgent-packet run of 10 repetitions (the urgent
//! packet's delay behind a 1,000-packet burst is far smaller with late binding).
//!
//! Each test copies its lab file with a name unique to this process, absolute paths to the stack templates and
//! helper scripts, and its own `--state-dir`; a guard runs `lab down --all` on that state folder when dropped.
//! Privileged: skipped with a printed reason when not root (see [`common::privileged`]). Ignored by default: with
//! the debug build's data plane the flows do not reach their rates; run them against the release build.

mod common;

use common::{bin, privileged, text, unique};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A copy of a committed lab file run from a temporary folder; `lab down --all` on drop.
struct Lab {
    dir: tempfile::TempDir,
    file: PathBuf,
}

impl Lab {
    /// Copies `labs/<file>` with a unique name and `edits` (`(from, to)` text replacements) applied.
    fn new(file: &str, tag: &str, edits: &[(&str, &str)]) -> Lab {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut text = std::fs::read_to_string(repo().join("labs").join(file)).expect("lab file");
        let name_line = text.lines().find(|l| l.starts_with("name = ")).expect("a name line").to_string();
        text = text.replace(&name_line, &format!("name = \"{}\"", unique(tag)));
        let root = repo().display().to_string();
        text = text.replace("\"../stacks/", &format!("\"{root}/stacks/"));
        text = text.replace("python3 scripts/", &format!("python3 {root}/scripts/"));
        for (from, to) in edits {
            assert!(text.contains(from), "{file} has no {from:?}");
            text = text.replace(from, to);
        }
        let path = dir.path().join(file);
        std::fs::write(&path, text).expect("write lab file");
        Lab { dir, file: path }
    }

    /// Runs the lab; returns its results folder.
    fn run(&self) -> PathBuf {
        let results = self.dir.path().join("results");
        let out = Command::new(bin())
            .arg("--state-dir")
            .arg(self.dir.path().join("state"))
            .args(["lab", "run", "-q"])
            .arg(&self.file)
            .arg("--results")
            .arg(&results)
            .stdin(Stdio::null())
            .output()
            .expect("run flexstack");
        assert!(out.status.success(), "lab run {}: {}", self.file.display(), text(&out));
        let timeline = std::fs::read_to_string(results.join("timeline.csv")).expect("timeline");
        assert!(!timeline.contains("FAILED"), "an event failed:\n{timeline}");
        results
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let _ = Command::new(bin())
            .arg("--state-dir")
            .arg(self.dir.path().join("state"))
            .args(["lab", "down", "--all"])
            .stdin(Stdio::null())
            .output();
    }
}

#[test]
#[ignore = "timing: the debug data plane is too slow for 5-10 Mbit/s pacing; run `cargo test --release --test binding_e2e -- --ignored`"]
fn handoff_late_binding_loses_at_most_two_packets_early_binding_its_fifo() {
    if !privileged("handoff_late_binding_loses_at_most_two_packets_early_binding_its_fifo") {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let lab = Lab::new("handoff-b2.toml", "ho", &[]);
    let results = lab.run();
    let out = Command::new("python3")
        .arg(repo().join("scripts/experiments/handoff_results.py"))
        .arg(&results)
        .output()
        .expect("python3");
    assert!(out.status.success(), "handoff_results.py: {}", text(&out));
    let s: Json = serde_json::from_slice(&out.stdout).expect("JSON summary");
    let f = |host: &str, key: &str| s[host][key].as_f64().unwrap_or_else(|| panic!("{host}.{key} in {s}"));
    assert_eq!(f("late", "device_queue"), 2.0);
    assert_eq!(f("early", "device_queue"), 2.0);
    let (late, early) = (f("late", "lost_below_binding_point"), f("early", "lost_below_binding_point"));
    assert!(late <= 2.0, "late binding lost {late} packets below the binding point");
    // Early binding loses its FIFO: whatever TCP had queued on wlan (a standing queue of tens of packets or more).
    assert!(early >= 10.0 && early > late + 8.0, "early binding lost {early}, late {late}");
    for host in ["late", "early"] {
        let (before, after) = (f(host, "throughput_before_mbit"), f(host, "throughput_after_mbit"));
        assert!(before > 2.5, "{host}: {before} Mbit/s before the handoff");
        // The flow continues over lte: the 2 s after the first one after the handoff carry data too.
        let late_bins: f64 = s[host]["throughput_bins"]
            .as_array()
            .expect("bins")
            .iter()
            .filter_map(|b| Some((b[0].as_f64()?, b[1].as_f64()?)))
            .filter(|(t, _)| (8.0..10.0).contains(t))
            .map(|(_, v)| v)
            .sum::<f64>()
            / 20.0;
        assert!(late_bins > 2.5, "{host}: {late_bins} Mbit/s from 8 to 10 s (after {after} in the first second)");
    }
}

/// The queue delays (ms: marker to urgent at the receiver minus the sender's own marker-to-urgent time) a
/// udp_urgent.py receiver printed; a lost marker or urgent packet is `None`.
fn delays(file: &Path) -> Vec<Option<f64>> {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    text.lines().skip(1).map(|l| l.split(',').nth(5).and_then(|d| d.parse().ok())).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[test]
#[ignore = "timing: the debug data plane is too slow for 5-10 Mbit/s pacing; run `cargo test --release --test binding_e2e -- --ignored`"]
fn urgent_packets_wait_only_for_the_device_buffer_with_late_binding() {
    if !privileged("urgent_packets_wait_only_for_the_device_buffer_with_late_binding") {
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let lab = Lab::new(
        "urgent-b2.toml",
        "ur",
        &[("duration = \"90s\"", "duration = \"19s\""), ("--reps 50", "--reps 10"), ("--timeout 89", "--timeout 18")],
    );
    let results = lab.run();
    let late = delays(&results.join("programs/lr1-1.out"));
    let early = delays(&results.join("programs/er1-1.out"));
    assert_eq!(late.len(), 10, "late: {late:?}");
    assert_eq!(early.len(), 10, "early: {early:?}");
    let late: Vec<f64> = late.into_iter().flatten().collect();
    let early: Vec<f64> = early.into_iter().flatten().collect();
    assert!(late.len() >= 9 && early.len() >= 5, "urgent packets lost: late {late:?}, early {early:?}");
    let (ml, me) = (median(late.clone()), median(early.clone()));
    // Late: 2 packets of the device buffer and the one in transmission, 1.17 ms each at 10 Mbit/s, plus 1 ms (and
    // 2 ms of slack for a loaded two-core machine).
    assert!(ml <= 1.0 + 3.0 * 1.17 + 2.0, "late binding: median {ml} ms ({late:?})");
    // Early: behind the burst in the FIFO, hundreds of ms.
    assert!(me > 100.0 && me > 20.0 * ml, "early binding: median {me} ms vs late {ml} ms ({early:?})");
}
