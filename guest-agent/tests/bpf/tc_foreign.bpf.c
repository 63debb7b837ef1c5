// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * Test fixture, not part of the agent: "someone else's" tc program (think
 * Cilium) that counts every packet and drops UDP to port 9. The tc tests
 * attach it first and check that it keeps running and keeps its verdicts once
 * gpufeed's programs are on the same hook.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define ETH_P_IP 0x0800
#define IPPROTO_UDP 17
#define TC_ACT_SHOT 2

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2); /* [0] packets seen, [1] packets dropped */
	__type(key, __u32);
	__type(value, __u64);
} foreign_counts SEC(".maps");

static __always_inline void bump(__u32 i)
{
	__u64 *v = bpf_map_lookup_elem(&foreign_counts, &i);

	if (v)
		__sync_fetch_and_add(v, 1);
}

SEC("tc")
int foreign(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = data + sizeof(*eth);
	struct udphdr *udp;

	bump(0);
	if ((void *)(ip + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP) || ip->protocol != IPPROTO_UDP)
		return -1;
	udp = (void *)ip + ip->ihl * 4;
	if ((void *)(udp + 1) > end)
		return -1;
	if (udp->dest == bpf_htons(9)) {
		bump(1);
		return TC_ACT_SHOT;
	}
	return -1;
}
