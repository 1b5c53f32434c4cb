//! Declaring a module kind once: its ports, settings, knobs and meters, with what is derived from them.
//!
//! A kind writes one [`KindDecl`]: its name and summary, its ports ([`PortDecl`]), its settings and knobs
//! ([`Param`]: name, unit, description, default, range, and where the value lives in the module's state `S`), and
//! its meters ([`MeterDecl`]: name, type, unit, description, and the [`Meter`] field of a struct `M` that holds the
//! module's meter handles). Everything else is derived from that one table:
//!
//! - [`KindDecl::read`]: the settings read in `configure`, with their defaults, types and ranges checked and
//!   errors located where the setting was written (every knob is also a setting);
//! - [`KindDecl::interface`]: the ports and [`VarSpec`]s of the interface;
//! - [`KindDecl::publish`] and [`KindDecl::meters`]: the knobs' initial values stored in their cells, and the meter
//!   handles bound, in `build`;
//! - [`KindDecl::write`]: a knob write, type and range checked, stored in the state (for `write_knob`);
//! - [`KindDecl::reference`]: the kind's entry in the module reference (docs/modules.md), without configuring;
//! - [`KindDecl::configure`] and [`KindDecl::builder`]: a builder with the declared interface, for kinds whose
//!   ports do not depend on their settings, and [`kind_from_decl!`](crate::kind_from_decl) for the kind's `name`,
//!   `summary` and `reference`.
//!
//! Settings, knobs and meters that repeat for each item of a list setting (`<iface>.rate_mbit` for each interface)
//! are declared once in a [`GroupDecl`], which derives the same for each item.
//!
//! ```
//! use flexstack_core::decl::{KindDecl, MeterDecl, Param, PortDecl};
//! use flexstack_core::{field, module::port_type, Meter, ModuleVars, Settings, Value};
//!
//! struct Config { max_len: u64 }
//! #[derive(Default)]
//! struct Meters { cut: Meter }
//!
//! type P = Param<Config>;
//! const DECL: KindDecl<Config, Meters> = KindDecl {
//!     inputs: &[PortDecl::new("in", port_type::ANY, "packets to cut")],
//!     outputs: &[PortDecl::new("out", port_type::ANY, "the packets, at most `max_len` bytes long")],
//!     params: &[P::u64("max_len", "bytes", "longest packet let through whole", 1500, field!(max_len))
//!         .range(1.0, 65535.0)],
//!     meters: &[MeterDecl::u64("cut_total", "frames", "packets that were shortened", |m| &mut m.cut)],
//!     ..KindDecl::new("truncate", "cuts packets to at most `max_len` bytes")
//! };
//!
//! let mut cfg = DECL.settings(&Settings::from_args(&["max_len=100".into()]).unwrap(), Config { max_len: 0 })
//!     .unwrap();
//! assert_eq!(cfg.max_len, 100);
//! let iface = DECL.interface(&cfg);
//! let vars = ModuleVars::new(&iface.vars);
//! DECL.publish(&cfg, &vars);
//! let meters = DECL.meters(&vars);
//! meters.cut.add(1);
//! assert_eq!(vars.cell("max_len").unwrap().get(), Value::U64(100));
//! assert!(DECL.write(&mut cfg, "max_len", &Value::U64(0)).unwrap_err().contains("1..=65535"));
//! DECL.write(&mut cfg, "max_len", &Value::U64(64)).unwrap();
//! assert_eq!(cfg.max_len, 64);
//! ```

use crate::config::{ConfigError, Settings, SettingsReader};
use crate::module::{Module, ModuleBuilder, ModuleInterface, PortSpec};
use crate::reference::{KindReference, MeterDoc, PortDoc, SettingDoc};
use crate::value::{Value, ValueType};
use crate::vars::{Across, Meter, ModuleVars, VarSpec};
use std::borrow::Cow;
use std::fmt;

/// The storage of a declared parameter: a getter and a setter on the module's state `S` (see
/// [`field!`](crate::field)).
pub type Access<S, T> = (fn(&S) -> T, fn(&mut S, T));

/// Makes the module from its state and bound meters (and the variables, for meters declared elsewhere).
pub type Make<S, M> = fn(S, M, &ModuleVars) -> Box<dyn Module>;

/// A check of a numeric value beyond its range, given the state read so far; the error is its message.
pub type Check<S> = fn(&S, f64) -> Result<(), String>;

/// The getter and setter of a parameter stored in field `$path` of the state (`field!(cfg.delay_ms)`).
#[macro_export]
macro_rules! field {
    ($($f:ident).+) => {
        (|s| s.$($f).+, |s, v| s.$($f).+ = v)
    };
}

/// A u64 [`MeterDecl`] counted in frames whose handle is one element of an array of the meters, indexed by an
/// enum: `frames_meter!("drop_tiny_total", "fragments dropped: too short", drops[Reason::Tiny])`, for modules that
/// count by reason.
#[macro_export]
macro_rules! frames_meter {
    ($name:literal, $description:literal, $field:ident[$index:expr]) => {
        $crate::MeterDecl::u64($name, "frames", $description, |m| &mut m.$field[$index as usize])
    };
}

/// The `name`, `summary`, `global_view` and `reference` methods of a [`crate::ModuleKind`] declared by `$decl` (a
/// [`KindDecl`]) and, if its settings repeat per item, `$group` (a [`GroupDecl`]), for use inside the
/// `impl ModuleKind` block, which then only adds `configure`.
#[macro_export]
macro_rules! kind_from_decl {
    ($decl:expr $(, $group:expr)?) => {
        fn name(&self) -> &'static str {
            $decl.name
        }

        fn summary(&self) -> &'static str {
            $decl.summary
        }

        fn global_view(&self) -> bool {
            $decl.global_view
        }

        fn reference(&self) -> $crate::KindReference {
            #[allow(unused_mut)]
            let mut reference = $decl.reference();
            $($group.add_to(&mut reference);)?
            reference
        }
    };
}

/// A port as the reference shows it. Ports that depend on settings are described in words (`0..N-1`) and built
/// by the module itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortDecl {
    /// The port's name.
    pub name: &'static str,
    /// The frame type it carries ([`crate::module::port_type`]).
    pub ty: &'static str,
    /// What goes through it.
    pub description: &'static str,
}

impl PortDecl {
    /// A port `name` carrying `ty` frames.
    pub const fn new(name: &'static str, ty: &'static str, description: &'static str) -> PortDecl {
        PortDecl { name, ty, description }
    }

    fn spec(&self) -> PortSpec {
        PortSpec::new(self.name, self.ty)
    }
}

/// Where a parameter's value lives in the state `S`, its type and its default.
pub enum Field<S> {
    /// A non-negative integer.
    U64(Access<S, u64>, u64),
    /// An integer.
    I64(Access<S, i64>, i64),
    /// A number.
    F64(Access<S, f64>, f64),
    /// true or false.
    Bool(Access<S, bool>, bool),
    /// Text, shown by the getter and parsed by the setter, which may refuse it with a message.
    Text(fn(&S) -> String, fn(&mut S, &str) -> Result<(), String>, &'static str),
    /// A setting the module reads itself (an array, a required path ...): declared for the reference only, with
    /// its type and default in words.
    Manual(&'static str, &'static str),
}

// Clone and Copy for any `S`: the tables hold only fn pointers and static text (a derive would require `S: Copy`).
macro_rules! copy_for_any {
    ($($t:ident),*) => {$(
        impl<S> Clone for $t<S> {
            fn clone(&self) -> Self {
                *self
            }
        }
        impl<S> Copy for $t<S> {}
    )*};
}
copy_for_any!(Field, Range, Param, MeterDecl);

// The numeric knobs' constructors: name, unit, description, default and storage.
macro_rules! numeric_constructors {
    ($($(#[$doc:meta])* $name:ident: $t:ty => $variant:ident;)*) => {$(
        $(#[$doc])*
        pub const fn $name(
            name: &'static str,
            unit: &'static str,
            doc: &'static str,
            default: $t,
            access: Access<S, $t>,
        ) -> Self {
            Param::new(name, unit, doc, Field::$variant(access, default))
        }
    )*};
}

/// The numeric range a parameter accepts.
pub enum Range<S> {
    /// Any value of the type.
    Any,
    /// `min..=max`.
    Fixed(f64, f64),
    /// A range that depends on other settings (read before this one), and how the reference words it.
    By(fn(&S) -> (f64, f64), &'static str),
}

/// One setting of a module kind, declared once; a knob unless marked [`Param::setting`] (every knob is also
/// accepted as a setting of the same name).
pub struct Param<S> {
    /// The name in stack files and variable names.
    pub name: &'static str,
    /// Unit in base units (`bytes`, `ms`, `frames/s`), or empty.
    pub unit: &'static str,
    /// One-line description.
    pub description: &'static str,
    /// Where the value lives, its type and its default.
    pub field: Field<S>,
    /// The values accepted.
    pub range: Range<S>,
    /// A check of a numeric value beyond its range (its message replaces the range's), with the state as read so
    /// far.
    pub check: Option<Check<S>>,
    /// True for a knob: published as a variable and writable while the module runs.
    pub knob: bool,
    /// For an old name kept for a while: the current name (see [`Param::renamed_to`]).
    pub renamed_to: Option<&'static str>,
}

impl<S> Param<S> {
    const fn new(name: &'static str, unit: &'static str, description: &'static str, field: Field<S>) -> Param<S> {
        Param { name, unit, description, field, range: Range::Any, check: None, knob: true, renamed_to: None }
    }

    numeric_constructors! {
        /// A u64 knob stored by `access` (see [`field!`](crate::field)).
        u64: u64 => U64;
        /// An i64 knob.
        i64: i64 => I64;
        /// An f64 knob.
        f64: f64 => F64;
    }

    /// A bool knob.
    pub const fn bool(name: &'static str, doc: &'static str, default: bool, access: Access<S, bool>) -> Self {
        Param::new(name, "", doc, Field::Bool(access, default))
    }

    /// A text knob: `get` shows the state's value, `set` parses text into the state or says what is wrong.
    pub const fn text(
        name: &'static str,
        doc: &'static str,
        default: &'static str,
        get: fn(&S) -> String,
        set: fn(&mut S, &str) -> Result<(), String>,
    ) -> Self {
        Param::new(name, "", doc, Field::Text(get, set, default))
    }

    /// A setting the module reads itself in `configure`; `ty` and `default` in words (`array of strings`, `none`).
    pub const fn manual(name: &'static str, ty: &'static str, doc: &'static str, default: &'static str) -> Self {
        Param::new(name, "", doc, Field::Manual(ty, default)).setting()
    }

    /// Accepts `min..=max` only.
    pub const fn range(mut self, min: f64, max: f64) -> Self {
        self.range = Range::Fixed(min, max);
        self
    }

    /// Accepts the range `bounds` computes from the settings read before this one (`words` in the reference).
    pub const fn range_by(mut self, bounds: fn(&S) -> (f64, f64), words: &'static str) -> Self {
        self.range = Range::By(bounds, words);
        self
    }

    /// Checks a numeric value further (before the range); the message is the error's.
    pub const fn check(mut self, check: Check<S>) -> Self {
        self.check = Some(check);
        self
    }

    /// The old name of parameter `new`, still accepted (declare it after `new`, with its own unit and storage, e.g.
    /// converting): read only when given and `new` is not, a knob marked as an alias of `new`
    /// ([`VarSpec::alias_of`]: the stack's description writes `new` instead), and deprecated in the reference.
    /// Catalogs report its use as a setting ([`crate::Catalog::on_alias`]); a module reports writes of the knob.
    pub const fn renamed_to(mut self, new: &'static str) -> Self {
        self.renamed_to = Some(new);
        self
    }

    /// A setting only: read when configured, not a variable, not writable while the module runs.
    pub const fn setting(mut self) -> Self {
        self.knob = false;
        self
    }

    /// The value type, or `None` for a [`Field::Manual`] setting.
    pub fn value_type(&self) -> Option<ValueType> {
        Some(match self.field {
            Field::U64(..) => ValueType::U64,
            Field::I64(..) => ValueType::I64,
            Field::F64(..) => ValueType::F64,
            Field::Bool(..) => ValueType::Bool,
            Field::Text(..) => ValueType::Str,
            Field::Manual(..) => return None,
        })
    }

    /// Checks numeric value `x` (shown as `shown`): the check, then the range, with the state read so far.
    fn accepts(&self, state: &S, x: f64, shown: &dyn fmt::Display) -> Result<(), String> {
        if let Some(check) = self.check {
            check(state, x)?;
        }
        let (min, max) = match self.range {
            Range::Any => return Ok(()),
            Range::Fixed(min, max) => (min, max),
            Range::By(bounds, _) => bounds(state),
        };
        if !(min..=max).contains(&x) {
            return Err(format!("must be within {min}..={max}, got {shown}"));
        }
        Ok(())
    }

    /// Reads this setting, named `name` (its default when not given), into `state`.
    fn read(&self, r: &mut SettingsReader<'_>, name: &str, state: &mut S) -> Result<(), ConfigError> {
        let checked = |state: &S, x: f64, shown: &dyn fmt::Display, r: &SettingsReader<'_>| {
            self.accepts(state, x, shown).map_err(|e| r.error(name, e))
        };
        match self.field {
            Field::U64((_, set), default) => {
                let v = r.u64(name)?.unwrap_or(default);
                checked(state, v as f64, &v, r)?;
                set(state, v);
            }
            Field::I64((_, set), default) => {
                let v = r.i64(name)?.unwrap_or(default);
                checked(state, v as f64, &v, r)?;
                set(state, v);
            }
            Field::F64((_, set), default) => {
                let v = r.f64(name)?.unwrap_or(default);
                checked(state, v, &v, r)?;
                set(state, v);
            }
            Field::Bool((_, set), default) => set(state, r.bool(name)?.unwrap_or(default)),
            Field::Text(_, set, default) => {
                let text = r.string(name)?;
                set(state, text.as_deref().unwrap_or(default)).map_err(|e| r.error(name, e))?;
            }
            Field::Manual(..) => {}
        }
        Ok(())
    }

    /// Writes `value` (converted to the parameter's type, checked) into `state`; `name` is the knob's name.
    fn write(&self, name: &str, state: &mut S, value: &Value) -> Result<(), String> {
        let ty = self.value_type().ok_or_else(|| format!("{name} is not a knob"))?;
        let in_range = |state: &S, x: f64, v: &Value| self.accepts(state, x, v).map_err(|e| format!("{name} {e}"));
        match (self.field, value.coerce(ty)?) {
            (Field::U64((_, set), _), Value::U64(v)) => in_range(state, v as f64, value).map(|()| set(state, v)),
            (Field::I64((_, set), _), Value::I64(v)) => in_range(state, v as f64, value).map(|()| set(state, v)),
            (Field::F64((_, set), _), Value::F64(v)) => in_range(state, v, value).map(|()| set(state, v)),
            (Field::Bool((_, set), _), Value::Bool(v)) => {
                set(state, v);
                Ok(())
            }
            (Field::Text(_, set, _), Value::Str(v)) => set(state, &v),
            _ => Err(format!("cannot set {name} to {value}")),
        }
    }

    /// The current value in `state` (`None` for a [`Field::Manual`] setting).
    pub fn get(&self, state: &S) -> Option<Value> {
        Some(match self.field {
            Field::U64((get, _), _) => Value::U64(get(state)),
            Field::I64((get, _), _) => Value::I64(get(state)),
            Field::F64((get, _), _) => Value::F64(get(state)),
            Field::Bool((get, _), _) => Value::Bool(get(state)),
            Field::Text(get, ..) => Value::Str(get(state)),
            Field::Manual(..) => return None,
        })
    }

    /// The variable of a knob, named `name`, with its range for this state.
    fn spec(&self, name: &str, state: &S) -> Option<VarSpec> {
        let ty = self.value_type().filter(|_| self.knob)?;
        let spec = VarSpec::knob(name, ty, self.unit, self.description);
        Some(match self.range {
            Range::Any => spec,
            Range::Fixed(min, max) => spec.with_range(min, max),
            Range::By(bounds, _) => {
                let (min, max) = bounds(state);
                spec.with_range(min, max)
            }
        })
    }

    fn doc(&self, name: &str) -> SettingDoc {
        let (ty, default) = match self.field {
            Field::U64(_, d) => ("u64".to_string(), d.to_string()),
            Field::I64(_, d) => ("i64".to_string(), d.to_string()),
            Field::F64(_, d) => ("f64".to_string(), d.to_string()),
            Field::Bool(_, d) => ("bool".to_string(), d.to_string()),
            Field::Text(_, _, d) => ("str".to_string(), format!("{d:?}")),
            Field::Manual(ty, d) => (ty.to_string(), d.to_string()),
        };
        let range = match self.range {
            Range::Any => String::new(),
            Range::Fixed(min, max) => format!("{min}..={max}"),
            Range::By(_, words) => words.to_string(),
        };
        SettingDoc {
            name: name.into(),
            ty,
            unit: self.unit.into(),
            default,
            range,
            knob: self.knob,
            description: self.description.into(),
        }
    }
}

/// One meter of a module kind, declared once: its variable and the field of the meter struct `M` that holds its
/// handle.
pub struct MeterDecl<M> {
    /// The name (counters end in `_total`).
    pub name: &'static str,
    /// Value type.
    pub ty: ValueType,
    /// Unit in base units, or empty.
    pub unit: &'static str,
    /// One-line description.
    pub description: &'static str,
    /// The field holding the meter's handle; `None` for meters named by a pattern (`rule<N>_matches_total`), which
    /// the module declares itself and which are listed in the reference only.
    pub field: Option<fn(&mut M) -> &mut Meter>,
    /// How the meter's cells on several data-plane workers combine ([`Across`]: summed unless said otherwise).
    pub across: Across,
}

impl<M> MeterDecl<M> {
    /// A meter of type `ty`.
    pub const fn new(
        name: &'static str,
        ty: ValueType,
        unit: &'static str,
        description: &'static str,
        field: fn(&mut M) -> &mut Meter,
    ) -> Self {
        MeterDecl { name, ty, unit, description, field: Some(field), across: Across::Sum }
    }

    /// A u64 meter (a counter or a gauge).
    pub const fn u64(
        name: &'static str,
        unit: &'static str,
        description: &'static str,
        field: fn(&mut M) -> &mut Meter,
    ) -> Self {
        MeterDecl::new(name, ValueType::U64, unit, description, field)
    }

    /// Meters named by `pattern`, which the module declares itself (their number depends on its settings): listed in
    /// the reference only.
    pub const fn pattern(pattern: &'static str, unit: &'static str, description: &'static str) -> Self {
        MeterDecl { name: pattern, ty: ValueType::U64, unit, description, field: None, across: Across::Sum }
    }

    /// A gauge that every worker sees alike (a link's carrier): readers see the largest of its cells, not the sum.
    pub const fn max_across_workers(self) -> Self {
        MeterDecl { across: Across::Max, ..self }
    }

    fn doc(&self, name: &str) -> MeterDoc {
        MeterDoc::new(name, self.ty, self.unit, self.description)
    }
}

/// Everything a module kind declares about itself, once. `S` holds the values of its settings and knobs, `M` the
/// handles of its meters (use `()` for none).
pub struct KindDecl<S: 'static, M: 'static> {
    /// The kind's name in stack files.
    pub name: &'static str,
    /// One-line description.
    pub summary: &'static str,
    /// Input ports, in order.
    pub inputs: &'static [PortDecl],
    /// Output ports, in order.
    pub outputs: &'static [PortDecl],
    /// Settings and knobs, in the order they are read (a range may depend on the ones before it).
    pub params: &'static [Param<S>],
    /// Meters with a field in `M`, and meters named by a pattern.
    pub meters: &'static [MeterDecl<M>],
    /// Meters declared elsewhere and shared by several kinds (e.g. the parse-error drop counters).
    pub more_meters: fn() -> Vec<VarSpec>,
    /// See [`ModuleInterface::breaks_cycles`].
    pub breaks_cycles: bool,
    /// The module needs a global view of the traffic (a shared queue model, a scheduler across flows, a file it
    /// writes, frames it makes itself): a stack with one runs its data plane on one worker
    /// ([`ModuleBuilder::global_view`]; docs/architecture.md, "Workers").
    pub global_view: bool,
    /// The module takes GSO super-packets whole (see [`ModuleInterface::accepts_gso`]): it handles their length
    /// fields and counts what it says it counts of them; the switch cuts them into segments before a module that
    /// does not.
    pub accepts_gso: bool,
}

impl<S, M> KindDecl<S, M> {
    /// A kind with no ports, settings or meters yet (to complete with `..KindDecl::new(..)`).
    pub const fn new(name: &'static str, summary: &'static str) -> Self {
        KindDecl {
            name,
            summary,
            inputs: &[],
            outputs: &[],
            params: &[],
            meters: &[],
            more_meters: Vec::new,
            breaks_cycles: false,
            global_view: false,
            accepts_gso: false,
        }
    }

    /// The parameters and meters, by their own names.
    fn declared(&self) -> Declared<'static, S, M> {
        Declared { params: self.params, meters: self.meters, prefix: None }
    }

    /// Reads every declared setting (defaults when not given; types and ranges checked, errors located) into
    /// `state`. Settings read by hand ([`Param::manual`]) are left to the caller, who then calls
    /// [`SettingsReader::finish`].
    pub fn read(&self, r: &mut SettingsReader<'_>, state: &mut S) -> Result<(), ConfigError> {
        self.declared().read(r, state)
    }

    /// Reads `settings` into `state` and rejects any other setting: `configure` for a kind without manual settings.
    pub fn settings(&self, settings: &Settings, mut state: S) -> Result<S, ConfigError> {
        let mut r = settings.reader(self.name);
        self.read(&mut r, &mut state)?;
        r.finish()?;
        Ok(state)
    }

    /// The variables: knobs (ranges for this state), declared meters, then the shared ones.
    pub fn vars(&self, state: &S) -> Vec<VarSpec> {
        let mut vars = self.declared().vars(state);
        vars.extend((self.more_meters)());
        vars
    }

    /// The interface: the declared ports and [`KindDecl::vars`]. A module whose ports depend on its settings
    /// replaces them.
    pub fn interface(&self, state: &S) -> ModuleInterface {
        ModuleInterface {
            inputs: self.inputs.iter().map(PortDecl::spec).collect(),
            outputs: self.outputs.iter().map(PortDecl::spec).collect(),
            vars: self.vars(state),
            breaks_cycles: self.breaks_cycles,
            accepts_gso: self.accepts_gso,
        }
    }

    /// Stores the knobs' values in their cells (in `build`), so the stack's description shows what it runs with.
    pub fn publish(&self, state: &S, vars: &ModuleVars) {
        self.declared().publish(state, vars);
    }

    /// The meter handles, bound to their cells in `vars`.
    ///
    /// # Panics
    /// If `vars` lacks a declared meter (they were not made from [`KindDecl::interface`]).
    pub fn meters(&self, vars: &ModuleVars) -> M
    where
        M: Default,
    {
        self.declared().meters(vars)
    }

    /// Writes knob `knob` (for [`crate::Module::write_knob`]): converted to its type, checked, stored in `state`.
    pub fn write(&self, state: &mut S, knob: &str, value: &Value) -> Result<(), String> {
        self.declared().write(state, knob, value)
    }

    /// A builder for a module whose interface is the declared one: `build` publishes the knobs of `state`, binds
    /// the meters and hands both to `make` (with the variables, for meters declared elsewhere).
    pub fn builder(&'static self, state: S, make: Make<S, M>) -> Box<dyn ModuleBuilder>
    where
        S: Send,
        M: Default,
    {
        Box::new(DeclBuilder { decl: self, state, make })
    }

    /// `configure` for a kind without manual settings: [`KindDecl::settings`] read into `blank`, then
    /// [`KindDecl::builder`].
    pub fn configure(
        &'static self,
        settings: &Settings,
        blank: S,
        make: Make<S, M>,
    ) -> Result<Box<dyn ModuleBuilder>, ConfigError>
    where
        S: Send,
        M: Default,
    {
        Ok(self.builder(self.settings(settings, blank)?, make))
    }

    /// The kind's entry in the module reference.
    pub fn reference(&self) -> KindReference {
        let port = |p: &PortDecl| PortDoc { name: p.name.into(), ty: p.ty.into(), description: p.description.into() };
        let (settings, mut meters) = self.declared().docs();
        meters.extend((self.more_meters)().iter().map(MeterDoc::from_spec));
        KindReference {
            kind: self.name.into(),
            summary: self.summary.into(),
            inputs: self.inputs.iter().map(port).collect(),
            outputs: self.outputs.iter().map(port).collect(),
            settings,
            meters,
            breaks_cycles: self.breaks_cycles,
            accepts_gso: self.accepts_gso,
            aliases: Vec::new(),
            note: None,
        }
    }
}

/// Settings, knobs and meters repeated for each item of a list setting (each interface of a binding scheduler), named
/// `<item>.<name>`, declared once: `I` holds one item's values, `IM` its meter handles. The kind reads the list
/// itself and calls these for each item; [`kind_from_decl!`](crate::kind_from_decl) adds the group to its reference.
pub struct GroupDecl<I: 'static, IM: 'static> {
    /// How the reference writes an item's name (`<iface>`).
    pub item: &'static str,
    /// One item's settings and knobs, in the order they are read.
    pub params: &'static [Param<I>],
    /// One item's meters.
    pub meters: &'static [MeterDecl<IM>],
}

impl<I, IM> GroupDecl<I, IM> {
    /// The parameters and meters of the item named `item`.
    fn declared<'a>(&self, item: &'a str) -> Declared<'a, I, IM> {
        Declared { params: self.params, meters: self.meters, prefix: Some(item) }
    }

    /// Reads the settings of item `item` into `state`, as [`KindDecl::read`] does.
    pub fn read(&self, r: &mut SettingsReader<'_>, item: &str, state: &mut I) -> Result<(), ConfigError> {
        self.declared(item).read(r, state)
    }

    /// The variables of item `item`: its knobs (ranges for this state), then its meters.
    pub fn vars(&self, item: &str, state: &I) -> Vec<VarSpec> {
        self.declared(item).vars(state)
    }

    /// Stores the values of item `item`'s knobs in their cells.
    pub fn publish(&self, item: &str, state: &I, vars: &ModuleVars) {
        self.declared(item).publish(state, vars);
    }

    /// The meter handles of item `item`, bound to their cells in `vars`.
    ///
    /// # Panics
    /// If `vars` lacks one of them (they were not made from [`GroupDecl::vars`]).
    pub fn meters(&self, item: &str, vars: &ModuleVars) -> IM
    where
        IM: Default,
    {
        self.declared(item).meters(vars)
    }

    /// Writes knob `knob` of item `item` (`<item>.<knob>`), as [`KindDecl::write`] does.
    pub fn write(&self, state: &mut I, item: &str, knob: &str, value: &Value) -> Result<(), String> {
        self.declared(item).write(state, knob, value)
    }

    /// The current name of knob `knob` if it is an old one ([`Param::renamed_to`]), for a module to report a write
    /// by the old name.
    pub fn new_name_of(&self, knob: &str) -> Option<&'static str> {
        self.params.iter().find(|p| p.name == knob).and_then(|p| p.renamed_to)
    }

    /// Adds the group's settings and meters, named `<item>.<name>`, to a kind's reference.
    pub fn add_to(&self, reference: &mut KindReference) {
        let (settings, meters) = self.declared(self.item).docs();
        reference.settings.extend(settings);
        reference.meters.extend(meters);
    }
}

/// Declared parameters and meters, named by their own names or, for an item of a [`GroupDecl`],
/// `<prefix>.<name>`: what both derive from them.
struct Declared<'a, S: 'static, M: 'static> {
    params: &'static [Param<S>],
    meters: &'static [MeterDecl<M>],
    prefix: Option<&'a str>,
}

impl<S, M> Declared<'_, S, M> {
    /// The full name of `name`.
    fn name<'n>(&self, name: &'n str) -> Cow<'n, str> {
        match self.prefix {
            None => Cow::Borrowed(name),
            Some(p) => Cow::Owned(format!("{p}.{name}")),
        }
    }

    fn read(&self, r: &mut SettingsReader<'_>, state: &mut S) -> Result<(), ConfigError> {
        for p in self.params {
            let name = self.name(p.name);
            if let Some(new) = p.renamed_to {
                if !r.is_given(&name) || r.is_given(&self.name(new)) {
                    // Accepted, but the new name (or its default) stands.
                    r.value(&name)?;
                    continue;
                }
            }
            p.read(r, &name, state)?;
        }
        Ok(())
    }

    /// The description of `p`, saying what it is the old name of if it is one.
    fn description(&self, p: &Param<S>) -> String {
        match p.renamed_to {
            Some(new) => format!("deprecated: the old name of `{}`, {}", self.name(new), p.description),
            None => p.description.to_string(),
        }
    }

    fn vars(&self, state: &S) -> Vec<VarSpec> {
        let knobs = self.params.iter().filter_map(|p| {
            let spec = p.spec(&self.name(p.name), state)?;
            Some(match p.renamed_to {
                Some(new) => VarSpec { description: self.description(p), ..spec.as_alias_of(&self.name(new)) },
                None => spec,
            })
        });
        let meters = self
            .meters
            .iter()
            .filter(|m| m.field.is_some())
            .map(|m| VarSpec::meter(&self.name(m.name), m.ty, m.unit, m.description).with_across(m.across));
        knobs.chain(meters).collect()
    }

    fn publish(&self, state: &S, vars: &ModuleVars) {
        for p in self.params.iter().filter(|p| p.knob) {
            if let (Some(cell), Some(v)) = (vars.cell(&self.name(p.name)), p.get(state)) {
                cell.store(&v);
            }
        }
    }

    fn meters(&self, vars: &ModuleVars) -> M
    where
        M: Default,
    {
        let mut m = M::default();
        for d in self.meters {
            if let Some(field) = d.field {
                *field(&mut m) = vars.meter(&self.name(d.name));
            }
        }
        m
    }

    fn write(&self, state: &mut S, knob: &str, value: &Value) -> Result<(), String> {
        let name = self.name(knob);
        match self.params.iter().find(|p| p.knob && p.name == knob) {
            Some(p) => p.write(&name, state, value),
            None => Err(format!("cannot set {name} to {value}: no such knob")),
        }
    }

    fn docs(&self) -> (Vec<SettingDoc>, Vec<MeterDoc>) {
        let settings = self
            .params
            .iter()
            .map(|p| SettingDoc { description: self.description(p), ..p.doc(&self.name(p.name)) })
            .collect();
        let meters = self.meters.iter().map(|m| m.doc(&self.name(m.name))).collect();
        (settings, meters)
    }
}

/// See [`KindDecl::builder`].
struct DeclBuilder<S: 'static, M: 'static> {
    decl: &'static KindDecl<S, M>,
    state: S,
    make: Make<S, M>,
}

impl<S: Send, M: Default> ModuleBuilder for DeclBuilder<S, M> {
    fn interface(&self) -> ModuleInterface {
        self.decl.interface(&self.state)
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        self.decl.publish(&self.state, vars);
        (self.make)(self.state, self.decl.meters(vars), vars)
    }

    fn global_view(&self) -> bool {
        self.decl.global_view
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::StackSpec;
    use crate::module::port_type;

    #[derive(Debug, Default, PartialEq)]
    struct Cfg {
        outputs: u64,
        select: i64,
        rate: f64,
        on: bool,
        mode: String,
        mtu: u64,
    }

    #[derive(Default)]
    struct Meters {
        frames: Meter,
        spare: [Meter; 2],
    }

    type P = Param<Cfg>;
    const DECL: KindDecl<Cfg, Meters> = KindDecl {
        inputs: &[PortDecl::new("in", port_type::ANY, "frames")],
        outputs: &[PortDecl::new("0..N-1", port_type::ANY, "one per output")],
        params: &[
            P::u64("outputs", "", "number of outputs", 2, field!(outputs)).range(1.0, 64.0).setting(),
            P::i64("select", "", "the output", 0, field!(select))
                .range_by(|c| (-1.0, c.outputs as f64 - 1.0), "-1..=outputs-1"),
            P::f64("rate", "frames/s", "sending rate", 1000.0, field!(rate)).range(0.0, 1e9),
            P::bool("on", "false pauses", true, field!(on)),
            P::text(
                "mode",
                "fast or slow",
                "fast",
                |c| c.mode.clone(),
                |c, t| match t {
                    "fast" | "slow" => {
                        c.mode = t.into();
                        Ok(())
                    }
                    _ => Err(format!("expected fast or slow, got {t:?}")),
                },
            ),
            P::u64("mtu", "bytes", "0 or 68..=65535", 0, field!(mtu)).range(0.0, 65535.0).check(|_, v| {
                if v != 0.0 && v < 68.0 {
                    return Err(format!("must be 0 or within 68..=65535, got {v}"));
                }
                Ok(())
            }),
            P::manual("rules", "array of strings", "rules, in order", "none"),
        ],
        meters: &[
            MeterDecl::u64("frames_total", "frames", "frames seen", |m| &mut m.frames),
            MeterDecl::u64("spare_a_total", "frames", "a", |m| &mut m.spare[0]),
            MeterDecl::new("spare_b", ValueType::F64, "frames/s", "b", |m| &mut m.spare[1]),
            MeterDecl::pattern("rule<N>_total", "frames", "per rule"),
        ],
        more_meters: || vec![VarSpec::meter("extra_total", ValueType::U64, "frames", "shared")],
        ..KindDecl::new("demo", "a demonstration")
    };

    fn read(text: &str) -> Result<Cfg, ConfigError> {
        let spec = StackSpec::parse("t.toml", &format!("[modules.d]\nkind = \"demo\"\n{text}")).unwrap();
        let settings = &spec.modules[0].settings;
        let mut r = settings.reader("demo");
        let mut cfg = Cfg::default();
        DECL.read(&mut r, &mut cfg)?;
        let _ = r.strings("rules")?;
        r.finish()?;
        Ok(cfg)
    }

    #[test]
    fn reads_defaults_types_and_ranges_with_locations() {
        let c = read("").unwrap();
        assert_eq!(c, Cfg { outputs: 2, select: 0, rate: 1000.0, on: true, mode: "fast".into(), mtu: 0 });
        let c = read("outputs = 4\nselect = -1\nrate = 5\non = false\nmode = \"slow\"\nmtu = 1500\n").unwrap();
        assert_eq!(c, Cfg { outputs: 4, select: -1, rate: 5.0, on: false, mode: "slow".into(), mtu: 1500 });

        let e = read("outputs = 3\nselect = 3\n").unwrap_err();
        assert_eq!(e.to_string(), "t.toml:4:10: setting `select` of a demo module: must be within -1..=2, got 3");
        let e = read("\nrate = 1e10\n").unwrap_err();
        assert_eq!(
            e.to_string(),
            "t.toml:4:8: setting `rate` of a demo module: must be within 0..=1000000000, got 10000000000"
        );
        let e = read("outputs = 0\n").unwrap_err();
        assert!(e.message.ends_with("must be within 1..=64, got 0"), "{e}");
        let e = read("mtu = 20\n").unwrap_err();
        assert!(e.message.ends_with("must be 0 or within 68..=65535, got 20"), "{e}");
        let e = read("mode = \"warp\"\n").unwrap_err();
        assert!(e.message.ends_with("expected fast or slow, got \"warp\""), "{e}");
        let e = read("on = 1\n").unwrap_err();
        assert!(e.message.contains("expected true or false, got integer 1"), "{e}");
        let e = read("bogus = 1\n").unwrap_err();
        assert!(e.message.contains("one of: mode, mtu, on, outputs, rate, rules, select"), "{e}");
    }

    #[test]
    fn interface_publish_meters_and_writes() {
        let mut cfg = read("outputs = 3\nselect = 1\n").unwrap();
        let iface = DECL.interface(&cfg);
        assert_eq!(iface.inputs, [PortSpec::new("in", port_type::ANY)]);
        let names: Vec<&str> = iface.vars.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(
            names,
            ["select", "rate", "on", "mode", "mtu", "frames_total", "spare_a_total", "spare_b", "extra_total"]
        );
        assert_eq!(iface.vars[0].range, Some((-1.0, 2.0)));

        let vars = ModuleVars::new(&iface.vars);
        DECL.publish(&cfg, &vars);
        assert_eq!(vars.cell("select").unwrap().get(), Value::I64(1));
        assert_eq!(vars.cell("mode").unwrap().get(), Value::Str("fast".into()));
        let m = DECL.meters(&vars);
        m.frames.add(3);
        m.spare[1].set_f64(2.5);
        assert_eq!(vars.cell("frames_total").unwrap().get(), Value::U64(3));
        assert_eq!(vars.cell("spare_b").unwrap().get(), Value::F64(2.5));

        DECL.write(&mut cfg, "select", &Value::U64(2)).unwrap();
        assert_eq!(cfg.select, 2);
        assert_eq!(DECL.write(&mut cfg, "select", &Value::I64(3)).unwrap_err(), "select must be within -1..=2, got 3");
        assert!(DECL.write(&mut cfg, "rate", &Value::Bool(true)).unwrap_err().contains("expected a f64 value"));
        DECL.write(&mut cfg, "rate", &Value::U64(7)).unwrap();
        assert_eq!(cfg.rate, 7.0);
        assert!(DECL.write(&mut cfg, "mode", &Value::Str("x".into())).unwrap_err().contains("fast or slow"));
        assert!(DECL.write(&mut cfg, "outputs", &Value::U64(2)).unwrap_err().contains("no such knob"));
        assert!(DECL.write(&mut cfg, "rules", &Value::U64(2)).is_err());
        assert!(DECL.write(&mut cfg, "mtu", &Value::U64(30)).unwrap_err().contains("68..=65535"));
    }

    #[derive(Debug, Default, PartialEq)]
    struct Item {
        rate: u64,
        on: bool,
    }

    #[derive(Default)]
    struct ItemMeters {
        sent: Meter,
    }

    const GROUP: GroupDecl<Item, ItemMeters> = GroupDecl {
        item: "<iface>",
        params: &[
            Param::<Item>::u64("rate", "bit/s", "its rate", 10, field!(rate)).range(0.0, 100.0),
            Param::<Item>::bool("on", "up at start", true, field!(on)).setting(),
        ],
        meters: &[MeterDecl::u64("sent_total", "frames", "frames sent", |m| &mut m.sent)],
    };

    #[test]
    fn a_group_repeats_for_each_item_under_its_name() {
        let text = "[modules.d]\nkind = \"demo\"\n\"a.rate\" = 5\n\"b.on\" = false\n\"b.rate\" = 500\n";
        let spec = StackSpec::parse("t.toml", text).unwrap();
        let mut r = spec.modules[0].settings.reader("demo");
        let (mut a, mut b) = (Item::default(), Item::default());
        GROUP.read(&mut r, "a", &mut a).unwrap();
        assert_eq!(a, Item { rate: 5, on: true });
        let e = GROUP.read(&mut r, "b", &mut b).unwrap_err();
        assert_eq!(e.to_string(), "t.toml:5:12: setting `b.rate` of a demo module: must be within 0..=100, got 500");
        assert!(!b.on, "read up to the error");

        let vars: Vec<String> = GROUP.vars("a", &a).into_iter().map(|v| v.name).collect();
        assert_eq!(vars, ["a.rate", "a.sent_total"]);
        let cells = ModuleVars::new(&GROUP.vars("a", &a));
        GROUP.publish("a", &a, &cells);
        assert_eq!(cells.cell("a.rate").unwrap().get(), Value::U64(5));
        GROUP.meters("a", &cells).sent.add(2);
        assert_eq!(cells.cell("a.sent_total").unwrap().get(), Value::U64(2));
        GROUP.write(&mut a, "a", "rate", &Value::U64(7)).unwrap();
        assert_eq!(a.rate, 7);
        assert_eq!(
            GROUP.write(&mut a, "a", "rate", &Value::U64(101)).unwrap_err(),
            "a.rate must be within 0..=100, got 101"
        );
        assert_eq!(
            GROUP.write(&mut a, "a", "on", &Value::Bool(true)).unwrap_err(),
            "cannot set a.on to true: no such knob"
        );

        let mut reference = DECL.reference();
        GROUP.add_to(&mut reference);
        let names: Vec<&str> = reference.settings.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names[7..], ["<iface>.rate", "<iface>.on"]);
        assert_eq!(reference.meters.last().unwrap().name, "<iface>.sent_total");
    }

    #[derive(Debug, Default, PartialEq)]
    struct Link {
        bps: u64,
    }

    /// `rate_mbit`, and its old name `rate_bps` in bit/s, both stored in `bps`.
    const RENAMED: GroupDecl<Link, ()> = GroupDecl {
        item: "<iface>",
        params: &[
            Param::<Link>::f64(
                "rate_mbit",
                "Mbit/s",
                "the rate",
                0.0,
                (|l| l.bps as f64 / 1e6, |l, v| l.bps = (v * 1e6) as u64),
            )
            .range(0.0, 1e6),
            Param::<Link>::u64("rate_bps", "bit/s", "in bit/s", 0, field!(bps))
                .range(0.0, 1e12)
                .renamed_to("rate_mbit"),
        ],
        meters: &[],
    };

    #[test]
    fn an_old_name_is_read_when_the_new_one_is_not_given_and_marked_as_an_alias() {
        let read = |lines: &str| -> Result<Link, ConfigError> {
            let spec = StackSpec::parse("t.toml", &format!("[modules.d]\nkind = \"demo\"\n{lines}")).unwrap();
            let mut r = spec.modules[0].settings.reader("demo");
            let mut l = Link::default();
            RENAMED.read(&mut r, "a", &mut l)?;
            r.finish()?;
            Ok(l)
        };
        assert_eq!(read("").unwrap(), Link { bps: 0 });
        assert_eq!(read("\"a.rate_mbit\" = 8\n").unwrap(), Link { bps: 8_000_000 });
        assert_eq!(read("\"a.rate_bps\" = 5000000\n").unwrap(), Link { bps: 5_000_000 });
        assert_eq!(read("\"a.rate_bps\" = 5000000\n\"a.rate_mbit\" = 8\n").unwrap(), Link { bps: 8_000_000 });
        let e = read("\"a.rate_bps\" = -1\n").unwrap_err();
        assert!(e.message.contains("setting `a.rate_bps`"), "{e}");

        let vars = RENAMED.vars("a", &Link { bps: 5_000_000 });
        assert_eq!((vars[0].name.as_str(), vars[0].alias_of.as_deref()), ("a.rate_mbit", None));
        assert_eq!((vars[1].name.as_str(), vars[1].alias_of.as_deref()), ("a.rate_bps", Some("a.rate_mbit")));
        assert_eq!(vars[1].description, "deprecated: the old name of `a.rate_mbit`, in bit/s");
        let cells = ModuleVars::new(&vars);
        RENAMED.publish("a", &Link { bps: 5_000_000 }, &cells);
        assert_eq!(cells.cell("a.rate_mbit").unwrap().get(), Value::F64(5.0));
        assert_eq!(cells.cell("a.rate_bps").unwrap().get(), Value::U64(5_000_000));
        let mut l = Link::default();
        RENAMED.write(&mut l, "a", "rate_bps", &Value::U64(7)).unwrap();
        assert_eq!(l.bps, 7);
        assert_eq!((RENAMED.new_name_of("rate_bps"), RENAMED.new_name_of("rate_mbit")), (Some("rate_mbit"), None));

        let mut reference = DECL.reference();
        RENAMED.add_to(&mut reference);
        let old = reference.settings.last().unwrap();
        assert_eq!(old.name, "<iface>.rate_bps");
        assert_eq!(old.description, "deprecated: the old name of `<iface>.rate_mbit`, in bit/s");
    }

    #[test]
    fn reference_lists_everything_without_configuring() {
        let r = DECL.reference();
        assert_eq!((r.kind.as_str(), r.summary.as_str()), ("demo", "a demonstration"));
        assert_eq!(r.outputs[0].name, "0..N-1");
        let s: Vec<(&str, &str, &str, &str, bool)> = r
            .settings
            .iter()
            .map(|s| (s.name.as_str(), s.ty.as_str(), s.default.as_str(), s.range.as_str(), s.knob))
            .collect();
        assert_eq!(
            s,
            [
                ("outputs", "u64", "2", "1..=64", false),
                ("select", "i64", "0", "-1..=outputs-1", true),
                ("rate", "f64", "1000", "0..=1000000000", true),
                ("on", "bool", "true", "", true),
                ("mode", "str", "\"fast\"", "", true),
                ("mtu", "u64", "0", "0..=65535", true),
                ("rules", "array of strings", "none", "", false),
            ]
        );
        let m: Vec<&str> = r.meters.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(m, ["frames_total", "spare_a_total", "spare_b", "rule<N>_total", "extra_total"]);
    }
}
