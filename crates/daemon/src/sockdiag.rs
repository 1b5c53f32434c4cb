//! Transport meters of forwarded TCP flows, read from the app's own kernel socket: a thread of the control side
//! (never the data plane) that, every `interval`, lists the forwarded TCP flows of sandboxed apps (the `classify`
//! flows of [`Control::flows`]), asks each app's network namespace for its TCP sockets with sock_diag (INET_DIAG
//! over NETLINK_SOCK_DIAG, with the TCP_INFO and congestion-control extensions), matches sockets to flows by
//! 5-tuple, and publishes, read-only, under `flow.<id>.tcp.`: `state`, `srtt_us`, `cwnd`, `bytes_in_flight`,
//! `retrans_total`, `delivery_rate`, `send_queue`, `recv_queue` and `cc`.
//!
//! - The namespace: a netlink socket belongs to the namespace it was created in, so the thread enters the app's
//!   namespace (`setns`, on this thread only), creates the socket and goes back at once; the socket is kept for the
//!   app's next polls and dropped when the app goes.
//! - Bounded: at most `max_flows` flows are updated per poll (the rest wait for later polls, oldest ids first), and
//!   at most [`MAX_SOCKETS`] sockets are read from one dump.
//! - Idle flows cost nothing: a flow whose packet count did not change since its socket was last read is read again
//!   only every ten polls, and an app none of whose flows is due is not dumped at all (10,000 idle
//!   connections of an app are one dump every ten seconds, not every second).
//! - Terminated flows are not polled: `classify` also publishes the packets between the app and a `terminate`
//!   endpoint as a flow, but the app's socket then talks to the endpoint, whose own `tcp.*` meters are the flow's.
//!   A flow whose (protocol, two ends) is a `terminate` flow's (parsed from both `tuple` texts, either end first)
//!   is left out, and so are its meters.
//! - Polls are cheap however many flows: the classifiers' flow groups are walked only when a runtime prefix was
//!   registered or removed since the last walk ([`flexstack_core::vars::SharedRegistry::runtime_changes`]); each new flow is judged once
//!   (terminated or not: the endpoints' flows are walked only then, and an endpoint flow's tuple is parsed only
//!   the first time it is seen), and between walks a poll looks only at the flows judged forwarded (their packet
//!   counters; it reads sockets for those due), not at the terminated ones. 10,000 idle terminated connections
//!   cost the thread nothing once they are open; the walk after the last of them opened reads one cell per flow
//!   and parses nothing it parsed before (it parsed all 10,000 again, 30-80 ms, which the idle CPU of
//!   bench-flows caught as 0.2-1.6 %). The poller's own registrations (a forwarded flow's meters published or
//!   removed) are not changes to walk for: they used to make the next poll walk every flow again.
//! - A flow whose socket is gone (the app closed it, or exited) keeps its last values with `state` `closed`; its
//!   meters go at the first poll after its flow leaves the flow table. A flow table made anew (an app attached
//!   again under the same name, a classifier replaced with `--fresh`) numbers its flows from 1 again: until the
//!   next poll, a new flow may have an old one's id and meters; `socket` (the socket's two ends) tells them apart,
//!   and `flow list` leaves out meters whose socket is not the flow's.
//! - Where the meters come from (`tcp_info` of the app's socket, as `ss -ti` shows it): `srtt_us` = `tcpi_rtt`,
//!   `cwnd` = `tcpi_snd_cwnd` (segments), `bytes_in_flight` = `tcpi_bytes_sent - tcpi_bytes_retrans -
//!   tcpi_bytes_acked` (new bytes sent minus bytes acked: `snd_nxt - snd_una`), `retrans_total` =
//!   `tcpi_total_retrans`, `delivery_rate` = `tcpi_delivery_rate` (bytes/s); `send_queue` and `recv_queue` are the
//!   diag header's (bytes written and not acked, bytes received and not read).

use crate::actions::{app_of, handling, Control, Publisher, Tuple};
use flexstack_api::ops::Handling;
use flexstack_core::vars::{DynamicVars, GroupVars, ModuleVars, Var, VarHandle, VarSpec};
use flexstack_core::Registry;
use flexstack_core::{Value, ValueType};
use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_TCP};
use netlink_packet_sock_diag::inet::{nlas::Nla, ExtensionFlags, InetRequest, InetResponse, SocketId, StateFlags};
use netlink_packet_sock_diag::SockDiagMessage;
use netlink_sys::{protocols::NETLINK_SOCK_DIAG, Socket, SocketAddr};
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Most sockets read from one namespace's dump in one poll.
pub const MAX_SOCKETS: usize = 16_384;

/// The owner the meters are registered for.
const OWNER: &str = "sockdiag";

/// How the poller runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PollOptions {
    /// Time between polls (zero: no poller).
    pub interval: Duration,
    /// Most flows updated per poll.
    pub max_flows: usize,
}

impl Default for PollOptions {
    fn default() -> Self {
        PollOptions { interval: Duration::from_secs(1), max_flows: 1024 }
    }
}

/// The meters published under `flow.<id>.tcp.`.
pub fn specs() -> Vec<VarSpec> {
    let u = |name: &str, unit: &str, doc: &str| VarSpec::meter(name, ValueType::U64, unit, doc);
    vec![
        VarSpec::meter("state", ValueType::Str, "", "TCP state of the app's socket (established ...; closed: gone)"),
        u("srtt_us", "us", "smoothed round-trip time of the app's socket (tcpi_rtt)"),
        u("cwnd", "segments", "congestion window of the app's socket (tcpi_snd_cwnd)"),
        u("bytes_in_flight", "bytes", "bytes sent and not acknowledged (snd_nxt - snd_una)"),
        u("retrans_total", "frames", "segments retransmitted (tcpi_total_retrans)"),
        u("delivery_rate", "bytes/s", "delivery rate (tcpi_delivery_rate)"),
        u("send_queue", "bytes", "bytes written by the app and not yet acknowledged"),
        u("recv_queue", "bytes", "bytes received and not yet read by the app"),
        VarSpec::meter("cc", ValueType::Str, "", "congestion control of the app's socket"),
        VarSpec::meter("socket", ValueType::Str, "", "the app's socket they are read from: local -> remote"),
    ]
}

/// What one socket told.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SocketStats {
    /// `established` ...
    pub state: &'static str,
    /// µs.
    pub srtt_us: u64,
    /// Segments.
    pub cwnd: u64,
    /// Bytes.
    pub bytes_in_flight: u64,
    /// Segments.
    pub retrans_total: u64,
    /// Bytes/s.
    pub delivery_rate: u64,
    /// Bytes.
    pub send_queue: u64,
    /// Bytes.
    pub recv_queue: u64,
    /// Congestion control.
    pub cc: String,
}

/// A socket's two ends: (local address, port), (remote address, port).
pub type SocketKey = ((IpAddr, u16), (IpAddr, u16));

/// The name of a kernel TCP state (`TCP_ESTABLISHED` ...), as smoltcp's are written.
pub fn state_name(state: u8) -> &'static str {
    flexstack_sys::tcp_state_name(state)
}

/// The key and stats of one INET_DIAG answer.
pub fn stats_of(r: &InetResponse) -> (SocketKey, SocketStats) {
    let id = &r.header.socket_id;
    let key = ((id.source_address, id.source_port), (id.destination_address, id.destination_port));
    let mut s = SocketStats {
        state: state_name(r.header.state),
        send_queue: u64::from(r.header.send_queue),
        recv_queue: u64::from(r.header.recv_queue),
        ..SocketStats::default()
    };
    for nla in &r.nlas {
        match nla {
            Nla::TcpInfo(i) => {
                s.srtt_us = u64::from(i.rtt);
                s.cwnd = u64::from(i.snd_cwnd);
                s.bytes_in_flight = i.bytes_sent.saturating_sub(i.bytes_retrans).saturating_sub(i.bytes_acked);
                s.retrans_total = u64::from(i.total_retrans);
                s.delivery_rate = i.delivery_rate;
            }
            Nla::Congestion(cc) => s.cc = cc.clone(),
            _ => {}
        }
    }
    (key, s)
}

/// The socket of a flow among `sockets`: the one whose two ends are the tuple's, in either order (the app may be
/// the flow's first sender or not).
pub fn socket_of(
    sockets: &HashMap<SocketKey, SocketStats>,
    a: (IpAddr, u16),
    b: (IpAddr, u16),
) -> Option<(SocketKey, &SocketStats)> {
    [(a, b), (b, a)].into_iter().find_map(|k| sockets.get(&k).map(|s| (k, s)))
}

/// A socket's two ends as the `socket` meter shows them: `local -> remote`.
pub fn socket_text(((l, lp), (r, rp)): SocketKey) -> String {
    format!("{} -> {}", std::net::SocketAddr::new(l, lp), std::net::SocketAddr::new(r, rp))
}

/// A forwarded TCP flow of an app, whose socket is looked for.
struct Target {
    id: String,
    tuple: String,
    app: String,
    /// Its two ends, the first sender first.
    a: (IpAddr, u16),
    b: (IpAddr, u16),
    /// Its packets so far: a flow whose count did not change since its socket was last read is not read again.
    packets: u64,
}

/// Keeps at most `max` of `todo`, in the order of their ids, starting after the id `resume_after` (where the last
/// poll stopped) and wrapping around; returns where this one stops, `None` when all fit.
fn window(todo: &mut Vec<Target>, max: usize, resume_after: Option<&str>) -> Option<String> {
    todo.sort_by(|a, b| a.id.cmp(&b.id));
    if todo.len() <= max {
        return None;
    }
    let start = resume_after.map_or(0, |last| todo.iter().position(|t| t.id.as_str() > last).unwrap_or(0));
    todo.rotate_left(start);
    todo.truncate(max);
    todo.last().map(|t| t.id.clone())
}

/// The number in a cell (0 if none).
fn u64_of(cell: Option<Var<'_>>) -> u64 {
    match cell.map(|c| c.get()) {
        Some(Value::U64(n)) => n,
        _ => 0,
    }
}

/// The two ends of a flow's tuple in a fixed order, with its protocol: a flow's key whichever side sent first
/// (`classify` writes the first sender first, an endpoint the app's side or, for the server role, the client's).
type FlowKey = (String, (IpAddr, u16), (IpAddr, u16));

/// The key of a parsed tuple, if it names both ends with ports.
fn key_of(t: &Tuple) -> Option<FlowKey> {
    let (a, b) = ((t.src?.0, t.src?.1?), (t.dst?.0, t.dst?.1?));
    Some((t.protocol.clone(), a.min(b), a.max(b)))
}

/// A TCP flow of an app: its key, the app, and its two ends, the first sender first.
type TcpFlow = (FlowKey, String, (IpAddr, u16), (IpAddr, u16));

/// What the poller knows of a `classify` flow between polls.
struct Known {
    /// Its `tuple` cell: another cell under the same id is another connection (a flow table made anew).
    cell: VarHandle,
    tuple: String,
    /// Its key, the app it belongs to and its two ends (the first sender first), if it is a TCP flow of an app.
    tcp: Option<TcpFlow>,
    /// Whether an endpoint (`terminate`) took it: its app's socket talks to the endpoint, and the flow's transport
    /// meters are the endpoint's own (`None`: not judged yet).
    terminated: Option<bool>,
    /// Its `packets_total` cell, read at each poll while no flow comes or goes.
    packets_cell: VarHandle,
    packets: u64,
    /// The last poll that saw it.
    seen: u64,
}

impl Known {
    /// Its target, if its socket is to be read: a TCP flow of an app that no endpoint terminated.
    fn target(&self, id: &str) -> Option<Target> {
        let (_, app, a, b) = self.tcp.as_ref().filter(|_| self.terminated == Some(false))?;
        Some(Target { id: id.into(), tuple: self.tuple.clone(), app: app.clone(), a: *a, b: *b, packets: self.packets })
    }
}

/// The flows that the `terminate` modules published, kept between walks: each flow's key is parsed from its
/// `tuple` once, when the flow is first seen, so a walk over 10,000 terminated connections reads one cell per flow
/// and parses only the new ones.
#[derive(Default)]
struct EndpointKeys {
    /// By group (`app.term.7`): its `tuple` cell (another cell under the same id is another connection), its key,
    /// and the update that last saw it.
    flows: HashMap<String, (VarHandle, Option<FlowKey>, u64)>,
    /// How many endpoint flows have each key.
    keys: HashMap<FlowKey, usize>,
    /// Updates so far.
    updates: u64,
    /// Tuples parsed so far.
    parsed: u64,
}

impl EndpointKeys {
    /// Reads the flows the `terminate` modules among `publishers` publish in `reg`: new ones are parsed, gone ones
    /// forgotten.
    fn update(&mut self, reg: &Registry, publishers: &[Publisher]) {
        self.updates += 1;
        let update = self.updates;
        for p in publishers.iter().filter(|p| handling(&p.kind) == Handling::Terminated) {
            for_flow_groups(reg, &p.prefix, |id, g| {
                let Some(cell) = g.get("tuple") else { return };
                match self.flows.get_mut(id) {
                    Some((known, _, seen)) if known.var().is(cell) => *seen = update,
                    _ => {
                        let key = match cell.get() {
                            Value::Str(text) => key_of(&Tuple::parse(&text)),
                            _ => None,
                        };
                        self.parsed += 1;
                        if let Some(k) = &key {
                            *self.keys.entry(k.clone()).or_default() += 1;
                        }
                        if let Some((_, Some(old), _)) = self.flows.insert(id.into(), (cell.to_handle(), key, update)) {
                            self.forget(&old);
                        }
                    }
                }
            });
        }
        let gone: Vec<FlowKey> =
            self.flows.extract_if(|_, (_, _, seen)| *seen != update).filter_map(|(_, (_, key, _))| key).collect();
        for k in gone {
            self.forget(&k);
        }
    }

    fn forget(&mut self, key: &FlowKey) {
        if let Some(n) = self.keys.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                self.keys.remove(key);
            }
        }
    }

    /// Whether an endpoint's flow has this key.
    fn contains(&self, key: &FlowKey) -> bool {
        self.keys.contains_key(key)
    }
}

/// Calls `f` for each flow group a module with `vars_prefix` `prefix` publishes in `reg`: `<prefix>.<id>`, with its
/// id (`app.3`), leaving out groups below them (`<prefix>.<id>.tcp`) and other modules' under the same prefix
/// (`flow.app.term.<id>`). One search, then one comparison per group.
fn for_flow_groups(reg: &Registry, prefix: &str, mut f: impl FnMut(&str, GroupVars<'_>)) {
    let start = format!("{prefix}.");
    for (p, g) in reg.groups_under(&start) {
        if !p[start.len()..].contains('.') {
            f(p.strip_prefix("flow.").unwrap_or(p), g);
        }
    }
}

/// Sends one INET_DIAG dump request for TCP sockets of `family` and reads the answers, at most [`MAX_SOCKETS`].
fn dump(socket: &Socket, family: u8, into: &mut HashMap<SocketKey, SocketStats>) -> Result<(), String> {
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    let socket_id = if family == AF_INET { SocketId::new_v4() } else { SocketId::new_v6() };
    let request = SockDiagMessage::InetRequest(InetRequest {
        family,
        protocol: IPPROTO_TCP,
        extensions: ExtensionFlags::INFO | ExtensionFlags::CONG,
        states: StateFlags::all() - StateFlags::LISTEN,
        socket_id,
    });
    let mut message = NetlinkMessage::new(header, request.into());
    message.finalize();
    let mut bytes = vec![0; message.buffer_len()];
    message.serialize(&mut bytes);
    socket.send(&bytes, 0).map_err(|e| format!("sock_diag request: {e}"))?;
    let mut buf = vec![0u8; 1 << 16];
    let mut read = 0;
    loop {
        let n = socket.recv(&mut &mut buf[..], 0).map_err(|e| format!("sock_diag answer: {e}"))?;
        let mut offset = 0;
        while offset < n {
            let m = NetlinkMessage::<SockDiagMessage>::deserialize(&buf[offset..n])
                .map_err(|e| format!("sock_diag answer: {e}"))?;
            let len = m.header.length as usize;
            match m.payload {
                NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => {
                    read += 1;
                    if read <= MAX_SOCKETS {
                        let (k, s) = stats_of(&r);
                        into.insert(k, s);
                    }
                }
                NetlinkPayload::Done(_) => return Ok(()),
                NetlinkPayload::Error(e) => return Err(format!("sock_diag: {e}")),
                _ => {}
            }
            if len == 0 {
                break;
            }
            offset += len;
        }
    }
}

/// A NETLINK_SOCK_DIAG socket in network namespace `netns` (under /run/netns): this thread enters it, creates the
/// socket and returns to `home`. An error returning is fatal to the caller: the thread would be left elsewhere.
fn socket_in(netns: &str, home: &std::fs::File) -> Result<Socket, Fatal> {
    use nix::sched::{setns, CloneFlags};
    let target =
        std::fs::File::open(format!("/run/netns/{netns}")).map_err(|e| Fatal::No(format!("namespace {netns}: {e}")))?;
    setns(&target, CloneFlags::CLONE_NEWNET).map_err(|e| Fatal::No(format!("setns into {netns}: {e}")))?;
    let socket = Socket::new(NETLINK_SOCK_DIAG);
    setns(home, CloneFlags::CLONE_NEWNET).map_err(|e| Fatal::Yes(format!("setns back from {netns}: {e}")))?;
    let mut socket = socket.map_err(|e| Fatal::No(format!("sock_diag socket in {netns}: {e}")))?;
    socket.bind_auto().map_err(|e| Fatal::No(format!("sock_diag bind: {e}")))?;
    socket.connect(&SocketAddr::new(0, 0)).map_err(|e| Fatal::No(format!("sock_diag connect: {e}")))?;
    let timeout = nix::sys::time::TimeVal::new(1, 0);
    nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::ReceiveTimeout, &timeout)
        .map_err(|e| Fatal::No(format!("sock_diag timeout: {e}")))?;
    Ok(socket)
}

/// The inode of network namespace `netns` (under /run/netns), which tells it from a later one of the same name.
fn namespace_inode(netns: &str) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/run/netns/{netns}")).ok().map(|m| m.ino())
}

/// An error, and whether the thread must stop.
enum Fatal {
    No(String),
    Yes(String),
}

/// One flow's published meters.
struct Published {
    tuple: String,
    vars: ModuleVars,
}

impl Published {
    fn store(&self, key: SocketKey, s: &SocketStats) {
        let m = |n: &str| self.vars.meter(n);
        m("socket").store(&Value::Str(socket_text(key)));
        m("state").store(&Value::Str(s.state.into()));
        m("srtt_us").set(s.srtt_us);
        m("cwnd").set(s.cwnd);
        m("bytes_in_flight").set(s.bytes_in_flight);
        m("retrans_total").set(s.retrans_total);
        m("delivery_rate").set(s.delivery_rate);
        m("send_queue").set(s.send_queue);
        m("recv_queue").set(s.recv_queue);
        m("cc").store(&Value::Str(s.cc.clone()));
    }
}

/// An idle flow's socket is read again after this many polls.
const REFRESH_POLLS: u64 = 10;

/// Whether `t`'s socket is read at poll `polls`, given what it was when last read (tuple, packets, poll): when it is
/// new, another connection under its id, has moved packets since, or was last read [`REFRESH_POLLS`] polls ago.
fn due(last: Option<&(String, u64, u64)>, t: &Target, polls: u64) -> bool {
    last.is_none_or(|(tuple, packets, poll)| {
        *tuple != t.tuple || *packets != t.packets || polls.saturating_sub(*poll) >= REFRESH_POLLS
    })
}

/// The poller's state between polls.
struct Poller {
    dynamic: DynamicVars,
    specs: Vec<VarSpec>,
    published: BTreeMap<String, Published>,
    /// By namespace name: the namespace's inode (a name can be given to a new namespace) and the socket in it.
    sockets: HashMap<String, (u64, Socket)>,
    home: std::fs::File,
    max_flows: usize,
    /// Where the last poll stopped, for the next one to go on from (flows beyond `max_flows`).
    resume_after: Option<String>,
    /// By flow id: its tuple, its packets and the poll when its socket was last read. Without a packet a TCP
    /// socket's state, round-trip time and window do not change (keep-alives and closes are packets), so an idle
    /// flow is read again only every [`REFRESH_POLLS`] polls (its queues may change as the app reads or writes).
    read_at: HashMap<String, (String, u64, u64)>,
    /// Polls so far.
    polls: u64,
    /// The `classify` flows seen at the last walk, by id.
    known: HashMap<String, Known>,
    /// The registry's [`SharedRegistry::runtime_changes`] at the last walk of the flows, plus the changes this
    /// poller made since ([`Poller::own_change`]).
    walked: Option<u64>,
    /// A poll that walks the flows again to judge once more those judged forwarded (an endpoint may have published
    /// its flow just after the snapshot that showed the classifier's).
    rejudge_at: Option<u64>,
    /// The endpoints' flows, as of the last walk that judged flows.
    endpoints: EndpointKeys,
    /// The ids of the `known` flows judged forwarded (TCP flows of an app that no endpoint took): the only ones a
    /// poll between walks looks at, however many terminated connections there are.
    forwarded: Vec<String>,
}

impl Poller {
    /// Reads the classifiers' flows anew (some came or went since the last walk) and judges the new ones: read lean,
    /// for tens of thousands of them may be idle connections an endpoint terminated.
    fn walk(&mut self, control: &Control, changes: u64) -> Result<(), Fatal> {
        let polls = self.polls;
        let reg = control.registry().snapshot();
        let publishers = control.publishers().map_err(|e| Fatal::No(e.message))?;
        let apps = control.sandboxes.list();
        let mut fresh = false;
        for p in publishers.iter().filter(|p| handling(&p.kind) == Handling::Forwarded) {
            for_flow_groups(&reg, &p.prefix, |id, g| {
                let Some(cell) = g.get("tuple") else { return };
                match self.known.get_mut(id) {
                    Some(k) if k.cell.var().is(cell) => {
                        k.seen = polls;
                        // Only a forwarded flow's packets matter (its cell is kept: no lookup by name).
                        if k.terminated == Some(false) {
                            k.packets = u64_of(Some(k.packets_cell.var()));
                        }
                    }
                    _ => {
                        let Some(packets_cell) = g.get("packets_total") else { return };
                        let packets = u64_of(Some(packets_cell));
                        let Value::Str(tuple) = cell.get() else { return };
                        let t = Tuple::parse(&tuple);
                        let tcp = (t.protocol == "tcp")
                            .then(|| Some((key_of(&t)?, app_of(&apps, &p.name, &t)?, t.src?, t.dst?)))
                            .flatten()
                            .map(|(key, app, (a, pa), (b, pb))| (key, app, (a, pa.unwrap_or(0)), (b, pb.unwrap_or(0))));
                        let terminated = if tcp.is_some() { None } else { Some(true) };
                        let (cell, packets_cell) = (cell.to_handle(), packets_cell.to_handle());
                        let k = Known { cell, packets_cell, tuple, tcp, terminated, packets, seen: polls };
                        self.known.insert(id.to_string(), k);
                        fresh = true;
                    }
                }
            });
        }
        self.known.retain(|_, k| k.seen == polls);
        // Judge the new flows, and those judged forwarded at the last walk, against the endpoints' flows: only when
        // there are any, so idle flows cost no walk of the endpoints' flows.
        let again = self.rejudge_at == Some(polls);
        if fresh || again {
            self.endpoints.update(&reg, &publishers);
            let mut forwarded = false;
            for k in
                self.known.values_mut().filter(|k| k.terminated.is_none() || (again && k.terminated == Some(false)))
            {
                let taken = k.tcp.as_ref().is_some_and(|t| self.endpoints.contains(&t.0));
                forwarded |= !taken && k.terminated.is_none();
                k.terminated = Some(taken);
            }
            self.rejudge_at = forwarded.then_some(polls + 1);
        }
        self.forwarded =
            self.known.iter().filter(|(_, k)| k.terminated == Some(false)).map(|(id, _)| id.clone()).collect();
        self.walked = Some(changes);
        Ok(())
    }

    /// Counts a runtime prefix this poller registered or removed (one step of
    /// [`flexstack_core::vars::SharedRegistry::runtime_changes`]) as seen: its own meters are not flows, and
    /// walking all the flows again after each poll that published or removed some would cost as much as the first
    /// walk (10,000 idle terminated connections walked again after the meters of one closed forwarded flow went).
    /// A change by anyone else in between still makes the count differ, and the next poll walk.
    fn own_change(&mut self) {
        if let Some(walked) = &mut self.walked {
            *walked += 1;
        }
    }

    /// Nothing to read until an app attaches: none is, and nothing of an earlier one is left to remove.
    fn idle(&self, control: &Control) -> bool {
        control.sandboxes.count() == 0 && self.published.is_empty() && self.sockets.is_empty()
    }

    /// One poll: read the sockets of the apps with forwarded TCP flows and publish the flows' meters.
    fn poll(&mut self, control: &Control) -> Result<(), Fatal> {
        if self.idle(control) {
            return Ok(()); // no app: nothing to read (and the data plane is not asked for a snapshot)
        }
        self.polls += 1;
        let polls = self.polls;
        let changes = control.registry().runtime_changes();
        if self.walked == Some(changes) && self.rejudge_at != Some(polls) {
            // No flow came or went: only the packet counts of the flows whose sockets are read may have moved.
            for id in &self.forwarded {
                if let Some(k) = self.known.get_mut(id) {
                    k.packets = u64_of(Some(k.packets_cell.var()));
                }
            }
        } else {
            self.walk(control, changes)?;
        }
        let apps = control.sandboxes.list();
        let mut todo: Vec<Target> = self
            .forwarded
            .iter()
            .filter_map(|id| self.known.get(id)?.target(id))
            .filter(|t| due(self.read_at.get(&t.id), t, polls))
            .collect();
        // Forget the meters of flows that are gone, taken by an endpoint, or whose id now names another connection.
        let known = &self.known;
        let live =
            |id: &str, tuple: &str| known.get(id).is_some_and(|k| k.tuple == tuple && k.terminated == Some(false));
        let gone: Vec<String> =
            self.published.iter().filter(|(id, p)| !live(id, &p.tuple)).map(|(id, _)| id.clone()).collect();
        self.read_at.retain(|id, _| known.get(id.as_str()).is_some_and(|k| k.terminated == Some(false)));
        for id in gone {
            self.published.remove(&id);
            if self.dynamic.unregister(OWNER, &format!("flow.{id}.tcp")) {
                self.own_change();
            }
        }
        // Sockets of namespaces that are gone, or whose name is now another namespace's (an app attached again).
        self.sockets
            .retain(|netns, (ino, _)| apps.iter().any(|a| &a.netns == netns) && namespace_inode(netns) == Some(*ino));
        self.resume_after = window(&mut todo, self.max_flows, self.resume_after.as_deref());
        let mut by_app: BTreeMap<String, Vec<Target>> = BTreeMap::new();
        for t in todo {
            by_app.entry(t.app.clone()).or_default().push(t);
        }
        for (app, flows) in by_app {
            let Some(info) = apps.iter().find(|a| a.name == app) else { continue };
            if !self.sockets.contains_key(&info.netns) {
                let Some(ino) = namespace_inode(&info.netns) else { continue };
                match socket_in(&info.netns, &self.home) {
                    Ok(s) => {
                        self.sockets.insert(info.netns.clone(), (ino, s));
                    }
                    Err(Fatal::No(e)) => {
                        tracing::debug!(app, error = %e, "cannot read the app's sockets");
                        continue;
                    }
                    Err(fatal) => return Err(fatal),
                }
            }
            let Some((_, socket)) = self.sockets.get(&info.netns) else { continue };
            let mut sockets = HashMap::new();
            let families =
                [(AF_INET, flows.iter().any(|f| f.a.0.is_ipv4())), (AF_INET6, flows.iter().any(|f| f.a.0.is_ipv6()))];
            let mut failed = None;
            for (family, _) in families.iter().filter(|f| f.1) {
                if let Err(e) = dump(socket, *family, &mut sockets) {
                    failed = Some(e);
                }
            }
            if let Some(e) = failed {
                // A socket that failed once is made again at the next poll.
                tracing::debug!(app, error = %e, "sock_diag dump failed");
                self.sockets.remove(&info.netns);
                continue;
            }
            for Target { id, tuple, a, b, packets, .. } in flows {
                self.read_at.insert(id.clone(), (tuple.clone(), packets, self.polls));
                match (socket_of(&sockets, a, b), self.published.get(&id)) {
                    (Some((k, s)), Some(p)) => p.store(k, s),
                    (Some((k, s)), None) => {
                        let prefix = format!("flow.{id}.tcp");
                        match self.dynamic.register(OWNER, &prefix, &self.specs) {
                            Ok(vars) => {
                                self.own_change();
                                let p = Published { tuple, vars };
                                p.store(k, s);
                                self.published.insert(id, p);
                            }
                            Err(e) => tracing::debug!(prefix, error = %e, "cannot publish a flow's TCP meters"),
                        }
                    }
                    (None, Some(p)) => p.vars.meter("state").store(&Value::Str("closed".into())),
                    (None, None) => {}
                }
            }
        }
        Ok(())
    }
}

/// The poller's pause is at least this many times its last pass (at most 2 % of a core however many flows).
const MAX_DUTY: u32 = 50;

/// The running poller; stops (and its meters go) when dropped.
pub struct FlowMeterPoller {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FlowMeterPoller {
    /// Starts the poller thread for the apps of `control` (kept weakly: the thread ends with the daemon).
    pub fn start(control: &Arc<Control>, opts: PollOptions) -> Result<FlowMeterPoller, String> {
        let home = std::fs::File::open("/proc/thread-self/ns/net")
            .map_err(|e| format!("flow meters: cannot open this thread's network namespace: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let weak: Weak<Control> = Arc::downgrade(control);
        let mut poller = Poller {
            dynamic: DynamicVars::new(control.registry()),
            specs: specs(),
            published: BTreeMap::new(),
            sockets: HashMap::new(),
            home,
            max_flows: opts.max_flows.max(1),
            resume_after: None,
            read_at: HashMap::new(),
            polls: 0,
            known: HashMap::new(),
            walked: None,
            rejudge_at: None,
            endpoints: EndpointKeys::default(),
            forwarded: Vec::new(),
        };
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("flow-meters".into())
            .spawn(move || {
                let mut pause = Some(opts.interval);
                while !flag.load(Ordering::Relaxed) {
                    // With no app attached and nothing published, sleep until an app attaches (or the poller stops):
                    // an idle daemon has no timer here.
                    match pause {
                        Some(pause) => std::thread::park_timeout(pause),
                        None => std::thread::park(),
                    }
                    let Some(control) = weak.upgrade() else { break };
                    if flag.load(Ordering::Relaxed) {
                        break;
                    }
                    let started = std::time::Instant::now();
                    let polled = poller.poll(&control);
                    // A pass reads every flow's variables: with many thousands of flows (idle terminated connections
                    // included) it takes long, so the pause grows to keep this thread busy at most 1/MAX_DUTY.
                    pause = (!poller.idle(&control)).then(|| opts.interval.max(started.elapsed() * MAX_DUTY));
                    match polled {
                        Ok(()) => {}
                        Err(Fatal::No(e)) => tracing::debug!(error = %e, "flow meters: poll failed"),
                        Err(Fatal::Yes(e)) => {
                            tracing::error!(error = %e, "flow meters: stopped");
                            break;
                        }
                    }
                }
                poller.dynamic.unregister_owner(OWNER);
            })
            .map_err(|e| format!("flow meters thread: {e}"))?;
        control.sandboxes.wake_on_attach(thread.thread().clone());
        Ok(FlowMeterPoller { stop, thread: Some(thread) })
    }
}

impl Drop for FlowMeterPoller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_core::{Emitable, Parseable};
    use netlink_packet_sock_diag::inet::nlas::TcpInfo;
    use netlink_packet_sock_diag::inet::InetResponseHeader;

    fn response(state: u8, info: Option<TcpInfo>) -> InetResponse {
        let mut socket_id = SocketId::new_v4();
        socket_id.source_address = "10.9.1.2".parse().unwrap();
        socket_id.source_port = 40000;
        socket_id.destination_address = "10.1.1.1".parse().unwrap();
        socket_id.destination_port = 5201;
        let nlas = info.map(Nla::TcpInfo).into_iter().chain([Nla::Congestion("cubic".into())]).collect();
        InetResponse {
            header: InetResponseHeader {
                family: AF_INET,
                state,
                timer: None,
                socket_id,
                recv_queue: 3,
                send_queue: 70_000,
                uid: 0,
                inode: 1,
            },
            nlas,
        }
    }

    /// A kernel-sized `tcp_info` with the fields we read set, decoded by the crate as an answer would be.
    fn tcp_info() -> TcpInfo {
        let mut raw = vec![0u8; 512];
        let put32 = |raw: &mut Vec<u8>, at: usize, v: u32| raw[at..at + 4].copy_from_slice(&v.to_ne_bytes());
        let put64 = |raw: &mut Vec<u8>, at: usize, v: u64| raw[at..at + 8].copy_from_slice(&v.to_ne_bytes());
        // Offsets of struct tcp_info (linux/tcp.h).
        put32(&mut raw, 68, 1234); // tcpi_rtt
        put32(&mut raw, 80, 42); // tcpi_snd_cwnd
        put32(&mut raw, 100, 7); // tcpi_total_retrans
        put64(&mut raw, 120, 1_000_000); // tcpi_bytes_acked
        put64(&mut raw, 160, 5_000_000); // tcpi_delivery_rate
        put64(&mut raw, 200, 1_070_000); // tcpi_bytes_sent
        put64(&mut raw, 208, 20_000); // tcpi_bytes_retrans
        TcpInfo::parse(&raw).unwrap()
    }

    #[test]
    fn an_answer_gives_the_flow_meters() {
        let sent = response(1, Some(tcp_info()));
        // Through the wire format and back, as the kernel's answer is read.
        let mut bytes = vec![0; sent.buffer_len()];
        sent.emit(&mut bytes);
        let r = InetResponse::parse(&bytes[..]).unwrap();
        let (key, s) = stats_of(&r);
        let a = ("10.9.1.2".parse().unwrap(), 40000);
        let b = ("10.1.1.1".parse().unwrap(), 5201);
        assert_eq!(key, (a, b));
        assert_eq!(
            s,
            SocketStats {
                state: "established",
                srtt_us: 1234,
                cwnd: 42,
                bytes_in_flight: 50_000,
                retrans_total: 7,
                delivery_rate: 5_000_000,
                send_queue: 70_000,
                recv_queue: 3,
                cc: "cubic".into(),
            }
        );
        let sockets = HashMap::from([(key, s.clone())]);
        assert_eq!(socket_of(&sockets, a, b), Some(((a, b), &s)), "the app sent first");
        assert_eq!(socket_of(&sockets, b, a), Some(((a, b), &s)), "the peer sent first");
        assert_eq!(socket_text((a, b)), "10.9.1.2:40000 -> 10.1.1.1:5201");
        assert_eq!(socket_of(&sockets, a, ("10.1.1.1".parse().unwrap(), 5202)), None);
        // Without TCP_INFO (a socket in TIME_WAIT): state and queues only.
        let (_, s) = stats_of(&response(6, None));
        assert_eq!((s.state, s.srtt_us, s.send_queue), ("time-wait", 0, 70_000));
        assert_eq!(state_name(99), "unknown");
    }

    #[test]
    fn idle_flows_are_read_again_only_now_and_then() {
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let t = |tuple: &str, packets| Target {
            id: "a.1".into(),
            tuple: tuple.into(),
            app: "a".into(),
            a: (ip, 1),
            b: (ip, 2),
            packets,
        };
        let read = ("tcp x".to_string(), 10, 5);
        assert!(due(None, &t("tcp x", 10), 5), "never read");
        assert!(!due(Some(&read), &t("tcp x", 10), 6), "idle since the last read");
        assert!(!due(Some(&read), &t("tcp x", 10), 5 + REFRESH_POLLS - 1));
        assert!(due(Some(&read), &t("tcp x", 10), 5 + REFRESH_POLLS), "refreshed now and then");
        assert!(due(Some(&read), &t("tcp x", 11), 6), "a packet moved");
        assert!(due(Some(&read), &t("tcp y", 10), 6), "another connection under the id");
    }

    #[test]
    fn polls_beyond_max_flows_go_round_all_flows() {
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let all = || -> Vec<Target> {
            ["e", "b", "a", "d", "c"]
                .map(|id| Target {
                    id: id.into(),
                    tuple: String::new(),
                    app: String::new(),
                    a: (ip, 1),
                    b: (ip, 2),
                    packets: 0,
                })
                .into()
        };
        let mut resume = None;
        let mut seen = Vec::new();
        for _ in 0..4 {
            let mut todo = all();
            resume = window(&mut todo, 2, resume.as_deref());
            seen.push(todo.iter().map(|t| t.id.clone()).collect::<Vec<_>>().join(""));
        }
        assert_eq!(seen, ["ab", "cd", "ea", "bc"]);
        let mut todo = all();
        assert_eq!(window(&mut todo, 5, Some("c")), None, "all fit: no window");
        assert_eq!(todo.len(), 5);
    }

    #[test]
    fn flows_an_endpoint_terminated_are_not_polled() {
        use flexstack_core::vars::SharedRegistry;
        let shared = SharedRegistry::default();
        let mut dynamic = DynamicVars::new(shared.clone());
        let tuple = [VarSpec::meter("tuple", ValueType::Str, "", "")];
        let mut publish = |owner: &str, prefix: &str, text: &str| {
            let vars = dynamic.register(owner, prefix, &tuple).unwrap();
            vars.meter("tuple").store(&Value::Str(text.into()));
        };
        // The classifier's flows (one of them with the poller's meters below it) and an endpoint's, whose tuple
        // is the first one's written from the other side.
        publish("a-flows", "flow.a.3", "tcp 10.9.1.2:4000 <-> 10.1.1.1:80");
        publish("a-flows", "flow.a.4", "udp 10.9.1.2:53 <-> 10.1.1.1:53");
        publish("sockdiag", "flow.a.3.tcp", "");
        let before = shared.runtime_changes();
        publish("a-term", "flow.a.term.1", r#"tcp 10.1.1.1:80 -> 10.9.1.2:4000 role server app "a""#);
        assert_eq!(shared.runtime_changes(), before + 1, "a new group is a change: the poller walks again");
        let reg = shared.snapshot();
        let mut ids = Vec::new();
        for_flow_groups(&reg, "flow.a", |id, _| ids.push(id.to_string()));
        assert_eq!(ids, ["a.3", "a.4"], "neither the meters below a flow nor another module's flows");
        let publisher = |name: &str, kind: &str, prefix: &str| Publisher {
            name: name.into(),
            kind: kind.into(),
            prefix: prefix.into(),
            backend: None,
        };
        let publishers = [publisher("a-flows", "classify", "flow.a"), publisher("a-term", "terminate", "flow.a.term")];
        let mut keys = EndpointKeys::default();
        keys.update(&reg, &publishers);
        let t = Tuple::parse("tcp 10.9.1.2:4000 <-> 10.1.1.1:80");
        assert_eq!(keys.keys, HashMap::from([(key_of(&t).unwrap(), 1)]), "the same key from either side");
        assert!(keys.contains(&key_of(&t).unwrap()));
        assert!(!keys.contains(&key_of(&Tuple::parse("tcp 10.9.1.2:4001 <-> 10.1.1.1:80")).unwrap()));
        // Walked again, an endpoint's flow is not parsed again; a new one is; a gone one is forgotten.
        keys.update(&reg, &publishers);
        assert_eq!(keys.parsed, 1, "a flow's tuple is parsed once");
        publish("a-term", "flow.a.term.2", r#"tcp 10.1.1.1:80 -> 10.9.1.2:4001 role server app "a""#);
        keys.update(&shared.snapshot(), &publishers);
        assert_eq!(keys.parsed, 2);
        assert!(keys.contains(&key_of(&Tuple::parse("tcp 10.9.1.2:4001 <-> 10.1.1.1:80")).unwrap()));
        dynamic.unregister("a-term", "flow.a.term.1");
        keys.update(&shared.snapshot(), &publishers);
        assert!(!keys.contains(&key_of(&t).unwrap()), "its endpoint flow is gone");
        assert_eq!((keys.flows.len(), keys.keys.len(), keys.parsed), (1, 1, 2));
        assert_eq!(key_of(&Tuple::parse("icmp 10.9.1.2 <-> 10.1.1.1 id 7")), None, "no ports: no key");
        // Only a TCP flow judged not terminated is a target.
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let mut k = Known {
            cell: reg.group("flow.a.3").unwrap().get("tuple").unwrap().to_handle(),
            packets_cell: reg.group("flow.a.3").unwrap().get("tuple").unwrap().to_handle(),
            tuple: "tcp x".into(),
            tcp: Some((key_of(&t).unwrap(), "a".into(), (ip("10.9.1.2"), 4000), (ip("10.1.1.1"), 80))),
            terminated: None,
            packets: 5,
            seen: 1,
        };
        assert!(k.target("a.3").is_none(), "not judged yet");
        k.terminated = Some(true);
        assert!(k.target("a.3").is_none(), "terminated");
        k.terminated = Some(false);
        let target = k.target("a.3").unwrap();
        assert_eq!((target.app.as_str(), target.a.1, target.b.1, target.packets), ("a", 4000, 80, 5));
    }
}
