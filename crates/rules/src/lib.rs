//! flexstack's cross-layer rules (the CRAWLER language), as a sans-IO crate.
//!
//! A rule text such as
//!
//! ```text
//! rssi: get("iface.wlan0.rssi")
//! recent: History(rssi, 4)
//! bad: Less(Avg(recent), 55)
//! tick: Timer(200ms)
//! tick -> bad
//! bad -> freeze
//! freeze: set("module.sel.select", -1)
//! ```
//!
//! is parsed ([`syntax`]), checked into a [`Program`] of unit trees ([`mod@compile`]), and run by a [`RuleEngine`]
//! ([`engine`]) as functional units ([`units`]) wired by query and event signalling. The engine reads variables
//! through an [`Environment`] ([`mod@env`]) and returns the knob writes its rules make; it never reads a clock
//! (every call takes `now`). Each load, unload, delete, replace or rollback is a revision in the engine's
//! repository. The engine is bounded ([`Limits`]: instances, memory, revisions kept).
//! The language and every unit are described in docs/rules.md.
//!
//! Typical use, as the daemon's control thread would:
//!
//! ```
//! use flexstack_core::{Time, Value};
//! use flexstack_rules::{drive, Environment, MemoryEnv, RuleEngine};
//!
//! let mut env = MemoryEnv::new();
//! env.meter("flow.a.loss", Value::F64(0.01)).knob("flow.a.cc", Value::Str("cubic".into()));
//! let mut engine = RuleEngine::new();
//! let text = "lossy: Threshold(get(\"flow.*.loss\"), 0.04, 0.02)\n\
//!             cc: set(\"flow.*.cc\", If(lossy, \"bbr\", \"cubic\"))";
//! engine.handle_load_text("cc.rules", text, Time::ZERO, &env).unwrap();
//! env.meter("flow.a.loss", Value::F64(0.06));
//! drive(&mut engine, &mut env, Time::from_millis(100));
//! assert_eq!(env.get("flow.a.cc"), Some(Value::Str("bbr".into())));
//! ```

#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod compile;
pub mod diag;
pub mod engine;
pub mod env;
pub mod limits;
mod plan;
pub mod syntax;
pub mod testing;
pub mod units;

pub use compile::{compile, render_rules, Compiled, Program, RuleAction, RuleDef};
pub use diag::{Diagnostic, Severity, Span};
pub use engine::{
    drive, InstanceView, LoadReport, Notice, RevisionInfo, RuleEngine, RuleError, RuleSummary, RuleView, Step, UnitView,
};
pub use env::{Environment, Existence, HeldValue, MemoryEnv};
pub use limits::{Cap, Limits, Usage};
pub use units::{KnobWrite, UnitKind};
