//! Flows: list and show, read from the registry. A flow is a prefix `flow.<id>` with a `tuple` meter; the module
//! that publishes it is the one whose `vars_prefix` (its setting, or its kind's default) is the prefix's parent,
//! and its kind says how the flow is handled (`classify`: forwarded; `terminate`, `originate`: the two sides of a
//! terminated flow). Its app is the sandboxed app whose modules include that module, else the app the endpoint
//! named in the tuple, else the app whose address is one of the tuple's.

use crate::actions::control::{internal, Control};
use flexstack_api::ops::{AppInfo, FlowDetail, FlowInfo, Handling, TcpMeters, VarValue};
use flexstack_api::protocol::{ApiError, ErrorCode};
use flexstack_core::vars::{GroupVars, Var};
use flexstack_core::{Registry, SharedRegistry, Value};
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};

/// A flow's `tuple` meter, parsed: `tcp 10.0.0.2:40000 <-> 10.0.0.1:80` (classify), `icmp A <-> B id 7`,
/// `proto 47 A <-> B`, `tcp 10.0.0.2:40000 -> 10.0.0.1:80 app "curl"` (terminate, originate).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tuple {
    /// `tcp`, `udp`, `icmp`, `icmpv6`, `proto N`.
    pub protocol: String,
    /// The first sender, or the app's side.
    pub src: Option<(IpAddr, Option<u16>)>,
    /// The other side.
    pub dst: Option<(IpAddr, Option<u16>)>,
    /// The app an endpoint named (`app "curl"`), if any.
    pub app: Option<String>,
}

/// An address with an optional port: `10.0.0.2:80`, `[fd00::2]:80`, `10.0.0.2`, `fd00::2`.
fn endpoint(text: &str) -> Option<(IpAddr, Option<u16>)> {
    if let Ok(sa) = text.parse::<SocketAddr>() {
        return Some((sa.ip(), Some(sa.port())));
    }
    text.parse::<IpAddr>().ok().map(|ip| (ip, None))
}

impl Tuple {
    /// Parses a `tuple` meter's text; the parts it cannot read stay `None`.
    pub fn parse(text: &str) -> Tuple {
        let (protocol, rest) = match text.strip_prefix("proto ") {
            Some(r) => {
                let (n, rest) = r.split_once(' ').unwrap_or((r, ""));
                (format!("proto {n}"), rest)
            }
            None => {
                let (p, rest) = text.split_once(' ').unwrap_or((text, ""));
                (p.to_string(), rest)
            }
        };
        let mut words = rest.split(' ');
        let src = words.next().and_then(endpoint);
        let dst = match words.next() {
            Some("<->" | "->") => words.next().and_then(endpoint),
            _ => None,
        };
        let app = rest.split_once(" app ").map(|(_, a)| unquote(a.trim()));
        Tuple { protocol, src, dst, app }
    }
}

/// A name written with `{:?}`: the quotes removed and `\"`, `\\` unescaped.
fn unquote(s: &str) -> String {
    let inner = s.strip_prefix('"').and_then(|s| s.strip_suffix('"')).unwrap_or(s);
    let mut out = String::new();
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        out.push(if c == '\\' { chars.next().unwrap_or('\\') } else { c });
    }
    out
}

/// How a module of `kind` handles the flows it publishes.
pub(crate) fn handling(kind: &str) -> Handling {
    match kind {
        "classify" => Handling::Forwarded,
        "terminate" => Handling::Terminated,
        "originate" => Handling::Originated,
        "carrier" => Handling::Carried,
        _ => Handling::Other,
    }
}

/// A loaded module that publishes flows: its name, kind, prefix and back-end.
pub(crate) struct Publisher {
    pub(crate) name: String,
    pub(crate) kind: String,
    pub(crate) prefix: String,
    pub(crate) backend: Option<String>,
}

/// The text of a cell, if it holds text.
fn text_of(cell: Option<Var<'_>>) -> Option<String> {
    match cell?.get() {
        Value::Str(s) => Some(s),
        _ => None,
    }
}

/// The number of a cell, if it holds an unsigned one.
fn u64_of(cell: Option<Var<'_>>) -> Option<u64> {
    match cell?.get() {
        Value::U64(n) => Some(n),
        _ => None,
    }
}

/// The transport meters of a flow: its own `tcp.*` variables (an endpoint's), or the group `<prefix>.tcp` that the
/// flow-meters thread publishes; None if there are none.
fn tcp_meters(own: GroupVars<'_>, tcp: Option<GroupVars<'_>>) -> Option<TcpMeters> {
    let cell = |k: &str| match tcp {
        Some(g) => g.get(k),
        None => own.get(&format!("tcp.{k}")),
    };
    let (n, text) = (|k: &str| u64_of(cell(k)), |k: &str| text_of(cell(k)));
    let m = TcpMeters {
        state: text("state"),
        srtt_us: n("srtt_us"),
        cwnd: n("cwnd"),
        bytes_in_flight: n("bytes_in_flight"),
        retrans_total: n("retrans_total"),
        delivery_rate: n("delivery_rate"),
        send_queue: n("send_queue"),
        recv_queue: n("recv_queue"),
        cc: text("cc"),
    };
    (m != TcpMeters::default()).then_some(m)
}

/// False when the flow's TCP meters (group `tcp`) say they were read from a socket (`tcp.socket`, `local ->
/// remote`) that is not the flow's: meters of an earlier flow with the same id, left until the poller's next round.
fn same_socket(tcp: Option<GroupVars<'_>>, t: &Tuple) -> bool {
    let Some(text) = text_of(tcp.and_then(|g| g.get("socket"))) else { return true };
    let ends: Vec<Option<(IpAddr, Option<u16>)>> = text.split(" -> ").map(endpoint).collect();
    match ends.as_slice() {
        [Some(l), Some(r)] => (Some(*l), Some(*r)) == (t.src, t.dst) || (Some(*r), Some(*l)) == (t.src, t.dst),
        _ => false,
    }
}

/// The app a flow belongs to: the app whose modules include `module`, else the app an endpoint named, else the app
/// with one of the tuple's addresses.
pub(crate) fn app_of(apps: &[AppInfo], module: &str, t: &Tuple) -> Option<String> {
    if let Some(a) = apps.iter().find(|a| a.modules.iter().any(|m| m == module)) {
        return Some(a.name.clone());
    }
    if let Some(a) = t.app.as_ref().filter(|a| !a.is_empty()) {
        return Some(a.clone());
    }
    let ips = [t.src.map(|e| e.0), t.dst.map(|e| e.0)];
    apps.iter()
        .find(|a| ips.iter().flatten().any(|ip| ip.to_string() == a.ipv4 || ip.to_string() == a.ipv6))
        .map(|a| a.name.clone())
}

/// The flows in `reg`, each matched to its publisher among `publishers` and to its app among `apps`.
fn flows_in(reg: &Registry, publishers: &[Publisher], apps: &[AppInfo], only: Option<Handling>) -> Vec<FlowInfo> {
    // Every flow group with a `tuple`: one search, no name compared or sorted (there may be many thousands).
    let mut flows: Vec<FlowInfo> = reg
        .groups_under("flow.")
        .filter_map(|(prefix, own)| {
            let cell = own.get("tuple")?;
            let parent = prefix.rsplit_once('.').map_or("", |(p, _)| p);
            let publisher = publishers.iter().find(|p| p.prefix == parent);
            if only.is_some_and(|h| publisher.map(|p| handling(&p.kind)) != Some(h)) {
                return None;
            }
            let Value::Str(text) = cell.get() else { return None };
            // The transport meters the flow-meters thread adds under `<prefix>.tcp` (the flow's own: `own`).
            let tcp = reg.group(&format!("{prefix}.tcp"));
            let t = Tuple::parse(&text);
            let module = publisher.map_or(String::new(), |p| p.name.clone());
            let kind = publisher.map_or("", |p| p.kind.as_str());
            Some(FlowInfo {
                id: prefix.strip_prefix("flow.")?.to_string(),
                app: app_of(apps, &module, &t),
                handling: handling(kind),
                backend: publisher.and_then(|p| p.backend.clone()),
                protocol: t.protocol.clone(),
                src: t.src.map(|e| e.0),
                src_port: t.src.and_then(|e| e.1),
                dst: t.dst.map(|e| e.0),
                dst_port: t.dst.and_then(|e| e.1),
                tuple: text,
                bytes_down: u64_of(own.get("bytes_down_total")),
                bytes_up: u64_of(own.get("bytes_up_total")),
                packets: u64_of(own.get("packets_total")),
                tcp: tcp_meters(own, tcp).filter(|_| same_socket(tcp, &t)),
                peer: None,
                module,
            })
        })
        .collect();
    // The two sides of a terminated flow carry the same tuple (the app's side, the original destination, the app);
    // a carried flow's network side is its carrier's.
    let mut sides: HashMap<(Handling, String), String> = HashMap::new();
    for f in &flows {
        if matches!(f.handling, Handling::Terminated | Handling::Originated | Handling::Carried) {
            sides.entry((f.handling, f.tuple.clone())).or_insert_with(|| f.id.clone());
        }
    }
    for f in &mut flows {
        let others: &[Handling] = match f.handling {
            Handling::Terminated => &[Handling::Originated, Handling::Carried],
            Handling::Originated | Handling::Carried => &[Handling::Terminated],
            _ => continue,
        };
        f.peer = others.iter().find_map(|h| sides.get(&(*h, f.tuple.clone())).cloned());
    }
    flows
}

/// A flow id as the user may write it: `app1.3` or `flow.app1.3`.
fn flow_id(id: &str) -> &str {
    id.strip_prefix("flow.").unwrap_or(id)
}

impl Control {
    /// The registry every meter and knob is published in (the flow meters' poller adds to it).
    pub fn registry(&self) -> SharedRegistry {
        self.registry.clone()
    }

    /// The loaded modules that publish flows, with their prefix: the `vars_prefix` setting, or the kind's default.
    pub(crate) fn publishers(&self) -> Result<Vec<Publisher>, ApiError> {
        let snap = self.dp().snapshot().map_err(internal)?;
        let reference = self.catalog.reference();
        let default = |kind: &str, setting: &str| {
            let k = reference.iter().find(|r| r.kind == kind)?;
            let s = k.settings.iter().find(|s| s.name == setting)?;
            Some(s.default.trim_matches('"').to_string())
        };
        let publishers = snap.spec.modules.iter().filter_map(|m| {
            let kind = self.kind_name(&m.kind);
            let setting = |k: &str| {
                m.settings.get(k).map(|v| v.value.as_str().map_or_else(|| v.value.to_string(), str::to_string))
            };
            let prefix = setting("vars_prefix").or_else(|| default(&kind, "vars_prefix"))?;
            let backend = match handling(&kind) {
                Handling::Terminated | Handling::Originated => setting("backend").or_else(|| default(&kind, "backend")),
                _ => None,
            };
            Some(Publisher { name: m.name.clone(), kind, prefix, backend })
        });
        Ok(publishers.collect())
    }

    /// `flow_list`: every flow, sorted by id.
    pub fn flows(&self) -> Result<Vec<FlowInfo>, ApiError> {
        self.flows_handled(None)
    }

    /// The flows handled as `only` says (all of them: `None`), sorted by id. Only those are read: the flow-meters
    /// thread asks every second for the forwarded ones among, it may be, tens of thousands of terminated ones.
    pub fn flows_handled(&self, only: Option<Handling>) -> Result<Vec<FlowInfo>, ApiError> {
        let publishers = self.publishers()?;
        let apps = self.sandboxes.list();
        Ok(flows_in(&self.registry.snapshot(), &publishers, &apps, only))
    }

    /// `flow_show`: one flow and every variable under its prefix.
    pub(super) fn flow_show(&self, id: &str) -> Result<FlowDetail, ApiError> {
        let id = flow_id(id);
        let flow =
            self.flows()?.into_iter().find(|f| f.id == id).ok_or_else(|| {
                ApiError::new(ErrorCode::NotFound, format!("no flow {id:?} (see `flexstack flow list`)"))
            })?;
        let pattern = format!("flow.{id}.**");
        let reg = self.registry.snapshot_for(&pattern);
        let vars: BTreeMap<String, VarValue> = reg
            .matching(&pattern)
            .map(|(n, c)| (n.to_string(), VarValue { value: c.get(), unit: c.spec().unit.clone() }))
            .collect();
        Ok(FlowDetail { flow, vars })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flexstack_core::vars::{DynamicVars, VarSpec};
    use flexstack_core::ValueType;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn tuples_of_every_module_parse() {
        let t = Tuple::parse("tcp 10.0.0.2:40000 <-> 10.0.0.1:80");
        assert_eq!(t.protocol, "tcp");
        assert_eq!((t.src, t.dst), (Some((ip("10.0.0.2"), Some(40000))), Some((ip("10.0.0.1"), Some(80)))));
        assert_eq!(t.app, None);
        let t = Tuple::parse("udp [fd00::2]:7 <-> [fd00::1]:9");
        assert_eq!((t.src, t.dst), (Some((ip("fd00::2"), Some(7))), Some((ip("fd00::1"), Some(9)))));
        let t = Tuple::parse("icmp 10.0.0.2 <-> 10.0.0.1 id 7");
        assert_eq!(
            (t.protocol.as_str(), t.src, t.dst),
            ("icmp", Some((ip("10.0.0.2"), None)), Some((ip("10.0.0.1"), None)))
        );
        let t = Tuple::parse("proto 47 10.0.0.2 <-> 10.0.0.1");
        assert_eq!((t.protocol.as_str(), t.dst), ("proto 47", Some((ip("10.0.0.1"), None))));
        let t = Tuple::parse(r#"tcp 10.0.0.2:5 -> [fd00::1]:80 app "my \"app\"""#);
        assert_eq!((t.src, t.dst), (Some((ip("10.0.0.2"), Some(5))), Some((ip("fd00::1"), Some(80)))));
        assert_eq!(t.app.as_deref(), Some("my \"app\""));
        assert_eq!(Tuple::parse("garbage"), Tuple { protocol: "garbage".into(), ..Tuple::default() });
    }

    fn publish(dynamic: &mut DynamicVars, owner: &str, prefix: &str, tuple: &str, extra: &[(&str, Value)]) {
        // The poller's `tcp` meters have no tuple: they are not a flow of their own.
        let mut specs: Vec<VarSpec> = Vec::new();
        if !tuple.is_empty() {
            specs.push(VarSpec::meter("tuple", ValueType::Str, "", ""));
        }
        for (name, v) in extra {
            let ty = if matches!(v, Value::Str(_)) { ValueType::Str } else { ValueType::U64 };
            specs.push(VarSpec::meter(name, ty, "", ""));
        }
        let vars = dynamic.register(owner, prefix, &specs).unwrap();
        if !tuple.is_empty() {
            vars.meter("tuple").store(&Value::Str(tuple.into()));
        }
        for (name, v) in extra {
            vars.meter(name).store(v);
        }
    }

    fn app(name: &str, ipv4: &str, modules: &[&str]) -> AppInfo {
        AppInfo {
            name: name.into(),
            index: 1,
            netns: format!("fs-1-{name}"),
            app_dev: String::new(),
            host_dev: String::new(),
            ipv4: ipv4.into(),
            ipv6: "fd77::2".into(),
            modules: modules.iter().map(|m| m.to_string()).collect(),
            host_table: String::new(),
            uid: 0,
            pids: Vec::new(),
            cgroup: String::new(),
        }
    }

    #[test]
    fn flows_are_matched_to_their_module_app_and_peer() {
        let shared = SharedRegistry::default();
        let mut dynamic = DynamicVars::new(shared.clone());
        let fwd = [
            ("bytes_down_total", Value::U64(100)),
            ("bytes_up_total", Value::U64(2000)),
            ("packets_total", Value::U64(9)),
        ];
        publish(&mut dynamic, "a-flows", "flow.a.3", "tcp 10.9.1.2:4000 <-> 10.1.1.1:5201", &fwd);
        let sock = Value::Str("10.9.1.2:4000 -> 10.1.1.1:5201".into());
        let tcp = [("srtt_us", Value::U64(250)), ("cwnd", Value::U64(10)), ("socket", sock)];
        publish(&mut dynamic, "sockdiag", "flow.a.3.tcp", "", &tcp);
        // Meters left from an earlier flow 4 of another connection: not this flow's.
        publish(&mut dynamic, "a-flows", "flow.a.4", "tcp 10.9.1.2:4001 <-> 10.1.1.1:5201", &[]);
        let stale = [("srtt_us", Value::U64(9)), ("socket", Value::Str("10.9.1.2:3999 -> 10.1.1.1:5201".into()))];
        publish(&mut dynamic, "sockdiag", "flow.a.4.tcp", "", &stale);
        let tuple = r#"tcp 10.9.2.2:5000 -> 10.1.1.1:80 app "b""#;
        publish(&mut dynamic, "t", "flow.terminate.1", tuple, &[("tcp.state", Value::Str("established".into()))]);
        publish(&mut dynamic, "o", "flow.originate.1", tuple, &[]);
        publish(&mut dynamic, "x", "flow.other.1", "udp 10.9.3.2:1 <-> 10.1.1.1:2", &[]);
        let publishers = [
            Publisher { name: "a-flows".into(), kind: "classify".into(), prefix: "flow.a".into(), backend: None },
            Publisher {
                name: "t".into(),
                kind: "terminate".into(),
                prefix: "flow.terminate".into(),
                backend: Some("smoltcp".into()),
            },
            Publisher {
                name: "o".into(),
                kind: "originate".into(),
                prefix: "flow.originate".into(),
                backend: Some("kernel".into()),
            },
        ];
        let apps = [app("a", "10.9.1.2", &["a", "a-flows"]), app("c", "10.9.3.2", &["c"])];
        let flows = flows_in(&shared.snapshot(), &publishers, &apps, None);
        let ids: Vec<&str> = flows.iter().map(|f| f.id.as_str()).collect();
        assert_eq!(ids, ["a.3", "a.4", "originate.1", "other.1", "terminate.1"]);
        let forwarded = flows_in(&shared.snapshot(), &publishers, &apps, Some(Handling::Forwarded));
        assert_eq!(forwarded.iter().map(|f| f.id.as_str()).collect::<Vec<_>>(), ["a.3", "a.4"]);
        assert_eq!(forwarded, flows[..2], "the same flows, read alike");
        assert_eq!(flows[1].tcp, None, "stale meters are left out");
        let a = &flows[0];
        assert_eq!((a.app.as_deref(), a.module.as_str(), a.handling), (Some("a"), "a-flows", Handling::Forwarded));
        assert_eq!((a.src, a.src_port, a.dst_port), (Some(ip("10.9.1.2")), Some(4000), Some(5201)));
        assert_eq!((a.bytes_down, a.bytes_up, a.packets, a.backend.as_deref()), (Some(100), Some(2000), Some(9), None));
        let tcp = a.tcp.as_ref().unwrap();
        assert_eq!((tcp.srtt_us, tcp.cwnd, tcp.state.as_deref()), (Some(250), Some(10), None));
        let (o, x, t) = (&flows[2], &flows[3], &flows[4]);
        assert_eq!(
            (t.handling, t.app.as_deref(), t.peer.as_deref()),
            (Handling::Terminated, Some("b"), Some("originate.1"))
        );
        assert_eq!(t.tcp.as_ref().and_then(|m| m.state.as_deref()), Some("established"));
        assert_eq!(
            (o.handling, o.peer.as_deref(), o.backend.as_deref()),
            (Handling::Originated, Some("terminate.1"), Some("kernel"))
        );
        // No module publishes flow.other: unknown handling, the app found by its address.
        assert_eq!(
            (x.handling, x.module.as_str(), x.app.as_deref(), x.tcp.is_none()),
            (Handling::Other, "", Some("c"), true)
        );
        assert_eq!(flow_id("flow.a.3"), "a.3");
        assert_eq!(flow_id("a.3"), "a.3");
    }
}
