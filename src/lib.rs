//! flexstack: the command line, `flexstack run` and the lab runner.
//!
//! - [`cli`] parses the command line; every command but `daemon`, `run` and `lab` is one request to the daemon,
//!   whose typed answer [`render`] turns into text (or `-j` prints as JSON).
//! - [`runner`] is `flexstack run` (an unmodified program in a sandbox), [`lab`] is `flexstack lab`.
//! - [`manual`] writes the shell completions and man pages, generated from the command line's definition.
//!
//! The daemon is the `flexstack-daemon` crate, the control API `flexstack-api`, the sans-IO core
//! `flexstack-core`, the modules `flexstack-modules` and the faces `flexstack-faces` (docs/architecture.md).
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod cli;
pub mod error;
pub mod lab;
pub mod manual;
pub mod render;
pub mod runner;
