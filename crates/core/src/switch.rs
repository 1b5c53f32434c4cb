//! The switch: runs modules and routes their frames through the linking table.
//!
//! Calling order (one data-plane thread owns the switch):
//! - [`Switch::apply`] a list of [`Edit`]s between batches: all are validated against a model of the stack first
//!   (unknown module, dangling port, type mismatch, forbidden cycle, bad knob value ...) and, only if every one is
//!   valid, committed together; otherwise nothing changes.
//! - [`Switch::inject`] frames from faces, then [`Switch::run`] with `now`: modules whose poll time has come are
//!   polled, then every module with pending input is called once per input port in topological order, so a batch
//!   runs to completion through the graph in one call. Frames move between modules as two-word handles in reused
//!   vectors: no allocation and no lock per frame.
//! - [`Switch::next_wakeup`] says when `run` is due again if nothing is injected.
//!
//! The linking table is compiled into, for each (module, output port), the list of (module, input port)
//! receivers; several receivers get shared copies (reference counts, copy on write). Frames emitted on a port with
//! no receiver are dropped and counted on that port.
//!
//! GSO super-packets ([`crate::frame::MetaKey::GSO`]) travel whole between modules that take them
//! ([`ModuleInterface::accepts_gso`]); before a module that does not, the switch cuts each into its on-wire
//! segments ([`segment_batch`]), so that such a module sees only ordinary packets. The switch meters
//! `gso_cut_total` and `gso_mismatch_total` count the super-packets cut, and those left whole (without the key)
//! because their bytes did not match their description. A module that does not take super-packets sees segments
//! only and emits segments only, so the switch looks for super-packets only in a batch that may hold one: frames
//! injected by a face, carried over by an edit, or emitted by a face or a module that takes them. (Every kind that
//! sets [`crate::frame::MetaKey::GSO`] on a packet takes super-packets; a kind that does not and made one anyway
//! would hand it on whole.)

use crate::config::{valid_name, Endpoint, LinkEntry, LinkSpec, ModuleSpec, Settings, StackSpec};
use crate::frame::{Batch, ControlFrame, ControlOp, Frame, PacketPool};
use crate::module::{port_type, FaceDevice, Module, ModuleBuilder, ModuleInterface, Output, PortSpec, CONTROL_PORT};
use crate::notify::{take_mark, Wakeups};
use crate::time::Time;
use crate::value::{Value, ValueType};
use crate::vars::{Across, DynamicVars, Meter, ModuleVars, Registry, SharedRegistry, VarCell, VarKind, VarSpec};
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// Most frames held at one paused input port; beyond it frames are dropped (and counted).
pub const HOLD_LIMIT: usize = 1 << 16;

/// Rounds of control-frame delivery per run (a bound on chains of replies).
const CONTROL_ROUNDS: usize = 16;

/// Name of the sender/destination that stands for the control plane in control frames.
pub const CONTROL_PLANE: &str = "control";

/// One change to the running stack.
pub enum Edit {
    /// Adds a module.
    Load {
        /// Unique name.
        name: String,
        /// Kind, as in the catalog.
        kind: String,
        /// Settings it was configured with.
        settings: Settings,
        /// The configured module.
        builder: Box<dyn ModuleBuilder>,
    },
    /// Removes a module and every link to or from it; frames waiting at its inputs are dropped (and reported in
    /// the notes [`Switch::apply`] returns).
    Unload {
        /// The module.
        name: String,
    },
    /// Swaps a module for a new one under the same name, keeping its links (the new one must have their ports),
    /// its switch meters and the frames waiting at inputs of the same name (frames at inputs the new one lacks
    /// are dropped, counted and noted).
    Replace {
        /// The module.
        name: String,
        /// Kind of the new module.
        kind: String,
        /// Settings of the new module.
        settings: Settings,
        /// The configured new module.
        builder: Box<dyn ModuleBuilder>,
        /// Hand the old module's state to the new one.
        keep_state: bool,
    },
    /// Adds links.
    Link(LinkSpec),
    /// Removes links.
    Unlink(LinkSpec),
    /// Writes a knob.
    SetKnob {
        /// The module.
        module: String,
        /// The knob's name within the module.
        knob: String,
        /// The new value.
        value: Value,
    },
    /// Writes a knob a module registered at runtime (`flow.…`, `iface.…`: e.g. a flow's class): the module that
    /// registered it gets [`Module::write_knob`] with the variable's whole name. Not part of the stack description.
    SetVar {
        /// The variable's whole name.
        name: String,
        /// The new value.
        value: Value,
    },
    /// Holds frames at one module's inputs (or, with `None`, stops running the whole stack).
    Pause {
        /// The module, or the whole stack.
        module: Option<String>,
    },
    /// Resumes what [`Edit::Pause`] held.
    Resume {
        /// The module, or the whole stack.
        module: Option<String>,
    },
}

impl Edit {
    /// A `Load` edit for a module built outside the catalog (test and benchmark modules): `builder`, under the
    /// kind name `kind`, with no settings.
    pub fn load_built(name: &str, kind: &str, builder: Box<dyn ModuleBuilder>) -> Edit {
        Edit::Load { name: name.into(), kind: kind.into(), settings: Settings::default(), builder }
    }
}

impl fmt::Display for Edit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Edit::Load { name, kind, settings, .. } => write!(f, "module load {name} {kind}{}", fmt_settings(settings)),
            Edit::Unload { name } => write!(f, "module unload {name}"),
            Edit::Replace { name, kind, settings, keep_state, .. } => {
                write!(
                    f,
                    "module replace {name} {kind}{}{}",
                    fmt_settings(settings),
                    if *keep_state { "" } else { " (fresh state)" }
                )
            }
            Edit::Link(l) => write!(f, "link add {l}"),
            Edit::Unlink(l) => write!(f, "link del {l}"),
            Edit::SetKnob { module, knob, value } => write!(f, "set module.{module}.{knob} {value}"),
            Edit::SetVar { name, value } => write!(f, "set {name} {value}"),
            Edit::Pause { module } => {
                write!(f, "pause{}", module.as_ref().map(|m| format!(" {m}")).unwrap_or_default())
            }
            Edit::Resume { module } => {
                write!(f, "resume{}", module.as_ref().map(|m| format!(" {m}")).unwrap_or_default())
            }
        }
    }
}

fn fmt_settings(s: &Settings) -> String {
    s.iter().map(|(k, v)| format!(" {k}={}", v.value)).collect()
}

/// Why an edit was refused; nothing was changed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("edit {}: {message}", index + 1)]
pub struct EditError {
    /// Position of the refused edit in the list given to [`Switch::apply`].
    pub index: usize,
    /// What is wrong and what was expected.
    pub message: String,
}

/// A resolved link: one output port to one input port.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Edge {
    /// Sending module.
    pub from: String,
    /// Its output port.
    pub from_port: String,
    /// Receiving module.
    pub to: String,
    /// Its input port.
    pub to_port: String,
}

impl fmt::Display for Edge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[{}] -> {}[{}]", self.from, self.from_port, self.to, self.to_port)
    }
}

/// The standard meters the switch keeps for every module.
struct SlotMeters {
    frames_in: Arc<VarCell>,
    frames_out: Arc<VarCell>,
    dropped: Arc<VarCell>,
    calls: Arc<VarCell>,
    busy_ns: Arc<VarCell>,
    held: Arc<VarCell>,
    port_in: Vec<Arc<VarCell>>,
    port_out: Vec<Arc<VarCell>>,
    port_dropped: Vec<Arc<VarCell>>,
}

const STD_VARS: [&str; 6] =
    ["frames_in_total", "frames_out_total", "frames_dropped_total", "calls_total", "busy_ns_total", "held_frames"];

impl SlotMeters {
    fn new(iface: &ModuleInterface) -> SlotMeters {
        let m = |name: &str, unit: &str, d: &str| Arc::new(VarCell::new(VarSpec::meter(name, ValueType::U64, unit, d)));
        SlotMeters {
            frames_in: m("frames_in_total", "frames", "frames delivered to the module's inputs"),
            frames_out: m("frames_out_total", "frames", "frames the module emitted on its outputs"),
            dropped: m("frames_dropped_total", "frames", "frames dropped by the module or on its unlinked outputs"),
            calls: m("calls_total", "calls", "process and poll calls"),
            busy_ns: m("busy_ns_total", "ns", "time spent in the module's calls (when the switch is profiled)"),
            held: m("held_frames", "frames", "frames held at the module's inputs while paused"),
            port_in: iface
                .inputs
                .iter()
                .map(|p| {
                    m(&format!("port.{}.frames_in_total", p.name), "frames", "frames that arrived on this input port")
                })
                .collect(),
            port_out: iface
                .outputs
                .iter()
                .map(|p| {
                    m(&format!("port.{}.frames_out_total", p.name), "frames", "frames emitted on this output port")
                })
                .collect(),
            port_dropped: iface
                .outputs
                .iter()
                .map(|p| {
                    m(
                        &format!("port.{}.frames_dropped_total", p.name),
                        "frames",
                        "frames emitted on this output port while it had no receiver",
                    )
                })
                .collect(),
        }
    }

    /// Keeps the counts of `old` where names match (a replaced module's counters continue).
    fn carry_over(&self, old: &SlotMeters) {
        for (a, b) in [
            (&self.frames_in, &old.frames_in),
            (&self.frames_out, &old.frames_out),
            (&self.dropped, &old.dropped),
            (&self.calls, &old.calls),
            (&self.busy_ns, &old.busy_ns),
        ] {
            a.set_u64(b.local_u64());
        }
        for new in self.port_in.iter().chain(&self.port_out).chain(&self.port_dropped) {
            if let Some(o) = old
                .port_in
                .iter()
                .chain(&old.port_out)
                .chain(&old.port_dropped)
                .find(|o| o.spec().name == new.spec().name)
            {
                new.set_u64(o.local_u64());
            }
        }
    }

    fn cells(&self) -> impl Iterator<Item = &Arc<VarCell>> {
        [&self.frames_in, &self.frames_out, &self.dropped, &self.calls, &self.busy_ns, &self.held]
            .into_iter()
            .chain(&self.port_in)
            .chain(&self.port_out)
            .chain(&self.port_dropped)
    }
}

struct Slot {
    paths: Option<Vec<(String, String)>>,
    name: String,
    kind: String,
    settings: Settings,
    iface: ModuleInterface,
    module: Box<dyn Module>,
    vars: ModuleVars,
    meters: SlotMeters,
    pending: Vec<Batch>,
    /// Per input: the frames waiting there may include GSO super-packets (see the module's doc).
    may_gso: Vec<bool>,
    out: Vec<Batch>,
    routes: Vec<Vec<(usize, usize)>>,
    paused: bool,
    wake_at: Option<Time>,
    /// The module has a device (a face): what it queues for it is taken by [`Switch::face_egress`].
    face: bool,
    /// The face is on [`Switch::egress`] already.
    egress_listed: bool,
    /// Set by the module's [`crate::Notifier`]s (from any thread): poll it at the next run.
    marked: Arc<AtomicBool>,
}

impl Slot {
    fn new(name: String, kind: String, settings: Settings, builder: Box<dyn ModuleBuilder>) -> Slot {
        let iface = full_interface(builder.interface());
        let paths = builder.paths();
        let vars = ModuleVars::new(&iface.vars);
        // A knob given as a setting of the same name starts at that value (the module may still store its own),
        // so that describe() writes back what the module was configured with.
        for c in vars.cells().iter().filter(|c| c.spec().kind == VarKind::Knob) {
            let given = settings.get(&c.spec().name).and_then(|s| Value::from_toml(&s.value));
            if let Some(v) = given.and_then(|v| c.spec().validate(&v).ok()) {
                c.store(&v);
            }
        }
        let module = builder.build(&vars);
        let face = module.device().is_some();
        let meters = SlotMeters::new(&iface);
        Slot {
            paths,
            pending: iface.inputs.iter().map(|_| Vec::new()).collect(),
            may_gso: iface.inputs.iter().map(|_| false).collect(),
            out: iface.outputs.iter().map(|_| Vec::new()).collect(),
            routes: iface.outputs.iter().map(|_| Vec::new()).collect(),
            name,
            kind,
            settings,
            iface,
            module,
            vars,
            meters,
            paused: false,
            // Every module is polled once right after it is loaded.
            wake_at: Some(Time::ZERO),
            face,
            egress_listed: false,
            marked: Arc::new(AtomicBool::new(false)),
        }
    }

    fn held(&self) -> u64 {
        self.pending.iter().map(|b| b.len() as u64).sum()
    }
}

/// The interface with the implicit control port appended to the outputs.
fn full_interface(mut iface: ModuleInterface) -> ModuleInterface {
    iface.outputs.push(PortSpec::new(CONTROL_PORT, port_type::CONTROL));
    iface
}

/// The switch: modules, the compiled linking table, the packet pool and the registry of variables.
pub struct Switch {
    slots: Vec<Slot>,
    index: HashMap<String, usize>,
    edges: Vec<Edge>,
    order: Vec<usize>,
    pool: PacketPool,
    paused: bool,
    // Boxed: a control frame travels as `Frame::Control(Box<_>)`, so queueing and delivery move one pointer.
    #[allow(clippy::vec_box)]
    control: Vec<Box<ControlFrame>>,
    control_inbox: Vec<ControlFrame>,
    listeners: BTreeSet<(String, String, String)>,
    next_serial: u32,
    registry: SharedRegistry,
    dynamic: DynamicVars,
    profiler: Option<Box<dyn FnMut() -> u64>>,
    switch_vars: ModuleVars,
    hot: HotMeters,
    /// The data-plane worker this switch is (0..n), and n ([`Output::worker`]).
    worker: (u32, u32),
    /// Position of each module in `order`.
    rank: Vec<usize>,
    /// Passes a run makes at most ([`Switch::run`]): one more than the cycle-breaking modules, at least 4.
    passes: usize,
    /// Ranks of the modules that may have frames waiting at their inputs: every module with some is in it, so a
    /// run visits only these (in topological order) rather than every module.
    ready: BTreeSet<usize>,
    /// (time, module) for each module's poll time: every module not paused whose `wake_at` is set has an entry
    /// with that time; entries whose time no longer matches are stale and skipped.
    timers: BinaryHeap<Reverse<(Time, usize)>>,
    /// Reused list of the modules due in a run.
    due: Vec<usize>,
    /// Faces that were called (and so may have queued frames for their device) since [`Switch::take_egress_ready`].
    egress: Vec<usize>,
    /// How modules' [`crate::Notifier`]s wake the thread running the switch ([`Switch::set_waker`]).
    wakeups: Option<Arc<Wakeups>>,
}

/// Handles of the switch meters written on every run, so the hot path does no lookup by name.
struct HotMeters {
    runs: Meter,
    injected: Meter,
    pool_allocated: Meter,
    pool_free: Meter,
    pool_free_bytes: Meter,
    gso_cut: Meter,
    gso_mismatch: Meter,
}

/// One row of `show runtime`, read from the registry.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct RuntimeRow {
    /// Module name.
    pub module: String,
    /// Calls made to the module.
    pub calls: u64,
    /// Frames it handled (arrived, or emitted for modules without inputs).
    pub frames: u64,
    /// Average frames per call.
    pub frames_per_call: f64,
    /// Average nanoseconds per frame (0 when not profiled).
    pub ns_per_frame: f64,
}

impl Default for Switch {
    fn default() -> Self {
        Switch::new(PacketPool::default())
    }
}

impl Switch {
    /// An empty switch using `pool` for packets.
    pub fn new(pool: PacketPool) -> Switch {
        Switch::for_worker(pool, SharedRegistry::default(), 0, 1)
    }

    /// An empty switch for data-plane worker `worker` of `workers`, publishing into `registry` (for a worker
    /// other than the first: [`SharedRegistry::sharing_runtime`] of the first's, so that flows' variables are
    /// found in one place and the first worker's cells stand for the others').
    pub fn for_worker(pool: PacketPool, registry: SharedRegistry, worker: u32, workers: u32) -> Switch {
        let switch_vars = ModuleVars::new(&[
            VarSpec::meter("runs_total", ValueType::U64, "runs", "times the switch ran its modules"),
            VarSpec::meter("frames_injected_total", ValueType::U64, "frames", "frames injected by faces"),
            // Every worker commits every edit: the count is one worker's, not their sum.
            VarSpec::meter("edits_total", ValueType::U64, "edits", "edits committed").with_across(Across::Max),
            VarSpec::meter("paused", ValueType::Bool, "", "true while the whole stack is paused"),
            VarSpec::meter("pool_allocated_total", ValueType::U64, "buffers", "packet buffers allocated from the heap"),
            VarSpec::meter("pool_free", ValueType::U64, "buffers", "packet buffers on the free list"),
            VarSpec::meter("pool_free_bytes", ValueType::U64, "bytes", "bytes of buffer the free list holds"),
            VarSpec::meter(
                "gso_cut_total",
                ValueType::U64,
                "frames",
                "GSO super-packets cut into segments before a module that does not take them whole",
            ),
            VarSpec::meter(
                "gso_mismatch_total",
                ValueType::U64,
                "frames",
                "GSO super-packets whose bytes did not match their description: passed on whole, without the key",
            ),
        ]);
        let mut s = Switch {
            slots: Vec::new(),
            index: HashMap::new(),
            edges: Vec::new(),
            order: Vec::new(),
            pool,
            paused: false,
            control: Vec::new(),
            control_inbox: Vec::new(),
            listeners: BTreeSet::new(),
            next_serial: 0,
            registry: registry.clone(),
            dynamic: DynamicVars::new(registry),
            profiler: None,
            hot: HotMeters {
                runs: switch_vars.meter("runs_total"),
                injected: switch_vars.meter("frames_injected_total"),
                pool_allocated: switch_vars.meter("pool_allocated_total"),
                pool_free: switch_vars.meter("pool_free"),
                pool_free_bytes: switch_vars.meter("pool_free_bytes"),
                gso_cut: switch_vars.meter("gso_cut_total"),
                gso_mismatch: switch_vars.meter("gso_mismatch_total"),
            },
            switch_vars,
            worker: (worker, workers.max(1)),
            rank: Vec::new(),
            passes: 4,
            ready: BTreeSet::new(),
            timers: BinaryHeap::new(),
            due: Vec::new(),
            egress: Vec::new(),
            wakeups: None,
        };
        s.publish();
        s
    }

    /// The registry handle that readers on other threads keep.
    pub fn registry(&self) -> SharedRegistry {
        self.registry.clone()
    }

    /// The packet pool.
    pub fn pool(&self) -> &PacketPool {
        &self.pool
    }

    /// Measures each module call with `clock` (nanoseconds), for `busy_ns_total` and `show runtime`.
    pub fn set_profiler(&mut self, clock: Option<Box<dyn FnMut() -> u64>>) {
        self.profiler = clock;
    }

    /// True while the whole stack is paused.
    pub fn is_paused(&self) -> bool {
        self.paused
    }

    /// Names of the loaded modules, in load order.
    pub fn module_names(&self) -> impl Iterator<Item = &str> {
        self.slots.iter().map(|s| s.name.as_str())
    }

    /// The resolved links, in the order they were added.
    pub fn edges(&self) -> &[Edge] {
        &self.edges
    }

    /// Validates `edits` and commits them all, or changes nothing and says which edit is wrong and why.
    /// Returns notes about side effects (links removed with an unloaded module, state not handed over ...).
    pub fn apply(&mut self, edits: Vec<Edit>) -> Result<Vec<String>, EditError> {
        let mut model = Model::of(self);
        let ifaces: Vec<Option<(ModuleInterface, Paths)>> = edits
            .iter()
            .map(|e| match e {
                Edit::Load { builder, .. } | Edit::Replace { builder, .. } => {
                    Some((full_interface(builder.interface()), builder.paths()))
                }
                _ => None,
            })
            .collect();
        for (index, (edit, iface)) in edits.iter().zip(&ifaces).enumerate() {
            model.check(edit, iface.as_ref()).map_err(|message| EditError { index, message })?;
            if let Edit::SetVar { name, value } = edit {
                self.check_runtime_knob(name, value).map_err(|message| EditError { index, message })?;
            }
        }
        model.check_cycles().map_err(|message| EditError { index: edits.len().saturating_sub(1), message })?;

        let mut notes = Vec::new();
        for edit in edits {
            self.commit(edit, &mut notes);
        }
        self.compile();
        self.switch_vars.meter("edits_total").add(1);
        self.publish();
        Ok(notes)
    }

    fn commit(&mut self, edit: Edit, notes: &mut Vec<String>) {
        match edit {
            Edit::Load { name, kind, settings, builder } => {
                let slot = Slot::new(name.clone(), kind, settings, builder);
                self.index.insert(name, self.slots.len());
                self.slots.push(slot);
            }
            Edit::Unload { name } => {
                let before = self.edges.len();
                self.edges.retain(|e| {
                    let touches = e.from == name || e.to == name;
                    if touches {
                        notes.push(format!("removed link {e}"));
                    }
                    !touches
                });
                let _ = before;
                if let Some(i) = self.index.remove(&name) {
                    let slot = self.slots.remove(i);
                    let held = slot.held();
                    if held > 0 {
                        notes.push(format!("dropped {held} frames held at {name}"));
                    }
                    self.listeners.retain(|(src, _, l)| *src != name && *l != name);
                    self.dynamic.unregister_owner(&name);
                    self.reindex();
                }
            }
            Edit::Replace { name, kind, settings, builder, keep_state } => {
                let Some(&i) = self.index.get(&name) else {
                    return;
                };
                let mut fresh = Slot::new(name.clone(), kind, settings, builder);
                let old = &mut self.slots[i];
                let mut handed_over = false;
                if keep_state {
                    match old.module.take_state() {
                        Some(state) => match fresh.module.adopt_state(state) {
                            Ok(()) => handed_over = true,
                            Err(e) => notes.push(format!("{name}: state not handed over: {e}")),
                        },
                        None => notes.push(format!("{name}: the old module had no state to hand over")),
                    }
                }
                fresh.meters.carry_over(&old.meters);
                // Frames waiting at inputs that still exist move to the new module.
                for (p, port) in fresh.iface.inputs.iter().enumerate() {
                    if let Some(q) = old.iface.inputs.iter().position(|o| o.name == port.name) {
                        fresh.pending[p] = std::mem::take(&mut old.pending[q]);
                        fresh.may_gso[p] = true;
                    }
                }
                // Those waiting at inputs the new module lacks are dropped, counted and noted.
                for (q, port) in old.iface.inputs.iter().enumerate() {
                    let n = old.pending[q].len();
                    if n > 0 {
                        notes.push(format!("dropped {n} frames held at {name}[{}]", port.name));
                        fresh.meters.dropped.add_u64(n as u64);
                    }
                }
                fresh.paused = old.paused;
                // Notifiers the old module handed out (work still out, taken over with its state) poll the new one.
                fresh.marked = old.marked.clone();
                self.slots[i] = fresh;
                // The runtime variables of the old module go with it unless its state (which holds them) moved on.
                if !handed_over {
                    self.dynamic.unregister_owner(&name);
                }
            }
            Edit::Link(spec) => {
                for e in self.resolve(&spec) {
                    self.edges.push(e);
                }
            }
            Edit::Unlink(spec) => {
                let gone: Vec<Edge> = self.resolve(&spec);
                self.edges.retain(|e| !gone.contains(e));
            }
            Edit::SetKnob { module, knob, value } => {
                if let Err(e) = self.write_knob(&module, &knob, &value) {
                    notes.push(format!("set module.{module}.{knob}: {e}"));
                }
            }
            Edit::SetVar { name, value } => {
                if let Err(e) = self.write_runtime_knob(&name, &value) {
                    notes.push(format!("set {name}: {e}"));
                }
            }
            Edit::Pause { module: None } => {
                self.paused = true;
                self.switch_vars.meter("paused").store(&Value::Bool(true));
            }
            Edit::Resume { module: None } => {
                self.paused = false;
                self.switch_vars.meter("paused").store(&Value::Bool(false));
                for s in self.slots.iter().filter(|s| !s.paused) {
                    s.meters.held.set_u64(0);
                }
            }
            Edit::Pause { module: Some(m) } => {
                if let Some(&i) = self.index.get(&m) {
                    self.slots[i].paused = true;
                }
            }
            Edit::Resume { module: Some(m) } => {
                if let Some(&i) = self.index.get(&m) {
                    self.slots[i].paused = false;
                    self.slots[i].meters.held.set_u64(0);
                }
            }
        }
    }

    fn reindex(&mut self) {
        self.index = self.slots.iter().enumerate().map(|(i, s)| (s.name.clone(), i)).collect();
    }

    /// Resolves a link written by the user against the current modules (validated already).
    fn resolve(&self, spec: &LinkSpec) -> Vec<Edge> {
        let ifaces = |m: &str| self.index.get(m).map(|&i| &self.slots[i].iface);
        spec.to
            .iter()
            .filter_map(|to| {
                let from_port = resolve_port(&spec.from, ifaces(&spec.from.module)?, true).ok()?;
                let to_port = resolve_port(to, ifaces(&to.module)?, false).ok()?;
                Some(Edge { from: spec.from.module.clone(), from_port, to: to.module.clone(), to_port })
            })
            .collect()
    }

    fn write_knob(&mut self, module: &str, knob: &str, value: &Value) -> Result<(), String> {
        let &i = self.index.get(module).ok_or_else(|| format!("no module named {module}"))?;
        let slot = &mut self.slots[i];
        let cell = slot.vars.cell(knob).ok_or_else(|| format!("module {module} has no knob {knob}"))?.clone();
        let v = cell.spec().validate(value)?;
        slot.module.write_knob(knob, &v)?;
        cell.store(&v);
        // Polled at the next run, so the module can act on the new value (e.g. a source resuming).
        self.wake_now(i);
        Ok(())
    }

    /// Checks a write of runtime knob `name`: a module registered it, it is a knob, and `value` fits it.
    fn check_runtime_knob(&self, name: &str, value: &Value) -> Result<(), String> {
        let (_, cell) =
            self.dynamic.owner_of(name).ok_or_else(|| format!("no variable {name} registered by a module"))?;
        if cell.spec().kind != VarKind::Knob {
            return Err(format!("{name} is a meter (read-only)"));
        }
        cell.spec().validate(value).map(|_| ()).map_err(|e| format!("{name}: {e}"))
    }

    /// Writes runtime knob `name` through the module that registered it (checked first by
    /// [`Switch::check_runtime_knob`]).
    fn write_runtime_knob(&mut self, name: &str, value: &Value) -> Result<(), String> {
        let (owner, cell) = self.dynamic.owner_of(name).ok_or_else(|| format!("no runtime variable {name}"))?;
        let &i = self.index.get(owner).ok_or_else(|| format!("no module named {owner}"))?;
        let v = cell.spec().validate(value)?;
        let slot = &mut self.slots[i];
        slot.module.write_knob(name, &v)?;
        cell.store(&v);
        self.wake_now(i);
        Ok(())
    }

    /// Recompiles the linking table and the processing order from the modules and edges.
    fn compile(&mut self) {
        for s in &mut self.slots {
            for r in &mut s.routes {
                r.clear();
            }
        }
        for e in &self.edges {
            let (Some(&a), Some(&b)) = (self.index.get(&e.from), self.index.get(&e.to)) else {
                continue;
            };
            let (Some(p), Some(q)) = (
                self.slots[a].iface.outputs.iter().position(|p| p.name == e.from_port),
                self.slots[b].iface.inputs.iter().position(|p| p.name == e.to_port),
            ) else {
                continue;
            };
            self.slots[a].routes[p].push((b, q));
        }
        // Kahn's algorithm; edges out of cycle-breaking modules do not order anything.
        let n = self.slots.len();
        let mut indegree = vec![0usize; n];
        for s in &self.slots {
            if s.iface.breaks_cycles {
                continue;
            }
            for r in s.routes.iter().flatten() {
                indegree[r.0] += 1;
            }
        }
        let mut ready: Vec<usize> = (0..n).filter(|&i| indegree[i] == 0).rev().collect();
        self.order.clear();
        while let Some(i) = ready.pop() {
            self.order.push(i);
            if self.slots[i].iface.breaks_cycles {
                continue;
            }
            let mut next: Vec<usize> = Vec::new();
            for r in self.slots[i].routes.iter().flatten() {
                indegree[r.0] -= 1;
                if indegree[r.0] == 0 {
                    next.push(r.0);
                }
            }
            next.sort_unstable();
            next.dedup();
            ready.extend(next.into_iter().rev());
        }
        // Validation rejected cycles; should one slip through, run the rest in load order rather than never.
        let mut placed = vec![false; n];
        for &i in &self.order {
            placed[i] = true;
        }
        for (i, _) in placed.iter().enumerate().filter(|(_, p)| !**p) {
            self.order.push(i);
        }
        // A frame moves backwards in the order only out of a cycle-breaking module, and a pass takes it no further
        // than the next such hop: one pass per cycle-breaking module it crosses (a chain of stream services, each
        // one, is crossed in one run, not a hop per run with a round of I/O between).
        self.passes = 4.max(self.slots.iter().filter(|s| s.iface.breaks_cycles).count() + 1);
        self.rebuild_work();
    }

    /// Rebuilds the bookkeeping of work from the modules (after an edit: indices and order may have changed): the
    /// ranks, the modules with frames waiting, the timers, and every face as possibly having egress.
    fn rebuild_work(&mut self) {
        self.rank = vec![0; self.slots.len()];
        for (r, &i) in self.order.iter().enumerate() {
            self.rank[i] = r;
        }
        self.ready = (0..self.slots.len()).filter(|&i| self.slots[i].held() > 0).map(|i| self.rank[i]).collect();
        self.rebuild_timers();
        self.egress.clear();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            slot.egress_listed = slot.face;
            if slot.face {
                self.egress.push(i);
            }
        }
    }

    fn rebuild_timers(&mut self) {
        self.timers = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.paused)
            .filter_map(|(i, s)| s.wake_at.map(|t| Reverse((t, i))))
            .collect();
    }

    /// True if the timer entry (t, i) is current: module `i` is not paused and is due at `t`.
    fn timer_current(&self, t: Time, i: usize) -> bool {
        self.slots.get(i).is_some_and(|s| !s.paused && s.wake_at == Some(t))
    }

    /// Sets module `i`'s poll time and, when it changed, its timer entry.
    fn set_wake(&mut self, i: usize, wake: Option<Time>) {
        let slot = &mut self.slots[i];
        if slot.wake_at != wake {
            slot.wake_at = wake;
            self.arm(i);
        }
    }

    /// Adds the timer entry of module `i`'s current poll time (if it has one and is not paused).
    fn arm(&mut self, i: usize) {
        let slot = &self.slots[i];
        if let (Some(t), false) = (slot.wake_at, slot.paused) {
            self.timers.push(Reverse((t, i)));
        }
    }

    /// Module `i` is polled at the next run.
    fn wake_now(&mut self, i: usize) {
        self.set_wake(i, Some(Time::ZERO));
        self.note_called(i);
    }

    /// Module `i` was called: if it is a face it may have queued frames for its device.
    fn note_called(&mut self, i: usize) {
        let slot = &mut self.slots[i];
        if slot.face && !slot.egress_listed {
            slot.egress_listed = true;
            self.egress.push(i);
        }
    }

    /// Module `i` has frames waiting at an input.
    fn mark_ready(&mut self, i: usize) {
        if let Some(&r) = self.rank.get(i) {
            self.ready.insert(r);
        }
    }

    /// Publishes the current variables to the shared registry.
    fn publish(&mut self) {
        let mut reg = Registry::default();
        for c in self.switch_vars.cells() {
            reg.insert(format!("switch.{}", c.spec().name), c.clone());
        }
        for s in &self.slots {
            for c in s.meters.cells().chain(s.vars.cells()) {
                reg.insert(format!("module.{}.{}", s.name, c.spec().name), c.clone());
            }
        }
        self.registry.publish(reg);
    }

    /// Hands frames from a face to input port `port` of `module`; `frames` is left empty.
    pub fn inject(&mut self, module: &str, port: &str, frames: &mut Batch) -> Result<(), String> {
        let &i = self.index.get(module).ok_or_else(|| format!("no module named {module}"))?;
        let slot = &mut self.slots[i];
        let q = slot
            .iface
            .inputs
            .iter()
            .position(|p| p.name == port)
            .ok_or_else(|| format!("module {module} has no input port {port}"))?;
        self.hot.injected.add(frames.len() as u64);
        slot.may_gso[q] = true;
        let dest = &mut slot.pending[q];
        let room = HOLD_LIMIT.saturating_sub(dest.len());
        if frames.len() > room {
            let extra = frames.len() - room;
            frames.truncate(room);
            slot.meters.dropped.add_u64(extra as u64);
        }
        if dest.is_empty() {
            // Move the vector rather than copy the frames; the face gets an empty one back (with capacity).
            std::mem::swap(dest, frames);
        } else {
            dest.append(frames);
        }
        self.mark_ready(i);
        Ok(())
    }

    /// The face modules (those with a device), as (module index, device); indices hold until the next edit
    /// ([`Switch::generation`] tells when that happened).
    pub fn faces(&self) -> Vec<(usize, Arc<dyn FaceDevice>)> {
        self.slots.iter().enumerate().filter_map(|(i, s)| s.module.device().map(|d| (i, d))).collect()
    }

    /// Counts committed edits: face indices from [`Switch::faces`] are valid while it does not change.
    pub fn generation(&self) -> u64 {
        self.switch_vars.cell("edits_total").map_or(0, |c| c.local_u64())
    }

    /// Frames read from the device of face module `index`: they leave the module on its first output port and
    /// are routed at once; `frames` is left empty. Run the switch afterwards.
    pub fn face_ingress(&mut self, index: usize, frames: &mut Batch) {
        let Some(slot) = self.slots.get_mut(index) else {
            frames.clear();
            return;
        };
        self.hot.injected.add(frames.len() as u64);
        if slot.out.len() < 2 {
            // No data output (only `ctl`): nothing can leave.
            slot.meters.dropped.add_u64(frames.len() as u64);
            frames.clear();
            return;
        }
        slot.out[0].append(frames);
        let dropped = self.route(index);
        self.slots[index].meters.dropped.add_u64(dropped);
    }

    /// The index of module `name` (as [`Switch::faces`] and [`Switch::face_link_changed`] use), until the next edit.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    /// The link of face module `index` went up or down: its `carrier` meter (if it declares one) is set to 1 or 0
    /// and its `carrier_changes_total` counted, and every module is told ([`Module::link_changed`] with the face's
    /// name); those that act on it are polled at the next run.
    pub fn face_link_changed(&mut self, index: usize, up: bool) {
        let Some(slot) = self.slots.get(index) else { return };
        let face = slot.name.clone();
        if let Some(cell) = slot.vars.cell("carrier") {
            cell.store(&Value::U64(u64::from(up)));
        }
        if let Some(cell) = slot.vars.cell("carrier_changes_total") {
            cell.add_u64(1);
        }
        for i in 0..self.slots.len() {
            if self.slots[i].module.link_changed(&face, up) {
                self.wake_now(i);
            }
        }
    }

    /// The face modules that may have queued frames for their devices since the last call (those called since,
    /// and after an edit every face), into `into` (cleared first): only these need [`Switch::face_egress`].
    pub fn take_egress_ready(&mut self, into: &mut Vec<usize>) {
        into.clear();
        std::mem::swap(into, &mut self.egress);
        for &i in into.iter() {
            if let Some(slot) = self.slots.get_mut(i) {
                slot.egress_listed = false;
            }
        }
    }

    /// Moves the frames face module `index` queued for its device into `into`.
    pub fn face_egress(&mut self, index: usize, into: &mut Batch) {
        if let Some(slot) = self.slots.get_mut(index) {
            slot.module.take_egress(into);
        }
    }

    /// Queues a control frame from the control plane (`sender` should be [`CONTROL_PLANE`]).
    pub fn send_control(&mut self, frame: ControlFrame) {
        self.control.push(Box::new(frame));
    }

    /// Control frames addressed to the control plane since the last call.
    pub fn take_control_inbox(&mut self) -> Vec<ControlFrame> {
        std::mem::take(&mut self.control_inbox)
    }

    /// How the modules' [`crate::Notifier`]s wake the thread that runs this switch (e.g. a write to the eventfd its loop
    /// waits on); without it, [`Output::notifier`] gives none and modules poll on timers. A notified module is
    /// polled at the next [`Switch::run`].
    pub fn set_waker(&mut self, wake: impl Fn() + Send + Sync + 'static) {
        self.wakeups = Some(Arc::new(Wakeups::new(Box::new(wake))));
    }

    /// The earliest time a module asked to be polled, or `None`.
    pub fn next_wakeup(&self) -> Option<Time> {
        if self.paused {
            return None;
        }
        match self.timers.peek() {
            None => None,
            Some(&Reverse((t, i))) if self.timer_current(t, i) => Some(t),
            // Stale entries are cleared at the end of each run and the timers rebuilt after each edit, so this
            // does not happen; should it, the answer is still right.
            Some(_) => self.slots.iter().filter(|s| !s.paused).filter_map(|s| s.wake_at).min(),
        }
    }

    /// True if frames wait at inputs of modules that are not paused.
    pub fn has_pending(&self) -> bool {
        !self.paused
            && self.ready.iter().any(|&r| {
                let s = &self.slots[self.order[r]];
                !s.paused && s.pending.iter().any(|b| !b.is_empty())
            })
    }

    /// Runs everything that is due at `now`: polls, control frames, and the pending frames through the graph.
    /// Returns the number of module calls made.
    pub fn run(&mut self, now: Time) -> u64 {
        if self.paused {
            for s in &self.slots {
                s.meters.held.set_u64(s.held());
            }
            return 0;
        }
        self.hot.runs.add(1);
        let mut calls = 0;
        if self.wakeups.as_ref().is_some_and(|w| w.take_any()) {
            for i in 0..self.slots.len() {
                if take_mark(&self.slots[i].marked) {
                    self.set_wake(i, Some(Time::ZERO));
                }
            }
        }
        // The modules due are polled in load order; a poll arms the module's next time (after this loop: a poll
        // asking for a time already past is polled again at the next run, not in this one).
        let mut due = std::mem::take(&mut self.due);
        while let Some(&Reverse((t, i))) = self.timers.peek() {
            if t > now {
                break;
            }
            self.timers.pop();
            if self.timer_current(t, i) {
                due.push(i);
            }
        }
        due.sort_unstable();
        due.dedup();
        for &i in &due {
            if !self.slots[i].paused && self.slots[i].wake_at.is_some_and(|t| t <= now) {
                self.call(i, None, now);
                calls += 1;
            }
        }
        due.clear();
        self.due = due;
        self.deliver_control(now);
        // One topological pass drains a DAG; further passes pick up frames from control handling and those sent
        // back to earlier modules (out of cycle-breaking ones; `passes` bounds them). A pass visits, in order, the
        // modules with frames waiting at or after its cursor; those that get frames behind the cursor wait for the
        // next pass.
        for _ in 0..self.passes {
            let mut progressed = false;
            let mut cursor = 0;
            while let Some(&r) = self.ready.range(cursor..).next() {
                cursor = r + 1;
                let i = self.order[r];
                if self.slots[i].paused {
                    // Stays ready: it runs when resumed.
                    self.slots[i].meters.held.set_u64(self.slots[i].held());
                    continue;
                }
                self.ready.remove(&r);
                for port in 0..self.slots[i].pending.len() {
                    if !self.slots[i].pending[port].is_empty() {
                        self.call(i, Some(port), now);
                        calls += 1;
                        progressed = true;
                    }
                }
            }
            self.deliver_control(now);
            if !progressed || !self.has_pending() {
                break;
            }
        }
        self.tidy_timers();
        let ps = self.pool.stats();
        self.hot.pool_allocated.set(ps.allocated);
        self.hot.pool_free.set(ps.free);
        self.hot.pool_free_bytes.set(ps.free_bytes);
        calls
    }

    /// Drops stale timer entries from the top of the heap (so [`Switch::next_wakeup`] reads the top), and rebuilds
    /// the heap when stale entries further down have piled up.
    fn tidy_timers(&mut self) {
        while let Some(&Reverse((t, i))) = self.timers.peek() {
            if self.timer_current(t, i) {
                break;
            }
            self.timers.pop();
        }
        if self.timers.len() > 4 * self.slots.len() + 64 {
            self.rebuild_timers();
        }
    }

    /// One call into module `i`: `process` for input `port`, or `poll` when `port` is `None`; then routes outputs.
    fn call(&mut self, i: usize, port: Option<usize>, now: Time) {
        let start = self.profiler.as_mut().map(|c| c());
        let slot = &mut self.slots[i];
        let mut input = match port {
            Some(p) => std::mem::take(&mut slot.pending[p]),
            None => Vec::new(),
        };
        let may_gso = port.is_some_and(|p| std::mem::take(&mut slot.may_gso[p]));
        if may_gso && !slot.iface.accepts_gso {
            let done = segment_batch(&self.pool, &mut input);
            if done != Segmented::default() {
                self.hot.gso_cut.add(done.cut);
                self.hot.gso_mismatch.add(done.mismatched);
            }
        }
        let arrived = input.len() as u64;
        let (module, mut out) = self.module_and_output(i, now);
        let polled = match port {
            Some(p) => {
                module.process(p, &mut input, &mut out);
                None
            }
            None => Some(module.poll(&mut out)),
        };
        let (out_dropped, wake) = (out.dropped, out.wake);
        let before = self.slots[i].wake_at;
        let mut after = polled.unwrap_or(before);
        if let Some(w) = wake {
            after = Some(after.map_or(w, |t| t.min(w)));
        }
        self.slots[i].wake_at = after;
        // A poll took the module's timer entry (if it was due): it is armed again even at the same time.
        if polled.is_some() || after != before {
            self.arm(i);
        }
        self.note_called(i);
        let slot = &mut self.slots[i];
        let mut dropped = out_dropped + input.len() as u64;
        input.clear();
        if let Some(p) = port {
            // Give the emptied vector back so its capacity is reused.
            if slot.pending[p].is_empty() {
                slot.pending[p] = input;
            }
            slot.meters.port_in[p].add_u64(arrived);
            slot.meters.frames_in.add_u64(arrived);
        }
        slot.meters.calls.add_u64(1);
        if let (Some(t0), Some(clock)) = (start, self.profiler.as_mut()) {
            let t1 = clock();
            self.slots[i].meters.busy_ns.add_u64(t1.saturating_sub(t0));
        }
        dropped += self.route(i);
        self.slots[i].meters.dropped.add_u64(dropped);
    }

    /// Moves what module `i` emitted to its receivers; returns frames dropped for lack of a receiver.
    fn route(&mut self, i: usize) -> u64 {
        let mut dropped = 0;
        for p in 0..self.slots[i].out.len() {
            if self.slots[i].out[p].is_empty() {
                continue;
            }
            let mut buf = std::mem::take(&mut self.slots[i].out[p]);
            let n = buf.len() as u64;
            let src = &self.slots[i];
            src.meters.port_out[p].add_u64(n);
            src.meters.frames_out.add_u64(n);
            let gso_out = src.iface.accepts_gso || src.face;
            let routes = std::mem::take(&mut self.slots[i].routes[p]);
            match routes.len() {
                0 => {
                    dropped += n;
                    self.slots[i].meters.port_dropped[p].add_u64(n);
                    buf.clear();
                }
                count => {
                    for (k, &(d, q)) in routes.iter().enumerate() {
                        let last = k + 1 == count;
                        if let Some(&r) = self.rank.get(d) {
                            self.ready.insert(r);
                        }
                        let dest_slot = &mut self.slots[d];
                        dest_slot.may_gso[q] |= gso_out;
                        let dest = &mut dest_slot.pending[q];
                        let room = if dest_slot.paused || self.paused {
                            HOLD_LIMIT.saturating_sub(dest.len())
                        } else {
                            usize::MAX
                        };
                        if last && dest.is_empty() && room >= buf.len() {
                            std::mem::swap(dest, &mut buf);
                        } else if last {
                            let over = buf.len().saturating_sub(room);
                            buf.truncate(buf.len() - over);
                            dest_slot.meters.dropped.add_u64(over as u64);
                            dest.append(&mut buf);
                        } else {
                            let take = buf.len().min(room);
                            dest.extend(buf[..take].iter().cloned());
                            dest_slot.meters.dropped.add_u64((buf.len() - take) as u64);
                        }
                    }
                }
            }
            self.slots[i].routes[p] = routes;
            if self.slots[i].out[p].is_empty() {
                self.slots[i].out[p] = buf;
            }
        }
        dropped
    }

    /// Delivers queued control frames: the switch answers parameter reads and writes and keeps listener lists;
    /// procedures go to `execute`, replies, alerts and errors to `handle_control`. Every frame is also mirrored on
    /// its sender's `ctl` port so a tap linked there observes it.
    fn deliver_control(&mut self, now: Time) {
        for _ in 0..CONTROL_ROUNDS {
            if self.control.is_empty() {
                return;
            }
            let frames = std::mem::take(&mut self.control);
            for cf in frames {
                if let Some(&s) = self.index.get(&cf.sender) {
                    let ctl = self.slots[s].out.len() - 1;
                    if !self.slots[s].routes[ctl].is_empty() {
                        self.slots[s].out[ctl].push(Frame::Control(cf.clone()));
                        self.route(s);
                    }
                }
                self.dispatch_control(cf, now);
            }
        }
    }

    fn dispatch_control(&mut self, cf: Box<ControlFrame>, now: Time) {
        if cf.op == ControlOp::Alert {
            let targets: Vec<String> = self
                .listeners
                .iter()
                .filter(|(src, ev, _)| *src == cf.sender && *ev == cf.param)
                .map(|(_, _, l)| l.clone())
                .collect();
            for t in targets {
                let mut copy = (*cf).clone();
                copy.dest = t;
                self.deliver_to_module(Box::new(copy), now);
            }
            return;
        }
        if cf.dest == CONTROL_PLANE {
            self.control_inbox.push(*cf);
            return;
        }
        let Some(&d) = self.index.get(&cf.dest) else {
            // Only requests are answered with an error; a reply, alert or error addressed to nobody is dropped, or
            // two unknown names would bounce errors between them forever.
            if matches!(
                cf.op,
                ControlOp::ReadParam | ControlOp::SetParam | ControlOp::Exec | ControlOp::Listen | ControlOp::Unlisten
            ) {
                let err = cf.reply(ControlOp::Error, Value::Str(format!("no module named {}", cf.dest)));
                self.control.push(Box::new(err));
            }
            return;
        };
        let reply = match cf.op {
            ControlOp::ReadParam => Some(match self.read_var(&self.slots[d].name.clone(), &cf.param) {
                Some(v) => cf.reply(ControlOp::ReadParamReply, v),
                None => {
                    cf.reply(ControlOp::Error, Value::Str(format!("module {} has no variable {}", cf.dest, cf.param)))
                }
            }),
            ControlOp::SetParam => Some(match self.write_knob(&cf.dest.clone(), &cf.param, &cf.value) {
                Ok(()) => cf.reply(ControlOp::SetParamReply, Value::Bool(true)),
                Err(e) => cf.reply(ControlOp::Error, Value::Str(e)),
            }),
            ControlOp::Listen => {
                self.listeners.insert((cf.dest.clone(), cf.param.clone(), cf.sender.clone()));
                None
            }
            ControlOp::Unlisten => {
                self.listeners.remove(&(cf.dest.clone(), cf.param.clone(), cf.sender.clone()));
                None
            }
            ControlOp::Exec => {
                let result = self.with_module(d, now, |m, out| m.execute(&cf.param, &cf.value, out));
                Some(match result {
                    Ok(v) => cf.reply(ControlOp::ExecReply, v),
                    Err(e) => cf.reply(ControlOp::Error, Value::Str(e)),
                })
            }
            _ => {
                self.deliver_to_module(cf, now);
                None
            }
        };
        if let Some(r) = reply {
            self.control.push(Box::new(r));
        }
    }

    fn deliver_to_module(&mut self, cf: Box<ControlFrame>, now: Time) {
        if cf.dest == CONTROL_PLANE {
            self.control_inbox.push(*cf);
            return;
        }
        let Some(&d) = self.index.get(&cf.dest) else {
            return;
        };
        self.with_module(d, now, |m, out| m.handle_control(cf, out));
    }

    /// Module `i` and an [`Output`] for it: they borrow disjoint parts of the switch.
    fn module_and_output(&mut self, i: usize, now: Time) -> (&mut dyn Module, Output<'_>) {
        let slot = &mut self.slots[i];
        let out = Output {
            now,
            module: &slot.name,
            pool: &self.pool,
            ports: &mut slot.out,
            dropped: 0,
            control: &mut self.control,
            next_serial: &mut self.next_serial,
            wake: None,
            dynamic: Some(&mut self.dynamic),
            worker: self.worker,
            notify: self.wakeups.as_ref().map(|w| (&slot.marked, w)),
        };
        (slot.module.as_mut(), out)
    }

    /// Calls `f` with module `i` and an [`Output`] for it, outside of `process` and `poll`; then counts its drops,
    /// keeps the wakeup it asked for and routes what it emitted.
    fn with_module<R>(&mut self, i: usize, now: Time, f: impl FnOnce(&mut dyn Module, &mut Output<'_>) -> R) -> R {
        let (module, mut out) = self.module_and_output(i, now);
        let result = f(module, &mut out);
        let (dropped, wake) = (out.dropped, out.wake);
        if let Some(w) = wake {
            let t = self.slots[i].wake_at.map_or(w, |t| t.min(w));
            self.set_wake(i, Some(t));
        }
        self.note_called(i);
        let routed = self.route(i);
        self.slots[i].meters.dropped.add_u64(dropped + routed);
        result
    }

    fn read_var(&self, module: &str, var: &str) -> Option<Value> {
        let &i = self.index.get(module)?;
        let s = &self.slots[i];
        s.vars.cell(var).or_else(|| s.meters.cells().find(|c| c.spec().name == var)).map(|c| c.get())
    }

    /// The running stack as a description: modules with their settings (knobs at their current values) and links.
    pub fn describe(&self) -> StackSpec {
        let modules = self
            .slots
            .iter()
            .map(|s| {
                let mut settings = s.settings.clone();
                for c in s.vars.cells().iter().filter(|c| c.spec().kind == VarKind::Knob) {
                    // A knob's old name is written as its new one (which holds the same value).
                    match c.spec().alias_of {
                        Some(_) => settings.remove(&c.spec().name),
                        None => settings.insert(&c.spec().name, c.get().to_toml()),
                    }
                }
                ModuleSpec { name: s.name.clone(), kind: s.kind.clone(), settings, location: None }
            })
            .collect();
        let mut links: Vec<LinkEntry> = Vec::new();
        for e in &self.edges {
            let from = self.endpoint(&e.from, &e.from_port, true);
            let to = self.endpoint(&e.to, &e.to_port, false);
            match links.iter_mut().find(|l| l.link.from == from) {
                Some(l) => l.link.to.push(to),
                None => links.push(LinkEntry { link: LinkSpec { from, to: vec![to] }, location: None }),
            }
        }
        StackSpec { modules, links }
    }

    /// An endpoint as the user would write it: the port is left out where it is the module's only one.
    fn endpoint(&self, module: &str, port: &str, output: bool) -> Endpoint {
        let only = self.index.get(module).is_some_and(|&i| {
            let ports = if output { &self.slots[i].iface.outputs } else { &self.slots[i].iface.inputs };
            ports.iter().filter(|p| p.name != CONTROL_PORT || !output).count() == 1 && port != CONTROL_PORT
        });
        Endpoint { module: module.to_string(), port: if only { None } else { Some(port.to_string()) } }
    }

    /// Facts about each module for `module list`.
    pub fn module_infos(&self) -> Vec<ModuleInfo> {
        self.slots
            .iter()
            .map(|s| ModuleInfo {
                name: s.name.clone(),
                kind: s.kind.clone(),
                state: if self.paused || s.paused { "paused" } else { "running" }.to_string(),
                inputs: s.iface.inputs.iter().map(|p| (p.name.clone(), p.ty.to_string())).collect(),
                outputs: s.iface.outputs.iter().map(|p| (p.name.clone(), p.ty.to_string())).collect(),
            })
            .collect()
    }
}

/// A module's name, kind, state and ports, for listings.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModuleInfo {
    /// Name.
    pub name: String,
    /// Kind.
    pub kind: String,
    /// `running` or `paused`.
    pub state: String,
    /// Input ports (name, type).
    pub inputs: Vec<(String, String)>,
    /// Output ports (name, type), the implicit `ctl` last.
    pub outputs: Vec<(String, String)>,
}

/// Resolves an endpoint's port against an interface: the named port, or the only one.
fn resolve_port(ep: &Endpoint, iface: &ModuleInterface, output: bool) -> Result<String, String> {
    let ports: Vec<&PortSpec> = if output { iface.outputs.iter().collect() } else { iface.inputs.iter().collect() };
    let dir = if output { "output" } else { "input" };
    match &ep.port {
        Some(p) => ports.iter().find(|x| x.name == *p).map(|x| x.name.clone()).ok_or_else(|| {
            format!("module {} has no {dir} port `{p}`; its {dir} ports are: {}", ep.module, list_ports(&ports))
        }),
        None => {
            let data: Vec<&&PortSpec> = ports.iter().filter(|x| !(output && x.name == CONTROL_PORT)).collect();
            match data.as_slice() {
                [only] => Ok(only.name.clone()),
                [] => Err(format!("module {} has no {dir} port", ep.module)),
                _ => Err(format!(
                    "module {} has several {dir} ports ({}); name one, e.g. {}[{}]",
                    ep.module,
                    list_ports(&ports),
                    ep.module,
                    data[0].name
                )),
            }
        }
    }
}

fn list_ports(ports: &[&PortSpec]) -> String {
    ports.iter().map(|p| format!("{} ({})", p.name, p.ty)).collect::<Vec<_>>().join(", ")
}

/// A model of the stack's shape on which edits are checked before anything is changed.
/// Declared (input, output) paths of a module; `None`: every input reaches every output.
type Paths = Option<Vec<(String, String)>>;

struct Model {
    modules: HashMap<String, ModuleInterface>,
    paths: HashMap<String, Paths>,
    edges: Vec<Edge>,
}

impl Model {
    fn of(s: &Switch) -> Model {
        Model {
            modules: s.slots.iter().map(|x| (x.name.clone(), x.iface.clone())).collect(),
            paths: s.slots.iter().map(|x| (x.name.clone(), x.paths.clone())).collect(),
            edges: s.edges.clone(),
        }
    }

    fn iface(&self, name: &str) -> Result<&ModuleInterface, String> {
        self.modules.get(name).ok_or_else(|| {
            let mut known: Vec<&str> = self.modules.keys().map(String::as_str).collect();
            known.sort_unstable();
            format!(
                "no module named `{name}` (modules: {})",
                if known.is_empty() { "none".into() } else { known.join(", ") }
            )
        })
    }

    fn resolve(&self, spec: &LinkSpec) -> Result<Vec<Edge>, String> {
        let from_iface = self.iface(&spec.from.module)?;
        let from_port = resolve_port(&spec.from, from_iface, true)?;
        let from_ty = from_iface.outputs.iter().find(|p| p.name == from_port).map_or(port_type::ANY, |p| p.ty);
        spec.to
            .iter()
            .map(|to| {
                let to_iface = self.iface(&to.module)?;
                let to_port = resolve_port(to, to_iface, false)?;
                let to_ty = to_iface.inputs.iter().find(|p| p.name == to_port).map_or(port_type::ANY, |p| p.ty);
                if !PortSpec::compatible(from_ty, to_ty) {
                    return Err(format!(
                        "type mismatch: {}[{from_port}] carries {from_ty} frames but {}[{to_port}] takes {to_ty}",
                        spec.from.module, to.module
                    ));
                }
                Ok(Edge {
                    from: spec.from.module.clone(),
                    from_port: from_port.clone(),
                    to: to.module.clone(),
                    to_port,
                })
            })
            .collect()
    }

    fn check_interface(name: &str, iface: &ModuleInterface) -> Result<(), String> {
        if !valid_name(name) {
            return Err(format!("invalid module name {name:?}: expected lowercase letters, digits, '_' or '-'"));
        }
        for (dir, ports) in [("input", &iface.inputs), ("output", &iface.outputs)] {
            let mut seen = BTreeSet::new();
            for p in ports.iter() {
                if !seen.insert(&p.name) {
                    return Err(format!("module {name} declares {dir} port `{}` twice", p.name));
                }
            }
        }
        let mut seen = BTreeSet::new();
        for v in &iface.vars {
            if STD_VARS.contains(&v.name.as_str()) || v.name.starts_with("port.") || !seen.insert(&v.name) {
                return Err(format!(
                    "module {name} declares variable `{}` twice or under a name the switch keeps",
                    v.name
                ));
            }
        }
        Ok(())
    }

    fn check(&mut self, edit: &Edit, new: Option<&(ModuleInterface, Paths)>) -> Result<(), String> {
        let new_iface = new.map(|(i, _)| i);
        if let (Edit::Load { name, .. } | Edit::Replace { name, .. }, Some((_, paths))) = (edit, new) {
            self.paths.insert(name.clone(), paths.clone());
        }
        match edit {
            Edit::Load { name, .. } => {
                if self.modules.contains_key(name) {
                    return Err(format!("a module named `{name}` is already loaded"));
                }
                let iface = new_iface.cloned().unwrap_or_default();
                Self::check_interface(name, &iface)?;
                self.modules.insert(name.clone(), iface);
            }
            Edit::Unload { name } => {
                self.iface(name)?;
                self.modules.remove(name);
                self.edges.retain(|e| e.from != *name && e.to != *name);
            }
            Edit::Replace { name, .. } => {
                self.iface(name)?;
                let iface = new_iface.cloned().unwrap_or_default();
                Self::check_interface(name, &iface)?;
                for e in self.edges.iter().filter(|e| e.from == *name || e.to == *name) {
                    let (ports, port, dir) = if e.from == *name {
                        (&iface.outputs, &e.from_port, "output")
                    } else {
                        (&iface.inputs, &e.to_port, "input")
                    };
                    let Some(p) = ports.iter().find(|p| p.name == *port) else {
                        return Err(format!(
                            "the new {name} has no {dir} port `{port}`, which link {e} uses; remove the link first"
                        ));
                    };
                    let other_ty = if e.from == *name {
                        self.modules
                            .get(&e.to)
                            .and_then(|m| m.inputs.iter().find(|x| x.name == e.to_port))
                            .map_or(port_type::ANY, |x| x.ty)
                    } else {
                        self.modules
                            .get(&e.from)
                            .and_then(|m| m.outputs.iter().find(|x| x.name == e.from_port))
                            .map_or(port_type::ANY, |x| x.ty)
                    };
                    if !PortSpec::compatible(p.ty, other_ty) {
                        return Err(format!("type mismatch: the new {name}'s {dir} port `{port}` carries {} frames, link {e} needs {other_ty}", p.ty));
                    }
                }
                self.modules.insert(name.clone(), iface);
            }
            Edit::Link(spec) => {
                for e in self.resolve(spec)? {
                    if self.edges.contains(&e) {
                        return Err(format!("link {e} already exists"));
                    }
                    self.edges.push(e);
                }
            }
            Edit::Unlink(spec) => {
                for e in self.resolve(spec)? {
                    let Some(pos) = self.edges.iter().position(|x| *x == e) else {
                        return Err(format!("there is no link {e}"));
                    };
                    self.edges.remove(pos);
                }
            }
            Edit::SetKnob { module, knob, value } => {
                let iface = self.iface(module)?;
                let spec = iface.vars.iter().find(|v| v.name == *knob).ok_or_else(|| {
                    let knobs: Vec<&str> =
                        iface.vars.iter().filter(|v| v.kind == VarKind::Knob).map(|v| v.name.as_str()).collect();
                    format!(
                        "module {module} has no knob `{knob}` (knobs: {})",
                        if knobs.is_empty() { "none".into() } else { knobs.join(", ") }
                    )
                })?;
                spec.validate(value).map_err(|e| format!("module.{module}.{knob}: {e}"))?;
            }
            // Runtime variables are not in the model: checked by the switch itself (Switch::check_runtime_knob).
            Edit::SetVar { .. } => {}
            Edit::Pause { module: Some(m) } | Edit::Resume { module: Some(m) } => {
                self.iface(m)?;
            }
            Edit::Pause { module: None } | Edit::Resume { module: None } => {}
        }
        Ok(())
    }

    /// Rejects a loop of links that a frame could go round within one run: one through no cycle-breaking module,
    /// following each module's declared paths from input to output (all of them where none are declared).
    fn check_cycles(&self) -> Result<(), String> {
        // Nodes are (module, input port); a frame at one may next be at the inputs linked to the outputs it can
        // reach. Cycle-breaking modules emit only later, so nothing leads on from their inputs.
        let nodes: Vec<(&str, &str)> = self
            .modules
            .iter()
            .flat_map(|(m, iface)| iface.inputs.iter().map(move |p| (m.as_str(), p.name.as_str())))
            .collect();
        let index: HashMap<(&str, &str), usize> = nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
        let reaches = |m: &str, input: &str, output: &str| match self.paths.get(m).and_then(|p| p.as_ref()) {
            Some(paths) => output == CONTROL_PORT || paths.iter().any(|(i, o)| i == input && o == output),
            None => true,
        };
        let mut next: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
        for (n, (m, input)) in nodes.iter().enumerate() {
            if self.modules.get(*m).is_some_and(|i| i.breaks_cycles) {
                continue;
            }
            for e in self.edges.iter().filter(|e| e.from == *m && reaches(m, input, &e.from_port)) {
                if let Some(&t) = index.get(&(e.to.as_str(), e.to_port.as_str())) {
                    next[n].push(t);
                }
            }
        }
        let mut indegree = vec![0usize; nodes.len()];
        for t in next.iter().flatten() {
            indegree[*t] += 1;
        }
        let mut ready: Vec<usize> = (0..nodes.len()).filter(|&n| indegree[n] == 0).collect();
        let mut done = 0;
        while let Some(n) = ready.pop() {
            done += 1;
            for &t in &next[n] {
                indegree[t] -= 1;
                if indegree[t] == 0 {
                    ready.push(t);
                }
            }
        }
        if done == nodes.len() {
            return Ok(());
        }
        let mut stuck: Vec<&str> = (0..nodes.len()).filter(|&n| indegree[n] > 0).map(|n| nodes[n].0).collect();
        stuck.sort_unstable();
        stuck.dedup();
        Err(format!("the links would form a cycle through {} with no queueing module to break it", stuck.join(", ")))
    }
}

mod gso;
pub use gso::{fold64, ones_complement_sum, segment_batch, segment_packet, Segmented};

#[cfg(test)]
mod tests;
