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
//!   `<iface>.device_queue` packets, drained at `<iface>.rate_bps`. A packet admitted at `now` starts its modelled
//!   transmission when the previous one ends (or at `now`) and leaves the device queue when its transmission time
//!   (`(len + overhead_bytes) * 8 / rate`) has passed. `<iface>.overhead_bytes` is the link layer's per-packet
//!   addition (14 for Ethernet), so that the model drains no faster than the link behind it. With `rate_bps = 0`
//!   nothing is modelled: packets pass at once. `<iface>.emit` says when a packet is emitted on the interface's
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
//! Ports: input `in` and `up_in` (ip); one output per interface, named as in `interfaces`, then `up_out` (ip).
//!
//! Settings: `interfaces` (array of names, required, at most 16), `policy` (knob), `class_rules` (array of rules
//! `CLASS [tcp|udp|icmp] [port N] [dscp N]`, first match wins, a port matching either end), `virtual_v4`,
//! `virtual_v6`, `vars_prefix` (default `flow`), per interface `"<iface>.address_v4"` and `"<iface>.address_v6"`
//! (quoted dotted keys in TOML), `"<iface>.face"` (the face module of that interface: its link going down or up
//! sets `<iface>.up`, see `Module::link_changed`), and every knob.
//!
//! Knobs: `policy` (text), `quantum` (bytes, default 1514, late only), `queue_limit` (packets, default 10000, late
//! only), `flow_idle_ms` (default 30000: a flow with nothing queued is forgotten after this long), per interface
//! `<iface>.rate_bps` (bit/s, default 0), `<iface>.overhead_bytes` (bytes per packet, default 0),
//! `<iface>.device_queue` (packets, default 2 late / 50 early), `<iface>.emit` (text, `start` or `admit`, default
//! `start`; switched to `admit`, the packets the device queue still holds are emitted at the next call, in order;
//! switched to `start`, packets bound afterwards wait for their start), `<iface>.up` (default true),
//! `<iface>.weight` (default 1), and early only `<iface>.fifo_limit`.
//!
//! Meters: `queued`, `queued_bytes`, `flows_active`, `rebinds_total`, `drop_queue_full_total`,
//! `drop_no_interface_total`, `drop_interface_down_total` (all interfaces), `up_mapped_total`,
//! `flow_vars_unpublished_total`, parse drops `drop_<reason>_total`; per interface `<iface>.device_queue_len`,
//! `<iface>.queue_len` (early: FIFO), `<iface>.bound_packets_total`, `<iface>.bound_bytes_total`,
//! `<iface>.rebinds_total`, `<iface>.drop_interface_down_total`, `<iface>.drop_queue_full_total`,
//! `<iface>.tx_interrupted_total`; per flow, under `<vars_prefix>.<flow>.binding.`: `class`, `interface`,
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

use crate::flow::table::Slab;
use flexstack_core::config::{valid_name, SettingsReader};
use flexstack_core::module::port_type;
use flexstack_core::{
    Batch, ConfigError, Frame, MetaKey, Meter, Module, ModuleBuilder, ModuleInterface, ModuleKind, ModuleVars, Output,
    Packet, PortSpec, Settings, Time, Value, ValueType, VarSpec,
};
use flexstack_wire::cidr::Words;
use flexstack_wire::packet::{proto, PacketInfo, ParseDrops};
use flexstack_wire::rewrite::{self, Layout};
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

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
const MAX_RATE_BPS: u64 = 1_000_000_000_000;
const MAX_DEVICE_QUEUE: u64 = 1_000_000;
/// Largest per-packet link-layer overhead modelled, in bytes.
const MAX_OVERHEAD: u64 = 1024;
const MAX_QUEUE_LIMIT: u64 = 10_000_000;
const MAX_QUANTUM: u64 = 1_000_000;
const MIN_QUANTUM: u64 = 64;
const MAX_WEIGHT: u64 = 1_000_000;
const MAX_IDLE_MS: u64 = 7 * 24 * 3_600_000;
/// Most class overrides remembered for flows not seen yet.
const MAX_OVERRIDES: usize = 65_536;
/// Port names an interface may not take.
const RESERVED: [&str; 4] = ["in", "up_in", "up_out", "ctl"];
/// Per-flow meters (`queued`, `queue_delay_ns`) are written at most this often (ns of module time), for the flows
/// that changed since: writing them per packet touched two more cache lines per packet and flow.
const PUBLISH_NS: u64 = 100_000_000;
/// After each binding, the packets the next `PREFETCH_PACKETS` bindings will take (by deficit round robin, among
/// the first `NEAR_FLOWS` flows of the round) are prefetched: their slot and header line, and for the very next
/// one its bytes up to `PREFETCH_BYTES` (the header is rewritten at binding, the rest is read by the face that
/// sends the packet; in a deep backlog served out of arrival order the packet is nowhere in the caches and the
/// hardware prefetchers cannot guess it). A packet's bytes are asked for once, one binding ahead: asking for
/// them two ahead as well kept more misses in flight than the core tracks and cost more than it saved. The
/// queue nodes of the `FAR_FLOWS` flows after them are prefetched too, so that reading them two or three
/// bindings later does not wait for memory.
const PREFETCH_PACKETS: usize = 2;
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
const PREFETCH_MIN_BYTES: u64 = 1 << 20;
/// A batch going down of at least this many packets is taken in passes (late binding): first every packet's flow
/// is looked up and its state asked for ([`prefetch`]), then the link its queue's last packet has, then the packets
/// are queued. At 10,000 flows these are reads at random in memory, known only when the packet arrives; in passes
/// the reads of a batch overlap instead of each waiting in turn (the software pipelining of VPP). The daemon hands
/// a module whole batches (up to 256 frames per face per wake-up); a single packet gains nothing from it.
const ARRIVAL_PREFETCH_MIN: usize = 2;
/// A cache line (x86_64, aarch64).
const LINE: usize = 64;

/// Asks the CPU to start loading the cache line holding `addr` into its caches: a hint only, never a read (a
/// stale or unmapped address is ignored), so it costs no wait. A no-op where there is no such instruction. Public
/// for the scheduler bench's reference (`benches/binding.rs`), which prefetches as the scheduler does.
#[inline(always)]
pub fn prefetch(addr: usize) {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse"))]
    #[allow(unsafe_code)]
    // SAFETY: `_mm_prefetch` is unsafe only because it is a `#[target_feature(enable = "sse")]` function; SSE is
    // statically enabled here (the cfg above; it is in every x86_64 target's baseline). PREFETCHT0 does not access
    // memory architecturally: it never faults and reads or writes nothing the program can observe, whatever the
    // address.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(addr as *const i8)
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse")))]
    let _ = addr;
}

/// No node: the end of a flow's queue.
const NIL: u32 = u32::MAX;
/// The link of a node that is last in its flow.
const NO_LINK: u64 = (NIL as u64) << 32;

/// splitmix64's finalizer: a cheap, well-mixing hash of a 64-bit word.
fn mix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The hasher of the flow index: its keys are u64 flow keys, hashed by [`mix64`] (std's SipHash cost about 45
/// instructions a lookup, and needs no protection here: flow ids come from `classify`, 5-tuple keys are already
/// SipHash values).
#[derive(Default)]
struct FlowKeyHasher(u64);

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
type FlowMap<V> = HashMap<u64, V, BuildHasherDefault<FlowKeyHasher>>;

// -------------------------------------------------------------------------------------------------------------
// Classes, policies, rules
// -------------------------------------------------------------------------------------------------------------

/// A traffic class; lower values are served first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Class {
    /// Served before everything else.
    Urgent = 0,
    /// Served before bulk.
    Interactive = 1,
    /// Served last (the default).
    Bulk = 2,
}

impl Class {
    const ALL: [Class; 3] = [Class::Urgent, Class::Interactive, Class::Bulk];

    /// The class's name.
    pub fn name(self) -> &'static str {
        match self {
            Class::Urgent => "urgent",
            Class::Interactive => "interactive",
            Class::Bulk => "bulk",
        }
    }

    /// The class named `s`.
    pub fn parse(s: &str) -> Option<Class> {
        Class::ALL.into_iter().find(|c| c.name() == s)
    }

    /// The class of a DSCP: EF (46), VOICE-ADMIT (44), CS5-CS7 (40, 48, 56) are urgent; AF2x-AF4x and CS2-CS4
    /// (16-38) are interactive; everything else (best effort, CS1/lower effort, AF1x) is bulk.
    pub fn from_dscp(dscp: u8) -> Class {
        match dscp {
            40 | 44 | 46 | 48 | 56 => Class::Urgent,
            16..=38 => Class::Interactive,
            _ => Class::Bulk,
        }
    }
}

/// How the interface of a packet is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// The first interface that is up, in the order of `interfaces`.
    Preferred,
    /// A flow stays on its interface while it is up; first choice: the fastest.
    Affinity,
    /// Flows split over the up interfaces in proportion to their weights.
    Weighted,
    /// Per packet, the up interface whose modelled transmission would end first.
    Fastest,
}

impl Policy {
    const NAMES: [(&'static str, Policy); 4] = [
        ("preferred", Policy::Preferred),
        ("affinity", Policy::Affinity),
        ("weighted", Policy::Weighted),
        ("fastest", Policy::Fastest),
    ];

    /// The policy named `s`.
    pub fn parse(s: &str) -> Option<Policy> {
        Self::NAMES.iter().find(|(n, _)| *n == s).map(|(_, p)| *p)
    }

    /// The policy's name.
    pub fn name(self) -> &'static str {
        Self::NAMES.iter().find(|(_, p)| *p == self).map_or("", |(n, _)| n)
    }
}

/// When a bound packet is handed to its interface's output port (knob `<iface>.emit`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Emit {
    /// At its modelled transmission start (the default): the model paces the packets itself.
    Start,
    /// At binding, when it is admitted to the modelled device queue: the link behind the port paces them, the
    /// model only decides when there is room.
    Admit,
}

impl Emit {
    const NAMES: [(&'static str, Emit); 2] = [("start", Emit::Start), ("admit", Emit::Admit)];

    /// The emission point named `s`.
    pub fn parse(s: &str) -> Option<Emit> {
        Self::NAMES.iter().find(|(n, _)| *n == s).map(|(_, e)| *e)
    }

    /// The emission point's name.
    pub fn name(self) -> &'static str {
        Self::NAMES.iter().find(|(_, e)| *e == self).map_or("", |(n, _)| n)
    }
}

/// A rule of `class_rules`: packets matching every condition given start flows of `class`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassRule {
    /// The class given.
    pub class: Class,
    /// Transport protocol, if limited.
    pub protocol: Option<u8>,
    /// A port either end must have (TCP/UDP).
    pub port: Option<u16>,
    /// The DSCP the packet must carry.
    pub dscp: Option<u8>,
}

impl ClassRule {
    /// Parses `CLASS [tcp|udp|icmp] [port N] [dscp N]`.
    pub fn parse(text: &str) -> Result<ClassRule, String> {
        let mut w = Words::new(text);
        let c = w.next("a class (urgent, interactive, bulk)")?;
        let class = Class::parse(c).ok_or_else(|| w.error_last("expected a class (urgent, interactive, bulk)"))?;
        let mut rule = ClassRule { class, protocol: None, port: None, dscp: None };
        rule.protocol = match w.peek() {
            Some("tcp") => Some(proto::TCP),
            Some("udp") => Some(proto::UDP),
            Some("icmp") => Some(proto::ICMP),
            _ => None,
        };
        if rule.protocol.is_some() {
            w.next("a protocol")?;
        }
        if w.eat("port") {
            let p = w.next("a port number")?;
            rule.port = Some(p.parse().map_err(|_| w.error_last("expected a port number (0-65535)"))?);
        }
        if w.eat("dscp") {
            let d = w.next("a DSCP (0-63)")?;
            rule.dscp =
                Some(d.parse().ok().filter(|d: &u8| *d < 64).ok_or_else(|| w.error_last("expected a DSCP (0-63)"))?);
        }
        w.end("`port N`, `dscp N` or the end of the rule")?;
        Ok(rule)
    }

    fn matches(&self, info: &PacketInfo, dscp: u8) -> bool {
        let proto_ok = match self.protocol {
            None => true,
            Some(proto::ICMP) => matches!(info.protocol, proto::ICMP | proto::ICMPV6),
            Some(p) => info.protocol == p,
        };
        proto_ok
            && self.port.is_none_or(|p| info.has_ports() && (info.src_port == p || info.dst_port == p))
            && self.dscp.is_none_or(|d| d == dscp)
    }
}

/// The DSCP of an IP packet (the upper six bits of the IPv4 TOS or IPv6 traffic class).
fn dscp_of(data: &[u8]) -> u8 {
    match data {
        [b0, b1, ..] if b0 >> 4 == 6 => (((b0 & 0x0f) << 4) | (b1 >> 4)) >> 2,
        [_, b1, ..] => b1 >> 2,
        _ => 0,
    }
}

// -------------------------------------------------------------------------------------------------------------
// Configuration
// -------------------------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Late,
    Early,
}

impl Mode {
    fn kind(self) -> &'static str {
        match self {
            Mode::Late => LATE_KIND,
            Mode::Early => EARLY_KIND,
        }
    }
}

/// One interface's configuration (knobs included).
#[derive(Clone, Debug)]
struct IfaceConfig {
    name: String,
    address_v4: Option<Ipv4Addr>,
    address_v6: Option<Ipv6Addr>,
    rate_bps: u64,
    overhead_bytes: u64,
    device_queue: u64,
    up: bool,
    weight: u64,
    fifo_limit: u64,
    /// When a bound packet is emitted: at its modelled transmission start, or at once.
    emit: Emit,
    /// The face module whose link state drives `up` (carrier lost: down; back: up).
    face: Option<String>,
}

#[derive(Clone, Debug)]
struct Config {
    mode: Mode,
    ifaces: Vec<IfaceConfig>,
    policy: Policy,
    quantum: u64,
    queue_limit: u64,
    flow_idle_ms: u64,
    rules: Vec<ClassRule>,
    virtual_v4: Option<Ipv4Addr>,
    virtual_v6: Option<Ipv6Addr>,
    vars_prefix: String,
}

/// The per-interface setting names (`<iface>.<key>`), in the order `configure` reads them.
const IFACE_KEYS: [&str; 10] = [
    "address_v4",
    "address_v6",
    "rate_bps",
    "device_queue",
    "up",
    "weight",
    "fifo_limit",
    "overhead_bytes",
    "face",
    "emit",
];

/// Reads an address setting of family v6 (or v4).
fn read_addr<'a>(r: &mut SettingsReader<'a>, key: &'a str, v6: bool) -> Result<Option<IpAddr>, ConfigError> {
    let Some(t) = r.string(key)? else { return Ok(None) };
    match t.parse::<IpAddr>() {
        Ok(a) if a.is_ipv6() == v6 => Ok(Some(a)),
        _ => Err(r.error(key, format_args!("expected an IPv{} address, got {t:?}", if v6 { 6 } else { 4 }))),
    }
}

fn configure(mode: Mode, settings: &Settings) -> Result<Config, ConfigError> {
    let kind = mode.kind();
    // The interface names come first: the other settings' names depend on them.
    let names = {
        let mut r = settings.reader(kind);
        let names = r.strings("interfaces")?;
        let err = |m: String| r.error("interfaces", m);
        let names = names.ok_or_else(|| {
            ConfigError::new(None, format!("a {kind} module needs `interfaces`, e.g. interfaces = [\"wlan\", \"lte\"]"))
        })?;
        if names.is_empty() || names.len() > MAX_INTERFACES {
            return Err(err(format!("expected 1 to {MAX_INTERFACES} interface names, got {}", names.len())));
        }
        for (i, n) in names.iter().enumerate() {
            if !valid_name(n) || RESERVED.contains(&n.as_str()) {
                return Err(err(format!(
                    "invalid interface name {n:?}: expected lowercase letters, digits, '_' or '-', not one of {}",
                    RESERVED.join(", ")
                )));
            }
            if names[..i].contains(n) {
                return Err(err(format!("interface {n:?} is named twice")));
            }
        }
        names
    };
    let keys: Vec<String> = names.iter().flat_map(|n| IFACE_KEYS.iter().map(move |k| format!("{n}.{k}"))).collect();
    let mut r = settings.reader(kind);
    r.strings("interfaces")?;
    let policy_text = r.string("policy")?.unwrap_or_else(|| "preferred".into());
    let policy = Policy::parse(&policy_text).ok_or_else(|| {
        r.error("policy", format_args!("expected preferred, affinity, weighted or fastest, got {policy_text:?}"))
    })?;
    let quantum = r.u64_in("quantum", 1514, MIN_QUANTUM, MAX_QUANTUM)?;
    let queue_limit = r.u64_in("queue_limit", 10_000, 1, MAX_QUEUE_LIMIT)?;
    let flow_idle_ms = r.u64_in("flow_idle_ms", 30_000, 1, MAX_IDLE_MS)?;
    let rules = r
        .strings("class_rules")?
        .unwrap_or_default()
        .iter()
        .enumerate()
        .map(|(i, t)| {
            ClassRule::parse(t).map_err(|e| r.error("class_rules", format_args!("rule {} {t:?}: {e}", i + 1)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let v4 = |a: Option<IpAddr>| match a {
        Some(IpAddr::V4(a)) => Some(a),
        _ => None,
    };
    let v6 = |a: Option<IpAddr>| match a {
        Some(IpAddr::V6(a)) => Some(a),
        _ => None,
    };
    let virtual_v4 = v4(read_addr(&mut r, "virtual_v4", false)?);
    let virtual_v6 = v6(read_addr(&mut r, "virtual_v6", true)?);
    let vars_prefix = r.string("vars_prefix")?.unwrap_or_else(|| "flow".into());
    if !(vars_prefix == "flow" || vars_prefix.strip_prefix("flow.").is_some_and(|rest| rest.split('.').all(valid_name)))
    {
        return Err(r.error("vars_prefix", format_args!("expected `flow` or `flow.NAME`, got {vars_prefix:?}")));
    }
    let default_dq = if mode == Mode::Late { 2 } else { 50 };
    let mut ifaces = Vec::new();
    for (name, k) in names.iter().zip(keys.chunks(IFACE_KEYS.len())) {
        let address_v4 = v4(read_addr(&mut r, &k[0], false)?);
        let address_v6 = v6(read_addr(&mut r, &k[1], true)?);
        let rate_bps = r.u64_in(&k[2], 0, 0, MAX_RATE_BPS)?;
        let device_queue = r.u64_in(&k[3], default_dq, 1, MAX_DEVICE_QUEUE)?;
        let up = r.bool(&k[4])?.unwrap_or(true);
        let weight = r.u64_in(&k[5], 1, 0, MAX_WEIGHT)?;
        let fifo_limit = if mode == Mode::Early { r.u64_in(&k[6], 1000, 0, MAX_QUEUE_LIMIT)? } else { 0 };
        let overhead_bytes = r.u64_in(&k[7], 0, 0, MAX_OVERHEAD)?;
        let face = r.string(&k[8])?;
        let emit_text = r.string(&k[9])?.unwrap_or_else(|| Emit::Start.name().into());
        let emit = Emit::parse(&emit_text)
            .ok_or_else(|| r.error(&k[9], format_args!("expected start or admit, got {emit_text:?}")))?;
        ifaces.push(IfaceConfig {
            name: name.clone(),
            address_v4,
            address_v6,
            rate_bps,
            overhead_bytes,
            device_queue,
            up,
            weight,
            fifo_limit,
            emit,
            face,
        });
    }
    r.finish()?;
    Ok(Config { mode, ifaces, policy, quantum, queue_limit, flow_idle_ms, rules, virtual_v4, virtual_v6, vars_prefix })
}

/// The `late-binding` module kind.
pub struct LateBindingKind;
/// The `early-binding` module kind.
pub struct EarlyBindingKind;

impl ModuleKind for LateBindingKind {
    fn name(&self) -> &'static str {
        LATE_KIND
    }

    fn summary(&self) -> &'static str {
        "per-flow queues above a binding point; each packet bound to an interface (policy, address) only when it has room"
    }

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        Ok(Box::new(BindingBuilder(configure(Mode::Late, settings)?)))
    }
}

impl ModuleKind for EarlyBindingKind {
    fn name(&self) -> &'static str {
        EARLY_KIND
    }

    fn summary(&self) -> &'static str {
        "stock-Linux comparison: interface chosen at enqueue, per-interface FIFO and device buffer, lost when it goes down"
    }

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        Ok(Box::new(BindingBuilder(configure(Mode::Early, settings)?)))
    }
}

struct BindingBuilder(Config);

/// Module-level meters: name, unit, description.
const METERS: [(&str, &str, &str); 9] = [
    ("queued", "frames", "packets waiting above the binding point (late) or in the FIFOs (early)"),
    ("queued_bytes", "bytes", "bytes waiting above the binding point (late) or in the FIFOs (early)"),
    ("flows_active", "flows", "flows the scheduler knows"),
    ("rebinds_total", "frames", "packets bound to another interface than their flow's previous packet"),
    ("drop_queue_full_total", "frames", "packets dropped: queue_limit (late) or an interface's FIFO (early) full"),
    ("drop_no_interface_total", "frames", "packets dropped on arrival with no interface up (early)"),
    ("drop_interface_down_total", "frames", "packets lost below the binding point when their interface went down"),
    ("up_mapped_total", "frames", "packets coming up whose destination was mapped to the virtual address"),
    ("flow_vars_unpublished_total", "flows", "flows whose runtime variables could not be registered"),
];

/// Per-interface meters: name, unit, description.
const IFACE_METERS: [(&str, &str, &str); 8] = [
    ("queue_len", "frames", "packets in the interface's FIFO (early binding)"),
    ("device_queue_len", "frames", "packets in the modelled device queue"),
    ("bound_packets_total", "frames", "packets bound to the interface"),
    ("bound_bytes_total", "bytes", "bytes bound to the interface"),
    ("rebinds_total", "frames", "packets bound here whose flow's previous packet went elsewhere"),
    ("drop_interface_down_total", "frames", "packets lost (not yet started) when the interface went down"),
    ("drop_queue_full_total", "frames", "packets dropped because the FIFO was full (early binding)"),
    ("tx_interrupted_total", "frames", "packets whose modelled transmission was cut by the interface going down"),
];

impl ModuleBuilder for BindingBuilder {
    fn interface(&self) -> ModuleInterface {
        let c = &self.0;
        let mut vars = vec![
            VarSpec::knob("policy", ValueType::Str, "", "preferred, affinity, weighted or fastest"),
            VarSpec::knob("flow_idle_ms", ValueType::U64, "ms", "a flow with nothing queued is forgotten after this")
                .with_range(1.0, MAX_IDLE_MS as f64),
        ];
        if c.mode == Mode::Late {
            vars.push(
                VarSpec::knob("quantum", ValueType::U64, "bytes", "deficit round robin: bytes per flow per round")
                    .with_range(MIN_QUANTUM as f64, MAX_QUANTUM as f64),
            );
            vars.push(
                VarSpec::knob("queue_limit", ValueType::U64, "frames", "most packets above the binding point")
                    .with_range(1.0, MAX_QUEUE_LIMIT as f64),
            );
        }
        vars.extend(METERS.iter().map(|&(n, u, d)| VarSpec::meter(n, ValueType::U64, u, d)));
        vars.extend(ParseDrops::specs(true));
        for i in &c.ifaces {
            let n = &i.name;
            vars.push(
                VarSpec::knob(
                    &format!("{n}.rate_bps"),
                    ValueType::U64,
                    "bit/s",
                    "modelled transmit rate; 0 = unmodelled",
                )
                .with_range(0.0, MAX_RATE_BPS as f64),
            );
            vars.push(
                VarSpec::knob(
                    &format!("{n}.overhead_bytes"),
                    ValueType::U64,
                    "bytes",
                    "link-layer bytes added to each packet in the modelled transmission time (Ethernet: 14)",
                )
                .with_range(0.0, MAX_OVERHEAD as f64),
            );
            vars.push(
                VarSpec::knob(
                    &format!("{n}.device_queue"),
                    ValueType::U64,
                    "frames",
                    "size of the modelled device queue",
                )
                .with_range(1.0, MAX_DEVICE_QUEUE as f64),
            );
            vars.push(VarSpec::knob(
                &format!("{n}.emit"),
                ValueType::Str,
                "",
                "start (emit a packet at its modelled transmission start) or admit (at once, when it enters the device queue)",
            ));
            vars.push(VarSpec::knob(&format!("{n}.up"), ValueType::Bool, "", "the interface is up"));
            vars.push(
                VarSpec::knob(&format!("{n}.weight"), ValueType::U64, "", "share of flows (policy weighted)")
                    .with_range(0.0, MAX_WEIGHT as f64),
            );
            if c.mode == Mode::Early {
                vars.push(
                    VarSpec::knob(&format!("{n}.fifo_limit"), ValueType::U64, "frames", "most packets in the FIFO")
                        .with_range(0.0, MAX_QUEUE_LIMIT as f64),
                );
            }
            vars.extend(
                IFACE_METERS.iter().map(|&(m, u, d)| VarSpec::meter(&format!("{n}.{m}"), ValueType::U64, u, d)),
            );
        }
        let mut outputs: Vec<PortSpec> =
            c.ifaces.iter().map(|i| PortSpec::new(i.name.clone(), port_type::IP)).collect();
        outputs.push(PortSpec::new("up_out", port_type::IP));
        ModuleInterface {
            inputs: vec![PortSpec::new("in", port_type::IP), PortSpec::new("up_in", port_type::IP)],
            outputs,
            vars,
            breaks_cycles: false,
        }
    }

    fn paths(&self) -> Option<Vec<(String, String)>> {
        let mut p: Vec<(String, String)> = self.0.ifaces.iter().map(|i| ("in".into(), i.name.clone())).collect();
        p.push(("up_in".into(), "up_out".into()));
        Some(p)
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        let c = self.0;
        vars.meter("policy").store(&Value::Str(c.policy.name().into()));
        vars.meter("flow_idle_ms").set(c.flow_idle_ms);
        if c.mode == Mode::Late {
            vars.meter("quantum").set(c.quantum);
            vars.meter("queue_limit").set(c.queue_limit);
        }
        let ifaces = c
            .ifaces
            .iter()
            .map(|i| {
                let m = |s: &str| vars.meter(&format!("{}.{s}", i.name));
                m("rate_bps").set(i.rate_bps);
                m("overhead_bytes").set(i.overhead_bytes);
                m("device_queue").set(i.device_queue);
                m("up").store(&Value::Bool(i.up));
                m("weight").set(i.weight);
                m("emit").store(&Value::Str(i.emit.name().into()));
                if c.mode == Mode::Early {
                    m("fifo_limit").set(i.fifo_limit);
                }
                Iface {
                    cfg: i.clone(),
                    ring: VecDeque::with_capacity(i.device_queue.min(4096) as usize),
                    busy_until: Time::ZERO,
                    fifo: VecDeque::new(),
                    fifo_bytes: 0,
                    pending_down: false,
                    flush_held: false,
                    m: IfaceMeters {
                        queue_len: m("queue_len"),
                        device_queue_len: m("device_queue_len"),
                        bound_packets: m("bound_packets_total"),
                        bound_bytes: m("bound_bytes_total"),
                        rebinds: m("rebinds_total"),
                        drop_down: m("drop_interface_down_total"),
                        drop_full: m("drop_queue_full_total"),
                        interrupted: m("tx_interrupted_total"),
                        up: m("up"),
                    },
                }
            })
            .collect();
        let m = |s: &str| vars.meter(s);
        Box::new(Binding {
            meters: Meters {
                queued: m("queued"),
                queued_bytes: m("queued_bytes"),
                flows_active: m("flows_active"),
                rebinds: m("rebinds_total"),
                drop_full: m("drop_queue_full_total"),
                drop_no_iface: m("drop_no_interface_total"),
                drop_down: m("drop_interface_down_total"),
                up_mapped: m("up_mapped_total"),
                unpublished: m("flow_vars_unpublished_total"),
            },
            drops: ParseDrops::new(vars),
            ifaces,
            cfg: Settings2 {
                mode: c.mode,
                policy: c.policy,
                quantum: c.quantum,
                queue_limit: c.queue_limit,
                flow_idle_ns: c.flow_idle_ms * 1_000_000,
                rules: c.rules,
                virtual_v4: c.virtual_v4,
                virtual_v6: c.virtual_v6,
                vars_prefix: c.vars_prefix,
            },
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
            flow_specs: flow_specs(),
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

/// The module's parameters while it runs.
struct Settings2 {
    mode: Mode,
    policy: Policy,
    quantum: u64,
    queue_limit: u64,
    flow_idle_ns: u64,
    rules: Vec<ClassRule>,
    virtual_v4: Option<Ipv4Addr>,
    virtual_v6: Option<Ipv6Addr>,
    vars_prefix: String,
}

struct Meters {
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

struct IfaceMeters {
    queue_len: Meter,
    device_queue_len: Meter,
    bound_packets: Meter,
    bound_bytes: Meter,
    rebinds: Meter,
    drop_down: Meter,
    drop_full: Meter,
    interrupted: Meter,
    /// The `up` knob's cell, written when the face's link changes.
    up: Meter,
}

/// A packet waiting to be bound.
struct Queued {
    pkt: Packet,
    hdr: Layout,
    at: Time,
    flow: u32,
}

/// A packet of a batch being bound whole ([`Binding::bind_batch`]): taken when bound; `next` is the flow's next
/// packet in the batch ([`NIL`]: none).
struct Held {
    pkt: Option<Packet>,
    hdr: Layout,
    len: u32,
    next: u32,
}

/// A packet in a modelled device queue, gone at `end`: with `emit` = `start` it is emitted at `start` (`pkt` is
/// taken then); with `admit` it was emitted when it entered (`pkt` is `None` from the start).
struct InRing {
    start: Time,
    end: Time,
    pkt: Option<Packet>,
}

struct Iface {
    cfg: IfaceConfig,
    ring: VecDeque<InRing>,
    /// When the modelled transmitter is free.
    busy_until: Time,
    /// Early binding: packets bound at enqueue, waiting for the device queue.
    fifo: VecDeque<Queued>,
    fifo_bytes: u64,
    pending_down: bool,
    /// `emit` was switched to `admit` while the device queue may hold packets not emitted yet: the next call
    /// emits them (in ring order).
    flush_held: bool,
    m: IfaceMeters,
}

impl Iface {
    /// Takes the interface up or down (the `up` knob, or its face's link); true if it went down, so that the next
    /// call applies the down (drops its device queue, re-pins its flows).
    fn set_up(&mut self, up: bool) -> bool {
        let went_down = self.cfg.up && !up;
        self.pending_down |= went_down;
        self.cfg.up = up;
        went_down
    }

    /// Transmission time of `bytes` in `packets` packets at the interface's rate (each with the link-layer
    /// overhead), in ns.
    fn tx_ns(&self, bytes: u64, packets: u64) -> u64 {
        let bytes = u128::from(bytes) + u128::from(packets) * u128::from(self.cfg.overhead_bytes);
        match self.cfg.rate_bps {
            0 => 0,
            r => u64::try_from(bytes * 8 * 1_000_000_000 / u128::from(r)).unwrap_or(u64::MAX),
        }
    }

    fn has_room(&self) -> bool {
        self.cfg.up && (self.ring.len() as u64) < self.cfg.device_queue
    }

    /// When a packet of `len` bytes would finish if sent after everything the interface holds.
    fn completion(&self, now: Time, len: u64) -> u64 {
        self.busy_until.max(now).0.saturating_add(self.tx_ns(self.fifo_bytes + len, self.fifo.len() as u64 + 1))
    }
}

struct FlowVars {
    class: Meter,
    iface: Meter,
    queued: Meter,
    delay: Meter,
}

/// A packet of a flow waiting above the binding point (late binding): a node of the queue arena shared by all
/// flows ([`Nodes`], which links it to the flow's next packet). Its length is kept here, so deciding whether it may
/// go does not read the packet.
struct Node {
    pkt: Packet,
    /// Address of the packet's first byte, for [`prefetch`] only (never dereferenced; stale if the packet is
    /// copied on write at binding, which makes the hint useless, not wrong).
    data: usize,
    hdr: Layout,
    at: Time,
    len: u32,
}

/// The queue nodes of all flows: a slab (as [`Slab`]) whose entries' addresses can be computed without reading
/// them, for [`prefetch`], with the links between a flow's nodes kept apart.
#[derive(Default)]
struct Nodes {
    entries: Vec<Option<Node>>,
    /// Per entry, the next node of its flow and that node's length (`next << 32 | len`): apart from the nodes,
    /// so that linking a packet behind its flow's last one writes 8 bytes in a small array.
    links: Vec<u64>,
    free: Vec<u32>,
}

impl Nodes {
    /// Stores `node`, last of its flow (no link yet); returns its index.
    fn insert(&mut self, node: Node) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.entries[i as usize] = Some(node);
                self.links[i as usize] = NO_LINK;
                i
            }
            None => {
                self.entries.push(Some(node));
                self.links.push(NO_LINK);
                (self.entries.len() - 1) as u32
            }
        }
    }

    /// Node `i`, if it holds one.
    fn get(&self, i: u32) -> Option<&Node> {
        self.entries.get(i as usize).and_then(Option::as_ref)
    }

    /// Takes node `i` out; its index is reused by the next insert.
    fn remove(&mut self, i: u32) -> Option<Node> {
        let node = self.entries.get_mut(i as usize)?.take()?;
        self.free.push(i);
        Some(node)
    }

    /// The node after `i` in its flow ([`NIL`]: none) and that node's packet length.
    fn next_of(&self, i: u32) -> (u32, u32) {
        let l = self.links.get(i as usize).copied().unwrap_or(NO_LINK);
        ((l >> 32) as u32, l as u32)
    }

    /// Links `next` (of `len` bytes) behind `i`.
    fn link(&mut self, i: u32, next: u32, len: u32) {
        if let Some(l) = self.links.get_mut(i as usize) {
            *l = (u64::from(next) << 32) | u64::from(len);
        }
    }

    /// Hints the CPU to load node `i`'s link.
    fn prefetch_link(&self, i: u32) {
        if (i as usize) < self.links.len() {
            prefetch(self.links.as_ptr().wrapping_add(i as usize) as usize);
        }
    }

    /// Hints the CPU to load node `i`, both cache lines it may straddle (an index past the end is ignored).
    fn prefetch(&self, i: u32) {
        if (i as usize) < self.entries.len() {
            let at = self.entries.as_ptr().wrapping_add(i as usize) as usize;
            prefetch(at);
            prefetch(at + std::mem::size_of::<Option<Node>>() - 1);
        }
    }
}

/// What the scheduler reads and writes per packet of a flow, in one cache line: with 10,000 flows queued the
/// flows no longer fit in the nearer caches, and each extra line a packet touches is a miss.
#[repr(align(64))]
struct Flow {
    /// First and last node of the flow's queue in the arena ([`NIL`]: empty).
    head: u32,
    tail: u32,
    /// Length of the head packet.
    head_len: u32,
    /// Packets of the flow in the queue (late) or in a FIFO (early).
    pending: u32,
    deficit: u64,
    hash: u64,
    last_seen: Time,
    /// How long the flow's last bound packet waited, ns (published as `queue_delay_ns`).
    delay_ns: u64,
    class: Class,
    active: bool,
    /// In [`Binding::dirty`]: its meters are written at the next publication.
    dirty: bool,
    pinned: Option<u8>,
    last_iface: Option<u8>,
    /// The flow gets its `quantum` at its next visit: it has not had the current round's yet ([`Rounds`]).
    quantum_due: bool,
    cold: Box<FlowCold>,
}

impl Flow {
    /// At a visit by deficit round robin: adds the round's quantum if it is due; whether the deficit now covers
    /// the head packet.
    fn covers_head(&mut self, quantum: u64) -> bool {
        if std::mem::take(&mut self.quantum_due) {
            self.deficit += quantum;
        }
        self.deficit >= u64::from(self.head_len)
    }

    /// Whether a visit now would let the flow send its head packet (as [`Flow::covers_head`], without the visit).
    fn would_cover_head(&self, quantum: u64) -> bool {
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
struct Rounds {
    /// The current round's flows still to visit, in turn.
    current: VecDeque<u32>,
    /// The flows done with the current round, in the order they finished it: the next round.
    next: VecDeque<u32>,
}

impl Rounds {
    fn is_empty(&self) -> bool {
        self.current.is_empty() && self.next.is_empty()
    }

    fn len(&self) -> usize {
        self.current.len() + self.next.len()
    }

    /// The flow to visit next; when the current round has no flow left, the next round begins.
    fn front(&mut self) -> Option<u32> {
        if self.current.is_empty() {
            std::mem::swap(&mut self.current, &mut self.next);
        }
        self.current.front().copied()
    }

    /// The flows in the order they will be visited (as far as it is known now).
    fn iter(&self) -> impl Iterator<Item = &u32> {
        self.current.iter().chain(self.next.iter())
    }

    /// A flow that has just become active joins the current round, last.
    fn push(&mut self, slot: u32) {
        self.current.push_back(slot);
    }

    /// The front flow goes to the back of the current round.
    fn again(&mut self) {
        if let Some(slot) = self.current.pop_front() {
            self.current.push_back(slot);
        }
    }

    /// The front flow is done with the current round (see [`wait_next_round`]).
    fn later(&mut self) {
        if let Some(slot) = self.current.pop_front() {
            self.next.push_back(slot);
        }
    }

    /// The front flow leaves (its queue is empty).
    fn remove_front(&mut self) {
        self.current.pop_front();
    }

    /// The front flow could not send (its interface is full): it is passed over, to the back of the current round;
    /// returns whether every flow of the current round has now been passed over once since `passed` counted 0
    /// (`passed` counts the pass-overs). Then the flows of the next round are visited before them: they may have
    /// other interfaces.
    fn pass_over(&mut self, passed: &mut usize) -> bool {
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
    fn remove(&mut self, slot: u32) {
        self.current.retain(|&s| s != slot);
        self.next.retain(|&s| s != slot);
    }
}

/// What a flow needs only when it appears, goes, or is published.
struct FlowCold {
    key: u64,
    vars_name: String,
    vars: FlowVars,
}

/// Notes that flow `f` (in `slot`) has meters to publish.
fn mark_dirty(dirty: &mut Vec<u32>, f: &mut Flow, slot: u32) {
    if !f.dirty {
        f.dirty = true;
        dirty.push(slot);
    }
}

/// Flow `f`, at the front of `rounds`, is done with the current round: it waits for the next one, whose quantum
/// its next visit gives it.
fn wait_next_round(rounds: &mut Rounds, f: &mut Flow) {
    f.quantum_due = true;
    rounds.later();
}

/// After flow `f`, at the front of `rounds`, sent its head packet (its deficit and `head` already updated):
/// `next` is its new head packet ([`NIL`]: none) of `next_len` bytes. An empty flow leaves; one whose deficit
/// covers the next packet goes to the back of the round, the others wait for the next round.
fn served(rounds: &mut Rounds, f: &mut Flow, next: u32, next_len: u32) {
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

/// A running `late-binding` or `early-binding` module.
pub struct Binding {
    cfg: Settings2,
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
    flow_specs: Vec<VarSpec>,
    meters: Meters,
    drops: ParseDrops,
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
            ModuleVars::new(&self.flow_specs)
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

    /// Puts a packet into interface `k`'s device queue: rewrites its source, models its transmission and emits it
    /// if it starts now, or at once with `emit` = `admit` (its ring entry then only models the occupancy).
    fn bind(&mut self, k: usize, q: Queued, class: Class, now: Time, out: &mut Output<'_>) {
        let Queued { mut pkt, hdr, .. } = q;
        let iface = &mut self.ifaces[k];
        let new = if hdr.v6 { iface.cfg.address_v6.map(IpAddr::V6) } else { iface.cfg.address_v4.map(IpAddr::V4) };
        if let Some(new) = new {
            rewrite::address(pkt.make_mut(), &hdr, true, new);
        }
        let meta = pkt.meta_mut();
        meta.set(MetaKey::OUT_FACE, k as u64);
        meta.set(MetaKey::CLASS, class as u64);
        let len = pkt.len() as u64;
        iface.m.bound_packets.add(1);
        iface.m.bound_bytes.add(len);
        let start = iface.busy_until.max(now);
        let end = start + std::time::Duration::from_nanos(iface.tx_ns(len, 1));
        iface.busy_until = end;
        let pkt = if start <= now || iface.cfg.emit == Emit::Admit {
            out.emit(k, pkt);
            None
        } else {
            Some(pkt)
        };
        if end > now {
            iface.ring.push_back(InRing { start, end, pkt });
        }
    }

    /// Emits packets whose modelled transmission has started and removes those that have ended; on an interface
    /// just switched to `emit` = `admit`, emits every packet its device queue still holds, in ring order.
    fn advance(&mut self, now: Time, out: &mut Output<'_>) {
        for (k, iface) in self.ifaces.iter_mut().enumerate() {
            if std::mem::take(&mut iface.flush_held) && iface.cfg.emit == Emit::Admit {
                for e in iface.ring.iter_mut() {
                    if let Some(p) = e.pkt.take() {
                        out.emit(k, p);
                    }
                }
            }
            while iface.ring.front().is_some_and(|e| e.end <= now) {
                if let Some(e) = iface.ring.pop_front() {
                    if let Some(p) = e.pkt {
                        out.emit(k, p);
                    }
                }
            }
            for e in iface.ring.iter_mut() {
                if e.start > now {
                    break;
                }
                if let Some(p) = e.pkt.take() {
                    out.emit(k, p);
                }
            }
        }
    }

    /// Applies interface downs written since the last call: the device queue (and, early, the FIFO) is lost.
    fn apply_downs(&mut self, now: Time, out: &mut Output<'_>) {
        if !std::mem::take(&mut self.downs_pending) {
            return;
        }
        for k in 0..self.ifaces.len() {
            if !std::mem::take(&mut self.ifaces[k].pending_down) {
                continue;
            }
            let iface = &mut self.ifaces[k];
            for e in iface.ring.drain(..) {
                match e.pkt {
                    Some(p) => {
                        iface.m.drop_down.add(1);
                        self.meters.drop_down.add(1);
                        out.drop_frame(p.into());
                    }
                    None if e.end > now => iface.m.interrupted.add(1),
                    None => {}
                }
            }
            iface.busy_until = now;
            let fifo: Vec<Queued> = iface.fifo.drain(..).collect();
            iface.fifo_bytes = 0;
            for q in fifo {
                self.ifaces[k].m.drop_down.add(1);
                self.meters.drop_down.add(1);
                self.unqueue(q.flow, q.pkt.len() as u64);
                out.drop_frame(q.pkt.into());
            }
            for (_, f) in self.flows.iter_mut() {
                if f.pinned == Some(k as u8) {
                    f.pinned = None;
                }
            }
        }
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

    /// Hints the CPU to load what the next bindings will touch (see [`PREFETCH_PACKETS`]): `class` is the class
    /// just served; a higher one may have become active meanwhile.
    fn prefetch_next(&self, class: Class) {
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

    /// Deficit round robin over the classes in priority order: the next flow whose head packet may be sent now,
    /// and its interface. It is left at the front of its class's list.
    fn select(&mut self, now: Time) -> Option<(Class, u32, usize)> {
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

    /// The first passes over a batch going down (late binding; see [`ARRIVAL_PREFETCH_MIN`]): for each packet
    /// whose flow is known by its [`MetaKey::FLOW_ID`], looks up its flow slot (pushed to `slots`, [`NIL`] for the
    /// others) and asks for the flow's state; then, the flows' states having come in meanwhile, asks for the
    /// link of each flow's last queued packet, which queueing the packet behind it writes. The lookups of the
    /// batch are independent of each other, so their memory reads overlap instead of each waiting in turn.
    fn prefetch_arrivals(&self, input: &Batch, slots: &mut Vec<u32>) {
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

    /// Parses a packet going down: its headers, and the packet cut to the length its IP header gives; a control
    /// frame, or a packet that does not parse, is counted and dropped (`None`).
    fn parse_down(&mut self, frame: Frame, out: &mut Output<'_>) -> Option<(Packet, PacketInfo)> {
        let (mut p, info) = self.drops.parse(frame, out)?;
        if p.len() > info.total_len {
            p.make_mut().truncate(info.total_len);
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

    /// Late binding: whether the batch `input` going down will be bound whole within this call, so that
    /// [`Binding::bind_batch`] may take it without the queue structures, with exactly the result of queueing it
    /// ([`Binding::enqueue`]) and settling ([`Binding::fill_late`]): nothing waits above the binding point (every
    /// flow is empty, inactive, with no deficit); the batch fits under `queue_limit` (none of it is dropped as
    /// full); and every interface that is up models no rate, has sent everything (`busy_until` not after `now`)
    /// and has room in its device queue. Then a packet bound there leaves at once and its device queue stays as it
    /// is, so every interface keeps its room through the batch, no flow is ever passed over as blocked, and the
    /// policy's choice does not depend on the packet's length (`fastest` sees every interface free now): the order
    /// of service is the one class priority and deficit round robin give the batch by themselves.
    fn binds_at_once(&self, input: &Batch, now: Time) -> bool {
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
    fn bind_batch(&mut self, input: &mut Batch, now: Time, out: &mut Output<'_>) {
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

    /// Maps a packet coming up to the virtual address if it is addressed to one of the interfaces.
    fn map_up(&mut self, frame: Frame, out: &mut Output<'_>) {
        let Some((mut p, info)) = self.drops.parse(frame, out) else { return };
        // The destination address is rewritten in place, with fixed-size arrays (no allocation per packet).
        let mapped = match info.dst {
            IpAddr::V4(d) if self.ifaces.iter().any(|i| i.cfg.address_v4 == Some(d)) => {
                self.cfg.virtual_v4.map(|v| rewrite::address(p.make_mut(), &Layout::of(&info), false, v.into()))
            }
            IpAddr::V6(d) if self.ifaces.iter().any(|i| i.cfg.address_v6 == Some(d)) => {
                self.cfg.virtual_v6.map(|v| rewrite::address(p.make_mut(), &Layout::of(&info), false, v.into()))
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
            // The ring's entries follow each other without a gap (an entry is admitted at the end of the last
            // one, which is still in the ring, or at `now` into an empty ring), so only the front matters: its
            // start if it still holds its packet (`emit` = `start`, not started), else its end, when room frees
            // and the next entry, if any, starts. With `admit` no entry holds a packet: the module wakes only
            // when room frees, never for a start.
            if let Some(e) = i.ring.front() {
                let t = if e.pkt.is_some() { e.start } else { e.end };
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
        match (knob, value) {
            ("policy", Value::Str(s)) => self.cfg.policy = Policy::parse(s).ok_or_else(bad)?,
            ("quantum", Value::U64(v)) if (MIN_QUANTUM..=MAX_QUANTUM).contains(v) => self.cfg.quantum = *v,
            ("queue_limit", Value::U64(v)) if (1..=MAX_QUEUE_LIMIT).contains(v) => self.cfg.queue_limit = *v,
            ("flow_idle_ms", Value::U64(v)) if (1..=MAX_IDLE_MS).contains(v) => self.cfg.flow_idle_ns = v * 1_000_000,
            _ => {
                let (name, param) = knob.rsplit_once('.').ok_or_else(bad)?;
                let iface = self.ifaces.iter_mut().find(|i| i.cfg.name == name).ok_or_else(bad)?;
                let c = &mut iface.cfg;
                match (param, value) {
                    ("rate_bps", Value::U64(v)) if *v <= MAX_RATE_BPS => c.rate_bps = *v,
                    ("overhead_bytes", Value::U64(v)) if *v <= MAX_OVERHEAD => c.overhead_bytes = *v,
                    ("device_queue", Value::U64(v)) if (1..=MAX_DEVICE_QUEUE).contains(v) => c.device_queue = *v,
                    ("weight", Value::U64(v)) if *v <= MAX_WEIGHT => c.weight = *v,
                    ("fifo_limit", Value::U64(v)) if self.cfg.mode == Mode::Early && *v <= MAX_QUEUE_LIMIT => {
                        c.fifo_limit = *v
                    }
                    ("up", Value::Bool(v)) => self.downs_pending |= iface.set_up(*v),
                    ("emit", Value::Str(s)) => {
                        c.emit = Emit::parse(s)
                            .ok_or_else(|| format!("cannot set {knob} to {s:?}: expected start or admit"))?;
                        // To admit: what the ring still holds goes at the next call (the switch polls the module
                        // after a write). To start: only packets bound from now on wait for their start.
                        iface.flush_held |= c.emit == Emit::Admit;
                    }
                    _ => return Err(bad()),
                }
            }
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

#[cfg(test)]
mod node_arena_tests {
    use super::*;
    use flexstack_core::PacketPool;

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

#[cfg(test)]
mod arrival_tests {
    use super::*;
    use flexstack_core::{Catalog, PacketPool, StackSpec};
    use flexstack_wire::packet::build;

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
