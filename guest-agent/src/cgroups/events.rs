//! Cgroup creation and removal as the kernel reports them
//! (`bpf/cgroup_events.bpf.c`), so that the tree follows the hierarchy
//! without walking it every tick, and the changes in processes that tell the
//! GPU units which process lists and which processes to look at again.

mod skel {
    include!(concat!(env!("OUT_DIR"), "/cgroup_events.skel.rs"));
}

use std::collections::HashSet;
use std::mem::MaybeUninit;

use libbpf_rs::skel::SkelBuilder;
use libbpf_rs::{Link, MapHandle};

use crate::ebpf::cgroup_maps::{take_all, ActiveSet, MappedWords};
use crate::ebpf::{attach_all, decode, err, handle, ProbeError};

const OBJ: &str = "cgroup_events";
const BATCH: u32 = 256;

// SAFETY: generated #[repr(C)] structs of integers and bytes: every bit pattern is valid.
unsafe impl plain::Plain for skel::types::born {}
unsafe impl plain::Plain for skel::types::died {}

/// A cgroup created since the previous read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Born {
    pub id: u64,
    pub parent: u64,
    /// depth below the root (the root is 0)
    pub level: u32,
}

/// A cgroup removed since the previous read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Died {
    pub id: u64,
    pub parent: u64,
    /// Its path from the hierarchy's root as the kernel names it; None under
    /// lockdown (see the BPF file).
    pub path: Option<String>,
}

/// What happened since the previous read.
#[derive(Debug, Default)]
pub struct Events {
    pub born: Vec<Born>,
    pub died: Vec<Died>,
    /// An event could not be recorded (a map was full): walk the hierarchy.
    pub overflowed: bool,
}

/// What changed in processes since the previous read (and the read before:
/// the kernel marks a change as it begins, so each is looked at twice).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ProcessChanges {
    /// Cgroups that gained or lost a process: their process lists are stale.
    pub cgroups: HashSet<u64>,
    /// Processes that exec'd or mapped something new: their mappings and open
    /// files are worth another look.
    pub processes: HashSet<i32>,
}

pub struct CgroupEvents {
    born: MapHandle,
    died: MapHandle,
    overflow: MappedWords,
    /// `procs_changed` and `maps_changed`; None when the kernel lacks a hook.
    procs: Option<(ActiveSet, ActiveSet)>,
    _links: Vec<Link>,
}

/// The programs that follow processes, and the tracepoints they attach to.
const PROCESS_HOOKS: [&str; 5] = [
    "sched_process_fork",
    "sched_process_exit",
    "cgroup_attach_task",
    "sched_process_exec",
    "vm_unmapped_area",
];

impl CgroupEvents {
    /// Loads and attaches the tracepoint programs. `read_paths`: copy the
    /// removed cgroup's path (not allowed under lockdown=confidentiality).
    /// `processes`: follow processes too (the kernel has every hook in
    /// [`PROCESS_HOOKS`]; else [`CgroupEvents::processes`] is None).
    pub fn load(read_paths: bool, processes: bool) -> Result<CgroupEvents, ProbeError> {
        let mut storage = MaybeUninit::uninit();
        let mut open = skel::CgroupEventsSkelBuilder::default()
            .open(&mut storage)
            .map_err(err(OBJ, "open"))?;
        if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
            ro.read_paths = read_paths;
        }
        let p = &mut open.progs;
        for prog in [
            &mut p.procs_fork,
            &mut p.procs_exit,
            &mut p.procs_attach,
            &mut p.maps_exec,
            &mut p.maps_new_area,
        ] {
            prog.set_autoload(processes);
        }
        let skel = crate::ebpf::object::load(OBJ, open)?;
        let p = &skel.progs;
        let mut progs = vec![
            (&p.cgroup_mkdir, "cgroup_mkdir"),
            (&p.cgroup_rmdir, "cgroup_rmdir"),
        ];
        if processes {
            progs.extend(
                [
                    &p.procs_fork,
                    &p.procs_exit,
                    &p.procs_attach,
                    &p.maps_exec,
                    &p.maps_new_area,
                ]
                .into_iter()
                .zip(PROCESS_HOOKS),
            );
        }
        let links = attach_all(OBJ, progs)?;
        let procs = if processes {
            let epoch = || handle(OBJ, &skel.maps.changed_epoch);
            Some((
                ActiveSet::new(OBJ, epoch()?, handle(OBJ, &skel.maps.procs_changed)?)?,
                ActiveSet::new(OBJ, epoch()?, handle(OBJ, &skel.maps.maps_changed)?)?,
            ))
        } else {
            None
        };
        Ok(CgroupEvents {
            born: handle(OBJ, &skel.maps.born)?,
            died: handle(OBJ, &skel.maps.died)?,
            overflow: MappedWords::new(OBJ, handle(OBJ, &skel.maps.overflow)?)?,
            procs,
            _links: links,
        })
    }

    /// The changes in processes since the previous call and the one before;
    /// None when they are not followed, or some were lost (then every list
    /// and process is to be looked at again).
    pub fn processes(&mut self) -> Option<ProcessChanges> {
        let (cgroups, maps) = self.procs.as_mut()?;
        // both sets share the epoch array: its overflow flag is taken by the
        // first take, so it is read once here for both
        let cgroups = cgroups.take();
        let processes = maps.take();
        Some(ProcessChanges {
            cgroups: cgroups?.into_iter().collect(),
            processes: processes?.into_iter().map(|t| t as i32).collect(),
        })
    }

    /// Takes the events recorded since the previous call out of the maps.
    pub fn take(&self) -> Events {
        let overflowed = self.overflow.take(0);
        // [1] counts what was recorded: cleared before the take, so that
        // whatever comes after the clear is taken now or next time
        if !self.overflow.take(1) {
            return Events {
                overflowed,
                ..Events::default()
            };
        }
        let born = take_all(&self.born, BATCH)
            .into_iter()
            .filter_map(|(id, v)| {
                let b = decode::<skel::types::born>(&v)?;
                Some(Born {
                    id,
                    parent: b.parent,
                    level: b.level,
                })
            })
            .collect();
        let died = take_all(&self.died, BATCH)
            .into_iter()
            .filter_map(|(id, v)| {
                let d = decode::<skel::types::died>(&v)?;
                let len = d.path.iter().position(|c| *c == 0).unwrap_or(d.path.len());
                let bytes: Vec<u8> = d.path[..len].iter().map(|c| *c as u8).collect();
                Some(Died {
                    id,
                    parent: d.parent,
                    path: (len > 0).then(|| String::from_utf8_lossy(&bytes).into_owned()),
                })
            })
            .collect();
        Events {
            born,
            died,
            overflowed,
        }
    }
}
