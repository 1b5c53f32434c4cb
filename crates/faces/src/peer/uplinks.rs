//! A connecting carrier's uplinks ([`Uplinks`], docs/peers.md, "Several uplinks"), and the UDP sockets of a `quic`,
//! `udp` or `udpplus` carrier ([`Sockets`]): one bound to the wildcard address (the kernel's routing picks the way),
//! or, with `uplinks`, one per uplink bound to its local address, of which the carrier sends from the **active** one
//! and reads them all. A NETLINK_ROUTE socket joined to the link and address groups, in the carrier's epoll set, says
//! when something changed; the uplinks are then looked at again (getifaddrs: which interface holds each address, up
//! with carrier or not), and when the active one is not usable any more the carrier moves to the first usable one.
//! The engines do what moving means for them (quinn-proto's migration, the datagram carriers' re-binding, the `tcp`
//! carrier's session resumed on a new connection from the new uplink's address).

use super::batch;
use crate::linkwatch::{LinkWatch, RTMGRP_IFADDR, RTMGRP_LINK};
use flexstack_modules::stream::carrier::Meters;
use nix::ifaddrs::getifaddrs;
use nix::net::if_::InterfaceFlags;
use nix::sys::epoll::{Epoll, EpollEvent, EpollFlags};
use nix::sys::socket::{setsockopt, sockopt};
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::AsFd;
use std::time::Instant;

/// The sockets' buffers: a congestion window's worth of datagrams (GSO runs and GRO ones arrive 64 at once).
const SOCKET_BUFFER: usize = 8 << 20;
/// Epoll tokens: the netlink socket, then the sockets from `SOCKETS`.
const WATCH: u64 = 10;
const SOCKETS: u64 = 16;

/// A carrier's uplinks (`uplinks`): their local addresses, which one is in use, and the link watch that says when
/// to look at them again. The UDP carriers hold them in [`Sockets`]; the `tcp` carrier opens its connection from
/// the active one's address.
pub(crate) struct Uplinks {
    addrs: Vec<IpAddr>,
    active: usize,
    /// The link and address events.
    watch: LinkWatch,
    /// When something was last received.
    last_rx: Option<Instant>,
    /// After a move: when the last thing before it came (the gap ends with the first on the new uplink).
    gap_from: Option<Instant>,
    /// No uplink was usable when last looked at (logged once).
    stranded: bool,
}

impl Uplinks {
    /// The uplinks of `addrs` towards `peer` (each of its address family), starting on the first usable one.
    pub(crate) fn new(addrs: &[IpAddr], peer: SocketAddr) -> Result<Uplinks, String> {
        if let Some(a) = addrs.iter().find(|a| a.is_ipv4() != peer.is_ipv4()) {
            return Err(format!("uplink {a} is not of the peer's address family ({peer})"));
        }
        let watch = LinkWatch::joined(RTMGRP_LINK | RTMGRP_IFADDR)
            .map_err(|e| format!("cannot watch the uplinks (netlink): {e}"))?;
        let active = usable(addrs).iter().position(|u| *u).unwrap_or(0);
        Ok(Uplinks { addrs: addrs.to_vec(), active, watch, last_rx: None, gap_from: None, stranded: false })
    }

    /// Adds the watch to the carrier's epoll set, as `token`.
    pub(crate) fn watch_in(&self, epoll: &Epoll, token: u64) {
        epoll
            .add(self.watch.fd(), EpollEvent::new(EpollFlags::EPOLLIN, token))
            .expect("the uplink watch in the epoll set");
    }

    /// The position of the uplink in use.
    pub(crate) fn active(&self) -> usize {
        self.active
    }

    /// The address of the uplink in use.
    pub(crate) fn addr(&self) -> IpAddr {
        self.addrs[self.active]
    }

    /// The module's meters at the start.
    pub(crate) fn init_meters(&self, m: &Meters) {
        m.uplink_active.set(self.active as u64);
    }

    /// Something came over uplink `i` at `now`: the end of the latest move's gap if it is the first on the new one.
    pub(crate) fn received(&mut self, i: usize, now: Instant, m: &Meters) {
        if i == self.active {
            if let Some(from) = self.gap_from.take() {
                m.migration_gap_us.set(now.duration_since(from).as_micros() as u64);
            }
        }
        self.last_rx = Some(now);
    }

    /// Reads the watch's events; when something changed, looks at the uplinks and moves off an active one that is
    /// not usable any more. True when the carrier moved (it then does what moving means for it).
    pub(crate) fn moved(&mut self, now: Instant, m: &Meters) -> bool {
        if !self.watch.drain() {
            return false;
        }
        let usable = usable(&self.addrs);
        if usable[self.active] {
            self.stranded = false;
            return false;
        }
        let Some(next) = usable.iter().position(|u| *u) else {
            if !self.stranded {
                tracing::warn!(uplinks = ?self.addrs, "carrier: no uplink is usable; staying on {}", self.addrs[self.active]);
            }
            self.stranded = true;
            return false;
        };
        self.stranded = false;
        tracing::info!(from = %self.addrs[self.active], to = %self.addrs[next], "carrier: uplink down, moving");
        self.active = next;
        self.gap_from = self.last_rx.or(Some(now));
        m.migrations.add(1);
        m.uplink_active.set(next as u64);
        true
    }
}

/// A carrier's UDP sockets and, with uplinks, which one it sends from.
pub(crate) struct Sockets {
    sockets: Vec<UdpSocket>,
    /// With `uplinks`: one socket per uplink, in their order.
    uplinks: Option<Uplinks>,
}

impl Sockets {
    /// One socket bound to `addr` (accepting: `listen`; connecting without uplinks: the wildcard address).
    pub(crate) fn single(socket: UdpSocket) -> Sockets {
        Sockets { sockets: vec![socket], uplinks: None }
    }

    /// A connecting carrier's sockets towards `peer`: one per uplink of `uplinks` (the wildcard one when empty).
    pub(crate) fn connecting(uplinks: &[IpAddr], peer: SocketAddr) -> Result<Sockets, String> {
        if uplinks.is_empty() {
            let any: SocketAddr = if peer.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().expect("an address");
            let socket = UdpSocket::bind(any).map_err(|e| format!("cannot open a UDP socket: {e}"))?;
            return Ok(Sockets::single(socket));
        }
        let up = Uplinks::new(uplinks, peer)?;
        let mut sockets = Vec::new();
        for a in uplinks {
            let s = UdpSocket::bind(SocketAddr::new(*a, 0))
                .map_err(|e| format!("cannot open a UDP socket on uplink {a}: {e}"))?;
            sockets.push(s);
        }
        Ok(Sockets { sockets, uplinks: Some(up) })
    }

    /// Applies `f` to every socket (buffer sizes, non-blocking).
    pub(crate) fn each(&self, mut f: impl FnMut(&UdpSocket) -> std::io::Result<()>) -> std::io::Result<()> {
        self.sockets.iter().try_for_each(&mut f)
    }

    /// Makes the sockets non-blocking, with [`SOCKET_BUFFER`] buffers (root may go beyond the system's maximum;
    /// others get what it allows) and UDP GRO where the kernel has it (`kind` names the carrier in the log).
    pub(crate) fn prepare(&self, kind: &str) -> Result<(), String> {
        self.each(|s| s.set_nonblocking(true)).map_err(|e| e.to_string())?;
        for socket in &self.sockets {
            let forced = setsockopt(socket, sockopt::RcvBufForce, &SOCKET_BUFFER)
                .and_then(|_| setsockopt(socket, sockopt::SndBufForce, &SOCKET_BUFFER));
            if forced.is_err() {
                let _ = setsockopt(socket, sockopt::RcvBuf, &SOCKET_BUFFER);
                let _ = setsockopt(socket, sockopt::SndBuf, &SOCKET_BUFFER);
            }
            if let Err(e) = batch::enable_gro(socket) {
                tracing::info!(error = %e, "{kind} carrier: no UDP GRO; receiving datagrams singly");
            }
        }
        Ok(())
    }

    /// Adds the sockets and the watch to the carrier's epoll set.
    pub(crate) fn watch_in(&self, epoll: &Epoll) {
        for (i, s) in self.sockets.iter().enumerate() {
            epoll
                .add(s.as_fd(), EpollEvent::new(EpollFlags::EPOLLIN, SOCKETS + i as u64))
                .expect("the carrier's sockets in its epoll set");
        }
        if let Some(u) = &self.uplinks {
            u.watch_in(epoll, WATCH);
        }
    }

    /// The socket to send from.
    pub(crate) fn socket(&self) -> &UdpSocket {
        &self.sockets[self.uplinks.as_ref().map_or(0, Uplinks::active)]
    }

    /// How many sockets there are, to read from each.
    pub(crate) fn len(&self) -> usize {
        self.sockets.len()
    }

    /// Socket `i`.
    pub(crate) fn get(&self, i: usize) -> &UdpSocket {
        &self.sockets[i]
    }

    /// The module's meters at the start.
    pub(crate) fn init_meters(&self, m: &Meters) {
        m.uplink_active.set(0);
        if let Some(u) = &self.uplinks {
            u.init_meters(m);
        }
    }

    /// A datagram came on socket `i` at `now`: the end of the latest move's gap if it is the first on the new uplink.
    pub(crate) fn received(&mut self, i: usize, now: Instant, m: &Meters) {
        if let Some(u) = &mut self.uplinks {
            u.received(i, now, m);
        }
    }

    /// See [`Uplinks::moved`]; false without uplinks.
    pub(crate) fn moved(&mut self, now: Instant, m: &Meters) -> bool {
        self.uplinks.as_mut().is_some_and(|u| u.moved(now, m))
    }
}

/// Whether each address is held by an interface that is up with carrier (IFF_UP and IFF_RUNNING).
fn usable(addrs: &[IpAddr]) -> Vec<bool> {
    let mut up = vec![false; addrs.len()];
    let Ok(list) = getifaddrs() else { return up };
    for ifa in list {
        let Some(ip) = ifa.address.as_ref().and_then(|a| {
            a.as_sockaddr_in().map(|s| IpAddr::V4(s.ip())).or_else(|| a.as_sockaddr_in6().map(|s| IpAddr::V6(s.ip())))
        }) else {
            continue;
        };
        let running = ifa.flags.contains(InterfaceFlags::IFF_UP | InterfaceFlags::IFF_RUNNING);
        for (i, a) in addrs.iter().enumerate() {
            if *a == ip && running {
                up[i] = true;
            }
        }
    }
    up
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_usable_and_an_address_nobody_holds_is_not() {
        let u = usable(&["127.0.0.1".parse().unwrap(), "192.0.2.77".parse().unwrap()]);
        assert_eq!(u, vec![true, false]);
    }

    #[test]
    fn uplinks_of_another_family_than_the_peer_are_refused() {
        let e = Sockets::connecting(&["::1".parse().unwrap()], "127.0.0.1:7300".parse().unwrap()).err();
        assert!(e.is_some_and(|e| e.contains("family")));
    }
}
