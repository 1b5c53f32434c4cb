//! `inspect`: an application-layer filter on the byte stream (FreeNA's stateful application firewall). Each rule
//! of `patterns` is `ACTION [down|up] literal|regex PATTERN`:
//!
//! - `ACTION`: `count` (its meter `rule<N>_matches_total` only), `alert` (also `alerts_total`, a log line and an
//!   `inspect_alert` alert to the module's listeners, with the rule's number), `close` (also `closed_total`: the
//!   flow is aborted both ways at once, reason `inspect`, and the chunk that matched is not passed on);
//! - `down` / `up`: only the data travelling that way (default: both);
//! - `literal TEXT`: the bytes of TEXT (everything after `literal `, spaces included); `regex RE`: a regular
//!   expression of the `regex` crate on bytes (linear time: no backtracking, so no pattern can take exponential
//!   time; one whose compiled form exceeds 1 MiB is refused).
//!
//! Matching across chunks: per flow and direction it keeps the last `window - 1` bytes seen and searches them with
//! each new chunk, so a match up to `window` bytes long is found wherever the chunks were cut; a match is reported
//! when it ends in the new chunk (so once). Memory: two tails of at most `window` bytes per flow, and one scratch
//! buffer. Frames of flows its `select` rules left out pass unexamined.
//!
//! `active` is a knob: false takes it out of its flows' paths (their bytes pass unexamined, and the tails are
//! dropped, so no match spans the time it was out); true searches again from the next chunk.

use super::active;
use super::flows::{read_select, slot, Flows, HandedFlows, Seen, SelectRule, SelectionMeters, SELECT, SELECT_DOC};
use crate::stream::{BOTH_WAYS_IN, BOTH_WAYS_OUT};
use flexstack_core::module::handed_over;
use flexstack_core::{
    field, kind_from_decl, Batch, ConfigError, Direction, Frame, KindDecl, Meter, MeterDecl, Module, ModuleBuilder,
    ModuleInterface, ModuleKind, ModuleVars, Output, Param, Settings, Value, ValueType, VarSpec,
};
use regex::bytes::{Regex, RegexBuilder};
use std::fmt;

/// The kind's name in stack files.
pub const KIND: &str = "inspect";

/// Largest compiled pattern accepted, in bytes (the `regex` crate's size limit).
pub const MAX_PATTERN_SIZE: usize = 1 << 20;

/// Most rules.
pub const MAX_RULES: usize = 64;

/// The `inspect` module kind.
pub struct InspectKind;

/// Settings.
struct Config {
    window: u64,
    active: bool,
}

type P = Param<Config>;

const DECL: KindDecl<Config, Meters> = KindDecl {
    inputs: BOTH_WAYS_IN,
    outputs: BOTH_WAYS_OUT,
    params: &[
        P::manual(
            "patterns",
            "array of strings",
            "the rules: `count|alert|close [down|up] literal|regex PATTERN`",
            "[]",
        ),
        P::u64(
            "window",
            "bytes",
            "longest match found across chunk boundaries (bytes kept per flow and direction)",
            1024,
            field!(window),
        )
        .range(1.0, 65536.0)
        .setting(),
        active::param(field!(active)),
        P::manual(SELECT, "array of strings", SELECT_DOC, "[\"use *\"]"),
    ],
    meters: &[
        MeterDecl::pattern("rule<N>_matches_total", "matches", "matches of rule N (1, 2, ...)"),
        MeterDecl::u64("matches_total", "matches", "matches of every rule", |m| &mut m.matches),
        MeterDecl::u64("alerts_total", "matches", "matches of `alert` rules", |m| &mut m.alerts),
        MeterDecl::u64("closed_total", "flows", "flows aborted by a `close` rule", |m| &mut m.closed),
        MeterDecl::u64("bytes_scanned_total", "bytes", "data bytes searched", |m| &mut m.scanned),
    ],
    more_meters: SelectionMeters::specs,
    breaks_cycles: true,
    ..KindDecl::new(KIND, "a stream service: literal and regex patterns on the byte stream; count, alert or close")
};

/// The meters.
#[derive(Default)]
struct Meters {
    matches: Meter,
    alerts: Meter,
    closed: Meter,
    scanned: Meter,
}

/// What a rule does on a match.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Its meter.
    Count,
    /// Meter, log line and alert.
    Alert,
    /// Abort the flow.
    Close,
}

/// One rule.
#[derive(Clone, Debug)]
pub struct Rule {
    /// What it does.
    pub action: Action,
    /// Only this direction (`None`: both).
    pub dir: Option<Direction>,
    /// The pattern as written (`literal X` / `regex X`).
    pub text: String,
    re: Regex,
}

impl Rule {
    /// Parses `ACTION [down|up] literal|regex PATTERN`.
    pub fn parse(text: &str) -> Result<Rule, String> {
        let (action, rest) =
            text.split_once(' ').ok_or("expected `count|alert|close [down|up] literal|regex PATTERN`")?;
        let action = match action {
            "count" => Action::Count,
            "alert" => Action::Alert,
            "close" => Action::Close,
            _ => return Err(format!("expected an action: count, alert or close, got {action:?}")),
        };
        let (mut word, mut rest) = rest.split_once(' ').unwrap_or((rest, ""));
        let dir = match word {
            "down" => Some(Direction::Down),
            "up" => Some(Direction::Up),
            _ => None,
        };
        if dir.is_some() {
            (word, rest) = rest.split_once(' ').unwrap_or((rest, ""));
        }
        if rest.is_empty() {
            return Err(format!("no pattern after {word:?}"));
        }
        let source = match word {
            "literal" => regex::escape(rest),
            "regex" => rest.to_string(),
            _ => return Err(format!("expected literal or regex, got {word:?}")),
        };
        let re = RegexBuilder::new(&source)
            .size_limit(MAX_PATTERN_SIZE)
            .dfa_size_limit(MAX_PATTERN_SIZE)
            .unicode(false)
            .build()
            .map_err(|e| match e {
                regex::Error::CompiledTooBig(n) => {
                    format!("pattern too large: its compiled form exceeds {n} bytes (simplify it)")
                }
                e => format!("bad regex: {}", e.to_string().lines().last().unwrap_or("?")),
            })?;
        Ok(Rule { action, dir, text: format!("{word} {rest}"), re })
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let action = match self.action {
            Action::Count => "count",
            Action::Alert => "alert",
            Action::Close => "close",
        };
        let dir = match self.dir {
            Some(Direction::Down) => " down",
            Some(Direction::Up) => " up",
            None => "",
        };
        write!(f, "{action}{dir} {}", self.text)
    }
}

impl ModuleKind for InspectKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(KIND);
        let mut cfg = Config { window: 0, active: true };
        DECL.read(&mut r, &mut cfg)?;
        let texts = r.strings("patterns")?.unwrap_or_default();
        if texts.len() > MAX_RULES {
            return Err(r.error("patterns", format!("at most {MAX_RULES} rules, got {}", texts.len())));
        }
        let rules = texts
            .iter()
            .enumerate()
            .map(|(i, t)| Rule::parse(t).map_err(|e| r.error("patterns", format!("rule {}: {e}", i + 1))))
            .collect::<Result<Vec<_>, _>>()?;
        let select = read_select(&mut r)?;
        r.finish()?;
        Ok(Box::new(InspectBuilder { cfg, rules, select }))
    }
}

struct InspectBuilder {
    cfg: Config,
    rules: Vec<Rule>,
    select: Vec<SelectRule>,
}

impl ModuleBuilder for InspectBuilder {
    fn interface(&self) -> ModuleInterface {
        let mut iface = DECL.interface(&self.cfg);
        for (i, rule) in self.rules.iter().enumerate() {
            let desc = format!("matches of rule {}: {rule}", i + 1);
            iface.vars.push(VarSpec::meter(&format!("rule{}_matches_total", i + 1), ValueType::U64, "matches", &desc));
        }
        iface
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        DECL.publish(&self.cfg, vars);
        let per_rule = (1..=self.rules.len()).map(|n| vars.meter(&format!("rule{n}_matches_total"))).collect();
        Box::new(Inspect {
            window: self.cfg.window as usize,
            cfg: self.cfg,
            rules: self.rules,
            per_rule,
            m: DECL.meters(vars),
            flows: Flows::new(self.select, vars),
            scratch: Vec::new(),
        })
    }
}

/// A running `inspect`.
pub struct Inspect {
    cfg: Config,
    window: usize,
    rules: Vec<Rule>,
    per_rule: Vec<Meter>,
    m: Meters,
    /// Per flow, the tail of each direction.
    flows: Flows<[Vec<u8>; 2]>,
    scratch: Vec<u8>,
}

impl Inspect {
    /// Searches a chunk of `flow` travelling `dir` (with the tail before it); true if a `close` rule matched.
    fn scan(&mut self, flow: u64, dir: Direction, bytes: &[u8], out: &mut Output<'_>) -> bool {
        let tail = &mut self.flows.get_mut(flow).expect("a flow it works on")[slot(dir)];
        self.scratch.clear();
        self.scratch.extend_from_slice(tail);
        self.scratch.extend_from_slice(bytes);
        let old = tail.len();
        self.m.scanned.add(bytes.len() as u64);
        let mut close = false;
        for (i, rule) in self.rules.iter().enumerate() {
            if rule.dir.is_some_and(|d| d != dir) {
                continue;
            }
            let n = rule.re.find_iter(&self.scratch).filter(|m| m.end() > old && m.end() > m.start()).count() as u64;
            if n == 0 {
                continue;
            }
            self.per_rule[i].add(n);
            self.m.matches.add(n);
            match rule.action {
                Action::Count => {}
                Action::Alert => {
                    self.m.alerts.add(n);
                    tracing::warn!(flow, rule = i + 1, pattern = %rule, "inspect: pattern matched");
                    out.alert("inspect_alert", Value::U64(i as u64 + 1));
                }
                Action::Close => close = true,
            }
        }
        let keep = self.window.saturating_sub(1).min(self.scratch.len());
        tail.clear();
        tail.extend_from_slice(&self.scratch[self.scratch.len() - keep..]);
        close
    }
}

impl Module for Inspect {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        for frame in input.drain(..) {
            let Frame::Data(p) = frame else {
                out.emit(0, frame);
                continue;
            };
            match self.flows.see(&p, |_| [Vec::new(), Vec::new()]).0 {
                Seen::Data(_) if !self.cfg.active => {}
                Seen::Data(flow) if self.scan(flow, p.direction(), p.data(), out) => {
                    self.m.closed.add(1);
                    tracing::info!(flow, "inspect: closing the flow");
                    self.flows.close(flow, KIND, out);
                    continue; // the chunk that matched goes nowhere
                }
                Seen::Fin(flow) => {
                    self.flows.fin(flow, p.direction());
                }
                _ => {}
            }
            out.emit(0, p);
        }
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        DECL.write(&mut self.cfg, knob, value)?;
        if !self.cfg.active {
            for (_, tails) in self.flows.iter_mut() {
                *tails = Default::default();
            }
        }
        Ok(())
    }

    fn take_state(&mut self) -> Option<Box<dyn std::any::Any>> {
        Some(Box::new(self.flows.take()))
    }

    fn adopt_state(&mut self, state: Box<dyn std::any::Any>) -> Result<(), String> {
        self.flows.adopt(handed_over::<HandedFlows<[Vec<u8>; 2]>>(state, "an inspect's flows")?);
        Ok(())
    }
}
