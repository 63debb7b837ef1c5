//! Keeps `talos/` true to the binary: every YAML document parses (the Kubernetes objects as
//! `kubectl kustomize` builds them); the DaemonSet's and the
//! extension service's arguments are parsed by the real `gpufeed-guest run` (with `--help`
//! last, clap parses and validates every flag and value, then prints help instead of running);
//! RBAC, capabilities, ports, mounts and the TLS Secret agree with the binary and with
//! `gpufeed-guest certs init`; the PrometheusRule passes `promtool check rules` and its unit
//! tests (`promtool test rules`), refers only to series the agents export, and promtool does
//! reject a broken expression (so this test can fail). Needs no root; needs `promtool`
//! (Debian package `prometheus`).

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Output};

use serde_yaml::Value;

use crate::manifests;
use manifests::*;

const BIN: &str = env!("CARGO_BIN_EXE_gpufeed-guest");

/// Everything a user deploys: the objects of the kustomize overlay with every component
/// (`kubectl kustomize talos/kubernetes/overlays/full`), and the Talos documents.
fn documents() -> Vec<(String, Value)> {
    let mut out: Vec<(String, Value)> = kustomize("overlays/full")
        .into_iter()
        .map(|v| ("overlays/full".to_string(), v))
        .collect();
    let talos = talos_documents();
    assert!(talos.len() >= 4, "talos/*.yaml has too few documents");
    out.extend(talos);
    out
}

fn of_kind<'a>(docs: &'a [(String, Value)], kind: &str) -> Vec<&'a Value> {
    docs.iter()
        .filter(|(_, v)| v["kind"].as_str() == Some(kind))
        .map(|(_, v)| v)
        .collect()
}

fn one<'a>(docs: &'a [(String, Value)], kind: &str) -> &'a Value {
    let v = of_kind(docs, kind);
    assert_eq!(v.len(), 1, "expected exactly one {kind}");
    v[0]
}

fn strs(v: &Value) -> Vec<String> {
    v.as_sequence()
        .unwrap_or_else(|| panic!("not a list: {v:?}"))
        .iter()
        .map(|x| x.as_str().expect("string").to_string())
        .collect()
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env_remove("NODE_NAME")
        .output()
        .expect("running gpufeed-guest")
}

fn run_help() -> String {
    let o = run(&["run", "--help"]);
    assert!(o.status.success());
    String::from_utf8(o.stdout).unwrap()
}

/// Parses `args` (without the leading `run`) with the real binary.
fn parse_with_binary(args: &[String]) -> Output {
    let mut a: Vec<&str> = vec!["run"];
    a.extend(args.iter().map(String::as_str));
    a.push("--help"); // last: everything before it is parsed and validated first
    run(&a)
}

/// `--name=value` / `--name value` → value.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let eq = format!("{name}=");
    args.iter().enumerate().find_map(|(i, a)| {
        if let Some(v) = a.strip_prefix(&eq) {
            Some(v)
        } else if a == name {
            args.get(i + 1).map(String::as_str)
        } else {
            None
        }
    })
}

fn port_of(addr: &str) -> u64 {
    addr.rsplit_once(':').unwrap().1.parse().unwrap()
}

/// The `[default: X]` of a flag in `run --help`.
fn help_default(help: &str, flag: &str) -> String {
    let at = help
        .find(&format!("{flag} <"))
        .unwrap_or_else(|| panic!("{flag} not in --help"));
    let rest = &help[at..];
    let end = rest[2..].find("\n      --").map_or(rest.len(), |e| e + 2);
    let d = rest[..end].find("[default: ").expect("has a default") + "[default: ".len();
    rest[d..d + rest[d..].find(']').unwrap()].to_string()
}

/// Checks arguments against the binary; returns them without the leading `run`.
fn check_args(what: &str, args: Vec<String>, help: &str) -> Vec<String> {
    assert_eq!(
        args.first().map(String::as_str),
        Some("run"),
        "{what}: first arg"
    );
    let args = args[1..].to_vec();
    for a in &args {
        if let Some(f) = a.strip_prefix("--") {
            let name = f.split('=').next().unwrap();
            assert!(
                help.contains(&format!("--{name} ")) || help.contains(&format!("--{name}\n")),
                "{what}: --{name} is not a flag of `gpufeed-guest run`"
            );
        }
    }
    let o = parse_with_binary(&args);
    assert!(
        o.status.success(),
        "{what}: `gpufeed-guest run` rejects {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    args
}

/// What `gpufeed-guest certs init` writes: (Secret name, namespace, data keys, guest dir files).
fn certs_init_output() -> (String, String, BTreeSet<String>, BTreeSet<String>) {
    let dir = tempfile::tempdir().unwrap();
    let o = run(&[
        "certs",
        "init",
        "--out",
        dir.path().to_str().unwrap(),
        "--guest-addr",
        "10.0.0.20:7845",
        "--host",
        "pve1",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(dir.path().join("gpufeed-guest-tls.yaml")).unwrap();
    let s: Value = serde_yaml::from_str(&text).unwrap();
    assert_eq!(s["kind"].as_str(), Some("Secret"));
    let keys = s["stringData"]
        .as_mapping()
        .unwrap()
        .keys()
        .map(|k| k.as_str().unwrap().to_string())
        .collect();
    let files = std::fs::read_dir(dir.path().join("guest"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    (
        s["metadata"]["name"].as_str().unwrap().to_string(),
        s["metadata"]["namespace"].as_str().unwrap().to_string(),
        keys,
        files,
    )
}

fn walk<'a>(v: &'a Value, path: &str, f: &mut dyn FnMut(&str, &'a Value)) {
    f(path, v);
    match v {
        Value::Mapping(m) => {
            for (k, x) in m {
                walk(x, &format!("{path}.{}", k.as_str().unwrap_or("?")), f);
            }
        }
        Value::Sequence(s) => {
            for (i, x) in s.iter().enumerate() {
                walk(x, &format!("{path}[{i}]"), f);
            }
        }
        _ => {}
    }
}

#[test]
fn daemonset_matches_the_binary() {
    let docs = documents();
    let help = run_help();

    // Nothing anywhere runs privileged.
    for (file, d) in &docs {
        walk(d, "", &mut |p, v| {
            assert!(
                !(p.ends_with(".privileged") && v.as_bool() == Some(true)),
                "{file}: {p} is privileged: true"
            );
        });
    }

    let ns = one(&docs, "Namespace");
    let ns_name = ns["metadata"]["name"].as_str().unwrap();
    assert_eq!(
        ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"].as_str(),
        Some("privileged")
    );

    // The Secret `certs init` writes lands in this namespace under the name the pod mounts.
    let (secret, secret_ns, secret_keys, guest_files) = certs_init_output();
    assert_eq!(secret_ns, ns_name, "certs init's default namespace");
    assert_eq!(
        secret_keys, guest_files,
        "Secret keys = the guest --tls-dir files"
    );

    // RBAC: pods only, read only.
    let role = one(&docs, "ClusterRole");
    let rules = role["rules"].as_sequence().unwrap();
    assert!(!rules.is_empty());
    let allowed: BTreeSet<&str> = ["get", "list", "watch"].into();
    for r in rules {
        assert_eq!(strs(&r["apiGroups"]), [""], "core API group only");
        assert_eq!(strs(&r["resources"]), ["pods"], "pods only");
        for v in strs(&r["verbs"]) {
            assert!(
                allowed.contains(v.as_str()),
                "verb {v} beyond get/list/watch"
            );
        }
    }
    let sa = one(&docs, "ServiceAccount");
    let binding = one(&docs, "ClusterRoleBinding");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    assert_eq!(binding["subjects"][0]["name"], sa["metadata"]["name"]);
    assert_eq!(binding["subjects"][0]["namespace"].as_str(), Some(ns_name));

    let ds = one(&docs, "DaemonSet");
    assert_eq!(ds["metadata"]["namespace"].as_str(), Some(ns_name));
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], sa["metadata"]["name"]);
    assert_eq!(pod["hostNetwork"].as_bool(), Some(true));
    assert_eq!(pod["hostPID"].as_bool(), Some(true));
    let containers = pod["containers"].as_sequence().unwrap();
    assert_eq!(containers.len(), 1);
    let c = &containers[0];
    assert!(strs(&c["command"])[0].ends_with("/gpufeed-guest"));

    let args = check_args("DaemonSet", strs(&c["args"]), &help);

    // NODE_NAME from the downward API, read by the binary as --node-name.
    assert!(help.contains("[env: NODE_NAME=]"));
    let env = c["env"].as_sequence().unwrap();
    let node = env
        .iter()
        .find(|e| e["name"].as_str() == Some("NODE_NAME"))
        .expect("NODE_NAME");
    assert_eq!(
        node["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        Some("spec.nodeName")
    );

    // Least capabilities, exactly the documented set; no escalation; read-only root.
    let sc = &c["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"].as_bool(), Some(true));
    assert_eq!(sc["allowPrivilegeEscalation"].as_bool(), Some(false));
    assert_eq!(strs(&sc["capabilities"]["drop"]), ["ALL"]);
    let caps: BTreeSet<String> = strs(&sc["capabilities"]["add"]).into_iter().collect();
    let want: BTreeSet<String> = ["BPF", "PERFMON", "NET_ADMIN", "SYS_PTRACE"]
        .map(String::from)
        .into();
    assert_eq!(caps, want);

    // Ports: the metrics port is the binary's default; the QUIC port is the one it listens on.
    let ports = c["ports"].as_sequence().unwrap();
    let port = |name: &str| {
        ports
            .iter()
            .find(|p| p["name"].as_str() == Some(name))
            .unwrap_or_else(|| panic!("port {name}"))
    };
    let default_metrics = help_default(&help, "--metrics-listen");
    let metrics_port = port_of(&default_metrics);
    assert_eq!(metrics_port, 9745);
    assert_eq!(
        port("metrics")["containerPort"].as_u64(),
        Some(metrics_port)
    );
    assert_eq!(port("metrics")["protocol"].as_str(), Some("TCP"));
    if let Some(m) = flag(&args, "--metrics-listen") {
        assert_eq!(port_of(m), metrics_port);
    }
    let quic = flag(&args, "--quic-listen").expect("the DaemonSet runs the hub");
    assert_eq!(port("quic")["containerPort"].as_u64(), Some(port_of(quic)));
    assert_eq!(port("quic")["protocol"].as_str(), Some("UDP"));
    assert!(
        help.contains(&format!("e.g. {quic}")),
        "QUIC port as documented in --help"
    );

    // Liveness: the tick; readiness also the hub, which this DaemonSet runs (/readyz); both
    // on the probe listener (loopback), where a flood of the metrics port cannot reach.
    let health = flag(&args, "--health-listen").expect("the probe listener is set");
    assert_eq!(health, "127.0.0.1:9746");
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        let get = &c[probe]["httpGet"];
        assert_eq!(get["path"].as_str(), Some(path), "{probe}");
        assert_eq!(get["host"].as_str(), Some("127.0.0.1"), "{probe}");
        assert_eq!(get["port"].as_u64(), Some(port_of(health)), "{probe}");
    }
    let lim = &c["resources"]["limits"]["memory"];
    assert!(lim.is_string() && c["resources"]["requests"]["memory"].is_string());

    // Mounts behind the flags.
    let mounts = c["volumeMounts"].as_sequence().unwrap();
    let volumes = pod["volumes"].as_sequence().unwrap();
    let volume_at = |path: &str| -> (&Value, &Value) {
        let m = mounts
            .iter()
            .find(|m| m["mountPath"].as_str() == Some(path))
            .unwrap_or_else(|| panic!("nothing mounted at {path}"));
        let v = volumes
            .iter()
            .find(|v| v["name"] == m["name"])
            .unwrap_or_else(|| panic!("no volume {:?}", m["name"]));
        (m, v)
    };
    let cg =
        flag(&args, "--cgroup-root").expect("--cgroup-root: the container's own view is wrong");
    let (m, v) = volume_at(cg);
    assert_eq!(m["readOnly"].as_bool(), Some(true));
    assert_eq!(v["hostPath"]["path"].as_str(), Some("/sys/fs/cgroup"));
    let (m, v) = volume_at("/sys/kernel/security");
    assert_eq!(m["readOnly"].as_bool(), Some(true));
    assert_eq!(v["hostPath"]["path"].as_str(), Some("/sys/kernel/security"));
    // The pinned pod namespaces, where the binary looks for them, with pods started later.
    let (m, v) = volume_at(gpufeed_guest::ifaces::PINNED_NETNS);
    assert_eq!(m["readOnly"].as_bool(), Some(true));
    assert_eq!(m["mountPropagation"].as_str(), Some("HostToContainer"));
    assert_eq!(v["hostPath"]["path"].as_str(), Some("/run/netns"));
    let tls =
        flag(&args, "--tls-dir").map_or_else(|| help_default(&help, "--tls-dir"), String::from);
    let (m, v) = volume_at(&tls);
    assert_eq!(m["readOnly"].as_bool(), Some(true));
    assert_eq!(v["secret"]["secretName"].as_str(), Some(secret.as_str()));
    let journal = flag(&args, "--event-journal").expect("--event-journal");
    let (m, v) = volume_at(Path::new(journal).parent().unwrap().to_str().unwrap());
    assert_ne!(m["readOnly"].as_bool(), Some(true));
    assert!(v["emptyDir"].is_mapping(), "journal on an emptyDir");

    // Service and PodMonitor reach the metrics port of these pods.
    let pod_labels = &ds["spec"]["template"]["metadata"]["labels"];
    let selects_the_pods = |selector: &Value, what: &str| {
        let sel = selector.as_mapping().expect("a label map");
        assert!(!sel.is_empty(), "{what}: empty selector");
        for (k, v) in sel {
            assert_eq!(&pod_labels[k], v, "{what}: selects {k:?}={v:?}");
        }
    };
    let svc = one(&docs, "Service");
    assert_eq!(svc["spec"]["clusterIP"].as_str(), Some("None"));
    selects_the_pods(&svc["spec"]["selector"], "Service");
    assert_eq!(svc["spec"]["ports"][0]["port"].as_u64(), Some(metrics_port));
    assert_eq!(
        svc["spec"]["ports"][0]["targetPort"].as_str(),
        Some("metrics")
    );
    let pm = one(&docs, "PodMonitor");
    assert_eq!(pm["apiVersion"].as_str(), Some("monitoring.coreos.com/v1"));
    selects_the_pods(&pm["spec"]["selector"]["matchLabels"], "PodMonitor");
    let ep = &pm["spec"]["podMetricsEndpoints"][0];
    assert_eq!(ep["port"].as_str(), Some("metrics"));
    assert_eq!(ep["path"].as_str(), Some("/metrics"));
    // The rules select job="gpufeed-guest": the PodMonitor's jobLabel gives it.
    let job_label = pm["spec"]["jobLabel"].as_str().unwrap();
    assert_eq!(pod_labels[job_label].as_str(), Some("gpufeed-guest"));

    // The negative controls: the binary does reject what it should.
    let mut bad = args.clone();
    bad.push("--no-such-flag".into());
    assert!(!parse_with_binary(&bad).status.success());
    let mut bad = args.clone();
    bad.push("--interval=0s".into());
    assert!(!parse_with_binary(&bad).status.success());
}

#[test]
fn extension_service_matches_the_binary() {
    let docs = documents();
    let help = run_help();
    let ext = docs
        .iter()
        .find(|(f, _)| f == "extension-service.yaml")
        .map(|(_, v)| v)
        .expect("talos/extension-service.yaml");
    let name = ext["name"].as_str().unwrap();
    assert!(name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_'));
    assert!(ext["container"]["entrypoint"]
        .as_str()
        .unwrap()
        .ends_with("/gpufeed-guest"));
    assert!(["always", "never", "untilSuccess"].contains(&ext["restart"].as_str().unwrap()));
    let args = check_args("extension service", strs(&ext["container"]["args"]), &help);
    let mounts = ext["container"]["mounts"].as_sequence().unwrap();
    let at = |dest: &str| {
        mounts
            .iter()
            .find(|m| m["destination"].as_str() == Some(dest))
            .unwrap_or_else(|| panic!("nothing mounted at {dest}"))
    };
    let cg = at(flag(&args, "--cgroup-root").expect("--cgroup-root"));
    assert_eq!(cg["source"].as_str(), Some("/sys/fs/cgroup"));
    assert!(strs(&cg["options"]).contains(&"ro".to_string()));
    let journal = flag(&args, "--event-journal").expect("--event-journal");
    let j = at(Path::new(journal).parent().unwrap().to_str().unwrap());
    assert!(strs(&j["options"]).contains(&"rw".to_string()));

    // NVML: --nvml-library, seen through a read-only mount, is where the Talos NVIDIA
    // extensions put the library on the host
    let lib = flag(&args, "--nvml-library").expect("--nvml-library");
    let (m, rest) = mounts
        .iter()
        .filter_map(|m| {
            let dest = m["destination"].as_str()?;
            Some((m, lib.strip_prefix(dest)?.strip_prefix('/')?))
        })
        .max_by_key(|(m, _)| m["destination"].as_str().unwrap().len())
        .unwrap_or_else(|| panic!("nothing mounted above {lib}"));
    assert_eq!(
        Path::new(m["source"].as_str().unwrap()).join(rest),
        Path::new("/usr/local/glibc/usr/lib/libnvidia-ml.so.1"),
        "the host path of {lib}"
    );
    assert!(strs(&m["options"]).contains(&"ro".to_string()));

    // Its ExtensionServiceConfig provides exactly the guest --tls-dir files.
    let cfg = one(&docs, "ExtensionServiceConfig");
    assert_eq!(cfg["name"].as_str(), Some(name));
    let tls =
        flag(&args, "--tls-dir").map_or_else(|| help_default(&help, "--tls-dir"), String::from);
    let paths: BTreeSet<String> = cfg["configFiles"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|f| f["mountPath"].as_str().unwrap().to_string())
        .collect();
    let (_, _, _, guest_files) = certs_init_output();
    let want: BTreeSet<String> = guest_files.iter().map(|f| format!("{tls}/{f}")).collect();
    assert_eq!(paths, want);

    // Firewall rules of the machine-config patch open exactly the agent's ports.
    let rules = of_kind(&docs, "NetworkRuleConfig");
    let mut opened: BTreeSet<(u64, String)> = BTreeSet::new();
    for r in rules {
        for p in r["portSelector"]["ports"].as_sequence().unwrap() {
            opened.insert((
                p.as_u64().unwrap(),
                r["portSelector"]["protocol"].as_str().unwrap().into(),
            ));
        }
        assert!(!r["ingress"].as_sequence().unwrap().is_empty());
    }
    // ... which are the DaemonSet's: hosts and Prometheus see one agent either way.
    let ds = one(&docs, "DaemonSet");
    let ds_args = strs(&ds["spec"]["template"]["spec"]["containers"][0]["args"]);
    let quic = port_of(flag(&ds_args, "--quic-listen").unwrap());
    assert_eq!(
        port_of(flag(&args, "--quic-listen").expect("--quic-listen")),
        quic
    );
    let metrics = port_of(&help_default(&help, "--metrics-listen"));
    if let Some(m) = flag(&args, "--metrics-listen") {
        assert_eq!(port_of(m), metrics);
    }
    assert_eq!(
        opened,
        BTreeSet::from([(quic, "udp".into()), (metrics, "tcp".into())])
    );
}

fn promtool(args: &[&str], dir: &Path) -> Output {
    Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("promtool (Debian package `prometheus`) must be installed")
}

/// The metric names an expression reads (recording rules, with `:`, excluded).
fn series_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for ch in expr.chars().chain(std::iter::once(' ')) {
        if ch.is_ascii_alphanumeric() || ch == '_' || ch == ':' {
            cur.push(ch);
        } else {
            if (cur.starts_with("ebpf_") || cur.starts_with("gpufeed_")) && !cur.contains(':') {
                out.push(cur.clone());
            }
            cur.clear();
        }
    }
    out
}

fn source_text() -> String {
    let mut text = std::fs::read_to_string(repo().join("docs/metrics.md")).unwrap();
    fn rs(dir: &Path, text: &mut String) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                rs(&p, text);
            } else if p.extension().is_some_and(|x| x == "rs") {
                *text += &std::fs::read_to_string(&p).unwrap();
            }
        }
    }
    rs(&repo().join("guest-agent/src"), &mut text);
    rs(&repo().join("host-agent/src"), &mut text);
    // the hub's gpufeed_stream_* series are registered in the shared stream library
    rs(&repo().join("shared/src"), &mut text);
    text
}

#[test]
fn prometheus_rules_pass_promtool() {
    let docs = documents();
    let pr = one(&docs, "PrometheusRule");
    assert_eq!(pr["apiVersion"].as_str(), Some("monitoring.coreos.com/v1"));
    let groups = pr["spec"]["groups"].clone();

    // Every series an expression reads is one the agents export.
    let sources = source_text();
    let mut exprs = Vec::new();
    for g in groups.as_sequence().unwrap() {
        for r in g["rules"].as_sequence().unwrap() {
            exprs.push(r["expr"].as_str().expect("expr").to_string());
        }
    }
    assert!(exprs.len() >= 10, "{} rules", exprs.len());
    for e in &exprs {
        for s in series_names(e) {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suf| s.strip_suffix(suf))
                .unwrap_or(&s);
            assert!(
                sources.contains(&format!("\"{base}\"")) || sources.contains(&format!("`{base}`")),
                "{s} (in `{e}`) is not a series the agents export"
            );
        }
    }

    let dir = tempfile::tempdir().unwrap();
    let mut file = serde_yaml::Mapping::new();
    file.insert("groups".into(), groups.clone());
    std::fs::write(
        dir.path().join("rules.yaml"),
        serde_yaml::to_string(&file).unwrap(),
    )
    .unwrap();
    let o = promtool(&["check", "rules", "rules.yaml"], dir.path());
    assert!(
        o.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    std::fs::copy(
        repo().join("talos/tests/prometheus-rules.promtool.yaml"),
        dir.path().join("tests.yaml"),
    )
    .unwrap();
    let o = promtool(&["test", "rules", "tests.yaml"], dir.path());
    assert!(
        o.status.success(),
        "promtool test rules: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );

    // Negative control: one expression broken, and promtool must say so.
    let mut broken = groups;
    broken[0]["rules"][0]["expr"] = "rate(ebpf_tc_bytes_total[5m]".into();
    let mut file = serde_yaml::Mapping::new();
    file.insert("groups".into(), broken);
    std::fs::write(
        dir.path().join("broken.yaml"),
        serde_yaml::to_string(&file).unwrap(),
    )
    .unwrap();
    let o = promtool(&["check", "rules", "broken.yaml"], dir.path());
    assert!(!o.status.success(), "promtool accepted a broken expression");
}

/// A Markdown heading's anchor as GitHub and most renderers make it.
fn anchor_of(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The sections of a Markdown file by anchor, with their text.
fn sections(md: &str) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    let mut cur: Option<String> = None;
    for line in md.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            cur = Some(anchor_of(h));
            out.insert(anchor_of(h), String::new());
        } else if let Some(c) = &cur {
            let s = out.get_mut(c).unwrap();
            s.push_str(line);
            s.push('\n');
        }
    }
    out
}

#[test]
fn every_alert_has_a_runbook() {
    let docs = documents();
    let pr = one(&docs, "PrometheusRule");
    let runbooks = std::fs::read_to_string(repo().join("docs/runbooks.md")).unwrap();
    let sections = sections(&runbooks);
    let mut alerts = 0;
    for g in pr["spec"]["groups"].as_sequence().unwrap() {
        for r in g["rules"].as_sequence().unwrap() {
            let Some(alert) = r["alert"].as_str() else {
                continue;
            };
            alerts += 1;
            let url = r["annotations"]["runbook_url"]
                .as_str()
                .unwrap_or_else(|| panic!("{alert}: no runbook_url"));
            let (file, anchor) = url
                .split_once('#')
                .unwrap_or_else(|| panic!("{alert}: {url} has no anchor"));
            assert_eq!(file, "docs/runbooks.md", "{alert}");
            assert_eq!(anchor, alert.to_lowercase(), "{alert}: anchor");
            let text = sections
                .get(anchor)
                .unwrap_or_else(|| panic!("{alert}: no section #{anchor} in docs/runbooks.md"));
            // what to check and what to do
            assert!(
                text.contains("Check") && text.contains("Do:"),
                "{alert}: the runbook says what to check and do"
            );
        }
    }
    assert!(alerts >= 10, "{alert} alerts", alert = alerts);
    // the anchor check can fail
    assert!(!sections.contains_key("gpufeednosuchalert"));
    assert_eq!(anchor_of("GpufeedAgentDown"), "gpufeedagentdown");
}

/// The extension service definition's schema as Talos reads it (`services.Spec` in
/// siderolabs/talos, pkg/machinery/extensions/services): unknown keys are errors here because
/// Talos would ignore them silently.
// Every field Talos knows is declared, read or not: deny_unknown_fields rejects the rest.
#[allow(dead_code)]
mod talos_service {
    use serde::Deserialize;

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Spec {
        pub name: String,
        pub container: Container,
        #[serde(default)]
        pub depends: Vec<Dependency>,
        pub restart: String,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct Container {
        pub entrypoint: String,
        #[serde(default)]
        pub environment: Vec<String>,
        #[serde(default)]
        pub environment_file: Option<String>,
        #[serde(default)]
        pub args: Vec<String>,
        #[serde(default)]
        pub mounts: Vec<Mount>,
        #[serde(default)]
        pub security: Option<Security>,
    }

    /// An OCI runtime-spec mount.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Mount {
        pub destination: String,
        #[serde(rename = "type")]
        pub kind: Option<String>,
        pub source: Option<String>,
        #[serde(default)]
        pub options: Vec<String>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields, rename_all = "camelCase")]
    pub struct Security {
        #[serde(default)]
        pub writeable_sysfs: bool,
        #[serde(default)]
        pub masked_paths: Vec<String>,
        #[serde(default)]
        pub readonly_paths: Vec<String>,
        #[serde(default)]
        pub writeable_rootfs: bool,
        #[serde(default)]
        pub rootfs_propagation: Option<String>,
    }

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Dependency {
        pub service: Option<String>,
        pub path: Option<String>,
        pub network: Option<Vec<String>>,
        pub time: Option<bool>,
        pub configuration: Option<bool>,
    }

    /// Talos's validation: the name, restart kind, entrypoint, and exactly one condition per
    /// dependency (absolute paths, known network states).
    pub fn validate(spec: &Spec) -> Result<(), String> {
        let mut errs = Vec::new();
        if spec.name.is_empty()
            || !spec
                .name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_')
        {
            errs.push(format!("name {:?} is invalid", spec.name));
        }
        if !["always", "never", "untilSuccess"].contains(&spec.restart.as_str()) {
            errs.push(format!("restart kind {:?} is invalid", spec.restart));
        }
        if spec.container.entrypoint.is_empty() {
            errs.push("container entrypoint is empty".into());
        }
        for m in &spec.container.mounts {
            if !m.destination.starts_with('/') {
                errs.push(format!(
                    "mount destination {:?} is not absolute",
                    m.destination
                ));
            }
        }
        for d in &spec.depends {
            let set = [
                d.service.is_some(),
                d.path.is_some(),
                d.network.as_ref().is_some_and(|n| !n.is_empty()),
                d.time == Some(true),
                d.configuration == Some(true),
            ]
            .iter()
            .filter(|x| **x)
            .count();
            if set != 1 {
                errs.push(format!("a dependency sets {set} conditions, not one"));
            }
            if let Some(p) = &d.path {
                if !p.starts_with('/') {
                    errs.push(format!("dependency path {p:?} is not absolute"));
                }
            }
            for n in d.network.iter().flatten() {
                if !["addresses", "connectivity", "hostname", "etcfiles"].contains(&n.as_str()) {
                    errs.push(format!("unknown network dependency {n:?}"));
                }
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs.join("; "))
        }
    }

    pub fn parse(text: &str) -> Result<Spec, String> {
        let spec: Spec = serde_yaml::from_str(text).map_err(|e| e.to_string())?;
        validate(&spec)?;
        Ok(spec)
    }
}

#[test]
fn extension_service_follows_the_talos_schema() {
    let text = std::fs::read_to_string(repo().join("talos/extension-service.yaml")).unwrap();
    let spec = talos_service::parse(&text).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(spec.name, "gpufeed-guest");
    assert!(spec.container.entrypoint.starts_with('/'));
    let sec = spec.container.security.expect("security");
    assert!(!sec.writeable_rootfs && !sec.writeable_sysfs);
    // The TLS files come from the ExtensionServiceConfig: the service waits for them.
    assert!(spec.depends.iter().any(|d| d.configuration == Some(true)));
    for m in &spec.container.mounts {
        assert_eq!(m.kind.as_deref(), Some("bind"), "{}", m.destination);
        assert!(m.source.as_deref().is_some_and(|s| s.starts_with('/')));
        assert!(
            m.options.iter().any(|o| o == "ro" || o == "rw"),
            "{}",
            m.destination
        );
    }

    // The schema check can fail: a misspelt key, a wrong restart kind, a double dependency.
    let typo = text.replace("writeableRootfs:", "writableRootfs:");
    assert!(
        talos_service::parse(&typo).is_err(),
        "misspelt key accepted"
    );
    let bad_restart = text.replace("restart: always", "restart: sometimes");
    assert!(talos_service::parse(&bad_restart).is_err());
    let double = text.replace(
        "  - configuration: true\n",
        "  - configuration: true\n    time: true\n",
    );
    assert_ne!(double, text);
    assert!(talos_service::parse(&double).is_err());
}
