//! The error of a `flexstack` command, shared by the CLI, `flexstack run` and the lab runner; its kind decides the
//! exit code (see the CLI's `main`).

use flexstack_api::client::ClientError;

/// A failure of a CLI command.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// From the control connection or the daemon.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// Anything else, already worded.
    #[error("{0}")]
    Message(String),
    /// An input file (lab, stack) is invalid: exit code 2, nothing was created.
    #[error("{0}")]
    Config(String),
}

/// A [`CliError::Message`] saying `e`.
pub fn msg(e: impl std::fmt::Display) -> CliError {
    CliError::Message(e.to_string())
}

/// The error of an operation the kernel refused for want of privileges: says that it needs root (or sudo) and
/// which operation needed it.
pub fn needs_root(operation: &str) -> CliError {
    CliError::Message(format!(
        "{operation}: permission denied; this needs root: run it as root or with sudo (e.g. `sudo flexstack ...`)"
    ))
}
