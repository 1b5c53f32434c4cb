//! `classify`: sorts IP packets by transport protocol and keeps a table of bidirectional 5-tuple flows, each with an
//! id, per-flow meters and an idle timeout.
//!
//! Its ports, settings, knobs and meters are declared once, in `DECL` below; docs/modules.md lists them.
//!
//! - Ports: a stack can write `classify[udp] -> nat`. Every packet that parses leaves on the output of its protocol.
//! - Flows: the key is (protocol, address and port of each side), with ports for TCP/UDP, the identifier for ICMP
//!   echo and 0 otherwise; the two sides are put in a fixed order, so both directions of a conversation are one
//!   flow. A new flow gets the next id (1, 2, ...), which is stamped into each of its packets' metadata
//!   ([`MetaKey::FLOW_ID`]), and runtime meters under `flow.<id>` (see `vars_prefix`): `packets_total`,
//!   `bytes_total`, `packets_up_total` / `packets_down_total` and `bytes_up_total` / `bytes_down_total` (by the
//!   frame's direction), `first_seen_ns`, `last_seen_ns` (switch time) and `tuple` (text, e.g.
//!   `udp 10.0.0.2:5000 <-> 10.0.0.1:53`, the side that sent the first packet first; `flexstack flow list` reads
//!   it) and `worker` (the data-plane worker that owns the flow; with N workers, worker k numbers its flows k+1,
//!   k+1+N, ..., so that ids stay unique). Non-first fragments carry no ports: they pass untracked (counted in `fragments_untracked_total`); put
//!   reassembly before the classifier to track fragmented datagrams.
//! - Idle timeouts: a flow expires when it has seen no packet for its protocol's timeout; a TCP flow that saw a RST,
//!   or a FIN from both sides, uses `tcp_closing_timeout_ms` instead. Expired flows leave the table and their
//!   `flow.<id>` meters are unregistered. Expiry runs from the module's poll, at the earliest deadline.
//! - `vars_prefix`: the flows' meters go under `<vars_prefix>.<id>`; give each classifier of a stack its own, e.g.
//!   `flow.lan`, so that their ids do not collide. `track` = false empties the table (at the poll that follows the
//!   write) and passes packets without flows; beyond `max_flows`, packets pass untracked.
//! - Drops: packets that do not parse count by [`ParseError`](flexstack_wire::packet::ParseError) reason, control
//!   frames arriving on `in` in `drop_not_packet_total`. Per-port frame counts are the switch's.
//!
//! On `module replace` with state kept, the new classifier continues the old one's flows (ids, meters, timers)
//! under its own timeouts.

use crate::flow::table::{tcp_flags, timeouts_in_field, Expiring, FlowIndex, Idle, Slab, Timeouts, Timers, FIN_OR_RST};
use flexstack_core::module::port_type;
use flexstack_core::vars::add_single_writer;
use flexstack_core::BlockArena;
use flexstack_core::{
    field, kind_from_decl, Batch, ConfigError, Direction, KindDecl, MetaKey, Meter, MeterDecl, Module, ModuleBuilder,
    ModuleKind, Output, Param, PortDecl, Settings, Time, Value, ValueType, VarBlock, VarSpec, VarSpecs,
};
use flexstack_wire::packet::{proto, PacketInfo, ParseDrops};
use std::any::Any;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The kind's name in stack files.
pub const KIND: &str = "classify";

/// Output port of TCP packets.
pub const OUT_TCP: usize = 0;
/// Output port of UDP packets.
pub const OUT_UDP: usize = 1;
/// Output port of ICMP and ICMPv6 packets.
pub const OUT_ICMP: usize = 2;
/// Output port of every other protocol.
pub const OUT_OTHER: usize = 3;

/// Largest `max_flows`.
const MAX_FLOWS_LIMIT: u64 = 1 << 24;

/// The name of a protocol in tuples and rules.
fn proto_name(p: u8) -> String {
    match p {
        proto::TCP => "tcp".into(),
        proto::UDP => "udp".into(),
        proto::ICMP => "icmp".into(),
        proto::ICMPV6 => "icmpv6".into(),
        n => format!("proto {n}"),
    }
}

// -------------------------------------------------------------------------------------------------------------
// The kind
// -------------------------------------------------------------------------------------------------------------

/// The `classify` module kind.
pub struct ClassifyKind;

/// The settings and knobs of a classifier (`Default` is a blank to read them into: the defaults are declared in
/// `DECL`).
#[derive(Clone, Debug, Default)]
struct Config {
    track: bool,
    max_flows: u64,
    timeouts: Timeouts,
    vars_prefix: String,
}

timeouts_in_field!(Config);

/// Checks and sets `vars_prefix`: `flow` or `flow.NAME`.
fn set_vars_prefix(c: &mut Config, prefix: &str) -> Result<(), String> {
    let segment_ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 64
            && s.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_' || c == b'-')
    };
    if !(prefix == "flow" || prefix.strip_prefix("flow.").is_some_and(|rest| rest.split('.').all(segment_ok))) {
        return Err(format!("expected `flow` or `flow.NAME` (lowercase letters, digits, '_', '-'), got {prefix:?}"));
    }
    c.vars_prefix = prefix.into();
    Ok(())
}

type P = Param<Config>;

/// The settings and knobs: `track`, `max_flows`, the timeouts, `vars_prefix`.
const PARAMS: [P; 8] = {
    let t = Timeouts::params::<Config>();
    [
        P::bool("track", "keep the flow table (false empties it)", true, field!(track)),
        P::u64("max_flows", "flows", "most flows tracked; beyond, packets pass untracked", 65_536, field!(max_flows))
            .range(0.0, MAX_FLOWS_LIMIT as f64),
        t[0],
        t[1],
        t[2],
        t[3],
        t[4],
        P::text(
            "vars_prefix",
            "prefix of the flows' meters: `flow` or `flow.NAME`",
            "flow",
            |c| c.vars_prefix.clone(),
            set_vars_prefix,
        )
        .setting(),
    ]
};

/// The kind: ports, settings, knobs and meters.
const DECL: KindDecl<Config, Meters> = KindDecl {
    inputs: &[PortDecl::new("in", port_type::IP, "IP packets to sort")],
    outputs: &[
        PortDecl::new("tcp", port_type::IP, "TCP packets"),
        PortDecl::new("udp", port_type::IP, "UDP packets"),
        PortDecl::new("icmp", port_type::IP, "ICMP and ICMPv6 packets"),
        PortDecl::new("other", port_type::IP, "packets of every other protocol"),
    ],
    params: &PARAMS,
    meters: &[
        MeterDecl::u64("flows_active", "flows", "flows in the table", |m| &mut m.active),
        MeterDecl::u64("flows_created_total", "flows", "flows created", |m| &mut m.created),
        MeterDecl::u64("flows_expired_total", "flows", "flows expired (or removed)", |m| &mut m.expired),
        MeterDecl::u64("flows_untracked_total", "frames", "packets passed untracked: table full", |m| &mut m.untracked),
        MeterDecl::u64("fragments_untracked_total", "frames", "non-first fragments passed untracked (no ports)", |m| {
            &mut m.fragments
        }),
    ],
    more_meters: || ParseDrops::specs(true),
    accepts_gso: true,
    ..KindDecl::new(
        KIND,
        "sorts IP packets by protocol; bidirectional 5-tuple flows with ids, per-flow meters and idle timeouts",
    )
};

impl ModuleKind for ClassifyKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        DECL.configure(settings, Config::default(), |cfg, m, vars| {
            let flow_specs = VarSpecs::new(flow_specs());
            Box::new(Classify {
                cfg,
                flush: false,
                table: Table::new(&flow_specs),
                flow_specs,
                vars_prefix: "".into(),
                m,
                drops: ParseDrops::new(vars),
                work: Vec::new(),
            })
        })
    }
}

/// The classifier's meters.
#[derive(Default)]
struct Meters {
    active: Meter,
    created: Meter,
    expired: Meter,
    untracked: Meter,
    fragments: Meter,
}

/// The indices of the flow meters in [`flow_specs`], in their block.
mod fm {
    pub const PACKETS: usize = 0;
    pub const BYTES: usize = 1;
    pub const PACKETS_UP: usize = 2;
    pub const BYTES_UP: usize = 4;
    pub const FIRST_SEEN: usize = 6;
    pub const LAST_SEEN: usize = 7;
    pub const TUPLE: usize = 8;
    pub const WORKER: usize = 9;
    /// After the meters, in the flow's arena slot and seen by no reader: its id, then its key (5 words), in the
    /// slot's second line with `TUPLE` (whose word is unused) and `WORKER`.
    pub const ID: usize = 10;
    pub const KEY: usize = 11;
}

/// A flow's meters, in the order of the indices in [`fm`] (the per-packet ones first: they share a cache line).
fn flow_specs() -> Vec<VarSpec> {
    vec![
        VarSpec::meter("packets_total", ValueType::U64, "frames", "packets of the flow, both directions"),
        VarSpec::meter("bytes_total", ValueType::U64, "bytes", "bytes of the flow's packets, both directions"),
        VarSpec::meter("packets_up_total", ValueType::U64, "frames", "packets travelling up (from the network)"),
        VarSpec::meter("packets_down_total", ValueType::U64, "frames", "packets travelling down (to the network)"),
        VarSpec::meter("bytes_up_total", ValueType::U64, "bytes", "bytes of the packets travelling up"),
        VarSpec::meter("bytes_down_total", ValueType::U64, "bytes", "bytes of the packets travelling down"),
        VarSpec::meter("first_seen_ns", ValueType::U64, "ns", "switch time of the flow's first packet"),
        VarSpec::meter("last_seen_ns", ValueType::U64, "ns", "switch time of the flow's last packet"),
        VarSpec::meter("tuple", ValueType::Str, "", "protocol and endpoints, the first sender first"),
        VarSpec::meter("worker", ValueType::U64, "", "the data-plane worker that owns the flow (0 with one worker)"),
    ]
}

/// A flow's key: protocol and the two endpoints, in a fixed order (so both directions give the same key), packed in
/// five words as the flow's arena slot keeps it: each address as 16 bytes (IPv4 as IPv4-mapped), then the ports,
/// the protocol and whether the addresses are IPv6.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct FlowKey([u64; 5]);

impl FlowKey {
    fn of(info: &PacketInfo) -> FlowKey {
        let s = (info.src, info.src_port);
        let d = (info.dst, info.dst_port);
        let (a, b) = if src_is_a(info) { (s, d) } else { (d, s) };
        let [a0, a1] = halves(a.0);
        let [b0, b1] = halves(b.0);
        let rest = u64::from(a.1)
            | u64::from(b.1) << 16
            | u64::from(info.protocol) << 32
            | u64::from(info.src.is_ipv6()) << 40;
        FlowKey([a0, a1, b0, b1, rest])
    }

    fn protocol(&self) -> u8 {
        (self.0[4] >> 32) as u8
    }

    /// The key a flow's arena slot holds.
    #[inline]
    fn in_slot(words: &[AtomicU64]) -> FlowKey {
        FlowKey(std::array::from_fn(|i| words[fm::KEY + i].load(Ordering::Relaxed)))
    }
}

/// Whether the packet's sender is the key's first endpoint.
fn src_is_a(info: &PacketInfo) -> bool {
    (info.src, info.src_port) <= (info.dst, info.dst_port)
}

/// An address's 16 bytes (IPv4 as IPv4-mapped) as two words.
fn halves(ip: IpAddr) -> [u64; 2] {
    let o = match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    };
    let (hi, lo) = o.split_at(8);
    [hi, lo].map(|h| u64::from_ne_bytes(h.try_into().unwrap_or_default()))
}

/// What a flow keeps apart from its arena slot: read when it is created, expires, or a FIN or RST arrives.
struct Flow {
    /// Its id, protocol, idle timer and TCP end (its last-seen time is the meter's, in the slot; its key is in the
    /// slot too).
    idle: Idle,
    /// Whether the endpoint that sent the first packet is the key's `a` (else `b`).
    first_is_a: bool,
    /// The prefix its meters are registered under is `<vars_prefix>.<id>`, with the `vars_prefix` of the
    /// classifier that created it (shared by every flow).
    vars_prefix: Arc<str>,
    /// Its meters, in its arena slot ([`fm`]).
    meters: VarBlock,
}

impl Flow {
    fn vars_name(&self) -> String {
        format!("{}.{}", self.vars_prefix, self.idle.id)
    }
}

impl Expiring for Flow {
    fn idle(&mut self) -> &mut Idle {
        &mut self.idle
    }

    /// The meter `last_seen_ns`: a packet writes it there and nothing in the flow's [`Flow`].
    fn last_seen(&mut self) -> u64 {
        self.meters.get(fm::LAST_SEEN)
    }
}

/// The flow table: what a classifier hands to its replacement. A flow's number is its slot in `arena` (its meters,
/// key and id: what a packet reads and writes, packed with the other flows') and in `flows` (the rest).
struct Table {
    flows: Slab<Flow>,
    arena: BlockArena,
    index: FlowIndex,
    timers: Timers,
    next_id: u64,
    created: u64,
    expired: u64,
    untracked: u64,
}

impl Table {
    fn new(specs: &VarSpecs) -> Table {
        Table {
            flows: Slab::external(),
            arena: BlockArena::new(specs),
            index: FlowIndex::default(),
            timers: Timers::default(),
            next_id: 0,
            created: 0,
            expired: 0,
            untracked: 0,
        }
    }
}

/// A running classifier.
pub struct Classify {
    cfg: Config,
    flush: bool,
    table: Table,
    /// Declared once, shared by every flow's block.
    flow_specs: VarSpecs,
    /// `vars_prefix`, shared by the flows created under it.
    vars_prefix: Arc<str>,
    m: Meters,
    drops: ParseDrops,
    /// The batch being processed, parsed, with each packet's flow key and its hash (kept for its capacity).
    work: Vec<(flexstack_core::Packet, PacketInfo, Option<FlowKey>, u64)>,
}

impl Classify {
    /// The slot of the flow of `key` (whose hash is `hash`).
    fn find(&self, key: &FlowKey, hash: u64) -> Option<u32> {
        let arena = &self.table.arena;
        self.table.index.find(hash, |s| FlowKey::in_slot(arena.words(s)) == *key)
    }

    /// Accounts `p` to its flow (creating it if needed) and stamps the flow id.
    fn account(
        &mut self,
        p: &mut flexstack_core::Packet,
        info: &PacketInfo,
        key: FlowKey,
        hash: u64,
        out: &mut Output<'_>,
    ) {
        let now = out.now().as_nanos();
        let slot = match self.find(&key, hash) {
            Some(s) => s,
            None => {
                if self.table.flows.len() as u64 >= self.cfg.max_flows {
                    self.table.untracked += 1;
                    self.m.untracked.add(1);
                    return;
                }
                self.create(key, hash, info, out)
            }
        };
        // A GSO super-packet counts its segments and their bytes on the wire.
        let (n, len) = (p.wire_packets(), p.wire_bytes());
        let w = self.table.arena.words(slot);
        add_single_writer(&w[fm::PACKETS], n);
        add_single_writer(&w[fm::BYTES], len);
        // The down meters follow their up ones.
        let d = usize::from(p.direction() != Direction::Up);
        add_single_writer(&w[fm::PACKETS_UP + d], n);
        add_single_writer(&w[fm::BYTES_UP + d], len);
        w[fm::LAST_SEEN].store(now, Ordering::Relaxed);
        let id = w[fm::ID].load(Ordering::Relaxed);
        // Only a FIN or RST changes what the flow saw of its end: then the rest of the flow is read.
        if let Some(flags) = tcp_flags(p.data(), info).filter(|f| f & FIN_OR_RST != 0) {
            let closing_ns = self.cfg.timeouts.of(proto::TCP, true);
            if let Some(f) = self.table.flows.get_mut(slot) {
                let tcp = Some((src_is_a(info) == f.first_is_a, flags));
                if let Some(d) = self.table.timers.seen_tcp(slot, &mut f.idle, now, tcp, closing_ns) {
                    out.wake_at(Time(d));
                }
            }
        }
        p.meta_mut().set(MetaKey::FLOW_ID, id);
    }

    fn create(&mut self, key: FlowKey, hash: u64, info: &PacketInfo, out: &mut Output<'_>) -> u32 {
        let now = out.now().as_nanos();
        self.table.next_id += 1;
        let id = (self.table.next_id - 1) * u64::from(out.workers()) + u64::from(out.worker()) + 1;
        if self.vars_prefix.as_ref() != self.cfg.vars_prefix {
            self.vars_prefix = self.cfg.vars_prefix.as_str().into();
        }
        let vars_name = format!("{}.{id}", self.vars_prefix);
        let (slot, meters) = self.table.arena.block();
        // A name taken (another classifier with the same `vars_prefix`): the flow is tracked, its meters unpublished.
        let _ = out.register_existing_block(&vars_name, &meters);
        meters.set(fm::FIRST_SEEN, now);
        meters.store(fm::TUPLE, &Value::Str(tuple_text(info)));
        meters.set(fm::WORKER, u64::from(out.worker()));
        let w = self.table.arena.words(slot);
        w[fm::ID].store(id, Ordering::Relaxed);
        for (w, k) in w[fm::KEY..].iter().zip(key.0) {
            w.store(k, Ordering::Relaxed);
        }
        let idle = Idle::new(id, key.protocol(), now, &self.cfg.timeouts);
        let vars_prefix = self.vars_prefix.clone();
        self.table.flows.insert_at(slot, Flow { idle, first_is_a: src_is_a(info), vars_prefix, meters });
        self.table.index.insert(hash, slot);
        self.table.timers.start(slot, &idle);
        out.wake_at(Time(idle.queued));
        self.table.created += 1;
        self.m.created.add(1);
        self.m.active.set(self.table.flows.len() as u64);
        slot
    }

    /// Puts every flow's timer at its current deadline (after a timeout changed, or a table was adopted).
    fn rearm(&mut self) {
        self.table.timers.rearm(&mut self.table.flows, &self.cfg.timeouts);
    }

    fn publish(&self) {
        self.m.active.set(self.table.flows.len() as u64);
        self.m.created.set(self.table.created);
        self.m.expired.set(self.table.expired);
        self.m.untracked.set(self.table.untracked);
    }
}

fn tuple_text(info: &PacketInfo) -> String {
    use flexstack_wire::cidr::Endpoint;
    let name = proto_name(info.protocol);
    match info.protocol {
        proto::TCP | proto::UDP if info.fragment.is_none_or(|f| f.offset == 0) => {
            format!("{name} {} <-> {}", Endpoint(info.src, info.src_port), Endpoint(info.dst, info.dst_port))
        }
        proto::ICMP | proto::ICMPV6 if info.src_port != 0 || matches!(info.icmp, Some((0 | 8 | 128 | 129, _))) => {
            format!("{name} {} <-> {} id {}", info.src, info.dst, info.src_port)
        }
        _ => format!("{name} {} <-> {}", info.src, info.dst),
    }
}

impl Module for Classify {
    /// In passes over the batch, so that the cache misses of a large table overlap instead of adding up: parse every
    /// packet and prefetch the first bucket of its flow's lookup; then prefetch the likely flow's arena slot (key,
    /// id and meters: two lines); then look up (or create) and account each flow, and emit the packets in their
    /// order.
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        let mut work = std::mem::take(&mut self.work);
        for frame in input.drain(..) {
            let Some((p, info)) = self.drops.parse(frame, out) else { continue };
            let key = (self.cfg.track && info.fragment.is_none_or(|f| f.offset == 0)).then(|| FlowKey::of(&info));
            let hash = key.map_or(0, |k| self.table.index.hash(&k));
            if key.is_some() {
                self.table.index.prefetch(hash);
            }
            work.push((p, info, key, hash));
        }
        for (_, _, key, hash) in &work {
            if key.is_some() {
                if let Some(at) = self.table.index.candidate(*hash).and_then(|s| self.table.arena.addr(s)) {
                    flexstack_sys::prefetch(at);
                    flexstack_sys::prefetch(at + 64);
                }
            }
        }
        for (mut p, info, key, hash) in work.drain(..) {
            match key {
                Some(key) => self.account(&mut p, &info, key, hash, out),
                None if self.cfg.track => self.m.fragments.add(1),
                None => {}
            }
            let port = match info.protocol {
                proto::TCP => OUT_TCP,
                proto::UDP => OUT_UDP,
                proto::ICMP | proto::ICMPV6 => OUT_ICMP,
                _ => OUT_OTHER,
            };
            out.emit(port, p);
        }
        self.work = work;
    }

    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        let now = out.now().as_nanos();
        let Table { flows, arena, index, timers, expired, .. } = &mut self.table;
        let meter = &self.m.expired;
        // `f` still holds its slot here: the key is read before the slot can go to another flow.
        let mut forget = |slot: u32, f: Flow| {
            let indexed = index.remove(index.hash(&FlowKey::in_slot(arena.words(slot))), slot);
            debug_assert!(indexed, "flow in slot {slot} was not found in the index under its key");
            out.unregister_vars(&f.vars_name());
            *expired += 1;
            meter.add(1);
        };
        if self.flush {
            self.flush = false;
            let slots: Vec<u32> = flows.iter().map(|(s, _)| s).collect();
            for s in slots {
                if let Some(f) = flows.remove(s) {
                    forget(s, f);
                }
            }
            timers.clear();
        }
        let next = timers.expire(flows, &self.cfg.timeouts, now, forget);
        self.m.active.set(flows.len() as u64);
        next.map(Time)
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        DECL.write(&mut self.cfg, knob, value)?;
        if knob == "track" {
            // The table is emptied at the poll that follows the write (unregistering needs an Output).
            self.flush = !self.cfg.track;
        } else if knob.ends_with("_timeout_ms") {
            self.rearm();
        }
        Ok(())
    }

    fn take_state(&mut self) -> Option<Box<dyn Any>> {
        Some(Box::new(std::mem::replace(&mut self.table, Table::new(&self.flow_specs))))
    }

    fn adopt_state(&mut self, state: Box<dyn Any>) -> Result<(), String> {
        let table = state.downcast::<Table>().map_err(|_| "not a classifier's flow table".to_string())?;
        self.table = *table;
        self.rearm();
        self.flush = !self.cfg.track;
        self.publish();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::flow::testutil::*;
    use flexstack_core::{Direction, Switch, Time, Value};
    use flexstack_wire::packet::{build, proto};
    use std::net::{Ipv4Addr, Ipv6Addr};

    const A: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
    const B: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);

    fn udp4(src: Ipv4Addr, dst: Ipv4Addr, sp: u16, dp: u16, data: &[u8]) -> Vec<u8> {
        build::ipv4(src, dst, proto::UDP, 64, &build::udp(src.into(), dst.into(), sp, dp, data))
    }

    fn tcp4(src: Ipv4Addr, dst: Ipv4Addr, sp: u16, dp: u16, flags: u8) -> Vec<u8> {
        let mut t = build::tcp(src.into(), dst.into(), sp, dp, b"");
        t[13] = flags; // checksum now wrong: the classifier does not check it
        build::ipv4(src, dst, proto::TCP, 64, &t)
    }

    /// classify with each output recorded.
    fn stack(args: &[&str]) -> (Switch, [Log; 4]) {
        let mut sw = Switch::default();
        let (t, lt) = recorder("t");
        let (u, lu) = recorder("u");
        let (i, li) = recorder("i");
        let (o, lo) = recorder("o");
        sw.apply(vec![
            load("c", "classify", args),
            t,
            u,
            i,
            o,
            link("c[tcp] -> t"),
            link("c[udp] -> u"),
            link("c[icmp] -> i"),
            link("c[other] -> o"),
        ])
        .unwrap();
        (sw, [lt, lu, li, lo])
    }

    fn flow_var(sw: &Switch, id: u64, name: &str) -> Option<Value> {
        var(sw, &format!("flow.{id}.{name}"))
    }

    #[test]
    fn sorts_by_protocol_and_tracks_bidirectional_flows() {
        let (mut sw, logs) = stack(&[]);
        let q = udp4(A, B, 5000, 53, b"query");
        let r = udp4(B, A, 53, 5000, b"answer!");
        let t = tcp4(A, B, 40000, 80, 0x02);
        let e = build::ipv4(A, B, proto::ICMP, 64, &build::icmpv4_echo(7, 1, b"hi"));
        let gre = build::ipv4(A, B, 47, 64, b"greg");
        send(&mut sw, "c", "in", &[q.clone(), t, e, gre], Direction::Down, 1);
        send(&mut sw, "c", "in", std::slice::from_ref(&r), Direction::Up, 2);
        let [lt, lu, li, lo] = &logs;
        let (t, u, i, o) = (take(lt), take(lu), take(li), take(lo));
        assert_eq!((t.len(), u.len(), i.len(), o.len()), (1, 2, 1, 1));
        assert_eq!(u[0].data, q, "packets pass unchanged");
        assert_eq!(
            (u[0].flow(), u[1].flow(), t[0].flow(), i[0].flow(), o[0].flow()),
            (Some(1), Some(1), Some(2), Some(3), Some(4))
        );
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 4);
        assert_eq!(u64_var(&sw, "module.c.flows_created_total"), 4);
        assert_eq!(flow_var(&sw, 1, "packets_total"), Some(Value::U64(2)));
        assert_eq!(flow_var(&sw, 1, "bytes_total"), Some(Value::U64((q.len() + r.len()) as u64)));
        assert_eq!(flow_var(&sw, 1, "packets_down_total"), Some(Value::U64(1)));
        assert_eq!(flow_var(&sw, 1, "packets_up_total"), Some(Value::U64(1)));
        assert_eq!(flow_var(&sw, 1, "bytes_down_total"), Some(Value::U64(q.len() as u64)));
        assert_eq!(flow_var(&sw, 1, "bytes_up_total"), Some(Value::U64(r.len() as u64)));
        assert_eq!(flow_var(&sw, 1, "first_seen_ns"), Some(Value::U64(1_000_000)));
        assert_eq!(flow_var(&sw, 1, "last_seen_ns"), Some(Value::U64(2_000_000)));
        assert_eq!(flow_var(&sw, 1, "tuple"), Some(Value::Str("udp 10.0.0.2:5000 <-> 10.0.0.1:53".into())));
        assert_eq!(flow_var(&sw, 2, "tuple"), Some(Value::Str("tcp 10.0.0.2:40000 <-> 10.0.0.1:80".into())));
        assert_eq!(flow_var(&sw, 3, "tuple"), Some(Value::Str("icmp 10.0.0.2 <-> 10.0.0.1 id 7".into())));
        assert_eq!(flow_var(&sw, 4, "tuple"), Some(Value::Str("proto 47 10.0.0.2 <-> 10.0.0.1".into())));
        // A different port is a different flow; the next id.
        send(&mut sw, "c", "in", &[udp4(A, B, 5001, 53, b"")], Direction::Down, 3);
        assert_eq!(take(lu)[0].flow(), Some(5));
    }

    #[test]
    fn ipv6_flows_and_icmpv6() {
        let (mut sw, logs) = stack(&[]);
        let a: Ipv6Addr = "fd00::2".parse().unwrap();
        let b: Ipv6Addr = "fd00::1".parse().unwrap();
        let q = build::ipv6(a, b, proto::UDP, 64, &build::udp(a.into(), b.into(), 7, 9, b"x"));
        let r = build::ipv6(b, a, proto::UDP, 64, &build::udp(b.into(), a.into(), 9, 7, b"y"));
        let mut echo = build::icmpv4_echo(3, 1, b"");
        echo[0] = 128;
        let ping = build::ipv6(a, b, proto::ICMPV6, 64, &echo);
        send(&mut sw, "c", "in", &[q, r, ping], Direction::Down, 1);
        let u = take(&logs[1]);
        assert_eq!((u[0].flow(), u[1].flow()), (Some(1), Some(1)));
        assert_eq!(take(&logs[2])[0].flow(), Some(2));
        assert_eq!(flow_var(&sw, 1, "tuple"), Some(Value::Str("udp [fd00::2]:7 <-> [fd00::1]:9".into())));
        assert_eq!(flow_var(&sw, 2, "tuple"), Some(Value::Str("icmpv6 fd00::2 <-> fd00::1 id 3".into())));
    }

    #[test]
    fn bad_packets_are_dropped_with_their_reason() {
        let (mut sw, logs) = stack(&[]);
        let mut bad = udp4(A, B, 1, 2, b"");
        bad[10] ^= 1;
        send(&mut sw, "c", "in", &[vec![], vec![0x45; 10], bad, vec![0x70; 40]], Direction::Up, 1);
        assert!(logs.iter().all(|l| take(l).is_empty()));
        assert_eq!(u64_var(&sw, "module.c.drop_truncated_total"), 2);
        assert_eq!(u64_var(&sw, "module.c.drop_bad_checksum_total"), 1);
        assert_eq!(u64_var(&sw, "module.c.drop_bad_version_total"), 1);
        assert_eq!(u64_var(&sw, "module.c.frames_dropped_total"), 4);
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 0);
    }

    #[test]
    fn idle_udp_flow_expires_and_its_meters_go() {
        let (mut sw, logs) = stack(&["udp_timeout_ms=1000"]);
        send(&mut sw, "c", "in", &[udp4(A, B, 1, 2, b"")], Direction::Down, 0);
        assert_eq!(sw.next_wakeup(), Some(Time::from_millis(1000)));
        // Traffic at 600 ms pushes the deadline to 1600 ms.
        send(&mut sw, "c", "in", &[udp4(B, A, 2, 1, b"")], Direction::Up, 600);
        sw.run(Time::from_millis(1000));
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 1);
        assert!(flow_var(&sw, 1, "packets_total").is_some());
        assert_eq!(sw.next_wakeup(), Some(Time::from_millis(1600)));
        sw.run(Time::from_millis(1600));
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 0);
        assert_eq!(u64_var(&sw, "module.c.flows_expired_total"), 1);
        assert!(flow_var(&sw, 1, "packets_total").is_none(), "meters unregistered");
        assert!(sw.registry().snapshot().matching("flow.**").next().is_none());
        assert_eq!(sw.next_wakeup(), None);
        // The same tuple again is a new flow, in the old one's arena slot (no one holds it): its meters start anew.
        send(&mut sw, "c", "in", &[udp4(A, B, 1, 2, b"")], Direction::Down, 2000);
        assert_eq!(take(&logs[1]).last().unwrap().flow(), Some(2));
        assert_eq!(flow_var(&sw, 2, "packets_total"), Some(Value::U64(1)));
        assert_eq!(flow_var(&sw, 2, "first_seen_ns"), Some(Value::U64(2_000_000_000)));
        // A reader's handle keeps an expired flow's meters (and its slot) as they were.
        let held = sw.registry().snapshot().get("flow.2.packets_total").unwrap().to_handle();
        sw.run(Time::from_millis(3100));
        assert!(flow_var(&sw, 2, "packets_total").is_none());
        send(&mut sw, "c", "in", &[udp4(A, B, 3, 4, b""), udp4(A, B, 3, 4, b"")], Direction::Down, 3200);
        assert_eq!(flow_var(&sw, 3, "packets_total"), Some(Value::U64(2)));
        assert_eq!(held.get(), Value::U64(1));
    }

    #[test]
    fn tcp_fin_from_both_sides_or_rst_shortens_the_timeout() {
        let (mut sw, _logs) = stack(&["tcp_closing_timeout_ms=100"]);
        send(&mut sw, "c", "in", &[tcp4(A, B, 1000, 80, 0x02), tcp4(B, A, 80, 1000, 0x12)], Direction::Down, 0);
        send(&mut sw, "c", "in", &[tcp4(A, B, 1000, 80, 0x11)], Direction::Down, 10);
        sw.run(Time::from_millis(200));
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 1, "one FIN is not enough");
        send(&mut sw, "c", "in", &[tcp4(B, A, 80, 1000, 0x11)], Direction::Up, 300);
        sw.run(Time::from_millis(399));
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 1);
        sw.run(Time::from_millis(400));
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 0);
        // A RST from either side.
        send(&mut sw, "c", "in", &[tcp4(A, B, 1001, 80, 0x02)], Direction::Down, 1000);
        send(&mut sw, "c", "in", &[tcp4(B, A, 80, 1001, 0x04)], Direction::Up, 1010);
        assert_eq!(sw.next_wakeup(), Some(Time::from_millis(1110)));
        sw.run(Time::from_millis(1110));
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 0);
        assert_eq!(u64_var(&sw, "module.c.flows_expired_total"), 2);
        // Without FIN/RST a TCP flow lives for tcp_timeout_ms (300 s by default).
        send(&mut sw, "c", "in", &[tcp4(A, B, 1002, 80, 0x02)], Direction::Down, 2000);
        sw.run(Time::from_millis(301_999));
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 1);
        sw.run(Time::from_millis(302_000));
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 0);
    }

    /// The side that opened the flow is kept as a bit of the key (`first_is_a`): FINs count by side whichever end
    /// of the key opened it.
    #[test]
    fn fins_count_by_side_whichever_end_opened_the_flow() {
        for (opener, other) in [(A, B), (B, A)] {
            let (mut sw, _logs) = stack(&["tcp_closing_timeout_ms=100"]);
            send(&mut sw, "c", "in", &[tcp4(opener, other, 1000, 80, 0x02)], Direction::Down, 0);
            send(&mut sw, "c", "in", &[tcp4(opener, other, 1000, 80, 0x11)], Direction::Down, 1);
            send(&mut sw, "c", "in", &[tcp4(opener, other, 1000, 80, 0x11)], Direction::Down, 2);
            sw.run(Time::from_millis(200));
            assert_eq!(u64_var(&sw, "module.c.flows_active"), 1, "two FINs of one side are not the end ({opener})");
            send(&mut sw, "c", "in", &[tcp4(other, opener, 80, 1000, 0x11)], Direction::Up, 300);
            sw.run(Time::from_millis(400));
            assert_eq!(u64_var(&sw, "module.c.flows_active"), 0, "a FIN from each side ends it ({opener})");
        }
    }

    #[test]
    fn max_flows_passes_the_rest_untracked() {
        let (mut sw, logs) = stack(&["max_flows=2"]);
        let packets: Vec<Vec<u8>> = (0..4).map(|i| udp4(A, B, 100 + i, 53, b"")).collect();
        send(&mut sw, "c", "in", &packets, Direction::Down, 1);
        let u = take(&logs[1]);
        assert_eq!(u.iter().map(|s| s.flow()).collect::<Vec<_>>(), [Some(1), Some(2), None, None]);
        assert_eq!(u64_var(&sw, "module.c.flows_untracked_total"), 2);
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 2);
        // Raised at runtime: new flows are tracked again.
        sw.apply(vec![knob("c", "max_flows", Value::U64(3))]).unwrap();
        send(&mut sw, "c", "in", &packets[2..3], Direction::Down, 2);
        assert_eq!(take(&logs[1])[0].flow(), Some(3));
    }

    #[test]
    fn track_off_empties_the_table_and_timeouts_are_knobs() {
        let (mut sw, logs) = stack(&["track=true", "udp_timeout_ms=5000"]);
        send(&mut sw, "c", "in", &[udp4(A, B, 1, 2, b""), udp4(A, B, 3, 4, b"")], Direction::Down, 1);
        // A shorter timeout applies to existing flows at once.
        sw.apply(vec![knob("c", "udp_timeout_ms", Value::U64(100))]).unwrap();
        assert_eq!(u64_var(&sw, "module.c.udp_timeout_ms"), 100);
        sw.run(Time::from_millis(2));
        assert_eq!(sw.next_wakeup(), Some(Time::from_millis(101)));
        sw.run(Time::from_millis(101));
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 0);
        send(&mut sw, "c", "in", &[udp4(A, B, 1, 2, b"")], Direction::Down, 200);
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 1);
        sw.apply(vec![knob("c", "track", Value::Bool(false))]).unwrap();
        sw.run(Time::from_millis(201));
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 0);
        assert!(sw.registry().snapshot().matching("flow.**").next().is_none());
        take(&logs[1]);
        send(&mut sw, "c", "in", &[udp4(A, B, 1, 2, b"")], Direction::Down, 300);
        assert_eq!(take(&logs[1])[0].flow(), None);
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 0);
    }

    #[test]
    fn many_flows_expire_in_bounded_polls() {
        let (mut sw, _logs) = stack(&["udp_timeout_ms=10"]);
        let packets: Vec<Vec<u8>> = (0..5000u32).map(|i| udp4(A, Ipv4Addr::from(0x0a01_0000 + i), 9, 9, b"")).collect();
        send(&mut sw, "c", "in", &packets, Direction::Down, 0);
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 5000);
        sw.run(Time::from_millis(10));
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 5000 - 4096);
        assert_eq!(sw.next_wakeup(), Some(Time::from_millis(10)));
        sw.run(Time::from_millis(10));
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 0);
    }

    #[test]
    fn replace_keeps_flows_and_separate_prefixes_do_not_collide() {
        let (mut sw, logs) = stack(&["vars_prefix=\"flow.lan\""]);
        send(&mut sw, "c", "in", &[udp4(A, B, 1, 2, b"")], Direction::Down, 1);
        assert_eq!(var(&sw, "flow.lan.1.packets_total"), Some(Value::U64(1)));
        let settings = settings(&["vars_prefix=\"flow.lan\""]);
        let builder = catalog().configure("classify", &settings, None).unwrap();
        sw.apply(vec![flexstack_core::Edit::Replace {
            name: "c".into(),
            kind: "classify".into(),
            settings,
            builder,
            keep_state: true,
        }])
        .unwrap();
        assert_eq!(u64_var(&sw, "module.c.flows_active"), 1);
        send(&mut sw, "c", "in", &[udp4(B, A, 2, 1, b""), udp4(A, B, 5, 6, b"")], Direction::Up, 2);
        let u = take(&logs[1]);
        assert_eq!((u[1].flow(), u[2].flow()), (Some(1), Some(2)));
        assert_eq!(var(&sw, "flow.lan.1.packets_total"), Some(Value::U64(2)));
        assert_eq!(u64_var(&sw, "module.c.flows_created_total"), 2);
        // A second classifier with the default prefix: its flow 1 is flow.1, not a clash with flow.lan.1.
        sw.apply(vec![load("c2", "classify", &[])]).unwrap();
        send(&mut sw, "c2", "in", &[udp4(A, B, 1, 2, b"")], Direction::Down, 3);
        assert_eq!(var(&sw, "flow.1.packets_total"), Some(Value::U64(1)));
        // Unloading removes every flow meter of the module.
        sw.apply(vec![flexstack_core::Edit::Unload { name: "c".into() }]).unwrap();
        assert!(sw.registry().snapshot().matching("flow.lan.**").next().is_none());
    }

    #[test]
    fn settings_are_checked() {
        assert!(config_error("classify", &["max_flows=-1"]).contains("max_flows"));
        assert!(config_error("classify", &["udp_timeout_ms=0"]).contains("within 1.."));
        assert!(config_error("classify", &["vars_prefix=\"iface.x\""]).contains("flow.NAME"));
        assert!(config_error("classify", &["vars_prefix=\"flow.A\""]).contains("flow.NAME"));
        assert!(config_error("classify", &["timeout=1"]).contains("unknown setting `timeout`"));
    }
}
