//! From registry names to Prometheus metric families: one family per kind of thing measured, the things (module,
//! port, drop reason, flow, app) as labels, values in base units. Pure: no I/O, tested on its own.

use flexstack_core::vars::VarKind;
use flexstack_core::Value;
use prometheus_client::registry::Unit;

/// Meters every module has (the switch adds them): `flexstack_module_<name>{module,kind}`.
const STD_METERS: [&str; 6] =
    ["frames_in_total", "frames_out_total", "frames_dropped_total", "calls_total", "busy_ns_total", "held_frames"];

/// Family prefixes the mapping uses itself: a module kind named like one gets `kind_` before its name.
const RESERVED: [&str; 8] = ["switch", "module", "port", "flow", "app", "iface", "metrics", "kind"];

/// The family a variable belongs to, and its labels.
#[derive(Clone, Debug)]
pub struct Series {
    /// Family name without the unit and `_total` suffixes (the encoder appends them): `flexstack_port_frames_in`.
    pub family: String,
    /// Base unit, if the variable has one that Prometheus names.
    pub unit: Option<Unit>,
    /// Factor from the variable's unit to the base unit (ns → s: 1e-9).
    pub scale: f64,
    /// A counter (a meter whose name ends in `_total`), else a gauge.
    pub counter: bool,
    /// Label pairs, in a fixed order.
    pub labels: Vec<(String, String)>,
    /// `# HELP` text when it is not the variable's description ([`help_text`]): the drop counters' (the reason
    /// is a label), the endpoint's own.
    pub help: Option<String>,
}

/// Letters, digits and `_` as they are; anything else becomes `_` (metric names and label names).
pub fn sanitize(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect()
}

/// The base unit, its factor, and the words a name spells that unit with.
fn base_unit(unit: &str) -> Option<(Unit, f64, &'static [&'static str])> {
    const SECONDS: &[&str] = &["ns", "us", "ms", "s", "seconds", "secs"];
    match unit {
        "ns" => Some((Unit::Seconds, 1e-9, SECONDS)),
        "us" | "µs" => Some((Unit::Seconds, 1e-6, SECONDS)),
        "ms" => Some((Unit::Seconds, 1e-3, SECONDS)),
        "s" => Some((Unit::Seconds, 1.0, SECONDS)),
        "bytes" => Some((Unit::Bytes, 1.0, &["bytes"])),
        "bits" => Some((Unit::Other("bits".into()), 1.0, &["bits"])),
        _ => None,
    }
}

/// One line of help: no newlines, no backslashes left unescaped.
pub fn help_text(description: &str, unit: &str) -> String {
    let d = description.replace('\\', "\\\\").replace('\n', " ");
    match unit {
        "" => d,
        u if base_unit(u).is_some() => d,
        u => format!("{d} ({})", u.replace('\\', "\\\\").replace('\n', " ")),
    }
}

/// Maps the registry variable `name` (declared as `var_kind` with `unit`) to its series.
/// `module_kind` gives a module's kind by its name. `None`: not exported here (flows are handled by the caller,
/// which decides which ones; text values have no number).
pub fn map(name: &str, var_kind: VarKind, unit: &str, module_kind: &dyn Fn(&str) -> Option<String>) -> Option<Series> {
    let mut parts = name.splitn(2, '.');
    let (scope, rest) = (parts.next()?, parts.next()?);
    let (prefix, short, labels, help): (String, &str, Vec<(String, String)>, Option<String>) = match scope {
        "switch" => ("switch".into(), rest, Vec::new(), None),
        "module" => {
            let (module, var) = rest.split_once('.')?;
            let kind = module_kind(module).unwrap_or_default();
            let mut labels = vec![("module".to_string(), module.to_string()), ("kind".to_string(), kind.clone())];
            if let Some(port_var) = var.strip_prefix("port.") {
                let (port, m) = port_var.split_once('.')?;
                labels.push(("port".into(), port.into()));
                ("port".into(), m, labels, None)
            } else if let Some(reason) = var.strip_prefix("drop_").and_then(|r| r.strip_suffix("_total")) {
                labels.push(("reason".into(), reason.into()));
                let help = "frames a module dropped, by reason (see docs/modules.md for each kind's reasons)";
                ("module".into(), "drops_total", labels, Some(help.into()))
            } else if STD_METERS.contains(&var) || kind.is_empty() {
                ("module".into(), var, labels, None)
            } else {
                let k = sanitize(&kind);
                let k = if RESERVED.contains(&k.as_str()) { format!("kind_{k}") } else { k };
                (k, var, labels, None)
            }
        }
        "flow" => {
            // flow.<app>.<n>.<meter…>: the id is the first two parts.
            let mut p = rest.splitn(3, '.');
            let (app, n, var) = (p.next()?, p.next()?, p.next()?);
            let labels = vec![("flow".to_string(), format!("{app}.{n}")), ("app".to_string(), app.to_string())];
            ("flow".into(), var, labels, None)
        }
        "app" => {
            let (app, var) = rest.split_once('.')?;
            ("app".into(), var, vec![("app".to_string(), app.to_string())], None)
        }
        "iface" => {
            let (iface, var) = rest.split_once('.')?;
            ("iface".into(), var, vec![("iface".to_string(), iface.to_string())], None)
        }
        "worker" => {
            // worker.<k>.<meter>: the data plane's workers (docs/architecture.md, "Workers").
            let (worker, var) = rest.split_once('.')?;
            ("worker".into(), var, vec![("worker".to_string(), worker.to_string())], None)
        }
        other => (sanitize(other), rest, Vec::new(), None),
    };
    let counter = var_kind == VarKind::Meter && short.ends_with("_total");
    let base = short.strip_suffix("_total").filter(|_| counter).unwrap_or(short);
    let (unit_enum, scale, words) = match base_unit(unit) {
        Some((u, f, w)) => (Some(u), f, w),
        None => (None, 1.0, &[][..]),
    };
    // The unit's word moves to the end (the encoder appends it): `busy_ns` → `busy` + `_seconds`.
    let words: Vec<&str> = base.split(['.', '_']).filter(|w| !w.is_empty() && !words.contains(w)).collect();
    let mut family = format!("flexstack_{prefix}");
    if !words.is_empty() {
        family.push('_');
        family.push_str(&sanitize(&words.join("_")));
    }
    Some(Series { family, unit: unit_enum, scale, counter, labels, help })
}

/// A variable's value as a number; text has none (`None`).
pub fn number(v: &Value) -> Option<f64> {
    match v {
        Value::Bool(b) => Some(f64::from(u8::from(*b))),
        Value::U64(n) => Some(*n as f64),
        Value::I64(n) => Some(*n as f64),
        Value::F64(x) => Some(*x),
        Value::Str(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(m: &str) -> Option<String> {
        match m {
            "a-ip" => Some("ip".into()),
            "tun0" => Some("tun".into()),
            "p" => Some("port".into()),
            _ => None,
        }
    }

    fn m(name: &str, unit: &str) -> Series {
        map(name, VarKind::Meter, unit, &kinds).unwrap()
    }

    fn labels(s: &Series) -> Vec<(&str, &str)> {
        s.labels.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
    }

    #[test]
    fn module_meters_share_one_family_with_module_and_kind_labels() {
        let s = m("module.a-ip.frames_in_total", "frames");
        assert_eq!((s.family.as_str(), s.counter, s.unit.is_none()), ("flexstack_module_frames_in", true, true));
        assert_eq!(labels(&s), [("module", "a-ip"), ("kind", "ip")]);
        assert_eq!(m("module.tun0.frames_in_total", "frames").family, s.family);
    }

    #[test]
    fn drop_reasons_become_a_label_of_one_counter() {
        let s = m("module.a-ip.drop_bad_checksum_total", "frames");
        assert_eq!((s.family.as_str(), s.counter), ("flexstack_module_drops", true));
        assert_eq!(labels(&s), [("module", "a-ip"), ("kind", "ip"), ("reason", "bad_checksum")]);
        assert!(!s.help.unwrap().contains("checksum"), "the help is the family's, not one reason's");
    }

    #[test]
    fn port_meters_get_a_port_label() {
        let s = m("module.tun0.port.in.frames_in_total", "frames");
        assert_eq!(s.family, "flexstack_port_frames_in");
        assert_eq!(labels(&s), [("module", "tun0"), ("kind", "tun"), ("port", "in")]);
    }

    #[test]
    fn times_are_seconds_and_the_unit_word_moves_to_the_end() {
        let s = m("module.a-ip.busy_ns_total", "ns");
        assert_eq!((s.family.as_str(), s.unit.as_ref().map(Unit::as_str)), ("flexstack_module_busy", Some("seconds")));
        assert_eq!(s.scale, 1e-9);
        let k = map("module.a-ip.timeout_ms", VarKind::Knob, "ms", &kinds).unwrap();
        assert_eq!((k.family.as_str(), k.counter, k.scale), ("flexstack_ip_timeout", false, 1e-3));
        let b = m("module.tun0.rx_bytes_total", "bytes");
        assert_eq!(
            (b.family.as_str(), b.unit.as_ref().map(Unit::as_str), b.scale),
            ("flexstack_tun_rx", Some("bytes"), 1.0)
        );
        // A name that is only the unit keeps the kind's prefix.
        assert_eq!(m("module.a-ip.bytes_total", "bytes").family, "flexstack_ip");
        assert_eq!(m("module.a-ip.bytes_pending", "bytes").family, "flexstack_ip_pending");
    }

    #[test]
    fn kind_specific_meters_are_named_after_the_kind_not_the_module() {
        let s = m("module.tun0.rx_packets_total", "frames");
        assert_eq!(s.family, "flexstack_tun_rx_packets");
        // A kind that is named like one of the mapping's own prefixes is set apart.
        assert_eq!(m("module.p.queue_frames", "frames").family, "flexstack_kind_port_queue_frames");
        // A knob ending in _total is still a gauge.
        assert!(!map("module.tun0.max_total", VarKind::Knob, "", &kinds).unwrap().counter);
    }

    #[test]
    fn switch_flow_app_and_iface_variables() {
        assert_eq!(m("switch.runs_total", "").family, "flexstack_switch_runs");
        let f = m("flow.web.3.tcp.srtt_us", "us");
        assert_eq!((f.family.as_str(), f.scale), ("flexstack_flow_tcp_srtt", 1e-6));
        assert_eq!(labels(&f), [("flow", "web.3"), ("app", "web")]);
        let w = m("worker.1.busy_ns_total", "ns");
        assert_eq!((w.family.as_str(), w.scale, w.counter), ("flexstack_worker_busy", 1e-9, true));
        assert_eq!(labels(&w), [("worker", "1")]);
        let a = m("app.voip.loss", "");
        assert_eq!((a.family.as_str(), labels(&a)), ("flexstack_app_loss", vec![("app", "voip")]));
        let i = m("iface.eth-0.queue_frames", "frames");
        assert_eq!((i.family.as_str(), labels(&i)), ("flexstack_iface_queue_frames", vec![("iface", "eth-0")]));
    }

    #[test]
    fn odd_names_are_sanitized_and_help_is_one_line() {
        let s = map("module.x.a-b_total", VarKind::Meter, "pkt/s", &kinds).unwrap();
        assert_eq!(s.family, "flexstack_module_a_b");
        assert_eq!(help_text("line\none \\", "pkt/s"), "line one \\\\ (pkt/s)");
        assert_eq!(help_text("t", "ns"), "t", "a base unit is in the name, not the help");
        assert!(map("module", VarKind::Meter, "", &kinds).is_none());
        assert!(map("module.nodot", VarKind::Meter, "", &kinds).is_none());
    }

    #[test]
    fn values_are_numbers_except_text() {
        assert_eq!(number(&Value::Bool(true)), Some(1.0));
        assert_eq!(number(&Value::U64(7)), Some(7.0));
        assert_eq!(number(&Value::Str("x".into())), None);
    }
}
