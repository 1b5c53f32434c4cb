//! The running stack as a whole: status, per-module run time, pause and resume.

use serde::{Deserialize, Serialize};

/// `status`: daemon facts. Result: [`DaemonStatus`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Status;

/// `show_runtime`: per module, calls, frames, frames per call and nanoseconds per frame. Result: a list of
/// [`RuntimeInfo`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShowRuntime;

/// `pause`: holds frames at a module, or stops the whole stack (frames are held, not dropped). Result:
/// [`Notes`](crate::ops::Notes).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pause {
    /// The module; absent for the whole stack.
    #[serde(default)]
    pub module: Option<String>,
}

/// `resume`: resumes a module or the whole stack. Result: [`Notes`](crate::ops::Notes).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resume {
    /// The module; absent for the whole stack.
    #[serde(default)]
    pub module: Option<String>,
}

/// The result of `status`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DaemonStatus {
    /// The daemon's version.
    pub version: String,
    /// Its process id.
    pub pid: u32,
    /// Seconds since it started.
    pub uptime_s: f64,
    /// The latest stack revision (0: none yet).
    pub revision: u64,
    /// Modules loaded.
    pub modules: usize,
    /// Resolved links (edges).
    pub links: usize,
    /// True while the whole stack is paused.
    pub paused: bool,
    /// How the data-plane thread runs: `normal`, `fifo N`, or `normal (real-time priority N was refused ...)`.
    pub dataplane_scheduling: String,
    /// The capabilities the daemon holds.
    pub capabilities: Capabilities,
    /// Where `--metrics` is served (`127.0.0.1:9464`), if it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<String>,
    /// Where `--web` is served, if it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub web: Option<String>,
}

/// Capability sets, by name (`CAP_NET_ADMIN`, ...).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    /// Effective set.
    pub effective: Vec<String>,
    /// Permitted set: what the daemon kept.
    pub permitted: Vec<String>,
    /// Bounding set: the most any program the daemon starts can hold.
    pub bounding: Vec<String>,
}

/// One module's row of `show_runtime`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RuntimeInfo {
    /// The module.
    pub module: String,
    /// Its kind.
    pub kind: String,
    /// Calls of the module (process and poll).
    pub calls: u64,
    /// Frames in (frames out for a module without inputs).
    pub frames: u64,
    /// Frames per call (0 without calls).
    pub frames_per_call: f64,
    /// Busy nanoseconds per frame (0 without frames).
    pub ns_per_frame: f64,
    /// Nanoseconds spent in the module.
    pub busy_ns: u64,
    /// Frames the module dropped (the switch's `frames_dropped_total`) and, for a face, packets the kernel dropped
    /// in its device's queues (`drop_kernel_queue_total`); for a worker, frames lost to full hand-over rings.
    #[serde(default)]
    pub drops: u64,
}
