//! The running stack as a whole: status, per-module run time (`show runtime`), pause and resume.

use crate::actions::control::{internal, Control};
use flexstack_api::ops::{DaemonStatus, Notes, RuntimeInfo};
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_core::Edit;

impl Control {
    /// The daemon's facts; its capabilities are read on the calling thread (every thread of the daemon holds the
    /// same ones).
    pub(super) fn status(&self) -> Result<DaemonStatus, ApiError> {
        let dp = self.dp();
        let snap = dp.snapshot().map_err(internal)?;
        let scheduling = match dp.worker_count() {
            1 => dp.scheduling().to_string(),
            _ => format!("{}, workers {}", dp.scheduling(), dp.workers()),
        };
        drop(dp);
        let revision = self.revisions.lock().unwrap_or_else(|p| p.into_inner()).latest();
        let capabilities = crate::privileges::current().map_err(|e| ApiError::new(ErrorCode::Internal, e))?;
        let served = self.served.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let at = |what: &str| served.iter().find(|(w, _)| *w == what).map(|(_, a)| a.to_string());
        Ok(DaemonStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            pid: std::process::id(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            revision,
            modules: snap.modules.len(),
            links: snap.edges.len(),
            paused: snap.paused,
            dataplane_scheduling: scheduling,
            capabilities,
            metrics: at("metrics"),
            web: at("web"),
        })
    }

    /// A row per module and, with several data-plane workers, one per worker (`worker.<k>`, kind `worker`: its
    /// loop's rounds, the frames it ran and its busy time).
    pub(super) fn show_runtime(&self) -> Result<Vec<RuntimeInfo>, ApiError> {
        let workers = self.dp().worker_count();
        let mut rows = self.module_rows(|m, v| {
            let calls = v("calls_total");
            let frames = if m.inputs.is_empty() { v("frames_out_total") } else { v("frames_in_total") };
            let ns = v("busy_ns_total");
            let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
            RuntimeInfo {
                frames_per_call: ratio(frames, calls),
                ns_per_frame: ratio(ns, frames),
                module: m.name,
                kind: m.kind,
                calls,
                frames,
                busy_ns: ns,
                drops: v("frames_dropped_total") + v("drop_kernel_queue_total"),
            }
        })?;
        if workers > 1 {
            let reg = self.registry.snapshot_for("worker.");
            for k in 0..workers {
                let v = |var: &str| reg.get(&format!("worker.{k}.{var}")).map_or(0, |c| c.load_u64());
                let (calls, frames, ns) = (v("rounds_total"), v("frames_total"), v("busy_ns_total"));
                let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
                rows.push(RuntimeInfo {
                    module: format!("worker.{k}"),
                    kind: "worker".into(),
                    calls,
                    frames,
                    frames_per_call: ratio(frames, calls),
                    ns_per_frame: ratio(ns, frames),
                    busy_ns: ns,
                    drops: v("drop_handoff_total"),
                });
            }
        }
        Ok(rows)
    }

    /// Holds frames at `module` (the whole stack when `None`): a runtime state, not a revision.
    pub(super) fn pause(&self, module: Option<String>) -> Result<Notes, ApiError> {
        self.runtime_edit(vec![Edit::Pause { module }])
    }

    /// Resumes `module` (the whole stack when `None`).
    pub(super) fn resume(&self, module: Option<String>) -> Result<Notes, ApiError> {
        self.runtime_edit(vec![Edit::Resume { module }])
    }
}
