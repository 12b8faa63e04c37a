#!/usr/bin/env python3
"""Renders attnd's kustomizations and validates them offline, no cluster needed.

    validate.py [--self-test] [--print OVERLAY] [DIR]     (DIR: deploy/k8s)

Rendering: the subset of Kustomize these manifests use (resources, namespace,
labels without selectors, patches as strategic merges with $patch: delete),
in Python, so CI needs no kubectl; `kubectl kustomize DIR/overlays/X` renders
the same objects. Validation of every rendered object:
- core kinds against the Kubernetes OpenAPI schemas with kubernetes-validate,
  strict (unknown fields fail), for the oldest and newest versions named below;
- ServiceMonitor and LeaderWorkerSet against the vendored subsets of their
  CRDs in schemas/, and the LeaderWorkerSet's pod templates as core
  PodTemplates;
- attnd's own rules: the hardening of the systemd unit (non-root, read-only
  root, no privilege escalation, no capabilities, seccomp RuntimeDefault), the
  /healthz and /readyz probes on the metrics port, the Prometheus annotations,
  a headless Service, one GPU per pod in the GPU overlays.
--self-test also checks that broken copies of the manifests are rejected.
Exit 0: all valid; 1: something is not (each problem on its own line).
"""
import argparse
import copy
import json
import os
import sys

import yaml

import kubernetes_validate as kv
import jsonschema

VERSIONS = ("1.29.0", "1.37.0")
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PriorityClass", "StorageClass", "PersistentVolume"}
# Strategic-merge keys of the lists these manifests patch (others are replaced).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name",
              "volumeMounts": "name", "env": "name", "ports": "containerPort",
              "volumeClaimTemplates": None}
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "namespace", "labels", "patches"}
RPC_PORT, METRICS_PORT = 7411, 7412


class Invalid(Exception):
    pass


# ---- rendering ----

def load_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def merge(base, patch):
    """Strategic merge of patch into base (both plain YAML data); returns the result."""
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(base)
    for k, v in patch.items():
        if k in out and isinstance(out[k], list) and isinstance(v, list) and MERGE_KEYS.get(k):
            key = MERGE_KEYS[k]
            items = [copy.deepcopy(x) for x in out[k]]
            for pv in v:
                match = [i for i, x in enumerate(items) if isinstance(x, dict) and x.get(key) == pv.get(key)]
                if match:
                    items[match[0]] = merge(items[match[0]], pv)
                else:
                    items.append(copy.deepcopy(pv))
            out[k] = items
        elif k in out:
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def ident(doc):
    return doc.get("kind"), doc.get("metadata", {}).get("name")


def render(d):
    """Renders the kustomization in directory d into a list of objects."""
    kpath = os.path.join(d, "kustomization.yaml")
    if not os.path.exists(kpath):
        raise Invalid(f"{d}: no kustomization.yaml")
    (k,) = load_docs(kpath)
    extra = set(k) - KUSTOMIZATION_KEYS
    if extra:
        raise Invalid(f"{kpath}: fields {sorted(extra)} are outside the subset this renderer knows")
    objs = []
    for r in k.get("resources", []):
        p = os.path.normpath(os.path.join(d, r))
        objs += render(p) if os.path.isdir(p) else load_docs(p)
    for p in k.get("patches", []):
        if set(p) - {"path"}:
            raise Invalid(f"{kpath}: only patches with a path are supported here")
        for doc in load_docs(os.path.join(d, p["path"])):
            want = ident(doc)
            hits = [i for i, o in enumerate(objs) if ident(o) == want]
            if len(hits) != 1:
                raise Invalid(f"{kpath}: patch {p['path']} targets {want}, found {len(hits)} objects")
            if doc.get("$patch") == "delete":
                del objs[hits[0]]
            else:
                objs[hits[0]] = merge(objs[hits[0]], doc)
    for lab in k.get("labels", []):
        if lab.get("includeSelectors"):
            raise Invalid(f"{kpath}: labels with includeSelectors are outside this renderer's subset")
        for o in objs:
            o.setdefault("metadata", {}).setdefault("labels", {}).update(lab["pairs"])
            if lab.get("includeTemplates"):
                tmpl = o.get("spec", {}).get("template")
                if tmpl is not None:
                    tmpl.setdefault("metadata", {}).setdefault("labels", {}).update(lab["pairs"])
    if k.get("namespace"):
        for o in objs:
            if o.get("kind") not in CLUSTER_SCOPED:
                o.setdefault("metadata", {})["namespace"] = k["namespace"]
    return objs


# ---- validation ----

def schema_dir():
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "schemas")


def crd_schema(kind, api_version):
    group, _, ver = api_version.partition("/")
    path = os.path.join(schema_dir(), f"{kind.lower()}.{group}_{ver}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def pod_templates(o):
    """(where, PodTemplateSpec) of every pod template in an object."""
    spec = o.get("spec", {})
    if "template" in spec:
        yield "spec.template", spec["template"]
    lwt = spec.get("leaderWorkerTemplate", {})
    for name in ("leaderTemplate", "workerTemplate"):
        if name in lwt:
            yield f"spec.leaderWorkerTemplate.{name}", lwt[name]


def check_schema(o, where):
    problems = []
    kind, api = o.get("kind"), o.get("apiVersion", "")
    crd = crd_schema(kind, api) if kind else None
    if crd is not None:
        for e in jsonschema.Draft7Validator(crd).iter_errors(o):
            problems.append(f"{where}: {'.'.join(str(p) for p in e.absolute_path)}: {e.message}")
        for path, t in pod_templates(o):
            pt = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": t}
            for v in VERSIONS:
                try:
                    kv.validate(pt, v, strict=True)
                except kv.ValidationError as e:
                    problems.append(f"{where} {path} (Kubernetes {v}): {str(e).splitlines()[0]}")
        return problems
    for v in VERSIONS:
        try:
            kv.validate(o, v, strict=True)
        except kv.SchemaNotFoundError:
            problems.append(f"{where}: no schema for {api} {kind} (vendor one in schemas/)")
            break
        except kv.ValidationError as e:
            problems.append(f"{where} (Kubernetes {v}): {str(e).splitlines()[0]}")
    return problems


def check_rules(objs, where, gpu):
    """attnd's own requirements on the rendered manifests. gpu: True (one GPU per
    pod), False (none), None (not checked: the base)."""
    p = []
    kinds = [o["kind"] for o in objs]
    for need in ("Service", "ServiceMonitor", "ConfigMap", "ServiceAccount"):
        if need not in kinds:
            p.append(f"{where}: no {need}")
    for o in objs:
        name = f"{where} {o['kind']}/{o['metadata']['name']}"
        if o["kind"] == "Service":
            if o["spec"].get("clusterIP") != "None":
                p.append(f"{name}: must be headless (clusterIP: None) for client-side discovery")
            ports = {x["name"]: x["port"] for x in o["spec"].get("ports", [])}
            if ports != {"rpc": RPC_PORT, "metrics": METRICS_PORT}:
                p.append(f"{name}: ports {ports}, want rpc {RPC_PORT} and metrics {METRICS_PORT}")
        for path, t in pod_templates(o):
            tname = f"{name} {path}"
            ps = t.get("spec", {})
            ann = t.get("metadata", {}).get("annotations", {})
            if ann.get("prometheus.io/scrape") != "true" or ann.get("prometheus.io/port") != str(METRICS_PORT):
                p.append(f"{tname}: the metrics port must be annotated for Prometheus")
            sc = ps.get("securityContext", {})
            if not sc.get("runAsNonRoot") or sc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
                p.append(f"{tname}: pod must run as non-root with seccomp RuntimeDefault")
            if ps.get("automountServiceAccountToken") is not False:
                p.append(f"{tname}: no service account token is needed")
            for c in ps.get("containers", []):
                cn = f"{tname} container {c['name']}"
                csc = c.get("securityContext", {})
                if (csc.get("allowPrivilegeEscalation") is not False or csc.get("readOnlyRootFilesystem") is not True
                        or csc.get("capabilities", {}).get("drop") != ["ALL"] or csc.get("privileged")):
                    p.append(f"{cn}: needs allowPrivilegeEscalation false, readOnlyRootFilesystem, drop ALL")
                for probe, path_ in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"),
                                     ("startupProbe", "/healthz")):
                    g = c.get(probe, {}).get("httpGet", {})
                    if g.get("path") != path_ or g.get("port") not in ("metrics", METRICS_PORT):
                        p.append(f"{cn}: {probe} must GET {path_} on the metrics port")
                gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
                if gpu and str(gpus) != "1":
                    p.append(f"{cn}: one attnd per GPU: limits nvidia.com/gpu must be 1, not {gpus}")
                if gpu is False and gpus is not None:
                    p.append(f"{cn}: a CPU overlay asks for no GPU")
    return p


def overlays(root):
    od = os.path.join(root, "overlays")
    return sorted(os.path.join(od, x) for x in os.listdir(od) if os.path.isdir(os.path.join(od, x)))


def validate_tree(root):
    problems, counts = [], {}
    for d in [os.path.join(root, "base")] + overlays(root):
        where = os.path.relpath(d, root)
        try:
            objs = render(d)
        except (Invalid, OSError, yaml.YAMLError) as e:
            problems.append(f"{where}: {e}")
            continue
        for o in objs:
            problems += check_schema(o, f"{where} {o.get('kind')}/{o.get('metadata', {}).get('name')}")
        # The base leaves the GPU to its overlays; the CPU overlay must ask for none.
        gpu = {"base": None, "cpu": False}.get(os.path.basename(d), True)
        problems += check_rules(objs, where, gpu)
        counts[where] = len(objs)
    return problems, counts


def self_test(root):
    """Broken variants must be rejected: each one alone."""
    def broken(edit):
        objs = render(os.path.join(root, "overlays", "gpu")) + render(os.path.join(root, "overlays", "sharded-lws"))
        edit(objs)
        out = []
        for o in objs:
            out += check_schema(o, o["kind"])
        return out + check_rules(objs, "x", True)

    def find(objs, kind):
        return next(o for o in objs if o["kind"] == kind)

    def c0(objs, kind="StatefulSet"):
        return find(objs, kind)["spec"]["template"]["spec"]["containers"][0]

    def lws0(objs):
        return find(objs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]

    cases = {
        "replicas as a string": lambda o: find(o, "StatefulSet")["spec"].update(replicas="two"),
        "unknown container field": lambda o: c0(o).update(imagePullPolicyy="Always"),
        "root allowed": lambda o: find(o, "StatefulSet")["spec"]["template"]["spec"]["securityContext"].pop("runAsNonRoot"),
        "writable root": lambda o: c0(o)["securityContext"].update(readOnlyRootFilesystem=False),
        "two GPUs": lambda o: c0(o)["resources"]["limits"].update({"nvidia.com/gpu": 2}),
        "probe path": lambda o: c0(o)["readinessProbe"]["httpGet"].update(path="/metrics"),
        "ServiceMonitor typo": lambda o: find(o, "ServiceMonitor")["spec"]["endpoints"][0].update(intervall="15s"),
        "ServiceMonitor duration": lambda o: find(o, "ServiceMonitor")["spec"]["endpoints"][0].update(interval="soon"),
        "LWS size": lambda o: find(o, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"].update(size=0),
        "LWS restart policy": lambda o: find(o, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"].update(restartPolicy="Always"),
        "LWS pod template field": lambda o: lws0(o).update(cpu="8"),
        "not headless": lambda o: find(o, "Service")["spec"].pop("clusterIP"),
        "no annotation": lambda o: find(o, "StatefulSet")["spec"]["template"]["metadata"].pop("annotations"),
    }
    failed = []
    for name, edit in cases.items():
        if not broken(edit):
            failed.append(f"self-test: a manifest with {name} passed validation")
    return failed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--print", metavar="OVERLAY", help="print the rendered overlay (or base) as YAML")
    a = ap.parse_args()
    if a.print:
        d = os.path.join(a.root, a.print) if a.print == "base" else os.path.join(a.root, "overlays", a.print)
        yaml.safe_dump_all(render(d), sys.stdout, sort_keys=False)
        return 0
    problems, counts = validate_tree(a.root)
    if a.self_test:
        problems += self_test(a.root)
    for p in problems:
        print(p)
    for where, n in counts.items():
        print(f"{where}: {n} objects rendered and checked against Kubernetes {' and '.join(VERSIONS)}")
    print(f"{len(problems)} problems" + (" (self-test included)" if a.self_test else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
