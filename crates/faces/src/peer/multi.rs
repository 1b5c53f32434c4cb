//! A carrier with several transports to its peer (`transports`; docs/peers.md, "Switching"): cached stacks and
//! hitless switching.
//!
//! Each transport is the engine it is alone ([`carrier`](super::carrier), [`quic`](super::quic),
//! [`datagram`](super::datagram)), on a port of its own (the port given plus [`Transport::port_offset`]); this
//! engine holds them, their epoll sets inside its own, and chooses per flow the one that carries it. The
//! connecting side builds `transport` at once and the others when a flow first moves to them; once built they stay
//! (warm: their keep-alives run). The accepting side listens on all of them, and its transports share one numbering
//! of flows ([`FlowIds`]), so a flow that arrives on another transport keeps its id.
//!
//! A move (the flow's `carrier` knob written on the connecting side): the side sends a `Switch` with `end` on the
//! transport the flow leaves, as the flow's last message there, and a `Switch` on the one it goes to, as its first
//! there; then its frames go on the new one. The other side answers the same way when the first `Switch` comes.
//! Each side delivers the flow's frames from the old transport until its `end` came, and holds back those the new
//! one brings meanwhile (counted in `switch_held_total`; bounded by the flow's budget, as what is in flight is):
//! nothing is lost, duplicated or reordered for a TCP flow. A UDP flow's datagrams are delivered as they come (UDP
//! never promised order; each travels once, on one transport, so none comes twice).

use super::carrier::epoll_with_kick;
use super::carrier::{pop_ready, Builder, CarrierEngine, MakeDevice, Ready, SWITCH_MARK};
use super::trust;
use crate::stream::{EpollDevice, FrameEngine};
use flexstack_core::frame::{MetaKey, Metadata};
use flexstack_core::stream::{FlowInfo, Protocol, StreamKind};
use flexstack_core::{FaceDevice, KindDecl, ModuleBuilder, Packet};
use flexstack_modules::stream::carrier::order::{Order, Take};
use flexstack_modules::stream::carrier::{self, wire, CarrierRequest, Config, FlowIds, Meters, Router, Transport};
use nix::sys::epoll::{Epoll, EpollEvent, EpollFlags};
use nix::sys::eventfd::EventFd;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A switch to a transport that does not come up within this is given up (the flow stays where it is).
pub const SWITCH_TIMEOUT: Duration = Duration::from_secs(5);
/// Most frames a flow holds back while it switches; beyond, the flow is aborted (a peer that never ends the old
/// transport must not make it grow).
pub const MAX_HELD: usize = 65_536;
/// Frames read from one transport per turn.
const BATCH: usize = 256;

/// One transport's engine, behind its device's mutex.
pub(crate) trait Sub: Send + Sync {
    /// Its epoll set (inside the carrier's).
    fn epoll_fd(&self) -> BorrowedFd<'_>;
    /// Runs `f` on the engine.
    fn with(&self, f: &mut dyn FnMut(&mut dyn CarrierEngine));
}

impl<E: CarrierEngine> Sub for EpollDevice<E> {
    fn epoll_fd(&self) -> BorrowedFd<'_> {
        FaceDevice::fd(self)
    }

    fn with(&self, f: &mut dyn FnMut(&mut dyn CarrierEngine)) {
        f(&mut *self.engine());
    }
}

fn run<R>(sub: &dyn Sub, f: impl FnOnce(&mut dyn CarrierEngine) -> R) -> R {
    let (mut f, mut out) = (Some(f), None);
    sub.with(&mut |e| out = f.take().map(|f| f(e)));
    out.expect("the engine ran")
}

/// Makes one transport's engine.
pub(crate) trait MakeSub: Send {
    fn make(self: Box<Self>, m: Meters) -> Arc<dyn Sub>;
}

impl<E: CarrierEngine> MakeSub for Builder<E> {
    fn make(self: Box<Self>, m: Meters) -> Arc<dyn Sub> {
        let Builder { req, make } = *self;
        make(&req.cfg, m).0
    }
}

/// Builds a carrier with several transports.
pub(crate) fn build(req: CarrierRequest) -> Result<Box<dyn ModuleBuilder>, String> {
    let connect = !req.cfg.peer.is_empty();
    let ids = (!connect).then(FlowIds::default);
    let kinds = req.cfg.offered();
    let mut makers = Vec::new();
    let mut cfgs = Vec::new();
    for k in &kinds {
        let cfg = sub_cfg(&req.cfg, *k, ids.clone());
        let sub = CarrierRequest { cfg: cfg.clone(), interface: req.interface.clone(), decl: req.decl };
        makers.push(Some(transport(sub)?));
        cfgs.push(cfg);
    }
    let decl = req.decl;
    let make: MakeDevice<Multi> = Box::new(move |cfg: &Config, m| multi_device(cfg, m, decl, kinds, cfgs, makers, ids));
    Ok(Box::new(Builder { req, make }))
}

/// The settings of transport `k` of a carrier with several.
fn sub_cfg(cfg: &Config, k: Transport, ids: Option<FlowIds>) -> Config {
    // Its `transports` keep every one the carrier has (what its `Hello` offers, and what makes it take `Switch`).
    Config { transport: k, transports: cfg.offered(), port_offset: k.port_offset(), ids, ..cfg.clone() }
}

#[allow(clippy::too_many_arguments)]
fn multi_device(
    cfg: &Config,
    m: Meters,
    decl: &'static KindDecl<Config, Meters>,
    kinds: Vec<Transport>,
    cfgs: Vec<Config>,
    makers: Vec<Option<Box<dyn MakeSub>>>,
    ids: Option<FlowIds>,
) -> (Arc<EpollDevice<Multi>>, bool) {
    let (epoll, kick) = epoll_with_kick();
    let connect = !cfg.peer.is_empty();
    let n = kinds.len();
    let mut e = Multi {
        cfg: cfg.clone(),
        m,
        own: Meters::default(),
        sub_m: Vec::new(),
        decl,
        kinds,
        cfgs,
        subs: vec![None; n],
        makers,
        epoll: Arc::new(epoll),
        kick,
        connect,
        router: Router::default(),
        ids,
        flows: HashMap::new(),
        ready: VecDeque::new(),
        born: Vec::new(),
        gone: Vec::new(),
        moved: Vec::new(),
        buf: Vec::new(),
    };
    // Connecting: the first transport at once (as a carrier with one); accepting: every one listens.
    for i in 0..if connect { 1 } else { n } {
        e.ensure(i);
    }
    let dir = if connect { flexstack_core::Direction::Up } else { flexstack_core::Direction::Down };
    let name = format!("carrier-{}", if connect { &cfg.peer } else { &cfg.listen });
    let epoll = e.epoll.clone();
    (Arc::new(EpollDevice::new(name, dir, epoll, e)), connect)
}

struct Flow {
    udp: bool,
    peer: String,
    /// Accepting: the peer's id of the flow.
    remote: u64,
    /// The transport its frames go on.
    send: usize,
    /// Where its frames come from, in order: the first delivers, the others hold back.
    recv: Order<Ready>,
    /// `Data` bytes sent.
    sent: u64,
    /// The transports that know the flow.
    on: BTreeSet<usize>,
    /// A switch waiting for its transport to come up: where to, since when.
    want: Option<(usize, Instant)>,
    /// Accepting: `Fin` from the peer, from the chain.
    fins: (bool, bool),
}

impl Flow {
    fn new(sub: usize, udp: bool, peer: String, remote: u64) -> Flow {
        Flow {
            udp,
            peer,
            remote,
            send: sub,
            recv: Order::new(sub),
            sent: 0,
            on: BTreeSet::from([sub]),
            want: None,
            fins: (false, false),
        }
    }
}

/// The engine of a carrier with several transports.
pub(crate) struct Multi {
    cfg: Config,
    /// The module's meters: what the transports' own meters ([`Multi::sub_m`]) and `own` add up to.
    m: Meters,
    own: Meters,
    sub_m: Vec<Meters>,
    decl: &'static KindDecl<Config, Meters>,
    kinds: Vec<Transport>,
    cfgs: Vec<Config>,
    subs: Vec<Option<Arc<dyn Sub>>>,
    makers: Vec<Option<Box<dyn MakeSub>>>,
    epoll: Arc<Epoll>,
    kick: EventFd,
    connect: bool,
    router: Router,
    ids: Option<FlowIds>,
    flows: HashMap<u64, Flow>,
    ready: VecDeque<Ready>,
    born: Vec<(u64, String)>,
    gone: Vec<u64>,
    moved: Vec<(u64, String)>,
    buf: Vec<u8>,
}

impl Multi {
    /// Transport `i`, built if it is not yet.
    fn ensure(&mut self, i: usize) -> Option<Arc<dyn Sub>> {
        if self.subs[i].is_none() {
            let maker = self.makers[i].take()?;
            let m = Meters::default();
            let sub = maker.make(m.clone());
            self.sub_m.push(m);
            let ev = EpollEvent::new(EpollFlags::EPOLLIN, 1 + i as u64);
            if let Err(e) = self.epoll.add(sub.epoll_fd(), ev) {
                tracing::error!(error = %e, "cannot watch a carrier transport");
            }
            tracing::info!(transport = self.kinds[i].name(), "carrier transport built");
            self.subs[i] = Some(sub);
        }
        self.subs[i].clone()
    }

    fn on_sub<R>(&self, i: usize, f: impl FnOnce(&mut dyn CarrierEngine) -> R) -> Option<R> {
        self.subs.get(i)?.as_ref().map(|s| run(&**s, f))
    }

    fn kick(&self) {
        if !self.ready.is_empty() {
            let _ = self.kick.write(1);
        }
    }

    /// Reads what the transports brought.
    fn pull(&mut self) {
        let mut meta = Metadata::default();
        let mut buf = std::mem::take(&mut self.buf);
        for i in 0..self.subs.len() {
            let Some(sub) = self.subs[i].clone() else { continue };
            for _ in 0..BATCH {
                let got = run(&*sub, |e| e.read_frame(&mut buf, &mut meta)).unwrap_or(false);
                if !got {
                    break;
                }
                let (Some(flow), Some(st)) = (meta.get(MetaKey::FLOW_ID), meta.get(MetaKey::STREAM)) else { continue };
                let Some(kind) = StreamKind::from_u8(st as u8) else { continue };
                self.brought(i, Ready { flow, kind, extra: st >> 8, bytes: buf.clone() });
            }
        }
        self.buf = buf;
    }

    /// A frame transport `i` brought.
    fn brought(&mut self, i: usize, r: Ready) {
        if r.kind == StreamKind::Fin && r.extra & SWITCH_MARK != 0 {
            let offset = r.bytes.get(..8).map_or(0, |b| u64::from_be_bytes(b.try_into().expect("8 bytes")));
            return self.marker(i, r.flow, r.extra as u8, offset);
        }
        let Some(f) = self.flows.get_mut(&r.flow) else {
            if r.kind == StreamKind::Open && !self.connect {
                return self.accepted(i, r);
            }
            self.own.orphans.add(1);
            return;
        };
        if r.kind == StreamKind::Ack || f.udp {
            // Credit (an increment, in any order) and UDP datagrams: as they come.
            return self.deliver(r);
        }
        let (id, len) = (r.flow, if r.kind == StreamKind::Data { r.bytes.len() as u64 } else { 0 });
        let abort = r.kind == StreamKind::Abort && f.send == i;
        match f.recv.frame(i, r, len) {
            Take::Deliver(r) => self.deliver(r),
            Take::Held => {
                self.own.switch_held.add(1);
                if f.recv.held() > MAX_HELD {
                    tracing::warn!(flow = id, "carrier: a switching flow held back too much, aborted");
                    self.deliver(Ready { flow: id, kind: StreamKind::Abort, extra: 0, bytes: b"switch".to_vec() });
                }
            }
            // Its transport went while it sent there: the flow cannot go on.
            Take::Unknown(r) if abort => self.deliver(r),
            Take::Unknown(_) => self.own.orphans.add(1),
        }
    }

    /// Accepting: a flow opened on transport `i`.
    fn accepted(&mut self, i: usize, r: Ready) {
        let udp = FlowInfo::decode(&r.bytes).is_ok_and(|info| info.protocol == Protocol::Udp);
        let (peer, remote) = self.on_sub(i, |e| e.remote_of(r.flow)).flatten().unwrap_or_default();
        if let Some(ids) = &self.ids {
            ids.register(&peer, remote, r.flow);
        }
        let tuple = FlowInfo::decode(&r.bytes).map(|info| carrier::tuple(&info)).unwrap_or_default();
        self.born.push((r.flow, tuple));
        self.flows.insert(r.flow, Flow::new(i, udp, peer, remote));
        self.deliver(r);
    }

    /// A `Switch` of flow `id` on transport `i`.
    fn marker(&mut self, i: usize, id: u64, flags: u8, offset: u64) {
        let Some(f) = self.flows.get_mut(&id) else {
            self.own.orphans.add(1);
            return;
        };
        f.on.insert(i);
        if flags & wire::SWITCH_END == 0 {
            f.recv.start(i);
            if f.send != i {
                // The peer moved the flow: follow it.
                self.move_send(id, i);
            }
            return;
        }
        if f.udp {
            // Its datagrams were delivered as they came: only the end of the source matters.
            let _ = f.recv.end(i, f.recv.delivered);
        } else {
            let before = f.recv.mismatches;
            match f.recv.end(i, offset) {
                Some(frames) => {
                    if f.recv.mismatches != before {
                        // The peer said it sent `offset` bytes before the switch: fewer or more came before it.
                        tracing::warn!(
                            flow = id,
                            offset,
                            delivered = f.recv.delivered,
                            "carrier: a switch's offset does not match"
                        );
                    }
                    for r in frames {
                        self.deliver(r);
                    }
                }
                None => self.own.orphans.add(1),
            }
        }
        self.prune(id);
    }

    /// Forgets flow `id` on the transports it neither goes nor comes on any more.
    fn prune(&mut self, id: u64) {
        let Some(f) = self.flows.get_mut(&id) else { return };
        let done: Vec<usize> = f.on.iter().copied().filter(|i| *i != f.send && !f.recv.uses(*i)).collect();
        for i in &done {
            f.on.remove(i);
        }
        for i in done {
            self.on_sub(i, |e| e.detach(id));
        }
    }

    /// Flow `id`'s frames go on transport `to` from now on: the old one gets its `Switch(end)`, the new one its
    /// `Switch`.
    fn move_send(&mut self, id: u64, to: usize) {
        let connect = self.connect;
        let Some(f) = self.flows.get_mut(&id) else { return };
        let (from, sent) = (f.send, f.sent);
        let flags = if f.udp { wire::SWITCH_UDP } else { 0 };
        f.send = to;
        f.on.insert(to);
        self.on_sub(from, |e| e.send_switch(id, flags | wire::SWITCH_END, sent));
        self.on_sub(to, |e| {
            if connect {
                e.attach(id);
            }
            e.send_switch(id, flags, sent);
        });
        self.own.switches.add(1);
        self.moved.push((id, self.kinds[to].name().to_string()));
        tracing::debug!(flow = id, from = self.kinds[from].name(), to = self.kinds[to].name(), "carrier: flow moved");
        self.prune(id);
    }

    /// Hands a frame to the chain; forgets the flow when it ends.
    fn deliver(&mut self, r: Ready) {
        let Some(f) = self.flows.get_mut(&r.flow) else { return };
        let ended = if self.connect {
            self.router.up(r.flow, r.kind);
            !self.router.carries(r.flow)
        } else {
            if r.kind == StreamKind::Fin {
                f.fins.0 = true;
            }
            r.kind == StreamKind::Abort || f.fins == (true, true)
        };
        let id = r.flow;
        self.ready.push_back(r);
        if ended {
            self.end(id);
        }
    }

    /// Flow `id` ended: every transport that knows it forgets it.
    fn end(&mut self, id: u64) {
        let Some(f) = self.flows.remove(&id) else { return };
        for i in f.on {
            self.on_sub(i, |e| e.detach(id));
        }
        if !self.connect {
            if let Some(ids) = &self.ids {
                ids.forget(&f.peer, f.remote);
            }
            self.gone.push(id);
        }
    }

    /// Switches waiting for their transport: made once it is up, given up after [`SWITCH_TIMEOUT`].
    fn pending(&mut self, now: Instant) {
        let waiting: Vec<(u64, usize, Instant)> =
            self.flows.iter().filter_map(|(id, f)| f.want.map(|(to, since)| (*id, to, since))).collect();
        for (id, to, since) in waiting {
            if self.on_sub(to, |e| e.is_up()).unwrap_or(false) {
                if let Some(f) = self.flows.get_mut(&id) {
                    f.want = None;
                    f.recv.start(to);
                }
                self.own.switch_wait_us.set(now.saturating_duration_since(since).as_micros() as u64);
                self.move_send(id, to);
            } else if now.saturating_duration_since(since) > SWITCH_TIMEOUT {
                if let Some(f) = self.flows.get_mut(&id) {
                    f.want = None;
                }
                self.own.switch_refused.add(1);
                tracing::warn!(
                    flow = id,
                    transport = self.kinds[to].name(),
                    "carrier: the transport did not come up in 5 s; the flow stays where it is"
                );
            }
        }
    }

    /// The module's meters: each the sum of the transports' and this engine's own (the round-trip time and the
    /// congestion window: the largest); the flows carried now are this engine's.
    fn sum_meters(&mut self) {
        for d in self.decl.meters {
            let Some(field) = d.field else { continue };
            let values = self.sub_m.iter_mut().map(|m| field(m).get());
            let v = if matches!(d.name, "rtt_us" | "cwnd_bytes") {
                values.max().unwrap_or(0)
            } else {
                values.sum::<u64>() + field(&mut self.own).get()
            };
            field(&mut self.m).set(v);
        }
        self.m.flows_active.set(self.flows.len() as u64);
        if self.connect {
            let (active, bin, bout) = (self.flows.len() as u64, self.m.bytes_in.get(), self.m.bytes_out.get());
            trust::report(&self.cfg.peer, |s| {
                s.flows_active = active;
                s.bytes_in = bin;
                s.bytes_out = bout;
            });
        }
    }

    fn write_frames(&mut self, packets: &[&Packet]) {
        self.pending(Instant::now());
        let mut per: Vec<Vec<&Packet>> = vec![Vec::new(); self.subs.len()];
        let mut touched = Vec::new();
        for p in packets {
            let (Some(id), Some(kind)) = (p.stream_flow(), p.stream_kind()) else {
                self.own.orphans.add(1);
                continue;
            };
            if self.connect && kind == StreamKind::Open && !self.flows.contains_key(&id) {
                let udp = FlowInfo::decode(p.data()).is_ok_and(|i| i.protocol == Protocol::Udp);
                self.flows.insert(id, Flow::new(0, udp, self.cfg.peer.clone(), id));
                self.on_sub(0, |e| e.attach(id));
            }
            let Some(f) = self.flows.get_mut(&id) else {
                self.own.orphans.add(1);
                continue;
            };
            match kind {
                StreamKind::Data => f.sent += p.len() as u64,
                StreamKind::Fin => f.fins.1 = true,
                _ => {}
            }
            per[f.send].push(p);
            touched.push((id, kind == StreamKind::Abort || f.fins == (true, true)));
        }
        for (i, ps) in per.iter().enumerate() {
            if !ps.is_empty() {
                self.on_sub(i, |e| e.write_frames(ps));
            }
        }
        for (id, ended) in touched {
            let ended = if self.connect { !self.router.carries(id) } else { ended };
            if ended {
                self.end(id);
            }
        }
        self.kick();
    }

    /// Flow `id`'s `carrier` knob: moves it to transport `name` (at once when it is up; else once it is).
    fn set_carrier(&mut self, id: u64, name: &str) -> Result<(), String> {
        if !self.connect {
            return Err("flows are moved by the connecting carrier (on the app's host)".into());
        }
        let to_kind = Transport::parse(name)?;
        let list = || self.kinds.iter().map(|k| k.name()).collect::<Vec<_>>().join(", ");
        let Some(to) = self.kinds.iter().position(|k| *k == to_kind) else {
            return Err(format!("{name} is not one of this carrier's transports ({})", list()));
        };
        let Some(f) = self.flows.get(&id) else { return Err(format!("no flow {id} on this carrier")) };
        if f.send == to && f.want.is_none() {
            return Ok(());
        }
        if f.recv.moving() || f.want.is_some() {
            return Err(format!("flow {id} is still moving; try again"));
        }
        let caps = trust::status(&self.cfg.peer).map(|s| s.caps).unwrap_or_default();
        let offers = |c: &str| caps.iter().any(|x| x == c);
        let known = !caps.is_empty();
        let offered = offers(name) && offers(wire::SWITCH_CAP);
        let refused = known && !offered;
        if refused {
            self.own.switch_refused.add(1);
            return Err(format!(
                "peer {} does not offer {name} with switching (its hello offers: {}); flow {id} stays on {}",
                self.cfg.peer,
                caps.join(", "),
                self.kinds[f.send].name()
            ));
        }
        self.ensure(to);
        if let Some(f) = self.flows.get_mut(&id) {
            f.want = Some((to, Instant::now()));
        }
        self.pending(Instant::now());
        self.kick();
        Ok(())
    }
}

impl FrameEngine for Multi {
    fn read_frame(&mut self, buf: &mut Vec<u8>, meta: &mut Metadata) -> std::io::Result<bool> {
        if self.ready.is_empty() {
            let _ = self.kick.read();
            self.pull();
        }
        Ok(pop_ready(&mut self.ready, buf, meta))
    }

    fn write_frames(&mut self, packets: &[&Packet]) {
        Multi::write_frames(self, packets);
    }
}

impl CarrierEngine for Multi {
    fn router(&mut self) -> Option<&mut Router> {
        self.connect.then_some(&mut self.router)
    }

    fn meters(&self) -> &Meters {
        &self.m
    }

    fn born(&mut self) -> &mut Vec<(u64, String)> {
        &mut self.born
    }

    fn take_gone(&mut self) -> Vec<u64> {
        let mut gone = std::mem::take(&mut self.gone);
        gone.append(&mut self.router.gone);
        for id in &gone {
            // Flows the router forgot (both Fins): forgotten here too.
            if self.flows.contains_key(id) {
                self.end(*id);
            }
        }
        gone
    }

    fn peer_of(&self, id: u64) -> String {
        self.flows.get(&id).map_or_else(|| self.cfg.peer.clone(), |f| f.peer.clone())
    }

    fn tick(&mut self, now: Instant) {
        for i in 0..self.subs.len() {
            self.on_sub(i, |e| {
                e.tick(now);
                // Its flows' meters are this carrier's.
                e.born().clear();
                e.take_gone();
            });
        }
        self.pending(now);
        self.sum_meters();
        self.kick();
    }

    fn set_cfg(&mut self, cfg: Config) {
        for i in 0..self.subs.len() {
            let c = sub_cfg(&cfg, self.kinds[i], self.cfgs[i].ids.clone());
            self.cfgs[i] = c.clone();
            self.on_sub(i, |e| e.set_cfg(c));
        }
        self.cfg = cfg;
    }

    fn is_up(&self) -> bool {
        self.on_sub(0, |e| e.is_up()).unwrap_or(false)
    }

    fn remote_of(&self, id: u64) -> Option<(String, u64)> {
        self.flows.get(&id).map(|f| (f.peer.clone(), f.remote))
    }

    fn send_switch(&mut self, _local: u64, _flags: u8, _offset: u64) {}

    fn detach(&mut self, _local: u64) {}

    fn set_carrier(&mut self, id: u64, name: &str) -> Result<(), String> {
        Multi::set_carrier(self, id, name)
    }

    fn carrier_of(&self, id: u64) -> String {
        let i = self.flows.get(&id).map_or(0, |f| f.send);
        self.kinds[i].name().to_string()
    }

    fn take_moved(&mut self) -> Vec<(u64, String)> {
        std::mem::take(&mut self.moved)
    }
}

/// The engine of one transport of a carrier with several, made when first needed.
fn transport(req: CarrierRequest) -> Result<Box<dyn MakeSub>, String> {
    Ok(match req.cfg.transport {
        Transport::Tcp => Box::new(super::carrier::build(req)?),
        Transport::Quic => Box::new(super::quic::build(req)?),
        Transport::Udp | Transport::Udpplus => Box::new(super::datagram::build(req)?),
    })
}
