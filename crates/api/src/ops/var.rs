//! Meters and knobs: get, set, watch, var list.

use flexstack_core::{Value, VarSpec};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use std::collections::BTreeMap;

/// `get`: reads variables by name or pattern (`module.*.frames_in_total`). Result: [`Values`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Get {
    /// Names or patterns.
    pub names: Vec<String>,
}

/// `set`: writes a knob. Result: [`SetResult`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Set {
    /// The knob's full name (`module.sel.select`, `app.voip.cc`).
    pub name: String,
    /// The value: JSON of the knob's type, or text parsed as that type.
    pub value: Json,
}

/// `watch`: streams values every `interval_ms`, all of them or (with `changes`) those that changed. A stream of
/// [`WatchEvent`]s, ended by [`WatchDone`] when `count` events were sent (see [`crate::Client::watch`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Watch {
    /// Names or patterns.
    pub names: Vec<String>,
    /// Sampling interval in milliseconds (default 1000, at least 10).
    #[serde(default)]
    pub interval_ms: Option<u64>,
    /// Send only values that changed since the last event.
    #[serde(default)]
    pub changes: bool,
    /// Stop after this many events.
    #[serde(default)]
    pub count: Option<u64>,
}

/// `var_list`: the declared meters and knobs, optionally those matching a pattern. Result: a list of [`VarInfo`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VarList {
    /// Pattern (`module.*.frames_*`).
    #[serde(default)]
    pub pattern: Option<String>,
}

/// The result of `get`: each variable matched, by full name, sorted.
pub type Values = BTreeMap<String, VarValue>;

/// A variable's value in [`Values`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VarValue {
    /// The value, of the variable's type.
    #[serde(deserialize_with = "crate::value::read")]
    pub value: Value,
    /// Its unit (`frames`, `ns`, ... or empty).
    pub unit: String,
}

/// The result of `set`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SetResult {
    /// The stack revision the write became; absent for knobs outside the stack description (an application's, a
    /// flow's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<u64>,
    /// What the switch reported.
    pub notes: Vec<String>,
    /// The knob's value after the write.
    #[serde(deserialize_with = "crate::value::read")]
    pub value: Value,
}

/// One sample of a `watch` stream (the `event` of its response lines).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WatchEvent {
    /// Milliseconds since the stream started.
    pub t_ms: u64,
    /// Milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// The values, by full name (with `changes`, only those that changed; the first event has all).
    #[serde(deserialize_with = "crate::value::read_map")]
    pub values: BTreeMap<String, Value>,
}

/// The final result of a `watch` stream that stopped by itself (`count` reached).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchDone {
    /// Always true.
    pub done: bool,
}

/// A meter or knob of `var_list`: its declaration, named in full (`module.sel.select`), and its current value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VarInfo {
    /// Its declaration (`name`, `kind`, `type`, `unit`, `description`, `range`) with its full name.
    #[serde(flatten)]
    pub spec: VarSpec,
    /// Its current value.
    #[serde(deserialize_with = "crate::value::read")]
    pub value: Value,
}
