"""Fixtures of the model tests."""
import pytest
import torch

from tests.models.harness import tiny_hf_model


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: save a tiny HF model for ``arch`` to a fresh directory; returns (hf model, directory)."""

    def make(arch: str, **overrides):
        model = tiny_hf_model(arch, **overrides)
        path = tmp_path / arch
        model.save_pretrained(path)
        return model, path

    return make


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The default model converted into a fresh cache directory (exercises the first-use conversion)."""
    import os

    from blink.models import default_model_path

    old = os.environ.get("BLINK_CACHE_DIR")
    os.environ["BLINK_CACHE_DIR"] = str(tmp_path_factory.mktemp("blink-cache"))
    try:
        yield default_model_path()
    finally:
        if old is None:
            del os.environ["BLINK_CACHE_DIR"]
        else:
            os.environ["BLINK_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def smollm2_gguf():
    from blink.models.default import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """transformers' own float32 load of the GGUF file: the independent reference for conversion and model."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
