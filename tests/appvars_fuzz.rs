//! Fuzzing of the app-variable protocol on both sides, with the shared engine (`flexstack-fuzzkit`; see
//! `fuzz/README.md`; `FLEXSTACK_FUZZ_SEED` and `FLEXSTACK_FUZZ_ITERS` as for the other fuzz tests).
//!
//! - `appreq`: mutated sessions (lines an application sends) into the daemon's connection handler
//!   ([`AppVars::connection`]) over a socket pair: every non-empty line but an `ack` gets exactly one JSON
//!   response with `ok` (and an `error.code` when false), nothing panics, and when the connection closes its
//!   variables are gone from the registry.
//! - `appevent`: mutated lines the daemon could send, into the C library's parser (clients/c, built with
//!   AddressSanitizer and UBSan by `cc` into a harness, `clients/c/fuzz_parse.c`): no memory error, no crash.

// The check, shared with the libFuzzer target `appreq` (fuzz/fuzz_targets/appreq.rs).
#[allow(dead_code)]
#[path = "../fuzz/src/appvars.rs"]
mod checks;

use checks::check_session;
use flexstack_core::SharedRegistry;
use flexstack_daemon::appvars::AppVars;
use flexstack_fuzzkit::{
    iters_from_env, load_corpus_bytes, mutate, run_guarded, seed_from_env, target_seed, Dict, Rng,
};
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

const SEED: u64 = 0x5eed_a995_0000_0005;

const DICT: Dict<'static> = Dict {
    tokens: &[
        "\\u",
        "\\u00",
        "\\\"",
        "\\",
        "\"",
        "\n",
        "{",
        "}",
        ":",
        "[",
        "]",
        ",",
        "null",
        "true",
        "\"op\":\"register\"",
        "\"op\":\"update\"",
        "\"op\":\"ack\"",
        "\"op\":\"ping\"",
        "\"op\":\"set\"",
        "\"event\":",
        "\"serial\":",
        "\"name\":\"cc\"",
        "\"text\":\"",
        "\"message\":\"",
        "\"ok\":true",
        "\"kind\":\"knob\"",
        "\"type\":\"str\"",
        "\"type\":\"f64\"",
        "\"id\":",
        "😀",
        "\u{0}",
    ],
    bytes: b"{}[]\":,\\\n0-.eu",
    numbers: &["-1", "0", "1e400", "18446744073709551616", "-0.0", "nan"],
    runs: &[8, 300, 5000],
    run_bytes: b"[{\"\\a",
    max_len: 16 * 1024,
    ..Dict::EMPTY
};

/// A target's seed, number of mutated inputs, corpus and generator.
fn start(target: &str) -> (u64, usize, Vec<Vec<u8>>, Rng) {
    let seed = target_seed(seed_from_env(SEED), target);
    (seed, iters_from_env(3_000), load_corpus_bytes(target, 4), Rng::new(seed))
}

#[test]
fn mutated_sessions_into_the_daemons_app_protocol() {
    let target = "appreq";
    let (seed, iters, corpus, mut rng) = start(target);
    let registry = SharedRegistry::default();
    let vars = Arc::new(AppVars::new(registry.clone()));
    for i in 0..iters + corpus.len() {
        let input = if i < corpus.len() { corpus[i].clone() } else { mutate(&mut rng, &corpus, &DICT) };
        run_guarded(target, seed, i, &input, || check_session(&vars, &registry, &input));
    }
}

/// The C harness built with the sanitizers into `dir`.
fn build_c_harness(dir: &Path) -> std::path::PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/c/fuzz_parse.c");
    let exe = dir.join("fuzz_parse");
    let out = Command::new("cc")
        .args(["-std=c99", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-fsanitize=address,undefined"])
        .arg("-fno-sanitize-recover=all")
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output()
        .expect("run cc");
    assert!(out.status.success(), "building the C harness failed: {}", String::from_utf8_lossy(&out.stderr));
    exe
}

/// Feeds `inputs` to the harness in one run; Err with its report if it fails.
fn run_c_harness(exe: &Path, inputs: &[Vec<u8>]) -> Result<(), String> {
    let mut child = Command::new(exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut stdin = child.stdin.take().unwrap();
    let framed: Vec<u8> =
        inputs.iter().flat_map(|i| (i.len() as u32).to_le_bytes().into_iter().chain(i.iter().copied())).collect();
    let feeding = std::thread::spawn(move || stdin.write_all(&framed));
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let _ = feeding.join();
    let stdout = String::from_utf8_lossy(&out.stdout);
    if out.status.success() && stdout.trim() == format!("ok {}", inputs.len()) {
        Ok(())
    } else {
        Err(format!("{}: {stdout}\n{}", out.status, String::from_utf8_lossy(&out.stderr)))
    }
}

#[test]
fn mutated_daemon_lines_into_the_c_librarys_parser() {
    let target = "appevent";
    let (seed, iters, corpus, mut rng) = start(target);
    let dir = tempfile::tempdir().unwrap();
    let exe = build_c_harness(dir.path());
    let mut inputs: Vec<Vec<u8>> = corpus.clone();
    inputs.extend((0..iters).map(|_| {
        let mut i = mutate(&mut rng, &corpus, &DICT);
        i.truncate(60_000);
        i
    }));
    // One run for all; on a failure, find the first input that fails alone so that the report names it.
    if let Err(all) = run_c_harness(&exe, &inputs) {
        for (i, input) in inputs.iter().enumerate() {
            run_guarded(target, seed, i, input, || run_c_harness(&exe, std::slice::from_ref(input)));
        }
        panic!("the harness failed on the whole run but on no input alone: {all}");
    }
}
