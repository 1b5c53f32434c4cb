//! The results report written from a small results folder built in a temporary directory, with real iperf3 -J
//! outputs (recorded on loopback, `tests/data/`): report.md's content, the SVG plots' series and event labels,
//! determinism, and located errors for malformed files.

use flexstack_lab::report::{write_report, ReportError, ReportOptions};
use std::fs;
use std::path::{Path, PathBuf};

const LAB: &str = r#"
[lab]
name = "rep"
duration = "12s"
seed = 7

[hosts.h1]
[hosts.srv]

[[links]]
a = "h1"
b = "srv"
bw = 20
delay = "10ms"

[[programs]]
host = "srv"
run = "iperf3 -s -J"
background = true
[[programs]]
host = "h1"
run = "iperf3 -c srv -t 2 -J"
at = "1s"
[[programs]]
host = "h1"
run = "iperf3 -c srv -u -b 10M -t 2 -J"
at = "4s"
[[programs]]
host = "h1"
run = "iperf3 -c nowhere -J"
at = "7s"

[[events]]
at = "6s"
link = "h1-srv"
set = { delay = "50ms" }
"#;

const TIMELINE: &str = "time_s,planned_s,event\n\
0.001,0,start on srv (background): iperf3 -s -J\n\
1.002,1,start on h1 (foreground): iperf3 -c srv -t 2 -J\n\
4.001,4,start on h1 (foreground): iperf3 -c srv -u -b 10M -t 2 -J\n\
6.003,6,\"link h1-srv set delay_ms=50, for the test\"\n\
7.001,7,start on h1 (foreground): iperf3 -c nowhere -J\n\
12.000,12,end of lab rep\n";

/// `ab` sends 1 MB/s (8 Mbit/s) all along but its counter restarts between 2 s and 3 s; `ba` sends 125 kB/s; drops
/// and a gauge.
fn meters() -> String {
    let mut s = String::from("time_s,name,value\n");
    for t in 0..=6 {
        let ab = if t < 3 { t * 1_000_000 } else { (t - 2) * 1_000_000 };
        s += &format!("{t},link.h1-srv.ab.tx_bytes_total,{ab}\n");
        s += &format!("{t},link.h1-srv.ba.tx_bytes_total,{}\n", t * 125_000);
        s += &format!("{t},link.h1-srv.ab.drop_loss_total,{}\n", t * 2);
        s += &format!("{t},link.h1-srv.ab.queued,{}\n", t % 3);
        s += &format!("{t},host.h1.module.c.frames_total,{}\n", t * 100);
    }
    s
}

fn data(name: &str) -> String {
    fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)).unwrap()
}

fn folder() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    fs::write(d.join("lab.toml"), LAB).unwrap();
    fs::write(d.join("timeline.csv"), TIMELINE).unwrap();
    fs::write(d.join("meters.csv"), meters()).unwrap();
    let p = d.join("programs");
    fs::create_dir(&p).unwrap();
    for (stem, json, status) in [
        ("h1-1", "iperf3-tcp-client.json", "exit=0"),
        ("h1-2", "iperf3-udp-client.json", "exit=0"),
        ("h1-3", "iperf3-error.json", "exit=1"),
    ] {
        fs::write(p.join(format!("{stem}.json")), data(json)).unwrap();
        fs::write(p.join(format!("{stem}.status")), format!("{status}\n")).unwrap();
        fs::write(p.join(format!("{stem}.err")), "").unwrap();
    }
    // A server run without -1 prints one JSON document per test: the runner writes no .json (stdout is not one
    // JSON value), so the report reads the .out of an `iperf3 ... -J` command.
    let two_tests = format!("{}{}", data("iperf3-udp-server.json"), data("iperf3-tcp-server.json"));
    fs::write(p.join("srv-1.out"), two_tests).unwrap();
    fs::write(p.join("srv-1.status"), "killed\n").unwrap();
    dir
}

/// Every file under `dir`, sorted, with its bytes.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    for sub in [dir.to_path_buf(), dir.join("plots")] {
        for e in fs::read_dir(&sub).unwrap() {
            let path = e.unwrap().path();
            if path.is_file() {
                out.push((path.clone(), fs::read(&path).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// The SVG is one `<svg>` element whose elements open and close in balance.
fn assert_well_formed_svg(svg: &str, path: &Path) {
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{}", path.display());
    for tag in ["svg", "text", "g"] {
        let open = svg.matches(&format!("<{tag} ")).count() + svg.matches(&format!("<{tag}>")).count();
        let close = svg.matches(&format!("</{tag}>")).count();
        assert_eq!(open, close, "<{tag}> in {}", path.display());
    }
    assert_eq!(svg.matches('<').count(), svg.matches('>').count(), "{}", path.display());
}

#[test]
fn report_from_a_results_folder() {
    let dir = folder();
    let d = dir.path();
    let summary = write_report(d, &ReportOptions::default()).unwrap();
    let md = fs::read_to_string(&summary.report).unwrap();

    // Title, lab, timeline (the quoted event kept whole), regenerate line.
    assert!(md.starts_with("# Lab report: rep\n"), "{md}");
    assert!(md.contains("seed 7, duration 12s"), "{md}");
    assert!(md.contains("| 4 | 6.003 | 6.000 | link h1-srv set delay_ms=50, for the test |"), "{md}");
    assert!(md.contains("`flexstack lab report <dir>`"), "{md}");
    assert!(md.contains("| h1-srv | delay_ms=10 rate_mbit=20 | – |"), "{md}");

    // Programs: figures of the real iperf3 runs.
    assert!(
        md.contains("| h1-1 | h1 | `iperf3 -c srv -t 2 -J` | exit 0 | TCP client | 22886.41 | 22879.29 | 37 | – |"),
        "{md}"
    );
    assert!(
        md.contains(
            "| h1-2 | h1 | `iperf3 -c srv -u -b 10M -t 2 -J` | exit 0 | UDP client | 10.09 | 10.09 | – | 0.00 |"
        ),
        "{md}"
    );
    assert!(
        md.contains("| srv-1 | srv | `iperf3 -s -J` | stopped at lab end | #1 UDP server | – | 10.09 | – | 0.00 |"),
        "{md}"
    );
    assert!(md.contains("| srv-1 | srv | `iperf3 -s -J` | stopped at lab end | #2 TCP server | "), "{md}");
    assert!(md.contains("| h1-3 | h1 | `iperf3 -c nowhere -J` | exit 1 | error (see notes) |"), "{md}");
    assert!(md.contains("- h1-3 test 1: iperf3 reported an error: unable to connect to server: Connection refused"));

    // Link totals: ab counted 2 MB before its restart and 4 MB from it; drops by reason as their own column.
    assert!(md.contains("| meter | h1-srv.ab | h1-srv.ba |\n|---|---|---|\n"), "{md}");
    assert!(md.contains("| drop_loss_total | 12 | – |\n| tx_bytes_total | 6000000 | 750000 |\n\n"), "{md}");

    // Plots: throughput, link rates, link drops (values); all embedded.
    let names: Vec<String> =
        summary.plots.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["throughput.svg", "meters-1-rate.svg", "meters-2-value.svg"]);
    for n in &names {
        assert!(md.contains(&format!("](plots/{n})")), "{n} not embedded:\n{md}");
    }
    let events = ["6.003s link h1-srv set delay_ms=50, for the test", "12s end of lab rep"];
    for p in &summary.plots {
        let svg = fs::read_to_string(p).unwrap();
        assert_well_formed_svg(&svg, p);
        for e in events {
            assert!(svg.contains(e), "event label {e:?} missing in {}", p.display());
        }
    }
    let throughput = fs::read_to_string(&summary.plots[0]).unwrap();
    for s in [
        "h1-1: iperf3 -c srv -t 2 -J",
        "h1-2: iperf3 -c srv -u -b 10M -t 2 -J",
        "srv-1 #1: iperf3 -s -J",
        "srv-1 #2: iperf3 -s -J",
        "Mbit/s",
    ] {
        assert!(throughput.contains(s), "series {s:?} missing");
    }
    assert!(!throughput.contains("h1-3:"), "a failed test has no intervals to plot");
    let rates = fs::read_to_string(&summary.plots[1]).unwrap();
    assert!(rates.contains("link.h1-srv.ab.tx_bytes_total") && rates.contains("link.h1-srv.ba.tx_bytes_total"));
    // 1 MB/s = 8 Mbit/s from every pair of samples, the restart included: the first series' line is flat.
    let line = rates.lines().find(|l| l.contains("<polyline") && l.contains("stroke-width=\"2\"")).unwrap();
    let ys: Vec<&str> =
        line.split("points=\"").nth(1).unwrap().split_whitespace().filter_map(|p| p.split(',').nth(1)).collect();
    assert_eq!(ys.len(), 6, "{line}");
    assert!(ys.iter().all(|y| *y == ys[0]), "not flat: {line}");
    assert!(rates.contains("\n8\n</text>"), "the y axis reaches 8 (Mbit/s)");
    let drops = fs::read_to_string(&summary.plots[2]).unwrap();
    assert!(drops.contains("link.h1-srv.ab.drop_loss_total") && !drops.contains("queued"));

    // Deterministic: the same folder gives the same bytes.
    let first = snapshot(d);
    write_report(d, &ReportOptions::default()).unwrap();
    assert_eq!(first, snapshot(d));
}

#[test]
fn chosen_meter_groups_and_stale_plots() {
    let dir = folder();
    let d = dir.path();
    write_report(d, &ReportOptions::default()).unwrap();
    let options = ReportOptions { meter_groups: vec!["host.*.module.*.frames_total".into(), "nothing.*".into()] };
    let summary = write_report(d, &options).unwrap();
    let names: Vec<String> =
        summary.plots.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["throughput.svg", "meters-1-pps.svg"], "plots of the earlier report are gone");
    assert_eq!(fs::read_dir(d.join("plots")).unwrap().count(), 2);
    let md = fs::read_to_string(&summary.report).unwrap();
    assert!(md.contains("- `nothing.*`: no meter matched"), "{md}");
    let pps = fs::read_to_string(&summary.plots[1]).unwrap();
    assert!(pps.contains("host.h1.module.c.frames_total") && pps.contains("packets/s"));
}

#[test]
fn missing_files_are_noted_and_the_planned_timeline_used() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("lab.toml"), LAB).unwrap();
    let summary = write_report(dir.path(), &ReportOptions::default()).unwrap();
    assert_eq!(summary.plots.len(), 0);
    let md = fs::read_to_string(&summary.report).unwrap();
    assert!(md.contains("(planned, from lab.toml: no timeline.csv was written)"), "{md}");
    assert!(md.contains("| 4 | 6.000 | 6.000 | link h1-srv set delay_ms=50 |"), "{md}");
    assert!(md.contains("No program output.") && md.contains("no meters.csv"), "{md}");
    assert_eq!(summary.notes.len(), 3, "{:?}", summary.notes);
}

#[test]
fn malformed_files_give_located_errors() {
    let dir = folder();
    let d = dir.path();
    fs::write(d.join("meters.csv"), "time_s,name,value\n1,a.b,2\n2,a.b,lots\n").unwrap();
    let e = write_report(d, &ReportOptions::default()).unwrap_err();
    assert!(matches!(e, ReportError::Parse(_)));
    let want = format!(
        "{}:3:7: `value`: expected a finite number or true/false, got \"lots\"",
        d.join("meters.csv").display()
    );
    assert_eq!(e.to_string(), want);

    fs::write(d.join("meters.csv"), meters()).unwrap();
    fs::write(d.join("programs/h1-1.status"), "exit=ok\n").unwrap();
    let e = write_report(d, &ReportOptions::default()).unwrap_err();
    assert!(e.to_string().contains("h1-1.status:1:6: expected one line"), "{e}");

    // A program's unreadable JSON is noted, not fatal.
    fs::write(d.join("programs/h1-1.status"), "exit=0\n").unwrap();
    fs::write(d.join("programs/h1-1.json"), &data("iperf3-tcp-client.json")[..300]).unwrap();
    let summary = write_report(d, &ReportOptions::default()).unwrap();
    assert!(
        summary.notes.iter().any(|n| n.starts_with("unreadable iperf3 output: programs/h1-1.json:")),
        "{:?}",
        summary.notes
    );
    let md = fs::read_to_string(&summary.report).unwrap();
    assert!(md.contains("| h1-1 | h1 | `iperf3 -c srv -t 2 -J` | exit 0 | unreadable (see notes) |"), "{md}");

    fs::write(d.join("lab.toml"), "[lab]\nname = \"x\"\n").unwrap();
    let e = write_report(d, &ReportOptions::default()).unwrap_err();
    assert!(e.to_string().contains("lab.toml:1:2: [lab] needs `duration`"), "{e}");
    fs::remove_file(d.join("lab.toml")).unwrap();
    assert!(matches!(write_report(d, &ReportOptions::default()), Err(ReportError::Io { .. })));
}
