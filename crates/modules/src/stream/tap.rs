//! `stream-tap`: records each flow's bytes, in both directions, to files in a folder, and passes every frame on
//! unchanged.
//!
//! - Files, in the folder named by `path` (which must exist): `<path>/<flow>.down` holds the bytes of the flow's
//!   `Data` travelling down (from the app), in order, and `<path>/<flow>.up` those travelling up; for UDP, the
//!   datagrams one after the other (their boundaries are not recorded). `<path>/index` gets one line when a flow
//!   starts, `<flow> open <FlowInfo>` (e.g.
//!   `7 open tcp 10.0.0.2:40000 -> 192.0.2.1:80 app "curl" client`, or `7 open unknown` for a flow that was already
//!   running when the tap was added), and one when it ends, `<flow> end fin down <bytes> up <bytes>` (TCP: both
//!   directions saw `Fin`; UDP: one `Fin`) or `<flow> end abort <reason> down <bytes> up <bytes>`.
//! - When: `index` is created (or truncated) when the module is configured (the folder is not created: a setting
//!   with a typo then fails instead of creating folders somewhere); the files of a flow are created when its first
//!   frame passes (flows are not known before), so this is the one stream module that opens files in the data
//!   plane — one `open` per flow, then buffered writes. Writes go
//!   through an 8 KiB buffer per file, flushed at least every 50 ms (the module asks to be polled), when the flow
//!   ends and when the module is unloaded.
//! - Bounds: at most `max_flows` flows are recorded at once (knob, 64 by default: two open files each); frames of
//!   other flows pass unrecorded, counted in `flows_skipped_total` once per flow.
//! - Errors: a file that cannot be created or written is counted in `write_errors_total` and that flow stops being
//!   recorded; traffic never stops. `enabled = false` passes frames without recording (flows being recorded are
//!   closed).
//!
//! Its ports, settings, knobs and meters are declared once, in `DECL` below; docs/modules.md lists them.

use crate::stream::{u64_meters, BOTH_WAYS_IN, BOTH_WAYS_OUT};
use flexstack_core::config::SettingsReader;
use flexstack_core::stream::{Protocol, StreamEvent};
use flexstack_core::{
    field, kind_from_decl, Batch, ConfigError, Direction, Frame, KindDecl, Meter, MeterDecl, Module, ModuleBuilder,
    ModuleInterface, ModuleKind, ModuleVars, Output, Param, Settings, Time, Value,
};
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::time::Duration;

/// The kind's name in stack files.
pub const KIND: &str = "stream-tap";

/// Longest time recorded bytes wait in a buffer.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(50);

/// The `stream-tap` module kind.
pub struct StreamTapKind;

/// The knobs (`record` has them too).
pub(crate) struct Config {
    pub(crate) max_flows: u64,
    pub(crate) enabled: bool,
}

type P = Param<Config>;

/// The `path` setting (`record` has it too).
pub(crate) const PATH: P = P::manual(
    "path",
    "str",
    "the folder of the recordings (it must exist); `index` is created in it when configured",
    "required",
);

/// The `max_flows` knob (`record` has it too).
pub(crate) const MAX_FLOWS: P =
    P::u64("max_flows", "flows", "most flows recorded at once (two open files each)", 64, field!(max_flows))
        .range(0.0, 4096.0);

/// The recording's meters (`record` has them too).
pub(crate) const METERS: &[MeterDecl<Meters>] = u64_meters![
    recorded: "flows_recorded_total", "flows", "flows whose files were created";
    active: "flows_active", "flows", "flows being recorded";
    skipped: "flows_skipped_total", "flows", "flows not recorded: `max_flows` reached";
    down: "bytes_down_total", "bytes", "bytes recorded travelling down";
    up: "bytes_up_total", "bytes", "bytes recorded travelling up";
    errors: "write_errors_total", "errors", "files that could not be created, written or flushed";
];

/// The kind: ports, settings, knobs and meters.
const DECL: KindDecl<Config, Meters> = KindDecl {
    inputs: BOTH_WAYS_IN,
    outputs: BOTH_WAYS_OUT,
    params: &[PATH, MAX_FLOWS, P::bool("enabled", "false passes frames without recording them", true, field!(enabled))],
    meters: METERS,
    // One folder of files: the stack runs on one data-plane worker.
    global_view: true,
    ..KindDecl::new(KIND, "records each flow's bytes both ways to files in a folder, and passes stream frames on")
};

impl ModuleKind for StreamTapKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(KIND);
        let mut cfg = Config { max_flows: 0, enabled: true };
        DECL.read(&mut r, &mut cfg)?;
        let (folder, index) = open_folder(settings, &mut r, KIND)?;
        r.finish()?;
        Ok(Box::new(TapBuilder { cfg, folder, index }))
    }
}

/// Reads `path` and creates `index` in that folder (which must exist), with errors at the setting's file:line.
pub(crate) fn open_folder(
    settings: &Settings,
    r: &mut SettingsReader<'_>,
    kind: &str,
) -> Result<(PathBuf, File), ConfigError> {
    let folder = match r.string("path")? {
        Some(f) if !f.is_empty() => PathBuf::from(f),
        Some(_) => return Err(r.error("path", "must name a folder, e.g. path = \"flows\"")),
        None => return Err(r.error("path", "is required: the folder to write in, e.g. path = \"flows\"")),
    };
    let at_folder = |message: String| {
        ConfigError::new(
            settings.get("path").and_then(|s| s.location.clone()),
            format!("setting `path` of a {kind} module: {message}"),
        )
    };
    if !folder.is_dir() {
        return Err(at_folder(format!("{folder:?} is not a folder (create it first)")));
    }
    let index = File::create(folder.join("index"))
        .map_err(|e| at_folder(format!("cannot create {:?}: {e}", folder.join("index"))))?;
    Ok((folder, index))
}

struct TapBuilder {
    cfg: Config,
    folder: PathBuf,
    index: File,
}

impl ModuleBuilder for TapBuilder {
    fn interface(&self) -> ModuleInterface {
        DECL.interface(&self.cfg)
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        DECL.publish(&self.cfg, vars);
        let files = FlowFiles::new(self.folder, self.index, DECL.meters(vars), false);
        Box::new(StreamTap { cfg: self.cfg, files })
    }
}

/// The meters.
#[derive(Default)]
pub(crate) struct Meters {
    recorded: Meter,
    active: Meter,
    skipped: Meter,
    down: Meter,
    up: Meter,
    errors: Meter,
}

/// One flow being recorded.
struct Recording {
    down: BufWriter<File>,
    up: BufWriter<File>,
    /// `<flow>.times` (`record`): a line per event.
    times: Option<BufWriter<File>>,
    bytes: [u64; 2],
    udp: bool,
    fins: [bool; 2],
    failed: bool,
}

/// The files of the flows being recorded, in one folder: what `stream-tap` and `record` share.
pub(crate) struct FlowFiles {
    m: Meters,
    folder: PathBuf,
    index: BufWriter<File>,
    flows: HashMap<u64, Recording>,
    /// Flows not recorded (over `max_flows`, or a file failed), so they are counted once.
    skipped: HashSet<u64>,
    last_flush: Option<Time>,
    /// Also write `<flow>.times` and the time on each index line.
    timestamps: bool,
}

/// A running `stream-tap`.
pub struct StreamTap {
    cfg: Config,
    files: FlowFiles,
}

fn slot(dir: Direction) -> usize {
    match dir {
        Direction::Down => 0,
        Direction::Up => 1,
    }
}

fn dir_name(d: usize) -> &'static str {
    if d == 0 {
        "down"
    } else {
        "up"
    }
}

impl FlowFiles {
    /// Recording into `folder`, whose `index` is open; `timestamps` as `record` writes them.
    pub(crate) fn new(folder: PathBuf, index: File, m: Meters, timestamps: bool) -> FlowFiles {
        FlowFiles {
            m,
            folder,
            index: BufWriter::new(index),
            flows: HashMap::new(),
            skipped: HashSet::new(),
            last_flush: None,
            timestamps,
        }
    }

    /// An index line (with the time first when timestamps are on).
    fn index_line(&mut self, now: Time, line: &str) {
        let ok = if self.timestamps {
            write!(self.index, "{} {line}", now.as_nanos()).is_ok()
        } else {
            self.index.write_all(line.as_bytes()).is_ok()
        };
        if !ok {
            self.m.errors.add(1);
        }
    }

    /// The recording of `flow`, created (with its index line) if this frame may start one.
    fn recording(
        &mut self,
        flow: u64,
        open: Option<&StreamEvent<'_>>,
        max_flows: u64,
        now: Time,
    ) -> Option<&mut Recording> {
        if self.skipped.contains(&flow) {
            return None;
        }
        if !self.flows.contains_key(&flow) {
            if self.flows.len() as u64 >= max_flows {
                self.skipped.insert(flow);
                self.m.skipped.add(1);
                return None;
            }
            let create = |dir: &str| File::create(self.folder.join(format!("{flow}.{dir}"))).map(BufWriter::new);
            let times = if self.timestamps { Some(create("times")) } else { None };
            let (down, up, times) = match (create("down"), create("up"), times.transpose()) {
                (Ok(d), Ok(u), Ok(t)) => (d, u, t),
                _ => {
                    self.m.errors.add(1);
                    self.skipped.insert(flow);
                    return None;
                }
            };
            let (line, udp) = match open {
                Some(StreamEvent::Open(info)) => (format!("{flow} open {info}\n"), info.protocol == Protocol::Udp),
                _ => (format!("{flow} open unknown\n"), false),
            };
            self.index_line(now, &line);
            self.flows.insert(flow, Recording { down, up, times, bytes: [0; 2], udp, fins: [false; 2], failed: false });
            self.m.recorded.add(1);
            self.m.active.set(self.flows.len() as u64);
        }
        self.flows.get_mut(&flow)
    }

    /// Ends `flow`'s recording with `how` (`fin`, `abort REASON`): flushes its files and writes its index line.
    pub(crate) fn end(&mut self, flow: u64, how: &str, now: Time) {
        let Some(mut r) = self.flows.remove(&flow) else { return };
        let mut ok = r.down.flush().is_ok() & r.up.flush().is_ok();
        if let Some(t) = &mut r.times {
            ok &= writeln!(t, "{} end {how}", now.as_nanos()).is_ok() && t.flush().is_ok();
        }
        if !ok {
            self.m.errors.add(1);
        }
        let line = format!("{flow} end {how} down {} up {}\n", r.bytes[0], r.bytes[1]);
        self.index_line(now, &line);
        if self.index.flush().is_err() {
            self.m.errors.add(1);
        }
        self.m.active.set(self.flows.len() as u64);
    }

    /// Ends every recording with `how`.
    pub(crate) fn end_all(&mut self, how: &str, now: Time) {
        let flows: Vec<u64> = self.flows.keys().copied().collect();
        for f in flows {
            self.end(f, how, now);
        }
    }

    /// Records what a frame carries (a frame that is not a stream frame is ignored).
    fn record(&mut self, frame: &Frame, max_flows: u64, now: Time) {
        let Frame::Data(p) = frame else { return };
        let (Some(flow), Some(event)) = (p.stream_flow(), p.stream()) else { return };
        let dir = slot(p.direction());
        match &event {
            StreamEvent::Open(_) if p.direction() == Direction::Down => {
                self.recording(flow, Some(&event), max_flows, now);
            }
            StreamEvent::Data(bytes) => {
                let Some(r) = self.recording(flow, None, max_flows, now) else { return };
                if r.failed {
                    return;
                }
                let w = if dir == 0 { &mut r.down } else { &mut r.up };
                let mut ok = w.write_all(bytes).is_ok();
                if let Some(t) = &mut r.times {
                    ok &= writeln!(t, "{} {} {} {}", now.as_nanos(), dir_name(dir), r.bytes[dir], bytes.len()).is_ok();
                }
                if !ok {
                    r.failed = true;
                    self.m.errors.add(1);
                    return;
                }
                r.bytes[dir] += bytes.len() as u64;
                let m = if dir == 0 { &self.m.down } else { &self.m.up };
                m.add(bytes.len() as u64);
            }
            StreamEvent::Fin => {
                let Some(r) = self.flows.get_mut(&flow) else { return };
                r.fins[dir] = true;
                if let Some(t) = &mut r.times {
                    let _ = writeln!(t, "{} fin {}", now.as_nanos(), dir_name(dir));
                }
                if r.udp || r.fins == [true, true] {
                    self.end(flow, "fin", now);
                }
            }
            StreamEvent::Abort(reason) => {
                let how = format!("abort {reason}");
                self.end(flow, &how, now);
                self.skipped.remove(&flow);
            }
            _ => {}
        }
    }

    fn flush(&mut self, now: Time) {
        self.last_flush = Some(now);
        let mut errors = 0;
        for r in self.flows.values_mut() {
            if r.down.flush().is_err() || r.up.flush().is_err() || r.times.as_mut().is_some_and(|t| t.flush().is_err())
            {
                errors += 1;
            }
        }
        if self.index.flush().is_err() {
            errors += 1;
        }
        self.m.errors.add(errors);
    }

    /// A module's batch: records the frames `wanted` chooses, passes every frame on, and flushes when
    /// `FLUSH_INTERVAL` passed (asking to be polled for the first flush).
    pub(crate) fn pass(
        &mut self,
        input: &mut Batch,
        out: &mut Output<'_>,
        max_flows: u64,
        mut wanted: impl FnMut(&Frame) -> bool,
    ) {
        let now = out.now();
        for f in input.iter() {
            if wanted(f) {
                self.record(f, max_flows, now);
            }
        }
        out.emit_all(0, input);
        match self.last_flush {
            None => {
                self.last_flush = Some(now);
                out.wake_at(now + FLUSH_INTERVAL);
            }
            Some(t) if now - t >= FLUSH_INTERVAL => self.flush(now),
            Some(_) => {}
        }
    }

    /// The poll: flushes, and says when to come back.
    pub(crate) fn poll(&mut self, now: Time) -> Option<Time> {
        self.flush(now);
        (!self.flows.is_empty() || self.last_flush.is_some()).then_some(now + FLUSH_INTERVAL)
    }
}

impl Module for StreamTap {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        let enabled = self.cfg.enabled;
        self.files.pass(input, out, self.cfg.max_flows, |_| enabled);
    }

    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        self.files.poll(out.now())
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        DECL.write(&mut self.cfg, knob, value)?;
        if !self.cfg.enabled {
            let now = self.files.last_flush.unwrap_or_default();
            self.files.end_all("disabled", now);
        }
        Ok(())
    }
}

impl Drop for FlowFiles {
    fn drop(&mut self) {
        for r in self.flows.values_mut() {
            let _ = r.down.flush();
            let _ = r.up.flush();
            if let Some(t) = &mut r.times {
                let _ = t.flush();
            }
        }
        let _ = self.index.flush();
    }
}

#[cfg(test)]
mod tests {
    use crate::testutil::*;
    use flexstack_core::stream::{FlowInfo, Role, StreamFrame};
    use flexstack_core::testing::take;
    use flexstack_core::{Batch, Direction, Switch, Time, Value};

    fn stack(folder: &std::path::Path, extra: &[&str]) -> (Switch, Log) {
        let mut sw = Switch::default();
        let (rec, log) = Recorder::load("r");
        let folder = format!("path={:?}", folder.display().to_string());
        let mut args = vec![folder.as_str()];
        args.extend_from_slice(extra);
        sw.apply(vec![load("t", "stream-tap", &args), rec, link("t -> r")]).unwrap();
        (sw, log)
    }

    fn info(port: u16) -> FlowInfo {
        FlowInfo::tcp(
            format!("10.0.0.2:{port}").parse().unwrap(),
            "192.0.2.1:80".parse().unwrap(),
            "curl",
            Role::Client,
        )
    }

    #[test]
    fn records_both_directions_and_an_index_and_passes_frames_on() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("rec");
        std::fs::create_dir(&folder).unwrap();
        let (mut sw, log) = stack(&folder, &[]);
        let pool = sw.pool().clone();
        let mut batch: Batch = vec![
            StreamFrame::open(&pool, 3, Direction::Down, &info(1000)).into(),
            StreamFrame::data(&pool, 3, Direction::Down, b"GET / HTTP/1.0\r\n\r\n").into(),
            StreamFrame::open(&pool, 3, Direction::Up, &info(1000)).into(),
            StreamFrame::data(&pool, 3, Direction::Up, b"HTTP/1.0 200 OK\r\n").into(),
            StreamFrame::ack(&pool, 3, Direction::Up, 18).into(),
            StreamFrame::fin(&pool, 3, Direction::Down).into(),
            StreamFrame::data(&pool, 3, Direction::Up, b"\r\nbody").into(),
            StreamFrame::fin(&pool, 3, Direction::Up).into(),
            // A flow that started before the tap, and one that is aborted.
            StreamFrame::data(&pool, 4, Direction::Up, b"late").into(),
            StreamFrame::open(&pool, 5, Direction::Down, &info(1001)).into(),
            StreamFrame::abort(&pool, 5, Direction::Up, "refused").into(),
        ];
        sw.inject("t", "in", &mut batch).unwrap();
        sw.run(Time::from_millis(1));
        assert_eq!(take(&log).len(), 11, "every frame passes");
        sw.run(Time::from_millis(51)); // the flush
        let read = |name: &str| std::fs::read(folder.join(name)).unwrap();
        assert_eq!(read("3.down"), b"GET / HTTP/1.0\r\n\r\n");
        assert_eq!(read("3.up"), b"HTTP/1.0 200 OK\r\n\r\nbody");
        assert_eq!(read("4.up"), b"late");
        let index = String::from_utf8(read("index")).unwrap();
        assert_eq!(
            index,
            "3 open tcp 10.0.0.2:1000 -> 192.0.2.1:80 app \"curl\" client\n\
             3 end fin down 18 up 23\n\
             4 open unknown\n\
             5 open tcp 10.0.0.2:1001 -> 192.0.2.1:80 app \"curl\" client\n\
             5 end abort refused down 0 up 0\n"
        );
        assert_eq!(u64_var(&sw, "module.t.flows_recorded_total"), 3);
        assert_eq!(u64_var(&sw, "module.t.flows_active"), 1, "flow 4 has not ended");
        assert_eq!(u64_var(&sw, "module.t.bytes_down_total"), 18);
        assert_eq!(u64_var(&sw, "module.t.bytes_up_total"), 27);
        assert_eq!(u64_var(&sw, "module.t.write_errors_total"), 0);
    }

    #[test]
    fn max_flows_bounds_open_files_and_disabling_closes_them() {
        let dir = tempfile::tempdir().unwrap();
        let (mut sw, log) = stack(dir.path(), &["max_flows=2"]);
        let pool = sw.pool().clone();
        let mut batch: Batch =
            (1..=4).map(|f| StreamFrame::data(&pool, f, Direction::Down, b"x").into()).collect::<Batch>();
        batch.push(StreamFrame::data(&pool, 4, Direction::Down, b"y").into());
        sw.inject("t", "in", &mut batch).unwrap();
        sw.run(Time::from_millis(1));
        assert_eq!(take(&log).len(), 5);
        assert_eq!(u64_var(&sw, "module.t.flows_recorded_total"), 2);
        assert_eq!(u64_var(&sw, "module.t.flows_skipped_total"), 2, "each skipped flow counted once");
        assert!(!dir.path().join("3.down").exists());
        sw.apply(vec![knob("t", "enabled", Value::Bool(false))]).unwrap();
        assert_eq!(u64_var(&sw, "module.t.flows_active"), 0);
        let index = std::fs::read_to_string(dir.path().join("index")).unwrap();
        assert!(index.contains("1 end disabled down 1 up 0"), "{index}");
    }

    #[test]
    fn a_udp_flow_ends_with_one_fin_and_files_are_flushed_on_unload() {
        let dir = tempfile::tempdir().unwrap();
        let (mut sw, _log) = stack(dir.path(), &[]);
        let pool = sw.pool().clone();
        let udp = FlowInfo::udp("10.0.0.2:5000".parse().unwrap(), "10.0.0.1:53".parse().unwrap(), "dig", Role::Client);
        let mut batch: Batch = vec![
            StreamFrame::open(&pool, 1, Direction::Down, &udp).into(),
            StreamFrame::data(&pool, 1, Direction::Down, b"q1").into(),
            StreamFrame::data(&pool, 1, Direction::Down, b"q2").into(),
            StreamFrame::fin(&pool, 1, Direction::Up).into(),
            StreamFrame::open(&pool, 2, Direction::Down, &info(9)).into(),
            StreamFrame::data(&pool, 2, Direction::Down, b"unflushed").into(),
        ];
        sw.inject("t", "in", &mut batch).unwrap();
        sw.run(Time::from_millis(1));
        assert_eq!(std::fs::read(dir.path().join("1.down")).unwrap(), b"q1q2");
        sw.apply(vec![flexstack_core::Edit::Unload { name: "t".into() }]).unwrap();
        assert_eq!(std::fs::read(dir.path().join("2.down")).unwrap(), b"unflushed");
    }

    #[test]
    fn a_file_that_cannot_be_created_is_counted_and_frames_still_pass() {
        let dir = tempfile::tempdir().unwrap();
        let (mut sw, log) = stack(dir.path(), &[]);
        std::fs::create_dir(dir.path().join("1.down")).unwrap(); // even root cannot create a file there
        let pool = sw.pool().clone();
        let mut batch: Batch = vec![
            StreamFrame::data(&pool, 1, Direction::Down, b"lost").into(),
            StreamFrame::data(&pool, 1, Direction::Down, b"lost too").into(),
            StreamFrame::data(&pool, 2, Direction::Down, b"kept").into(),
        ];
        sw.inject("t", "in", &mut batch).unwrap();
        sw.run(Time::from_millis(100));
        assert_eq!(take(&log).len(), 3, "traffic never stops");
        assert_eq!(u64_var(&sw, "module.t.write_errors_total"), 1, "counted once for the flow");
        assert_eq!(u64_var(&sw, "module.t.flows_recorded_total"), 1);
        sw.run(Time::from_millis(200)); // the flush
        assert_eq!(std::fs::read(dir.path().join("2.down")).unwrap(), b"kept");
    }

    #[test]
    fn settings_are_checked_where_written() {
        let e = configure_toml("[modules.t]\nkind = \"stream-tap\"\nmax_flows = 5\n").err().unwrap();
        assert!(e.to_string().contains("`path`"), "{e}");
        let file = tempfile::NamedTempFile::new().unwrap();
        for bad in [file.path().to_path_buf(), file.path().join("missing")] {
            let text = format!("[modules.t]\nkind = \"stream-tap\"\npath = {:?}\n", bad.display().to_string());
            let e = configure_toml(&text).err().unwrap();
            assert_eq!(e.location.as_ref().unwrap().line, 3, "{e}");
            assert!(e.message.contains("is not a folder (create it first)"), "{e}");
        }
        assert!(!file.path().join("missing").exists(), "nothing was created");
    }
}
