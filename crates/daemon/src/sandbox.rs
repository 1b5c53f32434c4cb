//! Sandboxes for unmodified applications: each app runs in a network namespace of its own whose only interface
//! is a TUN device owned by flexstack's data plane; a second TUN device in the host namespace (the host face)
//! hands its packets to the host kernel, which routes them onward with masquerading.
//!
//! What attaching an app changes on the host, all of it undone when the last app detaches (or the daemon stops):
//! - a namespace `fs-<daemon pid>-<app>` under /run/netns and `/etc/netns/<namespace>/{resolv.conf,hosts}` (copies
//!   of the host's, so DNS and host names work inside);
//! - a cgroup (v2) `flexstack/fs-<daemon pid>-<app>` at the root of the cgroup hierarchy: `flexstack run` starts
//!   the app in it, and every process in it is killed (`cgroup.kill`) when the app detaches;
//! - two TUN devices (`fsa…` moved into the namespace, `fsh…` in the host) and routes to the app's subnet via the
//!   host device;
//! - `net.ipv4.ip_forward` and `net.ipv6.conf.all.forwarding` set to 1; the values before are kept in
//!   `/run/flexstack-forwarding-<netns inode>.saved` and restored when the last daemon with apps removes its table;
//! - an nftables table `inet flexstack_<daemon pid>` masquerading the apps' subnets on the way out, and guarding
//!   them: a packet from or to the daemon's app prefixes (v4 and v6) that would leave through any interface but a
//!   host face (`fsh*`) is dropped. The table is made before the first app's devices and outlives a daemon that is
//!   killed, so that replies to a sandbox whose routes went with its devices never leave through the host's
//!   default route; it is removed (after the apps' conntrack entries) only when the daemon's last app detaches or
//!   by the cleanup of a daemon that is gone.
//!
//! Names and liveness: a daemon holds `/run/flexstack/daemons/<pid>.lock` locked (flock) while it runs; the lock
//! goes with the process, however it ends. The state of daemon `<pid>` (namespaces, cgroups, the nftables table)
//! is stale only when no process holds that lock (and, for daemons from before the lock, no flexstack daemon runs
//! with that pid); every daemon removes stale state when it starts and before each attach. The daemons of one
//! network namespace take turns through `/run/flexstack-host-<netns inode>.lock` (flock) for what they share: an
//! app's subnet from its choice to its routes, and the forwarding settings with the table made or removed.
//!
//! Addresses: an app gets A.B.n.2/24 and fd77:B:n::2/64 (A.B from `--app-subnet`, default 10.77.0.0/16) with the
//! first n whose /24 and /64 no route of the host's uses (so daemons side by side share the /16 without clashing),
//! or the /24 its `flexstack run --subnet` asks for; default routes through its TUN device.

use flexstack_api::ops::AppInfo;
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_core::config::valid_name;
use flexstack_core::StackSpec;
use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The chain an app gets when no template is given (stacks/app-default.toml).
pub const DEFAULT_TEMPLATE: &str = include_str!("../../../stacks/app-default.toml");

/// Where daemons hold their lock files (`<pid>.lock`).
pub const REGISTRY: &str = "/run/flexstack/daemons";

struct HostState {
    table: String,
}

/// Where the host's forwarding settings are kept while any daemon's apps run: one file per network namespace
/// (daemons of stacked lab hosts run in namespaces of their own), named after the namespace's inode.
fn saved_forwarding() -> String {
    format!("/run/flexstack-forwarding-{}.saved", netns_inode())
}

/// The inode number of this process's network namespace, as digits.
fn netns_inode() -> String {
    let ns = std::fs::read_link("/proc/self/ns/net").map(|p| p.display().to_string()).unwrap_or_default();
    ns.chars().filter(char::is_ascii_digit).collect()
}

/// An exclusive lock of the daemons of one network namespace, held while one chooses an app's subnet and routes it
/// (so that two never take the same one), and while one decides on the host's forwarding settings and makes or
/// removes its table (so that the one that stops last restores the settings and none restores them while another's
/// apps still run). `None` (no lock, warned) when /run does not take the file.
fn host_lock() -> Option<std::fs::File> {
    let path = format!("/run/flexstack-host-{}.lock", netns_inode());
    let file = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&path);
    match file.and_then(|f| f.lock().map(|()| f)) {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::warn!(path, error = %e, "cannot lock the host's shared settings (subnets, forwarding) against other daemons");
            None
        }
    }
}

/// The lock file of daemon `pid`.
fn lock_path(pid: u32) -> PathBuf {
    Path::new(REGISTRY).join(format!("{pid}.lock"))
}

/// A daemon's hold on its names: its lock file, locked for as long as the process lives.
struct Instance {
    _lock: std::fs::File,
}

/// Takes this process's lock file (waiting while a cleanup of a dead daemon that had the same pid holds it).
fn acquire_instance() -> Result<Instance, String> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(REGISTRY)
        .map_err(|e| format!("{REGISTRY}: cannot create: {e}"))?;
    let path = lock_path(std::process::id());
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    file.lock().map_err(|e| format!("{}: cannot lock: {e}", path.display()))?;
    Ok(Instance { _lock: file })
}

/// How another daemon's lock file is found.
enum Lock {
    /// Held: the daemon runs.
    Held,
    /// Not held; we hold it now (until the file is dropped): the daemon is gone.
    Taken(std::fs::File),
    /// No lock file (a daemon from before lock files, or none).
    Missing,
}

fn try_lock(pid: u32) -> Lock {
    match std::fs::File::open(lock_path(pid)) {
        Err(_) => Lock::Missing,
        Ok(f) => match f.try_lock() {
            Ok(()) => Lock::Taken(f),
            Err(std::fs::TryLockError::WouldBlock) => Lock::Held,
            Err(std::fs::TryLockError::Error(_)) => Lock::Missing,
        },
    }
}

/// Runs the commands of `script` with `nft -f -`, as one transaction.
fn nft(script: &str) -> Result<(), String> {
    flexstack_faces::netconf::nft(None, script)
}

/// The prefixes (`a.b.c.d/n`, `x::/n`) written in `text`, as nft lists a table or a set.
fn prefixes_in(text: &str) -> Vec<String> {
    text.split(|c: char| c.is_whitespace() || c == ',' || c == '{' || c == '}')
        .filter(|t| parse_prefix(t).is_some())
        .map(str::to_string)
        .collect()
}

/// Deletes the connection-tracking entries from or to `prefix` (the masquerading of an app's flows), so that no
/// late reply is translated back to a sandbox address that is gone. Logs what fails (conntrack missing).
pub fn flush_conntrack(prefix: &str) {
    let family = if prefix.contains(':') { "ipv6" } else { "ipv4" };
    for dir in ["-s", "-d"] {
        match Command::new("conntrack").args(["-D", "-f", family, dir, prefix]).output() {
            // conntrack exits 1 when nothing matched; it says how many it deleted either way.
            Ok(o) if o.status.success() || String::from_utf8_lossy(&o.stderr).contains("have been deleted") => {}
            Ok(o) => tracing::warn!(prefix, error = %String::from_utf8_lossy(&o.stderr).trim(), "conntrack -D failed"),
            Err(e) => {
                tracing::warn!(prefix, error = %e, "cannot run conntrack (conntrack-tools) to flush a sandbox's flows")
            }
        }
    }
}

/// Deletes a daemon's nftables table after flushing the conntrack entries of the apps it lists; if no other
/// daemon's table remains, restores the host's forwarding settings first (so that nothing is forwarded between
/// the table's guard going and the settings coming back). Also used by `flexstack run` after a daemon that died.
pub fn remove_host_table(table: &str) {
    let out = Command::new("nft").args(["list", "table", "inet", table]).output();
    let Some(out) = out.ok().filter(|o| o.status.success()) else { return };
    let listing = String::from_utf8_lossy(&out.stdout);
    // The apps' prefixes (sets apps4/apps6), or those of a table from before them (its masquerade rules).
    let apps: Vec<String> = listing
        .lines()
        .skip_while(|l| !l.contains("set apps4"))
        .take_while(|l| !l.contains("chain "))
        .flat_map(prefixes_in)
        .collect();
    let flush = if listing.contains("set apps4") { apps } else { prefixes_in(&listing) };
    for p in &flush {
        flush_conntrack(p);
    }
    let _lock = host_lock();
    if !other_tables_exist(table) {
        if let Ok(saved) = std::fs::read_to_string(saved_forwarding()) {
            let mut v = saved.split_whitespace();
            let _ = std::fs::write(FORWARD_V4, v.next().unwrap_or("0"));
            let _ = std::fs::write(FORWARD_V6, v.next().unwrap_or("0"));
            let _ = std::fs::remove_file(saved_forwarding());
        }
    }
    if let Err(e) = nft(&format!("delete table inet {table}\n")) {
        tracing::warn!(table, error = %e, "cannot delete the nftables table");
    }
}

/// What `nft list tables` prints (`table inet NAME` per line); empty if nft fails.
fn nft_tables() -> String {
    let out = Command::new("nft").args(["list", "tables"]).output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).to_string()).unwrap_or_default()
}

/// The network namespaces named in /run/netns.
pub fn namespace_names() -> Vec<String> {
    dir_names("/run/netns")
}

fn dir_names(dir: impl AsRef<Path>) -> Vec<String> {
    std::fs::read_dir(dir).into_iter().flatten().flatten().filter_map(|e| e.file_name().into_string().ok()).collect()
}

/// The daemons' tables (`flexstack_<pid>`) in `listing`, as `nft list tables` prints them (`table inet NAME`),
/// other than `own`. Not the tables of a daemon's stream endpoints (`flexstack_kserver_<port>`, ...): those go
/// with their module, not with the daemon's apps.
fn flexstack_tables<'a>(listing: &'a str, own: &'a str) -> impl Iterator<Item = &'a str> {
    listing.lines().filter_map(|l| l.split_whitespace().nth(2)).filter(move |t| {
        t.strip_prefix("flexstack_").is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
            && *t != own
    })
}

/// True if an nftables table of another flexstack daemon (not `own`) exists.
fn other_tables_exist(own: &str) -> bool {
    flexstack_tables(&nft_tables(), own).next().is_some()
}

/// The tables in `listing` (as `nft list tables` prints them) that belong to flexstack daemons no longer running:
/// `flexstack_<pid>` whose pid `live` says is not a running daemon, and not `own`.
fn stale_tables<'a>(listing: &'a str, own: &'a str, live: impl Fn(u32) -> bool) -> Vec<&'a str> {
    flexstack_tables(listing, own)
        .filter(|t| t.strip_prefix("flexstack_").and_then(|pid| pid.parse::<u32>().ok()).is_some_and(|pid| !live(pid)))
        .collect()
}

/// True if process `pid` is a running flexstack daemon (its command line says so).
fn is_live_daemon(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
        let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
        args.first().is_some_and(|a| a.ends_with(b"flexstack")) && args.contains(&&b"daemon"[..])
    })
}

/// The daemon pid in the name of an app namespace or cgroup (`fs-<daemon pid>-<app>`).
fn daemon_of(name: &str) -> Option<u32> {
    name.strip_prefix("fs-")?.split_once('-')?.0.parse().ok()
}

/// Removes what flexstack daemons that died without cleaning up (SIGKILL) left: the processes of their apps (their
/// cgroups), their apps' namespaces, their nftables tables in this network namespace (after the conntrack entries
/// of their apps) and their lock files. The lock of each is held meanwhile, so a new daemon that got the same pid
/// waits for the cleanup to end; a daemon that still runs holds its lock and is never touched.
fn remove_stale_leftovers(own: &str) {
    let listing = nft_tables();
    let names = namespace_names();
    let cgroups = cgroup_base().map(dir_names).unwrap_or_default();
    let mut pids: BTreeSet<u32> = dir_names(REGISTRY)
        .iter()
        .filter_map(|f| f.strip_suffix(".lock")?.parse().ok())
        .chain(names.iter().chain(&cgroups).filter_map(|n| daemon_of(n)))
        .collect();
    pids.extend(stale_tables(&listing, own, |_| false).iter().filter_map(|t| t[10..].parse::<u32>().ok()));
    for pid in pids {
        if pid == std::process::id() {
            continue;
        }
        // Live: its lock is held, or a flexstack daemon runs as that pid (one from before lock files, or one that
        // has not taken its lock yet).
        let lock = match try_lock(pid) {
            Lock::Held => continue,
            other => other,
        };
        if is_live_daemon(pid) {
            continue;
        }
        let prefix = format!("fs-{pid}-");
        for cg in cgroups.iter().filter(|c| c.starts_with(&prefix)) {
            tracing::warn!(cgroup = %cg, "killing the processes left of an app of a daemon that is gone");
            if let Some(path) = app_cgroup(cg) {
                if let Err(e) = kill_cgroup(&path) {
                    tracing::warn!(cgroup = %cg, error = %e, "cannot remove the cgroup");
                }
            }
        }
        for netns in names.iter().filter(|n| n.starts_with(&prefix)) {
            tracing::warn!(netns, "removing the app namespace of a daemon that is gone");
            delete_namespace(netns);
        }
        let table = format!("flexstack_{pid}");
        if flexstack_tables(&listing, own).any(|t| t == table) {
            tracing::warn!(table, "removing the nftables table of a daemon that is gone");
            remove_host_table(&table);
        }
        if let Lock::Taken(_held) = lock {
            let _ = std::fs::remove_file(lock_path(pid));
        }
    }
}

/// The root of the cgroup v2 hierarchy (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on a hybrid host), from
/// /proc/self/mountinfo; `None` without one.
fn cgroup2_mount() -> Option<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|l| {
        let (before, after) = l.split_once(" - ")?;
        if after.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        before.split_whitespace().nth(4).map(PathBuf::from)
    })
}

/// The folder of the sandboxes' cgroups: `flexstack` at the root of the cgroup v2 hierarchy.
pub fn cgroup_base() -> Option<PathBuf> {
    cgroup2_mount().map(|m| m.join("flexstack"))
}

/// The cgroup of the app whose namespace is `netns` (named the same).
pub fn app_cgroup(netns: &str) -> Option<PathBuf> {
    cgroup_base().map(|b| b.join(netns))
}

/// True while a process is in cgroup `dir`.
fn populated(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("cgroup.procs")).is_ok_and(|p| !p.trim().is_empty())
}

/// Kills every process in cgroup `dir` (`cgroup.kill`, which needs no CAP_KILL: the kernel sends the SIGKILLs),
/// waits for them to be gone and removes the cgroup. Nothing to do if it does not exist.
pub fn kill_cgroup(dir: &Path) -> Result<(), String> {
    if !dir.exists() {
        return Ok(());
    }
    if populated(dir) {
        let kill = dir.join("cgroup.kill");
        std::fs::write(&kill, "1").map_err(|e| format!("{}: {e} (cgroup.kill needs Linux 5.14)", kill.display()))?;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while populated(dir) {
        if Instant::now() > deadline {
            return Err(format!("{}: processes are left after cgroup.kill", dir.display()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // An emptied cgroup can stay busy for a moment after its last process has gone.
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if Instant::now() > deadline => return Err(format!("{}: cannot remove: {e}", dir.display())),
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// A prefix written `a.b.c.d/n` or `x:…/n` (a host route without `/n`: all bits), as (address, length, bits).
fn parse_prefix(text: &str) -> Option<(u128, u8, u8)> {
    let (addr, len) = text.split_once('/').map_or((text, None), |(a, l)| (a, Some(l)));
    let (value, bits) = match addr.parse::<Ipv4Addr>() {
        Ok(a) => (u128::from(u32::from(a)), 32),
        Err(_) => (u128::from(addr.parse::<Ipv6Addr>().ok()?), 128),
    };
    let len = match len {
        Some(l) => l.parse::<u8>().ok().filter(|l| *l <= bits)?,
        None => bits,
    };
    Some((value, len, bits))
}

/// The destinations of the routes `ip -o route show table all` printed (`default` as a /0).
fn route_prefixes(listing: &str) -> Vec<(u128, u8, u8)> {
    const TYPES: &[&str] = &[
        "unicast",
        "local",
        "broadcast",
        "multicast",
        "unreachable",
        "blackhole",
        "prohibit",
        "throw",
        "anycast",
        "nat",
    ];
    listing
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace().skip_while(|w| TYPES.contains(w));
            let dest = words.next()?;
            if dest == "default" {
                let bits = if l.contains(':') { 128 } else { 32 };
                return Some((0, 0, bits));
            }
            parse_prefix(dest)
        })
        .collect()
}

/// True if a route more specific than a /`wider` (the app prefix's, whose routes are no clash) overlaps `prefix`:
/// its addresses are in use on the host.
fn in_use(routes: &[(u128, u8, u8)], prefix: (u128, u8, u8), wider: u8) -> bool {
    let (net, len, bits) = prefix;
    let mask = |l: u8| if l == 0 { 0 } else { u128::MAX << (128 - u32::from(l)) } >> (128 - u32::from(bits));
    routes.iter().any(|&(a, l, b)| {
        let shorter = l.min(len);
        b == bits && l > wider && (a & mask(shorter)) == (net & mask(shorter))
    })
}

/// The host's routes (v4 and v6), for [`in_use`].
fn host_routes() -> Vec<(u128, u8, u8)> {
    let mut routes = Vec::new();
    for family in ["-4", "-6"] {
        if let Ok(text) = command_output(&["ip", "-o", family, "route", "show", "table", "all"]) {
            routes.extend(route_prefixes(&text));
        }
    }
    routes
}

/// An app's addresses: its /24 and /64, and the prefixes as text.
#[derive(Clone, Debug, PartialEq, Eq)]
struct AppNet {
    v4: [u8; 3],
    v6: [u16; 3],
}

impl AppNet {
    /// A.B.n.0/24 and fd77:B:n::/64.
    fn new(v4: [u8; 3]) -> AppNet {
        AppNet { v4, v6: [0xfd77, u16::from(v4[1]), u16::from(v4[2])] }
    }

    /// From `a.b.c.0/24` (the /24 of `--subnet`).
    fn parse(text: &str) -> Result<AppNet, String> {
        let bad = || format!("invalid subnet {text:?}: expected a /24 such as 10.90.3.0/24");
        let (a, len) = text.split_once('/').unwrap_or((text, "24"));
        let a: Ipv4Addr = a.parse().map_err(|_| bad())?;
        let o = a.octets();
        if len != "24" || o[3] != 0 {
            return Err(bad());
        }
        Ok(AppNet::new([o[0], o[1], o[2]]))
    }

    /// `A.B.n` and `fd77:B:n:`, the common part of the /24's and the /64's addresses.
    fn stems(&self) -> (String, String) {
        let ([a, b, c], [x, y, z]) = (self.v4, self.v6);
        (format!("{a}.{b}.{c}"), format!("{x:x}:{y:x}:{z:x}:"))
    }

    fn ipv4(&self) -> String {
        format!("{}.2", self.stems().0)
    }

    fn ipv6(&self) -> String {
        format!("{}:2", self.stems().1)
    }

    /// The /24's first address.
    fn net4(&self) -> Ipv4Addr {
        let [a, b, c] = self.v4;
        Ipv4Addr::new(a, b, c, 0)
    }

    /// The /64's first address.
    fn net6(&self) -> Ipv6Addr {
        let [x, y, z] = self.v6;
        Ipv6Addr::new(x, y, z, 0, 0, 0, 0, 0)
    }

    fn prefix4(&self) -> String {
        format!("{}/24", self.net4())
    }

    fn prefix6(&self) -> String {
        format!("{}/64", self.net6())
    }

    /// The app's net from its addresses (as in [`AppInfo`]).
    fn of(app: &AppInfo) -> Option<AppNet> {
        let o = app.ipv4.parse::<Ipv4Addr>().ok()?.octets();
        let s = app.ipv6.parse::<Ipv6Addr>().ok()?.segments();
        Some(AppNet { v4: [o[0], o[1], o[2]], v6: [s[0], s[1], s[2]] })
    }

    /// True if a route of the host's overlaps the /24 or the /64 (more specific than the /16 and /32 app
    /// prefixes, whose own guard routes are no clash).
    fn used(&self, routes: &[(u128, u8, u8)]) -> bool {
        let p4 = parse_prefix(&self.prefix4()).expect("a prefix");
        let p6 = parse_prefix(&self.prefix6()).expect("a prefix");
        in_use(routes, p4, 16) || in_use(routes, p6, 32)
    }
}

/// Flushes the conntrack entries of an app and removes its prefixes from its daemon's table (best effort).
/// Also used by `flexstack run` after a daemon that died.
pub fn forget_app_flows(app: &AppInfo) {
    let Some(net) = AppNet::of(app) else { return };
    for p in [net.prefix4(), net.prefix6()] {
        flush_conntrack(&p);
    }
    if app.host_table.starts_with("flexstack_") {
        let script = format!(
            "delete element inet {t} apps4 {{ {} }}\ndelete element inet {t} apps6 {{ {} }}\n",
            net.prefix4(),
            net.prefix6(),
            t = app.host_table
        );
        let _ = nft(&script);
    }
}

/// What sandboxes need of the daemon's stack: an app's modules loaded and unloaded, each as one change (the
/// control plane implements it; an app's namespace and devices are the sandbox's own business).
pub trait AppModules {
    /// Loads the modules and links of `spec` as one change recorded as `change` by `who`; errors carry file:line.
    fn load_modules(&self, spec: &StackSpec, who: &str, change: &str) -> Result<(), ApiError>;
    /// Unloads those of the named modules that are loaded, as one change recorded as `change`.
    fn unload_modules(&self, names: &[String], change: &str) -> Result<(), ApiError>;
}

/// The sandboxes of one daemon.
pub struct Sandboxes {
    subnet: [u8; 2],
    etc: Option<std::path::PathBuf>,
    state: Mutex<(BTreeMap<String, AppInfo>, Option<HostState>)>,
    /// This daemon's lock file (or why it could not be taken: then no app can attach).
    instance: Result<Instance, String>,
    /// Threads that sleep while no app is attached, woken when one attaches ([`Sandboxes::wake_on_attach`]).
    sleepers: Mutex<Vec<std::thread::Thread>>,
}

/// Runs a command (stdin closed) and returns its stdout; an error names the command and carries its stderr.
/// Shared with the lab runner, which builds namespaces and veth pairs the same way.
pub fn command_output(args: &[&str]) -> Result<String, String> {
    let out = Command::new(args[0]).args(&args[1..]).output().map_err(|e| format!("cannot run {}: {e}", args[0]))?;
    if !out.status.success() {
        return Err(format!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

/// Deletes network namespace `netns` and its `/etc/netns/<netns>` folder, if they exist (best effort, quiet).
pub fn delete_namespace(netns: &str) {
    if let Err(e) = flexstack_faces::netconf::del_netns(netns) {
        tracing::debug!(netns, error = %e, "cannot delete the namespace");
    }
    let _ = std::fs::remove_dir_all(format!("/etc/netns/{netns}"));
}

/// The values of an app's stack template's placeholders.
pub struct TemplateValues<'a> {
    /// `{app}`: the app's name (its face module's name).
    pub app: &'a str,
    /// `{app_dev}`: its TUN device.
    pub app_dev: &'a str,
    /// `{host_dev}`: the host face's TUN device.
    pub host_dev: &'a str,
    /// `{app_v4}`: its IPv4 address.
    pub ipv4: &'a str,
    /// `{app_v6}`: its IPv6 address.
    pub ipv6: &'a str,
}

/// Fills in an app's stack template: `{app}`, `{app_dev}`, `{host_dev}`, `{app_v4}`, `{app_v6}`. Also used by the
/// lab runner to check a stacked host's template before anything is created.
pub fn fill_template(template: &str, v: &TemplateValues<'_>) -> String {
    template
        .replace("{app_dev}", v.app_dev)
        .replace("{host_dev}", v.host_dev)
        .replace("{app_v4}", v.ipv4)
        .replace("{app_v6}", v.ipv6)
        .replace("{app}", v.app)
}

const FORWARD_V4: &str = "/proc/sys/net/ipv4/ip_forward";
const FORWARD_V6: &str = "/proc/sys/net/ipv6/conf/all/forwarding";

impl Sandboxes {
    /// Sandboxes whose apps get addresses in `subnet` (a /16 given by its first two octets). Takes the daemon's
    /// lock file and removes what daemons that are gone left behind (see the module's description).
    pub fn new(subnet: Ipv4Addr) -> Sandboxes {
        let o = subnet.octets();
        let instance = acquire_instance();
        match &instance {
            Ok(_) => remove_stale_leftovers(&format!("flexstack_{}", std::process::id())),
            Err(e) => tracing::debug!(error = %e, "no lock file: apps cannot be attached"),
        }
        let sleepers = Mutex::default();
        Sandboxes { subnet: [o[0], o[1]], etc: None, state: Mutex::new((BTreeMap::new(), None)), instance, sleepers }
    }

    /// Apps get `resolv.conf` and `hosts` from `dir` instead of /etc (a file missing there still comes from /etc):
    /// how a lab's stacked host, whose daemon runs in the host's namespace, gives its apps the lab's names.
    pub fn with_etc_dir(mut self, dir: Option<std::path::PathBuf>) -> Sandboxes {
        self.etc = dir;
        self
    }

    /// Unparks `thread` whenever an app attaches (a thread that parks while there is none).
    pub fn wake_on_attach(&self, thread: std::thread::Thread) {
        self.sleepers.lock().unwrap_or_else(|p| p.into_inner()).push(thread);
    }

    /// The apps now attached.
    pub fn list(&self) -> Vec<AppInfo> {
        self.state.lock().map(|s| s.0.values().cloned().collect()).unwrap_or_default()
    }

    /// Number of attached apps.
    pub fn count(&self) -> usize {
        self.state.lock().map(|s| s.0.len()).unwrap_or(0)
    }

    /// Runs `exit` if no app is attached, holding the apps' lock so that no attach can begin meanwhile (one
    /// waiting for the lock finds the daemon gone, and its client retries with a new daemon).
    pub fn exit_if_idle(&self, exit: impl FnOnce()) {
        let guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if guard.0.is_empty() {
            exit();
        }
    }

    /// The app's subnet: the one asked for if free, else the first A.B.n.0/24 of the daemon's /16 that no other
    /// app of ours has and no route of the host's uses.
    fn choose_net(&self, apps: &BTreeMap<String, AppInfo>, asked: Option<&str>) -> Result<AppNet, ApiError> {
        let routes = host_routes();
        let ours = |n: &AppNet| apps.values().any(|a| AppNet::of(a).is_some_and(|o| o.v4 == n.v4 || o.v6 == n.v6));
        if let Some(text) = asked {
            let net = AppNet::parse(text).map_err(|e| ApiError::new(ErrorCode::InvalidValue, e))?;
            if ours(&net) || net.used(&routes) {
                return Err(ApiError::new(
                    ErrorCode::InvalidEdit,
                    format!("subnet {} (or {}) is in use on this host", net.prefix4(), net.prefix6()),
                ));
            }
            return Ok(net);
        }
        let [b0, b1] = self.subnet;
        (1..=254u8).map(|n| AppNet::new([b0, b1, n])).find(|n| !ours(n) && !n.used(&routes)).ok_or_else(|| {
            ApiError::new(ErrorCode::InvalidEdit, format!("no free /24 left in {b0}.{b1}.0.0/16 (--app-subnet)"))
        })
    }

    /// Creates the namespace, cgroup, devices and modules for a new app, from `template` (a stack description with
    /// `{app}`, `{app_dev}`, `{host_dev}`, `{app_v4}`, `{app_v6}` and `{netns}` placeholders), in `subnet` (a /24)
    /// if given.
    pub fn attach(
        &self,
        stack: &dyn AppModules,
        name: Option<String>,
        uid: u32,
        template: Option<&str>,
        subnet: Option<&str>,
    ) -> Result<AppInfo, ApiError> {
        if let Err(e) = &self.instance {
            return Err(ApiError::new(ErrorCode::Internal, format!("sandboxes need the daemon's lock file: {e}")));
        }
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let pid = std::process::id();
        remove_stale_leftovers(&format!("flexstack_{pid}"));
        let index = (1..=254u8)
            .find(|i| !guard.0.values().any(|a| a.index == *i))
            .ok_or_else(|| ApiError::new(ErrorCode::InvalidEdit, "254 apps are attached already"))?;
        let name = name.unwrap_or_else(|| format!("app{index}"));
        if !valid_name(&name) || name.len() > 24 {
            return Err(ApiError::new(
                ErrorCode::InvalidValue,
                format!("invalid app name {name:?}: lowercase letters, digits, '-', '_', at most 24"),
            ));
        }
        if guard.0.contains_key(&name) {
            return Err(ApiError::new(ErrorCode::InvalidEdit, format!("an app named {name} is attached already")));
        }
        // The whole pid (at most 7 digits: pid_max is 2^22) keeps the names unique and within 15 bytes.
        let app_dev = format!("fsa{pid}x{index}");
        let host_dev = format!("fsh{pid}x{index}");
        let netns = format!("fs-{pid}-{name}");
        let host_lock = host_lock();
        let net = self.choose_net(&guard.0, subnet)?;
        let (ipv4, ipv6) = (net.ipv4(), net.ipv6());
        let template = template.unwrap_or(DEFAULT_TEMPLATE);
        // Without a host face ({host_dev}) the app's chain leads elsewhere (a link face): no host routes, no
        // masquerading, no forwarding.
        let host_face = template.contains("{host_dev}");
        let text = fill_template(
            template,
            &TemplateValues { app: &name, app_dev: &app_dev, host_dev: &host_dev, ipv4: &ipv4, ipv6: &ipv6 },
        );
        // `{netns}`: the app's namespace, for modules that act inside it (terminate's kernel back-end listens
        // there and redirects the app's TCP to itself).
        let text = text.replace("{netns}", &netns);
        let spec =
            StackSpec::parse("app stack", &text).map_err(|e| ApiError::new(ErrorCode::ConfigError, e.to_string()))?;
        let modules: Vec<String> = spec.modules.iter().map(|m| m.name.clone()).collect();
        if !modules.contains(&name) {
            return Err(ApiError::new(
                ErrorCode::ConfigError,
                "the app stack must have a module named {app} (the app's face)",
            ));
        }

        if host_face && guard.1.is_none() {
            guard.1 = Some(self.host_up()?);
        }
        let app = AppInfo {
            name: name.clone(),
            index,
            netns: netns.clone(),
            app_dev: app_dev.clone(),
            host_dev: if host_face { host_dev.clone() } else { String::new() },
            ipv4: ipv4.clone(),
            ipv6: ipv6.clone(),
            modules,
            uid,
            host_table: if host_face { format!("flexstack_{pid}") } else { String::new() },
            pids: Vec::new(),
            cgroup: app_cgroup(&netns).map(|c| c.display().to_string()).unwrap_or_default(),
        };
        let result = (|| {
            if host_face {
                self.guard_net(&app.host_table, &net)?;
            }
            flexstack_faces::netconf::add_netns(&netns).map_err(crate::actions::internal)?;
            if let Some(cg) = app_cgroup(&netns) {
                std::fs::create_dir_all(&cg)
                    .map_err(|e| ApiError::new(ErrorCode::Internal, format!("{}: {e}", cg.display())))?;
            }
            stack.load_modules(&spec, "flexstack run", &format!("app attach {name}"))?;
            self.configure(&app, &net)
        })();
        drop(host_lock);
        if let Err(e) = result {
            self.teardown(stack, &app);
            if guard.0.is_empty() {
                if let Some(h) = guard.1.take() {
                    self.host_down(&h);
                }
            }
            return Err(e);
        }
        guard.0.insert(name, app.clone());
        for t in self.sleepers.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            t.unpark();
        }
        tracing::info!(app = %app.name, netns = %app.netns, ipv4 = %app.ipv4, "app attached");
        Ok(app)
    }

    /// Adds the app's prefixes to its daemon's table: to the apps' sets (whose conntrack entries a cleanup
    /// flushes) and, when outside the daemon's /16, to the guarded ones.
    fn guard_net(&self, table: &str, net: &AppNet) -> Result<(), ApiError> {
        let [b0, b1] = self.subnet;
        let (p4, p6) = (net.prefix4(), net.prefix6());
        let mut script =
            format!("add element inet {table} apps4 {{ {p4} }}\nadd element inet {table} apps6 {{ {p6} }}\n");
        if net.v4[..2] != [b0, b1] {
            script += &format!("add element inet {table} guard4 {{ {p4} }}\n");
        }
        if net.v6[1] != u16::from(b1) {
            script += &format!("add element inet {table} guard6 {{ {p6} }}\n");
        }
        nft(&script).map_err(|e| ApiError::new(ErrorCode::Internal, e))
    }

    fn configure(&self, app: &AppInfo, net: &AppNet) -> Result<(), ApiError> {
        use crate::actions::internal;
        use flexstack_faces::netconf::{open_netns, Rtnl};
        use std::net::IpAddr;
        use std::os::fd::AsFd;
        let (ns, dev) = (app.netns.as_str(), app.app_dev.as_str());
        let addr = |a: &str| a.parse::<IpAddr>().map_err(|e| internal(format!("the app's address {a}: {e}")));
        let (v4, v6) = (addr(&app.ipv4)?, addr(&app.ipv6)?);
        // In the daemon's namespace: the app's device into the app's; in the app's: lo and the device up, the
        // addresses (IPv6 usable at once: no duplicate detection) and the default routes through the device.
        let mut host = Rtnl::open().map_err(internal)?;
        let netns = open_netns(ns).map_err(internal)?;
        let index = host.index_of(dev).map_err(internal)?;
        host.move_link(index, netns.as_fd());
        host.commit().map_err(internal)?;
        let mut nl = Rtnl::open_in(netns.as_fd()).map_err(internal)?;
        let (lo, index) = (nl.index_of("lo").map_err(internal)?, nl.index_of(dev).map_err(internal)?);
        nl.set_up(lo, true);
        nl.add_address(index, v4, 24);
        nl.add_address_nodad(index, v6, 64);
        nl.set_up(index, true);
        nl.add_route(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0, None, index);
        nl.add_route(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0, None, index);
        nl.commit().map_err(internal)?;
        if !app.host_dev.is_empty() {
            let index = host.index_of(&app.host_dev).map_err(internal)?;
            host.set_up(index, true);
            host.add_route(IpAddr::V4(net.net4()), 24, None, index);
            host.add_route(IpAddr::V6(net.net6()), 64, None, index);
            host.commit().map_err(internal)?;
        }
        let dir = format!("/etc/netns/{ns}");
        std::fs::create_dir_all(&dir).map_err(|e| ApiError::new(ErrorCode::Internal, format!("{dir}: {e}")))?;
        // The app sees the daemon's resolv.conf and hosts (see with_etc_dir).
        for file in ["resolv.conf", "hosts"] {
            let given = self.etc.as_ref().and_then(|d| std::fs::read_to_string(d.join(file)).ok());
            let text = given.unwrap_or_else(|| std::fs::read_to_string(format!("/etc/{file}")).unwrap_or_default());
            std::fs::write(format!("{dir}/{file}"), text)
                .map_err(|e| ApiError::new(ErrorCode::Internal, format!("{dir}/{file}: {e}")))?;
        }
        Ok(())
    }

    /// Removes an app's modules (its devices, and with them its routes), its processes (the cgroup), namespace and
    /// files, then its conntrack entries (best effort: every step is tried).
    fn teardown(&self, stack: &dyn AppModules, app: &AppInfo) {
        if let Err(e) = stack.unload_modules(&app.modules, &format!("app detach {}", app.name)) {
            tracing::warn!(app = %app.name, error = %e.message, "unloading the app's modules");
        }
        if let Some(cg) = app_cgroup(&app.netns) {
            if let Err(e) = kill_cgroup(&cg) {
                tracing::warn!(app = %app.name, error = %e, "stopping the app's processes");
            }
        }
        delete_namespace(&app.netns);
        if !app.host_dev.is_empty() {
            forget_app_flows(app);
        }
    }

    /// Detaches app `name`; false if there is none.
    pub fn detach(&self, stack: &dyn AppModules, name: &str) -> bool {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let Some(app) = guard.0.remove(name) else { return false };
        self.teardown(stack, &app);
        if guard.0.is_empty() {
            if let Some(h) = guard.1.take() {
                self.host_down(&h);
            }
        }
        tracing::info!(app = %name, "app detached");
        true
    }

    /// Detaches every app (daemon shutdown).
    pub fn detach_all(&self, stack: &dyn AppModules) {
        for app in self.list() {
            self.detach(stack, &app.name);
        }
    }

    fn host_up(&self) -> Result<HostState, ApiError> {
        // Several daemons may run side by side: the host's original forwarding settings are saved once, by the
        // first, and restored by the last (see host_down).
        // The caller holds the host lock.
        let own = format!("flexstack_{}", std::process::id());
        if !other_tables_exist("") && !std::path::Path::new(&saved_forwarding()).exists() {
            let read =
                |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_else(|_| "0".into());
            let _ = std::fs::write(saved_forwarding(), format!("{} {}\n", read(FORWARD_V4), read(FORWARD_V6)));
        }
        let saved = HostState { table: own };
        let [b0, b1] = self.subnet;
        nft(&host_table_script(&saved.table, &format!("{b0}.{b1}.0.0/16"), &format!("fd77:{b1:x}::/32")))
            .map_err(|e| ApiError::new(ErrorCode::Internal, e))?;
        let _ = std::fs::write(FORWARD_V4, "1");
        let _ = std::fs::write(FORWARD_V6, "1");
        // Turning forwarding on turned it on for every interface, those link faces took over too.
        flexstack_faces::takeover::reassert_forwarding_off();
        Ok(saved)
    }

    fn host_down(&self, h: &HostState) {
        remove_host_table(&h.table);
    }
}

/// The nftables script that makes (or remakes, in one transaction) a daemon's table: sets of the guarded prefixes
/// (the daemon's app prefixes, v4 and v6) and of its apps' ones, the masquerading of the guarded prefixes on the
/// way out, and the guard, after it: a packet from or to a guarded prefix that leaves through anything but a host
/// face is dropped (one from a sandbox that was not masqueraded, or a reply translated back to a sandbox whose
/// route has gone), except a sandbox's answer to a connection the network opened to it (a server in a sandbox, or
/// the server role of termination): conntrack's reply direction, from the sandbox's own address.
fn host_table_script(table: &str, v4: &str, v6: &str) -> String {
    format!(
        "table inet {table} {{}}\ndelete table inet {table}\ntable inet {table} {{\n  \
         set guard4 {{ type ipv4_addr; flags interval; elements = {{ {v4} }}; }}\n  \
         set guard6 {{ type ipv6_addr; flags interval; elements = {{ {v6} }}; }}\n  \
         set apps4 {{ type ipv4_addr; flags interval; }}\n  \
         set apps6 {{ type ipv6_addr; flags interval; }}\n  \
         chain postrouting {{\n    type nat hook postrouting priority srcnat; policy accept;\n    \
         ip saddr @guard4 oifname != \"fsh*\" masquerade\n    \
         ip6 saddr @guard6 oifname != \"fsh*\" masquerade\n  }}\n  \
         chain guard {{\n    type filter hook postrouting priority 110; policy accept;\n    \
         oifname \"fsh*\" accept\n    \
         ct direction reply ip saddr @guard4 accept\n    ct direction reply ip6 saddr @guard6 accept\n    \
         ip saddr @guard4 counter drop\n    ip daddr @guard4 counter drop\n    \
         ip6 saddr @guard6 counter drop\n    ip6 daddr @guard6 counter drop\n  }}\n}}\n"
    )
}

#[cfg(test)]
mod tests {
    use super::stale_tables;

    #[test]
    fn tables_of_daemons_that_are_gone_are_stale() {
        let listing = "table inet flexstack_100\ntable inet flexstack_200\ntable ip filter\n\
                       table inet flexstack_300\ntable inet flexstack_x\ntable inet other_400\n";
        let live = |pid: u32| pid == 200;
        assert_eq!(stale_tables(listing, "flexstack_300", live), ["flexstack_100"]);
        let with_endpoints =
            "table inet flexstack_kserver_4000\ntable inet flexstack_kernel_5\ntable inet flexstack_\n";
        assert_eq!(super::flexstack_tables(with_endpoints, "").count(), 0, "an endpoint's table is no daemon's");
        let tables: Vec<&str> = super::flexstack_tables(listing, "flexstack_300").collect();
        assert_eq!(tables, ["flexstack_100", "flexstack_200"]);
        assert_eq!(stale_tables(listing, "", |_| true), Vec::<&str>::new());
        assert_eq!(stale_tables("", "", |_| false), Vec::<&str>::new());
    }

    #[test]
    fn app_names_say_their_daemon() {
        let names = ["fs-100-app1", "fs-4194304-web", "fs-lk300-x", "fs-100", "fl-lab.demo", "fs-abc-app", "fs-fs12-x"];
        let daemons: Vec<Option<u32>> = names.iter().map(|n| super::daemon_of(n)).collect();
        assert_eq!(daemons, [Some(100), Some(4194304), None, None, None, None, None]);
    }

    #[test]
    fn routes_in_use_are_found() {
        let v4 = "default via 10.200.9.1 dev eth0\n10.77.1.0/24 dev fsh9x1 scope link\n\
                  local 10.77.5.7 dev veth0 table local proto kernel scope host src 10.77.5.7\n\
                  broadcast 10.200.9.255 dev eth0 table local\nunreachable 10.77.0.0/16\n10.90.0.0/20 dev wg0\n";
        let routes = super::route_prefixes(v4);
        assert_eq!(routes.len(), 6);
        let used = |p: &str| super::AppNet::parse(p).unwrap().used(&routes);
        assert!(used("10.77.1.0/24"), "a /24 of another daemon's");
        assert!(used("10.77.5.0/24"), "an address of the host's in it");
        assert!(!used("10.77.2.0/24"), "free: the default route and the /16 are no clash");
        assert!(used("10.90.3.0/24"), "inside a shorter route than the /24 but longer than the /16");
        let v6 = "fd77:4d:3::/64 dev fsh9x3 metric 1024\ndefault via fd99:c8::1 dev eth0\n";
        let routes = super::route_prefixes(v6);
        assert!(super::AppNet::new([10, 77, 3]).used(&routes), "the /64 is in use");
        assert!(!super::AppNet::new([10, 77, 4]).used(&routes));
    }

    #[test]
    fn app_nets_have_their_addresses() {
        let net = super::AppNet::parse("10.90.3.0/24").unwrap();
        assert_eq!((net.ipv4(), net.ipv6()), ("10.90.3.2".into(), "fd77:5a:3::2".into()));
        assert_eq!((net.prefix4(), net.prefix6()), ("10.90.3.0/24".into(), "fd77:5a:3::/64".into()));
        for bad in ["10.90.3.1/24", "10.90.0.0/16", "10.90.3", "x/24"] {
            assert!(super::AppNet::parse(bad).is_err(), "{bad}");
        }
        assert!(super::AppNet::parse("10.90.3.0").is_ok(), "a /24 by default");
    }

    #[test]
    fn prefixes_are_read_from_nft_listings() {
        let set = "table inet flexstack_7 {\n\tset apps4 {\n\t\ttype ipv4_addr\n\t\tflags interval\n\t\t\
                   elements = { 10.77.1.0/24, 10.77.3.0/24 }\n\t}\n\tset apps6 {\n\t\telements = { fd77:4d:1::/64 }\n";
        assert_eq!(super::prefixes_in(set), ["10.77.1.0/24", "10.77.3.0/24", "fd77:4d:1::/64"]);
    }
}
