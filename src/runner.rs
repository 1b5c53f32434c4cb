//! `flexstack run`: runs an unmodified program in a sandbox behind flexstack.
//!
//! 1. Finds the daemon at the state directory, or starts one (`daemon --exit-when-idle`, logging to
//!    `STATE_DIR/daemon.log`; the log of the daemon before is kept as `daemon.log.1`) that stops when its last app
//!    ends.
//! 2. Attaches the app over a connection that stays open as the app's lease (`app_attach`): the daemon creates
//!    the app's namespace, TUN devices and modules (see [`flexstack_daemon::sandbox`]).
//! 3. Runs the program in the namespace with `ip netns exec`, as the invoking user (SUDO_UID/SUDO_GID when run
//!    through sudo) through `setpriv`, with the terminal's stdio, in the app's cgroup (the daemon made it; the
//!    child moves itself there before exec, this process never enters it), so that every process the program starts
//!    ends with the sandbox. SIGINT/SIGTERM are passed on to it. Unless our stdin is a terminal, its stdout and
//!    stderr pass through pipes and are also kept in `STATE_DIR/apps/NAME.out` (`flexstack app output NAME`).
//! 4. When it exits, detaches (`app_detach`), waits for the daemon's answer (the sandbox, its processes, its
//!    conntrack entries and, with the last app, the host's forwarding settings are then back as they were) and
//!    exits with its exit code (128 + signal if it was killed). If the daemon dies meanwhile, the program is
//!    stopped, and its cgroup, namespace, conntrack entries and the daemon's nftables table are removed here
//!    (forwarding restored) before it returns.

use crate::error::{msg, CliError};
use clap::Args;
use flexstack_api::client::{result_of, Client, ClientError};
use flexstack_api::ops::{AppAttach, AppInfo};
use flexstack_api::protocol::{request_line, Request, Response};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Options of `flexstack run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// The app's stack template (placeholders {app}, {app_dev}, {host_dev}, {app_v4}, {app_v6}); default: stacks/app-default.toml.
    #[arg(long)]
    pub stack: Option<PathBuf>,
    /// A services file (docs/services.md): the app's flows go through these stream services, each where its rules
    /// choose; the chain is built on --stack (default: stacks/app-terminate.toml), whose `{app}-streams` it
    /// replaces, and only flows some service selects are terminated.
    #[arg(long, value_name = "FILE")]
    pub services: Option<PathBuf>,
    /// The app's name (default appN).
    #[arg(long)]
    pub name: Option<String>,
    /// The app's subnet, a /24 such as 10.90.3.0/24 (the app gets .2, and fd77:B:C::2/64); default: the first /24
    /// of the daemon's --app-subnet that no route of the host's uses.
    #[arg(long)]
    pub subnet: Option<String>,
    /// The program and its arguments.
    #[arg(required = true, last = true)]
    pub command: Vec<String>,
}

/// The user the app runs as: SUDO_UID/SUDO_GID when root runs us through sudo, else ourselves.
pub fn invoking_user() -> (u32, u32) {
    let me = (nix::unistd::getuid().as_raw(), nix::unistd::getgid().as_raw());
    if me.0 != 0 {
        return me;
    }
    let var = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u32>().ok());
    match (var("SUDO_UID"), var("SUDO_GID")) {
        (Some(u), Some(g)) => (u, g),
        _ => me,
    }
}

fn ensure_daemon(state_dir: &Path) -> Result<(), CliError> {
    if Client::connect(state_dir).is_ok() {
        return Ok(());
    }
    std::fs::create_dir_all(state_dir).map_err(|e| msg(format!("{}: {e}", state_dir.display())))?;
    // The log of the daemon before (which may have crashed) is kept, one generation.
    let log_path = state_dir.join("daemon.log");
    if log_path.exists() {
        let _ = std::fs::rename(&log_path, state_dir.join("daemon.log.1"));
    }
    let log = std::fs::File::create(&log_path).map_err(msg)?;
    let exe = std::env::current_exe().map_err(msg)?;
    Command::new(exe)
        .args(["daemon", "--exit-when-idle", "--state-dir"])
        .arg(state_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(|e| msg(format!("cannot start the daemon: {e}")))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if Client::connect(state_dir).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(msg(format!("the daemon did not start; see {}", state_dir.join("daemon.log").display())))
}

/// The lease connection and the daemon's reply to `attach`; `None` if the daemon closed the connection first.
type Attached = (UnixStream, BufReader<UnixStream>, Response);

fn try_attach(state_dir: &Path, attach: &Request) -> Result<Option<Attached>, CliError> {
    ensure_daemon(state_dir)?;
    let sock = flexstack_api::socket_path(state_dir);
    let stream = UnixStream::connect(&sock)
        .map_err(|source| ClientError::Connect { path: sock.display().to_string(), source })?;
    let mut writer = stream.try_clone().map_err(msg)?;
    let mut reader = BufReader::new(stream);
    if writer.write_all(request_line(1, attach).as_bytes()).is_err() {
        return Ok(None);
    }
    let mut line = String::new();
    if reader.read_line(&mut line).map_err(msg)? == 0 {
        return Ok(None);
    }
    let reply: Response = serde_json::from_str(&line).map_err(|e| msg(format!("unreadable reply: {e}")))?;
    Ok(Some((writer, reader, reply)))
}

/// A signal that arrived before the program started, if any.
fn pending_signal(interrupted: &AtomicI32) -> Option<nix::sys::signal::Signal> {
    nix::sys::signal::Signal::try_from(interrupted.load(Ordering::SeqCst)).ok()
}

/// Runs the program; returns its exit code.
pub fn run_app(state_dir: &Path, args: &RunArgs) -> Result<i32, CliError> {
    let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| msg(format!("{}: cannot read: {e}", p.display())));
    let template = match (&args.services, &args.stack) {
        (Some(file), stack) => {
            let base = match stack {
                Some(p) => read(p)?,
                None => TERMINATE_TEMPLATE.to_string(),
            };
            // Without a stack, the built-in one: its endpoints on the host's TCP unless the file says otherwise.
            let backend = stack.is_none().then_some(SERVICES_BACKEND);
            Some(services_template(file, &read(file)?, &base, backend)?)
        }
        (None, Some(p)) => Some(read(p)?),
        (None, None) => None,
    };
    let (uid, gid) = invoking_user();
    // SIGINT/SIGTERM are caught from here on: passed on to the program once it runs, or, if they come earlier,
    // kept and delivered to it as soon as it starts (so the sandbox is always cleaned up by the code below).
    let forward_to = Arc::new(AtomicI32::new(0));
    let interrupted = Arc::new(AtomicI32::new(0));
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM])
        .map_err(|e| msg(format!("signals: {e}")))?;
    let (target, pending) = (forward_to.clone(), interrupted.clone());
    std::thread::spawn(move || {
        for sig in signals.forever() {
            let pid = target.load(Ordering::SeqCst);
            match nix::sys::signal::Signal::try_from(sig) {
                Ok(s) if pid != 0 => {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), s);
                }
                _ => pending.store(sig, Ordering::SeqCst),
            }
        }
    });
    let attach =
        Request::AppAttach(AppAttach { name: args.name.clone(), uid, stack: template, subnet: args.subnet.clone() });
    // A daemon that exits as its last app ends (--exit-when-idle) may close on us just as we attach: then a new
    // daemon is started and the attach tried once more.
    let (mut writer, reader, reply) = match try_attach(state_dir, &attach)? {
        Some(attached) => attached,
        None => {
            try_attach(state_dir, &attach)?.ok_or_else(|| msg("the daemon closed the connection during the attach"))?
        }
    };
    let app: AppInfo = result_of(reply).map_err(|e| match e {
        ClientError::Api(e) => msg(e.message),
        other => msg(format!("app_attach failed: {other}")),
    })?;
    let netns = app.netns.clone();
    tracing::debug!(app = %app.name, netns = %netns, ipv4 = %app.ipv4, ipv6 = %app.ipv6, "sandbox ready");

    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &netns]);
    if uid != 0 {
        cmd.args(["setpriv", "--reuid", &uid.to_string(), "--regid", &gid.to_string(), "--init-groups", "--"]);
    }
    cmd.args(&args.command);
    let dump = Dump::start(state_dir, &app.name, &mut cmd);
    let mut child =
        spawn_in_cgroup(&mut cmd, &netns).map_err(|e| msg(format!("cannot run {:?}: {e}", args.command)))?;
    let copies = dump.copy(&mut child);

    let child_pid = nix::unistd::Pid::from_raw(child.id() as i32);
    forward_to.store(child_pid.as_raw(), Ordering::SeqCst);
    if let Some(sig) = pending_signal(&interrupted) {
        let _ = nix::sys::signal::kill(child_pid, sig);
    }

    // The lease: the daemon answers `app_detach` and closes it, or closes it when it dies. The watcher reads it to
    // its end; an end before we detach means the daemon went away: the program is stopped (and cleaned up below).
    let detaching = Arc::new(AtomicBool::new(false));
    let (ended, lease_end) = std::sync::mpsc::channel::<Vec<u8>>();
    let mut watch = reader.get_ref().try_clone().map_err(msg)?;
    let asked = detaching.clone();
    std::thread::spawn(move || {
        let mut got = Vec::new();
        let _ = std::io::Read::read_to_end(&mut watch, &mut got);
        if !asked.load(Ordering::SeqCst) {
            eprintln!("flexstack run: the daemon went away; stopping the program");
            let _ = nix::sys::signal::kill(child_pid, nix::sys::signal::Signal::SIGTERM);
        }
        let _ = ended.send(got);
    });

    let status = child.wait().map_err(msg)?;
    let code = status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    detaching.store(true, Ordering::SeqCst);
    let _ = writer.write_all(request_line(2, &Request::AppDetach).as_bytes());
    let _ = writer.shutdown(std::net::Shutdown::Write);
    // The daemon answers once the sandbox is gone; without an answer before the end of the lease, it died.
    match lease_end.recv_timeout(Duration::from_secs(20)) {
        Ok(got) if String::from_utf8_lossy(&got).contains("\"detached\"") => {}
        Ok(_) => clean_up_after_daemon(&app),
        Err(_) => eprintln!("flexstack run: the daemon did not confirm the detach of {} within 20 s", app.name),
    }
    // The sandbox's processes are gone: the pipes are closed and the copies end.
    for c in copies {
        let _ = c.join();
    }
    Ok(code)
}

/// The app's output file: `STATE_DIR/apps/NAME.out` (FreeNA's dumpfile, `flexstack app output NAME`).
pub fn output_path(state_dir: &Path, app: &str) -> std::path::PathBuf {
    state_dir.join("apps").join(format!("{app}.out"))
}

/// `flexstack app output NAME`: prints what the app wrote; the error names the apps with an output file.
pub fn print_output(state_dir: &Path, app: &str) -> Result<(), CliError> {
    let path = output_path(state_dir, app);
    match std::fs::read(&path) {
        Ok(bytes) => {
            std::io::stdout().write_all(&bytes).map_err(msg)?;
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut apps: Vec<String> = std::fs::read_dir(state_dir.join("apps"))
                .map(|d| {
                    d.filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".out").map(str::to_string)).collect()
                })
                .unwrap_or_default();
            apps.sort();
            let known = if apps.is_empty() { "none".to_string() } else { apps.join(", ") };
            Err(msg(format!("no output of app {app:?} (kept for: {known}; an app run on a terminal keeps none)")))
        }
        Err(e) => Err(msg(format!("{}: {e}", path.display()))),
    }
}

/// Keeps the app's stdout and stderr in its output file while passing them on to ours, unless our stdin is a
/// terminal (an interactive program keeps the terminal; nothing is kept).
struct Dump(Option<std::sync::Arc<std::sync::Mutex<std::fs::File>>>);

impl Dump {
    /// Opens the file (truncated) and makes the program's stdout and stderr pipes; without a file, changes nothing.
    fn start(state_dir: &Path, app: &str, cmd: &mut Command) -> Dump {
        use std::io::IsTerminal;
        if std::io::stdin().is_terminal() {
            return Dump(None);
        }
        let path = output_path(state_dir, app);
        let file = std::fs::create_dir_all(path.parent().expect("a folder")).and_then(|_| std::fs::File::create(&path));
        match file {
            Ok(f) => {
                cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
                Dump(Some(Arc::new(std::sync::Mutex::new(f))))
            }
            Err(e) => {
                eprintln!("flexstack run: {}: {e}; the app's output is not kept", path.display());
                Dump(None)
            }
        }
    }

    /// Copies the program's pipes to ours and to the file, until they close.
    fn copy(&self, child: &mut std::process::Child) -> Vec<std::thread::JoinHandle<()>> {
        let Some(file) = &self.0 else { return Vec::new() };
        let mut threads = Vec::new();
        fn pump(mut from: impl std::io::Read, mut to: impl Write, file: Arc<std::sync::Mutex<std::fs::File>>) {
            let mut buf = [0u8; 16384];
            while let Ok(n) = from.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let _ = to.write_all(&buf[..n]);
                let _ = to.flush();
                let _ = file.lock().unwrap_or_else(|p| p.into_inner()).write_all(&buf[..n]);
            }
        }
        if let Some(out) = child.stdout.take() {
            let f = file.clone();
            threads.push(std::thread::spawn(move || pump(out, std::io::stdout(), f)));
        }
        if let Some(err) = child.stderr.take() {
            let f = file.clone();
            threads.push(std::thread::spawn(move || pump(err, std::io::stderr(), f)));
        }
        threads
    }
}

/// The app template with termination (docs/streams.md), the base of `--services` without `--stack`.
const TERMINATE_TEMPLATE: &str = include_str!("../stacks/app-terminate.toml");

/// The endpoints' back-end for `--services` without `--stack` when the services file does not choose one: the
/// host's TCP carries the app's and the network's connections and the services work between (docs/services.md,
/// "Which back-end").
const SERVICES_BACKEND: &str = "kernel";

/// The app's stack template for a services file (`--services`): read, checked (every error at its file:line) and
/// turned into the chain of services on `base`, whose endpoints get the file's `backend`, else `backend`'s.
pub fn services_template(file: &Path, text: &str, base: &str, backend: Option<&str>) -> Result<String, CliError> {
    use flexstack_modules::stream::{matcher, services::file::ServiceFile};
    let mut spec = ServiceFile::parse(&file.display().to_string(), text).map_err(|e| msg(e.to_string()))?;
    if spec.backend.is_none() {
        spec.backend = backend.map(str::to_string);
    }
    let dir = std::path::absolute(file).map_err(msg)?;
    spec.resolve_paths(dir.parent().unwrap_or(Path::new("/")));
    spec.check(&flexstack_daemon::catalog()).map_err(|e| msg(e.to_string()))?;
    let template = spec.template(base, matcher::MAX_RULES).map_err(|e| msg(format!("{}: {e}", file.display())))?;
    tracing::debug!(%template, "the app's stack with its services");
    Ok(template)
}

/// Starts `cmd` in the app's cgroup: the program is born there, as are all its descendants, so that the sandbox's
/// end kills them all; this process never enters it (an `app stop` or `app kill` cannot reach it).
fn spawn_in_cgroup(cmd: &mut Command, netns: &str) -> std::io::Result<std::process::Child> {
    use flexstack_daemon::sandbox::app_cgroup;
    let Some(cgroup) = app_cgroup(netns).filter(|c| c.exists()) else {
        eprintln!("flexstack run: no cgroup for the app (no cgroup v2 here?): its processes may outlive it");
        return cmd.spawn();
    };
    let path = cgroup.join("cgroup.procs");
    let procs = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .map_err(|e| std::io::Error::other(format!("{}: {e}", path.display())))?;
    flexstack_sys::spawn_in_cgroup(cmd, &procs)
        .map_err(|e| std::io::Error::new(e.kind(), format!("start the app in {}: {e}", cgroup.display())))
}

/// After the daemon died: what was left of the app (its processes, namespace and files, its conntrack entries)
/// and the daemon's nftables table (the host's forwarding settings restored with the last) are removed.
fn clean_up_after_daemon(app: &AppInfo) {
    use flexstack_daemon::sandbox;
    if let Some(cg) = sandbox::app_cgroup(&app.netns) {
        if let Err(e) = sandbox::kill_cgroup(&cg) {
            eprintln!("flexstack run: {e}");
        }
    }
    sandbox::delete_namespace(&app.netns);
    if app.host_table.starts_with("flexstack_") {
        sandbox::forget_app_flows(app);
        sandbox::remove_host_table(&app.host_table);
    }
}
