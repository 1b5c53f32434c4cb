//! The client side of the control protocol, used by the CLI, `flexstack run`, the lab runner and the tests.
//!
//! [`Client::call`] sends one operation of [`crate::ops`] and returns its typed result (the example of
//! docs/control-api.md, "Typed clients"):
//!
//! ```no_run
//! use flexstack_api::{ops, Client};
//! # fn main() -> Result<(), flexstack_api::ClientError> {
//! let mut client = Client::connect(std::path::Path::new("/run/flexstack"))?;
//! for m in client.call(ops::ModuleList)? {
//!     // A renamed field is a compile error here, not a silent `null`.
//!     println!("{} {}: {} frames in, {} dropped", m.kind, m.name, m.frames_in, m.frames_dropped);
//! }
//! let values = client.call(ops::Get { names: vec!["module.*.frames_in_total".into()] })?;
//! println!("{} frames into count", values["module.count.frames_in_total"].value);
//! let set = client.call(ops::Set { name: "module.sel.select".into(), value: 1.into() })?;
//! println!("revision {:?}, select = {:?}", set.revision, set.value);
//! let watch = ops::Watch { names: vec!["module.count.*".into()], interval_ms: Some(100), changes: false, count: Some(3) };
//! client.watch(watch, &mut |event| {
//!     println!("{} ms: {:?}", event.t_ms, event.values);
//!     true // false stops the stream
//! })?;
//! # Ok(())
//! # }
//! ```

use crate::ops::{Watch, WatchEvent};
use crate::protocol::{request_line, ApiError, Call, Request, Response, MAX_REQUEST_BYTES};
use serde::de::DeserializeOwned;
use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixStream;
use std::path::Path;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No daemon answers at the state directory's socket.
    #[error("cannot reach the flexstack daemon at {path}: {source} (start one with `flexstack daemon --stack FILE`, or give --state-dir)")]
    Connect {
        /// The socket path.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The connection broke or the daemon sent something unreadable.
    #[error("control connection failed: {0}")]
    Protocol(String),
    /// The daemon answered with an error.
    #[error("{0}")]
    Api(ApiError),
    /// The request is longer than the daemon accepts ([`MAX_REQUEST_BYTES`]); it was not sent.
    #[error(
        "the request is {bytes} bytes long, over the daemon's limit of {} bytes (1 MiB); nothing was sent",
        MAX_REQUEST_BYTES
    )]
    TooLarge {
        /// The request's length, without its newline.
        bytes: usize,
    },
}

/// A connection to a daemon.
pub struct Client {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
    next_id: u64,
}

impl Client {
    /// Connects to the daemon whose state directory is `state_dir`.
    pub fn connect(state_dir: &Path) -> Result<Client, ClientError> {
        let path = socket_path(state_dir);
        let stream = UnixStream::connect(&path)
            .map_err(|source| ClientError::Connect { path: path.display().to_string(), source })?;
        let reader = BufReader::new(stream.try_clone().map_err(|e| ClientError::Protocol(e.to_string()))?);
        Ok(Client { writer: stream, reader, next_id: 1 })
    }

    /// Sends one request. One over the daemon's limit is refused here, before anything is sent. When the write
    /// fails because the daemon answered and closed the connection (a timeout, a full house), its answer is the
    /// error: it says why, where the broken pipe would not.
    fn send(&mut self, request: &Request) -> Result<(), ClientError> {
        let line = request_line(self.next_id, request);
        let bytes = line.trim_end_matches('\n').len();
        if bytes > MAX_REQUEST_BYTES {
            return Err(ClientError::TooLarge { bytes });
        }
        self.next_id += 1;
        if let Err(e) = write_all_nosignal(&self.writer, line.as_bytes()) {
            if let Ok(Some(Response { error: Some(answer), .. })) = self.receive() {
                return Err(ClientError::Api(answer));
            }
            return Err(ClientError::Protocol(e.to_string()));
        }
        Ok(())
    }

    fn receive(&mut self) -> Result<Option<Response>, ClientError> {
        let mut line = String::new();
        let n = self.reader.read_line(&mut line).map_err(|e| ClientError::Protocol(e.to_string()))?;
        if n == 0 {
            return Ok(None);
        }
        serde_json::from_str(&line).map(Some).map_err(|e| unreadable("response", e))
    }

    /// Sends `call` and returns its result.
    pub fn call<C: Call>(&mut self, call: C) -> Result<C::Response, ClientError> {
        self.send(&call.into())?;
        let r = self.receive()?.ok_or_else(|| ClientError::Protocol("the daemon closed the connection".into()))?;
        result_of(r)
    }

    /// Sends a `watch` request and hands each sample to `on_event` until it returns false or the stream ends
    /// (the daemon sends a final result when a `count` is reached).
    pub fn watch(&mut self, watch: Watch, on_event: &mut dyn FnMut(WatchEvent) -> bool) -> Result<(), ClientError> {
        self.send(&Request::Watch(watch))?;
        while let Some(r) = self.receive()? {
            if let Some(e) = r.error {
                return Err(ClientError::Api(e));
            }
            if let Some(ev) = r.event {
                let ev = serde_json::from_value(ev).map_err(|e| unreadable("event", e))?;
                if !on_event(ev) {
                    return Ok(());
                }
            } else if r.result.is_some() {
                // The end of a stream that stopped by itself (`count` reached).
                return Ok(());
            }
        }
        Ok(())
    }
}

/// Writes all of `buf` without raising SIGPIPE when the daemon has closed its end (an error instead).
fn write_all_nosignal(stream: &UnixStream, mut buf: &[u8]) -> std::io::Result<()> {
    use nix::sys::socket::{send, MsgFlags};
    use std::os::fd::AsRawFd;
    while !buf.is_empty() {
        match send(stream.as_raw_fd(), buf, MsgFlags::MSG_NOSIGNAL) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn unreadable(what: &str, e: serde_json::Error) -> ClientError {
    ClientError::Protocol(format!("unreadable {what}: {e}"))
}

/// The result of a response line as a `T`, or the daemon's error.
pub fn result_of<T: DeserializeOwned>(response: Response) -> Result<T, ClientError> {
    match (response.ok, response.result, response.error) {
        (true, Some(result), _) => serde_json::from_value(result).map_err(|e| unreadable("result", e)),
        (_, _, Some(e)) => Err(ClientError::Api(e)),
        _ => Err(ClientError::Protocol("response without result or error".into())),
    }
}

/// Name of the control socket inside the state directory.
pub const SOCKET_NAME: &str = "control.sock";

/// The control socket's path in `state_dir`.
pub fn socket_path(state_dir: &std::path::Path) -> std::path::PathBuf {
    state_dir.join(SOCKET_NAME)
}
