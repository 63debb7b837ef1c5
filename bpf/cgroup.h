/* SPDX-License-Identifier: GPL-2.0 OR Apache-2.0 */
/*
 * cgroup helpers. Everything here walks typed BTF pointers (no bpf_probe_read),
 * so the programs that use them also load under lockdown=confidentiality.
 */
#ifndef GPUFEED_CGROUP_H
#define GPUFEED_CGROUP_H

/* cgroup v2 (default hierarchy) cgroup of a task. Valid under the RCU read lock
 * that tp_btf programs run in. */
static __always_inline struct cgroup *task_dfl_cgroup(struct task_struct *t)
{
	return t->cgroups->dfl_cgrp;
}

/* Cgroup of the process that created the socket (accepted sockets inherit the
 * listener's). Correct in softirq context, unlike bpf_get_current_cgroup_id(). */
static __always_inline struct cgroup *sock_cgroup(const struct sock *sk)
{
	return sk->sk_cgrp_data.cgroup;
}

#endif
