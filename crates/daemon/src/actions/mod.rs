//! One action function per control operation, grouped by the object it acts on. The socket server calls them for
//! every client; the CLI reaches them only through the socket, so the CLI and the API cannot drift apart.
//!
//! - `control`: the control plane's state and `Control::edit`, the one way the stack changes: edits are validated
//!   and committed by the data plane between batches, and each accepted change is recorded as a numbered
//!   [`Revision`] (`revisions`) holding the whole stack description.
//! - one file per object: `module`, `link`, `var` (get, set, watch, var list), `config` (revisions, rollback),
//!   `tap`, `app` (sandboxed apps, applications' variables), `rules`, `runtime` (status, show runtime, pause,
//!   resume), `flow` (flows read from the registry), `peer` (this daemon's key and its peers), `service` (an
//!   app's stream services while it runs, signals to its processes).
//! - [`Control::handle`] (here) dispatches a request to its action.

mod app;
mod config;
mod control;
mod flow;
mod link;
mod module;
mod peer;
mod persist;
mod persist_state;
mod revisions;
mod rules;
mod runtime;
mod service;
mod tap;
mod var;

pub(crate) use control::internal;
pub use control::{Caller, Control};
pub use flow::Tuple;
pub(crate) use flow::{app_of, handling, Publisher};
pub use persist::{open_journal, Found, Restored};
pub use revisions::{Revision, RevisionLog};

use crate::journal::RulesOp;
use flexstack_api::ops::*;
use flexstack_api::protocol::{ApiError, Call, ErrorCode, Request};
use serde_json::Value as Json;

/// An action's result as the JSON sent on the wire. `C` is the request: its [`Call::Response`] is the type the
/// action must return, so the daemon and its clients agree on every result's type.
fn reply<C: Call>(result: Result<C::Response, ApiError>) -> Result<Json, ApiError> {
    result.and_then(|r| serde_json::to_value(r).map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string())))
}

impl Control {
    /// Runs one request (all but `watch`, which streams: see [`Control::watch`], and the app lease requests,
    /// which hold their connection: see the server) and returns its result as JSON.
    pub fn handle(&self, request: Request, caller: &Caller) -> Result<Json, ApiError> {
        let who = caller.user.as_str();
        match request {
            Request::Status => reply::<Status>(self.status()),
            Request::ModuleList => reply::<ModuleList>(self.module_list()),
            Request::ModuleKinds => reply::<ModuleKinds>(self.module_kinds()),
            Request::ModuleLoad(r) => reply::<ModuleLoad>(self.module_load(r, who)),
            Request::ModuleUnload(r) => reply::<ModuleUnload>(self.module_unload(r.name, who)),
            Request::ModuleReplace(r) => reply::<ModuleReplace>(self.module_replace(r, who)),
            Request::ModuleExec(r) => reply::<ModuleExec>(self.module_exec(r)),
            Request::LinkList => reply::<LinkList>(self.link_list()),
            Request::LinkAdd(r) => reply::<LinkAdd>(self.link_add(&r.link, who)),
            Request::LinkDel(r) => reply::<LinkDel>(self.link_del(&r.link, who)),
            Request::Pause(r) => reply::<Pause>(self.pause(r.module)),
            Request::Resume(r) => reply::<Resume>(self.resume(r.module)),
            Request::Get(r) => reply::<Get>(self.get(&r.names)),
            Request::Set(r) => reply::<Set>(self.set(&r.name, &r.value, who)),
            Request::Watch(_) => Err(ApiError::new(ErrorCode::InvalidRequest, "watch streams; use Control::watch")),
            Request::AppAttach(_) | Request::AppDetach => Err(ApiError::new(
                ErrorCode::InvalidRequest,
                "app_attach holds its connection as a lease; see the server",
            )),
            Request::AppList => reply::<AppList>(self.app_list()),
            Request::AppSignal(r) => reply::<AppSignal>(self.app_signal(&r.name, &r.signal)),
            Request::ServiceList(r) => reply::<ServiceList>(self.service_list(&r.app)),
            Request::ServiceShow(r) => reply::<ServiceShow>(self.service_show(&r.app, &r.name)),
            Request::ServiceAdd(r) => reply::<ServiceAdd>(self.service_add(r, who)),
            Request::ServiceDel(r) => reply::<ServiceDel>(self.service_del(r, who)),
            Request::AppVarList => reply::<AppVarList>(self.app_var_list()),
            Request::TapAdd(r) => reply::<TapAdd>(self.tap_add(r, who)),
            Request::TapDel(r) => reply::<TapDel>(self.tap_del(r.name, who)),
            Request::TapList => reply::<TapList>(self.tap_list()),
            Request::ShowRuntime => reply::<ShowRuntime>(self.show_runtime()),
            Request::VarList(r) => reply::<VarList>(self.var_list(r.pattern.as_deref())),
            Request::ConfigLog => reply::<ConfigLog>(self.config_log()),
            Request::ConfigShow(r) => reply::<ConfigShow>(self.config_show(r.rev)),
            Request::ConfigRollback(r) => reply::<ConfigRollback>(self.config_rollback(r.rev, who)),
            Request::RulesLoad(r) => reply::<RulesLoad>(self.rules_load(r.name, r.text, who)),
            Request::RulesUnload(r) => reply::<RulesUnload>(self.rules_revision(RulesOp::Unload { names: r.names })),
            Request::RulesDelete(r) => reply::<RulesDelete>(self.rules_delete(r.names, who)),
            Request::RulesReplace(r) => {
                reply::<RulesReplace>(self.rules_revision(RulesOp::Replace { old: r.old, new: r.new }))
            }
            Request::RulesList => reply::<RulesList>(self.rules().and_then(|s| s.list())),
            Request::RulesShow(r) => reply::<RulesShow>(self.rules().and_then(|s| s.show(r.name))),
            Request::RulesLog => reply::<RulesLog>(self.rules().and_then(|s| s.log())),
            Request::RulesDiff(r) => reply::<RulesDiff>(self.rules().and_then(|s| s.diff(r.from, r.to))),
            Request::FlowList => reply::<FlowList>(self.flows()),
            Request::FlowShow(r) => reply::<FlowShow>(self.flow_show(&r.flow)),
            Request::RulesRollback(r) => {
                reply::<RulesRollback>(self.rules_revision(RulesOp::Rollback { revision: r.rev }))
            }
            Request::PeerKey => reply::<PeerKey>(self.peer_key()),
            Request::PeerAdd(r) => reply::<PeerAdd>(self.peer_add(r)),
            Request::PeerDel(r) => reply::<PeerDel>(self.peer_del(&r.name)),
            Request::PeerShow(r) => reply::<PeerShow>(self.peer_show(&r.name)),
            Request::PeerList => reply::<PeerList>(self.peer_list()),
        }
    }
}
