//! The checks of the parsers of text and JSON: stack files, links, control requests, values, name patterns and
//! command-line settings. One function per parser (`check_*`: whether the parser accepted the input, or what is
//! wrong), shared by the stable-Rust fuzz test `tests/fuzz_parsers.rs` (which includes this file) and the libFuzzer
//! targets in `fuzz/fuzz_targets/`. Every `path` setting that could create a file is rewritten into `dir` first.

use flexstack_api::ops::{Get, LinkAdd, LinkDel, ModuleLoad, ModuleReplace, Set, VarList, Watch};
use flexstack_api::protocol::{parse_request, request_line, ErrorCode, Request, Response};
use flexstack_core::config::{valid_name, LinkSpec, Settings, StackSpec, MAX_STACK_FILE_BYTES};
use flexstack_core::value::{Value, ValueType};
use flexstack_core::vars::{is_pattern, name_matches};
use flexstack_core::ConfigError;
use flexstack_core::ModuleVars;
use serde_json::Value as Json;
use std::path::Path;

/// Longest variable name the pattern target matches against (real ones are much shorter).
pub const MAX_NAME: usize = 256;

/// Fails with `message` unless `cond`.
pub fn ensure(cond: bool, message: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(message())
    }
}

pub fn text(input: &[u8]) -> String {
    String::from_utf8_lossy(input).into_owned()
}

/// True when serde_json parses every float exactly (its `float_roundtrip` feature). Without it, a float read back
/// from JSON may be a few ULPs off, and the properties below allow that much (and no more).
pub fn json_floats_exact() -> bool {
    ["1.1844674407370955e20", "-1844674407370955.0", "4.9e-32", "100.92233720368547"]
        .iter()
        .all(|t| serde_json::from_str::<f64>(t).ok().map(f64::to_bits) == t.parse::<f64>().ok().map(f64::to_bits))
}

/// Equal floats, or (when serde_json rounds: up to 2 ULPs off, and about 30% of random f64s are) close ones.
pub fn float_close(a: f64, b: f64) -> bool {
    a == b || (!json_floats_exact() && a.signum() == b.signum() && a.to_bits().abs_diff(b.to_bits()) <= 4)
}

/// Equal JSON values, up to what serde_json's float parsing loses (see [`json_floats_exact`]).
pub fn json_eq(a: &Json, b: &Json) -> bool {
    match (a, b) {
        (Json::Number(x), Json::Number(y)) if x.is_f64() || y.is_f64() => {
            x == y || x.as_f64().zip(y.as_f64()).is_some_and(|(x, y)| float_close(x, y))
        }
        (Json::Array(x), Json::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(x, y)| json_eq(x, y)),
        (Json::Object(x), Json::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| json_eq(v, w)))
        }
        _ => a == b,
    }
}

pub fn json_opt_eq(a: Option<&Json>, b: Option<&Json>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => json_eq(a, b),
        (a, b) => a.is_none() && b.is_none(),
    }
}

/// Equal TOML values, where NaN equals NaN.
pub fn toml_eq(a: &toml::Value, b: &toml::Value) -> bool {
    use toml::Value as T;
    match (a, b) {
        (T::Float(x), T::Float(y)) => x == y || (x.is_nan() && y.is_nan()),
        (T::Array(x), T::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(x, y)| toml_eq(x, y)),
        (T::Table(x), T::Table(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| toml_eq(v, w)))
        }
        _ => a == b,
    }
}

pub fn same_settings(a: &Settings, b: &Settings) -> bool {
    a.iter().count() == b.iter().count() && a.iter().all(|(k, s)| b.get(k).is_some_and(|o| toml_eq(&s.value, &o.value)))
}

/// True if a tap's `exists` setting makes a new file for each tap: absent (`None`) or the text `"suffix"` (an
/// `exists` that is not text is `Some(None)`: it fails the configuration and is kept).
pub fn multiplies_files(exists: Option<Option<&str>>) -> bool {
    exists.is_none_or(|e| e == Some("suffix"))
}

/// Settings safe to configure: a `path` that could create a file points into `dir` instead, and adds to one file
/// (a tap never overwrites a capture: with the default `exists = "suffix"` each tap configured would leave a file
/// of its own).
pub fn contained(settings: &Settings, dir: &Path) -> Settings {
    let mut s = settings.clone();
    if let Some(p) = settings.get("path") {
        if p.value.as_str().is_some_and(|p| !p.is_empty()) {
            s.insert("path", toml::Value::String(dir.join("fuzz.pcapng").display().to_string()));
            let exists = settings.get("exists").map(|e| e.value.as_str());
            if multiplies_files(exists) {
                s.insert("exists", toml::Value::String("append".into()));
            }
        }
    }
    s
}

/// Module kinds whose configuration changes the machine: the faces create a TUN interface or open a packet socket
/// on an interface, and `packet` with `take_over` flushes that interface's addresses. A fuzzer running as root
/// would find them (libFuzzer compares its inputs with every string it meets); they are parsed, not configured.
pub const DEVICE_KINDS: &[&str] = &["tun", "packet"];

/// Configures `kind` with `settings` (path contained); a built module must declare a sane interface. Device kinds
/// ([`DEVICE_KINDS`]) are not configured.
pub fn configure(kind: &str, settings: &Settings, dir: &Path) -> Result<(), String> {
    if DEVICE_KINDS.contains(&kind) {
        return Ok(());
    }
    let settings = contained(settings, dir);
    match flexstack_daemon::catalog().configure(kind, &settings, None) {
        Ok(builder) => {
            let iface = builder.interface();
            let mut names = std::collections::HashSet::new();
            for v in &iface.vars {
                ensure(!v.name.is_empty(), || format!("{kind}: a variable without a name"))?;
                ensure(names.insert(&v.name), || format!("{kind}: variable {} declared twice", v.name))?;
                if let Some((min, max)) = v.range {
                    ensure(min <= max, || format!("{kind}: variable {} has range {min}..={max}", v.name))?;
                }
            }
            drop(builder.build(&ModuleVars::new(&iface.vars)));
            Ok(())
        }
        Err(e) => ensure(!e.message.is_empty(), || format!("{kind}: configure error without a message")),
    }
}

pub fn check_location(
    what: &str,
    loc: Option<&flexstack_core::Location>,
    file: &str,
    text: &str,
) -> Result<(), String> {
    let Some(loc) = loc else { return Ok(()) };
    let lines = text.lines().count();
    ensure(&*loc.file == file, || format!("{what}: location names file {:?}, not {file:?}", loc.file))?;
    ensure(loc.line >= 1 && loc.line <= lines + 1, || format!("{what}: line {} of a {lines}-line text", loc.line))?;
    ensure(loc.column >= 1, || format!("{what}: column {}", loc.column))
}

/// A configuration file's error: a message on one line, at a place in the file (unless the file was too large).
fn check_config_error(e: &ConfigError, file: &str, text: &str, max_bytes: usize) -> Result<(), String> {
    ensure(!e.message.is_empty(), || "error without a message".to_string())?;
    ensure(!e.message.contains('\n'), || format!("message of several lines: {e}"))?;
    ensure(e.location.is_some() || text.len() > max_bytes, || format!("error without a location: {e}"))?;
    check_location("error", e.location.as_ref(), file, text)
}

/// A services file (`flexstack run --services`): parsed, every service and rule located in it, the settings
/// checked by the kinds, the terminate match table derived; errors located, on one line.
pub fn check_services(input: &[u8]) -> Result<bool, String> {
    use flexstack_modules::stream::services::file::{ServiceFile, MAX_FILE_BYTES, MAX_SERVICES};
    const FILE: &str = "fuzz-services.toml";
    let text = text(input);
    let file = match ServiceFile::parse(FILE, &text) {
        Ok(file) => file,
        Err(e) => return check_config_error(&e, FILE, &text, MAX_FILE_BYTES).map(|()| false),
    };
    ensure(file.services.len() <= MAX_SERVICES, || format!("{} services accepted", file.services.len()))?;
    for s in &file.services {
        check_location("service", s.location.as_ref(), FILE, &text)?;
        for r in &s.rules {
            check_location("service rule", r.location.as_ref(), FILE, &text)?;
        }
    }
    for r in &file.rules {
        check_location("rule", r.location.as_ref(), FILE, &text)?;
    }
    if let Err(e) = file.check(&flexstack_modules::catalog()) {
        return check_config_error(&e, FILE, &text, MAX_FILE_BYTES).map(|()| false);
    }
    match file.match_table(64) {
        Ok(table) => {
            for rule in &table {
                ensure(!rule.is_empty() && !rule.contains('\n'), || format!("match rule {rule:?}"))?;
            }
        }
        Err(e) => ensure(!e.is_empty() && !e.contains('\n'), || format!("match table error {e:?}"))?,
    }
    Ok(true)
}

pub fn check_stack(input: &[u8], dir: &Path) -> Result<bool, String> {
    const FILE: &str = "fuzz.toml";
    let text = text(input);
    let spec = match StackSpec::parse(FILE, &text) {
        Ok(spec) => spec,
        Err(e) => return check_config_error(&e, FILE, &text, MAX_STACK_FILE_BYTES).map(|()| false),
    };
    let mut names = std::collections::HashSet::new();
    for m in &spec.modules {
        ensure(valid_name(&m.name), || format!("accepted invalid module name {:?}", m.name))?;
        ensure(names.insert(&m.name), || format!("module {:?} twice", m.name))?;
        check_location("module", m.location.as_ref(), FILE, &text)?;
        for (k, s) in m.settings.iter() {
            ensure(k != "kind", || "`kind` among the settings".to_string())?;
            check_location("setting", s.location.as_ref(), FILE, &text)?;
        }
        configure(&m.kind, &m.settings, dir)?;
    }
    for l in &spec.links {
        check_location("link", l.location.as_ref(), FILE, &text)?;
        check_link_value(&l.link)?;
    }
    // Written back, the stack reads the same; written again, the text is the same.
    let saved = spec.to_toml();
    let again = StackSpec::parse("saved.toml", &saved)
        .map_err(|e| format!("to_toml() does not parse back: {e}\n--- to_toml():\n{saved}"))?;
    let shape = |s: &StackSpec| s.modules.iter().map(|m| (m.name.clone(), m.kind.clone())).collect::<Vec<_>>();
    let links = |s: &StackSpec| s.links.iter().map(|l| l.link.to_string()).collect::<Vec<_>>();
    ensure(shape(&again) == shape(&spec), || format!("modules differ after to_toml():\n{saved}"))?;
    ensure(links(&again) == links(&spec), || format!("links differ after to_toml():\n{saved}"))?;
    for (a, b) in again.modules.iter().zip(&spec.modules) {
        ensure(same_settings(&a.settings, &b.settings), || {
            format!("settings of {} differ after to_toml():\n{saved}", a.name)
        })?;
    }
    let saved_again = again.to_toml();
    ensure(saved_again == saved, || format!("to_toml() is not stable:\n{saved}\n--- then:\n{saved_again}"))?;
    Ok(true)
}

pub fn check_link_value(l: &LinkSpec) -> Result<(), String> {
    ensure(!l.to.is_empty(), || "link without receivers".to_string())?;
    for e in std::iter::once(&l.from).chain(&l.to) {
        ensure(valid_name(&e.module), || format!("accepted module name {:?}", e.module))?;
        if let Some(p) = &e.port {
            ensure(valid_name(p), || format!("accepted port name {p:?}"))?;
        }
    }
    let written = l.to_string();
    let again = LinkSpec::parse(&written).map_err(|e| format!("Display {written:?} does not parse back: {e}"))?;
    ensure(&again == l, || format!("Display {written:?} parses back to {again:?}, not {l:?}"))
}

pub fn check_link(input: &[u8]) -> Result<bool, String> {
    match LinkSpec::parse(&text(input)) {
        Ok(l) => check_link_value(&l).map(|()| true),
        Err(e) => ensure(!e.is_empty(), || "error without a message".to_string()).map(|()| false),
    }
}

/// Some variable names as the daemon registers them, to match patterns against.
pub const VAR_NAMES: &[&str] = &[
    "module.count.frames_total",
    "module.count.port.in.frames_in_total",
    "module.sel.select",
    "module.sel.port.0.frames_out_total",
    "module.src.rate",
    "iface.eth0.rx_bytes",
    "",
    ".",
    "a..b",
];

pub fn check_request(input: &[u8], dir: &Path) -> Result<bool, String> {
    let line = text(input);
    let (id, request) = parse_request(&line);
    let request = match request {
        Ok(r) => r,
        Err(e) => {
            ensure(!e.message.is_empty(), || "error without a message".to_string())?;
            ensure(matches!(e.code, ErrorCode::InvalidJson | ErrorCode::InvalidRequest), || {
                format!("parse error with code {:?}", e.code)
            })?;
            // The error response is one line of JSON with `ok: false`, the error and the request's id.
            let code = serde_json::to_value(e.code).map_err(|e| e.to_string())?;
            let out = Response::err(id.clone(), e).to_line();
            ensure(out.ends_with('\n') && !out.trim_end().contains('\n'), || {
                format!("response {out:?} is not one line")
            })?;
            let back: Json = serde_json::from_str(&out).map_err(|e| format!("response {out:?}: {e}"))?;
            ensure(back["ok"] == Json::Bool(false) && back["error"]["code"] == code, || format!("response {out:?}"))?;
            let echoed = json_opt_eq(back.get("id"), id.as_ref());
            return ensure(echoed, || format!("response {out:?} does not echo id {id:?}")).map(|()| false);
        }
    };
    // Written with request_line, the request parses back equal, with its id.
    let out = request_line(7, &request);
    ensure(out.ends_with('\n') && !out.trim_end().contains('\n'), || format!("request_line {out:?} is not one line"))?;
    let (id2, again) = parse_request(out.trim_end());
    let again = again.map_err(|e| format!("request_line {out:?} does not parse back: {}", e.message))?;
    ensure(id2 == Some(Json::from(7)), || format!("request_line {out:?} lost its id"))?;
    let same = again == request || {
        let as_json = |r: &Request| serde_json::to_value(r).unwrap_or(Json::Null);
        json_eq(&as_json(&again), &as_json(&request))
    };
    ensure(same, || format!("request_line {out:?} parses back to {again:?}, not {request:?}"))?;
    // What the daemon does next with the request's text parts.
    match &request {
        Request::Get(Get { names }) | Request::Watch(Watch { names, .. }) => {
            for p in names.iter().take(16) {
                for n in VAR_NAMES {
                    let _ = name_matches(p, n);
                }
            }
        }
        Request::VarList(VarList { pattern: Some(p) }) => {
            for n in VAR_NAMES {
                let _ = name_matches(p, n);
            }
        }
        Request::LinkAdd(LinkAdd { link }) | Request::LinkDel(LinkDel { link }) => {
            if let Ok(l) = LinkSpec::parse(link) {
                check_link_value(&l)?;
            }
        }
        Request::ModuleLoad(ModuleLoad { kind, settings, .. })
        | Request::ModuleReplace(ModuleReplace { kind, settings, .. }) => {
            // As the daemon converts them (crates/daemon/src/actions.rs: settings_from_json).
            let mut s = Settings::default();
            for (k, v) in settings {
                match toml::Value::try_from(v) {
                    Ok(tv) => s.insert(k, tv),
                    Err(_) => return Ok(true),
                }
            }
            configure(kind, &s, dir)?;
        }
        Request::Set(Set { value: Json::String(t), .. }) => {
            for ty in TYPES {
                let _ = Value::parse_as(ty, t);
            }
        }
        _ => {}
    }
    Ok(true)
}

pub const TYPES: [ValueType; 5] = [ValueType::U64, ValueType::I64, ValueType::F64, ValueType::Bool, ValueType::Str];

pub fn check_value(input: &[u8]) -> Result<bool, String> {
    let t = text(input);
    let mut accepted = false;
    for ty in TYPES {
        let v = match Value::parse_as(ty, &t) {
            Ok(v) => v,
            Err(e) => {
                ensure(!e.is_empty(), || "error without a message".to_string())?;
                continue;
            }
        };
        ensure(v.value_type() == ty, || format!("parse_as({ty}) gave a {}", v.value_type()))?;
        accepted |= ty != ValueType::Str;
        if let Value::F64(x) = v {
            ensure(x.is_finite(), || format!("parse_as(f64) accepted {x}"))?;
        }
        let shown = v.to_string();
        let again = Value::parse_as(ty, &shown).map_err(|e| format!("{ty} {v:?} shown as {shown:?}: {e}"))?;
        ensure(again == v, || format!("{ty} {v:?} shown as {shown:?} parses back as {again:?}"))?;
        ensure(v.coerce(ty).as_ref() == Ok(&v), || format!("{v:?} does not coerce to its own type"))?;
        let fits_toml = !matches!(v, Value::U64(x) if x > i64::MAX as u64);
        if fits_toml {
            let back = Value::from_toml(&v.to_toml());
            let expect = match &v {
                Value::I64(x) if *x >= 0 => Value::U64(*x as u64),
                other => other.clone(),
            };
            ensure(back.as_ref() == Some(&expect), || format!("{v:?} through TOML is {back:?}"))?;
        }
        let json = serde_json::to_string(&v).map_err(|e| format!("{v:?} to JSON: {e}"))?;
        let back: Value = serde_json::from_str(&json).map_err(|e| format!("{v:?} as JSON {json}: {e}"))?;
        let expect = match &v {
            Value::I64(x) if *x >= 0 => Value::U64(*x as u64),
            other => other.clone(),
        };
        let close = matches!((&back, &expect), (Value::F64(a), Value::F64(b)) if float_close(*a, *b));
        ensure(back == expect || close, || format!("{v:?} through JSON {json} is {back:?}"))?;
    }
    Ok(accepted)
}

/// The backtracking matcher `name_matches` replaced, memoized: the reference for short inputs.
pub fn reference_matches(pattern: &[u8], name: &[u8]) -> bool {
    fn go(p: &[u8], n: &[u8], pi: usize, ni: usize, memo: &mut [Option<bool>]) -> bool {
        let key = pi * (n.len() + 1) + ni;
        if let Some(known) = memo[key] {
            return known;
        }
        let (rest_p, rest_n) = (&p[pi..], &n[ni..]);
        let result = match rest_p.first() {
            None => rest_n.is_empty(),
            Some(b'*') if rest_p.get(1) == Some(&b'*') => (ni..=n.len()).any(|j| go(p, n, pi + 2, j, memo)),
            Some(b'*') => {
                let seg = rest_n.iter().position(|&c| c == b'.').unwrap_or(rest_n.len());
                (ni..=ni + seg).any(|j| go(p, n, pi + 1, j, memo))
            }
            Some(b'?') => rest_n.first().is_some_and(|&c| c != b'.') && go(p, n, pi + 1, ni + 1, memo),
            Some(&c) => rest_n.first() == Some(&c) && go(p, n, pi + 1, ni + 1, memo),
        };
        memo[key] = Some(result);
        result
    }
    let mut memo = vec![None; (pattern.len() + 1) * (name.len() + 1)];
    go(pattern, name, 0, 0, &mut memo)
}

pub fn check_pattern(input: &[u8]) -> Result<bool, String> {
    let t = text(input);
    let (pattern, name) = t.split_once('\n').unwrap_or((&t, "module.count.frames_total"));
    // Names come from the registry: dotted segments of at most 64 characters. Patterns come from clients.
    let mut end = name.len().min(MAX_NAME);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    let name = &name[..end];
    let got = name_matches(pattern, name);
    if pattern.len() <= 96 && name.len() <= 160 {
        let want = reference_matches(pattern.as_bytes(), name.as_bytes());
        ensure(got == want, || format!("name_matches({pattern:?}, {name:?}) = {got}, reference says {want}"))?;
    }
    if !is_pattern(pattern) {
        ensure(got == (pattern == name), || format!("literal {pattern:?} vs {name:?}: {got}"))?;
    }
    if !is_pattern(name) {
        ensure(name_matches(name, name), || format!("{name:?} does not match itself"))?;
    }
    ensure(name_matches("**", name), || format!("** does not match {name:?}"))?;
    for n in VAR_NAMES {
        let _ = name_matches(pattern, n);
    }
    Ok(got)
}

/// First line: a module kind; then one `key=value` argument per line, as on the command line (a line ending in `\`
/// continues on the next: the argument holds that newline).
pub fn check_args(input: &[u8], dir: &Path) -> Result<bool, String> {
    let t = text(input);
    let mut lines = t.split('\n');
    let kind = lines.next().unwrap_or_default().trim().to_string();
    let mut args: Vec<String> = Vec::new();
    let mut continued = false;
    for line in lines {
        match args.last_mut() {
            Some(last) if continued => {
                last.pop();
                last.push('\n');
                last.push_str(line);
            }
            _ => args.push(line.to_string()),
        }
        continued = line.ends_with('\\');
    }
    let settings = match Settings::from_args(&args) {
        Ok(s) => s,
        Err(e) => {
            ensure(e.location.is_none(), || format!("command-line error with a location: {e}"))?;
            return ensure(!e.message.is_empty(), || "error without a message".to_string()).map(|()| false);
        }
    };
    for (k, s) in settings.iter() {
        ensure(valid_name(k), || format!("accepted setting name {k:?}"))?;
        ensure(s.location.is_none(), || format!("command-line setting {k} with a location"))?;
    }
    ensure(args.iter().all(|a| a.contains('=')), || "accepted an argument without `=`".to_string())?;
    // A value is the whole text after `=`: one TOML value, or else the text itself.
    let mut last = std::collections::HashMap::new();
    for a in &args {
        if let Some((k, raw)) = a.split_once('=') {
            last.insert(k.trim(), raw);
        }
    }
    for (k, raw) in last {
        let value = &settings.get(k).ok_or_else(|| format!("setting {k} lost"))?.value;
        let whole = format!("v = {}", raw.trim()).parse::<toml::Table>().is_ok_and(|t| t.len() == 1);
        let text = value.as_str() == Some(raw);
        ensure(whole || text, || format!("{k}={raw:?} read as {value:?}"))?;
    }
    let kinds: Vec<&str> = flexstack_daemon::catalog().kinds().map(|k| k.name()).collect();
    for k in kinds.iter().copied().chain(std::iter::once(kind.as_str())) {
        configure(k, &settings, dir)?;
    }
    Ok(true)
}
