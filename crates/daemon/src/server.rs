//! The daemon: sets up the state directory and the private control socket, starts the data plane, loads the
//! stack, and serves clients — each connection on its own thread, with a size limit per request, a time limit
//! for a request to arrive, a cap on concurrent clients, and write timeouts so a slow reader of a `watch` stream
//! is dropped rather than waited for. None of this can stall the data plane, which only ever sees queued edits.
//! It also starts the rules thread ([`crate::rules`]) and the applications' socket ([`crate::appvars`]).

use crate::actions::{Caller, Control, Found};
use crate::appvars::APP_SOCKET_NAME;
use crate::dataplane::DataPlane;
use crate::sandbox::Sandboxes;
use flexstack_api::ops::{AppAttach, Detached, Watch, WatchDone};
use flexstack_api::protocol::{parse_request, ApiError, ErrorCode, Request, Response, MAX_REQUEST_BYTES};
use flexstack_api::socket_path;
use flexstack_core::{Catalog, StackSpec};
use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the daemon runs.
#[derive(Clone, Debug)]
pub struct DaemonOptions {
    /// Stack description to load at start (none: start empty).
    pub stack: Option<PathBuf>,
    /// Directory for the socket and the pid file.
    pub state_dir: PathBuf,
    /// Time a client has to send a complete request line.
    pub client_timeout: Duration,
    /// Most clients served at once.
    pub max_clients: usize,
    /// The /16 sandboxed apps get addresses from.
    pub app_subnet: std::net::Ipv4Addr,
    /// Where sandboxed apps' resolv.conf and hosts come from (default /etc).
    pub app_etc: Option<PathBuf>,
    /// Exit when the last sandboxed app detaches (a daemon started by `flexstack run`).
    pub exit_when_idle: bool,
    /// How often the rules thread samples the meters its rules read (while rules are loaded).
    pub rules_sampling: crate::rules::Sampling,
    /// The rules engine's caps (`--rules-max-instances`, `--rules-max-memory-mb`, `--rules-max-revisions`).
    pub rules_limits: flexstack_rules::Limits,
    /// How the data-plane thread runs.
    pub dataplane: crate::dataplane::DataPlaneOptions,
    /// How often the transport meters of forwarded TCP flows are read from the apps' sockets (zero: never).
    pub flow_meters: crate::sockdiag::PollOptions,
    /// Serve the registry in OpenMetrics text at `GET /metrics` (`--metrics`; none: off).
    pub metrics: Option<crate::metrics::MetricsOptions>,
    /// Serve the web view (`--web`; none: off).
    pub web: Option<crate::web::WebOptions>,
    /// The app socket's limits and group (`--app-*`).
    pub app_socket: crate::appvars::AppSocketOptions,
    /// Come back to the state in the journal (`--restore`): revisions, stack, rules (docs/persistence.md).
    pub restore: bool,
    /// Compact the journal when it grows past this many bytes (`--journal-max-bytes`).
    pub journal_max_bytes: u64,
}

/// Binds the app socket at `path`: mode 0666, or 0660 and owned by `group` when one is given.
fn bind_app_socket(path: &std::path::Path, group: Option<&str>) -> Result<UnixListener, String> {
    let gid = match group {
        Some(name) => match nix::unistd::Group::from_name(name) {
            Ok(Some(g)) => Some(g.gid),
            Ok(None) => return Err(format!("--app-socket-group {name}: no such group")),
            Err(e) => return Err(format!("--app-socket-group {name}: cannot look it up: {e}")),
        },
        None => None,
    };
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path).map_err(|e| format!("{}: cannot listen: {e}", path.display()))?;
    let mode = if gid.is_some() { 0o660 } else { 0o666 };
    if let Some(gid) = gid {
        nix::unistd::chown(path, None, Some(gid))
            .map_err(|e| format!("{}: cannot give it to group {}: {e}", path.display(), group.unwrap_or_default()))?;
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| format!("{}: cannot set mode {mode:o}: {e}", path.display()))?;
    Ok(listener)
}

/// Runs the daemon in the foreground until SIGINT or SIGTERM. Errors (a bad stack file, a daemon already
/// running) are returned before anything is left behind.
pub fn run_daemon(opts: DaemonOptions, catalog: Catalog) -> Result<(), String> {
    if let Some(m) = &opts.metrics {
        m.check()?;
    }
    if let Some(w) = &opts.web {
        w.check()?;
    }
    let spec = match &opts.stack {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
            Some(StackSpec::parse(&path.display().to_string(), &text).map_err(|e| e.to_string())?)
        }
        None => None,
    };

    // 0711: other users can reach the app socket by its name (and nothing else: the control socket is 0600),
    // but not list the folder.
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o711)
        .create(&opts.state_dir)
        .map_err(|e| format!("{}: cannot create state directory: {e}", opts.state_dir.display()))?;
    std::fs::set_permissions(&opts.state_dir, std::fs::Permissions::from_mode(0o711))
        .map_err(|e| format!("{}: cannot set mode 0711: {e}", opts.state_dir.display()))?;
    // The peer identity (docs/peers.md): made the first time, in the state directory.
    let key = flexstack_faces::peer::init(&opts.state_dir)?;
    tracing::debug!(fingerprint = %flexstack_faces::peer::fingerprint_hex(&key.fingerprint), "peer identity");
    let sock = socket_path(&opts.state_dir);
    let app_sock = opts.state_dir.join(APP_SOCKET_NAME);
    if sock.exists() {
        if UnixStream::connect(&sock).is_ok() {
            return Err(format!("a daemon is already running on {} (use another --state-dir)", sock.display()));
        }
        tracing::warn!(socket = %sock.display(), "removing stale control socket");
        std::fs::remove_file(&sock).map_err(|e| format!("{}: cannot remove stale socket: {e}", sock.display()))?;
    }

    // The journal: read for --restore, otherwise set aside (kept under a name with the time) for a fresh start.
    let journal_path = crate::journal::Journal::path_in(&opts.state_dir);
    let (restore, damage) = match crate::actions::open_journal(&opts.state_dir, opts.restore)? {
        Found::Fresh(aside) => {
            if let Some(p) = aside {
                tracing::info!(kept = %p.display(), "starting fresh (no --restore): the old journal was set aside");
            }
            (crate::journal::State::default(), None)
        }
        Found::Restore(state, damage) => (state, damage),
    };
    if let Some(d) = &damage {
        let from = match restore.revisions.last() {
            Some(r) => format!("restoring the last good revision ({}) and the rules changes before it", r.number),
            None if restore.rules.is_empty() => "nothing before it to restore".to_string(),
            None => "restoring the rules changes before it (no stack revision)".to_string(),
        };
        tracing::error!(
            journal = %journal_path.display(),
            offset = d.offset,
            record = d.record,
            "the journal is damaged at {d}; {from}"
        );
    }

    // Set up, before the first thread starts (capabilities are per thread and inherited): from here on the daemon
    // and what it starts hold only the capabilities it needs (crate::privileges).
    // A real-time data plane: CAP_SYS_NICE is dropped below, so this thread takes SCHED_FIFO now, the data-plane
    // thread inherits it when it is created, and this thread goes back to the normal policy right after (which
    // needs no privilege), before any other thread exists: only the data plane runs at real-time priority.
    let realtime = opts.dataplane.realtime;
    if realtime > 0 {
        if let Err(e) = flexstack_sys::set_fifo_priority(i32::from(realtime)) {
            tracing::warn!(priority = realtime, error = %e, "cannot run the data plane at real-time priority; it runs at normal priority");
        }
    }
    // Kernel-terminated connections hold two sockets each: raise the limit of open files while the daemon still
    // may (CAP_SYS_RESOURCE is not kept).
    let files = flexstack_faces::stream::raise_open_files_limit();
    tracing::debug!(limit = files, "limit of open files");
    // The app socket is set up while the daemon may still give it to a group (CAP_CHOWN is not kept).
    let app_listener = bind_app_socket(&app_sock, opts.app_socket.group.as_deref())?;
    // The metrics endpoint may listen in another namespace, which needs privileges the daemon does not keep.
    let metrics_listener = opts.metrics.as_ref().map(crate::metrics::bind).transpose()?;
    crate::privileges::drop_unneeded()?;

    let dataplane = DataPlane::start(opts.dataplane);
    if realtime > 0 {
        flexstack_sys::set_normal_policy()
            .map_err(|e| format!("cannot return to the normal scheduling policy: {e}"))?;
    }
    let dataplane = dataplane.map_err(|e| format!("cannot start the data plane: {e}"))?;
    tracing::info!(scheduling = dataplane.scheduling(), "data plane started");
    // Interfaces that link faces of daemons now gone had taken over get their addresses and IPv6 back first.
    flexstack_faces::takeover::restore_stale();
    let control =
        Arc::new(Control::new(dataplane, catalog, Sandboxes::new(opts.app_subnet).with_etc_dir(opts.app_etc.clone())));
    if let Some(table) = &restore.peers {
        for w in control.restore_peers(table) {
            tracing::warn!(journal = %journal_path.display(), "{w}");
        }
        tracing::info!(peers = table.peers.len(), "peers restored");
    }
    let restored = match control.restore_stack(&restore, &journal_path, damage.as_ref()) {
        Ok(r) => r,
        Err(e) => {
            control.shutdown();
            return Err(format!(
                "{}: {e} (without --restore the daemon starts fresh and keeps this journal under another name)",
                journal_path.display()
            ));
        }
    };
    if restored.revision > 0 {
        tracing::info!(
            journal = %journal_path.display(),
            revision = restored.revision,
            revisions = restored.revisions,
            apps_left_out = ?restored.apps_left_out,
            "stack restored"
        );
        if let Some(path) = &opts.stack {
            tracing::info!(stack = %path.display(), "--stack not loaded: the journal's stack was restored");
        }
    } else if let (Some(spec), Some(path)) = (&spec, &opts.stack) {
        if let Err(e) = control.load_stack(spec, "daemon", &format!("daemon --stack {}", path.display())) {
            control.shutdown();
            return Err(e.message);
        }
        tracing::info!(stack = %path.display(), modules = spec.modules.len(), links = spec.links.len(), "stack loaded");
    }

    // The socket is private: created under umask 077, then set to 0600 explicitly.
    let old_mask = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    let listener = UnixListener::bind(&sock);
    nix::sys::stat::umask(old_mask);
    let listener = listener.map_err(|e| format!("{}: cannot listen: {e}", sock.display()))?;
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("{}: cannot set mode 0600: {e}", sock.display()))?;
    let pid_file = opts.state_dir.join("daemon.pid");
    let _ = std::fs::write(&pid_file, format!("{}\n", std::process::id()));

    // Rules run on a thread of their own; applications register variables on a socket of their own.
    control.start_rules(opts.rules_sampling, opts.rules_limits)?;
    if !restore.rules.is_empty() {
        for w in control.restore_rules(&restore.rules)? {
            tracing::warn!(journal = %journal_path.display(), "{w}");
        }
        tracing::info!(changes = restore.rules.len(), "rules restored");
    }
    if damage.is_some() {
        let kept = crate::journal::set_aside(&journal_path, "damaged.")?;
        tracing::warn!(kept = %kept.display(), "the damaged journal was kept; a new one holds what was restored");
    }
    control.start_journal(&journal_path, opts.journal_max_bytes)?;
    let _flow_meters = if opts.flow_meters.interval.is_zero() {
        None
    } else {
        Some(crate::sockdiag::FlowMeterPoller::start(&control, opts.flow_meters)?)
    };
    let _metrics = match (&opts.metrics, metrics_listener) {
        (Some(m), Some(listener)) => Some(crate::metrics::serve(control.clone(), m, listener)?),
        _ => None,
    };
    let _web = match &opts.web {
        Some(w) => Some(crate::web::serve(control.clone(), w)?),
        None => None,
    };
    let appvars = control.appvars.clone();
    let app_opts = opts.app_socket.clone();
    std::thread::Builder::new()
        .name("app-socket".into())
        .spawn(move || crate::appvars::serve(app_listener, appvars, app_opts))
        .map_err(|e| format!("app socket thread: {e}"))?;

    install_shutdown(control.clone(), vec![sock.clone(), app_sock.clone(), pid_file.clone()])?;
    tracing::info!(socket = %sock.display(), pid = std::process::id(), "flexstack daemon ready");

    let active = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        let conn = match conn {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if active.load(Ordering::SeqCst) >= opts.max_clients {
            let mut c = conn;
            let _ = c.set_write_timeout(Some(Duration::from_secs(1)));
            let msg = format!("too many clients (at most {}); try again", opts.max_clients);
            let _ = c.write_all(Response::err(None, ApiError::new(ErrorCode::Busy, msg)).to_line().as_bytes());
            continue;
        }
        active.fetch_add(1, Ordering::SeqCst);
        let (control, active, timeout) = (control.clone(), active.clone(), opts.client_timeout);
        let (exit_when_idle, sock, pid_file) = (opts.exit_when_idle, sock.clone(), pid_file.clone());
        let app_sock = app_sock.clone();
        let spawned = std::thread::Builder::new().name("client".into()).spawn(move || {
            let had_app = serve(conn, &control, timeout);
            active.fetch_sub(1, Ordering::SeqCst);
            if had_app && exit_when_idle {
                control.sandboxes.exit_if_idle(|| {
                    tracing::info!("last app detached; exiting (--exit-when-idle)");
                    // The socket goes first: from here on a new `flexstack run` starts a daemon of its own.
                    let _ = std::fs::remove_file(&sock);
                    let _ = std::fs::remove_file(&app_sock);
                    let _ = std::fs::remove_file(&pid_file);
                    control.shutdown();
                    std::process::exit(0);
                });
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start a client thread");
        }
    }
    Ok(())
}

/// On SIGINT/SIGTERM: stop the data plane (taps flush), remove the sockets and pid file, exit 0.
fn install_shutdown(control: Arc<Control>, files: Vec<PathBuf>) -> Result<(), String> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM]).map_err(|e| format!("signals: {e}"))?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                tracing::info!(signal = sig, "shutting down");
                for f in &files {
                    let _ = std::fs::remove_file(f);
                }
                control.sandboxes.detach_all(control.as_ref());
                control.shutdown();
                std::process::exit(0);
            }
        })
        .map_err(|e| format!("signal thread: {e}"))?;
    Ok(())
}

fn caller_of(conn: &UnixStream) -> Caller {
    match nix::sys::socket::getsockopt(conn, nix::sys::socket::sockopt::PeerCredentials) {
        Ok(cred) => {
            let uid = nix::unistd::Uid::from_raw(cred.uid());
            let user =
                nix::unistd::User::from_uid(uid).ok().flatten().map_or_else(|| cred.uid().to_string(), |u| u.name);
            Caller { user, pid: Some(cred.pid()) }
        }
        Err(_) => Caller { user: "unknown".into(), pid: None },
    }
}

enum ReadError {
    TooLarge,
    Timeout,
    Io,
}

/// Reads one line of at most `limit` bytes, within `deadline` in total.
fn read_line(
    reader: &mut BufReader<UnixStream>,
    limit: usize,
    timeout: Duration,
) -> Result<Option<Vec<u8>>, ReadError> {
    let start = Instant::now();
    let mut line = Vec::new();
    loop {
        if start.elapsed() > timeout {
            return Err(ReadError::Timeout);
        }
        let buf = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(ReadError::Timeout)
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => return Err(ReadError::Io),
        };
        if buf.is_empty() {
            return Ok(if line.is_empty() { None } else { Some(line) });
        }
        let (chunk, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (&buf[..i], Some(i + 1)),
            None => (buf, None),
        };
        if line.len() + chunk.len() > limit {
            return Err(ReadError::TooLarge);
        }
        line.extend_from_slice(chunk);
        let used = done.unwrap_or(chunk.len());
        reader.consume(used);
        if done.is_some() {
            return Ok(Some(line));
        }
    }
}

/// Serves one client; returns true if it asked to attach an app (and the lease, if granted, has ended by now).
fn serve(conn: UnixStream, control: &Control, timeout: Duration) -> bool {
    let caller = caller_of(&conn);
    let _ = conn.set_read_timeout(Some(timeout));
    let _ = conn.set_write_timeout(Some(Duration::from_secs(5)));
    let Ok(read_half) = conn.try_clone() else { return false };
    let mut reader = BufReader::new(read_half);
    let mut writer = conn;
    let mut send = |r: Response| writer.write_all(r.to_line().as_bytes()).is_ok();
    loop {
        let line = match read_line(&mut reader, MAX_REQUEST_BYTES, timeout) {
            Ok(Some(l)) => l,
            Ok(None) | Err(ReadError::Io) => return false,
            Err(ReadError::TooLarge) => {
                let msg = format!("request longer than {MAX_REQUEST_BYTES} bytes");
                send(Response::err(None, ApiError::new(ErrorCode::TooLarge, msg)));
                return false;
            }
            Err(ReadError::Timeout) => {
                let msg = format!("no complete request within {:.1} s; closing", timeout.as_secs_f64());
                send(Response::err(None, ApiError::new(ErrorCode::Timeout, msg)));
                return false;
            }
        };
        let Ok(text) = std::str::from_utf8(&line) else {
            send(Response::err(None, ApiError::new(ErrorCode::InvalidJson, "request is not UTF-8")));
            continue;
        };
        if text.trim().is_empty() {
            continue;
        }
        let (id, request) = parse_request(text);
        let request = match request {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(user = %caller.user, error = %e.message, "bad request");
                if !send(Response::err(id, e)) {
                    return false;
                }
                continue;
            }
        };
        if let Request::Watch(Watch { names, interval_ms, changes, count }) = request {
            let interval = Duration::from_millis(interval_ms.unwrap_or(1000).max(10));
            let mut emit = |event| send(Response::event(id.clone(), &event));
            let end = match control.watch(&names, interval, changes, count, &mut emit) {
                Ok(()) => Response::ok(id.clone(), &WatchDone { done: true }),
                Err(e) => Response::err(id.clone(), e),
            };
            if !send(end) {
                return false;
            }
            continue;
        }
        if let Request::AppAttach(AppAttach { name, uid, stack, subnet }) = request {
            let app = match control.sandboxes.attach(control, name, uid, stack.as_deref(), subnet.as_deref()) {
                Ok(app) => app,
                Err(e) => {
                    // A refused attach still counts: a daemon started for this app has nothing left to do.
                    send(Response::err(id, e));
                    return true;
                }
            };
            if !send(Response::ok(id, &app)) {
                control.sandboxes.detach(control, &app.name);
                return true;
            }
            // The lease: wait, without a time limit, for `app_detach` or the end of the connection.
            let _ = reader.get_ref().set_read_timeout(None);
            let detach_id = loop {
                match read_line(&mut reader, MAX_REQUEST_BYTES, Duration::MAX) {
                    Ok(Some(l)) => {
                        let (rid, r) = parse_request(&String::from_utf8_lossy(&l));
                        if matches!(r, Ok(Request::AppDetach)) {
                            break Some(rid);
                        }
                        let msg = "only app_detach is accepted on an app's lease connection";
                        if !send(Response::err(rid, ApiError::new(ErrorCode::InvalidRequest, msg))) {
                            break None;
                        }
                    }
                    _ => break None,
                }
            };
            control.sandboxes.detach(control, &app.name);
            if let Some(rid) = detach_id {
                send(Response::ok(rid, &Detached { detached: app.name }));
            }
            return true;
        }
        let response = match control.handle(request, &caller) {
            Ok(result) => Response::ok(id, &result),
            Err(e) => Response::err(id, e),
        };
        if !send(response) {
            return false;
        }
    }
}
