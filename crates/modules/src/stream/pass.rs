//! `stream-pass`: passes stream frames unchanged, both ways, and counts them: a placeholder for a stream service,
//! and a hop for tests.
//!
//! Every frame that arrives on `in` leaves on `out`, in order, stream frame or not (the contract of docs/streams.md:
//! a stream module never drops). Its ports and meters are declared once, in `DECL` below; docs/modules.md lists
//! them.

use crate::stream::{u64_meters, BOTH_WAYS_IN, BOTH_WAYS_OUT};
use flexstack_core::stream::StreamKind;
use flexstack_core::{
    kind_from_decl, Batch, ConfigError, Direction, Frame, KindDecl, Meter, Module, ModuleBuilder, ModuleKind, Output,
    Settings,
};

/// The kind's name in stack files.
pub const KIND: &str = "stream-pass";

/// The `stream-pass` module kind.
pub struct StreamPassKind;

/// The kind's ports and meters.
const DECL: KindDecl<(), Meters> = KindDecl {
    inputs: BOTH_WAYS_IN,
    outputs: BOTH_WAYS_OUT,
    meters: u64_meters![
        frames: "frames_total", "frames", "frames passed (stream frames or not)";
        down: "data_bytes_down_total", "bytes", "bytes of `Data` travelling down";
        up: "data_bytes_up_total", "bytes", "bytes of `Data` travelling up";
        opens: "opens_total", "frames", "`Open` frames (both directions)";
        fins: "fins_total", "frames", "`Fin` frames";
        aborts: "aborts_total", "frames", "`Abort` frames";
        acks: "acks_total", "frames", "`Ack` frames";
        other: "not_stream_total", "frames", "frames that are not stream frames (passed too)";
    ],
    ..KindDecl::new(KIND, "passes stream frames unchanged both ways and counts them")
};

impl ModuleKind for StreamPassKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        DECL.configure(settings, (), |(), m, _| Box::new(StreamPass { m }))
    }
}

/// The meters.
#[derive(Default)]
struct Meters {
    frames: Meter,
    down: Meter,
    up: Meter,
    opens: Meter,
    fins: Meter,
    aborts: Meter,
    acks: Meter,
    other: Meter,
}

/// A running `stream-pass`.
pub struct StreamPass {
    m: Meters,
}

impl Module for StreamPass {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        let m = &self.m;
        m.frames.add(input.len() as u64);
        for f in input.iter() {
            let Frame::Data(p) = f else {
                m.other.add(1);
                continue;
            };
            match p.stream_kind() {
                Some(StreamKind::Data) if p.direction() == Direction::Down => m.down.add(p.len() as u64),
                Some(StreamKind::Data) => m.up.add(p.len() as u64),
                Some(StreamKind::Open) => m.opens.add(1),
                Some(StreamKind::Fin) => m.fins.add(1),
                Some(StreamKind::Abort) => m.aborts.add(1),
                Some(StreamKind::Ack) => m.acks.add(1),
                None => m.other.add(1),
            }
        }
        out.emit_all(0, input);
    }
}

#[cfg(test)]
mod tests {
    use crate::testutil::*;
    use flexstack_core::stream::{FlowInfo, Role, StreamFrame};
    use flexstack_core::testing::take;
    use flexstack_core::{Batch, Direction, Switch, Time};

    #[test]
    fn passes_every_frame_in_order_and_counts_them() {
        let mut sw = Switch::default();
        let (rec, log) = Recorder::load("r");
        sw.apply(vec![load("p", "stream-pass", &[]), rec, link("p -> r")]).unwrap();
        let pool = sw.pool().clone();
        let info = FlowInfo::tcp("10.0.0.2:1000".parse().unwrap(), "10.9.9.9:80".parse().unwrap(), "a", Role::Client);
        let mut batch: Batch = vec![
            StreamFrame::open(&pool, 1, Direction::Down, &info).into(),
            StreamFrame::data(&pool, 1, Direction::Down, b"GET /").into(),
            StreamFrame::ack(&pool, 1, Direction::Down, 10).into(),
            StreamFrame::data(&pool, 1, Direction::Up, b"200 OK!!!!").into(),
            StreamFrame::fin(&pool, 1, Direction::Down).into(),
            StreamFrame::abort(&pool, 1, Direction::Up, "reset").into(),
            pool.alloc_from(b"not a stream frame").into(),
        ];
        sw.inject("p", "in", &mut batch).unwrap();
        sw.run(Time::from_millis(1));
        let seen = take(&log);
        assert_eq!(seen.len(), 7);
        assert_eq!(seen[1].data, b"GET /");
        assert_eq!(seen[3].data, b"200 OK!!!!");
        for (name, v) in [
            ("frames_total", 7),
            ("data_bytes_down_total", 5),
            ("data_bytes_up_total", 10),
            ("opens_total", 1),
            ("fins_total", 1),
            ("aborts_total", 1),
            ("acks_total", 1),
            ("not_stream_total", 1),
            ("frames_dropped_total", 0),
        ] {
            assert_eq!(u64_var(&sw, &format!("module.p.{name}")), v, "{name}");
        }
    }

    #[test]
    fn links_only_to_stream_and_any_ports() {
        let mut sw = Switch::default();
        sw.apply(vec![load("p", "stream-pass", &[]), load("c", "counter", &[]), load("i", "ip", &[])]).unwrap();
        sw.apply(vec![link("p -> c")]).unwrap();
        assert!(sw.apply(vec![link("p -> i")]).is_err(), "a stream port does not link to an ip port");
    }
}
