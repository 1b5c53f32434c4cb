//! The `quic` carrier (docs/peers.md, "The quic carrier"): one QUIC connection per peer over one UDP socket,
//! driven by quinn-proto's sans-IO state machine from the data plane's epoll loop (no async runtime).
//!
//! - Authentication is the `tcp` carrier's: the same rustls configurations ([`client_config`], [`server_config`],
//!   fingerprints pinned both ways), wrapped for QUIC. Nothing is read from a connection before its handshake has
//!   authenticated the other side and its `Hello` (on the control stream) has the same version.
//! - The connecting side opens the connection's first bidirectional stream, the **control stream**: `Hello` both
//!   ways, then `Close`. Each carried flow (TCP or UDP) gets a bidirectional stream of its own, opened by the
//!   connecting side with the flow's `Open`: every stream frame of that flow travels on it as a [`wire`] message, so
//!   one flow's loss or backpressure never stalls another's. A UDP flow's `Data` travel instead in QUIC DATAGRAM
//!   frames (RFC 9221: [`wire::datagram`], the flow id and one app datagram), unreliable as UDP is: the carrier
//!   acks a datagram's bytes to its producer when it sends it, and absorbs the consumer's acks of the datagrams it
//!   received (they have no one to go to). A datagram larger than the path takes counts in
//!   `datagrams_dropped_total`.
//! - Congestion control per carrier (`cc`: quinn-proto's NewReno, Cubic or BBR). quinn-proto's timers (loss
//!   detection, acks, idle) are a timerfd in the device's epoll set, armed at the connections' earliest
//!   `poll_timeout`, so the data plane wakes when one is due.
//! - Meters from quinn-proto's statistics: `rtt_us`, `cwnd_bytes` (latest connection), `lost_packets_total`,
//!   `udp_bytes_out_total`, `udp_bytes_in_total` (every connection's, closed ones included).

use super::batch::{self, Outbox};
use super::carrier::{
    caps, carrier_engine_common, check_hello, each_message, epoll_with_kick, listen_of_cfg, log_end, peer_of_cfg,
    pop_ready, switch_marker, switch_unasked, Builder, CarrierEngine, End, LogLimit, Modes, Ready, HANDSHAKE_TIMEOUT,
    MAX_CONNECTIONS,
};
use super::trust::{self, client_config, identity, report, server_config, TLS_NAME};
use super::uplinks::Sockets;
use crate::stream::{EpollDevice, FrameEngine};
use bytes::{Bytes, BytesMut};
use flexstack_core::frame::{MetaKey, Metadata};
use flexstack_core::stream::{FlowInfo, Protocol, StreamKind};
use flexstack_core::{Direction, Packet};
use flexstack_modules::stream::carrier::early::Early;
use flexstack_modules::stream::carrier::{wire, CarrierRequest, Config, Meters, Router};
use nix::sys::epoll::{EpollEvent, EpollFlags};
use nix::sys::eventfd::EventFd;
use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
use quinn_proto::congestion::{BbrConfig, ControllerFactory, CubicConfig, NewRenoConfig};
use quinn_proto::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn_proto::{
    ClientConfig, ConnectionHandle, DatagramEvent, Dir, Endpoint, EndpointConfig, Event, IdleTimeout, ServerConfig,
    StreamEvent as QStreamEvent, StreamId, TransportConfig, VarInt,
};
use std::collections::{HashMap, HashSet, VecDeque};
use std::io::ErrorKind;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The capabilities this carrier announces.
/// Epoll tokens.
const TIMER: u64 = 2;
/// UDP datagrams read from a socket per pass, about (a GRO run counts as its datagrams; the rest wait for the next).
const READ_BATCH: usize = 256;
/// A connection that hears nothing for this long is gone (keep-alives every third of it).
const IDLE: Duration = Duration::from_secs(10);
/// The error code of a connection closed by the protocol's rules.
const CLOSE_CODE: u32 = 1;

/// The transport parameters: the congestion control of `cc`, a stream per flow allowed (`max_flows` and the
/// control stream), keep-alives and the idle timeout.
fn transport(cfg: &Config) -> Arc<TransportConfig> {
    let mut t = TransportConfig::default();
    let cc: Arc<dyn ControllerFactory + Send + Sync> = match cfg.cc.as_str() {
        "newreno" => Arc::new(NewRenoConfig::default()),
        "bbr" => Arc::new(BbrConfig::default()),
        _ => Arc::new(CubicConfig::default()),
    };
    t.congestion_controller_factory(cc);
    t.max_concurrent_bidi_streams(VarInt::from_u64(cfg.max_flows + 16).unwrap_or(VarInt::MAX));
    t.max_concurrent_uni_streams(VarInt::from_u32(0));
    t.max_idle_timeout(IdleTimeout::try_from(IDLE).ok());
    t.keep_alive_interval(Some(IDLE / 3));
    Arc::new(t)
}

/// Builds a `quic` carrier from what the kind read.
pub(crate) fn build(req: CarrierRequest) -> Result<Builder<Quic>, String> {
    let id = identity().ok_or("no peer identity: the daemon makes one in its state directory when it starts")?;
    let tp = transport(&req.cfg);
    let (socket, server, mode) = if req.cfg.peer.is_empty() {
        let addr = listen_of_cfg(&req.cfg)?;
        let socket = UdpSocket::bind(addr).map_err(|e| format!("cannot listen on {addr} (UDP): {e}"))?;
        let socket = Sockets::single(socket);
        let crypto = QuicServerConfig::try_from(server_config(id)?).map_err(|e| format!("QUIC TLS: {e}"))?;
        let mut sc = ServerConfig::with_crypto(Arc::new(crypto));
        sc.transport_config(tp);
        (
            socket,
            Some(Arc::new(sc)),
            Mode::Accept { server: (), flows: HashMap::new(), next_local: 1, ids: req.cfg.ids.clone() },
        )
    } else {
        let peer = peer_of_cfg(&req.cfg)?;
        let socket = Sockets::connecting(&req.cfg.uplinks, peer.addr)?;
        let crypto =
            QuicClientConfig::try_from(client_config(id, peer.fingerprint)?).map_err(|e| format!("QUIC TLS: {e}"))?;
        let mut cc = ClientConfig::new(Arc::new(crypto));
        cc.transport_config(tp);
        (socket, None, Mode::Connect { peer, client: cc, router: Router::default(), retry_at: None, conn: None })
    };
    socket.prepare("quic")?;
    let make = move |cfg: &Config, m| quic_device(socket, server, mode, cfg, m);
    Ok(Builder { req, make: Box::new(make) })
}

/// The quic carrier's device.
fn quic_device(
    socket: Sockets,
    server: Option<Arc<ServerConfig>>,
    mode: Mode,
    cfg: &Config,
    m: Meters,
) -> (Arc<EpollDevice<Quic>>, bool) {
    let (epoll, kick) = epoll_with_kick();
    let timer =
        TimerFd::new(ClockId::CLOCK_MONOTONIC, TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC).expect("a timerfd");
    let watch = |fd: BorrowedFd<'_>, token| {
        epoll.add(fd, EpollEvent::new(EpollFlags::EPOLLIN, token)).expect("the carrier's fds in its epoll set")
    };
    socket.watch_in(&epoll);
    socket.init_meters(&m);
    watch(timer.as_fd(), TIMER);
    let connect = matches!(mode, Mode::Connect { .. });
    let endpoint = Endpoint::new(Arc::new(EndpointConfig::default()), server, true, None);
    let epoll = Arc::new(epoll);
    let mut q = Quic {
        net: socket,
        endpoint,
        mode,
        conns: HashMap::new(),
        ready: VecDeque::new(),
        born: Vec::new(),
        gone: Vec::new(),
        cfg: cfg.clone(),
        m,
        kick,
        timer,
        timer_at: None,
        refusal_log: LogLimit::default(),
        closed: Totals::default(),
        buf: Vec::new(),
        out: Outbox::default(),
        waiting: Vec::new(),
    };
    if connect {
        q.connect(Instant::now());
        q.drive(Instant::now());
    }
    let dir = if connect { Direction::Up } else { Direction::Down };
    let name = format!("quic-{}", if connect { &cfg.peer } else { &cfg.listen });
    (Arc::new(EpollDevice::new(name, dir, epoll, q)), connect)
}

type Mode = Modes<ClientConfig, (), ConnectionHandle>;

/// Statistics of the connections that are gone (the meters add the live ones').
#[derive(Default, Clone, Copy)]
struct Totals {
    lost: u64,
    tx: u64,
    rx: u64,
}

impl Totals {
    fn of(c: &quinn_proto::Connection) -> Totals {
        let s = c.stats();
        Totals { lost: s.path.lost_packets, tx: s.udp_tx.bytes, rx: s.udp_rx.bytes }
    }

    fn add(self, o: Totals) -> Totals {
        Totals { lost: self.lost + o.lost, tx: self.tx + o.tx, rx: self.rx + o.rx }
    }
}

struct Conn {
    conn: quinn_proto::Connection,
    /// The peer's name (accepting: known once authenticated).
    peer: String,
    /// Authenticated and hello received.
    up: bool,
    /// The handshake completed (quinn-proto's `Connected`).
    connected: bool,
    since: Instant,
    control: Option<StreamId>,
    /// Bytes received on a stream, not decoded yet.
    rx: HashMap<StreamId, Vec<u8>>,
    /// Bytes waiting for a stream's send window.
    tx: HashMap<StreamId, Vec<u8>>,
    /// Streams of flows that ended: finished once their `tx` is written.
    finishing: HashSet<StreamId>,
    /// Streams with data to read.
    readable: Vec<StreamId>,
    /// A flow's stream, by the flow's id in messages (the connecting side's).
    flow_stream: HashMap<u64, StreamId>,
    stream_flow: HashMap<StreamId, u64>,
    /// Streams of flows that ended whose peer may still send on them (an `Ack` after both `Fin`s, a late `Abort`):
    /// what comes on them is an orphan, not a new flow. Forgotten when the peer finishes the stream.
    ended: HashSet<StreamId>,
    /// Streams of flows not ended yet that the peer already finished (so [`Conn::end_flow`] keeps no entry).
    recv_done: HashSet<StreamId>,
    /// UDP flows (their `Data` travel in datagrams), by their id in messages.
    udp: HashSet<u64>,
    /// The peer's datagrams that came before their flow's `Open` (a lost stream packet).
    held: Early,
    /// Accepting: the peer's flow id -> the local one.
    remote: HashMap<u64, u64>,
    /// Ended (counted, flows aborted); kept until quinn-proto has drained it.
    dead: bool,
    /// The peer's address as last seen (accepting: a change is a migration of the peer's).
    addr: SocketAddr,
}

impl Conn {
    fn new(conn: quinn_proto::Connection, peer: String) -> Conn {
        Conn {
            peer,
            up: false,
            connected: false,
            since: Instant::now(),
            control: None,
            rx: HashMap::new(),
            tx: HashMap::new(),
            finishing: HashSet::new(),
            readable: Vec::new(),
            flow_stream: HashMap::new(),
            stream_flow: HashMap::new(),
            ended: HashSet::new(),
            recv_done: HashSet::new(),
            udp: HashSet::new(),
            held: Early::default(),
            remote: HashMap::new(),
            dead: false,
            addr: conn.remote_address(),
            conn,
        }
    }

    /// Queues `bytes` (encoded messages) on stream `id` and writes what its window takes.
    fn send(&mut self, id: StreamId, bytes: &[u8]) {
        self.tx.entry(id).or_default().extend_from_slice(bytes);
        self.flush(id);
    }

    fn flush(&mut self, id: StreamId) {
        let Some(buf) = self.tx.get_mut(&id) else { return };
        let mut s = self.conn.send_stream(id);
        let mut at = 0;
        while at < buf.len() {
            match s.write(&buf[at..]) {
                Ok(n) => at += n,
                Err(quinn_proto::WriteError::Blocked) => break,
                Err(_) => {
                    // Stopped or closed: nobody reads it any more.
                    at = buf.len();
                }
            }
        }
        buf.drain(..at);
        if buf.is_empty() {
            self.tx.remove(&id);
            if self.finishing.remove(&id) {
                let _ = self.conn.send_stream(id).finish();
            }
        }
    }

    /// The flow's stream is done: its send side finishes once what waits is written; the maps forget it.
    fn end_flow(&mut self, flow: u64) {
        self.udp.remove(&flow);
        if let Some(id) = self.flow_stream.remove(&flow) {
            self.stream_flow.remove(&id);
            if !self.recv_done.remove(&id) {
                self.ended.insert(id);
            }
            // Finished once what waits for its window is written.
            self.finishing.insert(id);
            self.tx.entry(id).or_default();
            self.flush(id);
        }
    }

    /// Reads what stream `id` holds into `rx`; true at its end.
    fn read(&mut self, id: StreamId) -> bool {
        let mut s = self.conn.recv_stream(id);
        let Ok(mut chunks) = s.read(true) else { return true };
        let buf = self.rx.entry(id).or_default();
        let end = loop {
            match chunks.next(usize::MAX) {
                // What a stream holds is bounded by its receive window (quinn-proto's) and the flow's budget.
                Ok(Some(c)) => buf.extend_from_slice(&c.bytes),
                Ok(None) => break true,
                Err(quinn_proto::ReadError::Blocked) => break false,
                Err(quinn_proto::ReadError::Reset(_)) => break true,
            }
        };
        let _ = chunks.finalize();
        end
    }
}

/// The engine behind the device.
pub(crate) struct Quic {
    /// The UDP socket, or one per uplink (`uplinks`).
    net: Sockets,
    endpoint: Endpoint,
    mode: Mode,
    conns: HashMap<ConnectionHandle, Conn>,
    ready: VecDeque<Ready>,
    born: Vec<(u64, String)>,
    gone: Vec<u64>,
    cfg: Config,
    m: Meters,
    kick: EventFd,
    timer: TimerFd,
    timer_at: Option<Instant>,
    refusal_log: LogLimit,
    closed: Totals,
    buf: Vec<u8>,
    /// What this pass sends (`transmit` flushes it).
    out: Outbox,
    /// Connect mode: frames that came while the connection was handshaking.
    waiting: Vec<(u64, StreamKind, u64, Vec<u8>)>,
}

impl Quic {
    fn push(&mut self, flow: u64, kind: StreamKind, extra: u64, bytes: &[u8]) {
        self.ready.push_back(Ready { flow, kind, extra, bytes: bytes.to_vec() });
    }

    fn kick(&self) {
        if !self.ready.is_empty() {
            let _ = self.kick.write(1);
        }
    }

    /// Connect mode: starts the connection (if none and not waiting to retry); its `Hello` goes on the control
    /// stream, opened at once (sent when the handshake allows).
    fn connect(&mut self, now: Instant) {
        let Mode::Connect { peer, client, retry_at, conn, .. } = &mut self.mode else { return };
        if conn.is_some() || retry_at.is_some_and(|t| now < t) {
            return;
        }
        let name = peer.name.clone();
        match self.endpoint.connect(now, client.clone(), peer.addr, TLS_NAME) {
            Ok((ch, qc)) => {
                *conn = Some(ch);
                self.conns.insert(ch, Conn::new(qc, name.clone()));
                report(&name, |s| s.state = "connecting".into());
            }
            Err(e) => self.connect_failed(now, &e.to_string()),
        }
    }

    fn connect_failed(&mut self, now: Instant, why: &str) {
        let retry = Duration::from_millis(self.cfg.retry_ms);
        if let Mode::Connect { peer, retry_at, conn, .. } = &mut self.mode {
            *retry_at = Some(now + retry);
            *conn = None;
            tracing::warn!(peer = %peer.name, addr = %peer.addr, "quic carrier to the peer is down: {why}");
            report(&peer.name, |s| s.state = format!("down: {why}"));
        }
    }

    /// Closes connection `ch` (the peer is told why in QUIC's CONNECTION_CLOSE) and ends its flows.
    fn close(&mut self, ch: ConnectionHandle, end: End, now: Instant) {
        let Some(c) = self.conns.get_mut(&ch) else { return };
        if c.dead {
            return;
        }
        let reason: &[u8] = match &end {
            End::Malformed(_) => b"malformed",
            End::Refused(_) => b"refused",
            End::Closed(_) => b"closed",
        };
        c.conn.close(now, VarInt::from_u32(CLOSE_CODE), Bytes::copy_from_slice(reason));
        self.lost(ch, end);
    }

    /// Connection `ch` ended (closed here, by the peer, or lost): counts, logs, aborts its flows towards the chain.
    /// quinn-proto keeps it until it is drained (its CONNECTION_CLOSE sent or the peer's seen).
    fn lost(&mut self, ch: ConnectionHandle, end: End) {
        let Some(c) = self.conns.get_mut(&ch) else { return };
        if c.dead {
            return;
        }
        c.dead = true;
        let addr = c.conn.remote_address();
        let why = log_end(&self.m, &mut self.refusal_log, &end, c.up, &c.peer, &addr);
        let remote = c.remote.values().copied().collect();
        if matches!(self.mode, Mode::Connect { conn, .. } if conn == Some(ch)) {
            self.waiting.clear();
        }
        let aborted = self.mode.conn_ended(ch, remote, &mut self.gone);
        self.m.flows_aborted.add(aborted.len() as u64);
        for id in aborted {
            self.push(id, StreamKind::Abort, 0, b"unreachable");
        }
        if matches!(self.mode, Mode::Connect { .. }) {
            self.connect_failed(Instant::now(), &why);
        }
    }

    /// Everything due: datagrams from the socket, the connections' events and timers, what they transmit.
    fn drive(&mut self, now: Instant) {
        if self.net.moved(now, &self.m) {
            // Connection migration: the next packets leave from the new uplink, on a fresh connection ID, and a
            // PING shows the peer the new path at once.
            for c in self.conns.values_mut() {
                c.conn.local_address_changed();
            }
        }
        self.receive(now);
        let handles: Vec<ConnectionHandle> = self.conns.keys().copied().collect();
        for ch in handles {
            self.service(ch, now);
        }
        self.transmit(now);
        self.arm_timer();
        self.kick();
    }

    fn receive(&mut self, now: Instant) {
        let mut data = [0u8; 65536];
        for i in 0..self.net.len() {
            self.receive_on(i, now, &mut data);
        }
    }

    /// What socket `i` received.
    fn receive_on(&mut self, i: usize, now: Instant, data: &mut [u8; 65536]) {
        let mut taken = 0;
        while taken < READ_BATCH {
            let (n, from, seg) = match batch::recv(self.net.get(i), data) {
                Ok(x) => x,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => break, // WouldBlock, or an ICMP error reported on the socket
            };
            self.net.received(i, now, &self.m);
            for d in batch::datagrams(data, n, seg) {
                taken += 1;
                let bytes = BytesMut::from(&d[..]);
                let mut buf = std::mem::take(&mut self.buf);
                match self.endpoint.handle(now, from, None, None, bytes, &mut buf) {
                    Some(DatagramEvent::ConnectionEvent(ch, ev)) => {
                        if let Some(c) = self.conns.get_mut(&ch) {
                            c.conn.handle_event(ev);
                        }
                    }
                    Some(DatagramEvent::NewConnection(incoming)) => self.incoming(incoming, now, &mut buf),
                    Some(DatagramEvent::Response(t)) => self.send_to(&buf[..t.size], t.destination),
                    None => {}
                }
                self.buf = buf;
            }
        }
    }

    /// A new connection at an accepting carrier (a connecting one ignores them).
    fn incoming(&mut self, incoming: quinn_proto::Incoming, now: Instant, buf: &mut Vec<u8>) {
        if matches!(self.mode, Mode::Connect { .. }) {
            self.endpoint.ignore(incoming);
            return;
        }
        if self.conns.len() >= MAX_CONNECTIONS {
            self.m.refusals.add(1);
            tracing::warn!(from = %incoming.remote_address(), "quic carrier: too many connections, refused");
            let t = self.endpoint.refuse(incoming, buf);
            self.send_to(&buf[..t.size], t.destination);
            return;
        }
        match self.endpoint.accept(incoming, now, buf, None) {
            Ok((ch, qc)) => {
                self.conns.insert(ch, Conn::new(qc, String::new()));
            }
            Err(e) => {
                self.m.refusals.add(1);
                if let Some(t) = e.response {
                    self.send_to(&buf[..t.size], t.destination);
                }
            }
        }
    }

    fn send_to(&self, bytes: &[u8], to: SocketAddr) {
        // A full socket buffer loses the datagram, as the network may: QUIC recovers.
        let _ = self.net.socket().send_to(bytes, to);
    }

    /// A connection's timers, events and streams.
    fn service(&mut self, ch: ConnectionHandle, now: Instant) {
        let Some(c) = self.conns.get_mut(&ch) else { return };
        if c.conn.poll_timeout().is_some_and(|t| t <= now) {
            c.conn.handle_timeout(now);
        }
        if c.conn.remote_address() != c.addr {
            tracing::info!(peer = %c.peer, from = %c.addr, to = %c.conn.remote_address(), "quic carrier: the peer moved");
            c.addr = c.conn.remote_address();
            self.m.migrations.add(1);
        }
        let mut lost = None;
        let mut datagrams = false;
        while let Some(ev) = c.conn.poll() {
            match ev {
                Event::Connected => {
                    c.connected = true;
                    if self_connects(&self.mode) {
                        open_control(c, &self.m, &self.cfg);
                    }
                }
                Event::ConnectionLost { reason } => {
                    let why = reason.to_string();
                    lost = Some(if c.up { End::Closed(why) } else { End::Refused(why) });
                }
                Event::Stream(QStreamEvent::Opened { dir: Dir::Bi }) => {
                    while let Some(id) = c.conn.streams().accept(Dir::Bi) {
                        if c.control.is_none() && !self_connects(&self.mode) {
                            c.control = Some(id);
                        }
                        c.readable.push(id);
                    }
                }
                Event::Stream(QStreamEvent::Readable { id }) => c.readable.push(id),
                Event::Stream(QStreamEvent::Writable { id }) => c.flush(id),
                Event::DatagramReceived => datagrams = true,
                _ => {}
            }
        }
        if let Some(end) = lost {
            self.lost(ch, end);
        }
        let Some(c) = self.conns.get_mut(&ch) else { return };
        if !c.dead {
            if let Err(end) = self.read_streams(ch) {
                self.close(ch, end, now);
            } else if datagrams {
                self.datagrams(ch, now);
            }
        }
        let Some(c) = self.conns.get_mut(&ch) else { return };
        while let Some(ev) = c.conn.poll_endpoint_events() {
            if let Some(back) = self.endpoint.handle_event(ch, ev) {
                c.conn.handle_event(back);
            }
        }
        if c.conn.is_drained() {
            self.lost(ch, End::Closed("drained".into()));
            if let Some(c) = self.conns.remove(&ch) {
                self.closed = self.closed.add(Totals::of(&c.conn));
            }
        }
    }

    /// Decodes the messages of the streams that have data: the control stream first; flow streams only once the
    /// peer said hello.
    fn read_streams(&mut self, ch: ConnectionHandle) -> Result<(), End> {
        let Some(c) = self.conns.get_mut(&ch) else { return Ok(()) };
        let mut ids = std::mem::take(&mut c.readable);
        ids.sort_unstable();
        ids.dedup();
        if let Some(ctl) = c.control {
            if let Some(i) = ids.iter().position(|&i| i == ctl) {
                ids.remove(i);
                ids.insert(0, ctl);
            }
        }
        let mut later = Vec::new();
        for id in ids {
            let Some(c) = self.conns.get_mut(&ch) else { return Ok(()) };
            let control = c.control == Some(id);
            if !control && !c.up {
                later.push(id); // read once authenticated and hello received
                continue;
            }
            let end = c.read(id);
            self.take_messages(ch, id, control)?;
            if end && control {
                return Err(End::Closed("the peer closed its control stream".into()));
            }
            if let Some(c) = self.conns.get_mut(&ch) {
                if end {
                    c.rx.remove(&id);
                    if !c.ended.remove(&id) && c.stream_flow.contains_key(&id) {
                        c.recv_done.insert(id);
                    }
                }
            }
        }
        if let Some(c) = self.conns.get_mut(&ch) {
            c.readable.extend(later);
        }
        Ok(())
    }

    fn take_messages(&mut self, ch: ConnectionHandle, id: StreamId, control: bool) -> Result<(), End> {
        let Some(c) = self.conns.get_mut(&ch) else { return Ok(()) };
        let plain = c.rx.remove(&id).unwrap_or_default();
        let m = self.m.clone();
        let (at, result) =
            each_message(
                &plain,
                &m,
                |msg, _| {
                    if control {
                        self.control(ch, msg)
                    } else {
                        self.flow_message(ch, id, msg)
                    }
                },
            );
        let Some(c) = self.conns.get_mut(&ch) else { return result };
        if at < plain.len() {
            c.rx.insert(id, plain[at..].to_vec());
        }
        result.map_err(|e| e.before_hello(c.up))
    }

    /// A message on the control stream: `Hello` first, then only `Close`.
    fn control(&mut self, ch: ConnectionHandle, m: wire::Message<'_>) -> Result<(), End> {
        let Some(c) = self.conns.get_mut(&ch) else { return Ok(()) };
        if c.up {
            return match m {
                wire::Message::Close { reason } => Err(End::Closed(format!("the peer closed: {reason}"))),
                _ => Err(End::Malformed("only close follows hello on the control stream".into())),
            };
        }
        check_hello(&m, &c.peer)?;
        if c.peer.is_empty() {
            // Accepting: who it is (the verifier let only peers of the table through).
            let name = c
                .conn
                .crypto_session()
                .peer_identity()
                .and_then(|a| a.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>().ok())
                .and_then(|v| v.first().map(|d| trust::fingerprint_of(d)))
                .and_then(|fp| trust::by_fingerprint(&fp));
            let Some(name) = name else { return Err(End::Refused("not a peer (removed?)".into())) };
            c.peer = name;
            let mut hello = Vec::new();
            wire::hello(&mut hello, &caps(&self.cfg));
            self.m.bytes_out.add(hello.len() as u64);
            self.m.frames_out.add(1);
            if let Some(ctl) = c.control {
                c.send(ctl, &hello);
            }
        }
        c.up = true;
        self.m.connections.add(1);
        self.m.connections_active.add(1);
        let peer = c.peer.clone();
        let cc = controller(&c.conn);
        tracing::info!(peer = %peer, cc, "quic carrier connection up");
        report(&peer, |s| {
            s.state = format!("connected over quic ({cc})");
            s.connections += 1;
        });
        for (flow, kind, extra, data) in std::mem::take(&mut self.waiting) {
            self.out_frame(flow, kind, extra, &data);
        }
        Ok(())
    }

    /// A message on a flow's stream: a frame of that flow (an accepting side learns the flow from its `Open`).
    fn flow_message(&mut self, ch: ConnectionHandle, id: StreamId, m: wire::Message<'_>) -> Result<(), End> {
        if let wire::Message::Switch { flow, flags, offset } = m {
            return self.switch_in(ch, id, flow, flags, offset);
        }
        let wire::Message::Frame { flow, kind, ack, bytes } = m else {
            return Err(End::Malformed("a flow's stream carries only frames".into()));
        };
        let max = self.cfg.max_flows;
        let Some(c) = self.conns.get_mut(&ch) else { return Ok(()) };
        match c.stream_flow.get(&id) {
            Some(&f) if f != flow => return Err(End::Malformed(format!("flow {flow} on flow {f}'s stream"))),
            Some(_) => {}
            None if c.ended.contains(&id) => {
                self.m.orphans.add(1);
                return Ok(());
            }
            None => {
                if !matches!(self.mode, Mode::Accept { .. }) {
                    return Err(End::Malformed("a stream the connecting side did not open".into()));
                }
                if kind != StreamKind::Open {
                    return Err(End::Malformed("a flow's stream starts with its open".into()));
                }
                let (local, info) =
                    match self.mode.accept_open(ch, &mut c.remote, flow, bytes, max, &self.m, &mut self.born)? {
                        Ok(x) => x,
                        Err(abort) => {
                            c.send(id, &abort);
                            let _ = c.conn.send_stream(id).finish();
                            return Ok(());
                        }
                    };
                c.flow_stream.insert(flow, id);
                c.stream_flow.insert(id, flow);
                let udp = info.protocol == Protocol::Udp;
                if udp {
                    c.udp.insert(flow);
                }
                self.push(local, kind, ack, bytes);
                if udp {
                    self.opened(ch, flow);
                }
                return Ok(());
            }
        }
        self.frame_in(ch, flow, kind, ack, bytes);
        Ok(())
    }

    /// A `Switch` on a flow's stream: a flow that starts on this connection may open the stream (accepting).
    fn switch_in(&mut self, ch: ConnectionHandle, id: StreamId, flow: u64, flags: u8, offset: u64) -> Result<(), End> {
        switch_unasked(&self.cfg)?;
        let Some(c) = self.conns.get_mut(&ch) else { return Ok(()) };
        match c.stream_flow.get(&id) {
            Some(&f) if f != flow => return Err(End::Malformed(format!("flow {flow} on flow {f}'s stream"))),
            Some(_) => {}
            None if !matches!(self.mode, Mode::Accept { .. }) => {
                return Err(End::Malformed("a stream the connecting side did not open".into()));
            }
            None => {
                if let Some(old) = c.flow_stream.insert(flow, id) {
                    c.stream_flow.remove(&old);
                }
                c.stream_flow.insert(id, flow);
            }
        }
        let udp = flags & wire::SWITCH_UDP != 0;
        if udp {
            c.udp.insert(flow);
        }
        match self.mode.peer_switch(ch, &mut c.remote, &c.peer, flow, flags) {
            Some(local) => self.ready.push_back(switch_marker(local, flags, offset)),
            None => self.m.orphans.add(1),
        }
        if udp {
            self.opened(ch, flow);
        }
        Ok(())
    }

    /// A frame of a known flow from the peer (on its stream, or a datagram's `Data`), towards the chain.
    fn frame_in(&mut self, ch: ConnectionHandle, flow: u64, kind: StreamKind, ack: u64, bytes: &[u8]) {
        let Some(c) = self.conns.get_mut(&ch) else { return };
        match self.mode.peer_frame(&mut c.remote, flow, kind, &mut self.gone) {
            Some((local, ended)) => {
                if ended {
                    c.end_flow(flow);
                }
                self.push(local, kind, ack, bytes);
            }
            None => self.m.orphans.add(1),
        }
    }

    /// The DATAGRAM frames connection `ch` received: UDP app datagrams of its flows.
    fn datagrams(&mut self, ch: ConnectionHandle, now: Instant) {
        loop {
            let Some(c) = self.conns.get_mut(&ch) else { return };
            if !c.up {
                return;
            }
            let Some(d) = c.conn.datagrams().recv() else { return };
            self.m.bytes_in.add(d.len() as u64);
            match wire::decode_datagram(&d) {
                Ok((flow, payload)) if c.udp.contains(&flow) => {
                    self.frame_in(ch, flow, StreamKind::Data, 0, payload);
                }
                // Its flow's `Open` was in a packet that was lost or overtaken: held until it comes.
                Ok((flow, _)) if c.held.hold(now, flow, &d) => self.m.early_held.add(1),
                _ => self.m.orphans.add(1),
            }
        }
    }

    /// UDP flow `flow` of connection `ch` opened: the datagrams that came before, in order.
    fn opened(&mut self, ch: ConnectionHandle, flow: u64) {
        let Some(c) = self.conns.get_mut(&ch) else { return };
        for d in c.held.release(flow) {
            match wire::decode_datagram(&d) {
                Ok((_, payload)) => self.frame_in(ch, flow, StreamKind::Data, 0, payload),
                Err(_) => self.m.orphans.add(1),
            }
        }
    }

    /// Frames from the chain to the peer(s).
    fn write_frames(&mut self, packets: &[&Packet]) {
        let now = Instant::now();
        for p in packets {
            let (Some(flow), Some(kind)) = (p.stream_flow(), p.stream_kind()) else {
                self.m.orphans.add(1);
                continue;
            };
            let extra = p.meta().get(MetaKey::STREAM).unwrap_or(0) >> 8;
            if matches!(self.mode, Mode::Connect { .. }) {
                if kind == StreamKind::Open {
                    self.m.flows.add(1);
                    self.connect(now);
                }
                let conn = match &self.mode {
                    Mode::Connect { conn, .. } => *conn,
                    Mode::Accept { .. } => None,
                };
                let handshaking = conn.and_then(|ch| self.conns.get(&ch)).is_some_and(|c| !c.up);
                if handshaking {
                    // Sent once the peer said hello (its streams are not open before the handshake ends).
                    self.waiting.push((flow, kind, extra, p.data().to_vec()));
                    continue;
                }
            }
            self.out_frame(flow, kind, extra, p.data());
        }
        self.transmit(now);
        self.arm_timer();
        self.kick();
    }

    /// One frame of flow `flow` (the local id) from the chain to its connection.
    fn out_frame(&mut self, flow: u64, kind: StreamKind, extra: u64, data: &[u8]) {
        let target = match &mut self.mode {
            Mode::Connect { conn, .. } => conn.map(|ch| (ch, flow, false)),
            Mode::Accept { flows, .. } => {
                let Some(f) = flows.get(&flow) else {
                    self.m.orphans.add(1);
                    return;
                };
                let t = (f.token, f.remote);
                let done = self.mode.accepted_ends(flow, kind, true, &mut self.gone);
                Some((t.0, t.1, done))
            }
        };
        let Some((ch, wire_flow, done)) = target.filter(|(ch, ..)| self.conns.contains_key(ch)) else {
            // Connect mode, no connection: the flow cannot be carried.
            if let Mode::Connect { router, .. } = &mut self.mode {
                if router.up(flow, StreamKind::Abort) {
                    self.m.flows_aborted.add(1);
                    self.push(flow, StreamKind::Abort, 0, b"unreachable");
                }
            }
            return;
        };
        self.send_frame(ch, wire_flow, flow, kind, extra, data);
        let Some(c) = self.conns.get_mut(&ch) else { return };
        let ended = match &mut self.mode {
            Mode::Connect { router, .. } => !router.carries(flow),
            Mode::Accept { .. } => done,
        };
        if ended {
            c.remote.remove(&wire_flow);
            c.end_flow(wire_flow);
        }
    }

    /// Sends one frame of flow `local` (`wire_flow` on the wire) on its stream, or its `Data` in a datagram (UDP).
    fn send_frame(
        &mut self,
        ch: ConnectionHandle,
        wire_flow: u64,
        local: u64,
        kind: StreamKind,
        extra: u64,
        data: &[u8],
    ) {
        let Some(c) = self.conns.get_mut(&ch) else { return };
        if kind == StreamKind::Open && !c.flow_stream.contains_key(&wire_flow) {
            // The connecting side: the flow's own stream.
            let Some(id) = c.conn.streams().open(Dir::Bi) else {
                self.m.flows_limited.add(1);
                if let Mode::Connect { router, .. } = &mut self.mode {
                    if router.up(local, StreamKind::Abort) {
                        self.push(local, StreamKind::Abort, 0, b"limit");
                    }
                }
                return;
            };
            c.flow_stream.insert(wire_flow, id);
            c.stream_flow.insert(id, wire_flow);
            if FlowInfo::decode(data).is_ok_and(|i| i.protocol == Protocol::Udp) {
                c.udp.insert(wire_flow);
            }
        }
        let udp = c.udp.contains(&wire_flow);
        if udp && kind == StreamKind::Ack {
            return; // acks of datagrams received: the sender acked them when it sent them
        }
        if udp && kind == StreamKind::Data {
            let mut d = Vec::with_capacity(wire::DATAGRAM_HEAD + data.len());
            wire::datagram(&mut d, wire_flow, data);
            let len = d.len();
            let fits = c.conn.datagrams().max_size().is_some_and(|max| len <= max);
            if fits && c.conn.datagrams().send(Bytes::from(d), true).is_ok() {
                self.m.bytes_out.add(len as u64);
                self.m.frames_out.add(1);
            } else {
                self.m.datagrams_dropped.add(1);
            }
            // Its bytes are the producer's credit again, delivered or not (UDP).
            self.push(local, StreamKind::Ack, data.len() as u64, b"");
            return;
        }
        let Some(&id) = c.flow_stream.get(&wire_flow) else {
            self.m.orphans.add(1);
            return;
        };
        let mut b = Vec::new();
        if kind == StreamKind::Data && data.len() > wire::MAX_DATA {
            for chunk in data.chunks(wire::MAX_DATA) {
                wire::frame(&mut b, wire_flow, kind, 0, chunk);
                self.m.frames_out.add(1);
            }
        } else {
            wire::frame(&mut b, wire_flow, kind, extra, data);
            self.m.frames_out.add(1);
        }
        self.m.bytes_out.add(b.len() as u64);
        c.send(id, &b);
    }

    /// Writes what the connections have to send: up to [`batch::MAX_SEGMENTS`] datagrams a poll (quinn-proto makes
    /// them equal-sized for GSO), sent together by the outbox.
    fn transmit(&mut self, now: Instant) {
        let mut buf = std::mem::take(&mut self.buf);
        for c in self.conns.values_mut() {
            loop {
                buf.clear();
                let Some(t) = c.conn.poll_transmit(now, batch::MAX_SEGMENTS, &mut buf) else { break };
                for d in buf[..t.size].chunks(t.segment_size.unwrap_or(t.size).max(1)) {
                    self.out.push(t.destination, d);
                }
            }
        }
        self.buf = buf;
        if !self.out.is_empty() {
            self.out.flush(self.net.socket());
        }
    }

    /// The timerfd at the connections' earliest timer (disarmed when none).
    fn arm_timer(&mut self) {
        let next = self.conns.values_mut().filter_map(|c| c.conn.poll_timeout()).min();
        if next == self.timer_at {
            return;
        }
        self.timer_at = next;
        let r = match next {
            Some(t) => {
                let d = t.saturating_duration_since(Instant::now()).max(Duration::from_micros(1));
                self.timer.set(Expiration::OneShot(TimeSpec::from_duration(d)), TimerSetTimeFlags::empty())
            }
            None => self.timer.unset(),
        };
        if let Err(e) = r {
            tracing::error!(error = %e, "quic carrier: cannot arm its timer");
        }
    }

    /// Handshakes that take too long, the meters.
    fn tick(&mut self, now: Instant) {
        let late: Vec<ConnectionHandle> = self
            .conns
            .iter()
            .filter(|(_, c)| !c.up && !c.dead && now - c.since > HANDSHAKE_TIMEOUT)
            .map(|(h, _)| *h)
            .collect();
        for ch in late {
            self.close(ch, End::Refused("no handshake within 5 s".into()), now);
        }
        let expired: usize = self.conns.values_mut().map(|c| c.held.expire(now)).sum();
        self.m.orphans.add(expired as u64);
        self.drive(now);
        self.m.flows_active.set(self.mode.active() as u64);
        let live = self.conns.values().fold(Totals::default(), |t, c| t.add(Totals::of(&c.conn)));
        let all = self.closed.add(live);
        self.m.lost_packets.set(all.lost);
        self.m.udp_bytes_out.set(all.tx);
        self.m.udp_bytes_in.set(all.rx);
        if let Some(c) = self.conns.values().filter(|c| c.up).max_by_key(|c| c.since) {
            let s = c.conn.stats();
            self.m.rtt_us.set(s.path.rtt.as_micros() as u64);
            self.m.cwnd.set(s.path.cwnd);
        }
        self.mode.report_counts(&self.m);
    }
}

/// The connecting side, once the handshake is done: the control stream and its `Hello`.
fn open_control(c: &mut Conn, m: &Meters, cfg: &Config) {
    let Some(id) = c.conn.streams().open(Dir::Bi) else { return };
    c.control = Some(id);
    let mut hello = Vec::new();
    wire::hello(&mut hello, &caps(cfg));
    m.bytes_out.add(hello.len() as u64);
    m.frames_out.add(1);
    c.send(id, &hello);
}

impl Drop for Quic {
    /// The module goes (its stack unloaded): the peers are told at once rather than by the idle timeout.
    fn drop(&mut self) {
        let now = Instant::now();
        for c in self.conns.values_mut() {
            c.conn.close(now, VarInt::from_u32(CLOSE_CODE), Bytes::from_static(b"unloaded"));
        }
        self.transmit(now);
    }
}

/// The name of the congestion controller connection `c` runs (read back from quinn-proto, not from the setting).
fn controller(c: &quinn_proto::Connection) -> &'static str {
    let any = c.congestion_state().clone_box().into_any();
    if any.is::<quinn_proto::congestion::Bbr>() {
        "bbr"
    } else if any.is::<quinn_proto::congestion::Cubic>() {
        "cubic"
    } else if any.is::<quinn_proto::congestion::NewReno>() {
        "newreno"
    } else {
        "other"
    }
}

fn self_connects(mode: &Mode) -> bool {
    matches!(mode, Mode::Connect { .. })
}

impl FrameEngine for Quic {
    fn read_frame(&mut self, buf: &mut Vec<u8>, meta: &mut Metadata) -> std::io::Result<bool> {
        if self.ready.is_empty() {
            let _ = self.kick.read();
            let _ = nix::unistd::read(&self.timer, &mut [0u8; 8]); // clears an expiry (non-blocking)
            self.timer_at = None;
            self.drive(Instant::now());
        }
        Ok(pop_ready(&mut self.ready, buf, meta))
    }

    fn write_frames(&mut self, packets: &[&Packet]) {
        Quic::write_frames(self, packets);
    }
}

impl CarrierEngine for Quic {
    carrier_engine_common!();

    fn send_switch(&mut self, local: u64, flags: u8, offset: u64) {
        let Some((ch, wire_flow)) = self.mode.target(local) else { return };
        let Some(c) = self.conns.get_mut(&ch) else { return };
        if !c.flow_stream.contains_key(&wire_flow) {
            // The connecting side: the flow starts here, on a stream of its own.
            let Some(id) = c.conn.streams().open(Dir::Bi) else {
                self.m.flows_limited.add(1);
                return;
            };
            c.flow_stream.insert(wire_flow, id);
            c.stream_flow.insert(id, wire_flow);
        }
        if flags & wire::SWITCH_UDP != 0 {
            c.udp.insert(wire_flow);
        }
        let Some(&id) = c.flow_stream.get(&wire_flow) else { return };
        let mut b = Vec::new();
        wire::switch(&mut b, wire_flow, flags, offset);
        self.m.frames_out.add(1);
        self.m.bytes_out.add(b.len() as u64);
        c.send(id, &b);
        let now = Instant::now();
        self.transmit(now);
        self.arm_timer();
    }

    fn detach(&mut self, local: u64) {
        if let Some((ch, remote)) = self.mode.detach(local) {
            if let Some(c) = self.conns.get_mut(&ch) {
                c.remote.remove(&remote);
                c.end_flow(remote);
            }
        }
    }

    fn tick(&mut self, now: Instant) {
        Quic::tick(self, now);
        self.kick();
    }
}
