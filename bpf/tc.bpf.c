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
 * hostNetwork pods have no veth of their own: on the node's devices the
 * node_* programs count bytes per socket-owner cgroup instead. Outgoing
 * packets carry their socket (counted only when it belongs to the host's
 * network namespace: other pods' packets were counted on their veth); for
 * incoming ones the socket is looked up from the packet's addresses and ports
 * (TCP and UDP) in the host's namespace.
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
#include <bpf/bpf_core_read.h>

/* generic kfunc (6.2+): a read-only typed view of a kernel object; tc programs
 * have no bpf_sk_cgroup_id(), so the owner cgroup is read from the socket. Only
 * the node-device programs (hostNetwork pods) use it: on a kernel without it
 * (6.1) the agent leaves them out and counts pod interfaces and drops alone. */
extern void *bpf_rdonly_cast(const void *obj, __u32 btf_id) __ksym __weak;

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
 * Userspace creates the entry when it attaches, so the programs only look up.
 * max_entries here and below are placeholders: userspace sets every size before
 * load (probes/tc/loader.rs, docs/probes.md). */
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

/* key: socket-owner cgroup id; same value layout as if_bytes, [0] sent by the
 * cgroup's sockets (egress), [1] received (ingress). LRU: idle cgroups age out. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_PERCPU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u64);
	__type(value, struct if_bytes[2]);
} cg_bytes SEC(".maps");

/* [0] set when a packet was counted in cg_bytes, [1] when a drop was counted,
 * since the agent last looked (it clears them): an idle node's tick walks
 * neither hash map (a walk visits every bucket, empty or not). Set only when
 * clear, so packets mostly read the shared word.
 * [2] the generation new drops are recorded under (0 or 1), written by the
 * agent: see `drops`. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 3);
	__type(key, __u32);
	__type(value, __u64);
} tc_touched SEC(".maps");

static __always_inline void touch(__u32 i)
{
	__u64 *t = bpf_map_lookup_elem(&tc_touched, &i);

	if (t && !*t)
		*t = 1;
}

static __always_inline void count_cgroup(__u64 cg, int dir, __u32 len)
{
	struct if_bytes *b = bpf_map_lookup_elem(&cg_bytes, &cg);

	if (!b) {
		struct if_bytes zero[2] = {};

		bpf_map_update_elem(&cg_bytes, &cg, zero, BPF_NOEXIST);
		b = bpf_map_lookup_elem(&cg_bytes, &cg);
		if (!b)
			return;
	}
	b[dir].bytes += len;
	b[dir].packets += 1;
	touch(0);
}

/* Inode of the host's network namespace (the node devices'), set by userspace
 * before load; 0 = unknown, every socket counts. */
const volatile __u32 host_netns_ino = 0;

SEC("tc")
int tc_node_egress(struct __sk_buff *skb)
{
	__u64 cg = bpf_skb_cgroup_id(skb); /* 0 without a local socket (forwarded) */
	struct bpf_sock *sk = skb->sk;

	if (!cg || !sk)
		return TC_ACT_UNSPEC;
	/* Only sockets of the host's namespace: an ordinary pod's packets that
	 * reach the node device with their socket still attached (host routing
	 * by bpf_redirect_neigh/peer, as Cilium does) were counted on its veth. */
	if (host_netns_ino) {
		struct sock_common *c =
			bpf_rdonly_cast(sk, bpf_core_type_id_kernel(struct sock_common));
		struct net *net = c->skc_net.net;

		if (!net || net->ns.inum != host_netns_ino)
			return TC_ACT_UNSPEC;
	}
	count_cgroup(cg, 0, skb->len);
	return TC_ACT_UNSPEC;
}

#define IPPROTO_TCP 6
#define IPPROTO_UDP 17

SEC("tc")
int tc_node_ingress(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk = 0;
	__u32 tlen;
	__u8 proto;
	void *l4;

	if (skb->protocol == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = data + sizeof(struct ethhdr);

		if ((void *)(ip + 1) > end || ip->ihl < 5)
			return TC_ACT_UNSPEC;
		proto = ip->protocol;
		l4 = (void *)ip + ip->ihl * 4;
		t.ipv4.saddr = ip->saddr;
		t.ipv4.daddr = ip->daddr;
		tlen = sizeof(t.ipv4);
	} else if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = data + sizeof(struct ethhdr);

		if ((void *)(ip6 + 1) > end)
			return TC_ACT_UNSPEC;
		proto = ip6->nexthdr; /* extension headers: not attributed */
		l4 = ip6 + 1;
		__builtin_memcpy(t.ipv6.saddr, &ip6->saddr, 16);
		__builtin_memcpy(t.ipv6.daddr, &ip6->daddr, 16);
		tlen = sizeof(t.ipv6);
	} else {
		return TC_ACT_UNSPEC;
	}
	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return TC_ACT_UNSPEC;
	/* source and destination ports lead both TCP and UDP headers */
	if (l4 + 4 > end)
		return TC_ACT_UNSPEC;
	if (tlen == sizeof(t.ipv4)) {
		t.ipv4.sport = ((__be16 *)l4)[0];
		t.ipv4.dport = ((__be16 *)l4)[1];
	} else {
		t.ipv6.sport = ((__be16 *)l4)[0];
		t.ipv6.dport = ((__be16 *)l4)[1];
	}
	if (proto == IPPROTO_TCP)
		sk = bpf_sk_lookup_tcp(skb, &t, tlen, BPF_F_CURRENT_NETNS, 0);
	else
		sk = bpf_sk_lookup_udp(skb, &t, tlen, BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return TC_ACT_UNSPEC;
	{
		struct sock *ks = bpf_rdonly_cast(sk, bpf_core_type_id_kernel(struct sock));
		struct cgroup *cgrp = ks->sk_cgrp_data.cgroup;
		__u64 cg = cgrp ? cgrp->kn->id : 0;

		bpf_sk_release(sk);
		if (cg)
			count_cgroup(cg, 1, skb->len);
	}
	return TC_ACT_UNSPEC;
}

/* Pod ingress at delivery to a socket, keyed by the receiving (pod-side)
 * interface: ((netns inode) << 32 | ifindex). Cilium's host routing hands
 * packets to a pod with bpf_redirect_peer from the node device's tc ingress
 * straight into the pod-side interface's ingress: the host side's egress hook
 * above never sees them. A cgroup_skb/ingress program on the cgroup2 root
 * runs for every packet a socket of the node receives, whatever way it came
 * in; skb->dev is still the interface it arrived on (tcp_v4_rcv clears it only
 * after the filter). Userspace creates the entry of each pod-side interface it
 * knows, so other packets cost one failed lookup. Same value layout as
 * if_bytes[1]. The agent exports, per pod and tick, the larger of this and
 * the host side's egress (docs/probes.md, "Where each direction is counted"). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, struct if_bytes);
} pod_rx SEC(".maps");

/* generic kfunc (6.3+): the kernel's sk_buff behind a program's context */
extern void *bpf_cast_to_kern_ctx(void *obj) __ksym __weak;

SEC("cgroup_skb/ingress")
int pod_deliver(struct __sk_buff *ctx)
{
	struct sk_buff *skb = bpf_cast_to_kern_ctx(ctx);
	struct net_device *dev = skb->dev;
	struct if_bytes *b;
	__u32 l2 = 0;
	__u64 key;

	if (!dev)
		return 1;
	key = (__u64)dev->nd_net.net->ns.inum << 32 | (__u32)dev->ifindex;
	b = bpf_map_lookup_elem(&pod_rx, &key);
	if (!b)
		return 1;
	/* the program sees the packet from its network header; the interface
	 * counted its link-layer header too (none on an L3 device) */
	if (skb->mac_header != (__u16)~0U && skb->network_header > skb->mac_header)
		l2 = skb->network_header - skb->mac_header;
	b->bytes += ctx->len + l2;
	b->packets += 1;
	return 1; /* allow: no verdict of ours */
}

/* netkit pods: netkit runs the programs attached to the primary device (the
 * host side) in its own hooks, in the transmit routine of either device, with
 * skb->dev already switched to the device that will receive the packet:
 * BPF_NETKIT_PEER when the pod's side transmits (the pod's egress, before
 * Cilium's program there, which may redirect it to the node device so that the
 * primary never receives it) runs with skb->dev the primary: tc_host_ingress,
 * keyed by the primary's ifindex as on a veth. BPF_NETKIT_PRIMARY when the
 * primary transmits (towards the pod) runs with skb->dev the pod-side
 * interface, in the pod's namespace, whose ifindex means nothing here (and may
 * equal another host interface's): nk_primary finds the primary's ifindex in
 * this map, which userspace fills when it attaches, by the pod side's
 * ((netns inode) << 32 | ifindex), as pod_rx is keyed. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u64);
	__type(value, __u32);
} nk_primary_of SEC(".maps");

SEC("tc")
int nk_primary(struct __sk_buff *ctx)
{
	struct sk_buff *skb = bpf_cast_to_kern_ctx(ctx);
	struct net_device *dev = skb->dev;
	struct if_bytes *b;
	__u32 *primary;
	__u64 key;

	if (!dev)
		return TC_ACT_UNSPEC;
	key = (__u64)dev->nd_net.net->ns.inum << 32 | (__u32)dev->ifindex;
	primary = bpf_map_lookup_elem(&nk_primary_of, &key);
	if (!primary)
		return TC_ACT_UNSPEC;
	b = bpf_map_lookup_elem(&if_bytes, primary);
	if (b) {
		b[1].bytes += ctx->len;
		b[1].packets += 1;
	}
	return TC_ACT_UNSPEC; /* = NETKIT_NEXT: the next program's verdict, or netkit's policy */
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
	__u16 gen;   /* tc_touched[2] when the drop was counted */
	__u8 saddr[16];
	__u8 daddr[16];
};

/* Drops are counted under one of two generations. The agent deletes what it
 * takes, and a program that looked an entry up just before the delete would
 * add to the freed copy, losing the drop. So the agent flips the generation
 * and takes the old one's entries a tick later, when no program still holds
 * them. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, struct drop_key);
	__type(value, __u64);
} drops SEC(".maps");

/* reasons of the tc/qdisc layer, filled by userspace from the kernel's BTF
 * (and sized to their number) */
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

/* SKB_DROP_REASON_MAX of the running kernel (userspace reads it from BTF; 0 = unknown). A
 * reason above it that is no subsystem's (those sit at subsys << 16) is one the kernel never
 * defined: 7.x qdiscs free part of their drops from their to-free list with the reason their
 * control block was left holding (a tbf on a shaped upload, a third of its drops in the lab's
 * 7.3 run, counted in the qdisc's own `dropped`). They are qdisc drops: counted, under their
 * raw value. */
const volatile __u32 core_reason_max = 0;

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
	__u64 *v, *gen, one = 1;
	__u32 r = reason, gen_at = 2;

	if (!bpf_map_lookup_elem(&tc_reasons, &r) &&
	    (!core_reason_max || r <= core_reason_max || r >> 16))
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
	gen = bpf_map_lookup_elem(&tc_touched, &gen_at);
	if (gen)
		k.gen = *gen & 1;
	v = bpf_map_lookup_elem(&drops, &k);
	if (v) {
		__sync_fetch_and_add(v, 1);
		touch(1);
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
	touch(1);
	return 0;
}
