//! End-to-end: `flexstack flow list/show` of a sandboxed iperf3 TCP client forwarded through the default app chain
//! (stacks/app-default.toml), over IPv4 and IPv6: the flow's app, 5-tuple and rising bytes, and its transport
//! meters `flow.<id>.tcp.*` read from the app's own socket (sock_diag) against `ss -ti` in the app's namespace at
//! about the same time. An unknown flow id is a clear error with a non-zero exit. Needs root (skips with a reason
//! outside CI).

mod common;

use common::{privileged_serial, server_and_daemon, text, upper_median, SandboxDaemon};
use flexstack_api::ops::{FlowDetail, FlowInfo, FlowList, FlowShow, Handling};
use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::time::{Duration, Instant};

/// The data connection of iperf3 to `server`:5201 in `flow list`: of its two TCP flows there (control and data),
/// the one with the most bytes down.
fn data_flow(d: &SandboxDaemon, server: IpAddr) -> Option<FlowInfo> {
    let flows = common::answer::<FlowList>(&d.cli(&["-j", "flow", "list"]))?;
    flows
        .into_iter()
        .filter(|f| f.protocol == "tcp" && f.dst == Some(server) && f.dst_port == Some(5201))
        .max_by_key(|f| f.bytes_down.unwrap_or(0))
}

/// What `ss -tinH` in `netns` says of the socket from local port `port`: (rtt in µs, cwnd, cc, whole line).
fn ss(netns: &str, port: u16) -> Option<(f64, u64, String, String)> {
    let out = Command::new("ip")
        .args(["netns", "exec", netns, "ss", "-tinH", "state", "established", &format!("sport = :{port}")])
        .output()
        .ok()?;
    let line = String::from_utf8_lossy(&out.stdout).split_whitespace().collect::<Vec<_>>().join(" ");
    let field = |key: &str| line.split(' ').find_map(|w| w.strip_prefix(key)).map(str::to_string);
    let rtt_ms: f64 = field("rtt:")?.split('/').next()?.parse().ok()?;
    let cwnd: u64 = field("cwnd:")?.parse().ok()?;
    // The congestion control's name is printed alone, before `wscale:`.
    let cc = line.split(' ').take_while(|w| !w.starts_with("wscale:")).last()?.to_string();
    Some((rtt_ms * 1000.0, cwnd, cc, line))
}

#[test]
fn a_forwarded_iperf3_flow_is_listed_with_its_tuple_bytes_and_tcp_info() {
    let Some(_serial) = privileged_serial() else { return };
    let (srv, d) = server_and_daemon(30, b"");
    let _iperf = srv.ns.spawn(&["iperf3", "-s", "-p", "5201"]);
    std::thread::sleep(Duration::from_millis(300));
    for (family, server) in [("4", srv.v4.clone()), ("6", srv.v6.clone())] {
        let server: IpAddr = server.parse().unwrap();
        // Paced, so that the window and the round-trip time are steady enough to compare samples taken a few ms
        // apart; long enough for five samples a second apart.
        let (family_flag, server_text) = (format!("-{family}"), server.to_string());
        let args = [
            "--name",
            "perf",
            "--",
            "timeout",
            "30",
            "iperf3",
            &family_flag,
            "-c",
            &server_text,
            "-t",
            "8",
            "-b",
            "200M",
        ];
        let app = d.spawn_run(&args);
        d.wait_for_apps(1);
        let apps = d.apps().unwrap();
        let (app_addr, netns): (IpAddr, String) = {
            let a = &apps[0];
            ((if family == "4" { &a.ipv4 } else { &a.ipv6 }).parse().unwrap(), a.netns.clone())
        };
        // The flow appears with its app, 5-tuple and how it is handled.
        let deadline = Instant::now() + Duration::from_secs(10);
        let first = loop {
            match data_flow(&d, server) {
                Some(f) if f.bytes_down.unwrap_or(0) > 1_000_000 && f.tcp.is_some() => break f,
                _ if Instant::now() > deadline => {
                    panic!("IPv{family}: no data flow with TCP meters:\n{}", text(&d.cli(&["flow", "list"])))
                }
                _ => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        assert_eq!(
            (first.app.as_deref(), first.handling, first.module.as_str()),
            (Some("perf"), Handling::Forwarded, "perf-flows")
        );
        assert_eq!((first.src, first.dst, first.dst_port), (Some(app_addr), Some(server), Some(5201)), "{first:?}");
        let port = first.src_port.expect("a source port");
        assert!(first.id.starts_with("perf."), "{}", first.id);
        // Its bytes rise, mostly down (iperf3 sends).
        std::thread::sleep(Duration::from_millis(1200));
        let later = data_flow(&d, server).unwrap();
        assert_eq!(later.id, first.id);
        eprintln!("{}", text(&d.cli(&["flow", "list"])));
        assert!(later.bytes_down > first.bytes_down, "{first:?}\n{later:?}");
        assert!(later.bytes_down.unwrap() > 10 * later.bytes_up.unwrap(), "{later:?}");

        // The transport meters against ss, five samples: srtt and cwnd of the same socket, read by the poller (every
        // second) and by ss now. The ratios' median must be within 3x for srtt (a round trip through the daemon
        // varies by that much between samples under load; the meter may be up to a second older) and within 2x for
        // cwnd (paced: it moves little); cc and state must be equal.
        let (mut rtt_ratios, mut cwnd_ratios) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            let out = d.cli(&["-j", "flow", "show", &first.id]);
            let detail = common::answer::<FlowShow>(&out).unwrap_or_else(|| panic!("{}", text(&out)));
            let FlowDetail { flow, vars } = detail;
            let (rtt_us, cwnd, cc, line) = ss(&netns, port).unwrap_or_else(|| panic!("no socket from port {port}"));
            let tcp = flow.tcp.expect("tcp meters");
            let (srtt, meter_cwnd) = (tcp.srtt_us.unwrap(), tcp.cwnd.unwrap());
            assert!(srtt > 0 && meter_cwnd > 0, "{tcp:?}");
            assert_eq!(tcp.state.as_deref(), Some("established"));
            assert_eq!(tcp.cc.as_deref(), Some(cc.as_str()), "ss: {line}");
            assert!(tcp.bytes_in_flight.is_some() && tcp.delivery_rate.unwrap_or(0) > 0, "{tcp:?}");
            assert!(vars.contains_key(&format!("flow.{}.tcp.srtt_us", first.id)), "{vars:?}");
            let socket = vars.get(&format!("flow.{}.tcp.socket", first.id)).map(|v| v.value.clone());
            let want = format!("{} -> {}", SocketAddr::new(app_addr, port), SocketAddr::new(server, 5201));
            assert_eq!(socket, Some(flexstack_api::Value::Str(want)));
            eprintln!("IPv{family}: meter srtt {srtt} us cwnd {meter_cwnd}; ss rtt {rtt_us} us cwnd {cwnd}");
            rtt_ratios.push(srtt as f64 / rtt_us.max(1.0));
            cwnd_ratios.push(meter_cwnd as f64 / cwnd as f64);
            std::thread::sleep(Duration::from_millis(1000));
        }
        let (r, c) = (upper_median(rtt_ratios), upper_median(cwnd_ratios));
        assert!((1.0 / 3.0..=3.0).contains(&r), "IPv{family}: srtt meter / ss rtt median {r}");
        assert!((0.5..=2.0).contains(&c), "IPv{family}: cwnd meter / ss cwnd median {c}");
        let out = app.wait_with_output().unwrap();
        assert!(out.status.success(), "iperf3 failed: {}", text(&out));
        d.wait_for_apps(0);
    }

    // An unknown id: a clear error, a non-zero exit.
    let out = d.cli(&["flow", "show", "perf.999999"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no flow \"perf.999999\"") && err.contains("flow list"), "{err}");
}

/// An app chain that terminates the app's TCP flows (smoltcp on both sides) and sends the rest on unchanged.
const TERMINATING: &str = r#"
links = [
  "{app} -> {app}-ip", "{app}-host -> {app}-ip",
  "{app}-ip[out] -> {app}-split", "{app}-ip[icmp] -> {app}-split",
  "{app}-split[down] -> {app}-t[in]", "{app}-split[up] -> {app}-o[in]",
  "{app}-t[out] -> {app}", "{app}-t[pass] -> {app}-host",
  "{app}-o[out] -> {app}-host", "{app}-o[pass] -> {app}",
  "{app}-t[stream] -> {app}-sdir", "{app}-o[stream] -> {app}-sdir",
  "{app}-sdir[down] -> {app}-o[stream_in]", "{app}-sdir[up] -> {app}-t[stream_in]",
]
[modules."{app}"]
kind = "tun"
name = "{app_dev}"
direction = "down"
[modules."{app}-host"]
kind = "tun"
name = "{host_dev}"
direction = "up"
[modules."{app}-ip"]
kind = "ip"
[modules."{app}-split"]
kind = "direction"
[modules."{app}-t"]
kind = "terminate"
vars_prefix = "flow.{app}-t"
[modules."{app}-o"]
kind = "originate"
vars_prefix = "flow.{app}-o"
[modules."{app}-sdir"]
kind = "direction"
"#;

#[test]
fn a_terminated_flow_is_listed_on_both_sides() {
    let Some(_serial) = privileged_serial() else { return };
    let blob = vec![7u8; 4 << 20];
    let (srv, d) = server_and_daemon(31, &blob);
    let dir = tempfile::tempdir().unwrap();
    let stack = dir.path().join("terminating.toml");
    std::fs::write(&stack, TERMINATING).unwrap();
    // curl at 1 MB/s: the flow lives for about 4 s.
    let url = format!("http://{}:8080/blob", srv.v4);
    let args = [
        "--stack",
        stack.to_str().unwrap(),
        "--name",
        "term",
        "--",
        "curl",
        "-sf",
        "--limit-rate",
        "1M",
        "-o",
        "/dev/null",
        &url,
    ];
    let app = d.spawn_run(&args);
    let deadline = Instant::now() + Duration::from_secs(10);
    let flows = loop {
        let flows = common::answer::<FlowList>(&d.cli(&["-j", "flow", "list"])).unwrap_or_default();
        if flows.iter().filter(|f| f.bytes_up.unwrap_or(0) > 100_000).count() == 2 {
            break flows;
        }
        assert!(Instant::now() < deadline, "no terminated flow:\n{}", text(&d.cli(&["flow", "list"])));
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!("{}", text(&d.cli(&["flow", "list"])));
    let t = flows.iter().find(|f| f.handling == Handling::Terminated).expect("the app's side");
    let o = flows.iter().find(|f| f.handling == Handling::Originated).expect("the network's side");
    let server: IpAddr = srv.v4.parse().unwrap();
    for f in [t, o] {
        assert_eq!(
            (f.app.as_deref(), f.backend.as_deref(), f.protocol.as_str()),
            (Some("term"), Some("smoltcp"), "tcp")
        );
        assert_eq!((f.dst, f.dst_port), (Some(server), Some(8080)), "{f:?}");
        assert!(f.tcp.as_ref().and_then(|m| m.srtt_us).is_some(), "{f:?}");
    }
    assert_eq!((t.id.as_str(), t.module.as_str()), ("term-t.1", "term-t"));
    assert_eq!((t.peer.as_deref(), o.peer.as_deref()), (Some(o.id.as_str()), Some(t.id.as_str())));
    let out = app.wait_with_output().unwrap();
    assert!(out.status.success(), "curl failed: {}", text(&out));
}
