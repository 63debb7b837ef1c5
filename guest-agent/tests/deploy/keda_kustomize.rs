//! The opt-in KEDA component (`talos/kubernetes/components/keda`) as an application's
//! kustomization uses it, built by the real `kubectl kustomize` (what `kubectl apply -k` sends):
//! its ScaledObject is valid against KEDA's published CRD schema (npm's @kubernetes-models/keda,
//! installed by scripts/schema-tools.sh), its scaling behaviour is what the HPA API accepts,
//! and it scales the application's Deployment on gpufeed's duty cycle. Needs `kubectl`, node
//! and python3 (and the registries on first use); no cluster, no root.

use crate::manifests;

use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscalerBehavior;
use manifests::*;
use serde_yaml::Value;

/// What KEDA's published CRD schema finds wrong with a ScaledObject (npm's
/// @kubernetes-models/keda: types, formats, required and unknown fields).
fn schema_errors(obj: &Value) -> Vec<String> {
    crd_errors(std::slice::from_ref(obj)).remove(0)
}

fn application_overlay() -> Vec<Value> {
    keda_application_overlay()
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

/// A field a mistake touches, and the mistake.
type Mistake = (&'static str, fn(&mut Value));

/// The schema check can fail: each kind of mistake `kubectl apply` would meet is caught.
#[test]
fn the_schema_check_rejects_what_the_api_server_would() {
    let objs = application_overlay();
    let so = object(&objs, "ScaledObject").clone();
    assert!(schema_errors(&so).is_empty());
    // each mistake alone (all checked in one run of the validators), and the schema names
    // the field
    let mistakes: [Mistake; 6] = [
        ("pollingIntervall", |o| {
            o["spec"]["pollingIntervall"] = 5.into()
        }),
        ("threshold", |o| {
            o["spec"]["triggers"][0]["metadata"]["threshold"] = 0.75.into()
        }),
        ("minReplicaCount", |o| {
            o["spec"]["minReplicaCount"] = "1".into()
        }),
        ("maxReplicaCount", |o| {
            o["spec"]["maxReplicaCount"] = 4_294_967_296i64.into()
        }),
        ("name", |o| {
            o["spec"]["scaleTargetRef"]
                .as_mapping_mut()
                .unwrap()
                .remove("name");
        }),
        ("periodSeconds", |o| {
            o["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
                ["policies"][0]
                .as_mapping_mut()
                .unwrap()
                .remove("periodSeconds");
        }),
    ];
    let variants: Vec<Value> = mistakes
        .iter()
        .map(|(_, f)| {
            let mut o = so.clone();
            f(&mut o);
            o
        })
        .collect();
    for ((field, _), e) in mistakes.iter().zip(crd_errors(&variants)) {
        assert!(
            e.len() == 1 && e[0].contains(field),
            "expected one error naming {field}: {e:?}"
        );
    }
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
