//! Recorded /dev/kmsg streams are classified correctly, and the parsers never panic on random
//! or mutated input (the same functions the fuzz targets in host-agent/fuzz drive).

use gpufeed_host::kmsg::{classify, parse_record, split_records, SeqTracker};
use gpufeed_shared::event::KmsgClass::*;

#[test]
fn recorded_egpu_stream_is_classified() {
    let text = include_str!("../fixtures/kmsg-egpu.txt");
    let mut seq = SeqTracker::default();
    let mut got = Vec::new();
    let mut bad = 0;
    for rec in split_records(text) {
        match parse_record(rec.as_bytes()) {
            Ok(r) => {
                seq.observe(r.seq);
                if let Some(c) = classify(&r) {
                    got.push((r.seq, c.class, c.bdf, c.vmid));
                }
            }
            Err(_) => bad += 1,
        }
    }
    let b = |s: &str| Some(s.to_string());
    assert_eq!(
        got,
        vec![
            (1201, Thunderbolt, None, None),
            (1202, Thunderbolt, None, None),
            (1203, BandwidthLimited, b("0000:0a:00.0"), None),
            (1204, Vfio, b("0000:0a:00.0"), None),
            (1205, AerSource, b("0000:0a:00.0"), None),
            (1206, AerDetail, b("0000:0a:00.0"), None),
            (1207, AerDetail, b("0000:0a:00.0"), None),
            (1208, AerDetail, b("0000:0a:00.0"), None),
            (1209, AerSource, b("0000:0a:00.0"), None),
            (1210, AerDetail, b("0000:0a:00.0"), None),
            (1211, AerDetail, b("0000:0a:00.0"), None),
            (1212, AerDetail, b("0000:0a:00.0"), None),
            (1213, AerDetail, b("0000:0a:00.0"), None),
            (1214, AerRecovery, b("0000:00:1c.4"), None),
            (1216, VmStop, None, Some(100)),
            (1217, VmStop, None, Some(100)),
            (1218, LinkDown, b("0000:00:1c.4"), None),
            (1219, CardNotPresent, b("0000:00:1c.4"), None),
            (1220, Thunderbolt, None, None),
            (1221, Retraining, b("0000:00:1c.4"), None),
            (1222, Dpc, b("0000:00:1c.4"), None),
            (1223, AerSource, b("0000:00:1c.1"), None),
            (1227, LinkUp, b("0000:00:1c.4"), None),
        ]
    );
    // garbage line, bad sequence, truncated header
    assert_eq!(bad, 3);
    // 1215 is missing from the stream and 1225 was truncated to its header: two lost records.
    assert_eq!(seq.lost_total, 2);
    // Continuation lines became the dictionary.
    let r = parse_record(split_records(text)[1].as_bytes()).unwrap();
    assert_eq!(
        r.dict,
        vec![
            ("SUBSYSTEM".into(), "thunderbolt".into()),
            ("DEVICE".into(), "+thunderbolt:0-1".into())
        ]
    );
}

const ALPHABET: &[u8] = b"0123456789abcdefx,;:.-= \n\t[]()+/\\\0\xff\xc3GT/sPCIeAER";

fn mutate(rng: &mut fastrand::Rng, seed: &[u8]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..1 + rng.usize(..8) {
        match rng.usize(..5) {
            0 if !v.is_empty() => {
                let i = rng.usize(..v.len());
                v[i] = ALPHABET[rng.usize(..ALPHABET.len())];
            }
            1 if !v.is_empty() => {
                let i = rng.usize(..v.len());
                v.truncate(i);
            }
            2 => {
                let i = rng.usize(..v.len() + 1);
                v.insert(i, rng.u8(..));
            }
            3 if !v.is_empty() => {
                let i = rng.usize(..v.len());
                v.remove(i);
            }
            _ => {
                let i = rng.usize(..v.len() + 1);
                let chunk: Vec<u8> = seed
                    .iter()
                    .skip(rng.usize(..seed.len().max(1)))
                    .take(rng.usize(..40))
                    .copied()
                    .collect();
                v.splice(i..i, chunk);
            }
        }
    }
    v
}

/// Every text parser of the agent on random and mutated input: no panic.
#[test]
fn parsers_never_panic_on_random_and_mutated_input() {
    let seeds: Vec<Vec<u8>> = vec![
        include_bytes!("../fixtures/kmsg-egpu.txt").to_vec(),
        b"3,1205,5123456789,-,caller=T98;pcieport 0000:00:1c.4: AER: Correctable error message received from 0000:0a:00.0\n SUBSYSTEM=pci\n DEVICE=+pci:0000:00:1c.4\n".to_vec(),
        b"RxErr 0\nBadTLP 3\ndev_cor_errs_bit[9] 3\nTOTAL_ERR_COR 7\n".to_vec(),
        b"16.0 GT/s PCIe\n".to_vec(),
        b"change@/devices/pci0000:00/domain0/0-0/0-1\0ACTION=change\0SUBSYSTEM=thunderbolt\0TUNNEL_EVENT=changed\0".to_vec(),
        b"irq/122-aerdrv-98 [002] ..... 5123.456789: aer_event: dev_name=0000:09:00.0 status=0x1000 (4096) severity=0x2 (2) tlp_header_valid=0x1 (1) tlp_header=ARRAY[4a, 00, 00, 01, 0f, 00, 00, 01, 00, 00, 20, 00, 00, 00, 00, 00]".to_vec(),
        b"hostpci0: host=0000:01:00.0;02:00,pcie=1\nhostpci1: mapping=gpu\n[snap]\n".to_vec(),
        b"gpu\n\tmap id=10de:2684,node=n,path=0000:01:00.0\n".to_vec(),
        b"some avg10=0.00 avg60=0.00 avg300=0.00 total=123\n".to_vec(),
        b"[pcie]\npoll_interval_ms = 100\n[bridge]\nbridges=[\"vmbr0\"]\n".to_vec(),
        // netlink: one RTM_NEWLINK with IFNAME + MASTER, then DONE
        {
            let mut m = Vec::new();
            let attrs: Vec<u8> = [&[12u8, 0, 3, 0][..], b"tap1i0\0\0", &[8, 0, 10, 0, 5, 0, 0, 0]].concat();
            let len = 16 + 16 + attrs.len();
            m.extend_from_slice(&(len as u32).to_ne_bytes());
            m.extend_from_slice(&16u16.to_ne_bytes());
            m.extend_from_slice(&[2, 0]);
            m.extend_from_slice(&7u32.to_ne_bytes());
            m.extend_from_slice(&0u32.to_ne_bytes());
            m.extend_from_slice(&[0u8; 16]);
            m.extend_from_slice(&attrs);
            m.extend_from_slice(&20u32.to_ne_bytes());
            m.extend_from_slice(&3u16.to_ne_bytes());
            m.extend_from_slice(&[2, 0]);
            m.extend_from_slice(&7u32.to_ne_bytes());
            m.extend_from_slice(&[0u8; 8]);
            m
        },
        // netlink: one RTM_NEWSTATS (if_stats_msg + IFLA_STATS_LINK_64 of 25 counters)
        {
            let mut m = Vec::new();
            let len = 16 + 12 + 4 + 25 * 8;
            m.extend_from_slice(&(len as u32).to_ne_bytes());
            m.extend_from_slice(&92u16.to_ne_bytes());
            m.extend_from_slice(&[2, 0]);
            m.extend_from_slice(&7u32.to_ne_bytes());
            m.extend_from_slice(&0u32.to_ne_bytes());
            m.extend_from_slice(&[0, 0, 0, 0]);
            m.extend_from_slice(&5u32.to_ne_bytes());
            m.extend_from_slice(&1u32.to_ne_bytes());
            m.extend_from_slice(&((4 + 25 * 8) as u16).to_ne_bytes());
            m.extend_from_slice(&1u16.to_ne_bytes());
            for i in 0..25u64 {
                m.extend_from_slice(&(i * 1000).to_ne_bytes());
            }
            m
        },
    ];
    let dir = tempfile::tempdir().unwrap();
    // fixed seed: the same inputs every run
    let mut rng = fastrand::Rng::with_seed(0x9E3779B97F4A7C15);
    let mut n = 0;
    for round in 0..20_000 {
        let input = if round % 5 == 0 {
            (0..rng.usize(..300))
                .map(|_| rng.u8(..))
                .collect::<Vec<u8>>()
        } else {
            let s = &seeds[rng.usize(..seeds.len())];
            mutate(&mut rng, s)
        };
        gpufeed_host::fuzzing::all(&input);
        if round % 2000 == 0 {
            // The file-based parsers too (Proxmox configs).
            let etc = dir.path().join("etc/pve/qemu-server");
            std::fs::create_dir_all(&etc).unwrap();
            std::fs::create_dir_all(dir.path().join("etc/pve/mapping")).unwrap();
            std::fs::write(etc.join("100.conf"), &input).unwrap();
            std::fs::write(dir.path().join("etc/pve/mapping/pci.cfg"), &input).unwrap();
            let roots = gpufeed_host::roots::Roots::new(dir.path());
            let _ = gpufeed_host::discovery::scan_pve(&roots, "n");
        }
        n += 1;
    }
    assert_eq!(n, 20_000);
    // Sanity: the netlink seed itself decodes to one row.
    let mut rows = Vec::new();
    let done = gpufeed_host::rtnetlink::parse_dump_chunk(&seeds[10], 7, &mut rows).unwrap();
    assert!(done);
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].name.as_str(), rows[0].master), ("tap1i0", Some(5)));
}
