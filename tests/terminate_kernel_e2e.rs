//! End-to-end: what is particular to the `kernel` back-end of `terminate` and `originate` (docs/streams.md, "The
//! kernel back-end"); the real-program scenarios run with each back-end in tests/terminate_e2e.rs. Here: a mix of
//! back-ends (kernel app side, smoltcp network side; UDP with kernel sockets on the network side behind either app
//! side, dig against dnsmasq); the per-flow `tcp.cc` knob switched while iperf3 runs, seen in `ss -ti`, and the
//! TCP_INFO meters; a stalled server holding the app at its budget without the daemon spinning. Needs root (skips
//! with a reason outside CI).
mod common;

use common::{bin, octets, path_str, pattern, privileged, sh, sha256, text, Background, SandboxDaemon, Server};
use flexstack_api::ops::{FlowList, Handling};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A server (HTTP on 8080 serving `blob`, iperf3 on 5201, DNS on 53), a daemon, and a stack file.
struct Rig {
    srv: Server,
    d: SandboxDaemon,
    dir: tempfile::TempDir,
    _iperf: Background,
}

impl Rig {
    fn new(offset: u8, blob: &[u8]) -> Option<Rig> {
        if !privileged() {
            return None;
        }
        let (app_octet, srv_octet) = octets();
        // Apart from the subnets of the other stream tests (terminate_e2e uses small offsets).
        let srv = Server::new(srv_octet.wrapping_add(100 + offset), blob);
        let iperf = srv.ns.spawn(&["iperf3", "-s", "-p", "5201"]);
        let d = SandboxDaemon::start(app_octet.wrapping_add(100 + offset));
        let dir = tempfile::tempdir().expect("temp dir");
        Some(Rig { srv, d, dir, _iperf: iperf })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Starts the python server `script` in the server's namespace (stopped when the guard goes), and writes the
    /// python client `client` for the app; returns both.
    fn python(&self, script: &str, client: &str) -> (Background, PathBuf) {
        let server = self.srv.ns.spawn(&["python3", "-c", script]);
        std::thread::sleep(Duration::from_millis(500));
        let path = self.path("client.py");
        std::fs::write(&path, client).expect("write the client");
        (server, path)
    }

    fn stack(&self, term: &str, orig: &str, matches: &str) -> PathBuf {
        let p = self.path(&format!("stack-{term}-{orig}.toml"));
        std::fs::write(&p, common::terminate_stack(term, orig, matches)).expect("write the stack");
        p
    }

    /// Runs `script` (sh) as app `app` behind `stack`, then (still attached) prints the daemon's variables matching
    /// `vars` after a marker; returns the output and those variables.
    fn run(&self, stack: &Path, app: &str, script: &str, vars: &str) -> (std::process::Output, Json) {
        let get = format!("echo @@vars@@; {} --state-dir {} -j get '{vars}'", bin(), path_str(self.d.state.path()));
        let full = format!("{script}\nrc=$?\nsleep 0.3\n{get}\nexit $rc\n");
        let out = self.d.run(&["--stack", path_str(stack), "--name", app, "--", "sh", "-c", &full]);
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let vars = stdout
            .split_once("@@vars@@")
            .map(|(_, j)| {
                serde_json::from_str(j.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {j}\n{}", text(&out)))
            })
            .unwrap_or(Json::Null);
        (out, vars)
    }
}

fn value(vars: &Json, name: &str) -> u64 {
    vars[name]["value"].as_u64().unwrap_or_else(|| panic!("{name} in {vars}"))
}

/// curl of 2 MB over IPv4 and IPv6 through `term`/`orig`; the copies are intact and went through the endpoints.
fn curl_both_families(rig: &Rig, term: &str, orig: &str, app: &str) {
    let stack = rig.stack(term, orig, r#"["tcp *"]"#);
    let (a, b) = (rig.path(&format!("{app}-v4")), rig.path(&format!("{app}-v6")));
    let script = format!(
        "curl -sSf -m 20 -o {} http://{}:8080/blob && curl -sSf -m 20 -o {} 'http://[{}]:8080/blob'",
        path_str(&a),
        rig.srv.v4,
        path_str(&b),
        rig.srv.v6
    );
    let (out, vars) = rig.run(&stack, app, &script, &format!("module.{app}-*.*"));
    assert!(out.status.success(), "{term}/{orig}: {}", text(&out));
    let want = sha256(&rig.srv.www.path().join("blob"));
    assert_eq!(sha256(&a), want, "IPv4 copy");
    assert_eq!(sha256(&b), want, "IPv6 copy");
    // Both connections were terminated and opened again; the server's 2 x 2 MB went up through originate.
    assert!(value(&vars, &format!("module.{app}-term.connections_total")) >= 2, "{vars}");
    assert!(value(&vars, &format!("module.{app}-orig.connections_total")) >= 2, "{vars}");
    assert!(value(&vars, &format!("module.{app}-orig.data_bytes_out_total")) >= 4_000_000, "{vars}");
    assert!(value(&vars, &format!("module.{app}-term.data_bytes_in_total")) >= 4_000_000, "{vars}");
}

#[test]
fn curl_2mb_through_a_kernel_app_side_and_a_smoltcp_network_side() {
    let Some(rig) = Rig::new(1, &pattern(2_000_000)) else { return };
    curl_both_families(&rig, "kernel", "smoltcp", "ks");
}

/// The network-side flows of app `app`: (id, tcp.cc, bytes down) of each TCP flow `originate` holds.
fn orig_flows(rig: &Rig, app: &str) -> Vec<(u64, String, u64)> {
    let out = rig.d.cli(&["-j", "get", &format!("flow.{app}.orig.**")]);
    let j: Json = serde_json::from_slice(&out.stdout).unwrap_or(Json::Null);
    let mut flows = Vec::new();
    let Some(map) = j.as_object() else { return flows };
    let prefix = format!("flow.{app}.orig.");
    for (name, v) in map {
        let Some(id) = name.strip_prefix(&prefix).and_then(|r| r.strip_suffix(".tcp.cc")) else { continue };
        let cc = v["value"].as_str().unwrap_or_default().to_string();
        let down = map.get(&format!("{prefix}{id}.bytes_down_total")).and_then(|v| v["value"].as_u64()).unwrap_or(0);
        flows.push((id.parse().unwrap_or(0), cc, down));
    }
    flows
}

#[test]
fn the_cc_knob_switches_a_running_flow_and_tcp_info_meters_are_plausible() {
    let Some(rig) = Rig::new(3, &pattern(1000)) else { return };
    let stack = rig.stack("kernel", "kernel", r#"["tcp *"]"#);
    let mut app = rig.d.spawn_run(&[
        "--stack",
        path_str(&stack),
        "--name",
        "kc",
        "--",
        "iperf3",
        "-c",
        &rig.srv.v4,
        "-p",
        "5201",
        "-t",
        "4",
    ]);
    // The data connection: the flow that carries the most bytes down (the daemon's socket sends them, so its
    // congestion control is the one that matters).
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut data = None;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        let flows = orig_flows(&rig, "kc");
        if let Some(f) = flows.into_iter().filter(|f| f.2 > 1_000_000).max_by_key(|f| f.2) {
            data = Some(f);
            break;
        }
    }
    let (id, cc, _) = data.expect("a data connection carrying bytes");
    assert_eq!(cc, "cubic", "new connections get the module's `cc`");
    let ss = || sh("ss", &["-tin", "dst", &format!("{}:5201", rig.srv.v4)]);
    assert!(ss().contains("cubic"), "{}", ss());
    let knob = format!("flow.kc.orig.{id}.tcp.cc");
    let set = rig.d.cli(&["set", &knob, "bbr"]);
    assert!(set.status.success(), "{}", text(&set));
    // At once: the socket's congestion control is bbr while the transfer goes on.
    let listing = ss();
    assert!(listing.contains("bbr"), "{listing}");
    let get = |m: &str| {
        let out = rig.d.cli(&["-j", "get", &format!("flow.kc.orig.{id}.{m}")]);
        let j: Json = serde_json::from_slice(&out.stdout).unwrap_or(Json::Null);
        j[format!("flow.kc.orig.{id}.{m}")]["value"].clone()
    };
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(get("tcp.cc"), Json::String("bbr".into()));
    assert_eq!(get("tcp.state"), Json::String("established".into()));
    // The server is a veth away: a round trip of microseconds to a few milliseconds, a window of segments, and
    // a delivery rate of at least 1 MB/s while iperf3 sends.
    let srtt = get("tcp.srtt_us").as_u64().unwrap_or(0);
    assert!((1..200_000).contains(&srtt), "srtt {srtt}");
    assert!(get("tcp.cwnd").as_u64().unwrap_or(0) >= 2, "cwnd {}", get("tcp.cwnd"));
    assert!(get("tcp.delivery_rate").as_u64().unwrap_or(0) > 1_000_000, "rate {}", get("tcp.delivery_rate"));
    // A name the kernel does not offer is refused, and says what it offers.
    let bad = rig.d.cli(&["set", &knob, "nosuchcc"]);
    assert!(!bad.status.success() && text(&bad).contains("offered"), "{}", text(&bad));
    let status = app.wait().expect("iperf3 ends");
    assert!(status.success(), "iperf3 failed");
}

#[test]
fn udp_over_kernel_sockets_on_the_network_side_and_dns() {
    let Some(rig) = Rig::new(4, &pattern(1000)) else { return };
    let _dns = rig.srv.ns.serve_dns(&rig.srv.v4, &rig.srv.v6);
    std::thread::sleep(Duration::from_millis(300));
    let script = format!(
        "dig +short +tries=1 +time=3 @{} flexstack.test A && dig +short +tries=1 +time=3 @{} flexstack.test AAAA \
         && dig +tcp +short +time=3 @{} flexstack.test A",
        rig.srv.v4, rig.srv.v6, rig.srv.v4
    );
    // smoltcp app side; and the kernel's, whose UDP flows stay in the data plane (its TCP is redirected).
    for (term, app) in [("smoltcp", "ku"), ("kernel", "kku")] {
        let stack = rig.stack(term, "kernel", r#"["udp dport 53", "tcp *"]"#);
        let (out, vars) = rig.run(&stack, app, &script, &format!("module.{app}-*.*"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{term}: {}", text(&out));
        assert_eq!(stdout.matches("10.1.2.3").count(), 2, "{term}: {stdout}");
        assert!(stdout.contains("fd00:1:2::3"), "{term}: {stdout}");
        // Two UDP flows terminated on the app side (rule 1) and opened by kernel sockets; the TCP query (rule 2)
        // through both endpoints.
        assert_eq!(value(&vars, &format!("module.{app}-term.rule1_matches_total")), 2, "{term}: {vars}");
        assert_eq!(value(&vars, &format!("module.{app}-term.udp_flows_total")), 2, "{term}: {vars}");
        assert!(value(&vars, &format!("module.{app}-orig.udp_flows_total")) >= 2, "{term}: {vars}");
        assert_eq!(value(&vars, &format!("module.{app}-term.connections_total")), 1, "{term}: {vars}");
        assert!(value(&vars, &format!("module.{app}-orig.connections_total")) >= 1, "{term}: {vars}");
    }
}

/// A client that sends 100,000 bytes, shuts its write side, and still reads the whole answer.
const HALF_CLOSE_CLIENT: &str = "import socket,sys
s=socket.create_connection((sys.argv[1],9000)); s.sendall(b'x'*100000); s.shutdown(socket.SHUT_WR)
d=b''
while True:
    b=s.recv(65536)
    if not b: break
    d+=b
print(d[:7].decode(), len(d))
";

/// A server that accepts, reads nothing for 3 s (its window closes), then reads everything and answers the count.
const STALLED_SERVER: &str = "import socket,time
l=socket.socket(socket.AF_INET6); l.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)
l.bind(('::',9002)); l.listen(8)
c,_=l.accept(); time.sleep(3); n=0
while True:
    b=c.recv(65536)
    if not b: break
    n+=len(b)
c.sendall(str(n).encode()); c.close()
";

/// CPU time (user + system) of process `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let f: Vec<&str> = after.split_whitespace().collect();
    f.get(11).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
}

#[test]
fn a_stalled_server_holds_the_app_at_its_budget_without_spinning() {
    let Some(rig) = Rig::new(6, &pattern(1000)) else { return };
    let big = HALF_CLOSE_CLIENT.replace("9000", "9002").replace("b'x'*100000", "b'x'*20000000").replace("d[:7]", "d");
    let (_server, client) = rig.python(STALLED_SERVER, &big);
    let stack = rig.stack("kernel", "kernel", r#"["tcp *"]"#);
    let app = rig.d.spawn_run(&[
        "--stack",
        path_str(&stack),
        "--name",
        "kst",
        "--",
        "python3",
        path_str(&client),
        &rig.srv.v4,
    ]);
    // Mid-stall: the daemon holds at most the budget between its sockets, and does not spin on the sockets it
    // stopped reading.
    std::thread::sleep(Duration::from_millis(1200));
    let pid = rig.d.child.id();
    let before = cpu_ticks(pid);
    std::thread::sleep(Duration::from_millis(1000));
    let used = cpu_ticks(pid) - before;
    let get = |n: &str| {
        let out = rig.d.cli(&["-j", "get", n]);
        let j: Json = serde_json::from_slice(&out.stdout).unwrap_or(Json::Null);
        j[n]["value"].as_u64().unwrap_or(u64::MAX)
    };
    let (in_flight, buffered) = (get("module.kst-term.in_flight_bytes"), get("module.kst-orig.buffered_bytes"));
    eprintln!("stall: {in_flight} bytes in flight, {buffered} queued, {used} ticks of daemon CPU in 1 s");
    assert!(in_flight <= 262_144, "in flight {in_flight}");
    assert!(buffered <= 262_144, "queued for the stalled server {buffered}");
    assert!(get("module.kst-term.data_bytes_out_total") < 20_000_000, "the stall did not hold the app back");
    // 100 ticks a second: a daemon spinning on a socket would use about 100 here.
    assert!(used < 20, "the daemon used {used} ticks of CPU in 1 s of stall");
    let out = app.wait_with_output().expect("the client ends");
    let stdout = String::from_utf8_lossy(&out.stdout);
    // Every byte arrived: the server counted 20,000,000.
    assert!(out.status.success() && stdout.contains("20000000 8"), "{stdout}");
}

/// An echo server for many connections at once (port 9003).
const ECHO_SERVER: &str = "import asyncio
async def echo(r, w):
    try:
        while (d := await r.read(4096)):
            w.write(d); await w.drain()
    except Exception: pass
    w.close()
async def main():
    s = await asyncio.start_server(echo, host=None, port=9003, backlog=1024)
    async with s: await s.serve_forever()
asyncio.run(main())
";

/// Opens 200 connections one after the other (each echoes one byte or fails within 5 s), keeps those that
/// worked, prints `ok N failed N slowest_failure_s X`, runs `flexstack status` (argv 2 and 3: the binary and the
/// state directory) and prints its exit code, closes them all, then prints `after ok` if a new connection echoes
/// again.
const MANY_CLIENT: &str = "import socket,sys,time
held, failed, slowest = [], 0, 0.0
for i in range(200):
    t = time.monotonic()
    try:
        s = socket.create_connection((sys.argv[1], 9003), timeout=5); s.sendall(b'x')
        if s.recv(1) != b'x': raise OSError('no echo')
        held.append(s)
    except OSError:
        failed += 1; slowest = max(slowest, time.monotonic() - t)
print('ok', len(held), 'failed', failed, 'slowest_failure_s', round(slowest, 2), flush=True)
import subprocess
st = subprocess.run([sys.argv[2], '--state-dir', sys.argv[3], 'status'], capture_output=True)
print('status_while_held', st.returncode, flush=True)
for s in held: s.close()
time.sleep(1)
s = socket.create_connection((sys.argv[1], 9003), timeout=5); s.sendall(b'y')
print('after', 'ok' if s.recv(1) == b'y' else 'bad', flush=True)
";

/// Near the limit of open files (the daemon's lowered to 400 with prlimit; two per kernel-terminated connection,
/// 256 left to the rest of the daemon), new connections are refused at once, the ones held keep working, the
/// control socket still answers, and once they close new ones work again; the refusals are counted.
#[test]
fn out_of_descriptors_new_connections_are_refused_at_once_and_service_returns() {
    let Some(rig) = Rig::new(7, &pattern(1000)) else { return };
    let limit = std::process::Command::new("prlimit")
        .args(["--pid", &rig.d.child.id().to_string(), "--nofile=400:400"])
        .status()
        .expect("prlimit");
    assert!(limit.success(), "prlimit");
    let (_server, client) = rig.python(ECHO_SERVER, MANY_CLIENT);
    let stack = rig.stack("kernel", "kernel", r#"["tcp *"]"#);
    let script = format!("python3 {} {} {} {}", path_str(&client), rig.srv.v4, bin(), path_str(rig.d.state.path()));
    let (out, vars) = rig.run(&stack, "kfd", &script, "module.kfd-*.refused_total");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{}", text(&out));
    let field = |k: &str| -> f64 {
        let words: Vec<&str> = stdout.split_whitespace().collect();
        let i = words.iter().position(|w| *w == k).unwrap_or_else(|| panic!("{k} in {stdout}"));
        words[i + 1].parse().unwrap_or_else(|_| panic!("{k} in {stdout}"))
    };
    let (ok, failed, slowest) = (field("ok"), field("failed"), field("slowest_failure_s"));
    eprintln!("out of descriptors: {ok} held, {failed} refused (slowest refusal {slowest} s), {vars}");
    // (400 - 256) / 2 are held; the rest are refused, each well before the client's 5 s timeout (a connection left
    // in the backlog would take all of it).
    assert!((60.0..=72.0).contains(&ok), "held {ok}: {stdout}");
    assert!(stdout.contains("status_while_held 0"), "the control socket did not answer: {stdout}");
    assert_eq!(ok + failed, 200.0, "{stdout}");
    assert!(slowest < 2.0, "a refusal took {slowest} s: {stdout}");
    assert!(stdout.contains("after ok"), "no service after the held connections closed: {stdout}");
    let refused = value(&vars, "module.kfd-term.refused_total") + value(&vars, "module.kfd-orig.refused_total");
    assert!(refused as f64 >= failed, "refusals counted {refused}, failed {failed}: {vars}");
}

/// The app's side of the server role tests: an HTTP server (its log says who connected), iperf3, a half-close
/// server (reads until the client's FIN, then answers 300,000 bytes and the count it read) and a UDP echo (each
/// datagram back reversed), until `GO` exists.
const SERVER_ROLE_APP: &str = r#"
cd "$WWW" && python3 -m http.server 8080 --bind :: >/dev/null 2>"$LOG" & http=$!
iperf3 -s -p 5201 >/dev/null 2>&1 & iperf=$!
python3 -c '
import socket
l = socket.create_server(("::", 8082), family=socket.AF_INET6, dualstack_ipv6=True)
while True:
    c, _ = l.accept()
    n = 0
    while True:
        b = c.recv(65536)
        if not b:
            break
        n += len(b)
    c.sendall(bytes(300000) + str(n).encode())
    c.close()
' & half=$!
python3 -c '
import socket
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
s.bind(("::", 5353))
while True:
    m, a = s.recvfrom(65536)
    s.sendto(m[::-1], a)
' & echo=$!
while ! ss -Htln "sport = :8082" | grep -q . || ! ss -Htln "sport = :5201" | grep -q . \
    || ! ss -Htln "sport = :8080" | grep -q . || ! ss -Huln "sport = :5353" | grep -q .; do sleep 0.05; done
touch "$READY"
while [ ! -e "$GO" ]; do sleep 0.05; done
kill $http $iperf $half $echo ${more:-}
"#;

/// A client in the server's namespace: connects to the app's port 8081 (nobody listens there) and says what it got;
/// or sends 100,000 bytes to port 8082, shuts its write side and reads the answer (the half-close), or sends 50,000
/// and resets the connection (SO_LINGER 0: the abort; the app's server, reset, ends); or sends 20
/// datagrams to the UDP echo and counts the exact answers.
const SERVER_ROLE_CLIENT: &str = r#"
import socket, sys, time
host, what = sys.argv[1], sys.argv[2]
t = time.monotonic()
if what == "udp":
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    ok = 0
    for i in range(20):
        m = bytes(j % 256 for j in range(i, i + 100 + 37 * i))
        s.sendto(m, (host, 5353))
        ok += s.recv(65536) == m[::-1]
    print("echoed", ok)
    sys.exit(0)
try:
    s = socket.create_connection((host, 8081 if what == "refused" else 8082), timeout=10)
    if what == "refused":
        print("read", len(s.recv(10)), "bytes")
    elif what == "abort":
        s.sendall(bytes(50000))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, bytes(8))
        s.close()
        print("aborted")
    else:
        s.sendall(bytes(100000))
        s.shutdown(socket.SHUT_WR)
        got = b""
        while True:
            b = s.recv(65536)
            if not b:
                break
            got += b
        print("answered", len(got), got[300000:].decode())
except OSError as e:
    print(type(e).__name__, int((time.monotonic() - t) * 1000), "ms")
"#;

/// A run of the server role's app (`SERVER_ROLE_APP`) behind `term`/`orig` with match table `table`, its servers
/// listening.
struct ServerRole<'a> {
    rig: &'a Rig,
    run: std::process::Child,
    go: PathBuf,
    log: PathBuf,
    app: flexstack_api::ops::AppInfo,
    /// sha256 of the server's blob (what the app downloads, and the clients from the app).
    want: String,
    client: PathBuf,
}

impl<'a> ServerRole<'a> {
    /// Starts app `name` (which also downloads the server's blob, the client role, once its servers listen).
    fn start(rig: &'a Rig, term: &str, orig: &str, table: &str, name: &str) -> ServerRole<'a> {
        Self::start_with(rig, term, orig, table, name, "")
    }

    /// [`ServerRole::start`], the app running the shell lines `more` first (servers of its own, listening when
    /// they end; their process ids in `$more`, stopped with the others).
    fn start_with(rig: &'a Rig, term: &str, orig: &str, table: &str, name: &str, more: &str) -> ServerRole<'a> {
        let stack = rig.stack(term, orig, table);
        let (ready, go, log) = (rig.path("ready"), rig.path("go"), rig.path("http.log"));
        let script = format!(
            "WWW={www} LOG={log} READY={ready} GO={go}\n{more}\n{SERVER_ROLE_APP}\n\
             curl -sSf -m 20 http://{srv}:8080/blob | sha256sum",
            www = path_str(rig.srv.www.path()),
            log = path_str(&log),
            ready = path_str(&ready),
            go = path_str(&go),
            srv = rig.srv.v4,
        );
        let get =
            format!("echo @@vars@@; {} --state-dir {} -j get 'module.{name}-*.*'", bin(), path_str(rig.d.state.path()));
        let full = format!("{script}\nrc=$?\nsleep 0.5\n{get}\nexit $rc\n");
        let run = rig.d.spawn_run(&["--stack", path_str(&stack), "--name", name, "--", "sh", "-c", &full]);
        let deadline = Instant::now() + Duration::from_secs(15);
        while !ready.exists() {
            assert!(Instant::now() < deadline, "the app's servers never listened");
            std::thread::sleep(Duration::from_millis(50));
        }
        let app = rig.d.apps().expect("app list").into_iter().next().expect("the app");
        let want = sha256(&rig.srv.www.path().join("blob"));
        let client = rig.path("client.py");
        std::fs::write(&client, SERVER_ROLE_CLIENT).expect("write the client");
        ServerRole { rig, run, go, log, app, want, client }
    }

    /// `program` with `args` in the server's namespace (the network's client).
    fn in_ns(&self, program: &str, args: &[&str]) -> std::process::Command {
        let mut c = std::process::Command::new("ip");
        c.args(["netns", "exec", self.rig.srv.ns.name.as_str(), program]).args(args);
        c
    }

    /// `SERVER_ROLE_CLIENT` doing `what` towards the app's `host`; what it printed.
    fn client(&self, host: &str, what: &str) -> String {
        text(&self.in_ns("python3", &[path_str(&self.client), host, what]).output().expect("python3"))
    }

    /// curl of the blob from the app's `host` (an IPv4 or IPv6 address), intact.
    fn curl(&self, host: &str, file: &str) {
        let fetched = self.rig.path(file);
        let url =
            if host.contains(':') { format!("http://[{host}]:8080/blob") } else { format!("http://{host}:8080/blob") };
        let out = self.in_ns("curl", &["-sSf", "-m", "30", "-o", path_str(&fetched), &url]).output().expect("curl");
        assert!(out.status.success(), "{host}: {}", text(&out));
        assert_eq!(sha256(&fetched), self.want, "{host}: intact");
    }

    /// The app's server saw the clients' own addresses (transparent sockets), not the daemon's.
    fn saw_the_clients(&self) {
        let http_log = std::fs::read_to_string(&self.log).unwrap_or_default();
        for client in [&self.rig.srv.v4, &self.rig.srv.v6] {
            assert!(http_log.lines().any(|l| l.contains(client.as_str())), "{client} in the server's log: {http_log}");
        }
    }

    /// Lets the app end; asserts its own download was intact; returns its modules' meters.
    fn finish(self) -> Json {
        std::fs::write(&self.go, b"").unwrap();
        let out = self.run.wait_with_output().expect("the run's output");
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success() && stdout.contains(&self.want), "the app's own download: {}", text(&out));
        stdout
            .split_once("@@vars@@")
            .map(|(_, j)| serde_json::from_str(j.trim()).unwrap_or(Json::Null))
            .unwrap_or(Json::Null)
    }
}

/// The server role with the kernel back-ends on both sides (docs/streams.md, "The kernel back-end"): servers in
/// the sandbox reached from the server's namespace (routed through the host). curl of 4 MB over IPv4 (slowly, while
/// `flow list` shows the flow terminated and originated by the kernel back-end with role server) and IPv6, intact;
/// the app's server logs the client's own addresses; iperf3 TCP both directions (IPv4, IPv6); a port where nothing
/// listens resets the client's connection at once; a half-close (100 KB, FIN, then 300 KB back); the client's abort
/// reaches the app; the app's own download (the client role) through the same endpoints; at the end no connection
/// left on either endpoint.
#[test]
fn server_role_with_kernel_back_ends() {
    let Some(rig) = Rig::new(9, &pattern(4_000_000)) else { return };
    let r = ServerRole::start(&rig, "kernel", "kernel", r#"["tcp dport 8080-8082,5201 role server", "tcp *"]"#, "ksrv");
    // IPv4, about 4 s, while `flow list` is read (under load, a read may take a while).
    let fetched = rig.path("fetched4");
    let url = format!("http://{}:8080/blob", r.app.ipv4);
    let mut slow = r
        .in_ns("curl", &["-sSf", "-m", "30", "--limit-rate", "1m", "-o", path_str(&fetched), &url])
        .spawn()
        .expect("curl");
    let (mut term, mut orig, mut unreadable) = (None, None, String::new());
    let deadline = Instant::now() + Duration::from_secs(10);
    while (term.is_none() || orig.is_none()) && Instant::now() < deadline {
        let flows = rig.d.flows().unwrap_or_else(|printed| {
            unreadable = printed; // kept for the failure's message
            Vec::new()
        });
        for f in flows.into_iter().filter(|f| f.tuple.ends_with(" server") && f.dst_port == Some(8080)) {
            let kernel = f.backend.as_deref() == Some("kernel");
            match f.handling {
                Handling::Terminated if kernel => term = Some(f),
                Handling::Originated if kernel => orig = Some(f),
                _ => {}
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut list = text(&rig.d.cli(&["flow", "list"]));
    if term.is_none() || orig.is_none() {
        let _ = slow.kill();
        let forwarding = std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward").unwrap_or_default();
        list += &format!("\ncurl: {:?}; the host's ip_forward: {}", slow.wait(), forwarding.trim());
        list += &format!("\nthe last flow list that did not decode: {unreadable}");
    }
    let (term, orig) = (term.expect(&list), orig.expect(&list));
    for f in [&term, &orig] {
        assert_eq!(f.dst.map(|a| a.to_string()), Some(r.app.ipv4.clone()), "to the app: {list}");
        assert_eq!(f.src.map(|a| a.to_string()), Some(rig.srv.v4.clone()), "from the client: {list}");
    }
    assert!(orig.tcp.as_ref().and_then(|t| t.cwnd).unwrap_or(0) > 0, "TCP_INFO of the network side: {list}");
    assert!(slow.wait().expect("curl").success(), "curl from the network (IPv4)");
    assert_eq!(sha256(&fetched), r.want, "IPv4: intact");
    r.curl(&r.app.ipv6, "fetched6");
    r.saw_the_clients();
    // iperf3 TCP, both directions, IPv4 and IPv6.
    for (host, reverse) in [(&r.app.ipv4, false), (&r.app.ipv4, true), (&r.app.ipv6, false), (&r.app.ipv6, true)] {
        let mut args = vec!["-c", host.as_str(), "-p", "5201", "-t", "2", "-J"];
        if reverse {
            args.push("-R");
        }
        let out = common::iperf3_client(|| r.in_ns("iperf3", &args));
        let j: Json = serde_json::from_slice(&out.stdout).unwrap_or(Json::Null);
        let bytes = j["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0);
        assert!(out.status.success() && bytes > 1_000_000, "iperf3 {host} -R {reverse}: {bytes} B: {}", text(&out));
        eprintln!("server role, iperf3 to {host} reverse {reverse}: {bytes} bytes in 2 s");
    }
    for host in [&r.app.ipv4, &r.app.ipv6] {
        // Nobody listens on 8081: the kernel accepted the client's connection, so it is reset (not refused).
        let t = r.client(host, "refused");
        let ms: u64 = t.split_whitespace().nth(1).and_then(|w| w.parse().ok()).unwrap_or(u64::MAX);
        assert!(t.starts_with("ConnectionResetError") && ms < 2000, "{host}: reset at once: {t}");
        let t = r.client(host, "half");
        assert!(t.contains("answered 300006 100000"), "{host}: half-close: {t}");
    }
    // The client aborts (RST) while the app still reads: the abort crosses both endpoints, and the app's
    // connection is reset too (were it not, it would be left open: `connections_active` below).
    assert_eq!(r.client(&r.app.ipv4, "abort").trim(), "aborted");
    let vars = r.finish();
    assert!(value(&vars, "module.ksrv-term.aborts_received_total") >= 1, "the client's abort: {vars}");
    // Two downloads, 4 x 2 iperf3 connections (control and data), two resets and two half-closes from the network;
    // one download of the app's own.
    assert!(value(&vars, "module.ksrv-orig.connections_total") >= 15, "through originate: {vars}");
    assert_eq!(value(&vars, "module.ksrv-term.refused_total"), 2, "the two refusals: {vars}");
    assert_eq!(value(&vars, "module.ksrv-term.connections_active"), 0, "nothing left: {vars}");
    assert_eq!(value(&vars, "module.ksrv-orig.connections_active"), 0, "nothing left: {vars}");
}

/// The server role with a smoltcp network side and a kernel app side: the smoltcp `originate` holds the client's
/// SYN-ACK, so a port where nothing listens is refused (not reset); the kernel `terminate` opens the connections
/// and the UDP flows into the sandbox from the clients' own addresses (transparent TCP and UDP sockets). curl of
/// 4 MB over IPv4 and IPv6, intact; the app's server logs the clients' addresses; 20 datagrams each way to a UDP
/// echo in the sandbox come back exact (IPv4, IPv6); nothing left afterwards.
#[test]
fn server_role_with_a_smoltcp_network_side_and_a_kernel_app_side() {
    let Some(rig) = Rig::new(11, &pattern(4_000_000)) else { return };
    let table = r#"["tcp dport 8080,8081 role server", "udp dport 5353 role server", "tcp *"]"#;
    let r = ServerRole::start(&rig, "kernel", "smoltcp", table, "kmix");
    for (host, file) in [(&r.app.ipv4, "fetched4"), (&r.app.ipv6, "fetched6")] {
        r.curl(host, file);
        let t = r.client(host, "refused");
        assert!(t.starts_with("ConnectionRefusedError"), "{host}: refused: {t}");
        let t = r.client(host, "udp");
        assert!(t.contains("echoed 20"), "{host}: every datagram answered exactly: {t}");
    }
    r.saw_the_clients();
    let vars = r.finish();
    assert_eq!(value(&vars, "module.kmix-term.refused_total"), 2, "the two refusals: {vars}");
    assert!(value(&vars, "module.kmix-term.udp_flows_total") >= 2, "two UDP flows into the sandbox: {vars}");
    assert_eq!(value(&vars, "module.kmix-term.connections_active"), 0, "nothing left: {vars}");
}

/// dnsmasq in the sandbox (port 53, every address), answering flexstack.test as the server's does.
const DNS_IN_THE_APP: &str = r#"
dnsmasq --no-daemon --no-resolv --no-hosts --port=53 --pid-file= --address=/flexstack.test/10.1.2.3 \
    --address=/flexstack.test/fd00:1:2::3 2>/dev/null & more=$!
while ! ss -Huln "sport = :53" | grep -q .; do sleep 0.05; done
"#;

/// UDP in the server role with the kernel back-ends (docs/streams.md, "The kernel back-end", "The server role"):
/// datagrams from the server's namespace (routed through the host) to servers in the sandbox are taken by
/// `originate`'s TPROXY rule and socket in the daemon's namespace and delivered by `terminate`'s transparent
/// sockets from the clients' own addresses. dig against dnsmasq in the sandbox (IPv4 A, IPv6 AAAA), while
/// `flow list` shows both flows terminated and originated by the kernel back-end from the clients' addresses; 20
/// datagrams each way to a UDP echo come back exact (IPv4, IPv6); iperf3 UDP (its control connection the TCP server
/// role's) with exact datagram counts into the sandbox, the server seeing the client's address; nothing left of the
/// TCP connections afterwards.
#[test]
fn udp_server_role_with_kernel_back_ends() {
    let Some(rig) = Rig::new(13, &pattern(1000)) else { return };
    let table = r#"["udp dport 53,5201,5353 role server", "tcp dport 5201 role server", "tcp *"]"#;
    let r = ServerRole::start_with(&rig, "kernel", "kernel", table, "kudp", DNS_IN_THE_APP);
    let clients = [&rig.srv.v4, &rig.srv.v6];
    for (host, (kind, answer)) in
        [&r.app.ipv4, &r.app.ipv6].into_iter().zip([("A", "10.1.2.3"), ("AAAA", "fd00:1:2::3")])
    {
        let at = format!("@{host}");
        let out =
            r.in_ns("dig", &["+short", "+tries=1", "+time=3", &at, "flexstack.test", kind]).output().expect("dig");
        assert!(out.status.success() && text(&out).contains(answer), "dig {host} {kind}: {}", text(&out));
    }
    // Both DNS flows (they live until udp_timeout_ms) on both endpoints, kernel sockets, from the clients (a kernel
    // endpoint registers a new flow's meters within its meter period, 100 ms).
    let dns = |flows: &[flexstack_api::ops::FlowInfo], handling: Handling| -> Vec<flexstack_api::ops::FlowInfo> {
        flows
            .iter()
            .filter(|f| f.protocol == "udp" && f.dst_port == Some(53) && f.tuple.ends_with(" server"))
            .filter(|f| f.handling == handling && f.backend.as_deref() == Some("kernel"))
            .cloned()
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut flows = Vec::new();
    while Instant::now() < deadline {
        flows = common::answer::<FlowList>(&rig.d.cli(&["-j", "flow", "list"])).expect("flow list");
        if [Handling::Terminated, Handling::Originated].iter().all(|h| dns(&flows, *h).len() == 2) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let list = text(&rig.d.cli(&["flow", "list"]));
    for handling in [Handling::Terminated, Handling::Originated] {
        let dns = dns(&flows, handling);
        assert_eq!(dns.len(), 2, "{handling:?}: the two DNS flows: {list}");
        for client in clients {
            assert!(dns.iter().any(|f| f.src.map(|a| a.to_string()).as_ref() == Some(client)), "{client}: {list}");
        }
    }
    for host in [&r.app.ipv4, &r.app.ipv6] {
        let t = r.client(host, "udp");
        assert!(t.contains("echoed 20"), "{host}: every datagram answered exactly: {t}");
    }
    // iperf3 UDP into the sandbox: datagrams that reached the app's namespace (delivered to a socket or to none,
    // by its kernel's counters) are exactly those sent.
    let arrived = |v6: bool| {
        let names = if v6 { ["Udp6InDatagrams", "Udp6NoPorts"] } else { ["UdpInDatagrams", "UdpNoPorts"] };
        let out = sh("ip", &["netns", "exec", &r.app.netns, "nstat", "-az", names[0], names[1]]);
        out.lines().filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()).sum::<u64>()
    };
    for (host, client) in [&r.app.ipv4, &r.app.ipv6].into_iter().zip(clients) {
        let v6 = host.contains(':');
        let before = arrived(v6);
        let args = ["-c", host, "-p", "5201", "-u", "-b", "10M", "-l", "1200", "-t", "2", "-w", "2M", "-J"];
        let out = common::iperf3_client(|| {
            let mut c = r.in_ns("iperf3", &args);
            c.arg("--get-server-output");
            c
        });
        let json: Json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out)));
        let sent = json["end"]["sum_sent"]["packets"].as_u64().unwrap_or(0);
        let received = &json["end"]["sum_received"];
        let counted = received["packets"].as_u64().unwrap_or(0);
        let sandbox = arrived(v6) - before;
        assert!(sent > 1000, "{host}: {sent} datagrams sent: {}", text(&out));
        // iperf3's own count may miss the last few (its end message, on the TCP control connection, can overtake
        // them); the sandbox's kernel saw every one.
        if !(sent..=sent + 4).contains(&sandbox) {
            // Where they went: the endpoints' counted drops.
            let drops: Vec<String> = ["kudp-orig", "kudp-term"]
                .iter()
                .flat_map(|m| ["udp_socket_drops_total", "udp_budget_drops_total"].map(|v| format!("module.{m}.{v}")))
                .map(|var| text(&rig.d.cli(&["get", &var])).lines().last().unwrap_or_default().to_string())
                .collect();
            let runtime = text(&rig.d.cli(&["show", "runtime"]));
            panic!("{host}: {sent} sent, {sandbox} reached the sandbox; {drops:?}\n{runtime}");
        }
        assert!(sent - counted <= 8, "{host}: {sent} sent, the server counted {counted}: {received}");
        assert_eq!(received["lost_packets"], 0, "{host}: no gap in the sequence: {received}");
        let server = json["server_output_text"].as_str().unwrap_or_default();
        assert!(server.contains(&format!("connected to {client}")), "{host}: the client's own address: {server}");
    }
    let vars = r.finish();
    // Two DNS queries, two echoes, two iperf3 data flows: six UDP flows chosen by rule 1, on both endpoints.
    assert!(value(&vars, "module.kudp-orig.rule1_matches_total") >= 6, "{vars}");
    assert!(value(&vars, "module.kudp-orig.udp_flows_total") >= 6, "{vars}");
    assert!(value(&vars, "module.kudp-term.udp_flows_total") >= 6, "{vars}");
    assert_eq!(value(&vars, "module.kudp-term.connections_active"), 0, "nothing left: {vars}");
    assert_eq!(value(&vars, "module.kudp-orig.connections_active"), 0, "nothing left: {vars}");
}
