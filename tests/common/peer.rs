//! The rig of the peer tests (tests/peer_e2e.rs, tests/peer_switch_e2e.rs): two daemons, A (the app's, with the
//! host's sandboxes) and B (in a namespace of its own, `stacks/peer-in.toml`), joined by a veth pair, and a server
//! (python3 http.server, dnsmasq) in a third namespace behind B, on a subnet A has no route to.

use crate::common::{
    bin, octets, path_str, pattern, privileged, repo, sh, text, unique, veth_into, Background, Daemon, Netns,
    SandboxDaemon,
};
use std::path::PathBuf;
use std::process::Output;
use std::time::Duration;

/// The line the scripts print before the meters they read.
pub const MARK: &str = "@@meters@@";
/// The line a script prints before `flow list`.
pub const FLOWS: &str = "@@flows@@";

/// Two peers and a server behind B: A (sandbox daemon, host namespace) ─ veth 10.S.1.0/24 ─ B (namespace) ─ veth
/// 10.S.2.0/24 ─ server namespace.
pub struct Rig {
    pub a: SandboxDaemon,
    pub b: Daemon,
    pub _srv: Netns,
    pub _nb: Netns,
    pub host_dev: String,
    /// B's end of the veth pair to A (in `_nb`).
    pub b_dev: String,
    pub _http: Background,
    pub _dns: Background,
    pub www: tempfile::TempDir,
    pub dir: tempfile::TempDir,
    pub stack: PathBuf,
    /// The server's addresses (behind B).
    pub srv: String,
    pub srv6: String,
    /// B's carrier address.
    pub b_addr: String,
    /// The carrier settings the app's stacks get (`transport`, `cc`).
    pub carrier: String,
    /// The octet of the rig's subnets (`10.S.1.0/24` between the peers, `10.S.2.0/24` to the server).
    pub s: u8,
}

/// How the peers are joined.
#[derive(Clone, Copy)]
pub struct Link {
    /// The carrier's transport: `tcp`, `quic`, `udp` or `udpplus`.
    pub transport: &'static str,
    /// The peers reach each other over IPv6 (else IPv4).
    pub v6: bool,
    /// More transports of both carriers (`transports`, comma-separated; empty: none).
    pub transports: &'static str,
}

pub const TCP: Link = Link { transport: "tcp", v6: false, transports: "" };
pub const TCP6: Link = Link { transport: "tcp", v6: true, transports: "" };
pub const QUIC: Link = Link { transport: "quic", v6: false, transports: "" };
pub const QUIC6: Link = Link { transport: "quic", v6: true, transports: "" };
pub const UDP: Link = Link { transport: "udp", v6: false, transports: "" };
pub const UDPPLUS: Link = Link { transport: "udpplus", v6: false, transports: "" };
pub const UDPPLUS6: Link = Link { transport: "udpplus", v6: true, transports: "" };

impl Link {
    /// The carrier settings of both ends.
    pub fn settings(&self) -> String {
        let mut s = format!("transport = \"{}\"", self.transport);
        if !self.transports.is_empty() {
            s.push_str(&format!("\ntransports = \"{}\"", self.transports));
        }
        s
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip").args(["link", "del", &self.host_dev]).status();
    }
}

impl Rig {
    /// `offset` keeps the tests of this file apart (their subnets). `introduce`: whether B knows A's key (A always
    /// knows B's).
    pub fn new(offset: u8, introduce: bool) -> Option<Rig> {
        Rig::with(offset, introduce, TCP)
    }

    pub fn with(offset: u8, introduce: bool, link: Link) -> Option<Rig> {
        Rig::with_links(offset, introduce, link, link)
    }

    /// A rig whose carriers have settings of their own: A's `link`, B's `b_link` (the same addresses).
    pub fn with_links(offset: u8, introduce: bool, link: Link, b_link: Link) -> Option<Rig> {
        Rig::with_b_stack(offset, introduce, link, b_link, "stacks/peer-in.toml", &|t, _| t.to_string())
    }

    /// A rig whose B runs `b_template` (a file of the repo that listens on `0.0.0.0:7300`), changed by `edit` (the
    /// template and the rig's subnet octet `S`) before the listening address is put in.
    pub fn with_b_stack(
        offset: u8,
        introduce: bool,
        link: Link,
        b_link: Link,
        b_template: &str,
        edit: &dyn Fn(&str, u8) -> String,
    ) -> Option<Rig> {
        if !privileged() {
            return None;
        }
        let (app_octet, srv_octet) = octets();
        let s = srv_octet.wrapping_add(60 + offset);
        let (nb, srv) = (Netns::new("pb"), Netns::new("ps"));
        // A (host) <-> B.
        let (h, b1) = veth_into(
            &nb,
            [&format!("10.{s}.1.1/24"), &format!("fd96:{s:x}::1/64")],
            [&format!("10.{s}.1.2/24"), &format!("fd96:{s:x}::2/64")],
        );
        // B <-> server.
        let (b2, s1) = (unique("b"), unique("s"));
        sh("ip", &["link", "add", &b2, "type", "veth", "peer", "name", &s1]);
        nb.adopt(&b2, &[&format!("10.{s}.2.1/24"), &format!("fd97:{s:x}::1/64")]);
        srv.adopt(&s1, &[&format!("10.{s}.2.2/24"), &format!("fd97:{s:x}::2/64")]);
        let srv_addr = format!("10.{s}.2.2");
        let www = tempfile::tempdir().expect("temp dir");
        std::fs::write(www.path().join("blob"), pattern(2_000_000)).expect("write the blob");
        let http = srv.serve_http("::", www.path());
        let dns = srv.serve_dns(&srv_addr, &format!("fd97:{s:x}::2"));
        // B: accepts carriers on its side of the first veth and opens the flows again with kernel sockets.
        let b_addr = if link.v6 { format!("[fd96:{s:x}::2]:7300") } else { format!("10.{s}.1.2:7300") };
        let a_addr = if link.v6 { format!("[fd96:{s:x}::1]:0") } else { format!("10.{s}.1.1:0") };
        let template = edit(&std::fs::read_to_string(repo().join(b_template)).expect("B's stack"), s);
        assert!(template.contains("listen = \"0.0.0.0:7300\""), "the template listens on 0.0.0.0:7300");
        let listen = format!("listen = \"{b_addr}\"\n{}", b_link.settings());
        let b_stack = template.replace("listen = \"0.0.0.0:7300\"", &listen);
        let b = Daemon::start_in(&nb, &b_stack, &[]);
        let a = SandboxDaemon::start(app_octet.wrapping_add(60 + offset));
        let key = |out: Output| {
            assert!(out.status.success(), "peer key: {}", text(&out));
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        };
        let (fa, fb) = (key(a.cli(&["peer", "key"])), key(b.cli(&["peer", "key"])));
        assert_eq!((fa.len(), fb.len()), (64, 64), "fingerprints: {fa} {fb}");
        assert_ne!(fa, fb, "each daemon has its own key");
        let added = a.cli(&["peer", "add", "gateway", &b_addr, &fb]);
        assert!(added.status.success(), "{}", text(&added));
        if introduce {
            b.ok(&["peer", "add", "a", &a_addr, &fa]);
        } else {
            // B knows another key under A's name: A's certificate is not it.
            b.ok(&["peer", "add", "a", &a_addr, &"ab".repeat(32)]);
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let stack = dir.path().join("app-peer.toml");
        let carrier = link.settings();
        write_app_stack(&stack, &carrier);
        // Wait for the server to answer in its namespace.
        for _ in 0..100 {
            let url = format!("http://{srv_addr}:8080/blob");
            if srv.run(&["curl", "-sf", "-m", "2", "-o", "/dev/null", &url]).status.success() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(Rig {
            a,
            b,
            _srv: srv,
            _nb: nb,
            host_dev: h,
            b_dev: b1,
            _http: http,
            _dns: dns,
            www,
            dir,
            stack,
            srv: srv_addr,
            srv6: format!("fd97:{s:x}::2"),
            b_addr,
            carrier,
            s,
        })
    }

    /// An app stack whose carrier has these settings besides the transport (e.g. `cc = "bbr"`).
    pub fn stack_with(&self, settings: &str) -> PathBuf {
        let path = self.dir.path().join(format!("app-peer-{}.toml", unique("s")));
        write_app_stack(&path, &format!("{}\n{settings}", self.carrier));
        path
    }

    /// The arguments of `flexstack run` for `script` as app `app`, which then reads A's `meters` (`peer.X` is
    /// `module.<app>-peer.X`) and prints them after [`MARK`].
    pub fn args(&self, app: &str, script: &str, meters: &[&str]) -> Vec<String> {
        self.args_in(&self.stack, app, script, meters)
    }

    pub fn args_in(&self, stack: &std::path::Path, app: &str, script: &str, meters: &[&str]) -> Vec<String> {
        let names: Vec<String> = meters.iter().map(|m| format!("module.{app}-{m}")).collect();
        let read =
            format!("echo {MARK}; {} --state-dir {} -j get {}", bin(), path_str(self.a.state.path()), names.join(" "));
        let full = format!("{script}\nrc=$?\n{read}\nexit $rc\n");
        ["--stack", path_str(stack), "--name", app, "--", "sh", "-c", &full].map(String::from).to_vec()
    }

    /// The meters a run printed, by their short names.
    pub fn meters(out: &Output, app: &str, meters: &[&str]) -> Vec<u64> {
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let (_, json) = stdout.split_once(MARK).unwrap_or_else(|| panic!("no meters: {}", text(out)));
        let parsed: serde_json::Value = serde_json::from_str(json.trim()).expect("meters as JSON");
        meters
            .iter()
            .map(|m| {
                let name = format!("module.{app}-{m}");
                parsed[&name]["value"].as_u64().unwrap_or_else(|| panic!("{name}: {parsed}"))
            })
            .collect()
    }

    pub fn run(&self, app: &str, script: &str, meters: &[&str]) -> (Output, Vec<u64>) {
        self.run_in(&self.stack, app, script, meters)
    }

    pub fn run_in(&self, stack: &std::path::Path, app: &str, script: &str, meters: &[&str]) -> (Output, Vec<u64>) {
        let args = self.args_in(stack, app, script, meters);
        let out = self.a.run(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let values = Rig::meters(&out, app, meters);
        (out, values)
    }

    pub fn b_meter(&self, name: &str) -> u64 {
        self.b.get_u64(&format!("module.peers.{name}"))
    }
}

/// `stacks/app-peer.toml` with `settings` (TOML lines) added to its carrier.
pub fn write_app_stack(path: &std::path::Path, settings: &str) {
    write_stack_from("stacks/app-peer.toml", path, settings);
}

/// An app's stack from `template` (a file of the repo whose carrier connects to `gateway`) with `settings` (TOML
/// lines) added to its carrier.
pub fn write_stack_from(template: &str, path: &std::path::Path, settings: &str) {
    let template = std::fs::read_to_string(repo().join(template)).expect("the app's stack template");
    let line = "peer = \"gateway\"";
    assert!(template.contains(line), "the template's carrier connects to `gateway`");
    let text = template.replacen(line, &format!("{line}\n{settings}"), 1);
    std::fs::write(path, text).expect("write the app's stack");
}

/// Counts the numbered datagrams (`N ...`) that reach port 9000 of the server behind B: spawned in its namespace,
/// it writes `distinct total` to the file it returns whenever nothing came for 0.3 s. Its receive buffer (8 MiB)
/// takes a burst: the datagrams a carrier held for a late `Open` come at once.
pub fn udp_counter(r: &Rig, name: &str) -> (Background, PathBuf) {
    let out = r.dir.path().join(format!("count-{name}"));
    let counter = format!(
        "import os, socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         s.setsockopt(socket.SOL_SOCKET, 33, 1 << 23)\ns.bind(('{srv}', 9000))\n\
         s.settimeout(0.3)\nseen = set()\ntotal = 0\nlast = None\nwhile True:\n    try:\n        \
         d, _ = s.recvfrom(65536)\n        total += 1\n        seen.add(int(d.split(b' ')[0]))\n    \
         except socket.timeout:\n        if (len(seen), total) != last:\n            last = (len(seen), total)\n            \
         open('{out}.tmp', 'w').write('%d %d' % last)\n            os.rename('{out}.tmp', '{out}')\n",
        srv = r.srv,
        out = path_str(&out),
    );
    let bg = r._srv.spawn(&["python3", "-c", &counter]);
    std::thread::sleep(Duration::from_millis(300));
    (bg, out)
}

/// What [`udp_counter`] counted once it settled: the distinct numbers and the datagrams received.
pub fn read_counter(out: &std::path::Path) -> (u64, u64) {
    let read = || std::fs::read_to_string(out).unwrap_or_default();
    let mut last = read();
    for _ in 0..20 {
        std::thread::sleep(Duration::from_millis(400));
        let now = read();
        if !now.is_empty() && now == last {
            break;
        }
        last = now;
    }
    let v: Vec<u64> = last.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    assert_eq!(v.len(), 2, "the counter's result: {last:?}");
    (v[0], v[1])
}

/// A second link between A and B with addresses of its own (A 10.S.3.1/24, B 10.S.3.2/24, S the rig's subnet
/// octet) and the source-based policy routing of a multi-homed host on A: what leaves from the second uplink's
/// address goes out of it (`ip rule from 10.S.3.1 table T`, B's carrier address via 10.S.3.2 there), everything
/// else by the main table, through the rig's first link. An `unreachable` route behind each keeps a carrier's packets
/// on these links when one is down (never out of the host's default route). Removed when dropped.
pub struct SecondUplink {
    /// A's end of the second link (in the host namespace).
    pub host_dev: String,
    /// A's address on the rig's first link and on this one: a carrier's `uplinks`.
    pub first: String,
    pub second: String,
    table: String,
    guard: String,
    /// `-4` or `-6`: the peers' address family (`ip -6 rule` and routes for IPv6 peers).
    family: String,
}

impl Rig {
    /// Adds [`SecondUplink`] (of the peers' address family: 10.S.3.0/24, or fd98:S::/64 for IPv6 peers).
    pub fn second_uplink(&self) -> SecondUplink {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let b_ip = self.b_addr.rsplit_once(':').expect("ADDR:PORT").0.trim_matches(['[', ']']).to_string();
        let v6 = b_ip.contains(':');
        let s = self.s;
        let (h, _) = veth_into(
            &self._nb,
            [&format!("10.{s}.3.1/24"), &format!("fd98:{s}::1/64")],
            [&format!("10.{s}.3.2/24"), &format!("fd98:{s}::2/64")],
        );
        // A routing table of this process's own.
        let table = (40_000 + (std::process::id() % 20_000) * 8 + NEXT.fetch_add(1, Ordering::Relaxed) % 8).to_string();
        let (family, first, second, via, host, guard) = if v6 {
            let f = |x: &str| x.to_string();
            (
                f("-6"),
                format!("fd96:{s:x}::1"),
                format!("fd98:{s}::1"),
                format!("fd98:{s}::2"),
                "128",
                format!("fd96:{s:x}::/64"),
            )
        } else {
            (
                "-4".to_string(),
                format!("10.{s}.1.1"),
                format!("10.{s}.3.1"),
                format!("10.{s}.3.2"),
                "32",
                format!("10.{s}.1.0/24"),
            )
        };
        let up = SecondUplink { host_dev: h.clone(), first, second, table, guard, family };
        let f = up.family.as_str();
        sh("ip", &[f, "rule", "add", "from", &up.second, "table", &up.table]);
        sh("ip", &[f, "route", "add", &format!("{b_ip}/{host}"), "via", &via, "dev", &h, "table", &up.table]);
        sh("ip", &[f, "route", "add", "unreachable", "default", "table", &up.table]);
        sh("ip", &[f, "route", "add", "unreachable", &up.guard, "metric", "9999"]);
        up
    }
}

impl Drop for SecondUplink {
    fn drop(&mut self) {
        let ip = |args: &[&str]| {
            let _ = std::process::Command::new("ip").args(args).status();
        };
        let f = self.family.as_str();
        ip(&[f, "rule", "del", "from", &self.second, "table", &self.table]);
        ip(&[f, "route", "flush", "table", &self.table]);
        ip(&[f, "route", "del", "unreachable", &self.guard, "metric", "9999"]);
        ip(&["link", "del", &self.host_dev]);
    }
}

/// A download of the rig's 2 MB blob by app `app` with stack `stack`, read slowly (64 KiB every `pause` s) through
/// a socket with a 64 KiB receive buffer (so that little waits on A: most of the rest is still to cross the carrier)
/// and hashed by python3, which prints the sha256; the running `flexstack run`, once B carries the flow, and the
/// sha256 it should print. The script then prints A's `meters` (see [`Rig::meters`]).
pub fn slow_download(
    r: &Rig,
    stack: &std::path::Path,
    app: &str,
    pause: f64,
    meters: &[&str],
) -> (String, std::process::Child) {
    let want = crate::common::sha256(&r.www.path().join("blob"));
    let reader = format!(
        "import hashlib, socket, time\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)\n\
         s.settimeout(60)\ns.connect(('{srv}', 8080))\ns.sendall(b'GET /blob HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n')\n\
         data = b''\nwhile True:\n    b = s.recv(65536)\n    if not b:\n        break\n    data += b\n    \
         time.sleep({pause})\nhead, body = data.split(b'\\r\\n\\r\\n', 1)\n\
         print(hashlib.sha256(body).hexdigest())\n",
        srv = r.srv
    );
    let args = r.args_in(stack, app, &format!("python3 -c \"{reader}\""), meters);
    let run = r.a.spawn_run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    r.b.wait_for("the app's flow at B", 10, |b| b.get_u64("module.peers.flows_active") == 1);
    (want.trim().to_string(), run)
}

/// Waits for `run` at most `secs` seconds: its output, or a panic saying it hung.
pub fn wait_app(mut run: std::process::Child, secs: u64, what: &str) -> std::process::Output {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while run.try_wait().expect("wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = run.kill();
            panic!("{what}: the app still ran after {secs} s (hung)");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    run.wait_with_output().expect("output")
}
