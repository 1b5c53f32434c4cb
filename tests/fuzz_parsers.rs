//! Deterministic, bounded mutational fuzzing of every parser, on stable Rust, as part of `cargo test`.
//!
//! The engine is the dev-only crate `flexstack-fuzzkit` (`crates/fuzzkit`); the tokens and checks are here.
//! The seeds are the files in `fuzz/corpus/<target>/` (see `fuzz/README.md`). Each target draws inputs from its
//! corpus, mutates them with a xorshift PRNG (bit flips, byte inserts, deletes and duplicates, splices of two
//! entries, interesting tokens, long runs of one character, extreme numbers, unicode) and calls its parser under
//! `catch_unwind`. A panic, a violated property (round trips, error locations, agreement with a reference) or a
//! slow input is a failure: the test prints the input (escaped), the seed and the iteration, so it can be reproduced
//! (`FLEXSTACK_FUZZ_SEED=...`) and added to the corpus.
//!
//! - `FLEXSTACK_FUZZ_SEED`: base seed (decimal or 0x-hex); a fixed default keeps `cargo test` deterministic.
//! - `FLEXSTACK_FUZZ_ITERS`: iterations per target (default [`DEFAULT_ITERS`]).
//! - `FLEXSTACK_FUZZ_DAEMON_LINES`: request lines answered by the live daemon (default [`DEFAULT_DAEMON_LINES`]),
//!   within `FLEXSTACK_FUZZ_DAEMON_SECS` seconds (default 8).
//! - `FLEXSTACK_FUZZ_TARGETS`: comma-separated targets to run (default: all of them).
//! - `FLEXSTACK_FUZZ_ARTIFACTS`: a directory; failing inputs are also written there as files.
//!
//! The tap kind creates the file named by its `path` setting when configured: every `path` that could create a
//! file is rewritten to a file inside a temporary directory before configuring, here and in the daemon test, and
//! its `exists` setting, unless it refuses (or is not valid), to `"append"`: a tap never overwrites a capture, so
//! with the default (`"suffix"`) each of the thousands of taps configured would leave a file of its own.

mod common;

use flexstack_api::ops::{Get, LinkAdd, LinkDel, ModuleLoad, ModuleReplace, Set, VarList, Watch};
use flexstack_api::protocol::{parse_request, request_line, ErrorCode, Request, Response};
use flexstack_core::config::{valid_name, LinkSpec, Settings, StackSpec, MAX_STACK_FILE_BYTES};
use flexstack_core::value::{Value, ValueType};
use flexstack_core::vars::{is_pattern, name_matches};
use flexstack_core::ModuleVars;
use flexstack_fuzzkit::{
    env_u64, iters_from_env, load_corpus_bytes, mutate_input, panic_message, seed_from_env, target_seed, Dict, Rng,
};
use serde_json::Value as Json;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Iterations per target by default: the whole file runs in a few seconds in a debug build.
const DEFAULT_ITERS: usize = 15_000;

/// Request lines sent to the live daemon by default.
const DEFAULT_DAEMON_LINES: usize = 600;

/// The default base seed.
const DEFAULT_SEED: u64 = 0x5eed_f1e5_57ac_0001;

/// Largest mutated input, in bytes.
const MAX_INPUT: usize = 64 * 1024;

/// An input taking longer than this (debug build) is reported as a failure: parsers must stay linear-ish.
const SLOW: Duration = Duration::from_secs(2);

/// An input still running after this long is a hang: the test process exits with a report.
const HANG: Duration = Duration::from_secs(30);

/// Longest variable name the pattern target matches against (real ones are much shorter).
const MAX_NAME: usize = 256;

/// Longest input or message shown in a report, in characters.
const MAX_SHOWN: usize = 600;

/// Failures reported per target before giving up on it.
const MAX_FAILURES: usize = 8;

// ---------------------------------------------------------------------------------------------------------------
// The engine
// ---------------------------------------------------------------------------------------------------------------

fn base_seed() -> u64 {
    seed_from_env(DEFAULT_SEED)
}

/// The seeds of `target`, sorted by file name.
fn corpus(target: &str) -> Vec<Vec<u8>> {
    load_corpus_bytes(target, 10)
}

/// Tokens that mean something to one of the parsers, or that parsers often get wrong.
const TOKENS: &[&str] = &[
    "[",
    "]",
    "[[",
    "]]",
    "->",
    ",",
    "\"",
    "'",
    "\"\"\"",
    "'''",
    "=",
    "\n",
    "\r\n",
    "\r",
    "\t",
    " ",
    "{",
    "}",
    "{}",
    "[]",
    ":",
    ".",
    "#",
    "\\",
    "\u{0}",
    "\\u0000",
    "\\ud800",
    "\\n",
    "*",
    "**",
    "?",
    "-",
    "_",
    "nan",
    "inf",
    "-inf",
    "+inf",
    "-0",
    "+0.0",
    "0x7f",
    "1_000",
    "1e309",
    "4.9e-324",
    "18446744073709551615",
    "18446744073709551616",
    "9223372036854775807",
    "-9223372036854775808",
    "-9223372036854775809",
    "340282366920938463463374607431768211456",
    "1979-05-27T07:32:00Z",
    "true",
    "false",
    "null",
    "on",
    "kind",
    "modules",
    "links",
    "[modules.x]",
    "kind = \"tap\"",
    "\"op\":",
    "\"id\":",
    "\"settings\":{",
    "é",
    "☃",
    "😀",
    "\u{feff}",
    "\u{202e}",
    "\u{3000}",
    "\u{fffd}",
    "ｋｉｎｄ",
];

/// Bytes worth planting.
const BYTES: &[u8] = b"\x00\x01\x7f\x80\xff\n\r\t \"'[]{}=,.-*?#\\:";

/// The mutations of every target: its tokens and bytes, extreme numbers and long runs.
const DICT: Dict<'static> = Dict {
    tokens: TOKENS,
    bytes: BYTES,
    numbers: &["0", "1", "-1", "-0", "18446744073709551616", "1e309", "nan", "inf", "99999999999999999999999"],
    runs: &[8, 64, 65, 300, 4096],
    run_bytes: b"a0*[{\"-9 ",
    max_len: MAX_INPUT,
    ..Dict::EMPTY
};

/// One to four stacked mutations of `input`; `corpus` provides splice partners.
fn mutate(rng: &mut Rng, input: &[u8], corpus: &[Vec<u8>]) -> Vec<u8> {
    mutate_input(rng, input, corpus, &DICT)
}

/// The input being checked, and since when.
type Current = Option<(usize, Vec<u8>, Instant)>;

/// Turns a hang into a failure: a thread that, when one input runs longer than [`HANG`], prints it and the seed and
/// exits the test process (a running check cannot be interrupted, and a hung test reports nothing).
struct Watchdog {
    current: std::sync::Arc<std::sync::Mutex<Current>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    fn start(target: &str) -> Watchdog {
        let current = std::sync::Arc::new(std::sync::Mutex::new(None::<(usize, Vec<u8>, Instant)>));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (c, st, target) = (current.clone(), stop.clone(), target.to_string());
        let thread = std::thread::spawn(move || {
            while !st.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(50));
                let guard = c.lock().unwrap_or_else(|p| p.into_inner());
                if let Some((iteration, input, since)) = guard.as_ref().filter(|(_, _, since)| since.elapsed() > HANG) {
                    let report = format!(
                        "\nfuzz target `{target}` hangs: iteration {iteration} still running after {:?} \
                         (FLEXSTACK_FUZZ_SEED={:#x})\n    input ({} bytes): \"{}\"\n",
                        since.elapsed(),
                        base_seed(),
                        input.len(),
                        clip(&input.escape_ascii().to_string())
                    );
                    // Straight to the process's stderr: the test harness's capture is lost on exit.
                    let _ = std::io::stderr().write_all(report.as_bytes());
                    std::process::exit(101);
                }
            }
        });
        Watchdog { current, stop, thread: Some(thread) }
    }

    fn watch(&self, iteration: usize, input: &[u8]) {
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some((iteration, input.to_vec(), Instant::now()));
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What went wrong with one input.
struct Failure {
    iteration: usize,
    input: Vec<u8>,
    problem: String,
}

/// Runs `check` on every seed of `target` and then on `iters` mutated inputs; returns a report of the failures.
/// A target's check: whether the parser accepted the input, or what is wrong.
type Check<'a> = &'a dyn Fn(&[u8]) -> Result<bool, String>;

fn fuzz(target: &str, iters: usize, check: Check<'_>) -> Option<String> {
    if let Ok(only) = std::env::var("FLEXSTACK_FUZZ_TARGETS") {
        if !only.split(',').any(|t| t.trim() == target) {
            return None;
        }
    }
    let seeds = corpus(target);
    let seed = target_seed(base_seed(), target);
    let mut rng = Rng::new(seed);
    let mut failures = Vec::new();
    let mut accepted = 0;
    let start = Instant::now();
    let total = seeds.len() + iters;
    let watchdog = Watchdog::start(target);
    for iteration in 0..total {
        let input = match seeds.get(iteration) {
            Some(s) => s.clone(),
            None => {
                let base = rng.pick(&seeds).clone();
                mutate(&mut rng, &base, &seeds)
            }
        };
        watchdog.watch(iteration, &input);
        let t = Instant::now();
        let result = catch_unwind(AssertUnwindSafe(|| check(&input)));
        let took = t.elapsed();
        let problem = match result {
            Ok(Ok(_)) if took > SLOW => Some(format!("slow: took {took:?}")),
            Ok(Ok(ok)) => {
                accepted += usize::from(ok);
                None
            }
            Ok(Err(p)) => Some(p),
            Err(panic) => Some(format!("panic: {}", panic_message(&*panic))),
        };
        if let Some(problem) = problem {
            failures.push(Failure { iteration, input, problem });
            if failures.len() >= MAX_FAILURES {
                break;
            }
        }
    }
    drop(watchdog);
    eprintln!(
        "fuzz {target}: {total} inputs in {:?}, {accepted} accepted, {} failures",
        start.elapsed(),
        failures.len()
    );
    if failures.is_empty() {
        return None;
    }
    let artifacts = std::env::var_os("FLEXSTACK_FUZZ_ARTIFACTS").map(PathBuf::from);
    let mut report = format!(
        "fuzz target `{target}`: {} failure(s) (reproduce with FLEXSTACK_FUZZ_SEED={:#x}; add the input to \
         fuzz/corpus/{target}/ once fixed)\n",
        failures.len(),
        base_seed()
    );
    for f in &failures {
        let what = if f.iteration < seeds.len() { "corpus seed" } else { "iteration" };
        report.push_str(&format!(
            "  {what} {}: {}\n    input ({} bytes): \"{}\"\n",
            f.iteration,
            clip(&f.problem),
            f.input.len(),
            clip(&f.input.escape_ascii().to_string())
        ));
        if let Some(dir) = &artifacts {
            let _ = std::fs::create_dir_all(dir);
            let _ = std::fs::write(dir.join(format!("{target}-{:#x}-{}", base_seed(), f.iteration)), &f.input);
        }
    }
    Some(report)
}

/// At most [`MAX_SHOWN`] characters of `s`, saying how much was left out.
fn clip(s: &str) -> String {
    match s.char_indices().nth(MAX_SHOWN) {
        Some((cut, _)) => {
            format!("{}... ({} more bytes; set FLEXSTACK_FUZZ_ARTIFACTS=DIR for all)", &s[..cut], s.len() - cut)
        }
        None => s.to_string(),
    }
}

/// Fails with `message` unless `cond`.
fn ensure(cond: bool, message: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(message())
    }
}

fn text(input: &[u8]) -> String {
    String::from_utf8_lossy(input).into_owned()
}

// ---------------------------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------------------------

/// True when serde_json parses every float exactly (its `float_roundtrip` feature). Without it, a float read back
/// from JSON may be a few ULPs off, and the properties below allow that much (and no more).
fn json_floats_exact() -> bool {
    ["1.1844674407370955e20", "-1844674407370955.0", "4.9e-32", "100.92233720368547"]
        .iter()
        .all(|t| serde_json::from_str::<f64>(t).ok().map(f64::to_bits) == t.parse::<f64>().ok().map(f64::to_bits))
}

/// Equal floats, or (when serde_json rounds: up to 2 ULPs off, and about 30% of random f64s are) close ones.
fn float_close(a: f64, b: f64) -> bool {
    a == b || (!json_floats_exact() && a.signum() == b.signum() && a.to_bits().abs_diff(b.to_bits()) <= 4)
}

/// Equal JSON values, up to what serde_json's float parsing loses (see [`json_floats_exact`]).
fn json_eq(a: &Json, b: &Json) -> bool {
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

fn json_opt_eq(a: Option<&Json>, b: Option<&Json>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => json_eq(a, b),
        (a, b) => a.is_none() && b.is_none(),
    }
}

/// Equal TOML values, where NaN equals NaN.
fn toml_eq(a: &toml::Value, b: &toml::Value) -> bool {
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

fn same_settings(a: &Settings, b: &Settings) -> bool {
    a.iter().count() == b.iter().count() && a.iter().all(|(k, s)| b.get(k).is_some_and(|o| toml_eq(&s.value, &o.value)))
}

/// True if a tap's `exists` setting makes a new file for each tap: absent (`None`) or the text `"suffix"` (an
/// `exists` that is not text is `Some(None)`: it fails the configuration and is kept).
fn multiplies_files(exists: Option<Option<&str>>) -> bool {
    exists.is_none_or(|e| e == Some("suffix"))
}

/// Settings safe to configure: a `path` that could create a file points into `dir` instead, and adds to one file.
fn contained(settings: &Settings, dir: &Path) -> Settings {
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

/// Configures `kind` with `settings` (path contained); a built module must declare a sane interface.
fn configure(kind: &str, settings: &Settings, dir: &Path) -> Result<(), String> {
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

fn check_location(what: &str, loc: Option<&flexstack_core::Location>, file: &str, text: &str) -> Result<(), String> {
    let Some(loc) = loc else { return Ok(()) };
    let lines = text.lines().count();
    ensure(&*loc.file == file, || format!("{what}: location names file {:?}, not {file:?}", loc.file))?;
    ensure(loc.line >= 1 && loc.line <= lines + 1, || format!("{what}: line {} of a {lines}-line text", loc.line))?;
    ensure(loc.column >= 1, || format!("{what}: column {}", loc.column))
}

fn check_stack(input: &[u8], dir: &Path) -> Result<bool, String> {
    const FILE: &str = "fuzz.toml";
    let text = text(input);
    let spec = match StackSpec::parse(FILE, &text) {
        Ok(spec) => spec,
        Err(e) => {
            ensure(!e.message.is_empty(), || "error without a message".to_string())?;
            ensure(!e.message.contains('\n'), || format!("message of several lines: {e}"))?;
            ensure(e.location.is_some() || text.len() > MAX_STACK_FILE_BYTES, || {
                format!("error without a location: {e}")
            })?;
            return check_location("error", e.location.as_ref(), FILE, &text).map(|()| false);
        }
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

fn check_link_value(l: &LinkSpec) -> Result<(), String> {
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

fn check_link(input: &[u8]) -> Result<bool, String> {
    match LinkSpec::parse(&text(input)) {
        Ok(l) => check_link_value(&l).map(|()| true),
        Err(e) => ensure(!e.is_empty(), || "error without a message".to_string()).map(|()| false),
    }
}

/// Some variable names as the daemon registers them, to match patterns against.
const VAR_NAMES: &[&str] = &[
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

fn check_request(input: &[u8], dir: &Path) -> Result<bool, String> {
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

const TYPES: [ValueType; 5] = [ValueType::U64, ValueType::I64, ValueType::F64, ValueType::Bool, ValueType::Str];

fn check_value(input: &[u8]) -> Result<bool, String> {
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
fn reference_matches(pattern: &[u8], name: &[u8]) -> bool {
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

fn check_pattern(input: &[u8]) -> Result<bool, String> {
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
fn check_args(input: &[u8], dir: &Path) -> Result<bool, String> {
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

// ---------------------------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------------------------

#[test]
fn fuzz_parsers() {
    let dir = tempfile::tempdir().expect("temp dir");
    let iters = iters_from_env(DEFAULT_ITERS);
    eprintln!("fuzzing with FLEXSTACK_FUZZ_SEED={:#x}, {iters} iterations per target", base_seed());
    let reports: Vec<String> = [
        fuzz("stack", iters, &|i| check_stack(i, dir.path())),
        fuzz("link", iters, &check_link),
        fuzz("request", iters, &|i| check_request(i, dir.path())),
        fuzz("value", iters, &check_value),
        fuzz("pattern", iters, &check_pattern),
        fuzz("args", iters, &|i| check_args(i, dir.path())),
    ]
    .into_iter()
    .flatten()
    .collect();
    // Nothing was written outside the temporary directory: at most the one contained capture file inside it.
    let written: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(written.iter().all(|n| n == "fuzz.pcapng"), "unexpected files: {written:?}");
    assert!(reports.is_empty(), "\n{}", reports.join("\n"));
}

/// The engine itself: deterministic for a seed, and its mutations stay within bounds.
#[test]
fn mutations_are_deterministic_and_bounded() {
    let seeds = corpus("link");
    let run = |seed| {
        let mut rng = Rng::new(seed);
        (0..200).map(|_| mutate(&mut rng, &seeds[0], &seeds)).collect::<Vec<_>>()
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
    assert!(run(3).iter().all(|m| m.len() <= MAX_INPUT));
}

// ---------------------------------------------------------------------------------------------------------------
// A live daemon
// ---------------------------------------------------------------------------------------------------------------

/// What to send for one line (with the newline), and whether the daemon answers it; `None` to skip it.
fn prepare_line(line: &[u8], capture: &Path) -> Option<(Vec<u8>, bool)> {
    let Ok(text) = std::str::from_utf8(line) else {
        return Some((line.to_vec(), true));
    };
    if text.trim().is_empty() {
        return Some((line.to_vec(), false));
    }
    let (id, request) = parse_request(text);
    match request {
        // A watch streams until its count is reached or the client goes away: not part of this test.
        Ok(Request::Watch(_)) => None,
        // A tap creates its file: only inside the test's directory.
        Ok(
            Request::ModuleLoad(ModuleLoad { ref kind, .. }) | Request::ModuleReplace(ModuleReplace { ref kind, .. }),
        ) if kind == "tap" => {
            let mut r = request.ok()?;
            if let Request::ModuleLoad(ModuleLoad { settings, .. })
            | Request::ModuleReplace(ModuleReplace { settings, .. }) = &mut r
            {
                settings.insert("path".into(), Json::String(capture.display().to_string()));
                let exists = settings.get("exists").map(|e| e.as_str());
                if multiplies_files(exists) {
                    settings.insert("exists".into(), Json::String("append".into()));
                }
            }
            let id = id.and_then(|i| i.as_u64()).unwrap_or(0);
            Some((request_line(id, &r).trim_end().as_bytes().to_vec(), true))
        }
        _ => Some((line.to_vec(), true)),
    }
}

/// Checks one response line to a request line.
fn check_response(sent: &[u8], got: &str) -> Result<(), String> {
    let v: Json = serde_json::from_str(got).map_err(|e| format!("response is not JSON ({e}): {got:?}"))?;
    let obj = v.as_object().ok_or_else(|| format!("response is not an object: {got}"))?;
    match obj.get("ok") {
        Some(Json::Bool(true)) => {}
        Some(Json::Bool(false)) => {
            let code = obj.get("error").and_then(|e| e.get("code")).and_then(Json::as_str);
            let code = code.ok_or_else(|| format!("failure without error.code: {got}"))?;
            serde_json::from_value::<ErrorCode>(Json::from(code))
                .map_err(|_| format!("unknown error code {code:?}"))?;
        }
        _ => return Err(format!("response without a boolean `ok`: {got}")),
    }
    serde_json::from_value::<Response>(v.clone()).map_err(|e| format!("not a Response ({e}): {got}"))?;
    // The id is echoed whenever the request was a JSON object.
    if let Ok(t) = std::str::from_utf8(sent) {
        if let (Some(id), _) = parse_request(t) {
            ensure(json_opt_eq(obj.get("id"), Some(&id)), || format!("id {id} not echoed: {got}"))?;
        }
    }
    Ok(())
}

/// Sends mutated request lines on one connection until `lines` were answered or the deadline passed; returns (lines
/// sent, answered ok, answered with an error).
fn drive_connection(sock: &Path, seed: u64, lines: usize, capture: &Path, deadline: Instant) -> (usize, usize, usize) {
    let seeds = corpus("request");
    let mut rng = Rng::new(seed);
    let conn = UnixStream::connect(sock).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut writer = conn;
    let (mut sent, mut ok, mut failed) = (0, 0, 0);
    while ok + failed < lines && Instant::now() < deadline {
        let base = rng.pick(&seeds).clone();
        // One in three unchanged: valid requests that load, link and set things, so the stack keeps changing.
        let input = if rng.one_in(3) { base } else { mutate(&mut rng, &base, &seeds) };
        for piece in input.split(|&b| b == b'\n') {
            let Some((line, answered)) = prepare_line(piece, capture) else { continue };
            let mut bytes = line.clone();
            bytes.push(b'\n');
            writer.write_all(&bytes).unwrap_or_else(|e| panic!("write {:?}: {e}", line.escape_ascii().to_string()));
            sent += 1;
            if !answered {
                continue;
            }
            let mut got = String::new();
            match reader.read_line(&mut got) {
                Ok(0) => panic!("daemon closed the connection after \"{}\"", line.escape_ascii()),
                Ok(_) => {}
                Err(e) => panic!("no response to \"{}\": {e}", line.escape_ascii()),
            }
            if let Err(problem) = check_response(&line, got.trim_end()) {
                panic!("request \"{}\" (seed {seed:#x}): {problem}", line.escape_ascii());
            }
            if got.contains("\"ok\":true") {
                ok += 1;
            } else {
                failed += 1;
            }
        }
    }
    (sent, ok, failed)
}

#[test]
fn fuzz_live_daemon() {
    let mut daemon = common::Daemon::start(&common::chain("rate = 1000\nsize = 64", "", ""), &[]);
    let first_revision = daemon.json(&["status"])["revision"].as_u64().expect("revision");
    let sock = daemon.state_dir().join("control.sock");
    let capture = daemon.path("fuzz.pcapng");
    let lines = env_u64("FLEXSTACK_FUZZ_DAEMON_LINES").map_or(DEFAULT_DAEMON_LINES, |n| n as usize);
    let connections = 3;
    let secs = env_u64("FLEXSTACK_FUZZ_DAEMON_SECS").unwrap_or(8);
    let deadline = Instant::now() + Duration::from_secs(secs);
    let start = Instant::now();
    let base = target_seed(base_seed(), "daemon");
    let results: Vec<(usize, usize, usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..connections)
            .map(|c| {
                let (sock, capture) = (&sock, &capture);
                s.spawn(move || {
                    drive_connection(sock, base.wrapping_add(c as u64), lines / connections, capture, deadline)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("connection thread")).collect()
    });
    let (sent, ok, failed) = results.iter().fold((0, 0, 0), |a, r| (a.0 + r.0, a.1 + r.1, a.2 + r.2));
    eprintln!(
        "fuzz daemon: {sent} lines in {:?} over {connections} connections: {ok} ok, {failed} errors (seed {:#x})",
        start.elapsed(),
        base_seed()
    );
    assert!(ok > 0 && failed > 0, "expected both accepted and refused requests: {ok} ok, {failed} errors");
    assert!(daemon.alive(), "the daemon died");
    let mut c = daemon.raw();
    c.send(b"{\"id\":\"last\",\"op\":\"status\"}\n");
    let status = c.line().expect("status response");
    assert_eq!(status["ok"], Json::Bool(true), "{status}");
    assert_eq!(status["id"], Json::from("last"));
    let revision = status["result"]["revision"].as_u64().expect("revision");
    assert!(revision > first_revision, "no request changed the stack: revision {revision}");
    // Taps wrote only the contained capture file, or, while a tap still loaded held it (a tap never appends to a
    // file another one writes), a suffix file next to it: one per tap loaded at the same time, not one per load.
    let mut written: Vec<_> = std::fs::read_dir(daemon.dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    written.sort();
    let suffix_file = |n: &str| {
        n.strip_prefix("fuzz.").and_then(|n| n.strip_suffix(".pcapng")).is_some_and(|n| n.parse::<u8>().is_ok())
    };
    assert!(
        written
            .iter()
            .map(|n| n.to_str().unwrap_or(""))
            .all(|n| ["fuzz.pcapng", "stack.toml", "state"].contains(&n) || suffix_file(n)),
        "{written:?}"
    );
}
