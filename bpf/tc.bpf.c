// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * Per-pod bytes at the tc layer and tc/qdisc drops with the kernel's reason.
 *
 * Bytes: tc programs on each pod's host-side veth count what passes, per
 * interface. They never change a verdict: they return TCX_NEXT (TC_ACT_UNSPEC
 * for clsact), so the next program (Cilium's, say) sees the packet exactly as
 * before. Host-side ingress is the pod's egress and host-side egress its
 * ingress. Counters are per-CPU: no atomics on the packet path.
 *
 * Drops: tp_btf/kfree_skb, filtered to the reasons of the tc/qdisc layer
 * (userspace fills tc_reasons from the kernel's own enum), counted per
 * (socket-owner cgroup, device, reason, addresses). Userspace drains the map
 * every tick and attributes each drop: socket owner, else device, else pod IP.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_endian.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define TC_ACT_UNSPEC (-1)
#define ETH_P_IP 0x0800
#define ETH_P_IPV6 0x86DD
#define TCP_TIME_WAIT 6
#define TCP_NEW_SYN_RECV 12

struct if_bytes {
	__u64 bytes;
	__u64 packets;
};

/* key: host ifindex; value per CPU: [0] host ingress (pod egress), [1] host egress (pod ingress).
 * Userspace creates the entry when it attaches, so the programs only look up. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct if_bytes[2]);
} if_bytes SEC(".maps");

static __always_inline int count(struct __sk_buff *skb, int dir)
{
	__u32 ifindex = skb->ifindex;
	struct if_bytes *b = bpf_map_lookup_elem(&if_bytes, &ifindex);

	if (b) {
		b[dir].bytes += skb->len;
		b[dir].packets += 1;
	}
	return TC_ACT_UNSPEC; /* = TCX_NEXT: no verdict of ours */
}

SEC("tc")
int tc_host_ingress(struct __sk_buff *skb)
{
	return count(skb, 0);
}

SEC("tc")
int tc_host_egress(struct __sk_buff *skb)
{
	return count(skb, 1);
}

struct drop_key {
	__u64 cgroup_id; /* socket owner, 0 = no full socket */
	__u32 netns;	 /* inode of the device's network namespace, 0 = no device */
	__u32 ifindex;
	__u32 reason;
	__u16 proto; /* ETH_P_IP / ETH_P_IPV6 when addresses were read, else 0 */
	__u16 pad;
	__u8 saddr[16];
	__u8 daddr[16];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, struct drop_key);
	__type(value, __u64);
} drops SEC(".maps");

/* reasons of the tc/qdisc layer, filled by userspace from the kernel's BTF */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 64);
	__type(key, __u32);
	__type(value, __u8);
} tc_reasons SEC(".maps");

/* [0] drops not counted because the drops map was full */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} drop_overflow SEC(".maps");

/* Reading packet headers from a tracepoint needs bpf_probe_read_kernel, which
 * kernel lockdown (confidentiality) forbids: userspace clears this there, and
 * the IP fallback of the attribution is then unavailable. */
const volatile bool read_addrs = true;

static __always_inline void read_ips(struct sk_buff *skb, struct drop_key *k)
{
	unsigned char *head = skb->head;
	__u16 nh = skb->network_header;
	__u16 proto = bpf_ntohs(skb->protocol);

	if (proto == ETH_P_IP) {
		struct iphdr ip;

		if (bpf_probe_read_kernel(&ip, sizeof(ip), head + nh))
			return;
		k->proto = ETH_P_IP;
		k->saddr[10] = k->saddr[11] = 0xff;
		k->daddr[10] = k->daddr[11] = 0xff;
		__builtin_memcpy(&k->saddr[12], &ip.saddr, 4);
		__builtin_memcpy(&k->daddr[12], &ip.daddr, 4);
	} else if (proto == ETH_P_IPV6) {
		struct ipv6hdr ip6;

		if (bpf_probe_read_kernel(&ip6, sizeof(ip6), head + nh))
			return;
		k->proto = ETH_P_IPV6;
		__builtin_memcpy(k->saddr, &ip6.saddr, 16);
		__builtin_memcpy(k->daddr, &ip6.daddr, 16);
	}
}

SEC("tp_btf/kfree_skb")
int BPF_PROG(kfree_skb, struct sk_buff *skb, void *location, enum skb_drop_reason reason)
{
	struct drop_key k = {};
	struct net_device *dev;
	struct sock *sk;
	__u64 *v, one = 1;
	__u32 r = reason;

	if (!bpf_map_lookup_elem(&tc_reasons, &r))
		return 0;
	k.reason = r;
	sk = skb->sk;
	if (sk) {
		__u8 state = sk->__sk_common.skc_state;

		/* request and timewait sockets are not full sockets: no cgroup data */
		if (state != TCP_TIME_WAIT && state != TCP_NEW_SYN_RECV && sk->sk_cgrp_data.cgroup)
			k.cgroup_id = sk->sk_cgrp_data.cgroup->kn->id;
	}
	dev = skb->dev;
	if (dev) {
		k.ifindex = dev->ifindex;
		k.netns = dev->nd_net.net->ns.inum;
	}
	if (read_addrs)
		read_ips(skb, &k);
	v = bpf_map_lookup_elem(&drops, &k);
	if (v) {
		__sync_fetch_and_add(v, 1);
		return 0;
	}
	if (bpf_map_update_elem(&drops, &k, &one, BPF_NOEXIST)) {
		/* raced with another CPU creating it, or full */
		v = bpf_map_lookup_elem(&drops, &k);
		if (v) {
			__sync_fetch_and_add(v, 1);
		} else {
			__u32 zero = 0;
			__u64 *o = bpf_map_lookup_elem(&drop_overflow, &zero);

			if (o)
				*o += 1;
		}
	}
	return 0;
}
