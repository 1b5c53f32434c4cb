//! Issue 14, "Peer failures": a carrier's link down for 5 s, the peer daemon killed and restarted mid-flow, a peer
//! that does not offer the carrier asked for. Each time the meters and the log say what happened, and the app's flow
//! either survives intact or is aborted with a reason within bounded time: nothing hangs. Two daemons joined by a
//! veth pair (tests/common/peer.rs); needs root (skips with a reason outside CI).

mod common;

use common::peer::{wait_app as finish, Link, Rig, QUIC, TCP, UDP, UDPPLUS};
use std::time::{Duration, Instant};

/// A download of the rig's 2 MB blob read slowly (64 KiB every `pause`), as app `app`; returns the sha256 it should
/// print and the running `flexstack run`, once B carries the flow.
fn slow_download(r: &Rig, app: &str, pause: f64) -> (String, std::process::Child) {
    let want = common::sha256(&r.www.path().join("blob"));
    let reader = format!(
        "import hashlib, time, urllib.request\nh = hashlib.sha256()\nwith urllib.request.urlopen('http://{}:8080/blob', \
         timeout=60) as f:\n    while True:\n        b = f.read(65536)\n        if not b:\n            break\n        \
         h.update(b)\n        time.sleep({pause})\nprint(h.hexdigest())\n",
        r.srv
    );
    let args = r.args(app, &format!("python3 -c \"{reader}\""), &["peer.flows_aborted_total"]);
    let run = r.a.spawn_run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    r.b.wait_for("the app's flow at B", 10, |b| b.get_u64("module.peers.flows_active") == 1);
    (want, run)
}

fn outage(link: Link, offset: u8) {
    let Some(r) = Rig::with(offset, true, link) else { return };
    // 32 reads 0.25 s apart: about 8 s, the outage from the first second to the sixth.
    let (want, run) = slow_download(&r, "outage", 0.25);
    std::thread::sleep(Duration::from_secs(1));
    let set = |state: &str| {
        let out = r._nb.run(&["ip", "link", "set", &r.b_dev, state]);
        assert!(out.status.success(), "{}", common::text(&out));
    };
    set("down");
    std::thread::sleep(Duration::from_secs(5));
    set("up");
    let out = finish(run, 90, link.transport);
    let text = common::text(&out);
    assert!(out.status.success(), "{}: {text}", link.transport);
    assert!(text.contains(want.trim()), "{}: the download arrived intact across the outage: {text}", link.transport);
}

/// Each carrier kind carries a flow across 5 s without its link (B's end of the veth pair down): TCP, QUIC and
/// the reliable stream of `udp` / `udpplus` retransmit, and 5 s is within every idle timeout (10 s).
#[test]
fn a_five_second_link_outage_is_survived_by_every_carrier() {
    for (i, link) in [TCP, QUIC, UDP, UDPPLUS].into_iter().enumerate() {
        outage(link, 30 + i as u8);
    }
}

/// B killed (SIGKILL) in the middle of a download: A aborts the app's flow with a reason, counts it, and says so in
/// its log, within the carrier's timeout (`tcp`: at once, B's kernel resets the connection; `quic`: its 10 s idle
/// timeout); nothing hangs. B restarted with `--restore` (its stack and its peer table from its journal) carries
/// the next flow: A connects again by itself.
#[test]
fn a_killed_peer_aborts_the_flow_with_a_reason_and_a_restarted_one_carries_again() {
    for (i, link) in [TCP, QUIC].into_iter().enumerate() {
        let Some(mut r) = Rig::with(34 + i as u8, true, link) else { return };
        let (_, run) = slow_download(&r, "killed", 0.25);
        r.b.kill();
        let started = Instant::now();
        let out = finish(run, 40, link.transport);
        let text = common::text(&out);
        assert!(!out.status.success(), "{}: the download cannot complete: {text}", link.transport);
        let aborted = Rig::meters(&out, "killed", &["peer.flows_aborted_total"])[0];
        assert!(aborted >= 1, "{}: A counted the aborted flow: {text}", link.transport);
        eprintln!("{}: the app's flow ended {:?} after B was killed", link.transport, started.elapsed());
        r.b.restart(&["--restore"], "restored.log");
        let (out, m) = r.run(
            "again",
            &format!("curl -sf -m 30 http://{}:8080/blob | sha256sum", r.srv),
            &["peer.connections_total"],
        );
        let want = common::sha256(&r.www.path().join("blob"));
        assert!(out.status.success() && common::text(&out).contains(want.trim()), "{}", common::text(&out));
        assert_eq!(m[0], 1, "{}: the new app's carrier connected to the restarted B", link.transport);
        assert!(r.b_meter("connections_total") >= 1, "{}: B's restored carrier accepted it", link.transport);
    }
}

/// B offers only `tcp`; A's carrier asks for `quic`: A cannot set the connection up, and the app's flow is aborted
/// with a reason (counted) instead of waiting for ever.
#[test]
fn a_peer_without_the_carrier_asked_for_aborts_the_flow() {
    let Some(r) = Rig::with_links(36, true, QUIC, TCP) else { return };
    let script = format!("curl -s -m 60 -o /dev/null -w '%{{http_code}}' http://{}:8080/blob; echo rc=$?", r.srv);
    let started = Instant::now();
    let (out, m) = r.run("refused", &script, &["peer.flows_aborted_total", "peer.connections_total"]);
    let text = common::text(&out);
    assert!(started.elapsed() < Duration::from_secs(45), "the app waited {:?}: {text}", started.elapsed());
    assert!(!text.contains("rc=0"), "curl cannot succeed: {text}");
    assert!(m[0] >= 1 && m[1] == 0, "aborted, never connected: {m:?} {text}");
}
