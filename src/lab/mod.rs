//! `flexstack lab`: builds an experiment from a lab file (crates/lab), runs its programs and events, samples its
//! meters, and leaves a results folder with a report.
//!
//! - [`build`] creates a lab from its [`Plan`] (namespaces, veth pairs, addresses, routes, the wire daemon and the
//!   stacked hosts' daemons) and tears it down; it records what it creates in a state file first, so that
//!   `flexstack lab down` finds everything even after the runner was killed.
//! - [`run`] executes the timeline: programs, events, meter sampling, progress, Ctrl-C.
//!
//! The commands: `lab run FILE` (build, run for the lab's duration, tear down, write the report), `lab up FILE`
//! (build and start the background programs, leave it running), `lab exec HOST -- CMD`, `lab link A B
//! down|up|set K=V...`, `lab down [NAME] | --all`, `lab list`, `lab check FILE`, `lab report DIR`.

pub mod build;
pub mod progress;
pub mod run;

use crate::error::{msg, CliError};
use clap::{Args, Subcommand};
use flexstack_lab::plan::Plan;
use flexstack_lab::Lab;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub use build::{down, labs_dir, LabState};

/// What `lab run` and `lab up` take.
#[derive(Args, Debug)]
pub struct Start {
    /// The lab file (TOML).
    file: PathBuf,
    /// The results folder (default: `results/<lab>-<UTC time>`).
    #[arg(long)]
    results: Option<PathBuf>,
    /// No progress lines.
    #[arg(short, long)]
    quiet: bool,
    /// Serve each daemon's meters for Prometheus on this host's loopback (a free port each) and write the
    /// scrape configuration into the results (`prometheus.yml`).
    #[arg(long)]
    metrics: bool,
}

/// `flexstack lab ...`
#[derive(Subcommand, Debug)]
pub enum LabCmd {
    /// Build the lab, run its programs and events for its duration, tear it down and write the results and report.
    Run(Start),
    /// Build the lab and start its background programs; it stays up until `lab down`.
    Up(Start),
    /// Run a command on a host of a lab that is up (through its stack on a stacked host), as the invoking user.
    Exec {
        /// The lab (default: the only one up).
        #[arg(long)]
        lab: Option<String>,
        /// The host.
        host: String,
        /// The command and its arguments.
        #[arg(required = true, last = true)]
        command: Vec<String>,
    },
    /// Take a link down or up, or change its parameters: `lab link h1 srv set delay=50ms loss=1`.
    Link {
        /// The lab (default: the only one up).
        #[arg(long)]
        lab: Option<String>,
        /// One end of the link.
        a: String,
        /// The other end.
        b: String,
        /// `down`, `up` or `set`.
        action: String,
        /// For `set`: the parameters, KEY=VALUE (bw, delay, jitter, loss, max_queue_size, loss_model, ge_*).
        params: Vec<String>,
    },
    /// Tear down a lab (default: the only one up), or every lab under the state directory with --all.
    Down {
        /// The lab.
        name: Option<String>,
        /// Every lab (also those whose runner was killed).
        #[arg(long)]
        all: bool,
        /// No progress lines.
        #[arg(short, long)]
        quiet: bool,
    },
    /// The labs that are up.
    List,
    /// Validate a lab file (and its stack templates) without creating anything.
    Check {
        /// The lab file (TOML).
        file: PathBuf,
    },
    /// Write (again) the report of a results folder.
    Report {
        /// The results folder.
        dir: PathBuf,
    },
}

/// What a lab command needs before it starts: root for those that create, enter or remove a lab's namespaces,
/// and for `lab exec` a program that exists.
pub fn preflight(cmd: &LabCmd) -> Result<(), CliError> {
    let why = match cmd {
        LabCmd::Run(_) => ("flexstack lab run", "it creates network namespaces, veth pairs and daemons"),
        LabCmd::Up(_) => ("flexstack lab up", "it creates network namespaces, veth pairs and daemons"),
        LabCmd::Down { .. } => ("flexstack lab down", "it stops the lab's daemons and removes its namespaces"),
        LabCmd::Exec { .. } => ("flexstack lab exec", "it enters a host's network namespace"),
        LabCmd::Link { .. } => ("flexstack lab link", "it changes the lab's interfaces and daemons"),
        LabCmd::List | LabCmd::Check { .. } | LabCmd::Report { .. } => return Ok(()),
    };
    crate::error::require_root(why.0, why.1)?;
    if let LabCmd::Exec { command, .. } = cmd {
        crate::error::program_exists("flexstack lab exec", command)?;
    }
    Ok(())
}

/// A lab file read, validated and planned: the lab, its plan, its text and the stacked hosts' stack templates with
/// the lab's values filled in (by host in file order; `None` for a plain host).
pub type Loaded = (Lab, Plan, String, Vec<Option<String>>);

/// Reads and validates a lab file and plans it: every error (file:line, what was expected) comes before anything
/// is created. Stack templates of stacked hosts are resolved against the lab file's directory, filled in with the
/// lab's values ([`Plan::template_values`]) and must then parse as stacks. Rule files of `rules` events must be
/// readable and check ([`run::check_rules`]).
pub fn load(file: &Path) -> Result<Loaded, CliError> {
    let shown = file.display().to_string();
    let text = std::fs::read_to_string(file).map_err(|e| msg(format!("{shown}: cannot read: {e}")))?;
    let lab = Lab::parse(&shown, &text).map_err(|e| CliError::Config(e.to_string()))?;
    let plan = Plan::new(&lab).map_err(|e| CliError::Config(format!("{shown}: {e}")))?;
    let base = file.parent().unwrap_or(Path::new("."));
    let mut templates = Vec::new();
    for h in &lab.hosts {
        match &h.stack {
            None => templates.push(None),
            Some(s) => {
                let path = base.join(s);
                let mut text = std::fs::read_to_string(&path).map_err(|e| {
                    CliError::Config(format!(
                        "{}: `stack` of host `{}`: cannot read {} (relative paths are from the lab file's folder): {e}",
                        h.location,
                        h.name,
                        path.display()
                    ))
                })?;
                for (k, v) in plan.template_values(&lab, &h.name) {
                    text = text.replace(&k, &v);
                }
                // The template must parse once the daemon's placeholders are filled in too.
                let sample = flexstack_daemon::sandbox::TemplateValues {
                    app: "app1",
                    app_dev: "fsa0",
                    host_dev: "fsh0",
                    ipv4: "172.16.1.2",
                    ipv6: "fd77:10:1::2",
                };
                let filled = flexstack_daemon::sandbox::fill_template(&text, &sample);
                flexstack_core::StackSpec::parse(&path.display().to_string(), &filled)
                    .map_err(|e| CliError::Config(format!("{e} (the stack of host `{}` at {})", h.name, h.location)))?;
                templates.push(Some(text));
            }
        }
    }
    run::check_rules(&lab, file)?;
    Ok((lab, plan, text, templates))
}

/// The state of the lab `name`, or of the only lab up when `name` is `None`.
pub fn find(state_dir: &Path, name: Option<&str>) -> Result<LabState, CliError> {
    let labs = list(state_dir);
    match name {
        Some(n) => labs.into_iter().find(|l| l.name == n).ok_or_else(|| msg(format!("no lab named {n} is up"))),
        None => match labs.len() {
            0 => Err(msg("no lab is up (start one with `flexstack lab up FILE`)")),
            1 => Ok(labs.into_iter().next().expect("one")),
            _ => Err(msg(format!(
                "several labs are up ({}); say which with --lab NAME",
                labs.iter().map(|l| l.name.as_str()).collect::<Vec<_>>().join(", ")
            ))),
        },
    }
}

/// Every lab whose state is under `state_dir`, sorted by name.
pub fn list(state_dir: &Path) -> Vec<LabState> {
    let mut out: Vec<LabState> = std::fs::read_dir(labs_dir(state_dir))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| LabState::read(&e.path()).ok())
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// One line of `lab list`.
#[derive(Serialize, Deserialize, Debug)]
pub struct LabSummary {
    /// The lab's name.
    pub name: String,
    /// Its file.
    pub file: String,
    /// Its results folder.
    pub results: String,
    /// The runner's pid (`lab run`) or 0 (`lab up`).
    pub runner_pid: u32,
    /// Whether the runner is still alive.
    pub runner_alive: bool,
    /// Its hosts and their namespaces.
    pub hosts: Vec<(String, String)>,
}

/// `lab list`.
pub fn summaries(state_dir: &Path) -> Vec<LabSummary> {
    list(state_dir)
        .into_iter()
        .map(|s| LabSummary {
            runner_alive: s.runner_pid != 0 && build::alive(s.runner_pid),
            name: s.name,
            file: s.file,
            results: s.results.display().to_string(),
            runner_pid: s.runner_pid,
            hosts: s.hosts.into_iter().map(|h| (h.name, h.netns)).collect(),
        })
        .collect()
}

/// A results folder name: `<lab>-<YYYYmmdd-HHMMSS>` (UTC).
pub fn results_name(lab: &str, now: std::time::SystemTime) -> String {
    // "2026-11-21T08:30:00Z" → "20261121-083000"
    let stamp: String = humantime::format_rfc3339_seconds(now)
        .to_string()
        .chars()
        .filter_map(|c| match c {
            'T' => Some('-'),
            c if c.is_ascii_digit() => Some(c),
            _ => None,
        })
        .collect();
    format!("{lab}-{stamp}")
}

/// Turns `KEY=VALUE` arguments into TOML lines: numbers and booleans stay bare, anything else is quoted.
fn params_toml(args: &[String]) -> Result<String, CliError> {
    let mut out = String::new();
    for a in args {
        let (k, v) = a.split_once('=').ok_or_else(|| msg(format!("expected KEY=VALUE, got {a:?}")))?;
        let bare = v.parse::<f64>().is_ok() || v == "true" || v == "false";
        let v = if bare { v.to_string() } else { format!("{:?}", v) };
        out.push_str(&format!("{} = {v}\n", k.trim()));
    }
    Ok(out)
}

/// The results folder of a run: `--results`, else `results/<lab>-<UTC time>`.
fn results_dir(lab: &Lab, given: Option<PathBuf>) -> Result<PathBuf, CliError> {
    let dir = given.unwrap_or_else(|| Path::new("results").join(results_name(&lab.name, std::time::SystemTime::now())));
    if dir.join("timeline.csv").exists() {
        return Err(msg(format!("{} already holds results; give another --results folder", dir.display())));
    }
    std::fs::create_dir_all(&dir).map_err(|e| msg(format!("{}: {e}", dir.display())))?;
    std::path::absolute(&dir).map_err(msg)
}

/// Writes the lab file and the topology (namespaces, interfaces, addresses, routes) into the results folder.
fn write_resolved(dir: &Path, text: &str, plan: &Plan) -> Result<(), CliError> {
    use std::fmt::Write as _;
    std::fs::write(dir.join("lab.toml"), text).map_err(msg)?;
    let mut t = format!("wire namespace: {}\n", plan.wire_netns);
    for h in &plan.hosts {
        let kind = if h.stack.is_some() { "stacked" } else { "plain" };
        let _ = writeln!(t, "\nhost {} ({kind}), namespace {}", h.name, h.netns);
        if let Some(s) = h.app_subnet {
            let _ = writeln!(t, "  apps in {s}/16");
        }
        for f in &h.interfaces {
            let _ = writeln!(
                t,
                "  {} {}/24 {} -> {} {} (wire end {})",
                f.name, f.address, f.mac, f.peer_host, f.peer_address, f.wire_name
            );
        }
        for r in &h.routes {
            let _ = writeln!(t, "  route {} via {} dev {}", r.destination, r.via, r.dev);
        }
    }
    for l in &plan.links {
        let _ = writeln!(
            t,
            "\nlink {}: {} and {}, seeds {} / {}",
            l.name, l.emulator_ab, l.emulator_ba, l.seed_ab, l.seed_ba
        );
    }
    std::fs::write(dir.join("topology.txt"), t).map_err(msg)
}

/// Gives the results folder to the invoking user when root ran us through sudo.
fn give_to_user(dir: &Path) {
    let (uid, gid) = crate::runner::invoking_user();
    if uid == 0 {
        return;
    }
    fn walk(p: &Path, uid: u32, gid: u32) {
        let _ = nix::unistd::chown(p, Some(nix::unistd::Uid::from_raw(uid)), Some(nix::unistd::Gid::from_raw(gid)));
        if p.is_dir() {
            for e in std::fs::read_dir(p).into_iter().flatten().flatten() {
                walk(&e.path(), uid, gid);
            }
        }
    }
    walk(dir, uid, gid);
}

/// Catches SIGINT and SIGTERM into a flag.
fn interrupt_flag() -> Result<std::sync::Arc<std::sync::atomic::AtomicBool>, CliError> {
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, flag.clone()).map_err(|e| msg(format!("signals: {e}")))?;
    }
    Ok(flag)
}

fn print_json(value: &impl Serialize) -> Result<(), CliError> {
    println!("{}", serde_json::to_string_pretty(value).map_err(msg)?);
    Ok(())
}

/// Runs a `flexstack lab` command.
pub fn command(state_dir: &Path, json: bool, cmd: LabCmd) -> Result<(), CliError> {
    match cmd {
        LabCmd::Check { file } => {
            let (lab, plan, _, _) = load(&file)?;
            if json {
                return print_json(
                    &serde_json::json!({"name": lab.name, "hosts": plan.hosts.len(), "links": plan.links.len(),
                    "programs": lab.programs.len(), "events": lab.events.len(), "valid": true}),
                );
            }
            println!(
                "{}: lab {} is valid: {} hosts, {} links, {} programs, {} events",
                file.display(),
                lab.name,
                plan.hosts.len(),
                plan.links.len(),
                lab.programs.len(),
                lab.events.len()
            );
            for (at, what) in lab.timeline() {
                println!("  {:>8}  {what}", flexstack_lab::format_duration(at));
            }
            Ok(())
        }
        LabCmd::Run(Start { file, results, quiet, metrics }) => {
            run_lab(state_dir, json, &file, results, !quiet, metrics)
        }
        LabCmd::Up(Start { file, results, quiet, metrics }) => {
            let (lab, plan, text, templates) = load(&file)?;
            let dir = results_dir(&lab, results)?;
            write_resolved(&dir, &text, &plan)?;
            let opts = build::CreateOptions {
                state_dir,
                results: &dir,
                file: &file.display().to_string(),
                runner_pid: 0,
                templates: &templates,
                progress: !quiet && !json,
                metrics,
            };
            let state = build::create(&lab, &plan, &opts)?;
            let never = std::sync::atomic::AtomicBool::new(false);
            let started = run::run(&state, &lab, &run::RunOptions { whole: false, progress: false }, &never);
            if let Err(e) = started {
                build::down(&state, false);
                return Err(e);
            }
            if json {
                return print_json(&serde_json::json!({"name": lab.name, "results": dir, "state": state.dir}));
            }
            println!(
                "lab {} is up (results in {}); `flexstack lab exec HOST -- CMD`, `flexstack lab down {}`",
                lab.name,
                dir.display(),
                lab.name
            );
            Ok(())
        }
        LabCmd::Exec { lab, host, command } => {
            let state = find(state_dir, lab.as_deref())?;
            let status = run::host_command(&state, &host, None, &command)?
                .status()
                .map_err(|e| msg(format!("cannot run {command:?} on {host}: {e}")))?;
            use std::os::unix::process::ExitStatusExt;
            std::process::exit(status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0)));
        }
        LabCmd::Link { lab, a, b, action, params } => {
            let state = find(state_dir, lab.as_deref())?;
            let link = state.link(&a, &b)?.name.clone();
            match (action.as_str(), params.is_empty()) {
                ("down", true) => run::link_up(&state, &link, false)?,
                ("up", true) => run::link_up(&state, &link, true)?,
                ("set", false) => {
                    let p = flexstack_lab::parse_link_params("the command line", &params_toml(&params)?)
                        .map_err(|e| CliError::Config(e.to_string()))?;
                    run::link_set(&state, &link, &p)?;
                }
                ("down" | "up", false) => return Err(msg(format!("`{action}` takes no parameters"))),
                ("set", true) => return Err(msg("`set` needs KEY=VALUE parameters, e.g. delay=50ms loss=1")),
                _ => return Err(msg(format!("expected down, up or set, got {action:?}"))),
            }
            if !json {
                println!("link {link}: {action} {}", params.join(" "));
            }
            Ok(())
        }
        LabCmd::Down { name, all, quiet } => {
            let labs = if all { list(state_dir) } else { vec![find(state_dir, name.as_deref())?] };
            for s in &labs {
                if s.runner_pid != 0 && s.runner_pid != std::process::id() && build::alive(s.runner_pid) {
                    // A runner still at work: stop it first, so it does not build on what is being removed.
                    build::stop_processes(&[s.runner_pid], std::time::Duration::from_secs(10));
                }
                build::down(s, !json && !quiet);
            }
            if json {
                return print_json(&labs.iter().map(|l| &l.name).collect::<Vec<_>>());
            }
            if labs.is_empty() {
                println!("no lab is up");
            } else {
                println!("removed: {}", labs.iter().map(|l| l.name.as_str()).collect::<Vec<_>>().join(", "));
            }
            Ok(())
        }
        LabCmd::List => {
            let labs = summaries(state_dir);
            if json {
                return print_json(&labs);
            }
            if labs.is_empty() {
                println!("no lab is up");
            }
            for l in labs {
                let runner = if l.runner_pid == 0 {
                    "up".to_string()
                } else if l.runner_alive {
                    format!("running (pid {})", l.runner_pid)
                } else {
                    format!("runner {} gone: `flexstack lab down {}`", l.runner_pid, l.name)
                };
                println!("{}  {runner}  {}  results {}", l.name, l.file, l.results);
                for (h, ns) in l.hosts {
                    println!("  {h}: ip netns exec {ns} ...");
                }
            }
            Ok(())
        }
        LabCmd::Report { dir } => report(&dir, json),
    }
}

/// Writes `report.md` and `plots/*.svg` of a results folder; prints where (or, with `json`, the summary).
fn report(dir: &Path, json: bool) -> Result<(), CliError> {
    use flexstack_lab::report::{write_report, ReportOptions};
    let summary = write_report(dir, &ReportOptions::default()).map_err(msg)?;
    if json {
        return print_json(
            &serde_json::json!({"report": summary.report, "plots": summary.plots, "notes": summary.notes}),
        );
    }
    for n in &summary.notes {
        eprintln!("note: {n}");
    }
    println!("report: {}", summary.report.display());
    Ok(())
}

fn run_lab(
    state_dir: &Path,
    json: bool,
    file: &Path,
    results: Option<PathBuf>,
    progress: bool,
    metrics: bool,
) -> Result<(), CliError> {
    let (lab, plan, text, templates) = load(file)?;
    let interrupted = interrupt_flag()?;
    let dir = results_dir(&lab, results)?;
    write_resolved(&dir, &text, &plan)?;
    if progress {
        eprintln!("lab {}: building {} hosts and {} links", lab.name, plan.hosts.len(), plan.links.len());
    }
    let opts = build::CreateOptions {
        state_dir,
        results: &dir,
        file: &file.display().to_string(),
        runner_pid: std::process::id(),
        templates: &templates,
        progress,
        metrics,
    };
    let state = build::create(&lab, &plan, &opts)?;
    let outcome = run::run(&state, &lab, &run::RunOptions { whole: true, progress }, &interrupted);
    build::down(&state, progress);
    let outcome = outcome?;
    let reported = flexstack_lab::report::write_report(&dir, &flexstack_lab::report::ReportOptions::default());
    give_to_user(&dir);
    if json {
        let report = reported.as_ref().ok().map(|r| r.report.clone());
        print_json(&serde_json::json!({"name": lab.name, "results": dir, "report": report,
            "interrupted": outcome.interrupted, "failed": outcome.failed}))?;
    } else {
        println!("results: {}", dir.display());
    }
    match reported {
        Ok(r) if !json => println!("report: {}", r.report.display()),
        Ok(_) => {}
        Err(e) => eprintln!("lab {}: no report: {e}", lab.name),
    }
    if outcome.interrupted {
        return Err(msg(format!("lab {} was interrupted; partial results in {}", lab.name, dir.display())));
    }
    if !outcome.failed.is_empty() {
        let list: Vec<String> = outcome.failed.iter().map(|(p, s)| format!("{p} ({s})")).collect();
        return Err(msg(format!("foreground programs failed: {}; see {}/programs", list.join(", "), dir.display())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_names_sort_by_time() {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_795_000_000);
        assert_eq!(results_name("demo", t), "demo-20261118-110640");
        let a = results_name("demo", t);
        let b = results_name("demo", t + std::time::Duration::from_secs(61));
        assert!(a < b, "{a} {b}");
        assert_eq!(a.len(), "demo-".len() + 15);
    }
}
