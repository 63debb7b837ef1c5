//! The lab's parsers on the formats they read: apt's answers and the kernel's module lists.
//! Here and not beside the code: every test of the lab is in `lab/tests/`, which
//! scripts/test.sh runs as a stream of its own beside the rest of the suite.

use gpufeed_lab::apt::{in_suite, parse_depends, parse_madison, Candidate};
use gpufeed_lab::initramfs::load_order;

#[test]
fn reads_apts_formats() {
    let m = "linux-image-cloud-amd64 | 7.3.4-1~bpo13+1 | http://deb.debian.org/debian trixie-backports/main amd64 Packages\n\
             linux-image-cloud-amd64 |  6.1.176-1 | http://deb.debian.org/debian bookworm/main amd64 Packages\n";
    let c = parse_madison(m);
    assert_eq!(
        c,
        vec![
            Candidate {
                version: "7.3.4-1~bpo13+1".into(),
                suite: "trixie-backports".into()
            },
            Candidate {
                version: "6.1.176-1".into(),
                suite: "bookworm".into()
            }
        ]
    );
    assert_eq!(
        in_suite(&c, "linux-image-cloud-amd64", "bookworm").unwrap(),
        "6.1.176-1"
    );
    assert!(in_suite(&c, "x", "sid").is_err());
    let show = "Package: linux-image-7.3.4+deb13-cloud-amd64\nDepends: dracut | initramfs-tools (>= 0.120+deb8u2) | linux-initramfs-tool, linux-binary-7.3.4+deb13-cloud-amd64 (= 7.3.4-1~bpo13+1), kmod\n";
    assert_eq!(
        parse_depends(show),
        vec![
            ("dracut".into(), None),
            (
                "linux-binary-7.3.4+deb13-cloud-amd64".into(),
                Some("7.3.4-1~bpo13+1".into())
            ),
            ("kmod".into(), None)
        ]
    );
}

#[test]
fn dependencies_load_first_and_builtins_are_skipped() {
    let dep = "kernel/drivers/block/virtio_blk.ko.xz: kernel/drivers/virtio/virtio_ring.ko.xz kernel/drivers/virtio/virtio.ko.xz\n\
               kernel/drivers/net/virtio_net.ko.xz: kernel/net/core/failover.ko.xz kernel/drivers/virtio/virtio_ring.ko.xz kernel/drivers/virtio/virtio.ko.xz\n\
               kernel/drivers/virtio/virtio.ko.xz:\n";
    let builtin = "kernel/drivers/virtio/virtio_pci.ko\n";
    let o = load_order(dep, builtin, &["virtio_pci", "virtio_blk", "virtio_net"]).unwrap();
    assert_eq!(
        o,
        vec![
            "kernel/drivers/virtio/virtio.ko.xz",
            "kernel/drivers/virtio/virtio_ring.ko.xz",
            "kernel/drivers/block/virtio_blk.ko.xz",
            "kernel/net/core/failover.ko.xz",
            "kernel/drivers/net/virtio_net.ko.xz",
        ]
    );
    assert!(load_order(dep, builtin, &["nope"]).is_err());
}
