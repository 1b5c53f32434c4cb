//! `sink`: consumes every frame it receives, counting it and dropping it.
//!
//! Frames are dropped through [`Output::drop_frame`], so they also show in the switch's
//! `module.<name>.frames_dropped_total` (the drop reason is "sink": everything a sink receives is dropped).
//!
//! No outputs, no settings. Its ports and meters are declared once, in `DECL` below; docs/modules.md lists them.

use flexstack_core::module::port_type;
use flexstack_core::{
    kind_from_decl, Batch, ConfigError, KindDecl, Meter, MeterDecl, Module, ModuleBuilder, ModuleKind, Output,
    PortDecl, Settings,
};

/// The kind's name in stack files.
pub const KIND: &str = "sink";

/// The `sink` module kind.
pub struct SinkKind;

/// The kind's ports and meters.
const DECL: KindDecl<(), Sink> = KindDecl {
    inputs: &[PortDecl::new("in", port_type::ANY, "frames to consume")],
    meters: &[
        MeterDecl::u64("frames_total", "frames", "frames received and dropped", |m| &mut m.frames),
        MeterDecl::u64("bytes_total", "bytes", "bytes of the data frames received", |m| &mut m.bytes),
    ],
    ..KindDecl::new(KIND, "consumes and counts frames, dropping them")
};

impl ModuleKind for SinkKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        DECL.configure(settings, (), |(), sink, _| Box::new(sink))
    }
}

/// A running sink.
#[derive(Default)]
pub struct Sink {
    frames: Meter,
    bytes: Meter,
}

impl Module for Sink {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        self.frames.add(input.len() as u64);
        let mut bytes = 0u64;
        for f in input.drain(..) {
            bytes += f.len() as u64;
            out.drop_frame(f);
        }
        self.bytes.add(bytes);
    }
}

#[cfg(test)]
mod tests {
    use crate::testutil::*;
    use flexstack_core::{Switch, Time};

    #[test]
    fn counts_and_drops_everything() {
        let mut sw = Switch::default();
        sw.apply(vec![load("s", "sink", &[])]).unwrap();
        for i in 0..3 {
            let mut b = packets(sw.pool(), 7, 50);
            sw.inject("s", "in", &mut b).unwrap();
            sw.run(Time::from_millis(i));
        }
        assert_eq!(u64_var(&sw, "module.s.frames_total"), 21);
        assert_eq!(u64_var(&sw, "module.s.bytes_total"), 21 * 50);
        assert_eq!(u64_var(&sw, "module.s.frames_dropped_total"), 21);
        assert_eq!(u64_var(&sw, "module.s.frames_in_total"), 21);
        // The packets went back to the pool.
        assert_eq!(sw.pool().stats().allocated, 7);
    }

    #[test]
    fn rejects_settings_with_their_location() {
        assert_config_error(
            "[modules.s]\nkind = \"sink\"\nlimit = 3\n",
            Some(3),
            &["unknown setting `limit` for a sink module"],
        );
    }
}
