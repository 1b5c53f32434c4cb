//! The TUN device behind a `tun` face: raw IP packets, with virtio-net offloads where the kernel has them (GSO
//! packets read are cut into segments, packets written are coalesced into GSO writes; both by tun-rs).

use crate::device::{finish_read, Device, DeviceCommon};
use flexstack_core::{Direction, FaceDevice};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Mutex, MutexGuard};
use tun_rs::{GROTable, IDEAL_BATCH_SIZE, VIRTIO_NET_HDR_LEN};

/// Largest packet read from a TUN device.
const MAX_PACKET: usize = 65_535;

/// A TUN device (no packet information header), non-blocking, with or without offloads.
pub struct TunDevice {
    common: DeviceCommon,
    dev: tun_rs::SyncDevice,
    /// Present when the device uses virtio-net headers (offloads on).
    offload: Option<Offload>,
    mtu: u16,
    /// The kernel's drop counters of the device, read by its first queue only (they are the device's, not a
    /// queue's); `None` on the other queues.
    kernel: Option<Mutex<KernelDrops>>,
}

/// Where the device's drop counters are read: a netlink socket in the namespace the device is in now (an app's
/// device is moved into the app's namespace after it is created), and the total read last.
#[derive(Default)]
struct KernelDrops {
    netns: Option<(u64, crate::netconf::Rtnl)>,
    last: u64,
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
    /// Creates TUN device `name` with `mtu`, up, non-blocking, with offloads if `offload`; with `multi_queue`,
    /// as a multi-queue device (IFF_MULTI_QUEUE) whose further queues [`TunDevice::another_queue`] opens. Needs
    /// CAP_NET_ADMIN.
    pub fn create(
        name: &str,
        mtu: u16,
        direction: Direction,
        offload: bool,
        multi_queue: bool,
    ) -> std::io::Result<TunDevice> {
        // A longer kernel queue than the default 500 absorbs bursts while the data plane is busy elsewhere.
        let dev = tun_rs::DeviceBuilder::new()
            .name(name)
            .mtu(mtu)
            .tx_queue_len(4096)
            .offload(offload)
            .multi_queue(multi_queue)
            .build_sync()?;
        dev.set_nonblocking(true)?;
        dev.enabled(true)?;
        // tcp_gso() tells whether the device really uses virtio-net headers.
        let offload = (offload && dev.tcp_gso()).then(|| Offload::new(mtu));
        Ok(TunDevice {
            common: DeviceCommon::new(name, direction),
            dev,
            offload,
            mtu,
            kernel: Some(Mutex::new(KernelDrops::default())),
        })
    }

    /// Another queue of this multi-queue device (for another data-plane worker): a file descriptor of its own,
    /// with its own buffers and I/O meters. The kernel spreads the packets it sends to the device over the
    /// queues by flow; a packet written to any queue goes to the kernel.
    pub fn another_queue(&self) -> std::io::Result<TunDevice> {
        let dev = self.dev.try_clone()?;
        dev.set_nonblocking(true)?;
        let offload = self.offload.as_ref().map(|_| Offload::new(self.mtu));
        Ok(TunDevice {
            common: DeviceCommon::new(&self.common.name, self.common.direction),
            dev,
            offload,
            mtu: self.mtu,
            kernel: None,
        })
    }

    /// The device's dropped packets as the kernel counts them now, from the namespace it is in.
    fn read_kernel_drops(&self, k: &mut KernelDrops) -> Result<Option<u64>, String> {
        let ns = flexstack_sys::tun_netns(self.dev.as_fd()).map_err(|e| format!("cannot find its namespace: {e}"))?;
        let inode = nix::sys::stat::fstat(&ns).map_err(|e| e.to_string())?.st_ino;
        if k.netns.as_ref().is_none_or(|(i, _)| *i != inode) {
            let rtnl = crate::netconf::Rtnl::open_in(ns.as_fd()).map_err(|e| e.to_string())?;
            k.netns = Some((inode, rtnl));
        }
        let (_, rtnl) = k.netns.as_mut().expect("just set");
        rtnl.dropped(&self.common.name).map_err(|e| e.to_string())
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

    fn another_queue(&self) -> std::io::Result<TunDevice> {
        TunDevice::another_queue(self)
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

    fn count_handoff(&self, sent: u64, dropped: u64) {
        self.common.handed_off(sent, dropped);
    }

    fn refresh_kernel_drops(&self) {
        let Some(kernel) = &self.kernel else { return };
        let mut k = lock(kernel);
        match self.read_kernel_drops(&mut k) {
            Ok(Some(total)) => {
                self.common.kernel_dropped(total.saturating_sub(k.last));
                k.last = total;
            }
            Ok(None) => {}
            Err(e) => {
                k.netns = None;
                tracing::debug!(device = %self.common.name, error = %e, "cannot read the device's drops");
            }
        }
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
