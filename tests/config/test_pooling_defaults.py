"""A model folder's pooling (`folder_pooling_defaults`): sentence-transformers' modules.json and Pooling config, read
as `PoolingDefaults`; what pagedjax cannot compute is refused with the reason, a file that is not JSON is an
error naming it."""

from __future__ import annotations

import json
import re

import pytest

from pagedjax.config.pooling import PoolingDefaults
from pagedjax.model.loading.pooling_config import folder_pooling_defaults

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
DENSE = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
FLAGS = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
         "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")


def folder(tmp_path, modules, pooling: dict | None):
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def flags(on: str, **extra) -> dict:
    return {"word_embedding_dimension": 64, **{f: f == on for f in FLAGS}, **extra}


@pytest.mark.parametrize("flag, pooling", [("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                                           ("pooling_mode_cls_token", "cls")])
def test_each_mode_with_and_without_normalize(tmp_path, flag, pooling):
    d = folder_pooling_defaults(folder(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], flags(flag, include_prompt=True)))
    assert (d.pooling, d.normalize, d.refused) == (pooling, True, None)
    assert d.source.endswith("modules.json") and d.describe().endswith(f"normalized ({d.source})")
    (tmp_path / "modules.json").write_text(json.dumps([TRANSFORMER, POOLING]))
    assert folder_pooling_defaults(tmp_path).normalize is False


def test_newer_pooling_mode_strings_and_no_folder_files(tmp_path):
    assert folder_pooling_defaults(folder(tmp_path, [TRANSFORMER, POOLING], {"pooling_mode": "lasttoken"})).pooling \
        == "last"
    assert folder_pooling_defaults(tmp_path / "1_Pooling") == PoolingDefaults()  # no modules.json: last, normalized


@pytest.mark.parametrize("modules, pooling, why", [
    ([TRANSFORMER, POOLING, DENSE, NORMALIZE], flags("pooling_mode_mean_tokens"), r"\['Dense'\] after the Transformer"),
    ([TRANSFORMER, POOLING], flags("pooling_mode_max_tokens"), r"pooling \['pooling_mode_max_tokens'\]"),
    ([TRANSFORMER, POOLING], {**flags("pooling_mode_cls_token"), "pooling_mode_mean_tokens": True}, "pooling"),
    ([TRANSFORMER, POOLING], flags("pooling_mode_mean_tokens", include_prompt=False), "include_prompt false"),
    ([POOLING], flags("pooling_mode_cls_token"), "not a Transformer, one Pooling"),
])
def test_what_pagedjax_cannot_compute_is_refused_with_the_reason(tmp_path, modules, pooling, why):
    d = folder_pooling_defaults(folder(tmp_path, modules, pooling))
    assert d.refused is not None and d.describe().startswith("refused")
    assert re.search(why, d.refused), d.refused


def test_files_of_the_wrong_shape_are_errors_naming_them(tmp_path):
    (tmp_path / "modules.json").write_text("{not json")
    with pytest.raises(ValueError, match="modules.json: not a readable JSON file"):
        folder_pooling_defaults(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps({"0": TRANSFORMER}))
    with pytest.raises(ValueError, match="must hold a list of module objects"):
        folder_pooling_defaults(tmp_path)
    folder(tmp_path, [TRANSFORMER, POOLING], None)
    with pytest.raises(ValueError, match="the Pooling module's config must be a JSON object"):
        folder_pooling_defaults(tmp_path)
    with pytest.raises(ValueError, match="PoolingDefaults.pooling 'max' is not supported"):
        PoolingDefaults(pooling="max")
    with pytest.raises(TypeError, match="PoolingDefaults.normalize must be true or false"):
        PoolingDefaults(normalize="yes")
