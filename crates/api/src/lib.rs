//! flexstack-api: the control API shared by the daemon, the CLI, `flexstack run`, the lab runner and the tests.
//!
//! - [`protocol`] defines the JSON-lines requests and responses (docs/control-api.md) and the error codes.
//! - [`client`] is a blocking client of the daemon's control socket.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod client;
pub mod protocol;

pub use client::{socket_path, Client, ClientError};
pub use protocol::{ApiError, ErrorCode, Request, Response};
