/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0 */
/*
 * Limits and request classes of the gpu_driver probe, shared with Rust: build.rs writes
 * every `#define NAME <number>` of this file as `pub const NAME: usize` (OUT_DIR/
 * gpu_driver.consts.rs, included by src/probes/gpu_driver.rs), so each is defined here only.
 */
#ifndef GPUFEED_GPU_DRIVER_H
#define GPUFEED_GPU_DRIVER_H

/* GPU fds tracked per process: fds >= this are counted in stats[2] and not
 * timed (device files are opened early, so they have small numbers). */
#define GPU_FD_BITS 8192

/* Path prefixes that name GPU device files: how many, and each one's room
 * (its bytes and a NUL). */
#define MAX_PREFIXES 4
#define PREFIX_LEN 64

/* Request classes (the `cmd` label; Rust names them in CMD_CLASSES). */
#define CMD_OTHER 0
#define CMD_RM_CONTROL 1
#define CMD_RM_ALLOC 2
#define CMD_RM_FREE 3
#define CMD_RM_MAP 4
#define CMD_RM_UNMAP 5
#define CMD_RM_VID_HEAP 6
#define CMD_UVM 7
#define CMD_SLOTS 8

/* Per-CPU counters (gpu_stats) the agent exports as self-metrics. */
#define STAT_NO_STORAGE 0	/* cgroup storage unavailable */
#define STAT_FD_LEARNED 1	/* GPU fds learned at open */
#define STAT_FD_UNTRACKED 2	/* fds >= GPU_FD_BITS: not tracked */
#define STAT_CGROUP_MOVED 3	/* calls that left a cgroup other than the one they entered in */
#define STATS 4

#endif
