//! The control plane's persistence state (the journal, the rules changes, the apps' modules), used by
//! [`crate::actions::persist`]; apart so that `control` holds it without importing the code that uses `Control`.

use crate::journal::{Journal, RulesChange, StoredPeers};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

/// The control plane's persistence state.
#[derive(Default)]
pub(super) struct Persist {
    /// One rules change at a time, from the request to its record.
    pub(super) rules_order: Mutex<()>,
    /// The journal and what compaction writes.
    pub(super) writer: Mutex<Writer>,
    /// The modules of sandboxed apps now.
    pub(super) app_modules: Mutex<BTreeSet<String>>,
}

/// The open journal and the state its compaction writes.
#[derive(Default)]
pub(super) struct Writer {
    /// None until [`crate::actions::Control::start_journal`].
    pub(super) journal: Option<Journal>,
    /// Compact past this size (`--journal-max-bytes`).
    pub(super) max_bytes: u64,
    /// Compact past this size now: `max_bytes`, or twice what the last compaction could not shrink below.
    pub(super) limit: u64,
    /// A record could not be written: rewrite the journal at the next change.
    pub(super) stale: bool,
    /// Every rules change, in order (they are replayed at a restore, so compaction keeps them all).
    pub(super) rules: Vec<RulesChange>,
    /// The app modules of revisions that had some (by number).
    pub(super) apps: BTreeMap<u64, Vec<String>>,
    /// The peer table since it was first changed or restored (compaction writes it first).
    pub(super) peers: Option<StoredPeers>,
}
