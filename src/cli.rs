//! The `flexstack` command line, in the iproute2 manner: `flexstack OBJECT VERB [ARGS]`, `-j/--json` on every
//! show. Every command but `daemon` is a client of the control API (see [`flexstack_api::client`]).

use crate::error::CliError;
use crate::lab::LabCmd;
use crate::runner::RunArgs;
use clap::{Args, Parser, Subcommand};
use flexstack_api::client::{Client, ClientError};
use flexstack_api::ops::*;
use flexstack_api::protocol::Request;
use flexstack_core::Settings;
use flexstack_daemon::server::{run_daemon, DaemonOptions};
use serde_json::{json, Value as Json};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Default state directory (socket and pid file).
pub const DEFAULT_STATE_DIR: &str = "/run/flexstack";

/// flexstack: a user-space, modular, runtime-reconfigurable network stack.
#[derive(Parser, Debug)]
#[command(name = "flexstack", version, about, long_about = None)]
pub struct Cli {
    /// Directory of the daemon's control socket.
    #[arg(long, global = true, env = "FLEXSTACK_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    /// Print results as JSON.
    #[arg(short = 'j', long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Top-level commands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the daemon in the foreground (logs to stderr; FLEXSTACK_LOG=debug for more).
    Daemon(DaemonArgs),
    /// Run an unmodified program in a sandbox behind flexstack: `flexstack run [--stack FILE] [--name N] -- CMD ARGS`.
    Run(RunArgs),
    /// Packet captures on links: `tap add LINK FILE`, `tap del NAME`, `tap list`.
    #[command(subcommand)]
    Tap(TapCmd),
    /// Sandboxed apps: `app list`.
    #[command(subcommand)]
    App(AppCmd),
    /// Daemon status.
    Status,
    /// Modules: list, kinds, load, unload, replace.
    #[command(subcommand)]
    Module(ModuleCmd),
    /// Links: list, add, del.
    #[command(subcommand)]
    Link(LinkCmd),
    /// Hold frames at a module, or stop the whole stack (frames are held, not dropped).
    Pause {
        /// The module (default: the whole stack).
        module: Option<String>,
    },
    /// Resume a module or the whole stack.
    Resume {
        /// The module (default: the whole stack).
        module: Option<String>,
    },
    /// Read meters and knobs by name or pattern (`module.*.frames_in_total`).
    Get {
        /// Names or patterns.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Write a knob.
    Set {
        /// Knob name (`module.sel.select`).
        name: String,
        /// New value (negative numbers allowed).
        #[arg(allow_negative_numbers = true)]
        value: String,
    },
    /// Stream values: a periodic sample, or each change with --changes.
    Watch {
        /// Names or patterns.
        #[arg(required = true)]
        names: Vec<String>,
        /// Sampling interval in milliseconds.
        #[arg(short, long, default_value_t = 1000)]
        interval: u64,
        /// Print only values that changed.
        #[arg(long)]
        changes: bool,
        /// Stop after this many samples.
        #[arg(short = 'n', long)]
        count: Option<u64>,
    },
    /// Show things: `show runtime`.
    #[command(subcommand)]
    Show(ShowCmd),
    /// Meters and knobs: `var list [PATTERN]`.
    #[command(subcommand)]
    Var(VarCmd),
    /// Revisions: log, show, rollback, save.
    #[command(subcommand)]
    Config(ConfigCmd),
    /// Cross-layer rules: `rules load FILE`, `unload NAME|ALL`, `replace OLD NEW`, `list`, `show NAME`, `log`,
    /// `diff REV REV`, `rollback REV` (docs/rules.md).
    #[command(subcommand)]
    Rules(RulesCmd),
    /// Live values of meters and knobs, one row per sample (the paper's monitorapp): `monitor NAME... [-i MS]
    /// [--csv | --json]`.
    Monitor {
        /// Names or patterns.
        #[arg(required = true)]
        names: Vec<String>,
        /// Sampling interval in milliseconds.
        #[arg(short, long, default_value_t = 1000)]
        interval: u64,
        /// Comma-separated values: a header `time_s,NAME...`, then a row per sample.
        #[arg(long, conflicts_with = "json_lines")]
        csv: bool,
        /// One JSON object per sample: `{"t_s": ..., "values": {NAME: VALUE}}`.
        #[arg(long = "json-lines", alias = "jsonl")]
        json_lines: bool,
        /// Stop after this many samples.
        #[arg(short = 'n', long)]
        count: Option<u64>,
    },
    /// Experiments: `lab run FILE`, `lab up FILE`, `lab exec HOST -- CMD`, `lab link A B down|up|set K=V`,
    /// `lab down [NAME] | --all`, `lab list`, `lab check FILE`, `lab report DIR`.
    #[command(subcommand)]
    Lab(LabCmd),
}

/// Options of `flexstack daemon`.
#[derive(Args, Debug)]
pub struct DaemonArgs {
    /// Stack description to load (TOML); without it the daemon starts empty.
    #[arg(long)]
    pub stack: Option<PathBuf>,
    /// Seconds a client has to send a complete request.
    #[arg(long, default_value_t = 10.0)]
    pub client_timeout: f64,
    /// Most clients served at once.
    #[arg(long, default_value_t = 64)]
    pub max_clients: usize,
    /// The /16 that sandboxed apps get their addresses from (app n: A.B.n.2).
    #[arg(long, default_value = "10.77.0.0")]
    pub app_subnet: std::net::Ipv4Addr,
    /// Folder whose resolv.conf and hosts sandboxed apps get (default /etc; a file missing there comes from /etc).
    #[arg(long)]
    pub app_etc: Option<PathBuf>,
    /// Exit when the last sandboxed app detaches (how `flexstack run` starts a daemon of its own).
    #[arg(long)]
    pub exit_when_idle: bool,
    /// Milliseconds between samples of the meters that loaded rules read.
    #[arg(long, default_value_t = 5)]
    pub rules_interval_ms: u64,
    /// Microseconds the data plane waits before reading a face while frames stream in, so that one wake-up reads
    /// several (interrupt moderation; 0, the default: off).
    #[arg(long, default_value_t = flexstack_daemon::dataplane::DEFAULT_RX_HOLD.as_micros() as u64)]
    pub rx_hold_us: u64,
    /// Run the data-plane thread under the real-time policy SCHED_FIFO at this priority (1-99; 0, the default: the
    /// normal policy). It then forwards as soon as a packet arrives, ahead of ordinary programs; the kernel's
    /// real-time throttling still leaves them 5 % of each second. The lab's daemons use 10.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=99))]
    pub realtime: u8,
}

/// `flexstack module ...`
#[derive(Subcommand, Debug)]
pub enum ModuleCmd {
    /// Loaded modules with kind, state and frames per port.
    List,
    /// Module kinds that can be loaded.
    Kinds,
    /// Load a module: `module load NAME KIND [KEY=VALUE ...]`.
    Load {
        /// Unique name.
        name: String,
        /// Kind (see `module kinds`).
        kind: String,
        /// Settings, KEY=VALUE with TOML values.
        settings: Vec<String>,
    },
    /// Run a module's procedure through a control frame: `module exec NAME PROCEDURE [ARG]`.
    Exec {
        /// The module.
        name: String,
        /// The procedure.
        procedure: String,
        /// Its argument, as JSON (`1`, `true`, `"text"`) or plain text (negative numbers allowed).
        #[arg(allow_negative_numbers = true)]
        argument: Option<String>,
    },
    /// Unload a module and its links.
    Unload {
        /// The module.
        name: String,
    },
    /// Replace a module, keeping its links and (unless --fresh) its state.
    Replace {
        /// The module.
        name: String,
        /// Kind of the new module.
        kind: String,
        /// Settings, KEY=VALUE.
        settings: Vec<String>,
        /// Start from fresh state.
        #[arg(long)]
        fresh: bool,
    },
}

/// `flexstack tap ...`
#[derive(Subcommand, Debug)]
pub enum TapCmd {
    /// Record the frames of a link (`"a -> b"`, or a port `"a[port]"`) to a pcapng file.
    Add {
        /// The link or port.
        link: String,
        /// The pcapng file to write.
        file: PathBuf,
    },
    /// Stop a tap and close its file.
    Del {
        /// The tap's name (see `tap list`).
        name: String,
    },
    /// The taps.
    List,
}

/// `flexstack app ...`
#[derive(Subcommand, Debug)]
pub enum AppCmd {
    /// The sandboxed apps: name, namespace, addresses, user.
    List,
    /// Variables applications registered over the app socket (`app.<name>.*`), with uid and pid.
    Vars,
}

/// `flexstack rules ...`
#[derive(Subcommand, Debug)]
pub enum RulesCmd {
    /// Check and load a rule file (errors: FILE:LINE:COLUMN, exit code 2, nothing changed).
    Load {
        /// The rule file.
        file: PathBuf,
    },
    /// Unload rules loaded by themselves (`ALL`: every rule).
    Unload {
        /// Rule names, or ALL.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Replace rule OLD by rule NEW wherever it is used (the users keep their state).
    Replace {
        /// The rule replaced.
        old: String,
        /// The rule that takes its place.
        new: String,
    },
    /// Every defined rule: section, file, loaded, instances, value.
    List,
    /// A rule's text, commands and unit graph with each unit's value and state.
    Show {
        /// The rule.
        name: String,
    },
    /// The rules repository's revisions, and recent notices.
    Log,
    /// The commands added and removed between two revisions.
    Diff {
        /// The older revision.
        from: u64,
        /// The newer revision.
        to: u64,
    },
    /// Return the rules to a revision.
    Rollback {
        /// Revision number.
        rev: u64,
    },
}

/// `flexstack link ...`
#[derive(Subcommand, Debug)]
pub enum LinkCmd {
    /// The links.
    List,
    /// Add links: `link add "a[port] -> b, c"`.
    Add {
        /// The link.
        link: String,
    },
    /// Remove links.
    Del {
        /// The link.
        link: String,
    },
}

/// `flexstack show ...`
#[derive(Subcommand, Debug)]
pub enum ShowCmd {
    /// Per module: calls, frames, frames per call, nanoseconds per frame.
    Runtime,
}

/// `flexstack var ...`
#[derive(Subcommand, Debug)]
pub enum VarCmd {
    /// Every meter and knob with type, unit and description.
    List {
        /// Only names matching this pattern.
        pattern: Option<String>,
    },
}

/// `flexstack config ...`
#[derive(Subcommand, Debug)]
pub enum ConfigCmd {
    /// The revisions: number, time, user, change.
    Log,
    /// A revision's stack description (default: the running stack).
    Show {
        /// Revision number.
        rev: Option<u64>,
    },
    /// Return the stack to a revision.
    Rollback {
        /// Revision number.
        rev: u64,
    },
    /// Write the running stack as a description that starts the same stack.
    Save {
        /// Output file.
        file: PathBuf,
    },
}

/// Runs the command line; returns the process exit code (0 ok, 1 refused or failed, 3 no daemon).
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let long_running = matches!(
        &cli.command,
        Command::Daemon(_)
            | Command::Run(_)
            | Command::Lab(LabCmd::Run { .. } | LabCmd::Up { .. } | LabCmd::Exec { .. } | LabCmd::Down { .. })
    );
    if !long_running {
        flexstack_faces::sys::default_sigpipe();
    }
    let filter = tracing_subscriber::EnvFilter::try_from_env("FLEXSTACK_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).init();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(CliError::Client(e @ ClientError::Connect { .. })) => {
            eprintln!("error: {e}");
            ExitCode::from(3)
        }
        Err(CliError::Config(e)) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

fn settings_json(args: &[String]) -> Result<serde_json::Map<String, Json>, CliError> {
    let s = Settings::from_args(args).map_err(|e| CliError::Message(e.to_string()))?;
    let table = s.to_table();
    match serde_json::to_value(&table) {
        Ok(Json::Object(m)) => Ok(m),
        _ => Err(CliError::Message("settings cannot be sent as JSON".into())),
    }
}

fn run(cli: Cli) -> Result<(), CliError> {
    let json_out = cli.json;
    if let Command::Daemon(d) = &cli.command {
        let opts = DaemonOptions {
            stack: d.stack.clone(),
            state_dir: cli.state_dir.clone(),
            client_timeout: Duration::from_secs_f64(d.client_timeout.max(0.05)),
            max_clients: d.max_clients.max(1),
            app_subnet: d.app_subnet,
            app_etc: d.app_etc.clone(),
            exit_when_idle: d.exit_when_idle,
            rules_interval: Duration::from_millis(d.rules_interval_ms.max(1)),
            dataplane: flexstack_daemon::dataplane::DataPlaneOptions {
                rx_hold: Duration::from_micros(d.rx_hold_us),
                realtime: d.realtime,
            },
        };
        return run_daemon(opts, flexstack_daemon::catalog()).map_err(CliError::Message);
    }
    if let Command::Run(r) = &cli.command {
        return crate::runner::run_app(&cli.state_dir, r).map(|code| std::process::exit(code));
    }
    if let Command::Lab(cmd) = cli.command {
        return crate::lab::command(&cli.state_dir, json_out, cmd);
    }
    let mut client = Client::connect(&cli.state_dir)?;
    let request = match cli.command {
        Command::Daemon(_) | Command::Run(_) | Command::Lab(_) => unreachable!("handled above"),
        Command::App(AppCmd::List) => Request::AppList,
        Command::App(AppCmd::Vars) => Request::AppVarList,
        Command::Rules(cmd) => return rules_command(&mut client, cmd, json_out),
        Command::Monitor { names, interval, csv, json_lines, count } => {
            let format = if csv {
                MonitorFormat::Csv
            } else if json_lines || json_out {
                MonitorFormat::Json
            } else {
                MonitorFormat::Table
            };
            return monitor(&mut client, names, interval, count, format);
        }
        Command::Tap(TapCmd::Add { link, file }) => {
            let abs = std::path::absolute(&file).map_err(|e| CliError::Message(format!("{}: {e}", file.display())))?;
            Request::TapAdd(TapAdd { link, file: abs.display().to_string() })
        }
        Command::Tap(TapCmd::Del { name }) => Request::TapDel(TapDel { name }),
        Command::Tap(TapCmd::List) => Request::TapList,
        Command::Status => Request::Status,
        Command::Module(ModuleCmd::List) => Request::ModuleList,
        Command::Module(ModuleCmd::Kinds) => Request::ModuleKinds,
        Command::Module(ModuleCmd::Load { name, kind, settings }) => {
            Request::ModuleLoad(ModuleLoad { name, kind, settings: settings_json(&settings)? })
        }
        Command::Module(ModuleCmd::Exec { name, procedure, argument }) => Request::ModuleExec(ModuleExec {
            name,
            procedure,
            argument: argument.map(|a| serde_json::from_str(&a).unwrap_or(Json::String(a))),
        }),
        Command::Module(ModuleCmd::Unload { name }) => Request::ModuleUnload(ModuleUnload { name }),
        Command::Module(ModuleCmd::Replace { name, kind, settings, fresh }) => {
            Request::ModuleReplace(ModuleReplace { name, kind, settings: settings_json(&settings)?, fresh })
        }
        Command::Link(LinkCmd::List) => Request::LinkList,
        Command::Link(LinkCmd::Add { link }) => Request::LinkAdd(LinkAdd { link }),
        Command::Link(LinkCmd::Del { link }) => Request::LinkDel(LinkDel { link }),
        Command::Pause { module } => Request::Pause(Pause { module }),
        Command::Resume { module } => Request::Resume(Resume { module }),
        Command::Get { names } => Request::Get(Get { names }),
        Command::Set { name, value } => Request::Set(Set { name, value: Json::String(value) }),
        Command::Watch { names, interval, changes, count } => {
            let req = Request::Watch(Watch { names, interval_ms: Some(interval), changes, count });
            let mut print = |ev: Json| print_watch(&ev, json_out);
            client.stream(&req, &mut print)?;
            return Ok(());
        }
        Command::Show(ShowCmd::Runtime) => Request::ShowRuntime,
        Command::Var(VarCmd::List { pattern }) => Request::VarList(VarList { pattern }),
        Command::Config(ConfigCmd::Log) => Request::ConfigLog,
        Command::Config(ConfigCmd::Show { rev }) => Request::ConfigShow(ConfigShow { rev }),
        Command::Config(ConfigCmd::Rollback { rev }) => Request::ConfigRollback(ConfigRollback { rev }),
        Command::Config(ConfigCmd::Save { file }) => {
            let r = client.call_json(&Request::ConfigShow(ConfigShow { rev: None }))?;
            let text = r["stack"].as_str().unwrap_or_default();
            std::fs::write(&file, text)
                .map_err(|e| CliError::Message(format!("{}: cannot write: {e}", file.display())))?;
            if json_out {
                println!("{}", json!({ "file": file.display().to_string(), "revision": r["revision"] }));
            } else {
                println!("saved revision {} to {}", r["revision"], file.display());
            }
            return Ok(());
        }
    };
    let result = client.call_json(&request)?;
    if json_out {
        println!("{}", serde_json::to_string_pretty(&result).unwrap_or_default());
    } else {
        print!("{}", render(&request, &result));
    }
    Ok(())
}

/// `flexstack rules ...`: one request each (`load` reads the file and sends its text and name).
fn rules_command(client: &mut Client, cmd: RulesCmd, json_out: bool) -> Result<(), CliError> {
    let request = match cmd {
        RulesCmd::Load { file } => {
            let text = std::fs::read_to_string(&file)
                .map_err(|e| CliError::Config(format!("{}: cannot read: {e}", file.display())))?;
            Request::RulesLoad(RulesLoad { name: file.display().to_string(), text })
        }
        RulesCmd::Unload { names } => Request::RulesUnload(RulesUnload { names }),
        RulesCmd::Replace { old, new } => Request::RulesReplace(RulesReplace { old, new }),
        RulesCmd::List => Request::RulesList,
        RulesCmd::Show { name } => Request::RulesShow(RulesShow { name }),
        RulesCmd::Log => Request::RulesLog,
        RulesCmd::Diff { from, to } => Request::RulesDiff(RulesDiff { from, to }),
        RulesCmd::Rollback { rev } => Request::RulesRollback(RulesRollback { rev }),
    };
    let result = match client.call_json(&request) {
        Ok(r) => r,
        // A rule text with errors is an invalid input file: exit code 2, like a bad stack or lab file.
        Err(ClientError::Api(e)) if e.code == flexstack_api::protocol::ErrorCode::InvalidRules => {
            return Err(CliError::Config(e.message))
        }
        Err(e) => return Err(e.into()),
    };
    if json_out {
        println!("{}", serde_json::to_string_pretty(&result).unwrap_or_default());
    } else {
        print!("{}", render_rules(&request, &result));
    }
    Ok(())
}

/// The text form of a `rules_*` result.
fn render_rules(request: &Request, r: &Json) -> String {
    let s = plain;
    let arr = |v: &Json| v.as_array().cloned().unwrap_or_default();
    let opt = |v: &Json| if v.is_null() { "-".to_string() } else { s(v) };
    match request {
        Request::RulesLoad(_) => {
            let names = |v: &Json| arr(v).iter().map(s).collect::<Vec<_>>().join(", ");
            let mut out = format!(
                "ok: rules revision {}: defined {}; loaded {}\n",
                r["revision"],
                names(&r["defined"]),
                names(&r["loaded"])
            );
            for w in arr(&r["warnings"]) {
                out.push_str(&format!("{}\n", s(&w)));
            }
            out
        }
        Request::RulesList => table(
            &["RULE", "SECTION", "LOADED", "INSTANCES", "VALUE", "FILE"],
            arr(r)
                .iter()
                .map(|x| {
                    vec![
                        s(&x["name"]),
                        s(&x["section"]),
                        if x["explicit"] == json!(true) {
                            "yes".into()
                        } else if x["instances"] != json!(0) {
                            "dep".into()
                        } else {
                            "no".into()
                        },
                        s(&x["instances"]),
                        opt(&x["value"]),
                        s(&x["source"]),
                    ]
                })
                .collect(),
        ),
        Request::RulesShow(_) => {
            let mut out = format!("rule {} ({}, from {})\n", s(&r["name"]), s(&r["section"]), s(&r["source"]));
            for t in arr(&r["text"]) {
                out.push_str(&format!("  {}\n", s(&t)));
            }
            out.push_str("commands:\n");
            for c in arr(&r["commands"]) {
                out.push_str(&format!("  {}\n", s(&c)));
            }
            if arr(&r["instances"]).is_empty() {
                out.push_str("not loaded\n");
            }
            for i in arr(&r["instances"]) {
                let binding = arr(&i["binding"]).iter().map(s).collect::<Vec<_>>().join(",");
                out.push_str(&format!(
                    "instance [{binding}]  refcount {}  {}  value {}\n",
                    i["refcount"],
                    if i["pulled"] == json!(true) { "pulled" } else { "pushed" },
                    opt(&i["value"])
                ));
                let rows = arr(&i["units"])
                    .iter()
                    .map(|u| {
                        let state = u["state"]
                            .as_object()
                            .map(|m| m.iter().map(|(k, v)| format!("{k}={}", s(v))).collect::<Vec<_>>().join(" "))
                            .unwrap_or_default();
                        let inputs = arr(&u["inputs"]).iter().map(s).collect::<Vec<_>>().join(",");
                        vec![s(&u["key"]), s(&u["kind"]), inputs, opt(&u["value"]), state]
                    })
                    .collect();
                for line in table(&["UNIT", "KIND", "INPUTS", "VALUE", "STATE"], rows).lines() {
                    out.push_str(&format!("  {line}\n"));
                }
            }
            out
        }
        Request::RulesLog => {
            let mut out = table(
                &["REV", "T", "RULES", "LOADED", "CHANGE"],
                arr(&r["revisions"])
                    .iter()
                    .map(|v| {
                        let loaded = arr(&v["loaded"]).iter().map(s).collect::<Vec<_>>().join(",");
                        let t = v["at"].as_u64().unwrap_or(0) as f64 / 1e9;
                        vec![s(&v["number"]), format!("{t:.3}s"), s(&v["rules"]), loaded, s(&v["what"])]
                    })
                    .collect(),
            );
            for n in arr(&r["notices"]) {
                let t = n["t_ms"].as_u64().unwrap_or(0) as f64 / 1e3;
                out.push_str(&format!("notice {t:.3}s: {}\n", s(&n["message"])));
            }
            out
        }
        Request::RulesDiff(_) => arr(r).iter().map(|l| format!("{}\n", s(l))).collect(),
        _ => format!("ok: rules revision {}\n", r["revision"]),
    }
}

/// How `monitor` prints samples.
#[derive(Clone, Copy, Debug, PartialEq)]
enum MonitorFormat {
    Table,
    Csv,
    Json,
}

/// `flexstack monitor`: a `watch` stream printed as a table, CSV or JSON lines. The columns are the names the
/// first sample has (patterns expanded then); a value missing later prints empty.
fn monitor(
    client: &mut Client,
    names: Vec<String>,
    interval: u64,
    count: Option<u64>,
    format: MonitorFormat,
) -> Result<(), CliError> {
    use std::io::Write;
    let req = Request::Watch(Watch { names, interval_ms: Some(interval), changes: false, count });
    let mut columns: Option<Vec<String>> = None;
    let mut widths: Vec<usize> = Vec::new();
    let mut print = |ev: Json| {
        let mut out = std::io::stdout().lock();
        let t = ev["t_ms"].as_u64().unwrap_or(0) as f64 / 1000.0;
        let values = ev["values"].as_object().cloned().unwrap_or_default();
        let mut text = String::new();
        if format == MonitorFormat::Json {
            text = format!("{}\n", json!({"t_s": t, "time_ms": ev["time_ms"], "values": values}));
        } else {
            let cols = columns.get_or_insert_with(|| {
                let cols: Vec<String> = values.keys().cloned().collect();
                widths = cols.iter().map(|c| c.len().max(10)).collect();
                text = if format == MonitorFormat::Csv {
                    let quoted: Vec<String> = cols.iter().map(|c| csv_field(c)).collect();
                    format!("time_s,{}\n", quoted.join(","))
                } else {
                    let heads: Vec<String> = cols.iter().zip(&widths).map(|(c, w)| format!("{c:>w$}")).collect();
                    format!("{:>9}  {}\n", "TIME", heads.join("  "))
                };
                cols
            });
            let cells: Vec<String> = cols.iter().map(|c| values.get(c).map(plain).unwrap_or_default()).collect();
            if format == MonitorFormat::Csv {
                let quoted: Vec<String> = cells.iter().map(|c| csv_field(c)).collect();
                text.push_str(&format!("{t:.3},{}\n", quoted.join(",")));
            } else {
                let cells: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:>w$}")).collect();
                text.push_str(&format!("{:>8.3}s  {}\n", t, cells.join("  ")));
            }
        }
        out.write_all(text.as_bytes()).is_ok() && out.flush().is_ok()
    };
    client.stream(&req, &mut print)?;
    Ok(())
}

/// A CSV field (RFC 4180): quoted when it holds a comma, a quote or a line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// Prints one watch event; false stops the stream (stdout closed).
fn print_watch(ev: &Json, json_out: bool) -> bool {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let ok = if json_out {
        writeln!(out, "{ev}")
    } else {
        let t = ev["t_ms"].as_u64().unwrap_or(0) as f64 / 1000.0;
        let mut line = format!("{t:>8.3}s");
        if let Some(values) = ev["values"].as_object() {
            for (k, v) in values {
                line.push_str(&format!("  {k}={}", plain(v)));
            }
        }
        writeln!(out, "{line}")
    };
    ok.is_ok() && out.flush().is_ok()
}

fn plain(v: &Json) -> String {
    match v {
        Json::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A table with left-aligned columns.
fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.len());
        }
    }
    let line = |cells: Vec<String>| {
        let mut s =
            cells.iter().enumerate().map(|(i, c)| format!("{c:<w$}", w = widths[i])).collect::<Vec<_>>().join("  ");
        s.truncate(s.trim_end().len());
        s.push('\n');
        s
    };
    let mut out = line(header.iter().map(|h| h.to_string()).collect());
    for r in rows {
        out.push_str(&line(r));
    }
    out
}

/// The daemon's kept capabilities for `status`: `net_admin,net_raw,...`, or `none`.
fn capability_names(list: &Json) -> String {
    let names: Vec<String> = list
        .as_array()
        .map(|a| a.iter().filter_map(Json::as_str).map(|c| c.trim_start_matches("CAP_").to_lowercase()).collect())
        .unwrap_or_default();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(",")
    }
}

fn render(request: &Request, r: &Json) -> String {
    let arr = || r.as_array().cloned().unwrap_or_default();
    let s = |v: &Json| plain(v);
    match request {
        Request::Status => format!(
            "flexstack {} pid {}  up {:.0}s  revision {}  modules {}  links {}{}\ncapabilities {}\ndata plane {}\n",
            s(&r["version"]),
            r["pid"],
            r["uptime_s"].as_f64().unwrap_or(0.0),
            r["revision"],
            r["modules"],
            r["links"],
            if r["paused"] == json!(true) { "  PAUSED" } else { "" },
            capability_names(&r["capabilities"]["permitted"]),
            s(&r["dataplane_scheduling"])
        ),
        Request::ModuleList => {
            let mut rows = Vec::new();
            for m in arr() {
                rows.push(vec![
                    s(&m["name"]),
                    s(&m["kind"]),
                    s(&m["state"]),
                    String::new(),
                    s(&m["frames_in"]),
                    s(&m["frames_out"]),
                    s(&m["frames_dropped"]),
                ]);
                // The implicit control port is shown only when something went through it (JSON lists it always).
                let ports = m["ports"].as_array().cloned().unwrap_or_default();
                for p in ports.into_iter().filter(|p| p["port"] != "ctl" || p["frames"] != json!(0)) {
                    let (fin, fout, fdrop) = if p["dir"] == "in" {
                        (s(&p["frames"]), String::new(), String::new())
                    } else {
                        (String::new(), s(&p["frames"]), s(&p["dropped"]))
                    };
                    rows.push(vec![
                        String::new(),
                        String::new(),
                        String::new(),
                        format!("{} {} ({})", s(&p["dir"]), s(&p["port"]), s(&p["type"])),
                        fin,
                        fout,
                        fdrop,
                    ]);
                }
            }
            table(&["NAME", "KIND", "STATE", "PORT", "IN", "OUT", "DROPPED"], rows)
        }
        Request::ModuleKinds => {
            table(&["KIND", "SUMMARY"], arr().iter().map(|k| vec![s(&k["kind"]), s(&k["summary"])]).collect())
        }
        Request::LinkList => {
            r["links"].as_array().map_or(String::new(), |l| l.iter().map(|x| format!("{}\n", s(x))).collect())
        }
        Request::Get(_) => {
            let rows = r.as_object().map_or(Vec::new(), |o| {
                o.iter().map(|(k, v)| vec![k.clone(), s(&v["value"]), s(&v["unit"])]).collect()
            });
            table(&["NAME", "VALUE", "UNIT"], rows)
        }
        Request::VarList(_) => table(
            &["NAME", "KIND", "TYPE", "UNIT", "VALUE", "DESCRIPTION"],
            arr()
                .iter()
                .map(|v| {
                    vec![
                        s(&v["name"]),
                        s(&v["kind"]),
                        s(&v["type"]),
                        s(&v["unit"]),
                        s(&v["value"]),
                        s(&v["description"]),
                    ]
                })
                .collect(),
        ),
        Request::ShowRuntime => table(
            &["MODULE", "KIND", "CALLS", "FRAMES", "FRAMES/CALL", "NS/FRAME"],
            arr()
                .iter()
                .map(|m| {
                    vec![
                        s(&m["module"]),
                        s(&m["kind"]),
                        s(&m["calls"]),
                        s(&m["frames"]),
                        format!("{:.2}", m["frames_per_call"].as_f64().unwrap_or(0.0)),
                        format!("{:.1}", m["ns_per_frame"].as_f64().unwrap_or(0.0)),
                    ]
                })
                .collect(),
        ),
        Request::ConfigLog => table(
            &["REV", "TIME", "USER", "CHANGE"],
            arr()
                .iter()
                .map(|v| {
                    vec![
                        s(&v["revision"]),
                        fmt_time(v["time_ms"].as_u64().unwrap_or(0)),
                        s(&v["user"]),
                        s(&v["change"]),
                    ]
                })
                .collect(),
        ),
        Request::ConfigShow(_) => s(&r["stack"]),
        Request::TapAdd(_) => format!("ok: {} records to the file (revision {})\n", s(&r["tap"]), r["revision"]),
        Request::TapList => table(
            &["NAME", "TAPS", "LINKTYPE", "FRAMES", "FILE"],
            arr()
                .iter()
                .map(|t| {
                    let taps: Vec<String> = t["taps"].as_array().map_or(vec![], |a| a.iter().map(s).collect());
                    vec![s(&t["name"]), taps.join(","), s(&t["linktype"]), s(&t["frames"]), s(&t["file"])]
                })
                .collect(),
        ),
        Request::AppList => table(
            &["NAME", "NETNS", "IPV4", "IPV6", "UID", "MODULES"],
            arr()
                .iter()
                .map(|a| {
                    let modules: Vec<String> = a["modules"].as_array().map_or(vec![], |m| m.iter().map(s).collect());
                    vec![s(&a["name"]), s(&a["netns"]), s(&a["ipv4"]), s(&a["ipv6"]), s(&a["uid"]), modules.join(",")]
                })
                .collect(),
        ),
        Request::ModuleExec(_) => format!("{}\n", s(&r["result"])),
        Request::AppVarList => {
            let mut rows = Vec::new();
            for a in arr() {
                for v in a["vars"].as_array().cloned().unwrap_or_default() {
                    rows.push(vec![
                        s(&v["name"]),
                        s(&v["kind"]),
                        s(&v["type"]),
                        s(&v["value"]),
                        s(&a["uid"]),
                        s(&a["pid"]),
                    ]);
                }
            }
            table(&["NAME", "KIND", "TYPE", "VALUE", "UID", "PID"], rows)
        }
        _ => {
            let mut out = String::new();
            if let Some(rev) = r.get("revision") {
                out.push_str(&format!("ok: revision {rev}\n"));
            } else {
                out.push_str("ok\n");
            }
            for n in r["notes"].as_array().cloned().unwrap_or_default() {
                out.push_str(&format!("  note: {}\n", s(&n)));
            }
            out
        }
    }
}

/// Milliseconds since the epoch as `YYYY-MM-DD HH:MM:SS` UTC.
fn fmt_time(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_format() {
        assert_eq!(fmt_time(0), "1970-01-01 00:00:00");
        assert_eq!(fmt_time(1_795_000_000_000), "2026-11-18 11:06:40");
    }

    #[test]
    fn csv_fields_are_quoted_when_needed() {
        assert_eq!(csv_field("module.a.x"), "module.a.x");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
    }

    #[test]
    fn rules_and_monitor_commands_parse() {
        let c = Cli::try_parse_from(["flexstack", "rules", "diff", "1", "3"]).unwrap();
        assert!(matches!(c.command, Command::Rules(RulesCmd::Diff { from: 1, to: 3 })));
        let c = Cli::try_parse_from(["flexstack", "monitor", "-i", "50", "--csv", "module.*.x"]).unwrap();
        assert!(matches!(c.command, Command::Monitor { interval: 50, csv: true, .. }));
        assert!(Cli::try_parse_from(["flexstack", "monitor", "--csv", "--json-lines", "x"]).is_err());
    }

    #[test]
    fn cli_parses() {
        Cli::command_for_test();
        let c = Cli::try_parse_from(["flexstack", "-j", "--state-dir", "/tmp/x", "link", "add", "a -> b"]).unwrap();
        assert!(c.json);
        assert!(matches!(c.command, Command::Link(LinkCmd::Add { .. })));
    }

    impl Cli {
        fn command_for_test() {
            use clap::CommandFactory;
            Cli::command().debug_assert();
        }
    }
}
