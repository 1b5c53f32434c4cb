//! flexstack peers (docs/peers.md): the daemon's identity (a key pair and a self-signed certificate in its state
//! directory, known to peers by the certificate's SHA-256 fingerprint), the table of peers it knows (`NAME
//! ADDR:PORT FINGERPRINT`, managed by `flexstack peer`), and the rustls configurations of mutual TLS with
//! fingerprints pinned both ways: a connection completes only when the other side's certificate is one the table
//! names ([`trust`]). [`carrier`] is the `tcp` carrier's connection, [`quic`] the `quic` carrier's and [`datagram`]
//! the `udp` and `udpplus` carriers', installed into the `carrier` kind by [`install`].

pub(crate) mod batch;
pub mod carrier;
pub mod datagram;
pub mod multi;
pub mod quic;
pub mod trust;
pub(crate) mod uplinks;

pub use trust::*;

use flexstack_core::ModuleBuilder;
use flexstack_modules::stream::carrier::{CarrierRequest, Transport};

/// Installs the `tcp`, `quic`, `udp` and `udpplus` carriers into the `carrier` kind (the daemon's catalog calls it once).
pub fn install() {
    flexstack_modules::stream::carrier::install(build);
}

/// Builds a carrier of the transport its settings name, or of several (`transports`).
fn build(req: CarrierRequest) -> Result<Box<dyn ModuleBuilder>, String> {
    if !req.cfg.uplinks.is_empty() && req.cfg.peer.is_empty() {
        return Err("`uplinks` is a connecting carrier's setting (with `peer`)".into());
    }
    if req.cfg.switching() {
        return multi::build(req);
    }
    Ok(match req.cfg.transport {
        Transport::Tcp => Box::new(carrier::build(req)?),
        Transport::Quic => Box::new(quic::build(req)?),
        Transport::Udp | Transport::Udpplus => Box::new(datagram::build(req)?),
    })
}
