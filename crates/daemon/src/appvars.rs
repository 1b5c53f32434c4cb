//! Application variables: applications register their own meters and knobs (`app.<name>.<var>`) over a
//! restricted socket, `STATE_DIR/apps.sock`, so that rules and the CLI can read and set them (CRAWLER's
//! application support; the C library is clients/c, the Python module clients/python).
//!
//! Why a second socket: the control socket is 0600 and owned by root, while applications run as the invoking
//! user. The app socket is 0666 (the state directory is 0711: reachable by name, not listable) and accepts only
//! the requests below; a client can touch nothing but the variables it registered itself, under the one name it
//! registered. Who registered is recorded from `SO_PEERCRED` (uid, pid) and shown by `app vars`.
//!
//! The protocol, JSON lines as on the control socket (docs/control-api.md, "Application variables"):
//! 1. `{"id":1,"op":"register","app":"voip","vars":[{"name":"loss","kind":"meter","type":"f64"},
//!    {"name":"cc","kind":"knob","type":"str","value":"cubic"}]}` — first, once per connection. The variables
//!    exist as long as the connection (a lease): they go when it closes.
//! 2. `{"id":2,"op":"update","name":"loss","value":0.02}` — the app stores a new value of one of its variables.
//! 3. A write to one of its knobs (`flexstack set app.voip.cc bbr`, or a rule) reaches the app as an event line
//!    `{"event":{"op":"set","serial":7,"name":"cc","value":"bbr","text":"bbr"}}`; the app answers
//!    `{"op":"ack","serial":7,"ok":true}` (or `"ok":false,"error":"why"`) within [`ACK_TIMEOUT`]. Only an
//!    accepted write changes the knob's value.
//!
//! How the parts are called: [`serve`] accepts connections (a thread each, see [`AppVars::connection`]);
//! [`AppVars::write`] is called by the daemon's `set` action for names under `app.`; [`AppVars::list`] by
//! `app_var_list`. Updates of meters are announced to the rules thread through the hook set with
//! [`AppVars::on_meter_change`].

use flexstack_api::ops::{AppVar, RegisteredApp};
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_core::vars::{DynamicVars, ModuleVars, VarCell, VarKind, VarSpec};
use flexstack_core::{SharedRegistry, Value, ValueType};
use serde::Deserialize;
use serde_json::{json, Value as Json};
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::Duration;

/// Name of the app socket inside the state directory.
pub const APP_SOCKET_NAME: &str = "apps.sock";
/// Most applications registered at once.
pub const MAX_APPS: usize = 32;
/// Most variables one application may register.
pub const MAX_VARS: usize = 64;
/// Longest line an application may send, in bytes.
pub const MAX_LINE: u64 = 64 * 1024;
/// Longest text value, in bytes.
pub const MAX_TEXT: usize = 4096;
/// How long a knob write waits for the application's acknowledgement.
pub const ACK_TIMEOUT: Duration = Duration::from_secs(1);

/// One variable as an application declares it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct VarDecl {
    name: String,
    kind: VarKind2,
    #[serde(rename = "type")]
    ty: ValueType,
    #[serde(default)]
    unit: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    value: Option<Json>,
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq)]
#[serde(rename_all = "lowercase")]
enum VarKind2 {
    Meter,
    Knob,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
enum AppRequest {
    Register {
        app: String,
        vars: Vec<VarDecl>,
    },
    Update {
        name: String,
        value: Json,
    },
    Ack {
        serial: u64,
        ok: bool,
        #[serde(default)]
        error: Option<String>,
    },
}

/// Told of every value an application stores (name, value).
pub type MeterHook = Box<dyn Fn(&str, &Value) + Send + Sync>;

type Pending = Arc<Mutex<HashMap<u64, mpsc::SyncSender<Result<(), String>>>>>;

struct App {
    uid: u32,
    pid: i32,
    vars: ModuleVars,
    writer: Arc<Mutex<UnixStream>>,
    pending: Pending,
}

/// The registered applications and their variables.
pub struct AppVars {
    dynamic: Mutex<DynamicVars>,
    registry: SharedRegistry,
    apps: Mutex<BTreeMap<String, App>>,
    serial: AtomicU64,
    on_meter: OnceLock<MeterHook>,
}

fn var_name_ok(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_')
}

/// A JSON value as a value of type `ty` (text is parsed as that type).
fn value_of(ty: ValueType, v: &Json) -> Result<Value, String> {
    let v = match v {
        Json::String(t) if t.len() > MAX_TEXT => return Err(format!("text longer than {MAX_TEXT} bytes")),
        Json::String(t) => Value::parse_as(ty, t)?,
        other => serde_json::from_value::<Value>(other.clone()).map_err(|e| e.to_string())?.coerce(ty)?,
    };
    Ok(v)
}

fn send_line(w: &Mutex<UnixStream>, v: &Json) -> bool {
    let mut line = v.to_string();
    line.push('\n');
    w.lock().map(|mut s| s.write_all(line.as_bytes()).is_ok()).unwrap_or(false)
}

impl AppVars {
    /// No applications yet; their variables go into `registry`.
    pub fn new(registry: SharedRegistry) -> AppVars {
        AppVars {
            dynamic: Mutex::new(DynamicVars::new(registry.clone())),
            registry,
            apps: Mutex::new(BTreeMap::new()),
            serial: AtomicU64::new(1),
            on_meter: OnceLock::new(),
        }
    }

    /// Sets the hook told of every update an application makes (the rules thread's push).
    pub fn on_meter_change(&self, hook: MeterHook) {
        let _ = self.on_meter.set(hook);
    }

    fn apps(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, App>> {
        self.apps.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// True if `name` (`app.<app>.<var>`) is a variable an application registered.
    pub fn owns(&self, name: &str) -> bool {
        let mut parts = name.splitn(3, '.');
        let (Some("app"), Some(app), Some(var)) = (parts.next(), parts.next(), parts.next()) else { return false };
        self.apps().get(app).is_some_and(|a| a.vars.cell(var).is_some())
    }

    /// The registered applications: name, uid, pid and variables.
    pub fn list(&self) -> Vec<RegisteredApp> {
        let apps = self.apps();
        let app = |(name, a): (&String, &App)| {
            let var = |c: &Arc<VarCell>| AppVar {
                name: format!("app.{name}.{}", c.spec().name),
                kind: c.spec().kind,
                ty: c.spec().ty,
                value: c.get(),
            };
            RegisteredApp { app: name.clone(), uid: a.uid, pid: a.pid, vars: a.vars.cells().iter().map(var).collect() }
        };
        apps.iter().map(app).collect()
    }

    /// Delivers a validated knob write to the application that owns `name` and waits for its answer; the knob
    /// takes the value only if the application accepts it.
    pub fn write(&self, name: &str, value: &Value) -> Result<(), ApiError> {
        let mut parts = name.splitn(3, '.');
        let (_, app, var) = (parts.next(), parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
        let (writer, pending, cell) = {
            let apps = self.apps();
            let a = apps
                .get(app)
                .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("no application registered as {app}")))?;
            let cell = a.vars.cell(var).cloned().ok_or_else(|| {
                ApiError::new(ErrorCode::NotFound, format!("application {app} has no variable {var}"))
            })?;
            (a.writer.clone(), a.pending.clone(), cell)
        };
        if cell.spec().kind != VarKind::Knob {
            return Err(ApiError::new(ErrorCode::InvalidValue, format!("{name} is a meter (read-only)")));
        }
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::sync_channel(1);
        pending.lock().unwrap_or_else(|p| p.into_inner()).insert(serial, tx);
        let event =
            json!({"event": {"op": "set", "serial": serial, "name": var, "value": value, "text": value.to_string()}});
        let outcome = if send_line(&writer, &event) {
            rx.recv_timeout(ACK_TIMEOUT).map_err(|_| {
                ApiError::new(
                    ErrorCode::AppTimeout,
                    format!(
                        "application {app} did not answer the write of {name} within {} ms",
                        ACK_TIMEOUT.as_millis()
                    ),
                )
            })
        } else {
            Err(ApiError::new(ErrorCode::AppTimeout, format!("application {app} is not reading its connection")))
        };
        pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&serial);
        match outcome? {
            Ok(()) => {
                cell.store(value);
                Ok(())
            }
            Err(why) => {
                Err(ApiError::new(ErrorCode::InvalidValue, format!("{name}: refused by application {app}: {why}")))
            }
        }
    }

    fn register(
        &self,
        app: &str,
        decls: &[VarDecl],
        uid: u32,
        pid: i32,
        writer: Arc<Mutex<UnixStream>>,
        pending: Pending,
    ) -> Result<Vec<String>, String> {
        if decls.is_empty() || decls.len() > MAX_VARS {
            return Err(format!("register 1 to {MAX_VARS} variables, got {}", decls.len()));
        }
        let mut specs = Vec::new();
        let mut initial = Vec::new();
        for d in decls {
            if !var_name_ok(&d.name) {
                return Err(format!("invalid variable name {:?}: expected 1-64 of a-z 0-9 _", d.name));
            }
            if specs.iter().any(|s: &VarSpec| s.name == d.name) {
                return Err(format!("variable {} declared twice", d.name));
            }
            if d.unit.len() > 64 || d.description.len() > 256 {
                return Err(format!("{}: unit at most 64 bytes, description at most 256", d.name));
            }
            let description = if d.description.is_empty() {
                format!("registered by application {app}")
            } else {
                d.description.clone()
            };
            specs.push(match d.kind {
                VarKind2::Meter => VarSpec::meter(&d.name, d.ty, &d.unit, &description),
                VarKind2::Knob => VarSpec::knob(&d.name, d.ty, &d.unit, &description),
            });
            if let Some(v) = &d.value {
                initial.push((d.name.clone(), value_of(d.ty, v).map_err(|e| format!("{}: {e}", d.name))?));
            }
        }
        let mut apps = self.apps();
        if apps.contains_key(app) {
            return Err(format!("an application named {app} is already registered"));
        }
        if apps.len() >= MAX_APPS {
            return Err(format!("at most {MAX_APPS} applications may register at once"));
        }
        let prefix = format!("app.{app}");
        if self.registry.snapshot().matching(&format!("{prefix}.**")).next().is_some() {
            return Err(format!("variables under {prefix}. exist already (a module registered them)"));
        }
        let vars = self.dynamic.lock().unwrap_or_else(|p| p.into_inner()).register(
            &format!("client:{app}"),
            &prefix,
            &specs,
        )?;
        for (name, v) in &initial {
            if let Some(c) = vars.cell(name) {
                c.store(v);
            }
        }
        let names = specs.iter().map(|s| format!("{prefix}.{}", s.name)).collect();
        apps.insert(app.to_string(), App { uid, pid, vars, writer, pending });
        Ok(names)
    }

    fn unregister(&self, app: &str) {
        if self.apps().remove(app).is_some() {
            self.dynamic
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .unregister(&format!("client:{app}"), &format!("app.{app}"));
            tracing::info!(app, "application variables removed (connection closed)");
        }
    }

    fn update(&self, app: &str, var: &str, value: &Json) -> Result<(), String> {
        let cell = self
            .apps()
            .get(app)
            .and_then(|a| a.vars.cell(var).cloned())
            .ok_or_else(|| format!("no variable {var} registered by {app}"))?;
        let v = value_of(cell.spec().ty, value)?;
        cell.store(&v);
        if let Some(hook) = self.on_meter.get() {
            hook(&format!("app.{app}.{var}"), &v);
        }
        Ok(())
    }

    /// Serves one application connection until it closes; its variables go with it.
    pub fn connection(&self, conn: UnixStream) {
        let (uid, pid) = match nix::sys::socket::getsockopt(&conn, nix::sys::socket::sockopt::PeerCredentials) {
            Ok(c) => (c.uid(), c.pid()),
            Err(_) => (u32::MAX, -1),
        };
        let _ = conn.set_write_timeout(Some(ACK_TIMEOUT));
        let Ok(read_half) = conn.try_clone() else { return };
        let writer = Arc::new(Mutex::new(conn));
        let pending: Pending = Arc::default();
        let mut reader = BufReader::new(read_half);
        let mut app: Option<String> = None;
        loop {
            let mut line = String::new();
            match reader.by_ref().take(MAX_LINE + 1).read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(n) if n as u64 > MAX_LINE => {
                    send_line(
                        &writer,
                        &json!({"ok": false, "error": {"code": "too_large", "message": format!("line longer than {MAX_LINE} bytes")}}),
                    );
                    break;
                }
                Ok(_) => {}
            }
            if line.trim().is_empty() {
                continue;
            }
            let mut value: Json = match serde_json::from_str(&line) {
                Ok(v) => v,
                Err(e) => {
                    send_line(
                        &writer,
                        &json!({"ok": false, "error": {"code": "invalid_json", "message": format!("invalid JSON: {e}")}}),
                    );
                    continue;
                }
            };
            let id = value.as_object_mut().and_then(|o| o.remove("id"));
            let reply = |r: Result<Json, (&str, String)>| {
                let mut out = match r {
                    Ok(result) => json!({"ok": true, "result": result}),
                    Err((code, message)) => json!({"ok": false, "error": {"code": code, "message": message}}),
                };
                if let Some(id) = &id {
                    out["id"] = id.clone();
                }
                send_line(&writer, &out)
            };
            let request = match serde_json::from_value::<AppRequest>(value) {
                Ok(r) => r,
                Err(e) => {
                    reply(Err(("invalid_request", format!("invalid request: {e}: expected register, update or ack"))));
                    continue;
                }
            };
            let ok = match (request, &app) {
                (AppRequest::Register { app: name, vars }, None) => {
                    match self.register(&name, &vars, uid, pid, writer.clone(), pending.clone()) {
                        Ok(names) => {
                            tracing::info!(app = %name, uid, pid, vars = names.len(), "application registered variables");
                            app = Some(name.clone());
                            reply(Ok(json!({"prefix": format!("app.{name}"), "vars": names})))
                        }
                        Err(e) => reply(Err(("invalid_request", e))),
                    }
                }
                (AppRequest::Register { .. }, Some(a)) => {
                    reply(Err(("invalid_request", format!("this connection registered {a} already"))))
                }
                (_, None) => reply(Err(("invalid_request", "register first".to_string()))),
                (AppRequest::Update { name, value }, Some(a)) => match self.update(a, &name, &value) {
                    Ok(()) => reply(Ok(json!({}))),
                    Err(e) => reply(Err(("invalid_value", e))),
                },
                (AppRequest::Ack { serial, ok, error }, Some(_)) => {
                    if let Some(tx) = pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&serial) {
                        let _ = tx.send(if ok { Ok(()) } else { Err(error.unwrap_or_else(|| "refused".into())) });
                    }
                    true
                }
            };
            if !ok {
                break;
            }
        }
        if let Some(a) = app {
            self.unregister(&a);
        }
    }
}

/// Accepts application connections on `listener`, a thread each, while fewer than [`MAX_APPS`] are open.
pub fn serve(listener: UnixListener, appvars: Arc<AppVars>) {
    let open = Arc::new(AtomicU64::new(0));
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        if open.load(Ordering::SeqCst) >= MAX_APPS as u64 {
            let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
            let msg = json!({"ok": false, "error": {"code": "busy", "message": format!("at most {MAX_APPS} application connections")}});
            let _ = conn.write_all(format!("{msg}\n").as_bytes());
            continue;
        }
        open.fetch_add(1, Ordering::SeqCst);
        let (appvars, open) = (appvars.clone(), open.clone());
        let spawned = std::thread::Builder::new().name("app-vars".into()).spawn(move || {
            appvars.connection(conn);
            open.fetch_sub(1, Ordering::SeqCst);
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start an application thread");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(s: &mut BufReader<UnixStream>, w: &mut UnixStream, line: Json) -> Json {
        w.write_all(format!("{line}\n").as_bytes()).unwrap();
        let mut out = String::new();
        s.read_line(&mut out).unwrap();
        serde_json::from_str(&out).unwrap()
    }

    #[test]
    fn register_update_write_and_lease() {
        let registry = SharedRegistry::default();
        let vars = Arc::new(AppVars::new(registry.clone()));
        let (mut client, server) = UnixStream::pair().unwrap();
        let v2 = vars.clone();
        let t = std::thread::spawn(move || v2.connection(server));
        let mut r = BufReader::new(client.try_clone().unwrap());
        let bad = request(&mut r, &mut client, json!({"op": "update", "name": "x", "value": 1}));
        assert_eq!(bad["error"]["message"], "register first");
        let reg = request(
            &mut r,
            &mut client,
            json!({"id": 1, "op": "register", "app": "voip", "vars": [
                {"name": "loss", "kind": "meter", "type": "f64"},
                {"name": "cc", "kind": "knob", "type": "str", "value": "cubic"}]}),
        );
        assert_eq!(reg["ok"], true, "{reg}");
        assert_eq!(reg["id"], 1);
        assert_eq!(registry.snapshot().get("app.voip.cc").unwrap().get(), Value::Str("cubic".into()));
        let up = request(&mut r, &mut client, json!({"op": "update", "name": "loss", "value": 0.25}));
        assert_eq!(up["ok"], true);
        assert_eq!(registry.snapshot().get("app.voip.loss").unwrap().get(), Value::F64(0.25));
        assert!(vars.owns("app.voip.cc") && !vars.owns("app.other.cc"));
        let bad = request(&mut r, &mut client, json!({"op": "update", "name": "nope", "value": 1}));
        assert_eq!(bad["error"]["code"], "invalid_value");

        // A write: the app refuses the first, accepts the second.
        let mut acks = vec![(false, "no such algorithm"), (true, "")].into_iter();
        let mut w2 = client.try_clone().unwrap();
        let answering = std::thread::spawn(move || {
            for _ in 0..2 {
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                let ev: Json = serde_json::from_str(&line).unwrap();
                assert_eq!(ev["event"]["name"], "cc");
                let (ok, why) = acks.next().unwrap();
                let ack = json!({"op": "ack", "serial": ev["event"]["serial"], "ok": ok, "error": why});
                w2.write_all(format!("{ack}\n").as_bytes()).unwrap();
            }
            r
        });
        let e = vars.write("app.voip.cc", &Value::Str("westwood".into())).unwrap_err();
        assert!(e.message.contains("no such algorithm"), "{}", e.message);
        assert_eq!(registry.snapshot().get("app.voip.cc").unwrap().get(), Value::Str("cubic".into()));
        vars.write("app.voip.cc", &Value::Str("bbr".into())).unwrap();
        assert_eq!(registry.snapshot().get("app.voip.cc").unwrap().get(), Value::Str("bbr".into()));
        assert_eq!(vars.write("app.voip.loss", &Value::F64(1.0)).unwrap_err().code, ErrorCode::InvalidValue);
        let r = answering.join().unwrap();

        // The lease: closing the connection (every handle of it) removes the variables.
        drop(r);
        drop(client);
        t.join().unwrap();
        assert!(registry.snapshot().get("app.voip.cc").is_none());
        assert_eq!(vars.list(), Vec::new());
    }

    #[test]
    fn registrations_are_limited_and_confined() {
        let registry = SharedRegistry::default();
        let vars = AppVars::new(registry);
        let (a, _b) = UnixStream::pair().unwrap();
        let w = Arc::new(Mutex::new(a));
        let decl = |name: &str| VarDecl {
            name: name.into(),
            kind: VarKind2::Meter,
            ty: ValueType::U64,
            unit: String::new(),
            description: String::new(),
            value: None,
        };
        let reg = |app: &str, d: &[VarDecl]| vars.register(app, d, 0, 0, w.clone(), Pending::default());
        assert!(reg("Bad Name", &[decl("x")]).is_err());
        assert!(reg("ok", &[decl("a.b")]).unwrap_err().contains("invalid variable name"));
        assert!(reg("ok", &[]).is_err());
        let many: Vec<VarDecl> = (0..=MAX_VARS).map(|i| decl(&format!("v{i}"))).collect();
        assert!(reg("ok", &many).unwrap_err().contains("1 to 64"));
        assert!(reg("ok", &[decl("x"), decl("x")]).unwrap_err().contains("twice"));
        reg("ok", &[decl("x")]).unwrap();
        assert!(reg("ok", &[decl("y")]).unwrap_err().contains("already registered"));
    }
}
