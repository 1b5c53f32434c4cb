//! The data-plane thread: owns the [`Switch`], runs it, does the I/O of face modules, and applies commands from
//! the control plane between batches.
//!
//! The loop: apply queued commands; read every face device that epoll reported readable (at most a batch each)
//! and hand the packets to its module ([`Switch::face_ingress`]); run the switch; write what face modules queued
//! ([`Switch::face_egress`], only for the faces the switch called: [`Switch::take_egress_ready`]); wait in epoll for
//! a device, a command (an eventfd the control plane signals) or the next module timer. No step visits every module
//! or face: the switch keeps lists of the modules with work, so a frame costs the same with 1 link or 1,000.
//!
//! Wake-ups by a face can be moderated as a NIC moderates its interrupts ([`RxModeration`], off by default:
//! `flexstack daemon --rx-hold-us N`): while frames stream in (wake-ups closer together than a gap), the loop waits
//! a short hold before reading, so that one wake-up reads several frames instead of one or two. Sparse traffic (a
//! ping) is read at once.
//!
//! The thread can run under the real-time policy SCHED_FIFO (`flexstack daemon --realtime PRIO`; the lab's daemons
//! use it): see [`DataPlane::start`].
//!
//! The control plane talks to it only through [`DataPlane`]: [`DataPlane::apply`] sends edits and waits for the
//! verdict, [`DataPlane::snapshot`] asks for the stack's shape. Meters are never read through here: readers use
//! the [`SharedRegistry`], whose cells the data plane updates without locks.

use flexstack_core::config::StackSpec;
use flexstack_core::switch::CONTROL_PLANE;
use flexstack_core::switch::{Edge, ModuleInfo};
use flexstack_core::{Batch, FaceDevice, Frame};
use flexstack_core::{ControlFrame, Edit, EditError, PacketPool, SharedRegistry, Switch, Time};
use flexstack_faces::linkwatch::{CarrierBook, LinkWatch};
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::time::TimeSpec;
use nix::sys::timerfd::{ClockId, Expiration, TimerFd, TimerFlags, TimerSetTimeFlags};
use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest sleep of the loop when nothing is due (bounds the latency of commands only when none arrive).
const MAX_IDLE: Duration = Duration::from_millis(50);

/// The shape of the running stack at one moment.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// The stack as a description (knob values as settings).
    pub spec: StackSpec,
    /// Modules with kind, state and ports.
    pub modules: Vec<ModuleInfo>,
    /// Resolved links.
    pub edges: Vec<Edge>,
    /// True while the whole stack is paused.
    pub paused: bool,
}

enum Command {
    Apply(Vec<Edit>, Sender<Result<Vec<String>, EditError>>),
    Snapshot(Sender<Snapshot>),
    Control(ControlFrame, Sender<Option<ControlFrame>>),
    Shutdown(Sender<()>),
}

/// Packets read from one face per wakeup, at most.
const READ_BATCH: usize = 256;

/// Frames of at most this many bytes (acknowledgements, MTU-sized packets) are copied out of the buffer they were
/// read into, which must hold the largest frame (64 KiB); larger ones (GSO super-frames) keep it.
const COPY_AT_MOST: usize = 2048;

/// Handle to the data-plane thread.
pub struct DataPlane {
    tx: Sender<Command>,
    wake: Arc<EventFd>,
    registry: SharedRegistry,
    scheduling: String,
    thread: Option<JoinHandle<()>>,
}

/// How the data-plane thread runs.
#[derive(Clone, Copy, Debug)]
pub struct DataPlaneOptions {
    /// The hold of [`RxModeration`] (zero: read as soon as a face is readable).
    pub rx_hold: Duration,
    /// SCHED_FIFO priority the data-plane thread was asked to run at (1-99; 0: none). See [`DataPlane::start`].
    pub realtime: u8,
}

impl Default for DataPlaneOptions {
    fn default() -> DataPlaneOptions {
        DataPlaneOptions { rx_hold: DEFAULT_RX_HOLD, realtime: 0 }
    }
}

/// How the calling (data-plane) thread is scheduled, as `status` shows it; `asked` is the priority it was started
/// for (0: none). A real-time thread also gets SCHED_RESET_ON_FORK here: nothing it might start inherits the policy.
fn scheduling_of_this_thread(asked: u8) -> String {
    match flexstack_sys::fifo_priority() {
        Ok(Some(p)) => {
            if let Err(e) = flexstack_sys::set_fifo_reset_on_fork(p) {
                tracing::warn!(error = %e, "cannot set SCHED_RESET_ON_FORK on the data plane");
            }
            format!("fifo {p}")
        }
        Ok(None) if asked == 0 => "normal".into(),
        Ok(None) => format!("normal (real-time priority {asked} was refused: see the daemon's log)"),
        Err(e) => format!("unknown ({e})"),
    }
}

/// The default hold of face wake-ups while frames stream (see [`RxModeration`]): none. A hold of 30 us doubled
/// the frames read per wake-up on the emulator benchmark (2 to 4) but changed neither its throughput nor the
/// daemon's CPU time per byte on a quiet machine (BENCHMARKS.md, issue 4), so it is not on by default.
pub const DEFAULT_RX_HOLD: Duration = Duration::ZERO;

/// Interrupt moderation of face wake-ups, sans-IO: the loop asks [`RxModeration::hold`] each time epoll reports a
/// face readable, and waits what it answers before reading.
///
/// Frames are streaming in when the last two gaps between face wake-ups were both shorter than
/// [`RxModeration::STREAMING_GAP`] holds: the loop then waits `hold` (at most until the next module timer is due),
/// and the frames that arrive meanwhile are read by the same wake-up. Each wake-up costs a context switch on both
/// sides (the writer's wake and the reader's schedule), a cost per frame that is worth more than the hold's latency
/// while frames stream (the TCP benchmark of the emulator reads about 2 frames per wake-up without it). Sparse
/// traffic is read at once: a ping's request and its reply make one short gap, not two. Request/response traffic
/// faster than one exchange per 4 holds does stream, and each frame then waits up to one hold.
#[derive(Clone, Debug)]
pub struct RxModeration {
    hold: Duration,
    last_face_wake: Option<Time>,
    /// Whether the gap before the last face wake-up was short.
    last_gap_short: bool,
}

impl RxModeration {
    /// Wake-ups closer together than this many holds are streaming.
    pub const STREAMING_GAP: u32 = 4;

    /// Moderation with this hold (zero: off).
    pub fn new(hold: Duration) -> RxModeration {
        RxModeration { hold, last_face_wake: None, last_gap_short: false }
    }

    /// A face woke the loop at `now`; `next_due` is the earliest module timer. Returns how long to wait before
    /// reading (zero: read at once).
    pub fn hold(&mut self, now: Time, next_due: Option<Time>) -> Duration {
        let previous = self.last_face_wake.replace(now);
        if self.hold.is_zero() {
            return Duration::ZERO;
        }
        let limit = self.hold * Self::STREAMING_GAP;
        let gap_short = previous.is_some_and(|p| now.0.saturating_sub(p.0) < limit.as_nanos() as u64);
        let streaming = gap_short && self.last_gap_short;
        self.last_gap_short = gap_short;
        if !streaming {
            return Duration::ZERO;
        }
        match next_due {
            Some(due) if due.0 <= now.0 => Duration::ZERO,
            Some(due) => self.hold.min(Duration::from_nanos(due.0 - now.0)),
            None => self.hold,
        }
    }
}

impl DataPlane {
    /// Starts the data-plane thread with an empty switch. The thread inherits the caller's scheduling policy: the
    /// daemon (`crate::server`) calls this under SCHED_FIFO when `options.realtime` asks for it (and goes back to
    /// the normal policy afterwards), so that the data plane runs as soon as a face or timer wakes it, instead of
    /// waiting for a core behind the programs whose packets it carries (on the emulator benchmark, 2 cores shared
    /// by an iperf3 sender, its receiver and the daemon, this raised the emulated link's throughput from about
    /// 0.66 to 0.71-0.80 of a plain veth's; BENCHMARKS.md, issue 4). `options.realtime` itself only says what was
    /// asked, for [`DataPlane::scheduling`].
    pub fn start(options: DataPlaneOptions) -> std::io::Result<DataPlane> {
        let (tx, rx) = mpsc::channel();
        let (reg_tx, reg_rx) = mpsc::channel();
        let wake = Arc::new(EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)?);
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        epoll.add(wake.as_ref(), EpollEvent::new(EpollFlags::EPOLLIN, WAKE_TOKEN))?;
        let timer = TimerFd::new(ClockId::CLOCK_MONOTONIC, TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC)?;
        epoll.add(&timer, EpollEvent::new(EpollFlags::EPOLLIN, TIMER_TOKEN))?;
        // Without a link watcher (no netlink here?) faces work as before; only their carrier goes unwatched.
        let links = match LinkWatch::open() {
            Ok(w) => match epoll.add(w.fd(), EpollEvent::new(EpollFlags::EPOLLIN, LINK_TOKEN)) {
                Ok(()) => Some(w),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot watch link events; face carriers are not watched");
                    None
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, "cannot open a netlink socket; face carriers are not watched");
                None
            }
        };
        let thread_wake = wake.clone();
        let thread = std::thread::Builder::new().name("dataplane".into()).spawn(move || {
            let scheduling = scheduling_of_this_thread(options.realtime);
            let mut switch = Switch::new(PacketPool::default());
            let origin = Instant::now();
            switch.set_profiler(Some(Box::new(move || u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX))));
            let _ = reg_tx.send((switch.registry(), scheduling));
            // The hold is a sleep: keep the kernel's timer slack (50 us by default) from stretching it.
            if !options.rx_hold.is_zero() {
                if let Err(e) = nix::sys::prctl::set_timerslack(1_000) {
                    tracing::debug!(error = %e, "cannot set the data plane's timer slack");
                }
            }
            let moderation = RxModeration::new(options.rx_hold);
            Loop {
                switch,
                origin,
                rx,
                epoll,
                wake: thread_wake,
                timer,
                faces: Vec::new(),
                face_at: HashMap::new(),
                egress_ready: Vec::new(),
                generation: u64::MAX,
                moderation,
                links,
                carriers: CarrierBook::default(),
            }
            .run();
        })?;
        let (registry, scheduling) = reg_rx.recv().map_err(|_| std::io::Error::other("data plane did not start"))?;
        Ok(DataPlane { tx, wake, registry, scheduling, thread: Some(thread) })
    }

    fn send(&self, cmd: Command) -> Result<(), DataPlaneGone> {
        self.tx.send(cmd).map_err(|_| DataPlaneGone)?;
        self.wake.write(1).map_err(|_| DataPlaneGone)?;
        Ok(())
    }

    /// How the data-plane thread is scheduled: `normal`, `fifo N`, or `normal (real-time priority N was refused:
    /// ...)`.
    pub fn scheduling(&self) -> &str {
        &self.scheduling
    }

    /// The registry of meters and knobs.
    pub fn registry(&self) -> SharedRegistry {
        self.registry.clone()
    }

    /// Applies `edits` atomically between two batches; returns the switch's notes or why nothing changed.
    pub fn apply(&self, edits: Vec<Edit>) -> Result<Result<Vec<String>, EditError>, DataPlaneGone> {
        let (tx, rx) = mpsc::channel();
        self.send(Command::Apply(edits, tx))?;
        rx.recv().map_err(|_| DataPlaneGone)
    }

    /// The stack's current shape.
    pub fn snapshot(&self) -> Result<Snapshot, DataPlaneGone> {
        let (tx, rx) = mpsc::channel();
        self.send(Command::Snapshot(tx))?;
        rx.recv().map_err(|_| DataPlaneGone)
    }

    /// Sends a control frame from the control plane through the switch and returns the reply addressed back to
    /// the control plane with the same serial, if one came within the same run.
    pub fn control(&self, frame: ControlFrame) -> Result<Option<ControlFrame>, DataPlaneGone> {
        let (tx, rx) = mpsc::channel();
        self.send(Command::Control(frame, tx))?;
        rx.recv().map_err(|_| DataPlaneGone)
    }

    /// Stops the thread, dropping every module (taps flush their files).
    pub fn shutdown(&mut self) {
        let (tx, rx) = mpsc::channel();
        if self.send(Command::Shutdown(tx)).is_ok() {
            let _ = rx.recv_timeout(Duration::from_secs(5));
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The data-plane thread has stopped (it panicked or was shut down).
#[derive(Debug, thiserror::Error)]
#[error("the data plane has stopped")]
pub struct DataPlaneGone;

fn now(origin: Instant) -> Time {
    Time(u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX))
}

/// The epoll token of the command eventfd; faces use their index + 1.
const WAKE_TOKEN: u64 = 0;
/// The epoll token of the link watcher's netlink socket.
const LINK_TOKEN: u64 = u64::MAX - 1;

/// The epoll token of the wake-up timer.
const TIMER_TOKEN: u64 = u64::MAX;

struct Loop {
    switch: Switch,
    origin: Instant,
    rx: Receiver<Command>,
    epoll: Epoll,
    wake: Arc<EventFd>,
    timer: TimerFd,
    faces: Vec<(usize, Arc<dyn FaceDevice>)>,
    /// Module index of each face to its position in `faces`.
    face_at: HashMap<usize, usize>,
    /// Reused list of the faces that may have frames for their devices ([`Switch::take_egress_ready`]).
    egress_ready: Vec<usize>,
    generation: u64,
    moderation: RxModeration,
    links: Option<LinkWatch>,
    carriers: CarrierBook,
}

impl Loop {
    fn run(mut self) {
        let clock = move || now(self.origin);
        let mut events = vec![EpollEvent::empty(); 64];
        let mut ready: Vec<usize> = Vec::new();
        let mut batch: Batch = Vec::with_capacity(READ_BATCH);
        // The pooled packet the next read goes into (kept when a read found nothing).
        let mut spare: Option<flexstack_core::Packet> = None;
        let mut meta = flexstack_core::frame::Metadata::default();
        loop {
            // Commands first: they are applied between batches, never inside one.
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => {
                        if !handle(&mut self.switch, cmd, &clock) {
                            return;
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return,
                }
            }
            if self.refresh_faces() {
                ready.clear();
            }
            // Read the devices that were ready; a device with more waiting stays ready for the next round.
            let mut more = false;
            for &k in &ready {
                let Some((index, dev)) = self.faces.get(k).cloned() else { continue };
                let pool = self.switch.pool().clone();
                while batch.len() < READ_BATCH {
                    // Read straight into a pooled buffer: no copy, and a buffer that held a large frame is not
                    // zeroed again (PacketPool::alloc_for_overwrite; the device sets the length it read).
                    let mut p = spare.take().unwrap_or_else(|| pool.alloc_for_overwrite());
                    match dev.read_frame(p.make_mut(), &mut meta) {
                        Ok(true) if p.len() <= COPY_AT_MOST => {
                            // A small frame is copied into a packet of its own and the large buffer read into
                            // again: held frames (a delay line of small packets) keep small buffers.
                            let mut q = pool.alloc_from(p.data());
                            q.set_direction(dev.direction());
                            if !meta.is_empty() {
                                *q.meta_mut() = meta;
                            }
                            batch.push(Frame::Data(q));
                            spare = Some(p);
                        }
                        Ok(true) => {
                            p.set_direction(dev.direction());
                            if !meta.is_empty() {
                                *p.meta_mut() = meta;
                            }
                            batch.push(Frame::Data(p));
                        }
                        Ok(false) => {
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
                more |= batch.len() == READ_BATCH;
                self.switch.face_ingress(index, &mut batch);
            }
            if !more {
                ready.clear();
            }
            self.switch.run(clock());
            self.flush_egress(&mut batch);
            let wait = if more || self.switch.has_pending() {
                Duration::ZERO
            } else {
                match self.switch.next_wakeup() {
                    Some(w) => (w - clock()).min(MAX_IDLE),
                    None => MAX_IDLE,
                }
            };
            // epoll's timeout counts whole milliseconds: a module's wake-up (a modelled transmission ending, a
            // delayed frame due) is kept to the nanosecond by a timerfd, and epoll waits for it.
            let wait = if wait.is_zero() || wait >= MAX_IDLE {
                wait
            } else {
                let when = TimeSpec::from_duration(wait);
                match self.timer.set(Expiration::OneShot(when), TimerSetTimeFlags::empty()) {
                    Ok(()) => MAX_IDLE,
                    Err(_) => wait,
                }
            };
            let timeout = EpollTimeout::try_from(wait).unwrap_or(EpollTimeout::NONE);
            let n = match self.epoll.wait(&mut events, timeout) {
                Ok(n) => n,
                Err(nix::errno::Errno::EINTR) => 0,
                Err(e) => {
                    tracing::error!(error = %e, "epoll failed; data plane stops");
                    return;
                }
            };
            if events[..n].iter().any(|e| e.data() != WAKE_TOKEN && e.data() != TIMER_TOKEN && e.data() != LINK_TOKEN) {
                let hold = self.moderation.hold(clock(), self.switch.next_wakeup());
                if !hold.is_zero() {
                    std::thread::sleep(hold);
                }
            }
            for ev in &events[..n] {
                match ev.data() {
                    WAKE_TOKEN => {
                        let _ = self.wake.read();
                    }
                    LINK_TOKEN => self.link_events(),
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

    /// After an edit, registers the current face devices with epoll (and forgets the old ones); true if it did.
    fn refresh_faces(&mut self) -> bool {
        let generation = self.switch.generation();
        if generation == self.generation {
            return false;
        }
        self.generation = generation;
        for (_, dev) in self.faces.drain(..) {
            let _ = self.epoll.delete(dev.fd());
        }
        self.faces = self.switch.faces();
        self.face_at = self.faces.iter().enumerate().map(|(k, (index, _))| (*index, k)).collect();
        for (k, (_, dev)) in self.faces.iter().enumerate() {
            let event = EpollEvent::new(EpollFlags::EPOLLIN, k as u64 + 1);
            if let Err(e) = self.epoll.add(dev.fd(), event) {
                tracing::warn!(device = dev.name(), error = %e, "cannot watch device");
            }
        }
        // Learn the links' current state: a face may be loaded on an interface that is already down.
        let watched: Vec<u32> = self.faces.iter().filter_map(|(_, d)| d.ifindex()).collect();
        self.carriers.retain(&watched);
        if let Some(links) = self.links.as_mut().filter(|_| !watched.is_empty()) {
            if let Err(e) = links.request_dump() {
                tracing::warn!(error = %e, "cannot ask for the links' state");
            }
        }
        true
    }

    /// Reads the kernel's link events and tells the switch about each face whose link changed state.
    fn link_events(&mut self) {
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
                self.faces.iter().filter(|(_, d)| d.ifindex() == Some(ifindex)).map(|(i, _)| *i).collect();
            if faces.is_empty() || !self.carriers.update(ifindex, up) {
                continue;
            }
            for index in faces {
                tracing::info!(face = index, ifindex, up, "face link changed");
                self.switch.face_link_changed(index, up);
            }
        }
    }

    /// Writes what the face modules queued for their devices: those the switch called since the last flush (with
    /// 1,000 faces, visiting every one each round cost more than the frames).
    fn flush_egress(&mut self, batch: &mut Batch) {
        self.switch.take_egress_ready(&mut self.egress_ready);
        for index in &self.egress_ready {
            let Some(&k) = self.face_at.get(index) else { continue };
            let dev = &self.faces[k].1;
            self.switch.face_egress(*index, batch);
            if batch.is_empty() {
                continue;
            }
            let packets: Vec<&flexstack_core::Packet> = batch
                .iter()
                .filter_map(|f| match f {
                    Frame::Data(p) => Some(p),
                    _ => None,
                })
                .collect();
            if let Err(e) = dev.write_frames(&packets) {
                tracing::debug!(device = dev.name(), error = %e, "write failed (counted)");
            }
            drop(packets);
            batch.clear();
        }
    }
}

/// Handles one command; false means stop.
fn handle(switch: &mut Switch, cmd: Command, clock: &dyn Fn() -> Time) -> bool {
    match cmd {
        Command::Apply(edits, reply) => {
            let _ = reply.send(switch.apply(edits));
        }
        Command::Snapshot(reply) => {
            let _ = reply.send(Snapshot {
                spec: switch.describe(),
                modules: switch.module_infos(),
                edges: switch.edges().to_vec(),
                paused: switch.is_paused(),
            });
        }
        Command::Control(frame, reply) => {
            let serial = frame.serial;
            switch.send_control(frame);
            switch.run(clock());
            let mut inbox = switch.take_control_inbox();
            let found = inbox.iter().position(|f| f.serial == serial && f.dest == CONTROL_PLANE);
            let _ = reply.send(found.map(|i| inbox.swap_remove(i)));
        }
        Command::Shutdown(reply) => {
            let names: Vec<String> = switch.module_names().map(str::to_string).collect();
            let _ = switch.apply(names.into_iter().rev().map(|name| Edit::Unload { name }).collect());
            let _ = reply.send(());
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOLD: Duration = Duration::from_micros(30);

    fn at_us(us: u64) -> Time {
        Time(us * 1_000)
    }

    #[test]
    fn sparse_wake_ups_are_read_at_once() {
        let mut m = RxModeration::new(HOLD);
        assert_eq!(m.hold(at_us(1_000), None), Duration::ZERO);
        // A ping's reply 100 us after its request: one short gap.
        assert_eq!(m.hold(at_us(1_100), None), Duration::ZERO);
        // The next ping 10 ms later, and its reply.
        assert_eq!(m.hold(at_us(11_000), None), Duration::ZERO);
        assert_eq!(m.hold(at_us(11_100), None), Duration::ZERO);
        // A gap of exactly 4 holds (120 us) is not short.
        assert_eq!(m.hold(at_us(11_220), None), Duration::ZERO);
        assert_eq!(m.hold(at_us(11_340), None), Duration::ZERO);
    }

    #[test]
    fn wake_ups_in_close_succession_are_held_until_a_quiet_gap() {
        let mut m = RxModeration::new(HOLD);
        assert_eq!(m.hold(at_us(1_000), None), Duration::ZERO);
        assert_eq!(m.hold(at_us(1_050), None), Duration::ZERO);
        assert_eq!(m.hold(at_us(1_100), None), HOLD);
        assert_eq!(m.hold(at_us(1_219), None), HOLD);
        assert_eq!(m.hold(at_us(2_000), None), Duration::ZERO);
        assert_eq!(m.hold(at_us(2_010), None), Duration::ZERO);
        assert_eq!(m.hold(at_us(2_020), None), HOLD);
    }

    #[test]
    fn the_hold_ends_before_a_module_timer_is_due() {
        let mut m = RxModeration::new(HOLD);
        m.hold(at_us(1_000), None);
        m.hold(at_us(1_005), None);
        assert_eq!(m.hold(at_us(1_010), Some(at_us(1_020))), Duration::from_micros(10));
        assert_eq!(m.hold(at_us(1_020), Some(at_us(1_020))), Duration::ZERO);
        assert_eq!(m.hold(at_us(1_030), Some(at_us(1_000))), Duration::ZERO);
        assert_eq!(m.hold(at_us(1_040), Some(at_us(2_000))), HOLD);
    }

    #[test]
    fn a_zero_hold_turns_moderation_off() {
        let mut m = RxModeration::new(Duration::ZERO);
        for us in [1_000, 1_001, 1_002] {
            assert_eq!(m.hold(at_us(us), None), Duration::ZERO);
        }
    }
}
