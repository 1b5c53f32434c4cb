//! Fuzz target `rules`: the rule language's parser, checker and engine on mutated rule texts, with the shared
//! deterministic engine of `flexstack-fuzzkit` (see fuzz/README.md for the variables it reads:
//! `FLEXSTACK_FUZZ_SEED`, `FLEXSTACK_FUZZ_ITERS`).
//!
//! Seeds: `fuzz/corpus/rules/`. For every input, besides "no panic":
//! - every diagnostic lies inside the text (line 1..=lines+1, column >= 1) and is one line;
//! - a text that checks renders back (each defined rule's definition, triggers and actions) to a text that checks
//!   again and gives the same unit trees;
//! - loading it into an engine and advancing the clock a few times neither panics nor hangs, and
//!   every knob write names a variable without `*`.

use flexstack_fuzzkit::{
    iters_from_env, load_corpus_bytes, mutate, run_guarded, seed_from_env, target_seed, Dict, Rng,
};
// The check, shared with the libFuzzer target `rules` (fuzz/fuzz_targets/rules.rs).
#[allow(dead_code)]
#[path = "../../../fuzz/src/rules.rs"]
mod checks;
use checks::check;
use std::time::{Duration, Instant};

const DEFAULT_ITERS: usize = 8_000;
const DEFAULT_SEED: u64 = 0x5eed_f1e5_57ac_0001;
const SLOW: Duration = Duration::from_secs(2);

const DICT: Dict<'static> = Dict {
    tokens: &[
        "->",
        ":",
        "(",
        ")",
        ",",
        "\n",
        "[manual]\n",
        "[contextEnter]\n",
        "[contextExit]\n",
        "get(\"",
        "set(\"",
        "\"flow.*.rtt\"",
        "\"module.src.rate\"",
        "History(",
        "Avg(",
        "Timer(",
        "Threshold(",
        "If(",
        "Cache(",
        "EWMA(",
        "load(",
        "unload(ALL)",
        "replace(",
        "*",
        "5s",
        "200ms",
        "0",
        "-1",
        "1e99",
        "\"",
        "#",
        "//",
        "\\",
        "😀",
        "\t",
        "ALL",
        "true",
    ],
    bytes: b"\n\"()-:,*#[]",
    words: &[],
    patches: &[],
    numbers: &["0", "-1", "18446744073709551616", "99999999999", "0.0001", "65537"],
    runs: &[8, 300],
    run_bytes: b"(",
    head: 0,
    max_len: 16 * 1024,
};

#[test]
fn fuzz_rules() {
    let corpus = load_corpus_bytes("rules", 8);
    let seed = target_seed(seed_from_env(DEFAULT_SEED), "rules");
    for (i, s) in corpus.iter().enumerate() {
        run_guarded("rules", seed, i, s, || check(&String::from_utf8_lossy(s)));
    }
    let mut rng = Rng::new(seed);
    for i in 0..iters_from_env(DEFAULT_ITERS) {
        let input = mutate(&mut rng, &corpus, &DICT);
        let started = Instant::now();
        run_guarded("rules", seed, i, &input, || check(&String::from_utf8_lossy(&input)));
        assert!(started.elapsed() < SLOW, "slow input at iteration {i}: {:?}", String::from_utf8_lossy(&input));
    }
}
