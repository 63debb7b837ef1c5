/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0 */
/*
 * The cuda probe's counters, shared with Rust: build.rs writes every `#define NAME <number>`
 * of this file as `pub const NAME: usize` (OUT_DIR/cuda.consts.rs, included by
 * src/probes/cuda.rs).
 */
#ifndef GPUFEED_CUDA_H
#define GPUFEED_CUDA_H

/* Per-CPU counters (cuda_stats) the agent exports as self-metrics. */
#define STAT_NO_STORAGE 0	/* cgroup storage unavailable */
#define STAT_OBJECTS_FULL 1	/* the object map, or the range map, was full */
#define STAT_UNKNOWN_FREE 2	/* frees of pointers or handles allocated before the probe */
#define STAT_UNTRACKED_LAUNCH 3	/* launches whose stream could not be tracked */
#define STATS 4

#endif
