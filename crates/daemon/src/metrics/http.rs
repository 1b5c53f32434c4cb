//! A minimal blocking HTTP/1.1 server for `GET /metrics`: one accept thread, one short-lived thread per
//! connection, strict limits (request head size, connections at once, time to send the request), one request per
//! connection (`Connection: close`). What it refuses it answers with a status when it can and counts by reason;
//! nothing a client sends stops it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The server's limits.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest request head (request line and headers), bytes; longer: 431.
    pub max_head: usize,
    /// Connections served at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Time a client has to send its whole request head; slower: 408.
    pub request_timeout: Duration,
    /// Time the answer may take to be read.
    pub write_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_head: 8192,
            max_connections: 16,
            request_timeout: Duration::from_secs(2),
            write_timeout: Duration::from_secs(10),
        }
    }
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reject {
    /// Not an HTTP/1.x request head (400), or the client closed before sending one.
    Malformed,
    /// A head over [`Limits::max_head`] (431).
    TooLarge,
    /// More than [`Limits::max_connections`] at once (503).
    TooManyConnections,
    /// No complete head within [`Limits::request_timeout`] (408).
    Timeout,
    /// Another path than /metrics (404).
    NotFound,
    /// Another method than GET or HEAD (405).
    Method,
    /// The registry could not be read (500).
    Internal,
}

const REASONS: [(Reject, &str, &str); 7] = [
    (Reject::Malformed, "malformed", "400 Bad Request"),
    (Reject::TooLarge, "too_large", "431 Request Header Fields Too Large"),
    (Reject::TooManyConnections, "too_many_connections", "503 Service Unavailable"),
    (Reject::Timeout, "timeout", "408 Request Timeout"),
    (Reject::NotFound, "not_found", "404 Not Found"),
    (Reject::Method, "method", "405 Method Not Allowed"),
    (Reject::Internal, "internal", "500 Internal Server Error"),
];

/// Refused requests by reason (exported as `flexstack_metrics_http_rejected_total`).
#[derive(Debug, Default)]
pub struct Stats {
    rejected: [AtomicU64; REASONS.len()],
}

impl Stats {
    fn count(&self, r: Reject) {
        if let Some(i) = REASONS.iter().position(|x| x.0 == r) {
            self.rejected[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Each reason's name and count.
    pub fn rejected(&self) -> Vec<(&'static str, u64)> {
        REASONS.iter().zip(&self.rejected).map(|(r, n)| (r.1, n.load(Ordering::Relaxed))).collect()
    }
}

/// Makes the body of one scrape.
pub type Handler = Box<dyn Fn() -> Result<String, String> + Send + Sync>;

/// The running server; stops accepting when dropped.
pub struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// Listens on `addr` and serves on a thread of its own.
    pub fn start(addr: SocketAddr, limits: Limits, stats: Arc<Stats>, handler: Handler) -> Result<Server, String> {
        let listener = TcpListener::bind(addr).map_err(|e| format!("--metrics {addr}: cannot listen: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let stop = Arc::new(AtomicBool::new(false));
        let (stop2, handler) = (stop.clone(), Arc::new(handler));
        let active = Arc::new(AtomicUsize::new(0));
        let thread = std::thread::Builder::new()
            .name("metrics-http".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(stream) = conn else { continue };
                    if active.load(Ordering::Relaxed) >= limits.max_connections {
                        stats.count(Reject::TooManyConnections);
                        let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
                        respond_error(stream, Reject::TooManyConnections);
                        continue;
                    }
                    active.fetch_add(1, Ordering::Relaxed);
                    let (active, stats, handler) = (active.clone(), stats.clone(), handler.clone());
                    let spawned = std::thread::Builder::new().name("metrics-conn".into()).spawn(move || {
                        serve_one(stream, &limits, &stats, &handler);
                        active.fetch_sub(1, Ordering::Relaxed);
                    });
                    if spawned.is_err() {
                        tracing::warn!("metrics: cannot start a connection thread");
                    }
                }
            })
            .map_err(|e| format!("cannot start the metrics thread: {e}"))?;
        Ok(Server { addr, stop, thread: Some(thread) })
    }

    /// The address it listens on (the port chosen when `:0` was asked).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees `stop`.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn respond_error(mut stream: TcpStream, r: Reject) {
    let status = REASONS.iter().find(|x| x.0 == r).map_or("500 Internal Server Error", |x| x.2);
    let body = format!("{status}\n");
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// Reads the request head: up to the blank line, within the limits.
fn read_head(stream: &mut TcpStream, limits: &Limits) -> Result<Vec<u8>, Reject> {
    let deadline = Instant::now() + limits.request_timeout;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Reject::Timeout);
        }
        stream.set_read_timeout(Some(left)).map_err(|_| Reject::Internal)?;
        let n = match stream.read(&mut buf) {
            Ok(0) => return Err(Reject::Malformed),
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Err(Reject::Timeout)
            }
            Err(_) => return Err(Reject::Malformed),
        };
        head.extend_from_slice(&buf[..n]);
        if let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            head.truncate(end);
            return Ok(head);
        }
        if head.len() > limits.max_head {
            return Err(Reject::TooLarge);
        }
    }
}

/// What a well-formed request for /metrics asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Asked {
    /// GET (the body too), not HEAD.
    pub body: bool,
    /// Its `Accept` names OpenMetrics (as Prometheus's does); else the classic text format 0.0.4 (curl, promtool).
    pub openmetrics: bool,
}

/// Parses a request head (without its blank line).
pub fn parse_head(head: &[u8]) -> Result<Asked, Reject> {
    let text = std::str::from_utf8(head).map_err(|_| Reject::Malformed)?;
    let mut lines = text.split("\r\n");
    let line = lines.next().ok_or(Reject::Malformed)?;
    let mut parts = line.split(' ');
    let (method, target, version) =
        (parts.next().ok_or(Reject::Malformed)?, parts.next().ok_or(Reject::Malformed)?, parts.next());
    if parts.next().is_some() || !matches!(version, Some("HTTP/1.1" | "HTTP/1.0")) {
        return Err(Reject::Malformed);
    }
    if method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) || !target.starts_with('/') {
        return Err(Reject::Malformed);
    }
    let mut openmetrics = false;
    for h in lines {
        // Every header is `name: value`, the name a token (no obs-fold, no spaces before the colon).
        let (name, value) = h.split_once(':').ok_or(Reject::Malformed)?;
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_!#$%&'*+.^`|~".contains(&b)) {
            return Err(Reject::Malformed);
        }
        if name.eq_ignore_ascii_case("accept") && value.contains("application/openmetrics-text") {
            openmetrics = true;
        }
    }
    let path = target.split('?').next().unwrap_or_default();
    if path != "/metrics" {
        return Err(Reject::NotFound);
    }
    match method {
        "GET" => Ok(Asked { body: true, openmetrics }),
        "HEAD" => Ok(Asked { body: false, openmetrics }),
        _ => Err(Reject::Method),
    }
}

/// The classic Prometheus text format (0.0.4) of an OpenMetrics exposition: a counter's `# HELP` and `# TYPE`
/// name its samples (`x_total`), and there is no `# UNIT` or `# EOF`.
pub fn classic_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> =
        openmetrics.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let comment = ["# HELP ", "# TYPE "].into_iter().find(|p| line.starts_with(p));
        match comment.and_then(|p| Some((p, line[p.len()..].split_once(' ')?))) {
            Some((p, (name, rest))) if counters.contains(name) => {
                out.push_str(&format!("{p}{name}_total {rest}"));
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

fn serve_one(mut stream: TcpStream, limits: &Limits, stats: &Stats, handler: &Handler) {
    let _ = stream.set_write_timeout(Some(limits.write_timeout));
    let asked = read_head(&mut stream, limits).and_then(|h| parse_head(&h));
    let asked = match asked {
        Ok(a) => a,
        Err(r) => {
            stats.count(r);
            respond_error(stream, r);
            return;
        }
    };
    let body = match handler() {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "metrics: scrape failed");
            stats.count(Reject::Internal);
            respond_error(stream, Reject::Internal);
            return;
        }
    };
    let (body, ty) = if asked.openmetrics {
        (body, "application/openmetrics-text; version=1.0.0; charset=utf-8")
    } else {
        (classic_text(&body), "text/plain; version=0.0.4; charset=utf-8")
    };
    let head =
        format!("HTTP/1.1 200 OK\r\nContent-Type: {ty}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
    let _ = stream.write_all(head.as_bytes());
    if asked.body {
        let _ = stream.write_all(body.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXPOSITION: &str = "# HELP c_seconds help\n# TYPE c_seconds counter\n# UNIT c_seconds seconds\n\
        c_seconds_total 1\n# HELP g help\n# TYPE g gauge\ng 1.0\n# EOF\n";

    #[test]
    fn classic_text_names_counters_by_their_samples_and_drops_unit_and_eof() {
        assert_eq!(
            classic_text(EXPOSITION),
            "# HELP c_seconds_total help\n# TYPE c_seconds_total counter\nc_seconds_total 1\n\
             # HELP g help\n# TYPE g gauge\ng 1.0\n"
        );
    }

    fn server(limits: Limits) -> (Server, Arc<Stats>) {
        let stats = Arc::new(Stats::default());
        let s =
            Server::start("127.0.0.1:0".parse().unwrap(), limits, stats.clone(), Box::new(|| Ok(EXPOSITION.into())))
                .unwrap();
        (s, stats)
    }

    fn exchange(addr: SocketAddr, request: &[u8]) -> String {
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = c.write_all(request);
        let mut out = String::new();
        let _ = c.read_to_string(&mut out);
        out
    }

    fn count(stats: &Stats, reason: &str) -> u64 {
        stats.rejected().into_iter().find(|r| r.0 == reason).unwrap().1
    }

    #[test]
    fn parses_only_well_formed_gets_of_metrics() {
        let om = b"GET /metrics HTTP/1.1\r\nHost: x\r\naccept: application/openmetrics-text;version=1.0.0,*/*";
        assert_eq!(parse_head(om), Ok(Asked { body: true, openmetrics: true }));
        assert_eq!(parse_head(b"GET /metrics HTTP/1.1\r\nAccept: */*"), Ok(Asked { body: true, openmetrics: false }));
        assert_eq!(parse_head(b"HEAD /metrics?x=1 HTTP/1.0"), Ok(Asked { body: false, openmetrics: false }));
        assert_eq!(parse_head(b"GET / HTTP/1.1"), Err(Reject::NotFound));
        assert_eq!(parse_head(b"POST /metrics HTTP/1.1"), Err(Reject::Method));
        for bad in [
            &b"GET /metrics"[..],
            b"GET  /metrics HTTP/1.1",
            b"get /metrics HTTP/1.1",
            b"GET metrics HTTP/1.1",
            b"GET /metrics HTTP/2",
            b"GET /metrics HTTP/1.1\r\nno colon",
            b"GET /metrics HTTP/1.1\r\n bad: fold",
            b"\xff\xfe",
            b"",
        ] {
            assert_eq!(parse_head(bad), Err(Reject::Malformed), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn serves_metrics_and_refuses_the_rest_with_a_status() {
        let (s, stats) = server(Limits::default());
        let ok = exchange(s.addr(), b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.ends_with(EXPOSITION), "{ok}");
        assert!(ok.contains("Content-Type: application/openmetrics-text"), "{ok}");
        let classic = exchange(s.addr(), b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(classic.contains("version=0.0.4") && classic.ends_with("g 1.0\n"), "{classic}");
        assert!(exchange(s.addr(), b"BLAH\r\n\r\n").starts_with("HTTP/1.1 400 "));
        assert!(exchange(s.addr(), b"GET /x HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
        assert_eq!((count(&stats, "malformed"), count(&stats, "not_found")), (1, 1));
    }

    #[test]
    fn a_head_over_the_limit_is_refused_431() {
        let (s, stats) = server(Limits::default());
        let mut big = b"GET /metrics HTTP/1.1\r\nX-Big: ".to_vec();
        big.extend(std::iter::repeat_n(b'a', 100 * 1024));
        big.extend_from_slice(b"\r\n\r\n");
        assert!(exchange(s.addr(), &big).starts_with("HTTP/1.1 431 "));
        assert_eq!(count(&stats, "too_large"), 1);
    }

    #[test]
    fn idle_connections_time_out_and_extra_ones_are_refused() {
        let limits = Limits { max_connections: 4, request_timeout: Duration::from_millis(300), ..Limits::default() };
        let (s, stats) = server(limits);
        let idle: Vec<TcpStream> = (0..20).map(|_| TcpStream::connect(s.addr()).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(100));
        assert!(count(&stats, "too_many_connections") >= 16 - 4, "{:?}", stats.rejected());
        // Once the idle ones timed out, a scrape is served again.
        std::thread::sleep(Duration::from_millis(400));
        let ok = exchange(s.addr(), b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK"), "{ok}");
        assert!(count(&stats, "timeout") >= 4, "{:?}", stats.rejected());
        drop(idle);
    }

    #[test]
    fn a_client_that_closes_early_is_counted_and_the_server_goes_on() {
        let (s, stats) = server(Limits::default());
        drop(TcpStream::connect(s.addr()).unwrap());
        let mut c = TcpStream::connect(s.addr()).unwrap();
        c.write_all(b"GET /met").unwrap();
        drop(c);
        std::thread::sleep(Duration::from_millis(100));
        assert!(exchange(s.addr(), b"GET /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 200 OK"));
        assert_eq!(count(&stats, "malformed"), 2);
    }
}
