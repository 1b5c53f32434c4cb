//! The running stack as a whole: status, per-module run time (`show runtime`), pause and resume.

use crate::actions::control::{internal, u64_var, Control};
use flexstack_api::protocol::ApiError;
use flexstack_core::Edit;
use serde_json::{json, Value as Json};

impl Control {
    pub(super) fn status(&self) -> Result<Json, ApiError> {
        let dp = self.dp();
        let snap = dp.snapshot().map_err(internal)?;
        let scheduling = dp.scheduling().to_string();
        drop(dp);
        let revision = self.revisions.lock().unwrap_or_else(|p| p.into_inner()).latest();
        Ok(json!({
            "version": env!("CARGO_PKG_VERSION"),
            "pid": std::process::id(),
            "uptime_s": self.started.elapsed().as_secs_f64(),
            "revision": revision,
            "modules": snap.modules.len(),
            "links": snap.edges.len(),
            "paused": snap.paused,
            "dataplane_scheduling": scheduling,
        }))
    }

    pub(super) fn show_runtime(&self) -> Result<Json, ApiError> {
        let snap = self.dp().snapshot().map_err(internal)?;
        let reg = self.registry.snapshot();
        let rows: Vec<Json> = snap
            .modules
            .iter()
            .map(|m| {
                let v = |var: &str| u64_var(&reg, &format!("module.{}.{var}", m.name));
                let calls = v("calls_total");
                let frames = if m.inputs.is_empty() { v("frames_out_total") } else { v("frames_in_total") };
                let ns = v("busy_ns_total");
                let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
                json!({"module": m.name, "kind": m.kind, "calls": calls, "frames": frames,
                       "frames_per_call": ratio(frames, calls), "ns_per_frame": ratio(ns, frames), "busy_ns": ns})
            })
            .collect();
        Ok(Json::Array(rows))
    }

    /// Holds frames at `module` (the whole stack when `None`): a runtime state, not a revision.
    pub(super) fn pause(&self, module: Option<String>) -> Result<Json, ApiError> {
        self.runtime_edit(vec![Edit::Pause { module }])
    }

    /// Resumes `module` (the whole stack when `None`).
    pub(super) fn resume(&self, module: Option<String>) -> Result<Json, ApiError> {
        self.runtime_edit(vec![Edit::Resume { module }])
    }
}
