//! Faces: module kinds that stand for real devices, and the devices behind them.
//!
//! A face module is sans-IO like any other: frames sent to its input port are queued for the device, and frames
//! read from the device leave on its output port. The device itself is opened when the module is configured — on
//! the control side, which holds the privileges — and the data-plane thread reads and writes it on the module's
//! behalf (see [`crate::dataplane`]). Dropping the module drops the device.
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
//!   virtio-net headers (PACKET_VNET_HDR): a frame whose sender offloaded its transport checksum has it completed
//!   here, so that modules see valid packets; large segments (GSO) arrive whole, as one long IP packet.
//! - Both: `queue` is the most frames waiting for the device (default 4096; beyond, drop_queue_full). Meters:
//!   rx_packets_total, rx_bytes_total, rx_errors_total, tx_errors_total (counted as the data plane does the
//!   device's I/O), tx_packets_total, tx_bytes_total, drop_queue_full_total, device (the interface name).

use flexstack_core::config::{ConfigError, Settings, SettingsReader};
use flexstack_core::module::port_type;
use flexstack_core::vars::ModuleVars;
use flexstack_core::{
    Batch, Direction, FaceDevice, Frame, Meter, Module, ModuleBuilder, ModuleInterface, ModuleKind, Output, PortSpec,
    ValueType, VarSpec,
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
        Ok(PacketDevice { common: DeviceCommon::new(interface, Direction::Up), socket })
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

    fn fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }

    fn direction(&self) -> Direction {
        self.common.direction
    }

    fn read_packet(&self, buf: &mut Vec<u8>) -> std::io::Result<bool> {
        use nix::sys::socket::{recvfrom, LinkAddr};
        loop {
            buf.clear();
            buf.resize(MAX_PACKET, 0);
            let result = recvfrom::<LinkAddr>(self.socket.as_raw_fd(), buf);
            match result {
                // Frames the kernel sends out on the interface are seen too: skip them.
                Ok((_, Some(addr))) if addr.pkttype() == libc::PACKET_OUTGOING => continue,
                Ok((n, _)) if n < VNET_HDR_LEN => {
                    self.common.rx_error();
                    continue;
                }
                Ok((n, _)) => {
                    buf.truncate(n);
                    complete_offloaded_checksum(buf);
                    buf.drain(..VNET_HDR_LEN);
                    let n = buf.len();
                    return finish_read(&self.common, buf, Ok(n));
                }
                Err(e) => return finish_read(&self.common, buf, Err(std::io::Error::from(e))),
            }
        }
    }

    fn write_packet(&self, packet: &[u8]) -> std::io::Result<()> {
        use nix::sys::socket::{sendmsg, MsgFlags, UnixAddr};
        // A zero virtio_net_hdr: a whole frame, its checksums complete.
        let header = [0u8; VNET_HDR_LEN];
        let iov = [std::io::IoSlice::new(&header), std::io::IoSlice::new(packet)];
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

/// Completes a transport checksum the frame's sender left to offload: `buf` is a `virtio_net_hdr` followed by
/// the frame; csum_start and csum_offset (from the header) are relative to the frame.
fn complete_offloaded_checksum(buf: &mut [u8]) {
    if buf[0] & VNET_F_NEEDS_CSUM == 0 {
        return;
    }
    let start = VNET_HDR_LEN + usize::from(u16::from_le_bytes([buf[6], buf[7]]));
    let field = start + usize::from(u16::from_le_bytes([buf[8], buf[9]]));
    if field + 2 > buf.len() || start > field {
        return;
    }
    // The field holds the pseudo-header sum: summing it with the rest gives the full checksum.
    let sum = flexstack_net::checksum::sum(0, &buf[start..]);
    let c = flexstack_net::checksum::finish(sum);
    buf[field..field + 2].copy_from_slice(&c.to_be_bytes());
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
            ],
            // Its output comes from the device, not from its input: a cycle through a face cannot loop in a batch.
            breaks_cycles: true,
        }
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        let common = self.device.common();
        vars.meter("device").store(&flexstack_core::Value::Str(common.name.clone()));
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
