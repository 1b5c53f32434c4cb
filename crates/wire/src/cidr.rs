//! Address prefixes, port ranges and endpoints as written in rules (`10.77.0.0/24`, `fd77::/64`, `1000-2000`,
//! `192.0.2.10:8080`, `[fd00::10]:80`), and the word reader the rule parsers share.
//!
//! Everything here parses without panicking on any input and reports what was expected.

use std::fmt;
use std::net::IpAddr;

/// An address prefix: the addresses whose first `len` bits equal those of `addr` (host bits are cleared).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Prefix {
    addr: IpAddr,
    len: u8,
}

impl Prefix {
    /// The prefix of `addr` with `len` bits (at most 32 for IPv4, 128 for IPv6); host bits are cleared.
    pub fn new(addr: IpAddr, len: u8) -> Result<Prefix, String> {
        let max = max_len(addr);
        if len > max {
            return Err(format!("prefix length {len} is longer than {max}"));
        }
        let addr = match addr {
            IpAddr::V4(a) => IpAddr::V4((u32::from(a) & mask32(len)).into()),
            IpAddr::V6(a) => IpAddr::V6((u128::from(a) & mask128(len)).into()),
        };
        Ok(Prefix { addr, len })
    }

    /// The prefix holding only `addr`.
    pub fn host(addr: IpAddr) -> Prefix {
        Prefix { addr, len: max_len(addr) }
    }

    /// Parses `10.0.0.0/8`, `fd00::/64` or a single address (`10.0.0.1`, `fd00::1`).
    pub fn parse(text: &str) -> Result<Prefix, String> {
        let (a, l) = match text.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (text, None),
        };
        let addr: IpAddr = a
            .parse()
            .map_err(|_| format!("expected an address or prefix like 10.0.0.0/24 or fd00::/64, got `{text}`"))?;
        match l {
            None => Ok(Prefix::host(addr)),
            Some(l) => {
                let len: u8 = l
                    .parse()
                    .ok()
                    .filter(|_| !l.starts_with('+'))
                    .ok_or_else(|| format!("expected a prefix length after `/` in `{text}`, got `{l}`"))?;
                Prefix::new(addr, len).map_err(|e| format!("{e} in `{text}`"))
            }
        }
    }

    /// The network address.
    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    /// The prefix length in bits.
    pub fn len(&self) -> u8 {
        self.len
    }

    /// True for a zero-length prefix (every address of its family).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True for an IPv4 prefix.
    pub fn is_ipv4(&self) -> bool {
        self.addr.is_ipv4()
    }

    /// True if `ip` (of the same family) lies in the prefix.
    #[inline]
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => u32::from(a) & mask32(self.len) == u32::from(n),
            (IpAddr::V6(n), IpAddr::V6(a)) => u128::from(a) & mask128(self.len) == u128::from(n),
            _ => false,
        }
    }
}

impl fmt::Display for Prefix {
    /// A host prefix is written as the bare address, so that it parses back equal.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.len == max_len(self.addr) {
            write!(f, "{}", self.addr)
        } else {
            write!(f, "{}/{}", self.addr, self.len)
        }
    }
}

fn max_len(addr: IpAddr) -> u8 {
    if addr.is_ipv4() {
        32
    } else {
        128
    }
}

fn mask32(len: u8) -> u32 {
    u32::MAX.checked_shl(32 - u32::from(len.min(32))).unwrap_or(0)
}

fn mask128(len: u8) -> u128 {
    u128::MAX.checked_shl(128 - u32::from(len.min(128))).unwrap_or(0)
}

/// An inclusive range of ports (`22`, `1000-2000`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PortRange {
    /// First port.
    pub first: u16,
    /// Last port (≥ first).
    pub last: u16,
}

impl PortRange {
    /// Parses `22` or `1000-2000`.
    pub fn parse(text: &str) -> Result<PortRange, String> {
        let (a, b) = text.split_once('-').unwrap_or((text, text));
        let first = parse_port(a).map_err(|e| format!("{e} in port range `{text}`"))?;
        let last = parse_port(b).map_err(|e| format!("{e} in port range `{text}`"))?;
        if first > last {
            return Err(format!("port range `{text}` ends before it starts"));
        }
        Ok(PortRange { first, last })
    }

    /// True if `port` lies in the range.
    #[inline]
    pub fn contains(&self, port: u16) -> bool {
        (self.first..=self.last).contains(&port)
    }

    /// Number of ports in the range.
    pub fn count(&self) -> u32 {
        u32::from(self.last) - u32::from(self.first) + 1
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.first == self.last {
            write!(f, "{}", self.first)
        } else {
            write!(f, "{}-{}", self.first, self.last)
        }
    }
}

/// Parses a port number 0..=65535 (decimal digits only).
pub fn parse_port(text: &str) -> Result<u16, String> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("expected a port number 0-65535, got `{text}`"));
    }
    text.parse().map_err(|_| format!("port `{text}` is larger than 65535"))
}

/// Parses an endpoint: `10.0.0.1`, `10.0.0.1:80`, `fd00::1` or `[fd00::1]:80`.
pub fn parse_endpoint(text: &str) -> Result<(IpAddr, Option<u16>), String> {
    let bad = || format!("expected an address with an optional port (10.0.0.1:80, [fd00::1]:80), got `{text}`");
    if let Some(rest) = text.strip_prefix('[') {
        let (a, tail) = rest.split_once(']').ok_or_else(bad)?;
        let addr: std::net::Ipv6Addr = a.parse().map_err(|_| bad())?;
        let port = match tail {
            "" => None,
            t => Some(parse_port(t.strip_prefix(':').ok_or_else(bad)?).map_err(|e| format!("{e} in `{text}`"))?),
        };
        return Ok((IpAddr::V6(addr), port));
    }
    if let Ok(addr) = text.parse::<IpAddr>() {
        return Ok((addr, None));
    }
    let (a, p) = text.rsplit_once(':').ok_or_else(bad)?;
    let addr: std::net::Ipv4Addr = a.parse().map_err(|_| bad())?;
    Ok((IpAddr::V4(addr), Some(parse_port(p).map_err(|e| format!("{e} in `{text}`"))?)))
}

/// An address with a port, written `10.0.0.1:80` or `[fd00::1]:80`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint(pub IpAddr, pub u16);

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            IpAddr::V4(a) => write!(f, "{a}:{}", self.1),
            IpAddr::V6(a) => write!(f, "[{a}]:{}", self.1),
        }
    }
}

/// Reads the whitespace-separated words of one rule, and words errors as "word N `w`: expected ...".
pub struct Words<'a> {
    words: Vec<&'a str>,
    pos: usize,
}

impl<'a> Words<'a> {
    /// The words of `text`.
    pub fn new(text: &'a str) -> Words<'a> {
        Words { words: text.split_whitespace().collect(), pos: 0 }
    }

    /// The next word, without taking it.
    pub fn peek(&self) -> Option<&'a str> {
        self.words.get(self.pos).copied()
    }

    /// Takes the next word if it is `word`.
    pub fn eat(&mut self, word: &str) -> bool {
        if self.peek() == Some(word) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Takes the next word; at the end of the rule, an error saying `expected` was.
    pub fn next(&mut self, expected: &str) -> Result<&'a str, String> {
        match self.peek() {
            Some(w) => {
                self.pos += 1;
                Ok(w)
            }
            None => Err(self.error(expected)),
        }
    }

    /// An error about the next word (or the end of the rule): `expected` was expected there.
    pub fn error(&self, expected: &str) -> String {
        match self.peek() {
            Some(w) => format!("word {} `{w}`: expected {expected}", self.pos + 1),
            None => format!("expected {expected} after word {} but the rule ends", self.pos),
        }
    }

    /// An error about the word just taken.
    pub fn error_last(&self, message: &str) -> String {
        let at = self.pos.saturating_sub(1);
        format!("word {} `{}`: {message}", at + 1, self.words.get(at).copied().unwrap_or_default())
    }

    /// Fails unless every word was read.
    pub fn end(&self, expected: &str) -> Result<(), String> {
        match self.peek() {
            None => Ok(()),
            Some(_) => Err(self.error(expected)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn prefixes_parse_mask_and_match() {
        let p = Prefix::parse("10.77.0.9/24").unwrap();
        assert_eq!(p.to_string(), "10.77.0.0/24");
        assert!(p.contains(ip("10.77.0.200")) && !p.contains(ip("10.77.1.1")) && !p.contains(ip("::1")));
        let h = Prefix::parse("10.77.0.2").unwrap();
        assert_eq!((h.len(), h.to_string().as_str()), (32, "10.77.0.2"));
        assert!(h.contains(ip("10.77.0.2")) && !h.contains(ip("10.77.0.3")));
        assert!(Prefix::parse("0.0.0.0/0").unwrap().contains(ip("1.2.3.4")));
        let v6 = Prefix::parse("fd77::/64").unwrap();
        assert!(v6.contains(ip("fd77::5")) && !v6.contains(ip("fd78::5")) && !v6.contains(ip("10.0.0.1")));
        assert!(Prefix::parse("::/0").unwrap().contains(ip("2001:db8::1")));
        assert_eq!(Prefix::parse("fd00::1/128").unwrap().to_string(), "fd00::1");
        for bad in ["", "/", "10.0.0.0/33", "fd00::/129", "10.0.0/8", "10.0.0.0/", "10.0.0.0/+8", "x/1", "1.2.3.4/8/8"]
        {
            assert!(Prefix::parse(bad).is_err(), "{bad}");
        }
        assert!(Prefix::parse("10.0.0.0/33").unwrap_err().contains("longer than 32"));
    }

    #[test]
    fn ports_and_endpoints() {
        assert_eq!(PortRange::parse("22").unwrap(), PortRange { first: 22, last: 22 });
        assert_eq!(PortRange::parse("1000-2000").unwrap().count(), 1001);
        assert_eq!(PortRange::parse("1000-2000").unwrap().to_string(), "1000-2000");
        for bad in ["", "-", "70000", "5-4", "+5", "1-2-3", "a"] {
            assert!(PortRange::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_endpoint("10.0.0.1:80").unwrap(), (ip("10.0.0.1"), Some(80)));
        assert_eq!(parse_endpoint("10.0.0.1").unwrap(), (ip("10.0.0.1"), None));
        assert_eq!(parse_endpoint("fd00::1").unwrap(), (ip("fd00::1"), None));
        assert_eq!(parse_endpoint("[fd00::1]:443").unwrap(), (ip("fd00::1"), Some(443)));
        assert_eq!(parse_endpoint("[fd00::1]").unwrap(), (ip("fd00::1"), None));
        for bad in ["", ":80", "10.0.0.1:", "10.0.0.1:99999", "[10.0.0.1]:80", "[fd00::1]80", "[fd00::1", "a:b"] {
            assert!(parse_endpoint(bad).is_err(), "{bad}");
        }
        assert_eq!(Endpoint(ip("fd00::1"), 5).to_string(), "[fd00::1]:5");
        assert_eq!(Endpoint(ip("10.0.0.1"), 5).to_string(), "10.0.0.1:5");
    }

    #[test]
    fn words_report_positions() {
        let mut w = Words::new("  drop in   tcp ");
        assert_eq!(w.next("an action").unwrap(), "drop");
        assert!(w.eat("in") && !w.eat("out"));
        assert_eq!(w.error("end"), "word 3 `tcp`: expected end");
        w.next("x").unwrap();
        assert_eq!(w.error_last("bad"), "word 3 `tcp`: bad");
        assert_eq!(w.next("an address").unwrap_err(), "expected an address after word 3 but the rule ends");
        assert!(w.end("end").is_ok());
    }
}
