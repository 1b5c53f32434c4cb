//! The `backend` setting of `terminate` and `originate`, and the hook through which the daemon builds the `kernel`
//! back-end (`flexstack_faces::stream`): kernel sockets are I/O at the edge, like faces, so their code lives above
//! this crate and is installed at startup ([`install_kernel`]). Without it (a catalog of this crate alone, as in
//! its tests), `backend = "kernel"` is refused with a message that says so.

use crate::stream::matcher::MatchTable;
use flexstack_core::config::SettingsReader;
use flexstack_core::{ConfigError, KindDecl, ModuleBuilder, ModuleInterface, Settings};
use std::sync::OnceLock;

pub use crate::stream::endpoint::config::{flow_specs, Cc, Config, Meters};
pub use crate::stream::endpoint::{EndpointBuilder, Ports, Side};

/// The back-ends an endpoint can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// smoltcp, in the data plane.
    Smoltcp,
    /// The host kernel's TCP, sockets in the daemon.
    Kernel,
}

/// What the kernel back-end is built from: everything the kind read, as the smoltcp back-end would get it.
pub struct KernelRequest {
    /// `terminate` (App) or `originate` (Net).
    pub side: Side,
    /// The settings and knobs read.
    pub cfg: Config,
    /// terminate: its match table.
    pub matcher: MatchTable,
    /// terminate: the network namespace of the app (`netns`, a name under /run/netns); empty: none given.
    pub netns: String,
    /// originate: the app's host face (`host_dev`), where the host routes the app's addresses (the server role's
    /// connections to them are redirected); empty: none given.
    pub host_dev: String,
    /// The interface the smoltcp back-end would have (ports, knobs, meters, match rule meters).
    pub interface: ModuleInterface,
    /// The kind's declaration (publishing knobs, binding meters, writing knobs).
    pub decl: &'static KindDecl<Config, Meters>,
    /// The smoltcp back-end of the same settings, with the kernel back-end's `ports`: `terminate`'s kernel back-end
    /// runs it for the UDP flows it selects (app-side UDP has no kernel state to take over).
    pub smoltcp: Box<dyn FnOnce(Ports) -> Box<dyn ModuleBuilder> + Send>,
}

/// Builds the kernel back-end of an endpoint; the error is a message about the setting `backend`.
pub type KernelHook = fn(KernelRequest) -> Result<Box<dyn ModuleBuilder>, String>;

static KERNEL: OnceLock<KernelHook> = OnceLock::new();

/// Installs the kernel back-end (the daemon does, once); later calls change nothing.
pub fn install_kernel(hook: KernelHook) {
    let _ = KERNEL.set(hook);
}

/// Reads `backend` (`smoltcp` by default).
fn read(r: &mut SettingsReader<'_>) -> Result<Backend, ConfigError> {
    match r.string("backend")?.as_deref() {
        None | Some("smoltcp") => Ok(Backend::Smoltcp),
        Some("kernel") => Ok(Backend::Kernel),
        Some(other) => Err(r.error("backend", format_args!("expected \"smoltcp\" or \"kernel\", got {other:?}"))),
    }
}

/// Reads an endpoint's settings (`EndpointBuilder::read`, with `more` what only its kind has) and `backend` (and
/// `terminate`'s `netns`), and builds that back-end: smoltcp, or the kernel one through the installed hook (errors
/// located at the `backend` setting).
pub fn configure(
    settings: &Settings,
    kind: &str,
    decl: &'static KindDecl<Config, Meters>,
    (side, ports): (Side, Ports),
    more: impl FnOnce(&mut SettingsReader<'_>) -> Result<MatchTable, ConfigError>,
) -> Result<Box<dyn ModuleBuilder>, ConfigError> {
    let (mut backend, mut netns, mut host_dev) = (Backend::Smoltcp, String::new(), String::new());
    let b = EndpointBuilder::read(settings, kind, decl, (side, ports), |r| {
        let matcher = more(r)?;
        backend = read(r)?;
        if side == Side::App {
            netns = r.string("netns")?.unwrap_or_default();
        } else {
            host_dev = r.string("host_dev")?.unwrap_or_default();
        }
        Ok(matcher)
    })?;
    if backend == Backend::Smoltcp {
        return Ok(Box::new(b));
    }
    let at = |m: String| {
        let location = settings.get("backend").and_then(|s| s.location.clone());
        ConfigError::new(location, format!("setting `backend` of a {kind} module: {m}"))
    };
    let hook = KERNEL
        .get()
        .ok_or_else(|| at("the kernel back-end is built by the daemon (flexstack-faces), not available here".into()))?;
    let req = KernelRequest {
        side,
        cfg: b.cfg.clone(),
        matcher: b.matcher.clone(),
        netns,
        host_dev,
        interface: b.interface(),
        decl,
        smoltcp: Box::new(move |ports| Box::new(EndpointBuilder { ports, ..b })),
    };
    hook(req).map_err(at)
}

#[cfg(test)]
mod tests {
    use flexstack_core::StackSpec;

    fn configure(kind: &str, backend: &str) -> String {
        configure_with(kind, backend, "")
    }

    fn configure_with(kind: &str, backend: &str, more: &str) -> String {
        let text = format!("[modules.e]\nkind = \"{kind}\"\nbackend = \"{backend}\"\n{more}");
        let spec = StackSpec::parse("s.toml", &text).unwrap();
        match crate::catalog().configure(kind, &spec.modules[0].settings, None) {
            Ok(_) => "ok".into(),
            Err(e) => e.to_string(),
        }
    }

    /// Without the daemon's hook (this crate alone), `kernel` is refused where it is written, saying why.
    #[test]
    fn the_kernel_back_end_needs_the_daemon_and_other_names_are_refused() {
        for kind in ["terminate", "originate"] {
            assert_eq!(configure(kind, "smoltcp"), "ok");
            let e = configure(kind, "kernel");
            assert!(
                e.starts_with(&format!("s.toml:3:11: setting `backend` of a {kind} module: the kernel back-end")),
                "{e}"
            );
            let e = configure(kind, "dpdk");
            assert!(e.ends_with("expected \"smoltcp\" or \"kernel\", got \"dpdk\""), "{e}");
        }
    }

    /// The server role's rules, TCP and UDP (or `*`), go on to either back-end of originate (the kernel one takes
    /// the network's datagrams by TPROXY: flexstack_faces::stream).
    #[test]
    fn the_server_role_goes_to_either_back_end() {
        let rules = "match = [\"pass udp dport 22 role server\", \"* dport 8080 role server\"]\n";
        assert_eq!(configure_with("originate", "smoltcp", rules), "ok");
        let e = configure_with("originate", "kernel", rules);
        assert!(e.contains("the kernel back-end is built by the daemon"), "{e}");
    }
}
