//! `originate` with `backend = "kernel"`: each flow is opened again by a non-blocking kernel socket of the daemon,
//! in the daemon's network namespace, towards the original destination.
//!
//! - TCP: `Open` down starts a non-blocking connect (from `source` of the destination's family if set, the kernel
//!   choosing the port; else from an address the kernel chooses); when it completes, `Open` goes up with the local
//!   address the socket got. A refusal becomes `Abort(refused)`, an ICMP error `Abort(unreachable)`, the kernel's
//!   own give-up `Abort(timeout)`, and so does no answer within `connect_timeout_ms`. The socket's congestion
//!   control is the module's `cc` (the per-flow knob `tcp.cc` changes it at once: `TCP_CONGESTION`).
//! - UDP: a connected UDP socket per flow: each `Data` down is one datagram sent, each datagram from the destination
//!   one `Data` up; `udp_timeout_ms` without a datagram either way ends the flow (`Fin`); an ICMP port unreachable
//!   (the socket's ECONNREFUSED) ends it with `Abort(unreachable)`.
//! - The server role (`role server` TCP rules): listeners in the daemon's namespace and an nftables redirect of the
//!   connections to the app's addresses to them ([`open_server`]); an accepted connection sends `Open` up (see
//!   `Engine::accept_all`) and is read once `Open` comes back down (`terminate` connected to the app).

use super::engine::{cc_of, set_cc, Engine, Flow, Sock};
use super::kernel_app::{self, listener, nft_table, redirect_rules, redirect_to, Redirect};
use crate::sock::{socket_addr, socket_for};
use flexstack_core::stream::{FlowInfo, Protocol, Role};
use flexstack_modules::stream::matcher::{Candidate, MatchTable};
use nix::sys::socket::{
    bind, connect, setsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, SockaddrStorage,
};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::os::fd::AsFd;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

impl Engine {
    /// originate: `Open` of flow `id`: its socket, connecting (TCP) or ready (UDP).
    pub(crate) fn open_net(&mut self, id: u64, mut info: FlowInfo) {
        let tcp = info.protocol == Protocol::Tcp;
        let (count, max) =
            if tcp { (self.tcp_count(), self.cfg.max_connections) } else { (self.udp_count(), self.cfg.max_udp_flows) };
        if count >= max || !super::engine::room_for_sockets(1) {
            self.m.refused.add(1);
            return self.refuse(id, "limit");
        }
        let source = self.cfg.source.iter().find(|a| a.is_ipv4() == info.dst.is_ipv4()).copied();
        let now = Instant::now();
        if !tcp {
            let sock = socket_for(info.dst, SockType::Datagram, source).map(UdpSocket::from).and_then(|s| {
                s.connect(info.dst)?;
                Ok(s)
            });
            let sock = match sock {
                Ok(s) => s,
                Err(e) => return self.refuse_open(id, &e),
            };
            if let Ok(local) = sock.local_addr() {
                info.src = local;
            }
            let idle = now + Duration::from_millis(self.cfg.udp_timeout_ms);
            return self.insert(id, Flow::new(info, Sock::Udp(sock)), true, false, Some(idle));
        }
        let fd = match socket_for(info.dst, SockType::Stream, source) {
            Ok(fd) => fd,
            Err(e) => return self.refuse_open(id, &e),
        };
        let _ = setsockopt(&fd, sockopt::TcpNoDelay, &!self.cfg.nagle);
        let stream = TcpStream::from(fd);
        let mut cc = String::new();
        if let Some(name) = self.cc.clone() {
            if let Err(e) = set_cc(&stream, &name) {
                tracing::warn!(cc = %name, error = %e, "cannot set the congestion control of a new connection");
            }
        }
        cc.push_str(&cc_of(&stream));
        match connect(stream.as_raw_fd(), &SockaddrStorage::from(info.dst)) {
            Ok(()) | Err(nix::errno::Errno::EINPROGRESS) => {}
            Err(e) => {
                let r = super::engine::reason(&std::io::Error::from(e), true);
                return self.refuse(id, r);
            }
        }
        let mut flow = Flow::new(info, Sock::Tcp(stream));
        flow.cc = cc;
        let deadline = now + Duration::from_millis(self.cfg.connect_timeout_ms);
        self.insert(id, flow, false, true, Some(deadline));
    }

    /// originate with the server role: takes every datagram waiting at its UDP socket `index` (sent there by
    /// TPROXY, see [`open_server`]). A datagram of a flow it has joins the flow's inbox; the first of a new flow (by
    /// client and original destination) makes the flow: its socket in the daemon's namespace, transparent, bound to
    /// the app's address and port and connected to the client (the later datagrams reach it directly; the app's
    /// answers leave from the app's address), `Open` up (role server), then each datagram one `Data`.
    pub(crate) fn receive_all(&mut self, index: usize) {
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
        let mut buf = std::mem::take(&mut self.scratch);
        buf.resize(super::engine::MAX_DATAGRAM, 0);
        while let Some((sock, dropped)) = self.udp_listeners.get_mut(index) {
            let mut cmsg = nix::cmsg_space!(libc::sockaddr_in6, u32);
            let mut iov = [std::io::IoSliceMut::new(&mut buf)];
            let (n, client, dst) =
                match recvmsg::<SockaddrStorage>(sock.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty()) {
                    Ok(msg) => {
                        let mut dst = None;
                        for c in msg.cmsgs().into_iter().flatten() {
                            match c {
                                ControlMessageOwned::RxqOvfl(total) => {
                                    super::engine::add_socket_drops(total, dropped, &self.m.udp_socket_drops)
                                }
                                ControlMessageOwned::Ipv4OrigDstAddr(a) => {
                                    dst = Some(SocketAddr::V4(std::net::SocketAddrV4::new(
                                        Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                                        u16::from_be(a.sin_port),
                                    )))
                                }
                                ControlMessageOwned::Ipv6OrigDstAddr(a) => {
                                    dst = Some(SocketAddr::V6(std::net::SocketAddrV6::new(
                                        Ipv6Addr::from(a.sin6_addr.s6_addr),
                                        u16::from_be(a.sin6_port),
                                        0,
                                        0,
                                    )))
                                }
                                _ => {}
                            }
                        }
                        let client = msg.address.as_ref().and_then(socket_addr);
                        (msg.bytes, client, dst)
                    }
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(nix::errno::Errno::EAGAIN) => break,
                    Err(e) => {
                        tracing::debug!(error = %e, "reading the server role's UDP socket");
                        break;
                    }
                };
            let (Some(client), Some(dst)) = (client, dst) else {
                self.m.stream_bad.add(1); // not sent here by TPROXY (no original destination)
                continue;
            };
            self.datagram_from_network(client, dst, &buf[..n]);
        }
        self.scratch = buf;
    }

    /// A datagram from `client` to `dst` (the app) that reached the server role's UDP socket: to its flow, made if
    /// new (see [`Engine::receive_all`]).
    fn datagram_from_network(&mut self, client: SocketAddr, dst: SocketAddr, data: &[u8]) {
        let id = match self.udp_server.get(&(client, dst)) {
            Some(&id) => id,
            None => {
                if self.udp_count() >= self.cfg.max_udp_flows || !super::engine::room_for_sockets(1) {
                    self.m.refused.add(1);
                    return;
                }
                let Some(side) = self.app.as_ref() else { return };
                let c = Candidate { protocol: Protocol::Udp, src: client, dst, role: Role::Server, app: &side.app };
                if let Some((rule, _)) = side.matcher.decide(&c) {
                    side.hits[rule].add(1);
                }
                let info = FlowInfo::udp(client, dst, &side.app, Role::Server);
                let sock = match kernel_app::transparent_socket(dst, client, SockType::Datagram, None) {
                    Ok(fd) => {
                        // Room for a burst while the data plane is busy (as a UDP server app would ask for).
                        let _ = setsockopt(&fd, sockopt::RcvBufForce, &RECEIVE_BUFFER);
                        UdpSocket::from(fd)
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, %client, %dst, "cannot open the server role's UDP socket");
                        self.m.refused.add(1);
                        return;
                    }
                };
                self.next_id += 1;
                let id = self.next_id;
                self.push(super::engine::Event::Open(id, info.clone()));
                let idle = Instant::now() + Duration::from_millis(self.cfg.udp_timeout_ms);
                self.insert(id, Flow::new(info, Sock::Udp(sock)), true, false, Some(idle));
                self.udp_server.insert((client, dst), id);
                id
            }
        };
        if let Some(f) = self.flows.get_mut(&id) {
            f.inbox.push_back(data.to_vec());
        }
        self.wake(id);
    }

    /// Answers `Open` of flow `id` whose socket could not be made: out of descriptors or memory is a refusal
    /// (counted in `refused_total`, as a limit is), anything else (no route, a source address it cannot bind) an
    /// unreachable destination.
    pub(crate) fn refuse_open(&mut self, id: u64, e: &std::io::Error) {
        if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)) {
            if !std::mem::replace(&mut self.warned_no_files, true) {
                tracing::warn!(error = %e, "cannot open sockets towards the destinations: refusing new connections");
            }
            self.m.refused.add(1);
            return self.refuse(id, "refused");
        }
        self.refuse(id, "unreachable")
    }

    /// Answers `Open` of flow `id` with `Abort(reason)`: no flow is made.
    pub(crate) fn refuse(&mut self, id: u64, reason: &'static str) {
        self.m.aborts_sent.add(1);
        self.push(super::engine::Event::Abort(id, reason));
    }
}

/// Whether `matcher` has rules of the server role that terminate flows of `protocol` for app `app` (originate then
/// listens for them).
pub(crate) fn serves(matcher: &MatchTable, app: &str, protocol: Protocol) -> bool {
    matcher.rules.iter().any(|r| {
        !r.pass
            && r.role == Some(Role::Server)
            && r.protocol.is_none_or(|p| p == protocol)
            && r.app.as_deref().is_none_or(|a| a == "*" || a == app)
    })
}

/// The mark of the datagrams the server role's TPROXY rules take in the daemon's namespace, which policy routing
/// delivers locally (to originate's sockets: `kernel_app::mark_routing`).
pub(crate) const NET_MARK: u32 = 0x6673_0002;
/// The routing table of [`NET_MARK`]: every destination local.
const NET_MARK_TABLE: u32 = 0x6674;

/// The receive buffer of the server role's UDP sockets (`SO_RCVBUFFORCE`, past `net.core.rmem_max`): 2 MiB, about
/// 1,000 datagrams of 1,200 bytes, for the bursts that arrive while the data plane is busy elsewhere.
const RECEIVE_BUFFER: usize = 2 << 20;

/// A UDP socket on `addr` (IPv6: v6 only), non-blocking, that takes the datagrams the server role's TPROXY rules
/// send it: transparent, and telling each datagram's original destination (`IP_RECVORIGDSTADDR`,
/// `IPV6_RECVORIGDSTADDR`).
fn udp_listener(addr: SocketAddr) -> std::io::Result<UdpSocket> {
    let family = if addr.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    let fd = socket(family, SockType::Datagram, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    setsockopt(&fd, sockopt::IpTransparent, &true)?;
    let _ = setsockopt(&fd, sockopt::RcvBufForce, &RECEIVE_BUFFER);
    if addr.is_ipv6() {
        setsockopt(&fd, sockopt::Ipv6V6Only, &true)?;
        setsockopt(&fd, sockopt::Ipv6OrigDstAddr, &true)?;
    } else {
        setsockopt(&fd, sockopt::Ipv4OrigDstAddr, &true)?;
    }
    bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))?;
    Ok(UdpSocket::from(fd))
}

/// What originate with the server role listens with: TCP listeners, UDP sockets, and the table that sends them
/// the network's flows to the app.
pub(crate) type Listening = (Vec<std::net::TcpListener>, Vec<UdpSocket>, Redirect);

/// originate with the server role: opens its sockets on one port `Q` in the daemon's namespace (for `role server`
/// TCP rules listeners `0.0.0.0:Q` and `[::]:Q`; for UDP rules transparent UDP sockets on the same addresses) and
/// installs there the table `inet flexstack_kserver_Q`:
/// - TCP: its nat `prerouting` (clients routed through the host: `fib daddr oifname DEV`) and `output` (clients on
///   the host: `oifname DEV`) chains redirect to `:Q` the connections the host routes to the app (through
///   `host_dev`, its host face) that `matcher`'s `role server` rules select;
/// - UDP: its `divert` chain (filter, prerouting, priority mangle) sends the datagrams routed to the app that those
///   rules select to `:Q` by TPROXY (`tproxy to :Q`, marked [`NET_MARK`], which the policy rules made here deliver
///   locally): a datagram of a flow originate has a socket for reaches that socket (TPROXY looks for a connected
///   one first), the first of a flow the UDP socket on `:Q`, which tells its original destination. Clients on the
///   host: its `local` chain (route, output) marks their datagrams to the app that the rules select, which policy
///   routing sends through `lo`, where `divert` takes them as it takes the routed ones.
///
/// `None` when it has no such rule.
pub(crate) fn open_server(host_dev: &str, matcher: &MatchTable, app: &str) -> Result<Option<Listening>, String> {
    let (tcp, udp) = (serves(matcher, app, Protocol::Tcp), serves(matcher, app, Protocol::Udp));
    if !tcp && !udp {
        return Ok(None);
    }
    if host_dev.is_empty() || host_dev.contains('"') {
        return Err("the server role of the kernel back-end of originate needs `host_dev`, the app's host face \
                    (a sandbox's template gives it as host_dev = \"{host_dev}\"): the connections routed there are \
                    redirected"
            .into());
    }
    let any = |v6: bool, port: u16| {
        SocketAddr::new(if v6 { IpAddr::V6(Ipv6Addr::UNSPECIFIED) } else { IpAddr::V4(Ipv4Addr::UNSPECIFIED) }, port)
    };
    let (mut listeners, mut sockets, mut port) = (Vec::new(), Vec::new(), 0);
    if tcp {
        let v4 = listener(any(false, 0)).map_err(|e| format!("listen: {e}"))?;
        port = v4.local_addr().map_err(|e| e.to_string())?.port();
        listeners.push(v4);
        listeners.push(listener(any(true, port)).map_err(|e| format!("listen: {e}"))?);
    }
    if udp {
        let v4 = udp_listener(any(false, port)).map_err(|e| format!("UDP socket of the server role: {e}"))?;
        port = v4.local_addr().map_err(|e| e.to_string())?.port();
        sockets.push(v4);
        sockets.push(udp_listener(any(true, port)).map_err(|e| format!("UDP socket of the server role: {e}"))?);
        // Once per daemon's namespace: the kernel numbers a rule given without a priority below the last one, so
        // the same rule made again is another one, not "already there".
        let mut nl = crate::netconf::Rtnl::open().map_err(|e| e.to_string())?;
        let mut has_rule = |v6: bool| {
            nl.has_fwmark_rule(v6, NET_MARK).map_err(|e| format!("the server role's routing of datagrams: {e}"))
        };
        if !has_rule(false)? || !has_rule(true)? {
            let own = std::fs::File::open("/proc/thread-self/ns/net").map_err(|e| format!("own namespace: {e}"))?;
            kernel_app::mark_routing(own.as_fd(), NET_MARK, NET_MARK_TABLE)
                .map_err(|e| format!("the server role's routing of datagrams: {e}"))?;
        }
    }
    let table = format!("flexstack_kserver_{port}");
    let rules = |protocol: Protocol, head: &str, action: &str| {
        redirect_rules(matcher, app, Role::Server, head, protocol, action)
    };
    let (routed, on_host) = (format!("fib daddr oifname \"{host_dev}\""), format!("oifname \"{host_dev}\""));
    let mut chains = Vec::new();
    let (prerouting, output, divert, local);
    if tcp {
        prerouting = rules(Protocol::Tcp, &routed, &redirect_to(port));
        output = rules(Protocol::Tcp, &on_host, &redirect_to(port));
        chains.push(("prerouting", "type nat hook prerouting priority dstnat", prerouting.as_slice()));
        chains.push(("output", "type nat hook output priority -100", output.as_slice()));
    }
    if udp {
        divert = rules(Protocol::Udp, &routed, &format!("meta mark set {NET_MARK:#x} tproxy to :{port} accept"));
        local = rules(Protocol::Udp, &on_host, &format!("meta mark set {NET_MARK:#x}"));
        chains.push(("divert", "type filter hook prerouting priority mangle", divert.as_slice()));
        chains.push(("local", "type route hook output priority mangle", local.as_slice()));
    }
    crate::netconf::nft(None, &nft_table(&table, &chains)).map_err(|e| format!("the server role's redirect: {e}"))?;
    Ok(Some((listeners, sockets, Redirect { netns: None, table })))
}

#[cfg(test)]
mod tests {
    use super::kernel_app::tests::table;
    use super::*;

    /// The server role's UDP and `*` rules (this app's) become TPROXY rules of the UDP socket's port, in order;
    /// `pass` rules return; TCP and client-role rules are not there.
    #[test]
    fn the_server_role_s_udp_rules_become_tproxy_rules() {
        let t = table(&[
            "udp *",
            "tcp dport 80 role server",
            "pass udp dport 22 role server",
            "* dport 53 role server",
            "udp dport 5000-5100 to 10.0.0.0/8 role server app other",
            "udp sport 7 to fd00::/8 role server",
        ]);
        assert!(serves(&t, "a", Protocol::Udp) && serves(&t, "a", Protocol::Tcp));
        assert!(!serves(&table(&["tcp dport 80 role server", "udp *"]), "a", Protocol::Udp));
        assert!(!serves(&table(&["pass udp dport 80 role server"]), "a", Protocol::Udp));
        let action = format!("meta mark set {NET_MARK:#x} tproxy to :9 accept");
        let rules = redirect_rules(&t, "a", Role::Server, "fib daddr oifname \"fsh1\"", Protocol::Udp, &action);
        assert_eq!(
            rules,
            [
                "meta l4proto udp fib daddr oifname \"fsh1\" udp dport { 22 } return",
                "meta l4proto udp fib daddr oifname \"fsh1\" udp dport { 53 } meta mark set 0x66730002 tproxy to :9 accept",
                "meta l4proto udp fib daddr oifname \"fsh1\" ip6 daddr fd00::/8 udp sport { 7 } meta mark set \
                 0x66730002 tproxy to :9 accept",
            ]
        );
    }

    #[test]
    fn the_server_role_needs_the_host_face() {
        let e = open_server("", &table(&["udp dport 53 role server"]), "a").unwrap_err();
        assert!(e.contains("needs `host_dev`"), "{e}");
        assert!(open_server("", &table(&["udp dport 53"]), "a").unwrap().is_none(), "no server role: nothing opened");
    }
}
