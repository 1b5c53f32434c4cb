//! `null`: a service that passes every frame unchanged; it does what every service does (its selection rules on
//! each flow's `Open`, its table of flows, its meters) and nothing else, so a chain of them measures what a service
//! costs (issue 15's overhead benchmark). Its knob `active` (false: it counts nothing) is there for the chains that
//! switch services (docs/services.md).

use super::active;
use super::flows::{read_select, Flows, HandedFlows, Seen, SelectRule, SelectionMeters, SELECT, SELECT_DOC};
use crate::stream::{u64_meters, BOTH_WAYS_IN, BOTH_WAYS_OUT};
use flexstack_core::module::handed_over;
use flexstack_core::{
    field, kind_from_decl, Batch, ConfigError, Direction, Frame, KindDecl, Meter, Module, ModuleBuilder,
    ModuleInterface, ModuleKind, ModuleVars, Output, Param, Settings, Value,
};

/// The kind's name in stack files.
pub const KIND: &str = "null";

/// The `null` module kind.
pub struct NullKind;

/// Its knob.
struct Config {
    active: bool,
}

/// The kind: ports, settings and meters.
const DECL: KindDecl<Config, Meters> = KindDecl {
    inputs: BOTH_WAYS_IN,
    outputs: BOTH_WAYS_OUT,
    params: &[active::param(field!(active)), Param::manual(SELECT, "array of strings", SELECT_DOC, "[\"use *\"]")],
    meters: u64_meters![
        down: "bytes_down_total", "bytes", "bytes of chosen flows passed down";
        up: "bytes_up_total", "bytes", "bytes of chosen flows passed up";
    ],
    more_meters: SelectionMeters::specs,
    breaks_cycles: true,
    ..KindDecl::new(KIND, "a stream service that passes its flows' bytes unchanged (to measure what a service costs)")
};

/// The meters.
#[derive(Default)]
struct Meters {
    down: Meter,
    up: Meter,
}

impl ModuleKind for NullKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(KIND);
        let mut cfg = Config { active: true };
        DECL.read(&mut r, &mut cfg)?;
        let rules = read_select(&mut r)?;
        r.finish()?;
        Ok(Box::new(NullBuilder { cfg, rules }))
    }
}

struct NullBuilder {
    cfg: Config,
    rules: Vec<SelectRule>,
}

impl ModuleBuilder for NullBuilder {
    fn interface(&self) -> ModuleInterface {
        DECL.interface(&self.cfg)
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        DECL.publish(&self.cfg, vars);
        Box::new(Null { cfg: self.cfg, flows: Flows::new(self.rules, vars), m: DECL.meters(vars) })
    }
}

/// A running `null`.
pub struct Null {
    cfg: Config,
    flows: Flows<()>,
    m: Meters,
}

impl Module for Null {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        for f in input.iter() {
            let Frame::Data(p) = f else { continue };
            match self.flows.see(p, |_| ()).0 {
                Seen::Data(_) if !self.cfg.active => {}
                Seen::Data(_) if p.direction() == Direction::Down => self.m.down.add(p.len() as u64),
                Seen::Data(_) => self.m.up.add(p.len() as u64),
                Seen::Fin(flow) => {
                    self.flows.fin(flow, p.direction());
                }
                _ => {}
            }
        }
        out.emit_all(0, input);
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        DECL.write(&mut self.cfg, knob, value)
    }

    fn take_state(&mut self) -> Option<Box<dyn std::any::Any>> {
        Some(Box::new(self.flows.take()))
    }

    fn adopt_state(&mut self, state: Box<dyn std::any::Any>) -> Result<(), String> {
        self.flows.adopt(handed_over::<HandedFlows<()>>(state, "a null's flows")?);
        Ok(())
    }
}
