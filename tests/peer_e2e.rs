//! End-to-end: flows of an app on daemon A carried to peer daemon B over the `tcp`, `quic`, `udp` and `udpplus` carriers
//! (docs/peers.md) and
//! opened again by B towards a server that only B can reach. Daemon A runs with the host's sandboxes (the app in
//! `stacks/app-peer.toml`), daemon B in a namespace of its own (`stacks/peer-in.toml`), joined to A by a veth pair;
//! the server (python3 http.server, dnsmasq) sits in a third namespace behind B, on a subnet A has no route to, so
//! an answer can only come through the carrier. Needs root (skips with a reason outside CI).

mod common;

use common::peer::{read_counter, udp_counter, Rig, FLOWS, MARK, QUIC, QUIC6, UDP, UDPPLUS, UDPPLUS6};
use common::{bin, path_str, pattern, sh, text, Daemon};
use flexstack_api::ops::{FlowInfo, Handling};
use std::time::Duration;

/// curl of a 2 MB file and dig, from an app on A, to servers only B reaches: both arrive intact through the carrier,
/// both flows counted as carried on both sides, nothing opened on A.
#[test]
fn curl_and_dig_are_carried_to_the_peer() {
    let Some(r) = Rig::new(0, true) else { return };
    curl_and_dig(&r, "carried");
}

/// The checks of [`curl_and_dig_are_carried_to_the_peer`] for app `app` on rig `r` (any carrier); returns A's
/// meters `quic` (the carrier's, `peer.` prefixed) read after the transfers.
fn curl_and_dig(r: &Rig, app: &str) -> Vec<u64> {
    curl_and_dig_with(r, app, &[])
}

fn curl_and_dig_with(r: &Rig, app: &str, more: &[&str]) -> Vec<u64> {
    let want = common::sha256(&r.www.path().join("blob"));
    // A cannot reach the server itself: only the carrier can bring the answers.
    let direct = sh("ip", &["route", "get", &r.srv]);
    assert!(!direct.contains(&r.host_dev), "A must not route to the server directly: {direct}");
    // IPv4 and IPv6 downloads, then dig to both server addresses; the UDP flows are still open (their idle timeout)
    // when the flows are listed, and have lived past `meters_after_ms` (20 ms), after which a flow's meters (what
    // `flow list` reads) are published: two digs can take less.
    let script = format!(
        "curl -sSf -m 30 http://{srv}:8080/blob | sha256sum\ncurl -sSf -m 30 'http://[{v6}]:8080/blob' | sha256sum\n\
         dig +short +time=2 +tries=2 @{srv} flexstack.test\ndig +short +time=2 +tries=2 @{v6} flexstack.test AAAA\n\
         sleep 0.2; echo {FLOWS}; {bin} --state-dir {state} -j flow list",
        srv = r.srv,
        v6 = r.srv6,
        bin = bin(),
        state = path_str(r.a.state.path()),
    );
    let mut meters = vec![
        "peer.flows_total",
        "peer.connections_total",
        "peer.bytes_in_total",
        "peer.refusals_total",
        "orig.connections_total",
    ];
    meters.extend(more);
    let (out, m) = r.run(app, &script, &meters);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(stdout.matches(&want).count(), 2, "sha256 of the downloads (IPv4, IPv6): {}", text(&out));
    assert!(stdout.lines().any(|l| l.trim() == "10.1.2.3"), "dig's answer: {}", text(&out));
    assert!(stdout.lines().any(|l| l.trim() == "fd00:1:2::3"), "dig's answer from the IPv6 server: {}", text(&out));
    let [flows, conns, bytes_in, refusals, orig] = m[..5] else { unreachable!() };
    assert!(flows >= 4, "the TCP and UDP flows were carried: {flows}");
    // `flow list`: the UDP flow's app side is terminated, its network side carried to the peer, each naming the other.
    let listed = stdout.split_once(FLOWS).and_then(|(_, rest)| rest.split_once(MARK)).expect("flow list printed").0;
    let list: Vec<FlowInfo> = serde_json::from_str(listed.trim()).unwrap_or_else(|e| panic!("{e}: {listed}"));
    let dns = |h: Handling| {
        list.iter()
            .find(|f| f.handling == h && f.protocol == "udp" && f.dst_port == Some(53))
            .unwrap_or_else(|| panic!("no {h:?} DNS flow in {listed}"))
    };
    let (carried, terminated) = (dns(Handling::Carried), dns(Handling::Terminated));
    assert_eq!(carried.module, format!("{app}-peer"));
    assert_eq!(carried.peer.as_deref(), Some(terminated.id.as_str()), "{listed}");
    assert_eq!(terminated.peer.as_deref(), Some(carried.id.as_str()), "{listed}");
    assert_eq!((conns, refusals), (1, 0), "one connection, authenticated");
    assert!(bytes_in > 2_000_000, "the download came through the carrier: {bytes_in} bytes");
    assert_eq!(orig, 0, "nothing was opened on A");
    assert!(r.b_meter("flows_total") >= 3, "B opened the flows");
    assert_eq!(r.b_meter("refusals_total"), 0);
    assert_eq!(r.b_meter("malformed_total"), 0);
    let peers = r.a.cli(&["-j", "peer", "show", "gateway"]);
    let p: serde_json::Value = serde_json::from_slice(&peers.stdout).expect("peer show as JSON");
    // As addresses: the daemon prints B's IPv6 address in its shortest form (`fd96::2`, not the rig's `fd96:0::2`).
    let addr = |a: &str| a.parse::<std::net::SocketAddr>().unwrap_or_else(|e| panic!("{a}: {e}"));
    assert_eq!(addr(p["addr"].as_str().unwrap_or_default()), addr(&r.b_addr), "{p}");
    assert!(p["connections"].as_u64() >= Some(1), "{p}");
    m[5..].to_vec()
}

/// A peer whose key B does not know gets nothing: the connection is refused and counted on both sides, no flow
/// is opened by B, and the app's connection fails instead of hanging.
#[test]
fn a_peer_with_an_unknown_key_gets_nothing_and_is_counted() {
    let Some(r) = Rig::new(1, false) else { return };
    let script = format!("curl -sS -m 10 -o /dev/null http://{}:8080/blob; echo curl=$?", r.srv);
    let (out, m) =
        r.run("refused", &script, &["peer.refusals_total", "peer.connections_total", "peer.flows_aborted_total"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("curl=0"), "curl must fail: {}", text(&out));
    assert!(m[0] >= 1 && m[1] == 0, "A counts the refusal, no connection: {m:?}");
    assert!(m[2] >= 1, "the flow was aborted: {m:?}");
    assert!(r.b_meter("refusals_total") >= 1, "B counts the refusal");
    assert_eq!(r.b_meter("connections_total"), 0);
    assert_eq!(r.b_meter("flows_total"), 0, "B opened nothing");
    let peers = r.a.cli(&["-j", "peer", "list"]);
    let list: serde_json::Value = serde_json::from_slice(&peers.stdout).expect("peer list as JSON");
    assert!(list[0]["state"].as_str().is_some_and(|s| s.starts_with("down")), "{list}");
}

/// Starts a slow download by app `app` (64 KiB every 250 ms: about 8 s for the 2 MB, so that the flow is open
/// while a test disturbs the carrier) and waits until B carries its flow; returns the sha256 it must print.
fn slow_download(r: &Rig, app: &str) -> (String, std::process::Child) {
    let want = common::sha256(&r.www.path().join("blob"));
    let reader = format!(
        "import hashlib, time, urllib.request\nh = hashlib.sha256()\nwith urllib.request.urlopen('http://{}:8080/blob', \
         timeout=30) as f:\n    while True:\n        b = f.read(65536)\n        if not b:\n            break\n        \
         h.update(b)\n        time.sleep(0.25)\nprint(h.hexdigest())\n",
        r.srv
    );
    let args = r.args(app, &format!("python3 -c \"{reader}\""), &["peer.connections_total"]);
    let run = r.a.spawn_run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    r.b.wait_for("the app's flow at B", 10, |b| b.get_u64("module.peers.flows_active") == 1);
    (want, run)
}

/// Sends `garbage` (a python3 script) while the slow download `run` goes on: the download arrives intact (`want`)
/// and B is still running.
fn survives_garbage(r: &mut Rig, garbage: &str, run: std::process::Child, want: &str) {
    sh("python3", &["-c", garbage]);
    assert_eq!(r.b_meter("flows_active"), 1, "the transfer was open while the garbage came");
    let out = run.wait_with_output().expect("the app");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains(want), "the transfer survives: {stdout}");
    assert!(r.b.alive(), "B is still running");
}

/// Garbage on B's carrier port (random bytes, a plain HTTP request) is refused and counted while a transfer
/// through the carrier goes on: B survives and the download arrives intact.
#[test]
fn garbage_on_the_peer_port_is_refused_while_flows_continue() {
    let Some(mut r) = Rig::new(2, true) else { return };
    let (want, run) = slow_download(&r, "steady");
    let (host, port) = r.b_addr.split_once(':').unwrap();
    let garbage = format!(
        "import os, socket\nfor i in range(30):\n    s = socket.create_connection(('{host}', {port}), timeout=5)\n    \
         s.sendall(os.urandom(3000) if i % 2 else b'GET / HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n')\n    \
         try:\n        s.recv(65536)\n    except OSError:\n        pass\n    s.close()\n"
    );
    survives_garbage(&mut r, &garbage, run, &want);
    assert!(r.b_meter("refusals_total") >= 30, "every garbage connection refused: {}", r.b_meter("refusals_total"));
    assert_eq!(r.b_meter("malformed_total"), 0, "garbage never got past authentication");
    assert_eq!(r.b_meter("connections_total"), 1, "the peer's own connection only");
    let _ = r.dir.path();
}

/// The `quic` carrier: the same curl (IPv4 and IPv6 apps) and dig, the peers joined over IPv4; the TCP flows on
/// QUIC streams, the DNS query in a DATAGRAM frame; quinn-proto's meters move.
#[test]
fn quic_carries_curl_and_dig() {
    let Some(r) = Rig::with(3, true, QUIC) else { return };
    let quic = ["peer.udp_bytes_in_total", "peer.rtt_us", "peer.cwnd_bytes", "peer.datagrams_dropped_total"];
    let m = curl_and_dig_with(&r, "quic4", &quic);
    let [udp_in, rtt, cwnd, dropped] = m[..] else { unreachable!() };
    // (Read within a meter period, 100 ms, of the second download's end: at least the first's are in.)
    assert!(udp_in > 2_000_000, "the downloads came as QUIC packets: {udp_in} bytes");
    assert!(rtt > 0 && cwnd > 0, "quinn-proto's path meters: rtt {rtt} us, cwnd {cwnd}");
    assert_eq!(dropped, 0, "the DNS query fits a datagram");
    let b_out = r.b_meter("udp_bytes_out_total");
    assert!(b_out > 2 * 2_000_000, "B sent both downloads over QUIC: {b_out} bytes");
}

/// The `quic` carrier between peers that reach each other over IPv6.
#[test]
fn quic_carries_curl_and_dig_between_ipv6_peers() {
    let Some(r) = Rig::with(4, true, QUIC6) else { return };
    assert!(r.b_addr.starts_with("[fd96:"), "{}", r.b_addr);
    curl_and_dig(&r, "quic6");
}

/// Each congestion control of the `quic` carrier (`cc`: quinn-proto's NewReno, Cubic, BBR) carries a download intact;
/// each app's carrier has a connection of its own.
#[test]
fn each_quic_congestion_control_carries_a_download() {
    let Some(r) = Rig::with(5, true, QUIC) else { return };
    let want = common::sha256(&r.www.path().join("blob"));
    for (i, cc) in ["newreno", "cubic", "bbr"].iter().enumerate() {
        let stack = r.stack_with(&format!("cc = \"{cc}\""));
        // The sleep: the carrier refreshes quinn-proto's meters every 100 ms.
        let script = format!("curl -sSf -m 30 http://{}:8080/blob | sha256sum; sleep 0.3", r.srv);
        let app = format!("cc{i}");
        let (out, m) = r.run_in(&stack, &app, &script, &["peer.connections_total", "peer.udp_bytes_in_total"]);
        assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains(&want), "{cc}: {}", text(&out));
        assert_eq!(m[0], 1, "{cc}: one QUIC connection");
        assert!(m[1] > 2_000_000, "{cc}: the download came over QUIC: {} bytes", m[1]);
        // The controller the connection ran, as quinn-proto reports it.
        let p = r.a.cli(&["-j", "peer", "show", "gateway"]);
        let p: serde_json::Value = serde_json::from_slice(&p.stdout).expect("peer show as JSON");
        assert_eq!(p["state"], format!("connected over quic ({cc})").as_str(), "{p}");
    }
    assert_eq!(r.b_meter("connections_total"), 3, "one connection per app's carrier");
}

/// A QUIC handshake from a peer whose key B does not know fails: counted on both sides, no flow opened by B, the
/// app's connection fails instead of hanging.
#[test]
fn quic_from_an_unknown_peer_gets_nothing_and_is_counted() {
    let Some(r) = Rig::with(6, false, QUIC) else { return };
    let script = format!("curl -sS -m 10 -o /dev/null http://{}:8080/blob; echo curl=$?", r.srv);
    let (out, m) =
        r.run("qrefused", &script, &["peer.refusals_total", "peer.connections_total", "peer.flows_aborted_total"]);
    assert!(!String::from_utf8_lossy(&out.stdout).contains("curl=0"), "curl must fail: {}", text(&out));
    assert!(m[0] >= 1 && m[1] == 0, "A counts the refusal, no connection: {m:?}");
    assert!(m[2] >= 1, "the flow was aborted: {m:?}");
    assert!(r.b_meter("refusals_total") >= 1, "B counts the refusal");
    assert_eq!(r.b_meter("connections_total"), 0);
    assert_eq!(r.b_meter("flows_total"), 0, "B opened nothing");
}

/// Garbage UDP datagrams on B's QUIC port (random bytes, QUIC long headers cut short, Initial packets of random
/// content) while a transfer goes on over the carrier: B survives, no connection is made of them, the download
/// arrives intact.
#[test]
fn garbage_datagrams_on_the_quic_port_do_not_disturb_flows() {
    let Some(mut r) = Rig::with(7, true, QUIC) else { return };
    let (want, run) = slow_download(&r, "qsteady");
    let (host, port) = r.b_addr.rsplit_once(':').unwrap();
    // 0xc0-0xcf: a long header (Initial), version 1, then random or truncated content; some padded to 1200 bytes
    // as a real Initial must be.
    let garbage = format!(
        "import os, random, socket\nrandom.seed(14)\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         for i in range(3000):\n    k = i % 4\n    if k == 0:\n        b = os.urandom(random.randint(1, 1500))\n    \
         else:\n        head = bytes([0xc0 | random.randint(0, 15), 0, 0, 0, 1, 8]) + os.urandom(8) + bytes([8]) + \
         os.urandom(8)\n        b = head + os.urandom(1200 - len(head) if k == 1 else random.randint(0, 40))\n        \
         b = b[:random.randint(1, len(b))] if k == 3 else b\n    s.sendto(b, ('{host}', {port}))\n"
    );
    survives_garbage(&mut r, &garbage, run, &want);
    assert_eq!(r.b_meter("connections_total"), 1, "the peer's own connection only");
    assert_eq!(r.b_meter("malformed_total"), 0, "garbage never got past authentication");
}

/// `flexstack peer`: the key is stable across restarts of the daemon (it lives in the state directory); names,
/// addresses and fingerprints are checked; a name, a fingerprint or the daemon's own key cannot be added twice.
/// Needs no privileges.
#[test]
fn peer_commands_check_their_input_and_the_key_persists() {
    let mut d = Daemon::start("", &[]);
    let key = d.ok(&["peer", "key"]).trim().to_string();
    assert_eq!(key.len(), 64, "{key}");
    let fp = "ab".repeat(32);
    d.ok(&["peer", "add", "b-1", "192.0.2.1:7300", &fp]);
    for (args, why) in [
        (vec!["peer", "add", "b-1", "192.0.2.2:7300", &"cd".repeat(32)], "exists"),
        (vec!["peer", "add", "c", "192.0.2.2:7300", &fp], "fingerprint is peer \"b-1\""),
        (vec!["peer", "add", "self", "192.0.2.2:7300", &key], "this daemon's own"),
        (vec!["peer", "add", "c", "192.0.2.2", &"cd".repeat(32)], "ADDR:PORT"),
        (vec!["peer", "add", "c", "192.0.2.2:1", "xyz"], "64 hex digits"),
        (vec!["peer", "add", "a b", "192.0.2.2:1", &"cd".repeat(32)], "A-Z a-z 0-9"),
        (vec!["peer", "show", "nobody"], "no peer"),
    ] {
        let e = d.fails(&args);
        assert!(e.contains(why), "{args:?}: {e}");
    }
    let list = d.json(&["peer", "list"]);
    assert_eq!(list.as_array().map(Vec::len), Some(1), "{list}");
    assert_eq!((list[0]["name"].as_str(), list[0]["fingerprint"].as_str()), (Some("b-1"), Some(fp.as_str())));
    d.ok(&["peer", "del", "b-1"]);
    assert_eq!(d.json(&["peer", "list"]), serde_json::json!([]));
    d.kill();
    d.restart(&[], "restarted.log");
    assert_eq!(d.ok(&["peer", "key"]).trim(), key, "the same key after a restart");
}

/// Writes a file of `mib` MiB behind B and downloads it as app `app` (from the server's IPv6 address if `v6`):
/// sha256 equal. Returns A's `meters` read after it.
fn large_download(r: &Rig, app: &str, mib: usize, v6: bool, meters: &[&str]) -> Vec<u64> {
    let name = format!("large-{app}");
    std::fs::write(r.www.path().join(&name), pattern(mib << 20)).expect("write the file");
    let want = common::sha256(&r.www.path().join(&name));
    let host = if v6 { format!("[{}]", r.srv6) } else { r.srv.clone() };
    // The sleep: the carrier refreshes its meters every 100 ms.
    let script = format!("curl -sSf -m 60 http://{host}:8080/{name} | sha256sum; sleep 0.3");
    let (out, m) = r.run(app, &script, meters);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains(&want), "{mib} MiB ({}): {}", r.carrier, text(&out));
    m
}

/// iperf3 UDP at 20 Mbit/s for 2 s from app `app` to a server behind B (its control connection a TCP flow, its
/// datagrams a UDP flow, both carried): returns the datagrams sent and the share iperf3's server reports lost.
fn iperf_udp(r: &Rig, app: &str) -> (u64, f64) {
    let _server = r._srv.spawn(&["iperf3", "-s", "-1", "-p", "5201"]);
    std::thread::sleep(Duration::from_millis(500));
    let script = format!("iperf3 -c {} -p 5201 -u -b 20M -l 1200 -t 2 -J", r.srv);
    let (out, _) = r.run(app, &script, &["peer.flows_total"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "iperf3: {}", text(&out));
    let json = stdout.split_once(MARK).expect("iperf3's report").0;
    let v: serde_json::Value = serde_json::from_str(json.trim()).unwrap_or_else(|e| panic!("{e}: {json}"));
    let sum = &v["end"]["sum"];
    (sum["packets"].as_u64().unwrap_or(0), sum["lost_percent"].as_f64().unwrap_or(100.0))
}

/// The `udp` carrier: curl (IPv4 and IPv6 apps) and dig as over the others, a 32 MiB download (TCP over the
/// carrier's reliable stream) and iperf3 UDP; the carrier's meters move, nothing is replayed or malformed.
#[test]
fn udp_carries_curl_dig_a_large_download_and_iperf3() {
    let Some(r) = Rig::with(8, true, UDP) else { return };
    let meters = ["peer.udp_bytes_in_total", "peer.rtt_us", "peer.cwnd_bytes", "peer.replayed_total"];
    let m = curl_and_dig_with(&r, "udp4", &meters);
    let [udp_in, rtt, cwnd, replayed] = m[..] else { unreachable!() };
    assert!(udp_in > 2_000_000, "the downloads came as datagrams: {udp_in} bytes");
    assert!(rtt > 0 && cwnd > 0, "the reliable stream's meters: rtt {rtt} us, cwnd {cwnd}");
    assert_eq!(replayed, 0);
    let m = large_download(&r, "udpbig", 32, false, &["peer.udp_bytes_in_total"]);
    assert!(m[0] > 32 << 20, "32 MiB came through the carrier: {} bytes", m[0]);
    let (packets, lost) = iperf_udp(&r, "udpiperf");
    assert!(packets > 3000, "iperf3 sent its datagrams: {packets}");
    assert!(lost < 5.0, "iperf3's datagrams arrived on a clean link: {lost} % lost");
    assert_eq!(r.b_meter("malformed_total"), 0);
    assert_eq!(r.b_meter("replayed_total"), 0);
    // Both sides of version 2: the handshake chose AES-256-GCM (docs/peers.md, "Handshake and protection").
    let p = r.a.cli(&["-j", "peer", "show", "gateway"]);
    let p: serde_json::Value = serde_json::from_slice(&p.stdout).expect("peer show as JSON");
    assert_eq!(p["state"], "connected over udp (aes-256-gcm)", "{p}");
}

/// The `udpplus` carrier between peers that reach each other over IPv6: curl (IPv4 and IPv6 apps) and dig, a
/// 32 MiB download from the IPv6 server, and iperf3 UDP.
#[test]
fn udpplus_carries_curl_dig_a_large_download_and_iperf3_between_ipv6_peers() {
    let Some(r) = Rig::with(9, true, UDPPLUS6) else { return };
    assert!(r.b_addr.starts_with("[fd96:"), "{}", r.b_addr);
    curl_and_dig(&r, "plus6");
    let m = large_download(&r, "plusbig", 32, true, &["peer.udp_bytes_in_total"]);
    assert!(m[0] > 32 << 20, "32 MiB came through the carrier: {} bytes", m[0]);
    let (packets, lost) = iperf_udp(&r, "plusiperf");
    assert!(packets > 3000, "iperf3 sent its datagrams: {packets}");
    assert!(lost < 5.0, "{lost} % lost");
}

/// Datagrams a seq-numbered stream sends in [`lossy_stream`].
const STREAM_LEN: u32 = 1500;

/// Makes the link between A and B lose 5 % of the UDP packets each way, each datagram on its own, at the receiving
/// end (`numgen random`; this kernel has no netem): A to B in B's namespace (an input hook on B's end of the veth,
/// gone with the namespace), B to A in an ingress hook on A's end (a netdev table in the host's namespace, deleted
/// when the returned guard drops).
///
/// The carriers send runs of datagrams as one GSO packet, and a hook before the device sees such a run whole: a
/// drop there would lose up to 64 datagrams at once, and how much a carrier batches depends on the machine's load.
/// So UDP segmentation is off on both ends of the veth: each kernel cuts its runs into datagrams before they cross,
/// and the receiving hook drops datagrams one by one, as a lossy link does.
fn make_lossy(r: &Rig) -> LossGuard {
    sh("ethtool", &["-K", &r.host_dev, "tx-udp-segmentation", "off"]);
    let out = r._nb.run(&["ethtool", "-K", &r.b_dev, "tx-udp-segmentation", "off"]);
    assert!(out.status.success(), "ethtool in B: {}", text(&out));
    let nft = |args: &str| {
        let out = r._nb.run(&["nft", args]);
        assert!(out.status.success(), "nft {args}: {}", text(&out));
    };
    nft("add table inet fsloss");
    nft("add chain inet fsloss in { type filter hook input priority 0; }");
    nft(&format!("add rule inet fsloss in iifname {} meta l4proto udp numgen random mod 20 == 0 drop", r.b_dev));
    let guard = LossGuard(format!("fsloss{}", r.s));
    let host = |args: String| sh("nft", &[&args]);
    host(format!("add table netdev {}", guard.0));
    host(format!("add chain netdev {} in {{ type filter hook ingress device {} priority 0; }}", guard.0, r.host_dev));
    host(format!("add rule netdev {} in meta l4proto udp numgen random mod 20 == 0 drop", guard.0));
    guard
}

/// The host's loss table of [`make_lossy`], deleted on drop.
struct LossGuard(String);

impl Drop for LossGuard {
    fn drop(&mut self) {
        let _ = std::process::Command::new("nft").args(["delete", "table", "netdev", &self.0]).status();
    }
}

/// A UDP stream of [`STREAM_LEN`] numbered datagrams (200 bytes, one a millisecond) from app `app` (its stack
/// `stack`, `before` run first in the app's shell) to a counter behind B; returns the distinct numbers and the
/// datagrams the counter received, and A's `meters`.
fn lossy_stream(r: &Rig, app: &str, stack: &std::path::Path, before: &str, meters: &[&str]) -> (u64, u64, Vec<u64>) {
    let (_counter, out) = udp_counter(r, app);
    let sender = format!(
        "import socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nfor i in range({STREAM_LEN}):\n    \
         s.sendto(b'%d ' % i + b'x' * 200, ('{}', 9000))\n    time.sleep(0.001)\n",
        r.srv
    );
    // The sleep: what is retransmitted arrives, and the meters are refreshed, before they are read.
    let (run, m) = r.run_in(stack, app, &format!("{before}\npython3 -c \"{sender}\"; sleep 2"), meters);
    assert!(run.status.success(), "{}", text(&run));
    let (distinct, total) = read_counter(&out);
    (distinct, total, m)
}

/// Over a link that loses 5 % each way, the `udp` carrier loses some of a numbered UDP stream (one datagram per
/// app datagram, nothing resent), while TCP flows still arrive intact through its reliable stream, which
/// retransmits what was lost.
#[test]
fn udp_loses_datagrams_on_a_lossy_link_and_tcp_still_arrives() {
    let Some(r) = Rig::with(10, true, UDP) else { return };
    let _loss = make_lossy(&r);
    let (distinct, total, _) = lossy_stream(&r, "udplossy", &r.stack, "", &["peer.flows_total"]);
    let n = u64::from(STREAM_LEN);
    assert!(distinct < n && distinct > n / 2, "udp loses some: {distinct} of {n}");
    assert_eq!(distinct, total, "no duplicates");
    let want = common::sha256(&r.www.path().join("blob"));
    let script = format!("curl -sSf -m 60 http://{}:8080/blob | sha256sum; sleep 0.3", r.srv);
    let (out, m) = r.run("udptcp", &script, &["peer.retransmits_total", "peer.lost_packets_total"]);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains(&want), "{}", text(&out));
    assert!(r.b_meter("retransmits_total") > 0, "B resent the download's lost segments");
    assert!(m[0] > 0 || m[1] > 0 || r.b_meter("lost_packets_total") > 0, "losses were seen: {m:?}");
}

/// Over the same lossy link, `udpplus` with ARQ and FEC delivers every datagram of the stream, each once: lost
/// ones are rebuilt from parities (`fec_recovered_total` at B) or asked for again (`nacks_total` at B) and resent
/// (`retransmits_total` at A). FEC is off in the app's stack and turned on by its knob while the carrier runs.
#[test]
fn udpplus_with_arq_and_fec_delivers_a_whole_stream_on_a_lossy_link() {
    let Some(r) = Rig::with(11, true, UDPPLUS) else { return };
    let _loss = make_lossy(&r);
    let stack = r.stack_with("arq = true\nfec = false\nfec_k = 4");
    let knob =
        format!("{} --state-dir {} set module.pluslossy-peer.fec true || exit 1", bin(), path_str(r.a.state.path()));
    let (distinct, total, m) = lossy_stream(&r, "pluslossy", &stack, &knob, &["peer.retransmits_total"]);
    let n = u64::from(STREAM_LEN);
    let seen: Vec<(&str, u64)> = ["orphans_total", "early_held_total", "datagrams_lost_total", "nacks_total"]
        .map(|k| (k, r.b_meter(k)))
        .to_vec();
    assert_eq!(distinct, n, "udpplus delivers every datagram; B's meters: {seen:?}");
    assert_eq!(total, n, "each once");
    let (recovered, nacks) = (r.b_meter("fec_recovered_total"), r.b_meter("nacks_total"));
    assert!(recovered > 0, "FEC (turned on by its knob) rebuilt some: {recovered}");
    assert!(nacks > 0 && m[0] > 0, "ARQ asked for and resent the rest: {nacks} NACKs, {} resent", m[0]);
    assert_eq!(r.b_meter("datagrams_lost_total"), 0);
}

/// Captured datagrams of a running session sent again (from the session's address: the frames themselves,
/// re-injected on A's veth) are counted as replayed and dropped; forged sealed datagrams and garbage as malformed;
/// the download on the session is not disturbed and no other session is made.
#[test]
fn replayed_and_forged_datagrams_are_counted_and_dropped() {
    let Some(mut r) = Rig::with(12, true, UDP) else { return };
    // The carrier sends runs of datagrams as one GSO packet, which a capture on the veth sees whole: with UDP
    // segmentation off there, the kernel cuts them before the capture, and each frame caught is one datagram.
    sh("ethtool", &["-K", &r.host_dev, "tx-udp-segmentation", "off"]);
    let (want, run) = slow_download(&r, "replay");
    let (host, port) = r.b_addr.rsplit_once(':').unwrap();
    let script = format!(
        "import os, random, socket, struct, time\nrandom.seed(14)\n\
         raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))\nraw.bind(('{dev}', 0))\n\
         raw.settimeout(1)\ncaught = []\nend = time.time() + 5\nwhile len(caught) < 40 and time.time() < end:\n    \
         try:\n        f = raw.recv(65535)\n    except socket.timeout:\n        continue\n    \
         if len(f) < 43 or f[12:14] != b'\\x08\\x00' or f[23] != 17:\n        continue\n    \
         ihl = (f[14] & 15) * 4\n    udp = 14 + ihl\n    \
         if struct.unpack('!H', f[udp + 2:udp + 4])[0] == {port} and f[udp + 8] == 3:\n        \
         caught.append(f[:udp + 6] + b'\\x00\\x00' + f[udp + 8:])\n\
         for f in caught:\n    raw.send(f)\n\
         s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         for i in range(200):\n    s.sendto(bytes([3]) + os.urandom(random.randint(8, 1400)), ('{host}', {port}))\n\
         for i in range(100):\n    s.sendto(bytes([random.randint(4, 255)]) + os.urandom(random.randint(0, 1500)), ('{host}', {port}))\n\
         open('{out}', 'w').write(str(len(caught)))\n",
        dev = r.host_dev,
        out = path_str(&r.dir.path().join("caught")),
    );
    survives_garbage(&mut r, &script, run, &want);
    let caught: u64 = std::fs::read_to_string(r.dir.path().join("caught")).unwrap().trim().parse().unwrap();
    assert!(caught >= 20, "datagrams of the session captured: {caught}");
    let replayed = r.b_meter("replayed_total");
    assert!(replayed >= caught, "every replayed datagram counted: {replayed} of {caught}");
    assert!(r.b_meter("malformed_total") >= 300, "forged and garbage counted: {}", r.b_meter("malformed_total"));
    assert_eq!(r.b_meter("connections_total"), 1, "the peer's own session only");
}

/// A `udp` handshake from a peer whose key B does not know gets no answer: counted on both sides, no flow opened
/// by B, the app's connection fails instead of hanging.
#[test]
fn udp_from_an_unknown_peer_gets_nothing_and_is_counted() {
    let Some(r) = Rig::with(13, false, UDP) else { return };
    let script = format!("curl -sS -m 10 -o /dev/null http://{}:8080/blob; echo curl=$?", r.srv);
    let (out, m) =
        r.run("urefused", &script, &["peer.refusals_total", "peer.connections_total", "peer.flows_aborted_total"]);
    assert!(!String::from_utf8_lossy(&out.stdout).contains("curl=0"), "curl must fail: {}", text(&out));
    assert!(m[0] >= 1 && m[1] == 0, "A counts the refusal, no session: {m:?}");
    assert!(m[2] >= 1, "the flow was aborted: {m:?}");
    assert!(r.b_meter("refusals_total") >= 1, "B counts the refusal");
    assert_eq!(r.b_meter("connections_total"), 0);
    assert_eq!(r.b_meter("flows_total"), 0, "B opened nothing");
}
