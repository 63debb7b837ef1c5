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

#endif
