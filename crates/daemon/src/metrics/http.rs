//! The routes of `--metrics` on the daemon's HTTP server ([`crate::http`]): `GET /metrics` (and HEAD), in
//! OpenMetrics text for Prometheus or the classic text format for other clients.

use crate::http::{Handler, Reject, Request, Response};

/// What a well-formed request for /metrics asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Asked {
    /// GET (the body too), not HEAD.
    pub body: bool,
    /// Its `Accept` names OpenMetrics (as Prometheus's does); else the classic text format 0.0.4 (curl, promtool).
    pub openmetrics: bool,
}

/// What a request asks of /metrics.
pub fn asked(r: &Request) -> Result<Asked, Reject> {
    if r.path != "/metrics" {
        return Err(Reject::NotFound);
    }
    let openmetrics = r.header("accept").is_some_and(|a| a.contains("application/openmetrics-text"));
    match r.method.as_str() {
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

/// Serves /metrics with the exposition `scrape` makes (OpenMetrics text).
pub fn handler(scrape: impl Fn() -> Result<String, String> + Send + Sync + 'static) -> Handler {
    Box::new(move |r: &Request| {
        let asked = asked(r)?;
        let body = scrape().map_err(|e| {
            tracing::warn!(error = %e, "metrics: scrape failed");
            Reject::Internal
        })?;
        Ok(if asked.openmetrics {
            Response::ok("application/openmetrics-text; version=1.0.0; charset=utf-8", body)
        } else {
            Response::ok("text/plain; version=0.0.4; charset=utf-8", classic_text(&body))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::{parse_head, Limits, Server, Stats};
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::sync::Arc;
    use std::time::Duration;

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

    #[test]
    fn asks_only_gets_of_metrics() {
        let ask = |head: &[u8]| asked(&parse_head(head).unwrap());
        let om = b"GET /metrics HTTP/1.1\r\nHost: x\r\naccept: application/openmetrics-text;version=1.0.0,*/*";
        assert_eq!(ask(om), Ok(Asked { body: true, openmetrics: true }));
        assert_eq!(ask(b"GET /metrics HTTP/1.1\r\nAccept: */*"), Ok(Asked { body: true, openmetrics: false }));
        assert_eq!(ask(b"HEAD /metrics?x=1 HTTP/1.0"), Ok(Asked { body: false, openmetrics: false }));
        assert_eq!(ask(b"GET / HTTP/1.1"), Err(Reject::NotFound));
        assert_eq!(ask(b"POST /metrics HTTP/1.1"), Err(Reject::Method));
    }

    #[test]
    fn serves_both_formats() {
        let stats = Arc::new(Stats::default());
        let h = handler(|| Ok(EXPOSITION.into()));
        let s = Server::start("metrics", "127.0.0.1:0".parse().unwrap(), Limits::default(), stats, h).unwrap();
        let exchange = |request: &[u8]| {
            let mut c = TcpStream::connect(s.addr()).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            c.write_all(request).unwrap();
            let mut out = String::new();
            let _ = c.read_to_string(&mut out);
            out
        };
        let ok = exchange(b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.ends_with(EXPOSITION), "{ok}");
        assert!(ok.contains("Content-Type: application/openmetrics-text"), "{ok}");
        let classic = exchange(b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(classic.contains("version=0.0.4") && classic.ends_with("g 1.0\n"), "{classic}");
    }
}
