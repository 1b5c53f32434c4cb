//! Rules: the `rules_*` requests, answered by the rules thread ([`crate::rules`]).

use crate::actions::control::Control;
use flexstack_api::ops::RulesLoaded;
use flexstack_api::protocol::ApiError;

impl Control {
    /// `rules load`: checks and loads the text `text` read from `name`.
    pub(super) fn rules_load(&self, name: String, text: String, who: &str) -> Result<RulesLoaded, ApiError> {
        let r = self.rules()?.load(name.clone(), text)?;
        tracing::info!(user = who, file = %name, revision = r.revision, "rules loaded");
        Ok(r)
    }
}
