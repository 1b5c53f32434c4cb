//! Meters and knobs: get, set (module, runtime and application knobs), watch, var list.

use crate::actions::control::{now_ms, Author, Control};
use flexstack_api::ops::{SetResult, Values, VarInfo, VarValue, WatchEvent};
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_core::vars::{is_pattern, VarHandle, VarKind, VarSpec};
use flexstack_core::{Edit, Value};
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// True if `now` is sent as `last` was: equal values, or floats that are both not finite (JSON has no NaN or
/// infinity: they are sent as `null`).
fn sent_alike(last: Option<&Value>, now: &Value) -> bool {
    match (last, now) {
        (Some(Value::F64(a)), Value::F64(b)) if !a.is_finite() && !b.is_finite() => true,
        (last, now) => last == Some(now),
    }
}

impl Control {
    /// Values of the variables matching `names` (each a name or a pattern), sorted by name.
    pub fn get(&self, names: &[String]) -> Result<Values, ApiError> {
        let mut out = Values::new();
        // A name, not a pattern, is read without a snapshot (a whole one costs a reference count per flow).
        let value = |var: flexstack_core::Var<'_>| VarValue { value: var.get(), unit: var.spec().unit.clone() };
        let mut rest = Vec::new();
        for n in names {
            match (!is_pattern(n)).then(|| self.registry.with_var(n, value)).flatten() {
                Some(v) => {
                    out.insert(n.clone(), v);
                }
                None => rest.push(n),
            }
        }
        if rest.is_empty() {
            return Ok(out);
        }
        for n in rest {
            // A snapshot of the groups the pattern can reach: `module.*.x` takes no flow's.
            let reg = self.registry.snapshot_for(n);
            let before = out.len();
            for (name, cell) in reg.matching(n) {
                out.insert(name.to_string(), VarValue { value: cell.get(), unit: cell.spec().unit.clone() });
            }
            if out.len() == before && reg.matching(n).next().is_none() {
                let what = if is_pattern(n) { "no variable matches" } else { "no variable named" };
                // `*` stays within a segment: say so when `**` would have matched.
                let deep = n.replace("**", "*").replace('*', "**");
                let hint = if is_pattern(n)
                    && deep != *n
                    && self.registry.snapshot_for(&deep).matching(&deep).next().is_some()
                {
                    format!("; `*` matches within one dot-separated part of a name, `**` across them: try {deep}")
                } else {
                    String::new()
                };
                return Err(ApiError::new(ErrorCode::NotFound, format!("{what} {n}{hint} (see `flexstack var list`)")));
            }
        }
        Ok(out)
    }

    /// The declaration of the knob `name`, or why it cannot be written.
    fn knob_spec(&self, name: &str) -> Result<(VarSpec, VarHandle), ApiError> {
        let (spec, handle) = self.registry.with_var(name, |v| (v.spec().clone(), v.to_handle())).ok_or_else(|| {
            ApiError::new(ErrorCode::NotFound, format!("no variable named {name} (see `flexstack var list`)"))
        })?;
        if spec.kind != VarKind::Knob {
            return Err(ApiError::new(ErrorCode::InvalidValue, format!("{name} is a meter (read-only)")));
        }
        Ok((spec, handle))
    }

    /// `set`: the value is JSON of the knob's type, or text parsed as that type.
    pub(super) fn set(&self, name: &str, value: &Json, who: &str) -> Result<SetResult, ApiError> {
        let (spec, cell) = self.knob_spec(name)?;
        let v = match value {
            Json::String(text) => Value::parse_as(spec.ty, text),
            other => serde_json::from_value::<Value>(other.clone())
                .map_err(|e| e.to_string())
                .and_then(|v| v.coerce(spec.ty)),
        }
        .map_err(|e| ApiError::new(ErrorCode::InvalidValue, format!("{name}: {e}")))?;
        self.write_knob(name, &spec, &cell, &v, Author::User(who))
    }

    /// Writes a knob from a typed value made by rule `rule`: the same validation and path as `set`, as the user
    /// `rules`; a module knob's revision goes into the rule's coalesced entry of the log.
    pub fn set_by_rule(&self, name: &str, value: &Value, rule: &str) -> Result<SetResult, ApiError> {
        let (spec, cell) = self.knob_spec(name)?;
        let v = value.coerce(spec.ty).map_err(|e| ApiError::new(ErrorCode::InvalidValue, format!("{name}: {e}")))?;
        self.write_knob(name, &spec, &cell, &v, Author::Rule(rule))
    }

    /// Validates `v` against the knob's declaration, then applies it: a module knob through an edit between
    /// batches (a stack revision), an application's knob by delivering it to the application.
    fn write_knob(
        &self,
        name: &str,
        spec: &VarSpec,
        cell: &VarHandle,
        v: &Value,
        author: Author<'_>,
    ) -> Result<SetResult, ApiError> {
        let who = match author {
            Author::User(who) => who,
            Author::Rule(_) => "rules",
        };
        let v = spec.validate(v).map_err(|e| ApiError::new(ErrorCode::InvalidValue, format!("{name}: {e}")))?;
        if name.starts_with("app.") && self.appvars.owns(name) {
            self.appvars.write(name, &v)?;
            tracing::info!(user = who, knob = name, value = %v, "application knob written");
            return Ok(SetResult { revision: None, notes: Vec::new(), value: cell.get() });
        }
        if name.starts_with("worker.all.") {
            // A setting of the data plane's loop that every worker loads each round: stored, nothing to edit.
            cell.store(&v);
            tracing::info!(user = who, knob = name, value = %v, "data-plane knob written");
            return Ok(SetResult { revision: None, notes: Vec::new(), value: cell.get() });
        }
        if name.starts_with("flow.") || name.starts_with("iface.") {
            // A knob a module registered at runtime (a flow's class): the module that owns it applies it. Not part
            // of the stack description, so no revision.
            let notes = self.runtime_edit(vec![Edit::SetVar { name: name.to_string(), value: v.clone() }])?.notes;
            // The module refused the value (it checks more than the declared type): nothing changed.
            let refused = format!("set {name}: ");
            if let Some(note) = notes.iter().find(|n| n.starts_with(&refused)) {
                return Err(ApiError::new(ErrorCode::InvalidValue, note.trim_start_matches("set ").to_string()));
            }
            tracing::info!(user = who, knob = name, value = %v, "runtime knob written");
            return Ok(SetResult { revision: None, notes, value: cell.get() });
        }
        let (module, knob) = name
            .strip_prefix("module.")
            .and_then(|r| r.split_once('.'))
            .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("{name} is not a module knob")))?;
        let e = Edit::SetKnob { module: module.to_string(), knob: knob.to_string(), value: v };
        let change = match author {
            Author::User(who) => self.edit_one(who, e)?,
            Author::Rule(rule) => self.edit_by_rule(rule, e)?,
        };
        Ok(SetResult { revision: Some(change.revision), notes: change.notes, value: cell.get() })
    }

    pub(super) fn var_list(&self, pattern: Option<&str>) -> Result<Vec<VarInfo>, ApiError> {
        let pattern = pattern.unwrap_or("**");
        let reg = self.registry.snapshot_for(pattern);
        let vars = reg
            .matching(pattern)
            .map(|(name, c)| VarInfo { spec: VarSpec { name: name.to_string(), ..c.spec().clone() }, value: c.get() });
        Ok(vars.collect())
    }

    /// Streams samples of the variables matching `names` to `emit` until it returns false or `count` events
    /// were sent. With `changes`, only values that changed are sent (the first event has them all).
    pub fn watch(
        &self,
        names: &[String],
        interval: Duration,
        changes: bool,
        count: Option<u64>,
        emit: &mut dyn FnMut(WatchEvent) -> bool,
    ) -> Result<(), ApiError> {
        self.get(names)?;
        let mut last: BTreeMap<String, Value> = BTreeMap::new();
        let mut sent = 0u64;
        let start = Instant::now();
        loop {
            let mut values = BTreeMap::new();
            for n in names {
                for (name, cell) in self.registry.snapshot_for(n).matching(n) {
                    let v = cell.get();
                    if !changes || !sent_alike(last.get(name.as_ref()), &v) {
                        values.insert(name.to_string(), v.clone());
                    }
                    last.insert(name.to_string(), v);
                }
            }
            if !values.is_empty() || !changes {
                let event = WatchEvent { t_ms: start.elapsed().as_millis() as u64, time_ms: now_ms(), values };
                if !emit(event) {
                    return Ok(());
                }
                sent += 1;
                if count.is_some_and(|c| sent >= c) {
                    return Ok(());
                }
            }
            std::thread::sleep(interval);
        }
    }
}
