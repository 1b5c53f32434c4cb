//! `tap`: writes every frame it receives to a pcapng file, and passes the frames on.
//!
//! The file is created (or truncated) when the module is configured, and starts with a section header and two
//! interface description blocks: interface 0 for data frames, with the link type of the `linktype` setting, and
//! interface 1, link type `USER0` (147), for control frames. A data frame is written as an enhanced packet block on
//! interface 0 (cut to `snaplen` bytes, with its full length recorded); a control frame (e.g. when the tap is linked
//! to another module's `ctl` port) is written on interface 1 as one line of JSON text:
//! `{"op":"exec_reply","sender":"sw","dest":"control","serial":7,"param":"select","value":0}`.
//!
//! Timestamps are the switch's `now` in nanoseconds (the interfaces declare nanosecond resolution); on the daemon
//! that clock is monotonic, so they are relative to its origin rather than to 1970.
//!
//! Writing goes through a buffer, flushed after a `process` call when at least 50 ms (of `now`) have passed since
//! the last flush, on every poll, and when the module is dropped. The switch polls a module only when it asked to
//! be and `process` cannot ask, so the tap asks to be polled every 50 ms (a heartbeat) so buffered frames reach the
//! file within about 50 ms even when traffic stops. An I/O error never stops traffic: it is counted and the tap
//! keeps going.
//!
//! Used inline, frames continue on `out`. As an extra receiver of a fan-out link, either leave `out` unlinked (the
//! switch then counts the frames as dropped on it) or set `passthrough = false`: the tap then has no output and lets
//! the frames go without counting them as drops. Its ports, settings, knob and meters are declared once, in `DECL`
//! below; docs/modules.md lists them.

use flexstack_core::module::port_type;
use flexstack_core::{
    field, kind_from_decl, Batch, ConfigError, ControlFrame, Frame, KindDecl, Meter, MeterDecl, Module, ModuleBuilder,
    ModuleInterface, ModuleKind, ModuleVars, Output, Param, PortDecl, Settings, Time, Value,
};
use pcap_file::pcapng::blocks::enhanced_packet::EnhancedPacketBlock;
use pcap_file::pcapng::blocks::interface_description::{InterfaceDescriptionBlock, InterfaceDescriptionOption};
use pcap_file::pcapng::PcapNgWriter;
use pcap_file::{DataLink, PcapResult};
use std::borrow::Cow;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::time::Duration;

/// The kind's name in stack files.
pub const KIND: &str = "tap";

/// Longest time buffered frames wait before they are flushed to the file.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(50);

/// The pcapng interface id of data frames.
pub const DATA_INTERFACE: u32 = 0;

/// The pcapng interface id of control frames.
pub const CONTROL_INTERFACE: u32 = 1;

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

/// The `tap` module kind.
pub struct TapKind;

type P = Param<TapOptions>;

/// The kind: ports, settings, knob and meters.
const DECL: KindDecl<TapOptions, Meters> = KindDecl {
    inputs: &[PortDecl::new("in", port_type::ANY, "frames to capture")],
    outputs: &[PortDecl::new("out", port_type::ANY, "the same frames, unless `passthrough = false` (then no port)")],
    params: &[
        P::manual("path", "str", "the pcapng file, created or truncated when the module is configured", "required"),
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
        P::bool("enabled", "false passes frames without writing them", true, field!(enabled)),
    ],
    meters: &[
        MeterDecl::u64("frames_total", "frames", "frames written to the capture", |m| &mut m.frames),
        MeterDecl::u64("bytes_total", "bytes", "bytes of data frames written (after snaplen)", |m| &mut m.bytes),
        MeterDecl::u64("write_errors_total", "errors", "failed writes and flushes", |m| &mut m.errors),
    ],
    ..KindDecl::new(KIND, "writes frames (and observed control frames) to a pcapng file and passes them on")
};

impl ModuleKind for TapKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(KIND);
        let mut options = TapOptions { linktype: LinkType::Raw, snaplen: 0, passthrough: true, enabled: true };
        DECL.read(&mut r, &mut options)?;
        let path = match r.string("path")? {
            Some(p) if !p.is_empty() => p,
            Some(_) => return Err(r.error("path", "must name a file, e.g. path = \"capture.pcapng\"")),
            None => {
                return Err(r.error("path", "is required: the pcapng file to write, e.g. path = \"capture.pcapng\""))
            }
        };
        // Unknown settings are rejected before the file is created (and truncated).
        r.finish()?;
        let at_path = |message: String| {
            ConfigError::new(
                settings.get("path").and_then(|s| s.location.clone()),
                format!("setting `path` of a {KIND} module: {message}"),
            )
        };
        let file = File::create(&path).map_err(|e| at_path(format!("cannot create {path:?}: {e}")))?;
        let writer = start_capture(BufWriter::new(file), options.linktype, options.snaplen)
            .map_err(|e| at_path(format!("cannot write to {path:?}: {e}")))?;
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
    writer: PcapNgWriter<BufWriter<File>>,
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
    errors: Meter,
}

/// A running tap, writing to any [`Write`] (a buffered file when made by [`TapKind`]).
pub struct Tap<W: Write> {
    writer: PcapNgWriter<W>,
    options: TapOptions,
    dirty: bool,
    last_flush: Option<Time>,
    m: Meters,
}

impl<W: Write> Tap<W> {
    /// A tap writing to a capture started with [`start_capture`]; `vars` holds the variables of the tap interface.
    pub fn new(writer: PcapNgWriter<W>, options: TapOptions, vars: &ModuleVars) -> Tap<W> {
        DECL.publish(&options, vars);
        Tap { writer, options, dirty: false, last_flush: None, m: DECL.meters(vars) }
    }

    /// Writes one frame; returns (frames, bytes) written, counting a failure in `write_errors_total`.
    fn write(&mut self, frame: &Frame, now: Time) -> (u64, u64) {
        let timestamp = Duration::from_nanos(now.as_nanos());
        let result = match frame {
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
                self.writer.write_pcapng_block(block).map(|_| cap as u64)
            }
            Frame::Control(cf) => {
                let text = control_text(cf);
                let block = EnhancedPacketBlock {
                    interface_id: CONTROL_INTERFACE,
                    timestamp,
                    original_len: u32::try_from(text.len()).unwrap_or(u32::MAX),
                    data: Cow::Borrowed(text.as_bytes()),
                    options: Vec::new(),
                };
                self.writer.write_pcapng_block(block).map(|_| 0)
            }
        };
        self.dirty = true;
        match result {
            Ok(bytes) => (1, bytes),
            Err(_) => {
                self.m.errors.add(1);
                (0, 0)
            }
        }
    }

    fn flush(&mut self, now: Option<Time>) {
        if let Some(t) = now {
            self.last_flush = Some(t);
        }
        if !self.dirty {
            return;
        }
        self.dirty = false;
        if self.writer.get_mut().flush().is_err() {
            self.m.errors.add(1);
        }
    }
}

impl<W: Write> Module for Tap<W> {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        let now = out.now();
        let (mut frames, mut bytes) = (0, 0);
        if self.options.enabled {
            for f in input.iter() {
                let (n, b) = self.write(f, now);
                frames += n;
                bytes += b;
            }
        }
        self.m.frames.add(frames);
        self.m.bytes.add(bytes);
        if self.options.passthrough {
            out.emit_all(0, input);
        } else {
            // Consumed, not dropped: the frames simply end here.
            input.clear();
        }
        match self.last_flush {
            None => self.last_flush = Some(now),
            Some(t) if self.dirty && now - t >= FLUSH_INTERVAL => self.flush(Some(now)),
            Some(_) => {}
        }
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

impl<W: Write> Drop for Tap<W> {
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
        assert_eq!(u64_var(&sw, "module.t.frames_total"), 3);
        assert_eq!(u64_var(&sw, "module.t.bytes_total"), 3 * 16);
        assert_eq!(u64_var(&sw, "module.t.write_errors_total"), 0);
        // The poll after 50 ms flushes while the module is still running.
        sw.run(Time::from_millis(60));
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
        assert_eq!(u64_var(&sw, "module.t.frames_total"), 3);
        drop(sw);
        assert_eq!(read_capture(&path).packets.len(), 3);
    }

    /// A writer that accepts `room` bytes, then fails.
    struct Failing {
        room: usize,
    }

    impl Write for Failing {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.room == 0 {
                return Err(std::io::Error::other("disk full"));
            }
            let n = buf.len().min(self.room);
            self.room -= n;
            Ok(n)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            if self.room == 0 {
                return Err(std::io::Error::other("disk full"));
            }
            Ok(())
        }
    }

    #[test]
    fn io_errors_are_counted_not_fatal() {
        let options = TapOptions { linktype: LinkType::Raw, snaplen: 0, passthrough: true, enabled: true };
        let vars = ModuleVars::new(&interface(&options).vars);
        // Room for the headers and one 100-byte packet (a 132-byte block), then the disk is full.
        let header = start_capture(Vec::new(), LinkType::Raw, 0).unwrap().into_inner().len();
        let writer = start_capture(Failing { room: header + 132 }, LinkType::Raw, 0).unwrap();
        let mut tap = Tap::new(writer, options, &vars);
        let pool = PacketPool::default();
        let mut ports = vec![Vec::new()];
        let mut control = Vec::new();
        let mut serial = 0;
        let mut input = packets(&pool, 10, 100);
        let mut out = Output::detached(Time::from_millis(1), "t", &pool, &mut ports, &mut control, &mut serial);
        tap.process(0, &mut input, &mut out);
        assert_eq!(ports[0].len(), 10, "frames still pass");
        let errors = vars.meter("write_errors_total").get();
        assert_eq!(errors, 9);
        assert_eq!(vars.meter("frames_total").get(), 1);
        let mut out = Output::detached(Time::from_millis(100), "t", &pool, &mut ports, &mut control, &mut serial);
        assert_eq!(tap.poll(&mut out), Some(Time::from_millis(150)));
        assert_eq!(vars.meter("write_errors_total").get(), errors + 1, "failed flush counted");
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
