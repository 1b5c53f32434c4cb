//! The module API: what a module kind declares, and the calls the switch makes on a module.
//!
//! A module comes to life in three steps:
//! 1. [`ModuleKind::configure`] (control plane) reads the module's [`Settings`] and returns a [`ModuleBuilder`],
//!    or a [`ConfigError`] that says where and what was expected. It may open files the module will use.
//! 2. The builder's [`ModuleBuilder::interface`] declares the ports and the meters and knobs; the switch validates
//!    links against it and allocates the variables' cells.
//! 3. [`ModuleBuilder::build`] (data plane, between batches) creates the [`Module`], handing it its variables.
//!
//! Then the switch calls, always on the data-plane thread and always with `now` passed in:
//! [`Module::process`] for each batch arriving on an input port, [`Module::poll`] when the time it asked for has
//! come, [`Module::write_knob`] between batches, [`Module::handle_control`] for control frames addressed to it, and
//! [`Module::take_state`] / [`Module::adopt_state`] when it is replaced. A module never reads a clock, never touches a
//! socket and never blocks; it emits frames on its output ports through [`Output`] and the switch routes them.

use crate::config::{ConfigError, Settings};
use crate::deprecation::Deprecations;
use crate::frame::{Batch, ControlFrame, ControlOp, Frame, PacketPool};
use crate::notify::{Notifier, Wakeups};
use crate::reference::{KindReference, MeterDoc, PortDoc, SettingDoc};
use crate::time::Time;
use crate::value::Value;
use crate::vars::{DynamicVars, ModuleVars, VarBlock, VarKind, VarSpec, VarSpecs};
use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// Frame type carried by a port; links must join ports of compatible types.
pub mod port_type {
    /// Accepts or carries any frame.
    pub const ANY: &str = "any";
    /// Raw IP packets (IPv4 or IPv6, no link header).
    pub const IP: &str = "ip";
    /// Ethernet frames.
    pub const ETHERNET: &str = "ethernet";
    /// Control frames only (the implicit `ctl` output port of every module).
    pub const CONTROL: &str = "control";
    /// Stream frames: a flow's events and ordered bytes between the endpoints that terminate and originate it
    /// ([`crate::stream`]).
    pub const STREAM: &str = "stream";
}

/// Name of the implicit output port on which every module's sent control frames are mirrored.
pub const CONTROL_PORT: &str = "ctl";

/// A port declaration: name and the type of frames it carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortSpec {
    /// Port name, unique among the module's inputs (or outputs).
    pub name: String,
    /// Frame type ([`port_type`]).
    pub ty: &'static str,
}

impl PortSpec {
    /// A port named `name` carrying `ty` frames.
    pub fn new(name: impl Into<String>, ty: &'static str) -> PortSpec {
        PortSpec { name: name.into(), ty }
    }

    /// True if frames from an output of type `from` may enter an input of type `to`.
    pub fn compatible(from: &str, to: &str) -> bool {
        from == to || from == port_type::ANY || to == port_type::ANY
    }
}

/// Everything a module declares about itself.
#[derive(Clone, Debug, Default)]
pub struct ModuleInterface {
    /// Input ports, in order (port index = position).
    pub inputs: Vec<PortSpec>,
    /// Output ports, in order (port index = position).
    pub outputs: Vec<PortSpec>,
    /// Meters and knobs.
    pub vars: Vec<VarSpec>,
    /// True if the module holds frames and emits them only on a later poll, so a cycle through it cannot loop
    /// within one batch; cycles through no such module are rejected.
    pub breaks_cycles: bool,
    /// True if the module takes GSO super-packets whole ([`crate::frame::MetaKey::GSO`]: the headers of the first
    /// segment and the payload of all). The switch cuts a super-packet into its segments before a module that does
    /// not ([`crate::switch`], "GSO super-packets").
    pub accepts_gso: bool,
}

/// A kind of module that the catalog can create.
pub trait ModuleKind: Send + Sync {
    /// The kind's name as written in stack files (`counter`).
    fn name(&self) -> &'static str;

    /// One-line description.
    fn summary(&self) -> &'static str;

    /// Reads and checks the settings (each knob may also be given as a setting of the same name).
    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError>;

    /// What the kind offers (ports, settings, knobs, meters) for the module reference, without configuring a
    /// module. A kind with a [`crate::decl::KindDecl`] returns its `reference()`; the default describes the
    /// interface of a module configured with no settings (knobs with the values it starts with), which leaves out
    /// the settings that are not knobs, or only notes what it needs if that fails.
    fn reference(&self) -> KindReference {
        configured_reference(self)
    }

    /// True if every module of the kind needs a global view of the traffic (see
    /// [`ModuleBuilder::global_view`]): a kind with a [`crate::decl::KindDecl`] returns its `global_view`.
    fn global_view(&self) -> bool {
        false
    }
}

/// A configured module, ready to be built on the data-plane thread.
pub trait ModuleBuilder: Send {
    /// Ports and variables of the module this builder will build.
    fn interface(&self) -> ModuleInterface;

    /// Which outputs each input can lead to, as (input, output) port names; `None` (the default) means every input
    /// can reach every output. A module that carries traffic both ways (NAT, a link layer) declares its paths so
    /// that it may sit in a loop of links that no frame can go round (see [`crate::switch`]'s cycle check).
    fn paths(&self) -> Option<Vec<(String, String)>> {
        None
    }

    /// Builds the module; `vars` holds the cells of the variables declared by [`ModuleBuilder::interface`]. A knob
    /// given as a setting of the same name already holds that value; the module stores the initial value of any
    /// other knob itself, so that the stack's description shows what it runs with.
    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module>;

    /// Hands over where old names are reported (the catalog's, after `configure`): a module with a knob kept under
    /// an old name ([`VarSpec::alias_of`]) reports a write by that name there. The default ignores it.
    fn deprecations(&mut self, deprecations: &Deprecations) {
        let _ = deprecations;
    }

    /// True if the module needs a global view of the traffic (a shared queue model, a scheduler across flows, a
    /// file it writes, frames it makes itself): a stack with one runs its data plane on one worker. Most kinds
    /// declare it for all their modules ([`ModuleKind::global_view`], from
    /// [`crate::decl::KindDecl::global_view`]); a builder answers here when its settings decide.
    fn global_view(&self) -> bool {
        false
    }

    /// A builder of the same module for data-plane worker `worker` (1..), which runs a switch of its own: `None`
    /// (the default) when configuring the kind again from the same settings makes one; a face opens another queue
    /// of its device here; `Some(Err(why))` when the module cannot run on several workers (the stack then runs on
    /// one).
    fn replica(&self, worker: usize) -> Option<Result<Box<dyn ModuleBuilder>, String>> {
        let _ = worker;
        None
    }
}

/// A running module: a sans-IO state machine driven by the switch.
pub trait Module {
    /// Handles the frames in `input` that arrived on input port `port` (its index in the interface). The module
    /// takes what it wants out of `input` (e.g. `input.drain(..)`) and emits on `out`; frames left in `input`
    /// when it returns are dropped and counted as dropped by this module.
    fn process(&mut self, port: usize, input: &mut Batch, out: &mut Output<'_>);

    /// Called when the time the module last asked for has come (and once after it is loaded). Returns when to be
    /// polled next, or `None`.
    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        let _ = out;
        None
    }

    /// Applies a knob write. The value has already been checked against the knob's type and range. The switch
    /// polls the module at its next run after a successful write, so it can act on the new value there.
    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        let _ = value;
        Err(format!("knob {knob} cannot be written"))
    }

    /// Runs procedure `procedure` with `argument` (control frame `Exec`).
    fn execute(&mut self, procedure: &str, argument: &Value, out: &mut Output<'_>) -> Result<Value, String> {
        let _ = (argument, out);
        Err(format!("no procedure named {procedure}"))
    }

    /// Handles a control frame addressed to this module that the switch does not answer itself: replies,
    /// alerts and errors coming back from other modules.
    fn handle_control(&mut self, frame: Box<ControlFrame>, out: &mut Output<'_>) {
        let _ = (frame, out);
    }

    /// The link of face module `face` (its name in the stack) went up or down, as the data plane saw it in the
    /// kernel's link events (up: the interface is up and has carrier). Every module is told, the face included;
    /// one that acts on it returns true and is polled at the next run, as after a knob write.
    fn link_changed(&mut self, face: &str, up: bool) -> bool {
        let _ = (face, up);
        false
    }

    /// For a face module: the device the data plane reads and writes on the module's behalf. Frames read from it
    /// leave the module on output port 0; frames the module queues for it are taken with [`Module::take_egress`].
    fn device(&self) -> Option<Arc<dyn FaceDevice>> {
        None
    }

    /// For a face module: moves the frames waiting to be written to its device into `into`.
    fn take_egress(&mut self, into: &mut Batch) {
        let _ = into;
    }

    /// Hands the module's state to its replacement (`module replace`); `None` if it has none to give.
    fn take_state(&mut self) -> Option<Box<dyn Any>> {
        None
    }

    /// Takes over the state of the module this one replaces; an error leaves the new module as built.
    fn adopt_state(&mut self, state: Box<dyn Any>) -> Result<(), String> {
        let _ = state;
        Err("this module kind does not take over state".into())
    }
}

/// The state a module of the same kind handed over ([`Module::take_state`]), as the `T` it is; when it is something
/// else, the error says it is not `what` (`"a counter's state"`).
pub fn handed_over<T: Any>(state: Box<dyn Any>, what: &str) -> Result<T, String> {
    state.downcast::<T>().map(|s| *s).map_err(|_| format!("not {what}"))
}

/// An I/O device a face module stands for (a TUN device, a raw socket on an interface ...). Implemented at the
/// edge (the daemon); the core and the modules never call it — the data plane does, outside the switch.
pub trait FaceDevice: Send + Sync {
    /// The device's name (an interface name).
    fn name(&self) -> &str;
    /// The file descriptor the data plane waits on for readability.
    fn fd(&self) -> std::os::fd::BorrowedFd<'_>;
    /// The direction of the frames read from the device (down: from applications; up: from the network).
    fn direction(&self) -> crate::frame::Direction {
        crate::frame::Direction::Down
    }
    /// The kernel's index of the interface the device is, when the data plane should watch its link (carrier
    /// and up/down) and tell the modules ([`Module::link_changed`]); `None`: not watched.
    fn ifindex(&self) -> Option<u32> {
        None
    }
    /// True if its frames start with an Ethernet header (a link face), false for raw IP packets.
    fn ethernet(&self) -> bool {
        false
    }
    /// Counts, on the face's meters, frames read here whose flow another data-plane worker owns: `sent` handed
    /// to it, `dropped` lost because the ring to it was full. The default counts nothing.
    fn count_handoff(&self, sent: u64, dropped: u64) {
        let _ = (sent, dropped);
    }
    /// Reads what the kernel dropped in the device's own queues since the last call and counts it on the face's
    /// meters (`drop_kernel_queue_total`); the data plane calls it about once a second. The default counts
    /// nothing.
    fn refresh_kernel_drops(&self) {}
    /// Reads one packet into `buf` (cleared first) without blocking; `Ok(false)` when none is waiting.
    fn read_packet(&self, buf: &mut Vec<u8>) -> std::io::Result<bool>;
    /// Writes one packet.
    fn write_packet(&self, packet: &[u8]) -> std::io::Result<()>;
    /// Writes several packets, in order (a device may coalesce them, e.g. into GSO writes). The default writes
    /// them one by one; every packet is attempted, and the last error, if any, is returned.
    fn write_batch(&self, packets: &[&[u8]]) -> std::io::Result<()> {
        let mut result = Ok(());
        for p in packets {
            if let Err(e) = self.write_packet(p) {
                result = Err(e);
            }
        }
        result
    }
    /// Reads one packet into `buf` and what the device tells about it into `meta` (cleared first; e.g.
    /// [`crate::frame::MetaKey::GSO`]). The default reads with [`FaceDevice::read_packet`] and sets nothing.
    fn read_frame(&self, buf: &mut Vec<u8>, meta: &mut crate::frame::Metadata) -> std::io::Result<bool> {
        *meta = crate::frame::Metadata::default();
        self.read_packet(buf)
    }
    /// Reads one frame as [`FaceDevice::read_frame`] does, into `buf` from the front, but a device that can leaves
    /// `headroom` bytes free before the frame (stale bytes, not part of it), so that a module can put a header in
    /// front without moving it ([`crate::frame::Packet::prepend`]). Returns where the frame starts in `buf`
    /// (`None` when none is waiting): the default reads with [`FaceDevice::read_frame`] and leaves none.
    fn read_frame_at(
        &self,
        buf: &mut Vec<u8>,
        headroom: usize,
        meta: &mut crate::frame::Metadata,
    ) -> std::io::Result<Option<usize>> {
        let _ = headroom;
        Ok(self.read_frame(buf, meta)?.then_some(0))
    }
    /// Writes several packets, in order, with their metadata (a device that understands
    /// [`crate::frame::MetaKey::GSO`] hands super-frames to the kernel for segmentation). The default writes their
    /// bytes with [`FaceDevice::write_batch`].
    fn write_frames(&self, packets: &[&crate::frame::Packet]) -> std::io::Result<()> {
        let bytes: Vec<&[u8]> = packets.iter().map(|p| p.data()).collect();
        self.write_batch(&bytes)
    }
}

/// What a module emits during one call: frames on output ports, drops, control frames.
pub struct Output<'a> {
    pub(crate) now: Time,
    pub(crate) module: &'a str,
    pub(crate) pool: &'a PacketPool,
    pub(crate) ports: &'a mut [Batch],
    pub(crate) dropped: u64,
    // Boxed: a control frame travels as `Frame::Control(Box<_>)`, so queueing and delivery move one pointer.
    #[allow(clippy::vec_box)]
    pub(crate) control: &'a mut Vec<Box<ControlFrame>>,
    pub(crate) next_serial: &'a mut u32,
    pub(crate) wake: Option<Time>,
    pub(crate) dynamic: Option<&'a mut DynamicVars>,
    /// The data-plane worker running the switch, and how many there are.
    pub(crate) worker: (u32, u32),
    /// The module's mark and its switch's wake-up ([`Output::notifier`]), if the switch has a way to be woken.
    pub(crate) notify: Option<(&'a Arc<AtomicBool>, &'a Arc<Wakeups>)>,
}

impl<'a> Output<'a> {
    /// An output for use outside a switch (module unit tests): frames land in `ports`, control frames in `control`.
    pub fn detached(
        now: Time,
        module: &'a str,
        pool: &'a PacketPool,
        ports: &'a mut [Batch],
        control: &'a mut Vec<Box<ControlFrame>>,
        next_serial: &'a mut u32,
    ) -> Output<'a> {
        Output {
            now,
            module,
            pool,
            ports,
            dropped: 0,
            control,
            next_serial,
            wake: None,
            dynamic: None,
            worker: (0, 1),
            notify: None,
        }
    }

    /// The current time.
    #[inline]
    pub fn now(&self) -> Time {
        self.now
    }

    /// The data-plane worker this module runs on (0..[`Output::workers`]): each runs a switch of its own, and a
    /// flow's frames always meet on one (docs/architecture.md, "Workers").
    #[inline]
    pub fn worker(&self) -> u32 {
        self.worker.0
    }

    /// How many data-plane workers run the stack (1 unless the daemon runs several and the stack allows it).
    #[inline]
    pub fn workers(&self) -> u32 {
        self.worker.1
    }

    /// The pool to allocate new packets from.
    #[inline]
    pub fn pool(&self) -> &PacketPool {
        self.pool
    }

    /// Emits `frame` on output port `port`.
    ///
    /// # Panics
    /// If `port` is not one of the module's declared output ports (a bug in the module).
    #[inline]
    pub fn emit(&mut self, port: usize, frame: impl Into<Frame>) {
        self.ports[port].push(frame.into());
    }

    /// Emits all frames of `batch` on output port `port`, leaving `batch` empty (moves the vector when it can).
    #[inline]
    pub fn emit_all(&mut self, port: usize, batch: &mut Batch) {
        let dest = &mut self.ports[port];
        if dest.is_empty() {
            std::mem::swap(dest, batch);
        } else {
            dest.append(batch);
        }
    }

    /// Drops `frame` and counts it in the module's `frames_dropped_total` (modules count the reason themselves).
    #[inline]
    pub fn drop_frame(&mut self, frame: Frame) {
        self.dropped += 1;
        drop(frame);
    }

    /// Asks to be polled at `time` (or earlier, if the module asked for an earlier time already): lets `process`,
    /// `execute` and `handle_control` arm a timer, as `poll`'s return value does.
    #[inline]
    pub fn wake_at(&mut self, time: Time) {
        self.wake = Some(self.wake.map_or(time, |t| t.min(time)));
    }

    /// The wakeup asked for in this call, if any.
    pub fn requested_wakeup(&self) -> Option<Time> {
        self.wake
    }

    /// A [`Notifier`] that has this module polled at once, from any thread (work it runs off the data plane is
    /// done), instead of a timer's poll: `None` where nothing would wake the thread running the switch (a switch
    /// without [`crate::Switch::set_waker`], a detached output): poll on a timer there.
    pub fn notifier(&self) -> Option<Notifier> {
        self.notify.map(|(marked, wakeups)| Notifier::new(marked, wakeups))
    }

    /// Registers variables under `prefix` (`flow.17`, `iface.eth0`, `app.voip`) while the module runs, e.g. per-flow
    /// meters. They are readable by name like declared ones, belong to this module, and go away with
    /// [`Output::unregister_vars`] or when the module is unloaded. Not for every packet: it takes a lock.
    /// (A detached output, in module unit tests, returns the cells without publishing them.) Pass the same
    /// [`VarSpecs`] for every flow: the cells then share its declarations.
    pub fn register_vars(&mut self, prefix: &str, specs: impl Into<VarSpecs>) -> Result<ModuleVars, String> {
        match self.dynamic.as_deref_mut() {
            Some(d) => d.register(self.module, prefix, specs),
            None => Ok(ModuleVars::shared(&specs.into())),
        }
    }

    /// Registers runtime variables under `prefix` as [`Output::register_vars`] does, kept in one [`VarBlock`] (a
    /// flow's meters: a fraction of the memory of a cell each). Without a registry, the block is published nowhere.
    pub fn register_block(&mut self, prefix: &str, specs: &VarSpecs) -> Result<VarBlock, String> {
        match self.dynamic.as_deref_mut() {
            Some(d) => d.register_block(self.module, prefix, specs),
            None => Ok(VarBlock::new(specs)),
        }
    }

    /// Registers a block made in a [`BlockArena`](crate::vars::BlockArena) under `prefix`, as
    /// [`Output::register_block`] does. Without a registry, the block is published nowhere.
    pub fn register_existing_block(&mut self, prefix: &str, block: &VarBlock) -> Result<(), String> {
        match self.dynamic.as_deref_mut() {
            Some(d) => d.register_existing_block(self.module, prefix, block),
            None => Ok(()),
        }
    }

    /// Removes the variables this module registered under `prefix`; false if there were none.
    pub fn unregister_vars(&mut self, prefix: &str) -> bool {
        match self.dynamic.as_deref_mut() {
            Some(d) => d.unregister(self.module, prefix),
            None => false,
        }
    }

    /// Frames dropped so far in this call.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Sends a control frame with operation `op` to module `dest`; returns its serial number.
    pub fn send_control(&mut self, op: ControlOp, dest: &str, param: &str, value: Value) -> u32 {
        *self.next_serial = self.next_serial.wrapping_add(1);
        let serial = *self.next_serial;
        self.control.push(Box::new(ControlFrame {
            op,
            sender: self.module.to_string(),
            dest: dest.to_string(),
            serial,
            param: param.to_string(),
            value,
        }));
        serial
    }

    /// Sends a prepared control frame (e.g. a reply made with [`ControlFrame::reply`]).
    pub fn send_control_frame(&mut self, frame: ControlFrame) {
        self.control.push(Box::new(frame));
    }

    /// Raises event `event` with `value`: every module that listens to this module's `event` gets an `Alert`.
    pub fn alert(&mut self, event: &str, value: Value) {
        self.send_control(ControlOp::Alert, "", event, value);
    }
}

/// The reference of a kind without declarations (see [`ModuleKind::reference`]).
fn configured_reference<K: ModuleKind + ?Sized>(kind: &K) -> KindReference {
    let mut r = KindReference {
        kind: kind.name().into(),
        summary: kind.summary().into(),
        inputs: Vec::new(),
        outputs: Vec::new(),
        settings: Vec::new(),
        meters: Vec::new(),
        breaks_cycles: false,
        accepts_gso: false,
        aliases: Vec::new(),
        note: None,
    };
    let builder = match kind.configure(&Settings::default()) {
        Ok(b) => b,
        Err(e) => {
            r.note = Some(format!(
                "Not declared yet, and it needs settings to be configured, so its ports, knobs and meters are not \
                 listed here: {}",
                e.message
            ));
            return r;
        }
    };
    let iface = builder.interface();
    let vars = ModuleVars::new(&iface.vars);
    drop(builder.build(&vars));
    let port = |p: &PortSpec| PortDoc { name: p.name.clone(), ty: p.ty.into(), description: String::new() };
    r.inputs = iface.inputs.iter().map(port).collect();
    r.outputs = iface.outputs.iter().map(port).collect();
    r.breaks_cycles = iface.breaks_cycles;
    r.accepts_gso = iface.accepts_gso;
    for c in vars.cells() {
        let s = c.spec();
        if s.kind == VarKind::Meter {
            r.meters.push(MeterDoc::from_spec(s));
            continue;
        }
        let default = match c.get() {
            Value::Str(t) => format!("{t:?}"),
            v => v.to_string(),
        };
        r.settings.push(SettingDoc {
            name: s.name.clone(),
            ty: s.ty.name().into(),
            unit: s.unit.clone(),
            default,
            range: s.range.map_or(String::new(), |(min, max)| format!("{min}..={max}")),
            knob: true,
            description: s.description.clone(),
        });
    }
    r.note = Some(
        "Not declared yet: described from a module configured with no settings; settings that are not knobs \
         are not listed."
            .into(),
    );
    r
}

/// The set of module kinds a switch can create, by name, and the old names of renamed kinds.
#[derive(Default)]
pub struct Catalog {
    kinds: BTreeMap<&'static str, Box<dyn ModuleKind>>,
    aliases: BTreeMap<&'static str, &'static str>,
    /// Where old names are reported, once each: of kinds, and of settings and knobs.
    deprecations: Deprecations,
}

impl Catalog {
    /// An empty catalog.
    pub fn new() -> Catalog {
        Catalog::default()
    }

    /// Adds a kind (replacing one of the same name).
    pub fn register(&mut self, kind: Box<dyn ModuleKind>) {
        self.kinds.insert(kind.name(), kind);
    }

    /// Lets `old`, the former name of kind `new`, still load kind `new` (stack files, lab files, requests).
    pub fn alias(&mut self, old: &'static str, new: &'static str) {
        self.aliases.insert(old, new);
    }

    /// The old names and the kinds they stand for, by old name.
    pub fn aliases(&self) -> impl Iterator<Item = (&'static str, &'static str)> + '_ {
        self.aliases.iter().map(|(old, new)| (*old, *new))
    }

    /// Calls `hook` with (old name, new name) the first time each old name is used: a renamed kind's (configured
    /// by it), a setting's (configured with it) or a knob's (written by it, in a module configured here). Core does
    /// not log: the daemon logs a deprecation warning from here.
    pub fn on_alias(&mut self, hook: impl Fn(&str, &str) + Send + Sync + 'static) {
        self.deprecations.set_hook(Box::new(hook));
    }

    /// The current name of kind `name`: itself if it is a kind, the new name if it is an old one.
    pub fn canonical(&self, name: &str) -> Option<&'static str> {
        match self.kinds.get_key_value(name) {
            Some((k, _)) => Some(*k),
            None => self.aliases.get(name).copied(),
        }
    }

    /// The kind named `name` (or formerly named `name`).
    pub fn get(&self, name: &str) -> Option<&dyn ModuleKind> {
        self.kinds.get(self.canonical(name)?).map(|k| k.as_ref())
    }

    /// All kinds, by name.
    pub fn kinds(&self) -> impl Iterator<Item = &dyn ModuleKind> {
        self.kinds.values().map(|k| k.as_ref())
    }

    /// The reference of every kind, by name, with its old names.
    pub fn reference(&self) -> Vec<KindReference> {
        self.kinds()
            .map(|k| {
                let mut r = k.reference();
                r.aliases = self.aliases().filter(|(_, new)| *new == k.name()).map(|(old, _)| old.into()).collect();
                r
            })
            .collect()
    }

    /// Configures a module of kind `kind` (a kind's name or an old one), with an error naming the known kinds if
    /// there is none.
    pub fn configure(
        &self,
        kind: &str,
        settings: &Settings,
        location: Option<crate::config::Location>,
    ) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let Some(k) = self.get(kind) else {
            let known: Vec<&str> = self.kinds.keys().copied().collect();
            let message = format!("unknown module kind `{kind}`; expected one of: {}", known.join(", "));
            return Err(ConfigError::new(location, message));
        };
        if let Some((&old, &new)) = self.aliases.get_key_value(kind) {
            self.deprecations.report(old, new);
        }
        // An error about no setting in particular (e.g. a required one missing) points at the module's table.
        let mut builder =
            k.configure(settings).map_err(|e| if e.location.is_none() { ConfigError { location, ..e } } else { e })?;
        for v in builder.interface().vars {
            if let Some(new) = v.alias_of.as_deref().filter(|_| settings.get(&v.name).is_some()) {
                self.deprecations.report(&v.name, new);
            }
        }
        builder.deprecations(&self.deprecations);
        Ok(builder)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const PLAIN: crate::KindDecl<(), ()> = crate::KindDecl::new("select", "a kind");
    struct Plain;
    impl ModuleKind for Plain {
        crate::kind_from_decl!(PLAIN);
        fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
            PLAIN.configure(settings, (), |(), (), _| Box::new(PlainModule))
        }
    }
    struct PlainModule;
    impl Module for PlainModule {
        fn process(&mut self, _: usize, _: &mut Batch, _: &mut Output<'_>) {}
    }

    /// A kind whose knob `mbit` was called `bps` (in bit/s).
    #[derive(Default)]
    struct Rate {
        bps: u64,
    }
    const RATED: crate::KindDecl<Rate, ()> = crate::KindDecl {
        params: &[
            crate::Param::<Rate>::f64(
                "mbit",
                "Mbit/s",
                "rate",
                0.0,
                (|r| r.bps as f64 / 1e6, |r, v| r.bps = (v * 1e6) as u64),
            ),
            crate::Param::<Rate>::u64("bps", "bit/s", "rate", 0, crate::field!(bps)).renamed_to("mbit"),
        ],
        ..crate::KindDecl::new("rated", "a kind with a renamed knob")
    };
    struct Rated;
    impl ModuleKind for Rated {
        crate::kind_from_decl!(RATED);
        fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
            RATED.configure(settings, Rate::default(), |_, (), _| Box::new(PlainModule))
        }
    }

    #[test]
    fn an_old_setting_name_is_reported_once_and_described_by_its_new_name() {
        let heard = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut c = Catalog::new();
        c.register(Box::new(Rated));
        let h = heard.clone();
        c.on_alias(move |old, new| h.lock().unwrap().push(format!("{old} -> {new}")));
        let spec = crate::StackSpec::parse("t.toml", "[modules.r]\nkind = \"rated\"\nbps = 5000000\n").unwrap();
        let settings = &spec.modules[0].settings;
        let builder = c.configure("rated", settings, None).unwrap();
        c.configure("rated", settings, None).unwrap();
        c.configure("rated", &Settings::default(), None).unwrap();
        assert_eq!(*heard.lock().unwrap(), ["bps -> mbit"]);

        let mut sw = crate::Switch::default();
        let load = crate::Edit::Load { name: "r".into(), kind: "rated".into(), settings: settings.clone(), builder };
        sw.apply(vec![load]).unwrap();
        let described = &sw.describe().modules[0].settings;
        assert!(described.get("bps").is_none(), "the old name is not written back");
        assert_eq!(described.get("mbit").map(|s| s.value.clone()), Some(toml::Value::Float(5.0)));
    }

    #[test]
    fn old_names_load_the_renamed_kind_and_are_reported_once() {
        let reported = Arc::new(AtomicUsize::new(0));
        let mut c = Catalog::new();
        c.register(Box::new(Plain));
        c.alias("switch", "select");
        let r = reported.clone();
        c.on_alias(move |old, new| {
            assert_eq!((old, new), ("switch", "select"));
            r.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(c.canonical("switch"), Some("select"));
        assert_eq!(c.canonical("select"), Some("select"));
        assert_eq!(c.get("switch").map(|k| k.name()), Some("select"));
        for _ in 0..3 {
            c.configure("switch", &Settings::default(), None).unwrap();
        }
        c.configure("select", &Settings::default(), None).unwrap();
        assert_eq!(reported.load(Ordering::Relaxed), 1);
        let e = c.configure("swtich", &Settings::default(), None).err().unwrap();
        assert_eq!(e.message, "unknown module kind `swtich`; expected one of: select");
        let names: Vec<&str> = c.kinds().map(|k| k.name()).collect();
        assert_eq!(names, ["select"], "old names are not kinds of their own");
        assert_eq!(c.reference()[0].aliases, ["switch"]);
    }
}
