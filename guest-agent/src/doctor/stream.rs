//! The host stream as the running agent sees it: started, every allowed host connected, and
//! the clocks close enough.

use std::time::Duration;

use gpufeed_shared::doctor::Finding;

use crate::host_stream::{Stream, StreamState};

/// Host minus guest clock offset beyond which the check fails. NTP-synced machines agree
/// within milliseconds; events are placed with the measured offset either way, but the host's
/// own logs and series then disagree with the guest's by that much.
pub const MAX_CLOCK_OFFSET: Duration = Duration::from_millis(100);

const CHECK: &str = "host_stream";

/// `host_stream` of the running agent.
pub fn host_stream(stream: &Stream) -> Finding {
    match stream.get() {
        StreamState::Off => Finding::skip(CHECK, "off (no --quic-listen)"),
        StreamState::Waiting(why) => Finding::fail(
            CHECK,
            format!("not started: {why}"),
            "apply the Secret gpufeed-guest-tls that `gpufeed-guest certs init` writes \
             (certs/gpufeed-guest-tls.yaml); the agent picks it up within seconds",
        ),
        StreamState::Up(hub) => {
            let hosts: Vec<(String, bool, Option<i64>)> = hub
                .hosts()
                .into_iter()
                .map(|(h, up)| {
                    let off = hub.clock_offset_ns(&h);
                    (h, up, off)
                })
                .collect();
            verdict(&hosts)
        }
    }
}

/// The verdict on (host, connected, clock offset in ns) of every allowed host.
pub fn verdict(hosts: &[(String, bool, Option<i64>)]) -> Finding {
    if hosts.is_empty() {
        return Finding::fail(
            CHECK,
            "allowed-hosts lists no host",
            "list the host in allowed-hosts (`gpufeed-guest certs init --host NAME`) and apply the Secret again",
        );
    }
    let down: Vec<&str> = hosts
        .iter()
        .filter(|h| !h.1)
        .map(|h| h.0.as_str())
        .collect();
    if !down.is_empty() {
        return Finding::fail(
            CHECK,
            format!("not connected: {}", down.join(", ")),
            "on the host: `systemctl status gpufeed-host` and `gpufeed-host doctor`; its \
             [[stream.guests]] address must be <NODE_IP>:7845 and reach it over UDP, with \
             certificates from this deployment's CA",
        );
    }
    let max = MAX_CLOCK_OFFSET.as_nanos() as i64;
    let skewed: Vec<String> = hosts
        .iter()
        .filter_map(|(h, _, off)| {
            off.filter(|o| o.abs() > max)
                .map(|o| format!("{h} {:+.1} ms", o as f64 / 1e6))
        })
        .collect();
    if !skewed.is_empty() {
        return Finding::fail(
            CHECK,
            format!(
                "clock offset over {} ms: {}",
                MAX_CLOCK_OFFSET.as_millis(),
                skewed.join(", ")
            ),
            "sync both clocks (chrony or systemd-timesyncd on the host, the node's time \
             sync in the guest; a KVM guest can use /dev/ptp_kvm as chrony refclock)",
        );
    }
    let names: Vec<&str> = hosts.iter().map(|h| h.0.as_str()).collect();
    Finding::pass(
        CHECK,
        format!(
            "connected: {}; clock offsets within {} ms",
            names.join(", "),
            MAX_CLOCK_OFFSET.as_millis()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts() {
        let h = |n: &str, up: bool, off: Option<i64>| (n.to_string(), up, off);
        assert!(verdict(&[h("a", true, Some(2_000_000)), h("b", true, None)]).passed());
        let f = verdict(&[h("a", true, None), h("b", false, None)]);
        assert_eq!(f.detail, "not connected: b");
        let f = verdict(&[h("a", true, Some(-250_000_000))]);
        assert!(!f.passed());
        assert_eq!(f.detail, "clock offset over 100 ms: a -250.0 ms");
        assert!(!verdict(&[]).passed());
    }
}
