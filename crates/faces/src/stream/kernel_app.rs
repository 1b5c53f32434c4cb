//! `terminate` with `backend = "kernel"`: the app's TCP connections end at the host kernel's TCP, in a listener
//! the daemon opens inside the app's network namespace, and become streams.
//!
//! When the module is configured (on the control side, which holds CAP_SYS_ADMIN and CAP_NET_ADMIN), it
//! - opens two listeners, IPv4 `0.0.0.0:P` and IPv6 `[::]:P` (the same port), inside the namespace `netns` (the
//!   thread enters it with setns and comes back; a socket stays in the namespace it was made in);
//! - installs there an nftables table `inet flexstack_kernel_P` whose `output` nat chain redirects the TCP flows its
//!   match table selects to that port (`redirect to :P`), in the table's order (`pass` rules `return`), loopback
//!   destinations excepted.
//!
//! An accepted connection's original destination comes from conntrack (`SO_ORIGINAL_DST`, `IP6T_SO_ORIGINAL_DST`);
//! its source is the app's own address and port. `Open` goes down at once; the app's bytes are read only when
//! `Open` comes back up (the far side accepted). App-side UDP has no kernel transport state to take over: the UDP flows
//! the match table selects stay in the data plane, terminated by the smoltcp back-end (`terminates_udp`; see
//! docs/streams.md, "The kernel back-end").
//!
//! The server role: an `Open` coming up for a flow `originate` accepted from the network makes a socket in the
//! app's namespace, transparent and marked [`MARK`], from the client's own address and port to the app
//! ([`Engine::open_app`]); the table's `route` chain and the policy routing of [`MARK`] bring the app's answers back
//! to it (docs/streams.md, "The kernel back-end", "The server role").

use super::engine::{cc_of, reset, room_for_sockets, set_cc, spare_descriptor, Engine, Event, Flow, Sock};
use flexstack_core::stream::{FlowInfo, Protocol, Role};
use flexstack_modules::stream::backend::Side;
use flexstack_modules::stream::matcher::{Candidate, MatchTable};
use nix::sys::socket::{
    bind, getsockopt, listen, setsockopt, socket, sockopt, AddressFamily, Backlog, SockFlag, SockType, SockaddrStorage,
};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpListener};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

/// The redirect installed in the app's namespace: removed when this is dropped (with the module).
#[derive(Debug)]
pub(crate) struct Redirect {
    /// The namespace it is in (`None`: the daemon's own).
    pub(crate) netns: Option<String>,
    pub(crate) table: String,
}

impl Drop for Redirect {
    /// Removes the redirect (the namespace may be gone already: then there is nothing to remove). On a thread of
    /// its own: the module is dropped on the data-plane thread, which must not wait for `nft`.
    fn drop(&mut self) {
        let (netns, table) = (self.netns.clone(), self.table.clone());
        let _ = std::thread::Builder::new().name("nft-cleanup".into()).spawn(move || {
            let _ = crate::netconf::nft(netns.as_deref(), &format!("delete table inet {table}"));
        });
    }
}

/// A listening TCP socket on `addr` (IPv6: v6 only), non-blocking.
pub(crate) fn listener(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let family = if addr.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    if addr.is_ipv6() {
        setsockopt(&fd, sockopt::Ipv6V6Only, &true)?;
    }
    bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrStorage::from(addr))?;
    listen(&fd, Backlog::new(4096).unwrap_or(Backlog::MAXCONN))?;
    Ok(TcpListener::from(fd))
}

/// Runs `f` with the calling thread in network namespace `netns` (a name under /run/netns), then returns it to
/// the namespace it was in.
fn in_netns<T>(netns: &str, f: impl FnOnce() -> std::io::Result<T>) -> std::io::Result<T> {
    use nix::sched::{setns, CloneFlags};
    let own = std::fs::File::open("/proc/thread-self/ns/net")?;
    let target = std::fs::File::open(format!("/run/netns/{netns}"))
        .map_err(|e| std::io::Error::new(e.kind(), format!("network namespace {netns}: {e}")))?;
    setns(&target, CloneFlags::CLONE_NEWNET)?;
    let result = f();
    // Coming back cannot fail where going there worked (same privileges, a namespace we hold open); if it did,
    // this thread would go on in the app's namespace, which must not happen silently.
    setns(&own, CloneFlags::CLONE_NEWNET).expect("returning to the daemon's network namespace");
    result
}

/// Opens the listeners in `netns` and installs the redirect of `matcher`'s TCP flows to them. Returns the
/// listeners and the redirect.
pub(crate) fn open(netns: &str, matcher: &MatchTable, app: &str) -> Result<(Vec<TcpListener>, Redirect), String> {
    if netns.is_empty() {
        return Err("the kernel back-end of terminate needs `netns`, the app's network namespace (a sandbox's \
                    template gives it as netns = \"{netns}\")"
            .into());
    }
    let (listeners, port) = in_netns(netns, || {
        let v4 = listener(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))?;
        let port = v4.local_addr()?.port();
        let v6 = listener(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port))?;
        Ok((vec![v4, v6], port))
    })
    .map_err(|e| format!("cannot listen in network namespace {netns}: {e}"))?;
    let table = format!("flexstack_kernel_{port}");
    let script = nft_script(&table, &redirect_rules(matcher, app, Role::Client, "", Protocol::Tcp, &redirect_to(port)));
    nft_in(netns, &script)?;
    let redirect = Redirect { netns: Some(netns.to_string()), table };
    let ns = crate::netconf::open_netns(netns).map_err(|e| e.to_string());
    ns.and_then(|ns| mark_routing(ns.as_fd(), MARK, MARK_TABLE))
        .map_err(|e| format!("the server role's routing in network namespace {netns}: {e}"))?;
    Ok((listeners, redirect))
}

/// The mark of the packets of the connections `terminate` opens into the app's namespace for the server role,
/// and of the app's answers to them (by conntrack), which policy routing delivers locally (see [`mark_routing`]).
pub(crate) const MARK: u32 = 0x6673_0001;
/// The routing table of [`MARK`]: every destination local.
const MARK_TABLE: u32 = 0x6673;

/// Makes, in the network namespace `ns`, the policy rules `fwmark MARK lookup TABLE` and the routes `local default
/// dev lo` in that table (IPv4 and IPv6), by netlink: packets marked `mark` are delivered locally, to a transparent
/// socket (`terminate`: the app's answers to a connection it opened from a client's non-local address, as TPROXY
/// does for locally made traffic; `originate`: the datagrams its TPROXY rules took, see `kernel_net`). Made once per
/// namespace (those already there are kept) and left with it: they touch only marked packets.
pub(crate) fn mark_routing(ns: std::os::fd::BorrowedFd<'_>, mark: u32, table: u32) -> Result<(), String> {
    use crate::netconf::Rtnl;
    let mut nl = Rtnl::open_in(ns).map_err(|e| e.to_string())?;
    let lo = nl.index_of("lo").map_err(|e| e.to_string())?;
    // The sandbox sets it up later (the stack is built first); a local route needs it now.
    nl.set_up(lo, true);
    nl.commit().map_err(|e| e.to_string())?;
    // One request per commit: one already there (EEXIST: another module made it) says nothing about the others.
    for v6 in [false, true] {
        for rule in [true, false] {
            if rule {
                nl.add_fwmark_rule(v6, mark, table);
            } else {
                nl.add_local_default(v6, table, lo);
            }
            match nl.commit() {
                Err(e) if e.error.kind() != std::io::ErrorKind::AlreadyExists => return Err(e.to_string()),
                _ => {}
            }
        }
    }
    Ok(())
}

/// Runs an nftables script in namespace `netns`.
fn nft_in(netns: &str, script: &str) -> Result<(), String> {
    crate::netconf::nft(Some(netns), script).map_err(|e| format!("the redirect: {e}"))
}

/// The nftables table of the app's namespace: `rules` in a nat `output` chain, loopback destinations and the
/// server role's connections (marked [`MARK`]) excepted, and the `route` chain that marks the app's answers to
/// those connections (by conntrack) so that policy routing delivers them locally (see [`mark_routing`]).
pub(crate) fn nft_script(table: &str, rules: &[String]) -> String {
    let mut nat = vec![
        "ip daddr 127.0.0.0/8 return".to_string(),
        "ip6 daddr ::1 return".into(),
        format!("meta mark {MARK:#x} return"),
    ];
    nat.extend(rules.iter().cloned());
    let marks =
        [format!("meta mark {MARK:#x} ct mark set meta mark"), format!("ct mark {MARK:#x} meta mark set ct mark")];
    nft_table(
        table,
        &[
            ("output", "type nat hook output priority -100", &nat),
            ("route", "type route hook output priority mangle", &marks),
        ],
    )
}

/// An nftables table of `chains` (name, hook line, rules in order), each with policy accept.
pub(crate) fn nft_table(table: &str, chains: &[(&str, &str, &[String])]) -> String {
    let mut s = format!("table inet {table} {{\n");
    for (name, hook, rules) in chains {
        s.push_str(&format!("  chain {name} {{\n    {hook}; policy accept;\n"));
        for r in *rules {
            s.push_str("    ");
            s.push_str(r);
            s.push('\n');
        }
        s.push_str("  }\n");
    }
    s.push_str("}\n");
    s
}

/// The action of a rule that redirects a TCP connection to the listener on `port`.
pub(crate) fn redirect_to(port: u16) -> String {
    format!("redirect to :{port}")
}

/// The nftables rules, in order, that send the flows of `protocol` that `matcher` terminates for app `app` in
/// `role` to the endpoint's sockets: a `pass` rule returns (the flow is not taken), another ends with `action`
/// (TCP: [`redirect_to`] a listener; the server role's UDP: TPROXY to one, see `kernel_net`). Rules of the other
/// role, of the other protocol or for another app select none of these flows and are left out (so are the client
/// role's UDP rules: UDP stays in the data plane, `terminates_udp`). `head`, if not empty, comes first in each rule
/// (the server role: the flows routed to the app).
pub(crate) fn redirect_rules(
    matcher: &MatchTable,
    app: &str,
    role: Role,
    head: &str,
    protocol: Protocol,
    action: &str,
) -> Vec<String> {
    let list = |ranges: &[flexstack_wire::cidr::PortRange]| {
        let items: Vec<String> = ranges.iter().map(ToString::to_string).collect();
        format!("{{ {} }}", items.join(", "))
    };
    let l4 = if protocol == Protocol::Udp { "udp" } else { "tcp" };
    let mut out = Vec::new();
    for r in &matcher.rules {
        if r.role.unwrap_or(Role::Client) != role || r.app.as_deref().is_some_and(|a| a != "*" && a != app) {
            continue;
        }
        if r.protocol.is_some_and(|p| p != protocol) {
            continue;
        }
        let mut words = vec![format!("meta l4proto {l4}")];
        if !head.is_empty() {
            words.push(head.to_string());
        }
        if let Some(to) = &r.to {
            let family = if to.addr().is_ipv4() { "ip" } else { "ip6" };
            words.push(format!("{family} daddr {to}"));
        }
        if let Some(p) = &r.sport {
            words.push(format!("{l4} sport {}", list(p)));
        }
        if let Some(p) = &r.dport {
            words.push(format!("{l4} dport {}", list(p)));
        }
        words.push(if r.pass { "return".into() } else { action.to_string() });
        out.push(words.join(" "));
    }
    out
}

/// Whether `matcher` terminates UDP flows (a `udp` or `*` rule that is not `pass`): they stay in the data plane.
pub(crate) fn terminates_udp(matcher: &MatchTable) -> bool {
    matcher.rules.iter().any(|r| !r.pass && r.protocol != Some(Protocol::Tcp))
}

/// The original destination of a redirected connection, from conntrack.
fn original_dst(s: &std::net::TcpStream, v4: bool) -> std::io::Result<SocketAddr> {
    if v4 {
        let a = getsockopt(&s.as_fd(), sockopt::OriginalDst)?;
        let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
        Ok(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(a.sin_port))))
    } else {
        let a = getsockopt(&s.as_fd(), sockopt::Ip6tOriginalDst)?;
        let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
        Ok(SocketAddr::V6(SocketAddrV6::new(ip, u16::from_be(a.sin6_port), 0, 0)))
    }
}

/// A non-blocking socket of `ty` for a flow of the server role, made in the current namespace: transparent
/// (`IP_TRANSPARENT`: bound to `local`, an address that need not be local), marked `mark` if given, connecting
/// (TCP) or connected (UDP) to `peer`. `terminate` opens one into the app's namespace from the client's address and
/// port ([`MARK`]); `originate` one per UDP flow in the daemon's, from the app's address and port to the client.
pub(crate) fn transparent_socket(
    local: SocketAddr,
    peer: SocketAddr,
    ty: SockType,
    mark: Option<u32>,
) -> std::io::Result<std::os::fd::OwnedFd> {
    let family = if peer.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    let fd = socket(family, ty, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)?;
    // IP_TRANSPARENT at SOL_IP also sets an IPv6 socket's transparency (the kernel's ipv6_setsockopt passes SOL_IP on).
    setsockopt(&fd, sockopt::IpTransparent, &true)?;
    if let Some(mark) = mark {
        setsockopt(&fd, sockopt::Mark, &mark)?;
    }
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrStorage::from(local))?;
    match nix::sys::socket::connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrStorage::from(peer)) {
        Ok(()) | Err(nix::errno::Errno::EINPROGRESS) => Ok(fd),
        Err(e) => Err(e.into()),
    }
}

impl Engine {
    /// terminate: `Open` up of the server role's flow `id` (a client of the network connected to the app through
    /// `originate`): a transparent socket in the app's namespace, from the client's address and port to the app.
    /// TCP: `Open` goes down when the app accepted (see `writable`), `Abort(refused)` when it refused; UDP: ready
    /// at once, each `Data` one datagram to the app.
    pub(crate) fn open_app(&mut self, id: u64, info: FlowInfo) {
        let tcp = info.protocol == Protocol::Tcp;
        let (count, max) =
            if tcp { (self.tcp_count(), self.cfg.max_connections) } else { (self.udp_count(), self.cfg.max_udp_flows) };
        if count >= max || !room_for_sockets(1) {
            self.m.refused.add(1);
            return self.refuse(id, "limit");
        }
        let Some(ns) = self.netns.as_ref() else {
            self.m.stream_bad.add(1);
            return self.refuse(id, "refused");
        };
        let ty = if tcp { SockType::Stream } else { SockType::Datagram };
        let fd = match ns.run(|| transparent_socket(info.src, info.dst, ty, Some(MARK))) {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => return self.refuse(id, "refused"),
            Err(e) => return self.refuse_open(id, &e),
        };
        let now = Instant::now();
        if !tcp {
            let idle = now + Duration::from_millis(self.cfg.udp_timeout_ms);
            return self.insert(id, Flow::new(info, Sock::Udp(std::net::UdpSocket::from(fd))), true, false, Some(idle));
        }
        let stream = std::net::TcpStream::from(fd);
        let _ = stream.set_nodelay(!self.cfg.nagle);
        let deadline = now + Duration::from_millis(self.cfg.connect_timeout_ms);
        self.insert(id, Flow::new(info, Sock::Tcp(stream)), false, true, Some(deadline));
    }

    /// Accepts every connection waiting at listener `index`: each becomes a flow, and `Open` goes out (terminate:
    /// down, the client role; originate: up, the server role).
    pub(crate) fn accept_all(&mut self, index: usize) {
        loop {
            let Some(l) = self.listeners.get(index) else { return };
            let (stream, peer) = match l.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => continue, // the app gave up first
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) && self.spare.is_some() => {
                    // Out of file descriptors: free the one held in reserve, accept and reset the connection (the
                    // app sees a refusal now rather than a connection that hangs in the backlog), take it back.
                    if !std::mem::replace(&mut self.warned_no_files, true) {
                        tracing::warn!(error = %e, "out of file descriptors: refusing the app's new connections \
                            (each kernel-terminated connection holds two; raise the limit of open files)");
                    }
                    // (accept takes the descriptor before it looks at the backlog: EMFILE says nothing about
                    // whether a connection waits.)
                    self.spare = None;
                    let waiting = l.accept();
                    self.spare = spare_descriptor();
                    match waiting {
                        Ok((stream, _)) => {
                            reset(Sock::Tcp(stream));
                            self.m.refused.add(1);
                            if self.spare.is_some() {
                                continue;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && self.spare.is_some() => return,
                        Err(_) => {}
                    }
                    self.pause_listeners();
                    return;
                }
                Err(e) => {
                    // Out of memory, or of descriptors with none in reserve: the connection stays in the backlog
                    // and the listener readable. The listeners leave the epoll set until the next tick, or the
                    // data plane would spin on them.
                    tracing::warn!(error = %e, "cannot accept the app's connection; trying again shortly");
                    self.m.refused.add(1);
                    self.pause_listeners();
                    return;
                }
            };
            let v4 = peer.is_ipv4();
            let dst = match original_dst(&stream, v4) {
                // (Without a translation conntrack answers with the connection's own destination.)
                Ok(d) if stream.local_addr().is_ok_and(|l| l != d) => d,
                _ => {
                    // Not redirected (the app connected to the listener's port itself): no destination to open.
                    self.m.stream_bad.add(1);
                    reset(Sock::Tcp(stream));
                    continue;
                }
            };
            // Room for this socket and the one `originate` opens for it.
            if self.tcp_count() >= self.cfg.max_connections
                || !room_for_sockets(2)
                || stream.set_nonblocking(true).is_err()
            {
                self.m.refused.add(1);
                reset(Sock::Tcp(stream));
                continue;
            }
            let _ = stream.set_nodelay(!self.cfg.nagle);
            // terminate accepts the app's connections (the client role), originate the network's (the server role:
            // its socket is the one towards the network, whose congestion control the module's `cc` sets).
            let role = if self.side == Side::App { Role::Client } else { Role::Server };
            let mut cc = String::new();
            if role == Role::Server {
                if let Some(name) = self.cc.clone() {
                    if let Err(e) = set_cc(&stream, &name) {
                        tracing::warn!(cc = %name, error = %e, "cannot set the congestion control of a connection");
                    }
                }
                cc = cc_of(&stream);
            }
            let Some(side) = self.app.as_ref() else { return };
            let c = Candidate { protocol: Protocol::Tcp, src: peer, dst, role, app: &side.app };
            if let Some((rule, _)) = side.matcher.decide(&c) {
                side.hits[rule].add(1);
            }
            let info = FlowInfo::tcp(peer, dst, &side.app, role);
            self.next_id += 1;
            let id = self.next_id;
            let deadline = Instant::now() + Duration::from_millis(self.cfg.connect_timeout_ms);
            self.push(Event::Open(id, info.clone()));
            let mut flow = Flow::new(info, Sock::Tcp(stream));
            flow.cc = cc;
            self.insert(id, flow, false, false, Some(deadline));
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A match table of `rules`.
    pub(crate) fn table(rules: &[&str]) -> MatchTable {
        MatchTable::parse(&rules.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn the_match_table_becomes_redirect_rules_in_order() {
        let t = table(&[
            "pass tcp dport 22",
            "tcp dport 80,443,8000-8099",
            "tcp to 192.0.2.0/24 sport 1000-2000",
            "* to 2001:db8::/32",
            "tcp role server",
            "tcp app other",
            "pass udp dport 53",
            "tcp app curl",
        ]);
        let rules = redirect_rules(&t, "curl", Role::Client, "", Protocol::Tcp, &redirect_to(40000));
        assert_eq!(
            rules,
            [
                "meta l4proto tcp tcp dport { 22 } return",
                "meta l4proto tcp tcp dport { 80, 443, 8000-8099 } redirect to :40000",
                "meta l4proto tcp ip daddr 192.0.2.0/24 tcp sport { 1000-2000 } redirect to :40000",
                "meta l4proto tcp ip6 daddr 2001:db8::/32 redirect to :40000",
                "meta l4proto tcp redirect to :40000",
            ]
        );
        let script = nft_script("flexstack_kernel_40000", &rules);
        assert!(script.starts_with("table inet flexstack_kernel_40000 {\n  chain output {\n"), "{script}");
        assert!(script.contains(
            "ip daddr 127.0.0.0/8 return\n    ip6 daddr ::1 return\n    meta mark 0x66730001 return\n    \
             meta l4proto tcp tcp dport { 22 } return\n"
        ));
        assert!(
            script.ends_with(
                "  chain route {\n    type route hook output priority mangle; policy accept;\n    \
                 meta mark 0x66730001 ct mark set meta mark\n    ct mark 0x66730001 meta mark set ct mark\n  }\n}\n"
            ),
            "{script}"
        );
    }

    #[test]
    fn udp_rules_stay_in_the_data_plane() {
        let t = table(&["tcp dport 80", "pass udp dport 5353", "udp dport 53", "* to 192.0.2.0/24"]);
        assert_eq!(
            redirect_rules(&t, "a", Role::Client, "", Protocol::Tcp, &redirect_to(7)).len(),
            2,
            "no UDP rule is redirected"
        );
        assert!(terminates_udp(&t));
        assert!(terminates_udp(&table(&["*"])));
        assert!(!terminates_udp(&table(&["tcp *", "pass udp *"])));
        assert_eq!(
            redirect_rules(&table(&["*"]), "a", Role::Client, "", Protocol::Tcp, &redirect_to(7)),
            ["meta l4proto tcp redirect to :7"]
        );
    }

    /// The server role's rules: those with `role server` (TCP, this app), each after the given head.
    #[test]
    fn the_server_role_becomes_redirect_rules_of_its_own() {
        let t = table(&["tcp *", "pass tcp dport 22 role server", "tcp dport 80 to 10.0.0.0/8 role server", "udp *"]);
        let rules = redirect_rules(&t, "a", Role::Server, "oifname \"fsh1\"", Protocol::Tcp, &redirect_to(9));
        assert_eq!(
            rules,
            [
                "meta l4proto tcp oifname \"fsh1\" tcp dport { 22 } return",
                "meta l4proto tcp oifname \"fsh1\" ip daddr 10.0.0.0/8 tcp dport { 80 } redirect to :9",
            ]
        );
    }

    #[test]
    fn without_a_namespace_nothing_is_opened() {
        let e = open("", &table(&["tcp *"]), "a").unwrap_err();
        assert!(e.contains("needs `netns`"), "{e}");
    }
}
