//! `source`: a paced test traffic generator.
//!
//! Driven by `poll`, it emits packets of `size` bytes at `rate` frames/s on `out`. Packet number `n` (counting from
//! 0) carries `n` as a big-endian u64 in its first 8 bytes (packets shorter than 8 bytes carry its low-order bytes),
//! zeros after it, and `n` in its [`MetaKey::SEQ`] metadata.
//!
//! Pacing is exact in the long run: frame `k` of a schedule is due at `start + k / rate`, and each poll emits every
//! frame that is due by `now`, but at most `burst` of them; if frames are still due after that, the source asks to
//! be polled again at once. A late poll is therefore caught up on the following polls, so over `T` seconds
//! `rate * T` frames are sent (± `burst`). A backlog of more than 1 s (or `burst` frames, if more) is forgotten
//! rather than sent as a flood, e.g. after the stack was paused. Changing `rate` starts a new schedule whose first
//! frame comes one new interval after the last frame sent.
//!
//! The switch polls a module only at the time it asked for, and a knob write cannot wake a module, so the source
//! never asks for a wakeup more than 100 ms away: while it is disabled, paused by `rate = 0` or done, it keeps
//! polling every 100 ms (a heartbeat), so re-enabling it, raising `rate` or `count` takes effect within 100 ms.
//!
//! No inputs. Its ports, settings, knobs (each also accepted as a setting) and meters are declared once, in `DECL`
//! below; docs/modules.md lists them with their units, defaults and ranges.
//!
//! On `module replace` with state kept, the new source continues the sequence numbers and counts.

use flexstack_core::module::{handed_over, port_type};
use flexstack_core::{
    field, kind_from_decl, Batch, ConfigError, KindDecl, MetaKey, Meter, MeterDecl, Module, ModuleBuilder, ModuleKind,
    Output, Param, PortDecl, Settings, Time, Value, ValueType,
};
use std::any::Any;
use std::time::Duration;

/// The kind's name in stack files.
pub const KIND: &str = "source";

/// Longest time between two polls, so that knob changes take effect.
pub const HEARTBEAT: Duration = Duration::from_millis(100);

/// Largest backlog caught up on (at least `burst` frames' worth).
const MAX_BACKLOG: Duration = Duration::from_secs(1);

/// Largest packet.
const MAX_SIZE: u64 = 65_535;
/// Largest rate, in frames/s.
const MAX_RATE: f64 = 1e9;
/// Largest burst.
const MAX_BURST: u64 = 4096;

/// The `source` module kind.
pub struct SourceKind;

/// Settings and knob values (`Default` is a blank to read them into; the defaults are in `DECL`).
#[derive(Clone, Debug, Default, PartialEq)]
struct SourceConfig {
    size: u64,
    rate: f64,
    burst: u64,
    count: u64,
    enabled: bool,
}

type P = Param<SourceConfig>;

/// The kind: ports, settings, knobs and meters.
const DECL: KindDecl<SourceConfig, Meters> = KindDecl {
    outputs: &[PortDecl::new("out", port_type::ANY, "the generated packets")],
    params: &[
        P::u64("size", "bytes", "packet length", 64, field!(size)).range(1.0, MAX_SIZE as f64),
        P::f64("rate", "frames/s", "sending rate; 0 pauses", 1000.0, field!(rate)).range(0.0, MAX_RATE),
        P::u64("burst", "frames", "most frames emitted per poll", 32, field!(burst))
            .range(1.0, MAX_BURST as f64)
            .setting(),
        P::u64("count", "frames", "stop after this many frames; 0 = no limit", 0, field!(count)),
        P::bool("enabled", "false pauses the source", true, field!(enabled)),
    ],
    meters: &[
        MeterDecl::u64("frames_total", "frames", "frames sent", |m| &mut m.frames),
        MeterDecl::u64("bytes_total", "bytes", "bytes sent", |m| &mut m.bytes),
        MeterDecl::new("done", ValueType::Bool, "", "true once `count` frames were sent", |m| &mut m.done),
    ],
    // Frames it makes itself, at one rate: the stack runs on one data-plane worker.
    global_view: true,
    ..KindDecl::new(KIND, "generates sequence-numbered test packets at a paced rate")
};

impl ModuleKind for SourceKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        DECL.configure(settings, SourceConfig::default(), |cfg, m, _| {
            let source = Source { cfg, state: SourceState::default(), schedule: None, m };
            source.publish();
            Box::new(source)
        })
    }
}

/// The source's meters.
#[derive(Default)]
struct Meters {
    frames: Meter,
    bytes: Meter,
    done: Meter,
}

/// What a source hands to its replacement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceState {
    /// Sequence number of the next packet, which is also the number of frames sent.
    pub next_seq: u64,
    /// Bytes sent.
    pub bytes: u64,
}

/// A pacing schedule: frame `k` is due at `start + k * interval_ns`.
#[derive(Clone, Copy, Debug)]
struct Schedule {
    start: Time,
    interval_ns: f64,
    rate: f64,
    sent: u64,
}

impl Schedule {
    fn new(start: Time, rate: f64) -> Schedule {
        Schedule { start, interval_ns: 1e9 / rate, rate, sent: 0 }
    }

    /// When frame `k` of the schedule is due.
    fn due(&self, k: u64) -> Time {
        // `as` saturates; the schedule is restarted long before precision matters.
        Time(self.start.0.saturating_add((k as f64 * self.interval_ns).ceil() as u64))
    }
}

/// A running source.
pub struct Source {
    cfg: SourceConfig,
    state: SourceState,
    schedule: Option<Schedule>,
    m: Meters,
}

impl Source {
    fn is_done(&self) -> bool {
        self.cfg.count > 0 && self.state.next_seq >= self.cfg.count
    }

    fn publish(&self) {
        self.m.frames.set(self.state.next_seq);
        self.m.bytes.set(self.state.bytes);
        self.m.done.store(&Value::Bool(self.is_done()));
    }

    /// The schedule to send by at `now`: kept, started, restarted after a rate change, or trimmed of a backlog.
    fn schedule_at(&mut self, now: Time) -> Schedule {
        let rate = self.cfg.rate;
        let mut s = match self.schedule {
            None => Schedule::new(now, rate),
            Some(old) if old.rate != rate => {
                // The next frame comes one new interval after the last one sent, or now if that has passed.
                let fresh = Schedule::new(now, rate);
                let start = if old.sent > 0 { (old.due(old.sent - 1) + ns(fresh.interval_ns)).max(now) } else { now };
                Schedule::new(start, rate)
            }
            Some(old) => old,
        };
        let next = s.due(s.sent);
        let limit = MAX_BACKLOG.max(ns(s.interval_ns * self.cfg.burst as f64));
        if now > next && now - next > limit {
            s = Schedule::new(now, rate);
        }
        s
    }

    fn emit_packet(&mut self, out: &mut Output<'_>) {
        let seq = self.state.next_seq;
        let size = self.cfg.size as usize;
        let mut p = out.pool().alloc();
        let buf = p.make_mut();
        buf.resize(size, 0);
        let be = seq.to_be_bytes();
        let n = size.min(be.len());
        buf[..n].copy_from_slice(&be[be.len() - n..]);
        p.meta_mut().set(MetaKey::SEQ, seq);
        out.emit(0, p);
        self.state.next_seq += 1;
        self.state.bytes += size as u64;
    }
}

fn ns(x: f64) -> Duration {
    Duration::from_nanos(x.min(u64::MAX as f64) as u64)
}

impl Module for Source {
    fn process(&mut self, _port: usize, input: &mut Batch, _out: &mut Output<'_>) {
        // No inputs are declared, so the switch never calls this; anything handed in is dropped and counted.
        let _ = input;
    }

    fn poll(&mut self, out: &mut Output<'_>) -> Option<Time> {
        let now = out.now();
        if !self.cfg.enabled || self.cfg.rate <= 0.0 || self.is_done() {
            self.schedule = None;
            self.publish();
            return Some(now + HEARTBEAT);
        }
        let mut s = self.schedule_at(now);
        let room = if self.cfg.count > 0 { self.cfg.count - self.state.next_seq } else { u64::MAX };
        let limit = self.cfg.burst.min(room);
        let (seq0, bytes0) = (self.state.next_seq, self.state.bytes);
        let mut n = 0;
        while n < limit && s.due(s.sent) <= now {
            self.emit_packet(out);
            s.sent += 1;
            n += 1;
        }
        self.m.frames.add(self.state.next_seq - seq0);
        self.m.bytes.add(self.state.bytes - bytes0);
        if self.is_done() {
            self.m.done.store(&Value::Bool(true));
            self.schedule = None;
            return Some(now + HEARTBEAT);
        }
        self.schedule = Some(s);
        Some(s.due(s.sent).min(now + HEARTBEAT))
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        DECL.write(&mut self.cfg, knob, value)?;
        self.m.done.store(&Value::Bool(self.is_done()));
        Ok(())
    }

    fn take_state(&mut self) -> Option<Box<dyn Any>> {
        Some(Box::new(self.state.clone()))
    }

    fn adopt_state(&mut self, state: Box<dyn Any>) -> Result<(), String> {
        self.state = handed_over(state, "a source's state")?;
        self.publish();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::testutil::*;
    use flexstack_core::{Edit, Switch, Time, Value};
    use std::collections::BTreeMap;
    use std::time::Duration;

    fn stack(args: &[&str]) -> (Switch, Log) {
        recorded("src", "source", args)
    }

    /// Frames per distinct arrival time (= per poll).
    fn per_poll(log: &Log) -> BTreeMap<Time, usize> {
        let mut m = BTreeMap::new();
        for s in log.lock().unwrap().iter() {
            *m.entry(s.at).or_default() += 1;
        }
        m
    }

    #[test]
    fn paced_exactly_when_polled_often() {
        let (mut sw, log) = stack(&[]);
        run_every(&mut sw, Time::ZERO, Time::from_millis(10_000), Duration::from_millis(1));
        let sent = u64_var(&sw, "module.src.frames_total");
        assert!(sent.abs_diff(10_000) <= 32, "sent {sent}");
        assert_eq!(log.lock().unwrap().len() as u64, sent);
        assert_eq!(u64_var(&sw, "module.src.bytes_total"), sent * 64);
    }

    #[test]
    fn late_polls_are_caught_up_and_bursts_are_bounded() {
        // Polled every 20 ms: 20 frames are due per poll, within the burst, so nothing is lost.
        let (mut sw, log) = stack(&["burst=32"]);
        run_every(&mut sw, Time::ZERO, Time::from_millis(10_000), Duration::from_millis(20));
        let sent = u64_var(&sw, "module.src.frames_total");
        assert!(sent.abs_diff(10_000) <= 32, "sent {sent}");
        assert!(per_poll(&log).values().all(|&n| n <= 32));

        // Polled every 50 ms: 50 are due, but never more than 32 go out per poll.
        let (mut sw, log) = stack(&["burst=32"]);
        run_every(&mut sw, Time::ZERO, Time::from_millis(10_000), Duration::from_millis(50));
        let polls = per_poll(&log);
        assert!(polls.values().all(|&n| n <= 32), "{polls:?}");
        assert!(polls.values().filter(|&&n| n == 32).count() > 150);

        // Irregular polling with gaps shorter than the burst allows: still exact in the long run.
        let (mut sw, _log) = stack(&["rate=2000", "burst=64"]);
        let mut t = Time::ZERO;
        let mut k = 0u64;
        while t <= Time::from_millis(10_000) {
            sw.run(t);
            k += 1;
            t = t + Duration::from_micros(1_000 + (k * 7919) % 25_000);
        }
        let sent = u64_var(&sw, "module.src.frames_total");
        assert!(sent.abs_diff(20_000) <= 64, "sent {sent}");
    }

    #[test]
    fn sequence_numbers_size_and_count_limit() {
        let (mut sw, log) = stack(&["count=100", "rate=100000", "size=20"]);
        run_every(&mut sw, Time::ZERO, Time::from_millis(10), Duration::from_millis(1));
        assert_eq!(u64_var(&sw, "module.src.frames_total"), 100);
        assert_eq!(var(&sw, "module.src.done"), Value::Bool(true));
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 100);
        for (i, s) in log.iter().enumerate() {
            assert_eq!(s.seq(), Some(i as u64));
            assert_eq!(s.data.len(), 20);
            assert_eq!(s.data[..8], (i as u64).to_be_bytes());
            assert!(s.data[8..].iter().all(|&b| b == 0));
        }
        drop(log);
        // Asking for more lets it continue.
        sw.apply(vec![knob("src", "count", Value::U64(150))]).unwrap();
        assert_eq!(var(&sw, "module.src.done"), Value::Bool(false));
        run_every(&mut sw, Time::from_millis(11), Time::from_millis(200), Duration::from_millis(1));
        assert_eq!(u64_var(&sw, "module.src.frames_total"), 150);
        assert_eq!(var(&sw, "module.src.done"), Value::Bool(true));
    }

    #[test]
    fn tiny_packets_carry_the_low_bytes_of_the_sequence_number() {
        let (mut sw, log) = stack(&["count=300", "rate=1000000", "size=1", "burst=4096"]);
        // The first poll starts the schedule with one frame; a millisecond later 1000 more are due.
        sw.run(Time::from_millis(1));
        sw.run(Time::from_millis(2));
        let log = log.lock().unwrap();
        assert_eq!(log.len(), 300);
        assert_eq!(log[258].data, [2]);
        assert_eq!(log[258].seq(), Some(258));
    }

    #[test]
    fn enabled_and_rate_knobs_pause_and_resume() {
        let (mut sw, _log) = stack(&[]);
        run_every(&mut sw, Time::ZERO, Time::from_millis(999), Duration::from_millis(1));
        let a = u64_var(&sw, "module.src.frames_total");
        assert_eq!(a, 1000);
        sw.apply(vec![knob("src", "enabled", Value::Bool(false))]).unwrap();
        assert_eq!(var(&sw, "module.src.enabled"), Value::Bool(false));
        run_every(&mut sw, Time::from_millis(1000), Time::from_millis(1999), Duration::from_millis(1));
        assert_eq!(u64_var(&sw, "module.src.frames_total"), a, "disabled sends nothing");
        // While idle the source only asks for a heartbeat.
        assert!(sw.next_wakeup().unwrap() <= Time::from_millis(2100));
        sw.apply(vec![knob("src", "enabled", Value::Bool(true))]).unwrap();
        run_every(&mut sw, Time::from_millis(2000), Time::from_millis(2999), Duration::from_millis(1));
        let b = u64_var(&sw, "module.src.frames_total");
        // Resumed within the 100 ms heartbeat, without a burst for the time it was off.
        assert!((a + 900..=a + 1000).contains(&b), "{a} -> {b}");

        // rate 0 pauses, a new rate resumes at that rate.
        sw.apply(vec![knob("src", "rate", Value::U64(0))]).unwrap();
        run_every(&mut sw, Time::from_millis(3000), Time::from_millis(3999), Duration::from_millis(1));
        assert_eq!(u64_var(&sw, "module.src.frames_total"), b);
        sw.apply(vec![knob("src", "rate", Value::F64(5000.0))]).unwrap();
        run_every(&mut sw, Time::from_millis(4000), Time::from_millis(5999), Duration::from_millis(1));
        let c = u64_var(&sw, "module.src.frames_total");
        assert!((b + 9_400..=b + 10_001).contains(&c), "{b} -> {c}");

        // Out-of-range knob values are refused by the switch.
        assert!(sw.apply(vec![knob("src", "size", Value::U64(0))]).is_err());
        assert!(sw.apply(vec![knob("src", "rate", Value::F64(-1.0))]).is_err());
    }

    #[test]
    fn rate_change_keeps_spacing() {
        let (mut sw, log) = stack(&["rate=100"]);
        run_every(&mut sw, Time::ZERO, Time::from_millis(995), Duration::from_millis(1));
        sw.apply(vec![knob("src", "rate", Value::F64(10.0))]).unwrap();
        run_every(&mut sw, Time::from_millis(996), Time::from_millis(2000), Duration::from_millis(1));
        let log = log.lock().unwrap();
        let times: Vec<u64> = log.iter().map(|s| s.at.as_nanos() / 1_000_000).collect();
        // 100 frames at 0..990 ms, then one every 100 ms starting 100 ms after the last.
        assert_eq!(times[99], 990);
        assert_eq!(times[100..], [1090, 1190, 1290, 1390, 1490, 1590, 1690, 1790, 1890, 1990]);
    }

    #[test]
    fn replace_keeps_sequence() {
        let (mut sw, log) = stack(&["rate=1000"]);
        run_every(&mut sw, Time::ZERO, Time::from_millis(9), Duration::from_millis(1));
        assert_eq!(u64_var(&sw, "module.src.frames_total"), 10);
        let settings = settings(&["rate=1000", "size=100"]);
        let builder = crate::catalog().configure("source", &settings, None).unwrap();
        sw.apply(vec![Edit::Replace {
            name: "src".into(),
            kind: "source".into(),
            settings,
            builder,
            keep_state: true,
        }])
        .unwrap();
        assert_eq!(u64_var(&sw, "module.src.frames_total"), 10);
        run_every(&mut sw, Time::from_millis(10), Time::from_millis(19), Duration::from_millis(1));
        assert_eq!(u64_var(&sw, "module.src.frames_total"), 20);
        assert_eq!(u64_var(&sw, "module.src.bytes_total"), 10 * 64 + 10 * 100);
        let seqs: Vec<u64> = log.lock().unwrap().iter().map(|s| s.seq().unwrap()).collect();
        assert_eq!(seqs, (0..20).collect::<Vec<_>>());
    }

    #[test]
    fn rejects_bad_settings_with_their_location() {
        assert_config_error("[modules.s]\nkind = \"source\"\nsize = 0\n", Some(3), &["`size`", "1..=65535"]);
        assert_config_error("[modules.s]\nkind = \"source\"\nburst = 5000\n", Some(3), &[]);
        assert_config_error(
            "[modules.s]\nkind = \"source\"\nrate = 10\nrat = 10\n",
            Some(4),
            &["unknown setting `rat`", "rate"],
        );
        assert_config_error("[modules.s]\nkind = \"source\"\nenabled = \"yes\"\n", Some(3), &[]);
        assert!(configure_toml("[modules.s]\nkind = \"source\"\nrate = 0.5\ncount = 3\nenabled = false\n").is_ok());
    }
}
