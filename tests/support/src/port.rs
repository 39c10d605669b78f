//! Ports for the servers tests start as processes of their own (PostgreSQL clusters, PgBouncer,
//! nats-server, chromedriver).
//!
//! Such a server is told its port, so the port is chosen before the server listens on it, and
//! several are stopped and started again on theirs (a crash, a failover, a node restart). A port
//! the kernel hands out for `bind(0)` lies in its ephemeral range, from which every outgoing
//! connection of every test running beside it also takes its local port: in the gap before the
//! server listens, or while it is down, one of those connections can hold the port, and the
//! server fails to start ("Address already in use"). Below the ephemeral range a port is taken
//! only by an explicit bind, so one is chosen there at random and checked free by binding it.

use std::hash::{BuildHasher, Hasher};
use std::net::TcpListener;

/// Where the random choice starts: above the ports well-known services listen on.
const LOWEST: u16 = 10_000;

/// A port of 127.0.0.1 that no socket holds and that no outgoing connection will be given.
pub fn free() -> u16 {
    let below = ephemeral_range().map_or(32_768, |(low, _)| low);
    if below <= LOWEST + 1_000 {
        // No room below the ephemeral range on this machine: the kernel's choice.
        return TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    }
    let random = std::collections::hash_map::RandomState::new();
    for attempt in 0u64..10_000 {
        let mut hasher = random.build_hasher();
        hasher.write_u64(attempt);
        let port = LOWEST + (hasher.finish() % u64::from(below - LOWEST)) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port of 127.0.0.1 between {LOWEST} and {below}");
}

/// The kernel's ephemeral port range (`net.ipv4.ip_local_port_range`).
fn ephemeral_range() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut bounds = text.split_whitespace().map(|v| v.parse().ok());
    Some((bounds.next()??, bounds.next()??))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_servers_port_is_free_and_outside_the_range_outgoing_connections_take_theirs_from() {
        let (low, high) = super::ephemeral_range().expect("ip_local_port_range");
        for _ in 0..100 {
            let port = super::free();
            assert!(!(low..=high).contains(&port), "{port} is in the ephemeral range {low}–{high}");
            std::net::TcpListener::bind(("127.0.0.1", port)).expect("the port is free");
        }
    }
}
