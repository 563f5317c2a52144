"""Fixtures of the model tests."""
import pytest

from harness import tiny_hf_model


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: save a tiny HF model for ``arch`` to a fresh directory; returns (hf model, directory)."""

    def make(arch: str, **overrides):
        model = tiny_hf_model(arch, **overrides)
        path = tmp_path / arch
        model.save_pretrained(path)
        return model, path

    return make
