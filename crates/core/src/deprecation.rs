//! Old names that still work: a renamed module kind, setting or knob is reported the first time it is used, so that
//! its user learns the new name. Core does not log: the daemon sets the hook (see
//! [`Catalog::on_alias`](crate::Catalog::on_alias)) and logs a deprecation warning from it.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

/// Called the first time an old name is used, with (old name, new name).
pub type AliasHook = Box<dyn Fn(&str, &str) + Send + Sync>;

/// Reports each old name once to a hook; clones share what was reported and the hook. A catalog holds one and
/// hands it to the builders it configures ([`crate::ModuleBuilder::deprecations`]), so that a module reports a knob
/// written by its old name there too.
#[derive(Clone, Default)]
pub struct Deprecations(Arc<Inner>);

#[derive(Default)]
struct Inner {
    reported: Mutex<BTreeSet<String>>,
    hook: RwLock<Option<AliasHook>>,
}

impl Deprecations {
    /// Calls `hook` for each old name from now on (replacing any hook before it).
    pub fn set_hook(&self, hook: AliasHook) {
        *self.0.hook.write().unwrap_or_else(PoisonError::into_inner) = Some(hook);
    }

    /// Notes that `old`, the old name of `new`, was used: the hook hears of it the first time only.
    pub fn report(&self, old: &str, new: &str) {
        let first = self.0.reported.lock().unwrap_or_else(PoisonError::into_inner).insert(old.to_string());
        if first {
            if let Some(hook) = &*self.0.hook.read().unwrap_or_else(PoisonError::into_inner) {
                hook(old, new);
            }
        }
    }
}

impl std::fmt::Debug for Deprecations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let reported = self.0.reported.lock().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("Deprecations").field("reported", &*reported).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_old_name_is_reported_once_through_every_clone() {
        let heard = Arc::new(Mutex::new(Vec::new()));
        let d = Deprecations::default();
        d.report("before", "hook");
        let h = heard.clone();
        d.set_hook(Box::new(move |old, new| h.lock().unwrap().push(format!("{old} -> {new}"))));
        let clone = d.clone();
        for _ in 0..3 {
            d.report("a.rate_bps", "a.rate_mbit");
            clone.report("a.rate_bps", "a.rate_mbit");
        }
        clone.report("b.rate_bps", "b.rate_mbit");
        d.report("before", "hook");
        assert_eq!(*heard.lock().unwrap(), ["a.rate_bps -> a.rate_mbit", "b.rate_bps -> b.rate_mbit"]);
        assert!(format!("{d:?}").contains("a.rate_bps"));
    }
}
