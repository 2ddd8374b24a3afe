"""Turn a CustomResourceDefinition into strict JSON Schemas, one per served version, for
`check-jsonschema` (the manifests under deploy/ are checked against them offline, in the tests).

    python deploy/schemas/vendor_crd.py CRD.yaml OUT_DIR --source "owner/repo@commit:path"

Strict means what the API server does not do but a review wants: an unknown field is an error
(`additionalProperties: false` on every object that lists its properties and does not preserve
unknown fields), so a typo such as `protocolVersions: v2` under the wrong key fails the test
instead of being pruned silently by the cluster. Descriptions are dropped to keep the files small."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml


def strict(node):
    if isinstance(node, list):
        return [strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict(v) for k, v in node.items() if k != "description"}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def version_schemas(crd: dict, source: str) -> dict[str, dict]:
    spec = crd["spec"]
    group, kind = spec["group"], spec["names"]["kind"]
    schemas = {}
    for version in spec["versions"]:
        schema = strict(version["schema"]["openAPIV3Schema"])
        schema["properties"]["apiVersion"] = {"const": f"{group}/{version['name']}"}
        schema["properties"]["kind"] = {"const": kind}
        schema["properties"]["metadata"] = {"type": "object"}
        schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
        schema = {"$schema": "http://json-schema.org/draft-07/schema#",
                  "title": f"{kind} {group}/{version['name']}", "$comment": f"from {source}", **schema}
        schemas[f"{kind.lower()}_{group.split('.')[0]}_{version['name']}.json"] = schema
    return schemas


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("crd")
    p.add_argument("out_dir")
    p.add_argument("--source", required=True, help="where the CRD came from: owner/repo@commit:path")
    args = p.parse_args()
    crds = [d for d in yaml.safe_load_all(Path(args.crd).read_text()) if d and d.get("kind") == "CustomResourceDefinition"]
    for crd in crds:
        for name, schema in version_schemas(crd, args.source).items():
            path = Path(args.out_dir) / name
            path.write_text(json.dumps(schema, separators=(",", ":"), sort_keys=True) + "\n")
            print(f"{path}: {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
