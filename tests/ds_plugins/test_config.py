"""ParmConfig: the "parm" section of a DeepSpeed config, parsed and validated once."""

import json

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from ds_plugins.config import ParmConfig


def test_defaults_and_full_section():
    assert ParmConfig.from_deepspeed({"train_batch_size": 8}) == ParmConfig()
    cfg = ParmConfig.from_deepspeed({"parm": {"enabled": True, "schedule": "s2", "overlap_chunks": 8,
                                              "skip_empty_slots": False, "debug": True,
                                              "cost_cache": "/tmp/c.json"}})
    got = (cfg.enabled, cfg.schedule, cfg.overlap_chunks, cfg.skip_empty_slots, cfg.debug, cfg.cost_cache)
    assert got == (True, "s2", 8, False, True, "/tmp/c.json")
    assert ParmConfig().skip_empty_slots


def test_reads_a_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "parm": {"enabled": True, "schedule": "s1"}}))
    assert ParmConfig.from_deepspeed(str(path)).schedule == "s1"


def test_deepspeed_accepts_the_section_verbatim():
    ds = DeepSpeedConfig({"train_batch_size": 1, "parm": {"enabled": True, "schedule": "auto"}})
    assert ParmConfig.from_deepspeed(ds._param_dict).enabled


@pytest.mark.parametrize(("section", "message"), [
    ({"pipeline_degree": 4}, r"unknown key\(s\) \['pipeline_degree'\] .* allowed keys"),
    ({"schedule": "fast"}, r"schedule='fast' is not one of \('auto', 's1', 's2', 'deepspeed'\)"),
    ({"overlap_chunks": 0}, r"overlap_chunks=0 must be an integer >= 1"),
    ({"overlap_chunks": 2.5}, r"overlap_chunks=2.5 must be an integer >= 1"),
    ({"enabled": "yes"}, r"enabled='yes' must be true or false"),
    ({"skip_empty_slots": 1}, r"skip_empty_slots=1 must be true or false"),
    ({"cost_cache": 3}, r"cost_cache=3 must be a file path"),
])
def test_bad_values_name_value_and_rule(section, message):
    with pytest.raises(ValueError, match=message):
        ParmConfig.from_deepspeed({"parm": section})


def test_section_must_be_an_object():
    with pytest.raises(ValueError, match='"parm" section must be a JSON object'):
        ParmConfig.from_deepspeed({"parm": ["s1"]})
