//! Running a built lab: programs at their times, events, meter sampling, progress, Ctrl-C, and the results folder.
//!
//! [`run`] executes [`Lab::timeline`] against the clock from the lab's start and writes, in the results folder:
//! `timeline.csv` (`time_s,planned_s,event`: what happened when; `planned_s` is empty for what was not scheduled,
//! a program's end or an interruption, so two runs of a lab file give the same planned and event columns),
//! `meters.csv` (`time_s,name,value`: the lab's meter patterns sampled every `sample`),
//! `programs/<host>-<n>.{out,err,status}` (n: the program's place among its host's programs in the file, from 1)
//! and `.json` when a program printed JSON (iperf3 -J), and `captures/*.pcapng`.
//!
//! Programs run with `sh -c` and get `LAB_NAME`, `LAB_HOST`, `LAB_RESULTS` and `LAB_SCRATCH` (a folder of their
//! host's, under the results, for files they serve or write) in their environment, and `FLEXSTACK_STATE_DIR`: the
//! state folder of the daemon their host's rules run in (the wire daemon for a plain host, the host's own daemon for
//! a stacked host), which the application libraries (clients/c, clients/python) read to find `apps.sock`.
//!
//! A `rules` event reads its rule file (relative to the lab file's folder, see [`rules_path`]) when it is due and
//! sends it as `flexstack rules load` does (a `RulesLoad` request). [`check_rules`] checks every rule file before
//! the lab is built.
//!
//! Meter names in the results: the wire daemon's emulator `<link>_ab` appears as `link.<link>.ab.<meter>` (and
//! `_ba` as `.ba.`), its other variables as `wire.<name>`; a stacked host's variables as `host.<host>.<name>`.

use crate::error::{msg, CliError};
use crate::lab::build::{set_knob, set_link_up, stop_processes, LabState};
use flexstack_api::client::Client;
use flexstack_api::ops::{Get, RulesLoad, TapAdd};
use flexstack_core::vars::name_matches;
use flexstack_core::Value;
use flexstack_lab::{Action, Lab, LinkParams};
use flexstack_rules::{Environment, Existence};
use serde_json::Value as Json;
use std::io::Write;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A program started by the lab.
struct Running {
    /// Its number among the programs of its host, in file order, from 1.
    number: usize,
    host: String,
    child: Child,
    stem: PathBuf,
    background: bool,
}

/// How a run ended.
#[derive(Debug)]
pub struct Outcome {
    /// True if Ctrl-C (SIGINT/SIGTERM) stopped it early.
    pub interrupted: bool,
    /// Foreground programs that exited with a failure: `(host-n, status)`.
    pub failed: Vec<(String, String)>,
}

/// The command that runs `argv` on `host` as the invoking user; on a stacked host through `flexstack run` with the
/// host's stack template, as the app `app` (whose modules' names the template derives from it).
pub fn host_command(state: &LabState, host: &str, app: Option<&str>, argv: &[String]) -> Result<Command, CliError> {
    let h = state.host(host)?;
    let mut cmd = Command::new("ip");
    if h.daemon_dir.is_some() {
        // `flexstack run` enters only the network namespace, as the host's daemon does (`ip netns exec` would give it
        // a mount namespace whose /sys has no cgroup hierarchy, and the app no cgroup of its own).
        cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{}", h.netns)).arg("--");
    } else {
        cmd.args(["netns", "exec", &h.netns]);
    }
    match (&h.daemon_dir, &h.template) {
        (Some(dir), Some(template)) => {
            // `flexstack run` drops to the invoking user itself (SUDO_UID), and passes signals on.
            cmd.arg(std::env::current_exe().map_err(msg)?).arg("--state-dir").arg(dir).arg("run");
            cmd.arg("--stack").arg(template);
            if let Some(name) = app {
                cmd.arg("--name").arg(name);
            }
            cmd.arg("--");
        }
        _ => {
            let (uid, gid) = crate::runner::invoking_user();
            if uid != 0 {
                cmd.args(["setpriv", "--reuid", &uid.to_string(), "--regid", &gid.to_string(), "--init-groups", "--"]);
            }
        }
    }
    cmd.args(argv);
    Ok(cmd)
}

fn start_program(state: &LabState, lab: &Lab, index: usize, dir: &Path) -> Result<Running, CliError> {
    let p = &lab.programs[index];
    let number = lab.programs[..=index].iter().filter(|q| q.host == p.host).count();
    let stem = dir.join(format!("{}-{number}", p.host));
    let file = |ext: &str| {
        let path = stem.with_extension(ext);
        std::fs::File::create(&path).map_err(|e| msg(format!("{}: {e}", path.display())))
    };
    let argv = ["sh".to_string(), "-c".to_string(), p.run.clone()];
    let scratch = scratch_dir(state, &p.host)?;
    let app = format!("{}-{number}", p.host);
    let child = host_command(state, &p.host, Some(&app), &argv)?
        .env("FLEXSTACK_STATE_DIR", rules_daemon(state, Some(&p.host))?)
        .env("LAB_NAME", &lab.name)
        .env("LAB_HOST", &p.host)
        .env("LAB_RESULTS", &state.results)
        .env("LAB_SCRATCH", &scratch)
        .stdin(Stdio::null())
        .stdout(file("out")?)
        .stderr(file("err")?)
        .process_group(0)
        .spawn()
        .map_err(|e| msg(format!("cannot start `{}` on {}: {e}", p.run, p.host)))?;
    Ok(Running { number, host: p.host.clone(), child, stem, background: p.background })
}

/// The host's scratch folder, `<results>/scratch/<host>`, created and owned by the user programs run as.
fn scratch_dir(state: &LabState, host: &str) -> Result<PathBuf, CliError> {
    let dir = state.results.join("scratch").join(host);
    std::fs::create_dir_all(&dir).map_err(|e| msg(format!("{}: {e}", dir.display())))?;
    let (uid, gid) = crate::runner::invoking_user();
    nix::unistd::chown(&dir, Some(nix::unistd::Uid::from_raw(uid)), Some(nix::unistd::Gid::from_raw(gid)))
        .map_err(|e| msg(format!("{}: {e}", dir.display())))?;
    Ok(dir)
}

/// Describes an exit status as the `.status` files do: `exit=N`, `signal=N`.
fn status_text(s: std::process::ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit={c}"),
        (None, Some(sig)) => format!("signal={sig}"),
        _ => "unknown".into(),
    }
}

/// Says on stderr that a results file could not be written (the lab goes on: its other results still count).
fn warn_unwritten(path: &Path, e: &std::io::Error) {
    eprintln!("lab: cannot write {}: {e} (this result is missing or incomplete)", path.display());
}

/// Writes `.status` and, when stdout is JSON, `.json`.
fn finish_program(r: &Running, status: &str) {
    let path = r.stem.with_extension("status");
    if let Err(e) = std::fs::write(&path, format!("{status}\n")) {
        warn_unwritten(&path, &e);
    }
    if let Ok(text) = std::fs::read_to_string(r.stem.with_extension("out")) {
        if let Ok(json) = serde_json::from_str::<Json>(&text) {
            let path = r.stem.with_extension("json");
            if let Err(e) = std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap_or(text)) {
                warn_unwritten(&path, &e);
            }
        }
    }
}

/// The knob writes of a link parameter change, for both directions.
fn link_knobs(state: &LabState, link: &str, params: &LinkParams) -> Vec<(String, Json)> {
    let Some(l) = state.links.iter().find(|l| l.name == link) else { return Vec::new() };
    let mut out = Vec::new();
    for (k, v) in params.emulator_settings() {
        for e in [&l.emulator_ab, &l.emulator_ba] {
            out.push((format!("module.{e}.{k}"), serde_json::to_value(&v).unwrap_or(Json::Null)));
        }
    }
    out
}

/// Sets a link up or down, like a cable pulled out or plugged in: both directions of its emulators (frames on the
/// way are dropped, none pass), and its two interfaces in the wire namespace, so that both hosts' interfaces lose
/// their carrier and get it back (the hosts' kernels and stacked hosts' link faces see it).
pub fn link_up(state: &LabState, link: &str, up: bool) -> Result<(), CliError> {
    let l = state.links.iter().find(|l| l.name == link).ok_or_else(|| msg(format!("no link {link}")))?;
    let carrier = || -> Result<(), CliError> {
        for end in &l.wire_ends {
            set_link_up(&state.wire_netns, end, up)?;
        }
        Ok(())
    };
    // Down: the emulators first, so that nothing passes while the carrier goes; up: the carrier first.
    if up {
        carrier()?;
    }
    for e in [&l.emulator_ab, &l.emulator_ba] {
        set_knob(&state.wire_dir, &format!("module.{e}.up"), Json::Bool(up))?;
    }
    if !up {
        carrier()?;
    }
    Ok(())
}

/// Changes link parameters (both directions).
pub fn link_set(state: &LabState, link: &str, params: &LinkParams) -> Result<(), CliError> {
    for (name, value) in link_knobs(state, link, params) {
        set_knob(&state.wire_dir, &name, value)?;
    }
    Ok(())
}

/// Starts capturing what each direction of `link` delivers (after the emulator) to
/// `captures/<link>.<ab|ba>.pcapng`.
pub fn capture(state: &LabState, link: &str) -> Result<(), CliError> {
    let l = state.links.iter().find(|l| l.name == link).ok_or_else(|| msg(format!("no link {link}")))?;
    let dir = state.results.join("captures");
    std::fs::create_dir_all(&dir).map_err(|e| msg(format!("{}: {e}", dir.display())))?;
    let dir = std::path::absolute(&dir).map_err(msg)?;
    let mut wire = state.wire()?;
    for (e, tag) in [(&l.emulator_ab, "ab"), (&l.emulator_ba, "ba")] {
        let file = dir.join(format!("{link}.{tag}.pcapng")).display().to_string();
        wire.call(TapAdd { link: format!("{e}[out]"), file })?;
    }
    Ok(())
}

/// The state folder of the daemon that `host`'s knobs and rules live in: a stacked host's own daemon, else (a
/// plain host, or no host) the lab's wire daemon.
fn rules_daemon(state: &LabState, host: Option<&str>) -> Result<PathBuf, CliError> {
    match host {
        Some(h) => {
            let h = state.host(h)?;
            Ok(h.daemon_dir.clone().unwrap_or_else(|| state.wire_dir.clone()))
        }
        None => Ok(state.wire_dir.clone()),
    }
}

/// Where the rule file of a `rules` event is: `file` as written, relative to the folder of the lab file.
pub fn rules_path(lab_file: &Path, file: &str) -> PathBuf {
    lab_file.parent().unwrap_or(Path::new(".")).join(file)
}

/// An environment of daemons that do not exist yet: no variable exists now, and every name may appear (the lab's
/// modules, flows and applications come later), so a rule file is checked for everything but its names.
struct NoDaemonYet;

impl Environment for NoDaemonYet {
    fn get(&self, _: &str) -> Option<flexstack_core::Value> {
        None
    }
    fn set(&mut self, name: &str, _: flexstack_core::Value) -> Result<(), String> {
        Err(format!("{name}: no daemon yet"))
    }
    fn names(&self, _: &str) -> Vec<String> {
        Vec::new()
    }
    fn exists(&self, _: &str) -> Existence {
        Existence::Maybe
    }
}

/// Checks every `rules` event of `lab` (read from `lab_file`) before anything is created: the rule file must be
/// readable and its text must check (docs/rules.md) against no environment; warnings are allowed. Errors are
/// `RULEFILE:line:column: error: ...`, each followed by the event's place in the lab file.
pub fn check_rules(lab: &Lab, lab_file: &Path) -> Result<(), CliError> {
    for e in &lab.events {
        let Action::Rules { file, .. } = &e.action else { continue };
        let path = rules_path(lab_file, file);
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(&path).map_err(|err| {
            CliError::Config(format!(
                "{}: `rules` of this event: cannot read {shown} (relative paths are from the lab file's folder): {err}",
                e.location
            ))
        })?;
        if let Err(diags) = flexstack_rules::compile(&shown, &text, &flexstack_rules::Program::default(), &NoDaemonYet)
        {
            // Warnings are allowed: only the errors are reported.
            let lines: Vec<String> = diags
                .iter()
                .filter(|d| d.severity == flexstack_rules::Severity::Error)
                .map(|d| format!("{shown}:{d}"))
                .collect();
            return Err(CliError::Config(format!("{}\n(the rules of the event at {})", lines.join("\n"), e.location)));
        }
    }
    Ok(())
}

/// Loads a rule file into the daemon of `host` (or the wire daemon): the request `flexstack rules load` sends.
fn load_rules(state: &LabState, host: Option<&str>, file: &str) -> Result<(), CliError> {
    let path = rules_path(Path::new(&state.file), file);
    let text = std::fs::read_to_string(&path).map_err(|e| msg(format!("{}: cannot read: {e}", path.display())))?;
    let dir = rules_daemon(state, host)?;
    Client::connect(&dir)?.call(RulesLoad { name: path.display().to_string(), text })?;
    Ok(())
}

fn apply(state: &LabState, action: &Action) -> Result<(), CliError> {
    match action {
        Action::LinkDown { link } => link_up(state, link, false),
        Action::LinkUp { link } => link_up(state, link, true),
        Action::LinkSet { link, params } => link_set(state, link, params),
        Action::Capture { link } => capture(state, link),
        Action::Rules { host, file } => load_rules(state, host.as_deref(), file),
        Action::Knob { host, knob, value } => {
            let dir = match host {
                Some(h) => {
                    state.host(h)?.daemon_dir.clone().ok_or_else(|| msg(format!("{h} is not a stacked host")))?
                }
                None => state.wire_dir.clone(),
            };
            set_knob(&dir, knob, serde_json::to_value(value).unwrap_or(Json::Null))
        }
    }
}

/// Maps a wire daemon variable to its name in the results.
fn wire_name(state: &LabState, name: &str) -> String {
    if let Some((module, var)) = name.strip_prefix("module.").and_then(|r| r.split_once('.')) {
        for l in &state.links {
            if module == l.emulator_ab {
                return format!("link.{}.ab.{var}", l.name);
            }
            if module == l.emulator_ba {
                return format!("link.{}.ba.{var}", l.name);
            }
        }
    }
    format!("wire.{name}")
}

/// A meter's value for `meters.csv`: a number as JSON writes it, a boolean as 0 or 1; none for text and for a
/// float that is not finite (sent as `null`).
fn numeric(v: &Value) -> Option<String> {
    match v {
        Value::Bool(b) => Some(u8::from(*b).to_string()),
        Value::Str(_) => None,
        Value::F64(f) if !f.is_finite() => None,
        number => serde_json::to_string(number).ok(),
    }
}

/// Samples the meters matching the lab's patterns until `stop`, appending to `meters.csv`.
fn sampler(state: LabState, patterns: Vec<String>, every: Duration, start: Instant, stop: Arc<AtomicBool>) {
    let path = state.results.join("meters.csv");
    let mut out = match std::fs::File::create(&path) {
        Ok(f) => std::io::BufWriter::new(f),
        Err(e) => return warn_unwritten(&path, &e),
    };
    // The first failed write is reported; sampling goes on (a full disk may free up).
    let mut failed = false;
    let mut check = |r: std::io::Result<()>| {
        if let Err(e) = r {
            if !std::mem::replace(&mut failed, true) {
                warn_unwritten(&path, &e);
            }
        }
    };
    check(writeln!(out, "time_s,name,value"));
    let mut sources: Vec<(PathBuf, Option<String>)> = vec![(state.wire_dir.clone(), None)];
    sources.extend(state.hosts.iter().filter_map(|h| h.daemon_dir.clone().map(|d| (d, Some(h.name.clone())))));
    let mut clients: Vec<Option<Client>> = sources.iter().map(|_| None).collect();
    let mut next = start;
    while !stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        if now < next {
            std::thread::sleep((next - now).min(Duration::from_millis(50)));
            continue;
        }
        let t = (now - start).as_secs_f64();
        let mut rows: Vec<(String, String)> = Vec::new();
        for ((dir, host), client) in sources.iter().zip(clients.iter_mut()) {
            if client.is_none() {
                *client = Client::connect(dir).ok();
            }
            let Some(c) = client.as_mut() else { continue };
            match c.call(Get { names: vec!["**".into()] }) {
                Ok(values) => {
                    for (name, v) in values {
                        let shown = match host {
                            None => wire_name(&state, &name),
                            Some(h) => format!("host.{h}.{name}"),
                        };
                        if patterns.iter().any(|p| name_matches(p, &shown)) {
                            if let Some(value) = numeric(&v.value) {
                                rows.push((shown, value));
                            }
                        }
                    }
                }
                Err(_) => *client = None,
            }
        }
        rows.sort();
        for (name, value) in rows {
            check(writeln!(out, "{t:.3},{name},{value}"));
        }
        check(out.flush());
        next += every;
    }
}

/// Options of [`run`].
pub struct RunOptions {
    /// Run the whole timeline (`lab run`); false starts only the background programs (`lab up`).
    pub whole: bool,
    /// Print progress on stderr.
    pub progress: bool,
}

/// Quotes a CSV field when needed (RFC 4180).
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// Runs the lab's timeline (see the module docs). `interrupted` is set by SIGINT/SIGTERM.
pub fn run(state: &LabState, lab: &Lab, opts: &RunOptions, interrupted: &AtomicBool) -> Result<Outcome, CliError> {
    let programs_dir = state.results.join("programs");
    std::fs::create_dir_all(&programs_dir).map_err(|e| msg(format!("{}: {e}", programs_dir.display())))?;
    let timeline_path = state.results.join("timeline.csv");
    let mut timeline =
        std::fs::File::create(&timeline_path).map_err(|e| msg(format!("{}: {e}", timeline_path.display())))?;
    writeln!(timeline, "time_s,planned_s,event").map_err(msg)?;

    for l in &lab.links {
        if l.capture {
            capture(state, &l.name)?;
        }
    }
    let start = Instant::now();
    // The lab's 0 s on CLOCK_MONOTONIC (the same in every namespace): programs that stamp their own events with
    // that clock can put them on the lab's time axis (the handoff labs' TCP senders and sinks do).
    if let Ok(t) = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC) {
        let text = format!("monotonic_s {}.{:09}\n", t.tv_sec(), t.tv_nsec());
        std::fs::write(state.results.join("clock.txt"), text).map_err(msg)?;
    }
    let stop_sampling = Arc::new(AtomicBool::new(false));
    let sampler_thread = {
        let (s, p, every, stop) = (state.clone(), lab.meters.clone(), lab.sample, stop_sampling.clone());
        std::thread::spawn(move || sampler(s, p, every, start, stop))
    };

    // The schedule: programs before events at the same instant, each in file order (as Lab::timeline).
    enum Item<'a> {
        Program(usize),
        Event(&'a Action),
    }
    let mut items: Vec<(Duration, Item<'_>)> = Vec::new();
    for (i, p) in lab.programs.iter().enumerate() {
        if opts.whole || p.background {
            items.push((if opts.whole { p.at } else { Duration::ZERO }, Item::Program(i)));
        }
    }
    if opts.whole {
        items.extend(lab.events.iter().map(|e| (e.at, Item::Event(&e.action))));
    }
    items.sort_by_key(|(at, item)| (*at, matches!(item, Item::Event(_))));

    let mut running: Vec<Running> = Vec::new();
    let mut finished: Vec<(Running, String)> = Vec::new();
    let mut last = String::from("started");
    let mut last_progress = Instant::now() - Duration::from_secs(10);
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let end = if opts.whole { lab.duration } else { Duration::ZERO };
    let mut pending = items.into_iter().peekable();
    let record = |timeline: &mut std::fs::File, planned: Option<Duration>, text: &str| {
        let t = start.elapsed().as_secs_f64();
        let planned = planned.map_or(String::new(), |p| format!("{:.3}", p.as_secs_f64()));
        if let Err(e) = writeln!(timeline, "{t:.3},{planned},{}", csv_field(text)) {
            warn_unwritten(&timeline_path, &e);
        }
    };
    loop {
        if interrupted.load(Ordering::SeqCst) {
            record(&mut timeline, None, "interrupted");
            break;
        }
        let now = start.elapsed();
        while let Some((at, _)) = pending.peek() {
            if *at > now {
                break;
            }
            let (at, item) = pending.next().expect("peeked");
            match item {
                Item::Program(i) => {
                    let r = start_program(state, lab, i, &programs_dir)?;
                    last = format!("started {}-{}: {}", r.host, r.number, lab.programs[i].run);
                    record(
                        &mut timeline,
                        Some(at),
                        &format!(
                            "start on {} ({}): {}",
                            r.host,
                            if r.background { "background" } else { "foreground" },
                            lab.programs[i].run
                        ),
                    );
                    running.push(r);
                }
                Item::Event(action) => {
                    let text = action.describe();
                    match apply(state, action) {
                        Ok(()) => record(&mut timeline, Some(at), &text),
                        Err(e) => {
                            eprintln!("lab {}: event `{text}` failed: {e}", lab.name);
                            record(&mut timeline, Some(at), &format!("FAILED {text}: {e}"));
                        }
                    }
                    last = text;
                }
            }
            if opts.progress && !tty {
                eprintln!("lab {}: {:>6.1}s  {last}", lab.name, start.elapsed().as_secs_f64());
            }
        }
        // Reap programs that ended.
        let mut i = 0;
        while i < running.len() {
            match running[i].child.try_wait() {
                Ok(Some(s)) => {
                    let r = running.remove(i);
                    let text = status_text(s);
                    finish_program(&r, &text);
                    record(&mut timeline, None, &format!("{}-{} ended: {text}", r.host, r.number));
                    finished.push((r, text));
                }
                _ => i += 1,
            }
        }
        if now >= end && pending.peek().is_none() {
            if opts.whole {
                record(&mut timeline, Some(end), &format!("end of lab {}", lab.name));
            }
            break;
        }
        if opts.progress
            && (tty || last_progress.elapsed() >= Duration::from_secs(5))
            && last_progress.elapsed() >= Duration::from_millis(500)
        {
            last_progress = Instant::now();
            let line = format!(
                "lab {}: {:.1}s / {:.0}s · {} running · {last}",
                lab.name,
                start.elapsed().as_secs_f64(),
                lab.duration.as_secs_f64(),
                running.len()
            );
            if tty {
                eprint!("\r\x1b[2K{}", line.chars().take(120).collect::<String>());
            } else {
                eprintln!("{line}");
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if opts.progress && tty {
        eprintln!();
    }
    stop_sampling.store(true, Ordering::SeqCst);
    let _ = sampler_thread.join();
    if !opts.whole {
        // `lab up`: the background programs keep running; `lab down` stops them.
        for r in running {
            std::mem::forget(r.child);
        }
        return Ok(Outcome { interrupted: false, failed: Vec::new() });
    }
    // The end: programs still running are stopped.
    let pids: Vec<u32> = running.iter().map(|r| r.child.id()).collect();
    stop_processes(&pids, Duration::from_secs(3));
    for mut r in running {
        let _ = r.child.wait();
        let text = "killed".to_string();
        finish_program(&r, &text);
        if !r.background {
            eprintln!("lab {}: {}-{} was still running at the end and was stopped", lab.name, r.host, r.number);
        }
        finished.push((r, text));
    }
    let failed = finished
        .iter()
        .filter(|(r, s)| !r.background && s.starts_with("exit=") && s != "exit=0")
        .map(|(r, s)| (format!("{}-{}", r.host, r.number), s.clone()))
        .collect();
    Ok(Outcome { interrupted: interrupted.load(Ordering::SeqCst), failed })
}
