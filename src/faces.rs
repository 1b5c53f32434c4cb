//! Faces: module kinds that stand for real devices, and the devices behind them.
//!
//! A face module is sans-IO like any other: frames sent to its input port are queued for the device, and frames
//! read from the device leave on its output port. The device itself (a [`TunDevice`] here) is opened when the
//! module is configured — on the control side, which holds the privileges — and the data-plane thread reads and
//! writes it on the module's behalf (see [`crate::dataplane`]). Dropping the module drops the device.
//!
//! Kind `tun`: a TUN device carrying raw IP packets. Ports: input `in` (to the device), output `out` (from it).
//! Settings: `name` (interface name, required), `mtu` (default 1500), `direction` (of the frames read from it:
//! `"down"`, the default, for an app's virtual NIC whose packets go towards the network; `"up"` for a face on the
//! network side, such as the host face), `queue` (most packets waiting for the
//! device, default 4096; beyond, drop_queue_full). Meters: rx_packets_total, rx_bytes_total, rx_errors_total,
//! tx_errors_total (counted as the data plane does the device's I/O), tx_packets_total, tx_bytes_total,
//! drop_queue_full_total, device (the interface name).

use flexstack_core::config::{ConfigError, Settings};
use flexstack_core::module::port_type;
use flexstack_core::vars::ModuleVars;
use flexstack_core::{
    Batch, Direction, FaceDevice, Frame, Meter, Module, ModuleBuilder, ModuleInterface, ModuleKind, Output, PortSpec,
    ValueType, VarSpec,
};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, OnceLock};

/// Largest packet read from a TUN device.
const MAX_PACKET: usize = 65_535;

/// A TUN device (no packet information header), non-blocking. Its I/O is counted in the owning module's
/// meters (written only by the data-plane thread).
pub struct TunDevice {
    name: String,
    direction: Direction,
    dev: tun_rs::SyncDevice,
    meters: OnceLock<DeviceMeters>,
}

/// Meters of a device's I/O, bound when the module is built.
struct DeviceMeters {
    rx_packets: Meter,
    rx_bytes: Meter,
    rx_errors: Meter,
    tx_errors: Meter,
}

impl TunDevice {
    /// Creates TUN device `name` with `mtu`, up, non-blocking. Needs CAP_NET_ADMIN.
    pub fn create(name: &str, mtu: u16, direction: Direction) -> std::io::Result<TunDevice> {
        // A longer kernel queue than the default 500 absorbs bursts while the data plane is busy elsewhere.
        let dev = tun_rs::DeviceBuilder::new().name(name).mtu(mtu).tx_queue_len(4096).build_sync()?;
        dev.set_nonblocking(true)?;
        dev.enabled(true)?;
        Ok(TunDevice { name: name.to_string(), direction, dev, meters: OnceLock::new() })
    }
}

impl FaceDevice for TunDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.dev.as_fd()
    }

    fn read_packet(&self, buf: &mut Vec<u8>) -> std::io::Result<bool> {
        buf.clear();
        buf.resize(MAX_PACKET, 0);
        match self.dev.recv(buf) {
            Ok(n) => {
                buf.truncate(n);
                if let Some(m) = self.meters.get() {
                    m.rx_packets.add(1);
                    m.rx_bytes.add(n as u64);
                }
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                buf.clear();
                Ok(false)
            }
            Err(e) => {
                buf.clear();
                if let Some(m) = self.meters.get() {
                    m.rx_errors.add(1);
                }
                Err(e)
            }
        }
    }

    fn direction(&self) -> Direction {
        self.direction
    }

    fn write_packet(&self, packet: &[u8]) -> std::io::Result<()> {
        self.dev.send(packet).map(|_| ()).inspect_err(|_| {
            if let Some(m) = self.meters.get() {
                m.tx_errors.add(1);
            }
        })
    }
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
        let mtu = r.u64("mtu")?.unwrap_or(1500);
        let queue = r.u64("queue")?.unwrap_or(4096);
        let direction = match r.string("direction")?.as_deref() {
            None | Some("down") => Direction::Down,
            Some("up") => Direction::Up,
            Some(other) => return Err(r.error("direction", format_args!("expected \"down\" or \"up\", got {other:?}"))),
        };
        let Some(name) = name else {
            return Err(r.error("name", "is required: the TUN interface's name, e.g. name = \"fs-app0\""));
        };
        if name.is_empty()
            || name.len() > 15
            || !name.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_')
        {
            return Err(
                r.error("name", format_args!("{name:?} is not an interface name (1-15 letters, digits, '-', '_')"))
            );
        }
        if !(68..=65535).contains(&mtu) {
            return Err(r.error("mtu", format_args!("must be within 68..=65535, got {mtu}")));
        }
        if !(1..=1 << 20).contains(&queue) {
            return Err(r.error("queue", format_args!("must be within 1..=1048576, got {queue}")));
        }
        r.finish()?;
        let device = TunDevice::create(&name, mtu as u16, direction).map_err(|e| {
            r_error(settings, "name", format!("cannot create TUN device {name}: {e} (needs CAP_NET_ADMIN)"))
        })?;
        Ok(Box::new(TunBuilder { device: Arc::new(device), queue: queue as usize }))
    }
}

fn r_error(settings: &Settings, key: &str, message: String) -> ConfigError {
    settings.reader("tun").error(key, message)
}

struct TunBuilder {
    device: Arc<TunDevice>,
    queue: usize,
}

impl ModuleBuilder for TunBuilder {
    fn interface(&self) -> ModuleInterface {
        ModuleInterface {
            inputs: vec![PortSpec::new("in", port_type::IP)],
            outputs: vec![PortSpec::new("out", port_type::IP)],
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
            breaks_cycles: true,
        }
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        vars.meter("device").store(&flexstack_core::Value::Str(self.device.name.clone()));
        let _ = self.device.meters.set(DeviceMeters {
            rx_packets: vars.meter("rx_packets_total"),
            rx_bytes: vars.meter("rx_bytes_total"),
            rx_errors: vars.meter("rx_errors_total"),
            tx_errors: vars.meter("tx_errors_total"),
        });
        Box::new(Tun {
            device: self.device,
            queue: Vec::new(),
            limit: self.queue,
            tx_packets: vars.meter("tx_packets_total"),
            tx_bytes: vars.meter("tx_bytes_total"),
            drop_full: vars.meter("drop_queue_full_total"),
        })
    }
}

struct Tun {
    device: Arc<TunDevice>,
    queue: Batch,
    limit: usize,
    tx_packets: Meter,
    tx_bytes: Meter,
    drop_full: Meter,
}

impl Module for Tun {
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
