//! Rules (docs/rules.md): load, unload, delete, replace, list, show, log, diff, rollback.

use flexstack_core::Value;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `rules_load`: checks and loads a rule text; errors carry `name:line:column`. Result: [`RulesLoaded`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulesLoad {
    /// Where the text came from (the file name), used in messages and `rules list`.
    pub name: String,
    /// The rule text.
    pub text: String,
}

/// `rules_unload`: unloads rules loaded by themselves (`["ALL"]`: every rule). Result: [`RulesRevision`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulesUnload {
    /// Rule names.
    pub names: Vec<String>,
}

/// `rules_delete`: deletes rule definitions (`["ALL"]`: every rule), unloading them first; refused if a rule that
/// stays uses one. Result: [`RulesRevision`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulesDelete {
    /// Rule names.
    pub names: Vec<String>,
}

/// `rules_replace`: replaces rule `old` by rule `new` wherever it is used. Result: [`RulesRevision`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulesReplace {
    /// The rule replaced.
    pub old: String,
    /// The rule that takes its place.
    pub new: String,
}

/// `rules_list`: every defined rule. Result: a list of [`RuleSummary`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RulesList;

/// `rules_show`: a rule's text, commands and live unit graph. Result: [`RuleInfo`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulesShow {
    /// The rule.
    pub name: String,
}

/// `rules_log`: the rules repository's revisions and the rules' recent notices. Result: [`RulesHistory`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RulesLog;

/// `rules_diff`: the commands added and removed between two rules revisions. Result: its lines (`"rule NAME"`,
/// `"- command"`, `"+ command"`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulesDiff {
    /// The older revision.
    pub from: u64,
    /// The newer revision.
    pub to: u64,
}

/// `rules_rollback`: switches the rules to an earlier revision (a new revision records it). Result:
/// [`RulesRevision`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulesRollback {
    /// Revision number.
    pub rev: u64,
}

/// The result of `rules_load`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RulesLoaded {
    /// The rules revision it became.
    pub revision: u64,
    /// The rules it defined, in written order.
    pub defined: Vec<String>,
    /// The rules it loaded (those outside `[manual]`).
    pub loaded: Vec<String>,
    /// Warnings, each `name:line:column: warning: ...`.
    pub warnings: Vec<String>,
}

/// The result of `rules_unload`, `rules_replace` and `rules_rollback`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RulesRevision {
    /// The rules revision it became.
    pub revision: u64,
}

/// The section a rule was written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum RuleSection {
    /// Before any section header: loaded when the text is loaded.
    Default,
    /// `[manual]`: defined, loaded only by `load(...)`.
    Manual,
    /// `[contextEnter]`: watchers that load rules when their condition becomes true.
    ContextEnter,
    /// `[contextExit]`: watchers that unload rules when their condition becomes true.
    ContextExit,
}

/// A rule of `rules_list`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RuleSummary {
    /// The rule's name.
    pub name: String,
    /// Its section.
    pub section: RuleSection,
    /// The text it came from.
    pub source: String,
    /// Loaded by itself (not only as a dependency).
    pub explicit: bool,
    /// Running instances (0: not loaded).
    pub instances: usize,
    /// The output of its only instance (`null` for per-name rules and while it has none).
    pub value: Option<Value>,
}

/// The result of `rules_show`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RuleInfo {
    /// The rule's name.
    pub name: String,
    /// Its section.
    pub section: RuleSection,
    /// The text it came from.
    pub source: String,
    /// Its definition, triggers and actions as text.
    pub text: Vec<String>,
    /// Its preprocessed commands.
    pub commands: Vec<String>,
    /// Loaded by itself (not only as a dependency).
    pub explicit: bool,
    /// Its running instances (none when not loaded).
    pub instances: Vec<RuleInstance>,
}

/// A running instance of a rule.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RuleInstance {
    /// The segments its `*`s captured (empty for a rule without wildcards); `binding` on the wire.
    #[serde(rename = "binding")]
    pub captures: Vec<String>,
    /// How many loaded things hold it: 1 if loaded by itself, plus 1 per loaded rule instance using it.
    pub refcount: u32,
    /// Evaluated only by query (it has a trigger or is used by a rule that has one).
    pub pulled: bool,
    /// Its output.
    pub value: Option<Value>,
    /// Its functional units, root first.
    pub units: Vec<UnitInfo>,
}

/// A functional unit of a rule instance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UnitInfo {
    /// `rule[captures]/path`.
    pub key: String,
    /// The unit's kind (`get`, `set`, `Avg`, ...).
    pub kind: String,
    /// The keys of its inputs.
    pub inputs: Vec<String>,
    /// Its current output.
    pub value: Option<Value>,
    /// Its private state, by name (`writes`, `samples`, ...).
    pub state: BTreeMap<String, UnitState>,
}

/// One entry of a unit's state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum UnitState {
    /// A scalar.
    Value(#[serde(deserialize_with = "crate::value::read")] Value),
    /// A window's samples.
    Samples(#[serde(deserialize_with = "crate::value::read_samples")] Vec<f64>),
}

impl UnitState {
    /// The scalar, if this is one.
    pub fn value(&self) -> Option<&Value> {
        match self {
            UnitState::Value(v) => Some(v),
            UnitState::Samples(_) => None,
        }
    }

    /// The samples, if these are.
    pub fn samples(&self) -> Option<&[f64]> {
        match self {
            UnitState::Samples(s) => Some(s),
            UnitState::Value(_) => None,
        }
    }
}

/// The result of `rules_log`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RulesHistory {
    /// The repository's revisions, oldest first.
    pub revisions: Vec<RulesRevisionInfo>,
    /// Recent notices of the rules (context actions, refused writes), oldest first.
    pub notices: Vec<RulesNotice>,
    /// Functional units running.
    pub units: usize,
    /// Rule instances loaded.
    pub instances: usize,
    /// Rules defined (loaded or not).
    #[serde(default)]
    pub definitions: usize,
    /// Estimated bytes of the definitions and the running units.
    #[serde(default)]
    pub memory_bytes: usize,
    /// Instances not created because a cap was reached, since the daemon started.
    #[serde(default)]
    pub refused_instances_total: u64,
    /// The caps (`daemon --rules-max-instances`, `--rules-max-memory-mb`, `--rules-max-revisions`).
    #[serde(default)]
    pub limits: RulesLimits,
}

/// The rules engine's caps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RulesLimits {
    /// Most rule instances running at once.
    pub max_instances: usize,
    /// Most estimated bytes of definitions and running units.
    pub max_memory_bytes: usize,
    /// Most revisions the rules repository keeps.
    pub max_revisions: usize,
}

/// A revision of the rules repository.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RulesRevisionInfo {
    /// Its number, from 1.
    pub number: u64,
    /// What changed.
    pub what: String,
    /// When, in nanoseconds on the rules thread's clock.
    pub at: u64,
    /// Rules defined in it.
    pub rules: usize,
    /// Rules loaded by themselves in it.
    pub loaded: Vec<String>,
}

/// Something the rules did on their own.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RulesNotice {
    /// When, in milliseconds on the rules thread's clock.
    pub t_ms: u64,
    /// What happened.
    pub message: String,
}
