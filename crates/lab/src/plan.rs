//! From a validated [`Lab`] to everything a runner must create, computed up front and without I/O: namespace and
//! interface names, addresses, MAC addresses, static neighbours, routes, `/etc/hosts` contents, the per-link
//! emulator seeds and the stack description of the lab's wire daemon.
//!
//! The runner calls [`Plan::new`] once, after [`Lab::parse`], and then only executes the plan; two runs of the same
//! file get the same plan.
//!
//! # Topology
//!
//! - Each host is a network namespace `fl-lab.<lab>.<host>`; the lab's wire is one more namespace `fl-lab.<lab>`
//!   ([`namespace_prefix`] is what `lab down --all` looks for).
//! - Link number `i` (file order) is two veth pairs: `eth<n>` in host `a` (its n-th link) paired with `l<i>a` in the
//!   wire namespace, and likewise `eth<m>` in host `b` with `l<i>b`. A flexstack daemon in the wire namespace owns
//!   `l<i>a` and `l<i>b` with `packet` faces and bridges them through two `emulator` modules, `<link>_ab` (a → b) and
//!   `<link>_ba` (b → a), seeded from the lab's seed, the link's number and the direction.
//! - Link `i` is the subnet `10.<i / 256>.<i % 256>.0/24`: host `a` is `.1`, host `b` is `.2`. MAC addresses are
//!   derived from the address (`02:00:` + its four bytes), and each side knows the other's as a permanent neighbour,
//!   so no ARP crosses the emulated link; kernel IPv6 is off on lab interfaces. Only the programs' own packets cross
//!   a link, which makes the emulators' random draws, and so the drops, reproducible for the same traffic.
//! - Hosts forward, with static routes along shortest paths (ties broken by file order), so every address is
//!   reachable from every host. The interface that carries the most routes gets a default route instead of them:
//!   a leaf host has only its default route, a host of a line or a tree only the routes towards its smaller side. A host name resolves (per host, through `/etc/netns/<namespace>/hosts`) to its
//!   address on a link shared with the asking host, else to its address on its first link.
//! - The k-th stacked host's apps get addresses from [`stacked_app_subnet`]`(k)` (`172.(16+k).0.0/16`), and every
//!   other host routes that subnet towards the stacked host (shortest path, or the lab's `[[routes]]`), so apps
//!   that leave through the stacked host's own link faces (no NAT) are reachable too.
//! - A stacked host's stack template may use the lab's values of its interfaces: see [`Plan::template_values`].

use crate::{Lab, Link};
use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::net::Ipv4Addr;

/// What every lab namespace's name starts with.
pub fn namespace_prefix() -> &'static str {
    "fl-lab."
}

/// Most links a lab may have (each takes a /24 of 10.0.0.0/8 below the stacked hosts' app subnets, [`stacked_app_subnet`]).
pub const MAX_LINKS: usize = 250 * 256;

/// Most stacked hosts a lab may have: stacked host number k (file order, from 0) gives its sandboxed apps the /16
/// `172.(16 + k).0.0`.
pub const MAX_STACKED_HOSTS: usize = 16;

/// The /16 of the apps of the `k`-th stacked host (file order, from 0).
pub fn stacked_app_subnet(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(172, 16 + k as u8, 0, 0)
}

/// One interface of a host.
#[derive(Clone, Debug, PartialEq)]
pub struct Interface {
    /// Its name in the host's namespace (`eth0`).
    pub name: String,
    /// The veth peer's name in the wire namespace (`l3a`).
    pub wire_name: String,
    /// Its address (prefix length 24).
    pub address: Ipv4Addr,
    /// Its MAC address.
    pub mac: String,
    /// The host at the other end.
    pub peer_host: String,
    /// The other end's address.
    pub peer_address: Ipv4Addr,
    /// The other end's MAC address.
    pub peer_mac: String,
    /// The link's MTU, if set.
    pub mtu: Option<u32>,
    /// The link's index.
    pub link: usize,
}

/// A route of a host: `destination` via `via` on `dev`.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    /// The destination subnet, `a.b.c.0/24` (a link), `a.b.0.0/16` (a stacked host's apps) or `default`.
    pub destination: String,
    /// The next hop.
    pub via: Ipv4Addr,
    /// The interface.
    pub dev: String,
}

impl Route {
    /// The destination as an address and a prefix length (`default`: `0.0.0.0/0`).
    pub fn prefix(&self) -> Option<(Ipv4Addr, u8)> {
        if self.destination == "default" {
            return Some((Ipv4Addr::UNSPECIFIED, 0));
        }
        let (a, len) = self.destination.split_once('/')?;
        Some((a.parse().ok()?, len.parse().ok().filter(|l| *l <= 32)?))
    }

    /// True if `address` is in the destination.
    pub fn covers(&self, address: Ipv4Addr) -> bool {
        self.prefix().is_some_and(|(net, len)| {
            let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
            u32::from(address) & mask == u32::from(net) & mask
        })
    }
}

/// What to create for one host.
#[derive(Clone, Debug, PartialEq)]
pub struct HostPlan {
    /// Its name.
    pub name: String,
    /// Its namespace.
    pub netns: String,
    /// The stack template of its apps (stacked host), as written in the lab file.
    pub stack: Option<String>,
    /// A stacked host's app subnet (a /16).
    pub app_subnet: Option<Ipv4Addr>,
    /// Its interfaces, in link order.
    pub interfaces: Vec<Interface>,
    /// Its routes to subnets it is not on.
    pub routes: Vec<Route>,
    /// The contents of its `/etc/hosts`.
    pub hosts_file: String,
}

/// What to create for one link.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkPlan {
    /// The link's name (`h1-srv`).
    pub name: String,
    /// Its index (file order).
    pub index: usize,
    /// The wire interface towards host `a` (`l3a`).
    pub wire_a: String,
    /// The wire interface towards host `b` (`l3b`).
    pub wire_b: String,
    /// The emulator module carrying a → b.
    pub emulator_ab: String,
    /// The emulator module carrying b → a.
    pub emulator_ba: String,
    /// Seed of the a → b emulator.
    pub seed_ab: u64,
    /// Seed of the b → a emulator.
    pub seed_ba: u64,
}

impl HostPlan {
    /// The route the host's kernel takes to `address` (the longest matching prefix), if it is not on one of the
    /// host's links.
    pub fn route_to(&self, address: Ipv4Addr) -> Option<&Route> {
        self.routes.iter().filter(|r| r.covers(address)).max_by_key(|r| r.prefix().map_or(0, |(_, l)| l))
    }
}

/// Everything a runner creates for a lab.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The wire namespace.
    pub wire_netns: String,
    /// Hosts in file order.
    pub hosts: Vec<HostPlan>,
    /// Links in file order.
    pub links: Vec<LinkPlan>,
}

/// Why a lab cannot be planned.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    /// More links than addresses.
    #[error("a lab has at most {MAX_LINKS} links, this one has {0}")]
    TooManyLinks(usize),
    /// More stacked hosts than app subnets.
    #[error("a lab has at most {MAX_STACKED_HOSTS} stacked hosts, this one has {0}")]
    TooManyStackedHosts(usize),
}

/// SplitMix64: spreads the lab seed over links and directions, so that neighbouring seeds give unrelated streams.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The seed of link `index`'s emulator in one direction (`0` = a → b, `1` = b → a); below 2^63, as TOML
/// integers are signed.
pub fn link_seed(lab_seed: u64, index: usize, direction: u64) -> u64 {
    mix(mix(lab_seed) ^ ((index as u64) << 1 | direction)) >> 1
}

fn link_address(index: usize, side: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, (index / 256) as u8, (index % 256) as u8, side)
}

fn link_subnet(index: usize) -> String {
    format!("10.{}.{}.0/24", index / 256, index % 256)
}

fn mac_of(a: Ipv4Addr) -> String {
    let o = a.octets();
    format!("02:00:{:02x}:{:02x}:{:02x}:{:02x}", o[0], o[1], o[2], o[3])
}

/// The emulator module name of a link in one direction.
pub fn emulator_name(link: &str, a_to_b: bool) -> String {
    format!("{link}_{}", if a_to_b { "ab" } else { "ba" })
}

impl Plan {
    /// Plans `lab`. Deterministic.
    pub fn new(lab: &Lab) -> Result<Plan, PlanError> {
        if lab.links.len() > MAX_LINKS {
            return Err(PlanError::TooManyLinks(lab.links.len()));
        }
        let stacked = lab.hosts.iter().filter(|h| h.stack.is_some()).count();
        if stacked > MAX_STACKED_HOSTS {
            return Err(PlanError::TooManyStackedHosts(stacked));
        }
        let prefix = format!("{}{}", namespace_prefix(), lab.name);
        let positions: HashMap<&str, usize> = lab.hosts.iter().enumerate().map(|(i, h)| (h.name.as_str(), i)).collect();
        let host_index = |name: &str| positions[name];
        let mut hosts: Vec<HostPlan> = lab
            .hosts
            .iter()
            .map(|h| HostPlan {
                name: h.name.clone(),
                netns: format!("{prefix}.{}", h.name),
                stack: h.stack.clone(),
                app_subnet: None,
                interfaces: Vec::new(),
                routes: Vec::new(),
                hosts_file: String::new(),
            })
            .collect();
        let mut links = Vec::new();
        for (i, l) in lab.links.iter().enumerate() {
            let (addr_a, addr_b) = (link_address(i, 1), link_address(i, 2));
            for (me, peer, addr, peer_addr, side) in
                [(&l.a, &l.b, addr_a, addr_b, 'a'), (&l.b, &l.a, addr_b, addr_a, 'b')]
            {
                let h = &mut hosts[host_index(me)];
                h.interfaces.push(Interface {
                    name: format!("eth{}", h.interfaces.len()),
                    wire_name: format!("l{i}{side}"),
                    address: addr,
                    mac: mac_of(addr),
                    peer_host: peer.clone(),
                    peer_address: peer_addr,
                    peer_mac: mac_of(peer_addr),
                    mtu: l.mtu,
                    link: i,
                });
            }
            links.push(LinkPlan {
                name: l.name.clone(),
                index: i,
                wire_a: format!("l{i}a"),
                wire_b: format!("l{i}b"),
                emulator_ab: emulator_name(&l.name, true),
                emulator_ba: emulator_name(&l.name, false),
                seed_ab: link_seed(lab.seed, i, 0),
                seed_ba: link_seed(lab.seed, i, 1),
            });
        }
        for (k, h) in hosts.iter_mut().filter(|h| h.stack.is_some()).enumerate() {
            h.app_subnet = Some(stacked_app_subnet(k));
        }
        let by_name: HashMap<String, usize> = hosts.iter().enumerate().map(|(i, h)| (h.name.clone(), i)).collect();
        for h in 0..hosts.len() {
            hosts[h].routes = routes_from(lab, &hosts, &by_name, h);
            hosts[h].hosts_file = hosts_file(lab, &hosts, h);
        }
        Ok(Plan { wire_netns: prefix, hosts, links })
    }

    /// The host plan named `name`.
    pub fn host(&self, name: &str) -> Option<&HostPlan> {
        self.hosts.iter().find(|h| h.name == name)
    }

    /// The link plan named `name` (either order of its hosts).
    pub fn link(&self, name: &str) -> Option<&LinkPlan> {
        self.links.iter().find(|l| l.name == name)
    }

    /// The values a stacked host's stack template may use, as `(placeholder, value)`: for each of its interfaces
    /// `ethN`, `{ethN.address}` (10.0.3.1), `{ethN.cidr}` (10.0.3.1/24), `{ethN.mac}`, `{ethN.peer}` (the other end's
    /// address, the gateway), `{ethN.peer_mac}`, `{ethN.bw_mbit}` (the link's rate at the start in Mbit/s, as its
    /// `bw`, 0 if unlimited) and `{ethN.bw_bps}` (the same in bit/s); and `{host}`, `{app_subnet}` (172.16.0.0/16). The daemon fills in `{app}`, `{app_dev}`,
    /// `{host_dev}`, `{app_v4}` and `{app_v6}` when an app attaches.
    pub fn template_values(&self, lab: &Lab, host: &str) -> Vec<(String, String)> {
        let Some(h) = self.host(host) else { return Vec::new() };
        let mut out = vec![("{host}".to_string(), h.name.clone())];
        if let Some(s) = h.app_subnet {
            out.push(("{app_subnet}".into(), format!("{s}/16")));
        }
        for f in &h.interfaces {
            let bw_mbit = lab.links[f.link].params.bw_mbit.unwrap_or(0.0);
            let bw = (bw_mbit * 1e6).round() as u64;
            let n = &f.name;
            out.push((format!("{{{n}.address}}"), f.address.to_string()));
            out.push((format!("{{{n}.cidr}}"), format!("{}/24", f.address)));
            out.push((format!("{{{n}.mac}}"), f.mac.clone()));
            out.push((format!("{{{n}.peer}}"), f.peer_address.to_string()));
            out.push((format!("{{{n}.peer_mac}}"), f.peer_mac.clone()));
            out.push((format!("{{{n}.bw_mbit}}"), bw_mbit.to_string()));
            out.push((format!("{{{n}.bw_bps}}"), bw.to_string()));
        }
        out
    }

    /// The stack description of the wire daemon: per link, two `packet` faces (not taken over: the wire
    /// namespace has nothing else) and two seeded emulators with the link's parameters.
    pub fn wire_stack(&self, lab: &Lab) -> String {
        let mut links = Vec::new();
        let mut modules = String::new();
        for (lp, l) in self.links.iter().zip(&lab.links) {
            let (ab, ba) = (&lp.emulator_ab, &lp.emulator_ba);
            links.extend([
                format!("{} -> {ab}", lp.wire_a),
                format!("{ab} -> {}", lp.wire_b),
                format!("{} -> {ba}", lp.wire_b),
                format!("{ba} -> {}", lp.wire_a),
            ]);
            for face in [&lp.wire_a, &lp.wire_b] {
                let _ = writeln!(
                    modules,
                    "\n[modules.{face}]\nkind = \"packet\"\ninterface = \"{face}\"\ntake_over = false"
                );
            }
            for (name, seed) in [(ab, lp.seed_ab), (ba, lp.seed_ba)] {
                let _ = writeln!(modules, "\n[modules.\"{name}\"]\nkind = \"emulator\"\nseed = {seed}");
                for (k, v) in emulator_settings(l) {
                    let _ = writeln!(modules, "{k} = {v}");
                }
            }
        }
        let mut out =
            format!("# The wire of lab {}: generated by flexstack lab from the lab file.\nlinks = [\n", lab.name);
        for l in &links {
            let _ = writeln!(out, "  \"{l}\",");
        }
        out.push_str("]\n");
        out.push_str(&modules);
        out
    }
}

/// A link's emulator settings as TOML values (`delay_ms = 10.0`).
fn emulator_settings(l: &Link) -> Vec<(String, String)> {
    l.emulator_settings().into_iter().map(|(k, v)| (k, v.to_string())).collect()
}

/// Shortest-path next hops from host `h` to every link subnet it is not on.
fn routes_from(lab: &Lab, hosts: &[HostPlan], by_name: &HashMap<String, usize>, h: usize) -> Vec<Route> {
    let index = |name: &str| by_name[name];
    // Breadth-first search over hosts; `first[x]` = the interface of `h` that starts the path to x.
    // `dist[x]` = hops from h to x.
    let mut first: Vec<Option<usize>> = vec![None; hosts.len()];
    let mut dist = vec![usize::MAX; hosts.len()];
    let mut seen = vec![false; hosts.len()];
    seen[h] = true;
    dist[h] = 0;
    let mut queue = VecDeque::new();
    for (k, iface) in hosts[h].interfaces.iter().enumerate() {
        let p = index(&iface.peer_host);
        if !seen[p] {
            seen[p] = true;
            first[p] = Some(k);
            dist[p] = 1;
            queue.push_back(p);
        }
    }
    while let Some(x) = queue.pop_front() {
        for iface in &hosts[x].interfaces {
            let p = index(&iface.peer_host);
            if !seen[p] {
                seen[p] = true;
                first[p] = first[x];
                dist[p] = dist[x] + 1;
                queue.push_back(p);
            }
        }
    }
    let on_link = |i: usize| hosts[h].interfaces.iter().any(|f| f.link == i);
    let via_neighbour = |n: &str| hosts[h].interfaces.iter().find(|f| f.peer_host == n);
    let mut routes = Vec::new();
    for (i, l) in lab.links.iter().enumerate() {
        if on_link(i) {
            continue;
        }
        // Reach the subnet through whichever of its ends is nearer (at equal distance, the a end).
        let via_iface = [index(&l.a), index(&l.b)]
            .into_iter()
            .filter_map(|e| first[e].map(|k| (dist[e], k)))
            .min_by_key(|&(d, _)| d)
            .map(|(_, k)| k);
        if let Some(k) = via_iface {
            let f = &hosts[h].interfaces[k];
            routes.push(Route { destination: link_subnet(i), via: f.peer_address, dev: f.name.clone() });
        }
    }
    for (x, other) in hosts.iter().enumerate() {
        let Some(subnet) = other.app_subnet.filter(|_| x != h) else { continue };
        let chosen = lab.routes.iter().find(|r| r.host == hosts[h].name && r.to == other.name);
        let iface = match chosen {
            Some(r) => via_neighbour(&r.via),
            None => first[x].map(|k| &hosts[h].interfaces[k]),
        };
        if let Some(f) = iface {
            routes.push(Route { destination: format!("{subnet}/16"), via: f.peer_address, dev: f.name.clone() });
        }
    }
    with_default_route(&hosts[h], routes)
}

/// Replaces the routes through the interface that carries the most of them (ties: the first interface) by one
/// default route through it: a leaf host keeps only its default route, a host of a line or a tree only the routes
/// towards its smaller side. The destinations are disjoint (link /24s in 10/8, app /16s in 172.16/12), so every one
/// still leaves through the same interface. An address outside the lab, which found no route before, now follows
/// the default routes until its TTL runs out.
fn with_default_route(host: &HostPlan, routes: Vec<Route>) -> Vec<Route> {
    let count = |dev: &str| routes.iter().filter(|r| r.dev == dev).count();
    let Some(best) = host.interfaces.iter().filter(|f| count(&f.name) > 0).max_by_key(|f| {
        // max_by_key keeps the last of equals: rank earlier interfaces higher on ties.
        (count(&f.name), std::cmp::Reverse(f.name.trim_start_matches("eth").parse::<usize>().unwrap_or(0)))
    }) else {
        return routes;
    };
    let mut out = vec![Route { destination: "default".into(), via: best.peer_address, dev: best.name.clone() }];
    out.extend(routes.into_iter().filter(|r| r.dev != best.name));
    out
}

/// `/etc/resolv.conf` for every lab host: the lab has no name server unless it runs one, so lookups go to the
/// host's own loopback and fail at once. Without it, they go to the machine's name server, which lab hosts cannot
/// reach: a program that looks a name up (Python's `http.server` resolves the address it binds to) waits seconds for
/// it while the packets wander the lab along its default routes.
pub const RESOLV_CONF: &str =
    "# written by flexstack lab: no name server in the lab (host names are in /etc/hosts)\nnameserver 127.0.0.1\noptions timeout:1 attempts:1\n";

/// `/etc/hosts` for host `h`: every host's name with the address `h` should use for it.
fn hosts_file(lab: &Lab, hosts: &[HostPlan], h: usize) -> String {
    let mut out =
        format!("# lab {}, host {}: written by flexstack lab\n127.0.0.1\tlocalhost\n", lab.name, hosts[h].name);
    let me = &hosts[h];
    for (x, other) in hosts.iter().enumerate() {
        let address = if x == h {
            me.interfaces.first().map(|f| f.address)
        } else {
            me.interfaces
                .iter()
                .find(|f| f.peer_host == other.name)
                .map(|f| f.peer_address)
                .or_else(|| other.interfaces.first().map(|f| f.address))
        };
        if let Some(a) = address {
            let _ = writeln!(out, "{a}\t{}", other.name);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lab(text: &str) -> Lab {
        Lab::parse("t.toml", text).unwrap()
    }

    const CHAIN: &str = r#"
[lab]
name = "chain"
duration = "10s"
seed = 3
[hosts.h1]
[hosts.r]
[hosts.h2]
[[links]]
a = "h1"
b = "r"
delay = "10ms"
[[links]]
a = "r"
b = "h2"
bw = 5
"#;

    #[test]
    fn names_addresses_and_neighbours() {
        let l = lab(CHAIN);
        let p = Plan::new(&l).unwrap();
        assert_eq!(p.wire_netns, "fl-lab.chain");
        let r = p.host("r").unwrap();
        assert_eq!(r.netns, "fl-lab.chain.r");
        assert_eq!(r.interfaces.len(), 2);
        assert_eq!((r.interfaces[0].name.as_str(), r.interfaces[0].wire_name.as_str()), ("eth0", "l0b"));
        assert_eq!(r.interfaces[0].address, Ipv4Addr::new(10, 0, 0, 2));
        assert_eq!(r.interfaces[0].peer_address, Ipv4Addr::new(10, 0, 0, 1));
        assert_eq!(r.interfaces[1].address, Ipv4Addr::new(10, 0, 1, 1));
        assert_eq!(r.interfaces[1].mac, "02:00:0a:00:01:01");
        let h2 = p.host("h2").unwrap();
        assert_eq!(h2.interfaces[0].peer_mac, r.interfaces[1].mac);
    }

    #[test]
    fn routes_follow_shortest_paths() {
        let p = Plan::new(&lab(CHAIN)).unwrap();
        let h1 = p.host("h1").unwrap();
        // A leaf host: one default route instead of a route per subnet.
        assert_eq!(
            h1.routes,
            vec![Route { destination: "default".into(), via: Ipv4Addr::new(10, 0, 0, 2), dev: "eth0".into() }]
        );
        assert!(p.host("r").unwrap().routes.is_empty());
        let h2 = p.host("h2").unwrap();
        assert_eq!(h2.routes.len(), 1);
        assert_eq!(h2.route_to(Ipv4Addr::new(10, 0, 0, 1)).unwrap().via, Ipv4Addr::new(10, 0, 1, 1));
        assert_eq!(h2.route_to(Ipv4Addr::new(10, 0, 1, 1)).unwrap().destination, "default");
    }

    #[test]
    fn a_subnet_is_reached_through_its_nearer_end_not_the_first_interface() {
        // m - a1 - s and m - a2 - s: from a2, link a1-s (10.0.2.0/24) is one hop away through s, two through m.
        let text = "[lab]\nname = \"sq\"\nduration = \"1s\"\n[hosts.m]\n[hosts.a1]\n[hosts.a2]\n[hosts.s]\n\
                    [[links]]\na = \"m\"\nb = \"a1\"\n[[links]]\na = \"m\"\nb = \"a2\"\n\
                    [[links]]\na = \"a1\"\nb = \"s\"\n[[links]]\na = \"a2\"\nb = \"s\"\n";
        let p = Plan::new(&lab(text)).unwrap();
        let a2 = p.host("a2").unwrap();
        let r = a2.routes.iter().find(|r| r.destination == "10.0.2.0/24").unwrap();
        assert_eq!((r.dev.as_str(), r.via), ("eth1", Ipv4Addr::new(10, 0, 3, 2)), "{:?}", a2.routes);
    }

    #[test]
    fn a_line_keeps_routes_only_towards_its_smaller_side_and_every_address_is_reached() {
        let n: usize = 12;
        let mut text = "[lab]\nname = \"line\"\nduration = \"1s\"\n".to_string();
        for i in 0..n {
            text += &format!("[hosts.h{i}]\n");
        }
        for i in 1..n {
            text += &format!("[[links]]\na = \"h{}\"\nb = \"h{i}\"\n", i - 1);
        }
        let l = lab(&text);
        let p = Plan::new(&l).unwrap();
        let total: usize = p.hosts.iter().map(|h| h.routes.len()).sum();
        // Per host: a default route and the subnets on its smaller side beyond its own links.
        let expected: usize = (0..n).map(|i| usize::from(n > 2) + i.min(n - 1 - i).saturating_sub(1)).sum();
        assert_eq!(total, expected, "{:?}", p.hosts.iter().map(|h| &h.routes).collect::<Vec<_>>());
        // Following the routes from any host reaches every link address in as many hops as the line is long.
        for from in 0..n {
            for (li, _) in l.links.iter().enumerate() {
                let target = link_address(li, 2);
                let (mut at, mut hops) = (from, 0);
                while !p.hosts[at].interfaces.iter().any(|f| f.address == target || f.peer_address == target) {
                    let r = p.hosts[at].route_to(target).unwrap_or_else(|| panic!("no route h{at} -> {target}"));
                    let f = p.hosts[at].interfaces.iter().find(|f| f.name == r.dev).unwrap();
                    at = p.hosts.iter().position(|h| h.name == f.peer_host).unwrap();
                    hops += 1;
                    assert!(hops <= n, "a loop from h{from} to {target}");
                }
            }
        }
    }

    #[test]
    fn hosts_file_prefers_a_shared_link() {
        let p = Plan::new(&lab(CHAIN)).unwrap();
        let h1 = &p.host("h1").unwrap().hosts_file;
        assert!(h1.contains("10.0.0.2\tr\n"), "{h1}");
        assert!(h1.contains("10.0.1.2\th2\n"), "{h1}");
        assert!(h1.contains("10.0.0.1\th1\n"), "{h1}");
        let h2 = &p.host("h2").unwrap().hosts_file;
        assert!(h2.contains("10.0.1.1\tr\n"), "{h2}");
    }

    #[test]
    fn seeds_are_deterministic_and_distinct() {
        let a = Plan::new(&lab(CHAIN)).unwrap();
        let b = Plan::new(&lab(CHAIN)).unwrap();
        assert_eq!(a, b);
        let seeds = [a.links[0].seed_ab, a.links[0].seed_ba, a.links[1].seed_ab, a.links[1].seed_ba];
        for i in 0..4 {
            for j in i + 1..4 {
                assert_ne!(seeds[i], seeds[j]);
            }
        }
        let other = Plan::new(&lab(&CHAIN.replace("seed = 3", "seed = 4"))).unwrap();
        assert_ne!(other.links[0].seed_ab, a.links[0].seed_ab);
    }

    #[test]
    fn wire_stack_parses_and_carries_parameters() {
        let l = lab(CHAIN);
        let p = Plan::new(&l).unwrap();
        let text = p.wire_stack(&l);
        let spec = flexstack_core::StackSpec::parse("wire.toml", &text).unwrap();
        assert_eq!(spec.modules.len(), 8, "{text}");
        assert!(text.contains("[modules.\"h1-r_ab\"]\nkind = \"emulator\""), "{text}");
        assert!(text.contains("delay_ms = 10"), "{text}");
        assert!(text.contains("rate_mbit = 5"), "{text}");
        assert!(text.contains("\"l1b -> r-h2_ba\""), "{text}");
    }

    #[test]
    fn stacked_hosts_get_app_subnets_routed_by_shortest_path_or_by_routes() {
        let text = r#"
[lab]
name = "mob"
duration = "1s"
[hosts.mob]
stack = "s.toml"
[hosts.ap1]
[hosts.ap2]
[hosts.srv]
[[links]]
a = "mob"
b = "ap1"
bw = 5
[[links]]
a = "mob"
b = "ap2"
[[links]]
a = "ap1"
b = "srv"
[[links]]
a = "ap2"
b = "srv"
"#;
        let p = Plan::new(&lab(text)).unwrap();
        assert_eq!(p.host("mob").unwrap().app_subnet, Some(Ipv4Addr::new(172, 16, 0, 0)));
        let to_apps = |p: &Plan, h: &str| p.host(h).unwrap().route_to(Ipv4Addr::new(172, 16, 0, 2)).cloned();
        // Shortest path: srv reaches mob through ap1 (first in file order), ap2 directly.
        assert_eq!(to_apps(&p, "srv").unwrap().via, Ipv4Addr::new(10, 0, 2, 1));
        assert_eq!(to_apps(&p, "ap2").unwrap().via, Ipv4Addr::new(10, 0, 1, 1));
        let routed = format!("{text}[[routes]]\nhost = \"srv\"\nto = \"mob\"\nvia = \"ap2\"\n");
        let p = Plan::new(&lab(&routed)).unwrap();
        assert_eq!(to_apps(&p, "srv").unwrap().via, Ipv4Addr::new(10, 0, 3, 1));
        // The stacked host reaches its own apps through its daemon's device, not a lab route.
        assert!(p.host("mob").unwrap().routes.iter().all(|r| r.destination != "172.16.0.0/16"));
        let values = p.template_values(&lab(&routed), "mob");
        let get = |k: &str| values.iter().find(|(p, _)| p == k).map(|(_, v)| v.clone()).unwrap();
        assert_eq!(get("{eth0.address}"), "10.0.0.1");
        assert_eq!(get("{eth1.peer}"), "10.0.1.2");
        assert_eq!(get("{eth0.bw_bps}"), "5000000");
        assert_eq!(get("{eth1.bw_bps}"), "0");
        assert_eq!((get("{eth0.bw_mbit}"), get("{eth1.bw_mbit}")), ("5".into(), "0".into()));
        assert_eq!(get("{eth1.mac}"), "02:00:0a:00:01:01");
        assert_eq!(get("{app_subnet}"), "172.16.0.0/16");
    }

    #[test]
    fn unreachable_hosts_get_no_route_but_resolve() {
        let text = r#"
[lab]
name = "split"
duration = "1s"
[hosts.a]
[hosts.b]
[hosts.c]
[hosts.d]
[[links]]
a = "a"
b = "b"
[[links]]
a = "c"
b = "d"
"#;
        let p = Plan::new(&lab(text)).unwrap();
        assert!(p.host("a").unwrap().routes.is_empty());
        assert!(p.host("a").unwrap().hosts_file.contains("10.0.1.1\tc\n"));
    }
}
