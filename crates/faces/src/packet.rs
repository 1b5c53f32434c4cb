//! The AF_PACKET socket behind a `packet` (link) face: Ethernet frames of an interface flexstack takes over, each
//! with a virtio-net header ([`flexstack_wire::vnet`]) that carries partial checksums and GSO super-frames.

use crate::device::{finish_read_at, Device, DeviceCommon};
use flexstack_core::frame::{CsumPartial, Gso, MetaKey, Metadata};
use flexstack_core::{Direction, FaceDevice, Packet};
use flexstack_wire::vnet::{gso_write_parts, partial_write_header, VnetHeader, VNET_HDR_LEN};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

/// Largest frame read from a packet socket: the largest IP packet behind an Ethernet header with two VLAN tags.
const MAX_FRAME: usize = 65_535 + 14 + 8;

/// An AF_PACKET socket bound to one interface, non-blocking: raw Ethernet frames.
pub struct PacketDevice {
    common: DeviceCommon,
    socket: ClosedAside,
    ifindex: u32,
    /// The hold on the interface when the face took it over: given back when the device goes (after the socket);
    /// shared by the sockets of a fanout group.
    _taken: Option<std::sync::Arc<crate::takeover::TakenOver>>,
    /// Whether the socket joined its interface's fanout group (when the first other queue was opened).
    fanout: std::sync::OnceLock<()>,
}

/// A packet socket that is closed on a thread of its own. The kernel waits for an RCU grace period in every
/// packet socket's release (~10 ms here), so a daemon with hundreds of link faces (a lab's wire) took seconds to
/// unload them or to exit, one after the other; closed on threads of their own they wait together. At exit, the
/// threads still closing finish in parallel too (each thread's pending release runs as it exits).
struct ClosedAside(Option<OwnedFd>);

impl AsFd for ClosedAside {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_ref().expect("open until dropped").as_fd()
    }
}

impl Drop for ClosedAside {
    fn drop(&mut self) {
        let Some(fd) = self.0.take() else { return };
        // When no thread can be made, the closure, and the socket with it, is dropped here.
        let _ = std::thread::Builder::new().name("fs-close".into()).stack_size(64 * 1024).spawn(move || drop(fd));
    }
}

impl PacketDevice {
    /// Opens a packet socket on `interface`. Needs CAP_NET_RAW.
    pub fn open(interface: &str) -> std::io::Result<PacketDevice> {
        use nix::sys::socket::{socket, AddressFamily, SockFlag, SockProtocol, SockType};
        let ifindex = nix::net::if_::if_nametoindex(interface)?;
        // Protocol 0: no frames until the bind below, which then registers the socket's hook once. A socket made
        // with a protocol has a hook already, and binding it again waits for an RCU grace period (~10 ms): 5 s
        // for the 400 faces of a 200-host lab's wire.
        let socket = socket(
            AddressFamily::Packet,
            SockType::Raw,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            None::<SockProtocol>,
        )?;
        // A burst of frames while the data plane is busy must not overflow the default ~200 KB buffer.
        let rcvbuf = 4 << 20;
        if nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::RcvBufForce, &rcvbuf).is_err() {
            nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::RcvBuf, &rcvbuf)?;
        }
        flexstack_sys::set_packet_vnet_hdr(socket.as_fd())?;
        flexstack_sys::bind_packet(socket.as_fd(), ifindex)?;
        flexstack_sys::set_qdisc_bypass(socket.as_fd())?;
        Ok(PacketDevice {
            common: DeviceCommon::new(interface, Direction::Up),
            socket: ClosedAside(Some(socket)),
            ifindex,
            _taken: None,
            fanout: std::sync::OnceLock::new(),
        })
    }

    /// The fanout group of the interface's sockets: one per interface (and network namespace).
    fn fanout_group(&self) -> u16 {
        (self.ifindex & 0xffff) as u16
    }

    /// The device, holding `taken` (the interface taken over) for as long as it lives.
    pub fn holding(self, taken: Option<std::sync::Arc<crate::takeover::TakenOver>>) -> PacketDevice {
        PacketDevice { _taken: taken, ..self }
    }
}

impl Device for PacketDevice {
    fn common(&self) -> &DeviceCommon {
        &self.common
    }

    /// Another socket on the interface; both join the interface's fanout group (PACKET_FANOUT, by flow hash), so
    /// that each frame reaches one of them.
    fn another_queue(&self) -> std::io::Result<PacketDevice> {
        if self.fanout.get().is_none() {
            flexstack_sys::join_packet_fanout(self.socket.as_fd(), self.fanout_group())?;
            let _ = self.fanout.set(());
        }
        let other = PacketDevice::open(&self.common.name)?;
        flexstack_sys::join_packet_fanout(other.socket.as_fd(), self.fanout_group())?;
        let _ = other.fanout.set(());
        Ok(other.holding(self._taken.clone()))
    }
}

impl FaceDevice for PacketDevice {
    fn name(&self) -> &str {
        &self.common.name
    }

    fn ifindex(&self) -> Option<u32> {
        Some(self.ifindex)
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }

    fn direction(&self) -> Direction {
        self.common.direction
    }

    fn count_handoff(&self, sent: u64, dropped: u64) {
        self.common.handed_off(sent, dropped);
    }

    fn refresh_kernel_drops(&self) {
        // Each socket of a fanout group has its own queue and counters: the workers' meters add up.
        match flexstack_sys::packet_drops(self.socket.as_fd()) {
            Ok(n) => self.common.kernel_dropped(u64::from(n)),
            Err(e) => tracing::debug!(device = %self.common.name, error = %e, "cannot read the socket's drops"),
        }
    }

    fn ethernet(&self) -> bool {
        true
    }

    fn read_packet(&self, buf: &mut Vec<u8>) -> std::io::Result<bool> {
        let mut meta = Metadata::default();
        self.read_frame(buf, &mut meta)
    }

    fn read_frame(&self, buf: &mut Vec<u8>, meta: &mut Metadata) -> std::io::Result<bool> {
        Ok(self.read_frame_at(buf, 0, meta)?.is_some())
    }

    fn read_frame_at(&self, buf: &mut Vec<u8>, headroom: usize, meta: &mut Metadata) -> std::io::Result<Option<usize>> {
        *meta = Metadata::default();
        let mut header = [0u8; VNET_HDR_LEN];
        loop {
            // The header and the frame are read into separate buffers: the frame is not moved afterwards. The
            // buffer is not zeroed first (flexstack_sys::recv_packet reads into its spare capacity).
            match flexstack_sys::recv_packet(self.socket.as_fd(), &mut header, buf, headroom, MAX_FRAME) {
                // Frames the kernel sends out on the interface are seen too: skip them.
                Ok(read) if read.pkttype == Some(libc::PACKET_OUTGOING) => continue,
                Ok(read) if read.bytes < VNET_HDR_LEN || read.truncated => {
                    self.common.rx_error();
                    continue;
                }
                Ok(_) => {
                    let frame = &buf[headroom..];
                    let vnet = VnetHeader::decode(&header);
                    // A checksum left to offload stays partial (MetaKey::CSUM_PARTIAL): summing up to 64 KiB here
                    // was the largest single cost of the emulated link, and a frame written back as it came
                    // never needs it (the kernel, or the peer's offloads, complete it).
                    if let Some(partial) = vnet.partial_checksum(frame.len()) {
                        meta.set(MetaKey::CSUM_PARTIAL, partial.pack());
                    }
                    if let Some(gso) = vnet.gso(frame) {
                        meta.set(MetaKey::GSO, gso.pack());
                        if gso.segments(frame.len()) > 1 {
                            self.common.count(|m| &m.rx_gso);
                        }
                    }
                    let n = frame.len();
                    return Ok(finish_read_at(&self.common, buf, headroom, Ok(n))?.then_some(headroom));
                }
                Err(e) => return Ok(finish_read_at(&self.common, buf, headroom, Err(e))?.then_some(headroom)),
            }
        }
    }

    fn write_packet(&self, packet: &[u8]) -> std::io::Result<()> {
        // A zero virtio_net_hdr: a whole frame, its checksums complete.
        self.send(&[&[0u8; VNET_HDR_LEN], packet])
    }

    fn write_frames(&self, packets: &[&Packet]) -> std::io::Result<()> {
        let mut result = Ok(());
        for p in packets {
            let data = p.data();
            let sent = match Gso::of(p.meta()).and_then(|g| gso_write_parts(data, &g)) {
                Some(w) => self
                    .send(&[&w.header, &data[..w.field], &w.field_value, &data[w.field + 2..]])
                    .inspect(|_| self.common.count(|m| &m.tx_gso)),
                None => match CsumPartial::of(p.meta()).and_then(|c| partial_write_header(data.len(), c)) {
                    Some(header) => self.send(&[&header, data]),
                    None => self.write_packet(data),
                },
            };
            if let Err(e) = sent {
                result = Err(e);
            }
        }
        result
    }
}

impl PacketDevice {
    /// Sends one frame gathered from `parts` (the virtio_net_hdr first).
    fn send(&self, parts: &[&[u8]]) -> std::io::Result<()> {
        use nix::sys::socket::{sendmsg, MsgFlags, UnixAddr};
        let iov: Vec<std::io::IoSlice<'_>> = parts.iter().map(|p| std::io::IoSlice::new(p)).collect();
        sendmsg::<UnixAddr>(self.socket.as_fd().as_raw_fd(), &iov, &[], MsgFlags::MSG_DONTWAIT, None)
            .map(|_| ())
            .map_err(std::io::Error::from)
            .inspect_err(|_| self.common.tx_error())
    }
}
