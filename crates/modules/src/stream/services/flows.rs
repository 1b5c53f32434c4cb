//! What every service shares: its selection rules (setting `select`), the table of the flows it works on, and their
//! meters (docs/services.md).

use flexstack_core::config::SettingsReader;
use flexstack_core::stream::{FlowInfo, Protocol, Role, StreamEvent};
use flexstack_core::{ConfigError, Direction, Meter, ModuleVars, Packet, ValueType, VarSpec};
use flexstack_wire::cidr::{PortRange, Words};
use std::collections::HashMap;
use std::fmt;

/// The setting that holds a service's selection rules.
pub const SELECT: &str = "select";

/// One selection rule: `use|skip PROTOCOL [port PORTS] [role client|server|*]`, where `PROTOCOL` is `tcp`, `udp` or
/// `*`, and `PORTS` a comma-separated list of ports and ranges or `*`. The port is the flow's server port: its
/// original destination port (for a client, where the app connects; for a server, the port it accepted on).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelectRule {
    /// The service is used (true) or not (false) for a matching flow.
    pub used: bool,
    /// The protocol (`None`: both).
    pub protocol: Option<Protocol>,
    /// The ports (`None`: any).
    pub ports: Option<Vec<PortRange>>,
    /// The app's role (`None`: either).
    pub role: Option<Role>,
}

impl SelectRule {
    /// A rule that uses the service for every flow.
    pub const ALL: SelectRule = SelectRule { used: true, protocol: None, ports: None, role: None };

    /// Parses one rule; the error names the word at fault and what was expected.
    pub fn parse(text: &str) -> Result<SelectRule, String> {
        let mut w = Words::new(text);
        let used = match w.next("use or skip")? {
            "use" => true,
            "skip" => false,
            _ => return Err(w.error_last("expected use or skip")),
        };
        let protocol = parse_protocol(w.next("a protocol: tcp, udp or *")?).map_err(|e| w.error_last(&e))?;
        let mut rule = SelectRule { used, protocol, ports: None, role: None };
        let mut seen = (false, false);
        while let Some(word) = w.peek() {
            w.next("port, role or the end of the rule")?;
            match word {
                "port" if !seen.0 => {
                    seen.0 = true;
                    rule.ports =
                        parse_ports(w.next("ports: 80, 8000-8099, 80,443 or *")?).map_err(|e| w.error_last(&e))?;
                }
                "role" if !seen.1 => {
                    seen.1 = true;
                    rule.role = parse_role(w.next("client, server or *")?).map_err(|e| w.error_last(&e))?;
                }
                "port" | "role" => return Err(w.error_last(&format!("`{word}` given twice"))),
                _ => return Err(w.error_last("expected port, role or the end of the rule")),
            }
        }
        Ok(rule)
    }

    /// True if the rule matches the flow.
    pub fn matches(&self, info: &FlowInfo) -> bool {
        self.protocol.is_none_or(|p| p == info.protocol)
            && self.ports.as_ref().is_none_or(|l| l.iter().any(|r| r.contains(info.dst.port())))
            && self.role.is_none_or(|r| r == info.role)
    }
}

/// `tcp`, `udp` or `*` (case-insensitive, as FreeNA's files write `TCP`).
pub fn parse_protocol(text: &str) -> Result<Option<Protocol>, String> {
    match text.to_ascii_lowercase().as_str() {
        "tcp" => Ok(Some(Protocol::Tcp)),
        "udp" => Ok(Some(Protocol::Udp)),
        "*" => Ok(None),
        _ => Err(format!("expected a transport: tcp, udp or *, got {text:?}")),
    }
}

/// `client`, `server` or `*`.
pub fn parse_role(text: &str) -> Result<Option<Role>, String> {
    match text.to_ascii_lowercase().as_str() {
        "client" => Ok(Some(Role::Client)),
        "server" => Ok(Some(Role::Server)),
        "*" => Ok(None),
        _ => Err(format!("expected a role: client, server or *, got {text:?}")),
    }
}

/// `80`, `8000-8099`, `80,443` or `*`.
pub fn parse_ports(text: &str) -> Result<Option<Vec<PortRange>>, String> {
    if text == "*" {
        return Ok(None);
    }
    text.split(',').map(PortRange::parse).collect::<Result<Vec<_>, _>>().map(Some)
}

impl fmt::Display for SelectRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.used { "use " } else { "skip " })?;
        f.write_str(self.protocol.map_or("*", Protocol::name))?;
        if let Some(l) = &self.ports {
            let list: Vec<String> = l.iter().map(|r| r.to_string()).collect();
            write!(f, " port {}", list.join(","))?;
        }
        match self.role {
            Some(Role::Client) => f.write_str(" role client"),
            Some(Role::Server) => f.write_str(" role server"),
            None => Ok(()),
        }
    }
}

/// Reads the `select` setting (default: every flow); errors at its file:line.
pub fn read_select(r: &mut SettingsReader<'_>) -> Result<Vec<SelectRule>, ConfigError> {
    let Some(texts) = r.strings(SELECT)? else { return Ok(vec![SelectRule::ALL]) };
    texts
        .iter()
        .enumerate()
        .map(|(i, t)| SelectRule::parse(t).map_err(|e| r.error(SELECT, format!("rule {}: {e}", i + 1))))
        .collect()
}

/// The decision of an ordered list of rules: the first that matches; no match: not used.
pub fn selects(rules: &[SelectRule], info: &FlowInfo) -> bool {
    rules.iter().find(|r| r.matches(info)).is_some_and(|r| r.used)
}

/// The reference's line for the `select` setting.
pub const SELECT_DOC: &str = "selection rules, first match wins, no match: not used: `use|skip tcp|udp|* [port \
                              PORTS] [role client|server|*]` (docs/services.md)";

/// The meters every service has: what its selection chose.
pub struct SelectionMeters {
    selected: Meter,
    unselected: Meter,
    active: Meter,
}

impl SelectionMeters {
    const NAMES: [(&'static str, &'static str, &'static str); 3] = [
        ("flows_selected_total", "flows", "flows its `select` rules chose (it works on them)"),
        ("flows_unselected_total", "flows", "flows its `select` rules left out (passed unchanged)"),
        ("selected_flows_active", "flows", "flows it works on now"),
    ];

    /// Their declarations (`KindDecl::more_meters`).
    pub fn specs() -> Vec<VarSpec> {
        Self::NAMES.iter().map(|(n, u, d)| VarSpec::meter(n, ValueType::U64, u, d)).collect()
    }

    /// Bound to a module's variables.
    pub fn new(vars: &ModuleVars) -> SelectionMeters {
        let m = |i: usize| vars.meter(Self::NAMES[i].0);
        SelectionMeters { selected: m(0), unselected: m(1), active: m(2) }
    }
}

/// Hashes a flow id (a number the endpoint chose, not the network) with one multiplication: every frame of every
/// service looks its flow up, and SipHash was a visible share of a null service's cost in bulk.
#[derive(Default, Clone, Copy)]
pub struct FlowIdHasher(u64);

impl std::hash::Hasher for FlowIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0 ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// A map keyed by flow id.
type FlowMap<V> = HashMap<u64, V, std::hash::BuildHasherDefault<FlowIdHasher>>;

/// The flows a service works on, with its state `F` for each; the frames of other flows pass unchanged.
pub struct Flows<F> {
    rules: Vec<SelectRule>,
    map: FlowMap<Tracked<F>>,
    m: SelectionMeters,
}

struct Tracked<F> {
    state: F,
    fins: [bool; 2],
    udp: bool,
}

/// The flows of a service and their states, as it hands them to its replacement (`module replace`): the flows keep
/// the decision taken on their `Open`; the new module's rules apply to flows opened after.
pub struct HandedFlows<F>(FlowMap<Tracked<F>>);

/// What a stream frame is to a service (its bytes: the packet's).
pub enum Seen {
    /// An opening `Open` (Down for the client role, Up for the server role) its rules chose: its state was just
    /// made.
    Opened(u64, FlowInfo),
    /// `Data` of a flow it works on.
    Data(u64),
    /// `Fin` of a flow it works on.
    Fin(u64),
    /// `Ack` of so many bytes, of a flow it works on.
    Ack(u64, u64),
    /// The acceptance `Open` (the other way) of a flow it works on.
    Accepted(u64),
    /// An `Abort` of a flow it worked on: forgotten, with its state.
    Aborted(u64),
    /// Anything else: not a stream frame, a flow not chosen or not known: to pass on unchanged.
    Other,
}

/// Emits an ack of `n` bytes of `flow` travelling `dir` (nothing if `n` is 0).
pub fn ack(out: &mut flexstack_core::Output<'_>, flow: u64, dir: Direction, n: u64) {
    if n > 0 {
        out.emit(0, flexstack_core::StreamFrame::ack(out.pool(), flow, dir, n));
    }
}

/// For a service that changes lengths (an `AckMap` per data direction): an ack travelling `dir` of `n` output
/// bytes becomes an ack of the input bytes it frees.
pub fn translate_ack(
    acks: &mut [flexstack_core::AckMap; 2],
    flow: u64,
    dir: Direction,
    n: u64,
    out: &mut flexstack_core::Output<'_>,
) {
    let input = acks[slot(dir) ^ 1].acked(n);
    ack(out, flow, dir, input);
}

/// Down is 0, Up is 1 (per-direction arrays).
pub fn slot(d: Direction) -> usize {
    match d {
        Direction::Down => 0,
        Direction::Up => 1,
    }
}

impl<F> Flows<F> {
    /// A table with these rules and meters.
    pub fn new(rules: Vec<SelectRule>, vars: &ModuleVars) -> Flows<F> {
        Flows { rules, map: FlowMap::default(), m: SelectionMeters::new(vars) }
    }

    /// Looks at a frame: on a flow's opening `Open` the rules decide, and `make` builds the state of a chosen flow (a flow
    /// opened again replaces its state). Returns the state removed by an `Abort` through `aborted`.
    pub fn see(&mut self, p: &Packet, make: impl FnOnce(&FlowInfo) -> F) -> (Seen, Option<F>) {
        let (Some(flow), Some(event)) = (p.stream_flow(), p.stream()) else { return (Seen::Other, None) };
        match event {
            // A flow opens where its first packet was taken: Down from `terminate` for the client role, Up from
            // `originate` for the server role; the `Open` the other way is the far side's acceptance.
            StreamEvent::Open(info) if (p.direction() == Direction::Down) == (info.role == Role::Client) => {
                let chosen = selects(&self.rules, &info);
                if !chosen {
                    self.m.unselected.add(1);
                    self.map.remove(&flow);
                    self.m.active.set(self.map.len() as u64);
                    return (Seen::Other, None);
                }
                self.m.selected.add(1);
                let state = make(&info);
                self.map.insert(flow, Tracked { state, fins: [false; 2], udp: info.protocol == Protocol::Udp });
                self.m.active.set(self.map.len() as u64);
                (Seen::Opened(flow, info), None)
            }
            StreamEvent::Abort(_) => match self.map.remove(&flow) {
                Some(t) => {
                    self.m.active.set(self.map.len() as u64);
                    (Seen::Aborted(flow), Some(t.state))
                }
                None => (Seen::Other, None),
            },
            _ if !self.map.contains_key(&flow) => (Seen::Other, None),
            StreamEvent::Data(_) => (Seen::Data(flow), None),
            StreamEvent::Fin => (Seen::Fin(flow), None),
            StreamEvent::Ack(n) => (Seen::Ack(flow, n), None),
            StreamEvent::Open(_) => (Seen::Accepted(flow), None),
        }
    }

    /// The state of a flow it works on.
    pub fn get_mut(&mut self, flow: u64) -> Option<&mut F> {
        self.map.get_mut(&flow).map(|t| &mut t.state)
    }

    /// A `Fin` travelling `dir` was passed on: the flow is forgotten (its state returned) once both directions
    /// ended (one `Fin` for UDP).
    pub fn fin(&mut self, flow: u64, dir: Direction) -> Option<F> {
        let t = self.map.get_mut(&flow)?;
        t.fins[slot(dir)] = true;
        if t.udp || t.fins == [true, true] {
            return self.forget(flow);
        }
        None
    }

    /// Forgets a flow (the service closed it).
    pub fn forget(&mut self, flow: u64) -> Option<F> {
        let t = self.map.remove(&flow)?;
        self.m.active.set(self.map.len() as u64);
        Some(t.state)
    }

    /// Closes a flow the service cannot go on with: forgets it and aborts it both ways with `reason`, so that both
    /// endpoints reset their connections.
    pub fn close(&mut self, flow: u64, reason: &str, out: &mut flexstack_core::Output<'_>) {
        self.forget(flow);
        out.emit(0, flexstack_core::StreamFrame::abort(out.pool(), flow, Direction::Down, reason));
        out.emit(0, flexstack_core::StreamFrame::abort(out.pool(), flow, Direction::Up, reason));
    }

    /// Gives every flow away (to the replacement).
    pub fn take(&mut self) -> HandedFlows<F> {
        self.m.active.set(0);
        HandedFlows(std::mem::take(&mut self.map))
    }

    /// Takes over the flows of the module this one replaces.
    pub fn adopt(&mut self, handed: HandedFlows<F>) {
        self.map.extend(handed.0);
        self.m.active.set(self.map.len() as u64);
    }

    /// Flows it works on.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True if it works on no flow.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The flows and their states.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (u64, &mut F)> {
        self.map.iter_mut().map(|(k, t)| (*k, &mut t.state))
    }
}
