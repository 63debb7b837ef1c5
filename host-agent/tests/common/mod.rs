//! Recorded sysfs / Proxmox trees in the kernel's exact formats, written into a temp dir that
//! the agent reads through `--root`.
#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

pub use gpufeed_testkit::aer::Aer;

pub struct Tree {
    pub dir: tempfile::TempDir,
}

pub struct Dev<'a> {
    pub bdf: &'a str,
    pub class: &'a str,
    pub vendor: &'a str,
    pub device: &'a str,
    pub speed: &'a str,
    pub width: u32,
    pub max_speed: &'a str,
    pub max_width: u32,
    pub removable: bool,
    pub aer: bool,
    pub root_port: bool,
    pub driver: Option<&'a str>,
}

impl Tree {
    pub fn new() -> Tree {
        let t = Tree {
            dir: tempfile::tempdir().unwrap(),
        };
        for d in ["sys/bus/pci/devices", "sys/devices", "run", "proc", "dev"] {
            fs::create_dir_all(t.root().join(d)).unwrap();
        }
        fs::write(t.root().join("dev/kmsg"), "").unwrap();
        t
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    pub fn p(&self, rel: &str) -> PathBuf {
        self.root().join(rel.trim_start_matches('/'))
    }

    pub fn write(&self, rel: &str, text: &str) {
        let p = self.p(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        // Write to a temp name and rename: a reader never sees a half-written attribute.
        let tmp = p.with_extension("tmp~");
        fs::write(&tmp, text).unwrap();
        fs::rename(&tmp, &p).unwrap();
    }

    pub fn pci(&self, bdf: &str) -> PathBuf {
        self.p("sys/bus/pci/devices").join(bdf)
    }

    /// Add a PCI function at `devpath` (relative to /sys/devices, e.g. `pci0000:00/0000:00:1c.4`).
    pub fn add_pci(&self, devpath: &str, d: Dev) {
        let dir = self.p("sys/devices").join(devpath);
        fs::create_dir_all(dir.join("power")).unwrap();
        let w = |f: &str, v: String| fs::write(dir.join(f), v).unwrap();
        w("class", format!("{}\n", d.class));
        w("vendor", format!("{}\n", d.vendor));
        w("device", format!("{}\n", d.device));
        w("current_link_speed", format!("{}\n", d.speed));
        w("current_link_width", format!("{}\n", d.width));
        w("max_link_speed", format!("{}\n", d.max_speed));
        w("max_link_width", format!("{}\n", d.max_width));
        w(
            "removable",
            if d.removable {
                "removable\n".into()
            } else {
                "fixed\n".into()
            },
        );
        w("power/runtime_status", "active\n".into());
        w("power_state", "D0\n".into());
        if d.aer {
            for a in [Aer::Correctable, Aer::Nonfatal, Aer::Fatal] {
                w(a.file(), a.text(&[]));
            }
        }
        if d.root_port {
            for f in [
                "aer_rootport_total_err_cor",
                "aer_rootport_total_err_fatal",
                "aer_rootport_total_err_nonfatal",
            ] {
                w(f, "0\n".into());
            }
        }
        if let Some(drv) = d.driver {
            let ddir = self.p("sys/bus/pci/drivers").join(drv);
            fs::create_dir_all(&ddir).unwrap();
            let _ = symlink(&ddir, dir.join("driver"));
        }
        let depth = 4; // sys/bus/pci/devices → ../../../devices
        let _ = depth;
        symlink(format!("../../../devices/{devpath}"), self.pci(d.bdf)).unwrap();
    }

    pub fn add_tb(&self, devpath: &str, name: &str, attrs: &[(&str, &str)]) {
        let dir = self.p("sys/devices").join(devpath);
        fs::create_dir_all(&dir).unwrap();
        for (k, v) in attrs {
            fs::write(dir.join(k), format!("{v}\n")).unwrap();
        }
        fs::create_dir_all(self.p("sys/bus/thunderbolt/devices")).unwrap();
        symlink(
            format!("../../../devices/{devpath}"),
            self.p("sys/bus/thunderbolt/devices").join(name),
        )
        .unwrap();
    }

    pub fn remove_tb(&self, devpath: &str, name: &str) {
        fs::remove_file(self.p("sys/bus/thunderbolt/devices").join(name)).unwrap();
        fs::remove_dir_all(self.p("sys/devices").join(devpath)).unwrap();
    }

    /// Link Status of device `devpath` (under `sys/devices`) as its `current_link_*` read.
    pub fn set_link(&self, devpath: &str, width: &str, speed: &str) {
        self.write(
            &format!("sys/devices/{devpath}/current_link_width"),
            &format!("{width}\n"),
        );
        self.write(
            &format!("sys/devices/{devpath}/current_link_speed"),
            &format!("{speed}\n"),
        );
    }

    pub fn append_kmsg(&self, records: &str) {
        use std::io::Write;
        let mut f = fs::OpenOptions::new()
            .append(true)
            .open(self.p("dev/kmsg"))
            .unwrap();
        f.write_all(records.as_bytes()).unwrap();
    }
}

pub const RP: &str = "pci0000:00/0000:00:1c.4";
pub const TB_USP: &str = "pci0000:00/0000:00:1c.4/0000:05:00.0";
pub const TB_NHI_DSP: &str = "pci0000:00/0000:00:1c.4/0000:05:00.0/0000:06:00.0";
pub const TB_NHI: &str = "pci0000:00/0000:00:1c.4/0000:05:00.0/0000:06:00.0/0000:07:00.0";
pub const TB_DSP: &str = "pci0000:00/0000:00:1c.4/0000:05:00.0/0000:06:01.0";
pub const ENC_USP: &str = "pci0000:00/0000:00:1c.4/0000:05:00.0/0000:06:01.0/0000:08:00.0";
pub const ENC_DSP: &str =
    "pci0000:00/0000:00:1c.4/0000:05:00.0/0000:06:01.0/0000:08:00.0/0000:09:01.0";
pub const GPU: &str =
    "pci0000:00/0000:00:1c.4/0000:05:00.0/0000:06:01.0/0000:08:00.0/0000:09:01.0/0000:0a:00.0";
pub const GPU_AUDIO: &str =
    "pci0000:00/0000:00:1c.4/0000:05:00.0/0000:06:01.0/0000:08:00.0/0000:09:01.0/0000:0a:00.1";
pub const TB_ROUTER: &str =
    "pci0000:00/0000:00:1c.4/0000:05:00.0/0000:06:00.0/0000:07:00.0/domain0/0-0/0-1";
pub const PLAIN_RP: &str = "pci0000:00/0000:00:01.0";
pub const PLAIN_GPU: &str = "pci0000:00/0000:00:01.0/0000:01:00.0";
pub const PLAIN_AUDIO: &str = "pci0000:00/0000:00:01.0/0000:01:00.1";

fn bridge<'a>(
    bdf: &'a str,
    speed: &'a str,
    width: u32,
    max_speed: &'a str,
    max_width: u32,
    removable: bool,
) -> Dev<'a> {
    Dev {
        bdf,
        class: "0x060400",
        vendor: "0x8086",
        device: "0x15ef",
        speed,
        width,
        max_speed,
        max_width,
        removable,
        aer: true,
        root_port: false,
        driver: Some("pcieport"),
    }
}

/// TB4 eGPU: root port 00:1c.4 → Thunderbolt controller (USP 05:00.0, DSP 06:01.0; NHI
/// 07:00.0 behind DSP 06:00.0) → tunnel → enclosure switch (USP 08:00.0, DSP 09:01.0) →
/// GPU 0a:00.0 at 16 GT/s x4 bound to vfio-pci (+ audio 0a:00.1).
/// Plain slot: root port 00:01.0 → GPU 01:00.0 at 16 GT/s x16 (+ audio 01:00.1).
pub fn topology(t: &Tree) {
    let mut rp = bridge(
        "0000:00:1c.4",
        "8.0 GT/s PCIe",
        4,
        "8.0 GT/s PCIe",
        4,
        false,
    );
    rp.root_port = true;
    rp.device = "0x7ab8";
    t.add_pci(RP, rp);
    t.add_pci(
        TB_USP,
        bridge(
            "0000:05:00.0",
            "8.0 GT/s PCIe",
            4,
            "8.0 GT/s PCIe",
            4,
            false,
        ),
    );
    t.add_pci(
        TB_NHI_DSP,
        bridge(
            "0000:06:00.0",
            "2.5 GT/s PCIe",
            4,
            "2.5 GT/s PCIe",
            4,
            false,
        ),
    );
    t.add_pci(
        TB_NHI,
        Dev {
            bdf: "0000:07:00.0",
            class: "0x0c0340",
            vendor: "0x8086",
            device: "0x15eb",
            speed: "2.5 GT/s PCIe",
            width: 4,
            max_speed: "2.5 GT/s PCIe",
            max_width: 4,
            removable: false,
            aer: false,
            root_port: false,
            driver: Some("thunderbolt"),
        },
    );
    t.add_pci(
        TB_DSP,
        bridge(
            "0000:06:01.0",
            "2.5 GT/s PCIe",
            4,
            "2.5 GT/s PCIe",
            4,
            false,
        ),
    );
    t.add_pci(
        ENC_USP,
        bridge("0000:08:00.0", "2.5 GT/s PCIe", 4, "2.5 GT/s PCIe", 4, true),
    );
    t.add_pci(
        ENC_DSP,
        bridge(
            "0000:09:01.0",
            "16.0 GT/s PCIe",
            4,
            "16.0 GT/s PCIe",
            4,
            true,
        ),
    );
    // The eGPU: a x16 card in a x4 enclosure.
    for (path, bdf, class, device) in [
        (GPU, "0000:0a:00.0", "0x030000", "0x2bb1"),
        (GPU_AUDIO, "0000:0a:00.1", "0x040300", "0x22e8"),
    ] {
        t.add_pci(path, nvidia_vfio(bdf, class, device, 4, true));
    }
    t.add_tb(
        &TB_ROUTER.replace("/0-0/0-1", ""),
        "domain0",
        &[("security", "user"), ("iommu_dma_protection", "1")],
    );
    t.add_tb(
        &TB_ROUTER.replace("/0-1", ""),
        "0-0",
        &[
            ("authorized", "1"),
            ("generation", "4"),
            ("vendor_name", "Intel"),
            ("device_name", "Maple Ridge 4C"),
        ],
    );
    t.add_tb(
        TB_ROUTER,
        "0-1",
        &[
            ("authorized", "1"),
            ("generation", "4"),
            ("vendor_name", "Razer"),
            ("device_name", "Core X V2"),
            ("rx_speed", "20.0 Gb/s"),
            ("tx_speed", "20.0 Gb/s"),
            ("rx_lanes", "2"),
            ("tx_lanes", "2"),
            ("unique_id", "c8030000-0060-6c18-2311-d8c1a5e42e21"),
        ],
    );
    let mut prp = bridge(
        "0000:00:01.0",
        "16.0 GT/s PCIe",
        16,
        "16.0 GT/s PCIe",
        16,
        false,
    );
    prp.root_port = true;
    t.add_pci(PLAIN_RP, prp);
    for (path, bdf, class, device) in [
        (PLAIN_GPU, "0000:01:00.0", "0x030000", "0x2684"),
        (PLAIN_AUDIO, "0000:01:00.1", "0x040300", "0x22ba"),
    ] {
        t.add_pci(path, nvidia_vfio(bdf, class, device, 16, false));
    }
}

/// VM 100 gets the eGPU through a resource mapping; VM 101 the plain-slot GPU (all functions).
pub fn pve_basic(t: &Tree) {
    t.write(
        "etc/pve/mapping/pci.cfg",
        "egpu\n\tmap id=10de:2bb1,iommugroup=20,node=testnode,path=0000:0a:00.0,subsystem-id=10de:204b\n\tdescription TB4 enclosure\n",
    );
    t.write(
        "etc/pve/qemu-server/100.conf",
        "boot: order=scsi0\ncores: 8\nhostpci0: mapping=egpu,pcie=1\nmachine: q35\nnet0: virtio=BC:24:11:00:00:01,bridge=vmbr0,firewall=1\n",
    );
    t.write(
        "etc/pve/qemu-server/101.conf",
        "cores: 4\nhostpci0: 01:00,pcie=1,x-vga=1\nnet0: virtio=BC:24:11:00:00:02,bridge=vmbr0\n",
    );
}

/// A function of an NVIDIA card bound to vfio-pci, with AER, on a 16 GT/s link of `width`
/// lanes (the card has 16).
fn nvidia_vfio(
    bdf: &'static str,
    class: &'static str,
    device: &'static str,
    width: u32,
    removable: bool,
) -> Dev<'static> {
    Dev {
        bdf,
        class,
        vendor: "0x10de",
        device,
        speed: "16.0 GT/s PCIe",
        width,
        max_speed: "16.0 GT/s PCIe",
        max_width: 16,
        removable,
        aer: true,
        root_port: false,
        driver: Some("vfio-pci"),
    }
}

pub fn base_config(t: &Tree, poll_ms: u64) -> gpufeed_host::config::Config {
    let mut c = gpufeed_host::config::Config {
        host_id: Some("testnode".into()),
        root: t.root().to_path_buf(),
        ..Default::default()
    };
    c.pcie.poll_interval_ms = poll_ms;
    c.aer.poll_interval_ms = poll_ms;
    c.thunderbolt.poll_interval_ms = poll_ms;
    c.thunderbolt.uevents = false;
    c.vm.poll_interval_ms = poll_ms;
    c.vm.qmp = false;
    c.bridge.enabled = false;
    c.host.enabled = false;
    c
}

/// The binary's config file for the recorded host in `t`: `host_id`, its tree as the root,
/// /metrics on a free loopback port, links and AER read every 100 ms and the watchers that
/// would read this machine (bridge, host, QMP, uevents) off; `extra` is appended (more
/// sections). Returns the file and the /metrics address.
pub fn recorded_host_config(
    t: &Tree,
    host_id: &str,
    extra: &str,
) -> (PathBuf, std::net::SocketAddr) {
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let cfg = t.p("host.toml");
    fs::write(
        &cfg,
        format!(
            "host_id = \"{host_id}\"\nroot = {:?}\nmetrics_listen = \"{addr}\"\n\
             [pcie]\npoll_interval_ms = 100\n[aer]\npoll_interval_ms = 100\n\
             [bridge]\nenabled = false\n[host]\nenabled = false\n[vm]\nqmp = false\n\
             [thunderbolt]\nuevents = false\n{extra}",
            t.root().display().to_string()
        ),
    )
    .unwrap();
    (cfg, addr)
}

// The shared test kit's: root-needing tests skip on a laptop and fail under CI=true; a GET of
// an agent's page.
#[allow(unused_imports)]
pub use gpufeed_testkit::{http::get as http_get, root::root_or_skip as require_root};
