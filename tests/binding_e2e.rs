//! End-to-end tests of late binding in real labs (issue 5): the committed lab files `labs/handoff-b2.toml` and
//! `labs/urgent-b2.toml`, run by the real binary with real kernel TCP/UDP in the apps' sandboxes, `late` and
//! `early` binding side by side in the same run. Short versions of what scripts/experiment-binding.sh measures:
//! one handoff run (late binding loses at most 2 packets below the binding point, early binding what its FIFO held,
//! and both flows continue over the second uplink, the late one at >= 80 % of its rate), and one urgent-packet run
//! of 10 repetitions (late binding: the urgent packet waits only for the device buffer; early binding: behind the
//! whole 1,000-packet burst).
//!
//! Each test copies its lab file with a name unique to this process, absolute paths to the stack templates and
//! helper scripts, and its own `--state-dir`; a guard runs `lab down --all` on that state folder when dropped.
//! Privileged: skipped with a printed reason when not root (see [`common::privileged`]). They pace real flows at
//! 5-20 Mbit/s, which the optimized data plane does (`cargo test --profile ci`, as scripts/test.sh runs the suite;
//! about 35 s for both); a debug build's data plane may not, and then they fail on timing.

mod common;

use common::{path_str, privileged_serial, repo, text, upper_median, LabScratch};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};
use std::process::Command;
/// A copy of a committed lab file run from a temporary folder ([`LabScratch`]: `lab down --all` on drop).
struct Lab {
    scratch: LabScratch,
    file: PathBuf,
}

impl Lab {
    /// Copies `labs/<file>` with a unique name and `edits` (`(from, to)` text replacements) applied.
    fn new(file: &str, tag: &str, edits: &[(&str, &str)]) -> Lab {
        let scratch = LabScratch::new(tag);
        let mut text = std::fs::read_to_string(repo().join("labs").join(file)).expect("lab file");
        let name_line = text.lines().find(|l| l.starts_with("name = ")).expect("a name line").to_string();
        text = text.replace(&name_line, &format!("name = \"{}\"", scratch.name));
        let root = repo().display().to_string();
        text = text.replace("\"../stacks/", &format!("\"{root}/stacks/"));
        text = text.replace("python3 scripts/", &format!("python3 {root}/scripts/"));
        for (from, to) in edits {
            assert!(text.contains(from), "{file} has no {from:?}");
            text = text.replace(from, to);
        }
        let path = scratch.path(file);
        std::fs::write(&path, text).expect("write lab file");
        Lab { scratch, file: path }
    }

    /// Runs the lab; returns its results folder.
    fn run(&self) -> PathBuf {
        let results = self.scratch.path("results");
        let out = self.scratch.cli(&["lab", "run", "-q", path_str(&self.file), "--results", path_str(&results)]);
        assert!(out.status.success(), "lab run {}: {}", self.file.display(), text(&out));
        let timeline = std::fs::read_to_string(results.join("timeline.csv")).expect("timeline");
        assert!(!timeline.contains("FAILED"), "an event failed:\n{timeline}");
        results
    }
}

#[test]
fn handoff_late_binding_loses_at_most_two_packets_early_binding_its_fifo() {
    let Some(_serial) = privileged_serial() else { return };
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
    for host in ["late", "early"] {
        eprintln!(
            "{host}: lost below the binding point {} (held before {}), link drop {}, throughput {:.2} -> {:.2} Mbit/s \
             (ratio {:.2}), retransmissions in 3 s {}",
            f(host, "lost_below_binding_point"),
            f(host, "held_below_binding_point_before_handoff"),
            f(host, "link_dropped_at_down"),
            f(host, "throughput_before_mbit"),
            f(host, "throughput_after_mbit"),
            f(host, "throughput_ratio"),
            f(host, "retransmissions_after_handoff"),
        );
    }
    assert_eq!(f("late", "device_queue"), 2.0);
    assert_eq!(f("early", "device_queue"), 2.0);
    // Acceptance: late binding with a 2-packet device buffer loses at most 2 packets at the handoff (the one not
    // yet started and the one on the wire, at most).
    let (late, early) = (f("late", "lost_below_binding_point"), f("early", "lost_below_binding_point"));
    assert!(late <= 2.0, "late binding lost {late} packets below the binding point");
    // Early binding loses what its FIFO and device queue held. They were sampled up to 100 ms before the handoff;
    // in 100 ms the 5 Mbit/s link drains about 43 full-size packets and TCP refills the queue at most as fast,
    // so the loss is within 45 of that sample. TCP keeps a standing queue of tens of packets or more.
    let held = f("early", "held_below_binding_point_before_handoff");
    assert!(early >= 10.0 && (early - held).abs() <= 45.0, "early binding lost {early}, held {held} before");
    for host in ["late", "early"] {
        // Both flows filled their 5 Mbit/s uplink before the handoff (payload is 94 % of the bytes on the wire).
        let before = f(host, "throughput_before_mbit");
        assert!(before >= 4.0, "{host}: {before} Mbit/s before the handoff");
        // The flow continues over lte: 8-10 s (the 2 s after the first one after the handoff) carry data too.
        let later: f64 = s[host]["throughput_bins"]
            .as_array()
            .expect("bins")
            .iter()
            .filter_map(|b| Some((b[0].as_f64()?, b[1].as_f64()?)))
            .filter(|(t, _)| (8.0..10.0).contains(t))
            .map(|(_, v)| v)
            .sum::<f64>()
            / 20.0;
        assert!(later >= 3.0, "{host}: {later} Mbit/s from 8 to 10 s");
    }
    // Acceptance: the late-binding flow keeps at least 80 % of its throughput in the second after the handoff.
    let ratio = f("late", "throughput_ratio");
    assert!(ratio >= 0.8, "late binding: throughput after / before the handoff {ratio}");
}

/// The queue delays (ms: marker to urgent at the receiver minus the sender's own marker-to-urgent time) a
/// udp_urgent.py receiver printed; a lost marker or urgent packet is `None`.
fn delays(file: &Path) -> Vec<Option<f64>> {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    text.lines().skip(1).map(|l| l.split(',').nth(5).and_then(|d| d.parse().ok())).collect()
}

/// Transmission time of one 1428-byte packet of the urgent lab (with the modelled 38 bytes of Ethernet overhead)
/// on its 20 Mbit/s wlan link, ms.
const PACKET_MS: f64 = (1428.0 + 38.0) * 8.0 / 20e6 * 1000.0;

#[test]
fn urgent_packets_wait_only_for_the_device_buffer_with_late_binding() {
    let Some(_serial) = privileged_serial() else { return };
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
    let (ml, me) = (upper_median(late.clone()), upper_median(early.clone()));
    eprintln!("urgent queue delay, median of 10: late {ml:.2} ms, early {me:.2} ms");
    // Functional claim: with late binding the urgent packet does not wait behind the burst. The acceptance bound
    // (median <= 1 ms + the transmission time of the 3 packets below the binding point, 2.76 ms) is measured by
    // scripts/experiment-binding.sh with 50 repetitions (BENCHMARKS.md); here the delay is the receiver's
    // marker-to-urgent time minus the sender's own, and scheduling noise on a loaded two-core CI machine spans
    // -8 to +16 ms, so the test asserts an order of magnitude against the burst's 586 ms instead: waiting behind
    // even 5 % of the burst (29 ms) fails.
    let bound = 0.05 * 1000.0 * PACKET_MS;
    assert!(ml <= bound, "late binding: median {ml} ms > {bound} ms ({late:?})");
    // Early binding: the urgent packet waits behind the whole burst in the interface's FIFO (1,000 packets:
    // 586 ms, less the sender's own marker-to-urgent time of tens of ms); below 80 % of that, something is off.
    assert!(me >= 0.8 * 1000.0 * PACKET_MS, "early binding: median {me} ms ({early:?})");
}
