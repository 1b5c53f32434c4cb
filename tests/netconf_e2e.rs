//! The netlink configuration module (`flexstack_faces::netconf`) against the real kernel: two namespaces made as
//! `ip netns add` makes them, a veth pair between them created from one with its peer put straight into the other,
//! IPv4 and IPv6 addresses and routes, a permanent neighbour and sysctls, checked with `ip` and a ping; a refused
//! request reported with what it was; the namespaces removed. Needs root (skips outside CI with the reason).

mod common;

use common::{privileged, unique};
use flexstack_faces::netconf::{self, Rtnl, Veth};
use std::net::IpAddr;
use std::os::fd::AsFd;
use std::process::Command;

/// Named namespaces removed when dropped, pass or fail.
struct Namespaces(Vec<String>);

impl Drop for Namespaces {
    fn drop(&mut self) {
        for n in &self.0 {
            let _ = netconf::del_netns(n);
        }
    }
}

fn ip(args: &[&str]) -> String {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn addr(text: &str) -> IpAddr {
    text.parse().unwrap()
}

#[test]
fn namespaces_veths_addresses_routes_and_neighbours_through_netlink() {
    if !privileged() {
        return;
    }
    let (a, b) = (format!("fs-{}", unique("nca")), format!("fs-{}", unique("ncb")));
    let guard = Namespaces(vec![a.clone(), b.clone()]);
    let fd_a = netconf::add_netns(&a).unwrap();
    let fd_b = netconf::add_netns(&b).unwrap();
    assert!(ip(&["netns", "list"]).contains(&a), "ip netns sees the namespace");
    let again = netconf::add_netns(&a).unwrap_err();
    assert!(again.to_string().contains(&format!("create network namespace {a}")), "{again}");

    // A veth pair from a's socket, its peer created in b with its MAC address and MTU.
    let mut nl_a = Rtnl::open_in(fd_a.as_fd()).unwrap();
    let (end_a, end_b) = (unique("va"), unique("vb"));
    let mac = netconf::parse_mac("02:00:0a:fb:00:02").unwrap();
    nl_a.add_veth(&Veth {
        name: &end_a,
        peer: &end_b,
        peer_netns: Some(fd_b.as_fd()),
        peer_mac: Some(mac),
        mtu: Some(1400),
        up: true,
    });
    assert_eq!(nl_a.commit().unwrap(), 1);
    let index_a = nl_a.index_of(&end_a).unwrap();
    nl_a.set_up(1, true);
    nl_a.add_address(index_a, addr("10.251.0.1"), 24);
    nl_a.add_address(index_a, addr("fd99::1"), 64);
    assert_eq!(nl_a.commit().unwrap(), 3);

    let mut nl_b = Rtnl::open_in(fd_b.as_fd()).unwrap();
    let index_b = nl_b.index_of(&end_b).unwrap();
    nl_b.set_up(index_b, true);
    nl_b.add_address(index_b, addr("10.251.0.2"), 24);
    nl_b.add_address(index_b, addr("fd99::2"), 64);
    nl_b.add_route(addr("0.0.0.0"), 0, Some(addr("10.251.0.1")), index_b);
    nl_b.add_route(addr("fd98::"), 64, Some(addr("fd99::1")), index_b);
    nl_b.add_neighbour(index_b, addr("10.251.0.9"), [2, 0, 10, 251, 0, 9]);
    assert_eq!(nl_b.commit().unwrap(), 6);
    netconf::in_netns(fd_b.as_fd(), || netconf::write_sysctls(&[("net.ipv4.ip_default_ttl", "77")])).unwrap();

    let link = ip(&["-n", &b, "link", "show", &end_b]);
    assert!(link.contains("mtu 1400") && link.contains("02:00:0a:fb:00:02") && link.contains(",UP"), "{link}");
    let v4 = ip(&["-n", &b, "-4", "route"]);
    assert!(v4.contains(&format!("default via 10.251.0.1 dev {end_b}")), "{v4}");
    let v6 = ip(&["-n", &b, "-6", "route"]);
    assert!(v6.contains(&format!("fd98::/64 via fd99::1 dev {end_b}")), "{v6}");
    let neigh = ip(&["-n", &b, "neigh", "show", "10.251.0.9"]);
    assert!(neigh.contains("lladdr 02:00:0a:fb:00:09 PERMANENT"), "{neigh}");
    let ttl = |ns: &str| ip(&["netns", "exec", ns, "cat", "/proc/sys/net/ipv4/ip_default_ttl"]).trim().to_string();
    assert_eq!(ttl(&b), "77");
    assert_ne!(ttl(&a), "77", "the sysctl of b only");
    let ping = Command::new("ip").args(["netns", "exec", &a, "ping", "-c", "1", "-W", "2", "10.251.0.2"]).output();
    assert!(ping.unwrap().status.success(), "ping a -> b over the pair");

    // A refused request says what it was; the others of the same commit are carried out.
    nl_b.add_address(index_b, addr("10.251.0.2"), 24);
    nl_b.add_address(index_b, addr("10.251.1.2"), 24);
    let e = nl_b.commit().unwrap_err();
    assert_eq!(e.error.kind(), std::io::ErrorKind::AlreadyExists, "{e}");
    assert!(e.to_string().starts_with(&format!("add address 10.251.0.2/24 to link {index_b}: ")), "{e}");
    assert!(ip(&["-n", &b, "-4", "addr"]).contains("10.251.1.2/24"));

    // Removed: the names go at once.
    drop((nl_a, nl_b, fd_a, fd_b));
    assert!(netconf::del_netns_all(&[a.as_str(), b.as_str()]).is_empty());
    assert!(!ip(&["netns", "list"]).contains(&a));
    assert!(!std::path::Path::new(&format!("/run/netns/{b}")).exists());
    netconf::del_netns(&a).expect("removing a name that is gone is quiet");
    drop(guard);
}
