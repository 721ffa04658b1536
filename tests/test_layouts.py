"""Built-in layouts are the real models' shapes: parameter counts as published."""

import pytest
from weightsync_bench.layouts import layout


@pytest.mark.parametrize("name, params", [("qwen2.5-1.5b", 1_543_714_304), ("qwen2.5-3b", 3_085_938_688)])
def test_growth_layouts_have_the_published_parameter_counts(name, params):
    m = layout(name)
    assert sum(s.nbytes for s in m) == 2 * params  # bf16
    assert {s.dtype for s in m} == {"bfloat16"} and "lm_head.weight" not in {s.name for s in m}  # tied
