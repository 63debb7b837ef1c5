// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * Test fixture, not part of the agent: host routing the way Cilium does it.
 * On the pod veth's host side a tc ingress program hands IP packets straight
 * to the node device with bpf_redirect_neigh (no forwarding by the stack, the
 * socket stays attached to the skb); a second instance on the node device
 * sends the replies back to the pod veth the same way.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define ETH_P_IP 0x0800

const volatile __u32 to_ifindex = 0;

SEC("tc")
int redirect_neigh_ip(struct __sk_buff *skb)
{
	if (skb->protocol != bpf_htons(ETH_P_IP))
		return -1; /* ARP and the rest: the stack answers */
	return bpf_redirect_neigh(to_ifindex, 0, 0, 0);
}
