//! Revisions of the stack: log, show, rollback.

use serde::{Deserialize, Serialize};

/// `config_log`: the stack's revisions. Result: a list of [`RevisionInfo`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConfigLog;

/// `config_show`: a revision's stack description; the running stack's when `rev` is absent. Result:
/// [`RevisionStack`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigShow {
    /// Revision number.
    #[serde(default)]
    pub rev: Option<u64>,
}

/// `config_rollback`: returns the stack to revision `rev` (a new revision records the rollback). Result:
/// [`Change`](crate::ops::Change).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigRollback {
    /// Revision number.
    pub rev: u64,
}

/// One revision of `config_log`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevisionInfo {
    /// Its number, from 1.
    pub revision: u64,
    /// When, in milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// Who asked for it.
    pub user: String,
    /// What changed, as the command that changed it.
    pub change: String,
    /// Side effects the switch reported.
    pub notes: Vec<String>,
    /// Present for an entry of a rule's knob writes (user `rules`), which stands for all the writes of that rule
    /// within a window (`change` and the stack are those of the last one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<RuleWrites>,
}

/// The knob writes of one rule that a revision stands for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleWrites {
    /// The rule that wrote.
    pub rule: String,
    /// How many writes the entry stands for.
    pub writes: u64,
    /// When the first of them was made, in milliseconds since the Unix epoch.
    pub first_ms: u64,
}

/// The result of `config_show`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevisionStack {
    /// The revision.
    pub revision: u64,
    /// The whole stack as a TOML description.
    pub stack: String,
}
