//! An app's stream services while it runs (docs/services.md): `service list|show|add|del`, and FreeNA's client
//! commands on its processes: `app stop|continue|kill`.

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use std::collections::BTreeMap;

/// `service_list`: the services of app `app`, in their order (Down frames go through them first to last). Result: a
/// list of [`ServiceInfo`]. An unknown app fails with `not_found`, naming the apps there are.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceList {
    /// The app.
    pub app: String,
}

/// `service_show`: one service of an app with all its variables. Result: [`ServiceDetail`]. An unknown service
/// fails with `not_found`, naming the app's services.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceShow {
    /// The app.
    pub app: String,
    /// The service's name (its module is `{app}-NAME`).
    pub name: String,
}

/// `service_add`: adds a service to a running app's chain, nearest the network (after the others), as one edit.
/// Flows opened before it pass it unchanged; flows opened after go through it as its `select` says. Result:
/// [`Change`](crate::ops::Change).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceAdd {
    /// The app.
    pub app: String,
    /// The service's kind (`null`, `compress` ...).
    pub kind: String,
    /// Its name (default: the kind); the module is `{app}-NAME`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Its settings, as for `module_load`.
    #[serde(default)]
    pub settings: serde_json::Map<String, Json>,
}

/// `service_del`: removes a service from a running app's chain, as one edit. Refused while it works on flows (they
/// would lose the state it keeps for them) unless `force`. Result: [`Change`](crate::ops::Change).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceDel {
    /// The app.
    pub app: String,
    /// The service's name.
    pub name: String,
    /// Remove it even while it works on flows.
    #[serde(default)]
    pub force: bool,
}

/// A service of an app, in `service_list`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceInfo {
    /// The service's name in the app.
    pub name: String,
    /// Its module (`{app}-NAME`).
    pub module: String,
    /// Its kind.
    pub kind: String,
    /// The value of its `active` knob (`None`: the kind has none, it is always in the path).
    pub active: Option<bool>,
    /// Flows it works on now (`selected_flows_active`).
    pub flows: u64,
    /// Its selection rules (`select`).
    pub select: Vec<String>,
}

/// The result of `service_show`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServiceDetail {
    /// The service.
    pub service: ServiceInfo,
    /// Every variable of its module (`module.{app}-NAME.*`): value and unit.
    pub vars: BTreeMap<String, crate::ops::VarValue>,
}

/// `app_signal`: sends a signal to every process of a sandboxed app (the processes of its cgroup): `stop`
/// (SIGSTOP), `continue` (SIGCONT) or `kill` (SIGKILL). Result: [`Signalled`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppSignal {
    /// The app.
    pub name: String,
    /// `stop`, `continue` or `kill`.
    pub signal: String,
}

/// The result of `app_signal`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Signalled {
    /// The app.
    pub app: String,
    /// The signal sent (`SIGSTOP` ...).
    pub signal: String,
    /// The processes it was sent to.
    pub pids: Vec<i32>,
}
