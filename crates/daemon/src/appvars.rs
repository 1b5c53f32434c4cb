//! Application variables: applications register their own meters and knobs (`app.<name>.<var>`) over a
//! restricted socket, `STATE_DIR/apps.sock`, so that rules and the CLI can read and set them (CRAWLER's
//! application support; the C library is clients/c, the Python module clients/python).
//!
//! Why a second socket: the control socket is 0600 and owned by root, while applications run as the invoking
//! user. The app socket is 0666 (the state directory is 0711: reachable by name, not listable) and accepts only
//! the requests below; a client can touch nothing but the variables it registered itself, under the one name it
//! registered. Who registered is recorded from `SO_PEERCRED` (uid, pid) and shown by `app vars`.
//!
//! Against a hostile local user ([`AppSocketOptions`]): each uid may hold only so many connections ([`serve`]),
//! a connection must register within a deadline and is closed when silent for the idle timeout (it is pinged
//! at half of it), a name stays bound to the uid that first registered it, and `--app-socket-group` restricts
//! the socket to a group (mode 0660).
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
//! 4. A registered connection silent for half the idle timeout gets `{"event":{"op":"ping","serial":8}}`, answered
//!    by an `ack` like a write.
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
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Name of the app socket inside the state directory.
pub const APP_SOCKET_NAME: &str = "apps.sock";
/// Most application connections open at once (connections of the daemon's own uid, root, are not counted).
pub const MAX_APPS: usize = 32;
/// Most application names one uid may hold (registered now or earlier: a name stays bound to its uid).
pub const MAX_NAMES_PER_UID: usize = 64;
/// Most variables one application may register.
pub const MAX_VARS: usize = 64;
/// Longest line an application may send, in bytes.
pub const MAX_LINE: u64 = 64 * 1024;
/// Longest text value, in bytes.
pub const MAX_TEXT: usize = 4096;
/// How long a knob write waits for the application's acknowledgement.
pub const ACK_TIMEOUT: Duration = Duration::from_secs(1);

/// The limits of the app socket (`flexstack daemon --app-*`).
#[derive(Clone, Debug)]
pub struct AppSocketOptions {
    /// Time a connection has, from its start, to register (it is closed otherwise).
    pub register_timeout: Duration,
    /// Time a registered connection may stay silent: after half of it the daemon sends a `ping` event, which
    /// the libraries answer with an `ack`; a connection that sent no line for all of it is closed.
    pub idle_timeout: Duration,
    /// Most connections open at once per uid (`SO_PEERCRED`), so one user cannot take every slot.
    pub max_per_uid: usize,
    /// The group the socket is restricted to (mode 0660, owned by that group); none: mode 0666.
    pub group: Option<String>,
}

impl Default for AppSocketOptions {
    fn default() -> AppSocketOptions {
        AppSocketOptions {
            register_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            max_per_uid: 8,
            group: None,
        }
    }
}

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
    /// Each name ever registered and the uid it is bound to: another uid cannot take it (root can).
    owners: Mutex<HashMap<String, u32>>,
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
            owners: Mutex::new(HashMap::new()),
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
        let mut owners = self.owners.lock().unwrap_or_else(|p| p.into_inner());
        match owners.get(app) {
            Some(&owner) if owner != uid && uid != 0 => {
                return Err(format!(
                    "the name {app} is bound to uid {owner}, which registered it first; uid {uid} cannot take it"
                ))
            }
            Some(_) => {}
            None if owners.values().filter(|&&o| o == uid).count() >= MAX_NAMES_PER_UID => {
                return Err(format!("uid {uid} holds {MAX_NAMES_PER_UID} application names already"));
            }
            None => {}
        }
        if uid != 0 && apps.values().filter(|a| a.uid != 0).count() >= MAX_APPS {
            return Err(format!("at most {MAX_APPS} applications may register at once"));
        }
        let prefix = format!("app.{app}");
        let pattern = format!("{prefix}.**");
        if self.registry.snapshot_for(&pattern).matching(&pattern).next().is_some() {
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
        owners.insert(app.to_string(), uid);
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

    /// Serves one application connection until it closes, fails to register within
    /// [`AppSocketOptions::register_timeout`], or stays silent for [`AppSocketOptions::idle_timeout`] (a ping
    /// event is sent at half of it); its variables go with it.
    pub fn connection(&self, conn: UnixStream, opts: &AppSocketOptions) {
        let (uid, pid) = peer(&conn);
        let _ = conn.set_write_timeout(Some(ACK_TIMEOUT));
        let Ok(read_half) = conn.try_clone() else { return };
        let mut c = Conn { uid, pid, writer: Arc::new(Mutex::new(conn)), pending: Arc::default(), app: None };
        let mut reader = BufReader::new(read_half);
        let started = Instant::now();
        let mut last_line = started;
        let mut pinged = false;
        let mut line = Vec::new();
        loop {
            let now = Instant::now();
            let (deadline, why) = match &c.app {
                None => (started + opts.register_timeout, "registered"),
                Some(_) => (last_line + opts.idle_timeout, "sent a line"),
            };
            if now >= deadline {
                let limit = if c.app.is_none() { opts.register_timeout } else { opts.idle_timeout };
                let message = format!("closed: the application has not {why} within {} ms", limit.as_millis());
                tracing::info!(app = ?c.app, uid, pid, "{message}");
                send_line(&c.writer, &json!({"ok": false, "error": {"code": "timeout", "message": message}}));
                break;
            }
            let ping_at = last_line + opts.idle_timeout / 2;
            if c.app.is_some() && !pinged && now >= ping_at {
                let serial = self.serial.fetch_add(1, Ordering::Relaxed);
                pinged = true;
                if !send_line(&c.writer, &json!({"event": {"op": "ping", "serial": serial}})) {
                    break;
                }
            }
            let wake = if c.app.is_some() && !pinged { ping_at.min(deadline) } else { deadline };
            let _ = reader.get_ref().set_read_timeout(Some(wake.saturating_duration_since(now).max(MIN_WAIT)));
            let room = (MAX_LINE + 1).saturating_sub(line.len() as u64);
            match reader.by_ref().take(room).read_until(b'\n', &mut line) {
                Ok(0) => break,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {
                    continue
                }
                Err(_) => break,
                Ok(_) if line.len() as u64 > MAX_LINE => {
                    send_line(
                        &c.writer,
                        &json!({"ok": false, "error": {"code": "too_large", "message": format!("line longer than {MAX_LINE} bytes")}}),
                    );
                    break;
                }
                Ok(_) => {}
            }
            last_line = Instant::now();
            pinged = false;
            let text = String::from_utf8_lossy(&line).into_owned();
            line.clear();
            if let Some(reply) = self.handle_line(&mut c, &text) {
                if !send_line(&c.writer, &reply) {
                    break;
                }
            }
        }
        if let Some(a) = c.app {
            self.unregister(&a);
        }
    }

    /// The response to one line from an application (none for an `ack` or an empty line).
    fn handle_line(&self, c: &mut Conn, line: &str) -> Option<Json> {
        if line.trim().is_empty() {
            return None;
        }
        let mut value: Json = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(e) => {
                return Some(
                    json!({"ok": false, "error": {"code": "invalid_json", "message": format!("invalid JSON: {e}")}}),
                )
            }
        };
        let id = value.as_object_mut().and_then(|o| o.remove("id"));
        let result = match serde_json::from_value::<AppRequest>(value) {
            Err(e) => Err(("invalid_request", format!("invalid request: {e}: expected register, update or ack"))),
            Ok(AppRequest::Register { app: name, vars }) => match &c.app {
                Some(a) => Err(("invalid_request", format!("this connection registered {a} already"))),
                None => match self.register(&name, &vars, c.uid, c.pid, c.writer.clone(), c.pending.clone()) {
                    Ok(names) => {
                        let (uid, pid) = (c.uid, c.pid);
                        tracing::info!(app = %name, uid, pid, vars = names.len(), "application registered variables");
                        c.app = Some(name.clone());
                        Ok(json!({"prefix": format!("app.{name}"), "vars": names}))
                    }
                    Err(e) => Err(("invalid_request", e)),
                },
            },
            Ok(_) if c.app.is_none() => Err(("invalid_request", "register first".to_string())),
            Ok(AppRequest::Update { name, value }) => {
                match self.update(c.app.as_deref().unwrap_or_default(), &name, &value) {
                    Ok(()) => Ok(json!({})),
                    Err(e) => Err(("invalid_value", e)),
                }
            }
            Ok(AppRequest::Ack { serial, ok, error }) => {
                if let Some(tx) = c.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&serial) {
                    let _ = tx.send(if ok { Ok(()) } else { Err(error.unwrap_or_else(|| "refused".into())) });
                }
                return None;
            }
        };
        let mut out = match result {
            Ok(result) => json!({"ok": true, "result": result}),
            Err((code, message)) => json!({"ok": false, "error": {"code": code, "message": message}}),
        };
        if let Some(id) = id {
            out["id"] = id;
        }
        Some(out)
    }
}

/// The shortest read wait: a deadline just passed is checked on the next turn, not spun on.
const MIN_WAIT: Duration = Duration::from_millis(1);

/// One application connection's state.
struct Conn {
    uid: u32,
    pid: i32,
    writer: Arc<Mutex<UnixStream>>,
    pending: Pending,
    app: Option<String>,
}

/// The peer's uid and pid (`SO_PEERCRED`); unknown peers count as uid `u32::MAX`.
fn peer(conn: &UnixStream) -> (u32, i32) {
    match nix::sys::socket::getsockopt(conn, nix::sys::socket::sockopt::PeerCredentials) {
        Ok(c) => (c.uid(), c.pid()),
        Err(_) => (u32::MAX, -1),
    }
}

/// Refuses a connection with a `busy` line.
fn refuse(mut conn: UnixStream, message: String) {
    let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
    let msg = json!({"ok": false, "error": {"code": "busy", "message": message}});
    let _ = conn.write_all(format!("{msg}\n").as_bytes());
}

/// Accepts application connections on `listener`, a thread each: at most [`MAX_APPS`] of other uids than the
/// daemon's, and at most [`AppSocketOptions::max_per_uid`] of each uid.
pub fn serve(listener: UnixListener, appvars: Arc<AppVars>, opts: AppSocketOptions) {
    let own_uid = nix::unistd::geteuid().as_raw();
    let open: Arc<Mutex<HashMap<u32, usize>>> = Arc::default();
    let opts = Arc::new(opts);
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let (uid, _) = peer(&conn);
        {
            let mut open = open.lock().unwrap_or_else(|p| p.into_inner());
            let mine = open.get(&uid).copied().unwrap_or(0);
            let others: usize = open.iter().filter(|(&u, _)| u != own_uid).map(|(_, n)| n).sum();
            if mine >= opts.max_per_uid {
                refuse(
                    conn,
                    format!("uid {uid} has {mine} application connections open (at most {})", opts.max_per_uid),
                );
                continue;
            }
            if uid != own_uid && others >= MAX_APPS {
                refuse(conn, format!("at most {MAX_APPS} application connections"));
                continue;
            }
            *open.entry(uid).or_default() += 1;
        }
        let (appvars, open2, opts) = (appvars.clone(), open.clone(), opts.clone());
        let spawned = std::thread::Builder::new().name("app-vars".into()).spawn(move || {
            appvars.connection(conn, &opts);
            let mut open = open2.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = open.get_mut(&uid) {
                *n -= 1;
                if *n == 0 {
                    open.remove(&uid);
                }
            }
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start an application thread");
            let mut open = open.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = open.get_mut(&uid) {
                *n = n.saturating_sub(1);
            }
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
        let t = std::thread::spawn(move || v2.connection(server, &AppSocketOptions::default()));
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

        // A name stays bound to the uid that registered it first, after its application is gone; root may take it.
        let as_uid = |uid: u32, app: &str| vars.register(app, &[decl("x")], uid, 0, w.clone(), Pending::default());
        as_uid(1000, "voip").unwrap();
        vars.unregister("voip");
        assert!(as_uid(1001, "voip").unwrap_err().contains("bound to uid 1000"), "another uid took the name");
        as_uid(1000, "voip").unwrap();
        vars.unregister("voip");
        as_uid(0, "voip").unwrap();
        vars.unregister("voip");
        assert!(as_uid(1000, "voip").unwrap_err().contains("bound to uid 0"));
        for i in 0..MAX_NAMES_PER_UID {
            as_uid(1000, &format!("n{i}")).unwrap();
            vars.unregister(&format!("n{i}"));
        }
        assert!(as_uid(1000, "onemore").unwrap_err().contains("holds 64 application names"));
    }
}
