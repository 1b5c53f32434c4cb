//! Stream frames: a transport flow as ordered bytes between the endpoint that terminates it and the one that
//! originates it again (docs/streams.md has the whole contract).
//!
//! A stream frame is an ordinary pooled [`Packet`] (no allocation per chunk once the pool is warm) whose metadata
//! carries the flow's id under [`MetaKey::FLOW_ID`] and the event under [`MetaKey::STREAM`]; its [`Direction`] says
//! which way it travels: [`Direction::Down`] from the application towards the network, [`Direction::Up`] back. The
//! events ([`StreamKind`]):
//!
//! | kind | bytes | means |
//! |---|---|---|
//! | `Open` | a [`FlowInfo`], encoded | A new flow, with its original 5-tuple, app and role: Down for the client role, Up for the server role (docs/streams.md). Back the other way (TCP): the far side accepted it |
//! | `Data` | the next chunk of the byte stream (TCP), or exactly one datagram (UDP) | in order, never lost |
//! | `Fin` | none | this direction is done (TCP half-close); UDP: the flow ended |
//! | `Abort` | a reason (`reset`, `refused`, `unreachable`, `timeout` ...) | both directions end; the other side resets |
//! | `Ack` | none: the count is in the metadata | credit: `n` bytes of `Data` travelling the other way were consumed |
//!
//! Build frames with [`StreamFrame`] and read them with [`Packet::stream`]; a producer keeps a [`Credit`] per flow and
//! direction, and a module that changes the length of the bytes keeps an [`AckMap`] to translate acks.
//!
//! # A worked example: a stream module
//!
//! `crlf` turns every `\n` of the data travelling down into `\r\n`, so its output is longer than its input. It
//! forwards every other event unchanged, in order, and translates the acks that come back up from output bytes to
//! input bytes with an [`AckMap`] per flow, so the producer upstream gets its credit back exactly when the bytes it
//! sent have left the chain. It never drops a frame: a frame of a flow it does not know is passed on as it is.
//!
//! ```
//! use flexstack_core::module::port_type;
//! use flexstack_core::stream::{AckMap, FlowInfo, Protocol, Role, StreamEvent, StreamFrame};
//! use flexstack_core::testing::{take, Recorder};
//! use flexstack_core::*;
//! use std::collections::HashMap;
//!
//! const CRLF: KindDecl<(), ()> = KindDecl {
//!     inputs: &[PortDecl::new("in", port_type::STREAM, "stream frames, both directions")],
//!     outputs: &[PortDecl::new("out", port_type::STREAM, "the same, with `\\n` as `\\r\\n` going down")],
//!     ..KindDecl::new("crlf", "writes line ends as CR LF in the data travelling down")
//! };
//!
//! #[derive(Default)]
//! struct Crlf {
//!     /// Per flow: down input bytes <-> down output bytes, for the acks coming back up.
//!     flows: HashMap<u64, AckMap>,
//! }
//!
//! impl Module for Crlf {
//!     fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
//!         for frame in input.drain(..) {
//!             let Frame::Data(p) = frame else { out.drop_frame(frame); continue }; // no control frames here
//!             let (Some(flow), Some(event)) = (p.stream_flow(), p.stream()) else {
//!                 out.emit(0, p); // not a stream frame: not ours to judge, pass it on
//!                 continue;
//!             };
//!             let down = p.direction() == Direction::Down;
//!             match event {
//!                 StreamEvent::Open(_) if down => {
//!                     self.flows.insert(flow, AckMap::default());
//!                     out.emit(0, p);
//!                 }
//!                 StreamEvent::Data(bytes) if down && self.flows.contains_key(&flow) => {
//!                     let mut text = Vec::with_capacity(bytes.len() * 2);
//!                     for &b in bytes {
//!                         if b == b'\n' {
//!                             text.push(b'\r');
//!                         }
//!                         text.push(b);
//!                     }
//!                     let map = self.flows.get_mut(&flow).unwrap();
//!                     // What this output stands for; bytes that produced no output may be acked at once.
//!                     let now_free = map.produced(bytes.len() as u64, text.len() as u64);
//!                     out.emit(0, StreamFrame::data(out.pool(), flow, Direction::Down, &text));
//!                     if now_free > 0 {
//!                         out.emit(0, StreamFrame::ack(out.pool(), flow, Direction::Up, now_free));
//!                     }
//!                 }
//!                 StreamEvent::Ack(n) if !down => match self.flows.get_mut(&flow) {
//!                     // An ack of our output bytes becomes an ack of the input bytes they came from.
//!                     Some(map) => {
//!                         let input = map.acked(n);
//!                         if input > 0 {
//!                             out.emit(0, StreamFrame::ack(out.pool(), flow, Direction::Up, input));
//!                         }
//!                     }
//!                     None => out.emit(0, p),
//!                 },
//!                 StreamEvent::Abort(_) => {
//!                     self.flows.remove(&flow); // both directions end: forget the flow, pass the abort on
//!                     out.emit(0, p);
//!                 }
//!                 // Fin, Up data, Up opens and everything of unknown flows pass unchanged. (A real module also
//!                 // forgets a flow once both directions saw Fin.)
//!                 _ => out.emit(0, p),
//!             }
//!         }
//!     }
//! }
//!
//! struct CrlfKind;
//! impl ModuleKind for CrlfKind {
//!     kind_from_decl!(CRLF);
//!     fn configure(&self, s: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
//!         CRLF.configure(s, (), |(), (), _| Box::new(Crlf::default()))
//!     }
//! }
//!
//! // Two lines down, then the acks of the consumer at the end come back up through the module.
//! let mut catalog = Catalog::new();
//! catalog.register(Box::new(CrlfKind));
//! let mut sw = Switch::default();
//! let builder = catalog.configure("crlf", &Settings::default(), None).unwrap();
//! let (rec, log) = Recorder::load("end");
//! sw.apply(vec![
//!     Edit::Load { name: "m".into(), kind: "crlf".into(), settings: Settings::default(), builder },
//!     rec,
//!     Edit::Link(LinkSpec::parse("m -> end").unwrap()),
//! ]).unwrap();
//! let info = FlowInfo::tcp("10.0.0.2:40000".parse().unwrap(), "192.0.2.1:80".parse().unwrap(), "curl", Role::Client);
//! let pool = sw.pool().clone();
//! let mut batch: Batch = vec![
//!     StreamFrame::open(&pool, 7, Direction::Down, &info).into(),
//!     StreamFrame::data(&pool, 7, Direction::Down, b"a\nb\n").into(), // 4 bytes in, 6 out
//!     StreamFrame::ack(&pool, 7, Direction::Up, 3).into(),            // "a\r\n" consumed: not all of the chunk
//!     StreamFrame::ack(&pool, 7, Direction::Up, 3).into(),            // "b\r\n": the whole chunk
//! ];
//! sw.inject("m", "in", &mut batch).unwrap();
//! sw.run(Time::from_millis(1));
//! let seen = take(&log);
//! assert_eq!(seen.len(), 3, "open, data, one ack");
//! assert_eq!(seen[1].data, b"a\r\nb\r\n");
//! assert_eq!(seen[2].meta.get(MetaKey::STREAM).map(|v| v & 0xff), Some(5)); // Ack
//! assert_eq!(seen[2].meta.get(MetaKey::STREAM).map(|v| v >> 8), Some(4), "the 4 input bytes, acked once");
//! ```

use crate::frame::{Direction, Frame, MetaKey, Packet, PacketPool};
use std::collections::VecDeque;
use std::fmt;
use std::net::{IpAddr, SocketAddr};

/// The event a stream frame carries (the low 8 bits of its [`MetaKey::STREAM`] value).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum StreamKind {
    /// A new flow (Down), or the far side's acceptance of it (Up, TCP); bytes: an encoded [`FlowInfo`].
    Open = 1,
    /// The next chunk of the byte stream, or one datagram.
    Data = 2,
    /// This direction is done (half-close).
    Fin = 3,
    /// Both directions end; bytes: the reason.
    Abort = 4,
    /// Credit: bytes of the other direction's data consumed (in the metadata, bits 8-63).
    Ack = 5,
}

impl StreamKind {
    /// The kind for its number.
    pub fn from_u8(n: u8) -> Option<StreamKind> {
        Some(match n {
            1 => StreamKind::Open,
            2 => StreamKind::Data,
            3 => StreamKind::Fin,
            4 => StreamKind::Abort,
            5 => StreamKind::Ack,
            _ => return None,
        })
    }

    /// The kind's name, as meters and logs write it.
    pub fn name(self) -> &'static str {
        match self {
            StreamKind::Open => "open",
            StreamKind::Data => "data",
            StreamKind::Fin => "fin",
            StreamKind::Abort => "abort",
            StreamKind::Ack => "ack",
        }
    }
}

/// The transport of a flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// A TCP connection: data is a byte stream.
    Tcp,
    /// UDP: data frames are datagrams.
    Udp,
}

impl Protocol {
    /// The IP protocol number.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
        }
    }

    /// `tcp` or `udp`.
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}

/// Which end of the flow the application is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The app opened the flow (it sent the SYN, or the first datagram).
    Client,
    /// The app accepted it.
    Server,
}

/// What an `Open` frame says about a flow: its transport, the original 5-tuple as the application sent it, the
/// application's name and its role.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FlowInfo {
    /// TCP or UDP.
    pub protocol: Protocol,
    /// The app's side for a client (its address and port), the peer's for a server.
    pub src: SocketAddr,
    /// The original destination (for a client: where the app wanted to go; for a server: the app's address and port).
    pub dst: SocketAddr,
    /// The application's name (at most [`FlowInfo::MAX_APP`] bytes; longer names are cut when encoded).
    pub app: String,
    /// Client or server.
    pub role: Role,
}

/// Why bytes are not an encoded [`FlowInfo`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowInfoError(pub &'static str);

impl fmt::Display for FlowInfoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "bad flow info: {}", self.0)
    }
}

impl std::error::Error for FlowInfoError {}

impl FlowInfo {
    /// Longest app name encoded, in bytes.
    pub const MAX_APP: usize = 255;
    /// The encoding's version (its first byte).
    pub const VERSION: u8 = 1;

    /// A TCP flow.
    pub fn tcp(src: SocketAddr, dst: SocketAddr, app: &str, role: Role) -> FlowInfo {
        FlowInfo { protocol: Protocol::Tcp, src, dst, app: app.into(), role }
    }

    /// A UDP flow.
    pub fn udp(src: SocketAddr, dst: SocketAddr, app: &str, role: Role) -> FlowInfo {
        FlowInfo { protocol: Protocol::Udp, src, dst, app: app.into(), role }
    }

    /// Appends the encoding: version, protocol number, role (0 client, 1 server), address family (4 or 6), source
    /// address and port, destination address and port (ports big-endian), app name length (one byte) and the name.
    /// A name longer than [`FlowInfo::MAX_APP`] bytes is cut at a character boundary.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let family = if self.src.is_ipv4() && self.dst.is_ipv4() { 4 } else { 6 };
        out.extend_from_slice(&[Self::VERSION, self.protocol.number(), u8::from(self.role == Role::Server), family]);
        for a in [self.src, self.dst] {
            match (family, a.ip()) {
                (4, IpAddr::V4(v4)) => out.extend_from_slice(&v4.octets()),
                (_, IpAddr::V4(v4)) => out.extend_from_slice(&v4.to_ipv6_mapped().octets()),
                (_, IpAddr::V6(v6)) => out.extend_from_slice(&v6.octets()),
            }
            out.extend_from_slice(&a.port().to_be_bytes());
        }
        let mut end = self.app.len().min(Self::MAX_APP);
        while !self.app.is_char_boundary(end) {
            end -= 1;
        }
        out.push(end as u8);
        out.extend_from_slice(&self.app.as_bytes()[..end]);
    }

    /// Reads an encoding made by [`FlowInfo::encode`] (trailing bytes are an error).
    pub fn decode(b: &[u8]) -> Result<FlowInfo, FlowInfoError> {
        let header = b.get(..4).ok_or(FlowInfoError("truncated header"))?;
        if header[0] != Self::VERSION {
            return Err(FlowInfoError("unknown version"));
        }
        let protocol = match header[1] {
            6 => Protocol::Tcp,
            17 => Protocol::Udp,
            _ => return Err(FlowInfoError("unknown protocol")),
        };
        let role = match header[2] {
            0 => Role::Client,
            1 => Role::Server,
            _ => return Err(FlowInfoError("unknown role")),
        };
        let alen = match header[3] {
            4 => 4,
            6 => 16,
            _ => return Err(FlowInfoError("unknown address family")),
        };
        let mut at = 4;
        let mut endpoint = |b: &[u8]| -> Result<SocketAddr, FlowInfoError> {
            let raw = b.get(at..at + alen + 2).ok_or(FlowInfoError("truncated address"))?;
            at += alen + 2;
            let ip = match alen {
                4 => IpAddr::from(<[u8; 4]>::try_from(&raw[..4]).expect("4 bytes")),
                _ => IpAddr::from(<[u8; 16]>::try_from(&raw[..16]).expect("16 bytes")),
            };
            Ok(SocketAddr::new(ip, u16::from_be_bytes([raw[alen], raw[alen + 1]])))
        };
        let src = endpoint(b)?;
        let dst = endpoint(b)?;
        let n = usize::from(*b.get(at).ok_or(FlowInfoError("truncated app name"))?);
        let name = b.get(at + 1..at + 1 + n).ok_or(FlowInfoError("truncated app name"))?;
        if b.len() != at + 1 + n {
            return Err(FlowInfoError("trailing bytes"));
        }
        let app = std::str::from_utf8(name).map_err(|_| FlowInfoError("app name is not UTF-8"))?.to_string();
        Ok(FlowInfo { protocol, src, dst, app, role })
    }
}

impl fmt::Display for FlowInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let role = match self.role {
            Role::Client => "client",
            Role::Server => "server",
        };
        write!(f, "{} {} -> {} app {:?} {role}", self.protocol.name(), self.src, self.dst, self.app)
    }
}

/// A stream frame, read: what [`Packet::stream`] returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamEvent<'a> {
    /// A new flow (Down) or its acceptance (Up).
    Open(FlowInfo),
    /// Bytes of the stream, or one datagram.
    Data(&'a [u8]),
    /// Half-close of this direction.
    Fin,
    /// Both directions end, for this reason.
    Abort(&'a str),
    /// Bytes of the other direction consumed.
    Ack(u64),
}

impl StreamEvent<'_> {
    /// The event's kind.
    pub fn kind(&self) -> StreamKind {
        match self {
            StreamEvent::Open(_) => StreamKind::Open,
            StreamEvent::Data(_) => StreamKind::Data,
            StreamEvent::Fin => StreamKind::Fin,
            StreamEvent::Abort(_) => StreamKind::Abort,
            StreamEvent::Ack(_) => StreamKind::Ack,
        }
    }
}

/// Constructors of stream frames: each returns a pooled packet with the flow id, the event and the direction set.
pub struct StreamFrame;

impl StreamFrame {
    /// A frame of `kind` for `flow` travelling `dir`, with `bytes` and the value `extra` in bits 8-63 of its
    /// [`MetaKey::STREAM`] value.
    fn make(pool: &PacketPool, flow: u64, dir: Direction, kind: StreamKind, extra: u64, bytes: &[u8]) -> Packet {
        let mut p = pool.alloc();
        if !bytes.is_empty() {
            p.make_mut().extend_from_slice(bytes);
        }
        p.set_direction(dir);
        let meta = p.meta_mut();
        meta.set(MetaKey::FLOW_ID, flow);
        meta.set(MetaKey::STREAM, kind as u64 | extra << 8);
        p
    }

    /// `Open` for a flow described by `info`.
    pub fn open(pool: &PacketPool, flow: u64, dir: Direction, info: &FlowInfo) -> Packet {
        let mut p = Self::make(pool, flow, dir, StreamKind::Open, 0, &[]);
        info.encode(p.make_mut());
        p
    }

    /// `Data` carrying a copy of `bytes`.
    pub fn data(pool: &PacketPool, flow: u64, dir: Direction, bytes: &[u8]) -> Packet {
        Self::make(pool, flow, dir, StreamKind::Data, 0, bytes)
    }

    /// `Data` whose bytes `fill` writes into the (empty) packet buffer: lets a producer copy straight from its
    /// socket's buffer into the pooled packet.
    pub fn data_with(pool: &PacketPool, flow: u64, dir: Direction, fill: impl FnOnce(&mut Vec<u8>)) -> Packet {
        let mut p = Self::make(pool, flow, dir, StreamKind::Data, 0, &[]);
        fill(p.make_mut());
        p
    }

    /// `Fin`: no more data travels `dir` in this flow.
    pub fn fin(pool: &PacketPool, flow: u64, dir: Direction) -> Packet {
        Self::make(pool, flow, dir, StreamKind::Fin, 0, &[])
    }

    /// `Abort` with a short reason (`reset`, `refused`, `unreachable`, `timeout` ...).
    pub fn abort(pool: &PacketPool, flow: u64, dir: Direction, reason: &str) -> Packet {
        Self::make(pool, flow, dir, StreamKind::Abort, 0, reason.as_bytes())
    }

    /// `Ack` of `bytes` bytes of data that travelled the other way. Travels `dir`: an ack of Down data travels Up.
    ///
    /// # Panics
    /// If `bytes` does not fit in 56 bits (no flow has 64 PiB in flight).
    pub fn ack(pool: &PacketPool, flow: u64, dir: Direction, bytes: u64) -> Packet {
        assert!(bytes < 1 << 56, "ack of {bytes} bytes");
        Self::make(pool, flow, dir, StreamKind::Ack, bytes, &[])
    }
}

impl Packet {
    /// The flow id of a stream frame (`None` if this is not one).
    pub fn stream_flow(&self) -> Option<u64> {
        self.meta().get(MetaKey::STREAM)?;
        self.meta().get(MetaKey::FLOW_ID)
    }

    /// The kind of a stream frame (`None` if this is not one, or the kind is unknown).
    pub fn stream_kind(&self) -> Option<StreamKind> {
        StreamKind::from_u8(self.meta().get(MetaKey::STREAM)? as u8)
    }

    /// The stream event this frame carries; `None` if it is not a stream frame (no [`MetaKey::STREAM`] or no
    /// [`MetaKey::FLOW_ID`]), its kind is unknown, or an `Open`'s bytes are not a [`FlowInfo`]. An `Abort` reason
    /// that is not UTF-8 reads as `"?"`.
    pub fn stream(&self) -> Option<StreamEvent<'_>> {
        let value = self.meta().get(MetaKey::STREAM)?;
        self.meta().get(MetaKey::FLOW_ID)?;
        Some(match StreamKind::from_u8(value as u8)? {
            StreamKind::Open => StreamEvent::Open(FlowInfo::decode(self.data()).ok()?),
            StreamKind::Data => StreamEvent::Data(self.data()),
            StreamKind::Fin => StreamEvent::Fin,
            StreamKind::Abort => StreamEvent::Abort(std::str::from_utf8(self.data()).unwrap_or("?")),
            StreamKind::Ack => StreamEvent::Ack(value >> 8),
        })
    }
}

impl Frame {
    /// The stream event of a data frame that is a stream frame (see [`Packet::stream`]).
    pub fn stream(&self) -> Option<StreamEvent<'_>> {
        self.packet()?.stream()
    }
}

/// The producer's side of a flow's budget, for one direction: bytes sent and not yet acknowledged stay below the
/// budget. The endpoint that reads a socket (the start of a direction) sends `Data` only while [`Credit::room`] is
/// not 0, and stops reading its socket otherwise, so the sender's window closes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Credit {
    /// Bytes sent, ever.
    pub sent: u64,
    /// Bytes acknowledged, ever.
    pub acked: u64,
}

impl Credit {
    /// Bytes sent and not acknowledged.
    pub fn in_flight(&self) -> u64 {
        self.sent - self.acked
    }

    /// How many more bytes may be sent with `budget` bytes allowed in flight.
    pub fn room(&self, budget: u64) -> u64 {
        budget.saturating_sub(self.in_flight())
    }

    /// Records `n` bytes sent.
    pub fn send(&mut self, n: u64) {
        self.sent += n;
    }

    /// Records an ack of `n` bytes; returns false (and acknowledges only what is in flight) when it acks more
    /// than was sent (a bug upstream, or a hostile peer module).
    pub fn ack(&mut self, n: u64) -> bool {
        let ok = n <= self.in_flight();
        self.acked += n.min(self.in_flight());
        ok
    }
}

/// For a module that changes the length of the bytes it passes (compression, encoding ...): maps acks of its output
/// bytes back to acks of its input bytes, per flow and direction.
///
/// Call [`AckMap::produced`] whenever input bytes become output bytes (emitted), and [`AckMap::acked`] with each
/// ack of output bytes that comes back; each returns the input bytes to acknowledge upstream now. Input bytes are
/// acknowledged only when every output byte made from them (and from earlier input) was acknowledged, so the
/// producer's budget still bounds what the chain holds. It keeps one mark per `produced` call not yet fully
/// acknowledged: bounded by the frames in flight.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AckMap {
    /// (output bytes so far, input bytes so far) at each `produced` call not yet acknowledged, oldest first.
    marks: VecDeque<(u64, u64)>,
    input: u64,
    output: u64,
    input_acked: u64,
    output_acked: u64,
}

impl AckMap {
    /// `input` bytes were consumed and became `output` bytes (0 if they produced nothing, e.g. were filtered out).
    /// Returns input bytes that may be acknowledged at once: those that produced nothing when all earlier output
    /// is already acknowledged.
    pub fn produced(&mut self, input: u64, output: u64) -> u64 {
        self.input += input;
        self.output += output;
        match self.marks.back_mut() {
            // Nothing new out: the input joins the previous mark (freed with it).
            Some(last) if output == 0 => last.1 = self.input,
            _ => self.marks.push_back((self.output, self.input)),
        }
        self.release()
    }

    /// `n` output bytes were acknowledged downstream. Returns the input bytes to acknowledge upstream.
    pub fn acked(&mut self, n: u64) -> u64 {
        self.output_acked = (self.output_acked + n).min(self.output);
        self.release()
    }

    fn release(&mut self) -> u64 {
        let before = self.input_acked;
        while let Some(&(out, inp)) = self.marks.front() {
            if out > self.output_acked {
                break;
            }
            self.input_acked = inp;
            self.marks.pop_front();
        }
        self.input_acked - before
    }

    /// Input bytes consumed and not yet acknowledged upstream.
    pub fn unacked_input(&self) -> u64 {
        self.input - self.input_acked
    }

    /// Output bytes emitted and not yet acknowledged.
    pub fn unacked_output(&self) -> u64 {
        self.output - self.output_acked
    }

    /// Marks kept (for tests of boundedness).
    pub fn marks(&self) -> usize {
        self.marks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::module::{port_type, PortSpec};

    fn info4() -> FlowInfo {
        FlowInfo::tcp("10.0.0.2:40000".parse().unwrap(), "192.0.2.1:443".parse().unwrap(), "curl", Role::Client)
    }

    #[test]
    fn flow_info_encodes_to_known_bytes_and_back() {
        let mut b = Vec::new();
        info4().encode(&mut b);
        #[rustfmt::skip]
        let expected = [
            1, 6, 0, 4,                          // version, tcp, client, IPv4
            10, 0, 0, 2, 0x9c, 0x40,             // 10.0.0.2:40000
            192, 0, 2, 1, 0x01, 0xbb,            // 192.0.2.1:443
            4, b'c', b'u', b'r', b'l',           // "curl"
        ];
        assert_eq!(b, expected);
        assert_eq!(FlowInfo::decode(&b), Ok(info4()));

        let v6 =
            FlowInfo::udp("[fd77::2]:5353".parse().unwrap(), "[2001:db8::53]:53".parse().unwrap(), "", Role::Server);
        let mut b = Vec::new();
        v6.encode(&mut b);
        assert_eq!(b.len(), 4 + 18 + 18 + 1);
        assert_eq!(&b[..4], &[1, 17, 1, 6]);
        assert_eq!(&b[4..6], &[0xfd, 0x77]);
        assert_eq!(&b[20..22], &5353u16.to_be_bytes());
        assert_eq!(FlowInfo::decode(&b), Ok(v6));
    }

    #[test]
    fn flow_info_rejects_what_it_did_not_write() {
        let mut b = Vec::new();
        info4().encode(&mut b);
        for n in 0..b.len() {
            assert!(FlowInfo::decode(&b[..n]).is_err(), "prefix of {n} bytes");
        }
        let mut long = b.clone();
        long.push(0);
        assert_eq!(FlowInfo::decode(&long), Err(FlowInfoError("trailing bytes")));
        for (at, bad) in [(0, 2), (1, 1), (2, 7), (3, 5)] {
            let mut x = b.clone();
            x[at] = bad;
            assert!(FlowInfo::decode(&x).is_err(), "byte {at} = {bad}");
        }
        let mut x = b.clone();
        x[17] = 0xff; // the name: not UTF-8
        assert!(FlowInfo::decode(&x).is_err());
        // A long name is cut at a character boundary.
        let mut i = info4();
        i.app = "é".repeat(200);
        let mut b = Vec::new();
        i.encode(&mut b);
        let back = FlowInfo::decode(&b).unwrap();
        assert_eq!(back.app.len(), 254);
        // Mixed families are written as IPv6 (v4-mapped).
        let mixed = FlowInfo::tcp("10.0.0.2:1".parse().unwrap(), "[2001:db8::1]:2".parse().unwrap(), "", Role::Client);
        let mut b = Vec::new();
        mixed.encode(&mut b);
        let back = FlowInfo::decode(&b).unwrap();
        assert_eq!(back.src, "[::ffff:10.0.0.2]:1".parse().unwrap());
    }

    #[test]
    fn frames_carry_flow_kind_and_direction() {
        let pool = PacketPool::new(64, 8);
        let open = StreamFrame::open(&pool, 9, Direction::Down, &info4());
        assert_eq!(open.stream_flow(), Some(9));
        assert_eq!(open.direction(), Direction::Down);
        assert_eq!(open.meta().get(MetaKey::STREAM), Some(1));
        assert_eq!(open.stream(), Some(StreamEvent::Open(info4())));

        let data = StreamFrame::data(&pool, 9, Direction::Up, b"hello");
        assert_eq!((data.stream(), data.direction()), (Some(StreamEvent::Data(b"hello")), Direction::Up));
        assert_eq!(data.stream_kind(), Some(StreamKind::Data));
        let filled = StreamFrame::data_with(&pool, 9, Direction::Down, |b| b.extend_from_slice(&[1, 2, 3]));
        assert_eq!(filled.data(), &[1, 2, 3]);

        let fin = StreamFrame::fin(&pool, 9, Direction::Down);
        assert_eq!((fin.stream(), fin.len()), (Some(StreamEvent::Fin), 0));
        let abort = StreamFrame::abort(&pool, 9, Direction::Up, "refused");
        assert_eq!(abort.stream(), Some(StreamEvent::Abort("refused")));
        assert_eq!(abort.data(), b"refused");

        let ack = StreamFrame::ack(&pool, 9, Direction::Up, 70_000);
        assert_eq!(ack.meta().get(MetaKey::STREAM), Some(5 | 70_000 << 8));
        assert_eq!(ack.stream(), Some(StreamEvent::Ack(70_000)));
        assert!(ack.is_empty());
        assert_eq!(Frame::Data(ack).stream(), Some(StreamEvent::Ack(70_000)));
    }

    #[test]
    fn frames_without_the_keys_or_with_bad_bytes_are_not_stream_frames() {
        let pool = PacketPool::new(64, 8);
        let plain = pool.alloc_from(b"\x45 an IP packet");
        assert_eq!((plain.stream(), plain.stream_flow()), (None, None));
        let mut unknown = StreamFrame::fin(&pool, 1, Direction::Down);
        unknown.meta_mut().set(MetaKey::STREAM, 77);
        assert_eq!((unknown.stream(), unknown.stream_kind()), (None, None));
        let mut no_flow = StreamFrame::fin(&pool, 1, Direction::Down);
        no_flow.meta_mut().remove(MetaKey::FLOW_ID);
        assert_eq!(no_flow.stream(), None);
        let mut bad_open = StreamFrame::open(&pool, 1, Direction::Down, &info4());
        bad_open.make_mut().truncate(5);
        assert_eq!(bad_open.stream(), None);
        assert_eq!(bad_open.stream_kind(), Some(StreamKind::Open));
        let mut bad_reason = StreamFrame::abort(&pool, 1, Direction::Down, "x");
        bad_reason.make_mut()[0] = 0xff;
        assert_eq!(bad_reason.stream(), Some(StreamEvent::Abort("?")));
    }

    #[test]
    fn stream_frames_reuse_pool_slots() {
        let pool = PacketPool::new(64, 8);
        for i in 0..100u64 {
            let p = StreamFrame::data(&pool, i, Direction::Down, b"chunk");
            drop(p);
        }
        assert_eq!(pool.stats().allocated, 1, "one slot, reused for every chunk");
    }

    #[test]
    fn the_stream_port_type_links_to_itself_and_any() {
        assert!(PortSpec::compatible(port_type::STREAM, port_type::STREAM));
        assert!(PortSpec::compatible(port_type::STREAM, port_type::ANY));
        assert!(PortSpec::compatible(port_type::ANY, port_type::STREAM));
        assert!(!PortSpec::compatible(port_type::STREAM, port_type::IP));
        assert!(!PortSpec::compatible(port_type::IP, port_type::STREAM));
    }

    #[test]
    fn credit_bounds_what_is_in_flight() {
        let mut c = Credit::default();
        assert_eq!(c.room(100), 100);
        c.send(60);
        assert_eq!((c.in_flight(), c.room(100)), (60, 40));
        c.send(40);
        assert_eq!(c.room(100), 0);
        assert!(c.ack(30));
        assert_eq!(c.room(100), 30);
        assert!(!c.ack(1000), "more than in flight");
        assert_eq!((c.in_flight(), c.acked, c.sent), (0, 100, 100));
        // A budget lowered below what is in flight gives no room until acks bring it under.
        c.send(50);
        assert_eq!(c.room(20), 0);
    }

    #[test]
    fn ack_map_acks_input_when_its_output_is_acked() {
        let mut m = AckMap::default();
        // 4 bytes in became 6 out; 10 in became 3 out (compressed).
        assert_eq!(m.produced(4, 6), 0);
        assert_eq!(m.produced(10, 3), 0);
        assert_eq!((m.unacked_input(), m.unacked_output(), m.marks()), (14, 9, 2));
        assert_eq!(m.acked(5), 0, "the first output is not wholly acked");
        assert_eq!(m.acked(1), 4, "now it is: its 4 input bytes");
        assert_eq!(m.acked(2), 0);
        assert_eq!(m.acked(1), 10);
        assert_eq!((m.unacked_input(), m.unacked_output(), m.marks()), (0, 0, 0));
        // Input that produced nothing is acked at once when nothing is outstanding...
        assert_eq!(m.produced(7, 0), 7);
        // ...and with the output before it otherwise.
        assert_eq!(m.produced(2, 2), 0);
        assert_eq!(m.produced(5, 0), 0);
        assert_eq!(m.marks(), 1, "joined the previous mark");
        assert_eq!(m.acked(2), 7);
        // Acks beyond what was emitted are capped.
        assert_eq!(m.produced(1, 1), 0);
        assert_eq!(m.acked(100), 1);
        assert_eq!(m.unacked_output(), 0);
    }

    #[test]
    fn ack_map_stays_small_on_a_long_stream() {
        let mut m = AckMap::default();
        let (mut acked_in, mut pending) = (0, std::collections::VecDeque::new());
        for i in 0..10_000u64 {
            let out = i % 7;
            acked_in += m.produced(5, out);
            pending.push_back(out);
            if pending.len() > 4 {
                acked_in += m.acked(pending.pop_front().unwrap());
            }
            assert!(m.marks() <= 5);
        }
        while let Some(n) = pending.pop_front() {
            acked_in += m.acked(n);
        }
        assert_eq!(acked_in, 50_000, "every input byte acked exactly once");
    }
}
