//! `terminate` (back-end `smoltcp`): ends the app's TCP connections and UDP flows in user space and turns each into
//! a stream (docs/streams.md); everything else passes unchanged.
//!
//! - Ports: input `in` (ip: packets from the app, travelling down) and `stream_in` (stream: frames travelling up,
//!   from `originate`); outputs `out` (ip: packets to the app, up), `stream` (stream: frames travelling down) and
//!   `pass` (ip: the packets of flows it does not terminate, unchanged, partial checksums included).
//! - Which flows: the `match` table (`flexstack_modules::stream::matcher`), first match wins, e.g.
//!   `match = ["pass tcp dport 22", "tcp dport 80,443", "udp dport 53", "tcp *"]`; by default `["tcp *"]`. Its rules
//!   are about the flows the app opens (the client role: its SYNs and first datagrams arrive on `in`); `role server`
//!   rules are `originate`'s. TCP packets of connections it did not see start (opened before it was added) pass.
//! - The server role: `Open` coming up for a flow `originate` accepted from the network (role server) makes a
//!   socket that connects to the app (from the network client's own address and port); when the app accepted,
//!   `Open` goes down (the client's SYN-ACK is released there); a refusal (the app's RST) goes down as
//!   `Abort(refused)`. UDP: the datagrams coming up are sent to the app from the client's address.
//! - TCP: a selected SYN gets a smoltcp socket listening in any-IP mode on that exact destination, so it accepts for
//!   the original destination; the SYN-ACK is held until `originate` says the far side accepted (`Open` up), so a
//!   refused destination reaches the app as RST, an unreachable one as ICMP host unreachable, and a timeout as no
//!   answer. Then the app's bytes go down as `Data` while the flow's credit allows (`budget`), its FIN as `Fin`, its
//!   RST as `Abort(reset)`; bytes coming up are written into the socket as its send buffer allows and acked, `Fin`
//!   closes its send side, `Abort` resets it. SYNs beyond `max_connections` are answered with RST.
//! - UDP: a selected first datagram opens a flow (`Open`, then one `Data` per datagram); datagrams coming up are
//!   sent to the app from the original destination; `udp_timeout_ms` of silence ends the flow (`Fin`);
//!   `Abort(unreachable)` becomes ICMP port unreachable to the app.
//! - Per-flow meters under `<vars_prefix>.<flow>` (`flow.terminate` by default): `tuple`, `bytes_down_total`,
//!   `bytes_up_total`, `in_flight_bytes`, `queued_bytes`, and for TCP `tcp.state`, `tcp.srtt_us`,
//!   `tcp.bytes_in_flight`, `tcp.retrans_total`, `tcp.send_queue`, `tcp.recv_queue`, `tcp.cwnd` (observed: the most
//!   bytes in flight in the last round trip), `tcp.delivery_rate` (bytes/s acked in the last round trip) and the
//!   knob `tcp.cc`.
//!
//! Its ports, settings, knobs and meters are declared once, in `DECL` below; docs/modules.md lists them.

use crate::stream::backend;
use crate::stream::endpoint::config::{endpoint_decl, Config, Meters, APP};
use crate::stream::endpoint::{Ports, Side};
use crate::stream::matcher::MatchTable;
use flexstack_core::module::port_type;
use flexstack_core::{kind_from_decl, ConfigError, KindDecl, ModuleBuilder, ModuleKind, Param, PortDecl, Settings};

/// The kind's name in stack files.
pub const KIND: &str = "terminate";

/// Its ports.
pub const PORTS: Ports = Ports { ip_in: 0, stream_in: 1, ip_out: 0, stream_out: 1, pass: 2 };

/// The `terminate` module kind.
pub struct TerminateKind;

type P = Param<Config>;

/// The kind: ports, settings, knobs and meters.
const DECL: KindDecl<Config, Meters> = endpoint_decl!(
    KIND,
    "ends the app's TCP and UDP flows chosen by a match table (smoltcp) and turns them into streams",
    "flow.terminate",
    "how flows are terminated: smoltcp (user-space TCP in the data plane) or kernel (the host's TCP; docs/streams.md)",
    inputs: &[
        PortDecl::new("in", port_type::IP, "packets from the app (down)"),
        PortDecl::new("stream_in", port_type::STREAM, "stream frames travelling up, from `originate`"),
    ],
    outputs: &[
        PortDecl::new("out", port_type::IP, "packets to the app (up)"),
        PortDecl::new("stream", port_type::STREAM, "stream frames travelling down"),
        PortDecl::new("pass", port_type::IP, "packets of flows it does not terminate, unchanged"),
    ],
    extra: [
        P::manual(
            "netns",
            "str",
            "kernel back-end: the app's network namespace (under /run/netns), where its TCP is redirected to a listener",
            "none",
        ),
        P::manual(
            "match",
            "array of strings",
            "the flows it terminates, first match wins (`tcp dport 80,443`, `pass tcp dport 22`, `udp *`)",
            "[\"tcp *\"]",
        ),
        APP,
    ]
);

impl ModuleKind for TerminateKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        backend::configure(settings, KIND, &DECL, (Side::App, PORTS), |r| {
            let rules = r.strings("match")?.unwrap_or_else(|| vec!["tcp *".into()]);
            MatchTable::parse(&rules).map_err(|e| r.error("match", e))
        })
    }
}
