//! `shape`: token buckets on the byte stream, in bytes/s, per direction: one per flow (`per = "flow"`) or one shared
//! by every flow the module works on (`per = "app"`: an app's chain has its own modules, so that is the app's rate).
//! trickle's job, done outside the app.
//!
//! - A bucket holds up to `burst` bytes of tokens and gains `rate` a second. A `Data` chunk leaves when its bucket
//!   is not in debt, and takes its length from it (the bucket may go below 0, so a chunk larger than `burst` still
//!   leaves, and the average is exactly `rate`); otherwise it waits, and the module asks to be polled when the debt
//!   is paid (`out.wake_at`). With `per = "app"` the flows waiting take turns, one chunk each.
//! - A `Fin` waits behind its direction's data; `Open`, `Ack` and the frames of flows its `select` rules left out
//!   are never held. An `Abort` passes at once and discards what was held for the flow.
//! - Bounds: it holds at most what the producer upstream may have in flight, the flow's budget (256 KiB by default,
//!   docs/streams.md) per direction, since it passes acks unchanged and only bytes that left it are acked.
//! - `rate` and `burst` are knobs (`rate = 0`: no limit, everything held leaves at once); so is `active` (false:
//!   out of the path, as at `rate = 0`; true: the buckets apply again, starting full).

use super::active;
use super::flows::{read_select, slot, Flows, HandedFlows, Seen, SelectRule, SelectionMeters, SELECT, SELECT_DOC};
use crate::stream::{u64_meters, BOTH_WAYS_IN, BOTH_WAYS_OUT};
use flexstack_core::module::handed_over;
use flexstack_core::{
    field, kind_from_decl, Batch, ConfigError, Frame, KindDecl, Meter, Module, ModuleBuilder, ModuleInterface,
    ModuleKind, ModuleVars, Output, Packet, Param, Settings, Time, Value,
};
use std::collections::VecDeque;
use std::time::Duration;

/// The kind's name in stack files.
pub const KIND: &str = "shape";

/// The shortest wait it asks for (a smaller debt is paid by then anyway).
const MIN_WAIT: Duration = Duration::from_micros(100);

/// The `shape` module kind.
pub struct ShapeKind;

/// Settings and knobs.
struct Config {
    rate: u64,
    burst: u64,
    per_app: bool,
    active: bool,
}

type P = Param<Config>;

/// The kind: ports, settings, knobs and meters.
const DECL: KindDecl<Config, Meters> = KindDecl {
    inputs: BOTH_WAYS_IN,
    outputs: BOTH_WAYS_OUT,
    params: &[
        P::u64("rate", "bytes/s", "each bucket's rate, per direction (0: no limit)", 0, field!(rate)).range(0.0, 1e11),
        P::u64(
            "burst",
            "bytes",
            "most tokens a bucket holds (what may leave at once after a pause)",
            16384,
            field!(burst),
        )
        .range(1.0, 1e9),
        P::text(
            "per",
            "flow: a bucket per flow and direction; app: one per direction shared by every flow of the module",
            "flow",
            |c| if c.per_app { "app".into() } else { "flow".into() },
            |c, t| {
                c.per_app = match t {
                    "flow" => false,
                    "app" => true,
                    _ => return Err(format!("expected flow or app, got {t:?}")),
                };
                Ok(())
            },
        )
        .setting(),
        active::param(field!(active)),
        P::manual(SELECT, "array of strings", SELECT_DOC, "[\"use *\"]"),
    ],
    meters: u64_meters![
        held: "held_bytes", "bytes", "bytes waiting for tokens now";
        delayed: "delayed_total", "frames", "data chunks that had to wait";
        down: "bytes_down_total", "bytes", "bytes of chosen flows sent on down";
        up: "bytes_up_total", "bytes", "bytes of chosen flows sent on up";
    ],
    more_meters: SelectionMeters::specs,
    breaks_cycles: true,
    // A bucket per app is shared by the app's flows: the stack runs on one data-plane worker.
    global_view: true,
    ..KindDecl::new(KIND, "a stream service: token buckets per flow or per app, per direction, in bytes/s")
};

/// The meters.
#[derive(Default)]
struct Meters {
    held: Meter,
    delayed: Meter,
    down: Meter,
    up: Meter,
}

impl ModuleKind for ShapeKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(KIND);
        let mut cfg = Config { rate: 0, burst: 0, per_app: false, active: true };
        DECL.read(&mut r, &mut cfg)?;
        let rules = read_select(&mut r)?;
        r.finish()?;
        Ok(Box::new(ShapeBuilder { cfg, rules }))
    }
}

struct ShapeBuilder {
    cfg: Config,
    rules: Vec<SelectRule>,
}

impl ModuleBuilder for ShapeBuilder {
    fn interface(&self) -> ModuleInterface {
        DECL.interface(&self.cfg)
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        DECL.publish(&self.cfg, vars);
        Box::new(Shape {
            cfg: self.cfg,
            m: DECL.meters(vars),
            flows: Flows::new(self.rules, vars),
            app: Default::default(),
            backlog: Default::default(),
            held: 0,
        })
    }
}

/// A token bucket.
#[derive(Default)]
struct Bucket {
    tokens: f64,
    last: Option<Time>,
}

impl Bucket {
    /// Adds the tokens earned since the last refill (a new bucket starts full).
    fn refill(&mut self, now: Time, rate: u64, burst: u64) {
        self.tokens = match self.last {
            None => burst as f64,
            Some(t) => (self.tokens + now.saturating_since(t).as_secs_f64() * rate as f64).min(burst as f64),
        };
        self.last = Some(now);
    }

    /// How long until the debt is paid.
    fn wait(&self, rate: u64) -> Duration {
        Duration::from_secs_f64((-self.tokens).max(0.0) / rate.max(1) as f64).max(MIN_WAIT)
    }
}

/// One flow: what waits, per direction, and its buckets.
#[derive(Default)]
struct ShapeFlow {
    queue: [VecDeque<Packet>; 2],
    bucket: [Bucket; 2],
}

/// What a `shape` hands its replacement: its flows with what waits, its buckets and turns.
struct ShapeState {
    flows: HandedFlows<ShapeFlow>,
    app: [Bucket; 2],
    backlog: [VecDeque<u64>; 2],
    held: u64,
}

/// A running `shape`.
pub struct Shape {
    cfg: Config,
    m: Meters,
    flows: Flows<ShapeFlow>,
    /// The app's buckets (`per = "app"`).
    app: [Bucket; 2],
    /// Per direction, the flows with frames waiting, in turn.
    backlog: [VecDeque<u64>; 2],
    held: u64,
}

impl Shape {
    /// Sends what the buckets allow; returns when to look again, if anything still waits.
    fn release(&mut self, now: Time, out: &mut Output<'_>) -> Option<Time> {
        // Out of the path: no limit.
        let rate = if self.cfg.active { self.cfg.rate } else { 0 };
        let (burst, per_app) = (self.cfg.burst, self.cfg.per_app);
        let mut next: Option<Duration> = None;
        for d in 0..2 {
            let mut blocked = 0;
            while let Some(&flow) = self.backlog[d].front() {
                let Some(st) = self.flows.get_mut(flow) else {
                    self.backlog[d].pop_front(); // the flow ended
                    continue;
                };
                let Some(front) = st.queue[d].front() else {
                    self.backlog[d].pop_front();
                    continue;
                };
                let len = front.len() as u64;
                if rate > 0 && len > 0 {
                    let bucket = if per_app { &mut self.app[d] } else { &mut st.bucket[d] };
                    bucket.refill(now, rate, burst);
                    if bucket.tokens < 0.0 {
                        let wait = bucket.wait(rate);
                        next = Some(next.map_or(wait, |n| n.min(wait)));
                        if per_app {
                            break;
                        }
                        blocked += 1;
                        if blocked >= self.backlog[d].len() {
                            break;
                        }
                        self.backlog[d].rotate_left(1);
                        continue;
                    }
                    bucket.tokens -= len as f64;
                }
                blocked = 0;
                let p = st.queue[d].pop_front().expect("looked at");
                let emptied = st.queue[d].is_empty();
                self.held -= len;
                let fin = p.stream_kind() == Some(flexstack_core::stream::StreamKind::Fin);
                let dir = p.direction();
                out.emit(0, p);
                if len > 0 {
                    if d == 0 { &self.m.down } else { &self.m.up }.add(len);
                }
                if fin {
                    self.flows.fin(flow, dir);
                }
                if emptied {
                    self.backlog[d].pop_front();
                } else if per_app {
                    self.backlog[d].rotate_left(1); // the next flow's turn
                }
            }
        }
        self.m.held.set(self.held);
        next.map(|w| now + w)
    }
}

/// What to do with a frame, decided before the frame moves.
enum Step {
    Pass,
    Hold(u64),
    Aborted(ShapeFlow),
}

impl Module for Shape {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        let now = out.now();
        for frame in input.drain(..) {
            let Frame::Data(p) = frame else {
                out.emit(0, frame);
                continue;
            };
            let step = match self.flows.see(&p, |_| ShapeFlow::default()) {
                (Seen::Data(flow) | Seen::Fin(flow), _) => Step::Hold(flow),
                (Seen::Aborted(_), Some(st)) => Step::Aborted(st),
                _ => Step::Pass,
            };
            match step {
                Step::Pass => out.emit(0, p),
                Step::Aborted(st) => {
                    let dropped: u64 = st.queue.iter().flatten().map(|q| q.len() as u64).sum();
                    self.held -= dropped;
                    out.emit(0, p);
                }
                Step::Hold(flow) => {
                    let d = slot(p.direction());
                    let st = self.flows.get_mut(flow).expect("seen");
                    if st.queue[d].is_empty() {
                        self.backlog[d].push_back(flow);
                    } else if !p.is_empty() {
                        self.m.delayed.add(1);
                    }
                    self.held += p.len() as u64;
                    st.queue[d].push_back(p);
                }
            }
        }
        if let Some(t) = self.release(now, out) {
            out.wake_at(t);
        }
    }

    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        let now = out.now();
        self.release(now, out)
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        let was = self.cfg.active;
        DECL.write(&mut self.cfg, knob, value)?;
        if self.cfg.active && !was {
            // Back in the path: the buckets start full, as new ones do (no debt from the time out of it).
            self.app = Default::default();
            for (_, st) in self.flows.iter_mut() {
                st.bucket = Default::default();
            }
        }
        Ok(())
    }

    fn take_state(&mut self) -> Option<Box<dyn std::any::Any>> {
        Some(Box::new(ShapeState {
            flows: self.flows.take(),
            app: std::mem::take(&mut self.app),
            backlog: std::mem::take(&mut self.backlog),
            held: std::mem::replace(&mut self.held, 0),
        }))
    }

    fn adopt_state(&mut self, state: Box<dyn std::any::Any>) -> Result<(), String> {
        let s: ShapeState = handed_over(state, "a shape's state")?;
        self.flows.adopt(s.flows);
        (self.app, self.backlog, self.held) = (s.app, s.backlog, s.held);
        self.m.held.set(self.held); // what waits leaves from the poll every new module gets
        Ok(())
    }
}
