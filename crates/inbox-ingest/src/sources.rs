//! Who may deliver webhooks (`--allow-from`), and which address a request comes from when a
//! proxy of ours stands in front (`--trusted-proxies`).
//!
//! The rule for the proxy header: `X-Forwarded-For` is read only when the TCP peer is a trusted
//! proxy, and then from the right — each proxy appends the address it received the request from —
//! skipping addresses that are trusted proxies themselves; the first that is not is the client.
//! Everything to its left was written by the client, who may write anything, and is never read.
//! Without `--trusted-proxies` the header is ignored: the TCP peer is the client.

use std::net::IpAddr;

use actix_web::http::header::HeaderMap;
use ipnet::IpNet;

/// The source rules of the webhook route.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourcePolicy {
    /// Networks webhooks are accepted from; empty: from anywhere.
    pub allow: Vec<IpNet>,
    /// Proxies whose `X-Forwarded-For` is believed.
    pub trusted_proxies: Vec<IpNet>,
}

/// Parses one network: `CIDR` (`10.0.0.0/8`, `2600:1f18::/32`) or a single address.
/// An empty entry is refused, not skipped: an allow-list that came out empty (a fetch of Stripe's
/// list that failed, say) must stop the ingest, not open it to everyone.
pub fn parse_network(text: &str) -> Result<IpNet, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("an empty entry (unset the variable to accept webhooks from anywhere)".to_owned());
    }
    text.parse::<IpNet>().or_else(|_| text.parse::<IpAddr>().map(IpNet::from)).map_err(|_| {
        "expected an address or a network in CIDR notation (203.0.113.0/24, 2001:db8::/32)".to_owned()
    })
}

fn contains(networks: &[IpNet], address: IpAddr) -> bool {
    networks.iter().any(|n| n.contains(&address))
}

impl SourcePolicy {
    /// The address the request comes from: `peer`, or — when `peer` is a trusted proxy — what
    /// `X-Forwarded-For` says by the rule above. None when a trusted proxy sent a header that is
    /// not a list of addresses.
    pub fn client(&self, peer: IpAddr, headers: &HeaderMap) -> Option<IpAddr> {
        let peer = peer.to_canonical();
        if !contains(&self.trusted_proxies, peer) {
            return Some(peer);
        }
        let mut forwarded = Vec::new();
        for value in headers.get_all("x-forwarded-for") {
            for item in value.to_str().ok()?.split(',') {
                forwarded.push(item.trim().parse::<IpAddr>().ok()?.to_canonical());
            }
        }
        Some(forwarded.iter().rev().copied().find(|a| !contains(&self.trusted_proxies, *a)).unwrap_or_else(
            // Every hop a proxy of ours: the first one is where it came from.
            || forwarded.first().copied().unwrap_or(peer),
        ))
    }

    /// Whether a request from `peer` with `headers` may deliver webhooks.
    pub fn admits(&self, peer: Option<IpAddr>, headers: &HeaderMap) -> bool {
        if self.allow.is_empty() {
            return true;
        }
        peer.and_then(|peer| self.client(peer, headers)).is_some_and(|client| contains(&self.allow, client))
    }
}

#[cfg(test)]
mod tests {
    use actix_web::http::header::{HeaderName, HeaderValue};

    use super::*;

    fn headers(forwarded: &[&str]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for value in forwarded {
            map.append(HeaderName::from_static("x-forwarded-for"), HeaderValue::from_str(value).unwrap());
        }
        map
    }

    fn policy(allow: &[&str], proxies: &[&str]) -> SourcePolicy {
        SourcePolicy {
            allow: allow.iter().map(|n| parse_network(n).unwrap()).collect(),
            trusted_proxies: proxies.iter().map(|n| parse_network(n).unwrap()).collect(),
        }
    }

    #[test]
    fn the_forwarded_header_counts_only_from_a_trusted_proxy_and_only_from_the_right() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let p = policy(&["203.0.113.0/24"], &["10.0.0.0/8"]);
        // Straight from the client: the header is the client's own words, never read.
        assert!(!p.admits(Some(ip("198.51.100.1")), &headers(&["203.0.113.7"])));
        assert!(p.admits(Some(ip("203.0.113.7")), &headers(&[])));
        // Through our proxy: the address it appended.
        assert!(p.admits(Some(ip("10.1.2.3")), &headers(&["203.0.113.7"])));
        assert!(!p.admits(Some(ip("10.1.2.3")), &headers(&["198.51.100.1"])));
        // A client that writes an allowed address first is still the address our proxy saw.
        assert!(!p.admits(Some(ip("10.1.2.3")), &headers(&["203.0.113.7, 198.51.100.1"])));
        // Two proxies of ours: the first address from the right that is not one of them.
        assert!(p.admits(Some(ip("10.1.2.3")), &headers(&["198.51.100.1, 203.0.113.7", "10.9.9.9"])));
        // Junk from a trusted proxy is no address at all.
        assert!(!p.admits(Some(ip("10.1.2.3")), &headers(&["unknown"])));
        // IPv4-mapped IPv6 peers are their IPv4 address; no allow-list admits everyone.
        assert!(p.admits(Some(ip("::ffff:203.0.113.9")), &headers(&[])));
        assert!(policy(&[], &[]).admits(None, &headers(&[])));
        assert!(parse_network("300.1.1.1").is_err());
        assert!(parse_network(" ").unwrap_err().contains("unset the variable"), "an empty list never opens");
    }
}
