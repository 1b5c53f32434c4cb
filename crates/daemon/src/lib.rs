//! flexstack-daemon: everything that runs inside `flexstack daemon`.
//!
//! - [`server`] runs the daemon: state directory, private control socket, client threads; [`privileges`] drops
//!   the capabilities it does not need.
//! - [`dataplane`] owns the switch on its own thread and applies queued edits between batches.
//! - [`actions`] holds one action function per control operation, behind both the API and the CLI.
//! - [`rules`] runs the cross-layer rules on a thread of their own; [`appvars`] serves applications' variables.
//! - [`sandbox`] builds and removes the namespaces of sandboxed apps; [`sockdiag`] reads the transport meters of
//!   their forwarded TCP flows from their own sockets.
//! - [`journal`] keeps every stack revision and rules change in the state directory, for `daemon --restore`.
//! - [`catalog`] lists every module kind the daemon can load.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod actions;
pub mod appvars;
pub mod dataplane;
pub mod http;
pub mod journal;
pub mod metrics;
pub mod privileges;
pub mod rules;
pub mod sandbox;
pub mod server;
pub mod sockdiag;
pub mod web;

/// Every module kind the daemon can load: the built-in modules and the faces. A renamed kind still loads by its
/// old name, and the first use of each old name logs a deprecation warning.
pub fn catalog() -> flexstack_core::Catalog {
    let mut catalog = catalog_quiet();
    catalog.on_alias(|old, new| {
        tracing::warn!("`{old}` is deprecated: it was renamed `{new}`; the old name still works for now")
    });
    catalog
}

/// The same kinds as [`catalog`], with no warning for old names: the data plane configures with it the modules of
/// its other workers, whose first configuration already warned.
pub(crate) fn catalog_quiet() -> flexstack_core::Catalog {
    let mut catalog = flexstack_modules::catalog();
    catalog.register(Box::new(flexstack_faces::TunKind));
    catalog.register(Box::new(flexstack_faces::PacketKind));
    flexstack_faces::stream::install(); // backend = "kernel" of terminate and originate
    flexstack_faces::peer::install(); // the `carrier` kind's connections (docs/peers.md)
    catalog
}

#[cfg(test)]
mod tests {
    use flexstack_core::{Settings, StackSpec};
    use std::sync::{Arc, Mutex};

    /// Collects what is logged.
    #[derive(Clone, Default)]
    struct Logged(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Logged {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Stack files with the old kind names load, and each old name is logged once, however often it is used.
    #[test]
    fn old_kind_names_load_and_warn_once() {
        let logged = Logged::default();
        let writer = logged.clone();
        let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
        tracing::subscriber::with_default(subscriber, || {
            let catalog = super::catalog();
            let text = "[modules.a]\nkind = \"switch\"\n[modules.b]\nkind = \"switch\"\noutputs = 3\n\
                        [modules.c]\nkind = \"link\"\nmac = \"02:00:00:00:00:01\"\n";
            let spec = StackSpec::parse("old.toml", text).unwrap();
            for _ in 0..2 {
                for m in &spec.modules {
                    catalog.configure(&m.kind, &m.settings, m.location.clone()).unwrap_or_else(|e| panic!("{e}"));
                }
            }
            catalog.configure("select", &Settings::default(), None).unwrap();
        });
        let text = String::from_utf8(logged.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(
            lines[0].contains("WARN") && lines[0].contains("`switch` is deprecated: it was renamed `select`"),
            "{text}"
        );
        assert!(lines[1].contains("`link` is deprecated: it was renamed `ethernet`"), "{text}");
    }
}
