//! What both kernel endpoints share: their flows (a kernel socket each), the stream protocol with its credit, and
//! the inner epoll the data plane waits on.
//!
//! The data plane sees one file descriptor per endpoint, an epoll instance holding the endpoint's sockets (and, for
//! `terminate`, its listeners) and an eventfd ("kick"). When it is readable the data plane calls
//! [`Engine::read_frame`] until it answers false: each call hands out one stream frame — an event waiting
//! (`Open`, `Fin`, `Abort`, `Ack`), or one chunk read from a socket straight into the pooled buffer (`Data`). Stream
//! frames for the endpoint reach [`Engine::write_frames`] (through the module's egress queue); what they cause
//! (acks, an `Open` after a connect) waits as events, and the kick wakes the data plane to take them.
//!
//! Backpressure: a socket is in the epoll set for reading only while its flow may send (`Credit::room` above 0,
//! and the flow accepted); without credit it is left unread, its receive buffer fills and the kernel closes the
//! peer's window. Bytes for a socket whose send buffer is full wait in the flow's queue (at most what the other
//! endpoint's budget lets it send, and `queue_limit`), and are acked once the kernel took them.

use crate::peer::batch::Outbox;
use flexstack_core::frame::{MetaKey, Metadata};
use flexstack_core::stream::{Credit, FlowInfo, Role, StreamEvent, StreamKind};
use flexstack_core::{Direction, Meter, Packet};
use flexstack_modules::stream::backend::{Config, Meters, Side};
use flexstack_modules::stream::matcher::MatchTable;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::socket::{setsockopt, sockopt};
use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Epoll token of the kick eventfd.
const KICK: u64 = 0;
/// Epoll token of listener `i`: `LISTENER + i` (flow ids stay far below).
const LISTENER: u64 = 1 << 62;
/// Epoll token of the server role's UDP socket `i` (originate): `UDP_LISTENER + i`.
const UDP_LISTENER: u64 = 1 << 61;
/// Largest UDP datagram read.
pub(crate) const MAX_DATAGRAM: usize = 65_535;

/// A flow's kernel socket.
pub(crate) enum Sock {
    Tcp(TcpStream),
    Udp(UdpSocket),
}

impl Sock {
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Sock::Tcp(s) => s.as_fd(),
            Sock::Udp(s) => s.as_fd(),
        }
    }
}

/// One flow.
pub(crate) struct Flow {
    /// The flow as described in its `Open` (originate: with the source address its socket got).
    pub(crate) info: FlowInfo,
    pub(crate) sock: Sock,
    pub(crate) credit: Credit,
    /// Bytes its socket did not take yet (copied out of their frames: packets stay on the data-plane thread).
    queue: VecDeque<Vec<u8>>,
    queue_off: usize,
    pub(crate) queued: u64,
    to_ack: u64,
    /// It may read its socket: terminate, once `Open` came back up; originate, once connected (UDP: at once).
    accepted: bool,
    /// originate TCP: the connect is under way.
    connecting: bool,
    /// Its socket's read side ended (`Fin` sent).
    eof: bool,
    /// `Fin` arrived for the direction it writes.
    fin_in: bool,
    /// Its socket's write side was shut after that `Fin`.
    shut: bool,
    /// In the readable list.
    listed: bool,
    /// What it is registered for in the epoll set (`None`: not registered).
    interest: Option<EpollFlags>,
    /// TCP: the far side must have accepted by then; UDP: the idle deadline.
    deadline: Option<Instant>,
    /// UDP: the datagrams its socket's full receive buffer dropped, as the kernel last said (`SO_RXQ_OVFL`).
    rxq_dropped: u32,
    /// Stream bytes it read and sent (`Data` out), and wrote to its socket (`Data` in).
    pub(crate) bytes_out: u64,
    pub(crate) bytes_in: u64,
    /// The congestion control of its socket, as last set.
    pub(crate) cc: String,
    /// In the touched list (see `Engine::touched`).
    touched: bool,
    /// Its bytes queued and in flight as counted in `Engine::held`.
    counted: (u64, u64),
    /// UDP of the server role (originate): datagrams of the flow that reached the endpoint's UDP socket on its port
    /// (the first, and those before the flow's own socket existed), handed out before its socket is read.
    pub(crate) inbox: VecDeque<Vec<u8>>,
}

impl Flow {
    pub(crate) fn new(info: FlowInfo, sock: Sock) -> Flow {
        Flow {
            info,
            sock,
            credit: Credit::default(),
            queue: VecDeque::new(),
            queue_off: 0,
            queued: 0,
            to_ack: 0,
            accepted: false,
            connecting: false,
            rxq_dropped: 0,
            eof: false,
            fin_in: false,
            shut: false,
            listed: false,
            interest: None,
            deadline: None,
            bytes_out: 0,
            bytes_in: 0,
            cc: String::new(),
            touched: false,
            counted: (0, 0),
            inbox: VecDeque::new(),
        }
    }

    fn tcp(&self) -> bool {
        matches!(self.sock, Sock::Tcp(_))
    }

    /// Files it in `list` (the engine's touched flows) unless it is there.
    fn touch(&mut self, list: &mut Vec<u64>, id: u64) {
        if !self.touched {
            self.touched = true;
            list.push(id);
        }
    }

    /// What it should be registered for: reading while it may send, writing while it connects or has bytes queued.
    fn wanted(&self, budget: u64) -> EpollFlags {
        let mut f = EpollFlags::empty();
        if self.accepted && !self.eof && (!self.tcp() || self.credit.room(budget) > 0) {
            f |= EpollFlags::EPOLLIN;
        }
        if self.connecting || !self.queue.is_empty() {
            f |= EpollFlags::EPOLLOUT;
        }
        f
    }
}

/// What one read of a flow's socket gave.
enum ReadOutcome {
    /// `n` bytes (or one datagram of `n` bytes) in the buffer.
    Bytes(usize),
    /// It may not read now (no credit, not accepted, ended).
    Stop,
    /// The peer's FIN.
    End,
    Failed(std::io::Error),
}

/// A stream frame waiting to be handed out (every kind but `Data`, which is read when handed out).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Event {
    Open(u64, FlowInfo),
    Fin(u64),
    Abort(u64, &'static str),
    Ack(u64, u64),
}

/// Writes `event` as a stream frame: its bytes into `buf`, its flow and kind into `meta`.
pub(crate) fn encode(event: &Event, buf: &mut Vec<u8>, meta: &mut Metadata) {
    buf.clear();
    let (id, kind, extra) = match event {
        Event::Open(id, info) => {
            info.encode(buf);
            (*id, StreamKind::Open, 0)
        }
        Event::Fin(id) => (*id, StreamKind::Fin, 0),
        Event::Abort(id, reason) => {
            buf.extend_from_slice(reason.as_bytes());
            (*id, StreamKind::Abort, 0)
        }
        Event::Ack(id, n) => (*id, StreamKind::Ack, *n),
    };
    set_meta(meta, id, kind, extra);
}

fn set_meta(meta: &mut Metadata, id: u64, kind: StreamKind, extra: u64) {
    *meta = Metadata::default();
    meta.set(MetaKey::FLOW_ID, id);
    meta.set(MetaKey::STREAM, kind as u64 | extra << 8);
}

/// The reason an `Abort` gives for a socket error.
pub(crate) fn reason(e: &std::io::Error, connecting: bool) -> &'static str {
    match e.raw_os_error() {
        Some(libc::ECONNREFUSED) if connecting => "refused",
        Some(libc::EHOSTUNREACH | libc::ENETUNREACH | libc::EHOSTDOWN | libc::ENETDOWN) => "unreachable",
        Some(libc::ETIMEDOUT) => "timeout",
        _ => "reset",
    }
}

/// Resets a TCP connection: SO_LINGER 0, then close sends RST instead of FIN.
pub(crate) fn reset(sock: Sock) {
    if let Sock::Tcp(s) = &sock {
        let _ = setsockopt(s, sockopt::Linger, &libc::linger { l_onoff: 1, l_linger: 0 });
    }
    drop(sock);
}

/// The app's network namespace and the daemon's, open: `terminate` enters the app's to open the server role's
/// connections (see [`Engine::open_app`]).
pub(crate) struct Namespaces {
    own: std::fs::File,
    app: std::fs::File,
}

impl Namespaces {
    /// Opens the daemon's namespace (the calling thread's, which the data plane shares) and `netns`.
    pub(crate) fn open(netns: &str) -> Result<Namespaces, String> {
        let own = std::fs::File::open("/proc/thread-self/ns/net").map_err(|e| format!("the own namespace: {e}"))?;
        let app = std::fs::File::open(format!("/run/netns/{netns}"))
            .map_err(|e| format!("network namespace {netns}: {e}"))?;
        Ok(Namespaces { own, app })
    }

    /// Runs `f` with the calling thread in the app's namespace, then back in the daemon's.
    pub(crate) fn run<T>(&self, f: impl FnOnce() -> std::io::Result<T>) -> std::io::Result<T> {
        use nix::sched::{setns, CloneFlags};
        setns(&self.app, CloneFlags::CLONE_NEWNET)?;
        let result = f();
        // As in `in_netns`: coming back cannot fail where going there worked; if it did, this thread would go on in
        // the app's namespace, which must not happen silently.
        setns(&self.own, CloneFlags::CLONE_NEWNET).expect("returning to the daemon's network namespace");
        result
    }
}

/// Sets the congestion control of TCP socket `s` (`TCP_CONGESTION`): any the kernel offers
/// (`net.ipv4.tcp_available_congestion_control`).
pub(crate) fn set_cc(s: &TcpStream, name: &str) -> std::io::Result<()> {
    setsockopt(s, sockopt::TcpCongestion, &std::ffi::OsString::from(name)).map_err(std::io::Error::from)
}

/// The congestion control of TCP socket `s`.
pub(crate) fn cc_of(s: &TcpStream) -> String {
    nix::sys::socket::getsockopt(s, sockopt::TcpCongestion)
        .map(|n| n.to_string_lossy().trim_end_matches('\0').to_string())
        .unwrap_or_default()
}

/// Sockets the kernel endpoints of this process hold (one per flow and endpoint).
static SOCKETS: AtomicU64 = AtomicU64::new(0);

/// Descriptors left to the rest of the daemon (control and app-variable connections, TUN devices, captures, state
/// files): the kernel endpoints refuse new flows rather than take them.
const RESERVED_FILES: u64 = 256;

/// True if the kernel endpoints may open `n` more sockets without eating into [`RESERVED_FILES`] of the process's
/// limit of open files (read each time: `prlimit` may change it).
pub(crate) fn room_for_sockets(n: u64) -> bool {
    let limit = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).map_or(u64::MAX, |l| l.0);
    SOCKETS.load(Ordering::Relaxed) + n + RESERVED_FILES <= limit
}

/// A descriptor to hold in reserve (see `Engine::spare`).
pub(crate) fn spare_descriptor() -> Option<std::fs::File> {
    std::fs::File::open("/dev/null").ok()
}

/// What the endpoint that accepts connections has (terminate; originate with the server role): its match table (to
/// count which rule selected each connection), one meter per rule, and the app's name.
pub(crate) struct AppSide {
    pub(crate) matcher: MatchTable,
    pub(crate) hits: Vec<Meter>,
    pub(crate) app: String,
}

/// The engine of one kernel endpoint.
pub(crate) struct Engine {
    pub(crate) side: Side,
    epoll: Arc<Epoll>,
    kick: EventFd,
    pub(crate) listeners: Vec<TcpListener>,
    /// originate with the server role: the UDP sockets its TPROXY rules send the network's datagrams to, each with
    /// its receive buffer's drops as the kernel last said (`SO_RXQ_OVFL`).
    pub(crate) udp_listeners: Vec<(UdpSocket, u32)>,
    /// Their flows by (client, original destination).
    pub(crate) udp_server: HashMap<(std::net::SocketAddr, std::net::SocketAddr), u64>,
    /// The buffer datagrams are received into from them.
    pub(crate) scratch: Vec<u8>,
    /// The listeners are out of the epoll set (see `pause_listeners`).
    listeners_paused: bool,
    pub(crate) flows: HashMap<u64, Flow>,
    pending: VecDeque<Event>,
    readable: VecDeque<u64>,
    /// Flows written to by the current `write_frames` (to ack).
    written: Vec<u64>,
    /// The datagrams of UDP flow `out.0` that `write_frames` has not sent yet: they leave together (one system call
    /// per run of equal sizes, UDP GSO) when a frame of another flow comes or the batch ends.
    out: (u64, Outbox),
    pub(crate) cfg: Config,
    pub(crate) m: Meters,
    /// Flows started and ended since the module last looked (it registers and removes their meters).
    pub(crate) born: Vec<u64>,
    pub(crate) gone: Vec<u64>,
    pub(crate) next_id: u64,
    /// Congestion control of new TCP sockets (None: the kernel's default).
    pub(crate) cc: Option<String>,
    tcp_count: u64,
    udp_count: u64,
    /// Bytes queued and in flight, summed over the flows as last counted (see `settle`).
    held: (u64, u64),
    /// Flows whose state changed since the module last looked (`update` files them): only these are counted
    /// again and have their meters refreshed, so that thousands of idle flows cost nothing per tick.
    touched: Vec<u64>,
    /// No deadline of any flow is earlier (`tick` walks the flows only once it has passed).
    earliest: Option<Instant>,
    /// terminate: the smoltcp back-end beside it has the UDP flows (see `counts`).
    pub(crate) shares_udp: bool,
    /// The endpoint that accepts (terminate; originate with the server role): its match table and app.
    pub(crate) app: Option<AppSide>,
    /// terminate: the app's namespace and the daemon's (the server role's connections are opened in the app's).
    pub(crate) netns: Option<Namespaces>,
    /// A descriptor held in reserve: out of descriptors, the app side closes it to accept and reset the waiting
    /// connection, so that the app sees a refusal at once instead of waiting in the backlog.
    pub(crate) spare: Option<std::fs::File>,
    /// It said once that it ran out of descriptors.
    pub(crate) warned_no_files: bool,
}

impl Engine {
    /// An engine with an empty epoll set (and the kick in it).
    pub(crate) fn new(side: Side, cfg: Config, m: Meters) -> std::io::Result<Engine> {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        let kick = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)?;
        epoll.add(&kick, EpollEvent::new(EpollFlags::EPOLLIN, KICK))?;
        let cc = match cfg.cc.name() {
            "none" => None,
            name => Some(name.to_string()),
        };
        Ok(Engine {
            side,
            epoll: Arc::new(epoll),
            kick,
            listeners: Vec::new(),
            udp_listeners: Vec::new(),
            udp_server: HashMap::new(),
            scratch: Vec::new(),
            listeners_paused: false,
            flows: HashMap::new(),
            pending: VecDeque::new(),
            readable: VecDeque::new(),
            written: Vec::new(),
            out: (0, Outbox::default()),
            cfg,
            m,
            born: Vec::new(),
            gone: Vec::new(),
            next_id: 0,
            cc,
            tcp_count: 0,
            udp_count: 0,
            held: (0, 0),
            touched: Vec::new(),
            earliest: None,
            shares_udp: false,
            app: None,
            netns: None,
            spare: None,
            warned_no_files: false,
        })
    }

    /// The epoll instance the data plane waits on.
    pub(crate) fn epoll(&self) -> Arc<Epoll> {
        self.epoll.clone()
    }

    /// The direction of the stream frames it emits.
    fn dir(&self) -> Direction {
        self.side.out_dir()
    }

    pub(crate) fn add_listener(&mut self, l: TcpListener) -> std::io::Result<()> {
        let token = LISTENER + self.listeners.len() as u64;
        self.epoll.add(&l, EpollEvent::new(EpollFlags::EPOLLIN, token))?;
        self.listeners.push(l);
        Ok(())
    }

    /// Watches a UDP socket of the server role (see `udp_listeners`).
    pub(crate) fn add_udp_listener(&mut self, s: UdpSocket) -> std::io::Result<()> {
        let token = UDP_LISTENER + self.udp_listeners.len() as u64;
        self.epoll.add(&s, EpollEvent::new(EpollFlags::EPOLLIN, token))?;
        count_socket_drops(&s);
        self.udp_listeners.push((s, 0));
        Ok(())
    }

    /// Takes the listeners out of the epoll set until the next [`Engine::tick`] (accepting failed).
    pub(crate) fn pause_listeners(&mut self) {
        if !self.listeners_paused {
            self.listeners_paused = true;
            for l in &self.listeners {
                let _ = self.epoll.delete(l);
            }
        }
    }

    pub(crate) fn push(&mut self, e: Event) {
        self.pending.push_back(e);
    }

    /// Wakes the data plane if frames wait to be handed out.
    pub(crate) fn kick_if_pending(&self) {
        if !self.pending.is_empty() || !self.readable.is_empty() {
            let _ = self.kick.write(1);
        }
    }

    pub(crate) fn tcp_count(&self) -> u64 {
        self.tcp_count
    }

    pub(crate) fn udp_count(&self) -> u64 {
        self.udp_count
    }

    /// Files a new flow (accepted or opened) and registers its socket as it needs.
    pub(crate) fn insert(&mut self, id: u64, mut f: Flow, accepted: bool, connecting: bool, deadline: Option<Instant>) {
        f.accepted = accepted;
        f.connecting = connecting;
        f.deadline = deadline;
        if let Some(d) = deadline {
            self.note_deadline(d);
        }
        if f.tcp() {
            self.tcp_count += 1;
            self.m.tcp_total.add(1);
        } else {
            if let Sock::Udp(s) = &f.sock {
                count_socket_drops(s);
            }
            self.udp_count += 1;
            self.m.udp_total.add(1);
        }
        self.flows.insert(id, f);
        SOCKETS.fetch_add(1, Ordering::Relaxed);
        self.born.push(id);
        self.update(id);
        self.counts();
    }

    /// Sets its gauges: connections, and the bytes held as last summed. With `shares_udp`, the UDP flows and the
    /// bytes the smoltcp back-end beside it holds for them are that one's (it writes the same gauges: the module
    /// calls this after each of its calls, so the kernel's connections are what the gauges show).
    pub(crate) fn counts(&self) {
        self.m.tcp_active.set(self.tcp_count);
        if !self.shares_udp {
            self.m.udp_active.set(self.udp_count);
        }
        self.m.buffered.set(self.held.0);
        self.m.in_flight.set(self.held.1);
    }

    /// Counts again the bytes held by the flows touched since the last call, sets the gauges, and returns those
    /// flows (whose meters the module refreshes).
    pub(crate) fn gauges(&mut self) -> Vec<u64> {
        let touched = std::mem::take(&mut self.touched);
        for id in &touched {
            let Some(f) = self.flows.get_mut(id) else { continue };
            f.touched = false;
            let now = (f.queued, f.credit.in_flight());
            let was = std::mem::replace(&mut f.counted, now);
            self.held = (self.held.0 - was.0 + now.0, self.held.1 - was.1 + now.1);
        }
        self.counts();
        touched
    }

    /// Files a deadline of a flow (see `earliest`).
    fn note_deadline(&mut self, d: Instant) {
        self.earliest = Some(self.earliest.map_or(d, |e| e.min(d)));
    }

    /// Registers flow `id`'s socket for what it needs now.
    fn update(&mut self, id: u64) {
        let budget = self.cfg.budget;
        let Some(f) = self.flows.get_mut(&id) else { return };
        f.touch(&mut self.touched, id);
        let want = f.wanted(budget);
        if f.interest == Some(want) {
            return;
        }
        let fd = f.sock.fd();
        let result = match (f.interest, want.is_empty()) {
            (None, true) => Ok(()),
            (Some(_), true) => self.epoll.delete(fd),
            (None, false) => self.epoll.add(fd, EpollEvent::new(want, id)),
            (Some(_), false) => self.epoll.modify(fd, &mut EpollEvent::new(want, id)),
        };
        match result {
            Ok(()) => f.interest = (!want.is_empty()).then_some(want),
            Err(e) => tracing::warn!(flow = id, error = %e, "cannot watch a flow's socket"),
        }
        // A flow that may read again is read at once (level-triggered epoll reports it too, a round later).
        if want.contains(EpollFlags::EPOLLIN) && !f.listed {
            f.listed = true;
            self.readable.push_back(id);
        }
    }

    /// Files flow `id` to be read (its socket, or its inbox).
    pub(crate) fn wake(&mut self, id: u64) {
        if let Some(f) = self.flows.get_mut(&id) {
            if !f.listed {
                f.listed = true;
                self.readable.push_back(id);
            }
        }
    }

    /// Forgets flow `id` (its socket closes normally).
    pub(crate) fn remove(&mut self, id: u64) -> Option<Flow> {
        let f = self.flows.remove(&id)?;
        SOCKETS.fetch_sub(1, Ordering::Relaxed);
        self.held = (self.held.0 - f.counted.0, self.held.1 - f.counted.1);
        if f.interest.is_some() {
            let _ = self.epoll.delete(f.sock.fd());
        }
        if f.tcp() {
            self.tcp_count -= 1;
        } else {
            self.udp_count -= 1;
            if self.udp_server.get(&(f.info.src, f.info.dst)) == Some(&id) {
                self.udp_server.remove(&(f.info.src, f.info.dst));
            }
        }
        self.gone.push(id);
        self.counts();
        Some(f)
    }

    /// Sends `Abort(reason)` for flow `id`, resets its socket and forgets it.
    pub(crate) fn abort(&mut self, id: u64, reason: &'static str) {
        self.m.aborts_sent.add(1);
        self.pending.push_back(Event::Abort(id, reason));
        if let Some(f) = self.remove(id) {
            reset(f.sock);
        }
    }

    /// Hands out one stream frame, if one is ready; `Ok(false)` when none is.
    pub(crate) fn read_frame(&mut self, buf: &mut Vec<u8>, meta: &mut Metadata) -> std::io::Result<bool> {
        let mut polled = false;
        loop {
            if let Some(e) = self.pending.pop_front() {
                encode(&e, buf, meta);
                return Ok(true);
            }
            while let Some(id) = self.readable.pop_front() {
                if let Some(f) = self.flows.get_mut(&id) {
                    f.listed = false;
                }
                if self.read_one(id, buf, meta) {
                    return Ok(true);
                }
                if !self.pending.is_empty() {
                    break;
                }
            }
            if !self.pending.is_empty() {
                continue;
            }
            if polled {
                buf.clear();
                return Ok(false);
            }
            polled = true;
            self.poll_events()?;
        }
    }

    /// Takes the events of the epoll set without waiting: new connections, sockets readable or writable.
    fn poll_events(&mut self) -> std::io::Result<()> {
        let mut events = [EpollEvent::empty(); 64];
        let n = match self.epoll.wait(&mut events, EpollTimeout::ZERO) {
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => 0,
            Err(e) => return Err(e.into()),
        };
        for ev in &events[..n] {
            let (token, flags) = (ev.data(), ev.events());
            if token == KICK {
                let _ = self.kick.read();
            } else if token >= LISTENER {
                self.accept_all((token - LISTENER) as usize);
            } else if token >= UDP_LISTENER {
                self.receive_all((token - UDP_LISTENER) as usize);
            } else {
                if flags.contains(EpollFlags::EPOLLOUT) {
                    self.writable(token);
                }
                let readish = EpollFlags::EPOLLIN | EpollFlags::EPOLLHUP | EpollFlags::EPOLLERR;
                if flags.intersects(readish) {
                    if let Some(f) = self.flows.get_mut(&token) {
                        if !f.listed {
                            f.listed = true;
                            self.readable.push_back(token);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Reads one chunk (TCP) or datagram (UDP) of flow `id` into `buf` as `Data`, if it may; true if it did.
    /// The end of its stream or an error becomes an event.
    fn read_one(&mut self, id: u64, buf: &mut Vec<u8>, meta: &mut Metadata) -> bool {
        let (budget, chunk, idle) = (self.cfg.budget, self.cfg.chunk, self.cfg.udp_timeout_ms);
        let udp_budget = self.cfg.udp_budget;
        let Some(f) = self.flows.get_mut(&id) else { return false };
        buf.clear();
        let outcome: ReadOutcome = if !f.accepted || f.eof {
            ReadOutcome::Stop
        } else {
            match &mut f.sock {
                Sock::Tcp(s) => {
                    let room = f.credit.room(budget).min(chunk) as usize;
                    if room == 0 {
                        ReadOutcome::Stop
                    } else {
                        buf.resize(room, 0);
                        match s.read(&mut buf[..room]) {
                            Ok(0) => ReadOutcome::End,
                            Ok(n) => ReadOutcome::Bytes(n),
                            Err(e) => ReadOutcome::Failed(e),
                        }
                    }
                }
                Sock::Udp(s) => loop {
                    // Datagrams the endpoint's UDP socket took for it first (the server role), then its own.
                    let received = match f.inbox.pop_front() {
                        Some(d) => {
                            buf.clear();
                            buf.extend_from_slice(&d);
                            Ok(d.len())
                        }
                        None => {
                            buf.resize(MAX_DATAGRAM, 0);
                            recv_counting(s, buf, &mut f.rxq_dropped, &self.m.udp_socket_drops)
                        }
                    };
                    match received {
                        Ok(n) => {
                            // Later than the one filed: `earliest` stays a lower bound.
                            f.deadline = Some(Instant::now() + Duration::from_millis(idle));
                            if f.credit.room(udp_budget) < (n as u64).max(1) {
                                self.m.udp_budget_drops.add(1); // as a full socket buffer drops it
                                continue;
                            }
                            break ReadOutcome::Bytes(n);
                        }
                        Err(e) => break ReadOutcome::Failed(e),
                    }
                },
            }
        };
        match outcome {
            ReadOutcome::Bytes(n) => {
                buf.truncate(n);
                set_meta(meta, id, StreamKind::Data, 0);
                f.credit.send(n as u64);
                f.bytes_out += n as u64;
                f.touch(&mut self.touched, id);
                self.m.bytes_out.add(n as u64);
                // More may wait: come back to it after the others.
                if !f.listed {
                    f.listed = true;
                    self.readable.push_back(id);
                }
                true
            }
            ReadOutcome::Stop => {
                buf.clear();
                self.update(id);
                false
            }
            ReadOutcome::End => {
                buf.clear();
                f.eof = true;
                self.pending.push_back(Event::Fin(id));
                self.update(id);
                self.maybe_done(id);
                false
            }
            ReadOutcome::Failed(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {
                buf.clear();
                false
            }
            ReadOutcome::Failed(e) => {
                buf.clear();
                // An ICMP port unreachable reaches a connected UDP socket as ECONNREFUSED.
                let udp = !f.tcp();
                let r = if udp && e.raw_os_error() == Some(libc::ECONNREFUSED) {
                    self.m.icmp_errors.add(1);
                    "unreachable"
                } else {
                    reason(&e, false)
                };
                self.abort(id, r);
                false
            }
        }
    }

    /// Flow `id`'s socket is writable: its connect finished, or its queue can move.
    fn writable(&mut self, id: u64) {
        let Some(f) = self.flows.get_mut(&id) else { return };
        if f.connecting {
            let Sock::Tcp(s) = &f.sock else { return };
            let error = match s.take_error() {
                Ok(None) => s.peer_addr().err(),
                Ok(Some(e)) | Err(e) => Some(e),
            };
            f.connecting = false;
            if let Some(e) = error {
                let r = reason(&e, true);
                if r == "timeout" {
                    self.m.timeouts.add(1);
                }
                self.m.refused.add(u64::from(r == "refused"));
                return self.abort(id, r);
            }
            if let Ok(local) = s.local_addr() {
                f.info.src = local;
            }
            f.accepted = true;
            f.deadline = None;
            let info = f.info.clone();
            self.pending.push_back(Event::Open(id, info));
        }
        self.flush(id);
        // What the kernel took is acked now (in `write_frames`, acks of a whole batch go out together).
        self.ack(id);
    }

    /// Writes what flow `id` has queued into its socket (acking it), shuts its write side after `Fin`, and forgets
    /// it when both directions are done.
    fn flush(&mut self, id: u64) {
        let Some(f) = self.flows.get_mut(&id) else { return };
        if f.connecting {
            return;
        }
        let mut failed = None;
        if let Sock::Tcp(s) = &mut f.sock {
            while let Some(front) = f.queue.front() {
                match s.write(&front[f.queue_off..]) {
                    Ok(n) => {
                        f.queue_off += n;
                        f.to_ack += n as u64;
                        f.queued -= n as u64;
                        if f.queue_off == front.len() {
                            f.queue.pop_front();
                            f.queue_off = 0;
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            if failed.is_none() && f.queue.is_empty() && f.fin_in && !f.shut {
                f.shut = true;
                let _ = s.shutdown(Shutdown::Write);
            }
        }
        if let Some(e) = failed {
            return self.abort(id, reason(&e, false));
        }
        self.update(id);
        self.maybe_done(id);
    }

    /// A TCP flow whose both directions ended is forgotten (its socket closes normally).
    fn maybe_done(&mut self, id: u64) {
        if self.flows.get(&id).is_some_and(|f| f.tcp() && f.eof && f.shut && f.queue.is_empty()) {
            self.ack(id);
            self.remove(id);
        }
    }

    /// Handles the stream frames that arrived for this endpoint, in order (an `Open` down makes a new flow's socket:
    /// `kernel_net`). Acks for what was written go out as events.
    pub(crate) fn write_frames(&mut self, packets: &[&Packet]) {
        for p in packets {
            self.stream_in(p);
        }
        self.send_datagrams();
        // Each flow written to in this batch, once: one ack of all it took.
        let mut ids = std::mem::take(&mut self.written);
        ids.sort_unstable();
        ids.dedup();
        for &id in &ids {
            self.ack(id);
        }
        ids.clear();
        self.written = ids;
        self.kick_if_pending();
    }

    /// Sends the datagrams waiting in `out` from their flow's socket (the flow may be gone: they are then dropped, as
    /// its socket would have been closed before they were sent).
    fn send_datagrams(&mut self) {
        let (id, out) = &mut self.out;
        if out.is_empty() {
            return;
        }
        let Some(Flow { sock: Sock::Udp(s), .. }) = self.flows.get(id) else {
            out.clear();
            return;
        };
        let (_, lost) = out.flush_connected(s);
        self.m.stream_bad.add(lost); // as a kernel drops a datagram it cannot send
    }

    /// Sends an ack of what flow `id` handed to its socket since the last one.
    fn ack(&mut self, id: u64) {
        let Some(f) = self.flows.get_mut(&id) else { return };
        let n = std::mem::take(&mut f.to_ack);
        if n > 0 {
            f.bytes_in += n;
            self.m.bytes_in.add(n);
            self.pending.push_back(Event::Ack(id, n));
        }
    }

    fn stream_in(&mut self, p: &Packet) {
        let (Some(id), Some(event)) = (p.stream_flow(), p.stream()) else {
            self.m.stream_bad.add(1);
            return;
        };
        // Datagrams of another flow waiting, or an event of this one that must come after them: out they go.
        if self.out.0 != id || !matches!(event, StreamEvent::Data(_)) {
            self.send_datagrams();
            self.out.0 = id;
        }
        if p.direction() == self.dir() {
            self.m.stream_bad.add(1); // its own direction: a loop in the links
            return;
        }
        if let StreamEvent::Open(info) = &event {
            // A new flow: originate opens the client role's towards the destination, terminate the server role's
            // into the app's namespace. An `Open` for a flow it has is the answer to its own (the far side
            // accepted), handled below.
            let known = self.flows.contains_key(&id);
            if self.side == Side::Net && !known {
                return self.open_net(id, info.clone());
            }
            if self.side == Side::App && !known && info.role == Role::Server {
                return self.open_app(id, info.clone());
            }
            if known && self.flows.get(&id).is_some_and(|f| f.accepted || f.connecting) {
                self.m.stream_bad.add(1); // a second Open
                return;
            }
        }
        let Some(f) = self.flows.get_mut(&id) else {
            self.m.stream_orphans.add(1);
            return;
        };
        f.touch(&mut self.touched, id);
        match event {
            StreamEvent::Open(_) => {
                // The far side accepted the flow this endpoint accepted (terminate: the client role's, originate: the
                // server role's): its peer's bytes may flow.
                f.accepted = true;
                f.deadline = None;
                self.update(id);
            }
            StreamEvent::Data(bytes) => {
                let len = bytes.len() as u64;
                match &f.sock {
                    Sock::Udp(_) => {
                        // Sent with the others of its flow in this batch (`send_datagrams`); the address is only
                        // the outbox's key: the connected socket writes to its own peer.
                        self.out.1.push(f.info.dst, bytes);
                        f.to_ack += len;
                        self.written.push(id);
                        f.deadline = Some(Instant::now() + Duration::from_millis(self.cfg.udp_timeout_ms));
                    }
                    Sock::Tcp(_) => {
                        if f.fin_in {
                            self.m.stream_bad.add(1); // data after Fin
                            return;
                        }
                        if f.queued + len > self.cfg.queue_limit {
                            self.m.overflows.add(1);
                            return self.abort(id, "overflow");
                        }
                        // Straight into the socket when nothing waits before it; what it does not take is queued.
                        let mut done = 0;
                        let mut failed = None;
                        if let (Sock::Tcp(s), true) = (&mut f.sock, f.queue.is_empty() && !f.connecting) {
                            while done < bytes.len() {
                                match s.write(&bytes[done..]) {
                                    Ok(n) => done += n,
                                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                                    Err(e) => {
                                        failed = Some(e);
                                        break;
                                    }
                                }
                            }
                        }
                        if let Some(e) = failed {
                            return self.abort(id, reason(&e, false));
                        }
                        f.to_ack += done as u64;
                        self.written.push(id);
                        if done < bytes.len() {
                            f.queued += (bytes.len() - done) as u64;
                            f.queue.push_back(bytes[done..].to_vec());
                        }
                        self.update(id);
                    }
                }
            }
            StreamEvent::Fin => {
                if f.tcp() {
                    f.fin_in = true;
                    self.flush(id);
                } else {
                    self.remove(id); // a UDP flow ended at the other end
                }
            }
            StreamEvent::Abort(_) => {
                self.m.aborts_received.add(1);
                if let Some(f) = self.remove(id) {
                    reset(f.sock);
                }
            }
            StreamEvent::Ack(n) => {
                if !f.credit.ack(n) {
                    self.m.stream_bad.add(1);
                }
                self.update(id);
            }
        }
    }

    /// Ends what is due at `now`: TCP flows whose far side did not accept in time, idle UDP flows.
    pub(crate) fn tick(&mut self, now: Instant) {
        if std::mem::take(&mut self.listeners_paused) {
            for (i, l) in self.listeners.iter().enumerate() {
                let _ = self.epoll.add(l, EpollEvent::new(EpollFlags::EPOLLIN, LISTENER + i as u64));
            }
        }
        if self.earliest.is_none_or(|e| e > now) {
            self.kick_if_pending();
            return;
        }
        let due: Vec<u64> =
            self.flows.iter().filter(|(_, f)| f.deadline.is_some_and(|d| d <= now)).map(|(id, _)| *id).collect();
        self.earliest = self.flows.values().filter_map(|f| f.deadline).filter(|d| *d > now).min();
        for id in due {
            if self.flows[&id].tcp() {
                self.m.timeouts.add(1);
                self.abort(id, "timeout");
            } else {
                self.pending.push_back(Event::Fin(id));
                self.remove(id);
            }
        }
        self.kick_if_pending();
    }

    /// The direction of TCP bytes it reads (`bytes_out`) is down for terminate, up for originate.
    pub(crate) fn out_is_down(&self) -> bool {
        self.dir() == Direction::Down
    }
}

/// Asks the kernel to tell, with each datagram read, how many its socket's full receive buffer dropped so far
/// (`SO_RXQ_OVFL`), so that such loss is counted ([`recv_counting`]) rather than unseen.
pub(crate) fn count_socket_drops(s: &UdpSocket) {
    if let Err(e) = setsockopt(s, sockopt::RxqOvfl, &1) {
        tracing::debug!(error = %e, "SO_RXQ_OVFL: the socket's drops will not be counted");
    }
}

/// Reads one datagram of `s` into `buf`; adds to `meter` the drops the kernel reports since `last` (its total
/// for the socket, from [`count_socket_drops`]).
pub(crate) fn recv_counting(s: &UdpSocket, buf: &mut [u8], last: &mut u32, meter: &Meter) -> std::io::Result<usize> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags, SockaddrStorage};
    let mut cmsg = nix::cmsg_space!(u32);
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let msg =
        recvmsg::<SockaddrStorage>(std::os::fd::AsRawFd::as_raw_fd(s), &mut iov, Some(&mut cmsg), MsgFlags::empty())?;
    for c in msg.cmsgs().into_iter().flatten() {
        if let ControlMessageOwned::RxqOvfl(total) = c {
            add_socket_drops(total, last, meter);
        }
    }
    Ok(msg.bytes)
}

/// Adds to `meter` the drops since `last` of a socket whose kernel count is now `total` (`SO_RXQ_OVFL`).
pub(crate) fn add_socket_drops(total: u32, last: &mut u32, meter: &Meter) {
    meter.add(u64::from(total.wrapping_sub(*last)));
    *last = total;
}

#[cfg(test)]
mod tests {
    use super::*;
    use flexstack_core::PacketPool;

    /// Datagrams a full receive buffer dropped are counted: 2,000 sent to a socket with the smallest buffer, none
    /// read meanwhile; then every one read, and one more sent (the kernel tells a socket's drops with the datagrams
    /// queued after them): what was read plus what the meter counts is what was sent.
    #[test]
    fn drops_at_a_full_socket_buffer_are_counted() {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        setsockopt(&rx, sockopt::RcvBuf, &1).unwrap(); // the kernel's minimum
        count_socket_drops(&rx);
        rx.set_nonblocking(true).unwrap();
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let sent = 2000;
        for i in 0..sent {
            tx.send_to(&[i as u8; 200], rx.local_addr().unwrap()).unwrap();
        }
        let (meter, mut last, mut buf, mut read) = (Meter::default(), 0, vec![0; 2048], 0u64);
        let mut drain = |read: &mut u64| {
            while recv_counting(&rx, &mut buf, &mut last, &meter).is_ok() {
                *read += 1;
            }
        };
        drain(&mut read);
        tx.send_to(b"after", rx.local_addr().unwrap()).unwrap();
        drain(&mut read);
        assert!(read > 1 && meter.get() > 0, "{read} read, {} counted dropped", meter.get());
        assert_eq!(read + meter.get(), sent + 1, "each one read or counted");
    }

    /// Events become stream frames that the core decodes back to the same events.
    #[test]
    fn events_encode_as_stream_frames() {
        let pool = PacketPool::default();
        let info = FlowInfo::tcp(
            "[2001:db8::2]:40000".parse().unwrap(),
            "[2001:db8::1]:80".parse().unwrap(),
            "curl",
            Role::Client,
        );
        let cases = [Event::Open(3, info.clone()), Event::Fin(4), Event::Abort(5, "refused"), Event::Ack(6, 1 << 40)];
        for e in &cases {
            let (mut buf, mut meta) = (Vec::new(), Metadata::default());
            encode(e, &mut buf, &mut meta);
            let mut p = pool.alloc_from(&buf);
            *p.meta_mut() = meta;
            let back = match p.stream().expect("a stream frame") {
                StreamEvent::Open(i) => Event::Open(p.stream_flow().unwrap(), i),
                StreamEvent::Fin => Event::Fin(p.stream_flow().unwrap()),
                StreamEvent::Abort(r) => {
                    Event::Abort(p.stream_flow().unwrap(), if r == "refused" { "refused" } else { "?" })
                }
                StreamEvent::Ack(n) => Event::Ack(p.stream_flow().unwrap(), n),
                StreamEvent::Data(_) => panic!("no data"),
            };
            assert_eq!(&back, e);
        }
    }

    #[test]
    fn socket_errors_map_to_abort_reasons() {
        let e = |n| std::io::Error::from_raw_os_error(n);
        assert_eq!(reason(&e(libc::ECONNREFUSED), true), "refused");
        assert_eq!(reason(&e(libc::ECONNREFUSED), false), "reset");
        assert_eq!(reason(&e(libc::EHOSTUNREACH), true), "unreachable");
        assert_eq!(reason(&e(libc::ETIMEDOUT), true), "timeout");
        assert_eq!(reason(&e(libc::ECONNRESET), false), "reset");
    }
}
