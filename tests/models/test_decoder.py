"""Every family's step against HF transformers on tiny random checkpoints: prefill, chunked prefill and decode mixed
in one padded step, with shuffled page placement."""
import pytest
import torch

from blink.models import load_model

from harness import Runner, check_mixed_batches, hf_logits

FAMILIES = ["LlamaForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_mixed_batches_match_transformers(arch, hf_checkpoint):
    hf_model, path = hf_checkpoint(arch)
    check_mixed_batches(load_model(path, dtype=torch.float32), hf_model)


@pytest.mark.parametrize("arch", FAMILIES)
def test_tied_embeddings(arch, hf_checkpoint):
    hf_model, path = hf_checkpoint(arch, tie_word_embeddings=True)
    model = load_model(path, dtype=torch.float32)
    assert model.lm_head_weight() is model.model.embed_tokens.weight
    check_mixed_batches(model, hf_model, seed=1)


def test_rows_that_sample_nothing_keep_their_outputs(hf_checkpoint):
    _, path = hf_checkpoint("LlamaForCausalLM")
    runner = Runner(load_model(path, dtype=torch.float32))
    runner.buf.sampled_ids.fill_(-7)
    _, ids, _ = runner.step([runner.chunk(0, [1, 2, 3], 0, sample=False), runner.chunk(1, [4, 5], 0)])
    assert ids[0] == -7 and ids[1] != -7


def test_bf16_step_tracks_float32(hf_checkpoint):
    hf_model, path = hf_checkpoint("Qwen3ForCausalLM")
    runner = Runner(load_model(path, dtype=torch.bfloat16))
    logits, _, _ = runner.step([runner.chunk(0, list(range(1, 12)), 0)])
    want = hf_logits(hf_model, list(range(1, 12)))[-1]
    assert (logits[0] - want).norm() / want.norm() < 2e-2


def _device_launch(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream):
    """Re-instantiate a captured graph for device launch (as the scheduler will), upload it, launch it once."""
    from cuda.bindings import runtime as rt

    def ok(result):
        assert int(result[0]) == 0, result[0]
        return result[1] if len(result) > 1 else None

    flag = rt.cudaGraphInstantiateFlags.cudaGraphInstantiateFlagDeviceLaunch
    exec_ = ok(rt.cudaGraphInstantiateWithFlags(rt.cudaGraph_t(init_value=graph.raw_cuda_graph()), flag))
    rs = rt.cudaStream_t(init_value=stream.cuda_stream)
    ok(rt.cudaGraphUpload(exec_, rs))
    return lambda: ok(rt.cudaGraphLaunch(exec_, rs))


@pytest.mark.gpu
def test_step_graph_captures_and_device_launch_instantiation_replays_bit_identically():
    from blink.device.step import StepBuffers, StepLayout
    from blink.models import ModelConfig, random_model
    from blink.models.batch import fill_step

    config = ModelConfig("Qwen3ForCausalLM", vocab_size=5000, hidden_size=256, intermediate_size=512, num_layers=3,
                         num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                         rotary_dim=64, max_position_embeddings=4096)
    model = random_model(config, "cuda")
    runner = Runner(model, num_pages=256, layout=StepLayout(64, 16, 128))
    bucket = 48

    def batch(seed):
        g = torch.Generator().manual_seed(seed)
        rand = lambda n: torch.randint(0, 5000, (n,), generator=g).tolist()  # noqa: E731
        return [runner.chunk(0, rand(20), 0), runner.chunk(1, rand(1), 300, temperature=0.7, top_p=0.9, seed=5),
                runner.chunk(2 + seed, rand(9), 0, sample=False), runner.chunk(9, rand(1), 37, temperature=1.0,
                                                                              top_k=20, seed=seed)]

    def eager(chunks):
        fill_step(runner.buf, chunks, 4)
        runner.buf.sampled_ids.fill_(-1)
        logits = model(runner.buf, runner.kv, bucket).clone()
        return logits, runner.buf.sampled_ids.clone(), runner.buf.sampled_logprobs.clone()

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        first = eager(batch(0))  # also compiles the kernels
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, stream=stream):
            static_logits = model(runner.buf, runner.kv, bucket)
    launch = _device_launch(graph, stream)
    for seed, want in ((0, first), (1, None)):
        with torch.cuda.stream(stream):
            want = want or eager(batch(seed))
            fill_step(runner.buf, batch(seed), 4)
            runner.buf.sampled_ids.fill_(-1)
            launch()
        stream.synchronize()
        assert torch.equal(static_logits, want[0])
        assert torch.equal(runner.buf.sampled_ids, want[1]) and torch.equal(runner.buf.sampled_logprobs, want[2])
