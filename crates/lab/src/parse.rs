//! Reading a lab file: the TOML tables with their locations ([`Tbl`]), the link parameters, and
//! [`Lab::parse`], one function per part of the file (`[lab]`, hosts, links, routes, programs, events).

use super::*;

type DeTable<'i> = toml::de::DeTable<'i>;
type DeValue<'i> = toml::de::DeValue<'i>;

/// The file being parsed: turns spans into locations.
struct Doc<'t> {
    file: Arc<str>,
    text: &'t str,
}

impl Doc<'_> {
    fn at(&self, span: Range<usize>) -> Location {
        Location::of_offset(&self.file, self.text, span.start)
    }

    fn start(&self) -> Location {
        Location { file: self.file.clone(), line: 1, column: 1 }
    }
}

/// A table with its spans; `what` names it in messages.
struct Tbl<'a, 'i, 'd> {
    doc: &'d Doc<'d>,
    values: &'a toml::Table,
    spans: Option<&'a DeTable<'i>>,
    location: Location,
    what: String,
}

impl<'a, 'i, 'd> Tbl<'a, 'i, 'd> {
    /// The table of a whole document, `what` in errors (with `spans`, where its keys and values are written).
    fn root(doc: &'d Doc<'d>, values: &'a toml::Table, spans: &'a DeTable<'i>, what: &str) -> Self {
        Tbl { doc, values, spans: Some(spans), location: doc.start(), what: what.into() }
    }

    fn err(&self, location: Location, message: impl Into<String>) -> ConfigError {
        ConfigError::new(Some(location), message)
    }

    /// Where `key` is written (its name), or the table.
    fn key_loc(&self, key: &str) -> Location {
        self.spans.and_then(|s| key_span(s, key)).map_or_else(|| self.location.clone(), |sp| self.doc.at(sp))
    }

    /// Where the value of `key` is written, or the table.
    fn value_loc(&self, key: &str) -> Location {
        self.spans.and_then(|s| entry(s, key)).map_or_else(|| self.location.clone(), |(_, v)| self.doc.at(v.span()))
    }

    fn check_keys(&self, allowed: &[&str]) -> Result<(), ConfigError> {
        for key in self.values.keys() {
            if !allowed.contains(&key.as_str()) {
                return Err(self.err(
                    self.key_loc(key),
                    format!("unknown key `{key}` in {}; expected one of: {}", self.what, allowed.join(", ")),
                ));
            }
        }
        Ok(())
    }

    fn has(&self, key: &str) -> bool {
        self.values.contains_key(key)
    }

    fn typed<T>(
        &self,
        key: &str,
        expected: &str,
        f: impl Fn(&'a toml::Value) -> Option<T>,
    ) -> Result<Option<T>, ConfigError> {
        let Some(v) = self.values.get(key) else { return Ok(None) };
        f(v).map(Some).ok_or_else(|| {
            self.err(self.value_loc(key), format!("`{key}` in {}: expected {expected}, got {}", self.what, describe(v)))
        })
    }

    fn string(&self, key: &str) -> Result<Option<&'a str>, ConfigError> {
        self.typed(key, "a string", |v: &'a toml::Value| v.as_str())
    }

    fn required_string(&self, key: &str) -> Result<&'a str, ConfigError> {
        self.string(key)?.ok_or_else(|| self.err(self.location.clone(), format!("{} needs `{key}`", self.what)))
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, ConfigError> {
        self.typed(key, "true or false", toml::Value::as_bool)
    }

    fn number(&self, key: &str, expected: &str, ok: impl Fn(f64) -> bool) -> Result<Option<f64>, ConfigError> {
        self.typed(key, expected, |v| {
            v.as_float().or_else(|| v.as_integer().map(|i| i as f64)).filter(|f| f.is_finite() && ok(*f))
        })
    }

    fn integer(&self, key: &str, range: std::ops::RangeInclusive<u64>) -> Result<Option<u64>, ConfigError> {
        let expected = format!("an integer in {}..={}", range.start(), range.end());
        self.typed(key, &expected, |v| v.as_integer().and_then(|i| u64::try_from(i).ok()).filter(|i| range.contains(i)))
    }

    fn duration(&self, key: &str) -> Result<Option<Duration>, ConfigError> {
        let Some(text) = self.typed(key, "a duration string like \"10ms\"", |v: &'a toml::Value| v.as_str())? else {
            return Ok(None);
        };
        parse_duration(text)
            .map(Some)
            .map_err(|m| self.err(self.value_loc(key), format!("`{key}` in {}: {m}", self.what)))
    }

    fn spans_of(&self, key: &str) -> Option<&'a DeValue<'i>> {
        self.spans.and_then(|s| entry(s, key)).map(|(_, v)| v.get_ref())
    }

    /// The sub-table under `key`.
    fn table(&self, key: &str, what: String) -> Result<Option<Tbl<'a, 'i, 'd>>, ConfigError> {
        let Some(v) = self.values.get(key) else { return Ok(None) };
        let values = v.as_table().ok_or_else(|| {
            self.err(self.value_loc(key), format!("`{key}` in {}: expected a table, got {}", self.what, describe(v)))
        })?;
        let spans = match self.spans_of(key) {
            Some(DeValue::Table(t)) => Some(t),
            _ => None,
        };
        Ok(Some(Tbl { doc: self.doc, values, spans, location: self.key_loc(key), what }))
    }

    /// The tables of the array under `key` (`[[key]]`).
    fn tables(&self, key: &str) -> Result<Vec<Tbl<'a, 'i, 'd>>, ConfigError> {
        let Some(v) = self.values.get(key) else { return Ok(Vec::new()) };
        let expected = || self.err(self.key_loc(key), format!("`{key}` must be written as [[{key}]] tables"));
        let items = v.as_array().ok_or_else(expected)?;
        let spans: Vec<_> = match self.spans_of(key) {
            Some(DeValue::Array(a)) => a.iter().collect(),
            _ => Vec::new(),
        };
        let mut out = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let span = spans.get(i);
            let location = span.map_or_else(|| self.key_loc(key), |s| self.doc.at(s.span()));
            let values = item.as_table().ok_or_else(|| {
                self.err(
                    location.clone(),
                    format!("`{key}` must be written as [[{key}]] tables, got {}", describe(item)),
                )
            })?;
            let spans = match span.map(|s| s.get_ref()) {
                Some(DeValue::Table(t)) => Some(t),
                _ => None,
            };
            let what = format!("{key} entry #{}", i + 1);
            out.push(Tbl { doc: self.doc, values, spans, location, what });
        }
        Ok(out)
    }
}

/// Keys of link parameters that an event may change.
const PARAM_KEYS: &[&str] =
    &["bw", "delay", "jitter", "loss", "loss_model", "ge_p", "ge_r", "ge_loss_bad", "ge_loss_good", "max_queue_size"];

/// Reads the link parameters of `t` (keys checked by the caller).
fn link_params(t: &Tbl<'_, '_, '_>) -> Result<LinkParams, ConfigError> {
    let pct = "a percentage in 0..=100";
    let prob = "a probability in 0..=1";
    let bw_mbit = t.number("bw", "a rate in Mbit/s, > 0 and at most 1000000", |f| f > 0.0 && f <= MAX_RATE_MBIT)?;
    let mut delays = [None, None];
    for (slot, key) in delays.iter_mut().zip(["delay", "jitter"]) {
        *slot = t.duration(key)?;
        if slot.is_some_and(|d| d > MAX_DELAY) {
            return Err(t.err(t.value_loc(key), format!("`{key}` in {}: at most 1h", t.what)));
        }
    }
    let model = t.typed("loss_model", "\"random\" or \"gilbert-elliott\"", |v| {
        v.as_str().filter(|s| matches!(*s, "random" | "gilbert-elliott"))
    })?;
    let ge_keys = ["ge_p", "ge_r", "ge_loss_bad", "ge_loss_good"];
    let loss = if model == Some("gilbert-elliott") {
        if t.has("loss") {
            return Err(t.err(t.key_loc("loss"), format!("{}: `loss` is for random loss; with loss_model = \"gilbert-elliott\" use ge_loss_bad and ge_loss_good", t.what)));
        }
        let need = |key: &str| -> Result<f64, ConfigError> {
            t.number(key, prob, |f| (0.0..=1.0).contains(&f))?.ok_or_else(|| {
                t.err(
                    t.key_loc("loss_model"),
                    format!("{}: loss_model = \"gilbert-elliott\" needs `{key}` (a probability in 0..=1)", t.what),
                )
            })
        };
        let (p, r) = (need("ge_p")?, need("ge_r")?);
        let loss_bad_pct = t.number("ge_loss_bad", pct, |f| (0.0..=100.0).contains(&f))?.unwrap_or(100.0);
        let loss_good_pct = t.number("ge_loss_good", pct, |f| (0.0..=100.0).contains(&f))?.unwrap_or(0.0);
        Some(Loss::GilbertElliott { p, r, loss_bad_pct, loss_good_pct })
    } else {
        if let Some(k) = ge_keys.iter().find(|k| t.has(k)) {
            return Err(t.err(t.key_loc(k), format!("{}: `{k}` needs loss_model = \"gilbert-elliott\"", t.what)));
        }
        let pct = t.number("loss", pct, |f| (0.0..=100.0).contains(&f))?;
        match (pct, model) {
            (Some(pct), _) => Some(Loss::Random { pct }),
            (None, Some(_)) => {
                return Err(
                    t.err(t.key_loc("loss_model"), format!("{}: loss_model = \"random\" needs `loss` (%)", t.what))
                )
            }
            (None, None) => None,
        }
    };
    let max_queue_size = t.integer("max_queue_size", 1..=MAX_QUEUE_PACKETS)?;
    Ok(LinkParams { bw_mbit, delay: delays[0], jitter: delays[1], loss, max_queue_size })
}

/// A meter name pattern: dotted parts that are names, `*` or `**`, or names with `*` inside.
fn valid_meter_pattern(p: &str) -> bool {
    !p.is_empty() && p.split('.').all(|part| !part.is_empty() && valid_name(&part.replace('*', "x")))
}

/// A dotted knob name: at least two valid names joined by dots.
fn valid_knob(name: &str) -> bool {
    name.split('.').count() >= 2 && name.split('.').all(valid_name)
}

/// Parses link parameters written as TOML `key = value` lines (the keys of an event's `set`), as `lab link A B set`
/// does with its `KEY=VALUE` arguments; `file` names the source in errors.
pub fn parse_link_params(file: &str, text: &str) -> Result<LinkParams, ConfigError> {
    let doc = Doc { file: Arc::from(file), text };
    let (spans, table) = parse_located(&doc.file, text)?;
    let t = Tbl::root(&doc, &table, spans.get_ref(), "the link parameters");
    t.check_keys(PARAM_KEYS)?;
    let params = link_params(&t)?;
    if params == LinkParams::default() {
        return Err(t.err(doc.start(), format!("no link parameter given; expected one of: {}", PARAM_KEYS.join(", "))));
    }
    Ok(params)
}

impl Lab {
    /// Parses and validates a lab description; `file` names it in errors. Nothing is created.
    pub fn parse(file: &str, text: &str) -> Result<Lab, ConfigError> {
        let doc = Doc { file: Arc::from(file), text };
        if text.len() > MAX_LAB_FILE_BYTES {
            return Err(ConfigError::new(
                Some(doc.start()),
                format!("lab description larger than {MAX_LAB_FILE_BYTES} bytes"),
            ));
        }
        let (spans, table) = parse_located(&doc.file, text)?;
        let root = Tbl::root(&doc, &table, spans.get_ref(), "the lab file");
        root.check_keys(&["lab", "hosts", "links", "programs", "events", "routes"])?;
        let head = Head::parse(&root)?;
        let hosts = hosts(&root)?;
        let links = links(&root, &hosts)?;
        let routes = routes(&root, &hosts, &links)?;
        let programs = programs(&root, &hosts, head.duration)?;
        let mut events = events(&root, &hosts, &links, head.duration)?;
        events.sort_by_key(|e| e.at);
        let Head { name, duration, seed, realtime, sample, meters } = head;
        Ok(Lab { name, duration, seed, realtime, sample, meters, hosts, links, programs, events, routes })
    }
}

/// The `[lab]` table.
struct Head {
    name: String,
    duration: Duration,
    seed: u64,
    realtime: u8,
    sample: Duration,
    meters: Vec<String>,
}

impl Head {
    fn parse(root: &Tbl<'_, '_, '_>) -> Result<Head, ConfigError> {
        let head = root.table("lab", "[lab]".into())?.ok_or_else(|| {
            ConfigError::new(Some(root.doc.start()), "the lab file needs a [lab] table with name and duration")
        })?;
        head.check_keys(&["name", "duration", "seed", "sample", "meters", "realtime"])?;
        let name = head.required_string("name")?.to_string();
        if !valid_name(&name) {
            return Err(head.err(
                head.value_loc("name"),
                format!("invalid lab name {name:?}: expected lowercase letters, digits, '_' or '-' (at most 64)"),
            ));
        }
        let duration = head
            .duration("duration")?
            .ok_or_else(|| head.err(head.location.clone(), "[lab] needs `duration` (e.g. \"20s\")"))?;
        if duration.is_zero() {
            return Err(head.err(head.value_loc("duration"), "`duration` in [lab]: expected more than 0s"));
        }
        let seed = head.integer("seed", 0..=i64::MAX as u64)?.unwrap_or(1);
        let realtime = head.integer("realtime", 0..=99)?.map_or(DEFAULT_REALTIME, |p| p as u8);
        let sample = head.duration("sample")?.unwrap_or(Duration::from_secs(1));
        if sample < MIN_SAMPLE {
            return Err(head.err(
                head.value_loc("sample"),
                format!("`sample` in [lab]: expected at least {}", format_duration(MIN_SAMPLE)),
            ));
        }
        let meters = match head.values.get("meters") {
            None => vec!["link.**".to_string()],
            Some(v) => {
                let items = v.as_array().filter(|a| a.iter().all(|x| x.as_str().is_some_and(valid_meter_pattern)));
                let Some(items) = items else {
                    return Err(head.err(
                        head.value_loc("meters"),
                        format!(
                            "`meters` in [lab]: expected a list of dotted name patterns like \"link.*\", got {}",
                            describe(v)
                        ),
                    ));
                };
                items.iter().filter_map(|x| x.as_str().map(str::to_string)).collect()
            }
        };
        Ok(Head { name, duration, seed, realtime, sample, meters })
    }
}

/// The `[hosts.NAME]` tables.
fn hosts(root: &Tbl<'_, '_, '_>) -> Result<Vec<Host>, ConfigError> {
    let mut hosts: Vec<Host> = Vec::new();
    let Some(ht) = root.table("hosts", "[hosts]".into())? else { return Ok(hosts) };
    for (hname, body) in ht.values {
        let location = ht.key_loc(hname);
        if !valid_name(hname) || hname.len() > MAX_HOST_NAME {
            return Err(ht.err(location, format!("invalid host name {hname:?}: expected a lowercase letter or digit, then letters, digits, '_' or '-', at most {MAX_HOST_NAME} characters")));
        }
        if body.as_table().is_none() {
            return Err(ht.err(
                ht.value_loc(hname),
                format!("host `{hname}`: expected a table ([hosts.{hname}]), got {}", describe(body)),
            ));
        }
        let h = ht.table(hname, format!("host `{hname}`"))?.expect("present");
        h.check_keys(&["stack"])?;
        let stack = h.string("stack")?.map(str::to_string);
        if stack.as_deref() == Some("") {
            return Err(h.err(h.value_loc("stack"), format!("`stack` in host `{hname}`: expected a stack file path")));
        }
        hosts.push(Host { name: hname.clone(), stack, location });
    }
    Ok(hosts)
}

/// The host named by `key` of `t`, which must be one of `hosts`.
fn find_host(hosts: &[Host], t: &Tbl<'_, '_, '_>, key: &str) -> Result<String, ConfigError> {
    let h = t.required_string(key)?;
    if hosts.iter().any(|x| x.name == h) {
        Ok(h.to_string())
    } else {
        let known: Vec<&str> = hosts.iter().map(|x| x.name.as_str()).collect();
        Err(t.err(
            t.value_loc(key),
            format!("`{key}` in {}: unknown host {h:?}; expected one of: {}", t.what, known.join(", ")),
        ))
    }
}

/// The `[[links]]` tables.
fn links(root: &Tbl<'_, '_, '_>, hosts: &[Host]) -> Result<Vec<Link>, ConfigError> {
    let mut links: Vec<Link> = Vec::new();
    for t in root.tables("links")? {
        let mut allowed = vec!["a", "b", "mtu", "capture"];
        allowed.extend_from_slice(PARAM_KEYS);
        t.check_keys(&allowed)?;
        let a = find_host(hosts, &t, "a")?;
        let b = find_host(hosts, &t, "b")?;
        if a == b {
            return Err(
                t.err(t.value_loc("b"), format!("{}: a link joins two different hosts, got {a:?} twice", t.what))
            );
        }
        let lname = format!("{a}-{b}");
        if let Some(other) = links.iter().find(|l| (l.a == a && l.b == b) || (l.a == b && l.b == a)) {
            return Err(t.err(
                t.location.clone(),
                format!("duplicate link between {a} and {b} (already declared at {})", other.location),
            ));
        }
        if let Some(other) = links.iter().find(|l| l.name == lname) {
            return Err(t.err(
                t.location.clone(),
                format!("link name {lname:?} is ambiguous: also the name of the link declared at {}", other.location),
            ));
        }
        let params = link_params(&t)?;
        let mtu = t.integer("mtu", 68..=65535)?.map(|m| m as u32);
        let capture = t.bool("capture")?.unwrap_or(false);
        links.push(Link { name: lname, a, b, params, mtu, capture, location: t.location.clone() });
    }
    Ok(links)
}

/// Fails unless `at` (the `at` of `t`) comes before the end of the lab.
fn before_end(t: &Tbl<'_, '_, '_>, at: Duration, duration: Duration) -> Result<(), ConfigError> {
    if at >= duration {
        Err(t.err(
            t.value_loc("at"),
            format!(
                "`at` in {}: {} is not before the end of the lab (duration {})",
                t.what,
                format_duration(at),
                format_duration(duration)
            ),
        ))
    } else {
        Ok(())
    }
}

/// The `[[routes]]` tables.
fn routes(root: &Tbl<'_, '_, '_>, hosts: &[Host], links: &[Link]) -> Result<Vec<RouteSpec>, ConfigError> {
    let mut routes: Vec<RouteSpec> = Vec::new();
    for t in root.tables("routes")? {
        t.check_keys(&["host", "to", "via"])?;
        let host = find_host(hosts, &t, "host")?;
        let to = find_host(hosts, &t, "to")?;
        let via = find_host(hosts, &t, "via")?;
        if hosts.iter().any(|h| h.name == to && h.stack.is_none()) {
            return Err(t.err(t.value_loc("to"), format!("`to` in {}: {to:?} is a plain host; routes lead to the apps of a stacked host (with `stack = ...`)", t.what)));
        }
        if to == host {
            return Err(t.err(t.value_loc("to"), format!("`to` in {}: a host needs no route to itself", t.what)));
        }
        if !links.iter().any(|l| (l.a == host && l.b == via) || (l.a == via && l.b == host)) {
            return Err(t.err(
                t.value_loc("via"),
                format!("`via` in {}: {via:?} is not linked to {host:?}; the next hop must be a neighbour", t.what),
            ));
        }
        if let Some(other) = routes.iter().find(|r| r.host == host && r.to == to) {
            return Err(t.err(
                t.location.clone(),
                format!("duplicate route from {host} to {to} (already declared at {})", other.location),
            ));
        }
        routes.push(RouteSpec { host, to, via, location: t.location.clone() });
    }
    Ok(routes)
}

/// The `[[programs]]` tables.
fn programs(root: &Tbl<'_, '_, '_>, hosts: &[Host], duration: Duration) -> Result<Vec<Program>, ConfigError> {
    let mut programs = Vec::new();
    for t in root.tables("programs")? {
        t.check_keys(&["host", "run", "background", "at"])?;
        let host = find_host(hosts, &t, "host")?;
        let run = t.required_string("run")?;
        if run.trim().is_empty() {
            return Err(t.err(t.value_loc("run"), format!("`run` in {}: expected a command line", t.what)));
        }
        let background = t.bool("background")?.unwrap_or(false);
        let at = t.duration("at")?.unwrap_or_default();
        before_end(&t, at, duration)?;
        programs.push(Program { host, run: run.to_string(), background, at, location: t.location.clone() });
    }
    Ok(programs)
}

/// The `[[events]]` tables, in file order.
fn events(
    root: &Tbl<'_, '_, '_>,
    hosts: &[Host],
    links: &[Link],
    duration: Duration,
) -> Result<Vec<Event>, ConfigError> {
    let mut events = Vec::new();
    for t in root.tables("events")? {
        t.check_keys(&["at", "link", "set", "down", "up", "knob", "value", "host", "capture", "rules"])?;
        let at = t
            .duration("at")?
            .ok_or_else(|| t.err(t.location.clone(), format!("{} needs `at` (e.g. \"6s\")", t.what)))?;
        before_end(&t, at, duration)?;
        let kinds: Vec<&str> = ["link", "knob", "rules"].into_iter().filter(|k| t.has(k)).collect();
        let action = match kinds.as_slice() {
            ["rules"] => rules_event(&t, hosts)?,
            ["link"] => link_event(&t, links)?,
            ["knob"] => knob_event(&t, hosts)?,
            _ => {
                let loc = kinds.get(1).map_or_else(|| t.location.clone(), |k| t.key_loc(k));
                return Err(t.err(
                    loc,
                    format!(
                        "{}: expected exactly one of `link` (with set, down or up), `knob` (with value) or `rules` (a rule file)",
                        t.what
                    ),
                ));
            }
        };
        events.push(Event { at, action, location: t.location.clone() });
    }
    Ok(events)
}

/// The stacked host a knob or rules event applies to, if given.
fn stacked_host(hosts: &[Host], t: &Tbl<'_, '_, '_>, what: &str) -> Result<Option<String>, ConfigError> {
    if !t.has("host") {
        return Ok(None);
    }
    let h = find_host(hosts, t, "host")?;
    if hosts.iter().any(|x| x.name == h && x.stack.is_none()) {
        return Err(t.err(
            t.value_loc("host"),
            format!(
                "`host` in {}: {h:?} is a plain host; {what} exist only on stacked hosts (with `stack = ...`)",
                t.what
            ),
        ));
    }
    Ok(Some(h))
}

/// An event with `rules`: a rule file loaded into a daemon.
fn rules_event(t: &Tbl<'_, '_, '_>, hosts: &[Host]) -> Result<Action, ConfigError> {
    if let Some(k) = ["set", "down", "up", "capture", "value"].into_iter().find(|k| t.has(k)) {
        return Err(t.err(t.key_loc(k), format!("{}: `{k}` is for link or knob events, not rules events", t.what)));
    }
    let file = t.required_string("rules")?;
    if file.trim().is_empty() {
        return Err(t.err(
            t.value_loc("rules"),
            format!("`rules` in {}: expected a rule file path (relative to the lab file)", t.what),
        ));
    }
    let host = stacked_host(hosts, t, "rule engines")?;
    Ok(Action::Rules { host, file: file.to_string() })
}

/// An event with `link`: new parameters, down, up or a capture.
fn link_event(t: &Tbl<'_, '_, '_>, links: &[Link]) -> Result<Action, ConfigError> {
    if let Some(k) = ["value", "host"].into_iter().find(|k| t.has(k)) {
        return Err(t.err(t.key_loc(k), format!("{}: `{k}` is for knob or rules events, not link events", t.what)));
    }
    let written = t.required_string("link")?;
    let link = links
        .iter()
        .find(|l| l.name == written || format!("{}-{}", l.b, l.a) == written)
        .map(|l| l.name.clone())
        .ok_or_else(|| {
            let known: Vec<&str> = links.iter().map(|l| l.name.as_str()).collect();
            t.err(
                t.value_loc("link"),
                format!("`link` in {}: unknown link {written:?}; expected one of: {}", t.what, known.join(", ")),
            )
        })?;
    let given: Vec<&str> = ["set", "down", "up", "capture"].into_iter().filter(|k| t.has(k)).collect();
    if given.len() != 1 {
        let loc = given.get(1).map_or_else(|| t.key_loc("link"), |k| t.key_loc(k));
        return Err(t.err(
            loc,
            format!(
                "{}: a link event needs exactly one of `set = {{ ... }}`, `down = true`, `up = true` or `capture = true`",
                t.what
            ),
        ));
    }
    match given[0] {
        "set" => {
            let s = t.table("set", format!("`set` of {}", t.what))?.expect("present");
            s.check_keys(PARAM_KEYS)?;
            let params = link_params(&s)?;
            if params == LinkParams::default() {
                return Err(s.err(
                    t.value_loc("set"),
                    format!("{}: `set` changes nothing; expected one of: {}", t.what, PARAM_KEYS.join(", ")),
                ));
            }
            Ok(Action::LinkSet { link, params })
        }
        k => {
            if t.bool(k)? != Some(true) {
                return Err(t.err(t.value_loc(k), format!("`{k}` in {}: expected true", t.what)));
            }
            Ok(match k {
                "down" => Action::LinkDown { link },
                "up" => Action::LinkUp { link },
                _ => Action::Capture { link },
            })
        }
    }
}

/// An event with `knob`: a value written to a knob.
fn knob_event(t: &Tbl<'_, '_, '_>, hosts: &[Host]) -> Result<Action, ConfigError> {
    if let Some(k) = ["set", "down", "up", "capture"].into_iter().find(|k| t.has(k)) {
        return Err(t.err(t.key_loc(k), format!("{}: `{k}` is for link events, not knob events", t.what)));
    }
    let knob = t.required_string("knob")?;
    if !valid_knob(knob) {
        return Err(t.err(
            t.value_loc("knob"),
            format!("`knob` in {}: expected a dotted knob name like \"module.x.select\", got {knob:?}", t.what),
        ));
    }
    let value = t
        .typed("value", "a number, boolean or string", Value::from_toml)?
        .ok_or_else(|| t.err(t.key_loc("knob"), format!("{}: a knob event needs `value`", t.what)))?;
    let host = stacked_host(hosts, t, "knobs")?;
    Ok(Action::Knob { host, knob: knob.to_string(), value })
}
