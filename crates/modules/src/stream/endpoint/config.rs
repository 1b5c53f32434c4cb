//! The settings, knobs and meters `terminate` and `originate` share, declared once (each kind's `DECL` adds its
//! ports and its own settings with `endpoint_decl!`).

use flexstack_core::{Meter, MeterDecl, ValueType, VarSpec};
use flexstack_wire::cidr::PortRange;
use smoltcp::socket::tcp::CongestionControl;
use std::net::IpAddr;

/// A congestion controller of smoltcp 0.14 (`cc` knob): none, Reno or Cubic. (BBR is not offered by smoltcp.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cc {
    /// No congestion control: the peer's window only.
    None,
    /// Reno.
    Reno,
    /// Cubic (smoltcp's default when both are built).
    Cubic,
}

impl Cc {
    /// Parses `none`, `reno` or `cubic`.
    pub fn parse(text: &str) -> Result<Cc, String> {
        match text {
            "none" => Ok(Cc::None),
            "reno" => Ok(Cc::Reno),
            "cubic" => Ok(Cc::Cubic),
            other => Err(format!("expected none, reno or cubic, got {other:?}")),
        }
    }

    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            Cc::None => "none",
            Cc::Reno => "reno",
            Cc::Cubic => "cubic",
        }
    }

    /// smoltcp's value.
    pub fn smoltcp(self) -> CongestionControl {
        match self {
            Cc::None => CongestionControl::None,
            Cc::Reno => CongestionControl::Reno,
            Cc::Cubic => CongestionControl::Cubic,
        }
    }
}

/// The settings and knobs of an endpoint (both kinds; a kind reads only its own).
#[derive(Clone, Debug)]
pub struct Config {
    pub budget: u64,
    pub queue_limit: u64,
    pub chunk: u64,
    pub rx_buffer: u64,
    pub tx_buffer: u64,
    pub mtu: u64,
    pub max_connections: u64,
    pub max_udp_flows: u64,
    pub connect_timeout_ms: u64,
    pub udp_timeout_ms: u64,
    pub keepalive_ms: u64,
    pub timeout_ms: u64,
    pub cc: Cc,
    pub nagle: bool,
    pub vars_prefix: String,
    pub seed: u64,
    /// terminate: the app's name.
    pub app: String,
    /// originate: source addresses (at most one per family); empty: the app's original source.
    pub source: Vec<IpAddr>,
    /// originate: local ports for connections from `source`.
    pub ports: PortRange,
}

impl Config {
    /// Everything at zero; the declaration's defaults are read over it.
    pub fn blank() -> Config {
        Config {
            budget: 0,
            queue_limit: 0,
            chunk: 0,
            rx_buffer: 0,
            tx_buffer: 0,
            mtu: 0,
            max_connections: 0,
            max_udp_flows: 0,
            connect_timeout_ms: 0,
            udp_timeout_ms: 0,
            keepalive_ms: 0,
            timeout_ms: 0,
            cc: Cc::Cubic,
            nagle: false,
            vars_prefix: String::new(),
            seed: 0,
            app: String::new(),
            source: Vec::new(),
            ports: PortRange { first: 32768, last: 60999 },
        }
    }
}

/// Checks a `vars_prefix`: `flow` or `flow.NAME[.NAME]` (lowercase letters, digits, `_`, `-`).
pub fn check_prefix(text: &str) -> Result<String, String> {
    let segment_ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 64
            && s.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_' || c == b'-')
    };
    if text == "flow" || text.strip_prefix("flow.").is_some_and(|rest| rest.split('.').all(segment_ok)) {
        Ok(text.to_string())
    } else {
        Err(format!("expected flow or flow.NAME (lowercase letters, digits, _ and -), got {text:?}"))
    }
}

/// Parses `source`: addresses separated by commas, at most one IPv4 and one IPv6.
pub fn parse_sources(text: &str) -> Result<Vec<IpAddr>, String> {
    let mut out: Vec<IpAddr> = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let a: IpAddr = part.parse().map_err(|_| format!("`{part}` is not an IP address"))?;
        if out.iter().any(|b| b.is_ipv4() == a.is_ipv4()) {
            return Err(format!("more than one {} address", if a.is_ipv4() { "IPv4" } else { "IPv6" }));
        }
        out.push(a);
    }
    Ok(out)
}

/// The shared parameters, then `$extra` (each kind's own), and the shared meters: an endpoint kind's declaration.
/// The caller has `P` (`Param<Config>`) and `field!` in scope.
macro_rules! endpoint_decl {
    (
        $name:expr, $summary:expr, $prefix:expr,
        inputs: $inputs:expr, outputs: $outputs:expr, extra: [$($extra:expr),* $(,)?]
    ) => {
        flexstack_core::KindDecl {
            inputs: $inputs,
            outputs: $outputs,
            params: &[
                P::u64(
                    "budget",
                    "bytes",
                    "most bytes of a flow's data in flight in the stream chain (sent, not acked), per direction",
                    262_144,
                    field!(budget),
                ).range(1024.0, 1073741824.0),
                P::u64(
                    "queue_limit",
                    "bytes",
                    "most bytes queued for one flow's socket, else the flow is aborted (above the other end's budget)",
                    4_194_304,
                    field!(queue_limit),
                ).range(1024.0, 4294967296.0),
                P::u64("chunk", "bytes", "most bytes in one Data frame", 16_384, field!(chunk)).range(64.0, 65536.0),
                P::u64(
                    "rx_buffer",
                    "bytes",
                    "receive buffer of each TCP socket: its largest window",
                    65_536,
                    field!(rx_buffer),
                ).range(1024.0, 67108864.0).setting(),
                P::u64(
                    "tx_buffer",
                    "bytes",
                    "send buffer of each TCP socket",
                    65_536,
                    field!(tx_buffer),
                ).range(1024.0, 67108864.0).setting(),
                P::u64(
                    "mtu",
                    "bytes",
                    "largest IP packet it sends (the MSS follows)",
                    1500,
                    field!(mtu),
                ).range(1280.0, 65535.0).setting(),
                P::u64(
                    "max_connections",
                    "connections",
                    "most TCP connections at once; beyond, new ones are refused",
                    4096,
                    field!(max_connections),
                ).range(0.0, 1048576.0),
                P::u64(
                    "max_udp_flows",
                    "flows",
                    "most UDP flows at once; beyond, new ones are refused",
                    4096,
                    field!(max_udp_flows),
                ).range(0.0, 1048576.0),
                P::u64(
                    "connect_timeout_ms",
                    "ms",
                    "a TCP connection not established after this long is given up (`timeout`)",
                    30_000,
                    field!(connect_timeout_ms),
                ).range(1.0, 3600000.0),
                P::u64(
                    "udp_timeout_ms",
                    "ms",
                    "a UDP flow idle this long ends (`Fin`)",
                    30_000,
                    field!(udp_timeout_ms),
                ).range(1.0, 86400000.0),
                P::u64(
                    "keepalive_ms",
                    "ms",
                    "keep-alive interval of idle TCP connections; 0: none",
                    60_000,
                    field!(keepalive_ms),
                ).range(0.0, 86400000.0),
                P::u64(
                    "timeout_ms",
                    "ms",
                    "a TCP peer silent this long with data or keep-alives outstanding is given up; 0: never",
                    180_000,
                    field!(timeout_ms),
                ).range(0.0, 86400000.0),
                P::text(
                    "cc",
                    "congestion control of new TCP connections: none, reno or cubic (a flow's own: `tcp.cc`)",
                    "cubic",
                    |c| c.cc.name().into(),
                    |c,
                    t| $crate::stream::endpoint::config::Cc::parse(t).map(|v| c.cc = v),
                ),
                P::bool("nagle", "Nagle's algorithm on new TCP connections", false, field!(nagle)),
                P::text(
                    "vars_prefix",
                    "per-flow meters go under `<vars_prefix>.<flow>`",
                    $prefix,
                    |c| c.vars_prefix.clone(),
                    |c,
                    t| $crate::stream::endpoint::config::check_prefix(t).map(|v| c.vars_prefix = v),
                ).setting(),
                P::u64(
                    "seed",
                    "",
                    "seed of initial sequence numbers and local ports; 0: random, drawn when configured",
                    0,
                    field!(seed),
                ).setting(),
                $($extra),*
            ],
            meters: $crate::stream::endpoint::config::METERS,
            breaks_cycles: true,
            ..flexstack_core::KindDecl::new($name, $summary)
        }
    };
}
pub(crate) use endpoint_decl;

/// The module's meter handles.
#[derive(Default)]
pub struct Meters {
    pub tcp_active: Meter,
    pub tcp_total: Meter,
    pub udp_active: Meter,
    pub udp_total: Meter,
    pub refused: Meter,
    pub aborts_sent: Meter,
    pub aborts_received: Meter,
    pub timeouts: Meter,
    pub bytes_out: Meter,
    pub bytes_in: Meter,
    pub buffered: Meter,
    pub in_flight: Meter,
    pub passed: Meter,
    pub segments_in: Meter,
    pub segments_out: Meter,
    pub stream_bad: Meter,
    pub stream_orphans: Meter,
    pub udp_budget_drops: Meter,
    pub icmp_errors: Meter,
    pub overflows: Meter,
    pub not_packet: Meter,
    pub invalid_syns: Meter,
    pub bad_datagrams: Meter,
}

/// The meters both kinds declare.
pub const METERS: &[MeterDecl<Meters>] = &[
    MeterDecl::u64("connections_active", "connections", "TCP connections held", |m| &mut m.tcp_active),
    MeterDecl::u64("connections_total", "connections", "TCP connections started", |m| &mut m.tcp_total),
    MeterDecl::u64("udp_flows_active", "flows", "UDP flows held", |m| &mut m.udp_active),
    MeterDecl::u64("udp_flows_total", "flows", "UDP flows started", |m| &mut m.udp_total),
    MeterDecl::u64("refused_total", "flows", "new flows refused: a limit was reached", |m| &mut m.refused),
    MeterDecl::u64("aborts_sent_total", "flows", "flows this endpoint aborted (`Abort` sent)", |m| &mut m.aborts_sent),
    MeterDecl::u64("aborts_received_total", "flows", "flows aborted by the other endpoint", |m| &mut m.aborts_received),
    MeterDecl::u64("timeouts_total", "flows", "flows given up on a timeout", |m| &mut m.timeouts),
    MeterDecl::u64("data_bytes_out_total", "bytes", "stream bytes read from sockets and sent as `Data`", |m| {
        &mut m.bytes_out
    }),
    MeterDecl::u64("data_bytes_in_total", "bytes", "stream bytes received as `Data` and handed to sockets", |m| {
        &mut m.bytes_in
    }),
    MeterDecl::u64("buffered_bytes", "bytes", "`Data` bytes waiting for room in their sockets, all flows", |m| {
        &mut m.buffered
    }),
    MeterDecl::u64("in_flight_bytes", "bytes", "`Data` bytes sent and not yet acked, all flows", |m| &mut m.in_flight),
    MeterDecl::u64("passed_total", "frames", "packets not terminated, sent out `pass` unchanged", |m| &mut m.passed),
    MeterDecl::u64("segments_in_total", "frames", "TCP segments handed to the endpoint's sockets", |m| {
        &mut m.segments_in
    }),
    MeterDecl::u64("segments_out_total", "frames", "TCP segments the sockets sent", |m| &mut m.segments_out),
    MeterDecl::u64(
        "stream_bad_total",
        "frames",
        "stream frames it could not use (malformed, wrong way, bad ack)",
        |m| &mut m.stream_bad,
    ),
    MeterDecl::u64(
        "stream_orphans_total",
        "frames",
        "stream frames of flows it does not hold (ended, or never seen)",
        |m| &mut m.stream_orphans,
    ),
    MeterDecl::u64("udp_budget_drops_total", "frames", "datagrams dropped: their flow's budget was in flight", |m| {
        &mut m.udp_budget_drops
    }),
    MeterDecl::u64("icmp_errors_total", "frames", "ICMP errors about its connections that it acted on", |m| {
        &mut m.icmp_errors
    }),
    MeterDecl::u64("queue_overflows_total", "flows", "flows aborted: more queued than `queue_limit`", |m| {
        &mut m.overflows
    }),
    MeterDecl::u64("not_packet_total", "frames", "control frames that arrived on a data port (dropped)", |m| {
        &mut m.not_packet
    }),
    MeterDecl::u64(
        "invalid_syns_total",
        "frames",
        "SYNs its TCP did not take (bad checksum or options): no flow",
        |m| &mut m.invalid_syns,
    ),
    MeterDecl::u64(
        "bad_datagrams_total",
        "frames",
        "UDP datagrams of its flows with a bad length or checksum (dropped)",
        |m| &mut m.bad_datagrams,
    ),
];

/// The runtime variables of one TCP flow, under `<vars_prefix>.<flow>`.
pub fn tcp_flow_specs() -> Vec<VarSpec> {
    let mut v = flow_specs();
    v.extend([
        VarSpec::meter("tcp.state", ValueType::Str, "", "TCP state of the endpoint's socket (established ...)"),
        VarSpec::meter("tcp.srtt_us", ValueType::U64, "us", "smoothed round-trip time, from the segments seen"),
        VarSpec::meter("tcp.bytes_in_flight", ValueType::U64, "bytes", "sent and not acknowledged by the peer"),
        VarSpec::meter("tcp.retrans_total", ValueType::U64, "frames", "segments sent again"),
        VarSpec::meter("tcp.send_queue", ValueType::U64, "bytes", "bytes in the socket's send buffer"),
        VarSpec::meter("tcp.recv_queue", ValueType::U64, "bytes", "bytes in the socket's receive buffer"),
        VarSpec::knob("tcp.cc", ValueType::Str, "", "congestion control of this connection: none, reno or cubic"),
    ]);
    v
}

/// The runtime variables of one flow (UDP; TCP adds its own).
pub fn flow_specs() -> Vec<VarSpec> {
    vec![
        VarSpec::meter("tuple", ValueType::Str, "", "protocol, the app's side and the original destination, app"),
        VarSpec::meter("bytes_down_total", ValueType::U64, "bytes", "stream bytes travelling down (from the app)"),
        VarSpec::meter("bytes_up_total", ValueType::U64, "bytes", "stream bytes travelling up (to the app)"),
        VarSpec::meter("in_flight_bytes", ValueType::U64, "bytes", "`Data` bytes this endpoint sent, not yet acked"),
        VarSpec::meter("queued_bytes", ValueType::U64, "bytes", "`Data` bytes waiting for room in the socket"),
    ]
}
