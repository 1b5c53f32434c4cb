//! Mutations of the results report's inputs — `timeline.csv`, `meters.csv`, `.status` files and real iperf3 -J
//! outputs (`tests/data/`) — through the shared fuzz engine (`flexstack-fuzzkit`): no input panics a parser, every
//! error is located inside its file, and what parses holds its invariants. `FLEXSTACK_FUZZ_ITERS` and
//! `FLEXSTACK_FUZZ_SEED` as for the other fuzz tests.

mod common;

use common::located;
use flexstack_fuzzkit::{iters_from_env, mutate_input, run_guarded, seed_from_env, target_seed, Dict, Rng};
use flexstack_lab::report::data::{
    counter_rate, counter_total, parse_iperf3, parse_meters, parse_status, parse_timeline,
};

const TIMELINE: &str = "time_s,planned_s,event\n0.001,0,start on srv (background): iperf3 -s\n1.002,1,start on h1 (foreground): iperf3 -c srv -J\n6.003,6,\"link h1-srv set delay_ms=50, jitter_ms=1\"\n7.5,,\"runner: \"\"stopped\"\"\"\n20,20,end of lab demo\n";
const METERS: &str = "time_s,name,value\n0,link.h1-srv.ab.tx_bytes_total,0\n0,link.h1-srv.ab.up,true\n1,link.h1-srv.ab.tx_bytes_total,125000\n1.5,link.h1-srv.ab.drop_loss_total,3\n2,link.h1-srv.ab.tx_bytes_total,100\n";
const TCP_CLIENT: &str = include_str!("data/iperf3-tcp-client.json");
const UDP_SERVER: &str = include_str!("data/iperf3-udp-server.json");
const UDP_CLIENT: &str = include_str!("data/iperf3-udp-client.json");
const ERROR: &str = include_str!("data/iperf3-error.json");
const TCP_SERVER: &str = include_str!("data/iperf3-tcp-server.json");

const CSV_DICT: Dict<'static> = Dict {
    tokens: &[
        ",",
        "\"",
        "\"\"",
        "\n",
        "\r\n",
        "\r",
        ",,",
        "true",
        "false",
        "-1",
        "nan",
        "inf",
        "1e309",
        "\u{0}",
        "😀",
        "time_s,name,value\n",
    ],
    bytes: b"\x00\xff\n\r\",.-",
    numbers: &["-0", "0", "1.5", "18446744073709551616", "1e-320", "9999999999"],
    runs: &[8, 300],
    run_bytes: b",\"\n",
    max_len: 8 * 1024,
    ..Dict::EMPTY
};

const JSON_DICT: Dict<'static> = Dict {
    tokens: &[
        "{",
        "}",
        "[",
        "]",
        ":",
        ",",
        "\"",
        "null",
        "true",
        "\"TCP\"",
        "\"UDP\"",
        "\"error\":\"x\",",
        "-1",
        "1e400",
        "\"intervals\":[]",
        "\"end\":{}",
        "\"sum\":",
        "\n",
        "😀",
        "\\u0000",
    ],
    bytes: b"{}[]\":,0-.e",
    numbers: &["-1", "0", "1.5", "18446744073709551616", "1e308", "-0.0"],
    runs: &[8, 200],
    run_bytes: b"[{\"",
    max_len: 16 * 1024,
    ..Dict::EMPTY
};

fn fuzz(target: &str, bases: &[&str], dict: &Dict<'_>, check: impl Fn(&str) -> Result<(), String>) {
    let seed = target_seed(seed_from_env(0x1ab5_eed0_0000_0002), target);
    let iters = iters_from_env(2_000);
    let mut rng = Rng::new(seed);
    let corpus: Vec<Vec<u8>> = bases.iter().map(|b| b.as_bytes().to_vec()).collect();
    for i in 0..iters {
        let base = corpus[rng.below(corpus.len())].clone();
        let input = mutate_input(&mut rng, &base, &corpus, dict);
        run_guarded(target, seed, i, &input, || match std::str::from_utf8(&input) {
            Ok(text) => check(text),
            Err(_) => check(&String::from_utf8_lossy(&input)),
        });
    }
}

#[test]
fn mutated_timelines() {
    fuzz("report-timeline", &[TIMELINE], &CSV_DICT, |text| match parse_timeline("t.csv", text) {
        Ok(rows) => {
            if rows.iter().any(|r| !r.time_s.is_finite() || r.time_s < 0.0 || r.event.trim().is_empty()) {
                return Err(format!("bad row accepted: {rows:?}"));
            }
            Ok(())
        }
        Err(e) => located(&e, "t.csv", text),
    });
}

#[test]
fn mutated_meters() {
    fuzz("report-meters", &[METERS], &CSV_DICT, |text| match parse_meters("m.csv", text) {
        Ok(rows) => {
            let mut samples: Vec<(f64, f64)> = rows.iter().map(|r| (r.time_s, r.value)).collect();
            samples.sort_by(|a, b| a.0.total_cmp(&b.0));
            if counter_rate(&samples).iter().any(|(t, v)| !t.is_finite() || v.is_nan())
                || counter_total(&samples).is_nan()
            {
                return Err(format!("rate of {samples:?} is not a number"));
            }
            Ok(())
        }
        Err(e) => located(&e, "m.csv", text),
    });
}

#[test]
fn mutated_status_lines() {
    fuzz("report-status", &["exit=0\n", "signal=9\n", "killed\n", "unknown\n"], &CSV_DICT, |text| {
        match parse_status("s", text) {
            Ok(_) => Ok(()),
            Err(e) => located(&e, "s", text),
        }
    });
}

#[test]
fn mutated_iperf3_outputs() {
    fuzz("report-iperf3", &[TCP_CLIENT, TCP_SERVER, UDP_SERVER, UDP_CLIENT, ERROR], &JSON_DICT, |text| {
        match parse_iperf3("i.json", text) {
            Ok(tests) => {
                for t in &tests {
                    if t.intervals.iter().any(|i| i.end < i.start || !i.bits_per_second.is_finite()) {
                        return Err(format!("bad interval accepted: {:?}", t.intervals));
                    }
                    if t.error.is_none() && t.sent.is_none() && t.received.is_none() && t.sum.is_none() {
                        return Err("a test without an error nor an end summary was accepted".into());
                    }
                }
                Ok(())
            }
            Err(e) => located(&e, "i.json", text),
        }
    });
}
