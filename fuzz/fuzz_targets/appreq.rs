//! libFuzzer target `appreq`: [`flexstack_fuzz::appvars::check_session`] (the app-variable protocol: a session of
//! lines an application sends, into the daemon's connection handler).
#![no_main]

use flexstack_core::SharedRegistry;
use flexstack_daemon::appvars::AppVars;
use std::sync::{Arc, OnceLock};

/// One registry and handler for the whole run, as in a daemon: each session must leave them clean.
fn state() -> &'static (SharedRegistry, Arc<AppVars>) {
    static STATE: OnceLock<(SharedRegistry, Arc<AppVars>)> = OnceLock::new();
    STATE.get_or_init(|| {
        let registry = SharedRegistry::default();
        let vars = Arc::new(AppVars::new(registry.clone()));
        (registry, vars)
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let (registry, vars) = state();
    flexstack_fuzz::require(flexstack_fuzz::appvars::check_session(vars, registry, data));
});
