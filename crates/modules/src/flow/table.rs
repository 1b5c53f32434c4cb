//! The flow table's building blocks, shared by the kinds that keep per-flow state: `classify` (its flow table),
//! `nat` (its binding table) and the late-binding scheduler (its flows).
//!
//! - [`Slab`]: entries with stable indices that timers (or a flow's queue) can refer to, holes reused.
//! - [`FlowIndex`]: from a key's hash to its entry's slot, with the first bucket of a lookup known from the hash
//!   alone, so that a batch's lookups can be prefetched before any is made.
//! - [`Timers`]: idle timers over such entries, a heap that is touched only when a timer is due; each entry keeps
//!   its [`Idle`] state, and [`Timers::expire`] takes out the entries whose time has come.
//! - [`Timeouts`]: the idle timeouts by protocol, with their knobs' declarations.
//! - [`TcpEnd`] and [`tcp_flags`]: what a TCP flow saw of its end (FINs, RST), which shortens its timeout.
//!
//! Packets are parsed with [`flexstack_wire::packet::PacketInfo`], and counted by drop reason with
//! [`flexstack_wire::packet::ParseDrops`].

use flexstack_core::decl::Access;
use flexstack_core::Param;
use flexstack_wire::packet::{proto, PacketInfo};
use std::cmp::Reverse;
use std::collections::hash_map::RandomState;
use std::collections::BinaryHeap;
use std::hash::{BuildHasher, Hash};

/// The idle timeouts of flows or bindings, by protocol, in ns; knobs and settings of the same names in ms.
/// `Default` is a blank to read them into: the defaults are declared in [`Timeouts::params`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Timeouts {
    ns: [u64; 5],
}

/// Lets [`Timeouts::params`] reach the timeouts of a kind's state `$state`, in its field `timeouts`.
macro_rules! timeouts_in_field {
    ($state:ty) => {
        impl AsRef<$crate::flow::table::Timeouts> for $state {
            fn as_ref(&self) -> &$crate::flow::table::Timeouts {
                &self.timeouts
            }
        }

        impl AsMut<$crate::flow::table::Timeouts> for $state {
            fn as_mut(&mut self) -> &mut $crate::flow::table::Timeouts {
                &mut self.timeouts
            }
        }
    };
}
pub(crate) use timeouts_in_field;

/// Timeout `I` of the state's timeouts, in ms.
fn ms<S: AsRef<Timeouts>, const I: usize>(s: &S) -> u64 {
    s.as_ref().ns[I] / 1_000_000
}

/// Sets timeout `I` of the state's timeouts to `ms`.
fn set_ms<S: AsMut<Timeouts>, const I: usize>(s: &mut S, ms: u64) {
    s.as_mut().ns[I] = ms * 1_000_000;
}

impl Timeouts {
    /// The timeout knobs of a kind whose state `S` holds its timeouts, in the order of `ns`.
    pub(crate) const fn params<S: AsRef<Timeouts> + AsMut<Timeouts>>() -> [Param<S>; 5] {
        [
            Self::knob("tcp_timeout_ms", "idle timeout of a TCP flow", 300_000, (ms::<S, 0>, set_ms::<S, 0>)),
            Self::knob(
                "tcp_closing_timeout_ms",
                "idle timeout of a TCP flow after a RST or a FIN from both sides",
                10_000,
                (ms::<S, 1>, set_ms::<S, 1>),
            ),
            Self::knob("udp_timeout_ms", "idle timeout of a UDP flow", 30_000, (ms::<S, 2>, set_ms::<S, 2>)),
            Self::knob("icmp_timeout_ms", "idle timeout of an ICMP/ICMPv6 flow", 10_000, (ms::<S, 3>, set_ms::<S, 3>)),
            Self::knob(
                "other_timeout_ms",
                "idle timeout of a flow of any other protocol",
                30_000,
                (ms::<S, 4>, set_ms::<S, 4>),
            ),
        ]
    }

    /// A timeout knob in ms, `1..=MAX_MS`.
    const fn knob<S>(name: &'static str, doc: &'static str, default_ms: u64, access: Access<S, u64>) -> Param<S> {
        Param::u64(name, "ms", doc, default_ms, access).range(1.0, Self::MAX_MS as f64)
    }

    const MAX_MS: u64 = 7 * 24 * 3_600_000;

    /// The timeout of a flow of `protocol`, in ns.
    pub(crate) fn of(&self, protocol: u8, closing: bool) -> u64 {
        match protocol {
            proto::TCP if closing => self.ns[1],
            proto::TCP => self.ns[0],
            proto::UDP => self.ns[2],
            proto::ICMP | proto::ICMPV6 => self.ns[3],
            _ => self.ns[4],
        }
    }
}

/// TCP flags: FIN, RST, and either (a segment that may end a flow).
const FIN: u8 = 0x01;
const RST: u8 = 0x04;
pub(crate) const FIN_OR_RST: u8 = FIN | RST;

/// What a TCP flow saw of its end: FINs from each side, a RST.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TcpEnd {
    fins: u8,
    rst: bool,
}

impl TcpEnd {
    /// Notes the flags of a segment (`from_first`: sent by the side that opened the flow); true when the flow
    /// has just become closing.
    pub(crate) fn see(&mut self, from_first: bool, flags: u8) -> bool {
        let before = self.closing();
        if flags & RST != 0 {
            self.rst = true;
        }
        if flags & FIN != 0 {
            self.fins |= if from_first { 1 } else { 2 };
        }
        !before && self.closing()
    }

    /// A RST was seen, or a FIN from both sides.
    pub(crate) fn closing(&self) -> bool {
        self.rst || self.fins == 3
    }
}

/// The TCP flags of a parsed packet, if it is a TCP segment with its header present.
pub(crate) fn tcp_flags(data: &[u8], info: &PacketInfo) -> Option<u8> {
    if info.protocol != proto::TCP || info.fragment.is_some_and(|f| f.offset != 0) {
        return None;
    }
    data.get(info.l4_offset + 13).copied()
}

/// What the idle timer of a table entry needs; every entry of a table with [`Timers`] keeps one ([`Expiring`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Idle {
    /// The entry's id: a timer set for an earlier entry in the same slot is stale.
    pub(crate) id: u64,
    /// Its protocol, which gives its timeout.
    pub(crate) protocol: u8,
    /// When it last saw a packet, ns, for the entries that keep it here ([`Expiring::last_seen`] reads it; an entry
    /// that keeps it elsewhere leaves it at its creation time).
    pub(crate) last_seen: u64,
    /// The deadline its live timer is set for, ns.
    pub(crate) queued: u64,
    /// What it saw of a TCP connection's end.
    pub(crate) tcp: TcpEnd,
}

impl Idle {
    /// A new entry `id` of `protocol` seen at `now` (ns): its timer is due after the protocol's timeout.
    pub(crate) fn new(id: u64, protocol: u8, now: u64, timeouts: &Timeouts) -> Idle {
        let queued = now.saturating_add(timeouts.of(protocol, false));
        Idle { id, protocol, last_seen: now, queued, tcp: TcpEnd::default() }
    }

    /// When the entry expires if it sees nothing more after `last_seen` (ns), ns.
    pub(crate) fn deadline(&self, last_seen: u64, timeouts: &Timeouts) -> u64 {
        last_seen.saturating_add(timeouts.of(self.protocol, self.tcp.closing()))
    }
}

/// An entry of a table with [`Timers`].
pub(crate) trait Expiring {
    /// The entry's idle state.
    fn idle(&mut self) -> &mut Idle;

    /// When the entry last saw a packet, ns: [`Idle::last_seen`] unless the entry keeps it elsewhere (`classify`
    /// keeps it in its flow's meter words only, so that a packet writes nothing in the flow's slot).
    fn last_seen(&mut self) -> u64 {
        self.idle().last_seen
    }
}

/// Entries expired in one call of [`Timers::expire`] at most; the rest wait for the next call (asked for at once).
pub(crate) const EXPIRE_BATCH: usize = 4096;

/// A vector of entries with reusable holes: stable indices for timers to refer to.
#[derive(Debug)]
pub(crate) struct Slab<T> {
    entries: Vec<Option<T>>,
    free: Vec<u32>,
    len: usize,
    /// Whether the caller chooses the indices ([`Slab::external`]).
    external: bool,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab { entries: Vec::new(), free: Vec::new(), len: 0, external: false }
    }
}

impl<T> Slab<T> {
    pub(crate) fn insert(&mut self, value: T) -> u32 {
        debug_assert!(!self.external, "insert on a slab whose indices the caller chooses");
        self.len += 1;
        match self.free.pop() {
            Some(i) => {
                self.entries[i as usize] = Some(value);
                i
            }
            None => {
                self.entries.push(Some(value));
                (self.entries.len() - 1) as u32
            }
        }
    }

    pub(crate) fn get(&self, i: u32) -> Option<&T> {
        self.entries.get(i as usize).and_then(Option::as_ref)
    }

    pub(crate) fn get_mut(&mut self, i: u32) -> Option<&mut T> {
        self.entries.get_mut(i as usize).and_then(Option::as_mut)
    }

    /// Puts `value` at index `i`, which the caller chose (`classify`: its flow's arena slot) and which is empty: a
    /// slab filled this way only, never by [`Slab::insert`], keeps no free list ([`Slab::external`]).
    pub(crate) fn insert_at(&mut self, i: u32, value: T) {
        debug_assert!(self.external, "insert_at on a slab that picks its own indices");
        let i = i as usize;
        if i >= self.entries.len() {
            self.entries.resize_with(i + 1, || None);
        }
        debug_assert!(self.entries[i].is_none(), "slot {i} is taken");
        if self.entries[i].replace(value).is_none() {
            self.len += 1;
        }
    }

    /// A slab whose indices the caller chooses ([`Slab::insert_at`]).
    pub(crate) fn external() -> Self {
        Slab { external: true, ..Slab::default() }
    }

    pub(crate) fn remove(&mut self, i: u32) -> Option<T> {
        let v = self.entries.get_mut(i as usize)?.take()?;
        if !self.external {
            self.free.push(i);
        }
        self.len -= 1;
        Some(v)
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The addresses of the first and last byte of slot `i` (`None` past the end), computed without reading it:
    /// for prefetching, which the late-binding scheduler does for its queue nodes.
    pub(crate) fn span(&self, i: u32) -> Option<(usize, usize)> {
        let at = self.entries.as_ptr().wrapping_add(i as usize) as usize;
        ((i as usize) < self.entries.len()).then(|| (at, at + std::mem::size_of::<Option<T>>() - 1))
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &T)> {
        self.entries.iter().enumerate().filter_map(|(i, e)| e.as_ref().map(|e| (i as u32, e)))
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (u32, &mut T)> {
        self.entries.iter_mut().enumerate().filter_map(|(i, e)| e.as_mut().map(|e| (i as u32, e)))
    }
}

/// Idle timers: a min-heap of (deadline ns, slab index, id). An entry whose deadline is not the entry's current
/// `queued` deadline is stale and skipped; a due entry whose entry was seen since is pushed again at its new
/// deadline, so a busy entry costs no heap operation per packet.
#[derive(Debug, Default)]
pub(crate) struct Timers {
    heap: BinaryHeap<Reverse<(u64, u32, u64)>>,
}

/// The outcome of [`Timers::next_due`].
enum Due {
    /// This entry's timer is due: check it.
    Check(u32, u64, u64),
    /// Nothing is due before this time (ns).
    Next(Option<u64>),
}

impl Timers {
    fn push(&mut self, deadline: u64, slot: u32, id: u64) {
        self.heap.push(Reverse((deadline, slot, id)));
    }

    /// Takes the next entry due at `now`, or says when the next one is due.
    fn next_due(&mut self, now: u64) -> Due {
        match self.heap.peek() {
            Some(Reverse((d, _, _))) if *d <= now => {
                let Some(Reverse((d, s, id))) = self.heap.pop() else { return Due::Next(None) };
                Due::Check(s, id, d)
            }
            Some(Reverse((d, _, _))) => Due::Next(Some(*d)),
            None => Due::Next(None),
        }
    }

    pub(crate) fn clear(&mut self) {
        self.heap.clear();
    }

    /// Starts the timer of the new entry in `slot`, due at `idle.queued`.
    pub(crate) fn start(&mut self, slot: u32, idle: &Idle) {
        self.push(idle.queued, slot, idle.id);
    }

    /// Notes a packet of the entry in `slot` at `now` (ns) in `idle.last_seen`, then as [`Timers::seen_tcp`].
    pub(crate) fn seen(
        &mut self,
        slot: u32,
        idle: &mut Idle,
        now: u64,
        tcp: Option<(bool, u8)>,
        closing_ns: u64,
    ) -> Option<u64> {
        idle.last_seen = now;
        self.seen_tcp(slot, idle, now, tcp, closing_ns)
    }

    /// Notes a packet of the entry in `slot` at `now` (ns) for an entry that keeps its last-seen time elsewhere
    /// ([`Expiring::last_seen`]); `tcp` is, for a TCP segment, whether the side that opened the entry sent it and its
    /// flags. `idle` is written only when the segment changes what the entry saw of its end (FIN, RST). When the
    /// segment makes the entry closing and `closing_ns` from now comes before its timer, the timer is brought
    /// forward: returns the new deadline, for the module to wake then.
    pub(crate) fn seen_tcp(
        &mut self,
        slot: u32,
        idle: &mut Idle,
        now: u64,
        tcp: Option<(bool, u8)>,
        closing_ns: u64,
    ) -> Option<u64> {
        let (from_first, flags) = tcp?;
        // Neither FIN nor RST: nothing changes (and `idle`, which may lie in a line the packet does not otherwise
        // read, is not read).
        if flags & FIN_OR_RST == 0 || !idle.tcp.see(from_first, flags) {
            return None;
        }
        let d = now.saturating_add(closing_ns);
        if d >= idle.queued {
            return None;
        }
        idle.queued = d;
        self.push(d, slot, idle.id);
        Some(d)
    }

    /// Puts every entry's timer at its current deadline (after a timeout changed, or a table was adopted).
    pub(crate) fn rearm<T: Expiring>(&mut self, entries: &mut Slab<T>, timeouts: &Timeouts) {
        self.clear();
        for (slot, e) in entries.iter_mut() {
            let last_seen = e.last_seen();
            let idle = e.idle();
            idle.queued = idle.deadline(last_seen, timeouts);
            self.start(slot, idle);
        }
    }

    /// Removes the entries whose deadline has come at `now` (ns), at most [`EXPIRE_BATCH`], handing each to
    /// `gone` with its slot. An entry seen since its timer was set gets a timer at its new deadline; timers of
    /// entries gone or re-armed are skipped. Returns when to call again: `now` when the batch was full, else when
    /// the next timer is due.
    pub(crate) fn expire<T: Expiring>(
        &mut self,
        entries: &mut Slab<T>,
        timeouts: &Timeouts,
        now: u64,
        mut gone: impl FnMut(u32, T),
    ) -> Option<u64> {
        let mut expired = 0;
        while expired < EXPIRE_BATCH {
            match self.next_due(now) {
                Due::Next(t) => return t,
                Due::Check(slot, id, at) => {
                    let Some(e) = entries.get_mut(slot) else { continue };
                    let last_seen = e.last_seen();
                    let idle = e.idle();
                    if idle.id != id || idle.queued != at {
                        continue; // stale
                    }
                    let d = idle.deadline(last_seen, timeouts);
                    if d > now {
                        idle.queued = d;
                        self.push(d, slot, id);
                    } else if let Some(e) = entries.remove(slot) {
                        gone(slot, e);
                        expired += 1;
                    }
                }
            }
        }
        Some(now)
    }
}

/// An index from keys to the slots of their entries: open addressing with linear probing over 8-byte buckets, each
/// holding the high 32 bits of the key's hash (which also give its first bucket) and its slot + 1 (0: empty).
/// Keys stay in the entries; a lookup compares the key of each bucket whose hash bits match. The hash is keyed at
/// random per index (SipHash), so a sender cannot aim keys at one bucket. At most half the buckets are used;
/// removal shifts the following buckets back (no tombstones), so a long-lived table does not degrade. From
/// [`HUGE_BUCKETS`] buckets up they are on transparent huge pages ([`Buckets`]).
#[derive(Debug)]
pub(crate) struct FlowIndex {
    buckets: Buckets,
    len: usize,
    hasher: RandomState,
}

impl Default for FlowIndex {
    fn default() -> Self {
        FlowIndex { buckets: Buckets::Heap(Vec::new()), len: 0, hasher: RandomState::new() }
    }
}

/// Buckets from which an index's are on huge pages (512 KiB: the index of 65,536 entries or more), which then cost
/// one TLB entry per 2 MiB: a lookup's bucket is at random. Below, on the heap (a huge page would be mostly empty).
const HUGE_BUCKETS: usize = 1 << 16;

/// An index's buckets, all zero at first.
#[derive(Debug)]
enum Buckets {
    Heap(Vec<u64>),
    /// The first `.1` words of a mapping on huge pages.
    Huge(flexstack_sys::HugeBuf, usize),
}

impl Buckets {
    fn zeroed(n: usize) -> Buckets {
        if n >= HUGE_BUCKETS {
            // Without the mapping (the kernel refused), the heap: the same buckets, on small pages.
            if let Ok(b) = flexstack_sys::HugeBuf::new(n) {
                return Buckets::Huge(b, n);
            }
        }
        Buckets::Heap(vec![0; n])
    }
}

impl std::ops::Deref for Buckets {
    type Target = [u64];

    #[inline]
    fn deref(&self) -> &[u64] {
        match self {
            Buckets::Heap(v) => v,
            Buckets::Huge(b, n) => &b[..*n],
        }
    }
}

impl std::ops::DerefMut for Buckets {
    #[inline]
    fn deref_mut(&mut self) -> &mut [u64] {
        match self {
            Buckets::Heap(v) => v,
            Buckets::Huge(b, n) => &mut b[..*n],
        }
    }
}

impl FlowIndex {
    /// The hash of `key`, which every other call takes.
    pub(crate) fn hash<K: Hash>(&self, key: &K) -> u64 {
        self.hasher.hash_one(key)
    }

    fn home(&self, hash: u64) -> usize {
        (hash >> 32) as usize & (self.buckets.len() - 1)
    }

    /// Starts loading the bucket where the lookup of `hash` begins into the cache.
    pub(crate) fn prefetch(&self, hash: u64) {
        if !self.buckets.is_empty() {
            flexstack_sys::prefetch(self.buckets.as_ptr().wrapping_add(self.home(hash)) as usize);
        }
    }

    /// The slot of the first bucket of `hash`'s probe whose hash bits match: the likely entry, to prefetch.
    pub(crate) fn candidate(&self, hash: u64) -> Option<u32> {
        self.find(hash, |_| true)
    }

    /// The slot of the entry of `hash` that `is` accepts (it compares the entry's key).
    pub(crate) fn find(&self, hash: u64, mut is: impl FnMut(u32) -> bool) -> Option<u32> {
        if self.buckets.is_empty() {
            return None;
        }
        let (tag, mask) = (hash >> 32, self.buckets.len() - 1);
        let mut i = self.home(hash);
        loop {
            let b = self.buckets[i];
            if b == 0 {
                return None;
            }
            if b >> 32 == tag && is((b as u32) - 1) {
                return Some((b as u32) - 1);
            }
            i = (i + 1) & mask;
        }
    }

    /// Adds `slot` under `hash` (the caller knows the key is not there yet).
    pub(crate) fn insert(&mut self, hash: u64, slot: u32) {
        if (self.len + 1) * 2 > self.buckets.len() {
            self.grow();
        }
        self.place((hash >> 32) << 32 | (u64::from(slot) + 1));
        self.len += 1;
    }

    fn place(&mut self, bucket: u64) {
        let mask = self.buckets.len() - 1;
        let mut i = self.home(bucket);
        while self.buckets[i] != 0 {
            i = (i + 1) & mask;
        }
        self.buckets[i] = bucket;
    }

    fn grow(&mut self) {
        let size = (self.buckets.len() * 2).max(16);
        let old = std::mem::replace(&mut self.buckets, Buckets::zeroed(size));
        for &b in old.iter().filter(|&&b| b != 0) {
            self.place(b);
        }
    }

    /// Removes `slot`, indexed under `hash`; false if it was not there.
    pub(crate) fn remove(&mut self, hash: u64, slot: u32) -> bool {
        if self.buckets.is_empty() {
            return false;
        }
        let want = (hash >> 32) << 32 | (u64::from(slot) + 1);
        let mask = self.buckets.len() - 1;
        let mut i = self.home(hash);
        loop {
            match self.buckets[i] {
                0 => return false,
                b if b == want => break,
                _ => i = (i + 1) & mask,
            }
        }
        // Shift back each following bucket of the run whose first bucket is not between the hole and it.
        self.buckets[i] = 0;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let b = self.buckets[j];
            if b == 0 {
                break;
            }
            let k = self.home(b);
            let stays = if i <= j { i < k && k <= j } else { i < k || k <= j };
            if !stays {
                self.buckets[i] = b;
                self.buckets[j] = 0;
                i = j;
            }
        }
        self.len -= 1;
        true
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod index_tests {
    use super::FlowIndex;
    use std::collections::HashMap;

    /// Inserts and removes keys in a pseudo-random order (with hashes forced into few buckets, so that runs wrap
    /// and removals shift), checking every lookup against a HashMap.
    #[test]
    fn agrees_with_a_hash_map_through_inserts_and_removals() {
        let mut index = FlowIndex::default();
        let mut model: HashMap<u32, u64> = HashMap::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for step in 0..20_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = (x % 512) as u32;
            // Few distinct first buckets: the high bits take 8 values, the low bits keep keys apart.
            let hash = ((x % 8) << 61) | u64::from(key) << 32 >> 32;
            let hash = model.get(&key).copied().unwrap_or(hash);
            match index.find(hash, |s| s == key) {
                Some(s) => {
                    assert_eq!(model.get(&key), Some(&hash), "step {step}: found {s} not in the model");
                    assert!(index.remove(hash, key), "step {step}");
                    model.remove(&key);
                }
                None => {
                    assert!(!model.contains_key(&key), "step {step}: lost key {key}");
                    index.insert(hash, key);
                    model.insert(key, hash);
                }
            }
            assert_eq!(index.len(), model.len());
        }
        for (&key, &hash) in &model {
            assert_eq!(index.find(hash, |s| s == key), Some(key));
        }
        assert!(!index.remove(0, 999_999));
    }

    /// Grown past [`super::HUGE_BUCKETS`], the buckets move to huge pages with every entry found again there.
    #[test]
    fn a_large_index_moves_to_huge_pages_whole() {
        let mut index = FlowIndex::default();
        let n = super::HUGE_BUCKETS as u32;
        let hash = |k: u32| u64::from(k).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for k in 0..n {
            index.insert(hash(k), k);
        }
        assert!(matches!(index.buckets, super::Buckets::Huge(..)), "{} buckets", index.buckets.len());
        assert_eq!(index.buckets.len(), 2 * super::HUGE_BUCKETS);
        assert!((0..n).all(|k| index.find(hash(k), |s| s == k) == Some(k)));
        assert!((0..n).step_by(2).all(|k| index.remove(hash(k), k)));
        assert!((0..n).all(|k| index.find(hash(k), |s| s == k).is_some() == (k % 2 == 1)));
    }
}
