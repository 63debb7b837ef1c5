/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0 */
/*
 * Slots of u64 array maps that the agent reads as counters and flags.
 * Inlined, so that each call site hands bpf_map_lookup_elem its map as the
 * constant the verifier needs, and the index as a stack slot of the caller.
 */
#ifndef GPUFEED_COUNTERS_H
#define GPUFEED_COUNTERS_H

/* Slot `i` of a per-CPU array grows by `n` (no other CPU writes it). */
static __always_inline void slot_add(void *map, __u32 i, __u64 n)
{
	__u64 *v = bpf_map_lookup_elem(map, &i);

	if (v)
		*v += n;
}

/* Slot `i` of an array every CPU writes grows by `n`. */
static __always_inline void slot_add_shared(void *map, __u32 i, __u64 n)
{
	__u64 *v = bpf_map_lookup_elem(map, &i);

	if (v)
		__sync_fetch_and_add(v, n);
}

/* Slot `i` becomes `val`: a flag that the agent clears once it has looked. */
static __always_inline void slot_set(void *map, __u32 i, __u64 val)
{
	__u64 *v = bpf_map_lookup_elem(map, &i);

	if (v)
		*v = val;
}

/* A program's self-metric counters: a per-CPU array `map` of `slots` u64 counters that the
 * agent sums over CPUs and exports, and `bump(i)`, which adds one to counter i (its STAT_*
 * index). One per program object: each declares its own map name and STAT_* list. */
#define PROBE_STATS(map, slots)                                                         \
	struct {                                                                        \
		__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);                                \
		__uint(max_entries, slots);                                             \
		__type(key, __u32);                                                     \
		__type(value, __u64);                                                   \
	} map SEC(".maps");                                                             \
                                                                                        \
	static __always_inline void bump(__u32 i)                                       \
	{                                                                               \
		slot_add(&map, i, 1);                                                   \
	}

#endif
