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
use super::kernel_app::{listener, nft_table, redirect_rules, Redirect};
use flexstack_core::stream::{FlowInfo, Protocol, Role};
use flexstack_modules::stream::matcher::MatchTable;
use nix::sys::socket::{
    bind, connect, setsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, SockaddrStorage,
};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// A non-blocking socket of `ty` for `dst`'s family, bound to `source` (its family's address, port 0) if any.
fn socket_for(dst: SocketAddr, ty: SockType, source: Option<IpAddr>) -> std::io::Result<OwnedFd> {
    let family = if dst.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    let fd = socket(family, ty, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)?;
    if let Some(ip) = source {
        bind(fd.as_raw_fd(), &SockaddrStorage::from(SocketAddr::new(ip, 0)))?;
    }
    Ok(fd)
}

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

/// Whether `matcher` has rules of the server role that terminate TCP for app `app` (originate then listens).
pub(crate) fn serves(matcher: &MatchTable, app: &str) -> bool {
    matcher.rules.iter().any(|r| {
        !r.pass
            && r.role == Some(Role::Server)
            && r.protocol != Some(Protocol::Udp)
            && r.app.as_deref().is_none_or(|a| a == "*" || a == app)
    })
}

/// originate with the server role: opens its listeners, `0.0.0.0:Q` and `[::]:Q`, in the daemon's namespace, and
/// installs there the table `inet flexstack_kserver_Q` whose nat `prerouting` (clients routed through the host:
/// `fib daddr oifname DEV`) and `output` (clients on the host: `oifname DEV`) chains redirect to `:Q` the TCP
/// connections the host routes to the app (through `host_dev`, its host face) that `matcher`'s `role server` rules
/// select. `None` when it has no such rule.
pub(crate) fn open_server(
    host_dev: &str,
    matcher: &MatchTable,
    app: &str,
) -> Result<Option<(Vec<std::net::TcpListener>, Redirect)>, String> {
    if !serves(matcher, app) {
        return Ok(None);
    }
    if host_dev.is_empty() || host_dev.contains('"') {
        return Err("the server role of the kernel back-end of originate needs `host_dev`, the app's host face \
                    (a sandbox's template gives it as host_dev = \"{host_dev}\"): the connections routed there are \
                    redirected"
            .into());
    }
    let v4 = listener(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)).map_err(|e| format!("listen: {e}"))?;
    let port = v4.local_addr().map_err(|e| e.to_string())?.port();
    let v6 = listener(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port)).map_err(|e| format!("listen: {e}"))?;
    let table = format!("flexstack_kserver_{port}");
    let routed = redirect_rules(matcher, app, port, Role::Server, &format!("fib daddr oifname \"{host_dev}\""));
    let local = redirect_rules(matcher, app, port, Role::Server, &format!("oifname \"{host_dev}\""));
    let script = nft_table(
        &table,
        &[
            ("prerouting", "type nat hook prerouting priority dstnat", &routed),
            ("output", "type nat hook output priority -100", &local),
        ],
    );
    crate::netconf::nft(None, &script).map_err(|e| format!("the server role's redirect: {e}"))?;
    Ok(Some((vec![v4, v6], Redirect { netns: None, table })))
}
