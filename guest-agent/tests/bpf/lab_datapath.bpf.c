// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * Test fixture, not part of the agent: what Cilium attaches on the datapaths the
 * VM lab checks (lab/scenarios/guest-datapaths.sh, loaded by the lab_datapath
 * example).
 *
 * cni_peer / cni_primary: programs on a netkit pair's primary, in netkit's own
 * hooks, as Cilium's from-container and to-container. Each counts what it sees
 * (the check that a program placed after the agent's still sees every packet)
 * and returns NETKIT_PASS, or, for cni_peer with redirect_ifindex set, hands
 * the pod's IPv4 packets to that node device with bpf_redirect_neigh (Cilium's
 * host routing: the packet keeps its socket down to the node device's qdisc).
 *
 * edt_egress: Cilium's bandwidth manager on the node device's egress: an
 * earliest departure time per pod (by source address) from its rate, which the
 * device's fq qdisc enforces. A packet whose departure would be beyond fq's
 * horizon (horizon_ns, the qdisc's) does not move the pod's clock: fq drops it
 * (its horizon drop), and the packets fq keeps leave at the rate.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define NETKIT_PASS 0
#define TCX_NEXT (-1)
#define ETH_P_IP 0x0800
#define ETH_HLEN 14

struct seen {
	__u64 packets;
	__u64 bytes;
};

/* [0] the peer hook (the pod's egress), [1] the primary hook (its ingress) */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, struct seen);
} seen SEC(".maps");

const volatile __u32 redirect_ifindex = 0;

static __always_inline void see(struct __sk_buff *skb, __u32 i)
{
	struct seen *s = bpf_map_lookup_elem(&seen, &i);

	if (s) {
		__sync_fetch_and_add(&s->packets, 1);
		__sync_fetch_and_add(&s->bytes, skb->len);
	}
}

SEC("tc")
int cni_peer(struct __sk_buff *skb)
{
	see(skb, 0);
	if (redirect_ifindex && skb->protocol == bpf_htons(ETH_P_IP))
		return bpf_redirect_neigh(redirect_ifindex, 0, 0, 0);
	return NETKIT_PASS;
}

SEC("tc")
int cni_primary(struct __sk_buff *skb)
{
	see(skb, 1);
	return NETKIT_PASS;
}

struct edt {
	__u64 rate;   /* bytes per second */
	__u64 t_last; /* the pod's last departure time, ns (CLOCK_MONOTONIC) */
};

/* key: the pod's IPv4 address (network order) */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16);
	__type(key, __u32);
	__type(value, struct edt);
} edt SEC(".maps");

const volatile __u64 horizon_ns = 0;

SEC("tc")
int edt_egress(struct __sk_buff *skb)
{
	struct iphdr ip;
	struct edt *e;
	__u64 now, t, t_next;

	if (skb->protocol != bpf_htons(ETH_P_IP))
		return TCX_NEXT;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)))
		return TCX_NEXT;
	e = bpf_map_lookup_elem(&edt, &ip.saddr);
	if (!e || !e->rate)
		return TCX_NEXT;
	now = bpf_ktime_get_ns();
	t = skb->tstamp > now ? skb->tstamp : now;
	t_next = e->t_last + (__u64)skb->len * 1000000000ULL / e->rate;
	if (t_next <= t) {
		e->t_last = t;
		return TCX_NEXT;
	}
	if (horizon_ns && t_next - now > horizon_ns) {
		/* beyond fq's horizon: fq drops it; the clock stays */
		skb->tstamp = t_next;
		return TCX_NEXT;
	}
	e->t_last = t_next;
	skb->tstamp = t_next;
	return TCX_NEXT;
}
