//! Services files: which stream services an application's flows go through, FreeNA's configuration file in TOML
//! (docs/services.md). `flexstack run --services FILE -- app` reads one.
//!
//! ```toml
//! # Global rules: for every service, after its own rules (first match wins; no match: not used).
//! [[rule]]
//! use = true
//! transport = "tcp"
//! port = 8080
//! role = "server"
//!
//! [[service]]              # services in the order the app's data goes through them, down
//! kind = "inspect"
//! patterns = ["close literal DROP TABLE"]
//!
//! [[service]]
//! kind = "compress"
//! level = 5
//! [[service.rule]]         # its own rules, before the global ones
//! use = true
//! transport = "tcp"
//! port = "8020-8021"
//! ```
//!
//! A rule has `use` (required: true or false), `transport` (`tcp`, `udp` or `*`), `port` (a number, `"8020-8021"`,
//! `"80,443"` or `"*"`) and `role` (`client`, `server` or `*`); what it leaves out is `*`. A service has `kind` (one
//! of [`kinds`]), optionally `name` (its module is `{app}-NAME`; default: its kind, numbered from the second of a
//! kind: `compress2`), its own `rule`s, and its settings, as in a stack file. Errors say `file:line:column`.

use super::flows::{parse_ports, parse_protocol, parse_role, selects, SelectRule, SELECT};
use flexstack_core::config::{entry, key_span, parse_located, valid_name, ConfigError, LineIndex, Location, Settings};
use flexstack_core::stream::{FlowInfo, Protocol, Role};
use std::net::{Ipv4Addr, SocketAddr};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// The kinds a service may have: the family's ([`super::kinds`]).
pub fn kinds() -> Vec<&'static str> {
    super::kinds().iter().map(|k| k.name()).collect()
}

/// Largest services file read, in bytes.
pub const MAX_FILE_BYTES: usize = 1 << 20;

/// Most services in one file.
pub const MAX_SERVICES: usize = 32;

/// A rule and where it was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocatedRule {
    /// The rule.
    pub rule: SelectRule,
    /// Where its table starts.
    pub location: Option<Location>,
}

/// One service of the file.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceSpec {
    /// The module kind.
    pub kind: String,
    /// The module's name after `{app}-`.
    pub name: String,
    /// Its settings (without `kind`, `name` and `rule`).
    pub settings: Settings,
    /// Its own rules.
    pub rules: Vec<LocatedRule>,
    /// Where its table starts.
    pub location: Option<Location>,
}

/// A whole services file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ServiceFile {
    /// The services, in order.
    pub services: Vec<ServiceSpec>,
    /// The global rules.
    pub rules: Vec<LocatedRule>,
    /// The endpoints' `backend` (`kernel` or `smoltcp`, [`BACKENDS`]), if the file sets one: the template then
    /// sets it on `terminate` and `originate`.
    pub backend: Option<String>,
}

/// The values of a services file's `backend`.
pub const BACKENDS: [&str; 2] = ["kernel", "smoltcp"];

/// Reads a file's spanned tables: the location of a byte offset.
struct At<'a> {
    file: Arc<str>,
    lines: LineIndex<'a>,
}

impl At<'_> {
    fn at(&self, span: Option<Range<usize>>) -> Option<Location> {
        span.map(|s| self.lines.locate(&self.file, s.start))
    }
}

/// The spanned tables of an array of tables (`[[rule]]`), with each table's span.
fn spanned_tables<'a, 'i>(t: &'a toml::de::DeTable<'i>, key: &str) -> Vec<(&'a toml::de::DeTable<'i>, Range<usize>)> {
    match entry(t, key).map(|(_, v)| v.get_ref()) {
        Some(toml::de::DeValue::Array(a)) => a
            .iter()
            .filter_map(|v| match v.get_ref() {
                toml::de::DeValue::Table(tb) => Some((tb, v.span())),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The tables of an array of tables, or an error at `key` if it is something else.
fn tables<'v>(value: &'v toml::Value, key: &str, loc: Option<Location>) -> Result<Vec<&'v toml::Table>, ConfigError> {
    let bad = || ConfigError::new(loc.clone(), format!("`{key}` must be an array of tables: [[{key}]]"));
    value.as_array().ok_or_else(bad)?.iter().map(|v| v.as_table().ok_or_else(bad)).collect()
}

fn parse_rule(
    at: &At<'_>,
    t: &toml::Table,
    spans: &toml::de::DeTable<'_>,
    start: Option<Location>,
) -> Result<LocatedRule, ConfigError> {
    let loc = |k: &str| at.at(entry(spans, k).map(|(_, v)| v.span())).or_else(|| start.clone());
    let mut rule = SelectRule { used: true, protocol: None, ports: None, role: None };
    let mut used = None;
    for (k, v) in t {
        let wrong = |what: &str| ConfigError::new(loc(k), format!("rule: `{k}` must be {what}, got {v}"));
        match k.as_str() {
            "use" => used = Some(v.as_bool().ok_or_else(|| wrong("true or false"))?),
            "transport" => {
                let s = v.as_str().ok_or_else(|| wrong("a string: tcp, udp or *"))?;
                rule.protocol = parse_protocol(s).map_err(|e| ConfigError::new(loc(k), format!("rule: {e}")))?;
            }
            "port" => {
                let text = match v {
                    toml::Value::Integer(n) => n.to_string(),
                    toml::Value::String(s) => s.clone(),
                    _ => return Err(wrong("a port (8080), a range (\"8020-8021\"), a list (\"80,443\") or \"*\"")),
                };
                rule.ports = parse_ports(&text).map_err(|e| ConfigError::new(loc(k), format!("rule: {e}")))?;
            }
            "role" => {
                let s = v.as_str().ok_or_else(|| wrong("a string: client, server or *"))?;
                rule.role = parse_role(s).map_err(|e| ConfigError::new(loc(k), format!("rule: {e}")))?;
            }
            other => {
                return Err(ConfigError::new(
                    at.at(key_span(spans, other)),
                    format!(
                        "rule: unknown key `{other}`; expected use, transport, port or role{}",
                        if other == "backend" { " (`backend` goes at the top, before the first table)" } else { "" }
                    ),
                ))
            }
        }
    }
    rule.used = used.ok_or_else(|| ConfigError::new(start.clone(), "rule: `use` is required (true or false)"))?;
    Ok(LocatedRule { rule, location: start })
}

impl ServiceFile {
    /// Parses a services file; `file` names it in errors. Settings are checked by [`ServiceFile::check`].
    pub fn parse(file: &str, text: &str) -> Result<ServiceFile, ConfigError> {
        let file: Arc<str> = Arc::from(file);
        if text.len() > MAX_FILE_BYTES {
            return Err(ConfigError::new(None, format!("{file}: services file larger than {MAX_FILE_BYTES} bytes")));
        }
        let at = At { file: file.clone(), lines: LineIndex::new(text) };
        let (spans, table) = parse_located(&file, text)?;
        let root = spans.get_ref();
        let mut out = ServiceFile::default();
        for (key, value) in &table {
            let loc = at.at(key_span(root, key));
            match key.as_str() {
                "rule" => {
                    let spanned = spanned_tables(root, "rule");
                    for (i, t) in tables(value, "rule", loc.clone())?.into_iter().enumerate() {
                        let (s, span) = spanned.get(i).map_or((None, None), |(s, r)| (Some(*s), Some(r.clone())));
                        let empty = toml::de::DeTable::default();
                        out.rules.push(parse_rule(&at, t, s.unwrap_or(&empty), at.at(span).or(loc.clone()))?);
                    }
                }
                "service" => {
                    let spanned = spanned_tables(root, "service");
                    let list = tables(value, "service", loc.clone())?;
                    if list.len() > MAX_SERVICES {
                        return Err(ConfigError::new(
                            loc,
                            format!("at most {MAX_SERVICES} services, got {}", list.len()),
                        ));
                    }
                    for (i, t) in list.into_iter().enumerate() {
                        let empty = toml::de::DeTable::default();
                        let (s, span) = spanned.get(i).map_or((&empty, None), |(s, r)| (*s, Some(r.clone())));
                        let start = at.at(span).or(loc.clone());
                        out.services.push(Self::parse_service(&at, t, s, start, &out.services)?);
                    }
                }
                "backend" => match value.as_str() {
                    Some(b) if BACKENDS.contains(&b) => out.backend = Some(b.to_string()),
                    _ => {
                        return Err(ConfigError::new(
                            at.at(entry(root, key).map(|(_, v)| v.span())).or(loc),
                            format!(
                                "backend: expected {}, got {value}",
                                BACKENDS.map(|b| format!("\"{b}\"")).join(" or ")
                            ),
                        ))
                    }
                },
                other => {
                    return Err(ConfigError::new(
                        loc,
                        format!("unknown key `{other}`; expected backend, [[service]] or [[rule]]"),
                    ))
                }
            }
        }
        if out.services.is_empty() {
            return Err(ConfigError::new(
                Some(Location { file, line: 1, column: 1 }),
                "no service: add one, e.g. [[service]] with kind = \"null\"",
            ));
        }
        for s in &out.services {
            if s.rules.is_empty() && out.rules.is_empty() {
                return Err(ConfigError::new(
                    s.location.clone(),
                    format!(
                        "service `{}` has no rule and there are no global rules, so it would apply to no flow; add \
                         one, e.g. [[rule]] with use = true",
                        s.name
                    ),
                ));
            }
        }
        Ok(out)
    }

    fn parse_service(
        at: &At<'_>,
        t: &toml::Table,
        spans: &toml::de::DeTable<'_>,
        start: Option<Location>,
        before: &[ServiceSpec],
    ) -> Result<ServiceSpec, ConfigError> {
        let loc = |k: &str| at.at(entry(spans, k).map(|(_, v)| v.span())).or_else(|| start.clone());
        let kind = match t.get("kind") {
            Some(toml::Value::String(k)) if kinds().contains(&k.as_str()) => k.clone(),
            Some(v) => {
                return Err(ConfigError::new(
                    loc("kind"),
                    format!("service: unknown kind {v}; expected one of {}", kinds().join(", ")),
                ))
            }
            None => return Err(ConfigError::new(start, "service: `kind` is required, e.g. kind = \"compress\"")),
        };
        let name = match t.get("name") {
            Some(toml::Value::String(n)) if valid_name(n) && n.len() <= 40 => n.clone(),
            Some(v) => {
                return Err(ConfigError::new(
                    loc("name"),
                    format!("service: name {v} is not a module name (lowercase letters, digits, '_', '-'; at most 40)"),
                ))
            }
            None => {
                let same = before.iter().filter(|s| s.kind == kind).count();
                if same == 0 {
                    kind.clone()
                } else {
                    format!("{kind}{}", same + 1)
                }
            }
        };
        if before.iter().any(|s| s.name == name) {
            return Err(ConfigError::new(
                loc("name").or(start),
                format!("service: two services named `{name}`; give one another `name`"),
            ));
        }
        let mut rules = Vec::new();
        let mut settings = Settings::default();
        for (k, v) in t {
            match k.as_str() {
                "kind" | "name" => {}
                "rule" => {
                    let spanned = spanned_tables(spans, "rule");
                    for (i, r) in tables(v, "rule", loc(k))?.into_iter().enumerate() {
                        let empty = toml::de::DeTable::default();
                        let (s, span) = spanned.get(i).map_or((&empty, None), |(s, r)| (*s, Some(r.clone())));
                        rules.push(parse_rule(at, r, s, at.at(span).or_else(|| loc(k)))?);
                    }
                }
                SELECT => {
                    return Err(ConfigError::new(
                        loc(k),
                        "service: `select` is made from the rules; write [[service.rule]] tables instead",
                    ))
                }
                _ => settings.insert_located(k, v.clone(), loc(k)),
            }
        }
        Ok(ServiceSpec { kind, name, settings, rules, location: start })
    }

    /// The rules of service `i`, in the order they are tried: its own, then the global ones.
    pub fn rules_of(&self, i: usize) -> impl Iterator<Item = &SelectRule> {
        self.services[i].rules.iter().chain(&self.rules).map(|r| &r.rule)
    }

    /// The settings of service `i` as its module gets them: its own, and `select` from its rules.
    pub fn settings_of(&self, i: usize) -> Settings {
        let mut s = self.services[i].settings.clone();
        let select = self.rules_of(i).map(|r| toml::Value::String(r.to_string())).collect();
        s.insert(SELECT, toml::Value::Array(select));
        s
    }

    /// Makes `path` settings of `record` services that are relative paths relative to `dir` (the file's folder), so
    /// that the daemon, wherever it runs, writes where the file means.
    pub fn resolve_paths(&mut self, dir: &Path) {
        for s in self.services.iter_mut().filter(|s| s.kind == super::record::KIND) {
            let Some(setting) = s.settings.get("path") else { continue };
            let Some(p) = setting.value.as_str().map(Path::new).filter(|p| p.is_relative()) else { continue };
            let full = dir.join(p).display().to_string();
            let location = setting.location.clone();
            s.settings.insert_located("path", toml::Value::String(full), location);
        }
    }

    /// Configures each service with `catalog`, so that a bad setting is reported at its line in this file.
    pub fn check(&self, catalog: &flexstack_core::Catalog) -> Result<(), ConfigError> {
        for (i, s) in self.services.iter().enumerate() {
            catalog.configure(&s.kind, &self.settings_of(i), s.location.clone())?;
        }
        Ok(())
    }

    /// Which services a flow goes through (their indexes), as the services decide on its `Open`.
    pub fn services_for(&self, info: &FlowInfo) -> Vec<usize> {
        (0..self.services.len()).filter(|&i| selects(&self.rules_of(i).cloned().collect::<Vec<_>>(), info)).collect()
    }

    /// `terminate`'s match table: exactly the flows some service is used for (by protocol, role and port), so a
    /// flow no service selects is not terminated at all. At most `max` rules.
    pub fn match_table(&self, max: usize) -> Result<Vec<String>, String> {
        // Every rule's port boundaries cut 0..=65535 into intervals on which every decision is constant.
        let mut cuts: Vec<u32> = vec![0, 65536];
        for i in 0..self.services.len() {
            for r in self.rules_of(i) {
                for p in r.ports.iter().flatten() {
                    cuts.extend([u32::from(p.first), u32::from(p.last) + 1]);
                }
            }
        }
        cuts.sort_unstable();
        cuts.dedup();
        let mut table = Vec::new();
        for protocol in [Protocol::Tcp, Protocol::Udp] {
            let mut per_role = Vec::new();
            for role in [Role::Client, Role::Server] {
                let mut ranges: Vec<(u32, u32)> = Vec::new();
                for w in cuts.windows(2) {
                    let dst = SocketAddr::from((Ipv4Addr::UNSPECIFIED, w[0] as u16));
                    let info = FlowInfo { protocol, src: dst, dst, app: String::new(), role };
                    if self.services_for(&info).is_empty() {
                        continue;
                    }
                    match ranges.last_mut() {
                        Some(last) if last.1 == w[0] => last.1 = w[1],
                        _ => ranges.push((w[0], w[1])),
                    }
                }
                per_role.push((role, ranges));
            }
            let all = |r: &Vec<(u32, u32)>| r == &[(0, 65536)];
            if per_role.iter().all(|(_, r)| all(r)) {
                table.push(format!("{} *", protocol.name()));
                continue;
            }
            for (role, ranges) in per_role {
                let role = if role == Role::Client { "client" } else { "server" };
                let list: Vec<String> = ranges
                    .iter()
                    .map(|&(a, b)| if b - a == 1 { a.to_string() } else { format!("{a}-{}", b - 1) })
                    .collect();
                // A terminate rule's port list stays short: a chunk of ranges per rule.
                for chunk in list.chunks(16) {
                    table.push(format!("{} dport {} role {role}", protocol.name(), chunk.join(",")));
                }
            }
        }
        if table.len() > max {
            return Err(format!(
                "the services' rules need {} match rules for terminate, more than its {max}: merge port ranges",
                table.len()
            ));
        }
        Ok(table)
    }

    /// An app's stack template with these services: `base` (a template like stacks/app-terminate.toml, with
    /// modules `{app}-term`, `{app}-orig`, `{app}-sdir` and, optionally, `{app}-streams`) with `{app}-streams`
    /// replaced by the services (modules `{app}-NAME`, a `direction` module `{app}-NAME-dir` after each but the
    /// last, which uses `{app}-sdir`), chained so that Down frames go through them in order and Up frames in
    /// reverse (`chain_links`), and the endpoints' match table (`{app}-term`'s and `{app}-orig`'s) derived from the
    /// rules. A base with a carrier `{app}-peer` (stacks/app-peer.toml) gets the services before the carrier: Down
    /// frames leave the chain into the carrier (which passes the flows it does not carry on to `{app}-orig`), and
    /// the Up frames the peer sends back enter the chain where `{app}-orig`'s do (docs/services.md, "Services
    /// between two peers").
    pub fn template(&self, base: &str, max_match_rules: usize) -> Result<String, String> {
        let mut doc: toml::Table =
            base.parse().map_err(|e: toml::de::Error| format!("the base stack: {}", e.message()))?;
        const TERM: &str = "{app}-term";
        const ORIG: &str = "{app}-orig";
        const SDIR: &str = "{app}-sdir";
        const STREAMS: &str = "{app}-streams";
        const PEER: &str = "{app}-peer";
        let modules = doc.get_mut("modules").and_then(|m| m.as_table_mut()).ok_or("the base stack has no [modules]")?;
        for m in [TERM, ORIG, SDIR] {
            if !modules.contains_key(m) {
                return Err(format!(
                    "the base stack has no module \"{m}\" (use a template like stacks/app-terminate.toml)"
                ));
            }
        }
        modules.remove(STREAMS);
        let carrier = modules.contains_key(PEER);
        let n = self.services.len();
        let names: Vec<String> = self.services.iter().map(|s| format!("{{app}}-{}", s.name)).collect();
        let dirs: Vec<String> =
            (0..n).map(|i| if i + 1 == n { SDIR.to_string() } else { format!("{}-dir", names[i]) }).collect();
        for (i, s) in self.services.iter().enumerate() {
            let mut t = toml::Table::new();
            t.insert("kind".into(), toml::Value::String(s.kind.clone()));
            t.extend(self.settings_of(i).to_table());
            modules.insert(names[i].clone(), toml::Value::Table(t));
            if i + 1 < n {
                let mut d = toml::Table::new();
                d.insert("kind".into(), toml::Value::String("direction".into()));
                modules.insert(dirs[i].clone(), toml::Value::Table(d));
            }
        }
        let table = self.match_table(max_match_rules)?;
        // Both endpoints take the table: `terminate` applies its client-role rules, `originate` its server-role ones.
        let table = toml::Value::Array(table.into_iter().map(toml::Value::String).collect());
        for m in [TERM, ORIG] {
            let t = modules.get_mut(m).and_then(|t| t.as_table_mut()).ok_or(format!("\"{m}\" is not a table"))?;
            t.insert("match".into(), table.clone());
            if let Some(b) = &self.backend {
                t.insert("backend".into(), toml::Value::String(b.clone()));
            }
        }
        let links = doc.get_mut("links").and_then(|l| l.as_array_mut()).ok_or("the base stack has no links")?;
        // The base's stream chain goes; the services' takes its place.
        links.retain(|l| {
            let l = l.as_str().unwrap_or("");
            !(l.contains(STREAMS)
                || l.starts_with(SDIR)
                || l.starts_with("{app}-term[stream]")
                || l.starts_with("{app}-orig[stream]"))
        });
        // With a carrier, the base's `{app}-sdir -> {app}-peer` and `{app}-peer[stream] -> {app}-streams` went with
        // the base's chain (its `{app}-peer[pass] -> {app}-orig[stream_in]` stays): the services' chain ends in it.
        let chain = super::chain_links_to(TERM, ORIG, carrier.then_some(PEER), &names, &dirs);
        links.extend(chain.into_iter().map(toml::Value::String));
        Ok(format!("# made by flexstack run --services from a services file and the base stack\n{doc}"))
    }
}
