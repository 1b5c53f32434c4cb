//! Modules: list, kinds, load, unload, replace, and running a module's procedure.

use flexstack_core::Value;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

/// `module_list`: the loaded modules with kind, state and per-port counters. Result: a list of [`ModuleInfo`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModuleList;

/// `module_kinds`: the module kinds the daemon can load. Result: a list of [`KindInfo`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModuleKinds;

/// `module_load`: loads a module. Result: [`Change`](crate::ops::Change).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModuleLoad {
    /// Unique name.
    pub name: String,
    /// Kind.
    pub kind: String,
    /// Settings (`{"rate": 5}`).
    #[serde(default)]
    pub settings: Map<String, Json>,
}

/// `module_unload`: unloads a module and its links. Result: [`Change`](crate::ops::Change).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModuleUnload {
    /// The module.
    pub name: String,
}

/// `module_replace`: replaces a module by a new one of the given kind and settings, keeping its links (and its
/// state unless `fresh`). Result: [`Change`](crate::ops::Change).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModuleReplace {
    /// The module.
    pub name: String,
    /// Kind of the new module.
    pub kind: String,
    /// Settings of the new module.
    #[serde(default)]
    pub settings: Map<String, Json>,
    /// Start the new module with fresh state instead of the old one's.
    #[serde(default)]
    pub fresh: bool,
}

/// `module_exec`: runs a module's procedure through an `Exec` control frame sent by the control plane. Result:
/// [`ExecResult`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModuleExec {
    /// The module.
    pub name: String,
    /// The procedure.
    pub procedure: String,
    /// Its argument, any JSON (default null = false).
    #[serde(default)]
    pub argument: Option<Json>,
}

/// One module of `module_list`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleInfo {
    /// Its name.
    pub name: String,
    /// Its kind.
    pub kind: String,
    /// `running` or `paused`.
    pub state: String,
    /// Frames received.
    pub frames_in: u64,
    /// Frames sent.
    pub frames_out: u64,
    /// Frames dropped.
    pub frames_dropped: u64,
    /// Frames held at its inputs while it is paused.
    pub held: u64,
    /// Its ports: inputs, then outputs (the implicit `ctl` last).
    pub ports: Vec<PortInfo>,
}

/// One port of a module.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortInfo {
    /// The port's name.
    pub port: String,
    /// Input or output.
    pub dir: PortDir,
    /// The frame type it carries (`any`, `ip`, `ethernet`, `control`).
    #[serde(rename = "type")]
    pub ty: String,
    /// Frames through it.
    pub frames: u64,
    /// Frames dropped on it (an output without receivers); outputs only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropped: Option<u64>,
}

/// The direction of a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PortDir {
    /// An input port.
    In,
    /// An output port.
    Out,
}

impl PortDir {
    /// `in` or `out`, as on the wire.
    pub fn name(self) -> &'static str {
        match self {
            PortDir::In => "in",
            PortDir::Out => "out",
        }
    }
}

/// A module kind of `module_kinds`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KindInfo {
    /// The kind's name.
    pub kind: String,
    /// One line: what it does.
    pub summary: String,
}

/// The result of `module_exec`: the value of the module's `ExecReply`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExecResult {
    /// The module.
    pub module: String,
    /// The procedure.
    pub procedure: String,
    /// What it returned.
    #[serde(deserialize_with = "crate::value::read")]
    pub result: Value,
}
