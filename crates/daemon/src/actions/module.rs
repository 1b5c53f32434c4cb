//! Modules: list, kinds, load, unload, replace, and running a module's procedure (`module exec`).

use crate::actions::control::{internal, Control};
use flexstack_api::ops::{
    Change, ExecResult, KindInfo, ModuleExec, ModuleInfo, ModuleLoad, ModuleReplace, PortDir, PortInfo,
};
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_core::config::Settings;
use flexstack_core::switch::CONTROL_PLANE;
use flexstack_core::{ControlFrame, ControlOp, Edit, Value};
use serde_json::Value as Json;
use std::sync::atomic::Ordering;

/// Converts JSON settings of an API request into module settings.
pub(super) fn settings_from_json(map: &serde_json::Map<String, Json>) -> Result<Settings, ApiError> {
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
    pub(super) fn module_list(&self) -> Result<Vec<ModuleInfo>, ApiError> {
        self.module_rows(|m, v| {
            let port = |(port, ty): (String, String), dir: PortDir| {
                let meter = |what: &str| v(&format!("port.{port}.frames_{what}_total"));
                let (frames, dropped) = match dir {
                    PortDir::In => (meter("in"), None),
                    PortDir::Out => (meter("out"), Some(meter("dropped"))),
                };
                PortInfo { port, dir, ty, frames, dropped }
            };
            let inputs = m.inputs.into_iter().map(|p| port(p, PortDir::In));
            let ports = inputs.chain(m.outputs.into_iter().map(|p| port(p, PortDir::Out))).collect();
            ModuleInfo {
                frames_in: v("frames_in_total"),
                frames_out: v("frames_out_total"),
                frames_dropped: v("frames_dropped_total"),
                held: v("held_frames"),
                name: m.name,
                kind: m.kind,
                state: m.state,
                ports,
            }
        })
    }

    pub(super) fn module_kinds(&self) -> Result<Vec<KindInfo>, ApiError> {
        let kinds =
            self.catalog.kinds().map(|k| KindInfo { kind: k.name().to_string(), summary: k.summary().to_string() });
        Ok(kinds.collect())
    }

    pub(super) fn module_load(&self, load: ModuleLoad, who: &str) -> Result<Change, ApiError> {
        let ModuleLoad { name, kind, settings } = load;
        let settings = settings_from_json(&settings)?;
        let builder = self.configure(&kind, &settings)?;
        self.edit_one(who, Edit::Load { name, kind: self.kind_name(&kind), settings, builder })
    }

    pub(super) fn module_unload(&self, name: String, who: &str) -> Result<Change, ApiError> {
        self.edit_one(who, Edit::Unload { name })
    }

    pub(super) fn module_replace(&self, replace: ModuleReplace, who: &str) -> Result<Change, ApiError> {
        let ModuleReplace { name, kind, settings, fresh } = replace;
        let settings = settings_from_json(&settings)?;
        let builder = self.configure(&kind, &settings)?;
        let kind = self.kind_name(&kind);
        self.edit_one(who, Edit::Replace { name, kind, settings, builder, keep_state: !fresh })
    }

    /// Sends an `Exec` control frame to module `name` and returns the value of its `ExecReply`.
    pub(super) fn module_exec(&self, exec: ModuleExec) -> Result<ExecResult, ApiError> {
        let ModuleExec { name, procedure, argument } = exec;
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
            dest: name.clone(),
            serial,
            param: procedure.clone(),
            value,
        };
        let reply = self.dp().control(frame).map_err(internal)?;
        match reply {
            Some(r) if r.op == ControlOp::ExecReply => Ok(ExecResult { module: name, procedure, result: r.value }),
            Some(r) if r.op == ControlOp::Error => {
                let code =
                    if self.registry.snapshot_for("module.").matching(&format!("module.{name}.*")).next().is_none() {
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
