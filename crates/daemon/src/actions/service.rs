//! An app's stream services while it runs (`service list|show|add|del`, docs/services.md) and signals to its
//! processes (`app stop|continue|kill`).
//!
//! The chain is read from the links, not from names: from `{app}-term[stream]` to the first element, from each
//! element to the `direction` module after it, and from that one's `down` port to the next element, until
//! `{app}-orig`, or the app's carrier `{app}-peer` (stacks/app-peer.toml) for an app whose flows go to a peer.
//! `service add` and `del` change it as one edit: the modules loaded or unloaded and the difference between the
//! chain's links before and after (`flexstack_modules::stream::services::chain_links_to`).

use crate::actions::control::{internal, Control};
use crate::dataplane::Snapshot;
use flexstack_api::ops::{AppInfo, Change, ServiceAdd, ServiceDel, ServiceDetail, ServiceInfo, Signalled, VarValue};
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_core::config::{LinkSpec, Settings};
use flexstack_core::Edit;
use flexstack_modules::stream::services::{chain_links_to, file};
use std::collections::BTreeMap;

/// An app's chain: its elements (services, or the `stream-pass` of an app without) and the `direction` module
/// after each, in order.
#[derive(Clone)]
struct Chain {
    term: String,
    orig: String,
    /// The carrier the chain ends in (its Down frames go there, its peer's Up frames come from there), if any.
    carrier: Option<String>,
    elements: Vec<String>,
    dirs: Vec<String>,
}

impl Chain {
    fn links(&self) -> Vec<String> {
        chain_links_to(&self.term, &self.orig, self.carrier.as_deref(), &self.elements, &self.dirs)
    }
}

fn not_found(what: String) -> ApiError {
    ApiError::new(ErrorCode::NotFound, what)
}

/// `a, b and c`, or `none`.
fn listing(names: &[String]) -> String {
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    }
}

impl Control {
    /// The attached app `name`; the error names the apps there are.
    fn app_named(&self, name: &str) -> Result<AppInfo, ApiError> {
        let apps = self.sandboxes.list();
        let names: Vec<String> = apps.iter().map(|a| a.name.clone()).collect();
        apps.into_iter()
            .find(|a| a.name == name)
            .ok_or_else(|| not_found(format!("no app {name:?}; running apps: {}", listing(&names))))
    }

    /// The app's chain of services, read from the links.
    fn chain_of(&self, app: &str, snap: &Snapshot) -> Result<Chain, ApiError> {
        let (term, orig) = (format!("{app}-term"), format!("{app}-orig"));
        let kind = |m: &str| snap.modules.iter().find(|x| x.name == m).map(|x| x.kind.as_str());
        let next = |from: &str, port: Option<&str>| {
            snap.edges.iter().find(|e| e.from == from && port.is_none_or(|p| e.from_port == p)).map(|e| e.to.clone())
        };
        let none = || {
            ApiError::new(
                ErrorCode::InvalidEdit,
                format!("app {app:?} has no chain of stream services (run it with --services)"),
            )
        };
        let peer = format!("{app}-peer");
        let mut at = next(&term, Some("stream")).ok_or_else(none)?;
        let mut chain = Chain { term, orig: orig.clone(), carrier: None, elements: Vec::new(), dirs: Vec::new() };
        while at != orig {
            if at == peer && kind(&peer) == Some("carrier") {
                chain.carrier = Some(peer);
                break;
            }
            let dir = snap
                .edges
                .iter()
                .find(|e| e.from == at && kind(&e.to) == Some("direction"))
                .map(|e| e.to.clone())
                .ok_or_else(none)?;
            let after = next(&dir, Some("down")).ok_or_else(none)?;
            chain.elements.push(std::mem::replace(&mut at, after));
            chain.dirs.push(dir);
            if chain.elements.len() > 1024 {
                return Err(internal(format!("app {app:?}: the chain of services loops")));
            }
        }
        Ok(chain)
    }

    /// The app's services in order.
    fn services_of(&self, app: &str, snap: &Snapshot) -> Result<Vec<ServiceInfo>, ApiError> {
        let kinds = file::kinds();
        let reg = self.registry.snapshot_for("module.");
        let prefix = format!("{app}-");
        let chain = match self.chain_of(app, snap) {
            Ok(c) => c,
            Err(e) if e.code == ErrorCode::InvalidEdit => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut out = Vec::new();
        for m in &chain.elements {
            let Some(spec) = snap.spec.modules.iter().find(|s| &s.name == m) else { continue };
            if !kinds.contains(&spec.kind.as_str()) {
                continue;
            }
            let var = |n: &str| reg.matching(&format!("module.{m}.{n}")).next().map(|(_, c)| c.get());
            let select = match spec.settings.get("select").map(|s| &s.value) {
                Some(toml::Value::Array(a)) => a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect(),
                _ => vec!["use *".to_string()],
            };
            out.push(ServiceInfo {
                name: m.strip_prefix(&prefix).unwrap_or(m).to_string(),
                module: m.clone(),
                kind: spec.kind.clone(),
                active: match var("active") {
                    Some(flexstack_core::Value::Bool(b)) => Some(b),
                    _ => None,
                },
                flows: var("selected_flows_active").and_then(|v| v.as_f64()).unwrap_or(0.0) as u64,
                select,
            });
        }
        Ok(out)
    }

    pub(super) fn service_list(&self, app: &str) -> Result<Vec<ServiceInfo>, ApiError> {
        self.app_named(app)?;
        let snap = self.dp().snapshot().map_err(internal)?;
        self.services_of(app, &snap)
    }

    /// The service `name` of the app; the error names the app's services.
    fn service_named(&self, app: &str, name: &str, snap: &Snapshot) -> Result<ServiceInfo, ApiError> {
        let services = self.services_of(app, snap)?;
        let names: Vec<String> = services.iter().map(|s| s.name.clone()).collect();
        services
            .into_iter()
            .find(|s| s.name == name || s.module == name)
            .ok_or_else(|| not_found(format!("app {app:?} has no service {name:?}; its services: {}", listing(&names))))
    }

    pub(super) fn service_show(&self, app: &str, name: &str) -> Result<ServiceDetail, ApiError> {
        self.app_named(app)?;
        let snap = self.dp().snapshot().map_err(internal)?;
        let service = self.service_named(app, name, &snap)?;
        let reg = self.registry.snapshot_for("module.");
        let vars: BTreeMap<String, VarValue> = reg
            .matching(&format!("module.{}.**", service.module))
            .map(|(n, c)| (n.to_string(), VarValue { value: c.get(), unit: c.spec().unit.clone() }))
            .collect();
        Ok(ServiceDetail { service, vars })
    }

    /// Applies the change from `before` to `after` (the same app's chain) with the module edits `modules` first.
    fn rechain(
        &self,
        who: &str,
        change: String,
        before: &Chain,
        after: &Chain,
        mut edits: Vec<Edit>,
    ) -> Result<Change, ApiError> {
        let (old, new) = (before.links(), after.links());
        let parse = |l: &String| LinkSpec::parse(l).map_err(|m| internal(format!("{l}: {m}")));
        for l in old.iter().filter(|l| !new.contains(l)) {
            edits.insert(0, Edit::Unlink(parse(l)?));
        }
        for l in new.iter().filter(|l| !old.contains(l)) {
            edits.push(Edit::Link(parse(l)?));
        }
        self.edit(who, change, edits)
    }

    pub(super) fn service_add(&self, add: ServiceAdd, who: &str) -> Result<Change, ApiError> {
        let ServiceAdd { app, kind, name, settings } = add;
        self.app_named(&app)?;
        if !file::kinds().contains(&self.kind_name(&kind).as_str()) {
            return Err(ApiError::new(
                ErrorCode::InvalidValue,
                format!("{kind:?} is not a service kind; the kinds: {}", file::kinds().join(", ")),
            ));
        }
        let snap = self.dp().snapshot().map_err(internal)?;
        let before = self.chain_of(&app, &snap)?;
        let name = name.unwrap_or_else(|| kind.clone());
        let (module, dir) = (format!("{app}-{name}"), format!("{app}-{name}-dir"));
        if let Some(m) = [&module, &dir].into_iter().find(|m| snap.modules.iter().any(|x| &x.name == *m)) {
            return Err(ApiError::new(ErrorCode::InvalidEdit, format!("module {m:?} exists: choose another name")));
        }
        let settings = super::module::settings_from_json(&settings)?;
        let builder = self.configure(&kind, &settings)?;
        let dir_builder = self.configure("direction", &Settings::default())?;
        let mut after = before.clone();
        after.elements.push(module.clone());
        after.dirs.push(dir.clone());
        let edits = vec![
            Edit::Load { name: module.clone(), kind: self.kind_name(&kind), settings, builder },
            Edit::Load { name: dir, kind: "direction".into(), settings: Settings::default(), builder: dir_builder },
        ];
        self.app_modules_changed([module.clone(), format!("{module}-dir")], true);
        let done = self.rechain(who, format!("service add {app} {name} ({kind})"), &before, &after, edits);
        if done.is_err() {
            self.app_modules_changed([module.clone(), format!("{module}-dir")], false);
        }
        done
    }

    pub(super) fn service_del(&self, del: ServiceDel, who: &str) -> Result<Change, ApiError> {
        let ServiceDel { app, name, force } = del;
        self.app_named(&app)?;
        let snap = self.dp().snapshot().map_err(internal)?;
        let service = self.service_named(&app, &name, &snap)?;
        if service.flows > 0 && !force {
            return Err(ApiError::new(
                ErrorCode::InvalidEdit,
                format!(
                    "service {name:?} of app {app:?} works on {} flow(s), which would lose what it keeps for them; \
                     wait for them to end, set its `active` knob to false first, or use --force",
                    service.flows
                ),
            ));
        }
        let before = self.chain_of(&app, &snap)?;
        if before.elements.len() == 1 {
            return Err(ApiError::new(
                ErrorCode::InvalidEdit,
                format!("{name:?} is app {app:?}'s only service; a chain needs one (add `null` first)"),
            ));
        }
        let i =
            before.elements.iter().position(|m| *m == service.module).ok_or_else(|| internal("not in the chain"))?;
        let mut after = before.clone();
        after.elements.remove(i);
        let dir = after.dirs.remove(i);
        let edits = vec![Edit::Unload { name: service.module.clone() }, Edit::Unload { name: dir.clone() }];
        let done = self.rechain(who, format!("service del {app} {name}"), &before, &after, edits);
        if done.is_ok() {
            self.app_modules_changed([service.module, dir], false);
        }
        done
    }

    /// The modules of the chains of services of the apps whose modules are `names` (those of `{app}-term`) that
    /// are not among them: the services `service add` loaded, with their `direction` modules.
    pub(super) fn services_added(&self, names: &[String], snap: &Snapshot) -> Vec<String> {
        let apps = names
            .iter()
            .filter_map(|n| n.strip_suffix("-term"))
            .filter(|app| snap.modules.iter().any(|m| m.name == format!("{app}-term") && m.kind == "terminate"));
        let chains = apps.filter_map(|app| self.chain_of(app, snap).ok());
        chains.flat_map(|c| c.elements.into_iter().chain(c.dirs)).filter(|m| !names.contains(m)).collect()
    }

    /// `app list`: the apps, with their processes.
    pub(super) fn apps_with_processes(&self) -> Vec<AppInfo> {
        let mut apps = self.sandboxes.list();
        for a in &mut apps {
            a.pids = processes(&a.cgroup);
        }
        apps
    }

    pub(super) fn app_signal(&self, name: &str, signal: &str) -> Result<Signalled, ApiError> {
        use nix::sys::signal::Signal;
        let app = self.app_named(name)?;
        let sig = match signal {
            "stop" => Signal::SIGSTOP,
            "continue" => Signal::SIGCONT,
            "kill" => Signal::SIGKILL,
            other => {
                return Err(ApiError::new(
                    ErrorCode::InvalidValue,
                    format!("signal {other:?}: expected stop, continue or kill"),
                ))
            }
        };
        if app.cgroup.is_empty() {
            return Err(ApiError::new(
                ErrorCode::InvalidEdit,
                format!("app {name:?} has no cgroup (no cgroup v2 here)"),
            ));
        }
        let pids = processes(&app.cgroup);
        for &pid in &pids {
            // A process that ended meanwhile is not an error.
            match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig) {
                Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
                Err(e) => return Err(internal(format!("{sig} to {pid}: {e}"))),
            }
        }
        Ok(Signalled { app: name.to_string(), signal: sig.as_str().to_string(), pids })
    }
}

/// The processes of a cgroup (`cgroup.procs`), none if it cannot be read.
fn processes(cgroup: &str) -> Vec<i32> {
    if cgroup.is_empty() {
        return Vec::new();
    }
    let procs = std::path::Path::new(cgroup).join("cgroup.procs");
    std::fs::read_to_string(procs)
        .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}
