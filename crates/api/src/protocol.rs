//! The control protocol: JSON lines over the daemon's unix socket (see docs/control-api.md).
//!
//! Each request is one JSON object on one line: `{"id": 7, "op": "link_add", "link": "a -> b"}`. `id` is optional
//! and echoed back. Each response is one line: `{"id": 7, "ok": true, "result": ...}` or
//! `{"id": 7, "ok": false, "error": {"code": "invalid_edit", "message": "..."}}`. A `watch` request answers with
//! a stream of `{"id": 7, "ok": true, "event": {...}}` lines until the client closes the connection or the
//! requested number of samples has been sent. The CLI is a client of exactly this protocol.

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

/// Longest request line accepted, in bytes; longer ones get `too_large` and the connection is closed.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

/// A request to the daemon.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Daemon facts: version, pid, revision, uptime.
    Status,
    /// Loaded modules with kind, state and per-port counters.
    ModuleList,
    /// Module kinds the daemon can load.
    ModuleKinds,
    /// Loads a module.
    ModuleLoad {
        /// Unique name.
        name: String,
        /// Kind.
        kind: String,
        /// Settings (`{"rate": 5}`).
        #[serde(default)]
        settings: serde_json::Map<String, Json>,
    },
    /// Unloads a module and its links.
    ModuleUnload {
        /// The module.
        name: String,
    },
    /// Replaces a module by a new one of the given kind and settings, keeping links (and state unless `fresh`).
    ModuleReplace {
        /// The module.
        name: String,
        /// Kind of the new module.
        kind: String,
        /// Settings of the new module.
        #[serde(default)]
        settings: serde_json::Map<String, Json>,
        /// Start the new module with fresh state instead of the old one's.
        #[serde(default)]
        fresh: bool,
    },
    /// Runs a module's procedure through an `Exec` control frame sent by the control plane.
    ModuleExec {
        /// The module.
        name: String,
        /// The procedure.
        procedure: String,
        /// Its argument (default null = false).
        #[serde(default)]
        argument: Option<Json>,
    },
    /// The links, as written and resolved.
    LinkList,
    /// Adds links (`"a[p] -> b, c"`).
    LinkAdd {
        /// The link text.
        link: String,
    },
    /// Removes links.
    LinkDel {
        /// The link text.
        link: String,
    },
    /// Holds frames at a module (or the whole stack).
    Pause {
        /// The module; absent for the whole stack.
        #[serde(default)]
        module: Option<String>,
    },
    /// Resumes a module (or the whole stack).
    Resume {
        /// The module; absent for the whole stack.
        #[serde(default)]
        module: Option<String>,
    },
    /// Reads variables by name or wildcard pattern.
    Get {
        /// Names or patterns.
        names: Vec<String>,
    },
    /// Writes a knob.
    Set {
        /// Full knob name (`module.sel.select`).
        name: String,
        /// The value: JSON of the knob's type, or text parsed as that type.
        value: Json,
    },
    /// Streams values: every `interval_ms`, all of them or (with `changes`) those that changed.
    Watch {
        /// Names or patterns.
        names: Vec<String>,
        /// Sampling interval in milliseconds (default 1000, at least 10).
        #[serde(default)]
        interval_ms: Option<u64>,
        /// Send only values that changed since the last event.
        #[serde(default)]
        changes: bool,
        /// Stop after this many events.
        #[serde(default)]
        count: Option<u64>,
    },
    /// Per-module calls, frames, frames per call and nanoseconds per frame.
    ShowRuntime,
    /// Declared meters and knobs, optionally filtered by a pattern.
    VarList {
        /// Pattern (`module.*.frames_*`).
        #[serde(default)]
        pattern: Option<String>,
    },
    /// Attaches a sandboxed app: creates its namespace, devices and modules. The connection is the app's lease:
    /// the app is detached when the client sends `app_detach` on it or the connection closes.
    AppAttach {
        /// App name (default `appN`).
        #[serde(default)]
        name: Option<String>,
        /// User the app will run as (recorded).
        #[serde(default)]
        uid: u32,
        /// The app's stack template (default: stacks/app-default.toml).
        #[serde(default)]
        stack: Option<String>,
    },
    /// Ends the lease of the app attached on this connection.
    AppDetach,
    /// The sandboxed apps.
    AppList,
    /// Records the frames of a link to a pcapng file: loads a tap as one more receiver of the link's sender port.
    TapAdd {
        /// The link (`"a -> b"` or `"a[port]"`): frames leaving that port are recorded.
        link: String,
        /// The pcapng file (absolute path).
        file: String,
    },
    /// Removes a tap added with `tap_add`.
    TapDel {
        /// The tap's module name.
        name: String,
    },
    /// The taps: module name, file, tapped port, frames written.
    TapList,
    /// The revision log.
    ConfigLog,
    /// A revision's stack description as TOML; the live stack when `rev` is absent.
    ConfigShow {
        /// Revision number.
        #[serde(default)]
        rev: Option<u64>,
    },
    /// Returns the stack to revision `rev` (a new revision records the rollback).
    ConfigRollback {
        /// Revision number.
        rev: u64,
    },
    /// Checks and loads a rule text (docs/rules.md); errors carry `name:line:column`.
    RulesLoad {
        /// Where the text came from (the file name), used in messages and `rules list`.
        name: String,
        /// The rule text.
        text: String,
    },
    /// Unloads rules loaded by themselves (`["ALL"]`: every rule).
    RulesUnload {
        /// Rule names.
        names: Vec<String>,
    },
    /// Replaces rule `old` by rule `new` wherever it is used.
    RulesReplace {
        /// The rule replaced.
        old: String,
        /// The rule that takes its place.
        new: String,
    },
    /// Every defined rule.
    RulesList,
    /// A rule's text, commands and live unit graph (each unit's value and state).
    RulesShow {
        /// The rule.
        name: String,
    },
    /// The rules repository's revisions and the rules' recent notices.
    RulesLog,
    /// The commands added and removed between two rules revisions.
    RulesDiff {
        /// The older revision.
        from: u64,
        /// The newer revision.
        to: u64,
    },
    /// Switches the rules to an earlier revision (a new revision records it).
    RulesRollback {
        /// Revision number.
        rev: u64,
    },
    /// The applications' registered variables (`app.<name>.*`), with the registering process.
    AppVarList,
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
    /// A success.
    pub fn ok(id: Option<Json>, result: Json) -> Response {
        Response { id, ok: true, result: Some(result), event: None, error: None }
    }

    /// A failure.
    pub fn err(id: Option<Json>, error: ApiError) -> Response {
        Response { id, ok: false, result: None, event: None, error: Some(error) }
    }

    /// A watch event.
    pub fn event(id: Option<Json>, event: Json) -> Response {
        Response { id, ok: true, result: None, event: Some(event), error: None }
    }

    /// The response as one line of JSON, with the newline.
    pub fn to_line(&self) -> String {
        let mut s = serde_json::to_string(self).unwrap_or_else(|_| r#"{"ok":false}"#.to_string());
        s.push('\n');
        s
    }
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
        let r = Request::LinkAdd { link: "a -> b".into() };
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
