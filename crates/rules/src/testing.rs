//! Rule texts for tests and benchmarks of the signalling.

/// A chain of `n` Forwarders over the meter `meter`: `{name}1: Forwarder(get("meter"))`, then
/// `{name}I: Forwarder({name}I-1)` up to `{name}N`. With `pulled`, the timer `t` triggers the last one, so the whole
/// chain is evaluated by query; without, it is pushed by the meter's changes.
pub fn forwarder_chain(name: &str, meter: &str, n: usize, pulled: bool) -> String {
    let mut text = format!("{name}1: Forwarder(get(\"{meter}\"))\n");
    for i in 2..=n {
        text.push_str(&format!("{name}{i}: Forwarder({name}{})\n", i - 1));
    }
    if pulled {
        text.push_str(&format!("t: Timer(1h)\nt -> {name}{n}\n"));
    }
    text
}
