//! End-to-end: unmodified programs run with `flexstack run --stack stacks/app-terminate.toml`, their TCP and UDP
//! flows terminated in the daemon and opened again towards a server in another namespace (docs/streams.md,
//! "Running an app with termination"). Real programs: curl, iperf3, dig + dnsmasq, nginx + wrk, a static Go binary,
//! python3 clients and servers for the connection semantics (refusal, unreachable, half-close, reset, a killed app,
//! a stalled server, 1,000 connections at once), and the match table (what it does not choose is forwarded as
//! before).
//!
//! Each scenario is a function of the back-end (`terminate`'s and `originate`'s `backend` setting), with one test per
//! back-end: a new back-end is one more line per scenario. Needs root (skips with a reason outside CI).

mod common;

use common::{
    bin, octets, path_str, pattern, privileged, privileged_serial, repo, sha256, text, Background, SandboxDaemon,
    Server,
};
use flexstack_api::ops::Handling;
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

/// The line the scripts print before the meters they read.
const MARK: &str = "@@meters@@";

/// A server namespace (HTTP on 8080 serving `blob`), a daemon of its own, and the terminating app stack with the
/// back-end (and optionally a match table) filled in.
struct Rig {
    srv: Server,
    d: SandboxDaemon,
    dir: tempfile::TempDir,
    stack: PathBuf,
}

impl Rig {
    /// `None` when the test cannot run here (see `privileged`). `offset` (below 20) keeps the scenarios of this file
    /// apart (their subnets), and the back-end another 20, since a scenario's two tests run at the same time;
    /// `matches` replaces the template's match table (a TOML array).
    fn new(backend: &str, offset: u8, blob: &[u8], matches: Option<&str>) -> Option<Rig> {
        if !privileged() {
            return None;
        }
        let (app_octet, srv_octet) = octets();
        let offset = offset + if backend == "kernel" { 20 } else { 0 };
        let srv = Server::new(srv_octet.wrapping_add(offset), blob);
        let d = SandboxDaemon::start(app_octet.wrapping_add(offset));
        let dir = tempfile::tempdir().expect("temp dir");
        let stack = dir.path().join("app-terminate.toml");
        std::fs::write(&stack, terminate_stack(backend, matches)).expect("write the stack");
        Some(Rig { srv, d, dir, stack })
    }

    /// A path in the test's own folder.
    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Runs `script` (sh) as app `app` behind the terminating stack; then, still in the sandbox, reads `meters`
    /// (`term.X` is `module.<app>-term.X`, `orig.X` `module.<app>-orig.X`). Returns the run's output (what the
    /// script printed; its exit code) and the meters.
    fn run(&self, app: &str, script: &str, meters: &[&str]) -> (Output, BTreeMap<String, u64>) {
        let args = self.args(app, script, meters);
        let out = self.d.run(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let values = read_meters(&out, app, meters);
        (out, values)
    }

    /// The arguments of `flexstack run` for [`Rig::run`] (to start it with `spawn_run`; then [`read_meters`]).
    fn args(&self, app: &str, script: &str, meters: &[&str]) -> Vec<String> {
        let names: Vec<String> = meters.iter().map(|m| meter_name(app, m)).collect();
        let read = if names.is_empty() {
            String::new()
        } else {
            format!("echo {MARK}; {} --state-dir {} -j get {}", bin(), path_str(self.d.state.path()), names.join(" "))
        };
        let full = format!("{script}\nrc=$?\n{read}\nexit $rc\n");
        let stack = path_str(&self.stack);
        ["--stack", stack, "--name", app, "--", "sh", "-c", &full].map(String::from).to_vec()
    }
}

/// The meters a run started with [`Rig::args`] printed after its script.
fn read_meters(out: &Output, app: &str, meters: &[&str]) -> BTreeMap<String, u64> {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let mut values = BTreeMap::new();
    if let Some((_, json)) = stdout.split_once(MARK) {
        let parsed: Json = serde_json::from_str(json.trim())
            .unwrap_or_else(|e| panic!("meters are not JSON ({e}): {json}\n{}", text(out)));
        for short in meters {
            let name = meter_name(app, short);
            let v = parsed[&name]["value"].as_u64().unwrap_or_else(|| panic!("{name}: {parsed}"));
            values.insert(short.to_string(), v);
        }
    }
    values
}

/// The full name of a meter given as `term.X` / `orig.X` / `host.X` for app `app` (`app.X`: the app's own face).
fn meter_name(app: &str, short: &str) -> String {
    let (module, meter) = short.split_once('.').expect("term.X or orig.X");
    match module {
        "app" => format!("module.{app}.{meter}"),
        _ => format!("module.{app}-{module}.{meter}"),
    }
}

/// stacks/app-terminate.toml with `backend = "<backend>"` on both endpoints and, if given, another match table.
fn terminate_stack(backend: &str, matches: Option<&str>) -> String {
    let template = std::fs::read_to_string(repo().join("stacks/app-terminate.toml")).expect("the template");
    assert_eq!(template.matches("backend = \"smoltcp\"").count(), 2, "both endpoints name their back-end");
    let mut out = String::new();
    for line in template.lines() {
        match (matches, line.starts_with("match = ")) {
            (Some(m), true) => out.push_str(&format!("match = {m}")),
            _ => out.push_str(&line.replace("backend = \"smoltcp\"", &format!("backend = \"{backend}\""))),
        }
        out.push('\n');
    }
    out
}

/// Asserts that a run succeeded; returns its stdout and stderr.
fn ok(out: &Output) -> String {
    let t = text(out);
    assert!(out.status.success(), "the program failed ({:?}): {t}", out.status.code());
    t
}

/// Writes the python3 helper (servers and clients of the semantic tests) to `dir`; returns its path.
fn python_helper(dir: &Path) -> PathBuf {
    let path = dir.join("helper.py");
    std::fs::write(&path, PYTHON_HELPER).expect("write helper.py");
    path
}

/// Servers (`serve MODE PORT`) and clients (`MODE HOST PORT`) for the semantic tests.
const PYTHON_HELPER: &str = r#"
import asyncio, hashlib, os, resource, socket, struct, sys, time

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
ANSWER = bytes(range(256)) * 1200  # 300 KB

def serve(mode, port):
    if mode == "echo":
        async def handle(r, w):
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            finally:
                w.close()
        async def main():
            srv = await asyncio.start_server(handle, host=None, port=port, backlog=4096)
            async with srv:
                await srv.serve_forever()
        asyncio.run(main())
    s = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128)
    while True:
        c, _ = s.accept()
        if mode == "halfclose":
            h, n = hashlib.sha256(), 0
            while b := c.recv(65536):
                h.update(b)
                n += len(b)
            c.sendall(f"{n} {h.hexdigest()}\n".encode() + ANSWER)
            c.close()
        elif mode.startswith("stall"):
            time.sleep(int(mode[5:]))  # "stall3": reads nothing for 3 s, its window closed
            h, n = hashlib.sha256(), 0
            while b := c.recv(1 << 20):
                h.update(b)
                n += len(b)
            c.sendall(f"{n} {h.hexdigest()}\n".encode())
            c.close()
        elif mode == "rst":
            c.sendall(b"x" * 200_000)
            time.sleep(0.5)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            c.close()

def halfclose(host, port):
    s = socket.create_connection((host, port), timeout=20)
    data = os.urandom(100_000)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    got = b""
    while b := s.recv(65536):
        got += b
    line, rest = got.split(b"\n", 1)
    assert line.decode() == f"{len(data)} {hashlib.sha256(data).hexdigest()}", line
    assert rest == ANSWER, len(rest)
    print("halfclose ok")

def rst(host, port):
    s = socket.create_connection((host, port), timeout=20)
    n = 0
    try:
        while b := s.recv(65536):
            n += len(b)
        print(f"eof after {n}")
    except ConnectionResetError:
        print(f"reset after {n}")

def stall(host, port, secs):
    import threading
    s = socket.create_connection((host, port), timeout=60)
    block = os.urandom(1 << 16)
    total, sent = 128 << 20, [0]
    def send():
        while sent[0] < total:
            sent[0] += s.send(block)
    t = threading.Thread(target=send)
    t.start()
    time.sleep(secs - 1 if secs > 2 else 2)  # near the stall's end: what the app sent while the server read nothing
    print(f"sent during the stall {sent[0]}", flush=True)
    t.join()
    s.shutdown(socket.SHUT_WR)
    h = hashlib.sha256()
    for _ in range(total >> 16):
        h.update(block)
    line = s.makefile().readline().strip()
    assert line == f"{sent[0]} {h.hexdigest()}", (line, sent[0])
    print("stall ok")

def raw_listen(path):
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, 253)
    while True:
        d = s.recv(4096)
        if b"raw protocol 253" in d:
            with open(path, "wb") as f:
                f.write(d)

def raw_send(host):
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, 253)
    for _ in range(5):
        s.sendto(b"raw protocol 253", (host, 0))
        time.sleep(0.1)

def many(host, port, count):
    async def one(i):
        r, w = await asyncio.open_connection(host, port)
        return i, r, w
    async def echo(i, r, w):
        msg = (f"{i:06d}" * 200).encode()[:1000]
        w.write(msg)
        await w.drain()
        got = await r.readexactly(len(msg))
        w.close()
        return got == msg
    async def main():
        conns = await asyncio.gather(*(one(i) for i in range(count)))
        print(f"open {len(conns)}", flush=True)
        results = await asyncio.gather(*(echo(*c) for c in conns))
        print(f"echoed {sum(results)} of {count}")
    asyncio.run(asyncio.wait_for(main(), 60))

if sys.argv[1] == "serve":
    serve(sys.argv[2], int(sys.argv[3]))
elif sys.argv[1] == "rawlisten":
    raw_listen(sys.argv[2])
elif sys.argv[1] == "rawsend":
    raw_send(sys.argv[2])
elif sys.argv[1] == "many":
    many(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
elif sys.argv[1] == "stall":
    stall(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
else:
    {"halfclose": halfclose, "rst": rst}[sys.argv[1]](sys.argv[2], int(sys.argv[3]))
"#;

/// Starts a helper server (`mode` on `port`) in the server's namespace and waits until it accepts connections.
fn helper_server(r: &Rig, helper: &Path, mode: &str, port: u16) -> Background {
    let bg = r.srv.ns.spawn(&["python3", path_str(helper), "serve", mode, &port.to_string()]);
    wait_listening(r, port);
    bg
}

/// Waits until something listens on TCP `port` in the server's namespace.
fn wait_listening(r: &Rig, port: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let out = r.srv.ns.run(&["ss", "-Htln", &format!("sport = :{port}")]);
        if !String::from_utf8_lossy(&out.stdout).trim().is_empty() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("nothing listens on port {port} in the server's namespace");
}

// ---------------------------------------------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------------------------------------------

/// curl fetches 2 MB over IPv4 and IPv6, intact; both connections were terminated.
fn curl_2mb(backend: &str) {
    let blob = pattern(2_000_000);
    let Some(r) = Rig::new(backend, 0, &blob, None) else { return };
    let want = sha256(&r.srv.www.path().join("blob"));
    let script = format!(
        "curl -sSf -m 30 http://{v4}:8080/blob | sha256sum && curl -sSf -m 30 'http://[{v6}]:8080/blob' | sha256sum",
        v4 = r.srv.v4,
        v6 = r.srv.v6
    );
    let (out, m) = r.run("curl", &script, &["term.connections_total", "orig.connections_total", "term.passed_total"]);
    let t = ok(&out);
    assert_eq!(t.matches(&want).count(), 2, "both downloads are intact: {t}");
    assert_eq!(m["term.connections_total"], 2, "both connections were terminated: {m:?}");
    assert_eq!(m["orig.connections_total"], 2, "and opened again: {m:?}");
}

/// Two apps behind the terminating stack on one daemon at the same time: each downloads intact through its own
/// endpoints, and their per-flow meters do not collide.
fn two_apps_at_once(backend: &str) {
    let blob = pattern(2_000_000);
    let Some(r) = Rig::new(backend, 15, &blob, None) else { return };
    let want = sha256(&r.srv.www.path().join("blob"));
    let (go, release) = (r.path("go"), r.path("release"));
    // Each app opens its connection at `go` and reads the answer only at `release`: with the kernel back-end the
    // whole 2 MB fits in the app's socket buffer, so a flow that is read at once ends in a fraction of a second,
    // too soon to be seen reliably on a loaded machine.
    let client = "import hashlib, os, socket, sys, time\n\
                  s = socket.create_connection((sys.argv[1], 8080), timeout=30)\n\
                  s.sendall(b'GET /blob HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n')\n\
                  while not os.path.exists(sys.argv[2]): time.sleep(0.05)\n\
                  data = b''\n\
                  while True:\n    b = s.recv(1 << 16)\n    if not b: break\n    data += b\n\
                  print(hashlib.sha256(data.split(b'\\r\\n\\r\\n', 1)[1]).hexdigest(), ' -')";
    let script = format!(
        "while [ ! -e {go} ]; do sleep 0.05; done; python3 -c \"{client}\" {} {release}",
        r.srv.v4,
        go = path_str(&go),
        release = path_str(&release)
    );
    let meters = ["term.connections_total", "orig.connections_total"];
    let runs: Vec<_> = ["one", "two"]
        .iter()
        .map(|app| {
            let args = r.args(app, &script, &meters);
            (app, r.d.spawn_run(&args.iter().map(String::as_str).collect::<Vec<_>>()))
        })
        .collect();
    r.d.wait_for_apps(2);
    // While both run, each app's flow has its own variables (with a shared prefix, the second app's would be
    // refused and never appear).
    std::fs::write(&go, b"").unwrap();
    // Any flow id: the kernel back-end's TCP flows count from 2^32 + 1 (docs/streams.md, "The kernel back-end"),
    // and an app whose first connection attempt is retried under load has its flow at a later id.
    let prefixes = ["one.term", "two.term", "one.orig", "two.orig"].map(|p| format!("flow.{p}."));
    let mut seen = [false; 4];
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut list = String::new();
    while seen.contains(&false) {
        let flows: Vec<&str> = list.lines().filter(|l| l.starts_with("flow.")).take(20).collect();
        assert!(Instant::now() < deadline, "each app's flow has its meters: {seen:?} of {prefixes:?}: {flows:?}");
        list = String::from_utf8_lossy(&r.d.cli(&["var", "list"]).stdout).to_string();
        for (p, s) in prefixes.iter().zip(&mut seen) {
            *s |= list.lines().any(|l| l.starts_with(p));
        }
    }
    std::fs::write(&release, b"").unwrap();
    for (app, run) in runs {
        let out = run.wait_with_output().expect("the run's output");
        let t = ok(&out);
        assert!(t.contains(&want), "{app}: the download is intact: {t}");
        let m = read_meters(&out, app, &meters);
        assert_eq!((m["term.connections_total"], m["orig.connections_total"]), (1, 1), "{app}: {m:?}");
    }
}

/// A large file (1 GiB) arrives intact; prints how long it took.
fn curl_large(backend: &str) {
    let Some(_serial) = privileged_serial() else { return };
    let Some(r) = Rig::new(backend, 1, b"small", None) else { return };
    const SIZE: usize = 1 << 30;
    let big = r.srv.www.path().join("big");
    {
        use std::io::Write;
        let mut f = std::io::BufWriter::new(std::fs::File::create(&big).expect("create"));
        let chunk = pattern(1 << 20);
        for i in 0..SIZE / chunk.len() {
            f.write_all(&(i as u64).to_le_bytes()).unwrap();
            f.write_all(&chunk[8..]).unwrap();
        }
        f.flush().unwrap();
    }
    let want = sha256(&big);
    let t0 = Instant::now();
    let script = format!("curl -sSf -m 120 http://{}:8080/big | sha256sum", r.srv.v4);
    let (out, m) = r.run("big", &script, &["term.data_bytes_in_total"]);
    let took = t0.elapsed();
    let t = ok(&out);
    eprintln!("{backend}: 1 GiB through termination in {took:?}");
    assert!(t.contains(&want), "the 1 GiB file arrives intact: {t}");
    assert!(m["term.data_bytes_in_total"] > SIZE as u64, "its bytes went through the endpoint: {m:?}");
}

/// iperf3 TCP, both directions (-R), IPv4 and IPv6. With smoltcp, the bytes move in super-packets: the app's
/// kernel's reach `terminate` whole (far fewer segments than MSS-sized ones would be), and over IPv4 the sending
/// endpoint writes segments of many MSS, which the TUN faces write whole (`tx_gso_total`).
fn iperf3_tcp(backend: &str) {
    let Some(_serial) = privileged_serial() else { return };
    let Some(r) = Rig::new(backend, 2, b"small", None) else { return };
    let _iperf = r.srv.ns.spawn(&["iperf3", "-s", "-p", "5201"]);
    wait_listening(&r, 5201);
    let mut meters = vec!["term.data_bytes_out_total", "term.data_bytes_in_total"];
    let gso = ["term.segments_in_total", "term.segments_out_total", "orig.segments_out_total"];
    let faces = ["app.rx_gso_total", "app.tx_gso_total", "host.tx_gso_total"];
    if backend == "smoltcp" {
        meters.extend(gso.iter().chain(&faces));
    }
    for (addr, family) in [(&r.srv.v4, "v4"), (&r.srv.v6, "v6")] {
        for reverse in [false, true] {
            let flag = if reverse { "-R" } else { "" };
            let script = format!("iperf3 -c {addr} -p 5201 -t 2 -J {flag}");
            let (out, m) = r.run("iperf", &script, &meters);
            let t = ok(&out);
            let json: Json = serde_json::from_str(t.split(MARK).next().unwrap()).unwrap_or_else(|e| panic!("{e}: {t}"));
            let received = json["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0);
            assert!(received > 10_000_000, "{family} {flag}: iperf3 moved {received} bytes: {t}");
            // The test's data went through the terminating endpoint, in its direction.
            let through = if reverse { m["term.data_bytes_in_total"] } else { m["term.data_bytes_out_total"] };
            assert!(through >= received, "{family} {flag}: {through} bytes through terminate, {received} received");
            eprintln!("{backend} {family} {flag}: {} Mbit/s {m:?}", received * 8 / 2_000_000);
            if backend != "smoltcp" {
                continue;
            }
            // Segments of one MSS (1,448 bytes) would be received / 1,448; whole super-packets, a small part.
            let mss_segments = received / 1448;
            let few = |meter: &str| assert!(m[meter] * 4 < mss_segments, "{family} {flag}: {meter} {m:?}");
            match (reverse, family) {
                (false, _) => {
                    assert!(m["app.rx_gso_total"] > 0, "{family}: the app's kernel sent super-packets: {m:?}");
                    few("term.segments_in_total");
                    if family == "v4" {
                        few("orig.segments_out_total");
                        assert!(m["host.tx_gso_total"] > 0, "{family}: written whole: {m:?}");
                    }
                }
                (true, "v4") => {
                    few("term.segments_out_total");
                    assert!(m["app.tx_gso_total"] > 0, "{family} {flag}: written whole to the app: {m:?}");
                }
                (true, _) => {}
            }
        }
    }
}

/// iperf3 UDP: every datagram sent arrives (the server's count equals the client's), IPv4 and IPv6.
fn iperf3_udp(backend: &str) {
    let Some(_serial) = privileged_serial() else { return };
    let Some(r) = Rig::new(backend, 3, b"small", None) else { return };
    let _iperf = r.srv.ns.spawn(&["iperf3", "-s", "-p", "5202"]);
    wait_listening(&r, 5202);
    // Datagrams that reached the server's host: delivered to a socket, or to none (they came after iperf3 closed
    // it), by the kernel's own counters in the server's namespace.
    let arrived = |v6: bool| {
        let names = if v6 { ["Udp6InDatagrams", "Udp6NoPorts"] } else { ["UdpInDatagrams", "UdpNoPorts"] };
        let out = r.srv.ns.run(&["nstat", "-az", names[0], names[1]]);
        text(&out).lines().filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()).sum::<u64>()
    };
    for addr in [&r.srv.v4, &r.srv.v6] {
        let v6 = addr.contains(':');
        let before = arrived(v6);
        // -w: socket buffers of 2 MB at both ends, so that a busy machine does not make the server's socket drop.
        // 10 Mbit/s: at 20, with other agents loading this machine (load 10), a few datagrams in some runs left the
        // daemon (its meters count all of them out) and never reached the server's host (issue 13 note).
        let script = format!("iperf3 -c {addr} -p 5202 -u -b 10M -l 1200 -t 2 -w 2M -J --get-server-output");
        let meters = [
            "term.udp_flows_total",
            "term.udp_budget_drops_total",
            "term.data_bytes_out_total",
            "orig.data_bytes_in_total",
            "host.drop_queue_full_total",
            "host.tx_packets_total",
            "host.frames_dropped_total",
            "orig.frames_dropped_total",
            "term.frames_dropped_total",
            "streams.frames_dropped_total",
            "sdir.frames_dropped_total",
        ];
        let (out, m) = r.run("iperfu", &script, &meters);
        let t = ok(&out);
        let json: Json = serde_json::from_str(t.split(MARK).next().unwrap()).unwrap_or_else(|e| panic!("{e}: {t}"));
        let sent = json["end"]["sum_sent"]["packets"].as_u64().expect("datagrams sent");
        let received = &json["end"]["sum_received"]; // the server's report
        let counted = received["packets"].as_u64().expect("datagrams the server counted");
        let server = json["server_output_text"].as_str().unwrap_or_default();
        assert!(sent > 2000, "{addr}: {sent} datagrams sent");
        // Every datagram reached the server's host, exactly: iperf3's own count may miss the last few, which can
        // arrive after its end-of-test message (on its TCP control connection, another flow) overtook them.
        let host = arrived(v6) - before;
        // On a shortfall, what the server's kernel says of the rest (socket buffer full, bad checksums) and of the
        // packets its interfaces dropped, to tell where they went.
        let diagnosis = || {
            let udp = r.srv.ns.run(&["nstat", "-az", "Udp*Errors", "Udp6*Errors", "IpInDiscards", "Ip6InDiscards"]);
            let links = r.srv.ns.run(&["ip", "-s", "link"]);
            format!("{}\n{}", text(&udp), text(&links))
        };
        assert!(
            (sent..=sent + 4).contains(&host),
            "{addr}: {sent} sent, {host} arrived at the server's host: {m:?}\n{}",
            diagnosis()
        );
        assert!(sent - counted <= 8, "{addr}: {sent} sent, the server counted {counted}: {received}");
        assert_eq!(received["lost_packets"], 0, "{addr}: no gap in the sequence: {received} {m:?}");
        assert!(server.contains(" 0/"), "{addr}: the server's own count: {server}");
        assert!(m["term.udp_flows_total"] >= 1, "the datagrams were terminated: {m:?}");
        assert_eq!(m["term.udp_budget_drops_total"], 0, "{m:?}");
    }
}

/// dig over UDP and TCP against dnsmasq, IPv4 and IPv6.
fn dig_udp_and_tcp(backend: &str) {
    let Some(r) = Rig::new(backend, 4, b"small", None) else { return };
    let _dns = r.srv.ns.serve_dns(&r.srv.v4, &r.srv.v6);
    wait_listening(&r, 53);
    let q =
        |server: &str, ty: &str, tcp: &str| format!("dig +short +time=3 +tries=1 {tcp} @{server} flexstack.test {ty}");
    let script =
        [q(&r.srv.v4, "A", ""), q(&r.srv.v4, "A", "+tcp"), q(&r.srv.v6, "AAAA", ""), q(&r.srv.v6, "AAAA", "+tcp")]
            .join(" && ");
    let (out, m) = r.run("dig", &script, &["term.udp_flows_total", "term.connections_total"]);
    let t = ok(&out);
    assert_eq!(t.matches("10.1.2.3").count(), 2, "A over UDP and TCP: {t}");
    assert_eq!(t.matches("fd00:1:2::3").count(), 2, "AAAA over UDP and TCP: {t}");
    assert_eq!(m["term.udp_flows_total"], 2, "both UDP queries were terminated: {m:?}");
    assert_eq!(m["term.connections_total"], 2, "both TCP queries were terminated: {m:?}");
}

/// nginx (in the server's namespace) and wrk, with keep-alive and with a new connection per request: no socket
/// errors, every answer 2xx.
fn nginx_wrk(backend: &str) {
    let Some(_serial) = privileged_serial() else { return };
    let Some(r) = Rig::new(backend, 5, b"small", None) else { return };
    let root = r.path("nginx");
    std::fs::create_dir_all(root.join("www")).unwrap();
    std::fs::write(root.join("www/index.html"), pattern(4096)).unwrap();
    let conf = root.join("nginx.conf");
    std::fs::write(
        &conf,
        format!(
            "user root;\nworker_processes 1;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
             events {{ worker_connections 4096; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n  \
             fastcgi_temp_path {d}/fcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n  \
             keepalive_requests 1000000;\n  server {{\n    listen 8081;\n    listen [::]:8081;\n    root {d}/www;\n  }}\n}}\n",
            d = root.display()
        ),
    )
    .unwrap();
    let _nginx = r.srv.ns.spawn(&["nginx", "-c", path_str(&conf), "-e", path_str(&root.join("error.log"))]);
    wait_listening(&r, 8081);
    for (addr, close) in [(r.srv.v4.clone(), false), (r.srv.v4.clone(), true), (format!("[{}]", r.srv.v6), false)] {
        let header = if close { "-H 'Connection: close'" } else { "" };
        let script = format!("wrk -t2 -c16 -d2s {header} http://{addr}:8081/index.html");
        let (out, m) = r.run("wrk", &script, &["term.connections_total", "term.refused_total"]);
        let t = ok(&out);
        assert!(!t.contains("Socket errors"), "{addr} close={close}: no socket errors: {t}");
        assert!(!t.contains("Non-2xx"), "{addr} close={close}: every answer 2xx: {t}");
        let requests: u64 = t
            .lines()
            .find_map(|l| l.split_once(" requests in ").map(|(n, _)| n.trim().parse().unwrap_or(0)))
            .unwrap_or(0);
        assert!(requests > 200, "{addr} close={close}: {requests} requests: {t}");
        if close {
            assert!(m["term.connections_total"] >= requests, "a connection per request, terminated: {m:?} {t}");
        } else {
            assert!(m["term.connections_total"] >= 16, "wrk's connections were terminated: {m:?}");
        }
        assert_eq!(m["term.refused_total"], 0, "{m:?}");
        eprintln!("{backend} {addr} close={close}: {requests} requests in 2 s");
    }
}

/// A static Go binary (no libc resolver, its own TCP use) fetches the file.
fn go_static_binary(backend: &str) {
    let go = Path::new("/usr/local/go/bin/go");
    if !go.exists() {
        let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false");
        assert!(!ci, "go is missing at {}", go.display());
        eprintln!("skipping the Go binary: no go at {}", go.display());
        return;
    }
    let blob = pattern(2_000_000);
    let Some(r) = Rig::new(backend, 6, &blob, None) else { return };
    let src = r.path("go");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("go.mod"), "module fetch\n\ngo 1.20\n").unwrap();
    std::fs::write(
        src.join("main.go"),
        "package main\n\nimport (\n\t\"crypto/sha256\"\n\t\"fmt\"\n\t\"io\"\n\t\"net/http\"\n\t\"os\"\n)\n\n\
         func main() {\n\tfor _, url := range os.Args[1:] {\n\t\tresp, err := http.Get(url)\n\t\tif err != nil {\n\t\t\t\
         fmt.Println(err)\n\t\t\tos.Exit(1)\n\t\t}\n\t\th := sha256.New()\n\t\tif _, err := io.Copy(h, resp.Body); err != nil {\n\t\t\t\
         fmt.Println(err)\n\t\t\tos.Exit(1)\n\t\t}\n\t\tresp.Body.Close()\n\t\tfmt.Printf(\"%x\\n\", h.Sum(nil))\n\t}\n}\n",
    )
    .unwrap();
    let build = std::process::Command::new(go)
        .args(["build", "-o", "fetch", "."])
        .current_dir(&src)
        .env("CGO_ENABLED", "0")
        .env("GOTOOLCHAIN", "local")
        .env("GOFLAGS", "-mod=mod")
        .output()
        .expect("go build");
    assert!(build.status.success(), "go build: {}", text(&build));
    let binary = std::fs::read(src.join("fetch")).expect("the binary");
    assert!(!binary.windows(8).any(|w| w == b"ld-linux"), "statically linked: no dynamic loader named");
    let want = sha256(&r.srv.www.path().join("blob"));
    let script =
        format!("{} http://{}:8080/blob 'http://[{}]:8080/blob'", path_str(&src.join("fetch")), r.srv.v4, r.srv.v6);
    let (out, m) = r.run("go", &script, &["term.connections_total"]);
    let t = ok(&out);
    assert_eq!(t.matches(&want).count(), 2, "both fetches intact: {t}");
    assert_eq!(m["term.connections_total"], 2, "terminated: {m:?}");
}

/// A refused port reaches the app as a refusal, at once (curl exit 7, not a timeout); IPv4 and IPv6.
fn refused_port(backend: &str) {
    let Some(r) = Rig::new(backend, 7, b"small", None) else { return };
    let script = format!(
        "for u in http://{}:9/ 'http://[{}]:9/'; do s=$(date +%s%N); curl -sS -m 10 \"$u\"; echo \"exit $? $(( ($(date +%s%N) - s) / 1000000 )) ms\"; done",
        r.srv.v4, r.srv.v6
    );
    let (out, m) = r.run("refused", &script, &["term.connections_total", "orig.aborts_sent_total"]);
    let t = text(&out);
    let exits: Vec<(i32, u64)> = t
        .lines()
        .filter_map(|l| {
            let mut w = l.strip_prefix("exit ")?.split_whitespace();
            Some((w.next()?.parse().ok()?, w.next()?.parse().ok()?))
        })
        .collect();
    assert_eq!(exits.len(), 2, "{t}");
    for (code, ms) in exits {
        // The kernel back-end has accepted the app's connection before the far side refuses it: a reset, which
        // curl reports as exit 7 while still connecting or 56 once it sent its request (docs/streams.md).
        let expected: &[i32] = if backend == "kernel" { &[7, 56] } else { &[7] };
        assert!(expected.contains(&code), "curl could not connect (refused): exit {code}: {t}");
        assert!(ms < 2000, "refused at once, not after a timeout: {ms} ms: {t}");
    }
    assert!(t.contains("refused"), "curl says refused: {t}");
    assert_eq!(m["term.connections_total"], 2, "{m:?}");
    assert_eq!(m["orig.aborts_sent_total"], 2, "originate told terminate both were refused: {m:?}");
}

/// An address routed into the server's namespace where nothing answers: an error for the app, not a success nor a
/// hang; IPv4 and IPv6.
fn unreachable_address(backend: &str) {
    let Some(r) = Rig::new(backend, 8, b"small", None) else { return };
    let (v4, v6) = (r.srv.v4.replace(".7.2", ".7.99"), r.srv.v6.replace("::2", "::99"));
    let script =
        format!("for u in http://{v4}:8080/ 'http://[{v6}]:8080/'; do curl -sS -m 15 \"$u\"; echo \"exit $?\"; done");
    let t0 = Instant::now();
    let meters =
        ["term.connections_total", "orig.icmp_errors_total", "orig.aborts_sent_total", "orig.connections_active"];
    let (out, m) = r.run("unreach", &script, &meters);
    let t = text(&out);
    let codes: Vec<&str> = t.lines().filter_map(|l| l.strip_prefix("exit ")).collect();
    assert!(t0.elapsed() < Duration::from_secs(25), "the errors came before curl's own timeout");
    // (An app's SYN sent again just as the error comes back may make one more flow, ended by its own error.)
    assert!(m["term.connections_total"] >= 2, "{m:?}");
    if backend == "kernel" {
        // The kernel listener completed the app's handshake: the failed connect reaches the app as a reset (curl:
        // 7 while it confirms its connect, 56 once it sent its request), and originate aborted both flows.
        assert!(codes.len() == 2 && codes.iter().all(|c| ["7", "56"].contains(c)), "reset, no success: {t}");
        assert!(m["orig.aborts_sent_total"] >= 2, "originate aborted both flows: {m:?}");
        assert_eq!(m["orig.connections_active"], 0, "nothing left: {m:?}");
        return;
    }
    assert_eq!(codes, ["7", "7"], "curl could not connect (no route to host), no success: {t}");
    assert!(m["orig.icmp_errors_total"] >= 2, "the host's ICMP errors ended the connections: {m:?}");
}

/// Half-close: the app sends, shuts down its write side and still reads the whole answer.
fn half_close(backend: &str) {
    let Some(r) = Rig::new(backend, 9, b"small", None) else { return };
    let helper = python_helper(r.dir.path());
    let _srv = helper_server(&r, &helper, "halfclose", 7001);
    let script = format!(
        "python3 {h} halfclose {} 7001 && python3 {h} halfclose {} 7001",
        r.srv.v4,
        r.srv.v6,
        h = path_str(&helper)
    );
    let (out, m) = r.run("halfclose", &script, &["term.connections_total"]);
    let t = ok(&out);
    assert_eq!(t.matches("halfclose ok").count(), 2, "{t}");
    assert_eq!(m["term.connections_total"], 2, "{m:?}");
}

/// The server resets the connection mid-transfer: the app sees a reset, not a clean end.
fn server_reset(backend: &str) {
    let Some(r) = Rig::new(backend, 10, b"small", None) else { return };
    let helper = python_helper(r.dir.path());
    let _srv = helper_server(&r, &helper, "rst", 7002);
    let script =
        format!("python3 {h} rst {} 7002 && python3 {h} rst {} 7002", r.srv.v4, r.srv.v6, h = path_str(&helper));
    let (out, m) = r.run("rst", &script, &["term.connections_total", "orig.aborts_sent_total"]);
    let t = ok(&out);
    assert_eq!(t.matches("reset after").count(), 2, "both connections were reset for the app: {t}");
    assert!(!t.contains("eof after"), "{t}");
    assert_eq!(m["term.connections_total"], 2, "{m:?}");
    assert_eq!(m["orig.aborts_sent_total"], 2, "the resets came through originate: {m:?}");
}

/// The app is killed mid-transfer: afterwards, within the timeouts, neither endpoint holds anything of its flow.
fn app_killed(backend: &str) {
    let blob = pattern(4_000_000);
    let Some(r) = Rig::new(backend, 11, &blob, None) else { return };
    let (go, killed) = (r.path("go"), r.path("killed"));
    // The client reads 200 KB and then no more, so that unread data waits in its socket when it is killed and its
    // kernel resets the connection (a socket closed with nothing unread would end it with a FIN instead).
    let reader = "import socket, sys, time\ns = socket.create_connection((sys.argv[1], 8080))\n\
                  s.sendall(b'GET /blob HTTP/1.0\\r\\n\\r\\n')\nn = 0\nwhile n < 200000:\n    \
                  n += len(s.recv(65536))\ntime.sleep(60)";
    let script = format!(
        "python3 -c \"{reader}\" {} & while [ ! -e {go} ]; do sleep 0.05; done; \
         kill -9 $!; touch {killed}; sleep 30",
        r.srv.v4,
        go = path_str(&go),
        killed = path_str(&killed)
    );
    let mut run = r.d.spawn_run(&["--stack", path_str(&r.stack), "--name", "killed", "--", "sh", "-c", &script]);
    let get = |short: &str| -> Option<u64> {
        let out = r.d.cli(&["-j", "get", &meter_name("killed", short)]);
        let j: Json = serde_json::from_slice(&out.stdout).ok()?;
        j[meter_name("killed", short)]["value"].as_u64()
    };
    // The per-flow variables of each endpoint (`flow.killed.term.1.*`, `flow.killed.orig.1.*`).
    let flow_vars = || {
        let out = r.d.cli(&["var", "list"]);
        let list = String::from_utf8_lossy(&out.stdout).to_string();
        let count = |prefix: &str| list.lines().filter(|l| l.starts_with(prefix)).count();
        (count("flow.killed.term."), count("flow.killed.orig."))
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    // Mid-transfer: the flow is held on both sides, with its meters.
    while get("term.data_bytes_in_total").unwrap_or(0) < 100_000 {
        assert!(Instant::now() < deadline, "the transfer did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    // (The kernel back-end registers a new flow's meters at its next meter period, 100 ms.)
    let (mut term_vars, mut orig_vars) = flow_vars();
    while term_vars <= 5 || orig_vars <= 5 {
        assert!(Instant::now() < deadline, "per-flow meters while it runs: {term_vars}, {orig_vars}");
        std::thread::sleep(Duration::from_millis(20));
        (term_vars, orig_vars) = flow_vars();
    }
    std::fs::write(&go, b"").unwrap();
    while !killed.exists() {
        assert!(Instant::now() < deadline, "the script did not kill curl");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(get("term.connections_total"), Some(1), "the transfer was terminated");
    let mut left = (u64::MAX, u64::MAX, (usize::MAX, usize::MAX));
    while Instant::now() < deadline {
        left = (get("term.connections_active").unwrap_or(9), get("orig.connections_active").unwrap_or(9), flow_vars());
        if left == (0, 0, (0, 0)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(left, (0, 0, (0, 0)), "connections and per-flow variables left (terminate, originate)");
    let aborts = get("term.aborts_sent_total").unwrap_or(0);
    assert_eq!(aborts, 1, "the app's reset became an abort");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(run.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    let _ = run.wait();
}

/// The server reads nothing for 3 s (`FLEXSTACK_STALL_SECS`, 30 in the issue: docs/streams.md has a 30 s run; in
/// the suite, its 30 s made other tests flaky under load) while the app sends 128 MiB: the app's send blocks, the daemon's memory stays
/// bounded (the flow's budget and buffers, not the bytes offered), and then every byte arrives intact.
fn stalled_server(backend: &str) {
    let Some(_serial) = privileged_serial() else { return };
    let Some(r) = Rig::new(backend, 14, b"small", None) else { return };
    let helper = python_helper(r.dir.path());
    let secs: u64 = std::env::var("FLEXSTACK_STALL_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let _srv = helper_server(&r, &helper, &format!("stall{secs}"), 7004);
    let rss = || {
        let status = std::fs::read_to_string(format!("/proc/{}/status", r.d.child.id())).unwrap_or_default();
        let kib = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().strip_suffix(" kB"));
        kib.and_then(|v| v.trim().parse::<u64>().ok()).expect("the daemon's VmRSS") * 1024
    };
    let before = rss();
    let script = format!("python3 {} stall {} 7004 {secs}", path_str(&helper), r.srv.v4);
    let mut run = r.d.spawn_run(&["--stack", path_str(&r.stack), "--name", "stall", "--", "sh", "-c", &script]);
    let mut peak = before;
    let deadline = Instant::now() + Duration::from_secs(60 + secs);
    while run.try_wait().expect("try_wait").is_none() {
        assert!(Instant::now() < deadline, "the transfer did not complete");
        peak = peak.max(rss());
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = run.wait_with_output().expect("the run's output");
    let t = ok(&out);
    assert!(t.contains("stall ok"), "every byte arrived after the stall: {t}");
    let during: u64 = t
        .lines()
        .find_map(|l| l.strip_prefix("sent during the stall "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("{t}"));
    let grown = peak.saturating_sub(before);
    eprintln!("{backend}: {during} bytes accepted during the stall; the daemon grew by {} KiB", grown / 1024);
    assert!(during < 48 << 20, "the app's send blocked: {during} of 128 MiB accepted during the stall");
    assert!(grown < 64 << 20, "the daemon's memory stays bounded: it grew by {grown} bytes");
}

/// 1,000 connections open at once, each echoing 1 KB intact.
fn thousand_connections(backend: &str) {
    let Some(_serial) = privileged_serial() else { return };
    let Some(r) = Rig::new(backend, 12, b"small", None) else { return };
    let helper = python_helper(r.dir.path());
    let _srv = helper_server(&r, &helper, "echo", 7003);
    let script = format!("python3 {} many {} 7003 1000", path_str(&helper), r.srv.v4);
    let (out, m) = r.run("many", &script, &["term.connections_total", "term.refused_total"]);
    let t = ok(&out);
    assert!(t.contains("open 1000"), "{t}");
    assert!(t.contains("echoed 1000 of 1000"), "{t}");
    assert_eq!(m["term.connections_total"], 1000, "{m:?}");
    assert_eq!(m["term.refused_total"], 0, "{m:?}");
}

/// In one sandbox at the same time: a flow the match table chooses is terminated, while ping, a raw IP protocol,
/// TCP to a port it does not name and UDP to a port it does not name are forwarded as before.
fn match_table_leaves_the_rest(backend: &str) {
    let blob = pattern(500_000);
    let Some(r) = Rig::new(backend, 13, &blob, Some(r#"["tcp dport 8080", "udp dport 5353"]"#)) else { return };
    let helper = python_helper(r.dir.path());
    let raw = r.path("raw");
    let _raw = r.srv.ns.spawn(&["python3", path_str(&helper), "rawlisten", path_str(&raw)]);
    let _other = r.srv.ns.spawn(&[
        "python3",
        "-m",
        "http.server",
        "8082",
        "--bind",
        "::",
        "--directory",
        path_str(r.srv.www.path()),
    ]);
    let _dns = r.srv.ns.serve_dns(&r.srv.v4, &r.srv.v6);
    wait_listening(&r, 8082);
    wait_listening(&r, 53);
    let want = sha256(&r.srv.www.path().join("blob"));
    let v4 = &r.srv.v4;
    // The terminated download runs while the others happen.
    let script = format!(
        "curl -sSf -m 30 --limit-rate 1m http://{v4}:8080/blob | sha256sum > {t} & \
         ping -c 3 -i 0.2 -W 2 {v4} && curl -sSf -m 10 http://{v4}:8082/blob | sha256sum && \
         dig +short +time=3 +tries=1 @{v4} flexstack.test A && python3 {h} rawsend {v4} && wait $! && cat {t}",
        t = path_str(&r.path("terminated")),
        h = path_str(&helper)
    );
    let meters = [
        "term.rule1_matches_total",
        "term.rule2_matches_total",
        "term.connections_total",
        "term.udp_flows_total",
        "term.passed_total",
        "orig.passed_total",
    ];
    let (out, m) = r.run("mixed", &script, &meters);
    let t = ok(&out);
    assert!(t.contains(" 0% packet loss"), "ping answered: {t}");
    assert_eq!(t.matches(&want).count(), 2, "both downloads intact: {t}");
    assert!(t.contains("10.1.2.3"), "DNS answered: {t}");
    assert_eq!(m["term.rule1_matches_total"], 1, "one flow chosen: {m:?}");
    assert_eq!(m["term.rule2_matches_total"], 0, "DNS (port 53) is not the UDP rule's: {m:?}");
    let got = std::fs::read(&raw).unwrap_or_default();
    assert!(got.ends_with(b"raw protocol 253"), "the raw protocol's packet reached the server: {got:?}");
    assert_eq!(m["term.connections_total"], 1, "only it was terminated (not port 8082): {m:?}");
    assert_eq!(m["term.udp_flows_total"], 0, "no UDP flow was terminated: {m:?}");
    // ping (3), the other download, DNS and the raw packets (5) pass terminate towards the network; all but the raw
    // ones have answers that pass originate towards the app.
    assert!(m["term.passed_total"] > 3 + 5 + 5, "{m:?}");
    assert!(m["orig.passed_total"] > 3 + 5, "{m:?}");
}

// ---------------------------------------------------------------------------------------------------------------
// One test per scenario and back-end
// ---------------------------------------------------------------------------------------------------------------

/// An app started with the plain packet chain (stacks/app-default.toml) gets `terminate`, `originate` and a stream
/// chain added live (`module load`, `link add/del`): a connection opened before keeps working (its packets are
/// of no flow the endpoints know, so they pass), while a new one is terminated and opened again.
fn terminate_added_live(backend: &str) {
    let Some(_serial) = privileged_serial() else { return };
    let blob = pattern(2_000_000);
    let Some(r) = Rig::new(backend, 16, &blob, None) else { return };
    let helper = python_helper(r.dir.path());
    let _srv = helper_server(&r, &helper, "echo", 7003);
    let want = sha256(&r.srv.www.path().join("blob"));
    let (ready, go) = (r.path("ready"), r.path("go"));
    let client = r.path("client.py");
    std::fs::write(
        &client,
        format!(
            r#"import os, socket, subprocess, time
s = socket.create_connection(("{v4}", 7003), timeout=20)
def echo(b):
    s.sendall(b)
    got = b""
    while len(got) < len(b):
        got += s.recv(65536)
    assert got == b, got
echo(b"before" * 1000)
open("{ready}", "w").close()
while not os.path.exists("{go}"):
    time.sleep(0.05)
echo(b"after" * 100000)
print("old connection ok", flush=True)
subprocess.run("curl -sSf -m 30 http://{v4}:8080/blob | sha256sum", shell=True, check=True)
"#,
            v4 = r.srv.v4,
            ready = ready.display(),
            go = go.display()
        ),
    )
    .expect("write client.py");
    let meters = ["term.connections_total", "orig.connections_total", "term.passed_total"];
    let mut args = r.args("live", &format!("python3 {}", path_str(&client)), &meters);
    args[1] = path_str(&repo().join("stacks/app-default.toml")).to_string();
    let mut run = r.d.spawn_run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready.exists() {
        assert!(Instant::now() < deadline && run.try_wait().expect("try_wait").is_none(), "the client did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let edit = |args: &[&str]| {
        let out = r.d.cli(args);
        assert!(out.status.success(), "flexstack {args:?}: {}", text(&out));
    };
    let b = format!("backend=\"{backend}\"");
    edit(&["module", "load", "live-term", "terminate", &b, "app=\"live\"", "vars_prefix=\"flow.live.term\""]);
    edit(&["module", "load", "live-orig", "originate", &b, "vars_prefix=\"flow.live.orig\""]);
    edit(&["module", "load", "live-streams", "stream-pass"]);
    edit(&["module", "load", "live-sdir", "direction"]);
    for l in [
        "live-term[pass] -> live-host",
        "live-term[out] -> live",
        "live-orig[pass] -> live",
        "live-orig[out] -> live-host",
        "live-term[stream] -> live-streams",
        "live-orig[stream] -> live-streams",
        "live-streams -> live-sdir",
        "live-sdir[down] -> live-orig[stream_in]",
        "live-sdir[up] -> live-term[stream_in]",
    ] {
        edit(&["link", "add", l]);
    }
    // The switch: the classified packets go through the endpoints from now on.
    edit(&["link", "del", "live-dir[down] -> live-host"]);
    edit(&["link", "add", "live-dir[down] -> live-term[in]"]);
    edit(&["link", "del", "live-dir[up] -> live"]);
    edit(&["link", "add", "live-dir[up] -> live-orig[in]"]);
    std::fs::write(&go, b"").expect("go");
    let deadline = Instant::now() + Duration::from_secs(60);
    while run.try_wait().expect("try_wait").is_none() {
        assert!(Instant::now() < deadline, "the client did not finish");
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = run.wait_with_output().expect("the run's output");
    let t = ok(&out);
    assert!(t.contains("old connection ok"), "the connection opened before kept working: {t}");
    assert!(t.contains(&want), "the new download is intact: {t}");
    let m = read_meters(&out, "live", &meters);
    assert_eq!(m["term.connections_total"], 1, "only the new connection was terminated: {m:?}");
    assert_eq!(m["orig.connections_total"], 1, "and opened again: {m:?}");
    assert!(m["term.passed_total"] > 0, "the old connection's packets passed: {m:?}");
}

/// A UDP echo server (python3, IPv4 and IPv6 on port 5353) that answers each datagram reversed.
const UDP_ECHO: &str = "import socket
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
s.bind((\"::\", 5353))
while True:
    d, a = s.recvfrom(65536)
    s.sendto(d[::-1], a)";

/// The server role (`role server` rules, applied by `originate`): a python3 http.server inside the sandbox serves a
/// 2 MB file to curl in the host's namespace (a client on the network side of the app's host face, connecting to
/// the app's address), IPv4 and IPv6, intact; `flow list` shows the flow terminated and originated with role server while it
/// runs; the app fetches from the server at the same time (the client role, through the same endpoints); a port the
/// app does not serve refuses the client at once (`originate` held the SYN-ACK until the app's RST came back as
/// `Abort(refused)`); UDP datagrams from the host to an echo server in the sandbox come back exact. The kernel
/// back-end's server role (TCP and UDP, where a port nobody serves resets rather than refuses) is
/// tests/terminate_kernel_e2e.rs.
fn server_role(backend: &str) {
    let blob = pattern(2_000_000);
    let table = r#"["tcp dport 8080,8081 role server", "udp dport 5353 role server", "tcp *", "udp *"]"#;
    let Some(r) = Rig::new(backend, 18, &blob, Some(table)) else { return };
    let www = path_str(r.srv.www.path()).to_string();
    let want = sha256(&r.srv.www.path().join("blob"));
    let (ready, go) = (r.path("ready"), r.path("go"));
    let script = format!(
        "cd {www} && python3 -m http.server 8080 --bind :: >/dev/null 2>&1 & py=$!\n\
         python3 -c '{UDP_ECHO}' & echo=$!\n\
         while ! ss -Htln 'sport = :8080' | grep -q .; do sleep 0.05; done\n\
         touch {ready}\n\
         curl -sSf -m 30 --limit-rate 1m http://{srv}:8080/blob | sha256sum\n\
         while [ ! -e {go} ]; do sleep 0.05; done\n\
         kill $py $echo",
        ready = path_str(&ready),
        go = path_str(&go),
        srv = r.srv.v4,
    );
    let meters = [
        "term.connections_total",
        "orig.connections_total",
        "orig.rule1_matches_total",
        "term.aborts_sent_total",
        "orig.aborts_received_total",
        "orig.rule2_matches_total",
        "orig.udp_flows_total",
        "term.udp_flows_total",
    ];
    let args = r.args("web", &script, &meters);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = r.d.spawn_run(&args);
    let deadline = Instant::now() + Duration::from_secs(15);
    while !ready.exists() {
        assert!(Instant::now() < deadline, "the app's server never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    let app = r.d.apps().expect("app list").into_iter().next().expect("the app");
    // IPv4, slowly (about 4 s), while `flow list` is read; then IPv6 at full speed.
    let fetched = r.path("fetched4");
    let url = format!("http://{}:8080/blob", app.ipv4);
    // From the server's namespace, routed through the host: the sandbox's guard lets the app's answers to
    // connections opened from the network leave through the host's interfaces.
    let ns = r.srv.ns.name.clone();
    let in_ns = ["netns", "exec", ns.as_str(), "curl"];
    let curl = |args: &[&str]| std::process::Command::new("ip").args(in_ns).args(args).output().expect("curl");
    let mut slow = std::process::Command::new("ip")
        .args(in_ns)
        .args(["-sSf", "-m", "30", "--limit-rate", "500k", "-o", path_str(&fetched), &url])
        .spawn()
        .expect("curl");
    // Also the transport meters of originate's side, which sends the file to curl: the window seen and the
    // delivery rate move (the largest of each while it runs).
    // The table's text is checked as read while the flow ran (it may have ended when the loop does).
    let (mut seen, mut cwnd, mut rate, mut says, mut unreadable) = ((false, false), 0, 0, false, String::new());
    let said = |t: &str| t.contains("terminated/server") && t.contains("originated/server");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(seen.0 && seen.1 && cwnd > 1000 && rate > 10_000 && says) && Instant::now() < deadline {
        says = says || said(&text(&r.d.cli(&["flow", "list"])));
        let flows = r.d.flows().unwrap_or_else(|printed| {
            unreadable = printed; // kept for the failure's message
            Vec::new()
        });
        for f in flows.iter().filter(|f| f.tuple.contains(" role server ") && f.dst_port == Some(8080)) {
            let to_app = f.dst.map(|a| a.to_string()) == Some(app.ipv4.clone());
            seen.0 |= to_app && f.handling == Handling::Terminated;
            seen.1 |= to_app && f.handling == Handling::Originated;
            if let (true, Handling::Originated, Some(tcp)) = (to_app, f.handling, &f.tcp) {
                cwnd = cwnd.max(tcp.cwnd.unwrap_or(0));
                rate = rate.max(tcp.delivery_rate.unwrap_or(0));
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut list = text(&r.d.cli(&["flow", "list"]));
    if !(seen.0 && seen.1) {
        // What the endpoints, the direction module and the workers counted, to tell where the flow went.
        for pattern in ["module.web-orig.*", "module.web-term.*", "module.web-dir.*", "worker.*"] {
            list += &text(&r.d.cli(&["get", pattern]));
        }
        list += &format!("\nthe last flow list that did not decode: {unreadable}");
    }
    assert!(seen.0 && seen.1, "flow list shows the flow terminated and originated with role server: {list}");
    assert!(says, "and says so: {list}");
    assert!(cwnd > 1000, "more than a segment seen in flight at once: {cwnd}: {list}");
    assert!(rate > 10_000, "a delivery rate was measured: {rate} B/s: {list}");
    eprintln!("server role: cwnd seen {cwnd} bytes, delivery rate {rate} B/s");
    assert!(slow.wait().expect("curl").success(), "curl from the network fetched the file (IPv4)");
    assert_eq!(sha256(&fetched), want, "IPv4: intact");
    let url6 = format!("http://[{}]:8080/blob", app.ipv6);
    let fetched6 = r.path("fetched6");
    let out = curl(&["-sSf", "-m", "30", "-o", path_str(&fetched6), &url6]);
    assert!(out.status.success(), "IPv6: {}", text(&out));
    assert_eq!(sha256(&fetched6), want, "IPv6: intact");
    // Nobody listens on 8081 in the sandbox: refused (ECONNREFUSED: an RST, no accepted connection), at once.
    for host in [app.ipv4.as_str(), app.ipv6.as_str()] {
        let connect = "import socket, sys, time\nt = time.monotonic()\ntry:\n    \
                       socket.create_connection((sys.argv[1], 8081), timeout=10)\n    print('connected')\n\
                       except OSError as e:\n    print(type(e).__name__, int((time.monotonic() - t) * 1000), 'ms')";
        let out = std::process::Command::new("python3").args(["-c", connect, host]).output().expect("python3");
        let t = text(&out);
        let ms: u64 = t.split_whitespace().nth(1).and_then(|w| w.parse().ok()).unwrap_or(u64::MAX);
        assert!(t.starts_with("ConnectionRefusedError"), "{host}: refused: {t}");
        assert!(ms < 2000, "{host}: at once: {t}");
    }
    // UDP (`udp dport 5353 role server`): 20 datagrams to a python3 echo in the sandbox (it answers each reversed),
    // IPv4 and IPv6: each answer exact.
    for host in [app.ipv4.as_str(), app.ipv6.as_str()] {
        let client = "import socket, sys\nf = socket.AF_INET6 if ':' in sys.argv[1] else socket.AF_INET\n\
                      s = socket.socket(f, socket.SOCK_DGRAM)\ns.settimeout(5)\nok = 0\nfor i in range(20):\n    \
                      m = bytes(j % 256 for j in range(i, i + 100 + 37 * i))\n    s.sendto(m, (sys.argv[1], 5353))\n    \
                      ok += s.recv(65536) == m[::-1]\nprint('echoed', ok)";
        let out = std::process::Command::new("python3").args(["-c", client, host]).output().expect("python3");
        assert!(text(&out).contains("echoed 20"), "{host}: every datagram answered exactly: {}", text(&out));
    }
    std::fs::write(&go, b"").unwrap();
    let out = run.wait_with_output().expect("the run's output");
    let t = ok(&out);
    assert!(t.contains(&want), "the app's own download (client role, at the same time) is intact: {t}");
    let m = read_meters(&out, "web", &meters);
    // One UDP flow per family from the network (the app itself sent no UDP).
    let udp = (m["orig.rule2_matches_total"], m["orig.udp_flows_total"], m["term.udp_flows_total"]);
    assert_eq!(udp, (2, 2, 2), "rule 2 chose two UDP flows, terminated on both ends: {m:?}");
    // Two downloads from the network and two refusals (server role), one download of the app (client role).
    assert_eq!(m["orig.rule1_matches_total"], 4, "the server role's rule chose four connections: {m:?}");
    assert_eq!((m["term.connections_total"], m["orig.connections_total"]), (5, 5), "{m:?}");
    assert_eq!((m["term.aborts_sent_total"], m["orig.aborts_received_total"]), (2, 2), "the refusals: {m:?}");
}

#[test]
fn curl_2mb_smoltcp() {
    curl_2mb("smoltcp")
}

#[test]
fn curl_2mb_kernel() {
    curl_2mb("kernel")
}

#[test]
fn two_apps_at_once_smoltcp() {
    two_apps_at_once("smoltcp")
}

#[test]
fn two_apps_at_once_kernel() {
    two_apps_at_once("kernel")
}

#[test]
fn curl_large_smoltcp() {
    curl_large("smoltcp")
}

#[test]
fn curl_large_kernel() {
    curl_large("kernel")
}

#[test]
fn iperf3_tcp_smoltcp() {
    iperf3_tcp("smoltcp")
}

#[test]
fn iperf3_tcp_kernel() {
    iperf3_tcp("kernel")
}

#[test]
fn iperf3_udp_smoltcp() {
    iperf3_udp("smoltcp")
}

#[test]
fn iperf3_udp_kernel() {
    iperf3_udp("kernel")
}

#[test]
fn dig_udp_and_tcp_smoltcp() {
    dig_udp_and_tcp("smoltcp")
}

#[test]
fn dig_udp_and_tcp_kernel() {
    dig_udp_and_tcp("kernel")
}

#[test]
fn nginx_wrk_smoltcp() {
    nginx_wrk("smoltcp")
}

#[test]
fn nginx_wrk_kernel() {
    nginx_wrk("kernel")
}

#[test]
fn go_static_binary_smoltcp() {
    go_static_binary("smoltcp")
}

#[test]
fn go_static_binary_kernel() {
    go_static_binary("kernel")
}

#[test]
fn refused_port_smoltcp() {
    refused_port("smoltcp")
}

#[test]
fn refused_port_kernel() {
    refused_port("kernel")
}

#[test]
fn unreachable_address_smoltcp() {
    unreachable_address("smoltcp")
}

#[test]
fn unreachable_address_kernel() {
    unreachable_address("kernel")
}

#[test]
fn half_close_smoltcp() {
    half_close("smoltcp")
}

#[test]
fn half_close_kernel() {
    half_close("kernel")
}

#[test]
fn server_reset_smoltcp() {
    server_reset("smoltcp")
}

#[test]
fn server_reset_kernel() {
    server_reset("kernel")
}

#[test]
fn app_killed_smoltcp() {
    app_killed("smoltcp")
}

#[test]
fn app_killed_kernel() {
    app_killed("kernel")
}

#[test]
fn stalled_server_smoltcp() {
    stalled_server("smoltcp")
}

#[test]
fn stalled_server_kernel() {
    stalled_server("kernel")
}

#[test]
fn thousand_connections_smoltcp() {
    thousand_connections("smoltcp")
}

#[test]
fn thousand_connections_kernel() {
    thousand_connections("kernel")
}

#[test]
fn match_table_leaves_the_rest_smoltcp() {
    match_table_leaves_the_rest("smoltcp")
}

#[test]
fn match_table_leaves_the_rest_kernel() {
    match_table_leaves_the_rest("kernel")
}

#[test]
fn terminate_added_live_smoltcp() {
    terminate_added_live("smoltcp");
}

#[test]
fn server_role_smoltcp() {
    server_role("smoltcp");
}

/// Hostile TCP from inside the sandbox, by raw sockets (python3, no library): `flood` sends 20,000 SYNs from
/// spoofed addresses of the sandbox's subnet (their SYN-ACKs reach no socket: half-open connections); `malformed`
/// sends 100 each of five broken segments (bad checksum, a zero-length option, an option past the header, a data
/// offset below 5, a header cut short); `oow` makes one connection by hand from a spoofed address (its SYN-ACK read
/// with an AF_PACKET socket on the sandbox's device), sends 50 segments far outside the window, then an HTTP
/// request inside it, and prints whether the answer came; `zero` connects normally, asks for the 2 MB file and
/// advertises a window of zero for argv[4] seconds (it never reads), then reads it all and prints its size.
const HOSTILE: &str = r#"import socket, struct, random, subprocess, sys, time
dst, port, phase = sys.argv[1], int(sys.argv[2]), sys.argv[3]
route = subprocess.run(["ip", "-o", "route", "get", dst], capture_output=True, text=True).stdout.split()
dev, me = route[route.index("dev") + 1], route[route.index("src") + 1]
net = me.rsplit(".", 1)[0]
SYN, ACK, PSH, FIN, RST = 2, 16, 8, 1, 4

def csum(b):
    if len(b) % 2:
        b += b"\0"
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF

def tcp(src, sport, seq, ack, flags, opts=b"", data=b"", doff=None, bad_sum=False, cut=None, win=65535):
    doff = (20 + len(opts)) // 4 if doff is None else doff
    seg = struct.pack("!HHIIBBHHH", sport, port, seq, ack, doff << 4, flags, win, 0, 0) + opts + data
    pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!BBH", 0, 6, len(seg))
    c = csum(pseudo + seg) ^ (0x5555 if bad_sum else 0)
    seg = seg[:16] + struct.pack("!H", c) + seg[18:]
    seg = seg if cut is None else seg[:cut]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(seg), random.randrange(65536), 0, 64, 6, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))
    return ip[:10] + struct.pack("!H", csum(ip)) + ip[12:] + seg

raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
send = lambda p: raw.sendto(p, (dst, 0))
MSS = b"\x02\x04\x05\xb4"
if phase == "flood":
    for i in range(20000):
        send(tcp(f"{net}.{100 + i % 100}", 1024 + i // 100, random.randrange(1 << 32), 0, SYN, opts=MSS))
        if i % 100 == 99:
            time.sleep(0.01)  # paced: the sandbox's device queue (500 packets) would drop a burst
    print("flood sent", flush=True)
elif phase == "malformed":
    src = f"{net}.99"
    for i in range(100):
        send(tcp(src, 2000 + i, 1, 0, SYN, opts=MSS, bad_sum=True))
        send(tcp(src, 3000 + i, 1, 0, SYN, opts=b"\x02\x00\x00\x00"))
        send(tcp(src, 4000 + i, 1, 0, SYN, opts=b"\x02\x28\x05\xb4"))
        send(tcp(src, 5000 + i, 1, 0, SYN, doff=3))
        send(tcp(src, 6000 + i, 1, 0, SYN | FIN | RST, opts=MSS, cut=12))
    print("malformed sent", flush=True)
elif phase == "oow":
    cap = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0800))
    cap.bind((dev, 0))
    cap.settimeout(5)
    src, sport = f"{net}.250", 40000
    def segment():
        while True:
            p = cap.recv(70000)
            ihl = (p[0] & 15) * 4
            if p[9] != 6 or socket.inet_ntoa(p[16:20]) != src:
                continue
            sp, dp, seq, ack, off, fl = struct.unpack("!HHIIBB", p[ihl:ihl + 14])
            if dp == sport:
                return seq, fl, p[ihl + (off >> 4) * 4:]
    send(tcp(src, sport, 1000, 0, SYN, opts=MSS))
    theirs, fl, _ = segment()
    assert fl & (SYN | ACK) == SYN | ACK, fl
    send(tcp(src, sport, 1001, theirs + 1, ACK))
    for k in range(50):
        send(tcp(src, sport, 1001 + 10**9 + 1000 * k, theirs + 1, ACK | PSH, data=b"X" * 100))
    send(tcp(src, sport, 1001, theirs + 1, ACK | PSH, data=b"GET /blob HTTP/1.0\r\n\r\n"))
    got = b""
    while b"HTTP/1." not in got:
        got += segment()[2]
    print("oow answered", flush=True)
elif phase == "zero":
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((dst, port))
    s.sendall(b"GET /blob HTTP/1.0\r\n\r\n")
    time.sleep(float(sys.argv[4]))
    n = 0
    while (d := s.recv(65536)):
        n += len(d)
    print("zero read", n, flush=True)
"#;

/// Hostile segments from the app (a SYN flood of 20,000 half-open connections, malformed segments, data far outside
/// the window, a receiver whose window stays at zero) while a legitimate download runs: the download is intact,
/// the bad segments are counted, the daemon's memory stays bounded, and the endpoint still serves a connection made
/// among them. The smoltcp back-end: with the kernel one, the app's side of each connection is the kernel of the
/// app's namespace.
fn hostile_input(backend: &str) {
    let Some(_serial) = privileged_serial() else { return };
    let blob = pattern(2_000_000);
    let Some(r) = Rig::new(backend, 17, &blob, None) else { return };
    let want = sha256(&r.srv.www.path().join("blob"));
    let hostile = r.path("hostile.py");
    std::fs::write(&hostile, HOSTILE).expect("write the script");
    let rss = || {
        let status = std::fs::read_to_string(format!("/proc/{}/status", r.d.child.id())).unwrap_or_default();
        let kib = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().strip_suffix(" kB"));
        kib.and_then(|v| v.trim().parse::<u64>().ok()).expect("the daemon's VmRSS") / 1024
    };
    let before = rss();
    let (h, srv) = (path_str(&hostile), &r.srv.v4);
    let script = format!(
        "curl -sS -m 60 --limit-rate 500k http://{srv}:8080/blob | sha256sum & \
         python3 {h} {srv} 8080 flood && python3 {h} {srv} 8080 malformed && python3 {h} {srv} 8080 oow && \
         python3 {h} {srv} 8080 zero 3; rc=$?; wait; [ $rc -eq 0 ]"
    );
    let meters = [
        "term.half_open_evicted_total",
        "term.invalid_syns_total",
        "ip.drop_truncated_transport_total",
        "ip.drop_ttl_exceeded_total",
        "term.connections_total",
        "term.refused_total",
    ];
    let (out, m) = r.run("bad", &script, &meters);
    let after = rss();
    let t = ok(&out);
    eprintln!("hostile input ({backend}): daemon RSS {before} -> {after} MiB; {m:?}\n{t}");
    assert!(t.contains(&want), "the legitimate download is intact: {t}");
    assert!(t.contains("flood sent") && t.contains("malformed sent"), "{t}");
    assert!(t.contains("oow answered"), "a connection among the hostile segments was served: {t}");
    let zero: usize = t.split("zero read ").nth(1).and_then(|r| r.split_whitespace().next()?.parse().ok()).unwrap_or(0);
    assert!(zero > 2_000_000, "the window-zero receiver got all of the file and its headers: {t}");
    // 500 broken SYNs: those with a bad checksum (100, refused by smoltcp) and those cut short (200, by `ip`)
    // at least are counted as such. (smoltcp takes some with odd options as SYNs.)
    assert!(m["term.invalid_syns_total"] + m["ip.drop_truncated_transport_total"] >= 300, "{m:?}");
    // The flood's half-open connections gave way to newer ones (max_half_open, 1,024) instead of filling
    // max_connections: nothing was refused.
    assert!(m["term.half_open_evicted_total"] >= 10_000, "{m:?}");
    assert_eq!(m["term.refused_total"], 0, "{m:?}");
    assert!(after < before + 256, "the daemon's RSS grew from {before} to {after} MiB");
}

#[test]
fn hostile_input_smoltcp() {
    hostile_input("smoltcp")
}
