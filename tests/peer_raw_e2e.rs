//! End-to-end: the raw stack (docs/peers.md, "The raw stack"). The rig of tests/peer_e2e.rs (daemon A with the
//! host's sandboxes, daemon B in a namespace of its own, a server behind B on a subnet A has no route to), B running
//! `stacks/peer-in-raw.toml` (its raw packets leave through a NAT and a TUN device into B's kernel, which forwards
//! them to the server) and the app `stacks/app-peer-raw.toml`: packets that are not terminated (ping, flows the match
//! table passes) reach the server only through the carrier's raw pseudo-flow. Needs root (skips with a reason
//! outside CI).

mod common;

use common::peer::{write_stack_from, Link, Rig, QUIC, TCP, UDPPLUS6};
use common::text;
use std::path::PathBuf;

const UDP6: Link = Link { transport: "udp", v6: true, transports: "" };

/// B's raw stack for the rig's subnet `s`: its TUN device named uniquely, its NAT to `10.S.3.2` and `fd98:S::2`.
fn b_raw_stack(t: &str, s: u8) -> String {
    t.replace("fsraw0", &common::unique("r"))
        .replace("10.255.77.2", &format!("10.{s}.3.2"))
        .replace("fd77:ff::2", &format!("fd98:{s:x}::2"))
}

/// A rig with B's raw stack: its TUN device addressed, B forwarding, and the server routing the NAT's subnets back
/// to B (A still has no route to the server).
fn raw_rig(offset: u8, link: Link) -> Option<Rig> {
    let r = Rig::with_b_stack(offset, true, link, link, "stacks/peer-in-raw.toml", &b_raw_stack)?;
    let s = r.s;
    let tun = r.b.get("module.net.device").as_str().expect("B's TUN device").to_string();
    for cmd in [
        vec!["ip", "addr", "add", &format!("10.{s}.3.1/24"), "dev", &tun],
        vec!["ip", "addr", "add", &format!("fd98:{s:x}::1/64"), "dev", &tun, "nodad"],
        vec!["ip", "link", "set", &tun, "up"],
        vec!["sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"],
    ] {
        let out = r._nb.run(&cmd);
        assert!(out.status.success(), "{cmd:?}: {}", text(&out));
    }
    for cmd in [
        vec!["ip", "route", "add", &format!("10.{s}.3.0/24"), "via", &format!("10.{s}.2.1")],
        vec!["ip", "-6", "route", "add", &format!("fd98:{s:x}::/64"), "via", &format!("fd97:{s:x}::1")],
    ] {
        let out = r._srv.run(&cmd);
        assert!(out.status.success(), "{cmd:?}: {}", text(&out));
    }
    let direct = common::sh("ip", &["route", "get", &r.srv]);
    assert!(!direct.contains(&r.host_dev), "A must not route to the server directly: {direct}");
    Some(r)
}

/// The app's raw stack with the rig's carrier settings and `edit` applied.
fn raw_app_stack(r: &Rig, edit: impl Fn(String) -> String) -> PathBuf {
    let path = r.dir.path().join(format!("app-raw-{}.toml", common::unique("s")));
    write_stack_from("stacks/app-peer-raw.toml", &path, &r.carrier);
    let t = std::fs::read_to_string(&path).expect("the stack");
    std::fs::write(&path, edit(t)).expect("write the stack");
    path
}

/// How many of `ping -c N` came back, from ping's summary.
fn received(stdout: &str, tag: &str) -> u64 {
    let line = stdout.lines().skip_while(|l| !l.contains(tag)).find(|l| l.contains("received")).unwrap_or("");
    line.split(',').find_map(|p| p.trim().strip_suffix(" received")?.parse().ok()).unwrap_or(0)
}

/// Ping from the app on A to the server's IPv4 and IPv6 addresses: the echo requests are not terminated, travel raw
/// over the quic carrier (DATAGRAM frames), leave from B through its NAT, and the replies come back the same way.
#[test]
fn ping_v4_and_v6_goes_through_the_raw_tunnel() {
    ping_through(40, QUIC, "rawping");
}

/// The same over udpplus (numbered datagrams) between IPv6 peers, and over tcp (messages on the TLS stream).
#[test]
fn ping_goes_raw_over_udpplus_and_tcp() {
    ping_through(48, UDPPLUS6, "rawplus");
    ping_through(49, TCP, "rawtcp");
}

/// The checks of [`ping_v4_and_v6_goes_through_the_raw_tunnel`] over `link`, rig subnet `offset`, app `app`.
fn ping_through(offset: u8, link: Link, app: &str) {
    let Some(r) = raw_rig(offset, link) else { return };
    let stack = raw_app_stack(&r, |t| t);
    let script =
        format!("echo @v4; ping -n -c 5 -i 0.3 -W 2 {}\necho @v6; ping -n -c 5 -i 0.3 -W 2 {}\ntrue", r.srv, r.srv6);
    let meters = ["peer.raw_packets_out_total", "peer.raw_packets_in_total", "peer.raw_drop_refused_total"];
    let (out, m) = r.run_in(&stack, app, &script, &meters);
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The first request may go while the carrier's connection is still being made (dropped, counted as down).
    assert!(received(&stdout, "@v4") >= 4, "{}: IPv4 ping through the tunnel: {}", link.transport, text(&out));
    assert!(received(&stdout, "@v6") >= 4, "IPv6 ping through the tunnel: {}", text(&out));
    assert!(m[0] >= 8 && m[1] >= 8, "A's raw meters (out, in): {m:?}");
    assert_eq!(m[2], 0, "B offers raw");
    assert!(r.b_meter("raw_packets_in_total") >= 8, "B took the requests");
    assert!(r.b_meter("raw_packets_out_total") >= 8, "B sent the replies back");
    assert_eq!(r.b_meter("raw_drop_malformed_total"), 0);
    assert!(r.b.get_u64("module.nat.translated_total") >= 16, "B's NAT translated both ways");
}

/// Flows that `terminate`'s match table passes (UDP to port 9000, TCP to port 8080) travel raw, over the udp
/// carrier between IPv6 peers: a numbered UDP stream reaches the server, and a curl download arrives intact.
#[test]
fn flows_the_match_table_passes_arrive_raw() {
    let Some(r) = raw_rig(41, UDP6) else { return };
    let stack = raw_app_stack(&r, |t| {
        let m = "match = [\"tcp *\", \"udp *\"]";
        assert!(t.contains(m), "the template's match table");
        t.replace(m, "match = [\"pass udp dport 9000\", \"pass tcp dport 8080\", \"tcp *\", \"udp *\"]")
    });
    let (_counter, counted) = common::peer::udp_counter(&r, "raw");
    let want = common::sha256(&r.www.path().join("blob"));
    let script = format!(
        "python3 -c \"import socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nfor i in range(300):\n    \
         s.sendto(b'%d raw' % i, ('{srv}', 9000))\n    time.sleep(0.002)\"\ncurl -sSf -m 30 http://{srv}:8080/blob | sha256sum",
        srv = r.srv
    );
    let meters = ["peer.raw_packets_out_total", "peer.raw_bytes_in_total", "peer.flows_total", "term.passed_total"];
    let (out, m) = r.run_in(&stack, "rawflows", &script, &meters);
    assert!(out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains(&want), "the download arrived intact: {}", text(&out));
    let (distinct, total) = common::peer::read_counter(&counted);
    assert!(distinct >= 290 && total == distinct, "the UDP stream arrived raw: {distinct} distinct of {total}");
    assert!(m[0] > 300, "A sent the datagrams and the TCP segments raw: {m:?}");
    assert!(m[1] > 2_000_000, "the download's segments came back raw: {m:?}");
    assert_eq!(m[2], 1, "only the raw pseudo-flow was opened on the carrier: {m:?}");
    assert!(m[3] >= m[0], "terminate passed what was carried raw: {m:?}");
    assert!(r.b_meter("raw_packets_in_total") >= m[0]);
    assert_eq!(r.b.get_u64("module.orig.connections_total"), 0, "B opened no flow for them");
}

/// A peer without the raw stack (plain `stacks/peer-in.toml`: no `raw` in its hello) gets no raw packet: A drops
/// and counts them, the ping fails, and the app's download is still carried.
#[test]
fn a_peer_without_raw_refuses_it_and_other_flows_go_on() {
    let Some(r) = Rig::with(42, true, TCP) else { return };
    let stack = raw_app_stack(&r, |t| t);
    let want = common::sha256(&r.www.path().join("blob"));
    let script = format!(
        "curl -sSf -m 30 http://{srv}:8080/blob | sha256sum\necho @v4; ping -n -c 3 -i 0.3 -W 1 {srv}\n\
         curl -sSf -m 30 http://{srv}:8080/blob | sha256sum",
        srv = r.srv
    );
    let meters = ["peer.raw_drop_refused_total", "peer.raw_packets_out_total", "peer.flows_total"];
    let (out, m) = r.run_in(&stack, "rawno", &script, &meters);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(received(&stdout, "@v4"), 0, "no reply without the raw stack: {}", text(&out));
    assert_eq!(stdout.matches(&want).count(), 2, "both downloads carried: {}", text(&out));
    assert!(m[0] >= 3, "the echo requests were refused and counted: {m:?}");
    assert_eq!(m[1], 0, "none sent: {m:?}");
    assert_eq!(m[2], 2, "the downloads' flows, not a raw one: {m:?}");
    assert_eq!(r.b_meter("malformed_total"), 0);
    assert_eq!(r.b_meter("flows_total"), 2, "B saw only the downloads");
}
