//! The data-plane thread: owns the [`Switch`], runs it, and applies commands from the control plane between
//! batches.
//!
//! The control plane talks to it only through [`DataPlane`]: [`DataPlane::apply`] sends edits and waits for the
//! verdict, [`DataPlane::snapshot`] asks for the stack's shape. Meters are never read through here: readers use
//! the [`SharedRegistry`], whose cells the data plane updates without locks.

use flexstack_core::config::StackSpec;
use flexstack_core::switch::CONTROL_PLANE;
use flexstack_core::switch::{Edge, ModuleInfo};
use flexstack_core::{ControlFrame, Edit, EditError, PacketPool, SharedRegistry, Switch, Time};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
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

/// Handle to the data-plane thread.
pub struct DataPlane {
    tx: Sender<Command>,
    registry: SharedRegistry,
    thread: Option<JoinHandle<()>>,
}

impl DataPlane {
    /// Starts the data-plane thread with an empty switch.
    pub fn start() -> std::io::Result<DataPlane> {
        let (tx, rx) = mpsc::channel();
        let (reg_tx, reg_rx) = mpsc::channel();
        let thread = std::thread::Builder::new().name("dataplane".into()).spawn(move || {
            let mut switch = Switch::new(PacketPool::default());
            let origin = Instant::now();
            switch.set_profiler(Some(Box::new(move || u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX))));
            let _ = reg_tx.send(switch.registry());
            run_loop(switch, origin, rx);
        })?;
        let registry = reg_rx.recv().map_err(|_| std::io::Error::other("data plane did not start"))?;
        Ok(DataPlane { tx, registry, thread: Some(thread) })
    }

    /// The registry of meters and knobs.
    pub fn registry(&self) -> SharedRegistry {
        self.registry.clone()
    }

    /// Applies `edits` atomically between two batches; returns the switch's notes or why nothing changed.
    pub fn apply(&self, edits: Vec<Edit>) -> Result<Result<Vec<String>, EditError>, DataPlaneGone> {
        let (tx, rx) = mpsc::channel();
        self.tx.send(Command::Apply(edits, tx)).map_err(|_| DataPlaneGone)?;
        rx.recv().map_err(|_| DataPlaneGone)
    }

    /// The stack's current shape.
    pub fn snapshot(&self) -> Result<Snapshot, DataPlaneGone> {
        let (tx, rx) = mpsc::channel();
        self.tx.send(Command::Snapshot(tx)).map_err(|_| DataPlaneGone)?;
        rx.recv().map_err(|_| DataPlaneGone)
    }

    /// Sends a control frame from the control plane through the switch and returns the reply addressed back to
    /// the control plane with the same serial, if one came within the same run.
    pub fn control(&self, frame: ControlFrame) -> Result<Option<ControlFrame>, DataPlaneGone> {
        let (tx, rx) = mpsc::channel();
        self.tx.send(Command::Control(frame, tx)).map_err(|_| DataPlaneGone)?;
        rx.recv().map_err(|_| DataPlaneGone)
    }

    /// Stops the thread, dropping every module (taps flush their files).
    pub fn shutdown(&mut self) {
        let (tx, rx) = mpsc::channel();
        if self.tx.send(Command::Shutdown(tx)).is_ok() {
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

fn run_loop(mut switch: Switch, origin: Instant, rx: Receiver<Command>) {
    let clock = move || now(origin);
    loop {
        // Commands first: they are applied between batches, never inside one.
        loop {
            match rx.try_recv() {
                Ok(cmd) => {
                    if !handle(&mut switch, cmd, &clock) {
                        return;
                    }
                }
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        }
        let t = now(origin);
        switch.run(t);
        let wait = if switch.has_pending() {
            Duration::ZERO
        } else {
            match switch.next_wakeup() {
                Some(w) => (w - now(origin)).min(MAX_IDLE),
                None => MAX_IDLE,
            }
        };
        if wait.is_zero() {
            continue;
        }
        match rx.recv_timeout(wait) {
            Ok(cmd) => {
                if !handle(&mut switch, cmd, &clock) {
                    return;
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
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
