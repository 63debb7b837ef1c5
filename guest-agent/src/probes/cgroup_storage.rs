//! Userspace half of `bpf/cgroup_storage.h`: where a unit's per-cgroup values live on this
//! kernel, and how the agent reads them.
//!
//! Cgroup-local storage (6.2) is preferred: the kernel frees a cgroup's value with it and
//! the hot path is a pointer chase. A unit falls back to the hash map keyed by cgroup id when
//! the kernel has no cgroup storage (6.1) or refuses the program that uses it (a verifier
//! that does not trust the cgroup pointer the program holds), and says so in its status.
//! `--cgroup-storage` forces either, for tests and benchmarks of both.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::OnceLock;

use libbpf_rs::{MapCore, MapFlags, MapHandle, OpenObject};

use crate::ebpf::libbpf_log::Capture;
use crate::ebpf::{err, not_in_object, ProbeError};

/// `--cgroup-storage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StorageChoice {
    /// Cgroup-local storage where the kernel loads it, else a hash map by cgroup id.
    Auto,
    /// Cgroup-local storage only (a kernel without it leaves the probes down).
    Local,
    /// The hash map keyed by cgroup id, on any kernel.
    ById,
}

static CHOSEN: OnceLock<StorageChoice> = OnceLock::new();

/// Sets `--cgroup-storage` before any unit loads (later calls change nothing).
pub fn choose(c: StorageChoice) {
    let _ = CHOSEN.set(c);
}

/// Entries of a unit's id map: cgroups with a value at once. Past it a new cgroup's events
/// are counted as storage failures (`gpufeed_bpf_storage_alloc_failures_total`).
pub const BY_ID_ENTRIES: u32 = 16384;

/// Where one unit keeps its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    Local,
    ById,
}

impl Storage {
    pub fn by_id(self) -> bool {
        self == Storage::ById
    }

    /// As `gpufeed_probe_info{storage}` and the kernel support table say it.
    pub fn name(self) -> &'static str {
        match self {
            Storage::Local => "cgroup-local",
            Storage::ById => "hash-by-id",
        }
    }

    /// Sets up a `CGROUP_STORAGE(name, ...)` triple before load: the unused maps are not
    /// created (a 6.1 kernel could not create the cgroup storage map at all), the id map
    /// gets its bound.
    pub fn configure(
        self,
        probe: &'static str,
        name: &str,
        open: &mut OpenObject,
    ) -> Result<(), ProbeError> {
        for (suffix, used) in [
            ("", !self.by_id()),
            ("_by_id", self.by_id()),
            ("_zero", self.by_id()),
        ] {
            let map_name = format!("{name}{suffix}");
            let mut m = open
                .maps_mut()
                .find(|m| m.name() == map_name.as_str())
                .ok_or_else(|| not_in_object(probe, "map", &map_name))?;
            m.set_autocreate(used)
                .map_err(err(probe, "choosing the cgroup storage"))?;
            if used && suffix == "_by_id" {
                m.set_max_entries(BY_ID_ENTRIES)
                    .map_err(err(probe, "sizing the cgroup id map"))?;
            }
        }
        Ok(())
    }
}

/// Whether the kernel has `BPF_MAP_TYPE_CGRP_STORAGE` (asked once).
pub fn kernel_has_local() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        // SAFETY: a feature probe; NULL options are allowed.
        let r = unsafe {
            libbpf_sys::libbpf_probe_bpf_map_type(
                libbpf_sys::BPF_MAP_TYPE_CGRP_STORAGE,
                std::ptr::null(),
            )
        };
        r == 1
    })
}

/// The storages to try on this kernel, preferred first.
pub fn candidates() -> Vec<Storage> {
    match CHOSEN.get().copied().unwrap_or(StorageChoice::Auto) {
        StorageChoice::Local => vec![Storage::Local],
        StorageChoice::ById => vec![Storage::ById],
        StorageChoice::Auto if kernel_has_local() => vec![Storage::Local, Storage::ById],
        StorageChoice::Auto => vec![Storage::ById],
    }
}

/// What [`load_first`] loaded.
pub struct Chosen<T> {
    pub loaded: T,
    pub storage: Storage,
    /// why the preferred storage was not used, when it was tried and refused
    pub fell_back: Option<String>,
}

/// Runs `attempt` with each candidate storage until one loads. A missing privilege is
/// returned at once (no storage would change it).
pub fn load_first<T>(
    probe: &'static str,
    mut attempt: impl FnMut(Storage) -> Result<T, ProbeError>,
) -> Result<Chosen<T>, ProbeError> {
    let mut fell_back = None;
    let mut last = None;
    for storage in candidates() {
        let capture = Capture::start();
        match attempt(storage) {
            Ok(loaded) => {
                return Ok(Chosen {
                    loaded,
                    storage,
                    fell_back,
                })
            }
            Err(e) if e.is_permission() => return Err(e),
            Err(e) => {
                let why = match capture.refusal() {
                    Some(r) => format!("{e}: {r}"),
                    None => e.to_string(),
                };
                tracing::info!(probe, storage = storage.name(), "refused: {why}");
                fell_back = Some(why);
                last = Some(e);
            }
        }
    }
    Err(last.expect("at least one candidate storage"))
}

/// A loaded unit's per-cgroup values, read by the cgroup's directory (cgroup-local
/// storage) or by its id (the id map).
pub struct CgroupValues {
    map: MapHandle,
    storage: Storage,
}

impl CgroupValues {
    pub fn new(map: MapHandle, storage: Storage) -> CgroupValues {
        CgroupValues { map, storage }
    }

    pub fn storage(&self) -> Storage {
        self.storage
    }

    /// The value of one cgroup, if it has one.
    pub fn get(&self, id: u64, dir: BorrowedFd<'_>) -> Option<Vec<u8>> {
        let found = match self.storage {
            Storage::Local => self
                .map
                .lookup(&dir.as_raw_fd().to_ne_bytes(), MapFlags::ANY),
            Storage::ById => self.map.lookup(&id.to_ne_bytes(), MapFlags::ANY),
        };
        found.ok().flatten()
    }

    /// The value of the cgroup whose directory `dir` is (its id is the directory's inode).
    pub fn get_by_dir(&self, dir: BorrowedFd<'_>) -> Option<Vec<u8>> {
        use std::os::unix::fs::MetadataExt;
        let f = std::fs::File::from(dir.try_clone_to_owned().ok()?);
        let id = f.metadata().ok()?.ino();
        self.get(id, dir)
    }

    /// A cgroup the agent is done with: the id map lets go of its entry (a socket that
    /// outlived its cgroup may have made one after the drain at `cgroup_rmdir`). Cgroup-local
    /// storage goes with the cgroup by itself.
    pub fn forget(&self, id: u64) {
        if self.storage.by_id() {
            let _ = self.map.delete(&id.to_ne_bytes());
        }
    }
}
