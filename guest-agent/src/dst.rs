//! Named destination CIDRs: the `dst` label of the TCP series.
//!
//! Users name networks (`--dst cluster=10.42.0.0/16,fd00:42::/56`); the kernel
//! does the longest-prefix match once per socket. IPv4 networks are stored as
//! v4-mapped IPv6 prefixes so that one trie serves both families (an AF_INET6
//! socket talking to a v4-mapped address matches the same entry).

#[cfg(test)]
use std::net::IpAddr;

use ipnet::IpNet;

/// Class slots in the kernel (`TCP_MAX_DST` in bpf/tcp.bpf.c); the last one is
/// "no prefix matched".
pub const MAX_DST: usize = 16;
pub const UNMATCHED_NAME: &str = "other";

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DstError {
    #[error("destination {0:?}: expected NAME=CIDR[,CIDR...]")]
    Syntax(String),
    #[error("destination {name:?}: {cidr:?} is not a CIDR ({reason})")]
    BadCidr {
        name: String,
        cidr: String,
        reason: String,
    },
    #[error("destination name {0:?}: use letters, digits, '-', '_' or '.'")]
    BadName(String),
    #[error("too many destination names (at most {} besides {UNMATCHED_NAME:?})", MAX_DST - 1)]
    TooMany,
}

/// The classes in index order plus their prefixes.
#[derive(Debug, Clone, PartialEq)]
pub struct DstTable {
    names: Vec<String>,
    prefixes: Vec<(IpNet, u32)>,
}

impl DstTable {
    /// Sensible defaults when the user names nothing.
    pub fn defaults() -> DstTable {
        let specs = [
            "loopback=127.0.0.0/8,::1/128",
            "private=10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,100.64.0.0/10,fc00::/7",
            "link-local=169.254.0.0/16,fe80::/10",
            "internet=0.0.0.0/0,::/0",
        ];
        DstTable::parse(specs.iter().copied()).expect("built-in destinations are valid")
    }

    /// Parses `NAME=CIDR[,CIDR...]` specs; a name may repeat to add prefixes.
    pub fn parse<'a>(specs: impl IntoIterator<Item = &'a str>) -> Result<DstTable, DstError> {
        let mut t = DstTable {
            names: Vec::new(),
            prefixes: Vec::new(),
        };
        for spec in specs {
            let (name, cidrs) = spec
                .split_once('=')
                .ok_or_else(|| DstError::Syntax(spec.to_string()))?;
            let name = name.trim();
            if name.is_empty()
                || name == UNMATCHED_NAME
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            {
                return Err(DstError::BadName(name.to_string()));
            }
            let idx = match t.names.iter().position(|n| n == name) {
                Some(i) => i,
                None => {
                    if t.names.len() >= MAX_DST - 1 {
                        return Err(DstError::TooMany);
                    }
                    t.names.push(name.to_string());
                    t.names.len() - 1
                }
            };
            for cidr in cidrs.split(',').map(str::trim).filter(|c| !c.is_empty()) {
                let net: IpNet =
                    cidr.parse()
                        .map_err(|e: ipnet::AddrParseError| DstError::BadCidr {
                            name: name.to_string(),
                            cidr: cidr.to_string(),
                            reason: e.to_string(),
                        })?;
                t.prefixes.push((net.trunc(), idx as u32));
            }
        }
        Ok(t)
    }

    /// Label value of class `idx` as reported by the kernel.
    pub fn name(&self, idx: usize) -> &str {
        self.names
            .get(idx)
            .map(String::as_str)
            .unwrap_or(UNMATCHED_NAME)
    }

    /// Entries for the kernel's LPM trie: (key bytes, class index).
    /// Key layout: u32 prefix length (host order), then 16 address bytes.
    pub fn lpm_entries(&self) -> Vec<([u8; 20], u32)> {
        self.prefixes
            .iter()
            .map(|(net, idx)| {
                let (addr, plen) = match net {
                    IpNet::V4(n) => (
                        n.addr().to_ipv6_mapped().octets(),
                        u32::from(n.prefix_len()) + 96,
                    ),
                    IpNet::V6(n) => (n.addr().octets(), u32::from(n.prefix_len())),
                };
                let mut key = [0u8; 20];
                key[..4].copy_from_slice(&plen.to_ne_bytes());
                key[4..].copy_from_slice(&addr);
                (key, *idx)
            })
            .collect()
    }

    /// The class the kernel would pick for `ip` (longest prefix wins); used in tests.
    #[cfg(test)]
    pub fn classify(&self, ip: IpAddr) -> &str {
        let mapped = match ip {
            IpAddr::V4(a) => a.to_ipv6_mapped(),
            IpAddr::V6(a) => a,
        };
        let mut best: Option<(u8, u32)> = None;
        for (net, idx) in &self.prefixes {
            let (hit, len) = match net {
                IpNet::V4(n) => (
                    mapped.to_ipv4_mapped().is_some_and(|a| n.contains(&a)),
                    n.prefix_len() + 96,
                ),
                IpNet::V6(n) => (n.contains(&mapped), n.prefix_len()),
            };
            if hit && best.is_none_or(|(l, _)| len > l) {
                best = Some((len, *idx));
            }
        }
        best.map(|(_, i)| self.name(i as usize))
            .unwrap_or(UNMATCHED_NAME)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_classify_like_an_lpm() {
        let t = DstTable::defaults();
        assert_eq!(t.classify("127.0.0.1".parse().unwrap()), "loopback");
        assert_eq!(t.classify("::1".parse().unwrap()), "loopback");
        assert_eq!(t.classify("10.1.2.3".parse().unwrap()), "private");
        assert_eq!(t.classify("8.8.8.8".parse().unwrap()), "internet");
        assert_eq!(t.classify("2001:db8::1".parse().unwrap()), "internet");
        assert_eq!(t.classify("::ffff:192.168.1.1".parse().unwrap()), "private");
    }

    #[test]
    fn user_names_longest_prefix_and_repeat() {
        let t = DstTable::parse([
            "cluster=10.42.0.0/16",
            "private=10.0.0.0/8",
            "cluster=fd00::/8",
        ])
        .unwrap();
        assert_eq!(t.classify("10.42.9.9".parse().unwrap()), "cluster");
        assert_eq!(t.classify("10.43.0.1".parse().unwrap()), "private");
        assert_eq!(t.classify("fd00::5".parse().unwrap()), "cluster");
        assert_eq!(t.classify("1.1.1.1".parse().unwrap()), UNMATCHED_NAME);
        let keys = t.lpm_entries();
        assert_eq!(keys.len(), 3);
        assert_eq!(
            u32::from_ne_bytes(keys[0].0[..4].try_into().unwrap()),
            16 + 96
        );
        assert_eq!(
            &keys[0].0[4..],
            &"::ffff:10.42.0.0"
                .parse::<std::net::Ipv6Addr>()
                .unwrap()
                .octets()
        );
        assert_eq!(keys[2].1, 0);
    }

    #[test]
    fn bad_specs_are_named() {
        assert_eq!(
            DstTable::parse(["nocidr"]),
            Err(DstError::Syntax("nocidr".into()))
        );
        assert!(matches!(
            DstTable::parse(["x=10.0.0.0/33"]),
            Err(DstError::BadCidr { .. })
        ));
        assert!(matches!(
            DstTable::parse(["bad name=10.0.0.0/8"]),
            Err(DstError::BadName(_))
        ));
        assert!(matches!(
            DstTable::parse(["other=10.0.0.0/8"]),
            Err(DstError::BadName(_))
        ));
        let many: Vec<String> = (0..16).map(|i| format!("n{i}=10.{i}.0.0/16")).collect();
        assert_eq!(
            DstTable::parse(many.iter().map(String::as_str)),
            Err(DstError::TooMany)
        );
        let err = DstTable::parse(["x=nonsense"]).unwrap_err().to_string();
        assert!(err.contains("nonsense"), "{err}");
    }
}
