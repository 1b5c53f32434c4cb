//! Persistence (docs/persistence.md): every stack revision and every rules change is written to the journal
//! ([`crate::journal`]) before it is acknowledged, the journal is compacted when it grows past its limit, and
//! `daemon --restore` brings back the revision history, the stack (without the modules of sandboxed apps, whose
//! namespaces are gone) and the rules.
//!
//! Locks, always taken in this order: `rules_order` (one rules change at a time, with its record), the stack's
//! revisions, the journal. The journal's lock is never held while waiting for the rules thread, whose knob writes
//! are stack revisions and so take the revisions and the journal.

use crate::actions::control::{now_ms, Control};
use crate::actions::persist_state::Writer;
use crate::actions::revisions::{Revision, RevisionLog, RuleWrites};
use crate::journal::{
    self, Damage, Journal, Record, RulesChange, RulesOp, State, StoredPeer, StoredPeers, StoredRevision,
};
use crate::rules::RegistryEnv;
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_core::config::{LinkEntry, StackSpec};
use flexstack_core::Value;
use flexstack_rules::{Environment, Existence};
use std::path::Path;
use std::sync::{Mutex, MutexGuard};

/// What a restore brought back.
#[derive(Clone, Debug, Default)]
pub struct Restored {
    /// The latest stack revision restored (0: none).
    pub revision: u64,
    /// Stack revisions in the history.
    pub revisions: usize,
    /// Modules of sandboxed apps left out.
    pub apps_left_out: Vec<String>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn stored(rev: &Revision, app_modules: Vec<String>) -> StoredRevision {
    StoredRevision {
        number: rev.number,
        time_ms: rev.time_ms,
        user: rev.user.clone(),
        change: rev.change.clone(),
        notes: rev.notes.clone(),
        stack: rev.stack.clone(),
        app_modules,
        rule: rev.rule.as_ref().map(|w| journal::RuleWrites {
            rule: w.rule.clone(),
            writes: w.writes,
            first_ms: w.first_ms,
        }),
    }
}

/// A revision read from the journal, as the revision log holds it.
impl From<&StoredRevision> for Revision {
    fn from(r: &StoredRevision) -> Revision {
        Revision {
            number: r.number,
            time_ms: r.time_ms,
            user: r.user.clone(),
            change: r.change.clone(),
            notes: r.notes.clone(),
            stack: r.stack.clone(),
            rule: r.rule.as_ref().map(|w| RuleWrites { rule: w.rule.clone(), writes: w.writes, first_ms: w.first_ms }),
        }
    }
}

/// An environment that reads the registry but lets a replayed rules text name variables that do not exist now
/// (it was checked when it was first loaded, against the stack of then).
struct Replaying<'a>(&'a RegistryEnv);

impl Environment for Replaying<'_> {
    fn get(&self, name: &str) -> Option<Value> {
        self.0.get(name)
    }
    fn set(&mut self, name: &str, _value: Value) -> Result<(), String> {
        Err(format!("{name}: no writes while rules are replayed"))
    }
    fn names(&self, pattern: &str) -> Vec<String> {
        self.0.names(pattern)
    }
    fn exists(&self, name: &str) -> Existence {
        match self.0.exists(name) {
            Existence::No => Existence::Maybe,
            e => e,
        }
    }
}

/// `spec` without the modules named in `apps`, the links from and to them, and the taps that recorded only them.
fn without_apps(mut spec: StackSpec, apps: &[String]) -> StackSpec {
    let is_app = |m: &str| apps.iter().any(|a| a == m);
    let app_taps: Vec<String> = spec
        .modules
        .iter()
        .filter(|m| m.kind == "tap" && !is_app(&m.name))
        .filter(|m| {
            let mut from = spec.links.iter().filter(|l| l.link.to.iter().any(|t| t.module == m.name)).peekable();
            from.peek().is_some() && from.all(|l| is_app(&l.link.from.module))
        })
        .map(|m| m.name.clone())
        .collect();
    let gone = |m: &str| is_app(m) || app_taps.iter().any(|t| t == m);
    spec.modules.retain(|m| !gone(&m.name));
    spec.links = spec
        .links
        .into_iter()
        .filter(|l| !gone(&l.link.from.module))
        .filter_map(|mut l: LinkEntry| {
            l.link.to.retain(|t| !gone(&t.module));
            (!l.link.to.is_empty()).then_some(l)
        })
        .collect();
    spec
}

impl Control {
    /// Brings back the stack's revision history from `state`, and the stack of its latest revision, without the
    /// modules of sandboxed apps. `damage`, when the journal `source` was damaged, is recorded as a revision (as
    /// are left-out apps), so `config log` says what happened. Before [`Control::start_journal`].
    pub fn restore_stack(&self, state: &State, source: &Path, damage: Option<&Damage>) -> Result<Restored, String> {
        let _guard = self.edit_guard();
        let mut restored = Restored { revisions: state.revisions.len(), ..Restored::default() };
        if let Some(last) = state.revisions.last() {
            let name = format!("{} revision {}", source.display(), last.number);
            let spec = StackSpec::parse(&name, &last.stack).map_err(|e| e.to_string())?;
            let spec = without_apps(spec, &last.app_modules);
            let (edits, locations) = self.load_edits(&spec).map_err(|e| e.message)?;
            self.apply_edits(edits, &locations)
                .map_err(|e| format!("cannot restore revision {}: {}", last.number, e.message))?;
            restored.revision = last.number;
            restored.apps_left_out =
                last.app_modules.iter().filter(|m| spec.modules.iter().all(|s| &s.name != *m)).cloned().collect();
        }
        let mut revs = lock(&self.revisions);
        let mut writer = lock(&self.persist.writer);
        for r in &state.revisions {
            revs.restore(Revision::from(r));
            if !r.app_modules.is_empty() {
                writer.apps.insert(r.number, r.app_modules.clone());
            }
        }
        let mut what = Vec::new();
        if let Some(d) = damage {
            what.push(format!("the journal {} is damaged at {d}", source.display()));
        }
        if !restored.apps_left_out.is_empty() {
            what.push(format!("modules of sandboxed apps not restored: {}", restored.apps_left_out.join(", ")));
        }
        if !what.is_empty() {
            let snap = self.dp().snapshot().map_err(|e| e.to_string())?;
            let from = match restored.revision {
                0 => "nothing before the damage".to_string(),
                n => format!("revision {n}"),
            };
            let change = format!("daemon --restore from {from}: {}", what.join("; "));
            revs.push(now_ms(), "daemon", change, Vec::new(), snap.spec.to_toml());
        }
        Ok(restored)
    }

    /// Replays the rules changes of a journal on the rules thread, in order (the rules log comes back with its
    /// numbers); returns a warning for each change that did not replay as recorded.
    pub fn restore_rules(&self, changes: &[RulesChange]) -> Result<Vec<String>, String> {
        let svc = self.rules().map_err(|e| e.message)?;
        let list = changes.to_vec();
        let results = svc
            .call(move |s, now, env| {
                let env = Replaying(env);
                let mut results = Vec::new();
                for (i, c) in list.iter().enumerate() {
                    let r = match &c.op {
                        RulesOp::Load { source, text } => {
                            s.engine.handle_load_text(source, text, now, &env).map(|r| r.revision)
                        }
                        RulesOp::Unload { names } => {
                            let names: Vec<&str> = names.iter().map(String::as_str).collect();
                            s.engine.handle_unload(&names, now, &env)
                        }
                        RulesOp::Delete { names } => {
                            let names: Vec<&str> = names.iter().map(String::as_str).collect();
                            s.engine.handle_delete(&names, now, &env)
                        }
                        RulesOp::Replace { old, new } => s.engine.handle_replace(old, new, now, &env),
                        RulesOp::Rollback { revision } => s.engine.handle_rollback(*revision, now, &env),
                    };
                    if i + 1 < list.len() {
                        // Only the rules as they are now write knobs (the stack's knobs are restored already).
                        s.engine.poll_writes();
                    }
                    results.push(r.map_err(|e| e.to_string()));
                }
                results
            })
            .map_err(|e| e.message)?;
        let mut warnings = Vec::new();
        let mut writer = lock(&self.persist.writer);
        for (c, r) in changes.iter().zip(results) {
            match r {
                Ok(n) => {
                    if n != c.revision {
                        warnings.push(format!("rules change {:?} became revision {n}, not {}", c.op, c.revision));
                    }
                    writer.rules.push(RulesChange { revision: n, op: c.op.clone() });
                }
                Err(e) => warnings.push(format!("rules change {:?} (revision {}) failed: {e}", c.op, c.revision)),
            }
        }
        Ok(warnings)
    }

    /// Writes the journal at `path` afresh from the daemon's state (revisions and rules changes) and appends every
    /// change from now on; compacts it past `max_bytes`.
    pub fn start_journal(&self, path: &Path, max_bytes: u64) -> Result<(), String> {
        let revs = lock(&self.revisions);
        let mut writer = lock(&self.persist.writer);
        writer.max_bytes = max_bytes;
        let journal = self.compacted(&revs, &mut writer, path)?;
        tracing::info!(journal = %path.display(), bytes = journal.size(), "journal started");
        writer.journal = Some(journal);
        Ok(())
    }

    /// Rewrites the journal at `path` with the rules changes and as many of the latest revisions as fit in half
    /// the limit (at least the latest); sets the next limit.
    fn compacted(&self, revs: &RevisionLog, writer: &mut Writer, path: &Path) -> Result<Journal, String> {
        let budget = writer.max_bytes / 2;
        let head: Vec<Record> = writer
            .peers
            .iter()
            .cloned()
            .map(Record::Peers)
            .chain(writer.rules.iter().cloned().map(Record::Rules))
            .collect();
        let mut used: u64 = head.iter().map(|r| journal::encode(r).len() as u64).sum();
        let mut kept = Vec::new();
        for r in revs.iter().collect::<Vec<_>>().into_iter().rev() {
            let record = Record::Revision(stored(r, writer.apps.get(&r.number).cloned().unwrap_or_default()));
            let size = journal::encode(&record).len() as u64;
            if !kept.is_empty() && used + size > budget {
                break;
            }
            used += size;
            kept.push(record);
        }
        let oldest = kept.last().map_or(0, |r| match r {
            Record::Revision(r) => r.number,
            Record::Rules(_) | Record::Peers(_) => 0,
        });
        writer.apps.retain(|n, _| *n >= oldest);
        let records = head.into_iter().chain(kept.into_iter().rev());
        let journal = Journal::rewrite(path, records)?;
        writer.limit = writer.max_bytes.max(journal.size().saturating_mul(2));
        if journal.size() > writer.max_bytes {
            tracing::warn!(
                journal = %path.display(),
                bytes = journal.size(),
                max = writer.max_bytes,
                "the journal stays over its limit after compaction (its rules changes and latest revision alone are this large)"
            );
        }
        writer.stale = false;
        Ok(journal)
    }

    /// Compacts the journal if it grew past its limit or a record could not be written.
    fn compact_if_needed(&self) {
        let due = |w: &Writer| w.journal.as_ref().is_some_and(|j| w.stale || j.size() > w.limit);
        if !due(&lock(&self.persist.writer)) {
            return;
        }
        let revs = lock(&self.revisions);
        let mut writer = lock(&self.persist.writer);
        if !due(&writer) {
            return;
        }
        let path = writer.journal.as_ref().map(|j| j.path().to_path_buf()).expect("a journal");
        let before = writer.journal.as_ref().map_or(0, Journal::size);
        match self.compacted(&revs, &mut writer, &path) {
            Ok(j) => {
                tracing::info!(journal = %path.display(), before, after = j.size(), "journal compacted");
                writer.journal = Some(j);
            }
            Err(e) => {
                tracing::error!(journal = %path.display(), error = %e, "cannot compact the journal");
                writer.stale = true;
            }
        }
    }

    fn append(writer: &mut Writer, record: &Record, sync: bool) -> Result<(), String> {
        let Some(j) = writer.journal.as_mut() else { return Ok(()) };
        let result = j.append(record, sync);
        if let Err(e) = &result {
            tracing::error!(error = %e, "cannot write to the journal; it is rewritten at the next change");
            writer.stale = true;
        }
        result
    }

    /// Records revision `number` of `revs` (just pushed) in the journal, synced to disk with `sync` (not for the
    /// knob writes of rules: a rule may write at every sample; a killed daemon still leaves them in the kernel's
    /// cache, only a power loss not); called with the revisions locked.
    pub(super) fn journal_revision(&self, revs: &RevisionLog, number: u64, sync: bool) -> Result<(), ApiError> {
        let Ok(rev) = revs.get(number) else { return Ok(()) };
        let apps: Vec<String> = lock(&self.persist.app_modules).iter().cloned().collect();
        let mut writer = lock(&self.persist.writer);
        if !apps.is_empty() {
            writer.apps.insert(number, apps.clone());
        }
        Self::append(&mut writer, &Record::Revision(stored(rev, apps)), sync).map_err(|e| {
            let msg = format!("the change is revision {number}, but it could not be written to the journal: {e}");
            ApiError::new(ErrorCode::Internal, msg)
        })
    }

    /// Adds the peers of a journal's last peer table (before the stack is restored: its carriers look their peers
    /// up when they are loaded); returns a warning for each peer that could not be added.
    pub fn restore_peers(&self, table: &StoredPeers) -> Vec<String> {
        let mut warnings = Vec::new();
        for p in &table.peers {
            let add = flexstack_api::ops::PeerAdd {
                name: p.name.clone(),
                addr: p.addr.clone(),
                fingerprint: p.fingerprint.clone(),
            };
            if let Err(e) = self.add_peer(add) {
                warnings.push(format!("peer {:?} not restored: {}", p.name, e.message));
            }
        }
        lock(&self.persist.writer).peers = Some(table.clone());
        warnings
    }

    /// Records the peer table, as it is now, in the journal, synced (a `peer add` or `peer del` was just made).
    pub(super) fn journal_peers(&self) -> Result<(), ApiError> {
        let peers = flexstack_faces::peer::list()
            .into_iter()
            .map(|(p, _)| StoredPeer {
                name: p.name,
                addr: p.addr.to_string(),
                fingerprint: flexstack_faces::peer::fingerprint_hex(&p.fingerprint),
            })
            .collect();
        let table = StoredPeers { peers };
        let mut writer = lock(&self.persist.writer);
        let written = Self::append(&mut writer, &Record::Peers(table.clone()), true);
        writer.peers = Some(table);
        drop(writer);
        self.compact_if_needed();
        written.map_err(|e| {
            let msg = format!("the peer table changed, but it could not be written to the journal: {e}");
            ApiError::new(ErrorCode::Internal, msg)
        })
    }

    /// After a change: compacts the journal when due.
    pub(super) fn after_change(&self) {
        self.compact_if_needed();
    }

    /// Runs a rules change and records it in the journal before it is acknowledged. `run` returns its result and
    /// the rules revision it made.
    pub(super) fn rules_change<R>(
        &self,
        op: RulesOp,
        run: impl FnOnce() -> Result<(R, u64), ApiError>,
    ) -> Result<R, ApiError> {
        let _order = lock(&self.persist.rules_order);
        let (result, revision) = run()?;
        let change = RulesChange { revision, op };
        let mut writer = lock(&self.persist.writer);
        let written = Self::append(&mut writer, &Record::Rules(change.clone()), true);
        writer.rules.push(change);
        drop(writer);
        self.compact_if_needed();
        written.map_err(|e| {
            let msg = format!(
                "the rules changed (revision {revision}), but the change could not be written to the journal: {e}"
            );
            ApiError::new(ErrorCode::Internal, msg)
        })?;
        Ok(result)
    }

    /// The modules of an app are about to be loaded (`true`) or have been unloaded (`false`).
    pub(super) fn app_modules_changed(&self, names: impl IntoIterator<Item = String>, loaded: bool) {
        let mut apps = lock(&self.persist.app_modules);
        for n in names {
            if loaded {
                apps.insert(n);
            } else {
                apps.remove(&n);
            }
        }
    }
}

/// What a daemon finds in its state directory's journal at start.
pub enum Found {
    /// Start fresh (no `--restore`): the old journal, if it held anything, was set aside under this name.
    Fresh(Option<std::path::PathBuf>),
    /// `--restore`: the state read, and where the journal is damaged if it is.
    Restore(State, Option<Damage>),
}

/// Reads or sets aside the journal of state directory `dir` (see [`Found`]).
pub fn open_journal(dir: &Path, restore: bool) -> Result<Found, String> {
    let path = Journal::path_in(dir);
    let scan = journal::read(&path)?;
    if restore {
        return Ok(Found::Restore(State::from_records(scan.records), scan.damage));
    }
    if scan.records.is_empty() && scan.damage.is_none() {
        return Ok(Found::Fresh(None));
    }
    journal::set_aside(&path, "").map(|p| Found::Fresh(Some(p)))
}

#[cfg(test)]
mod tests {
    use super::without_apps;
    use flexstack_core::config::StackSpec;

    #[test]
    fn without_apps_drops_their_modules_links_and_the_taps_that_recorded_only_them() {
        let text = r#"links = ["a -> a-ip", "a-ip -> keep, a", "keep -> both", "a-ip -> only", "a -> both"]
[modules.a]
kind = "counter"
[modules.a-ip]
kind = "counter"
[modules.keep]
kind = "counter"
[modules.only]
kind = "tap"
path = "/dev/null"
[modules.both]
kind = "tap"
path = "/dev/null"
"#;
        let spec = StackSpec::parse("t.toml", text).unwrap();
        let apps = ["a".to_string(), "a-ip".to_string()];
        let left = without_apps(spec, &apps);
        let names: Vec<&str> = left.modules.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["keep", "both"], "`only` recorded app modules alone; `both` also `keep`");
        let links: Vec<String> = left.links.iter().map(|l| l.link.to_string()).collect();
        assert_eq!(links, ["keep -> both"]);
    }
}
