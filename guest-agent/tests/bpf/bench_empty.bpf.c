// SPDX-License-Identifier: GPL-2.0 OR Apache-2.0
/*
 * Empty programs on the scheduler hooks: the floor that benchmarks compare the
 * real probes against (dispatch cost of a tp_btf program). Not loaded by the agent.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

char LICENSE[] SEC("license") = "Dual BSD/GPL";

SEC("tp_btf/sched_wakeup")
int BPF_PROG(empty_wakeup, struct task_struct *p)
{
	return 0;
}

SEC("tp_btf/sched_wakeup_new")
int BPF_PROG(empty_wakeup_new, struct task_struct *p)
{
	return 0;
}

SEC("tp_btf/sched_switch")
int BPF_PROG(empty_switch, bool preempt, struct task_struct *prev, struct task_struct *next)
{
	return 0;
}

/* The floor for the tc benchmark: a tc program that only says "next". */
SEC("tc")
int empty_tc(struct __sk_buff *skb)
{
	return -1; /* TCX_NEXT / TC_ACT_UNSPEC */
}
