//! The results of changes to the stack.

use serde::{Deserialize, Serialize};

/// The result of a change to the stack (`module_load`, `module_unload`, `module_replace`, `link_add`, `link_del`,
/// `tap_del`, `config_rollback`): the stack revision it became.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    /// The revision's number (`config log`).
    pub revision: u64,
    /// Side effects the switch reported (links removed with a module, ...).
    pub notes: Vec<String>,
}

/// The result of `pause` and `resume`: runtime states, not revisions.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Notes {
    /// What the switch reported.
    pub notes: Vec<String>,
}
