//! The functional units: their catalogue (names, signatures, documentation), their compiled form ([`Node`]) and
//! their runtime state and evaluation.
//!
//! The checker ([`mod@crate::compile`]) turns each call in a rule into a [`Node`]; the engine ([`crate::engine`])
//! instantiates nodes as units (the private `Unit`: key, kind, state `Core`, inputs; with a `Hot` entry for
//! what the evaluation loop touches) and evaluates one with `compute` (or `compute_stateless`) once its inputs
//! have values. A unit keeps private state between evaluations (History its samples, EWMA its average,
//! Threshold its side of the band); when a rule is rewired, `Core::adopt` hands the old unit's state to the new
//! one of the same kind.
//!
//! Every unit outputs an optional value: `None` until it has one (an aggregate over an empty window, a comparison
//! with a missing input, a meter that does not exist). Numbers are `f64` inside the units; `Count` and `Timer`
//! output `u64`; literals keep their written type.

use crate::env::Environment;
use flexstack_core::{Time, Value};
use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};

/// Most samples a window keeps, whatever its duration (bounds memory for time windows on fast meters).
pub const MAX_SAMPLES: usize = 65_536;

/// The kinds of functional units. Each variant says its arguments, its output and when that changes; the
/// same text is in [`CATALOG`] and in docs/rules.md. "On evaluation" means each time the unit is computed in a
/// query (see [`crate::engine`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum UnitKind {
    /// `get("name")`: a meter's or knob's current value; read on every query, and sampled on every `advance`
    /// as an event source (emits when the value changed). No output while the variable does not exist.
    Get,
    /// `set("name", value)`: writes its input to a knob (returned by `advance`), on a triggered evaluation or
    /// when the value differs from the last one it wrote; outputs that value.
    Set,
    /// `Constant(literal)`: the literal, always (literal arguments of other units become Constants).
    Constant,
    /// `Forwarder(x)`: x, unchanged.
    Forwarder,
    /// `Timer(period)`: period a duration or a number of milliseconds; outputs its tick count (u64), one more
    /// every period (one tick per `advance` however late), and emits on each tick.
    Timer,
    /// `History(x, window)`: records numeric x on each evaluation into a window of N samples or of a duration;
    /// outputs the newest sample. Aggregates given a History read its window.
    History,
    /// `Avg(x, window)` or `Avg(history)`: the mean of the window, on evaluation.
    Avg,
    /// `Min(x, window)` or `Min(history)`: the smallest sample of the window.
    Min,
    /// `Max(x, window)` or `Max(history)`: the largest sample of the window.
    Max,
    /// `Sum(x, window)` or `Sum(history)`: the sum of the window's samples.
    Sum,
    /// `Count(x, window)` or `Count(history)`: how many samples the window holds (u64).
    Count,
    /// `Rate(x)` / `Derivative(x)`: change of x per second between its last two evaluations at different
    /// times; no output before the second.
    Rate,
    /// `EWMA(x, alpha)`: `alpha * x + (1 - alpha) * previous` on each evaluation (the first sample as is).
    Ewma,
    /// `Less(a, b)`: a < b (numbers); no output while an input has none.
    Less,
    /// `Greater(a, b)`: a > b (numbers).
    Greater,
    /// `Equal(a, b)`: a == b, numbers compared as numbers whatever their type.
    Equal,
    /// `And(a, b, ...)`: true if every input is true.
    And,
    /// `Or(a, b, ...)`: true if any input is true.
    Or,
    /// `Not(a)`: the negation of a.
    Not,
    /// `If(c, then, else)`: then if c is true, else otherwise.
    If,
    /// `Threshold(x, high, low)`: hysteresis; true once x > high, false once x < low, unchanged in between
    /// (false at first).
    Threshold,
    /// `Changed(x)`: true if x differs from its value at the previous evaluation.
    Changed,
    /// `Cache(x, validity)`: x, but a query within `validity` of the last one that reached x answers with the
    /// cached value (the paper's per-unit cache validity).
    Cache,
}

/// What a unit is, for the checker, the docs and error messages.
#[derive(Clone, Copy, Debug)]
pub struct UnitInfo {
    /// The kind.
    pub kind: UnitKind,
    /// The canonical name.
    pub name: &'static str,
    /// Other accepted names (matching is case-insensitive in any case).
    pub aliases: &'static [&'static str],
    /// The arguments, as shown in errors.
    pub signature: &'static str,
    /// Arguments: fewest and most (`usize::MAX`: any number).
    pub arity: (usize, usize),
    /// Output type.
    pub output: Ty,
    /// One line: what it outputs and when.
    pub doc: &'static str,
}

/// The static type of an expression, as far as the checker knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Ty {
    /// A number (u64, i64 or f64).
    Num,
    /// true / false.
    Bool,
    /// Text.
    Str,
    /// Not known before running (a meter's value, an If with mixed branches).
    Any,
}

impl Ty {
    /// The name used in errors.
    pub fn name(self) -> &'static str {
        match self {
            Ty::Num => "a number",
            Ty::Bool => "a boolean",
            Ty::Str => "a string",
            Ty::Any => "any value",
        }
    }

    /// The type of a literal.
    pub fn of(v: &Value) -> Ty {
        match v {
            Value::Bool(_) => Ty::Bool,
            Value::Str(_) => Ty::Str,
            _ => Ty::Num,
        }
    }

    /// True if a value of type `self` may be used where `want` is expected.
    pub fn fits(self, want: Ty) -> bool {
        self == Ty::Any || want == Ty::Any || self == want
    }
}

/// The unit catalogue, in the order of docs/rules.md.
pub const CATALOG: &[UnitInfo] = &[
    UnitInfo { kind: UnitKind::Get, name: "get", aliases: &[], signature: "get(\"name\")", arity: (1, 1), output: Ty::Any, doc: "the current value of a meter or knob; read on every query, sampled by the engine for events (emits when it changes)" },
    UnitInfo { kind: UnitKind::Set, name: "set", aliases: &[], signature: "set(\"name\", value)", arity: (2, 2), output: Ty::Any, doc: "writes value to a knob when evaluated: on every triggered evaluation, otherwise when the value differs from the last one written; outputs the value" },
    UnitInfo { kind: UnitKind::Constant, name: "Constant", aliases: &[], signature: "Constant(literal)", arity: (1, 1), output: Ty::Any, doc: "a fixed value (literal arguments become Constant units)" },
    UnitInfo { kind: UnitKind::Forwarder, name: "Forwarder", aliases: &[], signature: "Forwarder(x)", arity: (1, 1), output: Ty::Any, doc: "outputs its input unchanged (for benchmarks and for naming a value)" },
    UnitInfo { kind: UnitKind::Timer, name: "Timer", aliases: &[], signature: "Timer(period)", arity: (1, 1), output: Ty::Num, doc: "counts ticks: every period (a duration, or a number of milliseconds) its tick count grows by one and it emits" },
    UnitInfo { kind: UnitKind::History, name: "History", aliases: &[], signature: "History(x, window)", arity: (2, 2), output: Ty::Num, doc: "records x on each evaluation into a window of the last N samples or of a duration; outputs the newest sample" },
    UnitInfo { kind: UnitKind::Avg, name: "Avg", aliases: &["Average", "Mean"], signature: "Avg(x, window) or Avg(History(...))", arity: (1, 2), output: Ty::Num, doc: "the mean of the window (its own, or the History it reads)" },
    UnitInfo { kind: UnitKind::Min, name: "Min", aliases: &[], signature: "Min(x, window) or Min(History(...))", arity: (1, 2), output: Ty::Num, doc: "the smallest sample of the window" },
    UnitInfo { kind: UnitKind::Max, name: "Max", aliases: &[], signature: "Max(x, window) or Max(History(...))", arity: (1, 2), output: Ty::Num, doc: "the largest sample of the window" },
    UnitInfo { kind: UnitKind::Sum, name: "Sum", aliases: &[], signature: "Sum(x, window) or Sum(History(...))", arity: (1, 2), output: Ty::Num, doc: "the sum of the window's samples" },
    UnitInfo { kind: UnitKind::Count, name: "Count", aliases: &[], signature: "Count(x, window) or Count(History(...))", arity: (1, 2), output: Ty::Num, doc: "how many samples the window holds" },
    UnitInfo { kind: UnitKind::Rate, name: "Rate", aliases: &["Derivative"], signature: "Rate(x)", arity: (1, 1), output: Ty::Num, doc: "change of x per second between its last two evaluations at different times" },
    UnitInfo { kind: UnitKind::Ewma, name: "EWMA", aliases: &[], signature: "EWMA(x, alpha)", arity: (2, 2), output: Ty::Num, doc: "exponentially weighted moving average: avg = alpha * x + (1 - alpha) * avg, 0 < alpha <= 1" },
    UnitInfo { kind: UnitKind::Less, name: "Less", aliases: &[], signature: "Less(a, b)", arity: (2, 2), output: Ty::Bool, doc: "a < b" },
    UnitInfo { kind: UnitKind::Greater, name: "Greater", aliases: &[], signature: "Greater(a, b)", arity: (2, 2), output: Ty::Bool, doc: "a > b" },
    UnitInfo { kind: UnitKind::Equal, name: "Equal", aliases: &[], signature: "Equal(a, b)", arity: (2, 2), output: Ty::Bool, doc: "a == b (numbers compared as numbers, whatever their integer or float type)" },
    UnitInfo { kind: UnitKind::And, name: "And", aliases: &[], signature: "And(a, b, ...)", arity: (2, usize::MAX), output: Ty::Bool, doc: "true if every input is true" },
    UnitInfo { kind: UnitKind::Or, name: "Or", aliases: &[], signature: "Or(a, b, ...)", arity: (2, usize::MAX), output: Ty::Bool, doc: "true if any input is true" },
    UnitInfo { kind: UnitKind::Not, name: "Not", aliases: &[], signature: "Not(a)", arity: (1, 1), output: Ty::Bool, doc: "the negation of a" },
    UnitInfo { kind: UnitKind::If, name: "If", aliases: &[], signature: "If(condition, then, else)", arity: (3, 3), output: Ty::Any, doc: "then when the condition is true, else otherwise" },
    UnitInfo { kind: UnitKind::Threshold, name: "Threshold", aliases: &["Hysteresis"], signature: "Threshold(x, high, low)", arity: (3, 3), output: Ty::Bool, doc: "hysteresis: becomes true when x > high, false when x < low, keeps its last output in between (false at first)" },
    UnitInfo { kind: UnitKind::Changed, name: "Changed", aliases: &[], signature: "Changed(x)", arity: (1, 1), output: Ty::Bool, doc: "true when x differs from its value at the previous evaluation" },
    UnitInfo { kind: UnitKind::Cache, name: "Cache", aliases: &[], signature: "Cache(x, validity)", arity: (2, 2), output: Ty::Any, doc: "query cache: answers with its last value without querying x until validity has passed since it last did" },
];

/// The catalogue entry of a unit name (case-insensitive, aliases included).
pub fn lookup(name: &str) -> Option<&'static UnitInfo> {
    CATALOG.iter().find(|u| u.name.eq_ignore_ascii_case(name) || u.aliases.iter().any(|a| a.eq_ignore_ascii_case(name)))
}

/// The catalogue entry of a kind.
pub fn info(kind: UnitKind) -> &'static UnitInfo {
    CATALOG.iter().find(|u| u.kind == kind).expect("every kind is catalogued")
}

/// A window: a count of samples, a duration, or (for aggregates) the window of the History they read.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Window {
    /// The last N samples.
    Samples(usize),
    /// The samples of the last N nanoseconds (at most [`MAX_SAMPLES`]).
    Duration(u64),
    /// The input is a History: use its samples.
    Input,
}

/// A compiled unit's fixed parameter.
#[derive(Clone, Debug, PartialEq)]
pub enum Param {
    /// None.
    None,
    /// A variable name (get, set).
    Name(String),
    /// A constant.
    Value(Value),
    /// A window.
    Window(Window),
    /// A period or validity in nanoseconds.
    Nanos(u64),
    /// EWMA's alpha.
    Alpha(f64),
    /// Threshold's band.
    Band {
        /// Becomes true above this.
        high: f64,
        /// Becomes false below this.
        low: f64,
    },
}

/// A compiled expression: a unit with its inputs, or a reference to another rule's output.
#[derive(Clone, Debug, PartialEq)]
pub enum Node {
    /// A unit.
    Unit {
        /// Its kind.
        kind: UnitKind,
        /// Its parameter.
        param: Param,
        /// Its input expressions.
        args: Vec<Node>,
    },
    /// The output of the named rule.
    Ref(String),
}

/// Shows a value as the language writes it.
pub fn show_value(v: &Value) -> String {
    match v {
        Value::Str(s) => quote(s),
        Value::F64(x) if x.fract() == 0.0 && x.abs() < 1e15 => format!("{x:.1}"),
        Value::F64(x) if *x != 0.0 && (x.abs() < 1e-4 || x.abs() >= 1e15) => format!("{x:e}"),
        other => other.to_string(),
    }
}

/// A string literal: in double quotes, with `"`, `\`, newline and tab escaped.
pub fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Shows a duration as a literal (`200ms`).
pub fn show_nanos(ns: u64) -> String {
    flexstack_core::time::format_nanos(ns)
}

impl Node {
    /// The expression as rule text (parsing it gives the same node back).
    pub fn render(&self) -> String {
        match self {
            Node::Ref(name) => name.clone(),
            Node::Unit { kind: UnitKind::Constant, param: Param::Value(v), .. } => show_value(v),
            Node::Unit { kind, param, args } => {
                let mut parts: Vec<String> = Vec::new();
                if let Param::Name(n) = param {
                    parts.push(quote(n));
                }
                parts.extend(args.iter().map(Node::render));
                match param {
                    Param::Window(Window::Samples(n)) => parts.push(n.to_string()),
                    Param::Window(Window::Duration(ns)) | Param::Nanos(ns) => parts.push(show_nanos(*ns)),
                    Param::Alpha(a) => parts.push(show_value(&Value::F64(*a))),
                    Param::Band { high, low } => {
                        parts.push(show_value(&Value::F64(*high)));
                        parts.push(show_value(&Value::F64(*low)));
                    }
                    _ => {}
                }
                format!("{}({})", info(*kind).name, parts.join(", "))
            }
        }
    }
}

/// Which aggregate an aggregating unit computes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum AggOp {
    Avg,
    Min,
    Max,
    Sum,
    Count,
}

/// A unit's behaviour and private state.
#[derive(Debug, Default)]
pub(crate) enum Core {
    /// A slot being evaluated (its core is taken out for the duration).
    #[default]
    Vacant,
    Get {
        name: String,
    },
    Set {
        name: String,
        last_written: Option<Value>,
        writes: u64,
        error: Option<String>,
    },
    Constant(Value),
    /// A unit without state (Forwarder, the comparisons, the logic, If), evaluated by [`compute_stateless`].
    Stateless(Op),
    Timer {
        period: u64,
        next_due: Option<Time>,
        ticks: u64,
    },
    History {
        window: Window,
        samples: VecDeque<(Time, f64)>,
    },
    Agg {
        op: AggOp,
        window: Window,
        samples: VecDeque<(Time, f64)>,
    },
    Rate {
        prev: Option<(Time, f64)>,
        rate: Option<f64>,
    },
    Ewma {
        alpha: f64,
        avg: Option<f64>,
    },
    Threshold {
        high: f64,
        low: f64,
        on: bool,
    },
    Changed {
        prev: Option<Value>,
    },
    Cache {
        validity: u64,
        fetched_at: Option<Time>,
    },
}

/// A value shown in a unit's state.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum StateValue {
    /// A scalar.
    Value(Value),
    /// A list of samples.
    Samples(Vec<f64>),
}

/// A knob write a rule wants applied.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KnobWrite {
    /// The knob's full name.
    pub name: String,
    /// The value to write.
    pub value: Value,
    /// The key of the set unit that asked (for [`crate::RuleEngine::handle_write_result`]).
    pub unit: String,
}

/// What an evaluation may read and produce besides the unit itself.
pub(crate) struct EvalCx<'a> {
    pub now: Time,
    pub env: &'a dyn Environment,
    pub writes: &'a mut Vec<KnobWrite>,
    /// The evaluation was caused by a trigger (`->`), not by a changed input.
    pub triggered: bool,
}

/// A unit at runtime: what identifies it and its private state. Its output and the rest of what the engine's
/// evaluation loop reads are in its [`Hot`] entry, at the same index of a dense array of their own.
#[derive(Debug)]
pub(crate) struct Unit {
    /// `rule[captures]/path`: stable across reloads, so state survives rewiring.
    pub key: String,
    pub kind: UnitKind,
    /// Kind and parameters: a unit is unchanged by a reload only if this is.
    pub sig: String,
    pub core: Core,
    pub inputs: Vec<u32>,
}

/// How the engine evaluates a unit: the units without state in place, from their inputs' outputs, the others
/// through [`compute`] with their [`Core`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    Forwarder,
    Less,
    Greater,
    Equal,
    And,
    Or,
    Not,
    If,
    /// A `Cache`: answers from its value while valid (see [`cache_valid`]), otherwise evaluated with state.
    Cache,
    /// Any other unit: evaluated by [`compute`].
    Stateful,
}

impl Op {
    /// The evaluation of a unit of this kind.
    pub(crate) fn of(kind: UnitKind) -> Op {
        match kind {
            UnitKind::Forwarder => Op::Forwarder,
            UnitKind::Less => Op::Less,
            UnitKind::Greater => Op::Greater,
            UnitKind::Equal => Op::Equal,
            UnitKind::And => Op::And,
            UnitKind::Or => Op::Or,
            UnitKind::Not => Op::Not,
            UnitKind::If => Op::If,
            UnitKind::Cache => Op::Cache,
            _ => Op::Stateful,
        }
    }
}

/// `Hot::owner` of a unit of a pulled instance: every query may evaluate it.
pub(crate) const ANY_QUERY: u32 = u32::MAX;

/// What the engine's evaluation loop reads and writes of a unit, one entry per unit in a dense array (indexed
/// like the units), so that a hop touches one small entry and the flat input list, not the unit's key or state.
#[derive(Clone, Debug)]
pub(crate) struct Hot {
    /// The unit's output.
    pub value: Option<Value>,
    /// The evaluation wave in which the value was last computed.
    pub epoch: u64,
    /// The wave in which it last emitted: a root whose instance's output changed, a get whose meter changed, a
    /// timer that ticked (the compiled wave plans run an instance when a unit it waits on emitted).
    pub emitted: u64,
    /// Where its inputs start in the runtime's flat list of inputs.
    pub first_input: u32,
    /// How many inputs it has.
    pub n_inputs: u32,
    /// For a unit of a pushed instance, that instance: queries from other instances stop here and use the
    /// current value. [`ANY_QUERY`] for a unit of a pulled instance.
    pub owner: u32,
    /// How it is evaluated.
    pub op: Op,
}

impl Hot {
    /// An entry for a new unit of kind `kind` without output.
    pub(crate) fn new(kind: UnitKind) -> Hot {
        Hot { value: None, epoch: 0, emitted: 0, first_input: 0, n_inputs: 0, owner: ANY_QUERY, op: Op::of(kind) }
    }

    /// True if a query made for instance `current` stops at this unit (it belongs to another pushed instance).
    #[inline]
    pub(crate) fn stops(&self, current: u32) -> bool {
        self.owner != ANY_QUERY && self.owner != current
    }
}

/// A value as a number, if it is one.
pub fn num(v: &Value) -> Option<f64> {
    match v {
        Value::U64(x) => Some(*x as f64),
        Value::I64(x) => Some(*x as f64),
        Value::F64(x) => Some(*x),
        Value::Bool(b) => Some(f64::from(u8::from(*b))),
        Value::Str(_) => None,
    }
}

/// `*dst = src.clone()`, reusing `dst`'s string buffer, and inlined: the scalars are copied without a call.
/// This is how the engine copies an output; it is public so that the signalling benchmark's plain-call
/// reference can copy a value the same way (benches/signalling.rs, `callcopy`).
#[inline(always)]
pub fn assign(dst: &mut Option<Value>, src: &Option<Value>) {
    match src {
        None => *dst = None,
        Some(Value::Bool(b)) => *dst = Some(Value::Bool(*b)),
        Some(Value::U64(x)) => *dst = Some(Value::U64(*x)),
        Some(Value::I64(x)) => *dst = Some(Value::I64(*x)),
        Some(Value::F64(x)) => *dst = Some(Value::F64(*x)),
        Some(Value::Str(_)) => dst.clone_from(src),
    }
}

/// `v.clone()`, inlined: the scalars are copied without a call.
#[inline(always)]
pub(crate) fn dup(v: &Option<Value>) -> Option<Value> {
    match v {
        None => None,
        Some(Value::Bool(b)) => Some(Value::Bool(*b)),
        Some(Value::U64(x)) => Some(Value::U64(*x)),
        Some(Value::I64(x)) => Some(Value::I64(*x)),
        Some(Value::F64(x)) => Some(Value::F64(*x)),
        Some(Value::Str(s)) => Some(Value::Str(s.clone())),
    }
}

/// `if *dst != *src { *dst = src.clone(); true } else { false }` (equality exactly as `PartialEq`, not
/// [`same`]: 2 and 2.0 differ, NaN differs from itself) with one dispatch on `src`'s variant: the scalars are compared and copied inline, a string's
/// buffer is reused.
#[inline(always)]
pub(crate) fn update(dst: &mut Option<Value>, src: &Option<Value>) -> bool {
    // A scalar: compared and copied in place when `dst` holds the same variant, else stored whole.
    macro_rules! scalar {
        ($variant:ident, $x:expr) => {{
            if let Some(Value::$variant(y)) = dst {
                if *y == *$x {
                    return false;
                }
                *y = *$x;
                return true;
            }
            *dst = Some(Value::$variant(*$x));
        }};
    }
    match src {
        Some(Value::U64(x)) => scalar!(U64, x),
        Some(Value::F64(x)) => scalar!(F64, x),
        Some(Value::Bool(x)) => scalar!(Bool, x),
        Some(Value::I64(x)) => scalar!(I64, x),
        None => {
            if dst.is_none() {
                return false;
            }
            *dst = None;
        }
        Some(Value::Str(_)) => {
            if dst == src {
                return false;
            }
            dst.clone_from(src);
        }
    }
    true
}

/// Truth of a value: true, a non-zero number, a non-empty string.
pub fn truthy(v: &Value) -> bool {
    match v {
        Value::Bool(b) => *b,
        Value::Str(s) => !s.is_empty(),
        other => num(other).is_some_and(|x| x != 0.0),
    }
}

/// Equality across number types.
pub fn same(a: &Value, b: &Value) -> bool {
    match (num(a), num(b)) {
        (Some(x), Some(y)) if !matches!(a, Value::Bool(_)) && !matches!(b, Value::Bool(_)) => x == y,
        _ => a == b,
    }
}

fn trim(samples: &mut VecDeque<(Time, f64)>, window: Window, now: Time) {
    match window {
        Window::Samples(n) => {
            while samples.len() > n {
                samples.pop_front();
            }
        }
        Window::Duration(d) => {
            while samples.front().is_some_and(|(t, _)| now.saturating_since(*t).as_nanos() > u128::from(d))
                || samples.len() > MAX_SAMPLES
            {
                samples.pop_front();
            }
        }
        Window::Input => {}
    }
}

fn aggregate(op: AggOp, samples: &VecDeque<(Time, f64)>) -> Option<Value> {
    if op == AggOp::Count {
        return Some(Value::U64(samples.len() as u64));
    }
    let mut it = samples.iter().map(|(_, x)| *x);
    let first = it.next()?;
    let (mut lo, mut hi, mut sum) = (first, first, first);
    for x in it {
        lo = lo.min(x);
        hi = hi.max(x);
        sum += x;
    }
    Some(Value::F64(match op {
        AggOp::Avg => sum / samples.len() as f64,
        AggOp::Min => lo,
        AggOp::Max => hi,
        _ => sum,
    }))
}

impl Core {
    /// A fresh core for a compiled unit.
    pub(crate) fn new(kind: UnitKind, param: &Param) -> Core {
        let nanos = |p: &Param| if let Param::Nanos(n) = p { *n } else { 0 };
        let window = |p: &Param| if let Param::Window(w) = p { *w } else { Window::Input };
        match kind {
            UnitKind::Get => Core::Get { name: if let Param::Name(n) = param { n.clone() } else { String::new() } },
            UnitKind::Set => Core::Set {
                name: if let Param::Name(n) = param { n.clone() } else { String::new() },
                last_written: None,
                writes: 0,
                error: None,
            },
            UnitKind::Constant => {
                Core::Constant(if let Param::Value(v) = param { v.clone() } else { Value::Bool(false) })
            }
            UnitKind::Forwarder
            | UnitKind::Less
            | UnitKind::Greater
            | UnitKind::Equal
            | UnitKind::And
            | UnitKind::Or
            | UnitKind::Not
            | UnitKind::If => Core::Stateless(Op::of(kind)),
            UnitKind::Timer => Core::Timer { period: nanos(param).max(1), next_due: None, ticks: 0 },
            UnitKind::History => Core::History { window: window(param), samples: VecDeque::new() },
            UnitKind::Avg | UnitKind::Min | UnitKind::Max | UnitKind::Sum | UnitKind::Count => Core::Agg {
                op: match kind {
                    UnitKind::Avg => AggOp::Avg,
                    UnitKind::Min => AggOp::Min,
                    UnitKind::Max => AggOp::Max,
                    UnitKind::Sum => AggOp::Sum,
                    _ => AggOp::Count,
                },
                window: window(param),
                samples: VecDeque::new(),
            },
            UnitKind::Rate => Core::Rate { prev: None, rate: None },
            UnitKind::Ewma => Core::Ewma { alpha: if let Param::Alpha(a) = param { *a } else { 1.0 }, avg: None },
            UnitKind::Threshold => {
                let (high, low) = if let Param::Band { high, low } = param { (*high, *low) } else { (0.0, 0.0) };
                Core::Threshold { high, low, on: false }
            }
            UnitKind::Changed => Core::Changed { prev: None },
            UnitKind::Cache => Core::Cache { validity: nanos(param), fetched_at: None },
        }
    }

    /// Takes over the state of `old`, a unit of the same kind at the same place before a reload; returns false
    /// (and keeps its fresh state) if the kinds differ. New parameters apply (a smaller window drops the oldest).
    pub(crate) fn adopt(&mut self, old: Core, now: Time) -> bool {
        match (self, old) {
            (Core::Set { last_written, writes, error, .. }, Core::Set { last_written: l, writes: w, error: e, .. }) => {
                (*last_written, *writes, *error) = (l, w, e);
            }
            (Core::Timer { next_due, ticks, .. }, Core::Timer { next_due: n, ticks: t, .. }) => {
                (*next_due, *ticks) = (n, t);
            }
            (Core::History { window, samples }, Core::History { samples: s, .. }) => {
                *samples = s;
                trim(samples, *window, now);
            }
            (Core::Agg { op, window, samples }, Core::Agg { op: o, samples: s, .. }) if *op == o => {
                *samples = s;
                trim(samples, *window, now);
            }
            (Core::Rate { prev, rate }, Core::Rate { prev: p, rate: r }) => (*prev, *rate) = (p, r),
            (Core::Ewma { avg, .. }, Core::Ewma { avg: a, .. }) => *avg = a,
            (Core::Threshold { on, .. }, Core::Threshold { on: o, .. }) => *on = o,
            (Core::Changed { prev }, Core::Changed { prev: p }) => *prev = p,
            (Core::Cache { fetched_at, .. }, Core::Cache { fetched_at: f, .. }) => *fetched_at = f,
            (Core::Stateless(op), Core::Stateless(o)) => return *op == o,
            (me, old) => return std::mem::discriminant(me) == std::mem::discriminant(&old),
        }
        true
    }

    /// The samples of a History (for aggregates that read it).
    pub(crate) fn samples(&self) -> Option<&VecDeque<(Time, f64)>> {
        match self {
            Core::History { samples, .. } => Some(samples),
            _ => None,
        }
    }

    /// The state shown by `show`.
    pub(crate) fn state(&self) -> BTreeMap<&'static str, StateValue> {
        let mut m = BTreeMap::new();
        let list = |s: &VecDeque<(Time, f64)>| StateValue::Samples(s.iter().map(|(_, x)| *x).collect());
        match self {
            Core::Set { name, last_written, writes, error } => {
                m.insert("knob", StateValue::Value(Value::Str(name.clone())));
                if let Some(v) = last_written {
                    m.insert("last_written", StateValue::Value(v.clone()));
                }
                m.insert("writes", StateValue::Value(Value::U64(*writes)));
                if let Some(e) = error {
                    m.insert("error", StateValue::Value(Value::Str(e.clone())));
                }
            }
            Core::Get { name } => {
                m.insert("meter", StateValue::Value(Value::Str(name.clone())));
            }
            Core::Timer { period, next_due, ticks } => {
                m.insert("period_ns", StateValue::Value(Value::U64(*period)));
                m.insert("ticks", StateValue::Value(Value::U64(*ticks)));
                if let Some(t) = next_due {
                    m.insert("next_due_ns", StateValue::Value(Value::U64(t.as_nanos())));
                }
            }
            Core::History { samples, .. } => {
                m.insert("samples", list(samples));
            }
            Core::Agg { samples, window, .. } if *window != Window::Input => {
                m.insert("samples", list(samples));
            }
            Core::Rate { prev: Some((_, x)), .. } => {
                m.insert("previous", StateValue::Value(Value::F64(*x)));
            }
            Core::Ewma { avg: Some(a), .. } => {
                m.insert("average", StateValue::Value(Value::F64(*a)));
            }
            Core::Threshold { on, .. } => {
                m.insert("on", StateValue::Value(Value::Bool(*on)));
            }
            Core::Changed { prev: Some(p) } => {
                m.insert("previous", StateValue::Value(p.clone()));
            }
            Core::Cache { fetched_at: Some(t), .. } => {
                m.insert("fetched_at_ns", StateValue::Value(Value::U64(t.as_nanos())));
            }
            _ => {}
        }
        m
    }
}

/// True if a `Cache` unit with output `value` answers a query at `now` without querying its input.
pub(crate) fn cache_valid(core: &Core, value: &Option<Value>, now: Time) -> bool {
    match core {
        Core::Cache { validity, fetched_at: Some(t) } => {
            value.is_some() && now.saturating_since(*t).as_nanos() < u128::from(*validity)
        }
        _ => false,
    }
}

/// Evaluates a unit without state (`op` Forwarder, comparisons, logic, If) from its inputs' outputs (`inputs`:
/// indexes into `hot`). Not for [`Op::Cache`] and [`Op::Stateful`], which [`compute`] evaluates.
#[inline]
pub(crate) fn compute_stateless(op: Op, inputs: &[u32], hot: &[Hot]) -> Option<Value> {
    let input = |i: usize| inputs.get(i).and_then(|&u| hot[u as usize].value.as_ref());
    let number = |i: usize| input(i).and_then(num);
    match op {
        Op::Forwarder => dup(inputs.first().map_or(&None, |&u| &hot[u as usize].value)),
        Op::Less => Some(Value::Bool(number(0)? < number(1)?)),
        Op::Greater => Some(Value::Bool(number(0)? > number(1)?)),
        Op::Equal => Some(Value::Bool(same(input(0)?, input(1)?))),
        Op::And => {
            let mut all = true;
            for i in 0..inputs.len() {
                all &= truthy(input(i)?);
            }
            Some(Value::Bool(all))
        }
        Op::Or => {
            let mut any = false;
            for i in 0..inputs.len() {
                any |= truthy(input(i)?);
            }
            Some(Value::Bool(any))
        }
        Op::Not => Some(Value::Bool(!truthy(input(0)?))),
        Op::If => {
            if truthy(input(0)?) {
                input(1).cloned()
            } else {
                input(2).cloned()
            }
        }
        Op::Cache | Op::Stateful => None,
    }
}

/// Evaluates one unit whose inputs (`inputs`, indexes into `units`) are up to date; `core` has been taken out of
/// its slot. `hot` holds the outputs of the units, `units` their state (a History's samples for the aggregates
/// that read it). Returns the new output.
pub(crate) fn compute(
    core: &mut Core,
    inputs: &[u32],
    hot: &[Hot],
    units: &[Unit],
    cx: &mut EvalCx<'_>,
) -> Option<Value> {
    let input = |i: usize| inputs.get(i).and_then(|&u| hot[u as usize].value.as_ref());
    let number = |i: usize| input(i).and_then(num);
    let now = cx.now;
    match core {
        Core::Vacant => None,
        Core::Constant(v) => Some(v.clone()),
        Core::Stateless(op) => compute_stateless(*op, inputs, hot),
        Core::Get { name } => cx.env.get(name),
        Core::Set { name, last_written, writes, .. } => {
            let v = input(0)?.clone();
            let differs = last_written.as_ref().is_none_or(|l| !same(l, &v));
            if cx.triggered || differs {
                cx.writes.push(KnobWrite { name: name.clone(), value: v.clone(), unit: String::new() });
                *last_written = Some(v.clone());
                *writes += 1;
            }
            Some(v)
        }
        Core::Timer { ticks, .. } => Some(Value::U64(*ticks)),
        Core::History { window, samples } => {
            if let Some(x) = number(0) {
                samples.push_back((now, x));
            }
            trim(samples, *window, now);
            samples.back().map(|(_, x)| Value::F64(*x))
        }
        Core::Agg { op, window, samples } => {
            if *window == Window::Input {
                let src = inputs.first().and_then(|&u| units[u as usize].core.samples())?;
                return aggregate(*op, src);
            }
            if let Some(x) = number(0) {
                samples.push_back((now, x));
            }
            trim(samples, *window, now);
            aggregate(*op, samples)
        }
        Core::Rate { prev, rate } => {
            let x = number(0)?;
            match *prev {
                Some((t0, x0)) if now > t0 => {
                    let secs = now.saturating_since(t0).as_secs_f64();
                    *rate = Some((x - x0) / secs);
                    *prev = Some((now, x));
                }
                // A second sample at the same instant replaces the first.
                _ => *prev = Some((now, x)),
            }
            rate.map(Value::F64)
        }
        Core::Ewma { alpha, avg } => {
            let x = number(0)?;
            let a = avg.map_or(x, |a| *alpha * x + (1.0 - *alpha) * a);
            *avg = Some(a);
            Some(Value::F64(a))
        }
        Core::Threshold { high, low, on } => {
            let x = number(0)?;
            if x > *high {
                *on = true;
            } else if x < *low {
                *on = false;
            }
            Some(Value::Bool(*on))
        }
        Core::Changed { prev } => {
            let x = input(0)?.clone();
            let changed = prev.as_ref().is_some_and(|p| !same(p, &x));
            *prev = Some(x);
            Some(Value::Bool(changed))
        }
        Core::Cache { fetched_at, .. } => {
            *fetched_at = Some(now);
            input(0).cloned()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::MemoryEnv;

    /// Runs `core` over the given input values at the given times (milliseconds); returns the outputs.
    fn run(mut core: Core, steps: &[(u64, Option<Value>)]) -> Vec<Option<Value>> {
        let env = MemoryEnv::new();
        let mut writes = Vec::new();
        let input = Unit {
            key: "in".into(),
            kind: UnitKind::Constant,
            sig: String::new(),
            core: Core::Stateless(Op::Forwarder),
            inputs: vec![],
        };
        let mut hot = Hot::new(UnitKind::Constant);
        let mut out = Vec::new();
        for (ms, v) in steps {
            hot.value = v.clone();
            let mut cx = EvalCx { now: Time::from_millis(*ms), env: &env, writes: &mut writes, triggered: false };
            out.push(compute(&mut core, &[0], std::slice::from_ref(&hot), std::slice::from_ref(&input), &mut cx));
        }
        out
    }

    fn f(x: f64) -> Option<Value> {
        Some(Value::F64(x))
    }

    #[test]
    fn windows_by_samples_and_by_duration() {
        let h = run(
            Core::new(UnitKind::History, &Param::Window(Window::Samples(2))),
            &[(0, f(1.0)), (1, f(2.0)), (2, f(3.0))],
        );
        assert_eq!(h, vec![f(1.0), f(2.0), f(3.0)]);
        let avg =
            run(Core::new(UnitKind::Avg, &Param::Window(Window::Samples(2))), &[(0, f(1.0)), (1, f(2.0)), (2, f(4.0))]);
        assert_eq!(avg, vec![f(1.0), f(1.5), f(3.0)]);
        // 100 ms window: at t=150 the sample of t=0 is gone.
        let sum = run(
            Core::new(UnitKind::Sum, &Param::Window(Window::Duration(100_000_000))),
            &[(0, f(1.0)), (50, f(2.0)), (150, f(4.0))],
        );
        assert_eq!(sum, vec![f(1.0), f(3.0), f(6.0)]);
        let count =
            run(Core::new(UnitKind::Count, &Param::Window(Window::Samples(3))), &[(0, None), (1, f(2.0)), (2, f(2.0))]);
        assert_eq!(count, vec![Some(Value::U64(0)), Some(Value::U64(1)), Some(Value::U64(2))]);
        let min =
            run(Core::new(UnitKind::Min, &Param::Window(Window::Samples(2))), &[(0, f(5.0)), (1, f(2.0)), (2, f(9.0))]);
        assert_eq!(min, vec![f(5.0), f(2.0), f(2.0)]);
        let max =
            run(Core::new(UnitKind::Max, &Param::Window(Window::Samples(2))), &[(0, f(5.0)), (1, f(2.0)), (2, f(1.0))]);
        assert_eq!(max, vec![f(5.0), f(5.0), f(2.0)]);
    }

    #[test]
    fn rate_ewma_threshold_changed() {
        let r = run(
            Core::new(UnitKind::Rate, &Param::None),
            &[(0, f(0.0)), (500, f(10.0)), (500, f(11.0)), (1500, f(11.0))],
        );
        assert_eq!(r, vec![None, f(20.0), f(20.0), f(0.0)]);
        let e = run(Core::new(UnitKind::Ewma, &Param::Alpha(0.5)), &[(0, f(4.0)), (1, f(0.0)), (2, f(0.0))]);
        assert_eq!(e, vec![f(4.0), f(2.0), f(1.0)]);
        let t = run(
            Core::new(UnitKind::Threshold, &Param::Band { high: 4.0, low: 2.0 }),
            &[(0, f(3.0)), (1, f(5.0)), (2, f(3.0)), (3, f(1.0)), (4, f(3.0))],
        );
        let b = |x| Some(Value::Bool(x));
        assert_eq!(t, vec![b(false), b(true), b(true), b(false), b(false)]);
        let c = run(
            Core::new(UnitKind::Changed, &Param::None),
            &[(0, f(1.0)), (1, f(1.0)), (2, Some(Value::U64(2))), (3, f(2.0))],
        );
        assert_eq!(c, vec![b(false), b(false), b(true), b(false)]);
    }

    #[test]
    fn inline_copies_and_comparisons_agree_with_clone_and_eq() {
        let values = [
            None,
            Some(Value::Bool(true)),
            Some(Value::Bool(false)),
            Some(Value::U64(7)),
            Some(Value::U64(8)),
            Some(Value::I64(-7)),
            Some(Value::F64(7.0)),
            Some(Value::F64(f64::NAN)),
            Some(Value::Str("bbr".into())),
            Some(Value::Str("cubic".into())),
        ];
        for a in &values {
            // NaN is not equal to itself: compare the copies by their Debug text.
            assert_eq!(format!("{:?}", dup(a)), format!("{a:?}"));
            for b in &values {
                let mut dst = b.clone();
                assign(&mut dst, a);
                assert_eq!(format!("{dst:?}"), format!("{a:?}"));
                let mut dst = b.clone();
                assert_eq!(update(&mut dst, a), a != b, "update {a:?} over {b:?}");
                assert_eq!(format!("{dst:?}"), format!("{:?}", if a != b { a } else { b }));
            }
        }
    }

    #[test]
    fn adopt_keeps_state_of_the_same_kind_and_trims_to_the_new_window() {
        let mut old = Core::new(UnitKind::History, &Param::Window(Window::Samples(4)));
        if let Core::History { samples, .. } = &mut old {
            samples.extend([(Time::ZERO, 1.0), (Time::ZERO, 2.0), (Time::ZERO, 3.0)]);
        }
        let mut new = Core::new(UnitKind::History, &Param::Window(Window::Samples(2)));
        assert!(new.adopt(old, Time::ZERO));
        assert_eq!(new.samples().unwrap().iter().map(|s| s.1).collect::<Vec<_>>(), vec![2.0, 3.0]);
        let mut other = Core::new(UnitKind::Ewma, &Param::Alpha(0.5));
        assert!(!other.adopt(new, Time::ZERO));
        assert!(lookup("derivative").is_some_and(|u| u.kind == UnitKind::Rate) && lookup("nope").is_none());
        assert!(truthy(&Value::U64(3)) && !truthy(&Value::F64(0.0)) && !truthy(&Value::Str(String::new())));
        assert!(same(&Value::U64(2), &Value::F64(2.0)) && !same(&Value::Bool(true), &Value::U64(1)));
    }
}
