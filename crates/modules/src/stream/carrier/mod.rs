//! `carrier`: carries terminated flows to a flexstack peer (docs/peers.md). On the host of the app it stands where
//! `originate` would (`peer = NAME`): the Down frames of the flows whose destination is in `prefixes` go to the
//! peer, over one mutually authenticated TLS connection, and the peer's Up frames come back on `stream`; the
//! frames of other flows leave on `pass` unchanged (to an `originate`). On the peer (`listen = ADDR:PORT`) it
//! accepts the connections of known peers and puts their flows into its own chain (towards an `originate`), giving
//! them ids of its own.
//!
//! The connection is I/O at the edge, like the kernel back-end of the endpoints: the daemon installs the builder
//! (`flexstack_faces::peer`, through [`install`]); this crate holds the settings, meters, the peer protocol's
//! parser ([`wire`]) and the choice of flows ([`Router`]). Without the daemon's hook the kind is refused with a
//! message that says so.
//!
//! Ports: input `stream_in` (stream frames: Down on the app's host, Up on the peer); outputs `stream` (what the
//! connection brings: Up frames on the app's host, Down on the peer) and `pass` (frames of flows not carried).

pub mod dgram;
pub mod early;
pub mod order;
pub mod plus;
pub mod raw;
pub mod reliable;
pub mod wire;

use crate::stream::u64_meters;
use flexstack_core::config::SettingsReader;
use flexstack_core::module::port_type;
use flexstack_core::stream::{FlowInfo, StreamKind};
use flexstack_core::{
    field, kind_from_decl, ConfigError, KindDecl, Meter, ModuleBuilder, ModuleInterface, ModuleKind, Param, PortDecl,
    Settings, ValueType, VarSpec,
};
use flexstack_wire::cidr::Prefix;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The kind's name in stack files.
pub const KIND: &str = "carrier";

/// The kind's settings and knobs.
#[derive(Clone, Debug, Default)]
pub struct Config {
    /// Connect mode: the peer's name (in the daemon's peer table).
    pub peer: String,
    /// Accept mode: the address and port to accept peers on.
    pub listen: String,
    /// Connect mode: destinations whose flows are carried (empty: all).
    pub prefixes: Vec<Prefix>,
    /// Most flows carried at once (per connection on the accepting side).
    pub max_flows: u64,
    /// Milliseconds between attempts to reach the peer again after the connection failed.
    pub retry_ms: u64,
    /// Where each carried flow's meters go (`<vars_prefix>.<flow>`).
    pub vars_prefix: String,
    /// The transport to the peer: `tcp` (TLS over TCP) or `quic`.
    pub transport: Transport,
    /// `quic`: the connection's congestion control (`newreno`, `cubic`, `bbr`).
    pub cc: String,
    /// `udpplus`: UDP flows' lost datagrams are asked for again (NACKs) and resent.
    pub arq: bool,
    /// `udpplus`: a parity (XOR) after every `fec_k` datagrams of a UDP flow.
    pub fec: bool,
    /// `udpplus`: datagrams per FEC group.
    pub fec_k: u64,
    /// More transports to the same peer, besides `transport` (the first of every flow): kept warm once built, a
    /// flow moves between them when its `carrier` knob is written (docs/peers.md, "Switching").
    pub transports: Vec<Transport>,
    /// Connect mode: local addresses of the uplinks, in order of preference (empty: the kernel's routing picks);
    /// the carrier moves to the next usable one when the one in use goes down (docs/peers.md, "Several uplinks").
    pub uplinks: Vec<std::net::IpAddr>,
    /// Not a setting: added to the port of the peer (connecting) or of `listen` (accepting), so that the
    /// transports of a carrier with several have a port each ([`Transport::port_offset`]).
    pub port_offset: u16,
    /// Not a setting: accepting with several transports, the flow ids they share ([`FlowIds`]).
    pub ids: Option<FlowIds>,
    /// The raw stack ([`raw`]): which packets of `raw_in` go to the peer (connecting), whether raw packets are
    /// taken from peers (accepting).
    pub raw: raw::RawMode,
}

/// The flow ids of an accepting carrier with several transports: one numbering for all of them, and each flow
/// known by its peer and the peer's id, so that a flow that moves to another transport keeps its id.
#[derive(Clone, Debug, Default)]
pub struct FlowIds(Arc<Mutex<FlowIdsInner>>);

#[derive(Debug, Default)]
struct FlowIdsInner {
    last: u64,
    by_remote: HashMap<(String, u64), u64>,
}

impl FlowIds {
    fn lock(&self) -> std::sync::MutexGuard<'_, FlowIdsInner> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new id (from 1).
    pub fn next(&self) -> u64 {
        let mut i = self.lock();
        i.last += 1;
        i.last
    }

    /// Flow `id` is `peer`'s flow `remote`.
    pub fn register(&self, peer: &str, remote: u64, id: u64) {
        self.lock().by_remote.insert((peer.to_string(), remote), id);
    }

    /// The id of `peer`'s flow `remote`, if it is known.
    pub fn lookup(&self, peer: &str, remote: u64) -> Option<u64> {
        self.lock().by_remote.get(&(peer.to_string(), remote)).copied()
    }

    /// Forgets `peer`'s flow `remote` (it ended).
    pub fn forget(&self, peer: &str, remote: u64) {
        self.lock().by_remote.remove(&(peer.to_string(), remote));
    }
}

impl Config {
    /// Every transport the carrier offers: `transport` first, then `transports` (without repeats).
    pub fn offered(&self) -> Vec<Transport> {
        let mut v = vec![self.transport];
        for t in &self.transports {
            if !v.contains(t) {
                v.push(*t);
            }
        }
        v
    }

    /// True when the carrier has several transports (flows can switch).
    pub fn switching(&self) -> bool {
        self.offered().len() > 1
    }
}

/// A carrier's transport to its peer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Transport {
    /// One TLS 1.3 connection over TCP, every flow multiplexed on it.
    #[default]
    Tcp,
    /// One QUIC connection: a stream per TCP flow, DATAGRAM frames for UDP flows.
    Quic,
    /// Authenticated, encrypted UDP datagrams: a reliable stream ([`reliable`]) for the protocol's messages and
    /// TCP flows' bytes, one datagram per app datagram of UDP flows.
    Udp,
    /// `udp`, with UDP flows' datagrams numbered, NACKs and retransmission (`arq`) and XOR FEC (`fec`, `fec_k`).
    Udpplus,
}

impl Transport {
    /// Every transport, in the order of their port offsets.
    pub const ALL: [Transport; 4] = [Transport::Tcp, Transport::Quic, Transport::Udp, Transport::Udpplus];

    /// The transport named `t` (as in settings and `Hello`).
    pub fn parse(t: &str) -> Result<Transport, String> {
        Transport::ALL
            .into_iter()
            .find(|k| k.name() == t)
            .ok_or_else(|| format!("expected tcp, quic, udp or udpplus, got {t:?}"))
    }

    /// In a carrier with several transports, each listens on (and connects to) the port given plus this.
    pub fn port_offset(self) -> u16 {
        Transport::ALL.iter().position(|k| *k == self).unwrap_or(0) as u16
    }

    /// Its name in settings and in the peers' `Hello`.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Quic => "quic",
            Transport::Udp => "udp",
            Transport::Udpplus => "udpplus",
        }
    }
}

/// The congestion controls a `quic` carrier offers (quinn-proto's).
pub const QUIC_CCS: &[&str] = &["newreno", "cubic", "bbr"];

/// The meters.
#[derive(Default, Clone)]
pub struct Meters {
    /// Connections established (authenticated, hello exchanged).
    pub connections: Meter,
    /// Connections up now.
    pub connections_active: Meter,
    /// Connections refused: unknown or wrong fingerprint, failed TLS handshake, wrong version.
    pub refusals: Meter,
    /// Connections closed for input that is not the peer protocol (after authentication).
    pub malformed: Meter,
    /// Bytes written to the connection(s), framing included (before TLS).
    pub bytes_out: Meter,
    /// Bytes read from them.
    pub bytes_in: Meter,
    /// Messages written.
    pub frames_out: Meter,
    /// Messages read.
    pub frames_in: Meter,
    /// Flows carried since the start.
    pub flows: Meter,
    /// Flows carried now.
    pub flows_active: Meter,
    /// Flows passed (connect mode: destination not in `prefixes`).
    pub flows_passed: Meter,
    /// Flows refused at `max_flows` (`Abort(limit)`).
    pub flows_limited: Meter,
    /// Flows aborted because their connection went (`Abort(unreachable)`).
    pub flows_aborted: Meter,
    /// Smoothed round-trip time of the (latest) connection, from its TCP_INFO.
    pub rtt_us: Meter,
    /// Frames of flows the carrier does not know (dropped, counted).
    pub orphans: Meter,
    /// App datagrams that came before their flow's `Open`, held until it came.
    pub early_held: Meter,
    /// `quic`: the congestion window of the (latest) connection.
    pub cwnd: Meter,
    /// `quic`: packets the connection(s) declared lost.
    pub lost_packets: Meter,
    /// `quic`: UDP payload bytes sent and received (QUIC headers, encryption and retransmissions included).
    pub udp_bytes_out: Meter,
    /// See `udp_bytes_out`.
    pub udp_bytes_in: Meter,
    /// `quic`: UDP app datagrams not carried: larger than the path's DATAGRAM frames take, or refused by QUIC.
    pub datagrams_dropped: Meter,
    /// `udp`, `udpplus`: authentic datagrams that came again.
    pub replayed: Meter,
    /// `udp`, `udpplus`: segments (and `udpplus` datagrams) sent again.
    pub retransmits: Meter,
    /// `udpplus`: numbers asked for again.
    pub nacks: Meter,
    /// `udpplus`: datagrams rebuilt from a parity.
    pub fec_recovered: Meter,
    /// `udpplus`: datagrams given up.
    pub datagrams_lost: Meter,
    /// `udp`, `udpplus`: UDP payload bits sent per second.
    pub rate: Meter,
    /// Flows moved to another transport.
    pub switches: Meter,
    /// How long the latest switch waited for its transport to come up (0: it was warm).
    pub switch_wait_us: Meter,
    /// Frames held back to keep a flow's order across a switch.
    pub switch_held: Meter,
    /// Switches given up: the transport did not come up, or the peer does not offer it.
    pub switch_refused: Meter,
    /// `uplinks`: moves to another uplink (accepting: sessions or paths that moved to a new address).
    pub migrations: Meter,
    /// `uplinks`: the position of the uplink in use.
    pub uplink_active: Meter,
    /// `uplinks`: the latest move's time without delivery.
    pub migration_gap_us: Meter,
    /// Raw packets sent to the peer(s), and their bytes.
    pub raw_packets_out: Meter,
    /// See `raw_packets_out`.
    pub raw_bytes_out: Meter,
    /// Raw packets received from the peer(s), and their bytes.
    pub raw_packets_in: Meter,
    /// See `raw_packets_in`.
    pub raw_bytes_in: Meter,
    /// Packets of `raw_in` left on `raw_pass` (raw off, or a destination not carried).
    pub raw_passed: Meter,
    /// Raw packets dropped: the peer did not offer `raw`.
    pub raw_drop_refused: Meter,
    /// Raw packets dropped: no connection to the peer up.
    pub raw_drop_down: Meter,
    /// Raw packets from the peer dropped: not one whole IP packet.
    pub raw_drop_malformed: Meter,
    /// Packets to carry back dropped: no raw flow brought their destination (accepting), or the table is full.
    pub raw_drop_unknown: Meter,
}

type P = Param<Config>;

fn prefixes_text(c: &Config) -> String {
    c.prefixes.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(",")
}

fn parse_prefixes(c: &mut Config, t: &str) -> Result<(), String> {
    c.prefixes = t.split(',').map(str::trim).filter(|s| !s.is_empty()).map(Prefix::parse).collect::<Result<_, _>>()?;
    Ok(())
}

/// The items of a comma-separated setting (blanks ignored), each read by `item`.
fn comma_list<T>(t: &str, item: impl Fn(&str) -> Result<T, String>) -> Result<Vec<T>, String> {
    t.split(',').map(str::trim).filter(|s| !s.is_empty()).map(item).collect()
}

/// The kind: ports, settings, knobs and meters.
pub const DECL: KindDecl<Config, Meters> = KindDecl {
    inputs: &[
        PortDecl::new(
            "stream_in",
            port_type::STREAM,
            "stream frames to carry (Down on the app's host, Up on the peer)",
        ),
        PortDecl::new(
            "raw_in",
            port_type::IP,
            "with `raw` only: IP packets to carry as packets (the app's host: what `terminate` passes; the peer: the replies)",
        ),
        PortDecl::new(
            "demux",
            port_type::STREAM,
            "with `raw` only: link its own `stream` here; raw packets leave on `raw`, the other frames on `peer_stream`",
        ),
    ],
    outputs: &[
        PortDecl::new(
            "stream",
            port_type::STREAM,
            "stream frames the connection brings (Up on the app's host, Down on the peer)",
        ),
        PortDecl::new("pass", port_type::STREAM, "frames of flows it does not carry, unchanged"),
        PortDecl::new("raw", port_type::IP, "with `raw` only: IP packets that came from the peer (through `demux`)"),
        PortDecl::new("raw_pass", port_type::IP, "with `raw` only: packets of `raw_in` not carried, unchanged"),
        PortDecl::new("peer_stream", port_type::STREAM, "with `raw` only: the frames of `demux` that are not raw packets"),
    ],
    params: &[
        P::text(
            "peer",
            "connect mode: the peer's name in the daemon's peer table (`flexstack peer add`)",
            "",
            |c| c.peer.clone(),
            |c, t| {
                c.peer = t.to_string();
                Ok(())
            },
        )
        .setting(),
        P::text(
            "listen",
            "accept mode: the address and port peers connect to (`ADDR:PORT`)",
            "",
            |c| c.listen.clone(),
            |c, t| {
                if !t.is_empty() {
                    t.parse::<std::net::SocketAddr>().map_err(|e| format!("expected ADDR:PORT: {e}"))?;
                }
                c.listen = t.to_string();
                Ok(())
            },
        )
        .setting(),
        P::text(
            "prefixes",
            "connect mode: destinations whose flows are carried, comma-separated (empty: all)",
            "",
            prefixes_text,
            parse_prefixes,
        ),
        P::u64(
            "max_flows",
            "flows",
            "most flows carried at once (per connection when accepting)",
            4096,
            field!(max_flows),
        )
        .range(1.0, 1_000_000.0),
        P::u64(
            "retry_ms",
            "ms",
            "connect mode: wait before reaching the peer again after a failure",
            1000,
            field!(retry_ms),
        )
        .range(10.0, 600_000.0),
        P::text(
            "vars_prefix",
            "per-flow meters go under <vars_prefix>.<flow> (tuple, peer)",
            "flow.carrier",
            |c| c.vars_prefix.clone(),
            |c, t| {
                c.vars_prefix = t.to_string();
                Ok(())
            },
        )
        .setting(),
        P::text(
            "transport",
            "tcp (TLS 1.3 over one TCP connection), quic (one QUIC connection: a stream per TCP flow, DATAGRAM \
             frames for UDP flows), udp (authenticated encrypted datagrams, a reliable stream for TCP flows) or \
             udpplus (udp with numbered UDP datagrams, ARQ and FEC); both ends must say the same",
            "tcp",
            |c| c.transport.name().to_string(),
            |c, t| {
                c.transport = Transport::parse(t)?;
                Ok(())
            },
        )
        .setting(),
        P::text(
            "transports",
            "more transports to the same peer, comma-separated (tcp, quic, udp, udpplus): with any, each transport \
             has a port of its own (the port given plus 0 tcp, 1 quic, 2 udp, 3 udpplus), new flows start on \
             `transport`, and a flow's `carrier` knob moves it to another without a byte lost, duplicated or \
             reordered; both ends must say the same",
            "",
            |c| c.transports.iter().map(|t| t.name()).collect::<Vec<_>>().join(","),
            |c, t| {
                c.transports = comma_list(t, Transport::parse)?;
                Ok(())
            },
        )
        .setting(),
        P::text(
            "uplinks",
            "connect mode: local addresses of the uplinks, comma-separated, in order of preference: one socket \
             each (tcp: its connection from the one in use), and a move to the next usable one when the one in use \
             goes down (QUIC migration, udp re-binding, tcp's session resumed on a new connection); empty: one \
             socket, the kernel's routing picks",
            "",
            |c| c.uplinks.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(","),
            |c, t| {
                c.uplinks = comma_list(t, |a| a.parse().map_err(|e| format!("expected IP addresses: {a:?}: {e}")))?;
                Ok(())
            },
        )
        .setting(),
        P::text(
            "cc",
            "quic: congestion control of the connection (newreno, cubic, bbr; quinn-proto's)",
            "cubic",
            |c| c.cc.clone(),
            |c, t| {
                if !QUIC_CCS.contains(&t) {
                    return Err(format!("expected one of {}, got {t:?}", QUIC_CCS.join(", ")));
                }
                c.cc = t.to_string();
                Ok(())
            },
        )
        .setting(),
        P::bool(
            "arq",
            "udpplus: UDP flows' lost datagrams are asked for again (NACK) and resent by the sender (its knob governs)",
            true,
            field!(arq),
        ),
        P::bool(
            "fec",
            "udpplus: the sender adds the XOR of every fec_k datagrams of a UDP flow, which rebuilds one lost of them",
            false,
            field!(fec),
        ),
        P::u64("fec_k", "datagrams", "udpplus: datagrams per FEC group", 4, field!(fec_k)).range(2.0, 32.0),
        P::text(
            "raw",
            "the raw stack: none, or all-unterminated (connecting: the packets of `raw_in` to a destination in \
             `prefixes` go to the peer as packets, over its raw pseudo-flow; accepting: peers' raw packets are taken \
             and leave on `raw`); link `stream` to `demux` (docs/peers.md)",
            "none",
            |c| c.raw.name().to_string(),
            |c, t| {
                c.raw = raw::RawMode::parse(t)?;
                Ok(())
            },
        )
        .setting(),
    ],
    meters: u64_meters![
        connections: "connections_total", "connections", "connections established (authenticated, hello exchanged)";
        connections_active: "connections_active", "connections", "connections up now";
        refusals: "refusals_total", "connections", "connections refused: unknown fingerprint, failed handshake, wrong version";
        malformed: "malformed_total", "connections", "connections closed for input that is not the peer protocol; udp, udpplus: datagrams that do not decode or authenticate, dropped (the session stays)";
        bytes_out: "bytes_out_total", "bytes", "bytes written to the connection (framing included, before TLS)";
        bytes_in: "bytes_in_total", "bytes", "bytes read from the connection (framing included, after TLS)";
        frames_out: "messages_out_total", "messages", "messages written (stream frames, hello, close)";
        frames_in: "messages_in_total", "messages", "messages read";
        flows: "flows_total", "flows", "flows carried";
        flows_active: "flows_active", "flows", "flows carried now";
        flows_passed: "flows_passed_total", "flows", "flows passed on `pass` (destination not in `prefixes`)";
        flows_limited: "flows_limited_total", "flows", "flows refused at max_flows (Abort limit)";
        flows_aborted: "flows_aborted_total", "flows", "flows aborted because their connection went (Abort unreachable)";
        rtt_us: "rtt_us", "us", "smoothed round-trip time of the latest connection (TCP_INFO; quic: quinn-proto's; udp, udpplus: the reliable stream's)";
        orphans: "orphans_total", "frames", "frames of flows it does not know, dropped";
        early_held: "early_held_total", "datagrams", "udp, udpplus, quic: app datagrams that came before their flow's Open, held until it came (dropped as orphans when it does not come within 3 s)";
        cwnd: "cwnd_bytes", "bytes", "quic, udp, udpplus: congestion window of the latest connection";
        lost_packets: "lost_packets_total", "packets", "quic: packets declared lost; udp, udpplus: reliable-stream segments declared lost";
        udp_bytes_out: "udp_bytes_out_total", "bytes", "quic, udp, udpplus: UDP payload bytes sent (headers, encryption and retransmissions included)";
        udp_bytes_in: "udp_bytes_in_total", "bytes", "quic, udp, udpplus: UDP payload bytes received";
        datagrams_dropped: "datagrams_dropped_total", "datagrams", "quic: app UDP datagrams not carried (over the path's DATAGRAM size, or refused); udp, udpplus: larger than a datagram takes, or sent before the session was up";
        replayed: "replayed_total", "datagrams", "udp, udpplus: authentic datagrams that came again (replay window), dropped";
        retransmits: "retransmits_total", "packets", "udp, udpplus: reliable-stream segments sent again; udpplus: datagrams resent on a NACK";
        nacks: "nacks_total", "datagrams", "udpplus: datagrams asked for again (sent NACKs' numbers)";
        fec_recovered: "fec_recovered_total", "datagrams", "udpplus: UDP datagrams rebuilt from a parity";
        datagrams_lost: "datagrams_lost_total", "datagrams", "udpplus: UDP datagrams never received (missing when the window passed)";
        rate: "rate_out_bps", "bit/s", "udp, udpplus: UDP payload sent per second over the last meter period";
        switches: "switches_total", "flows", "flows moved to another transport (`transports`)";
        switch_wait_us: "switch_wait_us", "us", "how long the latest switch waited for its transport to come up (its handshake; 0 when warm)";
        switch_held: "switch_held_total", "frames", "frames held back to keep a flow's order across a switch";
        switch_refused: "switch_refused_total", "flows", "switches given up: the transport did not come up in 5 s";
        migrations: "migrations_total", "moves", "uplinks: moves to another uplink (accepting: sessions and paths that moved to a new address)";
        uplink_active: "uplink_active", "index", "uplinks: the position in `uplinks` of the uplink in use (0 the first)";
        migration_gap_us: "migration_gap_us", "us", "uplinks: the latest move's time without delivery (last datagram received before it to the first after)";
        raw_packets_out: "raw_packets_out_total", "packets", "raw: IP packets sent to the peer(s)";
        raw_bytes_out: "raw_bytes_out_total", "bytes", "raw: bytes of the IP packets sent to the peer(s)";
        raw_packets_in: "raw_packets_in_total", "packets", "raw: IP packets received from the peer(s)";
        raw_bytes_in: "raw_bytes_in_total", "bytes", "raw: bytes of the IP packets received from the peer(s)";
        raw_passed: "raw_passed_total", "packets", "raw: packets of raw_in left on raw_pass (raw none, or a destination not carried)";
        raw_drop_refused: "raw_drop_refused_total", "packets", "raw: packets dropped because the peer did not offer `raw`";
        raw_drop_down: "raw_drop_down_total", "packets", "raw: packets dropped because no connection to the peer was up";
        raw_drop_malformed: "raw_drop_malformed_total", "packets", "raw: packets from the peer dropped: not one whole IPv4 or IPv6 packet";
        raw_drop_unknown: "raw_drop_unknown_total", "packets", "raw: replies dropped: no raw flow brought their destination (accepting), or its table was full";
    ],
    // Its frames wait in its connection between calls, as an endpoint's do in its sockets.
    breaks_cycles: true,
    // One connection per peer, shared by its flows: the stack runs on one data-plane worker.
    global_view: true,
    ..KindDecl::new(KIND, "carries terminated flows to a flexstack peer over mutual TLS (docs/peers.md)")
};

/// The meters of one carried flow, under `<vars_prefix>.<flow>` (`flexstack flow list` shows them as `carried`).
pub fn flow_specs() -> Vec<VarSpec> {
    vec![
        VarSpec::meter(
            "tuple",
            ValueType::Str,
            "",
            "the flow: protocol, the app's address, the original destination, the app",
        ),
        VarSpec::meter("peer", ValueType::Str, "", "the peer it is carried to, or came from"),
        VarSpec::knob(
            "carrier",
            ValueType::Str,
            "",
            "the transport carrying the flow; writing another of the carrier's `transports` moves the flow there",
        ),
    ]
}

/// A carried flow's `tuple` meter: as `terminate` writes its flows' (`tcp 10.0.0.2:40000 -> 10.9.9.9:80 app
/// "curl"`), so that `flow list` pairs the two sides of a flow.
pub fn tuple(info: &FlowInfo) -> String {
    format!("{} {} -> {} app {:?}", info.protocol.name(), info.src, info.dst, info.app)
}

/// What the hook builds the carrier from.
pub struct CarrierRequest {
    /// The settings and knobs read.
    pub cfg: Config,
    /// The interface (ports, knobs, meters).
    pub interface: ModuleInterface,
    /// The declaration (publishing knobs, binding meters, writing knobs).
    pub decl: &'static KindDecl<Config, Meters>,
}

/// Builds a carrier's I/O; the error is a message about its settings.
pub type CarrierHook = fn(CarrierRequest) -> Result<Box<dyn ModuleBuilder>, String>;

static HOOK: OnceLock<CarrierHook> = OnceLock::new();

/// Installs the builder of the carrier's connection (the daemon does, once); later calls change nothing.
pub fn install(hook: CarrierHook) {
    let _ = HOOK.set(hook);
}

/// The `carrier` module kind.
pub struct CarrierKind;

impl ModuleKind for CarrierKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r: SettingsReader<'_> = settings.reader(KIND);
        let mut cfg = Config::default();
        DECL.read(&mut r, &mut cfg)?;
        if cfg.peer.is_empty() == cfg.listen.is_empty() {
            return Err(r.error("peer", "give exactly one of `peer` (connect) and `listen` (accept)"));
        }
        if cfg.raw != raw::RawMode::None && cfg.switching() {
            return Err(r.error("raw", "the raw stack with several `transports` is not done yet: give one transport"));
        }
        r.finish()?;
        let at = |m: String| {
            let key = if cfg.peer.is_empty() { "listen" } else { "peer" };
            ConfigError::new(
                settings.get(key).and_then(|s| s.location.clone()),
                format!("setting `{key}` of a carrier module: {m}"),
            )
        };
        let hook = HOOK.get().ok_or_else(|| {
            at("the carrier's connection is built by the daemon (flexstack-faces), not available here".into())
        })?;
        let mut interface = DECL.interface(&cfg);
        if cfg.raw == raw::RawMode::None {
            // The raw stack's ports only with it, so that a stack without it may link the carrier without naming them.
            interface.inputs.truncate(1);
            interface.outputs.truncate(2);
        }
        hook(CarrierRequest { cfg: cfg.clone(), interface, decl: &DECL }).map_err(at)
    }
}

/// Where a Down frame goes on the app's host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// To the peer.
    Carry,
    /// Out on `pass`, unchanged.
    Pass,
    /// Refused: answer `Abort(limit)` Up (an `Open` beyond `max_flows`).
    Limit,
}

/// The choice of flows on the app's host (sans-IO): which Down frames are carried and when a carried flow ends.
#[derive(Debug, Default)]
pub struct Router {
    /// Carried flows: whether Fin went down, and up.
    flows: HashMap<u64, (bool, bool)>,
    /// Flows forgotten since the module last looked (it removes their meters).
    pub gone: Vec<u64>,
}

impl Router {
    /// The route of a Down frame of `flow`: an `Open` chooses by `prefixes` and `max_flows`, the other frames
    /// follow their flow's (frames of flows never opened here pass: the contract's "pass what you do not know").
    pub fn down(&mut self, cfg: &Config, flow: u64, kind: Option<StreamKind>, bytes: &[u8]) -> Route {
        match kind {
            Some(StreamKind::Open) => {
                let carried = FlowInfo::decode(bytes)
                    .is_ok_and(|i| cfg.prefixes.is_empty() || cfg.prefixes.iter().any(|p| p.contains(i.dst.ip())));
                if !carried {
                    return Route::Pass;
                }
                if self.flows.len() as u64 >= cfg.max_flows {
                    return Route::Limit;
                }
                self.flows.insert(flow, (false, false));
                Route::Carry
            }
            _ if !self.flows.contains_key(&flow) => Route::Pass,
            Some(StreamKind::Abort) => {
                self.forget(flow);
                Route::Carry
            }
            Some(StreamKind::Fin) => {
                self.fin(flow, true);
                Route::Carry
            }
            _ => Route::Carry,
        }
    }

    /// An Up frame from the peer: forgets the flow on `Abort` or its second `Fin`. False if the flow is unknown.
    pub fn up(&mut self, flow: u64, kind: StreamKind) -> bool {
        if !self.flows.contains_key(&flow) {
            return false;
        }
        match kind {
            StreamKind::Abort => self.forget(flow),
            StreamKind::Fin => self.fin(flow, false),
            _ => {}
        }
        true
    }

    fn fin(&mut self, flow: u64, down: bool) {
        if let Some(f) = self.flows.get_mut(&flow) {
            if down {
                f.0 = true;
            } else {
                f.1 = true;
            }
            if f.0 && f.1 {
                self.forget(flow);
            }
        }
    }

    fn forget(&mut self, flow: u64) {
        if self.flows.remove(&flow).is_some() {
            self.gone.push(flow);
        }
    }

    /// Carries `flow` from now on, as if it had opened here (a flow that moved to this transport).
    pub fn attach(&mut self, flow: u64) {
        self.flows.entry(flow).or_insert((false, false));
    }

    /// Forgets `flow` without counting it as gone (it moved to another transport).
    pub fn detach(&mut self, flow: u64) {
        self.flows.remove(&flow);
    }

    /// Forgets every flow (the connection went) and returns their ids.
    pub fn drain(&mut self) -> Vec<u64> {
        let ids: Vec<u64> = self.flows.drain().map(|(id, _)| id).collect();
        self.gone.extend(&ids);
        ids
    }

    /// True while `flow` is carried (opened, not ended both ways or aborted).
    pub fn carries(&self, flow: u64) -> bool {
        self.flows.contains_key(&flow)
    }

    /// Flows carried now.
    pub fn len(&self) -> usize {
        self.flows.len()
    }

    /// True when no flow is carried.
    pub fn is_empty(&self) -> bool {
        self.flows.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flexstack_core::stream::Role;
    use flexstack_core::StackSpec;

    fn open(dst: &str) -> Vec<u8> {
        let info = FlowInfo::tcp("10.0.0.2:1000".parse().unwrap(), dst.parse().unwrap(), "a", Role::Client);
        let mut v = Vec::new();
        info.encode(&mut v);
        v
    }

    #[test]
    fn flows_are_chosen_by_prefix_and_limited() {
        let mut cfg = Config { max_flows: 2, ..Config::default() };
        parse_prefixes(&mut cfg, "10.9.0.0/16, fd00::/8").unwrap();
        let mut r = Router::default();
        assert_eq!(r.down(&cfg, 1, Some(StreamKind::Open), &open("10.9.9.9:80")), Route::Carry);
        assert_eq!(r.down(&cfg, 2, Some(StreamKind::Open), &open("10.8.9.9:80")), Route::Pass);
        assert_eq!(r.down(&cfg, 2, Some(StreamKind::Data), b"x"), Route::Pass, "follows its flow");
        assert_eq!(r.down(&cfg, 1, Some(StreamKind::Data), b"x"), Route::Carry);
        assert_eq!(r.down(&cfg, 3, Some(StreamKind::Open), &open("[fd00::1]:80")), Route::Carry);
        assert_eq!(r.down(&cfg, 4, Some(StreamKind::Open), &open("10.9.0.1:80")), Route::Limit);
        assert_eq!(r.len(), 2);
        // Both Fins end a flow, an Abort at once.
        r.down(&cfg, 1, Some(StreamKind::Fin), b"");
        assert!(r.up(1, StreamKind::Fin));
        assert!(!r.up(1, StreamKind::Data), "forgotten");
        assert!(r.up(3, StreamKind::Abort));
        assert!(r.is_empty());
        assert_eq!(r.gone, [1, 3], "the flows forgotten, for their meters");
    }

    /// Without the daemon's hook (this crate alone), the kind is refused where it is configured, saying why; a
    /// carrier with neither or both modes is refused too.
    #[test]
    fn needs_the_daemon_and_exactly_one_mode() {
        let configure = |body: &str| {
            let spec = StackSpec::parse("s.toml", &format!("[modules.c]\nkind = \"carrier\"\n{body}")).unwrap();
            match crate::catalog().configure(KIND, &spec.modules[0].settings, None) {
                Ok(_) => "ok".to_string(),
                Err(e) => e.to_string(),
            }
        };
        let e = configure("peer = \"b\"\n");
        assert!(e.starts_with("s.toml:3:8: setting `peer` of a carrier module: the carrier's connection"), "{e}");
        assert!(configure("").contains("exactly one"));
        assert!(configure("peer = \"b\"\nlisten = \"0.0.0.0:1\"\n").contains("exactly one"));
        assert!(configure("listen = \"nope\"\n").contains("ADDR:PORT"));
        assert!(configure("peer = \"b\"\nprefixes = \"10.0.0.0/33\"\n").contains("prefixes"));
    }
}
