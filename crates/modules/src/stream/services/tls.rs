//! `tls`: the app speaks plaintext, the network TLS — stunnel's two cases, done on the flow's stream with rustls
//! (ring as the crypto provider).
//!
//! - `mode = "client"` (default): the app is the client; its flows reach a TLS server.
//! - `mode = "server"`: the app is a server in the sandbox (server-role flows); clients on the network reach it over
//!   TLS with the certificate chain of `cert` and the key of `key` (PEM files, read when configured). The flow's
//!   bytes from the network (Up) are decrypted for the app, the app's (Down) encrypted; the client sends the first
//!   handshake bytes. Everything below holds for both, with "the server" read as "the network's end".
//!
//! - On a chosen flow's `Open` it starts a TLS client connection to the flow's destination, checked against the CA
//!   certificates of `ca` (a PEM file, read when the module is configured) and the name `server_name` (default: the
//!   destination's IP address, which the server's certificate must then name). The app's bytes going down are
//!   encrypted; the server's bytes coming up are decrypted.
//! - Acks: the lengths change, so it keeps an `AckMap` per direction (docs/streams.md). Plaintext the app sends
//!   during the handshake waits inside rustls and is mapped to the records that carry it once they leave.
//! - Failures: a handshake or record that fails (bad certificate, garbage, an alert from the server) is counted in
//!   `failures_total` and logged with the flow and the error (which names the alert). The network's end gets the
//!   alert rustls chose, then the close (`Fin` down: `originate` sends the alert, then FIN, so the peer reads the
//!   alert first), and the app's end an `Abort` (reason `tls`); the flow stays, failed, until the network's end
//!   closes too (what it sends meanwhile is acked and dropped). Without an alert to send (rustls has none, or the
//!   app's `Fin` went already) the flow is aborted both ways.
//! - A `Fin` going down sends `close_notify` first; the server's `close_notify` is answered with ours and ends the
//!   direction for the app (`Fin` up; the transport's own `Fin` after it is not passed again).
//! - `tls_side = "up"` mirrors the directions (default `"down"`: the TLS bytes travel on the network's side): for
//!   the far end of a flow carried from a flexstack peer (docs/services.md, "Services between two peers"), where
//!   the TLS bytes come down from the carrier and go back up to it, and the plaintext is on the network's side.
//!   Everything above holds with "down" and "up" swapped.
//! - `active` cannot be false: a running flow cannot leave TLS without the peer's agreement (the knob exists, so
//!   that `service list` shows it and a write says why it is refused).

use super::active::{self, refuse_inactive, TLS_REFUSAL};
use super::flows::{
    ack, read_select, slot, translate_ack, Flows, HandedFlows, Seen, SelectRule, SelectionMeters, SELECT, SELECT_DOC,
};
use crate::stream::{BOTH_WAYS_IN, BOTH_WAYS_OUT};
use flexstack_core::module::handed_over;
use flexstack_core::stream::{AckMap, FlowInfo, StreamFrame};
use flexstack_core::{
    kind_from_decl, Batch, ConfigError, Direction, Frame, KindDecl, Meter, MeterDecl, Module, ModuleBuilder,
    ModuleInterface, ModuleKind, ModuleVars, Output, Param, Settings, Value,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, Connection, RootCertStore, ServerConfig, ServerConnection};
use std::io::{Read, Write};
use std::sync::Arc;

/// The kind's name in stack files.
pub const KIND: &str = "tls";

/// The `tls` module kind.
pub struct TlsKind;

/// Its knob: `active`, always true.
struct Knobs {
    active: bool,
}

const DECL: KindDecl<Knobs, Meters> = KindDecl {
    inputs: BOTH_WAYS_IN,
    outputs: BOTH_WAYS_OUT,
    params: &[
        Param::manual(
            "mode",
            "str",
            "client: the app's flows reach a TLS server; server: network clients reach the app (a server) over TLS",
            "\"client\"",
        ),
        Param::manual(
            "ca",
            "str",
            "client mode: PEM file of the CA certificates the server's certificate must chain to",
            "required in client mode",
        ),
        Param::manual(
            "cert",
            "str",
            "server mode: PEM file of the certificate chain offered to clients (the server's first)",
            "required in server mode",
        ),
        Param::manual(
            "key",
            "str",
            "server mode: PEM file of the certificate's private key",
            "required in server mode",
        ),
        Param::manual(
            "server_name",
            "str",
            "client mode: the name the server's certificate must carry (default: its IP address)",
            "the destination's address",
        ),
        Param::manual(
            "tls_side",
            "str",
            "down: the TLS bytes travel on the network's side; up: on the app's side (the far end of a flow carried \
             from a peer, docs/services.md)",
            "\"down\"",
        ),
        active::param(flexstack_core::field!(active)),
        Param::manual(SELECT, "array of strings", SELECT_DOC, "[\"use *\"]"),
    ],
    meters: &[
        MeterDecl::u64("handshakes_total", "flows", "handshakes completed", |m| &mut m.handshakes),
        MeterDecl::u64("failures_total", "flows", "flows aborted: a failed handshake or a bad record", |m| {
            &mut m.failures
        }),
        MeterDecl::u64("plain_bytes_total", "bytes", "plaintext bytes, both directions", |m| &mut m.plain),
        MeterDecl::u64("tls_bytes_total", "bytes", "TLS bytes, both directions", |m| &mut m.tls),
    ],
    more_meters: SelectionMeters::specs,
    breaks_cycles: true,
    ..KindDecl::new(
        KIND,
        "a stream service: TLS (rustls) for a plaintext app: as a client to TLS servers, or as a server to TLS clients",
    )
};

/// The meters.
#[derive(Default)]
struct Meters {
    handshakes: Meter,
    failures: Meter,
    plain: Meter,
    tls: Meter,
}

impl ModuleKind for TlsKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(KIND);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mode = r.string("mode")?.unwrap_or_else(|| "client".into());
        let config = match mode.as_str() {
            "client" => {
                let ca = r.string("ca")?.ok_or_else(|| r.error("ca", "is required: a PEM file of CA certificates"))?;
                let name = match r.string("server_name")? {
                    Some(n) => Some(
                        ServerName::try_from(n.clone()).map_err(|e| r.error("server_name", format!("{n:?}: {e}")))?,
                    ),
                    None => None,
                };
                let mut roots = RootCertStore::empty();
                for cert in read_certs(&mut r, "ca", &ca)? {
                    roots.add(cert).map_err(|e| r.error("ca", format!("{ca:?}: {e}")))?;
                }
                let config = ClientConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()
                    .map_err(|e| ConfigError::new(None, format!("tls: {e}")))?
                    .with_root_certificates(roots)
                    .with_no_client_auth();
                Config::Client(Arc::new(config), name)
            }
            "server" => {
                let cert =
                    r.string("cert")?.ok_or_else(|| r.error("cert", "is required in server mode: a PEM file"))?;
                let key = r.string("key")?.ok_or_else(|| r.error("key", "is required in server mode: a PEM file"))?;
                let chain = read_certs(&mut r, "cert", &cert)?;
                let private = PrivateKeyDer::from_pem_file(&key)
                    .map_err(|e| r.error("key", format!("cannot read a private key from {key:?}: {e}")))?;
                let config = ServerConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()
                    .map_err(|e| ConfigError::new(None, format!("tls: {e}")))?
                    .with_no_client_auth()
                    .with_single_cert(chain, private)
                    .map_err(|e| r.error("key", format!("{cert:?} and {key:?}: {e}")))?;
                Config::Server(Arc::new(config))
            }
            other => return Err(r.error("mode", format!("expected client or server, got {other:?}"))),
        };
        let mirrored = match r.string("tls_side")?.as_deref() {
            None | Some("down") => false,
            Some("up") => true,
            Some(other) => return Err(r.error("tls_side", format!("expected down or up, got {other:?}"))),
        };
        let mut knobs = Knobs { active: true };
        DECL.read(&mut r, &mut knobs)?;
        if !knobs.active {
            return Err(r.error(active::ACTIVE, TLS_REFUSAL));
        }
        let select = read_select(&mut r)?;
        r.finish()?;
        Ok(Box::new(TlsBuilder { config, select, mirrored }))
    }
}

/// The certificates of PEM file `path` (setting `key`); none is an error.
fn read_certs(
    r: &mut flexstack_core::config::SettingsReader<'_>,
    key: &str,
    path: &str,
) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let certs = CertificateDer::pem_file_iter(path).map_err(|e| r.error(key, format!("cannot read {path:?}: {e}")))?;
    let certs = certs.collect::<Result<Vec<_>, _>>().map_err(|e| r.error(key, format!("{path:?}: {e}")))?;
    if certs.is_empty() {
        return Err(r.error(key, format!("{path:?} holds no certificate")));
    }
    Ok(certs)
}

/// The side it plays: a client (with the name to check, default the destination's address) or a server.
#[derive(Clone)]
enum Config {
    Client(Arc<ClientConfig>, Option<ServerName<'static>>),
    Server(Arc<ServerConfig>),
}

struct TlsBuilder {
    config: Config,
    select: Vec<SelectRule>,
    mirrored: bool,
}

impl ModuleBuilder for TlsBuilder {
    fn interface(&self) -> ModuleInterface {
        DECL.interface(&Knobs { active: true })
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        DECL.publish(&Knobs { active: true }, vars);
        Box::new(Tls {
            config: self.config,
            m: DECL.meters(vars),
            flows: Flows::new(self.select, vars),
            buf: vec![0; 16 * 1024],
            mirrored: self.mirrored,
        })
    }
}

/// One flow: its TLS connection (`None` when it could not start), its ack maps, and plaintext not yet in records.
struct Flow {
    conn: Option<Connection>,
    acks: [AckMap; 2],
    pending_plain: u64,
    handshaken: bool,
    /// The server's close_notify came: its direction ended (our `Fin` up went, the transport's is not passed).
    server_closed: bool,
    /// A `Fin` went down (the app's, or ours after a failure).
    fin_down: bool,
    /// The flow failed: the alert and `Fin` went down, `Abort` up; the network's end is waited for.
    failed: bool,
}

/// A running `tls`.
pub struct Tls {
    config: Config,
    m: Meters,
    flows: Flows<Flow>,
    buf: Vec<u8>,
    /// `tls_side = "up"`: the TLS bytes travel up, the plaintext down.
    mirrored: bool,
}

impl Tls {
    /// The directions of the TLS bytes going out to the TLS peer ("down") and of those coming from it ("up"), as
    /// `tls_side` sets them.
    fn sides(&self) -> (Direction, Direction) {
        if self.mirrored {
            (Direction::Up, Direction::Down)
        } else {
            (Direction::Down, Direction::Up)
        }
    }

    fn new_flow(config: &Config, info: &FlowInfo) -> Flow {
        let mut conn = match config {
            Config::Client(config, name) => {
                let name = name.clone().unwrap_or_else(|| ServerName::IpAddress(info.dst.ip().into()));
                ClientConnection::new(config.clone(), name).ok().map(Connection::Client)
            }
            Config::Server(config) => ServerConnection::new(config.clone()).ok().map(Connection::Server),
        };
        if let Some(c) = &mut conn {
            c.set_buffer_limit(None); // bounded by the producer's budget: plaintext is acked only once sent
        }
        Flow {
            conn,
            acks: Default::default(),
            pending_plain: 0,
            handshaken: false,
            server_closed: false,
            fin_down: false,
            failed: false,
        }
    }

    /// Sends what rustls has for the server (down), mapping it for the acks; returns the bytes sent.
    fn flush(&mut self, flow: u64, out: &mut Output<'_>) -> u64 {
        let (down, up) = self.sides();
        let Some(st) = self.flows.get_mut(flow) else { return 0 };
        let Some(conn) = &mut st.conn else { return 0 };
        let mut sent = 0;
        while conn.wants_write() {
            let frame = StreamFrame::data_with(out.pool(), flow, down, |b| {
                b.clear();
                let _ = conn.write_tls(b);
            });
            if frame.is_empty() {
                break;
            }
            let n = frame.len() as u64;
            sent += n;
            self.m.tls.add(n);
            out.emit(0, frame);
            let input = if conn.is_handshaking() { 0 } else { std::mem::take(&mut st.pending_plain) };
            let free = st.acks[slot(down)].produced(input, n);
            ack(out, flow, up, free);
        }
        if !st.handshaken && !conn.is_handshaking() {
            st.handshaken = true;
            self.m.handshakes.add(1);
        }
        sent
    }

    /// Ends a flow that failed: the alert (if rustls has one) to the network's end, then the close; `Abort` to the
    /// app's end (or both ways without an alert).
    fn fail(&mut self, flow: u64, why: &str, out: &mut Output<'_>) {
        tracing::warn!(flow, error = why, "tls: the flow failed");
        self.m.failures.add(1);
        let (down, up) = self.sides();
        let alerted = self.flush(flow, out) > 0;
        let Some(st) = self.flows.get_mut(flow) else { return };
        if !alerted || st.fin_down {
            self.flows.close(flow, KIND, out);
            return;
        }
        (st.failed, st.fin_down, st.conn) = (true, true, None);
        out.emit(0, StreamFrame::fin(out.pool(), flow, down));
        out.emit(0, StreamFrame::abort(out.pool(), flow, up, KIND));
        self.flows.fin(flow, down);
    }

    /// A frame of a failed flow: the network's data is acked and dropped, its `Fin` ends the flow; the rest (the
    /// app's frames still on their way, acks) is dropped.
    fn after_failure(&mut self, flow: u64, p: &flexstack_core::Packet, out: &mut Output<'_>) {
        let (down, up) = self.sides();
        if p.direction() != up {
            return;
        }
        match p.stream_kind() {
            Some(flexstack_core::StreamKind::Data) => ack(out, flow, down, p.len() as u64),
            Some(flexstack_core::StreamKind::Fin) => {
                self.flows.fin(flow, up);
            }
            _ => {}
        }
    }

    /// Takes TLS bytes from the server: emits the plaintext up, answers the handshake down.
    fn server_bytes(&mut self, flow: u64, mut bytes: &[u8], out: &mut Output<'_>) -> Result<(), String> {
        let total = bytes.len() as u64;
        self.m.tls.add(total);
        let (down, up) = self.sides();
        let mut plain = 0u64;
        let mut closed = false;
        let st = self.flows.get_mut(flow).expect("a flow it works on");
        let conn = st.conn.as_mut().ok_or("no TLS connection")?;
        while !bytes.is_empty() {
            if conn.read_tls(&mut bytes).map_err(|e| e.to_string())? == 0 {
                break; // after the server's close_notify: nothing more is read (what follows is not TLS of this flow)
            }
            conn.process_new_packets().map_err(|e| e.to_string())?;
            loop {
                match conn.reader().read(&mut self.buf) {
                    Ok(0) => {
                        // The server's close_notify: answer it (as OpenSSL does; a server may wait for it before
                        // closing) and end the direction for the app.
                        if !st.server_closed {
                            st.server_closed = true;
                            conn.send_close_notify();
                            closed = true;
                        }
                        break;
                    }
                    Ok(n) => {
                        plain += n as u64;
                        out.emit(0, StreamFrame::data(out.pool(), flow, up, &self.buf[..n]));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(e.to_string()),
                }
            }
        }
        self.m.plain.add(plain);
        let free = st.acks[slot(up)].produced(total, plain);
        ack(out, flow, down, free);
        self.flush(flow, out);
        if closed {
            out.emit(0, StreamFrame::fin(out.pool(), flow, up));
            self.flows.fin(flow, up);
        }
        Ok(())
    }
}

impl Module for Tls {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        for frame in input.drain(..) {
            let Frame::Data(p) = frame else {
                out.emit(0, frame);
                continue;
            };
            let d = p.direction();
            let (down, up) = self.sides();
            let config = &self.config;
            let (seen, gone) = self.flows.see(&p, |info| Tls::new_flow(config, info));
            match seen {
                Seen::Data(flow) | Seen::Ack(flow, _) | Seen::Fin(flow)
                    if self.flows.get_mut(flow).is_some_and(|st| st.failed) =>
                {
                    self.after_failure(flow, &p, out); // `p` is consumed
                }
                // The network's end of a failed flow reset it: the app's end was aborted already.
                Seen::Aborted(_) if gone.is_some_and(|st| st.failed) => {}
                Seen::Opened(flow, _) => {
                    out.emit(0, p);
                    if self.flows.get_mut(flow).is_some_and(|st| st.conn.is_none()) {
                        self.fail(flow, "cannot start a TLS connection", out);
                    } else {
                        self.flush(flow, out); // a client's ClientHello (a server waits for one)
                    }
                }
                Seen::Data(flow) if d == down => {
                    let st = self.flows.get_mut(flow).expect("a flow it works on");
                    self.m.plain.add(p.len() as u64);
                    st.pending_plain += p.len() as u64;
                    let written = st.conn.as_mut().map(|c| c.writer().write_all(p.data()));
                    match written {
                        Some(Ok(())) => {
                            self.flush(flow, out);
                        }
                        Some(Err(e)) => self.fail(flow, &e.to_string(), out),
                        None => self.fail(flow, "no TLS connection", out),
                    }
                }
                Seen::Data(flow) => {
                    if let Err(e) = self.server_bytes(flow, p.data(), out) {
                        self.fail(flow, &e, out);
                    }
                }
                Seen::Ack(flow, n) => {
                    let st = self.flows.get_mut(flow).expect("a flow it works on");
                    translate_ack(&mut st.acks, flow, d, n, out);
                }
                Seen::Fin(flow) if d == up && self.flows.get_mut(flow).is_some_and(|st| st.server_closed) => {
                    // Its end went up with the close_notify; `p` is consumed.
                }
                Seen::Fin(flow) => {
                    if d == down {
                        if let Some(st) = self.flows.get_mut(flow) {
                            st.fin_down = true;
                            if let Some(c) = st.conn.as_mut() {
                                c.send_close_notify();
                            }
                        }
                        self.flush(flow, out);
                    }
                    self.flows.fin(flow, d);
                    out.emit(0, p);
                }
                _ => out.emit(0, p),
            }
        }
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        refuse_inactive(knob, value, TLS_REFUSAL)?;
        DECL.write(&mut Knobs { active: true }, knob, value)
    }

    fn take_state(&mut self) -> Option<Box<dyn std::any::Any>> {
        Some(Box::new(self.flows.take()))
    }

    fn adopt_state(&mut self, state: Box<dyn std::any::Any>) -> Result<(), String> {
        self.flows.adopt(handed_over::<HandedFlows<Flow>>(state, "a tls's flows")?);
        Ok(())
    }
}
