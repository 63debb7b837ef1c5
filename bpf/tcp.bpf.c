// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * TCP smoothed RTT and retransmitted segments per (socket-owner cgroup, destination).
 *
 * Both hooks run in softirq or timer context, where the current task is
 * unrelated to the socket; the owner is the cgroup stored in the socket at
 * creation (sk_cgrp_data), which is also right for hostNetwork pods.
 *
 * The destination class ("dst" label) comes from a longest-prefix-match trie
 * filled by userspace with named CIDRs. The match is done once per socket and
 * cached in socket-local storage, so the per-segment path is two local-storage
 * lookups and a few atomic adds.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include "hist.h"
#include "cgroup.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define AF_INET 2
#define AF_INET6 10
#define TCP_MAX_DST 16  /* mirrored in probes/tcp.rs */
#define DST_UNMATCHED (TCP_MAX_DST - 1)

struct dst_key {
	__u32 prefixlen;
	__u8 addr[16]; /* IPv4 as v4-mapped IPv6 */
};

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 256);
	__type(key, struct dst_key);
	__type(value, __u32); /* dst class index < DST_UNMATCHED */
} dst_cidrs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u32); /* dst class index + 1; 0 = not classified yet */
} sock_dst SEC(".maps");

struct tcp_cgroup {
	struct hist rtt[TCP_MAX_DST];
	__u64 retrans_segs[TCP_MAX_DST];
};

struct {
	__uint(type, BPF_MAP_TYPE_CGRP_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct tcp_cgroup);
} tcp_stats SEC(".maps");

/* Set by userspace before load: whether tcp_retransmit_skb has the `err`
 * argument (kernels >= 6.13 fire it on failed retransmits too). */
const volatile bool retransmit_has_err = false;

static __always_inline __u32 classify(const struct sock *sk)
{
	struct dst_key key = {};
	__u32 *cached, *idx, cls = DST_UNMATCHED;
	__u16 family = sk->__sk_common.skc_family;

	cached = bpf_sk_storage_get(&sock_dst, (void *)sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (cached && *cached)
		return *cached - 1;

	if (family == AF_INET) {
		__u32 a = sk->__sk_common.skc_daddr;

		key.prefixlen = 128;
		key.addr[10] = 0xff;
		key.addr[11] = 0xff;
		__builtin_memcpy(&key.addr[12], &a, 4);
	} else if (family == AF_INET6) {
		key.prefixlen = 128;
		__builtin_memcpy(key.addr, &sk->__sk_common.skc_v6_daddr, 16);
	} else {
		return DST_UNMATCHED;
	}
	idx = bpf_map_lookup_elem(&dst_cidrs, &key);
	if (idx && *idx < DST_UNMATCHED)
		cls = *idx;
	if (cached)
		*cached = cls + 1;
	return cls;
}

static __always_inline struct tcp_cgroup *owner_stats(const struct sock *sk)
{
	struct cgroup *cg = sock_cgroup(sk);

	if (!cg)
		return 0;
	return bpf_cgrp_storage_get(&tcp_stats, cg, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
}

SEC("tp_btf/tcp_probe")
int BPF_PROG(tcp_probe, struct sock *sk, const struct sk_buff *skb)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	struct tcp_cgroup *st;
	__u32 srtt, cls;

	if (!tp)
		return 0;
	srtt = tp->srtt_us; /* microseconds << 3 */
	if (!srtt)
		return 0;
	st = owner_stats(sk);
	if (!st)
		return 0;
	cls = classify(sk);
	if (cls >= TCP_MAX_DST)
		return 0;
	hist_record(&st->rtt[cls], (__u64)srtt * 125); /* (us << 3) * 1000 / 8 = ns */
	return 0;
}

SEC("tp_btf/tcp_retransmit_skb")
int BPF_PROG(tcp_retransmit_skb, const struct sock *sk, const struct sk_buff *skb)
{
	struct tcp_cgroup *st;
	__u32 cls;
	__u16 segs;

	if (retransmit_has_err && ctx[2] != 0)
		return 0; /* the retransmit failed; the kernel does not count it */
	/* tcp_skb_pcount(): TCP_SKB_CB(skb)->tcp_gso_segs, what TcpRetransSegs adds */
	segs = ((struct tcp_skb_cb *)skb->cb)->tcp_gso_segs;
	if (segs == 0)
		segs = 1;
	st = owner_stats(sk);
	if (!st)
		return 0;
	cls = classify(sk);
	if (cls >= TCP_MAX_DST)
		return 0;
	__sync_fetch_and_add(&st->retrans_segs[cls], segs);
	return 0;
}
