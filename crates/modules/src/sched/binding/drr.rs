//! Fair queueing above the binding point (late binding): the flows and their index, the queue nodes their packets
//! wait in, and deficit round robin with interleaved rounds over the flows of each class.

use super::{prefetch, Binding, Class, Iface, Policy};
use crate::flow::table::Slab;
use flexstack_core::{Meter, Packet, Time};
use flexstack_wire::rewrite::Layout;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

/// No node: the end of a flow's queue.
pub(crate) const NIL: u32 = u32::MAX;
/// The link of a node that is last in its flow.
const NO_LINK: u64 = (NIL as u64) << 32;

/// splitmix64's finalizer: a cheap, well-mixing hash of a 64-bit word.
pub(crate) fn mix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The hasher of the flow index: its keys are u64 flow keys, hashed by [`mix64`] (std's SipHash cost about 45
/// instructions a lookup, and needs no protection here: flow ids come from `classify`, 5-tuple keys are already
/// SipHash values).
#[derive(Default)]
pub(crate) struct FlowKeyHasher(u64);

impl Hasher for FlowKeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = mix64(self.0 ^ u64::from(*b));
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = mix64(self.0 ^ x);
    }
}

/// A map keyed by flow key.
pub(crate) type FlowMap<V> = HashMap<u64, V, BuildHasherDefault<FlowKeyHasher>>;

pub(crate) struct FlowVars {
    pub(super) class: Meter,
    pub(super) iface: Meter,
    pub(super) queued: Meter,
    pub(super) delay: Meter,
}

/// A packet of a flow waiting above the binding point (late binding): a node of the queue arena shared by all
/// flows ([`Nodes`], which links it to the flow's next packet). Its length is kept here, so deciding whether it may
/// go does not read the packet.
pub(crate) struct Node {
    pub(super) pkt: Packet,
    /// Address of the packet's first byte, for [`prefetch`] only (never dereferenced; stale if the packet is
    /// copied on write at binding, which makes the hint useless, not wrong).
    pub(super) data: usize,
    pub(super) hdr: Layout,
    pub(super) at: Time,
    pub(super) len: u32,
}

/// The queue nodes of all flows: a [`Slab`], with the links between a flow's nodes kept apart.
#[derive(Default)]
pub(crate) struct Nodes {
    entries: Slab<Node>,
    /// Per entry, the next node of its flow and that node's length (`next << 32 | len`): apart from the nodes,
    /// so that linking a packet behind its flow's last one writes 8 bytes in a small array.
    links: Vec<u64>,
}

impl Nodes {
    /// Stores `node`, last of its flow (no link yet); returns its index.
    pub(super) fn insert(&mut self, node: Node) -> u32 {
        let i = self.entries.insert(node);
        match self.links.get_mut(i as usize) {
            Some(l) => *l = NO_LINK,
            None => self.links.push(NO_LINK),
        }
        i
    }

    /// Node `i`, if it holds one.
    pub(super) fn get(&self, i: u32) -> Option<&Node> {
        self.entries.get(i)
    }

    /// Takes node `i` out; its index is reused by the next insert.
    pub(super) fn remove(&mut self, i: u32) -> Option<Node> {
        self.entries.remove(i)
    }

    /// The node after `i` in its flow ([`NIL`]: none) and that node's packet length.
    pub(super) fn next_of(&self, i: u32) -> (u32, u32) {
        let l = self.links.get(i as usize).copied().unwrap_or(NO_LINK);
        ((l >> 32) as u32, l as u32)
    }

    /// Links `next` (of `len` bytes) behind `i`.
    pub(super) fn link(&mut self, i: u32, next: u32, len: u32) {
        if let Some(l) = self.links.get_mut(i as usize) {
            *l = (u64::from(next) << 32) | u64::from(len);
        }
    }

    /// Hints the CPU to load node `i`'s link.
    pub(super) fn prefetch_link(&self, i: u32) {
        if (i as usize) < self.links.len() {
            prefetch(self.links.as_ptr().wrapping_add(i as usize) as usize);
        }
    }

    /// Hints the CPU to load node `i`, both cache lines it may straddle (an index past the end is ignored).
    pub(super) fn prefetch(&self, i: u32) {
        if let Some((first, last)) = self.entries.span(i) {
            prefetch(first);
            prefetch(last);
        }
    }
}

/// What the scheduler reads and writes per packet of a flow, in one cache line: with 10,000 flows queued the
/// flows no longer fit in the nearer caches, and each extra line a packet touches is a miss.
#[repr(align(64))]
pub(crate) struct Flow {
    /// First and last node of the flow's queue in the arena ([`NIL`]: empty).
    pub(super) head: u32,
    pub(super) tail: u32,
    /// Length of the head packet.
    pub(super) head_len: u32,
    /// Packets of the flow in the queue (late) or in a FIFO (early).
    pub(super) pending: u32,
    pub(super) deficit: u64,
    pub(super) hash: u64,
    pub(super) last_seen: Time,
    /// How long the flow's last bound packet waited, ns (published as `queue_delay_ns`).
    pub(super) delay_ns: u64,
    pub(super) class: Class,
    pub(super) active: bool,
    /// In [`Binding::dirty`]: its meters are written at the next publication.
    pub(super) dirty: bool,
    pub(super) pinned: Option<u8>,
    pub(super) last_iface: Option<u8>,
    /// The flow gets its `quantum` at its next visit: it has not had the current round's yet ([`Rounds`]).
    pub(super) quantum_due: bool,
    pub(super) cold: Box<FlowCold>,
}

impl Flow {
    /// At a visit by deficit round robin: adds the round's quantum if it is due; whether the deficit now covers
    /// the head packet.
    pub(super) fn covers_head(&mut self, quantum: u64) -> bool {
        if std::mem::take(&mut self.quantum_due) {
            self.deficit += quantum;
        }
        self.deficit >= u64::from(self.head_len)
    }

    /// Whether a visit now would let the flow send its head packet (as [`Flow::covers_head`], without the visit).
    pub(super) fn would_cover_head(&self, quantum: u64) -> bool {
        let due = if self.quantum_due { quantum } else { 0 };
        self.deficit + due >= u64::from(self.head_len)
    }

    /// The flow's queue is now empty: it leaves the round robin with no deficit.
    fn leave_rounds(&mut self) {
        self.tail = NIL;
        self.deficit = 0;
        self.active = false;
        self.quantum_due = true;
    }
}

/// The flows of one class with packets queued, in deficit-round-robin order, interleaved: a round gives every
/// flow one `quantum` of bytes, as classic DRR does, but a flow sends one packet per visit and then goes to the back
/// of the round while its deficit covers its next packet, so that within a round the flows take turns packet by
/// packet instead of each sending its whole quantum at once. A round sends the same packets as classic DRR's (so
/// the same byte shares, within one packet of fair), in an order closer to the one they arrived in when flows
/// arrive in turn; a flow sends two packets in a row only when the others have spent their round.
///
/// How it is called: [`Rounds::front`] is the flow to visit; after the visit the caller says where it goes:
/// [`Rounds::again`] (it sent and may send again this round), [`Rounds::later`] (its deficit does not cover its
/// head packet: it waits for the next round's quantum), [`Rounds::remove_front`] (it is empty) or
/// [`Rounds::pass_over`] (its interface has no room: it keeps its deficit and place in the round).
#[derive(Default)]
pub(crate) struct Rounds {
    /// The current round's flows still to visit, in turn.
    current: VecDeque<u32>,
    /// The flows done with the current round, in the order they finished it: the next round.
    next: VecDeque<u32>,
}

impl Rounds {
    pub(super) fn is_empty(&self) -> bool {
        self.current.is_empty() && self.next.is_empty()
    }

    pub(super) fn len(&self) -> usize {
        self.current.len() + self.next.len()
    }

    /// The flow to visit next; when the current round has no flow left, the next round begins.
    pub(super) fn front(&mut self) -> Option<u32> {
        if self.current.is_empty() {
            std::mem::swap(&mut self.current, &mut self.next);
        }
        self.current.front().copied()
    }

    /// The flows in the order they will be visited (as far as it is known now).
    pub(super) fn iter(&self) -> impl Iterator<Item = &u32> {
        self.current.iter().chain(self.next.iter())
    }

    /// A flow that has just become active joins the current round, last.
    pub(super) fn push(&mut self, slot: u32) {
        self.current.push_back(slot);
    }

    /// The front flow goes to the back of the current round.
    pub(super) fn again(&mut self) {
        if let Some(slot) = self.current.pop_front() {
            self.current.push_back(slot);
        }
    }

    /// The front flow is done with the current round (see [`wait_next_round`]).
    pub(super) fn later(&mut self) {
        if let Some(slot) = self.current.pop_front() {
            self.next.push_back(slot);
        }
    }

    /// The front flow leaves (its queue is empty).
    pub(super) fn remove_front(&mut self) {
        self.current.pop_front();
    }

    /// The front flow could not send (its interface is full): it is passed over, to the back of the current round;
    /// returns whether every flow of the current round has now been passed over once since `passed` counted 0
    /// (`passed` counts the pass-overs). Then the flows of the next round are visited before them: they may have
    /// other interfaces.
    pub(super) fn pass_over(&mut self, passed: &mut usize) -> bool {
        self.current.rotate_left(1.min(self.current.len()));
        *passed += 1;
        if *passed < self.current.len() {
            return false;
        }
        if self.next.is_empty() {
            return true;
        }
        let blocked = std::mem::take(&mut self.current);
        *passed = blocked.len();
        std::mem::swap(&mut self.current, &mut self.next);
        self.current.extend(blocked);
        false
    }

    /// Removes `slot` wherever it is.
    pub(super) fn remove(&mut self, slot: u32) {
        self.current.retain(|&s| s != slot);
        self.next.retain(|&s| s != slot);
    }
}

/// What a flow needs only when it appears, goes, or is published.
pub(crate) struct FlowCold {
    pub(super) key: u64,
    pub(super) vars_name: String,
    pub(super) vars: FlowVars,
}

/// Notes that flow `f` (in `slot`) has meters to publish.
pub(crate) fn mark_dirty(dirty: &mut Vec<u32>, f: &mut Flow, slot: u32) {
    if !f.dirty {
        f.dirty = true;
        dirty.push(slot);
    }
}

/// Flow `f`, at the front of `rounds`, is done with the current round: it waits for the next one, whose quantum
/// its next visit gives it.
pub(crate) fn wait_next_round(rounds: &mut Rounds, f: &mut Flow) {
    f.quantum_due = true;
    rounds.later();
}

/// After flow `f`, at the front of `rounds`, sent its head packet (its deficit and `head` already updated):
/// `next` is its new head packet ([`NIL`]: none) of `next_len` bytes. An empty flow leaves; one whose deficit
/// covers the next packet goes to the back of the round, the others wait for the next round.
pub(crate) fn served(rounds: &mut Rounds, f: &mut Flow, next: u32, next_len: u32) {
    if next == NIL {
        f.leave_rounds();
        rounds.remove_front();
        return;
    }
    f.head_len = next_len;
    if f.deficit >= u64::from(next_len) {
        rounds.again();
    } else {
        wait_next_round(rounds, f);
    }
}

impl Binding {
    /// Deficit round robin over the classes in priority order: the next flow whose head packet may be sent now,
    /// and its interface. It is left at the front of its class's list.
    pub(super) fn select(&mut self, now: Time) -> Option<(Class, u32, usize)> {
        // Policy preferred sends every flow to the same interface: when it is full, no flow needs looking at.
        if self.cfg.policy == Policy::Preferred && !self.ifaces.iter().find(|i| i.cfg.up).is_some_and(Iface::has_room) {
            return None;
        }
        let quantum = self.cfg.quantum;
        for class in Class::ALL {
            let c = class as usize;
            let n = self.active[c].len();
            if n == 0 {
                continue;
            }
            // Enough visits for every flow to gather the deficit for a largest packet, then to be found blocked.
            let limit = n.saturating_mul(2 + (65_536 / quantum.max(1)) as usize);
            let mut passed = 0;
            for _ in 0..limit {
                let Some(slot) = self.active[c].front() else { break };
                let Some(f) = self.flows.get(slot) else { break };
                if f.head == NIL {
                    break;
                }
                match self.target(slot, u64::from(f.head_len), now) {
                    // A flow that cannot send gathers no deficit: it is passed over, not served less later.
                    Some(k) if self.ifaces[k].has_room() => {
                        let Some(f) = self.flows.get_mut(slot) else { break };
                        if f.covers_head(quantum) {
                            return Some((class, slot, k));
                        }
                        wait_next_round(&mut self.active[c], f);
                    }
                    _ => {
                        if self.active[c].pass_over(&mut passed) {
                            break;
                        }
                    }
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flexstack_core::PacketPool;
    use flexstack_wire::packet::proto;

    fn node(pool: &PacketPool, len: u32) -> Node {
        let pkt = pool.alloc_from(&vec![0u8; len as usize]);
        let data = pkt.data().as_ptr() as usize;
        let hdr = Layout { v6: false, protocol: proto::UDP, l4: 20, end: len, transport: true, echo: false };
        Node { pkt, data, hdr, at: Time(1), len }
    }

    #[test]
    fn links_follow_a_flow_and_are_reset_when_an_index_is_reused() {
        let pool = PacketPool::new(64, 8);
        let mut nodes = Nodes::default();
        let a = nodes.insert(node(&pool, 40));
        let b = nodes.insert(node(&pool, 50));
        assert_eq!(nodes.next_of(a), (NIL, 0), "a new node is last of its flow");
        nodes.link(a, b, 50);
        assert_eq!(nodes.next_of(a), (b, 50));
        assert_eq!(nodes.remove(a).map(|n| n.len), Some(40));
        assert!(nodes.get(a).is_none() && nodes.remove(a).is_none(), "a removed node is gone");
        let c = nodes.insert(node(&pool, 60));
        assert_eq!(c, a, "the freed index is reused");
        assert_eq!(nodes.next_of(c), (NIL, 0), "without the link of the node it replaced");
        assert_eq!(nodes.get(c).map(|n| n.len), Some(60));
        assert_eq!(nodes.next_of(NIL), (NIL, 0), "an index past the end has no next");
        // Hints on indices past the end are ignored (no read, no panic).
        nodes.prefetch(NIL);
        nodes.prefetch_link(NIL);
        nodes.link(NIL, b, 1);
        assert_eq!(nodes.get(b).map(|n| n.len), Some(50));
    }
}
