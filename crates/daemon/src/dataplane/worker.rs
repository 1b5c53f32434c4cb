//! One data-plane worker: a thread with a switch of its own, reading its own queue of every face device, handing
//! frames of flows another worker owns over rings ([`super::steer`]), and applying the control plane's commands
//! between batches (together with the other workers, see [`Command::Apply`]).

use super::command::{Command, Edits, Snapshot, PRECISE_WAIT};
use super::moderation::RxModeration;
use super::steer;
use flexstack_core::frame::Metadata;
use flexstack_core::switch::CONTROL_PLANE;
use flexstack_core::vars::{DynamicVars, VarCell};
use flexstack_core::{
    Batch, Direction, Edit, FaceDevice, Frame, Meter, Packet, PacketPool, Switch, Time, ValueType, VarSpec,
};
use flexstack_faces::linkwatch::{CarrierBook, LinkWatch};
use nix::sys::epoll::{Epoll, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::EventFd;
use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{Expiration, TimerFd, TimerSetTimeFlags};
use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Packets read from one face per wakeup, at most.
const READ_BATCH: usize = 256;

/// Bytes read from one face per wakeup, at most (the frame that crosses it is the last): what a round holds in
/// flight. Without it a round of 256 GSO super-packets held 16 MiB of 64 KiB buffers per face, which the pool then
/// kept (66 MiB RSS with two workers under bench-hostpath's load); with it a worker holds at most about 1 MiB per
/// ready face, and frames that small packets fill (UDP floods) still come 256 to a round.
const READ_BYTES: usize = 1 << 20;

/// While busy-polling, how often epoll is still asked (for wake-ups, link events and timers).
const SPIN_EPOLL: Duration = Duration::from_micros(50);

/// Frames of at most this many bytes (acknowledgements, MTU-sized packets) are copied out of the buffer they were
/// read into, which must hold the largest frame (64 KiB); larger ones (GSO super-frames) keep it.
const COPY_AT_MOST: usize = 2048;

/// The room a device is read into: the largest frame (64 KiB) behind the headroom.
const READ_ROOM: usize = PacketPool::HEADROOM + 65_535;

/// Frames one ring between two workers holds; beyond, frames are dropped and counted (`drop_handoff_total`).
pub(super) const RING_FRAMES: usize = 4096;

/// The epoll token of the command eventfd (which other workers also signal when they hand frames over); faces use
/// their index + 1.
pub(super) const WAKE_TOKEN: u64 = 0;
/// The epoll token of the link watcher's netlink socket.
pub(super) const LINK_TOKEN: u64 = u64::MAX - 1;
/// The epoll token of the wake-up timer.
pub(super) const TIMER_TOKEN: u64 = u64::MAX;

/// A frame one worker read and another owns: the bytes (the pool's packets stay on their thread), what the device
/// told about it, and which face it was read from, by module index in the stack of `epoch` (the count of the data
/// plane's edit commands: all workers that run the stack apply the same edits, so their indices agree).
pub(super) struct Handoff {
    face: u32,
    epoch: u64,
    direction: Direction,
    meta: Metadata,
    data: Vec<u8>,
}

/// This worker's ends of the rings to and from every other worker (`None` at its own index).
pub(super) struct Rings {
    /// Frames to worker j.
    pub(super) to: Vec<Option<rtrb::Producer<Handoff>>>,
    /// Frames from worker j.
    pub(super) from: Vec<Option<rtrb::Consumer<Handoff>>>,
    /// Emptied buffers back to worker j (which handed them over).
    pub(super) give_back: Vec<Option<rtrb::Producer<Vec<u8>>>>,
    /// Buffers worker j gives back, to hand the next frames over in.
    pub(super) reuse: Vec<Option<rtrb::Consumer<Vec<u8>>>>,
    /// Every worker's wake-up eventfd (own included).
    pub(super) wakes: Vec<Arc<EventFd>>,
}

/// Makes the rings of `n` workers: each worker's [`Rings`].
pub(super) fn rings(n: usize, wakes: &[Arc<EventFd>]) -> Vec<Rings> {
    let mut all: Vec<Rings> = (0..n)
        .map(|_| Rings {
            to: (0..n).map(|_| None).collect(),
            from: (0..n).map(|_| None).collect(),
            give_back: (0..n).map(|_| None).collect(),
            reuse: (0..n).map(|_| None).collect(),
            wakes: wakes.to_vec(),
        })
        .collect();
    for i in 0..n {
        for j in (0..n).filter(|&j| j != i) {
            let (tx, rx) = rtrb::RingBuffer::new(RING_FRAMES);
            all[i].to[j] = Some(tx);
            all[j].from[i] = Some(rx);
            let (tx, rx) = rtrb::RingBuffer::new(RING_FRAMES);
            all[j].give_back[i] = Some(tx);
            all[i].reuse[j] = Some(rx);
        }
    }
    all
}

/// The meters of one worker, `worker.<k>.*`.
struct WorkerMeters {
    rounds: Meter,
    frames: Meter,
    busy_ns: Meter,
    handoff_out: Meter,
    handoff_in: Meter,
    drop_handoff: Meter,
    drop_stale: Meter,
    active: Meter,
}

impl WorkerMeters {
    fn register(dynamic: &mut DynamicVars, worker: usize) -> WorkerMeters {
        let u64 = |name: &str, unit: &str, description: &str| VarSpec::meter(name, ValueType::U64, unit, description);
        let specs = [
            u64("rounds_total", "rounds", "rounds of the worker's loop (reading, running the switch, writing)"),
            u64(
                "frames_total",
                "frames",
                "frames this worker ran through its switch (read here and kept, or handed in)",
            ),
            u64("busy_ns_total", "ns", "time the worker spent outside its wait for work"),
            u64("handoff_out_total", "frames", "frames read here and handed to the worker that owns their flow"),
            u64("handoff_in_total", "frames", "frames other workers handed to this one"),
            u64("drop_handoff_total", "frames", "dropped: the ring to the owning worker was full"),
            u64("drop_stale_total", "frames", "dropped: handed over across an edit (never expected)"),
            u64("active", "", "1 while this worker runs the stack, 0 while the stack runs on one worker"),
        ];
        let vars = dynamic
            .register("dataplane", &format!("worker.{worker}"), &specs)
            .unwrap_or_else(|_| flexstack_core::ModuleVars::new(&specs));
        WorkerMeters {
            rounds: vars.meter("rounds_total"),
            frames: vars.meter("frames_total"),
            busy_ns: vars.meter("busy_ns_total"),
            handoff_out: vars.meter("handoff_out_total"),
            handoff_in: vars.meter("handoff_in_total"),
            drop_handoff: vars.meter("drop_handoff_total"),
            drop_stale: vars.meter("drop_stale_total"),
            active: vars.meter("active"),
        }
    }
}

/// One worker's loop and what it owns.
pub(super) struct Loop {
    pub(super) id: usize,
    /// How many workers run the stack now (1: this one alone, or the stack is on worker 0 only).
    pub(super) active: usize,
    /// The epoch of the last edit command applied (see [`Handoff`]).
    pub(super) epoch: u64,
    pub(super) switch: Switch,
    pub(super) origin: Instant,
    pub(super) rx: Receiver<Command>,
    pub(super) epoll: Epoll,
    pub(super) timer: TimerFd,
    pub(super) rings: Rings,
    pub(super) moderation: RxModeration,
    pub(super) links: Option<LinkWatch>,
    pub(super) dynamic: DynamicVars,
    /// `worker.all.busy_poll_us`: how long to keep polling after the last frame.
    pub(super) busy_poll: Arc<VarCell>,
}

/// What the loop keeps between rounds besides [`Loop`]'s fields.
struct State {
    faces: Vec<(usize, Arc<dyn FaceDevice>)>,
    /// Module index of each face to its position in `faces`.
    face_at: HashMap<usize, usize>,
    /// Reused list of the faces that may have frames for their devices ([`Switch::take_egress_ready`]).
    egress_ready: Vec<usize>,
    generation: u64,
    carriers: CarrierBook,
    meters: WorkerMeters,
    /// Workers this round handed frames to (to wake once each).
    woken: Vec<bool>,
    /// Frames handed in, by face, to inject.
    handed_in: Vec<(usize, Batch)>,
    /// When the devices' kernel drop counters are to be read next: a second after frames moved, while none were
    /// read since (`None`: nothing moved since the last read, so an idle loop sleeps until an event).
    kernel_drops_due: Option<Time>,
    /// By position in `faces`: the face's last read found it empty (or short). While busy-polling such a face is
    /// read for one frame before the switch runs, so that a lone frame is processed before the read that finds the
    /// device empty; a face whose last read was full is read a batch at a time, so that a burst still comes in
    /// batches.
    drained: Vec<bool>,
}

impl Loop {
    pub(super) fn run(mut self) {
        let origin = self.origin;
        let clock = move || now(origin);
        let meters = WorkerMeters::register(&mut self.dynamic, self.id);
        meters.active.set(u64::from(self.id < self.active));
        let mut st = State {
            faces: Vec::new(),
            face_at: HashMap::new(),
            egress_ready: Vec::new(),
            generation: u64::MAX,
            carriers: CarrierBook::default(),
            meters,
            woken: vec![false; self.rings.wakes.len()],
            handed_in: Vec::new(),
            kernel_drops_due: None,
            drained: Vec::new(),
        };
        let mut events = vec![EpollEvent::empty(); 64];
        let mut ready: Vec<usize> = Vec::new();
        let mut batch: Batch = Vec::with_capacity(READ_BATCH);
        // The pooled packet the next read goes into (kept when a read found nothing).
        let mut spare: Option<Packet> = None;
        let mut meta = Metadata::default();
        let mut busy_since = clock();
        // When this worker last read or was handed a frame (busy-poll goes on this long after it).
        let mut last_frame = clock();
        // Busy-polling (the previous round found the worker within `busy_poll_us` of its last frame): the devices
        // are read in every round without asking epoll first, which is asked only every SPIN_EPOLL (for the
        // wake-ups, link events and timers it alone reports).
        let mut spinning = false;
        let mut last_epoll = clock();
        loop {
            // Commands first: they are applied between batches, never inside one.
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd, &mut st, &mut batch) {
                            return;
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return,
                }
            }
            if self.refresh_faces(&mut st) {
                ready.clear();
            }
            // Read the devices that were ready; a device with more waiting stays ready for the next round.
            let mut more = false;
            // Whether frames moved this round (read, handed in or written).
            let mut moved = false;
            for &k in &ready {
                let Some((index, dev)) = st.faces.get(k).cloned() else { continue };
                let pool = self.switch.pool().clone();
                let ethernet = dev.ethernet();
                let (mut sent, mut dropped) = (0u64, 0u64);
                let (mut read, mut bytes) = (0, 0);
                let limit = if spinning && st.drained[k] { 1 } else { READ_BATCH };
                while read < limit && bytes < READ_BYTES {
                    // Read straight into a pooled buffer: no copy, and a buffer that held a large frame is not
                    // zeroed again (PacketPool::alloc_for_overwrite; the device sets the length it read). Room is
                    // left in front, where the link module puts its header without moving the packet. A buffer that
                    // held a large frame is taken first (the pool's long slots): it has room for the largest frame
                    // (64 KiB) without growing, where a small one would be reallocated.
                    let mut p = spare.take().unwrap_or_else(|| pool.alloc_for_overwrite_len(READ_ROOM));
                    match dev.read_frame_at(p.buffer_for_overwrite(), PacketPool::HEADROOM, &mut meta) {
                        Ok(Some(start)) => {
                            p.strip_front(start);
                            read += 1;
                            bytes += p.len();
                            let owner = steer::owner(p.data(), ethernet, self.active);
                            if owner != self.id {
                                match self.hand_over(owner, index, dev.direction(), &meta, p.data()) {
                                    true => sent += 1,
                                    false => dropped += 1,
                                }
                                st.woken[owner] = true;
                                spare = Some(p);
                            } else if p.len() <= COPY_AT_MOST {
                                // A small frame is copied into a packet of its own and the large buffer read into
                                // again: held frames (a delay line of small packets) keep small buffers.
                                let mut q = pool.alloc_from(p.data());
                                q.set_direction(dev.direction());
                                if !meta.is_empty() {
                                    *q.meta_mut() = meta;
                                }
                                batch.push(Frame::Data(q));
                                spare = Some(p);
                            } else {
                                p.set_direction(dev.direction());
                                if !meta.is_empty() {
                                    *p.meta_mut() = meta;
                                }
                                batch.push(Frame::Data(p));
                            }
                        }
                        Ok(None) => {
                            spare = Some(p);
                            break;
                        }
                        Err(e) => {
                            spare = Some(p);
                            tracing::debug!(device = dev.name(), error = %e, "read failed (counted)");
                            break;
                        }
                    }
                }
                if sent + dropped > 0 {
                    dev.count_handoff(sent, dropped);
                    st.meters.handoff_out.add(sent);
                    st.meters.drop_handoff.add(dropped);
                }
                more |= read == limit || bytes >= READ_BYTES;
                // Fewer than asked for: it ran empty, failed, or gave its bytes' worth.
                st.drained[k] = read < limit;
                if read > 0 {
                    last_frame = clock();
                    moved = true;
                }
                st.meters.frames.add(batch.len() as u64);
                self.switch.face_ingress(index, &mut batch);
            }
            if !more {
                ready.clear();
            }
            self.wake_peers(&mut st);
            let handed_in = self.take_handed_in(&mut st);
            self.switch.run(clock());
            let wrote = self.flush_egress(&mut st, &mut batch);
            let now = clock();
            if st.kernel_drops_due.is_some_and(|due| due <= now) {
                st.kernel_drops_due = None;
                for (_, dev) in &st.faces {
                    dev.refresh_kernel_drops();
                }
            }
            if (moved || handed_in || wrote) && st.kernel_drops_due.is_none() {
                st.kernel_drops_due = Some(Time(now.0.saturating_add(KERNEL_DROPS_EVERY.as_nanos() as u64)));
            }
            let polling = match self.busy_poll.local_u64() {
                0 => false,
                us => clock().0.saturating_sub(last_frame.0) < us.saturating_mul(1_000),
            };
            // Nothing to do and nothing due: sleep until an event (a frame, a command, a link change), however long.
            let wait = if more || polling || self.switch.has_pending() || self.has_handed_in() {
                Some(Duration::ZERO)
            } else {
                let now = clock();
                let due = [self.switch.next_wakeup(), st.kernel_drops_due].into_iter().flatten().min();
                due.map(|w| w - now)
            };
            // epoll's timeout counts whole milliseconds: a module's wake-up soon (a modelled transmission ending, a
            // delayed frame due) is kept to the nanosecond by a timerfd, and epoll waits for it.
            let wait = match wait {
                Some(w) if !w.is_zero() && w < PRECISE_WAIT => {
                    let when = TimeSpec::from_duration(w);
                    match self.timer.set(Expiration::OneShot(when), TimerSetTimeFlags::empty()) {
                        Ok(()) => None,
                        Err(_) => Some(w),
                    }
                }
                w => w,
            };
            let timeout = wait.map_or(EpollTimeout::NONE, |w| {
                // Rounded up to the next millisecond: waking early would only wait again.
                let ms = w.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as u32;
                EpollTimeout::try_from(ms as i32).unwrap_or(EpollTimeout::NONE)
            });
            spinning = polling;
            if polling && !more && clock().0.saturating_sub(last_epoll.0) < SPIN_EPOLL.as_nanos() as u64 {
                // Every device is read next round, without a system call to ask which.
                ready.clear();
                ready.extend(0..st.faces.len());
                continue;
            }
            let idle_from = clock();
            last_epoll = idle_from;
            st.meters.busy_ns.add(idle_from.0.saturating_sub(busy_since.0));
            let n = match self.epoll.wait(&mut events, timeout) {
                Ok(n) => n,
                Err(nix::errno::Errno::EINTR) => 0,
                Err(e) => {
                    tracing::error!(error = %e, worker = self.id, "epoll failed; data plane stops");
                    return;
                }
            };
            busy_since = clock();
            st.meters.rounds.add(1);
            if events[..n].iter().any(|e| e.data() != WAKE_TOKEN && e.data() != TIMER_TOKEN && e.data() != LINK_TOKEN) {
                let hold = self.moderation.hold(clock(), self.switch.next_wakeup());
                if !hold.is_zero() {
                    std::thread::sleep(hold);
                }
            }
            for ev in &events[..n] {
                match ev.data() {
                    WAKE_TOKEN => {
                        let _ = self.rings.wakes[self.id].read();
                    }
                    LINK_TOKEN => self.link_events(&mut st),
                    TIMER_TOKEN => {
                        // Expired: reading clears it (non-blocking; nothing else to do, the loop runs the switch).
                        let _ = nix::unistd::read(&self.timer, &mut [0u8; 8]);
                    }
                    token => {
                        let k = (token - 1) as usize;
                        if !ready.contains(&k) {
                            ready.push(k);
                        }
                    }
                }
            }
        }
    }

    /// Hands a frame to worker `owner` over the ring to it; false (dropped) when the ring is full.
    fn hand_over(&mut self, owner: usize, face: usize, direction: Direction, meta: &Metadata, data: &[u8]) -> bool {
        let Some(ring) = self.rings.to[owner].as_mut() else { return false };
        if ring.is_full() {
            return false;
        }
        let mut buf = self.rings.reuse[owner].as_mut().and_then(|r| r.pop().ok()).unwrap_or_default();
        buf.clear();
        buf.extend_from_slice(data);
        let h = Handoff { face: face as u32, epoch: self.epoch, direction, meta: *meta, data: buf };
        ring.push(h).is_ok()
    }

    /// Wakes the workers frames were handed to this round (one eventfd write each).
    fn wake_peers(&mut self, st: &mut State) {
        for (j, woken) in st.woken.iter_mut().enumerate() {
            if std::mem::take(woken) {
                let _ = self.rings.wakes[j].write(1);
            }
        }
    }

    fn has_handed_in(&self) -> bool {
        self.rings.from.iter().flatten().any(|r| !r.is_empty())
    }

    /// Takes the frames other workers handed over (at most a ring's worth from each) into this worker's pool, and
    /// injects them at the faces they were read from.
    /// Returns whether any frame was taken.
    fn take_handed_in(&mut self, st: &mut State) -> bool {
        let pool = self.switch.pool().clone();
        for j in 0..self.rings.from.len() {
            let Some(ring) = self.rings.from[j].as_mut() else { continue };
            let n = ring.slots();
            for _ in 0..n {
                let Ok(h) = ring.pop() else { break };
                if h.epoch != self.epoch || !st.face_at.contains_key(&(h.face as usize)) {
                    st.meters.drop_stale.add(1);
                } else {
                    // With room in front, as a face reads: the link module's header goes there in place.
                    let mut p = pool.alloc_from_with_headroom(&h.data);
                    p.set_direction(h.direction);
                    if !h.meta.is_empty() {
                        *p.meta_mut() = h.meta;
                    }
                    let face = h.face as usize;
                    match st.handed_in.iter_mut().find(|(f, _)| *f == face) {
                        Some((_, b)) => b.push(Frame::Data(p)),
                        None => st.handed_in.push((face, vec![Frame::Data(p)])),
                    }
                }
                if let Some(back) = self.rings.give_back[j].as_mut() {
                    let _ = back.push(h.data);
                }
            }
        }
        let took = !st.handed_in.is_empty();
        for (face, mut frames) in st.handed_in.drain(..) {
            st.meters.handoff_in.add(frames.len() as u64);
            st.meters.frames.add(frames.len() as u64);
            self.switch.face_ingress(face, &mut frames);
        }
        took
    }

    /// Handles one command; false means stop.
    fn handle(&mut self, cmd: Command, st: &mut State, batch: &mut Batch) -> bool {
        match cmd {
            Command::Apply { edits, epoch, active, barrier, reply } => {
                if let Some(b) = &barrier {
                    // No worker reads its devices past this point, so no frame is handed over any more: take what
                    // was, run it to completion under the old stack, then change the stack together.
                    b.wait();
                    self.refresh_faces(st);
                    self.take_handed_in(st);
                    self.switch.run(now(self.origin));
                    self.flush_egress(st, batch);
                }
                let result = match edits {
                    Edits::These(edits) => self.switch.apply(edits),
                    Edits::UnloadAll => {
                        let names: Vec<String> = self.switch.module_names().map(str::to_string).collect();
                        self.switch.apply(names.into_iter().rev().map(|name| Edit::Unload { name }).collect())
                    }
                };
                self.epoch = epoch;
                // The stack's spread changes with an edit that holds (a failed one changed nothing).
                if let Some(active) = active.filter(|_| result.is_ok()) {
                    self.active = active;
                    st.meters.active.set(u64::from(self.id < active));
                }
                self.refresh_faces(st);
                if let Some(b) = &barrier {
                    b.wait();
                }
                let _ = reply.send(result);
            }
            Command::Snapshot(reply) => {
                let _ = reply.send(Snapshot {
                    spec: self.switch.describe(),
                    modules: self.switch.module_infos(),
                    edges: self.switch.edges().to_vec(),
                    paused: self.switch.is_paused(),
                });
            }
            Command::Control(frame, reply) => {
                let serial = frame.serial;
                self.switch.send_control(frame);
                self.switch.run(now(self.origin));
                let mut inbox = self.switch.take_control_inbox();
                let found = inbox.iter().position(|f| f.serial == serial && f.dest == CONTROL_PLANE);
                let _ = reply.send(found.map(|i| inbox.swap_remove(i)));
            }
            Command::Shutdown(reply) => {
                let names: Vec<String> = self.switch.module_names().map(str::to_string).collect();
                let _ = self.switch.apply(names.into_iter().rev().map(|name| Edit::Unload { name }).collect());
                let _ = reply.send(());
                return false;
            }
        }
        true
    }

    /// After an edit, registers the current face devices with epoll (and forgets the old ones); true if it did.
    fn refresh_faces(&mut self, st: &mut State) -> bool {
        let generation = self.switch.generation();
        if generation == st.generation {
            return false;
        }
        st.generation = generation;
        for (_, dev) in st.faces.drain(..) {
            let _ = self.epoll.delete(dev.fd());
        }
        st.faces = self.switch.faces();
        st.face_at = st.faces.iter().enumerate().map(|(k, (index, _))| (*index, k)).collect();
        st.drained = vec![true; st.faces.len()];
        for (k, (_, dev)) in st.faces.iter().enumerate() {
            let event = EpollEvent::new(EpollFlags::EPOLLIN, k as u64 + 1);
            if let Err(e) = self.epoll.add(dev.fd(), event) {
                tracing::warn!(device = dev.name(), error = %e, "cannot watch device");
            }
        }
        // Learn the links' current state: a face may be loaded on an interface that is already down.
        let watched: Vec<u32> = st.faces.iter().filter_map(|(_, d)| d.ifindex()).collect();
        st.carriers.retain(&watched);
        if let Some(links) = self.links.as_mut().filter(|_| !watched.is_empty()) {
            if let Err(e) = links.request_dump() {
                tracing::warn!(error = %e, "cannot ask for the links' state");
            }
        }
        true
    }

    /// Reads the kernel's link events and tells the switch about each face whose link changed state.
    fn link_events(&mut self, st: &mut State) {
        let Some(links) = self.links.as_mut() else { return };
        let mut states = Vec::new();
        match links.read(&mut states) {
            Ok(0) => {}
            Ok(malformed) => tracing::warn!(malformed, "link events that did not parse (skipped)"),
            Err(e) => {
                // Typically ENOBUFS: events were lost; the current state is asked for again.
                tracing::debug!(error = %e, "link events lost; asking for the links' state");
                let _ = links.request_dump();
            }
        }
        for (ifindex, up) in states {
            let faces: Vec<usize> =
                st.faces.iter().filter(|(_, d)| d.ifindex() == Some(ifindex)).map(|(i, _)| *i).collect();
            if faces.is_empty() || !st.carriers.update(ifindex, up) {
                continue;
            }
            for index in faces {
                if self.id == 0 {
                    tracing::info!(face = index, ifindex, up, "face link changed");
                }
                self.switch.face_link_changed(index, up);
            }
        }
    }

    /// Writes what the face modules queued for their devices: those the switch called since the last flush (with
    /// 1,000 faces, visiting every one each round cost more than the frames).
    /// Returns whether any frame was written.
    fn flush_egress(&mut self, st: &mut State, batch: &mut Batch) -> bool {
        let mut wrote = false;
        self.switch.take_egress_ready(&mut st.egress_ready);
        for index in &st.egress_ready {
            let Some(&k) = st.face_at.get(index) else { continue };
            let dev = &st.faces[k].1;
            self.switch.face_egress(*index, batch);
            if batch.is_empty() {
                continue;
            }
            let packets: Vec<&Packet> = batch
                .iter()
                .filter_map(|f| match f {
                    Frame::Data(p) => Some(p),
                    _ => None,
                })
                .collect();
            if let Err(e) = dev.write_frames(&packets) {
                tracing::debug!(device = dev.name(), error = %e, "write failed (counted)");
            }
            wrote |= !packets.is_empty();
            drop(packets);
            batch.clear();
        }
        wrote
    }
}

/// How often the devices' kernel drop counters are read while frames move (and once this long after the last).
const KERNEL_DROPS_EVERY: Duration = Duration::from_secs(1);

pub(super) fn now(origin: Instant) -> Time {
    Time(u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX))
}
