//! The TUN device behind a `tun` face: raw IP packets, with virtio-net offloads where the kernel has them. A GSO
//! super-packet read stays whole (`MetaKey::GSO`) and one written goes to the kernel whole, with its virtio-net
//! header; ordinary packets written are coalesced per flow into GSO writes (tun-rs's GRO). A super-packet is cut
//! only where the device cannot take it (offloads off, UDP segmentation the kernel lacks, segments beyond the MTU).

use crate::device::{finish_read, finish_read_at, Device, DeviceCommon};
use flexstack_core::frame::{Gso, GsoKind, MetaKey, Metadata};
use flexstack_core::{Direction, FaceDevice, Packet};
use flexstack_wire::vnet::{gso_write_parts, VnetHeader, VNET_HDR_LEN};
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
    /// The kernel's drop counters of the device (the device's, not a queue's), shared by all its queues, so the
    /// worker that moved frames reads them even when another worker's queue is idle; the delta since the last read
    /// is counted once, on the queue that read it (the face's meters are the sum of its queues').
    kernel: Option<std::sync::Arc<Mutex<KernelDrops>>>,
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
    /// The kernel takes UDP segmentation offload (USO) on this device.
    udp_gso: bool,
}

/// For [`FaceDevice::read_packet`], which hands out one packet at a time: the segments of the last super-packet
/// read, `next..` still to be handed out.
#[derive(Default)]
struct RxState {
    segments: Vec<Vec<u8>>,
    next: usize,
}

/// Buffers for coalesced writes: each packet behind room for a virtio-net header, with capacity to grow into a
/// GSO packet; and for the segments of super-packets the device cannot take whole.
struct TxState {
    gro: GROTable,
    bufs: Vec<Vec<u8>>,
    segments: Vec<Vec<u8>>,
    /// The flow ids of a run of packets ([`distinct_flows`]).
    flows: Vec<u64>,
}

/// Whether every packet of a run has a flow id (`classify` before the face) and no two share one: then no two can
/// be coalesced (a coalesced packet's segments are of one 5-tuple, one flow), and the run is written packet by
/// packet without the coalescing's bookkeeping. Many flows sent in turn (a server's clients) make such runs; the
/// bookkeeping was about a twentieth of the daemon's time per packet with 100,000 (bench-flowscale).
fn distinct_flows(flows: &mut Vec<u64>, packets: &[&Packet]) -> bool {
    flows.clear();
    for p in packets {
        match p.meta().get(MetaKey::FLOW_ID) {
            Some(id) => flows.push(id),
            None => return false,
        }
    }
    flows.sort_unstable();
    flows.windows(2).all(|w| w[0] != w[1])
}

/// The virtio-net header of a packet written as it is (no offload asked for).
const PLAIN_VNET_HDR: [u8; VIRTIO_NET_HDR_LEN] = [0; VIRTIO_NET_HDR_LEN];

/// Capacity of a write buffer: the largest GSO packet with room for the headers the coalescing asks for.
const TX_BUF_CAPACITY: usize = MAX_PACKET + 2 * VIRTIO_NET_HDR_LEN;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Offload {
    fn new(udp_gso: bool) -> Offload {
        Offload {
            rx: Mutex::new(RxState::default()),
            tx: Mutex::new(TxState { gro: GROTable::new(), bufs: Vec::new(), segments: Vec::new(), flows: Vec::new() }),
            udp_gso,
        }
    }
}

/// The super-packet description of `p`, if it is one of more than one segment.
fn super_packet(p: &Packet) -> Option<Gso> {
    Gso::of(p.meta()).filter(|g| g.segments(p.len()) > 1)
}

/// Cuts `data` (described by `gso`) into `segments` (reused buffers, grown as needed); returns how many, 0 if the
/// bytes do not match the description.
fn cut(data: &[u8], gso: &Gso, segments: &mut Vec<Vec<u8>>) -> usize {
    if !gso.matches(data) {
        return 0;
    }
    let n = gso.segments(data.len());
    if segments.len() < n {
        segments.resize_with(n, Vec::new);
    }
    for (i, s) in segments[..n].iter_mut().enumerate() {
        gso.segment_into(data, i, s);
    }
    n
}

/// Has the kernel put each packet it sends to multi-queue device `dev` on the queue of the worker that owns the
/// packet's flow ([`steering_program`]; queue k is worker k's, opened in that order). Without it the kernel picks
/// a queue from its own flow hash and learns a flow's queue from the packets written to it, in a table of 4,096
/// flows that forgets a flow 3 s after its last packet: with thousands of new connections a second the table is
/// full, nothing is learnt, and half of all packets arrive at the wrong worker and are handed over. Where the
/// program cannot be loaded (no CAP_BPF) the kernel's choice stays, which is only slower.
fn steer_queues(dev: &tun_rs::SyncDevice, name: &str) {
    static PROGRAM: std::sync::OnceLock<Result<std::os::fd::OwnedFd, String>> = std::sync::OnceLock::new();
    let program = PROGRAM.get_or_init(|| {
        flexstack_sys::bpf_load_socket_filter(&steering_program()).map_err(|e| format!("cannot load it: {e}"))
    });
    let result = match program {
        Ok(p) => flexstack_sys::tun_set_steering_ebpf(dev.as_fd(), p.as_fd()).map_err(|e| e.to_string()),
        Err(e) => Err(e.clone()),
    };
    if let Err(e) = result {
        tracing::warn!(device = name, error = %e, "no flow steering program on the device's queues (frames are handed over instead)");
    }
}

/// The eBPF program (a socket filter, as TUNSETSTEERINGEBPF takes) that computes the daemon's flow hash of an IP
/// packet (`flexstack_daemon`'s `steer::flow_hash`, which its tests check against this program): the XOR of the
/// source and destination addresses' 32-bit words; for TCP, UDP, UDP-Lite, SCTP and DCCP packets that are not
/// fragments (and, in IPv6, follow the fixed header), XORed with source port ^ destination port and the protocol
/// << 16; then mixed (lowbias32). The kernel takes it modulo the queues, as the daemon takes the hash modulo the
/// workers. Anything else (not IP, too short) returns 0: worker 0.
pub fn steering_program() -> Vec<u64> {
    use bpf::*;
    let mut a = Asm::default();
    a.op(ALU64 | MOV | X, R6, R1, 0, 0); // r6 = skb (LD_ABS/LD_IND read through it)
    a.op(LD | ABS | B, 0, 0, 0, 0); // r0 = version << 4 | ihl
    a.op(ALU | RSH | K, R0, 0, 0, 4);
    a.jump(JEQ | K, R0, 4, "v4");
    a.jump(JEQ | K, R0, 6, "v6");
    a.op(ALU | MOV | K, R0, 0, 0, 0);
    a.op(JMP | EXIT, 0, 0, 0, 0);
    // IPv4: the addresses, then the ports unless a fragment.
    a.label("v4");
    a.addresses(12..20, 9, "v4frag");
    a.label("v4frag");
    a.op(LD | ABS | H, 0, 0, 0, 6);
    a.op(ALU | AND | K, R0, 0, 0, 0x3fff);
    a.jump(JNE | K, R0, 0, "mix");
    a.op(LD | ABS | B, 0, 0, 0, 0);
    a.op(ALU | AND | K, R0, 0, 0, 0x0f);
    a.op(ALU | LSH | K, R0, 0, 0, 2);
    a.op(ALU | MOV | X, R8, R0, 0, 0);
    a.op(LD | IND | W, 0, R8, 0, 0); // r0 = source port << 16 | destination port
    a.jump(JA, 0, 0, "fold");
    // IPv6: the addresses, then the ports when the transport header follows the fixed header.
    a.label("v6");
    a.addresses(8..40, 6, "v6ports");
    a.label("v6ports");
    a.op(LD | ABS | W, 0, 0, 0, 40);
    a.label("fold");
    a.op(ALU | MOV | X, R1, R0, 0, 0);
    a.op(ALU | RSH | K, R1, 0, 0, 16);
    a.op(ALU | XOR | X, R0, R1, 0, 0);
    a.op(ALU | AND | K, R0, 0, 0, 0xffff);
    a.op(ALU | XOR | X, R7, R0, 0, 0);
    a.op(ALU | LSH | K, R9, 0, 0, 16);
    a.op(ALU | XOR | X, R7, R9, 0, 0);
    // lowbias32: x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16.
    a.label("mix");
    for (shift, factor) in [(16, Some(0x7feb_352d_u32)), (15, Some(0x846c_a68b)), (16, None)] {
        a.op(ALU | MOV | X, R0, R7, 0, 0);
        a.op(ALU | RSH | K, R0, 0, 0, shift);
        a.op(ALU | XOR | X, R7, R0, 0, 0);
        if let Some(f) = factor {
            a.op(ALU | MUL | K, R7, 0, 0, f as i32);
        }
    }
    a.op(ALU | MOV | X, R0, R7, 0, 0);
    a.op(JMP | EXIT, 0, 0, 0, 0);
    a.finish()
}

/// Just enough of an eBPF assembler for [`steering_program`].
mod bpf {
    use std::collections::HashMap;

    pub const LD: u8 = 0x00;
    pub const ALU: u8 = 0x04;
    pub const JMP: u8 = 0x05;
    pub const ALU64: u8 = 0x07;
    pub const W: u8 = 0x00;
    pub const H: u8 = 0x08;
    pub const B: u8 = 0x10;
    pub const ABS: u8 = 0x20;
    pub const IND: u8 = 0x40;
    pub const MUL: u8 = 0x20;
    pub const AND: u8 = 0x50;
    pub const LSH: u8 = 0x60;
    pub const RSH: u8 = 0x70;
    pub const XOR: u8 = 0xa0;
    pub const MOV: u8 = 0xb0;
    pub const K: u8 = 0x00;
    pub const X: u8 = 0x08;
    pub const JA: u8 = 0x00;
    pub const JEQ: u8 = 0x10;
    pub const JNE: u8 = 0x50;
    pub const EXIT: u8 = 0x90;
    pub const R0: u8 = 0;
    pub const R1: u8 = 1;
    pub const R6: u8 = 6;
    pub const R7: u8 = 7;
    pub const R8: u8 = 8;
    pub const R9: u8 = 9;

    /// Instructions with jumps to labels, resolved by [`Asm::finish`].
    #[derive(Default)]
    pub struct Asm {
        insns: Vec<u64>,
        labels: HashMap<&'static str, usize>,
        jumps: Vec<(usize, &'static str)>,
    }

    impl Asm {
        pub fn op(&mut self, code: u8, dst: u8, src: u8, off: i16, imm: i32) {
            let word = u64::from(code)
                | u64::from(dst | (src << 4)) << 8
                | u64::from(off as u16) << 16
                | u64::from(imm as u32) << 32;
            self.insns.push(word);
        }

        /// A conditional jump (`JMP | JEQ | K`...) comparing `dst` with `imm`, or `JA`, to `label`.
        pub fn jump(&mut self, op: u8, dst: u8, imm: i32, label: &'static str) {
            self.jumps.push((self.insns.len(), label));
            self.op(JMP | op, dst, 0, 0, imm);
        }

        pub fn label(&mut self, name: &'static str) {
            self.labels.insert(name, self.insns.len());
        }

        /// r7 = the XOR of the packet's 32-bit words in `words` (the addresses), r9 = its byte at `proto`; then
        /// on to `ports` when that protocol carries ports, else to `mix` (the addresses alone).
        pub fn addresses(&mut self, words: std::ops::Range<i32>, proto: i32, ports: &'static str) {
            self.op(ALU | MOV | K, R7, 0, 0, 0);
            for at in words.step_by(4) {
                self.op(LD | ABS | W, 0, 0, 0, at);
                self.op(ALU | XOR | X, R7, R0, 0, 0);
            }
            self.op(LD | ABS | B, 0, 0, 0, proto);
            self.op(ALU | MOV | X, R9, R0, 0, 0);
            for proto in [6, 17, 33, 132, 136] {
                self.jump(JEQ | K, R9, proto, ports);
            }
            self.jump(JA, 0, 0, "mix");
        }

        pub fn finish(mut self) -> Vec<u64> {
            for (at, label) in std::mem::take(&mut self.jumps) {
                let to = self.labels[label];
                let off = (to as i64 - at as i64 - 1) as i16;
                self.insns[at] |= u64::from(off as u16) << 16;
            }
            self.insns
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
        if multi_queue {
            steer_queues(&dev, name);
        }
        dev.enabled(true)?;
        // tcp_gso() tells whether the device really uses virtio-net headers.
        let offload = (offload && dev.tcp_gso()).then(|| Offload::new(dev.udp_gso()));
        Ok(TunDevice {
            common: DeviceCommon::new(name, direction),
            dev,
            offload,
            mtu,
            kernel: Some(std::sync::Arc::new(Mutex::new(KernelDrops::default()))),
        })
    }

    /// Another queue of this multi-queue device (for another data-plane worker): a file descriptor of its own,
    /// with its own buffers and I/O meters. The kernel spreads the packets it sends to the device over the
    /// queues by flow; a packet written to any queue goes to the kernel.
    pub fn another_queue(&self) -> std::io::Result<TunDevice> {
        let dev = self.dev.try_clone()?;
        dev.set_nonblocking(true)?;
        let offload = self.offload.as_ref().map(|o| Offload::new(o.udp_gso));
        Ok(TunDevice {
            common: DeviceCommon::new(&self.common.name, self.common.direction),
            dev,
            offload,
            mtu: self.mtu,
            // The device's counters are shared by its queues: whichever worker moved frames reads them.
            kernel: self.kernel.clone(),
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

    /// Reads one packet with its virtio-net header: a super-packet stays whole, with `MetaKey::GSO` (its transport
    /// checksum field holds the pseudo-header sum, which whoever cuts or writes it replaces); a packet whose
    /// checksum the kernel left to offload gets it completed (modules see complete checksums on ordinary packets).
    fn read_vnet(&self, buf: &mut Vec<u8>, start: usize, meta: &mut Metadata) -> std::io::Result<bool> {
        let mut header = [0u8; VNET_HDR_LEN];
        loop {
            let read = flexstack_sys::read_with_header(self.dev.as_fd(), &mut header, buf, start, MAX_PACKET);
            match read {
                Ok(n) if n <= VNET_HDR_LEN => {
                    self.common.rx_error();
                    continue;
                }
                Ok(_) => {
                    let packet = &mut buf[start..];
                    let vnet = VnetHeader::decode(&header);
                    if vnet.gso_type != 0 {
                        match vnet.gso_at(packet, 0).filter(|g| g.segments(packet.len()) > 1) {
                            Some(gso) => {
                                meta.set(MetaKey::GSO, gso.pack());
                                self.common.count(|m| &m.rx_gso);
                            }
                            // One segment's worth: an ordinary packet (its checksum completed below).
                            None if vnet.gso_at(packet, 0).is_some() => {}
                            None => {
                                // A kind the device was not offered (it only takes TCP and UDP segmentation).
                                self.common.rx_error();
                                tracing::debug!(device = %self.common.name, gso_type = vnet.gso_type, "unknown GSO type");
                                continue;
                            }
                        }
                    }
                    if meta.get(MetaKey::GSO).is_none() {
                        if let Some(partial) = vnet.partial_checksum(packet.len()) {
                            flexstack_wire::checksum::complete_partial_bytes(packet, partial);
                        }
                    }
                    let n = packet.len();
                    return finish_read_at(&self.common, buf, start, Ok(n));
                }
                Err(e) => return finish_read_at(&self.common, buf, start, Err(e)),
            }
        }
    }

    /// Hands out the next segment of the last super-packet read, reading the device when none is left.
    fn read_segment(&self, off: &Offload, buf: &mut Vec<u8>) -> std::io::Result<bool> {
        let mut rx = lock(&off.rx);
        let RxState { segments, next } = &mut *rx;
        if let Some(s) = segments.get(*next) {
            *next += 1;
            buf.clear();
            buf.extend_from_slice(s);
            return Ok(true);
        }
        let mut meta = Metadata::default();
        if !self.read_vnet(buf, 0, &mut meta)? {
            return Ok(false);
        }
        let Some(gso) = Gso::of(&meta) else { return Ok(true) };
        let n = cut(buf, &gso, segments);
        segments.truncate(n);
        *next = 0;
        match segments.first() {
            Some(first) => {
                *next = 1;
                buf.clear();
                buf.extend_from_slice(first);
                Ok(true)
            }
            None => {
                self.common.rx_error();
                Ok(false)
            }
        }
    }

    /// Whether the device takes super-packet `gso` whole: its kind is offered, and each segment fits the MTU.
    fn takes_whole(&self, off: &Offload, gso: &Gso) -> bool {
        (gso.kind != GsoKind::UdpL4 || off.udp_gso)
            && gso.l3_offset == 0
            && usize::from(gso.hdr_len) + usize::from(gso.gso_size) <= usize::from(self.mtu)
    }

    /// Writes super-packet `data` whole: the virtio-net header, then the packet with the pseudo-header sum in its
    /// checksum field. False if it does not match its description (the caller cuts it).
    fn write_whole(&self, data: &[u8], gso: &Gso) -> Option<std::io::Result<()>> {
        let w = gso_write_parts(data, gso)?;
        let parts = [
            std::io::IoSlice::new(&w.header),
            std::io::IoSlice::new(&data[..w.field]),
            std::io::IoSlice::new(&w.field_value),
            std::io::IoSlice::new(&data[w.field + 2..]),
        ];
        let result = self.dev.send_vectored(&parts).map(|_| ()).inspect_err(|_| self.common.tx_error());
        if result.is_ok() {
            self.common.count(|m| &m.tx_gso);
        }
        Some(result)
    }

    /// Writes `packets`, coalescing segments of a flow into GSO packets.
    fn write_offloaded(&self, tx: &mut TxState, packets: &[&[u8]]) -> std::io::Result<()> {
        let TxState { gro, bufs, .. } = tx;
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

    /// Writes packets on a device with offloads: runs of ordinary packets coalesced ([`TunDevice::write_offloaded`]),
    /// super-packets whole where the device takes them, their segments otherwise; in order.
    fn write_frames_offloaded(&self, off: &Offload, packets: &[&Packet]) -> std::io::Result<()> {
        let mut tx = lock(&off.tx);
        let mut result = Ok(());
        let mut keep = |r: std::io::Result<()>| {
            if let Err(e) = r {
                result = Err(e);
            }
        };
        if distinct_flows(&mut tx.flows, packets) && packets.iter().all(|p| super_packet(p).is_none()) {
            for p in packets.iter().filter(|p| !p.is_empty()) {
                let parts = [std::io::IoSlice::new(&PLAIN_VNET_HDR), std::io::IoSlice::new(p.data())];
                keep(self.dev.send_vectored(&parts).map(|_| ()).inspect_err(|_| self.common.tx_error()));
            }
            return result;
        }
        let mut run: Vec<&[u8]> = Vec::new();
        for p in packets {
            let Some(gso) = super_packet(p) else {
                run.push(p.data());
                continue;
            };
            keep(self.write_offloaded(&mut tx, &run));
            run.clear();
            if self.takes_whole(off, &gso) {
                if let Some(r) = self.write_whole(p.data(), &gso) {
                    keep(r);
                    continue;
                }
            }
            let mut segments = std::mem::take(&mut tx.segments);
            let n = self.cut_for_device(p.data(), &gso, &mut segments);
            let refs: Vec<&[u8]> = segments[..n].iter().map(Vec::as_slice).collect();
            keep(self.write_offloaded(&mut tx, &refs));
            drop(refs);
            tx.segments = segments;
        }
        keep(self.write_offloaded(&mut tx, &run));
        result
    }

    /// Cuts a super-packet the device cannot take whole, counting it; one whose bytes do not match its description
    /// is written as it is (one long packet).
    fn cut_for_device(&self, data: &[u8], gso: &Gso, segments: &mut Vec<Vec<u8>>) -> usize {
        self.common.count(|m| &m.tx_gso_cut);
        match cut(data, gso, segments) {
            0 => {
                segments.resize_with(segments.len().max(1), Vec::new);
                segments[0].clear();
                segments[0].extend_from_slice(data);
                1
            }
            n => n,
        }
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
            return self.read_segment(off, buf);
        }
        // Into the buffer's spare capacity, not zeroed first (a pooled 64 KiB buffer would be, at every read).
        let result = flexstack_sys::read_with_header(self.dev.as_fd(), &mut [], buf, 0, MAX_PACKET);
        finish_read(&self.common, buf, result)
    }

    fn read_frame(&self, buf: &mut Vec<u8>, meta: &mut Metadata) -> std::io::Result<bool> {
        Ok(self.read_frame_at(buf, 0, meta)?.is_some())
    }

    fn read_frame_at(&self, buf: &mut Vec<u8>, headroom: usize, meta: &mut Metadata) -> std::io::Result<Option<usize>> {
        *meta = Metadata::default();
        match &self.offload {
            // Super-packets are read whole, with room in front (a link header put there moves nothing).
            Some(_) => Ok(self.read_vnet(buf, headroom, meta)?.then_some(headroom)),
            None => Ok(self.read_packet(buf)?.then_some(0)),
        }
    }

    fn write_packet(&self, packet: &[u8]) -> std::io::Result<()> {
        if let Some(off) = &self.offload {
            return self.write_offloaded(&mut lock(&off.tx), &[packet]);
        }
        self.dev.send(packet).map(|_| ()).inspect_err(|_| self.common.tx_error())
    }

    fn write_batch(&self, packets: &[&[u8]]) -> std::io::Result<()> {
        match &self.offload {
            Some(off) => self.write_offloaded(&mut lock(&off.tx), packets),
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

    fn write_frames(&self, packets: &[&Packet]) -> std::io::Result<()> {
        if let Some(off) = &self.offload {
            return self.write_frames_offloaded(off, packets);
        }
        // No offloads: super-packets are cut, each segment written as one packet.
        let mut result = Ok(());
        let mut segments = Vec::new();
        for p in packets {
            let written = match super_packet(p) {
                Some(gso) => {
                    let n = self.cut_for_device(p.data(), &gso, &mut segments);
                    let refs: Vec<&[u8]> = segments[..n].iter().map(Vec::as_slice).collect();
                    self.write_batch(&refs)
                }
                None => self.write_packet(p.data()),
            };
            if let Err(e) = written {
                result = Err(e);
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An IP super-packet: IPv4 (with 8 bytes of options) or IPv6, TCP with 12 bytes of options (ECN: CWR, and
    /// FIN|PSH) or UDP, `payload` bytes.
    fn super_packet(v6: bool, tcp: bool, payload: usize) -> (Vec<u8>, Gso) {
        let ip = if v6 { 40 } else { 28 };
        let transport = if tcp { 32 } else { 8 };
        let hdr = ip + transport;
        let mut d = vec![0u8; hdr + payload];
        if v6 {
            d[0] = 0x60;
            let len = (transport + payload) as u16;
            d[4..6].copy_from_slice(&len.to_be_bytes());
            d[6] = if tcp { 6 } else { 17 };
            d[8] = 0xfd;
            d[23] = 1;
            d[24] = 0xfd;
            d[39] = 2;
        } else {
            d[0] = 0x47;
            let len = d.len() as u16;
            d[2..4].copy_from_slice(&len.to_be_bytes());
            d[4..6].copy_from_slice(&0xfff0u16.to_be_bytes());
            d[9] = if tcp { 6 } else { 17 };
            d[12..16].copy_from_slice(&[10, 1, 0, 1]);
            d[16..20].copy_from_slice(&[10, 1, 0, 2]);
        }
        if tcp {
            d[ip + 4..ip + 8].copy_from_slice(&0xffff_ff00u32.to_be_bytes());
            d[ip + 12] = 8 << 4;
            d[ip + 13] = 0x80 | 0x10 | 0x08 | 0x01;
        }
        for (i, b) in d[hdr..].iter_mut().enumerate() {
            *b = (i * 31 + 7) as u8;
        }
        let kind = match (tcp, v6) {
            (true, false) => GsoKind::TcpV4,
            (true, true) => GsoKind::TcpV6,
            (false, _) => GsoKind::UdpL4,
        };
        (d, Gso { kind, gso_size: 1300, hdr_len: hdr as u16, csum_start: ip as u16, l3_offset: 0, ecn: tcp })
    }

    /// A run is written packet by packet only when every packet has a flow id and no two share one.
    #[test]
    fn only_runs_of_distinct_flows_skip_coalescing() {
        let pool = flexstack_core::PacketPool::default();
        let with = |id: Option<u64>| {
            let mut p = pool.alloc_from(&[0x45; 28]);
            if let Some(id) = id {
                p.meta_mut().set(MetaKey::FLOW_ID, id);
            }
            p
        };
        let mut flows = Vec::new();
        let check = |ids: &[Option<u64>], flows: &mut Vec<u64>| {
            let ps: Vec<Packet> = ids.iter().map(|&i| with(i)).collect();
            distinct_flows(flows, &ps.iter().collect::<Vec<_>>())
        };
        assert!(check(&[Some(3), Some(1), Some(2)], &mut flows));
        assert!(check(&[Some(7)], &mut flows));
        assert!(!check(&[Some(3), Some(1), Some(3)], &mut flows), "two of flow 3 may coalesce");
        assert!(!check(&[Some(1), None], &mut flows), "no flow id: unknown");
    }

    /// The switch's segmentation (flexstack_core) gives the bytes tun-rs's (wireguard-go's) gives, as the TUN face
    /// cut super-packets before.
    #[test]
    fn super_packets_are_cut_as_tun_rs_cuts_them() {
        for (v6, tcp) in [(false, true), (true, true), (false, false), (true, false)] {
            let (d, gso) = super_packet(v6, tcp, 5000);
            let mut ours = Vec::new();
            assert_eq!(cut(&d, &gso, &mut ours), 4, "v6 {v6} tcp {tcp}");
            let hdr = tun_rs::VirtioNetHdr {
                flags: 1,
                gso_type: gso.kind.virtio_type(),
                hdr_len: gso.hdr_len,
                gso_size: gso.gso_size,
                csum_start: gso.csum_start,
                csum_offset: gso.kind.csum_offset(),
            };
            let mut theirs = vec![vec![0u8; 1500]; 4];
            let mut sizes = vec![0; 4];
            let n = tun_rs::gso_split(&mut d.clone(), hdr, &mut theirs, &mut sizes, 0, v6).unwrap();
            assert_eq!(n, 4);
            for i in 0..4 {
                assert_eq!(ours[i], theirs[i][..sizes[i]], "v6 {v6} tcp {tcp} segment {i}");
            }
        }
    }
}
