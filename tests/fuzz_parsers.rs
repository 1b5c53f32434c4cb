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
// The checks, one function per parser, shared with the libFuzzer targets (fuzz/fuzz_targets/).
#[allow(dead_code)]
#[path = "../fuzz/src/parsers.rs"]
mod checks;

use checks::{
    check_args, check_link, check_pattern, check_request, check_services, check_stack, check_value, ensure,
    json_opt_eq, multiplies_files,
};
use flexstack_api::ops::{ModuleLoad, ModuleReplace};
use flexstack_api::protocol::{parse_request, request_line, ErrorCode, Request, Response};
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
        fuzz("services", iters, &check_services),
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
