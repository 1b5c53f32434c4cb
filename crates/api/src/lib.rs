//! flexstack-api: the control API shared by the daemon, the CLI, `flexstack run`, the lab runner and the tests.
//!
//! - [`ops`] holds the operations by object (modules, links, variables, revisions, taps, apps, rules, the
//!   running stack): each one's request and the type of its result, whose JSON is the wire format of
//!   docs/control-api.md.
//! - [`protocol`] holds the JSON-lines envelope: the [`Request`] enum tagged by `op`, the [`Response`] line, the
//!   error codes, and [`Call`], which ties each request to its result type.
//! - [`client`] is a blocking client of the daemon's control socket: `client.call(ops::ModuleList)?` is a
//!   `Vec<ModuleInfo>`.
//!
//! Variables' values are [`Value`]s (`flexstack-core`'s), re-exported here with their [`ValueType`], [`VarKind`]
//! and declaration, [`VarSpec`].
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod client;
pub mod ops;
pub mod protocol;
mod value;

pub use client::{socket_path, Client, ClientError};
pub use flexstack_core::{Value, ValueType, VarKind, VarSpec};
pub use ops::*;
pub use protocol::{ApiError, Call, ErrorCode, Request, Response};
