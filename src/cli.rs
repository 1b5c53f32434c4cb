//! The `flexstack` command line, in the iproute2 manner: `flexstack OBJECT VERB [ARGS]`, `-j/--json` on every
//! show. Every command but `daemon` is a client of the control API (see [`flexstack_api::client`]).

use crate::error::{msg, CliError};
use crate::lab::LabCmd;
use crate::render;
use crate::runner::RunArgs;
use clap::{Args, Parser, Subcommand};
use flexstack_api::client::{Client, ClientError};
use flexstack_api::ops::*;
use flexstack_api::protocol::ErrorCode;
use flexstack_core::Settings;
use flexstack_daemon::server::{run_daemon, DaemonOptions};
use serde::Serialize;
use serde_json::Value as Json;
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
    /// Sandboxed apps: `app list`, `app vars`, and FreeNA's client commands `app stop|continue|kill|output NAME`.
    #[command(subcommand)]
    App(AppCmd),
    /// A running app's stream services (docs/services.md): `service list APP`, `service show APP NAME`,
    /// `service add APP KIND [--name N] [KEY=VALUE ...]`, `service del APP NAME [--force]`.
    #[command(subcommand)]
    Service(ServiceCmd),
    /// Flows, forwarded and terminated: `flow list`, `flow show ID`.
    #[command(subcommand)]
    Flow(FlowCmd),
    /// flexstack peers (docs/peers.md): `peer key`, `peer add NAME ADDR:PORT FINGERPRINT`, `peer list`,
    /// `peer show NAME`, `peer del NAME`.
    #[command(subcommand)]
    Peer(PeerCmd),
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
    /// Cross-layer rules: `rules load FILE`, `unload NAME|ALL`, `delete NAME|ALL`, `replace OLD NEW`, `list`,
    /// `show NAME`, `log`,
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
    /// Print the shell completion script for SHELL (generated from this command line; scripts/setup.sh installs
    /// them): `source <(flexstack completions bash)`.
    #[command(hide = true)]
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the man page flexstack(1), or with --dir write it and one page per command (flexstack-lab(1) ...)
    /// into DIR: `flexstack man | man -l -`.
    #[command(hide = true)]
    Man {
        /// Folder to write every page into (FILE.1), instead of printing flexstack(1).
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
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
    #[arg(long, default_value_t = flexstack_daemon::rules::Sampling::DEFAULT.interval.as_millis() as u64)]
    pub rules_interval_ms: u64,
    /// Most of one core, in percent, that sampling the rules' meters may take: a sample that takes longer than this
    /// share of the interval puts the next one later (the interval in use: meter rules.engine.sample_interval_us).
    #[arg(long, default_value_t = flexstack_daemon::rules::Sampling::DEFAULT.max_cpu_percent,
          value_parser = clap::value_parser!(u32).range(1..=100))]
    pub rules_max_cpu: u32,
    /// Most rule instances running at once (a per-name rule is one instance per matching name); a load over it is
    /// refused, and names appearing beyond it are not instantiated (counted in rules.engine.instances_refused_total).
    #[arg(long, default_value_t = flexstack_rules::Limits::DEFAULT.max_instances)]
    pub rules_max_instances: usize,
    /// Most memory, in MiB, the rules' definitions and running units may take (an estimate: docs/rules.md).
    #[arg(long, default_value_t = flexstack_rules::Limits::DEFAULT.max_memory_bytes >> 20)]
    pub rules_max_memory_mb: usize,
    /// Most revisions the rules repository keeps (`rules log`; the oldest go first).
    #[arg(long, default_value_t = flexstack_rules::Limits::DEFAULT.max_revisions)]
    pub rules_max_revisions: usize,
    /// Microseconds the data plane waits before reading a face while frames stream in, so that one wake-up reads
    /// several (interrupt moderation; 0, the default: off).
    #[arg(long, default_value_t = flexstack_daemon::dataplane::DEFAULT_RX_HOLD.as_micros() as u64)]
    pub rx_hold_us: u64,
    /// Run the data-plane thread under the real-time policy SCHED_FIFO at this priority (1-99; 0, the default: the
    /// normal policy). It then forwards as soon as a packet arrives, ahead of ordinary programs; the kernel's
    /// real-time throttling still leaves them 5 % of each second. The lab's daemons use 10.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=99))]
    pub realtime: u8,
    /// Data-plane workers: threads with a switch of their own each, flows spread over them by a hash of their
    /// addresses and ports (docs/architecture.md, "Workers"). A stack with a module that needs a global view
    /// (an emulator, a binding scheduler, a tap ...) runs on one; `status` says how many run it. Default: the
    /// machine's cores (as many as this process may run on), at most 8.
    #[arg(long, env = "FLEXSTACK_WORKERS", default_value_t = default_workers(),
          value_parser = clap::value_parser!(u16).range(1..=256))]
    pub workers: u16,
    /// Busy-poll: microseconds the data-plane workers keep polling their devices after their last frame before they
    /// sleep (lower latency while traffic flows, a core busy meanwhile; 0, the default: sleep at once). The knob
    /// `worker.all.busy_poll_us` changes it at runtime.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub busy_poll_us: u64,
    /// Milliseconds between reads of the transport meters of sandboxed apps' forwarded TCP flows from their own
    /// sockets (sock_diag; `flow.<id>.tcp.*`); 0: never.
    #[arg(long, default_value_t = 1000)]
    pub flow_meters_interval_ms: u64,
    /// Most flows whose transport meters are read per interval (the rest at the next ones).
    #[arg(long, default_value_t = 1024)]
    pub flow_meters_max: usize,
    /// Serve every meter and knob in OpenMetrics text at http://ADDR/metrics for Prometheus (docs/metrics.md);
    /// off by default. A loopback address unless --metrics-public.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,
    /// Allow --metrics on an address other than loopback: whoever reaches it reads every meter, unauthenticated.
    #[arg(long, requires = "metrics")]
    pub metrics_public: bool,
    /// Listen for --metrics in the network namespace of this file (`/proc/PID/ns/net`, `/run/netns/NAME`) instead
    /// of the daemon's own: how `flexstack lab run --metrics` lets Prometheus on the host scrape daemons that run
    /// in the lab's namespaces.
    #[arg(long, value_name = "PATH", requires = "metrics")]
    pub metrics_netns: Option<PathBuf>,
    /// Also export the per-flow series (`flexstack_flow_*`) of the N flows with the most bytes (0: none).
    #[arg(long, default_value_t = 0, value_name = "N", requires = "metrics")]
    pub metrics_flows: usize,
    /// Serve the web view of the running stack at http://ADDR/ (docs/web.md): live graph, runtime, flows,
    /// revisions, rules, apps, taps; off by default. Writes need the token it prints (also in STATE_DIR/web.token).
    /// A loopback address unless --web-public.
    #[arg(long, value_name = "ADDR")]
    pub web: Option<std::net::SocketAddr>,
    /// Allow --web on an address other than loopback: whoever reaches it sees the whole stack (writes still need
    /// the token).
    #[arg(long, requires = "web")]
    pub web_public: bool,
    /// Restrict the app socket (STATE_DIR/apps.sock) to this group: mode 0660, owned by it (default: mode 0666,
    /// any local user).
    #[arg(long, value_name = "NAME")]
    pub app_socket_group: Option<String>,
    /// Seconds an application connection has to register before it is closed.
    #[arg(long, default_value_t = 5.0, value_name = "SECS")]
    pub app_register_timeout: f64,
    /// Seconds a registered application may stay silent (it is pinged after half) before it is disconnected.
    #[arg(long, default_value_t = 60.0, value_name = "SECS")]
    pub app_idle_timeout: f64,
    /// Most app-socket connections one user (uid) may hold at once.
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub app_max_per_uid: usize,
    /// Come back to the last state kept in STATE_DIR/journal: the stack's revisions and current stack, the rules
    /// and their revisions (not sandboxed apps; docs/persistence.md). Without it the daemon starts fresh and sets
    /// the old journal aside as `journal.<time>`. A damaged journal is reported and restored up to the damage.
    #[arg(long)]
    pub restore: bool,
    /// Compact the journal when it grows past this many bytes (it keeps the rules changes and the latest revisions).
    #[arg(long, default_value_t = flexstack_daemon::journal::DEFAULT_MAX_BYTES, value_name = "BYTES",
          value_parser = clap::value_parser!(u64).range(4096..))]
    pub journal_max_bytes: u64,
}

/// `flexstack module ...`
#[derive(Subcommand, Debug)]
pub enum ModuleCmd {
    /// Loaded modules with kind, state and frames per port.
    List,
    /// Module kinds that can be loaded.
    Kinds {
        /// Print the module reference (docs/modules.md) of the built-in kinds instead; needs no daemon.
        #[arg(long)]
        markdown: bool,
    },
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
    /// The sandboxed apps: name, namespace, addresses, user, processes (pids of its cgroup) and the cgroup.
    List,
    /// Variables applications registered over the app socket (`app.<name>.*`), with uid and pid.
    Vars,
    /// Stop every process of the app (SIGSTOP to each process of its sandbox's cgroup).
    Stop {
        /// The app's name.
        name: String,
    },
    /// Let every process of the app go on (SIGCONT).
    Continue {
        /// The app's name.
        name: String,
    },
    /// Kill every process of the app (SIGKILL); `flexstack run` then ends and the sandbox goes.
    Kill {
        /// The app's name.
        name: String,
    },
    /// What the app wrote on stdout and stderr (`flexstack run` keeps it in STATE_DIR/apps/NAME.out, kept after
    /// the app ends until an app of that name runs again).
    Output {
        /// The app's name.
        name: String,
    },
}

/// `flexstack service ...`
#[derive(Subcommand, Debug)]
pub enum ServiceCmd {
    /// The app's services in order (Down frames first to last): name, kind, in the path (`active`), flows, rules.
    List {
        /// The app's name.
        app: String,
    },
    /// One service of the app and all its variables.
    Show {
        /// The app's name.
        app: String,
        /// The service's name (its module is APP-NAME).
        name: String,
    },
    /// Add a service nearest the network; flows opened after go through it as its `select` says.
    Add {
        /// The app's name.
        app: String,
        /// The service's kind (null, shape, inspect, record, compress, tls).
        kind: String,
        /// Its name (default: the kind).
        #[arg(long)]
        name: Option<String>,
        /// Its settings, `KEY=VALUE` (values are TOML: `rate=500000`, `select=["use tcp port 80"]`).
        settings: Vec<String>,
    },
    /// Remove a service (refused while it works on flows, unless --force).
    Del {
        /// The app's name.
        app: String,
        /// The service's name.
        name: String,
        /// Remove it even while it works on flows (they lose what it keeps for them).
        #[arg(long)]
        force: bool,
    },
}

/// `flexstack flow ...`
#[derive(Subcommand, Debug)]
pub enum FlowCmd {
    /// The flows: id, app, how handled, back-end, 5-tuple, bytes down and up, TCP state, srtt and cwnd.
    List,
    /// One flow and every variable under `flow.<ID>`.
    Show {
        /// The flow's id (`app1.3`, as `flow list` shows it) or its prefix (`flow.app1.3`).
        id: String,
    },
    /// Write a flow's knobs: `carrier=udpplus` (the transport of a flow carried to a peer: moves it there, with no
    /// byte lost; docs/peers.md), `cc=bbr` (its `tcp.cc`: the congestion control of a kernel TCP flow), or any
    /// `NAME=VALUE` under `flow.<ID>`.
    Set {
        /// The flow's id (as `flow list` shows it: `app1.peer.3`) or its prefix (`flow.app1.peer.3`).
        id: String,
        /// KNOB=VALUE, one or more (written in order).
        #[arg(required = true)]
        settings: Vec<String>,
    },
}

/// The knobs `flow set ID KNOB=VALUE...` writes: `carrier` and `cc` (`tcp.cc`) by their short names, others as
/// given, each under `flow.<ID>`.
fn flow_knobs(id: &str, settings: &[String]) -> Result<Vec<(String, String)>, CliError> {
    let id = id.strip_prefix("flow.").unwrap_or(id);
    settings
        .iter()
        .map(|kv| {
            let (k, v) = kv.split_once('=').ok_or_else(|| msg(format!("expected KNOB=VALUE, got {kv:?}")))?;
            let knob = match k {
                "" => return Err(msg(format!("expected KNOB=VALUE, got {kv:?}"))),
                "cc" => "tcp.cc",
                k => k,
            };
            Ok((format!("flow.{id}.{knob}"), v.to_string()))
        })
        .collect()
}

/// `flexstack peer ...`
#[derive(Subcommand, Debug)]
pub enum PeerCmd {
    /// This daemon's SHA-256 fingerprint: what its peers add it with.
    Key,
    /// Add a peer: flows are carried to it by carriers naming it, and its carriers are accepted.
    Add {
        /// Its name (1-32 of A-Z a-z 0-9 - _).
        name: String,
        /// Where its daemon accepts carriers (ADDR:PORT).
        addr: String,
        /// Its fingerprint (its `flexstack peer key`).
        fingerprint: String,
    },
    /// The peers: name, address, state, connections, flows, bytes.
    List,
    /// One peer.
    Show {
        /// The peer's name.
        name: String,
    },
    /// Forget a peer.
    Del {
        /// The peer's name.
        name: String,
    },
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
    /// Delete rule definitions (`ALL`: every rule), unloading them first; `unload` keeps definitions.
    Delete {
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
    let args: Vec<String> = std::env::args().collect();
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            if e.use_stderr() {
                if let Some(fixed) = crate::error::missing_separator(&args) {
                    eprintln!(
                        "\nhint: the program's arguments go after `--`, or flexstack takes them as its own: {fixed}"
                    );
                }
            }
            return ExitCode::from(e.exit_code().clamp(0, 255) as u8);
        }
    };
    let long_running = matches!(
        &cli.command,
        Command::Daemon(_)
            | Command::Run(_)
            | Command::Lab(LabCmd::Run(_) | LabCmd::Up(_) | LabCmd::Exec { .. } | LabCmd::Down { .. })
    );
    if !long_running {
        flexstack_sys::default_sigpipe();
    }
    let filter = tracing_subscriber::EnvFilter::try_from_env("FLEXSTACK_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(ansi).with_writer(std::io::stderr).init();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(CliError::Client(ClientError::Connect { path, source }))
            if source.kind() == std::io::ErrorKind::PermissionDenied =>
        {
            eprintln!("error: {}", crate::error::needs_root(&format!("connect to the daemon's control socket {path}")));
            ExitCode::from(3)
        }
        Err(CliError::Client(e @ ClientError::Connect { .. })) => {
            eprintln!("error: {e}");
            ExitCode::from(3)
        }
        Err(CliError::Exit(code, message)) => {
            eprintln!("{message}");
            ExitCode::from(code)
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
    if let Command::Daemon(d) = &cli.command {
        let opts = DaemonOptions {
            stack: d.stack.clone(),
            state_dir: cli.state_dir.clone(),
            client_timeout: Duration::from_secs_f64(d.client_timeout.max(0.05)),
            max_clients: d.max_clients.max(1),
            app_subnet: d.app_subnet,
            app_etc: d.app_etc.clone(),
            exit_when_idle: d.exit_when_idle,
            rules_sampling: flexstack_daemon::rules::Sampling {
                interval: Duration::from_millis(d.rules_interval_ms.max(1)),
                max_cpu_percent: d.rules_max_cpu,
            },
            rules_limits: flexstack_rules::Limits {
                max_instances: d.rules_max_instances,
                max_memory_bytes: d.rules_max_memory_mb.saturating_mul(1 << 20),
                max_revisions: d.rules_max_revisions.max(1),
            },
            dataplane: flexstack_daemon::dataplane::DataPlaneOptions {
                rx_hold: Duration::from_micros(d.rx_hold_us),
                busy_poll_us: d.busy_poll_us,
                realtime: d.realtime,
                workers: usize::from(d.workers),
            },
            flow_meters: flexstack_daemon::sockdiag::PollOptions {
                interval: Duration::from_millis(d.flow_meters_interval_ms),
                max_flows: d.flow_meters_max.max(1),
            },
            metrics: d.metrics.map(|addr| flexstack_daemon::metrics::MetricsOptions {
                addr,
                public: d.metrics_public,
                flows_top: d.metrics_flows,
                netns: d.metrics_netns.clone(),
            }),
            web: d.web.map(|addr| flexstack_daemon::web::WebOptions::new(addr, d.web_public, cli.state_dir.clone())),
            app_socket: flexstack_daemon::appvars::AppSocketOptions {
                register_timeout: Duration::from_secs_f64(d.app_register_timeout.clamp(0.05, 86400.0)),
                idle_timeout: Duration::from_secs_f64(d.app_idle_timeout.clamp(0.1, 86400.0)),
                max_per_uid: d.app_max_per_uid.max(1),
                group: d.app_socket_group.clone(),
            },
            restore: d.restore,
            journal_max_bytes: d.journal_max_bytes,
        };
        return run_daemon(opts, flexstack_daemon::catalog()).map_err(CliError::Message);
    }
    if let Command::Run(r) = &cli.command {
        crate::error::program_exists("flexstack run", &r.command)?;
        crate::error::require_root("flexstack run", "it creates a network namespace and devices for the program")?;
        return crate::runner::run_app(&cli.state_dir, r).map(|code| std::process::exit(code));
    }
    if let Command::App(AppCmd::Output { name }) = &cli.command {
        return crate::runner::print_output(&cli.state_dir, name);
    }
    if let Command::Lab(cmd) = cli.command {
        crate::lab::preflight(&cmd)?;
        return crate::lab::command(&cli.state_dir, cli.json, cmd);
    }
    use clap::CommandFactory;
    match &cli.command {
        Command::Completions { shell } => {
            return crate::manual::completions(Cli::command(), *shell, &mut std::io::stdout())
        }
        Command::Man { dir: Some(dir) } => return crate::manual::man_pages(Cli::command(), dir).map(|_| ()),
        Command::Man { dir: None } => return crate::manual::man_page(Cli::command(), &mut std::io::stdout()),
        _ => {}
    }
    if let Command::Module(ModuleCmd::Kinds { markdown: true }) = cli.command {
        print!("{}", flexstack_core::reference::markdown(&flexstack_daemon::catalog().reference()));
        return Ok(());
    }
    let mut client = Client::connect(&cli.state_dir)?;
    let json = cli.json;
    match cli.command {
        Command::Daemon(_) | Command::Run(_) | Command::Lab(_) | Command::Completions { .. } | Command::Man { .. } => {
            unreachable!("handled above")
        }
        Command::App(AppCmd::List) => print(json, &client.call(AppList)?, |a| render::app_list(a)),
        Command::App(AppCmd::Output { .. }) => unreachable!("handled above"),
        Command::App(AppCmd::Stop { name }) => signal(&mut client, json, name, "stop"),
        Command::App(AppCmd::Continue { name }) => signal(&mut client, json, name, "continue"),
        Command::App(AppCmd::Kill { name }) => signal(&mut client, json, name, "kill"),
        Command::Service(ServiceCmd::List { app }) => {
            print(json, &client.call(ServiceList { app })?, |s| render::service_list(s))
        }
        Command::Service(ServiceCmd::Show { app, name }) => {
            print(json, &client.call(ServiceShow { app, name })?, render::service_show)
        }
        Command::Service(ServiceCmd::Add { app, kind, name, settings }) => {
            let add = ServiceAdd { app, kind, name, settings: settings_json(&settings)? };
            print(json, &client.call(add)?, render::change)
        }
        Command::Service(ServiceCmd::Del { app, name, force }) => {
            print(json, &client.call(ServiceDel { app, name, force })?, render::change)
        }
        Command::App(AppCmd::Vars) => print(json, &client.call(AppVarList)?, |a| render::app_vars(a)),
        Command::Peer(PeerCmd::Key) => print(json, &client.call(PeerKey)?, |k| format!("{}\n", k.fingerprint)),
        Command::Peer(PeerCmd::Add { name, addr, fingerprint }) => {
            print(json, &client.call(PeerAdd { name, addr, fingerprint })?, |p| {
                render::peer_list(std::slice::from_ref(p))
            })
        }
        Command::Peer(PeerCmd::List) => print(json, &client.call(PeerList)?, |p| render::peer_list(p)),
        Command::Peer(PeerCmd::Show { name }) => {
            print(json, &client.call(PeerShow { name })?, |p| render::peer_list(std::slice::from_ref(p)))
        }
        Command::Peer(PeerCmd::Del { name }) => {
            print(json, &client.call(PeerDel { name })?, |p| format!("removed peer {}\n", p.name))
        }
        Command::Flow(FlowCmd::List) => print(json, &client.call(FlowList)?, |f| render::flow_list(f)),
        Command::Flow(FlowCmd::Show { id }) => print(json, &client.call(FlowShow { flow: id })?, render::flow_show),
        Command::Flow(FlowCmd::Set { id, settings }) => {
            let mut done = Vec::new();
            for (name, value) in flow_knobs(&id, &settings)? {
                done.push(client.call(Set { name, value: Json::String(value) })?);
            }
            print(json, &done, |d| d.iter().map(render::set).collect())
        }
        Command::Rules(cmd) => rules_command(&mut client, cmd, json),
        Command::Monitor { names, interval, csv, json_lines, count } => {
            let format = if csv {
                MonitorFormat::Csv
            } else if json_lines || json {
                MonitorFormat::Json
            } else {
                MonitorFormat::Table
            };
            monitor(&mut client, names, interval, count, format)
        }
        Command::Tap(TapCmd::Add { link, file }) => {
            let abs = std::path::absolute(&file).map_err(|e| CliError::Message(format!("{}: {e}", file.display())))?;
            print(json, &client.call(TapAdd { link, file: abs.display().to_string() })?, render::tap_added)
        }
        Command::Tap(TapCmd::Del { name }) => print(json, &client.call(TapDel { name })?, render::change),
        Command::Tap(TapCmd::List) => print(json, &client.call(TapList)?, |t| render::tap_list(t)),
        Command::Status => print(json, &client.call(Status)?, render::status),
        Command::Module(ModuleCmd::List) => print(json, &client.call(ModuleList)?, |m| render::module_list(m)),
        Command::Module(ModuleCmd::Kinds { .. }) => {
            print(json, &client.call(ModuleKinds)?, |k| render::module_kinds(k))
        }
        Command::Module(ModuleCmd::Load { name, kind, settings }) => {
            let load = ModuleLoad { name, kind, settings: settings_json(&settings)? };
            print(json, &client.call(load)?, render::change)
        }
        Command::Module(ModuleCmd::Exec { name, procedure, argument }) => {
            let argument = argument.map(|a| serde_json::from_str(&a).unwrap_or(Json::String(a)));
            print(json, &client.call(ModuleExec { name, procedure, argument })?, render::exec)
        }
        Command::Module(ModuleCmd::Unload { name }) => {
            print(json, &client.call(ModuleUnload { name })?, render::change)
        }
        Command::Module(ModuleCmd::Replace { name, kind, settings, fresh }) => {
            let replace = ModuleReplace { name, kind, settings: settings_json(&settings)?, fresh };
            print(json, &client.call(replace)?, render::change)
        }
        Command::Link(LinkCmd::List) => print(json, &client.call(LinkList)?, render::links),
        Command::Link(LinkCmd::Add { link }) => print(json, &client.call(LinkAdd { link })?, render::change),
        Command::Link(LinkCmd::Del { link }) => print(json, &client.call(LinkDel { link })?, render::change),
        Command::Pause { module } => print(json, &client.call(Pause { module })?, render::notes),
        Command::Resume { module } => print(json, &client.call(Resume { module })?, render::notes),
        Command::Get { names } => print(json, &get_each(&mut client, names)?, render::values),
        Command::Set { name, value } => {
            print(json, &client.call(Set { name, value: Json::String(value) })?, render::set)
        }
        Command::Watch { names, interval, changes, count } => {
            let watch = Watch { names, interval_ms: Some(interval), changes, count };
            client.watch(watch, &mut |ev| print_watch(&ev, json))?;
            Ok(())
        }
        Command::Show(ShowCmd::Runtime) => print(json, &client.call(ShowRuntime)?, |r| render::runtime(r)),
        Command::Var(VarCmd::List { pattern }) => {
            print(json, &client.call(VarList { pattern })?, |v| render::var_list(v))
        }
        Command::Config(ConfigCmd::Log) => print(json, &client.call(ConfigLog)?, |l| render::config_log(l)),
        Command::Config(ConfigCmd::Show { rev }) => {
            print(json, &client.call(ConfigShow { rev })?, render::revision_stack)
        }
        Command::Config(ConfigCmd::Rollback { rev }) => {
            print(json, &client.call(ConfigRollback { rev })?, render::change)
        }
        Command::Config(ConfigCmd::Save { file }) => {
            let r = client.call(ConfigShow { rev: None })?;
            std::fs::write(&file, &r.stack)
                .map_err(|e| CliError::Message(format!("{}: cannot write: {e}", file.display())))?;
            if json {
                println!("{}", serde_json::json!({ "file": file.display().to_string(), "revision": r.revision }));
            } else {
                println!("saved revision {} to {}", r.revision, file.display());
            }
            Ok(())
        }
    }
}

/// `get P1 P2 ...`: the values of every pattern that matches; a pattern that matches nothing gets a warning on
/// stderr (the daemon refuses the whole request for it), and only when none matches is it an error.
fn get_each(client: &mut Client, names: Vec<String>) -> Result<Values, CliError> {
    let all = client.call(Get { names: names.clone() });
    match all {
        Err(ClientError::Api(e)) if e.code == ErrorCode::NotFound && names.len() > 1 => {
            let mut out = Values::new();
            let mut missing = Vec::new();
            for n in names {
                match client.call(Get { names: vec![n.clone()] }) {
                    Ok(values) => out.extend(values),
                    Err(ClientError::Api(e)) if e.code == ErrorCode::NotFound => missing.push(e.message),
                    Err(e) => return Err(e.into()),
                }
            }
            if out.is_empty() {
                return Err(msg(missing.join("; ")));
            }
            for m in missing {
                eprintln!("warning: {m}");
            }
            Ok(out)
        }
        other => Ok(other?),
    }
}

/// Prints a result: with `-j` as the JSON the daemon sent (keys sorted, pretty), else as `text` renders it.
/// `app stop|continue|kill NAME`.
fn signal(client: &mut Client, json: bool, name: String, signal: &str) -> Result<(), CliError> {
    let done = client.call(AppSignal { name, signal: signal.to_string() })?;
    print(json, &done, |s| format!("{}: {} to {} process(es): {:?}\n", s.app, s.signal, s.pids.len(), s.pids))
}

fn print<T: Serialize>(json: bool, result: &T, text: impl FnOnce(&T) -> String) -> Result<(), CliError> {
    if json {
        let value = serde_json::to_value(result).map_err(msg)?;
        println!("{}", serde_json::to_string_pretty(&value).unwrap_or_default());
    } else {
        print!("{}", text(result));
    }
    Ok(())
}

/// A rule text with errors is an invalid input file: exit code 2, like a bad stack or lab file.
fn rules_error(e: ClientError) -> CliError {
    match e {
        ClientError::Api(e) if e.code == ErrorCode::InvalidRules => CliError::Config(e.message),
        e => e.into(),
    }
}

/// `flexstack rules ...`: one request each (`load` reads the file and sends its text and name).
fn rules_command(client: &mut Client, cmd: RulesCmd, json: bool) -> Result<(), CliError> {
    match cmd {
        RulesCmd::Load { file } => {
            let text = std::fs::read_to_string(&file)
                .map_err(|e| CliError::Config(format!("{}: cannot read: {e}", file.display())))?;
            let loaded = client.call(RulesLoad { name: file.display().to_string(), text }).map_err(rules_error)?;
            print(json, &loaded, render::rules_loaded)
        }
        RulesCmd::Unload { names } => {
            print(json, &client.call(RulesUnload { names }).map_err(rules_error)?, render::rules_revision)
        }
        RulesCmd::Delete { names } => {
            print(json, &client.call(RulesDelete { names }).map_err(rules_error)?, render::rules_revision)
        }
        RulesCmd::Replace { old, new } => {
            print(json, &client.call(RulesReplace { old, new }).map_err(rules_error)?, render::rules_revision)
        }
        RulesCmd::List => print(json, &client.call(RulesList).map_err(rules_error)?, |r| render::rules_list(r)),
        RulesCmd::Show { name } => print(json, &client.call(RulesShow { name }).map_err(rules_error)?, render::rule),
        RulesCmd::Log => print(json, &client.call(RulesLog).map_err(rules_error)?, render::rules_history),
        RulesCmd::Diff { from, to } => {
            print(json, &client.call(RulesDiff { from, to }).map_err(rules_error)?, |d| render::lines(d))
        }
        RulesCmd::Rollback { rev } => {
            print(json, &client.call(RulesRollback { rev }).map_err(rules_error)?, render::rules_revision)
        }
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
    let watch = Watch { names, interval_ms: Some(interval), changes: false, count };
    let mut columns: Option<Vec<String>> = None;
    let mut widths: Vec<usize> = Vec::new();
    let mut print = |ev: WatchEvent| {
        let mut out = std::io::stdout().lock();
        let t = ev.t_ms as f64 / 1000.0;
        let values = ev.values;
        let mut text = String::new();
        if format == MonitorFormat::Json {
            text = format!("{}\n", serde_json::json!({"t_s": t, "time_ms": ev.time_ms, "values": values}));
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
            let cells: Vec<String> =
                cols.iter().map(|c| values.get(c).map(render::plain).unwrap_or_default()).collect();
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
    client.watch(watch, &mut print)?;
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

/// Prints one watch event (with `-j`, as the daemon sent it); false stops the stream (stdout closed).
fn print_watch(ev: &WatchEvent, json: bool) -> bool {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let ok = if json {
        writeln!(out, "{}", serde_json::to_value(ev).unwrap_or_default())
    } else {
        let t = ev.t_ms as f64 / 1000.0;
        let mut line = format!("{t:>8.3}s");
        for (k, v) in &ev.values {
            line.push_str(&format!("  {k}={}", render::plain(v)));
        }
        writeln!(out, "{line}")
    };
    ok.is_ok() && out.flush().is_ok()
}

/// The default number of data-plane workers: one per core this process may run on, at most 8 (beyond, a stack's
/// edits wait for more threads at their barriers than most machines' flows need).
fn default_workers() -> u16 {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8) as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let c = Cli::try_parse_from(["flexstack", "-j", "flow", "show", "app1.3"]).unwrap();
        assert!(c.json && matches!(c.command, Command::Flow(FlowCmd::Show { id }) if id == "app1.3"));
        assert!(Cli::try_parse_from(["flexstack", "flow", "show"]).is_err(), "an id is needed");
        let c = Cli::try_parse_from(["flexstack", "flow", "set", "flow.a.peer.3", "carrier=udp", "cc=bbr"]).unwrap();
        let Command::Flow(FlowCmd::Set { id, settings }) = c.command else { panic!("flow set") };
        let knobs = flow_knobs(&id, &settings).unwrap();
        let want = [("flow.a.peer.3.carrier", "udp"), ("flow.a.peer.3.tcp.cc", "bbr")];
        assert_eq!(knobs, want.map(|(k, v)| (k.to_string(), v.to_string())));
        assert!(flow_knobs("a.1", &["carrier".into()]).is_err(), "KNOB=VALUE");
        assert!(Cli::try_parse_from(["flexstack", "flow", "set", "a.1"]).is_err(), "a knob is needed");
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
