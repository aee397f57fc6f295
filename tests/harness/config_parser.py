"""Test-only SGLang general plugin ``renamed_config``: a model-config parser (``--model-config-parser
renamed``) for targets whose config only SGLang can read, renamed to ``sglang_config.json``.

Its entry point is in ``SITE``, which the suite puts on every process's ``PYTHONPATH``
(``tests/conftest.py``), so its server forks from the zygote the others use; SGLang loads it only
where ``SGLANG_PLUGINS`` names it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sglang.srt.configs.model_config_parser_registry import (
    ModelConfigParserBase,
    register_model_config_parser,
)
from transformers import AutoConfig, LlamaConfig

PLUGIN = "renamed_config"
SITE = Path(__file__).resolve().parent / "config_parser_site"
CONFIG_NAME = "sglang_config.json"


class RenamedConfigParser(ModelConfigParserBase):
    def parse(self, model, trust_remote_code, revision=None, **kwargs):
        path = os.path.join(str(model), CONFIG_NAME)
        if not os.path.exists(path):  # the draft keeps its config.json
            return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code, revision=revision)
        with open(path) as f:
            config = LlamaConfig.from_dict(json.load(f))
        config._name_or_path = str(model)
        return config


def register() -> None:
    register_model_config_parser("renamed")(RenamedConfigParser)
