//! `switch`: Click's Switch element: sends every frame to one selected output, or drops them all.
//!
//! - Ports: input `in` (any); outputs `0`, `1`, ... `N-1` (any), where `N` is the `outputs` setting.
//! - Settings: `outputs` (u64, default 2, 1..=64): number of output ports; and the knob below.
//! - Knobs (also accepted as a setting): `select` (i64, default 0, -1..=N-1): the output every frame goes to; -1
//!   drops every frame (counted in the switch's `frames_dropped_total` for this module).
//! - Meters: `frames_total` (frames) received.
//! - Procedures (control frame `Exec`): `select` with an integer argument sets the selection, like the knob, and
//!   returns the previous selection.

use flexstack_core::module::port_type;
use flexstack_core::{
    Batch, ConfigError, Meter, Module, ModuleBuilder, ModuleInterface, ModuleKind, ModuleVars, Output, PortSpec,
    Settings, Value, ValueType, VarSpec,
};

/// The kind's name in stack files.
pub const KIND: &str = "switch";

/// Most output ports.
const MAX_OUTPUTS: u64 = 64;

/// The `switch` module kind.
pub struct SwitchKind;

impl ModuleKind for SwitchKind {
    fn name(&self) -> &'static str {
        KIND
    }

    fn summary(&self) -> &'static str {
        "sends every frame to the selected output (Click's Switch); -1 drops"
    }

    fn configure(&self, settings: &Settings) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
        let mut r = settings.reader(KIND);
        let outputs = r.u64_in("outputs", 2, 1, MAX_OUTPUTS)?;
        let select = r.i64("select")?.unwrap_or(0);
        let max = outputs as i64 - 1;
        if !(-1..=max).contains(&select) {
            return Err(r.error(
                "select",
                format_args!("must be within -1..={max} (the module has {outputs} outputs; -1 drops), got {select}"),
            ));
        }
        r.finish()?;
        Ok(Box::new(SwitchBuilder { outputs: outputs as usize, select }))
    }
}

struct SwitchBuilder {
    outputs: usize,
    select: i64,
}

impl ModuleBuilder for SwitchBuilder {
    fn interface(&self) -> ModuleInterface {
        ModuleInterface {
            inputs: vec![PortSpec::new("in", port_type::ANY)],
            outputs: (0..self.outputs).map(|i| PortSpec::new(i.to_string(), port_type::ANY)).collect(),
            vars: vec![
                VarSpec::knob("select", ValueType::I64, "", "output every frame goes to; -1 drops")
                    .with_range(-1.0, self.outputs as f64 - 1.0),
                VarSpec::meter("frames_total", ValueType::U64, "frames", "frames received"),
            ],
            breaks_cycles: false,
        }
    }

    fn build(self: Box<Self>, vars: &ModuleVars) -> Box<dyn Module> {
        let knob = vars.meter("select");
        knob.store(&Value::I64(self.select));
        Box::new(Selector { outputs: self.outputs, select: self.select, knob, frames: vars.meter("frames_total") })
    }
}

/// A running `switch` module.
pub struct Selector {
    outputs: usize,
    select: i64,
    knob: Meter,
    frames: Meter,
}

impl Selector {
    /// Checks and converts a selection.
    fn check(&self, value: &Value) -> Result<i64, String> {
        let Value::I64(v) = value.coerce(ValueType::I64)? else {
            return Err(format!("expected an integer, got {value}"));
        };
        let max = self.outputs as i64 - 1;
        if !(-1..=max).contains(&v) {
            return Err(format!("select must be within -1..={max}, got {v}"));
        }
        Ok(v)
    }
}

impl Module for Selector {
    fn process(&mut self, _port: usize, input: &mut Batch, out: &mut Output<'_>) {
        self.frames.add(input.len() as u64);
        match usize::try_from(self.select) {
            Ok(port) => out.emit_all(port, input),
            Err(_) => {
                for f in input.drain(..) {
                    out.drop_frame(f);
                }
            }
        }
    }

    fn write_knob(&mut self, knob: &str, value: &Value) -> Result<(), String> {
        match knob {
            "select" => {
                self.select = self.check(value)?;
                Ok(())
            }
            _ => Err(format!("a switch has no knob {knob}")),
        }
    }

    fn execute(&mut self, procedure: &str, argument: &Value, _out: &mut Output<'_>) -> Result<Value, String> {
        match procedure {
            "select" => {
                let v = self.check(argument)?;
                let previous = std::mem::replace(&mut self.select, v);
                self.knob.store(&Value::I64(v));
                Ok(Value::I64(previous))
            }
            _ => Err(format!("a switch has no procedure {procedure}; it has: select")),
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
            load("sw", "switch", args),
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
        sw.apply(vec![load("sw", "switch", &["outputs=1"]), load("s", "sink", &[]), link("sw -> s")]).unwrap();
        send(&mut sw, 2, 1);
        assert_eq!(u64_var(&sw, "module.s.frames_total"), 2);
    }

    #[test]
    fn rejects_bad_settings_with_their_location() {
        let e = configure_toml("[modules.sw]\nkind = \"switch\"\noutputs = 2\nselect = 2\n").err().unwrap();
        assert_eq!(e.location.as_ref().unwrap().line, 4);
        assert!(e.message.contains("-1..=1"), "{e}");
        let e = configure_toml("[modules.sw]\nkind = \"switch\"\noutputs = 65\n").err().unwrap();
        assert_eq!(e.location.as_ref().unwrap().line, 3);
        let e = configure_toml("[modules.sw]\nkind = \"switch\"\n\nports = 3\n").err().unwrap();
        assert_eq!(e.location.as_ref().unwrap().line, 4);
        assert!(e.message.contains("unknown setting `ports`") && e.message.contains("outputs, select"), "{e}");
    }
}
