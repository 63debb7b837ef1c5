//! The Helm chart `charts/gpufeed/`, through Helm v4's own library (PyPI's helm-python-sdk,
//! pinned in guest-agent/tests/schemas/requirements.txt and installed with the pinned kubectl
//! by scripts/schema-tools.sh; no helm binary is published on the registries this project
//! reaches): `helm lint --strict` for every documented values set; `helm template` of each
//! against the kustomize overlay it stands for, object for object (one source of truth: a
//! change to either that the other lacks fails here); every rendered object against its
//! upstream schema and the DaemonSet's arguments against the real binary; bad values refused
//! by values.schema.json or the templates with a message naming the value; the TLS Secret made
//! from `gpufeed-guest certs init`'s files; and upgrades between values sets changing exactly
//! the objects and fields the values name. No cluster, no root.

use crate::manifests;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use manifests::*;
use serde_yaml::Value;

const BIN: &str = env!("CARGO_BIN_EXE_gpufeed-guest");

/// A documented values set: `charts/gpufeed/examples/<name>.yaml`.
fn example(name: &str) -> String {
    chart_dir()
        .join("examples")
        .join(format!("{name}.yaml"))
        .display()
        .to_string()
}

/// The documented values sets (docs/install.md) with the kustomize overlay each renders, and
/// the extra `--set`s the comparison needs: the Namespace, which `helm install --namespace`
/// needs to exist before it and kustomize renders.
fn documented_sets() -> Vec<(&'static str, Vec<String>, &'static str)> {
    vec![
        ("defaults", vec![], "base"),
        ("operator", vec![example("operator")], "overlays/operator"),
        ("stream", vec![example("stream")], "overlays/stream"),
        ("full", vec![example("full")], "overlays/full"),
    ]
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// (kind, namespace, name) → object.
fn by_identity(objs: &[Value]) -> BTreeMap<(String, String, String), Value> {
    let mut out = BTreeMap::new();
    for o in objs {
        let id = (
            o["kind"].as_str().unwrap().to_string(),
            o["metadata"]["namespace"]
                .as_str()
                .unwrap_or("")
                .to_string(),
            o["metadata"]["name"].as_str().unwrap().to_string(),
        );
        assert!(out.insert(id.clone(), o.clone()).is_none(), "{id:?} twice");
    }
    out
}

/// The object with the one label that names the tool (`managed-by`: kustomize or Helm)
/// replaced by a placeholder, on the object and on its pod template.
fn without_tool(o: &Value) -> Value {
    fn replace(labels: Option<&mut Value>) {
        let Some(m) = labels.and_then(Value::as_mapping_mut) else {
            return;
        };
        if let Some(v) = m.get_mut("app.kubernetes.io/managed-by") {
            let tool = v.as_str().unwrap().to_string();
            assert!(tool == "Helm" || tool == "kustomize", "managed-by {tool}");
            *v = "TOOL".into();
        }
    }
    let mut o = o.clone();
    replace(o.get_mut("metadata").and_then(|m| m.get_mut("labels")));
    replace(
        o.get_mut("spec")
            .and_then(|s| s.get_mut("template"))
            .and_then(|t| t.get_mut("metadata"))
            .and_then(|m| m.get_mut("labels")),
    );
    o
}

/// Every difference between two values, as JSON-pointer-like paths.
fn differences(a: &Value, b: &Value, path: &str, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Mapping(x), Value::Mapping(y)) => {
            let keys: BTreeSet<String> = x
                .keys()
                .chain(y.keys())
                .map(|k| serde_yaml::to_string(k).unwrap().trim().to_string())
                .collect();
            for k in keys {
                let key = Value::from(k.as_str());
                let p = format!("{path}/{k}");
                match (x.get(&key), y.get(&key)) {
                    (Some(l), Some(r)) => differences(l, r, &p, out),
                    (Some(_), None) | (None, Some(_)) => out.push(p),
                    (None, None) => out.push(format!("{p} (key not a string)")),
                }
            }
        }
        (Value::Sequence(x), Value::Sequence(y)) if x.len() == y.len() => {
            for (i, (l, r)) in x.iter().zip(y).enumerate() {
                differences(l, r, &format!("{path}/{i}"), out);
            }
        }
        _ if a == b => {}
        _ => out.push(path.to_string()),
    }
}

fn diff(a: &Value, b: &Value) -> Vec<String> {
    let mut out = Vec::new();
    differences(a, b, "", &mut out);
    out
}

fn daemonset_args(objs: &[Value]) -> Vec<String> {
    object(objs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

/// The real binary accepts the DaemonSet's arguments (`--help` last: everything before it is
/// parsed and its values checked).
fn binary_accepts(what: &str, objs: &[Value]) {
    let mut a = daemonset_args(objs);
    assert_eq!(a[0], "run", "{what}");
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

#[test]
fn lint_passes_strict_for_every_documented_values_set() {
    let mut sets: Vec<Vec<String>> = documented_sets().into_iter().map(|s| s.1).collect();
    sets.push(vec![example("full"), example("finops")]);
    for args in sets {
        let report = helm_lint(&strs(&args));
        assert_eq!(report["total_charts_linted"].as_u64(), Some(1), "{report}");
        assert_eq!(
            report["errors"],
            serde_json::json!([]),
            "{args:?}: {report}"
        );
        // strict: no warning or error; an info (Chart.yaml has no icon) is allowed
        for m in report["messages"].as_array().unwrap() {
            assert!(m["severity"].as_u64() < Some(2), "{args:?}: {m}");
        }
    }
    // and lint does fail: a values file the schema refuses
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "hostStream:\n  enabled: yes please\n").unwrap();
    let report = helm_lint(&[bad.to_str().unwrap()]);
    let all = report.to_string();
    assert!(
        all.contains("/hostStream/enabled") && all.contains("want boolean"),
        "{report}"
    );
}

/// One source of truth: each documented values set renders, object for object and field for
/// field, what its kustomize overlay does (the `managed-by` label names the tool); the KEDA
/// values the ScaledObject of the application overlay the KEDA component's header shows.
#[test]
fn the_chart_renders_what_the_overlays_do() {
    for (name, mut args, overlay) in documented_sets() {
        args.extend(["--set".to_string(), "namespace.create=true".to_string()]);
        let chart = by_identity(&helm_template(&strs(&args)));
        let kust = by_identity(&kustomize(overlay));
        assert_eq!(
            chart.keys().collect::<Vec<_>>(),
            kust.keys().collect::<Vec<_>>(),
            "{name} vs {overlay}: the objects"
        );
        for (id, k) in &kust {
            let d = diff(&without_tool(k), &without_tool(&chart[id]));
            assert!(d.is_empty(), "{name} vs {overlay}: {id:?} differs at {d:?}");
        }
    }
    // without namespace.create (helm install --namespace): all but the Namespace
    let chart = by_identity(&helm_template(&[]));
    let kust = by_identity(&kustomize("base"));
    let missing: Vec<_> = kust.keys().filter(|k| !chart.contains_key(*k)).collect();
    assert_eq!(
        missing,
        [&(
            "Namespace".to_string(),
            String::new(),
            "gpufeed".to_string()
        )]
    );

    let chart = helm_template(&[&example("full"), &example("finops")]);
    let app = keda_application_overlay();
    let so = object(&chart, "ScaledObject");
    let d = diff(object(&app, "ScaledObject"), so);
    assert!(d.is_empty(), "ScaledObject differs at {d:?}");
    // and the agent labels the series the ScaledObject selects: app="chat" is the value of
    // the pods' app.kubernetes.io/name, which --pod-label app=... puts on the GPU series
    let query = so["spec"]["triggers"][0]["metadata"]["query"]
        .as_str()
        .unwrap();
    assert!(query.contains("{app=\"chat\"}"), "{query}");
    let deploy = object(&app, "Deployment");
    assert_eq!(
        deploy["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"].as_str(),
        Some("chat")
    );
    assert!(daemonset_args(&chart).contains(&"--pod-label=app=app.kubernetes.io/name".into()));
}

/// Every object of every documented values set (the cost settings, the KEDA ScaledObject and
/// the TLS Secret included) against its upstream schema: core objects against Kubernetes'
/// own, strict; the CRs against their projects' published CRDs. The DaemonSet's arguments are
/// parsed by the real binary.
#[test]
fn every_rendered_object_is_valid_against_its_upstream_schema() {
    let certs = tempfile::tempdir().unwrap();
    let files = certs_init(certs.path());
    let mut sets: Vec<(String, Vec<String>)> = documented_sets()
        .into_iter()
        .map(|(n, mut a, _)| {
            a.extend(["--set".into(), "namespace.create=true".into()]);
            (n.to_string(), a)
        })
        .collect();
    let mut finops = vec![example("full"), example("finops")];
    finops.extend(set_files(&files));
    sets.push(("full+finops+TLS Secret".into(), finops));
    let mut kinds = BTreeSet::new();
    for (name, args) in sets {
        let objs = helm_template(&strs(&args));
        binary_accepts(&name, &objs);
        let (crs, core): (Vec<Value>, Vec<Value>) = objs.into_iter().partition(is_custom_resource);
        for (o, e) in core.iter().zip(core_errors(&core)) {
            assert!(e.is_empty(), "{name}: {:?}: {e:?}", o["kind"]);
        }
        for (o, e) in crs.iter().zip(crd_errors(&crs)) {
            assert!(e.is_empty(), "{name}: {:?}: {e:?}", o["kind"]);
        }
        kinds.extend(
            core.iter()
                .chain(&crs)
                .map(|o| o["kind"].as_str().unwrap().to_string()),
        );
    }
    let all: BTreeSet<String> = [
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
        "Namespace",
        "PodMonitor",
        "PrometheusRule",
        "ScaledObject",
        "Secret",
        "Service",
        "ServiceAccount",
    ]
    .map(String::from)
    .into();
    assert_eq!(kinds, all, "every kind the chart can render was checked");

    // the cost settings reach the binary as its flags
    let objs = helm_template(&[&example("full"), &example("finops")]);
    let a = daemonset_args(&objs);
    for flag in [
        "--pod-label=app=app.kubernetes.io/name",
        "--pod-label=tenant=team.example.com/tenant",
        "--gpu-hourly-rate=2.5",
        "--gpu-cost-currency=EUR",
        "--gpu-cost-weights=0.55,0.35,0.10",
        "--gpu-memory-bytes=80GiB",
    ] {
        assert!(a.contains(&flag.to_string()), "{flag} in {a:?}");
    }
}

/// `gpufeed-guest certs init` into `dir`: the guest's files (name → path).
fn certs_init(dir: &std::path::Path) -> BTreeMap<String, std::path::PathBuf> {
    let o = Command::new(BIN)
        .args(["certs", "init", "--out"])
        .arg(dir.join("certs"))
        .args(["--guest-addr", "10.0.0.20:7845", "--host", "pve1"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::read_dir(dir.join("certs/guest"))
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .filter(|(n, _)| !n.ends_with(".yaml"))
        .collect()
}

/// The `--set-file`s docs/install.md gives for the TLS Secret, and `hostStream.tls.create`.
fn set_files(files: &BTreeMap<String, std::path::PathBuf>) -> Vec<String> {
    let mut a = vec!["--set".into(), "hostStream.tls.create=true".into()];
    for (name, path) in files {
        // a dot in a key is escaped in Helm's --set syntax
        let key = name.replace('.', "\\.");
        a.push("--set-file".into());
        a.push(format!("hostStream.tls.files.{key}={}", path.display()));
    }
    a
}

/// The stream's Secret from the chart: exactly the files `certs init` wrote for the guest,
/// under the name and in the namespace the DaemonSet mounts; a missing file is named.
#[test]
fn the_tls_secret_holds_the_files_of_certs_init() {
    let dir = tempfile::tempdir().unwrap();
    let files = certs_init(dir.path());
    assert_eq!(
        files.keys().map(String::as_str).collect::<Vec<_>>(),
        ["allowed-hosts", "ca.pem", "guest-key.pem", "guest.pem"]
    );
    let mut args = vec![example("stream")];
    args.extend(set_files(&files));
    let objs = try_helm_template("gpufeed", "monitoring", false, &strs(&args)).unwrap();
    let secret = object(&objs, "Secret");
    let ds = object(&objs, "DaemonSet");
    let vol = ds["spec"]["template"]["spec"]["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "tls")
        .unwrap();
    assert_eq!(secret["metadata"]["name"], vol["secret"]["secretName"]);
    assert_eq!(secret["metadata"]["namespace"].as_str(), Some("monitoring"));
    assert_eq!(ds["metadata"]["namespace"].as_str(), Some("monitoring"));
    let data = secret["data"].as_mapping().unwrap();
    assert_eq!(data.len(), files.len());
    for (name, path) in &files {
        let b64 = data[&Value::from(name.as_str())].as_str().unwrap();
        let decoded = base64_decode(b64);
        assert_eq!(decoded, std::fs::read(path).unwrap(), "{name}");
    }

    // one file left out: refused, naming it and how to give it
    let partial: BTreeMap<_, _> = files
        .iter()
        .filter(|(n, _)| *n != "guest-key.pem")
        .map(|(n, p)| (n.clone(), p.clone()))
        .collect();
    let mut args = vec![example("stream")];
    args.extend(set_files(&partial));
    let e = try_helm_template("gpufeed", "gpufeed", false, &strs(&args)).unwrap_err();
    assert!(
        e.contains("hostStream.tls.files.guest-key.pem is empty")
            && e.contains(
                "--set-file hostStream.tls.files.guest-key.pem=certs/guest/guest-key.pem"
            ),
        "{e}"
    );
}

/// Standard base64 (what Helm's b64enc writes), decoded.
fn base64_decode(s: &str) -> Vec<u8> {
    let table = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => (c - b'A') as u32,
            b'a'..=b'z' => (c - b'a' + 26) as u32,
            b'0'..=b'9' => (c - b'0' + 52) as u32,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let bytes: Vec<u8> = s.bytes().filter(|c| *c != b'=').collect();
    let mut out = Vec::new();
    for chunk in bytes.chunks(4) {
        let mut n = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            n |= table(*c) << (18 - 6 * i);
        }
        let len = chunk.len() * 6 / 8;
        out.extend_from_slice(&n.to_be_bytes()[1..1 + len]);
    }
    out
}

/// Values the chart cannot install are refused before anything renders, with a message that
/// names the value and what it must be (values.schema.json through Helm's validation, or the
/// templates' own checks for what a schema cannot say).
/// keda.threshold is the trigger's threshold and the hold's too: while a host cause starves
/// the GPU the query returns the pods' count × the threshold (the HPA then keeps the count),
/// so both change together; the app's label value goes everywhere the query selects the app.
#[test]
fn the_keda_threshold_sets_the_trigger_and_the_querys_hold_alike() {
    let chart = helm_template(&[
        "--set",
        "keda.enabled=true,finops.podLabels.app=app.kubernetes.io/name,keda.app=chat",
        "--set",
        "keda.threshold=0.5",
    ]);
    let so = object(&chart, "ScaledObject");
    let t = &so["spec"]["triggers"][0]["metadata"];
    assert_eq!(t["threshold"].as_str(), Some("0.5"));
    let query = t["query"].as_str().unwrap();
    assert!(
        query.contains("* 0.5)") && !query.contains("0.75"),
        "{query}"
    );
    assert_eq!(query.matches("app=\"chat\"").count(), 3, "{query}");
    assert!(!query.contains("inference-server"), "{query}");
}

#[test]
fn bad_values_are_refused_with_a_clear_message() {
    let cases: [(&str, &[&str]); 10] = [
        (
            "hostStream.port=70000",
            &["/hostStream/port", "maximum", "65,535"],
        ),
        (
            "image.pullPolicy=Sometimes",
            &["/image/pullPolicy", "'Always', 'IfNotPresent', 'Never'"],
        ),
        (
            "finops.podLabels.team=x",
            &["'team'", "'tenant', 'model', 'app'"],
        ),
        ("finops.gpuMemory=80Gb", &["/finops/gpuMemory", "'80Gb'"]),
        ("finops.currency=euros!", &["/finops/currency", "'euros!'"]),
        ("extraArgs[0]=verbose", &["/extraArgs/0", "'verbose'"]),
        ("imag.tag=1", &["additional properties 'imag' not allowed"]),
        ("keda.namespace=ML", &["/keda/namespace"]),
        (
            "keda.enabled=true",
            &["keda.enabled", "finops.podLabels.app"],
        ),
        (
            "keda.minReplicas=20",
            &["keda.minReplicas (20) is above keda.maxReplicas (12)"],
        ),
    ];
    for (set, expected) in cases {
        let mut args = vec!["--set", set];
        if set.starts_with("keda.minReplicas") {
            args = vec![
                "--set",
                "keda.enabled=true,finops.podLabels.app=app.kubernetes.io/name",
                "--set",
                set,
            ];
        }
        let e = try_helm_template("gpufeed", "gpufeed", false, &args)
            .err()
            .unwrap_or_else(|| panic!("--set {set} accepted"));
        for x in expected {
            assert!(e.contains(x), "--set {set}: {x:?} not in {e:?}");
        }
    }
    // a values file Helm cannot read at all
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "gpu:\n  enabled: true\n hostStream: {}\n").unwrap();
    let tools = schema_tools();
    let o = Command::new(tools.join("venv/bin/python"))
        .arg(tools.join("helm_chart.py"))
        .args(["template"])
        .arg(chart_dir())
        .args(["gpufeed", "gpufeed"])
        .arg(&bad)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("\"error\"") || !o.status.success(), "{out}");
}

/// `helm upgrade` from one values set to another changes exactly what the values name: the
/// objects of the parts turned on appear, the DaemonSet's fields of those parts change, and
/// every other object and field stays as it was (a changed selector or label would make
/// Kubernetes refuse the upgrade or roll every node for nothing).
#[test]
fn an_upgrade_changes_only_what_the_values_change() {
    let render = |upgrade: bool, args: &[&str]| {
        by_identity(&try_helm_template("gpufeed", "gpufeed", upgrade, args).unwrap())
    };
    let changes = |from: &[&str], to: &[&str]| {
        let a = render(false, from);
        let b = render(true, to);
        let added: BTreeSet<String> = b
            .keys()
            .filter(|k| !a.contains_key(*k))
            .map(|k| k.0.clone())
            .collect();
        let removed: BTreeSet<String> = a
            .keys()
            .filter(|k| !b.contains_key(*k))
            .map(|k| k.0.clone())
            .collect();
        let mut changed: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (k, o) in &a {
            if let Some(n) = b.get(k) {
                let d = diff(o, n);
                if !d.is_empty() {
                    changed.insert(k.0.clone(), d);
                }
            }
        }
        (added, removed, changed)
    };
    let set = |v: &[&str]| {
        v.iter()
            .map(|s| s.to_string())
            .collect::<BTreeSet<String>>()
    };

    // stream → full
    let stream = example("stream");
    let full = example("full");
    let (added, removed, changed) = changes(&[&stream], &[&full]);
    assert_eq!(
        added,
        set(&["ConfigMap", "PodMonitor", "PrometheusRule"]),
        "added"
    );
    assert!(removed.is_empty(), "{removed:?}");
    assert_eq!(
        changed.keys().collect::<Vec<_>>(),
        ["DaemonSet"],
        "{changed:?}"
    );
    let pod = "/spec/template/spec";
    let c = format!("{pod}/containers/0");
    assert_eq!(
        changed["DaemonSet"],
        [
            // --pod-label appended; NVIDIA_* appended; SYS_PTRACE appended
            format!("{c}/args"),
            format!("{c}/env"),
            format!("{c}/securityContext/capabilities/add"),
            format!("{pod}/hostPID"),
            format!("{pod}/runtimeClassName"),
        ]
    );

    // the image alone: the DaemonSet's image alone
    let (added, removed, changed) = changes(
        &[&full],
        &[
            &full,
            "--set",
            "image.repository=registry.example.com/gpufeed-guest,image.tag=0.2.0",
        ],
    );
    assert!(
        added.is_empty() && removed.is_empty(),
        "{added:?} {removed:?}"
    );
    assert_eq!(
        changed,
        BTreeMap::from([("DaemonSet".to_string(), vec![format!("{c}/image")])])
    );
    let b = render(
        true,
        &[
            &full,
            "--set",
            "image.repository=registry.example.com/gpufeed-guest,image.tag=0.2.0",
        ],
    );
    let ds = b.values().find(|o| o["kind"] == "DaemonSet").unwrap();
    assert_eq!(
        ds["spec"]["template"]["spec"]["containers"][0]["image"].as_str(),
        Some("registry.example.com/gpufeed-guest:0.2.0")
    );

    // a price for the cost series: the DaemonSet's arguments alone
    let (added, removed, changed) = changes(
        &[&full],
        &[&full, "--set", "finops.hourlyRate=3.1,finops.currency=EUR"],
    );
    assert!(
        added.is_empty() && removed.is_empty(),
        "{added:?} {removed:?}"
    );
    assert_eq!(
        changed,
        BTreeMap::from([("DaemonSet".to_string(), vec![format!("{c}/args")])])
    );
    let b = render(
        true,
        &[&full, "--set", "finops.hourlyRate=3.1,finops.currency=EUR"],
    );
    let gpu_flags: Vec<String> = daemonset_args(&b.into_values().collect::<Vec<_>>())
        .into_iter()
        .filter(|x| x.starts_with("--gpu-"))
        .collect();
    assert_eq!(
        gpu_flags,
        [
            "--gpu-hourly-rate=3.1",
            "--gpu-cost-currency=EUR",
            "--gpu-cost-weights=0.55,0.35,0.10"
        ]
    );

    // and back down: full → defaults removes what full added, the DaemonSet back to the base's
    let (added, removed, _) = changes(&[&full], &[]);
    assert!(added.is_empty());
    assert_eq!(removed, set(&["ConfigMap", "PodMonitor", "PrometheusRule"]));
    let base = render(true, &[]);
    let fresh = render(false, &[]);
    for (k, o) in &fresh {
        assert!(diff(o, &base[k]).is_empty(), "{k:?}: install = upgrade");
    }
}

/// The `helm` commands of docs/install.md as written (shell quoting included), run from a
/// checkout-shaped directory with the `certs/` that `gpufeed-guest certs init` writes: each
/// renders through Helm's library with its values files, `--set`s and `--set-file`s (a flag
/// the check does not know fails it), and installs what the text says; the namespace the guide
/// creates and labels first is the one the commands install into, with the chart's PodSecurity
/// labels.
#[test]
fn the_install_guides_helm_commands_render_as_written() {
    let guide = std::fs::read_to_string(repo().join("docs/install.md")).unwrap();
    let mut in_sh = false;
    let mut helm = Vec::new();
    let mut label = None;
    let mut create = None;
    for line in guide.lines() {
        if line.starts_with("```") {
            in_sh = line == "```sh";
            continue;
        }
        if !in_sh {
            continue;
        }
        if line.starts_with("helm ") {
            assert!(!line.ends_with('\\'), "one line per command: {line}");
            helm.push(line.to_string());
        } else if line.starts_with("kubectl label namespace ") {
            label = Some(line.to_string());
        } else if line.starts_with("kubectl create namespace ") {
            create = Some(line.to_string());
        }
    }
    assert!(helm.len() >= 2, "{helm:?}");
    let ns = create.expect("the guide creates the namespace");
    let ns = ns.trim_start_matches("kubectl create namespace ").trim();

    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(chart_dir().parent().unwrap(), dir.path().join("charts")).unwrap();
    certs_init(dir.path());
    let tools = schema_tools();
    for line in &helm {
        let o = Command::new(tools.join("venv/bin/python"))
            .arg(tools.join("helm_chart.py"))
            .arg("cli")
            .arg(line)
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let answer: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(answer["error"].is_null(), "{line}: {}", answer["error"]);
        let mut objs = Vec::new();
        for text in answer["manifests"].as_object().unwrap().values() {
            objs.extend(yaml_documents(text.as_str().unwrap(), line));
        }
        binary_accepts(line, &objs);
        let ds = object(&objs, "DaemonSet");
        assert_eq!(ds["metadata"]["namespace"].as_str(), Some(ns), "{line}");
        let image = ds["spec"]["template"]["spec"]["containers"][0]["image"]
            .as_str()
            .unwrap();
        // the install's image, and an upgrade keeps it (values are not reused)
        assert_eq!(image, "registry.example.com/gpufeed-guest:0.1.0", "{line}");
        if line.contains("hostStream.tls.create=true") {
            let secret = object(&objs, "Secret");
            assert_eq!(secret["data"].as_mapping().unwrap().len(), 4, "{line}");
        }
        // the full set: every part on
        for kind in ["PodMonitor", "PrometheusRule", "ConfigMap"] {
            object(&objs, kind);
        }
    }

    // the labels the guide puts on the namespace are the chart's Namespace's
    let label = label.expect("the guide labels the namespace");
    let rest = label
        .trim_start_matches("kubectl label namespace ")
        .strip_prefix(ns)
        .unwrap();
    let given: BTreeSet<String> = rest.split_whitespace().map(String::from).collect();
    let objs = helm_template(&["--set", "namespace.create=true"]);
    let nsobj = object(&objs, "Namespace");
    let wanted: BTreeSet<String> = nsobj["metadata"]["labels"]
        .as_mapping()
        .unwrap()
        .iter()
        .map(|(k, v)| format!("{}={}", k.as_str().unwrap(), v.as_str().unwrap()))
        .filter(|l| l.starts_with("pod-security.kubernetes.io/"))
        .collect();
    assert_eq!(given, wanted);
}

/// `helm package` makes a chart that stands alone: the files linked from the kustomize
/// components (PodMonitor, PrometheusRule, ScaledObject, dashboards) are in the archive, and
/// it renders exactly what the chart directory does.
#[test]
fn the_packaged_chart_renders_what_the_directory_does() {
    let dir = tempfile::tempdir().unwrap();
    let tools = schema_tools();
    let o = Command::new(tools.join("venv/bin/python"))
        .arg(tools.join("helm_chart.py"))
        .arg("package")
        .arg(chart_dir())
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let answer: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let archive = std::path::PathBuf::from(answer["archive"].as_str().unwrap());
    assert_eq!(
        archive.file_name().unwrap().to_str(),
        Some(format!("gpufeed-{}.tgz", env!("CARGO_PKG_VERSION")).as_str())
    );
    // nothing in it is a link
    let listing = Command::new("tar")
        .arg("tvzf")
        .arg(&archive)
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&listing.stdout);
    assert!(
        listing.contains("gpufeed/files/prometheus-rules.yaml"),
        "{listing}"
    );
    assert!(
        listing
            .lines()
            .all(|l| l.starts_with('-') || l.starts_with('d')),
        "{listing}"
    );
    let args = [example("full"), example("finops")];
    let args = strs(&args);
    let packaged = try_helm_template_of(&archive, "gpufeed", "gpufeed", false, &args).unwrap();
    let directory = helm_template(&args);
    assert_eq!(packaged.len(), directory.len());
    assert_eq!(by_identity(&packaged), by_identity(&directory));
}
