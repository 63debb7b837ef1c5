//! Pods' bandwidth annotations as the pod store has them.

use gpufeed_shared::doctor::Finding;

use crate::bandwidth::{EGRESS, INGRESS};
use crate::pods::PodStore;

/// `bandwidth_annotations`: no pod has only one of `kubernetes.io/egress-bandwidth` and
/// `kubernetes.io/ingress-bandwidth`. A pod capped one way only is usually a typo or a
/// half-applied change; the bytes-vs-cap panels then show no cap for the other direction.
pub fn bandwidth_annotations(store: &PodStore) -> Finding {
    const CHECK: &str = "bandwidth_annotations";
    if !store.synced() {
        return Finding::skip(CHECK, "the pod list has not been read from the API yet");
    }
    let mut half = Vec::new();
    let mut both = 0;
    for uid in store.uids() {
        let Some(p) = store.get(&uid) else { continue };
        if p.deleted_at.is_some() {
            continue;
        }
        match (
            p.annotations.contains_key(EGRESS),
            p.annotations.contains_key(INGRESS),
        ) {
            (true, true) => both += 1,
            (true, false) => half.push(format!("{}/{} (egress only)", p.namespace, p.name)),
            (false, true) => half.push(format!("{}/{} (ingress only)", p.namespace, p.name)),
            (false, false) => {}
        }
    }
    half.sort();
    if half.is_empty() {
        return Finding::pass(
            CHECK,
            format!("{both} pods with both caps, none with one only"),
        );
    }
    Finding::fail(
        CHECK,
        format!("{} pods with one cap only: {}", half.len(), half.join(", ")),
        format!("annotate each with both {EGRESS} and {INGRESS} (the same value when the link is symmetric)"),
    )
}
