//! flexstack-faces: the edge between the sans-IO graph and the kernel.
//!
//! - [`face`] holds the module kinds that stand for devices (`tun`, `packet`) and the devices behind them.
//! - [`linkwatch`] tells the data plane when a face's interface loses its carrier or goes down.
//! - [`sys`] wraps the few system calls that have no safe wrapper in `nix`; it holds every `unsafe` block of
//!   flexstack, each with its reason. No other crate of the workspace may use `unsafe`.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod face;
pub mod linkwatch;
pub mod sys;

pub use face::{PacketKind, TunKind};
