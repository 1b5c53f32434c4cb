//! flexstack peers (docs/peers.md): this daemon's key, and the peers it carries flows to or accepts them from.

use serde::{Deserialize, Serialize};

/// `peer_key`: this daemon's identity. Result: [`PeerKeyInfo`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerKey;

/// The result of `peer_key`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerKeyInfo {
    /// The SHA-256 fingerprint of this daemon's certificate (64 hex digits): what peers add it with.
    pub fingerprint: String,
}

/// `peer_add`: a peer this daemon carries flows to (a carrier's `peer`) and accepts carriers from. Result:
/// [`PeerInfo`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerAdd {
    /// Its name (1-32 of `A-Za-z0-9_-`).
    pub name: String,
    /// Where its daemon accepts carriers (`ADDR:PORT`).
    pub addr: String,
    /// Its certificate's SHA-256 fingerprint (its `flexstack peer key`).
    pub fingerprint: String,
}

/// `peer_del`: forgets a peer (new connections from or to it are refused). Result: [`PeerInfo`] (the one removed).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerDel {
    /// The peer's name.
    pub name: String,
}

/// `peer_show`: one peer. Result: [`PeerInfo`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerShow {
    /// The peer's name.
    pub name: String,
}

/// `peer_list`: the peers. Result: a list of [`PeerInfo`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerList;

/// A peer, with what its carriers report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerInfo {
    /// Its name.
    pub name: String,
    /// Its address and port.
    pub addr: String,
    /// Its certificate's fingerprint.
    pub fingerprint: String,
    /// `connected`, `connecting`, `down: <why>`, or empty when no carrier connects to it.
    pub state: String,
    /// Connections established with it.
    pub connections: u64,
    /// Flows carried to it now (by carriers that connect to it).
    pub flows_active: u64,
    /// Bytes written to it (framing included).
    pub bytes_out: u64,
    /// Bytes read from it.
    pub bytes_in: u64,
}
