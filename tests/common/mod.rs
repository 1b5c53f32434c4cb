//! Shared helpers for the end-to-end tests: a real daemon process in a private state directory, driven by the
//! real `flexstack` binary.
#![allow(dead_code)]

pub mod peer;
pub mod prometheus;

use flexstack_api::ops::{AppInfo, AppList, FlowInfo, FlowList, Get};
use flexstack_api::protocol::Call;
use flexstack_api::Value;
use serde_json::Value as Json;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Path of the built `flexstack` binary, or of the one `FLEXSTACK_TEST_BIN` names (to show that a test fails with
/// an older build, e.g. main's).
pub fn bin() -> &'static str {
    static BIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BIN.get_or_init(|| std::env::var("FLEXSTACK_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_flexstack").into()))
}

/// The stack of the daemon, rules and control-protocol tests: a source `src` (its settings in `source`, TOML lines)
/// feeds a counter `count` and a selector `sel` (loaded by its old kind name `switch`; two outputs, 0 selected),
/// whose outputs go to the sinks `sink0` and `sink1`. `also` adds receivers to `sel[1]` (", tap") and `more` adds
/// modules (TOML tables).
pub fn chain(source: &str, also: &str, more: &str) -> String {
    format!(
        r#"links = ["src -> count", "count -> sel", "sel[0] -> sink0", "sel[1] -> sink1{also}"]

[modules.src]
kind = "source"
{source}

[modules.count]
kind = "counter"

[modules.sel]
kind = "switch"
outputs = 2
select = 0

[modules.sink0]
kind = "sink"

[modules.sink1]
kind = "sink"
{more}"#
    )
}

/// A daemon running in its own temporary state directory; killed and cleaned up on drop.
pub struct Daemon {
    pub child: Child,
    pub dir: tempfile::TempDir,
    /// The network namespace it runs in (None: this process's); a restart starts it there again.
    pub netns: Option<String>,
}

impl Daemon {
    /// Starts `flexstack daemon` with `stack` (TOML text, written to the state dir) and extra arguments, and
    /// waits until it answers.
    pub fn start(stack: &str, extra: &[&str]) -> Daemon {
        Daemon::spawn(None, stack, extra, Stdio::inherit())
    }

    /// Like [`Daemon::start`], with the daemon in the network namespace `netns` (`ip netns exec`, which execs: the
    /// child is the daemon).
    pub fn start_in(netns: &Netns, stack: &str, extra: &[&str]) -> Daemon {
        Daemon::spawn(Some(&netns.name), stack, extra, Stdio::inherit())
    }

    /// Like [`Daemon::start`], with the daemon's log (its stderr, level warn) written to `log`.
    pub fn start_logged(stack: &str, extra: &[&str], log: &Path) -> Daemon {
        Daemon::spawn(None, stack, extra, std::fs::File::create(log).expect("create the log").into())
    }

    fn spawn(netns: Option<&str>, stack: &str, extra: &[&str], stderr: Stdio) -> Daemon {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("stack.toml"), stack).expect("write stack");
        let child = Self::spawn_child(netns, dir.path(), extra, stderr);
        let d = Daemon { child, dir, netns: netns.map(String::from) };
        d.wait_ready();
        d
    }

    /// `flexstack daemon --stack DIR/stack.toml --state-dir DIR/state EXTRA...`, its stderr to `stderr`, in the
    /// network namespace `netns` if given (`ip netns exec`, which execs: the child is the daemon).
    fn spawn_child(netns: Option<&str>, dir: &Path, extra: &[&str], stderr: Stdio) -> Child {
        let mut command = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, bin()]);
                c
            }
            None => Command::new(bin()),
        };
        command
            .arg("daemon")
            .arg("--stack")
            .arg(dir.join("stack.toml"))
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args(extra)
            .env("FLEXSTACK_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn daemon")
    }

    /// Kills the daemon with SIGKILL (nothing flushed or cleaned up) and starts another in the same state directory
    /// with the same stack file and the arguments `extra`; its stderr goes to `self.path(log)`.
    pub fn kill_and_restart(&mut self, extra: &[&str], log: &str) {
        self.kill();
        self.restart(extra, log);
    }

    /// Kills the daemon with SIGKILL and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the daemon again (after [`Daemon::kill`]) as [`Daemon::kill_and_restart`] does.
    pub fn restart(&mut self, extra: &[&str], log: &str) {
        let stderr = std::fs::File::create(self.path(log)).expect("create the daemon's log");
        self.child = Self::spawn_child(self.netns.as_deref(), self.dir.path(), extra, stderr.into());
        self.wait_ready();
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.state_dir().join("control.sock").exists() && self.cli(&["status"]).status.success() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("daemon did not become ready");
    }

    /// Runs `flexstack --state-dir DIR ARGS...`.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(bin()).arg("--state-dir").arg(self.state_dir()).args(args).output().expect("run flexstack")
    }

    /// Runs a command that must succeed and returns its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert!(
            out.status.success(),
            "flexstack {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8(out.stdout).expect("utf-8 output")
    }

    /// Runs a command with `-j` that must succeed and parses its JSON.
    pub fn json(&self, args: &[&str]) -> Json {
        let mut a = vec!["-j"];
        a.extend_from_slice(args);
        let text = self.ok(&a);
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("flexstack {args:?}: bad JSON {e}: {text}"))
    }

    /// Runs a command that must fail; returns its stderr.
    pub fn fails(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert!(
            !out.status.success(),
            "flexstack {args:?} should have failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8(out.stderr).expect("utf-8 output")
    }

    /// Runs a command with `-j` that must succeed and decodes its JSON as the result of `C`, the operation the
    /// command sends (`d.answer::<ModuleList>(&["module", "list"])` is a `Vec<ModuleInfo>`).
    pub fn answer<C: Call>(&self, args: &[&str]) -> C::Response {
        let mut a = vec!["-j"];
        a.extend_from_slice(args);
        let text = self.ok(&a);
        decode::<C>(&text).unwrap_or_else(|e| panic!("flexstack {args:?}: {e}: {text}"))
    }

    /// The value of one variable, as JSON (to compare with literals: `d.get(name) == 1`).
    pub fn get(&self, name: &str) -> Json {
        let values = self.answer::<Get>(&["get", name]);
        values.get(name).map_or(Json::Null, |v| serde_json::to_value(&v.value).expect("a value encodes"))
    }

    pub fn get_u64(&self, name: &str) -> u64 {
        self.get(name).as_u64().unwrap_or_else(|| panic!("{name} is not a u64"))
    }

    /// Waits until `cond` holds (polling every 20 ms), or panics with `what` after `secs`.
    pub fn wait_for(&self, what: &str, secs: u64, mut cond: impl FnMut(&Daemon) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < deadline {
            if cond(self) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("timed out waiting for {what}");
    }

    /// A raw connection to the control socket.
    pub fn raw(&self) -> RawClient {
        let s = UnixStream::connect(self.state_dir().join("control.sock")).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        RawClient { reader: BufReader::new(s.try_clone().unwrap()), writer: s }
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("kill");
        self.child.wait().expect("wait")
    }

    /// True while the process runs.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A client speaking the raw protocol.
pub struct RawClient {
    pub reader: BufReader<UnixStream>,
    pub writer: UnixStream,
}

impl RawClient {
    pub fn send(&mut self, bytes: &[u8]) {
        self.writer.write_all(bytes).expect("write");
    }

    pub fn line(&mut self) -> Option<Json> {
        let mut l = String::new();
        match self.reader.read_line(&mut l) {
            Ok(0) | Err(_) => None,
            Ok(_) => Some(serde_json::from_str(&l).expect("response is JSON")),
        }
    }
}

/// Decodes a command's `-j` output as the result of `C`, the operation the command sends.
pub fn decode<C: Call>(text: &str) -> Result<C::Response, String> {
    serde_json::from_str(text).map_err(|e| format!("not a {}: {e}", std::any::type_name::<C::Response>()))
}

/// The `-j` output of a finished command as the result of `C`; `None` when it failed or printed something else.
pub fn answer<C: Call>(out: &Output) -> Option<C::Response> {
    decode::<C>(std::str::from_utf8(&out.stdout).ok()?).ok()
}

/// A value that is an unsigned integer, as such (`serde_json::Value::as_u64` for a typed value).
pub fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::U64(n) => Some(*n),
        _ => None,
    }
}

/// Runs `flexstack daemon` expecting it to fail at start; returns stderr.
pub fn daemon_fails(stack: &str, dir: &Path) -> String {
    let stack_path = dir.join("bad.toml");
    std::fs::write(&stack_path, stack).unwrap();
    let out = Command::new(bin())
        .arg("daemon")
        .arg("--stack")
        .arg(&stack_path)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .output()
        .expect("run daemon");
    assert!(!out.status.success(), "daemon should refuse the stack:\n{stack}");
    String::from_utf8(out.stderr).unwrap()
}

/// True if the running privileged test can run here. Outside CI, a non-root run skips it with a printed reason; in
/// CI (CI=true) it must run, so not being root is a failure. The test is named by its thread (libtest runs each
/// test in a thread named after it).
pub fn privileged() -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    let current = std::thread::current();
    let test = current.name().unwrap_or("this test");
    if std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false") {
        panic!("{test}: privileged tests must run as root in CI");
    }
    eprintln!("skipping {test}: needs root (network namespaces, TUN devices)");
    false
}

/// For a privileged test that must not run at the same time as the others of its file that take it (their timings
/// would disturb each other on a two-core machine; each test file is a process of its own): `None` when it cannot
/// run here (see [`privileged`]), otherwise the guard to hold while it runs.
pub fn privileged_serial() -> Option<MutexGuard<'static, ()>> {
    static SERIAL: Mutex<()> = Mutex::new(());
    privileged().then(|| SERIAL.lock().unwrap_or_else(|e| e.into_inner()))
}

/// A name unique to this test process and tag, short enough for an interface (<= 15 bytes).
pub fn unique(tag: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("fs{}{}{tag}", std::process::id() % 100_000, n)
}

/// Runs a command that must succeed.
pub fn sh(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// A network namespace under /run/netns, deleted (with its processes killed) on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(tag: &str) -> Netns {
        let name = format!("fs-{}", unique(tag));
        sh("ip", &["netns", "add", &name]);
        sh("ip", &["-n", &name, "link", "set", "lo", "up"]);
        Netns { name }
    }

    /// Runs a command inside the namespace; returns its output.
    pub fn run(&self, args: &[&str]) -> Output {
        Command::new("ip").args(["netns", "exec", &self.name]).args(args).output().expect("ip netns exec")
    }

    /// Starts a background command inside the namespace; killed and reaped when the guard is dropped.
    pub fn spawn(&self, args: &[&str]) -> Background {
        let child = Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("ip netns exec");
        Background(child)
    }

    /// Serves the files of `dir` over HTTP on port 8080 of address `bind` (`::`: every address) inside the
    /// namespace (python3's http.server); stopped when the guard is dropped.
    pub fn serve_http(&self, bind: &str, dir: &Path) -> Background {
        self.spawn(&["python3", "-m", "http.server", "8080", "--bind", bind, "--directory", path_str(dir)])
    }

    /// Serves DNS on port 53 of addresses `v4` and `v6` inside the namespace (dnsmasq), answering `flexstack.test`
    /// with 10.1.2.3 (A) and fd00:1:2::3 (AAAA); stopped when the guard is dropped.
    pub fn serve_dns(&self, v4: &str, v6: &str) -> Background {
        self.spawn(&[
            "dnsmasq",
            "--no-daemon",
            "--no-resolv",
            "--no-hosts",
            "--port=53",
            "--bind-interfaces",
            &format!("--listen-address={v4},{v6}"),
            "--address=/flexstack.test/10.1.2.3",
            "--address=/flexstack.test/fd00:1:2::3",
        ])
    }

    /// Moves interface `dev` here and gives it addresses (CIDR strings), up.
    pub fn adopt(&self, dev: &str, addrs: &[&str]) {
        sh("ip", &["link", "set", dev, "netns", &self.name]);
        for a in addrs {
            let mut args = vec!["-n", self.name.as_str(), "addr", "add", a, "dev", dev];
            if a.contains(':') {
                args.push("nodad");
            }
            sh("ip", &args);
        }
        sh("ip", &["-n", &self.name, "link", "set", dev, "up"]);
    }
}

/// A daemon (started with the arguments `extra`) whose stack has the links `links` (a TOML array), the TUN faces `a` and `b` (`b` with the extra settings
/// `b_settings`, TOML lines) and the modules `modules` (TOML tables), and two namespaces, each holding one face's
/// device with its addresses (CIDR strings) of `addrs`.
pub fn through_tun_faces(
    links: &str,
    b_settings: &str,
    modules: &str,
    addrs: (&[&str], &[&str]),
    extra: &[&str],
) -> (Daemon, Netns, Netns) {
    let (dev_a, dev_b) = (unique("a"), unique("b"));
    let stack = format!(
        r#"links = {links}
[modules.a]
kind = "tun"
name = "{dev_a}"
[modules.b]
kind = "tun"
name = "{dev_b}"
{b_settings}{modules}"#
    );
    let d = Daemon::start(&stack, extra);
    let (ns_a, ns_b) = (Netns::new("a"), Netns::new("b"));
    ns_a.adopt(&dev_a, addrs.0);
    ns_b.adopt(&dev_b, addrs.1);
    (d, ns_a, ns_b)
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Ok(out) = Command::new("ip").args(["netns", "pids", &self.name]).output() {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
        }
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

/// A background program; killed and waited for on drop.
pub struct Background(pub Child);

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A server namespace joined to the host by a veth pair, with IPv4 and IPv6 addresses and an HTTP server.
pub struct Server {
    pub ns: Netns,
    host_dev: String,
    pub v4: String,
    pub v6: String,
    _http: Background,
    pub www: tempfile::TempDir,
}

impl Server {
    pub fn new(octet: u8, blob: &[u8]) -> Server {
        let ns = Netns::new("srv");
        let (h, _) = veth_into(
            &ns,
            [&format!("10.{octet}.7.1/24"), &format!("fd98:{octet:x}::1/64")],
            [&format!("10.{octet}.7.2/24"), &format!("fd98:{octet:x}::2/64")],
        );
        sh("ip", &["-n", &ns.name, "route", "add", "default", "via", &format!("10.{octet}.7.1")]);
        sh("ip", &["-n", &ns.name, "-6", "route", "add", "default", "via", &format!("fd98:{octet:x}::1")]);
        let www = tempfile::tempdir().unwrap();
        std::fs::write(www.path().join("blob"), blob).unwrap();
        let http = ns.serve_http("::", www.path());
        let v4 = format!("10.{octet}.7.2");
        for _ in 0..100 {
            if ns
                .run(&["curl", "-sf", "-m", "2", "-o", "/dev/null", &format!("http://{v4}:8080/blob")])
                .status
                .success()
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Server { ns, host_dev: h, v4, v6: format!("fd98:{octet:x}::2"), _http: http, www }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.host_dev]).status();
    }
}

/// The script that sends malformed packets, then a flood of fragments, into a device (see its usage).
pub const INJECTOR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/inject_malformed.py");

/// What one run of [`INJECTOR`] (20 rounds, then 2000 fragments) makes an app's chain drop, at the least: the
/// module that counts each drop (`ip` or `frag`), its reason and how many.
pub const MALFORMED_DROPS: [(&str, &str, u64); 10] = [
    ("ip", "truncated", 2 * 20),
    ("ip", "bad_header_length", 2 * 20),
    ("ip", "bad_total_length", 2 * 20),
    ("ip", "bad_checksum", 20),
    ("ip", "truncated_transport", 2 * 20),
    ("ip", "bad_extension_header", 20),
    ("frag", "overlap", 20),
    ("frag", "duplicate", 20),
    ("frag", "tiny", 20),
    ("frag", "memory", 2000 - 64),
];

/// A daemon for sandboxes, started explicitly with its own app subnet.
pub struct SandboxDaemon {
    pub child: std::process::Child,
    pub state: tempfile::TempDir,
}

impl SandboxDaemon {
    pub fn start(subnet_octet: u8) -> SandboxDaemon {
        SandboxDaemon::start_with(subnet_octet, &[])
    }

    /// [`SandboxDaemon::start`] with `extra` arguments of `flexstack daemon`.
    pub fn start_with(subnet_octet: u8, extra: &[&str]) -> SandboxDaemon {
        let state = tempfile::tempdir().unwrap();
        let child = Command::new(bin())
            .args(["daemon", "--app-subnet", &format!("10.{subnet_octet}.0.0")])
            .args(extra)
            .arg("--state-dir")
            .arg(state.path())
            .env("FLEXSTACK_LOG", "warn")
            .spawn()
            .unwrap();
        let d = SandboxDaemon { child, state };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && !d.cli(&["status"]).status.success() {
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(bin()).arg("--state-dir").arg(self.state.path()).args(args).output().unwrap()
    }

    pub fn run(&self, args: &[&str]) -> Output {
        let mut a = vec!["run"];
        a.extend_from_slice(args);
        self.cli(&a)
    }

    /// The attached apps; `None` when `app list` does not answer with them.
    pub fn apps(&self) -> Option<Vec<AppInfo>> {
        answer::<AppList>(&self.cli(&["-j", "app", "list"]))
    }

    /// The flows `flow list` shows; what it printed when that did not decode as flows.
    pub fn flows(&self) -> Result<Vec<FlowInfo>, String> {
        let out = self.cli(&["-j", "flow", "list"]);
        answer::<FlowList>(&out).ok_or_else(|| text(&out))
    }

    pub fn spawn_run(&self, args: &[&str]) -> std::process::Child {
        Command::new(bin())
            .arg("--state-dir")
            .arg(self.state.path())
            .arg("run")
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    }

    pub fn wait_for_apps(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.apps().is_some_and(|a| a.len() == n) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("expected {n} apps, have {:?}", self.apps());
    }

    pub fn namespaces_left(&self) -> Vec<String> {
        let prefix = format!("fs-{}-", self.child.id());
        sh("ip", &["netns", "list"]).lines().filter(|l| l.starts_with(&prefix)).map(str::to_string).collect()
    }

    pub fn table_exists(&self) -> bool {
        sh("nft", &["list", "tables"]).contains(&format!("flexstack_{}", self.child.id()))
    }
}

impl Drop for SandboxDaemon {
    fn drop(&mut self) {
        stop_daemon(&mut self.child);
    }
}

/// Stops a daemon: SIGTERM, SIGKILL if it is still there after 5 s; reaped.
pub fn stop_daemon(child: &mut Child) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && child.try_wait().ok().flatten().is_none() {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Octets for the app subnet (10.A.0.0/16) and the server's subnet (10.S.7.0/24) of this test process.
pub fn octets() -> (u8, u8) {
    let p = (std::process::id() % 40) as u8;
    (100 + p, 150 + p)
}

/// A [`Server`] serving `blob` and a [`SandboxDaemon`] on this test process's subnets (see [`octets`]) moved by
/// `offset`, so that the tests of a file, running at the same time, each have their own.
pub fn server_and_daemon(offset: u8, blob: &[u8]) -> (Server, SandboxDaemon) {
    let (app_octet, srv_octet) = octets();
    (Server::new(srv_octet.wrapping_add(offset), blob), SandboxDaemon::start(app_octet.wrapping_add(offset)))
}

/// The round-trip times, in ms, that ping printed in `output`; asserts that each of `count` pings was answered.
pub fn ping_rtts(output: &str, count: u32) -> Vec<f64> {
    let rtts: Vec<f64> =
        output.split("time=").skip(1).filter_map(|r| r.split_whitespace().next()?.parse().ok()).collect();
    assert_eq!(rtts.len(), count as usize, "every ping answered: {output}");
    rtts
}

/// The middle of `values` once sorted (of an even number of them, the upper of the two in the middle).
pub fn upper_median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// stdout and stderr of a finished command, for messages.
pub fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// The repository's root (stack templates, lab files, test scripts).
pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A path as `&str` for a command line.
pub fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// A lab of one test: a lab name unique to this process and test, and a temporary folder with its lab files, its
/// `--state-dir` (`state`) and its results. Dropping it runs `lab down --all` on the state folder, pass or fail.
pub struct LabScratch {
    /// The lab's name (`{name}` in files written with [`LabScratch::write`]).
    pub name: String,
    dir: tempfile::TempDir,
}

impl LabScratch {
    /// A new scratch lab named after `tag`.
    pub fn new(tag: &str) -> LabScratch {
        LabScratch { name: unique(tag), dir: tempfile::tempdir().expect("temp dir") }
    }

    /// The `--state-dir` of the lab's commands.
    pub fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// A path inside the test's folder.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes a file of the test; `{name}` becomes the lab's name and `{repo}` the repository's root.
    pub fn write(&self, file: &str, body: &str) -> PathBuf {
        let path = self.path(file);
        let body = body.replace("{name}", &self.name).replace("{repo}", &repo().display().to_string());
        std::fs::write(&path, body).expect("write test file");
        path
    }

    /// `flexstack --state-dir STATE ARGS...`, stdin closed.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(bin());
        c.arg("--state-dir").arg(self.state()).args(args).stdin(Stdio::null());
        c
    }

    /// Runs `flexstack --state-dir STATE ARGS...` to its end.
    pub fn cli(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run flexstack")
    }

    /// Runs a command that must succeed; returns its stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert!(out.status.success(), "flexstack {args:?} failed: {}", text(&out));
        String::from_utf8(out.stdout).expect("utf-8")
    }
}

impl Drop for LabScratch {
    fn drop(&mut self) {
        if self.state().exists() {
            let out = self.cli(&["lab", "down", "--all"]);
            if !out.status.success() {
                eprintln!("lab down --all for {}: {}", self.name, text(&out));
            }
        }
    }
}

/// An interface deleted when dropped (for a veth pair: both ends), pass or fail.
pub struct LinkGuard(pub String);

impl Drop for LinkGuard {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.0]).status();
    }
}

/// `n` bytes of a pattern that does not repeat within a file (each 8 bytes different): a test blob.
pub fn pattern(n: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(n);
    v
}

/// The sha256 of a file, as `sha256sum` prints it.
pub fn sha256(file: &Path) -> String {
    sh("sha256sum", &[path_str(file)]).split_whitespace().next().expect("a sum").to_string()
}

/// A dedicated "host" network namespace whose default routes (v4 and v6) lead through a veth pair into a gateway
/// namespace, for tests that run daemons and `flexstack run` as on a host (`nsenter --net`, as the lab starts its
/// daemons: no mount namespace of their own, so the app namespaces they add are seen by all) without ever touching
/// the real host's routes, forwarding settings or nftables. Addresses: the gateway 10.200.9.1/24 and
/// fd99:c8::1/64, the host .2 of each (private to the two namespaces). The host's forwarding starts off (0).
pub struct HostNet {
    pub host: Netns,
    pub gw: Netns,
    /// The gateway's end of the veth pair.
    pub gw_dev: String,
}

impl HostNet {
    pub const GW_V4: &'static str = "10.200.9.1";
    pub const GW_V6: &'static str = "fd99:c8::1";
    pub const HOST_V4: &'static str = "10.200.9.2";

    pub fn new() -> HostNet {
        let (host, gw) = (Netns::new("hst"), Netns::new("gw"));
        let (h, g) = (unique("h"), unique("g"));
        sh("ip", &["link", "add", &h, "type", "veth", "peer", "name", &g]);
        let guard = LinkGuard(h.clone());
        host.adopt(&h, &[&format!("{}/24", Self::HOST_V4), "fd99:c8::2/64"]);
        std::mem::forget(guard); // the pair now goes with the namespaces
        gw.adopt(&g, &[&format!("{}/24", Self::GW_V4), &format!("{}/64", Self::GW_V6)]);
        sh("ip", &["-n", &host.name, "route", "add", "default", "via", Self::GW_V4]);
        sh("ip", &["-n", &host.name, "-6", "route", "add", "default", "via", Self::GW_V6]);
        let net = HostNet { host, gw, gw_dev: g };
        net.set_forwarding("0");
        net
    }

    /// `program` started in the host namespace (`nsenter --net`, which execs it: the child's pid is its own).
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.host.name)).arg("--").arg(program);
        c
    }

    fn set_forwarding(&self, value: &str) {
        for key in ["net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"] {
            let out = self.host.run(&["sysctl", "-qw", &format!("{key}={value}")]);
            assert!(out.status.success(), "sysctl {key}: {}", text(&out));
        }
    }

    /// The host's `net.ipv4.ip_forward` and `net.ipv6.conf.all.forwarding`.
    pub fn forwarding(&self) -> (String, String) {
        let read = |key: &str| sh("ip", &["netns", "exec", &self.host.name, "sysctl", "-n", key]).trim().to_string();
        (read("net.ipv4.ip_forward"), read("net.ipv6.conf.all.forwarding"))
    }

    /// The host's nftables tables (`nft list tables`).
    pub fn nft_tables(&self) -> String {
        sh("ip", &["netns", "exec", &self.host.name, "nft", "list", "tables"])
    }
}

/// A daemon (started by the test, or by `flexstack run`) whose app namespaces and cgroups a test may leave behind on
/// purpose (SIGKILL): removed, with their processes (those in the cgroups, and those in the namespaces, for a build
/// without cgroups), on drop.
pub struct AppLeftovers(pub u32);

impl Drop for AppLeftovers {
    fn drop(&mut self) {
        use flexstack_daemon::sandbox;
        let prefix = format!("fs-{}-", self.0);
        if let Some(base) = sandbox::cgroup_base() {
            for e in std::fs::read_dir(base).into_iter().flatten().flatten() {
                if e.file_name().to_string_lossy().starts_with(&prefix) {
                    let _ = sandbox::kill_cgroup(&e.path());
                }
            }
        }
        for ns in sandbox::namespace_names().into_iter().filter(|n| n.starts_with(&prefix)) {
            if let Ok(out) = Command::new("ip").args(["netns", "pids", &ns]).output() {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-9", pid]).status();
                }
            }
            sandbox::delete_namespace(&ns);
        }
    }
}

/// A daemon in a [`HostNet`]'s host namespace with a temporary state directory, logging to `daemon.log` there;
/// killed on drop (what it leaves is removed: see [`AppLeftovers`]).
pub struct HostDaemon {
    pub child: Child,
    pub state: tempfile::TempDir,
    _leftovers: AppLeftovers,
}

impl HostDaemon {
    pub fn start(net: &HostNet, extra: &[&str]) -> HostDaemon {
        let state = tempfile::tempdir().expect("temp dir");
        let log = std::fs::File::create(state.path().join("daemon.log")).expect("log");
        let child = net
            .command(bin())
            .arg("--state-dir")
            .arg(state.path())
            .arg("daemon")
            .args(extra)
            .env("FLEXSTACK_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start the daemon");
        let d = HostDaemon { _leftovers: AppLeftovers(child.id()), child, state };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !d.cli(&["status"]).status.success() {
            assert!(Instant::now() < deadline, "the daemon did not start: {}", d.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(bin()).arg("--state-dir").arg(self.state.path()).args(args).output().expect("flexstack")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.state.path().join("daemon.log")).unwrap_or_default()
    }

    /// `flexstack run ARGS` in the host namespace, stdout and stderr piped.
    pub fn spawn_run(&self, net: &HostNet, args: &[&str]) -> Child {
        net.command(bin())
            .arg("--state-dir")
            .arg(self.state.path())
            .arg("run")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("flexstack run")
    }

    /// The attached apps (empty when `app list` does not answer).
    pub fn apps(&self) -> Vec<AppInfo> {
        answer::<AppList>(&self.cli(&["-j", "app", "list"])).unwrap_or_default()
    }

    /// Waits until `n` apps are attached.
    pub fn wait_for_apps(&self, n: usize) -> Vec<AppInfo> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let apps = self.apps();
            if apps.len() == n {
                return apps;
            }
            assert!(Instant::now() < deadline, "expected {n} apps, have {apps:?}; log: {}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, and the exit reaped.
    pub fn kill(&mut self) {
        self.child.kill().expect("kill the daemon");
        self.child.wait().expect("reap the daemon");
    }
}

impl Drop for HostDaemon {
    fn drop(&mut self) {
        stop_daemon(&mut self.child);
    }
}

/// True while process `pid` exists and is not a zombie.
pub fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
}

/// Waits up to `secs` for `cond`; false if it never held.
pub fn eventually(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}

/// Sends `request` to a TCP port on loopback and reads the answer until the server closes (empty if it reset).
pub fn tcp_exchange(port: u16, request: &[u8]) -> String {
    use std::io::Read;
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = c.write_all(request);
    let mut out = Vec::new();
    let _ = c.read_to_end(&mut out);
    String::from_utf8_lossy(&out).to_string()
}

/// A CA (`NAME-ca.pem`) and a server certificate it signed for `ip` with its key (`NAME.pem`, `NAME.key`) in `dir`.
pub fn certificate(dir: &Path, name: &str, ip: &str) -> (PathBuf, PathBuf, PathBuf) {
    let f = |suffix: &str| dir.join(format!("{name}{suffix}"));
    let (ca, ca_key, cert, key, csr, ext) = (f("-ca.pem"), f("-ca.key"), f(".pem"), f(".key"), f(".csr"), f(".ext"));
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    let p = path_str;
    let mut a =
        vec!["req", "-x509", "-days", "1", "-subj", "/CN=flexstack test CA", "-keyout", p(&ca_key), "-out", p(&ca)];
    a.extend(ec);
    sh("openssl", &a);
    let mut a = vec!["req", "-subj", "/CN=flexstack test server", "-keyout", p(&key), "-out", p(&csr)];
    a.extend(ec);
    sh("openssl", &a);
    std::fs::write(&ext, format!("subjectAltName=IP:{ip}\nbasicConstraints=CA:FALSE\n")).unwrap();
    sh(
        "openssl",
        &["x509", "-req", "-days", "1", "-in", p(&csr), "-CA", p(&ca), "-CAkey", p(&ca_key), "-CAcreateserial"]
            .into_iter()
            .chain(["-extfile", p(&ext), "-out", p(&cert)])
            .collect::<Vec<_>>(),
    );
    (ca, cert, key)
}

/// A veth pair from the host (its end up, with the IPv4 and IPv6 addresses `host`) into namespace `ns` (its end
/// with `inside`); returns the names of the host's end and of the namespace's.
pub fn veth_into(ns: &Netns, host: [&str; 2], inside: [&str; 2]) -> (String, String) {
    let (h, n) = (unique("h"), unique("s"));
    sh("ip", &["link", "add", &h, "type", "veth", "peer", "name", &n]);
    sh("ip", &["addr", "add", host[0], "dev", &h]);
    sh("ip", &["addr", "add", host[1], "dev", &h, "nodad"]);
    sh("ip", &["link", "set", &h, "up"]);
    ns.adopt(&n, &inside);
    (h, n)
}

/// Runs iperf3 client `command` (made anew for each try); a try the server refused because it was still ending
/// the previous test ("the server is busy running a test", a race of iperf3's own between one client's exit and
/// its server's cleanup) is tried again after a second, up to three times, and said on stderr.
pub fn iperf3_client(command: impl Fn() -> Command) -> Output {
    let mut tries = 0;
    loop {
        let out = command().output().expect("iperf3");
        tries += 1;
        if tries == 3 || !String::from_utf8_lossy(&out.stdout).contains("the server is busy running a test") {
            return out;
        }
        eprintln!("iperf3: the server was still busy with the previous test; trying again");
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// stacks/app-terminate.toml with `term` and `orig` as the back-ends of `terminate` and `originate` (in that order
/// in the file) and `matches` as the match table.
pub fn terminate_stack(term: &str, orig: &str, matches: &str) -> String {
    let template = std::fs::read_to_string(repo().join("stacks/app-terminate.toml")).expect("the template");
    assert_eq!(template.matches("backend = \"smoltcp\"").count(), 2, "both endpoints name their back-end");
    let template = template.replacen("backend = \"smoltcp\"", &format!("backend = \"{term}\""), 1);
    let template = template.replacen("backend = \"smoltcp\"", &format!("backend = \"{orig}\""), 1);
    let mut out = String::new();
    for line in template.lines() {
        out.push_str(if line.starts_with("match = ") { "" } else { line });
        if line.starts_with("match = ") {
            out.push_str(&format!("match = {matches}"));
        }
        out.push('\n');
    }
    out
}
