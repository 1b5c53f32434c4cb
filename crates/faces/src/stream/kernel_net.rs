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

use super::engine::{Engine, Flow, Sock};
use flexstack_core::stream::{FlowInfo, Protocol};
use nix::sys::socket::{
    bind, connect, setsockopt, socket, sockopt, AddressFamily, SockFlag, SockType, SockaddrStorage,
};
use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// Sets the congestion control of TCP socket `s` (`TCP_CONGESTION`): any the kernel offers
/// (`net.ipv4.tcp_available_congestion_control`).
pub(crate) fn set_cc(s: &TcpStream, name: &str) -> std::io::Result<()> {
    setsockopt(s, sockopt::TcpCongestion, &OsString::from(name)).map_err(std::io::Error::from)
}

/// The congestion control of TCP socket `s`.
pub(crate) fn cc_of(s: &TcpStream) -> String {
    nix::sys::socket::getsockopt(s, sockopt::TcpCongestion)
        .map(|n| n.to_string_lossy().trim_end_matches('\0').to_string())
        .unwrap_or_default()
}

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
    fn refuse_open(&mut self, id: u64, e: &std::io::Error) {
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
    fn refuse(&mut self, id: u64, reason: &'static str) {
        self.m.aborts_sent.add(1);
        self.push(super::engine::Event::Abort(id, reason));
    }
}
