//! flexstack-faces: the edge between the sans-IO graph and the kernel.
//!
//! - [`face`] holds the module kinds that stand for devices (`tun`, `packet`) and the face module they build;
//!   [`tun`] and [`packet`] the devices behind them (what those share is in `device`). The virtio-net header a packet
//!   socket puts before each frame is read and written with `flexstack_wire::vnet`.
//! - [`stream`] is the `kernel` back-end of the stream endpoints `terminate` and `originate`: kernel sockets in the
//!   data plane's epoll loop, as faces are.
//! - [`linkwatch`] tells the data plane when a face's interface loses its carrier or goes down.
//! - [`netconf`] configures namespaces, links, addresses, routes and neighbours through netlink, in batches (the
//!   lab runner's builder).
//! - [`takeover`] takes an interface over for a link face and gives its addresses and IPv6 back afterwards (also
//!   after a crash, at the next daemon's start).
//!
//! The system calls that `nix` has no safe wrapper for are in `flexstack-sys`, the workspace's one crate of
//! unsafe code.
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod device;
pub mod face;
pub mod linkwatch;
pub mod netconf;
pub mod packet;
pub mod peer;
mod sock;
pub mod stream;
pub mod takeover;
pub mod tun;

pub use face::{PacketKind, TunKind};

/// How many data-plane workers the daemon runs: with more than one, `tun` faces open their device with
/// IFF_MULTI_QUEUE, so that each worker's replica of the face reads and writes a queue of its own
/// (`ModuleBuilder::replica`). Set once, by the data plane, before any face is configured.
static WORKERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

/// Says how many data-plane workers faces are opened for.
pub fn set_workers(n: usize) {
    WORKERS.store(n.max(1), std::sync::atomic::Ordering::Relaxed);
}

/// How many data-plane workers faces are opened for.
pub fn workers() -> usize {
    WORKERS.load(std::sync::atomic::Ordering::Relaxed)
}
