//! `sink`: consumes every frame it receives, counting it and dropping it.
//!
//! Frames are dropped through [`Output::drop_frame`], so they also show in the switch's
//! `module.<name>.frames_dropped_total` (the drop reason is "sink": everything a sink receives is dropped).
//!
//! - Ports: input `in` (any); no outputs.
//! - Settings: none.
//! - Knobs: none.
//! - Meters: `frames_total` (frames) received, `bytes_total` (bytes) of the data frames received.

use flexstack_core::module::port_type;
use flexstack_core::{
    Batch, ConfigError, Meter, Module, ModuleBuilder, ModuleInterface, ModuleKind, ModuleVars, Output, PortSpec,
    Settings, ValueType, VarSpec,
};

/// The kind's name in stack files.
pub const KIND: &str = "sink";

/// The `sink` module kind.
pub struct SinkKind;

impl ModuleKind for SinkKind {
    fn name(&self) -> &'static str {
        KIND
    }

    fn summary(&self) -> &'static str {
        "consumes and counts frames, dropping them"
    }

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        settings.reader(KIND).finish()?;
        Ok(Box::new(SinkBuilder))
    }
}

struct SinkBuilder;

impl ModuleBuilder for SinkBuilder {
    fn interface(&self) -> ModuleInterface {
        ModuleInterface {
            inputs: vec![PortSpec::new("in", port_type::ANY)],
            outputs: Vec::new(),
            vars: vec![
                VarSpec::meter("frames_total", ValueType::U64, "frames", "frames received and dropped"),
                VarSpec::meter("bytes_total", ValueType::U64, "bytes", "bytes of the data frames received"),
            ],
            breaks_cycles: false,
        }
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        Box::new(Sink { frames: vars.meter("frames_total"), bytes: vars.meter("bytes_total") })
    }
}

/// A running sink.
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
        let e = configure_toml("[modules.s]\nkind = \"sink\"\nlimit = 3\n").err().unwrap();
        assert_eq!(e.location.as_ref().unwrap().line, 3);
        assert!(e.message.contains("unknown setting `limit` for a sink module"), "{e}");
    }
}
