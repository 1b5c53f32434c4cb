//! Rules: the `rules_*` requests, answered by the rules thread ([`crate::rules`]). The changes (load, unload,
//! delete, replace, rollback) are written to the journal before they are acknowledged ([`crate::actions::persist`]).

use crate::actions::control::Control;
use crate::journal::RulesOp;
use flexstack_api::ops::{RulesLoaded, RulesRevision};
use flexstack_api::protocol::ApiError;

impl Control {
    /// `rules load`: checks and loads the text `text` read from `name`.
    pub(super) fn rules_load(&self, name: String, text: String, who: &str) -> Result<RulesLoaded, ApiError> {
        let op = RulesOp::Load { source: name.clone(), text: text.clone() };
        let r = self.rules_change(op, || self.rules()?.load(name.clone(), text).map(|r| (r.clone(), r.revision)))?;
        tracing::info!(user = who, file = %name, revision = r.revision, "rules loaded");
        Ok(r)
    }

    /// `rules unload`, `rules delete`, `rules replace`, `rules rollback`: a change that makes a rules revision.
    pub(super) fn rules_revision(&self, op: RulesOp) -> Result<RulesRevision, ApiError> {
        let svc = self.rules()?;
        let run = || {
            let r = match op.clone() {
                RulesOp::Unload { names } => svc.unload(names),
                RulesOp::Delete { names } => svc.delete(names),
                RulesOp::Replace { old, new } => svc.replace(old, new),
                RulesOp::Rollback { revision } => svc.rollback(revision),
                RulesOp::Load { source, text } => {
                    svc.load(source, text).map(|r| RulesRevision { revision: r.revision })
                }
            }?;
            Ok((r, r.revision))
        };
        self.rules_change(op.clone(), run)
    }

    /// `rules delete NAME...|ALL`: definitions removed (unloaded first).
    pub(super) fn rules_delete(&self, names: Vec<String>, who: &str) -> Result<RulesRevision, ApiError> {
        let r = self.rules_revision(RulesOp::Delete { names: names.clone() })?;
        tracing::info!(user = who, rules = %names.join(","), revision = r.revision, "rules deleted");
        Ok(r)
    }
}
