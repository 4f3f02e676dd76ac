"""Each revision is judged by the spec it was created from (recorded on its router ConfigMap),
and the revision that serves is found from the cluster when status is lost."""

from helpers.builders import sample_spec
from helpers.crd_admission import load_sample
from kvfence_operator.crd.types import InferenceDeployment, InferenceDeploymentSpec
from kvfence_operator.revision import judged_spec, revision_of, spec_record


def _with(change: dict) -> InferenceDeploymentSpec:
    manifest = load_sample("full")
    manifest["spec"].update(change)
    return InferenceDeployment.model_validate(manifest).spec


def test_a_revision_is_judged_by_the_spec_recorded_on_it():
    serving = sample_spec("full")
    wider = _with({"contextLength": serving.context_length * 2})
    record = spec_record(serving)
    old, new = revision_of(serving), revision_of(wider)
    assert judged_spec(old, new, wider, record) == serving
    assert judged_spec(new, new, wider, spec_record(wider)) == wider
    # the desired revision takes in-place changes (minContextLength) from the object's spec
    in_place = _with({"minContextLength": 1024})
    assert judged_spec(old, old, in_place, record) == in_place
    # a revision an older operator created has no record: the object's spec, as before
    assert judged_spec(old, new, wider, None) == wider
    assert judged_spec(old, new, wider, "{not json") == wider
