//! `originate` (back-end `smoltcp`): opens again, towards the original destination, the flows `terminate` ended,
//! and relays their streams (docs/streams.md).
//!
//! - Ports: input `stream_in` (stream: frames travelling down, from `terminate`) and `in` (ip: packets from the
//!   network, travelling up); outputs `stream` (stream: frames travelling up), `out` (ip: packets to the network,
//!   down) and `pass` (ip: packets from the network that belong to none of its flows, unchanged).
//! - TCP: on `Open` a smoltcp socket connects to the original destination, from the `source` address of that
//!   family if set (with a local port from `ports`), else from the app's original source address and port; when it
//!   is established `Open` goes up. A refusal (RST) becomes `Abort(refused)`, an ICMP destination unreachable
//!   `Abort(unreachable)`, no answer within `connect_timeout_ms` `Abort(timeout)`; later, an RST is
//!   `Abort(reset)`. The server's bytes go up as `Data` while the flow's credit allows (`budget`), its FIN as
//!   `Fin`; bytes coming down are written as the socket's send buffer allows and acked; `Fin` closes the socket's
//!   send side, `Abort` resets it. Opens beyond `max_connections` are answered with `Abort(limit)`.
//! - The server role: a SYN (or a first datagram) from the network that its `match` table selects with a `role
//!   server` rule (`tcp dport 8080 role server`; rules without `role` are the client role's, which `terminate`
//!   applies) is accepted here, as `terminate` accepts the app's: a socket listens on that exact destination (the
//!   app's address and port, any-IP), holds its SYN-ACK and sends `Open` up (role server); `terminate` connects to
//!   the app and answers with `Open` down when the app accepted, which releases the SYN-ACK. A refusal comes back
//!   as `Abort(refused)` and the client gets RST. These flows' ids are its own, from [`SERVER_IDS`] + 1.
//! - UDP: on `Open` a per-flow state (no socket: the datagrams are written directly); each `Data` is one
//!   datagram to the destination, each datagram from it one `Data` up; `udp_timeout_ms` of silence ends the flow
//!   (`Fin`); an ICMP port unreachable ends it with `Abort(unreachable)`.
//! - The packets it sends are ordinary IP packets on `out`, so they can leave through a link face, the late-binding
//!   scheduler, an emulator or a tap.
//! - Per-flow meters under `<vars_prefix>.<flow>` (`flow.originate` by default; the flow ids are `terminate`'s):
//!   as `terminate`'s.
//!
//! Its ports, settings, knobs and meters are declared once, in `DECL` below; docs/modules.md lists them.

use crate::stream::backend;
use crate::stream::endpoint::config::{endpoint_decl, parse_sources, Config, Meters, APP};
use crate::stream::endpoint::{Ports, Side};
use crate::stream::matcher::MatchTable;
use flexstack_core::module::port_type;
use flexstack_core::{kind_from_decl, ConfigError, KindDecl, ModuleBuilder, ModuleKind, Param, PortDecl, Settings};
use flexstack_wire::cidr::PortRange;

/// The kind's name in stack files.
pub const KIND: &str = "originate";

pub use crate::stream::endpoint::SERVER_IDS;

/// Its ports.
pub const PORTS: Ports = Ports { stream_in: 0, ip_in: 1, stream_out: 0, ip_out: 1, pass: 2 };

/// The `originate` module kind.
pub struct OriginateKind;

type P = Param<Config>;

/// The kind: ports, settings, knobs and meters.
const DECL: KindDecl<Config, Meters> = endpoint_decl!(
    KIND,
    "opens terminated flows again towards their original destination (smoltcp) and relays their streams",
    "flow.originate",
    "how flows are opened: smoltcp (user-space TCP in the data plane) or kernel (kernel sockets; docs/streams.md)",
    inputs: &[
        PortDecl::new("stream_in", port_type::STREAM, "stream frames travelling down, from `terminate`"),
        PortDecl::new("in", port_type::IP, "packets from the network (up)"),
    ],
    outputs: &[
        PortDecl::new("stream", port_type::STREAM, "stream frames travelling up"),
        PortDecl::new("out", port_type::IP, "packets to the network (down)"),
        PortDecl::new("pass", port_type::IP, "packets from the network of none of its flows, unchanged"),
    ],
    extra: [
        P::manual(
            "match",
            "array of strings",
            "the connections and flows from the network towards the app it terminates (its `role server` rules; the \
             same table as `terminate`'s may be given), first match wins",
            "[]",
        ),
        APP,
        P::manual(
            "host_dev",
            "str",
            "kernel back-end with `role server` rules: the app's host face; the connections routed there go to its listener",
            "none",
        ),
        P::text(
            "source",
            "source addresses of its connections (one IPv4, one IPv6, comma-separated); empty: the app's own",
            "",
            |c| c.source.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(","),
            |c,
            t| parse_sources(t).map(|v| c.source = v),
        ).setting(),
        P::text(
            "ports",
            "local ports of connections from `source`",
            "32768-60999",
            |c| c.ports.to_string(),
            |c,
            t| PortRange::parse(t).map(|v| c.ports = v),
        ).setting(),
    ]
);

impl ModuleKind for OriginateKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        backend::configure(settings, KIND, &DECL, (Side::Net, PORTS), |r| {
            let rules = r.strings("match")?.unwrap_or_default();
            MatchTable::parse(&rules).map_err(|e| r.error("match", e))
        })
    }
}
