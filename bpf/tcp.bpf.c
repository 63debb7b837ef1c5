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
 * cached in socket-local storage.
 *
 * RTT: at most one sample per socket per agent tick (rtt_every_ns), taken at
 * its first received segment after the tick's time has passed since its last
 * sample, weighted by the socket's busy time since that sample: one
 * observation per millisecond with data queued or in flight (the kernel's own
 * chronograph, `ss -ti`'s busy:), at least one. The sample's value is the
 * socket's smoothed RTT integrated over the time since the previous sample:
 * each segment holds the srtt it found until the next one, over the gaps
 * shorter than two srtt (a sender hears an ACK at least once a round trip;
 * a longer gap is idle time), and the sample is that integral over the time
 * it covers (the srtt now when it covers none: an idle socket). A pod's mean
 * RTT is then the time average of its connections' srtt over the time they
 * carried traffic: a busy upload weighs its whole duration, an idle control
 * or keepalive connection next to nothing, yet a pod with only idle
 * connections still has RTT. (The srtt at the sampling segment alone read
 * BBR's cycling queue at 0.44-0.72 of ss's time average with a 1 s tick; one
 * sample per socket and tick, unweighted, made an idle socket weigh as much
 * as the busy one; one per segment over-weighted the ACK-dense phases such
 * as slow start.) A segment that brings neither a sample nor a retransmit
 * costs one socket-storage lookup, a compare and three stores.
 *
 * Retransmits are not counted per tracepoint hit: the tracepoint does not see
 * every segment the kernel adds to TcpRetransSegs. Instead each hook that
 * touches a socket brings the socket's own counter (tcp_sock.total_retrans,
 * incremented on the same line as TcpRetransSegs) up to date in the owner's
 * cgroup: on retransmit, on every received segment, and when the socket is
 * destroyed. SYN-ACK retransmits of a listener are counted per hit.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "hist.h"
#include "cgroup.h"
#include "cgroup_active.h"
#include "cgroup_storage.h"
#include "cgroup_drain.h"
#include "cgroup_batch.h"
#include "counters.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

#define AF_INET 2
#define AF_INET6 10
#define TCP_MAX_DST 16  /* userspace's dst::MAX_DST; probes/tcp.rs fails to compile if they differ */
#define DST_UNMATCHED (TCP_MAX_DST - 1)

struct dst_key {
	__u32 prefixlen;
	__u8 addr[16]; /* IPv4 as v4-mapped IPv6 */
};

/* sized by userspace before load: exactly the prefixes --dst names */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 256);
	__type(key, struct dst_key);
	__type(value, __u32); /* dst class index < DST_UNMATCHED */
} dst_cidrs SEC(".maps");

struct sock_state {
	__u32 dst_plus1;	  /* dst class index + 1 */
	__u32 total_retrans_seen; /* tcp_sock.total_retrans already counted */
	__u64 rtt_at;		  /* CLOCK_MONOTONIC ns of the socket's last RTT sample, 0 = none */
	__u32 rtt_at_jiffies;	  /* jiffies (low 32 bits) at that sample */
	__u32 busy_seen;	  /* the socket's busy time at that sample, jiffies */
	__u64 seg_at;		  /* CLOCK_MONOTONIC ns of the socket's last segment, 0 = none */
	__u64 srtt_area;	  /* srtt (us << 3) x time (ns >> 10) since the last sample */
	__u32 area_time;	  /* the time that covers, ns >> 10 (~us) */
	__u32 seg_srtt;		  /* srtt (us << 3) at the last segment */
};

/* Set by userspace before load: the agent's tick. A socket gives at most one
 * RTT sample per tick, weighted by its busy time since the previous one (see
 * the top of the file). */
const volatile __u64 rtt_every_ns = 0;

struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct sock_state);
} sock_state SEC(".maps");

struct tcp_cgroup {
	struct hist rtt[TCP_MAX_DST];
	__u64 retrans_segs[TCP_MAX_DST];
	__u64 epoch; /* see cgroup_active.h */
};

CGROUP_STORAGE(tcp_stats, struct tcp_cgroup)

CGROUP_DRAIN(tcp_stats, struct tcp_cgroup)
/* a tick reads its active cgroups 64 at a time (a value is 3.6 KiB) */
CGROUP_BATCH(tcp_stats, struct tcp_cgroup, 64)

/* [0] events lost because cgroup storage was unavailable (allocation failed or
 * the per-CPU storage lock was busy, e.g. a softirq interrupting a probe). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} tcp_lost SEC(".maps");

static __always_inline void count_lost(void)
{
	slot_add(&tcp_lost, 0, 1);
}

static __always_inline __u32 classify_addr(const struct sock_common *c)
{
	struct dst_key key = {};
	__u32 *idx;
	__u16 family = c->skc_family;

	if (family == AF_INET) {
		__u32 a = c->skc_daddr;

		key.prefixlen = 128;
		key.addr[10] = 0xff;
		key.addr[11] = 0xff;
		__builtin_memcpy(&key.addr[12], &a, 4);
	} else if (family == AF_INET6) {
		key.prefixlen = 128;
		__builtin_memcpy(key.addr, &c->skc_v6_daddr, 16);
	} else {
		return DST_UNMATCHED;
	}
	idx = bpf_map_lookup_elem(&dst_cidrs, &key);
	if (idx && *idx < DST_UNMATCHED)
		return *idx;
	return DST_UNMATCHED;
}

/* Per-socket state, created at first sight with the destination class and the
 * socket's retransmit counter as the baseline (minus `pending`, retransmitted
 * segments the current hook is about to account). */
static __always_inline struct sock_state *sock_state_of(const struct sock *sk, struct tcp_sock *tp,
							__u32 pending)
{
	struct sock_state *ss;

	ss = bpf_sk_storage_get(&sock_state, (void *)sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
	if (ss && !ss->dst_plus1) {
		ss->dst_plus1 = classify_addr(&sk->__sk_common) + 1;
		ss->total_retrans_seen = tp->total_retrans - pending;
	}
	return ss;
}

static __always_inline __u32 dst_of(struct sock_state *ss)
{
	__u32 cls = ss->dst_plus1 - 1;

	return cls < TCP_MAX_DST ? cls : DST_UNMATCHED;
}

static __always_inline struct tcp_cgroup *owner_stats(const struct sock *sk)
{
	struct cgroup *cg = sock_cgroup(sk);

	struct tcp_cgroup *st;

	if (!cg)
		return 0;
	st = tcp_stats_get(cg, true);
	if (!st)
		count_lost();
	else
		mark_active(cg, &st->epoch);
	return st;
}

/* The socket's busy time in jiffies as tcp_info's tcpi_busy_time counts it: the
 * three chronographs (busy, receive-window limited, send-buffer limited), each
 * running while data is queued or unacknowledged, plus the one running now.
 * Jiffies wrap: only differences of it are used. */
static __always_inline __u32 busy_jiffies(struct tcp_sock *tp, __u32 now_jiffies)
{
	__u32 busy = tp->chrono_stat[0] + tp->chrono_stat[1] + tp->chrono_stat[2];

	/* a 2-bit bitfield on older kernels, a byte on newer ones */
	if (BPF_CORE_READ_BITFIELD(tp, chrono_type))
		busy += now_jiffies - tp->chrono_start;
	return busy;
}

/* Observations a sample stands for: the socket's busy milliseconds since its
 * previous sample, rounded, at least one (and one for the first sample: a
 * socket older than the agent brings no history). HZ is a build option BPF
 * cannot read, so jiffies become time by the ratio of the two clocks over the
 * same interval (the interval is a tick, at least 100 ms: tens of jiffies). */
static __always_inline __u64 busy_weight(const struct sock_state *ss, __u64 now, __u32 now_jiffies,
					 __u32 busy)
{
	__u32 elapsed = now_jiffies - ss->rtt_at_jiffies;
	__u32 busy_delta = busy - ss->busy_seen;
	__u64 ms;

	if (!ss->rtt_at || !elapsed || now <= ss->rtt_at)
		return 1;
	if (busy_delta > elapsed) /* chronograph and jiffies read a tick apart */
		busy_delta = elapsed;
	ms = ((now - ss->rtt_at) / elapsed * busy_delta + 500000) / 1000000;
	return ms ? ms : 1;
}

/* One RTT sample: the srtt integrated since the previous sample (the srtt now
 * when nothing was integrated), weighted by the busy time since then. */
static __always_inline void record_rtt(struct tcp_cgroup *st, struct sock_state *ss,
				       struct tcp_sock *tp, __u32 cls, __u64 now, __u32 srtt)
{
	__u32 now_jiffies = (__u32)bpf_jiffies64(); /* tcp_jiffies32 */
	__u32 busy = busy_jiffies(tp, now_jiffies);
	__u64 weight = busy_weight(ss, now, now_jiffies, busy);
	__u64 mean = ss->area_time ? ss->srtt_area / ss->area_time : srtt;

	ss->rtt_at = now;
	ss->rtt_at_jiffies = now_jiffies;
	ss->busy_seen = busy;
	ss->srtt_area = 0;
	ss->area_time = 0;
	/* (us << 3) * 1000 / 8 = ns */
	hist_record_n(&st->rtt[cls], mean * 125, weight);
}

/* Adds the retransmits the socket counted since we last looked. */
static __always_inline void sync_retrans(struct tcp_cgroup *st, struct sock_state *ss,
					 struct tcp_sock *tp, __u32 cls)
{
	__u32 now = tp->total_retrans;
	__u32 delta = now - ss->total_retrans_seen;

	if (delta) {
		ss->total_retrans_seen = now;
		__sync_fetch_and_add(&st->retrans_segs[cls], delta);
	}
}

SEC("tp_btf/tcp_probe")
int BPF_PROG(tcp_probe, struct sock *sk, const struct sk_buff *skb)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	struct tcp_cgroup *st;
	struct sock_state *ss;
	__u32 srtt, cls;
	__u64 now;
	bool sample;

	if (!tp)
		return 0;
	ss = sock_state_of(sk, tp, 0);
	if (!ss)
		return 0;
	/* One sample at the socket's first segment after a tick's time without
	 * one. Most segments only integrate and stop here, before the owner's
	 * storage is looked up. */
	srtt = tp->srtt_us; /* microseconds << 3 */
	/* The socket's own clock instead of a helper call per segment: tcp_mstamp
	 * (CLOCK_MONOTONIC in us) is refreshed by every receive and transmit of the
	 * socket, and tcp_rcv_established fires this tracepoint just before it
	 * refreshes it, so it reads the socket's previous activity: each gap ends
	 * one segment late, which moves no time between gaps, and a gap after an
	 * idle spell still reads as idle (the next segment's gap spans it). */
	now = tp->tcp_mstamp * 1000;
	if (!now)
		now = bpf_ktime_get_ns();
	/* the srtt the previous segment found held until this one: integrated when
	 * the gap is shorter than two srtt (<< 3 >> 2), else the socket was idle */
	{
		__u64 gap = (now - ss->seg_at) >> 10;

		if (ss->seg_at && gap <= ss->seg_srtt >> 2) {
			ss->srtt_area += (__u64)ss->seg_srtt * gap;
			ss->area_time += (__u32)gap;
		}
		ss->seg_at = now;
		ss->seg_srtt = srtt;
	}
	sample = srtt && (!ss->rtt_at || now - ss->rtt_at >= rtt_every_ns);
	if (!sample && tp->total_retrans == ss->total_retrans_seen)
		return 0;
	st = owner_stats(sk);
	if (!st)
		return 0;
	cls = dst_of(ss);
	if (sample)
		record_rtt(st, ss, tp, cls, now, srtt);
	sync_retrans(st, ss, tp, cls);
	return 0;
}

static __always_inline void account_retrans(const struct sock *sk, __u32 pending)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock((void *)sk);
	struct tcp_cgroup *st;
	struct sock_state *ss;

	if (!tp)
		return;
	st = owner_stats(sk);
	ss = sock_state_of(sk, tp, pending);
	if (!st || !ss)
		return;
	sync_retrans(st, ss, tp, dst_of(ss));
}

SEC("tp_btf/tcp_retransmit_skb")
int BPF_PROG(tcp_retransmit_skb, const struct sock *sk, const struct sk_buff *skb)
{
	/* first sight of a socket in a retransmit: this hit's segments are new */
	account_retrans(sk, ((struct tcp_skb_cb *)skb->cb)->tcp_gso_segs);
	return 0;
}

SEC("tp_btf/tcp_destroy_sock")
int BPF_PROG(tcp_destroy_sock, struct sock *sk)
{
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	struct tcp_cgroup *st;
	struct sock_state *ss;

	if (!tp)
		return 0;
	st = owner_stats(sk);
	ss = sock_state_of(sk, tp, 0);
	if (!st || !ss)
		return 0;
	/* the socket's last interval: what it integrated since its last sample
	 * (a socket that closes before the next tick would otherwise lose it) */
	if (ss->area_time && tp->srtt_us)
		record_rtt(st, ss, tp, dst_of(ss), bpf_ktime_get_ns(), tp->srtt_us);
	sync_retrans(st, ss, tp, dst_of(ss));
	return 0;
}

/* A listener's SYN-ACK retransmit: counted in TcpRetransSegs, but the request
 * socket has no tcp_sock counter; the listener's owner gets it. */
SEC("tp_btf/tcp_retransmit_synack")
int BPF_PROG(tcp_retransmit_synack, const struct sock *sk, const struct request_sock *req)
{
	struct tcp_cgroup *st = owner_stats(sk);
	__u32 cls = classify_addr(&req->__req_common);

	if (st && cls < TCP_MAX_DST)
		__sync_fetch_and_add(&st->retrans_segs[cls], 1);
	return 0;
}
