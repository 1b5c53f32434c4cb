//! End-to-end: flows carried to a peer (tests/peer_e2e.rs's rig) by a carrier with several transports
//! (`transports`, docs/peers.md "Switching"), moved between them while they run: a TCP download and a numbered UDP
//! stream switched every second among tcp, quic, udp and udpplus, from the CLI (`flexstack flow set ID
//! carrier=KIND`) and by a CRAWLER rule writing the flows' `carrier` knob. The download arrives whole (sha256
//! equal), the UDP stream with no duplicate and no loss beyond what the switches cost, and `switches_total` counts
//! the moves. A transport the peer does not offer is refused with a clear error, the flow staying where it is.
//! Needs root (skips with a reason outside CI).

mod common;

use common::peer::{read_counter, udp_counter, Link, Rig, MARK};
use common::{path_str, pattern, text};
use flexstack_api::ops::{FlowInfo, Handling};
use std::time::{Duration, Instant};

/// The transports, in the order the tests cycle through them.
const KINDS: [&str; 4] = ["tcp", "quic", "udp", "udpplus"];
/// Both carriers offer every transport; flows start on tcp.
const ALL: Link = Link { transport: "tcp", v6: false, transports: "quic,udp,udpplus" };
/// How long the flows run while they are switched, one switch a second.
const SECS: u64 = 60;
/// The download: its size, paced by curl so that it lasts about [`SECS`].
const DOWNLOAD_MIB: usize = 32;
/// UDP datagrams a second of the numbered stream.
const UDP_RATE: u64 = 200;

/// The carried flows of app `app` on A: (id, protocol).
fn carried(r: &Rig, app: &str) -> Vec<(String, String)> {
    let out = r.a.cli(&["-j", "flow", "list"]);
    let list: Vec<FlowInfo> = serde_json::from_slice(&out.stdout).unwrap_or_default();
    list.into_iter()
        .filter(|f| f.handling == Handling::Carried && f.module == format!("{app}-peer"))
        .map(|f| (f.id, f.protocol))
        .collect()
}

/// Starts app `app`: a paced download of a [`DOWNLOAD_MIB`] MiB file and a numbered UDP stream to the counter, both
/// for about [`SECS`]; waits until both flows are carried. Returns the sha256 to expect, the app, the counter's
/// file and the UDP datagrams sent.
fn start(r: &Rig, app: &str) -> (String, std::process::Child, common::Background, std::path::PathBuf, u64) {
    let name = format!("big-{app}");
    std::fs::write(r.www.path().join(&name), pattern(DOWNLOAD_MIB << 20)).expect("write the file");
    let want = common::sha256(&r.www.path().join(&name));
    let (counter, count) = udp_counter(r, app);
    let n = SECS * UDP_RATE;
    let rate = (DOWNLOAD_MIB << 20) as u64 / SECS;
    let sender = format!(
        "import socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nt0 = time.time()\n\
         for i in range({n}):\n    s.sendto(b'%d ' % i + b'x' * 1000, ('{}', 9000))\n    \
         time.sleep(max(0, t0 + (i + 1) / {UDP_RATE} - time.time()))\n",
        r.srv
    );
    let script = format!(
        "curl -sSf -m {} --limit-rate {rate} http://{}:8080/{name} | sha256sum &\npython3 -c \"{sender}\" &\nwait\n\
         sleep 1",
        SECS + 40,
        r.srv
    );
    let args = r.args(app, &script, &["peer.switches_total", "peer.switch_held_total", "peer.flows_total"]);
    let run = r.a.spawn_run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let t0 = Instant::now();
    while carried(r, app).len() < 2 {
        assert!(t0.elapsed() < Duration::from_secs(15), "the app's two flows were not carried: {:?}", carried(r, app));
        std::thread::sleep(Duration::from_millis(100));
    }
    (want, run, counter, count, n)
}

/// Waits for app `app` (`run`), checks what arrived, and returns A's `switches_total` and `switch_held_total`.
fn finish(app: &str, run: std::process::Child, want: &str, count: &std::path::Path, sent: u64) -> (u64, u64) {
    let out = run.wait_with_output().expect("the app");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", text(&out));
    assert!(stdout.contains(want), "the download arrived whole (sha256): {}", text(&out));
    let (distinct, total) = read_counter(count);
    assert_eq!(distinct, total, "no UDP datagram came twice");
    // Loss: what a switch costs a UDP flow (a datagram on the new transport before its `Switch`), on a clean link.
    assert!(distinct * 100 >= sent * 97, "the UDP stream arrived: {distinct} of {sent}");
    eprintln!("{app}: UDP datagrams: {distinct} of {sent} arrived, each once");
    let (_, json) = stdout.split_once(MARK).unwrap_or_else(|| panic!("no meters: {}", text(&out)));
    let m: serde_json::Value = serde_json::from_str(json.trim()).expect("meters as JSON");
    let get = |k: &str| {
        let name = format!("module.{app}-peer.{k}");
        m[&name]["value"].as_u64().unwrap_or_else(|| panic!("{name}: {m}"))
    };
    (get("switches_total"), get("switch_held_total"))
}

/// Both flows switched every second for [`SECS`] from the CLI: `flexstack flow set ID carrier=KIND`, cycling through
/// every transport; `flow show` shows where each flow is.
#[test]
fn flows_switched_every_second_from_the_cli_arrive_whole() {
    let Some(r) = Rig::with(20, true, ALL) else { return };
    let app = "swcli";
    let (want, run, _counter, count, sent) = start(&r, app);
    let mut made = 0u64;
    let t0 = Instant::now();
    let mut i = 0;
    while t0.elapsed() < Duration::from_secs(SECS - 2) {
        i += 1;
        let kind = KINDS[i % KINDS.len()];
        for (id, proto) in carried(&r, app) {
            let out = r.a.cli(&["flow", "set", &id, &format!("carrier={kind}")]);
            if out.status.success() {
                made += 1;
                let show = r.a.cli(&["-j", "flow", "show", &id]);
                let s: serde_json::Value = serde_json::from_slice(&show.stdout).unwrap_or_default();
                let shown = s["vars"][&format!("flow.{id}.carrier")]["value"].as_str().map(String::from);
                assert!(shown.is_some_and(|k| KINDS.contains(&k.as_str())), "flow show lists the carrier: {s}");
            } else {
                // The download may have ended; a flow still moving says so. Nothing else is expected.
                let e = text(&out);
                assert!(e.contains("still moving") || e.contains("no flow"), "{proto} flow {id} to {kind}: {e}");
            }
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let (switches, held) = finish(app, run, &want, &count, sent);
    assert!(made >= SECS, "switches made: {made}");
    assert_eq!(switches, made, "switches_total counts every switch made");
    eprintln!("{made} switches, {held} frames held back to keep the order");
}

/// The same, switched by a rule: every second it writes each of the app's carried flows' `carrier` knob with the
/// transport after the one it is on.
#[test]
fn flows_switched_every_second_by_a_rule_arrive_whole() {
    let Some(r) = Rig::with(21, true, ALL) else { return };
    let app = "swrule";
    let (want, run, _counter, count, sent) = start(&r, app);
    let rules = r.dir.path().join("switch.rules");
    let text_rules = format!(
        "now: get(\"flow.{app}.peer.*.carrier\")\n\
         next: If(Equal(now, \"tcp\"), \"quic\", If(Equal(now, \"quic\"), \"udp\", If(Equal(now, \"udp\"), \"udpplus\", \"tcp\")))\n\
         tick: Timer(1s)\ntick -> move\nmove: set(\"flow.{app}.peer.*.carrier\", next)\n"
    );
    std::fs::write(&rules, text_rules).expect("write the rules");
    let out = r.a.cli(&["rules", "load", path_str(&rules)]);
    assert!(out.status.success(), "rules load: {}", text(&out));
    let (switches, _) = finish(app, run, &want, &count, sent);
    assert!(switches >= SECS, "the rule switched both flows about every second: {switches}");
}

/// A peer that does not offer a transport: the switch to it is refused at once with a clear error, and the flow
/// stays on its carrier (and can still move to one the peer offers); it arrives whole.
#[test]
fn a_switch_to_a_transport_the_peer_does_not_offer_is_refused() {
    let a = Link { transport: "tcp", v6: false, transports: "quic,udp" };
    let b = Link { transport: "tcp", v6: false, transports: "udp" };
    let Some(r) = Rig::with_links(22, true, a, b) else { return };
    let app = "swref";
    let want = common::sha256(&r.www.path().join("blob"));
    // Slow enough (about 20 s for the 2 MB, less what the buffers on the way take at once) that the switch to udp
    // completes while the flow still runs, even on a loaded machine.
    let script = format!("curl -sSf -m 60 --limit-rate 100000 http://{}:8080/blob | sha256sum", r.srv);
    let args = r.args(app, &script, &["peer.switches_total", "peer.switch_refused_total"]);
    let run = r.a.spawn_run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let t0 = Instant::now();
    let id = loop {
        if let Some((id, _)) = carried(&r, app).pop() {
            break id;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "the download was not carried");
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = r.a.cli(&["flow", "set", &id, "carrier=quic"]);
    assert!(!out.status.success(), "quic is refused: {}", text(&out));
    let e = text(&out);
    assert!(e.contains("does not offer quic") && e.contains("stays on tcp"), "a clear error: {e}");
    let out = r.a.cli(&["flow", "set", &id, "carrier=udpplus"]);
    assert!(text(&out).contains("not one of this carrier's transports"), "{}", text(&out));
    let out = r.a.cli(&["flow", "set", &id, "carrier=udp"]);
    assert!(out.status.success(), "udp is offered: {}", text(&out));
    let switches = format!("module.{app}-peer.switches_total");
    let moved = || {
        let out = r.a.cli(&["-j", "get", &switches]);
        common::answer::<flexstack_api::ops::Get>(&out)
            .and_then(|m| m.get(&switches).and_then(|v| common::as_u64(&v.value)))
            .unwrap_or(0)
    };
    let t0 = Instant::now();
    while moved() == 0 {
        assert!(t0.elapsed() < Duration::from_secs(15), "the switch to udp did not complete");
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = run.wait_with_output().expect("the app");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains(&want), "the download arrived whole: {}", text(&out));
    let (_, json) = stdout.split_once(MARK).expect("meters");
    let m: serde_json::Value = serde_json::from_str(json.trim()).expect("meters as JSON");
    assert_eq!(m[&format!("module.{app}-peer.switches_total")]["value"], 1, "{m}");
    assert_eq!(m[&format!("module.{app}-peer.switch_refused_total")]["value"], 1, "{m}");
}
