//! The server role of the stream endpoints, with simulated time (docs/streams.md, "The server role"): the app
//! listens, the network's host connects to it; `originate` accepts the connection (its SYN-ACK held), `Open` travels
//! up, `terminate` connects to the app and answers `Open` down when the app accepted. Each test runs over IPv4 and
//! IPv6 (see `streamkit`: here the "server" host is the network's client).

mod streamkit;
use flexstack_core::testing::take;
use flexstack_core::Direction;
use smoltcp::socket::tcp::State;
use std::time::Duration;
use streamkit::*;

/// originate's first own flow id (`SERVER_IDS` + 1).
const FIRST: u64 = (1 << 40) + 1;
const SERVE: &str =
    "match=[\"pass tcp dport 22 role server\", \"tcp dport 8080,8081 role server\", \"udp dport 5353 role server\"]";
const SYN: u8 = 0x02;
const ACK: u8 = 0x10;

/// A lab whose originate terminates the server role on TCP 8080-8081 and UDP 5353.
fn lab(v6: bool, t_args: &[&str]) -> Lab {
    let mut lab = Lab::new(v6, t_args, &[SERVE, "app=\"web\""], &[("p", "stream-pass", vec![])]);
    lab.keep_seen = true;
    lab
}

#[test]
fn a_connection_from_the_network_is_terminated_and_carries_2mb_both_ways() {
    const N: usize = 2 * 1024 * 1024;
    for v6 in [false, true] {
        let mut lab = lab(v6, &[]);
        let srv = lab.app_listen(8080, 65536);
        let cli = lab.net_connect(8080, 65536);
        let mut s = Pump::new(pattern(1, N), true);
        let mut c = Pump::new(pattern(2, N), true);
        let done = lab.until(60_000, |lab| {
            s.drive(lab.app.tcp(srv));
            c.drive(lab.server.tcp(cli));
            if lab.app.tcp(srv).state() == State::Established {
                // While it runs: both sides of the flow under originate's own id, with the role in the tuple.
                for side in ["terminate", "originate"] {
                    let tuple = lab.text(&format!("flow.{side}.{FIRST}.tuple")).unwrap_or_default();
                    let want =
                        format!("tcp {} -> {} role server app", sa(lab.server_addr(), 40001), sa(lab.app_addr(), 8080));
                    assert!(tuple.starts_with(&want), "v6 {v6} {side}: {tuple}");
                }
            }
            s.got.len() == N && c.got.len() == N
        });
        assert!(done, "v6 {v6}: the app got {} the client got {}", s.got.len(), c.got.len());
        assert!(s.got == pattern(2, N), "the client's bytes reach the app intact");
        assert!(c.got == pattern(1, N), "the app's bytes reach the client intact");
        // originate accepted (its own flow), terminate connected; the app's bytes go up, the client's down.
        assert_eq!(lab.meter("module.o.connections_total"), 1);
        assert_eq!(lab.meter("module.t.connections_total"), 1);
        assert_eq!(lab.meter("module.o.rule2_matches_total"), 1);
        assert_eq!(lab.meter("module.p.data_bytes_up_total"), N as u64);
        assert_eq!(lab.meter("module.p.data_bytes_down_total"), N as u64);
        // The app saw the client's own address (terminate connects from it), the client the app's.
        let from_t = lab.seen_to_app.iter().find(|p| tcp_flags(p) == Some(SYN)).expect("terminate's SYN");
        let info = flexstack_wire::packet::PacketInfo::parse(from_t).unwrap();
        assert_eq!((info.src, info.dst, info.dst_port), (lab.server_addr(), lab.app_addr(), 8080));
        lab.run(12_000);
        assert_eq!(lab.connections(), 0, "v6 {v6}: nothing left after TIME-WAIT");
        assert_eq!(lab.meter("module.t.aborts_sent_total") + lab.meter("module.o.aborts_sent_total"), 0);
        assert_eq!(lab.meter("module.t.stream_bad_total") + lab.meter("module.o.stream_bad_total"), 0);
        assert!(lab.passed().is_empty() && lab.net_passed().is_empty());
    }
}

/// The client's SYN-ACK waits for the app: none reaches the network before the app's own SYN-ACK reached
/// `terminate` (with a 20 ms delay on the network's side, a SYN-ACK sent at once would come first).
#[test]
fn the_syn_ack_to_the_client_follows_the_apps_acceptance() {
    for v6 in [false, true] {
        let mut lab = lab(v6, &[]);
        lab.net_delay = Duration::from_millis(20);
        let srv = lab.app_listen(8080, 65536);
        let cli = lab.net_connect(8080, 65536);
        // Step by step: the SYN-ACK reaches the network only once the app's SYN-ACK reached terminate.
        let mut app_answered_at = None;
        let mut client_answered_at = None;
        for step in 0..200 {
            lab.step();
            if app_answered_at.is_none() && lab.seen_from_app.iter().any(|p| tcp_flags(p) == Some(SYN | ACK)) {
                app_answered_at = Some(step);
            }
            if client_answered_at.is_none() && lab.seen_to_net.iter().any(|p| tcp_flags(p) == Some(SYN | ACK)) {
                client_answered_at = Some(step);
            }
        }
        let (a, c) = (app_answered_at.expect("the app answered"), client_answered_at.expect("the client too"));
        assert!(a <= c, "v6 {v6}: the client's SYN-ACK at step {c}, the app's at {a}");
        assert_eq!(lab.app.tcp(srv).state(), State::Established);
        assert_eq!(lab.server.tcp(cli).state(), State::Established);
    }
}

#[test]
fn a_closed_port_in_the_app_refuses_the_client_without_a_syn_ack() {
    for v6 in [false, true] {
        let mut lab = lab(v6, &[]);
        lab.net_delay = Duration::from_millis(20); // a SYN-ACK sent early would reach the client before the RST
        let cli = lab.net_connect(8081, 65536); // the app listens on nothing: its stack answers RST
        lab.assert_refused(false, cli, &format!("v6 {v6}: the network's client"));
        assert_eq!(lab.meter("module.t.aborts_sent_total"), 1, "terminate: Abort(refused)");
        assert_eq!(lab.meter("module.o.aborts_received_total"), 1);
        lab.assert_empty_after(5);
    }
}

/// Connections the match table does not choose for the server role pass, as before: another port, an exception
/// (`pass ... role server`), and with a table of client rules only (`tcp *`), every connection from the network.
#[test]
fn connections_from_the_network_not_chosen_pass_unchanged() {
    for v6 in [false, true] {
        let mut lab = lab(v6, &[]);
        let (net, app) = (sa(lab.server_addr(), 50000), sa(lab.app_addr(), 22));
        let syn = tcp(net, app, 1, 0, SYN, &[], &[], false);
        let other = tcp(net, sa(lab.app_addr(), 9000), 1, 0, SYN, &[], &[], false);
        lab.inject("o", "in", vec![syn.clone(), other.clone()], Direction::Up);
        lab.run_switch();
        let passed: Vec<Vec<u8>> = lab.net_passed().into_iter().map(|s| s.data).collect();
        assert_eq!(passed, [syn.clone(), other], "v6 {v6}: both passed byte for byte");
        assert_eq!(lab.meter("module.o.rule1_matches_total"), 1, "the exception decided for port 22");
        assert_eq!(lab.meter("module.o.connections_total"), 0);
        let mut plain = Lab::new(v6, &[], &["match=[\"tcp *\", \"udp *\"]"], &[]);
        plain.inject("o", "in", vec![syn.clone()], Direction::Up);
        plain.run_switch();
        assert_eq!(plain.net_passed().len(), 1, "v6 {v6}: `tcp *` is the client role's");
        assert_eq!(plain.meter("module.o.connections_total"), 0);
    }
}

/// The client role and the server role at once, through one pair of endpoints: each flow intact, under its own id.
#[test]
fn both_roles_at_once() {
    const N: usize = 500_000;
    for v6 in [false, true] {
        let mut lab = lab(v6, &[]);
        let (net_srv, app_cli) = lab.pair(); // the app connects out to port 80 (client role)
        let app_srv = lab.app_listen(8080, 65536);
        let net_cli = lab.net_connect(8080, 65536); // the network connects in (server role)
        let mut pumps: Vec<Pump> = (0..4).map(|i| Pump::new(pattern(10 + i, N), true)).collect();
        let names = ["flow.terminate.1.tuple".to_string(), format!("flow.originate.{FIRST}.tuple")];
        let mut tuples = [String::new(), String::new()];
        let done = lab.until(30_000, |lab| {
            pumps[0].drive(lab.app.tcp(app_cli));
            pumps[1].drive(lab.server.tcp(net_srv));
            pumps[2].drive(lab.app.tcp(app_srv));
            pumps[3].drive(lab.server.tcp(net_cli));
            for (name, t) in names.iter().zip(&mut tuples) {
                if t.is_empty() {
                    *t = lab.text(name).unwrap_or_default();
                }
            }
            pumps.iter().all(|p| p.got.len() == N)
        });
        assert!(done, "v6 {v6}: {:?}", pumps.iter().map(|p| p.got.len()).collect::<Vec<_>>());
        for (a, b) in [(0, 1), (1, 0), (2, 3), (3, 2)] {
            assert!(pumps[a].got == pattern(10 + b as u64, N), "v6 {v6}: pump {a} got pump {b}'s bytes");
        }
        assert_eq!(lab.meter("module.t.connections_total"), 2);
        assert_eq!(lab.meter("module.o.connections_total"), 2);
        let client = format!("tcp {} -> {} app", sa(lab.app_addr(), 40001), sa(lab.server_addr(), 80));
        assert!(tuples[0].starts_with(&client), "v6 {v6}: flow 1 is the app's (client role): {tuples:?}");
        let server = format!("tcp {} -> {} role server app", sa(lab.server_addr(), 40002), sa(lab.app_addr(), 8080));
        assert!(tuples[1].starts_with(&server), "v6 {v6}: {tuples:?}");
    }
}

/// UDP: a first datagram from the network to a port chosen for the server role opens a flow; the app's answers go
/// back from its address, exact; the flow ends when idle; a closed port in the app ends it (ICMP to the client).
#[test]
fn a_udp_flow_from_the_network() {
    for v6 in [false, true] {
        let mut lab = lab(v6, &["udp_timeout_ms=2000"]);
        let (client, app) = (sa(lab.server_addr(), 6000), sa(lab.app_addr(), 5353));
        let queries: Vec<Vec<u8>> = (0..50).map(|i| pattern(200 + i, 1 + (i as usize * 29) % 1300)).collect();
        lab.inject("o", "in", queries.iter().map(|q| udp(client, app, q)).collect(), Direction::Up);
        lab.run_switch();
        let to_app = take(&lab.to_app);
        assert_eq!(to_app.len(), 50, "v6 {v6}: one datagram to the app per datagram in");
        for (p, q) in to_app.iter().zip(&queries) {
            assert_eq!(parse_udp(&p.data), Some((client, app, q.clone())), "from the client's address, intact");
        }
        let answers: Vec<Vec<u8>> = (0..80).map(|i| pattern(300 + i, 1 + (i as usize * 11) % 1200)).collect();
        lab.inject("t", "in", answers.iter().map(|a| udp(app, client, a)).collect(), Direction::Down);
        lab.run_switch();
        let to_net = take(&lab.to_net);
        assert_eq!(to_net.len(), 80);
        for (p, a) in to_net.iter().zip(&answers) {
            assert_eq!(parse_udp(&p.data), Some((app, client, a.clone())), "from the app's address, intact");
        }
        assert_eq!(lab.meter("module.o.udp_flows_total"), 1);
        assert_eq!(lab.meter("module.t.udp_flows_active"), 1);
        let up: u64 = queries.iter().map(|q| q.len() as u64).sum();
        assert_eq!(lab.meter(&format!("flow.originate.{FIRST}.bytes_up_total")), up);
        assert_eq!(lab.meter(&format!("flow.terminate.{FIRST}.bytes_up_total")), up);
        lab.run(2500);
        assert_eq!(lab.meter("module.o.udp_flows_active") + lab.meter("module.t.udp_flows_active"), 0, "idle: gone");
        // A port the app does not serve: its ICMP port unreachable ends the flow and reaches the client.
        let q = udp(client, app, b"q");
        lab.inject("o", "in", vec![q], Direction::Up);
        lab.run_switch();
        let sent = take(&lab.to_app);
        let icmp = icmp_unreachable(lab.app_addr(), lab.server_addr(), &sent[0].data);
        lab.inject("t", "in", vec![icmp], Direction::Down);
        lab.run_switch();
        let back = take(&lab.to_net);
        assert_eq!(back.len(), 1, "v6 {v6}: the error reaches the client");
        let info = flexstack_wire::packet::PacketInfo::parse(&back[0].data).unwrap();
        assert_eq!(info.icmp, Some(if v6 { (1, 4) } else { (3, 3) }), "port unreachable");
        assert_eq!((info.src, info.dst), (lab.app_addr(), lab.server_addr()));
        assert_eq!(lab.meter("module.o.udp_flows_active") + lab.meter("module.t.udp_flows_active"), 0);
    }
}
