//! Sandboxes for unmodified applications: each app runs in a network namespace of its own whose only interface
//! is a TUN device owned by flexstack's data plane; a second TUN device in the host namespace (the host face)
//! hands its packets to the host kernel, which routes them onward with masquerading.
//!
//! What attaching an app changes on the host, all of it undone when the last app detaches (or the daemon stops):
//! - a namespace `fs-<daemon pid>-<app>` under /run/netns and `/etc/netns/<namespace>/{resolv.conf,hosts}` (copies
//!   of the host's, so DNS and host names work inside);
//! - two TUN devices (`fsa…` moved into the namespace, `fsh…` in the host) and routes to the app's subnet via the
//!   host device;
//! - `net.ipv4.ip_forward` and `net.ipv6.conf.all.forwarding` set to 1; the values before are kept in
//!   `/run/flexstack-forwarding-<netns inode>.saved` and restored when the last daemon with apps removes its table;
//! - an nftables table `inet flexstack_<daemon pid>` masquerading the apps' subnets on the way out.
//!
//! Addresses: app number n gets 10.B.n.2/24 and fd77:B:n::2/64 (B from `--app-subnet`, default 10.77.0.0/16),
//! with default routes through its TUN device.

use flexstack_api::ops::AppInfo;
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_core::config::valid_name;
use flexstack_core::StackSpec;
use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::Mutex;

/// The chain an app gets when no template is given (stacks/app-default.toml).
pub const DEFAULT_TEMPLATE: &str = include_str!("../../../stacks/app-default.toml");

struct HostState {
    table: String,
}

/// Where the host's forwarding settings are kept while any daemon's apps run: one file per network namespace
/// (daemons of stacked lab hosts run in namespaces of their own), named after the namespace's inode.
fn saved_forwarding() -> String {
    let ns = std::fs::read_link("/proc/self/ns/net").map(|p| p.display().to_string()).unwrap_or_default();
    let inode: String = ns.chars().filter(char::is_ascii_digit).collect();
    format!("/run/flexstack-forwarding-{inode}.saved")
}

/// Deletes a daemon's nftables table; if no other daemon's remains, restores the host's forwarding settings.
/// Also used by `flexstack run` to clean up after a daemon that died.
pub fn remove_host_table(table: &str) {
    let _ = Command::new("nft").args(["delete", "table", "inet", table]).status();
    if !other_tables_exist(table) {
        if let Ok(saved) = std::fs::read_to_string(saved_forwarding()) {
            let mut v = saved.split_whitespace();
            let _ = std::fs::write(FORWARD_V4, v.next().unwrap_or("0"));
            let _ = std::fs::write(FORWARD_V6, v.next().unwrap_or("0"));
            let _ = std::fs::remove_file(saved_forwarding());
        }
    }
}

/// What `nft list tables` prints (`table inet NAME` per line); empty if nft fails.
fn nft_tables() -> String {
    let out = Command::new("nft").args(["list", "tables"]).output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).to_string()).unwrap_or_default()
}

/// The network namespaces named in /run/netns.
pub fn namespace_names() -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect()
}

/// The flexstack tables (`flexstack_…`) in `listing`, as `nft list tables` prints them (`table inet NAME`), other
/// than `own`.
fn flexstack_tables<'a>(listing: &'a str, own: &'a str) -> impl Iterator<Item = &'a str> {
    listing
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(move |t| t.starts_with("flexstack_") && *t != own)
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

/// The app namespaces among `names` (`fs-<daemon pid>-<app>`) whose daemon `live` says is gone.
fn stale_namespaces(names: &[String], live: impl Fn(u32) -> bool) -> Vec<&str> {
    names
        .iter()
        .filter(|n| {
            n.strip_prefix("fs-")
                .and_then(|rest| rest.split_once('-'))
                .and_then(|(pid, _)| pid.parse::<u32>().ok())
                .is_some_and(|pid| !live(pid))
        })
        .map(String::as_str)
        .collect()
}

/// Removes what flexstack daemons that died without cleaning up (SIGKILL) left: their nftables tables and their
/// apps' namespaces. The forwarding settings they saved stay saved, to be restored by the last daemon.
fn remove_stale_leftovers(own: &str) {
    let listing = nft_tables();
    for table in stale_tables(&listing, own, is_live_daemon) {
        tracing::warn!(table, "removing the nftables table of a daemon that is gone");
        let _ = Command::new("nft").args(["delete", "table", "inet", table]).status();
    }
    let names = namespace_names();
    for netns in stale_namespaces(&names, is_live_daemon) {
        tracing::warn!(netns, "removing the app namespace of a daemon that is gone");
        delete_namespace(netns);
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

fn run(args: &[&str]) -> Result<String, ApiError> {
    command_output(args).map_err(|m| ApiError::new(ErrorCode::Internal, m))
}

/// Deletes network namespace `netns` and its `/etc/netns/<netns>` folder, if they exist (best effort, quiet).
pub fn delete_namespace(netns: &str) {
    let _ = Command::new("ip").args(["netns", "del", netns]).stderr(std::process::Stdio::null()).status();
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

fn nft(script: &str) -> Result<(), ApiError> {
    use std::io::Write;
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("nft: {e} (is nftables installed?)")))?;
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(script.as_bytes());
    }
    let out = child.wait_with_output().map_err(|e| ApiError::new(ErrorCode::Internal, format!("nft: {e}")))?;
    if !out.status.success() {
        return Err(ApiError::new(
            ErrorCode::Internal,
            format!("nft failed: {}", String::from_utf8_lossy(&out.stderr)),
        ));
    }
    Ok(())
}

const FORWARD_V4: &str = "/proc/sys/net/ipv4/ip_forward";
const FORWARD_V6: &str = "/proc/sys/net/ipv6/conf/all/forwarding";

impl Sandboxes {
    /// Sandboxes whose apps get addresses in `subnet` (a /16 given by its first two octets).
    pub fn new(subnet: Ipv4Addr) -> Sandboxes {
        let o = subnet.octets();
        Sandboxes { subnet: [o[0], o[1]], etc: None, state: Mutex::new((BTreeMap::new(), None)) }
    }

    /// Apps get `resolv.conf` and `hosts` from `dir` instead of /etc (a file missing there still comes from /etc):
    /// how a lab's stacked host, whose daemon runs in the host's namespace, gives its apps the lab's names.
    pub fn with_etc_dir(mut self, dir: Option<std::path::PathBuf>) -> Sandboxes {
        self.etc = dir;
        self
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

    /// Creates the namespace, devices and modules for a new app, from `template` (a stack description with
    /// `{app}`, `{app_dev}`, `{host_dev}`, `{app_v4}`, `{app_v6}` and `{netns}` placeholders).
    pub fn attach(
        &self,
        stack: &dyn AppModules,
        name: Option<String>,
        uid: u32,
        template: Option<&str>,
    ) -> Result<AppInfo, ApiError> {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
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
        let pid = std::process::id() % 100_000;
        let app_dev = format!("fsa{pid}x{index}");
        let host_dev = format!("fsh{pid}x{index}");
        let netns = format!("fs-{pid}-{name}");
        let [b0, b1] = self.subnet;
        let ipv4 = format!("{b0}.{b1}.{index}.2");
        let ipv6 = format!("fd77:{b1:x}:{index:x}::2");
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
        run(&["ip", "netns", "add", &netns])?;
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
            host_table: if host_face { format!("flexstack_{}", std::process::id()) } else { String::new() },
        };
        let result = (|| {
            stack.load_modules(&spec, "flexstack run", &format!("app attach {name}"))?;
            self.configure(&app)
        })();
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
        tracing::info!(app = %app.name, netns = %app.netns, ipv4 = %app.ipv4, "app attached");
        Ok(app)
    }

    fn configure(&self, app: &AppInfo) -> Result<(), ApiError> {
        let (ns, dev) = (app.netns.as_str(), app.app_dev.as_str());
        run(&["ip", "link", "set", dev, "netns", ns])?;
        run(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
        run(&["ip", "-n", ns, "addr", "add", &format!("{}/24", app.ipv4), "dev", dev])?;
        run(&["ip", "-n", ns, "addr", "add", &format!("{}/64", app.ipv6), "dev", dev, "nodad"])?;
        run(&["ip", "-n", ns, "link", "set", dev, "up"])?;
        run(&["ip", "-n", ns, "route", "add", "default", "dev", dev])?;
        run(&["ip", "-n", ns, "-6", "route", "add", "default", "dev", dev])?;
        if !app.host_dev.is_empty() {
            let [b0, b1] = self.subnet;
            run(&["ip", "link", "set", &app.host_dev, "up"])?;
            run(&["ip", "route", "add", &format!("{b0}.{b1}.{}.0/24", app.index), "dev", &app.host_dev])?;
            run(&["ip", "-6", "route", "add", &format!("fd77:{b1:x}:{:x}::/64", app.index), "dev", &app.host_dev])?;
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

    /// Removes an app's modules, namespace and files (best effort: every step is tried).
    fn teardown(&self, stack: &dyn AppModules, app: &AppInfo) {
        if let Err(e) = stack.unload_modules(&app.modules, &format!("app detach {}", app.name)) {
            tracing::warn!(app = %app.name, error = %e.message, "unloading the app's modules");
        }
        delete_namespace(&app.netns);
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
        // first, and restored by the last (see host_down). A daemon that was killed left its table and its saved
        // settings: the table goes, the settings (the host's original ones) stay.
        let own = format!("flexstack_{}", std::process::id());
        remove_stale_leftovers(&own);
        if !other_tables_exist("") && !std::path::Path::new(&saved_forwarding()).exists() {
            let read =
                |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_else(|_| "0".into());
            let _ = std::fs::write(saved_forwarding(), format!("{} {}\n", read(FORWARD_V4), read(FORWARD_V6)));
        }
        let saved = HostState { table: own };
        let [b0, b1] = self.subnet;
        nft(&format!(
            "table inet {t} {{\n  chain postrouting {{\n    type nat hook postrouting priority srcnat; policy accept;\n    \
             ip saddr {b0}.{b1}.0.0/16 oifname != \"fsh*\" masquerade\n    \
             ip6 saddr fd77:{b1:x}::/32 oifname != \"fsh*\" masquerade\n  }}\n}}\n",
            t = saved.table
        ))?;
        let _ = std::fs::write(FORWARD_V4, "1");
        let _ = std::fs::write(FORWARD_V6, "1");
        Ok(saved)
    }

    fn host_down(&self, h: &HostState) {
        remove_host_table(&h.table);
    }
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
        assert_eq!(stale_tables(listing, "", |_| true), Vec::<&str>::new());
        assert_eq!(stale_tables("", "", |_| false), Vec::<&str>::new());
    }

    #[test]
    fn app_namespaces_of_daemons_that_are_gone_are_stale() {
        let names: Vec<String> = ["fs-100-app1", "fs-200-app2", "fs-lk300-x", "fs-100", "fl-lab.demo", "fs-abc-app"]
            .map(String::from)
            .into();
        assert_eq!(super::stale_namespaces(&names, |pid| pid == 200), ["fs-100-app1"]);
    }
}
