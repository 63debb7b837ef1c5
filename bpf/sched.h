/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0 */
/*
 * The sched probe's counters, shared with Rust: build.rs writes every `#define NAME <number>`
 * of this file as `pub const NAME: usize` (OUT_DIR/sched.consts.rs, included by
 * src/probes/sched.rs).
 */
#ifndef GPUFEED_SCHED_H
#define GPUFEED_SCHED_H

/* Per-CPU counters (sched_stats) the agent exports as self-metrics. */
#define STAT_NEGATIVE_DELTA 0	/* negative deltas (cross-CPU clock skew), dropped */
#define STAT_NO_STORAGE 1	/* cgroup or task storage allocation failures */
#define STATS 2

#endif
