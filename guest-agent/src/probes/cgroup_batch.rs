//! Userspace half of `bpf/cgroup_batch.h`: many cgroups' storage values read
//! with one syscall, through a slot array shared with the kernel.
//!
//! A unit keyed by cgroup storage adds `CGROUP_BATCH(storage, ...)` to its C
//! file, leaves the program out when [`supported`] says the kernel cannot run
//! it, and otherwise reads its active cgroups with [`BatchRead::read`]
//! instead of one `lookup_cgroup` each.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::OnceLock;

use libbpf_rs::skel::SkelBuilder;
use libbpf_rs::{MapCore, MapFlags, MapHandle};

use super::model::Delta;
use crate::ebpf::cgroup_maps::Mapped;
use crate::ebpf::{err, ProbeError};

mod skel {
    include!(concat!(env!("OUT_DIR"), "/cgroup_batch.skel.rs"));
}

/// Whether this kernel loads and runs the batch program, and it sees the
/// agent's cgroups: checked once, by loading `bpf/cgroup_batch.bpf.c`, giving
/// the root of the cgroup2 mount a value through its directory and reading
/// it back by id. Kernels whose `cgroup_get_from_id` finds a cgroup only
/// inside the caller's cgroup namespace fail this for an agent in a
/// container's own namespace (reading the node's hierarchy through a mount
/// of it), which then reads cgroup by cgroup.
pub fn supported() -> bool {
    if CHOSEN.get() == Some(&Reads::Each) {
        return false;
    }
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| match check() {
        Ok(()) => true,
        Err(e) => {
            tracing::info!(error = %e, "batch reads of cgroup storage unavailable; reading cgroup by cgroup");
            false
        }
    })
}

/// `--cgroup-reads`: how a tick reads the active cgroups' storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Reads {
    /// Batch reads where the kernel allows them, else one lookup per cgroup.
    Auto,
    /// One lookup per cgroup through its directory.
    Each,
}

static CHOSEN: OnceLock<Reads> = OnceLock::new();

/// Sets `--cgroup-reads` before any unit loads (later calls change nothing).
pub fn choose(reads: Reads) {
    let _ = CHOSEN.set(reads);
    if reads == Reads::Each {
        tracing::info!("reading cgroup by cgroup (--cgroup-reads each)");
    }
}

fn check() -> Result<(), ProbeError> {
    const NAME: &str = "cgroup_batch";
    let io = |what: &'static str| {
        move |source| ProbeError::Io {
            probe: NAME,
            what,
            source,
        }
    };
    let root = crate::cgroups::cgroup2_mount().map_err(io("finding the cgroup2 mount"))?;
    let dir = std::fs::File::open(&root).map_err(io("opening the cgroup2 root"))?;
    let id = dir
        .metadata()
        .map_err(io("reading the cgroup2 root"))?
        .ino();
    let mut storage = std::mem::MaybeUninit::uninit();
    let open = skel::CgroupBatchSkelBuilder::default()
        .open(&mut storage)
        .map_err(err(NAME, "open"))?;
    let skel = crate::ebpf::object::load(NAME, open)?;
    const MARK: u64 = 0x6770_7566_6565_6401;
    skel.maps
        .batch_check
        .update(
            &dir.as_raw_fd().to_ne_bytes(),
            &MARK.to_ne_bytes(),
            MapFlags::ANY,
        )
        .map_err(err(NAME, "giving the cgroup2 root a value"))?;
    let mut batch = BatchRead::new(
        NAME,
        &skel.progs.batch_check_batch_read,
        &skel.maps.batch_check_batch,
        8,
    )?;
    let mut found = Vec::new();
    batch
        .read(&[id], |id, v| found.push((id, v.to_vec())))
        .map_err(io("running the batch read"))?;
    if found != [(id, MARK.to_ne_bytes().to_vec())] {
        return Err(ProbeError::Io {
            probe: NAME,
            what: "reading the cgroup2 root by id",
            source: std::io::Error::other(format!(
                "{} (id {id}) not found: outside this process's cgroup namespace?",
                root.display()
            )),
        });
    }
    Ok(())
}

/// Slot header before each value: `id`, `found` (see `cgroup_batch.h`).
const HEADER: usize = 16;

/// A unit's batch program and its slot array, mapped into this process.
pub struct BatchRead {
    prog: OwnedFd,
    slots_mem: Mapped,
    /// bytes from one slot to the next (the array's value size, 8-aligned)
    stride: usize,
    slots: usize,
    value_size: usize,
}

impl BatchRead {
    /// Takes the loaded batch program and its slot array; `value_size` is the
    /// size of the storage value (the slot holds a 16-byte header before it).
    pub fn new<P: AsFd, M: AsFd>(
        probe: &'static str,
        prog: &P,
        map: &M,
        value_size: usize,
    ) -> Result<BatchRead, ProbeError>
    where
        for<'a> MapHandle: TryFrom<&'a M, Error = libbpf_rs::Error>,
    {
        let io = |what: &'static str| {
            move |source| ProbeError::Io {
                probe,
                what,
                source,
            }
        };
        let prog = prog
            .as_fd()
            .try_clone_to_owned()
            .map_err(io("taking the batch program"))?;
        let map = MapHandle::try_from(map).map_err(err(probe, "taking the batch map"))?;
        let info = map.info().map_err(err(probe, "reading the batch map"))?;
        let (slot_size, slots) = (
            info.info.value_size as usize,
            info.info.max_entries as usize,
        );
        if slot_size != HEADER + value_size {
            return Err(ProbeError::Io {
                probe,
                what: "checking the batch slots",
                source: std::io::Error::other(format!(
                    "slot of {slot_size} bytes for a {value_size}-byte value"
                )),
            });
        }
        Ok(BatchRead {
            prog,
            slots_mem: Mapped::new(probe, "mapping the batch slots", map)?,
            stride: slot_size.next_multiple_of(8),
            slots,
            value_size,
        })
    }

    /// Reads the storage value of each cgroup in `ids` and calls `found(id,
    /// value bytes)` for those that have one; one BPF_PROG_RUN per `slots`
    /// ids. An id whose cgroup is gone, or has no value, is skipped.
    pub fn read(&mut self, ids: &[u64], mut found: impl FnMut(u64, &[u8])) -> std::io::Result<()> {
        let base = self.slots_mem.as_ptr();
        for chunk in ids.chunks(self.slots) {
            for (i, id) in chunk.iter().enumerate() {
                // SAFETY: i < slots, so the slot's first 8 bytes lie in the mapping.
                unsafe { base.add(i * self.stride).cast::<u64>().write_volatile(*id) };
            }
            self.run(chunk.len() as u32)?;
            for (i, &id) in chunk.iter().enumerate() {
                // SAFETY: as above; the kernel wrote the slot before the run returned.
                let slot = unsafe { base.add(i * self.stride) };
                let hit = unsafe { slot.add(8).cast::<u64>().read_volatile() };
                if hit != 1 {
                    continue;
                }
                // SAFETY: the value follows the header inside the slot.
                let value =
                    unsafe { std::slice::from_raw_parts(slot.add(HEADER), self.value_size) };
                found(id, value);
            }
        }
        Ok(())
    }

    /// [`BatchRead::read`] for a unit's tick: `each(id, value bytes, deltas)`
    /// turns a value into deltas, pushed to `out` with their cgroup id. A
    /// failed run is logged, and what it missed is read next time (the
    /// storage keeps counting).
    pub fn deltas(
        &mut self,
        probe: &'static str,
        ids: &[u64],
        mut each: impl FnMut(u64, &[u8], &mut Vec<Delta>),
        out: &mut Vec<(u64, Delta)>,
    ) {
        let mut deltas = Vec::new();
        let read = self.read(ids, |id, bytes| {
            each(id, bytes, &mut deltas);
            out.extend(deltas.drain(..).map(|d| (id, d)));
        });
        if let Err(e) = read {
            tracing::debug!(probe, error = %e, "batch read of cgroup storage");
        }
    }

    /// One BPF_PROG_RUN of the batch program over the first `n` slots.
    fn run(&self, n: u32) -> std::io::Result<()> {
        let mut args = n.to_ne_bytes();
        let mut opts = libbpf_sys::bpf_test_run_opts {
            sz: std::mem::size_of::<libbpf_sys::bpf_test_run_opts>() as _,
            ctx_in: args.as_mut_ptr().cast(),
            ctx_size_in: args.len() as u32,
            ..Default::default()
        };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        // SAFETY: `opts` points at `args`, which outlives the call.
        let rc = unsafe { libbpf_sys::bpf_prog_test_run_opts(self.prog.as_raw_fd(), &mut opts) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(-rc));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cgroup given a value through its directory (as programs would) is
    /// read back by id with the same bytes; one without a value, and one
    /// removed, are not found; more ids than slots take several runs.
    #[test]
    fn batch_reads_match_the_values_each_cgroup_holds() {
        if unsafe { libc::geteuid() } != 0 && std::env::var_os("CI").is_none() {
            eprintln!("needs root (loads BPF, creates cgroups); skipped");
            return;
        }
        assert!(
            supported(),
            "this kernel does not run the batch program (needs the generic kfuncs in syscall programs)"
        );
        let mount = crate::cgroups::cgroup2_mount().expect("a cgroup2 mount");
        let root = mount.join(format!("gpufeed-batch-test-{}", std::process::id()));
        struct Gone(std::path::PathBuf);
        impl Drop for Gone {
            fn drop(&mut self) {
                for i in 0..3 {
                    let _ = std::fs::remove_dir(self.0.join(format!("c{i}")));
                }
                let _ = std::fs::remove_dir(&self.0);
            }
        }
        std::fs::create_dir(&root).unwrap();
        let _gone = Gone(root.clone());
        let mut storage = std::mem::MaybeUninit::uninit();
        let open = skel::CgroupBatchSkelBuilder::default()
            .open(&mut storage)
            .unwrap();
        let skel = crate::ebpf::object::load("sched_latency", open).unwrap();
        let values = MapHandle::try_from(&skel.maps.batch_check).unwrap();
        let mut ids = Vec::new();
        for i in 0..3u64 {
            let dir = root.join(format!("c{i}"));
            std::fs::create_dir(&dir).unwrap();
            ids.push(std::fs::metadata(&dir).unwrap().ino());
            if i < 2 {
                let f = std::fs::File::open(&dir).unwrap();
                let key = f.as_raw_fd().to_ne_bytes();
                let v = (1000 + i).to_ne_bytes();
                values.update(&key, &v, MapFlags::ANY).unwrap();
            }
        }
        // c0 and c1 hold 1000 and 1001, c2 nothing; then c1 goes
        let mut batch = BatchRead::new(
            "test",
            &skel.progs.batch_check_batch_read,
            &skel.maps.batch_check_batch,
            8,
        )
        .unwrap();
        let mut got = Vec::new();
        let wanted = [ids[0], ids[1], ids[2], ids[0]];
        batch
            .read(&wanted, |id, v| {
                got.push((id, u64::from_ne_bytes(v.try_into().unwrap())))
            })
            .unwrap();
        assert_eq!(
            got,
            [(ids[0], 1000), (ids[1], 1001), (ids[0], 1000)],
            "one slot: four runs"
        );
        std::fs::remove_dir(root.join("c1")).unwrap();
        got.clear();
        batch
            .read(&ids, |id, v| {
                got.push((id, u64::from_ne_bytes(v.try_into().unwrap())))
            })
            .unwrap();
        assert_eq!(got, [(ids[0], 1000)], "a removed cgroup is not found");
    }
}
