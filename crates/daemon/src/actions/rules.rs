//! Rules: the `rules_*` requests, answered by the rules thread ([`crate::rules`]).

use crate::actions::control::Control;
use flexstack_api::ops::{RulesLoaded, RulesRevision};
use flexstack_api::protocol::ApiError;

impl Control {
    /// `rules load`: checks and loads the text `text` read from `name`.
    pub(super) fn rules_load(&self, name: String, text: String, who: &str) -> Result<RulesLoaded, ApiError> {
        let r = self.rules()?.load(name.clone(), text)?;
        tracing::info!(user = who, file = %name, revision = r.revision, "rules loaded");
        Ok(r)
    }

    /// `rules delete NAME...|ALL`: definitions removed (unloaded first).
    pub(super) fn rules_delete(&self, names: Vec<String>, who: &str) -> Result<RulesRevision, ApiError> {
        let r = self.rules()?.delete(names.clone())?;
        tracing::info!(user = who, rules = %names.join(","), revision = r.revision, "rules deleted");
        Ok(r)
    }
}
