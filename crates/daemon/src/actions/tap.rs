//! Taps: pcapng captures of a port, loaded as one more receiver of it (add, del, list).

use crate::actions::control::{internal, u64_var, Control};
use flexstack_api::ops::{Change, TapAdd, TapAdded, TapInfo};
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_core::config::{LinkSpec, Settings};
use flexstack_core::vars::Registry;
use flexstack_core::{Edit, Value};

/// A text variable's value; `None` when it is absent or empty.
fn text_var(reg: &Registry, name: &str) -> Option<String> {
    match reg.get(name).map(|c| c.get()) {
        Some(Value::Str(s)) if !s.is_empty() => Some(s),
        _ => None,
    }
}

impl Control {
    /// Loads a tap recording the frames that leave the sender port of `link`, as one more receiver of that port.
    pub(super) fn tap_add(&self, add: TapAdd, who: &str) -> Result<TapAdded, ApiError> {
        let TapAdd { link, file } = add;
        // "a -> b" names the link by its sender; "a[port]" or "a" alone names the port directly.
        let sender_text = link.split("->").next().unwrap_or(&link).trim();
        let l =
            LinkSpec::parse(&format!("{sender_text} -> x")).map_err(|m| ApiError::new(ErrorCode::InvalidEdit, m))?;
        if !std::path::Path::new(&file).is_absolute() {
            return Err(ApiError::new(
                ErrorCode::InvalidValue,
                format!("the capture file must be an absolute path, got {file:?}"),
            ));
        }
        let snap = self.dp().snapshot().map_err(internal)?;
        let module = snap
            .modules
            .iter()
            .find(|m| m.name == l.from.module)
            .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("no module named `{}`", l.from.module)))?;
        let data_ports: Vec<&(String, String)> = module.outputs.iter().filter(|(p, _)| p != "ctl").collect();
        let (port, ty) = match &l.from.port {
            Some(p) => module.outputs.iter().find(|(n, _)| n == p),
            None if data_ports.len() == 1 => Some(data_ports[0]),
            None => None,
        }
        .ok_or_else(|| {
            let ports: Vec<&str> = module.outputs.iter().map(|(p, _)| p.as_str()).collect();
            ApiError::new(
                ErrorCode::InvalidEdit,
                format!("name one output port of {}: {}", module.name, ports.join(", ")),
            )
        })?;
        let linktype = if ty == "ethernet" { "ethernet" } else { "raw" };
        let name =
            (1..).map(|n| format!("tap{n}")).find(|n| !snap.modules.iter().any(|m| &m.name == n)).unwrap_or_default();
        let mut settings = Settings::default();
        settings.insert("path", toml::Value::String(file.clone()));
        settings.insert("linktype", toml::Value::String(linktype.into()));
        settings.insert("passthrough", toml::Value::Boolean(false));
        let builder = self.configure("tap", &settings)?;
        let link = LinkSpec::parse(&format!("{}[{port}] -> {name}", module.name))
            .map_err(|m| ApiError::new(ErrorCode::Internal, m))?;
        let change = format!("tap add {}[{port}] {file} (as {name})", module.name);
        let edits = vec![Edit::Load { name: name.clone(), kind: "tap".into(), settings, builder }, Edit::Link(link)];
        let Change { revision, notes } = self.edit(who, change, edits)?;
        let file = text_var(&self.registry.snapshot_for("module."), &format!("module.{name}.file")).unwrap_or(file);
        Ok(TapAdded { revision, notes, tap: name, linktype: linktype.to_string(), file })
    }

    pub(super) fn tap_list(&self) -> Result<Vec<TapInfo>, ApiError> {
        let snap = self.dp().snapshot().map_err(internal)?;
        let reg = self.registry.snapshot_for("module.");
        let rows = snap
            .modules
            .iter()
            .filter(|m| m.kind == "tap")
            .map(|m| {
                let spec = snap.spec.modules.iter().find(|s| s.name == m.name);
                let setting = |k: &str| {
                    spec.and_then(|s| s.settings.get(k)).map(|v| v.value.to_string().trim_matches('"').to_string())
                };
                let taps = snap
                    .edges
                    .iter()
                    .filter(|e| e.to == m.name)
                    .map(|e| format!("{}[{}]", e.from, e.from_port))
                    .collect();
                let var = |v: &str| format!("module.{}.{v}", m.name);
                TapInfo {
                    name: m.name.clone(),
                    file: text_var(&reg, &var("file")).or_else(|| setting("path")),
                    linktype: setting("linktype"),
                    taps,
                    frames: u64_var(&reg, &var("frames_total")),
                    frames_pending: u64_var(&reg, &var("frames_pending")),
                    frames_unwritten: u64_var(&reg, &var("frames_unwritten_total")),
                    error: text_var(&reg, &var("error")),
                }
            })
            .collect();
        Ok(rows)
    }

    /// Unloads the tap `name` (and only a tap).
    pub(super) fn tap_del(&self, name: String, who: &str) -> Result<Change, ApiError> {
        let is_tap = self.dp().snapshot().map_err(internal)?.modules.iter().any(|m| m.name == name && m.kind == "tap");
        if !is_tap {
            return Err(ApiError::new(ErrorCode::NotFound, format!("no tap named {name} (see `flexstack tap list`)")));
        }
        self.edit_one(who, Edit::Unload { name })
    }
}
