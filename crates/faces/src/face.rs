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

use crate::device::{Device, DeviceMeters};
use crate::packet::{take_over_interface, PacketDevice};
use crate::tun::TunDevice;
use flexstack_core::config::{ConfigError, Settings, SettingsReader};
use flexstack_core::module::port_type;
use flexstack_core::vars::ModuleVars;
use flexstack_core::{
    Batch, Direction, FaceDevice, Frame, Meter, Module, ModuleBuilder, ModuleInterface, ModuleKind, Output, PortSpec,
    ValueType, VarSpec,
};
use std::sync::Arc;

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
