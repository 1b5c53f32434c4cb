//! What the devices behind faces share: a name, the direction of what is read, and the meters of their I/O.

use flexstack_core::{Direction, FaceDevice, Meter};
use std::sync::OnceLock;

/// Meters of a device's I/O, bound when the module is built and written only by the data-plane thread.
#[derive(Default)]
pub(crate) struct DeviceMeters {
    pub(crate) rx_packets: Meter,
    pub(crate) rx_bytes: Meter,
    pub(crate) rx_errors: Meter,
    pub(crate) tx_errors: Meter,
    pub(crate) handoff: Meter,
    pub(crate) drop_handoff: Meter,
    pub(crate) kernel_drops: Meter,
    pub(crate) rx_gso: Meter,
    pub(crate) tx_gso: Meter,
    pub(crate) tx_gso_cut: Meter,
}

/// What both kinds of device share: a name, the direction of what is read, and I/O counters.
pub(crate) struct DeviceCommon {
    pub(crate) name: String,
    pub(crate) direction: Direction,
    pub(crate) meters: OnceLock<DeviceMeters>,
}

impl DeviceCommon {
    pub(crate) fn new(name: &str, direction: Direction) -> DeviceCommon {
        DeviceCommon { name: name.to_string(), direction, meters: OnceLock::new() }
    }

    pub(crate) fn received(&self, n: usize) {
        if let Some(m) = self.meters.get() {
            m.rx_packets.add(1);
            m.rx_bytes.add(n as u64);
        }
    }

    /// Counts one on the meter `which` picks: a GSO super-packet read whole (`rx_gso`; it is also counted as one
    /// packet read), written whole (`tx_gso`), or cut because the device cannot take it whole (`tx_gso_cut`).
    pub(crate) fn count(&self, which: fn(&DeviceMeters) -> &Meter) {
        if let Some(m) = self.meters.get() {
            which(m).add(1);
        }
    }

    pub(crate) fn rx_error(&self) {
        if let Some(m) = self.meters.get() {
            m.rx_errors.add(1);
        }
    }

    pub(crate) fn handed_off(&self, sent: u64, dropped: u64) {
        if let Some(m) = self.meters.get() {
            m.handoff.add(sent);
            m.drop_handoff.add(dropped);
        }
    }

    /// Adds `n` packets the kernel dropped in the device's own queues.
    pub(crate) fn kernel_dropped(&self, n: u64) {
        if let Some(m) = self.meters.get() {
            m.kernel_drops.add(n);
        }
    }

    pub(crate) fn tx_error(&self) {
        if let Some(m) = self.meters.get() {
            m.tx_errors.add(1);
        }
    }
}

/// A device a face module stands for, with the parts the module itself needs.
pub(crate) trait Device: FaceDevice + Sized {
    fn common(&self) -> &DeviceCommon;

    /// Another queue of the same device, for another data-plane worker (a multi-queue TUN device's next queue, a
    /// packet socket in the first one's fanout group).
    fn another_queue(&self) -> std::io::Result<Self>;
}

/// Turns the result of a non-blocking read into `read_packet`'s answer, counting it.
pub(crate) fn finish_read(
    common: &DeviceCommon,
    buf: &mut Vec<u8>,
    result: std::io::Result<usize>,
) -> std::io::Result<bool> {
    finish_read_at(common, buf, 0, result)
}

/// [`finish_read`] for a frame of `n` bytes read into `buf` from offset `start` on.
pub(crate) fn finish_read_at(
    common: &DeviceCommon,
    buf: &mut Vec<u8>,
    start: usize,
    result: std::io::Result<usize>,
) -> std::io::Result<bool> {
    match result {
        Ok(n) => {
            buf.truncate(start + n);
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
