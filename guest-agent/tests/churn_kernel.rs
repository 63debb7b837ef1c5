//! Pod churn: 500 pods come and go; series, owners and per-cgroup map entries
//! return to their baseline, so cardinality and kernel memory stay bounded.

mod common;

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
    .expect("agent saw 500 new pods");
    eprintln!("baseline owners/entries/series {base:?}, with 500 pods {peak:?}");
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
    eprintln!("after deletion: {back:?}");
    let back =
        back.unwrap_or_else(|| panic!("back to baseline {base:?}; now {:?}", counts(&agent)));
    assert_eq!(back.0, base.0);
}
