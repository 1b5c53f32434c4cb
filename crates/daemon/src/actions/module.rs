//! Modules: list, kinds, load, unload, replace, and running a module's procedure (`module exec`).

use crate::actions::control::{internal, u64_var, Control};
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_core::config::Settings;
use flexstack_core::switch::CONTROL_PLANE;
use flexstack_core::{ControlFrame, ControlOp, Edit, Value};
use serde_json::{json, Value as Json};
use std::sync::atomic::Ordering;

/// Converts JSON settings of an API request into module settings.
fn settings_from_json(map: &serde_json::Map<String, Json>) -> Result<Settings, ApiError> {
    let mut s = Settings::default();
    for (k, v) in map {
        let tv = toml::Value::try_from(v).map_err(|e| {
            ApiError::new(ErrorCode::ConfigError, format!("setting `{k}`: not representable in TOML: {e}"))
        })?;
        s.insert(k, tv);
    }
    Ok(s)
}

impl Control {
    pub(super) fn module_list(&self) -> Result<Json, ApiError> {
        let snap = self.dp().snapshot().map_err(internal)?;
        let reg = self.registry.snapshot();
        let rows = snap
            .modules
            .iter()
            .map(|m| {
                let v = |var: &str| u64_var(&reg, &format!("module.{}.{var}", m.name));
                let mut ports = Vec::new();
                for (p, ty) in &m.inputs {
                    ports.push(
                        json!({"port": p, "dir": "in", "type": ty, "frames": v(&format!("port.{p}.frames_in_total"))}),
                    );
                }
                for (p, ty) in &m.outputs {
                    ports.push(json!({"port": p, "dir": "out", "type": ty,
                        "frames": v(&format!("port.{p}.frames_out_total")),
                        "dropped": v(&format!("port.{p}.frames_dropped_total"))}));
                }
                json!({
                    "name": m.name, "kind": m.kind, "state": m.state,
                    "frames_in": v("frames_in_total"), "frames_out": v("frames_out_total"),
                    "frames_dropped": v("frames_dropped_total"), "held": v("held_frames"), "ports": ports,
                })
            })
            .collect();
        Ok(Json::Array(rows))
    }

    pub(super) fn module_kinds(&self) -> Result<Json, ApiError> {
        Ok(Json::Array(self.catalog.kinds().map(|k| json!({ "kind": k.name(), "summary": k.summary() })).collect()))
    }

    pub(super) fn module_load(
        &self,
        name: String,
        kind: String,
        settings: &serde_json::Map<String, Json>,
        who: &str,
    ) -> Result<Json, ApiError> {
        let settings = settings_from_json(settings)?;
        let builder = self.configure(&kind, &settings)?;
        self.edit_one(who, Edit::Load { name, kind, settings, builder })
    }

    pub(super) fn module_unload(&self, name: String, who: &str) -> Result<Json, ApiError> {
        self.edit_one(who, Edit::Unload { name })
    }

    pub(super) fn module_replace(
        &self,
        name: String,
        kind: String,
        settings: &serde_json::Map<String, Json>,
        fresh: bool,
        who: &str,
    ) -> Result<Json, ApiError> {
        let settings = settings_from_json(settings)?;
        let builder = self.configure(&kind, &settings)?;
        self.edit_one(who, Edit::Replace { name, kind, settings, builder, keep_state: !fresh })
    }

    /// Sends an `Exec` control frame to module `name` and returns the value of its `ExecReply`.
    pub(super) fn exec(&self, name: &str, procedure: &str, argument: Option<Json>) -> Result<Json, ApiError> {
        let value = match argument {
            None | Some(Json::Null) => Value::Bool(false),
            Some(Json::String(s)) => Value::Str(s),
            Some(other) => serde_json::from_value::<Value>(other)
                .map_err(|e| ApiError::new(ErrorCode::InvalidValue, format!("argument: {e}")))?,
        };
        let serial = self.next_serial.fetch_add(1, Ordering::Relaxed);
        let frame = ControlFrame {
            op: ControlOp::Exec,
            sender: CONTROL_PLANE.to_string(),
            dest: name.to_string(),
            serial,
            param: procedure.to_string(),
            value,
        };
        let reply = self.dp().control(frame).map_err(internal)?;
        match reply {
            Some(r) if r.op == ControlOp::ExecReply => {
                Ok(json!({ "module": name, "procedure": procedure, "result": r.value }))
            }
            Some(r) if r.op == ControlOp::Error => {
                let code = if self.registry.snapshot().matching(&format!("module.{name}.*")).next().is_none() {
                    ErrorCode::NotFound
                } else {
                    ErrorCode::InvalidValue
                };
                Err(ApiError::new(code, format!("{name}: {}", r.value)))
            }
            Some(r) => Err(internal(format!("unexpected reply {:?} from {name}", r.op))),
            None => Err(internal(format!("no reply from {name}"))),
        }
    }
}
