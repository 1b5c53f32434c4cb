//! Creating and tearing down a lab: namespaces, veth pairs, addresses, neighbours, routes, hosts files, the wire
//! daemon (the emulated links) and the stacked hosts' daemons.
//!
//! [`create`] writes the lab's state file (`<state dir>/labs/<lab>/state.json`) before it creates anything and
//! updates it as daemons start, so [`down`] can remove a lab whose runner was killed at any point: it stops the
//! programs and daemons in the lab's namespaces, removes the namespaces of the stacked hosts' sandboxed apps, the
//! namespaces themselves (their veth pairs go with them) and the `/etc/netns/<namespace>` folders.

use crate::error::{msg, CliError};
use flexstack_api::client::Client;
use flexstack_api::ops::Set;
use flexstack_lab::plan::Plan;
use flexstack_lab::Lab;
use serde::{Deserialize, Serialize};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Where the state of running labs is kept: `<state dir>/labs/<lab>/`.
pub fn labs_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("labs")
}

/// A host as recorded in the state file.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HostState {
    /// Its name.
    pub name: String,
    /// Its namespace.
    pub netns: String,
    /// For a stacked host: its daemon's state directory.
    pub daemon_dir: Option<PathBuf>,
    /// For a stacked host: its apps' stack template, with the lab's values (in the results folder).
    pub template: Option<PathBuf>,
}

/// A link as recorded in the state file.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LinkState {
    /// `a-b`.
    pub name: String,
    /// Host a.
    pub a: String,
    /// Host b.
    pub b: String,
    /// The emulator carrying a → b.
    pub emulator_ab: String,
    /// The emulator carrying b → a.
    pub emulator_ba: String,
    /// The link's two interfaces in the wire namespace (towards a, towards b): `lab link A B down` takes them
    /// down, so that both hosts' interfaces lose their carrier (empty in state files of older runners).
    #[serde(default)]
    pub wire_ends: Vec<String>,
}

/// What a lab consists of, kept in `<state dir>/labs/<lab>/state.json` while it exists.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LabState {
    /// The lab's name.
    pub name: String,
    /// Its file, as given.
    pub file: String,
    /// Its results folder.
    pub results: PathBuf,
    /// This state's folder.
    pub dir: PathBuf,
    /// The runner's pid (`lab run`), 0 for `lab up`.
    pub runner_pid: u32,
    /// The wire namespace.
    pub wire_netns: String,
    /// The wire daemon's state directory.
    pub wire_dir: PathBuf,
    /// Hosts.
    pub hosts: Vec<HostState>,
    /// Links.
    pub links: Vec<LinkState>,
}

impl LabState {
    /// Reads the state in folder `dir`.
    pub fn read(dir: &Path) -> Result<LabState, String> {
        let path = dir.join("state.json");
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    fn write(&self) -> Result<(), CliError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| msg(format!("{}: {e}", self.dir.display())))?;
        let tmp = self.dir.join("state.json.tmp");
        let text = serde_json::to_string_pretty(self).map_err(msg)?;
        std::fs::write(&tmp, text).map_err(|e| msg(format!("{}: {e}", tmp.display())))?;
        std::fs::rename(&tmp, self.dir.join("state.json")).map_err(msg)
    }

    /// The host named `name`.
    pub fn host(&self, name: &str) -> Result<&HostState, CliError> {
        self.hosts.iter().find(|h| h.name == name).ok_or_else(|| {
            let known: Vec<&str> = self.hosts.iter().map(|h| h.name.as_str()).collect();
            msg(format!("lab {} has no host {name:?}; its hosts: {}", self.name, known.join(", ")))
        })
    }

    /// The link between `a` and `b` (either order).
    pub fn link(&self, a: &str, b: &str) -> Result<&LinkState, CliError> {
        self.links.iter().find(|l| (l.a == a && l.b == b) || (l.a == b && l.b == a)).ok_or_else(|| {
            let known: Vec<&str> = self.links.iter().map(|l| l.name.as_str()).collect();
            msg(format!("lab {} has no link between {a} and {b}; its links: {}", self.name, known.join(", ")))
        })
    }

    /// A client of the wire daemon.
    pub fn wire(&self) -> Result<Client, CliError> {
        Ok(Client::connect(&self.wire_dir)?)
    }
}

/// True if process `pid` exists.
pub fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Runs a command; an error carries its stderr (see [`flexstack_daemon::sandbox::command_output`]).
pub fn sh(args: &[&str]) -> Result<(), CliError> {
    flexstack_daemon::sandbox::command_output(args).map(drop).map_err(msg)
}

fn sysctl(netns: &str, settings: &[String]) -> Result<(), CliError> {
    let mut args = vec!["ip", "netns", "exec", netns, "sysctl", "-qw"];
    args.extend(settings.iter().map(String::as_str));
    sh(&args)
}

/// Starts `flexstack daemon` in `netns` with `state_dir`, logging to `log`; waits until it answers. Its data plane
/// runs under SCHED_FIFO at `realtime` (the lab's `realtime`, default [`flexstack_lab::DEFAULT_REALTIME`]; 0: the
/// normal policy; where the kernel refuses, at normal priority: its log and `status` say so).
///
/// It enters only the network namespace (`nsenter --net`), not a mount namespace of its own as `ip netns exec`
/// would give it: a stacked host's daemon creates its apps' namespaces with `ip netns add`, whose mounts must be
/// seen by everyone (its `/etc/hosts` comes from `--app-etc` instead).
fn start_daemon(netns: &str, state_dir: &Path, realtime: u8, extra: &[&str], log: &Path) -> Result<u32, CliError> {
    let exe = std::env::current_exe().map_err(msg)?;
    std::fs::create_dir_all(state_dir).map_err(|e| msg(format!("{}: {e}", state_dir.display())))?;
    let log_file = std::fs::File::create(log).map_err(|e| msg(format!("{}: {e}", log.display())))?;
    let mut child = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{netns}"))
        .arg("--")
        .arg(exe)
        .arg("--state-dir")
        .arg(state_dir)
        .arg("daemon")
        .arg("--realtime")
        .arg(realtime.to_string())
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log_file)
        // Its own process group: a Ctrl-C at the terminal reaches the runner, which stops the lab in order.
        .process_group(0)
        .spawn()
        .map_err(|e| msg(format!("cannot start a daemon in {netns}: {e}")))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if Client::connect(state_dir).is_ok() {
            // `nsenter` execs the daemon, so the child's pid is the daemon's.
            let pid = child.id();
            std::mem::forget(child);
            return Ok(pid);
        }
        if let Ok(Some(status)) = child.try_wait() {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(5).collect();
            return Err(msg(format!(
                "the daemon in {netns} exited ({status}): {}",
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            )));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            return Err(msg(format!("the daemon in {netns} did not answer within 20 s; see {}", log.display())));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Options of [`create`].
pub struct CreateOptions<'a> {
    /// The daemons' state root (`--state-dir`).
    pub state_dir: &'a Path,
    /// The results folder (created).
    pub results: &'a Path,
    /// The lab file as given.
    pub file: &'a str,
    /// The runner's pid, 0 for `lab up`.
    pub runner_pid: u32,
    /// Stack templates of the stacked hosts (lab values filled in), by host (file order).
    pub templates: &'a [Option<String>],
}

/// Refuses to build a lab whose namespaces or state already exist.
fn check_free(lab: &Lab, plan: &Plan, dir: &Path) -> Result<(), CliError> {
    if dir.join("state.json").exists() || Path::new(&format!("/run/netns/{}", plan.wire_netns)).exists() {
        return Err(msg(format!(
            "lab {} is already up (state in {}); stop it with `flexstack lab down {}`",
            lab.name,
            dir.display(),
            lab.name
        )));
    }
    Ok(())
}

/// Builds the lab: on error, whatever was created is torn down again.
pub fn create(lab: &Lab, plan: &Plan, opts: &CreateOptions<'_>) -> Result<LabState, CliError> {
    let dir = labs_dir(opts.state_dir).join(&lab.name);
    check_free(lab, plan, &dir)?;
    let mut state = LabState {
        name: lab.name.clone(),
        file: opts.file.to_string(),
        results: opts.results.to_path_buf(),
        dir: dir.clone(),
        runner_pid: opts.runner_pid,
        wire_netns: plan.wire_netns.clone(),
        wire_dir: dir.join("wire"),
        hosts: plan
            .hosts
            .iter()
            .zip(opts.templates)
            .map(|(h, t)| HostState {
                name: h.name.clone(),
                netns: h.netns.clone(),
                daemon_dir: t.as_ref().map(|_| dir.join("hosts").join(&h.name)),
                template: t.as_ref().map(|_| opts.results.join("stacks").join(format!("{}.toml", h.name))),
            })
            .collect(),
        links: plan
            .links
            .iter()
            .zip(&lab.links)
            .map(|(p, l)| LinkState {
                name: p.name.clone(),
                a: l.a.clone(),
                b: l.b.clone(),
                emulator_ab: p.emulator_ab.clone(),
                emulator_ba: p.emulator_ba.clone(),
                wire_ends: vec![p.wire_a.clone(), p.wire_b.clone()],
            })
            .collect(),
    };
    state.write()?;
    match build(lab, plan, &mut state, opts) {
        Ok(()) => Ok(state),
        Err(e) => {
            down(&state, false);
            Err(e)
        }
    }
}

fn build(lab: &Lab, plan: &Plan, state: &mut LabState, opts: &CreateOptions<'_>) -> Result<(), CliError> {
    let logs = opts.results.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| msg(format!("{}: {e}", logs.display())))?;
    let wire = plan.wire_netns.as_str();
    sh(&["ip", "netns", "add", wire])?;
    sh(&["ip", "-n", wire, "link", "set", "lo", "up"])?;
    sysctl(wire, &["net.ipv6.conf.all.disable_ipv6=1".into(), "net.ipv6.conf.default.disable_ipv6=1".into()])?;
    for h in &plan.hosts {
        sh(&["ip", "netns", "add", &h.netns])?;
        sh(&["ip", "-n", &h.netns, "link", "set", "lo", "up"])?;
        sysctl(&h.netns, &["net.ipv4.ip_forward=1".into()])?;
        let etc = format!("/etc/netns/{}", h.netns);
        std::fs::create_dir_all(&etc).map_err(|e| msg(format!("{etc}: {e}")))?;
        std::fs::write(format!("{etc}/hosts"), &h.hosts_file).map_err(|e| msg(format!("{etc}/hosts: {e}")))?;
    }
    for h in &plan.hosts {
        for f in &h.interfaces {
            sh(&[
                "ip",
                "-n",
                wire,
                "link",
                "add",
                &f.wire_name,
                "type",
                "veth",
                "peer",
                "name",
                &f.name,
                "netns",
                &h.netns,
            ])?;
            sysctl(&h.netns, &[format!("net.ipv6.conf.{}.disable_ipv6=1", f.name)])?;
            sh(&["ip", "-n", &h.netns, "link", "set", &f.name, "address", &f.mac])?;
            if let Some(mtu) = f.mtu {
                let mtu = mtu.to_string();
                sh(&["ip", "-n", &h.netns, "link", "set", &f.name, "mtu", &mtu])?;
                sh(&["ip", "-n", wire, "link", "set", &f.wire_name, "mtu", &mtu])?;
            }
            sh(&["ip", "-n", &h.netns, "addr", "add", &format!("{}/24", f.address), "dev", &f.name])?;
            sh(&["ip", "-n", &h.netns, "link", "set", &f.name, "up"])?;
            sh(&["ip", "-n", wire, "link", "set", &f.wire_name, "up"])?;
            let peer = f.peer_address.to_string();
            sh(&[
                "ip",
                "-n",
                &h.netns,
                "neigh",
                "replace",
                &peer,
                "lladdr",
                &f.peer_mac,
                "dev",
                &f.name,
                "nud",
                "permanent",
            ])?;
        }
    }
    for h in &plan.hosts {
        for r in &h.routes {
            sh(&["ip", "-n", &h.netns, "route", "add", &r.destination, "via", &r.via.to_string(), "dev", &r.dev])?;
        }
    }
    let wire_stack = opts.results.join("wire.toml");
    std::fs::write(&wire_stack, plan.wire_stack(lab)).map_err(|e| msg(format!("{}: {e}", wire_stack.display())))?;
    let stack_arg = wire_stack.display().to_string();
    start_daemon(wire, &state.wire_dir, lab.realtime, &["--stack", &stack_arg], &logs.join("wire-daemon.log"))?;
    for ((h, hp), text) in state.hosts.iter().zip(&plan.hosts).zip(opts.templates) {
        if let (Some(d), Some(path), Some(text), Some(subnet)) = (&h.daemon_dir, &h.template, text, hp.app_subnet) {
            std::fs::create_dir_all(opts.results.join("stacks")).map_err(msg)?;
            std::fs::write(path, text).map_err(|e| msg(format!("{}: {e}", path.display())))?;
            let etc = format!("/etc/netns/{}", h.netns);
            let subnet = subnet.to_string();
            let args = ["--app-subnet", &subnet, "--app-etc", &etc];
            start_daemon(&h.netns, d, lab.realtime, &args, &logs.join(format!("{}-daemon.log", h.name)))?;
        }
    }
    state.write()
}

/// The pids of the processes in namespace `netns`.
fn pids_in(netns: &str) -> Vec<u32> {
    let out = Command::new("ip").args(["netns", "pids", netns]).stderr(Stdio::null()).output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).split_whitespace().filter_map(|p| p.parse().ok()).collect())
        .unwrap_or_default()
}

fn signal(pids: &[u32], sig: nix::sys::signal::Signal) {
    for &p in pids {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p as i32), sig);
    }
}

/// Sends SIGTERM to `pids`, waits up to `grace` for them to exit, then SIGKILLs what is left.
pub fn stop_processes(pids: &[u32], grace: Duration) {
    use nix::sys::signal::Signal;
    signal(pids, Signal::SIGTERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline && pids.iter().any(|&p| alive(p) && !zombie(p)) {
        std::thread::sleep(Duration::from_millis(20));
    }
    signal(&pids.iter().copied().filter(|&p| alive(p)).collect::<Vec<_>>(), Signal::SIGKILL);
}

fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')))
        .unwrap_or(true)
}

fn daemon_pid(state_dir: &Path) -> Option<u32> {
    std::fs::read_to_string(state_dir.join("daemon.pid")).ok()?.trim().parse().ok()
}

/// The namespaces of sandboxed apps of the daemon with `pid` (`fs-<pid>-<app>`).
fn app_namespaces(pid: u32) -> Vec<String> {
    let prefix = format!("fs-{pid}-");
    flexstack_daemon::sandbox::namespace_names().into_iter().filter(|n| n.starts_with(&prefix)).collect()
}

fn remove_netns(netns: &str) {
    stop_processes(&pids_in(netns), Duration::from_secs(2));
    flexstack_daemon::sandbox::delete_namespace(netns);
}

/// Tears the lab down, each step tried whatever happened before: programs first (SIGTERM, then SIGKILL after 3 s),
/// then the stacked hosts' daemons (which remove their apps' sandboxes), the wire daemon, leftover app namespaces,
/// the lab's namespaces, and the state. With `verbose`, says what it removes.
pub fn down(state: &LabState, verbose: bool) {
    let say = |what: &str| {
        if verbose {
            eprintln!("lab {}: {what}", state.name);
        }
    };
    let daemons: Vec<(u32, &Path)> = state
        .hosts
        .iter()
        .filter_map(|h| h.daemon_dir.as_deref())
        .chain([state.wire_dir.as_path()])
        .filter_map(|d| daemon_pid(d).map(|p| (p, d)))
        .collect();
    let daemon_pids: Vec<u32> = daemons.iter().map(|(p, _)| *p).collect();
    // 1. The programs (and `flexstack run`, which passes SIGTERM on to its app and detaches it).
    let programs: Vec<u32> = state
        .hosts
        .iter()
        .flat_map(|h| pids_in(&h.netns))
        .filter(|p| !daemon_pids.contains(p) && *p != std::process::id())
        .collect();
    if !programs.is_empty() {
        say(&format!("stopping {} program processes", programs.len()));
        stop_processes(&programs, Duration::from_secs(3));
    }
    // 2. The daemons.
    if !daemon_pids.is_empty() {
        say("stopping the daemons");
        stop_processes(&daemon_pids, Duration::from_secs(5));
    }
    // 3. Sandboxes the stacked hosts' daemons could not remove (they were killed).
    for (pid, _) in &daemons {
        for ns in app_namespaces(*pid) {
            say(&format!("removing app namespace {ns}"));
            remove_netns(&ns);
        }
    }
    // 4. The lab's namespaces: their veth pairs go with them.
    for ns in state.hosts.iter().map(|h| h.netns.as_str()).chain([state.wire_netns.as_str()]) {
        if Path::new(&format!("/run/netns/{ns}")).exists() {
            say(&format!("removing namespace {ns}"));
        }
        remove_netns(ns);
    }
    let _ = std::fs::remove_dir_all(&state.dir);
}

/// Writes a knob on the wire daemon or a stacked host's daemon.
pub fn set_knob(dir: &Path, name: &str, value: serde_json::Value) -> Result<(), CliError> {
    Client::connect(dir)?.call(Set { name: name.to_string(), value })?;
    Ok(())
}
