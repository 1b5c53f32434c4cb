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

mod parse;
pub mod plan;
pub mod report;

pub use parse::parse_link_params;

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

/// Shortest meter sampling interval.
pub const MIN_SAMPLE: Duration = Duration::from_millis(10);

impl Lab {
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
