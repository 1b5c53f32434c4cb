//! End-to-end: stream services between two flexstack peers (docs/services.md, "Services between two peers"). The
//! app on daemon A runs with `flexstack run --stack stacks/app-peer.toml --services FILE`: its flows go through the
//! file's services and then to peer B over the carrier; B's stack puts the matching services after its carrier
//! (`compress` in `mode = "decompress"`, `tls` as the server of A's TLS client), and B opens the flows towards a
//! server only B reaches. curl downloads a compressible file: it arrives intact; through `compress` the bytes on the
//! link between the peers shrink (the veth counters) against the same download carried without services; through
//! `tls` both ends complete a handshake and carry the file as TLS records. Needs root (skips with a reason outside
//! CI).
//!
//! The rig is a minimal copy of tests/peer_e2e.rs's; it should share that rig once it lives in tests/common.

mod common;

use common::{
    certificate, octets, path_str, privileged, repo, sh, text, unique, Background, Daemon, Netns, SandboxDaemon,
};
use std::path::PathBuf;
use std::time::Duration;

/// B's stack: stacks/peer-in.toml with `compress` (restoring what A's compresses, flows to port 8081) and `tls`
/// (the server of A's TLS client, flows to port 8082; `CERT` and `KEY` replaced) between the carrier and
/// `originate`, both directions through them, as `flexstack run --services` chains them on A.
const B_LINKS: &str = r#"links = [
  "peers[stream] -> unzip",
  "unzip -> udir",
  "udir[down] -> tls",
  "udir[up] -> peers[stream_in]",
  "orig[stream] -> tls",
  "tls -> sdir",
  "sdir[down] -> orig[stream_in]",
  "sdir[up] -> unzip",
  "peers[pass] -> orig[stream_in]",
]

[modules.unzip]
kind = "compress"
mode = "decompress"
select = ["use tcp port 8081"]

[modules.udir]
kind = "direction"

[modules.tls]
kind = "tls"
mode = "server"
tls_side = "up"
cert = "CERT"
key = "KEY"
select = ["use tcp port 8082"]

[modules.sdir]
kind = "direction"
"#;

/// A's services file: TCP flows to port 8081 compressed (those to 8080 are carried as they are, without services:
/// the baseline).
const A_COMPRESS: &str = "[[rule]]\nuse = true\ntransport = \"tcp\"\nport = 8081\n\n[[service]]\nkind = \"compress\"\n";

/// Size of the file downloaded.
const SIZE: usize = 2_000_000;

/// Text lines (zstd shrinks them several times).
fn blob() -> Vec<u8> {
    let mut v = Vec::with_capacity(SIZE + 100);
    let mut i = 0u64;
    while v.len() < SIZE {
        let x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
        v.extend_from_slice(format!("line {i}: value {x:x} the quick brown fox\n").as_bytes());
        i += 1;
    }
    v.truncate(SIZE);
    v
}

/// A (sandbox daemon, host namespace) ─ veth 10.S.1.0/24 ─ B (namespace) ─ veth 10.S.2.0/24 ─ the server's
/// namespace (python3 http.server with [`blob`] on ports 8080, 8081 and 8082).
struct Rig {
    a: SandboxDaemon,
    b: Daemon,
    _srv: Netns,
    _nb: Netns,
    _http: Vec<Background>,
    /// The CA that signed B's TLS certificate (for the server's address).
    ca: PathBuf,
    /// A's end of the veth pair to B.
    host_dev: String,
    dir: tempfile::TempDir,
    srv: String,
    sum: String,
}

impl Drop for Rig {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip").args(["link", "del", &self.host_dev]).status();
    }
}

impl Rig {
    /// `offset` keeps the tests of this file apart (their subnets).
    fn new(offset: u8) -> Option<Rig> {
        if !privileged() {
            return None;
        }
        let (app_octet, srv_octet) = octets();
        let s = srv_octet.wrapping_add(85 + offset);
        let (nb, srv) = (Netns::new("qb"), Netns::new("qs"));
        let (h, b1) = (unique("h"), unique("b"));
        sh("ip", &["link", "add", &h, "type", "veth", "peer", "name", &b1]);
        sh("ip", &["addr", "add", &format!("10.{s}.1.1/24"), "dev", &h]);
        sh("ip", &["link", "set", &h, "up"]);
        nb.adopt(&b1, &[&format!("10.{s}.1.2/24")]);
        let (b2, s1) = (unique("b"), unique("s"));
        sh("ip", &["link", "add", &b2, "type", "veth", "peer", "name", &s1]);
        nb.adopt(&b2, &[&format!("10.{s}.2.1/24")]);
        srv.adopt(&s1, &[&format!("10.{s}.2.2/24")]);
        sh("ip", &["-n", &srv.name, "route", "add", "default", "via", &format!("10.{s}.2.1")]);
        let srv_addr = format!("10.{s}.2.2");
        let dir = tempfile::tempdir().expect("temp dir");
        let www = dir.path().join("www");
        std::fs::create_dir(&www).expect("www");
        std::fs::write(www.join("blob"), blob()).expect("write the blob");
        let sum = common::sha256(&www.join("blob"));
        let http: Vec<Background> = [8080, 8081, 8082]
            .iter()
            .map(|port| {
                let port = port.to_string();
                srv.spawn(&["python3", "-m", "http.server", &port, "--bind", "0.0.0.0", "--directory", path_str(&www)])
            })
            .collect();
        // A's `tls` checks the certificate against the server's address (the flow's destination).
        let (ca, cert, key) = certificate(dir.path(), "b", &srv_addr);
        // B: its carrier accepts A on its side of the first veth; `compress` restores what A's packed.
        let b_addr = format!("10.{s}.1.2:7300");
        let template = std::fs::read_to_string(repo().join("stacks/peer-in.toml")).expect("stacks/peer-in.toml");
        let (_, modules) = template.split_once("\n[modules.peers]").expect("peer-in.toml's carrier");
        let b_stack = format!("{B_LINKS}\n[modules.peers]{modules}")
            .replace("listen = \"0.0.0.0:7300\"", &format!("listen = \"{b_addr}\""))
            .replace("\"CERT\"", &format!("{:?}", path_str(&cert)))
            .replace("\"KEY\"", &format!("{:?}", path_str(&key)));
        assert!(b_stack.contains(&b_addr), "the template listens on 0.0.0.0:7300: {b_stack}");
        let b = Daemon::start_in(&nb, &b_stack, &[]);
        let a = SandboxDaemon::start(app_octet.wrapping_add(85 + offset));
        let key = |out: std::process::Output| {
            assert!(out.status.success(), "peer key: {}", text(&out));
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        };
        let (fa, fb) = (key(a.cli(&["peer", "key"])), key(b.cli(&["peer", "key"])));
        let added = a.cli(&["peer", "add", "gateway", &b_addr, &fb]);
        assert!(added.status.success(), "{}", text(&added));
        b.ok(&["peer", "add", "a", &format!("10.{s}.1.1:0"), &fa]);
        for port in [8080, 8081, 8082] {
            for _ in 0..100 {
                let url = format!("http://{srv_addr}:{port}/blob");
                if srv.run(&["curl", "-sf", "-m", "2", "-o", "/dev/null", &url]).status.success() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Some(Rig { a, b, _srv: srv, _nb: nb, _http: http, ca, host_dev: h, dir, srv: srv_addr, sum })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Bytes A's end of the link to B received so far.
    fn rx_bytes(&self) -> u64 {
        let p = format!("/sys/class/net/{}/statistics/rx_bytes", self.host_dev);
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{p}: {e}")).trim().parse().expect("a count")
    }

    /// Downloads the blob from `port` as app `app` with `run` options `opts`; asserts it arrived intact and returns
    /// the bytes that crossed the link from B to A meanwhile.
    fn download(&self, app: &str, port: u16, opts: &[&str]) -> u64 {
        let before = self.rx_bytes();
        let script = format!("curl -sSf -m 30 http://{}:{port}/blob | sha256sum", self.srv);
        let mut args: Vec<&str> = opts.to_vec();
        args.extend(["--name", app, "--", "sh", "-c", &script]);
        let out = self.a.run(&args);
        assert!(out.status.success(), "{}", text(&out));
        assert!(String::from_utf8_lossy(&out.stdout).contains(&self.sum), "sha256 of the download: {}", text(&out));
        self.rx_bytes() - before
    }
}

/// compress on A (before the carrier) and its restoring end on B (after it): the download is byte exact, B's
/// `compress` packed it to under half, and the link between the peers carried under half of what the same
/// download needs without services.
#[test]
fn compress_between_two_peers_shrinks_the_bytes_on_their_link() {
    let Some(r) = Rig::new(0) else { return };
    // The app's stack: stacks/app-peer.toml as it is (its carrier connects to `gateway`, over `tcp`).
    let stack = repo().join("stacks/app-peer.toml");
    let plain = r.download("plainpeer", 8080, &["--stack", path_str(&stack)]);
    assert!(plain >= SIZE as u64, "without services the file crosses the link whole: {plain} bytes");
    let file = r.path("compress.toml");
    std::fs::write(&file, A_COMPRESS).expect("the services file");
    let packed = r.download("zippeer", 8081, &["--stack", path_str(&stack), "--services", path_str(&file)]);
    let plain_in = r.b.get_u64("module.unzip.plain_bytes_total");
    let packed_out = r.b.get_u64("module.unzip.packed_bytes_total");
    eprintln!("B to A: {plain} bytes without services, {packed} with compress; B packed {plain_in} into {packed_out}");
    assert!(plain_in >= SIZE as u64, "B compressed the download (Up): {plain_in} bytes");
    assert!(packed_out * 2 < plain_in, "zstd shrank it: {packed_out} of {plain_in}");
    assert!(packed * 2 < plain, "the link between the peers carried {packed} bytes, against {plain} without services");
    assert_eq!(r.b.get_u64("module.unzip.errors_total"), 0);
}

/// tls between the peers: A's `tls` (client mode, before the carrier) and B's (server mode, `tls_side = "up"`,
/// after it) complete a handshake, the download passes through both as TLS records and arrives intact.
#[test]
fn tls_between_two_peers_carries_the_download_in_records() {
    let Some(r) = Rig::new(1) else { return };
    let stack = repo().join("stacks/app-peer.toml");
    let file = r.path("tls.toml");
    let services = format!(
        "[[rule]]\nuse = true\ntransport = \"tcp\"\nport = 8082\n\n[[service]]\nkind = \"tls\"\nca = {:?}\n",
        path_str(&r.ca)
    );
    std::fs::write(&file, services).expect("the services file");
    r.download("tlspeer", 8082, &["--stack", path_str(&stack), "--services", path_str(&file)]);
    let m = |name: &str| r.b.get_u64(&format!("module.tls.{name}"));
    assert_eq!(m("handshakes_total"), 1, "B's end completed the handshake");
    assert_eq!(m("failures_total"), 0);
    assert!(m("plain_bytes_total") >= SIZE as u64, "B encrypted the download: {}", m("plain_bytes_total"));
    assert!(m("tls_bytes_total") > m("plain_bytes_total"), "records are longer than their plaintext");
    assert_eq!(r.b.get_u64("module.unzip.flows_selected_total"), 0, "compress took no flow of port 8082");
}

/// `service add` and `del` on a running app whose chain ends in its carrier: the chain changed stays linked to the
/// carrier (not to `{app}-orig`, which cannot reach the server), so the downloads after each change still reach
/// the server through B, compressed by A's `compress` and restored by B's.
#[test]
fn service_add_and_del_keep_a_peer_apps_chain_on_its_carrier() {
    let Some(r) = Rig::new(2) else { return };
    let stack = repo().join("stacks/app-peer.toml");
    let file = r.path("compress.toml");
    std::fs::write(&file, A_COMPRESS).expect("the services file");
    let cli = format!("{} --state-dir {}", common::bin(), path_str(r.a.state.path()));
    let curl = format!("curl -sSf -m 30 http://{}:8081/blob | sha256sum", r.srv);
    // The app is this script: it adds `null` to its own chain (nearest the network: linked to the carrier),
    // downloads, removes it again, downloads.
    let script = format!(
        "exec 2>&1\n\
         echo '== add'; {cli} service add addpeer null || exit 3\n\
         echo '== list'; {cli} service list addpeer\n\
         echo '== curl1'; {curl}\n\
         echo '== del'; {cli} service del addpeer null || exit 4\n\
         echo '== curl2'; {curl}\n\
         echo '== end'"
    );
    let out = r.a.run(&[
        "--stack",
        path_str(&stack),
        "--services",
        path_str(&file),
        "--name",
        "addpeer",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    let step = |name: &str| {
        let from = t.find(&format!("== {name}\n")).unwrap_or_else(|| panic!("no step {name}: {t}"));
        let rest = &t[from + name.len() + 4..];
        rest[..rest.find("\n== ").unwrap_or(rest.len())].to_string()
    };
    assert!(step("list").contains("addpeer-null"), "{t}");
    assert!(step("curl1").contains(&r.sum), "the download after the add arrived intact: {t}");
    assert!(step("curl2").contains(&r.sum), "the download after the del arrived intact: {t}");
    assert_eq!(r.b.get_u64("module.unzip.flows_selected_total"), 2, "both went through the carrier to B's compress");
    assert!(r.b.get_u64("module.unzip.plain_bytes_total") >= 2 * SIZE as u64, "B compressed both downloads");
    assert_eq!(r.b.get_u64("module.unzip.errors_total"), 0);
}
