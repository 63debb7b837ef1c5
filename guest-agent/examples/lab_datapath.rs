//! Test fixture for the VM lab, not part of the agent: loads `tests/bpf/lab_datapath.bpf.c`
//! and attaches what a CNI would, the way Cilium does, on a datapath the test machine's
//! kernel lacks (netkit, fq). Links and the counters are pinned under /sys/fs/bpf, so that
//! they outlive this process; a later call reads the counters.
//!
//! ```text
//! lab_datapath netkit PIN PRIMARY [REDIRECT_DEV]   programs in netkit's hooks on PRIMARY
//! lab_datapath edt PIN DEV HORIZON_NS IP=BYTES_PER_S...   EDT on DEV's egress (tcx)
//! lab_datapath seen PIN        "peer PACKETS BYTES" and "primary PACKETS BYTES"
//! ```

mod fixture {
    include!(concat!(env!("OUT_DIR"), "/lab_datapath.skel.rs"));
}

use std::ffi::CString;
use std::mem::MaybeUninit;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd};

use anyhow::{bail, Context, Result};
use libbpf_rs::skel::SkelBuilder;
use libbpf_rs::{MapCore, MapFlags};

fn ifindex(name: &str) -> Result<u32> {
    let c = CString::new(name)?;
    // SAFETY: a NUL-terminated name.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        bail!("no interface {name}");
    }
    Ok(i)
}

fn pin(fd: i32, path: &str) -> Result<()> {
    let c = CString::new(path)?;
    // SAFETY: a valid fd and a NUL-terminated path.
    let r = unsafe { libbpf_sys::bpf_obj_pin(fd, c.as_ptr()) };
    if r < 0 {
        bail!("pin {path}: {}", std::io::Error::from_raw_os_error(-r));
    }
    Ok(())
}

/// A link of `prog` on `ifindex` (netkit or tcx), after the programs there.
fn link(prog: i32, ifindex: u32, ty: libbpf_sys::bpf_attach_type, path: &str) -> Result<()> {
    // SAFETY: zeroed is a valid bpf_link_create_opts; sz tells libbpf its size.
    let mut opts: libbpf_sys::bpf_link_create_opts = unsafe { std::mem::zeroed() };
    opts.sz = std::mem::size_of::<libbpf_sys::bpf_link_create_opts>() as _;
    // SAFETY: plain syscall wrapper.
    let r = unsafe { libbpf_sys::bpf_link_create(prog, ifindex as i32, ty, &opts) };
    if r < 0 {
        bail!(
            "link on ifindex {ifindex}: {}",
            std::io::Error::from_raw_os_error(-r)
        );
    }
    pin(r, path)?;
    // SAFETY: r is our fd; the pin keeps the link.
    unsafe { libc::close(r) };
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut storage = MaybeUninit::uninit();
    match a.as_slice() {
        ["netkit", pinned, primary, rest @ ..] => {
            let mut open = fixture::LabDatapathSkelBuilder::default()
                .open(&mut storage)
                .context("open")?;
            if let (Some(dev), Some(ro)) = (rest.first(), open.maps.rodata_data.as_deref_mut()) {
                ro.redirect_ifindex = ifindex(dev)?;
            }
            open.progs.edt_egress.set_autoload(false);
            let skel = gpufeed_guest::probes::object::load("lab_datapath", open)
                .map_err(|e| anyhow::anyhow!("load: {e}"))?;
            let i = ifindex(primary)?;
            link(
                skel.progs.cni_peer.as_fd().as_raw_fd(),
                i,
                libbpf_sys::BPF_NETKIT_PEER,
                &format!("{pinned}_peer"),
            )?;
            link(
                skel.progs.cni_primary.as_fd().as_raw_fd(),
                i,
                libbpf_sys::BPF_NETKIT_PRIMARY,
                &format!("{pinned}_primary"),
            )?;
            pin(
                skel.maps.seen.as_fd().as_raw_fd(),
                &format!("{pinned}_seen"),
            )?;
        }
        ["edt", pinned, dev, horizon, rates @ ..] => {
            let mut open = fixture::LabDatapathSkelBuilder::default()
                .open(&mut storage)
                .context("open")?;
            if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
                ro.horizon_ns = horizon.parse()?;
            }
            open.progs.cni_peer.set_autoload(false);
            open.progs.cni_primary.set_autoload(false);
            let skel = gpufeed_guest::probes::object::load("lab_datapath", open)
                .map_err(|e| anyhow::anyhow!("load: {e}"))?;
            for r in rates {
                let (ip, rate) = r.split_once('=').context("IP=BYTES_PER_S")?;
                let ip: Ipv4Addr = ip.parse()?;
                let rate: u64 = rate.parse()?;
                let mut v = [0u8; 16];
                v[..8].copy_from_slice(&rate.to_ne_bytes());
                skel.maps
                    .edt
                    .update(&ip.octets(), &v, MapFlags::ANY)
                    .context("edt map")?;
            }
            link(
                skel.progs.edt_egress.as_fd().as_raw_fd(),
                ifindex(dev)?,
                libbpf_sys::BPF_TCX_EGRESS,
                &format!("{pinned}_edt"),
            )?;
        }
        ["seen", pinned] => {
            let map = libbpf_rs::MapHandle::from_pinned_path(format!("{pinned}_seen"))?;
            for (i, name) in ["peer", "primary"].iter().enumerate() {
                let v = map
                    .lookup(&(i as u32).to_ne_bytes(), MapFlags::ANY)?
                    .context("seen entry")?;
                let n = |o: usize| u64::from_ne_bytes(v[o..o + 8].try_into().unwrap_or_default());
                println!("{name} {} {}", n(0), n(8));
            }
        }
        _ => bail!("usage: see the example's documentation"),
    }
    Ok(())
}
