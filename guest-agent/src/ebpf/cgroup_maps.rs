//! Userspace halves of `bpf/cgroup_drain.h` and `bpf/cgroup_active.h`, the
//! two maps a unit keyed by cgroup storage adds so that a tick reads only what
//! changed and nothing is lost when a cgroup goes.

use std::os::fd::{AsFd, AsRawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use libbpf_rs::{MapCore, MapFlags, MapHandle, RingBuffer, RingBufferBuilder};

use super::{err, ProbeError};

/// Entries one batch syscall moves. Drained values are large (a TCP cgroup's
/// is 3.6 KiB).
const DRAIN_BATCH: u32 = 64;

fn id_of(key: &[u8]) -> Option<u64> {
    Some(u64::from_ne_bytes(key.get(..8)?.try_into().ok()?))
}

/// Takes every entry out of a hash map keyed by a u64 (a cgroup id):
/// (key, value bytes), `batch` entries per syscall.
pub fn take_all(map: &MapHandle, batch: u32) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    // The kernel's batch read of a hash map stops at a bucket boundary, so
    // one batch may come back short with entries left behind, and libbpf-rs's
    // iterator takes a short batch for the end: read again until the map is
    // empty. An empty map's batch read still allocates a whole batch of
    // values, in the kernel and here (64 TCP values are 230 KiB), hence the
    // one key lookup first. Bounded: what programs insert meanwhile can wait
    // for the next take.
    for _ in 0..TAKE_ROUNDS {
        if map.keys().next().is_none() {
            break;
        }
        let before = out.len();
        match map.lookup_and_delete_batch(batch, MapFlags::ANY, MapFlags::ANY) {
            Ok(it) => out.extend(it.filter_map(|(k, v)| Some((id_of(&k)?, v)))),
            Err(e) => {
                tracing::debug!(error = %e, "emptying a map");
                break;
            }
        }
        if out.len() == before {
            break;
        }
    }
    out
}

/// Batch reads one [`take_all`] makes at most.
const TAKE_ROUNDS: usize = 64;

/// A BPF array map (`BPF_F_MMAPABLE`) mapped into the agent, read and
/// written through shared memory: unmapped on drop, and the map's fd kept
/// with it.
pub struct Mapped {
    _map: MapHandle,
    mem: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned by this value and outlives every pointer its
// users derive from it; what is shared with the kernel is accessed through
// volatile reads and writes or atomics.
unsafe impl Send for Mapped {}
unsafe impl Sync for Mapped {}

impl Mapped {
    /// Maps the whole of `map` read-write and shared.
    pub fn new(
        probe: &'static str,
        what: &'static str,
        map: MapHandle,
    ) -> Result<Mapped, ProbeError> {
        let io = |source| ProbeError::Io {
            probe,
            what,
            source,
        };
        let info = map
            .info()
            .map_err(|e| io(std::io::Error::other(e.to_string())))?;
        let stride = (info.info.value_size as usize).next_multiple_of(8);
        let len = (stride * info.info.max_entries as usize).max(1);
        // SAFETY: maps `len` bytes of the array (its whole size), shared; the
        // result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                map.as_fd().as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io(std::io::Error::last_os_error()));
        }
        Ok(Mapped {
            _map: map,
            mem: NonNull::new(ptr.cast()).expect("mmap does not return NULL on success"),
            len,
        })
    }

    /// The first byte of the array (the whole array follows).
    pub fn as_ptr(&self) -> *mut u8 {
        self.mem.as_ptr()
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `new` mapped, once.
        unsafe { libc::munmap(self.mem.as_ptr().cast(), self.len) };
    }
}

/// A small BPF array of u64 words mapped into the agent: epochs and flags
/// the programs read and set, read and written here without a syscall (a
/// tick used to spend two bpf() calls per unit on them).
pub struct MappedWords {
    mem: Mapped,
    count: usize,
}

impl MappedWords {
    pub fn new(probe: &'static str, map: MapHandle) -> Result<MappedWords, ProbeError> {
        let info = map.info().map_err(|e| ProbeError::Io {
            probe,
            what: "reading a word array",
            source: std::io::Error::other(e.to_string()),
        })?;
        if info.info.value_size != 8 {
            return Err(ProbeError::Io {
                probe,
                what: "reading a word array",
                source: std::io::Error::other("values are not u64"),
            });
        }
        Ok(MappedWords {
            count: info.info.max_entries as usize,
            mem: Mapped::new(probe, "mapping a word array", map)?,
        })
    }

    fn word(&self, index: usize) -> &AtomicU64 {
        assert!(index < self.count, "word {index} of {}", self.count);
        // SAFETY: in bounds (above), 8-aligned (a page-aligned mapping of
        // u64s), and the mapping lives as long as self.
        unsafe { &*self.mem.as_ptr().cast::<AtomicU64>().add(index) }
    }

    pub fn store(&self, index: usize, value: u64) {
        self.word(index).store(value, Ordering::SeqCst);
    }

    /// Whether the word at `index` is set; clears it.
    pub fn take(&self, index: usize) -> bool {
        self.word(index).swap(0, Ordering::SeqCst) != 0
    }
}

/// `<storage>_drained`: removed cgroups' storage values as they were at rmdir.
pub struct Drained {
    map: MapHandle,
    /// `<storage>_drain_added`: set by the kernel when an entry was added
    added: MappedWords,
}

impl Drained {
    pub fn new(
        probe: &'static str,
        map: MapHandle,
        added: MapHandle,
    ) -> Result<Drained, ProbeError> {
        Ok(Drained {
            map,
            added: MappedWords::new(probe, added)?,
        })
    }

    /// Takes every entry out of the map and turns each into the deltas since
    /// the cgroup's previous read: `decode` the value, `push` its deltas (the
    /// unit's delta state is then forgotten by `push`'s caller).
    pub fn deltas<T, D>(
        &self,
        decode: impl Fn(&[u8]) -> Option<T>,
        mut push: impl FnMut(u64, T, &mut Vec<D>),
        out: &mut Vec<(u64, D)>,
    ) {
        // cleared before the map is read: an entry added after the clear
        // sets it again, and is read now or next time
        if !self.added.take(0) {
            return;
        }
        let mut deltas = Vec::new();
        for (id, bytes) in take_all(&self.map, DRAIN_BATCH) {
            let Some(v) = decode(&bytes) else { continue };
            push(id, v, &mut deltas);
            out.extend(deltas.drain(..).map(|d| (id, d)));
        }
    }
}

/// `active_epoch` and the ring `active_cgroups`: the cgroups whose storage
/// changed (and, with the same layout, the rings of `bpf/cgroup_events.bpf.c`).
pub struct ActiveSet {
    epoch_map: MappedWords,
    /// Read through shared memory: taking the ids costs no syscall.
    ring: RingBuffer<'static>,
    _ring_map: MapHandle,
    /// What the ring's callback collected in the current take.
    taken: Arc<Mutex<Vec<u64>>>,
    epoch: u64,
    /// The previous take's ids, read once more: an event that saw the old
    /// epoch (so did not mark again) may update what it marks just after the
    /// agent read it.
    previous: Vec<u64>,
}

impl ActiveSet {
    /// Starts the first epoch (fresh storage has epoch 0: its first event marks it).
    pub fn new(
        probe: &'static str,
        epoch_map: MapHandle,
        ring_map: MapHandle,
    ) -> Result<ActiveSet, ProbeError> {
        let taken: Arc<Mutex<Vec<u64>>> = Arc::default();
        let into = taken.clone();
        let mut builder = RingBufferBuilder::new();
        builder
            .add(&ring_map, move |record: &[u8]| {
                if let Some(id) = id_of(record) {
                    into.lock().unwrap_or_else(|e| e.into_inner()).push(id);
                }
                0
            })
            .map_err(err(probe, "reading the activity ring"))?;
        let ring = builder
            .build()
            .map_err(err(probe, "reading the activity ring"))?;
        let mut s = ActiveSet {
            epoch_map: MappedWords::new(probe, epoch_map)?,
            ring,
            _ring_map: ring_map,
            taken,
            epoch: 0,
            previous: Vec::new(),
        };
        s.bump();
        Ok(s)
    }

    fn bump(&mut self) {
        self.epoch += 1;
        self.epoch_map.store(0, self.epoch);
    }

    /// Starts a new epoch and returns the ids marked in the ones before (this
    /// and the previous take's), or None when they cannot be trusted (the
    /// ring overflowed, or could not be read): then the caller reads
    /// every cgroup (or process).
    pub fn take(&mut self) -> Option<Vec<u64>> {
        self.bump();
        // [1]: a write to the ring failed since the last take
        let overflowed = self.epoch_map.take(1);
        let consumed = self.ring.consume().is_ok();
        let mut now = std::mem::take(&mut *self.taken.lock().unwrap_or_else(|e| e.into_inner()));
        now.sort_unstable();
        now.dedup();
        let mut out = std::mem::replace(&mut self.previous, now.clone());
        out.extend(now);
        out.sort_unstable();
        out.dedup();
        (consumed && !overflowed).then_some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libbpf_rs::{MapHandle, MapType};

    /// A hash map's batch read ends at a bucket boundary, so a batch shorter
    /// than asked for is not the map's end: every entry is still taken.
    #[test]
    fn take_all_empties_a_hash_map_larger_than_a_batch() {
        if unsafe { libc::geteuid() } != 0 && std::env::var_os("CI").is_none() {
            eprintln!("needs root (creates a BPF map); skipped");
            return;
        }
        let opts = libbpf_sys::bpf_map_create_opts {
            sz: std::mem::size_of::<libbpf_sys::bpf_map_create_opts>() as _,
            ..Default::default()
        };
        let map = MapHandle::create(MapType::Hash, Some("take_all_test"), 8, 16, 4096, &opts)
            .expect("a hash map");
        for round in 0..3u64 {
            for i in 0..1000u64 {
                let key = (round << 32 | i).to_ne_bytes();
                map.update(&key, &[7u8; 16], MapFlags::ANY).unwrap();
            }
            let got = take_all(&map, 256);
            assert_eq!(got.len(), 1000, "round {round}");
            assert!(map.keys().next().is_none(), "round {round}: map empty");
        }
    }
}
