//! Parsers for the files of a results folder — `timeline.csv`, `meters.csv`, `programs/*.status` and iperf3 `-J`
//! output — and rates computed from sampled counters.
//!
//! Every parser takes the file's name (for messages) and its text, and returns the parsed rows or a
//! [`ConfigError`] located at `file:line:column` that says what was expected. They do no I/O; `report.rs` reads
//! the files and calls them.
//!
//! The CSV files are RFC 4180 (read with the `csv` crate): a header line, then one record per line; a field that
//! holds a comma, a quote or a line break is written in double quotes, with quotes doubled.

use flexstack_core::config::{ConfigError, Location};
use serde_json::Value as Json;
use std::sync::Arc;

/// One row of `timeline.csv`: an event as it happened.
#[derive(Clone, Debug, PartialEq)]
pub struct TimelineRow {
    /// When it happened, in seconds since the lab started.
    pub time_s: f64,
    /// When it was planned, in seconds since the lab started; `None` for an unplanned event (empty field).
    pub planned_s: Option<f64>,
    /// What happened.
    pub event: String,
}

/// One row of `meters.csv`: one sample of one meter.
#[derive(Clone, Debug, PartialEq)]
pub struct MeterSample {
    /// When it was sampled, in seconds since the lab started.
    pub time_s: f64,
    /// The meter's dotted name.
    pub name: String,
    /// Its value (`true`/`false` are read as 1/0).
    pub value: f64,
}

/// How a program ended, from its `.status` file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExitStatus {
    /// It exited with this code (`exit=<code>`).
    Exit(i32),
    /// A signal ended it (`signal=<n>`).
    Signal(i32),
    /// The runner stopped it at the end of the lab (`killed`).
    Killed,
    /// It ended with neither an exit code nor a signal the runner could read (`unknown`).
    Unknown,
}

impl std::fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExitStatus::Exit(c) => write!(f, "exit {c}"),
            ExitStatus::Signal(s) => write!(f, "signal {s}"),
            ExitStatus::Killed => write!(f, "stopped at lab end"),
            ExitStatus::Unknown => write!(f, "unknown"),
        }
    }
}

fn err(file: &str, line: usize, column: usize, message: impl Into<String>) -> ConfigError {
    ConfigError::new(Some(Location { file: Arc::from(file), line, column }), message)
}

/// Parses a program's `.status` file: one line, `exit=<code>`, `signal=<n>`, `killed` or `unknown`.
pub fn parse_status(file: &str, text: &str) -> Result<ExitStatus, ConfigError> {
    let line = text.trim_end_matches(['\n', '\r']);
    let expected = "expected one line `exit=<code>`, `signal=<n>`, `killed` or `unknown`";
    if line.contains('\n') {
        return Err(err(file, 2, 1, format!("{expected}, got more than one line")));
    }
    let number = |v: &str, col: usize| {
        v.parse::<i32>().map_err(|_| err(file, 1, col, format!("{expected}: {v:?} is not an integer")))
    };
    match line.split_once('=') {
        Some(("exit", v)) => number(v, 6).map(ExitStatus::Exit),
        Some(("signal", v)) => number(v, 8).map(ExitStatus::Signal),
        None if line == "killed" => Ok(ExitStatus::Killed),
        None if line == "unknown" => Ok(ExitStatus::Unknown),
        _ => Err(err(file, 1, 1, format!("{expected}, got {line:?}"))),
    }
}

/// One CSV record with what is needed to locate its fields in the file.
struct Row<'t> {
    file: &'t str,
    text: &'t str,
    record: csv::StringRecord,
    /// Byte offset of the record's first character.
    start: usize,
}

impl Row<'_> {
    /// An error at the raw start of field `index` (quotes and line breaks inside quoted fields counted).
    fn err(&self, index: usize, message: impl Into<String>) -> ConfigError {
        let bytes = self.text.as_bytes();
        let (mut at, mut field, mut quoted) = (self.start, 0, false);
        while field < index && at < bytes.len() {
            match bytes[at] {
                b'"' => quoted = !quoted,
                b',' if !quoted => field += 1,
                _ => {}
            }
            at += 1;
        }
        while !self.text.is_char_boundary(at) {
            at -= 1;
        }
        ConfigError::new(Some(Location::of_offset(&Arc::from(self.file), self.text, at)), message)
    }

    fn seconds(&self, index: usize, what: &str) -> Result<f64, ConfigError> {
        let text = &self.record[index];
        match text.trim().parse::<f64>() {
            Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
            _ => Err(self.err(index, format!("`{what}`: expected a non-negative number of seconds, got {text:?}"))),
        }
    }
}

/// The location of byte `offset` of `text` (moved back to a character boundary).
fn at_byte(file: &str, text: &str, offset: usize) -> Location {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    Location::of_offset(&Arc::from(file), text, offset)
}

/// Reads a CSV file whose header must be exactly `header`; calls `row` with each record.
fn read_csv(
    file: &str,
    text: &str,
    header: &[&str],
    mut row: impl FnMut(&Row<'_>) -> Result<(), ConfigError>,
) -> Result<(), ConfigError> {
    let mut reader = csv::ReaderBuilder::new().has_headers(false).from_reader(text.as_bytes());
    let want = header.join(",");
    let located = |e: csv::Error| {
        let at = at_byte(file, text, e.position().map_or(0, |p| p.byte() as usize));
        let message = match e.kind() {
            csv::ErrorKind::UnequalLengths { len, .. } => {
                format!("expected {} fields ({want}), got {len}", header.len())
            }
            csv::ErrorKind::Utf8 { .. } => "expected UTF-8 text".to_string(),
            _ => format!("unreadable CSV: {e}"),
        };
        ConfigError::new(Some(at), message)
    };
    let mut records = reader.records();
    match records.next() {
        None => return Err(err(file, 1, 1, format!("expected the header line `{want}`, got an empty file"))),
        Some(first) => {
            let first = first.map_err(&located)?;
            if first.iter().ne(header.iter().copied()) {
                let got: Vec<&str> = first.iter().collect();
                let at = at_byte(file, text, first.position().map_or(0, |p| p.byte() as usize));
                let message = format!("expected the header line `{want}`, got `{}`", got.join(","));
                return Err(ConfigError::new(Some(at), message));
            }
        }
    }
    for record in records {
        let record = record.map_err(&located)?;
        let start = record.position().map_or(0, |p| p.byte() as usize);
        let r = Row { file, text, record, start };
        if r.record.len() != header.len() {
            let message = format!("expected {} fields ({want}), got {}", header.len(), r.record.len());
            return Err(r.err(0, message));
        }
        row(&r)?;
    }
    Ok(())
}

/// Parses `timeline.csv` (`time_s,planned_s,event`); `planned_s` may be empty. Rows keep the file's order.
pub fn parse_timeline(file: &str, text: &str) -> Result<Vec<TimelineRow>, ConfigError> {
    let mut rows = Vec::new();
    read_csv(file, text, &["time_s", "planned_s", "event"], |r| {
        let time_s = r.seconds(0, "time_s")?;
        let planned_s = if r.record[1].trim().is_empty() { None } else { Some(r.seconds(1, "planned_s")?) };
        if r.record[2].trim().is_empty() {
            return Err(r.err(2, "`event`: expected a description, got an empty field"));
        }
        rows.push(TimelineRow { time_s, planned_s, event: r.record[2].to_string() });
        Ok(())
    })?;
    Ok(rows)
}

/// Parses `meters.csv` (`time_s,name,value`, long format). Values are finite numbers or `true`/`false`. Rows keep
/// the file's order.
pub fn parse_meters(file: &str, text: &str) -> Result<Vec<MeterSample>, ConfigError> {
    let mut rows = Vec::new();
    read_csv(file, text, &["time_s", "name", "value"], |r| {
        let time_s = r.seconds(0, "time_s")?;
        let name = &r.record[1];
        if name.is_empty() || name.contains(char::is_whitespace) {
            return Err(r.err(1, format!("`name`: expected a dotted meter name, got {name:?}")));
        }
        let value = match r.record[2].trim() {
            "true" => 1.0,
            "false" => 0.0,
            v => v
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite())
                .ok_or_else(|| r.err(2, format!("`value`: expected a finite number or true/false, got {v:?}")))?,
        };
        rows.push(MeterSample { time_s, name: name.to_string(), value });
        Ok(())
    })?;
    Ok(rows)
}

/// What a meter's samples mean when plotted, from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum MeterKind {
    /// A monotonic byte counter (`..._bytes_total`, or any `_total` with a `bytes` word): plotted as bits/s.
    Bytes,
    /// A monotonic packet counter (`..._packets_total`, or any `_total` with a `packets` or `frames` word): plotted
    /// as packets/s.
    Packets,
    /// Anything else (gauges, settings, other counters such as `drops_total`): plotted as sampled.
    Value,
}

impl MeterKind {
    /// The kind of the meter called `name` (only the last dotted part counts).
    pub fn of(name: &str) -> MeterKind {
        let last = name.rsplit('.').next().unwrap_or(name);
        let Some(stem) = last.strip_suffix("_total") else { return MeterKind::Value };
        let words: Vec<&str> = stem.split('_').collect();
        if words.contains(&"bytes") {
            MeterKind::Bytes
        } else if words.contains(&"packets") || words.contains(&"frames") {
            MeterKind::Packets
        } else {
            MeterKind::Value
        }
    }

    /// The unit of its plotted series.
    pub fn unit(self) -> &'static str {
        match self {
            MeterKind::Bytes => "bit/s",
            MeterKind::Packets => "packets/s",
            MeterKind::Value => "value",
        }
    }
}

/// The per-second rate of a monotonic counter from successive `(time_s, value)` samples (in time order): one point
/// per pair of samples with time advancing, at the later sample's time. A value lower than the one before means
/// the counter restarted from zero (Prometheus's rule): the increase is then the new value itself.
pub fn counter_rate(samples: &[(f64, f64)]) -> Vec<(f64, f64)> {
    samples
        .windows(2)
        .filter(|w| w[1].0 > w[0].0)
        .map(|w| {
            let ((t0, v0), (t1, v1)) = (w[0], w[1]);
            (t1, counter_increase(v0, v1) / (t1 - t0))
        })
        .collect()
}

/// How much a counter counted from `before` to `after`, counting a lower `after` as a restart from zero.
pub fn counter_increase(before: f64, after: f64) -> f64 {
    if after >= before {
        after - before
    } else {
        after
    }
}

/// Everything a counter counted over the samples (in time order): the first value (counters start at zero with
/// the lab) plus every increase, restarts included.
pub fn counter_total(samples: &[(f64, f64)]) -> f64 {
    let first = samples.first().map_or(0.0, |s| s.1);
    first + samples.windows(2).map(|w| counter_increase(w[0].1, w[1].1)).sum::<f64>()
}

/// The transport an iperf3 test used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

/// Which end of the test wrote the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// `iperf3 -c` (has `start.connecting_to`).
    Client,
    /// `iperf3 -s` (has `start.accepted_connection`).
    Server,
}

/// One interval of an iperf3 test (`intervals[].sum`), times relative to the test's start.
#[derive(Clone, Debug, PartialEq)]
pub struct Iperf3Interval {
    /// Start, in seconds.
    pub start: f64,
    /// End, in seconds.
    pub end: f64,
    /// Throughput over the interval.
    pub bits_per_second: f64,
    /// TCP retransmissions (sender side).
    pub retransmits: Option<u64>,
    /// UDP packets lost (receiver side).
    pub lost_packets: Option<u64>,
    /// UDP packets.
    pub packets: Option<u64>,
}

/// A summary of a whole test (`end.sum_sent`, `end.sum_received`, `end.sum`).
#[derive(Clone, Debug, PartialEq)]
pub struct Iperf3Sum {
    /// Bytes transferred.
    pub bytes: f64,
    /// Average throughput.
    pub bits_per_second: f64,
    /// TCP retransmissions.
    pub retransmits: Option<u64>,
    /// UDP packets lost.
    pub lost_packets: Option<u64>,
    /// UDP packets.
    pub packets: Option<u64>,
    /// UDP loss, in %.
    pub lost_percent: Option<f64>,
}

/// One iperf3 test, as one `-J` JSON document describes it.
#[derive(Clone, Debug, PartialEq)]
pub struct Iperf3Test {
    /// The transport, when the test started (`start.test_start.protocol`).
    pub protocol: Option<Protocol>,
    /// Which end wrote it, when known.
    pub role: Option<Role>,
    /// Per-interval figures.
    pub intervals: Vec<Iperf3Interval>,
    /// `end.sum_sent`.
    pub sent: Option<Iperf3Sum>,
    /// `end.sum_received`.
    pub received: Option<Iperf3Sum>,
    /// `end.sum` (UDP).
    pub sum: Option<Iperf3Sum>,
    /// The `error` iperf3 reported (a failed test still has `start`, `intervals` and `end`).
    pub error: Option<String>,
    /// `start.cookie`: the same on the client's and the server's side of one test.
    pub cookie: Option<String>,
}

impl Iperf3Test {
    /// Throughput the sender reports, in bit/s (unknown on a UDP server, which sends nothing).
    pub fn sender_bps(&self) -> Option<f64> {
        let sent = self.sent.as_ref()?;
        (!(self.protocol == Some(Protocol::Udp) && self.role == Some(Role::Server) && sent.bytes == 0.0))
            .then_some(sent.bits_per_second)
    }

    /// Throughput the receiver reports, in bit/s.
    pub fn receiver_bps(&self) -> Option<f64> {
        self.received.as_ref().map(|r| r.bits_per_second)
    }

    /// UDP loss in %: `end.sum.lost_percent`, else `end.sum_received`'s.
    pub fn udp_loss_percent(&self) -> Option<f64> {
        if self.protocol != Some(Protocol::Udp) {
            return None;
        }
        self.sum.as_ref().and_then(|s| s.lost_percent).or_else(|| self.received.as_ref()?.lost_percent)
    }

    /// TCP retransmissions of the whole test (`end.sum_sent.retransmits`).
    pub fn retransmits(&self) -> Option<u64> {
        (self.protocol == Some(Protocol::Tcp)).then(|| self.sent.as_ref()?.retransmits).flatten()
    }
}

/// True if `text` looks like iperf3 `-J` output: a JSON object with `start` and either `end` or `error`.
pub fn looks_like_iperf3(text: &str) -> bool {
    let Some(Ok(Json::Object(o))) = serde_json::Deserializer::from_str(text).into_iter::<Json>().next() else {
        return false;
    };
    o.contains_key("start") && (o.contains_key("end") || o.contains_key("error"))
}

/// Parses iperf3 `-J` output, client or server side, TCP or UDP. A server run without `-1` writes one JSON
/// document per test, one after the other: each becomes an [`Iperf3Test`]. Errors name the line and column (JSON
/// syntax) or the document's line and the missing or mistyped field (`intervals[2].sum.end: expected a number`).
pub fn parse_iperf3(file: &str, text: &str) -> Result<Vec<Iperf3Test>, ConfigError> {
    let mut tests = Vec::new();
    let mut stream = serde_json::Deserializer::from_str(text).into_iter::<Json>();
    loop {
        let doc_start = stream.byte_offset();
        let Some(doc) = stream.next() else { break };
        let doc = doc.map_err(|e| {
            let at = byte_position(file, text, e.line(), e.column());
            ConfigError::new(Some(at), format!("invalid JSON: {e}"))
        })?;
        let skipped = text[doc_start..].len() - text[doc_start..].trim_start().len();
        let at = Location::of_offset(&Arc::from(file), text, doc_start + skipped);
        let (line, column) = (at.line, at.column);
        tests.push(iperf3_test(&doc).map_err(|m| err(file, line, column, format!("iperf3 JSON document: {m}")))?);
    }
    if tests.is_empty() {
        return Err(err(file, 1, 1, "expected iperf3 -J output (a JSON object), got no JSON"));
    }
    Ok(tests)
}

/// The location of serde_json's `line` and byte `column` (both 1-based; 0 for "before the first") in characters.
fn byte_position(file: &str, text: &str, line: usize, column: usize) -> Location {
    let line_start = text.split_inclusive('\n').take(line.saturating_sub(1)).map(str::len).sum::<usize>();
    let line_len = text[line_start..].find('\n').unwrap_or(text.len() - line_start);
    at_byte(file, text, line_start + column.saturating_sub(1).min(line_len))
}

/// A field reached by a path of keys, with the path for messages.
struct Field<'a> {
    value: Option<&'a Json>,
    path: String,
}

impl<'a> Field<'a> {
    fn root(value: &'a Json) -> Field<'a> {
        Field { value: Some(value), path: String::new() }
    }

    fn get(&self, key: &str) -> Field<'a> {
        let path = if self.path.is_empty() { key.to_string() } else { format!("{}.{key}", self.path) };
        Field { value: self.value.and_then(|v| v.get(key)), path }
    }

    fn number(&self) -> Result<f64, String> {
        match self.value {
            Some(Json::Number(n)) => n.as_f64().filter(|f| f.is_finite()).ok_or_else(|| self.expected("a number")),
            _ => Err(self.expected("a number")),
        }
    }

    fn opt_count(&self) -> Result<Option<u64>, String> {
        match self.value {
            None | Some(Json::Null) => Ok(None),
            Some(Json::Number(n)) => n
                .as_u64()
                .or_else(|| n.as_f64().filter(|f| *f >= 0.0 && f.fract() == 0.0 && *f < 1e18).map(|f| f as u64))
                .map(Some)
                .ok_or_else(|| self.expected("a non-negative integer")),
            Some(_) => Err(self.expected("a non-negative integer")),
        }
    }

    fn opt_number(&self) -> Result<Option<f64>, String> {
        match self.value {
            None | Some(Json::Null) => Ok(None),
            Some(_) => self.number().map(Some),
        }
    }

    fn expected(&self, what: &str) -> String {
        match self.value {
            None => format!("{}: expected {what}, missing", self.path),
            Some(v) => format!("{}: expected {what}, got {}", self.path, json_kind(v)),
        }
    }
}

fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

fn iperf3_sum(f: &Field<'_>) -> Result<Option<Iperf3Sum>, String> {
    match f.value {
        None => return Ok(None),
        Some(Json::Object(_)) => {}
        Some(v) => return Err(format!("{}: expected an object, got {}", f.path, json_kind(v))),
    }
    Ok(Some(Iperf3Sum {
        bytes: f.get("bytes").number()?,
        bits_per_second: f.get("bits_per_second").number()?,
        retransmits: f.get("retransmits").opt_count()?,
        lost_packets: f.get("lost_packets").opt_count()?,
        packets: f.get("packets").opt_count()?,
        lost_percent: f.get("lost_percent").opt_number()?,
    }))
}

fn iperf3_test(doc: &Json) -> Result<Iperf3Test, String> {
    let root = Field::root(doc);
    if !doc.is_object() {
        return Err(format!("expected an object, got {}", json_kind(doc)));
    }
    let error = match doc.get("error") {
        None => None,
        Some(Json::String(s)) => Some(s.clone()),
        Some(v) => return Err(format!("error: expected a string, got {}", json_kind(v))),
    };
    let start = root.get("start");
    let role = if start.get("connecting_to").value.is_some() {
        Some(Role::Client)
    } else if start.get("accepted_connection").value.is_some() {
        Some(Role::Server)
    } else {
        None
    };
    let protocol_field = start.get("test_start").get("protocol");
    let protocol = match protocol_field.value {
        Some(Json::String(p)) if p == "TCP" => Some(Protocol::Tcp),
        Some(Json::String(p)) if p == "UDP" => Some(Protocol::Udp),
        None if error.is_some() => None,
        _ => return Err(protocol_field.expected("\"TCP\" or \"UDP\"")),
    };
    let mut intervals = Vec::new();
    match doc.get("intervals") {
        None if error.is_some() => {}
        Some(Json::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                let sum = Field { value: Some(item), path: format!("intervals[{i}]") }.get("sum");
                let (start, end) = (sum.get("start").number()?, sum.get("end").number()?);
                if end < start {
                    return Err(format!("{}: expected end >= start, got {start}..{end}", sum.path));
                }
                intervals.push(Iperf3Interval {
                    start,
                    end,
                    bits_per_second: sum.get("bits_per_second").number()?,
                    retransmits: sum.get("retransmits").opt_count()?,
                    lost_packets: sum.get("lost_packets").opt_count()?,
                    packets: sum.get("packets").opt_count()?,
                });
            }
        }
        other => return Err(Field { value: other, path: "intervals".into() }.expected("an array")),
    }
    let end = root.get("end");
    let (sent, received, sum) =
        if error.is_some() && end.value.is_none_or(|e| e.as_object().is_some_and(|o| o.is_empty())) {
            (None, None, None)
        } else {
            (iperf3_sum(&end.get("sum_sent"))?, iperf3_sum(&end.get("sum_received"))?, iperf3_sum(&end.get("sum"))?)
        };
    if error.is_none() && sent.is_none() && received.is_none() && sum.is_none() {
        return Err(end.get("sum_sent").expected("an object (or end.sum_received, end.sum)"));
    }
    let cookie = start.get("cookie").value.and_then(Json::as_str).map(str::to_string);
    Ok(Iperf3Test { protocol, role, intervals, sent, received, sum, error, cookie })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TCP_CLIENT: &str = include_str!("../../tests/data/iperf3-tcp-client.json");
    const UDP_CLIENT: &str = include_str!("../../tests/data/iperf3-udp-client.json");
    const UDP_SERVER: &str = include_str!("../../tests/data/iperf3-udp-server.json");
    const ERROR: &str = include_str!("../../tests/data/iperf3-error.json");
    const TCP_SERVER: &str = include_str!("../../tests/data/iperf3-tcp-server.json");

    fn at(e: &ConfigError) -> (usize, usize) {
        let l = e.location.as_ref().expect("located");
        (l.line, l.column)
    }

    #[test]
    fn timeline_rows_with_quotes_and_empty_planned_time() {
        let text = "time_s,planned_s,event\n0.000,0,start on srv (background): iperf3 -s\n6.002,6,\"link h1-srv set delay_ms=50, jitter_ms=1\"\n7.5,,\"runner: \"\"note\"\"\"\n";
        let rows = parse_timeline("timeline.csv", text).unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(
            rows[1],
            TimelineRow {
                time_s: 6.002,
                planned_s: Some(6.0),
                event: "link h1-srv set delay_ms=50, jitter_ms=1".into()
            }
        );
        assert_eq!(rows[2].planned_s, None);
        assert_eq!(rows[2].event, "runner: \"note\"");
    }

    #[test]
    fn timeline_errors_are_located() {
        let e = parse_timeline("t.csv", "time,planned_s,event\n").unwrap_err();
        assert_eq!(at(&e), (1, 1));
        assert!(e.to_string().contains("expected the header line `time_s,planned_s,event`"), "{e}");
        let e = parse_timeline("t.csv", "time_s,planned_s,event\n1,1,a\n2,x,b\n").unwrap_err();
        assert_eq!(at(&e), (3, 3));
        assert!(e.to_string().starts_with("t.csv:3:3: `planned_s`: expected a non-negative number"), "{e}");
        let e = parse_timeline("t.csv", "time_s,planned_s,event\n1,1,a\n2,2\n").unwrap_err();
        assert_eq!(at(&e).0, 3);
        assert!(e.to_string().contains("expected 3 fields"), "{e}");
        let e = parse_timeline("t.csv", "time_s,planned_s,event\n-1,1,a\n").unwrap_err();
        assert_eq!(at(&e), (2, 1));
        let e = parse_timeline("t.csv", "").unwrap_err();
        assert!(e.to_string().contains("empty file"), "{e}");
    }

    #[test]
    fn meters_parse_numbers_and_booleans_and_locate_errors() {
        let text = "time_s,name,value\n0.5,link.h1-srv.ab.tx_bytes_total,1500\n0.5,link.h1-srv.ab.up,true\n";
        let rows = parse_meters("meters.csv", text).unwrap();
        assert_eq!(rows[0], MeterSample { time_s: 0.5, name: "link.h1-srv.ab.tx_bytes_total".into(), value: 1500.0 });
        assert_eq!(rows[1].value, 1.0);
        let e = parse_meters("m.csv", "time_s,name,value\n1,a.b,NaN\n").unwrap_err();
        assert_eq!(e.to_string(), "m.csv:2:7: `value`: expected a finite number or true/false, got \"NaN\"");
        let e = parse_meters("m.csv", "time_s,name,value\n1,,3\n").unwrap_err();
        assert_eq!(at(&e), (2, 3));
        let e = parse_meters("m.csv", "time_s,name,value\n1,a.b,3,4\n").unwrap_err();
        assert_eq!(at(&e).0, 2);
    }

    #[test]
    fn status_lines() {
        assert_eq!(parse_status("s", "exit=0\n").unwrap(), ExitStatus::Exit(0));
        assert_eq!(parse_status("s", "exit=-1").unwrap(), ExitStatus::Exit(-1));
        assert_eq!(parse_status("s", "signal=9\n").unwrap(), ExitStatus::Signal(9));
        assert_eq!(parse_status("s", "killed\n").unwrap(), ExitStatus::Killed);
        assert_eq!(parse_status("s", "unknown\n").unwrap(), ExitStatus::Unknown);
        let e = parse_status("h1-1.status", "exit=x\n").unwrap_err();
        assert_eq!(
            e.to_string(),
            "h1-1.status:1:6: expected one line `exit=<code>`, `signal=<n>`, `killed` or `unknown`: \"x\" is not an integer"
        );
        assert!(parse_status("s", "done\n").is_err());
        assert_eq!(at(&parse_status("s", "exit=0\nexit=1\n").unwrap_err()), (2, 1));
    }

    #[test]
    fn meter_kinds_from_names() {
        assert_eq!(MeterKind::of("link.h1-srv.ab.tx_bytes_total"), MeterKind::Bytes);
        assert_eq!(MeterKind::of("link.h1-srv.ab.bytes_delivered_total"), MeterKind::Bytes);
        assert_eq!(MeterKind::of("host.app.module.c.tx_packets_total"), MeterKind::Packets);
        assert_eq!(MeterKind::of("module.e.frames_total"), MeterKind::Packets);
        assert_eq!(MeterKind::of("link.h1-srv.ab.drops_total"), MeterKind::Value);
        assert_eq!(MeterKind::of("link.h1-srv.ab.queued"), MeterKind::Value);
        assert_eq!(MeterKind::of("module.bytes_total.queued"), MeterKind::Value);
    }

    #[test]
    fn rates_from_counters_with_a_restart() {
        // 1000 bytes/s, then the counter restarts (the module was replaced) and counts 500 in the next second.
        let samples = [(0.0, 0.0), (1.0, 1000.0), (2.0, 2000.0), (3.0, 500.0), (4.0, 1500.0), (4.0, 1600.0)];
        assert_eq!(counter_rate(&samples), vec![(1.0, 1000.0), (2.0, 1000.0), (3.0, 500.0), (4.0, 1000.0)]);
        assert_eq!(counter_total(&samples), 2000.0 + 500.0 + 1000.0 + 100.0);
        assert_eq!(counter_rate(&[(0.0, 5.0)]), vec![]);
        assert_eq!(counter_total(&[]), 0.0);
    }

    #[test]
    fn real_iperf3_tcp_client() {
        let t = parse_iperf3("tcp.json", TCP_CLIENT).unwrap();
        assert_eq!(t.len(), 1);
        let t = &t[0];
        assert_eq!((t.protocol, t.role, t.error.as_deref()), (Some(Protocol::Tcp), Some(Role::Client), None));
        assert_eq!(t.intervals.len(), 2);
        assert_eq!(t.intervals[0].start, 0.0);
        assert!(t.intervals[1].end > 2.0 && t.intervals.iter().all(|i| i.bits_per_second > 1e6));
        let sent_retransmits: u64 = t.intervals.iter().filter_map(|i| i.retransmits).sum();
        assert_eq!(t.retransmits(), Some(sent_retransmits));
        assert!(t.sender_bps().unwrap() >= t.receiver_bps().unwrap() * 0.99);
        assert_eq!(t.udp_loss_percent(), None);
    }

    #[test]
    fn real_iperf3_tcp_server() {
        let t = &parse_iperf3("s.json", TCP_SERVER).unwrap()[0];
        assert_eq!((t.protocol, t.role, t.error.as_deref()), (Some(Protocol::Tcp), Some(Role::Server), None));
        assert_eq!(t.intervals.len(), 1);
        assert!(t.intervals[0].retransmits.is_none(), "the receiving side does not count retransmissions");
        assert!(t.receiver_bps().unwrap() > 1e6);
        assert!(t.cookie.as_deref().is_some_and(|c| c.len() == 36));
    }

    #[test]
    fn real_iperf3_udp_both_sides() {
        let c = &parse_iperf3("c.json", UDP_CLIENT).unwrap()[0];
        assert_eq!((c.protocol, c.role), (Some(Protocol::Udp), Some(Role::Client)));
        assert!(c.intervals.iter().all(|i| i.packets.is_some()));
        assert_eq!(c.udp_loss_percent(), Some(0.0));
        let rx = c.receiver_bps().unwrap();
        assert!((9e6..11e6).contains(&rx), "{rx}");
        let s = &parse_iperf3("s.json", UDP_SERVER).unwrap()[0];
        assert_eq!((s.protocol, s.role), (Some(Protocol::Udp), Some(Role::Server)));
        assert_eq!(s.sender_bps(), None, "a UDP server sends nothing");
        assert!(s.intervals.iter().all(|i| i.lost_packets == Some(0)));
        assert_eq!(s.udp_loss_percent(), Some(0.0));
    }

    #[test]
    fn iperf3_error_is_reported_not_fatal() {
        let t = &parse_iperf3("e.json", ERROR).unwrap()[0];
        assert_eq!(t.error.as_deref(), Some("unable to connect to server: Connection refused"));
        assert!(t.intervals.is_empty() && t.sent.is_none() && t.protocol.is_none());
        assert!(looks_like_iperf3(ERROR) && looks_like_iperf3(TCP_CLIENT) && !looks_like_iperf3("{\"a\":1}"));
    }

    #[test]
    fn iperf3_server_with_several_tests_and_bad_documents() {
        let two = format!("{UDP_SERVER}\n{TCP_CLIENT}");
        let t = parse_iperf3("two.json", &two).unwrap();
        assert_eq!(t.iter().map(|t| t.protocol).collect::<Vec<_>>(), vec![Some(Protocol::Udp), Some(Protocol::Tcp)]);

        let e = parse_iperf3("cut.json", &TCP_CLIENT[..200]).unwrap_err();
        assert!(e.to_string().starts_with("cut.json:"), "{e}");
        assert!(e.to_string().contains("invalid JSON: EOF"), "{e}");

        let sum_at = TCP_CLIENT.find("\"sum\":").unwrap();
        let bad = format!(
            "{}{}",
            &TCP_CLIENT[..sum_at],
            TCP_CLIENT[sum_at..].replacen("\"end\":\t1.000184", "\"end\":\t\"x\"", 1)
        );
        assert_ne!(bad, TCP_CLIENT);
        let e = parse_iperf3("bad.json", &format!("\n{bad}")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad.json:2:1: iperf3 JSON document: intervals[0].sum.end: expected a number, got a string"
        );

        let e = parse_iperf3("p.json", "{\"start\":{\"test_start\":{}},\"intervals\":[],\"end\":{}}").unwrap_err();
        assert!(e.to_string().contains("start.test_start.protocol: expected \"TCP\" or \"UDP\", missing"), "{e}");
        let e = parse_iperf3("p.json", "  ").unwrap_err();
        assert!(e.to_string().contains("got no JSON"), "{e}");
    }
}
