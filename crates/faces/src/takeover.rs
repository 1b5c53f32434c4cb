//! Taking over an interface for a link face (`packet` with `take_over = true`), and giving it back.
//!
//! Taking over removes the kernel's addresses from the interface, disables kernel IPv6 on it and sets it up, so that
//! only flexstack answers ARP and neighbour discovery there. It also turns the kernel's IPv4 forwarding off for
//! frames arriving on the interface (`net.ipv4.conf.<if>.forwarding`): the frames flexstack's link face reads still
//! reach the kernel's IP layer too, and on a host that forwards (`net.ipv4.ip_forward = 1`) the kernel would route
//! each one addressed to flexstack's own address out of its default route (copies of flexstack's traffic leaking to
//! another network, at a system call's and a device's cost each; a TCP stream's every ACK through a link face was
//! one). Before it changes anything it saves what it will change (the addresses, IPv4 and IPv6,
//! `net.ipv6.conf.<if>.disable_ipv6` and `net.ipv4.conf.<if>.forwarding`) in a record,
//! `/run/flexstack/links/<netns inode>-<interface>`, which the daemon keeps open and locked (flock) for as long as
//! it holds the interface. Giving back (when the last face on the interface goes: unloaded, replaced by a face
//! that does not take it over, or the daemon ends normally) writes the sysctl back, adds the addresses again and
//! removes the record. A daemon killed with SIGKILL gives nothing back, but its lock goes with it: the next daemon
//! in the same network namespace gives back every interface whose record nobody holds when it starts
//! ([`restore_stale`]), and a face that takes such an interface over again keeps the record's addresses as the
//! ones to give back. An interface made anew since (another index) is not touched; its record is removed.
//!
//! An interface that carries a default route of the daemon's network namespace is refused unless `force` is set:
//! taking it over would cut the host (or the namespace) off its network.
//!
//! All of it through netlink ([`crate::netconf`]) and /proc/sys: no `ip` processes.

use crate::netconf::{Address, Rtnl};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

/// Where the records of taken-over interfaces are.
pub const RECORDS: &str = "/run/flexstack/links";

/// The first line of a record.
const MAGIC: &str = "flexstack link take-over";

/// What taking over changed on an interface, to be given back.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Saved {
    interface: String,
    ifindex: u32,
    /// The value of `disable_ipv6` before (`None`: the kernel has no IPv6).
    disable_ipv6: Option<String>,
    /// The value of the interface's IPv4 `forwarding` before (`None`: not known, e.g. a record of an older daemon).
    forwarding: Option<String>,
    addresses: Vec<Address>,
}

impl Saved {
    fn to_text(&self) -> String {
        let mut t = format!("{MAGIC}\ninterface {}\nifindex {}\n", self.interface, self.ifindex);
        if let Some(v) = &self.disable_ipv6 {
            t.push_str(&format!("disable_ipv6 {v}\n"));
        }
        if let Some(v) = &self.forwarding {
            t.push_str(&format!("forwarding {v}\n"));
        }
        for a in &self.addresses {
            t.push_str(&format!("address {}/{}", a.address, a.prefix));
            if let Some(b) = a.broadcast {
                t.push_str(&format!(" brd {b}"));
            }
            t.push('\n');
        }
        t
    }

    fn parse(text: &str) -> Result<Saved, String> {
        let mut lines = text.lines();
        if lines.next() != Some(MAGIC) {
            return Err("does not start with the record's first line".into());
        }
        let mut saved =
            Saved { interface: String::new(), ifindex: 0, disable_ipv6: None, forwarding: None, addresses: Vec::new() };
        for line in lines {
            let bad = || format!("bad line {line:?}");
            let (key, value) = line.split_once(' ').ok_or_else(bad)?;
            match key {
                "interface" => saved.interface = value.to_string(),
                "ifindex" => saved.ifindex = value.parse().map_err(|_| bad())?,
                "disable_ipv6" => saved.disable_ipv6 = Some(value.to_string()),
                "forwarding" => saved.forwarding = Some(value.to_string()),
                "address" => {
                    let mut words = value.split(' ');
                    let (address, prefix) = words.next().and_then(|a| a.split_once('/')).ok_or_else(bad)?;
                    let broadcast = match (words.next(), words.next()) {
                        (Some("brd"), Some(b)) => Some(b.parse().map_err(|_| bad())?),
                        (None, None) => None,
                        _ => return Err(bad()),
                    };
                    saved.addresses.push(Address {
                        address: address.parse().map_err(|_| bad())?,
                        prefix: prefix.parse().map_err(|_| bad())?,
                        broadcast,
                    });
                }
                _ => return Err(bad()),
            }
        }
        if saved.interface.is_empty() || saved.ifindex == 0 {
            return Err("no interface in it".into());
        }
        Ok(saved)
    }
}

/// An interface this daemon has taken over: given back when the last holder drops it.
#[derive(Debug)]
pub struct TakenOver {
    saved: Saved,
    record: PathBuf,
    /// The record, open and locked while the interface is held.
    _file: File,
}

/// The interfaces this process holds, so that a face replacing another on the same interface shares its hold
/// instead of saving the flushed state as the one to give back.
static HELD: Mutex<BTreeMap<String, Weak<TakenOver>>> = Mutex::new(BTreeMap::new());

/// The inode of this thread's network namespace: records are per namespace (interface names are).
fn netns_inode() -> String {
    let ns = std::fs::read_link("/proc/thread-self/ns/net").map(|p| p.display().to_string()).unwrap_or_default();
    ns.chars().filter(char::is_ascii_digit).collect()
}

fn record_path(interface: &str) -> PathBuf {
    Path::new(RECORDS).join(format!("{}-{interface}", netns_inode()))
}

fn disable_ipv6_path(interface: &str) -> PathBuf {
    Path::new("/proc/sys/net/ipv6/conf").join(interface).join("disable_ipv6")
}

fn forwarding_path(interface: &str) -> PathBuf {
    Path::new("/proc/sys/net/ipv4/conf").join(interface).join("forwarding")
}

fn rtnl() -> Result<Rtnl, String> {
    Rtnl::open().map_err(|e| e.to_string())
}

/// Takes `interface` over (see the module's documentation), or shares this process's hold on it.
pub fn take_over(interface: &str, force: bool) -> Result<Arc<TakenOver>, String> {
    let mut held = HELD.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(t) = held.get(interface).and_then(Weak::upgrade) {
        return Ok(t);
    }
    let mut nl = rtnl()?;
    let ifindex = nl.index_of(interface).map_err(|e| e.to_string())?;
    if !force {
        let routes = nl.default_routes_via(ifindex).map_err(|e| e.to_string())?;
        if !routes.is_empty() {
            return Err(format!(
                "{interface} carries the default route of this network namespace ({}): taking it over would remove \
                 its addresses and cut this host off its network; choose another interface, or set force = true to \
                 take it over anyway",
                routes.join(", ")
            ));
        }
    }
    let record = record_path(interface);
    std::fs::create_dir_all(RECORDS).map_err(|e| format!("{RECORDS}: cannot create: {e}"))?;
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&record)
        .map_err(|e| format!("{}: {e}", record.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            return Err(format!(
                "{interface} is held by another flexstack daemon (or is being given back): {} is locked",
                record.display()
            ))
        }
        Err(TryLockError::Error(e)) => return Err(format!("{}: cannot lock: {e}", record.display())),
    }
    let mut text = String::new();
    let _ = file.read_to_string(&mut text);
    // A record nobody holds: a daemon died holding the interface. Its addresses are the ones to give back.
    let left = match Saved::parse(&text) {
        Ok(s) if s.ifindex == ifindex && s.interface == interface => {
            tracing::warn!(interface, "taking over again an interface a daemon that is gone held: its addresses from before are kept to be given back");
            Some(s)
        }
        _ => None,
    };
    let saved = match left {
        Some(s) => s,
        None => {
            let mut save = |f: &mut File| -> Result<Saved, String> {
                let disable_ipv6 = std::fs::read_to_string(disable_ipv6_path(interface)).ok().map(|v| v.trim().into());
                let forwarding = std::fs::read_to_string(forwarding_path(interface)).ok().map(|v| v.trim().into());
                let addresses = nl.addresses(ifindex).map_err(|e| e.to_string())?;
                let s = Saved { interface: interface.to_string(), ifindex, disable_ipv6, forwarding, addresses };
                let write = |f: &mut File| -> std::io::Result<()> {
                    f.set_len(0)?;
                    f.seek(SeekFrom::Start(0))?;
                    f.write_all(s.to_text().as_bytes())?;
                    f.sync_data()
                };
                write(f).map_err(|e| format!("{}: cannot save the interface's state: {e}", record.display()))?;
                Ok(s)
            };
            match save(&mut file) {
                Ok(s) => s,
                Err(e) => {
                    // Nothing was changed: no record to leave behind.
                    let _ = std::fs::remove_file(&record);
                    return Err(e);
                }
            }
        }
    };
    // From here on, a failure gives back what was changed (the drop of `taken`).
    let taken = TakenOver { saved, record, _file: file };
    if taken.saved.disable_ipv6.is_some() {
        std::fs::write(disable_ipv6_path(interface), "1")
            .map_err(|e| format!("cannot disable kernel IPv6 on {interface}: {e}"))?;
    }
    if taken.saved.forwarding.is_some() {
        std::fs::write(forwarding_path(interface), "0")
            .map_err(|e| format!("cannot turn kernel IPv4 forwarding off on {interface}: {e}"))?;
    }
    // Disabling IPv6 removed its addresses; the others go now.
    for a in nl.addresses(ifindex).map_err(|e| e.to_string())? {
        nl.del_address(ifindex, a.address, a.prefix);
    }
    nl.set_up(ifindex, true);
    nl.commit().map_err(|e| format!("cannot take {interface} over: {e}"))?;
    let taken = Arc::new(taken);
    held.insert(interface.to_string(), Arc::downgrade(&taken));
    Ok(taken)
}

/// Turns the kernel's IPv4 forwarding off again on every interface this process holds. A change of
/// `net.ipv4.ip_forward` (or `net.ipv4.conf.all.forwarding`) from 0 to 1 sets every interface's `forwarding` to 1,
/// a taken-over one's too: whoever makes it (the daemon's sandboxes, for the host face) calls this after.
pub fn reassert_forwarding_off() {
    let held = HELD.lock().unwrap_or_else(|p| p.into_inner());
    for (interface, taken) in held.iter() {
        let Some(taken) = taken.upgrade() else { continue };
        if taken.saved.forwarding.is_none() {
            continue;
        }
        if let Err(e) = std::fs::write(forwarding_path(interface), "0") {
            tracing::warn!(interface, error = %e, "cannot turn kernel IPv4 forwarding off again on a taken-over interface");
        }
    }
}

/// Gives back what `saved` says: the IPv6 and IPv4 forwarding sysctls, then the addresses.
fn give_back(saved: &Saved) -> Result<(), String> {
    let interface = &saved.interface;
    let mut nl = rtnl()?;
    match nl.index_of(interface) {
        Ok(i) if i == saved.ifindex => {}
        _ => return Err(format!("{interface} (index {}) is gone: nothing to give back", saved.ifindex)),
    }
    if let Some(v) = &saved.disable_ipv6 {
        std::fs::write(disable_ipv6_path(interface), v)
            .map_err(|e| format!("cannot set disable_ipv6 of {interface} back to {v}: {e}"))?;
    }
    if let Some(v) = &saved.forwarding {
        std::fs::write(forwarding_path(interface), v)
            .map_err(|e| format!("cannot set IPv4 forwarding of {interface} back to {v}: {e}"))?;
    }
    for a in &saved.addresses {
        nl.restore_address(saved.ifindex, a);
    }
    nl.commit().map(|_| ()).map_err(|e| format!("cannot give {interface} its addresses back: {e}"))
}

impl Drop for TakenOver {
    fn drop(&mut self) {
        let interface = &self.saved.interface;
        match give_back(&self.saved) {
            Ok(()) => tracing::info!(interface, "gave the interface back its addresses, IPv6 and IPv4 forwarding"),
            Err(e) => tracing::warn!(interface, error = %e, "cannot give the interface back"),
        }
        // Removed while still locked: no other daemon takes the interface over from a record given back.
        let _ = std::fs::remove_file(&self.record);
    }
}

/// Gives back the interfaces of this network namespace that daemons now gone had taken over (their records are
/// not locked), and removes their records. Called when a daemon starts, before it loads its stack.
pub fn restore_stale() {
    let prefix = format!("{}-", netns_inode());
    let Ok(entries) = std::fs::read_dir(RECORDS) else { return };
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(&prefix) {
            continue;
        }
        let path = entry.path();
        let Ok(mut file) = OpenOptions::new().read(true).write(true).open(&path) else { continue };
        if file.try_lock().is_err() {
            // Held: a live daemon's interface.
            continue;
        }
        let mut text = String::new();
        let _ = file.read_to_string(&mut text);
        match Saved::parse(&text) {
            Ok(saved) => match give_back(&saved) {
                Ok(()) => tracing::warn!(
                    interface = %saved.interface,
                    "gave back an interface that a daemon now gone had taken over: its addresses, IPv6 and IPv4 forwarding"
                ),
                Err(e) => tracing::warn!(record = %path.display(), error = %e, "cannot give an interface back"),
            },
            Err(e) => tracing::warn!(record = %path.display(), error = %e, "removing a damaged take-over record"),
        }
        let _ = std::fs::remove_file(&path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_read_back_what_they_saved() {
        let saved = Saved {
            interface: "fs-eth1".into(),
            ifindex: 12,
            disable_ipv6: Some("0".into()),
            forwarding: Some("1".into()),
            addresses: vec![
                Address {
                    address: "10.1.2.3".parse().unwrap(),
                    prefix: 24,
                    broadcast: Some("10.1.2.255".parse().unwrap()),
                },
                Address { address: "fd00::3".parse().unwrap(), prefix: 64, broadcast: None },
            ],
        };
        let text = saved.to_text();
        assert_eq!(
            text,
            "flexstack link take-over\ninterface fs-eth1\nifindex 12\ndisable_ipv6 0\nforwarding 1\n\
             address 10.1.2.3/24 brd 10.1.2.255\naddress fd00::3/64\n"
        );
        assert_eq!(Saved::parse(&text), Ok(saved));
        assert!(Saved::parse("").is_err());
        assert!(Saved::parse("flexstack link take-over\ninterface x\n").unwrap_err().contains("no interface"));
        assert!(Saved::parse(&text.replace("/24", "/x")).unwrap_err().contains("bad line"));
    }
}
