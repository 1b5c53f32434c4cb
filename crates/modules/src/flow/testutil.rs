//! Helpers for the tests of the kinds that carry IP packets (flow, ip and sched): those of [`crate::testutil`], a
//! variable read that may find nothing, configuration errors, recording modules and injecting packets.

use flexstack_core::{Direction, Edit, Switch, Time, Value};

pub use crate::catalog;
pub use crate::testutil::{knob, link, load, settings, u64_var};
pub use flexstack_core::testing::{take, Log};

/// The configuration error of a module of `kind` with these settings.
pub fn config_error(kind: &str, args: &[&str]) -> String {
    match catalog().configure(kind, &settings(args), None) {
        Ok(_) => panic!("{kind} {args:?} configured"),
        Err(e) => e.to_string(),
    }
}

/// The value of a registry variable, if there is one of that name.
pub fn var(sw: &Switch, name: &str) -> Option<Value> {
    sw.registry().snapshot().get(name).map(|c| c.get())
}

/// A `Load` edit for a recording module with input `in`, and its log.
pub fn recorder(name: &str) -> (Edit, Log) {
    flexstack_core::testing::Recorder::load(name)
}

/// Injects `packets` (with `direction`) into `module[port]` and runs the switch at `at_ms`.
pub fn send(sw: &mut Switch, module: &str, port: &str, packets: &[Vec<u8>], direction: Direction, at_ms: u64) {
    crate::testutil::inject_into(sw, module, port, packets, direction);
    sw.run(Time::from_millis(at_ms));
}
