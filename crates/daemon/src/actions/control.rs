//! The control plane's state, shared by all client connections, and the way every action changes the stack:
//! `Control::edit` sends edits to the data plane, which validates and commits them between batches, and records
//! each accepted change as a numbered revision ([`crate::actions::revisions`]).

use crate::actions::persist_state::Persist;
use crate::actions::revisions::RevisionLog;
use crate::appvars::AppVars;
use crate::dataplane::DataPlane;
use crate::rules::RulesService;
use crate::sandbox::Sandboxes;
use flexstack_api::ops::{Change, Notes};
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_core::config::{Settings, StackSpec};
use flexstack_core::switch::ModuleInfo;
use flexstack_core::{Catalog, ConfigError, Edit, Location, Registry, SharedRegistry, Value};
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Who asked for something: from the socket's peer credentials.
#[derive(Clone, Debug)]
pub struct Caller {
    /// User name (or uid as text when the name is unknown).
    pub user: String,
    /// Process id of the client, if known.
    pub pid: Option<i32>,
}

/// Who made a change to the stack: an operator (a user of the socket), or a rule (coalesced in the log).
#[derive(Clone, Copy, Debug)]
pub(super) enum Author<'a> {
    User(&'a str),
    Rule(&'a str),
}

/// The control plane's state, shared by all client connections.
pub struct Control {
    dataplane: Mutex<DataPlane>,
    pub(super) registry: SharedRegistry,
    pub(super) catalog: Catalog,
    pub(super) revisions: Mutex<RevisionLog>,
    edit_lock: Mutex<()>,
    pub(super) started: Instant,
    pub(super) next_serial: AtomicU32,
    /// The sandboxed apps of this daemon.
    pub sandboxes: Sandboxes,
    /// The rules thread, once started ([`Control::start_rules`]).
    rules: OnceLock<RulesService>,
    /// Variables registered by applications over the app socket.
    pub appvars: Arc<AppVars>,
    /// Where the daemon's HTTP endpoints listen (`metrics`, `web`), for `status`.
    pub(super) served: Mutex<Vec<(&'static str, std::net::SocketAddr)>>,
    /// The journal and what it needs ([`crate::actions::persist`]).
    pub(super) persist: Persist,
}

pub(crate) fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::Internal, e.to_string())
}

pub(super) fn config_error(e: ConfigError) -> ApiError {
    ApiError::new(ErrorCode::ConfigError, e.to_string())
}

pub(super) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(0))
}

/// A u64 variable of `reg`, 0 if absent.
pub(super) fn u64_var(reg: &Registry, name: &str) -> u64 {
    reg.get(name).map_or(0, |c| c.load_u64())
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
            served: Mutex::new(Vec::new()),
            persist: Persist::default(),
        }
    }

    /// Notes that the endpoint `what` (`metrics`, `web`) listens at `addr` (`status` reports it).
    pub fn served_at(&self, what: &'static str, addr: std::net::SocketAddr) {
        self.served.lock().unwrap_or_else(|p| p.into_inner()).push((what, addr));
    }

    /// Starts the rules thread: it samples meters as `sampling` says while rules are loaded, within `limits`, and
    /// writes knobs through [`Control::set_by_rule`] (the user `rules`; their revisions are coalesced per rule).
    /// Updates of application meters are pushed to it.
    pub fn start_rules(
        self: &Arc<Self>,
        sampling: crate::rules::Sampling,
        limits: flexstack_rules::Limits,
    ) -> Result<(), String> {
        let weak: Weak<Control> = Arc::downgrade(self);
        let writer = Box::new(move |rule: &str, name: &str, value: &Value| match weak.upgrade() {
            Some(c) => c.set_by_rule(name, value, rule).map(|_| ()).map_err(|e| e.message),
            None => Err("the daemon is stopping".to_string()),
        });
        let svc = RulesService::start(self.registry.clone(), writer, sampling, limits)
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

    pub(super) fn rules(&self) -> Result<&RulesService, ApiError> {
        self.rules.get().ok_or_else(|| ApiError::new(ErrorCode::Internal, "the rules thread is not running"))
    }

    /// The module kinds this daemon knows.
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    pub(super) fn dp(&self) -> std::sync::MutexGuard<'_, DataPlane> {
        self.dataplane.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stops the data plane (modules dropped, taps flushed).
    pub fn shutdown(&self) {
        self.dp().shutdown();
    }

    /// Loads a whole stack description into the (empty) daemon as revision 1. Errors carry file:line.
    pub fn load_stack(&self, spec: &StackSpec, who: &str, change: &str) -> Result<Change, ApiError> {
        let (edits, locations) = self.load_edits(spec)?;
        self.edit_located(Author::User(who), change.to_string(), edits, &locations)
    }

    /// The edits that load `spec`'s modules and links, with where each was written.
    pub(super) fn load_edits(&self, spec: &StackSpec) -> Result<(Vec<Edit>, Vec<Option<Location>>), ApiError> {
        let mut edits = Vec::new();
        let mut locations = Vec::new();
        for m in &spec.modules {
            let builder = self.catalog.configure(&m.kind, &m.settings, m.location.clone()).map_err(config_error)?;
            edits.push(Edit::Load {
                name: m.name.clone(),
                kind: self.kind_name(&m.kind),
                settings: m.settings.clone(),
                builder,
            });
            locations.push(m.location.clone());
        }
        for l in &spec.links {
            edits.push(Edit::Link(l.link.clone()));
            locations.push(l.location.clone());
        }
        Ok((edits, locations))
    }

    /// Applies edits atomically and records a revision.
    pub(super) fn edit(&self, who: &str, change: String, edits: Vec<Edit>) -> Result<Change, ApiError> {
        self.edit_located(Author::User(who), change, edits, &[])
    }

    /// Applies a knob write made by rule `rule`: recorded in the rule's coalesced entry of the revision log.
    pub(super) fn edit_by_rule(&self, rule: &str, edit: Edit) -> Result<Change, ApiError> {
        self.edit_located(Author::Rule(rule), edit.to_string(), vec![edit], &[])
    }

    /// Held while the stack is changed: one change at a time.
    pub(super) fn edit_guard(&self) -> std::sync::MutexGuard<'_, ()> {
        self.edit_lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies edits atomically (with [`Control::edit_guard`] held); a refused edit `i` is reported at
    /// `locations[i]` when it came from a file. Returns the switch's notes.
    pub(super) fn apply_edits(
        &self,
        edits: Vec<Edit>,
        locations: &[Option<Location>],
    ) -> Result<Vec<String>, ApiError> {
        let single = edits.len() == 1;
        self.dp().apply(edits).map_err(internal)?.map_err(|e| {
            let message = match locations.get(e.index) {
                Some(Some(loc)) => format!("{loc}: {}", e.message),
                _ if single => e.message,
                _ => e.to_string(),
            };
            ApiError::new(ErrorCode::InvalidEdit, message)
        })
    }

    /// Like [`Control::edit`]; a refused edit `i` is reported at `locations[i]` when it came from a file. The
    /// revision is in the journal before this returns.
    fn edit_located(
        &self,
        author: Author<'_>,
        change: String,
        edits: Vec<Edit>,
        locations: &[Option<Location>],
    ) -> Result<Change, ApiError> {
        let _guard = self.edit_guard();
        let notes = self.apply_edits(edits, locations)?;
        let snap = self.dp().snapshot().map_err(internal)?;
        let mut revs = self.revisions.lock().unwrap_or_else(|p| p.into_inner());
        let revision = match author {
            Author::User(who) => {
                tracing::info!(revision = revs.latest() + 1, user = who, change = %change, "stack changed");
                revs.push(now_ms(), who, change, notes.clone(), snap.spec.to_toml())
            }
            Author::Rule(rule) => {
                tracing::debug!(rule, change = %change, "stack changed by a rule");
                revs.push_rule_write(now_ms(), rule, change, notes.clone(), snap.spec.to_toml())
            }
        };
        let written = self.journal_revision(&revs, revision, matches!(author, Author::User(_)));
        drop(revs);
        self.after_change();
        written?;
        Ok(Change { revision, notes })
    }

    /// Applies edits that are not changes to the stack description (pause, resume): no revision.
    pub(super) fn runtime_edit(&self, edits: Vec<Edit>) -> Result<Notes, ApiError> {
        let notes = self
            .dp()
            .apply(edits)
            .map_err(internal)?
            .map_err(|e| ApiError::new(ErrorCode::InvalidEdit, e.to_string()))?;
        Ok(Notes { notes })
    }

    pub(super) fn configure(
        &self,
        kind: &str,
        settings: &Settings,
    ) -> Result<Box<dyn flexstack_core::ModuleBuilder>, ApiError> {
        self.catalog.configure(kind, settings, None).map_err(config_error)
    }

    /// The name a module of `kind` is recorded under: the kind's current name when `kind` is an old one (a stack
    /// loaded with `switch` lists, saves and rolls back as `select`).
    pub(super) fn kind_name(&self, kind: &str) -> String {
        self.catalog.canonical(kind).unwrap_or(kind).to_string()
    }

    /// One row per loaded module, made by `row` from the module and a reader of its meters by their names under
    /// the module (`frames_in_total`, `port.out.frames_out_total`; 0 when absent).
    pub(super) fn module_rows<T>(
        &self,
        row: impl Fn(ModuleInfo, &dyn Fn(&str) -> u64) -> T,
    ) -> Result<Vec<T>, ApiError> {
        let snap = self.dp().snapshot().map_err(internal)?;
        let reg = self.registry.snapshot_for("module.");
        let rows = snap.modules.into_iter().map(|m| {
            let prefix = format!("module.{}.", m.name);
            row(m, &|var| u64_var(&reg, &format!("{prefix}{var}")))
        });
        Ok(rows.collect())
    }

    /// Applies one edit and records it as a revision named after the edit.
    pub(super) fn edit_one(&self, who: &str, edit: Edit) -> Result<Change, ApiError> {
        self.edit(who, edit.to_string(), vec![edit])
    }
}
