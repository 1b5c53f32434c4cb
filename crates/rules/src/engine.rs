//! The runtime: loaded rules as instantiated units, their signalling, and the revision repository.
//!
//! A [`RuleEngine`] is owned by one thread (the daemon's control thread) and driven by calls that each take `now`
//! and an [`Environment`] to read variables from; it never reads a clock and never writes a knob itself.
//!
//! Calling order:
//! 1. `handle_*` inputs, at any time: [`RuleEngine::handle_load_text`], [`RuleEngine::handle_load`],
//!    [`RuleEngine::handle_unload`], [`RuleEngine::handle_replace`], [`RuleEngine::handle_rollback`] (changes,
//!    each a new revision), [`RuleEngine::handle_meter_changed`] (a pushed value), [`RuleEngine::evaluate`]
//!    (a pull, as a trigger would), [`RuleEngine::handle_write_result`] (how a knob write went).
//! 2. [`RuleEngine::advance`] whenever `Step::next_wakeup` comes, and at the caller's sampling interval: it
//!    creates and drops per-name instances, fires due timers, samples the meters that rules wait on, runs the
//!    resulting evaluations, and returns the knob writes to apply with the next wake-up time.
//! 3. [`RuleEngine::poll_notice`] for what happened on its own (context sections loading rules, failed writes).
//!
//! Reads: [`RuleEngine::list`], [`RuleEngine::show`], [`RuleEngine::value`], [`RuleEngine::log`],
//! [`RuleEngine::diff`]. [`drive`] is `advance` plus applying the writes to an environment, for tests and tools.
//!
//! How rules run (see docs/rules.md): each loaded rule is an *instance* (one per set of values its `*`s capture) owning the
//! units of its expression. A rule with an incoming trigger, or used by such a rule, is *pulled*: it is only
//! evaluated by query. Every other rule is *pushed*: it is evaluated (by a query of its own units) when a meter
//! it reads changes, a timer in it ticks, or a pushed rule it uses emits. A rule *emits* when its output changes;
//! then the pushed rules that use it are evaluated and, if the new output is true (or a non-zero number, or a
//! non-empty string), the targets of its triggers run. Evaluations of one wave run in dependency order, each unit
//! at most once.
//!
//! How it is done fast: the units' hot data sit in dense arrays in dependency order, and queries and single-source
//! events run compiled plans (flat lists of steps, built by the private `plan` module when the units are rebuilt
//! or at an instance's first query) instead of recursing and scheduling; docs/rules.md, "How the engine
//! evaluates", describes them.

use crate::compile::{self, compile, Program, RuleAction, RuleDef};
use crate::diag::Diagnostic;
use crate::env::{Environment, HeldValue};
use crate::limits::{instance_bytes, Cap, Limits, Usage};
use crate::plan::{InstanceShape, Plans, UnitStep, WaveStep};
use crate::syntax::Section;
use crate::units::{
    assign, cache_valid, compute, compute_stateless, dup, truthy, update, Core, EvalCx, Hot, KnobWrite, Node, Op,
    Param, StateValue, Unit, UnitKind, ANY_QUERY,
};
use flexstack_core::{Time, Value};
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

mod reconcile;

/// Deepest recursion of a query before it continues with an explicit stack (bounds the thread's stack use).
const MAX_QUERY_DEPTH: u32 = 512;

/// Most rounds of context actions (a load that triggers a load ...) run by one call.
const MAX_ACTION_ROUNDS: usize = 16;

/// Times serialize as nanoseconds on the caller's clock.
fn ser_time<S: serde::Serializer>(t: &Time, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(t.as_nanos())
}

fn ser_opt_time<S: serde::Serializer>(t: &Option<Time>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => s.serialize_some(&t.as_nanos()),
        None => s.serialize_none(),
    }
}

/// Why a request to the engine was refused (nothing changed).
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RuleError {
    /// The text has errors (each with line:column).
    #[error("{}", .0.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<Diagnostic>),
    /// No rule by that name is defined.
    #[error("unknown rule {0}: expected a rule defined by a loaded text (see `rules list`)")]
    UnknownRule(String),
    /// The rule is defined but not loaded by itself (it may run as another rule's dependency).
    #[error("rule {0} is not loaded by itself: expected one of the loaded rules (see `rules list`)")]
    NotLoaded(String),
    /// No revision by that number (never made, or no longer kept: see [`Limits::max_revisions`]).
    #[error("unknown revision {0}: expected one listed by `rules log`")]
    UnknownRevision(u64),
    /// A cap of the engine's [`Limits`] refused the change; nothing changed.
    #[error("{what} refused: {}", over(*.cap, *.wanted, *.limit))]
    Limit {
        /// The change refused (`load cc.rules`).
        what: String,
        /// The cap.
        cap: Cap,
        /// How much the change would take (instances, or estimated bytes).
        wanted: usize,
        /// The cap's value.
        limit: usize,
    },
    /// Rules to delete are still used by rules that stay.
    #[error("rule {0} is used by {1}: expected those deleted too (in the same command) or first")]
    InUse(String, String),
}

/// `it would run 20000 rule instances, more than the cap of 10000 (max_instances)`.
fn over(cap: Cap, wanted: usize, limit: usize) -> String {
    match cap {
        Cap::Instances => {
            format!("it would run {wanted} rule instances, more than the cap of {limit} ({})", cap.name())
        }
        Cap::Memory => {
            let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
            format!(
                "its rules would take an estimated {:.1} MiB, more than the cap of {:.1} MiB ({})",
                mib(wanted),
                mib(limit),
                cap.name()
            )
        }
    }
}

/// What [`RuleEngine::advance`] returns.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Step {
    /// Knob writes to apply, in order; report each result with [`RuleEngine::handle_write_result`].
    pub writes: Vec<KnobWrite>,
    /// When a timer is next due (call `advance` then at the latest).
    #[serde(serialize_with = "ser_opt_time")]
    pub next_wakeup: Option<Time>,
}

/// Something the engine did on its own.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Notice {
    /// When.
    #[serde(serialize_with = "ser_time")]
    pub at: Time,
    /// What happened.
    pub message: String,
}

/// The result of loading a text.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LoadReport {
    /// The revision it became.
    pub revision: u64,
    /// The rules it defined, in written order.
    pub defined: Vec<String>,
    /// The rules loaded by it (outside `[manual]`).
    pub loaded: Vec<String>,
    /// Warnings (each with line:column).
    pub warnings: Vec<Diagnostic>,
}

/// One entry of the repository's log.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RevisionInfo {
    /// Its number, from 1.
    pub number: u64,
    /// What changed.
    pub what: String,
    /// When (the caller's clock).
    #[serde(serialize_with = "ser_time")]
    pub at: Time,
    /// Rules defined in it.
    pub rules: usize,
    /// Rules loaded by themselves in it.
    pub loaded: Vec<String>,
}

/// A revision: its log entry (whose `loaded` is filled in from `explicit` when listed), its program and the rules
/// loaded by themselves, both shared with the other revisions that have the same.
struct Revision {
    info: RevisionInfo,
    program: Arc<Program>,
    explicit: Arc<BTreeSet<String>>,
}

/// A unit as `show` presents it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct UnitView {
    /// `rule[captures]/path`.
    pub key: String,
    /// The unit's kind.
    pub kind: &'static str,
    /// The keys of its inputs.
    pub inputs: Vec<String>,
    /// Its current output.
    pub value: Option<Value>,
    /// Its private state.
    pub state: BTreeMap<&'static str, StateValue>,
}

/// One instance of a rule as `show` presents it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct InstanceView {
    /// The segments the `*`s captured (empty for a rule without wildcards); `binding` on the wire, its name
    /// before "binding" was kept for late binding alone.
    #[serde(rename = "binding")]
    pub captures: Vec<String>,
    /// How many loaded things hold it: 1 if loaded by itself, plus 1 per loaded rule instance using it.
    pub refcount: u32,
    /// Evaluated only by query (it has a trigger or is used by a rule that has one).
    pub pulled: bool,
    /// Its output.
    pub value: Option<Value>,
    /// Its units, root first.
    pub units: Vec<UnitView>,
}

/// A rule as `show` presents it: its text, commands, and the live unit graph of each instance.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RuleView {
    /// The rule's name.
    pub name: String,
    /// Its section.
    pub section: Section,
    /// The text it came from.
    pub source: String,
    /// Its definition, triggers and actions as text.
    pub text: Vec<String>,
    /// Its preprocessed commands.
    pub commands: Vec<String>,
    /// Loaded by itself (not only as a dependency).
    pub explicit: bool,
    /// Its running instances (none when not loaded).
    pub instances: Vec<InstanceView>,
}

/// A line of `list`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RuleSummary {
    /// The rule's name.
    pub name: String,
    /// Its section.
    pub section: Section,
    /// The text it came from.
    pub source: String,
    /// Loaded by itself.
    pub explicit: bool,
    /// Running instances (0: not loaded).
    pub instances: usize,
    /// The output of its only instance (none for per-name rules).
    pub value: Option<Value>,
}

#[derive(Clone, Debug)]
enum Fire {
    Eval(u32),
    Action(RuleAction),
}

#[derive(Debug)]
struct Instance {
    rule: String,
    captures: Vec<String>,
    root: u32,
    units: std::ops::Range<u32>,
    refs: Vec<u32>,
    pulled: bool,
    explicit: bool,
    refcount: u32,
    rank: u32,
}

/// The running units. `units` holds what identifies each unit and its state; the arrays after it hold what the
/// evaluation loop touches, densely: per unit its [`Hot`] entry (output, wave, inputs, owner, evaluation), the
/// inputs of all units in one flat list, and per instance its root and last emitted output.
#[derive(Default)]
struct Runtime {
    units: Vec<Unit>,
    hot: Vec<Hot>,
    /// Every unit's inputs, one after the other (see `Hot::first_input`).
    edges: Vec<u32>,
    instances: Vec<Instance>,
    /// Per instance: its root unit.
    roots: Vec<u32>,
    /// Per instance: its rank in the dependency order (a wave evaluates lower ranks first).
    ranks: Vec<u32>,
    /// Per instance: the output it last emitted (events are sent when the output differs from it). Not kept
    /// for instances in `selfcmp`, whose root's output is the last one they emitted.
    emitted: Vec<Option<Value>>,
    /// Per instance: pushed, with a root without state, and plans are on: its root's output is only ever changed
    /// by its own evaluation in a wave, so it is the last emitted output (no copy in `emitted`).
    selfcmp: Vec<bool>,
    /// The compiled unit plans and wave plans (see [`crate::plan`]).
    plans: Plans,
    by_rule: HashMap<(String, Vec<String>), u32>,
    /// Per rule name: its instances.
    of_rule: HashMap<String, Vec<u32>>,
    /// Per unit (and one more at the end): where its subscribers, the pushed instances evaluated when it emits,
    /// start in `sub_list`.
    sub_at: Vec<u32>,
    /// The subscribers of every unit, one list after the other: unit u's are `sub_list[sub_at[u]..sub_at[u + 1]]`.
    sub_list: Vec<u32>,
    /// Per instance: what runs when it emits a true value.
    fires: Vec<Vec<Fire>>,
    sampled: Vec<u32>,
    /// Per sampled unit (as `sampled`): its variable as the environment handed it out ([`Environment::hold`]),
    /// valid while the names' generation is `held_generation`.
    held: Vec<Option<Box<dyn HeldValue>>>,
    held_generation: Option<u64>,
    timers: Vec<u32>,
    epoch: u64,
}

/// The rule engine: rules, their running units and the repository of revisions. See the module docs.
pub struct RuleEngine {
    program: Arc<Program>,
    explicit: BTreeSet<String>,
    rt: Runtime,
    revisions: VecDeque<Revision>,
    /// The number the next revision gets (revisions beyond [`Limits::max_revisions`] go, the numbers go on).
    next_revision: u64,
    limits: Limits,
    /// Estimated bytes of the definitions (of `program`).
    def_bytes: usize,
    /// Estimated bytes of the running instances.
    running_bytes: usize,
    /// The instances (rule, captures) a cap kept from being created at the last rebuild, by rule.
    refused: HashMap<String, BTreeSet<Vec<String>>>,
    /// Instances refused since the engine started (each refusal of a name counted once, until it is created).
    refused_total: u64,
    /// The environment's [`Environment::names_generation`] when the per-name rules' names were last listed and
    /// found the same (`None`: list them at the next `advance`).
    listed: Option<u64>,
    notices: VecDeque<Notice>,
    writes: Vec<KnobWrite>,
    actions: Vec<(RuleAction, String)>,
    stack: Vec<(u32, bool)>,
    heap: BinaryHeap<Reverse<(u32, u32)>>,
    next: Option<u32>,
    queued: Vec<u8>,
    /// The sources (gets, timers) that emitted in the current call.
    sources: Vec<u32>,
    /// The instances `evaluate` starts a wave with (kept to reuse its allocation).
    seeds: Vec<(u32, bool)>,
    /// Use the compiled plans (off only in tests, to compare with the general evaluation).
    use_plans: bool,
}

impl Default for RuleEngine {
    fn default() -> Self {
        RuleEngine::new()
    }
}

/// `rule[a,b]` for an instance with captures, `rule` without.
fn instance_name(rule: &str, captures: &[String]) -> String {
    if captures.is_empty() {
        rule.to_string()
    } else {
        format!("{rule}[{}]", captures.join(","))
    }
}

/// Replaces the i-th `*` segment of `name` with `captures[i]`.
fn fill_wildcards(name: &str, captures: &[String]) -> String {
    if captures.is_empty() {
        return name.to_string();
    }
    let mut i = 0;
    name.split('.')
        .map(|seg| {
            if seg == "*" {
                i += 1;
                captures.get(i - 1).map_or("*", String::as_str)
            } else {
                seg
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// The segments `name` binds to the `*`s of `pattern` (same number of segments), or `None`.
fn capture(pattern: &str, name: &str) -> Option<Vec<String>> {
    let (p, n): (Vec<&str>, Vec<&str>) = (pattern.split('.').collect(), name.split('.').collect());
    if p.len() != n.len() {
        return None;
    }
    let mut out = Vec::new();
    for (a, b) in p.iter().zip(&n) {
        if *a == "*" {
            out.push(b.to_string());
        } else if a != b {
            return None;
        }
    }
    Some(out)
}

fn rename_refs(node: &mut Node, old: &str, new: &str) {
    match node {
        Node::Ref(r) if r == old => *r = new.to_string(),
        Node::Ref(_) => {}
        Node::Unit { args, .. } => args.iter_mut().for_each(|a| rename_refs(a, old, new)),
    }
}

impl RuleEngine {
    /// An engine with no rules and an empty repository.
    pub fn new() -> RuleEngine {
        RuleEngine {
            program: Arc::new(Program::default()),
            explicit: BTreeSet::new(),
            rt: Runtime::default(),
            revisions: VecDeque::new(),
            next_revision: 1,
            limits: Limits::DEFAULT,
            def_bytes: 0,
            running_bytes: 0,
            refused: HashMap::new(),
            refused_total: 0,
            listed: None,
            notices: VecDeque::new(),
            writes: Vec::new(),
            actions: Vec::new(),
            stack: Vec::new(),
            heap: BinaryHeap::new(),
            next: None,
            queued: Vec::new(),
            sources: Vec::new(),
            seeds: Vec::new(),
            use_plans: true,
        }
    }

    /// An engine with no rules, bounded by `limits`.
    pub fn with_limits(limits: Limits) -> RuleEngine {
        RuleEngine { limits, ..RuleEngine::new() }
    }

    /// The engine's caps.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Changes the caps; what runs now stays (a lower cap refuses what comes next). Revisions beyond a lower
    /// [`Limits::max_revisions`] go at once.
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
        self.listed = None;
        self.trim_revisions();
    }

    /// What the engine holds now, against its limits.
    pub fn usage(&self) -> Usage {
        Usage {
            instances: self.rt.instances.len(),
            units: self.rt.units.len(),
            definitions: self.program.rules.len(),
            revisions: self.revisions.len(),
            memory_bytes: self.def_bytes + self.running_bytes,
            refused_instances_total: self.refused_total,
        }
    }

    // ---- changes (each a revision) ----

    /// Checks and loads a rule text named `source`: its definitions replace rules of the same name (units at
    /// the same place keep their state), rules outside `[manual]` are loaded, and keywords on lines of their own
    /// run. Refused as a whole, with every error located, if anything is wrong, or if the rules would exceed a
    /// cap of the engine's [`Limits`].
    pub fn handle_load_text(
        &mut self,
        source: &str,
        text: &str,
        now: Time,
        env: &dyn Environment,
    ) -> Result<LoadReport, RuleError> {
        let c = compile(source, text, &self.program, env).map_err(RuleError::Invalid)?;
        let (old_program, old_explicit) = (self.program.clone(), self.explicit.clone());
        // Loading the same text again keeps the program it made (the revisions share it).
        if c.program != *self.program {
            self.program = Arc::new(c.program);
        }
        self.explicit.extend(c.to_load.iter().cloned());
        let what = format!("load {source}");
        let checked = c
            .actions
            .iter()
            .try_for_each(|a| self.apply_action(a, source))
            .and_then(|()| self.check_limits(&what, env));
        if let Err(e) = checked {
            self.program = old_program;
            self.explicit = old_explicit;
            return Err(e);
        }
        self.reconcile(now, env);
        self.run_actions(now, env);
        // The names, up to ten of them (a file may define thousands: the log keeps this text per revision).
        let mut names = c.defined.iter().take(10).cloned().collect::<Vec<_>>().join(", ");
        if c.defined.len() > 10 {
            names.push_str(&format!(", ... ({} rules)", c.defined.len()));
        }
        let revision = self.commit(format!("{what}: {names}"), now);
        Ok(LoadReport { revision, defined: c.defined, loaded: c.to_load, warnings: c.warnings })
    }

    /// Loads defined rules by name (with their dependencies); refused if that would exceed a cap.
    pub fn handle_load(&mut self, names: &[&str], now: Time, env: &dyn Environment) -> Result<u64, RuleError> {
        if let Some(n) = names.iter().find(|n| !self.program.rules.contains_key(**n)) {
            return Err(RuleError::UnknownRule(n.to_string()));
        }
        let old = self.explicit.clone();
        self.explicit.extend(names.iter().map(|n| n.to_string()));
        let what = format!("load {}", names.join(", "));
        if let Err(e) = self.check_limits(&what, env) {
            self.explicit = old;
            return Err(e);
        }
        self.reconcile(now, env);
        self.run_actions(now, env);
        Ok(self.commit(what, now))
    }

    /// Unloads rules loaded by themselves (`["ALL"]`: every rule, those of context sections too). A rule that
    /// another loaded rule uses keeps running, with its state, as that rule's dependency (its reference count
    /// drops by one). Definitions stay: [`RuleEngine::handle_delete`] removes them.
    pub fn handle_unload(&mut self, names: &[&str], now: Time, env: &dyn Environment) -> Result<u64, RuleError> {
        if names == ["ALL"] {
            self.explicit.clear();
        } else {
            if let Some(n) = names.iter().find(|n| !self.explicit.contains(**n)) {
                return Err(if self.program.rules.contains_key(*n) {
                    RuleError::NotLoaded(n.to_string())
                } else {
                    RuleError::UnknownRule(n.to_string())
                });
            }
            for n in names {
                self.explicit.remove(*n);
            }
        }
        self.reconcile(now, env);
        self.run_actions(now, env);
        Ok(self.commit(format!("unload {}", names.join(", ")), now))
    }

    /// Deletes definitions (`["ALL"]`: every rule): each is unloaded and its definition, triggers and actions
    /// go. Refused, with nothing changed, if a rule that stays uses one (by reference or in a `load`, `unload` or
    /// `replace` action); a trigger from a deleted rule to one that stays goes with it.
    pub fn handle_delete(&mut self, names: &[&str], now: Time, env: &dyn Environment) -> Result<u64, RuleError> {
        let mut program = Program::default();
        let mut explicit = BTreeSet::new();
        if names != ["ALL"] {
            if let Some(n) = names.iter().find(|n| !self.program.rules.contains_key(**n)) {
                return Err(RuleError::UnknownRule(n.to_string()));
            }
            let gone: BTreeSet<&str> = names.iter().copied().collect();
            program = (*self.program).clone();
            program.rules.retain(|n, _| !gone.contains(n.as_str()));
            for def in program.rules.values_mut() {
                def.triggered_by.retain(|t| !gone.contains(t.as_str()));
                let mut used = Vec::new();
                compile_refs(&def.node, &mut used);
                for a in &def.actions {
                    match a {
                        RuleAction::Load(v) | RuleAction::Unload(Some(v)) => used.extend(v.iter().cloned()),
                        RuleAction::Replace(a, b) => used.extend([a.clone(), b.clone()]),
                        RuleAction::Unload(None) => {}
                    }
                }
                if let Some(u) = used.iter().find(|u| gone.contains(u.as_str())) {
                    return Err(RuleError::InUse(u.clone(), def.name.clone()));
                }
            }
            compile::recheck(&mut program).map_err(RuleError::Invalid)?;
            explicit = self.explicit.iter().filter(|n| !gone.contains(n.as_str())).cloned().collect();
        }
        self.program = Arc::new(program);
        self.explicit = explicit;
        self.reconcile(now, env);
        self.run_actions(now, env);
        Ok(self.commit(format!("delete {}", names.join(", ")), now))
    }

    /// Replaces rule `old` by rule `new` everywhere: rules that used `old` use `new` (their units keep their
    /// state: only the wiring changes), triggers of and by `old` move to `new`, and `old` is unloaded unless
    /// still needed. Refused if that would exceed a cap.
    pub fn handle_replace(&mut self, old: &str, new: &str, now: Time, env: &dyn Environment) -> Result<u64, RuleError> {
        let (old_program, old_explicit) = (self.program.clone(), self.explicit.clone());
        let what = format!("replace {old} {new}");
        let checked = self
            .apply_action(&RuleAction::Replace(old.to_string(), new.to_string()), "")
            .and_then(|()| self.check_limits(&what, env));
        if let Err(e) = checked {
            self.program = old_program;
            self.explicit = old_explicit;
            return Err(e);
        }
        self.reconcile(now, env);
        self.run_actions(now, env);
        Ok(self.commit(what, now))
    }

    /// Switches to the rules of an earlier revision, from its stored commands (no parsing). Units that exist in
    /// both keep their state. Refused if that would exceed a cap.
    pub fn handle_rollback(&mut self, revision: u64, now: Time, env: &dyn Environment) -> Result<u64, RuleError> {
        let rev =
            self.revisions.iter().find(|r| r.info.number == revision).ok_or(RuleError::UnknownRevision(revision))?;
        let (program, explicit) = (rev.program.clone(), (*rev.explicit).clone());
        let (old_program, old_explicit) =
            (std::mem::replace(&mut self.program, program), std::mem::replace(&mut self.explicit, explicit));
        let what = format!("rollback to {revision}");
        if let Err(e) = self.check_limits(&what, env) {
            self.program = old_program;
            self.explicit = old_explicit;
            return Err(e);
        }
        self.reconcile(now, env);
        self.run_actions(now, env);
        Ok(self.commit(what, now))
    }

    // ---- signals ----

    /// A meter's new value, pushed by the caller: rules waiting on it are evaluated now.
    pub fn handle_meter_changed(&mut self, name: &str, value: Value, now: Time, env: &dyn Environment) {
        self.rt.epoch += 1;
        let epoch = self.rt.epoch;
        let mut sources = std::mem::take(&mut self.sources);
        sources.clear();
        for i in 0..self.rt.sampled.len() {
            let g = self.rt.sampled[i] as usize;
            let (unit, hot) = (&self.rt.units[g], &mut self.rt.hot[g]);
            if matches!(&unit.core, Core::Get { name: n } if n == name) && hot.value.as_ref() != Some(&value) {
                hot.value = Some(value.clone());
                hot.epoch = epoch;
                hot.emitted = epoch;
                sources.push(g as u32);
            }
        }
        self.emit_sources(&sources, now, env);
        self.sources = sources;
        self.run_actions(now, env);
    }

    /// Evaluates a loaded rule by query, as a trigger would (its sets write); returns the output of its first
    /// instance.
    pub fn evaluate(&mut self, name: &str, now: Time, env: &dyn Environment) -> Result<Option<Value>, RuleError> {
        let mut seeds = std::mem::take(&mut self.seeds);
        seeds.clear();
        seeds.extend(self.rt.of_rule.get(name).into_iter().flatten().map(|&i| (i, true)));
        let Some(&(first, _)) = seeds.first() else {
            self.seeds = seeds;
            return Err(if self.program.rules.contains_key(name) {
                RuleError::NotLoaded(name.to_string())
            } else {
                RuleError::UnknownRule(name.to_string())
            });
        };
        self.rt.epoch += 1;
        self.wave(&seeds, now, env);
        self.seeds = seeds;
        self.run_actions(now, env);
        let root = self.rt.roots[first as usize] as usize;
        Ok(self.rt.hot[root].value.clone())
    }

    /// How a knob write went; a refusal is kept in the set unit's state and reported as a notice.
    pub fn handle_write_result(&mut self, write: &KnobWrite, result: Result<(), String>, now: Time) {
        if let Some(u) = self.rt.units.iter_mut().find(|u| u.key == write.unit) {
            if let Core::Set { error, .. } = &mut u.core {
                *error = result.as_ref().err().cloned();
            }
        }
        if let Err(e) = result {
            self.notices.push_back(Notice {
                at: now,
                message: format!("{}: write {} = {} refused: {e}", write.unit, write.name, write.value),
            });
        }
    }

    /// Instantiates and drops per-name rules as names appear and disappear, fires due timers, samples the
    /// meters rules wait on, runs what that causes, and returns the writes to apply and the next wake-up.
    pub fn advance(&mut self, now: Time, env: &dyn Environment) -> Step {
        // The names are listed again only when they may have changed since they were last (or the rules did).
        let generation = env.names_generation();
        if generation.is_none() || generation != self.listed {
            if self.captures_changed(env) {
                self.reconcile(now, env);
            }
            self.listed = generation;
        }
        self.rt.epoch += 1;
        let epoch = self.rt.epoch;
        let mut sources = std::mem::take(&mut self.sources);
        sources.clear();
        for i in 0..self.rt.timers.len() {
            let t = self.rt.timers[i] as usize;
            let (unit, hot) = (&mut self.rt.units[t], &mut self.rt.hot[t]);
            if let Core::Timer { period, next_due, ticks } = &mut unit.core {
                let due = next_due.get_or_insert(now + std::time::Duration::from_nanos(*period));
                if *due <= now {
                    *ticks += 1;
                    let behind = (now.as_nanos() - due.as_nanos()) / *period;
                    *due = Time(due.as_nanos().saturating_add((behind + 1).saturating_mul(*period)));
                    hot.value = Some(Value::U64(*ticks));
                    hot.epoch = epoch;
                    hot.emitted = epoch;
                    sources.push(t as u32);
                }
            }
        }
        // Variables the environment hands out are read without looking their names up again, until names change.
        let rt = &mut self.rt;
        if generation.is_none() || rt.held_generation != generation || rt.held.len() != rt.sampled.len() {
            rt.held.clear();
            rt.held.resize_with(rt.sampled.len(), || None);
            rt.held_generation = generation;
        }
        for i in 0..self.rt.sampled.len() {
            let g = self.rt.sampled[i] as usize;
            let (unit, hot, held) = (&self.rt.units[g], &mut self.rt.hot[g], &mut self.rt.held[i]);
            if let Core::Get { name } = &unit.core {
                if held.is_none() && generation.is_some() {
                    *held = env.hold(name);
                }
                let v = match held {
                    Some(h) => Some(h.get()),
                    None => env.get(name),
                };
                if v != hot.value {
                    hot.value = v;
                    hot.epoch = epoch;
                    hot.emitted = epoch;
                    sources.push(g as u32);
                }
            }
        }
        self.emit_sources(&sources, now, env);
        self.sources = sources;
        self.run_actions(now, env);
        Step { writes: std::mem::take(&mut self.writes), next_wakeup: self.next_wakeup() }
    }

    /// Knob writes produced by `handle_*` calls since the last `advance` (which returns them too).
    pub fn poll_writes(&mut self) -> Vec<KnobWrite> {
        std::mem::take(&mut self.writes)
    }

    /// The next thing the engine did on its own, oldest first.
    pub fn poll_notice(&mut self) -> Option<Notice> {
        self.notices.pop_front()
    }

    /// When the next timer is due.
    pub fn next_wakeup(&self) -> Option<Time> {
        self.rt
            .timers
            .iter()
            .filter_map(|&t| match &self.rt.units[t as usize].core {
                Core::Timer { next_due, .. } => *next_due,
                _ => None,
            })
            .min()
    }

    // ---- reads ----

    /// Every defined rule.
    pub fn list(&self) -> Vec<RuleSummary> {
        self.program
            .rules
            .values()
            .map(|r| {
                let of_rule = self.rt.of_rule.get(&r.name).map_or(&[][..], Vec::as_slice);
                let inst: Vec<&Instance> = of_rule.iter().map(|&i| &self.rt.instances[i as usize]).collect();
                RuleSummary {
                    name: r.name.clone(),
                    section: r.section,
                    source: r.source.clone(),
                    explicit: self.explicit.contains(&r.name),
                    instances: inst.len(),
                    value: match inst.as_slice() {
                        [one] if one.captures.is_empty() => self.rt.hot[one.root as usize].value.clone(),
                        _ => None,
                    },
                }
            })
            .collect()
    }

    /// A rule's text, commands and live unit graph per instance.
    pub fn show(&self, name: &str) -> Option<RuleView> {
        let def = self.program.rules.get(name)?;
        let of_rule = self.rt.of_rule.get(name).map_or(&[][..], Vec::as_slice);
        let instances = of_rule
            .iter()
            .map(|&i| &self.rt.instances[i as usize])
            .map(|i| InstanceView {
                captures: i.captures.clone(),
                refcount: i.refcount,
                pulled: i.pulled,
                value: self.rt.hot[i.root as usize].value.clone(),
                units: i
                    .units
                    .clone()
                    .map(|u| {
                        let unit = &self.rt.units[u as usize];
                        UnitView {
                            key: unit.key.clone(),
                            kind: crate::units::info(unit.kind).name,
                            inputs: unit.inputs.iter().map(|&x| self.rt.units[x as usize].key.clone()).collect(),
                            value: self.rt.hot[u as usize].value.clone(),
                            state: unit.core.state(),
                        }
                    })
                    .collect(),
            })
            .collect();
        Some(RuleView {
            name: def.name.clone(),
            section: def.section,
            source: def.source.clone(),
            text: def.render(),
            commands: def.commands(),
            explicit: self.explicit.contains(name),
            instances,
        })
    }

    /// The output of a rule's instance: `captures` empty for a rule without wildcards.
    pub fn value(&self, name: &str, captures: &[&str]) -> Option<Value> {
        let key = (name.to_string(), captures.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let i = *self.rt.by_rule.get(&key)?;
        self.rt.hot[self.rt.roots[i as usize] as usize].value.clone()
    }

    /// The loaded rule instances as `rule` or `rule[captures]`, sorted.
    pub fn loaded(&self) -> Vec<String> {
        let mut v: Vec<String> = self.rt.instances.iter().map(|i| instance_name(&i.rule, &i.captures)).collect();
        v.sort();
        v
    }

    /// How many units run.
    pub fn unit_count(&self) -> usize {
        self.rt.units.len()
    }

    /// The repository's log, oldest first.
    pub fn log(&self) -> Vec<RevisionInfo> {
        let info = |r: &Revision| RevisionInfo { loaded: r.explicit.iter().cloned().collect(), ..r.info.clone() };
        self.revisions.iter().map(info).collect()
    }

    /// The differences between two revisions' commands, as `-`/`+` lines under a `rule NAME` header per rule,
    /// then the rules loaded or unloaded.
    pub fn diff(&self, from: u64, to: u64) -> Result<Vec<String>, RuleError> {
        let get = |n| self.revisions.iter().find(|r| r.info.number == n).ok_or(RuleError::UnknownRevision(n));
        let (a, b) = (get(from)?, get(to)?);
        let mut out = Vec::new();
        let names: BTreeSet<&String> = a.program.rules.keys().chain(b.program.rules.keys()).collect();
        for name in names {
            let ca = a.program.rules.get(name).map(RuleDef::commands).unwrap_or_default();
            let cb = b.program.rules.get(name).map(RuleDef::commands).unwrap_or_default();
            if ca == cb {
                continue;
            }
            out.push(format!("rule {name}"));
            out.extend(ca.iter().filter(|c| !cb.contains(c)).map(|c| format!("- {c}")));
            out.extend(cb.iter().filter(|c| !ca.contains(c)).map(|c| format!("+ {c}")));
        }
        out.extend(a.explicit.difference(&b.explicit).map(|n| format!("- load({n})")));
        out.extend(b.explicit.difference(&a.explicit).map(|n| format!("+ load({n})")));
        Ok(out)
    }

    // ---- internals ----

    fn commit(&mut self, what: String, now: Time) -> u64 {
        let number = self.next_revision;
        self.next_revision += 1;
        // Load/unload cycles come back to the same sets of loaded rules: share them.
        let explicit = match self.revisions.iter().rev().find(|r| *r.explicit == self.explicit) {
            Some(r) => r.explicit.clone(),
            None => Arc::new(self.explicit.clone()),
        };
        self.revisions.push_back(Revision {
            info: RevisionInfo { number, what, at: now, rules: self.program.rules.len(), loaded: Vec::new() },
            program: self.program.clone(),
            explicit,
        });
        self.trim_revisions();
        number
    }

    /// Drops the oldest revisions beyond [`Limits::max_revisions`] (the newest is always kept).
    fn trim_revisions(&mut self) {
        while self.revisions.len() > self.limits.max_revisions.max(1) {
            self.revisions.pop_front();
        }
    }

    /// Refuses the change named `what` if the program and loaded rules as they are now (not yet rebuilt) would
    /// run more instances, or take more memory, than the caps allow.
    fn check_limits(&self, what: &str, env: &dyn Environment) -> Result<(), RuleError> {
        let mut rt = Runtime::default();
        self.instances(&mut rt, &self.program, &HashMap::new(), None, env);
        let refuse = |cap, wanted, limit| Err(RuleError::Limit { what: what.to_string(), cap, wanted, limit });
        if rt.instances.len() > self.limits.max_instances {
            return refuse(Cap::Instances, rt.instances.len(), self.limits.max_instances);
        }
        let bytes = crate::limits::program_bytes(&self.program) + self.bytes_of(&rt, &self.program);
        if bytes > self.limits.max_memory_bytes {
            return refuse(Cap::Memory, bytes, self.limits.max_memory_bytes);
        }
        Ok(())
    }

    /// The estimated bytes of the instances of `rt`.
    fn bytes_of(&self, rt: &Runtime, program: &Program) -> usize {
        rt.instances.iter().filter_map(|i| program.rules.get(&i.rule).map(|d| instance_bytes(d, &i.captures))).sum()
    }

    /// Applies a keyword to the program and the set of loaded rules (not yet to the units).
    fn apply_action(&mut self, action: &RuleAction, source: &str) -> Result<(), RuleError> {
        match action {
            RuleAction::Load(names) => {
                if let Some(n) = names.iter().find(|n| !self.program.rules.contains_key(*n)) {
                    return Err(RuleError::UnknownRule(n.clone()));
                }
                self.explicit.extend(names.iter().cloned());
            }
            RuleAction::Unload(Some(names)) => {
                for n in names {
                    self.explicit.remove(n);
                }
            }
            RuleAction::Unload(None) => {
                let program = self.program.clone();
                self.explicit.retain(|n| {
                    program.rules.get(n).is_none_or(|r| {
                        r.source != source || matches!(r.section, Section::ContextEnter | Section::ContextExit)
                    })
                });
            }
            RuleAction::Replace(old, new) => {
                for n in [old, new] {
                    if !self.program.rules.contains_key(n) {
                        return Err(RuleError::UnknownRule(n.clone()));
                    }
                }
                let mut program = (*self.program).clone();
                for (name, def) in program.rules.iter_mut() {
                    if name == new {
                        continue;
                    }
                    rename_refs(&mut def.node, old, new);
                    for t in def.triggered_by.iter_mut().filter(|t| *t == old) {
                        t.clone_from(new);
                    }
                    for a in def.actions.iter_mut() {
                        match a {
                            RuleAction::Load(v) | RuleAction::Unload(Some(v)) => {
                                v.iter_mut().filter(|t| *t == old).for_each(|t| t.clone_from(new))
                            }
                            _ => {}
                        }
                    }
                }
                let moved = program.rules.get(old).map(|d| d.triggered_by.clone()).unwrap_or_default();
                if let Some(d) = program.rules.get_mut(new) {
                    for t in moved {
                        if t != *new && !d.triggered_by.contains(&t) {
                            d.triggered_by.push(t);
                        }
                    }
                }
                if let Some(d) = program.rules.get_mut(old) {
                    d.triggered_by.clear();
                }
                compile::recheck(&mut program).map_err(|mut d| {
                    for x in &mut d {
                        x.message = format!("replace({old}, {new}) is refused: {}", x.message);
                    }
                    RuleError::Invalid(d)
                })?;
                if self.explicit.remove(old) {
                    self.explicit.insert(new.clone());
                }
                self.program = Arc::new(program);
            }
        }
        Ok(())
    }

    /// Runs the actions fired by context rules (load/unload/replace), reconciling after each round.
    fn run_actions(&mut self, now: Time, env: &dyn Environment) {
        for _ in 0..MAX_ACTION_ROUNDS {
            if self.actions.is_empty() {
                return;
            }
            for (a, by) in std::mem::take(&mut self.actions) {
                let source = self.program.rules.get(&by).map(|r| r.source.clone()).unwrap_or_default();
                let message = match self.apply_action(&a, &source) {
                    Ok(()) => format!("{by} ran {}", a.render()),
                    Err(e) => format!("{by} could not run {}: {e}", a.render()),
                };
                self.notices.push_back(Notice { at: now, message });
            }
            self.reconcile(now, env);
        }
        if !self.actions.is_empty() {
            self.actions.clear();
            self.notices.push_back(Notice {
                at: now,
                message: format!("more than {MAX_ACTION_ROUNDS} rounds of context actions: stopped"),
            });
        }
    }

    /// The captures of a rule's instances: one empty list, or one per name matching its driver.
    fn all_captures(def: &RuleDef, env: &dyn Environment) -> Vec<Vec<String>> {
        match (&def.driver, def.stars) {
            (Some(driver), s) if s > 0 => {
                let set: BTreeSet<Vec<String>> = env.names(driver).iter().filter_map(|n| capture(driver, n)).collect();
                set.into_iter().collect()
            }
            _ => vec![vec![]],
        }
    }

    /// True if a per-name rule loaded by itself has gained or lost a matching name (instances of dependencies
    /// follow their users). A name whose instance a cap refused counts as had, so that it is not tried again on
    /// every call; it is when something else changes. Rules with the same driver share one listing of names.
    fn captures_changed(&self, env: &dyn Environment) -> bool {
        let mut listed: HashMap<&str, Vec<Vec<String>>> = HashMap::new();
        self.explicit.iter().any(|name| {
            let Some(def) = self.program.rules.get(name).filter(|d| d.stars > 0) else { return false };
            let want =
                listed.entry(def.driver.as_deref().unwrap_or_default()).or_insert_with(|| Self::all_captures(def, env));
            let instances = self.rt.of_rule.get(name).into_iter().flatten();
            let have: BTreeSet<&Vec<String>> = instances
                .map(|&i| &self.rt.instances[i as usize].captures)
                .chain(self.refused.get(name).into_iter().flatten())
                .collect();
            want.len() != have.len() || want.iter().any(|b| !have.contains(b))
        })
    }

    /// Evaluates the seeded instances and everything their emissions cause, in dependency order.
    fn wave(&mut self, seeds: &[(u32, bool)], now: Time, env: &dyn Environment) {
        let mut heap = std::mem::take(&mut self.heap);
        for &(i, triggered) in seeds {
            schedule(&mut self.queued, &mut self.next, &mut heap, &self.rt.ranks, i, triggered);
        }
        // `self.next` holds the one scheduled instance while the heap is empty (a chain of events), so that the
        // common case does not go through the heap; a second schedule moves it there.
        while let Some(i) = self.next.take().or_else(|| heap.pop().map(|Reverse((_, i))| i)) {
            let flags = std::mem::replace(&mut self.queued[i as usize], 0);
            if flags == 0 {
                continue;
            }
            if !self.run_instance(i, flags & 2 != 0, now, env) {
                continue;
            }
            let rt = &mut self.rt;
            let root = rt.roots[i as usize];
            rt.hot[root as usize].emitted = rt.epoch;
            for &s in subscribers(&rt.sub_at, &rt.sub_list, root as usize) {
                schedule(&mut self.queued, &mut self.next, &mut heap, &rt.ranks, s, false);
            }
            let after = &rt.hot[root as usize].value;
            let fires = &rt.fires[i as usize];
            if fires.is_empty() || !after.as_ref().is_some_and(truthy) {
                continue;
            }
            for fire in fires {
                match fire {
                    Fire::Eval(t) => schedule(&mut self.queued, &mut self.next, &mut heap, &rt.ranks, *t, true),
                    Fire::Action(a) => self.actions.push((a.clone(), rt.instances[i as usize].rule.clone())),
                }
            }
        }
        self.heap = heap;
    }

    /// Runs the emissions of `sources` (gets and timers whose value changed, with their wave stamp set): through
    /// the source's wave plan when there is one source, else through the general [`Self::wave`].
    fn emit_sources(&mut self, sources: &[u32], now: Time, env: &dyn Environment) {
        if let (true, &[s]) = (self.use_plans, sources) {
            let steps = self.rt.plans.wave_plan(s);
            if !steps.is_empty() {
                return self.run_wave_plan(steps, now, env);
            }
        }
        let seeds: Vec<(u32, bool)> = sources
            .iter()
            .flat_map(|&s| subscribers(&self.rt.sub_at, &self.rt.sub_list, s as usize).iter().map(|&d| (d, false)))
            .collect();
        self.wave(&seeds, now, env);
    }

    /// Runs a wave plan (see [`crate::plan`]): each instance in order, if a unit it waits on emitted in this wave
    /// or a trigger queued it. Evaluates and emits exactly as [`Self::wave`] would for the same source.
    fn run_wave_plan(&mut self, steps: std::ops::Range<usize>, now: Time, env: &dyn Environment) {
        let epoch = self.rt.epoch;
        // The steps are taken out while they run (nothing a step does reads the wave plans), so that the loop
        // walks a slice.
        let all = std::mem::take(self.rt.plans.wave_steps_mut());
        for &step in &all[steps] {
            match step {
                WaveStep::Forward { src, dst } => {
                    let rt = &mut self.rt;
                    let (input, out) = pair(&mut rt.hot, src, dst);
                    if input.emitted != epoch {
                        continue;
                    }
                    out.epoch = epoch;
                    if update(&mut out.value, &input.value) {
                        out.emitted = epoch;
                    }
                }
                WaveStep::Instance(i) => {
                    let flags = self.queued[i as usize];
                    let rt = &self.rt;
                    if flags == 0 && !rt.plans.watch(i).iter().any(|&u| rt.hot[u as usize].emitted == epoch) {
                        continue;
                    }
                    self.queued[i as usize] = 0;
                    if !self.run_instance(i, flags & 2 != 0, now, env) {
                        continue;
                    }
                    let rt = &mut self.rt;
                    let root = rt.roots[i as usize] as usize;
                    rt.hot[root].emitted = epoch;
                    if rt.fires[i as usize].is_empty() || !rt.hot[root].value.as_ref().is_some_and(truthy) {
                        continue;
                    }
                    for fire in &rt.fires[i as usize] {
                        match fire {
                            // The target comes later in the plan (triggers go forwards), which runs it.
                            Fire::Eval(t) => self.queued[*t as usize] |= 3,
                            Fire::Action(a) => self.actions.push((a.clone(), rt.instances[i as usize].rule.clone())),
                        }
                    }
                }
            }
        }
        *self.rt.plans.wave_steps_mut() = all;
    }

    /// Evaluates instance `i` in the current wave and returns true if it emits (its output differs from the one
    /// it last emitted, which is then updated).
    #[inline]
    fn run_instance(&mut self, i: u32, triggered: bool, now: Time, env: &dyn Environment) -> bool {
        let root = self.rt.roots[i as usize];
        if self.rt.selfcmp[i as usize] {
            let epoch = self.rt.epoch;
            if self.rt.hot[root as usize].epoch == epoch {
                return false;
            }
            self.eval_instance(i, root, triggered, true, now, env);
            let rt = &mut self.rt;
            let hot = &rt.hot[root as usize];
            let first = hot.first_input as usize;
            let value = stateless(hot.op, &rt.edges[first..first + hot.n_inputs as usize], &rt.hot);
            let hot = &mut rt.hot[root as usize];
            hot.epoch = epoch;
            return update(&mut hot.value, &value);
        }
        if !self.eval_in_place(root, i) {
            self.eval_instance(i, root, triggered, false, now, env);
        }
        let rt = &mut self.rt;
        let after = &rt.hot[root as usize].value;
        update(&mut rt.emitted[i as usize], after)
    }

    /// Evaluates the units of instance `i` (with root `root`) not yet evaluated in this wave, inputs first, all
    /// but the root if `skip_root`: through its unit plan, or by a recursive query if it has none.
    fn eval_instance(&mut self, i: u32, root: u32, triggered: bool, skip_root: bool, now: Time, env: &dyn Environment) {
        let rt = &mut self.rt;
        let plan = if self.use_plans { rt.plans.unit_plan(i, root, &rt.hot, &rt.edges) } else { None };
        match plan {
            Some(steps) => self.run_unit_plan(steps.start..steps.end - usize::from(skip_root), triggered, now, env),
            None if skip_root => {
                let hot = &self.rt.hot[root as usize];
                for k in hot.first_input as usize..(hot.first_input + hot.n_inputs) as usize {
                    let x = self.rt.edges[k];
                    self.query_rec(x, i, triggered, now, env, 1);
                }
            }
            None => self.query(root, i, triggered, now, env),
        }
    }

    /// Runs steps of a unit plan: each unit not yet evaluated in this wave.
    fn run_unit_plan(&mut self, steps: std::ops::Range<usize>, triggered: bool, now: Time, env: &dyn Environment) {
        let epoch = self.rt.epoch;
        // Taken out while they run, as in `run_wave_plan` (evaluating a unit builds no plan).
        let all = std::mem::take(self.rt.plans.unit_steps_mut());
        for &step in &all[steps] {
            match step {
                UnitStep::Forward { src, dst } => {
                    let (input, out) = pair(&mut self.rt.hot, src, dst);
                    if out.epoch == epoch {
                        continue;
                    }
                    assign(&mut out.value, &input.value);
                    out.epoch = epoch;
                }
                UnitStep::Eval(u) => {
                    if self.rt.hot[u as usize].epoch != epoch {
                        self.eval_unit(u, triggered, now, env);
                    }
                }
            }
        }
        *self.rt.plans.unit_steps_mut() = all;
    }

    /// Evaluates unit `u` for instance `current` without a walk if it has no state and its inputs are ready
    /// (the common case of a rule over other rules' outputs); false if it needs [`Self::query`].
    #[inline]
    fn eval_in_place(&mut self, u: u32, current: u32) -> bool {
        let rt = &mut self.rt;
        let epoch = rt.epoch;
        let hot = &rt.hot[u as usize];
        if matches!(hot.op, Op::Cache | Op::Stateful) || hot.epoch == epoch || hot.stops(current) {
            return false;
        }
        let first = hot.first_input as usize;
        let inputs = &rt.edges[first..first + hot.n_inputs as usize];
        if inputs.iter().any(|&x| {
            let input = &rt.hot[x as usize];
            input.epoch != epoch && !input.stops(current)
        }) {
            return false;
        }
        let value = stateless(hot.op, inputs, &rt.hot);
        let hot = &mut rt.hot[u as usize];
        hot.value = value;
        hot.epoch = epoch;
        true
    }

    /// Queries unit `root` of instance `current`: evaluates, inputs first, every unit of this wave not yet
    /// evaluated, stopping at pushed instances other than `current` (their value is current) and at valid caches.
    /// Recursive up to [`MAX_QUERY_DEPTH`] (the fast path), then with an explicit stack.
    fn query(&mut self, root: u32, current: u32, triggered: bool, now: Time, env: &dyn Environment) {
        self.query_rec(root, current, triggered, now, env, 0);
    }

    fn query_rec(&mut self, u: u32, current: u32, triggered: bool, now: Time, env: &dyn Environment, depth: u32) {
        let epoch = self.rt.epoch;
        let hot = &self.rt.hot[u as usize];
        if hot.epoch == epoch || hot.stops(current) {
            return;
        }
        if hot.op == Op::Cache && cache_valid(&self.rt.units[u as usize].core, &hot.value, now) {
            self.rt.hot[u as usize].epoch = epoch;
            return;
        }
        if depth >= MAX_QUERY_DEPTH {
            return self.query_iter(u, current, triggered, now, env);
        }
        let first = hot.first_input as usize;
        for k in first..first + hot.n_inputs as usize {
            let i = self.rt.edges[k];
            let input = &self.rt.hot[i as usize];
            if input.epoch != epoch && !input.stops(current) {
                self.query_rec(i, current, triggered, now, env, depth + 1);
            }
        }
        self.eval_unit(u, triggered, now, env);
    }

    /// [`Self::query`] with an explicit stack, for arbitrarily deep unit graphs.
    fn query_iter(&mut self, root: u32, current: u32, triggered: bool, now: Time, env: &dyn Environment) {
        let epoch = self.rt.epoch;
        let mut stack = std::mem::take(&mut self.stack);
        stack.push((root, false));
        while let Some((u, expanded)) = stack.pop() {
            let hot = &self.rt.hot[u as usize];
            if hot.epoch == epoch {
                continue;
            }
            if !expanded {
                if hot.stops(current) {
                    continue;
                }
                if hot.op == Op::Cache && cache_valid(&self.rt.units[u as usize].core, &hot.value, now) {
                    self.rt.hot[u as usize].epoch = epoch;
                    continue;
                }
                let mark = stack.len();
                stack.push((u, true));
                let first = hot.first_input as usize;
                for &i in &self.rt.edges[first..first + hot.n_inputs as usize] {
                    let input = &self.rt.hot[i as usize];
                    if input.epoch != epoch && !input.stops(current) {
                        stack.push((i, false));
                    }
                }
                if stack.len() > mark + 1 {
                    continue;
                }
                // Every input is ready: evaluate now.
                stack.pop();
            }
            self.eval_unit(u, triggered, now, env);
        }
        self.stack = stack;
    }

    /// Evaluates one unit whose inputs are ready, in wave `self.rt.epoch`: a unit without state in place, from
    /// the dense arrays only; the others through [`Self::eval_stateful`].
    #[inline]
    fn eval_unit(&mut self, u: u32, triggered: bool, now: Time, env: &dyn Environment) {
        let rt = &mut self.rt;
        let hot = &rt.hot[u as usize];
        let first = hot.first_input as usize;
        let inputs = &rt.edges[first..first + hot.n_inputs as usize];
        let value = match hot.op {
            Op::Cache | Op::Stateful => return self.eval_stateful(u, triggered, now, env),
            op => stateless(op, inputs, &rt.hot),
        };
        let hot = &mut rt.hot[u as usize];
        hot.value = value;
        hot.epoch = rt.epoch;
    }

    /// Evaluates a unit with state (or a Constant, a get, a set): its core is taken out of its slot for
    /// [`compute`], and the key of a `set` unit goes on the writes it made.
    #[inline(never)]
    fn eval_stateful(&mut self, u: u32, triggered: bool, now: Time, env: &dyn Environment) {
        let before = self.writes.len();
        let mut cx = EvalCx { now, env, writes: &mut self.writes, triggered };
        let rt = &mut self.rt;
        let first = rt.hot[u as usize].first_input as usize;
        let inputs = &rt.edges[first..first + rt.hot[u as usize].n_inputs as usize];
        let mut core = std::mem::take(&mut rt.units[u as usize].core);
        let value = compute(&mut core, inputs, &rt.hot, &rt.units, &mut cx);
        rt.units[u as usize].core = core;
        let hot = &mut rt.hot[u as usize];
        hot.value = value;
        hot.epoch = rt.epoch;
        if self.writes.len() > before {
            for w in &mut self.writes[before..] {
                w.unit.clone_from(&rt.units[u as usize].key);
            }
        }
    }
}

/// Unit `src`'s entry to read and unit `dst`'s to write (two different units).
#[inline(always)]
fn pair(hot: &mut [Hot], src: u32, dst: u32) -> (&Hot, &mut Hot) {
    let (s, d) = (src as usize, dst as usize);
    if s < d {
        let (a, b) = hot.split_at_mut(d);
        (&a[s], &mut b[0])
    } else {
        let (a, b) = hot.split_at_mut(s);
        (&b[0], &mut a[d])
    }
}

/// The instances evaluated when unit `u` emits (see `Runtime::sub_list`).
#[inline(always)]
fn subscribers<'a>(at: &[u32], list: &'a [u32], u: usize) -> &'a [u32] {
    &list[at[u] as usize..at[u + 1] as usize]
}

/// [`compute_stateless`], with the most common hop, a Forwarder, inlined.
#[inline(always)]
fn stateless(op: Op, inputs: &[u32], hot: &[Hot]) -> Option<Value> {
    match (op, inputs) {
        (Op::Forwarder, &[x]) => dup(&hot[x as usize].value),
        (op, inputs) => compute_stateless(op, inputs, hot),
    }
}

/// Puts instance `i` in the wave (`triggered`: by a trigger, so its sets write): as `next` while it is the only
/// one (a chain of events), else in the heap by rank. An instance already queued only gains the flag.
#[inline(always)]
fn schedule(
    queued: &mut [u8],
    next: &mut Option<u32>,
    heap: &mut BinaryHeap<Reverse<(u32, u32)>>,
    ranks: &[u32],
    i: u32,
    triggered: bool,
) {
    let q = &mut queued[i as usize];
    let first = *q == 0;
    *q |= 1 | if triggered { 2 } else { 0 };
    if !first {
        return;
    }
    if next.is_none() && heap.is_empty() {
        *next = Some(i);
        return;
    }
    schedule_in_heap(next, heap, ranks, i);
}

/// [`schedule`] when more than one instance waits: they all go in the heap.
#[cold]
#[inline(never)]
fn schedule_in_heap(next: &mut Option<u32>, heap: &mut BinaryHeap<Reverse<(u32, u32)>>, ranks: &[u32], i: u32) {
    if let Some(n) = next.take() {
        heap.push(Reverse((ranks[n as usize], n)));
    }
    heap.push(Reverse((ranks[i as usize], i)));
}

fn compile_refs(node: &Node, out: &mut Vec<String>) {
    match node {
        Node::Ref(r) => out.push(r.clone()),
        Node::Unit { args, .. } => args.iter().for_each(|a| compile_refs(a, out)),
    }
}

/// Builds the units of `node` (depth first, parent before children) and returns the index of its top unit.
fn build(
    node: &Node,
    key: &str,
    captures: &[String],
    deps: &HashMap<String, u32>,
    units: &mut Vec<Unit>,
    fixups: &mut Vec<(u32, usize, u32)>,
) -> u32 {
    let Node::Unit { kind, param, args } = node else { unreachable!("references are wired by their parent") };
    let param = match param {
        Param::Name(n) => Param::Name(fill_wildcards(n, captures)),
        p => p.clone(),
    };
    let me = units.len() as u32;
    units.push(Unit {
        key: key.to_string(),
        kind: *kind,
        sig: format!("{kind:?}|{param:?}"),
        core: Core::new(*kind, &param),
        inputs: vec![u32::MAX; args.len()],
    });
    for (pos, a) in args.iter().enumerate() {
        match a {
            Node::Ref(r) => {
                if let Some(&j) = deps.get(r) {
                    fixups.push((me, pos, j));
                }
            }
            n => {
                let child = build(n, &format!("{key}/{pos}"), captures, deps, units, fixups);
                units[me as usize].inputs[pos] = child;
            }
        }
    }
    me
}

/// [`RuleEngine::advance`], then applies the writes to `env` and reports each result back.
pub fn drive<E: Environment>(engine: &mut RuleEngine, env: &mut E, now: Time) -> Step {
    let step = engine.advance(now, env);
    for w in &step.writes {
        let result = env.set(&w.name, w.value.clone());
        engine.handle_write_result(w, result, now);
    }
    step
}

#[cfg(test)]
mod tests {
    //! The compiled plans against the general evaluation: the same scenario run by an engine with plans and by
    //! one without must give the same outputs, unit states, knob writes and notices after every step.

    use super::*;
    use crate::env::MemoryEnv;

    fn ms(t: u64) -> Time {
        Time::from_millis(t)
    }

    /// An engine that evaluates without plans (the recursive query and the heap-ordered wave only).
    fn without_plans() -> RuleEngine {
        RuleEngine { use_plans: false, ..RuleEngine::new() }
    }

    /// Everything observable: every rule as `show` presents it (outputs, unit values and states) and the notices.
    fn snapshot(engine: &mut RuleEngine) -> String {
        let mut out = String::new();
        for r in engine.list() {
            out.push_str(&serde_json::to_string(&engine.show(&r.name)).unwrap());
            out.push('\n');
        }
        while let Some(n) = engine.poll_notice() {
            out.push_str(&n.message);
            out.push('\n');
        }
        out
    }

    const MIXED: &str = r#"
rate: get("module.src.rate")
h: History(rate, 4)
a: Avg(h)
b: Max(h)
hot: Greater(a, 15)
pick: set("module.sel.select", If(hot, 1, 0))
fwd1: Forwarder(rate)
fwd2: Forwarder(fwd1)
fwd3: fwd2
moved: Changed(fwd3)
both: And(hot, moved)
both -> report
report: set("module.sel.mode", Sum(get("module.src.rate"), 3))
loss: get("flow.*.loss")
lossy: Threshold(loss, 0.04, 0.02)
cc: set("flow.*.cc", If(lossy, "bbr", "cubic"))
c: Cache(get("module.src.rate"), 50ms)
tc: Timer(20ms)
tc -> cached
cached: Forwarder(c)
ticks: Timer(30ms)
every: EWMA(Forwarder(ticks), 0.5)
pq: Forwarder(cached)
pq2: pq
ticks -> pq2
up: Greater(fwd3, 25)
up -> mark
mark: set("module.sel.mark", 1)
[manual]
extra: Greater(fwd2, 35)
[contextEnter]
enter: Greater(rate, 45)
enter -> load(extra)
[contextExit]
leave: Less(rate, 15)
leave -> unload(extra)
"#;

    fn env() -> MemoryEnv {
        let mut env = MemoryEnv::new();
        env.meter("module.src.rate", Value::U64(0))
            .knob("module.sel.select", Value::I64(0))
            .knob("module.sel.mode", Value::F64(0.0))
            .knob("module.sel.mark", Value::U64(0))
            .meter("flow.a.loss", Value::F64(0.01))
            .knob("flow.a.cc", Value::Str("cubic".into()));
        env
    }

    /// Runs the scenario step by step on `engine` and returns the snapshot after every step.
    fn scenario(mut engine: RuleEngine) -> Vec<String> {
        let mut env = env();
        let mut seen = Vec::new();
        let step = |engine: &mut RuleEngine, env: &mut MemoryEnv, t: u64, seen: &mut Vec<String>| {
            let s = drive(engine, env, ms(t));
            seen.push(format!("{:?}\n{}{:?}", s.writes, snapshot(engine), env.written));
        };
        engine.handle_load_text("mixed", MIXED, ms(0), &env).unwrap();
        seen.push(snapshot(&mut engine));
        let rates = [10u64, 20, 20, 50, 60, 30, 10, 40, 40, 55, 5, 70];
        for (k, rate) in rates.iter().enumerate() {
            let t = 10 * (k as u64 + 1);
            // Pushed by the caller (one source: the wave plan), then sampled (no change).
            engine.handle_meter_changed("module.src.rate", Value::U64(*rate), ms(t), &env);
            env.meter("module.src.rate", Value::U64(*rate));
            seen.push(format!("{:?}\n{}", engine.poll_writes(), snapshot(&mut engine)));
            // Two meters at once on some steps (the general wave), one on the others.
            if k % 3 == 1 {
                env.meter("flow.a.loss", Value::F64(if k % 2 == 0 { 0.05 } else { 0.01 }));
                env.meter("module.src.rate", Value::U64(rate + 1));
            }
            step(&mut engine, &mut env, t + 5, &mut seen);
            seen.push(format!("{:?}", engine.evaluate("report", ms(t + 6), &env)));
            seen.push(format!("{:?}", engine.evaluate("fwd3", ms(t + 6), &env)));
            match k {
                // Rewire: hot reads the maximum; History h keeps its window.
                2 => drop(engine.handle_load_text("rewire", "hot: Greater(b, 45)", ms(t + 7), &env).unwrap()),
                4 => drop(engine.handle_unload(&["pick"], ms(t + 7), &env).unwrap()),
                5 => drop(engine.handle_replace("fwd2", "fwd1", ms(t + 7), &env).unwrap()),
                6 => {
                    env.meter("flow.b.loss", Value::F64(0.06)).knob("flow.b.cc", Value::Str("cubic".into()));
                }
                7 => drop(engine.handle_load(&["pick"], ms(t + 7), &env).unwrap()),
                8 => drop(engine.handle_rollback(2, ms(t + 7), &env).unwrap()),
                9 => env.remove("flow.a.loss"),
                _ => {}
            }
            seen.push(snapshot(&mut engine));
        }
        seen
    }

    /// An environment whose meters are shared cells it hands out ([`Environment::hold`]); it counts the reads by
    /// name and the holds, and its names' generation is moved by the test.
    #[derive(Default)]
    struct HoldingEnv {
        vars: BTreeMap<String, Arc<std::sync::Mutex<Value>>>,
        generation: u64,
        by_name: std::cell::Cell<usize>,
        holds: std::cell::Cell<usize>,
    }

    struct Shared(Arc<std::sync::Mutex<Value>>);

    impl HeldValue for Shared {
        fn get(&self) -> Value {
            self.0.lock().unwrap().clone()
        }
    }

    impl HoldingEnv {
        fn store(&self, name: &str, v: Value) {
            *self.vars[name].lock().unwrap() = v;
        }
    }

    impl Environment for HoldingEnv {
        fn get(&self, name: &str) -> Option<Value> {
            self.by_name.set(self.by_name.get() + 1);
            self.vars.get(name).map(|v| v.lock().unwrap().clone())
        }
        fn set(&mut self, name: &str, _: Value) -> Result<(), String> {
            Err(format!("{name}: read only"))
        }
        fn names(&self, pattern: &str) -> Vec<String> {
            self.vars.keys().filter(|n| flexstack_core::vars::name_matches(pattern, n)).cloned().collect()
        }
        fn exists(&self, name: &str) -> crate::Existence {
            if self.vars.contains_key(name) {
                crate::Existence::Known
            } else {
                crate::env::absent(name)
            }
        }
        fn names_generation(&self) -> Option<u64> {
            Some(self.generation)
        }
        fn hold(&self, name: &str) -> Option<Box<dyn HeldValue>> {
            self.holds.set(self.holds.get() + 1);
            self.vars.get(name).map(|v| Box::new(Shared(v.clone())) as Box<dyn HeldValue>)
        }
    }

    #[test]
    fn sampled_variables_are_held_until_names_change() {
        let mut env = HoldingEnv::default();
        for n in ["m.a", "m.b"] {
            env.vars.insert(n.into(), Arc::new(std::sync::Mutex::new(Value::U64(0))));
        }
        let mut e = RuleEngine::new();
        e.handle_load_text("t", "hi: Threshold(get(\"m.*\"), 5, 1)\n", Time::ZERO, &env).unwrap();
        assert_eq!(e.rt.sampled.len(), 2, "one get per name");
        e.advance(ms(1), &env);
        assert_eq!(env.holds.get(), 2, "each variable held once");
        let (holds, by_name) = (env.holds.get(), env.by_name.get());
        env.store("m.b", Value::U64(9));
        for t in 2..6 {
            e.advance(ms(t), &env);
        }
        assert_eq!((env.holds.get(), env.by_name.get()), (holds, by_name), "read through what was held");
        let hi = |e: &RuleEngine| {
            e.show("hi").unwrap().instances.iter().filter(|i| i.value == Some(Value::Bool(true))).count()
        };
        assert_eq!(hi(&e), 1, "m.b's new value was seen: {:?}", e.show("hi"));
        // Names changed: held again (a name that went is no longer read).
        env.vars.remove("m.a");
        env.generation += 1;
        e.advance(ms(7), &env);
        assert_eq!(env.holds.get(), holds + 1, "m.b held again, m.a gone");
        assert_eq!(e.rt.sampled.len(), 1);
    }

    #[test]
    fn loading_the_same_text_again_shares_its_program_with_the_earlier_revisions() {
        let env = env();
        let mut e = RuleEngine::new();
        for t in 0..3 {
            e.handle_load_text("mixed", MIXED, ms(2 * t), &env).unwrap();
            e.handle_unload(&["ALL"], ms(2 * t + 1), &env).unwrap();
        }
        assert_eq!(e.revisions.len(), 6);
        assert!(e.revisions.iter().all(|r| Arc::ptr_eq(&r.program, &e.program)));
        assert!(Arc::ptr_eq(&e.revisions[0].explicit, &e.revisions[4].explicit));
        assert!(Arc::ptr_eq(&e.revisions[1].explicit, &e.revisions[5].explicit));
        e.handle_load_text("other", "z: Not(true)", ms(9), &env).unwrap();
        assert!(!Arc::ptr_eq(&e.revisions[0].program, &e.program));
    }

    #[test]
    fn plans_give_the_same_results_as_the_general_evaluation() {
        let with = scenario(RuleEngine::new());
        let without = scenario(without_plans());
        assert_eq!(with.len(), without.len());
        for (k, (a, b)) in with.iter().zip(&without).enumerate() {
            assert_eq!(a, b, "step {k} differs");
        }
        // The scenario did something: knobs were written, the context loaded `extra`, a flow was added.
        let all = with.join("\n");
        assert!(all.contains("module.sel.mode") && all.contains("bbr"), "{all}");
        // `mark` wrote the same value on each rising edge of `up` (a triggered set always writes).
        let mark = "\"knob\":\"module.sel.mark\",\"last_written\":1,\"writes\":3";
        assert!(with.last().unwrap().contains(mark), "{all}");
        assert!(all.contains("enter ran load(extra)") && all.contains("leave ran unload(extra)"), "{all}");
        assert!(all.contains("\"binding\":[\"b\"]"), "{all}");
    }

    fn chain(n: usize, pulled: bool) -> String {
        crate::testing::forwarder_chain("f", "x", n, pulled)
    }

    #[test]
    fn a_pushed_chain_runs_as_forward_steps_and_a_pulled_one_as_a_unit_plan() {
        let mut env = MemoryEnv::new();
        env.meter("x", Value::U64(0));
        let mut pushed = RuleEngine::new();
        pushed.handle_load_text("c", &chain(50, false), Time::ZERO, &env).unwrap();
        let g = pushed.rt.sampled[0];
        let steps = pushed.rt.plans.wave_plan(g);
        assert_eq!(steps.len(), 50);
        assert!(steps.clone().all(|k| matches!(pushed.rt.plans.wave_step(k), WaveStep::Forward { .. })));
        pushed.handle_meter_changed("x", Value::U64(7), ms(1), &env);
        assert_eq!(pushed.value("f50", &[]), Some(Value::U64(7)));
        // The same value again: nothing emits past the get, the chain keeps its value.
        pushed.handle_meter_changed("x", Value::U64(7), ms(2), &env);
        assert_eq!(pushed.value("f50", &[]), Some(Value::U64(7)));

        let mut pulled = RuleEngine::new();
        pulled.handle_load_text("c", &chain(50, true), Time::ZERO, &env).unwrap();
        env.meter("x", Value::Str("s".into()));
        assert_eq!(pulled.evaluate("f50", ms(1), &env), Ok(Some(Value::Str("s".into()))));
        let top = pulled.rt.of_rule["f50"][0];
        let root = pulled.rt.roots[top as usize];
        let rt = &mut pulled.rt;
        let steps = rt.plans.unit_plan(top, root, &rt.hot, &rt.edges).expect("no cache: a plan");
        assert_eq!(steps.len(), 51, "the get and 50 forwarders");
        let below = rt.roots[rt.of_rule["f49"][0] as usize];
        assert_eq!(rt.plans.unit_step(steps.end - 1), UnitStep::Forward { src: below, dst: root });
        // Only the queried instances have a plan built: f50 and the timer t (evaluated when loaded); the plans of
        // all the chain's instances would take 1,325 steps.
        assert_eq!(rt.plans.unit_plan_steps(), 51 + 1);
    }

    #[test]
    fn plans_are_rebuilt_on_load_unload_and_replace_and_history_keeps_its_window() {
        let mut env = MemoryEnv::new();
        env.meter("x", Value::U64(1)).meter("y", Value::U64(100));
        let mut e = RuleEngine::new();
        e.handle_load_text("t", "h: History(get(\"x\"), 3)\nm: Max(h)\nout: Forwarder(m)", ms(0), &env).unwrap();
        for (k, x) in [2u64, 3].iter().enumerate() {
            e.handle_meter_changed("x", Value::U64(*x), ms(k as u64 + 1), &env);
        }
        assert_eq!(e.value("out", &[]), Some(Value::F64(3.0)));
        // Rewire `out` to read y through a new rule: the plan of y's get now reaches it.
        e.handle_load_text("t2", "n: Forwarder(get(\"y\"))\nout: Greater(n, m)", ms(5), &env).unwrap();
        let y = *e.rt.sampled.iter().find(|&&g| e.rt.units[g as usize].key.starts_with("n")).unwrap();
        assert_eq!(e.rt.plans.wave_plan(y).len(), 2, "n and out");
        assert_eq!(e.value("out", &[]), Some(Value::Bool(true)));
        e.handle_meter_changed("y", Value::U64(0), ms(6), &env);
        assert_eq!(e.value("out", &[]), Some(Value::Bool(false)));
        // History kept its window across the rewiring: [1, 2, 3], then 0 makes the max still 3.
        e.handle_meter_changed("x", Value::U64(0), ms(7), &env);
        let h = e.show("h").unwrap();
        assert_eq!(h.instances[0].units[0].state["samples"], crate::units::StateValue::Samples(vec![2.0, 3.0, 0.0]));
        // Replace m by a new rule and unload out: plans follow.
        e.handle_load_text("t3", "[manual]\nlow: Min(h)", ms(8), &env).unwrap();
        e.handle_replace("m", "low", ms(9), &env).unwrap();
        assert_eq!(e.value("out", &[]), Some(Value::Bool(false)));
        env.meter("y", Value::U64(1));
        e.handle_meter_changed("y", Value::U64(1), ms(10), &env);
        assert_eq!(e.value("out", &[]), Some(Value::Bool(true)), "1 > min(2, 3, 0)");
        e.handle_unload(&["out"], ms(11), &env).unwrap();
        assert_eq!(e.value("out", &[]), None);
        assert!(e.rt.sampled.iter().all(|&g| e.rt.plans.wave_plan(g).len() <= 2));
    }

    /// A random rule over the meters and the rules before it: `(text, is_bool)`.
    fn random_expr(rng: &mut flexstack_fuzzkit::Rng, before: &[(String, bool)]) -> (String, bool) {
        let nums: Vec<&String> = before.iter().filter(|r| !r.1).map(|r| &r.0).collect();
        let bools: Vec<&String> = before.iter().filter(|r| r.1).map(|r| &r.0).collect();
        let num = |rng: &mut flexstack_fuzzkit::Rng| -> String {
            if nums.is_empty() || rng.one_in(4) {
                format!("get(\"m.x.m{}\")", rng.below(3))
            } else {
                rng.pick(&nums).to_string()
            }
        };
        let x = num(rng);
        if !bools.is_empty() && rng.one_in(4) {
            let b = rng.pick(&bools).to_string();
            let c = rng.pick(&bools).to_string();
            return match rng.below(5) {
                0 => (format!("Not({b})"), true),
                1 => (format!("And({b}, {c})"), true),
                2 => (format!("Or({b}, {c})"), true),
                3 => (format!("If({b}, {x}, {})", num(rng)), false),
                _ => (format!("Forwarder({b})"), true),
            };
        }
        match rng.below(18) {
            0 | 1 => (format!("Forwarder({x})"), false),
            2 => (x, false),
            3 => (format!("History({x}, 3)"), false),
            4 => (format!("Avg({x}, 3)"), false),
            5 => (format!("Max(History({x}, 4))"), false),
            6 => (format!("EWMA({x}, 0.5)"), false),
            7 => (format!("Rate({x})"), false),
            8 => (format!("Cache({x}, 15ms)"), false),
            9 => (format!("Count({x}, 3)"), false),
            10 => (format!("Greater({x}, {})", rng.below(8)), true),
            11 => (format!("Less({x}, {})", rng.below(8)), true),
            12 => (format!("Threshold({x}, 5, 2)"), true),
            13 => (format!("Changed({x})"), true),
            14 => ("Timer(20ms)".to_string(), false),
            15 => (format!("set(\"k.x.k{}\", {x})", rng.below(2)), false),
            _ => (format!("Forwarder(Forwarder({x}))"), false),
        }
    }

    /// A random program of 4 to 15 rules, with triggers from earlier rules to later ones and some `[manual]`.
    fn random_program(rng: &mut flexstack_fuzzkit::Rng) -> String {
        let n = 4 + rng.below(12);
        let mut rules: Vec<(String, bool)> = Vec::new();
        let mut lines = Vec::new();
        let mut manual = Vec::new();
        for i in 0..n {
            let (expr, is_bool) = random_expr(rng, &rules);
            let line = format!("r{i}: {expr}");
            if rng.one_in(6) {
                manual.push(line);
            } else {
                lines.push(line);
            }
            if i > 0 && rng.one_in(5) {
                lines.push(format!("r{} -> r{i}", rng.below(i)));
            }
            rules.push((format!("r{i}"), is_bool));
        }
        if !manual.is_empty() {
            lines.push("[manual]".to_string());
            lines.extend(manual);
        }
        lines.join("\n")
    }

    /// One random operation on `engine`; returns what it answered.
    fn random_op(engine: &mut RuleEngine, env: &mut MemoryEnv, op: u64, t: u64) -> String {
        let mut rng = flexstack_fuzzkit::Rng::new(op);
        let rule = format!("r{}", rng.below(15));
        match rng.below(10) {
            0..=2 => {
                let (m, v) = (format!("m.x.m{}", rng.below(3)), Value::U64(rng.below(10) as u64));
                env.meter(&m, v.clone());
                engine.handle_meter_changed(&m, v, ms(t), env);
                format!("{:?}", engine.poll_writes())
            }
            3 | 4 => {
                for _ in 0..=rng.below(2) {
                    env.meter(&format!("m.x.m{}", rng.below(3)), Value::U64(rng.below(10) as u64));
                }
                format!("{:?}", drive(engine, env, ms(t)))
            }
            5 => format!("{:?}", engine.evaluate(&rule, ms(t), env)),
            6 => format!("{:?}", engine.handle_unload(&[rule.as_str()], ms(t), env)),
            7 => format!("{:?}", engine.handle_load(&[rule.as_str()], ms(t), env)),
            8 => format!("{:?}", engine.handle_replace(&rule, &format!("r{}", rng.below(15)), ms(t), env)),
            _ => format!("{:?}", engine.handle_rollback(1 + rng.below(3) as u64, ms(t), env)),
        }
    }

    #[test]
    fn plans_agree_with_the_general_evaluation_on_random_programs() {
        let mut rng = flexstack_fuzzkit::Rng::new(0x91a5_0001);
        let mut programs = 0;
        let mut ops = 0;
        while programs < 120 {
            let text = random_program(&mut rng);
            let mut env = MemoryEnv::new();
            for m in 0..3 {
                env.meter(&format!("m.x.m{m}"), Value::U64(0));
            }
            env.knob("k.x.k0", Value::U64(0)).knob("k.x.k1", Value::U64(0));
            let (mut with, mut without) = (RuleEngine::new(), without_plans());
            let a = with.handle_load_text("p", &text, ms(0), &env);
            let b = without.handle_load_text("p", &text, ms(0), &env);
            assert_eq!(format!("{a:?}"), format!("{b:?}"), "{text}");
            if a.is_err() {
                continue;
            }
            programs += 1;
            let (mut env_a, mut env_b) = (env.clone(), env);
            for k in 1..=40u64 {
                let op = rng.next();
                let t = 7 * k;
                let ra = random_op(&mut with, &mut env_a, op, t);
                let rb = random_op(&mut without, &mut env_b, op, t);
                assert_eq!(ra, rb, "op {k} of\n{text}");
                assert_eq!(snapshot(&mut with), snapshot(&mut without), "after op {k} ({ra}) of\n{text}");
                ops += 1;
            }
        }
        assert_eq!(ops, 120 * 40);
    }
}
