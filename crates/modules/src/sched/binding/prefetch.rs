//! Prefetching for deep backlogs: hints that ask the CPU for what the next bindings, and the packets of a batch
//! being queued, will read, so that those reads do not each wait for memory.

use super::{Binding, Class, Flow, HASHED, NIL};
use flexstack_core::{Batch, Frame, MetaKey};

/// After each binding, the packets the next `PREFETCH_PACKETS` bindings will take (by deficit round robin, among
/// the first `NEAR_FLOWS` flows of the round) are prefetched: their slot and header line, and for the very next
/// one its bytes up to `PREFETCH_BYTES` (the header is rewritten at binding, the rest is read by the face that
/// sends the packet; in a deep backlog served out of arrival order the packet is nowhere in the caches and the
/// hardware prefetchers cannot guess it). A packet's bytes are asked for once, one binding ahead: asking for
/// them two ahead as well kept more misses in flight than the core tracks and cost more than it saved. The
/// queue nodes of the `FAR_FLOWS` flows after them are prefetched too, so that reading them two or three
/// bindings later does not wait for memory.
pub(super) const PREFETCH_PACKETS: usize = 2;
/// See [`PREFETCH_PACKETS`].
const NEAR_FLOWS: usize = 2;
/// See [`PREFETCH_PACKETS`].
const FAR_FLOWS: usize = 2;
/// See [`PREFETCH_PACKETS`]: 32 cache lines at most (the start of a GSO super-frame).
const PREFETCH_BYTES: usize = 2048;
/// See [`PREFETCH_PACKETS`]: the next bindings are prefetched only while at least this many bytes wait above the
/// binding point. A shallower backlog (a batch that is bound within the call that brought it, as when no rate is
/// modelled) is in the caches still, having just been read and queued: the hints found it there, and issuing them
/// (up to 40 per binding) was a third of the scheduler's time on that path (`perf annotate` of `settle` in the
/// daemon during `scripts/bench-binding.sh`). One MiB: a core's L2 cache on the machines measured.
pub(crate) const PREFETCH_MIN_BYTES: u64 = 1 << 20;
/// A batch going down of at least this many packets is taken in passes (late binding): first every packet's flow
/// is looked up and its state asked for ([`prefetch`]), then the link its queue's last packet has, then the packets
/// are queued. At 10,000 flows these are reads at random in memory, known only when the packet arrives; in passes
/// the reads of a batch overlap instead of each waiting in turn (the software pipelining of VPP). The daemon hands
/// a module whole batches (up to 256 frames per face per wake-up); a single packet gains nothing from it.
pub(crate) const ARRIVAL_PREFETCH_MIN: usize = 2;
/// A cache line (x86_64, aarch64).
const LINE: usize = 64;

/// The CPU's prefetch hint (in `flexstack-sys`, the crate that holds the workspace's unsafe code). Public for the
/// scheduler bench's reference (`benches/binding.rs`), which prefetches as the scheduler does.
pub use flexstack_sys::prefetch;

impl Binding {
    /// Hints the CPU to load what the next bindings will touch (see [`PREFETCH_PACKETS`]): `class` is the class
    /// just served; a higher one may have become active meanwhile.
    pub(super) fn prefetch_next(&self, class: Class) {
        let Some(c) = (0..=class as usize).find(|&c| !self.active[c].is_empty()) else { return };
        let mut found = 0;
        // Each visit sends at most one packet: the next bindings take the head packets of the next flows whose
        // deficit covers them (with the round's quantum if it is due).
        for &slot in self.active[c].iter().take(NEAR_FLOWS) {
            let Some(f) = self.flows.get(slot) else { continue };
            if !f.would_cover_head(self.cfg.quantum) {
                continue;
            }
            if let Some(n) = self.nodes.get(f.head) {
                // The packet's slot (reference counts, buffer pointer, metadata: about 160 bytes around the
                // metadata, whose address needs no read of the slot), then its bytes.
                let meta = n.pkt.meta() as *const _ as usize;
                for at in [meta.wrapping_sub(LINE), meta, meta.wrapping_add(LINE)] {
                    prefetch(at);
                }
                // Its bytes for the very next binding, its header line for the one after.
                let bytes = if found == 0 { PREFETCH_BYTES } else { LINE };
                for at in (0..(n.len as usize).min(bytes)).step_by(LINE) {
                    prefetch(n.data.wrapping_add(at));
                }
                // The flow's next node, for its next turn (the next binding, when it is alone in the round).
                self.nodes.prefetch(self.nodes.next_of(f.head).0);
            }
            found += 1;
            if found == PREFETCH_PACKETS {
                break;
            }
        }
        for &slot in self.active[c].iter().skip(NEAR_FLOWS).take(FAR_FLOWS) {
            if let Some(f) = self.flows.get(slot) {
                self.nodes.prefetch(f.head);
                self.nodes.prefetch_link(f.head);
            }
        }
    }

    /// The first passes over a batch going down (late binding; see [`ARRIVAL_PREFETCH_MIN`]): for each packet
    /// whose flow is known by its [`MetaKey::FLOW_ID`], looks up its flow slot (pushed to `slots`, [`NIL`] for the
    /// others) and asks for the flow's state; then, the flows' states having come in meanwhile, asks for the
    /// link of each flow's last queued packet, which queueing the packet behind it writes. The lookups of the
    /// batch are independent of each other, so their memory reads overlap instead of each waiting in turn.
    pub(super) fn prefetch_arrivals(&self, input: &Batch, slots: &mut Vec<u32>) {
        for f in input.iter() {
            let slot = match f {
                Frame::Data(p) => match p.meta().get(MetaKey::FLOW_ID) {
                    Some(id) if id & HASHED == 0 => self.index.get(&id).copied().unwrap_or(NIL),
                    _ => NIL,
                },
                Frame::Control(_) => NIL,
            };
            if let Some(flow) = self.flows.get(slot) {
                prefetch(flow as *const Flow as usize);
            }
            slots.push(slot);
        }
        for &slot in slots.iter() {
            if let Some(flow) = self.flows.get(slot) {
                self.nodes.prefetch_link(flow.tail);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::sched::binding::*;
    use flexstack_core::{Catalog, PacketPool, StackSpec};
    use flexstack_wire::packet::{build, proto};
    use std::net::Ipv4Addr;

    /// A late-binding module with one interface `a`, down (so everything handed to it queues), and its vars.
    fn module() -> (Box<dyn Module>, ModuleVars) {
        let mut catalog = Catalog::new();
        crate::register(&mut catalog);
        let text = "[modules.s]\nkind = \"late-binding\"\ninterfaces = [\"a\"]\nquantum = 64\n\"a.up\" = false\n\
                    \"a.device_queue\" = 100\n\"a.address_v4\" = \"192.0.2.10\"\n";
        let spec = StackSpec::parse("test.toml", text).unwrap();
        let builder = catalog.configure(LATE_KIND, &spec.modules[0].settings, None).unwrap();
        let vars = ModuleVars::new(&builder.interface().vars);
        (builder.build(&vars), vars)
    }

    /// Packet `i` of a mixed arrival: flow ids (known, new, repeated), packets without one (5-tuple flows of
    /// two source ports), a malformed one, different sizes; its index is in the payload.
    fn packet(pool: &PacketPool, i: u32) -> Frame {
        let (app, remote) = (Ipv4Addr::new(10, 77, 0, 2), Ipv4Addr::new(198, 51, 100, 7));
        let mut data = i.to_be_bytes().to_vec();
        data.resize(40 + 30 * (i as usize % 5), 0);
        let sport = 5000 + (i % 2) as u16;
        let bytes = build::ipv4(app, remote, proto::UDP, 64, &build::udp(app.into(), remote.into(), sport, 9, &data));
        let mut p = pool.alloc_from(if i == 13 { &bytes[..10] } else { &bytes });
        if i % 4 != 3 {
            p.meta_mut().set(MetaKey::FLOW_ID, u64::from(1 + (i * 7) % 11));
        }
        Frame::Data(p)
    }

    /// Hands `frames` to `m` in one call; returns the payload indices emitted on `a` and the frames dropped.
    fn call(m: &mut dyn Module, pool: &PacketPool, now: Time, frames: &mut Batch, poll: bool) -> (Vec<u32>, u64) {
        let mut ports = vec![Vec::new(), Vec::new()];
        let (mut control, mut serial) = (Vec::new(), 0);
        let mut out = Output::detached(now, "s", pool, &mut ports, &mut control, &mut serial);
        if poll {
            m.poll(&mut out);
        } else {
            m.process(IN_DOWN, frames, &mut out);
        }
        let dropped = out.dropped();
        let emitted = ports[0]
            .iter()
            .map(|f| match f {
                Frame::Data(p) => u32::from_be_bytes(p.data()[28..32].try_into().unwrap()),
                Frame::Control(_) => panic!("a control frame emitted"),
            })
            .collect();
        (emitted, dropped)
    }

    fn meter(vars: &ModuleVars, name: &str) -> Value {
        vars.cell(name).map(|c| c.get()).unwrap_or_else(|| panic!("no meter {name}"))
    }

    #[test]
    fn a_batch_is_queued_as_the_same_packets_one_by_one() {
        let pool = PacketPool::default();
        let (mut batched, batched_vars) = module();
        let (mut single, single_vars) = module();
        // Three arrivals: the first makes flows known, the second mixes known and new ones.
        let mut next = 0;
        for (round, n) in [(1u64, 9u32), (2, 24), (3, 1)] {
            let now = Time(round * 1000);
            let mut batch: Batch = (next..next + n).map(|i| packet(&pool, i)).collect();
            assert_eq!(
                call(batched.as_mut(), &pool, now, &mut batch, false),
                (vec![], u64::from(next <= 13 && 13 < next + n))
            );
            let mut dropped = 0;
            for i in next..next + n {
                let mut one = vec![packet(&pool, i)];
                let (emitted, d) = call(single.as_mut(), &pool, now, &mut one, false);
                assert!(emitted.is_empty(), "the interface is down");
                dropped += d;
            }
            assert_eq!(dropped, u64::from(next <= 13 && 13 < next + n), "the malformed packet is dropped");
            next += n;
        }
        for name in ["queued", "queued_bytes", "flows_active"] {
            assert_eq!(meter(&batched_vars, name), meter(&single_vars, name), "{name}");
        }
        assert_eq!(meter(&batched_vars, "queued"), Value::U64(u64::from(next) - 1));
        // The interface comes up: both send the same packets in the same order.
        let mut sent = Vec::new();
        for m in [&mut batched, &mut single] {
            m.write_knob("a.up", &Value::Bool(true)).unwrap();
            let (emitted, dropped) = call(m.as_mut(), &pool, Time(10_000), &mut Vec::new(), true);
            assert_eq!(dropped, 0);
            sent.push(emitted);
        }
        assert_eq!(sent[0].len(), next as usize - 1, "all but the malformed packet sent");
        assert_eq!(sent[0], sent[1], "the same order");
        let mut flows_order: Vec<u32> = sent[0].clone();
        flows_order.sort_unstable();
        assert_ne!(sent[0], flows_order, "served by flow, not in arrival order (the test sees the order)");
    }
}
