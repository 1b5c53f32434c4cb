//! The match table of `terminate` and `originate`: which flows they terminate. The first rule that matches decides;
//! a flow no rule matches is not terminated (its packets leave on `pass`, unchanged). `terminate` asks about the
//! flows the app opens (role client: its SYNs and first datagrams), `originate` about those the network opens
//! towards the app (role server), so both can be given the same table.
//!
//! A rule is `[pass] PROTOCOL [CONDITION ...]`, or `PROTOCOL *` / `*` for "any":
//!
//! - `PROTOCOL`: `tcp`, `udp` or `*` (both);
//! - `dport PORTS`, `sport PORTS`: the destination / source port, as the app sent it; `PORTS` is a comma-separated
//!   list of ports and ranges (`80,443,8000-8099`);
//! - `to PREFIX`: the original destination address (`192.0.2.0/24`, `2001:db8::1`);
//! - `role client|server`: the app opened the flow (client) or accepts it (server: a connection or a first datagram
//!   from the network); a rule without `role` is about the client role only, so that a broad rule (`tcp *`) never
//!   takes over the connections the network opens towards the app: those need a `role server` rule;
//! - `app NAME`: the app's name (the module's `app` setting), or `*`;
//! - a leading `pass` makes a matching flow *not* terminated (an exception before a broader rule).
//!
//! Examples: `tcp dport 80,443`, `udp dport 53`, `pass tcp dport 22`, `tcp *`, `* to 10.0.0.0/8 role client`.

use flexstack_core::stream::{Protocol, Role};
use flexstack_wire::cidr::{PortRange, Prefix, Words};
use std::fmt;
use std::net::SocketAddr;

/// Most rules of one table.
pub const MAX_RULES: usize = 256;

/// One rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatchRule {
    /// A matching flow is not terminated.
    pub pass: bool,
    /// The protocol (`None`: both).
    pub protocol: Option<Protocol>,
    /// Destination ports (`None`: any).
    pub dport: Option<Vec<PortRange>>,
    /// Source ports (`None`: any).
    pub sport: Option<Vec<PortRange>>,
    /// The original destination's prefix (`None`: any).
    pub to: Option<Prefix>,
    /// The app's role (`None`: client).
    pub role: Option<Role>,
    /// The app's name (`None`: any).
    pub app: Option<String>,
}

/// What a rule is asked about: one new flow. Its source and destination are the opening side's: for the server role
/// the network's client is the source and the app's address and port the destination.
#[derive(Clone, Copy, Debug)]
pub struct Candidate<'a> {
    /// Its protocol.
    pub protocol: Protocol,
    /// Source as the opening side sent it (the app's for the client role).
    pub src: SocketAddr,
    /// Original destination (the app's address for the server role).
    pub dst: SocketAddr,
    /// The app's role.
    pub role: Role,
    /// The app's name.
    pub app: &'a str,
}

fn ports(w: &mut Words<'_>) -> Result<Vec<PortRange>, String> {
    let text = w.next("ports (80, 8000-8099, or a list: 80,443)")?;
    text.split(',').map(|p| PortRange::parse(p).map_err(|e| w.error_last(&e))).collect()
}

impl MatchRule {
    /// Parses one rule; the error names the word at fault and what was expected there.
    pub fn parse(text: &str) -> Result<MatchRule, String> {
        let mut w = Words::new(text);
        let mut rule =
            MatchRule { pass: false, protocol: None, dport: None, sport: None, to: None, role: None, app: None };
        rule.pass = w.eat("pass");
        rule.protocol = match w.next("a protocol: tcp, udp or *")? {
            "tcp" => Some(Protocol::Tcp),
            "udp" => Some(Protocol::Udp),
            "*" => None,
            _ => return Err(w.error_last("expected a protocol: tcp, udp or *")),
        };
        if w.eat("*") {
            w.end("the end of the rule after `*`")?;
            return Ok(rule);
        }
        let expected = "dport, sport, to, role, app or the end of the rule";
        while let Some(word) = w.peek() {
            w.next(expected)?;
            let repeated = || format!("`{word}` given twice");
            match word {
                "dport" if rule.dport.is_none() => rule.dport = Some(ports(&mut w)?),
                "sport" if rule.sport.is_none() => rule.sport = Some(ports(&mut w)?),
                "to" if rule.to.is_none() => {
                    let t = w.next("an address or prefix (192.0.2.0/24, 2001:db8::1)")?;
                    rule.to = Some(Prefix::parse(t).map_err(|e| w.error_last(&e))?);
                }
                "role" if rule.role.is_none() => {
                    rule.role = Some(match w.next("client or server")? {
                        "client" => Role::Client,
                        "server" => Role::Server,
                        _ => return Err(w.error_last("expected client or server")),
                    })
                }
                "app" if rule.app.is_none() => {
                    let name = w.next("an app name or *")?;
                    rule.app = (name != "*").then(|| name.to_string());
                }
                "dport" | "sport" | "to" | "role" | "app" => return Err(w.error_last(&repeated())),
                _ => return Err(w.error_last(&format!("expected {expected}"))),
            }
        }
        Ok(rule)
    }

    /// True if the rule matches the flow.
    pub fn matches(&self, c: &Candidate<'_>) -> bool {
        let in_list =
            |list: &Option<Vec<PortRange>>, port: u16| list.as_ref().is_none_or(|l| l.iter().any(|r| r.contains(port)));
        self.protocol.is_none_or(|p| p == c.protocol)
            && in_list(&self.dport, c.dst.port())
            && in_list(&self.sport, c.src.port())
            && self.to.is_none_or(|p| p.contains(c.dst.ip()))
            && self.role.unwrap_or(Role::Client) == c.role
            && self.app.as_ref().is_none_or(|a| a == c.app)
    }
}

impl fmt::Display for MatchRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.pass {
            f.write_str("pass ")?;
        }
        f.write_str(self.protocol.map_or("*", Protocol::name))?;
        let list = |l: &[PortRange]| l.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(",");
        let mut any = true;
        if let Some(l) = &self.dport {
            write!(f, " dport {}", list(l))?;
            any = false;
        }
        if let Some(l) = &self.sport {
            write!(f, " sport {}", list(l))?;
            any = false;
        }
        if let Some(p) = &self.to {
            write!(f, " to {p}")?;
            any = false;
        }
        if let Some(r) = self.role {
            f.write_str(if r == Role::Client { " role client" } else { " role server" })?;
            any = false;
        }
        if let Some(a) = &self.app {
            write!(f, " app {a}")?;
            any = false;
        }
        if any {
            f.write_str(" *")?;
        }
        Ok(())
    }
}

/// A parsed match table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MatchTable {
    /// The rules, in order.
    pub rules: Vec<MatchRule>,
}

impl MatchTable {
    /// Parses the rules; the error says which rule (1-based), its text and what is wrong.
    pub fn parse(rules: &[String]) -> Result<MatchTable, String> {
        if rules.len() > MAX_RULES {
            return Err(format!("{} rules: at most {MAX_RULES} are allowed", rules.len()));
        }
        let rules = rules
            .iter()
            .enumerate()
            .map(|(i, text)| MatchRule::parse(text).map_err(|e| format!("rule {} {text:?}: {e}", i + 1)))
            .collect::<Result<_, _>>()?;
        Ok(MatchTable { rules })
    }

    /// The rule that decides for this flow (its index), and whether the flow is terminated; `None`: no rule matched
    /// (not terminated).
    pub fn decide(&self, c: &Candidate<'_>) -> Option<(usize, bool)> {
        self.rules.iter().position(|r| r.matches(c)).map(|i| (i, !self.rules[i].pass))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(rules: &[&str]) -> MatchTable {
        MatchTable::parse(&rules.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    fn flow(protocol: Protocol, dst: &str) -> Candidate<'static> {
        Candidate {
            protocol,
            src: "10.0.0.2:40000".parse().unwrap(),
            dst: dst.parse().unwrap(),
            role: Role::Client,
            app: "curl",
        }
    }

    #[test]
    fn first_match_wins() {
        let t = table(&["pass tcp dport 22", "tcp dport 80,443,8000-8099", "udp dport 53", "tcp *"]);
        let tcp = Protocol::Tcp;
        assert_eq!(t.decide(&flow(tcp, "192.0.2.1:22")), Some((0, false)));
        assert_eq!(t.decide(&flow(tcp, "192.0.2.1:443")), Some((1, true)));
        assert_eq!(t.decide(&flow(tcp, "192.0.2.1:8050")), Some((1, true)));
        assert_eq!(t.decide(&flow(tcp, "192.0.2.1:25")), Some((3, true)));
        assert_eq!(t.decide(&flow(Protocol::Udp, "[2001:db8::53]:53")), Some((2, true)));
        assert_eq!(t.decide(&flow(Protocol::Udp, "192.0.2.1:123")), None);
        assert_eq!(MatchTable::default().decide(&flow(tcp, "192.0.2.1:80")), None);
    }

    #[test]
    fn conditions_on_source_destination_role_and_app() {
        let t = table(&["* sport 40000-40010 to 192.0.2.0/24 role client app curl"]);
        assert!(t.decide(&flow(Protocol::Tcp, "192.0.2.9:1")).is_some());
        assert!(t.decide(&flow(Protocol::Udp, "192.0.2.9:1")).is_some());
        assert!(t.decide(&flow(Protocol::Tcp, "198.51.100.1:1")).is_none());
        let mut c = flow(Protocol::Tcp, "192.0.2.9:1");
        c.role = Role::Server;
        assert!(t.decide(&c).is_none());
        c.role = Role::Client;
        c.app = "wget";
        assert!(t.decide(&c).is_none());
        c.app = "curl";
        c.src = "10.0.0.2:50000".parse().unwrap();
        assert!(t.decide(&c).is_none());
        assert!(table(&["tcp app *"]).decide(&c).is_some());
    }

    /// A rule without `role` is about the client role: a flow the network opens needs a `role server` rule.
    #[test]
    fn the_server_role_needs_a_rule_of_its_own() {
        let t = table(&["pass tcp dport 22 role server", "tcp dport 22,8080 role server", "tcp *", "udp *"]);
        let mut c = flow(Protocol::Tcp, "10.0.0.2:8080");
        assert_eq!(t.decide(&c), Some((2, true)), "the client role: `tcp *`");
        c.role = Role::Server;
        assert_eq!(t.decide(&c), Some((1, true)));
        c.dst = "10.0.0.2:22".parse().unwrap();
        assert_eq!(t.decide(&c), Some((0, false)), "an exception first");
        c.dst = "10.0.0.2:9000".parse().unwrap();
        assert_eq!(t.decide(&c), None, "`tcp *` is not about the server role");
        c.protocol = Protocol::Udp;
        assert_eq!(t.decide(&c), None);
    }

    #[test]
    fn rules_print_back_to_what_parses_equal() {
        for text in ["pass tcp dport 22", "tcp dport 80,443", "udp *", "* *", "* to 10.0.0.0/8 role server app x"] {
            let r = MatchRule::parse(text).unwrap();
            assert_eq!(MatchRule::parse(&r.to_string()).unwrap(), r, "{text} -> {r}");
        }
        assert_eq!(MatchRule::parse("*").unwrap().to_string(), "* *");
    }

    #[test]
    fn errors_name_the_rule_and_the_word() {
        let e =
            |rules: &[&str]| MatchTable::parse(&rules.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap_err();
        assert_eq!(e(&["tcp *", "icmp"]), "rule 2 \"icmp\": word 1 `icmp`: expected a protocol: tcp, udp or *");
        assert!(e(&["tcp dport 70000"]).contains("word 3 `70000`"), "{}", e(&["tcp dport 70000"]));
        assert!(e(&["tcp dport"]).contains("expected ports"));
        assert!(e(&["tcp dport 1 dport 2"]).contains("`dport` given twice"));
        assert!(e(&["tcp role boss"]).contains("expected client or server"));
        assert!(e(&["tcp * dport 80"]).contains("the end of the rule"));
        assert!(e(&["tcp to 10.0.0.300"]).contains("word 3"));
        assert!(e(&["tcp flag syn"]).contains("expected dport, sport, to, role, app"));
        assert!(e(&[""]).contains("expected a protocol"));
        let many: Vec<&str> = vec!["tcp *"; MAX_RULES + 1];
        assert!(e(&many).contains("at most 256"));
    }
}
