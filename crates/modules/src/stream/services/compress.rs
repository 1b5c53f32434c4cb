//! `compress`: zstd on the byte stream, framed so that a `compress` in `mode = "decompress"` at the other end (the
//! peer flexstack, or further down the same chain) restores the bytes exactly.
//!
//! - `mode = "compress"` (the app's end) compresses the data travelling down and decompresses the data coming up;
//!   `mode = "decompress"` (the far end) does the opposite. So one of each, in either order of a chain, give both
//!   directions back as they were.
//! - The frame: the input becomes blocks of at most 64 KiB, each a 4-byte big-endian header and a payload: bit 31 of the header set means the payload is the bytes as they were (stored, when zstd would not
//!   make them smaller), bits 0-30 are the payload's length. A UDP datagram is one block, so one datagram still.
//! - Blocks are as big as the input at hand allows: the consecutive `Data` chunks of a TCP flow's direction in one
//!   batch are compressed together (up to 64 KiB a block; `terminate` hands over what its socket holds in chunks of
//!   16 KiB), and what is gathered leaves as a block at the end of the batch, so nothing waits for more input (a
//!   small message is sent as it comes; zstd's cost per call and its ratio favour big blocks).
//! - Acks: the lengths change, so it keeps an `AckMap` per flow and direction (docs/streams.md): the input bytes of
//!   a block are acknowledged upstream when the output made from them is. Bytes of a block not yet whole wait in a
//!   buffer of the flow (at most one block: 64 KiB + 1 KiB).
//! - A header that announces more than a block, or a payload zstd cannot read, aborts the flow both ways (reason
//!   `compress`), counted in `errors_total`.
//! - `level` is a knob (zstd levels 1 to 19; the next block uses it).
//! - `active` is a knob: false takes the service out of its flows' paths while they run, true puts it back. Each
//!   direction switches at a point both ends agree on, marked in the stream by the end that compresses it: a block
//!   header with bit 30 set and length 0 ends the blocks (the bytes after it pass as they are), and a `Data` frame
//!   with no bytes starts them again. The restoring end follows the marks, whatever its own knob says, so the two
//!   ends need not be switched together; both start framed, and a flow opened while inactive begins with the end
//!   mark (docs/services.md, "Changing services while flows run").

use super::active;
use super::flows::{
    ack, read_select, slot, translate_ack, Flows, HandedFlows, Seen, SelectRule, SelectionMeters, SELECT, SELECT_DOC,
};
use crate::stream::{BOTH_WAYS_IN, BOTH_WAYS_OUT};
use flexstack_core::module::handed_over;
use flexstack_core::stream::{AckMap, Protocol, StreamFrame, StreamKind};
use flexstack_core::{
    field, kind_from_decl, Batch, ConfigError, Direction, Frame, KindDecl, Meter, MeterDecl, Module, ModuleBuilder,
    ModuleInterface, ModuleKind, ModuleVars, Output, Param, Settings, Value, ValueType,
};

/// The kind's name in stack files.
pub const KIND: &str = "compress";

/// Most input bytes in one block.
pub const MAX_BLOCK: usize = 64 * 1024;

/// Longest payload a header may announce (zstd's bound for a block, rounded up).
pub const MAX_PAYLOAD: usize = MAX_BLOCK + 1024;

/// Header bit: the payload is stored, not compressed.
const STORED: u32 = 1 << 31;

/// Header bit (with length 0): the blocks end here; the bytes after pass as they are (the service was taken out).
const SWITCH_OFF: u32 = 1 << 30;

/// The `compress` module kind.
pub struct CompressKind;

/// Settings and knobs.
struct Config {
    level: u64,
    decompress: bool,
    active: bool,
}

type P = Param<Config>;

const DECL: KindDecl<Config, Meters> = KindDecl {
    inputs: BOTH_WAYS_IN,
    outputs: BOTH_WAYS_OUT,
    params: &[
        P::text(
            "mode",
            "compress: compresses data going down, restores data coming up (the app's end); decompress: the opposite",
            "compress",
            |c| if c.decompress { "decompress".into() } else { "compress".into() },
            |c, t| {
                c.decompress = match t {
                    "compress" => false,
                    "decompress" => true,
                    _ => return Err(format!("expected compress or decompress, got {t:?}")),
                };
                Ok(())
            },
        )
        .setting(),
        P::u64("level", "", "zstd's compression level (higher: smaller and slower)", 3, field!(level)).range(1.0, 19.0),
        active::param(field!(active)),
        P::manual(SELECT, "array of strings", SELECT_DOC, "[\"use *\"]"),
    ],
    meters: &[
        MeterDecl::u64("bytes_in_total", "bytes", "data bytes received, both directions", |m| &mut m.bytes_in),
        MeterDecl::u64("bytes_out_total", "bytes", "data bytes sent on, both directions", |m| &mut m.bytes_out),
        MeterDecl::u64("plain_bytes_total", "bytes", "bytes compressed (before)", |m| &mut m.plain),
        MeterDecl::u64("packed_bytes_total", "bytes", "what they became, headers included", |m| &mut m.packed),
        MeterDecl::new("ratio", ValueType::F64, "", "packed / plain bytes so far (below 1: smaller)", |m| &mut m.ratio),
        MeterDecl::u64("blocks_total", "blocks", "blocks made", |m| &mut m.blocks),
        MeterDecl::u64(
            "stored_blocks_total",
            "blocks",
            "blocks stored as they were (zstd would not shrink them)",
            |m| &mut m.stored,
        ),
        MeterDecl::u64("errors_total", "flows", "flows aborted: a block that could not be read", |m| &mut m.errors),
        MeterDecl::u64(
            "switches_total",
            "marks",
            "marks sent: a direction taken out of or put back into the path",
            |m| &mut m.switches,
        ),
        MeterDecl::u64("raw_bytes_total", "bytes", "data bytes passed as they were (out of the path)", |m| &mut m.raw),
    ],
    more_meters: SelectionMeters::specs,
    breaks_cycles: true,
    ..KindDecl::new(KIND, "a stream service: zstd, framed in length-prefixed blocks; decompress mode restores them")
};

/// The meters.
#[derive(Default)]
struct Meters {
    bytes_in: Meter,
    bytes_out: Meter,
    plain: Meter,
    packed: Meter,
    ratio: Meter,
    blocks: Meter,
    stored: Meter,
    errors: Meter,
    switches: Meter,
    raw: Meter,
}

impl ModuleKind for CompressKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(KIND);
        let mut cfg = Config { level: 0, decompress: false, active: true };
        DECL.read(&mut r, &mut cfg)?;
        let select = read_select(&mut r)?;
        r.finish()?;
        Ok(Box::new(CompressBuilder { cfg, select }))
    }
}

struct CompressBuilder {
    cfg: Config,
    select: Vec<SelectRule>,
}

impl ModuleBuilder for CompressBuilder {
    fn interface(&self) -> ModuleInterface {
        DECL.interface(&self.cfg)
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        DECL.publish(&self.cfg, vars);
        let zc = zstd::bulk::Compressor::new(self.cfg.level as i32).expect("zstd context");
        let zd = zstd::bulk::Decompressor::new().expect("zstd context");
        Box::new(Compress {
            cfg: self.cfg,
            m: DECL.meters(vars),
            flows: Flows::new(self.select, vars),
            zc,
            zd,
            gathering: None,
            gathered: Vec::with_capacity(MAX_BLOCK),
        })
    }
}

/// One flow: per direction, the map of its acks, (restoring) the bytes of a block not yet whole, and whether its
/// bytes pass as they are (after an end mark; both directions start framed).
#[derive(Default)]
struct Flow {
    acks: [AckMap; 2],
    partial: [Vec<u8>; 2],
    raw: [bool; 2],
    /// A UDP flow: each datagram stays one block (never gathered with the next).
    udp: bool,
}

/// A running `compress`.
pub struct Compress {
    cfg: Config,
    m: Meters,
    flows: Flows<Flow>,
    zc: zstd::bulk::Compressor<'static>,
    zd: zstd::bulk::Decompressor<'static>,
    /// The flow and direction whose chunks are being gathered into a block in this batch, and their bytes (less
    /// than a block; empty between batches).
    gathering: Option<(u64, Direction)>,
    gathered: Vec<u8>,
}

/// The other direction.
fn back(d: Direction) -> Direction {
    match d {
        Direction::Down => Direction::Up,
        Direction::Up => Direction::Down,
    }
}

impl Compress {
    /// True if data travelling `d` is compressed here (else restored).
    fn compresses(&self, d: Direction) -> bool {
        (d == Direction::Down) != self.cfg.decompress
    }

    /// `input` bytes travelling `d` became `output` bytes: acks at once what the flow's map frees.
    fn produced(&mut self, flow: u64, d: Direction, input: u64, output: u64, out: &mut Output<'_>) {
        self.m.bytes_out.add(output);
        let st = self.flows.get_mut(flow).expect("a flow it works on");
        let free = st.acks[slot(d)].produced(input, output);
        ack(out, flow, back(d), free);
    }

    /// Compresses a chunk into blocks, emitted (and mapped for the acks, block by block); returns the bytes emitted.
    fn pack(&mut self, flow: u64, d: Direction, bytes: &[u8], out: &mut Output<'_>) -> u64 {
        let mut total = 0;
        for piece in bytes.chunks(MAX_BLOCK) {
            let zc = &mut self.zc;
            let mut stored = false;
            let frame = StreamFrame::data_with(out.pool(), flow, d, |b| {
                // Zeroed up to zstd's bound for this piece only (not a whole block's for every chunk).
                b.clear();
                b.resize(4 + zstd::zstd_safe::compress_bound(piece.len()).max(piece.len()), 0);
                let n = match zc.compress_to_buffer(piece, &mut b[4..]) {
                    Ok(n) if n < piece.len() => n,
                    _ => {
                        stored = true;
                        b[4..4 + piece.len()].copy_from_slice(piece);
                        piece.len()
                    }
                };
                b.truncate(4 + n);
                let header = n as u32 | if stored { STORED } else { 0 };
                b[..4].copy_from_slice(&header.to_be_bytes());
            });
            self.m.blocks.add(1);
            if stored {
                self.m.stored.add(1);
            }
            let made = frame.len() as u64;
            total += made;
            out.emit(0, frame);
            self.produced(flow, d, piece.len() as u64, made, out);
        }
        self.m.plain.add(bytes.len() as u64);
        self.m.packed.add(total);
        let plain = self.m.plain.get();
        if plain > 0 {
            self.m.ratio.set_f64(self.m.packed.get() as f64 / plain as f64);
        }
        total
    }

    /// Takes a chunk of framed bytes, emits the blocks it completes, restored; returns the bytes emitted, or an error
    /// if a block is bad.
    fn unpack(&mut self, flow: u64, d: Direction, bytes: &[u8], out: &mut Output<'_>) -> Result<u64, String> {
        let st = self.flows.get_mut(flow).expect("a flow it works on");
        let buf = &mut st.partial[slot(d)];
        buf.extend_from_slice(bytes);
        let mut at = 0;
        let mut total = 0;
        while buf.len() - at >= 4 {
            let header = u32::from_be_bytes(buf[at..at + 4].try_into().expect("4 bytes"));
            if header == SWITCH_OFF {
                // The blocks end: what follows passes as it is.
                at += 4;
                st.raw[slot(d)] = true;
                if at < buf.len() {
                    let rest = StreamFrame::data(out.pool(), flow, d, &buf[at..]);
                    total += rest.len() as u64;
                    self.m.raw.add(rest.len() as u64);
                    out.emit(0, rest);
                }
                at = buf.len();
                break;
            }
            let len = (header & !(STORED | SWITCH_OFF)) as usize;
            if header & SWITCH_OFF != 0 {
                return Err(format!("a bad mark {header:#010x}"));
            }
            if len > MAX_PAYLOAD {
                return Err(format!("a block of {len} bytes announced (at most {MAX_PAYLOAD})"));
            }
            if buf.len() - at - 4 < len {
                break;
            }
            let payload = &buf[at + 4..at + 4 + len];
            let frame = if header & STORED != 0 {
                StreamFrame::data(out.pool(), flow, d, payload)
            } else {
                let zd = &mut self.zd;
                let mut failed = None;
                let f = StreamFrame::data_with(out.pool(), flow, d, |b| {
                    b.clear();
                    b.reserve(MAX_BLOCK);
                    if let Err(e) = zd.decompress_to_buffer(payload, b) {
                        failed = Some(e.to_string());
                    }
                });
                if let Some(e) = failed {
                    return Err(format!("zstd: {e}"));
                }
                f
            };
            total += frame.len() as u64;
            out.emit(0, frame);
            at += 4 + len;
        }
        buf.drain(..at);
        Ok(total)
    }

    /// Adds a chunk to the block being gathered for `flow` going `d` (a TCP flow's data to compress); full blocks
    /// leave at once, the rest with [`Self::flush`]. A chunk of a block's size or more with nothing gathered is
    /// packed as it is (no copy).
    fn gather(&mut self, flow: u64, d: Direction, bytes: &[u8], out: &mut Output<'_>) {
        if self.gathering != Some((flow, d)) {
            self.flush(out);
            self.gathering = Some((flow, d));
        }
        let mut bytes = bytes;
        if !self.gathered.is_empty() {
            let take = bytes.len().min(MAX_BLOCK - self.gathered.len());
            self.gathered.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.gathered.len() < MAX_BLOCK {
                return;
            }
            let block = std::mem::take(&mut self.gathered);
            self.pack(flow, d, &block, out);
            self.gathered = block;
            self.gathered.clear();
        }
        let whole = bytes.len() - bytes.len() % MAX_BLOCK;
        if whole > 0 {
            self.pack(flow, d, &bytes[..whole], out);
        }
        self.gathered.extend_from_slice(&bytes[whole..]);
    }

    /// The block being gathered leaves (the batch ended, or another frame comes between).
    fn flush(&mut self, out: &mut Output<'_>) {
        let Some((flow, d)) = self.gathering.take() else { return };
        if !self.gathered.is_empty() {
            let block = std::mem::take(&mut self.gathered);
            self.pack(flow, d, &block, out);
            self.gathered = block;
            self.gathered.clear();
        }
    }

    /// Marks in the stream that this direction leaves the path (the end mark) or comes back (a `Data` frame with no
    /// bytes), as `raw` now says.
    fn switch(&mut self, flow: u64, d: Direction, out: &mut Output<'_>) {
        self.m.switches.add(1);
        if self.cfg.active {
            out.emit(0, StreamFrame::data(out.pool(), flow, d, &[]));
        } else {
            out.emit(0, StreamFrame::data(out.pool(), flow, d, &SWITCH_OFF.to_be_bytes()));
            self.produced(flow, d, 0, 4, out);
        }
    }

    /// Passes a chunk as it is (this direction is out of the path).
    fn pass_raw(&mut self, flow: u64, d: Direction, p: flexstack_core::Packet, out: &mut Output<'_>) {
        let n = p.len() as u64;
        self.m.raw.add(n);
        out.emit(0, p);
        self.produced(flow, d, n, n, out);
    }

    fn abort(&mut self, flow: u64, why: &str, out: &mut Output<'_>) {
        tracing::warn!(flow, why, "compress: aborting the flow");
        self.m.errors.add(1);
        self.flows.close(flow, KIND, out);
    }
}

impl Module for Compress {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        for frame in input.drain(..) {
            let Frame::Data(p) = frame else {
                self.flush(out);
                out.emit(0, frame);
                continue;
            };
            let d = p.direction();
            // Only more data of the flow and direction being gathered joins the block; anything else sends it first.
            let joins = self.gathering.is_some_and(|(flow, dir)| {
                dir == d && p.stream_flow() == Some(flow) && p.stream_kind() == Some(StreamKind::Data)
            });
            if !joins {
                self.flush(out);
            }
            match self.flows.see(&p, |info| Flow { udp: info.protocol == Protocol::Udp, ..Flow::default() }).0 {
                Seen::Data(flow) => {
                    let n = p.len() as u64;
                    self.m.bytes_in.add(n);
                    let compresses = self.compresses(d);
                    let st = self.flows.get_mut(flow).expect("a flow it works on");
                    let (raw, udp) = (st.raw[slot(d)], st.udp);
                    if compresses {
                        let active = self.cfg.active;
                        if raw == active {
                            // The knob changed since this direction's last chunk: mark the switch here.
                            self.flush(out);
                            let st = self.flows.get_mut(flow).expect("a flow it works on");
                            st.raw[slot(d)] = !active;
                            self.switch(flow, d, out);
                        }
                        if active && !udp {
                            self.gather(flow, d, p.data(), out);
                        } else if active {
                            self.pack(flow, d, p.data(), out);
                        } else {
                            self.pass_raw(flow, d, p, out);
                        }
                    } else if raw {
                        if n == 0 {
                            st.raw[slot(d)] = false; // the blocks start again
                        } else {
                            self.pass_raw(flow, d, p, out);
                        }
                    } else {
                        match self.unpack(flow, d, p.data(), out) {
                            Ok(made) => self.produced(flow, d, n, made, out),
                            Err(why) => self.abort(flow, &why, out),
                        }
                    }
                    // Otherwise `p` is consumed: its bytes left in the frames just made.
                }
                Seen::Ack(flow, n) => {
                    // `p` is consumed: translated.
                    let st = self.flows.get_mut(flow).expect("a flow it works on");
                    translate_ack(&mut st.acks, flow, d, n, out);
                }
                Seen::Fin(flow) => {
                    let partial = self.flows.get_mut(flow).is_some_and(|st| !st.partial[slot(d)].is_empty());
                    if partial {
                        self.abort(flow, "the stream ended inside a block", out);
                    // replaces the Fin
                    } else {
                        self.flows.fin(flow, d);
                        out.emit(0, p);
                    }
                }
                _ => out.emit(0, p),
            }
        }
        self.flush(out);
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        DECL.write(&mut self.cfg, knob, value)?;
        if knob == "level" {
            self.zc.set_compression_level(self.cfg.level as i32).map_err(|e| format!("zstd: {e}"))?;
        }
        Ok(())
    }

    fn take_state(&mut self) -> Option<Box<dyn std::any::Any>> {
        Some(Box::new(self.flows.take()))
    }

    fn adopt_state(&mut self, state: Box<dyn std::any::Any>) -> Result<(), String> {
        self.flows.adopt(handed_over::<HandedFlows<Flow>>(state, "a compress's flows")?);
        Ok(())
    }
}
