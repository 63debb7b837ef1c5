//! A pod's ingress from the two places that count it: the host side's hook (the host veth's
//! tc egress, netkit's primary hook) and socket delivery in the pod. Packets that take the
//! host side are counted by both, the hook first; packets a CNI hands to the pod around the
//! host side (`bpf_redirect_peer`) only at delivery; packets no socket takes only at the hook.
//! So the pod's ingress in a tick is the larger of the two counts, less what delivery counted
//! of packets the hook had already counted in the tick before.
//!
//! Why that last part: between the hook and the socket a packet waits in the receiving CPU's
//! backlog for the softirq. When a tick's reads fall in that wait (a busy or emulated CPU), the
//! hook counts the packet in one tick and delivery in the next, and "the larger per tick"
//! counts it in both: a 64 KiB GSO packet twice, measured on an emulated 2-core VM.

/// The join of one pod interface's two ingress counts, tick by tick.
#[derive(Debug, Default, Clone, Copy)]
pub struct IngressJoin {
    /// bytes the hook counted that delivery has not yet: at most the last tick's hook bytes
    /// (a packet waits in a backlog for less than a tick; more is what no socket takes)
    in_flight: u64,
}

/// One tick's joined ingress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Joined {
    /// the pod's ingress bytes this tick
    pub bytes: u64,
    /// what delivery counted beyond the packets the hook counted the tick before
    pub fresh_delivered: u64,
}

impl IngressJoin {
    /// `host_side` and `delivered`: the bytes each place counted since the last tick.
    pub fn tick(&mut self, host_side: u64, delivered: u64) -> Joined {
        let fresh_delivered = delivered.saturating_sub(self.in_flight);
        self.in_flight = (self.in_flight + host_side)
            .saturating_sub(delivered)
            .min(host_side);
        Joined {
            bytes: host_side.max(fresh_delivered),
            fresh_delivered,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GSO: u64 = 65_226;

    fn run(ticks: &[(u64, u64)]) -> u64 {
        let mut j = IngressJoin::default();
        ticks.iter().map(|&(h, d)| j.tick(h, d).bytes).sum()
    }

    /// A packet the hook counts in one tick and delivery in the next is counted once, also
    /// when it happens tick after tick during a transfer.
    #[test]
    fn a_packet_counted_across_a_tick_boundary_counts_once() {
        // 10 packets: the hook sees 4, 3, 3; delivery lags one packet at each boundary
        assert_eq!(
            run(&[(4 * GSO, 3 * GSO), (3 * GSO, 3 * GSO), (3 * GSO, 4 * GSO)]),
            10 * GSO
        );
        // the lag changing from tick to tick: 0, 2, 1, 0 packets in flight at the boundaries
        assert_eq!(
            run(&[
                (5 * GSO, 3 * GSO),
                (5 * GSO, 6 * GSO),
                (2 * GSO, 3 * GSO),
                (0, 0)
            ]),
            12 * GSO
        );
    }

    /// Ingress the CNI delivers around the host side is counted whole at delivery.
    #[test]
    fn delivery_alone_counts_whole() {
        assert_eq!(run(&[(0, 1000), (0, 5000), (0, 0), (0, 7)]), 6007);
    }

    /// Packets no socket takes (ICMP, ARP, a closed port) are counted whole at the hook, and
    /// they do not hide delivery that comes after them by more than a tick.
    #[test]
    fn the_hook_alone_counts_whole_and_its_surplus_lasts_one_tick() {
        assert_eq!(run(&[(1000, 0), (1000, 0), (1000, 0)]), 3000);
        // a tick of hook-only bytes, an idle tick, then delivery-only: all counted
        assert_eq!(run(&[(1000, 0), (0, 0), (0, 500)]), 1500);
    }

    /// Both at once (some ingress by the host side, more around it): the larger.
    #[test]
    fn both_paths_at_once_count_the_larger() {
        let mut j = IngressJoin::default();
        for _ in 0..5 {
            assert_eq!(j.tick(500, 1500).bytes, 1500);
        }
    }

    /// Delivery counts a little less than the hook on a veth (the Ethernet headers of
    /// packets that no socket takes), tick after tick: the hook's count stands, the surplus
    /// held is bounded by one tick's hook bytes, and that is all delivery can lose when the
    /// host side goes quiet and everything arrives around it.
    #[test]
    fn a_steady_surplus_at_the_hook_is_bounded_by_one_tick() {
        let mut j = IngressJoin::default();
        for _ in 0..1000 {
            assert_eq!(j.tick(10_000, 9_900).bytes, 10_000);
        }
        assert!(j.in_flight <= 10_000, "{}", j.in_flight);
        assert!(j.tick(0, 20_000).bytes >= 20_000 - 10_000);
        assert_eq!(j.tick(0, 20_000).bytes, 20_000);
    }
}
