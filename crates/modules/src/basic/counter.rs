//! `counter`: counts the frames and bytes that pass and estimates their rate; frames pass through unchanged.
//!
//! Every batch is counted, then emitted whole on `out`. No settings. Its ports and meters are declared once, in
//! `DECL` below; docs/modules.md lists them.
//!
//! `rate_fps` is the number of frames counted in the last completed window, divided by the window's length. A
//! window starts at the first call and closes at the first call (`process` or `poll`) at least 1 s later; the
//! counter asks to be polled at the end of each window, so the rate falls to 0 within about 2 s once traffic stops.
//! `last_frame_ns` is `now` of the last batch seen, on the switch's clock.
//!
//! On `module replace` with state kept, the new counter continues the counts (and the rate window) of the old one.

use flexstack_core::module::{handed_over, port_type};
use flexstack_core::{
    kind_from_decl, Batch, ConfigError, Frame, KindDecl, Meter, MeterDecl, Module, ModuleBuilder, ModuleKind, Output,
    PortDecl, Settings, Time, ValueType,
};
use std::any::Any;
use std::time::Duration;

/// The kind's name in stack files.
pub const KIND: &str = "counter";

/// Length of a rate window.
const WINDOW: Duration = Duration::from_secs(1);

/// The `counter` module kind.
pub struct CounterKind;

/// The kind's ports and meters.
const DECL: KindDecl<(), Meters> = KindDecl {
    inputs: &[PortDecl::new("in", port_type::ANY, "frames to count")],
    outputs: &[PortDecl::new("out", port_type::ANY, "the same frames, unchanged")],
    meters: &[
        MeterDecl::u64(
            "frames_total",
            "frames",
            "frames seen (data and control; a GSO super-packet counts its segments)",
            |m| &mut m.frames,
        ),
        MeterDecl::u64(
            "bytes_total",
            "bytes",
            "bytes of the data frames seen (of a GSO super-packet: its segments' on the wire)",
            |m| &mut m.bytes,
        ),
        MeterDecl::u64("control_frames_total", "frames", "control frames seen", |m| &mut m.control),
        MeterDecl::new("rate_fps", ValueType::F64, "frames/s", "frame rate over the last completed ~1 s window", |m| {
            &mut m.rate
        }),
        MeterDecl::u64("last_frame_ns", "ns", "switch time of the last frame seen", |m| &mut m.last),
    ],
    accepts_gso: true,
    ..KindDecl::new(KIND, "counts frames, bytes and the frame rate, and passes frames through")
};

impl ModuleKind for CounterKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        DECL.configure(settings, (), |(), m, _| Box::new(Counter { state: CounterState::default(), m }))
    }
}

/// What a counter hands to its replacement: its counts and its current rate window.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CounterState {
    /// Frames seen.
    pub frames: u64,
    /// Bytes of data frames seen.
    pub bytes: u64,
    /// Control frames seen.
    pub control_frames: u64,
    /// Switch time of the last frame, in ns.
    pub last_frame_ns: u64,
    /// Rate over the last completed window, in frames/s.
    pub rate_fps: f64,
    /// Start of the current window (`None` before the first call).
    pub window_start: Option<Time>,
    /// Frames counted in the current window.
    pub window_frames: u64,
}

/// A running counter.
pub struct Counter {
    state: CounterState,
    m: Meters,
}

/// The counter's meters.
#[derive(Default)]
struct Meters {
    frames: Meter,
    bytes: Meter,
    control: Meter,
    rate: Meter,
    last: Meter,
}

impl Counter {
    /// Closes the rate window if it has lasted at least [`WINDOW`] (or opens the first one).
    fn roll(&mut self, now: Time) {
        let s = &mut self.state;
        match s.window_start {
            None => s.window_start = Some(now),
            Some(start) if now >= start + WINDOW => {
                let elapsed = (now - start).as_nanos() as f64;
                s.rate_fps = s.window_frames as f64 * 1e9 / elapsed;
                s.window_start = Some(now);
                s.window_frames = 0;
                self.m.rate.set_f64(s.rate_fps);
            }
            Some(_) => {}
        }
    }

    fn publish(&self) {
        let s = &self.state;
        self.m.frames.set(s.frames);
        self.m.bytes.set(s.bytes);
        self.m.control.set(s.control_frames);
        self.m.rate.set_f64(s.rate_fps);
        self.m.last.set(s.last_frame_ns);
    }
}

impl Module for Counter {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        let now = out.now();
        self.roll(now);
        let (mut bytes, mut control, mut n) = (0u64, 0u64, 0u64);
        for f in input.iter() {
            match f {
                Frame::Data(p) => {
                    bytes += p.wire_bytes();
                    n += p.wire_packets();
                }
                Frame::Control(_) => {
                    control += 1;
                    n += 1;
                }
            }
        }
        let s = &mut self.state;
        s.frames += n;
        s.bytes += bytes;
        s.control_frames += control;
        s.window_frames += n;
        s.last_frame_ns = now.as_nanos();
        self.m.frames.add(n);
        self.m.bytes.add(bytes);
        self.m.control.add(control);
        self.m.last.set(s.last_frame_ns);
        out.emit_all(0, input);
    }

    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        self.roll(out.now());
        self.state.window_start.map(|start| start + WINDOW)
    }

    fn take_state(&mut self) -> Option<Box<dyn Any>> {
        Some(Box::new(self.state.clone()))
    }

    fn adopt_state(&mut self, state: Box<dyn Any>) -> Result<(), String> {
        self.state = handed_over(state, "a counter's state")?;
        self.publish();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::testutil::*;
    use flexstack_core::{ControlFrame, ControlOp, Edit, Frame, Switch, Time, Value};
    use std::time::Duration;

    fn stack() -> (Switch, Log) {
        recorded("c", "counter", &[])
    }

    #[test]
    fn counts_frames_and_bytes_and_passes_them_through() {
        let (mut sw, log) = stack();
        let mut batch = packets(sw.pool(), 10, 100);
        batch.push(Frame::Control(Box::new(ControlFrame {
            op: ControlOp::Alert,
            sender: "x".into(),
            dest: "".into(),
            serial: 1,
            param: "e".into(),
            value: Value::U64(1),
        })));
        sw.inject("c", "in", &mut batch).unwrap();
        sw.run(Time::from_millis(3));
        assert_eq!(u64_var(&sw, "module.c.frames_total"), 11);
        assert_eq!(u64_var(&sw, "module.c.bytes_total"), 1000);
        assert_eq!(u64_var(&sw, "module.c.control_frames_total"), 1);
        assert_eq!(u64_var(&sw, "module.c.last_frame_ns"), 3_000_000);
        assert_eq!(u64_var(&sw, "module.c.frames_dropped_total"), 0);
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 11);
        for (i, seen) in log.iter().take(10).enumerate() {
            assert_eq!(seen.data.len(), 100);
            assert_eq!(seen.data[0], i as u8, "order kept");
        }
        assert_eq!(log[10].control.as_ref().unwrap().param, "e");
    }

    #[test]
    fn rate_over_one_second_windows() {
        let (mut sw, _log) = stack();
        // 100 frames every 10 ms = 10 000 frames/s, for 3 s.
        let mut t = Time::ZERO;
        while t <= Time::from_millis(3000) {
            let mut b = packets(sw.pool(), 100, 10);
            sw.inject("c", "in", &mut b).unwrap();
            sw.run(t);
            t = t + Duration::from_millis(10);
        }
        let Value::F64(rate) = var(&sw, "module.c.rate_fps") else { panic!() };
        assert!((rate - 10_000.0).abs() < 200.0, "rate {rate}");
        // Traffic stops: the counter's own polls bring the rate to zero.
        run_every(&mut sw, Time::from_millis(3010), Time::from_millis(6000), Duration::from_millis(10));
        assert_eq!(var(&sw, "module.c.rate_fps"), Value::F64(0.0));
    }

    #[test]
    fn replace_keeps_counts() {
        let (mut sw, _log) = stack();
        let mut b = packets(sw.pool(), 5, 20);
        sw.inject("c", "in", &mut b).unwrap();
        sw.run(Time::from_millis(1));
        let settings = crate::testutil::settings(&[]);
        let builder = crate::catalog().configure("counter", &settings, None).unwrap();
        let notes = sw
            .apply(vec![Edit::Replace {
                name: "c".into(),
                kind: "counter".into(),
                settings,
                builder,
                keep_state: true,
            }])
            .unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(u64_var(&sw, "module.c.frames_total"), 5);
        assert_eq!(u64_var(&sw, "module.c.bytes_total"), 100);
        let mut b = packets(sw.pool(), 3, 20);
        sw.inject("c", "in", &mut b).unwrap();
        sw.run(Time::from_millis(2));
        assert_eq!(u64_var(&sw, "module.c.frames_total"), 8);
        assert_eq!(u64_var(&sw, "module.c.bytes_total"), 160);

        // Without keep_state the new counter starts from zero.
        let settings = crate::testutil::settings(&[]);
        let builder = crate::catalog().configure("counter", &settings, None).unwrap();
        sw.apply(vec![Edit::Replace {
            name: "c".into(),
            kind: "counter".into(),
            settings,
            builder,
            keep_state: false,
        }])
        .unwrap();
        assert_eq!(u64_var(&sw, "module.c.frames_total"), 0);
    }

    #[test]
    fn rejects_settings_with_their_location() {
        let text = "[modules.c]\nkind = \"counter\"\n\nrate = 3\n";
        assert_config_error(text, Some(4), &["unknown setting `rate`", "no settings"]);
    }
}
