//! Binding a batch whole: when everything a batch going down holds will be bound within the call that brought it,
//! it is served by class and deficit round robin over the batch itself, without the queues.

use super::{mark_dirty, served, wait_next_round, Binding, Class, Mode, Queued, NIL};
use flexstack_core::{Batch, Output, Packet, Time};
use flexstack_wire::rewrite::Layout;

/// A packet of a batch being bound whole ([`Binding::bind_batch`]): taken when bound; `next` is the flow's next
/// packet in the batch ([`NIL`]: none).
pub(crate) struct Held {
    pkt: Option<Packet>,
    hdr: Layout,
    len: u32,
    next: u32,
}

impl Binding {
    /// Late binding: whether the batch `input` going down will be bound whole within this call, so that
    /// [`Binding::bind_batch`] may take it without the queue structures, with exactly the result of queueing it
    /// ([`Binding::enqueue`]) and settling ([`Binding::fill_late`]): nothing waits above the binding point (every
    /// flow is empty, inactive, with no deficit); the batch fits under `queue_limit` (none of it is dropped as
    /// full); and every interface that is up models no rate, has sent everything (`busy_until` not after `now`)
    /// and has room in its device queue. Then a packet bound there leaves at once and its device queue stays as it
    /// is, so every interface keeps its room through the batch, no flow is ever passed over as blocked, and the
    /// policy's choice does not depend on the packet's length (`fastest` sees every interface free now): the order
    /// of service is the one class priority and deficit round robin give the batch by themselves.
    pub(super) fn binds_at_once(&self, input: &Batch, now: Time) -> bool {
        if self.cfg.mode != Mode::Late || self.queued != 0 || input.is_empty() {
            return false;
        }
        if input.len() as u64 > self.cfg.queue_limit || self.active.iter().any(|a| !a.is_empty()) {
            return false;
        }
        let mut up = self.ifaces.iter().filter(|i| i.cfg.up).peekable();
        up.peek().is_some()
            && up.all(|i| i.cfg.rate_bps == 0 && i.busy_until <= now && i.has_room() && i.fifo.is_empty())
    }

    /// Late binding: takes a batch going down that [`Binding::binds_at_once`] accepted and binds all of it, in
    /// two passes. First each packet is parsed (or dropped as [`Binding::enqueue`] would), its flow found or made,
    /// and linked behind the flow's previous packet of the batch in [`Binding::held`] (the flow's `head` and `tail`
    /// index that batch while it runs, instead of the node arena; the flow becomes active in its class, as when
    /// queued). Then the classes are served in priority order by deficit round robin, as [`Binding::select`] does
    /// when no flow is blocked (a visit adds the round's quantum if it is due and sends one packet if the deficit
    /// covers it; the flow then goes to the back of the round or, its deficit short, to the next round: [`served`]),
    /// each packet bound as [`Binding::fill_late`] binds it. Every flow of the batch ends empty and
    /// inactive with no deficit, as after settling. The node arena, the per-packet queue accounting, the
    /// interface checks per visit and the prefetching for deep backlogs are skipped: the batch was just read and
    /// is in the caches.
    pub(super) fn bind_batch(&mut self, input: &mut Batch, now: Time, out: &mut Output<'_>) {
        let mut held = std::mem::take(&mut self.held);
        held.clear();
        for frame in input.drain(..) {
            let Some((p, info)) = self.parse_down(frame, out) else { continue };
            let slot = self.flow_for(&p, &info, out);
            // An IP packet is at most 65,575 bytes, and a batch far fewer than 2^32 packets.
            let (len, at) = (p.len() as u32, held.len() as u32);
            held.push(Held { pkt: Some(p), hdr: Layout::of(&info), len, next: NIL });
            let Some(f) = self.flows.get_mut(slot) else { continue };
            match f.tail {
                NIL => {
                    f.head = at;
                    f.head_len = len;
                }
                tail => held[tail as usize].next = at,
            }
            f.tail = at;
            f.last_seen = now;
            mark_dirty(&mut self.dirty, f, slot);
            if !f.active {
                f.active = true;
                self.active[f.class as usize].push(slot);
            }
        }
        let quantum = self.cfg.quantum;
        for class in Class::ALL {
            let c = class as usize;
            while let Some(slot) = self.active[c].front() {
                let Some(f) = self.flows.get_mut(slot) else { break };
                let len = u64::from(f.head_len);
                if !f.covers_head(quantum) {
                    wait_next_round(&mut self.active[c], f);
                    continue;
                }
                let at = f.head as usize;
                let Some(h) = held.get_mut(at) else { break };
                let (next, hdr, pkt) = (h.next, h.hdr, h.pkt.take());
                f.deficit -= len;
                f.head = next;
                let next_len = held.get(next as usize).map_or(0, |n| n.len);
                served(&mut self.active[c], f, next, next_len);
                let Some(pkt) = pkt else { continue };
                let q = Queued { pkt, hdr, at: now, flow: slot };
                match self.target(slot, len, now) {
                    Some(k) => {
                        self.note_binding(slot, k, 0);
                        self.bind(k, q, class, now, out);
                    }
                    // Not while an interface is up (every policy then finds one), which binds_at_once checked;
                    // should it happen, the packet waits above the binding point as it would have.
                    None => self.admit(q, now, out),
                }
            }
        }
        self.held = held;
    }
}
