//! Mutations of `labs/demo.toml` through the shared fuzz engine (`flexstack-fuzzkit`): no input panics the parser,
//! and every error is located inside the file.

mod common;

use common::check_lab;
use flexstack_fuzzkit::{iters_from_env, mutate_input, run_guarded, seed_from_env, target_seed, Dict, Rng};

const DEMO: &str = include_str!("../../../labs/demo.toml");

const DICT: Dict<'static> = Dict {
    tokens: &[
        "[",
        "]",
        "[[",
        "]]",
        "=",
        "\"",
        ".",
        "\n",
        "#",
        "{",
        "}",
        ",",
        "[[links]]\n",
        "[[events]]\n",
        "[hosts.",
        "link = \"h1-srv\"\n",
        "down = true\n",
        "knob = \"a.b\"\n",
        "value = 1\n",
        "at = \"19.999s\"\n",
        "at = \"20s\"\n",
        "-",
        "ms",
        "s",
        "m",
        "h",
        "us",
        "nan",
        "inf",
        "1e309",
        "\u{0}",
        "😀",
        "loss_model = \"gilbert-elliott\"\n",
        "ge_p",
        "ge_r",
        "set = { ",
        "host = \"app\"\n",
        "\r\n",
    ],
    bytes: b"\x00\xff\n\"'=[].-",
    words: &[],
    patches: &[],
    numbers: &[
        "-1",
        "0",
        "101",
        "65536",
        "67",
        "1.5",
        "18446744073709551616",
        "9223372036854775807",
        "99999999999999999",
    ],
    runs: &[8, 300],
    run_bytes: b"a0[",
    head: 0,
    max_len: 8 * 1024,
};

#[test]
fn mutated_demo_never_panics_and_errors_are_located() {
    let seed = target_seed(seed_from_env(0x1ab5_eed0_0000_0001), "lab");
    let iters = iters_from_env(2_500);
    let mut rng = Rng::new(seed);
    let corpus = vec![DEMO.as_bytes().to_vec()];
    for i in 0..iters {
        let input = mutate_input(&mut rng, DEMO.as_bytes(), &corpus, &DICT);
        run_guarded("lab", seed, i, &input, || check_lab(&input));
    }
}
