//! The control protocol: JSON lines over the daemon's unix socket (see docs/control-api.md).
//!
//! Each request is one JSON object on one line: `{"id": 7, "op": "link_add", "link": "a -> b"}`. `id` is optional
//! and echoed back. Each response is one line: `{"id": 7, "ok": true, "result": ...}` or
//! `{"id": 7, "ok": false, "error": {"code": "invalid_edit", "message": "..."}}`. A `watch` request answers with
//! a stream of `{"id": 7, "ok": true, "event": {...}}` lines until the client closes the connection or the
//! requested number of samples has been sent. The CLI is a client of exactly this protocol.

use crate::ops::*;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

/// Longest request line accepted, in bytes; longer ones get `too_large` and the connection is closed.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

/// A request to the daemon: one of the operations of [`crate::ops`], tagged by `op` on the wire. Requests with
/// fields hold the operation's struct; those without are unit variants (extra fields are ignored there).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Daemon facts: version, pid, revision, uptime ([`Status`]).
    Status,
    /// Loaded modules with kind, state and per-port counters ([`ModuleList`]).
    ModuleList,
    /// Module kinds the daemon can load ([`ModuleKinds`]).
    ModuleKinds,
    /// Loads a module.
    ModuleLoad(ModuleLoad),
    /// Unloads a module and its links.
    ModuleUnload(ModuleUnload),
    /// Replaces a module, keeping its links (and state unless `fresh`).
    ModuleReplace(ModuleReplace),
    /// Runs a module's procedure through an `Exec` control frame sent by the control plane.
    ModuleExec(ModuleExec),
    /// The links, as written and resolved ([`LinkList`]).
    LinkList,
    /// Adds links (`"a[p] -> b, c"`).
    LinkAdd(LinkAdd),
    /// Removes links.
    LinkDel(LinkDel),
    /// Holds frames at a module (or the whole stack).
    Pause(Pause),
    /// Resumes a module (or the whole stack).
    Resume(Resume),
    /// Reads variables by name or wildcard pattern.
    Get(Get),
    /// Writes a knob.
    Set(Set),
    /// Streams values: every `interval_ms`, all of them or (with `changes`) those that changed.
    Watch(Watch),
    /// Per-module calls, frames, frames per call and nanoseconds per frame ([`ShowRuntime`]).
    ShowRuntime,
    /// Declared meters and knobs, optionally filtered by a pattern.
    VarList(VarList),
    /// Attaches a sandboxed app; the connection is the app's lease.
    AppAttach(AppAttach),
    /// Ends the lease of the app attached on this connection ([`AppDetach`]).
    AppDetach,
    /// The sandboxed apps ([`AppList`]).
    AppList,
    /// Records the frames of a link to a pcapng file.
    TapAdd(TapAdd),
    /// Removes a tap added with `tap_add`.
    TapDel(TapDel),
    /// The taps ([`TapList`]).
    TapList,
    /// The revision log ([`ConfigLog`]).
    ConfigLog,
    /// A revision's stack description as TOML; the live stack when `rev` is absent.
    ConfigShow(ConfigShow),
    /// Returns the stack to a revision.
    ConfigRollback(ConfigRollback),
    /// Checks and loads a rule text (docs/rules.md).
    RulesLoad(RulesLoad),
    /// Unloads rules loaded by themselves.
    RulesUnload(RulesUnload),
    /// Deletes rule definitions.
    RulesDelete(RulesDelete),
    /// Replaces a rule by another wherever it is used.
    RulesReplace(RulesReplace),
    /// Every defined rule ([`RulesList`]).
    RulesList,
    /// A rule's text, commands and live unit graph.
    RulesShow(RulesShow),
    /// The rules repository's revisions and the rules' recent notices ([`RulesLog`]).
    RulesLog,
    /// The commands added and removed between two rules revisions.
    RulesDiff(RulesDiff),
    /// Switches the rules to an earlier revision.
    RulesRollback(RulesRollback),
    /// The applications' registered variables, with the registering process ([`AppVarList`]).
    AppVarList,
    /// The flows, forwarded and terminated ([`FlowList`]).
    FlowList,
    /// One flow with all its variables.
    FlowShow(FlowShow),
    /// This daemon's peer identity ([`PeerKey`]).
    PeerKey,
    /// Adds a peer (docs/peers.md).
    PeerAdd(PeerAdd),
    /// Forgets a peer.
    PeerDel(PeerDel),
    /// One peer.
    PeerShow(PeerShow),
    /// The peers ([`PeerList`]).
    PeerList,
    /// An app's services ([`ServiceInfo`]).
    ServiceList(ServiceList),
    /// One service of an app with its variables.
    ServiceShow(ServiceShow),
    /// Adds a service to a running app's chain.
    ServiceAdd(ServiceAdd),
    /// Removes a service from a running app's chain.
    ServiceDel(ServiceDel),
    /// Signals every process of a sandboxed app: stop, continue, kill.
    AppSignal(AppSignal),
}

/// A request whose result has a type: [`Client::call`](crate::Client::call) sends it and decodes the result as
/// its `Response`, and the daemon's action for it returns a `Response`. Implemented by every operation but
/// [`Watch`], which streams (`Client::watch`).
pub trait Call: Into<Request> {
    /// The result the daemon answers with.
    type Response: Serialize + DeserializeOwned;
}

/// Declares the result of each operation: `Op => Response` for a unit variant of [`Request`], `Op(..) =>
/// Response` for a variant holding the operation's fields.
macro_rules! calls {
    ($($op:ident $(($fields:tt))? => $response:ty;)*) => {$(
        impl From<$op> for Request {
            fn from(_op: $op) -> Request {
                calls!(@variant $op _op $($fields)?)
            }
        }

        impl Call for $op {
            type Response = $response;
        }
    )*};
    (@variant $op:ident $value:ident) => { Request::$op };
    (@variant $op:ident $value:ident ..) => { Request::$op($value) };
}

calls! {
    Status => DaemonStatus;
    ModuleList => Vec<ModuleInfo>;
    ModuleKinds => Vec<KindInfo>;
    ModuleLoad(..) => Change;
    ModuleUnload(..) => Change;
    ModuleReplace(..) => Change;
    ModuleExec(..) => ExecResult;
    LinkList => Links;
    LinkAdd(..) => Change;
    LinkDel(..) => Change;
    Pause(..) => Notes;
    Resume(..) => Notes;
    Get(..) => Values;
    Set(..) => SetResult;
    ShowRuntime => Vec<RuntimeInfo>;
    VarList(..) => Vec<VarInfo>;
    AppAttach(..) => AppInfo;
    AppDetach => Detached;
    AppList => Vec<AppInfo>;
    TapAdd(..) => TapAdded;
    TapDel(..) => Change;
    TapList => Vec<TapInfo>;
    ConfigLog => Vec<RevisionInfo>;
    ConfigShow(..) => RevisionStack;
    ConfigRollback(..) => Change;
    RulesLoad(..) => RulesLoaded;
    RulesUnload(..) => RulesRevision;
    RulesDelete(..) => RulesRevision;
    RulesReplace(..) => RulesRevision;
    RulesList => Vec<RuleSummary>;
    RulesShow(..) => RuleInfo;
    RulesLog => RulesHistory;
    RulesDiff(..) => Vec<String>;
    RulesRollback(..) => RulesRevision;
    AppVarList => Vec<RegisteredApp>;
    FlowList => Vec<FlowInfo>;
    FlowShow(..) => FlowDetail;
    PeerKey => PeerKeyInfo;
    PeerAdd(..) => PeerInfo;
    PeerDel(..) => PeerInfo;
    PeerShow(..) => PeerInfo;
    PeerList => Vec<PeerInfo>;
    ServiceList(..) => Vec<ServiceInfo>;
    ServiceShow(..) => ServiceDetail;
    ServiceAdd(..) => Change;
    ServiceDel(..) => Change;
    AppSignal(..) => Signalled;
}

impl From<Watch> for Request {
    fn from(w: Watch) -> Request {
        Request::Watch(w)
    }
}

/// Machine-readable error codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The line is not JSON.
    InvalidJson,
    /// JSON, but not a known request or with wrong fields.
    InvalidRequest,
    /// The request line is longer than [`MAX_REQUEST_BYTES`].
    TooLarge,
    /// No complete request arrived in time.
    Timeout,
    /// Too many clients are connected.
    Busy,
    /// A named module, variable or revision does not exist.
    NotFound,
    /// A value has the wrong type or range.
    InvalidValue,
    /// Settings or a stack description are wrong.
    ConfigError,
    /// An edit was refused (nothing changed).
    InvalidEdit,
    /// A rule text has errors (each `name:line:column: error: ...`); nothing changed.
    InvalidRules,
    /// An application did not answer a knob write in time.
    AppTimeout,
    /// A cap refused the request (rule instances, rules memory); the message names it and how to raise it; nothing
    /// changed.
    LimitReached,
    /// Something failed inside the daemon.
    Internal,
}

/// An error as sent to clients.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// The code.
    pub code: ErrorCode,
    /// What went wrong and what was expected.
    pub message: String,
}

impl ApiError {
    /// An error with `code` and `message`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError { code, message: message.into() }
    }
}

/// One response line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Response {
    /// The request's id, if it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<Json>,
    /// True on success.
    pub ok: bool,
    /// The result of a successful request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Json>,
    /// One event of a `watch` stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<Json>,
    /// The error of a failed request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ApiError>,
}

impl Response {
    /// A success with `result`, as JSON (keys sorted); a result that cannot be encoded is an `internal` error.
    pub fn ok(id: Option<Json>, result: &impl Serialize) -> Response {
        match serde_json::to_value(result) {
            Ok(result) => Response { id, ok: true, result: Some(result), event: None, error: None },
            Err(e) => Response::err(id, unencodable(e)),
        }
    }

    /// A failure.
    pub fn err(id: Option<Json>, error: ApiError) -> Response {
        Response { id, ok: false, result: None, event: None, error: Some(error) }
    }

    /// A watch event ([`WatchEvent`]), as JSON.
    pub fn event(id: Option<Json>, event: &impl Serialize) -> Response {
        match serde_json::to_value(event) {
            Ok(event) => Response { id, ok: true, result: None, event: Some(event), error: None },
            Err(e) => Response::err(id, unencodable(e)),
        }
    }

    /// The response as one line of JSON, with the newline.
    pub fn to_line(&self) -> String {
        let mut s = serde_json::to_string(self).unwrap_or_else(|_| r#"{"ok":false}"#.to_string());
        s.push('\n');
        s
    }
}

fn unencodable(e: serde_json::Error) -> ApiError {
    ApiError::new(ErrorCode::Internal, format!("cannot encode the result: {e}"))
}

/// Parses one request line into its id and request, or the error to send back.
pub fn parse_request(line: &str) -> (Option<Json>, Result<Request, ApiError>) {
    let mut value: Json = match serde_json::from_str(line) {
        Ok(v) => v,
        Err(e) => return (None, Err(ApiError::new(ErrorCode::InvalidJson, format!("invalid JSON: {e}")))),
    };
    let Some(obj) = value.as_object_mut() else {
        return (
            None,
            Err(ApiError::new(ErrorCode::InvalidRequest, "expected a JSON object like {\"op\": \"status\"}")),
        );
    };
    let id = obj.remove("id");
    let request = serde_json::from_value::<Request>(value)
        .map_err(|e| ApiError::new(ErrorCode::InvalidRequest, format!("invalid request: {e}")));
    (id, request)
}

/// The request as one line of JSON with `id`, with the newline.
pub fn request_line(id: u64, request: &Request) -> String {
    let mut v = serde_json::to_value(request).unwrap_or(Json::Null);
    if let Some(obj) = v.as_object_mut() {
        obj.insert("id".into(), Json::from(id));
    }
    let mut s = v.to_string();
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_with_id() {
        let r = Request::from(LinkAdd { link: "a -> b".into() });
        let line = request_line(7, &r);
        let (id, parsed) = parse_request(line.trim());
        assert_eq!(id, Some(Json::from(7)));
        assert_eq!(parsed.unwrap(), r);
    }

    #[test]
    fn bad_requests_are_classified() {
        assert_eq!(parse_request("{nope").1.unwrap_err().code, ErrorCode::InvalidJson);
        assert_eq!(parse_request("[1]").1.unwrap_err().code, ErrorCode::InvalidRequest);
        assert_eq!(parse_request(r#"{"op":"launch"}"#).1.unwrap_err().code, ErrorCode::InvalidRequest);
        let e = parse_request(r#"{"op":"link_add","link":"a -> b","extra":1}"#).1.unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidRequest);
        assert!(e.message.contains("extra"), "{}", e.message);
        assert_eq!(parse_request(r#"{"op":"status"}"#).1.unwrap(), Request::Status);
    }
}
