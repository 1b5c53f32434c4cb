//! Taps: pcapng captures of a port (add, del, list).

use serde::{Deserialize, Serialize};

/// `tap_add`: records the frames leaving a port to a pcapng file, with a tap loaded as one more receiver of the
/// port. Result: [`TapAdded`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TapAdd {
    /// The link (`"a -> b"`) or port (`"a[port]"`): frames leaving the sender's port are recorded.
    pub link: String,
    /// The pcapng file (absolute path).
    pub file: String,
}

/// `tap_del`: removes a tap added with `tap_add`. Result: [`Change`](crate::ops::Change).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TapDel {
    /// The tap's module name.
    pub name: String,
}

/// `tap_list`: the taps. Result: a list of [`TapInfo`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TapList;

/// The result of `tap_add`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TapAdded {
    /// The stack revision it became.
    pub revision: u64,
    /// What the switch reported.
    pub notes: Vec<String>,
    /// The tap's module name (`tapN`).
    pub tap: String,
    /// The capture's link type: `ethernet` or `raw` (IP).
    pub linktype: String,
    /// The file it writes: the one asked for, or a suffix file next to it when that one held a capture.
    #[serde(default)]
    pub file: String,
}

/// A tap of `tap_list`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TapInfo {
    /// The tap's module name.
    pub name: String,
    /// The file it writes: its `path` setting, or the suffix file it chose because that one held a capture.
    pub file: Option<String>,
    /// The capture's link type (its `linktype` setting).
    pub linktype: Option<String>,
    /// The ports it records (`a[out]`).
    pub taps: Vec<String>,
    /// Frames whose block reached the file whole.
    pub frames: u64,
    /// Frames encoded and waiting for the tap's next write (at most 50 ms); not in the file yet.
    #[serde(default)]
    pub frames_pending: u64,
    /// Frames lost to failed writes (a full disk).
    #[serde(default)]
    pub frames_unwritten: u64,
    /// The first write error, with the path and errno; `None` if every write succeeded.
    #[serde(default)]
    pub error: Option<String>,
}
