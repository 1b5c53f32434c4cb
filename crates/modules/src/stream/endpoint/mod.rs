//! The engine of `terminate` (the app's side) and `originate` (the network's side): one smoltcp `Interface` in
//! any-IP mode over an in-memory device, one small socket set per TCP connection (so a packet reaches its socket
//! by one hash lookup, not a scan of every socket), UDP flows handled directly, the stream protocol with its
//! credit, and per-flow meters. Sans-IO: time comes from `Output::now`, and the module asks to be polled at the
//! earliest time one of its connections needs (smoltcp's `poll_at`, or a timeout).
//!
//! The two sides differ in where flows start and which way their stream frames travel:
//!
//! | | terminate ([`Side::App`]) | originate ([`Side::Net`]) |
//! |---|---|---|
//! | IP `in` | packets from the app (Down) | packets from the network (Up) |
//! | IP `out` | packets to the app (Up) | packets to the network (Down) |
//! | a TCP flow starts (client role) | the app's SYN, selected by the match table: a socket listens on its exact destination, holds its SYN-ACK, emits `Open` Down | `Open` arrives: a socket connects to the original destination, and `Open` goes Up when it is established |
//! | a TCP flow starts (server role) | `Open` arrives: a socket connects to the app, and `Open` goes Down when the app accepted | the network client's SYN, selected by a `role server` rule: a socket listens on its exact destination (the app), holds its SYN-ACK, emits `Open` Up |
//! | data it reads (producer) | from the app, sent Down | from the network peer, sent Up |
//! | data it writes (consumer) | Up data, to the app | Down data, to the network peer |
//!
//! So each flow has a *listening* end (it took the first packet, and for TCP holds the SYN-ACK until the other
//! end's `Open` says the far side accepted) and a *connecting* end (it opened the flow towards its side when `Open`
//! arrived): [`listens`] tells which, from the side and the flow's role.

// Its fields are the settings, documented in their declarations; the kernel back-end reads them (`backend`).
mod buffers;
#[allow(missing_docs)]
pub(crate) mod config;
mod device;
pub(crate) mod observe;
pub(crate) mod wire;

use crate::stream::matcher::{Candidate, MatchTable};
use buffers::Sock;
use config::{Cc, Config, Meters};
use device::Queues;
use flexstack_core::frame::Gso;
use flexstack_core::stream::{Credit, FlowInfo, Protocol, Role, StreamEvent, StreamFrame};
use flexstack_core::switch::segment_packet;
use flexstack_core::{
    Batch, ConfigError, Direction, Frame, KindDecl, Meter, Module, ModuleBuilder, ModuleInterface, ModuleVars, Output,
    Packet, Settings, Time, Value, ValueType, VarSpec, VarSpecs,
};
use flexstack_wire::checksum;
use flexstack_wire::packet::{proto, PacketInfo};
use observe::{Observer, Segment};
use smoltcp::iface::{Config as IfaceConfig, Interface, SocketHandle, SocketSet};
use smoltcp::socket::tcp;
use smoltcp::time::{Duration as SmolDuration, Instant};
use smoltcp::wire::{HardwareAddress, IpAddress, IpCidr, IpEndpoint, IpListenEndpoint, Ipv4Address, Ipv6Address};
use std::any::Any;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// Which end of the stream chain an endpoint is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// `terminate`: faces the app.
    App,
    /// `originate`: faces the network.
    Net,
}

impl Side {
    /// The direction of the stream frames it emits (its data, its acks, its opens).
    pub fn out_dir(self) -> Direction {
        match self {
            Side::App => Direction::Down,
            Side::Net => Direction::Up,
        }
    }

    /// The direction of the packets it sends.
    fn ip_dir(self) -> Direction {
        match self {
            Side::App => Direction::Up,
            Side::Net => Direction::Down,
        }
    }
}

/// Whether the endpoint on `side` is the listening end of a flow of `role` (it took the flow's first packet), not
/// the connecting end (it opened the flow when `Open` arrived): terminate for the client role, originate for the
/// server role.
pub fn listens(side: Side, role: Role) -> bool {
    (side == Side::App) == (role == Role::Client)
}

/// The ids of the flows `originate` opens itself (the server role) start after this, far from `terminate`'s (1, 2,
/// ...) and from its kernel back-end's (2^32 + 1 ...), so the two endpoints never give one id to two flows.
pub const SERVER_IDS: u64 = 1 << 40;

/// Port indices of an endpoint.
#[derive(Clone, Copy, Debug)]
pub struct Ports {
    /// IP packets in.
    pub ip_in: usize,
    /// Stream frames in.
    pub stream_in: usize,
    /// IP packets out.
    pub ip_out: usize,
    /// Stream frames out.
    pub stream_out: usize,
    /// Packets not terminated.
    pub pass: usize,
}

/// A flow's key: protocol, the far end (the source of the packets arriving on `in`), the near end.
type Key = (u8, SocketAddr, SocketAddr);

/// A TCP connection's socket and stream state.
struct Tcp {
    sockets: SocketSet<'static>,
    handle: SocketHandle,
    /// Packets for the socket, fed at the next service.
    rx: Vec<Packet>,
    /// Listening end: the far side accepted (`Open` arrived, SYN-ACK released). Connecting end: established and
    /// `Open` sent.
    accepted: bool,
    /// The connection was established once.
    established: bool,
    /// `Fin` sent for the direction this endpoint produces.
    fin_sent: bool,
    /// `Fin` received for the direction it consumes.
    fin_in: bool,
    /// The socket's send side was closed after that `Fin`.
    closed: bool,
    /// `Abort` received: the socket was reset; nothing is echoed.
    abort_in: bool,
    /// Listening end: the SYN, quoted in an ICMP error if the far side is unreachable before the SYN-ACK.
    syn: Vec<u8>,
    obs: Observer,
    state: tcp::State,
    /// The state its `tcp.state` meter shows (stored again only when it changes: a string behind a lock).
    shown: Option<tcp::State>,
    cc: Cc,
    /// Where its buffers are (`Sock::bufs`).
    bufs: Option<(usize, usize)>,
    /// Its buffers may hold resident pages: bytes or segments went through since they were last discarded.
    resident: bool,
    /// When bytes or segments last went through.
    last_active: Time,
    /// Bytes went into the socket (towards its peer) since the peer's last payload came in.
    replied: bool,
    /// The peer's last payload came after a reply of ours: an exchange, where a reply can carry the next ACK.
    exchange: bool,
}

impl Tcp {
    /// A connection in its first `state` at `now`, with nothing fed, sent or received yet. Its socket may come from
    /// the pool with pages resident: its idle time starts now.
    fn new(sock: Sock, syn: Vec<u8>, obs: Observer, (state, now): (tcp::State, Time), cc: Cc) -> Box<Tcp> {
        let Sock { sockets, handle, bufs } = sock;
        Box::new(Tcp {
            sockets,
            handle,
            bufs,
            resident: true,
            last_active: now,
            replied: false,
            exchange: false,
            rx: Vec::new(),
            accepted: false,
            established: false,
            fin_sent: false,
            fin_in: false,
            closed: false,
            abort_in: false,
            syn,
            obs,
            state,
            shown: None,
            cc,
        })
    }
}

/// One flow.
struct Conn {
    key: Key,
    info: FlowInfo,
    vars: FlowMeters,
    /// When it started: its meters are published `meters_after_ms` later.
    born: Time,
    /// What this endpoint produces: bytes sent and acked.
    credit: Credit,
    /// Data for the socket, oldest first, with how much of the first frame was written.
    queue: VecDeque<Packet>,
    queue_off: usize,
    queued: u64,
    /// Bytes handed to the socket, to ack.
    to_ack: u64,
    /// Connect timeout (TCP, until established) or idle deadline (UDP).
    deadline: Option<Time>,
    /// The time this flow is filed under in the timer set.
    timer: Option<Time>,
    touched: bool,
    tcp: Option<Box<Tcp>>,
}

/// A flow's runtime meters: its byte counts, and once published (`meters_after_ms`) its cells in the registry.
#[derive(Default)]
struct FlowMeters {
    live: Option<Box<LiveMeters>>,
    down: u64,
    up: u64,
}

/// The registry cells of a published flow.
struct LiveMeters {
    down: Meter,
    up: Meter,
    in_flight: Meter,
    queued: Meter,
    tcp: Option<[Meter; 8]>,
}

impl FlowMeters {
    /// Publishes them in `vars`, with the bytes counted so far.
    fn publish(&mut self, vars: &ModuleVars, tcp: bool) {
        let m = |n: &str| vars.meter(n);
        let live = LiveMeters {
            down: m("bytes_down_total"),
            up: m("bytes_up_total"),
            in_flight: m("in_flight_bytes"),
            queued: m("queued_bytes"),
            tcp: tcp.then(|| std::array::from_fn(|i| m(config::TCP_METERS[i].0))),
        };
        live.down.add(self.down);
        live.up.add(self.up);
        self.live = Some(Box::new(live));
    }

    /// `n` more bytes travelling down (else up).
    fn add(&mut self, down: bool, n: u64) {
        let (total, live) = match (down, &self.live) {
            (true, l) => (&mut self.down, l.as_ref().map(|l| &l.down)),
            (false, l) => (&mut self.up, l.as_ref().map(|l| &l.up)),
        };
        *total += n;
        if let Some(m) = live {
            m.add(n);
        }
    }

    fn set_in_flight(&self, v: u64) {
        if let Some(l) = &self.live {
            l.in_flight.set(v);
        }
    }

    fn set_queued(&self, v: u64) {
        if let Some(l) = &self.live {
            l.queued.set(v);
        }
    }

    fn tcp(&self) -> Option<&[Meter; 8]> {
        self.live.as_ref().and_then(|l| l.tcp.as_ref())
    }
}

/// The endpoint's smoltcp interface: any-IP, with addresses of its own only so that the default routes have a
/// gateway (every destination is accepted, and it may send to any address: the device is IP, no neighbour is
/// looked up).
fn interface(seed: u64, dev: &mut Queues) -> Interface {
    let mut ic = IfaceConfig::new(HardwareAddress::Ip);
    ic.random_seed = seed;
    let mut iface = Interface::new(ic, dev, Instant::ZERO);
    iface.set_any_ip(true);
    let (v4, v6) = (Ipv4Address::new(192, 0, 0, 8), Ipv6Address::new(0x100, 0, 0, 0, 0, 0, 0, 1));
    iface.update_ip_addrs(|a| {
        let _ = a.push(IpCidr::new(IpAddress::Ipv4(v4), 32));
        let _ = a.push(IpCidr::new(IpAddress::Ipv6(v6), 128));
    });
    let _ = iface.routes_mut().add_default_ipv4_route(v4);
    let _ = iface.routes_mut().add_default_ipv6_route(v6);
    iface
}

/// What an endpoint hands to its replacement (`module replace` with state kept): its interface and every flow,
/// with their sockets, queues, credit, timers and meters.
struct Flows {
    side: Side,
    iface: Interface,
    conns: HashMap<u64, Conn>,
    by_key: HashMap<Key, u64>,
    timers: BTreeSet<(Time, u64)>,
    next_id: u64,
    next_port: u32,
    tcp_count: usize,
    udp_count: usize,
    buffered: u64,
    in_flight: u64,
    /// TCP connections over both ways and in TIME-WAIT: only their tuple and when TIME-WAIT ends (their socket,
    /// buffers and meters are gone). Their segments are absorbed; a new SYN starts a new connection.
    time_wait: HashMap<Key, Time>,
    /// The same, oldest first (an entry whose time no longer matches was taken over).
    time_wait_order: VecDeque<(Time, Key)>,
    /// TCP connections made by a SYN, oldest first; those whose app has finished its handshake (or that are gone)
    /// are skipped when the oldest waiting one must give way (`max_half_open`).
    half_open: VecDeque<u64>,
    /// Sockets of ended connections, each alone in its set, kept for new ones (at most `socket_pool`).
    pool: Vec<Sock>,
}

impl Flows {
    /// No flows yet. originate's own ids (the server role) start after `SERVER_IDS`.
    fn new(side: Side, iface: Interface, next_port: u32) -> Flows {
        Flows {
            side,
            iface,
            conns: HashMap::new(),
            by_key: HashMap::new(),
            timers: BTreeSet::new(),
            next_id: if side == Side::Net { SERVER_IDS } else { 0 },
            next_port,
            tcp_count: 0,
            udp_count: 0,
            buffered: 0,
            in_flight: 0,
            time_wait: HashMap::new(),
            half_open: VecDeque::new(),
            time_wait_order: VecDeque::new(),
            pool: Vec::new(),
        }
    }
}

fn instant(t: Time) -> Instant {
    Instant::from_micros((t.as_nanos() / 1000) as i64)
}

fn time(i: Instant) -> Time {
    Time(i.total_micros().max(0) as u64 * 1000)
}

/// The earlier of two times, either of which may be none.
fn soonest(a: Option<Time>, b: Option<Time>) -> Option<Time> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn ms(v: u64) -> Option<SmolDuration> {
    (v > 0).then(|| SmolDuration::from_millis(v))
}

fn endpoint(a: SocketAddr) -> IpEndpoint {
    IpEndpoint::new(IpAddress::from(a.ip()), a.port())
}

fn state_name(s: tcp::State) -> &'static str {
    use tcp::State::*;
    match s {
        Closed => "closed",
        Listen => "listen",
        SynSent => "syn-sent",
        SynReceived => "syn-received",
        Established => "established",
        FinWait1 => "fin-wait-1",
        FinWait2 => "fin-wait-2",
        CloseWait => "close-wait",
        Closing => "closing",
        LastAck => "last-ack",
        TimeWait => "time-wait",
    }
}

/// `p` (TCP) is a SYN without ACK: a new connection.
fn is_syn(p: &Packet, info: &PacketInfo) -> bool {
    Segment::parse(p.data(), info.l4_offset, info.total_len).is_some_and(|s| s.syn && s.ack.is_none())
}

/// The peer's FIN has arrived (the socket's receive side is done once its buffer is read).
fn peer_fin(s: tcp::State) -> bool {
    matches!(s, tcp::State::CloseWait | tcp::State::LastAck | tcp::State::Closing | tcp::State::TimeWait)
}

/// The builder of both kinds: they differ in their declaration, side and ports, and only `terminate` has a match
/// table (one meter per rule).
pub struct EndpointBuilder {
    pub(crate) side: Side,
    pub(crate) ports: Ports,
    pub(crate) decl: &'static KindDecl<Config, Meters>,
    pub(crate) cfg: Config,
    pub(crate) matcher: MatchTable,
}

impl EndpointBuilder {
    /// Reads an endpoint's settings for kind `kind` (declared in `decl`), and with `more` what only that kind has
    /// (its match table, and the back-end: `stream::backend::configure`, which builds the one chosen); draws a seed
    /// when none was given (on the control side, once per module).
    pub fn read(
        settings: &Settings,
        kind: &str,
        decl: &'static KindDecl<Config, Meters>,
        (side, ports): (Side, Ports),
        more: impl FnOnce(&mut flexstack_core::config::SettingsReader<'_>) -> Result<MatchTable, ConfigError>,
    ) -> Result<EndpointBuilder, ConfigError> {
        let mut r = settings.reader(kind);
        let mut cfg = Config::blank();
        decl.read(&mut r, &mut cfg)?;
        let matcher = more(&mut r)?;
        r.finish()?;
        if cfg.seed == 0 {
            use std::hash::BuildHasher;
            cfg.seed = std::collections::hash_map::RandomState::new().hash_one(0x5eed_u64) | 1;
        }
        Ok(EndpointBuilder { side, ports, decl, cfg, matcher })
    }
}

impl ModuleBuilder for EndpointBuilder {
    fn global_view(&self) -> bool {
        self.decl.global_view
    }

    fn interface(&self) -> ModuleInterface {
        let mut iface = self.decl.interface(&self.cfg);
        for (i, rule) in self.matcher.rules.iter().enumerate() {
            let desc = format!("new flows decided by match rule {}: {rule}", i + 1);
            iface.vars.push(VarSpec::meter(&format!("rule{}_matches_total", i + 1), ValueType::U64, "flows", &desc));
        }
        iface
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        Box::new(Endpoint::new(*self, vars))
    }
}

/// A running `terminate` or `originate`.
pub struct Endpoint {
    side: Side,
    ports: Ports,
    decl: &'static KindDecl<Config, Meters>,
    cfg: Config,
    m: Meters,
    matcher: MatchTable,
    rule_hits: Vec<Meter>,
    /// Its interface and flows (handed to a replacement as they are).
    f: Flows,
    dev: Queues,
    /// A socket set with no socket: a TCP packet fed through it is answered with RST.
    empty: SocketSet<'static>,
    touched: Vec<u64>,
    /// Per-flow variables, declared once: every flow's cells share them.
    tcp_specs: VarSpecs,
    udp_specs: VarSpecs,
}

/// How long a connection's tuple stays in TIME-WAIT (smoltcp's own delay).
const TIME_WAIT: Duration = Duration::from_secs(10);

/// Allocations from this size up are fresh mappings (`flexstack_sys::fix_mmap_threshold`).
const MMAP_THRESHOLD: usize = 128 * 1024;

impl Endpoint {
    /// The endpoint `b` built, its settings and knobs published in `vars`, its meters bound there (one per match
    /// rule too).
    fn new(b: EndpointBuilder, vars: &ModuleVars) -> Endpoint {
        let EndpointBuilder { side, ports, decl, cfg, matcher } = b;
        // Socket buffers of 128 KiB and more (glibc's initial threshold) as fresh mappings: an idle connection's untouched pages cost nothing
        // (docs/streams.md, "Memory"). glibc's own threshold rises after the first large free, and buffers then
        // come from the heap, zeroed by hand, every page resident.
        static LAZY_BUFFERS: std::sync::Once = std::sync::Once::new();
        LAZY_BUFFERS.call_once(|| {
            flexstack_sys::fix_mmap_threshold(MMAP_THRESHOLD);
        });
        decl.publish(&cfg, vars);
        let m = decl.meters(vars);
        let rule_hits = (1..=matcher.rules.len()).map(|i| vars.meter(&format!("rule{i}_matches_total"))).collect();
        let mut dev = Queues::new(cfg.mtu as usize, cfg.gso);
        let next_port = u32::from(cfg.ports.first) + (cfg.seed % u64::from(cfg.ports.count())) as u32;
        let f = Flows::new(side, interface(cfg.seed, &mut dev), next_port);
        Endpoint {
            side,
            ports,
            decl,
            cfg,
            m,
            matcher,
            rule_hits,
            f,
            dev,
            empty: SocketSet::new(Vec::new()),
            touched: Vec::new(),
            tcp_specs: VarSpecs::new(config::tcp_flow_specs()),
            udp_specs: VarSpecs::new(config::flow_specs()),
        }
    }

    fn touch(&mut self, id: u64) {
        if let Some(c) = self.f.conns.get_mut(&id) {
            if !c.touched {
                c.touched = true;
                self.touched.push(id);
            }
        }
    }

    fn schedule(&mut self, id: u64, at: Option<Time>) {
        let Some(c) = self.f.conns.get_mut(&id) else { return };
        if c.timer == at {
            return;
        }
        if let Some(old) = c.timer.take() {
            self.f.timers.remove(&(old, id));
        }
        if let Some(t) = at {
            self.f.timers.insert((t, id));
            c.timer = Some(t);
        }
    }

    fn emit_stream(&mut self, out: &mut Output<'_>, p: Packet) {
        out.emit(self.ports.stream_out, p);
    }

    fn pass(&mut self, out: &mut Output<'_>, p: Packet) {
        self.m.passed.add(1);
        out.emit(self.ports.pass, p);
    }

    /// A closed socket alone in its set, configured: from the pool, else one of the process's spare sockets, else
    /// new (`buffers`). Buffers cost their mapping and first touch per connection, hence the pool.
    fn new_socket(&mut self) -> Sock {
        let (rx, tx) = (self.cfg.rx_buffer as usize, self.cfg.tx_buffer as usize);
        let mut sock = self.f.pool.pop().or_else(|| buffers::take_spare(rx, tx)).unwrap_or_else(|| Sock::new(rx, tx));
        self.m.pooled.set(self.f.pool.len() as u64);
        let s = sock.socket();
        s.set_nagle_enabled(self.cfg.nagle);
        s.set_keep_alive(ms(self.cfg.keepalive_ms));
        s.set_timeout(ms(self.cfg.timeout_ms));
        s.set_congestion_control(self.cfg.cc.smoltcp());
        s.pause_synack(false);
        sock
    }

    /// Keeps a socket (alone in its set) for a new connection while the pool has room, else gives it to the
    /// process's spare sockets (its buffers discarded). It is closed at once, without a word to the far end (what
    /// its connection had to say was said); `listen` or `connect` resets it.
    fn put_back(&mut self, mut sock: Sock) {
        if (self.f.pool.len() as u64) < self.cfg.socket_pool {
            sock.socket().abort();
            self.f.pool.push(sock);
        } else {
            buffers::give_spare(sock);
            while self.f.pool.len() as u64 > self.cfg.socket_pool {
                buffers::give_spare(self.f.pool.pop().expect("longer than the pool"));
            }
        }
        self.m.pooled.set(self.f.pool.len() as u64);
    }

    /// Files a new flow: its id, key and counts; its meters are published `meters_after_ms` later (at once if 0).
    fn insert(&mut self, id: u64, key: Key, info: FlowInfo, tcp: Option<Box<Tcp>>, out: &mut Output<'_>) {
        if tcp.is_some() {
            self.f.tcp_count += 1;
            self.m.tcp_total.add(1);
        } else {
            self.f.udp_count += 1;
            self.m.udp_total.add(1);
        }
        self.f.by_key.insert(key, id);
        self.f.conns.insert(
            id,
            Conn {
                key,
                info,
                vars: FlowMeters::default(),
                born: out.now(),
                credit: Credit::default(),
                queue: VecDeque::new(),
                queue_off: 0,
                queued: 0,
                to_ack: 0,
                deadline: None,
                timer: None,
                touched: false,
                tcp,
            },
        );
        if self.cfg.meters_after_ms == 0 {
            self.publish_flow(id, out);
        }
        self.publish_counts();
    }

    /// When flow `c`'s meters are to be published, if they are not yet.
    fn publish_at(&self, c: &Conn) -> Option<Time> {
        c.vars.live.is_none().then(|| c.born + Duration::from_millis(self.cfg.meters_after_ms))
    }

    /// Publishes the meters of flow `id` under `<vars_prefix>.<id>`: a connection that ends sooner than
    /// `meters_after_ms` costs no registration (a short connection's largest cost after its packets).
    fn publish_flow(&mut self, id: u64, out: &mut Output<'_>) {
        let Some(c) = self.f.conns.get_mut(&id) else { return };
        if c.vars.live.is_some() {
            return;
        }
        let name = format!("{}.{id}", self.cfg.vars_prefix);
        let specs = if c.tcp.is_some() { &self.tcp_specs } else { &self.udp_specs };
        // Another module owning the prefix (a misconfiguration) leaves the meters unpublished, never the flow.
        let vars = out.register_vars(&name, specs).unwrap_or_else(|_| ModuleVars::shared(specs));
        let info = &c.info;
        let role = if info.role == Role::Server { " role server" } else { "" };
        vars.meter("tuple").store(&Value::Str(format!(
            "{} {} -> {}{role} app {:?}",
            info.protocol.name(),
            info.src,
            info.dst,
            info.app
        )));
        if let Some(t) = c.tcp.as_mut() {
            vars.meter("tcp.cc").store(&Value::Str(t.cc.name().into()));
            t.shown = None;
        }
        c.vars.publish(&vars, c.tcp.is_some());
        c.vars.set_in_flight(c.credit.in_flight());
        c.vars.set_queued(c.queued);
    }

    fn publish_counts(&self) {
        self.m.tcp_active.set(self.f.tcp_count as u64);
        self.m.udp_active.set(self.f.udp_count as u64);
        self.m.buffered.set(self.f.buffered);
        self.m.in_flight.set(self.f.in_flight);
    }

    /// Forgets flow `id`: its key, timer, queue and meters.
    fn remove(&mut self, id: u64, out: &mut Output<'_>) {
        let Some(c) = self.f.conns.remove(&id) else { return };
        self.f.by_key.remove(&c.key);
        if let Some(t) = c.timer {
            self.f.timers.remove(&(t, id));
        }
        self.f.buffered -= c.queued;
        self.f.in_flight -= c.credit.in_flight();
        if let Some(t) = c.tcp {
            self.f.tcp_count -= 1;
            let Tcp { sockets, handle, bufs, .. } = *t;
            self.put_back(Sock { sockets, handle, bufs });
        } else {
            self.f.udp_count -= 1;
        }
        if c.vars.live.is_some() {
            out.unregister_vars(&format!("{}.{id}", self.cfg.vars_prefix));
        }
        self.publish_counts();
    }

    /// Sends `Abort(reason)` for flow `id` and forgets it.
    fn abort_and_remove(&mut self, id: u64, reason: &str, out: &mut Output<'_>) {
        self.m.aborts_sent.add(1);
        let p = StreamFrame::abort(out.pool(), id, self.side.out_dir(), reason);
        self.emit_stream(out, p);
        self.remove(id, out);
    }

    // ---------------------------------------------------------------------------------------------------------
    // IP packets in
    // ---------------------------------------------------------------------------------------------------------

    fn ip_in(&mut self, frame: Frame, out: &mut Output<'_>) {
        let Frame::Data(mut p) = frame else {
            self.m.not_packet.add(1);
            out.drop_frame(frame);
            return;
        };
        // Everything it does not terminate leaves on `pass` exactly as it came (partial checksum included).
        let Ok(info) = PacketInfo::parse(p.data()) else { return self.pass(out, p) };
        if info.fragment.is_some() {
            return self.pass(out, p);
        }
        let (src, dst) = (SocketAddr::new(info.src, info.src_port), SocketAddr::new(info.dst, info.dst_port));
        match info.protocol {
            proto::TCP | proto::UDP => {
                let key = (info.protocol, src, dst);
                if info.protocol == proto::UDP && Gso::of(p.meta()).is_some() && self.f.by_key.contains_key(&key) {
                    return self.cut_datagrams(p, out); // a UDP super-packet of a flow it holds: one datagram each
                }
                if let Some(&id) = self.f.by_key.get(&key) {
                    // A TCP segment goes to smoltcp whole (a super-packet too), its checksum checked as it is fed.
                    if info.protocol == proto::UDP {
                        checksum::complete_partial(&mut p);
                    }
                    return self.flow_packet(id, p, &info, out);
                }
                if info.protocol == proto::TCP && !self.f.time_wait.is_empty() {
                    self.expire_time_wait(out.now());
                    if self.f.time_wait.contains_key(&key) {
                        if !is_syn(&p, &info) {
                            // A late segment of a connection that ended: absorbed, as by a TIME-WAIT socket.
                            out.drop_frame(Frame::Data(p));
                            return;
                        }
                        // A new connection on the tuple (the app reuses its port at once: it closed second, so it
                        // keeps no TIME-WAIT of its own): the SYN starts a new flow, as a kernel's TIME-WAIT
                        // socket accepts a new SYN.
                        self.m.time_wait_reused.add(1);
                        self.f.time_wait.remove(&key);
                    }
                }
                if let Some(p) = self.new_flow(p, &info, src, dst, out) {
                    self.pass(out, p);
                }
            }
            proto::ICMP | proto::ICMPV6 => {
                if let Some(p) = self.icmp_error(p, &info, out) {
                    self.pass(out, p);
                }
            }
            _ => self.pass(out, p),
        }
    }

    /// A UDP GSO super-packet of a flow it holds: its datagrams, one by one (a UDP flow's `Data` is one datagram).
    fn cut_datagrams(&mut self, p: Packet, out: &mut Output<'_>) {
        let mut datagrams = Vec::new();
        let gso = Gso::of(p.meta()).expect("a super-packet");
        if segment_packet(out.pool(), &p, &gso, &mut datagrams).is_none() {
            self.m.bad_datagrams.add(1);
            out.drop_frame(Frame::Data(p));
            return;
        }
        for d in datagrams {
            self.ip_in(d, out);
        }
    }

    /// Forgets the tuples whose TIME-WAIT is over.
    fn expire_time_wait(&mut self, now: Time) {
        while let Some(&(t, key)) = self.f.time_wait_order.front() {
            if t > now {
                break;
            }
            self.f.time_wait_order.pop_front();
            if self.f.time_wait.get(&key) == Some(&t) {
                self.f.time_wait.remove(&key);
            }
        }
    }

    /// TCP flow `id` is over both ways, its socket in TIME-WAIT: the flow goes (socket, buffers, meters), its tuple
    /// stays until TIME-WAIT ends. At most `4 x max_connections` tuples are kept (the oldest go first).
    fn enter_time_wait(&mut self, id: u64, now: Time, out: &mut Output<'_>) {
        let Some(key) = self.f.conns.get(&id).map(|c| c.key) else { return };
        self.remove(id, out);
        let until = now + TIME_WAIT;
        self.f.time_wait.insert(key, until);
        self.f.time_wait_order.push_back((until, key));
        let most = self.cfg.max_connections.saturating_mul(4).max(1) as usize;
        while self.f.time_wait.len() > most {
            let Some((t, k)) = self.f.time_wait_order.pop_front() else { break };
            if self.f.time_wait.get(&k) == Some(&t) {
                self.f.time_wait.remove(&k);
            }
        }
        if self.f.time_wait_order.len() > 2 * most {
            let live = &self.f.time_wait;
            self.f.time_wait_order.retain(|(t, k)| live.get(k) == Some(t));
        }
    }

    /// A packet of a flow it holds.
    fn flow_packet(&mut self, id: u64, p: Packet, info: &PacketInfo, out: &mut Output<'_>) {
        let Some(c) = self.f.conns.get_mut(&id) else { return };
        match &mut c.tcp {
            Some(_) if !device::tcp_checksum_ok(&p, info) => {
                self.m.bad_checksums.add(1);
                out.drop_frame(Frame::Data(p));
            }
            Some(t) => {
                t.rx.push(p);
                self.m.segments_in.add(1);
                self.touch(id);
            }
            None => match wire::udp_payload(p.data(), info) {
                Some(payload) => self.udp_datagram(id, payload, out),
                None => {
                    self.m.bad_datagrams.add(1);
                    out.drop_frame(Frame::Data(p));
                }
            },
        }
    }

    /// A datagram of UDP flow `id` from the socket side: `Data` if its budget allows.
    fn udp_datagram(&mut self, id: u64, payload: &[u8], out: &mut Output<'_>) {
        let (budget, dir, timeout) = (self.cfg.udp_budget, self.side.out_dir(), self.cfg.udp_timeout_ms);
        let Some(c) = self.f.conns.get_mut(&id) else { return };
        let len = payload.len() as u64;
        if c.credit.room(budget) < len.max(1) {
            self.m.udp_budget_drops.add(1);
            return;
        }
        c.credit.send(len);
        self.f.in_flight += len;
        c.vars.add(dir == Direction::Down, len);
        c.vars.set_in_flight(c.credit.in_flight());
        c.deadline = Some(out.now() + Duration::from_millis(timeout));
        self.m.bytes_out.add(len);
        let d = StreamFrame::data(out.pool(), id, dir, payload);
        self.emit_stream(out, d);
        self.touch(id);
    }

    /// A TCP or UDP packet that matches no flow (from the app: the client role; from the network: the server role):
    /// a new flow if the match table selects it (the packet is consumed), else the packet back (to pass).
    fn new_flow(
        &mut self,
        mut p: Packet,
        info: &PacketInfo,
        src: SocketAddr,
        dst: SocketAddr,
        out: &mut Output<'_>,
    ) -> Option<Packet> {
        let tcp = info.protocol == proto::TCP;
        if tcp {
            let flags = p.data().get(info.l4_offset + 13).copied().unwrap_or(0);
            if flags & 0x12 != 0x02 {
                return Some(p); // not a SYN: a flow that started before this module, or not ours
            }
        }
        let protocol = if tcp { Protocol::Tcp } else { Protocol::Udp };
        let role = if self.side == Side::App { Role::Client } else { Role::Server };
        let c = Candidate { protocol, src, dst, role, app: &self.cfg.app };
        let Some((rule, terminate)) = self.matcher.decide(&c) else { return Some(p) };
        self.rule_hits[rule].add(1);
        if !terminate {
            return Some(p);
        }
        checksum::complete_partial(&mut p);
        if tcp && !device::tcp_checksum_ok(&p, info) {
            self.m.invalid_syns.add(1); // smoltcp does not check checksums (`device`)
            out.drop_frame(Frame::Data(p));
            return None;
        }
        let info_out = FlowInfo { protocol, src, dst, app: self.cfg.app.clone(), role };
        let (now, dir) = (out.now(), self.side.out_dir());
        if !tcp {
            if wire::udp_payload(p.data(), info).is_none() {
                self.m.bad_datagrams.add(1); // as a kernel would: no flow for a datagram that is not one
                out.drop_frame(Frame::Data(p));
                return None;
            }
            if self.f.udp_count as u64 >= self.cfg.max_udp_flows {
                self.m.refused.add(1);
                out.drop_frame(Frame::Data(p));
                return None;
            }
            let id = self.new_id();
            let open = StreamFrame::open(out.pool(), id, dir, &info_out);
            self.insert(id, (proto::UDP, src, dst), info_out, None, out);
            self.emit_stream(out, open);
            let payload = wire::udp_payload(p.data(), info).expect("checked");
            self.udp_datagram(id, payload, out);
            return None;
        }
        // A SYN flood must not fill max_connections with connections that never finish their handshake: beyond
        // max_half_open waiting ones, the oldest gives way (as a kernel's SYN queue drops its oldest entry).
        while self.f.half_open.len() as u64 >= self.cfg.max_half_open {
            let Some(old) = self.f.half_open.pop_front() else { break };
            if self.f.conns.get(&old).and_then(|c| c.tcp.as_ref()).is_some_and(|t| !t.established) {
                self.m.half_open_evicted.add(1);
                self.abort_and_remove(old, "timeout", out);
                break;
            }
        }
        if self.f.tcp_count as u64 >= self.cfg.max_connections {
            // Refused: the SYN goes through a socket set without sockets, which answers with RST.
            self.m.refused.add(1);
            self.dev.rx.push_back(p);
            self.f.iface.poll(instant(now), &mut self.dev, &mut self.empty);
            self.flush_tx(None, now, out);
            return None;
        }
        let mut sock = self.new_socket();
        let s = sock.socket();
        if s.listen(IpListenEndpoint { addr: Some(IpAddress::from(dst.ip())), port: dst.port() }).is_err() {
            self.put_back(sock);
            return Some(p); // port 0: not a connection smoltcp can accept
        }
        s.pause_synack(true);
        let syn = p.data()[..info.total_len.min(info.l4_offset + 60)].to_vec();
        let mut obs = Observer::default();
        if let Some(seg) = Segment::parse(p.data(), info.l4_offset, info.total_len) {
            obs.received(&seg, now);
        }
        // The SYN goes in at once: a SYN smoltcp does not take (a bad checksum, bad options) makes no connection.
        self.dev.rx.push_back(p);
        self.f.iface.poll(instant(now), &mut self.dev, &mut sock.sockets);
        self.dev.tx.clear(); // nothing: the SYN-ACK is held
        if sock.socket().state() != tcp::State::SynReceived {
            self.m.invalid_syns.add(1);
            self.put_back(sock);
            return None;
        }
        let id = self.new_id();
        let t = Tcp::new(sock, syn, obs, (tcp::State::SynReceived, now), self.cfg.cc);
        let open = StreamFrame::open(out.pool(), id, dir, &info_out);
        self.insert(id, (proto::TCP, src, dst), info_out, Some(t), out);
        self.f.half_open.push_back(id);
        self.m.segments_in.add(1);
        if let Some(c) = self.f.conns.get_mut(&id) {
            c.deadline = Some(now + Duration::from_millis(self.cfg.connect_timeout_ms));
        }
        self.emit_stream(out, open);
        self.touch(id);
        None
    }

    fn new_id(&mut self) -> u64 {
        self.f.next_id += 1;
        self.f.next_id
    }

    /// An ICMP error about one of the flows it opened as the connecting end (originate: from the network; terminate:
    /// from the app, about a flow of the server role): a connection being made, or a UDP flow, ends as
    /// `unreachable`. Returns the packet if it is not about such a flow.
    fn icmp_error(&mut self, p: Packet, info: &PacketInfo, out: &mut Output<'_>) -> Option<Packet> {
        let dest_unreachable = matches!(info.icmp, Some((3, _))) && info.protocol == proto::ICMP
            || matches!(info.icmp, Some((1, _))) && info.protocol == proto::ICMPV6;
        if !dest_unreachable {
            return Some(p);
        }
        let Some(q) = wire::quoted(&p.data()[info.l4_offset..info.total_len]) else { return Some(p) };
        // The quoted packet is one we sent: its destination is the far end, its source the near end.
        let Some(&id) = self.f.by_key.get(&(q.protocol, q.dst, q.src)) else { return Some(p) };
        if self.f.conns.get(&id).is_none_or(|c| listens(self.side, c.info.role)) {
            return Some(p);
        }
        let connecting = self.f.conns.get(&id).and_then(|c| c.tcp.as_ref()).map(|t| !t.established);
        // An established connection takes it as a soft error, as a kernel socket does: nothing changes.
        if connecting != Some(false) {
            self.m.icmp_errors.add(1);
            self.abort_and_remove(id, "unreachable", out);
        }
        out.drop_frame(Frame::Data(p));
        None
    }

    // ---------------------------------------------------------------------------------------------------------
    // Stream frames in
    // ---------------------------------------------------------------------------------------------------------

    fn stream_in(&mut self, frame: Frame, out: &mut Output<'_>) {
        let Frame::Data(p) = frame else {
            self.m.not_packet.add(1);
            out.drop_frame(frame);
            return;
        };
        let (Some(id), Some(event)) = (p.stream_flow(), p.stream()) else {
            self.m.stream_bad.add(1);
            return;
        };
        if p.direction() == self.side.out_dir() {
            self.m.stream_bad.add(1); // its own direction: a loop in the links
            return;
        }
        if let StreamEvent::Open(info) = &event {
            // A new flow this end opens (originate: the client role; terminate: the server role), or the far side's
            // acceptance of one it listens for.
            match self.f.conns.get(&id) {
                None if !listens(self.side, info.role) => return self.open_connect(id, info.clone(), out),
                Some(c) if !listens(self.side, c.info.role) => {
                    self.m.stream_bad.add(1); // a second Open for a flow it opened
                    return;
                }
                _ => {}
            }
        }
        if !self.f.conns.contains_key(&id) {
            self.m.stream_orphans.add(1);
            return;
        }
        match event {
            StreamEvent::Open(_) => {
                // The listening end: the far side accepted; release the SYN-ACK.
                if let Some(t) = self.f.conns.get_mut(&id).and_then(|c| c.tcp.as_mut()) {
                    if !t.accepted {
                        t.accepted = true;
                        t.syn = Vec::new(); // quoted only in an error before the SYN-ACK
                        t.sockets.get_mut::<tcp::Socket>(t.handle).pause_synack(false);
                    }
                }
                self.touch(id);
            }
            StreamEvent::Data(bytes) => {
                let len = bytes.len() as u64;
                if self.f.conns[&id].tcp.is_none() {
                    self.udp_send(id, &p, out);
                    return;
                }
                let limit = self.cfg.queue_limit;
                let c = self.f.conns.get_mut(&id).expect("checked");
                if c.tcp.as_ref().is_some_and(|t| t.fin_in || t.abort_in) {
                    self.m.stream_bad.add(1); // data after Fin
                    return;
                }
                if c.queued + len > limit {
                    self.m.overflows.add(1);
                    if let Some(t) = c.tcp.as_mut() {
                        t.sockets.get_mut::<tcp::Socket>(t.handle).abort();
                        t.abort_in = true;
                    }
                    self.m.aborts_sent.add(1);
                    let a = StreamFrame::abort(out.pool(), id, self.side.out_dir(), "overflow");
                    self.emit_stream(out, a);
                    self.touch(id);
                    return;
                }
                c.queued += len;
                c.queue.push_back(p);
                self.f.buffered += len;
                self.touch(id);
            }
            StreamEvent::Fin => {
                let c = self.f.conns.get_mut(&id).expect("checked");
                match c.tcp.as_mut() {
                    Some(t) => {
                        t.fin_in = true;
                        self.touch(id);
                    }
                    None => self.remove(id, out), // a UDP flow ended at the other side
                }
            }
            StreamEvent::Abort(reason) => {
                self.m.aborts_received.add(1);
                let reason = reason.to_string();
                self.abort_in(id, &reason, out);
            }
            StreamEvent::Ack(n) => {
                let c = self.f.conns.get_mut(&id).expect("checked");
                let before = c.credit.in_flight();
                if !c.credit.ack(n) {
                    self.m.stream_bad.add(1);
                }
                self.f.in_flight -= before - c.credit.in_flight();
                c.vars.set_in_flight(c.credit.in_flight());
                self.touch(id);
            }
        }
    }

    /// `Data` for UDP flow `id`: the datagram goes out at once, and is acked.
    fn udp_send(&mut self, id: u64, p: &Packet, out: &mut Output<'_>) {
        let (dir, ip_dir, timeout) = (self.side.out_dir(), self.side.ip_dir(), self.cfg.udp_timeout_ms);
        let c = self.f.conns.get_mut(&id).expect("checked");
        let (far, near) = (c.key.1, c.key.2);
        let mut d = wire::udp(out.pool(), near, far, p.data());
        d.set_direction(ip_dir);
        let len = p.len() as u64;
        c.to_ack += len;
        c.vars.add(dir != Direction::Down, len);
        c.deadline = Some(out.now() + Duration::from_millis(timeout));
        self.m.bytes_in.add(len);
        out.emit(self.ports.ip_out, d);
        self.touch(id);
    }

    /// The other endpoint aborted flow `id`.
    fn abort_in(&mut self, id: u64, reason: &str, out: &mut Output<'_>) {
        let (pool, ip_dir) = (out.pool().clone(), self.side.ip_dir());
        let c = self.f.conns.get_mut(&id).expect("checked");
        let far = c.info.dst.ip();
        let listening_end = listens(self.side, c.info.role);
        match c.tcp.as_mut() {
            None => {
                // UDP: an unreachable destination is told to the flow's opener as ICMP port unreachable.
                if listening_end && reason == "unreachable" {
                    let quote = wire::udp(&pool, c.info.src, c.info.dst, &[]);
                    if let Some(mut e) = wire::unreachable(&pool, far, quote.data(), wire::Unreachable::Port) {
                        e.set_direction(ip_dir);
                        out.emit(self.ports.ip_out, e);
                    }
                }
                self.remove(id, out);
            }
            Some(t) => {
                t.abort_in = true;
                if listening_end && !t.accepted {
                    // The opener (the app, or the network client) is still waiting for its SYN-ACK: refused
                    // becomes RST (below), unreachable an ICMP error, a timeout nothing (its own connect timeout
                    // applies).
                    let tell = match reason {
                        "unreachable" => wire::unreachable(&pool, far, &t.syn, wire::Unreachable::Host),
                        "timeout" => None,
                        _ => {
                            t.sockets.get_mut::<tcp::Socket>(t.handle).abort();
                            return self.touch(id);
                        }
                    };
                    if let Some(mut e) = tell {
                        e.set_direction(ip_dir);
                        out.emit(self.ports.ip_out, e);
                    }
                    return self.remove(id, out);
                }
                t.sockets.get_mut::<tcp::Socket>(t.handle).abort();
                self.touch(id);
            }
        }
    }

    /// `Open` of a new flow this end connects: originate towards the original destination (the client role),
    /// terminate towards the app (the server role), from the opener's own address and port (originate: or from
    /// `source`).
    fn open_connect(&mut self, id: u64, info: FlowInfo, out: &mut Output<'_>) {
        if self.f.conns.contains_key(&id) {
            self.m.stream_bad.add(1); // a second Open for a flow it holds
            return;
        }
        let now = out.now();
        let tcp = info.protocol == Protocol::Tcp;
        let (count, max) =
            if tcp { (self.f.tcp_count, self.cfg.max_connections) } else { (self.f.udp_count, self.cfg.max_udp_flows) };
        let refuse = |this: &mut Self, out: &mut Output<'_>, reason: &str| {
            this.m.refused.add(1);
            this.m.aborts_sent.add(1);
            let a = StreamFrame::abort(out.pool(), id, this.side.out_dir(), reason);
            out.emit(this.ports.stream_out, a);
        };
        if count as u64 >= max {
            return refuse(self, out, "limit");
        }
        let protocol = info.protocol.number();
        let source = self.cfg.source.iter().find(|a| a.is_ipv4() == info.dst.is_ipv4()).copied();
        let local = match source {
            Some(ip) => match self.free_port(protocol, ip, info.dst) {
                Some(port) => SocketAddr::new(ip, port),
                None => return refuse(self, out, "limit"),
            },
            None => info.src,
        };
        let key = (protocol, info.dst, local);
        if self.f.time_wait.remove(&key).is_some() {
            self.m.time_wait_reused.add(1); // the app's own tuple again (terminate let its SYN take the tuple over)
        }
        if self.f.by_key.contains_key(&key) || local.is_ipv4() != info.dst.is_ipv4() {
            return refuse(self, out, "busy");
        }
        if !tcp {
            let mut mine = info;
            mine.src = local;
            self.insert(id, key, mine, None, out);
            if let Some(c) = self.f.conns.get_mut(&id) {
                c.deadline = Some(now + Duration::from_millis(self.cfg.udp_timeout_ms));
            }
            self.touch(id);
            return;
        }
        let mut sock = self.new_socket();
        let s = sock.socket();
        if s.connect(self.f.iface.context(), endpoint(info.dst), endpoint(local)).is_err() {
            self.put_back(sock);
            return refuse(self, out, "unreachable");
        }
        let t = Tcp::new(sock, Vec::new(), Observer::default(), (tcp::State::SynSent, now), self.cfg.cc);
        let mut mine = info;
        mine.src = local;
        self.insert(id, key, mine, Some(t), out);
        if let Some(c) = self.f.conns.get_mut(&id) {
            c.deadline = Some(now + Duration::from_millis(self.cfg.connect_timeout_ms));
        }
        self.touch(id);
    }

    /// A local port for a connection from `ip` to `far` that no flow of this endpoint uses.
    fn free_port(&mut self, protocol: u8, ip: IpAddr, far: SocketAddr) -> Option<u16> {
        let range = self.cfg.ports;
        let count = range.count();
        for _ in 0..count {
            let port = self.f.next_port as u16;
            self.f.next_port =
                if self.f.next_port >= u32::from(range.last) { u32::from(range.first) } else { self.f.next_port + 1 };
            let key = (protocol, far, SocketAddr::new(ip, port));
            if !self.f.by_key.contains_key(&key) && !self.f.time_wait.contains_key(&key) {
                return Some(port);
            }
        }
        None
    }

    // ---------------------------------------------------------------------------------------------------------
    // Service: move bytes between the sockets and the stream, send, and decide when to come back
    // ---------------------------------------------------------------------------------------------------------

    /// Emits the packets smoltcp wrote (observing them for flow `conn`).
    fn flush_tx(&mut self, conn: Option<u64>, now: Time, out: &mut Output<'_>) {
        if self.dev.tx.is_empty() {
            return;
        }
        let mut obs = conn.and_then(|id| self.f.conns.get_mut(&id)).and_then(|c| c.tcp.as_mut()).map(|t| &mut t.obs);
        let ip_dir = self.side.ip_dir();
        for mut p in self.dev.tx.drain(..) {
            if let (Some(o), Ok(info)) = (obs.as_deref_mut(), PacketInfo::parse(p.data())) {
                if let Some(s) = Segment::parse(p.data(), info.l4_offset, info.total_len) {
                    o.sent(&s, now);
                }
            }
            self.m.segments_out.add(1);
            p.set_direction(ip_dir);
            out.emit(self.ports.ip_out, p);
        }
    }

    fn service(&mut self, id: u64, out: &mut Output<'_>) {
        let now = out.now();
        let Some(c) = self.f.conns.get_mut(&id) else { return };
        c.touched = false;
        if self.publish_at(&self.f.conns[&id]).is_some_and(|t| t <= now) {
            self.publish_flow(id, out);
        }
        let c = self.f.conns.get_mut(&id).expect("present");
        if c.tcp.is_none() {
            if c.to_ack > 0 {
                let a = StreamFrame::ack(out.pool(), id, self.side.out_dir(), c.to_ack);
                c.to_ack = 0;
                self.emit_stream(out, a);
            }
            let c = self.f.conns.get_mut(&id).expect("present");
            if c.deadline.is_some_and(|d| d <= now) {
                let fin = StreamFrame::fin(out.pool(), id, self.side.out_dir());
                self.emit_stream(out, fin);
                return self.remove(id, out);
            }
            let d = soonest(c.deadline, self.publish_at(&self.f.conns[&id]));
            return self.schedule(id, d);
        }
        self.service_tcp(id, now, out);
    }

    fn service_tcp(&mut self, id: u64, now: Time, out: &mut Output<'_>) {
        let inst = instant(now);
        let (side, budget, chunk) = (self.side, self.cfg.budget, self.cfg.chunk as usize);
        let dir = side.out_dir();
        // Feed what arrived for it, watching the segments.
        {
            let c = self.f.conns.get_mut(&id).expect("present");
            let t = c.tcp.as_mut().expect("tcp");
            let mut payload = 0usize;
            for p in t.rx.drain(..) {
                if let Ok(info) = PacketInfo::parse(p.data()) {
                    if let Some(s) = Segment::parse(p.data(), info.l4_offset, info.total_len) {
                        t.obs.received(&s, now);
                        // Only a payload is written to a ring (a keep-alive or a bare ACK touches no buffer).
                        if s.len > 0 {
                            (t.resident, t.last_active) = (true, now);
                        }
                        payload += s.len as usize;
                    }
                }
                self.dev.rx.push_back(p);
            }
            // When to acknowledge (docs/streams.md, "ACKs"): a payload that came after a reply of ours is part of
            // an exchange, where our next reply can carry its ACK (the delay); anything else at once, and always
            // more than a full segment's payload (a super-packet, or several segments), as the kernel does.
            // smoltcp's delay ends early only on a second segment, and a super-packet is one segment to it; a
            // delay of zero also ends one that a smaller segment started.
            if payload > 0 {
                t.exchange = std::mem::take(&mut t.replied);
            }
            let full = (self.cfg.mtu as usize).saturating_sub(60);
            let delay = match ms(self.cfg.ack_delay_ms) {
                Some(d) if payload <= full && t.exchange => d,
                _ => SmolDuration::ZERO,
            };
            t.sockets.get_mut::<tcp::Socket>(t.handle).set_ack_delay(Some(delay));
        }
        for _round in 0..64 {
            {
                let c = self.f.conns.get_mut(&id).expect("present");
                let t = c.tcp.as_mut().expect("tcp");
                self.f.iface.poll(inst, &mut self.dev, &mut t.sockets);
            }
            self.flush_tx(Some(id), now, out);
            let pool = out.pool().clone();
            let c = self.f.conns.get_mut(&id).expect("present");
            let Conn { tcp: Some(t), credit, queue, queue_off, queued, to_ack, deadline, vars, info, key, .. } = c
            else {
                unreachable!("a TCP flow")
            };
            let sock = t.sockets.get_mut::<tcp::Socket>(t.handle);
            let state = sock.state();
            t.state = state;
            let mut progress = false;
            if !t.established && matches!(state, tcp::State::Established | tcp::State::CloseWait) {
                t.established = true;
                *deadline = None;
                if !listens(side, info.role) && !t.accepted {
                    t.accepted = true;
                    let mut info = info.clone();
                    info.src = key.2;
                    out.emit(self.ports.stream_out, StreamFrame::open(&pool, id, dir, &info));
                }
            }
            // Consumer: queued data into the socket's send buffer, acked once there.
            while let Some(front) = queue.front() {
                let n = match sock.send_slice(&front.data()[*queue_off..]) {
                    Ok(n) if n > 0 => n,
                    _ => break,
                };
                progress = true;
                t.replied = true;
                *queue_off += n;
                *to_ack += n as u64;
                *queued -= n as u64;
                self.f.buffered -= n as u64;
                if *queue_off == front.len() {
                    queue.pop_front();
                    *queue_off = 0;
                }
            }
            if queue.is_empty() && t.fin_in && !t.closed && !t.abort_in {
                sock.close();
                t.closed = true;
                progress = true;
            }
            // Producer: socket bytes into Data frames while the budget allows.
            while t.accepted && sock.can_recv() {
                let room = credit.room(budget).min(chunk as u64) as usize;
                if room == 0 {
                    break;
                }
                let p = StreamFrame::data_with(&pool, id, dir, |buf| {
                    let _ = sock.recv(|b| {
                        let n = b.len().min(room);
                        buf.extend_from_slice(&b[..n]);
                        (n, ())
                    });
                });
                if p.is_empty() {
                    break;
                }
                let n = p.len() as u64;
                credit.send(n);
                self.f.in_flight += n;
                self.m.bytes_out.add(n);
                vars.add(dir == Direction::Down, n);
                out.emit(self.ports.stream_out, p);
                progress = true;
            }
            if t.accepted && !t.fin_sent && peer_fin(state) && sock.recv_queue() == 0 {
                t.fin_sent = true;
                out.emit(self.ports.stream_out, StreamFrame::fin(&pool, id, dir));
            }
            if !progress {
                break;
            }
            (t.resident, t.last_active) = (true, now);
        }
        let c = self.f.conns.get_mut(&id).expect("present");
        if c.to_ack > 0 {
            self.m.bytes_in.add(c.to_ack);
            // It consumes the direction it does not produce.
            let n = c.to_ack;
            c.vars.add(dir != Direction::Down, n);
            let a = StreamFrame::ack(out.pool(), id, self.side.out_dir(), c.to_ack);
            c.to_ack = 0;
            out.emit(self.ports.stream_out, a);
        }
        self.finish_tcp(id, now, out);
    }

    /// After a service: the flow's meters, its end if its socket closed or its connect timed out, or its next
    /// wakeup.
    fn finish_tcp(&mut self, id: u64, now: Time, out: &mut Output<'_>) {
        let c = self.f.conns.get_mut(&id).expect("present");
        let t = c.tcp.as_mut().expect("tcp");
        let sock = t.sockets.get::<tcp::Socket>(t.handle);
        let state = sock.state();
        if let Some(m) = c.vars.tcp() {
            if t.shown != Some(state) {
                t.shown = Some(state);
                m[0].store(&Value::Str(state_name(state).into()));
            }
            m[1].set(t.obs.srtt_us);
            m[2].set(t.obs.in_flight());
            m[3].set(t.obs.retrans);
            m[4].set(sock.send_queue() as u64);
            m[5].set(sock.recv_queue() as u64);
            m[6].set(u64::from(t.obs.cwnd));
            m[7].set(t.obs.delivery_rate);
        }
        c.vars.set_in_flight(c.credit.in_flight());
        c.vars.set_queued(c.queued);
        // A listening socket that fell back to Listen (an RST during the handshake) is closed too.
        let gone = state == tcp::State::Closed || (state == tcp::State::Listen && t.obs.rst);
        let (quiet, rst, established, accepted) =
            (t.abort_in || (t.fin_sent && t.closed), t.obs.rst, t.established, t.accepted);
        let connecting_end = !listens(self.side, c.info.role);
        let expired = c.deadline.is_some_and(|d| d <= now);
        let deadline = c.deadline;
        let drained = c.credit.in_flight() == 0 && c.queue.is_empty();
        let mut next = self.f.iface.poll_at(instant(now), &t.sockets).map(time);
        // Idle: both rings empty and no out-of-order bytes held (they sit in the receive ring beyond its queue):
        // after `idle_discard_ms` the buffers' pages go back to the kernel (an empty ring's bytes are never read).
        let idle = self.cfg.idle_discard_ms;
        if t.resident && idle > 0 && sock.send_queue() == 0 && sock.recv_queue() == 0 && !t.obs.out_of_order() {
            let at = t.last_active + Duration::from_millis(idle);
            if at <= now {
                t.resident = false;
                if t.bufs.is_some_and(|(addr, len)| flexstack_sys::pages::discard(addr, len)) {
                    self.m.discarded.add(1);
                }
            } else {
                next = Some(next.map_or(at, |n| n.min(at)));
            }
        }
        let sock = t.sockets.get::<tcp::Socket>(t.handle);
        let more = accepted && sock.can_recv() && c.credit.room(self.cfg.budget) > 0;
        if more {
            next = Some(now); // bytes to read and credit to send them: at once (a service does a bounded amount)
        }
        self.publish_counts();
        if state == tcp::State::TimeWait && quiet && drained {
            return self.enter_time_wait(id, now, out);
        }
        if gone {
            if quiet {
                return self.remove(id, out);
            }
            let reason = match (rst, connecting_end, established) {
                (true, true, false) => "refused",
                (true, ..) => "reset",
                (false, ..) => {
                    self.m.timeouts.add(1);
                    "timeout"
                }
            };
            return self.abort_and_remove(id, reason, out);
        }
        if expired {
            // Not established in time: give up. The listening end drops a half-open connection without a word if
            // its SYN-ACK was never sent; otherwise the socket resets its peer.
            self.m.timeouts.add(1);
            if accepted || connecting_end {
                let c = self.f.conns.get_mut(&id).expect("present");
                let t = c.tcp.as_mut().expect("tcp");
                t.sockets.get_mut::<tcp::Socket>(t.handle).abort();
                self.f.iface.poll(instant(now), &mut self.dev, &mut t.sockets);
                self.flush_tx(Some(id), now, out);
            }
            return self.abort_and_remove(id, "timeout", out);
        }
        // Nothing more for smoltcp to do now means its next tick, not a spin at the same instant.
        let next = next.map(|n| if n < now || (n == now && !more) { now + Duration::from_millis(1) } else { n });
        let next = soonest(next, deadline);
        let next = soonest(next, self.publish_at(&self.f.conns[&id]));
        self.schedule(id, next);
    }

    fn apply_cc(&mut self, name: &str, value: &Value) -> Option<Result<(), String>> {
        let rest = name.strip_prefix(&self.cfg.vars_prefix)?.strip_prefix('.')?;
        let id: u64 = rest.strip_suffix(".tcp.cc")?.parse().ok()?;
        let Value::Str(text) = value else { return Some(Err(format!("{name} takes a string"))) };
        let cc = match Cc::parse(text) {
            Ok(cc) => cc,
            Err(e) => return Some(Err(e)),
        };
        let Some(t) = self.f.conns.get_mut(&id).and_then(|c| c.tcp.as_mut()) else {
            return Some(Err(format!("no TCP flow {id}")));
        };
        t.cc = cc;
        t.sockets.get_mut::<tcp::Socket>(t.handle).set_congestion_control(cc.smoltcp());
        Some(Ok(()))
    }

    fn run_touched(&mut self, out: &mut Output<'_>) {
        while let Some(id) = self.touched.pop() {
            self.service(id, out);
        }
        if let Some(&(t, _)) = self.f.timers.first() {
            out.wake_at(t);
        }
    }
}

impl Drop for Endpoint {
    /// An endpoint that held connections leaves their freed state in the allocator's arenas (resident, in pieces
    /// other allocations rarely fill): it goes back to the kernel when the endpoint goes (an app's chain unloaded).
    fn drop(&mut self) {
        // Its sockets go to the process's spare ones (their buffers are never freed: `buffers`).
        for sock in self.f.pool.drain(..) {
            buffers::give_spare(sock);
        }
        for (_, c) in self.f.conns.drain() {
            if let Some(t) = c.tcp {
                let Tcp { sockets, handle, bufs, .. } = *t;
                buffers::give_spare(Sock { sockets, handle, bufs });
            }
        }
        if self.m.tcp_total.get() + self.m.udp_total.get() > 0 {
            flexstack_sys::trim_heap();
        }
    }
}

impl Module for Endpoint {
    fn process(&mut self, port: usize, input: &mut Batch, out: &mut Output<'_>) {
        self.dev.pool = out.pool().clone();
        let ip = port == self.ports.ip_in;
        for frame in input.drain(..) {
            if ip {
                self.ip_in(frame, out);
            } else {
                self.stream_in(frame, out);
            }
        }
        self.run_touched(out);
    }

    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        self.dev.pool = out.pool().clone();
        let now = out.now();
        while let Some(&(t, id)) = self.f.timers.first() {
            if t > now {
                break;
            }
            self.f.timers.remove(&(t, id));
            if let Some(c) = self.f.conns.get_mut(&id) {
                c.timer = None;
            }
            self.touch(id);
        }
        self.run_touched(out);
        self.f.timers.first().map(|&(t, _)| t)
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        if let Some(r) = self.apply_cc(knob, value) {
            return r;
        }
        self.decl.write(&mut self.cfg, knob, value)
    }

    fn take_state(&mut self) -> Option<Box<dyn Any>> {
        let empty = Flows::new(self.side, interface(self.cfg.seed, &mut self.dev), self.f.next_port);
        Some(Box::new(std::mem::replace(&mut self.f, empty)))
    }

    /// Takes over the flows of the endpoint it replaces (same side): they keep their sockets (with the buffers they
    /// were made with) and meters; the new settings and knobs apply from now on (the match table to new flows).
    fn adopt_state(&mut self, state: Box<dyn Any>) -> Result<(), String> {
        let f = state.downcast::<Flows>().map_err(|_| "not an endpoint's flows".to_string())?;
        if f.side != self.side {
            return Err("the flows of a terminate cannot go to an originate, nor the reverse".into());
        }
        self.f = *f;
        for c in self.f.conns.values_mut() {
            c.touched = false;
        }
        self.publish_counts();
        // Every flow is serviced at the first poll (the switch polls a module once after it is loaded).
        let ids: Vec<u64> = self.f.conns.keys().copied().collect();
        for id in ids {
            self.schedule(id, Some(Time::ZERO));
        }
        Ok(())
    }
}
#[cfg(test)]
mod tests {
    use std::mem::size_of;

    /// The state of one TCP connection besides its socket's buffers and its meters (docs/streams.md, "Memory").
    #[test]
    fn a_connection_state_is_small() {
        let socket = size_of::<smoltcp::iface::SocketStorage>(); // the socket, in its set's vector
        let state = size_of::<super::Conn>() + size_of::<super::Tcp>() + size_of::<super::Key>() + 8;
        assert!(socket <= 640, "socket {socket}");
        assert!(state <= 720, "state {state}");
    }
}
