//! `direction`: sends each data frame to `up` or `down` by the direction it travels (FINS's data frames carry
//! one): frames from the network travel up towards the applications, frames from the applications down. Lets one
//! module that sees both directions (a flow table) hand each frame on to the right side.
//!
//! Control frames are dropped. No settings. Its ports and meters are declared once, in `DECL` below;
//! docs/modules.md lists them.

use flexstack_core::module::port_type;
use flexstack_core::{
    kind_from_decl, Batch, ConfigError, Direction, Frame, KindDecl, Meter, MeterDecl, Module, ModuleBuilder,
    ModuleKind, Output, PortDecl, Settings,
};

/// The kind's name in stack files.
pub const KIND: &str = "direction";

const UP: usize = 0;
const DOWN: usize = 1;

/// The `direction` module kind.
pub struct DirectionKind;

/// The kind's ports and meters.
const DECL: KindDecl<(), Demux> = KindDecl {
    inputs: &[PortDecl::new("in", port_type::ANY, "frames travelling either way")],
    outputs: &[
        PortDecl::new("up", port_type::ANY, "data frames travelling up (from the network)"),
        PortDecl::new("down", port_type::ANY, "data frames travelling down (from the applications)"),
    ],
    meters: &[
        MeterDecl::u64(
            "up_total",
            "frames",
            "packets sent up (towards the applications; a GSO super-packet counts its segments)",
            |m| &mut m.up,
        ),
        MeterDecl::u64(
            "down_total",
            "frames",
            "packets sent down (towards the network; a GSO super-packet counts its segments)",
            |m| &mut m.down,
        ),
    ],
    accepts_gso: true,
    ..KindDecl::new(KIND, "sends frames to `up` or `down` by their direction of travel")
};

impl ModuleKind for DirectionKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        DECL.configure(settings, (), |(), demux, _| Box::new(demux))
    }
}

/// A running `direction` demultiplexer.
#[derive(Default)]
pub struct Demux {
    up: Meter,
    down: Meter,
}

impl Module for Demux {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        let (mut up, mut down) = (0, 0);
        for f in input.drain(..) {
            match &f {
                Frame::Data(p) if p.direction() == Direction::Up => {
                    up += p.wire_packets();
                    out.emit(UP, f);
                }
                Frame::Data(p) => {
                    down += p.wire_packets();
                    out.emit(DOWN, f);
                }
                Frame::Control(_) => out.drop_frame(f),
            }
        }
        self.up.add(up);
        self.down.add(down);
    }
}

#[cfg(test)]
mod tests {
    use flexstack_core::{Edit, LinkSpec, Switch, Time, Value};

    #[test]
    fn frames_go_by_direction() {
        let catalog = crate::catalog();
        let mut sw = Switch::default();
        let load = |name: &str, kind: &str| Edit::Load {
            name: name.into(),
            kind: kind.into(),
            settings: Default::default(),
            builder: catalog.configure(kind, &Default::default(), None).unwrap(),
        };
        sw.apply(vec![
            load("d", "direction"),
            load("u", "sink"),
            load("w", "sink"),
            Edit::Link(LinkSpec::parse("d[up] -> u").unwrap()),
            Edit::Link(LinkSpec::parse("d[down] -> w").unwrap()),
        ])
        .unwrap();
        let pool = sw.pool().clone();
        let mut batch: flexstack_core::Batch = (0..5)
            .map(|i| {
                let mut p = pool.alloc_from(&[i]);
                p.set_direction(if i % 2 == 0 {
                    flexstack_core::Direction::Up
                } else {
                    flexstack_core::Direction::Down
                });
                p.into()
            })
            .collect();
        sw.inject("d", "in", &mut batch).unwrap();
        sw.run(Time::from_millis(1));
        let reg = sw.registry().snapshot();
        assert_eq!(reg.get("module.u.frames_total").unwrap().get(), Value::U64(3));
        assert_eq!(reg.get("module.w.frames_total").unwrap().get(), Value::U64(2));
        assert_eq!(reg.get("module.d.down_total").unwrap().get(), Value::U64(2));
    }
}
