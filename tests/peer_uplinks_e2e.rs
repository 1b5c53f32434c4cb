//! Issue 14, "Several uplinks" (docs/peers.md): A and B joined by two links with different addresses, A's carrier
//! with `uplinks` (one socket per uplink; the tcp carrier: its connection from the active one's address). A slow
//! TCP download (over quic, udp, udpplus and tcp; udpplus and tcp also between IPv6 peers, with `ip -6 rule`) by a
//! sandboxed app on A runs through B; mid-way A's end of the active uplink is set down: the carrier moves to the
//! other uplink (QUIC connection migration, the datagram carriers' re-binding, the tcp carrier's session resumed on
//! a new connection) and the download completes intact. Without `uplinks` (one wildcard socket, the kernel's
//! routing) the same cut stalls the carrier until its idle timeout ends the flow: the download fails.
//! Needs root (skips with a reason outside CI).

mod common;

use common::peer::{slow_download, wait_app, Link, Rig, QUIC, TCP, TCP6, UDP, UDPPLUS, UDPPLUS6};
use std::time::Duration;

const METERS: [&str; 4] =
    ["peer.migrations_total", "peer.uplink_active", "peer.migration_gap_us", "peer.flows_aborted_total"];

/// The download over `link`, A's first uplink set down 2 s into it; with `uplinks` or not. Returns whether the
/// download arrived intact, A's meters (see [`METERS`]) and B's `migrations_total`.
fn cut(link: Link, offset: u8, uplinks: bool) -> Option<(bool, Vec<u64>, u64)> {
    let r = Rig::with(offset, true, link)?;
    let second = r.second_uplink();
    let settings = if uplinks { format!("uplinks = \"{},{}\"", second.first, second.second) } else { String::new() };
    let stack = r.stack_with(&settings);
    // 32 reads 0.25 s apart: about 8 s.
    let app = if uplinks { "moves" } else { "stays" };
    let (want, run) = slow_download(&r, &stack, app, 0.25, &METERS);
    std::thread::sleep(Duration::from_secs(2));
    common::sh("ip", &["link", "set", &r.host_dev, "down"]);
    let out = wait_app(run, 60, link.transport);
    let text = common::text(&out);
    let intact = out.status.success() && text.contains(&want);
    let m = Rig::meters(&out, app, &METERS);
    eprintln!("{} uplinks={uplinks}: intact {intact}, A's meters {METERS:?} = {m:?}\n{text}", link.transport);
    Some((intact, m, r.b_meter("migrations_total")))
}

fn survives(link: Link, offset: u8) {
    let Some((intact, m, b_moves)) = cut(link, offset, true) else { return };
    assert!(intact, "{}: the download arrived intact across the handoff", link.transport);
    assert!(m[0] >= 1, "{}: A moved to the second uplink: migrations_total {}", link.transport, m[0]);
    assert_eq!(m[1], 1, "{}: the second uplink is the active one", link.transport);
    assert!(m[2] > 0, "{}: the move's time without delivery was measured", link.transport);
    assert_eq!(m[3], 0, "{}: no flow was aborted", link.transport);
    assert!(b_moves >= 1, "{}: B saw its peer move to the new address", link.transport);
}

fn fails_without_uplinks(link: Link, offset: u8) {
    let Some((intact, m, _)) = cut(link, offset, false) else { return };
    assert!(
        !intact,
        "{}: with one socket the cut must break the download (else the test proves nothing)",
        link.transport
    );
    assert_eq!(m[0], 0, "{}: nothing moved", link.transport);
}

#[test]
fn quic_migrates_to_the_second_uplink_and_the_download_survives() {
    survives(QUIC, 24);
}

#[test]
fn udpplus_rebinds_to_the_second_uplink_and_the_download_survives() {
    survives(UDPPLUS, 25);
}

#[test]
fn udp_rebinds_to_the_second_uplink_and_the_download_survives() {
    survives(UDP, 29);
}

#[test]
fn tcp_resumes_its_session_from_the_second_uplink_and_the_download_survives() {
    survives(TCP, 30);
}

#[test]
fn tcp_between_ipv6_peers_resumes_from_the_second_v6_uplink() {
    survives(TCP6, 31);
}

#[test]
fn udpplus_between_ipv6_peers_rebinds_to_the_second_v6_uplink() {
    survives(UDPPLUS6, 32);
}

#[test]
fn without_uplinks_the_same_cut_breaks_the_quic_download() {
    fails_without_uplinks(QUIC, 26);
}

#[test]
fn without_uplinks_the_same_cut_breaks_the_udpplus_download() {
    fails_without_uplinks(UDPPLUS, 27);
}

/// `uplinks` on an accepting carrier is refused when the stack is loaded, with a message that says why, rather
/// than ignored.
#[test]
fn uplinks_where_they_cannot_work_are_refused_with_a_reason() {
    if !common::privileged() {
        return;
    }
    let a = common::SandboxDaemon::start(common::octets().0.wrapping_add(28));
    let out = a.cli(&["module", "load", "acc", "carrier", "listen=127.0.0.1:0", "transport=tcp", "uplinks=127.0.0.1"]);
    let text = common::text(&out);
    assert!(!out.status.success() && text.contains("connecting carrier's setting"), "{text}");
}
