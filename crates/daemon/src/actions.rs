//! One action function per control operation. The socket server calls them for every client; the CLI reaches
//! them only through the socket, so the CLI and the API cannot drift apart.
//!
//! Changes to the stack go through `Control::edit`: edits are validated and committed by the data plane between
//! batches, and each accepted change is recorded as a numbered [`Revision`] holding the whole stack description.

use crate::appvars::AppVars;
use crate::dataplane::DataPlane;
use crate::rules::RulesService;
use crate::sandbox::{AppModules, Sandboxes};
use flexstack_api::protocol::{ApiError, ErrorCode, Request};
use flexstack_core::config::{LinkSpec, Settings, StackSpec};
use flexstack_core::switch::CONTROL_PLANE;
use flexstack_core::vars::{is_pattern, VarKind};
use flexstack_core::{Catalog, ConfigError, ControlFrame, ControlOp, Edit, Location, Registry, SharedRegistry, Value};
use serde::Serialize;
use serde_json::{json, Value as Json};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Who asked for something: from the socket's peer credentials.
#[derive(Clone, Debug)]
pub struct Caller {
    /// User name (or uid as text when the name is unknown).
    pub user: String,
    /// Process id of the client, if known.
    pub pid: Option<i32>,
}

/// An accepted change to the stack.
#[derive(Clone, Debug, Serialize)]
pub struct Revision {
    /// 1-based number.
    pub number: u64,
    /// When, in milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// Who asked for it.
    pub user: String,
    /// What changed, as the command that changed it.
    pub change: String,
    /// Side effects reported by the switch.
    pub notes: Vec<String>,
    /// The whole stack after the change, as a TOML description.
    pub stack: String,
}

/// The stack's revisions, numbered from 1. Only the last [`RevisionLog::KEPT`] are kept: every knob write is a
/// revision holding the whole stack, and a rule may write a knob at every sample (200 times a second by default),
/// which would otherwise grow the daemon's memory without bound. The numbers go on counting.
#[derive(Debug, Default)]
pub struct RevisionLog {
    kept: std::collections::VecDeque<Revision>,
    latest: u64,
}

impl RevisionLog {
    /// How many revisions are kept.
    pub const KEPT: usize = 1000;

    /// The number of the latest revision (0: none yet).
    pub fn latest(&self) -> u64 {
        self.latest
    }

    /// Records a revision; returns its number. The oldest kept one goes when more than [`RevisionLog::KEPT`].
    pub fn push(&mut self, time_ms: u64, user: &str, change: String, notes: Vec<String>, stack: String) -> u64 {
        self.latest += 1;
        if self.kept.len() == Self::KEPT {
            self.kept.pop_front();
        }
        self.kept.push_back(Revision { number: self.latest, time_ms, user: user.to_string(), change, notes, stack });
        self.latest
    }

    /// Revision `n`, or why there is none.
    pub fn get(&self, n: u64) -> Result<&Revision, String> {
        let first = self.kept.front().map_or(1, |r| r.number);
        if n == 0 || n > self.latest {
            return Err(format!("no revision {n} (revisions 1..={} exist)", self.latest));
        }
        if n < first {
            return Err(format!(
                "no revision {n}: it was discarded (only the last {} are kept: {first}..={})",
                Self::KEPT,
                self.latest
            ));
        }
        Ok(&self.kept[(n - first) as usize])
    }

    /// The revisions kept, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &Revision> {
        self.kept.iter()
    }
}

/// The control plane's state, shared by all client connections.
pub struct Control {
    dataplane: Mutex<DataPlane>,
    registry: SharedRegistry,
    catalog: Catalog,
    revisions: Mutex<RevisionLog>,
    edit_lock: Mutex<()>,
    started: Instant,
    next_serial: AtomicU32,
    /// The sandboxed apps of this daemon.
    pub sandboxes: Sandboxes,
    /// The rules thread, once started ([`Control::start_rules`]).
    rules: OnceLock<RulesService>,
    /// Variables registered by applications over the app socket.
    pub appvars: Arc<AppVars>,
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::Internal, e.to_string())
}

fn config_error(e: ConfigError) -> ApiError {
    ApiError::new(ErrorCode::ConfigError, e.to_string())
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(0))
}

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
    /// The control plane over a started data plane.
    pub fn new(dataplane: DataPlane, catalog: Catalog, sandboxes: Sandboxes) -> Control {
        let registry = dataplane.registry();
        let registry_for_apps = registry.clone();
        Control {
            dataplane: Mutex::new(dataplane),
            registry,
            catalog,
            revisions: Mutex::new(RevisionLog::default()),
            edit_lock: Mutex::new(()),
            started: Instant::now(),
            next_serial: AtomicU32::new(1 << 31),
            sandboxes,
            rules: OnceLock::new(),
            appvars: Arc::new(AppVars::new(registry_for_apps)),
        }
    }

    /// Starts the rules thread: it samples meters every `interval` while rules are loaded and writes knobs
    /// through [`Control::set_value`] as the user `rules`. Updates of application meters are pushed to it.
    pub fn start_rules(self: &Arc<Self>, interval: Duration) -> Result<(), String> {
        let weak: Weak<Control> = Arc::downgrade(self);
        let writer = Box::new(move |name: &str, value: &Value| match weak.upgrade() {
            Some(c) => c.set_value(name, value, "rules").map(|_| ()).map_err(|e| e.message),
            None => Err("the daemon is stopping".to_string()),
        });
        let svc = RulesService::start(self.registry.clone(), writer, interval)
            .map_err(|e| format!("cannot start the rules thread: {e}"))?;
        if self.rules.set(svc).is_err() {
            return Err("the rules thread runs already".into());
        }
        let weak: Weak<Control> = Arc::downgrade(self);
        self.appvars.on_meter_change(Box::new(move |name, value| {
            if let Some(r) = weak.upgrade().as_ref().and_then(|c| c.rules.get()) {
                r.meter_changed(name, value.clone());
            }
        }));
        Ok(())
    }

    fn rules(&self) -> Result<&RulesService, ApiError> {
        self.rules.get().ok_or_else(|| ApiError::new(ErrorCode::Internal, "the rules thread is not running"))
    }

    /// The module kinds this daemon knows.
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    fn dp(&self) -> std::sync::MutexGuard<'_, DataPlane> {
        self.dataplane.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stops the data plane (modules dropped, taps flushed).
    pub fn shutdown(&self) {
        self.dp().shutdown();
    }

    /// Loads a whole stack description into the (empty) daemon as revision 1. Errors carry file:line.
    pub fn load_stack(&self, spec: &StackSpec, who: &str, change: &str) -> Result<Json, ApiError> {
        let mut edits = Vec::new();
        let mut locations = Vec::new();
        for m in &spec.modules {
            let builder = self.catalog.configure(&m.kind, &m.settings, m.location.clone()).map_err(config_error)?;
            edits.push(Edit::Load {
                name: m.name.clone(),
                kind: m.kind.clone(),
                settings: m.settings.clone(),
                builder,
            });
            locations.push(m.location.clone());
        }
        for l in &spec.links {
            edits.push(Edit::Link(l.link.clone()));
            locations.push(l.location.clone());
        }
        self.edit_located(who, change.to_string(), edits, &locations)
    }

    /// Applies edits atomically and records a revision.
    fn edit(&self, who: &str, change: String, edits: Vec<Edit>) -> Result<Json, ApiError> {
        self.edit_located(who, change, edits, &[])
    }

    /// Like [`Control::edit`]; a refused edit `i` is reported at `locations[i]` when it came from a file.
    fn edit_located(
        &self,
        who: &str,
        change: String,
        edits: Vec<Edit>,
        locations: &[Option<Location>],
    ) -> Result<Json, ApiError> {
        let _guard = self.edit_lock.lock().unwrap_or_else(|p| p.into_inner());
        let dp = self.dp();
        let single = edits.len() == 1;
        let notes = dp.apply(edits).map_err(internal)?.map_err(|e| {
            let message = match locations.get(e.index) {
                Some(Some(loc)) => format!("{loc}: {}", e.message),
                _ if single => e.message,
                _ => e.to_string(),
            };
            ApiError::new(ErrorCode::InvalidEdit, message)
        })?;
        let snap = dp.snapshot().map_err(internal)?;
        drop(dp);
        let mut revs = self.revisions.lock().unwrap_or_else(|p| p.into_inner());
        tracing::info!(revision = revs.latest() + 1, user = who, change = %change, "stack changed");
        let number = revs.push(now_ms(), who, change, notes.clone(), snap.spec.to_toml());
        Ok(json!({ "revision": number, "notes": notes }))
    }

    /// Applies edits that are not changes to the stack description (pause, resume): no revision.
    fn runtime_edit(&self, edits: Vec<Edit>) -> Result<Json, ApiError> {
        let notes = self
            .dp()
            .apply(edits)
            .map_err(internal)?
            .map_err(|e| ApiError::new(ErrorCode::InvalidEdit, e.to_string()))?;
        Ok(json!({ "notes": notes }))
    }

    fn configure(&self, kind: &str, settings: &Settings) -> Result<Box<dyn flexstack_core::ModuleBuilder>, ApiError> {
        self.catalog.configure(kind, settings, None).map_err(config_error)
    }

    /// Runs one request (all but `watch`, which streams: see [`Control::watch`]).
    pub fn handle(&self, request: Request, caller: &Caller) -> Result<Json, ApiError> {
        let who = caller.user.as_str();
        match request {
            Request::Status => self.status(),
            Request::ModuleList => self.module_list(),
            Request::ModuleKinds => Ok(Json::Array(
                self.catalog.kinds().map(|k| json!({ "kind": k.name(), "summary": k.summary() })).collect(),
            )),
            Request::ModuleLoad { name, kind, settings } => {
                let settings = settings_from_json(&settings)?;
                let builder = self.configure(&kind, &settings)?;
                let change = Edit::Load { name: name.clone(), kind: kind.clone(), settings: settings.clone(), builder };
                self.edit(who, change.to_string(), vec![change])
            }
            Request::ModuleUnload { name } => {
                let e = Edit::Unload { name };
                self.edit(who, e.to_string(), vec![e])
            }
            Request::ModuleReplace { name, kind, settings, fresh } => {
                let settings = settings_from_json(&settings)?;
                let builder = self.configure(&kind, &settings)?;
                let e = Edit::Replace { name, kind, settings, builder, keep_state: !fresh };
                self.edit(who, e.to_string(), vec![e])
            }
            Request::ModuleExec { name, procedure, argument } => self.exec(&name, &procedure, argument),
            Request::LinkList => self.link_list(),
            Request::LinkAdd { link } => {
                let l = LinkSpec::parse(&link).map_err(|m| ApiError::new(ErrorCode::InvalidEdit, m))?;
                let e = Edit::Link(l);
                self.edit(who, e.to_string(), vec![e])
            }
            Request::LinkDel { link } => {
                let l = LinkSpec::parse(&link).map_err(|m| ApiError::new(ErrorCode::InvalidEdit, m))?;
                let e = Edit::Unlink(l);
                self.edit(who, e.to_string(), vec![e])
            }
            Request::Pause { module } => self.runtime_edit(vec![Edit::Pause { module }]),
            Request::Resume { module } => self.runtime_edit(vec![Edit::Resume { module }]),
            Request::Get { names } => self.get(&names),
            Request::Set { name, value } => self.set(&name, &value, who),
            Request::Watch { .. } => Err(ApiError::new(ErrorCode::InvalidRequest, "watch streams; use Control::watch")),
            Request::AppAttach { .. } | Request::AppDetach => Err(ApiError::new(
                ErrorCode::InvalidRequest,
                "app_attach holds its connection as a lease; see the server",
            )),
            Request::AppList => Ok(json!(self.sandboxes.list())),
            Request::TapAdd { link, file } => self.tap_add(&link, &file, who),
            Request::TapDel { name } => {
                let is_tap =
                    self.dp().snapshot().map_err(internal)?.modules.iter().any(|m| m.name == name && m.kind == "tap");
                if !is_tap {
                    return Err(ApiError::new(
                        ErrorCode::NotFound,
                        format!("no tap named {name} (see `flexstack tap list`)"),
                    ));
                }
                let e = Edit::Unload { name };
                self.edit(who, e.to_string(), vec![e])
            }
            Request::TapList => self.tap_list(),
            Request::ShowRuntime => self.show_runtime(),
            Request::VarList { pattern } => self.var_list(pattern.as_deref()),
            Request::ConfigLog => {
                let revs = self.revisions.lock().unwrap_or_else(|p| p.into_inner());
                Ok(Json::Array(
                    revs.iter()
                        .map(|r| json!({"revision": r.number, "time_ms": r.time_ms, "user": r.user, "change": r.change, "notes": r.notes}))
                        .collect(),
                ))
            }
            Request::ConfigShow { rev } => match rev {
                Some(n) => {
                    let r = self.revision(n)?;
                    Ok(json!({ "revision": r.number, "stack": r.stack }))
                }
                None => {
                    let snap = self.dp().snapshot().map_err(internal)?;
                    let current = self.revisions.lock().unwrap_or_else(|p| p.into_inner()).latest();
                    Ok(json!({ "revision": current, "stack": snap.spec.to_toml() }))
                }
            },
            Request::ConfigRollback { rev } => self.rollback(rev, who),
            Request::RulesLoad { name, text } => {
                let r = self.rules()?.load(name.clone(), text)?;
                tracing::info!(user = who, file = %name, revision = %r["revision"], "rules loaded");
                Ok(r)
            }
            Request::RulesUnload { names } => self.rules()?.unload(names),
            Request::RulesReplace { old, new } => self.rules()?.replace(old, new),
            Request::RulesList => self.rules()?.list(),
            Request::RulesShow { name } => self.rules()?.show(name),
            Request::RulesLog => self.rules()?.log(),
            Request::RulesDiff { from, to } => self.rules()?.diff(from, to),
            Request::RulesRollback { rev } => self.rules()?.rollback(rev),
            Request::AppVarList => Ok(self.appvars.list()),
        }
    }

    /// Loads a tap recording the frames that leave the sender port of `link`, as one more receiver of that port.
    fn tap_add(&self, link: &str, file: &str, who: &str) -> Result<Json, ApiError> {
        // "a -> b" names the link by its sender; "a[port]" or "a" alone names the port directly.
        let sender_text = link.split("->").next().unwrap_or(link).trim();
        let l =
            LinkSpec::parse(&format!("{sender_text} -> x")).map_err(|m| ApiError::new(ErrorCode::InvalidEdit, m))?;
        if !std::path::Path::new(file).is_absolute() {
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
        settings.insert("path", toml::Value::String(file.to_string()));
        settings.insert("linktype", toml::Value::String(linktype.into()));
        settings.insert("passthrough", toml::Value::Boolean(false));
        let builder = self.configure("tap", &settings)?;
        let link = LinkSpec::parse(&format!("{}[{port}] -> {name}", module.name))
            .map_err(|m| ApiError::new(ErrorCode::Internal, m))?;
        let change = format!("tap add {}[{port}] {file} (as {name})", module.name);
        let edits = vec![Edit::Load { name: name.clone(), kind: "tap".into(), settings, builder }, Edit::Link(link)];
        let mut result = self.edit(who, change, edits)?;
        result["tap"] = json!(name);
        result["linktype"] = json!(linktype);
        Ok(result)
    }

    fn tap_list(&self) -> Result<Json, ApiError> {
        let snap = self.dp().snapshot().map_err(internal)?;
        let reg = self.registry.snapshot();
        let rows = snap
            .modules
            .iter()
            .filter(|m| m.kind == "tap")
            .map(|m| {
                let spec = snap.spec.modules.iter().find(|s| s.name == m.name);
                let setting = |k: &str| {
                    spec.and_then(|s| s.settings.get(k)).map(|v| v.value.to_string().trim_matches('"').to_string())
                };
                let taps: Vec<String> = snap
                    .edges
                    .iter()
                    .filter(|e| e.to == m.name)
                    .map(|e| format!("{}[{}]", e.from, e.from_port))
                    .collect();
                json!({"name": m.name, "file": setting("path"), "linktype": setting("linktype"), "taps": taps,
                       "frames": Self::u64_var(&reg, &format!("module.{}.frames_total", m.name))})
            })
            .collect();
        Ok(Json::Array(rows))
    }

    /// Sends an `Exec` control frame to module `name` and returns the value of its `ExecReply`.
    fn exec(&self, name: &str, procedure: &str, argument: Option<Json>) -> Result<Json, ApiError> {
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

    fn revision(&self, n: u64) -> Result<Revision, ApiError> {
        let revs = self.revisions.lock().unwrap_or_else(|p| p.into_inner());
        revs.get(n).cloned().map_err(|e| ApiError::new(ErrorCode::NotFound, e))
    }

    fn status(&self) -> Result<Json, ApiError> {
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

    /// A u64 variable of `reg`, 0 if absent.
    fn u64_var(reg: &Registry, name: &str) -> u64 {
        reg.get(name).map_or(0, |c| c.load_u64())
    }

    fn module_list(&self) -> Result<Json, ApiError> {
        let snap = self.dp().snapshot().map_err(internal)?;
        let reg = self.registry.snapshot();
        let rows = snap
            .modules
            .iter()
            .map(|m| {
                let v = |var: &str| Self::u64_var(&reg, &format!("module.{}.{var}", m.name));
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

    fn link_list(&self) -> Result<Json, ApiError> {
        let snap = self.dp().snapshot().map_err(internal)?;
        Ok(json!({
            "links": snap.spec.links.iter().map(|l| l.link.to_string()).collect::<Vec<_>>(),
            "edges": snap.edges.iter().map(|e| json!({"from": e.from, "from_port": e.from_port, "to": e.to, "to_port": e.to_port})).collect::<Vec<_>>(),
        }))
    }

    /// Values of the variables matching `names` (each a name or a pattern), sorted by name.
    pub fn get(&self, names: &[String]) -> Result<Json, ApiError> {
        let reg = self.registry.snapshot();
        let mut out = serde_json::Map::new();
        for n in names {
            let before = out.len();
            for (name, cell) in reg.matching(n) {
                out.insert(name.to_string(), json!({ "value": cell.get(), "unit": cell.spec().unit }));
            }
            if out.len() == before && reg.matching(n).next().is_none() {
                let what = if is_pattern(n) { "no variable matches" } else { "no variable named" };
                return Err(ApiError::new(ErrorCode::NotFound, format!("{what} {n} (see `flexstack var list`)")));
            }
        }
        Ok(Json::Object(out))
    }

    /// The declaration of the knob `name`, or why it cannot be written.
    fn knob_spec(
        &self,
        name: &str,
    ) -> Result<(flexstack_core::vars::VarSpec, Arc<flexstack_core::vars::VarCell>), ApiError> {
        let reg = self.registry.snapshot();
        let cell = reg.get(name).ok_or_else(|| {
            ApiError::new(ErrorCode::NotFound, format!("no variable named {name} (see `flexstack var list`)"))
        })?;
        let spec = cell.spec().clone();
        if spec.kind != VarKind::Knob {
            return Err(ApiError::new(ErrorCode::InvalidValue, format!("{name} is a meter (read-only)")));
        }
        Ok((spec, cell.clone()))
    }

    /// `set`: the value is JSON of the knob's type, or text parsed as that type.
    fn set(&self, name: &str, value: &Json, who: &str) -> Result<Json, ApiError> {
        let (spec, cell) = self.knob_spec(name)?;
        let v = match value {
            Json::String(text) => Value::parse_as(spec.ty, text),
            other => serde_json::from_value::<Value>(other.clone())
                .map_err(|e| e.to_string())
                .and_then(|v| v.coerce(spec.ty)),
        }
        .map_err(|e| ApiError::new(ErrorCode::InvalidValue, format!("{name}: {e}")))?;
        self.write_knob(name, &spec, &cell, &v, who)
    }

    /// Writes a knob from a typed value (the rules' writes): the same validation and path as `set`.
    pub fn set_value(&self, name: &str, value: &Value, who: &str) -> Result<Json, ApiError> {
        let (spec, cell) = self.knob_spec(name)?;
        let v = value.coerce(spec.ty).map_err(|e| ApiError::new(ErrorCode::InvalidValue, format!("{name}: {e}")))?;
        self.write_knob(name, &spec, &cell, &v, who)
    }

    /// Validates `v` against the knob's declaration, then applies it: a module knob through an edit between
    /// batches (a stack revision), an application's knob by delivering it to the application.
    fn write_knob(
        &self,
        name: &str,
        spec: &flexstack_core::vars::VarSpec,
        cell: &flexstack_core::vars::VarCell,
        v: &Value,
        who: &str,
    ) -> Result<Json, ApiError> {
        let v = spec.validate(v).map_err(|e| ApiError::new(ErrorCode::InvalidValue, format!("{name}: {e}")))?;
        if name.starts_with("app.") && self.appvars.owns(name) {
            self.appvars.write(name, &v)?;
            tracing::info!(user = who, knob = name, value = %v, "application knob written");
            return Ok(json!({ "value": cell.get(), "notes": [] }));
        }
        if name.starts_with("flow.") || name.starts_with("iface.") {
            // A knob a module registered at runtime (a flow's class): the module that owns it applies it. Not part
            // of the stack description, so no revision.
            let mut result = self.runtime_edit(vec![Edit::SetVar { name: name.to_string(), value: v.clone() }])?;
            // The module refused the value (it checks more than the declared type): nothing changed.
            let refused = format!("set {name}: ");
            if let Some(note) = result["notes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Json::as_str)
                .find(|n| n.starts_with(&refused))
            {
                return Err(ApiError::new(ErrorCode::InvalidValue, note.trim_start_matches("set ").to_string()));
            }
            tracing::info!(user = who, knob = name, value = %v, "runtime knob written");
            result["value"] = json!(cell.get());
            return Ok(result);
        }
        let (module, knob) = name
            .strip_prefix("module.")
            .and_then(|r| r.split_once('.'))
            .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("{name} is not a module knob")))?;
        let e = Edit::SetKnob { module: module.to_string(), knob: knob.to_string(), value: v };
        let mut result = self.edit(who, e.to_string(), vec![e])?;
        result["value"] = json!(cell.get());
        Ok(result)
    }

    fn var_list(&self, pattern: Option<&str>) -> Result<Json, ApiError> {
        let reg = self.registry.snapshot();
        let pattern = pattern.unwrap_or("**");
        Ok(Json::Array(
            reg.matching(pattern)
                .map(|(name, c)| {
                    let s = c.spec();
                    json!({"name": name, "kind": s.kind, "type": s.ty, "unit": s.unit, "description": s.description,
                           "range": s.range, "value": c.get()})
                })
                .collect(),
        ))
    }

    fn show_runtime(&self) -> Result<Json, ApiError> {
        let snap = self.dp().snapshot().map_err(internal)?;
        let reg = self.registry.snapshot();
        let rows: Vec<Json> = snap
            .modules
            .iter()
            .map(|m| {
                let v = |var: &str| Self::u64_var(&reg, &format!("module.{}.{var}", m.name));
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

    /// Streams samples of the variables matching `names` to `emit` until it returns false or `count` events
    /// were sent. With `changes`, only values that changed are sent (the first event has them all).
    pub fn watch(
        &self,
        names: &[String],
        interval: Duration,
        changes: bool,
        count: Option<u64>,
        emit: &mut dyn FnMut(Json) -> bool,
    ) -> Result<(), ApiError> {
        self.get(names)?;
        let mut last: serde_json::Map<String, Json> = serde_json::Map::new();
        let mut sent = 0u64;
        let start = Instant::now();
        loop {
            let reg = self.registry.snapshot();
            let mut values = serde_json::Map::new();
            for n in names {
                for (name, cell) in reg.matching(n) {
                    let v = json!(cell.get());
                    if !changes || last.get(name) != Some(&v) {
                        values.insert(name.to_string(), v.clone());
                    }
                    last.insert(name.to_string(), v);
                }
            }
            if !values.is_empty() || !changes {
                let event =
                    json!({ "t_ms": start.elapsed().as_millis() as u64, "time_ms": now_ms(), "values": values });
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

    /// Returns the stack to revision `rev`: modules missing are loaded, extra ones unloaded, changed ones
    /// replaced (state kept where the kind is the same), knobs set, links relinked — all in one atomic edit.
    fn rollback(&self, rev: u64, who: &str) -> Result<Json, ApiError> {
        let target_rev = self.revision(rev)?;
        let target = StackSpec::parse(&format!("revision {rev}"), &target_rev.stack).map_err(config_error)?;
        let current = self.dp().snapshot().map_err(internal)?.spec;
        let reg = self.registry.snapshot();
        let knobs_of = |module: &str| -> Vec<String> {
            reg.matching(&format!("module.{module}.**"))
                .filter(|(_, c)| c.spec().kind == VarKind::Knob)
                .map(|(_, c)| c.spec().name.clone())
                .collect()
        };
        let mut edits: Vec<Edit> = current.links.iter().map(|l| Edit::Unlink(l.link.clone())).collect();
        for m in &current.modules {
            if !target.modules.iter().any(|t| t.name == m.name) {
                edits.push(Edit::Unload { name: m.name.clone() });
            }
        }
        for t in &target.modules {
            match current.modules.iter().find(|m| m.name == t.name) {
                None => {
                    let builder = self.configure(&t.kind, &t.settings)?;
                    edits.push(Edit::Load {
                        name: t.name.clone(),
                        kind: t.kind.clone(),
                        settings: t.settings.clone(),
                        builder,
                    });
                }
                Some(m) => {
                    let knobs = knobs_of(&m.name);
                    let strip = |s: &Settings| {
                        let mut out = Settings::default();
                        for (k, v) in s.iter().filter(|(k, _)| !knobs.iter().any(|n| n == k)) {
                            out.insert(k, v.value.clone());
                        }
                        out
                    };
                    if m.kind == t.kind && strip(&m.settings).same_values(&strip(&t.settings)) {
                        for k in &knobs {
                            if let Some(want) = t.settings.get(k) {
                                if m.settings.get(k).map(|s| &s.value) != Some(&want.value) {
                                    if let Some(value) = Value::from_toml(&want.value) {
                                        edits.push(Edit::SetKnob { module: m.name.clone(), knob: k.clone(), value });
                                    }
                                }
                            }
                        }
                    } else {
                        let builder = self.configure(&t.kind, &t.settings)?;
                        edits.push(Edit::Replace {
                            name: t.name.clone(),
                            kind: t.kind.clone(),
                            settings: t.settings.clone(),
                            builder,
                            keep_state: m.kind == t.kind,
                        });
                    }
                }
            }
        }
        edits.extend(target.links.iter().map(|l| Edit::Link(l.link.clone())));
        self.edit(who, format!("config rollback {rev}"), edits)
    }
}

/// The sandboxes load and unload their apps' modules through the control plane, as revisions.
impl AppModules for Control {
    fn load_modules(&self, spec: &StackSpec, who: &str, change: &str) -> Result<(), ApiError> {
        self.load_stack(spec, who, change).map(drop)
    }

    fn unload_modules(&self, names: &[String], change: &str) -> Result<(), ApiError> {
        let loaded: Vec<String> = self.dp().snapshot().map_err(internal)?.modules.into_iter().map(|m| m.name).collect();
        let edits: Vec<Edit> =
            names.iter().filter(|n| loaded.contains(n)).map(|n| Edit::Unload { name: n.clone() }).collect();
        if edits.is_empty() {
            return Ok(());
        }
        self.edit("daemon", change.to_string(), edits).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::RevisionLog;

    #[test]
    fn the_revision_log_keeps_the_last_revisions_and_goes_on_numbering() {
        let mut log = RevisionLog::default();
        assert_eq!(log.latest(), 0);
        assert!(log.get(1).unwrap_err().contains("revisions 1..=0 exist"));
        for i in 1..=(RevisionLog::KEPT as u64 + 5) {
            assert_eq!(log.push(i, "t", format!("change {i}"), Vec::new(), String::new()), i);
        }
        let latest = RevisionLog::KEPT as u64 + 5;
        assert_eq!(log.latest(), latest);
        assert_eq!(log.iter().count(), RevisionLog::KEPT);
        assert_eq!(log.iter().next().unwrap().number, 6);
        assert_eq!(log.get(6).unwrap().change, "change 6");
        assert_eq!(log.get(latest).unwrap().change, format!("change {latest}"));
        let discarded = log.get(5).unwrap_err();
        assert!(discarded.contains("discarded") && discarded.contains(&format!("6..={latest}")), "{discarded}");
        assert!(log.get(latest + 1).unwrap_err().contains(&format!("1..={latest} exist")));
        assert!(log.get(0).is_err());
    }
}
