/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0 */
/*
 * Latency histogram shared by all probes: log2 buckets over nanoseconds.
 *
 * Bucket i (0 <= i < HIST_BUCKETS) counts values v with v < 2^(HIST_MIN_SHIFT + i) ns
 * that did not fit bucket i-1, i.e. bucket 0 holds v < 1024 ns (~1 us) and
 * bucket HIST_BUCKETS-1 holds v < 2^34 ns (~17 s). Anything larger goes to the
 * overflow slot. Userspace turns them into cumulative Prometheus buckets with
 * le = 2^(HIST_MIN_SHIFT + i) / 1000 microseconds; the exact sum in ns is kept
 * so that rate(sum)/rate(count) is exact, not bucket-quantised.
 *
 * Userspace decodes the map values through the skeleton's generated
 * `types::hist` (guest-agent/src/probes/hist.rs); its constants are asserted
 * against that type, and its tests check the bucket indexing below.
 */
#ifndef GPUFEED_HIST_H
#define GPUFEED_HIST_H

#define HIST_MIN_SHIFT 10
#define HIST_BUCKETS 25 /* 2^10 .. 2^34 ns */

struct hist {
	__u64 buckets[HIST_BUCKETS + 1]; /* last slot: overflow (+Inf only) */
	__u64 sum_ns;
	/* no count: it is the sum of the buckets, which saves one locked add per event */
};

/* Index of the most significant set bit, branch-light (no loops for the verifier). */
static __always_inline __u32 log2_u64(__u64 v)
{
	__u32 r = 0, shift;

	shift = (v > 0xFFFFFFFFULL) << 5; v >>= shift; r |= shift;
	shift = (v > 0xFFFF) << 4; v >>= shift; r |= shift;
	shift = (v > 0xFF) << 3; v >>= shift; r |= shift;
	shift = (v > 0xF) << 2; v >>= shift; r |= shift;
	shift = (v > 0x3) << 1; v >>= shift; r |= shift;
	r |= (v >> 1);
	return r;
}

static __always_inline __u32 hist_index(__u64 ns)
{
	__u32 idx;

	if (ns < (1ULL << HIST_MIN_SHIFT))
		return 0;
	/* ns in [2^k, 2^(k+1)) belongs under le = 2^(k+1): index k+1-MIN_SHIFT */
	idx = log2_u64(ns) + 1 - HIST_MIN_SHIFT;
	if (idx > HIST_BUCKETS)
		idx = HIST_BUCKETS;
	return idx;
}

/* `n` observations of `ns` at once: a weighted sample (tcp.bpf.c weighs each RTT sample by the
 * socket's busy time). The count is still the sum of the buckets. */
static __always_inline void hist_record_n(struct hist *h, __u64 ns, __u64 n)
{
	__u32 idx = hist_index(ns);

	/* idx is bounded above; the explicit mask keeps older verifiers convinced */
	if (idx > HIST_BUCKETS)
		return;
	__sync_fetch_and_add(&h->buckets[idx], n);
	__sync_fetch_and_add(&h->sum_ns, ns * n);
}

static __always_inline void hist_record(struct hist *h, __u64 ns)
{
	hist_record_n(h, ns, 1);
}

#endif
