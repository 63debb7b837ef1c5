//! CUDA MPS: NVML's per-process utilisation belongs to the MPS server, which runs every
//! client's kernels; the clients' own samples stay empty. So the server's SM time is split
//! among the clients on its GPU by their own GPU activity in the same tick (time in the GPU
//! driver and CUDA launch-to-completion busy time, from the `gpu_driver` and `cuda` probes),
//! and equally when none of them shows any: never all to the server, never 0 to a client.
//! The split is exact in sum (every server nanosecond goes to a client); its error is in the
//! weights: activity that the probes see is a proxy for SM work (a client that launches few
//! long kernels is under-weighted against one polling the driver).

/// Whether `comm` (`/proc/<pid>/comm`, truncated to 15 bytes by the kernel) is the MPS
/// server's: `nvidia-cuda-mps-server` reads `nvidia-cuda-mps`. The control daemon shares
/// the prefix but never runs on a GPU, so it is not among NVML's processes.
pub fn is_server_comm(comm: &str) -> bool {
    comm.trim_end() == "nvidia-cuda-mps"
}

/// Whether process `pid` is an MPS server (its comm as the agent reads it, in the host's PID
/// namespace).
pub fn is_server(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| is_server_comm(&c))
}

/// `total` split by `weights` (equally when they are all 0), summing to `total` exactly: the
/// remainder of the integer division goes to the first entries.
pub fn shares<K: Clone>(total: u64, weights: &[(K, u64)]) -> Vec<(K, u64)> {
    if weights.is_empty() {
        return Vec::new();
    }
    let sum: u128 = weights.iter().map(|(_, w)| u128::from(*w)).sum();
    let mut out: Vec<(K, u64)> = weights
        .iter()
        .map(|(k, w)| {
            // no activity anywhere: equal shares
            let share = (u128::from(total) * u128::from(*w))
                .checked_div(sum)
                .unwrap_or(u128::from(total) / weights.len() as u128);
            (k.clone(), share as u64)
        })
        .collect();
    let given: u64 = out.iter().map(|(_, n)| n).sum();
    let mut left = total - given;
    for (_, n) in out.iter_mut() {
        if left == 0 {
            break;
        }
        *n += 1;
        left -= 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_follow_the_weights_and_sum_exactly() {
        assert_eq!(shares(90, &[("a", 2), ("b", 1)]), [("a", 60), ("b", 30)]);
        assert_eq!(
            shares(10, &[("a", 1), ("b", 1), ("c", 1)]),
            [("a", 4), ("b", 3), ("c", 3)]
        );
        // no activity: equally, never 0 to a client
        assert_eq!(shares(9, &[("a", 0), ("b", 0)]), [("a", 5), ("b", 4)]);
        assert!(shares::<&str>(9, &[]).is_empty());
        assert_eq!(
            shares(u64::MAX, &[("a", u64::MAX), ("b", u64::MAX)])[0].1,
            u64::MAX / 2 + 1
        );
        assert!(is_server_comm("nvidia-cuda-mps\n"));
        assert!(!is_server_comm("python3\n"));
    }
}
