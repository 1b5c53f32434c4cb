//! End-to-end: the `kernel` back-end of `terminate` and `originate` (docs/streams.md, "The kernel back-end").
//! Unmodified programs run in a sandbox whose TCP is redirected (nftables, in the app's namespace) to a listener of
//! the daemon and opened again by the daemon's kernel sockets towards a server in another namespace: curl (2 MB,
//! sha256) and iperf3 both ways, over IPv4 and IPv6; a mix of back-ends (kernel app side, smoltcp network side); UDP
//! with kernel sockets on the network side (dig against dnsmasq, behind either app side); the per-flow `tcp.cc` knob
//! switched while iperf3 runs, seen in `ss -ti`; and the TCP_INFO meters. Needs root (skips with a reason outside
//! CI).

mod common;

use common::{bin, octets, path_str, pattern, privileged, repo, sh, sha256, text, Background, SandboxDaemon, Server};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// stacks/app-terminate.toml with `term` and `orig` as the back-ends of `terminate` and `originate` (in that order
/// in the file) and `matches` as the match table.
fn stack(term: &str, orig: &str, matches: &str) -> String {
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
        std::fs::write(&p, stack(term, orig, matches)).expect("write the stack");
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
            .map(|(_, j)| serde_json::from_str(j.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {j}")))
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
fn curl_2mb_through_kernel_endpoints_both_families() {
    let Some(rig) = Rig::new(0, &pattern(2_000_000)) else { return };
    curl_both_families(&rig, "kernel", "kernel", "kk");
    // The redirect and listener went with the app: nothing is left of the namespace.
    assert!(rig.d.namespaces_left().is_empty(), "{:?}", rig.d.namespaces_left());
}

#[test]
fn curl_2mb_through_a_kernel_app_side_and_a_smoltcp_network_side() {
    let Some(rig) = Rig::new(1, &pattern(2_000_000)) else { return };
    curl_both_families(&rig, "kernel", "smoltcp", "ks");
}

#[test]
fn iperf3_both_directions_both_families_through_kernel_endpoints() {
    let Some(rig) = Rig::new(2, &pattern(1000)) else { return };
    let stack = rig.stack("kernel", "kernel", r#"["tcp *"]"#);
    let (v4, v6) = (&rig.srv.v4, &rig.srv.v6);
    let script = format!(
        // iperf3's server runs one test at a time and may still be finishing the last when the next client comes
        // ("the server is busy"): that client tries again.
        "go() {{ f=$1; shift; for t in 1 2 3 4 5; do iperf3 \"$@\" -J > $f; grep -q 'server is busy' $f || return 0; \
         sleep 0.5; done; }}\nset -e\nfor a in {v4} {v6}; do\n  go {dir}/up-$a.json -c $a -p 5201 -t 1\n  \
         go {dir}/down-$a.json -c $a -p 5201 -t 1 -R\ndone",
        dir = path_str(rig.dir.path())
    );
    let (out, _) = rig.run(&stack, "ki", &script, "module.ki-orig.connections_total");
    assert!(out.status.success(), "{}", text(&out));
    for way in ["up", "down"] {
        for a in [v4, v6] {
            let file = rig.path(&format!("{way}-{a}.json"));
            let j: Json = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
            let bytes = j["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0);
            let rate = j["end"]["sum_received"]["bits_per_second"].as_f64().unwrap_or(0.0);
            eprintln!("iperf3 {way} {a}: {bytes} bytes, {:.2} Gbit/s", rate / 1e9);
            // At least 10 MB in a second: far below what the kernel does, far above a stall.
            assert!(bytes > 10_000_000, "{way} {a}: {bytes} bytes received\n{j}");
        }
    }
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

/// A server that reads until the client's FIN, then answers 300,000 bytes and closes (half-close).
const HALF_CLOSE_SERVER: &str = "import socket,sys
l=socket.socket(socket.AF_INET6); l.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)
l.bind(('::',9000)); l.listen(8)
while True:
    c,_=l.accept(); n=0
    while True:
        b=c.recv(65536)
        if not b: break
        n+=len(b)
    c.sendall(str(n).encode()+b' '+b'y'*300000); c.close()
";

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

#[test]
fn half_close_and_a_refused_port_through_kernel_endpoints() {
    let Some(rig) = Rig::new(5, &pattern(1000)) else { return };
    let (_server, client) = rig.python(HALF_CLOSE_SERVER, HALF_CLOSE_CLIENT);
    let stack = rig.stack("kernel", "kernel", r#"["tcp *"]"#);
    // Half-close both families; then a port where nothing listens.
    let script = format!(
        "python3 {c} {v4} && python3 {c} {v6} && curl -sS -m 5 http://{v4}:9001/; echo curl=$?",
        c = path_str(&client),
        v4 = rig.srv.v4,
        v6 = rig.srv.v6
    );
    let (out, vars) = rig.run(&stack, "kh", &script, "module.kh-*.*");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", text(&out));
    // The server saw the client's 100,000 bytes end (FIN through the chain), and its 300,000 came back.
    assert_eq!(stdout.matches("100000  300007").count() + stdout.matches("100000 300007").count(), 2, "{stdout}");
    // Refused: the kernel listener had accepted the app's connection, so the app sees a reset, not a refused
    // connect: curl, still waiting for its non-blocking connect to be confirmed, reports the reset as a failed
    // connect (7, "Couldn't connect"); had it sent its request already, a failed read (56). The refusal is counted
    // on both sides.
    assert!(stdout.contains("curl=7") || stdout.contains("curl=56"), "{}", text(&out));
    assert!(value(&vars, "module.kh-orig.refused_total") >= 1, "{vars}");
    assert!(value(&vars, "module.kh-term.aborts_received_total") >= 1, "{vars}");
    // No state left: every connection ended on both sides.
    assert_eq!(value(&vars, "module.kh-term.connections_active"), 0, "{vars}");
    assert_eq!(value(&vars, "module.kh-orig.connections_active"), 0, "{vars}");
}

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

#[test]
fn an_app_killed_mid_transfer_leaves_no_connection_behind() {
    // 30 MB: more than the socket buffers on the way can hold (the app's alone may grow to 6 MB), so the transfer
    // is still running when the app dies.
    let Some(rig) = Rig::new(7, &pattern(30_000_000)) else { return };
    let stack = rig.stack("kernel", "kernel", r#"["tcp *"]"#);
    // curl, slowed to 200 KB/s, is killed after a second; the sandbox lives on.
    let script = format!(
        "curl -s --limit-rate 200k -o /dev/null http://{}:8080/blob & sleep 1; kill -9 $!; wait; sleep 1",
        rig.srv.v4
    );
    let (out, vars) = rig.run(&stack, "kk9", &script, "module.kk9-*.*");
    assert!(out.status.code().is_some(), "{}", text(&out));
    assert_eq!(value(&vars, "module.kk9-term.connections_total"), 1, "{vars}");
    // The killed app's socket reset its connection: the abort went to the server, and neither side holds anything.
    assert_eq!(value(&vars, "module.kk9-term.aborts_sent_total"), 1, "{vars}");
    assert_eq!(value(&vars, "module.kk9-orig.aborts_received_total"), 1, "{vars}");
    assert_eq!(value(&vars, "module.kk9-term.connections_active"), 0, "{vars}");
    assert_eq!(value(&vars, "module.kk9-orig.connections_active"), 0, "{vars}");
    assert_eq!(value(&vars, "module.kk9-orig.buffered_bytes"), 0, "{vars}");
}

/// An echo server (asyncio) on port 9003.
const ECHO_SERVER: &str = "import asyncio
async def echo(r, w):
    while True:
        b = await r.read(65536)
        if not b: break
        w.write(b); await w.drain()
    w.close()
async def main():
    s = await asyncio.start_server(echo, None, 9003, backlog=4096)
    async with s: await s.serve_forever()
asyncio.run(main())
";

/// Opens 1,000 connections at once, sends 1 KB on each, checks each echo, then closes them all.
const THOUSAND_CLIENTS: &str = "import asyncio,sys
async def one(i):
    r, w = await asyncio.open_connection(sys.argv[1], 9003)
    msg = bytes([i % 251]) * 1024
    w.write(msg); await w.drain()
    got = await r.readexactly(1024)
    return r, w, got == msg
async def main():
    res = await asyncio.gather(*[one(i) for i in range(1000)])
    print('ok', sum(1 for _, _, good in res if good))
    for _, w, _ in res: w.close()
asyncio.run(main())
";

#[test]
fn a_thousand_concurrent_connections_through_kernel_endpoints() {
    let Some(rig) = Rig::new(8, &pattern(1000)) else { return };
    let (_server, client) = rig.python(ECHO_SERVER, THOUSAND_CLIENTS);
    let stack = rig.stack("kernel", "kernel", r#"["tcp *"]"#);
    let script = format!("python3 {} {} && sleep 1", path_str(&client), rig.srv.v4);
    let (out, vars) = rig.run(&stack, "kt", &script, "module.kt-*.*");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("ok 1000"), "{}", text(&out));
    assert_eq!(value(&vars, "module.kt-term.connections_total"), 1000, "{vars}");
    assert_eq!(value(&vars, "module.kt-orig.connections_total"), 1000, "{vars}");
    assert_eq!(value(&vars, "module.kt-term.refused_total"), 0, "{vars}");
    // All closed again on both sides.
    assert_eq!(value(&vars, "module.kt-term.connections_active"), 0, "{vars}");
    assert_eq!(value(&vars, "module.kt-orig.connections_active"), 0, "{vars}");
}

/// stacks/app-terminate.toml (TCP and UDP terminated) with `backend = "kernel"` on both endpoints and nothing else
/// changed: a stack changes back-end by its setting alone. curl over TCP, dig over UDP.
#[test]
fn the_terminating_template_runs_on_the_kernel_back_end_by_its_setting_alone() {
    let Some(rig) = Rig::new(9, &pattern(2_000_000)) else { return };
    let _dns = rig.srv.ns.serve_dns(&rig.srv.v4, &rig.srv.v6);
    let stack = rig.stack("kernel", "kernel", r#"["tcp *", "udp *"]"#);
    let copy = rig.path("copy");
    let script = format!(
        "curl -sSf -m 20 -o {} http://{v4}:8080/blob && dig +short +tries=2 +time=2 @{v4} flexstack.test A",
        path_str(&copy),
        v4 = rig.srv.v4
    );
    let (out, vars) = rig.run(&stack, "kt2", &script, "module.kt2-*.*");
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(sha256(&copy), sha256(&rig.srv.www.path().join("blob")));
    assert!(String::from_utf8_lossy(&out.stdout).contains("10.1.2.3"), "{}", text(&out));
    assert_eq!(value(&vars, "module.kt2-term.connections_total"), 1, "{vars}");
    assert_eq!(value(&vars, "module.kt2-term.udp_flows_total"), 1, "{vars}");
    assert_eq!(value(&vars, "module.kt2-orig.udp_flows_total"), 1, "{vars}");
}
