//! Revisions of the stack: log, show, rollback.

use crate::actions::control::{config_error, internal, Control};
use crate::actions::revisions::Revision;
use flexstack_api::ops::{Change, RevisionInfo, RevisionStack, RuleWrites};
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_core::config::{Settings, StackSpec};
use flexstack_core::vars::VarKind;
use flexstack_core::{Edit, Value};

impl Control {
    pub(super) fn config_log(&self) -> Result<Vec<RevisionInfo>, ApiError> {
        let revs = self.revisions.lock().unwrap_or_else(|p| p.into_inner());
        let log = revs.iter().map(|r| RevisionInfo {
            revision: r.number,
            time_ms: r.time_ms,
            user: r.user.clone(),
            change: r.change.clone(),
            notes: r.notes.clone(),
            rule: r.rule.as_ref().map(|w| RuleWrites { rule: w.rule.clone(), writes: w.writes, first_ms: w.first_ms }),
        });
        Ok(log.collect())
    }

    /// Revision `rev`'s stack description; the running stack's when `None`.
    pub(super) fn config_show(&self, rev: Option<u64>) -> Result<RevisionStack, ApiError> {
        match rev {
            Some(n) => {
                let r = self.revision(n)?;
                Ok(RevisionStack { revision: r.number, stack: r.stack })
            }
            None => {
                let snap = self.dp().snapshot().map_err(internal)?;
                let current = self.revisions.lock().unwrap_or_else(|p| p.into_inner()).latest();
                Ok(RevisionStack { revision: current, stack: snap.spec.to_toml() })
            }
        }
    }

    fn revision(&self, n: u64) -> Result<Revision, ApiError> {
        let revs = self.revisions.lock().unwrap_or_else(|p| p.into_inner());
        revs.get(n).cloned().map_err(|e| ApiError::new(ErrorCode::NotFound, e))
    }

    /// Returns the stack to revision `rev`: modules missing are loaded, extra ones unloaded, changed ones
    /// replaced (state kept where the kind is the same), knobs set, links relinked — all in one atomic edit.
    pub(super) fn config_rollback(&self, rev: u64, who: &str) -> Result<Change, ApiError> {
        let target_rev = self.revision(rev)?;
        let target = StackSpec::parse(&format!("revision {rev}"), &target_rev.stack).map_err(config_error)?;
        let current = self.dp().snapshot().map_err(internal)?.spec;
        let reg = self.registry.snapshot_for("module.");
        let knobs_of = |module: &str| -> Vec<String> {
            reg.matching(&format!("module.{module}.**"))
                .filter(|(_, c)| c.spec().kind == VarKind::Knob)
                .map(|(_, c)| c.spec().name.clone())
                .collect()
        };
        let mut edits: Vec<Edit> = current.links.iter().map(|l| Edit::Unlink(l.link.clone())).collect();
        for m in &current.modules {
            if !target.modules.iter().any(|t| t.name == m.name) {
                edits.push(Edit::Unload { name: m.name.clone() });
            }
        }
        for t in &target.modules {
            match current.modules.iter().find(|m| m.name == t.name) {
                None => {
                    let builder = self.configure(&t.kind, &t.settings)?;
                    edits.push(Edit::Load {
                        name: t.name.clone(),
                        kind: self.kind_name(&t.kind),
                        settings: t.settings.clone(),
                        builder,
                    });
                }
                Some(m) => {
                    let knobs = knobs_of(&m.name);
                    let strip = |s: &Settings| {
                        let mut out = Settings::default();
                        for (k, v) in s.iter().filter(|(k, _)| !knobs.iter().any(|n| n == k)) {
                            out.insert(k, v.value.clone());
                        }
                        out
                    };
                    if m.kind == t.kind && strip(&m.settings).same_values(&strip(&t.settings)) {
                        for k in &knobs {
                            if let Some(want) = t.settings.get(k) {
                                if m.settings.get(k).map(|s| &s.value) != Some(&want.value) {
                                    if let Some(value) = Value::from_toml(&want.value) {
                                        edits.push(Edit::SetKnob { module: m.name.clone(), knob: k.clone(), value });
                                    }
                                }
                            }
                        }
                    } else {
                        let builder = self.configure(&t.kind, &t.settings)?;
                        edits.push(Edit::Replace {
                            name: t.name.clone(),
                            kind: self.kind_name(&t.kind),
                            settings: t.settings.clone(),
                            builder,
                            keep_state: m.kind == t.kind,
                        });
                    }
                }
            }
        }
        edits.extend(target.links.iter().map(|l| Edit::Link(l.link.clone())));
        self.edit(who, format!("config rollback {rev}"), edits)
    }
}
