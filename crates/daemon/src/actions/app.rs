//! Sandboxed apps and applications' variables: `app list`, `app vars`, and the modules the sandboxes load.

use crate::actions::control::{internal, Control};
use crate::sandbox::AppModules;
use flexstack_api::ops::{AppInfo, RegisteredApp};
use flexstack_api::protocol::ApiError;
use flexstack_core::config::StackSpec;
use flexstack_core::Edit;

impl Control {
    pub(super) fn app_list(&self) -> Result<Vec<AppInfo>, ApiError> {
        Ok(self.apps_with_processes())
    }

    pub(super) fn app_var_list(&self) -> Result<Vec<RegisteredApp>, ApiError> {
        Ok(self.appvars.list())
    }
}

/// The sandboxes load and unload their apps' modules through the control plane, as revisions.
impl AppModules for Control {
    fn load_modules(&self, spec: &StackSpec, who: &str, change: &str) -> Result<(), ApiError> {
        // Recorded as an app's before the revision is written, so that a restore leaves them out.
        let names = || spec.modules.iter().map(|m| m.name.clone());
        self.app_modules_changed(names(), true);
        let loaded = self.load_stack(spec, who, change).map(drop);
        if loaded.is_err() {
            self.app_modules_changed(names(), false);
        }
        loaded
    }

    fn unload_modules(&self, names: &[String], change: &str) -> Result<(), ApiError> {
        let snap = self.dp().snapshot().map_err(internal)?;
        // Services added while the app ran (`service add`) go with it too.
        let added = self.services_added(names, &snap);
        let names: &Vec<String> = &names.iter().cloned().chain(added).collect();
        let loaded: Vec<&String> = snap.modules.iter().map(|m| &m.name).collect();
        // Taps that record only these modules' ports (`tap add` on an app's chain) go with them.
        let taps = snap.modules.iter().filter(|m| m.kind == "tap" && !names.contains(&m.name)).filter(|m| {
            let mut inputs = snap.edges.iter().filter(|e| e.to == m.name).peekable();
            inputs.peek().is_some() && inputs.all(|e| names.contains(&e.from))
        });
        let edits: Vec<Edit> = names
            .iter()
            .filter(|n| loaded.contains(n))
            .chain(taps.map(|m| &m.name))
            .map(|n| Edit::Unload { name: n.clone() })
            .collect();
        self.app_modules_changed(names.iter().cloned(), false);
        if edits.is_empty() {
            return Ok(());
        }
        self.edit("daemon", change.to_string(), edits).map(drop)
    }
}
