//! Fuzzing of the persistence journal's reader (`flexstack_daemon::journal::scan`, issue 18 item 3) with the shared
//! engine (`flexstack-fuzzkit`; see `fuzz/README.md`; `FLEXSTACK_FUZZ_SEED` and `FLEXSTACK_FUZZ_ITERS` as for the
//! other fuzz tests). The seeds in `fuzz/corpus/journal/` are journals the writer makes (rewrite them with
//! `cargo test --test journal_fuzz -- --ignored`).
//!
//! The check is `fuzz/src/journal.rs`, shared with the libFuzzer target `journal` (docs/fuzzing.md). Checked
//! besides "no panic": the good part is a prefix of the input made of whole records that read back the
//! same when written again; the damage, if any, starts right after it and covers the rest; the records fold into a
//! state that a revision log takes back without overflowing, and that writes back as the same state.

#[path = "../fuzz/src/journal.rs"]
mod checks;

use checks::{check, journal_of};
use flexstack_daemon::journal::{Record, RuleWrites, RulesChange, RulesOp, StoredPeer, StoredPeers, StoredRevision};
use flexstack_fuzzkit::{
    iters_from_env, load_corpus_bytes, mutate, run_guarded, seed_from_env, target_seed, Dict, Rng,
};

const SEED: u64 = 0x5eed_10a2_0000_0003;

const DICT: Dict<'static> = Dict {
    tokens: &[
        "FSJRNL1\n",
        "{\"record\":\"revision\"",
        "{\"record\":\"rules\"",
        "{\"record\":\"peers\"",
        "\"fingerprint\":\"",
        "\"number\":",
        "\"op\":\"load\"",
        "\"op\":\"rollback\"",
        "\"stack\":\"",
        "\\u0000",
        "\"",
        "}",
        "😀",
    ],
    bytes: b"\x00\xff\x7f\x80{}\":,",
    words: &[0, 0xffff, 0x0100, 0x7fff],
    patches: &[&[0xff, 0xff, 0xff, 0xff], &[0, 0, 0, 0], &[0, 0, 0, 1]],
    numbers: &["0", "18446744073709551615", "9007199254740993", "-1"],
    runs: &[8, 300],
    run_bytes: b"\x00a",
    max_len: 32 * 1024,
    ..Dict::EMPTY
};

#[test]
fn mutated_journals_into_the_reader() {
    let target = "journal";
    let seed = target_seed(seed_from_env(SEED), target);
    let (iters, corpus, mut rng) = (iters_from_env(15_000), load_corpus_bytes(target, 4), Rng::new(seed));
    for i in 0..iters + corpus.len() {
        let input = if i < corpus.len() { corpus[i].clone() } else { mutate(&mut rng, &corpus, &DICT) };
        run_guarded(target, seed, i, &input, || check(&input));
    }
}

fn revision(number: u64, stack: &str, apps: &[&str]) -> Record {
    Record::Revision(StoredRevision {
        number,
        time_ms: 1_764_150_000_000 + number,
        user: "root".into(),
        change: format!("set module.src.rate {number}"),
        notes: vec!["note".into()],
        stack: stack.into(),
        app_modules: apps.iter().map(|a| a.to_string()).collect(),
        rule: None,
    })
}

/// An entry of rule `rule`'s knob writes: `writes` of them since `first_ms`.
fn rule_entry(number: u64, rule: &str, writes: u64, first_ms: u64) -> Record {
    let Record::Revision(mut r) = revision(number, "", &[]) else { unreachable!() };
    r.user = "rules".into();
    r.rule = Some(RuleWrites { rule: rule.into(), writes, first_ms });
    Record::Revision(r)
}

/// A peers record of `(name, addr)` pairs, each with a made-up fingerprint.
fn peers(table: &[(&str, &str)]) -> Record {
    let peer = |(name, addr): &(&str, &str)| StoredPeer {
        name: name.to_string(),
        addr: addr.to_string(),
        fingerprint: "5f".repeat(32),
    };
    Record::Peers(StoredPeers { peers: table.iter().map(peer).collect() })
}

/// Writes the seeds of `fuzz/corpus/journal/` from the writer (run by hand with `-- --ignored`).
#[test]
#[ignore]
fn write_journal_corpus() {
    let stack = "links = [\"src -> count\"]\n\n[modules.src]\nkind = \"source\"\nrate = 10.0\n\n[modules.count]\nkind = \"counter\"\n";
    let load = |n, source: &str, text: &str| {
        Record::Rules(RulesChange { revision: n, op: RulesOp::Load { source: source.into(), text: text.into() } })
    };
    let seeds: Vec<(&str, Vec<Record>)> = vec![
        ("empty-header", vec![]),
        ("one-revision", vec![revision(1, stack, &[])]),
        (
            "rules-and-revisions",
            vec![
                load(1, "hot.rules", "hot: Threshold(get(\"module.count.frames_in_total\"), 5, 1)\n"),
                Record::Rules(RulesChange { revision: 2, op: RulesOp::Unload { names: vec!["hot".into()] } }),
                Record::Rules(RulesChange { revision: 3, op: RulesOp::Rollback { revision: 1 } }),
                Record::Rules(RulesChange {
                    revision: 4,
                    op: RulesOp::Replace { old: "hot".into(), new: "cold".into() },
                }),
                Record::Rules(RulesChange { revision: 5, op: RulesOp::Delete { names: vec!["ALL".into()] } }),
                revision(7, stack, &[]),
                revision(8, stack, &["app1", "app1-host"]),
                revision(8, "", &[]),
                rule_entry(9, "flip", 1, 5000),
                rule_entry(10, "flop", 1, 5001),
                rule_entry(11, "flip", 2, 5000),
            ],
        ),
        ("many-revisions", (1..=12).map(|n| revision(n, stack, &[])).collect()),
        (
            "peers",
            vec![
                peers(&[("gateway", "10.0.0.2:7300"), ("b", "[fd00::2]:7300")]),
                revision(1, stack, &[]),
                peers(&[("b", "[fd00::2]:7300")]),
                peers(&[]),
            ],
        ),
    ];
    let dir = flexstack_fuzzkit::corpus_dir("journal");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, records) in seeds {
        std::fs::write(dir.join(name), journal_of(&records)).unwrap();
    }
}
