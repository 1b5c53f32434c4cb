//! flexstack-core: the sans-IO heart of flexstack.
//!
//! - [`frame`]: data and control frames over pooled, reference-counted packet buffers.
//! - [`module`]: the [`Module`] trait, module kinds and builders, the [`Output`] a
//!   module emits into, and the [`Catalog`] of kinds.
//! - [`switch`]: the [`Switch`], which validates and commits [`Edit`]s, compiles the
//!   linking table and moves batches of frames between modules by direct calls.
//! - [`vars`]: meters and knobs, their cells, and the [`Registry`] of dotted names.
//! - [`decl`]: a kind's ports, settings, knobs and meters declared once, with what is derived from them;
//!   [`reference`](mod@reference): the module reference made from them (docs/modules.md).
//! - [`config`]: stack descriptions in TOML, module settings, link syntax, errors with file:line.
//! - [`stream`]: stream frames (a transport flow as ordered bytes), their credit and ack helpers.
//! - [`time`] and [`value`]: the caller's clock and typed values.
//! - [`testing`]: a recording module for modules' tests.
//!
//! Nothing here reads a clock, opens a file or a socket, or spawns a thread: the daemon (the `flexstack` crate)
//! drives a [`Switch`] from its data-plane thread, and tests drive it with a simulated clock.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod config;
pub mod decl;
pub mod deprecation;
pub mod frame;
pub mod module;
pub mod notify;
pub mod reference;
pub mod stream;
pub mod switch;
pub mod testing;
pub mod time;
pub mod value;
pub mod vars;

pub use config::{ConfigError, LinkSpec, Location, Settings, StackSpec};
pub use decl::{GroupDecl, KindDecl, MeterDecl, Param, PortDecl};
pub use deprecation::Deprecations;
pub use frame::{Batch, ControlFrame, ControlOp, Direction, Frame, MetaKey, Packet, PacketPool};
pub use module::{Catalog, FaceDevice, Module, ModuleBuilder, ModuleInterface, ModuleKind, Output, PortSpec};
pub use notify::Notifier;
pub use reference::KindReference;
pub use stream::{AckMap, Credit, FlowInfo, StreamEvent, StreamFrame, StreamKind};
pub use switch::{Edit, EditError, Switch};
pub use time::Time;
pub use value::{Value, ValueType};
pub use vars::{BlockArena, Meter, ModuleVars, Registry, SharedRegistry, Var, VarBlock, VarKind, VarSpec, VarSpecs};

/// The guide in docs/architecture.md; its "Writing a module" example is compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/architecture.md")]
pub struct ArchitectureGuide;
