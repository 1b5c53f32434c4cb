//! The `udp` and `udpplus` carriers (docs/peers.md, "The udp and udpplus carriers"): a session per peer over one
//! non-blocking UDP socket per carrier, in the data plane's epoll loop like the other carriers (an eventfd, and a
//! timerfd armed at the earliest retransmission, NACK or handshake timer).
//!
//! - **Handshake** ([`dgram`]): the connecting side sends `Init` (an ephemeral X25519 key, its certificate, and its
//!   signature of both by the peer key the daemon already holds); the accepting side answers `Resp` only to a
//!   certificate whose fingerprint is in its table and whose signature holds, with its own ephemeral key, signed
//!   over both keys. The connecting side accepts only the certificate it pinned. Both derive a key per direction
//!   (HKDF-SHA256 over the X25519 secret, salted with the keys and fingerprints); every later datagram is sealed
//!   with the cipher the handshake chose (AES-256-GCM when both sides have version 2 of it, `Init2`/`Resp2`;
//!   ChaCha20-Poly1305 with a peer of version 1; `ring`), its packet number the nonce, and checked against a replay
//!   window. The
//!   accepting side keeps a session only once a sealed datagram from the other side opens (a replayed `Init` gets an
//!   answer nobody can use and no session).
//! - **Reliable stream** ([`reliable`](flexstack_modules::stream::carrier::reliable)): the peer protocol's
//!   messages (`Hello`, and every frame but UDP flows' data and acks) travel as on the `tcp` carrier, in one
//!   reliable byte stream per session (SACK, AIMD, flow control).
//! - **UDP flows' datagrams**: one sealed datagram each (`udp`); numbered, with NACKs and XOR parity (`udpplus`,
//!   [`plus`](flexstack_modules::stream::carrier::plus)). Unreliable as UDP is: the producer gets its credit back
//!   when the carrier sends.
//! - Datagrams that do not decode or authenticate count in `malformed_total`, authentic ones that come again in
//!   `replayed_total`; both are dropped and the session stays.

use super::batch::{self, Outbox};
use super::carrier::{
    caps, carrier_engine_common, check_hello, each_message, epoll_with_kick, listen_of_cfg, log_end, peer_of_cfg,
    pop_ready, switch_marker, switch_unasked, Builder, CarrierEngine, End, LogLimit, Modes, Ready, HANDSHAKE_TIMEOUT,
    MAX_CONNECTIONS,
};
use super::trust::{self, identity, report, Identity, Peer};
use super::uplinks::Sockets;
use crate::stream::{EpollDevice, FrameEngine};
use flexstack_core::frame::{MetaKey, Metadata};
use flexstack_core::stream::{FlowInfo, Protocol, StreamKind};
use flexstack_core::{Direction, Packet};
use flexstack_modules::stream::carrier::dgram::{self, Handshake, Item};
use flexstack_modules::stream::carrier::early::Early;
use flexstack_modules::stream::carrier::plus::{PlusRx, PlusTx};
use flexstack_modules::stream::carrier::reliable::{Receiver, Sender};
use flexstack_modules::stream::carrier::{wire, CarrierRequest, Config, Meters, Router, Transport};
use nix::sys::epoll::{EpollEvent, EpollFlags};
use nix::sys::eventfd::EventFd;
use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, CHACHA20_POLY1305};
use ring::agreement::{self, EphemeralPrivateKey, UnparsedPublicKey, X25519};
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, ECDSA_P256_SHA256_ASN1_SIGNING};
use std::collections::{HashMap, HashSet, VecDeque};
use std::io::ErrorKind;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Epoll tokens.
const TIMER: u64 = 2;
/// Datagrams read from a socket per pass, about (a GRO run counts as its datagrams, and is read whole): more at
/// once would reach the chain, and the originating side's receivers, in bursts their queues may not hold.
const READ_BATCH: usize = 256;
/// A session that hears nothing for this long is gone.
const IDLE: Duration = Duration::from_secs(10);
/// A session that sent nothing for this long sends a `Ping` (answered by an `Ack`).
const KEEPALIVE: Duration = Duration::from_secs(1);
/// The connecting side sends its `Init` again after this, until answered.
const INIT_AGAIN: Duration = Duration::from_millis(500);
/// Packet numbers remembered behind the highest (older ones are dropped as replayed).
const REPLAY_WINDOW: u64 = 8192;
/// The largest app datagram carried (what a UDP datagram takes, less the carrier's headers).
const MAX_APP_DATAGRAM: usize = 65_000;
/// Acknowledge after this many segments (and at the end of each batch read).
const ACK_EVERY: u32 = 8;
/// App datagrams a connecting side holds until its session has keys.
const MAX_EARLY: usize = 256;
/// Sealed datagrams from unknown addresses an accepting carrier tries against its sessions' keys per second.
const MAX_TRIED: u32 = 64;

/// Builds a `udp` or `udpplus` carrier from what the kind read.
pub(crate) fn build(req: CarrierRequest) -> Result<Builder<Dgram>, String> {
    let id = identity().ok_or("no peer identity: the daemon makes one in its state directory when it starts")?;
    let signer = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, id.key_der(), &SystemRandom::new())
        .map_err(|e| format!("the peer key is not an ECDSA P-256 key: {e}"))?;
    let (socket, mode) = if req.cfg.peer.is_empty() {
        let addr = listen_of_cfg(&req.cfg)?;
        let socket = UdpSocket::bind(addr).map_err(|e| format!("cannot listen on {addr} (UDP): {e}"))?;
        (
            Sockets::single(socket),
            Mode::Accept { server: (), flows: HashMap::new(), next_local: 1, ids: req.cfg.ids.clone() },
        )
    } else {
        let peer = peer_of_cfg(&req.cfg)?;
        (
            Sockets::connecting(&req.cfg.uplinks, peer.addr)?,
            Mode::Connect { peer, client: (), router: Router::default(), retry_at: None, conn: None },
        )
    };
    let plus = req.cfg.transport == Transport::Udpplus;
    socket.prepare(if plus { "udpplus" } else { "udp" })?;
    let make = move |cfg: &Config, m| dgram_device(socket, mode, id, signer, plus, cfg, m);
    Ok(Builder { req, make: Box::new(make) })
}

type Mode = Modes<(), (), u64>;

/// The device of a datagram carrier.
fn dgram_device(
    socket: Sockets,
    mode: Mode,
    id: &'static Identity,
    signer: EcdsaKeyPair,
    plus: bool,
    cfg: &Config,
    m: Meters,
) -> (Arc<EpollDevice<Dgram>>, bool) {
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
    let mut d = Dgram {
        net: socket,
        out: Outbox::default(),
        plus,
        mode,
        conns: HashMap::new(),
        by_addr: HashMap::new(),
        pending: HashMap::new(),
        next_token: 1,
        id,
        signer,
        rng: SystemRandom::new(),
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
        resent: 0,
        rate_at: (Instant::now(), 0),
        tried: (Instant::now(), 0),
    };
    if connect {
        d.connect(Instant::now());
        d.flush();
    }
    let dir = if connect { Direction::Up } else { Direction::Down };
    let kind = if plus { "udpplus" } else { "udp" };
    let name = format!("{kind}-{}", if connect { &cfg.peer } else { &cfg.listen });
    (Arc::new(EpollDevice::new(name, dir, Arc::new(epoll), d)), connect)
}

/// The keys of a session, one per direction, and the replay window of what it receives.
struct Keys {
    /// The cipher (`dgram::CHACHA20_POLY1305` or `dgram::AES_256_GCM`).
    cipher: u8,
    seal: LessSafeKey,
    open: LessSafeKey,
    /// The next packet number to send.
    number: u64,
    replay: Replay,
}

fn nonce(number: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&number.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

impl Keys {
    /// Derives the keys of `cipher` from the X25519 secret: HKDF-SHA256, salted with both ephemeral keys and both
    /// fingerprints (the connecting side's first), a label per direction and cipher; `connecting` says which
    /// direction this side seals.
    fn derive(secret: &[u8], salt: &[u8], connecting: bool, cipher: u8) -> Keys {
        let prk = ring::hkdf::Salt::new(ring::hkdf::HKDF_SHA256, salt).extract(secret);
        let (alg, labels): (_, [&[u8]; 2]) = if cipher == dgram::AES_256_GCM {
            (&AES_256_GCM, [b"flexstack udp aes-256-gcm c2s", b"flexstack udp aes-256-gcm s2c"])
        } else {
            (&CHACHA20_POLY1305, [b"flexstack udp c2s", b"flexstack udp s2c"])
        };
        let key = |label: &[u8]| {
            let info = [label];
            let okm = prk.expand(&info, alg).expect("a key's length");
            LessSafeKey::new(UnboundKey::from(okm))
        };
        let (c2s, s2c) = (key(labels[0]), key(labels[1]));
        let (seal, open) = if connecting { (c2s, s2c) } else { (s2c, c2s) };
        Keys { cipher, seal, open, number: 0, replay: Replay::default() }
    }

    /// Appends a sealed datagram to `out`: the item is what `plain` appends (sealed in place, where it lies).
    fn seal_into(&mut self, out: &mut Vec<u8>, plain: impl FnOnce(&mut Vec<u8>)) {
        let start = out.len();
        dgram::sealed_head(out, self.number);
        let head: [u8; dgram::SEALED_HEAD] = out[start..].try_into().expect("the head");
        plain(out);
        let tag = self
            .seal
            .seal_in_place_separate_tag(nonce(self.number), Aad::from(head), &mut out[start + dgram::SEALED_HEAD..])
            .expect("sealing never fails for these lengths");
        out.extend_from_slice(tag.as_ref());
        self.number += 1;
    }

    /// Seals `item` into a datagram.
    #[cfg(test)]
    fn seal(&mut self, item: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        self.seal_into(&mut out, |o| o.extend_from_slice(item));
        out
    }

    /// Opens a sealed datagram (`buf`, whole) in place: the item, or why not.
    fn open<'a>(&mut self, number: u64, buf: &'a mut [u8]) -> Result<&'a [u8], Opened> {
        if !self.replay.fresh(number) {
            // Checked again after opening: a forged packet number must not count as a replay.
            let head: [u8; dgram::SEALED_HEAD] = buf[..dgram::SEALED_HEAD].try_into().map_err(|_| Opened::Forged)?;
            let mut copy = buf[dgram::SEALED_HEAD..].to_vec();
            return match self.open.open_in_place(nonce(number), Aad::from(head), &mut copy) {
                Ok(_) => Err(Opened::Replayed),
                Err(_) => Err(Opened::Forged),
            };
        }
        let head: [u8; dgram::SEALED_HEAD] =
            buf.get(..dgram::SEALED_HEAD).ok_or(Opened::Forged)?.try_into().expect("9");
        let plain = self
            .open
            .open_in_place(nonce(number), Aad::from(head), &mut buf[dgram::SEALED_HEAD..])
            .map_err(|_| Opened::Forged)?;
        self.replay.set(number);
        Ok(plain)
    }
}

enum Opened {
    Forged,
    Replayed,
}

/// The packet numbers received: the highest, and a bitmap of the [`REPLAY_WINDOW`] below it.
struct Replay {
    top: Option<u64>,
    bits: Vec<u64>,
}

impl Default for Replay {
    fn default() -> Self {
        Replay { top: None, bits: vec![0; (REPLAY_WINDOW / 64) as usize] }
    }
}

impl Replay {
    fn bit(n: u64) -> (usize, u64) {
        (((n / 64) % (REPLAY_WINDOW / 64)) as usize, 1 << (n % 64))
    }

    fn fresh(&self, n: u64) -> bool {
        match self.top {
            None => true,
            Some(t) if n > t => true,
            Some(t) if t - n >= REPLAY_WINDOW - 64 => false,
            Some(_) => {
                let (w, b) = Replay::bit(n);
                self.bits[w] & b == 0
            }
        }
    }

    fn set(&mut self, n: u64) {
        let top = self.top.unwrap_or(0);
        if self.top.is_none() || n > top {
            // Clear the words between the old top's and the new one's (all of them after a long jump).
            let (from, to) = (if self.top.is_none() { 0 } else { top / 64 + 1 }, n / 64);
            let words = self.bits.len() as u64;
            for w in from..=to.min(from + words) {
                if w <= to {
                    self.bits[(w % words) as usize] = 0;
                }
            }
            self.top = Some(n);
        }
        let (w, b) = Replay::bit(n);
        self.bits[w] |= b;
    }
}

/// A handshake under way on the connecting side.
struct Dial {
    private: Option<EphemeralPrivateKey>,
    public: [u8; 32],
    /// `Init2` and `Init` of the same key: sent in turn (`sent` so far) until answered, a peer of version 1
    /// answering only `Init`.
    init: [Vec<u8>; 2],
    sent: u32,
    next_send: Instant,
}

/// An `Init` answered on the accepting side: the session is kept once a sealed datagram from it opens.
struct Pending {
    init_key: [u8; 32],
    resp: Vec<u8>,
    keys: Keys,
    peer: String,
    since: Instant,
}

/// A session with a peer.
struct Sess {
    addr: SocketAddr,
    peer: String,
    keys: Option<Keys>,
    dial: Option<Dial>,
    /// Hello received.
    up: bool,
    since: Instant,
    last_rx: Instant,
    last_tx: Instant,
    tx: Sender,
    rx: Receiver,
    /// Stream bytes in order, not decoded yet.
    plain: Vec<u8>,
    segs_unacked: u32,
    /// Accepting: the peer's flow id -> the local one.
    remote: HashMap<u64, u64>,
    /// UDP flows, by their id in messages.
    udp: HashSet<u64>,
    plus_tx: HashMap<u64, PlusTx>,
    plus_rx: HashMap<u64, PlusRx>,
    /// App datagrams (sealed items) waiting for the keys.
    early: Vec<Vec<u8>>,
    /// The peer's app datagrams that came before their flow's `Open`.
    held: Early,
    dead: bool,
}

impl Sess {
    fn new(addr: SocketAddr, peer: String, keys: Option<Keys>, now: Instant) -> Sess {
        Sess {
            addr,
            peer,
            keys,
            dial: None,
            up: false,
            since: now,
            last_rx: now,
            last_tx: now,
            tx: Sender::default(),
            rx: Receiver::default(),
            plain: Vec::new(),
            segs_unacked: 0,
            remote: HashMap::new(),
            udp: HashSet::new(),
            plus_tx: HashMap::new(),
            plus_rx: HashMap::new(),
            early: Vec::new(),
            held: Early::default(),
            dead: false,
        }
    }

    /// Queues peer-protocol messages on the reliable stream.
    fn write(&mut self, bytes: &[u8], m: &Meters) {
        m.bytes_out.add(bytes.len() as u64);
        self.tx.write(bytes);
    }

    /// The flow ended: forget its UDP state.
    fn end_flow(&mut self, flow: u64) {
        self.udp.remove(&flow);
        self.plus_tx.remove(&flow);
        self.plus_rx.remove(&flow);
    }

    fn rtt(&self) -> Duration {
        self.tx.srtt().unwrap_or(Duration::from_millis(50))
    }
}

/// Seals `item` for session `s` into the outbox (an app datagram waits for the keys when `early`).
fn send_item(out: &mut Outbox, s: &mut Sess, item: &Item<'_>, m: &Meters, now: Instant, early: bool) {
    let Some(keys) = s.keys.as_mut() else {
        if early && s.early.len() < MAX_EARLY {
            let mut plain = Vec::new();
            dgram::item(&mut plain, item);
            s.early.push(plain);
        } else if early {
            m.datagrams_dropped.add(1);
        }
        return;
    };
    out.push_with(s.addr, |b| keys.seal_into(b, |b| dgram::item(b, item)));
    s.last_tx = now;
}

/// Sends what the reliable stream of session `s` may send now.
fn pump(out: &mut Outbox, s: &mut Sess, m: &Meters, now: Instant) {
    if s.keys.is_none() {
        return;
    }
    let mut seg = Vec::new();
    while let Some(offset) = s.tx.poll(now, &mut seg) {
        let bytes = std::mem::take(&mut seg);
        send_item(out, s, &Item::Segment { offset, bytes: &bytes }, m, now, false);
        seg = bytes;
    }
}

/// Statistics of the sessions that are gone.
#[derive(Default, Clone, Copy)]
struct Totals {
    lost: u64,
    retransmits: u64,
}

impl Totals {
    fn of(s: &Sess) -> Totals {
        Totals { lost: s.tx.lost_total, retransmits: s.tx.retransmits }
    }

    fn add(self, o: Totals) -> Totals {
        Totals { lost: self.lost + o.lost, retransmits: self.retransmits + o.retransmits }
    }
}

/// The engine behind the device.
pub(crate) struct Dgram {
    /// The UDP socket, or one per uplink (`uplinks`).
    net: Sockets,
    /// What this pass sends, until [`Dgram::flush`].
    out: Outbox,
    /// Accepting: sealed datagrams from unknown addresses tried against the sessions' keys in the current second
    /// (a peer that moved to another uplink), and when that second began.
    tried: (Instant, u32),
    plus: bool,
    mode: Mode,
    /// Sessions by token.
    conns: HashMap<u64, Sess>,
    by_addr: HashMap<SocketAddr, u64>,
    /// Accepting: answered `Init`s.
    pending: HashMap<SocketAddr, Pending>,
    next_token: u64,
    id: &'static Identity,
    signer: EcdsaKeyPair,
    rng: SystemRandom,
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
    /// udpplus: datagrams resent on a NACK.
    resent: u64,
    /// When the rate was last measured, and `udp_bytes_out` then.
    rate_at: (Instant, u64),
}

impl Dgram {
    fn kind(&self) -> &'static str {
        if self.plus {
            "udpplus"
        } else {
            "udp"
        }
    }

    fn push(&mut self, flow: u64, kind: StreamKind, extra: u64, bytes: &[u8]) {
        self.ready.push_back(Ready { flow, kind, extra, bytes: bytes.to_vec() });
    }

    /// Sends what the outbox holds, from the active socket.
    fn flush(&mut self) {
        if !self.out.is_empty() {
            let sent = self.out.flush(self.net.socket());
            self.m.udp_bytes_out.add(sent);
        }
    }

    fn kick(&self) {
        if !self.ready.is_empty() {
            let _ = self.kick.write(1);
        }
    }

    fn sign(&self, msg: &[u8]) -> Vec<u8> {
        self.signer.sign(&self.rng, msg).map(|s| s.as_ref().to_vec()).unwrap_or_default()
    }

    /// Connect mode: starts a session (if none and not waiting to retry): its `Hello` is the stream's first bytes,
    /// sent once the handshake gives the keys; the `Init` goes now.
    fn connect(&mut self, now: Instant) {
        let Mode::Connect { peer, retry_at, conn, .. } = &self.mode else { return };
        if conn.is_some() || retry_at.is_some_and(|t| now < t) {
            return;
        }
        let peer: Peer = peer.clone();
        let Ok(private) = EphemeralPrivateKey::generate(&X25519, &self.rng) else { return };
        let Ok(public) = private.compute_public_key() else { return };
        let public: [u8; 32] = public.as_ref().try_into().expect("an X25519 key");
        let cert = self.id.cert_der();
        let offer = dgram::CIPHERS;
        let sig2 = self.sign(&[dgram::INIT2_CONTEXT, &public, &[offer]].concat());
        let mut init2 = Vec::new();
        dgram::handshake(&mut init2, &Handshake { ty: dgram::INIT2, ciphers: offer, key: public, cert, sig: &sig2 });
        let sig = self.sign(&[dgram::INIT_CONTEXT, &public].concat());
        let mut init = Vec::new();
        dgram::handshake(&mut init, &Handshake { ty: dgram::INIT, ciphers: 0, key: public, cert, sig: &sig });
        let init = [init2, init];
        let token = self.next_token;
        self.next_token += 1;
        let mut s = Sess::new(peer.addr, peer.name.clone(), None, now);
        s.dial = Some(Dial { private: Some(private), public, init, sent: 0, next_send: now });
        let mut hello = Vec::new();
        wire::hello(&mut hello, &caps(&self.cfg));
        self.m.frames_out.add(1);
        s.write(&hello, &self.m);
        self.conns.insert(token, s);
        self.by_addr.insert(peer.addr, token);
        if let Mode::Connect { conn, .. } = &mut self.mode {
            *conn = Some(token);
        }
        report(&peer.name, |st| st.state = "connecting".into());
        self.dial_timers(now);
    }

    /// Connect mode: sends the `Init` when due.
    fn dial_timers(&mut self, now: Instant) {
        for s in self.conns.values_mut() {
            let Some(d) = s.dial.as_mut().filter(|d| d.next_send <= now) else { continue };
            d.next_send = now + INIT_AGAIN;
            self.out.push(s.addr, &d.init[(d.sent % 2) as usize]);
            d.sent += 1;
        }
    }

    fn connect_failed(&mut self, now: Instant, why: &str) {
        let retry = Duration::from_millis(self.cfg.retry_ms);
        let kind = self.kind();
        if let Mode::Connect { peer, retry_at, conn, .. } = &mut self.mode {
            *retry_at = Some(now + retry);
            *conn = None;
            tracing::warn!(peer = %peer.name, addr = %peer.addr, "{kind} carrier to the peer is down: {why}");
            report(&peer.name, |s| s.state = format!("down: {why}"));
        }
    }

    /// Session `token` ended: the peer is told (`Close`), its flows are aborted towards the chain.
    fn close(&mut self, token: u64, end: End, now: Instant) {
        let Some(mut s) = self.conns.remove(&token) else { return };
        if s.dead {
            return;
        }
        s.dead = true;
        if s.keys.is_some() {
            let reason = match &end {
                End::Malformed(_) => "malformed",
                End::Refused(_) => "refused",
                End::Closed(_) => "closed",
            };
            send_item(&mut self.out, &mut s, &Item::Close { reason }, &self.m, now, false);
        }
        if self.by_addr.get(&s.addr) == Some(&token) {
            self.by_addr.remove(&s.addr);
        }
        self.closed = self.closed.add(Totals::of(&s));
        let why = log_end(&self.m, &mut self.refusal_log, &end, s.up, &s.peer, &s.addr);
        let remote = s.remote.values().copied().collect();
        let aborted = self.mode.conn_ended(token, remote, &mut self.gone);
        self.m.flows_aborted.add(aborted.len() as u64);
        for id in aborted {
            self.push(id, StreamKind::Abort, 0, b"unreachable");
        }
        if matches!(self.mode, Mode::Connect { .. }) {
            self.connect_failed(now, &why);
        }
    }

    /// Everything due: datagrams from the socket, timers, what the sessions send.
    fn drive(&mut self, now: Instant) {
        if self.net.moved(now, &self.m) {
            // Re-binding: the sessions' keys hold whatever the address; a `Ping` from the new uplink at once shows
            // the peer where the session is now (its `Ack` comes back there).
            for s in self.conns.values_mut() {
                send_item(&mut self.out, s, &Item::Ping, &self.m, now, false);
            }
        }
        self.receive(now);
        self.timers(now);
        self.transmit(now);
        self.flush();
        self.arm_timer(now);
        self.kick();
    }

    fn receive(&mut self, now: Instant) {
        let mut data = vec![0u8; 65536];
        let mut touched = HashSet::new();
        for i in 0..self.net.len() {
            let mut taken = 0;
            while taken < READ_BATCH {
                let (n, from, seg) = match batch::recv(self.net.get(i), &mut data) {
                    Ok(x) => x,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(_) => break, // WouldBlock, or an ICMP error reported on the socket
                };
                self.net.received(i, now, &self.m);
                self.m.udp_bytes_in.add(n as u64);
                for d in batch::datagrams(&mut data, n, seg) {
                    taken += 1;
                    if let Some(t) = self.datagram(now, from, d) {
                        touched.insert(t);
                    }
                }
            }
        }
        // Acks at the end of the batch.
        for t in touched {
            if let Some(s) = self.conns.get_mut(&t) {
                if s.rx.ack_due {
                    let (cum, window, sacks) = s.rx.ack();
                    s.segs_unacked = 0;
                    send_item(&mut self.out, s, &Item::Ack { cum, window, sacks }, &self.m, now, false);
                }
            }
        }
    }

    /// One datagram from `from`; returns the session it belongs to.
    fn datagram(&mut self, now: Instant, from: SocketAddr, buf: &mut [u8]) -> Option<u64> {
        let (number, hs) = match dgram::decode(buf) {
            Err(_) => {
                self.m.malformed.add(1);
                return None;
            }
            Ok(dgram::Packet::Sealed { number, .. }) => (number, None),
            Ok(dgram::Packet::Handshake(h)) => (0, Some((h.ty, h.ciphers, h.key, h.cert.to_vec(), h.sig.to_vec()))),
        };
        if let Some((ty, ciphers, key, cert, sig)) = hs {
            let h = Handshake { ty, ciphers, key, cert: &cert, sig: &sig };
            match (ty, &self.mode) {
                (dgram::INIT | dgram::INIT2, Mode::Accept { .. }) => self.on_init(now, from, &h),
                (dgram::RESP | dgram::RESP2, Mode::Connect { .. }) => self.on_resp(now, from, &h),
                _ => self.m.malformed.add(1),
            }
            return None;
        }
        // A sealed datagram: the session's keys, or those of an answered `Init` from the same address.
        let token = self.by_addr.get(&from).copied();
        // Opening fails in place: an answered `Init` from the same address gets its own copy.
        let mut backup = self.pending.contains_key(&from).then(|| buf.to_vec());
        let mut opened = None;
        if let Some(s) = token.and_then(|t| self.conns.get_mut(&t)) {
            if let Some(keys) = s.keys.as_mut() {
                opened = Some(keys.open(number, buf).map(<[u8]>::to_vec).map(|p| (token.expect("a token"), p)));
            }
        }
        if !matches!(opened, Some(Ok(_))) {
            if let (Some(p), Some(copy)) = (self.pending.get_mut(&from), backup.as_mut()) {
                if let Ok(plain) = p.keys.open(number, copy) {
                    let plain = plain.to_vec();
                    let t = self.promote(now, from);
                    opened = Some(Ok((t, plain)));
                }
            }
        }
        if opened.is_none() && token.is_none() {
            opened = self.moved_peer(now, from, number, buf).map(Ok);
        }
        let (token, plain) = match opened {
            Some(Ok(x)) => x,
            Some(Err(Opened::Replayed)) => {
                self.m.replayed.add(1);
                return None;
            }
            _ => {
                self.m.malformed.add(1);
                return None;
            }
        };
        let item = match dgram::decode_item(&plain) {
            Ok(i) => i,
            Err(_) => {
                self.m.malformed.add(1);
                return Some(token);
            }
        };
        if let Some(s) = self.conns.get_mut(&token) {
            s.last_rx = now;
        }
        if let Err(end) = self.item(now, token, item) {
            self.close(token, end, now);
            return None;
        }
        Some(token)
    }

    /// Accepting: a sealed datagram from an address without a session. A peer that moved to another uplink sends
    /// its session's datagrams from there: the sessions' keys are tried (at most [`MAX_TRIED`] such datagrams a
    /// second, so garbage from random addresses costs bounded work), and the session whose keys open it (authentic,
    /// not replayed) moves to `from`. Returns its token and the item.
    fn moved_peer(&mut self, now: Instant, from: SocketAddr, number: u64, buf: &[u8]) -> Option<(u64, Vec<u8>)> {
        if !matches!(self.mode, Mode::Accept { .. }) {
            return None;
        }
        if now.duration_since(self.tried.0) >= Duration::from_secs(1) {
            self.tried = (now, 0);
        }
        if self.tried.1 >= MAX_TRIED {
            return None;
        }
        self.tried.1 += 1;
        let mut copy = Vec::with_capacity(buf.len());
        let (token, plain) = self.conns.iter_mut().find_map(|(t, s)| {
            let keys = s.keys.as_mut()?;
            copy.clear();
            copy.extend_from_slice(buf);
            keys.open(number, &mut copy).ok().map(|p| (*t, p.to_vec()))
        })?;
        let kind = self.kind();
        let s = self.conns.get_mut(&token)?;
        tracing::info!(peer = %s.peer, from = %s.addr, to = %from, "{kind} carrier: the peer moved");
        if self.by_addr.get(&s.addr) == Some(&token) {
            self.by_addr.remove(&s.addr);
        }
        s.addr = from;
        self.by_addr.insert(from, token);
        self.m.migrations.add(1);
        Some((token, plain))
    }

    /// Accepting: an `Init` (or `Init2`). Answered only for a certificate of the table whose signature holds;
    /// refused (counted, logged, no answer) otherwise. `Init2` gets a `Resp2` choosing AES-256-GCM if offered,
    /// `Init` a `Resp` (ChaCha20-Poly1305).
    fn on_init(&mut self, now: Instant, from: SocketAddr, h: &Handshake<'_>) {
        if let Some(p) = self.pending.get(&from).filter(|p| p.init_key == h.key) {
            // The answer was lost (or the other version of the same `Init` came): the same again.
            self.out.push(from, &p.resp);
            return;
        }
        let fp = trust::fingerprint_of(h.cert);
        let peer = trust::by_fingerprint(&fp);
        let v2 = h.ty == dgram::INIT2;
        let signed = if v2 {
            verify(h.cert, &[dgram::INIT2_CONTEXT, &h.key, &[h.ciphers]].concat(), h.sig)
        } else {
            verify(h.cert, &[dgram::INIT_CONTEXT, &h.key].concat(), h.sig)
        };
        let (Some(peer), true) = (peer, signed) else {
            let why = if signed { "a certificate not in the peer table" } else { "a bad signature" };
            log_end(&self.m, &mut self.refusal_log, &End::Refused(why.into()), false, "", &from);
            return;
        };
        if self.conns.len() + self.pending.len() >= MAX_CONNECTIONS {
            log_end(&self.m, &mut self.refusal_log, &End::Refused("too many sessions".into()), false, &peer, &from);
            return;
        }
        let Ok(private) = EphemeralPrivateKey::generate(&X25519, &self.rng) else { return };
        let Ok(public) = private.compute_public_key() else { return };
        let public: [u8; 32] = public.as_ref().try_into().expect("an X25519 key");
        let salt = [&h.key[..], &public, &fp, &self.id.fingerprint].concat();
        let cipher =
            if !v2 || h.ciphers & dgram::AES_256_GCM == 0 { dgram::CHACHA20_POLY1305 } else { dgram::AES_256_GCM };
        let Ok(keys) = agreement::agree_ephemeral(private, &UnparsedPublicKey::new(&X25519, h.key), |secret| {
            Keys::derive(secret, &salt, false, cipher)
        }) else {
            self.m.malformed.add(1);
            return;
        };
        let (ty, sig) = if v2 {
            (dgram::RESP2, self.sign(&[dgram::RESP2_CONTEXT, &h.key, &public, &[cipher]].concat()))
        } else {
            (dgram::RESP, self.sign(&[dgram::RESP_CONTEXT, &h.key, &public].concat()))
        };
        let ciphers = if v2 { cipher } else { 0 };
        let mut resp = Vec::new();
        dgram::handshake(&mut resp, &Handshake { ty, ciphers, key: public, cert: self.id.cert_der(), sig: &sig });
        self.out.push(from, &resp);
        self.pending.insert(from, Pending { init_key: h.key, resp, keys, peer, since: now });
    }

    /// Accepting: the answered `Init` from `from` proved its keys: it becomes the session of that address (an older
    /// one from there ends).
    fn promote(&mut self, now: Instant, from: SocketAddr) -> u64 {
        let p = self.pending.remove(&from).expect("pending");
        if let Some(old) = self.by_addr.remove(&from) {
            self.close(old, End::Closed("replaced by a new session from the same address".into()), now);
        }
        let token = self.next_token;
        self.next_token += 1;
        self.conns.insert(token, Sess::new(from, p.peer, Some(p.keys), now));
        self.by_addr.insert(from, token);
        token
    }

    /// Connecting: the `Resp`. Taken only from the peer's address, for the `Init` under way, with the pinned
    /// certificate and a signature that holds; otherwise refused (counted) and ignored.
    fn on_resp(&mut self, now: Instant, from: SocketAddr, h: &Handshake<'_>) {
        let Some(&token) = self.by_addr.get(&from) else {
            self.m.malformed.add(1);
            return;
        };
        let Mode::Connect { peer, .. } = &self.mode else { return };
        let pinned = peer.fingerprint;
        let mine = self.id.fingerprint;
        let Some(s) = self.conns.get_mut(&token) else { return };
        let Some(d) = s.dial.as_mut() else {
            self.m.replayed.add(1); // a `Resp` again (ours was answered twice, or a replay)
            return;
        };
        let fp = trust::fingerprint_of(h.cert);
        let (signed, cipher) = if h.ty == dgram::RESP2 {
            // The cipher chosen is one offered (`dgram::CIPHERS`, all this side has): decode checked it.
            (verify(h.cert, &[dgram::RESP2_CONTEXT, &d.public, &h.key, &[h.ciphers]].concat(), h.sig), h.ciphers)
        } else {
            (verify(h.cert, &[dgram::RESP_CONTEXT, &d.public, &h.key].concat(), h.sig), dgram::CHACHA20_POLY1305)
        };
        if fp != pinned || !signed {
            let why = if fp != pinned { "the peer's certificate is not the one pinned" } else { "a bad signature" };
            log_end(&self.m, &mut self.refusal_log, &End::Refused(why.into()), false, &s.peer, &from);
            return;
        }
        let salt = [&d.public[..], &h.key, &mine, &fp].concat();
        let Some(private) = d.private.take() else { return };
        let Ok(keys) = agreement::agree_ephemeral(private, &UnparsedPublicKey::new(&X25519, h.key), |k| {
            Keys::derive(k, &salt, true, cipher)
        }) else {
            self.m.malformed.add(1);
            return;
        };
        s.dial = None;
        s.keys = Some(keys);
        s.last_rx = now;
        for item in std::mem::take(&mut s.early) {
            let k = s.keys.as_mut().expect("keys");
            self.out.push_with(s.addr, |b| k.seal_into(b, |b| b.extend_from_slice(&item)));
        }
    }

    /// An item of session `token`.
    fn item(&mut self, now: Instant, token: u64, item: Item<'_>) -> Result<(), End> {
        let arq = self.cfg.arq;
        let Some(s) = self.conns.get_mut(&token) else { return Ok(()) };
        match item {
            Item::Segment { offset, bytes } => {
                if s.rx.on_segment(offset, bytes) {
                    s.plain.extend(s.rx.take());
                }
                s.segs_unacked += 1;
                if s.segs_unacked >= ACK_EVERY {
                    s.segs_unacked = 0;
                    let (cum, window, sacks) = s.rx.ack();
                    send_item(&mut self.out, s, &Item::Ack { cum, window, sacks }, &self.m, now, false);
                }
                self.messages(now, token)?;
                // New acks may open the window: what waits goes out with the next transmit.
            }
            Item::Ack { cum, window, sacks } => s.tx.on_ack(now, cum, window, &sacks),
            Item::Ping => s.rx.ack_due = true,
            Item::Close { reason } => return Err(End::Closed(format!("the peer closed: {reason}"))),
            Item::Datagram { flow, payload, .. } | Item::Numbered { flow, payload, .. } => {
                self.m.frames_in.add(1);
                self.m.bytes_in.add((dgram::SEALED_HEAD + payload.len()) as u64);
                self.app_datagram(now, token, flow, &item);
            }
            Item::Parity { flow, .. } => self.app_datagram(now, token, flow, &item),
            Item::Nack { flow, seqs } => {
                let Some(tx) = s.plus_tx.get(&flow).filter(|_| arq) else { return Ok(()) };
                let again: Vec<(u32, Vec<u8>)> =
                    seqs.iter().filter_map(|&q| tx.resend(q).map(|p| (q, p.to_vec()))).collect();
                for (seq, payload) in again {
                    self.resent += 1;
                    send_item(&mut self.out, s, &Item::Numbered { flow, seq, payload: &payload }, &self.m, now, false);
                }
            }
        }
        Ok(())
    }

    /// An app datagram (or a parity) of `flow`: delivered when the flow is open, else held until its `Open` comes.
    fn app_datagram(&mut self, now: Instant, token: u64, flow: u64, item: &Item<'_>) {
        let Some(s) = self.conns.get_mut(&token) else { return };
        if !(s.up && s.udp.contains(&flow)) {
            let mut b = Vec::new();
            dgram::item(&mut b, item);
            match s.held.hold(now, flow, &b) {
                true => self.m.early_held.add(1),
                false => self.m.orphans.add(1),
            }
            return;
        }
        match *item {
            Item::Datagram { payload, .. } => self.frame_in(token, flow, StreamKind::Data, 0, payload),
            // A number seen before is dropped (the last arm).
            Item::Numbered { seq, payload, .. } if s.plus_rx.entry(flow).or_default().on_data(now, seq, payload) => {
                self.frame_in(token, flow, StreamKind::Data, 0, payload);
            }
            Item::Parity { first, k, len_xor, bytes, .. } => {
                if let Some((_, p)) = s.plus_rx.entry(flow).or_default().on_parity(now, first, k, len_xor, bytes) {
                    self.m.fec_recovered.add(1);
                    self.frame_in(token, flow, StreamKind::Data, 0, &p);
                }
            }
            _ => {}
        }
    }

    /// UDP flow `flow` of session `token` opened: the datagrams that came before, in order.
    fn opened(&mut self, now: Instant, token: u64, flow: u64) {
        let Some(s) = self.conns.get_mut(&token) else { return };
        for b in s.held.release(flow) {
            match dgram::decode_item(&b) {
                Ok(item) => self.app_datagram(now, token, flow, &item),
                Err(_) => self.m.orphans.add(1),
            }
        }
    }

    /// Decodes the messages the stream of session `token` brought.
    fn messages(&mut self, now: Instant, token: u64) -> Result<(), End> {
        let Some(s) = self.conns.get_mut(&token) else { return Ok(()) };
        let plain = std::mem::take(&mut s.plain);
        let m = self.m.clone();
        let (at, result) = each_message(&plain, &m, |msg, _| self.message(now, token, msg));
        let Some(s) = self.conns.get_mut(&token) else { return result };
        s.plain = plain[at..].to_vec();
        result.map_err(|e| e.before_hello(s.up))
    }

    fn message(&mut self, now: Instant, token: u64, m: wire::Message<'_>) -> Result<(), End> {
        let kind_name = self.kind();
        let Some(s) = self.conns.get_mut(&token) else { return Ok(()) };
        if !s.up {
            check_hello(&m, &s.peer)?;
            if matches!(self.mode, Mode::Accept { .. }) {
                let mut hello = Vec::new();
                wire::hello(&mut hello, &caps(&self.cfg));
                self.m.frames_out.add(1);
                s.write(&hello, &self.m);
            }
            s.up = true;
            self.m.connections.add(1);
            self.m.connections_active.add(1);
            let peer = s.peer.clone();
            let cipher = match s.keys.as_ref().map(|k| k.cipher) {
                Some(dgram::AES_256_GCM) => "aes-256-gcm",
                _ => "chacha20-poly1305",
            };
            tracing::info!(peer = %peer, cipher, "{kind_name} carrier session up");
            report(&peer, |st| {
                st.state = format!("connected over {kind_name} ({cipher})");
                st.connections += 1;
            });
            return Ok(());
        }
        let (flow, kind, ack, bytes) = match m {
            wire::Message::Hello { .. } => return Err(End::Malformed("a second hello".into())),
            wire::Message::Close { reason } => return Err(End::Closed(format!("the peer closed: {reason}"))),
            wire::Message::Switch { flow, flags, offset } => {
                switch_unasked(&self.cfg)?;
                let udp = flags & wire::SWITCH_UDP != 0;
                if udp {
                    s.udp.insert(flow);
                }
                match self.mode.peer_switch(token, &mut s.remote, &s.peer, flow, flags) {
                    Some(local) => self.ready.push_back(switch_marker(local, flags, offset)),
                    None => self.m.orphans.add(1),
                }
                if udp {
                    self.opened(now, token, flow);
                }
                return Ok(());
            }
            wire::Message::Frame { flow, kind, ack, bytes } => (flow, kind, ack, bytes),
            wire::Message::Resume { .. } | wire::Message::Received { .. } => {
                return Err(End::Malformed("a resume, which only the tcp carrier takes".into()))
            }
        };
        if matches!(self.mode, Mode::Accept { .. }) && kind == StreamKind::Open {
            let max = self.cfg.max_flows;
            let (local, info) =
                match self.mode.accept_open(token, &mut s.remote, flow, bytes, max, &self.m, &mut self.born)? {
                    Ok(x) => x,
                    Err(abort) => {
                        s.write(&abort, &self.m);
                        return Ok(());
                    }
                };
            let udp = info.protocol == Protocol::Udp;
            if udp {
                s.udp.insert(flow);
            }
            self.push(local, kind, ack, bytes);
            if udp {
                self.opened(now, token, flow);
            }
            return Ok(());
        }
        self.frame_in(token, flow, kind, ack, bytes);
        Ok(())
    }

    /// A frame of a known flow from the peer (from the stream, or a datagram's `Data`), towards the chain.
    fn frame_in(&mut self, token: u64, flow: u64, kind: StreamKind, ack: u64, bytes: &[u8]) {
        let Some(s) = self.conns.get_mut(&token) else { return };
        match self.mode.peer_frame(&mut s.remote, flow, kind, &mut self.gone) {
            Some((local, ended)) => {
                if ended {
                    s.end_flow(flow);
                }
                self.push(local, kind, ack, bytes);
            }
            None => self.m.orphans.add(1),
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
            let target = match &mut self.mode {
                Mode::Connect { .. } => {
                    if kind == StreamKind::Open {
                        self.m.flows.add(1);
                        self.connect(now);
                    }
                    match &self.mode {
                        Mode::Connect { conn, .. } => conn.map(|t| (t, flow, false)),
                        Mode::Accept { .. } => None,
                    }
                }
                Mode::Accept { flows, .. } => {
                    let Some(f) = flows.get(&flow) else {
                        self.m.orphans.add(1);
                        continue;
                    };
                    let t = (f.token, f.remote);
                    let done = self.mode.accepted_ends(flow, kind, true, &mut self.gone);
                    Some((t.0, t.1, done))
                }
            };
            let Some((token, wire_flow, done)) = target.filter(|(t, ..)| self.conns.contains_key(t)) else {
                if let Mode::Connect { router, .. } = &mut self.mode {
                    if router.up(flow, StreamKind::Abort) {
                        self.m.flows_aborted.add(1);
                        self.push(flow, StreamKind::Abort, 0, b"unreachable");
                    }
                }
                continue;
            };
            self.send_frame(now, token, wire_flow, flow, kind, extra, p.data());
            let ended = match &mut self.mode {
                Mode::Connect { router, .. } => !router.carries(flow),
                Mode::Accept { .. } => done,
            };
            if ended {
                if let Some(s) = self.conns.get_mut(&token) {
                    s.remote.remove(&wire_flow);
                    s.end_flow(wire_flow);
                }
            }
        }
        self.transmit(now);
        self.flush();
        self.arm_timer(now);
        self.kick();
    }

    /// One frame of flow `local` (`wire_flow` in messages): on the stream, or its `Data` as a datagram (UDP).
    #[allow(clippy::too_many_arguments)]
    fn send_frame(
        &mut self,
        now: Instant,
        token: u64,
        wire_flow: u64,
        local: u64,
        kind: StreamKind,
        extra: u64,
        data: &[u8],
    ) {
        let (arq, fec_k) = (self.cfg.arq, self.cfg.fec.then_some(self.cfg.fec_k as u8));
        let plus = self.plus;
        let Some(s) = self.conns.get_mut(&token) else { return };
        if kind == StreamKind::Open && FlowInfo::decode(data).is_ok_and(|i| i.protocol == Protocol::Udp) {
            s.udp.insert(wire_flow);
        }
        let udp = s.udp.contains(&wire_flow);
        if udp && kind == StreamKind::Ack {
            return; // acks of datagrams received: the sender acked them when it sent them
        }
        if udp && kind == StreamKind::Data {
            // The flow's `Open` (on the stream) goes first, so that the peer knows the flow when its datagram comes.
            pump(&mut self.out, s, &self.m, now);
            if data.len() > MAX_APP_DATAGRAM {
                self.m.datagrams_dropped.add(1);
            } else if plus {
                let (seq, parity) = s.plus_tx.entry(wire_flow).or_default().send(now, data, arq, fec_k);
                send_item(
                    &mut self.out,
                    s,
                    &Item::Numbered { flow: wire_flow, seq, payload: data },
                    &self.m,
                    now,
                    true,
                );
                if let Some(p) = parity {
                    let item =
                        Item::Parity { flow: wire_flow, first: p.first, k: p.k, len_xor: p.len_xor, bytes: &p.bytes };
                    send_item(&mut self.out, s, &item, &self.m, now, true);
                }
            } else {
                send_item(&mut self.out, s, &Item::Datagram { flow: wire_flow, payload: data }, &self.m, now, true);
            }
            self.m.frames_out.add(1);
            self.m.bytes_out.add((dgram::SEALED_HEAD + data.len()) as u64);
            // Its bytes are the producer's credit again, delivered or not (UDP).
            self.push(local, StreamKind::Ack, data.len() as u64, b"");
            return;
        }
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
        s.write(&b, &self.m);
    }

    /// What the sessions' streams may send now, and their due acks.
    fn transmit(&mut self, now: Instant) {
        for s in self.conns.values_mut() {
            if s.keys.is_none() {
                continue;
            }
            pump(&mut self.out, s, &self.m, now);
            if s.rx.ack_due {
                let (cum, window, sacks) = s.rx.ack();
                s.segs_unacked = 0;
                send_item(&mut self.out, s, &Item::Ack { cum, window, sacks }, &self.m, now, false);
            }
        }
    }

    /// Retransmission timers, NACKs, keep-alives, the `Init` again.
    fn timers(&mut self, now: Instant) {
        self.dial_timers(now);
        let arq = self.cfg.arq;
        for s in self.conns.values_mut() {
            s.tx.on_timeout(now);
            if s.keys.is_none() {
                continue;
            }
            let flows: Vec<u64> = s.plus_tx.keys().copied().collect();
            for flow in flows {
                let Some(p) = s.plus_tx.get_mut(&flow).and_then(|t| t.flush(now)) else { continue };
                let item = Item::Parity { flow, first: p.first, k: p.k, len_xor: p.len_xor, bytes: &p.bytes };
                send_item(&mut self.out, s, &item, &self.m, now, false);
            }
            if arq {
                let rtt = s.rtt();
                let flows: Vec<u64> = s.plus_rx.keys().copied().collect();
                for flow in flows {
                    let seqs =
                        s.plus_rx.get_mut(&flow).map(|r| r.nacks(now, rtt, dgram::MAX_NACKS)).unwrap_or_default();
                    if !seqs.is_empty() {
                        self.m.nacks.add(seqs.len() as u64);
                        send_item(&mut self.out, s, &Item::Nack { flow, seqs }, &self.m, now, false);
                    }
                }
            }
            if now.duration_since(s.last_tx) >= KEEPALIVE {
                send_item(&mut self.out, s, &Item::Ping, &self.m, now, false);
            }
        }
    }

    /// The timerfd at the earliest timer: retransmission, pacing, a NACK, an FEC group's tail, the `Init`.
    fn arm_timer(&mut self, now: Instant) {
        let mut next: Option<Instant> = None;
        let mut at = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        for s in self.conns.values() {
            if let Some(t) = s.tx.timeout() {
                at(t);
            }
            if let Some(t) = s.tx.pace_at() {
                at(t);
            }
            if let Some(d) = &s.dial {
                at(d.next_send);
            }
            for t in s.plus_tx.values().filter_map(PlusTx::flush_at) {
                at(t);
            }
            if self.cfg.arq {
                for t in s.plus_rx.values().filter_map(PlusRx::next_nack) {
                    at(t);
                }
            }
        }
        if next == self.timer_at {
            return;
        }
        self.timer_at = next;
        let r = match next {
            Some(t) => {
                let d = t.saturating_duration_since(now).max(Duration::from_micros(50));
                self.timer.set(Expiration::OneShot(TimeSpec::from_duration(d)), TimerSetTimeFlags::empty())
            }
            None => self.timer.unset(),
        };
        if let Err(e) = r {
            tracing::error!(error = %e, "datagram carrier: cannot arm its timer");
        }
    }

    /// Handshakes that take too long, silent sessions, the meters.
    fn tick(&mut self, now: Instant) {
        let late: Vec<(u64, End)> = self
            .conns
            .iter()
            .filter_map(|(t, s)| {
                if !s.up && now - s.since > HANDSHAKE_TIMEOUT {
                    Some((*t, End::Refused("no handshake within 5 s".into())))
                } else if now - s.last_rx > IDLE {
                    Some((*t, End::Closed(format!("nothing from the peer for {} s", IDLE.as_secs()))))
                } else {
                    None
                }
            })
            .collect();
        for (t, end) in late {
            self.close(t, end, now);
        }
        self.pending.retain(|_, p| now - p.since <= HANDSHAKE_TIMEOUT);
        let expired: usize = self.conns.values_mut().map(|s| s.held.expire(now)).sum();
        self.m.orphans.add(expired as u64);
        self.drive(now);
        self.m.flows_active.set(self.mode.active() as u64);
        let all = self.conns.values().fold(self.closed, |t, s| t.add(Totals::of(s)));
        self.m.lost_packets.set(all.lost);
        self.m.retransmits.set(all.retransmits + self.resent);
        let lost: u64 = self.conns.values().flat_map(|s| s.plus_rx.values()).map(|r| r.lost).sum();
        self.m.datagrams_lost.set(self.m.datagrams_lost.get().max(lost));
        if let Some(s) = self.conns.values().filter(|s| s.up).max_by_key(|s| s.since) {
            self.m.rtt_us.set(s.tx.srtt().map_or(0, |r| r.as_micros() as u64));
            self.m.cwnd.set(s.tx.cwnd());
        }
        let (then, before) = self.rate_at;
        let out = self.m.udp_bytes_out.get();
        let dt = now.duration_since(then).as_secs_f64();
        if dt >= 0.05 {
            self.m.rate.set(((out - before) as f64 * 8.0 / dt) as u64);
            self.rate_at = (now, out);
        }
        self.mode.report_counts(&self.m);
    }
}

/// Checks `sig` over `msg` by the key of certificate `cert` (ECDSA P-256 with SHA-256, the peers' keys).
fn verify(cert: &[u8], msg: &[u8], sig: &[u8]) -> bool {
    let der = rustls::pki_types::CertificateDer::from(cert);
    webpki::EndEntityCert::try_from(&der)
        .is_ok_and(|c| c.verify_signature(webpki::ring::ECDSA_P256_SHA256, msg, sig).is_ok())
}

impl Drop for Dgram {
    /// The module goes (its stack unloaded): the peers are told at once rather than by the idle timeout.
    fn drop(&mut self) {
        let now = Instant::now();
        for s in self.conns.values_mut() {
            if s.keys.is_some() {
                send_item(&mut self.out, s, &Item::Close { reason: "unloaded" }, &self.m, now, false);
            }
        }
        self.flush();
    }
}

impl FrameEngine for Dgram {
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
        Dgram::write_frames(self, packets);
    }
}

impl CarrierEngine for Dgram {
    carrier_engine_common!();

    fn send_switch(&mut self, local: u64, flags: u8, offset: u64) {
        let Some((token, wire_flow)) = self.mode.target(local) else { return };
        let Some(s) = self.conns.get_mut(&token) else { return };
        if flags & wire::SWITCH_UDP != 0 {
            s.udp.insert(wire_flow);
        }
        let mut b = Vec::new();
        wire::switch(&mut b, wire_flow, flags, offset);
        self.m.frames_out.add(1);
        s.write(&b, &self.m);
        let now = Instant::now();
        self.transmit(now);
        self.flush();
        self.arm_timer(now);
    }

    fn detach(&mut self, local: u64) {
        if let Some((token, remote)) = self.mode.detach(local) {
            if let Some(s) = self.conns.get_mut(&token) {
                s.remote.remove(&remote);
                s.end_flow(remote);
            }
        }
    }

    fn tick(&mut self, now: Instant) {
        Dgram::tick(self, now);
        self.kick();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replay_window_takes_each_number_once() {
        let mut r = Replay::default();
        for n in [0, 5, 3, 200, 199, 100_000] {
            assert!(r.fresh(n), "{n}");
            r.set(n);
            assert!(!r.fresh(n), "{n} again");
        }
        assert!(r.fresh(100_000 - 10), "below the top, within the window, never seen");
        assert!(!r.fresh(200), "beyond the window: too old");
        assert!(!r.fresh(100_000 - REPLAY_WINDOW), "at the window's end");
        // A long jump clears what the window held.
        r.set(100_000 + 64 * 3);
        assert!(r.fresh(100_000 + 64));
    }

    #[test]
    fn sealed_items_open_once_and_forgeries_do_not() {
        for cipher in [dgram::CHACHA20_POLY1305, dgram::AES_256_GCM] {
            sealed_items_open_once(cipher);
        }
        // Keys of one cipher do not open what the other sealed (the same secret and salt).
        let mut a = Keys::derive(&[1; 32], b"salt", true, dgram::AES_256_GCM);
        let mut b = Keys::derive(&[1; 32], b"salt", false, dgram::CHACHA20_POLY1305);
        let mut d = a.seal(b"hello");
        assert!(matches!(b.open(0, &mut d), Err(Opened::Forged)));
    }

    fn sealed_items_open_once(cipher: u8) {
        let (mut a, mut b) =
            (Keys::derive(&[1; 32], b"salt", true, cipher), Keys::derive(&[1; 32], b"salt", false, cipher));
        let mut d = a.seal(b"hello");
        let number = match dgram::decode(&d) {
            Ok(dgram::Packet::Sealed { number, .. }) => number,
            other => panic!("{other:?}"),
        };
        let mut copy = d.clone();
        assert_eq!(b.open(number, &mut d).ok(), Some(&b"hello"[..]));
        assert!(matches!(b.open(number, &mut copy), Err(Opened::Replayed)));
        let mut forged = a.seal(b"x");
        let last = forged.len() - 1;
        forged[last] ^= 1;
        assert!(matches!(b.open(1, &mut forged), Err(Opened::Forged)));
        // The forgery did not use up its number: the real one still opens.
        let mut real = a.seal(b"y");
        assert!(b.open(2, &mut real).is_ok());
        // The other direction's key does not open it.
        let mut wrong = b.seal(b"z");
        assert!(matches!(b.open(0, &mut wrong), Err(Opened::Forged) | Err(Opened::Replayed)));
    }
}
