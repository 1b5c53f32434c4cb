//! Faces: module kinds that stand for real devices, and the devices behind them.
//!
//! A face module is sans-IO like any other: frames sent to its input port are queued for the device, and frames
//! read from the device leave on its output port. The device itself is opened when the module is configured — on
//! the control side, which holds the privileges — and the data-plane thread reads and writes it on the module's
//! behalf (see the daemon's data plane). Dropping the module drops the device.
//!
//! Both kinds' ports, settings and meters are declared once, in `TUN` and `PACKET` below; docs/modules.md lists
//! them. Frames beyond `queue` waiting for the device are dropped (`drop_queue_full_total`); the `rx_*` and
//! `tx_errors_total` meters are counted as the data plane does the device's I/O; `carrier` is 1 while the link is
//! up (for `tun`, always). What the kernel drops in the device's own queues before flexstack reads a packet (a
//! TUN queue full while the data plane is busy; a packet socket's receive queue overflowing) is read from the
//! kernel about once a second into `drop_kernel_queue_total`, so that such loss is never reported as 0.
//!
//! - Kind `tun`: a TUN device carrying raw IP packets (an app's virtual NIC, or the host face). `direction` is that
//!   of the frames read from it: `"down"` for an app's NIC, whose packets go towards the network; `"up"` for a face
//!   on the network side, such as the host face. With `offload`, the device uses virtio-net headers
//!   (IFF_VNET_HDR) with TCP (TSO, checksum) and, where the kernel has them, UDP (USO) offloads: the kernel hands
//!   over GSO super-packets (up to 64 KiB of one TCP or UDP flow), which stay whole, carrying `MetaKey::GSO` (the
//!   switch cuts them into segments only before a module that does not take them whole,
//!   `ModuleInterface::accepts_gso`); a super-packet written goes to the kernel whole with its virtio-net header,
//!   and is cut here only if the device cannot take it (offloads off, UDP segmentation the kernel lacks, segments
//!   beyond the MTU: `tx_gso_cut_total`). A packet whose checksum the kernel left to offload gets it completed on
//!   read. Ordinary packets written to the device are coalesced per flow into GSO writes where possible (GRO), so
//!   that the kernel gets few large packets. `rx_gso_total` and `tx_gso_total` count the super-packets read and
//!   written whole.
//! - Kind `packet`: a link face: an AF_PACKET socket on an existing interface that flexstack takes over, carrying
//!   Ethernet frames (put an `ethernet` module behind it for ARP/NDP and addresses). With `take_over`, the
//!   kernel's addresses on the interface are removed and kernel IPv6 is disabled on it, so that only flexstack
//!   answers ARP and neighbour discovery there, and the kernel's IPv4 forwarding is turned off for frames arriving
//!   there (the face's frames reach the kernel's IP layer too, which on a forwarding host routed each one out of
//!   its default route); all are given back when the face goes, or, after a crash, when
//!   the next daemon starts ([`crate::takeover`]). An interface that carries a default route of the daemon's
//!   network namespace is refused unless `force = true`. Frames the kernel itself sends out on the
//!   interface are not read back; frames are sent past the interface's queueing discipline (PACKET_QDISC_BYPASS).
//!   The socket uses virtio-net headers (PACKET_VNET_HDR): a frame whose sender offloaded its transport checksum keeps it partial
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

use crate::device::{Device, DeviceMeters};
use crate::packet::PacketDevice;
use crate::tun::TunDevice;
use flexstack_core::config::{ConfigError, Settings};
use flexstack_core::decl::{KindDecl, MeterDecl, Param, PortDecl};
use flexstack_core::module::port_type;
use flexstack_core::vars::ModuleVars;
use flexstack_core::{
    field, kind_from_decl, Batch, Direction, FaceDevice, Frame, Meter, Module, ModuleBuilder, ModuleInterface,
    ModuleKind, Output, Value, ValueType,
};
use std::sync::Arc;

fn valid_ifname(name: &str) -> bool {
    !name.is_empty() && name.len() <= 15 && name.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
}

/// The settings of a face besides the device's name (`Default` is a blank to read them into: the defaults are
/// declared in `TUN` and `PACKET`).
#[derive(Clone, Copy, Debug, Default)]
struct Config {
    queue: u64,
    mtu: u64,
    offload: bool,
    direction: Direction,
    take_over: bool,
    force: bool,
}

type P = Param<Config>;

/// The setting both kinds share: the most frames waiting for the device.
const QUEUE: P = P::u64("queue", "frames", "most frames waiting for the device; beyond, dropped", 4096, field!(queue))
    .range(1.0, (1u64 << 20) as f64)
    .setting();

/// The meters both kinds share.
const METERS: &[MeterDecl<Meters>] = &[
    MeterDecl::u64(
        "tx_packets_total",
        "packets",
        "packets queued for the device (a GSO super-packet counts once)",
        |m| &mut m.tx_packets,
    ),
    MeterDecl::u64("tx_bytes_total", "bytes", "bytes queued for the device", |m| &mut m.tx_bytes),
    MeterDecl::u64("drop_queue_full_total", "packets", "dropped: the device queue was full", |m| &mut m.drop_full),
    MeterDecl::new("device", ValueType::Str, "", "the interface name", |m| &mut m.device),
    MeterDecl::u64(
        "rx_packets_total",
        "packets",
        "packets read from the device (a GSO super-packet counts once)",
        |m| &mut m.io.rx_packets,
    ),
    MeterDecl::u64("rx_bytes_total", "bytes", "bytes read from the device", |m| &mut m.io.rx_bytes),
    MeterDecl::u64("rx_errors_total", "errors", "failed reads", |m| &mut m.io.rx_errors),
    MeterDecl::u64(
        "rx_gso_total",
        "packets",
        "GSO super-packets read whole (each also counts once in rx_packets_total, however many segments it holds)",
        |m| &mut m.io.rx_gso,
    ),
    MeterDecl::u64("tx_gso_total", "packets", "GSO super-packets written whole, for the kernel to cut", |m| {
        &mut m.io.tx_gso
    }),
    MeterDecl::u64(
        "tx_gso_cut_total",
        "packets",
        "GSO super-packets cut into segments here because the device cannot take them whole (offloads off, a \
         segmentation the kernel does not offer, segments beyond the MTU)",
        |m| &mut m.io.tx_gso_cut,
    ),
    MeterDecl::u64("tx_errors_total", "errors", "failed writes (the packet is lost)", |m| &mut m.io.tx_errors),
    MeterDecl::u64(
        "handoff_total",
        "packets",
        "packets read here whose flow another data-plane worker owns, handed to it",
        |m| &mut m.io.handoff,
    ),
    MeterDecl::u64(
        "drop_handoff_total",
        "packets",
        "dropped: packets for another data-plane worker whose ring was full",
        |m| &mut m.io.drop_handoff,
    ),
    MeterDecl::u64(
        "drop_kernel_queue_total",
        "packets",
        "dropped by the kernel in the device's own queues, read from the kernel about once a second: for tun, packets \
         it could not queue for flexstack or that failed on their way in (the device's tx_dropped + rx_dropped); \
         for packet, frames lost to a full socket receive queue (PACKET_STATISTICS)",
        |m| &mut m.io.kernel_drops,
    ),
    MeterDecl::u64(
        "carrier",
        "",
        "1 while the interface is up with carrier, 0 while not (watched for link faces)",
        |m: &mut Meters| &mut m.carrier,
    )
    .max_across_workers(),
    // Every worker's replica of the face sees the same link events: the count is one worker's, not their sum.
    MeterDecl::u64("carrier_changes_total", "changes", "carrier losses and returns seen", |m: &mut Meters| {
        &mut m.carrier_changes
    })
    .max_across_workers(),
];

/// The `tun` kind.
const TUN: KindDecl<Config, Meters> = KindDecl {
    inputs: &[PortDecl::new("in", port_type::IP, "IP packets to write to the device")],
    outputs: &[PortDecl::new("out", port_type::IP, "IP packets read from the device")],
    params: &[
        P::manual("name", "str", "the TUN interface's name (1-15 letters, digits, '-', '_')", "required"),
        P::u64("mtu", "bytes", "the device's MTU", 1500, field!(mtu)).range(68.0, 65535.0).setting(),
        QUEUE,
        P::bool(
            "offload",
            "virtio-net offloads: GSO super-packets read and written whole, other packets written coalesced",
            true,
            field!(offload),
        )
        .setting(),
        P::text(
            "direction",
            "down (an app's NIC) or up (a face on the network side): the direction of the packets read",
            "down",
            |c| if c.direction == Direction::Up { "up" } else { "down" }.into(),
            |c, t| {
                c.direction = match t {
                    "down" => Direction::Down,
                    "up" => Direction::Up,
                    other => return Err(format!("expected \"down\" or \"up\", got {other:?}")),
                };
                Ok(())
            },
        )
        .setting(),
    ],
    meters: METERS,
    // Its output comes from the device, not from its input: a cycle through a face cannot loop in a batch.
    breaks_cycles: true,
    // It writes super-packets whole, or cuts them itself where the device cannot take them.
    accepts_gso: true,
    ..KindDecl::new("tun", "a TUN device: raw IP packets to and from the kernel (an app's virtual NIC, or the host)")
};

/// The `packet` kind.
const PACKET: KindDecl<Config, Meters> = KindDecl {
    inputs: &[PortDecl::new("in", port_type::ETHERNET, "Ethernet frames to write to the interface")],
    outputs: &[PortDecl::new("out", port_type::ETHERNET, "Ethernet frames read from the interface")],
    params: &[
        P::manual("interface", "str", "the interface to take over", "required"),
        P::bool(
            "take_over",
            "remove the kernel's addresses from the interface and disable its IPv6 and IPv4 forwarding, given back when the \
             face goes",
            true,
            field!(take_over),
        )
        .setting(),
        P::bool(
            "force",
            "take over an interface that carries a default route of the daemon's network namespace (refused without)",
            false,
            field!(force),
        )
        .setting(),
        QUEUE,
    ],
    meters: METERS,
    breaks_cycles: true,
    accepts_gso: true,
    ..KindDecl::new("packet", "a link face: Ethernet frames to and from an interface flexstack takes over (AF_PACKET)")
};

/// The `tun` module kind.
pub struct TunKind;

impl ModuleKind for TunKind {
    kind_from_decl!(TUN);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(TUN.name);
        let name = r.string("name")?;
        let mut cfg = Config::default();
        TUN.read(&mut r, &mut cfg)?;
        let Some(name) = name else {
            return Err(r.error("name", "is required: the TUN interface's name, e.g. name = \"fs-app0\""));
        };
        if !valid_ifname(&name) {
            return Err(
                r.error("name", format_args!("{name:?} is not an interface name (1-15 letters, digits, '-', '_')"))
            );
        }
        let device = TunDevice::create(&name, cfg.mtu as u16, cfg.direction, cfg.offload, crate::workers() > 1)
            .map_err(|e| r.error("name", format_args!("cannot create TUN device {name}: {e} (needs CAP_NET_ADMIN)")))?;
        r.finish()?;
        Ok(Box::new(FaceBuilder { device: Arc::new(device), cfg, decl: &TUN }))
    }
}

/// The `packet` module kind (a link face).
pub struct PacketKind;

impl ModuleKind for PacketKind {
    kind_from_decl!(PACKET);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(PACKET.name);
        let interface = r.string("interface")?;
        let mut cfg = Config::default();
        PACKET.read(&mut r, &mut cfg)?;
        let Some(interface) = interface else {
            return Err(r.error("interface", "is required: the interface to take over, e.g. interface = \"eth1\""));
        };
        if !valid_ifname(&interface) {
            return Err(r.error("interface", format_args!("{interface:?} is not an interface name")));
        }
        // Unknown settings are refused before the interface is touched.
        r.finish()?;
        let at_interface = |message: String| {
            let location = settings.get("interface").and_then(|s| s.location.clone());
            ConfigError::new(location, format!("setting `interface` of a {} module: {message}", PACKET.name))
        };
        let taken = if cfg.take_over {
            Some(crate::takeover::take_over(&interface, cfg.force).map_err(at_interface)?)
        } else {
            None
        };
        let device = PacketDevice::open(&interface)
            .map_err(|e| at_interface(format!("cannot open {interface}: {e} (needs CAP_NET_RAW)")))?
            .holding(taken);
        Ok(Box::new(FaceBuilder { device: Arc::new(device), cfg, decl: &PACKET }))
    }
}

struct FaceBuilder<D: Device + 'static> {
    device: Arc<D>,
    cfg: Config,
    decl: &'static KindDecl<Config, Meters>,
}

/// A face's meters; those of the device's I/O go to the device.
#[derive(Default)]
struct Meters {
    tx_packets: Meter,
    tx_bytes: Meter,
    drop_full: Meter,
    device: Meter,
    io: DeviceMeters,
    carrier: Meter,
    carrier_changes: Meter,
}

impl<D: Device + 'static> ModuleBuilder for FaceBuilder<D> {
    fn interface(&self) -> ModuleInterface {
        self.decl.interface(&self.cfg)
    }

    /// The face on another worker: the same device's next queue.
    fn replica(&self, _worker: usize) -> Option<Result<Box<dyn ModuleBuilder>, String>> {
        let device = self.device.another_queue().map_err(|e| {
            format!("cannot open another queue of {} for a data-plane worker: {e}", self.device.common().name)
        });
        Some(device.map(|d| Box::new(FaceBuilder { device: Arc::new(d), cfg: self.cfg, decl: self.decl }) as _))
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        let common = self.device.common();
        let m = self.decl.meters(vars);
        m.device.store(&Value::Str(common.name.clone()));
        // Up until the data plane's link watcher says otherwise (it tells a link first seen down at once).
        m.carrier.set(1);
        let _ = common.meters.set(m.io);
        Box::new(Face {
            device: self.device,
            queue: Vec::new(),
            limit: self.cfg.queue as usize,
            tx_packets: m.tx_packets,
            tx_bytes: m.tx_bytes,
            drop_full: m.drop_full,
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
