//! A link face that takes an interface over gives it back (issue 18, item 8): the interface's addresses (IPv4 and
//! IPv6), its `disable_ipv6` and its IPv4 `forwarding` come back when the daemon ends on SIGTERM, and, after
//! SIGKILL, when the next daemon starts; an interface that carries the default route is refused unless
//! `force = true`; while the face holds the interface, a host that forwards does not route the frames arriving
//! there (flexstack's) out of its default route. Each test runs its
//! daemons in a namespace of its own with a veth pair (never a real interface). Needs root (skips with a reason
//! outside CI).

mod common;

use common::{bin, eventually, privileged, sh, unique, Daemon, Netns};
use std::process::{Command, Stdio};

/// The addresses the owned end starts with.
const ADDRESSES: [&str; 3] = ["10.250.1.1/24", "10.250.2.1/24", "fd42:1::1/64"];

/// A namespace with a veth pair: `owned` (with [`ADDRESSES`], IPv6 on) for the face, and its peer, both up.
struct Link {
    ns: Netns,
    owned: String,
}

impl Link {
    fn new() -> Link {
        let ns = Netns::new("to");
        // A namespace that forwards (as many hosts do): the take-over turns it off on the owned end only.
        ns.run(&["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"]);
        let (owned, peer) = (unique("o"), unique("p"));
        sh("ip", &["link", "add", &owned, "type", "veth", "peer", "name", &peer]);
        ns.adopt(&peer, &[]);
        ns.adopt(&owned, &ADDRESSES);
        let link = Link { ns, owned };
        assert_eq!(link.disable_ipv6(), "0");
        assert_eq!(link.forwarding(), "1");
        link.assert_addresses_back("at the start");
        link
    }

    /// `ip -br addr` of the owned end.
    fn addresses(&self) -> String {
        sh("ip", &["-n", &self.ns.name, "-br", "addr", "show", "dev", &self.owned])
    }

    fn disable_ipv6(&self) -> String {
        let path = format!("/proc/sys/net/ipv6/conf/{}/disable_ipv6", self.owned);
        let out = self.ns.run(&["cat", &path]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    fn forwarding(&self) -> String {
        let path = format!("/proc/sys/net/ipv4/conf/{}/forwarding", self.owned);
        let out = self.ns.run(&["cat", &path]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// A stack whose link face takes the owned end over (`extra`: more settings of the face).
    fn stack(&self, extra: &str) -> String {
        format!(
            "links = [\"f -> s\"]\n\n[modules.f]\nkind = \"packet\"\ninterface = \"{}\"\n{extra}\n\n\
             [modules.s]\nkind = \"sink\"\n",
            self.owned
        )
    }

    /// The take-over records of the owned end (any namespace: its name is unique).
    fn records(&self) -> Vec<String> {
        let suffix = format!("-{}", self.owned);
        std::fs::read_dir("/run/flexstack/links")
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect::<Vec<_>>())
            .unwrap_or_default()
            .into_iter()
            .filter(|n| n.ends_with(&suffix))
            .collect()
    }

    fn assert_taken(&self, when: &str) {
        let addrs = self.addresses();
        assert!(ADDRESSES.iter().all(|a| !addrs.contains(a)) && !addrs.contains("fe80"), "{when}: {addrs}");
        assert_eq!(self.disable_ipv6(), "1", "{when}");
        assert_eq!(self.forwarding(), "0", "{when}");
    }

    fn assert_addresses_back(&self, when: &str) {
        let addrs = self.addresses();
        assert!(ADDRESSES.iter().all(|a| addrs.contains(a)), "{when}: {addrs}");
        assert_eq!(self.disable_ipv6(), "0", "{when}");
        assert_eq!(self.forwarding(), "1", "{when}");
    }

    /// Starts a daemon in the namespace with `stack`, expecting it to refuse within 10 s; returns its stderr.
    fn daemon_fails(&self, stack: &str) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stack.toml");
        std::fs::write(&path, stack).unwrap();
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.ns.name, bin(), "daemon", "--stack"])
            .arg(&path)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let ended = eventually(10, || child.try_wait().unwrap().is_some());
        if !ended {
            let _ = child.kill();
            let _ = child.wait();
        }
        let out = child.wait_with_output().unwrap();
        assert!(ended && !out.status.success(), "the daemon should refuse:\n{stack}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    }
}

fn kill(mut d: Daemon) {
    d.child.kill().unwrap();
    d.child.wait().unwrap();
}

#[test]
fn a_taken_over_interface_gets_its_addresses_and_ipv6_back() {
    if !privileged() {
        return;
    }
    let link = Link::new();
    let stack = link.stack("");

    // SIGTERM: given back as the daemon ends.
    let mut d = Daemon::start_in(&link.ns, &stack, &[]);
    link.assert_taken("taken over");
    assert_eq!(link.records().len(), 1, "a record while the interface is held");
    assert!(d.terminate().success());
    link.assert_addresses_back("after SIGTERM");
    assert!(link.records().is_empty(), "{:?}", link.records());

    // SIGKILL: nothing is given back until the next daemon starts, even one without the face.
    let d = Daemon::start_in(&link.ns, &stack, &[]);
    link.assert_taken("taken over again");
    kill(d);
    link.assert_taken("after SIGKILL, before the next daemon");
    assert_eq!(link.records().len(), 1, "the dead daemon's record stays");
    let mut d = Daemon::start_in(&link.ns, "[modules.s]\nkind = \"sink\"\n", &[]);
    link.assert_addresses_back("after the next daemon started");
    assert!(link.records().is_empty(), "{:?}", link.records());
    assert!(d.terminate().success());

    // SIGKILL, then a daemon that takes the interface over again: it keeps the addresses from before the crash as
    // the ones to give back (not the flushed state it finds).
    kill(Daemon::start_in(&link.ns, &stack, &[]));
    let mut d = Daemon::start_in(&link.ns, &stack, &[]);
    link.assert_taken("taken over after a crash");
    assert!(d.terminate().success());
    link.assert_addresses_back("after the crash and SIGTERM");

    // A face unloaded at runtime gives the interface back at once.
    let d = Daemon::start_in(&link.ns, &stack, &[]);
    link.assert_taken("taken over for the unload");
    d.ok(&["module", "unload", "f"]);
    // The data plane lets go of the device right after it answers the edit.
    assert!(eventually(5, || link.addresses().contains(ADDRESSES[0])), "{}", link.addresses());
    link.assert_addresses_back("after the unload");
}

#[test]
fn an_interface_with_the_default_route_is_refused_unless_forced() {
    if !privileged() {
        return;
    }
    let link = Link::new();
    sh("ip", &["-n", &link.ns.name, "route", "add", "default", "via", "10.250.1.2", "dev", &link.owned]);
    let err = link.daemon_fails(&link.stack(""));
    assert!(
        err.contains(&format!("{} carries the default route", link.owned))
            && err.contains("0.0.0.0/0 via 10.250.1.2")
            && err.contains("force = true"),
        "{err}"
    );
    link.assert_addresses_back("after the refusal");
    assert!(link.records().is_empty(), "{:?}", link.records());

    let mut d = Daemon::start_in(&link.ns, &link.stack("force = true"), &[]);
    link.assert_taken("forced");
    assert!(d.terminate().success());
    link.assert_addresses_back("after the forced take-over");
}

/// A host that forwards (ip_forward = 1) must not route the frames that arrive on a taken-over interface for
/// flexstack's own address: they reach the kernel's IP layer as well as the face, and the kernel sent each one out
/// of its default route (every ACK of a TCP stream through `stacks/app-link.toml` did, to the host's real network).
#[test]
fn frames_for_a_taken_over_interface_are_not_forwarded_by_the_kernel() {
    if !privileged() {
        return;
    }
    // The host: the owned end (no address, like a link face's interface) and a default route over another veth
    // pair (its peer in the far namespace, unconfigured); the kernel's ForwDatagrams counts what it forwarded.
    let host = Netns::new("tf");
    host.run(&["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"]);
    let far = Netns::new("tg");
    let (owned, peer, out, out_peer) = (unique("o"), unique("p"), unique("d"), unique("e"));
    sh("ip", &["link", "add", &owned, "type", "veth", "peer", "name", &peer]);
    sh("ip", &["link", "add", &out, "type", "veth", "peer", "name", &out_peer]);
    host.adopt(&owned, &[]);
    host.adopt(&out, &["10.250.9.1/24"]);
    far.adopt(&out_peer, &[]);
    sh("ip", &["-n", &host.name, "route", "add", "default", "via", "10.250.9.2", "dev", &out]);
    let mac = String::from_utf8_lossy(&host.run(&["cat", &format!("/sys/class/net/{owned}/address")]).stdout)
        .trim()
        .to_string();
    // The other end: frames to an address beyond, sent to the owned end's MAC (as to flexstack's link module).
    far.adopt(&peer, &["10.250.1.2/24"]);
    sh("ip", &["-n", &far.name, "neigh", "add", "10.250.1.1", "lladdr", &mac, "dev", &peer, "nud", "permanent"]);
    sh("ip", &["-n", &far.name, "route", "add", "10.250.7.0/24", "via", "10.250.1.1"]);
    let forwarded = || -> u64 {
        let snmp = String::from_utf8_lossy(&host.run(&["cat", "/proc/net/snmp"]).stdout).into_owned();
        let mut ip = snmp.lines().filter(|l| l.starts_with("Ip:"));
        let (names, values) = (ip.next().expect("Ip: names"), ip.next().expect("Ip: values"));
        let at = names.split_whitespace().position(|n| n == "ForwDatagrams").expect("ForwDatagrams");
        values.split_whitespace().nth(at).and_then(|v| v.parse().ok()).expect("a count")
    };
    let send = || {
        // Unanswered: ping's status says nothing here.
        far.run(&["ping", "-c", "5", "-i", "0.05", "-W", "1", "10.250.7.7"]);
    };

    // Without flexstack the namespace forwards them: the check below can fail.
    let before = forwarded();
    send();
    assert!(forwarded() >= before + 5, "the host forwards without a face: {before} -> {}", forwarded());

    let stack = format!(
        "links = [\"f -> s\"]\n\n[modules.f]\nkind = \"packet\"\ninterface = \"{owned}\"\n\n\
         [modules.s]\nkind = \"sink\"\n"
    );
    let mut d = Daemon::start_in(&host, &stack, &[]);
    let (before, read) = (forwarded(), d.get_u64("module.f.rx_packets_total"));
    send();
    d.wait_for("the face to read the pings", 5, |d| d.get_u64("module.f.rx_packets_total") >= read + 5);
    assert_eq!(forwarded(), before, "the kernel forwarded frames that arrived on the taken-over interface");
    assert!(d.terminate().success());

    // Given back: the host forwards again, as before the face.
    let before = forwarded();
    send();
    assert!(forwarded() >= before + 5, "forwarding given back: {before} -> {}", forwarded());
}

/// Turning `net.ipv4.ip_forward` on sets every interface's `forwarding` to 1; the daemon's sandboxes do it for the
/// host face of an app on a host that did not forward, after which a taken-over interface must still not forward.
#[test]
fn an_app_turning_forwarding_on_leaves_a_taken_over_interface_without() {
    if !privileged() {
        return;
    }
    let ns = Netns::new("tr");
    let forwarding = |what: &str| {
        let out = ns.run(&["cat", &format!("/proc/sys/net/ipv4/{what}")]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    // A host that does not forward (a new namespace may inherit the host's setting).
    ns.run(&["sysctl", "-q", "-w", "net.ipv4.ip_forward=0"]);
    assert_eq!(forwarding("ip_forward"), "0");
    let (owned, peer) = (unique("o"), unique("p"));
    sh("ip", &["link", "add", &owned, "type", "veth", "peer", "name", &peer]);
    ns.adopt(&owned, &[]);
    ns.adopt(&peer, &[]);
    let stack = format!(
        "links = [\"f -> s\"]\n\n[modules.f]\nkind = \"packet\"\ninterface = \"{owned}\"\n\n[modules.s]\nkind = \
         \"sink\"\n"
    );
    let subnet = format!("10.{}.0.0", 60 + std::process::id() % 60);
    let mut d = Daemon::start_in(&ns, &stack, &["--app-subnet", &subnet]);
    let of_owned = format!("conf/{owned}/forwarding");
    assert_eq!(forwarding(&of_owned), "0");
    // An app: while it runs, its host face keeps the namespace's forwarding on (given back after the last app).
    // In the daemon's mount namespace too (`ip netns exec` gave it one), where its apps' namespaces are mounted.
    let mut app = Command::new("nsenter")
        .args(["-t", &d.child.id().to_string(), "-n", "-m", bin(), "--state-dir"])
        .arg(d.state_dir())
        .args(["run", "--", "sleep", "4"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let on = eventually(10, || forwarding("ip_forward") == "1");
    // Past the moment between the sandbox's write and the face's answer to it.
    std::thread::sleep(std::time::Duration::from_millis(500));
    let owned_then = forwarding(&of_owned);
    let status = app.wait().unwrap();
    assert!(on, "the sandbox did not turn forwarding on");
    assert!(status.success(), "flexstack run: {status}");
    assert_eq!(owned_then, "0", "the taken-over interface forwards again");
    assert!(d.terminate().success());
}
