//! The `tcp` carrier (docs/peers.md): one mutually authenticated TLS 1.3 connection over TCP per peer, carrying
//! every flow's stream frames as length-prefixed messages ([`wire`]), multiplexed by flow id.
//!
//! Like the kernel back-end of the endpoints, the module is a face: its device is an epoll set holding the
//! connection(s) (and a listener when accepting, and an eventfd), which the data plane waits on with its other
//! devices. Frames the connection brings are read from it one per call (`read_frame`); the frames the module takes
//! on `stream_in` are queued as a face queues packets and written to the connection after the switch runs
//! (`write_frames`). All sockets are non-blocking: nothing here waits.
//!
//! - Connect mode (`peer`): the connection is opened when the module is built and again, at most every
//!   `retry_ms`, when a flow opens while it is down. A flow that opens while the peer is unreachable is answered
//!   `Abort(unreachable)`; when the connection goes, every flow on it is (`flows_aborted_total`).
//! - Accept mode (`listen`): any number of peers (at most [`MAX_CONNECTIONS`]) connect; each flow gets an id of
//!   this module's own (peers number their flows independently), and a connection that goes aborts its flows
//!   towards the chain (`Abort(unreachable)` Down).
//! - Nothing is read from a connection before TLS has authenticated the other side (its certificate's fingerprint
//!   is a peer's) and its `Hello` has the same version: anything else closes it and counts in `refusals_total`;
//!   after that, input that is not the protocol closes it and counts in `malformed_total`.

use super::trust::{self, client_config, identity, report, server_config, server_name, Peer};
use super::uplinks::Uplinks;
use crate::stream::{EpollDevice, FrameEngine};
use flexstack_core::frame::{MetaKey, Metadata};
use flexstack_core::stream::{FlowInfo, StreamEvent, StreamFrame, StreamKind};
use flexstack_core::{
    Batch, Direction, FaceDevice, Module, ModuleBuilder, ModuleInterface, ModuleVars, Output, Packet, Time, Value,
    VarSpec,
};
use flexstack_modules::stream::carrier::raw::{self, RawMode, RawPeers};
use flexstack_modules::stream::carrier::{self, wire, CarrierRequest, Config, FlowIds, Meters, Route, Router};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::socket::{connect, SockType, SockaddrStorage};
use rustls::{ClientConfig, ClientConnection, Connection, ServerConfig, ServerConnection};
use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most connections an accepting carrier holds (authenticated or not).
pub const MAX_CONNECTIONS: usize = 256;
/// A connection must authenticate and say hello within this time.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the module checks timers and refreshes its meters.
pub(crate) const PERIOD: Duration = Duration::from_millis(100);

const KICK: u64 = 0;
const LISTENER: u64 = 1;
const FIRST_CONN: u64 = 2;
/// The uplinks' link watch (connect mode with `uplinks`).
const WATCH: u64 = u64::MAX;
/// Most bytes a resumable session keeps to resend (what the other side has not said it took); beyond, the oldest
/// are forgotten, and a move that would need them aborts the flows instead.
pub const MAX_KEPT: usize = 64 << 20;
/// A resumable session tells the other side what it took once this much more came (and at every tick).
const TELL_EVERY: u64 = 256 << 10;
/// Output ports.
pub(crate) const STREAM: usize = 0;
pub(crate) const PASS: usize = 1;
const RAW: usize = 2;
const RAW_PASS: usize = 3;
const PEER_STREAM: usize = 4;
/// Input ports besides `stream_in` (0).
const RAW_IN: usize = 1;
const DEMUX: usize = 2;

/// Builds the carrier from what the kind read (the hook installed into `flexstack_modules::stream::carrier`).
pub(crate) fn build(req: CarrierRequest) -> Result<Builder<Inner>, String> {
    let id = identity().ok_or("no peer identity: the daemon makes one in its state directory when it starts")?;
    let mut uplinks = None;
    let mode = if req.cfg.peer.is_empty() {
        let addr = listen_of_cfg(&req.cfg)?;
        let listener = TcpListener::bind(addr).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        Mode::Accept {
            server: (listener, server_config(id)?),
            flows: HashMap::new(),
            next_local: 1,
            ids: req.cfg.ids.clone(),
        }
    } else {
        let peer = peer_of_cfg(&req.cfg)?;
        if !req.cfg.uplinks.is_empty() {
            uplinks = Some(Uplinks::new(&req.cfg.uplinks, peer.addr)?);
        }
        let tls = client_config(id, peer.fingerprint)?;
        Mode::Connect { peer, client: tls, router: Router::default(), retry_at: None, conn: None }
    };
    Ok(Builder { req, make: Box::new(move |cfg: &Config, m| tcp_device(mode, uplinks, cfg, m)) })
}

/// Connect mode: the peer of the carrier's settings, its port moved by `port_offset` (a carrier with several
/// transports has a port for each).
pub(crate) fn peer_of_cfg(cfg: &Config) -> Result<Peer, String> {
    let name = &cfg.peer;
    let mut peer = trust::get(name).ok_or_else(|| format!("no peer {name:?} (add it with `flexstack peer add`)"))?;
    peer.addr.set_port(peer.addr.port().wrapping_add(cfg.port_offset));
    Ok(peer)
}

/// Accept mode: the address to listen on, its port moved by `port_offset`.
pub(crate) fn listen_of_cfg(cfg: &Config) -> Result<std::net::SocketAddr, String> {
    let mut addr: std::net::SocketAddr = cfg.listen.parse().map_err(|e| format!("{e}"))?;
    addr.set_port(addr.port().wrapping_add(cfg.port_offset));
    Ok(addr)
}

/// The capabilities a carrier of transport `cfg.transport` announces in its `Hello`: its transport, and with
/// several, the others and `switch`.
pub(crate) fn caps(cfg: &Config) -> Vec<&'static str> {
    let mut v: Vec<&'static str> = cfg.offered().iter().map(|t| t.name()).collect();
    if cfg.switching() {
        v.push(wire::SWITCH_CAP);
    }
    if cfg.raw != RawMode::None {
        v.push(raw::RAW_CAP);
    }
    v
}

/// Hands a `Switch` to the chain side: a `Fin` whose extra bits carry [`SWITCH_MARK`], the flags and (in its
/// bytes) the offset. Only a carrier with several transports reads its transports' frames; it takes these.
pub(crate) fn switch_marker(local: u64, flags: u8, offset: u64) -> Ready {
    Ready {
        flow: local,
        kind: StreamKind::Fin,
        extra: SWITCH_MARK | u64::from(flags),
        bytes: offset.to_be_bytes().to_vec(),
    }
}

/// See [`switch_marker`].
pub(crate) const SWITCH_MARK: u64 = 1 << 40;

/// Makes a carrier's device from its meters, once the switch gives the module its variables.
pub(crate) type MakeDevice<E> = Box<dyn FnOnce(&Config, Meters) -> (Arc<EpollDevice<E>>, bool) + Send>;

/// The builder of a carrier over engine `E`: `make` returns the device and whether it connects.
pub(crate) struct Builder<E> {
    pub(crate) req: CarrierRequest,
    pub(crate) make: MakeDevice<E>,
}

impl<E: CarrierEngine> ModuleBuilder for Builder<E> {
    fn global_view(&self) -> bool {
        self.req.decl.global_view
    }

    fn interface(&self) -> ModuleInterface {
        self.req.interface.clone()
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        let Builder { req, make } = *self;
        req.decl.publish(&req.cfg, vars);
        let (device, connect) = make(&req.cfg, req.decl.meters(vars));
        Box::new(Carrier::new(device, req, connect))
    }
}

/// A carrier's epoll set with its kick (an eventfd, token 0: frames wait to be read).
pub(crate) fn epoll_with_kick() -> (Epoll, EventFd) {
    let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).expect("an epoll instance");
    let kick = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC).expect("an eventfd");
    epoll.add(&kick, EpollEvent::new(EpollFlags::EPOLLIN, KICK)).expect("the eventfd in the epoll set");
    (epoll, kick)
}

/// The tcp carrier's device.
fn tcp_device(mode: Mode, uplinks: Option<Uplinks>, cfg: &Config, m: Meters) -> (Arc<CarrierDevice>, bool) {
    let (epoll, kick) = epoll_with_kick();
    if let Some(u) = &uplinks {
        u.watch_in(&epoll, WATCH);
        u.init_meters(&m);
    }
    if let Mode::Accept { server: (listener, _), .. } = &mode {
        if let Err(e) = epoll.add(listener, EpollEvent::new(EpollFlags::EPOLLIN, LISTENER)) {
            tracing::error!(error = %e, "cannot watch the carrier's listener");
        }
    }
    let connect = matches!(mode, Mode::Connect { .. });
    let inner = Inner {
        refusal_log: LogLimit::default(),
        born: Vec::new(),
        gone: Vec::new(),
        mode,
        uplinks,
        conns: HashMap::new(),
        next_token: FIRST_CONN,
        ready: VecDeque::new(),
        cfg: cfg.clone(),
        m,
        epoll: Arc::new(epoll),
        kick,
        dir: if connect { Direction::Up } else { Direction::Down },
    };
    let dir = inner.dir;
    let epoll = inner.epoll.clone();
    let mut inner = inner;
    if connect {
        inner.connect(Instant::now());
    }
    (Arc::new(CarrierDevice::new(format!("carrier-{}", cfg.peer), dir, epoll, inner)), connect)
}

/// A frame ready to hand to the chain.
pub(crate) struct Ready {
    pub(crate) flow: u64,
    pub(crate) kind: StreamKind,
    pub(crate) extra: u64,
    pub(crate) bytes: Vec<u8>,
}

/// Hands the next ready frame to the data plane (its bytes in `buf`, flow and kind in `meta`); false if none.
pub(crate) fn pop_ready(ready: &mut VecDeque<Ready>, buf: &mut Vec<u8>, meta: &mut Metadata) -> bool {
    buf.clear();
    let Some(r) = ready.pop_front() else { return false };
    buf.extend_from_slice(&r.bytes);
    *meta = Metadata::default();
    meta.set(MetaKey::FLOW_ID, r.flow);
    meta.set(MetaKey::STREAM, r.kind as u64 | r.extra << 8);
    true
}

/// A flow of an accepting carrier: whose it is, and which directions saw `Fin`.
pub(crate) struct Accepted<H> {
    pub(crate) token: H,
    pub(crate) remote: u64,
    pub(crate) fins: (bool, bool),
}

type Mode = Modes<Arc<ClientConfig>, (TcpListener, Arc<ServerConfig>), u64>;

/// A carrier's mode and its flows, whatever its transport: `C` is what connects (a TLS configuration), `S` what
/// accepts (a listener and TLS), `H` names a connection.
pub(crate) enum Modes<C, S, H> {
    Connect {
        peer: Peer,
        client: C,
        router: Router,
        /// Down (a connection failed): no new attempt before this.
        retry_at: Option<Instant>,
        /// The connection.
        conn: Option<H>,
    },
    Accept {
        server: S,
        /// Local flow id -> its connection and the peer's id.
        flows: HashMap<u64, Accepted<H>>,
        next_local: u64,
        /// With several transports: the ids they share.
        ids: Option<FlowIds>,
    },
}

impl<C, S, H: Copy + PartialEq> Modes<C, S, H> {
    pub(crate) fn router(&mut self) -> Option<&mut Router> {
        match self {
            Modes::Connect { router, .. } => Some(router),
            Modes::Accept { .. } => None,
        }
    }

    /// The flows ended since the module last looked (`gone`, and the router's).
    pub(crate) fn take_gone(&mut self, gone: &mut Vec<u64>) -> Vec<u64> {
        if let Modes::Connect { router, .. } = self {
            gone.append(&mut router.gone);
        }
        std::mem::take(gone)
    }

    /// Flows carried now.
    pub(crate) fn active(&self) -> usize {
        match self {
            Modes::Connect { router, .. } => router.len(),
            Modes::Accept { flows, .. } => flows.len(),
        }
    }

    /// The name of the peer flow `id` goes to: connecting, the peer; accepting, its connection's (`conn_peer`).
    pub(crate) fn peer_of(&self, id: u64, conn_peer: impl Fn(&H) -> Option<String>) -> String {
        match self {
            Modes::Connect { peer, .. } => peer.name.clone(),
            Modes::Accept { flows, .. } => flows.get(&id).and_then(|f| conn_peer(&f.token)).unwrap_or_default(),
        }
    }

    /// Connecting: the peer's counts in the table (`flexstack peer list`).
    pub(crate) fn report_counts(&self, m: &Meters) {
        if let Modes::Connect { peer, .. } = self {
            let (active, bin, bout) = (self.active() as u64, m.bytes_in.get(), m.bytes_out.get());
            report(&peer.name, |s| {
                s.flows_active = active;
                s.bytes_in = bin;
                s.bytes_out = bout;
            });
        }
    }

    /// Connection `h` ended; `remote` are its flows' local ids (accepting). Returns the flows to abort towards the
    /// chain (connecting: every flow, if `h` was the connection), forgotten (`gone`).
    pub(crate) fn conn_ended(&mut self, h: H, remote: Vec<u64>, gone: &mut Vec<u64>) -> Vec<u64> {
        match self {
            Modes::Connect { router, conn, .. } if *conn == Some(h) => {
                *conn = None;
                router.drain()
            }
            Modes::Connect { .. } => Vec::new(),
            Modes::Accept { flows, .. } => {
                for id in &remote {
                    flows.remove(id);
                }
                gone.extend(&remote);
                remote
            }
        }
    }

    /// Accepting: a new flow of connection `token`, `remote` by the peer's numbering; returns its local id.
    pub(crate) fn new_flow(&mut self, token: H, remote: u64) -> u64 {
        let Modes::Accept { flows, next_local, ids, .. } = self else { return 0 };
        let local = match ids {
            Some(ids) => ids.next(),
            None => {
                *next_local += 1;
                *next_local - 1
            }
        };
        flows.insert(local, Accepted { token, remote, fins: (false, false) });
        local
    }

    /// Accepting: a frame of flow `local` from the peer (`up`: false) or the chain (true). True when it ends the
    /// flow (its `Abort`, or the second `Fin`), which is then forgotten (`gone`).
    pub(crate) fn accepted_ends(&mut self, local: u64, kind: StreamKind, up: bool, gone: &mut Vec<u64>) -> bool {
        let Modes::Accept { flows, .. } = self else { return false };
        let done = match kind {
            StreamKind::Abort => true,
            StreamKind::Fin => flows.get_mut(&local).is_some_and(|f| {
                if up {
                    f.fins.1 = true;
                    f.fins.0
                } else {
                    f.fins.0 = true;
                    f.fins.1
                }
            }),
            _ => false,
        };
        if done && flows.remove(&local).is_some() {
            gone.push(local);
        }
        done
    }
}

impl<C, S, H: Copy + PartialEq> Modes<C, S, H> {
    /// A `Switch` of the peer's flow `flow` (`peer`'s) on connection `token`, which carries `remote`: the local id
    /// to hand its marker to the chain side with, `None` for a flow not known (an orphan). Accepting, a flow that
    /// starts on this transport is known by the id its peer's flow has on the others ([`FlowIds`]).
    pub(crate) fn peer_switch(
        &mut self,
        token: H,
        remote: &mut HashMap<u64, u64>,
        peer: &str,
        flow: u64,
        flags: u8,
    ) -> Option<u64> {
        match self {
            Modes::Connect { router, .. } => router.carries(flow).then_some(flow),
            Modes::Accept { flows, ids, .. } => {
                if let Some(&local) = remote.get(&flow) {
                    return Some(local);
                }
                if flags & wire::SWITCH_END != 0 {
                    return None;
                }
                let local = ids.as_ref()?.lookup(peer, flow)?;
                flows.insert(local, Accepted { token, remote: flow, fins: (false, false) });
                remote.insert(flow, local);
                Some(local)
            }
        }
    }

    /// Accepting: the flows of connection `from` are on `to` from now on (a resumed session).
    pub(crate) fn retarget(&mut self, from: H, to: H) {
        if let Modes::Accept { flows, .. } = self {
            for f in flows.values_mut().filter(|f| f.token == from) {
                f.token = to;
            }
        }
    }

    /// Forgets flow `local` (it moved to another transport): its connection and id there, if it has one.
    pub(crate) fn detach(&mut self, local: u64) -> Option<(H, u64)> {
        match self {
            Modes::Connect { router, conn, .. } => {
                router.detach(local);
                conn.map(|h| (h, local))
            }
            Modes::Accept { flows, .. } => flows.remove(&local).map(|a| (a.token, a.remote)),
        }
    }

    /// Where flow `local` goes: its connection and its id there (connecting: the connection, the same id).
    pub(crate) fn target(&self, local: u64) -> Option<(H, u64)> {
        match self {
            Modes::Connect { conn, .. } => conn.map(|h| (h, local)),
            Modes::Accept { flows, .. } => flows.get(&local).map(|a| (a.token, a.remote)),
        }
    }

    /// A frame of the peer's flow `flow` (its id in messages) on a connection that carries `remote` (accepting: the
    /// peer's id -> local): the id to hand it to the chain with and whether it ends the flow (then forgotten, and
    /// `gone` when accepting); `None` for a flow not known (an orphan).
    pub(crate) fn peer_frame(
        &mut self,
        remote: &mut HashMap<u64, u64>,
        flow: u64,
        kind: StreamKind,
        gone: &mut Vec<u64>,
    ) -> Option<(u64, bool)> {
        match self {
            Modes::Connect { router, .. } => router.up(flow, kind).then(|| (flow, !router.carries(flow))),
            Modes::Accept { .. } => {
                let local = *remote.get(&flow)?;
                let ended = self.accepted_ends(local, kind, false, gone);
                if ended {
                    remote.remove(&flow);
                }
                Some((local, ended))
            }
        }
    }

    /// Accepting: the peer's `Open` of `flow` on connection `token` (which carries `remote`). `Ok(Err(abort))`:
    /// refused at `max` flows, the answer to send; `Ok(Ok((local, info)))`: the flow is carried (counted, its
    /// meters due in `born`). A flow opened twice or an open that does not decode is malformed.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn accept_open(
        &mut self,
        token: H,
        remote: &mut HashMap<u64, u64>,
        flow: u64,
        bytes: &[u8],
        max: u64,
        m: &Meters,
        born: &mut Vec<(u64, String)>,
    ) -> Result<Result<(u64, FlowInfo), Vec<u8>>, End> {
        if let Some(abort) = check_open(remote, flow, max, m)? {
            return Ok(Err(abort));
        }
        let info = FlowInfo::decode(bytes).map_err(|e| End::Malformed(format!("open: {e}")))?;
        let local = self.new_flow(token, flow);
        remote.insert(flow, local);
        m.flows.add(1);
        born.push((local, carrier::tuple(&info)));
        Ok(Ok((local, info)))
    }
}

/// Hands each whole message at the start of `plain` to `on`, with its length (counted in `messages_in_total` and
/// `bytes_in_total`) until one is incomplete or `on` fails; returns the bytes used and why it stopped (a message that does not decode
/// is malformed: see [`End::before_hello`]).
pub(crate) fn each_message(
    plain: &[u8],
    m: &Meters,
    mut on: impl FnMut(wire::Message<'_>, usize) -> Result<(), End>,
) -> (usize, Result<(), End>) {
    let mut at = 0;
    loop {
        let (msg, used) = match wire::decode(&plain[at..]) {
            Ok(Some(x)) => x,
            Ok(None) => return (at, Ok(())),
            Err(e) => return (at, Err(End::Malformed(e.to_string()))),
        };
        m.frames_in.add(1);
        m.bytes_in.add(used as u64);
        at += used;
        if let Err(e) = on(msg, used) {
            return (at, Err(e));
        }
    }
}

/// Checks that the first message of a connection is a `Hello` of this version (a refusal otherwise); `peer` (if
/// known) offers what it lists (kept in the peer table for a carrier that switches flows).
pub(crate) fn check_hello(m: &wire::Message<'_>, peer: &str) -> Result<(), End> {
    let wire::Message::Hello { version, caps } = m else {
        return Err(End::Refused("the first message is not a hello".into()));
    };
    if *version != wire::VERSION {
        return Err(End::Refused(format!("version {version}, this daemon speaks {}", wire::VERSION)));
    }
    if !peer.is_empty() {
        report(peer, |s| s.caps.clone_from(caps));
    }
    Ok(())
}

/// A `Switch` where the carrier does not take them (it has one transport, so it did not offer `switch`).
pub(crate) fn switch_unasked(cfg: &Config) -> Result<(), End> {
    if cfg.switching() {
        Ok(())
    } else {
        Err(End::Malformed("a switch, not offered".into()))
    }
}

/// Accepting: checks an `Open` of the peer's flow `flow` on a connection that carries `remote` (peer's id -> local).
/// A flow opened twice is malformed; beyond `max` flows, the answer to send, `Abort(limit)` (counted).
pub(crate) fn check_open(remote: &HashMap<u64, u64>, flow: u64, max: u64, m: &Meters) -> Result<Option<Vec<u8>>, End> {
    if remote.contains_key(&flow) {
        return Err(End::Malformed(format!("flow {flow} opened twice")));
    }
    if remote.len() as u64 >= max {
        m.flows_limited.add(1);
        let mut b = Vec::new();
        wire::frame(&mut b, flow, StreamKind::Abort, 0, b"limit");
        return Ok(Some(b));
    }
    Ok(None)
}

/// Counts and logs a connection's end (at most one line a second for refusals); returns why, as logged.
pub(crate) fn log_end(
    m: &Meters,
    log: &mut LogLimit,
    end: &End,
    up: bool,
    peer: &str,
    addr: &dyn std::fmt::Debug,
) -> String {
    let why = match end {
        End::Refused(w) => {
            m.refusals.add(1);
            w.clone()
        }
        End::Malformed(w) => {
            m.malformed.add(1);
            format!("malformed input: {w}")
        }
        End::Closed(w) => w.clone(),
    };
    let peer = if peer.is_empty() { "unknown" } else { peer };
    if up {
        m.connections_active.set(m.connections_active.get().saturating_sub(1));
        tracing::info!(peer = %peer, "carrier connection closed: {why}");
    } else if log.allow(Instant::now()) {
        let more = std::mem::take(&mut log.suppressed);
        tracing::warn!(peer = %peer, addr = ?addr, suppressed = more, "carrier connection refused: {why}");
    } else {
        log.suppressed += 1;
    }
    why
}

struct Conn {
    sock: TcpStream,
    tls: Connection,
    /// Bytes decrypted and not decoded yet.
    plain: Vec<u8>,
    /// The peer's name (accepting: known once authenticated).
    peer: String,
    /// Authenticated and hello received.
    up: bool,
    /// The TCP connect has not completed yet.
    connecting: bool,
    since: Instant,
    /// EPOLLOUT is in its interest set.
    want_out: bool,
    /// Accepting: the peer's flow id -> the local one.
    remote: HashMap<u64, u64>,
    /// The resumable session it carries (connect mode with `uplinks`, and its accepting side once asked).
    session: Option<Session>,
}

/// A resumable session (docs/peers.md, "Several uplinks"): the stream of `Frame` and `Switch` messages each side
/// sends, numbered by bytes, outlives the connection that carries it. Each side keeps what it sent until the other
/// says it took it (`Received`); a new connection says how much of the other's stream it took (`Resume`), and each
/// side sends again from there: no message lost, none twice, in order.
struct Session {
    id: u64,
    /// Bytes of this side's stream sent (queued) since the session began.
    sent: u64,
    /// The last of them, that the other side may not have taken: from `sent - kept.len()` to `sent`.
    kept: VecDeque<u8>,
    /// Bytes of the other side's stream taken.
    received: u64,
    /// `received` as last told.
    told: u64,
    /// A resumed connection before the other side's `Resume`: what is sent is only kept.
    held: bool,
}

impl Session {
    fn new(id: u64) -> Session {
        Session { id, sent: 0, kept: VecDeque::new(), received: 0, told: 0, held: false }
    }

    /// Queues stream bytes: kept, the oldest forgotten beyond [`MAX_KEPT`].
    fn keep(&mut self, bytes: &[u8]) {
        self.sent += bytes.len() as u64;
        self.kept.extend(bytes);
        if self.kept.len() > MAX_KEPT {
            let over = self.kept.len() - MAX_KEPT;
            self.kept.drain(..over);
        }
    }

    /// Where what is kept starts (bytes before it were taken, or forgotten beyond [`MAX_KEPT`]).
    fn from(&self) -> u64 {
        self.sent - self.kept.len() as u64
    }

    /// The other side took the stream up to `offset` (`Received`): what is kept before it is forgotten. An offset
    /// beyond what was sent is an error.
    fn took(&mut self, offset: u64) -> Result<(), String> {
        if offset > self.sent {
            return Err(format!("the peer took {offset} bytes of the session, more than the {} sent", self.sent));
        }
        let from = self.from();
        if offset > from {
            self.kept.drain(..(offset - from) as usize);
        }
        Ok(())
    }

    /// A new connection, whose other side took the stream up to `offset` (`Resume`): what is kept is then what to
    /// send again. An error if that needs bytes already forgotten.
    fn resume_from(&mut self, offset: u64) -> Result<(), String> {
        if offset < self.from() {
            return Err(format!("the peer took {offset} bytes of the session; those from {} on are kept", self.from()));
        }
        self.took(offset)
    }
}

/// Why a connection ended: before authentication (a refusal), for bad input, or otherwise.
pub(crate) enum End {
    Refused(String),
    Malformed(String),
    Closed(String),
}

impl End {
    /// Before the peer said hello, input that is not the protocol is a refusal (nothing was authenticated).
    pub(crate) fn before_hello(self, up: bool) -> End {
        match self {
            End::Malformed(w) if !up => End::Refused(format!("no hello: {w}")),
            e => e,
        }
    }
}

/// At most one log line a second for refused connections (a flood of them must not flood the log); the next line
/// says how many were left out.
#[derive(Default)]
pub(crate) struct LogLimit {
    last: Option<Instant>,
    pub(crate) suppressed: u64,
}

impl LogLimit {
    pub(crate) fn allow(&mut self, now: Instant) -> bool {
        if self.last.is_some_and(|t| now.duration_since(t) < Duration::from_secs(1)) {
            return false;
        }
        self.last = Some(now);
        true
    }
}

pub(crate) struct Inner {
    refusal_log: LogLimit,
    /// Flows carried since the module last looked, with their tuple (it registers their meters), and flows ended.
    born: Vec<(u64, String)>,
    gone: Vec<u64>,
    mode: Mode,
    /// Connect mode with `uplinks`: the uplinks, and which one the connection leaves from.
    uplinks: Option<Uplinks>,
    conns: HashMap<u64, Conn>,
    next_token: u64,
    ready: VecDeque<Ready>,
    cfg: Config,
    m: Meters,
    epoll: Arc<Epoll>,
    kick: EventFd,
    dir: Direction,
}

/// A non-blocking TCP connection to `addr`, from local address `from` if given (an uplink's).
fn tcp_connect(addr: SocketAddr, from: Option<IpAddr>) -> std::io::Result<TcpStream> {
    let fd = crate::sock::socket_for(addr, SockType::Stream, from)?;
    match connect(fd.as_raw_fd(), &SockaddrStorage::from(addr)) {
        Ok(()) | Err(nix::errno::Errno::EINPROGRESS) => {}
        Err(e) => return Err(e.into()),
    }
    let s = TcpStream::from(fd);
    let _ = s.set_nodelay(true);
    Ok(s)
}

/// Tells the other side how much of its session stream connection `c` took (`Received`).
fn tell(c: &mut Conn) -> Result<(), End> {
    let Some(s) = &mut c.session else { return Ok(()) };
    let mut b = Vec::new();
    wire::received(&mut b, s.received);
    s.told = s.received;
    c.send_ctl(&b)
}

/// A new session's id: random (the peer tells its sessions apart by it, among those of the same authenticated peer).
fn session_id() -> u64 {
    let mut b = [0u8; 8];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b);
    u64::from_le_bytes(b)
}

impl Conn {
    fn new(sock: TcpStream, tls: Connection, peer: String, connecting: bool) -> Conn {
        Conn {
            sock,
            tls,
            plain: Vec::new(),
            peer,
            up: false,
            connecting,
            since: Instant::now(),
            want_out: true,
            remote: HashMap::new(),
            session: None,
        }
    }

    /// Reads what the socket holds through TLS into `plain`; true at the end of the stream.
    fn read(&mut self) -> Result<bool, End> {
        let before = self.up;
        let end = |m: String| if before { End::Closed(m) } else { End::Refused(m) };
        loop {
            match self.tls.read_tls(&mut self.sock) {
                Ok(0) => return Ok(true),
                Ok(_) => {
                    let st = self.tls.process_new_packets().map_err(|e| {
                        let _ = self.tls.write_tls(&mut self.sock); // the alert, if it fits
                        End::Refused(format!("TLS: {e}"))
                    })?;
                    let n = st.plaintext_bytes_to_read();
                    if n > 0 {
                        let at = self.plain.len();
                        self.plain.resize(at + n, 0);
                        self.tls.reader().read_exact(&mut self.plain[at..]).map_err(|e| end(e.to_string()))?;
                    }
                    if st.peer_has_closed() {
                        return Ok(true);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(end(e.to_string())),
            }
        }
    }

    /// Writes what TLS holds as far as the socket takes it.
    fn flush(&mut self) -> Result<(), End> {
        while self.tls.wants_write() {
            match self.tls.write_tls(&mut self.sock) {
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(if self.up { End::Closed(e.to_string()) } else { End::Refused(e.to_string()) }),
            }
        }
        Ok(())
    }

    /// Queues `bytes` (encoded `Frame` and `Switch` messages: the session's stream) for the peer; a resumable
    /// session keeps a copy (and a resumed connection only that, until the other side's `Resume`).
    fn send(&mut self, bytes: &[u8]) -> Result<(), End> {
        if let Some(s) = &mut self.session {
            s.keep(bytes);
            if s.held {
                return Ok(());
            }
        }
        self.send_ctl(bytes)
    }

    /// Queues `bytes` (messages of the connection: `Hello`, `Resume`, `Received`, `Close`) for the peer.
    fn send_ctl(&mut self, bytes: &[u8]) -> Result<(), End> {
        let _ = self.tls.writer().write_all(bytes);
        if self.tls.wants_write() && !self.connecting {
            self.flush()?;
        }
        Ok(())
    }
}

impl Inner {
    fn kick(&self) {
        if !self.ready.is_empty() {
            let _ = self.kick.write(1);
        }
    }

    fn push(&mut self, flow: u64, kind: StreamKind, extra: u64, bytes: &[u8]) {
        self.ready.push_back(Ready { flow, kind, extra, bytes: bytes.to_vec() });
    }

    fn add_conn(&mut self, c: Conn) -> u64 {
        let token = self.next_token;
        self.next_token += 1;
        let flags = EpollFlags::EPOLLIN | EpollFlags::EPOLLOUT | EpollFlags::EPOLLRDHUP;
        if let Err(e) = self.epoll.add(&c.sock, EpollEvent::new(flags, token)) {
            tracing::error!(error = %e, "cannot watch a carrier connection");
        }
        self.conns.insert(token, c);
        token
    }

    /// Connect mode: opens the connection (if none and not waiting to retry).
    fn connect(&mut self, now: Instant) {
        let Mode::Connect { peer, retry_at, conn, .. } = &mut self.mode else { return };
        if conn.is_some() || retry_at.is_some_and(|t| now < t) {
            return;
        }
        let name = peer.name.clone();
        // With uplinks, a resumable session (a new one: its id, nothing sent or taken yet).
        let session = self.uplinks.as_ref().map(|_| Session::new(session_id()));
        match self.open(session) {
            Ok(token) => {
                if let Mode::Connect { conn, .. } = &mut self.mode {
                    *conn = Some(token);
                }
                report(&name, |s| s.state = "connecting".into());
            }
            Err(e) => self.connect_failed(now, &e),
        }
    }

    /// Connect mode: a connection to the peer (from the active uplink, if any) with its `Hello` queued, and with
    /// `session`, its `Resume`; returns its token.
    fn open(&mut self, session: Option<Session>) -> Result<u64, String> {
        let Mode::Connect { peer, client: tls, .. } = &self.mode else { return Err("not connecting".into()) };
        let (addr, name, tls) = (peer.addr, peer.name.clone(), tls.clone());
        let from = self.uplinks.as_ref().map(Uplinks::addr);
        let sock = tcp_connect(addr, from).map_err(|e| e.to_string())?;
        let tls = ClientConnection::new(tls, server_name()).map_err(|e| e.to_string())?;
        let mut tls = Connection::Client(tls);
        tls.set_buffer_limit(None);
        let mut first = Vec::new();
        wire::hello(&mut first, &caps(&self.cfg));
        if let Some(s) = &session {
            wire::resume(&mut first, s.id, s.received);
        }
        let _ = tls.writer().write_all(&first);
        let mut c = Conn::new(sock, tls, name, true);
        c.session = session;
        Ok(self.add_conn(c))
    }

    /// Connect mode: the active uplink went. The connection is dropped (its flows stay) and its session resumed on
    /// a new one from the uplink now active; without a session (no connection yet), the next connects from there.
    fn move_uplink(&mut self) {
        let Mode::Connect { conn: Some(old), .. } = self.mode else { return };
        let Some(mut session) = self.conns.get_mut(&old).and_then(|c| c.session.take()) else { return };
        session.held = true;
        let received = session.received;
        match self.open(Some(session)) {
            Ok(token) => {
                self.drop_conn(old);
                if let Mode::Connect { conn, peer, .. } = &mut self.mode {
                    *conn = Some(token);
                    tracing::info!(peer = %peer.name, received, "tcp carrier: resuming the session from the new uplink");
                }
            }
            Err(e) => self.close(old, End::Closed(format!("cannot connect from the new uplink: {e}"))),
        }
    }

    /// Connection `token` (`c`) ended: its flows are aborted towards the chain.
    fn abort_flows(&mut self, token: u64, c: &Conn) {
        let aborted = self.mode.conn_ended(token, c.remote.values().copied().collect(), &mut self.gone);
        self.m.flows_aborted.add(aborted.len() as u64);
        for id in aborted {
            self.push(id, StreamKind::Abort, 0, b"unreachable");
        }
    }

    /// Forgets connection `token` without touching its flows (its session moved to another connection).
    fn drop_conn(&mut self, token: u64) -> Option<Conn> {
        let c = self.conns.remove(&token)?;
        let _ = self.epoll.delete(&c.sock);
        let _ = c.sock.shutdown(std::net::Shutdown::Both);
        if c.up {
            self.m.connections_active.set(self.m.connections_active.get().saturating_sub(1));
        }
        Some(c)
    }

    fn connect_failed(&mut self, now: Instant, why: &str) {
        let retry = Duration::from_millis(self.cfg.retry_ms);
        if let Mode::Connect { peer, retry_at, conn, .. } = &mut self.mode {
            *retry_at = Some(now + retry);
            *conn = None;
            tracing::warn!(peer = %peer.name, addr = %peer.addr, "carrier to the peer is down: {why}");
            report(&peer.name, |s| s.state = format!("down: {why}"));
        }
    }

    /// Closes connection `token` and aborts its flows.
    fn close(&mut self, token: u64, end: End) {
        let Some(mut c) = self.conns.remove(&token) else { return };
        let _ = self.epoll.delete(&c.sock);
        if matches!(end, End::Malformed(_)) {
            let mut bye = Vec::new();
            wire::close(&mut bye, "malformed");
            let _ = c.send_ctl(&bye);
            let _ = c.flush();
        }
        let addr = c.sock.peer_addr().ok();
        let why = log_end(&self.m, &mut self.refusal_log, &end, c.up, &c.peer, &addr);
        let _ = c.sock.shutdown(std::net::Shutdown::Both);
        let now = Instant::now();
        self.abort_flows(token, &c);
        if matches!(self.mode, Mode::Connect { .. }) {
            self.connect_failed(now, &why);
        }
        self.kick();
    }

    /// Handles the epoll events waiting, without blocking.
    fn poll_events(&mut self) {
        let mut events = [EpollEvent::empty(); 64];
        let n = self.epoll.wait(&mut events, EpollTimeout::ZERO).unwrap_or(0);
        for ev in &events[..n] {
            match ev.data() {
                KICK => {
                    let _ = self.kick.read();
                }
                LISTENER => self.accept_all(),
                WATCH => {
                    if self.uplinks.as_mut().is_some_and(|u| u.moved(Instant::now(), &self.m)) {
                        self.move_uplink();
                    }
                }
                token => self.service(token, ev.events()),
            }
        }
    }

    fn accept_all(&mut self) {
        loop {
            let Mode::Accept { server: (listener, tls), .. } = &self.mode else { return };
            let (sock, from) = match listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "carrier: accept failed");
                    return;
                }
            };
            if self.conns.len() >= MAX_CONNECTIONS {
                self.m.refusals.add(1);
                tracing::warn!(%from, "carrier: too many connections, refused");
                continue;
            }
            let tls = tls.clone();
            let _ = sock.set_nonblocking(true);
            let _ = sock.set_nodelay(true);
            match ServerConnection::new(tls) {
                Ok(mut c) => {
                    c.set_buffer_limit(None);
                    self.add_conn(Conn::new(sock, Connection::Server(c), String::new(), false));
                }
                Err(e) => tracing::error!(error = %e, "carrier: TLS"),
            }
        }
    }

    /// A connection is readable or writable.
    fn service(&mut self, token: u64, flags: EpollFlags) {
        let Some(c) = self.conns.get_mut(&token) else { return };
        if c.connecting {
            if !flags.intersects(EpollFlags::EPOLLOUT | EpollFlags::EPOLLERR | EpollFlags::EPOLLHUP) {
                return;
            }
            match c.sock.take_error() {
                Ok(None) => c.connecting = false,
                Ok(Some(e)) | Err(e) => return self.close(token, End::Closed(format!("cannot connect: {e}"))),
            }
        }
        let r = c.flush().and_then(|()| c.read());
        let eof = match r {
            Ok(eof) => eof,
            Err(end) => return self.close(token, end),
        };
        if let Err(end) = self.take_messages(token) {
            return self.close(token, end);
        }
        let Some(c) = self.conns.get_mut(&token) else { return };
        if let Err(end) = c.flush() {
            return self.close(token, end);
        }
        if eof {
            let end = if c.up {
                End::Closed("the peer closed".into())
            } else {
                End::Refused("closed in the handshake".into())
            };
            return self.close(token, end);
        }
        let want = c.tls.wants_write();
        if want != c.want_out {
            c.want_out = want;
            let mut f = EpollFlags::EPOLLIN | EpollFlags::EPOLLRDHUP;
            if want {
                f |= EpollFlags::EPOLLOUT;
            }
            let _ = self.epoll.modify(&c.sock, &mut EpollEvent::new(f, token));
        }
        self.kick();
    }

    /// Decodes the messages connection `token` brought.
    fn take_messages(&mut self, token: u64) -> Result<(), End> {
        let Some(c) = self.conns.get_mut(&token) else { return Ok(()) };
        let plain = std::mem::take(&mut c.plain);
        let m = self.m.clone();
        let (at, result) = each_message(&plain, &m, |msg, used| self.message(token, msg, used));
        if at > 0 && matches!(self.mode, Mode::Connect { conn: Some(t), .. } if t == token) {
            if let Some(u) = &mut self.uplinks {
                u.received(u.active(), Instant::now(), &self.m);
            }
        }
        let Some(c) = self.conns.get_mut(&token) else { return result };
        c.plain = plain[at..].to_vec();
        if let Some(s) = &mut c.session {
            if s.received - s.told >= TELL_EVERY {
                tell(c)?;
            }
        }
        result.map_err(|e| e.before_hello(c.up))
    }

    /// Message `m` (`used` bytes) of connection `token`: a stream message counts in its session.
    fn message(&mut self, token: u64, m: wire::Message<'_>, used: usize) -> Result<(), End> {
        let Some(mut c) = self.conns.remove(&token) else { return Ok(()) };
        let stream = m.in_stream();
        let r = self.message_on(&mut c, token, m);
        if let (true, Some(s)) = (stream && r.is_ok(), &mut c.session) {
            s.received += used as u64;
        }
        self.conns.insert(token, c);
        r
    }

    /// A `Resume` on connection `c` (`token`), after the hellos. Connecting: the peer's answer, from where to send
    /// again. Accepting: a new session (`received` 0), or one that moved here from another connection of the same
    /// peer, which is dropped (its flows come here); the answer, then what the peer has not taken.
    fn resume(&mut self, c: &mut Conn, token: u64, id: u64, received: u64) -> Result<(), End> {
        if matches!(self.mode, Mode::Connect { .. }) {
            let Some(s) = c.session.as_mut().filter(|s| s.id == id) else {
                return Err(End::Malformed("a resume of another session".into()));
            };
            s.resume_from(received).map_err(End::Closed)?;
            if std::mem::take(&mut s.held) {
                let again: Vec<u8> = s.kept.iter().copied().collect();
                c.send_ctl(&again)?;
            }
            return Ok(());
        }
        if c.session.is_some() {
            return Err(End::Malformed("a second resume".into()));
        }
        let old = self
            .conns
            .iter()
            .find(|(t, o)| **t != token && o.peer == c.peer && o.session.as_ref().is_some_and(|s| s.id == id))
            .map(|(t, _)| *t);
        let mut session = match old {
            None if received == 0 => Session::new(id),
            None => return Err(End::Closed("the peer resumes a session this daemon does not know".into())),
            Some(old) => {
                let mut o = self.drop_conn(old).expect("the connection found");
                let mut s = o.session.take().expect("a session");
                if let Err(e) = s.resume_from(received) {
                    // Its flows cannot go on: aborted as when a connection goes.
                    self.abort_flows(old, &o);
                    return Err(End::Closed(format!("cannot resume: {e}")));
                }
                c.remote = std::mem::take(&mut o.remote);
                self.mode.retarget(old, token);
                self.m.migrations.add(1);
                tracing::info!(peer = %c.peer, received, "tcp carrier: the peer resumed its session on a new connection");
                s
            }
        };
        let mut answer = Vec::new();
        wire::resume(&mut answer, id, session.received);
        session.told = session.received;
        answer.extend(session.kept.iter());
        c.session = Some(session);
        c.send_ctl(&answer)
    }

    fn message_on(&mut self, c: &mut Conn, token: u64, m: wire::Message<'_>) -> Result<(), End> {
        if !c.up {
            check_hello(&m, &c.peer)?;
            if c.peer.is_empty() {
                // Accepting: who it is (the verifier let only peers of the table through).
                let fp = c.tls.peer_certificates().and_then(|v| v.first()).map(|d| trust::fingerprint_of(d));
                let Some(name) = fp.and_then(|fp| trust::by_fingerprint(&fp)) else {
                    return Err(End::Refused("not a peer (removed?)".into()));
                };
                c.peer = name;
                let mut hello = Vec::new();
                wire::hello(&mut hello, &caps(&self.cfg));
                self.m.bytes_out.add(hello.len() as u64);
                self.m.frames_out.add(1);
                c.send(&hello)?;
            }
            c.up = true;
            self.m.connections.add(1);
            self.m.connections_active.add(1);
            let peer = c.peer.clone();
            tracing::info!(peer = %peer, "carrier connection up");
            report(&peer, |s| {
                s.state = "connected".into();
                s.connections += 1;
            });
            return Ok(());
        }
        let (flow, kind, ack, bytes) = match m {
            wire::Message::Hello { .. } => return Err(End::Malformed("a second hello".into())),
            wire::Message::Close { reason } => return Err(End::Closed(format!("the peer closed: {reason}"))),
            wire::Message::Switch { flow, flags, offset } => {
                switch_unasked(&self.cfg)?;
                match self.mode.peer_switch(token, &mut c.remote, &c.peer, flow, flags) {
                    Some(local) => self.ready.push_back(switch_marker(local, flags, offset)),
                    None => self.m.orphans.add(1),
                }
                return Ok(());
            }
            wire::Message::Resume { session, received } => return self.resume(c, token, session, received),
            wire::Message::Received { offset } => {
                let Some(s) = &mut c.session else { return Err(End::Malformed("received, with no session".into())) };
                return s.took(offset).map_err(End::Malformed);
            }
            wire::Message::Frame { flow, kind, ack, bytes } => (flow, kind, ack, bytes),
        };
        let max = self.cfg.max_flows;
        match &mut self.mode {
            Mode::Connect { router, .. } => {
                if router.up(flow, kind) {
                    self.push(flow, kind, ack, bytes);
                } else {
                    self.m.orphans.add(1);
                }
            }
            Mode::Accept { .. } => {
                if kind == StreamKind::Open {
                    if let Some(abort) = check_open(&c.remote, flow, max, &self.m)? {
                        return c.send(&abort);
                    }
                    let local = self.mode.new_flow(token, flow);
                    c.remote.insert(flow, local);
                    self.m.flows.add(1);
                    let tuple = FlowInfo::decode(bytes).map(|i| carrier::tuple(&i)).unwrap_or_default();
                    self.born.push((local, tuple));
                    self.push(local, kind, ack, bytes);
                    return Ok(());
                }
                let Some(&local) = c.remote.get(&flow) else {
                    self.m.orphans.add(1);
                    return Ok(());
                };
                if self.mode.accepted_ends(local, kind, false, &mut self.gone) {
                    c.remote.remove(&flow);
                }
                self.push(local, kind, ack, bytes);
            }
        }
        Ok(())
    }

    /// Frames from the chain to the peer(s).
    fn write_frames(&mut self, packets: &[&Packet]) {
        let now = Instant::now();
        let mut out: HashMap<u64, Vec<u8>> = HashMap::new();
        for p in packets {
            let (Some(flow), Some(kind)) = (p.stream_flow(), p.stream_kind()) else {
                self.m.orphans.add(1);
                continue;
            };
            let extra = p.meta().get(MetaKey::STREAM).unwrap_or(0) >> 8;
            // Where it goes: the connection, and the id the peer knows the flow by.
            let target = match &mut self.mode {
                Mode::Connect { conn, .. } => {
                    if kind == StreamKind::Open {
                        self.m.flows.add(1);
                    }
                    (*conn).map(|t| (t, flow))
                }
                Mode::Accept { flows, .. } => {
                    let Some(f) = flows.get(&flow) else {
                        self.m.orphans.add(1);
                        continue;
                    };
                    let t = (f.token, f.remote);
                    if self.mode.accepted_ends(flow, kind, true, &mut self.gone) {
                        if let Some(c) = self.conns.get_mut(&t.0) {
                            c.remote.remove(&t.1);
                        }
                    }
                    Some(t)
                }
            };
            let Some((token, remote)) = target else {
                // Connect mode, no connection: try (again), and answer the flow at once if it cannot be carried.
                if kind == StreamKind::Open {
                    self.connect(now);
                    let conn = match &self.mode {
                        Mode::Connect { conn, .. } => *conn,
                        Mode::Accept { .. } => None,
                    };
                    if let Some(t) = conn {
                        let b = out.entry(t).or_default();
                        wire::frame(b, flow, kind, 0, p.data());
                        continue;
                    }
                }
                if let Mode::Connect { router, .. } = &mut self.mode {
                    if router.up(flow, StreamKind::Abort) {
                        self.m.flows_aborted.add(1);
                        self.push(flow, StreamKind::Abort, 0, b"unreachable");
                    }
                }
                continue;
            };
            let b = out.entry(token).or_default();
            if kind == StreamKind::Data && p.len() > wire::MAX_DATA {
                for chunk in p.data().chunks(wire::MAX_DATA) {
                    wire::frame(b, remote, kind, 0, chunk);
                    self.m.frames_out.add(1);
                }
                continue;
            }
            wire::frame(b, remote, kind, extra, p.data());
            self.m.frames_out.add(1);
        }
        for (token, bytes) in out {
            self.send_on(token, &bytes);
        }
        self.kick();
    }

    /// Writes encoded messages on connection `token` (counted), watching for its socket's room if they wait.
    fn send_on(&mut self, token: u64, bytes: &[u8]) {
        let Some(c) = self.conns.get_mut(&token) else { return };
        self.m.bytes_out.add(bytes.len() as u64);
        let r = c.send(bytes);
        let queued = c.tls.wants_write();
        if let Err(end) = r {
            return self.close(token, end);
        }
        if queued && !c.want_out {
            c.want_out = true;
            let f = EpollFlags::EPOLLIN | EpollFlags::EPOLLOUT | EpollFlags::EPOLLRDHUP;
            let _ = self.epoll.modify(&c.sock, &mut EpollEvent::new(f, token));
        }
    }

    /// Timers: handshakes that take too long, the retry of a connection, and the meters.
    fn tick(&mut self, now: Instant) {
        let late: Vec<u64> =
            self.conns.iter().filter(|(_, c)| !c.up && now - c.since > HANDSHAKE_TIMEOUT).map(|(t, _)| *t).collect();
        for t in late {
            self.close(t, End::Refused("no handshake within 5 s".into()));
        }
        let untold: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| c.up && c.session.as_ref().is_some_and(|s| s.received != s.told))
            .map(|(t, _)| *t)
            .collect();
        for t in untold {
            if let Some(Err(end)) = self.conns.get_mut(&t).map(tell) {
                self.close(t, end);
            }
        }
        self.m.flows_active.set(self.mode.active() as u64);
        if let Some(c) = self.conns.values().filter(|c| c.up).max_by_key(|c| c.since) {
            if let Ok(t) = flexstack_sys::tcp_info(c.sock.as_fd()) {
                self.m.rtt_us.set(u64::from(t.srtt_us));
            }
        }
        self.mode.report_counts(&self.m);
    }
}

/// The device the data plane sees: the carrier's epoll set.
type CarrierDevice = EpollDevice<Inner>;

impl FrameEngine for Inner {
    fn read_frame(&mut self, buf: &mut Vec<u8>, meta: &mut Metadata) -> std::io::Result<bool> {
        if self.ready.is_empty() {
            self.poll_events();
        }
        Ok(pop_ready(&mut self.ready, buf, meta))
    }

    fn write_frames(&mut self, packets: &[&Packet]) {
        Inner::write_frames(self, packets);
    }
}

/// What the carrier module needs of its transport's engine (TLS over TCP here, QUIC in `quic.rs`), behind the
/// device's mutex.
pub(crate) trait CarrierEngine: FrameEngine + 'static {
    /// Connect mode: the choice of flows; `None` when accepting.
    fn router(&mut self) -> Option<&mut Router>;
    fn meters(&self) -> &Meters;
    /// Flows carried since the module last looked, with their tuple.
    fn born(&mut self) -> &mut Vec<(u64, String)>;
    /// Flows ended since the module last looked.
    fn take_gone(&mut self) -> Vec<u64>;
    /// The name of the peer flow `id` is carried to or came from.
    fn peer_of(&self, id: u64) -> String;
    /// Timers, meters, and a kick of the device when frames wait.
    fn tick(&mut self, now: Instant);
    fn set_cfg(&mut self, cfg: Config);
    /// Connect mode: the connection is up (authenticated, hellos exchanged).
    fn is_up(&self) -> bool;
    /// Accepting: the peer's name and id of flow `local`.
    fn remote_of(&self, local: u64) -> Option<(String, u64)>;
    /// Sends a `Switch` of flow `local` (a carrier with several transports).
    fn send_switch(&mut self, local: u64, flags: u8, offset: u64);
    /// Forgets flow `local`, which moved to another transport.
    fn detach(&mut self, local: u64);
    /// Connect mode: carries flow `flow` from now on (it moved here).
    fn attach(&mut self, flow: u64) {
        if let Some(r) = self.router() {
            r.attach(flow);
        }
    }
    /// Writes flow `id`'s `carrier` knob: moves it to that transport. Only a carrier with several does.
    fn set_carrier(&mut self, id: u64, name: &str) -> Result<(), String> {
        let _ = id;
        Err(format!(
            "this carrier has one transport; give it `transports` (and its peer the same) to move flows to {name}"
        ))
    }
    /// The transport carrying flow `id`.
    fn carrier_of(&self, id: u64) -> String;
    /// Flows that moved to another transport since the module last looked, and where to.
    fn take_moved(&mut self) -> Vec<(u64, String)> {
        Vec::new()
    }
}

/// The [`CarrierEngine`] methods every engine implements the same way, from its fields `mode` ([`Modes`]), `m`,
/// `born`, `gone`, `cfg` and `conns` (whose values have a `peer`).
macro_rules! carrier_engine_common {
    () => {
        fn router(&mut self) -> Option<&mut Router> {
            self.mode.router()
        }

        fn meters(&self) -> &Meters {
            &self.m
        }

        fn born(&mut self) -> &mut Vec<(u64, String)> {
            &mut self.born
        }

        fn take_gone(&mut self) -> Vec<u64> {
            self.mode.take_gone(&mut self.gone)
        }

        fn peer_of(&self, id: u64) -> String {
            self.mode.peer_of(id, |h| self.conns.get(h).map(|c| c.peer.clone()))
        }

        fn set_cfg(&mut self, cfg: Config) {
            self.cfg = cfg;
        }

        fn is_up(&self) -> bool {
            match &self.mode {
                Modes::Connect { conn: Some(h), .. } => self.conns.get(h).is_some_and(|c| c.up),
                _ => false,
            }
        }

        fn remote_of(&self, local: u64) -> Option<(String, u64)> {
            let (h, remote) = self.mode.target(local)?;
            Some((self.conns.get(&h)?.peer.clone(), remote))
        }

        fn carrier_of(&self, _id: u64) -> String {
            self.cfg.transport.name().to_string()
        }
    };
}
pub(crate) use carrier_engine_common;

impl CarrierEngine for Inner {
    carrier_engine_common!();

    fn send_switch(&mut self, local: u64, flags: u8, offset: u64) {
        let Some((token, remote)) = self.mode.target(local) else { return };
        let mut b = Vec::new();
        wire::switch(&mut b, remote, flags, offset);
        self.m.frames_out.add(1);
        self.send_on(token, &b);
    }

    fn detach(&mut self, local: u64) {
        if let Some((token, remote)) = self.mode.detach(local) {
            if let (Some(c), Mode::Accept { .. }) = (self.conns.get_mut(&token), &self.mode) {
                c.remote.remove(&remote);
            }
        }
    }

    fn tick(&mut self, now: Instant) {
        Inner::tick(self, now);
        self.kick();
    }
}

/// A running carrier over engine `E`.
pub(crate) struct Carrier<E> {
    pub(crate) device: Arc<EpollDevice<E>>,
    pub(crate) decl: &'static flexstack_core::KindDecl<Config, Meters>,
    pub(crate) cfg: Config,
    pub(crate) egress: Batch,
    pub(crate) connect: bool,
    /// A flow's variables.
    pub(crate) specs: Vec<VarSpec>,
    /// Flows whose meters are registered: id -> name, and its `carrier` variable.
    pub(crate) flows: HashMap<u64, (String, flexstack_core::Meter)>,
    /// The raw stack: connecting, whether the raw pseudo-flow is open; accepting, the peers' raw flows.
    raw_open: bool,
    raw_peers: RawPeers,
}

impl<E: CarrierEngine> Carrier<E> {
    pub(crate) fn new(device: Arc<EpollDevice<E>>, req: CarrierRequest, connect: bool) -> Self {
        Carrier {
            device,
            decl: req.decl,
            cfg: req.cfg,
            egress: Vec::new(),
            connect,
            specs: carrier::flow_specs(),
            flows: HashMap::new(),
            raw_open: false,
            raw_peers: RawPeers::default(),
        }
    }

    /// Packets of `raw_in` (docs/peers.md, "The raw stack"): connecting, the app's packets that are not terminated go
    /// to the peer as `Data` of the raw pseudo-flow (opened first); accepting, replies go back on the raw flow that
    /// brought their destination. The others leave on `raw_pass`, or are dropped and counted.
    fn raw_in(&mut self, e: &mut E, input: &mut Batch, out: &mut Output<'_>) {
        let m = e.meters().clone();
        for f in input.drain(..) {
            let Some(p) = f.packet() else {
                out.drop_frame(f);
                continue;
            };
            let dst = raw::check_packet(p.data()).map(|(_, dst)| dst);
            let carried = self.cfg.raw != RawMode::None
                && dst.is_ok_and(|d| !self.connect || raw::carried(d, &self.cfg.prefixes));
            if !carried {
                m.raw_passed.add(1);
                out.emit(RAW_PASS, f);
                continue;
            }
            let (len, dir) = (p.len() as u64, if self.connect { Direction::Down } else { Direction::Up });
            let flow = if self.connect {
                let offered = trust::status(&self.cfg.peer).is_some_and(|s| s.caps.iter().any(|c| c == raw::RAW_CAP));
                if !e.is_up() {
                    m.raw_drop_down.add(1);
                    out.drop_frame(f);
                    continue;
                }
                if !offered {
                    m.raw_drop_refused.add(1);
                    out.drop_frame(f);
                    continue;
                }
                if !self.raw_open {
                    if let Some(r) = e.router() {
                        r.attach(raw::RAW_FLOW);
                    }
                    self.egress.push(StreamFrame::open(out.pool(), raw::RAW_FLOW, dir, &raw::open_info()).into());
                    self.raw_open = true;
                }
                raw::RAW_FLOW
            } else {
                match dst.ok().and_then(|d| self.raw_peers.route(d)) {
                    Some(flow) => flow,
                    None => {
                        m.raw_drop_unknown.add(1);
                        out.drop_frame(f);
                        continue;
                    }
                }
            };
            m.raw_packets_out.add(1);
            m.raw_bytes_out.add(len);
            self.egress.push(StreamFrame::data(out.pool(), flow, dir, p.data()).into());
        }
    }

    /// Frames of `demux` (the carrier's own `stream`, linked back): the raw pseudo-flows' packets leave on `raw`, as
    /// IP packets; their other frames (acks, the open, the end) are taken here; every other frame leaves on
    /// `peer_stream` unchanged.
    fn demux(&mut self, m: &Meters, input: &mut Batch, out: &mut Output<'_>) {
        for f in input.drain(..) {
            let Some((flow, kind)) = f.packet().and_then(|p| Some((p.stream_flow()?, p.stream_kind()?))) else {
                out.emit(PEER_STREAM, f);
                continue;
            };
            let ours = if self.connect {
                flow == raw::RAW_FLOW && self.cfg.raw != RawMode::None
            } else if kind == StreamKind::Open && self.cfg.raw != RawMode::None {
                let opens = f.packet().is_some_and(|p| raw::is_raw_open(p.data()));
                if opens {
                    self.raw_peers.open(flow);
                }
                opens
            } else {
                self.raw_peers.is_raw(flow)
            };
            if !ours {
                out.emit(PEER_STREAM, f);
                continue;
            }
            match kind {
                StreamKind::Data => {
                    let Some(p) = f.packet() else { continue };
                    let Ok((src, _)) = raw::check_packet(p.data()) else {
                        m.raw_drop_malformed.add(1);
                        out.drop_frame(f);
                        continue;
                    };
                    if !self.connect {
                        self.raw_peers.learn(flow, src);
                    }
                    m.raw_packets_in.add(1);
                    m.raw_bytes_in.add(p.len() as u64);
                    let mut q = out.pool().alloc_from(p.data());
                    q.set_direction(p.direction());
                    out.emit(RAW, q);
                }
                StreamKind::Abort | StreamKind::Fin => {
                    if self.connect {
                        self.raw_open = false;
                    } else {
                        self.raw_peers.close(flow);
                    }
                    out.drop_frame(f);
                }
                _ => out.drop_frame(f),
            }
        }
    }

    /// Registers the meters of flows carried since the last look, and removes those of flows that ended.
    fn flow_meters(&mut self, e: &mut E, out: &mut Output<'_>) {
        for (id, tuple) in std::mem::take(e.born()) {
            let name = format!("{}.{id}", self.cfg.vars_prefix);
            // Another module owning the prefix (a misconfiguration) leaves the meters unpublished, never the flow.
            let vars = out.register_vars(&name, &self.specs).unwrap_or_else(|_| ModuleVars::new(&self.specs));
            vars.meter("tuple").store(&Value::Str(tuple));
            vars.meter("peer").store(&Value::Str(e.peer_of(id)));
            let carrier = vars.meter("carrier");
            carrier.store(&Value::Str(e.carrier_of(id)));
            self.flows.insert(id, (name, carrier));
        }
        for (id, to) in e.take_moved() {
            if let Some((_, carrier)) = self.flows.get(&id) {
                carrier.store(&Value::Str(to));
            }
        }
        for id in e.take_gone() {
            if let Some((name, _)) = self.flows.remove(&id) {
                out.unregister_vars(&name);
            }
        }
    }

    /// A write of `<vars_prefix>.<flow>.carrier`: the flow moves to that transport.
    fn flow_carrier(&mut self, knob: &str, value: &Value) -> Option<Result<(), String>> {
        let rest = knob.strip_prefix(&self.cfg.vars_prefix)?.strip_prefix('.')?;
        let id: u64 = rest.strip_suffix(".carrier")?.parse().ok()?;
        let Value::Str(name) = value else { return Some(Err(format!("{knob} takes a string"))) };
        Some(self.device.engine().set_carrier(id, name))
    }
}

impl<E: CarrierEngine> Module for Carrier<E> {
    fn process(&mut self, port: usize, input: &mut Batch, out: &mut Output<'_>) {
        if port == RAW_IN || port == DEMUX {
            let device = self.device.clone();
            let mut e = device.engine();
            if port == RAW_IN {
                self.raw_in(&mut e, input, out);
            } else {
                let m = e.meters().clone();
                drop(e);
                self.demux(&m, input, out);
            }
            return;
        }
        if !self.connect {
            self.egress.append(input);
            return;
        }
        let device = self.device.clone();
        let mut e = device.engine();
        let cfg = self.cfg.clone();
        for f in input.drain(..) {
            let route = match f.packet().and_then(|p| Some((p.stream_flow()?, p))) {
                Some((flow, p)) => match e.router() {
                    Some(router) => (router.down(&cfg, flow, p.stream_kind(), p.data()), flow),
                    None => (Route::Carry, flow),
                },
                None => (Route::Pass, 0),
            };
            match route {
                (Route::Carry, flow) => {
                    if let Some(StreamEvent::Open(info)) = f.stream() {
                        e.born().push((flow, carrier::tuple(&info)));
                    }
                    self.egress.push(f);
                }
                (Route::Pass, _) => {
                    if f.packet().and_then(Packet::stream_kind) == Some(StreamKind::Open) {
                        e.meters().flows_passed.add(1);
                    }
                    out.emit(PASS, f);
                }
                (Route::Limit, flow) => {
                    e.meters().flows_limited.add(1);
                    let abort = StreamFrame::abort(out.pool(), flow, Direction::Up, "limit");
                    out.emit(STREAM, abort);
                }
            }
        }
        self.flow_meters(&mut e, out);
    }

    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        let device = self.device.clone();
        let mut e = device.engine();
        e.tick(Instant::now());
        self.flow_meters(&mut e, out);
        Some(out.now() + PERIOD)
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        if let Some(r) = self.flow_carrier(knob, value) {
            return r;
        }
        self.decl.write(&mut self.cfg, knob, value)?;
        self.device.engine().set_cfg(self.cfg.clone());
        Ok(())
    }

    fn device(&self) -> Option<Arc<dyn FaceDevice>> {
        Some(self.device.clone())
    }

    fn take_egress(&mut self, into: &mut Batch) {
        into.append(&mut self.egress);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a resumed connection sends again is exactly what the other side did not take: nothing lost, nothing
    /// twice; an offset outside what is kept cannot resume.
    #[test]
    fn a_session_resends_from_what_the_other_side_took() {
        let mut s = Session::new(7);
        s.keep(b"abcdef");
        s.keep(b"ghij");
        assert_eq!(s.sent, 10);
        s.took(4).expect("within what is kept");
        assert_eq!(s.kept.iter().copied().collect::<Vec<_>>(), b"efghij");
        assert!(s.took(11).is_err(), "more than was sent");
        s.took(3).expect("a `Received` behind what is kept: nothing to forget");
        assert_eq!(s.kept.len(), 6);
        assert!(s.resume_from(3).is_err(), "a resume needing bytes no longer kept");
        s.resume_from(6).expect("within what is kept");
        assert_eq!(s.kept.iter().copied().collect::<Vec<_>>(), b"ghij", "what to send again");
        s.took(10).expect("everything");
        assert!(s.kept.is_empty());
        s.keep(&vec![1; MAX_KEPT + 5]);
        assert_eq!(s.kept.len(), MAX_KEPT, "bounded");
        s.took(12).expect("a `Received` of bytes already forgotten");
        assert!(s.resume_from(12).is_err(), "forgotten beyond the bound: a move needing it cannot resume");
        s.resume_from(15).expect("what is still kept");
    }
}
