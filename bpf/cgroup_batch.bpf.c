// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * Whether this kernel runs the batch reads of cgroup_batch.h: the agent loads
 * this object once at start and runs its program on one cgroup. When that
 * fails (a kernel without the generic kfuncs in syscall programs), the probe
 * units leave their batch programs out and read cgroup by cgroup.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "cgroup_batch.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

struct batch_check_value {
	__u64 x;
};

struct {
	__uint(type, BPF_MAP_TYPE_CGRP_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct batch_check_value);
} batch_check SEC(".maps");

CGROUP_BATCH(batch_check, struct batch_check_value, 1)
