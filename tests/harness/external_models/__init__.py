"""Model classes for ``SGLANG_EXTERNAL_MODEL_PACKAGE=tests.harness.external_models`` (SGLang's own
way to add architectures from a package): drafts the plugin must refuse (tests/test_refusals.py)."""
