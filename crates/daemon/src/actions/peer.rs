//! Peers (docs/peers.md): this daemon's key and its table of peers, kept by `flexstack_faces::peer`.

use crate::actions::control::Control;
use flexstack_api::ops::{PeerAdd, PeerInfo, PeerKeyInfo};
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_faces::peer::{self, Peer, PeerStatus};

fn info(p: &Peer, s: &PeerStatus) -> PeerInfo {
    PeerInfo {
        name: p.name.clone(),
        addr: p.addr.to_string(),
        fingerprint: peer::fingerprint_hex(&p.fingerprint),
        state: s.state.clone(),
        connections: s.connections,
        flows_active: s.flows_active,
        bytes_out: s.bytes_out,
        bytes_in: s.bytes_in,
    }
}

fn not_found(name: &str) -> ApiError {
    ApiError::new(ErrorCode::NotFound, format!("no peer {name:?} (see `flexstack peer list`)"))
}

impl Control {
    /// This daemon's fingerprint.
    pub(super) fn peer_key(&self) -> Result<PeerKeyInfo, ApiError> {
        let id = peer::identity().ok_or_else(|| ApiError::new(ErrorCode::Internal, "no peer identity"))?;
        Ok(PeerKeyInfo { fingerprint: peer::fingerprint_hex(&id.fingerprint) })
    }

    /// Adds a peer to the table and records the table in the journal.
    pub(super) fn peer_add(&self, add: PeerAdd) -> Result<PeerInfo, ApiError> {
        let info = self.add_peer(add)?;
        self.journal_peers()?;
        Ok(info)
    }

    /// Adds a peer to the table (not recorded).
    pub(super) fn add_peer(&self, add: PeerAdd) -> Result<PeerInfo, ApiError> {
        let bad = |m: String| ApiError::new(ErrorCode::InvalidValue, m);
        let addr = add.addr.parse().map_err(|e| bad(format!("address {:?}: {e} (expected ADDR:PORT)", add.addr)))?;
        let fingerprint = peer::parse_fingerprint(&add.fingerprint).map_err(bad)?;
        let p = Peer { name: add.name, addr, fingerprint };
        peer::add(p.clone()).map_err(|m| ApiError::new(ErrorCode::InvalidEdit, m))?;
        tracing::info!(peer = %p.name, addr = %p.addr, "peer added");
        Ok(info(&p, &PeerStatus::default()))
    }

    /// Removes a peer from the table.
    pub(super) fn peer_del(&self, name: &str) -> Result<PeerInfo, ApiError> {
        let p = peer::del(name).ok_or_else(|| not_found(name))?;
        tracing::info!(peer = %p.name, "peer removed");
        self.journal_peers()?;
        Ok(info(&p, &PeerStatus::default()))
    }

    /// One peer.
    pub(super) fn peer_show(&self, name: &str) -> Result<PeerInfo, ApiError> {
        peer::list().iter().find(|(p, _)| p.name == name).map(|(p, s)| info(p, s)).ok_or_else(|| not_found(name))
    }

    /// Every peer.
    pub(super) fn peer_list(&self) -> Result<Vec<PeerInfo>, ApiError> {
        Ok(peer::list().iter().map(|(p, s)| info(p, s)).collect())
    }
}
