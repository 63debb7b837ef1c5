// Validates custom resources against their projects' published CRD schemas, as the npm
// packages @kubernetes-models/keda and @kubernetes-models/prometheus-operator generate them:
//
//   node validate_crds.mjs OBJECTS.json
//
// OBJECTS.json holds an array of objects; the answer (stdout) is an array of the same length,
// each the list of what is wrong with that object (empty: valid). Two checks:
//
// * the schema's validator (types, int32/int64 formats, enums, required fields), as the API
//   server applies the CRD's openAPIV3Schema;
// * unknown fields, which the generated validators let through (CRD schemas rely on the API
//   server's pruning) but `kubectl apply` refuses (strict field validation): each object is
//   type-checked by the TypeScript compiler against the package's generated interface, whose
//   excess-property check names any field the schema does not have.
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { createRequire } from "node:module";
import ts from "typescript";
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";
import { PodMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";

const KINDS = {
  "keda.sh/v1alpha1 ScaledObject": {
    model: ScaledObject,
    module: "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject",
    type: "IScaledObject",
  },
  "monitoring.coreos.com/v1 PodMonitor": {
    model: PodMonitor,
    module: "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor",
    type: "IPodMonitor",
  },
  "monitoring.coreos.com/v1 PrometheusRule": {
    model: PrometheusRule,
    module: "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule",
    type: "IPrometheusRule",
  },
};

const objects = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
const errors = objects.map(() => []);
const here = path.dirname(new URL(import.meta.url).pathname);
// scripts/schema-tools.sh puts this script beside the packages
const modules = path.join(here, "node_modules");

// 1. the schema validators
const typed = [];
objects.forEach((o, i) => {
  const kind = KINDS[`${o.apiVersion} ${o.kind}`];
  if (!kind) {
    errors[i].push(`no schema for ${o.apiVersion} ${o.kind}`);
    return;
  }
  try {
    new kind.model(o).validate();
  } catch (e) {
    for (const d of e.errors ?? e.details ?? [{ instancePath: "", message: e.message }]) {
      errors[i].push(`${d.instancePath || "/"}: ${d.message}`);
    }
  }
  typed.push([i, kind]);
});

// 2. unknown fields, by the compiler's excess-property check on each object literal
if (typed.length > 0) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "crd-check-"));
  fs.symlinkSync(modules, path.join(dir, "node_modules"));
  const file = path.join(dir, "objects.ts");
  const lines = [];
  const line_of = [];
  for (const [i, kind] of typed) {
    lines.push(`import type { ${kind.type} as T${i} } from "${kind.module}";`);
  }
  for (const [i] of typed) {
    line_of.push([lines.length, i]);
    lines.push(`export const o${i}: T${i} = ${JSON.stringify(objects[i])};`);
  }
  fs.writeFileSync(file, lines.join("\n") + "\n");
  const program = ts.createProgram([file], {
    noEmit: true,
    strict: true,
    skipLibCheck: true,
    module: ts.ModuleKind.NodeNext,
    moduleResolution: ts.ModuleResolutionKind.NodeNext,
    target: ts.ScriptTarget.ES2022,
  });
  // only the unknown-field diagnostics: types and required fields are the validators' above
  const EXCESS = new Set([2353, 2561]);
  for (const d of ts.getPreEmitDiagnostics(program)) {
    const text = ts.flattenDiagnosticMessageText(d.messageText, " ");
    if (d.file && d.file.fileName === file && !EXCESS.has(d.code)) continue;
    if (!d.file || d.file.fileName !== file) {
      errors.forEach((e) => e.push(`type check: ${text}`));
      continue;
    }
    const { line } = d.file.getLineAndCharacterOfPosition(d.start ?? 0);
    const hit = line_of.find(([l]) => l === line);
    if (hit) errors[hit[1]].push(text.replace(/"/g, ""));
  }
  fs.rmSync(dir, { recursive: true, force: true });
}

process.stdout.write(JSON.stringify(errors) + "\n");
