//! flexstack: the daemon, its control API and the command line.
//!
//! - [`server`] runs the daemon: state directory, private control socket, client threads; [`privileges`] drops
//!   the capabilities it does not need.
//! - [`dataplane`] owns the switch on its own thread and applies queued edits between batches; [`linkwatch`]
//!   tells it when a face's interface loses its carrier or goes down.
//! - [`actions`] holds one action function per control operation, behind both the API and the CLI.
//! - [`protocol`] defines the JSON-lines requests and responses (docs/control-api.md).
//! - [`rules`] runs the cross-layer rules on a thread of their own; [`appvars`] serves applications' variables.
//! - [`faces`] holds the module kinds that stand for devices (TUN), [`sandbox`] the namespaces of sandboxed apps.
//! - [`client`] and [`cli`] are the client side; [`runner`] is `flexstack run`, [`lab`] is `flexstack lab`.
//!
//! The sans-IO core (frames, modules, switch, registry, stack descriptions) is the `flexstack-core` crate; the
//! built-in modules are `flexstack-modules`.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod actions;
pub mod appvars;
pub mod cli;
pub mod client;
pub mod dataplane;
pub mod faces;
pub mod lab;
pub mod linkwatch;
pub mod privileges;
pub mod protocol;
pub mod rules;
pub mod runner;
pub mod sandbox;
pub mod server;
pub mod sys;

/// Every module kind the daemon can load: the built-ins and the network modules.
pub fn catalog() -> flexstack_core::Catalog {
    let mut catalog = flexstack_modules::catalog();
    flexstack_net::register(&mut catalog);
    catalog.register(Box::new(faces::TunKind));
    catalog.register(Box::new(faces::PacketKind));
    catalog
}
