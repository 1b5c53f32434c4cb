//! The results report: turns a lab run's results folder into `report.md` and `plots/*.svg`.
//!
//! Call [`write_report`] with the folder and [`ReportOptions`]; it reads the folder, parses every file (with the
//! parsers of [`data`], errors located at `file:line:column`), draws the plots with [`plot`] and writes
//! `report.md` next to them. `flexstack lab report <dir>` is the command behind it.
//!
//! # The folder (written by the lab runner)
//!
//! ```text
//! results/<lab>-<YYYYmmdd-HHMMSS>/
//!   lab.toml                 the resolved lab (parsed with `Lab::parse`); required
//!   timeline.csv             time_s,planned_s,event — every event as it happened; planned_s may be empty
//!   meters.csv               time_s,name,value — one row per sample of a meter
//!   programs/<host>-<n>.out / .err / .json / .status
//!   captures/*.pcapng, logs/*.log
//! ```
//!
//! `<n>` is the program's place among its host's `[[programs]]` in `lab.toml`, counted from 1 (file order). `.status` holds one line, `exit=<code>`, `signal=<n>`, `killed` or `unknown`. The CSV files are RFC 4180: a
//! field with a comma or a quote is quoted. A missing `timeline.csv` (the lab's planned timeline is used instead)
//! or `meters.csv` or `programs/` is noted in the report; a malformed CSV, status or `lab.toml` is an error. A
//! program's JSON output that cannot be read (a server killed while writing, say) is noted, not fatal; neither is
//! an iperf3 test that failed (its `error`).
//!
//! # What it writes
//!
//! - `plots/throughput.svg`: the throughput of every iperf3 test over lab time (one line each, client and server
//!   side), placed at the program's start time (`at` in `lab.toml`); a server's test is placed at the client test
//!   with the same iperf3 cookie when there is one.
//! - `plots/meters-<i>-<kind>.svg`: for each meter name pattern of [`ReportOptions::meter_groups`] (wildcards as in
//!   `flexstack_core::vars::name_matches`), the matching meters, one plot per kind: byte counters as Mbit/s and
//!   packet counters as packets/s (rates from successive samples, counter restarts handled, see
//!   [`data::counter_rate`]), other meters as sampled.
//! - the lab's events as labelled vertical lines on every plot;
//! - `report.md`: title, lab name, seed and duration, hosts and links, the event timeline, the programs (host,
//!   command, exit status; iperf3 sender/receiver Mbit/s, retransmits or UDP loss %), per-link counter totals,
//!   the plots, notes, and how to regenerate it.
//!
//! Everything is sorted and no time of generation is written, so the same folder gives the same bytes. Earlier
//! `plots/*.svg` are removed first. Plots are SVG only: PNG would need a rasterizer and a font file.

pub mod data;
pub mod plot;

use crate::{format_duration, Lab};
use data::{ExitStatus, Iperf3Test, MeterKind, MeterSample, Protocol, Role, TimelineRow};
use flexstack_core::config::ConfigError;
use flexstack_core::vars::name_matches;
use plot::{Marker, Series, TimePlot};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The meter groups plotted when none are chosen: link throughput (byte counters) and link drops.
pub const DEFAULT_METER_GROUPS: &[&str] = &["link.**.*bytes*_total", "link.**.drop*"];

/// What to put in the report.
#[derive(Clone, Debug, PartialEq)]
pub struct ReportOptions {
    /// Meter name patterns, one group (plot) each; `*` matches within a dotted part, `**` across dots.
    pub meter_groups: Vec<String>,
}

impl Default for ReportOptions {
    /// [`DEFAULT_METER_GROUPS`].
    fn default() -> Self {
        ReportOptions { meter_groups: DEFAULT_METER_GROUPS.iter().map(|s| s.to_string()).collect() }
    }
}

/// What [`write_report`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct ReportSummary {
    /// The `report.md` written.
    pub report: PathBuf,
    /// The plots written, in report order.
    pub plots: Vec<PathBuf>,
    /// What was missing or unreadable but not fatal (also listed under "Notes" in the report).
    pub notes: Vec<String>,
}

/// Why no report was written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A file or folder could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file of the folder is malformed (located at file:line:column).
    #[error("{0}")]
    Parse(#[from] ConfigError),
    /// A plot could not be drawn.
    #[error("{}: {message}", path.display())]
    Plot {
        /// The plot's file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ReportError + '_ {
    move |source| ReportError::Io { path: path.to_path_buf(), source }
}

/// Reads `path`, or `None` if it does not exist.
fn read_optional(path: &Path) -> Result<Option<String>, ReportError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io(path)(e)),
    }
}

/// One program's files under `programs/`.
#[derive(Debug, Default)]
struct ProgramFiles {
    host: String,
    index: usize,
    /// Its place among all programs of lab.toml, from 0 (`usize::MAX` when not there): the report's order.
    order: usize,
    command: Option<String>,
    start_s: f64,
    status: Option<ExitStatus>,
    tests: Vec<Iperf3Test>,
    json_note: Option<String>,
}

impl ProgramFiles {
    fn id(&self) -> String {
        format!("{}-{}", self.host, self.index)
    }
}

/// Everything read from a results folder.
struct Results {
    folder: String,
    lab: Lab,
    timeline: Vec<TimelineRow>,
    timeline_planned: bool,
    meters: BTreeMap<String, Vec<(f64, f64)>>,
    programs: Vec<ProgramFiles>,
    notes: Vec<String>,
}

fn display_name(dir: &Path, rel: &str) -> String {
    dir.join(rel).display().to_string()
}

fn read_results(dir: &Path) -> Result<Results, ReportError> {
    let lab_path = dir.join("lab.toml");
    let lab_text = std::fs::read_to_string(&lab_path).map_err(io(&lab_path))?;
    let lab = Lab::parse(&lab_path.display().to_string(), &lab_text)?;
    let mut notes = Vec::new();

    let (timeline, timeline_planned) = match read_optional(&dir.join("timeline.csv"))? {
        Some(text) => (data::parse_timeline(&display_name(dir, "timeline.csv"), &text)?, false),
        None => {
            notes.push("no timeline.csv: the events shown are the lab's planned timeline".to_string());
            let planned = lab.timeline().into_iter().map(|(at, event)| TimelineRow {
                time_s: at.as_secs_f64(),
                planned_s: Some(at.as_secs_f64()),
                event,
            });
            (planned.collect(), true)
        }
    };

    let mut meters: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    match read_optional(&dir.join("meters.csv"))? {
        Some(text) => {
            for MeterSample { time_s, name, value } in data::parse_meters(&display_name(dir, "meters.csv"), &text)? {
                meters.entry(name).or_default().push((time_s, value));
            }
            for samples in meters.values_mut() {
                samples.sort_by(|a, b| a.0.total_cmp(&b.0));
            }
        }
        None => notes.push("no meters.csv: no meter was sampled".to_string()),
    }

    let programs = read_programs(dir, &lab, &mut notes)?;
    let folder = dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| dir.display().to_string());
    Ok(Results { folder, lab, timeline, timeline_planned, meters, programs, notes })
}

fn read_programs(dir: &Path, lab: &Lab, notes: &mut Vec<String>) -> Result<Vec<ProgramFiles>, ReportError> {
    let pdir = dir.join("programs");
    let entries = match std::fs::read_dir(&pdir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            notes.push("no programs/ folder: no program output".to_string());
            return Ok(Vec::new());
        }
        Err(e) => return Err(io(&pdir)(e)),
    };
    let mut stems: BTreeMap<(usize, String), ()> = BTreeMap::new();
    for entry in entries {
        let entry = entry.map_err(io(&pdir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((stem, ext)) = name.rsplit_once('.') else { continue };
        if !["out", "err", "json", "status"].contains(&ext) {
            continue;
        }
        match stem.rsplit_once('-').and_then(|(h, n)| Some((h, n.parse::<usize>().ok()?))) {
            Some((host, n)) if !host.is_empty() => {
                stems.insert((n, host.to_string()), ());
            }
            _ => notes.push(format!("programs/{name}: not named <host>-<n>.{ext}; ignored")),
        }
    }
    let mut out = Vec::new();
    for (index, host) in stems.into_keys() {
        let mut p = ProgramFiles { host, index, ..ProgramFiles::default() };
        let place = lab.programs.iter().enumerate().filter(|(_, lp)| lp.host == p.host).nth(index.wrapping_sub(1));
        p.order = place.map_or(usize::MAX, |(i, _)| i);
        match place.map(|(_, lp)| lp) {
            Some(lp) => {
                p.command = Some(lp.run.clone());
                p.start_s = lp.at.as_secs_f64();
            }
            None => notes.push(format!(
                "programs/{}.*: lab.toml has no program {index} (counted from 1) among those of host {}",
                p.id(),
                p.host
            )),
        }
        let status_path = pdir.join(format!("{}.status", p.id()));
        if let Some(text) = read_optional(&status_path)? {
            p.status = Some(data::parse_status(&status_path.display().to_string(), &text)?);
        }
        // iperf3 -J output: `.json`, or the `.out` of an `iperf3 ... -J` command if the runner kept it there. Read
        // as bytes: a program's output need not be UTF-8.
        let iperf3_json = p.command.as_deref().is_some_and(is_iperf3_json_command);
        for ext in ["json", "out"] {
            if ext == "out" && !iperf3_json {
                continue;
            }
            let path = pdir.join(format!("{}.{ext}", p.id()));
            let bytes = match std::fs::read(&path) {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io(&path)(e)),
            };
            let text = String::from_utf8_lossy(&bytes);
            if iperf3_json || data::looks_like_iperf3(&text) {
                match data::parse_iperf3(&format!("programs/{}.{ext}", p.id()), &text) {
                    Ok(tests) => p.tests = tests,
                    Err(e) => p.json_note = Some(e.to_string()),
                }
            }
            break;
        }
        if let Some(n) = &p.json_note {
            notes.push(format!("unreadable iperf3 output: {n}"));
        }
        for (k, t) in p.tests.iter().enumerate() {
            if let Some(e) = &t.error {
                notes.push(format!("{} test {}: iperf3 reported an error: {e}", p.id(), k + 1));
            }
        }
        out.push(p);
    }
    out.sort_by(|a, b| (a.order, &a.host, a.index).cmp(&(b.order, &b.host, b.index)));
    Ok(out)
}

/// True for an `iperf3 … -J` (or `--json`) command line.
fn is_iperf3_json_command(cmd: &str) -> bool {
    let mut words = cmd.split_whitespace();
    let first = words.next().unwrap_or("");
    first.rsplit('/').next() == Some("iperf3") && words.any(|w| w == "-J" || w == "--json")
}

/// Reads the results folder `dir` and writes `report.md` and `plots/*.svg` into it.
pub fn write_report(dir: &Path, options: &ReportOptions) -> Result<ReportSummary, ReportError> {
    let mut r = read_results(dir)?;
    let plots_dir = dir.join("plots");
    std::fs::create_dir_all(&plots_dir).map_err(io(&plots_dir))?;
    for entry in std::fs::read_dir(&plots_dir).map_err(io(&plots_dir))? {
        let path = entry.map_err(io(&plots_dir))?.path();
        if path.extension().is_some_and(|e| e == "svg") {
            std::fs::remove_file(&path).map_err(io(&path))?;
        }
    }

    let markers: Vec<Marker> =
        r.timeline.iter().map(|row| Marker { time_s: row.time_s, label: row.event.clone() }).collect();
    let duration_s = r.lab.duration.as_secs_f64();
    let mut written: Vec<(String, PathBuf)> = Vec::new();
    let mut save = |file: &str, section: String, plot: TimePlot| -> Result<(), ReportError> {
        let path = plots_dir.join(file);
        let svg = plot::time_plot(&plot).map_err(|message| ReportError::Plot { path: path.clone(), message })?;
        std::fs::write(&path, svg).map_err(io(&path))?;
        written.push((section, path));
        Ok(())
    };

    // (1) Throughput of every iperf3 test.
    let offsets = iperf3_offsets(&r.programs);
    let mut series = Vec::new();
    for p in &r.programs {
        for (k, t) in p.tests.iter().enumerate() {
            if t.intervals.is_empty() {
                continue;
            }
            let offset = offsets.get(&(p.id(), k)).copied().unwrap_or(p.start_s);
            let points = t
                .intervals
                .iter()
                .flat_map(|i| [(offset + i.start, i.bits_per_second / 1e6), (offset + i.end, i.bits_per_second / 1e6)])
                .collect();
            series.push(Series { name: test_name(p, k), points });
        }
    }
    let has_iperf3 = !series.is_empty();
    if has_iperf3 {
        let plot = TimePlot {
            title: format!("{}: iperf3 throughput", r.lab.name),
            y_label: "throughput (Mbit/s)".into(),
            series,
            markers: markers.clone(),
            min_time_s: duration_s,
        };
        save("throughput.svg", "Throughput (iperf3)".into(), plot)?;
    }

    // (2) One plot per meter group and kind.
    let mut group_lines = Vec::new();
    for (i, pattern) in options.meter_groups.iter().enumerate() {
        let mut by_kind: BTreeMap<MeterKind, Vec<Series>> = BTreeMap::new();
        for (name, samples) in r.meters.iter().filter(|(n, _)| name_matches(pattern, n)) {
            let kind = MeterKind::of(name);
            let points = match kind {
                MeterKind::Bytes => data::counter_rate(samples).into_iter().map(|(t, v)| (t, v * 8.0 / 1e6)).collect(),
                MeterKind::Packets => data::counter_rate(samples),
                MeterKind::Value => samples.clone(),
            };
            by_kind.entry(kind).or_default().push(Series { name: name.clone(), points });
        }
        if by_kind.is_empty() {
            group_lines.push(format!("- `{pattern}`: no meter matched"));
            continue;
        }
        for (kind, series) in by_kind {
            let (slug, y_label) = match kind {
                MeterKind::Bytes => ("rate", "rate (Mbit/s) from byte counters"),
                MeterKind::Packets => ("pps", "rate (packets/s) from counters"),
                MeterKind::Value => ("value", "value as sampled"),
            };
            let plot = TimePlot {
                title: format!(
                    "{}: {pattern} ({})",
                    r.lab.name,
                    if kind == MeterKind::Bytes { "Mbit/s" } else { kind.unit() }
                ),
                y_label: y_label.into(),
                series,
                markers: markers.clone(),
                min_time_s: duration_s,
            };
            save(&format!("meters-{}-{slug}.svg", i + 1), format!("`{pattern}` ({y_label})"), plot)?;
        }
    }

    let markdown = render_markdown(&mut r, &written, &group_lines, has_iperf3, dir);
    let report = dir.join("report.md");
    std::fs::write(&report, markdown).map_err(io(&report))?;
    Ok(ReportSummary { report, plots: written.into_iter().map(|(_, p)| p).collect(), notes: r.notes })
}

/// Where each iperf3 test starts on the lab's time axis, by (program id, test index): a server test with the same
/// cookie as a client test starts where the client's program started; others are left to their program's start.
fn iperf3_offsets(programs: &[ProgramFiles]) -> BTreeMap<(String, usize), f64> {
    let mut client_starts: BTreeMap<&str, f64> = BTreeMap::new();
    for p in programs {
        for t in &p.tests {
            if let (Some(Role::Client), Some(c)) = (t.role, t.cookie.as_deref()) {
                client_starts.insert(c, p.start_s);
            }
        }
    }
    let mut out = BTreeMap::new();
    for p in programs {
        for (k, t) in p.tests.iter().enumerate() {
            if let (Some(Role::Server), Some(start)) = (t.role, t.cookie.as_deref().and_then(|c| client_starts.get(c)))
            {
                out.insert((p.id(), k), *start);
            }
        }
    }
    out
}

fn test_name(p: &ProgramFiles, k: usize) -> String {
    let cmd = p.command.as_deref().unwrap_or("?");
    let cmd = plot::clip(cmd, 34);
    if p.tests.len() > 1 {
        format!("{} #{}: {cmd}", p.id(), k + 1)
    } else {
        format!("{}: {cmd}", p.id())
    }
}

/// True for a counter of bytes, packets or drops (`bytes_delivered_total`, `frames_total`, `drop_loss_total`).
fn is_total_worth_listing(meter: &str) -> bool {
    const WORDS: &[&str] = &["bytes", "packets", "frames", "delivered", "drop", "drops", "dropped", "lost", "loss"];
    meter.strip_suffix("_total").is_some_and(|stem| stem.split('_').any(|w| WORDS.contains(&w)))
}

/// Escapes text for a markdown table cell.
fn cell(text: &str) -> String {
    text.replace('\\', "\\\\").replace('|', "\\|").replace(['\n', '\r'], " ")
}

fn mbit(bps: Option<f64>) -> String {
    bps.map_or_else(|| "–".into(), |b| format!("{:.2}", b / 1e6))
}

/// A number as an integer when it is one.
fn count(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v:.3}")
    }
}

fn render_markdown(
    r: &mut Results,
    plots: &[(String, PathBuf)],
    group_lines: &[String],
    has_iperf3: bool,
    dir: &Path,
) -> String {
    let lab = &r.lab;
    let mut md = String::new();
    let _ = writeln!(md, "# Lab report: {}\n", lab.name);
    let _ = writeln!(md, "- lab: `{}`, seed {}, duration {}", lab.name, lab.seed, format_duration(lab.duration));
    let _ = writeln!(md, "- results folder: `{}`", r.folder);
    let _ = writeln!(md, "- regenerate: `flexstack lab report <dir>` with this folder as `<dir>`\n");

    let _ = writeln!(md, "## Hosts and links\n");
    let _ = writeln!(md, "| host | stack |\n|---|---|");
    for h in &lab.hosts {
        let _ = writeln!(md, "| {} | {} |", cell(&h.name), h.stack.as_deref().map_or("kernel (plain)".into(), cell));
    }
    if !lab.links.is_empty() {
        let _ = writeln!(md, "\n| link | emulator settings | mtu |\n|---|---|---|");
        for l in &lab.links {
            let settings: Vec<String> = l.emulator_settings().iter().map(|(k, v)| format!("{k}={v}")).collect();
            let mtu = l.mtu.map_or("–".into(), |m| m.to_string());
            let _ = writeln!(md, "| {} | {} | {mtu} |", cell(&l.name), cell(&settings.join(" ")));
        }
    }

    let _ = writeln!(md, "\n## Timeline\n");
    if r.timeline_planned {
        let _ = writeln!(md, "(planned, from lab.toml: no timeline.csv was written)\n");
    }
    let _ = writeln!(md, "| # | time (s) | planned (s) | event |\n|---|---|---|---|");
    for (i, row) in r.timeline.iter().enumerate() {
        let planned = row.planned_s.map_or("–".into(), |p| format!("{p:.3}"));
        let _ = writeln!(md, "| {} | {:.3} | {planned} | {} |", i + 1, row.time_s, cell(&row.event));
    }

    let _ = writeln!(md, "\n## Programs\n");
    if r.programs.is_empty() {
        let _ = writeln!(md, "No program output.");
    } else {
        let _ = writeln!(
            md,
            "| program | host | command | status | iperf3 | sender Mbit/s | receiver Mbit/s | retransmits | UDP loss % |\n|---|---|---|---|---|---|---|---|---|"
        );
        for p in &r.programs {
            let head = format!(
                "| {} | {} | {} | {} ",
                p.id(),
                cell(&p.host),
                p.command.as_deref().map_or("(not in lab.toml)".into(), |c| format!("`{}`", cell(c))),
                p.status.as_ref().map_or("(no status)".into(), ExitStatus::to_string)
            );
            if p.tests.is_empty() {
                let what = if p.json_note.is_some() { "unreadable (see notes)" } else { "–" };
                let _ = writeln!(md, "{head}| {what} | – | – | – | – |");
            }
            for (k, t) in p.tests.iter().enumerate() {
                let kind = match (t.protocol, t.role) {
                    (_, _) if t.error.is_some() => "error (see notes)".to_string(),
                    (Some(proto), role) => format!(
                        "{} {}",
                        if proto == Protocol::Tcp { "TCP" } else { "UDP" },
                        match role {
                            Some(Role::Client) => "client",
                            Some(Role::Server) => "server",
                            None => "",
                        }
                    )
                    .trim_end()
                    .to_string(),
                    (None, _) => "?".into(),
                };
                let kind = if p.tests.len() > 1 { format!("#{} {kind}", k + 1) } else { kind };
                let retr = t.retransmits().map_or("–".into(), |n| n.to_string());
                let loss = t.udp_loss_percent().map_or("–".into(), |l| format!("{l:.2}"));
                let _ = writeln!(
                    md,
                    "{head}| {kind} | {} | {} | {retr} | {loss} |",
                    mbit(t.sender_bps()),
                    mbit(t.receiver_bps())
                );
            }
        }
    }

    let _ = writeln!(md, "\n## Link totals\n");
    // `link.<link>.<direction>.<meter>` counters of bytes, packets and drops; a column per link direction.
    let mut totals: BTreeMap<&str, BTreeMap<&str, f64>> = BTreeMap::new();
    let mut directions = std::collections::BTreeSet::new();
    for (name, samples) in &r.meters {
        let parts: Vec<&str> = name.splitn(4, '.').collect();
        let [_, _, _, meter] = parts[..] else { continue };
        if parts[0] != "link" || meter.contains('.') || !is_total_worth_listing(meter) {
            continue;
        }
        let direction = &name[5..name.len() - meter.len() - 1];
        directions.insert(direction);
        totals.entry(meter).or_default().insert(direction, data::counter_total(samples));
    }
    if totals.is_empty() {
        let _ = writeln!(md, "No `link.<link>.<direction>.*_total` counter of bytes, packets or drops was sampled.");
    } else {
        let _ = writeln!(md, "Counted over the run (counter restarts included):\n");
        let _ = write!(md, "| meter |");
        for d in &directions {
            let _ = write!(md, " {} |", cell(d));
        }
        let _ = writeln!(md, "\n|---|{}", "---|".repeat(directions.len()));
        for (meter, values) in &totals {
            let _ = write!(md, "| {} |", cell(meter));
            for d in &directions {
                let _ = write!(md, " {} |", values.get(d).map_or("–".into(), |v| count(*v)));
            }
            let _ = writeln!(md);
        }
    }

    let _ = writeln!(md, "\n## Plots\n");
    let _ = writeln!(md, "The lab's events are drawn as labelled vertical lines.\n");
    if !has_iperf3 {
        let _ = writeln!(md, "No iperf3 test with intervals: no throughput plot.\n");
    }
    for (section, path) in plots {
        let file = path.strip_prefix(dir).unwrap_or(path).display().to_string();
        let _ = writeln!(md, "### {section}\n\n![{}]({file})\n", cell(section).replace(['[', ']'], ""));
    }
    for line in group_lines {
        let _ = writeln!(md, "{line}");
    }

    r.notes.sort();
    if !r.notes.is_empty() {
        let _ = writeln!(md, "\n## Notes\n");
        for n in &r.notes {
            let _ = writeln!(md, "- {}", n.replace('\n', " "));
        }
    }
    md
}
