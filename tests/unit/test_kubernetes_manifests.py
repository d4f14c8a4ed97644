"""examples/kubernetes/*.yaml against the Kubeflow CRDs of the releases they name (tests/data/crds,
copied as released): the CRD's OpenAPI schema, strictly (an unknown field is an error, as under
`kubectl apply`'s default strict field validation)."""

import copy
import functools
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

pytestmark = pytest.mark.slow  # the CRDs' schemas: over a second in all

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO / "tests" / "data" / "crds"
MANIFESTS = {"trainjob.yaml": ("kubeflow-trainer-v2.3.0_trainjobs.yaml", "Kubeflow Trainer v2.3"),
             "pytorchjob.yaml": ("kubeflow-training-operator-v1.9.4_pytorchjobs.yaml", "Training Operator v1.9")}


def strict(schema: dict) -> dict:
    """The schema with every object closed to fields it does not name (Kubernetes' strict field
    validation), except where the CRD keeps unknown fields."""
    schema = copy.deepcopy(schema)

    def close(node: object) -> None:
        if isinstance(node, dict):
            if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node.setdefault("additionalProperties", False)
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)
    close(schema)
    return schema


LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: the CRDs are 0.6 MB each


@functools.cache
def _crd(crd_file: str) -> dict:
    (crd,) = [d for d in yaml.load_all((CRDS / crd_file).read_text(), Loader=LOADER) if d]
    return crd


@functools.cache
def crd_schema(crd_file: str, api_version: str, kind: str) -> dict:
    crd = _crd(crd_file)
    group, version = api_version.split("/")
    assert (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (group, kind), "the manifest names another CRD"
    served = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served")}
    assert version in served, f"{api_version} is not served by {crd_file} (it serves {sorted(served)})"
    return strict(served[version]["schema"]["openAPIV3Schema"])


def validate(document: dict, schema: dict) -> None:
    """jsonschema's validation without its check of the schema itself (seconds for a CRD's)."""
    jsonschema.Draft7Validator(schema).validate(document)


@pytest.mark.parametrize("manifest", sorted(MANIFESTS))
def test_the_example_manifest_validates_against_the_crd_of_the_release_it_names(manifest):
    crd_file, release = MANIFESTS[manifest]
    text = (REPO / "examples" / "kubernetes" / manifest).read_text()
    assert release in text.split("apiVersion:", 1)[0], f"{manifest} should name its release ({release})"
    document = yaml.safe_load(text)
    validate(document, crd_schema(crd_file, document["apiVersion"], document["kind"]))


def test_the_v2_0_field_v2_3_removed_is_refused():
    """What the check catches: the TrainJob as it was written for Trainer v2.0 (podSpecOverrides)."""
    document = yaml.safe_load((REPO / "examples" / "kubernetes" / "trainjob.yaml").read_text())
    old = copy.deepcopy(document)
    old["spec"].pop("runtimePatches")
    old["spec"]["podSpecOverrides"] = [{"targetJobs": [{"name": "node"}], "volumes": []}]
    with pytest.raises(jsonschema.ValidationError, match=re.escape("'podSpecOverrides' was unexpected")):
        validate(old, crd_schema(MANIFESTS["trainjob.yaml"][0], old["apiVersion"], old["kind"]))
