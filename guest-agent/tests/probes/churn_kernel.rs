//! Pod churn: 500 pods come and go; series, owners and per-cgroup map entries
//! return to their baseline, so cardinality and kernel memory stay bounded.

use crate::common;

use std::time::Duration;

use common::*;

fn counts(agent: &Agent) -> (f64, f64, usize) {
    let s = agent.scrape();
    let owners = value(&s, "gpufeed_owners", &[("kind", "pod")]).unwrap();
    let entries = value(&s, "gpufeed_map_entries", &[("map", "sched_hist")]).unwrap();
    let series = s.iter().filter(|x| x.name.starts_with("ebpf_")).count();
    (owners, entries, series)
}

#[test]
fn five_hundred_pods_created_and_deleted_return_to_baseline() {
    let Some(_lock) = require_root() else { return };
    let t0 = std::time::Instant::now();
    let agent = Agent::no_kube("200ms", "sched_latency", &["--pod-grace", "1s"]);
    std::thread::sleep(Duration::from_millis(500));
    let base = counts(&agent);
    let sb = CgroupSandbox::new();
    let pods: Vec<Pod> = (0..500)
        .map(|i| {
            let layout = if i % 2 == 0 {
                Layout::Cgroupfs
            } else {
                Layout::Systemd
            };
            let qos = ["burstable", "besteffort", "guaranteed"][i % 3];
            Pod::new(&sb, layout, qos, &random_uid(), &random_cid())
        })
        .collect();
    // One shell visits every container cgroup and runs a short task there, so
    // each gets scheduler samples (and so cgroup storage in the kernel).
    eprintln!("500 pods made ({:?} in)", t0.elapsed());
    let script: String = pods
        .iter()
        .map(|p| format!("echo $$ > {}/cgroup.procs; /bin/true\n", p.cgroup.display()))
        .collect::<String>()
        + &format!("echo $$ > {}/cgroup.procs\n", sb.root.display());
    let path = std::env::temp_dir().join(format!("gpufeed-churn-{}.sh", uniq()));
    std::fs::write(&path, script).unwrap();
    sh(&format!("sh {}", path.display()));
    std::fs::remove_file(&path).unwrap();

    let peak = wait_for(Duration::from_secs(20), || {
        let c = counts(&agent);
        (c.0 >= base.0 + 500.0).then_some(c)
    })
    .unwrap_or_else(|| {
        let s = agent.scrape();
        panic!(
            "agent saw 500 new pods: baseline {base:?}, now {:?}; cgroups {:?}, ticks {:?}",
            counts(&agent),
            value(&s, "gpufeed_cgroups", &[]),
            value(&s, "gpufeed_ticks_total", &[]),
        )
    });
    eprintln!(
        "baseline owners/entries/series {base:?}, with 500 pods {peak:?} ({:?} in)",
        t0.elapsed()
    );
    assert!(
        peak.1 >= base.1 + 500.0,
        "each pod cgroup holds a map entry"
    );
    assert!(
        peak.2 >= base.2 + 500 * 28,
        "each pod has a histogram series"
    );

    drop(pods); // removes every pod's cgroups
    let back = wait_for(Duration::from_secs(20), || {
        let c = counts(&agent);
        (c.0 <= base.0 && c.1 <= base.1 && c.2 <= base.2).then_some(c)
    });
    eprintln!("after deletion: {back:?} ({:?} in)", t0.elapsed());
    let back =
        back.unwrap_or_else(|| panic!("back to baseline {base:?}; now {:?}", counts(&agent)));
    assert_eq!(back.0, base.0);
}

/// The kernel's word on processes: a cgroup that gains or loses a process is
/// named, and so is a process that execs or maps something at an address of
/// the kernel's choosing; a steady process is not named again.
#[test]
fn process_changes_name_the_cgroups_and_processes_that_changed() {
    use std::os::unix::fs::MetadataExt;

    let Some(_lock) = require_root() else { return };
    let mut events = gpufeed_guest::cgroups::CgroupEvents::load(false, true)
        .expect("the cgroup events with the process hooks load");
    let scratch = tempfile::tempdir().unwrap();
    let go = scratch.path().join("go");
    let sb = CgroupSandbox::new();
    let mut pod = Pod::random(&sb, Layout::Cgroupfs, "burstable");
    let cgroup = std::fs::metadata(&pod.cgroup).unwrap().ino();
    // polls without mapping anything, then allocates 64 MiB (an anonymous
    // mapping at an address the kernel picks), then sleeps
    let pid = pod.spawn(&format!(
        "exec perl -e 'select(undef, undef, undef, 0.02) until -e \"{}\"; my $x = \"a\" x (64 << 20); sleep 60'",
        go.display()
    )) as i32;
    let named = |events: &mut gpufeed_guest::cgroups::CgroupEvents| {
        let p = events.processes().expect("no change lost");
        (p.cgroups.contains(&cgroup), p.processes.contains(&pid))
    };
    // the shell moved into the cgroup and exec'd perl under the same pid
    let (mut cgroup_named, mut pid_named) = (false, false);
    let both = wait_for(Duration::from_secs(5), || {
        let (c, p) = named(&mut events);
        cgroup_named |= c;
        pid_named |= p;
        (cgroup_named && pid_named).then_some(())
    });
    assert!(both.is_some(), "the new process and its cgroup are named");
    // once perl has started: named no more while it only polls
    assert!(
        wait_for(Duration::from_secs(5), || (named(&mut events)
            == (false, false))
            .then_some(()))
        .is_some(),
        "a steady process is not named"
    );
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(named(&mut events), (false, false), "still steady");
    std::fs::write(&go, "").unwrap();
    let seen = wait_for(Duration::from_secs(5), || {
        named(&mut events).1.then_some(())
    });
    assert!(seen.is_some(), "the process that mapped memory is named");
    assert_eq!(
        named(&mut events),
        (false, true),
        "and once more in the next read (the kernel marks it before the mapping exists)"
    );
    pod.signal_all(libc::SIGKILL);
    pod.wait_exit(pid as u32, Duration::from_secs(5));
    assert!(
        wait_for(Duration::from_secs(5), || named(&mut events)
            .0
            .then_some(()))
        .is_some(),
        "the cgroup that lost its process is named"
    );
}
