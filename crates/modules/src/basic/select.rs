//! `select` (formerly `switch`, which still loads): Click's Switch element: sends every frame to one selected output,
//! or drops them all. (The switch is the runtime that drives the graph; this kind selects.)
//!
//! Frames dropped by `select = -1` count in the switch's `frames_dropped_total` for this module. Its ports,
//! settings, knob and meter are declared once, in `DECL` below; docs/modules.md lists them.
//!
//! Procedure (control frame `Exec`): `select` with an integer argument sets the selection, like the knob, and
//! returns the previous selection.

use flexstack_core::module::port_type;
use flexstack_core::{
    field, kind_from_decl, Batch, ConfigError, KindDecl, Meter, MeterDecl, Module, ModuleBuilder, ModuleInterface,
    ModuleKind, ModuleVars, Output, Param, PortDecl, PortSpec, Settings, Value,
};

/// The kind's name in stack files.
pub const KIND: &str = "select";

/// Most output ports.
const MAX_OUTPUTS: u64 = 64;

/// The `select` module kind.
pub struct SelectKind;

/// Settings and knob value.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Config {
    outputs: u64,
    select: i64,
}

type P = Param<Config>;

/// The kind: ports, setting, knob and meter.
const DECL: KindDecl<Config, Meters> = KindDecl {
    inputs: &[PortDecl::new("in", port_type::ANY, "frames to steer")],
    outputs: &[PortDecl::new("0..N-1", port_type::ANY, "one port per output (`N` = `outputs`)")],
    params: &[
        P::u64("outputs", "", "number of output ports", 2, field!(outputs)).range(1.0, MAX_OUTPUTS as f64).setting(),
        P::i64("select", "", "output every frame goes to; -1 drops", 0, field!(select))
            .range_by(|c| (-1.0, c.outputs as f64 - 1.0), "-1..=N-1")
            .check(|c, v| {
                let (max, v) = (c.outputs as i64 - 1, v as i64);
                if !(-1..=max).contains(&v) {
                    let outputs = c.outputs;
                    return Err(format!(
                        "must be within -1..={max} (the module has {outputs} outputs; -1 drops), got {v}"
                    ));
                }
                Ok(())
            }),
    ],
    meters: &[MeterDecl::u64("frames_total", "frames", "frames received", |m| &mut m.frames)],
    ..KindDecl::new(KIND, "sends every frame to the selected output (Click's Switch); -1 drops")
};

impl ModuleKind for SelectKind {
    kind_from_decl!(DECL);

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        Ok(Box::new(SelectBuilder(DECL.settings(settings, Config::default())?)))
    }
}

struct SelectBuilder(Config);

impl ModuleBuilder for SelectBuilder {
    fn interface(&self) -> ModuleInterface {
        let mut iface = DECL.interface(&self.0);
        iface.outputs = (0..self.0.outputs).map(|i| PortSpec::new(i.to_string(), port_type::ANY)).collect();
        iface
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        DECL.publish(&self.0, vars);
        Box::new(Selector { cfg: self.0, knob: vars.meter("select"), m: DECL.meters(vars) })
    }
}

#[derive(Default)]
struct Meters {
    frames: Meter,
}

/// A running `select` module.
pub struct Selector {
    cfg: Config,
    /// The `select` knob's cell, updated by the procedure.
    knob: Meter,
    m: Meters,
}

impl Module for Selector {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        self.m.frames.add(input.len() as u64);
        match usize::try_from(self.cfg.select) {
            Ok(port) => out.emit_all(port, input),
            Err(_) => {
                for f in input.drain(..) {
                    out.drop_frame(f);
                }
            }
        }
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        DECL.write(&mut self.cfg, knob, value)
    }

    fn execute(&mut self, procedure: &str, argument: &Value, _out: &mut Output<'_>) -> Result<Value, String> {
        match procedure {
            "select" => {
                let previous = self.cfg.select;
                DECL.write(&mut self.cfg, "select", argument)?;
                self.knob.store(&Value::I64(self.cfg.select));
                Ok(Value::I64(previous))
            }
            _ => Err(format!("a select module has no procedure {procedure}; it has: select")),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::testutil::*;
    use flexstack_core::{ControlFrame, ControlOp, Switch, Time, Value};

    fn stack(args: &[&str]) -> Switch {
        let mut sw = Switch::default();
        sw.apply(vec![
            load("sw", "select", args),
            load("a", "sink", &[]),
            load("b", "sink", &[]),
            load("c", "sink", &[]),
            link("sw[0] -> a"),
            link("sw[1] -> b"),
            link("sw[2] -> c"),
        ])
        .unwrap();
        sw
    }

    fn send(sw: &mut Switch, n: usize, at: u64) {
        let mut b = packets(sw.pool(), n, 10);
        sw.inject("sw", "in", &mut b).unwrap();
        sw.run(Time::from_millis(at));
    }

    fn counts(sw: &Switch) -> [u64; 3] {
        ["a", "b", "c"].map(|m| u64_var(sw, &format!("module.{m}.frames_total")))
    }

    #[test]
    fn routes_by_select_and_drops_on_minus_one() {
        let mut sw = stack(&["outputs=3"]);
        send(&mut sw, 4, 1);
        assert_eq!(counts(&sw), [4, 0, 0]);
        sw.apply(vec![knob("sw", "select", Value::U64(2))]).unwrap();
        send(&mut sw, 5, 2);
        assert_eq!(counts(&sw), [4, 0, 5]);
        sw.apply(vec![knob("sw", "select", Value::I64(-1))]).unwrap();
        send(&mut sw, 6, 3);
        assert_eq!(counts(&sw), [4, 0, 5]);
        assert_eq!(u64_var(&sw, "module.sw.frames_dropped_total"), 6);
        assert_eq!(u64_var(&sw, "module.sw.frames_total"), 15);
        assert_eq!(var(&sw, "module.sw.select"), Value::I64(-1));
    }

    #[test]
    fn out_of_range_selection_is_refused() {
        let mut sw = stack(&["outputs=3", "select=1"]);
        assert_eq!(var(&sw, "module.sw.select"), Value::I64(1));
        let e = sw.apply(vec![knob("sw", "select", Value::U64(3))]).unwrap_err();
        assert!(e.message.contains("within"), "{e}");
        assert!(sw.apply(vec![knob("sw", "select", Value::I64(-2))]).is_err());
        assert_eq!(var(&sw, "module.sw.select"), Value::I64(1));
        send(&mut sw, 2, 1);
        assert_eq!(counts(&sw), [0, 2, 0]);
    }

    #[test]
    fn select_procedure_through_a_control_frame() {
        let mut sw = stack(&["outputs=3"]);
        let exec = |serial: u32, value: Value| ControlFrame {
            op: ControlOp::Exec,
            sender: "control".into(),
            dest: "sw".into(),
            serial,
            param: "select".into(),
            value,
        };
        sw.send_control(exec(7, Value::U64(1)));
        sw.run(Time::from_millis(1));
        let inbox = sw.take_control_inbox();
        assert_eq!(inbox.len(), 1);
        assert_eq!(inbox[0].op, ControlOp::ExecReply);
        assert_eq!(inbox[0].serial, 7);
        assert_eq!(inbox[0].value, Value::I64(0));
        assert_eq!(var(&sw, "module.sw.select"), Value::I64(1));
        send(&mut sw, 3, 2);
        assert_eq!(counts(&sw), [0, 3, 0]);

        sw.send_control(exec(8, Value::U64(9)));
        sw.run(Time::from_millis(3));
        let inbox = sw.take_control_inbox();
        assert_eq!(inbox[0].op, ControlOp::Error);
        assert!(inbox[0].value.to_string().contains("within -1..=2"), "{:?}", inbox[0]);
        assert_eq!(var(&sw, "module.sw.select"), Value::I64(1));

        let mut bad = exec(9, Value::U64(0));
        bad.param = "nope".into();
        sw.send_control(bad);
        sw.run(Time::from_millis(4));
        assert_eq!(sw.take_control_inbox()[0].op, ControlOp::Error);
    }

    #[test]
    fn one_output_is_the_default_port() {
        let mut sw = Switch::default();
        sw.apply(vec![load("sw", "select", &["outputs=1"]), load("s", "sink", &[]), link("sw -> s")]).unwrap();
        send(&mut sw, 2, 1);
        assert_eq!(u64_var(&sw, "module.s.frames_total"), 2);
    }

    #[test]
    fn rejects_bad_settings_with_their_location() {
        assert_config_error("[modules.sw]\nkind = \"select\"\noutputs = 2\nselect = 2\n", Some(4), &["-1..=1"]);
        assert_config_error("[modules.sw]\nkind = \"select\"\noutputs = 65\n", Some(3), &[]);
        assert_config_error(
            "[modules.sw]\nkind = \"select\"\n\nports = 3\n",
            Some(4),
            &["unknown setting `ports`", "outputs, select"],
        );
    }
}
