//! Faces: module kinds that stand for real devices, and the devices behind them.
//!
//! A face module is sans-IO like any other: frames sent to its input port are queued for the device, and frames
//! read from the device leave on its output port. The device itself is opened when the module is configured — on
//! the control side, which holds the privileges — and the data-plane thread reads and writes it on the module's
//! behalf (see the daemon's data plane). Dropping the module drops the device.
//!
//! - Kind `tun`: a TUN device carrying raw IP packets (an app's virtual NIC, or the host face). Ports: input `in`,
//!   output `out` (ip). Settings: `name` (interface name, required), `mtu` (default 1500), `direction` of the
//!   frames read from it (`"down"`, the default, for an app's NIC whose packets go towards the network; `"up"` for a
//!   face on the network side, such as the host face), `queue`, `offload` (default true). With `offload`, the
//!   device uses virtio-net headers (IFF_VNET_HDR) with TCP (TSO, checksum) and, where the kernel has them, UDP
//!   (USO) offloads: the kernel hands over large GSO packets, which are cut here into segments of at most the MTU
//!   with complete checksums, so that modules see only ordinary packets; packets written to the device are
//!   coalesced per flow into GSO writes where possible (GRO), so that the kernel gets few large packets.
//! - Kind `packet`: a link face: an AF_PACKET socket on an existing interface that flexstack takes over, carrying
//!   Ethernet frames (put a `link` module behind it for ARP/NDP and addresses). Ports: input `in`, output `out`
//!   (ethernet). Settings: `interface` (required), `take_over` (default true: the kernel's addresses on the
//!   interface are flushed and kernel IPv6 is disabled on it, so that only flexstack answers ARP and neighbour
//!   discovery there; they are not restored), `queue`. Frames the kernel itself sends out on the interface are not
//!   read back; frames are sent past the interface's queueing discipline (PACKET_QDISC_BYPASS). The socket uses
//!   virtio-net headers (PACKET_VNET_HDR): a frame whose sender offloaded its transport checksum keeps it partial
//!   and carries `MetaKey::CSUM_PARTIAL` (see there for the rule modules follow: `link` completes it, so the IP
//!   modules behind it see complete checksums); writing a frame with the key hands it back with NEEDS_CSUM, so
//!   that neither side sums the frame (up to 64 KiB). A GSO super-frame (TCPv4, TCPv6, UDP_L4; e.g. up to 64 KiB of TCP
//!   from a veth peer) arrives whole, as one long packet whose segment size and header layout travel with it under
//!   `MetaKey::GSO` (see there for what modules may do with such a packet); writing a packet that carries the key
//!   hands it to the kernel as a GSO write (virtio-net header with NEEDS_CSUM and the pseudo-header sum in the
//!   checksum field), and the kernel, or the peer's offloads, cut it into segments. Super-frames of other kinds
//!   (e.g. UFO, SCTP) travel without the key, as one long packet. The interface's link is watched
//!   ([`crate::linkwatch`]): when it loses its carrier or goes down, and when it comes back, the meter `carrier`
//!   goes to 0 or 1, `carrier_changes_total` counts, and every module is told (`Module::link_changed` with the
//!   face's name; e.g. `late-binding` takes an interface down whose `face` setting names it).
//! - Both: `queue` is the most frames waiting for the device (default 4096; beyond, drop_queue_full). Meters:
//!   rx_packets_total, rx_bytes_total, rx_errors_total, tx_errors_total (counted as the data plane does the
//!   device's I/O), tx_packets_total, tx_bytes_total, drop_queue_full_total, device (the interface name), carrier
//!   (1 while up; for `tun`, always), carrier_changes_total.

use flexstack_core::config::{ConfigError, Settings, SettingsReader};
use flexstack_core::frame::{CsumPartial, Gso, GsoKind, MetaKey, Metadata};
use flexstack_core::module::port_type;
use flexstack_core::vars::ModuleVars;
use flexstack_core::{
    Batch, Direction, FaceDevice, Frame, Meter, Module, ModuleBuilder, ModuleInterface, ModuleKind, Output, Packet,
    PortSpec, ValueType, VarSpec,
};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use tun_rs::{GROTable, IDEAL_BATCH_SIZE, VIRTIO_NET_HDR_LEN};

/// Largest packet or frame read from a device.
const MAX_PACKET: usize = 65_535;

/// Meters of a device's I/O, bound when the module is built and written only by the data-plane thread.
struct DeviceMeters {
    rx_packets: Meter,
    rx_bytes: Meter,
    rx_errors: Meter,
    tx_errors: Meter,
}

/// What both kinds of device share: a name, the direction of what is read, and I/O counters.
struct DeviceCommon {
    name: String,
    direction: Direction,
    meters: OnceLock<DeviceMeters>,
}

impl DeviceCommon {
    fn new(name: &str, direction: Direction) -> DeviceCommon {
        DeviceCommon { name: name.to_string(), direction, meters: OnceLock::new() }
    }

    fn received(&self, n: usize) {
        if let Some(m) = self.meters.get() {
            m.rx_packets.add(1);
            m.rx_bytes.add(n as u64);
        }
    }

    fn rx_error(&self) {
        if let Some(m) = self.meters.get() {
            m.rx_errors.add(1);
        }
    }

    fn tx_error(&self) {
        if let Some(m) = self.meters.get() {
            m.tx_errors.add(1);
        }
    }
}

/// A device a face module stands for, with the parts the module itself needs.
trait Device: FaceDevice {
    fn common(&self) -> &DeviceCommon;
}

/// A TUN device (no packet information header), non-blocking, with or without offloads.
pub struct TunDevice {
    common: DeviceCommon,
    dev: tun_rs::SyncDevice,
    /// Present when the device uses virtio-net headers (offloads on).
    offload: Option<Offload>,
}

/// The buffers of a TUN device with offloads. Only the data-plane thread uses them; the mutexes (never
/// contended) give `FaceDevice`'s `&self` methods the mutable state.
struct Offload {
    rx: Mutex<RxState>,
    tx: Mutex<TxState>,
}

/// Segments of the last packet read (a GSO packet cut into segments, or one packet), handed out one by one.
struct RxState {
    /// One read from the device: virtio-net header and packet (up to 64 KiB).
    raw: Vec<u8>,
    /// Segment buffers: the first holds up to 64 KiB (a packet that came whole), the others the MTU.
    segments: Vec<Vec<u8>>,
    sizes: Vec<usize>,
    /// Segments `next..count` are still to be handed out.
    next: usize,
    count: usize,
}

/// Buffers for coalesced writes: each packet behind room for a virtio-net header, with capacity to grow into a
/// GSO packet.
struct TxState {
    gro: GROTable,
    bufs: Vec<Vec<u8>>,
}

/// Capacity of a write buffer: the largest GSO packet with room for the headers the coalescing asks for.
const TX_BUF_CAPACITY: usize = MAX_PACKET + 2 * VIRTIO_NET_HDR_LEN;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Offload {
    fn new(mtu: u16) -> Offload {
        let mtu = usize::from(mtu);
        // Enough segments for the largest GSO packet at the smallest payload a segment of this MTU can carry.
        let payload = mtu.saturating_sub(120).max(8);
        let n = (MAX_PACKET / payload + 2).max(IDEAL_BATCH_SIZE);
        let mut segments = vec![vec![0u8; mtu]; n];
        segments[0] = vec![0u8; MAX_PACKET];
        Offload {
            rx: Mutex::new(RxState {
                raw: vec![0u8; VIRTIO_NET_HDR_LEN + MAX_PACKET],
                segments,
                sizes: vec![0; n],
                next: 0,
                count: 0,
            }),
            tx: Mutex::new(TxState { gro: GROTable::new(), bufs: Vec::new() }),
        }
    }
}

impl TunDevice {
    /// Creates TUN device `name` with `mtu`, up, non-blocking, with offloads if `offload`. Needs CAP_NET_ADMIN.
    pub fn create(name: &str, mtu: u16, direction: Direction, offload: bool) -> std::io::Result<TunDevice> {
        // A longer kernel queue than the default 500 absorbs bursts while the data plane is busy elsewhere.
        let dev = tun_rs::DeviceBuilder::new().name(name).mtu(mtu).tx_queue_len(4096).offload(offload).build_sync()?;
        dev.set_nonblocking(true)?;
        dev.enabled(true)?;
        // tcp_gso() tells whether the device really uses virtio-net headers.
        let offload = (offload && dev.tcp_gso()).then(|| Offload::new(mtu));
        Ok(TunDevice { common: DeviceCommon::new(name, direction), dev, offload })
    }

    /// Hands out the next segment, reading the device when none is left.
    fn read_offloaded(&self, off: &Offload, buf: &mut Vec<u8>) -> std::io::Result<bool> {
        let mut rx = lock(&off.rx);
        let RxState { raw, segments, sizes, next, count } = &mut *rx;
        loop {
            if *next < *count {
                let segment = &segments[*next][..sizes[*next]];
                *next += 1;
                buf.clear();
                buf.extend_from_slice(segment);
                self.common.received(buf.len());
                return Ok(true);
            }
            *next = 0;
            *count = 0;
            match self.dev.recv_multiple(raw, segments, sizes, 0) {
                Ok(n) => *count = n,
                Err(e) => return finish_read(&self.common, buf, Err(e)),
            }
        }
    }

    /// Writes `packets`, coalescing segments of a flow into GSO packets.
    fn write_offloaded(&self, off: &Offload, packets: &[&[u8]]) -> std::io::Result<()> {
        let mut tx = lock(&off.tx);
        let TxState { gro, bufs } = &mut *tx;
        let mut result = Ok(());
        for chunk in packets.chunks(IDEAL_BATCH_SIZE) {
            let mut n = 0;
            for p in chunk.iter().filter(|p| !p.is_empty()) {
                if bufs.len() == n {
                    bufs.push(Vec::with_capacity(TX_BUF_CAPACITY));
                }
                let b = &mut bufs[n];
                b.clear();
                b.resize(VIRTIO_NET_HDR_LEN, 0);
                b.extend_from_slice(p);
                n += 1;
            }
            if let Err(e) = self.dev.send_multiple(gro, &mut bufs[..n], VIRTIO_NET_HDR_LEN) {
                self.common.tx_error();
                result = Err(e);
            }
        }
        result
    }
}

impl Device for TunDevice {
    fn common(&self) -> &DeviceCommon {
        &self.common
    }
}

impl FaceDevice for TunDevice {
    fn name(&self) -> &str {
        &self.common.name
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.dev.as_fd()
    }

    fn direction(&self) -> Direction {
        self.common.direction
    }

    fn read_packet(&self, buf: &mut Vec<u8>) -> std::io::Result<bool> {
        if let Some(off) = &self.offload {
            return self.read_offloaded(off, buf);
        }
        buf.clear();
        buf.resize(MAX_PACKET, 0);
        let result = self.dev.recv(buf);
        finish_read(&self.common, buf, result)
    }

    fn write_packet(&self, packet: &[u8]) -> std::io::Result<()> {
        if let Some(off) = &self.offload {
            return self.write_offloaded(off, &[packet]);
        }
        self.dev.send(packet).map(|_| ()).inspect_err(|_| self.common.tx_error())
    }

    fn write_batch(&self, packets: &[&[u8]]) -> std::io::Result<()> {
        match &self.offload {
            Some(off) => self.write_offloaded(off, packets),
            None => {
                let mut result = Ok(());
                for p in packets {
                    if let Err(e) = self.write_packet(p) {
                        result = Err(e);
                    }
                }
                result
            }
        }
    }
}

/// Turns the result of a non-blocking read into `read_packet`'s answer, counting it.
fn finish_read(common: &DeviceCommon, buf: &mut Vec<u8>, result: std::io::Result<usize>) -> std::io::Result<bool> {
    match result {
        Ok(n) => {
            buf.truncate(n);
            common.received(n);
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
            buf.clear();
            Ok(false)
        }
        Err(e) => {
            buf.clear();
            common.rx_error();
            Err(e)
        }
    }
}

/// An AF_PACKET socket bound to one interface, non-blocking: raw Ethernet frames.
pub struct PacketDevice {
    common: DeviceCommon,
    socket: OwnedFd,
    ifindex: u32,
}

impl PacketDevice {
    /// Opens a packet socket on `interface`. Needs CAP_NET_RAW.
    pub fn open(interface: &str) -> std::io::Result<PacketDevice> {
        use nix::sys::socket::{socket, AddressFamily, SockFlag, SockProtocol, SockType};
        let ifindex = nix::net::if_::if_nametoindex(interface)?;
        let socket = socket(
            AddressFamily::Packet,
            SockType::Raw,
            SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
            SockProtocol::EthAll,
        )?;
        // A burst of frames while the data plane is busy must not overflow the default ~200 KB buffer.
        let rcvbuf = 4 << 20;
        if nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::RcvBufForce, &rcvbuf).is_err() {
            nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::RcvBuf, &rcvbuf)?;
        }
        crate::sys::set_packet_vnet_hdr(socket.as_fd())?;
        crate::sys::bind_packet(socket.as_fd(), ifindex)?;
        crate::sys::set_qdisc_bypass(socket.as_fd())?;
        Ok(PacketDevice { common: DeviceCommon::new(interface, Direction::Up), socket, ifindex })
    }
}

impl Device for PacketDevice {
    fn common(&self) -> &DeviceCommon {
        &self.common
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

    fn read_packet(&self, buf: &mut Vec<u8>) -> std::io::Result<bool> {
        let mut meta = Metadata::default();
        self.read_frame(buf, &mut meta)
    }

    fn read_frame(&self, buf: &mut Vec<u8>, meta: &mut Metadata) -> std::io::Result<bool> {
        *meta = Metadata::default();
        let mut header = [0u8; VNET_HDR_LEN];
        loop {
            // The header and the frame are read into separate buffers: the frame is not moved afterwards. The
            // buffer is not zeroed first (crate::sys::recv_packet reads into its spare capacity).
            match crate::sys::recv_packet(self.socket.as_fd(), &mut header, buf, MAX_FRAME) {
                // Frames the kernel sends out on the interface are seen too: skip them.
                Ok(read) if read.pkttype == Some(libc::PACKET_OUTGOING) => continue,
                Ok(read) if read.bytes < VNET_HDR_LEN || read.truncated => {
                    self.common.rx_error();
                    continue;
                }
                Ok(_) => {
                    let vnet = VnetHeader::decode(&header);
                    // A checksum left to offload stays partial (MetaKey::CSUM_PARTIAL): summing up to 64 KiB here
                    // was the largest single cost of the emulated link, and a frame written back as it came
                    // never needs it (the kernel, or the peer's offloads, complete it).
                    if let Some(partial) = vnet.partial_checksum(buf.len()) {
                        meta.set(MetaKey::CSUM_PARTIAL, partial.pack());
                    }
                    if let Some(gso) = vnet.gso(buf) {
                        meta.set(MetaKey::GSO, gso.pack());
                    }
                    let n = buf.len();
                    return finish_read(&self.common, buf, Ok(n));
                }
                Err(e) => return finish_read(&self.common, buf, Err(e)),
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
                Some(w) => self.send(&[&w.header, &data[..w.field], &w.field_value, &data[w.field + 2..]]),
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
        sendmsg::<UnixAddr>(self.socket.as_raw_fd(), &iov, &[], MsgFlags::MSG_DONTWAIT, None)
            .map(|_| ())
            .map_err(std::io::Error::from)
            .inspect_err(|_| self.common.tx_error())
    }
}

/// Length of the `virtio_net_hdr` before each frame on a packet socket with PACKET_VNET_HDR.
const VNET_HDR_LEN: usize = 10;
/// `virtio_net_hdr` flag: the checksum at csum_start + csum_offset holds only the pseudo-header sum.
const VNET_F_NEEDS_CSUM: u8 = 1;
/// `virtio_net_hdr` gso_type bit: TCP with ECN (CWR kept on the first segment only).
const VNET_GSO_ECN: u8 = 0x80;
/// Largest frame read from a packet socket: the largest IP packet behind an Ethernet header with two VLAN tags.
const MAX_FRAME: usize = 65_535 + 14 + 8;

/// A `virtio_net_hdr` as read from a packet socket (little-endian fields, as PACKET_VNET_HDR uses them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct VnetHeader {
    flags: u8,
    gso_type: u8,
    gso_size: u16,
    csum_start: u16,
    csum_offset: u16,
}

impl VnetHeader {
    fn decode(b: &[u8; VNET_HDR_LEN]) -> VnetHeader {
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        // b[2..4] is hdr_len: on receive the kernel puts the length of the linear part there, not the headers'
        // length, so it is worked out from the frame instead (see `gso`).
        VnetHeader { flags: b[0], gso_type: b[1], gso_size: u16_at(4), csum_start: u16_at(6), csum_offset: u16_at(8) }
    }

    /// Where the transport checksum the frame's sender left to offload is (csum_start and csum_offset count from
    /// the frame's start); `None` when the checksum is complete, or the field lies beyond a frame of `len` bytes.
    fn partial_checksum(&self, len: usize) -> Option<CsumPartial> {
        let partial = CsumPartial { start: self.csum_start, offset: self.csum_offset };
        (self.flags & VNET_F_NEEDS_CSUM != 0 && partial.field() + 2 <= len).then_some(partial)
    }

    /// The GSO description of `frame` if the header says it is a super-frame of a kind flexstack carries
    /// (TCPv4, TCPv6, UDP_L4) and its headers are where the header says; `None` otherwise (the frame then travels
    /// as one long packet, as any other).
    fn gso(&self, frame: &[u8]) -> Option<Gso> {
        let kind = GsoKind::from_virtio_type(self.gso_type)?;
        if self.gso_size == 0 || self.flags & VNET_F_NEEDS_CSUM == 0 || self.csum_offset != kind.csum_offset() {
            return None;
        }
        let l3 = l3_offset(frame)?;
        let start = usize::from(self.csum_start);
        let transport = match kind {
            GsoKind::UdpL4 => 8,
            GsoKind::TcpV4 | GsoKind::TcpV6 => usize::from(*frame.get(start + 12)? >> 4) * 4,
        };
        let version = frame.get(l3)? >> 4;
        let ip_ok = match kind {
            GsoKind::TcpV4 => version == 4,
            GsoKind::TcpV6 => version == 6,
            GsoKind::UdpL4 => version == 4 || version == 6,
        };
        let hdr_len = start + transport;
        if !ip_ok || start < l3 + 20 || transport < 8 || hdr_len > frame.len() {
            return None;
        }
        Some(Gso {
            kind,
            gso_size: self.gso_size,
            hdr_len: hdr_len as u16,
            csum_start: self.csum_start,
            l3_offset: l3 as u8,
            ecn: self.gso_type & VNET_GSO_ECN != 0,
        })
    }
}

/// Where the IP header of an Ethernet frame starts (behind up to two VLAN tags); `None` if it is not IP.
fn l3_offset(frame: &[u8]) -> Option<usize> {
    let mut at = 12;
    loop {
        let ethertype = u16::from_be_bytes([*frame.get(at)?, *frame.get(at + 1)?]);
        match ethertype {
            0x8100 | 0x88a8 if at < 20 => at += 4,
            0x0800 | 0x86dd => return Some(at + 2),
            _ => return None,
        }
    }
}

/// How a GSO super-frame is written: the virtio_net_hdr to put before it, and the checksum field to replace.
#[derive(Debug, PartialEq, Eq)]
struct GsoWrite {
    header: [u8; VNET_HDR_LEN],
    /// Offset of the transport checksum field in the frame.
    field: usize,
    /// What the kernel expects in that field: the pseudo-header sum (addresses, protocol, the super-frame's whole
    /// transport length), folded and not complemented, as Linux's CHECKSUM_PARTIAL; the kernel's segmentation
    /// adjusts it per segment (tcp_gso_segment, __udp_gso_segment) and completes it.
    field_value: [u8; 2],
}

/// The parts of a GSO write of `frame` described by `gso`; `None` when the frame fits in one segment or does not
/// match the description (it is then written as an ordinary frame, its checksums complete).
fn gso_write_parts(frame: &[u8], gso: &Gso) -> Option<GsoWrite> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let (start, hdr_len, l3) = (usize::from(gso.csum_start), usize::from(gso.hdr_len), usize::from(gso.l3_offset));
    let field = start + usize::from(gso.kind.csum_offset());
    if frame.len() <= hdr_len + usize::from(gso.gso_size) || field + 2 > hdr_len || hdr_len > frame.len() {
        return None;
    }
    let ip = frame.get(l3..start)?;
    let (src, dst) = match ip.first()? >> 4 {
        4 if ip.len() >= 20 => (
            IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(&ip[12..16]).ok()?)),
            IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(&ip[16..20]).ok()?)),
        ),
        6 if ip.len() >= 40 => (
            IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).ok()?)),
            IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&ip[24..40]).ok()?)),
        ),
        _ => return None,
    };
    let sum = flexstack_wire::checksum::pseudo_header(src, dst, gso.kind.protocol(), (frame.len() - start) as u32);
    let field_value = (!flexstack_wire::checksum::finish(sum)).to_be_bytes();
    let mut header = [0u8; VNET_HDR_LEN];
    header[0] = VNET_F_NEEDS_CSUM;
    header[1] = gso.kind.virtio_type() | if gso.ecn { VNET_GSO_ECN } else { 0 };
    header[2..4].copy_from_slice(&gso.hdr_len.to_le_bytes());
    header[4..6].copy_from_slice(&gso.gso_size.to_le_bytes());
    header[6..8].copy_from_slice(&gso.csum_start.to_le_bytes());
    header[8..10].copy_from_slice(&gso.kind.csum_offset().to_le_bytes());
    Some(GsoWrite { header, field, field_value })
}

/// The virtio_net_hdr of a frame of `len` bytes written whole with its partial checksum `partial` (NEEDS_CSUM:
/// the kernel, or the receiver's offloads, complete it); `None` if the field lies beyond the frame (it is then
/// written as it is, with a zero header).
fn partial_write_header(len: usize, partial: CsumPartial) -> Option<[u8; VNET_HDR_LEN]> {
    if partial.field() + 2 > len {
        return None;
    }
    let mut header = [0u8; VNET_HDR_LEN];
    header[0] = VNET_F_NEEDS_CSUM;
    header[6..8].copy_from_slice(&partial.start.to_le_bytes());
    header[8..10].copy_from_slice(&partial.offset.to_le_bytes());
    Some(header)
}

/// Reads the setting both kinds share: the most frames waiting for the device.
fn queue_setting(r: &mut SettingsReader<'_>) -> Result<usize, ConfigError> {
    Ok(r.u64_in("queue", 4096, 1, 1 << 20)? as usize)
}

fn valid_ifname(name: &str) -> bool {
    !name.is_empty() && name.len() <= 15 && name.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
}

/// The `tun` module kind.
pub struct TunKind;

impl ModuleKind for TunKind {
    fn name(&self) -> &'static str {
        "tun"
    }

    fn summary(&self) -> &'static str {
        "a TUN device: raw IP packets to and from the kernel (an app's virtual NIC, or the host)"
    }

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader("tun");
        let name = r.string("name")?;
        let mtu = r.u64_in("mtu", 1500, 68, 65535)?;
        let queue = queue_setting(&mut r)?;
        let offload = r.bool("offload")?.unwrap_or(true);
        let direction = match r.string("direction")?.as_deref() {
            None | Some("down") => Direction::Down,
            Some("up") => Direction::Up,
            Some(other) => return Err(r.error("direction", format_args!("expected \"down\" or \"up\", got {other:?}"))),
        };
        let Some(name) = name else {
            return Err(r.error("name", "is required: the TUN interface's name, e.g. name = \"fs-app0\""));
        };
        if !valid_ifname(&name) {
            return Err(
                r.error("name", format_args!("{name:?} is not an interface name (1-15 letters, digits, '-', '_')"))
            );
        }
        let device = TunDevice::create(&name, mtu as u16, direction, offload)
            .map_err(|e| r.error("name", format_args!("cannot create TUN device {name}: {e} (needs CAP_NET_ADMIN)")))?;
        r.finish()?;
        Ok(Box::new(FaceBuilder { device: Arc::new(device), queue, ty: port_type::IP }))
    }
}

/// The `packet` module kind (a link face).
pub struct PacketKind;

impl ModuleKind for PacketKind {
    fn name(&self) -> &'static str {
        "packet"
    }

    fn summary(&self) -> &'static str {
        "a link face: Ethernet frames to and from an interface flexstack takes over (AF_PACKET)"
    }

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader("packet");
        let interface = r.string("interface")?;
        let take_over = r.bool("take_over")?.unwrap_or(true);
        let queue = queue_setting(&mut r)?;
        let Some(interface) = interface else {
            return Err(r.error("interface", "is required: the interface to take over, e.g. interface = \"eth1\""));
        };
        if !valid_ifname(&interface) {
            return Err(r.error("interface", format_args!("{interface:?} is not an interface name")));
        }
        if take_over {
            take_over_interface(&interface).map_err(|e| r.error("interface", e))?;
        }
        let device = PacketDevice::open(&interface)
            .map_err(|e| r.error("interface", format_args!("cannot open {interface}: {e} (needs CAP_NET_RAW)")))?;
        r.finish()?;
        Ok(Box::new(FaceBuilder { device: Arc::new(device), queue, ty: port_type::ETHERNET }))
    }
}

/// Removes the kernel's addresses from `interface`, disables kernel IPv6 there and brings it up, so that only
/// flexstack answers for addresses on that link.
fn take_over_interface(interface: &str) -> Result<(), String> {
    let run = |args: &[&str]| -> Result<(), String> {
        let out = std::process::Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("`ip {}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
        }
    };
    run(&["addr", "flush", "dev", interface])?;
    std::fs::write(format!("/proc/sys/net/ipv6/conf/{interface}/disable_ipv6"), "1")
        .map_err(|e| format!("cannot disable kernel IPv6 on {interface}: {e}"))?;
    run(&["link", "set", interface, "up"])
}

struct FaceBuilder<D: Device + 'static> {
    device: Arc<D>,
    queue: usize,
    ty: &'static str,
}

impl<D: Device + 'static> ModuleBuilder for FaceBuilder<D> {
    fn interface(&self) -> ModuleInterface {
        ModuleInterface {
            inputs: vec![PortSpec::new("in", self.ty)],
            outputs: vec![PortSpec::new("out", self.ty)],
            vars: vec![
                VarSpec::meter("tx_packets_total", ValueType::U64, "packets", "packets queued for the device"),
                VarSpec::meter("tx_bytes_total", ValueType::U64, "bytes", "bytes queued for the device"),
                VarSpec::meter(
                    "drop_queue_full_total",
                    ValueType::U64,
                    "packets",
                    "dropped: the device queue was full",
                ),
                VarSpec::meter("device", ValueType::Str, "", "the interface name"),
                VarSpec::meter("rx_packets_total", ValueType::U64, "packets", "packets read from the device"),
                VarSpec::meter("rx_bytes_total", ValueType::U64, "bytes", "bytes read from the device"),
                VarSpec::meter("rx_errors_total", ValueType::U64, "errors", "failed reads"),
                VarSpec::meter("tx_errors_total", ValueType::U64, "errors", "failed writes (the packet is lost)"),
                VarSpec::meter(
                    "carrier",
                    ValueType::U64,
                    "",
                    "1 while the interface is up with carrier, 0 while not (watched for link faces)",
                ),
                VarSpec::meter("carrier_changes_total", ValueType::U64, "changes", "carrier losses and returns seen"),
            ],
            // Its output comes from the device, not from its input: a cycle through a face cannot loop in a batch.
            breaks_cycles: true,
        }
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        let common = self.device.common();
        vars.meter("device").store(&flexstack_core::Value::Str(common.name.clone()));
        // Up until the data plane's link watcher says otherwise (it tells a link first seen down at once).
        vars.meter("carrier").set(1);
        let _ = common.meters.set(DeviceMeters {
            rx_packets: vars.meter("rx_packets_total"),
            rx_bytes: vars.meter("rx_bytes_total"),
            rx_errors: vars.meter("rx_errors_total"),
            tx_errors: vars.meter("tx_errors_total"),
        });
        Box::new(Face {
            device: self.device,
            queue: Vec::new(),
            limit: self.queue,
            tx_packets: vars.meter("tx_packets_total"),
            tx_bytes: vars.meter("tx_bytes_total"),
            drop_full: vars.meter("drop_queue_full_total"),
        })
    }
}

/// A running face module: queues frames for its device.
struct Face<D: Device + 'static> {
    device: Arc<D>,
    queue: Batch,
    limit: usize,
    tx_packets: Meter,
    tx_bytes: Meter,
    drop_full: Meter,
}

impl<D: Device + 'static> Module for Face<D> {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        for f in input.drain(..) {
            match f {
                Frame::Data(p) if self.queue.len() < self.limit => {
                    self.tx_packets.add(1);
                    self.tx_bytes.add(p.len() as u64);
                    self.queue.push(Frame::Data(p));
                }
                Frame::Data(p) => {
                    self.drop_full.add(1);
                    out.drop_frame(Frame::Data(p));
                }
                other => out.drop_frame(other),
            }
        }
    }

    fn device(&self) -> Option<Arc<dyn FaceDevice>> {
        Some(self.device.clone())
    }

    fn take_egress(&mut self, into: &mut Batch) {
        into.append(&mut self.queue);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flexstack_wire::checksum;

    /// An Ethernet frame with one VLAN tag, IPv6 and TCP (32-byte header: 12 bytes of options) carrying
    /// `payload` bytes, its TCP checksum complete.
    fn tcp6_vlan_frame(payload: usize) -> Vec<u8> {
        let mut f = vec![0u8; 18 + 40 + 32 + payload];
        f[12..14].copy_from_slice(&0x8100u16.to_be_bytes());
        f[16..18].copy_from_slice(&0x86ddu16.to_be_bytes());
        f[18] = 0x60;
        f[22..24].copy_from_slice(&((32 + payload) as u16).to_be_bytes());
        f[24] = 6;
        f[25] = 64;
        f[26..42].copy_from_slice(&"fd00::1".parse::<std::net::Ipv6Addr>().unwrap().octets());
        f[42..58].copy_from_slice(&"fd00::2".parse::<std::net::Ipv6Addr>().unwrap().octets());
        f[58 + 12] = 8 << 4;
        for (i, b) in f[90..].iter_mut().enumerate() {
            *b = (i * 7) as u8;
        }
        let (src, dst) = (ip6(&f[26..42]), ip6(&f[42..58]));
        let sum = checksum::pseudo_header(src, dst, 6, (f.len() - 58) as u32);
        let c = checksum::finish(checksum::sum(sum, &f[58..]));
        f[58 + 16..58 + 18].copy_from_slice(&c.to_be_bytes());
        f
    }

    fn ip6(b: &[u8]) -> std::net::IpAddr {
        std::net::IpAddr::from(<[u8; 16]>::try_from(b).unwrap())
    }

    fn vnet(flags: u8, gso_type: u8, gso_size: u16, csum_start: u16, csum_offset: u16) -> VnetHeader {
        VnetHeader { flags, gso_type, gso_size, csum_start, csum_offset }
    }

    #[test]
    fn a_gso_header_becomes_the_gso_key_with_the_header_length_taken_from_the_frame() {
        let f = tcp6_vlan_frame(5000);
        let h = vnet(VNET_F_NEEDS_CSUM, 4 | VNET_GSO_ECN, 1428, 58, 16);
        let g = h.gso(&f).expect("a TCPv6 super-frame");
        assert_eq!(
            g,
            Gso { kind: GsoKind::TcpV6, gso_size: 1428, hdr_len: 90, csum_start: 58, l3_offset: 18, ecn: true }
        );
        // Not carried: no GSO, UFO (3), a zero segment size, a checksum offset that is not TCP's, IPv4 claimed for
        // an IPv6 packet, no NEEDS_CSUM.
        assert_eq!(vnet(VNET_F_NEEDS_CSUM, 0, 1428, 58, 16).gso(&f), None);
        assert_eq!(vnet(VNET_F_NEEDS_CSUM, 3, 1428, 58, 6).gso(&f), None);
        assert_eq!(vnet(VNET_F_NEEDS_CSUM, 4, 0, 58, 16).gso(&f), None);
        assert_eq!(vnet(VNET_F_NEEDS_CSUM, 4, 1428, 58, 6).gso(&f), None);
        assert_eq!(vnet(VNET_F_NEEDS_CSUM, 1, 1428, 58, 16).gso(&f), None);
        assert_eq!(vnet(0, 4, 1428, 58, 16).gso(&f), None);
        // A transport header that runs past the frame.
        assert_eq!(vnet(VNET_F_NEEDS_CSUM, 4, 1428, 58, 16).gso(&f[..80]), None);
    }

    #[test]
    fn a_gso_write_puts_the_pseudo_header_sum_in_the_checksum_field() {
        // An odd length: the last byte counts as the high byte of a word.
        let f = tcp6_vlan_frame(5001);
        let complete = u16::from_be_bytes([f[74], f[75]]);
        let g = Gso { kind: GsoKind::TcpV6, gso_size: 1428, hdr_len: 90, csum_start: 58, l3_offset: 18, ecn: false };
        let w = gso_write_parts(&f, &g).expect("a GSO write");
        assert_eq!(w.field, 74);
        assert_eq!(w.header, [VNET_F_NEEDS_CSUM, 4, 90, 0, 0x94, 0x05, 58, 0, 16, 0]);
        // What the kernel does with it, and what the read path does with a NEEDS_CSUM frame: sum from csum_start
        // with the field in place gives back the complete checksum.
        let mut partial = f.clone();
        partial[74..76].copy_from_slice(&w.field_value);
        let pseudo = checksum::pseudo_header(ip6(&f[26..42]), ip6(&f[42..58]), 6, (f.len() - 58) as u32);
        assert_eq!(u16::from_be_bytes(w.field_value), !checksum::finish(pseudo));
        let read = vnet(VNET_F_NEEDS_CSUM, 4, 1428, 58, 16).partial_checksum(partial.len()).expect("partial");
        assert!(checksum::complete_partial_bytes(&mut partial, read));
        assert_eq!(u16::from_be_bytes([partial[74], partial[75]]), complete);
        assert_eq!(partial, f);

        // One segment's worth is written as an ordinary frame; so is a frame that does not match the key.
        assert_eq!(gso_write_parts(&tcp6_vlan_frame(1428), &g), None);
        assert_eq!(gso_write_parts(&f[..85], &g), None);
        let mut v4 = f.clone();
        v4[18] = 0x45;
        assert!(gso_write_parts(&v4, &g).is_some_and(|w| w.field_value != gso_write_parts(&f, &g).unwrap().field_value));
        v4[18] = 0x75;
        assert_eq!(gso_write_parts(&v4, &g), None);
    }

    #[test]
    fn a_partial_checksum_is_read_into_the_key_and_written_back_with_needs_csum() {
        let f = tcp6_vlan_frame(100);
        // Read: NEEDS_CSUM gives where the field is; no flag, or a field beyond the frame, gives none.
        let partial = vnet(VNET_F_NEEDS_CSUM, 0, 0, 58, 16).partial_checksum(f.len());
        assert_eq!(partial, Some(CsumPartial { start: 58, offset: 16 }));
        assert_eq!(vnet(0, 0, 0, 58, 16).partial_checksum(f.len()), None);
        assert_eq!(vnet(VNET_F_NEEDS_CSUM, 0, 0, 58, 16).partial_checksum(75), None);
        // Write: the same place in a NEEDS_CSUM header, no GSO.
        let header = partial_write_header(f.len(), partial.unwrap()).expect("a header");
        assert_eq!(header, [VNET_F_NEEDS_CSUM, 0, 0, 0, 0, 0, 58, 0, 16, 0]);
        assert_eq!(VnetHeader::decode(&header).partial_checksum(f.len()), partial, "read back the same");
        assert_eq!(partial_write_header(75, partial.unwrap()), None);
    }

    #[test]
    fn the_ip_header_is_found_behind_up_to_two_vlan_tags() {
        let mut f = vec![0u8; 40];
        f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        assert_eq!(l3_offset(&f), Some(14));
        f[12..14].copy_from_slice(&0x88a8u16.to_be_bytes());
        f[16..18].copy_from_slice(&0x8100u16.to_be_bytes());
        f[20..22].copy_from_slice(&0x86ddu16.to_be_bytes());
        assert_eq!(l3_offset(&f), Some(22));
        f[20..22].copy_from_slice(&0x0806u16.to_be_bytes());
        assert_eq!(l3_offset(&f), None, "ARP is not IP");
        assert_eq!(l3_offset(&f[..13]), None);
    }
}
