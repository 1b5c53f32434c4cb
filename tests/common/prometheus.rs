//! A real Prometheus (Debian's package) on loopback, for the tests of `--metrics`.

use crate::common::{text, Background};
use serde_json::Value as Json;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A loopback port free right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A Prometheus server on loopback scraping `target` every second; killed when dropped.
pub struct Prometheus {
    _proc: Background,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    pub fn start(target: u16) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: flexstack\n    \
                 static_configs:\n      - targets: ['127.0.0.1:{target}']\n"
            ),
        )
        .unwrap();
        Prometheus::with_config(&config, dir)
    }

    /// A Prometheus server with the configuration file `config`, its storage in `dir`.
    pub fn with_config(config: &Path, dir: tempfile::TempDir) -> Prometheus {
        let port = free_port();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("log")).unwrap())
            .spawn()
            .expect("prometheus (Debian package `prometheus`, see scripts/setup.sh)");
        let p = Prometheus { _proc: Background(child), port, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while p.get("/-/ready").is_none_or(|(status, _)| status != 200) {
            assert!(Instant::now() < deadline, "prometheus did not get ready");
            std::thread::sleep(Duration::from_millis(100));
        }
        p
    }

    /// Status and body of a GET on Prometheus's web API; `None` when it does not answer.
    pub fn get(&self, path_and_query: &str) -> Option<(u16, String)> {
        let out = Command::new("curl")
            .args(["-s", "-m", "5", "-w", "\n%{http_code}", &format!("http://127.0.0.1:{}{path_and_query}", self.port)])
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (body, code) = text.rsplit_once('\n')?;
        Some((code.parse().ok()?, body.to_string()))
    }

    /// The result vector of an instant PromQL query.
    pub fn query(&self, promql: &str) -> Vec<Json> {
        let out = Command::new("curl")
            .args(["-s", "-m", "5", &format!("http://127.0.0.1:{}/api/v1/query", self.port)])
            .args(["--data-urlencode", &format!("query={promql}")])
            .output()
            .unwrap();
        let j: Json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{promql}: {e}: {}", text(&out)));
        assert_eq!(j["status"], "success", "{promql}: {j}");
        j["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// The single value of an instant query.
    pub fn value(&self, promql: &str) -> f64 {
        let r = self.query(promql);
        assert_eq!(r.len(), 1, "{promql}: {r:?}");
        r[0]["value"][1].as_str().unwrap().parse().unwrap()
    }
}
