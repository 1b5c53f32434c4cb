//! Frames: the units the switch moves between modules.
//!
//! A [`Frame`] is either a data frame ([`Packet`]: bytes + direction + small key-value [`Metadata`], as FINS's data
//! frames) or a [`ControlFrame`] (opcode + sender + destination + parameter, as FINS's control frames).
//!
//! Packets live in slots handed out by a [`PacketPool`]. A slot is reference counted: cloning a packet (the switch
//! does it to copy a frame to several receivers) shares the bytes, and [`Packet::make_mut`] copies them only when a
//! shared packet is written. When the last reference goes away, the slot, its allocation and its byte buffer return
//! to the pool, so a warmed-up data path allocates nothing per frame. Pools are single-threaded (`Rc`): each
//! data-plane worker owns one, and frames never cross threads.
//!
//! A packet's bytes need not start at the front of its buffer: the bytes before them are headroom, where
//! [`Packet::prepend`] puts a header (a link header) without moving the packet, and which
//! [`Packet::strip_front`] grows by taking a header away. The faces read into buffers
//! [`PacketPool::HEADROOM`] bytes in ([`crate::FaceDevice::read_frame_at`]), so that the packets they read can be
//! given a link header in place.

use crate::value::Value;
use std::cell::{Cell, RefCell};
use std::fmt;
use std::rc::{Rc, Weak};

/// Which way a data frame travels through the stack.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Direction {
    /// From the network towards the applications.
    #[default]
    Up,
    /// From the applications towards the network.
    Down,
}

/// A metadata key (FINS's metadata field): small integers, with well-known ones as constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MetaKey(pub u16);

impl MetaKey {
    /// Sequence number stamped by the test source.
    pub const SEQ: MetaKey = MetaKey(1);
    /// Flow identifier assigned by a classifier.
    pub const FLOW_ID: MetaKey = MetaKey(2);
    /// Index of the face the frame came in on.
    pub const IN_FACE: MetaKey = MetaKey(3);
    /// Index of the face the frame should leave on.
    pub const OUT_FACE: MetaKey = MetaKey(4);
    /// Traffic class (urgent, interactive, bulk ...).
    pub const CLASS: MetaKey = MetaKey(5);
    /// Receive timestamp in nanoseconds of the driver's clock.
    pub const RX_TIME: MetaKey = MetaKey(6);
    /// The packet is a GSO super-frame (several on-wire segments carried as one packet): a [`Gso`] packed with
    /// [`Gso::pack`]. Absent on ordinary packets.
    ///
    /// Super-packets reach only modules whose kind takes them whole ([`crate::ModuleInterface::accepts_gso`]); the
    /// switch cuts them into their segments before any other ([`crate::switch::segment_batch`]). The IP length
    /// fields of a super-packet (IPv4 total length, IPv6 payload length) count all of it; its transport checksum
    /// field means nothing (a TUN face leaves the pseudo-header sum there): whoever cuts it or writes it to a
    /// device computes the segments' checksums, or the pseudo-header sum the kernel expects, afresh.
    ///
    /// The rule for modules that take them: a module may parse it and rewrite addresses or ports and keep the key
    /// (no checksum needs updating for it); meters that count packets or bytes count its segments and their bytes
    /// on the wire ([`Packet::wire_packets`], [`Packet::wire_bytes`]), so that they read the same as if it had been
    /// cut first. A module that moves the IP header (adds or strips a link header) moves the key with it
    /// ([`Packet::move_gso`]); one that changes the packet's length or its header lengths, or needs the segments
    /// (per-packet drops, fragmentation), cuts it itself ([`crate::switch::segment_packet`]).
    pub const GSO: MetaKey = MetaKey(7);
    /// The packet's transport checksum is partial (Linux's CHECKSUM_PARTIAL, a virtio-net header's NEEDS_CSUM): a
    /// [`CsumPartial`] packed with [`CsumPartial::pack`]. The field at `start + offset` holds only the sum of the
    /// pseudo-header (folded, not complemented); the checksum over the bytes from `start` on is still to be added.
    /// Absent on packets whose checksums are complete.
    ///
    /// A `packet` face sets it on what it reads from a sender that left its checksum to offload (e.g. TCP from a
    /// veth peer), and writes such a packet back with NEEDS_CSUM, so that neither side sums up to 64 KiB per
    /// frame. It therefore appears only on Ethernet frames from a link face.
    ///
    /// The rule for modules: a module that only moves, queues, counts, delays, drops, copies or records frames
    /// keeps the key and the bytes as they are (a tap records the partial checksum, as a capture on the sending
    /// host shows it). A module that reads or verifies a transport checksum, rewrites addresses, ports or lengths,
    /// moves the IP header, quotes the packet, changes its bytes in a way the receiver should notice, or turns the
    /// frame into something else first completes the checksum and removes the key with
    /// `flexstack_wire::checksum::complete_partial` (a no-op on packets without the key). The `link` module does it
    /// for every frame it receives from the wire, so the IP modules behind it (ip, nat, firewall, icmp, classify,
    /// binding ...) never see partial checksums; the emulator's `corrupt` does it before flipping a bit, as netem
    /// does, so the receiver rejects the corrupted packet.
    pub const CSUM_PARTIAL: MetaKey = MetaKey(8);
    /// The frame is a stream frame (see [`crate::stream`]): the event's [`crate::stream::StreamKind`] in bits 0-7,
    /// and for an `Ack` the number of bytes acknowledged in bits 8-63. Its flow is under [`MetaKey::FLOW_ID`].
    pub const STREAM: MetaKey = MetaKey(9);
}

/// Where a partial transport checksum is, as carried under [`MetaKey::CSUM_PARTIAL`] (offsets count from the
/// packet's first byte, as [`Gso`]'s).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CsumPartial {
    /// Where the checksummed bytes start (the transport header).
    pub start: u16,
    /// Offset of the checksum field from `start` (TCP 16, UDP 6).
    pub offset: u16,
}

impl CsumPartial {
    /// The value stored under [`MetaKey::CSUM_PARTIAL`]: start in bits 0-15, offset in bits 16-31.
    pub fn pack(self) -> u64 {
        u64::from(self.start) | u64::from(self.offset) << 16
    }

    /// Reads a value packed by [`CsumPartial::pack`].
    pub fn unpack(v: u64) -> CsumPartial {
        CsumPartial { start: v as u16, offset: (v >> 16) as u16 }
    }

    /// The partial checksum description of `meta`, if it has one.
    pub fn of(meta: &Metadata) -> Option<CsumPartial> {
        meta.get(MetaKey::CSUM_PARTIAL).map(CsumPartial::unpack)
    }

    /// Where the checksum field is in the packet.
    pub fn field(self) -> usize {
        usize::from(self.start) + usize::from(self.offset)
    }
}

/// What a GSO super-frame is, as carried under [`MetaKey::GSO`]: the fields of a `virtio_net_hdr` a face needs to
/// hand the packet back to the kernel for segmentation, and that a module needs to tell its on-wire segments.
///
/// Offsets count from the packet's first byte (the Ethernet header on a link face, the IP header on a TUN face).
/// Each segment is the packet's first `hdr_len` bytes (IP and transport headers, adjusted) followed by up to
/// `gso_size` bytes of the payload that follows them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gso {
    /// Transport of the segments.
    pub kind: GsoKind,
    /// Most payload bytes per segment (the MSS for TCP).
    pub gso_size: u16,
    /// Bytes of headers (link, IP and transport) repeated in every segment.
    pub hdr_len: u16,
    /// Where the transport header starts.
    pub csum_start: u16,
    /// Where the IP header starts (0 for an IP packet, 14 behind Ethernet, 18 behind one VLAN tag).
    pub l3_offset: u8,
    /// TCP with ECN: the CWR flag stays on the first segment only (`VIRTIO_NET_HDR_GSO_ECN`).
    pub ecn: bool,
}

/// The transport of a GSO super-frame, as in `virtio_net_hdr.gso_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GsoKind {
    /// TCP over IPv4 (`VIRTIO_NET_HDR_GSO_TCPV4`).
    TcpV4,
    /// TCP over IPv6 (`VIRTIO_NET_HDR_GSO_TCPV6`).
    TcpV6,
    /// UDP over IPv4 or IPv6, segmentation offload (`VIRTIO_NET_HDR_GSO_UDP_L4`).
    UdpL4,
}

impl GsoKind {
    /// The `virtio_net_hdr.gso_type` value (without the ECN bit).
    pub fn virtio_type(self) -> u8 {
        match self {
            GsoKind::TcpV4 => 1,
            GsoKind::TcpV6 => 4,
            GsoKind::UdpL4 => 5,
        }
    }

    /// The kind for a `virtio_net_hdr.gso_type` value (the ECN bit ignored); `None` for none or unknown types.
    pub fn from_virtio_type(gso_type: u8) -> Option<GsoKind> {
        match gso_type & 0x7f {
            1 => Some(GsoKind::TcpV4),
            4 => Some(GsoKind::TcpV6),
            5 => Some(GsoKind::UdpL4),
            _ => None,
        }
    }

    /// Offset of the checksum field within the transport header (TCP 16, UDP 6).
    pub fn csum_offset(self) -> u16 {
        match self {
            GsoKind::TcpV4 | GsoKind::TcpV6 => 16,
            GsoKind::UdpL4 => 6,
        }
    }

    /// The IP protocol number of the transport.
    pub fn protocol(self) -> u8 {
        match self {
            GsoKind::TcpV4 | GsoKind::TcpV6 => 6,
            GsoKind::UdpL4 => 17,
        }
    }
}

impl Gso {
    /// The value stored under [`MetaKey::GSO`]: gso_size in bits 0-15, hdr_len 16-31, csum_start 32-47,
    /// l3_offset 48-55, the virtio gso_type 56-62 and ECN in bit 63.
    pub fn pack(self) -> u64 {
        u64::from(self.gso_size)
            | u64::from(self.hdr_len) << 16
            | u64::from(self.csum_start) << 32
            | u64::from(self.l3_offset) << 48
            | u64::from(self.kind.virtio_type()) << 56
            | u64::from(self.ecn) << 63
    }

    /// Reads a value packed by [`Gso::pack`]; `None` if its type is unknown.
    pub fn unpack(v: u64) -> Option<Gso> {
        Some(Gso {
            kind: GsoKind::from_virtio_type((v >> 56) as u8 & 0x7f)?,
            gso_size: v as u16,
            hdr_len: (v >> 16) as u16,
            csum_start: (v >> 32) as u16,
            l3_offset: (v >> 48) as u8,
            ecn: v >> 63 == 1,
        })
    }

    /// The GSO description of `meta`, if it has a valid one.
    pub fn of(meta: &Metadata) -> Option<Gso> {
        meta.get(MetaKey::GSO).and_then(Gso::unpack)
    }

    /// How many on-wire segments a packet of `len` bytes with this description becomes (at least 1).
    pub fn segments(&self, len: usize) -> usize {
        let payload = len.saturating_sub(usize::from(self.hdr_len));
        let size = usize::from(self.gso_size).max(1);
        payload.div_ceil(size).max(1)
    }

    /// Bytes on the wire of a packet of `len` bytes with this description: every segment repeats the headers.
    pub fn wire_bytes(&self, len: usize) -> usize {
        len + (self.segments(len) - 1) * usize::from(self.hdr_len)
    }

    /// The description of the same packet after `by` bytes were put in front of it (a link header; negative: taken
    /// away); `None` if its IP header would then start before the packet, or lie beyond 255 bytes.
    pub fn moved(self, by: isize) -> Option<Gso> {
        let shift = |v: u16| u16::try_from((v as isize).checked_add(by)?).ok();
        Some(Gso {
            hdr_len: shift(self.hdr_len)?,
            csum_start: shift(self.csum_start)?,
            l3_offset: u8::try_from(isize::from(self.l3_offset).checked_add(by)?).ok()?,
            ..self
        })
    }
}

/// How many key-value pairs a frame's metadata holds inline.
pub const METADATA_CAPACITY: usize = 6;

/// Small inline key-value metadata carried by a data frame; no allocation.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct Metadata {
    len: u8,
    entries: [(u16, u64); METADATA_CAPACITY],
}

impl Metadata {
    /// The value stored under `key`, if any.
    pub fn get(&self, key: MetaKey) -> Option<u64> {
        self.entries[..self.len as usize].iter().find(|(k, _)| *k == key.0).map(|(_, v)| *v)
    }

    /// Stores `value` under `key`; returns false (and stores nothing) when the metadata is full.
    pub fn set(&mut self, key: MetaKey, value: u64) -> bool {
        let len = self.len as usize;
        if let Some(entry) = self.entries[..len].iter_mut().find(|(k, _)| *k == key.0) {
            entry.1 = value;
            return true;
        }
        if len == METADATA_CAPACITY {
            return false;
        }
        self.entries[len] = (key.0, value);
        self.len += 1;
        true
    }

    /// Removes `key`, returning its value.
    pub fn remove(&mut self, key: MetaKey) -> Option<u64> {
        let len = self.len as usize;
        let pos = self.entries[..len].iter().position(|(k, _)| *k == key.0)?;
        let value = self.entries[pos].1;
        self.entries.copy_within(pos + 1..len, pos);
        self.len -= 1;
        Some(value)
    }

    /// The stored pairs, in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (MetaKey, u64)> + '_ {
        self.entries[..self.len as usize].iter().map(|(k, v)| (MetaKey(*k), *v))
    }

    /// Number of stored pairs.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True when nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl fmt::Debug for Metadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter().map(|(k, v)| (k.0, v))).finish()
    }
}

/// Counters of a pool, for the `pool.*` meters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Slots ever allocated from the heap.
    pub allocated: u64,
    /// Slots given back to the heap (returned when the free list was full).
    pub released: u64,
    /// The most slots that existed at once (in use or on the free list): the pool's high-water mark, what bounds its
    /// memory. `allocated` alone overstates it once the free list has released slots.
    pub peak: u64,
    /// Slots handed out again from the free list.
    pub reused: u64,
    /// Slots currently on the free list.
    pub free: u64,
    /// Bytes of buffer the free list holds (the slots' capacities).
    pub free_bytes: u64,
    /// Copies made by copy-on-write.
    pub copies: u64,
}

struct PoolShared {
    free: RefCell<Vec<Rc<Slot>>>,
    /// Free slots whose buffers held more than 32 KiB when freed (a super-packet, a large segment; not a stream
    /// chunk of 16 KiB, whose slots are best reused LIFO by the next chunks), kept apart for
    /// [`PacketPool::alloc_for_overwrite_len`]: among the small ones freed after them (ACKs, stream frames), a
    /// writer of a 62 KiB segment would not find them and would zero a small one up to its length. Other
    /// allocations take them only when `free` is empty.
    long: RefCell<Vec<Rc<Slot>>>,
    /// The capacities of the buffers on `free`, summed.
    free_bytes: Cell<usize>,
    buffer_capacity: usize,
    max_free: usize,
    max_free_bytes: usize,
    allocated: Cell<u64>,
    released: Cell<u64>,
    peak: Cell<u64>,
    reused: Cell<u64>,
    copies: Cell<u64>,
}

impl PoolShared {
    /// A slot from the free list.
    fn pop(&self) -> Option<Rc<Slot>> {
        let slot = self.free.borrow_mut().pop().or_else(|| self.long.borrow_mut().pop())?;
        self.free_bytes.set(self.free_bytes.get().saturating_sub(slot.data.capacity()));
        Some(slot)
    }

    /// A slot from the free list whose buffer already holds at least `len` bytes: the last freed of the long
    /// slots long enough, among the [`LOOK_FOR_LEN`] freed last; else the last long one freed; else the last freed.
    fn pop_with_len(&self, len: usize) -> Option<Rc<Slot>> {
        let slot = {
            let mut long = self.long.borrow_mut();
            let from = long.len().saturating_sub(LOOK_FOR_LEN);
            long[from..].iter().rposition(|s| s.data.len() >= len).map(|i| long.swap_remove(from + i))
        };
        let slot = match slot {
            Some(slot) => slot,
            // The longest one is then likely the last long one freed: the least to zero.
            None => self.long.borrow_mut().pop().or_else(|| self.free.borrow_mut().pop())?,
        };
        self.free_bytes.set(self.free_bytes.get().saturating_sub(slot.data.capacity()));
        Some(slot)
    }
}

/// A slot freed with at least this many bytes in its buffer goes to the long slots ([`PoolShared::long`]).
const LONG: usize = 32 * 1024 + 1;

/// How many of the long slots freed last [`PacketPool::alloc_for_overwrite_len`] looks through for one that is long
/// enough: a few, so that the look costs less than zeroing a large buffer would.
const LOOK_FOR_LEN: usize = 16;

struct Slot {
    pool: Weak<PoolShared>,
    /// The buffer: headroom, then the packet's bytes.
    data: Vec<u8>,
    /// Where the packet's bytes start in `data` (the headroom's length).
    head: usize,
    direction: Direction,
    meta: Metadata,
}

/// A pool of reusable, reference-counted packet slots. Cloning the pool handle shares the same pool.
///
/// Its free list is bounded twice: at most `max_free` slots, and at most `max_free_bytes` bytes of buffer (their
/// capacities; [`PacketPool::DEFAULT_MAX_FREE_BYTES`] unless set with [`PacketPool::with_max_free_bytes`]). A
/// buffer grows to the largest frame it held (64 KiB for a GSO super-packet), so a bound in slots alone let a burst
/// of large frames keep their memory for good; a slot given back beyond either bound is freed.
#[derive(Clone)]
pub struct PacketPool {
    shared: Rc<PoolShared>,
}

impl PacketPool {
    /// Default capacity of a packet buffer: a jumbo frame plus headroom for encapsulation.
    pub const DEFAULT_BUFFER_CAPACITY: usize = 9216 + 128;

    /// Bytes of headroom the faces leave in front of the packets they read, and that [`Packet::prepend`] makes
    /// when a packet has too little: room for an Ethernet header with two VLAN tags, or a small tunnel header.
    pub const HEADROOM: usize = 64;

    /// Default bound of the free list in bytes of buffer: 8 MiB (128 buffers of 64 KiB, or about 900 of the
    /// default capacity), per pool, that is per data-plane worker.
    pub const DEFAULT_MAX_FREE_BYTES: usize = 8 << 20;

    /// A pool whose buffers start with `buffer_capacity` bytes of room and which keeps at most `max_free` slots
    /// (and at most [`PacketPool::DEFAULT_MAX_FREE_BYTES`] of buffer).
    pub fn new(buffer_capacity: usize, max_free: usize) -> PacketPool {
        PacketPool::with_max_free_bytes(buffer_capacity, max_free, PacketPool::DEFAULT_MAX_FREE_BYTES)
    }

    /// A pool as [`PacketPool::new`] makes, whose free list holds at most `max_free_bytes` bytes of buffer.
    pub fn with_max_free_bytes(buffer_capacity: usize, max_free: usize, max_free_bytes: usize) -> PacketPool {
        PacketPool {
            shared: Rc::new(PoolShared {
                free: RefCell::new(Vec::new()),
                long: RefCell::new(Vec::new()),
                free_bytes: Cell::new(0),
                buffer_capacity,
                max_free,
                max_free_bytes,
                allocated: Cell::new(0),
                released: Cell::new(0),
                peak: Cell::new(0),
                reused: Cell::new(0),
                copies: Cell::new(0),
            }),
        }
    }

    /// An empty packet (length 0, direction up, no metadata) from the free list, or newly allocated.
    pub fn alloc(&self) -> Packet {
        let reused = self.shared.pop();
        let slot = match reused {
            Some(mut slot) => {
                self.shared.reused.set(self.shared.reused.get() + 1);
                if let Some(s) = Rc::get_mut(&mut slot) {
                    s.data.clear();
                    s.head = 0;
                    s.direction = Direction::Up;
                    s.meta = Metadata::default();
                }
                slot
            }
            None => {
                let sh = &self.shared;
                sh.allocated.set(sh.allocated.get() + 1);
                sh.peak.set(sh.peak.get().max(sh.allocated.get() - sh.released.get()));
                Rc::new(Slot {
                    pool: Rc::downgrade(&self.shared),
                    data: Vec::with_capacity(self.shared.buffer_capacity),
                    head: 0,
                    direction: Direction::Up,
                    meta: Metadata::default(),
                })
            }
        };
        Packet { slot: Some(slot) }
    }

    /// A packet (direction up, no metadata) whose bytes are still those the slot held last (empty for a new slot),
    /// for a reader that overwrites them and sets the length, e.g. a face reading a device straight into the
    /// pool: a buffer that held a large packet is not cleared and zeroed again before each read. Stale bytes never
    /// leave the data plane; the reader must set the length to what it read (or clear the packet).
    pub fn alloc_for_overwrite(&self) -> Packet {
        self.reuse(self.shared.pop())
    }

    /// As [`PacketPool::alloc_for_overwrite`], preferring a slot whose buffer already holds at least `len` bytes
    /// (among the long slots freed last), for a writer that needs `len` bytes to write into as a slice (smoltcp
    /// writing a 62 KiB segment): it then only cuts the buffer to `len`, where a slot that last held a small
    /// packet would have to be zeroed up to `len` first.
    pub fn alloc_for_overwrite_len(&self, len: usize) -> Packet {
        self.reuse(self.shared.pop_with_len(len))
    }

    /// A packet in `slot` (a free one, its bytes kept), or a new one when there was none.
    fn reuse(&self, slot: Option<Rc<Slot>>) -> Packet {
        let Some(mut slot) = slot else { return self.alloc() };
        self.shared.reused.set(self.shared.reused.get() + 1);
        if let Some(s) = Rc::get_mut(&mut slot) {
            s.head = 0;
            s.direction = Direction::Up;
            s.meta = Metadata::default();
        }
        Packet { slot: Some(slot) }
    }

    /// A packet holding a copy of `bytes`.
    pub fn alloc_from(&self, bytes: &[u8]) -> Packet {
        let mut p = self.alloc();
        p.make_mut().extend_from_slice(bytes);
        p
    }

    /// A packet holding a copy of `bytes` behind [`PacketPool::HEADROOM`] bytes of headroom, as a face reads one:
    /// for a frame copied in from elsewhere (another worker's ring) that a module may put a header in front of.
    pub fn alloc_from_with_headroom(&self, bytes: &[u8]) -> Packet {
        let mut p = self.alloc_for_overwrite();
        let buf = p.buffer_for_overwrite();
        buf.resize(Self::HEADROOM, 0);
        buf.extend_from_slice(bytes);
        p.strip_front(Self::HEADROOM);
        p
    }

    /// Counters of this pool.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            allocated: self.shared.allocated.get(),
            released: self.shared.released.get(),
            peak: self.shared.peak.get(),
            reused: self.shared.reused.get(),
            free: (self.shared.free.borrow().len() + self.shared.long.borrow().len()) as u64,
            free_bytes: self.shared.free_bytes.get() as u64,
            copies: self.shared.copies.get(),
        }
    }
}

impl Default for PacketPool {
    fn default() -> Self {
        PacketPool::new(Self::DEFAULT_BUFFER_CAPACITY, 65_536)
    }
}

/// A data frame: packet bytes, direction and metadata in a pooled, reference-counted slot.
pub struct Packet {
    // Always Some outside of Drop; an Option so that Drop can move the slot back into the pool.
    slot: Option<Rc<Slot>>,
}

impl Packet {
    #[inline]
    fn slot(&self) -> &Slot {
        self.slot.as_ref().expect("packet slot present outside drop")
    }

    fn slot_mut(&mut self) -> &mut Slot {
        let rc = self.slot.as_mut().expect("packet slot present outside drop");
        if Rc::get_mut(rc).is_none() {
            // Shared: copy into a fresh slot of the same pool (or a standalone one if the pool is gone).
            let copy = match rc.pool.upgrade() {
                Some(shared) => {
                    shared.copies.set(shared.copies.get() + 1);
                    let mut fresh = PacketPool { shared }.alloc();
                    let dst = fresh.slot.take().expect("fresh slot");
                    drop(fresh);
                    dst
                }
                None => Rc::new(Slot {
                    pool: Weak::new(),
                    data: Vec::new(),
                    head: 0,
                    direction: Direction::Up,
                    meta: Metadata::default(),
                }),
            };
            let mut copy = copy;
            {
                let dst = Rc::get_mut(&mut copy).expect("fresh slot is unique");
                // The headroom is copied with the bytes (it is short): a header can still be put in front in place.
                dst.data.clear();
                dst.data.extend_from_slice(&rc.data);
                dst.head = rc.head;
                dst.direction = rc.direction;
                dst.meta = rc.meta;
            }
            *rc = copy;
        }
        Rc::get_mut(rc).expect("slot is unique after copy-on-write")
    }

    /// The packet bytes.
    #[inline]
    pub fn data(&self) -> &[u8] {
        let s = self.slot();
        &s.data[s.head..]
    }

    /// The packet bytes as a growable buffer for writing (copying them first if the packet is shared). The buffer
    /// holds the packet's bytes only: a packet with headroom ([`Packet::headroom`]) is first moved to the front
    /// of its buffer, so prefer [`Packet::data_mut`], [`Packet::truncate`], [`Packet::prepend`] and
    /// [`Packet::strip_front`] on the data path, which never move the bytes.
    pub fn make_mut(&mut self) -> &mut Vec<u8> {
        let s = self.slot_mut();
        if s.head != 0 {
            s.data.drain(..s.head);
            s.head = 0;
        }
        &mut s.data
    }

    /// The packet bytes for writing in place (copying them first if the packet is shared); the length stays.
    #[inline]
    pub fn data_mut(&mut self) -> &mut [u8] {
        let s = self.slot_mut();
        &mut s.data[s.head..]
    }

    /// Shortens the packet to `len` bytes (nothing if it is not longer), copying it first if it is shared.
    pub fn truncate(&mut self, len: usize) {
        if len < self.len() {
            let s = self.slot_mut();
            s.data.truncate(s.head + len);
        }
    }

    /// Bytes free in front of the packet, where [`Packet::prepend`] puts a header without moving it.
    #[inline]
    pub fn headroom(&self) -> usize {
        self.slot().head
    }

    /// Puts `n` bytes in front of the packet and returns them for the caller to fill (they hold stale bytes). In
    /// the headroom if it is large enough: nothing moves; else the packet is moved back once to make
    /// [`PacketPool::HEADROOM`] bytes of it (more if `n` is larger). Copies a shared packet first.
    pub fn prepend(&mut self, n: usize) -> &mut [u8] {
        let s = self.slot_mut();
        if s.head < n {
            let room = PacketPool::HEADROOM.max(n);
            let len = s.data.len() - s.head;
            s.data.resize(room + len, 0);
            s.data.copy_within(s.head..s.head + len, room);
            s.head = room;
        }
        s.head -= n;
        &mut s.data[s.head..s.head + n]
    }

    /// Takes the first `n` bytes (all if there are fewer) off the packet without moving the rest: they become
    /// headroom. Copies a shared packet first.
    pub fn strip_front(&mut self, n: usize) {
        let n = n.min(self.len());
        if n > 0 {
            self.slot_mut().head += n;
        }
    }

    /// The whole buffer for a reader that fills it from the front, e.g. a face reading a device into it with
    /// room in front ([`crate::FaceDevice::read_frame_at`]); the bytes then start at offset 0 until
    /// [`Packet::strip_front`] moves the start to where the reader put them. Nothing is moved: what the buffer
    /// held is stale (as for [`PacketPool::alloc_for_overwrite`]). Copies a shared packet first.
    pub fn buffer_for_overwrite(&mut self) -> &mut Vec<u8> {
        let s = self.slot_mut();
        s.head = 0;
        &mut s.data
    }

    /// Length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        let s = self.slot();
        s.data.len() - s.head
    }

    /// True for a packet of zero bytes.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The direction of travel.
    #[inline]
    pub fn direction(&self) -> Direction {
        self.slot().direction
    }

    /// Sets the direction of travel.
    pub fn set_direction(&mut self, direction: Direction) {
        if self.direction() != direction {
            self.slot_mut().direction = direction;
        }
    }

    /// The metadata.
    #[inline]
    pub fn meta(&self) -> &Metadata {
        &self.slot().meta
    }

    /// The metadata for writing.
    pub fn meta_mut(&mut self) -> &mut Metadata {
        &mut self.slot_mut().meta
    }

    /// The on-wire packets this one stands for: the segments of a GSO super-packet ([`MetaKey::GSO`]), else 1.
    /// Meters that count packets count these, so that they read the same whether a super-packet was cut first.
    pub fn wire_packets(&self) -> u64 {
        Gso::of(self.meta()).map_or(1, |g| g.segments(self.len()) as u64)
    }

    /// The bytes on the wire of the packets it stands for ([`Packet::wire_packets`]): a super-packet's segments each
    /// repeat its headers.
    pub fn wire_bytes(&self) -> u64 {
        Gso::of(self.meta()).map_or(self.len(), |g| g.wire_bytes(self.len())) as u64
    }

    /// Keeps the GSO description right after `by` bytes were put in front of the packet (negative: taken away),
    /// e.g. a link header; the key is removed if it cannot be (the packet then travels as one long packet).
    pub fn move_gso(&mut self, by: isize) {
        if let Some(g) = Gso::of(self.meta()) {
            match g.moved(by) {
                Some(moved) => {
                    self.meta_mut().set(MetaKey::GSO, moved.pack());
                }
                None => {
                    self.meta_mut().remove(MetaKey::GSO);
                }
            }
        }
    }

    /// True when another packet shares these bytes.
    #[inline]
    pub fn is_shared(&self) -> bool {
        self.slot.as_ref().is_some_and(|rc| Rc::strong_count(rc) > 1)
    }
}

impl Clone for Packet {
    /// Shares the bytes (a reference-count increment); writing either copy copies first.
    fn clone(&self) -> Packet {
        Packet { slot: self.slot.clone() }
    }
}

impl Drop for Packet {
    fn drop(&mut self) {
        let Some(slot) = self.slot.take() else { return };
        if Rc::strong_count(&slot) != 1 {
            return;
        }
        if let Some(shared) = slot.pool.upgrade() {
            let (mut free, mut long) = (shared.free.borrow_mut(), shared.long.borrow_mut());
            let bytes = shared.free_bytes.get() + slot.data.capacity();
            if free.len() + long.len() < shared.max_free && bytes <= shared.max_free_bytes {
                shared.free_bytes.set(bytes);
                if slot.data.len() >= LONG {
                    long.push(slot);
                } else {
                    free.push(slot);
                }
            } else {
                shared.released.set(shared.released.get() + 1);
            }
        }
    }
}

impl fmt::Debug for Packet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Packet")
            .field("len", &self.len())
            .field("direction", &self.direction())
            .field("meta", self.meta())
            .finish()
    }
}

/// The operations of a control frame (FINS's control opcodes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlOp {
    /// Read parameter `param` of the destination module.
    ReadParam,
    /// Answer to a `ReadParam`, carrying the value.
    ReadParamReply,
    /// Write `value` into knob `param` of the destination module.
    SetParam,
    /// Answer to a `SetParam` (value true on success).
    SetParamReply,
    /// Execute procedure `param` of the destination with argument `value`.
    Exec,
    /// Answer to an `Exec`, carrying the result.
    ExecReply,
    /// Ask to be alerted when the destination raises event `param`.
    Listen,
    /// Stop listening to event `param` of the destination.
    Unlisten,
    /// An event `param` raised by the sender, with `value`.
    Alert,
    /// An error report; `value` is the message, `serial` names the request that failed.
    Error,
}

/// A control frame: an operation from one module (or the control plane) to another, routed by the switch.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ControlFrame {
    /// What is asked or reported.
    pub op: ControlOp,
    /// Name of the sending module (`control` for the control plane).
    pub sender: String,
    /// Name of the destination module.
    pub dest: String,
    /// Serial number chosen by the requester; replies carry the request's serial.
    pub serial: u32,
    /// Parameter, procedure or event name.
    pub param: String,
    /// Argument or result.
    pub value: Value,
}

impl ControlFrame {
    /// A reply to this frame with operation `op` and `value`, addressed back to its sender.
    pub fn reply(&self, op: ControlOp, value: Value) -> ControlFrame {
        ControlFrame {
            op,
            sender: self.dest.clone(),
            dest: self.sender.clone(),
            serial: self.serial,
            param: self.param.clone(),
            value,
        }
    }
}

/// What the switch moves: a data frame or a control frame.
#[derive(Clone, Debug)]
pub enum Frame {
    /// A packet with direction and metadata.
    Data(Packet),
    /// A control frame (boxed: rare, and keeps `Frame` two words wide).
    Control(Box<ControlFrame>),
}

impl Frame {
    /// The packet, for a data frame.
    #[inline]
    pub fn packet(&self) -> Option<&Packet> {
        match self {
            Frame::Data(p) => Some(p),
            Frame::Control(_) => None,
        }
    }

    /// The packet for writing, for a data frame.
    #[inline]
    pub fn packet_mut(&mut self) -> Option<&mut Packet> {
        match self {
            Frame::Data(p) => Some(p),
            Frame::Control(_) => None,
        }
    }

    /// Bytes of a data frame (0 for a control frame).
    pub fn len(&self) -> usize {
        self.packet().map_or(0, Packet::len)
    }

    /// True for an empty data frame or a control frame.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl From<Packet> for Frame {
    fn from(p: Packet) -> Frame {
        Frame::Data(p)
    }
}

/// A batch of frames handed to a module in one call.
pub type Batch = Vec<Frame>;

#[cfg(test)]
mod tests {
    #[test]
    fn a_super_packet_counts_its_segments_and_moves_its_description_with_a_link_header() {
        use super::{Gso, GsoKind, MetaKey, PacketPool};
        let g = Gso { kind: GsoKind::TcpV4, gso_size: 1000, hdr_len: 40, csum_start: 20, l3_offset: 0, ecn: false };
        let pool = PacketPool::default();
        let mut p = pool.alloc_from(&[0u8; 2540]);
        assert_eq!((p.wire_packets(), p.wire_bytes()), (1, 2540), "no key: one packet");
        p.meta_mut().set(MetaKey::GSO, g.pack());
        assert_eq!((p.wire_packets(), p.wire_bytes()), (3, 2540 + 2 * 40));
        p.move_gso(14);
        assert_eq!(Gso::of(p.meta()), Some(Gso { hdr_len: 54, csum_start: 34, l3_offset: 14, ..g }));
        p.move_gso(-14);
        assert_eq!(Gso::of(p.meta()), Some(g));
        p.move_gso(-1);
        assert_eq!(p.meta().get(MetaKey::GSO), None, "the IP header cannot start before the packet");
    }

    #[test]
    fn gso_packs_into_one_metadata_value_and_back() {
        use super::{Gso, GsoKind, Metadata};
        let g = Gso { kind: GsoKind::TcpV6, gso_size: 1440, hdr_len: 86, csum_start: 54, l3_offset: 14, ecn: true };
        let mut m = Metadata::default();
        assert!(m.set(super::MetaKey::GSO, g.pack()));
        assert_eq!(Gso::of(&m), Some(g));
        let u = Gso {
            kind: GsoKind::UdpL4,
            gso_size: 0xffff,
            hdr_len: 0xffff,
            csum_start: 0xffff,
            l3_offset: 255,
            ecn: false,
        };
        assert_eq!(Gso::unpack(u.pack()), Some(u));
        assert_eq!(Gso::unpack(0), None, "type 0 is not GSO");
        // 14 + 20 + 32 = 66 bytes of headers and 10,000 bytes of payload at 1448 per segment: 7 segments.
        let t = Gso { kind: GsoKind::TcpV4, gso_size: 1448, hdr_len: 66, csum_start: 34, l3_offset: 14, ecn: false };
        assert_eq!(t.segments(66 + 10_000), 7);
        assert_eq!(t.wire_bytes(66 + 10_000), 7 * 66 + 10_000);
        assert_eq!(t.segments(66 + 1448), 1);
        assert_eq!(t.segments(66), 1);
        assert_eq!(t.wire_bytes(66 + 1449), 2 * 66 + 1449);
    }

    use super::*;

    #[test]
    fn frame_is_two_words() {
        assert_eq!(std::mem::size_of::<Frame>(), 2 * std::mem::size_of::<usize>());
        assert_eq!(std::mem::size_of::<Packet>(), std::mem::size_of::<usize>());
    }

    #[test]
    fn slots_are_recycled_without_allocation() {
        let pool = PacketPool::new(64, 16);
        for _ in 0..100 {
            let mut p = pool.alloc();
            p.make_mut().extend_from_slice(&[1, 2, 3]);
            p.meta_mut().set(MetaKey::SEQ, 9);
        }
        let s = pool.stats();
        assert_eq!(s.allocated, 1);
        assert_eq!(s.reused, 99);
        let p = pool.alloc();
        assert!(p.is_empty(), "a reused slot comes back cleared");
        assert_eq!(p.meta().get(MetaKey::SEQ), None);
    }

    #[test]
    fn a_packet_for_overwrite_keeps_the_slot_bytes_but_not_its_metadata() {
        let pool = PacketPool::new(64, 16);
        let mut p = pool.alloc_from(b"previous packet");
        p.meta_mut().set(MetaKey::CSUM_PARTIAL, CsumPartial { start: 34, offset: 16 }.pack());
        p.set_direction(Direction::Down);
        drop(p);
        let q = pool.alloc_for_overwrite();
        assert_eq!(q.data(), b"previous packet", "not cleared: the reader overwrites and sets the length");
        assert!(q.meta().is_empty());
        assert_eq!(q.direction(), Direction::Up);
        assert_eq!(pool.stats().reused, 1);
        drop(q);
        assert!(pool.alloc().is_empty(), "an ordinary alloc still clears");
        assert!(PacketPool::new(64, 0).alloc_for_overwrite().is_empty(), "a new slot is empty");
    }

    /// A writer that needs `len` bytes gets a long slot freed lately that already holds them (nothing to zero),
    /// even with small ones freed after it; the last freed one if none does; the pool's counts follow. Other
    /// allocations take small slots first.
    #[test]
    fn a_packet_for_overwrite_of_a_length_prefers_a_slot_that_long() {
        let pool = PacketPool::new(64, 64);
        let long = pool.alloc_from(&[7u8; 40_000]);
        let short: Vec<Packet> = (0..2 * LOOK_FOR_LEN).map(|_| pool.alloc_from(b"ack")).collect();
        drop(long);
        drop(short);
        let before = pool.stats();
        assert_eq!(before.free, 2 * LOOK_FOR_LEN as u64 + 1);
        let (a, b) = (pool.alloc(), pool.alloc_for_overwrite());
        assert!(a.is_empty(), "cleared");
        assert_eq!(b.data(), b"ack", "small slots first");
        drop((a, b));
        let mut p = pool.alloc_for_overwrite_len(30_000);
        assert_eq!(p.len(), 40_000, "the long slot, past the small ones freed after it");
        assert!(p.meta().is_empty());
        assert_eq!(pool.stats().free_bytes, before.free_bytes - p.buffer_for_overwrite().capacity() as u64);
        assert_eq!(pool.stats().free, before.free - 1);
        let ack = pool.alloc_for_overwrite_len(30_000);
        assert_eq!(ack.data(), b"ack", "no long one: the last freed");
        drop(p);
        let p = pool.alloc_for_overwrite_len(50_000);
        assert_eq!(p.len(), 40_000, "none long enough: a long one still (less to zero)");
        drop(p);
        // Only the long slots freed last are looked through.
        let longs: Vec<Packet> = (0..LOOK_FOR_LEN).map(|_| pool.alloc_from(&[1u8; 35_000])).collect();
        let longest = pool.alloc_for_overwrite_len(30_000);
        assert_eq!(longest.len(), 40_000);
        drop(longest);
        drop(longs);
        assert_eq!(pool.alloc_for_overwrite_len(38_000).len(), 35_000, "the longest is too far down");
        // A stream chunk's slot (16 KiB) stays with the small ones.
        drop(pool.alloc_from(&[2u8; 16_400]));
        assert_eq!(pool.alloc_for_overwrite().len(), 16_400, "taken back first by a small allocation");
        drop(ack);
        let empty = PacketPool::new(64, 4);
        assert!(empty.alloc_for_overwrite_len(10).is_empty(), "an empty pool: a new slot");
    }

    #[test]
    fn csum_partial_packs_into_one_metadata_value() {
        let c = CsumPartial { start: 0xfffe, offset: 16 };
        let mut m = Metadata::default();
        assert_eq!(CsumPartial::of(&m), None);
        m.set(MetaKey::CSUM_PARTIAL, c.pack());
        assert_eq!(CsumPartial::of(&m), Some(c));
        assert_eq!(c.field(), 0xfffe + 16);
    }

    #[test]
    fn clone_shares_and_write_copies() {
        let pool = PacketPool::new(64, 16);
        let a = pool.alloc_from(b"hello");
        let mut b = a.clone();
        assert!(a.is_shared());
        b.make_mut()[0] = b'j';
        assert_eq!(a.data(), b"hello");
        assert_eq!(b.data(), b"jello");
        assert!(!a.is_shared());
        assert_eq!(pool.stats().copies, 1);
        b.set_direction(Direction::Down);
        assert_eq!(a.direction(), Direction::Up);
    }

    #[test]
    fn a_header_goes_into_the_headroom_and_comes_off_without_moving_the_packet() {
        let pool = PacketPool::new(64, 16);
        let mut p = pool.alloc();
        let buf = p.buffer_for_overwrite();
        buf.resize(PacketPool::HEADROOM, 0xee);
        buf.extend_from_slice(b"payload");
        p.strip_front(PacketPool::HEADROOM);
        assert_eq!((p.data(), p.len(), p.headroom()), (&b"payload"[..], 7, PacketPool::HEADROOM));
        let at = p.data().as_ptr();
        p.prepend(3).copy_from_slice(b"hdr");
        assert_eq!(p.data(), b"hdrpayload");
        assert_eq!(p.data()[3..].as_ptr(), at, "the payload stayed where it was");
        assert_eq!(p.headroom(), PacketPool::HEADROOM - 3);
        p.strip_front(3);
        assert_eq!((p.data(), p.data().as_ptr()), (&b"payload"[..], at));
        p.data_mut()[0] = b'P';
        p.truncate(4);
        p.truncate(10);
        assert_eq!((p.data(), p.data().as_ptr()), (&b"Payl"[..], at), "in place, and truncate never grows");
        p.strip_front(100);
        assert!(p.is_empty(), "stripping more than the packet empties it");
    }

    #[test]
    fn a_header_without_headroom_moves_the_packet_once() {
        let pool = PacketPool::new(64, 16);
        let mut p = pool.alloc_from(b"payload");
        assert_eq!(p.headroom(), 0);
        p.prepend(2).copy_from_slice(b"h1");
        assert_eq!(p.data(), b"h1payload");
        assert_eq!(p.headroom(), PacketPool::HEADROOM - 2, "moved once, with the usual headroom");
        let at = p.data().as_ptr();
        p.prepend(1)[0] = b'x';
        assert_eq!(p.data(), b"xh1payload");
        assert_eq!(p.data()[1..].as_ptr(), at, "the second header found room");
        let mut q = pool.alloc_from(b"ab");
        q.prepend(200).fill(7);
        assert_eq!((q.len(), &q.data()[200..], q.headroom()), (202, &b"ab"[..], 0), "a header above the headroom");
        // make_mut hands out the packet's bytes only.
        p.make_mut().push(b'!');
        assert_eq!((p.data(), p.headroom()), (&b"xh1payload!"[..], 0));
    }

    #[test]
    fn headroom_survives_sharing_and_is_gone_on_reuse() {
        let pool = PacketPool::new(64, 16);
        let mut a = pool.alloc_from(b"data");
        a.prepend(2).copy_from_slice(b"ab");
        a.strip_front(2);
        let mut b = a.clone();
        b.prepend(1)[0] = b'h';
        assert_eq!((a.data(), b.data()), (&b"data"[..], &b"hdata"[..]), "writing the copy leaves the original");
        assert_eq!(pool.stats().copies, 1);
        assert_eq!(b.headroom(), a.headroom() - 1, "the copy keeps the headroom: it prepended in place");
        let mut c = a.clone();
        c.strip_front(1);
        assert_eq!((a.data(), c.data()), (&b"data"[..], &b"ata"[..]));
        drop((a, b, c));
        let fresh = pool.alloc();
        assert_eq!((fresh.len(), fresh.headroom()), (0, 0));
        drop(fresh);
        let mut o = pool.alloc_for_overwrite();
        assert_eq!(o.headroom(), 0, "a reused slot starts at its front");
        o.buffer_for_overwrite().clear();
        assert!(o.is_empty());
        drop(o);
        let h = pool.alloc_from_with_headroom(b"copied");
        assert_eq!((h.data(), h.headroom()), (&b"copied"[..], PacketPool::HEADROOM));
    }

    #[test]
    fn free_list_is_bounded_and_survives_pool_drop() {
        let pool = PacketPool::new(8, 2);
        let packets: Vec<_> = (0..5).map(|_| pool.alloc()).collect();
        drop(packets);
        assert_eq!(pool.stats().free, 2);
        let orphan = pool.alloc_from(b"x");
        drop(pool);
        let mut copy = orphan.clone();
        copy.make_mut().push(b'y');
        assert_eq!(orphan.data(), b"x");
        assert_eq!(copy.data(), b"xy");
    }

    #[test]
    fn free_list_is_bounded_in_bytes() {
        let pool = PacketPool::with_max_free_bytes(100, 1000, 1000);
        let mut big = pool.alloc();
        big.make_mut().resize(900, 0);
        let big_capacity = big.slot().data.capacity();
        let small: Vec<_> = (0..5).map(|_| pool.alloc()).collect();
        drop(big);
        assert_eq!(pool.stats().free_bytes, big_capacity as u64);
        drop(small);
        let s = pool.stats();
        assert!(s.free_bytes <= 1000, "{s:?}");
        assert_eq!(s.free, 2, "one small buffer still fits beside the big one: {s:?}");
        assert_eq!((s.allocated, s.released, s.peak), (6, 4, 6), "four went back to the heap: {s:?}");
        let more: Vec<_> = (0..3).map(|_| pool.alloc()).collect();
        let t = pool.stats();
        assert_eq!((t.allocated, t.peak), (7, 6), "two reused, one new: 3 alive, the peak stays: {t:?}");
        drop(more);
        // A slot taken from the free list no longer counts.
        let again = pool.alloc();
        assert!(pool.stats().free_bytes < s.free_bytes);
        drop(again);
        assert_eq!(pool.stats().free_bytes, s.free_bytes);
    }

    #[test]
    fn metadata_set_get_remove() {
        let mut m = Metadata::default();
        for k in 0..METADATA_CAPACITY as u16 {
            assert!(m.set(MetaKey(k), u64::from(k) * 10));
        }
        assert!(!m.set(MetaKey(100), 1), "full");
        assert!(m.set(MetaKey(3), 33), "overwrite works when full");
        assert_eq!(m.remove(MetaKey(1)), Some(10));
        assert_eq!(m.get(MetaKey(3)), Some(33));
        assert_eq!(m.get(MetaKey(1)), None);
        assert_eq!(m.len(), METADATA_CAPACITY - 1);
    }
}
