//! Creating and tearing down a lab: namespaces, veth pairs, addresses, neighbours, routes, hosts files, the wire
//! daemon (the emulated links) and the stacked hosts' daemons.
//!
//! [`create`] writes the lab's state file (`<state dir>/labs/<lab>/state.json`) before it creates anything and
//! updates it as daemons start, so [`down`] can remove a lab whose runner was killed at any point: it stops the
//! programs and daemons in the lab's namespaces, removes the namespaces of the stacked hosts' sandboxed apps, the
//! namespaces themselves (their veth pairs go with them) and the `/etc/netns/<namespace>` folders.

use crate::error::{msg, CliError};
use crate::lab::progress::Progress;
use flexstack_api::client::Client;
use flexstack_api::ops::Set;
use flexstack_faces::netconf::{self, NetconfError, Rtnl, Veth};
use flexstack_lab::plan::{HostPlan, Plan, RESOLV_CONF};
use flexstack_lab::Lab;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::os::fd::{AsFd, OwnedFd};
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

/// A netlink failure as the CLI's error; a refusal for want of privileges says so.
pub fn netconf_error(e: NetconfError) -> CliError {
    if e.is_permission() {
        return crate::error::needs_root(&e.what);
    }
    msg(e.to_string())
}

/// Sets interface `dev` of namespace `netns` up or down, through netlink.
pub fn set_link_up(netns: &str, dev: &str, up: bool) -> Result<(), CliError> {
    let ns = netconf::open_netns(netns).map_err(netconf_error)?;
    let mut nl = Rtnl::open_in(ns.as_fd()).map_err(netconf_error)?;
    let index = nl.index_of(dev).map_err(netconf_error)?;
    nl.set_up(index, up);
    nl.commit().map_err(netconf_error).map(drop)
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
        // One data-plane worker a host: a lab runs many hosts on a few cores, and the real-time workers of each
        // host's extra workers would take turns with the other hosts' (the late-binding handoff lab lost two
        // thirds of its throughput after the handoff with two).
        .args(["--workers", "1"])
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
    /// Print progress and the phases' times on stderr.
    pub progress: bool,
    /// Serve each daemon's meters for Prometheus on the host's loopback and write `prometheus.yml` (`--metrics`).
    pub metrics: bool,
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
    let mut progress = Progress::new(&lab.name, opts.progress);
    match build(lab, plan, &mut state, opts, &mut progress) {
        Ok(()) => {
            progress.finish("built");
            Ok(state)
        }
        Err(e) => {
            progress.finish("failed to build");
            down(&state, opts.progress);
            Err(e)
        }
    }
}

/// A namespace the build created: its name, the namespace open, a netlink socket in it.
struct Made {
    fd: OwnedFd,
    nl: Rtnl,
}

/// Creates namespace `name` with `sysctls` set; returns it open with a netlink socket in it.
fn make_netns(name: &str, sysctls: &[(&str, &str)]) -> Result<Made, CliError> {
    let fd = netconf::add_netns(name).map_err(netconf_error)?;
    let nl = netconf::in_netns(fd.as_fd(), || {
        netconf::write_sysctls(sysctls)?;
        Rtnl::open().map_err(|e| e.error)
    })
    .map_err(|e| {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            crate::error::needs_root(&format!("configure namespace {name}"))
        } else {
            msg(format!("configure namespace {name}: {e}"))
        }
    })?;
    Ok(Made { fd, nl })
}

/// The index of `lo` in a new namespace.
const LOOPBACK_INDEX: u32 = 1;

fn build(
    lab: &Lab,
    plan: &Plan,
    state: &mut LabState,
    opts: &CreateOptions<'_>,
    progress: &mut Progress,
) -> Result<(), CliError> {
    let logs = opts.results.join("logs");
    std::fs::create_dir_all(&logs).map_err(|e| msg(format!("{}: {e}", logs.display())))?;
    // 1. Namespaces: the wire's without IPv6, the hosts' forwarding. IPv6 stays off on the hosts' lab interfaces
    //    (`default` while they are created, back on afterwards for the devices of stacked hosts' daemons), so that
    //    only the programs' own packets cross the emulated links.
    progress.phase("namespaces", plan.hosts.len() + 1);
    let wire_v6_off = [("net.ipv6.conf.all.disable_ipv6", "1"), ("net.ipv6.conf.default.disable_ipv6", "1")];
    let mut wire = make_netns(&plan.wire_netns, &wire_v6_off)?;
    wire.nl.set_up(LOOPBACK_INDEX, true);
    progress.step(1);
    let host_sysctls = [("net.ipv4.ip_forward", "1"), ("net.ipv6.conf.default.disable_ipv6", "1")];
    let mut hosts: Vec<Made> = Vec::with_capacity(plan.hosts.len());
    for h in &plan.hosts {
        hosts.push(make_netns(&h.netns, &host_sysctls)?);
        let etc = format!("/etc/netns/{}", h.netns);
        std::fs::create_dir_all(&etc).map_err(|e| msg(format!("{etc}: {e}")))?;
        std::fs::write(format!("{etc}/hosts"), &h.hosts_file).map_err(|e| msg(format!("{etc}/hosts: {e}")))?;
        std::fs::write(format!("{etc}/resolv.conf"), RESOLV_CONF)
            .map_err(|e| msg(format!("{etc}/resolv.conf: {e}")))?;
        progress.step(1);
    }
    // 2. Links: one veth pair per host interface, the host end in its namespace with its MAC and MTU.
    let interfaces: usize = plan.hosts.iter().map(|h| h.interfaces.len()).sum();
    progress.phase("links", interfaces);
    let macs: Vec<Vec<[u8; 6]>> = plan
        .hosts
        .iter()
        .map(|h| h.interfaces.iter().map(|f| mac(&f.mac)).collect::<Result<_, _>>())
        .collect::<Result<_, _>>()?;
    for ((h, made), macs) in plan.hosts.iter().zip(&hosts).zip(&macs) {
        for (f, mac) in h.interfaces.iter().zip(macs) {
            wire.nl.add_veth(&Veth {
                name: &f.wire_name,
                peer: &f.name,
                peer_netns: Some(made.fd.as_fd()),
                peer_mac: Some(*mac),
                mtu: f.mtu,
                up: true,
            });
        }
        progress.step(h.interfaces.len());
    }
    wire.nl.commit().map_err(netconf_error)?;
    // 3. In each host: interfaces up, addresses, the peers as permanent neighbours, routes; IPv6 back on for the
    //    devices created later.
    progress.phase("addresses and routes", plan.hosts.len());
    for (h, made) in plan.hosts.iter().zip(&mut hosts) {
        configure_host(h, &mut made.nl)?;
        netconf::in_netns(made.fd.as_fd(), || netconf::write_sysctls(&[("net.ipv6.conf.default.disable_ipv6", "0")]))
            .map_err(|e| msg(format!("{}: {e}", h.netns)))?;
        progress.step(1);
    }
    drop(hosts);
    // 4. The daemons.
    progress.phase("wire daemon", 0);
    let wire_stack = opts.results.join("wire.toml");
    std::fs::write(&wire_stack, plan.wire_stack(lab)).map_err(|e| msg(format!("{}: {e}", wire_stack.display())))?;
    let stack_arg = wire_stack.display().to_string();
    let wire_ns = plan.wire_netns.as_str();
    // With --metrics, every daemon listens on a free port of the loopback of the runner's own namespace.
    let runner_netns = format!("/proc/{}/ns/net", std::process::id());
    let metrics: Vec<&str> =
        if opts.metrics { vec!["--metrics", "127.0.0.1:0", "--metrics-netns", &runner_netns] } else { Vec::new() };
    let wire_args = [&["--stack", stack_arg.as_str()][..], &metrics].concat();
    start_daemon(wire_ns, &state.wire_dir, lab.realtime, &wire_args, &logs.join("wire-daemon.log"))?;
    let stacked = plan.hosts.iter().filter(|h| h.stack.is_some()).count();
    if stacked > 0 {
        progress.phase("stacked hosts' daemons", stacked);
    }
    for ((h, hp), text) in state.hosts.iter().zip(&plan.hosts).zip(opts.templates) {
        if let (Some(d), Some(path), Some(text), Some(subnet)) = (&h.daemon_dir, &h.template, text, hp.app_subnet) {
            std::fs::create_dir_all(opts.results.join("stacks")).map_err(msg)?;
            std::fs::write(path, text).map_err(|e| msg(format!("{}: {e}", path.display())))?;
            let etc = format!("/etc/netns/{}", h.netns);
            let subnet = subnet.to_string();
            let args = [&["--app-subnet", subnet.as_str(), "--app-etc", etc.as_str()][..], &metrics].concat();
            start_daemon(&h.netns, d, lab.realtime, &args, &logs.join(format!("{}-daemon.log", h.name)))?;
            progress.step(1);
        }
    }
    if opts.metrics {
        write_prometheus_config(lab, state, opts.results)?;
    }
    state.write()
}

/// `<results>/prometheus.yml`: a scrape job of the lab's daemons, each target at the address its `status` reports,
/// labelled with the lab and the host (`wire` for the wire daemon).
fn write_prometheus_config(lab: &Lab, state: &LabState, results: &Path) -> Result<(), CliError> {
    let mut daemons = vec![("wire".to_string(), state.wire_dir.clone())];
    daemons.extend(state.hosts.iter().filter_map(|h| Some((h.name.clone(), h.daemon_dir.clone()?))));
    let mut targets = String::new();
    for (host, dir) in daemons {
        let status = Client::connect(&dir)
            .and_then(|mut c| c.call(flexstack_api::ops::Status))
            .map_err(|e| msg(format!("the daemon of {host}: {e}")))?;
        let addr = status.metrics.ok_or_else(|| msg(format!("the daemon of {host} serves no metrics")))?;
        targets.push_str(&format!(
            "      - targets: [\"{addr}\"]\n        labels: {{lab: \"{}\", host: \"{host}\"}}\n",
            lab.name
        ));
    }
    let text = format!(
        "# Prometheus scrape configuration of lab {name}'s daemons, written by `flexstack lab run --metrics`; valid \
         while the lab runs:\n# prometheus --config.file={file}\nglobal:\n  scrape_interval: 1s\nscrape_configs:\n  \
         - job_name: flexstack-lab-{name}\n    static_configs:\n{targets}",
        name = lab.name,
        file = results.join("prometheus.yml").display()
    );
    let path = results.join("prometheus.yml");
    std::fs::write(&path, text).map_err(|e| msg(format!("{}: {e}", path.display())))
}

fn mac(text: &str) -> Result<[u8; 6], CliError> {
    netconf::parse_mac(text).ok_or_else(|| msg(format!("bad MAC address {text:?} in the plan")))
}

/// Interfaces up, addresses, static neighbours and routes of host `h`, through its namespace's socket `nl`, in one
/// commit.
fn configure_host(h: &HostPlan, nl: &mut Rtnl) -> Result<(), CliError> {
    let index: HashMap<String, u32> = nl.links().map_err(netconf_error)?.into_iter().map(|(i, n)| (n, i)).collect();
    let index_of = |dev: &str| {
        index.get(dev).copied().ok_or_else(|| msg(format!("{}: no interface {dev} after creating it", h.netns)))
    };
    nl.set_up(LOOPBACK_INDEX, true);
    for f in &h.interfaces {
        let i = index_of(&f.name)?;
        nl.set_up(i, true);
        nl.add_address(i, IpAddr::V4(f.address), 24);
        nl.add_neighbour(i, IpAddr::V4(f.peer_address), mac(&f.peer_mac)?);
    }
    for r in &h.routes {
        let (dest, len) = r.prefix().ok_or_else(|| msg(format!("bad route destination {:?}", r.destination)))?;
        nl.add_route(IpAddr::V4(dest), len, Some(IpAddr::V4(r.via)), index_of(&r.dev)?);
    }
    nl.commit().map_err(|e| msg(format!("{} (host {}, namespace {})", e, h.name, h.netns))).map(drop)
}

/// The processes (not this one) in any of the named network namespaces `names`: one pass over `/proc`, comparing
/// each process's namespace with the names' (as `ip netns pids` does for one).
fn processes_in(names: &[&str]) -> Vec<u32> {
    use std::os::unix::fs::MetadataExt;
    let wanted: HashSet<(u64, u64)> = names
        .iter()
        .filter_map(|n| std::fs::metadata(netconf::netns_path(n)).ok())
        .map(|m| (m.dev(), m.ino()))
        .collect();
    if wanted.is_empty() {
        return Vec::new();
    }
    let me = std::process::id();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            std::fs::metadata(format!("/proc/{pid}/ns/net")).is_ok_and(|m| wanted.contains(&(m.dev(), m.ino())))
        })
        .collect()
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
        std::thread::sleep(Duration::from_millis(10));
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

/// Tears the lab down, each step tried whatever happened before: programs first (SIGTERM, then SIGKILL after 3 s),
/// then the stacked hosts' daemons (which remove their apps' sandboxes), the wire daemon, leftover app namespaces,
/// the lab's namespaces (their veth pairs go with them), and the state. With `verbose`, shows its progress and the
/// phases' times on stderr.
pub fn down(state: &LabState, verbose: bool) {
    let mut progress = Progress::new(&state.name, verbose);
    let daemons: Vec<(u32, &Path)> = state
        .hosts
        .iter()
        .filter_map(|h| h.daemon_dir.as_deref())
        .chain([state.wire_dir.as_path()])
        .filter_map(|d| daemon_pid(d).map(|p| (p, d)))
        .collect();
    let daemon_pids: Vec<u32> = daemons.iter().map(|(p, _)| *p).collect();
    let host_namespaces: Vec<&str> = state.hosts.iter().map(|h| h.netns.as_str()).collect();
    // 1. The programs (and `flexstack run`, which passes SIGTERM on to its app and detaches it).
    let programs: Vec<u32> = processes_in(&host_namespaces).into_iter().filter(|p| !daemon_pids.contains(p)).collect();
    if !programs.is_empty() {
        progress.phase("stopping programs", programs.len());
        stop_processes(&programs, Duration::from_secs(3));
    }
    // 2. The daemons.
    if !daemon_pids.is_empty() {
        progress.phase("stopping daemons", daemon_pids.len());
        stop_processes(&daemon_pids, Duration::from_secs(5));
    }
    // 3. The lab's namespaces and the sandboxes the stacked hosts' daemons could not remove (they were killed):
    //    whatever still runs in them is stopped, then their names go (their veth pairs with them).
    let mut namespaces: Vec<String> = daemons.iter().flat_map(|(pid, _)| app_namespaces(*pid)).collect();
    namespaces.extend(host_namespaces.iter().map(|n| n.to_string()));
    namespaces.push(state.wire_netns.clone());
    let names: Vec<&str> = namespaces.iter().map(String::as_str).collect();
    let left = processes_in(&names);
    if !left.is_empty() {
        progress.phase("stopping what is left", left.len());
        stop_processes(&left, Duration::from_secs(2));
    }
    progress.phase("removing namespaces", namespaces.len());
    for e in netconf::del_netns_all(&names) {
        eprintln!("lab {}: {e}", state.name);
    }
    for ns in &namespaces {
        let _ = std::fs::remove_dir_all(format!("/etc/netns/{ns}"));
    }
    progress.step(namespaces.len());
    let _ = std::fs::remove_dir_all(&state.dir);
    progress.finish("torn down");
}

/// Writes a knob on the wire daemon or a stacked host's daemon.
pub fn set_knob(dir: &Path, name: &str, value: serde_json::Value) -> Result<(), CliError> {
    Client::connect(dir)?.call(Set { name: name.to_string(), value })?;
    Ok(())
}
