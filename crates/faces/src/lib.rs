//! flexstack-faces: the edge between the sans-IO graph and the kernel.
//!
//! - [`face`] holds the module kinds that stand for devices (`tun`, `packet`) and the face module they build;
//!   [`tun`] and [`packet`] the devices behind them (what those share is in `device`). The virtio-net header a packet
//!   socket puts before each frame is read and written with `flexstack_wire::vnet`.
//! - [`linkwatch`] tells the data plane when a face's interface loses its carrier or goes down.
//! - [`sys`] wraps the few system calls that have no safe wrapper in `nix`; it holds every `unsafe` block of
//!   flexstack, each with its reason. No other crate of the workspace may use `unsafe`.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod device;
pub mod face;
pub mod linkwatch;
pub mod packet;
pub mod sys;
pub mod tun;

pub use face::{PacketKind, TunKind};
