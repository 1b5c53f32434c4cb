//! flexstack-daemon: everything that runs inside `flexstack daemon`.
//!
//! - [`server`] runs the daemon: state directory, private control socket, client threads; [`privileges`] drops
//!   the capabilities it does not need.
//! - [`dataplane`] owns the switch on its own thread and applies queued edits between batches.
//! - [`actions`] holds one action function per control operation, behind both the API and the CLI.
//! - [`rules`] runs the cross-layer rules on a thread of their own; [`appvars`] serves applications' variables.
//! - [`sandbox`] builds and removes the namespaces of sandboxed apps.
//! - [`catalog`] lists every module kind the daemon can load.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod actions;
pub mod appvars;
pub mod dataplane;
pub mod privileges;
pub mod rules;
pub mod sandbox;
pub mod server;

/// Every module kind the daemon can load: the built-in modules and the faces.
pub fn catalog() -> flexstack_core::Catalog {
    let mut catalog = flexstack_modules::catalog();
    catalog.register(Box::new(flexstack_faces::TunKind));
    catalog.register(Box::new(flexstack_faces::PacketKind));
    catalog
}
