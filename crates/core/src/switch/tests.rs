//! Unit tests of the switch: routing, copies, every edit kind, validation and atomicity, edits while frames flow,
//! control frames, stack descriptions and meters.
//!
//! The modules here are test-only and tiny. Builders must be `Send`, so what a module records is shared with the
//! test through `Arc<Mutex<..>>` logs (a [`Probe`]).

use super::*;
use crate::frame::MetaKey;
use crate::module::{Catalog, ModuleKind};
use crate::vars::Meter;
use std::any::Any;
use std::collections::VecDeque;
use std::sync::Mutex;

// ---------------------------------------------------------------------------------------------------------------
// Test modules
// ---------------------------------------------------------------------------------------------------------------

type Log<T> = Arc<Mutex<Vec<T>>>;

/// What a test module saw, shared with the test.
#[derive(Clone, Default)]
struct Probe {
    /// SEQ of every data frame received (checked against the first 8 bytes).
    seqs: Log<u64>,
    /// Control frames received, on the data path (a tap on a `ctl` port) or through `handle_control`.
    ctl: Log<ControlFrame>,
    /// Knob writes that reached `Module::write_knob`.
    knobs: Log<(String, Value)>,
    /// `Packet::is_shared` of every data frame received (recorded by the scribbler).
    shared: Log<bool>,
    /// First byte of every data frame received.
    first: Log<u8>,
    /// Link changes that reached `Module::link_changed`: (face, up).
    links: Log<(String, bool)>,
}

impl Probe {
    fn seqs(&self) -> Vec<u64> {
        self.seqs.lock().unwrap().clone()
    }
    fn ctl(&self) -> Vec<ControlFrame> {
        self.ctl.lock().unwrap().clone()
    }

    /// Records a data frame's sequence number (and first byte) or a control frame.
    fn record(&self, f: &Frame) {
        match f {
            Frame::Data(p) => {
                let seq = p.meta().get(MetaKey::SEQ).expect("test frames carry SEQ");
                let bytes: [u8; 8] = p.data()[..8].try_into().expect("test frames are >= 8 bytes");
                if p.data()[0] != 0xff {
                    assert_eq!(u64::from_le_bytes(bytes), seq, "bytes and metadata disagree");
                }
                self.seqs.lock().unwrap().push(seq);
                self.first.lock().unwrap().push(p.data()[0]);
            }
            Frame::Control(c) => self.ctl.lock().unwrap().push((**c).clone()),
        }
    }
}

/// A builder made of an interface and a closure.
type Make = Box<dyn FnOnce(&ModuleVars) -> Box<dyn Module> + Send>;

struct Built {
    iface: ModuleInterface,
    make: Make,
}

impl ModuleBuilder for Built {
    fn interface(&self) -> ModuleInterface {
        self.iface.clone()
    }
    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        (self.make)(vars)
    }
}

fn ports(list: &[(&str, &'static str)]) -> Vec<PortSpec> {
    list.iter().map(|(n, t)| PortSpec::new(*n, t)).collect()
}

fn built(
    inputs: &[(&str, &'static str)],
    outputs: &[(&str, &'static str)],
    vars: Vec<VarSpec>,
    make: impl FnOnce(&ModuleVars) -> Box<dyn Module> + Send + 'static,
) -> Box<dyn ModuleBuilder> {
    Box::new(Built {
        iface: ModuleInterface {
            inputs: ports(inputs),
            outputs: ports(outputs),
            vars,
            breaks_cycles: false,
            accepts_gso: false,
        },
        make: Box::new(make),
    })
}

/// Pass-through with state (frames seen), a knob `level` (0..=10; the module itself refuses 7), a meter
/// `seen_total`, and procedures for the control tests.
struct Pass {
    probe: Probe,
    seen: u64,
    seen_meter: Meter,
    adopts: bool,
}

impl Module for Pass {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        for f in input.iter() {
            self.probe.record(f);
        }
        self.seen += input.len() as u64;
        self.seen_meter.set(self.seen);
        out.emit_all(0, input);
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        if *value == Value::U64(7) {
            return Err("seven is refused by the module".into());
        }
        self.probe.knobs.lock().unwrap().push((knob.to_string(), value.clone()));
        Ok(())
    }

    fn execute(&mut self, procedure: &str, argument: &Value, out: &mut Output<'_>) -> Result<Value, String> {
        let target = || match argument {
            Value::Str(s) => Ok(s.clone()),
            _ => Err("expected a module name".to_string()),
        };
        match procedure {
            "double" => match argument {
                Value::U64(x) => Ok(Value::U64(x * 2)),
                _ => Err("expected u64".into()),
            },
            "seen" => Ok(Value::U64(self.seen)),
            "fire" => {
                out.alert("ev", argument.clone());
                Ok(Value::Bool(true))
            }
            "listen" => Ok(Value::U64(out.send_control(ControlOp::Listen, &target()?, "ev", Value::Bool(true)).into())),
            "unlisten" => {
                Ok(Value::U64(out.send_control(ControlOp::Unlisten, &target()?, "ev", Value::Bool(true)).into()))
            }
            "ask" => {
                Ok(Value::U64(out.send_control(ControlOp::ReadParam, &target()?, "level", Value::Bool(false)).into()))
            }
            "emit" => {
                let Value::U64(seq) = argument else { return Err("expected u64".into()) };
                let p = packet(out.pool(), *seq);
                out.emit(0, p);
                Ok(Value::Bool(true))
            }
            _ => Err(format!("no procedure named {procedure}")),
        }
    }

    fn handle_control(&mut self, frame: Box<ControlFrame>, _out: &mut Output<'_>) {
        self.probe.ctl.lock().unwrap().push(*frame);
    }

    fn link_changed(&mut self, face: &str, up: bool) -> bool {
        self.probe.links.lock().unwrap().push((face.to_string(), up));
        true
    }

    fn take_state(&mut self) -> Option<Box<dyn Any>> {
        Some(Box::new(self.seen))
    }

    fn adopt_state(&mut self, state: Box<dyn Any>) -> Result<(), String> {
        if !self.adopts {
            return Err("this one starts afresh".into());
        }
        self.seen = *state.downcast::<u64>().map_err(|_| "not a u64".to_string())?;
        self.seen_meter.set(self.seen);
        Ok(())
    }
}

fn pass_vars() -> Vec<VarSpec> {
    vec![
        VarSpec::knob("level", ValueType::U64, "", "a test knob").with_range(0.0, 10.0),
        VarSpec::meter("seen_total", ValueType::U64, "frames", "frames seen (the module's state)"),
    ]
}

fn pass_typed(probe: &Probe, in_ty: &'static str, out_ty: &'static str) -> Box<dyn ModuleBuilder> {
    let probe = probe.clone();
    built(&[("in", in_ty)], &[("out", out_ty)], pass_vars(), move |vars| {
        Box::new(Pass { probe, seen: 0, seen_meter: vars.meter("seen_total"), adopts: true })
    })
}

fn pass_with(probe: &Probe) -> Box<dyn ModuleBuilder> {
    pass_typed(probe, port_type::ANY, port_type::ANY)
}

fn pass() -> Box<dyn ModuleBuilder> {
    pass_with(&Probe::default())
}

/// A pass-through that refuses the state of the module it replaces.
fn pass_refusing_state(probe: &Probe) -> Box<dyn ModuleBuilder> {
    let probe = probe.clone();
    built(&[("in", port_type::ANY)], &[("out", port_type::ANY)], pass_vars(), move |vars| {
        Box::new(Pass { probe, seen: 0, seen_meter: vars.meter("seen_total"), adopts: false })
    })
}

/// A pass-through whose output port is named differently (`other`).
fn pass_other_port() -> Box<dyn ModuleBuilder> {
    let probe = Probe::default();
    built(&[("in", port_type::ANY)], &[("other", port_type::ANY)], pass_vars(), move |vars| {
        Box::new(Pass { probe, seen: 0, seen_meter: vars.meter("seen_total"), adopts: true })
    })
}

/// Records everything it receives and drops it (back to the pool).
struct Sink(Probe);

impl Module for Sink {
    fn process(&mut self, _port: usize, input: &mut Batch, _out: &mut Output<'_>) {
        for f in input.drain(..) {
            self.0.record(&f);
        }
    }
}

fn sink_typed(probe: &Probe, ty: &'static str) -> Box<dyn ModuleBuilder> {
    let probe = probe.clone();
    built(&[("in", ty)], &[], vec![], move |_| Box::new(Sink(probe)))
}

fn sink(probe: &Probe) -> Box<dyn ModuleBuilder> {
    sink_typed(probe, port_type::ANY)
}

/// Sends even sequence numbers to `even`, odd ones to `odd`.
struct Split;

impl Module for Split {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        for f in input.drain(..) {
            let odd = f.packet().and_then(|p| p.meta().get(MetaKey::SEQ)).unwrap_or(0) % 2;
            out.emit(odd as usize, f);
        }
    }
}

fn split() -> Box<dyn ModuleBuilder> {
    built(&[("in", port_type::ANY)], &[("even", port_type::ANY), ("odd", port_type::ANY)], vec![], |_| Box::new(Split))
}

/// Two inputs, one output.
fn merge() -> Box<dyn ModuleBuilder> {
    built(&[("left", port_type::ANY), ("right", port_type::ANY)], &[("out", port_type::ANY)], vec![], |_| {
        Box::new(Split)
    })
}

/// Records whether each packet is shared, then writes its first byte (copy on write) and forwards it.
struct Scribble(Probe);

impl Module for Scribble {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        for mut f in input.drain(..) {
            if let Some(p) = f.packet_mut() {
                self.0.shared.lock().unwrap().push(p.is_shared());
                p.make_mut()[0] = 0xff;
            }
            self.0.record(&f);
            out.emit(0, f);
        }
    }
}

fn scribble(probe: &Probe) -> Box<dyn ModuleBuilder> {
    let probe = probe.clone();
    built(&[("in", port_type::ANY)], &[("out", port_type::ANY)], vec![], move |_| Box::new(Scribble(probe)))
}

/// Takes nothing from its input: every frame it is given is dropped by the switch and counted.
struct Leave;

impl Module for Leave {
    fn process(&mut self, _port: usize, _input: &mut Batch, _out: &mut Output<'_>) {}
}

/// A queue: holds what arrives, emits it on the next poll (every millisecond), so it breaks cycles.
struct Queue(VecDeque<Frame>);

impl Module for Queue {
    fn process(&mut self, _port: usize, input: &mut Batch, _out: &mut Output<'_>) {
        self.0.extend(input.drain(..));
    }
    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        for f in self.0.drain(..) {
            out.emit(0, f);
        }
        Some(out.now() + std::time::Duration::from_millis(1))
    }
}

fn queue() -> Box<dyn ModuleBuilder> {
    Box::new(Built {
        iface: ModuleInterface {
            inputs: ports(&[("in", port_type::ANY)]),
            outputs: ports(&[("out", port_type::ANY)]),
            vars: vec![],
            breaks_cycles: true,
            accepts_gso: false,
        },
        make: Box::new(|_| Box::new(Queue(VecDeque::new()))),
    })
}

/// A numbered source: on every poll emits the sequence numbers queued by the test.
struct Source(Arc<Mutex<VecDeque<u64>>>);

impl Module for Source {
    fn process(&mut self, _port: usize, _input: &mut Batch, _out: &mut Output<'_>) {}
    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        let seqs: Vec<u64> = self.0.lock().unwrap().drain(..).collect();
        for s in seqs {
            let p = packet(out.pool(), s);
            out.emit(0, p);
        }
        Some(out.now())
    }
}

fn source(queue: &Arc<Mutex<VecDeque<u64>>>) -> Box<dyn ModuleBuilder> {
    let q = queue.clone();
    built(&[], &[("out", port_type::ANY)], vec![], move |_| Box::new(Source(q)))
}

/// A packet of 16 bytes whose first 8 are `seq` (little endian), with metadata SEQ = `seq`.
fn packet(pool: &PacketPool, seq: u64) -> Packet {
    let mut p = pool.alloc();
    p.make_mut().extend_from_slice(&seq.to_le_bytes());
    p.make_mut().extend_from_slice(&[0xab; 8]);
    p.meta_mut().set(MetaKey::SEQ, seq);
    p
}

fn packets(pool: &PacketPool, seqs: impl IntoIterator<Item = u64>) -> Batch {
    seqs.into_iter().map(|s| Frame::Data(packet(pool, s))).collect()
}

use crate::frame::Packet;

// ---------------------------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------------------------

fn load(name: &str, builder: Box<dyn ModuleBuilder>) -> Edit {
    Edit::load_built(name, "test", builder)
}

fn replace(name: &str, builder: Box<dyn ModuleBuilder>, keep_state: bool) -> Edit {
    Edit::Replace { name: name.into(), kind: "test".into(), settings: Settings::default(), builder, keep_state }
}

fn link(s: &str) -> Edit {
    Edit::Link(LinkSpec::parse(s).unwrap())
}

fn unlink(s: &str) -> Edit {
    Edit::Unlink(LinkSpec::parse(s).unwrap())
}

fn set(module: &str, knob: &str, value: Value) -> Edit {
    Edit::SetKnob { module: module.into(), knob: knob.into(), value }
}

fn pause(m: Option<&str>) -> Edit {
    Edit::Pause { module: m.map(str::to_string) }
}

fn resume(m: Option<&str>) -> Edit {
    Edit::Resume { module: m.map(str::to_string) }
}

fn edge(from: &str, fp: &str, to: &str, tp: &str) -> Edge {
    Edge { from: from.into(), from_port: fp.into(), to: to.into(), to_port: tp.into() }
}

fn meter(sw: &Switch, name: &str) -> u64 {
    sw.registry().snapshot().get(name).unwrap_or_else(|| panic!("no variable {name}")).load_u64()
}

fn value(sw: &Switch, name: &str) -> Value {
    sw.registry().snapshot().get(name).unwrap_or_else(|| panic!("no variable {name}")).get()
}

fn inject(sw: &mut Switch, module: &str, seqs: impl IntoIterator<Item = u64>) {
    let mut b = packets(&sw.pool().clone(), seqs);
    sw.inject(module, "in", &mut b).unwrap();
    assert!(b.is_empty());
}

/// Everything visible about the shape of a switch, to check that a refused edit changed nothing.
#[derive(Debug, PartialEq)]
struct Shape {
    describe: StackSpec,
    edges: Vec<Edge>,
    names: Vec<String>,
    infos: Vec<ModuleInfo>,
    registry: Vec<(String, Value)>,
    order: Vec<usize>,
    routes: Vec<Vec<Vec<(usize, usize)>>>,
}

fn shape(sw: &Switch) -> Shape {
    Shape {
        describe: sw.describe(),
        edges: sw.edges().to_vec(),
        names: sw.module_names().map(str::to_string).collect(),
        infos: sw.module_infos(),
        registry: sw.registry().snapshot().iter().map(|(n, c)| (n.to_string(), c.get())).collect(),
        order: sw.order.clone(),
        routes: sw.slots.iter().map(|s| s.routes.clone()).collect(),
    }
}

/// Applies `edits`, expects them refused at `index` with a message containing `needle`, and the switch unchanged.
fn refused(sw: &mut Switch, edits: Vec<Edit>, index: usize, needle: &str) {
    let before = shape(sw);
    let err = sw.apply(edits).expect_err("edits should be refused");
    assert_eq!(err.index, index, "{err}");
    assert!(err.message.contains(needle), "expected {needle:?} in: {err}");
    assert_eq!(shape(sw), before, "a refused edit list changed the switch");
}

fn t(ms: u64) -> Time {
    Time::from_millis(ms)
}

/// xorshift64: a tiny seeded generator for the randomized tests.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------------------------------------------

#[test]
fn routes_by_module_and_port() {
    let (even, odd) = (Probe::default(), Probe::default());
    let mut sw = Switch::default();
    sw.apply(vec![
        load("src", pass()),
        load("split", split()),
        load("even", sink(&even)),
        load("odd", sink(&odd)),
        link("src -> split"),
        link("split[even] -> even"),
        link("split[odd] -> odd[in]"),
    ])
    .unwrap();
    // Default ports resolved to the only data port (the implicit ctl output does not count).
    assert_eq!(
        sw.edges(),
        [edge("src", "out", "split", "in"), edge("split", "even", "even", "in"), edge("split", "odd", "odd", "in"),]
    );
    inject(&mut sw, "src", 0..10);
    sw.run(t(1));
    assert_eq!(even.seqs(), [0, 2, 4, 6, 8]);
    assert_eq!(odd.seqs(), [1, 3, 5, 7, 9]);
}

#[test]
fn port_must_be_named_when_a_module_has_several() {
    let mut sw = Switch::default();
    sw.apply(vec![load("split", split()), load("merge", merge()), load("k", sink(&Probe::default()))]).unwrap();
    refused(&mut sw, vec![link("split -> k")], 0, "several output ports");
    refused(&mut sw, vec![link("split[even] -> merge")], 0, "several input ports");
    refused(&mut sw, vec![link("split[third] -> k")], 0, "no output port `third`");
    refused(&mut sw, vec![link("split[even] -> merge[middle]")], 0, "no input port `middle`");
    refused(&mut sw, vec![link("k -> merge[left]")], 0, "has no output port");
    sw.apply(vec![link("split[even] -> merge[left]"), link("split[odd] -> merge[right]")]).unwrap();
    assert_eq!(sw.edges().len(), 2);
    // inject resolves ports by name too.
    let mut b = packets(sw.pool(), [1]);
    assert!(sw.inject("merge", "middle", &mut b).unwrap_err().contains("no input port"));
    assert!(sw.inject("ghost", "in", &mut b).unwrap_err().contains("no module"));
}

#[test]
fn fan_out_copies_are_shared_and_copy_on_write() {
    let pool = PacketPool::new(64, 1024);
    let mut sw = Switch::new(pool.clone());
    let (b, c, d) = (Probe::default(), Probe::default(), Probe::default());
    sw.apply(vec![
        load("a", pass()),
        load("b", scribble(&b)),
        load("c", sink(&c)),
        load("d", sink(&d)),
        link("a -> b, c"),
        link("b -> d"),
    ])
    .unwrap();
    inject(&mut sw, "a", 0..20);
    let copies_before = pool.stats().copies;
    sw.run(t(1));
    // Both receivers got every frame.
    assert_eq!(b.seqs(), (0..20).collect::<Vec<_>>());
    assert_eq!(c.seqs(), (0..20).collect::<Vec<_>>());
    assert_eq!(d.seqs(), (0..20).collect::<Vec<_>>());
    // b ran first (topological order) and held a copy shared with the one waiting at c.
    assert_eq!(*b.shared.lock().unwrap(), vec![true; 20]);
    // b's write copied: c still sees the original bytes, d sees b's.
    assert_eq!(*c.first.lock().unwrap(), (0..20).map(|s| s as u8).collect::<Vec<_>>());
    assert_eq!(*d.first.lock().unwrap(), vec![0xff; 20]);
    assert_eq!(pool.stats().copies - copies_before, 20);
    // Everything went back to the pool.
    let s = pool.stats();
    assert_eq!(s.allocated, s.free);
    assert_eq!(meter(&sw, "module.a.port.out.frames_out_total"), 20);
    assert_eq!(meter(&sw, "module.b.frames_in_total"), 20);
    assert_eq!(meter(&sw, "module.c.frames_in_total"), 20);
}

#[test]
fn a_face_link_change_sets_its_carrier_meter_and_reaches_every_module() {
    let mut sw = Switch::new(PacketPool::new(64, 16));
    let (a, b) = (Probe::default(), Probe::default());
    let face_vars = vec![
        VarSpec::meter("carrier", ValueType::U64, "", "1 while the link is up"),
        VarSpec::meter("carrier_changes_total", ValueType::U64, "changes", "link changes seen"),
    ];
    let face = built(&[("in", port_type::ANY)], &[("out", port_type::ANY)], face_vars, |_| Box::new(Leave));
    sw.apply(vec![load("eth", face), load("a", pass_with(&a)), load("b", pass_with(&b)), link("a -> b")]).unwrap();
    sw.run(t(1));
    let eth = sw.index["eth"];
    sw.face_link_changed(eth, false);
    assert_eq!(meter(&sw, "module.eth.carrier"), 0);
    sw.face_link_changed(eth, true);
    assert_eq!(meter(&sw, "module.eth.carrier"), 1);
    assert_eq!(meter(&sw, "module.eth.carrier_changes_total"), 2);
    let expected = vec![("eth".to_string(), false), ("eth".to_string(), true)];
    assert_eq!(*a.links.lock().unwrap(), expected);
    assert_eq!(*b.links.lock().unwrap(), expected);
    // Modules that acted are polled at the next run; an unknown index changes nothing.
    assert_eq!(sw.slots[sw.index["a"]].wake_at, Some(Time::ZERO));
    assert_ne!(sw.slots[eth].wake_at, Some(Time::ZERO));
    sw.face_link_changed(99, false);
    assert_eq!(a.links.lock().unwrap().len(), 2);
}

#[test]
fn a_numbered_source_emits_on_poll() {
    let q = Arc::new(Mutex::new(VecDeque::new()));
    let k = Probe::default();
    let mut sw = Switch::default();
    sw.apply(vec![load("src", source(&q)), load("k", sink(&k)), link("src -> k")]).unwrap();
    q.lock().unwrap().extend(0..5);
    sw.run(t(1));
    q.lock().unwrap().extend(5..8);
    sw.run(t(2));
    assert_eq!(k.seqs(), (0..8).collect::<Vec<_>>());
    assert_eq!(meter(&sw, "module.src.frames_out_total"), 8);
    assert_eq!(sw.next_wakeup(), Some(t(2)));
}

// ---------------------------------------------------------------------------------------------------------------
// Edits
// ---------------------------------------------------------------------------------------------------------------

#[test]
fn load_creates_module_meters_and_polls_it_once() {
    let mut sw = Switch::default();
    assert_eq!(sw.apply(vec![load("a", pass())]).unwrap(), Vec::<String>::new());
    assert_eq!(sw.module_names().collect::<Vec<_>>(), ["a"]);
    let reg = sw.registry().snapshot();
    for v in ["frames_in_total", "port.in.frames_in_total", "port.out.frames_out_total", "port.ctl.frames_out_total"] {
        assert!(reg.get(&format!("module.a.{v}")).is_some(), "missing module.a.{v}");
    }
    assert_eq!(sw.next_wakeup(), Some(Time::ZERO), "a new module is polled once");
    sw.run(t(1));
    assert_eq!(meter(&sw, "module.a.calls_total"), 1);
    assert_eq!(sw.next_wakeup(), None);
    assert_eq!(meter(&sw, "switch.edits_total"), 1);
}

#[test]
fn unload_removes_links_and_drops_held_frames() {
    let pool = PacketPool::new(64, 1024);
    let mut sw = Switch::new(pool.clone());
    let k = Probe::default();
    sw.apply(vec![
        load("a", pass()),
        load("b", pass()),
        load("k", sink(&k)),
        link("a -> b"),
        link("b -> k"),
        link("a[ctl] -> b"),
    ])
    .unwrap();
    sw.apply(vec![pause(Some("b"))]).unwrap();
    inject(&mut sw, "a", 0..5);
    sw.run(t(1));
    assert_eq!(meter(&sw, "module.b.held_frames"), 5);
    let notes = sw.apply(vec![Edit::Unload { name: "b".into() }]).unwrap();
    assert_eq!(
        notes,
        [
            "removed link a[out] -> b[in]",
            "removed link b[out] -> k[in]",
            "removed link a[ctl] -> b[in]",
            "dropped 5 frames held at b",
        ]
    );
    assert!(sw.edges().is_empty());
    assert_eq!(sw.module_names().collect::<Vec<_>>(), ["a", "k"]);
    assert!(sw.registry().snapshot().matching("module.b.**").next().is_none());
    let s = pool.stats();
    assert_eq!(s.allocated, s.free, "held frames went back to the pool");
    // a's output now has no receiver: counted as dropped on the port.
    inject(&mut sw, "a", 5..7);
    sw.run(t(2));
    assert_eq!(meter(&sw, "module.a.port.out.frames_dropped_total"), 2);
    assert!(k.seqs().is_empty());
    // The name can be used again, and indices stay right after the removal.
    sw.apply(vec![load("b", pass()), link("a -> b"), link("b -> k")]).unwrap();
    inject(&mut sw, "a", 7..9);
    sw.run(t(3));
    assert_eq!(k.seqs(), [7, 8]);
    refused(&mut sw, vec![Edit::Unload { name: "ghost".into() }], 0, "no module named `ghost`");
}

#[test]
fn replace_keeps_links_and_hands_over_state() {
    let mut sw = Switch::default();
    let (old, new, k) = (Probe::default(), Probe::default(), Probe::default());
    sw.apply(vec![load("a", pass_with(&old)), load("k", sink(&k)), link("a -> k"), pause(Some("a"))]).unwrap();
    inject(&mut sw, "a", 0..3);
    sw.run(t(1)); // held at a
    let edges = sw.edges().to_vec();
    let notes = sw.apply(vec![replace("a", pass_with(&new), true)]).unwrap();
    assert!(notes.is_empty(), "{notes:?}");
    assert_eq!(sw.edges(), edges, "links kept");
    assert_eq!(sw.module_infos()[0].state, "paused", "a replaced paused module stays paused");
    sw.apply(vec![resume(Some("a"))]).unwrap();
    inject(&mut sw, "a", 3..5);
    sw.run(t(2));
    assert!(old.seqs().is_empty());
    assert_eq!(new.seqs(), [0, 1, 2, 3, 4], "frames held at the old module went to the new one");
    assert_eq!(k.seqs(), [0, 1, 2, 3, 4]);
    // The old module saw nothing, its state (0) was adopted; the switch's counters continued.
    assert_eq!(meter(&sw, "module.a.seen_total"), 5);
    sw.apply(vec![replace("a", pass(), true)]).unwrap();
    inject(&mut sw, "a", 5..6);
    sw.run(t(3));
    assert_eq!(meter(&sw, "module.a.seen_total"), 6, "state (frames seen) handed over");
    assert_eq!(meter(&sw, "module.a.frames_in_total"), 6, "switch meters carried over");
    // Fresh state when asked, and a note when the new module refuses the state.
    sw.apply(vec![replace("a", pass(), false)]).unwrap();
    inject(&mut sw, "a", 6..7);
    sw.run(t(4));
    assert_eq!(meter(&sw, "module.a.seen_total"), 1);
    let notes = sw.apply(vec![replace("a", pass_refusing_state(&Probe::default()), true)]).unwrap();
    assert_eq!(notes, ["a: state not handed over: this one starts afresh"]);
    let notes = sw.apply(vec![replace("k", sink(&k), true)]).unwrap();
    assert_eq!(notes, ["k: the old module had no state to hand over"]);
    // Frames held at an input the new module lacks (one not used by a link) are dropped, noted and counted.
    sw.apply(vec![pause(Some("a"))]).unwrap();
    inject(&mut sw, "a", 7..9);
    let other_in = built(&[("in2", port_type::ANY)], &[("out", port_type::ANY)], vec![], |_| Box::new(Leave));
    let notes = sw.apply(vec![unlink("a -> k"), replace("a", other_in, false)]).unwrap();
    assert_eq!(notes, ["dropped 2 frames held at a[in]"]);
    assert_eq!(meter(&sw, "module.a.frames_dropped_total"), 2);
}

#[test]
fn replace_refused_when_a_used_port_is_missing_or_mistyped() {
    let mut sw = Switch::default();
    let k = Probe::default();
    sw.apply(vec![
        load("a", pass_typed(&k, port_type::IP, port_type::IP)),
        load("k", sink_typed(&k, port_type::IP)),
        link("a -> k"),
    ])
    .unwrap();
    refused(&mut sw, vec![replace("a", pass_other_port(), true)], 0, "no output port `out`, which link");
    refused(&mut sw, vec![replace("a", pass_typed(&k, port_type::IP, port_type::ETHERNET), true)], 0, "type mismatch");
    refused(&mut sw, vec![replace("k", sink_typed(&k, port_type::ETHERNET), true)], 0, "type mismatch");
    refused(&mut sw, vec![replace("ghost", pass(), true)], 0, "no module named `ghost`");
    // Unlinked ports may go away; an `any` port accepts ip frames.
    sw.apply(vec![replace("a", pass_typed(&k, port_type::ANY, port_type::ANY), true)]).unwrap();
    // The port can be dropped in the same edit list that removes the link.
    sw.apply(vec![unlink("a -> k"), replace("a", pass_other_port(), true), link("a[other] -> k")]).unwrap();
    assert_eq!(sw.edges(), [edge("a", "other", "k", "in")]);
}

#[test]
fn link_and_unlink() {
    let mut sw = Switch::default();
    let (b, c) = (Probe::default(), Probe::default());
    sw.apply(vec![load("a", pass()), load("b", sink(&b)), load("c", sink(&c))]).unwrap();
    sw.apply(vec![link("a -> b, c")]).unwrap();
    assert_eq!(sw.edges(), [edge("a", "out", "b", "in"), edge("a", "out", "c", "in")]);
    refused(&mut sw, vec![link("a -> b")], 0, "already exists");
    refused(&mut sw, vec![link("a -> b, b")], 0, "already exists");
    sw.apply(vec![unlink("a -> b")]).unwrap();
    assert_eq!(sw.edges(), [edge("a", "out", "c", "in")]);
    refused(&mut sw, vec![unlink("a -> b")], 0, "there is no link a[out] -> b[in]");
    refused(&mut sw, vec![unlink("a -> c, b")], 0, "there is no link");
    inject(&mut sw, "a", 0..3);
    sw.run(t(1));
    assert!(b.seqs().is_empty());
    assert_eq!(c.seqs(), [0, 1, 2]);
}

#[test]
fn set_knob_validates_and_reaches_module_and_registry() {
    let mut sw = Switch::default();
    let p = Probe::default();
    sw.apply(vec![load("a", pass_with(&p))]).unwrap();
    assert!(sw.apply(vec![set("a", "level", Value::U64(5))]).unwrap().is_empty());
    assert_eq!(*p.knobs.lock().unwrap(), [("level".to_string(), Value::U64(5))]);
    assert_eq!(value(&sw, "module.a.level"), Value::U64(5));
    // An i64 that fits is converted to the knob's type.
    sw.apply(vec![set("a", "level", Value::I64(6))]).unwrap();
    assert_eq!(value(&sw, "module.a.level"), Value::U64(6));
    refused(&mut sw, vec![set("a", "level", Value::U64(11))], 0, "within 0..=10");
    refused(&mut sw, vec![set("a", "level", Value::Str("high".into()))], 0, "expected a u64 value");
    refused(&mut sw, vec![set("a", "level", Value::I64(-1))], 0, "expected a u64 value");
    refused(&mut sw, vec![set("a", "seen_total", Value::U64(1))], 0, "read-only");
    refused(&mut sw, vec![set("a", "volume", Value::U64(1))], 0, "no knob `volume` (knobs: level)");
    refused(&mut sw, vec![set("ghost", "level", Value::U64(1))], 0, "no module named `ghost`");
    // The module may still refuse a valid value when it is applied: a note, and the cell keeps its value.
    let notes = sw.apply(vec![set("a", "level", Value::U64(7))]).unwrap();
    assert_eq!(notes, ["set module.a.level: seven is refused by the module"]);
    assert_eq!(value(&sw, "module.a.level"), Value::U64(6));
    assert_eq!(p.knobs.lock().unwrap().len(), 2);
}

#[test]
fn pause_holds_frames_and_resume_delivers_them_all() {
    let pool = PacketPool::new(64, 1024);
    let mut sw = Switch::new(pool.clone());
    let k = Probe::default();
    sw.apply(vec![load("a", pass()), load("b", pass()), load("k", sink(&k)), link("a -> b"), link("b -> k")]).unwrap();

    // One module paused: frames stop in front of it.
    sw.apply(vec![pause(Some("b"))]).unwrap();
    assert_eq!(sw.module_infos()[1].state, "paused");
    inject(&mut sw, "a", 0..4);
    sw.run(t(1));
    inject(&mut sw, "a", 4..6);
    sw.run(t(2));
    assert!(k.seqs().is_empty());
    assert_eq!(meter(&sw, "module.a.frames_in_total"), 6, "upstream keeps running");
    assert_eq!(meter(&sw, "module.b.held_frames"), 6);
    assert_eq!(meter(&sw, "module.b.frames_dropped_total"), 0);
    assert!(!sw.has_pending(), "frames held at a paused module are not pending work");
    sw.apply(vec![resume(Some("b"))]).unwrap();
    assert!(sw.has_pending());
    sw.run(t(3));
    assert_eq!(k.seqs(), [0, 1, 2, 3, 4, 5]);
    assert_eq!(meter(&sw, "module.b.held_frames"), 0);

    // The whole stack paused: nothing runs, injected frames wait at the first module.
    sw.apply(vec![pause(None)]).unwrap();
    assert!(sw.is_paused());
    assert_eq!(value(&sw, "switch.paused"), Value::Bool(true));
    assert_eq!(sw.module_infos()[0].state, "paused");
    inject(&mut sw, "a", 6..9);
    assert_eq!(sw.run(t(4)), 0);
    assert_eq!(sw.next_wakeup(), None);
    assert!(!sw.has_pending());
    assert_eq!(k.seqs().len(), 6);
    assert_eq!(meter(&sw, "module.a.held_frames"), 3);
    sw.apply(vec![resume(None)]).unwrap();
    assert_eq!(value(&sw, "switch.paused"), Value::Bool(false));
    sw.run(t(5));
    assert_eq!(k.seqs(), (0..9).collect::<Vec<_>>());
    assert_eq!(meter(&sw, "module.a.held_frames"), 0, "held meter cleared after the stack resumes");
    let s = pool.stats();
    assert_eq!(s.allocated, s.free);
    refused(&mut sw, vec![pause(Some("ghost"))], 0, "no module named `ghost`");
    refused(&mut sw, vec![resume(Some("ghost"))], 0, "no module named `ghost`");
}

#[test]
fn hold_limit_drops_and_counts_beyond_it() {
    let mut sw = Switch::new(PacketPool::new(16, 0));
    let k = Probe::default();
    sw.apply(vec![load("a", pass()), load("k", sink(&k)), link("a -> k"), pause(Some("k"))]).unwrap();
    let n = HOLD_LIMIT as u64 + 10;
    // inject itself holds at most HOLD_LIMIT frames at one input.
    let mut b = packets(sw.pool(), 0..n);
    sw.inject("a", "in", &mut b).unwrap();
    assert_eq!(meter(&sw, "module.a.frames_dropped_total"), 10);
    sw.run(t(1));
    inject(&mut sw, "a", 0..20);
    sw.run(t(2));
    // The paused k holds HOLD_LIMIT frames; the 20 more routed to it are dropped and counted at k.
    assert_eq!(meter(&sw, "module.k.held_frames"), HOLD_LIMIT as u64);
    assert_eq!(meter(&sw, "module.k.frames_dropped_total"), 20);
    assert_eq!(meter(&sw, "module.a.frames_out_total"), HOLD_LIMIT as u64 + 20);
    sw.apply(vec![resume(Some("k"))]).unwrap();
    sw.run(t(3));
    assert_eq!(k.seqs(), (0..HOLD_LIMIT as u64).collect::<Vec<_>>());
}

// ---------------------------------------------------------------------------------------------------------------
// Validation and atomicity
// ---------------------------------------------------------------------------------------------------------------

fn small_stack() -> (Switch, Probe) {
    let k = Probe::default();
    let mut sw = Switch::default();
    sw.apply(vec![
        load("a", pass_typed(&k, port_type::IP, port_type::IP)),
        load("b", pass_typed(&k, port_type::IP, port_type::IP)),
        load("eth", sink_typed(&k, port_type::ETHERNET)),
        load("q", queue()),
        link("a -> b"),
    ])
    .unwrap();
    (sw, k)
}

#[test]
fn invalid_edits_change_nothing() {
    let (mut sw, _) = small_stack();
    refused(&mut sw, vec![link("a -> ghost")], 0, "no module named `ghost` (modules: a, b, eth, q)");
    refused(&mut sw, vec![link("ghost -> a")], 0, "no module named `ghost`");
    refused(&mut sw, vec![link("a[nope] -> b")], 0, "no output port `nope`");
    refused(&mut sw, vec![link("a -> b[nope]")], 0, "no input port `nope`");
    refused(&mut sw, vec![link("b -> eth")], 0, "type mismatch: b[out] carries ip frames but eth[in] takes ethernet");
    refused(&mut sw, vec![link("b[ctl] -> a")], 0, "type mismatch");
    refused(&mut sw, vec![link("b -> a")], 0, "cycle through a, b");
    refused(&mut sw, vec![link("a -> a")], 0, "cycle");
    refused(&mut sw, vec![load("a", pass())], 0, "already loaded");
    refused(&mut sw, vec![load("x", pass()), load("x", pass())], 1, "already loaded");
    refused(&mut sw, vec![load("Bad", pass())], 0, "invalid module name");
    refused(&mut sw, vec![set("a", "level", Value::U64(99))], 0, "within");
    let twice = built(&[("in", port_type::ANY), ("in", port_type::ANY)], &[], vec![], |_| Box::new(Leave));
    refused(&mut sw, vec![load("x", twice)], 0, "input port `in` twice");
    let ctl = built(&[], &[("ctl", port_type::ANY)], vec![], |_| Box::new(Leave));
    refused(&mut sw, vec![load("x", ctl)], 0, "output port `ctl` twice");
    let std = built(&[], &[], vec![VarSpec::meter("calls_total", ValueType::U64, "", "")], |_| Box::new(Leave));
    refused(&mut sw, vec![load("x", std)], 0, "a name the switch keeps");
}

#[test]
fn an_edit_list_is_all_or_nothing() {
    let (mut sw, _) = small_stack();
    // The last edit is invalid: the load, links, knob write, pause and unload before it do not happen.
    refused(
        &mut sw,
        vec![
            load("c", pass()),
            link("b -> c"),
            set("a", "level", Value::U64(3)),
            pause(None),
            pause(Some("a")),
            Edit::Unload { name: "q".into() },
            unlink("a -> b"),
            link("c -> ghost"),
        ],
        7,
        "no module named `ghost`",
    );
    assert!(!sw.is_paused());
    // A cycle is judged on the final graph: the error names the last edit.
    refused(&mut sw, vec![load("c", pass()), link("b -> c"), link("c -> a")], 2, "cycle through a, b, c");
    // Edits see the effect of earlier ones in the list: a link to a module loaded just before is fine, one to a
    // module unloaded just before is not.
    refused(&mut sw, vec![Edit::Unload { name: "b".into() }, link("a -> b")], 1, "no module named `b`");
    sw.apply(vec![load("c", pass()), link("b -> c")]).unwrap();
    // A cycle that would be created and removed within the same list is fine.
    sw.apply(vec![link("c -> a"), unlink("c -> a")]).unwrap();
}

#[test]
fn a_cycle_through_a_queue_is_accepted_and_bounded() {
    let (mut sw, _) = small_stack();
    // a -> b -> q -> a: q holds frames until its next poll, so the loop cannot spin within one run.
    sw.apply(vec![link("b -> q"), link("q -> a")]).unwrap();
    inject(&mut sw, "a", 0..3);
    sw.run(t(1));
    assert_eq!(meter(&sw, "module.a.frames_in_total"), 3);
    assert_eq!(meter(&sw, "module.q.frames_in_total"), 3);
    sw.run(t(3));
    assert_eq!(meter(&sw, "module.a.frames_in_total"), 6, "one more lap per poll of the queue");
    assert_eq!(meter(&sw, "module.b.frames_in_total"), 6);
    sw.run(t(3));
    assert_eq!(meter(&sw, "module.a.frames_in_total"), 6, "not due again before another millisecond");
}

#[test]
fn a_chain_of_cycle_breaking_modules_is_crossed_in_one_run() {
    // c0 -> c1 -> ... -> c9 -> sink, loaded last first: every hop goes back in the order (cycle-breaking modules
    // order nothing), so each needs a pass of its own; a run makes enough passes for all of them.
    let probe = Probe::default();
    let hop = || -> Box<dyn ModuleBuilder> {
        Box::new(Built {
            iface: ModuleInterface {
                inputs: ports(&[("in", port_type::ANY)]),
                outputs: ports(&[("out", port_type::ANY)]),
                vars: pass_vars(),
                breaks_cycles: true,
                accepts_gso: false,
            },
            make: Box::new(|vars| {
                Box::new(Pass { probe: Probe::default(), seen: 0, seen_meter: vars.meter("seen_total"), adopts: true })
            }),
        })
    };
    let mut sw = Switch::default();
    let mut edits: Vec<Edit> = (0..10).rev().map(|i| load(&format!("c{i}"), hop())).collect();
    edits.push(load("sink", sink(&probe)));
    edits.extend((0..9).map(|i| link(&format!("c{i} -> c{}", i + 1))));
    edits.push(link("c9 -> sink"));
    sw.apply(edits).unwrap();
    inject(&mut sw, "c0", 0..3);
    sw.run(t(1));
    assert_eq!(probe.seqs(), vec![0, 1, 2], "through the ten modules in one run");
    assert!(!sw.has_pending());
}

// ---------------------------------------------------------------------------------------------------------------
// Edits while frames flow
// ---------------------------------------------------------------------------------------------------------------

/// What the linking table says should happen, run by run.
#[derive(Default)]
struct Model {
    fan_out: bool,
    a_paused: bool,
    stack_paused: bool,
    spare_loaded: bool,
    /// Injected, not yet processed by src.
    at_src: Vec<u64>,
    /// Processed by src, held in front of a paused `a`.
    at_a: Vec<u64>,
    want_c1: Vec<u64>,
    want_c2: Vec<u64>,
    want_spare: Vec<u64>,
}

impl Model {
    /// One run of the switch, with the table in force now.
    fn run(&mut self) {
        if self.stack_paused {
            return;
        }
        let moved = std::mem::take(&mut self.at_src);
        if self.spare_loaded {
            self.want_spare.extend(&moved);
        }
        self.at_a.extend(moved);
        if !self.a_paused {
            if self.fan_out {
                self.want_c2.extend(&self.at_a);
            }
            self.want_c1.append(&mut self.at_a);
        }
    }
}

fn edits_while_frames_flow(seed: u64, rounds: usize) {
    let pool = PacketPool::new(32, 1 << 20);
    let mut sw = Switch::new(pool.clone());
    let (pa, c1, c2, spare) = (Probe::default(), Probe::default(), Probe::default(), Probe::default());
    sw.apply(vec![
        load("src", pass()),
        load("a", pass_with(&pa)),
        load("c1", sink(&c1)),
        load("c2", sink(&c2)),
        link("src -> a"),
        link("a -> c1"),
    ])
    .unwrap();
    let mut m = Model::default();
    let mut rng = XorShift(seed);
    let mut next = 0u64;
    let mut now = 0;
    let mut edits = 0;
    let mut runs = 0;
    let toggle_fan_out = |m: &mut Model| {
        m.fan_out = !m.fan_out;
        if m.fan_out {
            link("a -> c2")
        } else {
            unlink("a -> c2")
        }
    };
    for _ in 0..rounds {
        let list: Vec<Edit> = match rng.below(9) {
            0 => vec![toggle_fan_out(&mut m)],
            1 => vec![replace("a", pass_with(&pa), true)],
            2 => {
                m.a_paused = !m.a_paused;
                vec![if m.a_paused { pause(Some("a")) } else { resume(Some("a")) }]
            }
            3 => {
                m.spare_loaded = !m.spare_loaded;
                if m.spare_loaded {
                    vec![load("spare", pass_with(&spare)), link("src -> spare")]
                } else {
                    vec![Edit::Unload { name: "spare".into() }]
                }
            }
            4 => {
                m.stack_paused = !m.stack_paused;
                vec![if m.stack_paused { pause(None) } else { resume(None) }]
            }
            5 => vec![replace("a", pass_with(&pa), true), toggle_fan_out(&mut m)],
            6 => {
                // A refused list in the middle of the traffic changes nothing.
                let before = shape(&sw);
                assert!(sw.apply(vec![toggle_fan_out(&mut Model::default()), link("a -> ghost")]).is_err());
                assert_eq!(shape(&sw), before);
                vec![]
            }
            _ => vec![],
        };
        if !list.is_empty() {
            let unload = matches!(list[0], Edit::Unload { .. });
            let notes = sw.apply(list).unwrap();
            if unload {
                assert_eq!(notes, ["removed link src[out] -> spare[in]"], "spare never holds frames");
            }
            edits += 1;
        }
        // Inject zero, one or two batches; run or not (frames injected but not run meet the next table).
        for _ in 0..rng.below(3) {
            let k = 1 + rng.below(24);
            inject(&mut sw, "src", next..next + k);
            m.at_src.extend(next..next + k);
            next += k;
        }
        if rng.below(4) != 0 {
            now += 1;
            sw.run(t(now));
            m.run();
            runs += 1;
            if m.a_paused && !m.stack_paused {
                assert_eq!(meter(&sw, "module.a.held_frames"), m.at_a.len() as u64);
            }
            if m.stack_paused {
                assert_eq!(meter(&sw, "module.src.held_frames"), m.at_src.len() as u64);
            }
        }
        // After every step: what arrived is exactly what the model says, and only frames in flight are alive.
        assert_eq!(c1.seqs().len(), m.want_c1.len());
        assert_eq!(c2.seqs().len(), m.want_c2.len());
        let s = pool.stats();
        assert_eq!(s.allocated - s.free, (m.at_src.len() + m.at_a.len()) as u64, "a packet leaked or vanished");
    }
    // Drain: resume everything and run once.
    let mut last = vec![];
    if m.stack_paused {
        m.stack_paused = false;
        last.push(resume(None));
    }
    if m.a_paused {
        m.a_paused = false;
        last.push(resume(Some("a")));
    }
    if !last.is_empty() {
        sw.apply(last).unwrap();
    }
    sw.run(t(now + 1));
    m.run();
    assert!(next > 1000 && edits > 200 && runs > 300, "too little traffic: {next} frames, {edits} edits, {runs} runs");
    assert_eq!(m.want_c1, (0..next).collect::<Vec<_>>());
    assert_eq!(c1.seqs(), m.want_c1, "c1 must get every frame exactly once, in order");
    assert_eq!(c2.seqs(), m.want_c2, "c2 must get exactly the frames that passed a while a -> c2 existed");
    assert_eq!(spare.seqs(), m.want_spare, "spare gets exactly the frames src sent while it was loaded");
    assert_eq!(pa.seqs(), m.want_c1, "a (in all its incarnations) saw every frame once");
    assert!(!m.want_c2.is_empty() && m.want_c2.len() < next as usize);
    assert_eq!(meter(&sw, "module.a.seen_total"), next, "the state survived every replace");
    assert_eq!(meter(&sw, "module.a.frames_in_total"), next, "the meters survived every replace");
    assert_eq!(meter(&sw, "module.c2.frames_in_total"), m.want_c2.len() as u64);
    assert_eq!(meter(&sw, "switch.frames_injected_total"), next);
    let s = pool.stats();
    assert_eq!(s.allocated, s.free, "every packet went back to the pool");
    assert!(!sw.has_pending());
}

#[test]
fn edits_while_frames_flow_lose_and_duplicate_nothing() {
    for seed in [1, 0x9e37_79b9_7f4a_7c15, 0xdead_beef, 42, 7] {
        edits_while_frames_flow(seed, 1500);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Control frames
// ---------------------------------------------------------------------------------------------------------------

fn request(op: ControlOp, dest: &str, serial: u32, param: &str, value: Value) -> ControlFrame {
    ControlFrame { op, sender: CONTROL_PLANE.into(), dest: dest.into(), serial, param: param.into(), value }
}

/// Sends one frame from the control plane, runs, and returns what came back.
fn ask(sw: &mut Switch, frame: ControlFrame) -> Vec<ControlFrame> {
    sw.send_control(frame);
    sw.run(t(1));
    sw.take_control_inbox()
}

#[test]
fn the_switch_answers_param_reads_and_writes() {
    let p = Probe::default();
    let mut sw = Switch::default();
    sw.apply(vec![load("a", pass_with(&p))]).unwrap();
    let r = ask(&mut sw, request(ControlOp::SetParam, "a", 8, "level", Value::U64(4)));
    let want =
        request(ControlOp::SetParam, "a", 8, "level", Value::U64(4)).reply(ControlOp::SetParamReply, Value::Bool(true));
    assert_eq!(r, [want]);
    assert_eq!(*p.knobs.lock().unwrap(), [("level".to_string(), Value::U64(4))]);
    let r = ask(&mut sw, request(ControlOp::ReadParam, "a", 9, "level", Value::Bool(false)));
    assert_eq!(
        (r[0].op, r[0].serial, &r[0].sender, &r[0].dest),
        (ControlOp::ReadParamReply, 9, &"a".to_string(), &CONTROL_PLANE.to_string())
    );
    assert_eq!(r[0].value, Value::U64(4));
    let r = ask(&mut sw, request(ControlOp::ReadParam, "a", 10, "calls_total", Value::Bool(false)));
    assert_eq!(r[0].op, ControlOp::ReadParamReply);
    assert!(matches!(r[0].value, Value::U64(n) if n >= 1));
    let r = ask(&mut sw, request(ControlOp::ReadParam, "a", 11, "volume", Value::Bool(false)));
    assert_eq!((r[0].op, r[0].serial), (ControlOp::Error, 11));
    let r = ask(&mut sw, request(ControlOp::SetParam, "a", 12, "level", Value::U64(11)));
    assert_eq!((r[0].op, r[0].serial), (ControlOp::Error, 12));
    assert!(matches!(&r[0].value, Value::Str(s) if s.contains("within")));
    assert_eq!(value(&sw, "module.a.level"), Value::U64(4));
    let r = ask(&mut sw, request(ControlOp::SetParam, "a", 13, "seen_total", Value::U64(1)));
    assert_eq!(r[0].op, ControlOp::Error);
}

#[test]
fn exec_reaches_the_module_and_its_emitted_frames_are_routed() {
    let k = Probe::default();
    let mut sw = Switch::default();
    sw.apply(vec![load("a", pass()), load("k", sink(&k)), link("a -> k")]).unwrap();
    let r = ask(&mut sw, request(ControlOp::Exec, "a", 1, "double", Value::U64(21)));
    assert_eq!((r[0].op, r[0].serial, &r[0].value), (ControlOp::ExecReply, 1, &Value::U64(42)));
    let r = ask(&mut sw, request(ControlOp::Exec, "a", 2, "nope", Value::U64(0)));
    assert_eq!(
        (r[0].op, r[0].serial, &r[0].value),
        (ControlOp::Error, 2, &Value::Str("no procedure named nope".into()))
    );
    let r = ask(&mut sw, request(ControlOp::Exec, "a", 3, "emit", Value::U64(77)));
    assert_eq!(r[0].op, ControlOp::ExecReply);
    assert_eq!(k.seqs(), [77]);
    assert_eq!(meter(&sw, "module.a.port.out.frames_out_total"), 1);
}

#[test]
fn listen_and_alert_reach_the_listener() {
    let (pa, pl) = (Probe::default(), Probe::default());
    let mut sw = Switch::default();
    sw.apply(vec![load("a", pass_with(&pa)), load("l", pass_with(&pl))]).unwrap();
    // l asks to be alerted of a's event `ev`; then a raises it.
    ask(&mut sw, request(ControlOp::Exec, "l", 1, "listen", Value::Str("a".into())));
    let r = ask(&mut sw, request(ControlOp::Exec, "a", 2, "fire", Value::U64(9)));
    assert_eq!(r.len(), 1, "only the exec reply comes back to the control plane: {r:?}");
    let got = pl.ctl();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!((got[0].op, got[0].sender.as_str(), got[0].dest.as_str()), (ControlOp::Alert, "a", "l"));
    assert_eq!((got[0].param.as_str(), &got[0].value), ("ev", &Value::U64(9)));
    assert!(pa.ctl().is_empty());
    // The control plane can listen too.
    assert!(ask(&mut sw, request(ControlOp::Listen, "a", 3, "ev", Value::Bool(true))).is_empty());
    let r = ask(&mut sw, request(ControlOp::Exec, "a", 4, "fire", Value::U64(10)));
    let alerts: Vec<_> = r.iter().filter(|f| f.op == ControlOp::Alert).collect();
    assert_eq!(alerts.len(), 1);
    assert_eq!(alerts[0].value, Value::U64(10));
    assert_eq!(pl.ctl().len(), 2);
    // Unlisten stops the alerts.
    ask(&mut sw, request(ControlOp::Exec, "l", 5, "unlisten", Value::Str("a".into())));
    ask(&mut sw, request(ControlOp::Unlisten, "a", 6, "ev", Value::Bool(true)));
    let r = ask(&mut sw, request(ControlOp::Exec, "a", 7, "fire", Value::U64(11)));
    assert!(r.iter().all(|f| f.op != ControlOp::Alert));
    assert_eq!(pl.ctl().len(), 2);
    // Unloading the listener removes its subscription.
    ask(&mut sw, request(ControlOp::Exec, "l", 8, "listen", Value::Str("a".into())));
    assert_eq!(sw.listeners.len(), 1);
    sw.apply(vec![Edit::Unload { name: "l".into() }]).unwrap();
    assert!(sw.listeners.is_empty());
}

#[test]
fn unknown_destinations_get_an_error_and_errors_do_not_bounce() {
    let pl = Probe::default();
    let mut sw = Switch::default();
    sw.apply(vec![load("l", pass_with(&pl))]).unwrap();
    let r = ask(&mut sw, request(ControlOp::ReadParam, "ghost", 5, "level", Value::Bool(false)));
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].op, r[0].serial, r[0].sender.as_str()), (ControlOp::Error, 5, "ghost"));
    assert_eq!(r[0].value, Value::Str("no module named ghost".into()));
    // A module asking a module that does not exist gets the error through handle_control.
    ask(&mut sw, request(ControlOp::Exec, "l", 6, "ask", Value::Str("ghost".into())));
    let got = pl.ctl();
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].op, got[0].dest.as_str()), (ControlOp::Error, "l"));
    // A frame whose sender and destination are both unknown must not bounce errors back and forth forever.
    for op in [ControlOp::ReadParam, ControlOp::ReadParamReply, ControlOp::Error] {
        let mut f = request(op, "nobody", 1, "x", Value::Bool(false));
        f.sender = "ghost".into();
        sw.send_control(f);
        sw.run(t(2));
        assert!(sw.control.is_empty(), "control frames still circulating after {op:?}: {:?}", sw.control);
        assert!(sw.take_control_inbox().is_empty());
    }
}

#[test]
fn control_frames_are_mirrored_on_the_senders_ctl_port() {
    let (pl, tap) = (Probe::default(), Probe::default());
    let mut sw = Switch::default();
    sw.apply(vec![load("a", pass()), load("l", pass_with(&pl)), load("tap", sink(&tap)), link("l[ctl] -> tap")])
        .unwrap();
    assert_eq!(sw.edges(), [edge("l", "ctl", "tap", "in")]);
    ask(&mut sw, request(ControlOp::Exec, "l", 1, "ask", Value::Str("a".into())));
    ask(&mut sw, request(ControlOp::Exec, "l", 2, "listen", Value::Str("a".into())));
    // What l sent, and the exec replies the switch sent in l's name; not the reply a sent to l.
    let seen = tap.ctl();
    assert_eq!(
        seen.iter().map(|f| (f.op, f.dest.as_str())).collect::<Vec<_>>(),
        [
            (ControlOp::ReadParam, "a"),
            (ControlOp::ExecReply, CONTROL_PLANE),
            (ControlOp::Listen, "a"),
            (ControlOp::ExecReply, CONTROL_PLANE),
        ]
    );
    assert!(seen.iter().all(|f| f.sender == "l"));
    assert_eq!(pl.ctl().iter().map(|f| f.op).collect::<Vec<_>>(), [ControlOp::ReadParamReply]);
    assert_eq!(meter(&sw, "module.l.port.ctl.frames_out_total"), 4);
    assert_eq!(meter(&sw, "module.tap.frames_in_total"), 4);
    // Nothing is mirrored on a ctl port without a receiver, and nothing counted as dropped there.
    assert_eq!(meter(&sw, "module.a.port.ctl.frames_out_total"), 0);
    assert_eq!(meter(&sw, "module.a.port.ctl.frames_dropped_total"), 0);
    sw.apply(vec![unlink("l[ctl] -> tap"), link("a[ctl] -> tap")]).unwrap();
    ask(&mut sw, request(ControlOp::Exec, "a", 3, "double", Value::U64(1)));
    let last = tap.ctl().pop().unwrap();
    assert_eq!((last.op, last.sender.as_str(), last.dest.as_str()), (ControlOp::ExecReply, "a", CONTROL_PLANE));
}

// ---------------------------------------------------------------------------------------------------------------
// Stack descriptions
// ---------------------------------------------------------------------------------------------------------------

/// A kind of the tests' catalog: its name, summary and how it configures a module.
struct TestKind {
    name: &'static str,
    summary: &'static str,
    configure: fn(&Settings) -> Result<Box<dyn ModuleBuilder>, crate::ConfigError>,
}

impl ModuleKind for TestKind {
    fn name(&self) -> &'static str {
        self.name
    }
    fn summary(&self) -> &'static str {
        self.summary
    }
    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, crate::ConfigError> {
        (self.configure)(settings)
    }
}

fn catalog() -> Catalog {
    let mut c = Catalog::new();
    c.register(Box::new(TestKind {
        name: "pass",
        summary: "test pass-through",
        configure: |settings| {
            let mut r = settings.reader("pass");
            if let Some(l) = r.u64("level")? {
                if l > 10 {
                    return Err(r.error("level", "expected 0..=10"));
                }
            }
            r.finish()?;
            Ok(pass())
        },
    }));
    c.register(Box::new(TestKind {
        name: "sink",
        summary: "test sink",
        configure: |settings| {
            settings.reader("sink").finish()?;
            Ok(sink(&Probe::default()))
        },
    }));
    c.register(Box::new(TestKind {
        name: "split",
        summary: "test splitter",
        configure: |settings| {
            settings.reader("split").finish()?;
            Ok(split())
        },
    }));
    c
}

/// The edits that build `spec` from nothing.
fn edits_for(spec: &StackSpec, catalog: &Catalog) -> Vec<Edit> {
    let mut edits: Vec<Edit> = spec
        .modules
        .iter()
        .map(|m| Edit::Load {
            name: m.name.clone(),
            kind: m.kind.clone(),
            settings: m.settings.clone(),
            builder: catalog.configure(&m.kind, &m.settings, m.location.clone()).unwrap(),
        })
        .collect();
    edits.extend(spec.links.iter().map(|l| Edit::Link(l.link.clone())));
    edits
}

fn assert_same_stack(a: &StackSpec, b: &StackSpec) {
    let names = |s: &StackSpec| s.modules.iter().map(|m| (m.name.clone(), m.kind.clone())).collect::<Vec<_>>();
    assert_eq!(names(a), names(b));
    for (x, y) in a.modules.iter().zip(&b.modules) {
        assert!(
            x.settings.same_values(&y.settings),
            "settings of {} differ: {:?} vs {:?}",
            x.name,
            x.settings,
            y.settings
        );
    }
    let links = |s: &StackSpec| s.links.iter().map(|l| l.link.clone()).collect::<Vec<_>>();
    assert_eq!(links(a), links(b));
}

const STACK: &str = r#"links = ["src -> sp", "sp[even] -> k1, k2", "sp[odd] -> k3", "src[ctl] -> k3"]

[modules.src]
kind = "pass"
level = 3

[modules.sp]
kind = "split"

[modules.k1]
kind = "sink"

[modules.k2]
kind = "sink"

[modules.k3]
kind = "sink"
"#;

#[test]
fn describe_round_trips_through_toml() {
    let cat = catalog();
    let spec = StackSpec::parse("stack.toml", STACK).unwrap();
    let mut sw = Switch::default();
    sw.apply(edits_for(&spec, &cat)).unwrap();
    // A knob given as a setting starts at that value, and describe() gives back what was loaded.
    assert_eq!(value(&sw, "module.src.level"), Value::U64(3));
    assert_same_stack(&sw.describe(), &spec);

    sw.apply(vec![set("src", "level", Value::U64(5))]).unwrap();
    let described = sw.describe();
    assert_eq!(described.modules[0].settings.get("level").unwrap().value, toml::Value::Integer(5));
    let text = described.to_toml();
    let again = StackSpec::parse("saved.toml", &text).unwrap();
    assert_same_stack(&again, &described);
    assert_eq!(
        again.links.iter().map(|l| l.link.to_string()).collect::<Vec<_>>(),
        ["src -> sp", "sp[even] -> k1, k2", "sp[odd] -> k3", "src[ctl] -> k3"]
    );

    // Loading the saved description gives the same running stack.
    let mut sw2 = Switch::default();
    sw2.apply(edits_for(&again, &cat)).unwrap();
    assert_same_stack(&sw2.describe(), &described);
    assert_eq!(sw2.edges(), sw.edges());
    assert_eq!(value(&sw2, "module.src.level"), Value::U64(5));
}

// ---------------------------------------------------------------------------------------------------------------
// Meters
// ---------------------------------------------------------------------------------------------------------------

#[test]
fn meters_count_frames_per_module_and_port() {
    let ke = Probe::default();
    let mut sw = Switch::default();
    let leave = built(&[("in", port_type::ANY)], &[], vec![], |_| Box::new(Leave));
    sw.apply(vec![
        load("src", pass()),
        load("split", split()),
        load("ke", sink(&ke)),
        load("leave", leave),
        link("src -> split"),
        link("split[even] -> ke, leave"),
    ])
    .unwrap();
    let mut tick = 0u64;
    sw.set_profiler(Some(Box::new(move || {
        tick += 5;
        tick
    })));
    inject(&mut sw, "src", 0..10);
    inject(&mut sw, "src", 10..11);
    sw.run(t(1));
    inject(&mut sw, "src", 11..14);
    sw.run(t(2));
    let exp = [
        ("switch.frames_injected_total", 14),
        ("switch.runs_total", 2),
        ("module.src.frames_in_total", 14),
        ("module.src.port.in.frames_in_total", 14),
        ("module.src.frames_out_total", 14),
        ("module.src.port.out.frames_out_total", 14),
        ("module.src.frames_dropped_total", 0),
        // Polled once after loading, then one process call per run.
        ("module.src.calls_total", 3),
        ("module.split.frames_in_total", 14),
        ("module.split.frames_out_total", 14),
        ("module.split.port.even.frames_out_total", 7),
        ("module.split.port.odd.frames_out_total", 7),
        ("module.split.port.odd.frames_dropped_total", 7),
        ("module.split.port.even.frames_dropped_total", 0),
        ("module.split.frames_dropped_total", 7),
        ("module.ke.frames_in_total", 7),
        ("module.ke.frames_dropped_total", 0),
        ("module.leave.frames_in_total", 7),
        ("module.leave.frames_dropped_total", 7),
        ("module.leave.frames_out_total", 0),
    ];
    for (name, want) in exp {
        assert_eq!(meter(&sw, name), want, "{name}");
    }
    // The fake clock advances 5 per reading and is read twice per call.
    for m in ["src", "split", "ke", "leave"] {
        assert_eq!(
            meter(&sw, &format!("module.{m}.busy_ns_total")),
            5 * meter(&sw, &format!("module.{m}.calls_total"))
        );
    }
    assert_eq!(ke.seqs(), [0, 2, 4, 6, 8, 10, 12]);

    let reg = sw.registry().snapshot();
    let names = |p: &str| reg.matching(p).map(|(n, _)| n.to_string()).collect::<Vec<_>>();
    assert_eq!(
        names("module.*.frames_in_total"),
        [
            "module.ke.frames_in_total",
            "module.leave.frames_in_total",
            "module.split.frames_in_total",
            "module.src.frames_in_total"
        ]
    );
    assert_eq!(
        names("module.split.port.*.frames_out_total"),
        [
            "module.split.port.ctl.frames_out_total",
            "module.split.port.even.frames_out_total",
            "module.split.port.odd.frames_out_total"
        ]
    );
    assert_eq!(
        names("module.s*.port.?n.frames_in_total"),
        ["module.split.port.in.frames_in_total", "module.src.port.in.frames_in_total"]
    );
    let dropped: u64 = reg.matching("module.**.frames_dropped_total").map(|(_, c)| c.load_u64()).sum();
    assert_eq!(dropped, 7 + 7 + 7, "module totals plus the odd port's");
    assert!(names("switch.*").contains(&"switch.pool_free".to_string()));
    // Specs carry kind, unit and description.
    let spec = reg.get("module.split.port.odd.frames_dropped_total").unwrap().spec().clone();
    assert_eq!((spec.kind, spec.unit.as_str()), (VarKind::Meter, "frames"));
    assert!(!spec.description.is_empty());
    assert!(reg.get("module.src.level").is_some_and(|c| c.spec().kind == VarKind::Knob));
}

/// Counts its polls; `process` asks for a wakeup 5 ms later; knob `k` is accepted.
struct Timer(Arc<Mutex<Vec<Time>>>);

impl Module for Timer {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        input.clear();
        out.wake_at(out.now() + std::time::Duration::from_millis(5));
    }
    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        self.0.lock().unwrap().push(out.now());
        None
    }
    fn write_knob(&mut self, _knob: &str, _value: &Value) -> Result<(), String> {
        Ok(())
    }
}

#[test]
fn modules_can_ask_for_a_wakeup_from_process_and_are_polled_after_a_knob_write() {
    let polls = Arc::new(Mutex::new(Vec::new()));
    let p2 = polls.clone();
    let builder =
        built(&[("in", port_type::ANY)], &[], vec![VarSpec::knob("k", ValueType::U64, "", "test knob")], move |_| {
            Box::new(Timer(p2.clone()))
        });
    let mut sw = Switch::default();
    sw.apply(vec![load("timer", builder)]).unwrap();
    sw.run(t(1));
    assert_eq!(*polls.lock().unwrap(), [t(1)], "polled once after load");
    assert_eq!(sw.next_wakeup(), None);

    inject(&mut sw, "timer", [1]);
    sw.run(t(2));
    assert_eq!(sw.next_wakeup(), Some(t(7)), "process asked for now + 5 ms");
    sw.run(t(6));
    assert_eq!(polls.lock().unwrap().len(), 1, "not before its time");
    sw.run(t(7));
    assert_eq!(*polls.lock().unwrap(), [t(1), t(7)]);

    sw.apply(vec![set("timer", "k", Value::U64(3))]).unwrap();
    assert!(sw.next_wakeup().is_some_and(|w| w <= t(8)), "due right after a knob write");
    sw.run(t(8));
    assert_eq!(*polls.lock().unwrap(), [t(1), t(7), t(8)]);
}

/// For each frame, hands a [`crate::Notifier`] to a thread of its own in `process` (when the switch gives one), which
/// notifies once; counts its polls.
struct Offloader {
    polls: Log<Time>,
    threads: Log<std::thread::JoinHandle<()>>,
    had_notifier: Log<bool>,
}

impl Module for Offloader {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        let frames = input.len();
        input.clear();
        let notifier = out.notifier();
        self.had_notifier.lock().unwrap().push(notifier.is_some());
        for n in std::iter::repeat_n(notifier, frames).flatten() {
            self.threads.lock().unwrap().push(std::thread::spawn(move || n.notify()));
        }
    }
    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        self.polls.lock().unwrap().push(out.now());
        None
    }
}

#[test]
fn a_notifier_wakes_the_switch_thread_and_has_its_module_polled_at_the_next_run() {
    let (polls, threads, had) = (Log::default(), Log::default(), Log::default());
    let (p, th, h) = (polls.clone(), threads.clone(), had.clone());
    let builder = built(&[("in", port_type::ANY)], &[], vec![], move |_| {
        Box::new(Offloader { polls: p.clone(), threads: th.clone(), had_notifier: h.clone() })
    });
    let mut sw = Switch::default();
    sw.apply(vec![load("off", builder)]).unwrap();
    sw.run(t(1));
    inject(&mut sw, "off", [1]);
    sw.run(t(2));
    assert_eq!(*had.lock().unwrap(), [false], "no waker: no notifier (the module polls on a timer)");

    let woken = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let w = woken.clone();
    sw.set_waker(move || {
        w.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    });
    inject(&mut sw, "off", [2]);
    sw.run(t(3));
    assert_eq!(*had.lock().unwrap(), [false, true]);
    assert_eq!(sw.next_wakeup(), None, "no timer asked for");
    for th in threads.lock().unwrap().drain(..) {
        th.join().unwrap();
    }
    assert_eq!(woken.load(std::sync::atomic::Ordering::SeqCst), 1, "the thread woke the switch's thread");
    assert_eq!(*polls.lock().unwrap(), [t(1)]);
    sw.run(t(4));
    assert_eq!(*polls.lock().unwrap(), [t(1), t(4)], "polled at the next run");
    sw.run(t(5));
    assert_eq!(polls.lock().unwrap().len(), 2, "once per notification");

    // A burst of notifications before the switch runs costs one wake-up and one poll.
    inject(&mut sw, "off", [3]);
    inject(&mut sw, "off", [4]);
    sw.run(t(6));
    for th in threads.lock().unwrap().drain(..) {
        th.join().unwrap();
    }
    assert_eq!(woken.load(std::sync::atomic::Ordering::SeqCst), 2);
    sw.run(t(7));
    assert_eq!(*polls.lock().unwrap(), [t(1), t(4), t(7)]);
}

/// Registers `flow.<first byte>` meters for every new first byte it sees, counting packets per flow; procedure
/// `forget` unregisters a flow.
struct Flows {
    flows: std::collections::HashMap<u8, Meter>,
}

impl Module for Flows {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        for f in input.drain(..) {
            let key = f.packet().and_then(|p| p.data().first().copied()).unwrap_or(0);
            if let std::collections::hash_map::Entry::Vacant(e) = self.flows.entry(key) {
                let spec = VarSpec::meter("packets_total", ValueType::U64, "packets", "packets of this flow");
                if let Ok(vars) = out.register_vars(&format!("flow.{key}"), &[spec]) {
                    e.insert(vars.meter("packets_total"));
                }
            }
            if let Some(m) = self.flows.get(&key) {
                m.add(1);
            }
        }
    }
    fn execute(&mut self, procedure: &str, argument: &Value, out: &mut Output<'_>) -> Result<Value, String> {
        match (procedure, argument) {
            ("forget", Value::U64(k)) => {
                self.flows.remove(&(*k as u8));
                Ok(Value::Bool(out.unregister_vars(&format!("flow.{k}"))))
            }
            ("steal", Value::Str(prefix)) => out.register_vars(prefix, &[]).map(|_| Value::Bool(true)),
            _ => Err("unknown".into()),
        }
    }
}

fn flows() -> Box<dyn ModuleBuilder> {
    built(&[("in", port_type::ANY)], &[], vec![], |_| Box::new(Flows { flows: Default::default() }))
}

fn exec(sw: &mut Switch, dest: &str, procedure: &str, value: Value, now: Time) -> ControlFrame {
    sw.send_control(ControlFrame {
        op: ControlOp::Exec,
        sender: CONTROL_PLANE.into(),
        dest: dest.into(),
        serial: 99,
        param: procedure.into(),
        value,
    });
    sw.run(now);
    sw.take_control_inbox().pop().expect("a reply")
}

#[test]
fn modules_register_runtime_variables_that_go_away_with_them() {
    let mut sw = Switch::default();
    sw.apply(vec![load("fl", flows()), load("other", flows())]).unwrap();
    let pool = sw.pool().clone();
    let mut batch: Batch = [1u8, 1, 2, 7, 1].iter().map(|b| Frame::Data(pool.alloc_from(&[*b, 0, 0]))).collect();
    sw.inject("fl", "in", &mut batch).unwrap();
    sw.run(t(1));
    let reg = sw.registry().snapshot();
    let counts: Vec<(String, Value)> =
        reg.matching("flow.*.packets_total").map(|(n, c)| (n.to_string(), c.get())).collect();
    assert_eq!(
        counts,
        [
            ("flow.1.packets_total".to_string(), Value::U64(3)),
            ("flow.2.packets_total".to_string(), Value::U64(1)),
            ("flow.7.packets_total".to_string(), Value::U64(1)),
        ]
    );

    // Unregistered by its owner: gone from the registry.
    let r = exec(&mut sw, "fl", "forget", Value::U64(2), t(2));
    assert_eq!((r.op, r.value), (ControlOp::ExecReply, Value::Bool(true)));
    assert!(sw.registry().snapshot().get("flow.2.packets_total").is_none());

    // Another module cannot take a prefix that is owned, nor register outside flow./iface./app.
    let r = exec(&mut sw, "other", "steal", Value::Str("flow.1".into()), t(3));
    assert_eq!(r.op, ControlOp::Error);
    assert!(r.value.to_string().contains("belongs to module fl"), "{:?}", r.value);
    let r = exec(&mut sw, "other", "steal", Value::Str("module.fl".into()), t(3));
    assert_eq!(r.op, ControlOp::Error);

    // Unloading the owner removes what it registered.
    sw.apply(vec![Edit::Unload { name: "fl".into() }]).unwrap();
    assert_eq!(sw.registry().snapshot().matching("flow.**").count(), 0);
}

#[test]
fn a_replace_without_state_handover_drops_the_old_modules_runtime_variables() {
    let mut sw = Switch::default();
    sw.apply(vec![load("fl", flows())]).unwrap();
    let pool = sw.pool().clone();
    let mut batch: Batch = vec![Frame::Data(pool.alloc_from(&[4, 0]))];
    sw.inject("fl", "in", &mut batch).unwrap();
    sw.run(t(1));
    assert!(sw.registry().snapshot().get("flow.4.packets_total").is_some());
    // Flows hands over no state: its runtime variables cannot live on in the new module.
    sw.apply(vec![replace("fl", flows(), true)]).unwrap();
    assert!(sw.registry().snapshot().get("flow.4.packets_total").is_none());
}

/// A two-way module: `down` leads to `to_down` only, `up` to `to_up` only (declared as paths when `declared`).
struct TwoWay;

impl Module for TwoWay {
    fn process(&mut self, port: usize, input: &mut Batch, out: &mut Output<'_>) {
        out.emit_all(port, input);
    }
}

struct TwoWayBuilder {
    declared: bool,
}

impl ModuleBuilder for TwoWayBuilder {
    fn interface(&self) -> ModuleInterface {
        ModuleInterface {
            inputs: ports(&[("down", port_type::ANY), ("up", port_type::ANY)]),
            outputs: ports(&[("to_down", port_type::ANY), ("to_up", port_type::ANY)]),
            vars: vec![],
            breaks_cycles: false,
            accepts_gso: false,
        }
    }
    fn paths(&self) -> Option<Vec<(String, String)>> {
        self.declared.then(|| vec![("down".into(), "to_down".into()), ("up".into(), "to_up".into())])
    }
    fn build(self: Box<Self>, _: &ModuleVars) -> Box<dyn Module> {
        Box::new(TwoWay)
    }
}

#[test]
fn two_way_modules_may_loop_at_module_level_when_no_frame_can_go_round() {
    let two_way = |declared| -> Box<dyn ModuleBuilder> { Box::new(TwoWayBuilder { declared }) };
    let loop_links = || {
        vec![
            link("x[to_down] -> y[down]"),
            link("y[to_up] -> x[up]"),
            link("y[to_down] -> bottom"),
            link("x[to_up] -> top"),
        ]
    };
    let (top, bottom) = (Probe::default(), Probe::default());

    // Without declared paths every input may reach every output: x -> y -> x is a loop, refused.
    let mut sw = Switch::default();
    let mut edits = vec![
        load("x", two_way(false)),
        load("y", two_way(false)),
        load("top", sink(&top)),
        load("bottom", sink(&bottom)),
    ];
    edits.extend(loop_links());
    let e = sw.apply(edits).unwrap_err();
    assert!(e.message.contains("cycle"), "{e}");

    // With them, frames going down stay going down and frames going up stay going up: accepted.
    let mut sw = Switch::default();
    let mut edits = vec![
        load("x", two_way(true)),
        load("y", two_way(true)),
        load("top", sink(&top)),
        load("bottom", sink(&bottom)),
    ];
    edits.extend(loop_links());
    sw.apply(edits).unwrap();
    inject_port(&mut sw, "x", "down", [1, 2]);
    inject_port(&mut sw, "y", "up", [3]);
    for ms in 1..4 {
        sw.run(t(ms));
    }
    assert_eq!(bottom.seqs(), [1, 2]);
    assert_eq!(top.seqs(), [3]);

    // A real loop through the declared paths is still refused: y[to_down] back into x[down].
    let e = sw.apply(vec![link("y[to_down] -> x[down]")]).unwrap_err();
    assert!(e.message.contains("cycle"), "{e}");
}

fn inject_port(sw: &mut Switch, module: &str, port: &str, seqs: impl IntoIterator<Item = u64>) {
    let pool = sw.pool().clone();
    let mut batch = packets(&pool, seqs);
    sw.inject(module, port, &mut batch).unwrap();
}

// ---------------------------------------------------------------------------------------------------------------
// Bookkeeping of work: only modules with input, a due timer or (faces) output are visited
// ---------------------------------------------------------------------------------------------------------------

/// Logs its name on every process call and forwards what it gets; polls count in `polls` and ask for the next poll
/// `period` later (never, when `None`).
struct Named {
    name: String,
    log: Log<String>,
    polls: Arc<Mutex<u64>>,
    period: Option<std::time::Duration>,
    probe: Probe,
}

impl Module for Named {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        self.log.lock().unwrap().push(self.name.clone());
        for f in input.iter() {
            self.probe.record(f);
        }
        out.emit_all(0, input);
    }
    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        *self.polls.lock().unwrap() += 1;
        self.period.map(|p| out.now() + p)
    }
}

#[derive(Clone, Default)]
struct NamedLog {
    log: Log<String>,
    polls: Arc<Mutex<u64>>,
    probe: Probe,
}

fn named(name: &str, log: &NamedLog, period: Option<std::time::Duration>) -> Box<dyn ModuleBuilder> {
    let (name, log) = (name.to_string(), log.clone());
    built(&[("in", port_type::ANY)], &[("out", port_type::ANY)], vec![], move |_| {
        Box::new(Named { name, log: log.log, polls: log.polls, period, probe: log.probe })
    })
}

#[test]
fn a_module_with_a_timer_far_away_is_not_polled_while_others_work() {
    let mut sw = Switch::default();
    let (far, near) = (NamedLog::default(), NamedLog::default());
    let probe = Probe::default();
    sw.apply(vec![
        load("far", named("far", &far, Some(std::time::Duration::from_secs(3600)))),
        load("near", named("near", &near, Some(std::time::Duration::from_millis(10)))),
        load("sink", sink(&probe)),
        link("near -> sink"),
    ])
    .unwrap();
    sw.run(Time::ZERO);
    assert_eq!((*far.polls.lock().unwrap(), *near.polls.lock().unwrap()), (1, 1), "every module is polled once");
    assert_eq!(sw.next_wakeup(), Some(Time::from_millis(10)));
    for ms in 1..=100u64 {
        inject(&mut sw, "near", [ms]);
        sw.run(Time::from_millis(ms));
    }
    assert_eq!(*far.polls.lock().unwrap(), 1, "the far timer is not due: never polled again");
    assert_eq!(meter(&sw, "module.far.calls_total"), 1);
    assert_eq!(*near.polls.lock().unwrap(), 11, "polled at 0, 10, ..., 100 ms");
    assert_eq!(probe.seqs(), (1..=100).collect::<Vec<_>>());
    assert_eq!(sw.next_wakeup(), Some(Time::from_millis(110)));
    // Pausing the near one leaves the far timer as the next wake-up; resuming brings the near one back.
    sw.apply(vec![pause(Some("near"))]).unwrap();
    assert_eq!(sw.next_wakeup(), Some(Time::from_millis(3_600_000)));
    sw.apply(vec![resume(Some("near"))]).unwrap();
    assert_eq!(sw.next_wakeup(), Some(Time::from_millis(110)));
}

#[test]
fn only_modules_with_input_run_in_topological_order() {
    let mut sw = Switch::default();
    let log = NamedLog::default();
    let idle = NamedLog::default();
    // Loaded out of order: c, b, a; linked a -> b -> c; 200 idle modules in between.
    let mut edits = vec![load("c", named("c", &log, None)), load("b", named("b", &log, None))];
    edits.extend((0..200).map(|k| load(&format!("idle{k}"), named("idle", &idle, None))));
    edits.extend([load("a", named("a", &log, None)), link("a -> b"), link("b -> c")]);
    sw.apply(edits).unwrap();
    sw.run(Time::ZERO);
    let calls_after_load = meter(&sw, "module.idle7.calls_total");
    inject(&mut sw, "c", [100]);
    inject(&mut sw, "a", [1]);
    assert!(sw.has_pending());
    let calls = sw.run(Time::from_millis(1));
    assert_eq!(calls, 3, "a, b and c once each; no idle module called");
    assert_eq!(*log.log.lock().unwrap(), ["a", "b", "c"], "in topological order, c once with both frames");
    assert_eq!(log.probe.seqs(), [1, 1, 100, 1], "a and b saw 1; c its own frame first, then a's");
    assert!(idle.log.lock().unwrap().is_empty());
    assert_eq!(meter(&sw, "module.idle7.calls_total"), calls_after_load);
    assert!(!sw.has_pending());
    assert_eq!(sw.run(Time::from_millis(2)), 0, "nothing to do: no call");
}

#[test]
fn a_queue_emits_what_it_holds_when_its_timer_comes() {
    let mut sw = Switch::default();
    let log = NamedLog::default();
    let probe = Probe::default();
    sw.apply(vec![
        load("a", named("a", &log, None)),
        load("q", queue()),
        load("sink", sink(&probe)),
        link("a -> q"),
        link("q -> sink"),
    ])
    .unwrap();
    sw.run(Time::ZERO);
    assert_eq!(sw.next_wakeup(), Some(Time::from_millis(1)), "the queue polled at 0 asks for 1 ms");
    sw.run(Time::ZERO + std::time::Duration::from_micros(500));
    assert_eq!(sw.next_wakeup(), Some(Time::from_millis(1)), "not due yet: not polled");
    inject(&mut sw, "a", [5]);
    sw.run(Time::from_millis(1));
    assert!(probe.seqs().is_empty(), "polled before the frame arrived: held until the next poll");
    assert_eq!(sw.next_wakeup(), Some(Time::from_millis(2)));
    sw.run(Time::from_millis(2));
    assert_eq!(probe.seqs(), [5]);
    assert_eq!(sw.next_wakeup(), Some(Time::from_millis(3)));
}

/// A face over /dev/null: the switch only needs it to have a device.
struct NullDevice(std::fs::File);

impl FaceDevice for NullDevice {
    fn name(&self) -> &str {
        "null"
    }
    fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.0.as_fd()
    }
    fn read_packet(&self, _buf: &mut Vec<u8>) -> std::io::Result<bool> {
        Ok(false)
    }
    fn write_packet(&self, _packet: &[u8]) -> std::io::Result<()> {
        Ok(())
    }
}

struct NullFace(Arc<NullDevice>, Batch);

impl Module for NullFace {
    fn process(&mut self, _port: usize, input: &mut Batch, _out: &mut Output<'_>) {
        self.1.append(input);
    }
    fn device(&self) -> Option<Arc<dyn FaceDevice>> {
        Some(self.0.clone())
    }
    fn take_egress(&mut self, into: &mut Batch) {
        into.append(&mut self.1);
    }
}

fn null_face() -> Box<dyn ModuleBuilder> {
    let dev = Arc::new(NullDevice(std::fs::File::open("/dev/null").unwrap()));
    built(&[("in", port_type::ANY)], &[("out", port_type::ANY)], vec![], move |_| Box::new(NullFace(dev, Vec::new())))
}

#[test]
fn only_faces_that_were_called_are_listed_for_egress() {
    let mut sw = Switch::default();
    sw.apply(vec![load("f1", null_face()), load("f2", null_face()), load("p", pass())]).unwrap();
    let (f1, f2) = (sw.index_of("f1").unwrap(), sw.index_of("f2").unwrap());
    let mut ready = Vec::new();
    sw.take_egress_ready(&mut ready);
    assert_eq!(ready, [f1, f2], "after an edit every face is listed");
    sw.run(Time::ZERO);
    sw.take_egress_ready(&mut ready);
    assert_eq!(ready, [f1, f2], "both polled after load");
    sw.run(Time::from_millis(1));
    sw.take_egress_ready(&mut ready);
    assert!(ready.is_empty(), "nothing called: nothing listed");
    inject(&mut sw, "f2", [3, 4]);
    inject(&mut sw, "p", [9]);
    sw.run(Time::from_millis(2));
    sw.take_egress_ready(&mut ready);
    assert_eq!(ready, [f2]);
    let mut out = Vec::new();
    sw.face_egress(f2, &mut out);
    assert_eq!(out.len(), 2);
    sw.take_egress_ready(&mut ready);
    assert!(ready.is_empty());
}

// ---------------------------------------------------------------------------------------------------------------
// GSO super-packets
// ---------------------------------------------------------------------------------------------------------------

/// A stateless pass-through that takes GSO super-packets whole if `gso`.
fn forward(gso: bool) -> Box<dyn ModuleBuilder> {
    struct Forward;
    impl Module for Forward {
        fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
            out.emit_all(0, input);
        }
    }
    Box::new(Built {
        iface: ModuleInterface {
            inputs: ports(&[("in", port_type::ANY)]),
            outputs: ports(&[("out", port_type::ANY)]),
            vars: vec![],
            breaks_cycles: false,
            accepts_gso: gso,
        },
        make: Box::new(|_| Box::new(Forward)),
    })
}

#[test]
fn super_packets_are_cut_only_before_a_module_that_does_not_take_them() {
    use crate::frame::Gso;
    let mut sw = Switch::default();
    let (whole_edit, whole_log) = crate::testing::Recorder::load("seen_whole");
    let (cut_edit, cut_log) = crate::testing::Recorder::load("seen_cut");
    sw.apply(vec![
        load("whole", forward(true)),
        load("cut", forward(false)),
        whole_edit,
        cut_edit,
        link("whole -> seen_whole"),
        link("whole -> cut"),
        link("cut -> seen_cut"),
    ])
    .unwrap();
    let mut batch = vec![Frame::Data(super_packet(&sw))];
    sw.inject("whole", "in", &mut batch).unwrap();
    sw.run(Time::ZERO);
    let whole = crate::testing::take(&whole_log);
    assert_eq!(whole.len(), 1, "a module that takes super-packets gets it whole");
    assert_eq!(whole[0].data.len(), 2540);
    assert!(Gso::of(&whole[0].meta).is_some());
    let cut = crate::testing::take(&cut_log);
    let lens: Vec<usize> = cut.iter().map(|s| s.data.len()).collect();
    assert_eq!(lens, [1040, 1040, 540], "cut before the module that does not (the recorder after it takes them)");
    assert!(cut.iter().all(|s| Gso::of(&s.meta).is_none()));
    assert_eq!(meter(&sw, "switch.gso_cut_total"), 1);
    assert_eq!(meter(&sw, "switch.gso_mismatch_total"), 0);
    assert_eq!(meter(&sw, "module.cut.frames_in_total"), 3, "the module's meters count the segments it saw");
}

/// A super-packet of 2,540 bytes (IPv4 + TCP headers and 2,500 bytes cut into segments of 1,000).
fn super_packet(sw: &Switch) -> crate::frame::Packet {
    use crate::frame::{Gso, GsoKind};
    let mut d = vec![0u8; 2540];
    d[0] = 0x45;
    d[2..4].copy_from_slice(&2540u16.to_be_bytes());
    d[9] = 6;
    d[32] = 5 << 4;
    let gso = Gso { kind: GsoKind::TcpV4, gso_size: 1000, hdr_len: 40, csum_start: 20, l3_offset: 0, ecn: false };
    let mut p = sw.pool().alloc_from(&d);
    p.meta_mut().set(MetaKey::GSO, gso.pack());
    p
}

#[test]
fn a_super_packet_injected_before_a_module_that_does_not_take_them_is_cut() {
    let mut sw = Switch::default();
    let (cut_edit, cut_log) = crate::testing::Recorder::load("seen_cut");
    let edits = vec![load("cut", forward(false)), load("cut2", forward(false)), cut_edit];
    sw.apply(edits.into_iter().chain([link("cut -> cut2"), link("cut2 -> seen_cut")]).collect()).unwrap();
    let mut batch = vec![Frame::Data(super_packet(&sw))];
    sw.inject("cut", "in", &mut batch).unwrap();
    sw.run(Time::ZERO);
    let lens: Vec<usize> = crate::testing::take(&cut_log).iter().map(|s| s.data.len()).collect();
    assert_eq!(lens, [1040, 1040, 540]);
    assert_eq!(meter(&sw, "switch.gso_cut_total"), 1, "cut once, before the first module; the second sees segments");
}
