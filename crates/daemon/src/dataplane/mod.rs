//! The data plane: one or more worker threads, each with a [`Switch`] of its own, that do the I/O of face modules
//! and apply commands from the control plane between batches.
//!
//! A worker's loop (`worker.rs`): apply queued commands; read every face device that epoll reported readable (at
//! most a batch each; each worker reads its own queue of the device) and hand the packets to its module
//! ([`Switch::face_ingress`]); run the switch; write what face modules queued ([`Switch::face_egress`], only for the
//! faces the switch called: [`Switch::take_egress_ready`]); wait in epoll for a device, a command (an eventfd the
//! control plane signals) or the next module timer. No step visits every module or face: the switch keeps lists of
//! the modules with work, so a frame costs the same with 1 link or 1,000.
//!
//! With `flexstack daemon --workers N`, N workers run the same stack, each with its own modules, pools and flow
//! state; frames of a flow another worker owns (a symmetric hash of the flow, `steer.rs`) go to it over a bounded
//! single-producer/single-consumer ring, so that both directions of a flow always meet on one worker. Edits are
//! applied by all workers together (the control plane's reply comes after all applied), knob writes go to all,
//! and a meter reads the sum over the workers (docs/architecture.md, "Workers"). A stack with a module that needs
//! a global view (its kind's [`global_view`](flexstack_core::ModuleKind::global_view), or its builder's
//! [`ModuleBuilder::global_view`]) runs on worker 0 alone.
//!
//! Wake-ups by a face can be moderated as a NIC moderates its interrupts ([`RxModeration`], off by default:
//! `flexstack daemon --rx-hold-us N`): while frames stream in (wake-ups closer together than a gap), the loop waits
//! a short hold before reading, so that one wake-up reads several frames instead of one or two. Sparse traffic (a
//! ping) is read at once.
//!
//! The threads can run under the real-time policy SCHED_FIFO (`flexstack daemon --realtime PRIO`; the lab's daemons
//! use it): see [`DataPlane::start`].
//!
//! The control plane talks to it only through [`DataPlane`]: [`DataPlane::apply`] sends edits and waits for the
//! verdict, [`DataPlane::snapshot`] asks for the stack's shape. Meters are never read through here: readers use
//! the [`SharedRegistry`], whose cells the data plane updates without locks.

mod command;
mod moderation;
mod steer;
mod worker;

pub use command::Snapshot;
use command::{Command, Edits};
pub use moderation::{RxModeration, DEFAULT_RX_HOLD};

use flexstack_core::vars::VarCell;
use flexstack_core::{
    Catalog, ControlFrame, Edit, EditError, ModuleBuilder, PacketPool, SharedRegistry, Switch, ValueType, VarSpec,
};
use flexstack_faces::linkwatch::LinkWatch;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::timerfd::{ClockId, TimerFd, TimerFlags};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Barrier, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Handle to the data-plane threads.
pub struct DataPlane {
    workers: Vec<WorkerHandle>,
    registry: SharedRegistry,
    scheduling: String,
    /// Configures the modules of workers other than the first from their kind and settings.
    catalog: Catalog,
    sharding: Mutex<Sharding>,
    /// Edit commands sent (see [`Command::Apply`]).
    epoch: std::sync::atomic::AtomicU64,
}

/// One worker thread.
struct WorkerHandle {
    tx: Sender<Command>,
    wake: Arc<EventFd>,
    registry: SharedRegistry,
    thread: Option<JoinHandle<()>>,
}

/// Whether the stack runs on every worker, and why not.
#[derive(Debug, Default)]
struct Sharding {
    /// Workers running the stack: all, or 1.
    active: usize,
    /// Loaded modules.
    modules: BTreeSet<String>,
    /// Loaded modules that keep the stack on one worker, with the reason.
    single: BTreeMap<String, String>,
}

/// How the data-plane threads run.
#[derive(Clone, Copy, Debug)]
pub struct DataPlaneOptions {
    /// The hold of [`RxModeration`] (zero: read as soon as a face is readable).
    pub rx_hold: Duration,
    /// SCHED_FIFO priority the data-plane thread was asked to run at (1-99; 0: none). See [`DataPlane::start`].
    pub realtime: u8,
    /// Data-plane workers (threads with a switch of their own); at least 1.
    pub workers: usize,
    /// Microseconds a worker keeps polling its devices without sleeping after its last frame (0: never; it
    /// sleeps in epoll as soon as nothing is waiting). The knob `worker.all.busy_poll_us` changes it at runtime.
    pub busy_poll_us: u64,
}

impl Default for DataPlaneOptions {
    fn default() -> DataPlaneOptions {
        DataPlaneOptions { rx_hold: DEFAULT_RX_HOLD, realtime: 0, workers: 1, busy_poll_us: 0 }
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

impl DataPlane {
    /// Starts the data-plane threads (`options.workers`) with empty switches. The threads inherit the caller's
    /// scheduling policy: the daemon (`crate::server`) calls this under SCHED_FIFO when `options.realtime` asks for
    /// it (and goes back to the normal policy afterwards), so that the data plane runs as soon as a face or timer
    /// wakes it, instead of waiting for a core behind the programs whose packets it carries (on the emulator
    /// benchmark, 2 cores shared by an iperf3 sender, its receiver and the daemon, this raised the emulated link's
    /// throughput from about 0.66 to 0.71-0.80 of a plain veth's; BENCHMARKS.md, issue 4). `options.realtime`
    /// itself only says what was asked, for [`DataPlane::scheduling`].
    pub fn start(options: DataPlaneOptions) -> std::io::Result<DataPlane> {
        let n = options.workers.max(1);
        flexstack_faces::set_workers(n);
        let wakes: Vec<Arc<EventFd>> = (0..n)
            .map(|_| EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC).map(Arc::new))
            .collect::<Result<_, _>>()?;
        let first = SharedRegistry::default();
        let busy_poll = busy_poll_knob(&first, options.busy_poll_us);
        let mut workers = Vec::with_capacity(n);
        let mut scheduling = String::new();
        for (id, rings) in worker::rings(n, &wakes).into_iter().enumerate() {
            let registry = if id == 0 { first.clone() } else { first.sharing_runtime() };
            let (handle, sched) = start_worker(id, n, options, registry, rings, busy_poll.clone())?;
            if id == 0 {
                scheduling = sched;
            }
            workers.push(handle);
        }
        let catalog = crate::catalog_quiet();
        let sharding = Mutex::new(Sharding { active: n, ..Sharding::default() });
        let epoch = std::sync::atomic::AtomicU64::new(0);
        Ok(DataPlane { workers, registry: first, scheduling, catalog, sharding, epoch })
    }

    fn send_to(&self, worker: usize, cmd: Command) -> Result<(), DataPlaneGone> {
        let w = &self.workers[worker];
        w.tx.send(cmd).map_err(|_| DataPlaneGone)?;
        w.wake.write(1).map_err(|_| DataPlaneGone)?;
        Ok(())
    }

    /// How the data-plane threads are scheduled: `normal`, `fifo N`, or `normal (real-time priority N was refused:
    /// ...)`.
    pub fn scheduling(&self) -> &str {
        &self.scheduling
    }

    /// How many workers the data plane has, and how many run the stack now, with why only one if so
    /// (`2 of 2`, `1 of 2: module e (emulator) needs a global view`).
    pub fn workers(&self) -> String {
        let n = self.workers.len();
        let s = lock(&self.sharding);
        match s.single.iter().next() {
            Some((name, why)) if n > 1 => format!("1 of {n}: module {name} {why}"),
            _ => format!("{} of {n}", s.active),
        }
    }

    /// How many workers the data plane has (`--workers`); their meters are `worker.<k>.*`.
    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    /// The registry of meters and knobs.
    pub fn registry(&self) -> SharedRegistry {
        self.registry.clone()
    }

    /// Applies `edits` atomically between two batches, on every worker that runs the stack; returns the switch's
    /// notes or why nothing changed.
    pub fn apply(&self, edits: Vec<Edit>) -> Result<Result<Vec<String>, EditError>, DataPlaneGone> {
        let n = self.workers.len();
        let mut s = lock(&self.sharding);
        if n == 1 {
            let result = self.apply_on(&[0], vec![Edits::These(edits)], None)?;
            return Ok(result.into_iter().next().unwrap_or_else(|| Ok(Vec::new())));
        }
        let mut single = s.single.clone();
        let mut modules = s.modules.clone();
        for e in &edits {
            note_edit(&self.catalog, e, &mut modules, &mut single);
        }
        if s.active > 1 && single.is_empty() {
            // Flow variables live on the worker that owns the flow: a write goes to the one that registered it.
            let (vars, edits): (Vec<Edit>, Vec<Edit>) =
                edits.into_iter().partition(|e| matches!(e, Edit::SetVar { .. }));
            if edits.is_empty() && !vars.is_empty() {
                let mut result = Ok(Vec::new());
                for var in vars {
                    result = self.set_var(var)?;
                    if result.is_err() {
                        break;
                    }
                }
                return Ok(result);
            }
            let mut copies = Vec::with_capacity(n);
            let mut refused = None;
            for k in 1..n {
                match self.replicate(&edits, k) {
                    Ok(c) => copies.push(Edits::These(c)),
                    Err((name, why)) => {
                        refused = Some((name, why));
                        break;
                    }
                }
            }
            if let Some((name, why)) = refused {
                drop(copies);
                single.insert(name, why);
                let mut edits = edits;
                edits.extend(vars);
                return self.apply_collapsing(&mut s, edits, modules, single);
            }
            copies.insert(0, Edits::These(edits));
            let everyone: Vec<usize> = (0..n).collect();
            let results = self.apply_on(&everyone, copies, None)?;
            let first = results[0].clone();
            if results.iter().any(|r| r.is_ok() != first.is_ok()) {
                tracing::error!(?results, "workers disagreed on an edit; the stack goes on worker 0 alone");
                s.single.insert(String::new(), "disagreed with worker 0 on an edit".into());
                let others: Vec<usize> = (1..n).collect();
                self.apply_on(&others, others.iter().map(|_| Edits::UnloadAll).collect(), Some(1))?;
                return Ok(first);
            }
            let mut result = first;
            if result.is_ok() {
                s.modules = modules;
                self.registry.link_workers(&self.workers[1..].iter().map(|w| w.registry.clone()).collect::<Vec<_>>());
                for var in vars {
                    if let Err(e) = self.set_var(var)? {
                        result = Err(e);
                        break;
                    }
                }
            }
            return Ok(result);
        }
        if s.active > 1 {
            return self.apply_collapsing(&mut s, edits, modules, single);
        }
        // On worker 0 alone: back on every worker once the stack is empty.
        let result = self.apply_on(&[0], vec![Edits::These(edits)], None)?.remove(0);
        if result.is_ok() {
            s.modules = modules;
            s.single = single;
            if s.modules.is_empty() {
                s.single.clear();
                let everyone: Vec<usize> = (0..n).collect();
                self.apply_on(&everyone, everyone.iter().map(|_| Edits::These(Vec::new())).collect(), Some(n))?;
                s.active = n;
                tracing::info!(workers = n, "the stack is empty: the data plane runs on every worker again");
            }
        }
        Ok(result)
    }

    /// Applies `edits` on worker 0 and, if they hold, leaves the stack to it alone (the other workers unload
    /// theirs): `single` names the module that needs it.
    fn apply_collapsing(
        &self,
        s: &mut Sharding,
        edits: Vec<Edit>,
        modules: BTreeSet<String>,
        single: BTreeMap<String, String>,
    ) -> Result<Result<Vec<String>, EditError>, DataPlaneGone> {
        let n = self.workers.len();
        // Worker 0 first, alone: if its edit fails, nothing changes anywhere. From then on it keeps every frame
        // it reads; what the others handed it meanwhile, under the old stack, is dropped and counted
        // (`drop_stale_total`) until they have unloaded theirs.
        let first = self.apply_on(&[0], vec![Edits::These(edits)], Some(1))?.remove(0);
        if first.is_ok() {
            let others: Vec<usize> = (1..n).collect();
            self.apply_on(&others, others.iter().map(|_| Edits::UnloadAll).collect(), Some(1))?;
            s.active = 1;
            s.modules = modules;
            if let Some((name, why)) = single.iter().next() {
                tracing::info!(module = %name, reason = %why, workers = n, "the stack runs on one data-plane worker");
            }
            s.single = single;
        }
        Ok(first)
    }

    /// Sends `plan[i]` to worker `workers[i]` (all together, behind one barrier when more than one) and waits for
    /// every verdict, in the same order.
    fn apply_on(
        &self,
        workers: &[usize],
        plan: Vec<Edits>,
        active: Option<usize>,
    ) -> Result<Vec<Result<Vec<String>, EditError>>, DataPlaneGone> {
        let barrier = (workers.len() > 1).then(|| Arc::new(Barrier::new(workers.len())));
        let epoch = self.epoch.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        let mut replies = Vec::with_capacity(workers.len());
        for (&k, edits) in workers.iter().zip(plan) {
            let (tx, rx) = mpsc::channel();
            self.send_to(k, Command::Apply { edits, epoch, active, barrier: barrier.clone(), reply: tx })?;
            replies.push(rx);
        }
        replies.into_iter().map(|rx| rx.recv().map_err(|_| DataPlaneGone)).collect()
    }

    /// Writes a flow's variable on the worker that registered it (the first that accepts it).
    fn set_var(&self, edit: Edit) -> Result<Result<Vec<String>, EditError>, DataPlaneGone> {
        let Edit::SetVar { name, value } = edit else { return Ok(Ok(Vec::new())) };
        let mut last = Ok(Vec::new());
        for k in 0..self.workers.len() {
            let e = Edit::SetVar { name: name.clone(), value: value.clone() };
            last = self.apply_on(&[k], vec![Edits::These(vec![e])], None)?.remove(0);
            if last.is_ok() {
                break;
            }
        }
        Ok(last)
    }

    /// The edits of worker `k`: the same, with modules built again for it (a face opens another queue of its
    /// device). Err: the module that cannot run on several workers, and why.
    fn replicate(&self, edits: &[Edit], k: usize) -> Result<Vec<Edit>, (String, String)> {
        let again = |name: &str, kind: &str, settings, builder: &dyn ModuleBuilder| match builder.replica(k) {
            Some(Ok(b)) => Ok(b),
            Some(Err(why)) => Err((name.to_string(), why)),
            None => self
                .catalog
                .configure(kind, settings, None)
                .map_err(|e| (name.to_string(), format!("cannot be configured again for another worker: {e}"))),
        };
        edits
            .iter()
            .map(|e| {
                Ok(match e {
                    Edit::Load { name, kind, settings, builder } => Edit::Load {
                        name: name.clone(),
                        kind: kind.clone(),
                        settings: settings.clone(),
                        builder: again(name, kind, settings, builder.as_ref())?,
                    },
                    Edit::Replace { name, kind, settings, builder, keep_state } => Edit::Replace {
                        name: name.clone(),
                        kind: kind.clone(),
                        settings: settings.clone(),
                        builder: again(name, kind, settings, builder.as_ref())?,
                        keep_state: *keep_state,
                    },
                    Edit::Unload { name } => Edit::Unload { name: name.clone() },
                    Edit::Link(l) => Edit::Link(l.clone()),
                    Edit::Unlink(l) => Edit::Unlink(l.clone()),
                    Edit::SetKnob { module, knob, value } => {
                        Edit::SetKnob { module: module.clone(), knob: knob.clone(), value: value.clone() }
                    }
                    Edit::SetVar { name, value } => Edit::SetVar { name: name.clone(), value: value.clone() },
                    Edit::Pause { module } => Edit::Pause { module: module.clone() },
                    Edit::Resume { module } => Edit::Resume { module: module.clone() },
                })
            })
            .collect()
    }

    /// The stack's current shape (worker 0's; every worker runs the same).
    pub fn snapshot(&self) -> Result<Snapshot, DataPlaneGone> {
        let (tx, rx) = mpsc::channel();
        self.send_to(0, Command::Snapshot(tx))?;
        rx.recv().map_err(|_| DataPlaneGone)
    }

    /// Sends a control frame from the control plane through worker 0's switch and returns the reply addressed back
    /// to the control plane with the same serial, if one came within the same run.
    pub fn control(&self, frame: ControlFrame) -> Result<Option<ControlFrame>, DataPlaneGone> {
        let (tx, rx) = mpsc::channel();
        self.send_to(0, Command::Control(frame, tx))?;
        rx.recv().map_err(|_| DataPlaneGone)
    }

    /// Stops the threads, dropping every module (taps flush their files).
    pub fn shutdown(&mut self) {
        for k in 0..self.workers.len() {
            let (tx, rx) = mpsc::channel();
            if self.send_to(k, Command::Shutdown(tx)).is_ok() {
                let _ = rx.recv_timeout(Duration::from_secs(5));
            }
        }
        for w in &mut self.workers {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// Follows one edit in the set of loaded modules and of those that keep the stack on one worker.
fn note_edit(catalog: &Catalog, edit: &Edit, modules: &mut BTreeSet<String>, single: &mut BTreeMap<String, String>) {
    let global = |kind: &str, b: &dyn ModuleBuilder| {
        let all = catalog.get(kind).is_some_and(|k| k.global_view());
        (all || b.global_view()).then(|| format!("({kind}) needs a global view"))
    };
    match edit {
        Edit::Load { name, kind, builder, .. } | Edit::Replace { name, kind, builder, .. } => {
            modules.insert(name.clone());
            match global(kind, builder.as_ref()) {
                Some(why) => single.insert(name.clone(), why),
                None => single.remove(name),
            };
        }
        Edit::Unload { name } => {
            modules.remove(name);
            single.remove(name);
        }
        _ => {}
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Starts worker `id` of `n`; returns its handle and how its thread is scheduled.
/// The knob every worker reads each round: how long to poll on after the last frame (registered as
/// `worker.all.busy_poll_us`, set to `us`). A write stores it at once (workers load it; no edit needed).
fn busy_poll_knob(registry: &SharedRegistry, us: u64) -> Arc<VarCell> {
    let spec = VarSpec::knob(
        "busy_poll_us",
        ValueType::U64,
        "us",
        "how long the data-plane workers keep polling their devices after their last frame before they sleep \
         (busy-poll: lower latency, a core busy while traffic flows; 0: sleep at once)",
    )
    .with_range(0.0, 1_000_000.0);
    let vars = flexstack_core::vars::DynamicVars::new(registry.clone())
        .register("dataplane", "worker.all", std::slice::from_ref(&spec))
        .unwrap_or_else(|_| flexstack_core::ModuleVars::new(&[spec]));
    let cell = vars.cell("busy_poll_us").expect("declared above").clone();
    cell.set_u64(us.min(1_000_000));
    cell
}

fn start_worker(
    id: usize,
    n: usize,
    options: DataPlaneOptions,
    registry: SharedRegistry,
    rings: worker::Rings,
    busy_poll: Arc<VarCell>,
) -> std::io::Result<(WorkerHandle, String)> {
    let (tx, rx) = mpsc::channel();
    let (ready_tx, ready_rx) = mpsc::channel();
    let wake = rings.wakes[id].clone();
    let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
    epoll.add(wake.as_ref(), EpollEvent::new(EpollFlags::EPOLLIN, worker::WAKE_TOKEN))?;
    let timer = TimerFd::new(ClockId::CLOCK_MONOTONIC, TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC)?;
    epoll.add(&timer, EpollEvent::new(EpollFlags::EPOLLIN, worker::TIMER_TOKEN))?;
    // Without a link watcher (no netlink here?) faces work as before; only their carrier goes unwatched.
    let links = match LinkWatch::open() {
        Ok(w) => match epoll.add(w.fd(), EpollEvent::new(EpollFlags::EPOLLIN, worker::LINK_TOKEN)) {
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
    let thread_registry = registry.clone();
    let wake_switch = wake.clone();
    let name = if id == 0 { "dataplane".to_string() } else { format!("dataplane-{id}") };
    let thread = std::thread::Builder::new().name(name).spawn(move || {
        let scheduling = scheduling_of_this_thread(options.realtime);
        let mut switch = Switch::for_worker(PacketPool::default(), thread_registry.clone(), id as u32, n as u32);
        // A module's work done on another thread (compress's blocks) wakes this worker as a command does.
        let woken = wake_switch;
        switch.set_waker(move || {
            let _ = woken.write(1);
        });
        let origin = Instant::now();
        switch.set_profiler(Some(Box::new(move || u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX))));
        let _ = ready_tx.send(scheduling);
        // The hold is a sleep: keep the kernel's timer slack (50 us by default) from stretching it.
        if !options.rx_hold.is_zero() {
            if let Err(e) = nix::sys::prctl::set_timerslack(1_000) {
                tracing::debug!(error = %e, "cannot set the data plane's timer slack");
            }
        }
        worker::Loop {
            id,
            active: n,
            epoch: 0,
            switch,
            origin,
            rx,
            epoll,
            timer,
            rings,
            moderation: RxModeration::new(options.rx_hold),
            links,
            dynamic: flexstack_core::vars::DynamicVars::new(thread_registry),
            busy_poll,
        }
        .run();
    })?;
    let scheduling = ready_rx.recv().map_err(|_| std::io::Error::other("data plane did not start"))?;
    Ok((WorkerHandle { tx, wake, registry, thread: Some(thread) }, scheduling))
}

/// The data-plane thread has stopped (it panicked or was shut down).
#[derive(Debug, thiserror::Error)]
#[error("the data plane has stopped")]
pub struct DataPlaneGone;

#[cfg(test)]
mod tests {
    use super::*;

    /// An idle data plane sleeps until an event: its loop makes no round while nothing happens (it made one every
    /// 50 ms before). A link change anywhere on the host is an event, so the quietest of a few windows counts.
    #[test]
    fn an_idle_worker_does_not_wake() {
        let mut dp = DataPlane::start(DataPlaneOptions::default()).unwrap();
        let rounds = || dp.registry().snapshot().get("worker.0.rounds_total").map(|v| v.load_u64());
        // The worker registers its meters when it starts.
        let started = Instant::now();
        while rounds().is_none() && started.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let quietest = (0..4)
            .map(|_| {
                let before = rounds().unwrap();
                std::thread::sleep(Duration::from_millis(300));
                rounds().unwrap() - before
            })
            .min();
        assert_eq!(quietest, Some(0), "rounds of an idle worker in 300 ms");
        // A command still wakes it at once.
        let snapshot_at = Instant::now();
        dp.snapshot().unwrap();
        assert!(snapshot_at.elapsed() < Duration::from_secs(1));
        dp.shutdown();
    }
}
