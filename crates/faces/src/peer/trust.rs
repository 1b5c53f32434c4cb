//! What peers trust each other by (docs/peers.md): the daemon's identity (key pair and self-signed certificate), the
//! table of peers, and the rustls configurations of mutual TLS with pinned fingerprints.

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    ClientConfig, DigitallySignedStruct, DistinguishedName, Error as TlsError, ServerConfig, SignatureScheme,
};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// The name both sides use in the TLS handshake (certificates are pinned by fingerprint, never checked by name).
pub const TLS_NAME: &str = "flexstack-peer";

/// The daemon's identity.
pub struct Identity {
    cert: CertificateDer<'static>,
    key: Vec<u8>,
    /// SHA-256 of the certificate (DER).
    pub fingerprint: [u8; 32],
}

impl Identity {
    /// The key pair (PKCS#8 DER): the datagram carriers sign their handshakes with it.
    pub(crate) fn key_der(&self) -> &[u8] {
        &self.key
    }

    /// The certificate (DER), whose fingerprint names this daemon to its peers.
    pub(crate) fn cert_der(&self) -> &[u8] {
        &self.cert
    }
}

static IDENTITY: OnceLock<Identity> = OnceLock::new();

/// The SHA-256 fingerprint of a certificate.
pub fn fingerprint_of(der: &[u8]) -> [u8; 32] {
    ring::digest::digest(&ring::digest::SHA256, der).as_ref().try_into().expect("32 bytes")
}

/// A fingerprint as written: 64 lowercase hex digits.
pub fn fingerprint_hex(fp: &[u8; 32]) -> String {
    fp.iter().map(|b| format!("{b:02x}")).collect()
}

/// Reads a fingerprint: 64 hex digits, optionally `sha256:` first and colons between bytes.
pub fn parse_fingerprint(text: &str) -> Result<[u8; 32], String> {
    let t = text.trim();
    let hex: String = t.strip_prefix("sha256:").unwrap_or(t).chars().filter(|c| *c != ':').collect();
    if hex.len() != 64 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(format!("expected a SHA-256 fingerprint (64 hex digits), got {text:?}"));
    }
    let mut fp = [0u8; 32];
    for (i, b) in fp.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex");
    }
    Ok(fp)
}

/// Loads the identity from `dir/peer/` (`key.der`, PKCS#8, mode 0600, and `cert.der`), making it the first time;
/// once per process (later calls return the first).
pub fn init(dir: &Path) -> Result<&'static Identity, String> {
    if let Some(id) = IDENTITY.get() {
        return Ok(id);
    }
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let folder = dir.join("peer");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&folder)
        .map_err(|e| format!("{}: cannot create: {e}", folder.display()))?;
    let (key_path, cert_path) = (folder.join("key.der"), folder.join("cert.der"));
    let (key, cert) = match (std::fs::read(&key_path), std::fs::read(&cert_path)) {
        (Ok(k), Ok(c)) => (k, c),
        _ => {
            let made = rcgen::generate_simple_self_signed(vec![TLS_NAME.to_string()])
                .map_err(|e| format!("cannot make the peer key: {e}"))?;
            let (key, cert) = (made.signing_key.serialize_der(), made.cert.der().to_vec());
            let write = |path: &Path, bytes: &[u8], mode: u32| {
                use std::io::Write;
                std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(mode)
                    .open(path)
                    .and_then(|mut f| f.write_all(bytes))
                    .map_err(|e| format!("{}: cannot write: {e}", path.display()))
            };
            write(&key_path, &key, 0o600)?;
            write(&cert_path, &cert, 0o644)?;
            tracing::info!(fingerprint = %fingerprint_hex(&fingerprint_of(&cert)), "made the peer identity");
            (key, cert)
        }
    };
    let fingerprint = fingerprint_of(&cert);
    let _ = IDENTITY.set(Identity { cert: CertificateDer::from(cert), key, fingerprint });
    Ok(IDENTITY.get().expect("set"))
}

/// The identity, once [`init`] made it.
pub fn identity() -> Option<&'static Identity> {
    IDENTITY.get()
}

/// A peer the daemon knows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Its name (1-32 of `A-Za-z0-9_-`).
    pub name: String,
    /// Where its daemon accepts carriers.
    pub addr: SocketAddr,
    /// Its certificate's SHA-256.
    pub fingerprint: [u8; 32],
}

/// What the carriers report about a peer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerStatus {
    /// `connected`, `connecting`, `down: <why>`, or empty (no carrier uses it).
    pub state: String,
    /// Connections established.
    pub connections: u64,
    /// Flows carried now.
    pub flows_active: u64,
    /// Bytes written to and read from its connections (framing included).
    pub bytes_out: u64,
    /// See `bytes_out`.
    pub bytes_in: u64,
    /// What its latest `Hello` offered (transports, `switch`).
    pub caps: Vec<String>,
}

type Table = BTreeMap<String, (Peer, PeerStatus)>;

fn table() -> MutexGuard<'static, Table> {
    static TABLE: Mutex<Table> = Mutex::new(BTreeMap::new());
    TABLE.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Adds a peer; a name or fingerprint already in the table is refused.
pub fn add(peer: Peer) -> Result<(), String> {
    let ok = !peer.name.is_empty()
        && peer.name.len() <= 32
        && peer.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if !ok {
        return Err(format!("peer name {:?}: expected 1-32 of A-Z a-z 0-9 - _", peer.name));
    }
    let mut t = table();
    if t.contains_key(&peer.name) {
        return Err(format!("peer {:?} exists (flexstack peer del it first)", peer.name));
    }
    if let Some((other, _)) = t.values().find(|(p, _)| p.fingerprint == peer.fingerprint) {
        return Err(format!("that fingerprint is peer {:?}'s", other.name));
    }
    if Some(peer.fingerprint) == identity().map(|i| i.fingerprint) {
        return Err("that fingerprint is this daemon's own".into());
    }
    t.insert(peer.name.clone(), (peer, PeerStatus::default()));
    Ok(())
}

/// Removes a peer (connections already up stay until they end; new ones are refused).
pub fn del(name: &str) -> Option<Peer> {
    table().remove(name).map(|(p, _)| p)
}

/// Every peer with its status, by name.
pub fn list() -> Vec<(Peer, PeerStatus)> {
    table().values().cloned().collect()
}

/// The peer named `name`.
pub fn get(name: &str) -> Option<Peer> {
    table().get(name).map(|(p, _)| p.clone())
}

/// The name of the peer whose certificate has fingerprint `fp`.
pub fn by_fingerprint(fp: &[u8; 32]) -> Option<String> {
    table().values().find(|(p, _)| &p.fingerprint == fp).map(|(p, _)| p.name.clone())
}

/// The status of peer `name`.
pub fn status(name: &str) -> Option<PeerStatus> {
    table().get(name).map(|(_, s)| s.clone())
}

/// Changes the status of peer `name` (if it is still in the table).
pub fn report(name: &str, f: impl FnOnce(&mut PeerStatus)) {
    if let Some((_, s)) = table().get_mut(name) {
        f(s);
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_err(e: TlsError) -> String {
    format!("TLS configuration: {e}")
}

fn own(id: &Identity) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
    (vec![id.cert.clone()], PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(id.key.clone())))
}

/// The client side of a connection to a peer whose certificate must have fingerprint `expect`.
pub fn client_config(id: &Identity, expect: [u8; 32]) -> Result<Arc<ClientConfig>, String> {
    let (certs, key) = own(id);
    let cfg = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Pinned { want: Want::One(expect), provider: provider() }))
        .with_client_auth_cert(certs, key)
        .map_err(tls_err)?;
    Ok(Arc::new(cfg))
}

/// The accepting side: a client must present a certificate of a peer in the table.
pub fn server_config(id: &Identity) -> Result<Arc<ServerConfig>, String> {
    let (certs, key) = own(id);
    let cfg = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .with_client_cert_verifier(Arc::new(Pinned { want: Want::Table, provider: provider() }))
        .with_single_cert(certs, key)
        .map_err(tls_err)?;
    Ok(Arc::new(cfg))
}

/// The name used to connect (never checked: see [`TLS_NAME`]).
pub fn server_name() -> ServerName<'static> {
    ServerName::try_from(TLS_NAME).expect("a DNS name")
}

#[derive(Debug)]
enum Want {
    /// Exactly this certificate (the client's check of the server).
    One([u8; 32]),
    /// Any peer in the table (the server's check of a client).
    Table,
}

/// Certificates pinned by fingerprint; the handshake's signatures are checked as rustls does.
#[derive(Debug)]
struct Pinned {
    want: Want,
    provider: Arc<CryptoProvider>,
}

impl Pinned {
    fn check(&self, cert: &CertificateDer<'_>, intermediates: &[CertificateDer<'_>]) -> Result<(), TlsError> {
        let fp = fingerprint_of(cert);
        let ok = intermediates.is_empty()
            && match self.want {
                Want::One(want) => fp == want,
                Want::Table => by_fingerprint(&fp).is_some(),
            };
        if ok {
            Ok(())
        } else {
            Err(TlsError::InvalidCertificate(rustls::CertificateError::ApplicationVerificationFailure))
        }
    }
}

/// The handshake's signatures, checked as rustls's own verifiers do (the same methods in both verifier traits).
macro_rules! signatures {
    () => {
        fn verify_tls12_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, TlsError> {
            verify_tls12_signature(m, c, d, &self.provider.signature_verification_algorithms)
        }

        fn verify_tls13_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, TlsError> {
            verify_tls13_signature(m, c, d, &self.provider.signature_verification_algorithms)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.provider.signature_verification_algorithms.supported_schemes()
        }
    };
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, TlsError> {
        self.check(end_entity, intermediates).map(|()| ServerCertVerified::assertion())
    }

    signatures!();
}

impl ClientCertVerifier for Pinned {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, TlsError> {
        self.check(end_entity, intermediates).map(|()| ClientCertVerified::assertion())
    }

    signatures!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_are_read_in_their_usual_spellings() {
        let fp = fingerprint_of(b"x");
        let hex = fingerprint_hex(&fp);
        assert_eq!(hex.len(), 64);
        assert_eq!(parse_fingerprint(&hex), Ok(fp));
        assert_eq!(parse_fingerprint(&format!("sha256:{}", hex.to_uppercase())), Ok(fp));
        let colons: Vec<String> = fp.iter().map(|b| format!("{b:02X}")).collect();
        assert_eq!(parse_fingerprint(&colons.join(":")), Ok(fp));
        assert!(parse_fingerprint("abc").is_err());
        assert!(parse_fingerprint(&"g".repeat(64)).is_err());
    }
}
