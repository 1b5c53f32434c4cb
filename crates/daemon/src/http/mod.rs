//! The daemon's small blocking HTTP/1.1 server, shared by `--metrics` ([`crate::metrics`]) and `--web`
//! ([`crate::web`]): one accept thread, one short-lived thread per connection, strict limits (request head size,
//! body size, connections at once, time to send the request, time for the answer to be read), one request per
//! connection (`Connection: close`). An answer is either whole or a stream (Server-Sent Events) written until
//! the client goes away or stops reading: a reader too slow to take an event within the write timeout is dropped.
//! What the server refuses it answers with a status when it can and counts by reason; nothing a client sends
//! stops it.

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
    /// Largest request body, bytes; longer: 413.
    pub max_body: usize,
    /// Connections served at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Time a client has to send its whole request (head and body); slower: 408.
    pub request_timeout: Duration,
    /// Time one write of the answer (a whole answer, or one event of a stream) may take to be taken.
    pub write_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_head: 8192,
            max_body: 0,
            max_connections: 16,
            request_timeout: Duration::from_secs(2),
            write_timeout: Duration::from_secs(10),
        }
    }
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reject {
    /// Not an HTTP/1.x request (400), or the client closed before sending one.
    Malformed,
    /// A head over [`Limits::max_head`] (431).
    TooLarge,
    /// More than [`Limits::max_connections`] at once (503).
    TooManyConnections,
    /// No complete request within [`Limits::request_timeout`] (408).
    Timeout,
    /// No such path (404).
    NotFound,
    /// A method the path does not take (405).
    Method,
    /// The answer could not be made (500).
    Internal,
    /// A body over [`Limits::max_body`] (413).
    BodyTooLarge,
    /// A write without the token (403).
    Forbidden,
    /// Too many event streams at once (503).
    Busy,
}

const REASONS: [(Reject, &str, &str); 10] = [
    (Reject::Malformed, "malformed", "400 Bad Request"),
    (Reject::TooLarge, "too_large", "431 Request Header Fields Too Large"),
    (Reject::TooManyConnections, "too_many_connections", "503 Service Unavailable"),
    (Reject::Timeout, "timeout", "408 Request Timeout"),
    (Reject::NotFound, "not_found", "404 Not Found"),
    (Reject::Method, "method", "405 Method Not Allowed"),
    (Reject::Internal, "internal", "500 Internal Server Error"),
    (Reject::BodyTooLarge, "body_too_large", "413 Content Too Large"),
    (Reject::Forbidden, "forbidden", "403 Forbidden"),
    (Reject::Busy, "busy", "503 Service Unavailable"),
];

impl Reject {
    /// Its name in the counters (`too_large`).
    pub fn name(self) -> &'static str {
        REASONS.iter().find(|x| x.0 == self).map_or("internal", |x| x.1)
    }

    /// Its status line's code and text (`431 Request Header Fields Too Large`).
    pub fn status(self) -> &'static str {
        REASONS.iter().find(|x| x.0 == self).map_or("500 Internal Server Error", |x| x.2)
    }
}

/// Refused requests by reason, and event streams dropped because their reader was too slow.
#[derive(Debug, Default)]
pub struct Stats {
    rejected: [AtomicU64; REASONS.len()],
    slow_readers: AtomicU64,
}

impl Stats {
    /// Counts one refusal.
    pub fn count(&self, r: Reject) {
        if let Some(i) = REASONS.iter().position(|x| x.0 == r) {
            self.rejected[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Each reason's name and count.
    pub fn rejected(&self) -> Vec<(&'static str, u64)> {
        REASONS.iter().zip(&self.rejected).map(|(r, n)| (r.1, n.load(Ordering::Relaxed))).collect()
    }

    /// Counts a stream dropped because its reader did not take an event within the write timeout.
    pub fn slow_reader(&self) {
        self.slow_readers.fetch_add(1, Ordering::Relaxed);
    }

    /// Streams dropped because their reader was too slow.
    pub fn slow_readers(&self) -> u64 {
        self.slow_readers.load(Ordering::Relaxed)
    }
}

/// A request as the server read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// `GET`, `HEAD`, `POST`...
    pub method: String,
    /// The path, without the query.
    pub path: String,
    /// The query, without its `?` (empty when none).
    pub query: String,
    /// The headers, names as sent.
    pub headers: Vec<(String, String)>,
    /// The body (empty without `Content-Length`).
    pub body: Vec<u8>,
}

impl Request {
    /// The value of the first header named `name` (any case), trimmed.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.trim())
    }

    /// True for HEAD: the answer's head only.
    pub fn is_head(&self) -> bool {
        self.method == "HEAD"
    }
}

/// Writes the events of a stream to its client; returns when a write fails or the stream is over.
pub type StreamWriter = Box<dyn FnOnce(&mut dyn Write) + Send>;

/// An answer.
pub enum Response {
    /// A whole answer: status (`200 OK`), content type, extra headers and body.
    Whole {
        /// Status line's code and text.
        status: &'static str,
        /// `Content-Type`.
        content_type: String,
        /// More headers (`Content-Disposition`, `Cache-Control`).
        headers: Vec<(&'static str, String)>,
        /// The body.
        body: Vec<u8>,
    },
    /// A stream of unknown length (`text/event-stream`): the head is written, then the writer runs.
    Stream {
        /// `Content-Type`.
        content_type: &'static str,
        /// Writes the body.
        writer: StreamWriter,
    },
}

impl Response {
    /// `200 OK` with `body`.
    pub fn ok(content_type: &str, body: impl Into<Vec<u8>>) -> Response {
        Response::Whole { status: "200 OK", content_type: content_type.into(), headers: Vec::new(), body: body.into() }
    }
}

/// Answers one request.
pub type Handler = Box<dyn Fn(&Request) -> Result<Response, Reject> + Send + Sync>;

/// The running server; stops accepting when dropped.
pub struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// Listens on `addr` and serves on a thread of its own (`name`: the flag, for messages and thread names).
    pub fn start(
        name: &str,
        addr: SocketAddr,
        limits: Limits,
        stats: Arc<Stats>,
        handler: Handler,
    ) -> Result<Server, String> {
        let listener = TcpListener::bind(addr).map_err(|e| format!("--{name} {addr}: cannot listen: {e}"))?;
        Server::start_on(name, listener, limits, stats, handler)
    }

    /// Serves on `listener` (bound by the caller: in another network namespace, before privileges are dropped).
    pub fn start_on(
        name: &str,
        listener: TcpListener,
        limits: Limits,
        stats: Arc<Stats>,
        handler: Handler,
    ) -> Result<Server, String> {
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let stop = Arc::new(AtomicBool::new(false));
        let (stop2, handler) = (stop.clone(), Arc::new(handler));
        let active = Arc::new(AtomicUsize::new(0));
        let conn_name = format!("{name}-conn");
        let thread = std::thread::Builder::new()
            .name(format!("{name}-http"))
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
                    let spawned = std::thread::Builder::new().name(conn_name.clone()).spawn(move || {
                        serve_one(stream, &limits, &stats, &handler);
                        active.fetch_sub(1, Ordering::Relaxed);
                    });
                    if spawned.is_err() {
                        tracing::warn!("http: cannot start a connection thread");
                    }
                }
            })
            .map_err(|e| format!("cannot start the {name} thread: {e}"))?;
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
    let status = r.status();
    let body = format!("{status}\n");
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// Reads the request head (up to the blank line) and what came after it, within the limits.
fn read_head(stream: &mut TcpStream, limits: &Limits, deadline: Instant) -> Result<(Vec<u8>, Vec<u8>), Reject> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        read_some(stream, &mut buf, &mut head, deadline)?;
        if let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = head.split_off(end + 4);
            head.truncate(end);
            return Ok((head, rest));
        }
        if head.len() > limits.max_head {
            return Err(Reject::TooLarge);
        }
    }
}

/// Appends one read to `out`, before `deadline`.
fn read_some(stream: &mut TcpStream, buf: &mut [u8], out: &mut Vec<u8>, deadline: Instant) -> Result<(), Reject> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(Reject::Timeout);
    }
    stream.set_read_timeout(Some(left)).map_err(|_| Reject::Internal)?;
    match stream.read(buf) {
        Ok(0) => Err(Reject::Malformed),
        Ok(n) => {
            out.extend_from_slice(&buf[..n]);
            Ok(())
        }
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            Err(Reject::Timeout)
        }
        Err(_) => Err(Reject::Malformed),
    }
}

/// Parses a request head (without its blank line); the body is read afterwards.
pub fn parse_head(head: &[u8]) -> Result<Request, Reject> {
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
    let mut headers = Vec::new();
    for h in lines {
        // Every header is `name: value`, the name a token (no obs-fold, no spaces before the colon).
        let (name, value) = h.split_once(':').ok_or(Reject::Malformed)?;
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_!#$%&'*+.^`|~".contains(&b)) {
            return Err(Reject::Malformed);
        }
        headers.push((name.to_string(), value.to_string()));
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    Ok(Request {
        method: method.to_string(),
        path: path.to_string(),
        query: query.to_string(),
        headers,
        body: Vec::new(),
    })
}

/// Reads the whole request: head, then the body its `Content-Length` announces (chunked bodies are refused).
fn read_request(stream: &mut TcpStream, limits: &Limits) -> Result<Request, Reject> {
    let deadline = Instant::now() + limits.request_timeout;
    let (head, mut body) = read_head(stream, limits, deadline)?;
    let mut request = parse_head(&head)?;
    if request.header("transfer-encoding").is_some() {
        return Err(Reject::Malformed);
    }
    let length = match request.header("content-length") {
        None => 0,
        Some(v) => v.parse::<usize>().map_err(|_| Reject::Malformed)?,
    };
    if length > limits.max_body {
        return Err(Reject::BodyTooLarge);
    }
    let mut buf = [0u8; 4096];
    while body.len() < length {
        read_some(stream, &mut buf, &mut body, deadline)?;
    }
    body.truncate(length);
    request.body = body;
    Ok(request)
}

fn serve_one(mut stream: TcpStream, limits: &Limits, stats: &Stats, handler: &Handler) {
    let _ = stream.set_write_timeout(Some(limits.write_timeout));
    let answer = read_request(&mut stream, limits).and_then(|r| Ok((handler(&r)?, r.is_head())));
    let (response, head_only) = match answer {
        Ok(a) => a,
        Err(r) => {
            stats.count(r);
            respond_error(stream, r);
            return;
        }
    };
    match response {
        Response::Whole { status, content_type, headers, body } => {
            let mut head = format!(
                "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n",
                body.len()
            );
            for (name, value) in headers {
                head.push_str(&format!("{name}: {value}\r\n"));
            }
            head.push_str("\r\n");
            let _ = stream.write_all(head.as_bytes());
            if !head_only {
                let _ = stream.write_all(&body);
            }
        }
        Response::Stream { content_type, writer } => {
            // A small send buffer: a reader that stops reading is found out after a few events, not megabytes.
            let _ = nix::sys::socket::setsockopt(&stream, nix::sys::socket::sockopt::SndBuf, &(64 * 1024));
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n"
            );
            if stream.write_all(head.as_bytes()).is_err() || head_only {
                return;
            }
            let mut timed = TimedWriter { stream, stats, timed_out: false };
            writer(&mut timed);
            let _ = timed.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A stream's connection: a write that times out marks its reader as too slow.
struct TimedWriter<'a> {
    stream: TcpStream,
    stats: &'a Stats,
    timed_out: bool,
}

impl Write for TimedWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let r = self.stream.write(buf);
        if let Err(e) = &r {
            if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) && !self.timed_out {
                self.timed_out = true;
                self.stats.slow_reader();
            }
        }
        r
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &str = "hello\n";

    fn server(limits: Limits) -> (Server, Arc<Stats>) {
        let stats = Arc::new(Stats::default());
        let handler: Handler = Box::new(|r: &Request| match (r.method.as_str(), r.path.as_str()) {
            ("GET" | "HEAD", "/x") => Ok(Response::ok("text/plain", BODY)),
            ("POST", "/echo") => Ok(Response::ok("text/plain", r.body.clone())),
            ("GET", "/stream") => Ok(Response::Stream {
                content_type: "text/event-stream",
                writer: Box::new(|w| {
                    let chunk = vec![b'x'; 64 * 1024];
                    while w.write_all(&chunk).is_ok() {}
                }),
            }),
            (_, "/x" | "/echo") => Err(Reject::Method),
            _ => Err(Reject::NotFound),
        });
        let s = Server::start("test", "127.0.0.1:0".parse().unwrap(), limits, stats.clone(), handler).unwrap();
        (s, stats)
    }

    fn exchange(addr: SocketAddr, request: &[u8]) -> String {
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = c.write_all(request);
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        String::from_utf8_lossy(&out).to_string()
    }

    fn count(stats: &Stats, reason: &str) -> u64 {
        stats.rejected().into_iter().find(|r| r.0 == reason).unwrap().1
    }

    #[test]
    fn parses_only_well_formed_heads() {
        let r = parse_head(b"GET /metrics?a=1 HTTP/1.1\r\nHost: x\r\nAccept: text/plain").unwrap();
        assert_eq!((r.method.as_str(), r.path.as_str(), r.query.as_str()), ("GET", "/metrics", "a=1"));
        assert_eq!(r.header("accept"), Some("text/plain"));
        assert!(parse_head(b"HEAD / HTTP/1.0").unwrap().is_head());
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
    fn serves_and_refuses_with_a_status() {
        let (s, stats) = server(Limits { max_body: 16, ..Limits::default() });
        let ok = exchange(s.addr(), b"GET /x HTTP/1.1\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.ends_with(BODY), "{ok}");
        let head = exchange(s.addr(), b"HEAD /x HTTP/1.1\r\n\r\n");
        assert!(head.contains("Content-Length: 6\r\n") && head.ends_with("\r\n\r\n"), "{head}");
        let echo = exchange(s.addr(), b"POST /echo HTTP/1.1\r\nContent-Length: 5\r\n\r\nabcde");
        assert!(echo.ends_with("\r\n\r\nabcde"), "{echo}");
        assert!(exchange(s.addr(), b"BLAH\r\n\r\n").starts_with("HTTP/1.1 400 "));
        assert!(exchange(s.addr(), b"GET /y HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
        assert!(exchange(s.addr(), b"DELETE /x HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405 "));
        let big = exchange(s.addr(), b"POST /echo HTTP/1.1\r\nContent-Length: 17\r\n\r\n");
        assert!(big.starts_with("HTTP/1.1 413 "), "{big}");
        let chunked = exchange(s.addr(), b"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n");
        assert!(chunked.starts_with("HTTP/1.1 400 "), "{chunked}");
        let (malformed, not_found, method) =
            (count(&stats, "malformed"), count(&stats, "not_found"), count(&stats, "method"));
        assert_eq!((malformed, not_found, method, count(&stats, "body_too_large")), (2, 1, 1, 1));
    }

    #[test]
    fn a_head_over_the_limit_is_refused_431() {
        let (s, stats) = server(Limits::default());
        let mut big = b"GET /x HTTP/1.1\r\nX-Big: ".to_vec();
        big.extend(std::iter::repeat_n(b'a', 100 * 1024));
        big.extend_from_slice(b"\r\n\r\n");
        assert!(exchange(s.addr(), &big).starts_with("HTTP/1.1 431 "));
        assert_eq!(count(&stats, "too_large"), 1);
    }

    #[test]
    fn a_body_slower_than_the_request_timeout_is_refused_408() {
        let limits = Limits { max_body: 100, request_timeout: Duration::from_millis(300), ..Limits::default() };
        let (s, stats) = server(limits);
        let answer = exchange(s.addr(), b"POST /echo HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc");
        assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
        assert_eq!(count(&stats, "timeout"), 1);
    }

    #[test]
    fn idle_connections_time_out_and_extra_ones_are_refused() {
        let limits = Limits { max_connections: 4, request_timeout: Duration::from_millis(300), ..Limits::default() };
        let (s, stats) = server(limits);
        let idle: Vec<TcpStream> = (0..20).map(|_| TcpStream::connect(s.addr()).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(100));
        assert!(count(&stats, "too_many_connections") >= 16 - 4, "{:?}", stats.rejected());
        // Once the idle ones timed out, a request is served again.
        std::thread::sleep(Duration::from_millis(400));
        let ok = exchange(s.addr(), b"GET /x HTTP/1.1\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK"), "{ok}");
        assert!(count(&stats, "timeout") >= 4, "{:?}", stats.rejected());
        drop(idle);
    }

    #[test]
    fn a_client_that_closes_early_is_counted_and_the_server_goes_on() {
        let (s, stats) = server(Limits::default());
        drop(TcpStream::connect(s.addr()).unwrap());
        let mut c = TcpStream::connect(s.addr()).unwrap();
        c.write_all(b"GET /x").unwrap();
        drop(c);
        std::thread::sleep(Duration::from_millis(100));
        assert!(exchange(s.addr(), b"GET /x HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 200 OK"));
        assert_eq!(count(&stats, "malformed"), 2);
    }

    #[test]
    fn a_stream_whose_reader_stops_reading_is_dropped() {
        let limits = Limits { max_connections: 1, write_timeout: Duration::from_millis(200), ..Limits::default() };
        let (s, stats) = server(limits);
        let mut c = TcpStream::connect(s.addr()).unwrap();
        c.write_all(b"GET /stream HTTP/1.1\r\n\r\n").unwrap();
        // It never reads: once the socket buffers are full, a write times out and the stream ends.
        let deadline = Instant::now() + Duration::from_secs(10);
        while stats.slow_readers() == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(stats.slow_readers(), 1);
        // Its connection slot is free again.
        std::thread::sleep(Duration::from_millis(100));
        assert!(exchange(s.addr(), b"GET /x HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 200 OK"));
    }
}
