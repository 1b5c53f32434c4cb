//! The module reference: what every kind of a [`Catalog`](crate::Catalog) offers (ports, settings, knobs,
//! meters), described without configuring a module, and rendered as markdown (docs/modules.md, `flexstack module
//! kinds --markdown`).
//!
//! A kind with a [`crate::decl::KindDecl`] describes itself from it. A kind without one is described by the
//! default [`crate::ModuleKind::reference`]: the interface of a module configured with no settings, which says
//! nothing about settings that are not knobs (and nothing at all if the kind needs settings).
//! [`crate::Catalog::reference`] gathers every kind's entry; [`markdown`] renders them.

use crate::value::ValueType;
use crate::vars::VarSpec;
use std::fmt::Write as _;

/// A port in the reference.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortDoc {
    /// Name (or words, for ports that depend on settings).
    pub name: String,
    /// Frame type.
    pub ty: String,
    /// What goes through it.
    pub description: String,
}

/// A setting (or knob) in the reference.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SettingDoc {
    /// Name.
    pub name: String,
    /// Type (`u64`, `f64`, `bool`, `str`, or words such as `array of strings`).
    pub ty: String,
    /// Unit, or empty.
    pub unit: String,
    /// Default, as written in a stack file (or words such as `required`).
    pub default: String,
    /// Accepted range (`0..=100`, or words), or empty.
    pub range: String,
    /// True for a knob: a variable, writable while the module runs.
    pub knob: bool,
    /// One-line description.
    pub description: String,
}

/// A meter in the reference.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeterDoc {
    /// Name (or pattern: `rule<N>_matches_total`).
    pub name: String,
    /// Value type.
    pub ty: ValueType,
    /// Unit, or empty.
    pub unit: String,
    /// One-line description.
    pub description: String,
}

impl MeterDoc {
    /// A meter `name`.
    pub fn new(name: &str, ty: ValueType, unit: &str, description: &str) -> MeterDoc {
        MeterDoc { name: name.into(), ty, unit: unit.into(), description: description.into() }
    }

    /// The meter declared by `spec`.
    pub fn from_spec(spec: &VarSpec) -> MeterDoc {
        MeterDoc::new(&spec.name, spec.ty, &spec.unit, &spec.description)
    }
}

/// What a module kind offers, for the reference.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KindReference {
    /// The kind's name.
    pub kind: String,
    /// One-line description.
    pub summary: String,
    /// Input ports.
    pub inputs: Vec<PortDoc>,
    /// Output ports.
    pub outputs: Vec<PortDoc>,
    /// Settings and knobs, in the order the kind reads them.
    pub settings: Vec<SettingDoc>,
    /// Meters.
    pub meters: Vec<MeterDoc>,
    /// True if the module holds frames and may sit in a cycle of links.
    pub breaks_cycles: bool,
    /// True if the module takes GSO super-packets whole (otherwise the switch cuts them into segments first).
    pub accepts_gso: bool,
    /// Old names of the kind that still load (filled in by [`crate::Catalog::reference`]).
    pub aliases: Vec<String>,
    /// A remark on how the entry was made, for kinds not described by declarations.
    pub note: Option<String>,
}

impl KindReference {
    /// The kind's section of the reference, in markdown.
    pub fn markdown(&self) -> String {
        let mut out = format!("## `{}`\n\n{}\n", self.kind, cell(&self.summary));
        if !self.aliases.is_empty() {
            let old: Vec<String> = self.aliases.iter().map(|a| format!("`{a}`")).collect();
            let _ =
                writeln!(out, "\nFormerly {}: the old name still loads, with a deprecation warning.", old.join(", "));
        }
        if self.breaks_cycles {
            out.push_str("\nHolds frames and releases them on a later poll, so it may sit in a cycle of links.\n");
        }
        if self.accepts_gso {
            out.push_str(
                "\nTakes GSO super-packets whole (the switch cuts them into segments before kinds that do not).\n",
            );
        }
        if let Some(note) = &self.note {
            let _ = writeln!(out, "\n*{note}*");
        }
        let ports: Vec<(&str, &PortDoc)> =
            (self.inputs.iter().map(|p| ("input", p))).chain(self.outputs.iter().map(|p| ("output", p))).collect();
        if !ports.is_empty() {
            out.push_str("\n| port | direction | type | description |\n|---|---|---|---|\n");
            for (dir, p) in ports {
                let _ = writeln!(out, "| `{}` | {dir} | {} | {} |", p.name, p.ty, cell(&p.description));
            }
        }
        if !self.settings.is_empty() {
            out.push_str("\n| setting | knob | type | unit | default | range | description |\n");
            out.push_str("|---|---|---|---|---|---|---|\n");
            for s in &self.settings {
                let _ = writeln!(
                    out,
                    "| `{}` | {} | {} | {} | {} | {} | {} |",
                    s.name,
                    if s.knob { "knob" } else { "" },
                    cell(&s.ty),
                    cell(&s.unit),
                    code(&s.default),
                    code(&s.range),
                    cell(&s.description)
                );
            }
        }
        if !self.meters.is_empty() {
            out.push_str("\n| meter | type | unit | description |\n|---|---|---|---|\n");
            for m in &self.meters {
                let _ = writeln!(out, "| `{}` | {} | {} | {} |", m.name, m.ty, cell(&m.unit), cell(&m.description));
            }
        }
        out
    }
}

/// Text for a table cell: `|` escaped.
fn cell(text: &str) -> String {
    text.replace('|', "\\|")
}

/// A value for a table cell, as code (empty stays empty).
fn code(text: &str) -> String {
    if text.is_empty() {
        String::new()
    } else {
        format!("`{}`", cell(text))
    }
}

/// The whole module reference in markdown: every kind of `kinds` (a catalog's [`crate::Catalog::reference`]), its
/// ports, settings, knobs and meters.
pub fn markdown(kinds: &[KindReference]) -> String {
    let mut out = String::from(
        "# Module reference

<!-- Generated from the kinds' declarations by `flexstack module kinds --markdown > docs/modules.md`: do not edit.
     tests/module_reference.rs fails when this file is stale. -->

Every module kind flexstack can load, with its ports, settings, knobs and meters. A knob is also accepted as a
setting of the same name, and can be changed while the module runs (`flexstack set module.NAME.KNOB VALUE`); the
other settings are read when the module is loaded or replaced. Meters use base units; counters end in `_total`. Every
module also has the switch's own meters (`frames_in_total`, `frames_out_total`, `frames_dropped_total`, per port
`port.P.*`) and an implicit output port `ctl`. How each kind behaves is documented in its source file's header.

| kind | summary |
|---|---|
",
    );
    for k in kinds {
        let _ = writeln!(out, "| [`{}`](#{}) | {} |", k.kind, k.kind, cell(&k.summary));
    }
    for k in kinds {
        out.push('\n');
        out.push_str(&k.markdown());
    }
    out
}
