//! The packets of the datagram carriers, `udp` and `udpplus` (docs/peers.md, "The udp and udpplus carriers"): one
//! parser for every UDP datagram anyone can send to their port, sans-IO.
//!
//! A datagram is a type byte and its body:
//!
//! | type | packet | body |
//! |---|---|---|
//! | 1 | `Init` | the connecting side's ephemeral X25519 key (32), its certificate (u16 length, DER), its signature (u16 length) of [`INIT_CONTEXT`] and the key |
//! | 2 | `Resp` | the accepting side's ephemeral key (32), its certificate, its signature of [`RESP_CONTEXT`], the `Init`'s key and its own |
//! | 3 | `Sealed` | a packet number (u64), then one [`Item`] sealed with AEAD (the type byte and number authenticated with it) |
//! | 4 | `Init2` | as `Init`, then the ciphers offered (u8, a set of [`CHACHA20_POLY1305`] and [`AES_256_GCM`]); signed over [`INIT2_CONTEXT`], the key and that byte |
//! | 5 | `Resp2` | as `Resp`, then the cipher chosen (u8, one of those offered); signed over [`RESP2_CONTEXT`], both keys and that byte |
//!
//! `Init` and `Resp` (version 1) seal with ChaCha20-Poly1305; `Init2` offers ciphers and `Resp2` says which one
//! seals. A peer of version 1 drops an `Init2` as an unknown type, so the connecting side sends `Init2` and `Init`
//! in turn until answered.
//!
//! What a `Sealed` packet holds once opened ([`Item`]) is a kind byte and its body, described at each variant.
//! Anything else (an unknown type or kind, a length out of range, trailing bytes) is an error: the datagram is
//! dropped and counted, the session stays.

use super::wire::{WireError, MAX_DATA};

/// Packet types.
pub const INIT: u8 = 1;
/// See [`INIT`].
pub const RESP: u8 = 2;
/// See [`INIT`].
pub const SEALED: u8 = 3;
/// See [`INIT`].
pub const INIT2: u8 = 4;
/// See [`INIT`].
pub const RESP2: u8 = 5;
/// A cipher of `Init2` and `Resp2`: ChaCha20-Poly1305 (what version 1 seals with).
pub const CHACHA20_POLY1305: u8 = 1;
/// See [`CHACHA20_POLY1305`]: AES-256-GCM.
pub const AES_256_GCM: u8 = 2;
/// Every cipher this version knows.
pub const CIPHERS: u8 = CHACHA20_POLY1305 | AES_256_GCM;
/// The header of a `Sealed` packet (type and packet number), authenticated as the AEAD's associated data.
pub const SEALED_HEAD: usize = 9;
/// What an `Init` signature covers besides the key.
pub const INIT_CONTEXT: &[u8] = b"flexstack udp carrier init v1";
/// What a `Resp` signature covers besides the keys.
pub const RESP_CONTEXT: &[u8] = b"flexstack udp carrier resp v1";
/// What an `Init2` signature covers besides the key and the ciphers offered.
pub const INIT2_CONTEXT: &[u8] = b"flexstack udp carrier init v2";
/// What a `Resp2` signature covers besides the keys and the cipher chosen.
pub const RESP2_CONTEXT: &[u8] = b"flexstack udp carrier resp v2";
/// Most SACK ranges an `Ack` carries.
pub const MAX_SACKS: usize = 16;
/// Most sequence numbers a `Nack` carries.
pub const MAX_NACKS: usize = 64;
/// Most packets an FEC group covers (`fec_k`).
pub const MAX_FEC_K: usize = 32;
/// The largest certificate or signature a handshake packet carries.
pub const MAX_BLOB: usize = 4096;

/// A handshake packet (`Init`, `Resp`, `Init2` or `Resp2`): the sender's ephemeral key, certificate and signature.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handshake<'a> {
    /// `Init`, `Resp`, `Init2` or `Resp2`.
    pub ty: u8,
    /// `Init2`: the ciphers offered; `Resp2`: the one chosen; `Init` and `Resp`: 0.
    pub ciphers: u8,
    /// The sender's ephemeral X25519 public key.
    pub key: [u8; 32],
    /// The sender's certificate (DER): its fingerprint names the peer.
    pub cert: &'a [u8],
    /// The signature, by the certificate's key.
    pub sig: &'a [u8],
}

/// A datagram on the carrier's port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Packet<'a> {
    /// `Init`, `Resp`, `Init2` or `Resp2`.
    Handshake(Handshake<'a>),
    /// A sealed packet: its number and the ciphertext (tag included).
    Sealed {
        /// The packet number (the AEAD's nonce, and the replay window's).
        number: u64,
        /// The sealed item.
        sealed: &'a [u8],
    },
}

/// What a sealed packet holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Item<'a> {
    /// 1: bytes of the reliable stream (the peer protocol's messages of docs/peers.md) at byte `offset`: offset
    /// (u64), 1 or more bytes.
    Segment {
        /// Where the bytes start in the stream.
        offset: u64,
        /// The bytes.
        bytes: &'a [u8],
    },
    /// 2: the receiver's state of the reliable stream: every byte below `cum` (u64) arrived; it takes up to `window`
    /// (u32) bytes beyond `cum`; a count (u8, at most [`MAX_SACKS`]) of ranges `[start, end)` (u64 each) that
    /// arrived beyond `cum`.
    Ack {
        /// All bytes below arrived.
        cum: u64,
        /// Bytes the receiver takes beyond `cum`.
        window: u32,
        /// Ranges received beyond `cum`.
        sacks: Vec<(u64, u64)>,
    },
    /// 3: one app datagram of a UDP flow (`udp`): flow id (u64), the payload.
    Datagram {
        /// The flow (the id of the side that opened it).
        flow: u64,
        /// The app's datagram.
        payload: &'a [u8],
    },
    /// 4: one app datagram of a UDP flow (`udpplus`): flow id (u64), sequence number (u32), the payload.
    Numbered {
        /// The flow.
        flow: u64,
        /// Its number in the flow.
        seq: u32,
        /// The app's datagram.
        payload: &'a [u8],
    },
    /// 5: the datagrams of a flow the receiver misses (`udpplus`, `arq`): flow id, a count (u8, 1 to
    /// [`MAX_NACKS`]), the sequence numbers (u32 each).
    Nack {
        /// The flow.
        flow: u64,
        /// The numbers missing.
        seqs: Vec<u32>,
    },
    /// 6: the XOR of `k` datagrams of a flow (`udpplus`, `fec`): flow id, the first number (u32), `k` (u8, 2 to
    /// [`MAX_FEC_K`]), the XOR of their lengths (u16), the XOR of their payloads (each padded with zeros to the
    /// longest).
    Parity {
        /// The flow.
        flow: u64,
        /// The group's first number.
        first: u32,
        /// How many datagrams the group covers.
        k: u8,
        /// The XOR of their lengths.
        len_xor: u16,
        /// The XOR of their payloads.
        bytes: &'a [u8],
    },
    /// 7: nothing (keeps the session alive and asks for an `Ack`).
    Ping,
    /// 8: the sender ends the session: a reason (0-64 ASCII).
    Close {
        /// Why.
        reason: &'a str,
    },
}

const SEGMENT: u8 = 1;
const ACK: u8 = 2;
const DATAGRAM: u8 = 3;
const NUMBERED: u8 = 4;
const NACK: u8 = 5;
const PARITY: u8 = 6;
const PING: u8 = 7;
const CLOSE: u8 = 8;

fn u64_at(b: &[u8], at: usize) -> Result<u64, WireError> {
    b.get(at..at + 8).map(|s| u64::from_be_bytes(s.try_into().expect("8"))).ok_or(WireError("truncated"))
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, WireError> {
    b.get(at..at + 4).map(|s| u32::from_be_bytes(s.try_into().expect("4"))).ok_or(WireError("truncated"))
}

fn u16_at(b: &[u8], at: usize) -> Result<u16, WireError> {
    b.get(at..at + 2).map(|s| u16::from_be_bytes(s.try_into().expect("2"))).ok_or(WireError("truncated"))
}

/// Decodes a datagram received on the port.
pub fn decode(buf: &[u8]) -> Result<Packet<'_>, WireError> {
    let (&ty, body) = buf.split_first().ok_or(WireError("empty"))?;
    match ty {
        INIT | RESP | INIT2 | RESP2 => {
            let key: [u8; 32] = body.get(..32).ok_or(WireError("truncated"))?.try_into().expect("32");
            let mut at = 32;
            let mut blob = || -> Result<&[u8], WireError> {
                let n = usize::from(u16_at(body, at)?);
                if n == 0 || n > MAX_BLOB {
                    return Err(WireError("certificate or signature length out of range"));
                }
                let b = body.get(at + 2..at + 2 + n).ok_or(WireError("truncated"))?;
                at += 2 + n;
                Ok(b)
            };
            let cert = blob()?;
            let sig = blob()?;
            let ciphers = match ty {
                INIT | RESP => 0,
                _ => {
                    let c = *body.get(at).ok_or(WireError("truncated"))?;
                    at += 1;
                    let known = c & !CIPHERS == 0;
                    match ty {
                        INIT2 if c != 0 && known => c,
                        RESP2 if c.count_ones() == 1 && known => c,
                        _ => return Err(WireError("unknown cipher")),
                    }
                }
            };
            if at != body.len() {
                return Err(WireError("trailing bytes"));
            }
            Ok(Packet::Handshake(Handshake { ty, ciphers, key, cert, sig }))
        }
        SEALED => {
            let number = u64_at(body, 0)?;
            Ok(Packet::Sealed { number, sealed: &body[8..] })
        }
        _ => Err(WireError("unknown packet type")),
    }
}

/// Encodes a handshake packet.
pub fn handshake(out: &mut Vec<u8>, h: &Handshake<'_>) {
    out.push(h.ty);
    out.extend_from_slice(&h.key);
    for b in [h.cert, h.sig] {
        out.extend_from_slice(&(b.len() as u16).to_be_bytes());
        out.extend_from_slice(b);
    }
    if matches!(h.ty, INIT2 | RESP2) {
        out.push(h.ciphers);
    }
}

/// Encodes the header of a sealed packet (the ciphertext follows).
pub fn sealed_head(out: &mut Vec<u8>, number: u64) {
    out.push(SEALED);
    out.extend_from_slice(&number.to_be_bytes());
}

/// Decodes an opened item.
pub fn decode_item(buf: &[u8]) -> Result<Item<'_>, WireError> {
    let (&kind, b) = buf.split_first().ok_or(WireError("empty item"))?;
    let item = match kind {
        SEGMENT => {
            let offset = u64_at(b, 0)?;
            let bytes = &b[8..];
            if bytes.is_empty() || bytes.len() > MAX_DATA {
                return Err(WireError("segment length out of range"));
            }
            offset.checked_add(bytes.len() as u64).ok_or(WireError("segment beyond 2^64"))?;
            Item::Segment { offset, bytes }
        }
        ACK => {
            let cum = u64_at(b, 0)?;
            let window = u32_at(b, 8)?;
            let n = usize::from(*b.get(12).ok_or(WireError("truncated"))?);
            if n > MAX_SACKS || b.len() != 13 + 16 * n {
                return Err(WireError("ack length"));
            }
            let mut sacks = Vec::with_capacity(n);
            for i in 0..n {
                let (s, e) = (u64_at(b, 13 + 16 * i)?, u64_at(b, 21 + 16 * i)?);
                if s <= cum || e <= s {
                    return Err(WireError("sack range"));
                }
                sacks.push((s, e));
            }
            Item::Ack { cum, window, sacks }
        }
        DATAGRAM => {
            let flow = u64_at(b, 0)?;
            let payload = &b[8..];
            if payload.len() > MAX_DATA {
                return Err(WireError("datagram too long"));
            }
            Item::Datagram { flow, payload }
        }
        NUMBERED => {
            let flow = u64_at(b, 0)?;
            let seq = u32_at(b, 8)?;
            let payload = &b[12..];
            if payload.len() > MAX_DATA {
                return Err(WireError("datagram too long"));
            }
            Item::Numbered { flow, seq, payload }
        }
        NACK => {
            let flow = u64_at(b, 0)?;
            let n = usize::from(*b.get(8).ok_or(WireError("truncated"))?);
            if n == 0 || n > MAX_NACKS || b.len() != 9 + 4 * n {
                return Err(WireError("nack length"));
            }
            let seqs = (0..n).map(|i| u32_at(b, 9 + 4 * i)).collect::<Result<_, _>>()?;
            Item::Nack { flow, seqs }
        }
        PARITY => {
            let flow = u64_at(b, 0)?;
            let first = u32_at(b, 8)?;
            let k = *b.get(12).ok_or(WireError("truncated"))?;
            let len_xor = u16_at(b, 13)?;
            let bytes = &b[15..];
            if !(2..=MAX_FEC_K).contains(&usize::from(k)) || bytes.len() > MAX_DATA {
                return Err(WireError("parity out of range"));
            }
            Item::Parity { flow, first, k, len_xor, bytes }
        }
        PING if b.is_empty() => Item::Ping,
        CLOSE if b.len() <= 64 && b.is_ascii() => {
            Item::Close { reason: std::str::from_utf8(b).map_err(|_| WireError("reason"))? }
        }
        _ => return Err(WireError("unknown or malformed item")),
    };
    Ok(item)
}

/// Encodes an item (the caller keeps within the limits [`decode_item`] checks).
pub fn item(out: &mut Vec<u8>, it: &Item<'_>) {
    match it {
        Item::Segment { offset, bytes } => {
            out.push(SEGMENT);
            out.extend_from_slice(&offset.to_be_bytes());
            out.extend_from_slice(bytes);
        }
        Item::Ack { cum, window, sacks } => {
            out.push(ACK);
            out.extend_from_slice(&cum.to_be_bytes());
            out.extend_from_slice(&window.to_be_bytes());
            out.push(sacks.len().min(MAX_SACKS) as u8);
            for (s, e) in sacks.iter().take(MAX_SACKS) {
                out.extend_from_slice(&s.to_be_bytes());
                out.extend_from_slice(&e.to_be_bytes());
            }
        }
        Item::Datagram { flow, payload } => {
            out.push(DATAGRAM);
            out.extend_from_slice(&flow.to_be_bytes());
            out.extend_from_slice(payload);
        }
        Item::Numbered { flow, seq, payload } => {
            out.push(NUMBERED);
            out.extend_from_slice(&flow.to_be_bytes());
            out.extend_from_slice(&seq.to_be_bytes());
            out.extend_from_slice(payload);
        }
        Item::Nack { flow, seqs } => {
            out.push(NACK);
            out.extend_from_slice(&flow.to_be_bytes());
            out.push(seqs.len().min(MAX_NACKS) as u8);
            for s in seqs.iter().take(MAX_NACKS) {
                out.extend_from_slice(&s.to_be_bytes());
            }
        }
        Item::Parity { flow, first, k, len_xor, bytes } => {
            out.push(PARITY);
            out.extend_from_slice(&flow.to_be_bytes());
            out.extend_from_slice(&first.to_be_bytes());
            out.push(*k);
            out.extend_from_slice(&len_xor.to_be_bytes());
            out.extend_from_slice(bytes);
        }
        Item::Ping => out.push(PING),
        Item::Close { reason } => {
            out.push(CLOSE);
            out.extend_from_slice(&reason.as_bytes()[..reason.len().min(64)]);
        }
    }
}

/// A property check for the fuzz target `carrier_udp`: decoding any datagram or item never panics, and what
/// decodes encodes back to the same bytes.
pub fn check(buf: &[u8]) {
    if let Ok(p) = decode(buf) {
        let mut again = Vec::new();
        match p {
            Packet::Handshake(h) => handshake(&mut again, &h),
            Packet::Sealed { number, sealed } => {
                sealed_head(&mut again, number);
                again.extend_from_slice(sealed);
            }
        }
        assert_eq!(again, buf, "a packet re-encodes to its bytes");
    }
    if let Ok(it) = decode_item(buf) {
        let mut again = Vec::new();
        item(&mut again, &it);
        assert_eq!(again, buf, "an item re-encodes to its bytes");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(it: Item<'_>) {
        let mut b = Vec::new();
        item(&mut b, &it);
        assert_eq!(decode_item(&b).unwrap(), it);
        check(&b);
    }

    #[test]
    fn items_round_trip() {
        roundtrip(Item::Segment { offset: 7, bytes: b"abc" });
        roundtrip(Item::Ack { cum: 10, window: 1 << 20, sacks: vec![(12, 20), (30, 31)] });
        roundtrip(Item::Datagram { flow: 3, payload: b"" });
        roundtrip(Item::Numbered { flow: 3, seq: 9, payload: b"xyz" });
        roundtrip(Item::Nack { flow: 3, seqs: vec![1, 5] });
        roundtrip(Item::Parity { flow: 3, first: 4, k: 4, len_xor: 17, bytes: b"\x01\x02" });
        roundtrip(Item::Ping);
        roundtrip(Item::Close { reason: "bye" });
    }

    #[test]
    fn packets_round_trip() {
        for (ty, ciphers) in [(INIT, 0), (RESP, 0), (INIT2, CIPHERS), (INIT2, AES_256_GCM), (RESP2, AES_256_GCM)] {
            let h = Handshake { ty, ciphers, key: [7; 32], cert: b"cert", sig: b"sig" };
            let mut b = Vec::new();
            handshake(&mut b, &h);
            assert_eq!(decode(&b).unwrap(), Packet::Handshake(h));
            check(&b);
        }
        let mut s = Vec::new();
        sealed_head(&mut s, 42);
        s.extend_from_slice(&[9; 20]);
        assert_eq!(decode(&s).unwrap(), Packet::Sealed { number: 42, sealed: &[9; 20] });
    }

    #[test]
    fn malformed_input_is_refused() {
        for bad in [
            &b""[..],
            &[9],
            &[INIT, 1, 2],
            &[SEALED, 0, 0],
            &[SEGMENT, 0, 0, 0, 0, 0, 0, 0, 1],
            &[ACK, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1],
            &[NACK, 0, 0, 0, 0, 0, 0, 0, 1, 0],
            &[PARITY, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0],
            &[PING, 0],
            &[CLOSE, 0xff],
        ] {
            assert!(decode(bad).is_err() || bad.first() != Some(&INIT), "{bad:?}");
            if bad.first().is_some_and(|&k| (SEGMENT..=CLOSE).contains(&k)) {
                assert!(decode_item(bad).is_err(), "{bad:?}");
            }
        }
        let mut h = Vec::new();
        handshake(&mut h, &Handshake { ty: RESP, ciphers: 0, key: [0; 32], cert: b"c", sig: b"s" });
        h.push(0);
        assert!(decode(&h).is_err(), "trailing bytes");
        // Version 2: no cipher, an unknown one, a Resp2 choosing two, a cipher byte missing.
        for (ty, c) in [(INIT2, 0), (INIT2, 4), (RESP2, CIPHERS), (RESP2, 0), (RESP2, 8)] {
            let mut h = Vec::new();
            handshake(&mut h, &Handshake { ty, ciphers: c, key: [0; 32], cert: b"c", sig: b"s" });
            assert!(decode(&h).is_err(), "type {ty}, ciphers {c}");
        }
        let mut h = Vec::new();
        handshake(&mut h, &Handshake { ty: INIT2, ciphers: AES_256_GCM, key: [0; 32], cert: b"c", sig: b"s" });
        h.pop();
        assert!(decode(&h).is_err(), "no cipher byte");
        // A SACK range at or below the cumulative point.
        let mut a = Vec::new();
        item(&mut a, &Item::Ack { cum: 10, window: 0, sacks: vec![(5, 8)] });
        assert!(decode_item(&a).is_err());
    }
}
