//! Watches the kernel's link events, so that face modules and the modules behind them learn when an interface
//! loses its carrier or goes down (a Wi-Fi association lost, `flexstack lab link A B down`, `ip link set X down`).
//!
//! How the parts are called: the data plane opens one [`LinkWatch`] (a NETLINK_ROUTE socket joined to the link
//! group, in the daemon's network namespace), waits on [`LinkWatch::fd`] in its epoll, asks for the state of every
//! link with [`LinkWatch::request_dump`] whenever its set of faces changed, and calls [`LinkWatch::read`] when the
//! socket is readable. [`link_states`] is the sans-IO part: it turns the bytes of one netlink datagram into
//! `(ifindex, up)` pairs, where up means administratively up with carrier (IFF_UP and IFF_LOWER_UP). The data plane
//! compares them with what it last told ([`CarrierBook`]) and calls `Switch::face_link_changed` on a change.
//! A carrier with several uplinks opens its own with [`LinkWatch::joined`] (links and addresses) and only asks
//! [`LinkWatch::drain`] whether anything changed.
//!
//! The messages are parsed with `netlink-packet-route` (already in the build through tun-rs): the kernel's link
//! messages carry many attributes of varying layout, which that crate decodes and keeps up with.

use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_route::link::{LinkFlags, LinkMessage};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};

/// The rtnetlink multicast group of link changes (RTMGRP_LINK).
pub const RTMGRP_LINK: u32 = 1;
/// The groups of IPv4 and IPv6 address changes (RTMGRP_IPV4_IFADDR, RTMGRP_IPV6_IFADDR).
pub const RTMGRP_IFADDR: u32 = 0x10 | 0x100;

/// A NETLINK_ROUTE socket that receives every link change of the daemon's network namespace.
pub struct LinkWatch {
    socket: Socket,
    buf: Vec<u8>,
}

impl LinkWatch {
    /// Opens the socket, non-blocking, joined to the link group.
    pub fn open() -> io::Result<LinkWatch> {
        LinkWatch::joined(RTMGRP_LINK)
    }

    /// Opens the socket, non-blocking, joined to the rtnetlink multicast `groups`.
    pub fn joined(groups: u32) -> io::Result<LinkWatch> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind(&SocketAddr::new(0, groups))?;
        socket.set_non_blocking(true)?;
        Ok(LinkWatch { socket, buf: vec![0; 64 * 1024] })
    }

    /// The socket, for epoll.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }

    /// Asks the kernel for the state of every link; the answers arrive as link messages like the events.
    pub fn request_dump(&mut self) -> io::Result<()> {
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        let mut message =
            NetlinkMessage::new(header, NetlinkPayload::from(RouteNetlinkMessage::GetLink(LinkMessage::default())));
        message.finalize();
        let mut bytes = vec![0u8; message.buffer_len()];
        message.serialize(&mut bytes);
        self.socket.send(&bytes, 0)?;
        Ok(())
    }

    /// Reads every datagram waiting and appends the link states they carry to `into`. A datagram that does not
    /// parse is skipped and counted in the returned number. ENOBUFS (events were lost while the data plane was
    /// busy) is returned as an error: ask for a dump to learn the current state again.
    pub fn read(&mut self, into: &mut Vec<(u32, bool)>) -> io::Result<usize> {
        let mut malformed = 0;
        loop {
            match self.socket.recv(&mut &mut self.buf[..], 0) {
                Ok(n) => {
                    if link_states(&self.buf[..n], into).is_err() {
                        malformed += 1;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(malformed),
                Err(e) => return Err(e),
            }
        }
    }

    /// Reads every datagram waiting without parsing them: true when any came, or when events were lost (ENOBUFS or
    /// another error), so that the caller looks at the state again.
    pub fn drain(&mut self) -> bool {
        let mut any = false;
        loop {
            match self.socket.recv(&mut &mut self.buf[..], 0) {
                Ok(_) => any = true,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return any,
                Err(_) => return true,
            }
        }
    }
}

/// Appends the `(ifindex, up)` of every link message in one netlink datagram to `into` (up: IFF_UP and
/// IFF_LOWER_UP); other messages (done, errors, other families) are ignored. A message that does not parse stops
/// the datagram with an error; the states found before it are kept.
pub fn link_states(mut bytes: &[u8], into: &mut Vec<(u32, bool)>) -> Result<(), String> {
    while bytes.len() >= 16 {
        let message = NetlinkMessage::<RouteNetlinkMessage>::deserialize(bytes).map_err(|e| e.to_string())?;
        let len = message.header.length as usize;
        if let NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link)) = &message.payload {
            let flags = link.header.flags;
            into.push((link.header.index, flags.contains(LinkFlags::Up) && flags.contains(LinkFlags::LowerUp)));
        }
        // Messages are aligned to 4 bytes.
        let step = (len + 3) & !3;
        if len < 16 || step > bytes.len() {
            break;
        }
        bytes = &bytes[step..];
    }
    Ok(())
}

/// What the data plane last told about each watched link, by ifindex: it tells a change once, and a link first seen
/// down (faces start as up).
#[derive(Default, Debug)]
pub struct CarrierBook {
    told: HashMap<u32, bool>,
}

impl CarrierBook {
    /// Records the state `up` of link `ifindex`; true if it must be told (it differs from what was told, or it is
    /// the first state seen and it is down).
    pub fn update(&mut self, ifindex: u32, up: bool) -> bool {
        let previous = self.told.insert(ifindex, up);
        previous.unwrap_or(true) != up
    }

    /// Forgets the links that are not in `watched` (faces removed).
    pub fn retain(&mut self, watched: &[u32]) {
        self.told.retain(|k, _| watched.contains(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_core::{DoneMessage, NLM_F_MULTIPART};

    fn link_message(index: u32, flags: LinkFlags) -> Vec<u8> {
        let mut link = LinkMessage::default();
        link.header.index = index;
        link.header.flags = flags;
        let mut message =
            NetlinkMessage::new(NetlinkHeader::default(), NetlinkPayload::from(RouteNetlinkMessage::NewLink(link)));
        message.finalize();
        let mut bytes = vec![0u8; message.buffer_len()];
        message.serialize(&mut bytes);
        bytes
    }

    #[test]
    fn link_messages_give_up_only_with_both_up_and_carrier() {
        let mut datagram = link_message(3, LinkFlags::Up | LinkFlags::LowerUp | LinkFlags::Running);
        datagram.extend(link_message(4, LinkFlags::Up));
        datagram.extend(link_message(5, LinkFlags::LowerUp));
        let mut done = NetlinkMessage::<RouteNetlinkMessage>::new(
            NetlinkHeader::default(),
            NetlinkPayload::Done(DoneMessage::default()),
        );
        done.header.flags = NLM_F_MULTIPART;
        done.finalize();
        let mut bytes = vec![0u8; done.buffer_len()];
        done.serialize(&mut bytes);
        datagram.extend(bytes);
        let mut states = Vec::new();
        link_states(&datagram, &mut states).unwrap();
        assert_eq!(states, vec![(3, true), (4, false), (5, false)]);
    }

    #[test]
    fn a_malformed_datagram_is_an_error_and_keeps_what_came_before() {
        let mut datagram = link_message(7, LinkFlags::Up | LinkFlags::LowerUp);
        let mut bad = link_message(8, LinkFlags::Up);
        bad[0] = 0xff; // a length far beyond the datagram
        datagram.extend(bad);
        let mut states = Vec::new();
        assert!(link_states(&datagram, &mut states).is_err());
        assert_eq!(states, vec![(7, true)]);
        // Short garbage is ignored, not read past.
        assert!(link_states(&[1, 2, 3], &mut states).is_ok());
    }

    #[test]
    fn random_and_mutated_datagrams_never_panic_the_parser() {
        let mut rng = flexstack_fuzzkit::Rng::new(flexstack_fuzzkit::seed_from_env(0x11_4e));
        let valid = link_message(9, LinkFlags::Up | LinkFlags::LowerUp);
        let mut states = Vec::new();
        for _ in 0..flexstack_fuzzkit::iters_from_env(5_000) {
            let mut bytes = if rng.one_in(2) {
                let len = rng.below(300);
                rng.bytes(len)
            } else {
                valid.clone()
            };
            for _ in 0..rng.below(6) {
                if !bytes.is_empty() {
                    let at = rng.below(bytes.len());
                    bytes[at] = rng.next() as u8;
                }
            }
            let _ = link_states(&bytes, &mut states);
        }
    }

    #[test]
    fn the_book_tells_changes_and_a_first_down() {
        let mut book = CarrierBook::default();
        assert!(!book.update(3, true), "a first up is what faces start as");
        assert!(book.update(3, false));
        assert!(!book.update(3, false), "told once");
        assert!(book.update(3, true));
        assert!(book.update(4, false), "a first down is told");
        book.retain(&[3]);
        assert!(book.update(4, false), "forgotten, so told again");
    }
}
