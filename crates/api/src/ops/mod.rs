//! The operations of the control API, grouped by the object they act on: for each, its request and the type of
//! its result, as serde types whose JSON is the wire format of docs/control-api.md.
//!
//! Requests without fields (`ModuleList`, `Status`, ...) are unit structs; the others carry their fields. Which
//! result each request gets is declared once, by [`crate::protocol::Call`].

mod app;
mod change;
mod config;
mod flow;
mod link;
mod module;
mod peer;
mod rules;
mod runtime;
mod service;
mod tap;
mod var;

pub use app::*;
pub use change::*;
pub use config::*;
pub use flow::*;
pub use link::*;
pub use module::*;
pub use peer::*;
pub use rules::*;
pub use runtime::*;
pub use service::*;
pub use tap::*;
pub use var::*;
