//! The peer protocol's messages on a carrier connection (docs/peers.md, "Framing"): length-prefixed, one parser for
//! every input a peer (or anyone reaching the port) can send, sans-IO.
//!
//! A message is a 4-byte big-endian length of what follows (1 to [`MAX_BODY`] bytes), a type byte and its body:
//!
//! | type | body |
//! |---|---|
//! | 1 `Hello` | `FSPR`, version (u16), capability count (u8), each capability as a length (u8, 1-32) and ASCII |
//! | 2 `Frame` | flow id (u64), stream kind (u8), then by kind: `Open` an encoded `FlowInfo`; `Data` 0 to [`MAX_DATA`] bytes; `Fin` nothing; `Abort` a reason (1-32 ASCII); `Ack` a count (u64, below 2^56) |
//! | 3 `Close` | a reason (0-64 ASCII) |
//! | 4 `Switch` | flow id (u64), flags (u8: bit 0 `end`, bit 1 `udp`, no others), offset (u64, below 2^56) |
//! | 5 `Resume` | session (u64), received (u64, below 2^56) |
//! | 6 `Received` | offset (u64, below 2^56) |
//!
//! `Switch` is sent only to a peer whose `Hello` offered [`SWITCH_CAP`] (docs/peers.md, "Switching").
//! `Resume` and `Received` belong to a connection, not to the session's stream: the `tcp` carrier's resumable sessions
//! (docs/peers.md, "Several uplinks"); `Frame` and `Switch` are the session's stream, numbered by their bytes.
//! Everything else (an unknown type, a length out of range, trailing bytes, a `FlowInfo` that does not decode) is
//! an error: the connection that sent it is closed.

use flexstack_core::stream::{FlowInfo, StreamKind};
use std::fmt;

/// The magic at the start of `Hello`.
pub const MAGIC: [u8; 4] = *b"FSPR";
/// The protocol version this code speaks.
pub const VERSION: u16 = 1;
/// The largest `Data` a frame carries (bigger stream chunks are split by the sender).
pub const MAX_DATA: usize = 65536;
/// The largest body of a message (type byte included).
pub const MAX_BODY: usize = MAX_DATA + 16;
/// The most capabilities a `Hello` lists.
pub const MAX_CAPS: usize = 32;
/// The capability of a peer that takes `Switch` messages (a carrier with several transports).
pub const SWITCH_CAP: &str = "switch";
/// `Switch` flag: the flow leaves this transport (else: it starts on it).
pub const SWITCH_END: u8 = 1;
/// `Switch` flag: the flow is a UDP flow (its `Data` travels as datagrams).
pub const SWITCH_UDP: u8 = 2;

const HELLO: u8 = 1;
const FRAME: u8 = 2;
const CLOSE: u8 = 3;
const SWITCH: u8 = 4;
const RESUME: u8 = 5;
const RECEIVED: u8 = 6;

/// A decoded message; `Frame` borrows its bytes from the input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message<'a> {
    /// The first message each side sends: version and capabilities (`tcp`, ...).
    Hello {
        /// The sender's protocol version.
        version: u16,
        /// What it offers (carrier kinds, later congestion controls and services).
        caps: Vec<String>,
    },
    /// One stream frame of flow `flow` (the sender's id).
    Frame {
        /// The flow id, as the side that opened the flow numbers it.
        flow: u64,
        /// The event.
        kind: StreamKind,
        /// `Ack`: the count; otherwise 0.
        ack: u64,
        /// `Open`: the encoded `FlowInfo`; `Data`: the bytes; `Abort`: the reason; else empty.
        bytes: &'a [u8],
    },
    /// The sender closes the connection (every flow on it ends).
    Close {
        /// Why.
        reason: String,
    },
    /// Flow `flow` (the id of the side that opened it) moves between transports: on the transport it leaves, the
    /// last message of the flow there (`flags` has [`SWITCH_END`]); on the one it goes to, the first.
    Switch {
        /// The flow id, as in `Frame`.
        flow: u64,
        /// [`SWITCH_END`], [`SWITCH_UDP`].
        flags: u8,
        /// The `Data` bytes of the flow the sender sent before the switch (on every transport).
        offset: u64,
    },
    /// A resumable session (the `tcp` carrier with `uplinks`): sent by the connecting side right after its `Hello`
    /// and answered by the accepting side; `received` is how many bytes of the other side's session stream (its
    /// `Frame` and `Switch` messages, since the session began) the sender took. A new session says 0.
    Resume {
        /// The session's id (the connecting side's choice).
        session: u64,
        /// Bytes of the other side's stream taken.
        received: u64,
    },
    /// Bytes of the other side's session stream taken so far: the other side may forget what it kept to resend.
    Received {
        /// Bytes taken.
        offset: u64,
    },
}

impl Message<'_> {
    /// Whether the message is part of the session's stream (`Frame`, `Switch`), counted and resent by a resumable
    /// session, rather than of the connection.
    pub fn in_stream(&self) -> bool {
        matches!(self, Message::Frame { .. } | Message::Switch { .. })
    }
}

/// Why input was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireError(pub &'static str);

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for WireError {}

fn ascii(b: &[u8], min: usize, max: usize) -> Result<String, WireError> {
    if b.len() < min || b.len() > max || !b.iter().all(|c| c.is_ascii_graphic() || *c == b' ') {
        return Err(WireError("bad text"));
    }
    Ok(String::from_utf8_lossy(b).into_owned())
}

fn u64_at(b: &[u8], at: usize) -> Result<u64, WireError> {
    let s = b.get(at..at + 8).ok_or(WireError("short"))?;
    Ok(u64::from_be_bytes(s.try_into().expect("8 bytes")))
}

/// Decodes the message at the start of `buf`: `Ok(None)` while it is incomplete, else the message and the bytes it
/// took. An error means the stream is not the peer protocol (or is damaged): the reader closes the connection.
pub fn decode(buf: &[u8]) -> Result<Option<(Message<'_>, usize)>, WireError> {
    let Some(head) = buf.get(..4) else { return Ok(None) };
    let len = u32::from_be_bytes(head.try_into().expect("4 bytes")) as usize;
    if len == 0 || len > MAX_BODY {
        return Err(WireError("length out of range"));
    }
    let Some(body) = buf.get(4..4 + len) else { return Ok(None) };
    let (ty, b) = (body[0], &body[1..]);
    let m = match ty {
        HELLO => {
            if b.get(..4) != Some(&MAGIC[..]) || b.len() < 7 {
                return Err(WireError("not a hello"));
            }
            let version = u16::from_be_bytes([b[4], b[5]]);
            let n = b[6] as usize;
            if n > MAX_CAPS {
                return Err(WireError("too many capabilities"));
            }
            let (mut caps, mut at) = (Vec::with_capacity(n), 7);
            for _ in 0..n {
                let l = *b.get(at).ok_or(WireError("short"))? as usize;
                let text = b.get(at + 1..at + 1 + l).ok_or(WireError("short"))?;
                caps.push(ascii(text, 1, 32)?);
                at += 1 + l;
            }
            if at != b.len() {
                return Err(WireError("trailing bytes"));
            }
            Message::Hello { version, caps }
        }
        FRAME => {
            let flow = u64_at(b, 0)?;
            let kind = StreamKind::from_u8(*b.get(8).ok_or(WireError("short"))?).ok_or(WireError("bad kind"))?;
            let rest = &b[9..];
            let mut ack = 0;
            match kind {
                StreamKind::Open => {
                    FlowInfo::decode(rest).map_err(|_| WireError("bad flow info"))?;
                }
                StreamKind::Data if rest.len() > MAX_DATA => return Err(WireError("data too long")),
                StreamKind::Data => {}
                StreamKind::Fin if !rest.is_empty() => return Err(WireError("trailing bytes")),
                StreamKind::Fin => {}
                StreamKind::Abort => {
                    ascii(rest, 1, 32)?;
                }
                StreamKind::Ack => {
                    if rest.len() != 8 {
                        return Err(WireError("bad ack"));
                    }
                    ack = u64_at(rest, 0)?;
                    if ack >= 1 << 56 {
                        return Err(WireError("ack out of range"));
                    }
                }
            }
            let bytes = if kind == StreamKind::Ack { &rest[..0] } else { rest };
            Message::Frame { flow, kind, ack, bytes }
        }
        CLOSE => Message::Close { reason: ascii(b, 0, 64)? },
        SWITCH => {
            if b.len() != 17 {
                return Err(WireError("bad switch"));
            }
            let flags = b[8];
            if flags & !(SWITCH_END | SWITCH_UDP) != 0 {
                return Err(WireError("bad switch flags"));
            }
            let offset = u64_at(b, 9)?;
            if offset >= 1 << 56 {
                return Err(WireError("offset out of range"));
            }
            Message::Switch { flow: u64_at(b, 0)?, flags, offset }
        }
        RESUME => {
            if b.len() != 16 {
                return Err(WireError("bad resume"));
            }
            Message::Resume { session: u64_at(b, 0)?, received: below_2_56(u64_at(b, 8)?)? }
        }
        RECEIVED => {
            if b.len() != 8 {
                return Err(WireError("bad received"));
            }
            Message::Received { offset: below_2_56(u64_at(b, 0)?)? }
        }
        _ => return Err(WireError("unknown message type")),
    };
    Ok(Some((m, 4 + len)))
}

fn below_2_56(v: u64) -> Result<u64, WireError> {
    if v >= 1 << 56 {
        return Err(WireError("offset out of range"));
    }
    Ok(v)
}

fn begin(out: &mut Vec<u8>, ty: u8) -> usize {
    let at = out.len();
    out.extend_from_slice(&[0, 0, 0, 0, ty]);
    at
}

fn finish(out: &mut [u8], at: usize) {
    let len = (out.len() - at - 4) as u32;
    out[at..at + 4].copy_from_slice(&len.to_be_bytes());
}

/// Appends a `Hello` with this code's version and `caps` (each 1-32 ASCII, at most [`MAX_CAPS`]).
pub fn hello(out: &mut Vec<u8>, caps: &[&str]) {
    let at = begin(out, HELLO);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_be_bytes());
    out.push(caps.len().min(MAX_CAPS) as u8);
    for c in caps.iter().take(MAX_CAPS) {
        out.push(c.len() as u8);
        out.extend_from_slice(c.as_bytes());
    }
    finish(out, at);
}

/// Appends one stream frame: `bytes` as the frame carries them (`Data` at most [`MAX_DATA`]: the caller splits),
/// `ack` the count of an `Ack`.
pub fn frame(out: &mut Vec<u8>, flow: u64, kind: StreamKind, ack: u64, bytes: &[u8]) {
    debug_assert!(kind != StreamKind::Data || bytes.len() <= MAX_DATA);
    let at = begin(out, FRAME);
    out.extend_from_slice(&flow.to_be_bytes());
    out.push(kind as u8);
    if kind == StreamKind::Ack {
        out.extend_from_slice(&ack.to_be_bytes());
    } else {
        out.extend_from_slice(bytes);
    }
    finish(out, at);
}

/// Appends a `Switch` of `flow` (`flags`: [`SWITCH_END`], [`SWITCH_UDP`]; `offset` below 2^56).
pub fn switch(out: &mut Vec<u8>, flow: u64, flags: u8, offset: u64) {
    let at = begin(out, SWITCH);
    out.extend_from_slice(&flow.to_be_bytes());
    out.push(flags);
    out.extend_from_slice(&offset.to_be_bytes());
    finish(out, at);
}

/// Appends a `Resume` of `session`, having taken `received` bytes of the other side's stream (below 2^56).
pub fn resume(out: &mut Vec<u8>, session: u64, received: u64) {
    let at = begin(out, RESUME);
    out.extend_from_slice(&session.to_be_bytes());
    out.extend_from_slice(&received.to_be_bytes());
    finish(out, at);
}

/// Appends a `Received` of `offset` bytes (below 2^56).
pub fn received(out: &mut Vec<u8>, offset: u64) {
    let at = begin(out, RECEIVED);
    out.extend_from_slice(&offset.to_be_bytes());
    finish(out, at);
}

/// Appends a `Close` with `reason` (cut to 64 bytes).
pub fn close(out: &mut Vec<u8>, reason: &str) {
    let at = begin(out, CLOSE);
    out.extend_from_slice(&reason.as_bytes()[..reason.len().min(64)]);
    finish(out, at);
}

/// The header of a QUIC DATAGRAM frame's payload (the `quic` carrier's UDP app datagrams): the flow id (u64, the
/// id of the side that opened the flow, as in `Frame`), then exactly one app datagram.
pub const DATAGRAM_HEAD: usize = 8;

/// Encodes a UDP app datagram of `flow` for a QUIC DATAGRAM frame.
pub fn datagram(out: &mut Vec<u8>, flow: u64, payload: &[u8]) {
    out.extend_from_slice(&flow.to_be_bytes());
    out.extend_from_slice(payload);
}

/// Decodes a QUIC DATAGRAM frame's payload: the flow id and the app datagram (0 to [`MAX_DATA`] bytes). Shorter
/// or longer input is an error (the datagram is dropped and counted, the connection stays).
pub fn decode_datagram(buf: &[u8]) -> Result<(u64, &[u8]), WireError> {
    let flow = u64_at(buf, 0)?;
    let payload = &buf[DATAGRAM_HEAD..];
    if payload.len() > MAX_DATA {
        return Err(WireError("datagram too long"));
    }
    Ok((flow, payload))
}

/// A property check for the fuzz targets: decoding any input never panics, and what decodes encodes back to it.
pub fn check_datagram(buf: &[u8]) {
    if let Ok((flow, payload)) = decode_datagram(buf) {
        let mut again = Vec::new();
        datagram(&mut again, flow, payload);
        assert_eq!(again, buf, "a datagram re-encodes to its bytes");
    }
}

/// Decodes every message in `buf` as a reader would (a property check for the fuzz targets and the malformed-input
/// test): never panics; whatever decodes encodes back to the same bytes (frames) or to an equal message.
pub fn check_roundtrip(buf: &[u8]) {
    let mut at = 0;
    while let Ok(Some((m, used))) = decode(&buf[at..]) {
        let mut again = Vec::new();
        match &m {
            Message::Hello { caps, .. } => {
                let caps: Vec<&str> = caps.iter().map(String::as_str).collect();
                hello(&mut again, &caps);
                let Ok(Some((m2, _))) = decode(&again) else { panic!("a hello re-encoded does not decode") };
                match (&m, m2) {
                    (Message::Hello { caps: a, .. }, Message::Hello { caps: b, .. }) => assert_eq!(*a, b),
                    _ => panic!("a hello became something else"),
                }
            }
            Message::Frame { flow, kind, ack, bytes } => {
                frame(&mut again, *flow, *kind, *ack, bytes);
                assert_eq!(again, &buf[at..at + used], "a frame re-encodes to its bytes");
            }
            Message::Close { reason } => {
                close(&mut again, reason);
                assert_eq!(again, &buf[at..at + used]);
            }
            Message::Switch { flow, flags, offset } => {
                switch(&mut again, *flow, *flags, *offset);
                assert_eq!(again, &buf[at..at + used], "a switch re-encodes to its bytes");
            }
            Message::Resume { session, received: r } => {
                resume(&mut again, *session, *r);
                assert_eq!(again, &buf[at..at + used], "a resume re-encodes to its bytes");
            }
            Message::Received { offset } => {
                received(&mut again, *offset);
                assert_eq!(again, &buf[at..at + used], "a received re-encodes to its bytes");
            }
        }
        at += used;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flexstack_core::stream::Role;

    fn one(buf: &[u8]) -> Result<Option<Message<'_>>, WireError> {
        decode(buf).map(|o| {
            o.map(|(m, used)| {
                assert_eq!(used, buf.len());
                m
            })
        })
    }

    #[test]
    fn every_message_round_trips() {
        let info = FlowInfo::tcp("10.0.0.2:1000".parse().unwrap(), "10.9.9.9:80".parse().unwrap(), "a", Role::Client);
        let mut open = Vec::new();
        info.encode(&mut open);
        let mut buf = Vec::new();
        hello(&mut buf, &["tcp", "udp"]);
        frame(&mut buf, 7, StreamKind::Open, 0, &open);
        frame(&mut buf, 7, StreamKind::Data, 0, b"GET /");
        frame(&mut buf, 7, StreamKind::Data, 0, b"");
        frame(&mut buf, 7, StreamKind::Ack, 123_456, &[]);
        frame(&mut buf, 7, StreamKind::Fin, 0, &[]);
        frame(&mut buf, 7, StreamKind::Abort, 0, b"reset");
        switch(&mut buf, 7, SWITCH_END | SWITCH_UDP, 1 << 40);
        close(&mut buf, "bye");
        resume(&mut buf, 0xdead_beef, 12_345);
        received(&mut buf, 1 << 50);
        let mut got = Vec::new();
        let mut at = 0;
        while at < buf.len() {
            let (m, used) = decode(&buf[at..]).unwrap().expect("complete");
            got.push(format!("{m:?}"));
            at += used;
        }
        assert_eq!(got.len(), 11);
        assert!(got[9].contains("session: 3735928559") && got[9].contains("received: 12345"), "{}", got[9]);
        assert!(got[10].contains("offset: 1125899906842624"), "{}", got[10]);
        assert!(got[7].contains("flags: 3") && got[7].contains("offset: 1099511627776"), "{}", got[7]);
        assert!(got[0].contains("version: 1") && got[0].contains("\"udp\""), "{}", got[0]);
        assert!(got[4].contains("ack: 123456"), "{}", got[4]);
        check_roundtrip(&buf);
        // Every prefix of a message is incomplete, never an error.
        for cut in 0..buf.len().min(40) {
            assert!(decode(&buf[..cut]).is_ok(), "prefix of {cut} bytes");
        }
    }

    /// Malformed input of every kind is refused with a reason, never read as something else, never a panic.
    #[test]
    fn malformed_input_is_refused() {
        let msg = |ty: u8, body: &[u8]| {
            let mut v = ((body.len() + 1) as u32).to_be_bytes().to_vec();
            v.push(ty);
            v.extend_from_slice(body);
            v
        };
        let frame_of = |kind: u8, rest: &[u8]| {
            let mut b = 7u64.to_be_bytes().to_vec();
            b.push(kind);
            b.extend_from_slice(rest);
            msg(FRAME, &b)
        };
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![0, 0, 0, 0], "length out of range"),
            (vec![0xff, 0xff, 0xff, 0xff], "length out of range"),
            (((MAX_BODY + 1) as u32).to_be_bytes().to_vec(), "length out of range"),
            (b"GET / HTTP/1.1\r\n".to_vec(), "length out of range"),
            (msg(9, b"x"), "unknown message type"),
            (msg(HELLO, b"NOPE\0\x01\0"), "not a hello"),
            (msg(HELLO, b"FSPR\0\x01\x01\x05tcp"), "short"),
            (msg(HELLO, b"FSPR\0\x01\0extra"), "trailing bytes"),
            (msg(HELLO, b"FSPR\0\x01\x01\x03t\x01p"), "bad text"),
            (msg(FRAME, b"\0\0\0"), "short"),
            (frame_of(0, b""), "bad kind"),
            (frame_of(6, b""), "bad kind"),
            (frame_of(1, b"\x01\x06"), "bad flow info"),
            (frame_of(2, &vec![0; MAX_DATA + 1]), "data too long"),
            (frame_of(3, b"x"), "trailing bytes"),
            (frame_of(4, b""), "bad text"),
            (frame_of(4, b"\xff\xfe"), "bad text"),
            (frame_of(5, b"\0\0\0"), "bad ack"),
            (frame_of(5, &u64::MAX.to_be_bytes()), "ack out of range"),
            (msg(CLOSE, &[b'x'; 65]), "bad text"),
            (msg(SWITCH, &[0; 16]), "bad switch"),
            (msg(SWITCH, &[0; 18]), "bad switch"),
            (msg(SWITCH, &[0, 0, 0, 0, 0, 0, 0, 7, 4, 0, 0, 0, 0, 0, 0, 0, 0]), "bad switch flags"),
            (msg(SWITCH, &[0, 0, 0, 0, 0, 0, 0, 7, 1, 1, 0, 0, 0, 0, 0, 0, 0]), "offset out of range"),
            (msg(RESUME, &[0; 15]), "bad resume"),
            (msg(RESUME, &[0; 17]), "bad resume"),
            (msg(RESUME, &[0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]), "offset out of range"),
            (msg(RECEIVED, &[0; 7]), "bad received"),
            (msg(RECEIVED, &[1, 0, 0, 0, 0, 0, 0, 0]), "offset out of range"),
        ];
        for (input, why) in cases {
            assert_eq!(one(&input), Err(WireError(why)), "{input:?}");
            check_roundtrip(&input);
        }
        // Deterministic random bytes: never a panic; what decodes re-encodes identically.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            let n = (x % 48) as usize;
            let mut b = Vec::with_capacity(n + 5);
            b.extend_from_slice(&((n as u32 + 1).to_be_bytes()));
            b.push((x >> 8) as u8 % 7);
            for _ in 0..n {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                b.push(x as u8);
            }
            check_roundtrip(&b);
        }
    }

    #[test]
    fn datagrams_round_trip_and_short_or_long_ones_are_refused() {
        let mut b = Vec::new();
        datagram(&mut b, 0x0102_0304_0506_0708, b"query");
        assert_eq!(&b[..8], &[1, 2, 3, 4, 5, 6, 7, 8], "the flow id, big-endian");
        assert_eq!(decode_datagram(&b), Ok((0x0102_0304_0506_0708, &b"query"[..])));
        let mut empty = Vec::new();
        datagram(&mut empty, 7, b"");
        assert_eq!(decode_datagram(&empty), Ok((7, &b""[..])), "an empty UDP datagram is one too");
        for n in 0..8 {
            assert!(decode_datagram(&b[..n]).is_err(), "{n} bytes: no flow id");
        }
        let mut long = Vec::new();
        datagram(&mut long, 1, &vec![0; MAX_DATA + 1]);
        assert_eq!(decode_datagram(&long), Err(WireError("datagram too long")));
        long.pop();
        assert!(decode_datagram(&long).is_ok(), "MAX_DATA fits");
        for input in [&b[..], &b[..3], &long[..], &[0u8; 9][..]] {
            check_datagram(input);
        }
    }
}
