//! Lab descriptions: an experiment in one TOML file — hosts, emulated links, programs and a schedule of events —
//! parsed and validated into a resolved [`Lab`], with every error located at `file:line:column`.
//!
//! This crate is sans-IO: it parses from a `&str` and creates nothing. A lab runner builds the namespaces, veth
//! pairs and emulators from a [`Lab`] only after [`Lab::parse`] accepted the whole file, so a mistake is reported
//! before anything exists.
//!
//! # Format
//!
//! The demonstration lab (`labs/demo.toml`):
//!
#![doc = concat!("```toml\n", include_str!("../../../labs/demo.toml"), "```\n")]
//!
//! - `[lab]`: `name` (required; lowercase letters, digits, `_`, `-`), `duration` (required, > 0; every program and
//!   event must start before it), `seed` (non-negative integer, default 1; seeds the emulators), `sample` and
//!   `meters` (what is sampled into `meters.csv`), `realtime` (0-99, default [`DEFAULT_REALTIME`]: the SCHED_FIFO
//!   priority of the lab's daemons' data planes, `flexstack daemon --realtime`; 0 for the normal policy).
//! - `[hosts.NAME]`: one table per host. A name is a lowercase letter or digit then letters, digits, `_` or `-`, at
//!   most [`MAX_HOST_NAME`] characters (so namespace and interface names derived from it fit). `stack` (optional)
//!   makes it a stacked host: its apps run behind flexstack with that stack file as template; without it the host
//!   is a plain namespace with the kernel stack.
//! - `[[links]]`: `a` and `b` (two different known hosts; one link per pair, either order), and optionally `bw`
//!   (Mbit/s, > 0), `delay` and `jitter` (durations), `loss` (random loss, % in 0..=100) or
//!   `loss_model = "gilbert-elliott"` with `ge_p` and `ge_r` (required, probabilities in 0..=1) and `ge_loss_bad`,
//!   `ge_loss_good` (% in 0..=100, default 100 and 0), `max_queue_size` (packets, >= 1) and `mtu` (68..=65535).
//!   A link is named `"<a>-<b>"`.
//! - `[[routes]]`: `host`, `to` (a stacked host) and `via` (a neighbour of `host`): on `host`, the route to `to`'s
//!   apps goes through `via` instead of the shortest path (e.g. replies to a multi-homed host over one uplink).
//! - `[[programs]]`: `host`, `run` (a command line), `background` (default false: servers run in the background,
//!   clients in the foreground) and `at` (default `"0s"`).
//! - `[[events]]`: `at` (before `duration`) and either `link` (a link's name, either order of its hosts) with exactly
//!   one of `set = { ... }` (any link parameter but `mtu`), `down = true` or `up = true`; or `knob` (a dotted knob
//!   name such as `module.x.select`) with a scalar `value` and optionally the `host` (a stacked host) it applies to;
//!   or `rules` (a rule file, docs/rules.md, relative to the lab file) loaded into the lab's wire daemon, or with
//!   `host` into that stacked host's daemon. This crate reads no file: the runner checks that the rule file exists
//!   and that its text checks before it creates anything.
//!
//! Durations are strings: a non-negative decimal number and a unit, `ns`, `us`, `ms`, `s`, `m` or `h` (`"250ms"`, `"6s"`,
//! `"1.5s"`, `"2m"`); see [`parse_duration`]. Unknown keys are rejected everywhere.
//!
//! # Determinism
//!
//! [`Lab::timeline`] lists every scheduled action in time order; at the same instant, program starts come before
//! events and each keeps the order of the file. The same file always gives the same [`Lab`] and the same timeline.
//!
//! Link parameters map to the `emulator` module's knobs with [`LinkParams::emulator_settings`].

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod plan;
pub mod report;

use flexstack_core::config::{describe, entry, key_span, parse_located, valid_name, ConfigError, Location};
use flexstack_core::Value;
use std::fmt::Write as _;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// Longest host name: namespace and interface names (at most 15 bytes) are derived from it.
pub const MAX_HOST_NAME: usize = 10;

/// Largest lab description accepted, in bytes.
pub const MAX_LAB_FILE_BYTES: usize = 1 << 20;

/// Longest delay or jitter the emulator accepts (one hour).
pub const MAX_DELAY: Duration = Duration::from_secs(3600);

/// Highest link rate the emulator accepts, in Mbit/s.
pub const MAX_RATE_MBIT: f64 = 1_000_000.0;

/// The default `realtime` of a lab: its daemons' data planes run under SCHED_FIFO at this priority, so that an
/// emulated link forwards and releases frames when they are due rather than when a core is free of the lab's
/// programs (BENCHMARKS.md, issue 4).
pub const DEFAULT_REALTIME: u8 = 10;

/// Longest queue the emulator accepts, in packets.
pub const MAX_QUEUE_PACKETS: u64 = 10_000_000;

/// A whole, validated experiment.
#[derive(Clone, Debug, PartialEq)]
pub struct Lab {
    /// The lab's name.
    pub name: String,
    /// How long the experiment runs.
    pub duration: Duration,
    /// The seed of every random choice (the emulators' loss draws).
    pub seed: u64,
    /// SCHED_FIFO priority of the lab's daemons' data planes (`flexstack daemon --realtime`; 0: normal policy).
    pub realtime: u8,
    /// How often meters are sampled into the results.
    pub sample: Duration,
    /// Patterns of the meters sampled (default `link.**`; `*` stays within a dotted segment, `**` crosses them).
    pub meters: Vec<String>,
    /// Hosts in file order.
    pub hosts: Vec<Host>,
    /// Links in file order.
    pub links: Vec<Link>,
    /// Programs in file order.
    pub programs: Vec<Program>,
    /// Events sorted by time (stable: file order at the same time).
    pub events: Vec<Event>,
    /// Static routes that replace the computed ones, in file order.
    pub routes: Vec<RouteSpec>,
}

/// A `[[routes]]` entry: on `host`, traffic to the stacked host `to`'s apps goes through the neighbour `via`.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteSpec {
    /// The host whose routing table gets the route.
    pub host: String,
    /// The stacked host whose app subnet is the destination.
    pub to: String,
    /// The next hop: a host linked to `host`.
    pub via: String,
    /// Where it was declared.
    pub location: Location,
}

/// A host: a network namespace.
#[derive(Clone, Debug, PartialEq)]
pub struct Host {
    /// Its name.
    pub name: String,
    /// The stack file its apps run behind, for a stacked host; `None` for a plain host (kernel stack).
    pub stack: Option<String>,
    /// Where it was declared.
    pub location: Location,
}

/// A loss model.
#[derive(Clone, Debug, PartialEq)]
pub enum Loss {
    /// Independent random loss.
    Random {
        /// Loss probability, in %.
        pct: f64,
    },
    /// Gilbert-Elliott two-state loss.
    GilbertElliott {
        /// Probability of moving good → bad, per packet.
        p: f64,
        /// Probability of moving bad → good, per packet.
        r: f64,
        /// Loss in the bad state, in %.
        loss_bad_pct: f64,
        /// Loss in the good state, in %.
        loss_good_pct: f64,
    },
}

/// Link parameters that can be set when the link is created and changed by an event; `None` keeps the default
/// (or, in an event, the current value).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LinkParams {
    /// Rate in Mbit/s.
    pub bw_mbit: Option<f64>,
    /// One-way delay.
    pub delay: Option<Duration>,
    /// Jitter (± around the delay).
    pub jitter: Option<Duration>,
    /// Loss model.
    pub loss: Option<Loss>,
    /// Queue bound, in packets.
    pub max_queue_size: Option<u64>,
}

impl LinkParams {
    /// The parameters as `emulator` module knobs (`delay_ms`, `jitter_ms`, `rate_mbit`, `queue_packets`,
    /// `loss_pct`, `ge_p`, `ge_r`, `ge_loss_bad_pct`, `ge_loss_good_pct`), in that order, only those given.
    /// Random loss also sets `ge_p = 0` so that it replaces a Gilbert-Elliott model.
    pub fn emulator_settings(&self) -> Vec<(String, Value)> {
        let ms = |d: Duration| Value::F64(d.as_secs_f64() * 1000.0);
        let mut out: Vec<(&str, Value)> = Vec::new();
        if let Some(d) = self.delay {
            out.push(("delay_ms", ms(d)));
        }
        if let Some(j) = self.jitter {
            out.push(("jitter_ms", ms(j)));
        }
        if let Some(bw) = self.bw_mbit {
            out.push(("rate_mbit", Value::F64(bw)));
        }
        if let Some(q) = self.max_queue_size {
            out.push(("queue_packets", Value::U64(q)));
        }
        match &self.loss {
            Some(Loss::Random { pct }) => {
                out.push(("loss_pct", Value::F64(*pct)));
                out.push(("ge_p", Value::F64(0.0)));
            }
            Some(Loss::GilbertElliott { p, r, loss_bad_pct, loss_good_pct }) => {
                out.push(("ge_p", Value::F64(*p)));
                out.push(("ge_r", Value::F64(*r)));
                out.push(("ge_loss_bad_pct", Value::F64(*loss_bad_pct)));
                out.push(("ge_loss_good_pct", Value::F64(*loss_good_pct)));
            }
            None => {}
        }
        out.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    fn describe(&self) -> String {
        let mut s = String::new();
        for (i, (k, v)) in self.emulator_settings().iter().enumerate() {
            let _ = write!(s, "{}{k}={v}", if i > 0 { " " } else { "" });
        }
        s
    }
}

/// An emulated link between two hosts (both directions).
#[derive(Clone, Debug, PartialEq)]
pub struct Link {
    /// `"<a>-<b>"`.
    pub name: String,
    /// One end.
    pub a: String,
    /// The other end.
    pub b: String,
    /// Emulation parameters.
    pub params: LinkParams,
    /// MTU of both interfaces, if given.
    pub mtu: Option<u32>,
    /// Capture the link's frames (both directions) to pcapng from the start.
    pub capture: bool,
    /// Where it was declared.
    pub location: Location,
}

impl Link {
    /// The link's parameters as `emulator` knobs (see [`LinkParams::emulator_settings`]).
    pub fn emulator_settings(&self) -> Vec<(String, Value)> {
        self.params.emulator_settings()
    }
}

/// A program started on a host.
#[derive(Clone, Debug, PartialEq)]
pub struct Program {
    /// The host it runs on.
    pub host: String,
    /// Its command line.
    pub run: String,
    /// True for a server left running in the background.
    pub background: bool,
    /// When it starts.
    pub at: Duration,
    /// Where it was declared.
    pub location: Location,
}

/// What an event does.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Takes a link down.
    LinkDown {
        /// The link's name.
        link: String,
    },
    /// Brings a link up.
    LinkUp {
        /// The link's name.
        link: String,
    },
    /// Changes link parameters.
    LinkSet {
        /// The link's name.
        link: String,
        /// The parameters given (others unchanged).
        params: LinkParams,
    },
    /// Starts capturing a link's frames (both directions) to pcapng.
    Capture {
        /// The link's name.
        link: String,
    },
    /// Loads a rule file (docs/rules.md) into a daemon, as `flexstack rules load` does.
    Rules {
        /// The stacked host whose daemon gets the rules; `None`: the lab's wire daemon.
        host: Option<String>,
        /// The rule file as written in the lab file (relative to the lab file's folder unless absolute).
        file: String,
    },
    /// Writes a flexstack knob.
    Knob {
        /// The stacked host, if given.
        host: Option<String>,
        /// The knob's dotted name.
        knob: String,
        /// The value written.
        value: Value,
    },
}

impl Action {
    /// One line saying what the action does (`link h1-srv set delay_ms=50`), as in [`Lab::timeline`].
    pub fn describe(&self) -> String {
        match self {
            Action::LinkDown { link } => format!("link {link} down"),
            Action::LinkUp { link } => format!("link {link} up"),
            Action::Capture { link } => format!("capture link {link}"),
            Action::LinkSet { link, params } => format!("link {link} set {}", params.describe()),
            Action::Knob { host: Some(h), knob, value } => format!("knob {knob} = {value} on {h}"),
            Action::Knob { host: None, knob, value } => format!("knob {knob} = {value}"),
            Action::Rules { host: Some(h), file } => format!("rules {file} on {h}"),
            Action::Rules { host: None, file } => format!("rules {file}"),
        }
    }
}

/// A scheduled event.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// When it happens.
    pub at: Duration,
    /// What it does.
    pub action: Action,
    /// Where it was declared.
    pub location: Location,
}

/// Parses a duration: a non-negative decimal number and a unit, `ns`, `us`, `ms`, `s`, `m` or `h` (`"1.5s"`).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let bad = || format!("expected a duration like \"250ms\", \"6s\", \"1.5s\" or \"2m\", got {text:?}");
    if t.starts_with('-') {
        return Err(format!("expected a non-negative duration, got {text:?}"));
    }
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).ok_or_else(bad)?;
    let (number, unit) = t.split_at(split);
    let unit_ns: u128 = match unit {
        "ns" => 1,
        "us" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "m" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        _ => return Err(bad()),
    };
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if int.is_empty() || (number.contains('.') && frac.is_empty()) || frac.contains('.') {
        return Err(bad());
    }
    if int.len() > 15 || frac.len() > 9 {
        return Err(format!("duration {text:?} is too long or too precise"));
    }
    let int: u128 = int.parse().map_err(|_| bad())?;
    let frac_ns = if frac.is_empty() {
        0
    } else {
        let f: u128 = frac.parse().map_err(|_| bad())?;
        f * unit_ns / 10u128.pow(frac.len() as u32)
    };
    let ns = int * unit_ns + frac_ns;
    let secs = u64::try_from(ns / 1_000_000_000).map_err(|_| format!("duration {text:?} is too long"))?;
    Ok(Duration::new(secs, (ns % 1_000_000_000) as u32))
}

/// Formats a duration as [`parse_duration`] reads it back (`"250ms"`, `"6s"`, `"7ns"`).
pub fn format_duration(d: Duration) -> String {
    flexstack_core::time::format_nanos(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

type DeTable<'i> = toml::de::DeTable<'i>;
type DeValue<'i> = toml::de::DeValue<'i>;

/// The file being parsed: turns spans into locations.
struct Doc<'t> {
    file: Arc<str>,
    text: &'t str,
}

impl Doc<'_> {
    fn at(&self, span: Range<usize>) -> Location {
        Location::of_offset(&self.file, self.text, span.start)
    }

    fn start(&self) -> Location {
        Location { file: self.file.clone(), line: 1, column: 1 }
    }
}

/// A table with its spans; `what` names it in messages.
struct Tbl<'a, 'i, 'd> {
    doc: &'d Doc<'d>,
    values: &'a toml::Table,
    spans: Option<&'a DeTable<'i>>,
    location: Location,
    what: String,
}

impl<'a, 'i, 'd> Tbl<'a, 'i, 'd> {
    fn err(&self, location: Location, message: impl Into<String>) -> ConfigError {
        ConfigError::new(Some(location), message)
    }

    /// Where `key` is written (its name), or the table.
    fn key_loc(&self, key: &str) -> Location {
        self.spans.and_then(|s| key_span(s, key)).map_or_else(|| self.location.clone(), |sp| self.doc.at(sp))
    }

    /// Where the value of `key` is written, or the table.
    fn value_loc(&self, key: &str) -> Location {
        self.spans.and_then(|s| entry(s, key)).map_or_else(|| self.location.clone(), |(_, v)| self.doc.at(v.span()))
    }

    fn check_keys(&self, allowed: &[&str]) -> Result<(), ConfigError> {
        for key in self.values.keys() {
            if !allowed.contains(&key.as_str()) {
                return Err(self.err(
                    self.key_loc(key),
                    format!("unknown key `{key}` in {}; expected one of: {}", self.what, allowed.join(", ")),
                ));
            }
        }
        Ok(())
    }

    fn has(&self, key: &str) -> bool {
        self.values.contains_key(key)
    }

    fn typed<T>(
        &self,
        key: &str,
        expected: &str,
        f: impl Fn(&'a toml::Value) -> Option<T>,
    ) -> Result<Option<T>, ConfigError> {
        let Some(v) = self.values.get(key) else { return Ok(None) };
        f(v).map(Some).ok_or_else(|| {
            self.err(self.value_loc(key), format!("`{key}` in {}: expected {expected}, got {}", self.what, describe(v)))
        })
    }

    fn string(&self, key: &str) -> Result<Option<&'a str>, ConfigError> {
        self.typed(key, "a string", |v: &'a toml::Value| v.as_str())
    }

    fn required_string(&self, key: &str) -> Result<&'a str, ConfigError> {
        self.string(key)?.ok_or_else(|| self.err(self.location.clone(), format!("{} needs `{key}`", self.what)))
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, ConfigError> {
        self.typed(key, "true or false", toml::Value::as_bool)
    }

    fn number(&self, key: &str, expected: &str, ok: impl Fn(f64) -> bool) -> Result<Option<f64>, ConfigError> {
        self.typed(key, expected, |v| {
            v.as_float().or_else(|| v.as_integer().map(|i| i as f64)).filter(|f| f.is_finite() && ok(*f))
        })
    }

    fn integer(&self, key: &str, range: std::ops::RangeInclusive<u64>) -> Result<Option<u64>, ConfigError> {
        let expected = format!("an integer in {}..={}", range.start(), range.end());
        self.typed(key, &expected, |v| v.as_integer().and_then(|i| u64::try_from(i).ok()).filter(|i| range.contains(i)))
    }

    fn duration(&self, key: &str) -> Result<Option<Duration>, ConfigError> {
        let Some(text) = self.typed(key, "a duration string like \"10ms\"", |v: &'a toml::Value| v.as_str())? else {
            return Ok(None);
        };
        parse_duration(text)
            .map(Some)
            .map_err(|m| self.err(self.value_loc(key), format!("`{key}` in {}: {m}", self.what)))
    }

    fn spans_of(&self, key: &str) -> Option<&'a DeValue<'i>> {
        self.spans.and_then(|s| entry(s, key)).map(|(_, v)| v.get_ref())
    }

    /// The sub-table under `key`.
    fn table(&self, key: &str, what: String) -> Result<Option<Tbl<'a, 'i, 'd>>, ConfigError> {
        let Some(v) = self.values.get(key) else { return Ok(None) };
        let values = v.as_table().ok_or_else(|| {
            self.err(self.value_loc(key), format!("`{key}` in {}: expected a table, got {}", self.what, describe(v)))
        })?;
        let spans = match self.spans_of(key) {
            Some(DeValue::Table(t)) => Some(t),
            _ => None,
        };
        Ok(Some(Tbl { doc: self.doc, values, spans, location: self.key_loc(key), what }))
    }

    /// The tables of the array under `key` (`[[key]]`).
    fn tables(&self, key: &str) -> Result<Vec<Tbl<'a, 'i, 'd>>, ConfigError> {
        let Some(v) = self.values.get(key) else { return Ok(Vec::new()) };
        let expected = || self.err(self.key_loc(key), format!("`{key}` must be written as [[{key}]] tables"));
        let items = v.as_array().ok_or_else(expected)?;
        let spans: Vec<_> = match self.spans_of(key) {
            Some(DeValue::Array(a)) => a.iter().collect(),
            _ => Vec::new(),
        };
        let mut out = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let span = spans.get(i);
            let location = span.map_or_else(|| self.key_loc(key), |s| self.doc.at(s.span()));
            let values = item.as_table().ok_or_else(|| {
                self.err(
                    location.clone(),
                    format!("`{key}` must be written as [[{key}]] tables, got {}", describe(item)),
                )
            })?;
            let spans = match span.map(|s| s.get_ref()) {
                Some(DeValue::Table(t)) => Some(t),
                _ => None,
            };
            let what = format!("{key} entry #{}", i + 1);
            out.push(Tbl { doc: self.doc, values, spans, location, what });
        }
        Ok(out)
    }
}

/// Keys of link parameters that an event may change.
const PARAM_KEYS: &[&str] =
    &["bw", "delay", "jitter", "loss", "loss_model", "ge_p", "ge_r", "ge_loss_bad", "ge_loss_good", "max_queue_size"];

/// Reads the link parameters of `t` (keys checked by the caller).
fn link_params(t: &Tbl<'_, '_, '_>) -> Result<LinkParams, ConfigError> {
    let pct = "a percentage in 0..=100";
    let prob = "a probability in 0..=1";
    let bw_mbit = t.number("bw", "a rate in Mbit/s, > 0 and at most 1000000", |f| f > 0.0 && f <= MAX_RATE_MBIT)?;
    let mut delays = [None, None];
    for (slot, key) in delays.iter_mut().zip(["delay", "jitter"]) {
        *slot = t.duration(key)?;
        if slot.is_some_and(|d| d > MAX_DELAY) {
            return Err(t.err(t.value_loc(key), format!("`{key}` in {}: at most 1h", t.what)));
        }
    }
    let model = t.typed("loss_model", "\"random\" or \"gilbert-elliott\"", |v| {
        v.as_str().filter(|s| matches!(*s, "random" | "gilbert-elliott"))
    })?;
    let ge_keys = ["ge_p", "ge_r", "ge_loss_bad", "ge_loss_good"];
    let loss = if model == Some("gilbert-elliott") {
        if t.has("loss") {
            return Err(t.err(t.key_loc("loss"), format!("{}: `loss` is for random loss; with loss_model = \"gilbert-elliott\" use ge_loss_bad and ge_loss_good", t.what)));
        }
        let need = |key: &str| -> Result<f64, ConfigError> {
            t.number(key, prob, |f| (0.0..=1.0).contains(&f))?.ok_or_else(|| {
                t.err(
                    t.key_loc("loss_model"),
                    format!("{}: loss_model = \"gilbert-elliott\" needs `{key}` (a probability in 0..=1)", t.what),
                )
            })
        };
        let (p, r) = (need("ge_p")?, need("ge_r")?);
        let loss_bad_pct = t.number("ge_loss_bad", pct, |f| (0.0..=100.0).contains(&f))?.unwrap_or(100.0);
        let loss_good_pct = t.number("ge_loss_good", pct, |f| (0.0..=100.0).contains(&f))?.unwrap_or(0.0);
        Some(Loss::GilbertElliott { p, r, loss_bad_pct, loss_good_pct })
    } else {
        if let Some(k) = ge_keys.iter().find(|k| t.has(k)) {
            return Err(t.err(t.key_loc(k), format!("{}: `{k}` needs loss_model = \"gilbert-elliott\"", t.what)));
        }
        let pct = t.number("loss", pct, |f| (0.0..=100.0).contains(&f))?;
        match (pct, model) {
            (Some(pct), _) => Some(Loss::Random { pct }),
            (None, Some(_)) => {
                return Err(
                    t.err(t.key_loc("loss_model"), format!("{}: loss_model = \"random\" needs `loss` (%)", t.what))
                )
            }
            (None, None) => None,
        }
    };
    let max_queue_size = t.integer("max_queue_size", 1..=MAX_QUEUE_PACKETS)?;
    Ok(LinkParams { bw_mbit, delay: delays[0], jitter: delays[1], loss, max_queue_size })
}

/// Shortest meter sampling interval.
pub const MIN_SAMPLE: Duration = Duration::from_millis(10);

/// A meter name pattern: dotted parts that are names, `*` or `**`, or names with `*` inside.
fn valid_meter_pattern(p: &str) -> bool {
    !p.is_empty() && p.split('.').all(|part| !part.is_empty() && valid_name(&part.replace('*', "x")))
}

/// A dotted knob name: at least two valid names joined by dots.
fn valid_knob(name: &str) -> bool {
    name.split('.').count() >= 2 && name.split('.').all(valid_name)
}

/// Parses link parameters written as TOML `key = value` lines (the keys of an event's `set`), as `lab link A B set`
/// does with its `KEY=VALUE` arguments; `file` names the source in errors.
pub fn parse_link_params(file: &str, text: &str) -> Result<LinkParams, ConfigError> {
    let doc = Doc { file: Arc::from(file), text };
    let (spans, table) = parse_located(&doc.file, text)?;
    let t = Tbl {
        doc: &doc,
        values: &table,
        spans: Some(spans.get_ref()),
        location: doc.start(),
        what: "the link parameters".into(),
    };
    t.check_keys(PARAM_KEYS)?;
    let params = link_params(&t)?;
    if params == LinkParams::default() {
        return Err(t.err(doc.start(), format!("no link parameter given; expected one of: {}", PARAM_KEYS.join(", "))));
    }
    Ok(params)
}

impl Lab {
    /// Parses and validates a lab description; `file` names it in errors. Nothing is created.
    pub fn parse(file: &str, text: &str) -> Result<Lab, ConfigError> {
        let doc = Doc { file: Arc::from(file), text };
        if text.len() > MAX_LAB_FILE_BYTES {
            return Err(ConfigError::new(
                Some(doc.start()),
                format!("lab description larger than {MAX_LAB_FILE_BYTES} bytes"),
            ));
        }
        let (spans, table) = parse_located(&doc.file, text)?;
        let root = Tbl {
            doc: &doc,
            values: &table,
            spans: Some(spans.get_ref()),
            location: doc.start(),
            what: "the lab file".into(),
        };
        root.check_keys(&["lab", "hosts", "links", "programs", "events", "routes"])?;

        let head = root.table("lab", "[lab]".into())?.ok_or_else(|| {
            ConfigError::new(Some(doc.start()), "the lab file needs a [lab] table with name and duration")
        })?;
        head.check_keys(&["name", "duration", "seed", "sample", "meters", "realtime"])?;
        let name = head.required_string("name")?.to_string();
        if !valid_name(&name) {
            return Err(head.err(
                head.value_loc("name"),
                format!("invalid lab name {name:?}: expected lowercase letters, digits, '_' or '-' (at most 64)"),
            ));
        }
        let duration = head
            .duration("duration")?
            .ok_or_else(|| head.err(head.location.clone(), "[lab] needs `duration` (e.g. \"20s\")"))?;
        if duration.is_zero() {
            return Err(head.err(head.value_loc("duration"), "`duration` in [lab]: expected more than 0s"));
        }
        let seed = head.integer("seed", 0..=i64::MAX as u64)?.unwrap_or(1);
        let realtime = head.integer("realtime", 0..=99)?.map_or(DEFAULT_REALTIME, |p| p as u8);
        let sample = head.duration("sample")?.unwrap_or(Duration::from_secs(1));
        if sample < MIN_SAMPLE {
            return Err(head.err(
                head.value_loc("sample"),
                format!("`sample` in [lab]: expected at least {}", format_duration(MIN_SAMPLE)),
            ));
        }
        let meters = match head.values.get("meters") {
            None => vec!["link.**".to_string()],
            Some(v) => {
                let items = v.as_array().filter(|a| a.iter().all(|x| x.as_str().is_some_and(valid_meter_pattern)));
                let Some(items) = items else {
                    return Err(head.err(
                        head.value_loc("meters"),
                        format!(
                            "`meters` in [lab]: expected a list of dotted name patterns like \"link.*\", got {}",
                            describe(v)
                        ),
                    ));
                };
                items.iter().filter_map(|x| x.as_str().map(str::to_string)).collect()
            }
        };

        let mut hosts: Vec<Host> = Vec::new();
        if let Some(ht) = root.table("hosts", "[hosts]".into())? {
            for (hname, body) in ht.values {
                let location = ht.key_loc(hname);
                if !valid_name(hname) || hname.len() > MAX_HOST_NAME {
                    return Err(ht.err(location, format!("invalid host name {hname:?}: expected a lowercase letter or digit, then letters, digits, '_' or '-', at most {MAX_HOST_NAME} characters")));
                }
                if body.as_table().is_none() {
                    return Err(ht.err(
                        ht.value_loc(hname),
                        format!("host `{hname}`: expected a table ([hosts.{hname}]), got {}", describe(body)),
                    ));
                }
                let h = ht.table(hname, format!("host `{hname}`"))?.expect("present");
                h.check_keys(&["stack"])?;
                let stack = h.string("stack")?.map(str::to_string);
                if stack.as_deref() == Some("") {
                    return Err(
                        h.err(h.value_loc("stack"), format!("`stack` in host `{hname}`: expected a stack file path"))
                    );
                }
                hosts.push(Host { name: hname.clone(), stack, location });
            }
        }
        let find_host = |t: &Tbl<'_, '_, '_>, key: &str| -> Result<String, ConfigError> {
            let h = t.required_string(key)?;
            if hosts.iter().any(|x| x.name == h) {
                Ok(h.to_string())
            } else {
                let known: Vec<&str> = hosts.iter().map(|x| x.name.as_str()).collect();
                Err(t.err(
                    t.value_loc(key),
                    format!("`{key}` in {}: unknown host {h:?}; expected one of: {}", t.what, known.join(", ")),
                ))
            }
        };

        let mut links: Vec<Link> = Vec::new();
        for t in root.tables("links")? {
            let mut allowed = vec!["a", "b", "mtu", "capture"];
            allowed.extend_from_slice(PARAM_KEYS);
            t.check_keys(&allowed)?;
            let a = find_host(&t, "a")?;
            let b = find_host(&t, "b")?;
            if a == b {
                return Err(
                    t.err(t.value_loc("b"), format!("{}: a link joins two different hosts, got {a:?} twice", t.what))
                );
            }
            let lname = format!("{a}-{b}");
            if let Some(other) = links.iter().find(|l| (l.a == a && l.b == b) || (l.a == b && l.b == a)) {
                return Err(t.err(
                    t.location.clone(),
                    format!("duplicate link between {a} and {b} (already declared at {})", other.location),
                ));
            }
            if let Some(other) = links.iter().find(|l| l.name == lname) {
                return Err(t.err(
                    t.location.clone(),
                    format!(
                        "link name {lname:?} is ambiguous: also the name of the link declared at {}",
                        other.location
                    ),
                ));
            }
            let params = link_params(&t)?;
            let mtu = t.integer("mtu", 68..=65535)?.map(|m| m as u32);
            let capture = t.bool("capture")?.unwrap_or(false);
            links.push(Link { name: lname, a, b, params, mtu, capture, location: t.location.clone() });
        }

        let before_end = |t: &Tbl<'_, '_, '_>, at: Duration| -> Result<(), ConfigError> {
            if at >= duration {
                Err(t.err(
                    t.value_loc("at"),
                    format!(
                        "`at` in {}: {} is not before the end of the lab (duration {})",
                        t.what,
                        format_duration(at),
                        format_duration(duration)
                    ),
                ))
            } else {
                Ok(())
            }
        };

        let mut routes = Vec::new();
        for t in root.tables("routes")? {
            t.check_keys(&["host", "to", "via"])?;
            let host = find_host(&t, "host")?;
            let to = find_host(&t, "to")?;
            let via = find_host(&t, "via")?;
            if hosts.iter().any(|h| h.name == to && h.stack.is_none()) {
                return Err(t.err(t.value_loc("to"), format!("`to` in {}: {to:?} is a plain host; routes lead to the apps of a stacked host (with `stack = ...`)", t.what)));
            }
            if to == host {
                return Err(t.err(t.value_loc("to"), format!("`to` in {}: a host needs no route to itself", t.what)));
            }
            if !links.iter().any(|l| (l.a == host && l.b == via) || (l.a == via && l.b == host)) {
                return Err(t.err(
                    t.value_loc("via"),
                    format!("`via` in {}: {via:?} is not linked to {host:?}; the next hop must be a neighbour", t.what),
                ));
            }
            if let Some(other) = routes.iter().find(|r: &&RouteSpec| r.host == host && r.to == to) {
                return Err(t.err(
                    t.location.clone(),
                    format!("duplicate route from {host} to {to} (already declared at {})", other.location),
                ));
            }
            routes.push(RouteSpec { host, to, via, location: t.location.clone() });
        }

        let mut programs = Vec::new();
        for t in root.tables("programs")? {
            t.check_keys(&["host", "run", "background", "at"])?;
            let host = find_host(&t, "host")?;
            let run = t.required_string("run")?;
            if run.trim().is_empty() {
                return Err(t.err(t.value_loc("run"), format!("`run` in {}: expected a command line", t.what)));
            }
            let background = t.bool("background")?.unwrap_or(false);
            let at = t.duration("at")?.unwrap_or_default();
            before_end(&t, at)?;
            programs.push(Program { host, run: run.to_string(), background, at, location: t.location.clone() });
        }

        let mut events = Vec::new();
        for t in root.tables("events")? {
            t.check_keys(&["at", "link", "set", "down", "up", "knob", "value", "host", "capture", "rules"])?;
            let at = t
                .duration("at")?
                .ok_or_else(|| t.err(t.location.clone(), format!("{} needs `at` (e.g. \"6s\")", t.what)))?;
            before_end(&t, at)?;
            // The stacked host a knob or rules event applies to, if given.
            let stacked_host = |t: &Tbl<'_, '_, '_>, what: &str| -> Result<Option<String>, ConfigError> {
                if !t.has("host") {
                    return Ok(None);
                }
                let h = find_host(t, "host")?;
                if hosts.iter().any(|x| x.name == h && x.stack.is_none()) {
                    return Err(t.err(t.value_loc("host"), format!("`host` in {}: {h:?} is a plain host; {what} exist only on stacked hosts (with `stack = ...`)", t.what)));
                }
                Ok(Some(h))
            };
            let kinds: Vec<&str> = ["link", "knob", "rules"].into_iter().filter(|k| t.has(k)).collect();
            let action = match kinds.as_slice() {
                ["rules"] => {
                    if let Some(k) = ["set", "down", "up", "capture", "value"].into_iter().find(|k| t.has(k)) {
                        return Err(t.err(
                            t.key_loc(k),
                            format!("{}: `{k}` is for link or knob events, not rules events", t.what),
                        ));
                    }
                    let file = t.required_string("rules")?;
                    if file.trim().is_empty() {
                        return Err(t.err(
                            t.value_loc("rules"),
                            format!("`rules` in {}: expected a rule file path (relative to the lab file)", t.what),
                        ));
                    }
                    let host = stacked_host(&t, "rule engines")?;
                    Action::Rules { host, file: file.to_string() }
                }
                ["link"] => {
                    if let Some(k) = ["value", "host"].into_iter().find(|k| t.has(k)) {
                        return Err(t.err(
                            t.key_loc(k),
                            format!("{}: `{k}` is for knob or rules events, not link events", t.what),
                        ));
                    }
                    let written = t.required_string("link")?;
                    let link = links
                        .iter()
                        .find(|l| l.name == written || format!("{}-{}", l.b, l.a) == written)
                        .map(|l| l.name.clone())
                        .ok_or_else(|| {
                            let known: Vec<&str> = links.iter().map(|l| l.name.as_str()).collect();
                            t.err(
                                t.value_loc("link"),
                                format!(
                                    "`link` in {}: unknown link {written:?}; expected one of: {}",
                                    t.what,
                                    known.join(", ")
                                ),
                            )
                        })?;
                    let given: Vec<&str> = ["set", "down", "up", "capture"].into_iter().filter(|k| t.has(k)).collect();
                    if given.len() != 1 {
                        let loc = given.get(1).map_or_else(|| t.key_loc("link"), |k| t.key_loc(k));
                        return Err(t.err(
                            loc,
                            format!(
                                "{}: a link event needs exactly one of `set = {{ ... }}`, `down = true`, `up = true` or `capture = true`",
                                t.what
                            ),
                        ));
                    }
                    match given[0] {
                        "set" => {
                            let s = t.table("set", format!("`set` of {}", t.what))?.expect("present");
                            s.check_keys(PARAM_KEYS)?;
                            let params = link_params(&s)?;
                            if params == LinkParams::default() {
                                return Err(s.err(
                                    t.value_loc("set"),
                                    format!(
                                        "{}: `set` changes nothing; expected one of: {}",
                                        t.what,
                                        PARAM_KEYS.join(", ")
                                    ),
                                ));
                            }
                            Action::LinkSet { link, params }
                        }
                        k => {
                            if t.bool(k)? != Some(true) {
                                return Err(t.err(t.value_loc(k), format!("`{k}` in {}: expected true", t.what)));
                            }
                            match k {
                                "down" => Action::LinkDown { link },
                                "up" => Action::LinkUp { link },
                                _ => Action::Capture { link },
                            }
                        }
                    }
                }
                ["knob"] => {
                    if let Some(k) = ["set", "down", "up", "capture"].into_iter().find(|k| t.has(k)) {
                        return Err(
                            t.err(t.key_loc(k), format!("{}: `{k}` is for link events, not knob events", t.what))
                        );
                    }
                    let knob = t.required_string("knob")?;
                    if !valid_knob(knob) {
                        return Err(t.err(
                            t.value_loc("knob"),
                            format!(
                                "`knob` in {}: expected a dotted knob name like \"module.x.select\", got {knob:?}",
                                t.what
                            ),
                        ));
                    }
                    let value = t
                        .typed("value", "a number, boolean or string", Value::from_toml)?
                        .ok_or_else(|| t.err(t.key_loc("knob"), format!("{}: a knob event needs `value`", t.what)))?;
                    let host = stacked_host(&t, "knobs")?;
                    Action::Knob { host, knob: knob.to_string(), value }
                }
                _ => {
                    let loc = kinds.get(1).map_or_else(|| t.location.clone(), |k| t.key_loc(k));
                    return Err(t.err(
                        loc,
                        format!(
                            "{}: expected exactly one of `link` (with set, down or up), `knob` (with value) or `rules` (a rule file)",
                            t.what
                        ),
                    ));
                }
            };
            events.push(Event { at, action, location: t.location.clone() });
        }
        events.sort_by_key(|e| e.at);

        Ok(Lab { name, duration, seed, realtime, sample, meters, hosts, links, programs, events, routes })
    }

    /// Every scheduled action in time order, described in one line each: program starts, events and the end of the
    /// lab. At the same instant, programs come before events, each in file order. Deterministic.
    pub fn timeline(&self) -> Vec<(Duration, String)> {
        let mut out: Vec<(Duration, String)> = Vec::new();
        for p in &self.programs {
            let mode = if p.background { "background" } else { "foreground" };
            out.push((p.at, format!("start on {} ({mode}): {}", p.host, p.run)));
        }
        for e in &self.events {
            out.push((e.at, e.action.describe()));
        }
        out.sort_by_key(|(at, _)| *at);
        out.push((self.duration, format!("end of lab {}", self.name)));
        out
    }
}

#[cfg(test)]
mod rules_event_tests {
    use super::*;

    const HEAD: &str = "[lab]\nname = \"r\"\nduration = \"10s\"\n[hosts.h1]\n[hosts.app]\nstack = \"s.toml\"\n\
                        [[links]]\na = \"h1\"\nb = \"app\"\n";

    fn parse(events: &str) -> Result<Lab, ConfigError> {
        Lab::parse("r.toml", &format!("{HEAD}{events}"))
    }

    /// The error's line and message for `events` appended to the head (which has 9 lines).
    fn error(events: &str) -> (usize, String) {
        let e = parse(events).expect_err(events);
        let loc = e.location.clone().unwrap_or_else(|| panic!("{events:?}: no location: {e}"));
        assert_eq!(&*loc.file, "r.toml");
        (loc.line, e.message)
    }

    #[test]
    fn rules_events_parse_for_the_wire_and_for_a_stacked_host() {
        let lab = parse(
            "[[events]]\nat = \"2s\"\nrules = \"cc.rules\"\n\
             [[events]]\nat = \"1s\"\nrules = \"/abs/x.rules\"\nhost = \"app\"\n",
        )
        .expect("valid");
        assert_eq!(
            lab.events.iter().map(|e| e.action.clone()).collect::<Vec<_>>(),
            vec![
                Action::Rules { host: Some("app".into()), file: "/abs/x.rules".into() },
                Action::Rules { host: None, file: "cc.rules".into() },
            ]
        );
        assert_eq!(lab.events[1].location.line, 10);
        let timeline: Vec<String> = lab.timeline().into_iter().map(|(_, s)| s).collect();
        assert_eq!(timeline[..2], ["rules /abs/x.rules on app".to_string(), "rules cc.rules".to_string()]);
    }

    #[test]
    fn bad_rules_events_are_located() {
        let cases: &[(&str, usize, &str)] = &[
            ("[[events]]\nat = \"1s\"\nrules = \"x.rules\"\nhost = \"h1\"\n", 13, "plain host; rule engines exist"),
            ("[[events]]\nat = \"1s\"\nrules = \"x.rules\"\nhost = \"h7\"\n", 13, "unknown host"),
            ("[[events]]\nat = \"1s\"\nrules = \"  \"\n", 12, "expected a rule file path"),
            ("[[events]]\nat = \"1s\"\nrules = 3\n", 12, "expected a string"),
            ("[[events]]\nat = \"1s\"\nrules = \"x.rules\"\nvalue = 1\n", 13, "not rules events"),
            ("[[events]]\nat = \"1s\"\nrules = \"x.rules\"\ndown = true\n", 13, "not rules events"),
            ("[[events]]\nat = \"1s\"\nknob = \"a.b\"\nvalue = 1\nrules = \"x.rules\"\n", 14, "exactly one of"),
            ("[[events]]\nat = \"10s\"\nrules = \"x.rules\"\n", 11, "not before the end"),
        ];
        for (events, line, needle) in cases {
            let (l, message) = error(events);
            assert_eq!(l, *line, "{events:?}: {message}");
            assert!(message.contains(needle), "{events:?}: {message} (wanted {needle:?})");
        }
    }
}

#[cfg(test)]
mod realtime_tests {
    use super::*;

    fn parse(realtime: &str) -> Result<Lab, ConfigError> {
        Lab::parse("rt.toml", &format!("[lab]\nname = \"rt\"\nduration = \"1s\"\n{realtime}[hosts.h1]\n"))
    }

    #[test]
    fn realtime_defaults_to_the_labs_priority_and_takes_0_to_99() {
        assert_eq!(parse("").expect("valid").realtime, DEFAULT_REALTIME);
        assert_eq!(parse("realtime = 0\n").expect("valid").realtime, 0);
        assert_eq!(parse("realtime = 99\n").expect("valid").realtime, 99);
        for bad in ["realtime = 100\n", "realtime = -1\n", "realtime = \"high\"\n", "realtime = true\n"] {
            let e = parse(bad).expect_err(bad);
            let loc = e.location.clone().unwrap_or_else(|| panic!("{bad:?}: no location: {e}"));
            assert_eq!((&*loc.file, loc.line), ("rt.toml", 4), "{bad:?}: {e}");
            assert!(e.message.contains("0..=99"), "{bad:?}: {}", e.message);
        }
    }
}
