//! End-to-end test of link watching: a daemon owns one end of a real veth pair with a `packet` face; taking the
//! other end down (in a namespace of the test) makes the face's interface lose its carrier, which the daemon sees in
//! the kernel's link events: the face's `carrier` meter goes to 0 and back to 1, `carrier_changes_total` counts
//! both, and a daemon started while the link is already down shows 0 from the start. Needs root (skips with a
//! reason outside CI).

mod common;

use common::{privileged, sh, unique, Daemon, LinkGuard, Netns};

fn stack(interface: &str) -> String {
    format!(
        "links = [\"f -> s\"]\n[modules.f]\nkind = \"packet\"\ninterface = \"{interface}\"\ntake_over = false\n\
         [modules.s]\nkind = \"sink\"\n"
    )
}

#[test]
fn a_face_sees_its_carrier_go_and_come_back() {
    if !privileged() {
        return;
    }
    let peer_ns = Netns::new("cr");
    let (owned, peer) = (unique("co"), unique("cp"));
    sh("ip", &["link", "add", &owned, "type", "veth", "peer", "name", &peer]);
    let _veth = LinkGuard(owned.clone());
    peer_ns.adopt(&peer, &[]);
    sh("ip", &["link", "set", &owned, "up"]);

    let d = Daemon::start(&stack(&owned), &[]);
    d.wait_for("carrier 1 at start", 10, |d| d.get_u64("module.f.carrier") == 1);
    assert_eq!(d.get_u64("module.f.carrier_changes_total"), 0, "an up link at start is no change");

    sh("ip", &["-n", &peer_ns.name, "link", "set", &peer, "down"]);
    d.wait_for("carrier 0 after the peer went down", 10, |d| d.get_u64("module.f.carrier") == 0);
    sh("ip", &["-n", &peer_ns.name, "link", "set", &peer, "up"]);
    d.wait_for("carrier 1 after the peer came back", 10, |d| d.get_u64("module.f.carrier") == 1);
    assert_eq!(d.get_u64("module.f.carrier_changes_total"), 2);

    // Our own end taken down administratively is a loss too.
    sh("ip", &["link", "set", &owned, "down"]);
    d.wait_for("carrier 0 with our end down", 10, |d| d.get_u64("module.f.carrier") == 0);
    drop(d);

    // A daemon started while the link is down shows it at once (the link watcher asks for the links' state).
    let d = Daemon::start(&stack(&owned), &[]);
    d.wait_for("carrier 0 for a link down at start", 10, |d| d.get_u64("module.f.carrier") == 0);
    sh("ip", &["link", "set", &owned, "up"]);
    d.wait_for("carrier 1 once it is up", 10, |d| d.get_u64("module.f.carrier") == 1);
}
