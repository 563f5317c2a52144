"""vLLM's /tokenize and /detokenize, /version and OpenAI's GET /v1/models/{id}, over HTTP against an in-process
server (tests/nic/openai/local.py). Token ids and token strings are checked against transformers' tokenizer of the
same model, chat prompts against what the server's chat parser submits to the ring for the same body, and the
answers' bytes against vLLM's writer (Starlette's JSONResponse: compact UTF-8 JSON, fields in vLLM's order)."""
import json
from importlib import metadata

import pytest

import blink.version

from tests.nic.openai.local import GEOMETRY, run_local

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wie geht's? 你好"}]


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    from blink.models import default_model_path
    return AutoTokenizer.from_pretrained(default_model_path())


def vllm_bytes(content: dict) -> bytes:
    """What vLLM's server sends for ``content`` (starlette.responses.JSONResponse.render)."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


async def post(local, path: str, body: dict) -> tuple[int, bytes]:
    async with local.session.post(f"http://127.0.0.1:{local.port}{path}", json=body) as response:
        return response.status, await response.read()


def serve(local_ring, tokenizer, scenario, **options):
    run_local(local_ring, tokenizer, scenario, serve=True, **options)


@pytest.mark.parametrize("special", [True, False])
def test_tokenize_a_prompt_is_transformers_ids_and_token_strings_in_vllms_bytes(local_ring, tokenizer, hf, special):
    """The ids /v1/completions feeds the model for the same text (with BOS and the like unless
    ``add_special_tokens`` is false), each id's vocabulary entry, and ``max_model_len``."""
    prompt = "The capital of France is Paris. Ça va? 你好"

    async def scenario(local):
        status, raw = await post(local, "/tokenize", {"model": "local", "prompt": prompt, "add_special_tokens": special,
                                                      "return_token_strs": True})
        ids = hf(prompt, add_special_tokens=special)["input_ids"]
        assert status == 200
        assert raw == vllm_bytes({"count": len(ids), "max_model_len": GEOMETRY.max_model_len, "tokens": ids,
                                  "token_strs": hf.convert_ids_to_tokens(ids)})
        status, raw = await post(local, "/tokenize", {"prompt": prompt})      # no model: the served one
        assert status == 200 and json.loads(raw)["token_strs"] is None
        assert json.loads(raw)["tokens"] == hf(prompt)["input_ids"] == \
            local.server.parser.completion({"prompt": prompt}).prompt     # what /v1/completions submits

    serve(local_ring, tokenizer, scenario)


def test_tokenize_counts_a_prompt_longer_than_the_server_accepts(local_ring, tokenizer, hf):
    prompt = "word " * (2 * GEOMETRY.max_model_len)

    async def scenario(local):
        status, raw = await post(local, "/tokenize", {"prompt": prompt})
        assert status == 200 and json.loads(raw)["count"] == len(hf(prompt)["input_ids"]) > GEOMETRY.max_model_len

    serve(local_ring, tokenizer, scenario)


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_tokenize_messages_is_what_the_chat_endpoint_feeds_the_model(local_ring, tokenizer, hf, generation_prompt):
    async def scenario(local):
        body = {"messages": MESSAGES, "add_generation_prompt": generation_prompt, "max_tokens": 4}
        status, raw = await post(local, "/tokenize", body)
        assert status == 200
        tokens = json.loads(raw)["tokens"]
        assert tokens == local.server.parser.chat(body).prompt      # what /v1/chat/completions submits to the ring
        assert tokens == hf.apply_chat_template(MESSAGES, add_generation_prompt=generation_prompt, tokenize=True,
                                                return_dict=True)["input_ids"]

    serve(local_ring, tokenizer, scenario)


def test_detokenize_is_transformers_decode_special_tokens_included(local_ring, tokenizer, hf):
    ids = hf.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)["input_ids"]

    async def scenario(local):
        status, raw = await post(local, "/detokenize", {"model": "local", "tokens": ids})
        assert status == 200 and raw == vllm_bytes({"prompt": hf.decode(ids)})
        assert "<|im_start|>" in json.loads(raw)["prompt"]
        assert await post(local, "/detokenize", {"tokens": []}) == (200, vllm_bytes({"prompt": ""}))

    serve(local_ring, tokenizer, scenario)


BAD = [  # (path, body, status, param, what the message must mention)
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/tokenize", {"prompt": [1, 2]}, 400, "prompt", "'prompt' must be a string"),
    ("/tokenize", {}, 400, "prompt", "or send 'messages'"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens", "a boolean"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt", "surrogate"),
    ("/tokenize", {"messages": "hi"}, 400, "messages", "non-empty list"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message",
     "not supported"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 1 }}"}, 400, "chat_template", "not supported"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": 1}, 400, "add_generation_prompt", "a boolean"),
    ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens", "token ids in [0, 49152)"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens", "token ids in [0, 49152)"),
    ("/detokenize", {}, 400, "tokens", "'tokens' is required"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model", "does not exist"),
]


@pytest.mark.parametrize("path, body, status, param, mention", BAD)
def test_bad_tokenizer_requests_get_an_openai_error(local_ring, tokenizer, path, body, status, param, mention):
    async def scenario(local):
        got, raw = await post(local, path, body)
        error = json.loads(raw)["error"]
        assert got == status and error["param"] == param and mention in error["message"], error
        assert set(error) == {"message", "type", "param", "code"}

    serve(local_ring, tokenizer, scenario)


def test_version_is_the_installed_distributions_and_the_source_trees(local_ring, tokenizer):
    """/version answers the version written once in blink/version.py, which the installed distribution's metadata
    carries too (a run from a source tree, PYTHONPATH=src with nothing installed, raised KeyError here before)."""
    async def scenario(local):
        installed = metadata.distribution(metadata.packages_distributions()["blink"][0]).version
        assert installed == blink.version.__version__ and installed.count(".") >= 1
        assert await local.get("/version") == (200, {"version": installed})

    serve(local_ring, tokenizer, scenario)


def test_a_model_is_retrieved_by_its_id_slashes_included_and_no_other(local_ring, tokenizer):
    name = "HuggingFaceTB/SmolLM2-135M-Instruct"

    async def scenario(local):
        _, listed = await local.get("/v1/models")
        assert await local.get(f"/v1/models/{name}") == (200, listed["data"][0])
        assert listed["data"][0]["id"] == name
        status, body = await local.get("/v1/models/HuggingFaceTB/other")
        assert status == 404 and body["error"]["code"] == "model_not_found", body

    serve(local_ring, tokenizer, scenario, model_name=name)
