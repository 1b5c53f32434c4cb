//! `tap`: writes every frame it receives to a pcapng file, and passes the frames on.
//!
//! The capture starts with a section header and two interface description blocks: interface 0 for data frames,
//! with the link type of the `linktype` setting, and interface 1, link type `USER0` (147), for control frames. A
//! data frame is written as an enhanced packet block on interface 0 (cut to `snaplen` bytes, with its full length
//! recorded); a control frame (e.g. when the tap is linked to another module's `ctl` port) is written on interface 1
//! as one line of JSON text:
//! `{"op":"exec_reply","sender":"sw","dest":"control","serial":7,"param":"select","value":0}`.
//!
//! Timestamps are the switch's `now` in nanoseconds (the interfaces declare nanosecond resolution); on the daemon
//! that clock is monotonic, so they are relative to its origin rather than to 1970.
//!
//! **A capture is never overwritten.** The file is opened when the module is configured. A new (or empty) file is
//! created; a file that holds data is handled as the `exists` setting says: `"suffix"` (the default) writes a new
//! file next to it, `NAME.1.EXT` (the first free number), `"append"` adds a new section to it, and `"refuse"` fails
//! the configuration. A file another tap holds open (it locks it, in this daemon or another) is never appended to:
//! `"append"` then writes a suffix file too. So a daemon restarted with the same stack, or a `config rollback` that
//! loads a tap again, keeps what the earlier tap wrote. An incomplete block at the end of a file whose writer died
//! (SIGKILL, full disk) is cut when the file is opened again (`"suffix"` and `"append"`), so the file reads to its
//! last complete block. The `file` meter names the file written.
//!
//! **Whole blocks only.** Frames are encoded into a buffer as whole blocks, and the buffer goes to the file when
//! 64 KiB are waiting, after a `process` call when at least 50 ms (of `now`) have passed since the last flush, on
//! every poll, and when the module is dropped. The tap asks to be polled every 50 ms (a heartbeat), so buffered
//! frames reach the file within about 50 ms even when traffic stops. `frames_total` counts only frames whose block
//! reached the file whole; `frames_pending` those waiting in the buffer (`tap list` shows both). A failed write (a full disk) never stops traffic: the frames of the failed write are
//! counted in `frames_unwritten_total`, a block written in part is cut off again, the error is kept in the `error`
//! meter and logged once with the path and errno, and later writes are tried again.
//!
//! **Pages hold whole blocks.** A process killed (SIGKILL) in the middle of a `write()` leaves the part written so
//! far: the kernel copies a write into the page cache page by page and stops at a page boundary when a fatal signal
//! is pending. So a block never straddles a 4 KiB boundary of the file: when it would, a padding block (type
//! [`PADDING_BLOCK`], from the range the pcapng format leaves for local use; readers skip it) fills the page first,
//! and no block ends 4 or 8 bytes before a page boundary (too little room for a padding block). A file cut at any
//! page boundary then ends with a whole block. Only a block longer than a page (a frame of more than about 4 KiB)
//! still straddles boundaries; a file cut in one is cut back to its last complete block when a tap opens it again.
//! For frames of about 1,500 bytes the padding is up to a quarter of the file; `whole_pages = false` turns it off.
//!
//! Used inline, frames continue on `out`. As an extra receiver of a fan-out link, either leave `out` unlinked (the
//! switch then counts the frames as dropped on it) or set `passthrough = false`: the tap then has no output and lets
//! the frames go without counting them as drops. Its ports, settings, knob and meters are declared once, in `DECL`
//! below; docs/modules.md lists them.

use flexstack_core::module::port_type;
use flexstack_core::{
    field, kind_from_decl, Batch, ConfigError, ControlFrame, Frame, KindDecl, Meter, MeterDecl, Module, ModuleBuilder,
    ModuleInterface, ModuleKind, ModuleVars, Output, Param, PortDecl, Settings, Time, Value, ValueType,
};
use pcap_file::pcapng::blocks::enhanced_packet::EnhancedPacketBlock;
use pcap_file::pcapng::blocks::interface_description::{InterfaceDescriptionBlock, InterfaceDescriptionOption};
use pcap_file::pcapng::PcapNgWriter;
use pcap_file::{DataLink, PcapResult};
use std::borrow::Cow;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{self, ErrorKind, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The kind's name in stack files.
pub const KIND: &str = "tap";

/// Longest time buffered frames wait before they are flushed to the file.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(50);

/// Buffered bytes that make the tap write at once.
pub const FLUSH_BYTES: usize = 64 * 1024;

/// The pcapng interface id of data frames.
pub const DATA_INTERFACE: u32 = 0;

/// The pcapng interface id of control frames.
pub const CONTROL_INTERFACE: u32 = 1;

/// The type of a pcapng section header block (the same in both byte orders).
const SECTION_HEADER: u32 = 0x0A0D_0D0A;

/// The byte-order magic of a section header, as written in the section's byte order.
const BYTE_ORDER_MAGIC: u32 = 0x1A2B_3C4D;

/// The type of the padding blocks that keep blocks within pages (a local-use type: readers skip it).
pub const PADDING_BLOCK: u32 = 0x8F5F_0001;

/// The unit in which a killed writer's data reaches the file: a page.
pub const PAGE: u64 = 4096;

/// The padding to put before a block of `size` bytes that would start at offset `at`: 0, or the rest of the page
/// (at least 12 bytes), so that the block does not straddle a page boundary and does not end 4 or 8 bytes before
/// one (room no padding block fits in).
fn padding_before(at: u64, size: u64) -> u64 {
    let room = PAGE - at % PAGE;
    let fits = size <= room && !matches!(room - size, 4 | 8);
    if fits || size > PAGE || room < 12 || room == PAGE {
        0
    } else {
        room
    }
}

/// A padding block of `len` bytes (a multiple of 4, at least 12), in this machine's byte order (the section's).
fn padding_block(len: u64) -> Vec<u8> {
    let len32 = len as u32;
    let mut block = Vec::with_capacity(len as usize);
    block.extend_from_slice(&PADDING_BLOCK.to_ne_bytes());
    block.extend_from_slice(&len32.to_ne_bytes());
    block.resize(len as usize - 4, 0);
    block.extend_from_slice(&len32.to_ne_bytes());
    block
}

/// The link type of the data frames a tap captures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkType {
    /// IP packets without a link header (`LINKTYPE_RAW`, 101).
    Raw,
    /// Ethernet frames (`LINKTYPE_ETHERNET`, 1).
    Ethernet,
}

impl LinkType {
    fn name(self) -> &'static str {
        match self {
            LinkType::Raw => "raw",
            LinkType::Ethernet => "ethernet",
        }
    }

    fn parse(text: &str) -> Result<LinkType, String> {
        match text {
            "raw" => Ok(LinkType::Raw),
            "ethernet" => Ok(LinkType::Ethernet),
            other => Err(format!("expected \"raw\" or \"ethernet\", got {other:?}")),
        }
    }

    /// The pcap data link type.
    pub fn datalink(self) -> DataLink {
        match self {
            LinkType::Raw => DataLink::RAW,
            LinkType::Ethernet => DataLink::ETHERNET,
        }
    }
}

/// What a tap does when its file already holds data (the `exists` setting).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exists {
    /// Write a new file next to it, `NAME.N.EXT`.
    Suffix,
    /// Add a new section at its end (a suffix file if another tap holds it open).
    Append,
    /// Fail the configuration.
    Refuse,
}

impl Exists {
    fn name(self) -> &'static str {
        match self {
            Exists::Suffix => "suffix",
            Exists::Append => "append",
            Exists::Refuse => "refuse",
        }
    }

    fn parse(text: &str) -> Result<Exists, String> {
        match text {
            "suffix" => Ok(Exists::Suffix),
            "append" => Ok(Exists::Append),
            "refuse" => Ok(Exists::Refuse),
            other => Err(format!("expected \"suffix\", \"append\" or \"refuse\", got {other:?}")),
        }
    }
}

/// How a tap captures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TapOptions {
    /// Link type of interface 0.
    pub linktype: LinkType,
    /// Most bytes written per data frame; 0 = no limit.
    pub snaplen: u32,
    /// True if the tap has an `out` port and passes frames on.
    pub passthrough: bool,
    /// True if frames are written (the `enabled` knob).
    pub enabled: bool,
    /// What to do with a file that holds data.
    pub exists: Exists,
    /// Keep blocks within 4 KiB pages, with padding blocks (see the module's documentation).
    pub whole_pages: bool,
}

impl Default for TapOptions {
    /// The defaults `DECL` declares (a blank for the settings to be read into).
    fn default() -> TapOptions {
        TapOptions {
            linktype: LinkType::Raw,
            snaplen: 65_535,
            passthrough: true,
            enabled: true,
            exists: Exists::Suffix,
            whole_pages: true,
        }
    }
}

/// Starts a pcapng capture on `writer`: section header, then interface 0 (data) and interface 1 (control frames).
pub fn start_capture<W: Write>(writer: W, linktype: LinkType, snaplen: u32) -> PcapResult<PcapNgWriter<W>> {
    let mut w = PcapNgWriter::new(writer)?;
    let interface = |linktype: DataLink, snaplen: u32, name: &'static str, description: &'static str| {
        InterfaceDescriptionBlock {
            linktype,
            snaplen,
            options: vec![
                InterfaceDescriptionOption::IfName(Cow::Borrowed(name)),
                InterfaceDescriptionOption::IfDescription(Cow::Borrowed(description)),
                // Timestamps in nanoseconds, as the enhanced packet blocks write them.
                InterfaceDescriptionOption::IfTsResol(9),
            ],
        }
    };
    w.write_pcapng_block(interface(linktype.datalink(), snaplen, "data", "flexstack tap: data frames"))?;
    w.write_pcapng_block(interface(DataLink::USER0, 0, "control", "flexstack tap: control frames as JSON text"))?;
    Ok(w)
}

/// Where a capture's blocks go: a file, or any writer that can cut what it holds back to a length.
pub trait CaptureSink: Write {
    /// Drops everything past `len` bytes (an incomplete block) and continues writing there.
    fn cut(&mut self, len: u64) -> io::Result<()>;
}

impl CaptureSink for File {
    fn cut(&mut self, len: u64) -> io::Result<()> {
        self.set_len(len)?;
        self.seek(SeekFrom::Start(len)).map(|_| ())
    }
}

/// A capture file opened for a tap: locked, positioned at `start`, where its new section begins.
#[derive(Debug)]
pub struct OpenedCapture {
    /// The file.
    pub file: File,
    /// Its path: the one asked for, or a suffix file next to it.
    pub path: PathBuf,
    /// Where the new section starts (0 unless appending).
    pub start: u64,
    /// What was done that the user should know (a suffix file chosen, an incomplete block cut).
    pub notes: Vec<String>,
}

/// The length of the complete blocks at the start of a pcapng file of `len` bytes; `None` if it does not start
/// with a section header.
fn complete_blocks(file: &File, len: u64) -> io::Result<Option<u64>> {
    let word = |at: u64, big: bool| -> io::Result<u32> {
        let mut b = [0u8; 4];
        file.read_exact_at(&mut b, at)?;
        Ok(if big { u32::from_be_bytes(b) } else { u32::from_le_bytes(b) })
    };
    let (mut at, mut big) = (0u64, false);
    while at + 12 <= len {
        if word(at, false)? == SECTION_HEADER {
            if at + 12 > len {
                break;
            }
            big = match word(at + 8, false)? {
                BYTE_ORDER_MAGIC => false,
                m if m.swap_bytes() == BYTE_ORDER_MAGIC => true,
                _ => break,
            };
        } else if at == 0 {
            return Ok(None);
        }
        let size = u64::from(word(at + 4, big)?);
        if size < 12 || size % 4 != 0 || at + size > len || word(at + size - 4, big)? as u64 != size {
            break;
        }
        at += size;
    }
    if at == 0 && len > 0 {
        // Not even a whole section header: a file of ours is never like that, so it is not ours.
        return Ok(if len >= 4 && word(0, false)? == SECTION_HEADER { Some(0) } else { None });
    }
    Ok(Some(at))
}

/// `dir/name.N.ext` for `dir/name.ext`.
fn suffixed(path: &Path, n: u32) -> PathBuf {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.{n}.{}", ext.to_string_lossy()),
        None => format!("{stem}.{n}"),
    };
    path.with_file_name(name)
}

/// Creates `path` if it does not exist and locks it; `Ok(None)` if it exists.
fn create_new(path: &Path) -> Result<Option<File>, String> {
    match OpenOptions::new().read(true).write(true).create_new(true).open(path) {
        Ok(file) => {
            // Nobody else can hold a file we just made.
            let _ = file.try_lock();
            Ok(Some(file))
        }
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(None),
        Err(e) => Err(format!("cannot create {path:?}: {e}")),
    }
}

/// How long a file's lock may stay held by a tap that is gone: a process forked at that moment (the daemon starts
/// `ip`, `nft`, ...) shares the open file, and with it the lock, until it executes its program.
const LOCK_GRACE: Duration = Duration::from_millis(50);

/// Locks `file`; `Ok(false)` if it stays locked by someone else for [`LOCK_GRACE`].
fn lock_soon(file: &File) -> io::Result<bool> {
    let deadline = std::time::Instant::now() + LOCK_GRACE;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(true),
            Err(TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2))
            }
            Err(TryLockError::WouldBlock) => return Ok(false),
            Err(TryLockError::Error(e)) => return Err(e),
        }
    }
}

/// Opens the capture file `path` for a new capture, never losing what it holds (see the module's documentation).
pub fn open_capture(path: &Path, exists: Exists) -> Result<OpenedCapture, String> {
    let opened = |file, path: &Path, start, notes| Ok(OpenedCapture { file, path: path.to_path_buf(), start, notes });
    if let Some(file) = create_new(path)? {
        return opened(file, path, 0, Vec::new());
    }
    let mut file =
        OpenOptions::new().read(true).write(true).open(path).map_err(|e| format!("cannot open {path:?}: {e}"))?;
    let in_use = !lock_soon(&file).map_err(|e| format!("cannot lock {path:?}: {e}"))?;
    let len = file.metadata().map_err(|e| format!("cannot read {path:?}: {e}"))?.len();
    if len == 0 && !in_use {
        // Nothing to lose.
        return opened(file, path, 0, Vec::new());
    }
    let what = if in_use { "is being written by another tap" } else { "exists" };
    if exists == Exists::Refuse {
        return Err(format!(
            "{path:?} {what}: remove it, choose another path, or set exists = \"suffix\" or \"append\""
        ));
    }
    let mut notes = Vec::new();
    if !in_use {
        // The writer is gone: cut an incomplete last block, so the file reads to its end.
        let end = complete_blocks(&file, len).map_err(|e| format!("cannot read {path:?}: {e}"))?;
        match end {
            Some(end) if end < len => {
                file.cut(end).map_err(|e| format!("cannot cut the incomplete block at the end of {path:?}: {e}"))?;
                notes.push(format!("cut an incomplete block of {} bytes at the end of {path:?}", len - end));
                if exists == Exists::Append {
                    return opened(file, path, end, notes);
                }
            }
            Some(end) if exists == Exists::Append => {
                file.seek(SeekFrom::Start(end)).map_err(|e| format!("cannot seek in {path:?}: {e}"))?;
                return opened(file, path, end, notes);
            }
            None if exists == Exists::Append => {
                return Err(format!(
                    "{path:?} exists and is not a pcapng capture: not appending to it; remove it, choose another \
                     path, or set exists = \"suffix\""
                ))
            }
            _ => {}
        }
    }
    drop(file);
    for n in 1..10_000 {
        let candidate = suffixed(path, n);
        if let Some(file) = create_new(&candidate)? {
            notes.push(format!("{path:?} {what}: capturing to {candidate:?}"));
            return opened(file, &candidate, 0, notes);
        }
    }
    Err(format!("{path:?} {what}, and so do its suffix files up to 9999"))
}

/// The `tap` module kind.
pub struct TapKind;

type P = Param<TapOptions>;

/// The kind: ports, settings, knob and meters.
const DECL: KindDecl<TapOptions, Meters> = KindDecl {
    inputs: &[PortDecl::new("in", port_type::ANY, "frames to capture")],
    outputs: &[PortDecl::new("out", port_type::ANY, "the same frames, unless `passthrough = false` (then no port)")],
    params: &[
        P::manual("path", "str", "the pcapng file, opened when the module is configured (see `exists`)", "required"),
        P::text(
            "exists",
            "when the file holds data: \"suffix\" writes NAME.N.EXT next to it, \"append\" adds a section to it, \
             \"refuse\" fails; it is never overwritten",
            "suffix",
            |o| o.exists.name().into(),
            |o, t| Exists::parse(t).map(|e| o.exists = e),
        )
        .setting(),
        P::text(
            "linktype",
            "link type of the data frames: \"raw\" (IP packets) or \"ethernet\"",
            "raw",
            |o| o.linktype.name().into(),
            |o, t| LinkType::parse(t).map(|l| o.linktype = l),
        )
        .setting(),
        P::u64(
            "snaplen",
            "bytes",
            "most bytes written per data frame; 0 = no limit",
            65_535,
            (|o| u64::from(o.snaplen), |o, v| o.snaplen = u32::try_from(v).unwrap_or(u32::MAX)),
        )
        .range(0.0, u32::MAX as f64)
        .setting(),
        P::bool("passthrough", "false: no `out` port, frames end here", true, field!(passthrough)).setting(),
        P::bool(
            "whole_pages",
            "pad so that no block straddles a 4 KiB page: a file cut by SIGKILL ends with a whole block (costs up to \
             a quarter of the file for 1,500-byte frames); false: no padding",
            true,
            field!(whole_pages),
        )
        .setting(),
        P::bool("enabled", "false passes frames without writing them", true, field!(enabled)),
    ],
    meters: &[
        MeterDecl::u64("frames_total", "frames", "frames whose block reached the file whole", |m| &mut m.frames),
        MeterDecl::u64("bytes_total", "bytes", "bytes of data frames written (after snaplen)", |m| &mut m.bytes),
        MeterDecl::u64("frames_unwritten_total", "frames", "frames lost to failed writes", |m| &mut m.unwritten),
        MeterDecl::u64(
            "frames_pending",
            "frames",
            "frames encoded and waiting for the next write (at most 50 ms)",
            |m| &mut m.pending,
        ),
        MeterDecl::u64("write_errors_total", "errors", "failed writes", |m| &mut m.errors),
        MeterDecl::new("file", ValueType::Str, "", "the file written (`path`, or a suffix file)", |m| &mut m.file),
        MeterDecl::new("error", ValueType::Str, "", "the first write error, with the path; empty if none", |m| {
            &mut m.error
        }),
    ],
    // One pcapng file: the stack runs on one data-plane worker.
    global_view: true,
    // A GSO super-packet is recorded as one long packet, as a capture on the host that sent it shows it.
    accepts_gso: true,
    ..KindDecl::new(KIND, "writes frames (and observed control frames) to a pcapng file and passes them on")
};

impl ModuleKind for TapKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(KIND);
        let mut options = TapOptions::default();
        DECL.read(&mut r, &mut options)?;
        let path = match r.string("path")? {
            Some(p) if !p.is_empty() => p,
            Some(_) => return Err(r.error("path", "must name a file, e.g. path = \"capture.pcapng\"")),
            None => {
                return Err(r.error("path", "is required: the pcapng file to write, e.g. path = \"capture.pcapng\""))
            }
        };
        // Unknown settings are rejected before the file is opened.
        r.finish()?;
        let at_path = |message: String| {
            ConfigError::new(
                settings.get("path").and_then(|s| s.location.clone()),
                format!("setting `path` of a {KIND} module: {message}"),
            )
        };
        let opened = open_capture(Path::new(&path), options.exists).map_err(at_path)?;
        for note in &opened.notes {
            tracing::info!("tap: {note}");
        }
        let OpenedCapture { mut file, path, start, .. } = opened;
        let encoder = start_capture(Vec::new(), options.linktype, options.snaplen)
            .map_err(|e| at_path(format!("cannot encode the capture's header: {e}")))?;
        if let Err(e) = file.write_all(encoder.get_ref()) {
            // Leave no partial header behind (in a new file, nothing at all).
            let _ = file.cut(start);
            return Err(at_path(format!("cannot write to {path:?}: {e}")));
        }
        let writer = CaptureWriter::new(file, encoder, start, path.display().to_string());
        Ok(Box::new(TapBuilder { writer, options }))
    }
}

/// The interface of a tap with these options.
fn interface(options: &TapOptions) -> ModuleInterface {
    let mut iface = DECL.interface(options);
    if !options.passthrough {
        iface.outputs.clear();
    }
    iface
}

struct TapBuilder {
    writer: CaptureWriter<File>,
    options: TapOptions,
}

impl ModuleBuilder for TapBuilder {
    fn interface(&self) -> ModuleInterface {
        interface(&self.options)
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        Box::new(Tap::new(self.writer, self.options, vars))
    }
}

/// The tap's meters.
#[derive(Default)]
struct Meters {
    frames: Meter,
    bytes: Meter,
    unwritten: Meter,
    pending: Meter,
    errors: Meter,
    file: Meter,
    error: Meter,
}

/// A capture being written: blocks are encoded into a buffer and written to the sink whole.
pub struct CaptureWriter<S: CaptureSink> {
    sink: S,
    /// Encodes blocks into its buffer (it holds the section's interfaces).
    encoder: PcapNgWriter<Vec<u8>>,
    /// Per buffered frame: where its block ends in the buffer, and its data bytes.
    ends: Vec<(usize, u64)>,
    /// Bytes of the sink that hold complete blocks.
    committed: u64,
    /// The file's path, for errors.
    path: String,
    /// True once an incomplete block could not be cut: nothing more is written.
    broken: bool,
}

impl<S: CaptureSink> CaptureWriter<S> {
    /// A writer appending blocks to `sink`, which holds `committed` bytes of complete blocks (the section header
    /// `encoder` wrote included); the encoder's buffer is emptied.
    pub fn new(sink: S, mut encoder: PcapNgWriter<Vec<u8>>, start: u64, path: String) -> CaptureWriter<S> {
        let committed = start + encoder.get_ref().len() as u64;
        encoder.get_mut().clear();
        CaptureWriter { sink, encoder, ends: Vec::new(), committed, path, broken: false }
    }

    /// A capture started on `sink` (empty): its header is written at once.
    pub fn start(mut sink: S, linktype: LinkType, snaplen: u32, path: &str) -> io::Result<CaptureWriter<S>> {
        let encoder = start_capture(Vec::new(), linktype, snaplen).map_err(io::Error::other)?;
        sink.write_all(encoder.get_ref())?;
        Ok(CaptureWriter::new(sink, encoder, 0, path.to_string()))
    }

    fn buffered(&self) -> usize {
        self.encoder.get_ref().len()
    }
}

/// The outcome of one flush.
#[derive(Debug, Default, PartialEq, Eq)]
struct Flushed {
    frames: u64,
    bytes: u64,
    unwritten: u64,
    error: Option<String>,
}

impl<S: CaptureSink> CaptureWriter<S> {
    /// Writes the buffered blocks; a block written in part is cut off again.
    fn flush(&mut self) -> Flushed {
        let mut out = Flushed::default();
        let buf = std::mem::take(self.encoder.get_mut());
        if buf.is_empty() {
            *self.encoder.get_mut() = buf;
            return out;
        }
        let mut done = 0;
        let mut failure = None;
        if self.broken {
            failure = Some(format!("{}: not written since an incomplete block could not be cut", self.path));
        } else {
            while done < buf.len() {
                match self.sink.write(&buf[done..]) {
                    Ok(0) => {
                        failure = Some(describe(&self.path, &io::Error::from(ErrorKind::WriteZero)));
                        break;
                    }
                    Ok(n) => done += n,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => {
                        failure = Some(describe(&self.path, &e));
                        break;
                    }
                }
            }
        }
        let whole = self.ends.iter().take_while(|(end, _)| *end <= done).count();
        let kept = if whole == 0 { 0 } else { self.ends[whole - 1].0 };
        out.frames = whole as u64;
        out.bytes = self.ends[..whole].iter().map(|(_, b)| b).sum();
        out.unwritten = (self.ends.len() - whole) as u64;
        if done > kept {
            if let Err(e) = self.sink.cut(self.committed + kept as u64) {
                self.broken = true;
                failure = Some(format!(
                    "{}; and the incomplete block could not be cut: {}",
                    failure.unwrap_or_default(),
                    describe(&self.path, &e)
                ));
            }
        }
        self.committed += kept as u64;
        out.error = failure;
        self.ends.clear();
        let mut buf = buf;
        buf.clear();
        *self.encoder.get_mut() = buf;
        out
    }
}

/// A write error, with the path (the error's text ends with its errno: "(os error 28)").
fn describe(path: &str, e: &io::Error) -> String {
    format!("cannot write to {path}: {e}")
}

/// A running tap, writing to any [`CaptureSink`] (a file when made by [`TapKind`]).
pub struct Tap<S: CaptureSink> {
    writer: CaptureWriter<S>,
    options: TapOptions,
    last_flush: Option<Time>,
    /// True once a write error was logged (it is logged once).
    logged: bool,
    m: Meters,
}

impl<S: CaptureSink> Tap<S> {
    /// A tap writing to `writer`; `vars` holds the variables of the tap interface.
    pub fn new(writer: CaptureWriter<S>, options: TapOptions, vars: &ModuleVars) -> Tap<S> {
        DECL.publish(&options, vars);
        let m: Meters = DECL.meters(vars);
        m.file.store(&Value::Str(writer.path.clone()));
        Tap { writer, options, last_flush: None, logged: false, m }
    }

    /// Encodes one frame into the buffer.
    fn write(&mut self, frame: &Frame, now: Time) {
        let timestamp = Duration::from_nanos(now.as_nanos());
        let (block, bytes) = match frame {
            Frame::Data(p) => {
                let data = p.data();
                let cap = match self.options.snaplen {
                    0 => data.len(),
                    n => data.len().min(n as usize),
                };
                let block = EnhancedPacketBlock {
                    interface_id: DATA_INTERFACE,
                    timestamp,
                    original_len: u32::try_from(data.len()).unwrap_or(u32::MAX),
                    data: Cow::Borrowed(&data[..cap]),
                    options: Vec::new(),
                };
                (block, cap as u64)
            }
            Frame::Control(cf) => {
                let text = control_text(cf);
                let block = EnhancedPacketBlock {
                    interface_id: CONTROL_INTERFACE,
                    timestamp,
                    original_len: u32::try_from(text.len()).unwrap_or(u32::MAX),
                    data: Cow::Owned(text.into_bytes()),
                    options: Vec::new(),
                };
                (block, 0)
            }
        };
        let w = &mut self.writer;
        let before = w.buffered();
        match w.encoder.write_pcapng_block(block) {
            Ok(_) => {
                let size = (w.buffered() - before) as u64;
                let pad = if self.options.whole_pages { padding_before(w.committed + before as u64, size) } else { 0 };
                if pad > 0 {
                    w.encoder.get_mut().splice(before..before, padding_block(pad));
                }
                w.ends.push((w.buffered(), bytes))
            }
            Err(e) => {
                // Cannot happen for the two interfaces the section declares; keep the buffer whole blocks anyway.
                w.encoder.get_mut().truncate(before);
                self.m.unwritten.add(1);
                let error = format!("cannot encode a block for {}: {e}", w.path);
                self.record_error(error);
            }
        }
        if self.writer.buffered() >= FLUSH_BYTES {
            self.flush(None);
        }
    }

    fn flush(&mut self, now: Option<Time>) {
        if let Some(t) = now {
            self.last_flush = Some(t);
        }
        let f = self.writer.flush();
        self.m.frames.add(f.frames);
        self.m.bytes.add(f.bytes);
        self.m.unwritten.add(f.unwritten);
        self.m.pending.set(0);
        if let Some(error) = f.error {
            self.m.errors.add(1);
            self.record_error(error);
        }
    }

    /// Keeps the first error in the `error` meter and logs it (once).
    fn record_error(&mut self, error: String) {
        if self.logged {
            return;
        }
        self.logged = true;
        tracing::warn!("tap: {error}; frames that cannot be written are counted in frames_unwritten_total");
        self.m.error.store(&Value::Str(error));
    }
}

impl<S: CaptureSink> Module for Tap<S> {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        let now = out.now();
        if self.options.enabled {
            for f in input.iter() {
                self.write(f, now);
            }
        }
        if self.options.passthrough {
            out.emit_all(0, input);
        } else {
            // Consumed, not dropped: the frames simply end here.
            input.clear();
        }
        match self.last_flush {
            None => self.last_flush = Some(now),
            Some(t) if now - t >= FLUSH_INTERVAL => self.flush(Some(now)),
            Some(_) => {}
        }
        self.m.pending.set(self.writer.ends.len() as u64);
    }

    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        let now = out.now();
        self.flush(Some(now));
        Some(now + FLUSH_INTERVAL)
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        DECL.write(&mut self.options, knob, value)
    }
}

impl<S: CaptureSink> Drop for Tap<S> {
    fn drop(&mut self) {
        self.flush(None);
    }
}

/// One line of JSON describing a control frame.
pub fn control_text(cf: &ControlFrame) -> String {
    serde_json::to_string(cf).unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::*;
    use flexstack_core::ControlOp;
    use flexstack_core::{PacketPool, Switch};
    use pcap_file::pcapng::{Block, PcapNgReader};
    use std::path::Path;

    /// What a capture file holds: the interfaces' link types and (interface, timestamp ns, bytes) per packet.
    struct Capture {
        linktypes: Vec<DataLink>,
        snaplens: Vec<u32>,
        packets: Vec<(u32, u64, Vec<u8>, u32)>,
    }

    fn read_capture(path: &Path) -> Capture {
        let mut r = PcapNgReader::new(File::open(path).unwrap()).unwrap();
        let mut c = Capture { linktypes: Vec::new(), snaplens: Vec::new(), packets: Vec::new() };
        while let Some(block) = r.next_block() {
            match block.unwrap() {
                Block::InterfaceDescription(i) => {
                    c.linktypes.push(i.linktype);
                    c.snaplens.push(i.snaplen);
                    assert!(i.options.contains(&InterfaceDescriptionOption::IfTsResol(9)));
                }
                Block::EnhancedPacket(p) => {
                    c.packets.push((p.interface_id, p.timestamp.as_nanos() as u64, p.data.to_vec(), p.original_len))
                }
                Block::SectionHeader(_) => {}
                Block::Unknown(b) if b.type_ == PADDING_BLOCK => {}
                other => panic!("unexpected block {other:?}"),
            }
        }
        c
    }

    fn path_arg(path: &Path) -> String {
        format!("path={}", path.display())
    }

    #[test]
    fn inline_tap_writes_a_readable_capture_and_passes_frames() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inline.pcapng");
        let mut sw = Switch::default();
        sw.apply(vec![load("t", "tap", &[&path_arg(&path), "snaplen=16"]), load("s", "sink", &[]), link("t -> s")])
            .unwrap();
        let mut b = packets(sw.pool(), 3, 40);
        sw.inject("t", "in", &mut b).unwrap();
        sw.run(Time::from_millis(5));
        assert_eq!(u64_var(&sw, "module.s.frames_total"), 3, "frames pass through");
        assert_eq!(u64_var(&sw, "module.t.frames_total"), 0, "counted once in the file");
        // The poll after 50 ms flushes while the module is still running.
        sw.run(Time::from_millis(60));
        assert_eq!(u64_var(&sw, "module.t.frames_total"), 3);
        assert_eq!(u64_var(&sw, "module.t.bytes_total"), 3 * 16);
        assert_eq!(u64_var(&sw, "module.t.write_errors_total"), 0);
        let c = read_capture(&path);
        assert_eq!(c.linktypes, [DataLink::RAW, DataLink::USER0]);
        assert_eq!(c.snaplens[0], 16);
        assert_eq!(c.packets.len(), 3);
        for (i, (iface, ts, data, orig)) in c.packets.iter().enumerate() {
            assert_eq!(*iface, DATA_INTERFACE);
            assert_eq!(*ts, 5_000_000);
            assert_eq!(data.len(), 16);
            assert_eq!(data[0], i as u8);
            assert_eq!(*orig, 40);
        }
    }

    #[test]
    fn tap_on_a_fan_out_link_records_data_and_control_frames() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fanout.pcapng");
        let mut sw = Switch::default();
        sw.apply(vec![
            load("src", "source", &["count=5", "rate=1000", "size=60"]),
            load("sw", "select", &["outputs=2"]),
            load("s", "sink", &[]),
            load("t", "tap", &[&path_arg(&path), "linktype=\"ethernet\"", "passthrough=false"]),
            link("src -> sw, t"),
            link("sw[0] -> s"),
            link("sw[ctl] -> t"),
        ])
        .unwrap();
        run_every(&mut sw, Time::ZERO, Time::from_millis(10), Duration::from_millis(1));
        sw.send_control(ControlFrame {
            op: ControlOp::Exec,
            sender: "control".into(),
            dest: "sw".into(),
            serial: 42,
            param: "select".into(),
            value: Value::U64(1),
        });
        sw.run(Time::from_millis(11));
        let inbox = sw.take_control_inbox();
        assert_eq!(inbox.len(), 1);
        assert_eq!(inbox[0].op, ControlOp::ExecReply);
        assert_eq!(u64_var(&sw, "module.s.frames_total"), 5);
        sw.run(Time::from_millis(61));
        assert_eq!(u64_var(&sw, "module.t.frames_total"), 6);
        assert_eq!(u64_var(&sw, "module.t.bytes_total"), 5 * 60);
        assert_eq!(u64_var(&sw, "module.t.frames_dropped_total"), 0, "consumed, not dropped");
        drop(sw);

        let c = read_capture(&path);
        assert_eq!(c.linktypes, [DataLink::ETHERNET, DataLink::USER0]);
        assert_eq!(c.packets.len(), 6);
        for (i, (iface, ts, data, _)) in c.packets[..5].iter().enumerate() {
            assert_eq!(*iface, DATA_INTERFACE);
            assert_eq!(*ts, i as u64 * 1_000_000);
            assert_eq!(data.len(), 60);
            assert_eq!(data[..8], (i as u64).to_be_bytes());
        }
        let (iface, ts, text, _) = &c.packets[5];
        assert_eq!(*iface, CONTROL_INTERFACE);
        assert_eq!(*ts, 11_000_000);
        assert_eq!(
            std::str::from_utf8(text).unwrap(),
            r#"{"op":"exec_reply","sender":"sw","dest":"control","serial":42,"param":"select","value":0}"#
        );
    }

    #[test]
    fn enabled_knob_and_unlinked_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("knob.pcapng");
        let mut sw = Switch::default();
        sw.apply(vec![load("t", "tap", &[&path_arg(&path), "enabled=false"])]).unwrap();
        assert_eq!(var(&sw, "module.t.enabled"), Value::Bool(false));
        let mut b = packets(sw.pool(), 2, 10);
        sw.inject("t", "in", &mut b).unwrap();
        sw.run(Time::from_millis(1));
        assert_eq!(u64_var(&sw, "module.t.frames_total"), 0);
        // `out` is unlinked: the switch counts the passed frames as dropped there.
        assert_eq!(u64_var(&sw, "module.t.port.out.frames_dropped_total"), 2);
        sw.apply(vec![knob("t", "enabled", Value::Bool(true))]).unwrap();
        let mut b = packets(sw.pool(), 3, 10);
        sw.inject("t", "in", &mut b).unwrap();
        sw.run(Time::from_millis(2));
        sw.run(Time::from_millis(100));
        assert_eq!(u64_var(&sw, "module.t.frames_total"), 3);
        drop(sw);
        assert_eq!(read_capture(&path).packets.len(), 3);
    }

    /// A sink that accepts `room` bytes, then fails; it keeps what it holds.
    struct Failing {
        data: Vec<u8>,
        room: usize,
    }

    impl Write for Failing {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.room == 0 {
                return Err(std::io::Error::from_raw_os_error(28));
            }
            let n = buf.len().min(self.room);
            self.room -= n;
            self.data.extend_from_slice(&buf[..n]);
            Ok(n)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl CaptureSink for Failing {
        fn cut(&mut self, len: u64) -> std::io::Result<()> {
            self.room += self.data.len() - len as usize;
            self.data.truncate(len as usize);
            Ok(())
        }
    }

    fn options() -> TapOptions {
        TapOptions { snaplen: 0, ..TapOptions::default() }
    }

    #[test]
    fn a_full_disk_keeps_whole_blocks_counts_what_is_lost_and_recovers() {
        let options = options();
        let vars = ModuleVars::new(&interface(&options).vars);
        // Room for the headers and one and a half 100-byte packets (132-byte blocks), then the disk is full.
        let header = start_capture(Vec::new(), LinkType::Raw, 0).unwrap().into_inner().len();
        let sink = Failing { data: Vec::new(), room: header + 132 + 66 };
        let writer = CaptureWriter::start(sink, LinkType::Raw, 0, "/full/x.pcapng").unwrap();
        let mut tap = Tap::new(writer, options, &vars);
        assert_eq!(vars.cell("file").unwrap().get(), Value::Str("/full/x.pcapng".into()));
        let pool = PacketPool::default();
        let mut ports = vec![Vec::new()];
        let mut control = Vec::new();
        let mut serial = 0;
        let mut input = packets(&pool, 10, 100);
        let mut out = Output::detached(Time::from_millis(1), "t", &pool, &mut ports, &mut control, &mut serial);
        tap.process(0, &mut input, &mut out);
        assert_eq!(ports[0].len(), 10, "frames still pass");
        assert_eq!(vars.meter("frames_total").get(), 0, "nothing is counted before it reaches the file");
        let mut out = Output::detached(Time::from_millis(100), "t", &pool, &mut ports, &mut control, &mut serial);
        assert_eq!(tap.poll(&mut out), Some(Time::from_millis(150)));
        assert_eq!(vars.meter("frames_total").get(), 1);
        assert_eq!(vars.meter("frames_unwritten_total").get(), 9);
        assert_eq!(vars.meter("write_errors_total").get(), 1);
        let error = vars.cell("error").unwrap().get();
        let Value::Str(error) = error else { panic!("error is text") };
        assert!(error.contains("/full/x.pcapng") && error.contains("os error 28"), "{error}");
        // The half-written block was cut: the sink holds the header and one whole block, and reads as a capture.
        assert_eq!(tap.writer.sink.data.len(), header + 132);
        let mut r = PcapNgReader::new(&tap.writer.sink.data[..]).unwrap();
        let mut blocks = 0;
        while let Some(b) = r.next_block() {
            b.unwrap();
            blocks += 1;
        }
        assert_eq!(blocks, 2 + 1, "two interfaces and one packet after the section header");

        // Space comes back: later frames are written, the first error stays reported.
        tap.writer.sink.room = 1000;
        let mut input = packets(&pool, 2, 100);
        let mut out = Output::detached(Time::from_millis(200), "t", &pool, &mut ports, &mut control, &mut serial);
        tap.process(0, &mut input, &mut out);
        let mut out = Output::detached(Time::from_millis(300), "t", &pool, &mut ports, &mut control, &mut serial);
        tap.poll(&mut out);
        assert_eq!(vars.meter("frames_total").get(), 3);
        assert_eq!(vars.meter("frames_unwritten_total").get(), 9);
        assert_eq!(tap.writer.sink.data.len(), header + 3 * 132);
        assert_eq!(vars.cell("error").unwrap().get(), Value::Str(error));
    }

    #[test]
    fn big_bursts_are_written_in_whole_blocks_before_the_interval() {
        // Without padding, so that the blocks are simply one after the other.
        let options = TapOptions { whole_pages: false, ..options() };
        let vars = ModuleVars::new(&interface(&options).vars);
        let writer =
            CaptureWriter::start(Failing { data: Vec::new(), room: usize::MAX / 2 }, LinkType::Raw, 0, "m").unwrap();
        let header = writer.committed as usize;
        let mut tap = Tap::new(writer, options, &vars);
        let pool = PacketPool::default();
        let (mut ports, mut control, mut serial) = (vec![Vec::new()], Vec::new(), 0);
        let mut out = Output::detached(Time::from_millis(1), "t", &pool, &mut ports, &mut control, &mut serial);
        let mut input = packets(&pool, 100, 1000);
        tap.process(0, &mut input, &mut out);
        // 100 blocks of 1032 bytes: 64 KiB fill after 64 of them, which are written at once.
        assert_eq!(vars.meter("frames_total").get(), 64);
        assert_eq!(tap.writer.sink.data.len(), header + 64 * 1032);
    }

    #[test]
    fn a_file_cut_at_any_page_boundary_ends_with_a_whole_block() {
        let options = options();
        let vars = ModuleVars::new(&interface(&options).vars);
        let writer =
            CaptureWriter::start(Failing { data: Vec::new(), room: usize::MAX / 2 }, LinkType::Raw, 0, "p").unwrap();
        let mut tap = Tap::new(writer, options, &vars);
        let pool = PacketPool::default();
        let (mut ports, mut control, mut serial) = (vec![Vec::new()], Vec::new(), 0);
        // Frames of every size from 1 to 1500 bytes (blocks of 36 to 1532), in a few flushes.
        let mut sizes = (1..=1500).map(|n| (n * 7919) % 1500 + 1);
        for flush in 1..=20u64 {
            let mut input: Batch = Vec::new();
            for size in sizes.by_ref().take(75) {
                input.extend(packets(&pool, 1, size));
            }
            let mut out = Output::detached(Time::from_millis(flush), "t", &pool, &mut ports, &mut control, &mut serial);
            tap.process(0, &mut input, &mut out);
            tap.flush(None);
        }
        assert_eq!(vars.meter("frames_total").get(), 1500);
        let data = tap.writer.sink.data.clone();
        assert!(data.len() as u64 > 100 * PAGE, "{}", data.len());
        // Walk the blocks: every page boundary is a block boundary, and padding is all there is besides packets.
        let (mut at, mut padding, mut boundaries) = (0usize, 0usize, std::collections::BTreeSet::new());
        while at < data.len() {
            boundaries.insert(at);
            let word = |i: usize| u32::from_ne_bytes(data[i..i + 4].try_into().unwrap());
            let (kind, len) = (word(at), word(at + 4) as usize);
            assert_eq!(word(at + len - 4) as usize, len);
            if kind == PADDING_BLOCK {
                padding += len;
                assert!(data[at + 8..at + len - 4].iter().all(|b| *b == 0));
            }
            at += len;
        }
        for page in (0..data.len()).step_by(PAGE as usize) {
            assert!(boundaries.contains(&page), "the page at {page} starts inside a block");
        }
        assert!(padding < data.len() / 10, "padding {padding} of {}", data.len());
        let mut r = PcapNgReader::new(&data[..]).unwrap();
        let mut frames = 0;
        while let Some(b) = r.next_block() {
            match b.unwrap() {
                Block::EnhancedPacket(_) => frames += 1,
                Block::Unknown(b) => assert_eq!(b.type_, PADDING_BLOCK),
                _ => {}
            }
        }
        assert_eq!(frames, 1500);
        assert_eq!(padding_before(4096 - 40, 40), 0, "fills the page");
        assert_eq!(padding_before(4096 - 40, 28), 0, "leaves room for a padding block");
        assert_eq!(padding_before(4096 - 40, 36), 40, "would leave 4 bytes: padded to the page's end");
        assert_eq!(padding_before(4096 - 40, 32), 40, "would leave 8 bytes: padded to the page's end");
        assert_eq!(padding_before(4096 - 40, 100), 40, "would straddle: padded");
        assert_eq!(padding_before(8192 - 8, 100), 0, "8 bytes left: cannot pad");
        assert_eq!(padding_before(0, 9000), 0, "longer than a page: cannot help");
    }

    #[test]
    fn an_existing_capture_is_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.pcapng");
        let first = open_capture(&path, Exists::Suffix).unwrap();
        assert_eq!((first.path.as_path(), first.start), (path.as_path(), 0));
        let mut w = CaptureWriter::start(first.file, LinkType::Raw, 0, "c").unwrap();
        let pool = PacketPool::default();
        for (i, p) in packets(&pool, 3, 50).iter().enumerate() {
            let Frame::Data(p) = p else { unreachable!() };
            let block = EnhancedPacketBlock {
                interface_id: 0,
                timestamp: Duration::from_nanos(i as u64),
                original_len: 50,
                data: Cow::Borrowed(p.data()),
                options: Vec::new(),
            };
            w.encoder.write_pcapng_block(block).unwrap();
            w.ends.push((w.buffered(), 50));
        }
        assert_eq!(w.flush().frames, 3);
        // While the first writer holds it, even "append" writes a suffix file; "refuse" refuses.
        let busy = open_capture(&path, Exists::Append).unwrap();
        assert_eq!(busy.path, dir.path().join("c.1.pcapng"));
        let e = open_capture(&path, Exists::Refuse).unwrap_err();
        assert!(e.contains("being written by another tap") && e.contains("exists = \"suffix\""), "{e}");
        let len = std::fs::metadata(&path).unwrap().len();
        drop(w);
        drop(busy);

        // The writer died in the middle of a block: the tail is cut, and a suffix file is the next capture.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&[1, 0, 0, 0, 200, 0, 0, 0, 9, 9]).unwrap();
        drop(f);
        let e = open_capture(&path, Exists::Refuse).unwrap_err();
        assert!(e.contains("exists: remove it"), "{e}");
        let next = open_capture(&path, Exists::Suffix).unwrap();
        assert_eq!(next.path, dir.path().join("c.2.pcapng"), "c.1 exists (empty but locked until now)");
        assert!(next.notes.iter().any(|n| n.contains("cut an incomplete block of 10 bytes")), "{:?}", next.notes);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), len);
        assert_eq!(read_capture(&path).packets.len(), 3);

        // "append" adds a section after the complete blocks; both sections read back.
        let appended = open_capture(&path, Exists::Append).unwrap();
        assert_eq!((appended.path.as_path(), appended.start), (path.as_path(), len));
        let encoder = start_capture(Vec::new(), LinkType::Ethernet, 0).unwrap();
        let mut file = appended.file;
        file.write_all(encoder.get_ref()).unwrap();
        drop(file);
        let c = read_capture(&path);
        assert_eq!(c.linktypes, [DataLink::RAW, DataLink::USER0, DataLink::ETHERNET, DataLink::USER0]);
        assert_eq!(c.packets.len(), 3);

        // A file that is not a capture is never appended to.
        let other = dir.path().join("notes.txt");
        std::fs::write(&other, "hello").unwrap();
        assert!(open_capture(&other, Exists::Append).unwrap_err().contains("not a pcapng capture"));
        assert_eq!(open_capture(&other, Exists::Suffix).unwrap().path, dir.path().join("notes.1.txt"));
        assert_eq!(std::fs::read(&other).unwrap(), b"hello");
        assert_eq!(suffixed(Path::new("/a/b"), 3), Path::new("/a/b.3"));
    }

    #[test]
    fn a_lock_let_go_of_within_the_grace_is_not_a_file_in_use() {
        // As when a process forked by the daemon shares the file of a tap just unloaded until it executes.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("g.pcapng");
        std::fs::write(&path, start_capture(Vec::new(), LinkType::Raw, 0).unwrap().get_ref()).unwrap();
        let held = File::open(&path).unwrap();
        held.lock().unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(10));
            drop(held);
        });
        let opened = open_capture(&path, Exists::Append).unwrap();
        release.join().unwrap();
        assert_eq!(opened.path, path, "appended to, not a suffix file: {:?}", opened.notes);
        drop(opened);
        let held = File::open(&path).unwrap();
        held.lock().unwrap();
        assert_eq!(open_capture(&path, Exists::Append).unwrap().path, dir.path().join("g.1.pcapng"));
    }

    #[test]
    fn control_text_is_json() {
        let cf = ControlFrame {
            op: ControlOp::Error,
            sender: "a".into(),
            dest: "b\"c".into(),
            serial: 3,
            param: "p\n".into(),
            value: Value::Str("bad \\ thing\u{1}".into()),
        };
        assert_eq!(
            control_text(&cf),
            r#"{"op":"error","sender":"a","dest":"b\"c","serial":3,"param":"p\n","value":"bad \\ thing\u0001"}"#
        );
        let cf = ControlFrame { op: ControlOp::ReadParamReply, value: Value::F64(f64::NAN), ..cf };
        assert!(control_text(&cf).ends_with(r#""value":null}"#));
    }

    #[test]
    fn settings_errors_are_located() {
        assert_config_error("[modules.t]\nkind = \"tap\"\nlinktype = \"raw\"\n", None, &["`path`", "required"]);

        assert_config_error(
            "[modules.t]\nkind = \"tap\"\n\npath = \"/nonexistent-dir/x/y.pcapng\"\n",
            Some(4),
            &["cannot create"],
        );

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("never.pcapng");
        let text =
            format!("[modules.t]\nkind = \"tap\"\npath = {:?}\nlinktype = \"wifi\"\n", path.display().to_string());
        assert_config_error(&text, Some(4), &["\"raw\" or \"ethernet\""]);

        let text = format!("[modules.t]\nkind = \"tap\"\npath = {:?}\nsnap = 5\n", path.display().to_string());
        assert_config_error(&text, Some(4), &["unknown setting `snap`"]);
        assert!(!path.exists(), "a rejected configuration creates no file");
    }
}
