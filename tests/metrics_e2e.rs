//! `flexstack daemon --metrics`: a real Prometheus (Debian's package, started here on loopback with its own config
//! and storage) scrapes a daemon whose sandboxed app sends a known packet rate with iperf3, and its HTTP API
//! returns the expected series and that rate; `promtool check metrics` is clean on the exposition; malformed
//! requests, a 100 KiB header and 200 idle connections are refused while the data plane keeps forwarding and
//! /metrics is served again; every metric the Grafana dashboard (contrib/grafana) queries is in a live scrape.
//! Needs root (skips with a reason outside CI).

mod common;

use common::prometheus::{free_port, Prometheus};
use common::{answer, as_u64, octets, privileged, tcp_exchange as exchange, text, Background, SandboxDaemon, Server};
use flexstack_api::ops::Get;
use serde_json::Value as Json;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A sandbox daemon (app subnet 10.`octet`.0.0/16) serving /metrics on `port`, with `extra` arguments.
fn metrics_daemon(octet: u8, port: u16, extra: &[&str]) -> SandboxDaemon {
    let mut args = vec!["--metrics".to_string(), format!("127.0.0.1:{port}")];
    args.extend(extra.iter().map(|a| a.to_string()));
    let d = SandboxDaemon::start_with(octet, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(d.cli(&["status"]).status.success(), "the daemon did not start");
    d
}

/// The body of `GET /metrics` (classic text format unless `openmetrics`); panics on any other status.
fn scrape(port: u16, openmetrics: bool) -> String {
    let accept = if openmetrics { "application/openmetrics-text; version=1.0.0" } else { "text/plain" };
    let answer = exchange(port, format!("GET /metrics HTTP/1.1\r\nAccept: {accept}\r\n\r\n").as_bytes());
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer:.300}");
    answer.split_once("\r\n\r\n").unwrap().1.to_string()
}

/// The value of the sample `line_start` (a metric name with its labels, as exposed) in an exposition.
fn sample(exposition: &str, line_start: &str) -> Option<f64> {
    exposition.lines().find_map(|l| l.strip_prefix(line_start)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The metric names in every query of contrib/grafana/flexstack.json (panels' targets and template variables),
/// after checking that it is a Grafana dashboard: a uid, a title, panels each with a type, a position and
/// Prometheus targets.
fn dashboard_metrics() -> std::collections::BTreeSet<String> {
    let path = common::repo().join("contrib/grafana/flexstack.json");
    let d: Json = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(d["uid"].is_string() && d["title"].is_string() && d["schemaVersion"].is_u64(), "{}", path.display());
    let mut queries: Vec<String> = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        assert!(p["type"].is_string() && p["gridPos"]["w"].is_u64() && p["gridPos"]["h"].is_u64(), "{p}");
        let targets = p["targets"].as_array().unwrap_or_else(|| panic!("a panel without targets: {p}"));
        assert!(!targets.is_empty(), "{p}");
        for t in targets {
            assert_eq!(t["datasource"]["type"], "prometheus", "{t}");
            queries.push(t["expr"].as_str().unwrap_or_else(|| panic!("a target without expr: {t}")).to_string());
        }
    }
    for v in d["templating"]["list"].as_array().expect("templating") {
        if let Some(q) = v["query"]["query"].as_str() {
            queries.push(q.to_string());
        }
    }
    let mut names = std::collections::BTreeSet::new();
    for q in &queries {
        let mut rest = q.as_str();
        while let Some(i) = rest.find("flexstack_") {
            let name: String = rest[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            rest = &rest[i + name.len()..];
            names.insert(name);
        }
    }
    names
}

#[test]
fn prometheus_scrapes_the_series_and_the_packet_rate_of_real_traffic() {
    if !privileged() {
        return;
    }
    let (app_octet, srv_octet) = octets();
    let srv = Server::new(srv_octet.wrapping_add(60), b"");
    let _iperf = srv.ns.spawn(&["iperf3", "-s", "-p", "5201"]);
    let port = free_port();
    let d = metrics_daemon(app_octet.wrapping_add(60), port, &["--metrics-flows", "3"]);
    std::thread::sleep(Duration::from_millis(300));
    // 200 UDP datagrams a second: 500 bytes of payload at 800 kbit/s. iperf3 paces to the average bit rate over
    // the whole test (it catches up after a late timer), so every 10 s window carries 2000 ± a few datagrams.
    let _app = Background(d.spawn_run(&[
        "--name", "pm", "--", "iperf3", "-4", "-c", &srv.v4, "-u", "-b", "800k", "-l", "500", "-t", "60",
    ]));
    let prom = Prometheus::start(port);
    let deadline = Instant::now() + Duration::from_secs(30);
    while prom.query("up{job=\"flexstack\"} == 1").is_empty() {
        assert!(Instant::now() < deadline, "the target never came up: {:?}", prom.get("/api/v1/targets"));
        std::thread::sleep(Duration::from_millis(250));
    }
    // Wait until the UDP flow is on its port and a full 10 s window of scrapes holds it.
    let udp = "flexstack_port_frames_out_total{module=\"pm-flows\",port=\"udp\"}";
    let deadline = Instant::now() + Duration::from_secs(30);
    while prom.query(&format!("{udp} > 0")).is_empty() {
        assert!(Instant::now() < deadline, "no UDP frames in Prometheus");
        std::thread::sleep(Duration::from_millis(250));
    }
    std::thread::sleep(Duration::from_secs(12));

    // The series: one family per kind of meter, the things as labels.
    for (promql, what) in [
        ("flexstack_module_frames_in_total{module=\"pm-ip\",kind=\"ip\"}", "a standard module meter"),
        ("flexstack_module_drops_total{module=\"pm-ip\",kind=\"ip\",reason=\"bad_checksum\"}", "a drop reason"),
        ("flexstack_port_frames_in_total{module=\"pm-ip\",port=\"in\"}", "a port meter"),
        ("flexstack_module_busy_seconds_total{module=\"pm-ip\"}", "a time in seconds"),
        ("flexstack_tun_rx_packets_total{module=\"pm\",kind=\"tun\"}", "a kind's own meter"),
        ("flexstack_classify_udp_timeout_seconds{module=\"pm-flows\"}", "a knob in seconds"),
        ("flexstack_switch_runs_total", "a switch meter"),
        ("flexstack_module_info{module=\"pm-frag\",kind=\"reassemble\"}", "a module's info"),
    ] {
        assert_eq!(prom.query(promql).len(), 1, "{what}: {promql}");
    }
    let drops = prom.query("flexstack_module_drops_total{module=\"pm-ip\"}");
    assert!(drops.len() >= 5, "one series per drop reason: {drops:?}");
    assert_eq!(prom.value("flexstack_classify_udp_timeout_seconds{module=\"pm-flows\"}"), 30.0, "ms → s");
    // Per-flow series: opt-in, capped at --metrics-flows 3, the UDP flow (the most bytes) among them.
    let flows = prom.query("flexstack_flow_info");
    assert!((1..=3).contains(&flows.len()), "{flows:?}");
    assert!(flows.iter().any(|f| f["metric"]["protocol"] == "udp"), "{flows:?}");
    // Prometheus read the OpenMetrics metadata: the unit of a family.
    let (_, meta) = prom.get("/api/v1/metadata?metric=flexstack_module_busy_seconds").unwrap();
    assert!(meta.contains("\"unit\":\"seconds\"") && meta.contains("\"type\":\"counter\""), "{meta}");

    // The rate of the UDP port over the last 10 s is the sending rate: 200/s. The tolerance, ±10 %: iperf3's
    // bursts when it catches up, and rate()'s extrapolation over ten 1 s scrapes (one scrape off: ±10 %).
    let rate = prom.value(&format!("rate({udp}[10s])"));
    assert!((180.0..=220.0).contains(&rate), "rate of {udp}: {rate}/s, sent at 200/s");
    let tun = prom.value("rate(flexstack_tun_rx_packets_total{module=\"pm\"}[10s])");
    assert!((180.0..=230.0).contains(&tun), "the app's packets read by its TUN face: {tun}/s");
    eprintln!("Prometheus: UDP port {rate:.1}/s, app TUN {tun:.1}/s (sent 200/s)");

    // promtool lints the classic text exposition clean.
    let mut lint = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    lint.stdin.take().unwrap().write_all(scrape(port, false).as_bytes()).unwrap();
    let lint = lint.wait_with_output().unwrap();
    assert!(lint.status.success() && lint.stdout.is_empty() && lint.stderr.is_empty(), "{}", text(&lint));
    // The OpenMetrics exposition ends in # EOF; how long a scrape takes is exported.
    let om = scrape(port, true);
    assert!(om.ends_with("# EOF\n"), "{:.200}", &om[om.len().saturating_sub(200)..]);
    // Every metric the shipped Grafana dashboard queries is in this live scrape.
    let exposed: std::collections::BTreeSet<&str> =
        om.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split(['{', ' ']).next()).collect();
    let queried = dashboard_metrics();
    assert!(queried.len() >= 10, "{queried:?}");
    let missing: Vec<&String> = queried.iter().filter(|m| !exposed.contains(m.as_str())).collect();
    assert!(missing.is_empty(), "the dashboard queries metrics no scrape exposes: {missing:?}");
    let collect = sample(&om, "flexstack_metrics_collect_seconds").unwrap();
    eprintln!("one scrape read the registry in {:.2} ms ({} lines)", collect * 1e3, om.lines().count());
}

#[test]
fn malformed_requests_huge_headers_and_idle_connections_leave_it_serving() {
    if !privileged() {
        return;
    }
    let (app_octet, srv_octet) = octets();
    let srv = Server::new(srv_octet.wrapping_add(61), b"");
    let port = free_port();
    let d = metrics_daemon(app_octet.wrapping_add(61), port, &[]);
    let _app = Background(d.spawn_run(&["--name", "pq", "--", "ping", "-q", "-i", "0.02", "-c", "1500", &srv.v4]));
    let icmp = "module.pq-flows.port.icmp.frames_out_total";
    let forwarded = || answer::<Get>(&d.cli(&["-j", "get", icmp])).and_then(|v| as_u64(&v[icmp].value)).unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while forwarded() == 0 {
        assert!(Instant::now() < deadline, "no ping through the sandbox");
        std::thread::sleep(Duration::from_millis(50));
    }

    // Malformed heads: 400, and counted.
    for bad in [
        &b"GARBAGE\r\n\r\n"[..],
        b"GET /metrics HTTP/9\r\n\r\n",
        b"\x00\xff\xfe\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nno-colon\r\n\r\n",
    ] {
        let a = exchange(port, bad);
        assert!(a.starts_with("HTTP/1.1 400 "), "{bad:?}: {a:.100}");
    }
    assert!(exchange(port, b"DELETE /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405 "));
    assert!(exchange(port, b"GET /admin HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
    // A 100 KiB header: 431 (or the connection reset while the rest is still being sent).
    let mut big = b"GET /metrics HTTP/1.1\r\nX-Big: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', 100 * 1024));
    big.extend_from_slice(b"\r\n\r\n");
    let a = exchange(port, &big);
    assert!(a.is_empty() || a.starts_with("HTTP/1.1 431 "), "{a:.100}");

    // 200 idle connections: beyond the 16 served at once, each is answered 503 and closed.
    let before = forwarded();
    let idle: Vec<TcpStream> = (0..200).map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(500));
    let refused = idle
        .iter()
        .filter(|c| {
            let mut c = *c;
            c.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            let mut buf = [0u8; 64];
            matches!(c.read(&mut buf), Ok(n) if buf[..n].starts_with(b"HTTP/1.1 503 "))
        })
        .count();
    assert!(refused >= 200 - 16, "only {refused} of 200 idle connections were refused");
    // Meanwhile the data plane forwards.
    std::thread::sleep(Duration::from_millis(500));
    assert!(forwarded() > before, "no frames forwarded while 200 connections were idle");
    // The 16 that were let in time out (2 s to send a request); then a scrape is served.
    std::thread::sleep(Duration::from_millis(2000));
    let exposition = scrape(port, false);
    drop(idle);
    let rejected = |reason: &str| {
        sample(&exposition, &format!("flexstack_metrics_http_rejected_total{{reason=\"{reason}\"}}")).unwrap()
    };
    assert!(rejected("malformed") >= 4.0, "{}", rejected("malformed"));
    assert_eq!((rejected("method"), rejected("not_found")), (1.0, 1.0));
    assert!(rejected("too_many_connections") >= 184.0 && rejected("timeout") >= 1.0, "{exposition:.0}");
    if !a.is_empty() {
        assert_eq!(rejected("too_large"), 1.0);
    }
    assert!(sample(&exposition, "flexstack_module_frames_in_total{module=\"pq-ip\",kind=\"ip\"}").unwrap() > 0.0);
    assert!(d.cli(&["status"]).status.success());
}
