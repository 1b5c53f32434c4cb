//! `flexstack daemon --metrics ADDR`: every meter and knob of the registry in OpenMetrics text at `GET /metrics`
//! (docs/metrics.md). A [`Collector`] of the official `prometheus-client` crate walks the registry at each scrape
//! through the same typed control API the CLI uses (`module_list`, `var_list`, `flow_list`); [`mapping`] names
//! the families; [`http`] is the small blocking server on its own thread.

pub mod http;
pub mod mapping;

use crate::actions::{Caller, Control};
use flexstack_api::ops::{FlowInfo, ModuleInfo, VarInfo, VarList};
use flexstack_api::protocol::Request;
use mapping::Series;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use std::collections::{BTreeMap, HashMap, HashSet};
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
    stats: Arc<http::Stats>,
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

/// The ids of the `top` flows with the most bytes (both directions), and how many flows there are.
pub fn top_flows(flows: &[FlowInfo], top: usize) -> (HashSet<String>, usize) {
    let mut by_bytes: Vec<(u64, &str)> = flows
        .iter()
        .map(|f| (f.bytes_down.unwrap_or(0).saturating_add(f.bytes_up.unwrap_or(0)), f.id.as_str()))
        .collect();
    by_bytes.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    (by_bytes.into_iter().take(top).map(|(_, id)| id.to_string()).collect(), flows.len())
}

impl RegistryCollector {
    /// Every family of one scrape, by name.
    fn families(&self) -> Result<BTreeMap<String, Family>, String> {
        let start = Instant::now();
        let modules: Vec<ModuleInfo> = call(&self.control, Request::ModuleList)?;
        let kinds: HashMap<String, String> = modules.iter().map(|m| (m.name.clone(), m.kind.clone())).collect();
        let kind_of = |m: &str| kinds.get(m).cloned();
        let mut vars: Vec<VarInfo> = Vec::new();
        for pattern in ["switch.**", "module.**", "app.**", "iface.**"] {
            // A pattern nothing matches is an empty list (no apps yet), not an error.
            vars.extend(call::<Vec<VarInfo>>(
                &self.control,
                Request::VarList(VarList { pattern: Some(pattern.into()) }),
            )?);
        }
        let (top, flow_count) = if self.flows_top > 0 {
            let flows: Vec<FlowInfo> = call(&self.control, Request::FlowList)?;
            let (top, n) = top_flows(&flows, self.flows_top);
            for id in &top {
                vars.extend(call::<Vec<VarInfo>>(
                    &self.control,
                    Request::VarList(VarList { pattern: Some(format!("flow.{id}.**")) }),
                )?);
            }
            let tuples = flows.iter().filter(|f| top.contains(&f.id));
            (tuples.map(|f| (f.id.clone(), f.tuple.clone(), f.protocol.clone())).collect::<Vec<_>>(), n)
        } else {
            (Vec::new(), 0)
        };
        let mut out: BTreeMap<String, Family> = BTreeMap::new();
        let conflicts = std::cell::Cell::new(0u64);
        let add = |s: Series, value: f64, out: &mut BTreeMap<String, Family>| {
            let f = out.entry(s.family.clone()).or_insert_with(|| Family {
                help: s.help.clone(),
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
        for v in &vars {
            let Some(x) = mapping::number(&v.value) else { continue };
            let spec = &v.spec;
            if let Some(s) = mapping::map(&spec.name, spec.kind, &spec.unit, &spec.description, &kind_of) {
                add(s, x, &mut out);
            }
        }
        let info = |family: &str, help: &str, labels: Vec<(String, String)>| Series {
            family: family.into(),
            unit: None,
            scale: 1.0,
            counter: false,
            labels,
            help: help.into(),
        };
        for m in &modules {
            let labels = vec![("module".into(), m.name.clone()), ("kind".into(), m.kind.clone())];
            add(info("flexstack_module_info", "a loaded module (always 1), with its kind", labels), 1.0, &mut out);
        }
        for (id, tuple, protocol) in top {
            let app = id.split('.').next().unwrap_or_default().to_string();
            let labels =
                vec![("flow".into(), id), ("app".into(), app), ("protocol".into(), protocol), ("tuple".into(), tuple)];
            add(info("flexstack_flow_info", "an exported flow (always 1), with its endpoints", labels), 1.0, &mut out);
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
            add(info(family, help, Vec::new()), value, &mut out);
        }
        for (reason, n) in self.stats.rejected() {
            let s = Series {
                counter: true,
                ..info("flexstack_metrics_http_rejected", "requests refused", vec![("reason".into(), reason.into())])
            };
            add(s, n as f64, &mut out);
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
pub fn scrape(control: &Arc<Control>, flows_top: usize, stats: &Arc<http::Stats>) -> Result<String, String> {
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

/// Starts the endpoint (after [`MetricsOptions::check`]).
pub fn serve(control: Arc<Control>, opts: &MetricsOptions) -> Result<http::Server, String> {
    opts.check()?;
    let flows_top = opts.flows_top;
    let stats = Arc::new(http::Stats::default());
    let s = stats.clone();
    let handler = move || scrape(&control, flows_top, &s);
    let server = http::Server::start(opts.addr, http::Limits::default(), stats, Box::new(handler))?;
    tracing::info!(addr = %server.addr(), "metrics served at /metrics");
    Ok(server)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flexstack_api::ops::Handling;

    fn flow(id: &str, down: u64, up: Option<u64>) -> FlowInfo {
        FlowInfo {
            id: id.into(),
            app: None,
            module: String::new(),
            handling: Handling::Forwarded,
            backend: None,
            protocol: "udp".into(),
            src: None,
            src_port: None,
            dst: None,
            dst_port: None,
            tuple: String::new(),
            bytes_down: Some(down),
            bytes_up: up,
            packets: None,
            tcp: None,
            peer: None,
        }
    }

    #[test]
    fn only_loopback_unless_public() {
        let o = |addr: &str, public| MetricsOptions { addr: addr.parse().unwrap(), public, flows_top: 0 };
        assert!(o("127.0.0.1:9464", false).check().is_ok());
        assert!(o("[::1]:9464", false).check().is_ok());
        assert!(o("0.0.0.0:9464", false).check().unwrap_err().contains("--metrics-public"));
        assert!(o("0.0.0.0:9464", true).check().is_ok());
    }

    #[test]
    fn top_flows_keeps_the_k_with_most_bytes_both_ways() {
        let flows = [flow("a.1", 10, Some(0)), flow("a.2", 5, Some(100)), flow("b.1", 50, None), flow("b.2", 1, None)];
        let (top, n) = top_flows(&flows, 2);
        assert_eq!(n, 4);
        assert_eq!(top, ["a.2", "b.1"].iter().map(|s| s.to_string()).collect());
        assert_eq!(top_flows(&flows, 0).0.len(), 0);
        assert_eq!(top_flows(&flows, 10).0.len(), 4);
    }
}
