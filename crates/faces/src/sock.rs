//! Socket helpers the kernel back-end of the stream endpoints and the peer carriers share.

use nix::sys::socket::{bind, socket, AddressFamily, SockFlag, SockType, SockaddrStorage};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd};

/// The address of a socket address nix gives (IPv4 or IPv6).
pub(crate) fn socket_addr(a: &SockaddrStorage) -> Option<SocketAddr> {
    if let Some(v4) = a.as_sockaddr_in() {
        return Some(SocketAddr::V4((*v4).into()));
    }
    a.as_sockaddr_in6().map(|v6| SocketAddr::V6((*v6).into()))
}

/// A non-blocking socket of `ty` for `dst`'s family, bound to `source` (its family's address, port 0) if any.
pub(crate) fn socket_for(dst: SocketAddr, ty: SockType, source: Option<IpAddr>) -> std::io::Result<OwnedFd> {
    let family = if dst.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
    let fd = socket(family, ty, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)?;
    if let Some(ip) = source {
        bind(fd.as_raw_fd(), &SockaddrStorage::from(SocketAddr::new(ip, 0)))?;
    }
    Ok(fd)
}
