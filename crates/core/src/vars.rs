//! Meters (read-only) and knobs (read-write): declared once per module, read by name from any thread.
//!
//! A module declares its variables as [`VarSpec`]s. The switch gives every declared variable a [`VarCell`]: an atomic
//! word (or a small locked string) that the data plane writes with plain relaxed stores and that the control plane
//! reads at any time without stopping traffic. The [`Registry`] maps full dotted names
//! (`module.<name>.<var>`, `iface.<if>.<var>`, `flow.<id>.<var>`, `app.<name>.<var>`) to cells; the switch publishes a
//! fresh snapshot into a [`SharedRegistry`] after every change of the stack.

use crate::value::{Value, ValueType};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// Whether a variable can be written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VarKind {
    /// Read-only measurement.
    Meter,
    /// Read-write setting, changed between batches.
    Knob,
}

/// The declaration of one meter or knob (also, named in full, an entry of the control API's `var_list`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VarSpec {
    /// Name relative to its owner, dotted lowercase (`frames_total`, `port.out.frames_out_total`).
    pub name: String,
    /// Meter or knob.
    pub kind: VarKind,
    /// Value type.
    #[serde(rename = "type")]
    pub ty: ValueType,
    /// Unit in base units (`frames`, `bytes`, `ns`, `frames/s`, or empty).
    pub unit: String,
    /// One-line description.
    pub description: String,
    /// Inclusive numeric range a knob accepts, if limited (`null` otherwise).
    #[serde(default)]
    pub range: Option<(f64, f64)>,
    /// For a knob kept under an old name: the knob it is an old name of (a write sets that one too, converted).
    /// The stack's description leaves it out: it writes the new name.
    #[serde(skip)]
    pub alias_of: Option<String>,
}

impl VarSpec {
    /// Declares a meter.
    pub fn meter(name: &str, ty: ValueType, unit: &str, description: &str) -> VarSpec {
        VarSpec {
            name: name.into(),
            kind: VarKind::Meter,
            ty,
            unit: unit.into(),
            description: description.into(),
            range: None,
            alias_of: None,
        }
    }

    /// Declares a knob.
    pub fn knob(name: &str, ty: ValueType, unit: &str, description: &str) -> VarSpec {
        VarSpec {
            name: name.into(),
            kind: VarKind::Knob,
            ty,
            unit: unit.into(),
            description: description.into(),
            range: None,
            alias_of: None,
        }
    }

    /// Marks a knob as the old name of knob `new`.
    pub fn as_alias_of(mut self, new: &str) -> VarSpec {
        self.alias_of = Some(new.into());
        self
    }

    /// Limits a numeric knob to `min..=max`.
    pub fn with_range(mut self, min: f64, max: f64) -> VarSpec {
        self.range = Some((min, max));
        self
    }

    /// Checks and converts a value written to this variable: it must be a knob, of its type, within its range.
    pub fn validate(&self, value: &Value) -> Result<Value, String> {
        if self.kind != VarKind::Knob {
            return Err(format!("{} is a meter (read-only)", self.name));
        }
        let v = value.coerce(self.ty)?;
        if let (Some((min, max)), Some(x)) = (self.range, v.as_f64()) {
            if x < min || x > max {
                return Err(format!("{} must be within {min}..={max}, got {v}", self.name));
            }
        }
        Ok(v)
    }
}

/// The storage of one variable: written by one thread (the data plane), read by any.
#[derive(Debug)]
pub struct VarCell {
    spec: VarSpec,
    bits: AtomicU64,
    text: Mutex<String>,
}

impl VarCell {
    /// A cell for `spec` holding zero / false / "".
    pub fn new(spec: VarSpec) -> VarCell {
        let bits = match spec.ty {
            ValueType::F64 => 0f64.to_bits(),
            _ => 0,
        };
        VarCell { spec, bits: AtomicU64::new(bits), text: Mutex::new(String::new()) }
    }

    /// The declaration.
    pub fn spec(&self) -> &VarSpec {
        &self.spec
    }

    /// The current value.
    pub fn get(&self) -> Value {
        let bits = self.bits.load(Ordering::Relaxed);
        match self.spec.ty {
            ValueType::U64 => Value::U64(bits),
            ValueType::I64 => Value::I64(bits as i64),
            ValueType::F64 => Value::F64(f64::from_bits(bits)),
            ValueType::Bool => Value::Bool(bits != 0),
            ValueType::Str => Value::Str(self.text.lock().map(|s| s.clone()).unwrap_or_default()),
        }
    }

    /// Stores `value`, converted to the cell's type; values of another type are ignored (callers validate first).
    pub fn store(&self, value: &Value) {
        let Ok(v) = value.coerce(self.spec.ty) else {
            return;
        };
        let bits = match v {
            Value::U64(x) => x,
            Value::I64(x) => x as u64,
            Value::F64(x) => x.to_bits(),
            Value::Bool(b) => u64::from(b),
            Value::Str(s) => {
                if let Ok(mut t) = self.text.lock() {
                    *t = s;
                }
                return;
            }
        };
        self.bits.store(bits, Ordering::Relaxed);
    }

    /// The raw word of a u64 cell (cheap read for counters).
    pub fn load_u64(&self) -> u64 {
        self.bits.load(Ordering::Relaxed)
    }

    /// Adds to a u64 counter. Single writer: a relaxed load and store, no locked instruction.
    #[inline]
    pub fn add_u64(&self, n: u64) {
        self.bits.store(self.bits.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
    }

    /// Sets a u64 cell.
    #[inline]
    pub fn set_u64(&self, n: u64) {
        self.bits.store(n, Ordering::Relaxed);
    }

    /// Sets an f64 cell.
    #[inline]
    pub fn set_f64(&self, x: f64) {
        self.bits.store(x.to_bits(), Ordering::Relaxed);
    }
}

/// A module's handle to one of its u64 meters.
#[derive(Clone, Debug)]
pub struct Meter(Arc<VarCell>);

impl Default for Meter {
    /// A meter bound to no variable (a cell of its own, published nowhere), until it is replaced by one from
    /// [`ModuleVars::meter`].
    fn default() -> Meter {
        Meter(Arc::new(VarCell::new(VarSpec::meter("", ValueType::U64, "", ""))))
    }
}

impl Meter {
    /// Adds `n`.
    #[inline]
    pub fn add(&self, n: u64) {
        self.0.add_u64(n);
    }

    /// Sets the value.
    #[inline]
    pub fn set(&self, n: u64) {
        self.0.set_u64(n);
    }

    /// Sets the value of an f64 meter.
    #[inline]
    pub fn set_f64(&self, x: f64) {
        self.0.set_f64(x);
    }

    /// Stores any value (for bool, i64 and text meters).
    pub fn store(&self, v: &Value) {
        self.0.store(v);
    }

    /// The current value as u64.
    pub fn get(&self) -> u64 {
        self.0.load_u64()
    }
}

/// The cells of one module's declared variables, handed to the module when it is built.
#[derive(Clone, Debug, Default)]
pub struct ModuleVars {
    cells: Vec<Arc<VarCell>>,
}

impl ModuleVars {
    /// Cells for the given declarations, all zero.
    pub fn new(specs: &[VarSpec]) -> ModuleVars {
        ModuleVars { cells: specs.iter().cloned().map(|s| Arc::new(VarCell::new(s))).collect() }
    }

    /// The cell of the variable declared as `name`.
    pub fn cell(&self, name: &str) -> Option<&Arc<VarCell>> {
        self.cells.iter().find(|c| c.spec.name == name)
    }

    /// The meter handle of the variable declared as `name`.
    ///
    /// # Panics
    /// If the module did not declare `name`: a programming error that the module's own tests catch.
    pub fn meter(&self, name: &str) -> Meter {
        Meter(self.cell(name).unwrap_or_else(|| panic!("variable {name} was not declared")).clone())
    }

    /// All cells, in declaration order.
    pub fn cells(&self) -> &[Arc<VarCell>] {
        &self.cells
    }
}

/// Full name → cell, as published by the switch.
#[derive(Clone, Debug, Default)]
pub struct Registry {
    vars: BTreeMap<String, Arc<VarCell>>,
}

impl Registry {
    /// Adds `cell` under the full name `name`.
    pub fn insert(&mut self, name: String, cell: Arc<VarCell>) {
        self.vars.insert(name, cell);
    }

    /// The cell named exactly `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<VarCell>> {
        self.vars.get(name)
    }

    /// The variables whose names match `pattern` (see [`name_matches`]), sorted by name.
    pub fn matching<'a>(&'a self, pattern: &'a str) -> impl Iterator<Item = (&'a str, &'a Arc<VarCell>)> + 'a {
        self.vars.iter().filter(move |(n, _)| name_matches(pattern, n)).map(|(n, c)| (n.as_str(), c))
    }

    /// All variables, sorted by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Arc<VarCell>)> {
        self.vars.iter().map(|(n, c)| (n.as_str(), c))
    }

    /// Number of variables.
    pub fn len(&self) -> usize {
        self.vars.len()
    }

    /// True when no variable is registered.
    pub fn is_empty(&self) -> bool {
        self.vars.is_empty()
    }
}

/// The registry shared between the data plane and readers: a snapshot of the modules' declared variables,
/// replaced after every change of the stack, plus the variables modules register while they run
/// (`flow.<id>.*`, `iface.<if>.*`, `app.<name>.*`), added and removed one prefix at a time.
#[derive(Clone, Debug, Default)]
pub struct SharedRegistry {
    fixed: Arc<RwLock<Arc<Registry>>>,
    dynamic: Arc<RwLock<BTreeMap<String, Arc<VarCell>>>>,
}

impl SharedRegistry {
    /// A snapshot of every variable; reading its cells needs no further lock.
    pub fn snapshot(&self) -> Arc<Registry> {
        let fixed = self.fixed.read().map(|r| r.clone()).unwrap_or_default();
        let dynamic = match self.dynamic.read() {
            Ok(d) if !d.is_empty() => d,
            _ => return fixed,
        };
        let mut merged = (*fixed).clone();
        for (name, cell) in dynamic.iter() {
            merged.insert(name.clone(), cell.clone());
        }
        Arc::new(merged)
    }

    /// Publishes a new snapshot of the declared variables.
    pub fn publish(&self, registry: Registry) {
        if let Ok(mut slot) = self.fixed.write() {
            *slot = Arc::new(registry);
        }
    }

    fn insert_dynamic(&self, name: String, cell: Arc<VarCell>) {
        if let Ok(mut d) = self.dynamic.write() {
            d.insert(name, cell);
        }
    }

    fn remove_dynamic(&self, names: &[String]) {
        if let Ok(mut d) = self.dynamic.write() {
            for n in names {
                d.remove(n);
            }
        }
    }
}

/// Variables registered at runtime, by prefix, with the module that owns each prefix.
#[derive(Debug, Default)]
pub struct DynamicVars {
    registry: SharedRegistry,
    owners: BTreeMap<String, (String, Vec<String>)>,
}

/// First segments a module may register variables under.
pub const DYNAMIC_ROOTS: [&str; 3] = ["flow", "iface", "app"];

impl DynamicVars {
    /// Runtime variables published into `registry`.
    pub fn new(registry: SharedRegistry) -> DynamicVars {
        DynamicVars { registry, owners: BTreeMap::new() }
    }

    /// Registers `specs` under `prefix` (`flow.17`) for module `owner`; a prefix the owner registered before is
    /// replaced. Refused: a prefix outside `flow.`/`iface.`/`app.`, an invalid segment, or another module's prefix.
    pub fn register(&mut self, owner: &str, prefix: &str, specs: &[VarSpec]) -> Result<ModuleVars, String> {
        let mut segments = prefix.split('.');
        let root = segments.next().unwrap_or_default();
        if !DYNAMIC_ROOTS.contains(&root) {
            return Err(format!("runtime variables go under flow., iface. or app., not {prefix:?}"));
        }
        let segment_ok = |s: &str| {
            !s.is_empty()
                && s.len() <= 64
                && s.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_' || c == b'-')
        };
        if !prefix.split('.').all(segment_ok) || prefix.split('.').count() < 2 {
            return Err(format!("invalid variable prefix {prefix:?}: expected e.g. flow.17 or iface.eth0"));
        }
        match self.owners.get(prefix) {
            Some((o, _)) if o != owner => return Err(format!("{prefix} belongs to module {o}")),
            Some(_) => {
                self.unregister(owner, prefix);
            }
            None => {}
        }
        let vars = ModuleVars::new(specs);
        let names: Vec<String> = vars.cells().iter().map(|c| format!("{prefix}.{}", c.spec().name)).collect();
        for (name, cell) in names.iter().zip(vars.cells()) {
            self.registry.insert_dynamic(name.clone(), cell.clone());
        }
        self.owners.insert(prefix.to_string(), (owner.to_string(), names));
        Ok(vars)
    }

    /// The module that registered runtime variable `name` (the owner of the longest registered prefix of it), and
    /// the variable's cell; `None` if no module registered it.
    pub fn owner_of(&self, name: &str) -> Option<(&str, Arc<VarCell>)> {
        let mut cut = name.len();
        while let Some(dot) = name[..cut].rfind('.') {
            if let Some((owner, names)) = self.owners.get(&name[..dot]) {
                if names.iter().any(|n| n == name) {
                    let cell = self.registry.snapshot().get(name).cloned()?;
                    return Some((owner.as_str(), cell));
                }
                return None;
            }
            cut = dot;
        }
        None
    }

    /// Removes the variables `owner` registered under `prefix`; false if it had none there.
    pub fn unregister(&mut self, owner: &str, prefix: &str) -> bool {
        match self.owners.get(prefix) {
            Some((o, _)) if o == owner => {}
            _ => return false,
        }
        if let Some((_, names)) = self.owners.remove(prefix) {
            self.registry.remove_dynamic(&names);
        }
        true
    }

    /// Removes every variable `owner` registered (it was unloaded); returns how many prefixes went.
    pub fn unregister_owner(&mut self, owner: &str) -> usize {
        let prefixes: Vec<String> =
            self.owners.iter().filter(|(_, (o, _))| o == owner).map(|(p, _)| p.clone()).collect();
        for p in &prefixes {
            self.unregister(owner, p);
        }
        prefixes.len()
    }

    /// Number of registered prefixes.
    pub fn len(&self) -> usize {
        self.owners.len()
    }

    /// True when nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.owners.is_empty()
    }
}

/// True if the dotted `name` matches `pattern`: `*` matches any text within one dotted segment, `**` any text
/// across segments, `?` one character other than a dot; everything else matches itself.
///
/// Runs in O(name²) time and O(name) space, however long the pattern and however many wildcards it has (a
/// backtracking matcher is exponential in the number of stars, which a client could exploit with a pattern like
/// `**************a`): every step but a star consumes a character, runs of stars collapse, and matching stops as
/// soon as no prefix of the name is reachable.
pub fn name_matches(pattern: &str, name: &str) -> bool {
    let (p, n) = (pattern.as_bytes(), name.as_bytes());
    // `reach[i]`: the part of the pattern read so far matches `n[..i]`.
    let mut reach = vec![false; n.len() + 1];
    reach[0] = true;
    let mut next = vec![false; n.len() + 1];
    let mut k = 0;
    while k < p.len() {
        match p[k] {
            b'*' if p.get(k + 1) == Some(&b'*') => {
                // Any text: every position at or after a reachable one. More stars after `**` add nothing.
                let mut run = false;
                for (i, r) in next.iter_mut().enumerate() {
                    run |= reach[i];
                    *r = run;
                }
                while p.get(k + 1) == Some(&b'*') {
                    k += 1;
                }
            }
            b'*' => {
                // Text without a dot: positions after a reachable one, up to (not past) the next dot.
                let mut run = false;
                for (i, r) in next.iter_mut().enumerate() {
                    run |= reach[i];
                    *r = run;
                    if n.get(i) == Some(&b'.') {
                        run = false;
                    }
                }
            }
            c => {
                next[0] = false;
                for i in 0..n.len() {
                    next[i + 1] = reach[i] && if c == b'?' { n[i] != b'.' } else { n[i] == c };
                }
            }
        }
        std::mem::swap(&mut reach, &mut next);
        if !reach.contains(&true) {
            return false;
        }
        k += 1;
    }
    reach[n.len()]
}

/// True if `pattern` contains a wildcard.
pub fn is_pattern(pattern: &str) -> bool {
    pattern.contains(['*', '?'])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_respect_segments() {
        for (pattern, name, matches) in [
            ("module.*.frames_in_total", "module.c1.frames_in_total", true),
            ("module.*.frames_in_total", "module.c1.port.in.frames_in_total", false),
            ("module.**.frames_in_total", "module.c1.port.in.frames_in_total", true),
            ("module.c?.x", "module.c1.x", true),
            ("module.c?.x", "module.c12.x", false),
            ("module.c*", "module.c12", true),
            ("module.c*", "module.c1.x", false),
            ("exact.name", "exact.name", true),
            ("exact.name", "exact.names", false),
            ("**", "", true),
            ("*", "", true),
            ("?", "", false),
            ("a.**.b", "a..b", true),
            ("a***", "ab.c", true),
            ("a*.", "ab", false),
        ] {
            assert_eq!(name_matches(pattern, name), matches, "{pattern} ~ {name}");
        }
    }

    /// Many stars against a long name that does not match: a backtracking matcher takes minutes here.
    #[test]
    fn wildcards_run_in_polynomial_time() {
        let name = format!("module.{}.frames_in_total", "b".repeat(200));
        let start = std::time::Instant::now();
        assert!(!name_matches(&format!("{}a", "*".repeat(40)), &name));
        assert!(!name_matches(&"*?".repeat(30), "short"));
        assert!(name_matches(&format!("{}l", "**".repeat(20)), &name));
        assert!(name_matches(&"*".repeat(1 << 20), &name));
        assert!(!name_matches(&"*?".repeat(1 << 19), &name));
        assert!(start.elapsed() < std::time::Duration::from_secs(2), "{:?}", start.elapsed());
    }

    #[test]
    fn cells_store_each_type() {
        let c = VarCell::new(VarSpec::knob("x", ValueType::I64, "", "test"));
        c.store(&Value::I64(-4));
        assert_eq!(c.get(), Value::I64(-4));
        let f = VarCell::new(VarSpec::meter("r", ValueType::F64, "frames/s", "rate"));
        assert_eq!(f.get(), Value::F64(0.0));
        f.set_f64(2.5);
        assert_eq!(f.get(), Value::F64(2.5));
        let s = VarCell::new(VarSpec::knob("p", ValueType::Str, "", "path"));
        s.store(&Value::Str("a.pcapng".into()));
        assert_eq!(s.get(), Value::Str("a.pcapng".into()));
    }

    #[test]
    fn validate_checks_kind_type_and_range() {
        let k = VarSpec::knob("select", ValueType::I64, "", "output").with_range(-1.0, 2.0);
        assert_eq!(k.validate(&Value::U64(2)), Ok(Value::I64(2)));
        assert!(k.validate(&Value::U64(3)).unwrap_err().contains("within"));
        assert!(k.validate(&Value::Bool(true)).is_err());
        let m = VarSpec::meter("frames_total", ValueType::U64, "frames", "count");
        assert!(m.validate(&Value::U64(1)).unwrap_err().contains("read-only"));
    }
}
