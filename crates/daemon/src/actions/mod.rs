//! One action function per control operation, grouped by the object it acts on. The socket server calls them for
//! every client; the CLI reaches them only through the socket, so the CLI and the API cannot drift apart.
//!
//! - `control`: the control plane's state and `Control::edit`, the one way the stack changes: edits are validated
//!   and committed by the data plane between batches, and each accepted change is recorded as a numbered
//!   [`Revision`] (`revisions`) holding the whole stack description.
//! - one file per object: `module`, `link`, `var` (get, set, watch, var list), `config` (revisions, rollback),
//!   `tap`, `app` (sandboxed apps, applications' variables), `rules`, `runtime` (status, show runtime, pause,
//!   resume).
//! - [`Control::handle`] (here) dispatches a request to its action.

mod app;
mod config;
mod control;
mod link;
mod module;
mod revisions;
mod rules;
mod runtime;
mod tap;
mod var;

pub use control::{Caller, Control};
pub use revisions::{Revision, RevisionLog};

use flexstack_api::ops::*;
use flexstack_api::protocol::{ApiError, ErrorCode, Request};
use serde_json::Value as Json;

impl Control {
    /// Runs one request (all but `watch`, which streams: see [`Control::watch`], and the app lease requests,
    /// which hold their connection: see the server).
    pub fn handle(&self, request: Request, caller: &Caller) -> Result<Json, ApiError> {
        let who = caller.user.as_str();
        match request {
            Request::Status => self.status(),
            Request::ModuleList => self.module_list(),
            Request::ModuleKinds => self.module_kinds(),
            Request::ModuleLoad(ModuleLoad { name, kind, settings }) => self.module_load(name, kind, &settings, who),
            Request::ModuleUnload(ModuleUnload { name }) => self.module_unload(name, who),
            Request::ModuleReplace(ModuleReplace { name, kind, settings, fresh }) => {
                self.module_replace(name, kind, &settings, fresh, who)
            }
            Request::ModuleExec(ModuleExec { name, procedure, argument }) => self.exec(&name, &procedure, argument),
            Request::LinkList => self.link_list(),
            Request::LinkAdd(LinkAdd { link }) => self.link_add(&link, who),
            Request::LinkDel(LinkDel { link }) => self.link_del(&link, who),
            Request::Pause(Pause { module }) => self.pause(module),
            Request::Resume(Resume { module }) => self.resume(module),
            Request::Get(Get { names }) => self.get(&names),
            Request::Set(Set { name, value }) => self.set(&name, &value, who),
            Request::Watch(_) => Err(ApiError::new(ErrorCode::InvalidRequest, "watch streams; use Control::watch")),
            Request::AppAttach(_) | Request::AppDetach => Err(ApiError::new(
                ErrorCode::InvalidRequest,
                "app_attach holds its connection as a lease; see the server",
            )),
            Request::AppList => self.app_list(),
            Request::AppVarList => self.app_var_list(),
            Request::TapAdd(TapAdd { link, file }) => self.tap_add(&link, &file, who),
            Request::TapDel(TapDel { name }) => self.tap_del(name, who),
            Request::TapList => self.tap_list(),
            Request::ShowRuntime => self.show_runtime(),
            Request::VarList(VarList { pattern }) => self.var_list(pattern.as_deref()),
            Request::ConfigLog => self.config_log(),
            Request::ConfigShow(ConfigShow { rev }) => self.config_show(rev),
            Request::ConfigRollback(ConfigRollback { rev }) => self.rollback(rev, who),
            Request::RulesLoad(RulesLoad { name, text }) => self.rules_load(name, text, who),
            Request::RulesUnload(RulesUnload { names }) => self.rules()?.unload(names),
            Request::RulesReplace(RulesReplace { old, new }) => self.rules()?.replace(old, new),
            Request::RulesList => self.rules()?.list(),
            Request::RulesShow(RulesShow { name }) => self.rules()?.show(name),
            Request::RulesLog => self.rules()?.log(),
            Request::RulesDiff(RulesDiff { from, to }) => self.rules()?.diff(from, to),
            Request::RulesRollback(RulesRollback { rev }) => self.rules()?.rollback(rev),
        }
    }
}
