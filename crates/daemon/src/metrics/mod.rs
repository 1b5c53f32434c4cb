//! `flexstack daemon --metrics ADDR`: every meter and knob of the registry in OpenMetrics text at `GET /metrics`
//! (docs/metrics.md). A [`Collector`] of the official `prometheus-client` crate walks the registry at each scrape
//! through the same typed control API the CLI uses (`module_list`, `var_list`, `flow_list`); [`mapping`] names
//! the families; [`http`] its routes on the daemon's small blocking HTTP server ([`crate::http`]).

pub mod http;
pub mod mapping;

use crate::actions::{Caller, Control};
use flexstack_api::ops::{ConfigShow, RevisionStack};
use flexstack_api::protocol::Request;
use flexstack_core::vars::{Registry as VarRegistry, Var};
use flexstack_core::{StackSpec, Value};
use mapping::Series;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

/// What `--metrics` asked for.
#[derive(Clone, Debug)]
pub struct MetricsOptions {
    /// Address to listen on.
    pub addr: SocketAddr,
    /// Listen on an address other than loopback (`--metrics-public`): anyone who reaches it reads every meter.
    pub public: bool,
    /// Export the per-flow series of the this many flows with the most bytes (0: none, the default).
    pub flows_top: usize,
    /// Listen in this network namespace (a file such as `/proc/PID/ns/net`) instead of the daemon's own
    /// (`--metrics-netns`): how the lab's daemons, each in its namespace, are scraped from the host.
    pub netns: Option<std::path::PathBuf>,
}

/// One family of a scrape: its descriptor and samples.
struct Family {
    help: String,
    unit: Option<Unit>,
    counter: bool,
    samples: Vec<(Vec<(String, String)>, f64)>,
}

/// Collects the whole registry at each scrape.
pub struct RegistryCollector {
    control: Arc<Control>,
    flows_top: usize,
    stats: Arc<crate::http::Stats>,
}

impl std::fmt::Debug for RegistryCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryCollector").field("flows_top", &self.flows_top).finish()
    }
}

fn call<T: serde::de::DeserializeOwned>(control: &Control, request: Request) -> Result<T, String> {
    let caller = Caller { user: "metrics".into(), pid: None };
    let json = control.handle(request, &caller).map_err(|e| e.message)?;
    serde_json::from_value(json).map_err(|e| e.to_string())
}

/// The flow id of a variable `flow.<app>.<n>.<meter>`: `<app>.<n>`.
fn flow_id(name: &str) -> Option<&str> {
    let rest = name.strip_prefix("flow.")?;
    let app_end = rest.find('.')?;
    let n_len = rest[app_end + 1..].find('.')?;
    Some(&rest[..app_end + 1 + n_len])
}

/// A flow's bytes and its `tuple` variable.
type FlowBytes<'a> = (u64, Option<Var<'a>>);

/// Each flow's bytes (`bytes_total`, else the sum of its `bytes_*_total`) and its `tuple` variable, by id. Only
/// those meters are read, group by group: no variable's name is made.
fn flow_bytes(reg: &VarRegistry) -> HashMap<&str, FlowBytes<'_>> {
    let mut flows: HashMap<&str, FlowBytes<'_>> = HashMap::new();
    for (prefix, g) in reg.groups_under("flow.") {
        let Some(id) = group_flow_id(prefix) else { continue };
        let f = flows.entry(id).or_insert((0, None));
        // A group under a flow's (`flow.a.3.tcp`): its variables are not the flow's own meters.
        if prefix.len() != "flow.".len() + id.len() {
            continue;
        }
        let (mut total, mut parts) = (None, 0u64);
        for (leaf, var) in g.iter() {
            if leaf == "tuple" {
                f.1 = Some(var);
            } else if leaf == "bytes_total" {
                total = Some(var.load_u64());
            } else if leaf.starts_with("bytes_") && leaf.ends_with("_total") {
                parts = parts.saturating_add(var.load_u64());
            }
        }
        f.0 = total.unwrap_or(parts);
    }
    flows
}

/// The flow id of a group `flow.<app>.<n>` or one under it (`flow.<app>.<n>.tcp`): `<app>.<n>`.
fn group_flow_id(prefix: &str) -> Option<&str> {
    let rest = prefix.strip_prefix("flow.")?;
    let mut dots = rest.match_indices('.').map(|(i, _)| i);
    let app_end = dots.next()?;
    Some(dots.next().map_or(rest, |end| &rest[..end])).filter(|id| id.len() > app_end + 1)
}

/// The `top` flows with the most bytes: their ids and tuples.
fn top_flows(flows: HashMap<&str, FlowBytes<'_>>, top: usize) -> HashMap<String, String> {
    let mut by_bytes: Vec<(&str, FlowBytes<'_>)> = flows.into_iter().collect();
    by_bytes.sort_unstable_by(|a, b| b.1 .0.cmp(&a.1 .0).then(a.0.cmp(b.0)));
    let tuple = |c: Option<Var<'_>>| match c.map(|c| c.get()) {
        Some(Value::Str(t)) => t,
        _ => String::new(),
    };
    by_bytes.into_iter().take(top).map(|(id, (_, c))| (id.to_string(), tuple(c))).collect()
}

impl RegistryCollector {
    /// Every family of one scrape, by name.
    fn families(&self) -> Result<BTreeMap<String, Family>, String> {
        let start = Instant::now();
        // The modules and their kinds from the running stack's description (`config show`): `module list` would take
        // a snapshot of the whole registry a second time, flows and all, for meters read here anyway.
        let running: RevisionStack = call(&self.control, Request::ConfigShow(ConfigShow { rev: None }))?;
        let spec = StackSpec::parse("running stack", &running.stack).map_err(|e| e.to_string())?;
        let catalog = self.control.catalog();
        let modules: Vec<(String, String)> = spec
            .modules
            .iter()
            .map(|m| (m.name.clone(), catalog.canonical(&m.kind).unwrap_or(&m.kind).to_string()))
            .collect();
        let kinds: HashMap<&str, &str> = modules.iter().map(|(m, k)| (m.as_str(), k.as_str())).collect();
        let kind_of = |m: &str| kinds.get(m).map(|k| k.to_string());
        // The registry itself, walked once or twice: no copy of it through the control API's JSON (10,000 flows
        // are 90,000 variables).
        let reg = self.control.registry().snapshot();
        let (top, flow_count) = if self.flows_top > 0 {
            let flows = flow_bytes(&reg);
            let n = flows.len();
            (top_flows(flows, self.flows_top), n)
        } else {
            (HashMap::new(), 0)
        };
        let mut out: BTreeMap<String, Family> = BTreeMap::new();
        let conflicts = std::cell::Cell::new(0u64);
        let add = |s: Series, value: f64, description: &str, unit: &str, out: &mut BTreeMap<String, Family>| {
            let f = out.entry(s.family.clone()).or_insert_with(|| Family {
                help: s.help.clone().unwrap_or_else(|| mapping::help_text(description, unit)),
                unit: s.unit.clone(),
                counter: s.counter,
                samples: Vec::new(),
            });
            // Two declarations that name one family differently (an app's variable typed unlike another app's):
            // the first one wins, the other is counted, not exported under a wrong type or unit.
            if f.counter != s.counter || f.unit.as_ref().map(Unit::as_str) != s.unit.as_ref().map(Unit::as_str) {
                conflicts.set(conflicts.get() + 1);
                return;
            }
            f.samples.push((s.labels, value * s.scale));
        };
        // The variables of the flows not exported are skipped by group, before their names are made.
        let exported = |key: &str| flow_id(key).is_none_or(|id| top.contains_key(id));
        for (name, cell) in reg.iter_where(exported) {
            let name = name.as_ref();
            if !exported(name) {
                continue;
            }
            let spec = cell.spec();
            // An old name of a renamed variable would export its series twice.
            if spec.alias_of.is_some() {
                continue;
            }
            let Some(x) = mapping::number(&cell.get()) else { continue };
            if let Some(s) = mapping::map(name, spec.kind, &spec.unit, &kind_of) {
                add(s, x, &spec.description, &spec.unit, &mut out);
            }
        }
        let info = |family: &str, help: &str, labels: Vec<(String, String)>| Series {
            family: family.into(),
            unit: None,
            scale: 1.0,
            counter: false,
            labels,
            help: Some(help.into()),
        };
        for (name, kind) in &modules {
            let labels = vec![("module".into(), name.clone()), ("kind".into(), kind.clone())];
            add(
                info("flexstack_module_info", "a loaded module (always 1), with its kind", labels),
                1.0,
                "",
                "",
                &mut out,
            );
        }
        for (id, tuple) in top {
            let app = id.split('.').next().unwrap_or_default().to_string();
            let protocol = tuple.split(' ').next().unwrap_or_default().to_string();
            let labels =
                vec![("flow".into(), id), ("app".into(), app), ("protocol".into(), protocol), ("tuple".into(), tuple)];
            add(
                info("flexstack_flow_info", "an exported flow (always 1), with its endpoints", labels),
                1.0,
                "",
                "",
                &mut out,
            );
        }
        let own = [
            ("flexstack_metrics_flows", "flows the daemon holds (those exported: --metrics-flows)", flow_count as f64),
            (
                "flexstack_metrics_conflicts",
                "variables not exported: their family has another type or unit",
                conflicts.get() as f64,
            ),
            (
                "flexstack_metrics_collect_seconds",
                "time this scrape took to read the registry",
                start.elapsed().as_secs_f64(),
            ),
        ];
        for (family, help, value) in own {
            add(info(family, help, Vec::new()), value, "", "", &mut out);
        }
        for (reason, n) in self.stats.rejected() {
            let s = Series {
                counter: true,
                ..info("flexstack_metrics_http_rejected", "requests refused", vec![("reason".into(), reason.into())])
            };
            add(s, n as f64, "", "", &mut out);
        }
        Ok(out)
    }
}

/// One sample: a counter whole in its own unit as an integer (scaled, ns → s, it is a float), a gauge as a float.
fn encode_value(counter: bool, v: f64, e: MetricEncoder) -> Result<(), std::fmt::Error> {
    match counter {
        true if v.fract() == 0.0 && (0.0..u64::MAX as f64).contains(&v) => ConstCounter::new(v as u64).encode(e),
        true => ConstCounter::new(v.max(0.0)).encode(e),
        false => ConstGauge::new(v).encode(e),
    }
}

impl Collector for RegistryCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let families = self.families().map_err(|e| {
            tracing::warn!(error = %e, "metrics: cannot read the registry");
            std::fmt::Error
        })?;
        for (name, f) in &families {
            let ty = if f.counter { MetricType::Counter } else { MetricType::Gauge };
            let mut d = encoder.encode_descriptor(name, &f.help, f.unit.as_ref(), ty)?;
            match f.samples.as_slice() {
                // A family of one unlabelled sample (the switch's, the endpoint's own): `name value`, no `{}`.
                [(labels, v)] if labels.is_empty() => encode_value(f.counter, *v, d)?,
                samples => {
                    for (labels, v) in samples {
                        encode_value(f.counter, *v, d.encode_family(labels)?)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// The exposition of one scrape: OpenMetrics text ending in `# EOF`.
pub fn scrape(control: &Arc<Control>, flows_top: usize, stats: &Arc<crate::http::Stats>) -> Result<String, String> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(RegistryCollector {
        control: control.clone(),
        flows_top,
        stats: stats.clone(),
    }));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)
        .map_err(|_| "cannot read the registry".to_string())?;
    Ok(text)
}

impl MetricsOptions {
    /// Refuses an address other than loopback unless `public` (checked before the daemon starts anything).
    pub fn check(&self) -> Result<(), String> {
        if !self.addr.ip().is_loopback() && !self.public {
            return Err(format!(
                "--metrics {}: not a loopback address; anyone who reaches it reads every meter (add \
                 --metrics-public to mean it)",
                self.addr
            ));
        }
        Ok(())
    }
}

/// Binds the endpoint's socket (after [`MetricsOptions::check`]), in `--metrics-netns` if given: done at start,
/// while the daemon may still enter another namespace.
pub fn bind(opts: &MetricsOptions) -> Result<std::net::TcpListener, String> {
    opts.check()?;
    let addr = opts.addr;
    let listen = || std::net::TcpListener::bind(addr);
    let bound = match &opts.netns {
        None => listen(),
        Some(path) => {
            let ns = std::fs::File::open(path)
                .map_err(|e| format!("--metrics-netns {}: cannot open: {e}", path.display()))?;
            flexstack_faces::netconf::in_netns(std::os::fd::AsFd::as_fd(&ns), listen)
        }
    };
    let place = opts.netns.as_ref().map_or(String::new(), |p| format!(" in {}", p.display()));
    bound.map_err(|e| format!("--metrics {addr}{place}: cannot listen: {e}"))
}

/// Serves the endpoint on `listener` (from [`bind`]).
pub fn serve(
    control: Arc<Control>,
    opts: &MetricsOptions,
    listener: std::net::TcpListener,
) -> Result<crate::http::Server, String> {
    let flows_top = opts.flows_top;
    let stats = Arc::new(crate::http::Stats::default());
    let s = stats.clone();
    let c = control.clone();
    let handler = http::handler(move || scrape(&c, flows_top, &s));
    let server = crate::http::Server::start_on("metrics", listener, crate::http::Limits::default(), stats, handler)?;
    tracing::info!(addr = %server.addr(), "metrics served at /metrics");
    control.served_at("metrics", server.addr());
    Ok(server)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_unless_public() {
        let o = |addr: &str, public| MetricsOptions { addr: addr.parse().unwrap(), public, flows_top: 0, netns: None };
        assert!(o("127.0.0.1:9464", false).check().is_ok());
        assert!(o("[::1]:9464", false).check().is_ok());
        assert!(o("0.0.0.0:9464", false).check().unwrap_err().contains("--metrics-public"));
        assert!(o("0.0.0.0:9464", true).check().is_ok());
    }

    #[test]
    fn flow_ids_are_the_two_parts_after_flow() {
        assert_eq!(flow_id("flow.web.3.tcp.srtt_us"), Some("web.3"));
        assert_eq!(flow_id("flow.web.3.bytes_total"), Some("web.3"));
        assert_eq!(flow_id("flow.web.3"), None);
        assert_eq!(flow_id("module.web.3.x"), None);
    }

    #[test]
    fn top_flows_keeps_the_k_with_most_bytes() {
        use flexstack_core::vars::{DynamicVars, SharedRegistry};
        let shared = SharedRegistry::default();
        let mut dynamic = DynamicVars::new(shared.clone());
        // Flows' meters are runtime groups (a block, as classify registers them, or cells).
        let mut put = |prefix: &str, vars: &[(&str, Value)], block: bool| {
            let specs: Vec<_> =
                vars.iter().map(|(n, v)| flexstack_core::VarSpec::meter(n, v.value_type(), "", "")).collect();
            let specs = flexstack_core::VarSpecs::from(specs);
            if block {
                let b = dynamic.register_block("m", prefix, &specs).unwrap();
                vars.iter().enumerate().for_each(|(i, (_, v))| b.store(i, v));
            } else {
                let c = dynamic.register("m", prefix, &specs).unwrap();
                vars.iter().zip(c.cells()).for_each(|((_, v), c)| c.store(v));
            }
        };
        let tuple = ("tuple", Value::Str("udp a <-> b".into()));
        put("flow.a.1", &[("bytes_total", Value::U64(10)), ("bytes_down_total", Value::U64(999)), tuple], true);
        put("flow.a.1.tcp", &[("bytes_total", Value::U64(5000))], false);
        put("flow.a.2", &[("bytes_total", Value::U64(100))], false);
        put("flow.t.1", &[("bytes_down_total", Value::U64(30)), ("bytes_up_total", Value::U64(30))], true);
        let mut fixed = VarRegistry::default();
        let cell = flexstack_core::vars::VarCell::new(flexstack_core::VarSpec::meter(
            "x",
            flexstack_core::ValueType::U64,
            "",
            "",
        ));
        cell.store(&Value::U64(1000));
        fixed.insert("module.m.bytes_total".into(), Arc::new(cell));
        shared.publish(fixed);
        let reg = shared.snapshot();
        let flows = flow_bytes(&reg);
        assert_eq!(flows.len(), 3);
        assert_eq!(flows["a.1"].0, 10, "bytes_total wins over the directions");
        assert_eq!(flows["t.1"].0, 60);
        assert_eq!(top_flows(flow_bytes(&reg), 3)["a.1"], "udp a <-> b");
        let top = top_flows(flows, 2);
        assert_eq!(top.keys().map(String::as_str).collect::<std::collections::BTreeSet<_>>(), ["a.2", "t.1"].into());
        assert!(top_flows(flow_bytes(&reg), 0).is_empty());
    }
}
