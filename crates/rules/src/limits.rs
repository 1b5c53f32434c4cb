//! The engine's bounds: how many rule instances may run, how much memory the rules may take, how many revisions the
//! repository keeps; and the estimates the memory bound is checked against.
//!
//! A per-name rule makes one instance per matching name, so a thousand such rules over a few dozen names make tens
//! of thousands of instances, each with its units. [`Limits`] caps that: a change (load, replace, rollback) that
//! would exceed a cap is refused as a whole with [`crate::RuleError::Limit`]; an instance that a new name would
//! create while the engine runs is not created, and counted ([`crate::RuleEngine::usage`]'s
//! `refused_instances_total`). The memory bound is checked against an estimate made from the definitions, not
//! measured: every definition and every running unit counts its fixed size, its names and, for windows, the samples
//! the window may hold at most (a duration window counts one sample per millisecond, at most
//! [`crate::units::MAX_SAMPLES`]).

use crate::compile::{Program, RuleAction, RuleDef};
use crate::units::{Node, Param, Window, MAX_SAMPLES};
use serde::Serialize;

/// The engine's caps. The defaults are [`Limits::DEFAULT`]; the daemon sets them from its options
/// (`--rules-max-instances`, `--rules-max-memory-mb`, `--rules-max-revisions`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Limits {
    /// Most rule instances running at once (a rule without `*` is one instance; a per-name rule one per name).
    pub max_instances: usize,
    /// Most bytes the definitions and the running units may take, as estimated (see the module docs).
    pub max_memory_bytes: usize,
    /// Most revisions the repository keeps (the oldest go first; the numbers go on counting).
    pub max_revisions: usize,
}

impl Limits {
    /// The defaults: 10,000 instances, 64 MiB, 64 revisions.
    pub const DEFAULT: Limits = Limits { max_instances: 10_000, max_memory_bytes: 64 << 20, max_revisions: 64 };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::DEFAULT
    }
}

/// Which cap refused something.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cap {
    /// [`Limits::max_instances`].
    Instances,
    /// [`Limits::max_memory_bytes`].
    Memory,
}

impl Cap {
    /// The field of [`Limits`] it is.
    pub fn name(self) -> &'static str {
        match self {
            Cap::Instances => "max_instances",
            Cap::Memory => "max_memory_bytes",
        }
    }
}

/// What the engine holds now, against its [`Limits`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Rule instances running.
    pub instances: usize,
    /// Functional units running.
    pub units: usize,
    /// Rules defined (loaded or not).
    pub definitions: usize,
    /// Revisions kept in the repository.
    pub revisions: usize,
    /// Estimated bytes of the definitions and the running units.
    pub memory_bytes: usize,
    /// Instances not created because a cap was reached (names that appeared while the engine ran), since start.
    pub refused_instances_total: u64,
}

/// The most samples a window may hold.
fn window_samples(w: Window) -> usize {
    match w {
        Window::Samples(n) => n.min(MAX_SAMPLES),
        Window::Duration(ns) => usize::try_from(ns / 1_000_000).unwrap_or(MAX_SAMPLES).clamp(1, MAX_SAMPLES),
        Window::Input => 0,
    }
}

/// Bytes of a parameter beyond its fixed size.
fn param_bytes(p: &Param) -> usize {
    match p {
        Param::Name(n) => n.len(),
        Param::Value(flexstack_core::Value::Str(s)) => s.len(),
        _ => 0,
    }
}

/// The estimated bytes of the units a node makes in one instance: per unit its fixed parts (state, hot entry, key,
/// signature, inputs) and the samples its window may hold.
fn node_unit_bytes(node: &Node, key_len: usize) -> usize {
    /// A unit's fixed parts: its state and hot entry, its key and signature strings' headers, and a margin for the
    /// runtime's per-unit indexes (subscriptions, plans).
    const UNIT: usize = 256;
    /// One sample of a window: its time and value.
    const SAMPLE: usize = 16;
    match node {
        Node::Ref(_) => 8,
        Node::Unit { param, args, .. } => {
            let window = if let Param::Window(w) = param { window_samples(*w) * SAMPLE } else { 0 };
            UNIT + 2 * key_len
                + 2 * param_bytes(param)
                + window
                + args.iter().map(|a| node_unit_bytes(a, key_len + 2)).sum::<usize>()
        }
    }
}

/// Bytes of a node in a definition.
fn node_def_bytes(node: &Node) -> usize {
    match node {
        Node::Ref(r) => 64 + r.len(),
        Node::Unit { param, args, .. } => 64 + param_bytes(param) + args.iter().map(node_def_bytes).sum::<usize>(),
    }
}

/// The estimated bytes of a definition (kept whether or not it is loaded).
pub fn definition_bytes(def: &RuleDef) -> usize {
    let names = |v: &[String]| v.iter().map(|s| 24 + s.len()).sum::<usize>();
    let actions: usize = def
        .actions
        .iter()
        .map(|a| match a {
            RuleAction::Load(v) | RuleAction::Unload(Some(v)) => 32 + names(v),
            RuleAction::Unload(None) => 32,
            RuleAction::Replace(a, b) => 80 + a.len() + b.len(),
        })
        .sum();
    std::mem::size_of::<RuleDef>()
        + 2 * def.name.len()
        + def.source.len()
        + node_def_bytes(&def.node)
        + names(&def.triggered_by)
        + actions
        + def.driver.as_ref().map_or(0, String::len)
}

/// The estimated bytes of one running instance of `def` (its units and its entry in the runtime's indexes).
pub fn instance_bytes(def: &RuleDef, captures: &[String]) -> usize {
    /// An instance's entries: its record, its key in the index by rule and captures, its root, rank and plans.
    const INSTANCE: usize = 256;
    let key_len = def.name.len() + captures.iter().map(|c| c.len() + 1).sum::<usize>() + 4;
    INSTANCE
        + key_len * 2
        + node_unit_bytes(&def.node, key_len)
        + if matches!(def.node, Node::Ref(_)) { 256 } else { 0 }
}

/// The estimated bytes of every definition of `program`.
pub fn program_bytes(program: &Program) -> usize {
    program.rules.values().map(definition_bytes).sum()
}
