//! `flexstack daemon --web ADDR`: one page, served by the daemon, that shows the running stack live (docs/web.md).
//!
//! - `GET /` (and `/app.js`, `/style.css`): the page; its assets are compiled in (`include_str!`), so it works
//!   offline. Hand-written JS and SVG, no framework.
//! - `GET /api/state`: one [`State`] as JSON; `GET /api/events`: the same, pushed as Server-Sent Events every
//!   [`WebOptions::interval`] (and at once after a write from the page). One publisher thread builds each state
//!   for every reader; the number of readers is capped ([`WebOptions::max_streams`]) and a reader too slow to take
//!   an event within the write timeout is dropped by the HTTP server ([`crate::http`]).
//! - `POST /api/call`: one request of the control API (the JSON of docs/control-api.md, the same the unix socket
//!   takes), run by [`Control::handle`], the one dispatch behind the socket server too. Requests that change
//!   something (rollback, knob set, link edit, tap add ...) need the token (header `X-Flexstack-Token`): without
//!   it the answer is 403 and the page is read-only.
//! - `GET /api/tap?name=TAP`: the pcapng file of a tap the daemon has loaded (token needed: it holds packets).
//!
//! The token is made at start-up from /dev/urandom, printed, and written to `web.token` in the state directory
//! (mode 0600).

use crate::actions::{Caller, Control};
use crate::http::{Handler, Limits, Reject, Request as HttpRequest, Response, Server, Stats};
use flexstack_api::ops::*;
use flexstack_api::protocol::{parse_request, ApiError, Call, ErrorCode, Request, Response as ApiResponse};
use serde::Serialize;
use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const INDEX_HTML: &str = include_str!("index.html");
const APP_JS: &str = include_str!("app.js");
const STYLE_CSS: &str = include_str!("style.css");

/// Rows a state carries at most, per table: the page's DOM stays bounded however large the stack is.
pub const MAX_FLOWS: usize = 50;
/// Revisions a state carries (the latest).
pub const MAX_REVISIONS: usize = 20;
/// Rows of `show runtime` and of the drop counters (those with most frames, most drops).
pub const MAX_RUNTIME_ROWS: usize = 60;
/// Rules shown with their units' values (the first ones by name).
pub const MAX_RULES: usize = 20;
/// Apps, taps: the first ones.
pub const MAX_ROWS: usize = 50;

/// What `--web` asked for.
#[derive(Clone, Debug)]
pub struct WebOptions {
    /// Address to listen on.
    pub addr: SocketAddr,
    /// Listen on an address other than loopback (`--web-public`).
    pub public: bool,
    /// Time between two states pushed to the page.
    pub interval: Duration,
    /// Event streams served at once.
    pub max_streams: usize,
    /// The state directory: the token file goes there, and the taps added from the page write under `web-taps/`.
    pub state_dir: PathBuf,
}

impl WebOptions {
    /// The default options for `addr`.
    pub fn new(addr: SocketAddr, public: bool, state_dir: PathBuf) -> WebOptions {
        WebOptions { addr, public, interval: Duration::from_millis(500), max_streams: 8, state_dir }
    }

    /// Refuses an address other than loopback unless `public` (checked before the daemon starts anything).
    pub fn check(&self) -> Result<(), String> {
        if !self.addr.ip().is_loopback() && !self.public {
            return Err(format!(
                "--web {}: not a loopback address; anyone who reaches it sees the whole stack (add --web-public \
                 to mean it; writes still need the token)",
                self.addr
            ));
        }
        Ok(())
    }
}

/// A drop counter: `module.<module>.drop_<reason>_total`.
#[derive(Clone, Debug, Serialize)]
pub struct DropCount {
    /// The module.
    pub module: String,
    /// The reason.
    pub reason: String,
    /// Frames dropped.
    pub frames: u64,
}

/// Everything the page shows, read through the control API at one instant. Tables are capped (the consts
/// above); each `*_count` is the whole number.
#[derive(Clone, Debug, Serialize)]
pub struct State {
    /// Milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// `status`.
    pub status: DaemonStatus,
    /// `module list`: every module (the graph's boxes).
    pub modules: Vec<ModuleInfo>,
    /// `link list`: every link (the graph's arrows).
    pub links: Links,
    /// `show runtime`, the modules with most frames.
    pub runtime: Vec<RuntimeInfo>,
    /// Drop counters by reason, the largest, non-zero only.
    pub drops: Vec<DropCount>,
    /// `flow list`, the flows with most bytes.
    pub flows: Vec<FlowInfo>,
    /// Flows in all.
    pub flow_count: usize,
    /// `config log`, the latest revisions, newest first.
    pub revisions: Vec<RevisionInfo>,
    /// Revisions in all.
    pub revision_count: usize,
    /// `rules show` of the first rules (their units with values); an error text if the rules cannot be read.
    pub rules: Result<Vec<RuleInfo>, String>,
    /// Rules in all.
    pub rule_count: usize,
    /// `app list`.
    pub apps: Vec<AppInfo>,
    /// `tap list`.
    pub taps: Vec<TapInfo>,
    /// Where a tap added from the page writes its file.
    pub tap_dir: String,
}

/// The caller the page's requests run as (in the revision log: `web`).
fn web_caller() -> Caller {
    Caller { user: "web".into(), pid: None }
}

/// Runs one typed request through the control API's dispatch.
fn call<C: Call>(control: &Control, op: C) -> Result<C::Response, ApiError> {
    let json = control.handle(op.into(), &web_caller())?;
    serde_json::from_value(json).map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))
}

/// The largest `n` of `rows` by `key`, in that order.
fn top<T>(mut rows: Vec<T>, n: usize, key: impl Fn(&T) -> u64) -> Vec<T> {
    rows.sort_by_key(|r| std::cmp::Reverse(key(r)));
    rows.truncate(n);
    rows
}

/// Reads the whole [`State`].
pub fn read_state(control: &Control, tap_dir: &Path) -> Result<State, ApiError> {
    let status = call(control, Status)?;
    let modules = call(control, ModuleList)?;
    let links = call(control, LinkList)?;
    let runtime = top(call(control, ShowRuntime)?, MAX_RUNTIME_ROWS, |r| r.frames);
    let drop_vars = call(control, VarList { pattern: Some("module.*.drop_*_total".into()) })?;
    let drops = drop_vars.into_iter().filter_map(|v| {
        let rest = v.spec.name.strip_prefix("module.")?;
        let (module, meter) = rest.split_once('.')?;
        let reason = meter.strip_prefix("drop_")?.strip_suffix("_total")?;
        let frames = match v.value {
            flexstack_core::Value::U64(n) if n > 0 => n,
            _ => return None,
        };
        Some(DropCount { module: module.into(), reason: reason.into(), frames })
    });
    let drops = top(drops.collect(), MAX_RUNTIME_ROWS, |d| d.frames);
    let flows = call(control, FlowList)?;
    let flow_count = flows.len();
    let bytes = |f: &FlowInfo| f.bytes_down.unwrap_or(0).saturating_add(f.bytes_up.unwrap_or(0));
    let flows = top(flows, MAX_FLOWS, bytes);
    let mut revisions = call(control, ConfigLog)?;
    let revision_count = revisions.len();
    revisions.reverse();
    revisions.truncate(MAX_REVISIONS);
    let (rules, rule_count) = match call(control, RulesList) {
        Ok(list) => {
            let n = list.len();
            let shown = list.into_iter().take(MAX_RULES).map(|r| call(control, RulesShow { name: r.name }));
            (shown.collect::<Result<Vec<_>, _>>().map_err(|e| e.message), n)
        }
        Err(e) => (Err(e.message), 0),
    };
    let mut apps = call(control, AppList)?;
    apps.truncate(MAX_ROWS);
    let mut taps = call(control, TapList)?;
    taps.truncate(MAX_ROWS);
    let time_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis());
    Ok(State {
        time_ms: time_ms as u64,
        status,
        modules,
        links,
        runtime,
        drops,
        flows,
        flow_count,
        revisions,
        revision_count,
        rules,
        rule_count,
        apps,
        taps,
        tap_dir: tap_dir.display().to_string(),
    })
}

/// True for the requests that only read: the page may send them without the token.
pub fn reads_only(request: &Request) -> bool {
    matches!(
        request,
        Request::Status
            | Request::ModuleList
            | Request::ModuleKinds
            | Request::LinkList
            | Request::Get(_)
            | Request::AppList
            | Request::AppVarList
            | Request::TapList
            | Request::ShowRuntime
            | Request::VarList(_)
            | Request::ConfigLog
            | Request::ConfigShow(_)
            | Request::RulesList
            | Request::RulesShow(_)
            | Request::RulesLog
            | Request::RulesDiff(_)
            | Request::FlowList
            | Request::FlowShow(_)
            | Request::PeerKey
            | Request::PeerShow(_)
            | Request::PeerList
            | Request::ServiceList(_)
            | Request::ServiceShow(_)
    )
}

/// The latest state, as the JSON pushed to readers, numbered.
struct Hub {
    latest: Mutex<(u64, Arc<String>)>,
    changed: Condvar,
    streams: AtomicUsize,
}

impl Hub {
    /// Waits (at most `timeout`) for a state newer than `seen`.
    fn newer(&self, seen: u64, timeout: Duration) -> (u64, Arc<String>) {
        let guard = self.latest.lock().unwrap_or_else(|p| p.into_inner());
        let (guard, _) =
            self.changed.wait_timeout_while(guard, timeout, |(seq, _)| *seq <= seen).unwrap_or_else(|p| p.into_inner());
        guard.clone()
    }

    fn publish(&self, json: String) {
        let mut guard = self.latest.lock().unwrap_or_else(|p| p.into_inner());
        guard.0 += 1;
        guard.1 = Arc::new(json);
        self.changed.notify_all();
    }
}

/// Counts a stream while it runs.
struct StreamSlot(Arc<Hub>);

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.streams.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The state as JSON, or the error as a JSON object `{"error": ...}`.
fn state_json(control: &Control, tap_dir: &Path) -> String {
    match read_state(control, tap_dir) {
        Ok(s) => {
            serde_json::to_string(&s).unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }).to_string())
        }
        Err(e) => serde_json::json!({ "error": e.message }).to_string(),
    }
}

/// Builds a state every `interval` while someone reads the stream (or at once when kicked).
fn publish_loop(control: Arc<Control>, hub: Arc<Hub>, tap_dir: PathBuf, interval: Duration, kicks: Receiver<()>) {
    loop {
        match kicks.recv_timeout(interval) {
            Ok(()) | Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        if hub.streams.load(Ordering::SeqCst) > 0 {
            hub.publish(state_json(&control, &tap_dir));
        }
    }
}

/// A fresh random token: 32 hex digits from /dev/urandom.
fn new_token() -> Result<String, String> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| format!("--web: cannot read /dev/urandom for the token: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes the token to `path`, readable by its owner only.
fn write_token(path: &Path, token: &str) -> Result<(), String> {
    use std::io::Write;
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| format!("{}: cannot write the web token: {e}", path.display()))?;
    writeln!(f, "{token}").map_err(|e| format!("{}: cannot write the web token: {e}", path.display()))
}

/// Compares without stopping at the first difference.
fn same_token(given: Option<&str>, token: &str) -> bool {
    let Some(given) = given else { return false };
    given.len() == token.len() && given.bytes().zip(token.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// The running web view: its server, its token, where the token is written.
pub struct Web {
    server: Server,
    /// The token writes need.
    pub token: String,
    /// The file holding it.
    pub token_file: PathBuf,
}

impl Web {
    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }

    /// The page's address with the token (in the fragment: the browser keeps it, it is never sent in a URL).
    pub fn url_with_token(&self) -> String {
        format!("http://{}/#token={}", self.addr(), self.token)
    }
}

fn json_response(body: String) -> Response {
    Response::Whole {
        status: "200 OK",
        content_type: "application/json".into(),
        headers: vec![("Cache-Control", "no-store".into())],
        body: body.into_bytes(),
    }
}

fn asset(content_type: &str, body: &'static str) -> Response {
    Response::Whole {
        status: "200 OK",
        content_type: content_type.into(),
        headers: vec![
            // Everything is the daemon's own: no script or style from elsewhere, no framing.
            (
                "Content-Security-Policy",
                "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'".into(),
            ),
            ("X-Content-Type-Options", "nosniff".into()),
        ],
        body: body.as_bytes().to_vec(),
    }
}

/// What the server needs to answer.
struct Routes {
    control: Arc<Control>,
    hub: Arc<Hub>,
    token: String,
    tap_dir: PathBuf,
    kick: SyncSender<()>,
    max_streams: usize,
}

impl Routes {
    fn answer(&self, r: &HttpRequest) -> Result<Response, Reject> {
        let get = matches!(r.method.as_str(), "GET" | "HEAD");
        match (r.path.as_str(), get, r.method == "POST") {
            ("/" | "/index.html", true, _) => Ok(asset("text/html; charset=utf-8", INDEX_HTML)),
            ("/app.js", true, _) => Ok(asset("text/javascript; charset=utf-8", APP_JS)),
            ("/style.css", true, _) => Ok(asset("text/css; charset=utf-8", STYLE_CSS)),
            ("/api/state", true, _) => Ok(json_response(state_json(&self.control, &self.tap_dir))),
            ("/api/events", true, _) => self.events(),
            ("/api/auth", true, _) => Ok(json_response(
                serde_json::json!({ "write": same_token(r.header("x-flexstack-token"), &self.token) }).to_string(),
            )),
            ("/api/call", _, true) => self.call(r),
            ("/api/tap", true, _) => self.tap_file(r),
            ("/" | "/index.html" | "/app.js" | "/style.css" | "/api/state" | "/api/events" | "/api/auth", ..)
            | ("/api/call" | "/api/tap", ..) => Err(Reject::Method),
            _ => Err(Reject::NotFound),
        }
    }

    fn events(&self) -> Result<Response, Reject> {
        let hub = self.hub.clone();
        if hub.streams.fetch_add(1, Ordering::SeqCst) >= self.max_streams {
            hub.streams.fetch_sub(1, Ordering::SeqCst);
            return Err(Reject::Busy);
        }
        let slot = StreamSlot(hub.clone());
        let _ = self.kick.try_send(());
        Ok(Response::Stream {
            content_type: "text/event-stream",
            writer: Box::new(move |w| {
                let _slot = slot;
                // The first event is the one the kick above asks for, not an old one.
                let mut seen = hub.latest.lock().unwrap_or_else(|p| p.into_inner()).0;
                loop {
                    let (seq, json) = hub.newer(seen, Duration::from_secs(10));
                    let written = if seq == seen {
                        w.write_all(b": idle\n\n")
                    } else {
                        seen = seq;
                        w.write_all(format!("event: state\nid: {seq}\ndata: {json}\n\n").as_bytes())
                    };
                    if written.and_then(|()| w.flush()).is_err() {
                        return;
                    }
                }
            }),
        })
    }

    fn call(&self, r: &HttpRequest) -> Result<Response, Reject> {
        let text = std::str::from_utf8(&r.body).map_err(|_| Reject::Malformed)?;
        let (id, request) = parse_request(text);
        let request = match request {
            Ok(q) => q,
            Err(e) => return Ok(json_response(ApiResponse::err(id, e).to_line())),
        };
        if !reads_only(&request) && !same_token(r.header("x-flexstack-token"), &self.token) {
            return Err(Reject::Forbidden);
        }
        let writes = !reads_only(&request);
        let answer = match self.control.handle(request, &web_caller()) {
            Ok(result) => ApiResponse::ok(id, &result),
            Err(e) => ApiResponse::err(id, e),
        };
        if writes {
            // The page sees its change at once, not at the next tick.
            let _ = self.kick.try_send(());
        }
        Ok(json_response(answer.to_line()))
    }

    fn tap_file(&self, r: &HttpRequest) -> Result<Response, Reject> {
        if !same_token(r.header("x-flexstack-token"), &self.token) {
            return Err(Reject::Forbidden);
        }
        let name = r.query.split('&').find_map(|kv| kv.strip_prefix("name=")).ok_or(Reject::NotFound)?;
        let taps = call(&self.control, TapList).map_err(|_| Reject::Internal)?;
        let file = taps.into_iter().find(|t| t.name == name).and_then(|t| t.file).ok_or(Reject::NotFound)?;
        let body = std::fs::read(&file).map_err(|_| Reject::NotFound)?;
        Ok(Response::Whole {
            status: "200 OK",
            content_type: "application/vnd.tcpdump.pcap".into(),
            headers: vec![("Content-Disposition", format!("attachment; filename=\"{name}.pcapng\""))],
            body,
        })
    }
}

/// Starts the web view (after [`WebOptions::check`]): writes the token file, starts the publisher thread and
/// the server.
pub fn serve(control: Arc<Control>, opts: &WebOptions) -> Result<Web, String> {
    opts.check()?;
    let token = new_token()?;
    let token_file = opts.state_dir.join("web.token");
    write_token(&token_file, &token)?;
    let tap_dir = opts.state_dir.join("web-taps");
    std::fs::create_dir_all(&tap_dir).map_err(|e| format!("{}: cannot create: {e}", tap_dir.display()))?;
    let hub =
        Arc::new(Hub { latest: Mutex::new((0, Arc::new(String::new()))), changed: Condvar::new(), streams: 0.into() });
    let (kick, kicks) = std::sync::mpsc::sync_channel(1);
    let (c, h, t, interval) = (control.clone(), hub.clone(), tap_dir.clone(), opts.interval);
    std::thread::Builder::new()
        .name("web-publish".into())
        .spawn(move || publish_loop(c, h, t, interval, kicks))
        .map_err(|e| format!("cannot start the web thread: {e}"))?;
    let routes =
        Routes { control: control.clone(), hub, token: token.clone(), tap_dir, kick, max_streams: opts.max_streams };
    let handler: Handler = Box::new(move |r| routes.answer(r));
    // Room for the event streams and the page's own requests; a request body is one control request.
    let limits = Limits {
        max_body: 64 * 1024,
        max_connections: opts.max_streams + 24,
        write_timeout: Duration::from_secs(3),
        ..Limits::default()
    };
    let started = Instant::now();
    let server = Server::start("web", opts.addr, limits, Arc::new(Stats::default()), handler)?;
    let web = Web { server, token, token_file };
    control.served_at("web", web.addr());
    tracing::info!(addr = %web.addr(), token_file = %web.token_file.display(), ms = started.elapsed().as_millis() as u64, "web view served");
    println!("flexstack web view: {}", web.url_with_token());
    Ok(web)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_unless_public() {
        let o = |addr: &str, public| WebOptions::new(addr.parse().unwrap(), public, PathBuf::from("/x"));
        assert!(o("127.0.0.1:8080", false).check().is_ok());
        assert!(o("0.0.0.0:8080", false).check().unwrap_err().contains("--web-public"));
        assert!(o("0.0.0.0:8080", true).check().is_ok());
    }

    #[test]
    fn reads_need_no_token_and_writes_do() {
        let q = |text: &str| parse_request(text).1.unwrap();
        for read in [r#"{"op":"module_list"}"#, r#"{"op":"config_show","rev":1}"#, r#"{"op":"flow_list"}"#] {
            assert!(reads_only(&q(read)), "{read}");
        }
        for write in [
            r#"{"op":"config_rollback","rev":1}"#,
            r#"{"op":"link_add","link":"a -> b"}"#,
            r#"{"op":"set","name":"module.a.x","value":1}"#,
            r#"{"op":"tap_add","link":"a -> b","file":"/tmp/x.pcapng"}"#,
            r#"{"op":"pause"}"#,
        ] {
            assert!(!reads_only(&q(write)), "{write}");
        }
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same_token(Some("abcd"), "abcd"));
        assert!(!same_token(Some("abce"), "abcd"));
        assert!(!same_token(Some("abc"), "abcd"));
        assert!(!same_token(None, "abcd"));
    }

    #[test]
    fn the_token_file_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("web.token");
        let token = new_token().unwrap();
        assert_eq!(token.len(), 32);
        assert_ne!(token, new_token().unwrap());
        write_token(&path, &token).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_to_string(&path).unwrap().trim(), token);
    }

    #[test]
    fn the_page_loads_only_its_own_assets() {
        for (name, text) in [("index.html", INDEX_HTML), ("app.js", APP_JS), ("style.css", STYLE_CSS)] {
            // The SVG namespace is a name, not an address anything is fetched from.
            let text = text.replace("\"http://www.w3.org/2000/svg\"", "");
            for far in ["http://", "https://", "//cdn", "@import"] {
                assert!(!text.contains(far), "{name} names {far}");
            }
        }
        assert!(INDEX_HTML.contains("app.js") && INDEX_HTML.contains("style.css"));
    }
}
