//! The shipped deployment files as the tests read them: the kustomize tree under
//! `talos/kubernetes/` built by the real `kubectl kustomize` (what `kubectl apply -k` applies),
//! and the Talos documents in `talos/*.yaml`.

#![allow(dead_code)] // each test binary uses a part

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_yaml::Value;

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

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

/// `kubectl kustomize DIR`: the objects `kubectl apply -k DIR` would send, or kustomize's
/// error message.
pub fn try_kustomize(dir: &Path) -> Result<Vec<Value>, String> {
    let o = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .expect("kubectl (with its built-in kustomize) must be installed");
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
