//! The boundary between the rules and the variables they read and write.
//!
//! The engine never touches the daemon: it reads meters and knobs through an [`Environment`] handed to each call,
//! and returns knob writes for its caller to apply ([`crate::Step::writes`]); the caller reports how they went
//! with [`crate::RuleEngine::handle_write_result`]. The daemon implements `Environment` over its registry
//! snapshot; tests use [`MemoryEnv`].

use flexstack_core::vars::name_matches;
use flexstack_core::Value;
use std::collections::BTreeMap;

/// Prefixes of variables that come and go while the stack runs (flows, interfaces, applications' variables):
/// a name under one of them that does not exist yet gets a warning, not an error.
pub const DYNAMIC_PREFIXES: &[&str] = &["flow.", "iface.", "app."];

/// Whether a variable exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Existence {
    /// It exists now.
    Known,
    /// It does not exist now but may appear (a dynamic prefix, a wildcard with no match yet).
    Maybe,
    /// It does not exist and cannot appear.
    No,
}

/// Read and write access to meters and knobs by their dotted names.
pub trait Environment {
    /// The current value of a meter or knob; `None` if there is none by that name.
    fn get(&self, name: &str) -> Option<Value>;
    /// Writes a knob (validated as any write); the error says why it was refused.
    fn set(&mut self, name: &str, value: Value) -> Result<(), String>;
    /// The names of the existing variables matching a pattern (`*` within a dotted segment), sorted.
    fn names(&self, pattern: &str) -> Vec<String>;
    /// Whether a name (or a pattern) exists or may appear.
    fn exists(&self, name: &str) -> Existence;
    /// A number that moves whenever the set of names may have changed, so that names listed for a pattern need
    /// not be listed again while it stays the same; `None` (the default): unknown, list them every time.
    fn names_generation(&self) -> Option<u64> {
        None
    }
    /// The variable `name` taken out to be read again without looking it up, valid while
    /// [`Environment::names_generation`] stays the same; `None` (the default): read it by name every time.
    fn hold(&self, _name: &str) -> Option<Box<dyn HeldValue>> {
        None
    }
}

/// A variable an [`Environment`] resolved once ([`Environment::hold`]), read many times.
pub trait HeldValue: Send {
    /// Its current value.
    fn get(&self) -> Value;
}

impl HeldValue for flexstack_core::vars::VarHandle {
    fn get(&self) -> Value {
        flexstack_core::vars::VarHandle::get(self)
    }
}

/// The default answer of [`Environment::exists`] for a name that matches nothing now.
pub fn absent(name: &str) -> Existence {
    if DYNAMIC_PREFIXES.iter().any(|p| name.starts_with(p)) || name.contains('*') {
        Existence::Maybe
    } else {
        Existence::No
    }
}

/// An in-memory environment: meters (read-only) and knobs (writable), for tests and benchmarks.
#[derive(Clone, Debug, Default)]
pub struct MemoryEnv {
    vars: BTreeMap<String, (Value, bool)>,
    /// Every accepted write, in order.
    pub written: Vec<(String, Value)>,
    /// [`Environment::names_generation`]: `None` unless [`MemoryEnv::track_names`] was called; then it moves when
    /// a name is added or removed.
    generation: Option<u64>,
    /// How many times [`Environment::names`] was called.
    listings: std::cell::Cell<usize>,
}

impl MemoryEnv {
    /// An empty environment.
    pub fn new() -> MemoryEnv {
        MemoryEnv::default()
    }

    /// Reports a [`Environment::names_generation`] from now on, as the daemon's registry does.
    pub fn track_names(&mut self) -> &mut MemoryEnv {
        self.generation = Some(0);
        self
    }

    /// How many times the names matching a pattern were listed.
    pub fn listings(&self) -> usize {
        self.listings.get()
    }

    fn names_changed(&mut self) {
        if let Some(g) = &mut self.generation {
            *g += 1;
        }
    }

    /// Adds or updates a read-only meter.
    pub fn meter(&mut self, name: &str, value: Value) -> &mut MemoryEnv {
        self.put(name, value, false)
    }

    /// Adds or updates a writable knob.
    pub fn knob(&mut self, name: &str, value: Value) -> &mut MemoryEnv {
        self.put(name, value, true)
    }

    /// Updates a variable in place (no allocation for its name), or adds it.
    fn put(&mut self, name: &str, value: Value, writable: bool) -> &mut MemoryEnv {
        match self.vars.get_mut(name) {
            Some(slot) => *slot = (value, writable),
            None => {
                self.vars.insert(name.to_string(), (value, writable));
                self.names_changed();
            }
        }
        self
    }

    /// Removes a variable (a flow that ended).
    pub fn remove(&mut self, name: &str) {
        if self.vars.remove(name).is_some() {
            self.names_changed();
        }
    }
}

impl Environment for MemoryEnv {
    fn get(&self, name: &str) -> Option<Value> {
        self.vars.get(name).map(|(v, _)| v.clone())
    }

    fn set(&mut self, name: &str, value: Value) -> Result<(), String> {
        match self.vars.get_mut(name) {
            Some((v, true)) => {
                *v = value.clone();
                self.written.push((name.to_string(), value));
                Ok(())
            }
            Some((_, false)) => Err(format!("{name} is a meter, not a knob")),
            None => Err(format!("no knob named {name}")),
        }
    }

    fn names(&self, pattern: &str) -> Vec<String> {
        self.listings.set(self.listings.get() + 1);
        self.vars.keys().filter(|n| name_matches(pattern, n)).cloned().collect()
    }

    fn names_generation(&self) -> Option<u64> {
        self.generation
    }

    fn exists(&self, name: &str) -> Existence {
        if self.vars.keys().any(|n| name_matches(name, n)) {
            Existence::Known
        } else {
            absent(name)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_env_reads_writes_and_matches() {
        let mut env = MemoryEnv::new();
        env.meter("flow.a.rtt", Value::U64(4)).knob("flow.a.cc", Value::Str("cubic".into()));
        env.meter("flow.a.rtt", Value::U64(5));
        assert_eq!(env.get("flow.a.rtt"), Some(Value::U64(5)));
        assert!(env.set("flow.a.rtt", Value::U64(1)).unwrap_err().contains("meter"));
        assert!(env.set("flow.b.cc", Value::U64(1)).unwrap_err().contains("no knob"));
        env.set("flow.a.cc", Value::Str("bbr".into())).unwrap();
        assert_eq!(env.written.len(), 1);
        assert_eq!(env.names("flow.*.rtt"), vec!["flow.a.rtt".to_string()]);
        assert_eq!(env.exists("flow.*.cc"), Existence::Known);
        assert_eq!(env.exists("flow.z.cc"), Existence::Maybe);
        assert_eq!(env.exists("module.x.y"), Existence::No);
    }
}
