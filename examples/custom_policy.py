"""A custom GPU admission policy, shortest prompt first, serving a model through the public API.

The policy is a function of a waiting request's header fields that returns its sort key (plain arithmetic: it
runs on the GPU); the scheduler admits lower keys first. ``EngineConfig(policy=...)`` hands it to the engine, which
compiles it into the scheduler (on a machine without a GPU, the same device code runs under numba's CUDA simulator).
From the command line, ``blink serve --policy examples.custom_policy:shortest_prompt_first`` does the same (run from
the repository root).

    python examples/custom_policy.py

The script lets one request occupy the only running sequence, submits prompts of different lengths meanwhile, and
checks that they finish (one at a time, so in admission order) shortest first.
"""
import asyncio

from blink import AsyncEngine, EngineConfig, SamplingParams, SchedulerConfig


def shortest_prompt_first(arrival_ns, prompt_len, max_tokens, priority, request_id):
    return prompt_len


async def main() -> None:
    config = EngineConfig(device="cpu", policy=shortest_prompt_first, n_slots=8,
                          scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64))
    async with await AsyncEngine.start(config) as engine:
        first = engine.stream([1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        await anext(first)                  # it runs now; the others wait in the scheduler's queue
        lengths = [9, 2, 30, 5, 17]
        finished = []

        async def run(n: int) -> None:
            await engine.generate(list(range(1, n + 1)), SamplingParams(max_tokens=1, temperature=0))
            finished.append(n)

        await asyncio.gather(first.result(), *(run(n) for n in lengths))
    print("finished in this order (prompt lengths):", finished)
    assert finished == sorted(lengths), finished
    print("OK: shortest prompt first")


if __name__ == "__main__":
    asyncio.run(main())
