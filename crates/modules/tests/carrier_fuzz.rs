//! Deterministic, bounded mutational fuzzing of the peer protocol's parser (`stream::carrier::wire`, docs/peers.md),
//! on stable Rust, as part of `cargo test` (the approach of `packets_fuzz.rs`). Seeds: `fuzz/corpus/carrier/` (a
//! session's messages: hello, open, data, ack, fin, abort, close) mutated by the shared engine; each input is
//! decoded message by message as a connection would read it (`wire::check_roundtrip`): no panic, and whatever
//! decodes encodes back to the same bytes. The libFuzzer target `carrier` runs the same check.
//!
//! `FLEXSTACK_FUZZ_SEED` sets the base seed, `FLEXSTACK_FUZZ_ITERS` the inputs (default [`DEFAULT_ITERS`]).

use flexstack_fuzzkit::{
    iters_from_env, load_corpus, mutate_input, run_guarded, seed_from_env, target_seed, Dict, Rng,
};
use flexstack_modules::stream::carrier::{dgram, raw, wire};

const DEFAULT_ITERS: usize = 100_000;
const DEFAULT_SEED: u64 = 0x5eed_ca77_1e70_0001;

#[test]
fn fuzz_carrier_wire() {
    let corpus = load_corpus("carrier", 2);
    let seed = target_seed(seed_from_env(DEFAULT_SEED), "carrier");
    let mut rng = Rng::new(seed);
    // Lengths and kinds that sit on the parser's edges.
    let words: &[u16] = &[0, 1, 2, 9, 10, 17, 0x0100, 0x0101, 0xffff];
    let dict = Dict { words, bytes: &[0, 1, 2, 3, 4, 5, 6, 0x7f, 0xff], head: 16, max_len: 4096, ..Dict::EMPTY };
    let (mut decoded, iters) = (0usize, iters_from_env(DEFAULT_ITERS));
    for i in 0..iters {
        let (_, base) = &corpus[rng.below(corpus.len())];
        let input = mutate_input(&mut rng, base, &corpus, &dict);
        if matches!(wire::decode(&input), Ok(Some(_))) {
            decoded += 1;
        }
        run_guarded("carrier", seed, i, &input, || {
            wire::check_roundtrip(&input);
            Ok(())
        });
    }
    // The mutations keep a good share of inputs valid, so the checks after decoding are exercised.
    assert!(decoded * 20 > iters, "only {decoded} of {iters} inputs decoded");
}

/// The `quic` carrier's DATAGRAM payloads (`wire::check_datagram`, the libFuzzer target `carrier_datagram`): random
/// lengths around the 8-byte head and the largest payload, mutated by the shared engine.
#[test]
fn fuzz_carrier_datagrams() {
    let seed = target_seed(seed_from_env(DEFAULT_SEED), "carrier_datagram");
    let mut rng = Rng::new(seed);
    let mut base = Vec::new();
    wire::datagram(&mut base, 42, b"a DNS query");
    let corpus = vec![(String::from("seed"), base.clone()), (String::from("empty"), Vec::new())];
    let dict = Dict {
        bytes: &[0, 1, 0x7f, 0xff],
        head: 8,
        runs: &[wire::MAX_DATA],
        max_len: wire::MAX_DATA + 64,
        ..Dict::EMPTY
    };
    let (mut decoded, iters) = (0usize, iters_from_env(DEFAULT_ITERS) / 10);
    for i in 0..iters {
        let (_, b) = &corpus[rng.below(corpus.len())];
        let input = mutate_input(&mut rng, b, &corpus, &dict);
        decoded += usize::from(wire::decode_datagram(&input).is_ok());
        run_guarded("carrier_datagram", seed, i, &input, || {
            wire::check_datagram(&input);
            Ok(())
        });
    }
    assert!(decoded * 4 > iters, "only {decoded} of {iters} inputs decoded");
    assert!(wire::decode_datagram(&base[..7]).is_err(), "a head cut short is refused");
}

/// The `udp` and `udpplus` carriers' datagrams and items (`dgram::check`, the libFuzzer target `carrier_udp`): seeds
/// in `fuzz/corpus/carrier_udp/` (a handshake, a sealed head, each item) mutated by the shared engine.
#[test]
fn fuzz_carrier_udp() {
    let corpus = load_corpus("carrier_udp", 8);
    let seed = target_seed(seed_from_env(DEFAULT_SEED), "carrier_udp");
    let mut rng = Rng::new(seed);
    let words: &[u16] = &[0, 1, 2, 4, 16, 32, 64, 0x0100, 0x1000, 0xffff];
    let dict = Dict { words, bytes: &[0, 1, 2, 3, 4, 5, 6, 7, 8, 0x7f, 0xff], head: 16, max_len: 4096, ..Dict::EMPTY };
    let (mut decoded, iters) = (0usize, iters_from_env(DEFAULT_ITERS));
    for i in 0..iters {
        let (_, base) = &corpus[rng.below(corpus.len())];
        let input = mutate_input(&mut rng, base, &corpus, &dict);
        decoded += usize::from(dgram::decode(&input).is_ok() || dgram::decode_item(&input).is_ok());
        run_guarded("carrier_udp", seed, i, &input, || {
            dgram::check(&input);
            Ok(())
        });
    }
    assert!(decoded * 10 > iters, "only {decoded} of {iters} inputs decoded");
}

/// The raw stack's packets from a peer (`raw::check`, the libFuzzer target `carrier_raw`): an ICMP echo over IPv4
/// and over IPv6, mutated by the shared engine (lengths, versions, header lengths).
#[test]
fn fuzz_carrier_raw() {
    let seed = target_seed(seed_from_env(DEFAULT_SEED), "carrier_raw");
    let mut rng = Rng::new(seed);
    let mut v4 = vec![0x45, 0, 0, 28, 0, 1, 0, 0, 64, 1, 0, 0, 10, 0, 0, 2, 10, 9, 9, 9];
    v4.extend_from_slice(&[8, 0, 0, 0, 0, 1, 0, 1]);
    let mut v6 = vec![0x60, 0, 0, 0, 0, 8, 58, 64];
    v6.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
    v6.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 9]);
    v6.extend_from_slice(&[128, 0, 0, 0, 0, 1, 0, 1]);
    let corpus = vec![(String::from("v4"), v4), (String::from("v6"), v6)];
    let words: &[u16] = &[0, 8, 20, 28, 40, 48, 0xffff];
    let dict = Dict { words, bytes: &[0, 0x40, 0x45, 0x46, 0x4f, 0x60, 0xff], head: 8, max_len: 256, ..Dict::EMPTY };
    let (mut passed, iters) = (0usize, iters_from_env(DEFAULT_ITERS) / 10);
    for i in 0..iters {
        let (_, b) = &corpus[rng.below(corpus.len())];
        let input = mutate_input(&mut rng, b, &corpus, &dict);
        passed += usize::from(raw::check_packet(&input).is_ok());
        run_guarded("carrier_raw", seed, i, &input, || {
            raw::check(&input);
            Ok(())
        });
    }
    assert!(passed * 20 > iters, "only {passed} of {iters} inputs passed");
    assert!(passed < iters, "some inputs are refused");
}
