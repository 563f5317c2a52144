"""Fixtures of the agent's tests: transformers' tokenizer of the embedded model, the reference of blink's."""
import pytest


@pytest.fixture(scope="session")
def hf():
    from transformers import AutoTokenizer

    from blink.models import default_model_path
    return AutoTokenizer.from_pretrained(default_model_path())
