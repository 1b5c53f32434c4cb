//! `late-binding` and `early-binding`: a scheduler that sends IP packets going down over one of several
//! interfaces, choosing the interface as late as possible (the binding point of the late-binding paper), and,
//! for comparison, the same module binding at enqueue as stock Linux does.
//!
//! How the parts are called: the switch calls [`Module::process`] with packets on `in` (going down) or `up_in`
//! (coming up), [`Module::poll`] when a modelled transmission starts or ends (the module asks with
//! [`Output::wake_at`]), and [`Module::write_knob`] between batches. Every call first applies pending interface
//! downs, then advances the modelled device queues to `now` (emitting packets whose transmission starts), then
//! fills the device queues that have room. Nothing reads a clock: time is [`Output::now`]. A batch going down that
//! will be bound whole within the call (nothing queued, every interface that is up unmodelled and with room) is
//! served by class and deficit round robin over the batch itself, with the same result and without the queues
//! (`Binding::bind_batch`; docs/binding.md, "Cost").
//!
//! - **Above the binding point** (`late-binding` only): interface-independent per-flow queues. The flow is the
//!   packet's [`MetaKey::FLOW_ID`] (set by `classify`), or a hash of its 5-tuple. At most `queue_limit` packets
//!   wait in all of them; a packet arriving beyond is dropped (`drop_queue_full_total`). Each flow has a class,
//!   decided on its first packet: an override (procedure `class`), else the first matching `class_rules` rule,
//!   else [`MetaKey::CLASS`] (0 urgent, 1 interactive, 2 bulk), else the packet's DSCP (see [`Class::from_dscp`]).
//!   Classes are served in strict priority (urgent, interactive, bulk); flows within a class by deficit round
//!   robin with a `quantum` of bytes per round, interleaved: each visit sends one packet, and a flow whose deficit
//!   still covers its next packet goes to the back of the round (`Rounds`), so that flows take turns packet by
//!   packet within a round rather than each sending its quantum in a burst.
//! - **Below the binding point**: each interface has a device queue that models the NIC's transmit ring: at most
//!   `<iface>.device_queue` packets, drained at `<iface>.rate_mbit` (Mbit/s, as a lab link's `bw` and the
//!   emulator's `rate_mbit`; its old name `<iface>.rate_bps`, in bit/s, still works as a setting and a knob, and
//!   is reported as deprecated). A packet admitted at `now` starts its modelled transmission when the previous one
//!   ends (or at `now`) and leaves the device queue when its transmission time (`(len + overhead_bytes) * 8 /
//!   rate`) has passed. `<iface>.overhead_bytes` is the link layer's per-packet addition (14 for Ethernet), so that
//!   the model drains no faster than the link behind it. With `rate_mbit = 0` nothing is modelled: packets pass at
//!   once. `<iface>.emit` says when a packet is emitted on the interface's
//!   output port: `start` (default) at its modelled transmission start (the model paces the link; a late wake-up
//!   delays the emissions), `admit` at once, when it enters the device queue (the link behind the port paces it;
//!   the model's occupancy and room are the same, the module wakes only when an entry ends and room frees, and a
//!   late wake-up fills the freed room at once). Entries follow each other, so a start is the end before it: both
//!   wake at the same instants, which at Gbit/s rates come faster than the data plane calls the module.
//! - **Binding**: when an interface has room, the scheduler takes the next packet (class, then DRR) whose flow's
//!   interface by `policy` has room, and binds it: the source address is rewritten to the interface's
//!   `address_v4` / `address_v6` (kept when absent) with the IPv4 header, TCP, UDP and ICMPv6 checksums updated
//!   incrementally ([`flexstack_wire::rewrite`], RFC 1624); [`MetaKey::OUT_FACE`] gets the interface's index and
//!   [`MetaKey::CLASS`] the class. Policies: `preferred` (the first interface of `interfaces` that is up; the
//!   others only while it is down), `affinity` (a flow stays on the interface it was first bound to while that is
//!   up; the first choice is the fastest), `weighted` (flows are split over the up interfaces in proportion to
//!   `<iface>.weight`, by flow hash; a flow stays on its interface while that is up), `fastest` (per packet, the
//!   up interface whose modelled transmission of it would end first). A packet whose interface is full waits
//!   (other flows may go meanwhile); a packet is never bound to an interface that is down.
//! - **Interface down** (`<iface>.up` = false, written by hand, by a rule or by the lab; or the link of the face
//!   module named by `<iface>.face` lost its carrier or went down, which also sets the knob): the packets in its device
//!   queue that have not been emitted are dropped (`<iface>.drop_interface_down_total`), those already emitted
//!   whose modelled transmission had not ended are counted as interrupted (`<iface>.tx_interrupted_total`: with
//!   `emit` = `start` the one in transmission, with `admit` every packet in the device queue: they were handed to
//!   the link, what it does with them is its business). Packets above the binding
//!   point stay and are bound elsewhere; flows pinned to the interface are re-pinned by policy. A **rebind** is a
//!   packet bound to another interface than its flow's previous packet (`rebinds_total`, and
//!   `<iface>.rebinds_total` on the new interface).
//! - **`early-binding`** (stock Linux, for comparison): the policy picks the interface when the packet arrives;
//!   it waits in that interface's FIFO (`<iface>.fifo_limit`, default 1000; beyond, `<iface>.drop_queue_full_total`)
//!   and then its device queue (default 50). An interface going down loses its FIFO and device queue; a packet
//!   arriving while no interface is up is dropped (`drop_no_interface_total`).
//! - **Up direction**: packets on `up_in` leave on `up_out`; when `virtual_v4` / `virtual_v6` is set, a packet
//!   whose destination is one of the interfaces' addresses gets the virtual address instead (checksums updated
//!   the same way, `up_mapped_total`). Without them, put a `nat` module on the way up instead.
//!
//! The ports, settings, knobs and meters of both kinds are declared once, in `config.rs` (`LATE`, `EARLY` and
//! their per-interface groups); docs/modules.md lists them. Per-interface names are dotted
//! (`"<iface>.address_v4"`: quoted keys in TOML). `class_rules` are `CLASS [tcp|udp|icmp] [port N] [dscp N]`, the
//! first that matches wins, a port matching either end. `<iface>.face` names the face module of that interface:
//! its link going down or up sets `<iface>.up` (see `Module::link_changed`). Switched to `admit`, `<iface>.emit`
//! emits the packets the device queue still holds at the next call, in order; switched to `start`, packets bound
//! afterwards wait for their start. Per flow, under `<vars_prefix>.<flow>.binding.`: `class`, `interface`,
//! `queued`, `queue_delay_ns` (time its last bound packet waited before binding). `queued` and `queue_delay_ns`
//! are refreshed at most every 100 ms (module time; a wake-up is asked for while one is stale), not per packet.
//!
//! Cost: the per-flow state a packet touches is one cache line (`Flow`; names and meter handles sit behind a
//! box), the flows' queues are linked lists in one node arena (no allocation per flow or packet), the flow index
//! hashes with splitmix64 instead of SipHash, and per-flow meters are written in batches. After each binding the
//! packets the next bindings will take (the head packets of the next flows of the round) are prefetched, with the
//! queue nodes of the flows after them (see `PREFETCH_PACKETS` in the source): a deep backlog served out of arrival
//! order otherwise waits for memory on every line of every packet. Interleaving the rounds also keeps the service
//! in arrival order when flows arrive in turn, so that a deep backlog's packets are visited in the order they
//! were written, which the hardware prefetchers follow. A batch going down is taken in passes (`ARRIVAL_PREFETCH_MIN`): every
//! packet's flow is looked up and its state asked for, then the link of each flow's last packet, then the packets
//! are queued, so that these reads at random overlap. `crates/modules/benches/binding.rs` measures the cost per packet
//! with 1, 100 and 10,000 flows, one packet per call and in batches as the daemon hands them; figures in
//! BENCHMARKS.md.
//!
//! A flow's class is a runtime knob, `<vars_prefix>.<id>.binding.class` (the switch hands its writes over by the
//! whole name: `Edit::SetVar`); procedure `class` (argument `"<flow id> <class>"`) sets it too, also for a flow
//! not seen yet.

mod batch;
mod class;
mod config;
mod device;
mod drr;
mod prefetch;

// The parts' items that this file and the other parts use: the parts import them from here, so that no
// two files import each other.
pub(crate) use batch::Held;
pub(crate) use class::dscp_of;
pub use class::{Class, ClassRule};
pub(crate) use config::{configure, Config, IfaceConfig, Mode, MAX_OVERRIDES};
pub use config::{Emit, Policy};
pub(crate) use device::{Iface, IfaceMeters};
pub(crate) use drr::{
    mark_dirty, mix64, served, wait_next_round, Flow, FlowCold, FlowMap, FlowVars, Node, Nodes, Rounds, NIL,
};
pub use prefetch::prefetch;
pub(crate) use prefetch::{ARRIVAL_PREFETCH_MIN, PREFETCH_MIN_BYTES};

use crate::flow::table::Slab;
use flexstack_core::module::port_type;
use flexstack_core::{
    kind_from_decl, Batch, ConfigError, Deprecations, Frame, MetaKey, Meter, Module, ModuleBuilder, ModuleInterface,
    ModuleKind, ModuleVars, Output, Packet, PortSpec, Settings, Time, Value, ValueType, VarSpec, VarSpecs,
};
use flexstack_wire::packet::{PacketInfo, ParseDrops};
use flexstack_wire::rewrite::{self, Layout};
use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::net::IpAddr;

/// The late-binding kind's name in stack files.
pub const LATE_KIND: &str = "late-binding";
/// The early-binding kind's name in stack files.
pub const EARLY_KIND: &str = "early-binding";

/// Input port of packets going down.
pub const IN_DOWN: usize = 0;
/// Input port of packets coming up.
pub const IN_UP: usize = 1;

/// Most interfaces of one module.
pub const MAX_INTERFACES: usize = 16;
/// Per-flow meters (`queued`, `queue_delay_ns`) are written at most this often (ns of module time), for the flows
/// that changed since: writing them per packet touched two more cache lines per packet and flow.
const PUBLISH_NS: u64 = 100_000_000;

/// The `late-binding` module kind.
pub struct LateBindingKind;
/// The `early-binding` module kind.
pub struct EarlyBindingKind;

impl ModuleKind for LateBindingKind {
    kind_from_decl!(Mode::Late.decl(), Mode::Late.iface_decl());

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        BindingBuilder::configure(Mode::Late, settings)
    }
}

impl ModuleKind for EarlyBindingKind {
    kind_from_decl!(Mode::Early.decl(), Mode::Early.iface_decl());

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        BindingBuilder::configure(Mode::Early, settings)
    }
}

struct BindingBuilder {
    cfg: Config,
    ifaces: Vec<IfaceConfig>,
    deprecations: Deprecations,
}

impl BindingBuilder {
    fn configure(mode: Mode, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let (cfg, ifaces) = configure(mode, settings)?;
        Ok(Box::new(BindingBuilder { cfg, ifaces, deprecations: Deprecations::default() }))
    }
}

impl ModuleBuilder for BindingBuilder {
    fn interface(&self) -> ModuleInterface {
        let (c, ifaces) = (&self.cfg, &self.ifaces);
        let mut iface = c.mode.decl().interface(c);
        for i in ifaces {
            iface.vars.extend(c.mode.iface_decl().vars(&i.name, i));
        }
        iface.outputs = ifaces.iter().map(|i| PortSpec::new(i.name.clone(), port_type::IP)).collect();
        iface.outputs.push(PortSpec::new("up_out", port_type::IP));
        iface
    }

    fn paths(&self) -> Option<Vec<(String, String)>> {
        let mut p: Vec<(String, String)> = self.ifaces.iter().map(|i| ("in".into(), i.name.clone())).collect();
        p.push(("up_in".into(), "up_out".into()));
        Some(p)
    }

    fn deprecations(&mut self, deprecations: &Deprecations) {
        self.deprecations = deprecations.clone();
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        let BindingBuilder { cfg, ifaces, deprecations } = *self;
        let (decl, iface_decl) = (cfg.mode.decl(), cfg.mode.iface_decl());
        decl.publish(&cfg, vars);
        let ifaces = ifaces
            .into_iter()
            .map(|i| {
                iface_decl.publish(&i.name, &i, vars);
                let mut m = iface_decl.meters(&i.name, vars);
                let cell = |knob: &str| vars.meter(&format!("{}.{knob}", i.name));
                m.up = cell("up");
                m.rate = [cell("rate_mbit"), cell("rate_bps")];
                Iface {
                    ring: VecDeque::with_capacity(i.device_queue.min(4096) as usize),
                    cfg: i,
                    busy_until: Time::ZERO,
                    fifo: VecDeque::new(),
                    fifo_bytes: 0,
                    pending_down: false,
                    flush_held: false,
                    m,
                }
            })
            .collect();
        Box::new(Binding {
            meters: decl.meters(vars),
            drops: ParseDrops::new(vars),
            ifaces,
            cfg,
            flows: Slab::default(),
            index: FlowMap::default(),
            nodes: Nodes::default(),
            dirty: Vec::new(),
            arrivals: Vec::new(),
            held: Vec::new(),
            next_publish: Time::ZERO,
            active: Default::default(),
            overrides: FlowMap::default(),
            queued: 0,
            queued_bytes: 0,
            next_sweep: None,
            downs_pending: false,
            flow_specs: VarSpecs::new(flow_specs()),
            deprecations,
        })
    }
}

fn flow_specs() -> Vec<VarSpec> {
    vec![
        VarSpec::knob("class", ValueType::Str, "", "urgent, interactive or bulk; writable: sets the flow's class"),
        VarSpec::meter("interface", ValueType::Str, "", "interface the flow's last packet was bound to"),
        VarSpec::meter("queued", ValueType::U64, "frames", "packets of the flow waiting above the binding point"),
        VarSpec::meter("queue_delay_ns", ValueType::U64, "ns", "time the flow's last bound packet waited"),
    ]
}

// -------------------------------------------------------------------------------------------------------------
// The running module
// -------------------------------------------------------------------------------------------------------------

/// The module-level meters.
#[derive(Default)]
pub(crate) struct Meters {
    queued: Meter,
    queued_bytes: Meter,
    flows_active: Meter,
    rebinds: Meter,
    drop_full: Meter,
    drop_no_iface: Meter,
    drop_down: Meter,
    up_mapped: Meter,
    unpublished: Meter,
}

/// A packet waiting to be bound.
struct Queued {
    pkt: Packet,
    hdr: Layout,
    at: Time,
    flow: u32,
}

/// A running `late-binding` or `early-binding` module.
pub struct Binding {
    cfg: Config,
    ifaces: Vec<Iface>,
    flows: Slab<Flow>,
    index: FlowMap<u32>,
    /// Late binding: the packets above the binding point, each flow's a linked list ([`Flow::head`]). Freed nodes
    /// are reused last-out-first-in, so a packet arriving after one was bound usually lands in a line still cached.
    nodes: Nodes,
    /// Flows whose meters changed since the last publication.
    dirty: Vec<u32>,
    /// The flow slots [`Binding::prefetch_arrivals`] found for the batch being taken (kept for its capacity).
    arrivals: Vec<u32>,
    /// The batch [`Binding::bind_batch`] is binding (kept for its capacity).
    held: Vec<Held>,
    next_publish: Time,
    /// Per class, the flows with packets queued, in deficit-round-robin order.
    active: [Rounds; 3],
    overrides: FlowMap<Class>,
    queued: u64,
    queued_bytes: u64,
    next_sweep: Option<Time>,
    /// Some interface's `pending_down` is set.
    downs_pending: bool,
    /// Declared once, shared by every flow's cells.
    flow_specs: VarSpecs,
    meters: Meters,
    drops: ParseDrops,
    /// Where a knob written by its old name is reported.
    deprecations: Deprecations,
}

/// Bit set on flow keys made from a hash of the 5-tuple (flow ids from `classify` are small).
const HASHED: u64 = 1 << 63;

impl Binding {
    /// The flow of a packet and a hash of it: its FLOW_ID (hashed with splitmix64's finalizer), or a hash of its
    /// 5-tuple (SipHash with fixed keys: the same split on every run).
    fn flow_key(p: &Packet, info: &PacketInfo) -> (u64, u64) {
        match p.meta().get(MetaKey::FLOW_ID) {
            Some(id) if id & HASHED == 0 => (id, mix64(id)),
            _ => {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                (info.protocol, info.src, info.src_port, info.dst, info.dst_port).hash(&mut h);
                let hash = h.finish();
                (hash | HASHED, hash)
            }
        }
    }

    fn class_of(&self, key: u64, p: &Packet, info: &PacketInfo) -> Class {
        if let Some(c) = self.overrides.get(&key) {
            return *c;
        }
        let dscp = dscp_of(p.data());
        if let Some(r) = self.cfg.rules.iter().find(|r| r.matches(info, dscp)) {
            return r.class;
        }
        match p.meta().get(MetaKey::CLASS) {
            Some(0) => Class::Urgent,
            Some(1) => Class::Interactive,
            Some(2) => Class::Bulk,
            _ => Class::from_dscp(dscp),
        }
    }

    /// The flow slot of a packet, created if new.
    fn flow_for(&mut self, p: &Packet, info: &PacketInfo, out: &mut Output<'_>) -> u32 {
        let (key, hash) = Self::flow_key(p, info);
        if let Some(&s) = self.index.get(&key) {
            return s;
        }
        let class = self.class_of(key, p, info);
        let id = if key & HASHED == 0 { key.to_string() } else { format!("h{:016x}", key & !HASHED) };
        let vars_name = format!("{}.{id}.binding", self.cfg.vars_prefix);
        let vars = out.register_vars(&vars_name, &self.flow_specs).unwrap_or_else(|_| {
            self.meters.unpublished.add(1);
            ModuleVars::shared(&self.flow_specs)
        });
        vars.meter("class").store(&Value::Str(class.name().into()));
        let flow = Flow {
            head: NIL,
            tail: NIL,
            head_len: 0,
            pending: 0,
            deficit: 0,
            hash,
            last_seen: out.now(),
            delay_ns: 0,
            class,
            active: false,
            dirty: false,
            pinned: None,
            last_iface: None,
            quantum_due: true,
            cold: Box::new(FlowCold {
                key,
                vars_name,
                vars: FlowVars {
                    class: vars.meter("class"),
                    iface: vars.meter("interface"),
                    queued: vars.meter("queued"),
                    delay: vars.meter("queue_delay_ns"),
                },
            }),
        };
        let slot = self.flows.insert(flow);
        self.index.insert(key, slot);
        self.meters.flows_active.set(self.flows.len() as u64);
        if self.next_sweep.is_none() {
            self.next_sweep = Some(out.now() + std::time::Duration::from_nanos(self.cfg.flow_idle_ns));
        }
        slot
    }

    /// The interface the policy gives a packet of `len` bytes of flow `slot` now (it may have no room).
    fn target(&self, slot: u32, len: u64, now: Time) -> Option<usize> {
        let up = || self.ifaces.iter().enumerate().filter(|(_, i)| i.cfg.up);
        let fastest = || up().min_by_key(|(k, i)| (i.completion(now, len), *k)).map(|(k, _)| k);
        let flow = self.flows.get(slot)?;
        let pinned = flow.pinned.map(usize::from).filter(|&k| self.ifaces[k].cfg.up);
        match self.cfg.policy {
            Policy::Preferred => up().map(|(k, _)| k).next(),
            Policy::Fastest => fastest(),
            Policy::Affinity => pinned.or_else(fastest),
            Policy::Weighted => pinned.or_else(|| {
                let total: u64 = up().map(|(_, i)| i.cfg.weight).sum();
                if total == 0 {
                    // Every up interface has weight 0: split evenly.
                    let n = up().count() as u64;
                    return up().nth((flow.hash % n.max(1)) as usize).map(|(k, _)| k);
                }
                let mut pick = flow.hash % total;
                for (k, i) in up() {
                    if pick < i.cfg.weight {
                        return Some(k);
                    }
                    pick -= i.cfg.weight;
                }
                None
            }),
        }
    }

    /// Notes that a packet of flow `slot` goes to interface `k`: pins, counts a rebind.
    fn note_binding(&mut self, slot: u32, k: usize, waited: u64) {
        let Some(f) = self.flows.get_mut(slot) else { return };
        // k < MAX_INTERFACES (16).
        let k8 = k as u8;
        if matches!(self.cfg.policy, Policy::Affinity | Policy::Weighted) {
            f.pinned = Some(k8);
        }
        if f.last_iface != Some(k8) {
            if f.last_iface.is_some() {
                self.meters.rebinds.add(1);
                self.ifaces[k].m.rebinds.add(1);
            }
            f.last_iface = Some(k8);
            f.cold.vars.iface.store(&Value::Str(self.ifaces[k].cfg.name.clone()));
        }
        f.delay_ns = waited;
        mark_dirty(&mut self.dirty, f, slot);
    }

    /// Binds a packet to interface `k`: rewrites its source, notes its interface and class, and puts it into the
    /// interface's modelled device queue ([`Iface::admit`]).
    fn bind(&mut self, k: usize, q: Queued, class: Class, now: Time, out: &mut Output<'_>) {
        let Queued { mut pkt, hdr, .. } = q;
        let iface = &mut self.ifaces[k];
        let new = if hdr.v6 { iface.cfg.address_v6.map(IpAddr::V6) } else { iface.cfg.address_v4.map(IpAddr::V4) };
        if let Some(new) = new {
            rewrite::address(pkt.data_mut(), &hdr, true, new);
        }
        let meta = pkt.meta_mut();
        meta.set(MetaKey::OUT_FACE, k as u64);
        meta.set(MetaKey::CLASS, class as u64);
        let len = pkt.len() as u64;
        iface.m.bound_packets.add(1);
        iface.m.bound_bytes.add(len);
        iface.admit(k, pkt, now, out);
    }

    /// Accounts a packet leaving the queues of flow `slot`.
    fn unqueue(&mut self, slot: u32, len: u64) {
        self.queued -= 1;
        self.queued_bytes -= len;
        if let Some(f) = self.flows.get_mut(slot) {
            f.pending -= 1;
            mark_dirty(&mut self.dirty, f, slot);
        }
    }

    /// Late binding: binds packets while some interface has room and some flow's packet may go there.
    fn fill_late(&mut self, now: Time, out: &mut Output<'_>) {
        while self.ifaces.iter().any(Iface::has_room) {
            let Some((class, slot, k)) = self.select(now) else { break };
            let Some(f) = self.flows.get_mut(slot) else { break };
            let (next, next_len) = self.nodes.next_of(f.head);
            let Some(node) = self.nodes.remove(f.head) else { break };
            let len = u64::from(node.len);
            f.deficit = f.deficit.saturating_sub(len);
            f.head = next;
            served(&mut self.active[class as usize], f, next, next_len);
            self.unqueue(slot, len);
            self.note_binding(slot, k, now.0.saturating_sub(node.at.0));
            let q = Queued { pkt: node.pkt, hdr: node.hdr, at: node.at, flow: slot };
            self.bind(k, q, class, now, out);
            if self.queued_bytes >= PREFETCH_MIN_BYTES {
                self.prefetch_next(class);
            }
        }
    }

    /// Early binding: moves packets from each FIFO into its device queue while there is room.
    fn fill_early(&mut self, now: Time, out: &mut Output<'_>) {
        for k in 0..self.ifaces.len() {
            while self.ifaces[k].has_room() {
                let Some(q) = self.ifaces[k].fifo.pop_front() else { break };
                let len = q.pkt.len() as u64;
                self.ifaces[k].fifo_bytes -= len;
                self.unqueue(q.flow, len);
                let class = self.flows.get(q.flow).map_or(Class::Bulk, |f| f.class);
                if let Some(f) = self.flows.get_mut(q.flow) {
                    f.delay_ns = now.0.saturating_sub(q.at.0);
                    mark_dirty(&mut self.dirty, f, q.flow);
                }
                self.bind(k, q, class, now, out);
            }
        }
    }

    /// Parses a packet going down: its headers, and the packet cut to the length its IP header gives; a control
    /// frame, or a packet that does not parse, is counted and dropped (`None`).
    fn parse_down(&mut self, frame: Frame, out: &mut Output<'_>) -> Option<(Packet, PacketInfo)> {
        let (mut p, info) = self.drops.parse(frame, out)?;
        if p.len() > info.total_len {
            p.truncate(info.total_len);
        }
        Some((p, info))
    }

    /// Takes a packet going down; `known` is its flow's slot if [`Binding::prefetch_arrivals`] found it, else
    /// [`NIL`].
    fn enqueue(&mut self, frame: Frame, known: u32, now: Time, out: &mut Output<'_>) {
        let Some((p, info)) = self.parse_down(frame, out) else { return };
        let slot = if known != NIL { known } else { self.flow_for(&p, &info, out) };
        self.admit(Queued { pkt: p, hdr: Layout::of(&info), at: now, flow: slot }, now, out);
    }

    /// Queues a parsed packet of flow `q.flow` above the binding point (late) or in its interface's FIFO (early),
    /// or drops it if the queues are full.
    fn admit(&mut self, q: Queued, now: Time, out: &mut Output<'_>) {
        let (len, slot) = (q.pkt.len() as u64, q.flow);
        match self.cfg.mode {
            Mode::Late => {
                if self.queued >= self.cfg.queue_limit {
                    self.meters.drop_full.add(1);
                    out.drop_frame(q.pkt.into());
                    return;
                }
                let Some(f) = self.flows.get_mut(slot) else { return };
                // An IP packet is at most 65,575 bytes (16-bit length fields; jumbograms do not parse): it fits.
                let len32 = len as u32;
                let data = q.pkt.data().as_ptr() as usize;
                let node = self.nodes.insert(Node { pkt: q.pkt, data, hdr: q.hdr, at: now, len: len32 });
                match f.tail {
                    NIL => {
                        f.head = node;
                        f.head_len = len32;
                    }
                    tail => {
                        self.nodes.link(tail, node, len32);
                    }
                }
                f.tail = node;
                f.last_seen = now;
                f.pending += 1;
                mark_dirty(&mut self.dirty, f, slot);
                if !f.active {
                    f.active = true;
                    self.active[f.class as usize].push(slot);
                }
            }
            Mode::Early => {
                let Some(k) = self.target(slot, len, now) else {
                    self.meters.drop_no_iface.add(1);
                    out.drop_frame(q.pkt.into());
                    return;
                };
                // The FIFO and the device queue behind it hold fifo_limit + device_queue packets together.
                let i = &self.ifaces[k];
                if (i.fifo.len() + i.ring.len()) as u64 >= i.cfg.fifo_limit.saturating_add(i.cfg.device_queue) {
                    self.ifaces[k].m.drop_full.add(1);
                    self.meters.drop_full.add(1);
                    out.drop_frame(q.pkt.into());
                    return;
                }
                self.note_binding(slot, k, 0);
                let Some(f) = self.flows.get_mut(slot) else { return };
                f.last_seen = now;
                f.pending += 1;
                mark_dirty(&mut self.dirty, f, slot);
                self.ifaces[k].fifo_bytes += len;
                self.ifaces[k].fifo.push_back(q);
            }
        }
        self.queued += 1;
        self.queued_bytes += len;
    }

    /// Maps a packet coming up to the virtual address if it is addressed to one of the interfaces.
    fn map_up(&mut self, frame: Frame, out: &mut Output<'_>) {
        let Some((mut p, info)) = self.drops.parse(frame, out) else { return };
        // The destination address is rewritten in place, with fixed-size arrays (no allocation per packet).
        let mapped = match info.dst {
            IpAddr::V4(d) if self.ifaces.iter().any(|i| i.cfg.address_v4 == Some(d)) => {
                self.cfg.virtual_v4.map(|v| rewrite::address(p.data_mut(), &Layout::of(&info), false, v.into()))
            }
            IpAddr::V6(d) if self.ifaces.iter().any(|i| i.cfg.address_v6 == Some(d)) => {
                self.cfg.virtual_v6.map(|v| rewrite::address(p.data_mut(), &Layout::of(&info), false, v.into()))
            }
            _ => None,
        };
        if mapped.is_some() {
            self.meters.up_mapped.add(1);
        }
        out.emit(self.ifaces.len(), p);
    }

    /// Forgets flows with nothing queued that were idle for `flow_idle_ms`.
    fn sweep(&mut self, now: Time, out: &mut Output<'_>) {
        if self.next_sweep.is_none_or(|t| t > now) {
            return;
        }
        let idle = self.cfg.flow_idle_ns;
        let gone: Vec<u32> = self
            .flows
            .iter()
            .filter(|(_, f)| f.pending == 0 && !f.active && f.last_seen.0.saturating_add(idle) <= now.0)
            .map(|(s, _)| s)
            .collect();
        for s in gone {
            if let Some(f) = self.flows.remove(s) {
                self.index.remove(&f.cold.key);
                out.unregister_vars(&f.cold.vars_name);
            }
        }
        self.meters.flows_active.set(self.flows.len() as u64);
        self.next_sweep = (self.flows.len() > 0).then(|| now + std::time::Duration::from_nanos(idle.div_ceil(2)));
    }

    /// Everything a call does after taking its input: fill device queues, update meters, say when to wake.
    fn settle(&mut self, now: Time, out: &mut Output<'_>) -> Option<Time> {
        match self.cfg.mode {
            Mode::Late => self.fill_late(now, out),
            Mode::Early => self.fill_early(now, out),
        }
        self.sweep(now, out);
        self.publish(now);
        self.meters.queued.set(self.queued);
        self.meters.queued_bytes.set(self.queued_bytes);
        let mut next = self.next_sweep;
        if !self.dirty.is_empty() {
            next = Some(next.map_or(self.next_publish, |n: Time| n.min(self.next_publish)));
        }
        for i in &self.ifaces {
            i.m.device_queue_len.set(i.ring.len() as u64);
            i.m.queue_len.set(i.fifo.len() as u64);
            if let Some(t) = i.next_change() {
                next = Some(next.map_or(t, |n: Time| n.min(t)));
            }
        }
        next
    }

    /// Writes the meters of the flows that changed, at most every [`PUBLISH_NS`].
    fn publish(&mut self, now: Time) {
        if self.dirty.is_empty() || self.next_publish > now {
            return;
        }
        for slot in self.dirty.drain(..) {
            if let Some(f) = self.flows.get_mut(slot) {
                f.dirty = false;
                f.cold.vars.queued.set(u64::from(f.pending));
                f.cold.vars.delay.set(f.delay_ns);
            }
        }
        self.next_publish = now + std::time::Duration::from_nanos(PUBLISH_NS);
    }

    /// The flow key of a flow's runtime class knob (`<vars_prefix>.<id>.binding.class`, the switch hands runtime
    /// knobs over by their whole name), if `knob` is one.
    fn flow_class_knob(&self, knob: &str) -> Option<u64> {
        let id = knob.strip_prefix(self.cfg.vars_prefix.as_str())?.strip_prefix('.')?.strip_suffix(".binding.class")?;
        match id.strip_prefix('h') {
            Some(hex) => u64::from_str_radix(hex, 16).ok().map(|k| k | HASHED),
            None => id.parse::<u64>().ok().filter(|k| k & HASHED == 0),
        }
    }

    fn set_class(&mut self, key: u64, class: Class) -> Result<(), String> {
        let Some(&slot) = self.index.get(&key) else {
            if self.overrides.len() >= MAX_OVERRIDES && !self.overrides.contains_key(&key) {
                return Err(format!("more than {MAX_OVERRIDES} class overrides"));
            }
            self.overrides.insert(key, class);
            return Ok(());
        };
        self.overrides.insert(key, class);
        let Some(f) = self.flows.get_mut(slot) else { return Ok(()) };
        let old = f.class;
        f.class = class;
        f.cold.vars.class.store(&Value::Str(class.name().into()));
        if f.active && old != class {
            self.active[old as usize].remove(slot);
            self.active[class as usize].push(slot);
        }
        Ok(())
    }
}

impl Module for Binding {
    fn process(&mut self, port: usize, input: &mut Batch, out: &mut Output<'_>) {
        let now = out.now();
        self.apply_downs(now, out);
        self.advance(now, out);
        if port == IN_DOWN && self.binds_at_once(input, now) {
            self.bind_batch(input, now, out);
            if let Some(t) = self.settle(now, out) {
                out.wake_at(t);
            }
            return;
        }
        let mut slots = std::mem::take(&mut self.arrivals);
        slots.clear();
        if port == IN_DOWN && self.cfg.mode == Mode::Late && input.len() >= ARRIVAL_PREFETCH_MIN {
            self.prefetch_arrivals(input, &mut slots);
        }
        for (k, f) in input.drain(..).enumerate() {
            match port {
                IN_DOWN => self.enqueue(f, slots.get(k).copied().unwrap_or(NIL), now, out),
                _ => self.map_up(f, out),
            }
        }
        self.arrivals = slots;
        if let Some(t) = self.settle(now, out) {
            out.wake_at(t);
        }
    }

    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        let now = out.now();
        self.apply_downs(now, out);
        self.advance(now, out);
        self.settle(now, out)
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        let bad = || format!("cannot set {knob} to {value}");
        if let Some(key) = self.flow_class_knob(knob) {
            let Value::Str(text) = value else { return Err(bad()) };
            let class = Class::parse(text).ok_or_else(|| format!("{knob}: expected urgent, interactive or bulk"))?;
            return self.set_class(key, class);
        }
        let Some((name, param)) = knob.rsplit_once('.') else {
            return self.cfg.mode.decl().write(&mut self.cfg, knob, value).map_err(|_| bad());
        };
        let decl = self.cfg.mode.iface_decl();
        let iface = self.ifaces.iter_mut().find(|i| i.cfg.name == name).ok_or_else(bad)?;
        match (param, value) {
            // Going down drops what the device queue holds, at the next call.
            ("up", Value::Bool(v)) => self.downs_pending |= iface.set_up(*v),
            ("emit", Value::Str(s)) => {
                decl.write(&mut iface.cfg, name, param, value)
                    .map_err(|_| format!("cannot set {knob} to {s:?}: expected start or admit"))?;
                // To admit: what the ring still holds goes at the next call (the switch polls the module after a
                // write). To start: only packets bound from now on wait for their start.
                iface.flush_held |= iface.cfg.emit == Emit::Admit;
            }
            _ => decl.write(&mut iface.cfg, name, param, value).map_err(|_| bad())?,
        }
        if param.starts_with("rate_") {
            // The rate's two names show the same rate.
            iface.m.rate[0].store(&Value::F64(iface.cfg.rate_bps as f64 / 1e6));
            iface.m.rate[1].set(iface.cfg.rate_bps);
        }
        if let Some(new) = decl.new_name_of(param) {
            self.deprecations.report(knob, &format!("{name}.{new}"));
        }
        Ok(())
    }

    fn link_changed(&mut self, face: &str, up: bool) -> bool {
        let mut acted = false;
        for iface in self.ifaces.iter_mut().filter(|i| i.cfg.face.as_deref() == Some(face)) {
            self.downs_pending |= iface.set_up(up);
            iface.m.up.store(&Value::Bool(up));
            acted = true;
        }
        acted
    }

    fn execute(&mut self, procedure: &str, argument: &Value, _out: &mut Output<'_>) -> Result<Value, String> {
        if procedure != "class" {
            return Err(format!("no procedure named {procedure} (procedures: class)"));
        }
        let text = match argument {
            Value::Str(s) => s.as_str(),
            other => return Err(format!("class expects \"<flow id> <class>\", got {other}")),
        };
        let (id, class) = text
            .split_once(' ')
            .and_then(|(i, c)| {
                Some((i.trim().parse::<u64>().ok().filter(|i| i & HASHED == 0)?, Class::parse(c.trim())?))
            })
            .ok_or_else(|| format!("class expects \"<flow id> <urgent|interactive|bulk>\", got {text:?}"))?;
        self.set_class(id, class)?;
        Ok(Value::Str(format!("flow {id}: {}", class.name())))
    }
}

#[cfg(test)]
mod tests;
