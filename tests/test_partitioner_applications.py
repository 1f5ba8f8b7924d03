"""keras.applications models split into 2, 3 and 4 stages reproduce outputs and gradients."""

import warnings

import keras
import numpy as np
import pytest

from hyparflow.partitioner import partition
from tests.support.partitioner import check_plan

BUILDERS = {
    "ResNet50": keras.applications.ResNet50,
    "MobileNetV2": keras.applications.MobileNetV2,
    "DenseNet121": keras.applications.DenseNet121,
}
INPUT_SHAPE = (32, 32, 3)  # the smallest size these applications accept


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def application(request):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MobileNetV2: "no weights for this input size"
        model = BUILDERS[request.param](weights=None, input_shape=INPUT_SHAPE, classes=10)
    x = np.random.default_rng(1).standard_normal((2, *INPUT_SHAPE)).astype("float32")
    return model, x


@pytest.mark.parametrize("num_partitions", [2, 3, 4])
def test_application_split_is_exact(application, num_partitions):
    model, x = application
    plan = partition(model, num_partitions, balance="flops")
    check_plan(model, plan, x, num_partitions, training=True)
    # nothing is forwarded needlessly: every stage sends only what later stages read
    for stage in plan.stages[:-1]:
        for boundary in stage.sends:
            assert boundary.dest_stage == -1 or boundary.dest_stage > stage.index
