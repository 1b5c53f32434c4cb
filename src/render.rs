//! The text forms of the control API's results, as the CLI prints them without `-j` (with `-j` it prints the
//! result as JSON): tables with a header line, and `ok: revision N` with the switch's notes for changes.

use flexstack_api::ops::*;
use flexstack_api::{Value, VarKind};

/// A value as text: a string as itself, anything else as its JSON (`1`, `0.5`, `true`; `null` for a float that
/// is not finite).
pub fn plain(v: &Value) -> String {
    match v {
        Value::Str(s) => s.clone(),
        other => serde_json::to_string(other).unwrap_or_default(),
    }
}

/// An optional value as text, `-` when there is none.
fn optional(v: &Option<Value>) -> String {
    v.as_ref().map_or_else(|| "-".to_string(), plain)
}

/// `meter` or `knob`.
fn kind_name(k: VarKind) -> &'static str {
    match k {
        VarKind::Meter => "meter",
        VarKind::Knob => "knob",
    }
}

/// A table with left-aligned columns.
pub fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.len());
        }
    }
    let line = |cells: Vec<String>| {
        let mut s =
            cells.iter().enumerate().map(|(i, c)| format!("{c:<w$}", w = widths[i])).collect::<Vec<_>>().join("  ");
        s.truncate(s.trim_end().len());
        s.push('\n');
        s
    };
    let mut out = line(header.iter().map(|h| h.to_string()).collect());
    for r in rows {
        out.push_str(&line(r));
    }
    out
}

/// `ok` (with the revision a change became, if it is one), then the switch's notes.
fn ok(revision: Option<u64>, notes: &[String]) -> String {
    let mut out = match revision {
        Some(rev) => format!("ok: revision {rev}\n"),
        None => "ok\n".to_string(),
    };
    for n in notes {
        out.push_str(&format!("  note: {n}\n"));
    }
    out
}

/// A change to the stack.
pub fn change(c: &Change) -> String {
    ok(Some(c.revision), &c.notes)
}

/// `pause`, `resume`.
pub fn notes(n: &Notes) -> String {
    ok(None, &n.notes)
}

/// `set`.
pub fn set(s: &SetResult) -> String {
    ok(s.revision, &s.notes)
}

/// The daemon's kept capabilities for `status`: `net_admin,net_raw,...`, or `none`.
fn capability_names(list: &[String]) -> String {
    let names: Vec<String> = list.iter().map(|c| c.trim_start_matches("CAP_").to_lowercase()).collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(",")
    }
}

/// `status`.
pub fn status(r: &DaemonStatus) -> String {
    format!(
        "flexstack {} pid {}  up {:.0}s  revision {}  modules {}  links {}{}\ncapabilities {}\ndata plane {}\n",
        r.version,
        r.pid,
        r.uptime_s,
        r.revision,
        r.modules,
        r.links,
        if r.paused { "  PAUSED" } else { "" },
        capability_names(&r.capabilities.permitted),
        r.dataplane_scheduling
    )
}

/// `module list`: a row per module, then a row per port (the implicit control port only when something went
/// through it; JSON lists it always).
pub fn module_list(modules: &[ModuleInfo]) -> String {
    let mut rows = Vec::new();
    for m in modules {
        rows.push(vec![
            m.name.clone(),
            m.kind.clone(),
            m.state.clone(),
            String::new(),
            m.frames_in.to_string(),
            m.frames_out.to_string(),
            m.frames_dropped.to_string(),
        ]);
        for p in m.ports.iter().filter(|p| p.port != "ctl" || p.frames != 0) {
            let (fin, fout, fdrop) = match p.dir {
                PortDir::In => (p.frames.to_string(), String::new(), String::new()),
                PortDir::Out => (String::new(), p.frames.to_string(), p.dropped.unwrap_or_default().to_string()),
            };
            let port = format!("{} {} ({})", p.dir.name(), p.port, p.ty);
            rows.push(vec![String::new(), String::new(), String::new(), port, fin, fout, fdrop]);
        }
    }
    table(&["NAME", "KIND", "STATE", "PORT", "IN", "OUT", "DROPPED"], rows)
}

/// `module kinds`.
pub fn module_kinds(kinds: &[KindInfo]) -> String {
    table(&["KIND", "SUMMARY"], kinds.iter().map(|k| vec![k.kind.clone(), k.summary.clone()]).collect())
}

/// `module exec`: what the procedure returned.
pub fn exec(r: &ExecResult) -> String {
    format!("{}\n", plain(&r.result))
}

/// `link list`: the links as written, one a line.
pub fn links(l: &Links) -> String {
    l.links.iter().map(|x| format!("{x}\n")).collect()
}

/// `get`.
pub fn values(values: &Values) -> String {
    let rows = values.iter().map(|(k, v)| vec![k.clone(), plain(&v.value), v.unit.clone()]).collect();
    table(&["NAME", "VALUE", "UNIT"], rows)
}

/// `var list`.
pub fn var_list(vars: &[VarInfo]) -> String {
    let rows = vars
        .iter()
        .map(|v| {
            let (s, kind) = (&v.spec, kind_name(v.spec.kind).to_string());
            vec![s.name.clone(), kind, s.ty.to_string(), s.unit.clone(), plain(&v.value), s.description.clone()]
        })
        .collect();
    table(&["NAME", "KIND", "TYPE", "UNIT", "VALUE", "DESCRIPTION"], rows)
}

/// `show runtime`.
pub fn runtime(rows: &[RuntimeInfo]) -> String {
    let rows = rows
        .iter()
        .map(|m| {
            vec![
                m.module.clone(),
                m.kind.clone(),
                m.calls.to_string(),
                m.frames.to_string(),
                format!("{:.2}", m.frames_per_call),
                format!("{:.1}", m.ns_per_frame),
                m.drops.to_string(),
            ]
        })
        .collect();
    table(&["MODULE", "KIND", "CALLS", "FRAMES", "FRAMES/CALL", "NS/FRAME", "DROPS"], rows)
}

/// `config log`.
pub fn config_log(log: &[RevisionInfo]) -> String {
    let rows = log
        .iter()
        .map(|v| {
            let (user, change) = match &v.rule {
                // A rule's writes in one entry: `rules:cc`, the last write, how many since when.
                Some(w) => (
                    format!("{}:{}", v.user, w.rule),
                    format!("{} ({} writes since {})", v.change, w.writes, fmt_time(w.first_ms)),
                ),
                None => (v.user.clone(), v.change.clone()),
            };
            vec![v.revision.to_string(), fmt_time(v.time_ms), user, change]
        })
        .collect();
    table(&["REV", "TIME", "USER", "CHANGE"], rows)
}

/// `config show`: the stack description.
pub fn revision_stack(r: &RevisionStack) -> String {
    r.stack.clone()
}

/// `tap add`.
pub fn tap_added(r: &TapAdded) -> String {
    let file = if r.file.is_empty() { "the file" } else { r.file.as_str() };
    format!("ok: {} records to {file} (revision {})\n", r.tap, r.revision)
}

/// `tap list`.
pub fn tap_list(taps: &[TapInfo]) -> String {
    let setting = |s: &Option<String>| s.clone().unwrap_or_else(|| "null".into());
    let rows = taps
        .iter()
        .map(|t| {
            let counts = [t.frames, t.frames_pending, t.frames_unwritten].map(|n| n.to_string());
            let [frames, pending, unwritten] = counts;
            vec![t.name.clone(), t.taps.join(","), setting(&t.linktype), frames, pending, unwritten, setting(&t.file)]
        })
        .collect();
    let mut out = table(&["NAME", "TAPS", "LINKTYPE", "FRAMES", "PENDING", "UNWRITTEN", "FILE"], rows);
    for t in taps {
        if let Some(e) = &t.error {
            out.push_str(&format!("{}: error: {e}\n", t.name));
        }
    }
    out
}

/// `peer list`, `peer show`, `peer add`.
pub fn peer_list(peers: &[PeerInfo]) -> String {
    let rows = peers
        .iter()
        .map(|p| {
            let state = if p.state.is_empty() { "-".to_string() } else { p.state.clone() };
            let n = [p.connections, p.flows_active, p.bytes_out, p.bytes_in].map(|n| n.to_string());
            let [conns, flows, out, inb] = n;
            vec![p.name.clone(), p.addr.clone(), state, conns, flows, out, inb, p.fingerprint.clone()]
        })
        .collect();
    table(&["NAME", "ADDR", "STATE", "CONNECTIONS", "FLOWS", "BYTES_OUT", "BYTES_IN", "FINGERPRINT"], rows)
}

/// `app list`.
pub fn app_list(apps: &[AppInfo]) -> String {
    let rows = apps
        .iter()
        .map(|a| {
            let (name, netns, ipv4, ipv6) = (a.name.clone(), a.netns.clone(), a.ipv4.clone(), a.ipv6.clone());
            let pids: Vec<String> = a.pids.iter().map(|p| p.to_string()).collect();
            let pids = if pids.is_empty() { "-".to_string() } else { pids.join(",") };
            let cgroup = if a.cgroup.is_empty() { "-".to_string() } else { a.cgroup.clone() };
            vec![name, netns, ipv4, ipv6, a.uid.to_string(), pids, cgroup, a.modules.join(",")]
        })
        .collect();
    table(&["NAME", "NETNS", "IPV4", "IPV6", "UID", "PIDS", "CGROUP", "MODULES"], rows)
}

/// `service list`.
pub fn service_list(services: &[ServiceInfo]) -> String {
    let rows = services
        .iter()
        .map(|s| {
            let active = s.active.map_or_else(|| "-".to_string(), |a| a.to_string());
            vec![s.name.clone(), s.kind.clone(), s.module.clone(), active, s.flows.to_string(), s.select.join("; ")]
        })
        .collect();
    table(&["NAME", "KIND", "MODULE", "ACTIVE", "FLOWS", "SELECT"], rows)
}

/// `service show`: the service's row, then its variables.
pub fn service_show(d: &ServiceDetail) -> String {
    let mut out = service_list(std::slice::from_ref(&d.service));
    out.push('\n');
    out.push_str(&values(&d.vars));
    out
}

/// `app vars`: a row per variable.
pub fn app_vars(apps: &[RegisteredApp]) -> String {
    let mut rows = Vec::new();
    for a in apps {
        for v in &a.vars {
            let (kind, ty) = (kind_name(v.kind).to_string(), v.ty.to_string());
            rows.push(vec![v.name.clone(), kind, ty, plain(&v.value), a.uid.to_string(), a.pid.to_string()]);
        }
    }
    table(&["NAME", "KIND", "TYPE", "VALUE", "UID", "PID"], rows)
}

/// A number, or `-` when there is none.
fn number(n: Option<u64>) -> String {
    n.map_or_else(|| "-".to_string(), |n| n.to_string())
}

/// An address and port as one endpoint: `10.0.0.2:80`, `[fd00::2]:80`, `10.0.0.2`, `-`.
fn endpoint(ip: Option<std::net::IpAddr>, port: Option<u16>) -> String {
    match (ip, port) {
        (Some(ip), Some(p)) => std::net::SocketAddr::new(ip, p).to_string(),
        (Some(ip), None) => ip.to_string(),
        (None, _) => "-".into(),
    }
}

/// The columns of one flow in `flow list` and `flow show`.
fn flow_row(f: &FlowInfo) -> Vec<String> {
    let tcp = f.tcp.clone().unwrap_or_default();
    vec![
        f.id.clone(),
        f.app.clone().unwrap_or_else(|| "-".into()),
        // A terminated flow the app accepted from the network (its endpoints' tuple says `role server`).
        if f.tuple.contains(" role server ") {
            format!("{}/server", f.handling.name())
        } else {
            f.handling.name().into()
        },
        f.backend.clone().unwrap_or_else(|| "-".into()),
        f.protocol.clone(),
        endpoint(f.src, f.src_port),
        endpoint(f.dst, f.dst_port),
        number(f.bytes_down),
        number(f.bytes_up),
        tcp.state.unwrap_or_else(|| "-".into()),
        number(tcp.srtt_us),
        number(tcp.cwnd),
    ]
}

const FLOW_HEADER: [&str; 12] =
    ["ID", "APP", "HANDLING", "BACKEND", "PROTO", "SRC", "DST", "BYTES_DOWN", "BYTES_UP", "STATE", "SRTT_US", "CWND"];

/// `flow list`: a row per flow.
pub fn flow_list(flows: &[FlowInfo]) -> String {
    table(&FLOW_HEADER, flows.iter().map(flow_row).collect())
}

/// `flow show`: the flow's row, its module and peer, then its variables.
pub fn flow_show(d: &FlowDetail) -> String {
    let f = &d.flow;
    let mut out = table(&FLOW_HEADER, vec![flow_row(f)]);
    let module = if f.module.is_empty() { "-" } else { f.module.as_str() };
    out.push_str(&format!("module {module}  tuple {}\n", f.tuple));
    if let Some(peer) = &f.peer {
        out.push_str(&format!("peer {peer}\n"));
    }
    out.push('\n');
    out.push_str(&values(&d.vars));
    out
}

/// `rules load`.
pub fn rules_loaded(r: &RulesLoaded) -> String {
    let mut out = format!(
        "ok: rules revision {}: defined {}; loaded {}\n",
        r.revision,
        r.defined.join(", "),
        r.loaded.join(", ")
    );
    for w in &r.warnings {
        out.push_str(&format!("{w}\n"));
    }
    out
}

/// `rules unload`, `rules replace`, `rules rollback`.
pub fn rules_revision(r: &RulesRevision) -> String {
    format!("ok: rules revision {}\n", r.revision)
}

/// `rules list`: LOADED is `yes` for a rule loaded by itself, `dep` for one running only as a dependency.
pub fn rules_list(rules: &[RuleSummary]) -> String {
    let rows = rules
        .iter()
        .map(|x| {
            let loaded = if x.explicit {
                "yes"
            } else if x.instances != 0 {
                "dep"
            } else {
                "no"
            };
            vec![
                x.name.clone(),
                section_name(x.section).to_string(),
                loaded.to_string(),
                x.instances.to_string(),
                optional(&x.value),
                x.source.clone(),
            ]
        })
        .collect();
    table(&["RULE", "SECTION", "LOADED", "INSTANCES", "VALUE", "FILE"], rows)
}

/// A section as written on the wire (`default`, `manual`, `contextEnter`, `contextExit`).
fn section_name(s: RuleSection) -> &'static str {
    match s {
        RuleSection::Default => "default",
        RuleSection::Manual => "manual",
        RuleSection::ContextEnter => "contextEnter",
        RuleSection::ContextExit => "contextExit",
    }
}

/// A unit's state entry as text: a scalar as [`plain`], samples as a JSON list.
fn state_text(s: &UnitState) -> String {
    match s {
        UnitState::Value(v) => plain(v),
        UnitState::Samples(_) => serde_json::to_string(s).unwrap_or_default(),
    }
}

/// `rules show`: the rule's text and commands, then each instance with a table of its units.
pub fn rule(r: &RuleInfo) -> String {
    let mut out = format!("rule {} ({}, from {})\n", r.name, section_name(r.section), r.source);
    for t in &r.text {
        out.push_str(&format!("  {t}\n"));
    }
    out.push_str("commands:\n");
    for c in &r.commands {
        out.push_str(&format!("  {c}\n"));
    }
    if r.instances.is_empty() {
        out.push_str("not loaded\n");
    }
    for i in &r.instances {
        out.push_str(&format!(
            "instance [{}]  refcount {}  {}  value {}\n",
            i.captures.join(","),
            i.refcount,
            if i.pulled { "pulled" } else { "pushed" },
            optional(&i.value)
        ));
        let rows = i
            .units
            .iter()
            .map(|u| {
                let state = u.state.iter().map(|(k, v)| format!("{k}={}", state_text(v))).collect::<Vec<_>>().join(" ");
                vec![u.key.clone(), u.kind.clone(), u.inputs.join(","), optional(&u.value), state]
            })
            .collect();
        for line in table(&["UNIT", "KIND", "INPUTS", "VALUE", "STATE"], rows).lines() {
            out.push_str(&format!("  {line}\n"));
        }
    }
    out
}

/// `rules log`: the revisions (times in seconds on the rules thread's clock), then the notices.
pub fn rules_history(r: &RulesHistory) -> String {
    let rows = r
        .revisions
        .iter()
        .map(|v| {
            let t = v.at as f64 / 1e9;
            vec![v.number.to_string(), format!("{t:.3}s"), v.rules.to_string(), v.loaded.join(","), v.what.clone()]
        })
        .collect();
    let mut out = table(&["REV", "T", "RULES", "LOADED", "CHANGE"], rows);
    let l = &r.limits;
    out.push_str(&format!(
        "running: {} instances (cap {}), {} units, {} definitions, {:.1} MiB estimated (cap {:.1} MiB); {} \
         instances refused by a cap\n",
        r.instances,
        l.max_instances,
        r.units,
        r.definitions,
        r.memory_bytes as f64 / f64::from(1 << 20),
        l.max_memory_bytes as f64 / f64::from(1 << 20),
        r.refused_instances_total
    ));
    for n in &r.notices {
        let t = n.t_ms as f64 / 1e3;
        out.push_str(&format!("notice {t:.3}s: {}\n", n.message));
    }
    out
}

/// `rules diff`: its lines.
pub fn lines(lines: &[String]) -> String {
    lines.iter().map(|l| format!("{l}\n")).collect()
}

/// Milliseconds since the epoch as `YYYY-MM-DD HH:MM:SS` UTC.
pub fn fmt_time(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flows_render_as_a_table_with_dashes_for_what_is_absent() {
        let f = FlowInfo {
            id: "perf.3".into(),
            app: Some("perf".into()),
            module: "perf-flows".into(),
            handling: Handling::Forwarded,
            backend: None,
            protocol: "tcp".into(),
            src: Some("fd77::2".parse().unwrap()),
            src_port: Some(40000),
            dst: Some("10.1.7.2".parse().unwrap()),
            dst_port: Some(5201),
            tuple: "tcp [fd77::2]:40000 <-> 10.1.7.2:5201".into(),
            bytes_down: Some(1000),
            bytes_up: Some(20),
            packets: Some(5),
            tcp: Some(TcpMeters { state: Some("established".into()), srtt_us: Some(300), ..TcpMeters::default() }),
            peer: None,
        };
        let text = flow_list(std::slice::from_ref(&f));
        let row: Vec<&str> = text.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(
            row,
            [
                "perf.3",
                "perf",
                "forwarded",
                "-",
                "tcp",
                "[fd77::2]:40000",
                "10.1.7.2:5201",
                "1000",
                "20",
                "established",
                "300",
                "-"
            ]
        );
        let detail = FlowDetail { flow: f.clone(), vars: Values::new() };
        assert!(flow_show(&detail).contains("module perf-flows  tuple tcp [fd77::2]:40000 <-> 10.1.7.2:5201\n"));
        // The server role of a terminated flow shows in its handling.
        let served = FlowInfo {
            handling: Handling::Terminated,
            tuple: "tcp 10.200.9.2:40000 -> 10.77.1.2:8080 role server app \"web\"".into(),
            ..f
        };
        let text = flow_list(std::slice::from_ref(&served));
        assert_eq!(text.lines().nth(1).unwrap().split_whitespace().nth(2), Some("terminated/server"), "{text}");
    }

    #[test]
    fn time_format() {
        assert_eq!(fmt_time(0), "1970-01-01 00:00:00");
        assert_eq!(fmt_time(1_795_000_000_000), "2026-11-18 11:06:40");
    }
}
