//! Cgroup creation and removal as the kernel reports them
//! (`bpf/cgroup_events.bpf.c`), so that the tree follows the hierarchy
//! without walking it every tick.

mod skel {
    include!(concat!(env!("OUT_DIR"), "/cgroup_events.skel.rs"));
}

use std::mem::MaybeUninit;

use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapHandle};

use crate::probes::cgroup_maps::{take_all, take_flag};
use crate::probes::{decode, err, handle, ProbeError};

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

pub struct CgroupEvents {
    born: MapHandle,
    died: MapHandle,
    overflow: MapHandle,
    _links: Vec<Link>,
}

impl CgroupEvents {
    /// Loads and attaches the two tracepoint programs. `read_paths`: copy the
    /// removed cgroup's path (not allowed under lockdown=confidentiality).
    pub fn load(read_paths: bool) -> Result<CgroupEvents, ProbeError> {
        let mut storage = MaybeUninit::uninit();
        let mut open = skel::CgroupEventsSkelBuilder::default()
            .open(&mut storage)
            .map_err(err(OBJ, "open"))?;
        if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
            ro.read_paths = read_paths;
        }
        let skel = open.load().map_err(err(OBJ, "load"))?;
        let links = vec![
            skel.progs
                .cgroup_mkdir
                .attach()
                .map_err(err(OBJ, "attach cgroup_mkdir"))?,
            skel.progs
                .cgroup_rmdir
                .attach()
                .map_err(err(OBJ, "attach cgroup_rmdir"))?,
        ];
        Ok(CgroupEvents {
            born: handle(OBJ, &skel.maps.born)?,
            died: handle(OBJ, &skel.maps.died)?,
            overflow: handle(OBJ, &skel.maps.overflow)?,
            _links: links,
        })
    }

    /// Takes the events recorded since the previous call out of the maps.
    pub fn take(&self) -> Events {
        let overflowed = take_flag(&self.overflow, 0);
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
