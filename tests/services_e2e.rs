//! End-to-end: unmodified programs run with `flexstack run --services FILE` (docs/services.md): their flows go
//! through the stream services the file's rules choose, between `terminate` and `originate`, and a flow no service
//! selects is not terminated at all. Real programs: curl against an HTTP server in another namespace, python3 for a
//! client that splits a pattern over two writes. Needs root (skips with a reason outside CI); the file-error test
//! runs anywhere.

mod common;

use common::{bin, certificate, octets, path_str, privileged, text, SandboxDaemon, Server};
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Output;

/// The line the scripts print before the meters they read.
const MARK: &str = "@@meters@@";

/// 2 MB of text lines (compressible, with the line `line 20000: ...` once).
fn blob() -> Vec<u8> {
    let mut v = Vec::with_capacity(2_000_100);
    let mut i = 0u64;
    while v.len() < 2_000_000 {
        let x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
        v.extend_from_slice(format!("line {i}: value {x:x} the quick brown fox\n").as_bytes());
        i += 1;
    }
    v.truncate(2_000_000);
    v
}

/// A server namespace serving [`blob`] on port 8080, a daemon, and a folder for the services files.
struct Rig {
    srv: Server,
    d: SandboxDaemon,
    dir: tempfile::TempDir,
    sum: String,
}

impl Rig {
    /// `None` when the test cannot run here (see `privileged`); `offset` keeps the tests of this file apart.
    fn new(offset: u8) -> Option<Rig> {
        if !privileged() {
            return None;
        }
        let (app_octet, srv_octet) = octets();
        let blob = blob();
        let srv = Server::new(srv_octet.wrapping_add(offset), &blob);
        let d = SandboxDaemon::start(app_octet.wrapping_add(offset));
        let dir = tempfile::tempdir().expect("temp dir");
        let sum = common::sha256(&srv.www.path().join("blob"));
        Some(Rig { srv, d, dir, sum })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes services file `name`.
    fn file(&self, name: &str, body: &str) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, body).expect("write the services file");
        p
    }

    /// Runs `script` (sh) as app `app` with services file `file`; then, still in the sandbox, reads `meters`
    /// (`M.X` is `module.<app>-M.X`).
    fn run(&self, app: &str, file: &Path, script: &str, meters: &[&str]) -> (Output, BTreeMap<String, u64>) {
        let names: Vec<String> = meters.iter().map(|m| format!("module.{app}-{m}")).collect();
        let read =
            format!("echo {MARK}; {} --state-dir {} -j get {}", bin(), path_str(self.d.state.path()), names.join(" "));
        let full = format!("{script}\nrc=$?\n{read}\nexit $rc\n");
        let out = self.d.run(&["--services", path_str(file), "--name", app, "--", "sh", "-c", &full]);
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let mut values = BTreeMap::new();
        if let Some((_, json)) = stdout.split_once(MARK) {
            let parsed: Json = serde_json::from_str(json.trim())
                .unwrap_or_else(|e| panic!("meters are not JSON ({e}): {json}\n{}", text(&out)));
            for (short, name) in meters.iter().zip(&names) {
                let v = parsed[name]["value"].as_u64().unwrap_or_else(|| panic!("{name}: {parsed}"));
                values.insert(short.to_string(), v);
            }
        }
        (out, values)
    }

    /// curl's download of the blob, its sha256 and time: `sum`, then `time` (seconds) on the next line.
    fn curl(&self) -> String {
        self.curl_with("")
    }

    /// [`Rig::curl`] with more options for curl.
    fn curl_with(&self, options: &str) -> String {
        format!(
            "curl -sSf -m 30 {options} -o {out} -w 'time %{{time_total}}\\n' http://{v4}:8080/blob && sha256sum {out}",
            out = path_str(&self.path("got")),
            v4 = self.srv.v4
        )
    }
}

/// Asserts that a run succeeded; returns its stdout and stderr.
fn ok(out: &Output) -> String {
    let t = text(out);
    assert!(out.status.success(), "the program failed ({:?}): {t}", out.status.code());
    t
}

const EVERY_TCP_FLOW: &str = "[[rule]]\nuse = true\ntransport = \"tcp\"\n\n";

#[test]
fn curl_through_null_and_through_compress_then_decompress() {
    let Some(r) = Rig::new(0) else { return };
    // The endpoints' back-end: the host's TCP by default (the app's connection is redirected to a socket, so
    // `terminate` gets none of its segments), smoltcp when the file says so (every segment through it).
    for (backend, line) in [("kernel", ""), ("smoltcp", "backend = \"smoltcp\"\n")] {
        let null = r.file("null.toml", &format!("{line}{EVERY_TCP_FLOW}[[service]]\nkind = \"null\"\n"));
        let meters =
            ["null.bytes_up_total", "null.flows_selected_total", "term.connections_total", "term.segments_in_total"];
        let (out, m) = r.run("web", &null, &r.curl(), &meters);
        let t = ok(&out);
        assert!(t.contains(&r.sum), "the download is intact ({backend}): {t}");
        assert_eq!(m["term.connections_total"], 1, "{backend}: {m:?}");
        assert_eq!(m["null.flows_selected_total"], 1, "{backend}: {m:?}");
        assert!(m["null.bytes_up_total"] > 2_000_000, "the body and headers went through null ({backend}): {m:?}");
        let segments = m["term.segments_in_total"];
        assert_eq!(segments > 0, backend == "smoltcp", "the app's segments reached terminate ({backend}): {m:?}");
    }

    let zip = r.file(
        "zip.toml",
        &format!("{EVERY_TCP_FLOW}[[service]]\nkind = \"compress\"\nlevel = 3\n\n[[service]]\nkind = \"compress\"\nname = \"far\"\nmode = \"decompress\"\n"),
    );
    let meters =
        ["compress.plain_bytes_total", "far.plain_bytes_total", "far.packed_bytes_total", "compress.errors_total"];
    let (out, m) = r.run("web", &zip, &r.curl(), &meters);
    let t = ok(&out);
    assert!(t.contains(&r.sum), "the download is intact through compress and decompress: {t}");
    // The far end compressed the server's bytes coming up; the app's end restored them.
    assert!(m["far.plain_bytes_total"] > 2_000_000, "{m:?}");
    assert!(m["far.packed_bytes_total"] * 3 < m["far.plain_bytes_total"], "the text shrank: {m:?}");
    assert!(m["compress.plain_bytes_total"] > 50, "the request went down compressed: {m:?}");
    assert_eq!(m["compress.errors_total"], 0);
}

#[test]
fn curl_through_inspect_shape_and_record() {
    let Some(r) = Rig::new(1) else { return };
    std::fs::create_dir(r.path("rec")).unwrap();
    const RATE: f64 = 700_000.0;
    const BURST: f64 = 16_384.0;
    let file = r.file(
        "chain.toml",
        &format!(
            "{EVERY_TCP_FLOW}[[service]]\nkind = \"inspect\"\npatterns = [\"count up literal line 20000: \", \"alert down regex GET /blo+b\"]\n\n\
             [[service]]\nkind = \"shape\"\nrate = {RATE}\nburst = {BURST}\n\n[[service]]\nkind = \"record\"\npath = \"rec\"\n"
        ),
    );
    let meters =
        ["inspect.rule1_matches_total", "inspect.alerts_total", "shape.bytes_up_total", "record.flows_recorded_total"];
    let (out, m) = r.run("web", &file, &r.curl(), &meters);
    let t = ok(&out);
    assert!(t.contains(&r.sum), "the download is intact: {t}");
    assert_eq!((m["inspect.rule1_matches_total"], m["inspect.alerts_total"]), (1, 1), "{m:?}");
    assert_eq!(m["record.flows_recorded_total"], 1, "{m:?}");
    // The shaped bytes (body and headers) took what the rate says after the burst: within 5 %.
    let bytes = m["shape.bytes_up_total"] as f64;
    let time: f64 = t
        .lines()
        .find_map(|l| l.strip_prefix("time "))
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("no time: {t}"));
    let expected = (bytes - BURST) / RATE;
    eprintln!("shaped: {bytes} bytes in {time:.3} s; the rate gives {expected:.3} s");
    assert!((time - expected).abs() / expected < 0.05, "took {time:.3} s, the rate gives {expected:.3} s");
    // The recording holds the request and the response, with their times.
    let index = std::fs::read_to_string(r.path("rec/index")).unwrap();
    let flow = index.split_whitespace().nth(1).unwrap_or_else(|| panic!("index: {index}"));
    let up = std::fs::read(r.path(&format!("rec/{flow}.up"))).unwrap();
    assert!(up.ends_with(&blob()), "the recorded response ends with the blob");
    let down = std::fs::read_to_string(r.path(&format!("rec/{flow}.down"))).unwrap();
    assert!(down.starts_with("GET /blob HTTP/1.1\r\n"), "{down}");
    let times = std::fs::read_to_string(r.path(&format!("rec/{flow}.times"))).unwrap();
    let recorded: u64 = times
        .lines()
        .filter(|l| l.contains(" up "))
        .map(|l| l.split(' ').nth(3).unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(recorded, up.len() as u64, "a line per chunk");
    assert!(index.contains(" end fin down "), "{index}");
}

/// A client that sends an HTTP request with `DROP T` in one write and `ABLE` in another 0.5 s later, then reads.
const SPLIT_CLIENT: &str = r#"
import socket, sys, time
s = socket.create_connection((sys.argv[1], 8080), timeout=10)
s.sendall(b"GET /blob HTTP/1.0\r\nX-Query: DROP T")
time.sleep(0.5)
try:
    s.sendall(b"ABLE users\r\n\r\n")
    n = 0
    while b := s.recv(65536):
        n += len(b)
    print(f"eof after {n}")
except ConnectionResetError:
    print("reset")
"#;

#[test]
fn inspect_closes_a_flow_whose_pattern_straddles_two_writes() {
    let Some(r) = Rig::new(2) else { return };
    let py = r.path("split.py");
    std::fs::write(&py, SPLIT_CLIENT).unwrap();
    let file = r.file(
        "fw.toml",
        &format!("{EVERY_TCP_FLOW}[[service]]\nkind = \"inspect\"\npatterns = [\"close down literal DROP TABLE\"]\n"),
    );
    // First an innocent flow through the same file, which must not be closed, then the split one.
    let script = format!("{} && python3 {} {}", r.curl(), path_str(&py), r.srv.v4);
    let meters = ["inspect.closed_total", "inspect.rule1_matches_total", "inspect.bytes_scanned_total"];
    let (out, m) = r.run("fw", &file, &script, &meters);
    let t = ok(&out);
    assert!(t.contains(&r.sum), "the innocent download is intact: {t}");
    assert!(t.contains("reset") || t.contains("eof after 0"), "the split request got no answer: {t}");
    assert_eq!((m["inspect.closed_total"], m["inspect.rule1_matches_total"]), (1, 1), "{m:?}");
}

#[test]
fn a_flow_no_rule_selects_is_not_terminated() {
    let Some(r) = Rig::new(3) else { return };
    let file = r.file(
        "other.toml",
        "[[service]]\nkind = \"null\"\n[[service.rule]]\nuse = true\ntransport = \"tcp\"\nport = \"9000-9099\"\n",
    );
    let meters = ["term.connections_total", "orig.connections_total", "term.passed_total", "null.flows_selected_total"];
    let (out, m) = r.run("web", &file, &r.curl(), &meters);
    let t = ok(&out);
    assert!(t.contains(&r.sum), "the download is intact: {t}");
    assert_eq!(m.len(), meters.len(), "{t}");
    assert_eq!(m["term.connections_total"] + m["orig.connections_total"], 0, "port 8080 is no service's: {m:?}");
    // The handshake, the request and the acks of the download: forwarded as packets.
    assert!(m["term.passed_total"] >= 3, "its packets passed terminate unchanged: {m:?}");
    assert_eq!(m["null.flows_selected_total"], 0);
}

#[test]
fn a_bad_services_file_is_refused_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, "[[rule]]\nuse = true\n\n[[service]]\nkind = \"shape\"\nrate = \"fast\"\n").unwrap();
    let out = std::process::Command::new(bin())
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .args(["run", "--services", path_str(&file), "--", "true"])
        .output()
        .unwrap();
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(t.contains(&format!("{}:6:8: setting `rate` of a shape module", file.display())), "{t}");
    assert!(!dir.path().join("state").exists(), "no daemon was started for a file with errors");
}

#[test]
fn a_shape_replaced_during_a_download_hands_over_what_it_holds() {
    let Some(r) = Rig::new(4) else { return };
    let file = r.file("slow.toml", &format!("{EVERY_TCP_FLOW}[[service]]\nkind = \"shape\"\nrate = 400000\n"));
    // At 400 KB/s the download takes 5 s; after 1 s the module is replaced by one without a limit, state kept.
    let script = format!(
        "{curl} &\nsleep 1\n{bin} --state-dir {state} module replace web-shape shape rate=0 || exit 9\nwait $!",
        curl = r.curl(),
        bin = bin(),
        state = path_str(r.d.state.path())
    );
    let (out, m) = r.run("web", &file, &script, &["shape.held_bytes", "shape.selected_flows_active"]);
    let t = ok(&out);
    assert!(t.contains(&r.sum), "the download is intact across the replacement: {t}");
    let time: f64 = t.lines().find_map(|l| l.strip_prefix("time ")).and_then(|s| s.trim().parse().ok()).unwrap();
    assert!(time < 3.0, "the new module's rate (none) took over: {time} s");
    assert_eq!(m["shape.held_bytes"], 0, "{m:?}");
}

#[test]
fn tls_client_mode_lets_plaintext_curl_reach_openssl_s_server() {
    let Some(r) = Rig::new(5) else { return };
    let (ca, cert, key) = certificate(r.dir.path(), "server", &r.srv.v4);
    let (other, _, _) = certificate(r.dir.path(), "other", &r.srv.v4);
    let _tls = r.srv.ns.spawn(&[
        "openssl",
        "s_server",
        "-quiet",
        "-accept",
        "4433",
        "-cert",
        path_str(&cert),
        "-key",
        path_str(&key),
        "-www",
    ]);
    let ready = (0..100).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(50));
        r.srv.ns.run(&["sh", "-c", "ss -ltn | grep -q ':4433 '"]).status.success()
    });
    assert!(ready, "s_server listens");
    let file = |ca: &Path| {
        format!(
            "[[service]]\nkind = \"tls\"\nca = \"{}\"\n[[service.rule]]\nuse = true\ntransport = \"tcp\"\nport = 4433\n",
            path_str(ca)
        )
    };
    let good = r.file("tls.toml", &file(&ca));
    let script = format!("curl -sS -m 10 http://{}:4433/", r.srv.v4);
    let (out, m) =
        r.run("tls", &good, &script, &["tls.handshakes_total", "tls.failures_total", "term.connections_total"]);
    let t = ok(&out);
    assert!(t.contains("s_server") && t.contains("Cipher is"), "s_server's page, over TLS: {t}");
    assert_eq!((m["tls.handshakes_total"], m["tls.failures_total"]), (1, 0), "{m:?}");
    // A server whose certificate the CA file does not vouch for: the flow fails, and says why.
    let bad = r.file("bad-ca.toml", &file(&other));
    let (out, m) = r.run("tls", &bad, &script, &["tls.handshakes_total", "tls.failures_total"]);
    assert!(!out.status.success(), "curl gets no answer: {}", text(&out));
    assert_eq!((m["tls.handshakes_total"], m["tls.failures_total"]), (0, 1), "{m:?}");
}

/// An HTTP/1.0 server on port 8081 sending the file `argv[1]` in writes of 2 KB, 2 ms apart.
const SLOW_SERVER: &str = r#"
import socket, sys, time
data = open(sys.argv[1], "rb").read()
s = socket.socket(socket.AF_INET6)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::", 8081))
s.listen(8)
while True:
    c, _ = s.accept()
    c.recv(65536)
    c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data))
    for i in range(0, len(data), 2048):
        c.sendall(data[i:i + 2048])
        time.sleep(0.002)
    c.close()
"#;

#[test]
fn a_rule_takes_compress_out_and_puts_it_back_100_times_during_a_download() {
    let Some(r) = Rig::new(6) else { return };
    let zip = r.file(
        "zip.toml",
        &format!("{EVERY_TCP_FLOW}[[service]]\nkind = \"compress\"\nlevel = 1\n\n[[service]]\nkind = \"compress\"\nname = \"far\"\nmode = \"decompress\"\n"),
    );
    // A CRAWLER rule flips the far end's knob each time the rules engine sees new bytes at it (it samples every
    // 5 ms; the server's bytes come up through it, it compresses them) and the app's end follows it; the pulled
    // rules run only when `moved` emits.
    let rules = r.file(
        "flip.rules",
        "moved: get(\"module.web-far.bytes_in_total\")\nmoved -> flip\nmoved -> follow\n\
         flip: set(\"module.web-far.active\", Not(get(\"module.web-far.active\")))\n\
         follow: set(\"module.web-compress.active\", get(\"module.web-far.active\"))\n",
    );
    let cli = format!("{} --state-dir {}", bin(), path_str(r.d.state.path()));
    // The server sends the 2 MB in writes of 2 KB, 2 ms apart (about 2.5 s), so that the flow's bytes come in
    // many chunks and the rule's flips fall between them.
    let _slow = r.srv.ns.spawn(&["python3", "-c", SLOW_SERVER, path_str(&r.srv.www.path().join("blob"))]);
    let url = format!("http://{}:8081/blob", r.srv.v4);
    let ready = (0..100).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(50));
        r.srv.ns.run(&["curl", "-sf", "-m", "5", "-o", "/dev/null", &url]).status.success()
    });
    assert!(ready, "the slow server answers");
    let got = path_str(&r.path("got")).to_string();
    let script = format!(
        "{cli} rules load {rules} || exit 8\n\
         curl -sSf -m 30 -o {got} {url} && sha256sum {got} || exit 7\n\
         {cli} rules unload ALL || exit 9",
        rules = path_str(&rules),
    );
    let meters = [
        "far.switches_total",
        "far.plain_bytes_total",
        "far.packed_bytes_total",
        "far.raw_bytes_total",
        "compress.raw_bytes_total",
        "compress.errors_total",
        "far.errors_total",
    ];
    let (out, m) = r.run("web", &zip, &script, &meters);
    let t = ok(&out);
    assert!(t.contains(&r.sum), "the download is intact across the switches: {t}\n{m:?}");
    eprintln!("switches during the download: {m:?}");
    // Each switch the far end made in the stream is a mark: out of the path, then back in (about 400 here).
    assert!(m["far.switches_total"] >= 200, "compress left and rejoined the path mid-stream: {m:?}");
    assert!(m["far.plain_bytes_total"] > 100_000, "part went compressed: {m:?}");
    assert!(m["far.packed_bytes_total"] * 2 < m["far.plain_bytes_total"], "and shrank: {m:?}");
    assert!(m["far.raw_bytes_total"] > 100_000, "part went as it was: {m:?}");
    assert!(m["compress.raw_bytes_total"] >= m["far.raw_bytes_total"], "the app's end followed the marks: {m:?}");
    assert_eq!(m["compress.errors_total"] + m["far.errors_total"], 0, "{m:?}");
}

#[test]
fn service_commands_list_show_add_and_del_the_services_of_a_running_app() {
    let Some(r) = Rig::new(7) else { return };
    let file = r.file("null.toml", &format!("{EVERY_TCP_FLOW}[[service]]\nkind = \"null\"\n"));
    let cli = format!("{} --state-dir {}", bin(), path_str(r.d.state.path()));
    // The app is this script: it changes its own chain between two downloads, printing what each command said
    // after a line `== STEP`.
    let script = format!(
        "exec 2>&1\n\
         echo '== list'; {cli} service list web\n\
         echo '== add'; {cli} service add web compress level=1 && {cli} service add web compress --name far mode=decompress || exit 3\n\
         echo '== list2'; {cli} -j service list web\n\
         echo '== curl1'; {curl}\n\
         echo '== show'; {cli} service show web far\n\
         sleep 0.5\n\
         echo '== del'; {cli} service del web far && {cli} service del web compress || exit 4\n\
         echo '== last'; {cli} service del web null; echo \"rc $?\"\n\
         echo '== unknown'; {cli} service show web nosuch; {cli} service list nosuch; {cli} service add web counter\n\
         echo '== list3'; {cli} service list web\n\
         echo '== curl2'; {curl}\n\
         echo '== extra'; {cli} service add web null --name extra\n\
         echo '== end'",
        curl = r.curl(),
    );
    let (out, m) = r.run("web", &file, &script, &["null.flows_selected_total"]);
    let t = ok(&out);
    let step = |name: &str| {
        let from = t.find(&format!("== {name}\n")).unwrap_or_else(|| panic!("no step {name}: {t}"));
        let rest = &t[from + name.len() + 4..];
        rest[..rest.find("\n== ").unwrap_or(rest.len())].to_string()
    };
    let list = step("list");
    assert!(list.contains("null") && list.contains("web-null") && !list.contains("compress"), "{list}");
    // Added nearest the network, in order: null, compress, far.
    let list2: Json = serde_json::from_str(
        step("list2").lines().skip_while(|l| !l.starts_with('[')).collect::<Vec<_>>().join("\n").as_str(),
    )
    .unwrap_or_else(|e| panic!("{e}: {t}"));
    let names: Vec<&str> = list2.as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["null", "compress", "far"], "{list2}");
    assert_eq!(list2[1]["active"], true, "{list2}");
    // The download after the add went through both ends of compress, intact.
    assert!(step("curl1").contains(&r.sum), "{t}");
    let show = step("show");
    let plain: u64 = show
        .lines()
        .find(|l| l.starts_with("module.web-far.plain_bytes_total"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or_else(|| panic!("{show}"));
    assert!(plain > 2_000_000, "the server's bytes went through the added far end: {show}");
    assert!(step("last").contains("only service") && step("last").contains("rc 1"), "{t}");
    let unknown = step("unknown");
    assert!(unknown.contains("no service \"nosuch\"; its services: null"), "{unknown}");
    assert!(unknown.contains("no app \"nosuch\"; running apps: web"), "{unknown}");
    assert!(unknown.contains("not a service kind"), "{unknown}");
    let list3 = step("list3");
    assert!(list3.contains("null") && !list3.contains("compress") && !list3.contains("far"), "{list3}");
    assert!(step("curl2").contains(&r.sum), "the chain still carries the flows after the del: {t}");
    assert_eq!(m["null.flows_selected_total"], 2, "both downloads went through null: {m:?}");
    // A service added and never removed goes with the app.
    assert!(step("extra").contains("ok: revision"), "{t}");
    let modules = text(&r.d.cli(&["module", "list"]));
    assert!(!modules.contains("web-"), "the app's modules, the added ones too, are gone: {modules}");
}

/// A TLS client that sends garbage instead of a ClientHello; prints the first byte it gets back (21: an alert
/// record; None: nothing) and `closed` when the connection ends (`reset` too if it was reset).
const GARBAGE_CLIENT: &str = r#"
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(b"GET / HTTP/1.0 this is not a ClientHello\r\n" * 8)
got = b""
try:
    while True:
        b = s.recv(4096)
        if not b:
            break
        got += b
except ConnectionResetError:
    print("reset")
print("first", got[0] if got else None)
print("closed")
"#;

#[test]
fn tls_server_mode_offers_a_plaintext_server_over_tls_and_fails_garbage_per_flow() {
    let Some(r) = Rig::new(8) else { return };
    // The first app of the daemon's subnet 10.A.0.0/16 gets 10.A.1.2: its certificate names that address.
    let ip = format!("10.{}.1.2", octets().0.wrapping_add(8));
    let (ca, cert, key) = certificate(r.dir.path(), "app", &ip);
    let file = r.file(
        "tls-server.toml",
        &format!(
            "[[rule]]\nuse = true\ntransport = \"tcp\"\nport = 8443\nrole = \"server\"\n\n\
             [[service]]\nkind = \"tls\"\nmode = \"server\"\ncert = \"{}\"\nkey = \"{}\"\n",
            path_str(&cert),
            path_str(&key)
        ),
    );
    let (ready, go) = (r.path("ready"), r.path("go"));
    let cli = format!("{} --state-dir {}", bin(), path_str(r.d.state.path()));
    // The app: a plaintext HTTP server on 8443 serving the blob, until told to stop; then the meters.
    let script = format!(
        "cd {www} && python3 -m http.server 8443 --bind :: >/dev/null 2>&1 & py=$!\n\
         while ! ss -Htln 'sport = :8443' | grep -q .; do sleep 0.05; done\n\
         touch {ready}\n\
         while [ ! -e {go} ]; do sleep 0.05; done\n\
         kill $py\n\
         echo {MARK}; {cli} -j get module.web-tls.handshakes_total module.web-tls.failures_total",
        www = path_str(r.srv.www.path()),
        ready = path_str(&ready),
        go = path_str(&go),
    );
    let run = r.d.spawn_run(&["--services", path_str(&file), "--name", "web", "--", "sh", "-c", &script]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while !ready.exists() {
        assert!(std::time::Instant::now() < deadline, "the app's server never listened");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let app = r.d.apps().expect("app list").into_iter().next().expect("the app");
    assert_eq!(app.ipv4, ip, "the address the certificate names");
    let ns = r.srv.ns.name.clone();
    let in_ns = |args: &[&str]| {
        std::process::Command::new("ip").args(["netns", "exec", &ns]).args(args).output().expect("ip netns exec")
    };
    // A slow download over TLS from another namespace, while a client sends garbage: its flow alone fails.
    let got = r.path("got");
    let url = format!("https://{ip}:8443/blob");
    let slow = std::process::Command::new("ip")
        .args(["netns", "exec", &ns, "curl", "-sSf", "-m", "30", "--limit-rate", "1m", "--cacert"])
        .args([path_str(&ca), "-o", path_str(&got), &url])
        .spawn()
        .expect("curl");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let garbage = in_ns(&["python3", "-c", GARBAGE_CLIENT, &ip, "8443"]);
    let g = text(&garbage);
    // tls sends rustls's alert, then closes the connection (FIN): the client reads the alert (never the app's
    // plaintext answer, `first 60`, its `<html>`), then the end of the stream, and no reset.
    assert!(g.contains("first 21") && g.contains("closed") && !g.contains("reset"), "the alert, then the close: {g}");
    let mut slow = slow;
    assert!(slow.wait().expect("curl").success(), "the download over TLS went on");
    assert_eq!(common::sha256(&got), r.sum, "intact");
    // openssl s_client: the certificate checks out against the CA, and the page comes over TLS 1.3.
    let s_client = std::process::Command::new("ip")
        .args(["netns", "exec", &ns, "openssl", "s_client", "-connect", &format!("{ip}:8443"), "-CAfile"])
        .args([path_str(&ca), "-verify_return_error", "-ign_eof"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("openssl");
    let mut s_client = s_client;
    {
        use std::io::Write;
        let mut stdin = s_client.stdin.take().unwrap();
        stdin.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    }
    let o = s_client.wait_with_output().expect("openssl");
    let t = text(&o);
    assert!(t.contains("Verify return code: 0 (ok)") && t.contains("HTTP/1.0 200"), "{t}");
    std::fs::write(&go, "").unwrap();
    let out = run.wait_with_output().expect("the run");
    let t = text(&out);
    let (_, json) = t.split_once(MARK).unwrap_or_else(|| panic!("no meters: {t}"));
    let m: Json = serde_json::from_str(json.trim()).unwrap_or_else(|e| panic!("{e}: {t}"));
    assert_eq!(m["module.web-tls.failures_total"]["value"], 1, "the garbage flow alone failed: {m}");
    assert!(m["module.web-tls.handshakes_total"]["value"].as_u64() >= Some(2), "{m}");
}

/// tcpdump writing what crosses the interfaces of namespace `ns` (those of `filter`) to a file; stopped on drop.
struct Capture {
    _dump: common::Background,
    file: PathBuf,
}

impl Capture {
    fn start(ns: &common::Netns, file: PathBuf, filter: &str) -> Capture {
        let dump =
            ns.spawn(&["tcpdump", "-Z", "root", "-B", "65536", "-i", "any", "-U", "-w", path_str(&file), filter]);
        let started = common::eventually(5, || std::fs::metadata(&file).is_ok_and(|m| m.len() > 0));
        assert!(started, "tcpdump started");
        std::thread::sleep(std::time::Duration::from_millis(200));
        Capture { _dump: dump, file }
    }

    /// Stops the capture; returns what it wrote (pcap).
    fn bytes(self) -> Vec<u8> {
        std::thread::sleep(std::time::Duration::from_millis(500)); // the last packets written
        let file = self.file.clone();
        drop(self);
        std::fs::read(file).expect("the capture")
    }
}

/// True if `needle` occurs in `hay`.
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The text every line of [`blob`] carries.
const MARKER: &[u8] = b"the quick brown fox";

#[test]
fn tls_leaves_no_plaintext_on_the_wire() {
    let Some(r) = Rig::new(9) else { return };
    let (ca, cert, key) = certificate(r.dir.path(), "server", &r.srv.v4);
    // openssl s_server serving the blob's folder over TLS (-WWW), in the server's namespace.
    let serve = format!(
        "cd {} && exec openssl s_server -quiet -accept 4433 -cert {} -key {} -WWW",
        path_str(r.srv.www.path()),
        path_str(&cert),
        path_str(&key)
    );
    let _tls = r.srv.ns.spawn(&["sh", "-c", &serve]);
    assert!(
        common::eventually(5, || r.srv.ns.run(&["sh", "-c", "ss -ltn | grep -q ':4433 '"]).status.success()),
        "s_server listens"
    );
    let file = r.file(
        "tls.toml",
        &format!(
            "[[service]]\nkind = \"tls\"\nca = \"{}\"\n[[service.rule]]\nuse = true\ntransport = \"tcp\"\nport = 4433\n",
            path_str(&ca)
        ),
    );
    let got = path_str(&r.path("got")).to_string();
    let tls_curl = format!("curl -sSf -m 20 -o {got} http://{}:4433/blob && sha256sum {got}", r.srv.v4);
    let cap = Capture::start(&r.srv.ns, r.path("tls.pcap"), "tcp port 4433");
    let (out, m) = r.run("tls", &file, &tls_curl, &["tls.handshakes_total", "tls.tls_bytes_total"]);
    let wire = cap.bytes();
    assert!(ok(&out).contains(&r.sum), "curl's plaintext request, the blob back intact over TLS: {}", text(&out));
    assert_eq!(m["tls.handshakes_total"], 1, "{m:?}");
    // tcpdump may miss some packets on a loaded machine; half the transfer is plenty, as every line of the blob
    // carries the marker.
    assert!(wire.len() > 1_000_000, "the capture holds most of the transfer: {} bytes", wire.len());
    assert!(!contains(&wire, MARKER), "no plaintext of the blob on the wire");
    assert!(!contains(&wire, b"GET /blob"), "nor of the request");
    // The control: the same capture of a plain download (a flow no rule selects) finds the text.
    let cap = Capture::start(&r.srv.ns, r.path("plain.pcap"), "tcp port 8080");
    let (out, m) = r.run("tls", &file, &r.curl(), &["tls.handshakes_total"]);
    let wire = cap.bytes();
    assert!(ok(&out).contains(&r.sum));
    assert_eq!(m["tls.handshakes_total"], 0, "not through tls: {m:?}");
    assert!(contains(&wire, MARKER) && contains(&wire, b"GET /blob"), "the capture sees plaintext when there is some");
}

/// bench/svc_app.c built into `dir` (its server decodes `compress`'s framing).
fn svc_app(dir: &Path) -> PathBuf {
    let bin = dir.join("svc_app");
    let src = common::repo().join("bench/svc_app.c");
    common::sh("cc", &["-O2", "-o", path_str(&bin), path_str(&src), "-lzstd", "-lssl", "-lcrypto"]);
    bin
}

#[test]
fn compress_puts_fewer_bytes_on_the_wire() {
    let Some(r) = Rig::new(10) else { return };
    let app = svc_app(r.dir.path());
    // Servers: 9001 reads plain bytes, 9002 compress's blocks (it restores them and counts the plaintext).
    let _plain = r.srv.ns.spawn(&[path_str(&app), "server", "9001", "plain"]);
    let _zstd = r.srv.ns.spawn(&[path_str(&app), "server", "9002", "zstd"]);
    assert!(
        common::eventually(5, || r
            .srv
            .ns
            .run(&["sh", "-c", "ss -ltn | grep ':900[12] ' | wc -l | grep -q 2"])
            .status
            .success()),
        "the servers listen"
    );
    let file = r.file(
        "zip.toml",
        "[[service]]\nkind = \"compress\"\n[[service.rule]]\nuse = true\ntransport = \"tcp\"\nport = 9002\n\n\
         [[service]]\nkind = \"null\"\n[[service.rule]]\nuse = true\ntransport = \"tcp\"\nport = 9001\n",
    );
    // The same 5 MB of text (5,000 writes of 1 KiB) to each: the client checks the count the server read. What
    // the link carried: the bytes the server's namespace received (its interfaces' counters, exact where a
    // capture may drop packets).
    let mut wire = Vec::new();
    for port in [9001, 9002] {
        let before = rx_bytes(&r.srv.ns);
        let send = format!("{} client {} {port} plain 5000 1024 || exit 7", path_str(&app), r.srv.v4);
        let (out, m) = r.run("zip", &file, &send, &["compress.plain_bytes_total", "null.flows_selected_total"]);
        ok(&out);
        wire.push((rx_bytes(&r.srv.ns) - before, m));
    }
    let ((plain, m_plain), (zip, m_zip)) = (&wire[0], &wire[1]);
    eprintln!("on the wire: {plain} bytes plain, {zip} compressed");
    assert_eq!((m_plain["null.flows_selected_total"], m_plain["compress.plain_bytes_total"]), (1, 0), "{m_plain:?}");
    assert_eq!(m_zip["compress.plain_bytes_total"], 5_120_000, "the 5 MB went through compress: {m_zip:?}");
    assert!(*plain > 5_120_000, "the plain transfer's bytes crossed the link: {plain}");
    assert!(zip * 3 < *plain, "compress puts less than a third of the bytes on the wire: {zip} of {plain}");
}

/// The bytes the interfaces of namespace `ns` (but loopback) received so far.
fn rx_bytes(ns: &common::Netns) -> u64 {
    let o =
        ns.run(&["sh", "-c", "cat /sys/class/net/*/statistics/rx_bytes; cat /sys/class/net/lo/statistics/rx_bytes"]);
    let v: Vec<u64> = String::from_utf8_lossy(&o.stdout).lines().filter_map(|l| l.trim().parse().ok()).collect();
    let (lo, all) = v.split_last().expect("counters");
    all.iter().sum::<u64>() - lo // lo is counted in the glob, and read again after it
}

#[test]
fn iperf3_through_each_service_and_a_chain_gets_every_byte_across() {
    let Some(r) = Rig::new(11) else { return };
    let ports = [5201u16, 5202, 5203, 5204, 5205, 5206, 5207];
    let _servers: Vec<_> = ports.iter().map(|p| r.srv.ns.spawn(&["iperf3", "-s", "-p", &p.to_string()])).collect();
    assert!(
        common::eventually(5, || {
            let o = r.srv.ns.run(&["sh", "-c", "ss -Htln | grep -c ':520[1-7] '"]);
            String::from_utf8_lossy(&o.stdout).trim() == "7"
        }),
        "the iperf3 servers listen"
    );
    std::fs::create_dir(r.path("rec")).expect("the recording's folder");
    // Each service on its own port; 5202 both compress ends; 5206 the chain inspect + shape + record. The servers
    // send (-R): iperf3's receiving server stops counting at the end-of-test message, whatever is still in flight
    // (without flexstack too), so only this way round do its two counts agree exactly. 5207: UDP through null and
    // both compress ends (a datagram is a block).
    let rule = |ports: &str| format!("[[service.rule]]\nuse = true\ntransport = \"tcp\"\nport = \"{ports}\"\n\n");
    let udp = "[[service.rule]]\nuse = true\nport = 5207\n\n";
    let file = r.file(
        "iperf.toml",
        &[
            format!("[[service]]\nkind = \"null\"\n{}{udp}", rule("5201")),
            format!("[[service]]\nkind = \"compress\"\nlevel = 1\n{}{udp}", rule("5202")),
            format!("[[service]]\nkind = \"compress\"\nname = \"far\"\nmode = \"decompress\"\n{}{udp}", rule("5202")),
            format!("[[service]]\nkind = \"inspect\"\npatterns = [\"count literal xyzzy\"]\n{}", rule("5203,5206")),
            format!("[[service]]\nkind = \"shape\"\nrate = 40000000\n{}", rule("5204,5206")),
            format!("[[service]]\nkind = \"record\"\npath = \"rec\"\n{}", rule("5205,5206")),
        ]
        .concat(),
    );
    let json = |p: u16| r.path(&format!("iperf{p}.json"));
    let script: Vec<String> = ports
        .iter()
        .map(|&p| {
            let how = if p == 5207 { "-u -b 20M -n 2M" } else { "-n 8M" };
            format!("iperf3 -c {} -p {p} -R {how} -J > {} || exit 7", r.srv.v4, path_str(&json(p)))
        })
        .collect();
    let meters = [
        "null.bytes_up_total",
        "null.flows_selected_total",
        "far.flows_selected_total",
        "inspect.flows_selected_total",
        "shape.flows_selected_total",
        "record.flows_selected_total",
        "compress.errors_total",
    ];
    let (out, m) = r.run("perf", &file, &script.join("\n"), &meters);
    ok(&out);
    let (mut udp_bytes, mut udp_got, mut null_sent, mut null_got) = (0, 0, 0, 0);
    for p in ports {
        let j: Json = serde_json::from_str(&std::fs::read_to_string(json(p)).unwrap()).unwrap();
        let (sent, received) = (&j["end"]["sum_sent"], &j["end"]["sum_received"]);
        if p == 5207 {
            // Datagrams: the last may still be in flight when the test ends, and UDP may drop one on a loaded host.
            udp_bytes = sent["bytes"].as_u64().unwrap_or(0);
            udp_got = received["bytes"].as_u64().unwrap_or(0);
            assert!(udp_bytes >= 2 << 20, "port {p}: {}", j["end"]);
            assert!(
                udp_got <= udp_bytes && udp_got * 100 >= udp_bytes * 99,
                "port {p}: {udp_got} of {udp_bytes} bytes"
            );
            continue;
        }
        // The sending server checks `-n` after each 128 KiB write, and the receiving client stops counting at the
        // end-of-test message: with the buffers of the kernel back-end (the default) a block more may be written,
        // and bytes still in flight at that message are not counted. So: all 8 MiB asked for arrived, and no more
        // than was sent.
        let (sent, got) = (sent["bytes"].as_u64().unwrap_or(0), received["bytes"].as_u64().unwrap_or(0));
        assert!((8 << 20..=(8 << 20) + (128 << 10)).contains(&sent), "port {p}: {}", j["end"]);
        assert!((8 << 20..=sent).contains(&got), "port {p}: the receiver got {got} of the {sent} bytes sent");
        if p == 5201 {
            (null_sent, null_got) = (sent, got);
        }
    }
    // null passed up at least what the receivers counted, at most what the senders wrote (and iperf3's control
    // connections' few KiB).
    let null = m["null.bytes_up_total"];
    let (least, most) = (null_got + udp_got, null_sent + udp_bytes + 32768);
    assert!((least..=most).contains(&null), "null passed {null} bytes up, the data {least}-{most}");
    // iperf3 opens a control connection and a data connection (TCP or UDP): 2 flows a port.
    assert_eq!(m["null.flows_selected_total"], 4, "{m:?}");
    assert_eq!(m["far.flows_selected_total"], 4, "{m:?}");
    for s in ["inspect", "shape", "record"] {
        assert_eq!(m[&format!("{s}.flows_selected_total")], 4, "{s}: its port and the chain's: {m:?}");
    }
    assert_eq!(m["compress.errors_total"], 0, "{m:?}");
    let recorded: u64 =
        std::fs::read_dir(r.path("rec")).unwrap().filter_map(|e| e.ok()?.metadata().ok()).map(|m| m.len()).sum();
    assert!(recorded > 2 * (8 << 20), "both data flows recorded: {recorded} bytes");
}
