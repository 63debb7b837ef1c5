//! The opt-in KEDA component (`talos/kubernetes/components/keda`) as an application's
//! kustomization uses it, built by the real `kubectl kustomize` (what `kubectl apply -k` sends):
//! its ScaledObject is valid against KEDA's published CRD schema (the fields it uses, written
//! into tests/fixtures/keda/), its scaling behaviour is what the HPA API accepts, and it scales
//! the application's Deployment on gpufeed's duty cycle. Needs `kubectl`; no cluster, no root.

mod manifests;

use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscalerBehavior;
use manifests::*;
use serde_yaml::Value;

fn schema() -> Value {
    let path = repo().join("guest-agent/tests/fixtures/keda/scaledobject-v1alpha1.schema.yaml");
    serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Checks `v` against a structural OpenAPI v3 schema as the API server does for a CRD:
/// types (int32 ranges included), required fields, and no field the schema does not know.
fn validate(schema: &Value, v: &Value, path: &str, errs: &mut Vec<String>) {
    let ty = schema["type"].as_str().unwrap_or("");
    match ty {
        "object" => {
            let Some(map) = v.as_mapping() else {
                errs.push(format!("{path}: not an object"));
                return;
            };
            for r in schema["required"].as_sequence().into_iter().flatten() {
                if !map.contains_key(r) {
                    errs.push(format!("{path}.{}: required", r.as_str().unwrap()));
                }
            }
            let props = schema["properties"].as_mapping();
            let additional = schema.get("additionalProperties");
            if props.is_none() && additional.is_none() {
                return; // free-form (metadata)
            }
            for (k, val) in map {
                let key = k.as_str().unwrap_or("?");
                let sub = format!("{path}.{key}");
                match (props.and_then(|p| p.get(k)), additional) {
                    (Some(s), _) | (None, Some(s)) => validate(s, val, &sub, errs),
                    (None, None) => errs.push(format!("{sub}: unknown field")),
                }
            }
        }
        "array" => match v.as_sequence() {
            Some(items) => {
                for (i, item) in items.iter().enumerate() {
                    validate(&schema["items"], item, &format!("{path}[{i}]"), errs);
                }
            }
            None => errs.push(format!("{path}: not an array")),
        },
        "string" if !v.is_string() => errs.push(format!("{path}: not a string")),
        "boolean" if !v.is_bool() => errs.push(format!("{path}: not a boolean")),
        "integer" => match v.as_i64() {
            None => errs.push(format!("{path}: not an integer")),
            Some(n) if schema["format"] == "int32" && i32::try_from(n).is_err() => {
                errs.push(format!("{path}: {n} is not an int32"))
            }
            Some(_) => {}
        },
        _ => {}
    }
}

fn schema_errors(obj: &Value) -> Vec<String> {
    let mut errs = Vec::new();
    validate(&schema(), obj, "", &mut errs);
    errs
}

/// An application's kustomization: its Deployment in namespace `ml` (pods labelled
/// `app.kubernetes.io/name: chat`), the KEDA component, and the patches the component's header
/// shows, pointing it at that Deployment and app.
fn application_overlay() -> Vec<Value> {
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
    let k = format!(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: ml\n\
         resources:\n  - deployment.yaml\n\
         components:\n  - {up}{keda}\n\
         patches:\n  - target: {{group: keda.sh, kind: ScaledObject, name: inference-server-gpu}}\n    \
         patch: |-\n      - op: replace\n        path: /spec/scaleTargetRef/name\n        value: chat\n      \
         - op: replace\n        path: /spec/triggers/0/metadata/query\n        \
         value: sum(max by (namespace, pod) (ebpf_gpu_active_compute_duty_cycle{{app=\"chat\"}}))\n",
        keda = keda.strip_prefix("/").unwrap().display(),
    );
    std::fs::write(dir.path().join("kustomization.yaml"), k).unwrap();
    try_kustomize(dir.path()).unwrap_or_else(|e| panic!("kubectl kustomize: {e}"))
}

#[test]
fn the_scaled_object_is_valid_against_kedas_schema_and_scales_the_application() {
    let objs = application_overlay();
    let so = object(&objs, "ScaledObject");
    assert_eq!(so["apiVersion"].as_str(), Some("keda.sh/v1alpha1"));
    let errs = schema_errors(so);
    assert!(errs.is_empty(), "against KEDA's CRD schema: {errs:?}");
    // in the application's namespace, scaling its Deployment
    let deploy = object(&objs, "Deployment");
    assert_eq!(so["metadata"]["namespace"], deploy["metadata"]["namespace"]);
    assert_eq!(so["metadata"]["namespace"].as_str(), Some("ml"));
    let target = &so["spec"]["scaleTargetRef"];
    assert_eq!(target["kind"].as_str(), Some("Deployment"));
    assert_eq!(target["apiVersion"].as_str(), Some("apps/v1"));
    assert_eq!(target["name"], deploy["metadata"]["name"]);

    let spec = &so["spec"];
    assert_eq!(spec["minReplicaCount"].as_i64(), Some(1));
    assert_eq!(spec["maxReplicaCount"].as_i64(), Some(12));
    assert_eq!(spec["pollingInterval"].as_i64(), Some(5));
    assert_eq!(spec["cooldownPeriod"].as_i64(), Some(300));
    let triggers = spec["triggers"].as_sequence().unwrap();
    assert_eq!(triggers.len(), 1);
    let t = &triggers[0];
    assert_eq!(t["type"].as_str(), Some("prometheus"));
    assert_eq!(t["metricType"].as_str(), Some("AverageValue"));
    assert_eq!(t["metadata"]["threshold"].as_str(), Some("0.75"));
    let query = t["metadata"]["query"].as_str().unwrap();
    assert!(
        query.contains("ebpf_gpu_active_compute_duty_cycle{app=\"chat\"}"),
        "{query}"
    );

    // The behaviour is handed to the HPA as is: the HPA API type reads it, and its limits hold
    // (windows 0..3600 s, periods 1..1800 s, positive values, known policy kinds).
    let behavior = &spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"];
    let json = serde_json::to_value(behavior).unwrap();
    let typed: HorizontalPodAutoscalerBehavior = serde_json::from_value(json.clone()).unwrap();
    assert_eq!(
        serde_json::to_value(&typed).unwrap(),
        json,
        "fields the HPA API knows"
    );
    let (up, down) = (typed.scale_up.unwrap(), typed.scale_down.unwrap());
    for rules in [&up, &down] {
        let w = rules.stabilization_window_seconds.unwrap();
        assert!((0..=3600).contains(&w), "window {w}");
        assert!(["Max", "Min", "Disabled"].contains(&rules.select_policy.as_deref().unwrap()));
        let policies = rules.policies.as_ref().unwrap();
        assert!(!policies.is_empty());
        for p in policies {
            assert!((1..=1800).contains(&p.period_seconds), "{p:?}");
            assert!(p.value > 0, "{p:?}");
            assert!(["Pods", "Percent"].contains(&p.type_.as_str()), "{p:?}");
        }
    }
    // up fast, down slowly
    let (up_w, down_w) = (
        up.stabilization_window_seconds.unwrap(),
        down.stabilization_window_seconds.unwrap(),
    );
    assert!(
        up_w <= 30 && down_w >= 300,
        "windows up {up_w} s, down {down_w} s"
    );
    let fastest = |r: &k8s_openapi::api::autoscaling::v2::HPAScalingRules| {
        r.policies
            .as_ref()
            .unwrap()
            .iter()
            .map(|p| p.period_seconds)
            .min()
            .unwrap()
    };
    assert!(fastest(&up) < fastest(&down));
}

/// The schema check can fail: each kind of mistake `kubectl apply` would meet is caught.
#[test]
fn the_schema_check_rejects_what_the_api_server_would() {
    let objs = application_overlay();
    let so = object(&objs, "ScaledObject").clone();
    assert!(schema_errors(&so).is_empty());
    let broken = |f: fn(&mut Value)| {
        let mut o = so.clone();
        f(&mut o);
        schema_errors(&o)
    };
    let e = broken(|o| o["spec"]["pollingIntervall"] = 5.into());
    assert_eq!(e, [".spec.pollingIntervall: unknown field"]);
    let e = broken(|o| o["spec"]["triggers"][0]["metadata"]["threshold"] = 0.75.into());
    assert_eq!(e, [".spec.triggers[0].metadata.threshold: not a string"]);
    let e = broken(|o| o["spec"]["minReplicaCount"] = "1".into());
    assert_eq!(e, [".spec.minReplicaCount: not an integer"]);
    let e = broken(|o| o["spec"]["maxReplicaCount"] = 4_294_967_296i64.into());
    assert_eq!(e, [".spec.maxReplicaCount: 4294967296 is not an int32"]);
    let e = broken(|o| {
        o["spec"]["scaleTargetRef"]
            .as_mapping_mut()
            .unwrap()
            .remove("name");
    });
    assert_eq!(e, [".spec.scaleTargetRef.name: required"]);
    let e = broken(|o| {
        o["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["policies"]
            [0]
        .as_mapping_mut()
        .unwrap()
        .remove("periodSeconds");
    });
    assert_eq!(
        e,
        [".spec.advanced.horizontalPodAutoscalerConfig.behavior.scaleDown.policies[0].periodSeconds: required"]
    );
}

/// The component stays out of every shipped overlay: it belongs to an application's namespace.
#[test]
fn no_shipped_overlay_includes_the_component() {
    for overlay in [
        "base",
        "overlays/operator",
        "overlays/stream",
        "overlays/full",
    ] {
        assert!(
            kustomize(overlay)
                .iter()
                .all(|o| o["kind"].as_str() != Some("ScaledObject")),
            "{overlay}"
        );
    }
}
