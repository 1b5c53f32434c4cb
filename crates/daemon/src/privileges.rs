//! The daemon's privileges: it keeps only the capabilities it needs once it runs ([`KEPT`], each with its reason)
//! and drops every other one from its effective, permitted, inheritable, ambient and bounding sets, so that
//! neither the daemon nor a program it starts (`ip`, `nft`) can regain them; it also sets no-new-privileges, so that
//! no program it starts gains privileges by exec (setuid, file capabilities).
//!
//! How it is called: [`crate::server::run_daemon`] calls [`drop_unneeded`] once, after the state directory is set
//! up and before the daemon starts its first thread. Capabilities belong to each thread, and a new thread starts
//! with its creator's: dropped before any thread exists, they are gone from every thread of the daemon (the
//! data plane, rules, signal and client threads). The control socket, the pid file and the stack loaded after
//! that need nothing that is dropped (TUN devices and packet sockets are opened with the kept capabilities).
//! `flexstack status` shows [`current`]. [`plan`] is the pure part: from the sets the process holds, what
//! it keeps and what it drops.
//!
//! A daemon that does not run as root holds no permitted capability and cannot shrink its bounding set (that
//! takes CAP_SETPCAP): then there is nothing to drop and [`drop_unneeded`] changes nothing, which it logs at
//! debug. The `caps` crate (thin, safe wrappers of capget/capset and the PR_CAPBSET/PR_CAP_AMBIENT prctls) is
//! used so that this module needs no unsafe code.

use caps::{CapSet, Capability, CapsHashSet};
use flexstack_api::ops::Capabilities;

/// The capabilities the daemon keeps, each with what needs it (checked by running `ip`, `nft` and the daemon's
/// own system calls without it: see docs/architecture.md, "Privileges").
pub const KEPT: &[(Capability, &str)] = &[
    (
        Capability::CAP_NET_ADMIN,
        "TUN devices (TUNSETIFF) of faces; `ip link/addr/route` of sandboxes and link faces; the nftables table \
         (`nft`) and the flush of apps' conntrack entries (`conntrack -D`); the forwarding and disable_ipv6 sysctls",
    ),
    (Capability::CAP_NET_RAW, "AF_PACKET sockets of link faces (`packet` module)"),
    (
        Capability::CAP_NET_BIND_SERVICE,
        "the kernel `originate`'s UDP sockets of the server role, bound to the app's address and port (DNS: 53) to \
         answer the network's clients from it",
    ),
    (
        Capability::CAP_SYS_ADMIN,
        "`ip netns add/del` (unshare, bind mounts under /run/netns) and `ip -n` (setns, its sysfs mount) for \
         sandboxes",
    ),
    (
        Capability::CAP_DAC_OVERRIDE,
        "files in folders of other users: taps written where the user asks (a lab's results folder, a home \
         folder), the sockets and pid file removed from a state directory a user created",
    ),
];

/// What to keep and what to drop, as computed by [`plan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The permitted (and at most the effective and inheritable) set after the drop.
    pub keep: Vec<Capability>,
    /// Capabilities held in the permitted set that are dropped.
    pub drop: Vec<Capability>,
    /// Capabilities dropped from the bounding set (CAP_SETPCAP last, as the one that allows the others).
    pub drop_bounding: Vec<Capability>,
}

/// True if `cap` is one the daemon keeps.
pub fn is_kept(cap: Capability) -> bool {
    KEPT.iter().any(|(k, _)| *k == cap)
}

/// Sorts capabilities by their number, CAP_SETPCAP last.
fn ordered(set: impl IntoIterator<Item = Capability>) -> Vec<Capability> {
    let mut v: Vec<Capability> = set.into_iter().collect();
    v.sort_by_key(|c| (*c == Capability::CAP_SETPCAP, c.index()));
    v
}

/// From the permitted and bounding sets the process holds: the kept set (what it holds of [`KEPT`]; nothing is
/// added), the permitted capabilities to drop, and the bounding-set capabilities to drop.
pub fn plan(permitted: &CapsHashSet, bounding: &CapsHashSet) -> Plan {
    Plan {
        keep: ordered(permitted.iter().copied().filter(|c| is_kept(*c))),
        drop: ordered(permitted.iter().copied().filter(|c| !is_kept(*c))),
        drop_bounding: ordered(bounding.iter().copied().filter(|c| !is_kept(*c))),
    }
}

/// What [`drop_unneeded`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dropped {
    /// The permitted set now.
    pub kept: Vec<Capability>,
    /// Dropped from the permitted (and effective, inheritable) set.
    pub dropped: Vec<Capability>,
    /// Dropped from the bounding set.
    pub dropped_bounding: Vec<Capability>,
    /// Bounding-set capabilities that could not be dropped, lacking CAP_SETPCAP (a daemon not run as root).
    pub bounding_left: Vec<Capability>,
}

fn err(what: &str, e: caps::errors::CapsError) -> String {
    format!("cannot drop privileges: {what}: {e}")
}

/// Drops from the calling thread every capability not in [`KEPT`]: first from the bounding set (while
/// CAP_SETPCAP is still effective), then from the ambient set, then from the effective, inheritable and
/// permitted sets. Threads and programs started afterwards inherit the result. Dropping what the process does
/// not hold is a no-op; an error means a set could not be changed, and the daemon does not start.
pub fn drop_unneeded() -> Result<Dropped, String> {
    let permitted = caps::read(None, CapSet::Permitted).map_err(|e| err("reading the permitted set", e))?;
    let effective = caps::read(None, CapSet::Effective).map_err(|e| err("reading the effective set", e))?;
    let inheritable = caps::read(None, CapSet::Inheritable).map_err(|e| err("reading the inheritable set", e))?;
    let bounding = caps::read(None, CapSet::Bounding).map_err(|e| err("reading the bounding set", e))?;
    let plan = plan(&permitted, &bounding);
    let mut done = Dropped { kept: plan.keep.clone(), dropped: plan.drop.clone(), ..Dropped::default() };

    if effective.contains(&Capability::CAP_SETPCAP) {
        for cap in &plan.drop_bounding {
            caps::drop(None, CapSet::Bounding, *cap).map_err(|e| err(&format!("bounding set, {cap}"), e))?;
        }
        done.dropped_bounding = plan.drop_bounding;
    } else {
        done.bounding_left = plan.drop_bounding;
    }
    // Ambient capabilities are those a program keeps across exec without being root; the daemon needs none.
    if caps::runtime::ambient_set_supported().is_ok() {
        caps::clear(None, CapSet::Ambient).map_err(|e| err("ambient set", e))?;
    }
    let keep: CapsHashSet = plan.keep.iter().copied().collect();
    // Effective first: it must stay within the permitted set at every step.
    let limit = |set: &CapsHashSet| -> CapsHashSet { set.intersection(&keep).copied().collect() };
    caps::set(None, CapSet::Effective, &limit(&effective)).map_err(|e| err("effective set", e))?;
    caps::set(None, CapSet::Inheritable, &limit(&inheritable)).map_err(|e| err("inheritable set", e))?;
    caps::set(None, CapSet::Permitted, &keep).map_err(|e| err("permitted set", e))?;
    // No program the daemon starts (`ip`, `nft`, `conntrack`) gains privileges by exec: setuid bits and file
    // capabilities are ignored from here on, in every thread and child (the flag is inherited and never cleared).
    nix::sys::prctl::set_no_new_privs().map_err(|e| format!("cannot set no-new-privileges: {e}"))?;

    let names = |v: &[Capability]| names(v).join(",");
    tracing::debug!(
        kept = %names(&done.kept),
        dropped = %names(&done.dropped),
        dropped_bounding = %names(&done.dropped_bounding),
        "dropped the capabilities the daemon does not need"
    );
    if !done.bounding_left.is_empty() {
        tracing::debug!(
            left = %names(&done.bounding_left),
            "the bounding set stays as it is: shrinking it needs CAP_SETPCAP, which this process lacks"
        );
    }
    Ok(done)
}

/// Capability names as the kernel spells them (`CAP_NET_ADMIN`), in number order, CAP_SETPCAP last.
pub fn names(caps: &[Capability]) -> Vec<String> {
    caps.iter().map(|c| c.to_string()).collect()
}

/// The calling thread's capability sets, for `flexstack status`.
pub fn current() -> Result<Capabilities, String> {
    let read = |set: CapSet| -> Result<Vec<String>, String> {
        let held = caps::read(None, set).map_err(|e| format!("cannot read the capability sets: {e}"))?;
        let mut v: Vec<Capability> = held.into_iter().collect();
        v.sort_by_key(|c| c.index());
        Ok(names(&v))
    };
    Ok(Capabilities {
        effective: read(CapSet::Effective)?,
        permitted: read(CapSet::Permitted)?,
        bounding: read(CapSet::Bounding)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use Capability::*;

    fn set(caps: &[Capability]) -> CapsHashSet {
        caps.iter().copied().collect()
    }

    #[test]
    fn root_keeps_only_the_listed_capabilities() {
        let all = caps::all();
        let p = plan(&all, &all);
        assert_eq!(p.keep, vec![CAP_DAC_OVERRIDE, CAP_NET_BIND_SERVICE, CAP_NET_ADMIN, CAP_NET_RAW, CAP_SYS_ADMIN]);
        for c in [CAP_SYS_MODULE, CAP_SYS_BOOT, CAP_SYS_TIME, CAP_SYS_RAWIO, CAP_MKNOD, CAP_BPF, CAP_SETUID] {
            assert!(p.drop.contains(&c) && p.drop_bounding.contains(&c), "{c} is dropped");
        }
        assert_eq!(p.keep.len() + p.drop.len(), all.len(), "every capability is either kept or dropped");
        assert!(p.drop.iter().all(|c| !p.keep.contains(c)));
    }

    #[test]
    fn setpcap_is_dropped_last() {
        let all = caps::all();
        let p = plan(&all, &all);
        assert_eq!(p.drop.last(), Some(&CAP_SETPCAP));
        assert_eq!(p.drop_bounding.last(), Some(&CAP_SETPCAP));
        let numbers: Vec<u8> = p.drop[..p.drop.len() - 1].iter().map(|c| c.index()).collect();
        assert!(numbers.windows(2).all(|w| w[0] < w[1]), "the others in order: {numbers:?}");
    }

    #[test]
    fn nothing_is_added_that_was_not_held() {
        // A process with file capabilities: only NET_ADMIN and SYS_TIME permitted, a bounding set without NET_RAW.
        let p = plan(&set(&[CAP_NET_ADMIN, CAP_SYS_TIME]), &set(&[CAP_NET_ADMIN, CAP_SYS_TIME, CAP_CHOWN]));
        assert_eq!(p.keep, vec![CAP_NET_ADMIN]);
        assert_eq!(p.drop, vec![CAP_SYS_TIME]);
        assert_eq!(p.drop_bounding, vec![CAP_CHOWN, CAP_SYS_TIME]);
    }

    #[test]
    fn an_ordinary_user_has_nothing_to_drop_from_permitted() {
        let p = plan(&CapsHashSet::new(), &caps::all());
        assert!(p.keep.is_empty() && p.drop.is_empty());
        assert_eq!(p.drop_bounding.len(), caps::all().len() - KEPT.len());
    }

    #[test]
    fn every_kept_capability_has_a_reason() {
        for (cap, why) in KEPT {
            assert!(why.len() > 20, "{cap}: {why}");
        }
        let distinct: CapsHashSet = KEPT.iter().map(|(c, _)| *c).collect();
        assert_eq!(distinct.len(), KEPT.len());
    }

    #[test]
    fn current_sets_can_be_read() {
        let now = current().unwrap();
        assert!(now.effective.iter().all(|c| now.permitted.contains(c)), "effective within permitted: {now:?}");
        assert!(now.bounding.iter().all(|c| c.starts_with("CAP_")));
    }
}
