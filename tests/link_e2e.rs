//! End-to-end over a link face: flexstack takes over one end of a veth pair (AF_PACKET), answers ARP and
//! neighbour discovery for its own addresses on that link (the `link` module) and translates a sandboxed app's
//! traffic to them (the `nat` module). The other end is in a server namespace: ping, curl with a checksum and
//! iperf3 go over IPv4 and IPv6 with no host routing involved. Needs root (skips with a reason outside CI).

mod common;

use common::{
    answer, as_u64, eventually, octets, privileged, sh, text, unique, LinkGuard, Netns, SandboxDaemon, INJECTOR,
    MALFORMED_DROPS,
};
use flexstack_api::ops::Get;
use serde_json::Value as Json;
use std::time::Duration;

#[test]
fn apps_reach_a_server_over_a_link_face_with_flexstack_arp_ndp_and_nat() {
    if !privileged() {
        return;
    }
    let (app_octet, srv_octet) = octets();
    let (b, s) = (app_octet.wrapping_add(60), srv_octet.wrapping_add(60));
    // The link: `owned` stays in the host namespace for flexstack to take over; `peer` goes to the server.
    let srv = Netns::new("lk");
    let (owned, peer) = (unique("o"), unique("p"));
    sh("ip", &["link", "add", &owned, "type", "veth", "peer", "name", &peer]);
    let _link = LinkGuard(owned.clone());
    srv.adopt(&peer, &[&format!("10.{s}.9.1/24"), &format!("fd99:{s:x}::1/64")]);
    let mac = std::fs::read_to_string(format!("/sys/class/net/{owned}/address")).unwrap().trim().to_string();
    let www = tempfile::tempdir().unwrap();
    let blob: Vec<u8> = (0..5_000_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 9) as u8).collect();
    std::fs::write(www.path().join("blob"), &blob).unwrap();
    let _http = srv.serve_http("::", www.path());
    let _iperf = srv.spawn(&["iperf3", "-s", "-p", "5201"]);
    let _dns = srv.serve_dns(&format!("10.{s}.9.1"), &format!("fd99:{s:x}::1"));

    // The documented example, with this test's link filled in.
    let example = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/stacks/app-link.toml")).unwrap();
    let template = example
        .replace("10.77.0.0/16", &format!("10.{b}.0.0/16"))
        .replace("fd77:4d::/32", &format!("fd77:{b:x}::/32"))
        .replace("192.0.2.2", &format!("10.{s}.9.2"))
        .replace("2001:db8::2", &format!("fd99:{s:x}::2"))
        .replace("02:00:00:00:00:01", &mac)
        .replace("\"eth1\"", &format!("\"{owned}\""));
    let dir = tempfile::tempdir().unwrap();
    let template_file = dir.path().join("link-app.toml");
    std::fs::write(&template_file, template).unwrap();
    let d = SandboxDaemon::start(b);
    std::thread::sleep(Duration::from_millis(300));
    let want = sh("sh", &["-c", &format!("sha256sum {} | cut -d' ' -f1", www.path().join("blob").display())]);
    let script = format!(
        "ping -c 2 -W 2 10.{s}.9.1 && ping -6 -c 2 -W 2 fd99:{s:x}::1 && \
         curl -sf -m 60 --retry 5 --retry-connrefused http://10.{s}.9.1:8080/blob | sha256sum && \
         curl -sf -m 60 'http://[fd99:{s:x}::1]:8080/blob' | sha256sum && \
         timeout 120 iperf3 -c 10.{s}.9.1 -n 200M -J > {json} && \
         timeout 120 iperf3 -6 -c fd99:{s:x}::1 -n 50M -J > {json6} && \
         timeout 60 iperf3 -c 10.{s}.9.1 -u -b 20M -l 1000 -n 1000000 -J > {udp} && \
         dig +short +tries=3 +time=2 @10.{s}.9.1 flexstack.test A && \
         dig +short +tries=3 +time=2 @fd99:{s:x}::1 flexstack.test AAAA",
        json = dir.path().join("iperf.json").display(),
        json6 = dir.path().join("iperf6.json").display(),
        udp = dir.path().join("udp.json").display()
    );
    let out = d.run(&["--stack", template_file.to_str().unwrap(), "--", "sh", "-c", &script]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert_eq!(t.matches(want.trim()).count(), 2, "both downloads intact: {t}");
    let r: Json = serde_json::from_str(&std::fs::read_to_string(dir.path().join("iperf.json")).unwrap()).unwrap();
    assert!(r["end"]["sum_sent"]["bytes"].as_u64().unwrap() >= 200 << 20, "{}", r["end"]);
    let r: Json = serde_json::from_str(&std::fs::read_to_string(dir.path().join("iperf6.json")).unwrap()).unwrap();
    assert!(r["end"]["sum_sent"]["bytes"].as_u64().unwrap() >= 50 << 20, "IPv6: {}", r["end"]);
    let r: Json = serde_json::from_str(&std::fs::read_to_string(dir.path().join("udp.json")).unwrap()).unwrap();
    assert_eq!(r["end"]["sum"]["packets"].as_u64(), Some(1000), "UDP: {}", r["end"]);
    assert_eq!(r["end"]["sum"]["lost_packets"].as_u64(), Some(0), "UDP: {}", r["end"]);
    assert!(t.contains("10.1.2.3") && t.contains("fd00:1:2::3"), "dig over the link face: {t}");

    // The server saw flexstack's link address, resolved by ARP / NDP that flexstack answered.
    let neigh = String::from_utf8_lossy(&srv.run(&["ip", "neigh", "show"]).stdout).to_string();
    assert!(neigh.contains(&format!("10.{s}.9.2")) && neigh.contains(&mac), "{neigh}");
    assert!(neigh.contains(&format!("fd99:{s:x}::2")), "{neigh}");
    // The app's face went with it and gave the interface back its kernel IPv6 (tests/takeover_e2e.rs in detail):
    // the data plane lets go of the device right after the detach is answered.
    let disable_ipv6 = format!("/proc/sys/net/ipv6/conf/{owned}/disable_ipv6");
    let ipv6_of_owned = || std::fs::read_to_string(&disable_ipv6).unwrap().trim().to_string();
    assert!(eventually(5, || ipv6_of_owned() == "0"), "kernel IPv6 given back");

    // Malformed input on the link side while a transfer runs: frames injected from the server towards
    // flexstack's MAC. Each is dropped and counted with its reason; the transfer completes intact.
    // The reader sleeps first: the pipe fills, curl stops reading and TCP's window closes, so the transfer is still
    // open while the frames are injected (curl's --limit-rate does not hold it back here).
    let script = format!("curl -sf -m 120 http://10.{s}.9.1:8080/blob | (sleep 4; sha256sum)");
    let app = d.spawn_run(&["--stack", template_file.to_str().unwrap(), "--name", "lk", "--", "sh", "-c", &script]);
    d.wait_for_apps(1);
    std::thread::sleep(Duration::from_millis(300));
    // While flexstack holds the interface, the kernel has no address on it.
    let addrs = sh("ip", &["-br", "addr", "show", &owned]);
    assert!(!addrs.contains("10.") && !addrs.contains("fe80"), "{addrs}");
    assert_eq!(ipv6_of_owned(), "1");
    let (src4, dst4, src6, dst6) =
        (format!("10.{s}.9.1"), format!("10.{s}.9.2"), format!("fd99:{s:x}::1"), format!("fd99:{s:x}::2"));
    let out = srv.run(&["python3", INJECTOR, &peer, &src4, &dst4, &src6, &dst6, "--mac", &mac]);
    assert!(out.status.success(), "{}", text(&out));
    // The flood comes last: once its drops are counted, everything before it has been processed.
    let drops = |d: &SandboxDaemon| -> std::collections::BTreeMap<String, u64> {
        let out = d.cli(&["-j", "get", "module.lk-*.drop_*"]);
        answer::<Get>(&out)
            .map(|o| {
                o.iter().map(|(k, x)| (k.clone(), as_u64(&x.value).unwrap_or(0))).filter(|(_, n)| *n > 0).collect()
            })
            .unwrap_or_default()
    };
    let sum_of = |all: &std::collections::BTreeMap<String, u64>, reason: &str| -> u64 {
        all.iter().filter(|(k, _)| k.ends_with(&format!(".drop_{reason}_total"))).map(|(_, n)| n).sum()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    let mut all = drops(&d);
    while sum_of(&all, "memory") < 2000 - 64 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        all = drops(&d);
    }
    let io = text(&d.cli(&["get", "module.lk-eth.rx_*", "module.lk-*.frames_in_total", "module.lk-frag.*pending*"]));
    if d.apps().is_none_or(|a| a.is_empty()) {
        let out = app.wait_with_output().unwrap();
        panic!("the app ended before the checks: {}\ncounted: {all:#?}\n{io}", text(&out));
    }
    let rounds = 20;
    // On the link, truncated packets are counted at least once a round; the Ethernet and ARP drops are the link's.
    let expected =
        MALFORMED_DROPS.iter().map(|&(_, reason, n)| (reason, if reason == "truncated" { rounds } else { n }));
    for (reason, at_least) in expected.chain([("bad_ethertype", rounds), ("arp_malformed", rounds)]) {
        let n = sum_of(&all, reason);
        assert!(
            n >= at_least,
            "drop_{reason}: {n}, expected at least {at_least}\ninjected: {}\ncounted: {all:#?}\n{io}",
            text(&out)
        );
    }
    let out = app.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).split_whitespace().next(), Some(want.trim()), "intact under fire");
    assert!(d.cli(&["status"]).status.success(), "the daemon survived");
}

/// Frames a link face's socket could not queue while flexstack did not read it (the daemon stopped with SIGSTOP)
/// are counted on the face (`drop_kernel_queue_total`, from the socket's PACKET_STATISTICS): what the peer sent,
/// less what the face read, is what the meter says (issue 16).
#[test]
fn frames_a_link_face_socket_drops_are_counted() {
    if !privileged() {
        return;
    }
    let peer_ns = Netns::new("lq");
    let (owned, peer) = (unique("o"), unique("p"));
    sh("ip", &["link", "add", &owned, "type", "veth", "peer", "name", &peer]);
    let _link = LinkGuard(owned.clone());
    sh("sysctl", &["-qw", &format!("net.ipv6.conf.{owned}.disable_ipv6=1")]);
    sh("ip", &["link", "set", &owned, "up"]);
    sh("ip", &["link", "set", &peer, "netns", &peer_ns.name]);
    peer_ns.run(&["sysctl", "-qw", &format!("net.ipv6.conf.{peer}.disable_ipv6=1")]);
    peer_ns.run(&["ip", "addr", "add", "10.96.0.1/24", "dev", &peer]);
    peer_ns.run(&["ip", "link", "set", &peer, "up"]);
    // No ARP: the frames go to a made-up neighbour, and nothing answers them.
    peer_ns.run(&["ip", "neigh", "add", "10.96.0.2", "lladdr", "02:00:00:00:00:02", "dev", &peer]);
    let d = common::Daemon::start(
        &format!(
            "links = [\"p -> s\"]\n[modules.p]\nkind = \"packet\"\ninterface = \"{owned}\"\n\
             [modules.s]\nkind = \"sink\"\n"
        ),
        &[],
    );
    const SENT: u64 = 40_000;
    let pid = d.child.id().to_string();
    sh("kill", &["-STOP", &pid]);
    let sent = peer_ns.run(&[
        "python3",
        "-c",
        &format!(
            "import socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
             for i in range({SENT}):\n    s.sendto(b'x' * 64, ('10.96.0.2', 9000))\n    \
             if i % 500 == 499: time.sleep(0.01)\n"
        ),
    ]);
    sh("kill", &["-CONT", &pid]);
    assert!(sent.status.success(), "{}", text(&sent));
    let mut read = 0;
    let mut counted = 0;
    for _ in 0..50 {
        read = d.get_u64("module.p.rx_packets_total");
        counted = d.get_u64("module.p.drop_kernel_queue_total");
        if counted > 0 && read + counted >= SENT {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("sent {SENT}, read by the face {read}, counted as dropped {counted}");
    assert!(read < SENT, "the socket's queue held some, not all: read {read} of {SENT}");
    assert!((read + counted).abs_diff(SENT) * 100 <= SENT, "sent {SENT}, read {read}, counted {counted}");
}
