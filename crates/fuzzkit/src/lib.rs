//! The small deterministic mutational fuzz engine shared by flexstack's stable-Rust fuzz tests
//! (`tests/fuzz_parsers.rs`, `crates/modules/tests/{packets,rules,link}_fuzz.rs`; see `fuzz/README.md`).
//!
//! Dev-only: no dependencies, no nightly. A fuzz test
//!
//! 1. reads its base seed with [`seed_from_env`] (`FLEXSTACK_FUZZ_SEED`, decimal or `0x` hex) and its input count
//!    with [`iters_from_env`] (`FLEXSTACK_FUZZ_ITERS`), and derives one seed per target with [`target_seed`];
//! 2. loads its seeds from `fuzz/corpus/<target>/` with [`load_corpus`];
//! 3. draws inputs with [`mutate`] (or [`mutate_input`]) from a [`Rng`], guided by a target-specific [`Dict`] of
//!    tokens, bytes, 16-bit words and patches;
//! 4. checks each input under `catch_unwind`, e.g. with [`run_guarded`], which panics with a report naming the
//!    target, the seed and the iteration and showing the input escaped and in hex, so the failure can be
//!    reproduced and the input added to the corpus.
//!
//! With the same corpus and dictionary, the inputs only depend on the seed.

#![deny(unsafe_code)]
#![warn(missing_docs)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

/// xorshift64* PRNG: fast, deterministic, good enough for fuzzing.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`; close seeds give unrelated streams (the seed is mixed with splitmix64).
    pub fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Rng((z ^ (z >> 31)) | 1)
    }

    /// The next 64 random bits.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n`; 0 when `n` is 0.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// True with probability `1 / n`.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }

    /// A random element of `items` (not empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// The number in environment variable `name` (decimal or `0x` hex), if set; panics if it is not a number.
pub fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    let parsed = match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    Some(parsed.unwrap_or_else(|_| panic!("{name}={v:?}: expected a number")))
}

/// The base seed: `FLEXSTACK_FUZZ_SEED`, or `default` so that `cargo test` stays deterministic.
pub fn seed_from_env(default: u64) -> u64 {
    env_u64("FLEXSTACK_FUZZ_SEED").unwrap_or(default)
}

/// Mutated inputs per target: `FLEXSTACK_FUZZ_ITERS`, or `default`.
pub fn iters_from_env(default: usize) -> usize {
    env_u64("FLEXSTACK_FUZZ_ITERS").map_or(default, |n| n as usize)
}

/// A target's own seed derived from the base seed (FNV-1a of its name), so each target's stream is reproducible on
/// its own.
pub fn target_seed(base: u64, target: &str) -> u64 {
    target.bytes().fold(base ^ 0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// The directory of `target`'s seeds: `fuzz/corpus/<target>/` at the workspace root.
pub fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus").join(target)
}

/// The seeds of `target` as (file name, bytes), sorted by file name; panics if there are fewer than `min`.
pub fn load_corpus(target: &str, min: usize) -> Vec<(String, Vec<u8>)> {
    let dir = corpus_dir(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|e| e.expect("corpus entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    let seeds: Vec<(String, Vec<u8>)> = files
        .iter()
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(p).expect("read seed")))
        .collect();
    assert!(seeds.len() >= min, "corpus {} has only {} seeds", dir.display(), seeds.len());
    seeds
}

/// The bytes of `target`'s seeds, sorted by file name: [`load_corpus`] without the names.
pub fn load_corpus_bytes(target: &str, min: usize) -> Vec<Vec<u8>> {
    load_corpus(target, min).into_iter().map(|(_, s)| s).collect()
}

/// Anything that holds one seed's bytes: `Vec<u8>`, or a (name, bytes) pair from [`load_corpus`].
pub trait Seed {
    /// The seed's bytes.
    fn bytes(&self) -> &[u8];
}

impl Seed for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

impl Seed for (String, Vec<u8>) {
    fn bytes(&self) -> &[u8] {
        &self.1
    }
}

/// What a target's mutations plant, and their bounds. Empty lists disable the mutations that use them; start from
/// [`Dict::EMPTY`].
#[derive(Clone, Copy, Debug)]
pub struct Dict<'a> {
    /// Texts inserted at random positions (syntax, keywords, extreme numbers, unicode).
    pub tokens: &'a [&'a str],
    /// Bytes written over or inserted (random bytes when empty).
    pub bytes: &'a [u8],
    /// Big-endian 16-bit values written over two bytes (lengths, EtherTypes, offsets).
    pub words: &'a [u16],
    /// Byte strings written over the input in place (MAC or IP addresses).
    pub patches: &'a [&'a [u8]],
    /// Numbers that replace the next run of digits (or are inserted when there is none).
    pub numbers: &'a [&'a str],
    /// Lengths of runs of one byte inserted (none when empty).
    pub runs: &'a [usize],
    /// Extra bytes long runs are made of, besides [`Dict::bytes`].
    pub run_bytes: &'a [u8],
    /// When not 0, three in four in-place writes fall within the first `head` bytes (the headers).
    pub head: usize,
    /// Inputs are cut to this many bytes.
    pub max_len: usize,
}

impl Dict<'static> {
    /// No tokens, bytes, words, patches, numbers or runs; inputs up to 64 KiB.
    pub const EMPTY: Dict<'static> = Dict {
        tokens: &[],
        bytes: &[],
        words: &[],
        patches: &[],
        numbers: &[],
        runs: &[],
        run_bytes: &[],
        head: 0,
        max_len: 64 * 1024,
    };
}

/// Replaces the first run of digits at or after `at` with `with`; false if there is none.
fn replace_number(input: &mut Vec<u8>, at: usize, with: &[u8]) -> bool {
    let Some(start) = input[at..].iter().position(u8::is_ascii_digit).map(|p| p + at) else {
        return false;
    };
    let end = input[start..].iter().position(|b| !b.is_ascii_digit()).map_or(input.len(), |p| p + start);
    input.splice(start..end, with.iter().copied());
    true
}

/// A mutation of a random seed of `corpus` (not empty): see [`mutate_input`].
pub fn mutate<S: Seed>(rng: &mut Rng, corpus: &[S], dict: &Dict<'_>) -> Vec<u8> {
    let base = rng.pick(corpus).bytes();
    mutate_input(rng, base, corpus, dict)
}

/// One to four stacked mutations of `input` (half the time just one, so near-valid inputs reach the checks after
/// parsing): bit flips, planted bytes, words and patches, inserts, deletes, duplicated ranges, truncation, splices
/// with and pieces of other `corpus` seeds, tokens, long runs of one byte, extreme numbers. The result is at most
/// `dict.max_len` bytes.
pub fn mutate_input<S: Seed>(rng: &mut Rng, input: &[u8], corpus: &[S], dict: &Dict<'_>) -> Vec<u8> {
    let mut out = input.to_vec();
    // The mutations this dictionary and corpus allow (the numbers of the `match` below).
    let enabled = |op: u8| match op {
        2 => !dict.words.is_empty(),
        3 => !dict.patches.is_empty(),
        8 | 9 => !corpus.is_empty(),
        10 | 11 => !dict.tokens.is_empty(),
        12 => !dict.runs.is_empty(),
        13 => !dict.numbers.is_empty(),
        _ => true,
    };
    let mut ops = [0u8; 14];
    let mut n_ops = 0;
    for op in 0..14 {
        if enabled(op) {
            ops[n_ops] = op;
            n_ops += 1;
        }
    }
    let rounds = if rng.one_in(2) { 1 } else { 2 + rng.below(3) };
    for _ in 0..rounds {
        let len = out.len();
        let at = rng.below(len + 1);
        // Where an `n`-byte in-place write starts (`n <= len`): mostly in the headers when `dict.head` is set.
        let place = |rng: &mut Rng, n: usize| {
            if dict.head == 0 || rng.one_in(4) {
                rng.below(len - n + 1)
            } else {
                rng.below((len - n).min(dict.head) + 1)
            }
        };
        let byte = |rng: &mut Rng| {
            if !dict.bytes.is_empty() && !rng.one_in(2) {
                *rng.pick(dict.bytes)
            } else {
                rng.next() as u8
            }
        };
        match ops[rng.below(n_ops)] {
            0 if len > 0 => out[rng.below(len)] ^= 1 << rng.below(8),
            1 if len > 0 => {
                let i = place(rng, 1);
                out[i] = byte(rng);
            }
            2 if len > 1 && !dict.words.is_empty() => {
                let i = place(rng, 2);
                out[i..i + 2].copy_from_slice(&rng.pick(dict.words).to_be_bytes());
            }
            3 if !dict.patches.is_empty() => {
                let p = *rng.pick(dict.patches);
                if p.len() <= len {
                    let i = place(rng, p.len());
                    out[i..i + p.len()].copy_from_slice(p);
                }
            }
            4 => {
                let b = byte(rng);
                out.insert(at, b);
            }
            5 if len > 0 => {
                let start = at.min(len - 1);
                let n = 1 + rng.below((len - start).min(16));
                out.drain(start..start + n);
            }
            6 if len > 0 => {
                // Duplicate a range somewhere else.
                let start = rng.below(len);
                let n = 1 + rng.below((len - start).min(64));
                let piece = out[start..start + n].to_vec();
                let to = rng.below(len + 1);
                out.splice(to..to, piece);
            }
            7 => out.truncate(at),
            8 if !corpus.is_empty() => {
                // Splice: a prefix of this input and a suffix of another seed.
                let other = rng.pick(corpus).bytes();
                let from = rng.below(other.len() + 1);
                out.truncate(at);
                out.extend_from_slice(&other[from..]);
            }
            9 if len > 0 && !corpus.is_empty() => {
                // Replace a range by a random piece of another seed.
                let other = rng.pick(corpus).bytes();
                if !other.is_empty() {
                    let s = rng.below(other.len());
                    let piece = &other[s..(s + 1 + rng.below(32)).min(other.len())];
                    let end = (at + rng.below(8)).min(len);
                    out.splice(at..end, piece.iter().copied());
                }
            }
            10 | 11 if !dict.tokens.is_empty() => {
                let tok = rng.pick(dict.tokens).as_bytes();
                out.splice(at..at, tok.iter().copied());
            }
            12 if !dict.runs.is_empty() => {
                let c = if dict.run_bytes.is_empty() || (!dict.bytes.is_empty() && rng.one_in(2)) {
                    byte(rng)
                } else {
                    *rng.pick(dict.run_bytes)
                };
                let n = *rng.pick(dict.runs);
                out.splice(at..at, std::iter::repeat_n(c, n));
            }
            13 if !dict.numbers.is_empty() => {
                let n = rng.pick(dict.numbers).as_bytes();
                if !replace_number(&mut out, at, n) {
                    out.splice(at..at, n.iter().copied());
                }
            }
            _ => {}
        }
        out.truncate(dict.max_len);
    }
    out
}

/// Lower-case hex of `data`.
pub fn hex(data: &[u8]) -> String {
    data.iter().map(|b| format!("{b:02x}")).collect()
}

/// At most `max` characters of `s`, saying how much was left out.
pub fn clip(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((cut, _)) => format!("{}... ({} more bytes)", &s[..cut], s.len() - cut),
        None => s.to_string(),
    }
}

/// The message of a caught panic.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(non-string panic payload)".to_string())
}

/// Runs `check` on `input` under `catch_unwind`. On a panic or an `Err`, panics with a report that reproduces it:
/// the target, the base `seed` (as `FLEXSTACK_FUZZ_SEED=...`), the iteration and the input, escaped and in hex.
pub fn run_guarded(
    target: &str,
    seed: u64,
    iteration: usize,
    input: &[u8],
    check: impl FnOnce() -> Result<(), String>,
) {
    let message = match catch_unwind(AssertUnwindSafe(check)) {
        Ok(Ok(())) => return,
        Ok(Err(m)) => m,
        Err(p) => format!("panic: {}", panic_message(&*p)),
    };
    panic!(
        "fuzz target {target} failed at iteration {iteration} (FLEXSTACK_FUZZ_SEED={seed:#x}): {message}\n\
         input ({} bytes): \"{}\"\nhex: {}",
        input.len(),
        clip(&input.escape_ascii().to_string(), 2000),
        hex(input)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const DICT: Dict<'static> = Dict {
        tokens: &["[", "->", "\u{0}", "nan", "😀"],
        bytes: b"\x00\xff\n\"",
        words: &[0, 0xffff, 1500],
        patches: &[&[1, 2, 3, 4], &[0xff; 6]],
        numbers: &["-1", "18446744073709551616"],
        runs: &[8, 300, 4096],
        run_bytes: b"a0",
        head: 40,
        max_len: 700,
    };

    fn corpus() -> Vec<Vec<u8>> {
        vec![b"hello 123 world".to_vec(), vec![], vec![0x45; 60], b"x".to_vec()]
    }

    fn run(seed: u64, dict: &Dict<'_>) -> Vec<Vec<u8>> {
        let mut rng = Rng::new(seed);
        let c = corpus();
        (0..2000).map(|_| mutate(&mut rng, &c, dict)).collect()
    }

    #[test]
    fn deterministic_for_a_seed() {
        assert_eq!(run(1, &DICT), run(1, &DICT));
        assert_ne!(run(1, &DICT), run(2, &DICT));
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        assert!((0..100).all(|_| a.next() == b.next()));
        assert_ne!(target_seed(1, "stack"), target_seed(1, "link"));
    }

    #[test]
    fn mutations_stay_in_bounds() {
        for seed in 0..4 {
            let out = run(seed, &DICT);
            assert!(out.iter().all(|m| m.len() <= DICT.max_len));
            // They do change things, and lengths vary.
            assert!(out.iter().filter(|m| corpus().contains(m)).count() < out.len() / 4);
            assert!(out.iter().any(|m| m.len() > 300) && out.iter().any(|m| m.len() < 10));
            assert!(run(seed, &Dict::EMPTY).iter().all(|m| m.len() <= Dict::EMPTY.max_len));
        }
        let mut rng = Rng::new(3);
        assert!((0..1000).all(|_| rng.below(7) < 7) && rng.below(0) == 0);
        assert_eq!(rng.bytes(5).len(), 5);
    }

    #[test]
    fn corpus_and_reports() {
        let seeds = load_corpus("link", 10);
        assert!(seeds.windows(2).all(|w| w[0].0 < w[1].0));
        run_guarded("ok", 1, 0, b"x", || Ok(()));
        let failed = catch_unwind(|| run_guarded("t", 0x5eed, 4, b"a\n\xff", || Err("bad".into())));
        let message = panic_message(&*failed.expect_err("reports"));
        assert!(message.contains("FLEXSTACK_FUZZ_SEED=0x5eed") && message.contains("iteration 4"), "{message}");
        assert!(message.contains(r#""a\n\xff""#) && message.contains("0aff"), "{message}");
        assert_eq!(clip("abcdef", 3), "abc... (3 more bytes)");
    }
}
