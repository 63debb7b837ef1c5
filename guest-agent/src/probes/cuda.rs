//! CUDA driver API per cgroup by uprobes on `libcuda.so` (`bpf/cuda.bpf.c`):
//! device memory reserved, host↔device copy bytes, kernel launches.
//!
//! Each container brings its own copy of the library (or bind-mounts the
//! host's). [`CudaProbe::scan`] finds it in `/proc/<pid>/maps`, opens it
//! through `/proc/<pid>/root`, and attaches once per distinct file (device,
//! inode): a uprobe binds to the file, not to a process, so one attach covers
//! every process that maps it, now or later.

mod skel {
    include!(concat!(env!("OUT_DIR"), "/cuda.skel.rs"));
}

use std::collections::{HashMap, HashSet};
use std::mem::MaybeUninit;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapHandle, OpenObject, ProgramMut, UprobeOpts};

use super::{err, handle, lookup_cgroup, percpu_sum, ProbeError, ProbeStatus};

pub const NAME: &str = "cuda";

/// What to probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// Mapped files whose name starts with this are the driver library
    /// (maps shows the resolved name, e.g. `libcuda.so.550.54.15`).
    pub library_prefix: String,
    /// Count cuLaunchKernel (a uprobe on the hot launch path).
    pub launches: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            library_prefix: "libcuda.so".into(),
            launches: false,
        }
    }
}

/// One cgroup's CUDA numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CudaCgroup {
    /// Device memory its processes hold now (signed: memory allocated before
    /// the probe attached and freed after shows as a negative contribution).
    pub vram_bytes: i64,
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    pub launches: u64,
}

impl CudaCgroup {
    /// Decodes `struct cuda_cgroup`.
    pub fn from_bytes(b: &[u8]) -> Option<CudaCgroup> {
        let w = |i: usize| -> Option<u64> {
            Some(u64::from_ne_bytes(
                b.get(i * 8..i * 8 + 8)?.try_into().ok()?,
            ))
        };
        Some(CudaCgroup {
            vram_bytes: w(0)? as i64,
            h2d_bytes: w(1)?,
            d2h_bytes: w(2)?,
            launches: w(3)?,
        })
    }
}

/// Which program handles a symbol, and whether at entry or at return.
#[derive(Clone, Copy)]
enum Prog {
    Alloc,
    AllocManaged,
    AllocAsync,
    AllocPitch,
    Create,
    Import,
    AllocRet,
    Free,
    FreeAsync,
    Release,
    Map,
    Unmap,
    HtoD,
    DtoH,
    Launch,
}

/// The driver API functions probed: (symbol, entry program, whether its
/// out-parameters are read at return). Signatures are in bpf/cuda.bpf.c.
const SYMBOLS: &[(&str, Prog, bool)] = &[
    ("cuMemAlloc_v2", Prog::Alloc, true),
    ("cuMemAllocManaged", Prog::AllocManaged, true),
    ("cuMemAllocAsync", Prog::AllocAsync, true),
    ("cuMemAllocPitch_v2", Prog::AllocPitch, true),
    ("cuMemCreate", Prog::Create, true),
    ("cuMemImportFromShareableHandle", Prog::Import, true),
    ("cuMemFree_v2", Prog::Free, false),
    ("cuMemFreeAsync", Prog::FreeAsync, false),
    ("cuMemRelease", Prog::Release, false),
    ("cuMemMap", Prog::Map, false),
    ("cuMemUnmap", Prog::Unmap, false),
    ("cuMemcpyHtoD_v2", Prog::HtoD, false),
    ("cuMemcpyHtoDAsync_v2", Prog::HtoD, false),
    ("cuMemcpyDtoH_v2", Prog::DtoH, false),
    ("cuMemcpyDtoHAsync_v2", Prog::DtoH, false),
    ("cuLaunchKernel", Prog::Launch, false),
];

/// A mapped library as /proc/<pid>/maps names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MappedLib {
    /// (major, minor) of the filesystem and inode, from the maps line.
    pub dev: (u32, u32),
    pub inode: u64,
    /// The path as the process sees it.
    pub path: String,
}

/// Mapped files in /proc/<pid>/maps text whose name starts with `prefix`.
/// Lines: `start-end perms offset major:minor inode path`.
pub fn find_libs(maps: &str, prefix: &str) -> Vec<MappedLib> {
    let mut out: Vec<MappedLib> = Vec::new();
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(_), Some(_), Some(_), Some(dev), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let path = f.collect::<Vec<_>>().join(" ");
        let name = path.rsplit('/').next().unwrap_or("");
        if !path.starts_with('/') || !name.starts_with(prefix) || path.ends_with("(deleted)") {
            continue;
        }
        let Some((maj, min)) = dev.split_once(':') else {
            continue;
        };
        let (Ok(maj), Ok(min), Ok(inode)) = (
            u32::from_str_radix(maj, 16),
            u32::from_str_radix(min, 16),
            inode.parse::<u64>(),
        ) else {
            continue;
        };
        let lib = MappedLib {
            dev: (maj, min),
            inode,
            path,
        };
        if !out.contains(&lib) {
            out.push(lib);
        }
    }
    out
}

pub struct CudaProbe {
    // Programs must stay attachable after load, for libraries found later:
    // the skeleton is leaked once (one probe per agent).
    skel: &'static skel::CudaSkel<'static>,
    _exit: Link,
    cgroups: MapHandle,
    stats: MapHandle,
    opts: CudaOptions,
    /// Library files already attached, by (dev, inode), and their links.
    attached: HashMap<(u64, u64), Vec<Link>>,
    /// Processes whose maps held the library (not scanned again).
    done: HashSet<i32>,
}

impl CudaProbe {
    pub fn load(opts: CudaOptions) -> Result<Result<CudaProbe, ProbeStatus>, ProbeError> {
        let storage: &'static mut MaybeUninit<OpenObject> =
            Box::leak(Box::new(MaybeUninit::uninit()));
        let open = skel::CudaSkelBuilder::default()
            .open(storage)
            .map_err(err(NAME, "open"))?;
        let skel = open.load().map_err(err(NAME, "load"))?;
        let exit = skel
            .progs
            .cuda_exit
            .attach()
            .map_err(err(NAME, "attach sched_process_exit"))?;
        let skel: &'static skel::CudaSkel<'static> = Box::leak(Box::new(skel));
        Ok(Ok(CudaProbe {
            _exit: exit,
            cgroups: handle(NAME, &skel.maps.cuda_cgroup)?,
            stats: handle(NAME, &skel.maps.cuda_stats)?,
            skel,
            opts,
            attached: HashMap::new(),
            done: HashSet::new(),
        }))
    }

    /// Looks for the driver library in the processes `tgids` not yet known to
    /// map it, and attaches to every new library file. Returns the number of
    /// files newly attached.
    pub fn scan(&mut self, tgids: &HashSet<i32>) -> usize {
        self.done.retain(|t| tgids.contains(t));
        let mut new = 0;
        for &tgid in tgids {
            if self.done.contains(&tgid) {
                continue;
            }
            let Ok(maps) = std::fs::read_to_string(format!("/proc/{tgid}/maps")) else {
                continue;
            };
            let libs = find_libs(&maps, &self.opts.library_prefix);
            if libs.is_empty() {
                continue;
            }
            self.done.insert(tgid);
            for lib in libs {
                match self.attach_file(tgid, &lib) {
                    Ok(true) => new += 1,
                    Ok(false) => {}
                    Err(e) => tracing::warn!(tgid, path = %lib.path, "cuda: {e}"),
                }
            }
        }
        new
    }

    /// Attaches to one mapped library unless its file is attached already.
    fn attach_file(&mut self, tgid: i32, lib: &MappedLib) -> Result<bool, String> {
        // The path is the process's view: inside its root for a container,
        // or a host path when the file is reachable from the agent's root
        // (a chroot below it). The inode from maps tells which is the file.
        let candidates = [
            PathBuf::from(format!("/proc/{tgid}/root{}", lib.path)),
            PathBuf::from(&lib.path),
        ];
        let found = candidates.iter().find_map(|p| {
            let md = std::fs::metadata(p).ok()?;
            let dev = (libc::major(md.dev()), libc::minor(md.dev()));
            (md.ino() == lib.inode && dev == lib.dev).then(|| (p.clone(), (md.dev(), md.ino())))
        });
        let Some((path, key)) = found else {
            return Err("mapped library not reachable through /proc/<pid>/root".into());
        };
        if self.attached.contains_key(&key) {
            return Ok(false);
        }
        let mut links = Vec::new();
        for &(sym, prog, ret) in SYMBOLS {
            if matches!(prog, Prog::Launch) && !self.opts.launches {
                continue;
            }
            let entry = attach_one(self.prog(prog), &path, sym, false);
            let Ok(entry) = entry else {
                // older drivers lack some symbols
                tracing::debug!(symbol = sym, path = %path.display(), "not attached");
                continue;
            };
            links.push(entry);
            if ret {
                links.push(attach_one(self.prog(Prog::AllocRet), &path, sym, true)?);
            }
        }
        tracing::info!(path = %path.display(), probes = links.len(), "cuda: attached");
        self.attached.insert(key, links);
        Ok(true)
    }

    fn prog(&self, p: Prog) -> &'static ProgramMut<'static> {
        let skel: &'static skel::CudaSkel<'static> = self.skel;
        let progs = &skel.progs;
        match p {
            Prog::Alloc => &progs.cu_mem_alloc,
            Prog::AllocManaged => &progs.cu_mem_alloc_managed,
            Prog::AllocAsync => &progs.cu_mem_alloc_async,
            Prog::AllocPitch => &progs.cu_mem_alloc_pitch,
            Prog::Create => &progs.cu_mem_create,
            Prog::Import => &progs.cu_mem_import,
            Prog::AllocRet => &progs.cu_alloc_ret,
            Prog::Free => &progs.cu_mem_free,
            Prog::FreeAsync => &progs.cu_mem_free_async,
            Prog::Release => &progs.cu_mem_release,
            Prog::Map => &progs.cu_mem_map,
            Prog::Unmap => &progs.cu_mem_unmap,
            Prog::HtoD => &progs.cu_memcpy_htod,
            Prog::DtoH => &progs.cu_memcpy_dtoh,
            Prog::Launch => &progs.cu_launch_kernel,
        }
    }

    /// Distinct library files attached.
    pub fn files(&self) -> usize {
        self.attached.len()
    }

    /// One cgroup's numbers, if any of its processes called a probed function.
    pub fn read(&self, cgroup_dir: BorrowedFd<'_>) -> Option<CudaCgroup> {
        lookup_cgroup(&self.cgroups, cgroup_dir)
            .ok()
            .flatten()
            .and_then(|b| CudaCgroup::from_bytes(&b))
    }

    /// (cgroup storage unavailable, object map full, frees of unknown objects)
    pub fn kernel_stats(&self) -> [u64; 3] {
        [0, 1, 2].map(|i| percpu_sum(&self.stats, i))
    }
}

fn attach_one(
    prog: &ProgramMut<'static>,
    path: &std::path::Path,
    sym: &str,
    retprobe: bool,
) -> Result<Link, String> {
    prog.attach_uprobe_with_opts(
        -1,
        path,
        0,
        UprobeOpts {
            func_name: Some(sym.to_string()),
            retprobe,
            ..Default::default()
        },
    )
    .map_err(|e| format!("attaching {sym}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libraries_from_maps() {
        let maps = "\
55d0c0a00000-55d0c0a01000 r--p 00000000 fd:01 1234 /usr/bin/python3.11
7f1c2a000000-7f1c2a200000 r--p 00000000 fd:01 5678 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
7f1c2a200000-7f1c2b000000 r-xp 00200000 fd:01 5678 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15
7f1c2c000000-7f1c2c001000 rw-p 00000000 00:00 0 
7f1c2d000000-7f1c2d001000 r--p 00000000 00:1f 99 /tmp/x y/libcuda.so.1
7f1c2e000000-7f1c2e001000 r--p 00000000 fd:01 77 /old/libcuda.so.1 (deleted)
7ffd1000-7ffd2000 rw-p 00000000 00:00 0 [stack]
garbage line
";
        let libs = find_libs(maps, "libcuda.so");
        assert_eq!(
            libs,
            vec![
                MappedLib {
                    dev: (0xfd, 1),
                    inode: 5678,
                    path: "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15".into()
                },
                MappedLib {
                    dev: (0, 0x1f),
                    inode: 99,
                    path: "/tmp/x y/libcuda.so.1".into()
                },
            ]
        );
        assert!(find_libs("", "libcuda.so").is_empty());
    }

    #[test]
    fn decode_cgroup() {
        let mut b = Vec::new();
        for v in [-4096i64 as u64, 10, 20, 3] {
            b.extend_from_slice(&v.to_ne_bytes());
        }
        let c = CudaCgroup::from_bytes(&b).unwrap();
        assert_eq!(c.vram_bytes, -4096);
        assert_eq!((c.h2d_bytes, c.d2h_bytes, c.launches), (10, 20, 3));
        assert!(CudaCgroup::from_bytes(&b[..31]).is_none());
    }
}
