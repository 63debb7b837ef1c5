//! Cgroup path → pod classification for both kubelet cgroup drivers.
//!
//! cgroupfs driver (Talos, k3s, kind without systemd):
//!   `/kubepods/burstable/pod<uid>/<64-hex cid>`, `/kubepods/besteffort/pod<uid>/<cid>`,
//!   Guaranteed pods directly at `/kubepods/pod<uid>/<cid>`.
//! systemd driver:
//!   `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>.slice/
//!    cri-containerd-<cid>.scope` (also `crio-<cid>.scope`, `docker-<cid>.scope`,
//!   `crio-conmon-<cid>.scope`), Guaranteed `kubepods.slice/kubepods-pod<uid>.slice/...`.
//!   A kubelet `--cgroup-root` under systemd prefixes every slice name, e.g. kind's
//!   `kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/...`; that is handled
//!   too.
//!
//! The kubepods component may sit anywhere in the path (kind, docker-in-docker, test prefixes).
//! Everything that is not a pod is classified by its first path component.

/// Kubernetes QoS class of a pod, as encoded in its cgroup path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Qos {
    Guaranteed,
    Burstable,
    BestEffort,
}

impl Qos {
    /// The value Kubernetes uses in `status.qosClass`.
    pub fn as_str(self) -> &'static str {
        match self {
            Qos::Guaranteed => "Guaranteed",
            Qos::Burstable => "Burstable",
            Qos::BestEffort => "BestEffort",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CgroupClass {
    /// A pod cgroup or one of its container cgroups. `uid` with dashes (the systemd form's
    /// underscores normalised), lower case; `container_id` = the 64-hex id without runtime
    /// prefix/suffix, lower case. `container_id` is `None` for the pod cgroup itself, for
    /// crio's `crio-conmon-<cid>.scope` and for any other unrecognised child of the pod cgroup.
    Pod {
        uid: String,
        container_id: Option<String>,
        qos: Qos,
    },
    /// Not a pod: the name of the top-level cgroup it sits under, verbatim (e.g.
    /// "system.slice", "init", "system", "podruntime", "user.slice", "kubepods" or
    /// "kubepods.slice" for kubepods-level non-pod dirs); "" for the root cgroup itself.
    Slice(String),
}

/// Longest pod UID we accept (UUIDs are 36, static-pod config hashes 32).
const MAX_UID_LEN: usize = 64;
/// Runtime prefixes of container scopes/directories, longest first where they overlap.
const RUNTIME_PREFIXES: &[&str] = &["cri-containerd-", "containerd-", "crio-", "docker-"];

/// Classify a cgroup v2 path relative to the cgroup2 mount (starting with '/'; a missing
/// leading slash, repeated or trailing slashes are tolerated). Never panics.
pub fn classify_cgroup(path: &str) -> CgroupClass {
    let comps: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    let Some(first) = comps.first() else {
        return CgroupClass::Slice(String::new());
    };
    let slice = || CgroupClass::Slice((*first).to_string());

    for (i, comp) in comps.iter().enumerate() {
        if *comp == "kubepods" {
            return classify_cgroupfs(&comps[i + 1..]).unwrap_or_else(slice);
        }
        if let Some(base) = comp.strip_suffix(".slice") {
            if base == "kubepods" || base.ends_with("-kubepods") {
                return classify_systemd(base, &comps[i + 1..]).unwrap_or_else(slice);
            }
        }
    }
    slice()
}

/// `rest` = components below `kubepods`.
fn classify_cgroupfs(rest: &[&str]) -> Option<CgroupClass> {
    let (qos, pod_idx) = match *rest.first()? {
        "burstable" => (Qos::Burstable, 1),
        "besteffort" => (Qos::BestEffort, 1),
        _ => (Qos::Guaranteed, 0),
    };
    let uid = parse_uid(rest.get(pod_idx)?.strip_prefix("pod")?)?;
    let container_id = rest.get(pod_idx + 1).and_then(|c| parse_container(c));
    Some(CgroupClass::Pod {
        uid,
        container_id,
        qos,
    })
}

/// `base` = the kubepods slice name without ".slice" (usually "kubepods"); `rest` = components
/// below it.
fn classify_systemd(base: &str, rest: &[&str]) -> Option<CgroupClass> {
    // The pod slice is either directly below (Guaranteed) or below the QoS slice.
    let first = rest.first()?;
    let (pod_comp, container_idx) = if parse_qos_slice(base, first).is_some() {
        (rest.get(1)?, 2)
    } else {
        (first, 1)
    };
    let name = pod_comp.strip_suffix(".slice")?;
    let name = name.strip_prefix(base)?.strip_prefix('-')?;
    let (qos, uid) = if let Some(u) = name.strip_prefix("pod") {
        (Qos::Guaranteed, u)
    } else if let Some(u) = name.strip_prefix("burstable-pod") {
        (Qos::Burstable, u)
    } else if let Some(u) = name.strip_prefix("besteffort-pod") {
        (Qos::BestEffort, u)
    } else {
        return None;
    };
    let uid = parse_uid(uid)?;
    let container_id = rest.get(container_idx).and_then(|c| parse_container(c));
    Some(CgroupClass::Pod {
        uid,
        container_id,
        qos,
    })
}

fn parse_qos_slice(base: &str, comp: &str) -> Option<Qos> {
    let q = comp
        .strip_suffix(".slice")?
        .strip_prefix(base)?
        .strip_prefix('-')?;
    match q {
        "burstable" => Some(Qos::Burstable),
        "besteffort" => Some(Qos::BestEffort),
        _ => None,
    }
}

/// Pod UID from the part after "pod": hex digits and dashes (or underscores, systemd form),
/// at least one hex digit. Returned with dashes, lower case.
fn parse_uid(s: &str) -> Option<String> {
    if s.is_empty() || s.len() > MAX_UID_LEN {
        return None;
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_hexdigit() || b == b'-' || b == b'_')
    {
        return None;
    }
    if !s.bytes().any(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    Some(
        s.bytes()
            .map(|b| {
                if b == b'_' {
                    '-'
                } else {
                    b.to_ascii_lowercase() as char
                }
            })
            .collect(),
    )
}

/// Container id from a container cgroup name: a bare 64-hex id (cgroupfs) or
/// `<runtime>-<64 hex>[.scope]` (systemd); `crio-conmon-<id>` is not a container.
fn parse_container(comp: &str) -> Option<String> {
    let name = comp.strip_suffix(".scope").unwrap_or(comp);
    if name.starts_with("crio-conmon-") {
        return None;
    }
    let id = RUNTIME_PREFIXES
        .iter()
        .find_map(|p| name.strip_prefix(p))
        .unwrap_or(name);
    if id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
        Some(id.to_ascii_lowercase())
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "1b2c3d4e-5f60-4718-9a2b-3c4d5e6f7a8b";
    const UID_US: &str = "1b2c3d4e_5f60_4718_9a2b_3c4d5e6f7a8b";
    const CID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn pod(qos: Qos, cid: Option<&str>) -> CgroupClass {
        CgroupClass::Pod {
            uid: UID.to_string(),
            container_id: cid.map(str::to_string),
            qos,
        }
    }

    fn slice(s: &str) -> CgroupClass {
        CgroupClass::Slice(s.to_string())
    }

    #[test]
    fn cgroupfs_burstable_and_besteffort_containers() {
        assert_eq!(
            classify_cgroup(&format!("/kubepods/burstable/pod{UID}/{CID}")),
            pod(Qos::Burstable, Some(CID))
        );
        assert_eq!(
            classify_cgroup(&format!("/kubepods/besteffort/pod{UID}/{CID}")),
            pod(Qos::BestEffort, Some(CID))
        );
    }

    #[test]
    fn cgroupfs_guaranteed_directly_under_kubepods() {
        assert_eq!(
            classify_cgroup(&format!("/kubepods/pod{UID}/{CID}")),
            pod(Qos::Guaranteed, Some(CID))
        );
        assert_eq!(
            classify_cgroup(&format!("/kubepods/pod{UID}")),
            pod(Qos::Guaranteed, None)
        );
    }

    #[test]
    fn cgroupfs_pod_level_cgroup_has_no_container() {
        assert_eq!(
            classify_cgroup(&format!("/kubepods/burstable/pod{UID}")),
            pod(Qos::Burstable, None)
        );
        assert_eq!(
            classify_cgroup(&format!("/kubepods/besteffort/pod{UID}/")),
            pod(Qos::BestEffort, None)
        );
    }

    #[test]
    fn cgroupfs_subcgroups_of_a_container_belong_to_the_container() {
        assert_eq!(
            classify_cgroup(&format!("/kubepods/burstable/pod{UID}/{CID}/init.scope/x")),
            pod(Qos::Burstable, Some(CID))
        );
    }

    #[test]
    fn cgroupfs_crio_named_container_dirs() {
        assert_eq!(
            classify_cgroup(&format!("/kubepods/burstable/pod{UID}/crio-{CID}")),
            pod(Qos::Burstable, Some(CID))
        );
        assert_eq!(
            classify_cgroup(&format!("/kubepods/burstable/pod{UID}/crio-conmon-{CID}")),
            pod(Qos::Burstable, None)
        );
    }

    #[test]
    fn systemd_all_runtimes_and_qos() {
        for rt in ["cri-containerd", "crio", "docker"] {
            assert_eq!(
                classify_cgroup(&format!(
                    "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_US}.slice/{rt}-{CID}.scope"
                )),
                pod(Qos::Burstable, Some(CID)),
                "runtime {rt}"
            );
            assert_eq!(
                classify_cgroup(&format!(
                    "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_US}.slice/{rt}-{CID}.scope"
                )),
                pod(Qos::BestEffort, Some(CID)),
                "runtime {rt}"
            );
            assert_eq!(
                classify_cgroup(&format!(
                    "/kubepods.slice/kubepods-pod{UID_US}.slice/{rt}-{CID}.scope"
                )),
                pod(Qos::Guaranteed, Some(CID)),
                "runtime {rt}"
            );
        }
    }

    #[test]
    fn systemd_pod_slice_and_conmon_have_no_container() {
        assert_eq!(
            classify_cgroup(&format!(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_US}.slice"
            )),
            pod(Qos::Burstable, None)
        );
        assert_eq!(
            classify_cgroup(&format!(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_US}.slice/crio-conmon-{CID}.scope"
            )),
            pod(Qos::Burstable, None)
        );
        assert_eq!(
            classify_cgroup(&format!("/kubepods.slice/kubepods-pod{UID_US}.slice")),
            pod(Qos::Guaranteed, None)
        );
    }

    #[test]
    fn systemd_uid_underscores_become_dashes() {
        let CgroupClass::Pod { uid, .. } = classify_cgroup(&format!(
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_US}.slice"
        )) else {
            panic!("not a pod");
        };
        assert_eq!(uid, UID);
        assert!(!uid.contains('_'));
    }

    #[test]
    fn systemd_with_kubelet_cgroup_root_prefix_kind() {
        assert_eq!(
            classify_cgroup(&format!(
                "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{UID_US}.slice/cri-containerd-{CID}.scope"
            )),
            pod(Qos::BestEffort, Some(CID))
        );
        assert_eq!(
            classify_cgroup(&format!(
                "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{UID_US}.slice/cri-containerd-{CID}.scope"
            )),
            pod(Qos::Guaranteed, Some(CID))
        );
        assert_eq!(
            classify_cgroup(
                "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice"
            ),
            slice("kubelet.slice")
        );
    }

    #[test]
    fn nested_kubepods_anywhere() {
        assert_eq!(
            classify_cgroup(&format!(
                "/gpufeed-test-1234/kubepods/burstable/pod{UID}/{CID}"
            )),
            pod(Qos::Burstable, Some(CID))
        );
        assert_eq!(
            classify_cgroup(&format!(
                "/docker/abcd/kubepods.slice/kubepods-pod{UID_US}.slice/docker-{CID}.scope"
            )),
            pod(Qos::Guaranteed, Some(CID))
        );
        assert_eq!(
            classify_cgroup(&format!("/a/b/c/kubepods/pod{UID}/{CID}")),
            pod(Qos::Guaranteed, Some(CID))
        );
    }

    #[test]
    fn nested_non_pod_dirs_take_the_first_component() {
        assert_eq!(
            classify_cgroup("/gpufeed-test-1234/kubepods/burstable"),
            slice("gpufeed-test-1234")
        );
        assert_eq!(
            classify_cgroup("/gpufeed-test-1234/kubepods"),
            slice("gpufeed-test-1234")
        );
        assert_eq!(
            classify_cgroup("/gpufeed-test-1234/workload"),
            slice("gpufeed-test-1234")
        );
    }

    #[test]
    fn kubepods_level_non_pod_dirs() {
        assert_eq!(classify_cgroup("/kubepods"), slice("kubepods"));
        assert_eq!(classify_cgroup("/kubepods/burstable"), slice("kubepods"));
        assert_eq!(classify_cgroup("/kubepods/besteffort"), slice("kubepods"));
        assert_eq!(
            classify_cgroup("/kubepods/burstable/notapod"),
            slice("kubepods")
        );
        assert_eq!(classify_cgroup("/kubepods.slice"), slice("kubepods.slice"));
        assert_eq!(
            classify_cgroup("/kubepods.slice/kubepods-burstable.slice"),
            slice("kubepods.slice")
        );
        assert_eq!(
            classify_cgroup("/kubepods.slice/kubepods-besteffort.slice/other.slice"),
            slice("kubepods.slice")
        );
    }

    #[test]
    fn talos_and_systemd_system_slices() {
        assert_eq!(classify_cgroup("/init"), slice("init"));
        assert_eq!(classify_cgroup("/system/runtime"), slice("system"));
        assert_eq!(classify_cgroup("/system/apid"), slice("system"));
        assert_eq!(classify_cgroup("/podruntime/kubelet"), slice("podruntime"));
        assert_eq!(classify_cgroup("/podruntime/etcd"), slice("podruntime"));
        assert_eq!(
            classify_cgroup("/system.slice/containerd.service"),
            slice("system.slice")
        );
        assert_eq!(
            classify_cgroup("/user.slice/user-1000.slice/session-3.scope"),
            slice("user.slice")
        );
        assert_eq!(classify_cgroup("/init.scope"), slice("init.scope"));
    }

    #[test]
    fn root_cgroup_is_empty_slice() {
        assert_eq!(classify_cgroup("/"), slice(""));
        assert_eq!(classify_cgroup(""), slice(""));
        assert_eq!(classify_cgroup("///"), slice(""));
    }

    #[test]
    fn tolerant_of_slashes_and_case() {
        assert_eq!(
            classify_cgroup(&format!("kubepods//burstable/pod{UID}//{CID}/")),
            pod(Qos::Burstable, Some(CID))
        );
        let upper_uid = UID.to_uppercase();
        let upper_cid = CID.to_uppercase();
        assert_eq!(
            classify_cgroup(&format!("/kubepods/pod{upper_uid}/{upper_cid}")),
            pod(Qos::Guaranteed, Some(CID))
        );
    }

    #[test]
    fn static_pod_hash_uid_is_accepted() {
        let hash = "5d6e8c0c9a1f7b2e3d4c5b6a79880716";
        assert_eq!(
            classify_cgroup(&format!("/kubepods/burstable/pod{hash}/{CID}")),
            CgroupClass::Pod {
                uid: hash.to_string(),
                container_id: Some(CID.to_string()),
                qos: Qos::Burstable
            }
        );
    }

    #[test]
    fn non_container_children_of_a_pod() {
        // wrong length, non-hex, unknown runtime suffix
        for child in [
            &CID[..63],
            &format!("{CID}0"),
            &format!("{}g", &CID[..63]),
            "cri-containerd-.scope",
            "cri-containerd-xyz.scope",
            ".scope",
            "-",
        ] {
            assert_eq!(
                classify_cgroup(&format!("/kubepods/burstable/pod{UID}/{child}")),
                pod(Qos::Burstable, None),
                "child {child:?}"
            );
        }
    }

    #[test]
    fn hostile_pod_components_are_not_pods() {
        for p in [
            "/kubepods/pod",
            "/kubepods/pod/",
            "/kubepods/burstable/pod",
            "/kubepods/burstable/pod---",
            "/kubepods/burstable/pod___",
            "/kubepods/burstable/pod../x",
            "/kubepods/burstable/pod%2e%2e",
            "/kubepods/burstable/pod\u{0}\u{1}",
            "/kubepods/burstable/podé",
            "/kubepods/burstable/pod😀😀",
            "/kubepods/guaranteed/pod1234",
            "/kubepods/podnot-a-uid",
            "/kubepods.slice/kubepods-pod.slice",
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod.slice",
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podzz.slice",
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234",
            "/kubepods.slice/kubepods-burstable.slice/other-burstable-pod1234.slice",
            "/kubepods.slice/kubepods-unknown-pod1234.slice",
            "/kubepods.slice/.slice",
            "/kubepods.slice/-.slice",
        ] {
            let top = p.split('/').nth(1).unwrap();
            assert_eq!(classify_cgroup(p), slice(top), "path {p:?}");
        }
        let long = format!("/kubepods/pod{}", "a".repeat(65));
        assert_eq!(classify_cgroup(&long), slice("kubepods"));
        let ok = format!("/kubepods/pod{}", "a".repeat(64));
        assert!(matches!(classify_cgroup(&ok), CgroupClass::Pod { .. }));
    }

    #[test]
    fn hostile_strings_never_panic() {
        let mut inputs: Vec<String> = vec![
            "\u{0}".into(),
            "/\u{0}/kubepods".into(),
            "kubepods.slice".into(),
            ".slice".into(),
            "/kubepods.slice/kubepods-".into(),
            "/kubepods.slice/kubepods-burstable.slice/".into(),
            "/-kubepods.slice/-pod1.slice".into(),
            "/é/kubepods/pod€/ü".into(),
            "/".repeat(10_000),
            format!("/{}", "kubepods/".repeat(5_000)),
            format!("/{}", "x".repeat(100_000)),
        ];
        // every prefix of a valid path (byte-wise where it is a char boundary)
        let full = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_US}.slice/cri-containerd-{CID}.scope/é"
        );
        for i in 0..=full.len() {
            if full.is_char_boundary(i) {
                inputs.push(full[..i].to_string());
            }
        }
        for s in &inputs {
            let _ = classify_cgroup(s);
        }
        // repeated kubepods: the first one wins; "kubepods" below it is not a QoS dir
        assert_eq!(
            classify_cgroup(&format!("/{}", "kubepods/".repeat(5_000))),
            slice("kubepods")
        );
        // prefixes of the systemd path: pod from the pod slice on
        let pod_slice_end = full.find(".slice/cri").unwrap() + ".slice".len();
        assert_eq!(
            classify_cgroup(&full[..pod_slice_end]),
            pod(Qos::Burstable, None)
        );
        assert_eq!(
            classify_cgroup(&full[..pod_slice_end - 1]),
            slice("kubepods.slice")
        );
        let scope_end = full.find(".scope").unwrap() + ".scope".len();
        assert_eq!(
            classify_cgroup(&full[..scope_end]),
            pod(Qos::Burstable, Some(CID))
        );
        assert_eq!(classify_cgroup(&full), pod(Qos::Burstable, Some(CID)));
    }

    #[test]
    fn qos_names_match_kubernetes() {
        assert_eq!(Qos::Guaranteed.as_str(), "Guaranteed");
        assert_eq!(Qos::Burstable.as_str(), "Burstable");
        assert_eq!(Qos::BestEffort.as_str(), "BestEffort");
    }
}
