// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * Test fixture, not part of the agent: delivery to a local pod the way
 * Cilium's BPF host routing does it. On the "node device"'s tc ingress, IPv4
 * packets for the pod's address go with bpf_redirect_peer straight into the
 * ingress of the peer of the pod's host-side veth (the pod-side interface, in
 * the pod's namespace): no forwarding by the host's stack, and the host-side
 * veth never transmits them. Everything else passes. The pod's egress goes
 * out through the node device with bpf_redirect_neigh (redirect_keep_sk.bpf.c).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define ETH_P_IP 0x0800

/* the pod's host-side veth (whose peer receives) and the pod's IPv4 address
 * (network order), set before load */
const volatile __u32 pod_host_ifindex = 0;
const volatile __u32 pod_ip = 0;

/* [0] packets redirected into the pod */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} peer_counts SEC(".maps");

SEC("tc")
int redirect_peer_in(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + sizeof(struct ethhdr);
	__u32 zero = 0;
	__u64 *n;

	if (skb->protocol != bpf_htons(ETH_P_IP) || (void *)(ip + 1) > end)
		return -1;
	if (ip->daddr != pod_ip)
		return -1;
	n = bpf_map_lookup_elem(&peer_counts, &zero);
	if (n)
		__sync_fetch_and_add(n, 1);
	return bpf_redirect_peer(pod_host_ifindex, 0);
}
