//! A lab of 200 hosts (issue 19, acceptance): a binary tree of plain hosts joined by 199 emulated links is built
//! with `lab up` within 10 s, a ping crosses the tree from one deep leaf to another through the root (14 emulated
//! links each way), and `lab down` removes it within 5 s, leaving no namespace, `/etc/netns` folder, state or
//! interface of the lab.
//!
//! The lab is built through netlink (crates/faces/src/netconf.rs): a subprocess per address, route or link took
//! 170 s for such a lab. The build prints its phases with their times (kept in the test's output), and the wire
//! daemon with its 398 `packet` faces and 398 emulators must answer before `lab up` returns.

mod common;

use common::{path_str, privileged_serial, text, LabScratch};
use std::time::{Duration, Instant};

/// Hosts in the tree.
const HOSTS: usize = 200;

/// A lab file: hosts h0..h{n-1}, host i linked to its parent (i - 1) / 2.
fn tree(name: &str, n: usize) -> String {
    let mut t = format!("[lab]\nname = \"{name}\"\nduration = \"1s\"\n");
    for i in 0..n {
        t += &format!("[hosts.h{i}]\n");
    }
    for i in 1..n {
        t += &format!("[[links]]\na = \"h{}\"\nb = \"h{i}\"\n", (i - 1) / 2);
    }
    t
}

/// File names in a folder (none if it does not exist).
fn entries(dir: &str) -> Vec<String> {
    std::fs::read_dir(dir).into_iter().flatten().flatten().filter_map(|e| e.file_name().into_string().ok()).collect()
}

/// Names of the network interfaces of the root namespace.
fn root_links() -> Vec<String> {
    entries("/sys/class/net")
}

/// The namespaces of lab `name` that exist.
fn namespaces_of(name: &str) -> Vec<String> {
    let wire = format!("fl-lab.{name}");
    entries("/run/netns").into_iter().filter(|n| *n == wire || n.starts_with(&format!("{wire}."))).collect()
}

#[test]
fn a_200_host_tree_is_built_pinged_across_and_removed_within_the_targets() {
    let Some(_serial) = privileged_serial() else { return };
    let lab = LabScratch::new("scale");
    let file = lab.write("tree.toml", &tree(&lab.name, HOSTS));
    let results = lab.path("results");
    let links_before = root_links();

    let started = Instant::now();
    let out = lab.cli(&["lab", "up", path_str(&file), "--results", path_str(&results)]);
    let built = started.elapsed();
    let log = text(&out);
    assert!(out.status.success(), "lab up: {log}");
    eprintln!("{log}");
    // Progress: the phases with n of N, and the summary with each phase's time.
    assert!(log.contains(&format!("namespaces {0}/{0}", HOSTS + 1)), "{log}");
    assert!(log.contains(&format!("links {0}/{0}", 2 * (HOSTS - 1))), "{log}");
    assert!(log.contains(&format!("lab {}: built in ", lab.name)) && log.contains("wire daemon "), "{log}");
    assert_eq!(namespaces_of(&lab.name).len(), HOSTS + 1);
    assert!(built <= Duration::from_secs(10), "built in {built:?}, the target is 10 s");

    // A leaf has one default route instead of a route per subnet.
    let routes = lab.ok(&["lab", "exec", "h199", "--", "ip", "-4", "route", "show"]);
    assert_eq!(routes.lines().filter(|l| !l.contains("proto kernel")).collect::<Vec<_>>().len(), 1, "{routes}");
    assert!(routes.starts_with("default via "), "{routes}");

    // h199 (depth 7) to h127 (depth 7, the other half of the tree): 14 links through the root. The ARP of every
    // hop is static, so the first ping answers.
    let ping = lab.cli(&["lab", "exec", "h199", "--", "ping", "-c", "3", "-i", "0.2", "-W", "3", "h127"]);
    assert!(ping.status.success(), "ping across the tree: {}", text(&ping));
    assert!(text(&ping).contains(" 0% packet loss"), "{}", text(&ping));

    let started = Instant::now();
    let down = lab.cli(&["lab", "down", &lab.name]);
    let took = started.elapsed();
    assert!(down.status.success(), "lab down: {}", text(&down));
    eprintln!("{}", text(&down));
    assert!(text(&down).contains(&format!("lab {}: torn down in ", lab.name)), "{}", text(&down));
    assert!(took <= Duration::from_secs(5), "torn down in {took:?}, the target is 5 s");

    assert_eq!(namespaces_of(&lab.name), Vec::<String>::new(), "namespaces left");
    let etc: Vec<String> =
        entries("/etc/netns").into_iter().filter(|n| n.starts_with(&format!("fl-lab.{}", lab.name))).collect();
    assert_eq!(etc, Vec::<String>::new(), "/etc/netns folders left");
    assert!(!lab.state().join("labs").join(&lab.name).exists(), "state left");
    let new_links: Vec<String> = root_links().into_iter().filter(|l| !links_before.contains(l)).collect();
    let lab_like: Vec<&String> = new_links.iter().filter(|l| l.starts_with('l') || l.starts_with("eth")).collect();
    assert!(lab_like.is_empty(), "interfaces of the lab in the root namespace: {lab_like:?}");
}
