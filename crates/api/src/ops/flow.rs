//! Flows: list and show. A flow is read from the registry: every prefix `flow.<id>` with a `tuple` meter is one,
//! published by the module that holds it (`classify` for a forwarded flow, `terminate` or `originate` for each side
//! of a terminated one); its `<id>` (`app1.3`, `terminate.5`) is what `flow show` takes.

use crate::ops::VarValue;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::IpAddr;

/// `flow_list`: the flows of every module that keeps per-flow meters. Result: a list of [`FlowInfo`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowList;

/// `flow_show`: one flow with every variable under its prefix. Result: [`FlowDetail`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowShow {
    /// The flow's id (`app1.3`), or its registry prefix (`flow.app1.3`). (Not `id`: that is the request's.)
    pub flow: String,
}

/// How flexstack handles a flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Handling {
    /// Its packets pass through the chain (a `classify` flow table): the app's own kernel holds the connection.
    Forwarded,
    /// Ended at flexstack's endpoint on the app side (`terminate`).
    Terminated,
    /// Opened again by flexstack towards the original destination (`originate`): the network side of a terminated
    /// flow.
    Originated,
    /// Carried to a flexstack peer (`carrier`, docs/peers.md): the network side of a terminated flow, opened again
    /// by the peer.
    Carried,
    /// Published by a module of another kind.
    Other,
}

impl Handling {
    /// The name as on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Handling::Forwarded => "forwarded",
            Handling::Terminated => "terminated",
            Handling::Originated => "originated",
            Handling::Carried => "carried",
            Handling::Other => "other",
        }
    }
}

/// One flow of `flow_list`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlowInfo {
    /// Its id: the registry prefix without `flow.` (`app1.3`); its variables are `flow.<id>.*`.
    pub id: String,
    /// The sandboxed app it belongs to, when known.
    pub app: Option<String>,
    /// The module that publishes it ("" when none matches its prefix).
    pub module: String,
    /// Forwarded, terminated or originated.
    pub handling: Handling,
    /// The endpoint's back-end of a terminated or originated flow (`smoltcp`, `kernel`).
    pub backend: Option<String>,
    /// `tcp`, `udp`, `icmp`, `icmpv6` or `proto N`.
    pub protocol: String,
    /// The side that sent first (forwarded) or the app's side (terminated, originated).
    pub src: Option<IpAddr>,
    /// Its port (TCP, UDP; the identifier of an ICMP echo is not a port).
    pub src_port: Option<u16>,
    /// The other side: the (original) destination.
    pub dst: Option<IpAddr>,
    /// Its port.
    pub dst_port: Option<u16>,
    /// The `tuple` meter as the module wrote it.
    pub tuple: String,
    /// Bytes travelling down (from the app towards the network): IP bytes of a forwarded flow, stream bytes of a
    /// terminated one.
    pub bytes_down: Option<u64>,
    /// Bytes travelling up (to the app).
    pub bytes_up: Option<u64>,
    /// Packets, both directions (forwarded flows).
    pub packets: Option<u64>,
    /// The transport meters `flow.<id>.tcp.*`, when it has them.
    pub tcp: Option<TcpMeters>,
    /// The other side of a terminated flow: the `originate` flow with the same tuple, or the reverse.
    pub peer: Option<String>,
}

/// A TCP flow's transport meters, `flow.<id>.tcp.*` (each absent when the flow does not publish it).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpMeters {
    /// TCP state (`established` ...).
    pub state: Option<String>,
    /// Smoothed round-trip time, µs.
    pub srtt_us: Option<u64>,
    /// Congestion window, segments.
    pub cwnd: Option<u64>,
    /// Bytes sent and not yet acknowledged.
    pub bytes_in_flight: Option<u64>,
    /// Segments sent again.
    pub retrans_total: Option<u64>,
    /// Delivery rate, bytes/s.
    pub delivery_rate: Option<u64>,
    /// Bytes in the send queue.
    pub send_queue: Option<u64>,
    /// Bytes in the receive queue.
    pub recv_queue: Option<u64>,
    /// Congestion control.
    pub cc: Option<String>,
}

/// The result of `flow_show`: the flow and every variable under `flow.<id>`, by full name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlowDetail {
    /// The flow, as `flow_list` shows it.
    pub flow: FlowInfo,
    /// Its variables.
    pub vars: BTreeMap<String, VarValue>,
}
