//! Stack descriptions: parsing TOML with file:line errors, module settings with unknown-key rejection, link syntax,
//! and writing a running stack back as TOML.
//!
//! A stack file looks like this (module tables in order; `links` before them, as TOML requires):
//!
//! ```toml
//! links = ["src -> count", "count -> sel", "sel[0] -> sink0", "sel[1] -> sink1, tap"]
//!
//! [modules.src]
//! kind = "source"
//! rate = 1000
//!
//! [modules.count]
//! kind = "counter"
//! ```
//!
//! [`StackSpec::parse`] checks the shape (known top-level keys, a `kind` per module, valid names and link syntax).
//! Whether a kind exists and its settings are right is checked when the module is configured from its
//! [`Settings`] (see [`crate::module::ModuleKind`]); every error carries a [`Location`].

use crate::value::Value;
use indexmap::IndexMap;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// Where something was written: file, 1-based line and column.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    /// The file name as given by the user (or `<command line>`).
    pub file: Arc<str>,
    /// 1-based line.
    pub line: usize,
    /// 1-based column.
    pub column: usize,
}

impl Location {
    /// The location of byte offset `offset` in `text`.
    pub fn of_offset(file: &Arc<str>, text: &str, offset: usize) -> Location {
        let before = &text[..offset.min(text.len())];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        Location { file: file.clone(), line, column }
    }
}

/// The starts of the lines of a text, built once, so that locating many offsets in a long file (a generated stack of
/// thousands of lines) costs a binary search each rather than a count of newlines from the top.
pub struct LineIndex<'a> {
    text: &'a str,
    starts: Vec<usize>,
}

impl<'a> LineIndex<'a> {
    /// Indexes the lines of `text`.
    pub fn new(text: &'a str) -> LineIndex<'a> {
        let starts = std::iter::once(0).chain(text.match_indices('\n').map(|(i, _)| i + 1)).collect();
        LineIndex { text, starts }
    }

    /// The location of byte offset `offset`, as [`Location::of_offset`] gives it.
    pub fn locate(&self, file: &Arc<str>, offset: usize) -> Location {
        let offset = offset.min(self.text.len());
        let line = self.starts.partition_point(|&s| s <= offset);
        let start = self.starts[line - 1];
        let column = self.text[start..offset].chars().count() + 1;
        Location { file: file.clone(), line, column }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.file, self.line, self.column)
    }
}

/// A configuration error: what was expected, and where (when it came from a file).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// Where the offending text is, if it came from a file.
    pub location: Option<Location>,
    /// What is wrong and what was expected.
    pub message: String,
}

impl ConfigError {
    /// An error at `location`.
    pub fn new(location: Option<Location>, message: impl Into<String>) -> ConfigError {
        ConfigError { location, message: message.into() }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.location {
            Some(loc) => write!(f, "{loc}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

/// One setting of a module: its TOML value and where it was written.
#[derive(Clone, Debug, PartialEq)]
pub struct Setting {
    /// The value.
    pub value: toml::Value,
    /// Where the value was written, if in a file.
    pub location: Option<Location>,
}

/// The settings of one module, in the order written.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Settings {
    entries: IndexMap<String, Setting>,
}

impl Settings {
    /// Settings from `key=value` words of a command line; values are TOML (`rate=5`, `path="a b"`), bare words
    /// are taken as strings.
    pub fn from_args(args: &[String]) -> Result<Settings, ConfigError> {
        let mut s = Settings::default();
        for arg in args {
            let (key, raw) = arg
                .split_once('=')
                .ok_or_else(|| ConfigError::new(None, format!("expected key=value, got {arg:?}")))?;
            let key = key.trim();
            if !valid_name(key) {
                return Err(ConfigError::new(
                    None,
                    format!("invalid setting name {key:?}: expected lowercase letters, digits, '_' or '-'"),
                ));
            }
            let value = parse_toml_value(raw.trim()).unwrap_or_else(|| toml::Value::String(raw.to_string()));
            s.entries.insert(key.to_string(), Setting { value, location: None });
        }
        Ok(s)
    }

    /// Inserts or replaces a setting.
    pub fn insert(&mut self, key: &str, value: toml::Value) {
        match self.entries.get_mut(key) {
            Some(e) => e.value = value,
            None => {
                self.entries.insert(key.to_string(), Setting { value, location: None });
            }
        }
    }

    /// Inserts or replaces a setting written at `location` (for files other than stack descriptions that hold
    /// module settings, e.g. services files).
    pub fn insert_located(&mut self, key: &str, value: toml::Value, location: Option<Location>) {
        self.entries.insert(key.to_string(), Setting { value, location });
    }

    /// The setting named `key`.
    pub fn get(&self, key: &str) -> Option<&Setting> {
        self.entries.get(key)
    }

    /// Removes setting `key`, if it is there.
    pub fn remove(&mut self, key: &str) {
        self.entries.shift_remove(key);
    }

    /// The settings in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Setting)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// True when two settings hold the same values (locations ignored).
    pub fn same_values(&self, other: &Settings) -> bool {
        self.entries.len() == other.entries.len()
            && self.entries.iter().all(|(k, v)| other.entries.get(k).is_some_and(|o| o.value == v.value))
    }

    /// A reader that checks types and, at [`SettingsReader::finish`], rejects keys nobody asked for.
    pub fn reader<'a>(&'a self, kind: &'a str) -> SettingsReader<'a> {
        SettingsReader { settings: self, kind, asked: Vec::new() }
    }

    /// The settings as a TOML table (for writing a stack back).
    pub fn to_table(&self) -> toml::Table {
        self.entries.iter().map(|(k, v)| (k.clone(), v.value.clone())).collect()
    }
}

/// `raw` as one TOML value; `None` unless the whole text is that value (`1\nsize = 2` is not).
fn parse_toml_value(raw: &str) -> Option<toml::Value> {
    let doc: toml::Table = format!("v = {raw}").parse().ok()?;
    if doc.len() != 1 {
        return None;
    }
    doc.get("v").cloned()
}

/// Reads typed settings for one module kind and reports unknown keys.
pub struct SettingsReader<'a> {
    settings: &'a Settings,
    kind: &'a str,
    /// The keys asked for (a group's keys, `<item>.<name>`, are made while reading).
    asked: Vec<String>,
}

impl<'a> SettingsReader<'a> {
    fn typed<T>(
        &mut self,
        key: &str,
        expected: &str,
        f: impl Fn(&toml::Value) -> Option<T>,
    ) -> Result<Option<T>, ConfigError> {
        self.asked.push(key.to_string());
        let Some(s) = self.settings.entries.get(key) else {
            return Ok(None);
        };
        f(&s.value).map(Some).ok_or_else(|| {
            ConfigError::new(
                s.location.clone(),
                format!("setting `{key}` of a {} module: expected {expected}, got {}", self.kind, describe(&s.value)),
            )
        })
    }

    /// A non-negative integer.
    pub fn u64(&mut self, key: &str) -> Result<Option<u64>, ConfigError> {
        self.typed(key, "a non-negative integer", |v| v.as_integer().and_then(|i| u64::try_from(i).ok()))
    }

    /// An integer.
    pub fn i64(&mut self, key: &str) -> Result<Option<i64>, ConfigError> {
        self.typed(key, "an integer", toml::Value::as_integer)
    }

    /// A number (integers accepted).
    pub fn f64(&mut self, key: &str) -> Result<Option<f64>, ConfigError> {
        self.typed(key, "a number", |v| {
            v.as_float().or_else(|| v.as_integer().map(|i| i as f64)).filter(|f| f.is_finite())
        })
    }

    /// true or false.
    pub fn bool(&mut self, key: &str) -> Result<Option<bool>, ConfigError> {
        self.typed(key, "true or false", toml::Value::as_bool)
    }

    /// A string.
    pub fn string(&mut self, key: &str) -> Result<Option<String>, ConfigError> {
        self.typed(key, "a string", |v| v.as_str().map(str::to_string))
    }

    /// An array of strings (e.g. rules, one per element); an empty array gives an empty vector.
    pub fn strings(&mut self, key: &str) -> Result<Option<Vec<String>>, ConfigError> {
        self.typed(key, "an array of strings", |v| {
            v.as_array()?.iter().map(|e| e.as_str().map(str::to_string)).collect()
        })
    }

    /// A value of any scalar type, as a [`Value`].
    pub fn value(&mut self, key: &str) -> Result<Option<Value>, ConfigError> {
        self.typed(key, "a number, boolean or string", Value::from_toml)
    }

    /// A non-negative integer within `min..=max`, `default` when not given.
    pub fn u64_in(&mut self, key: &str, default: u64, min: u64, max: u64) -> Result<u64, ConfigError> {
        let v = self.u64(key)?.unwrap_or(default);
        if v < min || v > max {
            return Err(self.error(key, format_args!("must be within {min}..={max}, got {v}")));
        }
        Ok(v)
    }

    /// A number within `min..=max`, `default` when not given.
    pub fn f64_in(&mut self, key: &str, default: f64, min: f64, max: f64) -> Result<f64, ConfigError> {
        let v = self.f64(key)?.unwrap_or(default);
        if !(min..=max).contains(&v) {
            return Err(self.error(key, format_args!("must be within {min}..={max}, got {v}")));
        }
        Ok(v)
    }

    /// True if setting `key` was given (whether or not it was read).
    pub fn is_given(&self, key: &str) -> bool {
        self.settings.entries.contains_key(key)
    }

    /// An error about setting `key` (e.g. out of range), located where the setting was written.
    pub fn error(&self, key: &str, message: impl fmt::Display) -> ConfigError {
        let location = self.settings.entries.get(key).and_then(|s| s.location.clone());
        ConfigError::new(location, format!("setting `{key}` of a {} module: {message}", self.kind))
    }

    /// Fails on the first setting that was never asked for, listing the ones this kind accepts.
    pub fn finish(self) -> Result<(), ConfigError> {
        for (key, s) in &self.settings.entries {
            if !self.asked.contains(key) {
                let mut known = self.asked.clone();
                known.sort_unstable();
                known.dedup();
                let expected =
                    if known.is_empty() { "no settings".to_string() } else { format!("one of: {}", known.join(", ")) };
                return Err(ConfigError::new(
                    s.location.clone(),
                    format!("unknown setting `{key}` for a {} module; expected {expected}", self.kind),
                ));
            }
        }
        Ok(())
    }
}

/// A TOML value as errors name it: its type and, for scalars, the value (`string "fast"`, `an array`).
pub fn describe(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => format!("string {s:?}"),
        toml::Value::Integer(i) => format!("integer {i}"),
        toml::Value::Float(f) => format!("float {f}"),
        toml::Value::Boolean(b) => format!("boolean {b}"),
        toml::Value::Datetime(d) => format!("datetime {d}"),
        toml::Value::Array(_) => "an array".to_string(),
        toml::Value::Table(_) => "a table".to_string(),
    }
}

/// True for a valid module, port or setting name: a lowercase letter or digit, then letters, digits, `_` or `-`.
pub fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
        && name.len() <= 64
}

/// One end of a link: a module and, optionally, a port (`name` or `name[port]`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    /// Module name.
    pub module: String,
    /// Port name; `None` means the module's only (default) port.
    pub port: Option<String>,
}

impl Endpoint {
    fn parse(text: &str) -> Result<Endpoint, String> {
        let text = text.trim();
        let (module, port) = match text.split_once('[') {
            Some((m, rest)) => {
                let port = rest.strip_suffix(']').ok_or_else(|| format!("expected `]` after the port in {text:?}"))?;
                (m.trim(), Some(port.trim().to_string()))
            }
            None => (text, None),
        };
        if !valid_name(module) {
            return Err(format!("expected a module name (lowercase letters, digits, '_', '-'), got {module:?}"));
        }
        if let Some(p) = &port {
            if !valid_name(p) {
                return Err(format!("expected a port name inside [...], got {p:?}"));
            }
        }
        Ok(Endpoint { module: module.to_string(), port })
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.port {
            Some(p) => write!(f, "{}[{p}]", self.module),
            None => f.write_str(&self.module),
        }
    }
}

/// A link as written: one sender port to one or more receivers (`"a[p] -> b, c[q]"`; several = copies).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LinkSpec {
    /// The sending module and output port.
    pub from: Endpoint,
    /// The receiving modules and input ports.
    pub to: Vec<Endpoint>,
}

impl LinkSpec {
    /// Parses `"a[p] -> b, c[q]"`.
    pub fn parse(text: &str) -> Result<LinkSpec, String> {
        let (from, to) =
            text.split_once("->").ok_or_else(|| format!("expected `SENDER[PORT] -> RECEIVER, ...` in {text:?}"))?;
        let from = Endpoint::parse(from)?;
        let to = to.split(',').map(Endpoint::parse).collect::<Result<Vec<_>, _>>()?;
        Ok(LinkSpec { from, to })
    }
}

impl fmt::Display for LinkSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> ", self.from)?;
        for (i, t) in self.to.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{t}")?;
        }
        Ok(())
    }
}

/// A module as described in a stack file.
#[derive(Clone, Debug, PartialEq)]
pub struct ModuleSpec {
    /// Unique module name.
    pub name: String,
    /// Module kind (`counter`, `tap`, ...).
    pub kind: String,
    /// Settings other than `kind`.
    pub settings: Settings,
    /// Where the module's table starts.
    pub location: Option<Location>,
}

/// A link as described in a stack file, with where it was written.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkEntry {
    /// The link.
    pub link: LinkSpec,
    /// Where it was written.
    pub location: Option<Location>,
}

/// A whole stack description.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StackSpec {
    /// Modules in order.
    pub modules: Vec<ModuleSpec>,
    /// Links in order.
    pub links: Vec<LinkEntry>,
}

/// Largest stack description accepted, in bytes.
pub const MAX_STACK_FILE_BYTES: usize = 4 << 20;

impl StackSpec {
    /// Parses a stack description; `file` names it in errors.
    pub fn parse(file: &str, text: &str) -> Result<StackSpec, ConfigError> {
        let file: Arc<str> = Arc::from(file);
        if text.len() > MAX_STACK_FILE_BYTES {
            return Err(ConfigError::new(
                None,
                format!("{file}: stack description larger than {MAX_STACK_FILE_BYTES} bytes"),
            ));
        }
        let lines = LineIndex::new(text);
        let at = |span: Range<usize>| Some(lines.locate(&file, span.start));
        let (spans, table) = parse_located(&file, text)?;
        let root = spans.get_ref();
        let empty = toml::de::DeTable::default();
        let mut spec = StackSpec::default();
        for (key, value) in &table {
            let loc = key_span(root, key).and_then(&at);
            match key.as_str() {
                "links" => {
                    let items = value.as_array().ok_or_else(|| {
                        ConfigError::new(loc.clone(), "`links` must be an array of strings like \"a -> b\"")
                    })?;
                    let item_spans: Vec<Range<usize>> = entry(root, "links")
                        .and_then(|(_, v)| match v.get_ref() {
                            toml::de::DeValue::Array(a) => Some(a.iter().map(|e| e.span()).collect()),
                            _ => None,
                        })
                        .unwrap_or_default();
                    for (i, item) in items.iter().enumerate() {
                        let iloc = item_spans.get(i).cloned().and_then(&at).or_else(|| loc.clone());
                        let text = item.as_str().ok_or_else(|| {
                            ConfigError::new(iloc.clone(), "expected a link string like \"a[port] -> b, c\"")
                        })?;
                        let link = LinkSpec::parse(text).map_err(|m| ConfigError::new(iloc.clone(), m))?;
                        spec.links.push(LinkEntry { link, location: iloc });
                    }
                }
                "modules" => {
                    let modules = value
                        .as_table()
                        .ok_or_else(|| ConfigError::new(loc.clone(), "`modules` must be a table of module tables"))?;
                    let mod_spans = sub_table(root, "modules").unwrap_or(&empty);
                    for (name, body) in modules {
                        let mloc = key_span(mod_spans, name).and_then(&at).or_else(|| loc.clone());
                        if !valid_name(name) {
                            return Err(ConfigError::new(mloc, format!("invalid module name {name:?}: expected lowercase letters, digits, '_' or '-' (at most 64)")));
                        }
                        let body = body.as_table().ok_or_else(|| {
                            ConfigError::new(mloc.clone(), format!("module `{name}` must be a table with a `kind`"))
                        })?;
                        let body_spans = sub_table(mod_spans, name).unwrap_or(&empty);
                        let kind = match body.get("kind") {
                            Some(toml::Value::String(k)) => k.clone(),
                            Some(_) => {
                                let kloc = key_span(body_spans, "kind").and_then(&at);
                                return Err(ConfigError::new(
                                    kloc,
                                    format!("module `{name}`: `kind` must be a string"),
                                ));
                            }
                            None => {
                                return Err(ConfigError::new(
                                    mloc,
                                    format!("module `{name}` has no `kind` (expected e.g. kind = \"counter\")"),
                                ))
                            }
                        };
                        let mut settings = Settings::default();
                        for (k, v) in body.iter().filter(|(k, _)| k.as_str() != "kind") {
                            let sloc = entry(body_spans, k).map(|(_, v)| v.span()).and_then(&at);
                            settings.entries.insert(k.clone(), Setting { value: v.clone(), location: sloc });
                        }
                        spec.modules.push(ModuleSpec { name: name.clone(), kind, settings, location: mloc });
                    }
                }
                other => {
                    return Err(ConfigError::new(loc, format!("unknown key `{other}`; expected `links` or `modules`")));
                }
            }
        }
        Ok(spec)
    }

    /// Writes the description as TOML that [`StackSpec::parse`] reads back to an equal stack.
    pub fn to_toml(&self) -> String {
        let mut root = toml::Table::new();
        let links: Vec<toml::Value> = self.links.iter().map(|l| toml::Value::String(l.link.to_string())).collect();
        root.insert("links".into(), toml::Value::Array(links));
        let mut modules = toml::Table::new();
        for m in &self.modules {
            let mut t = toml::Table::new();
            t.insert("kind".into(), toml::Value::String(m.kind.clone()));
            t.extend(m.settings.to_table());
            modules.insert(m.name.clone(), toml::Value::Table(t));
        }
        root.insert("modules".into(), toml::Value::Table(modules));
        let body = toml::to_string_pretty(&root).unwrap_or_default();
        format!("# flexstack stack description\n{body}")
    }
}

/// Parses `text` twice, as spanned tables (for locations) and as a [`toml::Table`] (for values); a syntax error, or
/// (from the second pass) a value TOML cannot hold, such as an integer beyond i64, is a [`ConfigError`] located in
/// `file`, with the parser's message alone (no snippet of its own). Shared by every TOML description flexstack reads.
pub fn parse_located<'i>(
    file: &Arc<str>,
    text: &'i str,
) -> Result<(toml::Spanned<toml::de::DeTable<'i>>, toml::Table), ConfigError> {
    let invalid = |span: Option<Range<usize>>, message: &str| {
        let loc = span.map(|s| Location::of_offset(file, text, s.start));
        ConfigError::new(
            loc.or_else(|| Some(Location { file: file.clone(), line: 1, column: 1 })),
            format!("invalid TOML: {}", message.trim()),
        )
    };
    let spans = toml::de::DeTable::parse(text).map_err(|e| invalid(e.span(), e.message()))?;
    let table: toml::Table = toml::from_str(text).map_err(|e| invalid(e.span(), e.message()))?;
    Ok((spans, table))
}

/// A key and its value in a spanned table, as [`entry`] returns them.
pub type SpannedEntry<'a, 'i> = (&'a toml::Spanned<toml::de::DeString<'i>>, &'a toml::Spanned<toml::de::DeValue<'i>>);

/// The key and value spans of `key` in a spanned table (from [`parse_located`]).
pub fn entry<'a, 'i>(t: &'a toml::de::DeTable<'i>, key: &str) -> Option<SpannedEntry<'a, 'i>> {
    t.iter().find(|(k, _)| k.get_ref().as_ref() == key)
}

/// Where `key` is written in a spanned table (from [`parse_located`]).
pub fn key_span(t: &toml::de::DeTable<'_>, key: &str) -> Option<Range<usize>> {
    entry(t, key).map(|(k, _)| k.span())
}

/// The spanned sub-table under `key` (from [`parse_located`]).
pub fn sub_table<'a, 'i>(t: &'a toml::de::DeTable<'i>, key: &str) -> Option<&'a toml::de::DeTable<'i>> {
    match entry(t, key)?.1.get_ref() {
        toml::de::DeValue::Table(tb) => Some(tb),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"links = [
  "src -> count",
  "count -> sel",
  "sel[0] -> sink0",
  "sel[1] -> sink1, tap",
]

[modules.src]
kind = "source"
rate = 1000

[modules.count]
kind = "counter"
"#;

    #[test]
    fn parses_modules_links_and_locations() {
        let spec = StackSpec::parse("ex.toml", EXAMPLE).unwrap();
        assert_eq!(spec.modules.len(), 2);
        assert_eq!(spec.modules[0].name, "src");
        assert_eq!(spec.modules[0].kind, "source");
        let rate = spec.modules[0].settings.get("rate").unwrap();
        assert_eq!(rate.value, toml::Value::Integer(1000));
        assert_eq!(rate.location.as_ref().unwrap().line, 10);
        assert_eq!(spec.links[3].link.to.len(), 2);
        assert_eq!(spec.links[3].location.as_ref().unwrap().line, 5);
        assert_eq!(spec.links[2].link.from.port.as_deref(), Some("0"));
    }

    #[test]
    fn the_line_index_locates_every_offset_as_counting_newlines_does() {
        let file: Arc<str> = Arc::from("x.toml");
        let text = "a = 1\n\n[modules.é]\nkind = \"ü\" # ñ\n\nlast";
        let lines = LineIndex::new(text);
        for offset in (0..=text.len() + 2).filter(|&o| o >= text.len() || text.is_char_boundary(o)) {
            assert_eq!(lines.locate(&file, offset), Location::of_offset(&file, text, offset), "offset {offset}");
        }
        assert_eq!(lines.locate(&file, text.len()).line, 6);
    }

    #[test]
    fn settings_far_down_a_generated_stack_have_their_lines() {
        let n = 4_000;
        let text: String = (0..n).map(|i| format!("[modules.m{i}]\nkind = \"counter\"\nrate = {i}\n\n")).collect();
        let spec = StackSpec::parse("big.toml", &text).unwrap();
        assert_eq!(spec.modules.len(), n);
        let last = spec.modules[n - 1].settings.get("rate").unwrap();
        assert_eq!(last.location.as_ref().unwrap().line, 4 * (n - 1) + 3);
    }

    #[test]
    fn round_trips_through_toml() {
        let spec = StackSpec::parse("ex.toml", EXAMPLE).unwrap();
        let again = StackSpec::parse("saved.toml", &spec.to_toml()).unwrap();
        assert_eq!(again.modules.len(), spec.modules.len());
        for (a, b) in again.modules.iter().zip(&spec.modules) {
            assert_eq!((&a.name, &a.kind), (&b.name, &b.kind));
            assert!(a.settings.same_values(&b.settings));
        }
        let la: Vec<_> = again.links.iter().map(|l| l.link.clone()).collect();
        let lb: Vec<_> = spec.links.iter().map(|l| l.link.clone()).collect();
        assert_eq!(la, lb);
    }

    #[test]
    fn errors_name_file_line_and_expectation() {
        let e = StackSpec::parse("bad.toml", "links = [\"a -> \"]\n").unwrap_err();
        assert_eq!(e.location.as_ref().unwrap().line, 1);
        assert!(e.message.contains("module name"), "{e}");

        let e = StackSpec::parse("bad.toml", "\n\n[modules.x]\nkind = 3\n").unwrap_err();
        assert_eq!(e.to_string().split(':').take(2).collect::<Vec<_>>(), ["bad.toml", "4"]);

        let e = StackSpec::parse("bad.toml", "[modules.x]\nrate = 3\n").unwrap_err();
        assert!(e.message.contains("no `kind`"), "{e}");

        let e = StackSpec::parse("bad.toml", "\nmodulez = 1\n").unwrap_err();
        assert_eq!(e.location.as_ref().unwrap().line, 2);
        assert!(e.message.contains("unknown key `modulez`"));

        let e = StackSpec::parse("bad.toml", "[modules.x\nkind='a'\n").unwrap_err();
        assert!(e.to_string().starts_with("bad.toml:1:"), "{e}");
        assert!(e.message.contains("invalid TOML"));

        let e = StackSpec::parse("bad.toml", "[modules.Bad]\nkind='a'\n").unwrap_err();
        assert!(e.message.contains("invalid module name"));

        // Values TOML cannot hold are found by the second pass; still located, with a one-line message.
        for (text, line, column) in [
            ("[modules.s]\nkind = \"source\"\nrate = 18446744073709551616\n", 3, 8),
            ("[modules.s]\n\nrate = 1e309\n", 3, 8),
            ("\nlinks = [\"a -> b\", 99999999999999999999999]\n", 2, 20),
        ] {
            let e = StackSpec::parse("bad.toml", text).unwrap_err();
            let loc = e.location.as_ref().unwrap_or_else(|| panic!("{text:?}: no location: {e}"));
            assert_eq!((loc.line, loc.column), (line, column), "{text:?}: {e}");
            assert!(e.message.starts_with("invalid TOML: ") && !e.message.contains('\n'), "{e}");
        }
    }

    #[test]
    fn reader_rejects_unknown_and_mistyped_settings() {
        let spec = StackSpec::parse("s.toml", "[modules.c]\nkind = \"counter\"\nrate = \"fast\"\nbogus = 1\n").unwrap();
        let s = &spec.modules[0].settings;
        let mut r = s.reader("counter");
        let e = r.u64("rate").unwrap_err();
        assert_eq!(e.location.as_ref().unwrap().line, 3);
        assert!(e.message.contains("expected a non-negative integer, got string \"fast\""), "{e}");
        let mut r = s.reader("counter");
        let _ = r.string("rate");
        let e = r.finish().unwrap_err();
        assert_eq!(e.location.as_ref().unwrap().line, 4);
        assert!(e.message.contains("unknown setting `bogus`") && e.message.contains("one of: rate"), "{e}");
    }

    #[test]
    fn reader_reads_arrays_of_strings() {
        let spec = StackSpec::parse(
            "s.toml",
            "[modules.f]\nkind = \"firewall\"\nrules = [\"a\", \"b c\"]\nnone = []\nbad = [\"a\", 1]\nscalar = \"a\"\n",
        )
        .unwrap();
        let s = &spec.modules[0].settings;
        let mut r = s.reader("firewall");
        assert_eq!(r.strings("rules").unwrap(), Some(vec!["a".to_string(), "b c".to_string()]));
        assert_eq!(r.strings("none").unwrap(), Some(vec![]));
        assert_eq!(r.strings("missing").unwrap(), None);
        let e = r.strings("bad").unwrap_err();
        assert_eq!(e.location.as_ref().unwrap().line, 5);
        assert!(e.message.contains("expected an array of strings, got an array"), "{e}");
        let e = r.strings("scalar").unwrap_err();
        assert!(e.message.contains("got string \"a\""), "{e}");
        let s = Settings::from_args(&["rules=[\"x y\", \"z\"]".into()]).unwrap();
        assert_eq!(s.reader("f").strings("rules").unwrap(), Some(vec!["x y".to_string(), "z".to_string()]));
    }

    #[test]
    fn link_syntax() {
        let l = LinkSpec::parse("classify[udp] -> nat[in], log").unwrap();
        assert_eq!(l.to_string(), "classify[udp] -> nat[in], log");
        assert!(LinkSpec::parse("a b").is_err());
        assert!(LinkSpec::parse("a[p -> b").is_err());
        assert!(LinkSpec::parse("a -> B").is_err());
        assert!(LinkSpec::parse("a ->").is_err());
    }

    #[test]
    fn settings_from_args() {
        let s = Settings::from_args(&["rate=5".into(), "path=/tmp/x y.pcapng".into(), "on=true".into()]).unwrap();
        assert_eq!(s.get("rate").unwrap().value, toml::Value::Integer(5));
        assert_eq!(s.get("path").unwrap().value, toml::Value::String("/tmp/x y.pcapng".into()));
        assert_eq!(s.get("on").unwrap().value, toml::Value::Boolean(true));
        assert!(Settings::from_args(&["novalue".into()]).is_err());
        // A value is one TOML value or else text, never the first of several keys.
        let s = Settings::from_args(&["rate=5\nsize=9".into(), "x=1 # note".into()]).unwrap();
        assert_eq!(s.get("rate").unwrap().value, toml::Value::String("5\nsize=9".into()));
        assert_eq!(s.get("x").unwrap().value, toml::Value::Integer(1));
        assert!(s.get("size").is_none());
    }
}
