//! `reassemble`: IPv4 and IPv6 fragment reassembly with bounded memory (RFC 791, RFC 8200 4.5, RFC 5722, RFC 1858).
//!
//! Its ports, knobs (each also accepted as a setting of the same name) and meters are declared once, in `DECL`
//! below; docs/modules.md lists them with their units, defaults and ranges. Packets that are not fragments pass to
//! `out` unchanged, followed by the reassembled datagrams; control frames pass to `out`. `max_datagrams` counts
//! the tombstones of discarded datagrams too (see below); `max_bytes` bounds the heap held by the datagrams being
//! reassembled: the capacity of their payload, header and piece-list buffers (`bytes_pending`), so a datagram
//! larger than this cannot be reassembled; a datagram not complete `timeout_ms` after its first fragment arrived is
//! discarded.
//!
//! - Datagrams are keyed by (source, destination, identification, protocol) — the IP version being that of the
//!   addresses; for IPv6 the protocol is the fragment header's next header.
//! - Drop reasons, each counted in `drop_<reason>_total` (frames) and as dropped by the switch:
//!   - `overlap`: a fragment overlapping one already held (any overlap, for IPv4 as for IPv6: RFC 5722), or
//!     disagreeing with the end set by the last fragment: the whole datagram is discarded — the fragments held
//!     and this one — and its key stays a tombstone until its timeout, so that later fragments of it are dropped
//!     (as `overlap`) rather than start a new datagram.
//!   - `duplicate`: an exact duplicate (same offset, length and bytes) of a fragment held: only it is dropped.
//!   - `tiny`: a first fragment too short to hold a transport header (< 8 bytes), a fragment that is not the
//!     last with a length that is not a positive multiple of 8, or an IPv4 TCP fragment at offset 8, whose
//!     only use is rewriting the TCP flags (RFC 1858 3.2); only that fragment is dropped.
//!   - `too_big`: a fragment, or the datagram it completes, would make the datagram longer than 65535 bytes
//!     (IPv4 total length / IPv6 payload length): the datagram is discarded and tombstoned as for `overlap`.
//!   - `timeout`: the fragments of datagrams that expired.
//!   - `memory`: a fragment arriving while `max_datagrams` datagrams are pending (for a new datagram) or that
//!     needs more than `max_bytes`: the OLDEST datagram is discarded to make room, its fragments counted here
//!     (and this fragment too, if even that is not enough).
//!   - the parse errors of [`flexstack_wire::packet::ParseError`] (`truncated`, `bad_checksum`, ...).
//! - A reassembled datagram has the first fragment's header (IPv4: with its options, total length set, MF and
//!   offset cleared, checksum recomputed; IPv6: the headers before the fragment header, the fragment header
//!   removed and the payload length set), direction and metadata. Fragments are copied into a per-datagram
//!   buffer when they arrive (the frames are released at once) and held as pending until the datagram completes
//!   or is discarded; buffers of finished datagrams are kept for reuse up to a quarter of `max_bytes`.
//!
//! On `module replace` keeping state, the datagrams in progress move to the new module, whose limits apply at
//! once (the oldest evicted if they are lower).
//!
//! Accounting: every data frame received is passed, dropped (counted once, with one reason), pending, or one of
//! `fragments_reassembled_total`; each reassembled datagram is one new frame on `out`. Expiry is driven by
//! `out.wake_at` / `poll` at the earliest deadline.

use flexstack_core::frame::Metadata;
use flexstack_core::module::{handed_over, port_type};
use flexstack_core::{
    field, frames_meter, kind_from_decl, Batch, ConfigError, Direction, Frame, KindDecl, Meter, MeterDecl, Module,
    ModuleBuilder, ModuleKind, Output, Packet, Param, PortDecl, Settings, Time, Value,
};
use flexstack_wire::packet::ParseDrops;
use flexstack_wire::packet::{proto, PacketInfo};
use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::time::Duration;

/// The kind's name in stack files.
pub const KIND: &str = "reassemble";

/// Longest IPv4 datagram / IPv6 payload.
const MAX_LEN: usize = 65535;

/// Default `max_datagrams`.
pub const DEFAULT_MAX_DATAGRAMS: u64 = 64;
/// Default `max_bytes`.
pub const DEFAULT_MAX_BYTES: u64 = 4 << 20;
/// Default `timeout_ms`.
pub const DEFAULT_TIMEOUT_MS: u64 = 30_000;

/// Why a datagram was discarded (tombstones remember it for the fragments that follow); indexes `Meters::drops`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reason {
    Overlap,
    Duplicate,
    Tiny,
    TooBig,
    Timeout,
    Memory,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    src: IpAddr,
    dst: IpAddr,
    id: u32,
    protocol: u8,
}

/// One datagram being reassembled (or a tombstone, when `dead` is set). Its buffers are reused.
#[derive(Debug)]
struct Datagram {
    key: Key,
    seq: u64,
    created: Time,
    /// Payload bytes by offset; its length is the highest end seen.
    data: Vec<u8>,
    /// The first fragment's header (IPv4) or unfragmentable part with the next header fixed (IPv6).
    header: Vec<u8>,
    /// `(offset, end)` of every fragment held, sorted and disjoint.
    pieces: Vec<(u32, u32)>,
    /// The end of the datagram, once the last fragment arrived.
    total: Option<u32>,
    /// Sum of the pieces' lengths.
    received: u32,
    /// Direction and metadata of the first fragment.
    first: Option<(Direction, Metadata)>,
    dead: Option<Reason>,
    active: bool,
}

impl Datagram {
    fn empty() -> Datagram {
        Datagram {
            key: Key { src: IpAddr::from([0u8; 4]), dst: IpAddr::from([0u8; 4]), id: 0, protocol: 0 },
            seq: 0,
            created: Time::ZERO,
            data: Vec::new(),
            header: Vec::new(),
            pieces: Vec::new(),
            total: None,
            received: 0,
            first: None,
            dead: None,
            active: false,
        }
    }

    /// Heap bytes held by the buffers.
    fn capacity(&self) -> usize {
        self.data.capacity() + self.header.capacity() + self.pieces.capacity() * std::mem::size_of::<(u32, u32)>()
    }

    fn reset(&mut self) {
        self.data.clear();
        self.header.clear();
        self.pieces.clear();
        self.total = None;
        self.received = 0;
        self.first = None;
        self.dead = None;
    }

    fn release_buffers(&mut self) {
        self.data = Vec::new();
        self.header = Vec::new();
        self.pieces = Vec::new();
    }
}

/// The knobs (`Default` is a blank to read them into).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Limits {
    max_datagrams: u64,
    max_bytes: u64,
    timeout_ms: u64,
}

/// The `reassemble` module kind.
pub struct ReassembleKind;

type P = Param<Limits>;

/// The kind: ports, knobs and meters.
const DECL: KindDecl<Limits, Meters> = KindDecl {
    inputs: &[PortDecl::new("in", port_type::IP, "IP packets, fragments or not")],
    outputs: &[PortDecl::new("out", port_type::IP, "packets that are not fragments, and reassembled datagrams")],
    params: &[
        P::u64("max_datagrams", "", "datagrams reassembled at once", DEFAULT_MAX_DATAGRAMS, field!(max_datagrams))
            .range(1.0, 65536.0),
        P::u64("max_bytes", "bytes", "buffer bytes held by pending datagrams", DEFAULT_MAX_BYTES, field!(max_bytes))
            .range(1.0, (1u64 << 30) as f64),
        P::u64("timeout_ms", "ms", "time a datagram has to complete", DEFAULT_TIMEOUT_MS, field!(timeout_ms))
            .range(1.0, 600_000.0),
    ],
    meters: &[
        MeterDecl::u64("fragments_total", "frames", "fragments received", |m| &mut m.fragments),
        MeterDecl::u64("passed_total", "frames", "packets that are not fragments, passed on", |m| &mut m.passed),
        MeterDecl::u64("datagrams_reassembled_total", "frames", "datagrams reassembled and emitted", |m| {
            &mut m.reassembled
        }),
        MeterDecl::u64(
            "fragments_reassembled_total",
            "frames",
            "fragments that went into reassembled datagrams",
            |m| &mut m.fragments_reassembled,
        ),
        MeterDecl::u64("datagrams_pending", "", "datagrams being reassembled", |m| &mut m.datagrams_pending),
        MeterDecl::u64("fragments_pending", "frames", "fragments held by pending datagrams", |m| {
            &mut m.fragments_pending
        }),
        MeterDecl::u64("bytes_pending", "bytes", "buffer bytes held by pending datagrams", |m| &mut m.bytes_pending),
        MeterDecl::u64("bytes_spare", "bytes", "buffer bytes kept for reuse", |m| &mut m.bytes_spare),
        frames_meter!(
            "drop_overlap_total",
            "fragments dropped: overlapping or inconsistent (whole datagram)",
            drops[Reason::Overlap]
        ),
        frames_meter!("drop_duplicate_total", "fragments dropped: exact duplicates", drops[Reason::Duplicate]),
        frames_meter!("drop_tiny_total", "fragments dropped: too short or not a multiple of 8", drops[Reason::Tiny]),
        frames_meter!(
            "drop_too_big_total",
            "fragments dropped: datagram longer than 65535 bytes",
            drops[Reason::TooBig]
        ),
        frames_meter!("drop_timeout_total", "fragments dropped: datagram not complete in time", drops[Reason::Timeout]),
        frames_meter!(
            "drop_memory_total",
            "fragments dropped: oldest datagram discarded for room",
            drops[Reason::Memory]
        ),
    ],
    more_meters: || ParseDrops::specs(false),
    accepts_gso: true,
    ..KindDecl::new(
        KIND,
        "reassembles IPv4/IPv6 fragments with bounded memory; drops overlaps, duplicates, tiny fragments",
    )
};

impl ModuleKind for ReassembleKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        DECL.configure(settings, Limits::default(), |limits, m, vars| {
            let index = HashMap::with_capacity(limits.max_datagrams.min(1024) as usize);
            Box::new(Reassembler {
                limits,
                table: Table { index, ..Table::default() },
                m,
                parse: ParseDrops::new(vars),
            })
        })
    }
}

#[derive(Default)]
struct Meters {
    fragments: Meter,
    passed: Meter,
    reassembled: Meter,
    fragments_reassembled: Meter,
    datagrams_pending: Meter,
    fragments_pending: Meter,
    bytes_pending: Meter,
    bytes_spare: Meter,
    drops: [Meter; 6],
}

impl Meters {
    fn drop(&self, reason: Reason, n: u64) {
        self.drops[reason as usize].add(n);
    }
}

/// Counts `n` fragments that this module held (their frames were released when they were copied) as dropped by
/// the switch. The core has no call for counting drops without a frame: an empty pooled packet stands in.
fn count_held_drops(out: &mut Output<'_>, n: u64) {
    for _ in 0..n {
        let p = out.pool().alloc();
        out.drop_frame(Frame::Data(p));
    }
}

/// What a fragment tells: its place in the datagram and where its payload lies in the packet.
struct Piece {
    key: Key,
    offset: u32,
    end: u32,
    more: bool,
    data_offset: usize,
    total_len: usize,
    /// Length of the header a reassembled datagram will have, as far as this fragment tells.
    header_len: usize,
}

/// The datagrams in progress, and what a reassembler hands to its replacement (`module replace` keeping state).
#[derive(Default)]
struct Table {
    slots: Vec<Datagram>,
    free: Vec<usize>,
    index: HashMap<Key, usize>,
    /// (seq, slot) in creation order, i.e. deadline order; entries of finished datagrams are skipped lazily.
    order: VecDeque<(u64, usize)>,
    next_seq: u64,
    /// Capacity of the buffers of active slots.
    bytes: usize,
    /// Capacity of the buffers of free slots.
    spare: usize,
    /// Active datagrams that are not tombstones.
    live: u64,
    /// Fragments held.
    held: u64,
}

/// A running `reassemble` module.
pub struct Reassembler {
    limits: Limits,
    table: Table,
    m: Meters,
    parse: ParseDrops,
}

impl Reassembler {
    fn timeout(&self) -> Duration {
        Duration::from_millis(self.limits.timeout_ms)
    }

    fn publish(&self) {
        self.m.datagrams_pending.set(self.table.live);
        self.m.fragments_pending.set(self.table.held);
        self.m.bytes_pending.set(self.table.bytes as u64);
        self.m.bytes_spare.set(self.table.spare as u64);
    }

    fn is_current(&self, seq: u64, slot: usize) -> bool {
        self.table.slots.get(slot).is_some_and(|d| d.active && d.seq == seq)
    }

    /// The oldest active datagram's slot, dropping stale order entries on the way.
    fn oldest(&mut self) -> Option<usize> {
        while let Some(&(seq, slot)) = self.table.order.front() {
            if self.is_current(seq, slot) {
                return Some(slot);
            }
            self.table.order.pop_front();
        }
        None
    }

    /// The earliest deadline.
    fn next_deadline(&mut self) -> Option<Time> {
        let slot = self.oldest()?;
        Some(self.table.slots[slot].created + self.timeout())
    }

    /// A new datagram for `key`, in a free slot or a new one.
    fn create(&mut self, key: Key, now: Time) -> usize {
        let slot = match self.table.free.pop() {
            Some(s) => {
                self.table.spare -= self.table.slots[s].capacity();
                s
            }
            None => {
                self.table.slots.push(Datagram::empty());
                self.table.slots.len() - 1
            }
        };
        let d = &mut self.table.slots[slot];
        d.reset();
        d.key = key;
        d.seq = self.table.next_seq;
        d.created = now;
        d.active = true;
        self.table.bytes += d.capacity();
        self.table.next_seq += 1;
        self.table.index.insert(key, slot);
        self.table.order.push_back((d.seq, slot));
        self.table.live += 1;
        // Entries of finished datagrams are skipped lazily; compact when they pile up.
        if self.table.order.len() > 2 * self.table.index.len() + 64 {
            let slots = &self.table.slots;
            self.table.order.retain(|&(seq, s)| slots[s].active && slots[s].seq == seq);
        }
        slot
    }

    /// Frees `slot`: its key is forgotten, its buffers kept for reuse within a quarter of `max_bytes`.
    fn free_slot(&mut self, slot: usize) {
        let d = &mut self.table.slots[slot];
        debug_assert!(d.active);
        self.table.bytes -= d.capacity();
        if d.dead.is_none() {
            self.table.live -= 1;
        }
        self.table.held -= d.pieces.len() as u64;
        d.active = false;
        d.reset();
        if self.table.spare + d.capacity() > (self.limits.max_bytes / 4) as usize {
            d.release_buffers();
        }
        self.table.spare += d.capacity();
        self.table.index.remove(&d.key);
        self.table.free.push(slot);
    }

    /// Discards the datagram in `slot`, counting its held fragments under `reason`. With `tombstone`, its key
    /// stays known (without buffers) until its deadline, so that its later fragments are dropped too.
    fn discard(&mut self, slot: usize, reason: Reason, tombstone: bool, out: &mut Output<'_>) {
        let n = self.table.slots[slot].pieces.len() as u64;
        self.m.drop(reason, n);
        count_held_drops(out, n);
        if !tombstone {
            self.free_slot(slot);
            return;
        }
        let d = &mut self.table.slots[slot];
        if d.dead.is_none() {
            self.table.live -= 1;
        }
        self.table.held -= n;
        self.table.bytes -= d.capacity();
        d.reset();
        d.dead = Some(reason);
        d.release_buffers(); // a tombstone holds no buffers
    }

    /// Discards oldest datagrams (not `keep`) until `fits()` holds or none is left; true if it holds.
    fn evict_until(&mut self, keep: Option<usize>, out: &mut Output<'_>, fits: impl Fn(&Reassembler) -> bool) -> bool {
        while !fits(self) {
            let victim = self.table.order.iter().copied().find(|&(seq, s)| Some(s) != keep && self.is_current(seq, s));
            let Some((_, slot)) = victim else { return false };
            self.discard(slot, Reason::Memory, false, out);
        }
        true
    }

    /// Expires datagrams whose deadline has passed, and enforces the limits (after a knob change).
    fn maintain(&mut self, out: &mut Output<'_>) {
        let now = out.now();
        let timeout = self.timeout();
        while let Some(slot) = self.oldest() {
            if self.table.slots[slot].created + timeout > now {
                break;
            }
            if self.table.slots[slot].dead.is_some() {
                self.free_slot(slot);
            } else {
                self.discard(slot, Reason::Timeout, false, out);
            }
        }
        let (max_d, max_b) = (self.limits.max_datagrams as usize, self.limits.max_bytes as usize);
        self.evict_until(None, out, |r| r.table.index.len() <= max_d && r.table.bytes <= max_b);
        while self.table.spare > max_b / 4 {
            let Some(&s) = self.table.free.iter().find(|&&s| self.table.slots[s].capacity() > 0) else { break };
            self.table.spare -= self.table.slots[s].capacity();
            self.table.slots[s].release_buffers();
        }
    }

    /// Where the fragment in `data` (parsed as `info`) belongs, or why it is dropped at once.
    fn piece(info: &PacketInfo, data: &[u8]) -> Result<Piece, Reason> {
        let f = info.fragment.expect("a fragment");
        let len = info.total_len.saturating_sub(f.data_offset) as u32;
        let (offset, end) = (f.offset, f.offset + len);
        let (protocol, header_len) = if info.version == 4 {
            (info.protocol, f.data_offset)
        } else {
            // The fragment header's next header (the same in every fragment), and the unfragmentable part.
            (data[f.data_offset - 8], f.data_offset - 8)
        };
        let tcp_flags_rewrite = info.version == 4 && protocol == proto::TCP && offset == 8;
        if (offset == 0 && len < 8) || (f.more && (len == 0 || !len.is_multiple_of(8))) || tcp_flags_rewrite {
            return Err(Reason::Tiny);
        }
        let key = Key { src: info.src, dst: info.dst, id: f.id, protocol };
        Ok(Piece { key, offset, end, more: f.more, data_offset: f.data_offset, total_len: info.total_len, header_len })
    }

    /// Length of the datagram `header_len` + `end` would make, as its IP header counts it.
    fn datagram_len(version: u8, header_len: usize, end: u32) -> usize {
        if version == 4 {
            header_len + end as usize
        } else {
            header_len.saturating_sub(40) + end as usize
        }
    }

    fn handle_fragment(&mut self, info: &PacketInfo, p: Packet, out: &mut Output<'_>) {
        self.m.fragments.add(1);
        let piece = match Self::piece(info, p.data()) {
            Ok(piece) => piece,
            Err(reason) => {
                self.m.drop(reason, 1);
                out.drop_frame(p.into());
                return;
            }
        };
        let existing = self.table.index.get(&piece.key).copied();
        if Self::datagram_len(info.version, piece.header_len, piece.end) > MAX_LEN {
            if let Some(slot) = existing.filter(|&s| self.table.slots[s].dead.is_none()) {
                self.discard(slot, Reason::TooBig, true, out);
            }
            self.m.drop(Reason::TooBig, 1);
            out.drop_frame(p.into());
            return;
        }
        let slot = match existing {
            Some(slot) => slot,
            None => {
                let max_d = self.limits.max_datagrams as usize;
                self.evict_until(None, out, |r| r.table.index.len() < max_d);
                self.create(piece.key, out.now())
            }
        };
        if let Some(reason) = self.table.slots[slot].dead {
            self.m.drop(reason, 1);
            out.drop_frame(p.into());
            return;
        }
        // Where it goes among the pieces held, and whether it fits with them.
        let d = &self.table.slots[slot];
        let payload = &p.data()[piece.data_offset..piece.total_len];
        let at = d.pieces.partition_point(|&(o, _)| o < piece.offset);
        if d.pieces.get(at) == Some(&(piece.offset, piece.end))
            && d.data[piece.offset as usize..piece.end as usize] == *payload
            && (piece.more || d.total == Some(piece.end))
        {
            self.m.drop(Reason::Duplicate, 1);
            out.drop_frame(p.into());
            return;
        }
        let overlaps = (at > 0 && d.pieces[at - 1].1 > piece.offset)
            || d.pieces.get(at).is_some_and(|&(o, _)| o < piece.end || o == piece.offset);
        let inconsistent = match (piece.more, d.total) {
            (true, Some(t)) => piece.end >= t,
            (false, Some(t)) => piece.end != t,
            (false, None) => d.pieces.last().is_some_and(|&(_, e)| e > piece.end),
            (true, None) => false,
        };
        if overlaps || inconsistent {
            self.discard(slot, Reason::Overlap, true, out);
            self.m.drop(Reason::Overlap, 1);
            out.drop_frame(p.into());
            return;
        }
        // Room: the buffer growth this piece needs, within max_bytes, evicting older datagrams if need be.
        let need = self.growth(slot, &piece);
        let max_b = self.limits.max_bytes as usize;
        if !self.evict_until(Some(slot), out, |r| r.table.bytes + need <= max_b) {
            self.discard(slot, Reason::Memory, false, out);
            self.m.drop(Reason::Memory, 1);
            out.drop_frame(p.into());
            return;
        }
        self.store(slot, &piece, info.version, &p);
        self.table.held += 1;
        drop(p); // copied: the frame goes back to the pool
        self.complete(slot, info.version, out);
    }

    /// Bytes of buffer capacity `piece` would add to the datagram in `slot`.
    fn growth(&self, slot: usize, piece: &Piece) -> usize {
        let d = &self.table.slots[slot];
        let mut need = 0;
        let end = piece.end as usize;
        if end > d.data.capacity() {
            need += Self::data_capacity(d.data.capacity(), end) - d.data.capacity();
        }
        if piece.offset == 0 {
            need += piece.header_len.saturating_sub(d.header.capacity());
        }
        if d.pieces.len() == d.pieces.capacity() {
            need += Self::pieces_capacity(d.pieces.capacity()).saturating_sub(d.pieces.capacity())
                * std::mem::size_of::<(u32, u32)>();
        }
        need
    }

    /// Capacity the payload buffer grows to for `end` bytes: doubling, capped at the largest payload.
    fn data_capacity(current: usize, end: usize) -> usize {
        end.max((current * 2).min(MAX_LEN))
    }

    fn pieces_capacity(current: usize) -> usize {
        (current * 2).max(8)
    }

    /// Copies the fragment into the datagram in `slot`.
    fn store(&mut self, slot: usize, piece: &Piece, version: u8, p: &Packet) {
        let d = &mut self.table.slots[slot];
        let before = d.capacity();
        let data = p.data();
        let (offset, end) = (piece.offset as usize, piece.end as usize);
        if end > d.data.capacity() {
            let cap = Self::data_capacity(d.data.capacity(), end);
            d.data.reserve_exact(cap - d.data.len());
        }
        if end > d.data.len() {
            d.data.resize(end, 0);
        }
        d.data[offset..end].copy_from_slice(&data[piece.data_offset..piece.total_len]);
        if d.pieces.len() == d.pieces.capacity() {
            let cap = Self::pieces_capacity(d.pieces.capacity());
            d.pieces.reserve_exact(cap - d.pieces.len());
        }
        let at = d.pieces.partition_point(|&(o, _)| o < piece.offset);
        d.pieces.insert(at, (piece.offset, piece.end));
        d.received += piece.end - piece.offset;
        if !piece.more {
            d.total = Some(piece.end);
        }
        if piece.offset == 0 {
            d.header.clear();
            d.header.reserve_exact(piece.header_len);
            d.header.extend_from_slice(&data[..piece.header_len]);
            if version == 6 {
                // The header that named the fragment header now names what followed it.
                let next = data[piece.data_offset - 8];
                if let Some(at) = next_header_field(&d.header) {
                    d.header[at] = next;
                }
            }
            d.first = Some((p.direction(), *p.meta()));
        }
        self.table.bytes = self.table.bytes + d.capacity() - before;
    }

    /// Emits the datagram in `slot` if it is complete.
    fn complete(&mut self, slot: usize, version: u8, out: &mut Output<'_>) {
        let d = &self.table.slots[slot];
        let Some(total) = d.total.filter(|&t| t == d.received) else { return };
        if Self::datagram_len(version, d.header.len(), total) > MAX_LEN {
            self.discard(slot, Reason::TooBig, true, out);
            return;
        }
        let mut p = out.pool().alloc();
        if let Some((direction, meta)) = d.first {
            p.set_direction(direction);
            *p.meta_mut() = meta;
        }
        let b = p.make_mut();
        b.extend_from_slice(&d.header);
        b.extend_from_slice(&d.data[..total as usize]);
        if version == 4 {
            let hl = d.header.len();
            let len = b.len() as u16;
            b[2..4].copy_from_slice(&len.to_be_bytes());
            b[6] &= 0x40; // keep DF; clear MF, the reserved bit and the offset
            b[7] = 0;
            b[10] = 0;
            b[11] = 0;
            let c = flexstack_wire::checksum::ipv4_header(&b[..hl]);
            b[10..12].copy_from_slice(&c.to_be_bytes());
        } else {
            let len = (b.len() - 40) as u16;
            b[4..6].copy_from_slice(&len.to_be_bytes());
        }
        let n = d.pieces.len() as u64;
        self.m.reassembled.add(1);
        self.m.fragments_reassembled.add(n);
        self.free_slot(slot);
        out.emit(0, p);
    }
}

/// In an IPv6 unfragmentable part (fixed header, then extension headers), the position of the next-header byte
/// of its last header, i.e. the one that named the fragment header that followed.
fn next_header_field(header: &[u8]) -> Option<usize> {
    let mut field = 6;
    let mut pos = 40;
    while pos < header.len() {
        let len = match header[field] {
            proto::AH => (usize::from(*header.get(pos + 1)?) + 2) * 4,
            _ => (usize::from(*header.get(pos + 1)?) + 1) * 8,
        };
        field = pos;
        pos += len;
    }
    (pos == header.len()).then_some(field)
}

impl Module for Reassembler {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        self.maintain(out);
        for frame in input.drain(..) {
            let p = match frame {
                Frame::Data(p) => p,
                control => {
                    out.emit(0, control);
                    continue;
                }
            };
            match PacketInfo::parse(p.data()) {
                Err(e) => {
                    self.parse.count(e);
                    out.drop_frame(p.into());
                }
                Ok(info) if info.fragment.is_none() => {
                    // A GSO super-packet (never a fragment) counts its segments.
                    self.m.passed.add(p.wire_packets());
                    out.emit(0, p);
                }
                Ok(info) => self.handle_fragment(&info, p, out),
            }
        }
        self.publish();
        if let Some(t) = self.next_deadline() {
            out.wake_at(t);
        }
    }

    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        self.maintain(out);
        self.publish();
        self.next_deadline()
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        DECL.write(&mut self.limits, knob, value)?;
        if knob == "max_datagrams" {
            let want = (self.limits.max_datagrams as usize).min(1024);
            self.table.index.reserve(want.saturating_sub(self.table.index.len()));
        }
        // The switch polls the module next: maintain() applies lower limits there.
        Ok(())
    }

    fn take_state(&mut self) -> Option<Box<dyn Any>> {
        let next_seq = self.table.next_seq;
        let state = std::mem::replace(&mut self.table, Table { next_seq, ..Table::default() });
        self.publish();
        Some(Box::new(state))
    }

    /// Takes over the datagrams in progress; the new limits apply at the poll that follows a load.
    fn adopt_state(&mut self, state: Box<dyn Any>) -> Result<(), String> {
        self.table = handed_over(state, "a reassembler's state")?;
        self.publish();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ip::ip::testkit::*;
    use flexstack_core::Edit;
    use flexstack_wire::packet::build;

    fn udp4_datagram(id: u16, len: usize) -> Vec<u8> {
        let data: Vec<u8> = (0..len).map(|i| (i * 13 + usize::from(id)) as u8).collect();
        let mut p = build::ipv4(A4, B4, proto::UDP, 64, &build::udp(A4.into(), B4.into(), 7, 9, &data));
        p[4..6].copy_from_slice(&id.to_be_bytes());
        p[6] = 0; // no DF
        p[10] = 0;
        p[11] = 0;
        let c = flexstack_wire::checksum::ipv4_header(&p[..20]);
        p[10..12].copy_from_slice(&c.to_be_bytes());
        p
    }

    /// IPv4 fragment of `whole` (an unfragmented packet with a 20-byte header): payload bytes `from..to`.
    fn frag4(whole: &[u8], from: usize, to: usize, more: bool) -> Vec<u8> {
        let mut f = whole[..20].to_vec();
        f.extend_from_slice(&whole[20 + from..20 + to]);
        let total = f.len() as u16;
        f[2..4].copy_from_slice(&total.to_be_bytes());
        let fo = (if more { 0x2000 } else { 0 }) | (from / 8) as u16;
        f[6..8].copy_from_slice(&fo.to_be_bytes());
        f[10] = 0;
        f[11] = 0;
        let c = flexstack_wire::checksum::ipv4_header(&f[..20]);
        f[10..12].copy_from_slice(&c.to_be_bytes());
        f
    }

    /// Cuts `whole` (IPv4, 20-byte header) into fragments with `size` bytes of payload each.
    fn split4(whole: &[u8], size: usize) -> Vec<Vec<u8>> {
        let n = whole.len() - 20;
        (0..n).step_by(size).map(|from| frag4(whole, from, (from + size).min(n), from + size < n)).collect()
    }

    /// An IPv6 UDP datagram with a hop-by-hop header (unfragmentable part 48 bytes).
    fn udp6_datagram(len: usize) -> Vec<u8> {
        let data: Vec<u8> = (0..len).map(|i| (i * 31) as u8).collect();
        let mut payload = vec![proto::UDP, 0, 1, 4, 0, 0, 0, 0];
        payload.extend_from_slice(&build::udp(a6().into(), b6().into(), 7, 9, &data));
        build::ipv6(a6(), b6(), proto::HOP_BY_HOP, 64, &payload)
    }

    /// Fragments of `whole` (from [`udp6_datagram`]): each with the 48-byte unfragmentable part and a fragment
    /// header, `size` bytes of the fragmentable part each.
    fn split6(whole: &[u8], size: usize, id: u32) -> Vec<Vec<u8>> {
        let body = &whole[48..];
        (0..body.len())
            .step_by(size)
            .map(|from| {
                let to = (from + size).min(body.len());
                frag6(whole, from, to, to < body.len(), id)
            })
            .collect()
    }

    fn frag6(whole: &[u8], from: usize, to: usize, more: bool, id: u32) -> Vec<u8> {
        let body = &whole[48..];
        let mut f = whole[..48].to_vec();
        f[40] = proto::FRAGMENT; // the hop-by-hop header now names the fragment header
        let fo = (from as u16) | u16::from(more);
        f.extend_from_slice(&[whole[40], 0]);
        f.extend_from_slice(&fo.to_be_bytes());
        f.extend_from_slice(&id.to_be_bytes());
        f.extend_from_slice(&body[from..to]);
        let plen = (f.len() - 40) as u16;
        f[4..6].copy_from_slice(&plen.to_be_bytes());
        f
    }

    struct Stack {
        sw: Switch,
        out: Log,
    }

    use flexstack_core::Switch;

    impl Stack {
        fn new(args: &[&str]) -> Stack {
            let mut sw = Switch::default();
            let (o, out) = Recorder::load("o");
            sw.apply(vec![load("r", "reassemble", args), o, link("r -> o")]).unwrap();
            Stack { sw, out }
        }

        fn send(&mut self, at_ms: u64, packets: &[Vec<u8>]) {
            let refs: Vec<&[u8]> = packets.iter().map(|v| v.as_slice()).collect();
            inject(&mut self.sw, "r", &refs, Direction::Up);
            self.sw.run(Time::from_millis(at_ms));
        }

        fn out(&self) -> Vec<Vec<u8>> {
            std::mem::take(&mut *self.out.lock().unwrap()).into_iter().map(|s| s.data).collect()
        }

        fn meter(&self, name: &str) -> u64 {
            u64_var(&self.sw, &format!("module.r.{name}"))
        }

        /// Frames in = passed + reassembled fragments + pending + dropped, and the switch agrees on drops.
        fn check_accounting(&self) {
            let parse = flexstack_wire::packet::ParseError::ALL.map(|e| e.reason());
            let drops: u64 = ["overlap", "duplicate", "tiny", "too_big", "timeout", "memory"]
                .iter()
                .chain(parse.iter())
                .map(|r| self.meter(&format!("drop_{r}_total")))
                .sum();
            assert_eq!(drops, self.meter("frames_dropped_total"), "drop meters vs switch");
            assert_eq!(
                self.meter("frames_in_total"),
                self.meter("passed_total")
                    + self.meter("fragments_reassembled_total")
                    + self.meter("fragments_pending")
                    + drops,
                "every frame accounted for"
            );
            assert_eq!(
                self.meter("frames_out_total"),
                self.meter("passed_total") + self.meter("datagrams_reassembled_total")
            );
        }
    }

    #[test]
    fn in_order_and_out_of_order_v4() {
        let mut s = Stack::new(&[]);
        let whole = udp4_datagram(1, 3000);
        let frags = split4(&whole, 1480);
        assert_eq!(frags.len(), 3);
        s.send(1, &frags);
        assert_eq!(s.out(), vec![whole.clone()]);
        let mut rev = split4(&whole, 800);
        rev.reverse();
        rev.swap(1, 2);
        s.send(2, &rev[..2]);
        assert!(s.out().is_empty());
        assert_eq!(s.meter("datagrams_pending"), 1);
        assert_eq!(s.meter("fragments_pending"), 2);
        assert!(s.meter("bytes_pending") >= 3008);
        s.send(3, &rev[2..]);
        let out = s.out();
        assert_eq!(out, vec![whole.clone()]);
        assert_checksums(&out[0]);
        assert_eq!(s.meter("datagrams_reassembled_total"), 2);
        assert_eq!(s.meter("fragments_reassembled_total"), 3 + rev.len() as u64);
        assert_eq!((s.meter("datagrams_pending"), s.meter("fragments_pending"), s.meter("bytes_pending")), (0, 0, 0));
        // Non-fragments pass untouched.
        s.send(4, std::slice::from_ref(&whole));
        assert_eq!(s.out(), vec![whole]);
        s.check_accounting();
    }

    #[test]
    fn in_order_and_out_of_order_v6() {
        let mut s = Stack::new(&[]);
        let whole = udp6_datagram(2500);
        let frags = split6(&whole, 1232, 77);
        assert_eq!(frags.len(), 3);
        for f in &frags {
            assert!(PacketInfo::parse(f).unwrap().fragment.is_some());
        }
        s.send(1, &frags);
        let out = s.out();
        assert_eq!(out, vec![whole.clone()]);
        assert_checksums(&out[0]);
        let mut shuffled = split6(&whole, 504, 78);
        shuffled.rotate_left(2);
        s.send(2, &shuffled);
        assert_eq!(s.out(), vec![whole]);
        s.check_accounting();
    }

    #[test]
    fn fragment_header_right_after_the_fixed_header() {
        let mut s = Stack::new(&[]);
        let data = [5u8; 100];
        let u = build::udp(a6().into(), b6().into(), 1, 2, &data);
        let whole = build::ipv6(a6(), b6(), proto::UDP, 64, &u);
        let mk = |from: usize, to: usize, more: bool| {
            let mut f = vec![proto::UDP, 0];
            f.extend_from_slice(&((from as u16) | u16::from(more)).to_be_bytes());
            f.extend_from_slice(&9u32.to_be_bytes());
            f.extend_from_slice(&u[from..to]);
            build::ipv6(a6(), b6(), proto::FRAGMENT, 64, &f)
        };
        s.send(1, &[mk(56, 108, false), mk(0, 56, true)]);
        assert_eq!(s.out(), vec![whole]);
    }

    #[test]
    fn overlap_discards_the_whole_datagram_and_later_fragments() {
        let mut s = Stack::new(&[]);
        let whole = udp4_datagram(3, 64);
        let first = frag4(&whole, 0, 32, true);
        let overlapping = frag4(&whole, 24, 48, true);
        let last = frag4(&whole, 32, whole.len() - 20, false);
        s.send(1, &[first.clone(), overlapping]);
        assert_eq!(s.meter("drop_overlap_total"), 2, "the held fragment and the overlapping one");
        s.send(2, &[last.clone(), first.clone()]);
        assert!(s.out().is_empty(), "a tombstone keeps later fragments out");
        assert_eq!(s.meter("drop_overlap_total"), 4);
        assert_eq!(s.meter("datagrams_pending"), 0);
        s.check_accounting();
        // After the timeout, the key is free again.
        s.sw.run(Time::from_millis(30_002));
        s.send(30_003, &[first, last]);
        assert_eq!(s.out(), vec![whole.clone()]);
        // IPv6: an overlap too, and a fragment beyond the end set by the last one.
        let w6 = udp6_datagram(200);
        s.send(30_004, &[frag6(&w6, 0, 64, true, 5), frag6(&w6, 56, 120, true, 5)]);
        s.send(30_005, &[frag6(&w6, 64, 128, false, 6), frag6(&w6, 128, 136, true, 6), frag6(&w6, 0, 64, true, 6)]);
        assert!(s.out().is_empty());
        assert_eq!(s.meter("drop_overlap_total"), 4 + 2 + 3);
        s.check_accounting();
    }

    #[test]
    fn exact_duplicates_drop_only_themselves() {
        let mut s = Stack::new(&[]);
        let whole = udp4_datagram(4, 100);
        let frags = split4(&whole, 40);
        s.send(1, &[frags[0].clone(), frags[0].clone(), frags[1].clone(), frags[1].clone()]);
        assert_eq!(s.meter("drop_duplicate_total"), 2);
        s.send(2, &[frags[2].clone()]);
        assert_eq!(s.out(), vec![whole.clone()]);
        // A fragment at the same place with different bytes is an overlap.
        let mut other = frags[0].clone();
        other[30] ^= 1;
        s.send(3, &[frags[0].clone(), other]);
        assert_eq!(s.meter("drop_overlap_total"), 2);
        s.check_accounting();
    }

    #[test]
    fn tiny_fragments_are_dropped() {
        let mut s = Stack::new(&[]);
        let whole = udp4_datagram(5, 100);
        let short_first = frag4(&whole, 0, 4, true);
        let odd = frag4(&whole, 0, 20, true);
        let mut tcp = build::ipv4(A4, B4, proto::TCP, 64, &[0u8; 40]);
        tcp[6] = 0;
        let tcp_at_8 = frag4(&tcp, 8, 16, true);
        let w6 = udp6_datagram(100);
        s.send(1, &[short_first, odd, tcp_at_8, frag6(&w6, 0, 12, true, 1)]);
        assert_eq!(s.meter("drop_tiny_total"), 4);
        assert_eq!(s.meter("datagrams_pending"), 0);
        s.check_accounting();
    }

    #[test]
    fn timeout_expires_datagrams_and_counts_their_fragments() {
        let mut s = Stack::new(&["timeout_ms=1000"]);
        let whole = udp4_datagram(6, 3000);
        let frags = split4(&whole, 1000);
        s.send(10, &frags[..2]);
        assert_eq!(s.sw.next_wakeup(), Some(Time::from_millis(1010)));
        s.sw.run(Time::from_millis(1009));
        assert_eq!(s.meter("fragments_pending"), 2);
        s.sw.run(Time::from_millis(1010));
        assert_eq!(s.meter("drop_timeout_total"), 2);
        assert_eq!((s.meter("datagrams_pending"), s.meter("fragments_pending"), s.meter("bytes_pending")), (0, 0, 0));
        assert_eq!(s.meter("frames_dropped_total"), 2);
        s.send(1011, &frags[2..3]);
        assert_eq!(s.meter("fragments_pending"), 1, "the rest starts a new datagram");
        s.check_accounting();
    }

    #[test]
    fn too_big_datagrams_are_dropped() {
        let mut s = Stack::new(&[]);
        let whole = udp4_datagram(7, 100);
        // A last fragment ending beyond 65535 bytes.
        let mut far = frag4(&whole, 0, 16, false);
        let fo = (65528 / 8) as u16;
        far[6..8].copy_from_slice(&fo.to_be_bytes());
        far[10] = 0;
        far[11] = 0;
        let c = flexstack_wire::checksum::ipv4_header(&far[..20]);
        far[10..12].copy_from_slice(&c.to_be_bytes());
        s.send(1, &[frag4(&whole, 0, 16, true), far, frag4(&whole, 16, 32, true)]);
        assert_eq!(s.meter("drop_too_big_total"), 3, "held, offending, and later fragments");
        // IPv6: the unfragmentable part counts in the payload length.
        let w6 = udp6_datagram(100);
        let mut f = frag6(&w6, 0, 8, false, 3);
        f[50..52].copy_from_slice(&65528u16.to_be_bytes());
        s.send(2, &[f]);
        assert_eq!(s.meter("drop_too_big_total"), 4);
        assert!(s.out().is_empty());
        s.check_accounting();
    }

    #[test]
    fn memory_is_bounded_by_max_datagrams() {
        let mut s = Stack::new(&["max_datagrams=4"]);
        let wholes: Vec<Vec<u8>> = (0..6).map(|id| udp4_datagram(100 + id, 200)).collect();
        let firsts: Vec<Vec<u8>> = wholes.iter().map(|w| frag4(w, 0, 80, true)).collect();
        s.send(1, &firsts);
        assert_eq!(s.meter("datagrams_pending"), 4);
        assert_eq!(s.meter("drop_memory_total"), 2, "the two oldest made room");
        // The newest four complete; the oldest two's rest starts new datagrams.
        let rests: Vec<Vec<u8>> = wholes.iter().map(|w| frag4(w, 80, w.len() - 20, false)).collect();
        s.send(2, &rests[2..]);
        assert_eq!(s.out().len(), 4);
        s.check_accounting();
    }

    #[test]
    fn memory_is_bounded_by_max_bytes() {
        let mut s = Stack::new(&["max_bytes=100000"]);
        let wholes: Vec<Vec<u8>> = (0..3).map(|id| udp4_datagram(200 + id, 40000)).collect();
        // Five of the six fragments of each: buffers of 64 KB (doubling) do not fit twice in 100 000 bytes.
        for (i, w) in wholes.iter().enumerate() {
            s.send(1 + i as u64, &split4(w, 8000)[..5]);
            assert!(s.meter("bytes_pending") <= 100_000);
        }
        let evicted = s.meter("drop_memory_total");
        assert!(evicted > 0 && evicted.is_multiple_of(5), "whole datagrams evicted: {evicted}");
        assert_eq!(s.meter("datagrams_pending") + evicted / 5, 3);
        assert_eq!(s.meter("fragments_pending"), 5 * s.meter("datagrams_pending"));
        s.check_accounting();
        // A datagram bigger than max_bytes on its own is dropped, fragment by fragment.
        let mut s = Stack::new(&["max_bytes=10000"]);
        s.send(1, &split4(&wholes[0], 8000));
        assert!(s.out().is_empty());
        assert_eq!(s.meter("drop_memory_total"), 6);
        assert_eq!(s.meter("fragments_pending"), 0);
        s.check_accounting();
    }

    #[test]
    fn fragment_flood_keeps_memory_bounded() {
        let mut s = Stack::new(&["max_datagrams=64", "max_bytes=262144"]);
        let mut t = 1;
        for round in 0..20u32 {
            let flood: Vec<Vec<u8>> = (0..500u32)
                .map(|i| {
                    let id = (round * 500 + i) as u16;
                    let w = udp4_datagram(id, 1400 + (i as usize % 7) * 8);
                    // A middle fragment, far into the datagram: the buffer must reach that far.
                    frag4(&w, 800, 1200, true)
                })
                .collect();
            s.send(t, &flood);
            t += 1;
            assert!(s.meter("datagrams_pending") <= 64);
            assert!(s.meter("bytes_pending") <= 262_144);
            assert!(s.meter("bytes_spare") <= 262_144 / 4);
        }
        assert_eq!(s.meter("fragments_total"), 10_000);
        assert_eq!(s.meter("drop_memory_total"), 10_000 - 64);
        // A legitimate datagram still gets through during the flood.
        let whole = udp4_datagram(60_000, 3000);
        s.send(t, &split4(&whole, 1480));
        assert_eq!(s.out(), vec![whole]);
        s.check_accounting();
        // Lowering the limits at runtime evicts at once.
        s.sw.apply(vec![knob("r", "max_datagrams", Value::U64(8))]).unwrap();
        s.sw.run(Time::from_millis(t + 1));
        assert_eq!(s.meter("datagrams_pending"), 8);
        s.check_accounting();
    }

    #[test]
    fn ip_fragmentation_round_trips_through_reassembly() {
        let mut sw = Switch::default();
        let (o, out) = Recorder::load("o");
        sw.apply(vec![
            load("ip", "ip", &["mtu=576", "decrement_ttl=false"]),
            load("r", "reassemble", &[]),
            o,
            link("ip[out] -> r"),
            link("r -> o"),
        ])
        .unwrap();
        let mut originals = Vec::new();
        for (i, len) in [100usize, 548, 549, 1000, 1472, 9000, 65_000].into_iter().enumerate() {
            originals.push(udp4_datagram(i as u16, len));
        }
        // With options: a copied option (0x82) and a record route, which later fragments do not carry.
        let mut opt = udp4_datagram(99, 2000);
        opt.splice(20..20, [0x82, 4, 1, 2, 7, 7, 4, 0, 0, 0, 0, 0]);
        opt[0] = 0x48;
        let total = opt.len() as u16;
        opt[2..4].copy_from_slice(&total.to_be_bytes());
        opt[10] = 0;
        opt[11] = 0;
        let c = flexstack_wire::checksum::ipv4_header(&opt[..32]);
        opt[10..12].copy_from_slice(&c.to_be_bytes());
        originals.push(opt);
        let refs: Vec<&[u8]> = originals.iter().map(|v| v.as_slice()).collect();
        inject(&mut sw, "ip", &refs, Direction::Down);
        sw.run(Time::from_millis(1));
        let got: Vec<Vec<u8>> = out.lock().unwrap().iter().map(|s| s.data.clone()).collect();
        assert_eq!(got, originals);
        assert!(u64_var(&sw, "module.ip.fragments_made_total") > 100);
        assert_eq!(u64_var(&sw, "module.r.datagrams_reassembled_total"), 6);
    }

    #[test]
    fn replace_keeps_datagrams_in_progress() {
        let mut s = Stack::new(&[]);
        let whole = udp4_datagram(8, 3000);
        let frags = split4(&whole, 1000);
        s.send(1, &frags[..2]);
        let args = vec!["timeout_ms=5000".to_string(), "max_datagrams=2".to_string()];
        let settings = Settings::from_args(&args).unwrap();
        let builder = catalog().configure("reassemble", &settings, None).unwrap();
        let notes =
            s.sw.apply(vec![Edit::Replace {
                name: "r".into(),
                kind: "reassemble".into(),
                settings,
                builder,
                keep_state: true,
            }])
            .unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(s.meter("fragments_pending"), 2);
        assert_eq!(s.meter("datagrams_pending"), 1);
        s.send(2, &frags[2..]);
        assert_eq!(s.out(), vec![whole]);
        // The new module's timeout applies.
        s.send(3, &frags[..1]);
        s.sw.run(Time::from_millis(5002));
        assert_eq!(s.meter("fragments_pending"), 1);
        s.sw.run(Time::from_millis(5003));
        assert_eq!(s.meter("drop_timeout_total"), 1);
    }

    #[test]
    fn settings_are_checked() {
        assert_config_error("[modules.r]\nkind = \"reassemble\"\nmax_datagrams = 0\n", Some(3), &[]);
        assert_config_error(
            "[modules.r]\nkind = \"reassemble\"\n\ntimeout = 5\n",
            None,
            &["max_bytes, max_datagrams, timeout_ms"],
        );
        let s = Stack::new(&["timeout_ms=500", "max_bytes=70000"]);
        assert_eq!(s.meter("timeout_ms"), 500);
        assert_eq!(s.meter("max_bytes"), 70_000);
    }
}
