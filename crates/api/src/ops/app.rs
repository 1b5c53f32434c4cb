//! Sandboxed apps (`flexstack run`) and the variables applications register on the app socket.

use flexstack_core::{Value, ValueType, VarKind};
use serde::{Deserialize, Serialize};

/// `app_attach`: attaches a sandboxed app: creates its namespace, devices and modules. The connection is the
/// app's lease: the app is detached when the client sends [`AppDetach`] on it or the connection closes. Result:
/// [`AppInfo`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppAttach {
    /// App name (default `appN`).
    #[serde(default)]
    pub name: Option<String>,
    /// User the app will run as (recorded).
    #[serde(default)]
    pub uid: u32,
    /// The app's stack template (default: stacks/app-default.toml).
    #[serde(default)]
    pub stack: Option<String>,
    /// The app's subnet, a /24 (`10.90.3.0/24`: the app gets 10.90.3.2 and fd77:5a:3::2); default: the first free
    /// /24 of the daemon's `--app-subnet`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subnet: Option<String>,
}

/// `app_detach`: ends the lease of the app attached on this connection. Result: [`Detached`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AppDetach;

/// `app_list`: the sandboxed apps. Result: a list of [`AppInfo`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AppList;

/// `app_var_list`: the applications' registered variables (`app.<name>.*`), with the registering process.
/// Result: a list of [`RegisteredApp`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AppVarList;

/// A sandboxed app: the result of `app_attach`, an entry of `app_list`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppInfo {
    /// Name (also the name of its face module).
    pub name: String,
    /// Its number (in its devices' names); the third octet of its subnet unless it asked for one.
    pub index: u8,
    /// The network namespace it runs in.
    pub netns: String,
    /// Its TUN device inside the namespace.
    pub app_dev: String,
    /// The host face's TUN device ("" when the app's chain has none).
    pub host_dev: String,
    /// Its IPv4 address.
    pub ipv4: String,
    /// Its IPv6 address.
    pub ipv6: String,
    /// The modules loaded for it.
    pub modules: Vec<String>,
    /// The daemon's nftables table ("" without a host face), for cleanup by `flexstack run` if the daemon dies.
    pub host_table: String,
    /// The user it runs as.
    pub uid: u32,
    /// Its processes (those of its cgroup, FreeNA's proclist); empty before it starts.
    #[serde(default)]
    pub pids: Vec<i32>,
    /// Its sandbox's cgroup (v2), "" without one.
    #[serde(default)]
    pub cgroup: String,
}

/// The result of `app_detach`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Detached {
    /// The app detached.
    pub detached: String,
}

/// An application and its variables, in `app_var_list`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RegisteredApp {
    /// The application's registered name (`app.<app>.*`).
    pub app: String,
    /// The registering process's user id.
    pub uid: u32,
    /// The registering process's id.
    pub pid: i32,
    /// Its variables.
    pub vars: Vec<AppVar>,
}

/// A variable an application registered.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AppVar {
    /// Its full name (`app.voip.loss`).
    pub name: String,
    /// Meter or knob.
    pub kind: VarKind,
    /// Its value type.
    #[serde(rename = "type")]
    pub ty: ValueType,
    /// Its current value.
    #[serde(deserialize_with = "crate::value::read")]
    pub value: Value,
}
