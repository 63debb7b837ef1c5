//! The dashboards per purpose in grafana.com's export format
//! (`talos/kubernetes/components/grafana-dashboards/grafana.com/`: the node, the host, FinOps),
//! beside the sidecar's one dashboard. They are derived from it, not written beside it: each is
//! the sidecar dashboard's rows for its purpose, laid out from the top, with the data source an
//! import input (`__inputs` DS_PROMETHEUS, as Grafana's "Export for sharing externally" writes
//! it) instead of the `datasource` variable, only the variables and links its panels use, and
//! `__requires` naming Grafana, the Prometheus data source and every panel type in it. A shipped
//! file that differs from its derivation fails here (`GPUFEED_BLESS_DASHBOARDS=1` writes them);
//! every panel query of them is evaluated on a real Prometheus by dashboards_prometheus. No
//! root, no network.

use crate::manifests;

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::{json, Value as Json};

/// (file stem, title, the sidecar dashboard's rows it holds, in order)
const PURPOSES: [(&str, &str, &[&str]); 3] = [
    (
        "gpufeed-node",
        "gpufeed: node (the GPU fed, pods, network, correlation, agent)",
        &[
            "Is the GPU getting fed?",
            "Pods",
            "Network",
            "Correlation: pod latency spikes and host events",
            "Host → guest stream",
            "Agent",
        ],
    ),
    (
        "gpufeed-host",
        "gpufeed: Proxmox host (PCIe, AER, Thunderbolt, VM, bridge)",
        &[
            "Host: PCIe link and AER",
            "Host: Thunderbolt",
            "Host: the VM",
            "Host: the bridge",
        ],
    ),
    ("gpufeed-finops", "gpufeed: GPU FinOps", &["GPU FinOps"]),
];

/// The `__inputs` entry and what references it.
const INPUT: &str = "DS_PROMETHEUS";
/// The Grafana release the sidecar dashboard's schemaVersion (39) belongs to.
const GRAFANA: &str = "10.4.0";

fn sidecar() -> Json {
    let path = manifests::kustomize_dir("components/grafana-dashboards/gpufeed.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn export_path(stem: &str) -> PathBuf {
    manifests::kustomize_dir("components/grafana-dashboards/grafana.com")
        .join(format!("{stem}.json"))
}

/// Every `"uid": "${datasource}"` reference, anywhere in `v`, pointed at the import input.
fn to_input(v: &mut Json) {
    match v {
        Json::Object(m) => {
            if m.get("uid").and_then(Json::as_str) == Some("${datasource}") {
                m.insert("uid".into(), json!(format!("${{{INPUT}}}")));
            }
            m.values_mut().for_each(to_input);
        }
        Json::Array(a) => a.iter_mut().for_each(to_input),
        _ => {}
    }
}

/// Whether `text` uses variable `name` (`$name`, `${name}`, `${name:format}`).
fn uses(text: &str, name: &str) -> bool {
    let plain = format!("${name}");
    text.match_indices(&plain).any(|(i, _)| {
        !text[i + plain.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
    }) || text.contains(&format!("${{{name}}}"))
        || text.contains(&format!("${{{name}:"))
}

/// The export for one purpose, derived from the sidecar dashboard.
fn derive(d: &Json, stem: &str, title: &str, rows: &[&str]) -> Json {
    let panels = d["panels"].as_array().unwrap();
    // the sidecar's sections: each row with the panels below it up to the next row
    let mut sections: Vec<(String, Vec<Json>)> = Vec::new();
    for p in panels {
        if p["type"] == "row" {
            sections.push((p["title"].as_str().unwrap().to_string(), vec![p.clone()]));
        } else {
            sections
                .last_mut()
                .expect("panels start with a row")
                .1
                .push(p.clone());
        }
    }
    let mut out_panels = Vec::new();
    let mut y = 0;
    for want in rows {
        let (_, section) = sections
            .iter()
            .find(|(t, _)| t == want)
            .unwrap_or_else(|| panic!("the sidecar dashboard has no row {want:?}"));
        let top = section[0]["gridPos"]["y"].as_i64().unwrap();
        let bottom = section
            .iter()
            .map(|p| p["gridPos"]["y"].as_i64().unwrap() + p["gridPos"]["h"].as_i64().unwrap())
            .max()
            .unwrap();
        for p in section {
            let mut p = p.clone();
            let py = p["gridPos"]["y"].as_i64().unwrap();
            p["gridPos"]["y"] = json!(py - top + y);
            to_input(&mut p);
            out_panels.push(p);
        }
        y += bottom - top;
    }
    let mut annotations = d["annotations"].clone();
    to_input(&mut annotations);
    // the host events annotation where the dashboard is about what they explain
    if stem == "gpufeed-finops" {
        annotations["list"]
            .as_array_mut()
            .unwrap()
            .retain(|a| a["builtIn"] == 1);
    }
    let links: Vec<Json> = d["links"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|_| stem == "gpufeed-node")
        .cloned()
        .collect();
    let body = serde_json::to_string(&(&out_panels, &annotations, &links)).unwrap();
    let mut variables = Vec::new();
    // a variable used by a kept one's query counts too (pod's query uses $namespace)
    let all: Vec<Json> = d["templating"]["list"].as_array().unwrap().clone();
    let mut used: BTreeSet<String> = all
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_string())
        .filter(|n| n != "datasource" && uses(&body, n))
        .collect();
    loop {
        let before = used.len();
        for v in &all {
            if used.contains(v["name"].as_str().unwrap()) {
                let q = v["query"].to_string();
                for other in &all {
                    let n = other["name"].as_str().unwrap();
                    if n != "datasource" && uses(&q, n) {
                        used.insert(n.to_string());
                    }
                }
            }
        }
        if used.len() == before {
            break;
        }
    }
    for v in &all {
        if used.contains(v["name"].as_str().unwrap()) {
            let mut v = v.clone();
            to_input(&mut v);
            variables.push(v);
        }
    }
    let panel_types: BTreeSet<&str> = out_panels
        .iter()
        .filter(|p| p["type"] != "row")
        .map(|p| p["type"].as_str().unwrap())
        .collect();
    let mut requires = vec![
        json!({"type": "grafana", "id": "grafana", "name": "Grafana", "version": GRAFANA}),
        json!({"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"}),
    ];
    for t in panel_types {
        let name = match t {
            "timeseries" => "Time series",
            "stat" => "Stat",
            "table" => "Table",
            "text" => "Text",
            other => panic!("a panel type without its name here: {other}"),
        };
        requires.push(json!({"type": "panel", "id": t, "name": name, "version": ""}));
    }
    json!({
        "__inputs": [{
            "name": INPUT,
            "label": "Prometheus",
            "description": "the Prometheus that scrapes gpufeed-guest (and gpufeed-host)",
            "type": "datasource",
            "pluginId": "prometheus",
            "pluginName": "Prometheus",
        }],
        "__requires": requires,
        "id": null,
        "uid": stem,
        "title": title,
        "tags": d["tags"],
        "schemaVersion": d["schemaVersion"],
        "version": d["version"],
        "editable": d["editable"],
        "timezone": d["timezone"],
        "refresh": d["refresh"],
        "time": d["time"],
        "templating": {"list": variables},
        "annotations": annotations,
        "panels": out_panels,
        "links": links,
    })
}

/// Each shipped export is its derivation from the sidecar dashboard.
#[test]
fn the_exports_are_the_sidecar_dashboards_rows_per_purpose() {
    let d = sidecar();
    let bless = std::env::var("GPUFEED_BLESS_DASHBOARDS").as_deref() == Ok("1");
    for (stem, title, rows) in PURPOSES {
        let want = derive(&d, stem, title, rows);
        let path = export_path(stem);
        if bless {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            let text = serde_json::to_string_pretty(&want).unwrap() + "\n";
            std::fs::write(&path, text).unwrap();
        }
        let shipped: Json = serde_json::from_str(
            &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        )
        .unwrap();
        assert!(
            shipped == want,
            "{} is not derived from gpufeed.json: rerun with GPUFEED_BLESS_DASHBOARDS=1",
            path.display()
        );
    }
}

/// What grafana.com's import needs, and each purpose's content: the node's first panel is the
/// GPU feed stall, then the run-queue, RTT and bandwidth panels; every sidecar panel is in one
/// export; nothing
/// refers to the sidecar's `datasource` variable.
#[test]
fn the_exports_are_in_grafana_coms_format_and_cover_every_panel() {
    let d = sidecar();
    let mut covered = BTreeSet::new();
    for (stem, _, rows) in PURPOSES {
        let e: Json =
            serde_json::from_str(&std::fs::read_to_string(export_path(stem)).unwrap()).unwrap();
        let text = e.to_string();
        assert!(!uses(&text, "datasource"), "{stem}: refers to $datasource");
        assert_eq!(e["__inputs"][0]["name"], INPUT);
        assert_eq!(e["__inputs"][0]["pluginId"], "prometheus");
        assert!(e["id"].is_null(), "{stem}: an export has no id");
        let requires: BTreeSet<(String, String)> = e["__requires"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["type"].as_str().unwrap().to_string(),
                    r["id"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        assert!(requires.contains(&("grafana".into(), "grafana".into())));
        assert!(requires.contains(&("datasource".into(), "prometheus".into())));
        let mut ids = BTreeSet::new();
        let mut last_row_y = -1;
        for p in e["panels"].as_array().unwrap() {
            assert!(
                ids.insert(p["id"].as_u64().unwrap()),
                "{stem}: duplicate id"
            );
            if p["type"] == "row" {
                let y = p["gridPos"]["y"].as_i64().unwrap();
                assert!(y > last_row_y, "{stem}: rows in order");
                last_row_y = y;
                assert!(rows.contains(&p["title"].as_str().unwrap()));
                continue;
            }
            let ty = p["type"].as_str().unwrap().to_string();
            assert!(
                requires.contains(&("panel".into(), ty.clone())),
                "{stem}: {ty}"
            );
            assert_eq!(p["datasource"]["uid"], format!("${{{INPUT}}}"));
            for t in p["targets"].as_array().unwrap() {
                assert_eq!(t["datasource"]["uid"], format!("${{{INPUT}}}"));
            }
            covered.insert(p["title"].as_str().unwrap().to_string());
        }
        // every variable a panel uses is defined
        let defined: Vec<String> = e["templating"]["list"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap().to_string())
            .collect();
        for v in ["namespace", "pod", "tenant", "host", "parca_url"] {
            let body =
                serde_json::to_string(&(&e["panels"], &e["annotations"], &e["links"])).unwrap();
            if uses(&body, v) {
                assert!(defined.contains(&v.to_string()), "{stem}: ${v} undefined");
            }
        }
        if stem == "gpufeed-node" {
            let first: Vec<&str> = e["panels"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|p| p["type"] != "row")
                .take(4)
                .map(|p| p["title"].as_str().unwrap())
                .collect();
            // the product's question first, then the seed's three panels
            assert_eq!(
                first,
                [
                    "GPU feed stall per pod and cause",
                    "Run-queue wait p99 per pod",
                    "TCP RTT per pod and destination",
                    "Bytes vs bandwidth cap"
                ]
            );
        }
    }
    let all: BTreeSet<String> = d["panels"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["type"] != "row")
        .map(|p| p["title"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(covered, all, "every sidecar panel in an export");
}
