//! Stream services (issue 15; docs/services.md): stream modules that an application's flows pass through between
//! `terminate` and `originate`, each applied only to the flows its selection rules choose.
//!
//! | kind | what it does |
//! |---|---|
//! | [`null`] `null` | passes every frame (what a service costs, measured) |
//! | [`shape`] `shape` | token buckets per flow or per app, per direction, in bytes/s |
//! | [`inspect`] `inspect` | literal and regex patterns on the byte stream; count, alert or close |
//! | [`record`] `record` | a flow's bytes both ways to files, with timestamps (the code of `stream-tap`) |
//! | [`compress`] `compress` | zstd blocks, length-prefixed; `mode = "decompress"` restores them |
//! | [`tls`] `tls` | TLS client: the app's plaintext reaches a TLS server (rustls) |
//!
//! What they share lives here: in [`active`], their knob `active` (out of their flows' paths, and back); in [`flows`]: the selection rules (`SelectRule`, setting `select`), the table of the flows a
//! service works on (`Flows`), their meters (`SelectionMeters`), and the chain of an app's services between its
//! endpoints ([`chain_links`], [`chain_links_to`] when it ends in a carrier). [`file`](mod@file) reads the services files of `flexstack run --services` (FreeNA's
//! configuration files).
//!
//! Each service has one `stream` input and one output, both directions through them, like `stream-pass`. In a chain
//! of several, Down frames go through them in order and Up frames in the reverse order (a `direction` module after
//! each sends Up frames back to the one before), so that the service nearest the network sees Up data and the acks of
//! its own output first, as layers do; services therefore declare `breaks_cycles` (frames never loop: each hop is
//! one way).

pub mod active;
pub mod compress;
pub mod file;
pub mod flows;
pub mod inspect;
pub mod null;
pub mod record;
pub mod shape;
pub mod tls;

/// Every service kind: the registration list of the family (`flexstack_modules::kinds` takes them all; a services
/// file may name any of them).
pub fn kinds() -> Vec<Box<dyn flexstack_core::ModuleKind>> {
    vec![
        Box::new(null::NullKind),
        Box::new(shape::ShapeKind),
        Box::new(inspect::InspectKind),
        Box::new(record::RecordKind),
        Box::new(compress::CompressKind),
        Box::new(tls::TlsKind),
    ]
}

/// The links of an app's chain of services between its endpoints (`term`, `orig`) that ends in a carrier
/// (`Some`, stacks/app-peer.toml's `{app}-peer`) or not: as [`chain_links`], but the last `direction`'s `down` goes
/// to the carrier (which passes the flows it does not carry on to `orig`), and the Up frames the peer sends back
/// enter the chain where `orig`'s do (docs/services.md, "Services between two peers").
pub fn chain_links_to(
    term: &str,
    orig: &str,
    carrier: Option<&str>,
    services: &[String],
    dirs: &[String],
) -> Vec<String> {
    let mut links = chain_links(term, orig, services, dirs);
    if let (Some(peer), Some(last), Some(dir)) = (carrier, services.last(), dirs.last()) {
        let to_orig = format!("{dir}[down] -> {orig}[stream_in]");
        for l in links.iter_mut().filter(|l| **l == to_orig) {
            *l = format!("{dir}[down] -> {peer}");
        }
        links.push(format!("{peer}[stream] -> {last}"));
    }
    links
}

/// The links of an app's chain of services between its endpoints (`term`, `orig`): Down frames through the
/// services in order, Up frames in reverse order. `services` are the services' module names in order and `dirs`
/// the `direction` module after each (the last one's `down` goes to `orig`, the first one's `up` to `term`).
pub fn chain_links(term: &str, orig: &str, services: &[String], dirs: &[String]) -> Vec<String> {
    assert_eq!(services.len(), dirs.len(), "one direction module per service");
    let n = services.len();
    let mut links =
        vec![format!("{term}[stream] -> {}", services[0]), format!("{orig}[stream] -> {}", services[n - 1])];
    for i in 0..n {
        links.push(format!("{} -> {}", services[i], dirs[i]));
        let down = if i + 1 < n { services[i + 1].clone() } else { format!("{orig}[stream_in]") };
        let up = if i > 0 { services[i - 1].clone() } else { format!("{term}[stream_in]") };
        links.push(format!("{}[down] -> {down}", dirs[i]));
        links.push(format!("{}[up] -> {up}", dirs[i]));
    }
    links
}
