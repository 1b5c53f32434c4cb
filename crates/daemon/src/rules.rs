//! The daemon's cross-layer rules: one [`RuleEngine`] (crate `flexstack-rules`) owned by a control-plane thread of
//! its own, so rules run asynchronously to packet processing.
//!
//! How the parts are called:
//! - [`RulesService::start`] spawns the thread. Client threads reach the engine only through
//!   [`RulesService::call`], which sends a closure to the thread and waits for its answer; the action functions
//!   of the `rules_*` requests ([`RulesService::load`], [`RulesService::unload`], ...) are built on it.
//! - The thread loop: wait for a message or the next deadline; then `advance` the engine at the sampling
//!   interval (it samples every meter the loaded rules `get`, fires due timers, creates and drops per-name
//!   instances) or earlier when a timer is due; the interval stretches while a sample would take more than the
//!   share of a core [`Sampling`] allows; apply the knob writes it returns through the daemon's `set` path
//!   (the [`KnobWriter`]), report each result back with `handle_write_result`, and log the engine's notices.
//! - Meters that announce their changes (application variables updated over the app socket) are pushed with
//!   [`RulesService::meter_changed`]: the engine evaluates the rules waiting on them at once instead of at the
//!   next sample.
//! - The engine reads variables through [`RegistryEnv`], an [`Environment`] over the daemon's registry: a name
//!   under its lock, a pattern over a snapshot of the runtime groups it can reach.
//!
//! Rule changes are revisions of the engine's own repository (`rules log`), separate from the stack's revisions;
//! the knob writes rules make go through `set` and so are stack revisions by the user `rules`, coalesced per rule
//! ([`crate::actions::RevisionLog`]).
//!
//! The engine is bounded by its [`Limits`] (`daemon --rules-max-instances`, `--rules-max-memory-mb`,
//! `--rules-max-revisions`): a change over a cap fails with `limit_reached`, and what it holds is published as the
//! meters `rules.engine.*` ([`ENGINE`]). After a change that freed memory, the thread gives the allocator's free
//! memory back to the kernel (`trim_heap`), so the daemon's resident memory returns after an unload.

use flexstack_api::ops::{
    RuleInfo, RuleInstance, RuleSection, RuleSummary, RulesHistory, RulesLimits, RulesLoaded, RulesNotice,
    RulesRevision, RulesRevisionInfo, UnitInfo, UnitState,
};
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_core::decl::{KindDecl, MeterDecl};
use flexstack_core::vars::{is_pattern, DynamicVars};
use flexstack_core::{Meter, ModuleVars, SharedRegistry, Time, Value};
use flexstack_rules::env::absent;
use flexstack_rules::syntax::Section;
use flexstack_rules::units::StateValue;
use flexstack_rules::{Cap, Environment, Existence, Limits, RuleEngine, RuleError};
use std::collections::VecDeque;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Applies one knob write as `flexstack set` would (validated, between batches): `(rule, knob, value)`, the rule
/// being the one whose `set` wrote; the error says why it was refused.
pub type KnobWriter = Box<dyn Fn(&str, &str, &Value) -> Result<(), String> + Send>;

/// The prefix of the engine's meters.
pub const METERS_PREFIX: &str = "rules.engine";

/// The handles of the engine's meters.
#[derive(Default)]
pub struct EngineMeters {
    instances: Meter,
    units: Meter,
    definitions: Meter,
    memory: Meter,
    refused: Meter,
    max_instances: Meter,
    max_memory: Meter,
    sample_interval: Meter,
}

/// The engine's meters, `rules.engine.<name>`, declared once.
pub const ENGINE: KindDecl<(), EngineMeters> = KindDecl {
    meters: &[
        MeterDecl::u64("instances", "instances", "rule instances running", |m| &mut m.instances),
        MeterDecl::u64("units", "units", "functional units running", |m| &mut m.units),
        MeterDecl::u64("definitions", "rules", "rules defined, loaded or not (`rules delete` removes them)", |m| {
            &mut m.definitions
        }),
        MeterDecl::u64("memory_bytes", "bytes", "estimated bytes of the definitions and running units", |m| {
            &mut m.memory
        }),
        MeterDecl::u64(
            "instances_refused_total",
            "instances",
            "per-name instances not created because a cap was reached (each name counted once)",
            |m| &mut m.refused,
        ),
        MeterDecl::u64("max_instances", "instances", "the cap on instances (daemon --rules-max-instances)", |m| {
            &mut m.max_instances
        }),
        MeterDecl::u64(
            "max_memory_bytes",
            "bytes",
            "the cap on the estimated memory (daemon --rules-max-memory-mb)",
            |m| &mut m.max_memory,
        ),
        MeterDecl::u64(
            "sample_interval_us",
            "us",
            "the time between samples of the rules' meters: daemon --rules-interval-ms, longer while sampling would \
             take more than --rules-max-cpu percent of a core",
            |m| &mut m.sample_interval,
        ),
    ],
    ..KindDecl::new("rules", "the daemon's rules engine")
};

impl EngineMeters {
    /// Registers the meters in `registry`; the registration lasts as long as the returned [`DynamicVars`].
    fn register(registry: &SharedRegistry) -> (DynamicVars, ModuleVars, EngineMeters) {
        let mut dynamic = DynamicVars::new(registry.clone());
        let specs = ENGINE.interface(&()).vars;
        let vars = dynamic.register("rules", METERS_PREFIX, specs).expect("rules.engine is a valid prefix");
        let meters = ENGINE.meters(&vars);
        (dynamic, vars, meters)
    }

    /// Publishes what `engine` holds.
    fn update(&self, engine: &RuleEngine) {
        let (u, l) = (engine.usage(), engine.limits());
        self.instances.set(u.instances as u64);
        self.units.set(u.units as u64);
        self.definitions.set(u.definitions as u64);
        self.memory.set(u.memory_bytes as u64);
        self.refused.set(u.refused_instances_total);
        self.max_instances.set(l.max_instances as u64);
        self.max_memory.set(l.max_memory_bytes as u64);
    }
}

/// How the rules thread samples the meters its rules read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sampling {
    /// The time between samples (`daemon --rules-interval-ms`).
    pub interval: Duration,
    /// The share of one core, in percent, that sampling may take (`daemon --rules-max-cpu`): a sample that takes
    /// longer than this share of the interval puts the next one later, so that many instances (a per-name rule over
    /// 100,000 flows) are sampled less often instead of taking a whole core.
    pub max_cpu_percent: u32,
}

impl Sampling {
    /// The default: every 5 ms, at most 10 % of a core.
    pub const DEFAULT: Sampling = Sampling { interval: Duration::from_millis(5), max_cpu_percent: 10 };

    /// The time from the start of a sample that took `spent` to the start of the next, when the one before came
    /// `current` after the sample before it: the share of a core kept, but at most twice `current`, so that a
    /// single long sample (the one that makes 100,000 instances) does not put the next ones far away.
    pub fn next_after(&self, current: Duration, spent: Duration) -> Duration {
        let kept = spent.saturating_mul(100) / self.max_cpu_percent.clamp(1, 100);
        kept.min(current.saturating_mul(2)).max(self.interval)
    }
}

/// Most notices kept for `rules log` (older ones are dropped).
const MAX_NOTICES: usize = 200;

/// How long a client waits for the rules thread to answer before giving up.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// An [`Environment`] over the daemon's registry: values are read live from the cells.
pub struct RegistryEnv {
    registry: SharedRegistry,
}

impl RegistryEnv {
    /// The environment over the registry's current variables.
    pub fn new(registry: &SharedRegistry) -> RegistryEnv {
        RegistryEnv { registry: registry.clone() }
    }
}

/// A name is read under the registry's lock, a pattern over a snapshot of the groups it can reach: a whole snapshot
/// costs a reference count per runtime group (several ms with 100,000 flows), at every sample (5 ms) and meter
/// change.
impl Environment for RegistryEnv {
    fn get(&self, name: &str) -> Option<Value> {
        self.registry.with_var(name, |v| v.get())
    }

    fn set(&mut self, name: &str, _value: Value) -> Result<(), String> {
        Err(format!("{name}: the daemon's rules thread applies writes through `set`, not the environment"))
    }

    fn names(&self, pattern: &str) -> Vec<String> {
        self.registry.snapshot_for(pattern).matching(pattern).map(|(n, _)| n.to_string()).collect()
    }

    fn names_generation(&self) -> Option<u64> {
        Some(self.registry.names_generation())
    }

    fn hold(&self, name: &str) -> Option<Box<dyn flexstack_rules::HeldValue>> {
        self.registry.with_var(name, |v| Box::new(v.to_handle()) as Box<dyn flexstack_rules::HeldValue>)
    }

    fn exists(&self, name: &str) -> Existence {
        let found = if is_pattern(name) {
            self.registry.snapshot_for(name).matching(name).next().is_some()
        } else {
            self.get(name).is_some()
        };
        if found {
            Existence::Known
        } else {
            absent(name)
        }
    }
}

/// What the rules thread owns: the engine and the notices it reported.
pub struct RulesState {
    /// The engine.
    pub engine: RuleEngine,
    /// Recent notices (context actions, refused writes), oldest first.
    pub notices: VecDeque<RulesNotice>,
}

type Job = Box<dyn FnOnce(&mut RulesState, Time, &RegistryEnv) + Send>;

enum Msg {
    Call(Job),
    MeterChanged(String, Value),
}

/// The handle client threads use to reach the rules thread.
pub struct RulesService {
    tx: mpsc::Sender<Msg>,
}

fn rule_error(source: Option<&str>, e: RuleError) -> ApiError {
    match e {
        RuleError::Invalid(diags) => {
            let prefix = source.map_or(String::new(), |s| format!("{s}:"));
            let lines: Vec<String> = diags.iter().map(|d| format!("{prefix}{d}")).collect();
            ApiError::new(ErrorCode::InvalidRules, lines.join("\n"))
        }
        RuleError::Limit { cap, .. } => {
            ApiError::new(ErrorCode::LimitReached, format!("{e}; nothing changed: {}", raise(cap)))
        }
        RuleError::InUse(..) => ApiError::new(ErrorCode::InvalidEdit, e.to_string()),
        other => ApiError::new(ErrorCode::NotFound, other.to_string()),
    }
}

/// How to raise `cap`, or make room under it.
fn raise(cap: Cap) -> String {
    let flag = match cap {
        Cap::Instances => "--rules-max-instances N",
        Cap::Memory => "--rules-max-memory-mb N",
    };
    format!("raise the cap with `flexstack daemon {flag}`, or unload or delete rules (`rules unload`, `rules delete`)")
}

/// A notice of the engine, with how to raise the cap it names (instances a cap kept from being created).
fn with_hint(message: String) -> String {
    match [Cap::Instances, Cap::Memory].into_iter().find(|c| message.ends_with(&format!("({})", c.name()))) {
        Some(cap) => format!("{message}; {}", raise(cap)),
        None => message,
    }
}

impl RulesService {
    /// Starts the rules thread over `registry`, applying knob writes with `writer`, advancing the engine every
    /// `sampling` while rules are loaded (and sleeping until a request comes while none are).
    pub fn start(
        registry: SharedRegistry,
        writer: KnobWriter,
        sampling: Sampling,
        limits: Limits,
    ) -> std::io::Result<RulesService> {
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("rules".into())
            .spawn(move || run(&rx, &registry, &writer, sampling, limits))?;
        Ok(RulesService { tx })
    }

    /// Runs `f` on the rules thread with the engine, the current time and an environment; waits for its result.
    pub fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut RulesState, Time, &RegistryEnv) -> R + Send + 'static,
    ) -> Result<R, ApiError> {
        let (reply, answer) = mpsc::sync_channel(1);
        let job: Job = Box::new(move |state, now, env| {
            let _ = reply.send(f(state, now, env));
        });
        self.tx.send(Msg::Call(job)).map_err(|_| ApiError::new(ErrorCode::Internal, "the rules thread stopped"))?;
        answer
            .recv_timeout(CALL_TIMEOUT)
            .map_err(|_| ApiError::new(ErrorCode::Internal, "the rules thread did not answer"))
    }

    /// A meter changed now (pushed by its owner): the rules waiting on it run without waiting for a sample.
    pub fn meter_changed(&self, name: &str, value: Value) {
        let _ = self.tx.send(Msg::MeterChanged(name.to_string(), value));
    }

    /// `rules load`: checks and loads the text named `source`; errors carry `source:line:column`.
    pub fn load(&self, source: String, text: String) -> Result<RulesLoaded, ApiError> {
        self.call(move |s, now, env| match s.engine.handle_load_text(&source, &text, now, env) {
            Ok(r) => {
                let warnings = r.warnings.iter().map(|d| format!("{source}:{d}")).collect();
                Ok(RulesLoaded { revision: r.revision, defined: r.defined, loaded: r.loaded, warnings })
            }
            Err(e) => Err(rule_error(Some(&source), e)),
        })?
    }

    /// `rules unload NAME...` (`ALL`: every rule).
    pub fn unload(&self, names: Vec<String>) -> Result<RulesRevision, ApiError> {
        self.call(move |s, now, env| {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            revision(s.engine.handle_unload(&names, now, env))
        })?
    }

    /// `rules delete NAME...` (`ALL`: every rule): the definitions go, unloaded first.
    pub fn delete(&self, names: Vec<String>) -> Result<RulesRevision, ApiError> {
        self.call(move |s, now, env| {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            revision(s.engine.handle_delete(&names, now, env))
        })?
    }

    /// `rules replace OLD NEW`.
    pub fn replace(&self, old: String, new: String) -> Result<RulesRevision, ApiError> {
        self.call(move |s, now, env| revision(s.engine.handle_replace(&old, &new, now, env)))?
    }

    /// `rules rollback REV`.
    pub fn rollback(&self, rev: u64) -> Result<RulesRevision, ApiError> {
        self.call(move |s, now, env| revision(s.engine.handle_rollback(rev, now, env)))?
    }

    /// `rules list`: every defined rule with its section, source, whether loaded, instances and value.
    pub fn list(&self) -> Result<Vec<RuleSummary>, ApiError> {
        self.call(|s, _, _| s.engine.list().into_iter().map(summary).collect())
    }

    /// `rules show NAME`: the rule's text, commands and live unit graph.
    pub fn show(&self, name: String) -> Result<RuleInfo, ApiError> {
        self.call(move |s, _, _| {
            s.engine.show(&name).map(rule_info).ok_or_else(|| {
                ApiError::new(ErrorCode::NotFound, format!("unknown rule {name}: expected one listed by `rules list`"))
            })
        })?
    }

    /// `rules log`: the repository's revisions, the recent notices, and how many units and instances run.
    pub fn log(&self) -> Result<RulesHistory, ApiError> {
        self.call(|s, _, _| {
            let (u, l) = (s.engine.usage(), s.engine.limits());
            RulesHistory {
                revisions: s.engine.log().into_iter().map(revision_info).collect(),
                notices: s.notices.iter().cloned().collect(),
                units: u.units,
                instances: u.instances,
                definitions: u.definitions,
                memory_bytes: u.memory_bytes,
                refused_instances_total: u.refused_instances_total,
                limits: RulesLimits {
                    max_instances: l.max_instances,
                    max_memory_bytes: l.max_memory_bytes,
                    max_revisions: l.max_revisions,
                },
            }
        })
    }

    /// `rules diff A B`: the commands added and removed between two revisions.
    pub fn diff(&self, from: u64, to: u64) -> Result<Vec<String>, ApiError> {
        self.call(move |s, _, _| s.engine.diff(from, to).map_err(|e| rule_error(None, e)))?
    }
}

/// A new rules revision's number as the result of `rules unload`, `replace` or `rollback`.
fn revision(r: Result<u64, RuleError>) -> Result<RulesRevision, ApiError> {
    r.map(|revision| RulesRevision { revision }).map_err(|e| rule_error(None, e))
}

fn section(s: Section) -> RuleSection {
    match s {
        Section::Default => RuleSection::Default,
        Section::Manual => RuleSection::Manual,
        Section::ContextEnter => RuleSection::ContextEnter,
        Section::ContextExit => RuleSection::ContextExit,
    }
}

fn summary(r: flexstack_rules::RuleSummary) -> RuleSummary {
    RuleSummary {
        name: r.name,
        section: section(r.section),
        source: r.source,
        explicit: r.explicit,
        instances: r.instances,
        value: r.value,
    }
}

fn rule_info(v: flexstack_rules::RuleView) -> RuleInfo {
    let unit = |u: flexstack_rules::UnitView| UnitInfo {
        key: u.key,
        kind: u.kind.to_string(),
        inputs: u.inputs,
        value: u.value,
        state: u
            .state
            .into_iter()
            .map(|(k, s)| {
                let s = match s {
                    StateValue::Value(v) => UnitState::Value(v),
                    StateValue::Samples(v) => UnitState::Samples(v),
                };
                (k.to_string(), s)
            })
            .collect(),
    };
    let instance = |i: flexstack_rules::InstanceView| RuleInstance {
        captures: i.captures,
        refcount: i.refcount,
        pulled: i.pulled,
        value: i.value,
        units: i.units.into_iter().map(unit).collect(),
    };
    RuleInfo {
        name: v.name,
        section: section(v.section),
        source: v.source,
        text: v.text,
        commands: v.commands,
        explicit: v.explicit,
        instances: v.instances.into_iter().map(instance).collect(),
    }
}

fn revision_info(r: flexstack_rules::RevisionInfo) -> RulesRevisionInfo {
    RulesRevisionInfo { number: r.number, what: r.what, at: r.at.as_nanos(), rules: r.rules, loaded: r.loaded }
}

/// Gives the memory this thread freed back to the kernel. glibc's `malloc_trim` (`trim_heap`) releases the free
/// blocks inside every arena, but not the free top of a thread's arena, where an unloaded runtime's many small
/// blocks end up; glibc shrinks that top only when a block of 64 KiB or more that borders it is freed. So this
/// frees one first: below the mmap threshold (128 KiB), it comes from this thread's arena, whose small free blocks
/// glibc merges before serving it.
fn give_back_memory() {
    drop(std::hint::black_box(Vec::<u8>::with_capacity(96 << 10)));
    flexstack_sys::trim_heap();
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// The rules thread.
fn run(rx: &mpsc::Receiver<Msg>, registry: &SharedRegistry, writer: &KnobWriter, sampling: Sampling, limits: Limits) {
    let origin = Instant::now();
    let clock = || Time(u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX));
    let mut state = RulesState { engine: RuleEngine::with_limits(limits), notices: VecDeque::new() };
    // Blocks of 128 KiB and more (the runtime's dense arrays) as fresh mappings, given back when freed: glibc's
    // own threshold rises to the size of the first such block freed, after which they come from this thread's
    // arena, whose free top `trim_heap` does not give back (an unloaded runtime stayed resident).
    flexstack_sys::fix_mmap_threshold(128 * 1024);
    let (_registration, _vars, meters) = EngineMeters::register(registry);
    meters.update(&state.engine);
    let mut interval = sampling.interval;
    meters.sample_interval.set(micros(interval));
    let mut next_sample = clock();
    loop {
        let now = clock();
        let idle = state.engine.unit_count() == 0;
        let deadline = [Some(next_sample), state.engine.next_wakeup()].into_iter().flatten().min().unwrap_or(now);
        let msg = if idle {
            rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected)
        } else {
            rx.recv_timeout(deadline.saturating_since(now))
        };
        let now = clock();
        let before = state.engine.usage();
        match msg {
            Ok(Msg::Call(job)) => job(&mut state, now, &RegistryEnv::new(registry)),
            Ok(Msg::MeterChanged(name, value)) => {
                state.engine.handle_meter_changed(&name, value, now, &RegistryEnv::new(registry));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        let mut writes = Vec::new();
        if now >= next_sample || state.engine.next_wakeup().is_some_and(|t| t <= now) {
            writes = state.engine.advance(now, &RegistryEnv::new(registry)).writes;
            if now >= next_sample {
                let next = sampling.next_after(interval, clock().saturating_since(now));
                if next != interval {
                    interval = next;
                    meters.sample_interval.set(micros(interval));
                }
                next_sample = now + interval;
            }
        }
        writes.extend(state.engine.poll_writes());
        for w in &writes {
            // The rule is the first part of the set unit's key (`cc[a]/1` was written by rule cc).
            let rule = w.unit.split(['[', '/']).next().unwrap_or_default();
            let result = writer(rule, &w.name, &w.value);
            if let Err(e) = &result {
                tracing::warn!(unit = %w.unit, knob = %w.name, value = %w.value, error = %e, "rule write refused");
            } else {
                tracing::debug!(unit = %w.unit, knob = %w.name, value = %w.value, "rule wrote");
            }
            state.engine.handle_write_result(w, result, now);
        }
        while let Some(n) = state.engine.poll_notice() {
            let n = flexstack_rules::Notice { message: with_hint(n.message), ..n };
            tracing::info!(at = %n.at, "rules: {}", n.message);
            if state.notices.len() >= MAX_NOTICES {
                state.notices.pop_front();
            }
            state.notices.push_back(RulesNotice { t_ms: n.at.as_nanos() / 1_000_000, message: n.message });
        }
        let after = state.engine.usage();
        if after != before {
            meters.update(&state.engine);
            // Units, instances or definitions went: their memory goes back to the kernel, not only to the
            // allocator (a few milliseconds, only after such a change).
            if after.memory_bytes < before.memory_bytes || after.revisions < before.revisions {
                give_back_memory();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flexstack_core::vars::{DynamicVars, VarSpec};
    use flexstack_core::ValueType;
    use std::sync::{Arc, Mutex};

    fn registry_with_loss() -> (SharedRegistry, DynamicVars, flexstack_core::vars::ModuleVars) {
        let shared = SharedRegistry::default();
        let mut dynamic = DynamicVars::new(shared.clone());
        let vars = dynamic
            .register(
                "test",
                "app.t",
                &[
                    VarSpec::meter("loss", ValueType::F64, "", "loss"),
                    VarSpec::knob("cc", ValueType::Str, "", "congestion control"),
                ],
            )
            .unwrap();
        (shared, dynamic, vars)
    }

    #[test]
    fn registry_env_reads_matches_and_classifies_names() {
        let (shared, _dynamic, vars) = registry_with_loss();
        vars.cell("loss").unwrap().set_f64(0.5);
        let env = RegistryEnv::new(&shared);
        assert_eq!(env.get("app.t.loss"), Some(Value::F64(0.5)));
        assert_eq!(env.exists("app.t.cc"), Existence::Known);
        assert_eq!(env.names("app.*.cc"), vec!["app.t.cc".to_string()]);
        assert_eq!(env.exists("app.t.loss"), Existence::Known);
        assert_eq!(env.exists("app.*.loss"), Existence::Known);
        assert_eq!(env.exists("app.u.loss"), Existence::Maybe);
        assert_eq!(env.exists("module.x.y"), Existence::No);
    }

    #[test]
    fn the_thread_samples_meters_applies_writes_and_reports_refusals() {
        let (shared, _dynamic, vars) = registry_with_loss();
        let written: Arc<Mutex<Vec<(String, Value)>>> = Arc::default();
        let log = written.clone();
        let writer: KnobWriter = Box::new(move |rule, name, value| {
            assert_eq!(rule, "cc");
            log.lock().unwrap().push((name.to_string(), value.clone()));
            if value == &Value::Str("refuse".into()) {
                Err("refused by the test".into())
            } else {
                Ok(())
            }
        });
        let svc = RulesService::start(
            shared.clone(),
            writer,
            Sampling { interval: Duration::from_millis(2), ..Sampling::DEFAULT },
            Limits::DEFAULT,
        )
        .unwrap();
        let text = "lossy: Threshold(get(\"app.t.loss\"), 0.4, 0.2)\n\
                    cc: set(\"app.t.cc\", If(lossy, \"bbr\", \"refuse\"))\n";
        let r = svc.load("t.rules".into(), text.into()).unwrap();
        assert_eq!(r.revision, 1);
        type Writes = [(String, Value)];
        let wait = |what: &str, cond: &dyn Fn(&Writes) -> bool| {
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if cond(&written.lock().unwrap()) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            panic!("timed out waiting for {what}: {:?}", written.lock().unwrap());
        };
        // loss is 0: the first evaluation writes "refuse", which the writer refuses: a notice.
        wait("the first write", &|w| w.iter().any(|(_, v)| v == &Value::Str("refuse".into())));
        vars.cell("loss").unwrap().set_f64(0.5);
        wait("bbr after sampling", &|w| w.iter().any(|(_, v)| v == &Value::Str("bbr".into())));
        let log = svc.log().unwrap();
        assert!(log.notices.iter().any(|n| n.message.contains("refused by the test")), "{log:?}");
        // Sampling one meter is cheap: the interval is the one asked for.
        let interval = shared.with_var("rules.engine.sample_interval_us", |v| v.get());
        assert_eq!(interval, Some(Value::U64(2000)));
        // A pushed change is evaluated without waiting for a sample.
        vars.cell("loss").unwrap().set_f64(0.1);
        svc.meter_changed("app.t.loss", Value::F64(0.1));
        wait("refuse again after the push", &|w| {
            w.iter().filter(|(_, v)| v == &Value::Str("refuse".into())).count() >= 2
        });
    }

    #[test]
    fn sampling_stretches_only_past_its_share_of_a_core() {
        let ms = Duration::from_millis;
        let s = Sampling { interval: ms(5), max_cpu_percent: 10 };
        let far = ms(1000);
        assert_eq!(s.next_after(ms(5), Duration::ZERO), ms(5));
        assert_eq!(s.next_after(ms(5), ms(1) / 2), ms(5), "10 % of 5 ms: still the interval");
        assert_eq!(s.next_after(far, ms(2)), ms(20), "2 ms of sampling every 20 ms: 10 %");
        assert_eq!(s.next_after(far, ms(7)), ms(70));
        assert_eq!(s.next_after(ms(70), Duration::ZERO), ms(5), "back at once when sampling is cheap again");
        // One long sample (3 s) doubles the interval, no more; steady 7 ms samples reach 70 ms in a few steps.
        assert_eq!(s.next_after(ms(5), ms(3000)), ms(10));
        let steps: Vec<Duration> =
            std::iter::successors(Some(ms(10)), |&i| Some(s.next_after(i, ms(7)))).take(5).collect();
        assert_eq!(steps, [ms(10), ms(20), ms(40), ms(70), ms(70)]);
        let whole = Sampling { interval: ms(5), max_cpu_percent: 100 };
        assert_eq!(whole.next_after(far, ms(7)), ms(7), "a whole core: back to back");
        let zero = Sampling { interval: ms(5), max_cpu_percent: 0 };
        assert_eq!(zero.next_after(far, ms(1)), ms(100), "0 counts as 1 %");
    }

    #[test]
    fn errors_carry_the_file_name_line_and_column() {
        let svc = RulesService::start(
            SharedRegistry::default(),
            Box::new(|_, _, _| Ok(())),
            Sampling::DEFAULT,
            Limits::DEFAULT,
        )
        .unwrap();
        let e = svc.load("bad.rules".into(), "a: get(\"app.x.y\")\nb: Frobnicate(a)\n".into()).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidRules);
        // Warnings come along with the errors, each located.
        assert!(e.message.contains("\nbad.rules:2:4: error: unknown unit `Frobnicate`"), "{}", e.message);
        assert!(e.message.starts_with("bad.rules:1:8: warning: unknown meter name `app.x.y`"), "{}", e.message);
        assert!(svc.list().unwrap().is_empty());
        assert_eq!(svc.show("a".into()).unwrap_err().code, ErrorCode::NotFound);
        assert_eq!(svc.rollback(9).unwrap_err().code, ErrorCode::NotFound);
    }
}
