"""A custom GPU admission policy: shortest prompt first.

The policy is a numba CUDA device function that turns a waiting request's header fields into a sort key; the
scheduler admits lower keys first. Here it runs in the CPU simulator (the same device code the GPU image links);
on a GPU pass the same function to ``GpuScheduler(..., policy=shortest_prompt_first)``.

    python examples/custom_policy.py

The script submits requests of different prompt lengths while one sequence occupies the only running slot, then
checks that the scheduler admitted the rest in the order a host-side sort by (prompt length, slot) predicts.
"""
import os

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")   # before numba is imported: run the device code on the CPU

from numba import int64  # noqa: E402

from blink.config import SamplingParams, SchedulerConfig  # noqa: E402
from blink.device.numba_compat import cuda  # noqa: E402
from blink.device.ring import RUNNING, RingGeometry, RingLayout  # noqa: E402
from blink.device.sim import SimScheduler  # noqa: E402
from blink.device.step import StepBuffers, StepLayout  # noqa: E402
from blink.nic.agent import Agent  # noqa: E402
from blink.nic.transport import LocalMemory  # noqa: E402


@cuda.jit(device=True)
def shortest_prompt_first(arrival_ns, prompt_len, max_tokens, priority, request_id):
    return int64(prompt_len)


def main() -> None:
    geometry = RingGeometry(n_slots=8, max_prompt_tokens=32, max_output_tokens=4)
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=32, page_size=4, num_pages=16, max_model_len=36,
                             buckets=(1, 2, 4, 8, 16, 32))
    layout = RingLayout(geometry)
    memory = LocalMemory(layout.size)
    memory.write(0, layout.control_bytes())
    view = layout.view(memory.buffer)
    step = StepBuffers(StepLayout(config.buckets[-1], config.max_num_seqs, config.max_pages_per_seq))
    scheduler = SimScheduler(view, geometry, config, step, policy=shortest_prompt_first, threads=2)
    agent = Agent(memory, geometry)

    agent.submit([1, 2, 3], SamplingParams(max_tokens=4, seed=0))     # takes the only running slot
    scheduler.iteration()
    lengths = [9, 2, 30, 5, 5, 17]
    slots = {agent._slot_of[agent.submit(list(range(n)), SamplingParams(max_tokens=1, seed=0))]: n for n in lengths}
    expected = sorted(slots, key=lambda slot: (slots[slot], slot))

    admitted = []
    while agent.in_flight:
        scheduler.iteration()
        admitted += [slot for slot in slots if view.status["state"][slot] == RUNNING and slot not in admitted]
        agent.poll()
    print("admission order (prompt lengths):", [slots[s] for s in admitted])
    assert admitted == expected, (admitted, expected)
    print("OK: shortest prompt first")


if __name__ == "__main__":
    main()
