//! The settings, knobs and meters `terminate` and `originate` share, declared once (each kind's `DECL` adds its
//! ports and its own settings with `endpoint_decl!`).

use crate::stream::u64_meters;
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
    pub udp_budget: u64,
    pub queue_limit: u64,
    pub chunk: u64,
    pub rx_buffer: u64,
    pub tx_buffer: u64,
    pub mtu: u64,
    pub max_connections: u64,
    pub max_udp_flows: u64,
    pub max_half_open: u64,
    pub socket_pool: u64,
    pub idle_discard_ms: u64,
    pub meters_after_ms: u64,
    pub connect_timeout_ms: u64,
    pub udp_timeout_ms: u64,
    pub keepalive_ms: u64,
    pub ack_delay_ms: u64,
    pub timeout_ms: u64,
    pub cc: Cc,
    pub nagle: bool,
    pub gso: bool,
    pub vars_prefix: String,
    pub seed: u64,
    /// The app's name.
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
            udp_budget: 0,
            queue_limit: 0,
            chunk: 0,
            rx_buffer: 0,
            tx_buffer: 0,
            mtu: 0,
            max_connections: 0,
            max_udp_flows: 0,
            max_half_open: 0,
            socket_pool: 0,
            idle_discard_ms: 0,
            meters_after_ms: 0,
            connect_timeout_ms: 0,
            udp_timeout_ms: 0,
            keepalive_ms: 0,
            ack_delay_ms: 0,
            timeout_ms: 0,
            cc: Cc::Cubic,
            nagle: false,
            gso: true,
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

/// The shared parameters (`$backend` describes the back-end setting), then `$extra` (each kind's own), and the shared
/// meters: an endpoint kind's declaration.
/// The caller has `P` (`Param<Config>`) in scope.
macro_rules! endpoint_decl {
    (
        $name:expr, $summary:expr, $prefix:expr, $backend:expr,
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
                    flexstack_core::field!(budget),
                ).range(1024.0, 1073741824.0),
                P::u64(
                    "udp_budget",
                    "bytes",
                    "most bytes of a UDP flow's datagrams in flight in the stream chain; beyond, a datagram is dropped",
                    1_048_576,
                    flexstack_core::field!(udp_budget),
                ).range(1024.0, 1073741824.0),
                P::u64(
                    "queue_limit",
                    "bytes",
                    "most bytes queued for one flow's socket, else the flow is aborted (above the other end's budget)",
                    4_194_304,
                    flexstack_core::field!(queue_limit),
                ).range(1024.0, 4294967296.0),
                P::u64("chunk", "bytes", "most bytes in one Data frame", 16_384, flexstack_core::field!(chunk)).range(64.0, 65536.0),
                P::u64(
                    "rx_buffer",
                    "bytes",
                    "receive buffer of each TCP socket: its largest window",
                    65_536,
                    flexstack_core::field!(rx_buffer),
                ).range(1024.0, 67108864.0).setting(),
                P::u64(
                    "tx_buffer",
                    "bytes",
                    "send buffer of each TCP socket",
                    65_536,
                    flexstack_core::field!(tx_buffer),
                ).range(1024.0, 67108864.0).setting(),
                P::u64(
                    "mtu",
                    "bytes",
                    "largest IP packet it sends (the MSS follows)",
                    1500,
                    flexstack_core::field!(mtu),
                ).range(1280.0, 65535.0).setting(),
                P::u64(
                    "max_connections",
                    "connections",
                    "most TCP connections at once; beyond, new ones are refused",
                    4096,
                    flexstack_core::field!(max_connections),
                ).range(0.0, 1048576.0),
                P::u64(
                    "max_udp_flows",
                    "flows",
                    "most UDP flows at once; beyond, new ones are refused",
                    4096,
                    flexstack_core::field!(max_udp_flows),
                ).range(0.0, 1048576.0),
                P::u64(
                    "max_half_open",
                    "connections",
                    "most TCP connections whose app has not finished its handshake; a new SYN beyond gives up the \
                     oldest of them (a SYN flood cannot fill max_connections)",
                    1024,
                    flexstack_core::field!(max_half_open),
                ).range(1.0, 1048576.0),
                P::u64(
                    "socket_pool",
                    "sockets",
                    "TCP sockets kept, with their buffers, after their connections end, for new ones: no buffer is \
                     allocated and zeroed per connection while it holds enough",
                    32,
                    flexstack_core::field!(socket_pool),
                ).range(0.0, 65536.0),
                P::u64(
                    "idle_discard_ms",
                    "ms",
                    "a TCP connection with nothing queued either way this long gives its buffers' pages back to the \
                     kernel (they cost memory again when bytes come); 0: never",
                    1000,
                    flexstack_core::field!(idle_discard_ms),
                ).range(0.0, 86400000.0),
                P::u64(
                    "meters_after_ms",
                    "ms",
                    "a flow's meters (`<vars_prefix>.<flow>`) are published once it has lived this long: a shorter \
                     connection costs no registration; 0: at once",
                    20,
                    flexstack_core::field!(meters_after_ms),
                ).range(0.0, 3600000.0),
                P::u64(
                    "connect_timeout_ms",
                    "ms",
                    "a TCP connection not established after this long is given up (`timeout`)",
                    30_000,
                    flexstack_core::field!(connect_timeout_ms),
                ).range(1.0, 3600000.0),
                P::u64(
                    "udp_timeout_ms",
                    "ms",
                    "a UDP flow idle this long ends (`Fin`)",
                    30_000,
                    flexstack_core::field!(udp_timeout_ms),
                ).range(1.0, 86400000.0),
                P::u64(
                    "keepalive_ms",
                    "ms",
                    "keep-alive interval of idle TCP connections; 0: none",
                    60_000,
                    flexstack_core::field!(keepalive_ms),
                ).range(0.0, 86400000.0),
                P::u64(
                    "ack_delay_ms",
                    "ms",
                    "how long the ACK of a TCP segment may wait for a reply to carry it, in an exchange (a segment that \
                     came after a reply); other segments, and more than a full segment at once, are acknowledged at \
                     once; 0: every segment at once",
                    10,
                    flexstack_core::field!(ack_delay_ms),
                ).range(0.0, 500.0),
                P::u64(
                    "timeout_ms",
                    "ms",
                    "a TCP peer silent this long with data or keep-alives outstanding is given up; 0: never",
                    180_000,
                    flexstack_core::field!(timeout_ms),
                ).range(0.0, 86400000.0),
                P::text(
                    "cc",
                    "congestion control of new TCP connections: none, reno or cubic (a flow's own: `tcp.cc`)",
                    "cubic",
                    |c| c.cc.name().into(),
                    |c,
                    t| $crate::stream::endpoint::config::Cc::parse(t).map(|v| c.cc = v),
                ),
                P::bool("nagle", "Nagle's algorithm on new TCP connections", false, flexstack_core::field!(nagle)),
                P::bool(
                    "gso",
                    "TCP over IPv4: send segments of up to 64 KiB as GSO super-packets, cut at the MSS by the switch or \
                     the kernel (segments come in whole either way)",
                    true,
                    flexstack_core::field!(gso),
                ).setting(),
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
                    flexstack_core::field!(seed),
                ).setting(),
                // Read by `stream::backend::configure`, which builds the back-end (`kernel` through the daemon's hook).
                P::manual("backend", "str", $backend, "\"smoltcp\""),
                $($extra),*
            ],
            meters: $crate::stream::endpoint::config::METERS,
            breaks_cycles: true,
            // TCP super-packets go to smoltcp whole, UDP ones are cut into datagrams, the rest pass whole.
            accepts_gso: true,
            // Both ends of a terminated flow (two tuples) and its sockets: the stack runs on one worker.
            global_view: true,
            ..flexstack_core::KindDecl::new($name, $summary)
        }
    };
}
pub(crate) use endpoint_decl;

/// The `app` setting both kinds have: the app's name, in the `Open` frames of the flows they start and for `app`
/// rules.
pub const APP: flexstack_core::Param<Config> = flexstack_core::Param::<Config>::text(
    "app",
    "the app's name: in `Open` frames and for `app` rules",
    "",
    |c| c.app.clone(),
    |c, t| {
        c.app = t.into();
        Ok(())
    },
)
.setting();

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
    pub udp_socket_drops: Meter,
    pub icmp_errors: Meter,
    pub overflows: Meter,
    pub not_packet: Meter,
    pub invalid_syns: Meter,
    pub bad_checksums: Meter,
    pub bad_datagrams: Meter,
    pub time_wait_reused: Meter,
    pub half_open_evicted: Meter,
    pub pooled: Meter,
    pub discarded: Meter,
}

/// The meters both kinds declare.
pub const METERS: &[MeterDecl<Meters>] = u64_meters![
    tcp_active: "connections_active", "connections", "TCP connections held";
    tcp_total: "connections_total", "connections", "TCP connections started";
    udp_active: "udp_flows_active", "flows", "UDP flows held";
    udp_total: "udp_flows_total", "flows", "UDP flows started";
    refused: "refused_total", "flows", "new flows refused: a limit was reached";
    aborts_sent: "aborts_sent_total", "flows", "flows this endpoint aborted (`Abort` sent)";
    aborts_received: "aborts_received_total", "flows", "flows aborted by the other endpoint";
    timeouts: "timeouts_total", "flows", "flows given up on a timeout";
    bytes_out: "data_bytes_out_total", "bytes", "stream bytes read from sockets and sent as `Data`";
    bytes_in: "data_bytes_in_total", "bytes", "stream bytes received as `Data` and handed to sockets";
    buffered: "buffered_bytes", "bytes", "`Data` bytes waiting for room in their sockets, all flows";
    in_flight: "in_flight_bytes", "bytes", "`Data` bytes sent and not yet acked, all flows";
    passed: "passed_total", "frames", "packets not terminated, sent out `pass` unchanged";
    segments_in: "segments_in_total", "frames", "TCP segments handed to the endpoint's sockets";
    segments_out: "segments_out_total", "frames", "TCP segments the sockets sent";
    stream_bad: "stream_bad_total", "frames", "stream frames it could not use (malformed, wrong way, bad ack)";
    stream_orphans: "stream_orphans_total", "frames", "stream frames of flows it does not hold (ended, or never seen)";
    udp_budget_drops: "udp_budget_drops_total", "frames", "datagrams dropped: their flow's budget was in flight";
    udp_socket_drops: "udp_socket_drops_total", "frames",
        "datagrams the kernel dropped at a full receive buffer of a flow's UDP socket (kernel back-end)";
    icmp_errors: "icmp_errors_total", "frames", "ICMP errors about its connections that it acted on";
    overflows: "queue_overflows_total", "flows", "flows aborted: more queued than `queue_limit`";
    not_packet: "not_packet_total", "frames", "control frames that arrived on a data port (dropped)";
    invalid_syns: "invalid_syns_total", "frames", "SYNs its TCP did not take (bad checksum or options): no flow";
    bad_checksums: "bad_checksums_total", "frames", "TCP segments of its connections with a bad checksum (dropped)";
    bad_datagrams: "bad_datagrams_total", "frames",
        "UDP datagrams of its flows with a bad length or checksum (dropped)";
    time_wait_reused: "time_wait_reused_total", "connections",
        "connections in TIME-WAIT ended early by a new SYN on their tuple";
    half_open_evicted: "half_open_evicted_total", "connections",
        "connections given up before the app finished its handshake: max_half_open were waiting";
    pooled: "sockets_pooled", "sockets", "TCP sockets kept for new connections (`socket_pool`)";
    discarded: "buffers_discarded_total", "connections",
        "times an idle connection's buffers gave their pages back to the kernel (`idle_discard_ms`)";
];

/// A runtime variable of a flow: name, type, unit, description.
type FlowVar = (&'static str, ValueType, &'static str, &'static str);

/// The runtime meters of every flow, under `<vars_prefix>.<flow>`.
const FLOW_METERS: [FlowVar; 5] = [
    ("tuple", ValueType::Str, "", "protocol, the app's side and the original destination, app"),
    ("bytes_down_total", ValueType::U64, "bytes", "stream bytes travelling down (from the app)"),
    ("bytes_up_total", ValueType::U64, "bytes", "stream bytes travelling up (to the app)"),
    ("in_flight_bytes", ValueType::U64, "bytes", "`Data` bytes this endpoint sent, not yet acked"),
    ("queued_bytes", ValueType::U64, "bytes", "`Data` bytes waiting for room in the socket"),
];

/// The transport meters a TCP flow adds, in the order the endpoint updates them.
pub const TCP_METERS: [FlowVar; 8] = [
    ("tcp.state", ValueType::Str, "", "TCP state of the endpoint's socket (established ...)"),
    ("tcp.srtt_us", ValueType::U64, "us", "smoothed round-trip time, from the segments seen"),
    ("tcp.bytes_in_flight", ValueType::U64, "bytes", "sent and not acknowledged by the peer"),
    ("tcp.retrans_total", ValueType::U64, "frames", "segments sent again"),
    ("tcp.send_queue", ValueType::U64, "bytes", "bytes in the socket's send buffer"),
    ("tcp.recv_queue", ValueType::U64, "bytes", "bytes in the socket's receive buffer"),
    ("tcp.cwnd", ValueType::U64, "bytes", "congestion window as seen: the most bytes in flight in the last round trip"),
    ("tcp.delivery_rate", ValueType::U64, "bytes/s", "bytes acknowledged per second over the last round trip"),
];

fn meter_specs(vars: &[FlowVar]) -> impl Iterator<Item = VarSpec> + '_ {
    vars.iter().map(|&(name, ty, unit, what)| VarSpec::meter(name, ty, unit, what))
}

/// The runtime variables of one TCP flow, under `<vars_prefix>.<flow>`.
pub fn tcp_flow_specs() -> Vec<VarSpec> {
    let mut v = flow_specs();
    v.extend(meter_specs(&TCP_METERS));
    v.push(VarSpec::knob("tcp.cc", ValueType::Str, "", "congestion control of this connection: none, reno or cubic"));
    v
}

/// The runtime variables of one flow (UDP; TCP adds its own).
pub fn flow_specs() -> Vec<VarSpec> {
    meter_specs(&FLOW_METERS).collect()
}
